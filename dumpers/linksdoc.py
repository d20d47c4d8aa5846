"""The ``links`` section of a dump (format version 7): the interfaces the
link ring names (``dumpers.model.LinkInfo``) as msgpack, and their
validating reader.

Layout, every key required, no other allowed; ``null`` is unknown::

    "links": [{"id": u32, "name": str, "kind": "netdev" | "rdma",
               "device": str | null, "port": u32 | null, "ifindex": i32 | null,
               "netdev": str | null, "link_type": str | null, "link_layer": str | null,
               "addresses": [str], "mtu": u32 | null, "speed_mbps": u32 | null,
               "pids": [u32], "first_ns": u64, "gone_ns": u64}, ...]

Ids are unique within a dump: a ``link_event`` row names its interface by it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .model import LinkInfo
from .readingsdoc import I32, U32, U64

if TYPE_CHECKING:
    from .format import _Checker

KINDS = ("netdev", "rdma")
_KEYS = tuple(LinkInfo.__dataclass_fields__)


def links_doc(links: tuple[LinkInfo, ...]) -> list[dict[str, object]]:
    return [
        {
            "id": li.id,
            "name": li.name,
            "kind": li.kind,
            "device": li.device,
            "port": li.port,
            "ifindex": li.ifindex,
            "netdev": li.netdev,
            "link_type": li.link_type,
            "link_layer": li.link_layer,
            "addresses": list(li.addresses),
            "mtu": li.mtu,
            "speed_mbps": li.speed_mbps,
            "pids": list(li.pids),
            "first_ns": li.first_ns,
            "gone_ns": li.gone_ns,
        }
        for li in links
    ]


def read_links(obj: object, c: _Checker) -> tuple[LinkInfo, ...]:
    out = tuple(_read_link(x, f"links[{i}]", c) for i, x in enumerate(c.array(obj, "links")))
    seen: set[int] = set()
    for i, li in enumerate(out):
        if li.id in seen:
            c.fail(f"links[{i}].id", f"id {li.id} names two interfaces")
        seen.add(li.id)
    return out


def _opt_str(obj: object, path: str, c: _Checker) -> str | None:
    return None if obj is None else c.string(obj, path)


def _read_link(obj: object, path: str, c: _Checker) -> LinkInfo:
    m = c.map(obj, path, _KEYS)
    kind = c.string(m["kind"], f"{path}.kind")
    if kind not in KINDS:
        c.fail(f"{path}.kind", f"expected one of {', '.join(KINDS)}, found {kind[:40]!r}")
    pids = c.array(m["pids"], f"{path}.pids")
    return LinkInfo(
        id=c.integer(m["id"], f"{path}.id", U32),
        name=c.string(m["name"], f"{path}.name"),
        kind=kind,
        device=_opt_str(m["device"], f"{path}.device", c),
        port=c.opt_int(m["port"], f"{path}.port", U32),
        ifindex=c.opt_int(m["ifindex"], f"{path}.ifindex", I32),
        netdev=_opt_str(m["netdev"], f"{path}.netdev", c),
        link_type=_opt_str(m["link_type"], f"{path}.link_type", c),
        link_layer=_opt_str(m["link_layer"], f"{path}.link_layer", c),
        addresses=c.strings(m["addresses"], f"{path}.addresses"),
        mtu=c.opt_int(m["mtu"], f"{path}.mtu", U32),
        speed_mbps=c.opt_int(m["speed_mbps"], f"{path}.speed_mbps", U32),
        pids=tuple(c.integer(p, f"{path}.pids[{i}]", U32) for i, p in enumerate(pids)),
        first_ns=c.integer(m["first_ns"], f"{path}.first_ns", U64),
        gone_ns=c.integer(m["gone_ns"], f"{path}.gone_ns", U64),
    )

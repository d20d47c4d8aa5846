"""The agents' network evidence as incident tables: the probes between the
job's nodes at the incident (``probes`` ring), each job connection's state
sampled every second (``conn_samples``) and each job interface's counters
(``iface_samples``), every address read as the host it belongs to and every
time as wall clock.

An address is a host's when it is one of the addresses of the links its
ranks use, or the address its own connections leave from (``owner``, as the
TCP table reads them: ``align``).  A value the agent could not read (all
ones in its width in the ring) is -1 here; rows of a dump whose clock is
unknown keep their host's own time (offset 0) and are compared only within
that host.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from stallwatch.dumpers import addresses
from stallwatch.dumpers.layout import IFACE_NETDEV, UNKNOWN_U8, UNKNOWN_U32, UNKNOWN_U64
from stallwatch.dumpers.model import Recording

from .incident import CONN_SAMPLE_DTYPE, IFACE_DTYPE, PROBE_DTYPE

_UNKNOWN = {1: UNKNOWN_U8, 4: UNKNOWN_U32, 8: UNKNOWN_U64}


def _known(values: np.ndarray) -> np.ndarray:
    """The ring's values as signed 64-bit, unknown (all ones) as -1."""
    out = values.astype(np.int64)
    out[values == values.dtype.type(_UNKNOWN[values.dtype.itemsize])] = -1
    return out


def _offset(rec: Recording) -> int:
    return rec.clock.realtime_ns - rec.clock.monotonic_ns if rec.clock.realtime_ns else 0


def _end_keys(addrs: np.ndarray, ports: np.ndarray) -> np.ndarray:
    """One 64-bit key per (address, port): multiply-xor mixing."""
    words = np.ascontiguousarray(addrs).view("<u8").reshape(-1, 2)
    with np.errstate(over="ignore"):
        key = words[:, 0] * np.uint64(0x9E3779B97F4A7C15)
        key ^= (words[:, 1] + np.uint64(0xBF58476D1CE4E5B9)) * np.uint64(0x94D049BB133111EB)
        key ^= ports.astype(np.uint64) * np.uint64(0xD6E8FEB86659FD93)
    return key


def connection_keys(rows: np.ndarray) -> np.ndarray:
    """One key per connection, the same from both of its ends (the two
    ends' keys in order, mixed): of TCP event rows and connection samples."""
    a, b = _end_keys(rows["saddr"], rows["sport"]), _end_keys(rows["daddr"], rows["dport"])
    lo, hi = np.minimum(a, b), np.maximum(a, b)
    with np.errstate(over="ignore"):
        out: np.ndarray = lo * np.uint64(0xBF58476D1CE4E5B9) ^ hi
    return out


def owner_of(addrs: np.ndarray, owner: dict[bytes, int]) -> np.ndarray:
    """The host each 16-byte address is the own address of, -1 for none
    (each distinct address looked up once)."""
    if not len(addrs):
        return np.zeros(0, dtype=np.int64)
    distinct, which = addresses.distinct(addrs)
    hosts = np.array([owner.get(a.tobytes(), -1) for a in distinct], dtype=np.int64)
    out: np.ndarray = hosts[which]
    return out


def _rings(
    recordings: Sequence[Recording], hosts: tuple[str, ...], name: str
) -> Iterator[tuple[np.ndarray, int, int]]:
    """Each dump's rows of ring ``name`` (none: skipped), its host's index
    in ``hosts`` and what makes its timestamps wall clock."""
    host_of = {h: i for i, h in enumerate(hosts)}
    for rec in recordings:
        ring = rec.rings.get(name)
        if ring is not None and len(ring.rows):
            yield ring.rows, host_of[rec.host], _offset(rec)


def probe_rows(
    recordings: Sequence[Recording], hosts: tuple[str, ...], owner: dict[bytes, int]
) -> tuple[np.ndarray, tuple[str, ...]]:
    """Every dump's probe rows: who probed whom, how, and what came of it;
    and the addresses they name that no dump's host owns (a host without a
    dump here), as hosts after ``hosts``: the first is ``len(hosts)``."""
    parts = []
    owner = dict(owner)
    unreached: list[str] = []
    for r, host, offset in _rings(recordings, hosts, "probes"):
        t = np.zeros(len(r), dtype=PROBE_DTYPE)
        t["host"] = host
        t["wall"] = r["ts_ns"].astype(np.int64) + offset
        addrs = np.concatenate([r["saddr"], r["daddr"]])
        fams = np.concatenate([r["family"], r["family"]])
        keep = ~addresses.is_loopback(addrs, fams) & addresses.as_rows(addrs).any(axis=1)
        addrs, fams = addrs[keep], fams[keep]
        distinct, which = addresses.distinct(addrs)
        fam_of = np.zeros(len(distinct), dtype=fams.dtype)
        fam_of[which] = fams
        for raw, fam in zip(distinct, fam_of.tolist(), strict=True):
            key = raw.tobytes()
            if key not in owner:
                owner[key] = len(hosts) + len(unreached)
                unreached.append(addresses.format_address(fam, key))
        t["src"], t["dst"] = owner_of(r["saddr"], owner), owner_of(r["daddr"], owner)
        for name in ("probe", "role", "outcome"):
            t["kind" if name == "probe" else name] = r[name]
        t["size"], t["sent"], t["answered"] = r["probe_size"], r["sent"], r["answered"]
        t["rtt_us"], t["throughput_bps"] = _known(r["rtt_us"]), _known(r["throughput_bps"])
        t["round"] = r["round"]
        parts.append(t)
    rows = np.concatenate(parts) if parts else np.zeros(0, dtype=PROBE_DTYPE)
    return rows, tuple(unreached)


# conn_sample's fields kept, as the table names them
_CONN_FIELDS = (
    ("srtt_us", "srtt_us"), ("rttvar_us", "rttvar_us"), ("min_rtt_us", "min_rtt_us"),
    ("rto_us", "rto_us"), ("delivery_rate", "delivery_rate"), ("bytes_acked", "bytes_acked"),
    ("bytes_received", "bytes_received"), ("bytes_sent", "bytes_sent"),
    ("bytes_retrans", "bytes_retrans"), ("total_retrans", "total_retrans"), ("lost", "lost"),
    ("unacked", "unacked"), ("notsent", "notsent_bytes"), ("busy_us", "busy_time_us"),
    ("rwnd_limited_us", "rwnd_limited_us"), ("sndbuf_limited_us", "sndbuf_limited_us"),
    ("last_ack_ms", "last_ack_recv_ms"), ("last_sent_ms", "last_data_sent_ms"),
    ("last_recv_ms", "last_data_recv_ms"), ("backoff", "backoff"), ("ca_state", "ca_state"),
    ("app_limited", "delivery_rate_app_limited"),
)  # fmt: skip


def conn_rows(
    recordings: Sequence[Recording], hosts: tuple[str, ...], owner: dict[bytes, int]
) -> np.ndarray:
    """Every dump's samples of connections between two hosts' own addresses
    (never loopback, never both ends on one host), sorted by connection end
    and time."""
    parts = []
    for r, host, offset in _rings(recordings, hosts, "conn_samples"):
        fam = r["family"]
        keep = ~addresses.is_loopback(r["saddr"], fam) & ~addresses.is_loopback(r["daddr"], fam)
        r = r[keep]
        local, remote = owner_of(r["saddr"], owner), owner_of(r["daddr"], owner)
        keep = (local >= 0) & (remote >= 0) & (local != remote)
        r, local, remote = r[keep], local[keep], remote[keep]
        t = np.zeros(len(r), dtype=CONN_SAMPLE_DTYPE)
        t["host"] = host
        t["wall"] = r["ts_ns"].astype(np.int64) + offset
        t["local"], t["remote"], t["pid"], t["state"] = local, remote, r["pid"], r["state"]
        t["conn"] = connection_keys(r)
        for name, field in _CONN_FIELDS:
            t[name] = _known(r[field])
        parts.append(t)
    if not parts:
        return np.zeros(0, dtype=CONN_SAMPLE_DTYPE)
    out = np.concatenate(parts)
    return out[np.lexsort((out["wall"], out["local"], out["conn"]))]


_IFACE_FIELDS = (*IFACE_NETDEV, "qdisc_drops", "qdisc_overlimits", "qdisc_backlog_bytes",
                 "qdisc_backlog_packets", "qdisc_bytes")  # fmt: skip


def iface_rows(recordings: Sequence[Recording], hosts: tuple[str, ...]) -> np.ndarray:
    """Every dump's samples of the job's interfaces, sorted by host, interface
    and time."""
    parts = []
    for r, host, offset in _rings(recordings, hosts, "iface_samples"):
        t = np.zeros(len(r), dtype=IFACE_DTYPE)
        t["host"] = host
        t["wall"] = r["ts_ns"].astype(np.int64) + offset
        t["ifindex"], t["mtu"] = r["ifindex"], _known(r["mtu"])
        t["name"] = [bytes(n).rstrip(b"\0").decode(errors="replace") for n in r["name"]]
        for name in _IFACE_FIELDS:
            t[name] = _known(r[name])
        parts.append(t)
    if not parts:
        return np.zeros(0, dtype=IFACE_DTYPE)
    out = np.concatenate(parts)
    return out[np.lexsort((out["wall"], out["ifindex"], out["host"]))]

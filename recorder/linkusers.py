"""Which interfaces a process uses, read from outside it:

- the local addresses of its TCP connections: its socket inodes
  (``/proc/<pid>/fd/* -> socket:[inode]``) found in its network namespace's
  ``/proc/<pid>/net/tcp`` and ``tcp6`` (listening sockets and wildcard
  addresses say nothing of a link); the interface holding such an address
  carries the connection;
- the RDMA devices it has open: ``/proc/<pid>/fd/* -> /dev/infiniband/uverbsN``,
  and ``<verbs root>/uverbsN/ibdev`` names the device.

One pass over the process's descriptors gives both.  ``proc_root`` is the
seam the tests use (a folder of fake ``fd`` links).

Known limits: a connection is placed by its local address, so a process of
another network namespace (a host-scope agent beside containerized ranks)
maps to none of the agent's netdevs; UDP and raw sockets are not looked at;
an RDMA device maps to every one of its ports (which port a queue pair uses
is not visible from outside).
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from .rdma import verbs_device

PROC = Path("/proc")
UVERBS = "/dev/infiniband/uverbs"
TCP_LISTEN = "0A"


@dataclass(frozen=True, slots=True)
class Usage:
    addresses: frozenset[str]  # local addresses of its TCP connections, as ip_address text
    rdma_devices: frozenset[str]


def usage(pid: int, proc_root: Path = PROC, verbs_root: Path | None = None) -> Usage | None:
    """What ``pid`` uses now; None if it cannot be read (gone, no permission)."""
    from .rdma import DEFAULT_VERBS_ROOT

    fd_dir = proc_root / str(pid) / "fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return None
    inodes: set[int] = set()
    uverbs: set[str] = set()
    for name in names:
        try:
            target = os.readlink(fd_dir / name)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
        elif target.startswith(UVERBS):
            uverbs.add(target.rsplit("/", 1)[1])
    root = verbs_root or DEFAULT_VERBS_ROOT
    devices = {d for u in uverbs if (d := verbs_device(root, u)) is not None}
    addresses = _tcp_addresses(proc_root / str(pid) / "net", inodes) if inodes else set()
    return Usage(frozenset(addresses), frozenset(devices))


def _tcp_addresses(net: Path, inodes: set[int]) -> set[str]:
    out: set[str] = set()
    for name, width in (("tcp", 8), ("tcp6", 32)):
        try:
            with open(net / name, "rb") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or int(fields[9]) not in inodes or fields[3] == TCP_LISTEN.encode():
                continue
            address = decode_address(fields[1].split(b":")[0].decode(), width)
            if address is not None:
                out.add(address)
    return out


def decode_address(hex_text: str, width: int) -> str | None:
    """An address as /proc/net/tcp{,6} prints it (32-bit words in host
    order, hex) as text; None for a wildcard or malformed one."""
    if len(hex_text) != width:
        return None
    try:
        raw = b"".join(
            int(hex_text[i : i + 8], 16).to_bytes(4, "little") for i in range(0, width, 8)
        )
    except ValueError:
        return None
    addr = ipaddress.ip_address(raw)
    if addr.is_unspecified:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return str(addr.ipv4_mapped)  # an IPv4 connection on an IPv6 socket
    return str(addr)

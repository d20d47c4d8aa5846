"""Which interfaces a process uses, read from outside it, in one pass over
its descriptors (``/proc/<pid>/fd``):

- its sockets (``socket:[inode]``): those the agent's namespace has as TCP
  sockets carrying traffic (``Rtnl.tcp_local_addresses``, one sock_diag
  dump per round for every process) give their local addresses, and the
  interface holding such an address carries the connection;
- the RDMA devices it has open (``/dev/infiniband/uverbsN``;
  ``<verbs root>/uverbsN/ibdev`` names the device).

``proc_root`` is the seam the tests use (a folder of fake ``fd`` links).

Known limits: a connection is placed by its local address, and the sockets
looked at are the agent's namespace's: a process of another network
namespace (a host-scope agent beside containerized ranks) maps to none of
the agent's netdevs; UDP and raw sockets are not looked at; an RDMA device
maps to every one of its ports (which port a queue pair uses is not visible
from outside).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .rdma import verbs_device

PROC = Path("/proc")
UVERBS = "/dev/infiniband/uverbs"


@dataclass(frozen=True, slots=True)
class Usage:
    addresses: frozenset[str]  # local addresses of its TCP connections, as text
    rdma_devices: frozenset[str]


def usage(
    pid: int,
    tcp: Callable[[], dict[int, str]],
    proc_root: Path = PROC,
    verbs_root: Path | None = None,
) -> Usage | None:
    """What ``pid`` uses now; None if it cannot be read (gone, no
    permission).  ``tcp`` gives the namespace's TCP sockets (inode -> local
    address), asked only if the process holds a socket."""
    from .rdma import DEFAULT_VERBS_ROOT

    fd_dir = f"{proc_root}/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return None
    inodes: list[int] = []
    uverbs: set[str] = set()
    for name in names:
        try:
            target = os.readlink(f"{fd_dir}/{name}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.append(int(target[8:-1]))
        elif target.startswith(UVERBS):
            uverbs.add(target.rsplit("/", 1)[1])
    root = verbs_root or DEFAULT_VERBS_ROOT
    devices = {d for u in uverbs if (d := verbs_device(root, u)) is not None}
    table = tcp() if inodes else {}
    addresses = {table[i] for i in inodes if i in table}
    return Usage(frozenset(addresses), frozenset(devices))

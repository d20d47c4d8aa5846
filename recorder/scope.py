"""Which processes and TCP rows an agent keeps: its scope.

Scope ``host`` keeps every process that maps libnccl.  Scope ``netns`` keeps
only the processes of the agent's network namespace (others are excluded in
the kernel, and their rows recorded before they were classified are dropped
from snapshots and from the watchdog's input; a pid gone before it could be
classified is dropped too, as it may be another node's) and the TCP events of
sockets whose own (source) address belongs to this namespace, or, for
loopback and unbound sockets, whose owner is in scope: a connection between
two nodes shows in each node's dump through that node's end only.

Either scope can be narrowed to one job (``record --job ID``): only the
processes whose launcher job id (``TORCHELASTIC_RUN_ID`` or ``SLURM_JOB_ID``
in their environment) is ID are kept, as on a node that two jobs share.  The
other processes are excluded as out-of-namespace ones are; a pid gone before
its job could be read is dropped; in host scope every TCP row stays, a
socket owned by another job's process unattributed (pid 0).

Known limit: the TCP filter knows this namespace's addresses as they were at
most ``ADDRESS_REFRESH_S`` ago.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from collections.abc import Callable

import numpy as np

from stallwatch.dumpers import addresses
from stallwatch.dumpers.readings import JOB_ID_ENV

from . import discovery
from .threadreader import job_env

ADDRESS_REFRESH_S = 5.0
HOST, NETNS = "host", "netns"


def local_addresses() -> set[bytes]:
    """Addresses of this network namespace as 16-byte tcp_event fields.
    Loopback addresses exist in every namespace and say nothing: left out."""
    import psutil

    out: set[bytes] = set()
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                ip = ipaddress.ip_address(a.address.split("%")[0])
            except ValueError:
                continue
            if not ip.is_loopback:
                out.add(addresses.pack(ip))
    return out


class Scope:
    """The processes in scope and out of it, and the row filters they make.

    ``place`` decides a process once (``None``: it is gone); ``keep_pid``
    decides a pid seen in a row, placing it first if it is new."""

    def __init__(
        self,
        kind: str,
        place: Callable[[int], bool | None],
        netns: int | None = None,
        job: str | None = None,
    ) -> None:
        self.kind = kind
        self.job = job
        self.inside: set[int] = set()
        self.outside: set[int] = set()
        self.netns = netns if netns is not None else discovery.netns_of(os.getpid())
        self._place = place
        self.addresses: set[bytes] = set()
        self.addresses_at = 0.0

    @property
    def filters(self) -> bool:
        return self.kind == NETNS or self.job is not None

    def admits(self, netns: int, pid: int) -> bool:
        if self.kind == NETNS and netns != self.netns:
            return False
        return self.job is None or job_of(pid) == self.job

    def placed(self, pid: int) -> bool | None:
        if pid in self.inside:
            return True
        if pid in self.outside:
            return False
        return None

    def record(self, pid: int, inside: bool) -> None:
        (self.inside if inside else self.outside).add(pid)

    def keep_pid(self, pid: int) -> bool:
        """In scope.  A process gone before discovery placed it has no
        namespace left to check: the host scope keeps it, ``netns`` cannot
        tell whose it was and drops it (it may be another node's rank)."""
        known = self.placed(pid)
        if known is not None:
            return known
        if self._place(pid):
            return True
        unplaceable = self.kind == NETNS or self.job is not None
        return not unplaceable and not os.path.exists(f"/proc/{pid}")

    def pid_mask(self, pids: np.ndarray) -> np.ndarray:
        unique = np.unique(pids)
        drop = [int(p) for p in unique if not self.keep_pid(int(p))]
        if not drop:
            return np.ones(len(pids), bool)
        mask: np.ndarray = ~np.isin(pids, np.array(drop, dtype=pids.dtype))
        return mask

    def rows(self, rows: np.ndarray) -> np.ndarray:
        """The rows of processes in scope."""
        return rows[self.pid_mask(rows["pid"])] if len(rows) else rows

    def pids(self, dtype: np.dtype) -> np.ndarray:
        return np.array(sorted(self.inside), dtype=dtype)

    def tcp_mask(self, rows: np.ndarray) -> np.ndarray:
        """A row belongs here when the socket's own (source) address is one
        of this namespace's; a loopback or unbound socket, whose address
        every namespace has, when its owner is in scope."""
        now = time.monotonic()
        if now - self.addresses_at > ADDRESS_REFRESH_S:
            self.addresses = local_addresses()
            self.addresses_at = now
        saddr = addresses.ipv4_unmapped(rows["saddr"])
        local = np.array([list(a) for a in self.addresses] or [[0] * 16], dtype=np.uint8)
        is_local = (saddr[:, None, :] == local[None, :, :]).all(axis=2).any(axis=1)
        owned = np.isin(rows["pid"], self.pids(rows["pid"].dtype))
        mask: np.ndarray = np.where(addresses.is_shared(saddr), owned, is_local)
        return mask

    def ring_filter(self, name: str) -> Callable[[np.ndarray], np.ndarray] | None:
        """What a copy of ring ``name`` keeps (None: everything)."""
        if not self.filters:
            return None
        if name == "tcp":  # host scope: every row (``unattribute_foreign`` after)
            return self.tcp_mask if self.kind == NETNS else None
        return lambda rows: self.pid_mask(rows["pid"])

    def unattribute_foreign(self, tcp_rows: np.ndarray) -> None:
        """A socket of this node owned by a process out of scope (or not yet
        placed) stays, unattributed (pid 0)."""
        pids = tcp_rows["pid"]
        pids[~np.isin(pids, self.pids(pids.dtype))] = 0


def job_of(pid: int) -> str | None:
    """The launcher's job id in a process's environment (None: none, or gone)."""
    env = dict(job_env(pid))
    return next((env[name] for name in JOB_ID_ENV if env.get(name)), None)

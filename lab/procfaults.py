"""Faults the runner acts out on the ranks' own processes from outside them:
``throttle`` (the rank's process in a cgroup with a CPU quota, as a
container's ``cpu.max`` or a noisy co-tenant's share would cap it) and
``stop`` (SIGSTOP, then SIGCONT ``ms`` later: a process frozen by a
debugger, a cgroup freezer or the kernel swapping it out, then going on).

Each rank is one process (``nsenter`` execs it: the pid the runner holds is
the rank's), so a signal or a cgroup move reaches every one of its threads.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field

from stallwatch.dumpers.errors import LabError
from stallwatch.lab import faults as F
from stallwatch.lab.supervise import Cgroup


@dataclass
class RankActs:
    """The throttles and stops of one run, on its ranks' processes."""

    run_id: str
    ranks: Mapping[int, subprocess.Popen[bytes]]
    cgroups: list[Cgroup] = field(default_factory=list)

    def __call__(self, fault: F.Throttle | F.Stop, begin: bool) -> str:
        if isinstance(fault, F.Throttle):
            return self._throttle(fault)
        who = sorted(self.ranks) if fault.rank is None else [fault.rank]
        sig = signal.SIGSTOP if begin else signal.SIGCONT
        for rank in who:
            with contextlib.suppress(ProcessLookupError):  # an exited rank stops nothing
                os.kill(self._pid(rank), sig)
        what = "every rank" if fault.rank is None else f"rank {fault.rank}"
        return f"{what} {'stopped' if begin else 'continued'} ({sig.name})"

    def _pid(self, rank: int) -> int:
        proc = self.ranks.get(rank)
        if proc is None:
            raise LabError(f"rank {rank} has no process to act on")
        return proc.pid

    def _throttle(self, fault: F.Throttle) -> str:
        try:
            group = Cgroup(f"swlab-{self.run_id}-throttle-{fault.rank}")
            group.set_cpu_quota(fault.pct)
            group.add(self._pid(fault.rank))
        except OSError as exc:
            raise LabError(f"throttling rank {fault.rank}: {exc}") from exc
        self.cgroups.append(group)
        return f"rank {fault.rank}'s process in a cgroup with a CPU quota of {fault.pct}% of a CPU"

    def release(self) -> None:
        """Continue a rank still stopped (never a pid already reaped: it may
        be another process's now) and remove the cgroups once their
        processes are gone."""
        for proc in self.ranks.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
        for group in self.cgroups:
            group.remove()

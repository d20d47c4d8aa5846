"""Thread positions as an agent keeps them: read at start-up, at every dump and
on request (``POST /snapshot``), and turned into in-flight calls for the
watchdog when the agent arrived after they began.

An agent that attaches to a job already stuck sees no probe fire: the ranks
entered their collective before the uprobes existed.  The start-up reading
finds them inside it; each such call is handed to the watchdog as a call in
flight since the reading (a lower bound of its age), so that the usual stall
timeout, dump and peer notification follow.  A call leaves that list as soon
as it is seen to move: its process makes a recorded NCCL call, or a re-read
(every ``RECHECK_S``, and just before the timeout would fire) finds its
thread elsewhere.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from stallwatch.dumpers.model import Clock, ProcessInfo, Recording, Ring, Trigger, TriggerKind
from stallwatch.dumpers.readings import RUNNING, ThreadReading, ThreadState, syscall_name
from stallwatch.dumpers.schema import RING_DTYPES

from . import discovery
from .hostclock import boot_id, sample_clock
from .threadreader import Reader
from .tickstate import CommProgress, InflightCall

log = logging.getLogger("stallwatch.positions")

RECHECK_S = 5.0
KEEP_REQUESTED = 8  # on-demand readings kept for the next dump and for live SQL
# a reading asked for while the agent starts waits this long at most for its
# start-up reading (the HTTP surface answers before the first discovery: a
# series taken then read no process, and one late agent's readings spanned
# 0.9 s, too short to call a wait a stall)
STARTUP_WAIT_S = 10.0
SECOND_NS = 1_000_000_000


@dataclass(frozen=True, slots=True)
class _Blocked:
    """A call found blocked at start-up, and what it must still look like."""

    pid: int
    tid: int
    since_ns: int
    thread: ThreadState


@dataclass(slots=True)
class PositionKeeper:
    pids: Callable[[], Sequence[int]]  # the agent's NCCL processes in scope
    stall_timeout_ns: int
    reader: Reader = field(default_factory=Reader)
    startup: ThreadReading | None = None
    requested: list[ThreadReading] = field(default_factory=list)
    _blocked: list[_Blocked] = field(default_factory=list)
    _checked_ns: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _started: threading.Event = field(default_factory=threading.Event)

    def read(self, reason: str) -> ThreadReading:
        with self._lock:
            return self.reader.read(self.pids(), reason)

    def take_startup(self) -> ThreadReading:
        snap = self.read("startup")
        self.startup = snap
        self._started.set()
        self._blocked = [
            _Blocked(p.pid, t.tid, p.taken_ns, t)
            for p in snap.processes
            for t in p.threads
            if t.nccl is not None and (t.nccl.op.is_collective or t.nccl.op.is_p2p)
        ]
        self._checked_ns = snap.taken_ns
        for b in self._blocked:
            log.warning(
                "pid %d thread %d is inside %s since before this agent started: "
                "its stall is timed from now",
                b.pid, b.tid, b.thread.nccl.symbol if b.thread.nccl else "?",
            )  # fmt: skip
        return snap

    def take_series(self, samples: int, interval_s: float, reason: str) -> list[ThreadReading]:
        """``samples`` readings ``interval_s`` apart, kept for the next dump
        (after the start-up reading: the processes are known then)."""
        self._started.wait(STARTUP_WAIT_S)
        out = []
        for i in range(samples):
            if i:
                time.sleep(interval_s)
            out.append(self.read(reason))
        self.requested = [*self.requested, *out][-KEEP_REQUESTED:]
        return out

    def for_recording(self, dump: bool) -> tuple[ThreadReading, ...]:
        """Start-up and requested readings; a fresh one too for a dump."""
        kept = [s for s in (self.startup, *self.requested) if s is not None]
        if dump:
            kept.append(self.read("dump"))
        return tuple(kept)

    def inflight(self, now_ns: int, progress: Sequence[CommProgress]) -> list[InflightCall]:
        """The start-up's blocked calls that have not been seen to move."""
        if not self._blocked:
            return []
        entered: dict[int, int] = {}
        for p in progress:
            entered[p.pid] = max(entered.get(p.pid, 0), p.last_enter_ns)
        self._blocked = [b for b in self._blocked if entered.get(b.pid, 0) <= b.since_ns]
        if self._blocked and self._recheck_due(now_ns):
            self._recheck()
        return [
            InflightCall(
                b.pid, b.tid, 0, int(b.thread.nccl.op) if b.thread.nccl else 0, -1, b.since_ns
            )
            for b in self._blocked
        ]

    def _recheck_due(self, now_ns: int) -> bool:
        since = now_ns - self._checked_ns
        near_timeout = now_ns - self._blocked[0].since_ns >= self.stall_timeout_ns - SECOND_NS
        return since >= RECHECK_S * SECOND_NS or (near_timeout and since >= SECOND_NS // 2)

    def _recheck(self) -> None:
        with self._lock:
            snap = self.reader.read(sorted({b.pid for b in self._blocked}), "recheck")
        self._checked_ns = snap.taken_ns
        now = {(p.pid, t.tid): t for p in snap.processes for t in p.threads}
        still = []
        for b in self._blocked:
            t = now.get((b.pid, b.tid))
            # on a CPU when read (between two polls): where it is cannot be told
            if t is not None and (t.syscall == RUNNING or t.nccl == b.thread.nccl):
                still.append(b)
            else:
                log.info("pid %d thread %d left the NCCL call it was in at start-up", b.pid, b.tid)
        self._blocked = still


# -- summaries (the command's output, the answer of POST /snapshot) ----------


def reading_summary(snap: ThreadReading) -> list[dict[str, object]]:
    """Per process: its rank and each thread's state, system call and NCCL call."""
    return [
        {
            "pid": p.pid,
            "world_rank": p.world_rank,
            "error": p.error,
            "threads": [
                {
                    "tid": t.tid,
                    "name": t.name,
                    "state": t.state,
                    "syscall": syscall_name(t.syscall),
                    "wchan": t.wchan,
                    "nccl": t.nccl.describe() if t.nccl is not None else None,
                }
                for t in p.threads
            ],
        }
        for p in snap.processes
    ]


def summary_lines(summary: object) -> list[str]:
    """``reading_summary`` for people (also as an agent sent it back)."""
    lines = []
    for p in summary if isinstance(summary, list) else []:
        if not isinstance(p, dict):
            continue
        rank = p.get("world_rank")
        who = f"pid {p.get('pid')}" + (f" rank {rank}" if rank is not None else "")
        if p.get("error"):
            lines.append(f"{who}: not read: {p['error']}")
            continue
        threads = p.get("threads") or []
        inside = [t for t in threads if isinstance(t, dict) and t.get("nccl")]
        where = "; ".join(f"thread {t['tid']} inside {t['nccl']}" for t in inside)
        lines.append(f"{who}: {where or 'inside no NCCL call'} ({len(threads)} thread(s))")
    return lines


# -- a dump of readings alone (stallwatch snapshot without agents) ------------


def read_series(
    reader: Reader, pids: list[int] | None, samples: int, interval_s: float, reason: str
) -> list[ThreadReading]:
    out = []
    for i in range(samples):
        if i:
            time.sleep(interval_s)
        out.append(reader.read(pids, reason))
    return out


def readings_recording(
    host: str, snaps: list[ThreadReading], reason: str, incident_id: str
) -> Recording:
    """A dump of readings alone: no rings, no communicators."""
    clock: Clock = sample_clock()
    pids = sorted({p.pid for s in snaps for p in s.processes})
    infos = tuple(i for pid in pids if (i := _info(pid)) is not None)
    rings = {name: Ring(np.zeros(0, dtype)) for name, dtype in RING_DTYPES.items()}
    trigger = Trigger(TriggerKind.MANUAL, reason, incident_id, clock.monotonic_ns,
                      origin_host=host)  # fmt: skip
    return Recording(host, boot_id(), clock, infos, (), rings, _version(),
                     tuple(sys.argv[1:]), trigger, {}, tuple(snaps))  # fmt: skip


def _info(pid: int) -> ProcessInfo | None:
    libs = discovery.mapped_nccl_libs(pid)
    return discovery.process_info(pid, libs or ())


def _version() -> str:
    from stallwatch import __version__

    return __version__

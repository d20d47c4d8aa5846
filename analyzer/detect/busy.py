"""A rank missing at a frontier while busy outside NCCL: when its node
dumped, the thread that stands for it (its main thread) was running, or in
I/O (reading, writing or syncing a file; waiting for the disk in the
kernel), inside no NCCL call.  A job pauses so for a checkpoint (one rank
writes while the others wait for it in a barrier) or an evaluation, and
comes back: that is no hang, and the verdict says what the rank was doing
(``inconclusive``: from one moment a long phase cannot be told from a loop
that never ends; the rank named, with its threads, as the one the others
wait for).  A missing rank whose main thread is blocked (a lock, a sleep, a
wait on another process) or stopped (a stop signal, a debugger: its
system call interrupted, not running) stays a hang (``detect.missing``).

The metric: per process, its main thread's activity in the latest thread
reading of its node (``busy_outside``).

Known limits: only the main thread is looked at (a framework that makes its
NCCL calls and checkpoints from another thread is judged by what its main
thread does); a process read while it was between two system calls of its
checkpoint shows as running, which is what it was.
"""

from __future__ import annotations

from dataclasses import replace

from stallwatch.dumpers.readings import ProcessThreads, ThreadState

from ..incident import Frontier, Incident
from ..verdict import Verdict, VerdictKind
from .common import Analysis

# The system calls of file I/O a thread is found in while it writes or reads
# a checkpoint or a data set (x86-64 names, as dumpers.readings spells them).
IO_SYSCALLS = frozenset(
    {
        "read", "write", "pread64", "pwrite64", "readv", "writev", "preadv", "pwritev",
        "fsync", "fdatasync", "sync_file_range", "msync", "openat", "close",
        "sendfile", "copy_file_range", "fallocate", "ftruncate", "io_uring_enter",
        "io_getevents",
    }
)  # fmt: skip
# the kernel's uninterruptible sleep: a thread waiting for the disk (or a
# file system) in a system call
IO_STATE = "D"
RUNNING_STATE = "R"
STOPPED_STATES = frozenset({"T", "t"})  # by a stop signal, by a tracer: running nothing


def _main_thread(proc: ProcessThreads) -> ThreadState | None:
    return next((t for t in proc.threads if t.tid == proc.pid), None)


def activity(t: ThreadState) -> str | None:
    """What a thread outside NCCL is busy with, or None (blocked, or in NCCL)."""
    if t.nccl is not None or t.state in STOPPED_STATES:
        return None  # in NCCL; or stopped (a stop signal, a debugger): doing nothing
    if t.state == IO_STATE:
        wchan = f", {t.wchan}" if t.wchan else ""
        return f"in I/O ({t.syscall_name or 'the kernel'}{wchan}: state D)"
    if t.syscall_name in IO_SYSCALLS:
        return f"in I/O ({t.syscall_name})"
    if t.state == RUNNING_STATE:
        return "running"
    return None


def latest_reading(inc: Incident, proc: int) -> ProcessThreads | None:
    """Process ``proc``'s threads in the latest reading of its node that
    belongs to the incident; None if it was not read (or not readable)."""
    p = inc.procs[proc]
    latest: ProcessThreads | None = None
    for hr in inc.readings:
        if hr.host != p.host:
            continue
        for snap in hr.current():
            for r in snap.processes:
                if r.pid == p.pid and (latest is None or r.taken_ns > latest.taken_ns):
                    latest = r
    return latest if latest is not None and not latest.error else None


def busy_outside(inc: Incident, proc: int) -> str | None:
    """What process ``proc``'s main thread was busy with outside NCCL in the
    latest reading of its node, or None if it was not busy, inside NCCL, or
    not read.  (A culprit's evidence, its dump, is taken after the frontier
    began: its dump's reading is too.)"""
    latest = latest_reading(inc, proc)
    if latest is None:
        return None
    if any(
        t.nccl is not None and (t.nccl.op.is_collective or t.nccl.op.is_p2p) for t in latest.threads
    ):
        return None
    main = _main_thread(latest)
    return activity(main) if main is not None else None


def busy_instead(
    a: Analysis, v: Verdict, culprits: list[tuple[Frontier, int]], age: str
) -> Verdict | None:
    """The missing-rank verdict ``v`` as a busy rank's (``inconclusive``)
    when every culprit (frontier, proc) was busy outside NCCL; else None."""
    inc = a.incident
    doing = {p: busy_outside(inc, p) for _, p in culprits}
    if not doing or any(d is None for d in doing.values()):
        return None
    whats = sorted({f"{inc.procs[p].label()} {d}" for p, d in doing.items()})
    names = ", ".join(str(r) for r in v.ranks)
    summary = (
        f"rank {names} never entered {v.op} seq {v.seq} on {v.comm_id_hash}: busy outside "
        f"NCCL when its node dumped ({'; '.join(whats)}): a long phase such as a checkpoint "
        f"or an evaluation, or a loop; not blocked, not a hang; the other ranks wait there{age}"
    )
    evidence = tuple(f"busy outside NCCL: {w}" for w in whats) + v.evidence
    return replace(v, kind=VerdictKind.INCONCLUSIVE, summary=summary, evidence=evidence)

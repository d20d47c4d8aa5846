"""A missing rank busy outside NCCL (analyzer.detect.busy): its node's
reading at the dump shows its main thread running or in file I/O, as while
it writes a checkpoint: the verdict says so (inconclusive), never a hang;
blocked, it stays a hang.  Synthetic jobs (tests.analyzer.synth) with a
thread reading added to the missing rank's node."""

from __future__ import annotations

import dataclasses

import pytest

from stallwatch.analyzer.align import Source
from stallwatch.analyzer.detect.busy import activity
from stallwatch.analyzer.pipeline import analyze_incident, group_incidents
from stallwatch.analyzer.verdict import Verdict, VerdictKind
from stallwatch.dumpers.readings import (
    NOT_IN_SYSCALL,
    RUNNING,
    ArgsFrom,
    NcclCall,
    ProcessThreads,
    ThreadReading,
    ThreadState,
)
from tests.analyzer.synth import Job, pid_of, recordings

JOB = Job(nodes=2, ranks_per_node=2, hang=(3, 30))
CULPRIT = 3  # node 1
WRITE, FSYNC, FUTEX, NANOSLEEP = 1, 74, 202, 230


def thread(
    pid: int, state: str, syscall: int, tid: int | None = None, nccl: bool = False
) -> ThreadState:
    call = NcclCall("ncclAllReduce", "/lib/libnccl.so.2", ArgsFrom.NONE) if nccl else None
    return ThreadState(
        pid if tid is None else tid, "python3", state, "", syscall, (), 0, 0, (), "", call
    )


def verdicts_with(main: ThreadState, *others: ThreadState) -> list[Verdict]:
    """The job's verdicts, node 1's dump holding a reading of the culprit
    (its main thread ``main``) taken at the dump."""
    recs = recordings(JOB)
    node1 = recs[1]
    pid = pid_of(CULPRIT)
    taken = node1.clock.monotonic_ns - 1_000_000
    proc = ProcessThreads(pid, taken, 1_000_000, (("RANK", str(CULPRIT)),), (main, *others))
    reading = ThreadReading(taken, 2_000_000, "dump", (proc,))
    recs[1] = dataclasses.replace(node1, snapshots=(*node1.snapshots, reading))
    (inc,) = group_incidents([Source(f"dump-{r.host}.msgpack", r) for r in recs])
    return list(analyze_incident(inc).verdicts)


@pytest.mark.parametrize(
    ("state", "syscall", "said"),
    [
        ("R", RUNNING, "running"),
        ("S", WRITE, "in I/O (write)"),
        ("D", FSYNC, "in I/O (fsync"),
    ],
)
def test_a_missing_rank_busy_outside_nccl_is_said_busy_never_a_hang(
    state: str, syscall: int, said: str
) -> None:
    pid = pid_of(CULPRIT)
    [v] = verdicts_with(thread(pid, state, syscall))
    assert v.kind is VerdictKind.INCONCLUSIVE
    assert v.ranks == (CULPRIT,) and v.hosts == ("node1",)
    assert "busy outside NCCL" in v.summary and said in v.summary
    assert "not a hang" in v.summary and "checkpoint" in v.summary


@pytest.mark.parametrize(
    ("state", "syscall"),
    [("S", FUTEX), ("S", NANOSLEEP), ("S", NOT_IN_SYSCALL), ("T", WRITE), ("t", RUNNING)],
)
def test_a_missing_rank_blocked_outside_nccl_is_a_hang(state: str, syscall: int) -> None:
    [v] = verdicts_with(thread(pid_of(CULPRIT), state, syscall))
    assert v.kind is VerdictKind.MISSING_RANK and v.ranks == (CULPRIT,)


def test_a_busy_helper_thread_does_not_make_a_blocked_rank_busy() -> None:
    pid = pid_of(CULPRIT)
    helper = thread(pid, "R", RUNNING, tid=pid + 5)
    [v] = verdicts_with(thread(pid, "S", FUTEX), helper)
    assert v.kind is VerdictKind.MISSING_RANK


def test_a_rank_whose_reading_shows_it_inside_nccl_is_not_busy() -> None:
    pid = pid_of(CULPRIT)
    [v] = verdicts_with(thread(pid, "R", RUNNING), thread(pid, "S", FUTEX, pid + 1, nccl=True))
    assert v.kind is not VerdictKind.INCONCLUSIVE or "busy" not in v.summary


def test_activity_reads_the_thread() -> None:
    assert activity(thread(1, "R", RUNNING)) == "running"
    assert activity(thread(1, "D", NOT_IN_SYSCALL)) == "in I/O (the kernel: state D)"
    assert activity(thread(1, "S", FUTEX)) is None
    assert activity(thread(1, "R", RUNNING, nccl=True)) is None

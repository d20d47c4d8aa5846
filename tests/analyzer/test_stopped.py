"""A stall every member shares, held by a stopped rank (analyzer.detect.stopped):
its node's reading at the dump finds every thread of its process stopped (T:
a stop signal; t: a debugger), while its peers stand in flight beside it.
The stopped rank is named; a rank stopped in part, running or blocked is
not; every rank stopped is the whole job paused, nobody named.  Synthetic
jobs (tests.analyzer.synth): a stall with no network evidence (the traffic
on no TCP connection), thread readings added to the nodes' dumps."""

from __future__ import annotations

import dataclasses

import pytest

from stallwatch.analyzer.align import Source
from stallwatch.analyzer.pipeline import analyze_incident, group_incidents
from stallwatch.analyzer.verdict import Verdict, VerdictKind
from stallwatch.dumpers.readings import NOT_IN_SYSCALL, ProcessThreads, ThreadReading, ThreadState
from tests.analyzer.synth import Job, pid_of, recordings

JOB = Job(nodes=3, ranks_per_node=1, cut=(1, 30), rdma=True)  # every rank in flight at seq 30
FUTEX = 202


def thread(tid: int, state: str) -> ThreadState:
    syscall = FUTEX if state == "S" else NOT_IN_SYSCALL
    return ThreadState(tid, "python3", state, "", syscall, (), 0, 0, (), "", None)


def verdicts_with(states: dict[int, tuple[str, ...]]) -> list[Verdict]:
    """The job's verdicts, each rank in ``states`` read at its node's dump
    with threads in those states (its main thread first)."""
    recs = recordings(JOB)
    for rank, letters in states.items():
        node = JOB.node_of(rank)
        rec, pid = recs[node], pid_of(rank)
        taken = rec.clock.monotonic_ns - 1_000_000
        threads = tuple(thread(pid + i, s) for i, s in enumerate(letters))
        proc = ProcessThreads(pid, taken, 1_000_000, (("RANK", str(rank)),), threads)
        reading = ThreadReading(taken, 2_000_000, "dump", (proc,))
        recs[node] = dataclasses.replace(rec, snapshots=(*rec.snapshots, reading))
    (inc,) = group_incidents([Source(f"dump-{r.host}.msgpack", r) for r in recs])
    return list(analyze_incident(inc).verdicts)


@pytest.mark.parametrize("letter", ["T", "t"])
def test_a_stopped_rank_holding_a_shared_stall_is_named(letter: str) -> None:
    [v] = verdicts_with({0: ("S", "S"), 1: (letter, letter, letter), 2: ("S",)})
    assert v.kind is VerdictKind.CPU_INTERFERENCE and v.ranks == (1,) and v.hosts == ("node1",)
    assert "is stopped" in v.summary and "ALL_REDUCE seq 30" in v.summary


def test_without_readings_the_shared_stall_stays_inconclusive() -> None:
    [v] = verdicts_with({})
    assert v.kind is VerdictKind.INCONCLUSIVE and "a stall they all share" in v.summary


@pytest.mark.parametrize("letters", [("T", "S"), ("R",), ("S", "S"), ("D",)])
def test_a_rank_not_wholly_stopped_is_not_named(letters: tuple[str, ...]) -> None:
    [v] = verdicts_with({0: ("S",), 1: letters, 2: ("S",)})
    assert v.kind is VerdictKind.INCONCLUSIVE


def test_every_rank_stopped_is_the_job_paused_and_names_nobody() -> None:
    [v] = verdicts_with({r: ("T", "T") for r in range(3)})
    assert v.kind is VerdictKind.INCONCLUSIVE and "is stopped" not in v.summary

"""An agent that attached while the job ran: its ranks' calls on the
communicators made before it carry no id and count their seq from the
attach.  The analyzer aligns them with their peers' calls before it judges,
says so, and where no alignment is certain it says ``inconclusive``.
Synthetic jobs (``synth``); the lab's late attach is in test_lab_late.py."""

from __future__ import annotations

import dataclasses

import numpy as np

from stallwatch.analyzer.align import Source
from stallwatch.analyzer.pipeline import analyze_incident, group_incidents
from stallwatch.analyzer.streams import SEPARATION
from stallwatch.analyzer.verdict import Verdict, VerdictKind
from stallwatch.dumpers.model import CommInfo, Recording, Ring
from tests.analyzer.synth import WORLD, Job, pid_of, recordings

MS = 1_000_000


def attach_late(rec: Recording, first_seq: int) -> Recording:
    """The recording as an agent that attached before seq ``first_seq``
    would have it: earlier rows never seen, no id, seq from 0, no rank."""
    rows = rec.rings["nccl"].rows.copy()
    rows = rows[rows["seq"] >= first_seq]
    world = rows["comm_hash"] == WORLD
    rows["seq"][world] -= first_seq
    rows["comm_hash"][world] = 0
    rows["rank"][world], rows["nranks"][world] = -1, -1
    comms = tuple(
        CommInfo(c.pid, c.comm, 0, -1, -1) if c.comm_hash == WORLD else c for c in rec.communicators
    )
    return dataclasses.replace(rec, rings={**rec.rings, "nccl": Ring(rows)}, communicators=comms)


def judge(recs: list[Recording]) -> list[Verdict]:
    (inc,) = group_incidents([Source(f"{r.host}.msgpack", r) for r in recs])
    return list(analyze_incident(inc).verdicts)


def test_a_hung_rank_on_the_late_node_is_named_with_its_rank() -> None:
    job = Job(nodes=2, ranks_per_node=1, steps=40, hang=(1, 30))
    recs = recordings(job)
    recs[1] = attach_late(recs[1], first_seq=12)
    verdicts = judge(recs)
    v = verdicts[0]
    assert v.kind is VerdictKind.MISSING_RANK, [x.summary for x in verdicts]
    assert v.ranks == (1,) and v.pids == (pid_of(1),) and v.hosts == ("node1",)
    assert v.seq == 30
    late = [e for e in v.evidence if "recorded from its agent's attach" in e]
    assert late and "its seq + 12" in late[0] and "comm rank 1" in late[0], v.evidence
    assert all(x.kind is not VerdictKind.INCONCLUSIVE for x in verdicts)


def test_the_hung_rank_on_the_early_node_is_named_and_the_late_one_is_not() -> None:
    """Without the alignment the late node's rows would count from 0: the
    late rank would look 12 collectives behind, a missing rank of its own."""
    job = Job(nodes=3, ranks_per_node=1, steps=40, hang=(0, 25))
    recs = recordings(job)
    recs[2] = attach_late(recs[2], first_seq=12)
    verdicts = judge(recs)
    assert [v.kind for v in verdicts] == [VerdictKind.MISSING_RANK], [v.summary for v in verdicts]
    assert verdicts[0].ranks == (0,) and verdicts[0].seq == 25


def test_a_healthy_job_seen_late_is_healthy_and_says_how() -> None:
    recs = recordings(Job(nodes=2, ranks_per_node=2, steps=30))
    recs[1] = attach_late(recs[1], first_seq=7)
    [v] = judge(recs)
    assert v.kind is VerdictKind.HEALTHY
    lines = [e for e in v.evidence if "aligned by op, sizes and timing" in e]
    assert len(lines) == 2  # both ranks of node 1
    # two late ranks, two free slots, no peers: their calls are matched, their rank untold
    assert all("rank unknown" in line for line in lines)


def test_calls_closer_together_than_the_clocks_is_inconclusive_never_healthy() -> None:
    """Collectives 0.2 ms apart and a host whose wall clock is 3 ms off:
    several offsets fit about as well, none is certain."""
    job = Job(nodes=2, ranks_per_node=1, steps=60, compute_ms=0.1, xfer_ms=0.05, jitter_ms=0.01)
    recs = recordings(job)
    late = attach_late(recs[1], first_seq=10)
    clock = dataclasses.replace(late.clock, realtime_ns=late.clock.realtime_ns + 3 * MS)
    recs[1] = dataclasses.replace(late, clock=clock)
    verdicts = judge(recs)
    kinds = [v.kind for v in verdicts]
    assert VerdictKind.INCONCLUSIVE in kinds and VerdictKind.HEALTHY not in kinds, kinds
    (v,) = [v for v in verdicts if v.kind is VerdictKind.INCONCLUSIVE]
    assert v.pids == (pid_of(1),) and "not aligned" in v.evidence[0]
    assert "closer together than the clocks can tell apart" in v.evidence[0], v.evidence


def test_a_late_stream_with_no_call_in_common_is_inconclusive() -> None:
    """The early node's ring kept only calls older than any the late agent saw."""
    recs = recordings(Job(nodes=2, ranks_per_node=1, steps=30))
    rows = recs[0].rings["nccl"].rows
    recs[0] = dataclasses.replace(
        recs[0], rings={**recs[0].rings, "nccl": Ring(rows[rows["seq"] < 10], overwritten=1)}
    )
    recs[1] = attach_late(recs[1], first_seq=20)
    kinds = [v.kind for v in judge(recs)]
    assert kinds[-1] is VerdictKind.INCONCLUSIVE and VerdictKind.HEALTHY not in kinds, kinds


def test_the_certainty_rule_can_fail() -> None:
    """The separation the rule demands is more than a step can give when
    steps are as close as the skew: the test above depends on it."""
    assert SEPARATION > 1.0
    rows = recordings(Job(nodes=2, ranks_per_node=1, steps=5))[0].rings["nccl"].rows
    assert np.all(np.diff(rows["ts_ns"].astype(np.int64)) > 0)

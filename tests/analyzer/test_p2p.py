"""Stalls that no collective shows: point-to-point calls whose peer never
posted the matching call (pipeline stages).  The n-th send from a to b
matches the n-th receive at b from a; a side that posted more and has done
nothing since waits on the other."""

from __future__ import annotations

import dataclasses

import numpy as np

from stallwatch.analyzer.align import Source
from stallwatch.analyzer.pipeline import IncidentResult, analyze_incident, group_incidents
from stallwatch.analyzer.verdict import VerdictKind
from stallwatch.dumpers.model import Recording, Ring
from stallwatch.dumpers.schema import NCCL_EVENT, Op
from tests.analyzer.synth import MS, WORLD, Job, _row, recordings

JOB = Job(nodes=2, ranks_per_node=2, steps=12)
NOW_AFTER_NS = 5_000 * MS  # recordings() dump this long after the job's last collective


def _p2p(rank: int, peer: int, op: Op, seq: int, ts: int, end: int) -> np.void:
    r = _row(rank, JOB.nranks, seq, ts, end, WORLD, rank)
    r["op"], r["peer"] = op, peer
    return r


def _with(recs: list[Recording], rows: list[np.void]) -> list[Recording]:
    """The recordings with these p2p rows added to their ranks' nodes."""
    out = []
    for node, rec in enumerate(recs):
        mine = [r for r in rows if JOB.node_of(int(r["rank"])) == node]
        both = np.concatenate([rec.rings["nccl"].rows, np.array(mine, dtype=NCCL_EVENT)])
        rings = {**rec.rings, "nccl": Ring(both[np.argsort(both["ts_ns"], kind="stable")])}
        out.append(dataclasses.replace(rec, rings=rings))
    return out


def _pipeline(steps: int, end_ns: int) -> list[np.void]:
    """Rank 0 sends to 1 and 1 to 2 at every step, each matched, returning at once."""
    rows = []
    for s in range(steps):
        t = end_ns - (steps - s) * 20 * MS
        for a in (0, 1):
            rows += [_p2p(a, a + 1, Op.SEND, s, t, t + 10_000)]
            rows += [_p2p(a + 1, a, Op.RECV, s, t + 1_000, t + 2 * MS)]
    return rows


def _analyze(recs: list[Recording]) -> IncidentResult:
    (inc,) = group_incidents([Source(r.host, r) for r in recs])
    return analyze_incident(inc)


def _end() -> int:
    recs = recordings(JOB)
    return int(recs[0].trigger.time_ns) - NOW_AFTER_NS  # type: ignore[union-attr]


def test_healthy_pipeline_is_healthy() -> None:
    end = _end()
    res = _analyze(_with(recordings(JOB), _pipeline(10, end)))
    assert [v.kind for v in res.verdicts] == [VerdictKind.HEALTHY]


def test_receiver_that_never_posts_is_named() -> None:
    """Rank 0 sent its 11th message to rank 1 and has waited since; rank 1
    never posted the receive: rank 1 is named, not the waiting sender."""
    end = _end()
    rows = [*_pipeline(10, end), _p2p(0, 1, Op.SEND, 10, end + MS, end + MS + 10000)]
    (v,) = _analyze(_with(recordings(JOB), rows)).verdicts
    assert v.kind is VerdictKind.MISSING_RANK and v.ranks == (1,) and v.op == "RECV"
    assert v.seq == 10 and "rank 1 never posted the RECV" in v.summary and v.comm_ranks == (1,)
    assert "posted 1 sends from comm rank 0 to 1" in v.evidence[0]


def test_sender_that_never_sends_is_named() -> None:
    end = _end()
    rows = [*_pipeline(10, end), _p2p(2, 1, Op.RECV, 10, end + MS, 0)]  # in flight
    (v,) = _analyze(_with(recordings(JOB), rows)).verdicts
    assert v.kind is VerdictKind.MISSING_RANK and v.ranks == (1,) and v.op == "SEND"


def test_a_chain_of_waits_names_its_end() -> None:
    """Rank 2 waits to receive from 1, which waits to receive from 0, which
    never sent: rank 0 is the culprit, rank 1 a victim."""
    end = _end()
    rows = _pipeline(10, end)
    rows += [_p2p(1, 0, Op.RECV, 10, end + MS, 0), _p2p(2, 1, Op.RECV, 10, end + 2 * MS, 0)]
    (v,) = _analyze(_with(recordings(JOB), rows)).verdicts
    assert v.ranks == (0,) and v.op == "SEND"


def test_a_sender_ahead_but_busy_is_not_a_stall() -> None:
    """Sends run ahead of receives in a healthy pipeline: a sender that keeps
    calling NCCL is not waiting."""
    end = _end()
    rows = [*_pipeline(10, end), _p2p(0, 1, Op.SEND, 10, end + MS, end + MS + 10000)]
    busy = _p2p(0, 1, Op.SEND, 11, end + NOW_AFTER_NS - 100 * MS, end + NOW_AFTER_NS - 99 * MS)
    res = _analyze(_with(recordings(JOB), [*rows, busy]))
    assert [v.kind for v in res.verdicts] == [VerdictKind.HEALTHY]


def test_a_collective_verdict_comes_before_p2p() -> None:
    """A hang the collectives show is named by them alone."""
    end = _end()
    job = dataclasses.replace(JOB, hang=(3, 11))
    recs = recordings(job)
    rows = [*_pipeline(10, end), _p2p(0, 1, Op.SEND, 10, end + MS, end + MS + 10000)]
    verdicts = _analyze(_with(recs, rows)).verdicts
    assert [(v.kind, v.ranks, v.op, v.comm_ranks) for v in verdicts] == [
        (VerdictKind.MISSING_RANK, (3,), "ALL_REDUCE", (3,))
    ]


# ---- the evidence rules of collectives --------------------------------------------


def test_a_peer_without_a_dump_is_its_own_unknown() -> None:
    """Rank 0 sent its 11th message to rank 2, whose node left no dump: no
    rank is blamed for the receive nobody can show; rank 0 is not either."""
    end = _end()
    rows = [*_pipeline(10, end), _p2p(1, 2, Op.SEND, 10, end + MS, end + MS + 10000)]
    recs = _with(recordings(JOB), rows)[:1]  # node1 (ranks 2, 3) lost
    res = _analyze(recs)
    assert all(v.kind is VerdictKind.INCONCLUSIVE for v in res.verdicts), res.verdicts
    assert {r for v in res.verdicts for r in v.ranks} <= {2, 3}


def test_a_peer_dumped_before_the_post_is_not_blamed() -> None:
    """Rank 2's node dumped before rank 1 posted the send rank 2 never
    received (dumps taken in turn): its dump cannot show it behind.  Taken
    after the post, it does."""
    end = _end()
    rows = [*_pipeline(10, end), _p2p(1, 2, Op.SEND, 10, end + MS, end + MS + 10000)]
    node0, node1 = _with(recordings(JOB), rows)
    blamed = _analyze([node0, node1]).verdicts
    assert [(v.kind, v.ranks) for v in blamed] == [(VerdictKind.MISSING_RANK, (2,))]
    # node1's capture (wall clock) before the post, its own stamps kept
    early = dataclasses.replace(
        node1.clock, realtime_ns=node1.clock.realtime_ns - (NOW_AFTER_NS - MS // 2)
    )
    res = _analyze([node0, dataclasses.replace(node1, clock=early)])
    assert not [v for v in res.verdicts if v.kind is VerdictKind.MISSING_RANK], res.verdicts


def test_evidence_naming_one_rank_on_both_sides_is_refused_and_said() -> None:
    """A rank whose sends to itself were never received by itself (no
    recorder writes that of a working NCCL: its ranks were read wrong) is
    not blamed for waiting on itself; the refusal is in the report."""
    end = _end()
    rows = [*_pipeline(10, end), _p2p(1, 1, Op.SEND, 10, end + MS, end + MS + 10000)]
    res = _analyze(_with(recordings(JOB), rows))
    assert not [v for v in res.verdicts if v.kind is VerdictKind.MISSING_RANK], res.verdicts
    refused = [u for u in res.unjudged if u.startswith("refused:")]
    assert (
        len(refused) == 1 and "rank 1" in refused[0] and "its two sides are one rank" in refused[0]
    )

"""Our own dumps taken at different moments (their capture times are known):
a rank behind the frontier is stuck only if its dump was taken after the
frontier began.

A synthetic 2x2 blocking job (100 ms of compute between steps): node 0 dumps
2 s after its ranks entered step K+1 (stuck there, as far as its dump shows);
node 1's ranks last entered step K.  Whether node 1's dump was read before
step K+1 began (dumps in turn: healthy) or after (its ranks never came: the
hang) is told by its capture time alone; the rows are the same."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from stallwatch.analyzer.align import Source
from stallwatch.analyzer.pipeline import analyze_incident, group_incidents
from stallwatch.analyzer.verdict import Verdict, VerdictKind
from stallwatch.dumpers.model import Clock, Recording, Ring
from tests.analyzer.synth import MS, Job, recordings

K = 20
S = 1_000_000_000


def _cut(rec: Recording, at: int, upto_seq: int, stuck: bool = False) -> Recording:
    """The recording as a dump read at ``at`` (its clock) would hold it:
    calls up to ``upto_seq``, those not returned by then in flight (and, with
    ``stuck``, the last: its peers never came)."""
    ring = rec.rings["nccl"]
    rows = ring.rows[ring.rows["seq"] <= upto_seq].copy()
    late = (rows["end_ns"] > at) | (stuck & (rows["seq"] == upto_seq))
    rows["end_ns"][late], rows["result"][late] = 0, -1
    off = rec.clock.realtime_ns - rec.clock.monotonic_ns
    trig = dataclasses.replace(rec.trigger, time_ns=at) if rec.trigger else None
    return dataclasses.replace(
        rec,
        clock=Clock(at, at + off),
        trigger=trig,
        rings={**rec.rings, "nccl": Ring(rows, ring.overwritten, ring.lost)},
    )


def _verdicts(node1_read_at: Callable[[int], int], node0_after: int = 2 * S) -> list[Verdict]:
    node0, node1 = recordings(Job(compute_ms=100.0, steps=40))
    entered = node0.rings["nccl"].rows
    began = int(entered["ts_ns"][entered["seq"] == K + 1].min())
    n0 = _cut(node0, began + node0_after, K + 1, stuck=True)
    n1 = _cut(node1, node1_read_at(began), K)
    (inc,) = group_incidents([Source("node0.msgpack", n0), Source("node1.msgpack", n1)])
    return list(analyze_incident(inc).verdicts)


def test_a_dump_read_before_the_frontier_began_is_older_not_stuck() -> None:
    # node 0 read 60 ms after its ranks entered step K+1, node 1 between
    # steps K and K+1: a staircase, nothing in flight past the stall
    # threshold
    vs = _verdicts(lambda began: began - 60 * MS, node0_after=60 * MS)
    assert [v.kind for v in vs] == [VerdictKind.HEALTHY], [v.summary for v in vs]
    assert "the dumps were taken at different moments" in vs[0].summary


def test_calls_in_flight_past_the_stall_threshold_are_never_healthy() -> None:
    """Node 0's ranks in flight at step K+1 for 2 s at its dump (100 ms
    steps): the job stood still, whatever node 1's older dump shows.  Node
    1's ranks are not blamed (read before K+1 began: they may have come),
    nor is the stall called healthy (it was, before a hung job could never
    be): inconclusive, naming them."""
    vs = _verdicts(lambda began: began - 60 * MS)
    assert [v.kind for v in vs] == [VerdictKind.INCONCLUSIVE], [v.summary for v in vs]
    assert sorted(r for r in vs[0].ranks if r is not None) == [2, 3]
    assert "the job stood still at ALL_REDUCE seq 21" in vs[0].summary
    assert any("in flight 2.0 s when the dumps were taken" in e for e in vs[0].evidence)


def test_a_dump_read_after_the_frontier_began_shows_the_hang() -> None:
    vs = _verdicts(lambda began: began + 2 * S)
    assert vs[0].kind is VerdictKind.MISSING_RANK, [v.summary for v in vs]
    assert sorted(r for r in vs[0].ranks if r is not None) == [2, 3]


def test_within_the_clocks_skew_nothing_is_claimed_either_way() -> None:
    # read 10 ms before the frontier began: not ordered with it (skew), and
    # nothing else shows dumps taken in turn: the hang rule stands as before
    vs = _verdicts(lambda began: began - 10 * MS)
    assert vs[0].kind is VerdictKind.MISSING_RANK
    assert sorted(r for r in vs[0].ranks if r is not None) == [2, 3]

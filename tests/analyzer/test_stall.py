"""A hung job is never healthy (``analyzer.detect.stall``): the evidence
that a job stood still, each on inputs built by hand, with the cases that
must stay healthy.  The Flight Recorder frontier rule is judged on real
torch dumps (test_fr_in_turn), calls in flight past the stall threshold on
two nodes' dumps (test_moments)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest

from stallwatch.analyzer.align import Source
from stallwatch.analyzer.detect.positions import held_waits
from stallwatch.analyzer.detect.stall import STALL_HELD_NS
from stallwatch.analyzer.incident import Incident
from stallwatch.analyzer.pipeline import analyze_incident, group_incidents
from stallwatch.analyzer.verdict import Verdict, VerdictKind
from stallwatch.dumpers.model import TriggerKind
from tests.analyzer.synth import BASE_JOB, recordings
from tests.analyzer.test_positions import _call, _readings


def _verdicts(trigger: TriggerKind | None) -> list[Verdict]:
    """A healthy job's dumps; node 0's written on ``trigger``."""
    recs = recordings(BASE_JOB)
    if trigger is not None:
        t = recs[0].trigger
        assert t is not None
        why = "ncclAllReduce in flight 300 s\x1b[31m"
        recs[0] = dataclasses.replace(recs[0], trigger=dataclasses.replace(t, kind=trigger,
                                                                         reason=why))  # fmt: skip
    (inc,) = group_incidents([Source(f"dump-{r.host}.msgpack", r) for r in recs])
    return list(analyze_incident(inc).verdicts)


@pytest.mark.parametrize("kind", [TriggerKind.IN_FLIGHT, TriggerKind.NO_PROGRESS])
def test_a_watchdog_stall_dump_is_never_healthy(kind: TriggerKind) -> None:
    """The job stood still outside NCCL (every rank between calls): no rank
    departs, but the agent's watchdog said it stood still."""
    (v,) = _verdicts(kind)
    assert v.kind is VerdictKind.INCONCLUSIVE and v.ranks == (), v.summary
    assert "the job stood still" in v.summary
    assert any("its agent's watchdog dumped on a stall" in e for e in v.evidence), v.evidence


@pytest.mark.parametrize("kind", [None, TriggerKind.MANUAL, TriggerKind.PEER])
def test_a_dump_asked_for_says_nothing_of_a_stall(kind: TriggerKind | None) -> None:
    assert [v.kind for v in _verdicts(kind)] == [VerdictKind.HEALTHY]


def _incident(held_s: float, moving: bool = False) -> Incident:
    calls = {r: _call("ncclAllReduce", 0xD0) for r in range(8)}
    readings = _readings(calls, times=(0, int(held_s * 1e9)))
    if moving:  # one rank in another call at the second reading: it went on
        later = _readings({**calls, 3: _call("ncclAllGather", 0xD0)}, times=(int(held_s * 1e9),))
        node1 = readings[1]  # ranks 2 and 3
        readings[1] = dataclasses.replace(
            node1, snapshots=(node1.snapshots[0], later[1].snapshots[0])
        )
    return cast(Incident, SimpleNamespace(readings=tuple(readings), procs=()))


def test_threads_held_in_one_call_are_a_stall() -> None:
    held = held_waits(_incident(1.5), STALL_HELD_NS)
    assert len(held) >= 2 and all("ncclAllReduce" in h for h in held), held


def test_threads_held_briefly_or_moving_on_are_no_stall() -> None:
    assert held_waits(_incident(0.5), STALL_HELD_NS) == []
    held = held_waits(_incident(1.5, moving=True), STALL_HELD_NS)
    assert not any(h.startswith("rank 3") for h in held), held


def test_ranks_blocked_in_another_call_are_not_called_dumps_in_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The lab's lossy stall without the network rule: ranks 0 and 2 never
    entered the Broadcast because they wait in their AllReduce; both dumps
    were taken 14 ms apart, so "dumps taken in turn" would be false."""
    import stallwatch.analyzer.pipeline as pipeline
    from stallwatch.analyzer.detect.stall import detect_stall

    monkeypatch.setattr(pipeline, "STALL_DETECTORS", (detect_stall,))
    folder = Path(__file__).resolve().parents[1] / "data" / "net-loss-stall-2x2"
    (inc,) = pipeline.analyze_paths([str(p) for p in sorted(folder.glob("*.msgpack"))]).incidents
    (v,) = inc.verdicts
    assert v.kind is VerdictKind.INCONCLUSIVE
    assert "they wait in ALL_REDUCE at their dumps" in v.summary
    assert "in turn" not in v.summary

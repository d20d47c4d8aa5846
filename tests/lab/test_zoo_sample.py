"""A fixed sample of the fault zoo, run as ``python -m bench.zoo`` runs each
draw (the lab job with an agent per node, the truth beside its dumps, then
``stallwatch analyze --json``) and judged by the same rule: the verdict a
user gets names the faulted host alone, in the right kind, and a healthy
draw names nobody.  The figures that count come from fresh draws
(docs/evidence.md); these few keep the whole chain working in CI."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from bench import zoo as bench_zoo
from stallwatch.lab import zoo

pytestmark = [pytest.mark.lab, pytest.mark.slow]

# (seed, space): small shapes, early faults, block waits, no neighbour: the
# chain, not the hardest cases, in under a minute each
SAMPLE = [
    (137, zoo.Space(("cut",), ((3, 1),), ("block",), ("none",))),  # node1 cut off one way (out)
    (137, zoo.Space(("mtu",), ((3, 1),), ("block",), ("none",))),  # node1: over 905 bytes lost
    (1, zoo.Space(("healthy",), ((2, 1),), ("block",), ("none",))),  # nothing but itself
]


# the healthy job's watch after its start step: long enough for its agents to
# settle and dump at its end, short enough to keep the sample within CI's
# three minutes (the zoo's own draws watch RUN_AFTER_FAULT_S)
SAMPLE_DURATION_S = 15.0


@pytest.mark.parametrize(
    ("seed", "space"), SAMPLE, ids=lambda x: str(x) if isinstance(x, int) else x.mechanisms[0]
)
def test_a_zoo_draw_is_judged_right(seed: int, space: zoo.Space, tmp_path: Path) -> None:
    d = zoo.draw(seed, space=space)
    if d.job.duration is not None:  # a job that goes on: watched 15 s, not the zoo's 40 s
        d = dataclasses.replace(d, job=dataclasses.replace(d.job, duration=SAMPLE_DURATION_S))
    record = zoo.run_draw(d, tmp_path)
    analysis = bench_zoo.analyze(tmp_path)
    row = bench_zoo.judge(record, analysis)
    assert row.right and not row.wrong_culprit, (d.truth.what, row.top)
    if d.truth.mechanism != "healthy":
        assert record["affect"]["affected"], record["affect"]

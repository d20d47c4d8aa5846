"""The synthetic jobs the analyzer's unit tests are built on."""

from __future__ import annotations

from tests.analyzer.synth import Job, recordings


def test_synth_blocking_job_has_one_row_per_rank_and_step() -> None:
    recs = recordings(Job(steps=5))
    assert sum(len(r.rings["nccl"].rows) for r in recs) == 4 * 5
    assert {r.host for r in recs} == {"node0", "node1"}

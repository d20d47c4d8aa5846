"""bench/slowdown_seeds.py --rejudge: runs kept by an earlier bench judged
again from their lab account and dumps (here: dumps of a synthetic 3x2 job
whose rank 2 is starved of CPU from step 300, node1's agent raising the
slowdown), right when the account's fault is the rank the dumps name,
wrong when it is another."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.slowdown_seeds import CHECKPOINT, rejudge
from stallwatch.dumpers.format import write_dump
from tests.analyzer.synth import Job, recordings

JOB = Job(nodes=3, ranks_per_node=2, steps=360, from_step=300)


def _kept_run(out: Path, rank: int) -> None:
    folder = out / "cpuhog-3x2-seed0"
    recs = recordings(
        Job(**{**JOB.__dict__, "starved_inside": 2, "slowdown_by": 1, "background_wait_ms": 8.0})
    )
    for rec in recs:
        (folder / "dumps" / rec.host).mkdir(parents=True)
        write_dump(folder / "dumps" / rec.host / "dump.msgpack", rec)
    raised = min(r.trigger.time_ns for r in recs if r.trigger is not None)
    faults = [
        {"spec": CHECKPOINT, "injected": True, "injected_ns": 1},
        {
            "spec": f"cpuhog:rank={rank},step=300",
            "injected": True,
            "injected_ns": raised - 9 * 10**9,
        },
    ]
    (folder / "lab.json").write_text(json.dumps({"faults": faults}))


@pytest.mark.parametrize(("rank", "code", "said"), [(2, 0, "ok"), (3, 1, "WRONG")])
def test_a_kept_run_is_judged_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], rank: int, code: int, said: str
) -> None:
    _kept_run(tmp_path, rank)
    assert rejudge(tmp_path) == code
    out = capsys.readouterr().out
    assert f"cpuhog-3x2-seed0 cpuhog:rank={rank},step=300: {said}: 9.0 s, 3 nodes dumped" in out
    assert "cpu_interference: rank 2 (host node1" in out
    assert out.rstrip().endswith(f"== cpuhog-3x2: {1 - code}/1")

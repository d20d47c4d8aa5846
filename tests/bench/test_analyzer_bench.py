"""The analyzer benchmark runs (small sizes) and its figures meet their
targets: the 3-D incidents' verdicts name the injected rank, hang and
straggler alike."""

from __future__ import annotations

import pytest

from bench import bench_analyzer

pytestmark = pytest.mark.solo  # speed figures: measured alone


@pytest.mark.slow
def test_bench_quick_meets_targets() -> None:
    figures = bench_analyzer.figures(quick=True)
    assert len(figures) == 4
    assert all(f.ok is not False for f in figures), [(f.name, f.value, f.anchor) for f in figures]
    timed = [f for f in figures if f.name.startswith("analyze 3-D") and f.name.endswith("time")]
    assert [f.name.split()[2] for f in timed] == ["hang", "straggler"]
    assert all("(right)" in f.anchor for f in timed)

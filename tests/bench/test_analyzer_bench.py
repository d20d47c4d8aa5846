"""The analyzer benchmark runs (small sizes) and its figures meet their targets."""

from __future__ import annotations

import pytest

from bench import bench_analyzer


@pytest.mark.slow
def test_bench_quick_meets_targets() -> None:
    figures = bench_analyzer.figures(quick=True)
    # torchfrtrace's rows only where torch is installed (not by the test extra)
    assert len(figures) == (6 if bench_analyzer.has_torchfrtrace() else 3)
    assert all(f.ok is not False for f in figures), [(f.name, f.value, f.anchor) for f in figures]
    assert all("right" in f.anchor for f in figures if "our dumps): time" in f.name)

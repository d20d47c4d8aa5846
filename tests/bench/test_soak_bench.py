"""The soak benchmark runs at its quick size (40 s) and meets its targets:
no call missed between dumps, nothing lost or failed; its memory is judged
flat only by the 30-minute run (figures in docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from bench import bench_soak

pytestmark = [pytest.mark.solo, pytest.mark.bpf, pytest.mark.slow]


def test_soak_quick_meets_targets() -> None:
    figures = bench_soak.figures(quick=True)
    assert len(figures) == 4
    assert all(f.ok is not False for f in figures), [(f.name, f.value, f.anchor) for f in figures]
    assert [f.ok for f in figures] == [None, None, True, True]

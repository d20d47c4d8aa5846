"""The soak benchmark runs at its quick size (40 s) and meets its targets:
memory flat, no call missed between dumps, nothing lost or failed (the
30-minute figures are in docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from bench import bench_soak

pytestmark = [pytest.mark.solo, pytest.mark.bpf, pytest.mark.slow]


def test_soak_quick_meets_targets() -> None:
    figures = bench_soak.figures(quick=True)
    assert len(figures) == 4
    assert all(f.ok for f in figures), [(f.name, f.value, f.anchor) for f in figures]

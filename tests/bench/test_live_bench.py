"""The live verdict benchmark runs, in its quick mode, and prints its figures."""

from __future__ import annotations

import re

import pytest

from bench import bench_live
from bench.common import render

pytestmark = pytest.mark.solo  # speed figures: measured alone


def test_quick_bench_times_the_live_verdict() -> None:
    figures = bench_live.figures(quick=True)
    assert [f.name.split(" (")[0] for f in figures] == [
        "live verdict: analyze --agents over 4 agents",
        "live verdict: analyze --agents over 8 agents",
    ]
    for f, agents in zip(figures, (4, 8), strict=True):
        assert f.value > 0 and f.ok is not None
        judged = re.search(r"([\d,]+) ranks judged", f.anchor)
        assert judged is not None and int(judged.group(1).replace(",", "")) == 4 * agents
        came = re.search(r"([\d,]+) of ([\d,]+) answers came", f.anchor)
        assert came is not None and came.group(1) == came.group(2), f.anchor
    assert all(f.name in render(figures) for f in figures)

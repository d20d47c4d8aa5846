"""The recorder benchmark runs, with tiny sizes, and its figures are sane.
The targets themselves are judged by ``python -m bench`` on a quiet machine,
not here: this 2-core CI machine runs other suites beside it."""

from __future__ import annotations

import pytest

from bench import bench_recorder
from bench.common import render

pytestmark = [pytest.mark.bpf, pytest.mark.slow, pytest.mark.solo]


def test_bench_recorder_quick_figures() -> None:
    figures = {f.name: f for f in bench_recorder.figures(quick=True)}
    table = render(list(figures.values()))
    ratio = figures["NCCL call cost vs bare uprobe pair"]
    assert 0.8 < ratio.value < 20, table
    assert 0.5 < figures["graph launch cost vs bare uprobe pair"].value < 20, table
    assert figures["events lost at 100k/s"].value == 0, table
    assert figures["events into the rings"].value > 10_000, table
    assert 0 <= figures["agent CPU"].value < 50, table  # 10 ms CPU-time ticks

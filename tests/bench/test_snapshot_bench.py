"""The snapshot benchmark runs, with tiny sizes, and its figures are sane.
The targets are judged by ``python -m bench`` on a quiet machine, not here."""

from __future__ import annotations

import pytest

from bench import bench_snapshot
from bench.common import render

pytestmark = [pytest.mark.lab, pytest.mark.slow, pytest.mark.solo]


def test_bench_snapshot_quick_figures() -> None:
    figures = {f.name: f for f in bench_snapshot.figures(quick=True)}
    table = render(list(figures.values()))
    cold = figures["snapshot of 8 ranks (fresh reader)"].value
    warm = figures["snapshot of 8 ranks (agent's reader)"].value
    assert warm > 0 and 0 < cold < 1000, table  # ms
    assert figures["finding the NCCL processes (/proc scan)"].value > 0, table
    assert figures["rank wake-up lateness p99, snapshots running"].value >= 0, table
    running = figures["waiters read running, 12 busy loops on their CPU"]
    assert 0 <= running.value <= 60 * 8, table  # reads, of 60 rounds of 8 waiters

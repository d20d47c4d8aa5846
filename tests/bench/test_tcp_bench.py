"""The TCP benchmark runs at a small size beside the previous design, and
what it reports holds: the previous design's ring is the neighbour's, this
one keeps the job's retransmits and writes a small fraction of the rows."""

from __future__ import annotations

import pytest

from bench import bench_tcp
from bench.common import render

pytestmark = [pytest.mark.bpf, pytest.mark.slow]


def test_bench_tcp_quick_figures() -> None:
    figures = {f.name: f for f in bench_tcp.figures(quick=True)}
    table = render(list(figures.values()))
    kept = figures["the job's retransmits still in the ring"]
    assert kept.ok and kept.value > 0, table
    rows = figures["TCP ring rows written"]
    previous = float(rows.anchor.split(": ")[1].rstrip("/s").replace(",", ""))
    assert rows.value * 10 < previous, table  # the neighbour's rows are not written
    assert "previous design" in figures["all TCP programs, CPU per second"].anchor, table
    assert figures["TCP program handle_sock_ops, per event"].value > 0, table

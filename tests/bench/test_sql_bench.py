"""The SQL benchmark runs, in its quick mode, and prints its figures."""

from __future__ import annotations

import re

import pytest

from bench import bench_sql
from bench.common import render

pytestmark = pytest.mark.solo  # speed figures: measured alone


def test_quick_bench_measures_every_figure() -> None:
    figures = bench_sql.figures(quick=True, repeats=2)
    names = [f.name for f in figures]
    assert any("seed query" in n for n in names)
    assert any("fan-out seed query to 4 agents" in n for n in names)
    assert any("scanning agents / DuckDB agents" in n for n in names)
    assert all(f.value > 0 for f in figures)
    # the seed query finds retransmits in the windows (not an empty join)
    seed = next(f for f in figures if "seed query" in f.name)
    pairs = re.search(r"([\d,]+) \(AllReduce, retransmit\) pairs", seed.anchor)
    assert pairs is not None and int(pairs.group(1).replace(",", "")) > 0
    table = render(figures)
    assert all(f.name in table for f in figures)
    # query over many dumps holds no more for the data than analyze does
    (held,) = [f for f in figures if f.name.endswith("memory for the data / analyze's")]
    assert "on 32 dumps (256 ranks)" in held.name and held.ok, held

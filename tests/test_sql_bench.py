"""The SQL benchmark runs, in its quick mode, and prints its figures."""

from __future__ import annotations

import re

import pytest

from bench import bench_sql


def test_quick_bench_measures_every_figure(capsys: pytest.CaptureFixture[str]) -> None:
    figures = bench_sql.figures(quick=True, repeats=2)
    names = [f.name for f in figures]
    assert any("seed query" in n for n in names)
    assert any("fan-out seed query to 4 agents" in n for n in names)
    assert all(f.value > 0 for f in figures)
    # the seed query finds retransmits in the windows (not an empty join)
    seed = next(f for f in figures if "seed query" in f.name)
    pairs = re.search(r"([\d,]+) \(AllReduce, retransmit\) pairs", seed.anchor)
    assert pairs is not None and int(pairs.group(1).replace(",", "")) > 0
    assert bench_sql.main(["--quick", "--repeats", "1"]) in (0, 1)
    assert "fan-out" in capsys.readouterr().out

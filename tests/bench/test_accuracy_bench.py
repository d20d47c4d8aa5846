"""The accuracy benchmark: a figure per Flight Recorder corpus run, all right,
and the table of docs/flight-recorder.md is the one it prints."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench import bench_accuracy

pytestmark = pytest.mark.solo  # speed figures: measured alone

TABLE_DOC = Path(__file__).resolve().parents[2] / "docs" / "flight-recorder.md"


def test_every_corpus_run_is_right() -> None:
    figures = bench_accuracy.figures(quick=True)  # quick: torchfrtrace not run
    runs = [f for f in figures if f.name.startswith("FR corpus ") and ":" not in f.name]
    assert len(runs) >= 50
    assert all(f.ok for f in figures), [(f.name, f.anchor) for f in figures if not f.ok]
    assert figures[-1].value == 100.0


def test_the_docs_table_is_what_the_corpus_gives() -> None:
    """Our column of the table in docs/flight-recorder.md, job by job (torchfrtrace's column
    needs torch, and is not checked here)."""
    table = bench_accuracy.markdown(bench_accuracy.rows(with_torch=False))
    ours = {
        line.split(" | ")[0]: line.split(" | ")[4]
        for line in table.splitlines()[2:]
        if line.startswith("| ")
    }
    text = TABLE_DOC.read_text()
    for job, verdict in ours.items():
        row = re.search(re.escape(job) + r" \|[^\n]*", text)
        assert row is not None, job
        assert row.group(0).split(" | ")[4] == verdict, job

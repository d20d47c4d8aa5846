"""Unknown is null: no verdict, JSON document or report holds a -1, 0 or other
placeholder for a rank, comm rank or pid that no input tells.

The scan runs the analyzer over every incident kept in the repository
(tests/data: lab dumps, the Flight Recorder corpus in both forms) and the
shared fixtures (real 16-rank NCCL Flight Recorder dumps), and checks every
verdict, the JSON document and the text report.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from stallwatch.analyzer.pipeline import AnalysisResult, analyze_paths
from stallwatch.analyzer.report import to_json, to_text
from stallwatch.analyzer.verdict import Verdict, VerdictKind

DATA = Path(__file__).resolve().parents[1] / "data"


def _incident_folders(root: Path) -> list[Path]:
    """Folders that hold input files directly (one incident each)."""
    return sorted(
        d
        for d in [root, *root.rglob("*")]
        if d.is_dir()
        and any(f.is_file() and f.suffix not in (".md", ".py") for f in d.iterdir())
        and not all(f.name == "expected.json" for f in d.iterdir() if f.is_file())
    )


# a rank, comm rank or pid written as a number where none is known
PLACEHOLDER_TEXT = re.compile(r"\b(?:rank|ranks|pid|pids) (?:-\d+|\?)|\bpid 0\b")


def _check(result: AnalysisResult, where: str) -> int:
    verdicts = [v for r in result.incidents for v in r.verdicts]
    for v in verdicts:
        for r in (*v.ranks, *v.comm_ranks):
            assert r is None or (isinstance(r, int) and r >= 0), (where, v)
        for p in v.pids:
            assert p is None or (isinstance(p, int) and p > 0), (where, v)
        assert not PLACEHOLDER_TEXT.search(v.summary), (where, v.summary)
        for e in v.evidence:
            assert not PLACEHOLDER_TEXT.search(e), (where, e)
    doc = json.loads(to_json(result))
    for inc in doc["incidents"]:
        for v in inc["verdicts"]:
            assert all(r is None or r >= 0 for r in v["ranks"] + v["comm_ranks"]), (where, v)
            assert all(p is None or p > 0 for p in v["pids"]), (where, v)
    text = to_text(result, show_all=True)
    assert not PLACEHOLDER_TEXT.search(text), (where, PLACEHOLDER_TEXT.findall(text))
    return len(verdicts)


def test_no_verdict_of_the_repository_data_holds_a_placeholder() -> None:
    folders = _incident_folders(DATA)
    assert len(folders) >= 100  # the lab dumps and the corpus in both forms
    seen = sum(_check(analyze_paths([str(d)]), str(d)) for d in folders)
    assert seen >= len(folders)


def test_no_verdict_of_the_shared_fixtures_holds_a_placeholder(fixtures_dir: Path) -> None:
    folders = _incident_folders(fixtures_dir)
    assert len(folders) >= 4
    for d in folders:
        result = analyze_paths([str(d)])
        assert _check(result, str(d))
        # Flight Recorder files name no pid: null, never 0
        assert all(p is None for r in result.incidents for v in r.verdicts for p in v.pids)


def test_a_verdict_built_from_sentinels_holds_null() -> None:
    v = Verdict(
        VerdictKind.INCONCLUSIVE, (3, -1), ("h",), (0, 42), None, None, None, "s", (), (-1,)
    )
    assert v.ranks == (3, None) and v.pids == (None, 42) and v.comm_ranks == (None,)
    doc = v.to_json()
    assert doc["ranks"] == [3, None] and doc["pids"] == [None, 42] and doc["comm_ranks"] == [None]
    # unknown sorts after every known rank, and never raises
    assert sorted([v, v], key=Verdict.sort_key) == [v, v]


@pytest.mark.parametrize("rank", [-1, -7])
def test_unknown_world_rank_reads_unknown(rank: int) -> None:
    from stallwatch.analyzer.incident import Proc

    p = Proc("node0", 17, rank, "node0.msgpack")
    assert p.label() == "rank unknown (host node0, pid 17)"

"""The analyzer's per-host retransmit counts, and the SQL query that must
give them (tests/query/test_retransmit_agreement.py, tests/analyzer/test_lab.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stallwatch.analyzer.align import WINDOW_CALLS
from stallwatch.analyzer.detect.network import retransmits_in_windows
from stallwatch.analyzer.load import load_inputs
from stallwatch.analyzer.match import match
from stallwatch.analyzer.pipeline import group_incidents
from stallwatch.dumpers.format import read_dump
from stallwatch.dumpers.sqltables import RETRANSMITS_BY_HOST_QUERY
from stallwatch.query.sql import LOCAL, QueryEngine

Counts = dict[str, tuple[int, int, int, int]]  # host -> sent in windows, received, sent, calls


def analyzer_counts(folder: Path) -> Counts:
    """``retransmits_in_windows`` of the folder's one incident, per host."""
    loaded, _ = load_inputs([str(folder)])
    (inc,) = group_incidents(loaded)
    rows = retransmits_in_windows(inc, match(inc))
    assert rows, f"{folder}: no retransmit between the hosts"
    return {inc.hosts[h.host]: (h.local, h.remote, h.total, h.calls) for h in rows}


def sql_rows(folder: Path, sql: str) -> list[tuple[Any, ...]]:
    recs = [read_dump(p) for p in sorted(folder.rglob("*.msgpack"))]
    with QueryEngine(recs, LOCAL) as engine:
        return engine.query(sql).rows


def sql_counts(folder: Path) -> Counts:
    rows = sql_rows(folder, RETRANSMITS_BY_HOST_QUERY)
    return {host: (inside, received, sent, calls) for host, inside, received, sent, calls in rows}


def assert_rings_read_whole(folder: Path) -> None:
    """The analyzer reads each rank's latest WINDOW_CALLS calls of a ring
    only; the SQL tables hold every row.  They agree where nothing is older."""
    for path in sorted(folder.rglob("*.msgpack")):
        rec = read_dump(path)
        ranks = len({p.pid for p in rec.processes} | {c.pid for c in rec.communicators})
        assert len(rec.rings["nccl"].rows) <= WINDOW_CALLS * ranks, path


def assert_agree(folder: Path) -> Counts:
    assert_rings_read_whole(folder)
    want = analyzer_counts(folder)
    got = sql_counts(folder)
    assert got == want
    assert sum(sent for _, _, sent, _ in got.values()) > 0
    return got

"""The analyzer's per-host retransmit counts, and the SQL query that must
give them (tests/query/test_retransmit_agreement.py, tests/analyzer/test_lab.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stallwatch.analyzer.detect.network import network_metrics
from stallwatch.analyzer.load import load_inputs
from stallwatch.analyzer.match import match
from stallwatch.analyzer.pipeline import group_incidents
from stallwatch.dumpers.format import read_dump
from stallwatch.dumpers.sqltables import RETRANSMITS_BY_HOST_QUERY
from stallwatch.query.sql import LOCAL, QueryEngine

Counts = dict[str, tuple[int, int, int, int]]  # host -> sent in windows, received, sent, calls


def analyzer_counts(folder: Path) -> list[tuple[list[str], Counts]]:
    """Per incident of the folder, its dumps and the per-host counts the
    analyzer's network verdicts print (``network_metrics``)."""
    loaded, _ = load_inputs([str(folder)])
    out = []
    for inc in group_incidents(loaded):
        rows = network_metrics(inc, match(inc)).retransmits.get()
        counts = {inc.hosts[h.host]: (h.local, h.remote, h.total, h.calls) for h in rows}
        out.append((list(inc.sources), counts))
    return out


def sql_rows(where: Path | list[str], sql: str) -> list[tuple[Any, ...]]:
    """``sql`` over the dumps of a folder, or over dump files."""
    paths = sorted(where.rglob("*.msgpack")) if isinstance(where, Path) else where
    recs = [read_dump(p) for p in paths]
    with QueryEngine(recs, LOCAL) as engine:
        return engine.query(sql).rows


def sql_counts(where: Path | list[str]) -> Counts:
    rows = sql_rows(where, RETRANSMITS_BY_HOST_QUERY)
    return {host: (inside, received, sent, calls) for host, inside, received, sent, calls in rows}


def assert_agree(folder: Path) -> Counts:
    """The per-host query on each incident's dumps gives the analyzer's
    counts; returns them, over every incident of the folder."""
    total: Counts = {}
    for paths, want in analyzer_counts(folder):
        got = sql_counts(paths)
        if not want:  # no retransmit between two hosts: the analyzer counts nothing
            want = {host: (0, 0, 0, calls) for host, (*_, calls) in got.items()}
        assert got == want, f"SQL {got} != analyzer {want} on {paths}"
        for host, (inside, received, sent, calls) in got.items():
            a, b, c, d = total.get(host, (0, 0, 0, 0))
            total[host] = (a + inside, b + received, c + sent, d + calls)
    assert sum(sent for _, _, sent, _ in total.values()) > 0, f"no retransmit in {folder}"
    return total

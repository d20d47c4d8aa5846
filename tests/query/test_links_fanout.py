"""The link tables on live agents: the same SQL over agents serving
recordings (the fan-out) returns what it returns over their dumps in one
local query, list columns and NULLs included."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.bench_sql import Synthetic, synthetic_recording
from stallwatch.dumpers.model import Recording
from stallwatch.query.fanout import close_connections, query_agents
from stallwatch.query.http import RecordingsBackend, serve_http
from stallwatch.query.sql import LOCAL, QueryEngine
from tests.dump_samples import with_link_rows

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def recordings() -> list[Recording]:
    return [
        with_link_rows(synthetic_recording(Synthetic(host=f"node{i}", first_rank=4 * i, seed=i)), i)
        for i in range(3)
    ]


@pytest.fixture(scope="module")
def agents(recordings: list[Recording]) -> Iterator[list[str]]:
    handles = [serve_http(RecordingsBackend([r]), "127.0.0.1:0", None) for r in recordings]
    yield [h.address for h in handles]
    close_connections()
    for h in handles:
        h.close()


DOC_QUERIES = {  # docs/sql.md shows them
    "doc: links that went down": "SELECT e.host, e.interface, e.event, e.wall_time, "
    "(e.timestamp_ns - e.after_ns) / 1e6 AS within_ms, l.world_ranks, e.carrier_down_count, "
    "e.link_downed, e.symbol_error FROM link_events e JOIN links l ON l.host = e.host "
    "AND l.interface = e.interface WHERE e.event IN ('carrier_down', 'carrier_up', "
    "'carrier_flap', 'errors') ORDER BY e.host, e.timestamp_ns;",
    "doc: counters between two rows": "SELECT host, interface, event, timestamp_ns, "
    "rx_errors - lag(rx_errors) OVER w AS rx_errors_since, port_rcv_errors - "
    "lag(port_rcv_errors) OVER w AS port_rcv_errors_since FROM link_events WINDOW w AS "
    "(PARTITION BY host, interface ORDER BY timestamp_ns) ORDER BY host, interface, "
    "timestamp_ns;",
}
QUERIES = {
    "rows": "SELECT host, interface, kind, event, after_ns, carrier, operstate, port_state, "
    "rx_errors, symbol_error, np_cnp_sent FROM link_events ORDER BY host, timestamp_ns",
    "links": "SELECT host, interface, kind, device, port, netdev, addresses, mtu, speed_mbps, "
    "pids, world_ranks FROM links ORDER BY host, interface",
    "aggregates": "SELECT kind, count(*), max(rx_errors), sum(symbol_error), "
    "count(np_cnp_sent) FROM link_events GROUP BY kind ORDER BY kind",
    "a cut link and the ranks behind it": "SELECT e.host, e.interface, l.world_ranks "
    "FROM link_events e JOIN links l ON l.host = e.host AND l.interface = e.interface "
    "WHERE e.event = 'carrier_down' ORDER BY e.host",
    **DOC_QUERIES,
}


@pytest.mark.parametrize("sql", QUERIES.values(), ids=QUERIES.keys())
def test_link_tables_answer_alike_live_and_on_dumps(
    agents: list[str], recordings: list[Recording], sql: str
) -> None:
    result = query_agents(agents, sql, timeout=60.0)  # a loaded machine: slow, not lost
    assert not result.failed and not result.partial
    with QueryEngine(recordings, LOCAL) as engine:
        local = engine.query(sql)
    assert local.rows, "an empty answer proves nothing"
    assert result.columns == local.columns and result.types == local.types
    got: list[Any] = [tuple(r) for r in result.rows]
    assert got == local.rows


def test_the_cut_link_names_its_nodes_ranks(agents: list[str]) -> None:
    result = query_agents(agents, QUERIES["a cut link and the ranks behind it"], timeout=60.0)
    assert [tuple(r) for r in result.rows] == [("node1", "eth0", [4, 5, 6, 7])]


def test_the_docs_show_the_link_queries_tested() -> None:
    text = " ".join((ROOT / "docs" / "sql.md").read_text().split())
    for sql in DOC_QUERIES.values():
        assert sql in text, sql

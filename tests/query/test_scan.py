"""Fetch queries answered from the Arrow columns (``query.scan``) give what
DuckDB gives for the same query over the same rows: real lab dumps, with
their NULLs (calls in flight, unattributed TCP rows, calls outside any
communicator) and their hex ids."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import duckdb
import pyarrow as pa
import pytest

from stallwatch.dumpers.format import read_dump
from stallwatch.dumpers.sqltables import SEED_QUERY, tables
from stallwatch.query.plan import plan
from stallwatch.query.scan import Scan, compile_scan
from stallwatch.query.sql import (
    LOCAL,
    NETWORK,
    Limits,
    QueryEngine,
    parse_select,
    sandboxed_connection,
)

Tables = dict[str, pa.Table]
Con = duckdb.DuckDBPyConnection
LAB = Path(__file__).resolve().parents[1] / "data" / "lab-hang-2x2"
HASH = "0xe88e47aaaf64ddf1"  # a communicator of the lab job

# Each filter is met by some rows and missed by others, NULLs among both
# where the column has them.
SCANS = {
    "hex id": f"SELECT host, pid, comm_id_hash FROM nccl_events WHERE comm_id_hash = '{HASH}'",
    "hex id, not": f"SELECT comm_id_hash, rank FROM nccl_events WHERE comm_id_hash <> '{HASH}'",
    "hex id, ordered": f"SELECT comm_id_hash FROM nccl_events WHERE comm_id_hash < '{HASH}'",
    "null": "SELECT host, seq, rank FROM nccl_events WHERE rank IS NULL",
    "not null": "SELECT seq, duration_ns FROM nccl_events WHERE duration_ns IS NOT NULL",
    "null AND false": "SELECT seq FROM nccl_events WHERE NOT (rank = 0 AND seq > 5)",
    "null OR true": "SELECT seq, rank FROM nccl_events WHERE rank = 1 OR seq >= 3",
    "in": "SELECT op, rank FROM nccl_events WHERE rank IN (0, 2, -1)",
    "not in": "SELECT op, rank FROM nccl_events WHERE rank NOT IN (0, 2)",
    "text in": "SELECT op FROM nccl_events WHERE op IN ('ALL_REDUCE', 'SEND', 'nothing')",
    "between": "SELECT duration_ns FROM nccl_events WHERE duration_ns BETWEEN 10000 AND 5000000",
    "mirrored": "SELECT pid FROM tcp_events WHERE 2000 < pid",
    "two columns": "SELECT sport, dport FROM tcp_events WHERE sport < dport",
    "two interned columns": "SELECT saddr, daddr FROM tcp_events WHERE saddr = daddr",
    "qualified": 'SELECT "host", "state" FROM "tcp_events" AS t WHERE t."state" = \'CLOSE\'',
    "negative": "SELECT rank FROM nccl_events WHERE rank > -1",
    "quote in text": "SELECT host FROM tcp_events WHERE host = 'it''s'",
    "every row": "SELECT host, wall_time, newstate FROM tcp_events",
}


@pytest.fixture(scope="module")
def tabs() -> dict[str, pa.Table]:
    return tables([read_dump(LAB / f"node{i}.msgpack") for i in (0, 1)])


@pytest.fixture(scope="module")
def con(tabs: Tables) -> Iterator[Con]:
    con = sandboxed_connection(LOCAL)
    for name, table in tabs.items():
        con.register(name, table)
    yield con
    con.close()


def _scan(con: Con, tabs: Tables, sql: str) -> Scan | None:
    node = parse_select(con, sql)
    assert node is not None
    return compile_scan(node, {n: t.schema for n, t in tabs.items()})


@pytest.mark.parametrize("sql", SCANS.values(), ids=SCANS.keys())
def test_a_scan_gives_what_duckdb_gives(con: Con, tabs: Tables, sql: str) -> None:
    scan = _scan(con, tabs, sql)
    assert scan is not None, "answered by DuckDB, not by a scan"
    expected = con.sql(sql).to_arrow_table()
    got = scan.run(tabs[scan.table])
    assert got.schema == expected.schema
    assert got.num_rows == expected.num_rows and got.equals(expected)


def test_the_filters_meet_nulls_on_both_sides(con: Con, tabs: Tables) -> None:
    """The comparison above is not vacuous: NULL ranks and hex ids exist,
    and each filter keeps some rows and drops others."""
    nccl = tabs["nccl_events"]
    assert nccl.column("rank").null_count and nccl.column("comm_id_hash").null_count
    for name, sql in SCANS.items():
        if name in ("quote in text", "every row"):
            continue
        kept = len(con.sql(sql).fetchall())
        table = sql.split(" FROM ")[1].split()[0].strip('"')
        assert 0 < kept < tabs[table].num_rows, name


NOT_SCANS = {
    "float": "SELECT pid FROM nccl_events WHERE duration_ns > 1e6",
    "text against a number": "SELECT pid FROM nccl_events WHERE pid = '1234'",
    "number against text": "SELECT pid FROM nccl_events WHERE op = 1",
    "past the type": "SELECT rank FROM nccl_events WHERE rank < 3000000000",
    "spaced literal": "SELECT rank FROM nccl_events WHERE rank = 1_0",
    "boolean literal": "SELECT rank FROM nccl_events WHERE rank = TRUE",
    "null literal": "SELECT rank FROM nccl_events WHERE rank = NULL",
    "function": "SELECT op FROM nccl_events WHERE lower(op) = 'send'",
    "like": "SELECT comm_id_hash FROM nccl_events WHERE comm_id_hash LIKE '0xe8%'",
    "time": "SELECT wall_time FROM nccl_events WHERE wall_time > '2020-01-01'",
    "alias": "SELECT pid AS p FROM nccl_events",
    "expression": "SELECT pid + 1 FROM nccl_events",
    "star": "SELECT * FROM nccl_events",
    "repeated": "SELECT pid, pid FROM nccl_events",
    "other case": "SELECT PID FROM nccl_events",
    "order": "SELECT pid FROM nccl_events ORDER BY pid LIMIT 3",
    "distinct": "SELECT DISTINCT pid FROM nccl_events",
    "group": "SELECT pid, count(*) FROM nccl_events GROUP BY pid",
    "join": "SELECT e.pid FROM nccl_events e JOIN processes p ON e.pid = p.pid",
    "cte": "WITH x AS (SELECT pid FROM nccl_events) SELECT pid FROM x",
    "subquery": "SELECT pid FROM nccl_events WHERE pid IN (SELECT pid FROM processes)",
    "unknown table": "SELECT pid FROM elsewhere",
}


@pytest.mark.parametrize("sql", NOT_SCANS.values(), ids=NOT_SCANS.keys())
def test_anything_else_is_left_to_duckdb(con: Con, tabs: Tables, sql: str) -> None:
    assert _scan(con, tabs, sql) is None


def test_the_seed_query_fetches_are_scans(con: Con, tabs: Tables) -> None:
    """What a fan-out of the seed query asks every agent is answered by scans."""
    fetches = plan(SEED_QUERY).fetches
    assert fetches
    for fetch in fetches:
        scan = _scan(con, tabs, fetch.sql)
        assert scan is not None, fetch.sql
        expected = con.sql(fetch.sql).to_arrow_table()
        assert scan.run(tabs[scan.table]).equals(expected)


def test_an_engine_answers_fetches_as_before(con: Con) -> None:
    """Through the engine (materialized as ``serve`` does, or not): the
    table DuckDB gives, the row cap and its flag kept."""
    recs = [read_dump(LAB / f"node{i}.msgpack") for i in (0, 1)]
    sql = SCANS["null OR true"]
    expected = con.sql(sql).to_arrow_table()
    for materialize in (False, True):
        with QueryEngine(recs, NETWORK, materialize=materialize) as engine:
            got, truncated = engine.fetch_arrow(sql)
            assert got.equals(expected) and not truncated
        with QueryEngine(recs, Limits(max_fetch_rows=5), materialize=materialize) as engine:
            got, truncated = engine.fetch_arrow(sql)
            assert truncated and got.equals(expected.slice(0, 5))

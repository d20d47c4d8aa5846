"""Tables fed a dump at a time, narrowed to what a query reads: every query
of the docs (and more that lean on columns they do not name) returns what it
returns over the whole tables; ``stallwatch query`` over many dumps says how
far it got, as ``analyze`` does."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest

from stallwatch.dumpers.format import read_dump
from stallwatch.dumpers.ranks import Ranks
from stallwatch.dumpers.sqltables import SEED_QUERY, TABLE_NAMES
from stallwatch.query.feed import KEEP_ALWAYS, feed, needs
from stallwatch.query.limits import QUERY
from stallwatch.query.sql import QueryEngine, QueryResult
from tests.query.test_lab_sql import readme_sql

ROOT = Path(__file__).resolve().parents[2]
DUMPS = sorted((ROOT / "tests" / "data").glob("lab-*/*.msgpack"))

LEANING = [  # rows that depend on columns the query does not name
    "SELECT * FROM nccl_events ORDER BY host, timestamp_ns LIMIT 7",
    "SELECT * EXCLUDE (wall_time) FROM tcp_events ORDER BY ALL LIMIT 5",
    "SELECT n FROM nccl_events n ORDER BY n.timestamp_ns LIMIT 3",
    "SELECT count(*) FROM processes NATURAL JOIN communicators",
    "SELECT a, b FROM nccl_events AS t(a, b) ORDER BY 1, 2 LIMIT 4",
    "SELECT count(DISTINCT (n.*)) FROM nccl_events n",
    "SELECT host, count(*) FROM nccl_events GROUP BY ALL ORDER BY ALL",
    "SELECT count(*) FROM nccl_events",
    "SELECT p.pid, (SELECT count(*) FROM nccl_events WHERE pid = p.pid) FROM processes p "
    "ORDER BY 1",
    "WITH nccl_events AS (SELECT * FROM nccl_events WHERE op = 'ALL_REDUCE') "
    "SELECT count(*), max(seq) FROM nccl_events",
    "SELECT count(*) FROM nccl_events JOIN communicators USING (host, pid) WHERE nranks > 1",
    "SELECT table_name, count(*) FROM information_schema.columns GROUP BY 1 ORDER BY 1",
    "DESCRIBE nccl_events",
    "SUMMARIZE SELECT seq FROM nccl_events",
    "SELECT count(*) FROM range(3)",
    "SELECT unknown_column FROM nccl_events",
    "SELECT 1 FROM no_such_table",
]


ONE_THREAD = dataclasses.replace(QUERY, threads=1)  # rows tied in ORDER BY come in one order


def _whole() -> QueryEngine:
    return QueryEngine([read_dump(p) for p in DUMPS], ONE_THREAD)


def _fed(sql: str) -> QueryEngine:
    heads = [read_dump(p) for p in DUMPS]
    loads = [functools.partial(read_dump, p) for p in DUMPS]
    return QueryEngine(feed(loads, Ranks.of(heads), needs(sql)), ONE_THREAD)


def _answer(engine: QueryEngine, sql: str) -> QueryResult | str:
    try:
        with engine:
            return engine.query(sql)
    except Exception as exc:  # the same failure on both sides is the same answer
        return type(exc).__name__


@pytest.mark.parametrize("sql", [SEED_QUERY, *readme_sql(), *LEANING])
def test_a_query_over_what_it_reads_returns_what_it_returns_over_everything(sql: str) -> None:
    whole, fed = _answer(_whole(), sql), _answer(_fed(sql), sql)
    if isinstance(whole, str) or isinstance(fed, str):
        assert fed == whole, sql
        return
    assert (fed.columns, fed.types, fed.rows) == (whole.columns, whole.types, whole.rows), sql


def test_what_a_query_reads() -> None:
    assert needs("SELECT count(*) FROM nccl_events").columns == {"nccl_events": frozenset()}
    seed = needs(SEED_QUERY).columns
    assert set(seed) == {"nccl_events", "tcp_events"}
    assert {"timestamp_ns", "duration_ns", "op", "event"} <= set(seed["nccl_events"] or ())
    for whole in ("SELECT * FROM tcp_events", "SELECT t FROM tcp_events t",
                  "SELECT count(*) FROM tcp_events NATURAL JOIN processes"):  # fmt: skip
        assert all(cols is None for cols in needs(whole).columns.values()), whole
    everything = needs("SELECT * FROM information_schema.tables").columns
    assert set(everything) == set(TABLE_NAMES) and all(v is None for v in everything.values())
    assert set(needs("not sql at all").columns) == set(TABLE_NAMES)


def test_a_table_the_query_names_no_column_of_keeps_its_rows_in_one_small_column() -> None:
    heads = [read_dump(p) for p in DUMPS]
    loads = [functools.partial(read_dump, p) for p in DUMPS]
    built = feed(loads, Ranks.of(heads), needs("SELECT count(*) FROM nccl_events"))
    (table,) = built.values()
    assert table.column_names == [KEEP_ALWAYS] and table.num_rows > 100


def test_query_over_many_dumps_says_how_far_it_got(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Progress on stderr as analyze shows it (here a line at every dump);
    a dump whose rings fail the reader once its header was read is named
    once and skipped, the others answer (exit 1)."""
    from stallwatch.analyzer import progress
    from stallwatch.commands.main import main
    from stallwatch.dumpers import format as dump_format
    from stallwatch.dumpers.errors import DumpError

    monkeypatch.setattr(progress, "PROGRESS_EVERY_S", 0.0)
    read = dump_format.read_dump
    bad = str(DUMPS[-1])

    def failing(path: str) -> object:
        if str(path) == bad:
            raise DumpError(f"{path}: rings.nccl: checksum mismatch")
        return read(path)

    monkeypatch.setattr(dump_format, "read_dump", failing)
    sql = "SELECT host, count(*) AS n FROM nccl_events GROUP BY host ORDER BY host"
    assert main(["query", *map(str, DUMPS), sql]) == 1
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    total = len(DUMPS)
    assert [f"stallwatch query: read {k}/{total} dumps" for k in range(1, total + 1)] == [
        line for line in lines if " read " in line
    ]
    assert sum(bad in line for line in lines) == 1 and "checksum mismatch" in err
    assert "node0" in out and "node2" in out

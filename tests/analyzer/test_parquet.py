"""``stallwatch export --parquet``: the layout, appending, the documented
schema, and existing engines (DuckDB, Spark in local mode) returning on the
Parquet folder the rows ``stallwatch query`` returns on the dumps."""

from __future__ import annotations

import contextlib
import datetime
import decimal
import io
import json
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import duckdb
import pyarrow.parquet as pq
import pytest

from stallwatch.analyzer.parquet import FORMAT_VERSION, META_FILE, escape
from stallwatch.cli import main
from stallwatch.dumpers.format import write_dump
from stallwatch.dumpers.sqltables import RETRANSMITS_BY_HOST_QUERY, SEED_QUERY, TABLE_NAMES
from tests.analyzer.synth import Job, recordings

ROOT = Path(__file__).resolve().parents[2]
FR_FOLDER = "pytorch-fr-nccl-16rank/lock_gil_1st"

# the queries of docs/sql.md and docs/parquet.md that run on dumps as they
# are (no incident column there); each must appear there verbatim
DOC_QUERIES = (
    "SELECT op, count(*), avg(duration_ns)/1e6 AS ms FROM nccl_events GROUP BY op",
    "SELECT host, op, count(*) AS calls, max(duration_ns)/1e6 AS max_ms FROM nccl_events "
    "WHERE op = 'ALL_REDUCE' GROUP BY host, op ORDER BY max_ms DESC, host LIMIT 10",
    "SELECT t.host, count(*) AS retransmits FROM tcp_events t "
    "WHERE t.event = 'tcp_retransmit_skb' GROUP BY t.host ORDER BY retransmits DESC, t.host",
)
QUERIES = (SEED_QUERY, *DOC_QUERIES)


def _job(seed: int) -> Job:
    # lossy steps take ~64 ms, the others ~8: the seed query has rows, all
    # of distinct durations (jitter), so its LIMIT cuts the same rows everywhere
    return Job(nodes=3, ranks_per_node=2, steps=30, loss_node=1, xfer_ms=8, jitter_ms=3, seed=seed)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory, fixtures_dir: Path) -> list[Path]:
    """Two incidents of our dumps (one a host name that needs escaping) and a
    folder of real Flight Recorder dumps."""
    base = tmp_path_factory.mktemp("dumps")
    out = []
    for seed, incident in ((1, "inc-a"), (2, "inc b/2")):
        folder = base / f"incident{seed}"
        folder.mkdir()
        for rec in recordings(_job(seed), incident):
            if seed == 2:
                rec = _renamed(rec, f"{rec.host}:rack=7")
            write_dump(folder, rec)
        out.append(folder)
    fr = base / "lock_gil_1st"
    shutil.copytree(fixtures_dir / FR_FOLDER, fr, ignore=shutil.ignore_patterns("*.md"))
    out.append(fr)
    return out


def _renamed(rec: Any, host: str) -> Any:
    import dataclasses

    return dataclasses.replace(rec, host=host)


def run_cli(argv: Sequence[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def exported(dumps: list[Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder, written in three exports: appending, as a platform would."""
    root = tmp_path_factory.mktemp("parquet") / "incidents"
    for d in dumps:
        code, _, err = run_cli(["export", "--parquet", str(d), "-o", str(root)])
        assert code == 0, err
    return root


def _files(root: Path) -> dict[Path, tuple[int, int, bytes]]:
    return {
        p: (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes())
        for p in root.rglob("*")
        if p.is_file()
    }


# --- layout, appending, refusals ------------------------------------------------


def _fr_incident(exported: Path) -> str:
    """The Flight Recorder incident's id: its folder's name and a digest."""
    names = [p.name for p in (exported / "nccl_events").iterdir()]
    return next(n.removeprefix("incident=") for n in names if "lock_gil_1st" in n)


def test_layout_is_hive_partitioned_with_a_format_version(exported: Path) -> None:
    meta = json.loads((exported / META_FILE).read_text())
    assert meta["format"] == "stallwatch-parquet" and meta["version"] == FORMAT_VERSION
    assert sorted(meta["tables"]) == sorted(TABLE_NAMES)
    fr = _fr_incident(exported)
    assert re.fullmatch(r"lock_gil_1st-[0-9a-f]{8}", fr), fr  # the folder's name, made unique
    for table in TABLE_NAMES:
        parts = sorted(p.name for p in (exported / table).iterdir())
        assert parts == sorted(f"incident={escape(i)}" for i in ("inc-a", "inc b/2", fr)), parts
    hosts = sorted(p.name for p in (exported / "nccl_events" / "incident=inc%20b%2F2").iterdir())
    assert hosts == [f"host=node{k}%3Arack%3D7" for k in range(3)]
    fr_hosts = list((exported / "nccl_events" / f"incident={fr}").iterdir())
    assert len(fr_hosts) == 16  # one Flight Recorder dump per rank
    one = next((exported / "sched_events").rglob("*.parquet"))
    md = pq.read_schema(one).metadata
    assert md[b"stallwatch.version"] == str(FORMAT_VERSION).encode()
    assert "host" not in pq.read_schema(one).names  # the folder says it
    assert not [p for p in exported.iterdir() if p.name.startswith(".staging")]


def test_appending_an_incident_rewrites_nothing(dumps: list[Path], tmp_path: Path) -> None:
    root = tmp_path / "pq"
    assert run_cli(["export", "--parquet", str(dumps[0]), "-o", str(root)])[0] == 0
    before = _files(root)
    assert run_cli(["export", str(dumps[1]), "-o", str(root), "--parquet"])[0] == 0
    after = _files(root)
    assert all(after[p] == v for p, v in before.items())  # same inode, time and bytes
    assert len(after) > len(before)
    code, _, err = run_cli(["export", "--parquet", str(dumps[0]), "-o", str(root)])
    assert code == 2 and "inc-a is already exported" in err and err[-1] == "\n"
    assert _files(root) == after


def test_a_foreign_folder_or_version_is_refused(dumps: list[Path], tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    code, _, err = run_cli(["export", "--parquet", str(dumps[0]), "-o", str(other)])
    assert code == 2 and "not a stallwatch Parquet export" in err
    old = tmp_path / "old"
    old.mkdir()
    (old / META_FILE).write_text(json.dumps({"format": "stallwatch-parquet", "version": 0}))
    code, _, err = run_cli(["export", "--parquet", str(dumps[0]), "-o", str(old)])
    assert code == 2 and "format version 0" in err
    code, _, err = run_cli(["export", "--parquet", str(tmp_path / "nope"), "-o", str(old)])
    assert code == 2 and "no such file or folder" in err


def _documented(doc: str) -> dict[str, list[str]]:
    """Per table section of docs/parquet.md, the columns its table lists."""
    out: dict[str, list[str]] = {}
    for m in re.finditer(r"^## (\w+): .*?\n(.*?)(?=^## |\Z)", doc, re.S | re.M):
        out[m.group(1)] = re.findall(r"^\| `(\w+)` \|", m.group(2), re.M)
    return out


def test_every_column_is_documented(exported: Path) -> None:
    documented = _documented((ROOT / "docs" / "parquet.md").read_text())
    assert set(documented) == set(TABLE_NAMES)
    for table in TABLE_NAMES:
        for f in (exported / table).rglob("*.parquet"):
            assert pq.read_schema(f).names == documented[table], (table, f)


def test_the_docs_show_the_queries_tested() -> None:
    docs = [(ROOT / "docs" / name).read_text() for name in ("sql.md", "parquet.md")]
    text = " ".join(" ".join(docs).split())
    for q in DOC_QUERIES:
        assert q in text, q


# --- engines ----------------------------------------------------------------------


def _norm(value: object) -> object:
    """One spelling of a value whatever engine returned it."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int | decimal.Decimal) and value == int(value):
        return int(value)
    if isinstance(value, float | decimal.Decimal):
        return round(float(value), 6)
    if isinstance(value, datetime.datetime):
        return value.replace(tzinfo=None).isoformat()
    if isinstance(value, list | tuple):
        return tuple(_norm(v) for v in value)
    raise AssertionError(f"unexpected value {value!r}")


def _rows(rows: Sequence[Sequence[Any]], ordered: bool) -> list[tuple[object, ...]]:
    out = [tuple(_norm(v) for v in r) for r in rows]
    return out if ordered else sorted(out, key=repr)


def _ordered(sql: str) -> bool:
    return "ORDER BY" in sql.upper()


def _expected(dumps: list[Path], sql: str) -> list[tuple[object, ...]]:
    code, out, err = run_cli(["query", *map(str, dumps), sql, "--format", "json"])
    assert code == 0, err
    doc = json.loads(out)
    return _rows(doc["rows"], _ordered(sql))


def _json_round(rows: Sequence[Sequence[Any]]) -> list[list[Any]]:
    """Rows as ``stallwatch query --format json`` would print them."""
    from stallwatch.query.wire import encode_json

    out: list[list[Any]] = json.loads(encode_json({"rows": [list(r) for r in rows]}))["rows"]
    return out


def duckdb_views(con: duckdb.DuckDBPyConnection, root: Path) -> None:
    """What docs/parquet.md tells a platform team to run (there: on s3://...)."""
    for t in TABLE_NAMES:
        con.execute(
            f"CREATE VIEW {t} AS SELECT * FROM read_parquet('{root}/{t}/**/*.parquet', "
            "hive_partitioning = true, hive_types = {'incident': VARCHAR, 'host': VARCHAR})"
        )


@pytest.mark.parametrize(
    "sql",
    # the per-host query is DuckDB's SQL (DISTINCT ON, FILTER), not Spark's
    [*QUERIES, RETRANSMITS_BY_HOST_QUERY],
    ids=["seed", *(f"docs{i}" for i in range(3)), "retransmits-by-host"],
)
def test_duckdb_on_parquet_returns_what_query_returns(
    dumps: list[Path], exported: Path, sql: str
) -> None:
    expected = _expected(dumps, sql)
    con = duckdb.connect()
    duckdb_views(con, exported)
    got = _rows(_json_round(con.execute(sql).fetchall()), _ordered(sql))
    assert got == expected
    assert expected, "the query must return rows for the comparison to mean something"


def test_duckdb_sees_every_row_and_partition(dumps: list[Path], exported: Path) -> None:
    con = duckdb.connect()
    duckdb_views(con, exported)
    sql = "SELECT host, count(*) FROM {} GROUP BY host"
    for t in TABLE_NAMES:
        got = _rows(con.execute(sql.format(t)).fetchall(), False)
        assert got == _expected(dumps, sql.format(t)), t
    incidents = con.execute("SELECT DISTINCT incident FROM nccl_events ORDER BY 1").fetchall()
    assert incidents == [("inc b/2",), ("inc-a",), (_fr_incident(exported),)]


# --- Spark (the session-scoped local session of tests/conftest.py) -------------


def spark_views(spark: Any, root: Path) -> None:
    for t in TABLE_NAMES:
        spark.read.parquet(str(root / t)).createOrReplaceTempView(t)


@pytest.mark.slow
def test_spark_on_parquet_returns_what_query_returns(
    dumps: list[Path], exported: Path, spark: Any
) -> None:
    spark_views(spark, exported)
    for sql in QUERIES:
        rows = [tuple(r) for r in spark.sql(sql.rstrip().rstrip(";")).collect()]
        got = _rows(_json_round(rows), _ordered(sql))
        assert got == _expected(dumps, sql), sql
    # every row of every table, in one job
    sql = " UNION ALL ".join(
        f"SELECT '{t}' AS t, host, count(*) AS n FROM {t} GROUP BY host" for t in TABLE_NAMES
    )
    got = _rows([tuple(r) for r in spark.sql(sql).collect()], False)
    assert got == _expected(dumps, sql)

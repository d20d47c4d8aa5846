"""One answer on every surface: every incident of tests/data and of the shared
Flight Recorder fixtures asked the same questions through ``analyze --json``,
``query`` on the dumps, DuckDB and Spark on the Parquet export, ``query
--agents`` against the dumps served (one agent per dump file, as one node
each), and the Perfetto trace.

The questions: calls per world rank and communicator; per communicator, the world ranks
behind its frontier (members whose last collective seq there is below the
highest any member entered; a member with no call there is not counted: a
table cannot tell a rank that never called from one whose ring wrapped); calls in flight with
their elapsed time; the culprits' host and pid; and, for Flight Recorder
files, each file's world rank (which must be the rank in its name).

Not every surface can answer every question: ``analyze --json`` has no call
counts nor elapsed times (it answers who is behind, who is in flight, the
culprits), and the trace has no membership (it answers calls, calls in
flight, the culprits' tracks and each file's rank).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import pytest

from stallwatch.analyzer.export import export
from stallwatch.analyzer.parquet import escape, export_parquet
from stallwatch.analyzer.pipeline import analyze_paths
from stallwatch.analyzer.report import to_json
from stallwatch.commands.query import read_recordings
from stallwatch.dumpers.sqltables import TABLE_NAMES
from stallwatch.query.fanout import close_connections, query_agents
from stallwatch.query.http import RecordingsBackend, serve_http
from stallwatch.query.sql import LOCAL, QueryEngine
from tests.conftest import ROOT, SHARED

DATA = ROOT / "tests" / "data"
FR16 = SHARED / "fixtures" / "pytorch-fr-nccl-16rank"


def _incidents() -> list[tuple[str, Path]]:
    """The lab's incidents, the 16-rank fixtures, and every scenario of the
    torch corpus once (its 4-rank run, pickled: the 8-rank runs and the
    JSON form are the same scenarios, and test_fr_corpus reads them all)."""
    out = [(p.name, p) for p in sorted(DATA.glob("lab-*")) if p.is_dir()]
    out += [(p.parent.name, p) for p in sorted(DATA.glob("fr-torch/*-4/pickle"))]
    out += [(p.name, p) for p in sorted(FR16.iterdir()) if p.is_dir()]
    return out


INCIDENTS = _incidents()
# every surface of 32 incidents: the module's setup takes about a minute on a
# quiet machine (Spark's start the most), ten on one loaded 30-fold
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
NAMES = [n for n, _ in INCIDENTS]
FLIGHT = {n for n, p in INCIDENTS if "fr-torch" in str(p) or FR16 in p.parents}
SERVED = {n for n, p in INCIDENTS if "fr-torch" not in str(p)}

# ---- the questions, in SQL (k: the incident column on the Parquet export) ----


def q_calls(k: str = "") -> str:
    return (
        f"SELECT {k}world_rank, comm_id_hash, count(*) AS n FROM nccl_events "
        f"GROUP BY {k}world_rank, comm_id_hash"
    )


def q_behind(k: str = "") -> str:
    same = "AND e.incident = c.incident " if k else ""
    kc = "c.incident, " if k else ""
    kl = "l.incident, " if k else ""
    on_f = "AND l.incident = f.incident " if k else ""
    return (
        f"WITH last AS (SELECT {kc}c.comm_id_hash, c.world_rank, max(e.seq) AS s "
        "FROM communicators c LEFT JOIN nccl_events e ON e.host = c.host "
        "AND e.pid IS NOT DISTINCT FROM c.pid AND e.comm_id_hash = c.comm_id_hash "
        f"AND e.seq IS NOT NULL AND e.op NOT IN ('SEND', 'RECV') {same}"
        f"GROUP BY {kc}c.comm_id_hash, c.world_rank), "
        f"front AS (SELECT {k}comm_id_hash, max(s) AS m FROM last GROUP BY {k}comm_id_hash) "
        f"SELECT {kl}l.comm_id_hash, l.world_rank FROM last l JOIN front f "
        f"ON l.comm_id_hash = f.comm_id_hash {on_f}WHERE l.s < f.m"
    )


def q_in_flight(k: str = "") -> str:
    return f"SELECT {k}world_rank, comm_id_hash, elapsed_ns FROM nccl_events WHERE end_ns IS NULL"


def q_who(k: str = "") -> str:
    return f"SELECT {k}world_rank, host, pid FROM processes"


QUESTIONS: dict[str, Callable[[str], str]] = {
    "calls": q_calls,
    "behind": q_behind,
    "in_flight": q_in_flight,
    "who": q_who,
}


@dataclass
class Answers:
    calls: Counter[tuple[int | None, str | None]] | None = None  # (world rank, comm)
    behind: dict[str | None, frozenset[int | None]] | None = None
    in_flight: Counter[tuple[int | None, str | None, int]] | None = None
    in_flight_at: set[tuple[int | None, str | None]] | None = None  # (world rank, comm)
    who: dict[int | None, tuple[str | None, int | None]] | None = None
    files: dict[str, int | None] = field(default_factory=dict)  # host -> world rank


def _from_rows(rows: dict[str, list[Sequence[Any]]]) -> Answers:
    """The answers of one incident from the rows of the four SQL questions."""
    a = Answers()
    a.calls = Counter({(r[0], r[1]): int(r[2]) for r in rows["calls"]})
    behind: dict[str | None, set[int | None]] = {}
    for comm, world in rows["behind"]:
        behind.setdefault(comm, set()).add(world)
    a.behind = {c: frozenset(v) for c, v in behind.items()}
    a.in_flight = Counter((r[0], r[1], int(r[2])) for r in rows["in_flight"])
    a.in_flight_at = {(r[0], r[1]) for r in rows["in_flight"]}
    a.who = {r[0]: (r[1], r[2]) for r in rows["who"]}
    a.files = {r[1]: r[0] for r in rows["who"]}
    return a


# ---- the surfaces ---------------------------------------------------------------


def _analyze(path: Path) -> tuple[Answers, dict[int | None, tuple[str | None, int | None]]]:
    """Answers of analyze --json, and its culprits: world rank -> (host, pid)."""
    doc = json.loads(to_json(analyze_paths([str(path)])))
    a = Answers()
    behind: dict[str | None, set[int | None]] = {}
    a.in_flight_at = set()
    culprits: dict[int | None, tuple[str | None, int | None]] = {}
    for inc in doc["incidents"]:
        for c in inc["communicators"]:
            for m in c["members"]:
                if m["state"] == "behind":
                    behind.setdefault(c["comm_id_hash"], set()).add(m["world_rank"])
                if m["in_flight"]:
                    a.in_flight_at.add((m["world_rank"], c["comm_id_hash"]))
                if m["host"] is not None:
                    a.files[m["host"]] = m["world_rank"]
        for v in inc["verdicts"]:
            for c in v["culprits"]:
                culprits[c["world_rank"]] = (c["host"], c["pid"])
    a.behind = {c: frozenset(v) for c, v in behind.items()}
    return a, culprits


def _local(path: Path) -> Answers:
    recordings, _, _ = read_recordings([str(path)])
    with QueryEngine(recordings, LOCAL) as engine:
        return _from_rows({q: engine.query(sql("")).rows for q, sql in QUESTIONS.items()})


def _agents(path: Path) -> Answers:
    """One served agent per dump file, as if each were a node of its own
    (the lab's incidents and the 16-rank fixtures; the torch corpus's
    small runs take the same path as the latter, at a second each)."""
    recordings, _, _ = read_recordings([str(path)])
    handles = [serve_http(RecordingsBackend([r]), "127.0.0.1:0", None) for r in recordings]
    try:
        agents = [h.address for h in handles]
        rows = {}
        for q, sql in QUESTIONS.items():
            result = query_agents(agents, sql(""), timeout=30.0)
            assert not result.failed, result.failed
            rows[q] = result.rows
        return _from_rows(rows)
    finally:
        close_connections()
        for h in handles:
            h.close()


def _by_incident(rows: Sequence[Sequence[Any]]) -> dict[str, list[Sequence[Any]]]:
    out: dict[str, list[Sequence[Any]]] = {n: [] for n in NAMES}
    for r in rows:
        out[r[0]].append(tuple(r[1:]))
    return out


def _parquet_answers(run: Callable[[str], Sequence[Sequence[Any]]]) -> dict[str, Answers]:
    per_q = {q: _by_incident(run(sql("incident, "))) for q, sql in QUESTIONS.items()}
    return {n: _from_rows({q: per_q[q][n] for q in QUESTIONS}) for n in NAMES}


def _trace(
    path: Path, out: Path
) -> tuple[Answers, dict[int | None, tuple[str | None, int | None]]]:
    export([str(path)], out)
    events = json.loads(out.read_text())["traceEvents"]
    a = Answers()
    a.calls = Counter()
    a.in_flight = Counter()
    culprits: dict[int | None, tuple[str | None, int | None]] = {}
    for e in events:
        args = e.get("args", {})
        if e.get("cat") == "nccl":
            comm = None if args["comm_id_hash"] == "no comm" else args["comm_id_hash"]
            a.calls[(args["world_rank"], comm)] += 1
            a.files[args["host"]] = args["world_rank"]
            if args["in_flight"]:
                a.in_flight[(args["world_rank"], comm, args["elapsed_ns"])] += 1
        if e.get("cat") == "verdict" and "culprit" in args:
            c = args["culprit"]
            culprits[c["world_rank"]] = (c["host"], c["pid"])
    return a, culprits


# ---- one computation for the module ---------------------------------------------


@dataclass
class Surfaces:
    analyze: dict[str, Answers]
    culprits: dict[str, dict[int | None, tuple[str | None, int | None]]]
    local: dict[str, Answers]
    agents: dict[str, Answers]
    duckdb: dict[str, Answers]
    spark: dict[str, Answers]
    trace: dict[str, Answers]
    trace_culprits: dict[str, dict[int | None, tuple[str | None, int | None]]]


@pytest.fixture(scope="module")
def surfaces(tmp_path_factory: pytest.TempPathFactory, spark: Any) -> Iterator[Surfaces]:
    tmp = tmp_path_factory.mktemp("one-answer")
    root = tmp / "parquet"
    analyzed = {n: _analyze(p) for n, p in INCIDENTS}
    traced = {n: _trace(p, tmp / f"{n}.json") for n, p in INCIDENTS}
    for n, p in INCIDENTS:
        export_parquet([str(p)], root, incident=n)
    con = duckdb.connect()
    for t in TABLE_NAMES:
        con.execute(
            f"CREATE VIEW {t} AS SELECT * FROM read_parquet('{root}/{t}/**/*.parquet', "
            "hive_partitioning = true, hive_types = {'incident': VARCHAR, 'host': VARCHAR})"
        )
        spark.read.parquet(str(root / t)).createOrReplaceTempView(t)
    yield Surfaces(
        analyze={n: a for n, (a, _) in analyzed.items()},
        culprits={n: c for n, (_, c) in analyzed.items()},
        local={n: _local(p) for n, p in INCIDENTS},
        agents={n: _agents(p) for n, p in INCIDENTS if n in SERVED},
        duckdb=_parquet_answers(lambda sql: con.execute(sql).fetchall()),
        spark=_parquet_answers(lambda sql: [tuple(r) for r in spark.sql(sql).collect()]),
        trace={n: a for n, (a, _) in traced.items()},
        trace_culprits={n: c for n, (_, c) in traced.items()},
    )
    con.close()


# ---- the comparisons --------------------------------------------------------------


SQL_SURFACES = ("agents", "duckdb", "spark")


@pytest.mark.parametrize("name", NAMES)
def test_every_sql_surface_answers_as_query_on_the_dumps(surfaces: Surfaces, name: str) -> None:
    want = surfaces.local[name]
    for s in SQL_SURFACES:
        if s == "agents" and name not in SERVED:
            continue
        got: Answers = getattr(surfaces, s)[name]
        assert got.calls == want.calls, (s, "calls per world rank and communicator")
        assert got.behind == want.behind, (s, "ranks behind each frontier")
        assert got.in_flight == want.in_flight, (s, "calls in flight, elapsed")
        assert got.who == want.who, (s, "host and pid of each world rank")


@pytest.mark.parametrize("name", NAMES)
def test_analyze_answers_as_query(surfaces: Surfaces, name: str) -> None:
    a, want = surfaces.analyze[name], surfaces.local[name]
    assert a.behind is not None and want.behind is not None and want.calls is not None
    for comm, ranks in want.behind.items():
        assert ranks <= a.behind.get(comm, frozenset()), comm
    # analyze knows more only where a Flight Recorder file's progress counters
    # (pg_status) say how far a rank got without an entry to show it
    for comm, ranks in a.behind.items():
        for rank in ranks - want.behind.get(comm, frozenset()):
            assert name in FLIGHT and (rank, comm) not in want.calls, (comm, rank)
    # a member in flight on a communicator has a call in flight there
    assert a.in_flight_at is not None and want.in_flight_at is not None
    assert a.in_flight_at <= want.in_flight_at
    assert want.who is not None
    for rank, who in surfaces.culprits[name].items():
        if who[0] is None:  # a rank without a dump (crashed): no process in the tables
            assert rank not in want.who
            continue
        assert rank is not None and who == want.who[rank], (rank, who)


@pytest.mark.parametrize("name", NAMES)
def test_the_trace_answers_as_query(surfaces: Surfaces, name: str) -> None:
    t, want = surfaces.trace[name], surfaces.local[name]
    assert t.calls == want.calls
    assert t.in_flight == want.in_flight
    # every culprit has a track of its own, named by its world rank, on its host
    seen = {r for r, (host, _) in surfaces.culprits[name].items() if host is not None}
    assert set(surfaces.trace_culprits[name]) == seen
    assert want.who is not None
    for rank, who in surfaces.trace_culprits[name].items():
        assert rank is not None and who == want.who[rank]


RANK_IN_NAME = re.compile(r"(\d+)(?:\.json)?$")


@pytest.mark.parametrize("name", sorted(FLIGHT))
def test_a_flight_recorder_file_has_the_rank_of_its_name_everywhere(
    surfaces: Surfaces, name: str
) -> None:
    for s in ("local", "agents", "duckdb", "spark", "analyze", "trace"):
        if s == "agents" and name not in SERVED:
            continue
        files = getattr(surfaces, s)[name].files
        assert files, s
        for host, world in files.items():
            m = RANK_IN_NAME.search(host)
            assert m is not None and world == int(m.group(1)), (s, host, world)
    # every file is a process of the tables, its pid unknown (NULL), never 0
    who = surfaces.local[name].who
    assert who is not None and all(pid is None for _, pid in who.values())


def test_every_incident_is_asked(surfaces: Surfaces) -> None:
    assert len(NAMES) == len(set(NAMES)) > 30
    assert {"lab-hang-2x2", "gpu_error_1st", "lock_gil_1st"} <= set(surfaces.local)
    # the Parquet incidents are the ones asked for, by name
    assert {escape(n) for n in NAMES} == {escape(n) for n in surfaces.duckdb}

"""One answer on every surface: every incident of tests/data (the lab's, and
every form of every run of the torch corpus, 4 and 8 ranks: pickle, json,
pickle-pg, json-pg) and of the shared Flight Recorder fixtures asked the same
questions through ``analyze --json``, ``query`` on the dumps, DuckDB and
Spark on the Parquet export, ``query --agents`` against the dumps served, and
the Perfetto trace.

The questions: calls per world rank and communicator (with the rank in it);
per communicator, the world ranks behind its frontier (members whose last
collective seq there is below the highest any member entered; a member with
no call there is not counted: a table cannot tell a rank that never called
from one whose ring wrapped); calls in flight with their elapsed time (never
shorter than to the last thing their process recorded); the culprits' host
and pid; and, for Flight Recorder files, each file's world rank (which must
be the rank in its name).

Not every surface can answer every question: ``analyze --json`` has no call
counts nor elapsed times (it answers who is behind, who is in flight, each
member's rank, the culprits), and the trace has no membership (it answers
calls, calls in flight, the culprits' tracks and each file's rank).

Served: the lab's incidents and the 16-rank fixtures one agent per dump file
(a node each: the fan-out derives ranks across the answers); the torch
corpus one agent per incident, as ``stallwatch serve <folder>`` serves it,
for cost (see ``_agents``).  Cost: one Parquet export that all incidents go
into, read once by Spark and asked each question once over all incidents;
the surfaces that read one incident at a time run in two worker processes.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import duckdb
import pytest

from stallwatch.analyzer.export import export
from stallwatch.analyzer.parquet import escape, export_parquet
from stallwatch.analyzer.pipeline import analyze_paths
from stallwatch.analyzer.report import to_json
from stallwatch.commands.query import read_recordings
from stallwatch.dumpers.model import Recording
from stallwatch.query.fanout import close_connections, query_agents
from stallwatch.query.http import RecordingsBackend, serve_http
from stallwatch.query.sql import LOCAL, QueryEngine
from tests.conftest import ROOT, SHARED

DATA = ROOT / "tests" / "data"
FR16 = SHARED / "fixtures" / "pytorch-fr-nccl-16rank"
FR_FORMS = ("pickle", "json", "pickle-pg", "json-pg")  # tests/data/fr-torch/README.md


def _incidents() -> list[tuple[str, Path]]:
    """The lab's incidents, the 16-rank fixtures, and every form of every run
    of the torch corpus (4 and 8 ranks; ``pickle`` and ``json`` as torch
    wrote them, ``pickle-pg`` and ``json-pg`` where the run keeps them), each
    form an incident of its own named ``<run>.<form>``."""
    out = [(p.name, p) for p in sorted(DATA.glob("lab-*")) if p.is_dir()]
    out += [
        (f"{p.parent.name}.{p.name}", p)
        for p in sorted(DATA.glob("fr-torch/*/*"))
        if p.is_dir() and p.name in FR_FORMS
    ]
    out += [(p.name, p) for p in sorted(FR16.iterdir()) if p.is_dir()]
    return out


INCIDENTS = _incidents()
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
NAMES = [n for n, _ in INCIDENTS]
FLIGHT = {n for n, p in INCIDENTS if "fr-torch" in str(p) or FR16 in p.parents}
# served one agent per dump file (a node each): the lab's incidents and the
# 16-rank fixtures; the torch corpus one agent per incident (see _agents)
NODE_PER_FILE = {n for n, p in INCIDENTS if "fr-torch" not in str(p)}
ASKED_TABLES = ("nccl_events", "communicators", "processes")  # what the questions read

# ---- the questions, in SQL (k: the incident column on the Parquet export) ----


def q_calls(k: str = "") -> str:
    return (
        f"SELECT {k}world_rank, comm_id_hash, rank, count(*) AS n FROM nccl_events "
        f"GROUP BY {k}world_rank, comm_id_hash, rank"
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


Culprits = dict[int | None, tuple[str | None, int | None]]  # world rank -> (host, pid)


@dataclass
class Answers:
    # (world rank, comm, rank in the comm) -> calls
    calls: Counter[tuple[int | None, str | None, int | None]] | None = None
    behind: dict[str | None, frozenset[int | None]] | None = None
    in_flight: Counter[tuple[int | None, str | None, int]] | None = None
    in_flight_at: set[tuple[int | None, str | None]] | None = None  # (world rank, comm)
    who: Culprits | None = None  # world rank -> (host, pid) of every process
    files: dict[str, int | None] = field(default_factory=dict)  # host -> world rank
    # (world rank, comm) -> rank in the comm, of the members analyze names
    members: dict[tuple[int | None, str | None], int | None] = field(default_factory=dict)
    # calls in flight timed shorter than their process's own records last
    short: list[Sequence[Any]] = field(default_factory=list)


def _from_rows(rows: dict[str, list[Sequence[Any]]]) -> Answers:
    """The answers of one incident from the rows of the four SQL questions."""
    a = Answers()
    a.calls = Counter({(r[0], r[1], r[2]): int(r[3]) for r in rows["calls"]})
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


def _analyze(path: Path) -> tuple[Answers, Culprits]:
    """Answers of analyze --json, and its culprits: world rank -> (host, pid)."""
    doc = json.loads(to_json(analyze_paths([str(path)])))
    a = Answers()
    behind: dict[str | None, set[int | None]] = {}
    a.in_flight_at = set()
    culprits: Culprits = {}
    for inc in doc["incidents"]:
        for c in inc["communicators"]:
            for m in c["members"]:
                if m["state"] == "behind":
                    behind.setdefault(c["comm_id_hash"], set()).add(m["world_rank"])
                if m["in_flight"]:
                    a.in_flight_at.add((m["world_rank"], c["comm_id_hash"]))
                if m["host"] is not None:
                    a.files[m["host"]] = m["world_rank"]
                    a.members[(m["world_rank"], c["comm_id_hash"])] = m["rank"]
        for v in inc["verdicts"]:
            for c in v["culprits"]:
                culprits[c["world_rank"]] = (c["host"], c["pid"])
    a.behind = {c: frozenset(v) for c, v in behind.items()}
    return a, culprits


# A call in flight is timed up to its recording's time, which is no earlier
# than anything its process recorded: never shorter than to its process's last
# start or end (a Flight Recorder dump carries no dump time: its latest entry's).
Q_SHORT = (
    "WITH last AS (SELECT host, pid, max(greatest(timestamp_ns, coalesce(end_ns, 0))) AS t "
    "FROM nccl_events GROUP BY host, pid) "
    "SELECT e.host, e.pid, e.seq, e.elapsed_ns, l.t - e.timestamp_ns FROM nccl_events e "
    "JOIN last l ON e.host = l.host AND e.pid IS NOT DISTINCT FROM l.pid "
    "WHERE e.end_ns IS NULL AND (e.elapsed_ns IS NULL OR e.elapsed_ns < l.t - e.timestamp_ns)"
)


def _local(recordings: Sequence[Recording]) -> Answers:
    with QueryEngine(recordings, LOCAL) as engine:
        a = _from_rows({q: engine.query(sql("")).rows for q, sql in QUESTIONS.items()})
        a.short = engine.query(Q_SHORT).rows
        return a


def _agents(recordings: Sequence[Recording], per_file: bool) -> Answers:
    """The dumps served as ``stallwatch serve`` serves them, asked through
    ``query --agents``: with ``per_file``, one agent per dump file, as if
    each were a node of its own (the fan-out unions the answers and derives
    the ranks across them); otherwise one agent serving the incident's
    folder.  The torch corpus takes the latter: its 140 incidents one agent
    per file cost about 0.5 s of CPU each (an engine and four fan-outs per
    file), a whole minute, where the 16-rank fixtures already take real
    Flight Recorder dumps one per node through the same reader."""
    groups = [[r] for r in recordings] if per_file else [list(recordings)]
    handles = [
        serve_http(RecordingsBackend(g), "127.0.0.1:0", None, isolated=False) for g in groups
    ]
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


def _on_the_dumps(name: str, path: Path) -> tuple[Answers, Answers]:
    """``query`` on the dumps and ``query --agents`` on them served, from
    one read of them (both read through the one input opener)."""
    recordings, _ = read_recordings([str(path)])
    return _local(recordings), _agents(recordings, name in NODE_PER_FILE)


def _by_incident(rows: Sequence[Sequence[Any]]) -> dict[str, list[Sequence[Any]]]:
    out: dict[str, list[Sequence[Any]]] = {n: [] for n in NAMES}
    for r in rows:
        out[r[0]].append(tuple(r[1:]))
    return out


def _parquet_answers(run: Callable[[str], Sequence[Sequence[Any]]]) -> dict[str, Answers]:
    per_q = {q: _by_incident(run(sql("incident, "))) for q, sql in QUESTIONS.items()}
    return {n: _from_rows({q: per_q[q][n] for q in QUESTIONS}) for n in NAMES}


def _trace(path: Path, out: Path) -> tuple[Answers, Culprits]:
    export([str(path)], out)
    events = json.loads(out.read_text())["traceEvents"]
    a = Answers()
    a.calls = Counter()
    a.in_flight = Counter()
    culprits: Culprits = {}
    for e in events:
        args = e.get("args", {})
        if e.get("cat") == "nccl":
            comm = None if args["comm_id_hash"] == "no comm" else args["comm_id_hash"]
            a.calls[(args["world_rank"], comm, args["rank"])] += 1
            a.files[args["host"]] = args["world_rank"]
            if args["in_flight"]:
                a.in_flight[(args["world_rank"], comm, args["elapsed_ns"])] += 1
        if e.get("cat") == "verdict" and "culprit" in args:
            c = args["culprit"]
            culprits[c["world_rank"]] = (c["host"], c["pid"])
    return a, culprits


# ---- one computation for the module ---------------------------------------------


@dataclass(frozen=True)
class OneIncident:
    """What the surfaces that read one incident at a time answer about it."""

    analyze: Answers
    culprits: Culprits
    local: Answers
    agents: Answers
    trace: Answers
    trace_culprits: Culprits


def _export_one(job: tuple[str, Path, Path]) -> None:
    name, path, root = job
    export_parquet([str(path)], root, incident=name)


def _answer_one(job: tuple[str, Path, Path]) -> OneIncident:
    name, path, tmp = job
    analyzed, culprits = _analyze(path)
    traced, trace_culprits = _trace(path, tmp / f"{name}.json")
    local, agents = _on_the_dumps(name, path)
    return OneIncident(analyzed, culprits, local, agents, traced, trace_culprits)


@dataclass
class Surfaces:
    analyze: dict[str, Answers]
    culprits: dict[str, Culprits]
    local: dict[str, Answers]
    agents: dict[str, Answers]
    duckdb: dict[str, Answers]
    spark: dict[str, Answers]
    trace: dict[str, Answers]
    trace_culprits: dict[str, Culprits]


def _pool() -> ProcessPoolExecutor:
    """Workers that start clean (spawned: no copy of this process's DuckDB
    connections, agent threads or Spark gateway), one per core up to two:
    the per-incident surfaces are short Python calls, one core's worth
    each, and the suite runs one module at a time."""
    return ProcessPoolExecutor(min(2, os.cpu_count() or 1), mp_context=get_context("spawn"))


@pytest.fixture(scope="module")
def surfaces(tmp_path_factory: pytest.TempPathFactory, spark: Any) -> Iterator[Surfaces]:
    """Every incident through every surface: the Parquet export first (the
    first incident alone, which writes the export's description, then the
    rest beside it), then, while DuckDB and Spark ask all incidents at once
    in this process, the surfaces that read one incident at a time in the
    workers."""
    tmp = tmp_path_factory.mktemp("one-answer")
    root = tmp / "parquet"
    _export_one((NAMES[0], INCIDENTS[0][1], root))
    con = duckdb.connect()
    with _pool() as pool:
        list(pool.map(_export_one, [(n, p, root) for n, p in INCIDENTS[1:]], chunksize=8))
        answered = pool.map(_answer_one, [(n, p, tmp) for n, p in INCIDENTS], chunksize=4)
        for t in ASKED_TABLES:
            con.execute(
                f"CREATE VIEW {t} AS SELECT * FROM read_parquet('{root}/{t}/**/*.parquet', "
                "hive_partitioning = true, hive_types = {'incident': VARCHAR, 'host': VARCHAR})"
            )
            # read once (a file per dump and table), asked four times
            spark.read.parquet(str(root / t)).cache().createOrReplaceTempView(t)
        duck = _parquet_answers(lambda sql: con.execute(sql).fetchall())
        sparked = _parquet_answers(lambda sql: [tuple(r) for r in spark.sql(sql).collect()])
        one = dict(zip(NAMES, answered, strict=True))
    con.close()
    yield Surfaces(
        analyze={n: o.analyze for n, o in one.items()},
        culprits={n: o.culprits for n, o in one.items()},
        local={n: o.local for n, o in one.items()},
        agents={n: o.agents for n, o in one.items()},
        duckdb=duck,
        spark=sparked,
        trace={n: o.trace for n, o in one.items()},
        trace_culprits={n: o.trace_culprits for n, o in one.items()},
    )
    for t in ASKED_TABLES:
        spark.catalog.dropTempView(t)


# ---- the comparisons --------------------------------------------------------------


SQL_SURFACES = ("agents", "duckdb", "spark")


@pytest.mark.parametrize("name", NAMES)
def test_every_sql_surface_answers_as_query_on_the_dumps(surfaces: Surfaces, name: str) -> None:
    want = surfaces.local[name]
    for s in SQL_SURFACES:
        got: Answers = getattr(surfaces, s)[name]
        assert got.calls == want.calls, (s, "calls per world rank and communicator")
        assert got.behind == want.behind, (s, "ranks behind each frontier")
        assert got.in_flight == want.in_flight, (s, "calls in flight, elapsed")
        assert got.who == want.who, (s, "host and pid of each world rank")


@pytest.mark.parametrize("name", NAMES)
def test_calls_in_flight_are_timed_to_the_recording(surfaces: Surfaces, name: str) -> None:
    # the other surfaces answer the same elapsed times (compared above)
    assert surfaces.local[name].short == []


@pytest.mark.parametrize("name", NAMES)
def test_analyze_answers_as_query(surfaces: Surfaces, name: str) -> None:
    a, want = surfaces.analyze[name], surfaces.local[name]
    assert a.behind is not None and want.behind is not None and want.calls is not None
    ranked = {(w, c): r for w, c, r in want.calls}
    for comm, ranks in want.behind.items():
        assert ranks <= a.behind.get(comm, frozenset()), comm
    # analyze knows more only where a Flight Recorder file's progress counters
    # (pg_status) say how far a rank got without an entry to show it
    for comm, ranks in a.behind.items():
        for rank in ranks - want.behind.get(comm, frozenset()):
            assert name in FLIGHT and (rank, comm) not in ranked, (comm, rank)
    # a member's rank in a communicator is its calls' rank there
    for key, rank in a.members.items():
        assert ranked.get(key, rank) == rank, (key, rank, ranked[key])
    # a member in flight on a communicator has a call in flight there
    assert a.in_flight_at is not None and want.in_flight_at is not None
    assert a.in_flight_at <= want.in_flight_at
    assert want.who is not None
    for rank, who in surfaces.culprits[name].items():
        # a rank without a dump (crashed, or its host cut off and named by its
        # address): no process in the tables, nor a pid in the verdict
        if who[1] is None and rank not in want.who:
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
        assert rank is not None and who == surfaces.culprits[name][rank]
        if who[1] is None and rank not in want.who:  # no dump holds it: no process
            continue
        assert who == want.who[rank]


RANK_IN_NAME = re.compile(r"(\d+)(?:\.json)?$")


@pytest.mark.parametrize("name", sorted(FLIGHT))
def test_a_flight_recorder_file_has_the_rank_of_its_name_everywhere(
    surfaces: Surfaces, name: str
) -> None:
    for s in ("local", "agents", "duckdb", "spark", "analyze", "trace"):
        files = getattr(surfaces, s)[name].files
        assert files, s
        for host, world in files.items():
            m = RANK_IN_NAME.search(host)
            assert m is not None and world == int(m.group(1)), (s, host, world)
    # every file is a process of the tables, its pid unknown (NULL), never 0
    who = surfaces.local[name].who
    assert who is not None and all(pid is None for _, pid in who.values())


def test_every_incident_is_asked(surfaces: Surfaces) -> None:
    assert len(NAMES) == len(set(NAMES))
    assert {"lab-hang-2x2", "gpu_error_1st", "lock_gil_1st"} <= set(surfaces.local)
    # every form of every run of the torch corpus, 4 and 8 ranks
    runs = [p for p in sorted((DATA / "fr-torch").iterdir()) if p.is_dir()]
    forms = {f"{r.name}.{f.name}" for r in runs for f in r.iterdir() if f.is_dir()}
    assert forms <= set(NAMES)
    assert {r.name.rsplit("-", 1)[1] for r in runs} == {"4", "8"}
    assert len(forms) >= 2 * len(runs) >= 120
    # the Parquet incidents are the ones asked for, by name
    assert {escape(n) for n in NAMES} == {escape(n) for n in surfaces.duckdb}

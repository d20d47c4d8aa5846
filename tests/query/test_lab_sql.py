"""SQL on the dumps of a real lab incident: the columns answer the questions
people ask, and every SQL example of docs/sql.md runs as printed.

One recorded run (4 nodes of 2 ranks, real agents and eBPF, a hang) is
shared by the module.  The lab's job makes, beside its world communicator,
a split per node (color = node, key = local rank) and a split per local
rank across nodes (color = local rank, key = node): the agents cannot see
the ranks of either, so SQL must derive them.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stallwatch.analyzer.pipeline import analyze_paths
from stallwatch.commands.query import QUERY_EPILOG
from stallwatch.dumpers.format import read_dump
from stallwatch.dumpers.model import Recording
from stallwatch.dumpers.sqltables import EXAMPLES
from stallwatch.query.sql import LOCAL, QueryEngine

ROOT = Path(__file__).resolve().parents[2]
NODES, PER_NODE = 4, 2
AGENT_PORT = 9400  # the lab's agents listen there
COLLECTIVES = "('ALL_REDUCE', 'ALL_GATHER', 'REDUCE_SCATTER', 'BROADCAST', 'REDUCE')"

pytestmark = [pytest.mark.lab, pytest.mark.slow]


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("lab-sql")
    cmd = [sys.executable, "-m", "stallwatch", "lab", "run", "--nodes", str(NODES)]
    cmd += ["--ranks-per-node", str(PER_NODE), "--steps", "12", "--fault", "hang:rank=5,step=6"]
    cmd += ["--record", "--dump-dir", str(folder), "--stall-timeout", "3", "--timeout", "120"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    found = sorted(folder.rglob("*.msgpack"))
    assert len(found) == NODES, f"one dump per node expected: {found}\n{done.stdout}{done.stderr}"
    return folder


@pytest.fixture(scope="module")
def recordings(dumps: Path) -> list[Recording]:
    return [read_dump(p) for p in sorted(dumps.rglob("*.msgpack"))]


@pytest.fixture(scope="module")
def engine(recordings: list[Recording]) -> Iterator[QueryEngine]:
    with QueryEngine(recordings, LOCAL) as e:
        yield e


def rows(engine: QueryEngine, sql: str) -> list[tuple[Any, ...]]:
    return engine.query(sql).rows


def test_every_collective_row_has_a_rank_and_a_world_rank(engine: QueryEngine) -> None:
    ((total, no_rank, no_world, comms),) = rows(
        engine,
        "SELECT count(*), count(*) FILTER (WHERE rank IS NULL), "
        "count(*) FILTER (WHERE world_rank IS NULL), count(DISTINCT comm_id_hash) "
        f"FROM nccl_events WHERE op IN {COLLECTIVES}",
    )
    assert total > 0 and comms == 1 + PER_NODE + NODES  # world, and both kinds of split
    assert (no_rank, no_world) == (0, 0)


def test_split_membership_read_by_joining_communicators_to_their_calls(
    engine: QueryEngine,
) -> None:
    got = rows(
        engine,
        """SELECT c.comm_id_hash, c.color, c.rank, c.world_rank, count(e.seq),
                  count(*) FILTER (WHERE e.rank IS DISTINCT FROM c.rank)
           FROM communicators c
           JOIN nccl_events e
             ON e.comm_id_hash = c.comm_id_hash AND e.host = c.host AND e.pid = c.pid
           WHERE c.parent_hash IS NOT NULL
           GROUP BY ALL ORDER BY c.comm_id_hash, c.rank""",
    )
    members: dict[str, list[int]] = {}
    colors: dict[str, int] = {}
    for comm, color, rank, world, calls, disagree in got:
        assert rank == len(members.setdefault(comm, []))  # ranks 0..n-1, each once
        members[comm].append(world)
        colors[comm] = color
        assert calls > 0 and disagree == 0  # each call's rank is its member's
    by_node = {n: [n * PER_NODE + i for i in range(PER_NODE)] for n in range(NODES)}
    by_local = {i: [n * PER_NODE + i for n in range(NODES)] for i in range(PER_NODE)}
    assert len(members) == NODES + PER_NODE
    for comm, world in members.items():
        # color = node: ranked by local rank; color = local rank: ranked by node
        split = by_node if len(world) == PER_NODE else by_local
        assert world == split[colors[comm]], comm


def test_the_ids_of_a_report_find_their_rows(dumps: Path, engine: QueryEngine) -> None:
    (incident,) = analyze_paths([str(dumps)]).incidents
    verdict = incident.verdicts[0]
    assert verdict.comm_id_hash is not None and re.fullmatch(
        r"0x[0-9a-f]{16}", verdict.comm_id_hash
    )
    ((n, ranks),) = rows(
        engine,
        f"SELECT count(*), list(DISTINCT world_rank) FROM nccl_events "
        f"WHERE comm_id_hash = '{verdict.comm_id_hash}' AND seq = {verdict.seq}",
    )
    assert n > 0 and set(verdict.ranks) <= set(range(NODES * PER_NODE)) and ranks
    bad = rows(
        engine,
        "SELECT count(*) FROM (SELECT comm_id_hash AS id FROM nccl_events UNION ALL "
        "SELECT comm_id_hash FROM communicators UNION ALL SELECT parent_hash FROM communicators) "
        "WHERE id IS NOT NULL AND NOT regexp_full_match(id, '0x[0-9a-f]{16}')",
    )
    assert bad == [(0,)]


def test_calls_in_flight_have_an_elapsed_time_up_to_the_dump(engine: QueryEngine) -> None:
    ((hung, shortest, nulls, same),) = rows(
        engine,
        "SELECT count(*) FILTER (WHERE state = 'scheduled'), "
        "min(elapsed_ns) FILTER (WHERE state = 'scheduled'), "
        "count(duration_ns) FILTER (WHERE state = 'scheduled'), "
        "bool_and(elapsed_ns = duration_ns) FILTER (WHERE state = 'enqueued') "
        f"FROM nccl_events WHERE op IN {COLLECTIVES}",
    )
    assert hung > 0 and nulls == 0 and same is True
    assert shortest >= 2_000_000_000  # they waited past the 3 s stall timeout, about
    states = {s for (s,) in rows(engine, "SELECT DISTINCT state FROM nccl_events")}
    assert states == {"scheduled", "enqueued"}  # the lab has no device-side source


def test_unknown_is_null_and_calls_without_data_carry_none(engine: QueryEngine) -> None:
    ((n, with_data),) = rows(
        engine,
        "SELECT count(*), count(datatype) + count(redop) + count(count) + count(seq) "
        "FROM nccl_events WHERE op IN ('GET_UNIQUE_ID', 'GROUP_START', 'GROUP_END')",
    )
    assert n > 0 and with_data == 0
    negative = rows(
        engine,
        "SELECT count(*) FROM comm_events WHERE rank < 0 OR nranks < 0 OR color < 0 OR key < 0",
    )
    assert negative == [(0,)]
    ((sizes,),) = rows(engine, "SELECT count(*) FROM communicators WHERE nranks IS NULL")
    assert sizes == 0


def test_tcp_rows_name_states_and_families_and_leave_the_agents_out(
    engine: QueryEngine, dumps: Path
) -> None:
    names = rows(engine, "SELECT DISTINCT family, state, newstate FROM tcp_events")
    assert names and {f for f, _, _ in names} == {"ipv4"}
    assert {s for _, s, _ in names} <= {
        "ESTABLISHED", "SYN_SENT", "SYN_RECV", "FIN_WAIT1", "FIN_WAIT2", "TIME_WAIT", "CLOSE",
        "CLOSE_WAIT", "LAST_ACK", "LISTEN", "CLOSING", "NEW_SYN_RECV",
    }  # fmt: skip
    # the agents did talk to each other (one asked its peers to dump) and were waited for
    logs = "".join(p.read_text() for p in dumps.glob("*.agent.log"))
    assert "peer " in logs
    own = rows(engine, f"SELECT count(*) FROM tcp_events WHERE {AGENT_PORT} IN (sport, dport)")
    assert own == [(0,)]
    # every row of a rank's process names its rank; which ranks have rows at
    # all depends on whether the agent placed them before their connections
    # formed (the stall dumps before any closes them): on a loaded machine
    # the kernel leaves a late-placed rank's earlier rows out (counted)
    unnamed = rows(
        engine,
        "SELECT count(*) FROM tcp_events t WHERE t.world_rank IS NULL AND EXISTS "
        "(SELECT 1 FROM communicators c WHERE c.host = t.host AND c.pid = t.pid)",
    )
    assert unnamed == [(0,)]
    ((ranks,),) = rows(engine, "SELECT count(DISTINCT world_rank) FROM tcp_events")
    assert 1 <= ranks <= NODES * PER_NODE


def test_every_rank_process_lists_the_libraries_it_maps(engine: QueryEngine) -> None:
    got = rows(engine, "SELECT world_rank, libs FROM processes ORDER BY world_rank")
    assert [w for w, _ in got] == list(range(NODES * PER_NODE))
    assert all(libs and all("libnccl" in lib for lib in libs) for _, libs in got)


# ---- the examples of docs/sql.md -------------------------------------------


def readme_sql() -> list[str]:
    """Every SQL example of docs/sql.md (and of ``query --help``): ```sql
    blocks, and the SQL argument of every ``stallwatch query`` line."""
    text = (ROOT / "docs" / "sql.md").read_text()
    out = [b.strip() for b in re.findall(r"```sql\n(.*?)```", text, re.S)]
    for block in [*re.findall(r"```\n(.*?)```", text, re.S), QUERY_EPILOG]:
        command = ""
        for line in block.splitlines():
            command += line.rstrip("\\").strip() + " "
            if line.endswith("\\"):
                continue
            if command.startswith("stallwatch query "):
                out.append(_sql_of(command))
            command = ""
    return out


def _sql_of(command: str) -> str:
    words = shlex.split(command.split("#")[0])
    if "--example" in words:  # a named query
        return EXAMPLES[words[words.index("--example") + 1]]
    sql = [w for w in words if re.match(r"\s*(SELECT|WITH|FROM)\b", w, re.I)]
    assert len(sql) == 1, f"no SQL in an example: {command}"
    return sql[0]


def test_the_docs_have_the_examples_this_test_runs() -> None:
    examples = readme_sql()
    assert len(examples) >= 8
    assert all("..." not in sql for sql in examples), "an example that cannot run as printed"


@pytest.mark.parametrize("sql", readme_sql())
def test_docs_sql_runs_as_printed_on_lab_dumps(engine: QueryEngine, sql: str) -> None:
    result = engine.query(sql)
    assert result.columns
    if "GROUP BY" in sql and "tcp_retransmit_skb" not in sql and "duration_ns >" not in sql:
        assert result.rows, f"an example that answers nothing on a hung job: {sql}"

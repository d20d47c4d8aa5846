"""End to end: a 4-node lab job with packet loss on node 1, one agent per node.

The seed query (dumpers.sqltables.SEED_QUERY) fanned out to the 4 live agents finds node 1's
retransmits inside its slow AllReduces; then every agent dumps, and the same
query over each node's dump returns the same rows as that node's agent did
live, for the same window (collectives that ended before a cut-off taken
before the live query).

The agents listen on their node's address inside its network namespace, with
a token and mutual TLS (the run's own CA), so the client runs inside node 0's
namespace with the lab's client certificate, as a client on a cluster node
would.  The merged answer is the same query over the four dumps in one
local query.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import json
import secrets
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

from bench.bench_sql import SEED_QUERY
from stallwatch.dumpers.errors import QueryError
from stallwatch.dumpers.format import read_dump
from stallwatch.dumpers.model import Recording
from stallwatch.lab import faults, netns, runner
from stallwatch.lab.runner import AGENT_PORT, Lab, agent_dump_dir
from stallwatch.query.fanout import FanoutResult, close_connections, query_agents
from stallwatch.query.sql import LOCAL, QueryEngine
from stallwatch.query.tls import ClientTls

pytestmark = [pytest.mark.bpf, pytest.mark.lab, pytest.mark.slow]

T = TypeVar("T")
NODES = 4
LOSSY = 1
SLOW = "AND duration_ns > 50000000)"
RANK = "duration_ns, rank, nranks"


def windowed(cutoff_ns: int | str) -> str:
    """The seed query over collectives that ended before the cut-off (the
    hosts' own monotonic clock: a live agent converts its rows to the
    incident's clock with the clock pair it samples at the query, its dump
    with the pair sampled at the dump, which the wall clock's slew may move
    by microseconds), every
    row (no LIMIT: ties at the limit would make the comparison arbitrary),
    by world rank: the rank in a split communicator is derived over the
    recordings queried together, which one agent cannot do alone (its rows
    say NULL there), so that one column differs between live agents and
    their dumps read together."""
    assert SLOW in SEED_QUERY and "LIMIT 20" in SEED_QUERY and RANK in SEED_QUERY
    ended = f"host_timestamp_ns + duration_ns <= {cutoff_ns}"
    sql = SEED_QUERY.replace(SLOW, f"AND duration_ns > 50000000 AND {ended})")
    return sql.replace(" LIMIT 20", "").replace(RANK, "duration_ns, world_rank AS rank, nranks")


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    cfg = runner.RunConfig(
        nodes=NODES,
        ranks_per_node=1,
        steps=8,
        timeout=240.0,
        record=True,
        dump_dir=tmp_path_factory.mktemp("sql-lab"),
        stall_timeout=90.0,
        faults=faults.parse_faults([f"loss:node={LOSSY},pct=8"]),
        run_id=netns.new_run_id("q"),  # a subnet no other lab of the machine routes
    )
    the_lab = runner.make_lab(cfg, runner.preflight(cfg))
    try:
        runner.set_up(the_lab)
        gave_up = runner.wait_for_job(the_lab, time.monotonic())
        assert gave_up is None, gave_up
        yield the_lab
    finally:
        close_connections()
        problems = the_lab.teardown()
        # agents detach their uprobes slowly on a busy machine: reap them
        for sup in the_lab.agents.values():
            sup.wait_stopped(120)
        for proc in the_lab.ranks.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=120)
    # Detaching uprobes takes an agent seconds; on a loaded machine more than
    # the lab's grace, after which it is killed: that is not this test's fault.
    assert not [p for p in problems if "ignored SIGTERM" not in p], problems


def _in_node0(lab: Lab, fn: Callable[[], T]) -> T:
    """Run ``fn`` in node 0's namespace, fan-out threads included: they are
    started afresh from inside it, so no request leaves through the root
    namespace towards the nodes' private addresses."""

    def inside() -> T:
        close_connections()
        try:
            return fn()
        finally:
            close_connections()

    return netns.in_netns(lab.node(0).netns, inside)


def _agents(lab: Lab) -> list[str]:
    return [f"{lab.node(k).ip}:{AGENT_PORT}" for k in range(NODES)]


def _token(lab: Lab) -> str:
    return (lab.run_dir / "agent.token").read_text().strip()


def _tls(lab: Lab) -> ClientTls:
    assert lab.certs is not None
    return lab.certs.client()


def _ask(lab: Lab, agents: list[str], sql: str) -> FanoutResult:
    return _in_node0(lab, lambda: query_agents(agents, sql, _token(lab), 10, tls=_tls(lab)))


def _ask_dump(agent: str, token: str, incident: str, context: ssl.SSLContext) -> dict[str, object]:
    body = json.dumps({"reason": "sql e2e", "incident_id": incident}).encode()
    req = urllib.request.Request(
        f"https://{agent}/dump",
        data=body,
        method="POST",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30, context=context) as resp:
        answer: dict[str, object] = json.loads(resp.read())
    return answer


def _dump_of(lab: Lab, node: int, incident: str, timeout: float = 60) -> Recording:
    folder = agent_dump_dir(lab.cfg, node)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for path in sorted(folder.glob("*.msgpack")):
            rec = read_dump(path)
            if rec.trigger is not None and rec.trigger.incident_id == incident:
                return rec
        time.sleep(0.25)
    raise AssertionError(f"node {node} wrote no dump for {incident} in {folder}")


def _sorted(rows: list[Any]) -> list[tuple[object, ...]]:
    """In a stable order, NULL (an unknown rank) included."""
    return sorted(
        (tuple(r) for r in rows),
        key=lambda row: [(v is not None, v if v is not None else 0) for v in row],
    )


# The seed query, each host's windows joined with its own retransmits only.
BY_HOST = """
WITH slow AS (
  SELECT host, timestamp_ns, duration_ns, rank FROM nccl_events
  WHERE op = 'ALL_REDUCE' AND duration_ns > 50000000)
SELECT s.host, s.rank, s.duration_ns / 1e6 AS ms, count(t.timestamp_ns) AS retransmits_in_window
FROM slow s LEFT JOIN tcp_events t
  ON t.host = s.host AND t.event = 'tcp_retransmit_skb'
 AND t.timestamp_ns BETWEEN s.timestamp_ns AND s.timestamp_ns + s.duration_ns
GROUP BY ALL
"""
ENDED = "host_timestamp_ns + duration_ns <= {cut}"  # on the hosts' own clock (see windowed)
MERGED = [
    f"SELECT host, count(*) AS n FROM nccl_events WHERE {ENDED} GROUP BY host",
    f"SELECT DISTINCT host, op FROM nccl_events WHERE {ENDED}",
    "SELECT op, count(*), sum(bytes), max(duration_ns) FROM nccl_events "
    f"WHERE {ENDED} GROUP BY ALL",
    f"SELECT host, seq, duration_ns FROM nccl_events WHERE {ENDED} "
    "ORDER BY duration_ns DESC, host, seq LIMIT 5",
]


def test_fanout_to_live_agents_then_the_same_rows_from_their_dumps(lab: Lab) -> None:
    agents, token = _agents(lab), _token(lab)
    live = _ask(lab, agents, SEED_QUERY)
    assert not live.failed, live.failed
    assert {a.host for a in live.answers} == {f"node{k}" for k in range(NODES)}
    assert live.columns == ("rank", "ms", "retransmits_in_window")
    by_host = _ask(lab, agents, BY_HOST)
    lossy = [r for r in by_host.rows if r[0] == f"node{LOSSY}"]
    assert lossy and max(r[3] for r in lossy) > 0, "no retransmit inside node 1's slow AllReduces"

    cutoff = time.monotonic_ns()  # one monotonic clock: the nodes share the kernel
    live_rows = {
        sql: _ask(lab, agents, sql.format(cut=cutoff)) for sql in [*MERGED, windowed("{cut}")]
    }
    assert all(not r.failed for r in live_rows.values())

    incident = "sql-e2e-" + secrets.token_hex(3)
    context = _tls(lab).context()
    for agent in agents:
        _in_node0(lab, functools.partial(_ask_dump, agent, token, incident, context))
    dumps = [_dump_of(lab, k, incident) for k in range(NODES)]
    with QueryEngine(dumps, LOCAL) as engine:
        for sql, live_result in live_rows.items():
            local = engine.query(sql.format(cut=cutoff)).rows
            assert local, f"nothing to compare: {sql}"
            if "ORDER BY" in sql and "LIMIT" in sql:
                assert [tuple(r) for r in live_result.rows] == local, sql
            else:
                assert _sorted(live_result.rows) == _sorted(local), sql


def test_metrics_of_live_agents_parse(lab: Lab) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    token = _token(lab)

    context = _tls(lab).context()

    def scrape(agent: str) -> str:
        req = urllib.request.Request(
            f"https://{agent}/metrics", headers={"Authorization": f"Bearer {token}"}
        )
        with urllib.request.urlopen(req, timeout=10, context=context) as resp:
            return str(resp.read().decode())

    for agent in _agents(lab):
        text = _in_node0(lab, functools.partial(scrape, agent))
        families = list(text_string_to_metric_families(text))
        assert families, f"{agent}: no metrics"


def test_a_live_agent_refuses_file_access_and_keeps_recording(lab: Lab) -> None:
    agents, token = _agents(lab), _token(lab)
    before = _ask(lab, agents[:1], "SELECT count(*) AS n FROM nccl_events")
    with pytest.raises(QueryError, match="read_text"):  # refused before it is sent
        _ask(lab, agents[:1], "SELECT * FROM read_text('/etc/shadow')")
    body = json.dumps({"sql": "SELECT * FROM read_text('/etc/shadow')"}).encode()
    refused = _in_node0(lab, functools.partial(_post_query, agents[0], token, body, _tls(lab)))
    assert refused[0] == 400
    after = _ask(lab, agents[:1], "SELECT count(*) AS n FROM nccl_events")
    assert not after.failed and after.rows[0][0] >= before.rows[0][0] > 0


def test_plain_http_with_the_token_is_refused_and_no_certificate_gets_nothing(lab: Lab) -> None:
    agent, token = _agents(lab)[0], _token(lab)
    body = json.dumps({"sql": "SELECT 1"}).encode()
    status, answer = _in_node0(lab, functools.partial(_post_query, agent, token, body, None))
    assert status == 400 and "HTTPS only" in answer
    no_cert = ClientTls(_tls(lab).ca)
    result = _in_node0(lab, lambda: query_agents([agent], "SELECT 1", token, 10, tls=no_cert))
    assert len(result.failed) == 1 and result.failed[0].error.startswith("TLS: ")


def _post_query(agent: str, token: str, body: bytes, tls: ClientTls | None) -> tuple[int, str]:
    host, port = agent.rsplit(":", 1)
    conn = (
        http.client.HTTPSConnection(host, int(port), context=tls.context(), timeout=10)
        if tls is not None
        else http.client.HTTPConnection(host, int(port), timeout=10)
    )
    try:
        conn.request("POST", "/query", body, {"Authorization": f"Bearer {token}"})
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def test_windowed_query_keeps_the_seed_query() -> None:
    sql = windowed(123)
    assert "duration_ns <= 123" in sql and "LIMIT" not in sql and "tcp_retransmit_skb" in sql
    assert "world_rank AS rank" in sql

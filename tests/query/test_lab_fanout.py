"""End to end: a 4-node lab job with packet loss on node 1, one agent per node.

The DESIGN.md seed query fanned out to the 4 live agents finds node 1's
retransmits inside its slow AllReduces; then every agent dumps, and the same
query over each node's dump returns the same rows as that node's agent did
live, for the same window (collectives that ended before a cut-off taken
before the live query).

The agents listen on their node's address inside its network namespace, so
the client runs inside node 0's namespace, as a client on a cluster node would.
"""

from __future__ import annotations

import contextlib
import functools
import json
import secrets
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest
from stallwatch.dumpers.format import read_dump
from stallwatch.dumpers.model import Recording
from stallwatch.lab import faults, netns, runner
from stallwatch.lab.runner import AGENT_PORT, Lab, agent_dump_dir
from stallwatch.query.fanout import FanoutResult, close_connections, query_agents
from stallwatch.query.sql import LOCAL, QueryEngine

from bench.bench_sql import SEED_QUERY

pytestmark = [pytest.mark.bpf, pytest.mark.lab, pytest.mark.slow]

T = TypeVar("T")
NODES = 4
LOSSY = 1
SLOW = "AND duration_ns > 50000000)"


def windowed(cutoff_ns: int) -> str:
    """The seed query over collectives that ended before the cut-off, every
    row (no LIMIT: ties at the limit would make the comparison arbitrary)."""
    assert SLOW in SEED_QUERY and "LIMIT 20" in SEED_QUERY
    sql = SEED_QUERY.replace(SLOW, f"AND duration_ns > 50000000 AND end_ns <= {cutoff_ns})")
    return sql.replace(" LIMIT 20", "")


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
        run_id="q" + secrets.token_hex(3),
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
        for proc in [*the_lab.agents.values(), *the_lab.ranks.values()]:
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


def _ask_dump(agent: str, token: str, incident: str) -> dict[str, object]:
    body = json.dumps({"reason": "sql e2e", "incident_id": incident}).encode()
    req = urllib.request.Request(
        f"http://{agent}/dump",
        data=body,
        method="POST",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
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


def _by_host(result: FanoutResult) -> dict[str, list[tuple[object, ...]]]:
    out: dict[str, list[tuple[object, ...]]] = {}
    for host, *rest in result.rows:
        out.setdefault(host, []).append(tuple(rest))
    return {h: _sorted(rows) for h, rows in out.items()}


def _sorted(rows: list[tuple[object, ...]]) -> list[tuple[object, ...]]:
    """In a stable order, NULL (an unknown rank) included."""
    return sorted(rows, key=lambda row: [(v is not None, v if v is not None else 0) for v in row])


def test_fanout_to_live_agents_then_the_same_rows_from_their_dumps(lab: Lab) -> None:
    agents, token = _agents(lab), _token(lab)
    live = _in_node0(lab, lambda: query_agents(agents, SEED_QUERY, token, timeout=10))
    assert not live.failed, live.failed
    assert {a.host for a in live.answers} == {f"node{k}" for k in range(NODES)}
    assert live.columns == ("host", "rank", "ms", "retransmits_in_window")
    lossy = [r for r in live.rows if r[0] == f"node{LOSSY}"]
    assert lossy and max(r[3] for r in lossy) > 0, "no retransmit inside node 1's slow AllReduces"

    cutoff = time.monotonic_ns()  # one monotonic clock: the nodes share the kernel
    sql = windowed(cutoff)
    live_window = _in_node0(lab, lambda: query_agents(agents, sql, token, timeout=10))
    assert not live_window.failed, live_window.failed
    live_rows = _by_host(live_window)
    assert live_rows.get(f"node{LOSSY}"), "no slow AllReduce on the lossy node before the cut-off"

    incident = "sql-e2e-" + secrets.token_hex(3)
    for agent in agents:
        _in_node0(lab, functools.partial(_ask_dump, agent, token, incident))
    for k in range(NODES):
        with QueryEngine([_dump_of(lab, k, incident)], LOCAL) as engine:
            dumped = _sorted(engine.query(sql).rows)
        assert dumped == live_rows.get(f"node{k}", []), f"node{k}: dump and live agent differ"


def test_metrics_of_live_agents_parse(lab: Lab) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    token = _token(lab)

    def scrape(agent: str) -> str:
        req = urllib.request.Request(
            f"http://{agent}/metrics", headers={"Authorization": f"Bearer {token}"}
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            return str(resp.read().decode())

    for agent in _agents(lab):
        text = _in_node0(lab, functools.partial(scrape, agent))
        families = list(text_string_to_metric_families(text))
        assert families, f"{agent}: no metrics"


def test_a_live_agent_refuses_file_access_and_keeps_recording(lab: Lab) -> None:
    agents, token = _agents(lab), _token(lab)
    before = _in_node0(
        lab, lambda: query_agents(agents[:1], "SELECT count(*) AS n FROM nccl_events", token)
    )
    bad = _in_node0(
        lab, lambda: query_agents(agents[:1], "SELECT * FROM read_text('/etc/shadow')", token)
    )
    assert len(bad.failed) == 1 and "HTTP 400" in bad.failed[0].error
    after = _in_node0(
        lab, lambda: query_agents(agents[:1], "SELECT count(*) AS n FROM nccl_events", token)
    )
    assert not after.failed and after.rows[0][1] >= before.rows[0][1] > 0


def test_windowed_query_keeps_the_seed_query() -> None:
    sql = windowed(123)
    assert "end_ns <= 123" in sql and "LIMIT" not in sql and "tcp_retransmit_skb" in sql

"""The engine of the HTTP surface in a process of its own: every answer
bounded (queries, rows, bytes), its memory bounded whatever DuckDB does, a
query cut within a second of its time limit, a busy engine said at once,
and its memory given back when idle.  Real servers, real engine processes."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.bench_sql import Synthetic, synthetic_recording
from stallwatch.query.answers import fetch_answer
from stallwatch.query.engineproc import ChildConfig, EngineProcess
from stallwatch.query.http import RecordingsBackend, ServerHandle, serve_http
from stallwatch.query.sql import Limits, QueryEngine
from stallwatch.query.wire import decode_frames
from tests.query.test_http import FakeAgent, request

MiB = 2**20
# a query DuckDB runs for seconds without looking at its interrupt (one
# chunk of rows, each a long regular expression replacement): 4.3 s under a
# 1 s time limit in one process, 70 MB
UNINTERRUPTIBLE = (
    "SELECT sum(length(regexp_replace(repeat('ab', 300000 + range::INT), 'b', 'cc', 'g'))) "
    "FROM range(60)"
)


def _rss_mb(pid: int | str = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def fetch(address: str, queries: list[str]) -> tuple[int, object]:
    return request(address, "POST", "/fetch", json.dumps({"queries": queries}).encode())


def query(address: str, sql: str) -> tuple[int, object]:
    return request(address, "POST", "/query", json.dumps({"sql": sql}).encode())


@pytest.fixture(scope="module")
def agent() -> FakeAgent:
    return FakeAgent(synthetic_recording(Synthetic(host="node7", steps=50, tcp_rows=300)))


@pytest.fixture(scope="module")
def server(agent: FakeAgent) -> Iterator[ServerHandle]:
    # the bounds, not the clock, must answer the tests that use it
    handle = serve_http(agent, "127.0.0.1:0", None, Limits(time_limit_s=5))
    _warm(handle)
    yield handle
    handle.close()


def _warm(handle: ServerHandle) -> None:
    """The engine process started (seconds on a loaded machine): the tests
    time and bound what comes after."""
    import http.client

    host, port = handle.address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request("POST", "/query", json.dumps({"sql": "SELECT 1"}).encode())
        assert conn.getresponse().status == 200
    finally:
        conn.close()


def test_an_answer_is_bounded_in_queries_and_bytes(server: ServerHandle) -> None:
    """17 queries in one request, a cross join of 640,000 wide rows, a 40 MB
    /query answer: each a 400 naming the limit; the engine's peak stays bounded."""
    status, doc = fetch(server.address, ["SELECT 1"] * 17)
    assert status == 400 and "17 queries in one request: the limit is 16" in doc["error"]  # type: ignore[index]
    # the answer's bound first, on an engine that ran nothing heavy yet: after
    # the cross join below its engine may be near its memory (a CI run on a
    # loaded machine was refused for the engine's memory here)
    status, doc = query(server.address, "SELECT repeat('x', 4000) AS big FROM range(10000)")
    assert status == 400 and "over its limit of 32 MiB" in doc["error"], doc  # type: ignore[index]
    status, doc = fetch(server.address, ["SELECT * FROM nccl_events a, nccl_events b, range(4)"])
    # refused at a bound: the answer's 32 MiB, or the engine's memory first
    bounds = ("over its limit of 32 MiB", "needs more memory than the engine has")
    assert status == 400 and any(b in doc["error"] for b in bounds), doc  # type: ignore[index]
    peak = server.counters()["query_engine_peak_resident_bytes"] / MiB
    assert 0 < peak < 400, f"the engine's peak: {peak:.0f} MiB"


def test_rows_are_counted_across_the_queries_of_a_request(agent: FakeAgent) -> None:
    rows = len(agent.rec.rings["nccl"].rows)
    with QueryEngine([agent.rec], Limits(max_fetch_rows=rows + 99)) as engine:
        body = b"".join(fetch_answer(engine, ["SELECT seq FROM nccl_events"] * 3, "node7"))
    first, second, third = decode_frames(body)
    assert (first.table.num_rows, first.truncated) == (rows, False)
    assert (second.table.num_rows, second.truncated) == (99, True)
    assert (third.table.num_rows, third.truncated) == (0, True)


def test_memory_past_the_engines_bound_is_an_error_not_the_agents(server: ServerHandle) -> None:
    """An 800 MB list that DuckDB's memory limit does not see (7 GB resident
    in one process, measured): refused inside the engine's bound; this
    process, the agent's stand-in, holds none of it."""
    before = _rss_mb()
    status, doc = query(server.address, "SELECT count(*) FROM (SELECT unnest(range(100000000)))")
    assert status == 400 and "memory" in doc["error"], doc  # type: ignore[index]
    assert _rss_mb() - before < 50
    peak = server.counters()["query_engine_peak_resident_bytes"] / MiB
    assert peak < 500, f"the engine's peak: {peak:.0f} MiB"
    assert query(server.address, "SELECT 42 AS x")[0] == 200


@pytest.mark.solo  # judged by time
def test_a_query_is_cut_within_a_second_of_its_limit(agent: FakeAgent) -> None:
    """Served dumps (loaded once per engine process), the engine started
    first: what is timed is the query (28 s in one process)."""
    served = RecordingsBackend([agent.rec])
    handle = serve_http(served, "127.0.0.1:0", None, Limits(time_limit_s=1))
    try:
        _warm(handle)
        t0 = time.monotonic()
        status, doc = query(handle.address, UNINTERRUPTIBLE)
        took = time.monotonic() - t0
        assert status == 400 and "longer than 1 s" in doc["error"], doc  # type: ignore[index]
        assert took < 2.0, f"answered after {took:.2f} s for a limit of 1 s"
        assert handle.counters()["query_engine_stopped"] == 1
        status, doc = query(handle.address, "SELECT 42 AS x")
        assert (status, doc["rows"]) == (200, [[42]])  # type: ignore[index]
        assert handle.counters()["query_engine_starts"] == 2
    finally:
        handle.close()


def test_a_query_that_finds_the_engine_busy_is_answered_at_once(server: ServerHandle) -> None:
    slow = threading.Thread(target=query, args=(server.address, UNINTERRUPTIBLE))
    slow.start()
    try:
        engine = server.engine
        assert isinstance(engine, EngineProcess)
        deadline = time.monotonic() + 30
        while not engine._lock.locked():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        t0 = time.monotonic()
        status, doc = query(server.address, "SELECT 1")
        took = time.monotonic() - t0
    finally:
        slow.join()
    assert status == 503 and doc["error"].startswith("busy"), doc  # type: ignore[index]
    assert took < 1.0, f"busy said after {took:.2f} s"
    assert server.counters()["query_engine_busy"] >= 1


def test_the_engine_ends_when_idle_and_comes_back(agent: FakeAgent) -> None:
    engine = EngineProcess(lambda: [agent.rec], ChildConfig(Limits(), idle_s=3.0))
    try:
        body = json.loads(
            b"".join(engine.query("SELECT count(*) AS n FROM nccl_events", None, "node7"))
        )
        assert body["rows"] == [[len(agent.rec.rings["nccl"].rows)]]
        pid = engine.pid()
        assert pid is not None and _rss_mb(pid) > 0
        deadline = time.monotonic() + 20
        while os.path.exists(f"/proc/{pid}/status") and _rss_mb(pid) > 0:
            assert time.monotonic() < deadline, "the idle engine did not end"
            time.sleep(0.2)
        body = json.loads(b"".join(engine.query("SELECT 7 AS n", None, "node7")))
        assert body["rows"] == [[7]] and engine.stats.starts == 2
    finally:
        engine.close()

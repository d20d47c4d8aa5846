"""Fan-out: one query to many agents (``serve`` servers in-process), answered
as the same query over all their dumps in one local query."""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import pytest

from bench.bench_sql import SEED_QUERY, Synthetic, synthetic_recording
from stallwatch.dumpers.errors import QueryError, QueryRefused, UsageError
from stallwatch.dumpers.model import Recording
from stallwatch.query.fanout import close_connections, parse_agent, query_agents
from stallwatch.query.http import RecordingsBackend, serve_http
from stallwatch.query.sql import LOCAL, Limits, QueryEngine

TOKEN = "fanout-token"


def distinct_durations(rec: Recording, salt: int) -> Recording:
    """Every call of every host a duration of its own, so that ``ORDER BY
    duration LIMIT n`` has one answer (no ties at the limit)."""
    rows = rec.rings["nccl"].rows
    done = rows["end_ns"] > 0
    rows["end_ns"][done] += (np.arange(int(done.sum())) * 16 + salt).astype(np.uint64)
    return rec


@pytest.fixture(scope="module")
def recordings() -> list[Recording]:
    return [
        distinct_durations(
            synthetic_recording(
                Synthetic(
                    host=f"node{i}", first_rank=4 * i, steps=50, tcp_rows=300 - 60 * i, seed=i
                )
            ),
            salt=i,
        )
        for i in range(4)
    ]


@pytest.fixture(scope="module")
def agents(recordings: list[Recording]) -> Iterator[list[str]]:
    handles = [
        serve_http(RecordingsBackend([r]), "127.0.0.1:0", None, isolated=False) for r in recordings
    ]
    yield [h.address for h in handles]
    close_connections()
    for h in handles:
        h.close()


def _dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # closed again: nobody listens


def _norm(rows: list[Any]) -> list[tuple[Any, ...]]:
    """Rows comparable across addition orders (float sums differ in their
    last bits)."""
    return [
        tuple(round(v, 6 - math.floor(math.log10(abs(v)))) if isinstance(v, float) and v
              else v for v in row)
        for row in rows
    ]  # fmt: skip


def _key(row: tuple[Any, ...]) -> list[tuple[bool, str]]:
    return [(v is None, repr(v)) for v in row]


MERGED = {
    "seed query": SEED_QUERY,
    "top rows": "SELECT host, rank, seq, duration_ns / 1e6 AS ms FROM nccl_events "
    "ORDER BY ms DESC LIMIT 7",
    "top rows by a column not selected, offset": "SELECT rank, seq FROM nccl_events "
    "ORDER BY duration_ns LIMIT 5 OFFSET 3",
    "group by host": "SELECT host, count(*) AS n, sum(bytes) AS b FROM nccl_events "
    "GROUP BY host ORDER BY host",
    "aggregates across the cluster": "SELECT op, count(*), avg(duration_ns), min(timestamp_ns), "
    "max(rank), sum(duration_ns) FILTER (WHERE rank % 2 = 0) FROM nccl_events GROUP BY ALL",
    "global aggregate": "SELECT count(*) AS n, max(duration_ns) AS worst FROM nccl_events "
    "WHERE duration_ns > 50000000",
    "having and order by an aggregate": "SELECT rank, avg(duration_ns) / 1e6 AS ms "
    "FROM nccl_events GROUP BY rank HAVING count(*) > 10 ORDER BY ms DESC, rank LIMIT 5",
    "distinct": "SELECT DISTINCT rank FROM nccl_events ORDER BY rank",
    "distinct pairs": "SELECT DISTINCT host, pid FROM tcp_events",
    "count distinct": "SELECT count(DISTINCT rank), count(DISTINCT host) FROM nccl_events",
    "median (does not combine)": "SELECT host, median(duration_ns) FROM nccl_events "
    "GROUP BY host ORDER BY host",
    "join across hosts": "SELECT n.host, count(*) AS pairs FROM nccl_events n JOIN tcp_events t "
    "ON t.host = n.host AND t.event = 'tcp_retransmit_skb' AND n.rank = 0 GROUP BY 1 ORDER BY 1",
    "window": "SELECT host, rank, row_number() OVER (PARTITION BY host ORDER BY duration_ns "
    "DESC) AS r FROM nccl_events QUALIFY r <= 2 ORDER BY host, r",
    "subquery": "SELECT host, count(*) FROM nccl_events WHERE duration_ns > "
    "(SELECT avg(duration_ns) FROM nccl_events) GROUP BY host ORDER BY host",
    "union": "SELECT host, 'tcp' AS kind FROM tcp_events UNION SELECT host, 'nccl' "
    "FROM nccl_events ORDER BY ALL",
    "no table": "SELECT 1 AS one",
}


@pytest.mark.parametrize("sql", MERGED.values(), ids=MERGED.keys())
def test_the_same_rows_as_one_query_over_all_dumps(
    agents: list[str], recordings: list[Recording], sql: str
) -> None:
    result = query_agents(agents, sql)
    assert not result.failed and not result.partial
    with QueryEngine(recordings, LOCAL) as engine:
        local = engine.query(sql)
    assert result.columns == local.columns and result.types == local.types
    assert local.rows, "an empty answer proves nothing"
    rows = _norm([tuple(r) for r in result.rows])
    if "ORDER BY" in sql:
        assert rows == _norm(local.rows)
    else:
        assert sorted(rows, key=_key) == sorted(_norm(local.rows), key=_key)


def test_the_seed_query_joins_windows_across_hosts_as_one_table_would(
    agents: list[str], recordings: list[Recording]
) -> None:
    """The seed query names no host: over one table, node0's retransmits
    fall inside every host's slow windows (their clocks are alike here), so
    the merged counts exceed any one agent's own."""
    every = SEED_QUERY.replace(" LIMIT 20", "")
    merged = query_agents(agents, every)
    with QueryEngine(recordings[1:2], LOCAL) as engine:
        own = engine.query(every).rows
    assert sum(r[2] for r in merged.rows) > 4 * sum(r[2] for r in own) > 0


def test_a_limit_without_an_order_takes_rows_of_the_cluster(agents: list[str]) -> None:
    result = query_agents(agents, "SELECT host, seq FROM nccl_events LIMIT 10")
    assert len(result.rows) == 10 and not result.partial
    everything = query_agents(agents, "SELECT host, seq FROM nccl_events")
    assert {tuple(r) for r in result.rows} <= {tuple(r) for r in everything.rows}


def test_a_dead_agent_gives_a_partial_result_naming_it(
    agents: list[str], recordings: list[Recording]
) -> None:
    dead = _dead_address()
    result = query_agents([*agents, dead], "SELECT count(*) FROM nccl_events", timeout=2)
    assert [f.agent for f in result.failed] == [dead] and result.partial
    assert "cannot reach" in result.failed[0].error
    assert len(result.answers) == 4
    assert result.rows == [[sum(len(r.rings["nccl"].rows) for r in recordings)]]


def test_a_bad_query_fails_before_any_agent_is_asked() -> None:
    dead = [_dead_address()]  # would fail if it were asked
    with pytest.raises(QueryRefused, match="only SELECT"):
        query_agents(dead, "DROP TABLE nccl_events")
    with pytest.raises(QueryError, match="no_such_column"):
        query_agents(dead, "SELECT no_such_column FROM nccl_events")


class _Slow:
    """A live-like backend whose snapshot takes ``delay`` seconds, counting
    how many snapshots are taken at once across every instance."""

    busy = 0
    most = 0
    lock = threading.Lock()

    def __init__(self, rec: Recording, delay: float, host: str = "slowpoke") -> None:
        self.rec, self.delay, self.host = rec, delay, host

    def recording(self) -> Recording:
        with _Slow.lock:
            _Slow.busy += 1
            _Slow.most = max(_Slow.most, _Slow.busy)
        time.sleep(self.delay)
        with _Slow.lock:
            _Slow.busy -= 1
        return self.rec

    def metrics_text(self) -> str:
        return ""


@pytest.mark.solo  # bounded by time: judged alone
def test_a_slow_agent_times_out_and_the_rest_answer(
    agents: list[str], recordings: list[Recording]
) -> None:
    slow = serve_http(_Slow(recordings[0], 1.5), "127.0.0.1:0", None, isolated=False)
    try:
        start = time.monotonic()
        result = query_agents(
            [*agents, slow.address], "SELECT count(*) FROM tcp_events", timeout=0.5
        )
        assert time.monotonic() - start < 1.4
        assert [f.agent for f in result.failed] == [slow.address]
        assert "within 0.5 s" in result.failed[0].error
        assert result.rows == [[sum(len(r.rings["tcp"].rows) for r in recordings)]]
    finally:
        slow.close()


@pytest.mark.solo  # bounded by time: judged alone
def test_concurrency_is_bounded_and_each_agent_has_its_own_time(
    recordings: list[Recording],
) -> None:
    """Six agents that take 0.3 s each, two asked at a time: the fan-out takes
    three rounds, longer than the 0.5 s each agent is given, and all answer."""
    handles = [
        serve_http(_Slow(recordings[0], 0.3, f"slow{i}"), "127.0.0.1:0", None, isolated=False)
        for i in range(6)
    ]
    _Slow.most = 0
    try:
        start = time.monotonic()
        result = query_agents(
            [h.address for h in handles], "SELECT count(*) AS n FROM nccl_events",
            timeout=1.0, concurrency=2,
        )  # fmt: skip
        assert not result.failed, result.failed
        assert time.monotonic() - start >= 0.85
        assert _Slow.most == 2
        assert result.rows == [[6 * len(recordings[0].rings["nccl"].rows)]]
    finally:
        close_connections()
        for h in handles:
            h.close()


def test_an_agent_with_more_rows_than_it_may_send_is_named(recordings: list[Recording]) -> None:
    handle = serve_http(
        RecordingsBackend(recordings[:1]),
        "127.0.0.1:0",
        None,
        Limits(max_fetch_rows=50),
        isolated=False,
    )
    try:
        result = query_agents([handle.address], "SELECT rank, seq FROM nccl_events")
        assert result.partial and result.truncated and not result.failed
        assert [a.truncated for a in result.answers] == [True] and len(result.rows) == 50
        # a partial aggregate is one row per group: nothing is cut
        whole = query_agents([handle.address], "SELECT count(*) FROM nccl_events")
        assert not whole.partial and whole.rows == [[len(recordings[0].rings["nccl"].rows)]]
    finally:
        handle.close()


def test_token_reaches_the_agents(recordings: list[Recording]) -> None:
    handles = [
        serve_http(RecordingsBackend([r]), "127.0.0.1:0", TOKEN, isolated=False)
        for r in recordings[:2]
    ]
    try:
        addrs = [h.address for h in handles]
        denied = query_agents(addrs, "SELECT 1")
        assert len(denied.failed) == 2 and all("401" in f.error for f in denied.failed)
        assert not denied.answers and denied.rows == []
        allowed = query_agents(
            addrs, "SELECT host FROM processes GROUP BY host ORDER BY host", TOKEN
        )
        assert not allowed.failed and allowed.rows == [["node0"], ["node1"]]
    finally:
        for h in handles:
            h.close()


class _OldAgent(BaseHTTPRequestHandler):
    """An agent of an older version: it has no /fetch."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        body = json.dumps({"error": f"no such endpoint: {self.path}"}).encode()
        self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_an_agent_that_cannot_answer_is_named(agents: list[str]) -> None:
    other = ThreadingHTTPServer(("127.0.0.1", 0), _OldAgent)
    thread = threading.Thread(target=other.serve_forever, daemon=True)
    thread.start()
    address = f"127.0.0.1:{other.server_address[1]}"
    try:
        result = query_agents([agents[0], address], "SELECT count(*) AS n FROM nccl_events")
        assert result.rows == [[201]]
        assert [f.agent for f in result.failed] == [address]
        assert "HTTP 404: no such endpoint: /fetch" in result.failed[0].error
    finally:
        other.shutdown()
        other.server_close()


def test_persistent_connections_survive_a_restarted_agent(recordings: list[Recording]) -> None:
    handle = serve_http(RecordingsBackend([recordings[0]]), "127.0.0.1:0", None, isolated=False)
    address = handle.address
    assert not query_agents([address], "SELECT count(*) FROM nccl_events").failed
    handle.close()
    port = int(address.rsplit(":", 1)[1])
    handle = serve_http(
        RecordingsBackend([recordings[0]]), f"127.0.0.1:{port}", None, isolated=False
    )
    try:
        assert not query_agents([address], "SELECT count(*) FROM nccl_events").failed
    finally:
        handle.close()


def test_parse_agent() -> None:
    assert parse_agent("node1:9400") == ("node1", 9400)
    assert parse_agent("http://[::1]:80/") == ("::1", 80)
    assert parse_agent("https://node1:9400") == ("node1", 9400)
    for bad in ("node1", ":9400", "node1:http", "node1:0", "node1:70000"):
        with pytest.raises(UsageError, match="HOST:PORT"):
            parse_agent(bad)
    with pytest.raises(UsageError, match="no agents"):
        query_agents([], "SELECT 1")
    with pytest.raises(UsageError, match="--concurrency"):
        query_agents(["node1:9400"], "SELECT 1", concurrency=0)


@pytest.mark.solo  # bounded by time: judged alone
def test_fanout_is_fast_on_loopback(agents: list[str]) -> None:
    query_agents(agents, SEED_QUERY)
    times = []
    for _ in range(5):
        result = query_agents(agents, SEED_QUERY)
        assert not result.failed
        times.append(result.elapsed_ms)
    # The benchmark checks 100 ms on a quiet machine; the test leaves room
    # for a busy CI runner.
    assert sorted(times)[2] < 1000


def test_concurrent_fanouts_share_the_pool(agents: list[str]) -> None:
    errors: list[str] = []

    def work() -> None:
        for _ in range(3):
            r = query_agents(agents, "SELECT count(*) FROM nccl_events")
            errors.extend(f.error for f in r.failed)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []

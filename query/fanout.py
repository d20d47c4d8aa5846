"""One SQL query sent to many agents at once, answers merged with their host.

:func:`query_agents` posts the query to every agent's ``/query`` in parallel
(a process-wide pool of up to 128 client threads, HTTP/1.1 keep-alive
connections kept between calls), waits at most ``timeout`` seconds for all
of them together, and merges the rows.  Every table already has a ``host``
column; when a query's result lacks one, a leading ``host`` column names the
agent's host.

Rows are concatenated in the order the agents were given, each agent's rows in
the order that agent returned them: an ``ORDER BY ... LIMIT n`` applies per
agent (up to n rows from each), not to the merged result.

An agent that cannot be reached, answers late, refuses the query or returns
columns that differ from the others' is named in ``failed`` with the reason;
the others' rows are still returned (a partial result).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from stallwatch.dumpers.errors import AgentError, UsageError

DEFAULT_TIMEOUT_S = 5.0
_RETRYABLE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)


@dataclass(frozen=True, slots=True)
class AgentAnswer:
    agent: str  # the address as given
    host: str  # the host name the agent reports
    columns: tuple[str, ...]
    types: tuple[str, ...]
    rows: list[list[Any]]
    truncated: bool
    elapsed_ms: float  # the agent's own query time


@dataclass(frozen=True, slots=True)
class AgentFailure:
    agent: str
    error: str


@dataclass(frozen=True, slots=True)
class FanoutResult:
    columns: tuple[str, ...]
    types: tuple[str, ...]
    rows: list[list[Any]]
    answers: tuple[AgentAnswer, ...]
    failed: tuple[AgentFailure, ...]
    elapsed_ms: float  # end to end, as the caller saw it

    @property
    def truncated(self) -> bool:
        return any(a.truncated for a in self.answers)


def parse_agent(agent: str) -> tuple[str, int]:
    """``host:port``, ``[v6]:port`` or ``http://host:port``."""
    text = agent.strip().removeprefix("http://").rstrip("/")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"agent {agent!r}: expected HOST:PORT, e.g. node1:9400")
    return host.strip("[]"), int(port)


class _Pool:
    """Idle keep-alive connections per agent, safe to share between threads."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, int, float], list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()

    def take(self, host: str, port: int, timeout: float) -> tuple[http.client.HTTPConnection, bool]:
        with self._lock:
            idle = self._idle.get((host, port, timeout))
            if idle:
                return idle.pop(), True
        return http.client.HTTPConnection(host, port, timeout=timeout), False

    def give(self, host: str, port: int, timeout: float, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            self._idle.setdefault((host, port, timeout), []).append(conn)

    def clear(self) -> None:
        with self._lock:
            conns = [c for idle in self._idle.values() for c in idle]
            self._idle.clear()
        for c in conns:
            c.close()


_POOL = _Pool()
_WORKERS = 128  # agents asked at once; more wait for a free thread
_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def _threads() -> ThreadPoolExecutor:
    """One pool of client threads for the process, started on first use:
    a fan-out does not pay for starting a thread per agent each time."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="fanout")
        return _executor


def _post(agent: str, body: bytes, headers: dict[str, str], timeout: float) -> tuple[int, bytes]:
    host, port = parse_agent(agent)
    for _ in range(2):  # a pooled connection the agent closed: retry once, fresh
        conn, reused = _POOL.take(host, port, timeout)
        try:
            conn.request("POST", "/query", body, headers)
            resp = conn.getresponse()
            data = resp.read()
        except _RETRYABLE:
            conn.close()
            if reused:
                continue
            raise
        except BaseException:
            conn.close()
            raise
        if resp.will_close:
            conn.close()
        else:
            _POOL.give(host, port, timeout, conn)
        return resp.status, data
    raise AgentError(f"{agent}: connection closed twice")  # pragma: no cover


def _error_text(status: int, data: bytes) -> str:
    try:
        return f"HTTP {status}: {json.loads(data)['error']}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}: {data[:200].decode(errors='replace')}"


def _ask(agent: str, body: bytes, headers: dict[str, str], timeout: float) -> AgentAnswer:
    try:
        status, data = _post(agent, body, headers, timeout)
    except TimeoutError:
        raise AgentError(f"no answer within {timeout:g} s") from None
    except OSError as exc:
        raise AgentError(f"cannot reach the agent: {exc.strerror or exc}") from None
    except http.client.HTTPException as exc:
        raise AgentError(f"bad HTTP answer: {type(exc).__name__} {exc}") from None
    if status != 200:
        raise AgentError(_error_text(status, data))
    try:
        doc = json.loads(data)
        return AgentAnswer(
            agent=agent,
            host=str(doc["host"]),
            columns=tuple(doc["columns"]),
            types=tuple(doc["types"]),
            rows=doc["rows"],
            truncated=bool(doc["truncated"]),
            elapsed_ms=float(doc["elapsed_ms"]),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise AgentError(f"the answer is not a query result: {exc}") from None


def _merge(
    answers: list[AgentAnswer], failed: list[AgentFailure]
) -> tuple[tuple[str, ...], tuple[str, ...], list[list[Any]], list[AgentAnswer]]:
    if not answers:
        return (), (), [], []
    columns, types = answers[0].columns, answers[0].types
    kept, rows = [], []
    for a in answers:
        if a.columns != columns:
            failed.append(
                AgentFailure(a.agent, f"columns {list(a.columns)} differ from {list(columns)}")
            )
            continue
        kept.append(a)
        if "host" in columns:
            rows.extend(a.rows)
        else:
            rows.extend([a.host, *r] for r in a.rows)
    if "host" not in columns:
        columns, types = ("host", *columns), ("VARCHAR", *types)
    return columns, types, rows, kept


def query_agents(
    agents: Sequence[str],
    sql: str,
    token: str | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    limit: int | None = None,
) -> FanoutResult:
    """Send ``sql`` to every agent in parallel and merge what comes back
    within ``timeout`` seconds."""
    if not agents:
        raise UsageError("no agents given")
    for agent in agents:
        parse_agent(agent)
    start = time.perf_counter()
    doc: dict[str, Any] = {"sql": sql} if limit is None else {"sql": sql, "limit": limit}
    body = json.dumps(doc).encode()
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    pool = _threads()
    futures = {a: pool.submit(_ask, a, body, headers, timeout) for a in agents}
    wait(futures.values(), timeout=timeout)
    for future in futures.values():
        future.cancel()  # not started yet (more agents than threads): give up on it
    answers, failed = _collect(futures, timeout)
    columns, types, rows, kept = _merge(answers, failed)
    elapsed = (time.perf_counter() - start) * 1e3
    return FanoutResult(columns, types, rows, tuple(kept), tuple(failed), elapsed)


def _collect(
    futures: dict[str, Future[AgentAnswer]], timeout: float
) -> tuple[list[AgentAnswer], list[AgentFailure]]:
    answers, failed = [], []
    for agent, future in futures.items():
        if future.cancelled() or not future.done():
            failed.append(AgentFailure(agent, f"no answer within {timeout:g} s"))
            continue
        exc = future.exception()
        if exc is None:
            answers.append(future.result())
        elif isinstance(exc, AgentError):
            failed.append(AgentFailure(agent, str(exc)))
        else:
            failed.append(AgentFailure(agent, f"{type(exc).__name__}: {exc}"))
    return answers, failed


def close_connections() -> None:
    """Close the pooled keep-alive connections and stop the client threads
    (tests, long-lived callers).  The next fan-out starts fresh threads from
    its caller, so they share the caller's network namespace: a thread keeps
    the namespace of the thread that started it."""
    global _executor
    _POOL.clear()
    with _executor_lock:
        executor, _executor = _executor, None
    if executor is not None:
        executor.shutdown(wait=True)

"""One SQL query sent to many agents at once, answered as one table.

:func:`query_agents` plans the query (``query.plan``: what each agent must
send so that the client can answer the query over the union of all agents'
tables), posts the fetch queries to every agent's ``/fetch`` in parallel, and
runs the final query over the union in the client's own DuckDB.  The result
is what the same SQL returns over all the agents' dumps in one local query:
``ORDER BY``, ``LIMIT``, aggregates, ``DISTINCT`` and ``GROUP BY host`` apply
across the cluster.  Every table has a ``host`` column, filled by the agent
that sent the row.

Bounded: at most ``concurrency`` agents are asked at once (a process-wide
pool of client threads; ``query.agentclient`` keeps HTTP/1.1 connections
alive between calls);
each agent has ``timeout`` seconds from the moment it is asked.  An agent
that cannot be reached, answers late, refuses or sends rows of another shape
is named in ``failed`` with the reason; the others' rows are still merged (a
partial result).  An agent that had more rows than it may send
(``Limits.max_fetch_rows``) is named in ``truncated``.

TLS: with a :class:`~stallwatch.query.tls.ClientTls` (or an ``https://``
address), agents are reached over HTTPS, their certificate verified against
the CA file, the client's own certificate presented if given (mutual TLS).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import pyarrow as pa

from stallwatch.dumpers.errors import AgentError, UsageError
from stallwatch.dumpers.model import Clock, CommInfo, Recording
from stallwatch.dumpers.rankevidence import Evidence
from stallwatch.dumpers.ranks import Ranks

from .agentclient import Address, AgentClient, close_connections, context_of, parse_address
from .plan import IDENTITY, Plan, final_connection, merge_tables, plan
from .sql import run_on_tables
from .tls import ClientTls
from .wire import ARROW_FRAMES, Frame, decode_frames

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_CONCURRENCY = 128


@dataclass(frozen=True, slots=True)
class AgentAnswer:
    agent: str  # the address as given
    host: str  # the host name the agent reports
    truncated: bool  # the agent had more rows than it may send
    elapsed_ms: float  # asked to answered, as the client saw it


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
    limited: bool = False  # more rows than the caller's limit

    @property
    def truncated(self) -> bool:
        return self.limited or any(a.truncated for a in self.answers)

    @property
    def partial(self) -> bool:
        """Some agent's rows are missing from the answer, in part or whole."""
        return bool(self.failed) or any(a.truncated for a in self.answers)


def parse_agent(agent: str) -> tuple[str, int]:
    """``host:port``, ``[v6]:port``, ``http://host:port`` or ``https://...``."""
    address = parse_address(agent)
    return address.host, address.port


@dataclass(frozen=True, slots=True)
class _Request:
    body: bytes
    token: str | None
    timeout: float
    tls: ClientTls | None


def _ask(t: Address, req: _Request) -> list[Frame]:
    client = AgentClient(t, req.token, req.tls, req.timeout, keep_alive=True)
    reply = client.post("/fetch", req.body)  # AgentError: no answer
    if not reply.ok:
        raise AgentError(reply.error_text())
    if reply.content_type != ARROW_FRAMES:
        kind = reply.content_type or "untyped"
        raise AgentError(f"the answer is {kind}, not rows: an older agent?")
    try:
        return decode_frames(reply.body)
    except ValueError as exc:
        raise AgentError(f"the answer is not rows: {exc}") from None


T = TypeVar("T")


class _Batch(Generic[T]):
    """One fan-out: at most ``concurrency`` threads take the next agent until
    none is left; each agent's answer (what ``call`` makes of it), error and
    the moment it was asked.

    The threads are started by the caller for this fan-out (a thread start is
    tens of microseconds), so they share its network namespace, and the
    whole batch is handed out at once: no per-agent future to create and
    signal, which on a busy machine costs more than the request itself."""

    def __init__(
        self, targets: list[Address], timeout: float, call: Callable[[Address], T]
    ) -> None:
        self.targets, self.timeout, self.call = targets, timeout, call
        self.asked: list[float | None] = [None] * len(targets)
        self.answers: list[T | None] = [None] * len(targets)
        self.errors: list[str | None] = [None] * len(targets)
        self.took: list[float | None] = [None] * len(targets)  # seconds, once answered
        self.finished = 0
        self._next = 0
        self.cond = threading.Condition()

    def run(self, concurrency: int) -> None:
        for k in range(min(concurrency, len(self.targets))):
            threading.Thread(target=self._work, name=f"fanout-{k}", daemon=True).start()

    def _work(self) -> None:
        n = len(self.targets)
        while True:
            with self.cond:
                if self._next >= n:
                    return
                i, self._next = self._next, self._next + 1
                self.asked[i] = asked = time.monotonic()
            answer, error = None, None
            try:
                answer = self.call(self.targets[i])
            except AgentError as exc:
                error = str(exc)
            except Exception as exc:  # a bug must not hang the fan-out
                error = f"{type(exc).__name__}: {exc}"
            with self.cond:
                self.answers[i], self.errors[i] = answer, error
                self.took[i] = time.monotonic() - asked
                self.finished += 1
                if self.finished == n:
                    self.cond.notify()

    def wait(self) -> list[bool]:
        """Wait until every agent answered or had ``timeout`` seconds since
        it was asked (agents past ``concurrency`` wait for a free thread
        first); which ones answered in time.  Woken once all have answered,
        otherwise it looks every 50 ms at most (a wake-up per answer would
        cost a scan of every agent per answer)."""
        n, timeout = len(self.targets), self.timeout
        with self.cond:
            while self.finished < n:
                now = time.monotonic()
                ends = [
                    at + timeout
                    for i, at in enumerate(self.asked)
                    if at is not None and self.took[i] is None
                ]
                if self._next >= n and all(end <= now for end in ends):
                    break
                upcoming = min((end for end in ends if end > now), default=now + 0.05)
                self.cond.wait(min(0.05, max(0.005, upcoming - now)))
            self._next = n  # nobody asks the rest
            return [t is not None for t in self.took]


def query_agents(
    agents: Sequence[str],
    sql: str,
    token: str | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    limit: int | None = None,
    tls: ClientTls | None = None,
    concurrency: int = DEFAULT_CONCURRENCY,
) -> FanoutResult:
    """The answer to ``sql`` over the union of every agent's tables, from
    the agents that answered within ``timeout`` seconds of being asked.
    QueryError/QueryRefused for a query that fails before any agent is asked."""
    if not agents:
        raise UsageError("no agents given")
    if concurrency < 1:
        raise UsageError(f"--concurrency must be 1 or more, got {concurrency}")
    targets = [parse_address(a, tls is not None) for a in agents]
    start = time.perf_counter()
    the_plan = plan(sql)
    req = _request(the_plan, token, timeout, tls)
    answers, failed, tables = _gather(targets, req, the_plan, concurrency)
    if the_plan.derives_ranks:
        tables = fill_ranks(tables)
    if not answers:
        elapsed = (time.perf_counter() - start) * 1e3
        return FanoutResult((), (), [], (), tuple(failed), elapsed)
    result = run_on_tables(tables, the_plan.final_sql, limit, final_connection())
    rows = [list(r) for r in result.rows]
    columns, types = the_plan.columns, the_plan.types
    if result.columns != columns or result.types != types:
        rows = _cast(tables, the_plan, limit)
    elapsed = (time.perf_counter() - start) * 1e3
    return FanoutResult(
        columns, types, rows, tuple(answers), tuple(failed), elapsed, result.truncated
    )


def _request(the_plan: Plan, token: str | None, timeout: float, tls: ClientTls | None) -> _Request:
    body = json.dumps({"queries": [f.sql for f in the_plan.fetches]}).encode()
    if tls is not None:
        context_of(tls)  # a bad file is named before any agent is asked
    return _Request(body, token, timeout, tls)


def _gather(
    targets: list[Address], req: _Request, the_plan: Plan, concurrency: int
) -> tuple[list[AgentAnswer], list[AgentFailure], dict[str, pa.Table]]:
    batch = _Batch(targets, req.timeout, lambda t: _ask(t, req))
    batch.run(concurrency)
    answered = batch.wait()
    answers, failed = [], []
    parts: list[list[pa.Table]] = [[] for _ in the_plan.fetches]
    for i, t in enumerate(targets):
        frames, error = batch.answers[i], batch.errors[i]
        if not answered[i]:
            error = f"no answer within {req.timeout:g} s"
        elif frames is not None and len(frames) != len(the_plan.fetches):
            error = f"sent {len(frames)} tables for {len(the_plan.fetches)} queries"
        if error is not None or frames is None:
            failed.append(AgentFailure(t.text, error or "no answer"))
            continue
        host = frames[0].host if frames else t.host
        elapsed = (batch.took[i] or 0.0) * 1e3
        answers.append(AgentAnswer(t.text, host, any(f.truncated for f in frames), elapsed))
        for k, frame in enumerate(frames):
            parts[k].append(frame.table)
    return answers, failed, _union(the_plan, parts)


@dataclass(frozen=True, slots=True)
class AgentReply(Generic[T]):
    agent: str  # the address as given
    value: T  # what ``parse`` made of the answer
    elapsed_ms: float  # asked to answered (and parsed), as the client saw it


def call_agents(
    agents: Sequence[str],
    path: str,
    parse: Callable[[str, str, bytes], T],
    doc: Mapping[str, object] | None = None,
    token: str | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    tls: ClientTls | None = None,
    concurrency: int = DEFAULT_CONCURRENCY,
) -> tuple[list[AgentReply[T]], list[AgentFailure]]:
    """``POST path`` with ``doc`` (``GET path`` when None) to every agent at
    once, as the SQL fan-out asks (``concurrency``, ``timeout`` from the
    moment each is asked, kept-alive connections of ``query.agentclient``).
    Each 200 answer goes through ``parse(agent, content type, body)`` on the
    thread that fetched it; an AgentError or ValueError it raises, or any
    other status, fails that agent.  Returns the replies and the failures,
    each in the order of ``agents``."""
    if not agents:
        raise UsageError("no agents given")
    if concurrency < 1:
        raise UsageError(f"--concurrency must be 1 or more, got {concurrency}")
    targets = [parse_address(a, tls is not None) for a in agents]
    if tls is not None:
        context_of(tls)  # a bad file is named before any agent is asked

    def call(t: Address) -> T:
        client = AgentClient(t, token, tls, timeout, keep_alive=True)
        reply = client.get(path) if doc is None else client.post_json(path, doc)
        if not reply.ok:
            raise AgentError(reply.error_text())
        try:
            return parse(t.text, reply.content_type, reply.body)
        except ValueError as exc:
            raise AgentError(str(exc)) from None

    batch = _Batch(targets, timeout, call)
    batch.run(concurrency)
    answered = batch.wait()
    replies, failed = [], []
    for i, t in enumerate(targets):
        answer, error = batch.answers[i], batch.errors[i]
        if not answered[i]:
            error = f"no answer within {timeout:g} s"
        if error is not None or answer is None:
            failed.append(AgentFailure(t.text, error or "no answer"))
            continue
        replies.append(AgentReply(t.text, answer, (batch.took[i] or 0.0) * 1e3))
    return replies, failed


def _union(the_plan: Plan, parts: list[list[pa.Table]]) -> dict[str, pa.Table]:
    return {
        fetch.table: merge_tables(tables_of_fetch)
        for fetch, tables_of_fetch in zip(the_plan.fetches, parts, strict=True)
        if tables_of_fetch
    }


def _cast(tables: dict[str, pa.Table], the_plan: Plan, limit: int | None) -> list[list[Any]]:
    """The final query again, its columns cast to the names and types the
    same query gives over dumps (a sum of partial sums is a DECIMAL where
    the local sum is a HUGEINT, for example)."""
    items = ", ".join(
        f'CAST(#{i + 1} AS {t}) AS "{c.replace(chr(34), chr(34) * 2)}"'
        for i, (c, t) in enumerate(zip(the_plan.columns, the_plan.types, strict=True))
    )
    sql = f"SELECT {items} FROM ({the_plan.final_sql.rstrip().rstrip(';')})"
    return [list(r) for r in run_on_tables(tables, sql, limit, final_connection()).rows]


def _hash(text: str | None) -> int:
    return int(text, 16) if text else 0


def _minus(value: int | None) -> int:
    return -1 if value is None else value


def _identity(rows: pa.Table) -> Ranks:
    """Ranks derived over every agent's communicators, as one local query
    over all their dumps derives them (``dumpers.ranks``)."""
    by_host: dict[str, list[CommInfo]] = {}
    named: dict[tuple[str, int], int] = {}
    evidence: dict[tuple[tuple[str, int], int], Evidence] = {}
    for r in rows.to_pylist():
        pid = r["pid"] or 0
        info = CommInfo(
            pid, 0, _hash(r["comm_id_hash"]), _minus(r["rank"]), _minus(r["nranks"]),
            _hash(r["parent_hash"]), _minus(r["color"]), _minus(r["key"]),
            init_ns=r["init_ns"] or 0,
        )  # fmt: skip
        by_host.setdefault(r["host"], []).append(info)
        if r["world_rank"] is not None:
            named[(r["host"], pid)] = r["world_rank"]
        if r["not_ranks"] is not None:  # a split's member: what its own calls tell
            told = Evidence(_minus(r["named_rank"]), frozenset(r["not_ranks"]))
            evidence[((r["host"], pid), info.comm_hash)] = told
    recs = [Recording(h, "", Clock(0, 0), (), tuple(cs), {}) for h, cs in sorted(by_host.items())]
    known = Ranks.of(recs, evidence)
    # a world rank an agent knew (its dumps named it) stands
    return Ranks(known.comm, known.nranks, known.world | named)


def fill_ranks(tables: dict[str, pa.Table]) -> dict[str, pa.Table]:
    """The agents' rows with ``rank``, ``nranks`` and ``world_rank`` filled
    where an agent alone could not know them."""
    identity = tables.pop(IDENTITY, None)
    if identity is None:
        return tables
    known = _identity(identity)
    return {name: _filled(t, known) for name, t in tables.items()}


def _filled(t: pa.Table, known: Ranks) -> pa.Table:
    names = t.column_names
    if "host" not in names or "pid" not in names:
        return t
    hosts, pids = t.column("host").to_pylist(), t.column("pid").to_pylist()
    members = [(h, p or 0) for h, p in zip(hosts, pids, strict=True)]
    hashes = (
        [_hash(x) for x in t.column("comm_id_hash").to_pylist()]
        if "comm_id_hash" in names
        else [0] * len(members)
    )
    for col in ("rank", "nranks", "world_rank"):
        if col not in names:
            continue
        values = t.column(col).to_pylist()
        if None not in values:
            continue
        values = [
            _derived(col, known, members[i], hashes[i]) if v is None else v
            for i, v in enumerate(values)
        ]
        at = names.index(col)
        t = t.set_column(at, t.schema.field(at), pa.array(values, t.schema.field(at).type))
    return t


def _derived(col: str, known: Ranks, member: tuple[str, int], comm_hash: int) -> int | None:
    if col == "rank":
        return known.comm.get((member, comm_hash))
    if col == "nranks":
        return known.nranks.get(comm_hash)
    return known.world.get(member)


__all__ = ["close_connections", "fill_ranks", "parse_agent", "query_agents"]

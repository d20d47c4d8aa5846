"""The one SQL layer: DuckDB over the tables of ``dumpers.tables``.

The same :class:`QueryEngine` serves ``stallwatch query`` on dumps, ``stallwatch
serve`` and the live agent's ``POST /query``; there is never a second.

DuckDB scans the Arrow tables in place (``register``: no copy into DuckDB
storage) and plans range joins (IEJoin) for the ``BETWEEN`` windows that the
seed query (``dumpers.sqltables.SEED_QUERY``) uses.

Sandbox, applied to every query whatever its origin:

- the connection is opened with ``enable_external_access=false`` (no file,
  network or ``glob``/``read_*`` access; no ``ATTACH``/``COPY``/``EXPORT``
  targets), extension auto-install and auto-load off, no temporary directory,
  no allowed directories, no Python replacement scans (a query cannot name
  a Python variable of the server as a table), then ``lock_configuration=true``
  (no ``SET``);
- exactly one statement, and it must parse (with DuckDB's own parser,
  ``extract_statements``) as a ``SELECT`` (``WITH``, ``FROM``, ``VALUES``,
  ``DESCRIBE``, ``SUMMARIZE`` included), so ``CREATE``, ``INSERT``, ``PRAGMA``,
  ``CALL``, ``INSTALL``/``LOAD``, ``SET`` never reach the executor;
- limits (:class:`Limits`): query text size, rows returned (the rest is cut and
  the result marked truncated), wall time (a timer thread calls
  ``interrupt()`` on the connection), memory and threads.

Known limits: one connection per engine, so queries on one engine run one at a
time (a query waits at most its time limit for the one before it).
"""

from __future__ import annotations

import atexit
import json
import math
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import duckdb
import pyarrow as pa

from stallwatch.dumpers.errors import AnswerTooLarge, QueryError, QueryRefused
from stallwatch.dumpers.model import Recording
from stallwatch.dumpers.sqltables import tables

from .limits import LOCAL as LOCAL
from .limits import NETWORK as NETWORK
from .limits import QUERY as QUERY
from .limits import Limits
from .scan import Scan, compile_scan

_T = TypeVar("_T")
# recordings (dumps), a callable returning fresh ones (a live agent), or the
# tables already built (``query.feed``: a dump at a time, what a query reads)
Source = Sequence[Recording] | Callable[[], Sequence[Recording]] | Mapping[str, pa.Table]


@dataclass(frozen=True, slots=True)
class QueryResult:
    columns: tuple[str, ...]
    types: tuple[str, ...]
    rows: list[tuple[Any, ...]]
    truncated: bool
    elapsed_ms: float


def _config(limits: Limits) -> dict[str, Any]:
    config: dict[str, Any] = {
        "enable_external_access": False,
        "autoinstall_known_extensions": False,
        "autoload_known_extensions": False,
        "allow_community_extensions": False,
        "temp_directory": "",
    }
    if limits.memory_limit is not None:
        config["memory_limit"] = limits.memory_limit
    if limits.threads is not None:
        config["threads"] = limits.threads
    return config


def sandboxed_connection(limits: Limits) -> duckdb.DuckDBPyConnection:
    """An in-memory connection that cannot reach files, the network or
    extensions, and whose settings cannot be changed any more."""
    con = duckdb.connect(":memory:", config=_config(limits))
    con.execute("SET enable_progress_bar = false")
    # No Python variable of the caller's frames becomes a table by its name.
    con.execute("SET python_enable_replacements = false")
    con.execute("SET lock_configuration = true")
    return con


def check_statement(con: duckdb.DuckDBPyConnection, sql: str, limits: Limits) -> duckdb.Statement:
    """Refuse anything but exactly one SELECT, before it is bound or run;
    returns the parsed statement, which is what runs (never the text again)."""
    size = len(sql.encode())
    if limits.max_sql_bytes is not None and size > limits.max_sql_bytes:
        raise QueryRefused(f"query is {size} bytes, the limit is {limits.max_sql_bytes}")
    try:
        statements = con.extract_statements(sql)
    except duckdb.Error as exc:
        raise QueryError(str(exc)) from None
    if len(statements) != 1:
        raise QueryRefused(f"expected exactly one SQL statement, found {len(statements)}")
    kind = statements[0].type
    if kind != duckdb.StatementType.SELECT:
        raise QueryRefused(f"only SELECT queries are allowed, not {kind.name}")
    return statements[0]


def check_sql(sql: str, limits: Limits) -> None:
    """``check_statement`` on a connection of its own: a query refused or
    unparsable is said before anything is read for it."""
    con = sandboxed_connection(limits)
    try:
        check_statement(con, sql, limits)
    finally:
        con.close()


class _Watchdog:
    """One long-lived thread per engine that interrupts the connection when
    the running query passes its deadline.  Arming takes a lock; it wakes the
    thread only when the thread would sleep past the new deadline (it was
    idle): queries that follow one another leave it asleep until the first
    deadline, where it looks again.  A wake-up per query cost a thread switch
    per query, milliseconds on a loaded machine."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._con: duckdb.DuckDBPyConnection | None = None
        self._deadline = 0.0
        self._wake_at = math.inf  # when the waiting thread wakes by itself
        self._closed = False
        self._thread: threading.Thread | None = None

    def arm(self, con: duckdb.DuckDBPyConnection, seconds: float) -> None:
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="sql deadline", daemon=True)
                self._thread.start()
            self._con, self._deadline = con, time.monotonic() + seconds
            if self._deadline < self._wake_at:
                self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._con = None

    def close(self) -> None:
        with self._cond:
            self._closed, self._con = True, None
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                if self._con is not None and now >= self._deadline:
                    self._con.interrupt()
                    self._con = None
                    continue
                armed = self._con is not None
                self._wake_at = self._deadline if armed else math.inf
                self._cond.wait(self._deadline - now if armed else None)


class QueryEngine:
    """DuckDB over recordings: a fixed list (dumps) or a callable returning a
    fresh recording (a live agent), re-read at most every ``cache_s`` seconds.

    The tables are Arrow tables that DuckDB scans in place.  ``materialize``
    copies them, column by column, into DuckDB's own storage once instead:
    for a server that answers many queries on the same dumps, where it saves
    about a millisecond per table per query.  ``scans=False`` answers every
    fetch in DuckDB (to measure what scans save)."""

    def __init__(
        self,
        source: Source,
        limits: Limits | None = NETWORK,
        cache_s: float = 0.5,
        materialize: bool = False,
        scans: bool = True,
    ) -> None:
        self.limits = limits or LOCAL
        self._use_scans = scans
        self._materialize = materialize
        self._source = source
        self._cache_s = cache_s
        self._loaded_at: float | None = None
        self._lock = threading.Lock()
        self._watchdog = _Watchdog()
        self._con: duckdb.DuckDBPyConnection | None = sandboxed_connection(self.limits)
        self._arrow: dict[str, pa.Table] = {}  # the tables as built, for scans
        self._scans: OrderedDict[str, Scan | None] = OrderedDict()  # by query text
        _OPEN.add(self)

    def replace_source(self, recordings: Sequence[Recording]) -> None:
        """Serve ``recordings`` from the next query on (the same connection:
        its tables are registered again)."""
        with self._lock:
            self._source = recordings
            self._loaded_at = None
            self._arrow = {}

    def _connection(self) -> duckdb.DuckDBPyConnection:
        if self._con is None:
            raise QueryError("the query engine is closed")
        return self._con

    def _refresh(self, con: duckdb.DuckDBPyConnection) -> None:
        now = time.monotonic()
        static = not callable(self._source)
        if self._loaded_at is not None and (static or now - self._loaded_at < self._cache_s):
            return
        if isinstance(self._source, Mapping):
            built = dict(self._source)
        else:
            built = tables(list(self._source() if callable(self._source) else self._source))
        if {n: t.schema for n, t in built.items()} != {n: t.schema for n, t in self._arrow.items()}:
            self._scans.clear()  # compiled against the columns' types
        self._arrow = built
        for name, table in built.items():
            if not self._materialize:
                con.register(name, table)
                continue
            con.register("_arrow", table)
            con.execute(f"CREATE OR REPLACE TABLE {name} AS SELECT * FROM _arrow")
            con.unregister("_arrow")
        self._loaded_at = now

    def _acquire(self) -> None:
        wait = self.limits.time_limit_s
        if not self._lock.acquire(timeout=-1 if wait is None else wait):
            raise QueryError(f"the query engine is busy (waited {wait:g} s for another query)")

    def query(
        self, sql: str, limit: int | None = None, max_bytes: int | None = None
    ) -> QueryResult:
        """Run one SELECT; at most ``limit`` rows (and never more than the
        engine's row limit) come back, ``truncated`` says whether more existed.
        Rows whose values alone take more than ``max_bytes`` as JSON text are
        not read on: AnswerTooLarge (an answer's bound, refused while the rows
        are fetched rather than once all are held)."""
        start = time.perf_counter()
        max_rows = _row_limit(limit, self.limits.max_rows)
        self._acquire()
        try:
            con = self._connection()
            statement = check_statement(con, sql, self.limits)
            self._refresh(con)
            columns, types, rows = self._run(con, statement, max_rows, max_bytes)
        finally:
            self._lock.release()
        truncated = max_rows is not None and len(rows) > max_rows
        if truncated:
            del rows[max_rows:]
        elapsed = (time.perf_counter() - start) * 1e3
        return QueryResult(columns, types, rows, truncated, elapsed)

    def fetch_arrow(
        self, sql: str, max_rows: int | None = None, max_bytes: int | None = None
    ) -> tuple[pa.Table, bool]:
        """Run one SELECT and return its rows as an Arrow table, at most
        ``max_rows`` of them (default: ``max_fetch_rows``; the flag says
        whether more existed): the rows a fan-out merges (``query.plan``).
        Rows past ``max_bytes`` of Arrow buffers are not read: AnswerTooLarge.
        A plain scan of one table (``query.scan``) is answered from the Arrow
        columns, without DuckDB."""
        cap = self.limits.max_fetch_rows if max_rows is None else max_rows
        self._acquire()
        try:
            con = self._connection()
            self._refresh(con)
            scan = self._scan(con, sql) if self._use_scans else None
            if scan is not None:
                table = scan.run(self._arrow[scan.table])
                _check_bytes(table.nbytes, max_bytes)
            else:
                statement = check_statement(con, sql, self.limits)
                table = self._guarded(con, lambda: _arrow_rows(con, statement, cap, max_bytes))
        finally:
            self._lock.release()
        truncated = cap is not None and table.num_rows > cap
        return (table.slice(0, cap) if truncated else table), truncated

    def _scan(self, con: duckdb.DuckDBPyConnection, sql: str) -> Scan | None:
        """The scan that answers ``sql``, compiled once per query text (a
        fan-out sends the same text to every agent, and again when repeated)."""
        if sql in self._scans:
            self._scans.move_to_end(sql)
            return self._scans[sql]
        size = self.limits.max_sql_bytes
        if size is not None and len(sql.encode()) > size:
            return None  # refused by check_statement
        node = parse_select(con, sql)
        schemas = {name: table.schema for name, table in self._arrow.items()}
        scan = None if node is None else compile_scan(node, schemas)
        self._scans[sql] = scan
        if len(self._scans) > SCAN_CACHE:
            self._scans.popitem(last=False)
        return scan

    def _run(
        self,
        con: duckdb.DuckDBPyConnection,
        statement: duckdb.Statement,
        max_rows: int | None,
        max_bytes: int | None = None,
    ) -> tuple[tuple[str, ...], tuple[str, ...], list[tuple[Any, ...]]]:
        return self._guarded(con, lambda: _execute(con, statement, max_rows, max_bytes))

    def _guarded(self, con: duckdb.DuckDBPyConnection, run: Callable[[], _T]) -> _T:
        """``run`` under the time limit, DuckDB's errors as QueryError."""
        seconds = self.limits.time_limit_s
        if seconds is not None:
            self._watchdog.arm(con, seconds)
        try:
            try:
                return run()
            except duckdb.InterruptException:
                raise QueryError(f"query cut off: it ran longer than {seconds:g} s") from None
            except duckdb.OutOfMemoryException:
                limit = self.limits.memory_limit
                raise QueryError(f"query cut off: it needs more than {limit} of memory") from None
            except duckdb.Error as exc:
                raise QueryError(str(exc)) from None
        finally:
            self._watchdog.disarm()
            con.abort()  # drop rows past the limit, if any

    def close(self) -> None:
        with self._lock:
            if self._con is not None:
                self._con.close()
            # Drop the object too: DuckDB's bindings report a leak when a
            # connection object outlives the interpreter, closed or not.
            self._con = None
        self._watchdog.close()
        _OPEN.discard(self)

    def __enter__(self) -> QueryEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# DuckDB's bindings report leaks when a connection outlives the interpreter.
_OPEN: weakref.WeakSet[QueryEngine] = weakref.WeakSet()


@atexit.register
def _close_engines() -> None:
    for engine in list(_OPEN):
        engine.close()


Rows = list[tuple[Any, ...]]
SCAN_CACHE = 256  # query texts whose scan (or its absence) an engine remembers


def parse_select(con: duckdb.DuckDBPyConnection, sql: str) -> dict[str, Any] | None:
    """The one SELECT of ``sql`` as DuckDB's syntax tree, or None."""
    try:
        rows = con.execute("SELECT json_serialize_sql(?)", [sql]).fetchall()
        doc = json.loads(rows[0][0]) if rows else {}
    except (duckdb.Error, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("error"):
        return None
    statements = doc.get("statements")
    if not isinstance(statements, list) or len(statements) != 1:
        return None
    node = statements[0].get("node")
    return node if isinstance(node, dict) else None


_ZONED = "TIMESTAMP WITH TIME ZONE"


def _execute(
    con: duckdb.DuckDBPyConnection,
    statement: duckdb.Statement,
    max_rows: int | None,
    max_bytes: int | None = None,
) -> tuple[tuple[str, ...], tuple[str, ...], Rows]:
    """Stream the result, stopping after one row past the limit (so the
    caller knows it truncated), and before the rows' values take more than
    ``max_bytes`` as JSON text (AnswerTooLarge)."""
    con.execute(statement)
    description = con.description or []
    columns = tuple(d[0] for d in description)
    types = tuple(str(d[1]) for d in description)
    if any(t.startswith(_ZONED) for t in types):
        # Zoned times come back as text whatever the duckdb release: before 2.0
        # fetching them needs pytz, from 2.0 on they are ``datetime`` with a
        # zoneinfo; Arrow's text form is the one both agree on.
        return columns, types, _via_arrow(con, statement, max_rows, max_bytes)
    if max_bytes is None:
        rows = con.fetchall() if max_rows is None else con.fetchmany(max_rows + 1)
        return columns, types, rows
    rows, size = [], 0
    while max_rows is None or len(rows) <= max_rows:
        want = _FETCH_ROWS if max_rows is None else min(_FETCH_ROWS, max_rows + 1 - len(rows))
        chunk = con.fetchmany(want)
        size += sum(map(json_floor, chunk))
        _check_bytes(size, max_bytes)
        rows += chunk
        if len(chunk) < want:
            break
    return columns, types, rows


_FETCH_ROWS = 1024  # rows fetched at a time when an answer's bytes are bounded


def json_floor(value: object) -> int:
    """A lower bound of ``value``'s length as JSON text (``query.wire``):
    what an answer's rows are counted by while they are fetched."""
    if isinstance(value, str):
        return len(value) + 2
    if isinstance(value, bytes | bytearray | memoryview):
        return 2 * len(value) + 2  # hex
    if isinstance(value, list | tuple):
        return 2 + sum(map(json_floor, value)) + max(0, len(value) - 1)
    if isinstance(value, dict):
        return 2 + sum(len(str(k)) + 3 + json_floor(v) for k, v in value.items())
    return 1


def _arrow_rows(
    con: duckdb.DuckDBPyConnection,
    statement: duckdb.Statement,
    cap: int | None,
    max_bytes: int | None = None,
) -> pa.Table:
    """The rows, read in batches until one past ``cap`` (a ``LIMIT`` on the
    relation would cost a second plan; the parsed statement saves a parse),
    and never past ``max_bytes`` (AnswerTooLarge)."""
    reader = con.sql(statement).to_arrow_reader(_BATCH_ROWS)
    if cap is None and max_bytes is None:
        return reader.read_all()
    batches, rows, size = [], 0, 0
    for batch in reader:
        if cap is not None and rows + batch.num_rows > cap + 1:
            batch = batch.slice(0, cap + 1 - rows)  # one past the cap tells it truncated
        batches.append(batch)
        rows += batch.num_rows
        size += batch.nbytes
        _check_bytes(size, max_bytes)
        if cap is not None and rows > cap:
            break
    return pa.Table.from_batches(batches, schema=reader.schema)


_BATCH_ROWS = 16 * 1024  # rows read at a time: a batch of wide rows is a few MB


def too_large(cap: int) -> str:
    """The refusal of an answer over ``cap`` bytes (``Limits.max_answer_bytes``),
    said the same wherever the bound is met: while the rows are read here, or
    once the answer is made (``query.answers``)."""
    return (
        f"the answer is over its limit of {cap / 2**20:g} MiB: ask for fewer columns or "
        "rows (WHERE, LIMIT), or aggregate on the agent"
    )


def _check_bytes(size: int, max_bytes: int | None) -> None:
    if max_bytes is not None and size > max_bytes:
        raise AnswerTooLarge(too_large(max_bytes))


def run_on_tables(
    named: dict[str, pa.Table],
    sql: str,
    limit: int | None = None,
    con: duckdb.DuckDBPyConnection | None = None,
) -> QueryResult:
    """One query over Arrow tables given by name, in a sandboxed connection
    (``con``, a cursor of one, is closed after; without it, a new one): the
    client side of a fan-out (``query.plan``)."""
    start = time.perf_counter()
    con = con or sandboxed_connection(LOCAL)
    try:
        for name, table in named.items():
            con.register(name, table)
        statement = check_statement(con, sql, LOCAL)
        try:
            columns, types, rows = _execute(con, statement, limit)
        except duckdb.Error as exc:
            raise QueryError(str(exc)) from None
    finally:
        con.close()
    truncated = limit is not None and len(rows) > limit
    if truncated:
        del rows[limit:]
    return QueryResult(columns, types, rows, truncated, (time.perf_counter() - start) * 1e3)


def _via_arrow(
    con: duckdb.DuckDBPyConnection,
    statement: duckdb.Statement,
    max_rows: int | None,
    max_bytes: int | None,
) -> Rows:
    con.abort()
    table = _arrow_rows(con, statement, max_rows, max_bytes)
    if max_rows is not None:
        table = table.slice(0, max_rows + 1)
    rows = list(zip(*(_pylist(c) for c in table.columns), strict=True))
    if max_bytes is not None:
        _check_bytes(sum(map(json_floor, rows)), max_bytes)
    return rows


def _pylist(column: pa.ChunkedArray) -> list[Any]:
    """Python values of a result column; times become text (``datetime``
    cannot hold nanoseconds, and zoned times would need pytz)."""
    kind = column.type
    if pa.types.is_timestamp(kind) or pa.types.is_date(kind) or pa.types.is_time(kind):
        column = column.cast(pa.string())
    try:
        values: list[Any] = column.to_pylist()
    except (ValueError, pa.ArrowException):
        values = column.cast(pa.string()).to_pylist()
    return values


def _row_limit(requested: int | None, cap: int | None) -> int | None:
    if requested is not None and (not isinstance(requested, int) or requested < 0):
        raise QueryRefused(f"limit must be a non-negative integer, got {requested!r}")
    if requested is None:
        return cap
    return requested if cap is None else min(requested, cap)

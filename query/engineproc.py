"""The SQL engine of the HTTP surface, in a process of its own.

DuckDB holds its buffer manager to ``memory_limit``, but not every
allocation: ``SELECT unnest(range(100000000))`` builds an 800 MB list in one
function call that neither the memory limit nor an interrupt reaches (7 GB
resident and 27 s under a 10 s time limit, measured).  An agent must keep
its memory and its time whatever a client sends, so the engine that answers
the network runs in a child process (``EngineProcess``):

- its writable memory is bounded (``RLIMIT_DATA``: what it holds once
  started, plus ``ENGINE_MEMORY``): an allocation past it fails inside DuckDB,
  an error for that query.  Arrow allocates with the system allocator there,
  which the bound sees (mimalloc reserves a gigabyte up front);
- a query that outlives its time limit by ``GRACE_S`` is stopped with its
  process (SIGKILL): the client has its answer within a second of the limit,
  and the next query starts a new process;
- it ends after ``IDLE_S`` without a query, and with it everything it held
  (DuckDB, Arrow, the tables); while it lives, its memory is held near what
  it needs (``query.footprint``: collected and trimmed only once it has
  grown past that by more than an answer's bound);
- it runs at a lower priority (nice +10) and dies with the agent.

The agent sends the recording (the dump format's bytes, over a socket pair)
when a query comes and the one the child has is older than ``cache_s``; the
child answers with the body of the HTTP answer (``query.answers``).  One
query at a time: a request that finds the engine busy is refused at once
(``EngineBusy``), never queued.  A large message (a recording, an answer)
is received into a mapping of its own (``mmap``), unmapped when its last
reference goes: the agent keeps nothing of an answer it relayed.

``InlineEngine`` has the same interface and runs the engine in the caller's
process, unbounded by any of the above: for tests and benchmarks that start
hundreds of servers in one process.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import logging
import mmap
import os
import resource
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from stallwatch.dumpers.errors import (
    AnswerTooLarge,
    EngineBusy,
    QueryError,
    QueryRefused,
    StallwatchError,
)
from stallwatch.dumpers.model import Recording

from .footprint import Footprint
from .limits import Limits
from .server import PROCESS
from .wire import frame_parts, part_size, split_frames

if TYPE_CHECKING:
    from .sql import QueryEngine

log = logging.getLogger("stallwatch.query.http")

ENGINE_MEMORY = 256 * 2**20  # writable memory the child may take beyond its start
GRACE_S = 0.5  # past the time limit, before the process is stopped
IDLE_S = 60.0  # the child ends after this long without a query
LOAD_TIMEOUT_S = 60.0  # building the tables of a recording (ours, not a client's)
START_TIMEOUT_S = 60.0
NICE = 10
_LENGTH = struct.Struct(">Q")
MAPPED_FROM = 1 << 20  # a message body this large is received into a mapping of its own
_ERRORS: dict[str, type[QueryError]] = {
    "refused": QueryRefused,
    "too_large": AnswerTooLarge,
    "query": QueryError,
}

Source = Sequence[Recording] | Callable[[], Sequence[Recording]]


class Engine(Protocol):
    """What the routes ask of an engine; both kinds below have it."""

    def query(self, sql: str, limit: int | None, host: str) -> list[bytes | memoryview]: ...

    def fetch(self, queries: Sequence[str], host: str) -> list[bytes | memoryview]: ...

    def counters(self) -> dict[str, int]: ...

    def close(self) -> None: ...


@dataclass
class EngineStats:
    starts: int = 0  # processes started
    stopped: int = 0  # stopped for outliving a query's time limit
    failed: int = 0  # ended on their own in a query (out of memory, a crash)
    busy: int = 0  # requests refused: another query was running
    peak_rss: int = 0  # the largest resident set a child reported, in bytes


# ---- in this process ---------------------------------------------------------


class InlineEngine:
    """The engine in the caller's process, made at the first query (DuckDB
    and Arrow are loaded then, not at start); one query at a time."""

    def __init__(self, make: Callable[[], QueryEngine]) -> None:
        self._make = make
        self._engine: QueryEngine | None = None
        self._lock = threading.Lock()
        self.stats = EngineStats()

    @contextlib.contextmanager
    def _turn(self) -> Iterator[QueryEngine]:
        if not self._lock.acquire(blocking=False):
            self.stats.busy += 1
            raise EngineBusy("the query engine is busy with another query")
        try:
            if self._engine is None:
                self._engine = self._make()
            yield self._engine
        finally:
            self._lock.release()

    def query(self, sql: str, limit: int | None, host: str) -> list[bytes | memoryview]:
        from .answers import query_answer

        with self._turn() as engine:
            return [query_answer(engine, sql, limit, host)]

    def fetch(self, queries: Sequence[str], host: str) -> list[bytes | memoryview]:
        from .answers import fetch_answer

        with self._turn() as engine:
            return fetch_answer(engine, queries, host)

    def counters(self) -> dict[str, int]:
        return {"query_engine_busy": self.stats.busy}

    @property
    def loaded(self) -> bool:
        return self._engine is not None

    def close(self) -> None:
        with self._lock:
            if self._engine is not None:
                self._engine.close()
                self._engine = None


# ---- in a process of its own: the agent's side --------------------------------


@dataclass(frozen=True, slots=True)
class ChildConfig:
    limits: Limits
    materialize: bool = False
    scans: bool = True
    memory: int = ENGINE_MEMORY
    idle_s: float = IDLE_S


class _Child:
    """One engine process and our end of its socket pair."""

    def __init__(self, config: ChildConfig) -> None:
        ours, theirs = socket.socketpair()
        argv = [sys.executable, "-m", "stallwatch.query.engineproc", str(theirs.fileno())]
        argv.append(json.dumps(dataclasses.asdict(config)))
        env = {**os.environ, "ARROW_DEFAULT_MEMORY_POOL": "system", "MALLOC_ARENA_MAX": "2"}
        try:
            self.proc = subprocess.Popen(
                argv, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env=env
            )
        finally:
            theirs.close()
        self.sock = ours
        self.started = time.monotonic()
        self.last_used = self.started
        self.loaded_at: float | None = None

    def send(self, head: dict[str, Any], parts: Sequence[bytes | memoryview] = ()) -> None:
        send_message(self.sock, head, parts)

    def receive(self, timeout: float | None) -> tuple[dict[str, Any], Body]:
        self.sock.settimeout(timeout)
        return receive_message(self.sock)

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.kill()
        self.proc.wait()
        self.sock.close()

    def ended(self) -> bool:
        return self.proc.poll() is not None


class EngineProcess:
    """The engine in a child process (see the module docstring); the child
    is started at the first query, and again after it ended."""

    def __init__(self, source: Source, config: ChildConfig, cache_s: float = 0.5) -> None:
        self._source = source
        self.config = config
        self._cache_s = cache_s
        self._child: _Child | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.stats = EngineStats()

    @property
    def limits(self) -> Limits:
        return self.config.limits

    def query(self, sql: str, limit: int | None, host: str) -> list[bytes | memoryview]:
        head = {"op": "query", "sql": sql, "limit": limit, "host": host}
        return [memoryview(self._ask(head))]

    def fetch(self, queries: Sequence[str], host: str) -> list[bytes | memoryview]:
        return [memoryview(self._ask({"op": "fetch", "queries": list(queries), "host": host}))]

    def counters(self) -> dict[str, int]:
        s = self.stats
        return {
            "query_engine_starts": s.starts,
            "query_engine_stopped": s.stopped,
            "query_engine_failed": s.failed,
            "query_engine_busy": s.busy,
            "query_engine_peak_resident_bytes": s.peak_rss,
            "query_engine_running": int(self.pid() is not None),
        }

    def pid(self) -> int | None:
        child = self._child
        return child.proc.pid if child is not None and not child.ended() else None

    def close(self) -> None:
        """Stop the child now, a query it runs included (its request fails)."""
        self._closed = True
        child = self._child
        if child is not None:
            with contextlib.suppress(OSError):
                child.proc.kill()
        with self._lock:
            if self._child is not None:
                self._child.kill()
                self._child = None

    # ---- one request -----------------------------------------------------

    def _ask(self, head: dict[str, Any]) -> Body:
        if not self._lock.acquire(blocking=False):
            self.stats.busy += 1
            raise EngineBusy("the query engine is busy with another query")
        try:
            if self._closed:
                raise QueryError("the query engine is closed: the agent is stopping")
            limit = self.limits.time_limit_s
            reply, body = self._call(head, (), None if limit is None else limit + GRACE_S)
        finally:
            self._lock.release()
            PROCESS.settle()  # the recording sent, if one was
        if reply.get("error") is not None:
            raise _ERRORS.get(reply.get("kind", ""), QueryError)(str(reply["error"]))
        return body

    def _call(
        self, head: dict[str, Any], parts: Sequence[bytes | memoryview], timeout: float | None
    ) -> tuple[dict[str, Any], Body]:
        """One exchange with a child that holds a fresh recording; a child
        that says it must end first (it grew near its bound) is replaced."""
        for _ in range(2):
            child = self._ready()
            reply, body = self._exchange(child, head, parts, timeout)
            if not reply.get("restart"):
                return reply, body
            self._drop(child)
        raise QueryError("the query engine could not take the request")  # pragma: no cover

    def _exchange(
        self,
        child: _Child,
        head: dict[str, Any],
        parts: Sequence[bytes | memoryview],
        timeout: float | None,
    ) -> tuple[dict[str, Any], Body]:
        try:
            child.send(head, parts)
            reply, body = child.receive(timeout)
        except TimeoutError:
            self._drop(child)
            self.stats.stopped += 1
            if head.get("op") == "load":
                raise QueryError("the query engine could not load the recording in time") from None
            raise QueryError(
                f"query cut off: it ran longer than {self.limits.time_limit_s:g} s "
                "(its engine was stopped)"
            ) from None
        except (EOFError, OSError):
            why = self._failed(child)
            raise QueryError(f"query failed: its engine ended ({why})") from None
        child.last_used = time.monotonic()
        self.stats.peak_rss = max(self.stats.peak_rss, int(reply.get("peak_rss", 0)))
        return reply, body

    def _failed(self, child: _Child) -> str:
        self._drop(child)
        self.stats.failed += 1
        code = child.proc.returncode
        why = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        log.warning("the query engine (pid %d) ended in a query: %s", child.proc.pid, why)
        return f"{why}: out of its {self.config.memory // 2**20} MiB of memory, or a crash"

    def _drop(self, child: _Child) -> None:
        child.kill()
        if self._child is child:
            self._child = None

    def _ready(self) -> _Child:
        """A running child holding a fresh enough recording."""
        child = self._child
        # a child near its idle end is not given a request it might not see
        if child is not None and (
            child.ended() or time.monotonic() - child.last_used > self.config.idle_s - 2
        ):
            self._drop(child)
            child = None
        static = not callable(self._source)
        for _ in range(2):
            if child is None:
                child = self._child = self._start()
            taken = child.loaded_at
            if taken is not None and (static or time.monotonic() - taken < self._cache_s):
                return child
            if self._load(child):  # its age counts from now: a slow load is not taken again
                child.loaded_at = time.monotonic()
                return child
            self._drop(child)  # it had to end first: a new one loads
            child = None
        raise QueryError("the query engine could not load the recording")  # pragma: no cover

    def _start(self) -> _Child:
        child = _Child(self.config)
        self.stats.starts += 1
        try:
            reply, _ = child.receive(START_TIMEOUT_S)
        except (TimeoutError, EOFError, OSError) as exc:
            child.kill()
            raise QueryError(f"the query engine did not start: {exc or 'it exited'}") from None
        if reply.get("error"):
            child.kill()
            raise QueryError(f"the query engine did not start: {reply['error']}")
        return child

    def _load(self, child: _Child) -> bool:
        """Send the recording; False if the child must end first."""
        from stallwatch.dumpers.format import encode_parts

        recordings = self._source() if callable(self._source) else self._source
        parts = [p for rec in recordings for p in frame_parts(*encode_parts(rec))]
        del recordings
        reply, _ = self._exchange(child, {"op": "load", "count": len(parts) // 2}, parts, None)
        if reply.get("error"):
            raise QueryError(f"the query engine could not load the recording: {reply['error']}")
        return not reply.get("restart")


# ---- messages ----------------------------------------------------------------
# A message is a JSON head and a body: each behind its 8-byte big-endian length.


def send_message(
    sock: socket.socket, head: dict[str, Any], parts: Sequence[bytes | memoryview] = ()
) -> None:
    data = json.dumps(head).encode()
    sock.sendall(_LENGTH.pack(len(data)) + data)
    sock.sendall(_LENGTH.pack(sum(map(part_size, parts))))
    for part in parts:
        sock.sendall(part)


# a message body: in a mapping of its own from MAPPED_FROM bytes (unmapped
# when its last reference goes, whatever glibc would keep of a freed buffer)
Body = bytearray | mmap.mmap


def receive_message(sock: socket.socket) -> tuple[dict[str, Any], Body]:
    head = json.loads(bytes(_exactly(sock, _length(sock))))
    if not isinstance(head, dict):
        raise EOFError("a message head that is not a JSON object")
    return head, _exactly(sock, _length(sock))


def _length(sock: socket.socket) -> int:
    (size,) = _LENGTH.unpack(_exactly(sock, _LENGTH.size))
    return int(size)


def _exactly(sock: socket.socket, size: int) -> Body:
    buf: Body = mmap.mmap(-1, size) if size >= MAPPED_FROM else bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        n = sock.recv_into(view[got:], min(size - got, 1 << 20))
        if n == 0:
            raise EOFError("the other end closed")
        got += n
    return buf


# ---- the child ---------------------------------------------------------------


def _prepare() -> None:
    """Die with the agent; yield the CPU to it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the agent was gone before the line above
        sys.exit(0)
    with contextlib.suppress(OSError):
        os.nice(NICE)


def _data_bytes() -> int:
    """This process's writable private memory (what RLIMIT_DATA counts)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmData:"):
            return int(line.split()[1]) * 1024
    return 0


def _peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _release_arrow() -> None:
    import pyarrow as pa

    pa.default_memory_pool().release_unused()


class _Server:
    """The child's loop: one message, one answer."""

    def __init__(self, sock: socket.socket, config: ChildConfig, data_limit: int) -> None:
        self.sock = sock
        self.config = config
        self.data_limit = data_limit
        self.engine: QueryEngine | None = None
        # an answer is at most the request's bound; more than that kept
        # after it is memory to collect (query.footprint)
        allowance = config.limits.max_answer_bytes or config.memory // 4
        self.footprint = Footprint(allowance, _release_arrow)

    def serve(self) -> int:
        self.sock.settimeout(self.config.idle_s)
        while True:
            try:
                head, body = receive_message(self.sock)
            except (TimeoutError, EOFError, OSError):
                return 0  # idle, or the agent is gone
            if _data_bytes() > self.data_limit - self.config.memory // 4:
                # grown near its bound (a query that failed for memory, what
                # loads left behind): the agent asks a new process instead
                send_message(self.sock, {"restart": True})
                return 0
            reply, parts = self.handle(head, body)
            del body
            reply["peak_rss"] = _peak_rss()
            send_message(self.sock, reply, parts)
            del parts
            self.footprint.settle()

    def handle(
        self, head: dict[str, Any], body: Body
    ) -> tuple[dict[str, Any], Sequence[bytes | memoryview]]:
        from .answers import fetch_answer, query_answer

        try:
            op = head.get("op")
            if op == "load":
                try:
                    self._load(body, int(head.get("count", 0)))
                except (StallwatchError, ValueError) as exc:
                    return {"error": str(exc), "kind": "query"}, ()
                return {}, ()
            engine = self._engine()
            if op == "query":
                return {}, [query_answer(engine, head["sql"], head["limit"], head["host"])]
            if op == "fetch":
                return {}, fetch_answer(engine, head["queries"], head["host"])
            return {"error": f"unknown operation {op!r}", "kind": "query"}, ()
        except MemoryError:
            return {"error": "query cut off: it needs more memory than the engine has"}, ()
        except QueryError as exc:
            return {"error": str(exc), "kind": _kind(exc)}, ()

    def _engine(self) -> QueryEngine:
        if self.engine is None:
            raise QueryError("no recording loaded")
        return self.engine

    def _load(self, body: Body, count: int) -> None:
        from stallwatch.dumpers.format import decode

        from .sql import QueryEngine

        if self.engine is not None:
            self.engine.replace_source(())  # the old tables go before the new come
        frames = split_frames(body) if count else []
        recordings = [decode(bytes(f), "the agent's recording") for f in frames]
        del frames
        c = self.config
        if self.engine is None:
            self.engine = QueryEngine((), c.limits, materialize=c.materialize, scans=c.scans)
        self.engine.replace_source(recordings)
        self.engine.query("SELECT 1")  # the tables are made now, not in the first query


def _kind(exc: QueryError) -> str:
    if isinstance(exc, AnswerTooLarge):
        return "too_large"
    if isinstance(exc, QueryRefused):
        return "refused"
    return "query"


def main(argv: Sequence[str]) -> int:
    _prepare()
    sock = socket.socket(fileno=int(argv[0]))
    raw = json.loads(argv[1])
    config = ChildConfig(**{**raw, "limits": Limits(**raw["limits"])})
    try:
        import duckdb  # noqa: F401  (loaded before the bound is set)
        import pyarrow  # noqa: F401

        from . import answers, scan, sql  # noqa: F401

        limit = _data_bytes() + config.memory
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    except (ImportError, OSError, ValueError) as exc:
        send_message(sock, {"error": f"{type(exc).__name__}: {exc}"})
        return 1
    send_message(sock, {"pid": os.getpid()})
    return _Server(sock, config, limit).serve()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The network loop of the agent's HTTP surface: connections, TLS
handshakes, admission, whole requests handed to workers (``query.routes``
answers them).

Serving is bounded (``ServeLimits``): one thread waits on every connection
with epoll, reads requests and runs TLS handshakes without blocking; an
idle client holds a socket, never a thread.

Admission, before any worker: once a request is whole, the gate
(``query.routes.admit``) checks its credential and names its lane.  A
request it refuses (no or a wrong token, an unknown endpoint) is answered
here, in a few hundred bytes, and its connection closed: unauthenticated
clients never hold a worker.  Each lane has workers of its own (``LANES``:
health and metrics, dumps, queries, bulk answers, refusals), so a kind of
work can only wait behind its own kind: a lane whose workers and waiting
places are taken answers 503 "busy" at once.

Unauthenticated connections are budgeted: a connection that has not yet
made an authenticated request must bring its TLS handshake and first
request within ``FIRST_REQUEST_S``; at most ``UNPROVEN_PER_ADDRESS`` such
connections per client address (``MAX_UNPROVEN`` in all) are kept, and a
new one displaces the oldest of its address that has sent nothing.  At
``MAX_CONNECTIONS`` a new connection displaces the oldest idle one (an
unauthenticated one first), so that health checks and peers always get in;
only when none is idle is it closed at accept.  A request begun must be in
within ``READ_TIMEOUT_S``, an idle keep-alive connection is closed after
``IDLE_TIMEOUT_S``.  What was refused, displaced, timed out or answered
busy is counted (``ServerHandle.counters``, on the agent's ``/metrics``).

A plain-HTTP client of a TLS listener gets a plain 400 saying so, and the
connection is closed.  A client that goes away (reset, broken pipe,
timeout, failed handshake) is logged in one line.

Requests are parsed and answered by the standard library's
``BaseHTTPRequestHandler`` (one request at a time, from the bytes the loop
read); the agent stays free of web framework dependencies.
"""

from __future__ import annotations

import contextlib
import enum
import io
import ipaddress
import logging
import math
import queue
import re
import resource
import select
import selectors
import socket
import ssl
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

from stallwatch.dumpers.errors import UsageError

from .footprint import Footprint
from .limits import NETWORK
from .wire import encode_json

log = logging.getLogger("stallwatch.query.http")

MAX_HEAD = 64 * 1024  # request line and headers; longer is refused by the handler
# Connections open at once: idle ones hold a socket each (no thread), so a
# fleet's scrapers, fan-outs and forgotten keep-alives fit many times over.
MAX_CONNECTIONS = 4096
# connections that have not made an authenticated request yet
UNPROVEN_PER_ADDRESS = 64
MAX_UNPROVEN = 1024
FIRST_REQUEST_S = 3.0  # from accept to a new connection's first request (TLS handshake too)
READ_TIMEOUT_S = 10.0  # from a request's first byte to its last
IDLE_TIMEOUT_S = 60.0  # a keep-alive connection with no request is closed
WRITE_TIMEOUT_S = 30.0  # a client that stops reading its answer
LISTEN_BACKLOG = 128
RECV_BYTES = 65536
REFUSAL_LOG_S = 10.0
FDS_BESIDES = 512  # the agent's other files: maps, links, dumps
SETTLE_AFTER_BYTES = 1 << 20  # an answer this large: the process's memory is looked at after
_HEAVY = frozenset({"dump", "bulk"})  # lanes whose requests copy the recording
# The serving process's memory (query.footprint): what an answer leaves past
# the largest answer a request may have (Limits.max_answer_bytes) is memory
# something kept, and is collected.
PROCESS = Footprint(NETWORK.max_answer_bytes or 0)


def parse_listen(listen: str) -> tuple[str, int]:
    """``ADDR:PORT``, ``[V6ADDR]:PORT`` or ``:PORT`` (loopback)."""
    host, sep, port_text = listen.rpartition(":")
    if not sep or not port_text.isdigit() or int(port_text) > 65535:
        raise UsageError(f"--listen {listen!r}: expected ADDR:PORT, e.g. 127.0.0.1:9400")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port_text)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _peer(client_address: Any) -> str:
    try:
        host, port = client_address[:2]
    except (TypeError, ValueError):
        return str(client_address)
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError):
        return f"TLS: {exc.reason or exc.strerror or exc}"
    if isinstance(exc, TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc.strerror or exc}" if isinstance(exc, OSError) else str(exc)


_PLAIN_REFUSAL = encode_json(
    {"error": "this agent speaks HTTPS only: use https:// (stallwatch: --tls-ca FILE)"}
)


def _drain(sock: socket.socket, limit: int = 64 * 1024) -> None:
    """Read what the client sent (unread bytes at close make the kernel reset
    the connection, and the client would see that instead of the answer)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(0.5)
        while limit > 0 and (chunk := sock.recv(min(limit, 16384))):
            limit -= len(chunk)


@dataclass(frozen=True, slots=True)
class Lane:
    """Workers of one kind of work, and how many requests may wait for them
    (beyond: 503 "busy" at once)."""

    name: str
    workers: int
    waiting: int


LANES = (
    Lane("health", 2, 64),  # /healthz, /metrics: quick
    Lane("dump", 2, 16),  # /dump: a dump write each, peers' among them
    Lane("query", 2, 4),  # /query, /fetch: one engine; a request that finds it busy is told at once
    Lane("bulk", 2, 4),  # /recording, /collect, /dumps, /snapshot: large answers
    Lane("refusal", 1, 16),  # plain HTTP on a TLS listener: told so
)


@dataclass(frozen=True, slots=True)
class ServeLimits:
    """How much the surface serves at once, and how long it waits for clients."""

    max_connections: int = MAX_CONNECTIONS  # open at once (see the module docstring)
    lanes: tuple[Lane, ...] = LANES
    unproven_per_address: int = UNPROVEN_PER_ADDRESS
    max_unproven: int = MAX_UNPROVEN
    first_request_s: float = FIRST_REQUEST_S
    read_timeout_s: float = READ_TIMEOUT_S  # a request begun must end
    idle_timeout_s: float = IDLE_TIMEOUT_S  # a keep-alive connection with no request
    write_timeout_s: float = WRITE_TIMEOUT_S  # a client that does not read its answer

    @property
    def workers(self) -> int:
        return sum(lane.workers for lane in self.lanes)


@dataclass(frozen=True, slots=True)
class RequestHead:
    """What the gate sees of a whole request."""

    method: str
    path: str  # without its query string
    authorization: str  # the header, "" if none
    peer: str  # the client's address
    tls: bool


@dataclass(frozen=True, slots=True)
class Admission:
    """The gate's word on a request: its lane, or the answer that refuses it
    (sent from the loop, the connection closed)."""

    lane: str | None
    credential: object = None  # handed to the request's handler
    authenticated: bool = False  # the connection has proved itself
    status: int = 0
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()


Gate = Callable[[RequestHead], Admission]


class _Stage(enum.Enum):
    PEEK = "peek"  # TLS listener: the first byte says TLS or plain HTTP
    HANDSHAKE = "handshake"
    READING = "reading"
    SERVING = "serving"  # a worker has it: not in the selector


@dataclass(slots=True, eq=False)
class _Conn:
    raw: socket.socket  # detached once wrapped in TLS: ``io`` is what to use
    fd: int
    peer: Any
    deadline: float
    stage: _Stage = _Stage.READING
    sock: socket.socket | None = None  # raw, or its TLS wrapper once made
    buf: bytearray = field(default_factory=bytearray)
    slow: bool = False  # its deadline is a read timeout (a request begun), not idleness
    continued: bool = False  # "100 Continue" sent for the request being read
    proven: bool = False  # it made an authenticated request
    lane: str = ""  # the lane serving it (SERVING)
    credential: object = None  # of the request being served

    @property
    def io(self) -> socket.socket:
        return self.sock if self.sock is not None else self.raw


_CONTENT_LENGTH = re.compile(rb"^content-length:[ \t]*(\d+)[ \t]*\r?$", re.I | re.M)
_EXPECT_CONTINUE = re.compile(rb"^expect:[ \t]*100-continue[ \t]*\r?$", re.I | re.M)
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def request_size(buf: bytes | bytearray, max_body: int) -> int | None:
    """Bytes of the first request in ``buf`` once it is whole (its head, and
    its body unless that is over ``max_body``: the handler refuses it unread);
    None while more is to come."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return len(buf) if len(buf) > MAX_HEAD else None  # too long: the handler says so
    head = bytes(buf[:end])
    match = _CONTENT_LENGTH.search(head)
    body = int(match.group(1)) if match else 0
    need = end + 4 + (body if body <= max_body else 0)
    return need if len(buf) >= need else None


_REQUEST_LINE = re.compile(rb"^([A-Z]+) (\S+) HTTP/1\.[01]\r?$")
_AUTHORIZATION = re.compile(rb"^authorization:[ \t]*([^\r\n]*?)[ \t]*\r?$", re.I | re.M)
_REASONS = {400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
            405: "Method Not Allowed", 503: "Service Unavailable"}  # fmt: skip


def parse_head(data: bytes, peer: Any, tls: bool) -> RequestHead | None:
    """The method, path and credential of a whole request; None if its
    request line is not HTTP/1.x."""
    end = data.find(b"\r\n")
    line = _REQUEST_LINE.match(data[: end if end >= 0 else len(data)])
    if line is None:
        return None
    head = data[: data.find(b"\r\n\r\n") + 2]
    auth = _AUTHORIZATION.search(head)
    path = line.group(2).decode("latin-1").split("?", 1)[0]
    token = auth.group(1).decode("latin-1") if auth else ""
    host = str(peer[0]) if isinstance(peer, tuple) else str(peer)
    return RequestHead(line.group(1).decode(), path, token, host, tls)


class _Lane:
    def __init__(self, spec: Lane) -> None:
        self.spec = spec
        self.pool = ThreadPoolExecutor(spec.workers, thread_name_prefix=f"http {spec.name}")
        self.in_flight = 0  # running and waiting; counted by the loop alone

    @property
    def full(self) -> bool:
        return self.in_flight >= self.spec.workers + self.spec.waiting


class Server:
    """The HTTP surface (see the module docstring): one thread waits on every
    connection (epoll), reads requests and admits them; each lane's workers
    answer its whole requests."""

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        family: socket.AddressFamily,
        tls: ssl.SSLContext | None,
        limits: ServeLimits,
        max_body: int,
        gate: Gate,
    ) -> None:
        self.RequestHandlerClass = handler
        self.max_body = max_body
        self.tls = tls
        self.limits = limits
        self.gate = gate
        self.counts = dict.fromkeys(
            ("refused", "timed_out", "evicted", "unauthenticated", "busy"), 0
        )
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            # the kernel hands a connection over once its client sent something
            # (HTTP and TLS clients speak first): sockets opened and left
            # silent wait in its handshake queue for up to FIRST_REQUEST_S,
            # not here, where they would displace clients about to speak (a
            # reconnecting flood from one address cycled through its places
            # in 2 ms and displaced health checks before their TLS handshake)
            self.listener.setsockopt(
                socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, int(FIRST_REQUEST_S)
            )
            self.listener.bind(address)
            self.listener.listen(socket.SOMAXCONN)
        except OSError:
            self.listener.close()
            raise
        self.listener.setblocking(False)
        self.server_address = self.listener.getsockname()
        self._conns: dict[int, _Conn] = {}  # fd -> connection, workers' included
        # connections not yet proven, per client address, oldest first
        self._unproven: dict[str, dict[int, _Conn]] = {}
        self._unproven_count = 0
        self._returned: queue.SimpleQueue[_Conn | None] = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._lanes = {spec.name: _Lane(spec) for spec in limits.lanes}
        self._stopping = False
        self._refusal_logged = 0.0
        self._next_deadline = math.inf  # the earliest deadline of a connection

    # ---- the loop --------------------------------------------------------

    def serve_forever(self) -> None:
        try:
            while not self._stopping:
                for key, _ in self._selector.select(self._timeout()):
                    if key.fileobj is self.listener:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        self._take_back()
                    else:
                        self._ready(key.data)
                now = time.monotonic()
                if now >= self._next_deadline:
                    self._expire(now)
        finally:
            self._close_all()

    def _timeout(self) -> float | None:
        if self._next_deadline == math.inf:
            return None  # nothing to time out: woken by a client or a worker
        return max(0.0, self._next_deadline - time.monotonic()) + 0.01

    def _set_deadline(self, conn: _Conn, seconds: float, slow: bool) -> None:
        """The connection is closed if nothing comes for ``seconds``
        (``slow``: it began a request, and is counted when it times out)."""
        conn.deadline, conn.slow = time.monotonic() + seconds, slow
        self._next_deadline = min(self._next_deadline, conn.deadline)

    # ---- accepting, within the budgets -----------------------------------

    def _accept(self) -> None:
        for _ in range(LISTEN_BACKLOG):  # what is queued, then back to the others
            try:
                raw, peer = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of fds: wait for a close
                log.warning("cannot accept a connection: %s", _reason(exc))
                return
            host = str(peer[0]) if isinstance(peer, tuple) else str(peer)
            if not self._make_room(host):
                self._refuse(raw, peer)
                continue
            raw.setblocking(False)
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(raw, raw.fileno(), peer, math.inf)
            conn.stage = _Stage.PEEK if self.tls is not None else _Stage.READING
            self._set_deadline(conn, self.limits.first_request_s, slow=True)
            self._conns[conn.fd] = conn
            self._unproven.setdefault(host, {})[conn.fd] = conn
            self._unproven_count += 1
            self._selector.register(conn.fd, selectors.EVENT_READ, conn)

    def _make_room(self, host: str) -> bool:
        """Room for a new connection from ``host``: within its address's
        budget and the totals, displacing idle connections if need be."""
        mine = self._unproven.get(host, {})
        if len(mine) >= self.limits.unproven_per_address and not self._evict(mine.values()):
            return False
        if self._unproven_count >= self.limits.max_unproven:
            crowd = max(self._unproven.values(), key=len)
            if not self._evict(crowd.values()):
                return False
        if len(self._conns) < self.limits.max_connections:
            return True
        unproven = (c for group in self._unproven.values() for c in group.values())
        return self._evict(unproven) or self._evict(self._idle_proven())

    def _idle_proven(self) -> Iterator[_Conn]:
        by_age = sorted(
            (c for c in self._conns.values() if c.proven and c.stage is _Stage.READING),
            key=lambda c: c.deadline,
        )
        yield from by_age

    def _evict(self, candidates: Iterable[_Conn]) -> bool:
        """Close the first of ``candidates`` that has sent nothing (a client
        in the middle of its request, or its handshake, is left alone)."""
        for conn in candidates:
            idle = conn.stage in (_Stage.PEEK, _Stage.READING) and not conn.buf
            if idle and not _has_input(conn.fd):
                self.counts["evicted"] += 1
                self._close(conn)
                return True
        return False

    def _refuse(self, raw: socket.socket, peer: Any) -> None:
        self.counts["refused"] += 1
        raw.close()
        now = time.monotonic()
        if now - self._refusal_logged > REFUSAL_LOG_S:  # a flood is one line per period
            self._refusal_logged = now
            log.warning(
                "refused %s: no room (%d connections open, %d not authenticated; "
                "%d refused so far)",
                _peer(peer),
                len(self._conns),
                self._unproven_count,
                self.counts["refused"],
            )

    def _prove(self, conn: _Conn) -> None:
        if conn.proven:
            return
        conn.proven = True
        host = str(conn.peer[0]) if isinstance(conn.peer, tuple) else str(conn.peer)
        group = self._unproven.get(host)
        if group is not None and group.pop(conn.fd, None) is not None:
            self._unproven_count -= 1
            if not group:
                del self._unproven[host]

    # ---- reading ----------------------------------------------------------

    def _ready(self, conn: _Conn) -> None:
        try:
            if conn.stage is _Stage.PEEK:
                self._peek(conn)
            if conn.stage is _Stage.HANDSHAKE:
                self._handshake(conn)
            if conn.stage is _Stage.READING:
                self._read(conn)
        except OSError as exc:  # ssl.SSLError included
            what = "no TLS session" if conn.stage is not _Stage.READING else "went away"
            log.info("client %s: %s: %s", _peer(conn.peer), what, _reason(exc))
            self._close(conn)

    def _peek(self, conn: _Conn) -> None:
        try:
            first = conn.raw.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return
        if not first:
            self._close(conn)
        elif first[0] != 0x16:  # not a TLS handshake record: plain HTTP, most likely
            log.info("client %s: plain HTTP on a TLS listener, refused", _peer(conn.peer))
            if self._lanes["refusal"].full:
                self._close(conn)
            else:
                self._hand_over(conn, _refuse_plain, "refusal")
        else:
            assert self.tls is not None
            conn.sock = self.tls.wrap_socket(
                conn.raw, server_side=True, do_handshake_on_connect=False
            )
            conn.stage = _Stage.HANDSHAKE

    def _handshake(self, conn: _Conn) -> None:
        assert isinstance(conn.sock, ssl.SSLSocket)
        try:
            conn.sock.do_handshake()
        except ssl.SSLWantReadError:
            self._selector.modify(conn.fd, selectors.EVENT_READ, conn)
            return
        except ssl.SSLWantWriteError:
            self._selector.modify(conn.fd, selectors.EVENT_WRITE, conn)
            return
        self._selector.modify(conn.fd, selectors.EVENT_READ, conn)
        conn.stage = _Stage.READING  # its first request: within the deadline of its accept

    def _read(self, conn: _Conn) -> None:
        while True:
            try:
                chunk = conn.io.recv(RECV_BYTES)
            except (BlockingIOError, ssl.SSLWantReadError):
                break
            except ssl.SSLWantWriteError:
                self._selector.modify(conn.fd, selectors.EVENT_WRITE, conn)
                return
            if not chunk:
                self._close(conn)
                return
            if not conn.slow:  # a request begins: it has the read timeout to arrive
                self._set_deadline(conn, self.limits.read_timeout_s, slow=True)
            conn.buf += chunk
            if len(conn.buf) > MAX_HEAD + self.max_body:
                break
        self._selector.modify(conn.fd, selectors.EVENT_READ, conn)
        self._dispatch_whole(conn)

    def _dispatch_whole(self, conn: _Conn) -> None:
        size = request_size(conn.buf, self.max_body)
        if size is None:
            self._continue(conn)
            return
        data = bytes(conn.buf[:size])
        del conn.buf[:size]
        conn.continued = False
        head = parse_head(data, conn.peer, self.tls is not None)
        if head is None:
            line = data.split(b"\r\n", 1)[0][:80].decode("latin-1")
            body = encode_json({"error": f"400 not an HTTP/1.x request line: {line!r}"})
            admission = Admission(None, status=400, body=body)
        else:
            admission = self.gate(head)
        if admission.lane is None:
            if admission.status in (401, 403):
                self.counts["unauthenticated"] += 1
            self._answer_now(conn, admission.status, admission.body, admission.headers)
            return
        lane = self._lanes[admission.lane]
        if lane.full:
            self.counts["busy"] += 1
            body = encode_json({"error": f"busy: {lane.spec.name} requests are at their "
                                         "limit; ask again"})  # fmt: skip
            self._answer_now(conn, 503, body, (("Retry-After", "1"),))
            return
        if admission.authenticated:
            self._prove(conn)
        conn.credential = admission.credential
        self._hand_over(conn, lambda c: self._answer(c, data), lane.spec.name)

    def _answer_now(
        self, conn: _Conn, status: int, body: bytes, headers: tuple[tuple[str, str], ...]
    ) -> None:
        """A short answer sent from the loop, then the connection closed (a
        few hundred bytes into an empty send buffer: never waited for)."""
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}",
                 "Content-Type: application/json", f"Content-Length: {len(body)}",
                 "Connection: close", *(f"{k}: {v}" for k, v in headers)]  # fmt: skip
        with contextlib.suppress(OSError):  # BlockingIOError, SSLWantWriteError included
            conn.io.send("\r\n".join(lines).encode() + b"\r\n\r\n" + body)
        self._close(conn)

    def _continue(self, conn: _Conn) -> None:
        """A client that waits for "100 Continue" before its body (curl does
        above 1 KiB) is told to go on once its head is in."""
        end = conn.buf.find(b"\r\n\r\n")
        if conn.continued or end < 0 or not _EXPECT_CONTINUE.search(bytes(conn.buf[:end])):
            return
        conn.continued = True
        with contextlib.suppress(BlockingIOError, ssl.SSLWantWriteError):
            conn.io.send(_CONTINUE)  # a few bytes into an empty send buffer

    # ---- the workers --------------------------------------------------------

    def _hand_over(self, conn: _Conn, work: Callable[[_Conn], bool], lane: str) -> None:
        """A worker of ``lane`` has the connection until ``work`` returns
        (True: keep it)."""
        self._selector.unregister(conn.fd)
        conn.stage, conn.lane = _Stage.SERVING, lane
        worker = self._lanes[lane]
        try:
            worker.pool.submit(self._work, conn, work)
        except RuntimeError:  # shutting down
            self._close(conn)
            return
        worker.in_flight += 1

    def _work(self, conn: _Conn, work: Callable[[_Conn], bool]) -> None:
        keep = False
        try:
            conn.io.settimeout(self.limits.write_timeout_s)
            keep = work(conn)
        except OSError as exc:
            log.info("client %s went away: %s", _peer(conn.peer), _reason(exc))
        except Exception:  # never let a request take the server down
            log.exception("connection from %s failed", _peer(conn.peer))
        if not keep:
            conn.buf.clear()
        self._returned.put(conn if keep else _closing(conn))
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def _answer(self, conn: _Conn, data: bytes) -> bool:
        handler = object.__new__(self.RequestHandlerClass)
        handler.server = self  # type: ignore[assignment]
        handler.request = handler.connection = conn.io
        handler.client_address = conn.peer
        handler.credential = conn.credential  # type: ignore[attr-defined]
        handler.rfile = io.BytesIO(data)
        handler.wfile = conn.io.makefile("wb")  # flushed by handle_one_request
        handler.close_connection = True
        try:
            handler.handle_one_request()
        finally:
            handler.wfile.close()
        if getattr(handler, "answer_bytes", 0) > SETTLE_AFTER_BYTES or conn.lane in _HEAVY:
            PROCESS.settle()
        return not handler.close_connection

    def _take_back(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while self._wake_r.recv(4096):
                pass
        while True:
            try:
                conn = self._returned.get_nowait()
            except queue.Empty:
                return
            if conn is None:
                continue
            lane = self._lanes.get(conn.lane)
            if lane is not None:
                lane.in_flight -= 1
                conn.lane = ""
            if self._conns.get(conn.fd) is not conn:
                continue
            if conn.stage is not _Stage.SERVING:  # _closing marked it
                self._close(conn)
                continue
            self._resume(conn)

    def _resume(self, conn: _Conn) -> None:
        conn.io.setblocking(False)
        conn.stage = _Stage.READING
        begun = bool(conn.buf)
        wait = self.limits.read_timeout_s if begun else self.limits.idle_timeout_s
        self._set_deadline(conn, wait, slow=begun)
        self._selector.register(conn.fd, selectors.EVENT_READ, conn)
        pending = isinstance(conn.io, ssl.SSLSocket) and conn.io.pending()
        if pending:
            self._ready(conn)
        elif conn.buf:
            self._dispatch_whole(conn)  # a pipelined request came with the last

    def _expire(self, now: float) -> None:
        """Close what is past its deadline (a pass over every connection, only
        when the earliest deadline has come).  What a client sent and the
        loop has not read yet is read first: a loop that had no CPU for
        seconds (hundreds of agents on two cores) must not close on a client
        whose request came in time (it reset 6-8 of a fan-out's 1,024
        connections, from the loop's lateness alone)."""
        self._next_deadline = math.inf
        for conn in list(self._conns.values()):
            if conn.stage is _Stage.SERVING:
                continue  # a worker's: its deadline is set again when it comes back
            if conn.deadline <= now and self._taken_late(conn):
                continue
            if conn.deadline > now:  # a request begun while idle has its read timeout
                self._next_deadline = min(self._next_deadline, conn.deadline)
                continue
            if conn.slow:
                self.counts["timed_out"] += 1
                log.info("client %s: timed out (%s)", _peer(conn.peer), conn.stage.value)
            self._close(conn)

    def _taken_late(self, conn: _Conn) -> bool:
        """What ``conn`` sent, read now: True if that made it a worker's (a
        whole request) or closed it."""
        if not _has_input(conn.fd):
            return False
        self._ready(conn)
        return conn.stage is _Stage.SERVING or self._conns.get(conn.fd) is not conn

    def _close(self, conn: _Conn) -> None:
        if self._conns.get(conn.fd) is conn:
            del self._conns[conn.fd]
            self._prove(conn)  # out of the budget of unproven connections
            with contextlib.suppress(KeyError, ValueError):  # a worker's: not registered
                self._selector.unregister(conn.fd)
        with contextlib.suppress(OSError):
            conn.io.close()

    def _close_all(self) -> None:
        for conn in list(self._conns.values()):
            with contextlib.suppress(OSError):  # ends a worker's wait on it too
                conn.io.shutdown(socket.SHUT_RDWR)
            if conn.stage is not _Stage.SERVING:
                self._close(conn)
        for lane in self._lanes.values():
            lane.pool.shutdown(wait=True, cancel_futures=True)
        for conn in list(self._conns.values()):  # the workers' are back
            self._close(conn)
        self._selector.close()
        self.listener.close()
        self._wake_r.close()
        self._wake_w.close()

    # ---- from other threads ----------------------------------------------

    def open_connections(self) -> int:
        return len(self._conns)

    def shutdown(self) -> None:
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")


def _has_input(fd: int) -> bool:
    """Whether the client sent something not read yet (or closed)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


def _closing(conn: _Conn) -> _Conn:
    conn.stage = _Stage.READING  # not SERVING: the loop closes it when it comes back
    return conn


def _refuse_plain(conn: _Conn) -> bool:
    head = "HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(_PLAIN_REFUSAL)}\r\nConnection: close\r\n\r\n"
    conn.raw.sendall(head.encode() + _PLAIN_REFUSAL)
    _drain(conn.raw)
    return False


def raise_fd_limit(wanted: int) -> None:
    """Lift the soft limit on open files towards ``wanted`` (at most the
    hard limit): the default 1,024 is fewer than the connections served."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))

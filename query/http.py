"""The agent's HTTP surface, served by the live agent and by ``stallwatch serve``.

    POST /query    {"sql": str, "limit": int?}
                   -> 200 {"host", "columns", "types", "rows", "truncated", "elapsed_ms"}
                   -> 400 {"error"} (bad JSON, refused or failed query)
    POST /fetch    {"queries": [str, ...]}   (what a fan-out asks, ``query.plan``)
                   -> 200 application/x-stallwatch-arrow: per query, in order, an
                      8-byte big-endian length and an Arrow IPC stream of its rows
                      (schema metadata ``stallwatch.truncated``: b"1" if cut at
                      ``Limits.max_fetch_rows``); header X-Stallwatch-Host
    POST /dump     {"reason": str?, "incident_id": str?, "origin": str?, "kind": str?}
                   -> 200 whatever the backend returns; 501 if it cannot dump
    POST /snapshot {"reason": str?, "incident_id": str?, "samples": int?, "interval_s": float?}
                   -> 200 {"host", "incident_id", "status", "path", "positions"}: the
                   node's thread positions read ``samples`` times, then a dump; 501
                   if the backend cannot read them (dumps served by ``serve``)
    POST /recording {"incident_id": str?, "reason": str?}
                   -> 200 application/x-stallwatch-dumps: what a dump would hold now
                      (rings, tables, a fresh thread reading), under that incident id,
                      and nothing written; ``serve`` answers with the dumps it serves
    GET  /dumps    -> 200 {"host", "dumps": [{"name", "incident_id", "wall_ns", "bytes"}]}:
                   the dump files the agent keeps, newest first
    POST /collect  {"incident_id": str} -> 200 application/x-stallwatch-dumps: the
                   files of that incident, as written; 404 if it has none
    GET  /metrics  Prometheus text exposition format (version 0.0.4)
    GET  /healthz  -> 200 {"status": "ok", "host", "version"}

``application/x-stallwatch-dumps``: 8-byte big-endian length frames, the
first a JSON object ``{"host", "incident_id", "names": [file name, ...]}``,
then one dump (the msgpack dump format, checked by its reader) per name.
``/recording`` and ``/collect`` of a backend that has no recording or dump
folder answer 501.

A route is a function of the request handler returning (status, content type,
body), listed in ``ROUTES``: another endpoint is one function and one entry.

Every error is a JSON object ``{"error": "..."}``.  With a token, every request
needs ``Authorization: Bearer <token>`` (compared in constant time) or gets
401.  A token crosses the network only inside TLS: a listener on a
non-loopback address is refused at start without TLS (``--tls-cert``,
``--tls-key``) and a token, and a request with a token over plain HTTP from
a non-loopback peer gets 403.  A plain-HTTP client of a TLS listener gets a
plain 400 saying so, and the connection is closed.  With a client CA
(``--tls-client-ca``), clients must present a certificate it signed (mutual
TLS).  Request bodies above ``MAX_BODY`` bytes get 413 unread.  Queries run
in the sandbox of ``query.sql`` with its network limits (rows, time, memory).

Serving is bounded (``ServeLimits``): one thread waits on every connection
with epoll, reads requests and runs TLS handshakes without blocking, and
hands each whole request to one of ``WORKERS`` threads; an idle client
holds a socket, never a thread.  A request or handshake that has begun must
be in within ``READ_TIMEOUT_S`` (a slow client is closed and counted), an
idle keep-alive connection is closed after ``IDLE_TIMEOUT_S``, and at most
``MAX_CONNECTIONS`` are open: more are closed at accept and counted
(``ServerHandle.counters``, on the agent's ``/metrics``).

JSON: integers are written exactly, whatever their size (communicator hashes
are UBIGINT and often above 2**63; Python's ``json`` reads them back exactly,
JavaScript's ``JSON.parse`` does not — read them with a big-integer aware
parser, or select ``printf('%x', comm_id_hash)``).  Timestamps become ISO 8601
strings, non-finite floats ``null``, bytes hex strings.

Any failure inside a request handler becomes a 500 response; it never reaches
the server loop or the agent that hosts it.  A client that goes away (reset,
broken pipe, timeout, failed handshake) is logged in one line.

Requests are parsed and answered by the standard library's
``BaseHTTPRequestHandler`` (one request at a time, from the bytes the loop
read); the agent stays free of web framework dependencies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import decimal
import enum
import hmac
import io
import ipaddress
import json
import logging
import math
import queue
import re
import resource
import selectors
import socket
import ssl
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from stallwatch import __version__
from stallwatch.dumpers.errors import QueryError, StallwatchError, UsageError
from stallwatch.dumpers.folder import list_dumps
from stallwatch.dumpers.format import dump_file_name, encode
from stallwatch.dumpers.model import Recording

from .limits import NETWORK, Limits
from .tls import ServerTls

if TYPE_CHECKING:
    import pyarrow as pa

    from .sql import QueryEngine, QueryResult

log = logging.getLogger(__name__)

MAX_BODY = 64 * 1024
MAX_HEAD = 64 * 1024  # request line and headers; longer is refused by the handler
# Connections open at once: idle ones hold a socket each (no thread), so a
# fleet's scrapers, fan-outs and forgotten keep-alives fit many times over.
MAX_CONNECTIONS = 4096
WORKERS = 8  # requests answered at once
READ_TIMEOUT_S = 10.0  # from a request's (or a TLS handshake's) first byte to its last
IDLE_TIMEOUT_S = 60.0  # a keep-alive connection with no request is closed
WRITE_TIMEOUT_S = 30.0  # a client that stops reading its answer
LISTEN_BACKLOG = 128
RECV_BYTES = 65536
REFUSAL_LOG_S = 10.0
FDS_BESIDES = 512  # the agent's other files: maps, links, dumps
RECORDING_CACHE_S = 0.5
ARROW_FRAMES = "application/x-stallwatch-arrow"


VERSION = __version__


class Backend(Protocol):
    """What the server needs from whoever hosts it (the agent, or dumps).

    A backend that can dump also has ``request_dump(reason, incident_id,
    origin[, kind]) -> JSON-able answer`` (:class:`DumpingBackend`; ``kind``,
    given when a peer says what its incident is, its trigger's kind); it may raise
    ``StallwatchError`` (``UsageError`` answers 400, others 500).  Without it,
    ``POST /dump`` answers 501.  ``recording()`` is called at most every
    ``RECORDING_CACHE_S`` seconds, and only when a query comes."""

    @property
    def host(self) -> str: ...

    def recording(self) -> Recording: ...

    def metrics_text(self) -> str: ...


class DumpingBackend(Backend, Protocol):
    def request_dump(
        self, reason: str, incident_id: str | None, origin: str | None, kind: str | None = None
    ) -> object: ...


class SnapshottingBackend(Backend, Protocol):
    def request_snapshot(
        self, reason: str, incident_id: str | None, samples: int, interval_s: float
    ) -> object: ...


class LiveBackend(Backend, Protocol):
    def live_recordings(self, incident_id: str, reason: str) -> Sequence[Recording]: ...


class DumpFolderBackend(Backend, Protocol):
    @property
    def dump_dir(self) -> Path: ...


MAX_SNAPSHOT_SAMPLES = 20
MAX_SNAPSHOT_INTERVAL_S = 10.0


# ---- metrics of served dumps ----------------------------------------------


def recording_metrics_text(recordings: Sequence[Recording]) -> str:
    """Ring metrics of recordings: rows held, overwritten and lost per ring
    (Prometheus text, rendered by ``prometheus_client``)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.exposition import generate_latest
    from prometheus_client.registry import CollectorRegistry

    labels = ["host", "kind"]
    held = GaugeMetricFamily("stallwatch_ring_rows", "Rows held in each ring.", labels=labels)
    over = CounterMetricFamily(
        "stallwatch_events_overwritten", "Rows a ring dropped to make room.", labels=labels
    )
    lost = CounterMetricFamily(
        "stallwatch_events_lost",
        "Events the kernel could not record (ring buffer full).",
        labels=labels,
    )
    for rec in recordings:
        for name, ring in sorted(rec.rings.items()):
            held.add_metric([rec.host, name], float(len(ring.rows)))
            over.add_metric([rec.host, name], float(ring.overwritten))
            lost.add_metric([rec.host, name], float(ring.lost))

    class _Collector:
        def collect(self) -> list[Any]:
            return [held, over, lost]

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    return generate_latest(registry).decode()


# ---- backends --------------------------------------------------------------


class RecordingsBackend:
    """Recorded dumps served like a live agent (``stallwatch serve``)."""

    def __init__(self, recordings: Sequence[Recording]) -> None:
        if not recordings:
            raise UsageError("nothing to serve: no recordings given")
        self.recordings = tuple(recordings)
        hosts = dict.fromkeys(r.host for r in self.recordings)
        self.host = ",".join(hosts)

    def recording(self) -> Recording:
        return self.recordings[0]

    def live_recordings(self, incident_id: str, reason: str) -> Sequence[Recording]:
        """The dumps served, as they were recorded (their own incidents)."""
        return self.recordings

    def metrics_text(self) -> str:
        return recording_metrics_text(self.recordings)


# ---- JSON ------------------------------------------------------------------


def _json_default(value: object) -> object:
    if isinstance(value, datetime.datetime | datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    if isinstance(value, uuid.UUID):
        return str(value)
    return str(value)


def _finite(value: object) -> object:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value


def encode_json(doc: object) -> bytes:
    """Strict JSON (no NaN tokens), exact integers."""
    try:
        text = json.dumps(doc, default=_json_default, allow_nan=False)
    except ValueError:
        text = json.dumps(_finite(doc), default=_json_default, allow_nan=False)
    return text.encode()


# ---- Arrow frames (POST /fetch) ---------------------------------------------

_LENGTH = struct.Struct(">Q")


def join_frames(parts: Iterable[bytes | memoryview]) -> bytes:
    """Each part behind its 8-byte big-endian length."""
    out = bytearray()
    for part in parts:
        out += _LENGTH.pack(len(part))
        out += part
    return bytes(out)


def split_frames(data: bytes) -> list[memoryview]:
    """The inverse of :func:`join_frames`; ValueError on a malformed body."""
    view, parts, at = memoryview(data), [], 0
    while at < len(view):
        if at + _LENGTH.size > len(view):
            raise ValueError("a frame length is cut short")
        (size,) = _LENGTH.unpack_from(view, at)
        at += _LENGTH.size
        if at + size > len(view):
            raise ValueError(f"a frame of {size} bytes is cut short")
        parts.append(view[at : at + size])
        at += size
    return parts


DUMP_FRAMES = "application/x-stallwatch-dumps"


@dataclass(frozen=True, slots=True)
class DumpBundle:
    """An answer of ``/recording`` or ``/collect``: dumps as bytes, by name."""

    host: str
    incident_id: str | None
    names: tuple[str, ...]
    blobs: tuple[bytes, ...]


def encode_dumps(bundle: DumpBundle) -> bytes:
    head = {"host": bundle.host, "incident_id": bundle.incident_id, "names": list(bundle.names)}
    return join_frames([encode_json(head), *bundle.blobs])


def decode_dumps(data: bytes) -> DumpBundle:
    """The inverse of :func:`encode_dumps`; ValueError on a malformed body
    (the dumps themselves are checked by the dump reader, not here)."""
    frames = split_frames(data)
    if not frames:
        raise ValueError("no frames")
    try:
        head = json.loads(bytes(frames[0]))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"the first frame is not JSON: {exc}") from None
    names = head.get("names") if isinstance(head, dict) else None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError("the first frame has no list of names")
    if len(names) != len(frames) - 1:
        raise ValueError(f"{len(names)} names for {len(frames) - 1} dumps")
    host, incident = head.get("host"), head.get("incident_id")
    return DumpBundle(
        host if isinstance(host, str) else "",
        incident if isinstance(incident, str) else None,
        tuple(names),
        tuple(bytes(f) for f in frames[1:]),
    )


def encode_frames(host: str, results: Sequence[tuple[pa.Table, bool]]) -> bytes:
    """Each table as an Arrow IPC stream behind its 8-byte length; the host
    and whether the table was cut short ride in its schema metadata."""
    import pyarrow as pa

    frames = []
    for table, truncated in results:
        meta = {b"stallwatch.truncated": b"1" if truncated else b"0",
                b"stallwatch.host": host.encode()}  # fmt: skip
        table = table.replace_schema_metadata(meta)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        frames.append(sink.getvalue().to_pybytes())
    return join_frames(frames)


@dataclass(frozen=True, slots=True)
class Frame:
    table: pa.Table
    truncated: bool
    host: str


def decode_frames(data: bytes) -> list[Frame]:
    """The inverse of :func:`encode_frames`; ValueError on a malformed body."""
    import pyarrow as pa

    results = []
    for frame in split_frames(data):
        try:
            table = pa.ipc.open_stream(pa.py_buffer(frame)).read_all()
        except pa.ArrowException as exc:
            raise ValueError(f"a frame is not an Arrow stream: {exc}") from None
        meta = table.schema.metadata or {}
        truncated = meta.get(b"stallwatch.truncated") == b"1"
        host = meta.get(b"stallwatch.host", b"").decode(errors="replace")
        results.append(Frame(table.replace_schema_metadata(None), truncated, host))
    return results


# ---- server ----------------------------------------------------------------


class HttpError(Exception):
    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class ServerConfig:
    backend: Backend
    engine: LazyEngine
    token: bytes | None
    max_body: int
    tls: bool


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "stallwatch"
    timeout = 60  # an idle keep-alive connection frees its thread after this
    disable_nagle_algorithm = True  # headers and body leave at once: no delayed-ACK stall
    config: ServerConfig  # set on the per-server subclass

    def handle_expect_100(self) -> bool:
        return True  # the whole request is read before it is answered (_Server)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        try:
            self._authorize()
            route = ROUTES.get(self.path.split("?", 1)[0])
            if route is None:
                raise HttpError(HTTPStatus.NOT_FOUND, f"no such endpoint: {self.path}")
            if route[0] != method:
                raise HttpError(HTTPStatus.METHOD_NOT_ALLOWED, f"{self.path} takes {route[0]}")
            status, content_type, body = route[1](self)
        except HttpError as exc:
            status, content_type = exc.status, "application/json"
            body = encode_json({"error": str(exc)})
        except Exception as exc:  # never let a request take the server down
            log.exception("request %s %s failed", method, self.path)
            status, content_type = HTTPStatus.INTERNAL_SERVER_ERROR, "application/json"
            body = encode_json({"error": f"internal error: {type(exc).__name__}: {exc}"})
        self._send(status, content_type, body)

    def _authorize(self) -> None:
        token = self.config.token
        if token is None:
            return
        if not self.config.tls and not is_loopback(str(self.client_address[0])):
            self.close_connection = True
            raise HttpError(
                HTTPStatus.FORBIDDEN, "a token is accepted only over TLS or from loopback"
            )
        header = self.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token):
            self.close_connection = True
            raise HttpError(HTTPStatus.UNAUTHORIZED, "missing or wrong bearer token")

    def _send(self, status: HTTPStatus, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if status == HTTPStatus.UNAUTHORIZED:
            self.send_header("WWW-Authenticate", 'Bearer realm="stallwatch"')
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def read_json(self) -> dict[str, Any]:
        length_text = self.headers.get("Content-Length")
        if length_text is None:
            self.close_connection = True
            raise HttpError(HTTPStatus.LENGTH_REQUIRED, "Content-Length is required")
        try:
            length = int(length_text)
        except ValueError:
            self.close_connection = True
            raise HttpError(HTTPStatus.BAD_REQUEST, "Content-Length is not a number") from None
        if length < 0 or length > self.config.max_body:
            self.close_connection = True  # the body stays unread
            raise HttpError(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"request body is {length} bytes, the limit is {self.config.max_body}",
            )
        raw = self.rfile.read(length)
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise HttpError(HTTPStatus.BAD_REQUEST, f"request body is not JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise HttpError(HTTPStatus.BAD_REQUEST, "request body must be a JSON object")
        return doc


def _field(doc: Mapping[str, Any], name: str, kind: type, required: bool = False) -> Any:
    value = doc.get(name)
    if value is None:
        if required:
            raise HttpError(HTTPStatus.BAD_REQUEST, f"field {name!r} is required")
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise HttpError(
            HTTPStatus.BAD_REQUEST,
            f"field {name!r} must be {kind.__name__}, got {type(value).__name__}",
        )
    return value


Response = tuple[HTTPStatus, str, bytes]


def _query(h: _Handler) -> Response:
    doc = h.read_json()
    sql = _field(doc, "sql", str, required=True)
    limit = _field(doc, "limit", int)
    try:
        result = h.config.engine.query(sql, limit)
    except QueryError as exc:
        raise HttpError(HTTPStatus.BAD_REQUEST, str(exc)) from None
    body = {
        "host": h.config.backend.host,
        "columns": list(result.columns),
        "types": list(result.types),
        "rows": result.rows,
        "truncated": result.truncated,
        "elapsed_ms": round(result.elapsed_ms, 3),
    }
    return HTTPStatus.OK, "application/json", encode_json(body)


def _fetch(h: _Handler) -> Response:
    doc = h.read_json()
    queries = _field(doc, "queries", list, required=True)
    if not all(isinstance(q, str) for q in queries):
        raise HttpError(HTTPStatus.BAD_REQUEST, "field 'queries' must be a list of SQL texts")
    try:
        results = [h.config.engine.fetch_arrow(q) for q in queries]
    except QueryError as exc:
        raise HttpError(HTTPStatus.BAD_REQUEST, str(exc)) from None
    return HTTPStatus.OK, ARROW_FRAMES, encode_frames(h.config.backend.host, results)


def _dump(h: _Handler) -> Response:
    doc = h.read_json()
    request_dump = getattr(h.config.backend, "request_dump", None)
    if request_dump is None:
        raise HttpError(HTTPStatus.NOT_IMPLEMENTED, "this server serves recorded dumps only")
    reason = _field(doc, "reason", str) or "requested over HTTP (POST /dump)"
    incident = _field(doc, "incident_id", str)
    origin = _field(doc, "origin", str)
    kind = _field(doc, "kind", str)  # a peer's incident: what it is
    try:
        answer = request_dump(reason, incident, origin, *((kind,) if kind else ()))
    except UsageError as exc:
        raise HttpError(HTTPStatus.BAD_REQUEST, str(exc)) from None
    except StallwatchError as exc:
        raise HttpError(HTTPStatus.INTERNAL_SERVER_ERROR, f"dump failed: {exc}") from None
    return HTTPStatus.OK, "application/json", encode_json(answer)


def _snapshot(h: _Handler) -> Response:
    doc = h.read_json()
    request_snapshot = getattr(h.config.backend, "request_snapshot", None)
    if request_snapshot is None:
        raise HttpError(HTTPStatus.NOT_IMPLEMENTED, "this server serves recorded dumps only")
    reason = _field(doc, "reason", str) or "requested over HTTP (POST /snapshot)"
    incident = _field(doc, "incident_id", str)
    samples = _field(doc, "samples", int)
    samples = 3 if samples is None else samples
    interval = doc.get("interval_s", 0.5)
    if isinstance(interval, bool) or not isinstance(interval, int | float):
        raise HttpError(HTTPStatus.BAD_REQUEST, "field 'interval_s' must be a number")
    if not 1 <= samples <= MAX_SNAPSHOT_SAMPLES:
        raise HttpError(HTTPStatus.BAD_REQUEST, f"samples: expected 1 to {MAX_SNAPSHOT_SAMPLES}")
    if not 0 <= interval <= MAX_SNAPSHOT_INTERVAL_S:
        raise HttpError(
            HTTPStatus.BAD_REQUEST, f"interval_s: expected 0 to {MAX_SNAPSHOT_INTERVAL_S:g}"
        )
    try:
        answer = request_snapshot(reason, incident, samples, interval)
    except UsageError as exc:
        raise HttpError(HTTPStatus.BAD_REQUEST, str(exc)) from None
    except StallwatchError as exc:
        raise HttpError(HTTPStatus.INTERNAL_SERVER_ERROR, f"snapshot failed: {exc}") from None
    return HTTPStatus.OK, "application/json", encode_json(answer)


def _recording(h: _Handler) -> Response:
    doc = h.read_json()
    live = getattr(h.config.backend, "live_recordings", None)
    if live is None:
        raise HttpError(HTTPStatus.NOT_IMPLEMENTED, "this server holds no recording")
    incident = _field(doc, "incident_id", str) or f"live-{uuid.uuid4().hex[:12]}"
    reason = _field(doc, "reason", str) or "read over HTTP (POST /recording)"
    recordings = live(incident, reason)
    bundle = DumpBundle(
        h.config.backend.host,
        incident,
        tuple(dump_file_name(r) for r in recordings),
        tuple(encode(r) for r in recordings),
    )
    return HTTPStatus.OK, DUMP_FRAMES, encode_dumps(bundle)


def _dump_dir(h: _Handler) -> Path:
    folder = getattr(h.config.backend, "dump_dir", None)
    if not isinstance(folder, Path):
        raise HttpError(HTTPStatus.NOT_IMPLEMENTED, "this server keeps no dump folder")
    return folder


def _dumps(h: _Handler) -> Response:
    listing = [dataclasses.asdict(d) for d in list_dumps(_dump_dir(h))]
    body = {"host": h.config.backend.host, "dumps": listing}
    return HTTPStatus.OK, "application/json", encode_json(body)


def _collect(h: _Handler) -> Response:
    doc = h.read_json()
    incident = _field(doc, "incident_id", str, required=True)
    found = [d for d in list_dumps(_dump_dir(h)) if d.incident_id == incident]
    blobs, names = [], []
    for d in found:
        try:
            blobs.append((_dump_dir(h) / d.name).read_bytes())
        except OSError as exc:  # removed by retention meanwhile: said by its absence
            log.info("collect %s: %s: %s", incident, d.name, exc.strerror or exc)
            continue
        names.append(d.name)
    if not names:
        raise HttpError(HTTPStatus.NOT_FOUND, f"no dump of incident {incident} here")
    bundle = DumpBundle(h.config.backend.host, incident, tuple(names), tuple(blobs))
    return HTTPStatus.OK, DUMP_FRAMES, encode_dumps(bundle)


def _metrics(h: _Handler) -> Response:
    text = h.config.backend.metrics_text()
    return HTTPStatus.OK, "text/plain; version=0.0.4; charset=utf-8", text.encode()


def _healthz(h: _Handler) -> Response:
    doc = {"status": "ok", "host": h.config.backend.host, "version": VERSION}
    return HTTPStatus.OK, "application/json", encode_json(doc)


ROUTES: dict[str, tuple[str, Callable[[_Handler], Response]]] = {
    "/query": ("POST", _query),
    "/fetch": ("POST", _fetch),
    "/dump": ("POST", _dump),
    "/snapshot": ("POST", _snapshot),
    "/recording": ("POST", _recording),
    "/dumps": ("GET", _dumps),
    "/collect": ("POST", _collect),
    "/metrics": ("GET", _metrics),
    "/healthz": ("GET", _healthz),
}


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
class ServeLimits:
    """How much the surface serves at once, and how long it waits for clients."""

    max_connections: int = MAX_CONNECTIONS  # open at once; more are closed at accept
    workers: int = WORKERS  # threads answering requests (idle connections hold none)
    read_timeout_s: float = READ_TIMEOUT_S  # a request (or TLS handshake) begun must end
    idle_timeout_s: float = IDLE_TIMEOUT_S  # a keep-alive connection with no request
    write_timeout_s: float = WRITE_TIMEOUT_S  # a client that does not read its answer


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


class _Server:
    """The HTTP surface: one thread waits on every connection (epoll) and
    reads requests; a small pool of workers answers whole requests.  An
    idle client costs a socket, not a thread; a slow one is closed when its
    request (or TLS handshake) is not in within the read timeout; at most
    ``max_connections`` are open, more are closed at once and counted."""

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[_Handler],
        family: socket.AddressFamily,
        tls: ssl.SSLContext | None,
        limits: ServeLimits,
    ) -> None:
        self.RequestHandlerClass = handler
        self.tls = tls
        self.limits = limits
        self.counts = {"refused": 0, "timed_out": 0}
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.listener.bind(address)
            self.listener.listen(socket.SOMAXCONN)
        except OSError:
            self.listener.close()
            raise
        self.listener.setblocking(False)
        self.server_address = self.listener.getsockname()
        self._conns: dict[int, _Conn] = {}  # fd -> connection, workers' included
        self._returned: queue.SimpleQueue[_Conn | None] = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._pool = ThreadPoolExecutor(limits.workers, thread_name_prefix="http worker")
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

    def _accept(self) -> None:
        for _ in range(LISTEN_BACKLOG):  # what is queued, then back to the others
            try:
                raw, peer = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of fds: wait for a close
                log.warning("cannot accept a connection: %s", _reason(exc))
                return
            if len(self._conns) >= self.limits.max_connections:
                self._refuse(raw, peer)
                continue
            raw.setblocking(False)
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(raw, raw.fileno(), peer, math.inf)
            if self.tls is not None:
                conn.stage = _Stage.PEEK
                self._set_deadline(conn, self.limits.read_timeout_s, slow=True)
            else:
                self._set_deadline(conn, self.limits.idle_timeout_s, slow=False)
            self._conns[conn.fd] = conn
            self._selector.register(conn.fd, selectors.EVENT_READ, conn)

    def _refuse(self, raw: socket.socket, peer: Any) -> None:
        self.counts["refused"] += 1
        raw.close()
        now = time.monotonic()
        if now - self._refusal_logged > REFUSAL_LOG_S:  # a flood is one line per period
            self._refusal_logged = now
            log.warning(
                "refused %s: %d connections open (%d refused so far)",
                _peer(peer),
                self.limits.max_connections,
                self.counts["refused"],
            )

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
            self._hand_over(conn, _refuse_plain)
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
        conn.stage = _Stage.READING
        self._set_deadline(conn, self.limits.idle_timeout_s, slow=False)

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
            if len(conn.buf) > MAX_HEAD + self._max_body():
                break
        self._selector.modify(conn.fd, selectors.EVENT_READ, conn)
        self._dispatch_whole(conn)

    def _max_body(self) -> int:
        return self.RequestHandlerClass.config.max_body

    def _dispatch_whole(self, conn: _Conn) -> None:
        size = request_size(conn.buf, self._max_body())
        if size is None:
            self._continue(conn)
            return
        data = bytes(conn.buf[:size])
        del conn.buf[:size]
        conn.continued = False
        self._hand_over(conn, lambda c: self._answer(c, data))

    def _continue(self, conn: _Conn) -> None:
        """A client that waits for "100 Continue" before its body (curl does
        above 1 KiB) is told to go on once its head is in."""
        end = conn.buf.find(b"\r\n\r\n")
        if conn.continued or end < 0 or not _EXPECT_CONTINUE.search(bytes(conn.buf[:end])):
            return
        conn.continued = True
        with contextlib.suppress(BlockingIOError, ssl.SSLWantWriteError):
            conn.io.send(_CONTINUE)  # a few bytes into an empty send buffer

    def _hand_over(self, conn: _Conn, work: Callable[[_Conn], bool]) -> None:
        """A worker has the connection until ``work`` returns (True: keep it)."""
        self._selector.unregister(conn.fd)
        conn.stage = _Stage.SERVING
        try:
            self._pool.submit(self._work, conn, work)
        except RuntimeError:  # shutting down
            self._close(conn)

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
        handler.rfile = io.BytesIO(data)
        handler.wfile = conn.io.makefile("wb")  # flushed by handle_one_request
        handler.close_connection = True
        try:
            handler.handle_one_request()
        finally:
            handler.wfile.close()
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
            if conn is None or self._conns.get(conn.fd) is not conn:
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
        when the earliest deadline has come)."""
        self._next_deadline = math.inf
        for conn in list(self._conns.values()):
            if conn.stage is _Stage.SERVING:
                continue  # a worker's: its deadline is set again when it comes back
            if conn.deadline > now:
                self._next_deadline = min(self._next_deadline, conn.deadline)
                continue
            if conn.slow:
                self.counts["timed_out"] += 1
                log.info("client %s: timed out (%s)", _peer(conn.peer), conn.stage.value)
            self._close(conn)

    def _close(self, conn: _Conn) -> None:
        if self._conns.get(conn.fd) is conn:
            del self._conns[conn.fd]
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
        self._pool.shutdown(wait=True, cancel_futures=True)
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


def _closing(conn: _Conn) -> _Conn:
    conn.stage = _Stage.READING  # not SERVING: the loop closes it when it comes back
    return conn


def _refuse_plain(conn: _Conn) -> bool:
    head = "HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(_PLAIN_REFUSAL)}\r\nConnection: close\r\n\r\n"
    conn.raw.sendall(head.encode() + _PLAIN_REFUSAL)
    _drain(conn.raw)
    return False


@dataclass(slots=True)
class ServerHandle:
    """A running server: ``address`` is ``host:port`` as clients reach it."""

    address: str
    server: _Server
    thread: threading.Thread
    engine: LazyEngine

    @property
    def url(self) -> str:
        return f"{'https' if self.server.tls else 'http'}://{self.address}"

    def counters(self) -> dict[str, int]:
        """For the agent's /metrics: connections refused at the limit, closed
        for slowness, and open now."""
        return {
            "http_connections_refused": self.server.counts["refused"],
            "http_connections_timed_out": self.server.counts["timed_out"],
            "http_connections_open": self.server.open_connections(),
        }

    def close(self) -> None:
        self.server.shutdown()
        self.thread.join(timeout=10)
        self.engine.close()


class LazyEngine:
    """The SQL engine, made when the first query comes: DuckDB and Arrow
    are loaded then, not when the agent starts (an agent nobody queries
    never carries them)."""

    def __init__(self, make: Callable[[], QueryEngine]) -> None:
        self._make = make
        self._engine: QueryEngine | None = None
        self._lock = threading.Lock()

    def get(self) -> QueryEngine:
        with self._lock:
            if self._engine is None:
                self._engine = self._make()
            return self._engine

    def query(self, sql: str, limit: int | None = None) -> QueryResult:
        return self.get().query(sql, limit)

    def fetch_arrow(self, sql: str) -> tuple[pa.Table, bool]:
        return self.get().fetch_arrow(sql)

    @property
    def loaded(self) -> bool:
        return self._engine is not None

    def close(self) -> None:
        with self._lock:
            if self._engine is not None:
                self._engine.close()


def _engine_for(backend: Backend, limits: Limits, scans: bool) -> LazyEngine:
    def make() -> QueryEngine:
        from .sql import QueryEngine

        if isinstance(backend, RecordingsBackend):
            return QueryEngine(backend.recordings, limits, materialize=True, scans=scans)
        return QueryEngine(
            lambda: [backend.recording()], limits, cache_s=RECORDING_CACHE_S, scans=scans
        )

    return LazyEngine(make)


def serve_http(
    backend: Backend,
    listen: str,
    token: str | None,
    limits: Limits = NETWORK,
    max_body: int = MAX_BODY,
    tls: ServerTls | None = None,
    scans: bool = True,
    serving: ServeLimits | None = None,
) -> ServerHandle:
    """Start the HTTP surface in a daemon thread; port 0 picks a free port.
    A non-loopback ``listen`` needs ``tls`` and a ``token``.  ``scans``: see
    :class:`~stallwatch.query.sql.QueryEngine`."""
    serving = serving or ServeLimits()
    host, port = parse_listen(listen)
    if not is_loopback(host) and (not token or tls is None):
        raise UsageError(
            f"--listen {listen}: a non-loopback address needs TLS and a token: pass "
            "--tls-cert FILE --tls-key FILE and --token-file FILE"
        )
    context = tls.context() if tls is not None else None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    engine = _engine_for(backend, limits, scans)
    secret = token.encode() if token else None
    config = ServerConfig(backend, engine, secret, max_body, context is not None)
    handler = type("_BoundHandler", (_Handler,), {"config": config})
    raise_fd_limit(serving.max_connections + FDS_BESIDES)
    try:
        server = _Server((host, port), handler, family, context, serving)
    except OSError as exc:
        engine.close()
        raise UsageError(f"--listen {listen}: cannot listen: {exc.strerror or exc}") from None
    bound_host, bound_port = server.server_address[:2]
    address = (
        f"[{bound_host}]:{bound_port}" if family == socket.AF_INET6 else f"{host}:{bound_port}"
    )
    thread = threading.Thread(target=server.serve_forever, name=f"http {address}", daemon=True)
    thread.start()
    return ServerHandle(address, server, thread, engine)


def raise_fd_limit(wanted: int) -> None:
    """Lift the soft limit on open files towards ``wanted`` (at most the
    hard limit): the default 1,024 is fewer than the connections served."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))

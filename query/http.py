"""The agent's HTTP surface, served by the live agent and by ``stallwatch serve``.

    POST /query    {"sql": str, "limit": int?}
                   -> 200 {"host", "columns", "types", "rows", "truncated", "elapsed_ms"}
                   -> 400 {"error"} (bad JSON, refused or failed query)
    POST /fetch    {"queries": [str, ...]}   (what a fan-out asks, ``query.plan``)
                   -> 200 application/x-stallwatch-arrow: per query, in order, an
                      8-byte big-endian length and an Arrow IPC stream of its rows
                      (schema metadata ``stallwatch.truncated``: b"1" if cut at
                      ``Limits.max_fetch_rows``); header X-Stallwatch-Host
    POST /dump     {"reason": str?, "incident_id": str?, "origin": str?}
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
TLS); the TLS handshake runs on the connection's own thread, under a time
limit, so a slow or silent client holds up no one else.  Request bodies
above ``MAX_BODY`` bytes get 413 unread.  Queries run in the sandbox of
``query.sql`` with its network limits (rows, time, memory).  At most
``MAX_CONNECTIONS`` connections are served at once; more are closed at once.

JSON: integers are written exactly, whatever their size (communicator hashes
are UBIGINT and often above 2**63; Python's ``json`` reads them back exactly,
JavaScript's ``JSON.parse`` does not — read them with a big-integer aware
parser, or select ``printf('%x', comm_id_hash)``).  Timestamps become ISO 8601
strings, non-finite floats ``null``, bytes hex strings.

Any failure inside a request handler becomes a 500 response; it never reaches
the server loop or the agent that hosts it.  A client that goes away (reset,
broken pipe, timeout, failed handshake) is logged in one line.

The server is the standard library's threading HTTP server: the surface is
a few small routes on a small number of clients, the agent stays free of web
framework dependencies, and what a library would add (a worker pool, TLS
wrapping) is the few lines of ``_Server``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import decimal
import hmac
import ipaddress
import json
import logging
import math
import socket
import ssl
import struct
import sys
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa

from stallwatch import __version__
from stallwatch.dumpers.errors import QueryError, StallwatchError, UsageError
from stallwatch.dumpers.folder import list_dumps
from stallwatch.dumpers.format import dump_file_name, encode
from stallwatch.dumpers.model import Recording

from .sql import NETWORK, Limits, QueryEngine
from .tls import ServerTls

log = logging.getLogger(__name__)

MAX_BODY = 64 * 1024
MAX_CONNECTIONS = 512
HANDSHAKE_TIMEOUT_S = 10.0
POLL_S = 2.0
SNAPSHOT_CACHE_S = 0.5
ARROW_FRAMES = "application/x-stallwatch-arrow"


VERSION = __version__


class Backend(Protocol):
    """What the server needs from whoever hosts it (the agent, or dumps).

    A backend that can dump also has ``request_dump(reason, incident_id,
    origin) -> JSON-able answer`` (:class:`DumpingBackend`); it may raise
    ``StallwatchError`` (``UsageError`` answers 400, others 500).  Without it,
    ``POST /dump`` answers 501.  ``recording()`` is called at most every
    ``SNAPSHOT_CACHE_S`` seconds, and only when a query comes."""

    @property
    def host(self) -> str: ...

    def recording(self) -> Recording: ...

    def metrics_text(self) -> str: ...


class DumpingBackend(Backend, Protocol):
    def request_dump(self, reason: str, incident_id: str | None, origin: str | None) -> object: ...


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
    engine: QueryEngine
    token: bytes | None
    max_body: int
    tls: bool


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "stallwatch"
    timeout = 60  # an idle keep-alive connection frees its thread after this
    disable_nagle_algorithm = True  # headers and body leave at once: no delayed-ACK stall
    config: ServerConfig  # set on the per-server subclass

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
    try:
        answer = request_dump(reason, incident, origin)
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


class _Server(ThreadingHTTPServer):
    """Keeps its open connections (at most ``MAX_CONNECTIONS``), so that
    closing the server also ends the keep-alive connections its handler
    threads still serve; with ``tls``, each connection's handshake runs on
    its own thread."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128
    tls: ssl.SSLContext | None = None  # set on the per-server subclass

    def server_activate(self) -> None:
        # raw socket -> the socket to shut down (its TLS wrapper, once made)
        self.open_connections: dict[socket.socket, socket.socket] = {}
        self.connections_lock = threading.Lock()
        super().server_activate()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.connections_lock:
            full = len(self.open_connections) >= MAX_CONNECTIONS
            if not full:
                self.open_connections[request] = request
        if full:
            log.warning("refused %s: %d connections open", _peer(client_address), MAX_CONNECTIONS)
            request.close()
            return
        super().process_request(request, client_address)

    def finish_request(self, request: Any, client_address: Any) -> None:
        if self.tls is None:
            super().finish_request(request, client_address)
            return
        wrapped = self._handshake(self.tls, request, client_address)
        if wrapped is None:
            return
        with self.connections_lock:
            self.open_connections[request] = wrapped
        try:
            super().finish_request(wrapped, client_address)
        finally:
            wrapped.close()

    def _handshake(
        self, tls: ssl.SSLContext, request: socket.socket, client_address: Any
    ) -> ssl.SSLSocket | None:
        request.settimeout(HANDSHAKE_TIMEOUT_S)
        try:
            first = request.recv(1, socket.MSG_PEEK)
            if not first:
                return None
            if first[0] != 0x16:  # not a TLS handshake record: plain HTTP, most likely
                log.info("client %s: plain HTTP on a TLS listener, refused", _peer(client_address))
                head = "HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\n"
                head += f"Content-Length: {len(_PLAIN_REFUSAL)}\r\nConnection: close\r\n\r\n"
                request.sendall(head.encode() + _PLAIN_REFUSAL)
                _drain(request)
                return None
            return tls.wrap_socket(request, server_side=True)
        except OSError as exc:  # ssl.SSLError and timeouts included
            log.info("client %s: no TLS session: %s", _peer(client_address), _reason(exc))
            return None

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away is one line in the log, not a traceback."""
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):
            log.info("client %s went away: %s", _peer(client_address), _reason(exc))
        else:
            log.error("connection from %s failed", _peer(client_address), exc_info=exc)

    def shutdown_request(self, request: Any) -> None:
        with self.connections_lock:
            self.open_connections.pop(request, None)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        with self.connections_lock:
            connections = list(self.open_connections.values())
        for sock in connections:
            with contextlib.suppress(OSError):  # already gone
                sock.shutdown(socket.SHUT_RDWR)


@dataclass(slots=True)
class ServerHandle:
    """A running server: ``address`` is ``host:port`` as clients reach it."""

    address: str
    server: _Server
    thread: threading.Thread
    engine: QueryEngine

    @property
    def url(self) -> str:
        return f"{'https' if self.server.tls else 'http'}://{self.address}"

    def close(self) -> None:
        stopping = threading.Thread(target=self.server.shutdown, daemon=True)
        stopping.start()
        _wake(self.server)
        stopping.join()
        self.server.server_close()
        self.server.close_connections()
        self.thread.join(timeout=5)
        self.engine.close()


def _wake(server: _Server) -> None:
    """Connect to the server, so that its loop, waiting for a connection,
    sees the shutdown at once instead of at its next poll."""
    host, port = server.server_address[:2]
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(str(host), str(host))
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
        pass


def _engine_for(backend: Backend, limits: Limits, scans: bool) -> QueryEngine:
    if isinstance(backend, RecordingsBackend):
        return QueryEngine(backend.recordings, limits, materialize=True, scans=scans)
    return QueryEngine(lambda: [backend.recording()], limits, cache_s=SNAPSHOT_CACHE_S, scans=scans)


def serve_http(
    backend: Backend,
    listen: str,
    token: str | None,
    limits: Limits = NETWORK,
    max_body: int = MAX_BODY,
    tls: ServerTls | None = None,
    scans: bool = True,
) -> ServerHandle:
    """Start the HTTP surface in a daemon thread; port 0 picks a free port.
    A non-loopback ``listen`` needs ``tls`` and a ``token``.  ``scans``: see
    :class:`~stallwatch.query.sql.QueryEngine`."""
    host, port = parse_listen(listen)
    if not is_loopback(host) and (not token or tls is None):
        raise UsageError(
            f"--listen {listen}: a non-loopback address needs TLS and a token: pass "
            "--tls-cert FILE --tls-key FILE and --token-file FILE"
        )
    context = tls.context() if tls is not None else None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server_class = type("_FamilyServer", (_Server,), {"address_family": family, "tls": context})
    engine = _engine_for(backend, limits, scans)
    secret = token.encode() if token else None
    config = ServerConfig(backend, engine, secret, max_body, context is not None)
    handler = type("_BoundHandler", (_Handler,), {"config": config})
    try:
        server = server_class((host, port), handler)
    except OSError as exc:
        engine.close()
        raise UsageError(f"--listen {listen}: cannot listen: {exc.strerror or exc}") from None
    bound_host, bound_port = server.server_address[:2]
    address = (
        f"[{bound_host}]:{bound_port}" if family == socket.AF_INET6 else f"{host}:{bound_port}"
    )
    # The loop wakes every POLL_S to look for a shutdown (close() also wakes
    # it at once): ten wake-ups a second were idle cost for the agent.
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": POLL_S}, name=f"http {address}"
    )
    thread.daemon = True
    thread.start()
    return ServerHandle(address, server, thread, engine)

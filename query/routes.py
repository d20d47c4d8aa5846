"""The routes of the agent's HTTP surface (the same for ``stallwatch serve``):

    POST /query    {"sql": str, "limit": int?}
                   -> 200 {"host", "columns", "types", "rows", "truncated", "elapsed_ms"}
                   -> 400 {"error"} (bad JSON, refused or failed query)
    POST /fetch    {"queries": [str, ...]}   (what a fan-out asks, ``query.plan``)
                   -> 200 application/x-stallwatch-arrow (``query.wire``), rows cut
                      at ``Limits.max_fetch_rows``; header X-Stallwatch-Host
    POST /dump     {"reason": str?, "incident_id": str?, "origin": str?, "kind": str?}
                   -> 200 whatever the backend returns (the agent: {"host",
                   "incident_id", "status", "path", "error"?}); 429 if clients
                   asked for too many dumps lately; 501 if it cannot dump
                   {"outcome_of": str} -> 200 what became of that incident's
                   dump (status written|queued|failed|unknown, path, error)
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

``/recording`` and ``/collect`` of a backend that has no recording or dump
folder answer 501.

A route is a function of the request handler returning (status, content type,
body), listed in ``ROUTES``: another endpoint is one function and one entry.

Every error is a JSON object ``{"error": "..."}``.  ``admit`` is the gate
the network loop asks before any worker: with a token, every request needs
``Authorization: Bearer <token>`` (compared in constant time) or gets 401;
a scrape credential opens ``/metrics`` and ``/healthz`` only, a dump
credential ``/dump`` and ``/healthz`` only (403 elsewhere); without a token,
everything is open (loopback only) but ``/dump``, which needs the dump
credential when there is one.  A request with a token over plain HTTP from
a non-loopback peer gets 403.  Each route names its lane (the workers that
answer it, ``query.server``).  Request bodies above ``MAX_BODY`` bytes get
413 unread, JSON nested deeper than ``MAX_JSON_DEPTH`` a 400.  Queries run
in the engine's own process (``query.engineproc``), in the sandbox of
``query.sql``, every answer bounded (``query.answers``).

Any failure inside a request handler becomes a 500 response; it never reaches
the server loop or the agent that hosts it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hmac
import json
import logging
import math
import mmap
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from stallwatch import __version__
from stallwatch.dumpers.errors import EngineBusy, QueryError, StallwatchError, UsageError
from stallwatch.dumpers.folder import list_dumps
from stallwatch.dumpers.format import dump_file_name, encode_parts
from stallwatch.dumpers.model import Recording

from .server import Admission, RequestHead, is_loopback
from .wire import (
    ARROW_FRAMES,
    DUMP_FRAMES,
    DumpBundle,
    dump_frames,
    dumps_parts,
    encode_json,
    part_size,
)

if TYPE_CHECKING:
    from .engineproc import Engine

log = logging.getLogger("stallwatch.query.http")

MAX_BODY = 64 * 1024
VERSION = __version__
MAX_SNAPSHOT_SAMPLES = 20
MAX_SNAPSHOT_INTERVAL_S = 10.0


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
        self, reason: str, incident_id: str | None, origin: str | None, *, kind: str | None = None
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


# ---- the request handler -------------------------------------------------


class HttpError(Exception):
    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


class Credential(enum.Enum):
    """What a request's bearer token proves."""

    OPEN = "open"  # nothing asked: an agent without a token (loopback only)
    TOKEN = "token"  # the agent's token: everything
    DUMP = "dump"  # a dump-only credential: POST /dump, GET /healthz
    SCRAPE = "scrape"  # a read-only scrape credential: GET /metrics, GET /healthz


@dataclass(frozen=True, slots=True)
class Secrets:
    """The tokens a server accepts (None: not set)."""

    token: bytes | None = None
    dump: bytes | None = None
    scrape: bytes | None = None

    def credential(self, given: str | None) -> Credential | None:
        """What ``given`` (a bearer token, None if the request has none)
        proves; None if it is wrong, or missing where a token is needed."""
        if given is None:
            return Credential.OPEN if self.token is None else None
        found = None
        for secret, kind in (
            (self.token, Credential.TOKEN),
            (self.dump, Credential.DUMP),
            (self.scrape, Credential.SCRAPE),
        ):
            # every secret compared, in constant time: which one matched is not timed
            if secret is not None and hmac.compare_digest(given.encode(), secret):
                found = kind
        return found


@dataclass(frozen=True, slots=True)
class ServerConfig:
    backend: Backend
    engine: Engine
    secrets: Secrets
    max_body: int
    tls: bool


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "stallwatch"
    timeout = 60  # an idle keep-alive connection frees its thread after this
    disable_nagle_algorithm = True  # headers and body leave at once: no delayed-ACK stall
    config: ServerConfig  # set on the per-server subclass
    credential: Credential = Credential.OPEN  # set by the server from the gate's admission
    answer_bytes = 0  # the body's size, once sent
    retry_after = 1  # seconds, said with a 503 or a 429

    def handle_expect_100(self) -> bool:
        return True  # the whole request is read before it is answered (query.server)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The standard library's refusals of a malformed request, as JSON."""
        self.close_connection = True
        if self.request_version == "HTTP/0.9":  # a line it could not parse: answered as 1.1
            self.request_version = "HTTP/1.1"
        status = HTTPStatus(code)
        text = message or status.phrase
        self._send(status, "application/json", encode_json({"error": f"{code} {text}"}))

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        try:
            route = ROUTES.get(self.path.split("?", 1)[0])
            if route is None or route.method != method:  # the gate said so already
                raise HttpError(HTTPStatus.NOT_FOUND, f"no such endpoint: {method} {self.path}")
            status, content_type, body = route.answer(self)
        except HttpError as exc:
            status, content_type = exc.status, "application/json"
            body = encode_json({"error": str(exc)})
        except Exception as exc:  # never let a request take the server down
            log.exception("request %s %s failed", method, self.path)
            status, content_type = HTTPStatus.INTERNAL_SERVER_ERROR, "application/json"
            body = encode_json({"error": f"internal error: {type(exc).__name__}: {exc}"})
        self._send(status, content_type, body)

    def _send(
        self, status: HTTPStatus, content_type: str, body: bytes | Sequence[bytes | memoryview]
    ) -> None:
        parts = [body] if isinstance(body, bytes | bytearray) else body
        self.answer_bytes = sum(map(part_size, parts))
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(self.answer_bytes))
        if status == HTTPStatus.UNAUTHORIZED:
            self.send_header("WWW-Authenticate", 'Bearer realm="stallwatch"')
        if status in (HTTPStatus.SERVICE_UNAVAILABLE, HTTPStatus.TOO_MANY_REQUESTS):
            self.send_header("Retry-After", str(self.retry_after))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        for part in parts:
            self.wfile.write(part)

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
        depth = json_depth(raw)
        if depth > MAX_JSON_DEPTH:
            raise HttpError(
                HTTPStatus.BAD_REQUEST,
                f"request body is JSON nested {depth} levels deep: the limit is {MAX_JSON_DEPTH}",
            )
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


# the body: bytes, or parts sent one after the other (an answer never joined)
Response = tuple[HTTPStatus, str, bytes | Sequence[bytes | memoryview]]


def _query(h: Handler) -> Response:
    doc = h.read_json()
    sql = _field(doc, "sql", str, required=True)
    limit = _field(doc, "limit", int)
    with _answering_queries():
        body = h.config.engine.query(sql, limit, h.config.backend.host)
    return HTTPStatus.OK, "application/json", body


def _fetch(h: Handler) -> Response:
    doc = h.read_json()
    queries = _field(doc, "queries", list, required=True)
    if not all(isinstance(q, str) for q in queries):
        raise HttpError(HTTPStatus.BAD_REQUEST, "field 'queries' must be a list of SQL texts")
    with _answering_queries():
        parts = h.config.engine.fetch(queries, h.config.backend.host)
    return HTTPStatus.OK, ARROW_FRAMES, parts


@contextlib.contextmanager
def _answering_queries() -> Iterator[None]:
    """The engine's refusals as HTTP: busy is 503 (ask again), a query
    refused or failed is 400."""
    try:
        yield
    except EngineBusy as exc:
        raise HttpError(HTTPStatus.SERVICE_UNAVAILABLE, f"busy: {exc}; ask again") from None
    except QueryError as exc:
        raise HttpError(HTTPStatus.BAD_REQUEST, str(exc)) from None


def _dump(h: Handler) -> Response:
    doc = h.read_json()
    request_dump = getattr(h.config.backend, "request_dump", None)
    if request_dump is None:
        raise HttpError(HTTPStatus.NOT_IMPLEMENTED, "this server serves recorded dumps only")
    asked = _field(doc, "outcome_of", str)
    if asked is not None:
        return _dump_outcome(h, asked)
    reason = _field(doc, "reason", str) or "requested over HTTP (POST /dump)"
    incident = _field(doc, "incident_id", str)
    origin = _field(doc, "origin", str)
    kind = _field(doc, "kind", str)  # a peer's incident: what it is
    if origin is not None and h.credential is Credential.DUMP:
        raise HttpError(HTTPStatus.FORBIDDEN, "a peer's request (origin) needs the agent's token")
    try:
        answer = request_dump(reason, incident, origin, **({"kind": kind} if kind else {}))
    except UsageError as exc:
        raise HttpError(HTTPStatus.BAD_REQUEST, str(exc)) from None
    except StallwatchError as exc:
        raise HttpError(HTTPStatus.INTERNAL_SERVER_ERROR, f"dump failed: {exc}") from None
    if isinstance(answer, dict) and answer.get("status") == "rate_limited":
        h.retry_after = math.ceil(float(answer.get("retry_in_s") or 1))
        return HTTPStatus.TOO_MANY_REQUESTS, "application/json", encode_json(answer)
    return HTTPStatus.OK, "application/json", encode_json(answer)


def _dump_outcome(h: Handler, incident_id: str) -> Response:
    """``{"outcome_of": id}``: what became of that incident's dump (written,
    queued and why, failed and why, unknown), nothing dumped."""
    outcome = getattr(h.config.backend, "dump_outcome", None)
    if outcome is None:
        raise HttpError(HTTPStatus.NOT_IMPLEMENTED, "this server does not keep dump outcomes")
    return HTTPStatus.OK, "application/json", encode_json(outcome(incident_id))


def _snapshot(h: Handler) -> Response:
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


def _recording(h: Handler) -> Response:
    doc = h.read_json()
    live = getattr(h.config.backend, "live_recordings", None)
    if live is None:
        raise HttpError(HTTPStatus.NOT_IMPLEMENTED, "this server holds no recording")
    incident = _field(doc, "incident_id", str) or f"live-{uuid.uuid4().hex[:12]}"
    reason = _field(doc, "reason", str) or "read over HTTP (POST /recording)"
    recordings = live(incident, reason)
    names = [dump_file_name(r) for r in recordings]
    dumps = [encode_parts(r) for r in recordings]  # the rings sent from their arrays
    return HTTPStatus.OK, DUMP_FRAMES, dump_frames(h.config.backend.host, incident, names, dumps)


def _dump_dir(h: Handler) -> Path:
    folder = getattr(h.config.backend, "dump_dir", None)
    if not isinstance(folder, Path):
        raise HttpError(HTTPStatus.NOT_IMPLEMENTED, "this server keeps no dump folder")
    return folder


def _dumps(h: Handler) -> Response:
    listing = [dataclasses.asdict(d) for d in list_dumps(_dump_dir(h))]
    body = {"host": h.config.backend.host, "dumps": listing}
    return HTTPStatus.OK, "application/json", encode_json(body)


def _collect(h: Handler) -> Response:
    doc = h.read_json()
    incident = _field(doc, "incident_id", str, required=True)
    found = [d for d in list_dumps(_dump_dir(h)) if d.incident_id == incident]
    blobs: list[memoryview] = []
    names = []
    for d in found:
        try:
            blobs.append(_mapped(_dump_dir(h) / d.name))
        except (OSError, ValueError) as exc:  # removed by retention meanwhile: said by its absence
            log.info("collect %s: %s: %s", incident, d.name, getattr(exc, "strerror", exc) or exc)
            continue
        names.append(d.name)
    if not names:
        raise HttpError(HTTPStatus.NOT_FOUND, f"no dump of incident {incident} here")
    bundle = DumpBundle(h.config.backend.host, incident, tuple(names), tuple(blobs))
    return HTTPStatus.OK, DUMP_FRAMES, dumps_parts(bundle)


def _mapped(path: Path) -> memoryview:
    """A dump file's bytes, mapped, not read: sent from the page cache,
    whatever its size, without taking the agent's memory."""
    with path.open("rb") as f:
        return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))


def _metrics(h: Handler) -> Response:
    text = h.config.backend.metrics_text()
    return HTTPStatus.OK, "text/plain; version=0.0.4; charset=utf-8", text.encode()


def _healthz(h: Handler) -> Response:
    doc = {"status": "ok", "host": h.config.backend.host, "version": VERSION}
    return HTTPStatus.OK, "application/json", encode_json(doc)


@dataclass(frozen=True, slots=True)
class Route:
    method: str
    answer: Callable[[Handler], Response]
    lane: str  # whose workers answer it (query.server.LANES)
    takes: frozenset[Credential]  # the credentials it accepts (OPEN: see _takes)


_ALL = frozenset({Credential.TOKEN, Credential.OPEN})
ROUTES: dict[str, Route] = {
    "/query": Route("POST", _query, "query", _ALL),
    "/fetch": Route("POST", _fetch, "query", _ALL),
    "/dump": Route("POST", _dump, "dump", frozenset({Credential.TOKEN, Credential.DUMP})),
    "/snapshot": Route("POST", _snapshot, "bulk", _ALL),
    "/recording": Route("POST", _recording, "bulk", _ALL),
    "/dumps": Route("GET", _dumps, "bulk", _ALL),
    "/collect": Route("POST", _collect, "bulk", _ALL),
    "/metrics": Route("GET", _metrics, "health", _ALL | {Credential.SCRAPE}),
    "/healthz": Route("GET", _healthz, "health", frozenset(Credential)),
}


def _takes(route: Route, secrets: Secrets) -> frozenset[Credential]:
    """A server with no secret at all (tests, a tool's own server) takes
    dump requests without one, as everything else."""
    if route.answer is _dump and secrets.token is None and secrets.dump is None:
        return route.takes | {Credential.OPEN}
    return route.takes


def admit(config: ServerConfig, head: RequestHead) -> Admission:
    """The gate of ``query.server``: a request's lane, or its refusal."""
    scheme, _, given = head.authorization.partition(" ")
    token = given.strip() if scheme.lower() == "bearer" else None
    if head.authorization and token is None:
        return _refusal(401, "the Authorization header must be: Bearer <token>")
    if token is not None and not config.tls and not is_loopback(head.peer):
        return _refusal(403, "a token is accepted only over TLS or from loopback")
    credential = config.secrets.credential(token)
    if credential is None:
        return _refusal(401, "missing or wrong bearer token")
    route = ROUTES.get(head.path)
    if route is None:
        return _refusal(404, f"no such endpoint: {head.path}")
    if route.method != head.method:
        return _refusal(405, f"{head.path} takes {route.method}")
    if credential not in _takes(route, config.secrets):
        if credential is Credential.OPEN:
            return _refusal(401, f"{head.path} needs the agent's token or its dump credential")
        return _refusal(403, f"this credential ({credential.value}) does not open {head.path}")
    return Admission(route.lane, credential, authenticated=credential is not Credential.OPEN)


def _refusal(status: int, message: str) -> Admission:
    headers = (("WWW-Authenticate", 'Bearer realm="stallwatch"'),) if status == 401 else ()
    return Admission(None, status=status, body=encode_json({"error": message}), headers=headers)


MAX_JSON_DEPTH = 32  # a request's JSON: arrays and objects within one another


def json_depth(raw: bytes) -> int:
    """How deeply arrays and objects nest in ``raw`` (strings skipped), read
    before the parser, which would recurse that deep."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in raw:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            deepest = max(deepest, depth)
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return deepest

"""The agent's HTTP surface, served by the live agent and by ``stallwatch serve``:
``serve_http`` puts together the network loop (``query.server``), the routes
(``query.routes``: what each endpoint answers) and the wire formats
(``query.wire``, which the clients read too).

A token crosses the network only inside TLS: a listener on a non-loopback
address is refused at start without TLS (``--tls-cert``, ``--tls-key``) and
a token.  With a client CA (``--tls-client-ca``), clients must present a
certificate it signed (mutual TLS).
"""

from __future__ import annotations

import functools
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stallwatch.dumpers.errors import UsageError
from stallwatch.dumpers.model import Recording

from .engineproc import ChildConfig, Engine, EngineProcess, InlineEngine, Source
from .limits import NETWORK, Limits
from .routes import MAX_BODY, Backend, Handler, Secrets, ServerConfig, admit
from .server import FDS_BESIDES, ServeLimits, Server, is_loopback, parse_listen, raise_fd_limit
from .tls import ServerTls
from .wire import encode_json

if TYPE_CHECKING:
    from .sql import QueryEngine

__all__ = [
    "Backend",
    "RecordingsBackend",
    "ServeLimits",
    "ServerHandle",
    "check_listen",
    "encode_json",
    "is_loopback",
    "parse_listen",
    "serve_http",
    "try_listen",
]

RECORDING_CACHE_S = 0.5


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


# ---- serving ---------------------------------------------------------------


@dataclass(slots=True)
class ServerHandle:
    """A running server: ``address`` is ``host:port`` as clients reach it."""

    address: str
    server: Server
    thread: threading.Thread
    engine: Engine

    @property
    def url(self) -> str:
        return f"{'https' if self.server.tls else 'http'}://{self.address}"

    def counters(self) -> dict[str, int]:
        """For the agent's /metrics: connections refused (no room), closed
        for slowness, displaced by newer ones, and open now; requests refused
        for their credential, or answered busy; the engine's own."""
        counts = self.server.counts
        return {
            "http_connections_refused": counts["refused"],
            "http_connections_timed_out": counts["timed_out"],
            "http_connections_evicted": counts["evicted"],
            "http_connections_open": self.server.open_connections(),
            "http_requests_unauthenticated": counts["unauthenticated"],
            "http_requests_busy": counts["busy"],
            **self.engine.counters(),
        }

    def close(self) -> None:
        self.server.shutdown()
        self.engine.close()  # a query running: its worker is let go at once
        self.thread.join(timeout=10)


def _engine_for(backend: Backend, limits: Limits, scans: bool, isolated: bool) -> Engine:
    served = backend.recordings if isinstance(backend, RecordingsBackend) else None
    if isolated:
        config = ChildConfig(limits, materialize=served is not None, scans=scans)
        live: Source = served if served is not None else lambda: [backend.recording()]
        return EngineProcess(live, config, cache_s=RECORDING_CACHE_S)

    def make() -> QueryEngine:
        from .sql import QueryEngine

        if served is not None:
            return QueryEngine(served, limits, materialize=True, scans=scans)
        return QueryEngine(
            lambda: [backend.recording()], limits, cache_s=RECORDING_CACHE_S, scans=scans
        )

    return InlineEngine(make)


def check_listen(listen: str, token: str | None, tls: ServerTls | None) -> tuple[str, int]:
    """``listen`` as (host, port); UsageError if it is malformed, or not
    loopback without TLS and a token (a token would cross the network in
    clear text)."""
    host, port = parse_listen(listen)
    if not is_loopback(host) and (not token or tls is None):
        raise UsageError(
            f"--listen {listen}: a non-loopback address needs TLS and a token: pass "
            "--tls-cert FILE --tls-key FILE and --token-file FILE"
        )
    return host, port


def try_listen(listen: str) -> None:
    """UsageError now if nothing could listen at ``listen`` (taken, not an
    address of this machine): before an agent attaches anything."""
    host, port = parse_listen(listen)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise UsageError(f"--listen {listen}: cannot listen: {exc.strerror or exc}") from None


def serve_http(
    backend: Backend,
    listen: str,
    token: str | None,
    limits: Limits = NETWORK,
    max_body: int = MAX_BODY,
    tls: ServerTls | None = None,
    scans: bool = True,
    serving: ServeLimits | None = None,
    isolated: bool = True,
    dump_token: str | None = None,
    scrape_token: str | None = None,
) -> ServerHandle:
    """Start the HTTP surface in a daemon thread; port 0 picks a free port.
    A non-loopback ``listen`` needs ``tls`` and a ``token``.  ``scans``: see
    :class:`~stallwatch.query.sql.QueryEngine`.  ``isolated``: queries run
    in an engine process of their own (``query.engineproc``: bounded memory
    and time); without it, in this process (tests, benchmarks that serve
    hundreds of recordings from one process).  ``dump_token``: a credential
    that opens ``POST /dump`` (and ``/healthz``) only; ``scrape_token``: one
    that opens ``GET /metrics`` (and ``/healthz``) only."""
    serving = serving or ServeLimits()
    host, port = check_listen(listen, token, tls)
    context = tls.context() if tls is not None else None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    engine = _engine_for(backend, limits, scans, isolated)
    secrets = Secrets(*(t.encode() if t else None for t in (token, dump_token, scrape_token)))
    config = ServerConfig(backend, engine, secrets, max_body, context is not None)
    handler = type("_BoundHandler", (Handler,), {"config": config})
    raise_fd_limit(serving.max_connections + FDS_BESIDES)
    gate = functools.partial(admit, config)
    try:
        server = Server((host, port), handler, family, context, serving, max_body, gate)
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

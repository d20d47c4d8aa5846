"""Asking peer agents to dump the same incident (``--peers``).

Client side of ``POST /dump`` (the server is ``analyzer.http``)::

    POST http://HOST:PORT/dump   Authorization: Bearer <token>   (if a token is set)
    {"reason": str, "incident_id": str, "origin": str}
    -> 200 {"incident_id": str, "status": "written|queued|duplicate|cooldown", "path": str|null}

All peers are asked at once, one thread each, and the whole round ends after
``timeout`` seconds whatever the peers do.  With TLS (an ``ssl.SSLContext``
from ``query.tls.ClientTls``: the CA that signed the peers' certificates, and
the agent's own certificate for peers that ask for one), peers are reached
over HTTPS.  ``notify_in_background`` runs a
round on a daemon thread, so that the agent's tick never waits for the network.
Proxies from the environment are ignored: peers are reached directly.
"""

from __future__ import annotations

import json
import logging
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence

from stallwatch.dumpers.errors import UsageError
from stallwatch.dumpers.model import Trigger
from stallwatch.query.tls import ClientTls

log = logging.getLogger("stallwatch.peers")

DEFAULT_TIMEOUT_S = 1.0
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _opener(tls: ssl.SSLContext | None) -> urllib.request.OpenerDirector:
    if tls is None:
        return _OPENER
    return urllib.request.build_opener(
        urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=tls)
    )


def parse_peers(text: str) -> list[str]:
    """``host:port,host:port`` (``[v6]:port`` too) -> the list, checked."""
    peers = [p.strip() for p in text.split(",") if p.strip()]
    for peer in peers:
        host, sep, port = peer.removeprefix("http://").rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UsageError(f"--peers: expected HOST:PORT, found {peer!r}")
    return peers


def _url(peer: str, tls: bool) -> str:
    scheme = "https" if tls else "http"
    base = peer if peer.startswith(("http://", "https://")) else f"{scheme}://{peer}"
    return base.rstrip("/") + "/dump"


def ask_peer(
    peer: str,
    body: bytes,
    token: str | None,
    timeout: float,
    tls: ssl.SSLContext | None = None,
    opener: urllib.request.OpenerDirector | None = None,
) -> str:
    """One request; the peer's status, or ``error: <why>``."""
    return ask_peer_answer(peer, body, token, timeout, tls, opener)[0]


def ask_peer_answer(
    peer: str,
    body: bytes,
    token: str | None,
    timeout: float,
    tls: ssl.SSLContext | None = None,
    opener: urllib.request.OpenerDirector | None = None,
) -> tuple[str, str | None]:
    """One request; the peer's status (or ``error: <why>``) and the incident
    id it answered with (its own, when it says ``duplicate``)."""
    request = urllib.request.Request(
        _url(peer, tls is not None),
        data=body,
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with (opener or _opener(tls)).open(request, timeout=timeout) as response:
            answer = json.loads(response.read(65536))
    except urllib.error.HTTPError as exc:
        return f"error: HTTP {exc.code} {exc.reason}", None
    except (OSError, ValueError) as exc:  # refused, unreachable, timed out, not JSON, TLS
        reason = getattr(exc, "reason", None) or exc
        if isinstance(reason, ssl.SSLCertVerificationError):
            why = f"TLS: the peer's certificate is not trusted: {reason.verify_message}"
            return f"error: {why}", None
        return f"error: {reason}", None
    if not isinstance(answer, dict) or not isinstance(answer.get("status"), str):
        return "error: answer without a status", None
    incident = answer.get("incident_id")
    return answer["status"], incident if isinstance(incident, str) else None


def notify_peers(
    peers: Sequence[str],
    incident_id: str,
    reason: str,
    origin_host: str,
    token: str | None,
    timeout: float = DEFAULT_TIMEOUT_S,
    tls: ssl.SSLContext | None = None,
    answered: Callable[[str, str, str | None], object] | None = None,
) -> dict[str, str]:
    """Ask every peer to dump ``incident_id``; returns peer -> its status
    (``written``, ``queued``, ``duplicate``, ``cooldown``) or ``error: ...``.
    Returns within ``timeout`` seconds (plus thread start-up).  ``answered``
    gets (peer, status, the incident id it answered with) as each answers."""
    body = json.dumps({"reason": reason, "incident_id": incident_id, "origin": origin_host})
    results: dict[str, str] = {}
    opener = _opener(tls)

    def ask(peer: str) -> None:
        status, their_id = ask_peer_answer(peer, body.encode(), token, timeout, tls, opener)
        results[peer] = status
        if answered is not None:
            answered(peer, status, their_id)

    threads = [threading.Thread(target=ask, args=(p,), daemon=True) for p in peers]
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return {p: results.get(p, f"error: no answer within {timeout:g} s") for p in peers}


def notify_in_background(
    peers: Sequence[str],
    incident_id: str,
    reason: str,
    origin_host: str,
    token: str | None,
    timeout: float = DEFAULT_TIMEOUT_S,
    done: Callable[[dict[str, str]], object] | None = None,
    tls: ssl.SSLContext | None = None,
    answered: Callable[[str, str, str | None], object] | None = None,
) -> threading.Thread:
    """``notify_peers`` on a daemon thread; logs each answer, then calls ``done``."""

    def run() -> None:
        results = notify_peers(
            peers, incident_id, reason, origin_host, token, timeout, tls, answered
        )
        for peer, status in results.items():
            level = logging.WARNING if status.startswith("error") else logging.INFO
            log.log(level, "incident %s: peer %s: %s", incident_id, peer, status)
        if done is not None:
            done(results)

    thread = threading.Thread(target=run, name=f"peers-{incident_id}", daemon=True)
    thread.start()
    return thread


def peer_notifier(
    peers: Sequence[str],
    host: str,
    token: str | None,
    timeout: float = DEFAULT_TIMEOUT_S,
    tls: ClientTls | None = None,
    answered: Callable[[Trigger, str, str | None], object] | None = None,
) -> Callable[[Trigger], object]:
    """The ``notify`` callable of ``recorder.watchdog.Incidents``: each local
    incident is sent to every peer in the background (over HTTPS with
    ``tls``; its files are read now, once); ``answered`` gets (the trigger, a
    peer's status, the id it answered with)."""
    context = tls.context() if tls is not None else None

    def notify(trigger: Trigger) -> object:
        if not peers:
            return None
        reason = f"{host}: {trigger.reason}"

        def each(_peer: str, status: str, their_id: str | None) -> None:
            if answered is not None:
                answered(trigger, status, their_id)

        return notify_in_background(
            peers, trigger.incident_id, reason, host, token, timeout, tls=context, answered=each
        )

    return notify

"""The one client of an agent's HTTP surface (``query.http`` is the server):
every caller that talks to an agent (``stallwatch dump``, ``snapshot``,
``query --agents``, the agents' peer notices, the lab) goes through
``AgentClient``.  It holds what a request to an agent needs, once: the
address (``host:port``, ``[v6]:port``, ``http://`` or ``https://``), the
bearer token, TLS (``query.tls.ClientTls`` or a ready ``ssl.SSLContext``:
HTTPS when given), the timeout, and the mapping of every failure to one
line naming why (``AgentError``).

An answer with any HTTP status is a ``Reply``: refusing is the agent's
answer, and each caller words it for its own command.  "Busy" (503: the
agent's engine runs another query, or the work of that kind is at its
limit) is asked again every few hundred milliseconds while the timeout
allows.  No proxy is ever
used: agents are on the cluster network.  With ``keep_alive`` the
connection is kept for the next request to the same agent (a process-wide
pool: the fan-out of ``query --agents`` asks the same agents again and
again); without it, each request has its own connection, closed after.
"""

from __future__ import annotations

import http.client
import json
import random
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any

from stallwatch.dumpers.errors import AgentError, UsageError

from .tls import ClientTls, describe_failure

DEFAULT_TIMEOUT_S = 30.0
_RETRYABLE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)


@dataclass(frozen=True, slots=True)
class Address:
    text: str  # as given
    host: str
    port: int
    https: bool


def parse_address(text: str, https: bool = False) -> Address:
    """``host:port``, ``[v6]:port``, ``http://host:port`` or ``https://...``
    (which says HTTPS whatever ``https`` says)."""
    rest = text.strip().rstrip("/")
    if rest.startswith("https://"):
        https = True
    rest = rest.removeprefix("https://").removeprefix("http://")
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"agent {text!r}: expected HOST:PORT, e.g. node1:9400")
    return Address(text, host.strip("[]"), int(port), https)


@dataclass(frozen=True, slots=True)
class Reply:
    """What the agent answered, whatever its status."""

    status: int
    reason: str  # the status line's phrase
    content_type: str
    body: bytes
    server: str = ""  # its Server header: who answered, if not an agent

    @property
    def ok(self) -> bool:
        return self.status == 200

    def json(self) -> Any:
        try:
            return json.loads(self.body or b"{}")
        except ValueError as exc:
            raise AgentError(f"the answer is not JSON: {exc}") from None

    def error_text(self) -> str:
        """``HTTP <status>: <the agent's error>`` for a refusal; an answer
        that is not an agent's (an agent says why in JSON, whatever it
        refuses: another server on that port, a proxy) says so."""
        try:
            return f"HTTP {self.status}: {json.loads(self.body)['error']}"
        except (ValueError, KeyError, TypeError):
            pass
        return (
            f"HTTP {self.status} {self.reason}".rstrip()
            + f" from a server that is not a stallwatch agent ({self._gist()}): "
            "is that the agent's address and port?"
        )

    def _gist(self) -> str:
        """Who answered (its Server header), what: its type and size."""
        who = f"server {self.server[:60]!r}, " if self.server else ""
        if not self.body:
            return f"{who}no body"
        kind = self.content_type.split(";")[0].strip() or "no content type"
        return f"{who}{kind}, {len(self.body)} bytes"


class AgentClient:
    """Requests to one agent.  Every method returns the agent's ``Reply`` or
    raises ``AgentError`` saying why there is none (unreachable, no answer
    in time, TLS, not HTTP)."""

    def __init__(
        self,
        agent: str | Address,
        token: str | None = None,
        tls: ClientTls | ssl.SSLContext | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        keep_alive: bool = False,
    ) -> None:
        self.address = (
            agent if isinstance(agent, Address) else parse_address(agent, tls is not None)
        )
        self.token, self.timeout, self.keep_alive = token, timeout, keep_alive
        # The CA file and whether a client certificate is sent, to name them in TLS errors.
        self._ca = tls.ca if isinstance(tls, ClientTls) else None
        self._client_cert = not isinstance(tls, ClientTls) or tls.cert is not None
        self._files_unknown = isinstance(tls, ssl.SSLContext)  # a context made elsewhere
        self._context = context_of(tls) if isinstance(tls, ClientTls) else tls
        if self.address.https and self._context is None:
            self._context = _default_context()

    def get(self, path: str) -> Reply:
        return self.request("GET", path)

    def post(self, path: str, body: bytes, content_type: str = "application/json") -> Reply:
        return self.request("POST", path, body, {"Content-Type": content_type})

    def post_json(self, path: str, doc: object) -> Reply:
        return self.post(path, json.dumps(doc).encode())

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        headers = dict(headers or {})
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._request(method, path, body, headers)
            # busy (its engine runs another query): asked again while the timeout allows
            wait = random.uniform(0.1, 0.3)
            if reply.status != 503 or time.monotonic() + wait > deadline:
                return reply
            time.sleep(wait)

    def _request(
        self, method: str, path: str, body: bytes | None, headers: dict[str, str]
    ) -> Reply:
        try:
            return self._exchange(method, path, body, headers)
        except TimeoutError:
            raise AgentError(f"no answer within {self.timeout:g} s") from None
        except ssl.SSLError as exc:
            raise AgentError(self._tls_failure(exc)) from None
        except OSError as exc:
            raise AgentError(f"cannot reach the agent: {exc.strerror or exc}") from None
        except http.client.HTTPException as exc:
            raise AgentError(f"bad HTTP answer: {type(exc).__name__} {exc}") from None

    def _tls_failure(self, exc: ssl.SSLError) -> str:
        if self._files_unknown and isinstance(exc, ssl.SSLCertVerificationError):
            return f"TLS: the agent's certificate is not trusted: {exc.verify_message}"
        return describe_failure(exc, self._ca, self._client_cert)

    def _exchange(
        self, method: str, path: str, body: bytes | None, headers: dict[str, str]
    ) -> Reply:
        for _ in range(2):  # a pooled connection the agent closed: retry once, fresh
            conn, reused = self._connection()
            try:
                conn.request(method, path, body, headers)
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
            if resp.will_close or not self.keep_alive:
                conn.close()
            else:
                _POOL.give(self._key(), conn)
            content_type = resp.getheader("Content-Type", "") or ""
            server = "".join(c for c in resp.getheader("Server", "") or "" if c.isprintable())
            return Reply(resp.status, resp.reason, content_type, data, server)
        raise AgentError("the connection was closed twice")  # pragma: no cover

    def _key(self) -> tuple[Any, ...]:
        a = self.address
        return (a.host, a.port, self.timeout, id(self._context) if a.https else None)

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        if self.keep_alive:
            idle = _POOL.take(self._key())
            if idle is not None:
                return idle, True
        a = self.address
        if not a.https:
            return http.client.HTTPConnection(a.host, a.port, timeout=self.timeout), False
        return http.client.HTTPSConnection(
            a.host, a.port, timeout=self.timeout, context=self._context
        ), False


class _Pool:
    """Idle keep-alive connections per agent, safe to share between threads."""

    def __init__(self) -> None:
        self._idle: dict[tuple[Any, ...], list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()

    def take(self, key: tuple[Any, ...]) -> http.client.HTTPConnection | None:
        with self._lock:
            idle = self._idle.get(key)
            return idle.pop() if idle else None

    def give(self, key: tuple[Any, ...], conn: http.client.HTTPConnection) -> None:
        with self._lock:
            self._idle.setdefault(key, []).append(conn)

    def clear(self) -> None:
        with self._lock:
            conns = [c for idle in self._idle.values() for c in idle]
            self._idle.clear()
        for c in conns:
            c.close()


_POOL = _Pool()
_contexts: dict[ClientTls | None, ssl.SSLContext] = {}
_contexts_lock = threading.Lock()


def context_of(tls: ClientTls) -> ssl.SSLContext:
    """One context per set of files, so that pooled connections are found
    again by the next request (they are pooled per context)."""
    with _contexts_lock:
        if tls not in _contexts:
            _contexts[tls] = tls.context()
        return _contexts[tls]


def _default_context() -> ssl.SSLContext:
    """An ``https://`` address without a CA: the system's trusted CAs."""
    with _contexts_lock:
        if None not in _contexts:
            _contexts[None] = ssl.create_default_context()
        return _contexts[None]


def close_connections() -> None:
    """Close the pooled keep-alive connections (tests, long-lived callers)."""
    _POOL.clear()
    with _contexts_lock:
        _contexts.clear()


def post_url(
    url: str, body: bytes, timeout: float, content_type: str = "application/json"
) -> Reply:
    """POST to a URL that is no agent's (a webhook, ``--notify``): no token,
    the system's trusted CAs for ``https://``.  ``AgentError`` if there is
    no answer, as for an agent."""
    address, path = split_url(url)
    client = AgentClient(address, timeout=timeout)
    return client.request("POST", path, body, {"Content-Type": content_type})


def split_url(url: str) -> tuple[Address, str]:
    """``http[s]://host[:port][/path]`` -> its address and path (a usage
    error naming the URL otherwise)."""
    scheme, sep, rest = url.strip().partition("://")
    if not sep or scheme not in ("http", "https"):
        raise UsageError(f"{url!r}: expected http://HOST[:PORT]/PATH or https://...")
    where, slash, path = rest.partition("/")
    https = scheme == "https"
    if not where.rpartition("]")[2].count(":"):  # no port: the scheme's
        where = f"{where}:{443 if https else 80}"
    return parse_address(f"{scheme}://{where}"), "/" + path if slash else "/"

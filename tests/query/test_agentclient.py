"""``query.agentclient``: the one client of agents, against a real local
HTTP server: the token is sent, a refusal is an answer, every failure is one
``AgentError`` line, kept-alive connections are reused and a closed one is
retried once."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from stallwatch.dumpers.errors import AgentError, UsageError
from stallwatch.query.agentclient import AgentClient, close_connections, parse_address


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the agents answer

    def log_message(self, *args: object) -> None:
        pass

    def version_string(self) -> str:  # its Server header
        return "nginx"

    def do_POST(self) -> None:
        server = self.server
        assert isinstance(server, _Server)
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        server.seen.append((self.path, self.headers.get("Authorization"), body))
        server.peers.add(self.client_address[1])
        if self.path == "/slow":
            time.sleep(1.0)
        if self.path.startswith("/not-an-agent"):  # another server on the agent's port
            html = self.path.endswith("html")
            data = b"<html><body>Not Found</body></html>" if html else b""
            self.send_response(404)
            self.send_header("Content-Type", "text/html" if html else "")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        status = 401 if self.path == "/refuse" else 200
        data = b'{"error": "bad token"}' if status == 401 else b'{"status": "written"}'
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.close_connection = self.path == "/close-after"  # without saying so


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.seen: list[tuple[str, str | None, bytes]] = []
        self.peers: set[int] = set()


@pytest.fixture
def server() -> Iterator[_Server]:
    srv = _Server()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    close_connections()


def _address(srv: _Server) -> str:
    return f"127.0.0.1:{srv.server_address[1]}"


def test_the_token_and_body_are_sent_and_a_refusal_is_an_answer(server: _Server) -> None:
    client = AgentClient(_address(server), token="s3cret", timeout=5.0)
    ok = client.post_json("/dump", {"reason": "r"})
    assert ok.ok and ok.json() == {"status": "written"}
    refused = client.post("/refuse", b"{}")
    assert refused.status == 401 and refused.reason == "Unauthorized"
    assert refused.error_text() == "HTTP 401: bad token"
    assert server.seen[0] == ("/dump", "Bearer s3cret", b'{"reason": "r"}')


def test_an_answer_that_is_not_an_agents_says_so(server: _Server) -> None:
    """An agent says why it refuses, in JSON; a 404 of a server that is not
    one (an empty body, a web page) is named as such, never ``HTTP 404:``."""
    client = AgentClient(_address(server), timeout=5.0)
    for path, what in (("/not-an-agent", "no body"), ("/not-an-agent.html", "text/html, 35 bytes")):
        text = client.post(path, b"{}").error_text()
        assert text == (
            f"HTTP 404 Not Found from a server that is not a stallwatch agent (server 'nginx', "
            f"{what}): "
            "is that the agent's address and port?"
        )


def test_failures_are_one_line_agent_errors(server: _Server) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(AgentError, match="cannot reach the agent: Connection refused"):
        AgentClient(dead, timeout=2.0).get("/healthz")
    with pytest.raises(AgentError, match=r"no answer within 0\.2 s"):
        AgentClient(_address(server), timeout=0.2).post("/slow", b"{}")


def test_kept_alive_connections_are_reused_and_a_closed_one_retried(server: _Server) -> None:
    client = AgentClient(_address(server), timeout=5.0, keep_alive=True)
    for _ in range(3):
        assert client.post("/fetch", b"{}").ok
    assert len(server.peers) == 1  # one connection for the three
    # The agent closes a connection it said it would keep (an agent restarting,
    # an idle timeout): the next request finds it dead and asks again, fresh.
    assert client.post("/close-after", b"{}").ok
    assert client.post("/fetch", b"{}").ok
    assert len(server.peers) == 2
    assert [path for path, _, _ in server.seen][-2:] == ["/close-after", "/fetch"]


def test_addresses() -> None:
    plain, http = parse_address("node1:9400"), parse_address("http://node1:9400/")
    assert (
        (plain.host, plain.port, plain.https)
        == (http.host, http.port, False)
        == ("node1", 9400, False)
    )
    https = parse_address("https://[fe80::1]:9400")
    assert (https.host, https.port, https.https) == ("fe80::1", 9400, True)
    with pytest.raises(UsageError, match="expected HOST:PORT"):
        parse_address("node1")

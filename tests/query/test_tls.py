"""TLS on every HTTP surface: queries, fan-out, dump requests and peer
triggers, with and without client certificates (mutual TLS); a token never
crosses the network in clear text; bad files are named in one line; a client
that goes away is one line in the log."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import ssl
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bench.bench_sql import SEED_QUERY, Synthetic, synthetic_recording
from stallwatch.commands import main as cli
from stallwatch.dumpers.errors import UsageError
from stallwatch.dumpers.model import Recording
from stallwatch.query.fanout import close_connections, query_agents
from stallwatch.query.http import ServerHandle, serve_http
from stallwatch.query.sql import LOCAL, QueryEngine
from stallwatch.query.tls import ClientTls, ServerTls
from stallwatch.recorder import peers
from tests.query.certs import Certs, make_certs

TOKEN = "tls-token"
Run = Callable[..., tuple[int, str, str]]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def recordings() -> list[Recording]:
    return [
        synthetic_recording(Synthetic(host=f"node{i}", first_rank=4 * i, steps=50, seed=i))
        for i in range(4)
    ]


class DumpingAgent:
    """A live agent's side of the seam that can dump."""

    def __init__(self, rec: Recording) -> None:
        self.rec, self.host = rec, rec.host
        self.dumps: list[tuple[str, str | None, str | None]] = []

    def recording(self) -> Recording:
        return self.rec

    def metrics_text(self) -> str:
        return "# HELP x y\n"

    def request_dump(self, reason: str, incident_id: str | None, origin: str | None) -> object:
        self.dumps.append((reason, incident_id, origin))
        return {"host": self.host, "status": "written", "incident_id": incident_id or "i-1"}


@pytest.fixture
def servers(
    certs: Certs, recordings: list[Recording]
) -> Iterator[Callable[..., list[ServerHandle]]]:
    started: list[ServerHandle] = []

    def start(
        tls: ServerTls | None,
        count: int = 4,
        token: str | None = TOKEN,
        listen: str = "127.0.0.1:0",
    ) -> list[ServerHandle]:
        handles = [
            serve_http(DumpingAgent(r), listen, token, tls=tls, isolated=False)
            for r in recordings[:count]
        ]
        started.extend(handles)
        return handles

    yield start
    close_connections()
    for h in started:
        h.close()


def https(
    address: str, path: str, ctx: ssl.SSLContext, token: str | None = TOKEN
) -> tuple[int, bytes]:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPSConnection(host, int(port), context=ctx, timeout=10)
    try:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_query_and_fanout_over_tls(
    certs: Certs, servers: Callable[..., list[ServerHandle]], recordings: list[Recording]
) -> None:
    handles = servers(certs.server())
    assert all(h.url.startswith("https://") for h in handles)
    status, body = https(handles[0].address, "/healthz", certs.client().context())
    assert status == 200 and json.loads(body)["host"] == "node0"
    result = query_agents([h.address for h in handles], SEED_QUERY, TOKEN, tls=certs.client())
    assert not result.failed
    with QueryEngine(recordings, LOCAL) as engine:
        local = engine.query(SEED_QUERY.replace(" LIMIT 20", ""))
    # every merged row is a row of the local answer (LIMIT 20 among ties)
    assert len(result.rows) == 20 and {tuple(r) for r in result.rows} <= set(local.rows)


def test_an_agent_signed_by_another_ca_is_named_with_the_ca_file(
    certs: Certs, servers: Callable[..., list[ServerHandle]]
) -> None:
    (handle,) = servers(certs.server(), count=1)
    result = query_agents([handle.address], "SELECT 1", TOKEN, tls=certs.client(ca=certs.other_ca))
    (failure,) = result.failed
    assert f"not trusted by --tls-ca {certs.other_ca}" in failure.error
    assert failure.error.endswith("unable to get local issuer certificate")


def test_mutual_tls_needs_a_client_certificate(
    certs: Certs, servers: Callable[..., list[ServerHandle]], caplog: pytest.LogCaptureFixture
) -> None:
    (handle,) = servers(certs.server(mutual=True), count=1)
    caplog.set_level(logging.INFO, logger="stallwatch.query.http")
    without = query_agents(
        [handle.address], "SELECT count(*) FROM nccl_events", TOKEN, tls=certs.client()
    )
    (refused,) = without.failed
    assert refused.error.startswith("TLS: ") and "client certificate: --tls-cert?" in refused.error
    with_cert = query_agents(
        [handle.address],
        "SELECT count(*) FROM nccl_events",
        TOKEN,
        tls=certs.client(with_cert=True),
    )
    assert not with_cert.failed and with_cert.rows == [[201]]
    lines = [r.getMessage() for r in caplog.records if "no TLS session" in r.getMessage()]
    assert lines and all("\n" not in line for line in lines)


def test_plain_http_with_a_token_is_refused_on_a_non_loopback_listener(
    certs: Certs, servers: Callable[..., list[ServerHandle]]
) -> None:
    with pytest.raises(UsageError, match="needs TLS and a token"):
        serve_http(DumpingAgent(synthetic_recording(Synthetic())), "0.0.0.0:0", TOKEN)
    (handle,) = servers(certs.server(), count=1, listen="0.0.0.0:0")
    port = int(handle.address.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/healthz", headers={"Authorization": f"Bearer {TOKEN}"})
        resp = conn.getresponse()
        assert resp.status == 400 and b"HTTPS only" in resp.read()
    finally:
        conn.close()
    # the same client over TLS is let in
    assert https(f"127.0.0.1:{port}", "/healthz", certs.client().context())[0] == 200


def test_a_token_over_plain_http_from_another_host_is_refused() -> None:
    """A loopback listener only sees loopback peers; the rule behind it is
    checked on the gate: plain HTTP from a non-loopback peer with a token
    is 403, whatever the token."""
    from stallwatch.query.routes import Secrets, ServerConfig, admit
    from stallwatch.query.server import RequestHead

    config = ServerConfig(None, None, Secrets(TOKEN.encode()), 1024, tls=False)  # type: ignore[arg-type]
    head = RequestHead("GET", "/healthz", f"Bearer {TOKEN}", "10.0.0.7", tls=False)
    refused = admit(config, head)
    assert refused.lane is None and refused.status == 403
    assert b"only over TLS or from loopback" in refused.body
    # loopback: the token is checked as usual
    local = admit(config, RequestHead("GET", "/healthz", f"Bearer {TOKEN}", "127.0.0.1", False))
    assert local.lane == "health" and local.authenticated


def test_peer_triggers_over_tls_and_mutual_tls(
    certs: Certs, servers: Callable[..., list[ServerHandle]]
) -> None:
    plain_tls = servers(certs.server(), count=2)
    mutual = servers(certs.server(mutual=True), count=1)
    addresses = [h.address for h in [*plain_tls, *mutual]]
    ctx = certs.client(with_cert=True).context()
    results = peers.notify_peers(addresses, "inc-7", "node9: stuck", "node9", TOKEN, 5.0, ctx)
    assert set(results.values()) == {"written"}, results
    for h in [*plain_tls, *mutual]:
        assert h.server.RequestHandlerClass.config.backend.dumps == [  # type: ignore[attr-defined]
            ("node9: stuck", "inc-7", "node9")
        ]
    no_cert = peers.notify_peers(
        addresses[-1:], "inc-8", "r", "n", TOKEN, 5.0, certs.client().context()
    )
    assert no_cert[addresses[-1]].startswith("error:")
    wrong_ca = peers.notify_peers(
        addresses[:1], "inc-9", "r", "n", TOKEN, 5.0, certs.client(ca=certs.other_ca).context()
    )
    assert "not trusted" in wrong_ca[addresses[0]]


@pytest.fixture
def run(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Run:
    monkeypatch.setattr(
        cli,
        "COMMAND_MODULES",
        (
            "stallwatch.commands.record",
            "stallwatch.commands.dump",
            "stallwatch.commands.query",
            "stallwatch.commands.serve",
        ),
    )

    def invoke(*argv: str) -> tuple[int, str, str]:
        code = cli.main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return invoke


def test_dump_and_query_commands_over_tls(
    certs: Certs, servers: Callable[..., list[ServerHandle]], run: Run, tmp_path: Path
) -> None:
    (handle,) = servers(certs.server(mutual=True), count=1)
    token = tmp_path / "token"
    token.write_text(TOKEN)
    client = ["--token-file", str(token), "--tls-ca", str(certs.ca)]
    client += ["--tls-cert", str(certs.client_cert), "--tls-key", str(certs.client_key)]
    code, out, err = run(
        "dump", "--agent", handle.address, "--reason", "over tls", "--json", *client
    )
    assert code == 0, err
    assert json.loads(out)["status"] == "written"
    code, out, err = run(
        "query", "--agents", handle.address, *client, "SELECT count(*) AS n FROM nccl_events"
    )
    assert code == 0, err and out.splitlines()[-1].strip() == "201"
    # the wrong CA: one line naming it
    code, _, err = run(
        "dump",
        "--agent",
        handle.address,
        "--token-file",
        str(token),
        "--tls-ca",
        str(certs.other_ca),
    )
    assert code == 2 and f"not trusted by --tls-ca {certs.other_ca}" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_bad_files_are_named_in_one_line(certs: Certs, tmp_path: Path) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    missing = tmp_path / "missing.pem"
    cases = [
        (ServerTls(missing, certs.key), f"--tls-cert {missing}: cannot read"),
        (ServerTls(junk, certs.key), f"--tls-cert {junk}: not a PEM certificate"),
        (ServerTls(certs.cert, junk), f"--tls-key {junk}: not an unencrypted PEM private key"),
        (ServerTls(certs.cert, certs.client_key), f"--tls-key {certs.client_key}: does not match"),
        (ServerTls(certs.cert, certs.key, junk), f"--tls-client-ca {junk}: not a PEM CA"),
        (ClientTls(junk), f"--tls-ca {junk}: not a PEM CA"),
        (ClientTls(missing), f"--tls-ca {missing}: cannot read"),
        (ClientTls(certs.ca, certs.client_cert, None), "--tls-cert and --tls-key go together"),
    ]
    for tls, message in cases:
        with pytest.raises(UsageError) as refused:
            tls.context()
        assert message in str(refused.value) and "\n" not in str(refused.value)


def test_serve_and_record_name_a_bad_key_before_starting(
    run: Run, certs: Certs, tmp_path: Path
) -> None:
    dump = tmp_path / "d"
    dump.mkdir()
    from stallwatch.dumpers.format import write_dump

    write_dump(dump, synthetic_recording(Synthetic()))
    code, _, err = run(
        "serve", str(dump), "--tls-cert", str(certs.cert), "--tls-key", str(certs.ca)
    )
    assert code == 2 and f"--tls-key {certs.ca}" in err and "Traceback" not in err
    code, _, err = run("record", "--tls-cert", str(certs.cert), "--tls-key", str(certs.client_key))
    assert code == 2 and "does not match" in err


def _reset(sock: socket.socket) -> None:
    """Close with a reset (RST), as a client that crashed or was killed."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


@pytest.mark.solo  # bounded by time: judged alone
@pytest.mark.parametrize("with_tls", [False, True])
def test_a_client_that_goes_away_is_one_line_not_a_traceback(
    certs: Certs,
    servers: Callable[..., list[ServerHandle]],
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
    with_tls: bool,
) -> None:
    (handle,) = servers(certs.server() if with_tls else None, count=1, token=None)
    caplog.set_level(logging.INFO, logger="stallwatch.query.http")
    host, port = handle.address.rsplit(":", 1)
    big = json.dumps({"sql": "SELECT * FROM nccl_events, range(40)"}).encode()
    for _ in range(3):
        raw = socket.create_connection((host, int(port)), timeout=10)
        sock = certs.client().context().wrap_socket(raw, server_hostname=host) if with_tls else raw
        head = f"POST /query HTTP/1.1\r\nHost: x\r\nContent-Length: {len(big)}\r\n\r\n"
        sock.sendall(head.encode() + big)
        sock.recv(1)  # the answer has begun: the server is writing when the client vanishes
        _reset(raw if not with_tls else sock)
    # the server goes on answering
    status = (
        https(handle.address, "/healthz", certs.client().context(), None)[0] if with_tls else None
    )
    assert status in (None, 200)
    deadline_lines = [r for r in caplog.records if "went away" in r.getMessage()]
    assert deadline_lines, [r.getMessage() for r in caplog.records]
    assert all(r.exc_info is None and "\n" not in r.getMessage() for r in deadline_lines)
    assert "Traceback" not in capfd.readouterr().err


def test_a_plain_post_with_a_body_gets_the_refusal_not_a_reset(
    certs: Certs, servers: Callable[..., list[ServerHandle]]
) -> None:
    """The body comes after the server has answered: what the client sent is
    read before the server closes, or the kernel would reset the connection
    and the client would see a reset, not the answer."""
    (handle,) = servers(certs.server(), count=1)
    host, port = handle.address.rsplit(":", 1)
    body = json.dumps({"sql": "SELECT 1", "pad": "x" * 30000}).encode()
    head = f"POST /query HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
    head += f"Content-Length: {len(body)}\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head.encode())
        time.sleep(0.2)  # the server has answered by now
        sock.sendall(body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 400") and b"HTTPS only" in answer

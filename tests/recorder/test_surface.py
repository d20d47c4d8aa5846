"""The agent's HTTP surface under hostile and careless clients, against real
agents on loopback (``stallwatch record`` on the small NCCL-ABI library,
its NCCL ring full): its memory within bounds whatever a query asks, health
and dumps answered beside expensive queries, idle sockets and reconnect
floods, incidents kept over requested dumps, a full disk said, a removed pin
folder pinned again.  Each test prints its figure (``pytest -s``) and
asserts the target of issue 31."""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bench.fakenccl import FakeNccl, build
from stallwatch.dumpers.format import read_dump
from stallwatch.query.credentials import read_local_token
from tests import pins
from tests.query.certs import make_certs
from tests.recorder.test_pinning import STALLWATCH, Agent, pace_rows, start_agent, stop

pytestmark = [pytest.mark.bpf, pytest.mark.slow]

MB = 2**20
TOKEN = "surface-test-token"


@pytest.fixture(scope="module")
def fake() -> FakeNccl:
    return build()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("surface")


@pytest.fixture(scope="module")
def plain(fake: FakeNccl, folder: Path) -> Iterator[Agent]:
    """A pinned agent without a token, its NCCL ring full (70,000 calls)."""
    pin_dir = pins.pin_dir("surface")
    (folder / "plain").mkdir()
    agent = start_agent(fake, pin_dir, folder / "plain", keep=False)
    try:
        agent.wait_for("listening on")
        subprocess.run([str(fake.loop), "wrap", "70000"], check=True, capture_output=True)
        yield agent
    finally:
        stop(agent)
        pins.remove(pin_dir)


@pytest.fixture(scope="module")
def tls(fake: FakeNccl, folder: Path) -> Iterator[tuple[Agent, ssl.SSLContext, Path]]:
    """An agent with a token and TLS, its dumps on a 16 KiB file system."""
    base = folder / "tls"
    dumps = base / "dumps"
    dumps.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(dumps)], check=True)
    certs = make_certs(base)
    (base / "token").write_text(TOKEN)
    pin_dir = pins.pin_dir("surface-tls")
    extra = ["--token-file", str(base / "token"), "--tls-cert", str(certs.cert)]
    extra += ["--tls-key", str(certs.key)]
    agent = start_agent(fake, pin_dir, base, *extra, keep=False)
    try:
        agent.wait_for("listening on")
        yield agent, ssl.create_default_context(cafile=str(certs.ca)), certs.ca
    finally:
        stop(agent)
        pins.remove(pin_dir)
        subprocess.run(["umount", str(dumps)], check=False)


# ---------------------------------------------------------------- helpers


def ask(
    agent: Agent,
    method: str,
    path: str,
    body: object = None,
    token: str | None = None,
    context: ssl.SSLContext | None = None,
    timeout: float = 60,
) -> tuple[int, bytes]:
    import http.client

    conn: http.client.HTTPConnection
    if context is None:
        conn = http.client.HTTPConnection("127.0.0.1", agent.port, timeout=timeout)
    else:
        conn = http.client.HTTPSConnection(
            "127.0.0.1", agent.port, timeout=timeout, context=context
        )
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    data = None if body is None else json.dumps(body).encode()
    try:
        conn.request(method, path, data, headers)
        reply = conn.getresponse()
        return reply.status, reply.read()
    finally:
        conn.close()


def status_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1])
    return 0


def metric(agent: Agent, name: str, **kw: object) -> float:
    _, text = ask(agent, "GET", "/metrics", **kw)  # type: ignore[arg-type]
    for line in text.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def health_times(
    agent: Agent, seconds: float, context: ssl.SSLContext | None = None, token: str | None = None
) -> list[float]:
    """/healthz every 0.25 s for ``seconds``: each answer's time (inf: failed)."""
    times = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.monotonic()
        try:
            ok = ask(agent, "GET", "/healthz", token=token, context=context, timeout=5)[0] == 200
        except OSError:
            ok = False
        times.append(time.monotonic() - t0 if ok else float("inf"))
        time.sleep(0.25)
    return times


def raise_files(wanted: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, max(hard, wanted)))


def in_background(work: Callable[[threading.Event], None], count: int = 1) -> Callable[[], None]:
    """``count`` threads running ``work`` until the returned callable stops them."""
    stop_event = threading.Event()
    threads = [threading.Thread(target=work, args=(stop_event,)) for _ in range(count)]
    for t in threads:
        t.start()

    def finish() -> None:
        stop_event.set()
        for t in threads:
            t.join()

    return finish


# ---------------------------------------------------------------- memory


def test_hostile_queries_leave_the_agent_within_its_memory(plain: Agent) -> None:
    """A 59-byte cross join, 40 queries in one request, an 800 MB list and 16
    whole rings: refused, each naming its limit; the agent and its engine
    process together peak below 600 MB (before: 3.45 GB and 3.16 GB, with
    1.89 GB kept), and the agent gives back what a whole-ring answer took."""
    pid = plain.proc.pid
    assert ask(plain, "POST", "/query", {"sql": "SELECT count(*) FROM nccl_events"})[0] == 200
    before = status_kb(pid, "VmRSS") / 1024
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak counts from here
    hostile = [
        ("/fetch", {"queries": ["SELECT * FROM nccl_events a, nccl_events b"]}, "32 MiB"),
        ("/fetch", {"queries": ["SELECT * FROM nccl_events"] * 40}, "the limit is 16"),
        ("/fetch", {"queries": ["SELECT * FROM nccl_events"] * 16}, "32 MiB"),
        ("/query", {"sql": "SELECT count(*) FROM (SELECT unnest(range(100000000)))"}, "memory"),
    ]
    for path, body, needle in hostile:
        status, answer = ask(plain, "POST", path, body)
        assert status == 400 and needle in json.loads(answer)["error"], answer[:200]
    status, rows = ask(plain, "POST", "/fetch", {"queries": ["SELECT * FROM nccl_events"]})
    assert status == 200 and len(rows) > 15 * MB  # the whole ring: 65,536 rows, 18 MB
    agent_peak = status_kb(pid, "VmHWM") / 1024
    engine_peak = metric(plain, "stallwatch_query_engine_peak_resident_bytes") / MB
    after = status_kb(pid, "VmRSS") / 1024
    print(
        f"\nfigure: agent {before:.0f} MB before, peak {agent_peak:.0f} MB, {after:.0f} MB "
        f"after; engine process peak {engine_peak:.0f} MB; together {agent_peak + engine_peak:.0f}"
        " MB (target < 600 MB)"
    )
    assert engine_peak > 0 and agent_peak + engine_peak < 600
    assert after - before < 64


# ---------------------------------------------------------------- capacity


@pytest.mark.solo  # judged by time
def test_health_and_dumps_beside_16_expensive_queries(plain: Agent) -> None:
    """16 clients each running a self-join again and again: /healthz under
    1 s (before: 9 of 9 failed at 5 s) and `stallwatch dump` under 5 s
    (before: 13.2 s)."""
    sql = "SELECT count(*) FROM nccl_events a, nccl_events b WHERE a.seq < b.seq"

    def client(done: threading.Event) -> None:
        while not done.is_set():
            try:
                ask(plain, "POST", "/query", {"sql": sql}, timeout=30)
            except OSError:
                time.sleep(0.1)

    finish = in_background(client, 16)
    try:
        time.sleep(1.0)
        times = health_times(plain, 4.0)
        t0 = time.monotonic()
        dumped = subprocess.run(
            [*STALLWATCH, "dump", "--agent", f"127.0.0.1:{plain.port}", "--json"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        took = time.monotonic() - t0
    finally:
        finish()
    print(
        f"\nfigure: /healthz worst {max(times):.3f} s of {len(times)}, stallwatch dump "
        f"{took:.1f} s beside 16 clients of self-joins (targets < 1 s, < 5 s)"
    )
    assert dumped.returncode == 0, dumped.stderr
    assert json.loads(dumped.stdout)["status"] == "written"
    assert max(times) < 1.0 and took < 5.0
    assert metric(plain, "stallwatch_query_engine_busy_total") > 0


def _idle_and_flood(
    agent: Agent, context: ssl.SSLContext | None, token: str | None
) -> tuple[list[float], list[float], int]:
    """/healthz beside 4,200 idle sockets, then beside one client that holds
    as many connections as it can and reconnects each one closed; and how
    many connections that client opened."""
    raise_files(12000)
    idle = [socket.create_connection(("127.0.0.1", agent.port)) for _ in range(4200)]
    try:
        beside_idle = health_times(agent, 2.0, context, token)
    finally:
        for sock in idle:
            sock.close()

    opened = [0]

    def flood(done: threading.Event) -> None:
        held: list[socket.socket] = []
        while not done.is_set():
            try:
                held.append(socket.create_connection(("127.0.0.1", agent.port), timeout=1))
                opened[0] += 1
            except OSError:
                time.sleep(0.01)
            if len(held) >= 4200:  # full: reconnect those the agent closed
                alive = []
                for sock in held:
                    sock.setblocking(False)
                    try:
                        gone = sock.recv(1) == b""
                    except BlockingIOError:
                        gone = False
                    except OSError:
                        gone = True
                    (sock.close() if gone else alive.append(sock))  # type: ignore[func-returns-value]
                held = alive
        for sock in held:
            sock.close()

    finish = in_background(flood)
    try:
        time.sleep(1.0)
        beside_flood = health_times(agent, 3.0, context, token)
    finally:
        finish()
    return beside_idle, beside_flood, opened[0]


@pytest.mark.solo  # judged by time
def test_health_beside_idle_sockets_and_a_reconnecting_flood(
    plain: Agent, tls: tuple[Agent, ssl.SSLContext, Path]
) -> None:
    """Plain and TLS: /healthz under 2 s beside 4,200 idle unauthenticated
    sockets (before: failed while they were held) and beside a reconnecting
    flood (before: 39 of 41 failed, TLS; then, with idle connections
    displaced oldest first, a TLS health check whose handshake had not come
    yet was displaced in 1 run of 3: the flood cycled through an address's
    64 places in 2 ms).  The connections that never send reach the agent
    only after the kernel held them back for 3 s (TCP_DEFER_ACCEPT)."""
    tls_agent, context, _ = tls
    figures = {}
    for name, agent, ctx, token in (
        ("plain", plain, None, None),
        ("TLS", tls_agent, context, TOKEN),
    ):
        idle, flood, opened = _idle_and_flood(agent, ctx, token)
        figures[name] = (idle, flood)
        evicted, reset = _after_the_flood(agent, token, ctx)
        print(
            f"\nfigure ({name}): /healthz worst {max(idle):.3f} s beside 4,200 idle sockets, "
            f"{max(flood):.3f} s beside a reconnecting flood of {opened} connections "
            f"({len(idle)} and {len(flood)} asked; {evicted:.0f} idle connections displaced; "
            f"target < 2 s; {reset} request(s) reset right after the flood)"
        )
        assert opened >= 4200  # the flood was one
    for idle, flood in figures.values():
        assert max(idle) < 2.0 and max(flood) < 2.0


def _after_the_flood(
    agent: Agent, token: str | None, ctx: ssl.SSLContext | None
) -> tuple[float, int]:
    """The displaced count, read once the flood's last connections are in:
    a request made as they arrive may be reset (a TLS client accepted before
    its handshake came, through SYN cookies, which skip the deferred accept:
    docs/agent.md's known limit), as a scrape then is; it is asked again."""
    for reset in range(3):
        try:
            return metric(agent, "stallwatch_http_connections_evicted_total", token=token,
                          context=ctx), reset  # fmt: skip
        except ConnectionResetError:
            time.sleep(1.0)
    raise AssertionError("/metrics reset 3 times in 3 s after the flood")


# ---------------------------------------------------------------- incidents


def test_incidents_survive_a_hundred_dump_requests(fake: FakeNccl, folder: Path) -> None:
    """--max-dumps 3: the watchdog's dump (a rank killed) and `stallwatch
    dump`'s survive 100 dump requests from loopback: 50 without a
    credential (401), 50 with the agent's own (2 written, then 429).
    Before, 3 requests by anyone deleted the real dump."""
    pin_dir = pins.pin_dir("surface-dumps")
    (folder / "dumps3").mkdir()
    agent = start_agent(fake, pin_dir, folder / "dumps3", "--max-dumps", "3", keep=False)
    dump_dir = folder / "dumps3" / "dumps"
    try:
        agent.wait_for("listening on")
        rank = subprocess.Popen([str(fake.loop), "pace", "60", "200"], stdout=subprocess.DEVNULL)
        time.sleep(1.5)
        rank.send_signal(signal.SIGKILL)
        rank.wait()
        deadline = time.monotonic() + 30
        while not list(dump_dir.glob("*.msgpack")):
            assert time.monotonic() < deadline, agent.text()[-2000:]
            time.sleep(0.2)
        (watchdogs,) = dump_dir.glob("*.msgpack")
        assert read_dump(watchdogs).trigger.kind.value == "exit"  # type: ignore[union-attr]
        asked = subprocess.run(
            [*STALLWATCH, "dump", "--agent", f"127.0.0.1:{agent.port}", "--json"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert asked.returncode == 0, asked.stderr
        by_hand = Path(json.loads(asked.stdout)["path"])
        token = read_local_token("127.0.0.1", agent.port)
        statuses = [ask(agent, "POST", "/dump", {"reason": "noise"})[0] for _ in range(50)]
        statuses += [
            ask(agent, "POST", "/dump", {"reason": "noise"}, token=token)[0] for _ in range(50)
        ]
        counts = {s: statuses.count(s) for s in set(statuses)}
        left = sorted(p.name for p in dump_dir.glob("*.msgpack"))
        print(f"\nfigure: answers {counts}; dumps kept: {len(left)}")
        assert counts == {401: 50, 200: 2, 429: 48}
        assert watchdogs.exists() and by_hand.exists() and len(left) == 4
        assert metric(agent, "stallwatch_dump_requests_rate_limited_total") == 48
    finally:
        stop(agent)
        pins.remove(pin_dir)


def test_a_full_disk_is_said_and_stallwatch_dump_exits_non_zero(
    tls: tuple[Agent, ssl.SSLContext, Path], folder: Path
) -> None:
    """Dumps on a 16 KiB file system: `stallwatch dump` waits 2 s for the
    retries and exits 1 naming why (before: exit 0, "status queued")."""
    agent, context, ca = tls
    (folder / "tls-token").write_text(TOKEN)
    t0 = time.monotonic()
    done = subprocess.run(
        [*STALLWATCH, "dump", "--agent", f"https://127.0.0.1:{agent.port}", "--wait", "2",
         "--token-file", str(folder / "tls-token"), "--tls-ca", str(ca)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    took = time.monotonic() - t0
    print(f"\nfigure: exit {done.returncode} after {took:.1f} s: {done.stderr.strip()}")
    assert done.returncode == 1
    assert "not written (the agent retries it)" in done.stderr
    assert "No space left on device" in done.stderr
    pending = metric(agent, "stallwatch_dumps_pending", token=TOKEN, context=context)
    assert pending >= 1


# ---------------------------------------------------------------- pins


@pytest.mark.solo  # judges how soon (5 s) a removal is noticed: runs alone
def test_a_removed_pin_folder_is_pinned_again_and_a_sigkill_loses_nothing(
    fake: FakeNccl, folder: Path
) -> None:
    """An agent that adopted a pinned recording (it holds none of the links
    it did not make) has its pin folder removed while a rank calls 300
    times a second: pinned again within seconds, counted; SIGKILLed then,
    the next agent's dump holds every call (before: 1,198 of 1,198 lost).
    A temporary file of a dump write killed half-way is removed at start."""
    pin_dir = pins.pin_dir("surface-pins")
    base = folder / "pins"
    base.mkdir()
    first = start_agent(fake, pin_dir, base)
    agents = [first]
    rank = None
    try:
        first.wait_for("listening on")
        stop(first)  # --keep-pinned: the next one adopts
        dump_dir = base / "dumps"
        dead = subprocess.Popen(["true"])
        dead.wait()
        killed_write = dump_dir / f".node-x.msgpack.tmp-{dead.pid}-0000"
        killed_write.write_bytes(b"\0" * (4 * MB))
        second = start_agent(fake, pin_dir, base)
        agents.append(second)
        second.wait_for("listening on")
        assert "adopted the pinned recording" in second.text()
        assert not killed_write.exists() and "did not finish" in second.text()
        rank = subprocess.Popen(
            [str(fake.loop), "pace", "60", "300"], stdout=subprocess.PIPE, text=True
        )
        time.sleep(1.0)
        pins.remove(pin_dir)
        removed = time.monotonic()
        while metric(second, "stallwatch_pins_restored_total") < 1:
            assert time.monotonic() - removed < 10, second.text()[-2000:]
            time.sleep(0.1)
        noticed = time.monotonic() - removed
        assert pin_dir.is_dir() and "was removed: pinned again" in second.text()
        time.sleep(1.0)
        second.proc.kill()
        second.proc.wait()
        time.sleep(1.0)
        third = start_agent(fake, pin_dir, base)
        agents.append(third)
        third.wait_for("listening on")
        rank.send_signal(signal.SIGTERM)
        out, _ = rank.communicate(timeout=30)
        calls = int(out.split()[-1])
        rows = pace_rows(third.dump("after the kill"), rank.pid)
        print(
            f"\nfigure: noticed and pinned again {noticed:.1f} s after the removal; "
            f"{len(rows)} of {calls} calls in the next agent's dump"
        )
        assert noticed < 5.0
        assert len(rows) == calls and list(rows["seq"]) == list(range(calls))
    finally:
        if rank is not None and rank.poll() is None:
            rank.kill()
            rank.wait()
        for agent in agents:
            stop(agent)
        pins.remove(pin_dir)
        os.sync()

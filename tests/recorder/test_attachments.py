"""The TCP and scheduler programs on raw tracepoints (the agent's way)
against the same programs on tracepoints (the fallback), side by side on
the same events, real eBPF: the same rows, and no skipped evidence.

A tracepoint's program runs only when no other tracing program (a
tracepoint's, a kprobe's, a perf event's: any tool's) is running on that
CPU: an interrupt or softirq that comes in the middle of one (a timer
waking a task, a retransmission timer firing) gets none, and since 6.7 the
kernel counts the miss.  A raw tracepoint's program is skipped only when it
would run inside itself.  The raw programs read from the socket and the
task, at the running kernel's offsets, what the tracepoints copy.

The other tool here is a tracepoint program on task:task_rename that spins
for a while whenever a neighbour renames itself, as one neighbour per CPU
does in a loop (tests/recorder/data/nested_tool.c): a tracing program runs
on every CPU for much of the time.  Beside it a neighbour churns loopback
connections: a raw tracepoint's program is then skipped now and then where
it would run inside itself (a softirq's state change in the middle of its
run for a process's connect), and its second program runs for those.  The
kernel's own count of the job socket's retransmitted segments
(``tcpi_total_retrans``, one segment per packet here) is the truth the rows
are held to.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from stallwatch.dumpers.schema import TcpEvent
from stallwatch.recorder import bpfsys
from stallwatch.recorder.agent import Agent, AgentConfig
from stallwatch.recorder.bccmodule import BccModule
from stallwatch.recorder.kernelhooks import misses_counted
from stallwatch.recorder.source import BccSource
from tests.recorder import test_tcp
from tests.recorder.test_tcp import B_IP, JOB_PORT, hear, lose, place, python_in, say

pytestmark = [pytest.mark.bpf, pytest.mark.slow]
link = test_tcp.link  # two namespaces on a veth pair (a fixture)

RAW, TRACEPOINT = "raw_tracepoint", "tracepoint"
TOOL = Path(__file__).parent / "data" / "nested_tool.c"
SPIN_US = 150  # each run of the other tool's program
RUN_S = 8.0
LOSS_PCT = 20
CLOSED_PORT = 7999  # nobody listens there
TCP_HOOKS = ("tcp_retransmit_skb", "inet_sock_set_state", "sock_send_length")
SCHED_HOOKS = ("sched_wakeup", "sched_switch")
# what a row says of its event (not when it was written, nor where)
SAME = ("pid", "tid", "skaddr", "saddr", "daddr", "sport", "dport", "family", "event",
        "state", "newstate", "backoff", "srtt_us", "rto_us", "unacked", "packets_out",
        "retrans_out", "reason", "conn_known", "other", "err")  # fmt: skip


@pytest.fixture(scope="module")
def agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Agent]]:
    """Two agents of one machine: raw tracepoints, and tracepoints."""
    made: dict[str, Agent] = {}
    try:
        for attachment in (RAW, TRACEPOINT):
            config = AgentConfig(dump_dir=tmp_path_factory.mktemp(attachment), host_name="both")
            source = BccSource(1 << 14, 1_000_000, raw_tracepoints=attachment == RAW)
            made[attachment] = Agent(config, source)
        yield made
    finally:
        for agent in made.values():
            agent.close()


def _misses(agent: Agent) -> dict[str, tuple[str, int | None]]:
    return {p.hook: (p.attachment, p.misses) for p in agent.source.kernel_misses()}


def test_each_agent_is_attached_as_asked(agents: dict[str, Agent]) -> None:
    for attachment, agent in agents.items():
        attached = _misses(agent)
        assert {attached[h][0] for h in TCP_HOOKS + SCHED_HOOKS} == {attachment}
        assert attached["signal_generate"][0] == TRACEPOINT  # the process family's
        assert all((m is not None) == misses_counted() for _, m in attached.values())


# ---------------------------------------------------------------- the same rows

# The job, in one namespace: for IPv4 then IPv6 on loopback, a connection
# through a lossy port (state changes, retransmits), closed abortively (a
# reset sent from a full socket, and received); then, while its listener
# listens, a segment from the listener's port to a port nobody listens on:
# the kernel answers with a reset of no socket (told from the packet), to
# the job's listener.
JOB = f"""
import socket, struct, sys, time
def segment(family, host, sport, dport):
    tcp = struct.pack("!HHIIBBHHH", sport, dport, 1, 1, 5 << 4, 0x10, 1024, 0, 0)
    if family == socket.AF_INET6:  # the kernel sums it (IPV6_CHECKSUM)
        return tcp
    addr = socket.inet_pton(family, host)
    words = struct.unpack("!16H", addr + addr + struct.pack("!BBH", 0, 6, len(tcp)) + tcp)
    total = sum(words)
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return tcp[:16] + struct.pack("!H", ~total & 0xFFFF) + tcp[18:]
print("ready", flush=True)
sys.stdin.readline()
for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
    srv = socket.create_server((host, {JOB_PORT}), family=family)
    c = socket.create_connection((host, {JOB_PORT}))
    s, _ = srv.accept()
    for _ in range(300):
        c.sendall(b"x" * 1000)
        s.recv(65536)
    time.sleep(1.0)
    c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    c.close()
    time.sleep(0.2)
    try:
        s.recv(10)
    except ConnectionResetError:
        pass
    s.close()
    raw = socket.socket(family, socket.SOCK_RAW, socket.IPPROTO_TCP)
    if family == socket.AF_INET6:
        raw.setsockopt(socket.IPPROTO_IPV6, 7, 16)  # IPV6_CHECKSUM: at byte 16
    raw.sendto(segment(family, host, {JOB_PORT}, {CLOSED_PORT}), (host, 0))
    time.sleep(0.2)
    raw.close()
    srv.close()
print("done", flush=True)
sys.stdin.readline()
"""


def _lose_data(ns: str, port: int, pct: int) -> None:
    """``pct``% of the segments to ``port`` dropped, never a reset (a lost
    reset would leave the job waiting for it)."""
    nft = ("ip", "netns", "exec", ns, "nft")
    rule = f"tcp dport {port} tcp flags & rst == 0 numgen random mod 100 lt {pct} drop"
    chain = "add chain inet loss in { type filter hook input priority 0; }"
    for command in ("add table inet loss", chain, f"add rule inet loss in {rule}"):
        subprocess.run([*nft, command], check=True, capture_output=True, timeout=10)


def _rows(agent: Agent, pid: int) -> np.ndarray:
    rows = agent.recording().rings["tcp"].rows
    return np.asarray(rows[rows["pid"] == pid])


def _events(rows: np.ndarray) -> Counter[tuple[bytes, ...]]:
    """Each row by what it says of its event, not when it was written."""
    return Counter(tuple(np.asarray(r[f]).tobytes() for f in SAME) for r in rows)


def _waits(agent: Agent, tids: set[int]) -> dict[int, tuple[int, int]]:
    keys, values = agent.source.maps.items("rq_totals")  # type: ignore[attr-defined]
    return {
        int(k): (int(v["waits"]), int(v["over_threshold"]))
        for k, v in zip(keys, values, strict=True)
        if int(k) in tids
    }


def test_raw_tracepoints_write_the_rows_tracepoints_write(
    agents: dict[str, Agent], link: tuple[str, str]
) -> None:
    """IPv4 and IPv6, every kind of TCP row the job makes (state changes,
    retransmits with the connection's state, resets sent and received), and
    the scheduler's count of the job's waits: the same on both, but for what
    either's programs were skipped for, as the kernel counts it (on a shared
    machine, other tools' tracing programs run: the tracepoints' programs
    are skipped then, the raw tracepoints' only when one runs again inside
    itself)."""
    a, _ = link
    _lose_data(a, JOB_PORT, 10)
    before = {k: _unseen(agent) for k, agent in agents.items()}
    with python_in(a, JOB) as job:
        assert hear(job) == "ready"
        for agent in agents.values():
            place(agent, job.pid)
        say(job)
        assert hear(job) == "done"
        tids = {int(t) for t in os.listdir(f"/proc/{job.pid}/task")}
        time.sleep(0.2)
        rows = {k: _rows(agent, job.pid) for k, agent in agents.items()}
        waits = {k: _waits(agent, tids) for k, agent in agents.items()}
        unseen = {
            k: (
                _unseen_since(agent, before[k], TCP_HOOKS),
                _unseen_since(agent, before[k], SCHED_HOOKS),
            )
            for k, agent in agents.items()
        }
    raw = rows[RAW]
    assert set(raw["family"].tolist()) == {2, 10}  # AF_INET, AF_INET6
    kinds = Counter(raw["event"].tolist())
    for kind in (TcpEvent.TCP_RETRANSMIT_SKB, TcpEvent.INET_SOCK_SET_STATE,
                 TcpEvent.TCP_SEND_RESET, TcpEvent.TCP_RECEIVE_RESET):  # fmt: skip
        assert kinds[kind] > 0, kind.name
    # the resets of no socket, one a family: told from the packet, to the listener
    packet = raw[(raw["event"] == TcpEvent.TCP_SEND_RESET) & (raw["sport"] == CLOSED_PORT)]
    assert sorted(packet["family"].tolist()) == [2, 10]
    assert (packet["dport"] == JOB_PORT).all() and (packet["skaddr"] == 0).all()
    # what either side lacks, its programs were skipped for, and counted so
    # (a raw tracepoint's program is skipped only when it runs again on a
    # CPU where it is running, an interrupt's event inside a task's: on a
    # loaded machine, a few)
    mine, theirs = _events(raw), _events(rows[TRACEPOINT])
    assert (theirs - mine).total() <= unseen[RAW][0]
    assert (mine - theirs).total() <= unseen[TRACEPOINT][0]
    assert waits[RAW] and waits[RAW].keys() == waits[TRACEPOINT].keys()
    fewer = [np.subtract(waits[RAW][t], waits[TRACEPOINT][t]) for t in waits[RAW]]
    assert all((d >= -unseen[RAW][1]).all() for d in fewer)
    assert sum(int(d[0]) for d in fewer) <= unseen[TRACEPOINT][1]


# ---------------------------------------------------------------- nothing skipped

# The job: small writes (one segment each: the veth lets no packet carry
# more, see _one_segment_per_packet) with short sleeps between them; then,
# told the loss is lifted, it waits until everything is acknowledged and
# says how many segments its socket retransmitted.
SENDER = f"""
import socket, struct, sys, time
sys.stdin.readline()
c = socket.create_connection(("{B_IP}", {JOB_PORT}), timeout=5)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
print("connected", flush=True)
end = time.monotonic() + float(sys.stdin.readline())
while time.monotonic() < end:
    c.sendall(b"x" * 1000)
    time.sleep(0.001)
print("sent", flush=True)
sys.stdin.readline()
def info():
    return struct.unpack_from("=8B24I", c.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104))
while info()[12]:  # tcpi_unacked
    time.sleep(0.05)
print(info()[8 + 24 - 1], flush=True)  # tcpi_total_retrans
sys.stdin.readline()
"""
SERVER = f"""
import socket
s = socket.create_server(("0.0.0.0", {JOB_PORT}))
print("listening", flush=True)
c, _ = s.accept()
while c.recv(65536):
    pass
"""
# A neighbour of the job: renames itself in a loop on one CPU.
RENAMER = """
import ctypes, os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
libc = ctypes.CDLL(None)
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    libc.prctl(15, b"swspin", 0, 0, 0)
"""


@contextlib.contextmanager
def other_tool() -> Iterator[None]:
    """The other tool's program, linked to task:task_rename."""
    steps = SPIN_US * 1000 // 25  # clock reads of ~25 ns at least
    flags = [f"-DSPIN_NS={SPIN_US * 1000}ULL", f"-DSPIN_STEPS={steps}"]
    module = BccModule(src_file=TOOL, cflags=flags)
    try:
        prog = module.load("tracepoint__task__task_rename", bpfsys.BPF_PROG_TYPE_TRACEPOINT)
        tool_link = bpfsys.tracepoint_link(prog, "task", "task_rename")
        try:
            yield
        finally:
            os.close(tool_link)
    finally:
        module.cleanup()


@contextlib.contextmanager
def renamers(seconds: float) -> Iterator[None]:
    """One renaming neighbour per CPU, for ``seconds``."""
    procs = [
        subprocess.Popen([sys.executable, "-c", RENAMER, str(cpu), str(seconds)])
        for cpu in sorted(os.sched_getaffinity(0))
    ]
    try:
        yield
    finally:
        for proc in procs:
            proc.wait(seconds + 30)


@contextlib.contextmanager
def churning(seconds: float) -> Iterator[None]:
    """A neighbour opening and closing loopback connections: state changes
    in processes' context and in softirq, the same raw tracepoint's program
    nested in itself now and then (its second program runs for those)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", test_tcp.CHURN_FOR, str(seconds)], stdout=subprocess.DEVNULL
    )
    try:
        yield
    finally:
        proc.wait(seconds + 60)


def _one_segment_per_packet(ns: str) -> None:
    """The namespace's veth builds no packet of more than one segment, so
    that each retransmit row is one segment of the socket's count."""
    out = subprocess.run(
        ["ip", "-n", ns, "-o", "link", "show", "type", "veth"],
        capture_output=True, text=True, check=True, timeout=10,
    ).stdout  # fmt: skip
    for line in out.splitlines():
        dev = line.split(":")[1].strip().split("@")[0]
        subprocess.run(
            ["ip", "-n", ns, "link", "set", "dev", dev, "gso_max_segs", "1"],
            check=True, capture_output=True, timeout=10,
        )  # fmt: skip


def _lift_loss(ns: str) -> None:
    subprocess.run(
        ["ip", "netns", "exec", ns, "nft", "delete", "table", "inet", "loss"],
        check=True, capture_output=True, timeout=10,
    )  # fmt: skip


def _retransmits(agent: Agent, pid: int) -> np.ndarray:
    rows = agent.recording().rings["tcp"].rows
    return np.asarray(rows[(rows["event"] == TcpEvent.TCP_RETRANSMIT_SKB) & (rows["pid"] == pid)])


def _unseen(agent: Agent) -> dict[str, int]:
    """Per hook, the events no program of it ran for (a tracepoint's skipped
    runs; a raw tracepoint's, but those its second program ran for)."""
    counters = agent.source.kernel_counters()
    return {h: counters[f"kernel_skipped_{h}"] for h in TCP_HOOKS + SCHED_HOOKS}


def _unseen_since(agent: Agent, before: dict[str, int], hooks: tuple[str, ...]) -> int:
    now = _unseen(agent)
    return sum(now[h] - before[h] for h in hooks)


def _caught(agent: Agent) -> int:
    return sum(p.caught or 0 for p in agent.source.kernel_misses())


@pytest.mark.solo  # spins every CPU for seconds: alone
@pytest.mark.skipif(not misses_counted(), reason="the kernel counts skipped runs from 6.7 on")
def test_under_another_tools_program_raw_tracepoints_lose_no_retransmit(
    agents: dict[str, Agent], link: tuple[str, str]
) -> None:
    a, b = link
    _one_segment_per_packet(a)
    raw, old = agents[RAW], agents[TRACEPOINT]
    with python_in(b, SERVER) as server, python_in(a, SENDER) as sender, other_tool():
        assert hear(server) == "listening"
        say(sender)
        assert hear(sender) == "connected"
        place(raw, sender.pid)
        place(old, sender.pid)
        before = {RAW: _unseen(raw), TRACEPOINT: _unseen(old)}
        caught = _caught(raw)
        lose(b, JOB_PORT, LOSS_PCT)
        with renamers(RUN_S), churning(RUN_S):
            say(sender, str(RUN_S))
            assert hear(sender) == "sent"
        _lift_loss(b)
        say(sender)
        truth = int(hear(sender))
        time.sleep(0.2)
        job_raw, job_old = _retransmits(raw, sender.pid), _retransmits(old, sender.pid)
        skipped = {
            "raw": _unseen_since(raw, before[RAW], TCP_HOOKS + SCHED_HOOKS),
            "raw tcp": _unseen_since(raw, before[RAW], TCP_HOOKS),
            "raw, run by a second program": _caught(raw) - caught,
            "old tcp": _unseen_since(old, before[TRACEPOINT], TCP_HOOKS),
            "old sched": _unseen_since(old, before[TRACEPOINT], SCHED_HOOKS),
        }
    print(f"retransmitted segments {truth}; rows: raw {len(job_raw)}, tracepoints "
          f"{len(job_old)}; skipped {skipped}")  # fmt: skip
    assert truth >= 20, "too few retransmits to judge"
    # the tracepoints' programs were skipped in this run, for TCP events and
    # for wakeups: another tracing program ran where they came
    assert skipped["old tcp"] > 0 and skipped["old sched"] > 0
    # the raw tracepoints' a small share of that (a program within itself:
    # a wakeup its own work caused; a TCP event a second program missed by an
    # instant, docs/limits.md), and every retransmitted segment is a row (a
    # retransmit that failed to go out is a row, err set, and not counted)
    assert skipped["raw"] * 10 < skipped["old tcp"] + skipped["old sched"], skipped
    sent = int((job_raw["err"] == 0).sum())
    assert sent <= truth <= len(job_raw)
    assert len(job_old) <= len(job_raw)

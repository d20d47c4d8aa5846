"""Follow-ups on the recorder: what ends a process, scope in the lab, the
agent's /metrics.

- Exits (real eBPF): a multi-threaded process that calls exit(3) is recorded
  with code 3 and no signal (the SIGKILLs the kernel sends its other threads
  are not its cause); SIGKILL, SIGSEGV and abort() are recorded as such.
- Tables (unit): a SIGKILL row of another thread after a fatal signal does
  not replace it, whatever the ring order.
- TCP scope helpers (unit): loopback and unspecified addresses, IPv4-mapped.
- /metrics (real eBPF): scraped over HTTP, parsed by prometheus_client; the
  families the issue lists are there and counters move after NCCL calls.
- Scope in the lab (``--scope netns``): every pid in a node's dump is one of
  that node's ranks and no trigger names a foreign pid.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dumpers.format import read_dump
from dumpers.model import ProcessInfo
from dumpers.schema import EXIT_EVENT, NCCL_EVENT, TCP_EVENT, ExitEvent, Op
from recorder.agent import Agent, AgentConfig, _ipv4_unmapped, _shared_address
from recorder.model import CommProgress, InflightCall
from recorder.source import ReplaySource
from recorder.tables import ProcessTable

from .test_recorder_bpf import wait_for
from .test_recorder_lab import lab_run

GONE_PID = 4_000_000  # above pid_max: no such process

THREADS_THEN = """
import os, sys, threading, time
sys.stdin.readline()
def spin():
    while True:
        sum(range(1000))
for target in (spin, spin, lambda: time.sleep(100), lambda: time.sleep(100)):
    threading.Thread(target=target, daemon=True).start()
time.sleep(0.2)
{end}
"""
EXIT_FROM_THREAD = "threading.Thread(target=os._exit, args=(3,)).start(); time.sleep(9)"
ENDS: dict[str, tuple[str, int | None, int | None]] = {
    "exit3": ("sys.exit(3)", 3, None),
    "exit3_from_thread": (EXIT_FROM_THREAD, 3, None),
    "sigkill": ("time.sleep(100)", None, signal.SIGKILL),
    "sigsegv": ("os.kill(os.getpid(), signal.SIGSEGV)", None, signal.SIGSEGV),
    "abort": ("os.abort()", None, signal.SIGABRT),
}  # fmt: skip


@pytest.fixture(scope="module")
def bpf_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    from bench.fakenccl import build
    from recorder.source import BccSource

    fake = build()
    config = AgentConfig(dump_dir=tmp_path_factory.mktemp("dumps"), host_name="followups")
    agent = Agent(config, BccSource(1 << 12, 1_000_000))
    agent.attach_library(str(fake.lib), required=True)
    agent.fake_loop = fake.loop  # type: ignore[attr-defined]
    yield agent
    agent.close()


@contextlib.contextmanager
def processes(codes: list[str]) -> Iterator[list[subprocess.Popen[str]]]:
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, text=True)
        for code in codes
    ]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
            if p.stdin is not None:
                p.stdin.close()


@pytest.mark.bpf
def test_exit_code_or_the_signal_that_really_ended_the_process(bpf_agent: Agent) -> None:
    names = list(ENDS)
    codes = [THREADS_THEN.format(end=f"import signal\n{ENDS[n][0]}") for n in names]
    with processes(codes) as procs:
        for p in procs:
            bpf_agent.source.set_scope(p.pid, tracked=True, excluded=False)
            assert bpf_agent.classify(p.pid)
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        time.sleep(0.6)
        procs[names.index("sigkill")].send_signal(signal.SIGKILL)
        for p in procs:
            p.wait(10)
        pids = {p.pid: n for p, n in zip(procs, names, strict=True)}

    def infos() -> dict[str, ProcessInfo]:
        bpf_agent.tick()
        return {pids[i.pid]: i for i in bpf_agent.procs.infos() if i.pid in pids}

    wait_for("every exit", lambda: all(i.exit_ns for i in infos().values()))
    got = {n: (i.exit_code, i.exit_signal) for n, i in infos().items()}
    assert got == {n: (code, sig) for n, (_, code, sig) in ENDS.items()}


def _exit_row(pos: int, pid: int, tid: int, event: ExitEvent, code: int, sig: int) -> np.void:
    row = np.zeros(1, dtype=EXIT_EVENT)
    row["pos"], row["pid"], row["tid"] = pos, pid, tid
    row["event"], row["code"], row["signal"] = event, code, sig
    first: np.void = row[0]
    return first


def test_a_later_sigkill_of_another_thread_does_not_replace_the_fatal_signal() -> None:
    table = ProcessTable()
    rows = np.array(
        [
            _exit_row(1, 100, 100, ExitEvent.SIGNAL, -1, signal.SIGSEGV),
            _exit_row(2, 100, 101, ExitEvent.SIGNAL, -1, signal.SIGKILL),
            _exit_row(3, 200, 200, ExitEvent.SIGNAL, -1, signal.SIGTERM),  # handled, then
            _exit_row(4, 200, 200, ExitEvent.EXIT_GROUP, 0, 0),  # exit(0)
            _exit_row(5, 300, 300, ExitEvent.SIGNAL, -1, signal.SIGKILL),  # kill -9
            _exit_row(6, 300, 301, ExitEvent.SIGNAL, -1, signal.SIGKILL),
        ],
        dtype=EXIT_EVENT,
    )
    table.apply_exit_rows(rows)
    got = {p.pid: (p.exit_code, p.exit_signal) for p in table.infos()}
    assert got == {100: (None, signal.SIGSEGV), 200: (0, None), 300: (None, signal.SIGKILL)}


def _addr(*octets: int) -> list[int]:
    return list(octets) + [0] * (16 - len(octets))


def test_tcp_address_helpers() -> None:
    addrs = np.array(
        [
            _addr(10, 0, 0, 1),
            _addr(127, 0, 0, 1),
            _addr(),
            [0] * 15 + [1],  # ::1
            [0] * 10 + [0xFF, 0xFF, 10, 0, 0, 1],  # ::ffff:10.0.0.1
            [0] * 10 + [0xFF, 0xFF, 127, 0, 0, 1],
            [0x20, 0x01, 0x0D, 0xB8] + [0] * 11 + [1],  # 2001:db8::1
        ],
        dtype=np.uint8,
    )
    plain = _ipv4_unmapped(addrs)
    assert plain[4].tolist() == _addr(10, 0, 0, 1)
    assert plain[6].tolist() == addrs[6].tolist()
    assert _shared_address(plain).tolist() == [False, True, True, True, False, True, False]


def test_netns_scope_drops_pids_it_cannot_place(tmp_path: Path) -> None:
    """A pid that is gone before it could be classified may be another
    node's: in netns scope neither the watchdog nor a snapshot sees it; the
    host scope keeps it."""
    for scope, seen in (("netns", False), ("host", True)):
        source = ReplaySource(ring_slots=16)
        rows = np.zeros(3, dtype=NCCL_EVENT)
        rows["pid"], rows["op"] = GONE_PID, Op.ALL_REDUCE
        source.writers["nccl"].append(rows)
        exit_rows = np.zeros(1, dtype=EXIT_EVENT)
        exit_rows["pid"], exit_rows["event"], exit_rows["signal"] = GONE_PID, ExitEvent.SIGNAL, 9
        source.writers["exit"].append(exit_rows)
        source.comms.append(CommProgress(GONE_PID, 0xA0, 0, 0, 2, 5, 6, 3, 1, False))
        source.inflight.append(InflightCall(GONE_PID, GONE_PID, 0, Op.ALL_REDUCE, 2, 5))
        config = AgentConfig(dump_dir=tmp_path, scope=scope, host_name="node-a")
        agent = Agent(config, source)
        state = agent.tick()
        assert bool(state.inflight) is seen and bool(state.comms) is seen, scope
        assert any(p.pid == GONE_PID for p in state.processes) is seen, scope
        rec = agent.snapshot()
        assert bool(len(rec.rings["nccl"].rows)) is seen, scope
        assert bool(len(rec.rings["exit"].rows)) is seen, scope


def test_netns_tcp_rows_by_the_socket_address_foreign_owners_unattributed(
    tmp_path: Path,
) -> None:
    source = ReplaySource(ring_slots=64)
    agent = Agent(AgentConfig(dump_dir=tmp_path, scope="netns", host_name="n"), source)
    me = os.getpid()  # in this namespace: in scope once classified
    assert agent.classify(me)
    agent._addresses, agent._addresses_at = {bytes(_addr(10, 9, 0, 1))}, time.monotonic()
    table = [  # owner, own address, kept, pid in the snapshot
        (me, _addr(10, 9, 0, 1), True, me),
        (GONE_PID, _addr(10, 9, 0, 1), True, 0),  # our address, owner unknown
        (me, _addr(10, 9, 0, 2), False, None),  # another node's address
        (GONE_PID, _addr(10, 9, 0, 2), False, None),
        (me, _addr(127, 0, 0, 1), True, me),  # loopback: by owner
        (GONE_PID, _addr(127, 0, 0, 1), False, None),
        (0, _addr(10, 9, 0, 1), True, 0),
    ]
    rows = np.zeros(len(table), dtype=TCP_EVENT)
    rows["pid"] = [t[0] for t in table]
    rows["saddr"] = [t[1] for t in table]
    rows["sport"] = np.arange(len(table)) + 1000
    source.writers["tcp"].append(rows)
    got = agent.snapshot().rings["tcp"].rows
    want = [(1000 + i, t[3]) for i, t in enumerate(table) if t[2]]
    assert [(int(r["sport"]), int(r["pid"])) for r in got] == want


def _scrape(address: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = tuple(sorted(sample.labels.items()))
            out.setdefault(sample.name, {})[key] = sample.value
        out.setdefault(f"TYPE {family.name}", {})[(("type", family.type),)] = 0.0
    return out


@pytest.mark.bpf
def test_metrics_of_a_live_agent(bpf_agent: Agent) -> None:
    from analyzer.http import serve_http

    handle = serve_http(bpf_agent, "127.0.0.1:0", None)
    try:
        before = _scrape(handle.address)
        subprocess.run(
            [str(bpf_agent.fake_loop), "scenario", "-", "0", "2"],  # type: ignore[attr-defined]
            check=True,
            capture_output=True,
            timeout=30,
        )
        bpf_agent.tick()
        after = _scrape(handle.address)
    finally:
        handle.close()
    kinds = {(("kind", k),) for k in ("nccl", "comm", "tcp", "sched", "exit")}
    for name in (
        "stallwatch_events_recorded_total",
        "stallwatch_events_lost_total",
        "stallwatch_events_overwritten_total",
        "stallwatch_ring_fill_ratio",
    ):
        assert set(after[name]) == kinds, name
    types = {
        "stallwatch_events_recorded": "counter",
        "stallwatch_ring_fill_ratio": "gauge",
        "stallwatch_dumps_written": "counter",
        "stallwatch_dump_failures": "counter",
        "stallwatch_stalls_detected": "counter",
        "stallwatch_libraries_attached": "gauge",
        "stallwatch_processes_watched": "gauge",
    }
    for family, kind in types.items():
        assert after[f"TYPE {family}"] == {(("type", kind),): 0.0}, family
    assert "stallwatch_libraries_attached_total" not in after
    assert after["stallwatch_libraries_attached"][()] >= 1
    nccl = (("kind", "nccl"),)
    moved = after["stallwatch_events_recorded_total"][nccl]
    assert moved >= before["stallwatch_events_recorded_total"][nccl] + 20
    comm = (("kind", "comm"),)
    assert (
        after["stallwatch_events_recorded_total"][comm]
        > (before["stallwatch_events_recorded_total"][comm])
    )
    assert 0 < after["stallwatch_ring_fill_ratio"][nccl] <= 1


@pytest.mark.bpf
@pytest.mark.lab
def test_netns_scope_every_pid_of_a_dump_is_a_rank_of_its_node(tmp_path: Path) -> None:
    """Loss on node 1 and a hang of rank 3: each node's dump holds only its
    own ranks' rows, processes and triggers."""
    result = lab_run(
        "--nodes", "2", "--ranks-per-node", "2", "--steps", "20", "--record",
        "--dump-dir", str(tmp_path), "--stall-timeout", "2",
        "--fault", "loss:node=1,pct=8", "--fault", "hang:rank=3,step=15",
    )  # fmt: skip
    ranks = {n: {r["pid"] for r in result["ranks"] if r["node"] == n} for n in (0, 1)}
    assert all(ranks.values()), result["ranks"]
    by_node: dict[int, list[Path]] = {0: [], 1: []}
    for path in map(Path, result["dumps"]):
        by_node[int(path.parent.name.removeprefix("node"))].append(path)
    assert all(by_node.values()), result["dumps"]
    retransmits = 0
    tcp_keys: dict[int, set[tuple[int, int, int]]] = {0: set(), 1: set()}
    for node, paths in by_node.items():
        for path in paths:
            rec = read_dump(path)
            rows = rec.rings["tcp"].rows
            cols = (rows["ts_ns"].tolist(), rows["skaddr"].tolist(), rows["event"].tolist())
            tcp_keys[node].update(zip(*cols, strict=True))
            where = f"node {node} ({path.name})"
            nccl = {int(p) for p in rec.rings["nccl"].rows["pid"]}
            assert nccl and nccl <= ranks[node], f"{where}: nccl pids {nccl}, ranks {ranks[node]}"
            tcp = {int(p) for p in rec.rings["tcp"].rows["pid"]} - {0}
            assert tcp <= ranks[node], f"{where}: tcp pids {tcp}, ranks {ranks[node]}"
            procs = {p.pid for p in rec.processes}
            assert procs <= ranks[node], f"{where}: processes {procs}"
            assert {c.pid for c in rec.communicators} <= ranks[node], where
            for ring in ("comm", "sched", "exit"):
                pids = {int(p) for p in rec.rings[ring].rows["pid"]}
                assert pids <= ranks[node], f"{where}: {ring} pids {pids}"
            assert rec.trigger is not None
            assert rec.trigger.pid == 0 or rec.trigger.pid in ranks[0] | ranks[1], where
            if rec.trigger.origin_host in ("", rec.host):
                assert rec.trigger.pid in ranks[node] | {0}, f"{where}: {rec.trigger}"
            if node == 1:
                retransmits += int((rec.rings["tcp"].rows["pid"] != 0).sum())
    assert not tcp_keys[0] & tcp_keys[1], "the same TCP event in both nodes' dumps"
    seen = [(n.get("tcp_out_segs"), n.get("tcp_retrans_segs")) for n in result["nodes_seen"]]
    assert retransmits, f"node 1 recorded no TCP event owned by its ranks; segs, retrans: {seen}"

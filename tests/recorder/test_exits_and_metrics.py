"""What ends a process, and the agent's /metrics, against real eBPF.

- Exits (real eBPF): a multi-threaded process that calls exit(3) is recorded
  with code 3 and no signal (the SIGKILLs the kernel sends its other threads
  are not its cause); SIGKILL, SIGSEGV and abort() are recorded as such.
- Tables (unit): a SIGKILL row of another thread after a fatal signal does
  not replace it, whatever the ring order.
- /metrics (real eBPF): scraped over HTTP, parsed by prometheus_client; the
  families the issue lists are there and counters move after NCCL calls.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest

from stallwatch.dumpers.model import ProcessInfo
from stallwatch.dumpers.schema import EXIT_EVENT, ExitEvent
from stallwatch.recorder.agent import Agent, AgentConfig
from stallwatch.recorder.registry import ProcessRegistry

from .test_bpf import wait_for

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
    from stallwatch.recorder.source import BccSource

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
    table = ProcessRegistry()
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
    from stallwatch.query.http import serve_http

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
    kinds = {(("kind", k),) for k in ("nccl", "comm", "tcp", "sched", "exit", "link",
                                       "conn_samples", "iface_samples")}  # fmt: skip
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

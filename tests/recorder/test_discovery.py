"""Discovery from the kernel's events, and an idle agent that reads nothing:
the logic behind the seam (replayed rings, a counting source).  The real
thing: test_bpf.py (new processes, a chroot with its own loader)."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from bench.fakenccl import build
from stallwatch.dumpers.model import ProcessInfo
from stallwatch.recorder import agent as agent_mod
from stallwatch.recorder import discovery
from stallwatch.recorder import loop as loop_mod
from stallwatch.recorder.agent import Agent, AgentConfig
from stallwatch.recorder.discovery import KernelDiscovery
from stallwatch.recorder.links import LinkSampler
from stallwatch.recorder.maps import DISC_EXEC, DISC_LINKMAP, DISCOVERY_EVENT
from stallwatch.recorder.rings import RingBuffer, RingWriter
from stallwatch.recorder.source import ReplaySource
from stallwatch.recorder.tickstate import CommProgress


def events(*pairs: tuple[int, int]) -> np.ndarray:
    rows = np.zeros(len(pairs), dtype=DISCOVERY_EVENT)
    rows["pid"] = [p for p, _ in pairs]
    rows["event"] = [e for _, e in pairs]
    return rows


def test_pending_pids_once_each_and_lost_rows_asked_for_a_scan() -> None:
    ring = RingWriter("discovery", DISCOVERY_EVENT, 8)
    ring.append(events((1, DISC_EXEC)))  # before the agent looked: the start scan's
    found = KernelDiscovery(ring.buffer)
    assert found.pending() == (set(), set(), False)
    ring.append(events((5, DISC_EXEC), (5, DISC_LINKMAP), (6, DISC_LINKMAP), (6, DISC_LINKMAP)))
    assert found.pending() == ({5}, {5, 6}, False)
    assert found.pending() == (set(), set(), False)
    ring.append(events(*[(100 + i, DISC_LINKMAP) for i in range(12)]))  # more than it holds
    execs, links, lost = found.pending()
    assert lost and execs == set() and links == {104 + i for i in range(8)}


def test_a_row_still_being_written_is_read_next_time() -> None:
    ring = RingWriter("discovery", DISCOVERY_EVENT, 8)
    found = KernelDiscovery(ring.buffer)
    found.pending()
    ring.append(events((7, DISC_LINKMAP), (8, DISC_LINKMAP), (9, DISC_EXEC)))
    slot = ring.buffer.slots
    torn = slot[1].copy()
    slot[1]["pos"] = 0  # position 2 claimed, not yet published
    assert found.pending() == ({9}, {7}, False)
    slot[1] = torn
    assert found.pending() == ({9}, {8}, False)  # 8 now; 9 again (idempotent)


class CountingSource(ReplaySource):
    """A replay source that counts how often the agent reads the maps."""

    reads: int = 0

    def comm_progress(self) -> list[CommProgress]:
        self.reads += 1
        return super().comm_progress()


def test_an_idle_agent_reads_no_map_and_forgets_ended_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(agent_mod, "QUIET_NS", 50_000_000)
    source = CountingSource()
    gone = 2**22 + 17  # no such pid
    source.comms.append(CommProgress(gone, 0xA, 0x42, 0, 2, 5, 6, 4, 0, False))
    source.tracked.add(gone)
    agent = Agent(AgentConfig(dump_dir=tmp_path, host_name="idle"), source)
    agent.tick()
    assert source.reads == 1 and source.comms  # seen gone, not yet forgotten
    time.sleep(0.06)
    agent.tick()
    assert source.comms == [] and gone not in source.tracked  # forgotten
    agent.tick()  # the last read found nothing: from now on, nothing is read
    reads = source.reads
    for _ in range(5):
        assert agent.tick().comms == ()
    assert source.reads == reads
    # a process in scope alive: the maps are read again each tick
    agent.procs.add(ProcessInfo(os.getpid(), "me", "", 0, 1, ()))
    agent.tick()
    agent.tick()
    assert source.reads == reads + 2


def test_the_pacer_waits_a_little_then_looks_once_per_period() -> None:
    from stallwatch.recorder.discovery import Pacer

    pacer = Pacer(delay_s=0.15, every_s=1.0)
    assert pacer.due({1, 2}, 10.0) == set()  # just started: maybe gone soon
    assert pacer.due(set(), 10.1) == set()
    assert pacer.due({1}, 10.2) == {1, 2}
    assert pacer.due({1}, 10.5) == set()  # a burst: once per period
    assert pacer.due({1}, 11.0) == set()
    assert pacer.due(set(), 11.25) == {1}  # the burst's end is still looked at
    assert pacer.due(set(), 20.0) == set()


def test_the_loaders_list_lies_where_its_symbol_table_says() -> None:
    """The discovery probe's cookie: from ``_dl_debug_state`` to ``_r_debug``
    in the loader's file, as ``nm`` reads them; 0 in a file without them."""
    loader = os.path.realpath("/lib64/ld-linux-x86-64.so.2")
    out = subprocess.run(["nm", "-D", loader], capture_output=True, text=True, check=True).stdout
    where = {line.split()[2].split("@")[0]: int(line.split()[0], 16) for line in out.splitlines()}
    want = where["_r_debug"] - where["_dl_debug_state"]
    assert discovery.r_debug_distance(loader) == want % (1 << 64)
    assert discovery.r_debug_distance(str(build().lib)) == 0


def test_the_loop_sleeps_a_second_when_idle_and_a_signal_wakes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing to watch: the loop turns every IDLE_TICK_S, not every TICK_S
    (the kernel's doorbell, tested in test_bpf.py, or a signal wakes it);
    a process in scope makes it busy; a dump asked for or a stop is acted on
    at once, not at the next turn."""
    monkeypatch.setattr(discovery, "scan_all", lambda self_pid: {})  # no other process
    # nor any link news: the lab's namespaces, made beside this test, ring rtnetlink
    monkeypatch.setattr(agent_mod, "LinkSampler", lambda cfg: LinkSampler(cfg, rtnl=None))
    source = EventsSource()
    agent = Agent(AgentConfig(dump_dir=tmp_path, host_name="idle"), source)
    turns: list[float] = []
    tick = agent.tick
    monkeypatch.setattr(agent, "tick", lambda: (turns.append(time.monotonic()), tick())[1])
    stop = loop_mod.Stop()
    loop = threading.Thread(target=loop_mod.run_loop, args=(agent, stop))
    loop.start()
    try:
        time.sleep(2.5)
        assert not agent.busy()
        assert 2 <= len(turns) <= 4, f"{len(turns)} turns in 2.5 s"  # busy: 13
        asked = time.monotonic()
        stop.request_dump()
        wait_until(lambda: any(tmp_path.glob("*.msgpack")), 10)
        assert turns[-1] - asked < loop_mod.IDLE_TICK_S * 0.9
        agent.procs.add(ProcessInfo(os.getpid(), "me", "", 0, 1, ()))
        assert agent.busy()
    finally:
        asked = time.monotonic()
        stop.set()
        loop.join(10)
    assert not loop.is_alive() and time.monotonic() - asked < loop_mod.IDLE_TICK_S * 0.9


class EventsSource(ReplaySource):
    """A replay source with a discovery ring, as the kernel's (no rows)."""

    def discovery_ring(self) -> RingBuffer:
        return RingWriter("discovery", DISCOVERY_EVENT, 8).buffer


def wait_until(check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.01)

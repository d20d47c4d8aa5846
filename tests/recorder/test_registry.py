"""Communicator and process tables, and the agent's snapshot, on a replay source."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from stallwatch.dumpers.errors import ProbeError
from stallwatch.dumpers.model import TriggerKind
from stallwatch.dumpers.schema import COMM_EVENT, EXIT_EVENT, NCCL_EVENT, ExitEvent, Op, State
from stallwatch.recorder.agent import Agent, AgentConfig
from stallwatch.recorder.registry import CommRegistry, ProcessRegistry
from stallwatch.recorder.source import ReplaySource
from stallwatch.recorder.tickstate import CommProgress, InflightCall

DEAD_PID = 4_000_000  # above pid_max: never alive


def _uid(port: int) -> bytes:
    uid = bytearray(128)
    uid[0:8] = b"\x11" * 8
    uid[8:10] = (2).to_bytes(2, "little")
    uid[10:12] = port.to_bytes(2, "big")
    uid[12:16] = bytes([10, 0, 0, 7])
    return bytes(uid)


def _comm_row(op: Op, pid: int, comm: int, h: int, **kw: object) -> np.ndarray:
    row = np.zeros(1, dtype=COMM_EVENT)
    row["op"], row["pid"], row["comm"], row["comm_hash"] = op, pid, comm, h
    row["state"], row["result"], row["ts_ns"] = State.ENQUEUED, 0, kw.pop("ts", 100)
    row["rank"], row["nranks"], row["color"], row["key"] = -1, -1, -1, -1
    for k, v in kw.items():
        row[k] = np.frombuffer(v, np.uint8) if isinstance(v, bytes) else v
    return row


def test_comm_table_survives_ring_overwrite_and_keeps_destroyed_comms() -> None:
    source = ReplaySource(ring_slots=64)  # comm ring: 64 slots
    table = CommRegistry()
    ring = source.writers["comm"]
    init = _comm_row(Op.COMM_INIT_RANK, 7, 0xA0, 0x1234, rank=3, nranks=8, unique_id=_uid(29500))
    ring.append(init)
    table.apply_rows(ring.buffer.copy().rows)
    # Flood the ring with unrelated lifecycle rows: the init row is overwritten.
    flood = np.concatenate([_comm_row(Op.GET_UNIQUE_ID, 9, 0, i + 1) for i in range(200)])
    ring.append(flood)
    snap = ring.buffer.copy()
    assert snap.overwritten > 0 and Op.COMM_INIT_RANK not in snap.rows["op"]
    table.apply_rows(snap.rows)
    destroy = _comm_row(Op.COMM_DESTROY, 7, 0xA0, 0x1234, ts=500)
    ring.append(destroy)
    table.apply_rows(ring.buffer.copy().rows)
    (info,) = [c for c in table.infos() if c.comm_hash == 0x1234]
    assert (info.pid, info.comm, info.rank, info.nranks) == (7, 0xA0, 3, 8)
    assert info.root_addr == "10.0.0.7:29500"
    assert info.destroy_ns == 500


def test_split_rows_leave_rank_to_the_analyzer_and_pending_rows_wait() -> None:
    table = CommRegistry()
    split = _comm_row(Op.COMM_SPLIT, 7, 0xB0, 0x55, parent_hash=0x1234, color=2, key=5, rank=1)
    split["state"] = State.SCHEDULED
    split["pos"] = 1
    table.apply_rows(split)
    assert table.infos() == ()
    split["state"] = State.ENQUEUED
    table.apply_rows(split)
    (info,) = table.infos()
    assert (info.rank, info.nranks, info.parent_hash, info.color, info.key) == (
        -1,
        -1,
        0x1234,
        2,
        5,
    )


def test_comm_map_fills_what_the_ring_never_carried() -> None:
    table = CommRegistry()
    progress = [
        CommProgress(7, 0xC0, 0x99, 2, 4, 10, 20, 5, 0, destroyed=True),
        CommProgress(7, 0xD0, 0, -1, -1, 10, 20, 5, 0, destroyed=False),  # id unknown
    ]
    table.apply_progress(progress, now_ns=1234)
    known, late = sorted(table.infos(), key=lambda c: c.comm)
    assert (known.comm_hash, known.rank, known.nranks, known.destroy_ns) == (0x99, 2, 4, 1234)
    # made before the agent attached: kept, id unknown, init 0 (its seq counts
    # from the attach: the analyzer aligns it with its peers)
    assert (late.comm, late.comm_hash, late.init_ns, late.destroy_ns) == (0xD0, 0, 0, 0)


def _exit_row(
    pid: int, event: ExitEvent, code: int = -1, signal: int = 0, ts: int = 1
) -> np.ndarray:
    row = np.zeros(1, dtype=EXIT_EVENT)
    row["pid"], row["event"], row["code"], row["signal"], row["ts_ns"] = (
        pid,
        event,
        code,
        signal,
        ts,
    )
    return row


def test_process_table_exit_code_signal_and_handled_signal() -> None:
    source = ReplaySource()
    ring = source.writers["exit"]
    ring.append(_exit_row(11, ExitEvent.SIGNAL, signal=9))
    ring.append(_exit_row(11, ExitEvent.PROCESS_EXIT, ts=50))
    ring.append(_exit_row(12, ExitEvent.EXIT_GROUP, code=3))
    ring.append(_exit_row(13, ExitEvent.SIGNAL, signal=15))  # handled, then exit(0)
    ring.append(_exit_row(13, ExitEvent.EXIT_GROUP, code=0))
    table = ProcessRegistry()
    table.apply_exit_rows(ring.buffer.copy().rows)
    table.apply_exit_rows(ring.buffer.copy().rows)  # idempotent
    got = {p.pid: (p.exit_code, p.exit_signal, p.exit_ns) for p in table.infos()}
    assert got == {11: (None, 9, 50), 12: (3, None, 0), 13: (0, None, 0)}


def _agent(tmp_path: Path, source: ReplaySource, scope: str = "host") -> Agent:
    return Agent(AgentConfig(dump_dir=tmp_path, scope=scope, host_name="node-a"), source)


def test_agent_snapshot_tick_state_and_dump(tmp_path: Path) -> None:
    source = ReplaySource(ring_slots=16)
    rows = np.zeros(40, dtype=NCCL_EVENT)
    rows["pid"], rows["op"], rows["seq"] = DEAD_PID, Op.ALL_REDUCE, np.arange(40)
    source.writers["nccl"].append(rows)
    source.writers["comm"].append(
        _comm_row(Op.COMM_INIT_RANK, DEAD_PID, 0xA0, 0x42, rank=0, nranks=2)
    )
    source.comms.append(CommProgress(DEAD_PID, 0xA0, 0x42, 0, 2, 5, 6, 40, 1, False))
    source.inflight.append(InflightCall(DEAD_PID, DEAD_PID, 0x42, Op.ALL_REDUCE, 39, 5))
    source.counters["kernel_lost_nccl"] = 2
    agent = _agent(tmp_path, source)
    rec = agent.recording()
    assert rec.host == "node-a"
    assert list(rec.rings["nccl"].rows["seq"]) == list(range(24, 40))
    assert rec.rings["nccl"].overwritten == 24
    assert rec.counters["kernel_lost_nccl"] == 2
    assert rec.counters["ring_nccl_overwritten"] == 24
    assert [c.comm_hash for c in rec.communicators] == [0x42]
    assert rec.clock.monotonic_ns > 0 and rec.clock.realtime_ns > rec.clock.monotonic_ns
    state = agent.tick_state()
    assert [c.seq for c in state.inflight] == [39]
    assert [c.comm_hash for c in state.comms] == [0x42]
    answer = agent.request_dump("by test")
    assert answer["status"] == "written"
    from stallwatch.dumpers.format import read_dump

    dumped = read_dump(str(answer["path"]))
    assert dumped.trigger is not None and dumped.trigger.kind == TriggerKind.MANUAL
    assert len(dumped.rings["nccl"].rows) == 16


def test_netns_scope_drops_rows_of_processes_outside(tmp_path: Path) -> None:
    source = ReplaySource()
    agent = _agent(tmp_path, source, scope="netns")
    me, other = os.getpid(), DEAD_PID + 1
    agent.scope.record(me, inside=True)
    agent.scope.record(other, inside=False)
    rows = np.zeros(4, dtype=NCCL_EVENT)
    rows["pid"] = [me, other, me, other]
    source.writers["nccl"].append(rows)
    rec = agent.recording()
    assert list(rec.rings["nccl"].rows["pid"]) == [me, me]


def test_attach_skips_missing_symbols_and_counts_them(tmp_path: Path) -> None:
    from bench.fakenccl import build

    lib = build().lib
    source = ReplaySource()
    agent = _agent(tmp_path, source)
    attached = agent.attach_library(str(lib), required=True)
    assert attached is not None
    assert attached.skipped == ()
    assert set(attached.first_instructions.values()) == {"push %rbp"}
    assert len(source.attached) == 21
    again = agent.attach_library(str(lib))  # same file: attached once
    assert again is attached and len(source.attached) == 21


def test_a_library_lacking_symbols_is_attached_to_what_it_has(tmp_path: Path) -> None:
    src = tmp_path / "partial.c"
    src.write_text("int ncclAllReduce(void) { return 0; }\nint ncclSend(void) { return 0; }\n")
    lib = tmp_path / "libnccl.so.2"
    cc = shutil.which("cc") or "gcc"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    source = ReplaySource()
    agent = _agent(tmp_path, source)
    attached = agent.attach_library(str(lib))
    assert attached is not None
    assert sorted(attached.symbols) == ["ncclAllReduce", "ncclSend"]
    assert len(attached.skipped) == 19 and "ncclCommInitRank" in attached.skipped
    assert agent.counters.values["symbols_skipped"] == 19
    assert sorted(s for _, s in source.attached) == ["ncclAllReduce", "ncclSend"]
    assert "stallwatch_symbols_skipped_total 19" in agent.metrics_text()


def test_a_file_without_nccl_is_reported_not_fatal_unless_required(tmp_path: Path) -> None:
    agent = _agent(tmp_path, ReplaySource())
    not_elf = tmp_path / "libnccl.so.2"
    not_elf.write_bytes(b"not an ELF file")
    assert agent.attach_library(str(not_elf)) is None
    assert agent.counters.values["attach_failures"] == 1
    with pytest.raises(ProbeError, match=str(not_elf)):
        agent.attach_library(str(not_elf), required=True)


def test_pid_with_nccl_linked_in_statically_attaches_to_its_executable(tmp_path: Path) -> None:
    from bench.fakenccl import CSRC, NCCL_HEADER_DIR

    exe = tmp_path / "static-trainer"
    cc = shutil.which("cc") or "gcc"
    subprocess.run(
        [cc, "-O0", "-fcf-protection=none", f"-I{NCCL_HEADER_DIR}", "-o", str(exe),
         str(CSRC / "ncclloop.c"), str(CSRC / "fakenccl.c")],
        check=True,
    )  # fmt: skip
    with subprocess.Popen(
        [str(exe), "wrap", "1"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "WAIT": "1"},
    ) as proc:
        assert proc.stdout is not None
        proc.stdout.readline()  # ready: mapped, no libnccl
        source = ReplaySource()
        agent = _agent(tmp_path, source)
        try:
            agent.attach_pid(proc.pid)
        finally:
            proc.kill()
    assert {path for path, s in source.attached if s != "_exit"} == {str(exe)}
    assert len([s for _, s in source.attached if s != "_exit"]) == 21
    assert proc.pid in agent.scope.inside


def test_pid_that_does_not_exist_is_a_probe_error(tmp_path: Path) -> None:
    agent = _agent(tmp_path, ReplaySource())
    with pytest.raises(ProbeError, match=f"--pid {DEAD_PID}: no such process"):
        agent.attach_pid(DEAD_PID)

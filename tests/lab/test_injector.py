"""When faults fire and what ``lab run --json`` says of them: the steps file
the ranks write, the injector's thread firing at a step (through its hog
seam: no namespaces), and the records built from the ranks' events.  The
network faults themselves are judged on real lab runs (test_midrun.py)."""

from __future__ import annotations

import os
import secrets
import shutil
import time
from pathlib import Path

import pytest

from stallwatch.dumpers.errors import LabError
from stallwatch.lab import faults as F
from stallwatch.lab import job, netns, runner
from stallwatch.lab.faultlog import Episode, FaultRecord, Moment, iso, wall_offset_ns
from stallwatch.lab.injector import Injector, runner_faults

NET = netns.Network("abc", "swlab-abc-sw", (netns.Node(0, "swlab-abc-n0", "10.201.9.1", "n0"),))


def test_ranks_write_the_step_they_begin(tmp_path: Path) -> None:
    job.make_steps_file(tmp_path, 3)
    assert job.read_steps(tmp_path) == [-1, -1, -1]
    job.StepMark(tmp_path, 2).begin(7)
    job.StepMark(tmp_path, 0).begin(0)
    assert job.read_steps(tmp_path) == [0, -1, 7]
    job.StepMark(tmp_path / "elsewhere", 1).begin(3)  # no runner: nothing written, no error
    assert job.read_steps(tmp_path / "elsewhere") == []


def _injector(tmp_path: Path, faults: list[str], started: list[F.CpuHog]) -> Injector:
    def start_hog(fault: F.CpuHog) -> str:
        started.append(fault)
        return "hogs"

    parsed = runner_faults(F.parse_faults(faults))
    return Injector(NET, parsed, tmp_path, start_hog, keep_ports=(9400,))


def test_a_fault_from_a_step_fires_once_a_rank_is_there(tmp_path: Path) -> None:
    job.make_steps_file(tmp_path, 2)
    started: list[F.CpuHog] = []
    inj = _injector(tmp_path, ["cpuhog:rank=1,step=5", "cpuhog:rank=0"], started)
    inj.apply_from_start()
    assert started == [F.CpuHog(0)]  # the one without a step, before any rank runs
    inj.start()
    try:
        job.StepMark(tmp_path, 0).begin(4)
        time.sleep(0.1)
        assert started == [F.CpuHog(0)]
        before = time.monotonic_ns()
        job.StepMark(tmp_path, 1).begin(6)  # the first rank seen at or past 5
        deadline = time.monotonic() + 5
        while len(started) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        inj.stop()
    inj.check()
    assert started == [F.CpuHog(0), F.CpuHog(1, step=5)]
    records = inj.records()
    late = records[F.CpuHog(1, step=5)]
    assert (late.injected, late.step, late.how) == (True, 6, "hogs")  # the step it fired at
    assert late.injected_ns is not None and late.injected_ns >= before
    assert late.ended_ns is None and late.injected_wall is not None
    assert records[F.CpuHog(0)].step is None  # before the job began


def test_a_failure_in_the_thread_is_raised_in_the_runner(tmp_path: Path) -> None:
    job.make_steps_file(tmp_path, 1)

    def broken(_fault: F.CpuHog) -> str:
        raise OSError("no CPU for you")

    inj = Injector(NET, runner_faults([F.CpuHog(0, step=1)]), tmp_path, broken, keep_ports=())
    inj.start()
    job.StepMark(tmp_path, 0).begin(1)
    if inj._thread is not None:
        inj._thread.join(timeout=5)
    with pytest.raises(LabError, match="injecting a fault failed: no CPU for you"):
        inj.check()


def test_a_fault_that_never_fired_says_so() -> None:
    record = FaultRecord.of("rst:node=1,step=9", "ss -K", [])
    assert (record.injected, record.step, record.injected_ns, record.episodes) == (
        False,
        None,
        None,
        [],
    )
    assert "never injected" in record.when()


def test_record_times_on_both_clocks() -> None:
    offset = wall_offset_ns()
    start = Moment.from_mono(10_000_000_000, offset)
    end = Moment.from_mono(13_500_000_000, offset)
    record = FaultRecord.of("partition:node=1,step=5,ms=3500", "nft", [Episode(5, start, end)])
    assert (record.injected_ns, record.ended_ns, record.step) == (start.mono_ns, end.mono_ns, 5)
    assert record.injected_wall == iso(start.wall_ns) and record.injected_wall.endswith("Z")
    assert record.episodes == [
        {
            "step": 5,
            "at_ns": start.mono_ns,
            "at_wall": iso(start.wall_ns),
            "end_ns": end.mono_ns,
            "end_wall": iso(end.wall_ns),
        }
    ]
    assert "at step 5" in record.when() and "ended" in record.when()
    assert iso(1_700_000_000_123_000_000) == "2023-11-14T22:13:20.123Z"


def _outcome(rank: int, events: list[dict[str, object]]) -> runner.RankOutcome:
    return runner.RankOutcome(
        world_rank=rank, node=0, local_rank=rank, pid=None, steps_done=0, status="done",
        exit_code=0, exit_signal=None, killed_by_lab=False, stuck=False, verified=True,
        verified_ok=0, verified_failed=0, error=None, calls={}, comms={}, step_ms=[],
        step_start_ns=[], cpu_s=0.0, wall_s=0.0, run_delay_ms=0.0, compute_cpu_share=0.0,
        device_log=[], events=events,
    )  # fmt: skip


def test_a_pause_on_every_rank_is_one_episode_per_step() -> None:
    """From the first rank's start to the last one's end, each time."""
    spec = "pause:every=2,ms=100"
    ev = [
        {"spec": spec, "step": 2, "at_ns": 1_000, "end_ns": 5_000},
        {"spec": spec, "step": 4, "at_ns": 9_000, "end_ns": 12_000},
        {"spec": "slow:rank=0,ms=5", "step": 0, "at_ns": 1, "end_ns": None},
    ]
    other = [
        {"spec": spec, "step": 2, "at_ns": 900, "end_ns": 6_000},
        {"spec": spec, "step": 4, "at_ns": 9_100, "end_ns": 11_000},
    ]
    ranks = [_outcome(0, ev), _outcome(1, other)]
    record = runner._rank_fault_record(F.Pause(2, 100.0), ranks, offset_ns=0)
    assert [(e["step"], e["at_ns"], e["end_ns"]) for e in record.episodes] == [
        (2, 900, 6_000),
        (4, 9_000, 12_000),
    ]
    assert (record.step, record.injected_ns, record.ended_ns) == (2, 900, 12_000)
    assert record.how == "inside the ranks"
    slow = runner._rank_fault_record(F.Slow(0, 5.0), ranks, offset_ns=0)
    assert (slow.step, slow.injected_ns, slow.ended_ns) == (0, 1, None)


@pytest.mark.lab
def test_reset_leaves_the_agents_and_the_neighbours_connections_alone() -> None:
    """ss -K in a node: a connection on a kept port stays established, the
    other is aborted (its client then reads ECONNRESET from the kernel)."""
    import socket

    run_id = "t" + secrets.token_hex(3)
    run_dir = netns.RUNS_DIR / run_id  # a live run's mark: other runs' cleanup leaves it
    run_dir.mkdir(parents=True)
    (run_dir / "runner.pid").write_text(str(os.getpid()))
    net = netns.create(run_id, 1)
    try:
        node = net.nodes[0]

        def connect(port: int) -> tuple[socket.socket, socket.socket]:
            server = socket.create_server((node.ip, port))
            client = socket.create_connection((node.ip, server.getsockname()[1]))
            accepted, _ = server.accept()
            server.close()
            return client, accepted

        kept = netns.in_netns(node.netns, lambda: connect(9400))
        other = netns.in_netns(node.netns, lambda: connect(0))
        assert netns.reset_connections(node, keep_ports=(9400, 9500)) >= 1
        kept[0].sendall(b"x")
        assert kept[1].recv(1) == b"x"  # still connected
        with pytest.raises(OSError):  # aborted (ECONNABORTED) or reset (ECONNRESET)
            other[0].sendall(b"x")
            other[0].recv(1)
        for sock in (*kept, *other):
            sock.close()
    finally:
        netns.destroy(net)
        shutil.rmtree(run_dir)

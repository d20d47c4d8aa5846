"""Judging from thread positions alone (``analyzer.detect.positions``), on positions
built by hand: the chains a hang makes across communicators, desyncs of
order, and the cases that must not be judged."""

from __future__ import annotations

from dataclasses import replace

from stallwatch.analyzer.detect.positions import judge, position_text, rank_positions
from stallwatch.analyzer.incident import HostReadings
from stallwatch.analyzer.verdict import VerdictKind
from stallwatch.dumpers.model import CommInfo
from stallwatch.dumpers.readings import (
    ArgsFrom,
    NcclCall,
    ProcessThreads,
    ThreadReading,
    ThreadState,
)
from stallwatch.dumpers.schema import DataType, RedOp

LIB = "/opt/nccl/lib/libnccl.so.2"
S = 1_000_000_000


def _call(symbol: str, comm: int, count: int = 1024, root: int = -1) -> NcclCall:
    return NcclCall(symbol, LIB, ArgsFrom.FRAME, comm, count, DataType.FLOAT32, RedOp.SUM, root,
                    0x1000, 0x2000)  # fmt: skip


def _thread(pid: int, call: NcclCall | None) -> ThreadState:
    if call is None:
        frames = ("libc.so.6+0x85f16", "libpython3.11.so.1.0!PyThread_acquire_lock_timed+0x80")
        return ThreadState(pid, "python", "S", "futex_do_wait", 202, (0,) * 6, 1, 2, frames, "cfi")
    frames = ("libc.so.6!poll+0x4f", f"libnccl.so.2!{call.symbol}+0x3a")
    return ThreadState(pid, "python", "S", "poll_schedule_timeout", 7, (0,) * 6, 1, 2, frames,
                       "cfi", call)  # fmt: skip


def _proc(rank: int, call: NcclCall | None, at: int, job: str = "job1") -> ProcessThreads:
    pid = 1000 + rank
    env = (("RANK", str(rank)), ("TORCHELASTIC_RUN_ID", job), ("WORLD_SIZE", "8"))
    return ProcessThreads(pid, at, 1000, env, (_thread(pid, call),))


def _readings(
    calls: dict[int, NcclCall | None], times: tuple[int, ...] = (0, S), per_node: int = 2
) -> list[HostReadings]:
    hosts: dict[int, list[int]] = {}
    for rank in calls:
        hosts.setdefault(rank // per_node, []).append(rank)
    return [
        HostReadings(
            f"node{n}",
            tuple(
                ThreadReading(t, 1000, "request", tuple(_proc(r, calls[r], t) for r in ranks))
                for t in times
            ),
        )
        for n, ranks in sorted(hosts.items())
    ]


def _chain() -> dict[int, NcclCall | None]:
    """A 4x2 job whose rank 5 hung before the step's tensor-parallel
    AllGather: its tp partner 4 waits there, the data-parallel AllReduce
    groups wait for 4 and 5, and rank 5 is inside no call."""
    dp0, dp1, tp2 = 0xD0, 0xD1, 0x72
    calls: dict[int, NcclCall | None] = {r: _call("ncclAllReduce", dp0) for r in (0, 2, 6)}
    calls |= {r: _call("ncclAllReduce", dp1) for r in (1, 3, 7)}
    calls[4] = _call("ncclAllGather", tp2, count=64)
    calls[5] = None
    return calls


def test_the_rank_inside_no_call_is_named_not_the_ranks_chained_behind_it() -> None:
    verdicts = judge(rank_positions(_readings(_chain())))
    assert len(verdicts) == 1
    v = verdicts[0]
    assert v.kind is VerdictKind.MISSING_RANK
    assert (v.ranks, v.hosts, v.pids, v.op) == ((5,), ("node2",), (1005,), "ALL_REDUCE")
    assert "ncclAllReduce x6, ncclAllGather x1" in v.summary and "held at least 1.0 s" in v.summary
    text = "\n".join(v.evidence)
    assert "rank 5 (host node2, pid 1005): inside no NCCL call" in text
    assert "rank 4 (host node2, pid 1004): inside ncclAllGather(count=64, float32" in text
    assert "unchanged for 1.0 s over 2 readings" in text


def test_a_call_out_of_order_is_a_desync() -> None:
    calls: dict[int, NcclCall | None] = {r: _call("ncclAllReduce", 0xAA) for r in range(8)}
    calls[6] = _call("ncclBroadcast", 0xAA, root=0)
    verdicts = judge(rank_positions(_readings(calls)))
    assert [(v.kind, v.ranks, v.op) for v in verdicts] == [(VerdictKind.DESYNC, (6,), "ALL_REDUCE")]


def test_nothing_departs_when_every_rank_waits_in_the_same_call() -> None:
    calls: dict[int, NcclCall | None] = {r: _call("ncclAllReduce", 0xAA) for r in range(8)}
    assert judge(rank_positions(_readings(calls))) == []


def test_no_majority_names_nobody() -> None:
    calls: dict[int, NcclCall | None] = {r: _call("ncclAllReduce", 0xAA) for r in range(4)}
    calls |= {r: _call("ncclAllGather", 0xAA) for r in range(4, 8)}
    assert judge(rank_positions(_readings(calls))) == []


def test_ranks_that_move_on_between_readings_are_not_hung() -> None:
    first = rank_positions(_readings(_chain()))
    later = _chain()
    later[0] = _call("ncclAllReduce", 0xD0, count=2048)  # a different call: it progressed
    snaps = _readings(_chain(), times=(0,))
    moved = _readings(later, times=(S,))
    both = [
        HostReadings(a.host, a.snapshots + b.snapshots) for a, b in zip(snaps, moved, strict=True)
    ]
    assert judge(first) and judge(rank_positions(both)) == []


def test_one_reading_still_judges_and_says_so() -> None:
    v = judge(rank_positions(_readings(_chain(), times=(0,))))
    assert [x.ranks for x in v] == [(5,)] and "(one reading)" in v[0].summary


def test_ranks_whose_node_left_no_reading_are_listed_not_blamed() -> None:
    calls = {r: c for r, c in _chain().items() if r not in (6, 7)}  # node3 left nothing
    v = judge(rank_positions(_readings(calls)))
    assert v[0].ranks == (5,)
    assert any("no reading" in e and "[6, 7]" in e for e in v[0].evidence)


def test_the_recording_narrows_the_culprits_to_members_of_the_waited_communicator() -> None:
    """Two ranks outside any call; the recording knows the others wait on a
    communicator only rank 3 belongs to: rank 3 is named, not rank 1."""
    world = 0x1234
    calls: dict[int, NcclCall | None] = {r: _call("ncclAllReduce", 0xC000 + r) for r in (0, 2)}
    calls[1] = calls[3] = None
    readings = _readings(calls)
    comms = {
        0: (CommInfo(1000, 0xC000, world, 0, 3), CommInfo(1001, 0xC001, 0x999, 0, 2)),
        1: (CommInfo(1002, 0xC002, world, 1, 3), CommInfo(1003, 0xC003, world, 2, 3)),
    }
    readings = [HostReadings(h.host, h.snapshots, comms[i]) for i, h in enumerate(readings)]
    v = judge(rank_positions(readings))
    assert [(x.kind, x.ranks, x.comm_id_hash) for x in v] == [
        (VerdictKind.MISSING_RANK, (3,), f"0x{world:016x}")
    ]
    assert "on communicator 0x0000000000001234 as rank 0 of 3" in "\n".join(v[0].evidence)


def test_jobs_are_judged_apart() -> None:
    readings = _readings(_chain())
    other = ThreadReading(0, 1, "request", (_proc(0, None, S, job="job2"),))
    readings.append(HostReadings("node9", (other,)))
    v = judge(rank_positions(readings))
    assert [x.ranks for x in v] == [(5,)]  # job2's lone idle rank waits for nobody


def test_a_process_that_is_no_rank_is_not_blamed() -> None:
    readings = _readings(_chain())
    env = (("TORCHELASTIC_RUN_ID", "job1"), ("WORLD_SIZE", "8"))  # the job's, but no RANK
    tool = ProcessThreads(4242, S, 1000, env, (_thread(4242, None),))
    last = readings[0].snapshots[-1]
    readings[0] = HostReadings(
        "node0",
        (*readings[0].snapshots[:-1], ThreadReading(S, 1, "request", (*last.processes, tool))),
    )
    v = judge(rank_positions(readings))
    assert [x.ranks for x in v] == [(5,)]


def _spinning(pid: int) -> ThreadState:
    """A waiter that spins (CUDA spin sync, NCCL busy polling): running, its
    stack not read (a running thread is not stopped to read it)."""
    return ThreadState(pid, "python", "R", "", -1, (0,) * 6, 1, 2, (), "")


def test_a_running_thread_whose_stack_was_not_read_is_unknown_not_outside() -> None:
    # rank 5 hung (sleeping, outside NCCL); ranks 4 and 6 spin while they wait
    calls = _chain()
    readings = _readings(calls)
    spun = []
    for hr in readings:
        snaps = []
        for s in hr.snapshots:
            procs = tuple(
                replace(p, threads=(_spinning(p.pid),)) if p.pid in (1004, 1006) else p
                for p in s.processes
            )
            snaps.append(replace(s, processes=procs))
        spun.append(HostReadings(hr.host, tuple(snaps)))
    (v,) = judge(rank_positions(spun))
    assert v.kind is VerdictKind.MISSING_RANK and v.ranks == (5,), v.summary
    text = "\n".join(v.evidence)
    assert "rank 4 (host node2, pid 1004): position unknown (running, stack not read)" in text


def test_a_call_in_flight_in_the_rings_outranks_a_reading() -> None:
    calls = _chain()
    positions = rank_positions(_readings(calls))
    # rank 5's reading shows it outside NCCL, but the rings hold its call in flight
    flying = [
        replace(p, in_flight="ALL_GATHER seq 998 on 0x72") if p.world_rank == 5 else p
        for p in positions
    ]
    # every rank waits somewhere: nobody is outside, rank 5 is not a culprit
    assert [v.kind for v in judge(positions)] == [VerdictKind.MISSING_RANK]
    assert all(v.kind is not VerdictKind.MISSING_RANK for v in judge(flying))
    (p5,) = [p for p in flying if p.world_rank == 5]
    assert "ALL_GATHER seq 998 on 0x72 in flight in the rings" in position_text(p5)


def _entered_after(readings: list[HostReadings], ranks: set[int], at: int) -> list[HostReadings]:
    """The recording saw ``ranks`` enter an NCCL call at ``at``."""
    return [
        replace(hr, entered={1000 + r: at for r in ranks if any(
            p.pid == 1000 + r for s in hr.snapshots for p in s.processes)})
        for hr in readings
    ]  # fmt: skip


def test_a_reading_the_recording_shows_the_ranks_left_is_not_judged() -> None:
    """An agent's start-up reading (the job still running) in a dump taken
    later: every rank made calls after it, so where it found them is not
    where they are, and no desync is made of it."""
    calls: dict[int, NcclCall | None] = {r: _call("ncclAllReduce", 0xAA) for r in range(8)}
    calls[6] = _call("ncclBroadcast", 0xAA, root=0)  # caught at another point of the step
    readings = _readings(calls, times=(0,))
    assert judge(rank_positions(readings))  # read alone, it would be judged
    stale = _entered_after(readings, set(range(8)), 5 * S)
    assert judge(rank_positions(stale)) == [] and rank_positions(stale) == []


def test_only_the_ranks_seen_to_move_lose_their_position() -> None:
    """Rank 5 hung before the reading (no call since), the others moved on
    after it: rank 5 keeps its place; and a call entered while a process was
    being read may be the one the reading saw: it keeps its place too."""
    readings = _readings(_chain(), times=(0,))
    moved = _entered_after(readings, {0, 1, 2, 3}, 5 * S)
    kept = {p.world_rank for p in rank_positions(moved)}
    assert kept == {4, 5, 6, 7}
    twice = _readings(_chain())
    during = _entered_after(twice, set(range(8)), 500)  # within the 1000 ns it took
    assert judge(rank_positions(during)) == judge(rank_positions(twice)) != []


def test_one_reading_of_ranks_the_recording_saw_calling_is_not_judged() -> None:
    """A dump's own reading of a job whose calls were recorded up to it: one
    look catches running ranks at different points, and their recording is
    what is judged.  Read twice and unchanged, they are judged; ranks no
    call was recorded of (hung before the agent came) are judged on one."""
    once = _entered_after(_readings(_chain(), times=(0,)), set(range(8)), -1)
    assert judge(rank_positions(once)) == []
    twice = _entered_after(_readings(_chain()), set(range(8)), -1)
    assert [v.ranks for v in judge(rank_positions(twice))] == [(5,)]
    assert [v.ranks for v in judge(rank_positions(_readings(_chain(), times=(0,))))] == [(5,)]

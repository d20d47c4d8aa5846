"""Each communicator's stall bound (recorder.stallbound) on hand-fed
durations: the floor, the rhythm and its multiple, warm-up, pauses survived,
the ceiling; each constant against its derivation, so that a change by 2x fails."""

from __future__ import annotations

import math

import numpy as np
import pytest

from stallwatch.dumpers.model import TriggerKind
from stallwatch.dumpers.schema import Op
from stallwatch.recorder import stallbound as sb
from stallwatch.recorder.stallbound import StallBounds
from stallwatch.recorder.tickstate import CommProgress, InflightCall, ProcessState, TickState
from stallwatch.recorder.watchdog import Watchdog

S = 1_000_000_000
MS = 1_000_000
HASH = 0xC0FF_EE00_0000_0001
CEILING = 60 * S


def feed_rhythm(b: StallBounds, n: int, every_ns: int, duration_ns: int, start: int = S) -> int:
    """``n`` calls of communicator HASH from pid 1, one every ``every_ns``;
    returns the time of the last return."""
    t = start
    for _ in range(n):
        b.returned(HASH, 1, t, t + duration_ns)
        t += every_ns
    return t - every_ns + duration_ns


def tick(now: int, entered: int, last: int, pid: int = 1, comm_hash: int = HASH) -> TickState:
    call = InflightCall(pid, pid, comm_hash, int(Op.ALL_REDUCE), 99, entered)
    comm = CommProgress(pid, 0x1000, comm_hash, 0, 2, last, last, 100, 1, False)
    return TickState(now, (call,), (comm,), (ProcessState(pid, True, True),))


# ---- the constants, against their derivations ----------------------------------------


def test_the_floor_lies_between_tcps_recovery_and_the_promise() -> None:
    # the kernel counts a path healthy until the 4th RTO_MIN backoff: 3 s
    assert abs(sb.TCP_SUSPECT_S - 3.0) < 1e-9
    # a floor half as large would call the kernel's own recovery a stall; one
    # twice as large leaves no time for the verdict within the 10 s promised
    assert sb.TCP_SUSPECT_S <= sb.DEFAULT_FLOOR_S < 2 * sb.TCP_SUSPECT_S
    assert sb.DEFAULT_FLOOR_S + 3.0 <= 10.0 < 2 * sb.DEFAULT_FLOOR_S + 3.0


def test_the_multiple_keeps_false_stalls_to_one_a_year() -> None:
    """With an exponential tail a call outlasts k x the longest of n with
    chance n^-k: at the multiple's k, a year of calls makes one false stall."""
    for rate, n in ((100.0, 64), (1.0, 64), (10.0, 8), (0.1, 32)):
        span = int((n - 1) / rate * S)
        k = sb.rhythm_multiple(n, span)
        expected = rate * sb.YEAR_S * n ** (-k)
        assert expected == pytest.approx(sb.FALSE_STALLS_PER_YEAR, rel=1e-6)
    assert math.isinf(sb.rhythm_multiple(1, S))  # one duration: no rhythm
    # the bound hardly depends on the window: m ln(calls a year) either way
    k64 = sb.rhythm_multiple(64, int(63 / 100 * S)) * math.log(64)
    k16 = sb.rhythm_multiple(16, int(15 / 100 * S)) * math.log(16)
    assert k64 == pytest.approx(k16, rel=1e-6)


def test_false_stalls_on_an_exponential_rhythm_are_as_rare_as_derived() -> None:
    """Simulated: exponential durations, the longest of the last 8; the share
    of calls past k x that longest is about 8^-k (checked at a k made for
    a rate at which it can be counted: 20,000 calls a year)."""
    rng = np.random.default_rng(46)
    n = 8
    k = math.log(20_000 / sb.FALSE_STALLS_PER_YEAR) / math.log(n)
    x = rng.exponential(1.0, 400_000)
    windows = np.lib.stride_tricks.sliding_window_view(x[:-1], n).max(axis=1)
    share = float(np.mean(x[n:] > k * windows))
    assert share < 2 * n ** (-k) * 20  # the approximation (max ~ m ln n) is rough:
    assert share > n ** (-k) / 20  # within an order of magnitude or so either way


def test_the_rhythm_follows_a_change_after_recent_calls() -> None:
    b = StallBounds(CEILING)
    t = feed_rhythm(b, sb.RECENT_CALLS, 100 * MS, 3 * S // 10)  # slow: 300 ms calls
    t = feed_rhythm(b, sb.RECENT_CALLS - 1, 10 * MS, MS, start=t + 10 * MS)
    assert b.bound(HASH, 1).longest_ns == 3 * S // 10  # one slow call still in the window
    feed_rhythm(b, 1, 10 * MS, MS, start=t + 10 * MS)
    assert b.bound(HASH, 1).longest_ns == MS  # RECENT_CALLS fast calls: followed


def test_the_pause_margin_covers_the_same_pause_and_no_more_than_twice_it() -> None:
    b = StallBounds(CEILING)
    t = feed_rhythm(b, 200, 10 * MS, MS)
    b.returned(HASH, 1, t + 10 * MS, t + 10 * MS + 20 * S)  # a checkpoint's barrier: 20 s
    bound = b.bound(HASH, 1)
    assert (bound.set_by, bound.pause_ns, bound.ns) == ("pause", 20 * S, 40 * S)
    now = t + 100 * S
    assert not b.judge(tick(now + 39 * S, now, now))
    assert b.judge(tick(now + 41 * S, now, now))


# ---- the rules ----------------------------------------------------------------------


def test_a_fast_communicator_stalls_at_the_floor() -> None:
    b = StallBounds(CEILING)
    t = feed_rhythm(b, 100, 10 * MS, 2 * MS)
    bound = b.bound(HASH, 1)
    assert bound.set_by == "floor" and bound.ns == 5 * S
    assert bound.rhythm_ns is not None and bound.rhythm_ns < S
    assert not b.judge(tick(t + 5 * S, t, t))
    [stall] = b.judge(tick(t + 5 * S + MS, t, t))
    assert stall.since_ns == t and stall.bound.set_by == "floor"


def test_a_slow_communicator_stalls_at_its_rhythm() -> None:
    b = StallBounds(CEILING)
    feed_rhythm(b, 64, 3 * S, 2 * S)  # 2 s calls, one every 3 s
    bound = b.bound(HASH, 1)
    k = sb.rhythm_multiple(64, 63 * 3 * S)
    assert bound.set_by in ("rhythm", "ceiling")
    assert bound.ns == min(CEILING, int(k * 2 * S))
    assert bound.ns > 5 * S


def test_warm_up_is_the_ceiling_and_a_late_first_call_is_no_pause() -> None:
    b = StallBounds(CEILING)
    assert b.bound(HASH, 1).set_by == "warm-up" and b.bound(HASH, 1).ns == CEILING
    # its peers wait 20 s for a rank that started late, in the first call
    b.returned(HASH, 1, S, 21 * S)
    assert b.bound(HASH, 1).ns == CEILING  # one duration: no rhythm yet
    t = feed_rhythm(b, 10, 10 * MS, MS, start=22 * S)
    # the 20 s call is the longest of the window: the bound stays high ...
    assert b.bound(HASH, 1).ns == CEILING
    t = feed_rhythm(b, sb.RECENT_CALLS, 10 * MS, MS, start=t + 10 * MS)
    # ... until it leaves it, and it was never a pause
    assert b.bound(HASH, 1).set_by == "floor" and b.bound(HASH, 1).pause_ns is None


def test_progress_anywhere_on_the_node_holds_the_stall_back() -> None:
    b = StallBounds(CEILING)
    t = feed_rhythm(b, 100, 10 * MS, MS)
    # pid 1 waits since t; pid 2, a local member of the same communicator, moved at t + 4 s
    call = InflightCall(1, 1, HASH, int(Op.ALL_REDUCE), 99, t)
    comms = (
        CommProgress(1, 0x1000, HASH, 0, 2, t, t - MS, 100, 1, False),
        CommProgress(2, 0x2000, HASH, 1, 2, t + 4 * S, t + 4 * S, 100, 0, False),
    )
    procs = (ProcessState(1, True, True), ProcessState(2, True, True))
    assert not b.judge(TickState(t + 6 * S, (call,), comms, procs))
    [stall] = b.judge(TickState(t + 9 * S + MS, (call,), comms, procs))
    assert stall.since_ns == t + 4 * S


def test_a_call_without_a_communicator_takes_its_process_largest_bound() -> None:
    b = StallBounds(CEILING)
    t = feed_rhythm(b, 100, 10 * MS, MS)
    b.returned(HASH, 1, t, t + 12 * S)  # a pause survived: 24 s
    group = InflightCall(1, 1, 0, int(Op.GROUP_END), 0, t + 20 * S)
    procs = (ProcessState(1, True, True),)
    assert not b.judge(TickState(t + 40 * S, (group,), (), procs))
    [stall] = b.judge(TickState(t + 44 * S + MS, (group,), (), procs))
    assert stall.bound.set_by == "pause"
    # a process with no rhythm at all: the ceiling
    other = InflightCall(9, 9, 0, int(Op.GROUP_END), 0, S)
    assert not b.judge(TickState(60 * S, (other,), (), (ProcessState(9, True, True),)))


def test_the_ceiling_caps_every_bound_and_a_floor_above_it() -> None:
    b = StallBounds(3 * S)
    assert b.floor_ns == 3 * S
    feed_rhythm(b, 64, 3 * S, 2 * S)
    assert b.bound(HASH, 1).ns == 3 * S and b.bound(HASH, 1).set_by == "ceiling"


def test_processes_that_ended_are_forgotten() -> None:
    b = StallBounds(CEILING)
    feed_rhythm(b, 100, 10 * MS, MS)
    b.forget({2})
    assert b.bound(HASH, 1).set_by == "warm-up"


def test_feed_reads_settled_rows() -> None:
    from stallwatch.dumpers.schema import RING_DTYPES

    rows = np.zeros(3, dtype=RING_DTYPES["nccl"])
    rows["op"] = [int(Op.ALL_REDUCE), int(Op.ALL_REDUCE), int(Op.COMM_INIT_RANK)]
    rows["comm_hash"] = np.uint64(HASH)
    rows["pid"] = 1
    rows["ts_ns"] = [S, 2 * S, 3 * S]
    rows["end_ns"] = [S + MS, 2 * S + 2 * MS, 4 * S]
    b = StallBounds(CEILING)
    b.feed(rows)
    bound = b.bound(HASH, 1)
    assert bound.calls == 2 and bound.longest_ns == 2 * MS  # the init is no duration


def device_rows(n: int, every_ns: int, queue_ns: int, start: int = S) -> np.ndarray:
    """``n`` asynchronous calls of communicator HASH from pid 1: each returns
    at once and completes on the device ``queue_ns`` after its entry."""
    from stallwatch.dumpers.schema import RING_DTYPES

    rows = np.zeros(n, dtype=RING_DTYPES["nccl"])
    rows["op"] = int(Op.ALL_REDUCE)
    rows["comm_hash"], rows["comm"], rows["pid"], rows["tid"] = np.uint64(HASH), 0x1000, 1, 1
    rows["seq"] = np.arange(n)
    rows["ts_ns"] = start + np.arange(n, dtype=np.int64) * every_ns
    rows["end_ns"] = rows["ts_ns"] + 20_000
    rows["completed_ns"] = rows["ts_ns"] + queue_ns
    return rows


def test_durations_of_work_on_a_device_run_to_its_completion() -> None:
    b = StallBounds(CEILING)
    b.feed(device_rows(100, 100 * MS, 40 * MS))
    assert b.bound(HASH, 1).longest_ns == 40 * MS  # not the 20 us the host took


def test_queued_calls_are_the_oldest_of_each_stream_the_device_completes() -> None:
    rows = device_rows(6, 10 * MS, 0)
    rows["completed_ns"] = [S, 0, 0, 0, 0, 0]  # the first completed; the rest wait
    rows["end_ns"][5] = 0  # still in the host's call: the in-flight rule's
    rows["comm"][3:] = 0x2000  # a second communicator, whose stream is not timed on the device
    on_device = {(1, 0x1000)}
    [call] = sb.queued_calls(rows, lambda pid, comm: (pid, comm) in on_device)
    assert call.queued and call.seq == 1 and call.entered_ns == int(rows["ts_ns"][1])
    on_device.add((1, 0x2000))
    assert [c.seq for c in sb.queued_calls(rows, lambda p, c: (p, c) in on_device)] == [1, 3]


def test_work_queued_on_a_device_stalls_at_its_bound_and_completions_hold_it_back() -> None:
    b = StallBounds(CEILING)
    rows = device_rows(100, 100 * MS, 40 * MS)
    b.feed(rows)
    t = int(rows["ts_ns"][-1]) + 100 * MS  # the next call: returned at once, never completed
    queued = InflightCall(1, 1, HASH, int(Op.ALL_REDUCE), 100, t, queued=True)
    comm = CommProgress(1, 0x1000, HASH, 0, 2, t, t + 20_000, 101, 0, False)
    state = lambda now: TickState(now, (queued,), (comm,), (ProcessState(1, True, True),))  # noqa: E731
    assert not b.judge(state(t + 5 * S))
    [stall] = b.judge(state(t + 5 * S + MS))
    assert stall.bound.set_by == "floor" and stall.call.queued
    # another local member's call on it completed on the device 3 s later:
    # progress (the member's entry is not in the tick: only the completion says so)
    other = device_rows(1, 0, 40 * MS, start=t + 3 * S - 40 * MS)
    other["pid"], other["seq"] = 2, 100
    b.feed(other)
    assert b.bound(HASH, 1).set_by == "floor"
    assert not b.judge(state(t + 5 * S + MS))
    [stall] = b.judge(state(t + 8 * S + MS))
    assert stall.since_ns == t + 3 * S


# ---- in the watchdog ----------------------------------------------------------------


def test_the_watchdog_raises_at_the_bound_and_says_what_set_it() -> None:
    b = StallBounds(CEILING)
    t = feed_rhythm(b, 100, 10 * MS, MS)
    wd = Watchdog(CEILING, "node-1", bounds=b, wall_clock=lambda: 1_790_000_000 * S)
    assert not wd.check(tick(t + 5 * S - MS, t, t))
    [trig] = wd.check(tick(t + 5 * S + MS, t, t))
    assert trig.kind is TriggerKind.IN_FLIGHT
    assert "bound 5 s, set by the floor" in trig.reason
    assert "rhythm" in trig.reason and "ceiling 60 s" in trig.reason


def test_the_watchdog_says_a_stalled_call_waits_on_the_device() -> None:
    b = StallBounds(CEILING)
    b.feed(device_rows(100, 100 * MS, 40 * MS))
    t = 20 * S
    queued = InflightCall(1, 1, HASH, int(Op.ALL_REDUCE), 100, t, queued=True)
    comm = CommProgress(1, 0x1000, HASH, 0, 2, t, t, 101, 0, False)
    wd = Watchdog(CEILING, "node-1", bounds=b, wall_clock=lambda: 1_790_000_000 * S)
    procs = (ProcessState(1, True, True),)
    [trig] = wd.check(TickState(t + 5 * S + MS, (queued,), (comm,), procs))
    assert trig.kind is TriggerKind.IN_FLIGHT
    assert "queued on its stream, not completed by the device, for 5.0 s" in trig.reason


def test_the_lab_waits_for_the_agents_own_ceiling() -> None:
    """A lab run with the agents as deployed waits for their dumps as long as
    their own ceiling: it kills no job they have not yet raised."""
    import argparse

    from stallwatch.commands import record
    from stallwatch.lab import runner

    parser = argparse.ArgumentParser()
    record.register(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["record"]).stall_timeout == sb.DEFAULT_CEILING_S
    assert runner.AGENT_CEILING_S == sb.DEFAULT_CEILING_S

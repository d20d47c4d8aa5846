"""An agent that starts after the job hung: the calls its start-up reading
finds blocked are in flight for the watchdog (recorder.positions), and leave
as soon as they are seen to move."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from stallwatch.dumpers.model import TriggerKind
from stallwatch.lab import build
from stallwatch.recorder.positions import RECHECK_S, PositionKeeper
from stallwatch.recorder.tickstate import CommProgress, TickState
from stallwatch.recorder.watchdog import Watchdog
from tests.recorder.test_threads import HUNG, NRANKS, _hung

S = 1_000_000_000


def _progress(pid: int, entered: int) -> CommProgress:
    return CommProgress(pid, 0x10, 0xAB, 0, 2, entered, 0, 1, 1, False)


@pytest.mark.lab
def test_calls_blocked_before_the_agent_are_stalls_until_they_move(tmp_path: Path) -> None:
    job = _hung(tmp_path, build.ensure_built())
    try:
        pids = sorted(job.pids.values())
        keeper = PositionKeeper(lambda: pids, stall_timeout_ns=2 * S)
        start = keeper.take_startup()
        assert start.reason == "startup" and {p.pid for p in start.processes} == set(pids)
        t0 = start.taken_ns
        calls = keeper.inflight(t0 + S, [])
        waiting = {r: pid for r, pid in job.pids.items() if r != HUNG}
        assert {c.pid for c in calls} == set(waiting.values()) and len(calls) == NRANKS - 1
        assert all(c.entered_ns == min(p.taken_ns for p in start.processes if p.pid == c.pid)
                   for c in calls)  # fmt: skip

        watchdog = Watchdog(2 * S, "n0")
        assert watchdog.check(TickState(t0 + S, tuple(calls), (), ())) == []  # not yet
        later = keeper.inflight(t0 + 3 * S, [])  # re-read near the timeout: still there
        triggers = watchdog.check(TickState(t0 + 3 * S, tuple(later), (), ()))
        assert [t.kind for t in triggers] == [TriggerKind.IN_FLIGHT]
        assert "since before the agent started" in triggers[0].reason
        assert "ALL_GATHER" in triggers[0].reason

        moved = waiting[0]  # a recorded call of this process: it progressed
        since = next(c.entered_ns for c in calls if c.pid == moved)
        left = keeper.inflight(t0 + 3 * S, [_progress(moved, since + 1)])
        assert {c.pid for c in left} == set(waiting.values()) - {moved}

        gone = waiting[2]
        job.procs[2].kill()
        job.procs[2].wait()
        after = keeper.inflight(t0 + 4 * S + int(RECHECK_S * S), [])
        assert {c.pid for c in after} == set(waiting.values()) - {moved, gone}
    finally:
        job.stop()


def test_nothing_blocked_at_start_up_is_nothing_in_flight() -> None:
    keeper = PositionKeeper(list, stall_timeout_ns=S)
    snap = keeper.take_startup()
    assert snap.processes == () and keeper.inflight(snap.taken_ns + 10 * S, []) == []


def test_a_reading_asked_for_during_start_up_waits_for_the_start_up_reading() -> None:
    """The HTTP surface answers before the agent's first discovery: a series
    asked for then is taken after the start-up reading, once the processes
    are known (before, its first reading read none, and a late agent's
    readings spanned 0.9 s: too short to call a wait a stall)."""
    known: list[int] = []
    keeper = PositionKeeper(lambda: list(known), stall_timeout_ns=S)
    taken: list[list[object]] = []
    asker = threading.Thread(target=lambda: taken.append(keeper.take_series(2, 0.0, "request")))
    asker.start()
    asker.join(0.3)
    assert asker.is_alive() and not taken  # waiting for the start-up reading
    known.append(os.getpid())
    start = keeper.take_startup()
    asker.join(10)
    (series,) = taken
    assert all(r.taken_ns >= start.taken_ns and r.processes for r in series)  # type: ignore[attr-defined]

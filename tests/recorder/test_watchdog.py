"""The watchdog's rules on hand-built TickStates, the dump scheduler's retries
(fakes, then a real tmpfs), incidents shared between peers, the peers client."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from stallwatch.dumpers.errors import DumpWriteError, UsageError
from stallwatch.dumpers.format import read_dump, write_dump
from stallwatch.dumpers.model import Recording, Trigger, TriggerKind
from stallwatch.dumpers.schema import Op
from stallwatch.recorder import peers as peers_mod
from stallwatch.recorder.tickstate import CommProgress, InflightCall, ProcessState, TickState
from stallwatch.recorder.watchdog import (
    DumpScheduler,
    Incidents,
    Status,
    Watchdog,
    default_cooldown_ns,
    new_incident_id,
)
from tests.dump_samples import remount, sample_recording, tmpfs

S = 1_000_000_000
TIMEOUT = 2 * S
HASH = 0xF00D_0000_0000_BEEF
WALL = 1_790_000_000 * S  # 2026-09-21T14:13:20Z


# ---------------------------------------------------------------- a small world


def comm(
    pid: int,
    last: int,
    calls: int = 10,
    destroyed: bool = False,
    comm_hash: int = HASH,
    inflight: int = 0,
) -> CommProgress:
    return CommProgress(
        pid=pid,
        comm=0x1000 + pid,
        comm_hash=comm_hash,
        rank=pid % 10,
        nranks=2,
        last_enter_ns=last,
        last_return_ns=last,
        calls=calls,
        inflight=inflight,
        destroyed=destroyed,
    )


def proc(
    pid: int,
    alive: bool = True,
    holds: bool = True,
    code: int | None = None,
    signal: int | None = None,
    exit_ns: int = 0,
) -> ProcessState:
    return ProcessState(pid, alive, holds, code, signal, exit_ns)


def call(pid: int, entered: int, seq: int = 57) -> InflightCall:
    return InflightCall(
        pid=pid, tid=pid, comm_hash=HASH, op=Op.ALL_REDUCE, seq=seq, entered_ns=entered
    )


def state(now: float, inflight=(), comms=(), procs=()) -> TickState:  # type: ignore[no-untyped-def]
    return TickState(int(now * S), tuple(inflight), tuple(comms), tuple(procs))


def healthy(now: float, pids: tuple[int, ...] = (1, 2)) -> TickState:
    """Ranks calling collectives every 100 ms, the last one just returned."""
    last = int(now * S) - S // 10
    return state(now, comms=[comm(p, last) for p in pids], procs=[proc(p) for p in pids])


def watchdog(**kw: int) -> Watchdog:
    return Watchdog(TIMEOUT, "node-1", clock=lambda: 0, **kw)


def run(wd: Watchdog, states: list[TickState]) -> list[Trigger]:
    return [t for s in states for t in wd.check(s)]


# ---------------------------------------------------------------- triggers


def test_in_flight_longer_than_the_timeout() -> None:
    wd = watchdog()
    procs = [proc(1), proc(2)]
    entered = 10 * S
    early = state(11.9, [call(1, entered)], [comm(1, entered, inflight=1)], procs)
    assert wd.check(early) == []
    [trig] = wd.check(state(12.1, [call(1, entered)], [comm(1, entered, inflight=1)], procs))
    assert trig.kind == TriggerKind.IN_FLIGHT
    assert (trig.pid, trig.comm_hash, trig.origin_host) == (1, HASH, "node-1")
    assert "ALL_REDUCE seq 57" in trig.reason and "in flight for 2.1 s" in trig.reason
    assert trig.time_ns == int(12.1 * S)


def test_async_hang_no_progress_while_alive() -> None:
    """Healthy ranks are not in a call: they simply stop making progress."""
    wd = watchdog()
    last = 10 * S
    comms = [comm(1, last), comm(2, last)]
    procs = [proc(1), proc(2)]
    assert wd.check(state(11.5, comms=comms, procs=procs)) == []
    [trig] = wd.check(state(12.2, comms=comms, procs=procs))
    assert trig.kind == TriggerKind.NO_PROGRESS and trig.pid in (1, 2)
    assert "no progress for 2.2 s" in trig.reason


def test_a_communicator_made_before_the_agent_is_named_unknown() -> None:
    """A late agent never saw the communicator made: its id is unknown (0 in
    the recording), and the reason says so instead of printing 0 as an id."""
    wd = watchdog()
    last = 10 * S
    procs = [proc(1)]
    [trig] = wd.check(state(12.2, comms=[comm(1, last, comm_hash=0)], procs=procs))
    assert "made before the agent started (id unknown)" in trig.reason
    assert "0x0000000000000000" not in trig.reason


def test_abnormal_exits_trigger() -> None:
    for code, signal, words in (
        (1, None, "exited with code 1"),
        (None, 9, "signal 9"),
        (0, 6, "signal 6"),
    ):
        wd = watchdog()
        dead = proc(2, alive=False, code=code, signal=signal, exit_ns=5 * S)
        [trig] = wd.check(state(5.1, comms=[comm(1, 5 * S)], procs=[proc(1), dead]))
        assert trig.kind == TriggerKind.EXIT and trig.pid == 2 and words in trig.reason


def test_exit_has_priority_over_a_stall_in_the_same_tick() -> None:
    wd = watchdog()
    dead = proc(2, alive=False, code=3, exit_ns=5 * S)
    [trig] = wd.check(state(13, [call(1, 10 * S)], [comm(1, 10 * S)], [proc(1), dead]))
    assert trig.kind == TriggerKind.EXIT


# ---------------------------------------------------------------- no false alarms


def test_healthy_job_never_triggers() -> None:
    wd = watchdog()
    assert run(wd, [healthy(t / 10) for t in range(10, 600)]) == []


def test_normal_end_destroy_and_exit_zero() -> None:
    wd = watchdog()
    last = 10 * S
    ended = [
        # communicators destroyed, processes linger for long
        state(20, comms=[comm(1, last, destroyed=True)], procs=[proc(1)]),
        # processes exited 0 (still holding communicators, never destroyed)
        state(30, comms=[comm(2, last)], procs=[proc(2, alive=False, code=0, exit_ns=11 * S)]),
        # exited without any code or signal seen: not judged
        state(31, comms=[comm(3, last)], procs=[proc(3, alive=False, exit_ns=11 * S)]),
        # a process holding no communicator dies badly
        state(32, procs=[proc(4, alive=False, holds=False, code=1, exit_ns=31 * S)]),
    ]
    assert run(wd, ended) == []


def test_idle_shorter_than_the_timeout_and_never_started() -> None:
    wd = watchdog()
    last = 10 * S
    ticks = [state(10 + t / 10, comms=[comm(1, last)], procs=[proc(1)]) for t in range(20)]
    ticks += [state(10 + t, comms=[comm(2, 0, calls=0)], procs=[proc(2)]) for t in range(100)]
    # a call returned 1.9 s after it entered: slow, not stuck
    ticks += [
        state(40 + t / 10, [call(3, 40 * S)], [comm(3, 40 * S)], [proc(3)]) for t in range(20)
    ]
    assert run(wd, ticks) == []


def test_an_idle_split_communicator_beside_a_busy_one() -> None:
    wd = watchdog()
    ticks = []
    for t in range(10, 100):
        now = t * S
        busy = comm(1, now - S // 10)
        idle = comm(1, 5 * S, comm_hash=0xABC)  # used once, long ago
        ticks.append(state(t, comms=[busy, idle], procs=[proc(1)]))
    assert run(wd, ticks) == []


def test_unknown_or_dead_process_is_not_judged_for_progress() -> None:
    wd = watchdog()
    ticks = [
        state(20, comms=[comm(1, 10 * S)], procs=[]),
        state(21, [call(2, 10 * S)], [comm(2, 10 * S)], [proc(2, alive=False, code=0)]),
    ]
    assert run(wd, ticks) == []


# ---------------------------------------------------------------- episodes, cool-down


def test_one_incident_per_episode() -> None:
    wd = watchdog(cooldown_ns=5 * S)
    entered = 10 * S
    stuck = [
        state(12 + t / 10, [call(1, entered)], [comm(1, entered)], [proc(1)]) for t in range(1, 200)
    ]  # 20 s stuck: beyond the cool-down too
    assert len(run(wd, stuck)) == 1
    assert wd.stats.stalls_detected == 1


def test_new_episode_after_progress_resumes_and_cooldown_expires() -> None:
    wd = watchdog(cooldown_ns=10 * S)  # incident at 13 s: cool-down until 23 s
    assert len(wd.check(state(13, [call(1, 10 * S)], [comm(1, 10 * S)], [proc(1)]))) == 1
    assert run(wd, [healthy(t) for t in (14, 15, 16)]) == []
    # stuck again during the cool-down: counted, never raised, even once it expires
    again = [
        state(t, [call(1, 16 * S, seq=90)], [comm(1, 16 * S)], [proc(1)]) for t in (18.5, 19, 25)
    ]
    assert run(wd, again) == [] and wd.stats.suppressed == 1
    assert run(wd, [healthy(t) for t in (26, 27)]) == []
    [trig] = run(
        wd,
        [state(t, [call(1, 27 * S, seq=99)], [comm(1, 27 * S)], [proc(1)]) for t in (28, 29.5, 30)],
    )
    assert "seq 99" in trig.reason and trig.time_ns == int(29.5 * S)


def test_every_stuck_rank_of_a_node_is_one_incident() -> None:
    wd = watchdog()
    procs = [proc(p) for p in (1, 2, 3, 4)]
    ticks = [
        state(
            12 + t / 10,
            [call(p, 10 * S + p * S // 20) for p in (1, 2, 3, 4)],
            [comm(p, 10 * S) for p in (1, 2, 3, 4)],
            procs,
        )
        for t in range(1, 30)
    ]
    assert len(run(wd, ticks)) == 1


def test_default_cooldown() -> None:
    assert default_cooldown_ns(2 * S) == 300 * S
    assert default_cooldown_ns(600 * S) == 1200 * S
    assert Watchdog(TIMEOUT, "h").cooldown_ns == 300 * S
    with pytest.raises(ValueError, match="stall timeout must be positive"):
        Watchdog(0, "h")


# ---------------------------------------------------------------- requests and peers


def test_incident_ids_are_unique_url_safe_and_sorted_by_time() -> None:
    ids = {new_incident_id("gpu node/7.example.com", 1_790_000_000 * S) for _ in range(500)}
    assert len(ids) == 500
    for incident in ids:
        assert re.fullmatch(r"20260921T\d{9}-gpu-node-7-examp-[0-9a-f]{6}", incident), incident
    assert new_incident_id("b", 1_790_000_000 * S) < new_incident_id("a", 1_790_000_001 * S)


def test_manual_requests_bypass_the_cooldown() -> None:
    wd = watchdog()
    [auto] = wd.check(state(13, [call(1, 10 * S)], [comm(1, 10 * S)], [proc(1)]))
    manual = wd.request(TriggerKind.MANUAL, "loss spike at step 1200")
    assert manual is not None and manual.kind == TriggerKind.MANUAL
    assert manual.incident_id != auto.incident_id and manual.origin_host == "node-1"
    again = wd.request(TriggerKind.MANUAL, "again")
    assert again is not None and again.incident_id not in (manual.incident_id, auto.incident_id)


def test_peer_request_shares_the_id_and_duplicates_are_refused() -> None:
    clock = [100 * S]
    wd = Watchdog(TIMEOUT, "node-2", clock=lambda: clock[0])
    trig = wd.request(
        TriggerKind.PEER, "node-1: stuck", "20261122T021500000-node-1-abcdef", "node-1"
    )
    assert trig is not None and trig.kind == TriggerKind.PEER
    assert (trig.incident_id, trig.origin_host) == ("20261122T021500000-node-1-abcdef", "node-1")
    clock[0] += 20 * S  # past the merge window
    dup = wd.decide(TriggerKind.PEER, "again", trig.incident_id, "node-3")
    assert (dup.trigger, dup.status, dup.incident_id) == (None, Status.DUPLICATE, trig.incident_id)
    # this node's own detection of the same hang, moments later: part of the incident
    assert wd.check(state(120, [call(5, 100 * S)], [comm(5, 100 * S)], [proc(5)])) == []
    # another peer's new incident, later in the cool-down: refused
    late = wd.decide(TriggerKind.PEER, "x", "20261122T021600000-node-4-000000", "node-4")
    assert (late.trigger, late.status) == (None, Status.COOLDOWN)


def test_simultaneous_detections_converge_on_the_earlier_id() -> None:
    early, late = "20261122T021500000-node-1-aaaaaa", "20261122T021500120-node-2-bbbbbb"
    clock = [50 * S]
    wd = Watchdog(TIMEOUT, "node-2", clock=lambda: clock[0])
    own = wd.request(TriggerKind.PEER, "node-2's view", late, "node-2")  # as if detected here
    assert own is not None
    clock[0] += S // 10
    merge = wd.decide(TriggerKind.PEER, "node-1: stuck", early, "node-1")
    assert merge.replaces == late and merge.trigger is not None
    assert merge.trigger.incident_id == early and merge.incident_id == early
    # the later id now answers duplicate, as does the earlier one
    assert wd.decide(TriggerKind.PEER, "x", late, "node-3").status == Status.DUPLICATE
    assert wd.decide(TriggerKind.PEER, "x", early, "node-3").status == Status.DUPLICATE
    # a node holding the earlier id answers duplicate to the later one
    wd1 = Watchdog(TIMEOUT, "node-1", clock=lambda: clock[0])
    wd1.request(TriggerKind.PEER, "own", early, "node-1")
    answer = wd1.decide(TriggerKind.PEER, "node-2: stuck", late, "node-2")
    assert (answer.trigger, answer.status, answer.incident_id) == (None, Status.DUPLICATE, early)


def test_a_named_peer_incident_right_after_a_stall_is_not_merged_into_it() -> None:
    """A crash incident here, then within the merge window a peer's named
    incident (the lab's end-of-run dump, asked of the peer first): not taken
    for a later id of the same stall (a name sorts after every timestamp),
    so the client's own request for it here is dumped, not refused as a
    duplicate (a CI run lost node 0's end-of-run dump so)."""
    clock = [50 * S]
    wd = Watchdog(TIMEOUT, "node-0", clock=lambda: clock[0])
    crash = wd.request(TriggerKind.PEER, "node-1: exited", "20261208T003740634-node-1-a5654b", "n1")
    assert crash is not None
    clock[0] += 2 * S  # inside the merge window
    peer = wd.decide(TriggerKind.PEER, "node-1: end of run", "lab-t50071e-end", "node-1")
    assert peer.status != Status.DUPLICATE and peer.replaces is None
    # a watchdog's id of the same moment still merges (the earlier one kept)
    later = wd.decide(TriggerKind.PEER, "node-2: stuck", "20261208T003741000-node-2-cccccc", "n2")
    assert (later.status, later.incident_id) == (Status.DUPLICATE, crash.incident_id)
    mine = wd.decide(TriggerKind.MANUAL, "end of lab run", "lab-t50071e-end")
    assert mine.trigger is not None and mine.trigger.incident_id == "lab-t50071e-end"
    # and a stall id right after the named incident is not merged into it
    # (the cool-down holds it back; nothing is relabelled)
    after = wd.decide(TriggerKind.PEER, "node-3: stuck", "20261208T003743100-node-3-dddddd", "n3")
    assert (after.trigger, after.status, after.replaces) == (None, Status.COOLDOWN, None)


# ---------------------------------------------------------------- scheduler (fakes)


class FlakyDisk:
    """A write callable that fails while ``full`` is set."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.full = False
        self.calls = 0

    def __call__(self, rec: Recording) -> Path:
        self.calls += 1
        if self.full:
            raise DumpWriteError(f"{self.folder}/x.msgpack: cannot write dump: No space left")
        return write_dump(self.folder, rec)


def scheduler(
    folder: Path,
    clock: list[int],
    disk: FlakyDisk | None = None,
    snapshots: list[int] | None = None,
) -> DumpScheduler:
    taken = snapshots if snapshots is not None else []

    def snapshot() -> Recording:
        taken.append(clock[0])
        return sample_recording(50, incident="replaced")

    return DumpScheduler(
        snapshot,
        disk or FlakyDisk(folder),
        read=read_dump,
        clock=lambda: clock[0],
        backoff_ns=(S, 8 * S),
    )


def trigger(incident: str = "inc-1") -> Trigger:
    return Trigger(TriggerKind.IN_FLIGHT, "stuck", incident, 7 * S, 1, HASH, "node-1")


def test_scheduler_writes_once_with_the_trigger(tmp_path: Path) -> None:
    sched = scheduler(tmp_path, [0])
    outcome = sched.submit(trigger())
    assert outcome.status == Status.WRITTEN and outcome.path is not None
    back = read_dump(outcome.path)
    assert back.trigger == trigger()
    assert "inc-1" in outcome.path.name
    assert sched.stats.dumps_written == 1 and sched.pending == 0


def test_scheduler_retries_the_trigger_time_snapshot_with_backoff(tmp_path: Path) -> None:
    clock = [0]
    disk = FlakyDisk(tmp_path)
    snaps: list[int] = []
    sched = scheduler(tmp_path, clock, disk, snaps)
    disk.full = True
    assert sched.submit(trigger()).status == Status.QUEUED
    attempts_at = []
    for t in range(40):
        clock[0] = t * S
        before = disk.calls
        sched.retry_due()
        if disk.calls > before:
            attempts_at.append(t)
    assert attempts_at == [1, 3, 7, 15, 23, 31, 39]  # 1, 2, 4, 8, then capped at 8 s
    assert sched.stats.write_failures == 8 and sched.pending == 1
    disk.full = False
    clock[0] = 60 * S
    [path] = sched.retry_due()
    assert snaps == [0]  # never re-snapshotted
    assert read_dump(path).trigger == trigger()
    assert sched.pending == 0 and sched.stats.dumps_written == 1
    assert list(tmp_path.iterdir()) == [path]


def test_scheduler_bounds_pending_snapshots(tmp_path: Path) -> None:
    disk = FlakyDisk(tmp_path)
    disk.full = True
    sched = scheduler(tmp_path, [0], disk)
    for i in range(6):
        sched.submit(trigger(f"inc-{i}"))
    assert sched.pending == 4 and sched.stats.dumps_dropped == 2


def _manual(incident: str) -> Trigger:
    return Trigger(TriggerKind.MANUAL, "by hand", incident, 7 * S, origin_host="node-1")


def test_a_full_disk_keeps_the_incident_and_says_what_it_did_not_keep(tmp_path: Path) -> None:
    """The disk is full: the watchdog's incident and three requests wait
    (four at most); a fifth request is refused, not queued (its client was
    told "queued" and later lost it, and the incident was dropped for it);
    a second incident displaces the oldest request, whose outcome says so."""
    disk = FlakyDisk(tmp_path)
    disk.full = True
    clock = [0]
    sched = scheduler(tmp_path, clock, disk)
    assert sched.submit(trigger("stall")).status == Status.QUEUED
    for i in range(3):
        assert sched.submit(_manual(f"asked-{i}")).status == Status.QUEUED
    refused = sched.submit(_manual("asked-3"))
    assert refused.status == Status.FAILED and refused.path is None
    assert "No space left" in (refused.error or "") and "4 dumps already wait" in refused.error
    waiting = sched.outcome("stall")
    assert waiting.status == Status.QUEUED and "No space left" in (waiting.error or "")
    assert sched.submit(trigger("stall-2")).status == Status.QUEUED
    gone = sched.outcome("asked-0")
    assert gone.status == Status.FAILED and "displaced by incident stall-2" in (gone.error or "")
    assert sched.outcome("nobody-asked").status == Status.UNKNOWN
    disk.full = False
    clock[0] = 10 * S
    written = {p.name for p in sched.retry_due()}
    assert sched.pending == 0 and len(written) == 4
    assert sched.outcome("stall").status == Status.WRITTEN
    assert sched.stats.dumps_dropped == 2


def test_clients_dumps_are_rate_limited_not_peers_nor_signals(tmp_path: Path) -> None:
    clock = [13 * S]
    inc = incidents(tmp_path, "node-1", clock, [])
    answers = [inc.request_dump("script", by_client=True) for _ in range(5)]
    assert [a["status"] for a in answers] == ["written"] * 3 + ["rate_limited"] * 2
    assert answers[3]["retry_in_s"] == 20.0 and inc.rate_limited == 2
    # asking again about a dumped incident is no new dump: not counted
    again = inc.request_dump("again", str(answers[0]["incident_id"]), by_client=True)
    assert again["status"] == "duplicate"
    assert inc.request_dump("SIGUSR1")["status"] == "written"  # not a client
    peer = inc.request_dump("peer", "20260921T141500000-node-3-000000", "node-3", True)
    assert peer["status"] in ("written", "cooldown", "duplicate")  # the watchdog's word
    clock[0] += 20 * S
    assert inc.request_dump("later", by_client=True)["status"] == "written"
    assert inc.counters()["dump_requests_rate_limited"] == 2


def test_scheduler_drops_what_cannot_be_encoded(tmp_path: Path) -> None:
    def broken() -> Recording:
        raise RuntimeError("rings are gone")

    sched = DumpScheduler(broken, FlakyDisk(tmp_path))
    with pytest.raises(DumpWriteError, match="incident inc-1: snapshot failed: rings are gone"):
        sched.submit(trigger())
    assert sched.stats.dumps_dropped == 1 and sched.pending == 0


def test_relabel_of_a_written_dump_replaces_the_file(tmp_path: Path) -> None:
    sched = scheduler(tmp_path, [0])
    first = sched.submit(trigger("20261122T021500120-node-2-bbbbbb")).path
    assert first is not None
    peer = Trigger(
        TriggerKind.PEER,
        "node-1: stuck",
        "20261122T021500000-node-1-aaaaaa",
        0,
        origin_host="node-1",
    )
    outcome = sched.relabel("20261122T021500120-node-2-bbbbbb", peer)
    assert outcome.status == Status.WRITTEN and outcome.path is not None
    assert [p.name for p in tmp_path.iterdir()] == [outcome.path.name]
    back = read_dump(outcome.path)
    assert back.trigger is not None
    assert back.trigger.incident_id == peer.incident_id
    assert back.trigger.kind == TriggerKind.IN_FLIGHT and back.trigger.origin_host == "node-1"


def test_relabel_when_the_old_dump_is_gone_takes_a_new_snapshot(tmp_path: Path) -> None:
    snaps: list[int] = []
    sched = scheduler(tmp_path, [0], snapshots=snaps)
    first = sched.submit(trigger("b-incident")).path
    assert first is not None
    first.unlink()  # retention, or an operator
    peer = Trigger(TriggerKind.PEER, "node-1: stuck", "a-incident", 0, origin_host="node-1")
    outcome = sched.relabel("b-incident", peer)
    assert outcome.status == Status.WRITTEN and outcome.path is not None
    assert len(snaps) == 2 and read_dump(outcome.path).trigger == peer
    assert sched.paths["a-incident"] == outcome.path


def test_relabel_of_a_pending_dump_and_the_old_id_answers_with_the_new_file(
    tmp_path: Path,
) -> None:
    clock = [0]
    disk = FlakyDisk(tmp_path)
    sched = scheduler(tmp_path, clock, disk)
    disk.full = True
    assert sched.submit(trigger("b-incident")).status == Status.QUEUED
    peer = Trigger(TriggerKind.PEER, "node-1: stuck", "a-incident", 0, origin_host="node-1")
    assert sched.relabel("b-incident", peer).status == Status.QUEUED
    assert sched.pending == 1
    disk.full = False
    clock[0] = 10 * S
    [path] = sched.retry_due()
    assert sched.paths == {"a-incident": path, "b-incident": path}
    rec = read_dump(path)
    assert rec.trigger is not None and rec.trigger.incident_id == "a-incident"
    assert rec.trigger.kind == TriggerKind.IN_FLIGHT  # what this node saw, under the shared id


# ---------------------------------------------------------------- incidents facade


def incidents(folder: Path, host: str, clock: list[int], sent: list[Trigger]) -> Incidents:
    wd = Watchdog(TIMEOUT, host, clock=lambda: clock[0], wall_clock=lambda: WALL + clock[0])
    sched = DumpScheduler.for_directory(folder, lambda: sample_recording(50, host=host))
    sched.clock = lambda: clock[0]
    return Incidents(wd, sched, notify=sent.append)


def test_incidents_dump_notify_and_answer(tmp_path: Path) -> None:
    clock = [13 * S]
    sent: list[Trigger] = []
    inc = incidents(tmp_path, "node-1", clock, sent)
    [outcome] = inc.tick(state(13, [call(1, 10 * S)], [comm(1, 10 * S)], [proc(1)]))
    assert outcome.status == Status.WRITTEN and sent[0].incident_id == outcome.incident_id
    answer = inc.request_dump("peer says", outcome.incident_id, "node-2")
    assert answer == {
        "incident_id": outcome.incident_id,
        "status": "duplicate",
        "path": str(outcome.path),
    }
    manual = inc.request_dump("by hand")
    assert manual["status"] == "written" and len(sent) == 2  # manual dumps tell peers too
    clock[0] += 20 * S  # past the merge window, inside the cool-down
    peer = inc.request_dump("from node-3", "20260921T141500000-node-3-000000", "node-3")
    assert peer["status"] == "cooldown" and len(sent) == 2
    clock[0] += 300 * S  # after the cool-down: a peer's incident is dumped, never echoed
    peer = inc.request_dump("from node-3", "20260921T142000000-node-3-000000", "node-3")
    assert peer["status"] == "written" and len(sent) == 2
    counters = inc.counters()
    assert counters["dumps_written"] == 3 and counters["stalls_detected"] == 1
    assert counters["dump_requests_duplicate"] == 1 and counters["dumps_pending"] == 0
    json.dumps(answer)


def test_four_nodes_converge_on_one_incident(tmp_path: Path) -> None:
    """Nodes 0 and 1 detect the same hang at once; 2 and 3 (the culprit's)
    detect nothing.  Requests cross in every order; one id remains."""
    clock = [50 * S]
    nodes: dict[str, Incidents] = {}
    outbox: list[tuple[str, Trigger]] = []
    for n in range(4):
        host = f"node-{n}"
        (tmp_path / host).mkdir()
        sent: list[Trigger] = []
        nodes[host] = incidents(tmp_path / host, host, clock, sent)
        nodes[host].notify = lambda t, h=host: outbox.append((h, t))
    stuck = state(50, [call(1, 47 * S)], [comm(1, 47 * S)], [proc(1)])
    nodes["node-1"].tick(stuck)
    clock[0] += S // 100
    nodes["node-0"].tick(stuck)
    # deliver node-1's notifications first, then node-0's
    for origin, trig in sorted(outbox, key=lambda o: o[0], reverse=True):
        for host, node in nodes.items():
            if host != origin:
                node.request_dump(trig.reason, trig.incident_id, origin)
    ids = set()
    for host in nodes:
        [dump] = (tmp_path / host).iterdir()
        rec = read_dump(dump)
        assert rec.trigger is not None and rec.host == host
        ids.add(rec.trigger.incident_id)
    [incident] = ids
    assert incident.startswith("20260921T141410000-node-1-")  # node-1 detected first


# ---------------------------------------------------------------- scheduler on a real tmpfs


@pytest.mark.bpf
def test_disk_full_then_read_only_then_space_returns(tmp_path: Path) -> None:
    clock = [0]
    with tmpfs(tmp_path / "mnt", "2m") as mnt:
        filler = mnt / "filler.bin"
        filler.write_bytes(b"\0" * 1_900_000)
        sched = DumpScheduler.for_directory(mnt, lambda: sample_recording(2000), max_dumps=5)
        sched.clock = lambda: clock[0]
        assert sched.submit(trigger()).status == Status.QUEUED  # about 1.1 MB: no room
        remount(mnt, "ro")
        for t in range(1, 12):
            clock[0] = t * S
            assert sched.retry_due() == []
        assert sched.stats.write_failures >= 4 and sched.pending == 1
        remount(mnt, "rw")
        filler.unlink()
        clock[0] = 120 * S
        [path] = sched.retry_due()
        assert read_dump(path).trigger == trigger()
        assert [p.name for p in mnt.iterdir()] == [path.name]  # no temporary left behind


# ---------------------------------------------------------------- peers client


class _PeerHandler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        server = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server.seen.append((self.path, self.headers.get("Authorization"), body))  # type: ignore[attr-defined]
        time.sleep(server.delay)  # type: ignore[attr-defined]
        answer = json.dumps(
            {"incident_id": body["incident_id"], "status": "written", "path": "/dumps/x.msgpack"}
        ).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)
        except OSError:
            pass  # the slow peer's client gave up at its deadline: that is the test

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def peer_servers() -> Iterator[list[ThreadingHTTPServer]]:
    servers = []
    for delay in (0.3, 0.3, 3.0):
        server = ThreadingHTTPServer(("127.0.0.1", 0), _PeerHandler)
        server.seen = []  # type: ignore[attr-defined]
        server.delay = delay  # type: ignore[attr-defined]
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    yield servers
    for server in servers:
        server.shutdown()
        server.server_close()


def test_notify_peers_in_parallel_with_a_deadline(peer_servers: list[ThreadingHTTPServer]) -> None:
    addrs = [f"127.0.0.1:{s.server_address[1]}" for s in peer_servers]
    dead = "127.0.0.1:9"  # discard port: nothing listens
    start = time.monotonic()
    results = peers_mod.notify_peers(
        [*addrs, dead], "inc-9", "node-1: stuck", "node-1", "s3cret", timeout=1.0
    )
    elapsed = time.monotonic() - start
    assert elapsed < 1.5  # two 0.3 s peers in parallel, a 3 s one cut off at 1 s
    assert results[addrs[0]] == results[addrs[1]] == "written"
    assert results[addrs[2]].startswith("error:") and results[dead].startswith("error:")
    path, auth, body = peer_servers[0].seen[0]  # type: ignore[attr-defined]
    assert (path, auth) == ("/dump", "Bearer s3cret")
    assert body == {"reason": "node-1: stuck", "incident_id": "inc-9", "origin": "node-1"}


def test_notify_in_background_returns_at_once(peer_servers: list[ThreadingHTTPServer]) -> None:
    addr = f"127.0.0.1:{peer_servers[0].server_address[1]}"
    done: list[dict[str, str]] = []
    notify = peers_mod.peer_notifier([addr], "node-1", None, timeout=1.0)
    start = time.monotonic()
    thread = notify(trigger())
    assert time.monotonic() - start < 0.1
    assert isinstance(thread, threading.Thread)
    thread.join(2)
    _, auth, body = peer_servers[0].seen[0]  # type: ignore[attr-defined]
    assert auth is None and body["incident_id"] == "inc-1" and body["origin"] == "node-1"
    assert peers_mod.notify_in_background([], "x", "r", "h", None, done=done.append).join(1) is None
    assert done == [{}]


def test_parse_peers() -> None:
    assert peers_mod.parse_peers("10.0.0.2:9400, node3:9400,[::1]:1") == [
        "10.0.0.2:9400",
        "node3:9400",
        "[::1]:1",
    ]
    for bad in ("node3", "node3:x", ":9400", "node3:70000"):
        with pytest.raises(UsageError, match="--peers: expected HOST:PORT"):
            peers_mod.parse_peers(bad)


# ---------------------------------------------------------------- four agents over real HTTP


class _Node:
    """What an agent exposes to the HTTP server (analyzer.http's Backend)."""

    def __init__(self, host: str, folder: Path) -> None:
        self.host = host
        self.folder = folder
        wd = Watchdog(TIMEOUT, host)
        sched = DumpScheduler.for_directory(folder, lambda: sample_recording(2000, host=host))
        self.incidents = Incidents(wd, sched)

    def recording(self) -> Recording:
        return sample_recording(10, host=self.host)

    def metrics_text(self) -> str:
        return ""

    def request_dump(
        self, reason: str, incident_id: str | None, origin: str | None, *, kind: str | None = None
    ) -> object:
        said = TriggerKind(kind) if kind else None  # what the peer's incident is
        answer = self.incidents.request_dump(reason, incident_id, origin, origin_kind=said)
        return {"host": self.host, **answer}


def test_four_agents_over_http_share_one_incident(tmp_path: Path) -> None:
    from stallwatch.query.http import serve_http

    nodes = []
    servers = []
    try:
        for n in range(4):
            (tmp_path / f"node-{n}").mkdir()
            node = _Node(f"node-{n}", tmp_path / f"node-{n}")
            servers.append(serve_http(node, "127.0.0.1:0", token="t0ken"))
            nodes.append(node)
        addresses = [s.address for s in servers]
        for node, address in zip(nodes, addresses, strict=True):
            others = [a for a in addresses if a != address]
            node.incidents.notify = peers_mod.peer_notifier(others, node.host, "t0ken")
        now = time.monotonic_ns()
        stuck = TickState(now, (call(1, now - 3 * S),), (comm(1, now - 3 * S),), (proc(1),))
        nodes[2].incidents.tick(stuck)  # two nodes see the hang; 0 and 3 see nothing
        nodes[1].incidents.tick(stuck)
        deadline = time.monotonic() + 5
        ids: set[str] = set()
        while time.monotonic() < deadline:
            dumps = [sorted(n.folder.glob("*.msgpack")) for n in nodes]
            if all(len(d) == 1 for d in dumps):
                ids = {d[0].name.split("-", 2)[2].rsplit("-", 1)[0] for d in dumps}
                if len(ids) == 1:
                    break
            time.sleep(0.02)
        assert len(ids) == 1, [list(n.folder.iterdir()) for n in nodes]
        for node in nodes:
            [path] = node.folder.glob("*.msgpack")
            rec = read_dump(path)
            assert rec.trigger is not None and rec.trigger.incident_id in path.name
        # a wrong token is refused by the server, and reported by the client
        bad = peers_mod.notify_peers(addresses[:1], "x", "r", "h", "wrong", timeout=1.0)
        assert bad[addresses[0]] == "error: HTTP 401 Unauthorized"
    finally:
        for server in servers:
            server.close()

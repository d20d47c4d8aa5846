"""The stall watchdog, incidents, and the dump scheduler: pure logic.

No BCC and no I/O here except through injected callables, so that every rule
is tested on hand-built ``TickState``s.  Three pieces:

``Watchdog`` decides.  ``check(state)`` turns each tick's state into triggers:

- IN_FLIGHT: a call entered and not returned while its communicator made no
  progress on this node for longer than that communicator's own bound
  (``recorder.stallbound``: a floor, its rhythm, the pauses it survived; the
  stall timeout is the ceiling), the bound and what set it in the reason (a
  call of a process known to be dead is left to EXIT); a call that returned
  and waits on its stream, not completed by the device where the CUDA
  probes see completions, stands as one in flight (``InflightCall.queued``);
- NO_PROGRESS: a live process whose active communicators (calls > 0, not
  destroyed) have all been silent (no entry, no return) for longer than the
  stall timeout.  Judged per process, not per communicator: a process that
  keeps using its world communicator while a split one sits idle is healthy.
  A process the agent does not report as alive is not judged;
- EXIT: a process holding communicators died with a non-zero exit code or a
  fatal signal.  Exit code 0 is a normal end; a death with neither code nor
  signal seen is not judged;
- SLOWDOWN: what ``recorder.slowdown`` reports sustained (a communicator's
  rhythm degraded several-fold, a rank of this node persistently last, a
  collective held with the network failing inside it), keyed by when it began.

Each condition is an *episode*, keyed by what it is about (the stuck call, the
silent process and its last activity, the exit).  An episode triggers at most
once: it stays covered while it lasts and ends when the condition goes away
(the call returns, progress resumes).  At most one incident per tick.

Cool-down: after any incident (local, manual or a peer's) automatic triggers
are suppressed for ``cooldown_ns``, by default ``max(5 min, 2 x stall
timeout)``: a hung job stays hung, and each node would otherwise raise the same
hang again and again.  Episodes that begin during the cool-down are counted
as part of the incident in progress and never trigger on their own, even if
they outlast it.  Manual requests bypass the cool-down.  A slowdown's
cool-down holds back only slowdowns: a stall, an exit, or a peer's incident
that is not a slowdown (peers say what theirs is) raised after a slowdown is
its own incident (a degrading link that then drops is dumped twice: slow,
then stuck), while a slowdown after any incident waits for its cool-down.

``request()`` handles ``stallwatch dump``, SIGUSR1, ``POST /dump`` and peers.
A peer request for an incident already dumped here is a duplicate.  A peer
request with a new id is dumped under that id, so every node shares it -
unless this node raised or joined an incident moments ago (within
``merge_window_ns``, default 10 s): two nodes that detected the same hang at
once then converge on the smaller id.  Only the watchdogs' ids (which
begin with the time) are ordered so: a named incident (a client's, as the
lab's ``lab-RUN-end``) is never merged with a stall.  Later in a cool-down, a peer's new
incident is refused ("cooldown"): this node's last dump already holds the
recent past, and a flapping peer must not flood the disk.  Incident ids begin
with the UTC time, so the smaller id is the earlier detection; the node
holding the larger id relabels its dump (``Decision.replaces``), the other
answers "duplicate" with its id; a detector told so by a peer relabels its
own dump to that earlier id too (``Incidents.peer_answered``: an agent
restarted during a stall finds it again after its peers dumped it).

``DumpScheduler`` writes.  It takes the recording at trigger time (that
window is what matters; a later copy could have overwritten the stall),
writes once per incident, and if writing fails (disk full, read-only folder)
keeps that recording and retries with exponential backoff on later ticks while
recording goes on, then runs retention.  At most ``max_pending`` recordings are
kept (the oldest is dropped, and counted).

``Incidents`` wires both for the agent: ``tick(state)`` each tick,
``request_dump(...)`` from the HTTP server or a signal, peer notification
through an injected callable.  Thread-safe: one lock around all of it, so
``recording`` may be called from the HTTP server's thread too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from stallwatch.dumpers.errors import DumpError, DumpWriteError
from stallwatch.dumpers.model import Recording, Trigger, TriggerKind
from stallwatch.dumpers.schema import op_name

from .incidentids import (
    CLIENT_DUMP_EVERY_NS,
    CLIENT_DUMPS_BURST,
    ID_CLOCK_SLACK_NS,
    TokenBucket,
    incident_wall_ns,
    new_incident_id,
)
from .stallbound import StallBounds
from .tickstate import TickState
from .verdicts import Dumped

__all__ = [  # ids and the client bucket live in recorder.incidentids; named here as before
    "DumpScheduler",
    "Incidents",
    "Status",
    "TokenBucket",
    "Watchdog",
    "incident_wall_ns",
    "new_incident_id",
]

log = logging.getLogger("stallwatch.watchdog")

SECOND_NS = 1_000_000_000
MIN_COOLDOWN_NS = 300 * SECOND_NS
DEFAULT_MERGE_WINDOW_NS = 10 * SECOND_NS
KNOWN_INCIDENTS = 1024  # ids remembered for duplicate detection
STATE_INCIDENTS = 64  # of which an agent restarted on this node is told
_PRIORITY = {
    TriggerKind.EXIT: 0,
    TriggerKind.IN_FLIGHT: 1,
    TriggerKind.NO_PROGRESS: 2,
    TriggerKind.SLOWDOWN: 3,
}


def default_cooldown_ns(stall_timeout_ns: int) -> int:
    return max(MIN_COOLDOWN_NS, 2 * stall_timeout_ns)


@dataclass(frozen=True, slots=True)
class _Condition:
    kind: TriggerKind
    reason: str
    since_ns: int  # when the episode's clock started
    pid: int = 0
    comm_hash: int = 0


class Status(enum.Enum):
    """The answer to a dump request (``POST /dump``)."""

    WRITTEN = "written"
    QUEUED = "queued"  # accepted; the write failed and will be retried
    DUPLICATE = "duplicate"  # this incident is already dumped here
    COOLDOWN = "cooldown"  # refused: an incident was dumped moments ago
    FAILED = "failed"  # not written and not kept for a retry: ``error`` says why
    RATE_LIMITED = "rate_limited"  # refused: clients asked for too many dumps lately
    UNKNOWN = "unknown"  # asked for the outcome of an incident this agent does not know


@dataclass(frozen=True, slots=True)
class Decision:
    """What to do with a dump request: dump ``trigger`` (if not None), or
    answer ``status`` for ``incident_id``.  ``replaces``: this node's incident
    whose dump is to be relabelled with ``trigger.incident_id``."""

    trigger: Trigger | None
    status: Status | None
    incident_id: str
    replaces: str | None = None


@dataclass
class WatchdogStats:
    stalls_detected: int = 0  # incidents raised by check(), slowdowns apart
    slowdowns_detected: int = 0
    suppressed: int = 0  # new episodes inside a cool-down
    requests: int = 0  # manual and peer requests
    duplicates: int = 0
    merged: int = 0  # own incidents relabelled to a peer's id


class Watchdog:
    def __init__(
        self,
        stall_timeout_ns: int,
        host: str,
        cooldown_ns: int | None = None,
        merge_window_ns: int | None = None,
        clock: Callable[[], int] = time.monotonic_ns,
        wall_clock: Callable[[], int] = time.time_ns,
        bounds: StallBounds | None = None,
    ) -> None:
        """``bounds``: each communicator's own bound for calls in flight
        (``recorder.stallbound``); by default the stall timeout for all."""
        if stall_timeout_ns <= 0:
            raise ValueError(f"stall timeout must be positive, got {stall_timeout_ns} ns")
        self.stall_timeout_ns = stall_timeout_ns
        self.bounds = StallBounds(stall_timeout_ns) if bounds is None else bounds
        self.host = host
        self.cooldown_ns = (
            default_cooldown_ns(stall_timeout_ns) if cooldown_ns is None else cooldown_ns
        )
        window = DEFAULT_MERGE_WINDOW_NS if merge_window_ns is None else merge_window_ns
        self.merge_window_ns = min(window, self.cooldown_ns)
        self.clock = clock
        self.wall_clock = wall_clock
        self.stats = WatchdogStats()
        self._covered: set[tuple[object, ...]] = set()
        self._exits: OrderedDict[tuple[object, ...], None] = OrderedDict()
        self._known: OrderedDict[str, int] = OrderedDict()  # incident id -> monotonic ns
        self._last: tuple[str, int] | None = None  # (incident id, monotonic ns)
        self._stall_at: int | None = None  # the last incident that was no slowdown (monotonic)
        self.on_change: Callable[[], None] | None = None  # the incidents changed
        self._began: dict[str, int] = {}  # own incident -> when its episode began (monotonic)

    # ---- state that outlives the agent --------------------------------

    def state(self) -> dict[str, object]:
        """The incidents this node raised or joined (monotonic times: valid
        until the machine reboots), for an agent restarted on this node."""
        known = list(self._known.items())[-STATE_INCIDENTS:]
        return {
            "last": list(self._last) if self._last else None,
            "known": known,
            "stall_at": self._stall_at,
        }

    def restore(self, state: dict[str, object]) -> None:
        """Take up an earlier agent's incidents: a stall it dumped is not
        dumped again (its cool-down goes on) and its peers' requests for
        that incident are duplicates.  Anything malformed is ignored."""
        try:
            last = state.get("last")
            known = state.get("known") or []
            if isinstance(last, list):
                self._last = (str(last[0]), int(last[1]))
                stall_at = state.get("stall_at", self._last[1])  # older agents: any incident
                self._stall_at = stall_at if isinstance(stall_at, int) else None
            for item in known if isinstance(known, list) else ():
                self._known[str(item[0])] = int(item[1])
        except (TypeError, ValueError, IndexError):
            log.warning("ignoring an unreadable watchdog state: %r", state)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    # ---- automatic triggers -------------------------------------------

    def check(self, state: TickState) -> list[Trigger]:
        """Triggers for this tick: at most one, for a new episode outside a cool-down."""
        current = self._conditions(state)
        self._covered &= current.keys()
        fresh = {
            k: c for k, c in current.items() if k not in self._covered and k not in self._exits
        }
        if not fresh:
            return []
        for key in fresh:
            self._cover(key)
        live = [c for c in fresh.values() if not self.in_cooldown(state.now_ns, _is_slow(c.kind))]
        if not live:
            self.stats.suppressed += 1
            log.info("in cool-down, not dumping: %s", next(iter(fresh.values())).reason)
            return []
        cond = min(live, key=lambda c: (_PRIORITY[c.kind], c.since_ns))
        if _is_slow(cond.kind):
            self.stats.slowdowns_detected += 1
        else:
            self.stats.stalls_detected += 1
        trigger = self._incident(cond.kind, cond.reason, state.now_ns, cond.pid, cond.comm_hash)
        self._began[trigger.incident_id] = cond.since_ns
        return [trigger]

    def in_cooldown(self, now_ns: int, slowdown: bool = False) -> bool:
        """Whether an incident of that class is held back now: a slowdown by
        any recent incident, anything else by a recent one that was no slowdown."""
        since = (self._last[1] if self._last else None) if slowdown else self._stall_at
        return since is not None and now_ns - since < self.cooldown_ns

    def _cover(self, key: tuple[object, ...]) -> None:
        if key[0] == TriggerKind.EXIT:  # exits are final: remembered, not re-judged
            self._exits[key] = None
            while len(self._exits) > KNOWN_INCIDENTS:
                self._exits.popitem(last=False)
        else:
            self._covered.add(key)

    def _conditions(self, state: TickState) -> dict[tuple[object, ...], _Condition]:
        out: dict[tuple[object, ...], _Condition] = {}
        self._inflight_conditions(state, out)
        self._progress_conditions(state, out)
        self._exit_conditions(state, out)
        for slow in state.slowdowns:
            key = (TriggerKind.SLOWDOWN, slow.cause, slow.pid, slow.comm, slow.since_ns)
            out[key] = _Condition(
                TriggerKind.SLOWDOWN, slow.reason, slow.since_ns, slow.pid, slow.comm_hash
            )
        return out

    def _inflight_conditions(
        self, state: TickState, out: dict[tuple[object, ...], _Condition]
    ) -> None:
        for stall in self.bounds.judge(state):
            call, now = stall.call, state.now_ns
            what = f"{op_name(call.op)} seq {call.seq} on {_comm_text(call.comm_hash)}"
            if call.seq < 0:  # found on the thread's stack (recorder.positions)
                what = f"{op_name(call.op)} (thread position: since before the agent started)"
            standing = (
                "queued on its stream, not completed by the device,"
                if call.queued
                else ("in flight")
            )
            reason = (
                f"{what} {standing} for {(now - call.entered_ns) / SECOND_NS:.1f} s, no progress "
                f"on this node for {(now - stall.since_ns) / SECOND_NS:.1f} s "
                f"(pid {call.pid}, tid {call.tid}); {stall.bound.text()}"
            )
            key = (TriggerKind.IN_FLIGHT, call.pid, call.tid, call.entered_ns)
            out[key] = _Condition(
                TriggerKind.IN_FLIGHT, reason, stall.since_ns, call.pid, call.comm_hash
            )

    def _progress_conditions(
        self, state: TickState, out: dict[tuple[object, ...], _Condition]
    ) -> None:
        alive = {p.pid for p in state.processes if p.alive}
        latest: dict[int, tuple[int, int]] = {}  # pid -> (last activity, comm hash)
        for comm in state.comms:
            if comm.calls <= 0 or comm.destroyed or comm.pid not in alive:
                continue
            last = max(comm.last_enter_ns, comm.last_return_ns)
            if comm.pid not in latest or last > latest[comm.pid][0]:
                latest[comm.pid] = (last, comm.comm_hash)
        for pid, (last, comm_hash) in latest.items():
            idle = state.now_ns - last
            if idle <= self.stall_timeout_ns:
                continue
            reason = (
                f"no progress for {idle / SECOND_NS:.1f} s on any communicator of pid {pid} "
                f"(last on {_comm_text(comm_hash)})"
            )
            out[(TriggerKind.NO_PROGRESS, pid, last)] = _Condition(
                TriggerKind.NO_PROGRESS, reason, last, pid, comm_hash
            )

    def _exit_conditions(self, state: TickState, out: dict[tuple[object, ...], _Condition]) -> None:
        for proc in state.processes:
            if proc.alive or not proc.holds_comms:
                continue
            if proc.exit_signal:
                how = f"killed by signal {proc.exit_signal}"
            elif proc.exit_code:
                how = f"exited with code {proc.exit_code}"
            else:
                continue
            reason = f"pid {proc.pid}, holding communicators, {how}"
            key = (TriggerKind.EXIT, proc.pid, proc.exit_ns)
            out[key] = _Condition(TriggerKind.EXIT, reason, proc.exit_ns, proc.pid)

    # ---- incidents and requests ---------------------------------------

    def _incident(
        self,
        kind: TriggerKind,
        reason: str,
        now_ns: int,
        pid: int = 0,
        comm_hash: int = 0,
        incident_id: str | None = None,
        origin: str | None = None,
        slowdown: bool | None = None,
    ) -> Trigger:
        """``slowdown``: whether the incident is one (default: by ``kind``)."""
        incident = incident_id or new_incident_id(self.host, self.wall_clock())
        self._remember(incident, now_ns)
        self._last = (incident, now_ns)
        if not (_is_slow(kind) if slowdown is None else slowdown):
            self._stall_at = now_ns
        log.warning("incident %s (%s): %s", incident, kind.value, reason)
        self._changed()
        return Trigger(kind, reason, incident, now_ns, pid, comm_hash, origin or self.host)

    def _remember(self, incident_id: str, now_ns: int) -> None:
        self._known[incident_id] = now_ns
        while len(self._known) > KNOWN_INCIDENTS:
            self._known.popitem(last=False)

    def knows(self, incident_id: str) -> bool:
        return incident_id in self._known

    def decide(
        self,
        kind: TriggerKind,
        reason: str,
        incident_id: str | None = None,
        origin: str | None = None,
        origin_kind: TriggerKind | None = None,
    ) -> Decision:
        """A manual or peer request: dump, merge, or answer duplicate.
        ``origin_kind``: what the peer's incident is (its trigger's kind),
        if it says."""
        now = self.clock()
        slow = kind == TriggerKind.PEER and origin_kind == TriggerKind.SLOWDOWN
        self.stats.requests += 1
        if incident_id is not None and incident_id in self._known:
            self.stats.duplicates += 1
            return Decision(None, Status.DUPLICATE, incident_id)
        if kind == TriggerKind.PEER and incident_id and self._mergeable(incident_id, now):
            return self._merge(reason, incident_id, origin, now)
        if kind == TriggerKind.PEER and self.in_cooldown(now, slow):
            assert self._last is not None
            self.stats.suppressed += 1
            return Decision(None, Status.COOLDOWN, self._last[0])
        trigger = self._incident(
            kind, reason, now, incident_id=incident_id, origin=origin, slowdown=slow
        )
        return Decision(trigger, None, trigger.incident_id)

    def request(
        self,
        kind: TriggerKind,
        reason: str,
        incident_id: str | None = None,
        origin: str | None = None,
        origin_kind: TriggerKind | None = None,
    ) -> Trigger | None:
        """The trigger to dump for a request, or None (duplicate).  A merge
        (see the module docstring) needs ``decide``: use ``Incidents``."""
        return self.decide(kind, reason, incident_id, origin, origin_kind).trigger

    def adopt_earlier(self, own_id: str, their_id: str) -> bool:
        """Take ``their_id`` for this node's incident ``own_id`` if it is
        earlier, was raised after ``own_id``'s stall began (so it is that
        stall, seen from another node: not an older incident whose cool-down
        the peer is in) and ``own_id`` is still the current one; True if taken."""
        if self._last is None or self._last[0] != own_id or their_id >= own_id:
            return False
        raised = incident_wall_ns(their_id)
        began = self._began.get(own_id)
        if raised is None or began is None:
            return False
        began_wall = self.wall_clock() - (self.clock() - began)
        if raised < began_wall - ID_CLOCK_SLACK_NS:
            return False
        self._remember(their_id, self._last[1])
        self._last = (their_id, self._last[1])
        self.stats.merged += 1
        log.warning("incident %s is a peer's %s: relabelling", own_id, their_id)
        self._changed()
        return True

    def _recent(self, now_ns: int) -> bool:
        return self._last is not None and now_ns - self._last[1] <= self.merge_window_ns

    def _mergeable(self, incident_id: str, now_ns: int) -> bool:
        """A peer's incident and this node's latest are the same stall raised
        on two nodes: both ids the watchdogs' (raised when they say), moments
        apart.  A named one (a client's, ``lab-...-end``) is its own
        incident, never ordered against them (a name sorts after every
        timestamp)."""
        return (
            self._recent(now_ns)
            and self._last is not None
            and incident_wall_ns(incident_id) is not None
            and incident_wall_ns(self._last[0]) is not None
        )

    def _merge(self, reason: str, incident_id: str, origin: str | None, now: int) -> Decision:
        assert self._last is not None
        own_id, own_ns = self._last
        self._remember(incident_id, now)
        if incident_id > own_id:  # ours is earlier: the peer will adopt it
            self.stats.duplicates += 1
            self._changed()
            return Decision(None, Status.DUPLICATE, own_id)
        self.stats.merged += 1
        self._last = (incident_id, own_ns)
        self._changed()
        log.warning("incident %s is %s's %s: relabelling", own_id, origin or "a peer", incident_id)
        trigger = Trigger(TriggerKind.PEER, reason, incident_id, now, origin_host=origin or "")
        return Decision(trigger, None, incident_id, replaces=own_id)


# ---------------------------------------------------------------- dumping


# Kinds of dump kept over others (retention, the pending queue): what a
# watchdog raised, here or on a peer.  Asked for by a client (MANUAL) or at
# exit, a dump is "requested": counted apart, never at an incident's cost.
INCIDENT_KINDS = frozenset(
    k for k in TriggerKind if k not in (TriggerKind.MANUAL, TriggerKind.SHUTDOWN)
)


@dataclass
class _Pending:
    recording: Recording
    attempts: int = 0
    next_ns: int = 0
    replaces: Path | None = None  # a dump to remove once this one is written
    old_id: str | None = None  # the incident id it had before a relabel
    error: str = ""  # why the last attempt failed

    @property
    def incident(self) -> bool:
        trig = self.recording.trigger
        return trig is None or trig.kind in INCIDENT_KINDS


@dataclass(frozen=True, slots=True)
class DumpOutcome:
    status: Status
    incident_id: str
    path: Path | None
    error: str | None = None  # why it is not written (yet)


@dataclass
class DumpStats:
    dumps_written: int = 0
    write_failures: int = 0  # failed attempts, each retried
    dumps_dropped: int = 0  # given up: unencodable, snapshot failed, or too many pending
    relabelled: int = 0


class DumpScheduler:
    """Writes each incident's recording once; retries failed writes with backoff."""

    def __init__(
        self,
        recording: Callable[[], Recording],
        write: Callable[[Recording], Path],
        retention: Callable[[Path | None], object] | None = None,
        read: Callable[[Path], Recording] | None = None,
        clock: Callable[[], int] = time.monotonic_ns,
        backoff_ns: tuple[int, int] = (SECOND_NS // 2, 30 * SECOND_NS),
        max_pending: int = 4,
    ) -> None:
        self.recording = recording
        self.write = write
        self.retention = retention
        self.read = read
        self.clock = clock
        self.backoff_ns = backoff_ns
        self.max_pending = max_pending
        self.stats = DumpStats()
        self.paths: dict[str, Path] = {}  # incident id -> dump written
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        self._given_up: OrderedDict[str, str] = OrderedDict()  # incident id -> why

    @property
    def pending(self) -> int:
        return len(self._pending)

    def tidy(self) -> None:
        """At start: retention over the folder as it was left, temporary
        files of writes killed half-way included."""
        if self.retention is None:
            return
        try:
            removed = self.retention(None)
        except Exception:  # never at the cost of starting
            log.exception("retention at start failed")
            return
        paths = removed if isinstance(removed, list) else []
        unfinished = [p for p in paths if isinstance(p, Path) and ".tmp-" in p.name]
        if unfinished:
            log.warning(
                "removed %d temporary files of dump writes that did not finish: %s",
                len(unfinished),
                ", ".join(p.name for p in unfinished),
            )

    def submit(self, trigger: Trigger) -> DumpOutcome:
        """Take the recording now and try to write; a failed write is queued for retry."""
        try:
            rec = dataclasses.replace(self.recording(), trigger=trigger)
        except Exception as exc:
            self.stats.dumps_dropped += 1
            log.exception("incident %s: snapshot failed, no dump", trigger.incident_id)
            raise DumpWriteError(f"incident {trigger.incident_id}: snapshot failed: {exc}") from exc
        return self._queue(trigger.incident_id, _Pending(rec))

    def _queue(self, incident_id: str, item: _Pending) -> DumpOutcome:
        """Write now; a write that failed waits for a retry if there is room
        (at most ``max_pending``): a requested dump never takes an incident's
        place, and an incident the queue cannot take is refused, not queued
        (the pinned rings still hold it, until overwritten)."""
        self._pending[incident_id] = item
        outcome = self._attempt(incident_id)
        if outcome.status is not Status.QUEUED or len(self._pending) <= self.max_pending:
            return outcome
        others = [i for i, p in self._pending.items() if not p.incident and i != incident_id]
        if item.incident and others:  # an incident displaces the oldest requested dump
            self._give_up(others[0], f"displaced by incident {incident_id} (the disk is full)")
            return outcome
        waiting = len(self._pending) - 1
        why = f"{item.error}; not kept for a retry: {waiting} dumps already wait"
        self._give_up(incident_id, why)
        return DumpOutcome(Status.FAILED, incident_id, None, why)

    def _give_up(self, incident_id: str, why: str) -> None:
        del self._pending[incident_id]
        self.stats.dumps_dropped += 1
        self._given_up[incident_id] = why
        while len(self._given_up) > KNOWN_INCIDENTS:
            self._given_up.popitem(last=False)
        log.error("incident %s: dump dropped: %s", incident_id, why)

    def outcome(self, incident_id: str) -> DumpOutcome:
        """What became of an incident's dump: written, waiting for a retry
        (and why), given up (and why), or unknown here."""
        if incident_id in self.paths:
            return DumpOutcome(Status.WRITTEN, incident_id, self.paths[incident_id])
        item = self._pending.get(incident_id)
        if item is not None:
            return DumpOutcome(Status.QUEUED, incident_id, None, item.error)
        why = self._given_up.get(incident_id)
        if why is not None:
            return DumpOutcome(Status.FAILED, incident_id, None, why)
        return DumpOutcome(Status.UNKNOWN, incident_id, None)

    def retry_due(self) -> list[Path]:
        """Retry the pending writes whose backoff has expired (each tick)."""
        now = self.clock()
        written = []
        for incident_id in [i for i, p in self._pending.items() if p.next_ns <= now]:
            try:
                outcome = self._attempt(incident_id)
            except DumpWriteError:  # dropped, logged and counted
                continue
            if outcome.path is not None:
                written.append(outcome.path)
        return written

    @classmethod
    def for_directory(
        cls,
        dump_dir: Path,
        recording: Callable[[], Recording],
        max_dumps: int | None = None,
        max_bytes: int | None = None,
    ) -> DumpScheduler:
        """The production wiring: atomic writes into ``dump_dir``, retention."""
        from stallwatch.dumpers.format import read_dump, write_dump
        from stallwatch.dumpers.retention import enforce

        def kept(path: Path) -> bool:
            return _kind_of(path) in INCIDENT_KINDS

        return cls(
            recording,
            write=lambda rec: write_dump(dump_dir, rec),
            retention=lambda path: enforce(dump_dir, max_dumps, max_bytes, keep=path, kept=kept),
            read=read_dump,
        )

    def _attempt(self, incident_id: str) -> DumpOutcome:
        item = self._pending[incident_id]
        try:
            path = self.write(item.recording)
        except (DumpWriteError, OSError) as exc:
            return self._failed(incident_id, item, exc)
        except Exception as exc:  # a recording that cannot be encoded will never be
            log.exception("incident %s: dump cannot be encoded", incident_id)
            self._give_up(incident_id, f"cannot be encoded: {exc}")
            raise DumpWriteError(f"incident {incident_id}: dump dropped: {exc}") from exc
        del self._pending[incident_id]
        self._written(incident_id, item, path)
        return DumpOutcome(Status.WRITTEN, incident_id, path)

    def _failed(self, incident_id: str, item: _Pending, exc: Exception) -> DumpOutcome:
        item.attempts += 1
        item.error = str(exc)
        first, cap = self.backoff_ns
        delay = min(cap, first << min(item.attempts - 1, 20))
        item.next_ns = self.clock() + delay
        self.stats.write_failures += 1
        log.error(
            "incident %s: dump not written (attempt %d, retry in %.1f s): %s",
            incident_id,
            item.attempts,
            delay / SECOND_NS,
            exc,
        )
        return DumpOutcome(Status.QUEUED, incident_id, None, item.error)

    def _written(self, incident_id: str, item: _Pending, path: Path) -> None:
        self.paths[incident_id] = path
        self.stats.dumps_written += 1
        log.warning("incident %s: dump written to %s", incident_id, path)
        if item.replaces is not None and item.replaces != path:
            _unlink(item.replaces)
        if item.old_id is not None:  # asked about the old id, answer with the new file
            self.paths[item.old_id] = path
        if self.retention is not None:
            try:
                self.retention(path)
            except Exception:  # retention must never cost the dump
                log.exception("retention after %s failed", path)

    def relabel(self, old_id: str, trigger: Trigger) -> DumpOutcome:
        """Give incident ``old_id``'s dump the id of ``trigger``: a pending
        snapshot is retagged; a written dump is read back, rewritten under the
        new id, and the old file removed."""
        new_id = trigger.incident_id
        self.stats.relabelled += 1
        if old_id in self._pending:
            item = self._pending.pop(old_id)
            item.recording = _retag(item.recording, trigger)
            item.old_id = old_id
            return self._queue(new_id, item)
        old_path = self.paths.get(old_id)
        try:
            if old_path is None or self.read is None:
                raise DumpError("no dump of that incident to read back")
            rec = self.read(old_path)
        except DumpError as exc:  # removed by retention, or by hand: dump afresh
            log.warning("incident %s: cannot relabel %s (%s): new snapshot", new_id, old_path, exc)
            return self.submit(trigger)
        return self._queue(new_id, _Pending(_retag(rec, trigger), replaces=old_path, old_id=old_id))


def _kind_of(path: Path) -> TriggerKind | None:
    """The trigger kind of a dump file (None: unreadable, or no trigger)."""
    from stallwatch.dumpers.format import dump_trigger

    try:
        trigger = dump_trigger(path)
    except DumpError:
        return None
    return trigger.kind if trigger is not None else None


def _retag(rec: Recording, peer: Trigger) -> Recording:
    """The recording's own trigger, under the peer's id and origin."""
    own = rec.trigger
    if own is None:
        return dataclasses.replace(rec, trigger=peer)
    origin = peer.origin_host or own.origin_host
    new = dataclasses.replace(own, incident_id=peer.incident_id, origin_host=origin)
    return dataclasses.replace(rec, trigger=new)


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("%s: cannot remove relabelled dump: %s", path, exc)


# ---------------------------------------------------------------- wiring


class Incidents:
    """Watchdog + scheduler + peers, as the agent uses them."""

    def __init__(
        self,
        watchdog: Watchdog,
        scheduler: DumpScheduler,
        notify: Callable[[Trigger], object] | None = None,
    ) -> None:
        self.watchdog = watchdog
        self.scheduler = scheduler
        self.notify = notify
        # an incident of this node raised, then dumped here: its verdict (recorder.verdicts)
        self.on_raised: Callable[[Trigger], object] | None = None
        self.on_dumped: Callable[[Dumped], object] | None = None
        self.relabelled: dict[str, str] = {}  # own incident -> the peer's earlier id
        self._answers: dict[str, dict[str, str]] = {}  # own incident -> peer -> its answer
        # what is done before an incident's recording is taken (the agent's
        # probes of its paths: recorder.pathprobe), after the peers were told
        self.before_dump: Callable[[Trigger], object] | None = None
        self._lock = threading.RLock()
        self.client_requests = TokenBucket(CLIENT_DUMPS_BURST, CLIENT_DUMP_EVERY_NS)
        self.rate_limited = 0  # client requests refused by the bucket

    def tick(self, state: TickState) -> list[DumpOutcome]:
        """Check for stalls, dump new incidents, retry pending writes."""
        outcomes = []
        with self._lock:
            for trigger in self.watchdog.check(state):
                # a dropped dump is logged and counted; the agent records on
                with contextlib.suppress(DumpWriteError):
                    outcomes.append(self._dump(trigger))
            self.scheduler.retry_due()
        return outcomes

    def request_dump(
        self,
        reason: str,
        incident_id: str | None = None,
        origin: str | None = None,
        by_client: bool = False,
        *,
        origin_kind: TriggerKind | None = None,
    ) -> dict[str, object]:
        """``POST /dump`` and friends: a peer's if ``origin`` is set (its
        incident's kind ``origin_kind``, if it says), else manual.
        A client's manual request (``by_client``: not a signal, not a peer)
        that would write a new dump takes a token of ``client_requests``, or
        is refused ("rate_limited", with ``retry_in_s``); a peer's request,
        whatever its kind, never is.  Returns ``{"incident_id", "status",
        "path"}`` and, when it is not written, ``error``: why."""
        kind = TriggerKind.PEER if origin else TriggerKind.MANUAL
        with self._lock:
            if by_client and kind is TriggerKind.MANUAL:
                new = incident_id is None or not self.watchdog.knows(incident_id)
                wait_ns = self.client_requests.take(self.watchdog.clock()) if new else 0
                if wait_ns:
                    self.rate_limited += 1
                    answer = _answer(DumpOutcome(Status.RATE_LIMITED, incident_id or "", None))
                    return {**answer, "retry_in_s": round(wait_ns / SECOND_NS, 1)}
            decision = self.watchdog.decide(kind, reason, incident_id, origin, origin_kind)
            if decision.trigger is None:
                assert decision.status is not None
                path = self.scheduler.paths.get(decision.incident_id)
                outcome = DumpOutcome(decision.status, decision.incident_id, path)
            elif decision.replaces is not None:
                self.relabelled[decision.replaces] = decision.incident_id
                outcome = self.scheduler.relabel(decision.replaces, decision.trigger)
            else:
                try:
                    outcome = self._dump(decision.trigger)
                except DumpWriteError as exc:  # the snapshot or its encoding failed
                    outcome = DumpOutcome(Status.FAILED, decision.incident_id, None, str(exc))
        return _answer(outcome)

    def answers(self, incident_id: str) -> dict[str, str]:
        """What each peer answered so far to this node's incident (peer -> status)."""
        with self._lock:
            return dict(self._answers.get(incident_id, {}))

    def outcome(self, incident_id: str) -> dict[str, object]:
        """What became of an incident's dump (``stallwatch dump`` waits on it)."""
        with self._lock:
            return _answer(self.scheduler.outcome(incident_id))

    def peer_answered(
        self, trigger: Trigger, status: str, their_id: str | None, peer: str = ""
    ) -> None:
        """Each peer's answer is kept for the incident's verdict (``answers``).
        A peer asked to dump ``trigger``'s incident said it holds an
        earlier one for the same stall (``duplicate`` or ``cooldown`` with a
        smaller id raised after this stall began): this node's dump takes
        that id, so every node's dump of a stall has one.
        (An agent restarted during a stall detects it again under a new id
        after its peers dumped theirs; this is how it converges.)"""
        with self._lock:
            self._answers.setdefault(trigger.incident_id, {})[peer] = status
            while len(self._answers) > STATE_INCIDENTS:
                del self._answers[next(iter(self._answers))]
        if status not in (Status.DUPLICATE.value, Status.COOLDOWN.value) or not their_id:
            return
        with self._lock:
            ours = trigger.incident_id
            if not self.watchdog.adopt_earlier(ours, their_id):
                return
            theirs = dataclasses.replace(trigger, kind=TriggerKind.PEER, incident_id=their_id)
            self.relabelled[ours] = their_id
            with contextlib.suppress(DumpWriteError):
                self.scheduler.relabel(ours, theirs)

    def _dump(self, trigger: Trigger) -> DumpOutcome:
        if self.on_raised is not None and trigger.kind != TriggerKind.PEER:
            self.on_raised(trigger)
        peers = None
        if self.notify is not None and trigger.kind != TriggerKind.PEER:
            try:  # peers first: they dump while this node writes
                peers = self.notify(trigger)
            except Exception:
                log.exception("incident %s: notifying peers failed", trigger.incident_id)
        began = time.monotonic()  # the probes are the dump's work, here as on the peers
        if self.before_dump is not None:
            try:
                self.before_dump(trigger)
            except Exception:  # never at the cost of the dump
                log.exception("incident %s: before the dump", trigger.incident_id)
        outcome = self.scheduler.submit(trigger)
        if outcome.status is Status.WRITTEN and self.on_dumped is not None:
            round_ = peers if isinstance(peers, threading.Thread) else None
            self.on_dumped(Dumped(trigger, time.monotonic() - began, round_))
        return outcome

    def counters(self) -> dict[str, int]:
        """For /metrics (each a counter, except ``dumps_pending``)."""
        w, s = self.watchdog.stats, self.scheduler.stats
        return {
            "stalls_detected": w.stalls_detected,
            "slowdowns_detected": w.slowdowns_detected,
            "stalls_suppressed": w.suppressed,
            "dump_requests": w.requests,
            "dump_requests_duplicate": w.duplicates,
            "incidents_merged": w.merged,
            "dumps_written": s.dumps_written,
            "dump_write_failures": s.write_failures,
            "dumps_dropped": s.dumps_dropped,
            "dumps_pending": self.scheduler.pending,
            "dump_requests_rate_limited": self.rate_limited,
        }


def _is_slow(kind: TriggerKind) -> bool:
    return kind == TriggerKind.SLOWDOWN


def _answer(outcome: DumpOutcome) -> dict[str, object]:
    answer: dict[str, object] = {
        "incident_id": outcome.incident_id,
        "status": outcome.status.value,
        "path": str(outcome.path) if outcome.path else None,
    }
    if outcome.error:
        answer["error"] = outcome.error
    return answer


def _comm_text(comm_hash: int) -> str:
    """A communicator's id, or that it is unknown: one made before the agent
    started has none in the recording (hash 0 there), never an id of 0."""
    if comm_hash == 0:
        return "a communicator made before the agent started (id unknown)"
    return f"communicator {comm_hash:#018x}"

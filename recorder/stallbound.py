"""Each communicator's own stall bound: how long a collective may stand in
flight, with its communicator making no progress on this node, before it is
a stall.  Pure logic, as the watchdog's: the agent hands it the NCCL rows as
they settle (``StallBounds.feed``); the watchdog asks, per call in flight,
how long its communicator stood still and what bound it has (``judge``).

The bound is the largest of

- the **floor** (``--stall-floor``, 5 s): nothing shorter is a stall;
- the **rhythm**: ``multiple`` times the longest of the communicator's last
  ``RECENT_CALLS`` durations on this node, the multiple derived from the
  communicator's own call rate (``rhythm_multiple``).  A communicator's
  first collectives (initialisation, connection set-up, a rank that started
  late) are in that window until ``RECENT_CALLS`` calls push them out, and
  with few durations the multiple is large (infinite with one): warm-up
  raises the bound, never an incident;
- the **pauses**: ``PAUSE_MARGIN`` times the longest call a process of the
  communicator has survived beyond the bound its rhythm set (a rank
  checkpointing while the others wait for it in a barrier: the call
  returned, the job did not hang), for every communicator of that process.
  A communicator's first call is its warm-up, never a pause: NCCL connects
  the members there, and a rank that started late holds its peers there;

and never more than the **ceiling**, ``--stall-timeout``.  A call no
communicator can be found for (a group call; one found on a thread's stack
at start-up) gets the largest bound of its process's communicators, or the
ceiling.

"No progress anywhere" is read from every local member of the
communicator: the latest entry, return, or completion on the device of any
of them.  A communicator made before the agent attached (hash 0) is one
process's own.

Work queued on a device: where the CUDA probes see a communicator's calls
complete on the device (``recorder.slowdown``'s device streams), a call
that returned but did not complete stands as a call in flight does
(``InflightCall.queued``), from its entry; its durations are from entry to
the completion seen, so the rhythm is the device's.  An asynchronous job's
hang is then raised at its bound, not the ceiling.

Known limits: only this node's members are seen, so a communicator whose
local members wait while its remote ones progress on other calls is judged
as stalled (a collective cannot complete without every member, so such a
wait is one); a job whose calls return at once and whose device completions
no CUDA probe sees (no CUDA runtime attached) has no rhythm here and its
stalls are the ceiling's (``NO_PROGRESS``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from stallwatch.dumpers.schema import Op

from .tickstate import CommProgress, InflightCall, TickState

SECOND_NS = 1_000_000_000

# The floor: a collective that stood still for less than this is never a
# stall.  From below, the kernel's own TCP recovery: a segment lost again and
# again is retransmitted at TCP_RTO_MIN (200 ms), doubling, and the kernel
# calls the path suspect (tcp_retries1 = 3) only when the fourth timeout
# fires, 0.2 x (1 + 2 + 4 + 8) = 3 s after the loss: a call held for less is
# one the kernel still counts healthy.  From above, what people are promised:
# a verdict within 10 s of a hang, of which gathering the verdict from every
# node's dump takes 3-5 s on a loaded node (bench/verdict_latency.py).
DEFAULT_FLOOR_S = 5.0
# The ceiling: no collective stands still longer than this unraised, and a
# communicator with nothing in flight (its calls returned, its work queued on
# a device) is a stall after this long without progress.
DEFAULT_CEILING_S = 60.0
TCP_RTO_MIN_S = 0.2
TCP_RETRIES1 = 3
TCP_SUSPECT_S = TCP_RTO_MIN_S * (2 ** (TCP_RETRIES1 + 1) - 1)  # 3.0 s

# How many recent durations the rhythm is the longest of.  The bound hardly
# depends on it: for durations with an exponential tail of mean m, the
# longest of n is about m ln n and the multiple is ln(calls a year) / ln n,
# so the bound is about m ln(calls a year) whatever n is.  What n sets is how
# soon the bound follows a change of rhythm (and lets a warm-up go): after n
# calls.  64 calls are a few steps of a job (a step makes 5-10 calls on each
# of its communicators), so a rhythm is followed within a few steps.
RECENT_CALLS = 64

# The rhythm's multiple keeps a healthy communicator's false stalls to one a
# year: with an exponential tail, a call outlasts k times the longest of the
# n before it with chance n^-k, and a communicator making r calls a second
# makes r x YEAR_S of them: k = ln(r x YEAR_S / FALSE_STALLS_PER_YEAR) / ln n.
FALSE_STALLS_PER_YEAR = 1.0
YEAR_S = 365.25 * 86400

# A long phase the job came back from (a checkpoint, an evaluation) is
# expected again, as long or longer: it does the same work (the same bytes
# written, the same evaluation set) against a resource it shares (a file
# system, a network), whose share halves when one more job uses it as much:
# twice the longest such call is the bound it leaves behind.
PAUSE_MARGIN = 2.0

_CALLS = np.zeros(256, dtype=bool)
_CALLS[[int(op) for op in Op if op.is_collective or op.is_p2p]] = True

CommKey = tuple[int, int]  # (comm hash, 0), or (0, pid) for one made before the attach


def rhythm_multiple(calls: int, span_ns: int) -> float:
    """The multiple of the longest of ``calls`` recent durations, seen over
    ``span_ns`` (first to last return), that keeps false stalls to
    ``FALSE_STALLS_PER_YEAR``: infinite with fewer than two."""
    if calls < 2 or span_ns <= 0:
        return math.inf
    rate = (calls - 1) * SECOND_NS / span_ns
    expected = max(rate * YEAR_S / FALSE_STALLS_PER_YEAR, math.e)
    return math.log(expected) / math.log(calls)


@dataclass(frozen=True, slots=True)
class Bound:
    """A communicator's bound now, and what set it (one of ``floor``,
    ``rhythm``, ``pause``, ``warm-up``, ``ceiling``)."""

    ns: int
    set_by: str
    floor_ns: int
    ceiling_ns: int
    rhythm_ns: int | None = None  # None: no rhythm yet (warm-up)
    longest_ns: int | None = None  # the longest recent duration
    calls: int = 0  # recent durations known
    multiple: float | None = None
    pause_ns: int | None = None  # the longest call survived beyond the rhythm's bound

    def text(self) -> str:
        """``bound 5.0 s, set by the floor (...)``: for the trigger's reason."""
        parts = [f"floor {_s(self.floor_ns)}"]
        if self.rhythm_ns is None:
            parts.append(f"no rhythm yet ({self.calls} call(s) returned: warm-up)")
        else:
            parts.append(
                f"rhythm {_s(self.rhythm_ns)} = {self.multiple:.1f} x the longest of "
                f"{self.calls} recent calls ({_s(self.longest_ns or 0)})"
            )
        if self.pause_ns:
            parts.append(f"pause survived {_s(self.pause_ns)} x {PAUSE_MARGIN:g}")
        parts.append(f"ceiling {_s(self.ceiling_ns)}")
        return f"bound {_s(self.ns)}, set by the {self.set_by} ({'; '.join(parts)})"

    def to_doc(self) -> dict[str, object]:
        """The bound as it is written in the dump's trigger."""
        return {
            "bound_ns": self.ns,
            "set_by": self.set_by,
            "floor_ns": self.floor_ns,
            "ceiling_ns": self.ceiling_ns,
            "rhythm_ns": self.rhythm_ns,
            "longest_ns": self.longest_ns,
            "calls": self.calls,
            "multiple": None if self.multiple is None else round(self.multiple, 3),
            "pause_ns": self.pause_ns,
        }


def _s(ns: int) -> str:
    return f"{ns / SECOND_NS:.3g} s" if ns < 10 * SECOND_NS else f"{ns / SECOND_NS:.0f} s"


@dataclass(slots=True)
class _Rhythm:
    """One communicator's recent returns (time, duration) and calls seen."""

    recent: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=RECENT_CALLS))
    seen: int = 0
    pids: set[int] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class Stall:
    """A call whose communicator stood still longer than its bound."""

    call: InflightCall
    since_ns: int  # the communicator's last progress on this node
    bound: Bound


class StallBounds:
    """Every local communicator's rhythm, the pauses its processes survived,
    and the bound they make."""

    def __init__(self, ceiling_ns: int, floor_ns: int | None = None) -> None:
        floor = int(DEFAULT_FLOOR_S * SECOND_NS) if floor_ns is None else floor_ns
        if ceiling_ns <= 0 or floor <= 0:
            raise ValueError(f"bounds must be positive: ceiling {ceiling_ns}, floor {floor}")
        self.ceiling_ns = ceiling_ns
        self.floor_ns = min(floor, ceiling_ns)
        self._rhythms: dict[CommKey, _Rhythm] = {}
        self._paused: dict[int, int] = {}  # pid -> longest call survived beyond its bound
        self._completed: dict[CommKey, int] = {}  # the latest completion seen on the device

    # ---- learning --------------------------------------------------------------

    def feed(self, settled: np.ndarray) -> None:
        """NCCL ring rows whose calls returned (and completed on the device,
        where it is seen): their durations, to the later of the two."""
        if not len(settled):
            return
        rows = settled[_CALLS[settled["op"]] & (settled["end_ns"] != 0)]
        done = np.maximum(rows["end_ns"], rows["completed_ns"])
        order = np.argsort(done, kind="stable")
        rows, done = rows[order], done[order]
        cols = [rows[f].tolist() for f in ("comm_hash", "pid", "ts_ns", "completed_ns")]
        for comm_hash, pid, ts, completed, end in zip(*cols, done.tolist(), strict=True):
            if completed:
                key = _key(comm_hash, pid)
                self._completed[key] = max(self._completed.get(key, 0), completed)
            self.returned(comm_hash, pid, ts, end)

    def returned(self, comm_hash: int, pid: int, entered_ns: int, returned_ns: int) -> None:
        """One call returned: a duration of its communicator, and (past its
        first call) a pause its process survived if it outlasted the bound."""
        rhythm = self._rhythms.setdefault(_key(comm_hash, pid), _Rhythm())
        duration = max(0, returned_ns - entered_ns)
        rhythm.pids.add(pid)
        rhythm.seen += 1
        if rhythm.seen > 1 and duration > self._bound_of(rhythm, pid, False).ns:
            # a pause, apart from the rhythm: the calls after it are judged by
            # the rhythm they keep, and by the pause where they pause again
            self._paused[pid] = max(self._paused.get(pid, 0), duration)
            return
        rhythm.recent.append((returned_ns, duration))

    def forget(self, alive: set[int]) -> None:
        """What processes no longer alive left goes."""
        for pid in [p for p in self._paused if p not in alive]:
            del self._paused[pid]
        for key, rhythm in list(self._rhythms.items()):
            rhythm.pids &= alive
            if not rhythm.pids:
                del self._rhythms[key]
                self._completed.pop(key, None)

    # ---- judging ---------------------------------------------------------------

    def bound(self, comm_hash: int, pid: int) -> Bound:
        """The bound of the communicator ``comm_hash`` (0: the process's own
        made before the attach), as seen from process ``pid``."""
        rhythm = self._rhythms.get(_key(comm_hash, pid))
        if rhythm is None:
            return self._warmup(0, self._paused.get(pid))
        return self._bound_of(rhythm, pid, True)

    def _bound_of(self, rhythm: _Rhythm, pid: int, pauses: bool) -> Bound:
        pause = max((self._paused.get(p, 0) for p in {pid, *rhythm.pids}), default=0) or None
        calls = len(rhythm.recent)
        span = rhythm.recent[-1][0] - rhythm.recent[0][0] if calls else 0
        multiple = rhythm_multiple(calls, span)
        if math.isinf(multiple):
            return self._warmup(calls, pause if pauses else None)
        longest = max(d for _, d in rhythm.recent)
        rhythm_ns = int(multiple * longest)
        candidates = [(self.floor_ns, "floor"), (rhythm_ns, "rhythm")]
        if pauses and pause:
            candidates.append((int(PAUSE_MARGIN * pause), "pause"))
        ns, by = max(candidates)
        if ns >= self.ceiling_ns:
            ns, by = self.ceiling_ns, "ceiling"
        return Bound(
            ns, by, self.floor_ns, self.ceiling_ns, rhythm_ns, longest, calls, multiple,
            pause if pauses else None,
        )  # fmt: skip

    def _warmup(self, calls: int, pause: int | None) -> Bound:
        return Bound(
            self.ceiling_ns, "warm-up", self.floor_ns, self.ceiling_ns, calls=calls, pause_ns=pause
        )

    def judge(self, state: TickState) -> list[Stall]:
        """The calls in flight (or queued on a device and not completed)
        whose communicator has stood still on this node for longer than its
        bound (a call of a dead process is left to the exit trigger)."""
        dead = {p.pid for p in state.processes if not p.alive}
        progress = _progress(state.comms)
        out = []
        for call in state.inflight:
            if call.pid in dead:
                continue
            since, bound = self._judged(call, progress)
            if state.now_ns - since > bound.ns:
                out.append(Stall(call, since, bound))
        return out

    def _judged(self, call: InflightCall, progress: dict[CommKey, int]) -> tuple[int, Bound]:
        if call.seq < 0:  # found on a thread's stack at start-up: no rhythm known
            return call.entered_ns, self._warmup(0, None)
        key = _key(call.comm_hash, call.pid)
        if call.comm_hash or key in self._rhythms:
            since = max(call.entered_ns, progress.get(key, 0), self._completed.get(key, 0))
            return since, self.bound(call.comm_hash, call.pid)
        # a call with no communicator (a group's end): its process's largest bound
        mine = [self._bound_of(r, call.pid, True) for r in self._rhythms.values()]
        mine = [b for b, r in zip(mine, self._rhythms.values(), strict=True) if call.pid in r.pids]
        bound = max(mine, key=lambda b: b.ns) if mine else self._warmup(0, None)
        return call.entered_ns, bound


def queued_calls(waiting: np.ndarray, device: Callable[[int, int], bool]) -> list[InflightCall]:
    """The calls that returned and wait on a stream whose completions the
    device reports (``device(pid, comm)``): per process and communicator the
    oldest (a stream runs in order: the later ones wait behind it)."""
    rows = waiting[
        _CALLS[waiting["op"]] & (waiting["end_ns"] != 0) & (waiting["completed_ns"] == 0)
    ]
    rows = rows[np.argsort(rows["ts_ns"], kind="stable")]
    out: dict[tuple[int, int], InflightCall] = {}
    cols = (rows[f].tolist() for f in ("pid", "tid", "comm", "comm_hash", "op", "seq", "ts_ns"))
    for pid, tid, comm, comm_hash, op, seq, ts in zip(*cols, strict=True):
        if (pid, comm) not in out and device(pid, comm):
            out[(pid, comm)] = InflightCall(pid, tid, comm_hash, op, seq, ts, queued=True)
    return list(out.values())


def _key(comm_hash: int, pid: int) -> CommKey:
    return (comm_hash, 0) if comm_hash else (0, pid)


def _progress(comms: tuple[CommProgress, ...]) -> dict[CommKey, int]:
    """Per communicator, the latest entry or return of any local member."""
    out: dict[CommKey, int] = {}
    for c in comms:
        key = _key(c.comm_hash, c.pid)
        out[key] = max(out.get(key, 0), c.last_enter_ns, c.last_return_ns)
    return out

"""The slowdown trigger (fail-slow): each communicator's own rhythm, learnt
as the job goes, and the moments it departs from it.  Pure logic, as the
watchdog's: the agent hands it the NCCL ring's rows as they appear and as
they settle (``SlowdownWatch.feed``) and asks each tick what is slow
(``SlowdownWatch.judge``); tests feed it rows built by hand.

What it watches, per *stream* (one process's communicator) and, inside it,
per *signature* (the op, the bytes and the peer of a call: a step's
AllReduce of 1 MiB and its loss AllReduce of 8 bytes are two rhythms):

- the **interval**: the time from one call of a signature to the next (the
  job's pace; in every mode, since a call's entry is seen at once);
- the **duration** of each call, once it settled (returned; on the device,
  completed, where the CUDA probes see it).

Both go into buckets of ``BUCKET_NS`` of their calls' times; each bucket
keeps its median, and a signature's **baseline** is the median of its bucket
medians over the last ``baseline_s`` (recomputed as each bucket closes),
leaving out the latest ``window_s`` and the bucket before: a moving, robust
baseline that a checkpoint's one long interval does not move, and that a
slowdown only becomes after half of ``baseline_s``.

Three conditions, each sustained before it is reported (lateness read on
the host or on the device):

- **slow rhythm**: a stream's *slowdown factor* (per signature, the median of
  its last ``RECENT`` intervals over its baseline; the median over its
  signatures) is ``factor`` or more, every tick for ``window_s``, while the
  stream keeps calling (its last call within ``window_s``).  A checkpoint is
  one long interval per signature among ``RECENT``: the medians do not move;
  a pause with no call at all is no slowdown (the stall watchdog's, past
  ``--stall-timeout``).
- **a rank persistently last**: among the ranks of this node that share a
  communicator (matched by seq, one clock), one enters last in
  ``LATE_LAST_SHARE`` of the last ``LATE_RECENT`` collectives of one
  signature, later than the first by ``late_share`` of that signature's
  baseline interval more than it was in its own baseline (and
  ``LATE_MIN_NS``), for ``window_s``.  Per signature: a rank that computes
  longer is late at the first collective of each step only, and its peers
  wait for it there; at the step's later collectives every member enters
  together, in any order (on a 4x2 lab job, a rank 150 ms slower was last
  at its communicators' first collective each step and at half of the rest:
  judged over all of them, never 90%).
  Calls timed on the device (the CUDA probes' ``started_ns``) are judged by
  when each device started the collective, not by the host's entry: a gpu
  job's host only enqueues, on time, while its device starts late and its
  peers' kernels wait for it; last in ``LATE_LAST_SHARE_DEVICE`` of them
  (a checkpoint's barrier lines every device's queue up behind it, and the
  slow device is not last at the next collective or two: seen on 3x2 gpu
  lab runs, while a healthy gpu run's devices were last in at most 75% for
  the window).  Its lateness is no more than its device's own: the wait
  from its host's entry to its device's start, beyond the quickest
  member's (a host starved of CPU enqueues late, and its idle device starts
  late with it: on a healthy gpu lab run, rank 0's host and device 300-480
  ms behind its peer's for 15 s).  The margin is then ``device_late_share``
  of the cycle.
  Only this node's ranks are compared: a rank alone on its node is never
  called late here (its slowdown shows as the rhythm of its peers, and the
  analyzer tells who was late from every node's dump).  Judged only on
  communicators whose calls wait on the host here (any member's: the
  late rank's own calls wait for nobody; ``_Stream.blocking``).
- **a held collective**: a call that took ``hold_s`` and ``HOLD_FACTOR``
  times its signature's baseline duration, reported (``Held``) for the agent
  to look for network evidence inside it (``network_evidence``): an outage
  the job came back from is one such call, which no median sees.  It is
  handed over ``held_wait_s`` after it returned, so that the incident's
  dumps hold what followed it too (a lossy link's next collectives: one
  held call's few retransmits tell its host from its peer's no better than
  chance).

Known limits: a signature needs ``MIN_BASELINE_SAMPLES`` intervals over
``MIN_BASELINE_BUCKETS`` buckets before it is judged (a job's first 30 s or
so, and a signature called rarely, are not); communicators made before the
agent attached (hash 0) are judged for their rhythm, never for lateness (no
hash to match their members by); a slowdown of less than ``factor`` with no
local rank late goes unreported (the metrics show it).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from stallwatch.dumpers.schema import LinkEvent, Op, TcpEvent, arrival_lateness, op_name

from .rings import RingBuffer
from .tickstate import Slowdown

SECOND_NS = 1_000_000_000
BUCKET_NS = 5 * SECOND_NS
MIN_BASELINE_SAMPLES = 16  # intervals (or durations) a baseline needs
MIN_BASELINE_BUCKETS = 6  # over at least this many buckets (30 s)
BUCKET_CAP = 4096  # samples a bucket keeps (beyond, every other one is dropped)
RECENT = 3  # a signature's latest intervals its factor is the median of
LATE_RECENT = 16  # collectives a rank's lateness is judged on
LATE_LAST_SHARE = 0.9  # last to enter in this share of them
# on the device, all but two of them: a checkpoint's barrier puts every
# device's queue behind it, and the next collectives or two start together
LATE_LAST_SHARE_DEVICE = 0.85
LATE_MIN_NS = 20_000_000  # and later than it used to be by this much at least
BLOCKING_NS = 1_000_000  # a stream whose calls take this long (median) waits on the host
HOLD_FACTOR = 10.0  # a held call: this many times its baseline duration
SEQS_KEPT = 512  # collectives of a communicator waiting for every local member
# a call that returned settles once the device completed it (CUDA probes), or
# DEVICE_WAIT_NS after its return in a stream not timed on the device; rows
# open for longer than OPEN_MAX_NS (a call in flight that long is the stall
# watchdog's) or more than OPEN_MAX rows are let go
DEVICE_WAIT_NS = SECOND_NS
OPEN_MAX_NS = 120 * SECOND_NS
OPEN_MAX = 1 << 16
# network evidence inside a held call: a job connection with nothing
# acknowledged for this long (or this many timeouts in a row), a carrier lost
NO_ACK_EVIDENCE_NS = SECOND_NS // 2
BACKOFF_EVIDENCE = 2

MIN_BASELINE_S = MIN_BASELINE_BUCKETS * BUCKET_NS / SECOND_NS  # --slowdown-baseline at least

DEFAULT_FACTOR = 3.0
DEFAULT_WINDOW_S = 10.0
DEFAULT_BASELINE_S = 300.0
DEFAULT_LATE_SHARE = 0.5
DEFAULT_HOLD_S = 1.0
DEFAULT_HELD_WAIT_S = 5.0
DEFAULT_DEVICE_LATE_SHARE = 0.1

_CALLS = np.zeros(256, dtype=bool)
_CALLS[[int(op) for op in Op if op.is_collective or op.is_p2p]] = True
_COLLECTIVE = np.zeros(256, dtype=bool)
_COLLECTIVE[[int(op) for op in Op if op.is_collective]] = True
_KEY_FIELDS = ("pid", "comm", "comm_hash", "rank", "nranks", "op", "bytes", "peer", "seq")
_ENTRY_FIELDS = ("ts_ns", *_KEY_FIELDS)
_SETTLED_FIELDS = ("ts_ns", "end_ns", "started_ns", "completed_ns", *_KEY_FIELDS)


@dataclass(frozen=True, slots=True)
class SlowdownConfig:
    """The trigger's settings (``stallwatch record --slowdown-*``)."""

    factor: float = DEFAULT_FACTOR  # 0: the trigger is off (metrics still kept)
    window_s: float = DEFAULT_WINDOW_S
    baseline_s: float = DEFAULT_BASELINE_S
    late_share: float = DEFAULT_LATE_SHARE  # 0: no lateness trigger
    hold_s: float = DEFAULT_HOLD_S  # 0: no held-call trigger
    held_wait_s: float = DEFAULT_HELD_WAIT_S  # after the held call returned
    device_late_share: float = DEFAULT_DEVICE_LATE_SHARE  # 0: no device lateness trigger

    @property
    def on(self) -> bool:
        return self.factor > 0


# ---- robust moving summaries ---------------------------------------------------------


class _Buckets:
    """Samples by their time, in buckets of BUCKET_NS; a closed bucket keeps
    (its end, its median, its count)."""

    __slots__ = ("_closed", "_start", "_values")

    def __init__(self, keep: int) -> None:
        self._start = -1
        self._values: list[int] = []
        self._closed: deque[tuple[int, int, int]] = deque(maxlen=keep)

    def add(self, when: int, value: int) -> bool:
        """Add a sample; True if a bucket closed (the baseline may move)."""
        closed = False
        if self._start < 0:
            self._start = when
        elif when - self._start >= BUCKET_NS:
            closed = self.close()
            self._start = when
        self._values.append(value)
        if len(self._values) > BUCKET_CAP:
            del self._values[::2]
        return closed

    def close(self) -> bool:
        if not self._values:
            return False
        median = int(np.median(self._values))
        self._closed.append((self._start + BUCKET_NS, median, len(self._values)))
        self._values = []
        return True

    def baseline(self, before_ns: int) -> int | None:
        """The median of the medians of the buckets that ended before
        ``before_ns``, if they hold enough samples."""
        kept = [(m, n) for end, m, n in self._closed if end <= before_ns]
        if len(kept) < MIN_BASELINE_BUCKETS or sum(n for _, n in kept) < MIN_BASELINE_SAMPLES:
            return None
        return int(np.median([m for m, _ in kept]))


# ---- what is watched -----------------------------------------------------------------


@dataclass(slots=True)
class _Signature:
    op: int
    nbytes: int
    intervals: _Buckets
    durations: _Buckets
    last_ts: int = 0
    recent: deque[int] = field(default_factory=lambda: deque(maxlen=RECENT))
    base_interval: int | None = None
    base_duration: int | None = None
    # lateness against the first local member to enter, per collective of
    # this signature: (how late, last of them)
    lateness: deque[tuple[int, bool]] = field(default_factory=lambda: deque(maxlen=LATE_RECENT))
    late_buckets: _Buckets | None = None
    base_lateness: int | None = None
    late_since: int | None = None


# when a member entered a collective (or its device started it), its
# signature, and how long its own side took to get there (the host: its
# entry; the device: the wait from the host's entry to the device's start)
_Arrival = tuple[int, tuple[int, int, int], int]


@dataclass(slots=True)
class _Stream:
    """One process's communicator as this node sees it."""

    pid: int
    comm: int
    comm_hash: int
    rank: int
    nranks: int
    sigs: dict[tuple[int, int, int], _Signature] = field(default_factory=dict)
    last_ts: int = 0
    device: bool = False  # its calls complete on the device (CUDA probes)
    host_durations: deque[int] = field(default_factory=lambda: deque(maxlen=LATE_RECENT))
    slow_since: int | None = None
    factor: float | None = None
    durations: deque[int] = field(default_factory=lambda: deque(maxlen=LATE_RECENT))

    @property
    def blocking(self) -> bool:
        """Whether its calls wait on the host (a blocking NCCL): only then
        does a late entry hold its peers up.  Calls that return at once
        (queued on a stream, as real NCCL's) are entered as far ahead as the
        queue lets the host run: one rank's host a step behind another's is
        no straggler."""
        durations = self.host_durations
        return not self.device and len(durations) > 0 and bool(np.median(durations) >= BLOCKING_NS)

    def baseline_interval(self) -> int | None:
        """The pace of the communicator: the median of its signatures' baselines."""
        bases = [s.base_interval for s in self.sigs.values() if s.base_interval]
        return int(np.median(bases)) if bases else None

    def recent_interval(self) -> int | None:
        recent = [int(np.median(s.recent)) for s in self.sigs.values() if len(s.recent) == RECENT]
        return int(np.median(recent)) if recent else None


@dataclass(frozen=True, slots=True)
class Held:
    """A call that took far longer than its baseline: the agent looks for
    network evidence inside it."""

    pid: int
    comm: int
    comm_hash: int
    rank: int
    nranks: int
    seq: int
    op: int
    entered_ns: int
    settled_ns: int
    baseline_ns: int


class Cause:
    RHYTHM = "rhythm"
    LATE = "late"
    HELD = "held"


@dataclass(frozen=True, slots=True)
class StreamGauges:
    """What ``/metrics`` shows of one stream (None: not known yet)."""

    pid: int
    comm_hash: int
    rank: int
    nranks: int
    factor: float | None
    interval_ns: int | None  # its latest pace
    baseline_interval_ns: int | None
    duration_ns: int | None  # its latest calls' median duration
    baseline_duration_ns: int | None
    last_share: float | None  # of its node's ranks on the communicator, how often last
    lateness_ns: int | None
    baseline_lateness_ns: int | None


@dataclass
class SlowdownStats:
    rows_seen: int = 0
    held_calls: int = 0


class SlowdownWatch:
    """The streams of one node and the conditions they are in."""

    def __init__(self, config: SlowdownConfig | None = None) -> None:
        self.config = config or SlowdownConfig()
        self.stats = SlowdownStats()
        self._streams: dict[tuple[int, int], _Stream] = {}
        self._by_hash: dict[int, list[_Stream]] = {}  # this node's members of a communicator
        # comm hash -> seq -> pid -> (entry, signature): the local members'
        # entries; for streams timed on the device, their device starts
        self._entries: dict[int, dict[int, dict[int, _Arrival]]] = {}
        self._starts: dict[int, dict[int, dict[int, _Arrival]]] = {}
        self._keep = (
            math.ceil((self.config.baseline_s + self.config.window_s) * SECOND_NS / BUCKET_NS) + 2
        )
        self._held: list[Held] = []

    # ---- input ------------------------------------------------------------------

    def feed(self, rows: np.ndarray, settled: np.ndarray | None = None) -> None:
        """``rows``: NCCL ring rows seen for the first time (their entries);
        ``settled``: rows whose call has now settled (returned; completed,
        for calls timed on the device), for durations.  A row may be in both."""
        if len(rows):
            calls = rows[_CALLS[rows["op"]] & _uncaptured(rows)]
            calls = calls[np.argsort(calls["ts_ns"], kind="stable")]
            self.stats.rows_seen += len(calls)
            for call in zip(*(calls[f].tolist() for f in _ENTRY_FIELDS), strict=True):
                self._entry(*call)
        if settled is not None and len(settled):
            done = settled[_CALLS[settled["op"]] & _uncaptured(settled)]
            for call in zip(*(done[f].tolist() for f in _SETTLED_FIELDS), strict=True):
                self._settled(*call)

    def _stream(self, pid: int, comm: int, comm_hash: int, rank: int, nranks: int) -> _Stream:
        stream = self._streams.get((pid, comm))
        if stream is None:
            stream = _Stream(pid, comm, comm_hash, rank, nranks)
            self._streams[(pid, comm)] = stream
            if comm_hash:
                self._by_hash.setdefault(comm_hash, []).append(stream)
        return stream

    def _signature(self, stream: _Stream, op: int, nbytes: int, peer: int) -> _Signature:
        sig = stream.sigs.get((op, nbytes, peer))
        if sig is None:
            sig = _Signature(op, nbytes, _Buckets(self._keep), _Buckets(self._keep))
            stream.sigs[(op, nbytes, peer)] = sig
        return sig

    def _entry(
        self,
        ts: int,
        pid: int,
        comm: int,
        comm_hash: int,
        rank: int,
        nranks: int,
        op: int,
        nbytes: int,
        peer: int,
        seq: int,
    ) -> None:
        stream = self._stream(pid, comm, comm_hash, rank, nranks)
        sig = self._signature(stream, op, nbytes, peer)
        if sig.last_ts and ts > sig.last_ts:
            interval = ts - sig.last_ts
            sig.recent.append(interval)
            if sig.intervals.add(ts, interval):
                self._rebase(stream, ts)
        sig.last_ts = max(sig.last_ts, ts)
        stream.last_ts = max(stream.last_ts, ts)
        if comm_hash and _COLLECTIVE[op] and not stream.device:
            self._arrived(self._entries, stream, seq, (ts, (op, nbytes, peer), ts))

    def _settled(
        self,
        ts: int,
        end: int,
        started: int,
        completed: int,
        pid: int,
        comm: int,
        comm_hash: int,
        rank: int,
        nranks: int,
        op: int,
        nbytes: int,
        peer: int,
        seq: int,
    ) -> None:
        stream = self._stream(pid, comm, comm_hash, rank, nranks)
        sig = self._signature(stream, op, nbytes, peer)
        stream.device |= completed > 0
        stream.host_durations.append(end - ts)
        if stream.device and comm_hash and _COLLECTIVE[op] and started >= ts:
            self._arrived(self._starts, stream, seq, (started, (op, nbytes, peer), started - ts))
        end = completed if completed > 0 else end
        if end <= ts:
            return
        duration = end - ts
        stream.durations.append(duration)
        if sig.durations.add(ts, duration):
            self._rebase(stream, ts)
        if self.config.hold_s <= 0 or sig.base_duration is None:
            return
        if duration >= max(self.config.hold_s * SECOND_NS, HOLD_FACTOR * sig.base_duration):
            self.stats.held_calls += 1
            held = Held(pid, comm, comm_hash, rank, nranks, seq, op, ts, end, sig.base_duration)
            self._held.append(held)

    def _rebase(self, stream: _Stream, now: int) -> None:
        """A bucket closed: the stream's baselines, from the buckets that
        ended before the judged window (and the bucket before it)."""
        before = now - int(self.config.window_s * SECOND_NS) - BUCKET_NS
        for sig in stream.sigs.values():
            sig.base_interval = sig.intervals.baseline(before)
            sig.base_duration = sig.durations.baseline(before)
            if sig.late_buckets is not None:
                sig.base_lateness = sig.late_buckets.baseline(before)

    # ---- lateness among this node's ranks ---------------------------------------

    def _arrived(
        self,
        arrivals: dict[int, dict[int, dict[int, _Arrival]]],
        stream: _Stream,
        seq: int,
        arrival: _Arrival,
    ) -> None:
        """A member entered a collective (``_entries``), or its device
        started it (``_starts``): once every local member did, how late each was."""
        members = self._by_hash[stream.comm_hash]
        if len(members) < 2:
            return
        seqs = arrivals.setdefault(stream.comm_hash, {})
        got = seqs.setdefault(seq, {})
        got[stream.pid] = arrival
        if len(got) >= len(members):
            del seqs[seq]
            self._lateness(members, got)
        while len(seqs) > SEQS_KEPT:  # a member that left, or calls it never made
            del seqs[next(iter(seqs))]

    def _lateness(self, members: list[_Stream], got: dict[int, _Arrival]) -> None:
        """Each member's lateness: after the first to arrive, and no more
        than its own side took beyond the quickest member's (a device that
        starts late because its host enqueued late, on time for its queue,
        is its host's lateness: not the device's); the last is the latest so
        counted."""
        first = min(ts for ts, _, _ in got.values())
        quickest = min(own for _, _, own in got.values())
        lates = {
            pid: int(arrival_lateness(ts, first, own, quickest))
            for pid, (ts, _, own) in got.items()
        }
        latest = max(lates.values())
        for m in members:
            entry = got.get(m.pid)
            sig = m.sigs.get(entry[1]) if entry is not None else None
            if entry is None or sig is None:
                continue
            ts, late = entry[0], lates[m.pid]
            sig.lateness.append((late, late == latest > 0))
            if sig.late_buckets is None:
                sig.late_buckets = _Buckets(self._keep)
            if sig.late_buckets.add(ts, late):
                self._rebase(m, ts)

    # ---- judging ----------------------------------------------------------------

    def judge(self, now_ns: int) -> list[Slowdown]:
        """The slowdowns sustained for ``window_s`` now (each stream's
        state moves on: call once per tick)."""
        window = int(self.config.window_s * SECOND_NS)
        out = []
        for stream in self._streams.values():
            stream.factor = self._factor(stream, now_ns, window)
            slow = self._rhythm(stream, now_ns, window)
            if slow is not None:
                out.append(slow)
            late = self._late(stream, now_ns, window)
            if late is not None:
                out.append(late)
        return out if self.config.on else []

    def _factor(self, stream: _Stream, now: int, window: int) -> float | None:
        if now - stream.last_ts > window:
            return None  # not calling: a pause, an end, or a stall (the watchdog's)
        factors = [
            float(np.median(s.recent)) / s.base_interval
            for s in stream.sigs.values()
            if s.base_interval and len(s.recent) == RECENT
        ]
        return float(np.median(factors)) if factors else None

    def _rhythm(self, stream: _Stream, now: int, window: int) -> Slowdown | None:
        f = stream.factor
        if f is None or f < self.config.factor:
            stream.slow_since = None
            return None
        if stream.slow_since is None:
            stream.slow_since = now
        if now - stream.slow_since < window:
            return None
        base, recent = stream.baseline_interval(), stream.recent_interval()
        reason = (
            f"slowdown: {_stream_text(stream)} calls every {_ms(recent)} (median), "
            f"{f:.1f}x its baseline of {_ms(base)}, for {_s(now - stream.slow_since)}"
        )
        return Slowdown(
            Cause.RHYTHM, stream.pid, stream.comm, stream.comm_hash, stream.slow_since, reason
        )

    def _waits_on_host(self, stream: _Stream) -> bool:
        """Whether the communicator's calls wait on the host: those of any of
        this node's members (``_Stream.blocking``).  The late rank's own
        calls do not: its peers waited for it, it waits for nobody."""
        if not stream.comm_hash:
            return stream.blocking
        return any(m.blocking for m in self._by_hash.get(stream.comm_hash, [stream]))

    def _judged_late(self, stream: _Stream) -> bool:
        """Whether lateness is judged on the stream: its device starts, when
        its calls complete on the device (a collective's kernel waits there
        for its peers'); its host entries, when its communicator's calls
        wait on the host."""
        if stream.device:
            return self.config.device_late_share > 0
        return self.config.late_share > 0 and self._waits_on_host(stream)

    def _late(self, stream: _Stream, now: int, window: int) -> Slowdown | None:
        """The rank late at one kind of collective (a signature) for
        ``window``: a rank that computes longer is late at the first
        collective of each step only; after it, every member enters at once."""
        waits = self._judged_late(stream)
        found: Slowdown | None = None
        for sig in stream.sigs.values():
            since = self._late_since(stream, sig, now, window) if waits else None
            sig.late_since = since
            if since is None or now - since < window:
                continue
            if found is None or since < found.since_ns:
                found = self._late_slowdown(stream, sig, now)
        return found

    def _late_since(self, stream: _Stream, sig: _Signature, now: int, window: int) -> int | None:
        share, late = _last_share(sig), _median_lateness(sig)
        cycle = sig.base_interval or stream.baseline_interval()
        base = sig.base_lateness
        if share is None or late is None or cycle is None or base is None:
            return None
        if now - sig.last_ts > window:
            return None
        share_of_cycle = self.config.device_late_share if stream.device else self.config.late_share
        margin = max(LATE_MIN_NS, share_of_cycle * cycle)
        if share < last_share_needed(stream.device) or late - base < margin:
            return None
        return now if sig.late_since is None else sig.late_since

    def _late_slowdown(self, stream: _Stream, sig: _Signature, now: int) -> Slowdown:
        share, late = _last_share(sig) or 0.0, _median_lateness(sig) or 0
        cycle = sig.base_interval or stream.baseline_interval() or 0
        since = sig.late_since if sig.late_since is not None else now
        reason = (
            f"slowdown: {_stream_text(stream)} is the last of this node's ranks "
            f"{'whose device starts' if stream.device else 'to enter'} "
            f"{share:.0%} of its latest {len(sig.lateness)} {op_name(sig.op)} calls, "
            f"{_ms(late)} after the first (median; {_ms(sig.base_lateness or 0)} in its "
            f"baseline, called every {_ms(cycle)}), for {_s(now - since)}"
        )
        return Slowdown(Cause.LATE, stream.pid, stream.comm, stream.comm_hash, since, reason)

    def held(self, now_ns: int) -> list[Held]:
        """The held calls that returned ``held_wait_s`` or more before
        ``now_ns``, each handed over once."""
        due = now_ns - int(self.config.held_wait_s * SECOND_NS)
        out = [h for h in self._held if h.settled_ns <= due]
        self._held = [h for h in self._held if h.settled_ns > due]
        return out

    # ---- upkeep and metrics -----------------------------------------------------

    def forget(self, alive: Iterable[int]) -> None:
        """Streams (and held calls) of processes no longer alive go."""
        keep = set(alive)
        self._held = [h for h in self._held if h.pid in keep]
        for key in [k for k in self._streams if k[0] not in keep]:
            stream = self._streams.pop(key)
            if stream.comm_hash:
                members = self._by_hash[stream.comm_hash]
                members.remove(stream)
                if not members:
                    del self._by_hash[stream.comm_hash]
                    self._entries.pop(stream.comm_hash, None)
                    self._starts.pop(stream.comm_hash, None)

    def device_stream(self, pid: int, comm: int) -> bool:
        stream = self._streams.get((pid, comm))
        return stream is not None and stream.device

    def gauges(self) -> list[StreamGauges]:
        out = []
        for s in sorted(self._streams.values(), key=lambda s: (s.comm_hash, s.rank, s.pid)):
            bases = [x.base_duration for x in s.sigs.values() if x.base_duration]
            waits = self._judged_late(s)  # lateness only then: see _Stream.blocking
            worst = _latest_signature(s)
            out.append(
                StreamGauges(
                    s.pid,
                    s.comm_hash,
                    s.rank,
                    s.nranks,
                    s.factor,
                    s.recent_interval(),
                    s.baseline_interval(),
                    int(np.median(s.durations)) if s.durations else None,
                    int(np.median(bases)) if bases else None,
                    _last_share(worst) if waits and worst else None,
                    _median_lateness(worst) if waits and worst else None,
                    worst.base_lateness if waits and worst else None,
                )
            )
        return out


def last_share_needed(device: bool) -> float:
    """How often a rank must be the last to arrive to be late: its host's
    entries, or its device's starts."""
    return LATE_LAST_SHARE_DEVICE if device else LATE_LAST_SHARE


def _last_share(sig: _Signature) -> float | None:
    if len(sig.lateness) < LATE_RECENT:
        return None
    return sum(last for _, last in sig.lateness) / len(sig.lateness)


def _median_lateness(sig: _Signature) -> int | None:
    if len(sig.lateness) < LATE_RECENT:
        return None
    return int(np.median([late for late, _ in sig.lateness]))


def _latest_signature(stream: _Stream) -> _Signature | None:
    """The signature at which the stream's rank is the most often last (of
    equal shares, the one it is latest at, against its baseline): the
    communicator's lateness on /metrics."""
    judged = [s for s in stream.sigs.values() if len(s.lateness) >= LATE_RECENT]
    if not judged:
        return None

    def key(s: _Signature) -> tuple[float, int]:
        return (_last_share(s) or 0.0, (_median_lateness(s) or 0) - (s.base_lateness or 0))

    return max(judged, key=key)


def _uncaptured(rows: np.ndarray) -> np.ndarray:
    """Calls that run: not the ones captured into a CUDA graph (their
    replays are rows of their own)."""
    out: np.ndarray = (rows["graph"] == 0) | (rows["replay"] != 0)
    return out


def _stream_text(s: _Stream) -> str:
    ops = sorted({op_name(sig.op) for sig in s.sigs.values()})
    comm = f"communicator {s.comm_hash:#018x}" if s.comm_hash else "a communicator made before "
    if not s.comm_hash:
        comm += "the agent started"
    rank = f"rank {s.rank} of {s.nranks}" if s.rank >= 0 else "rank unknown"
    return f"pid {s.pid} ({rank} on {comm}; {', '.join(ops)})"


def _ms(ns: int | None) -> str:
    if ns is None:
        return "unknown"
    return f"{ns / 1e6:.1f} ms" if ns < SECOND_NS else f"{ns / SECOND_NS:.1f} s"


def _s(ns: int) -> str:
    return f"{ns / SECOND_NS:.1f} s"


# ---- the ring's rows as they appear and settle ---------------------------------------


class RowFollower:
    """Each tick, the NCCL ring's rows written since the last tick, and the
    rows seen before that settled since (a uretprobe completes the row its
    entry opened, the CUDA probes add the device's completion later): the
    positions of the rows still open are kept and looked at again, nothing
    else is read twice.  A row still being written when its turn came is
    read at the next tick; a row overwritten meanwhile is let go."""

    def __init__(self, ring: RingBuffer, after: int = 0) -> None:
        self.ring = ring
        self.after = after  # the last position read
        self._open = np.zeros(0, dtype=np.int64)  # rows seen, not settled
        self._torn = np.zeros(0, dtype=np.int64)  # rows being written when read
        # the rows that returned and did not settle at the last poll: waiting
        # for the device (or for DEVICE_WAIT_NS to say it is not timed there)
        self.waiting: np.ndarray = np.zeros(0, dtype=ring.slots.dtype)

    def poll(
        self, now_ns: int, device: Callable[[int, int], bool]
    ) -> tuple[np.ndarray, np.ndarray]:
        """(rows seen for the first time, rows settled now); ``device(pid,
        comm)``: whether a stream's calls complete on the device (its rows
        then wait for it)."""
        head = self.ring.read_head()
        lo = max(self.after, head - self.ring.capacity)
        want = np.concatenate([self._torn, np.arange(lo + 1, head + 1, dtype=np.int64)])
        self.after = head
        new, ok = self._gather(want)
        self._torn = want[~ok & (want > head - self.ring.capacity)][-OPEN_MAX:]
        old, alive = self._gather(self._open)
        positions = np.concatenate([self._open[alive], want[ok]])
        rows = np.concatenate([old, new])
        done = _settled(rows, now_ns, device)
        keep = ~done & (now_ns - rows["ts_ns"].astype(np.int64) < OPEN_MAX_NS)
        self._open = positions[keep][-OPEN_MAX:]
        self.waiting = rows[keep & (rows["end_ns"] != 0)][-OPEN_MAX:]
        return new, rows[done]

    def _gather(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows at these positions (a copy), and which of them are whole
        (their slot holds that position: written, not overwritten)."""
        rows = self.ring.slots[(positions - 1) & (self.ring.capacity - 1)]
        ok = rows["pos"].astype(np.int64) == positions
        return rows[ok], ok


def _settled(rows: np.ndarray, now_ns: int, device: Callable[[int, int], bool]) -> np.ndarray:
    """Per row: returned, and completed on the device or not waiting for it."""
    out: np.ndarray = rows["end_ns"] != 0
    waiting = out & (rows["completed_ns"] == 0)
    if waiting.any():
        idx = np.flatnonzero(waiting)
        recent = now_ns - rows["end_ns"][idx].astype(np.int64) < DEVICE_WAIT_NS
        pairs = zip(rows["pid"][idx].tolist(), rows["comm"][idx].tolist(), strict=True)
        on_device = np.array([device(p, c) for p, c in pairs], dtype=bool)
        out[idx[recent | on_device]] = False
    return out


def replay_ticks(
    watch: SlowdownWatch, rows: np.ndarray, tick_ns: int, until_ns: int | None = None
) -> Iterator[tuple[int, list[Slowdown]]]:
    """Recorded rows fed to ``watch`` tick by tick as the agent feeds its
    ring's (a row settles once it returned, and completed where the device
    completes it), each tick judged: (tick, slowdowns raised then), up to
    ``until_ns`` or one tick past the last row's end.  For replaying dumps
    (bench.slowdown_replay) and rows built by hand (the tests)."""
    rows = rows[np.argsort(rows["ts_ns"], kind="stable")]
    if not len(rows):
        return
    end = np.maximum(rows["end_ns"], rows["completed_ns"]).astype(np.int64)
    last = int(until_ns if until_ns is not None else end.max() + tick_ns)
    fed, settled = 0, np.zeros(len(rows), dtype=bool)
    for now in range(int(rows["ts_ns"][0]), last, tick_ns):
        hi = int(np.searchsorted(rows["ts_ns"], now, side="right"))
        done = np.flatnonzero(~settled[:hi] & (end[:hi] > 0) & (end[:hi] <= now))
        settled[done] = True
        watch.feed(rows[fed:hi], rows[done])
        fed = hi
        yield now, watch.judge(now)


# ---- network evidence inside a held call ---------------------------------------------


def network_evidence(held: Held, tcp: np.ndarray, links: np.ndarray) -> str | None:
    """What the node's rings say the network did while ``held`` was held:
    a job connection whose data went unacknowledged (``NO_ACK_EVIDENCE_NS``,
    or ``BACKOFF_EVIDENCE`` timeouts in a row), or an interface that lost
    its carrier; None if nothing (a checkpoint's barrier, a slow peer)."""
    lo, hi = held.entered_ns, held.settled_ns
    inside = (tcp["ts_ns"] >= lo) & (tcp["ts_ns"] <= hi) if len(tcp) else np.zeros(0, bool)
    rt = tcp[inside & (tcp["event"] == TcpEvent.TCP_RETRANSMIT_SKB)] if len(tcp) else tcp
    stopped = rt[
        ((rt["conn_known"] == 1) & (rt["no_ack_ns"] >= NO_ACK_EVIDENCE_NS))
        | (rt["backoff"] >= BACKOFF_EVIDENCE)
    ]
    if len(stopped):
        longest = int(stopped["no_ack_ns"].max())
        conns = len(np.unique(stopped["skaddr"]))
        silent = f"nothing acknowledged for up to {_ms(longest)}, " if longest else ""
        return (
            f"{len(rt)} retransmits of this node's job connections inside it; on "
            f"{conns} connection(s) {silent}{int(stopped['backoff'].max())} timeouts in a row"
        )
    if len(links):
        down = links[
            (links["ts_ns"] >= lo)
            & (links["ts_ns"] <= hi)
            & np.isin(links["event"], [LinkEvent.CARRIER_DOWN, LinkEvent.CARRIER_FLAP])
        ]
        if len(down):
            return f"an interface of this node lost its carrier inside it ({len(down)} readings)"
    return None


def held_slowdown(held: Held, evidence: str) -> Slowdown:
    """The incident a held call with network evidence inside it is."""
    comm = f"communicator {held.comm_hash:#018x}" if held.comm_hash else "a communicator"
    rank = f"rank {held.rank} of {held.nranks}" if held.rank >= 0 else "rank unknown"
    reason = (
        f"slowdown: {op_name(held.op)} seq {held.seq} on {comm} (pid {held.pid}, {rank}) "
        f"held {_ms(held.settled_ns - held.entered_ns)} "
        f"against {_ms(held.baseline_ns)} in its baseline; {evidence}"
    )
    return Slowdown(Cause.HELD, held.pid, held.comm, held.comm_hash, held.entered_ns, reason)

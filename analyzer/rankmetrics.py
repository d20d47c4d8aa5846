"""Stage "metrics": per-rank numbers computed from matched calls.

Metrics are kept apart from detectors (``detect.py``): each function here
measures, none decides.  Every time difference is taken between two
timestamps of the same host: durations (return - entry of one call),
lateness among ranks of one host, ages against that host's dump time.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

import numpy as np

from stallwatch.dumpers.schema import PREV_PID_UNKNOWN, Op, State

from .columns import Columns
from .incident import Incident
from .match import Matched

ROOTED_OPS = np.array([Op.BROADCAST, Op.REDUCE, Op.GATHER, Op.SCATTER], dtype=np.uint8)
STALL_MIN_NS = 1_000_000_000  # a frontier older than this (and than 4x p99) is stuck
NEVER = -1
ASYNC_BELOW_NS = 1_000_000  # median call duration under which calls are taken as async
# A collective timed on the device whose members' waits differ little says
# nothing about who was late (the collectives that follow the first one after
# a compute phase start together): left out of arrival scores are those whose
# spread of waits is under this, or under half of the communicator's large
# spreads (its 90th percentile).
DEVICE_WAIT_SPREAD_NS = 5_000_000
DEVICE_WAIT_SPREAD_SHARE = 0.5
RECENT_GROUPS = 256  # stragglers are judged on each communicator's latest collectives
P99_SAMPLE = 1 << 20  # durations sampled for the stall threshold's p99
# clocks of two hosts may differ this much: moments of evidence closer than
# this are not ordered
SKEW_NS = 50_000_000


class MemberState(enum.Enum):
    AT_FRONTIER = "at frontier"
    BEHIND = "behind"
    NO_ROWS = "no rows"  # its window is complete and holds nothing of this comm
    UNKNOWN = "unknown"  # its ring wrapped past every row of this comm
    NO_DUMP = "no dump"


@dataclass(frozen=True, slots=True)
class Member:
    crank: int
    proc: int  # -1 without a dump
    state: MemberState
    last_seq: int
    last_returned: int
    in_flight: bool
    # when its evidence was taken (wall clock): exact (a dump's capture time,
    # to the clocks' skew) or a lower bound (its latest timestamp: Flight
    # Recorder records no dump time); None where unknown
    moment: int | None = None
    moment_exact: bool = False
    # its last call is pending only because how it ended is unknown: it
    # returned (gloo retires a failed work as a finished one)
    returned: bool = False


class Lag(enum.Enum):
    """Why a member's evidence ends behind its communicator's frontier."""

    STUCK = "stuck"  # its evidence was taken after the frontier began
    OLDER = "older"  # its evidence was taken before: it entered more since
    UNPROVEN = "unproven"  # its evidence cannot be ordered with the frontier


@dataclass(frozen=True, slots=True)
class Frontier:
    comm: int
    seq: int
    op: int
    stuck: bool
    age_ns: int | None  # how long the ranks at the frontier have made no progress
    members: tuple[Member, ...]
    # the last seq every member is proven to have entered (a member completed
    # it), -1 if none
    proven: int = -1
    began: int | None = None  # the earliest entry into the frontier (wall clock)

    def lag(self, m: Member) -> Lag:
        """Completion implies entry: a member whose evidence ends before a
        seq its peers' completions prove it entered, or inside one they
        completed, was read before it went on.  Otherwise it is behind only
        if its evidence was taken after the frontier began (beyond the
        clocks' skew)."""
        running = m.in_flight and not m.returned
        if 0 <= m.last_seq < self.proven or (running and 0 <= m.last_seq <= self.proven):
            return Lag.OLDER
        if self.began is None or m.moment is None:
            return Lag.UNPROVEN
        if m.moment >= self.began + SKEW_NS:
            return Lag.STUCK
        if m.moment_exact and m.moment + SKEW_NS <= self.began:
            return Lag.OLDER
        return Lag.UNPROVEN

    @property
    def laggards(self) -> tuple[Member, ...]:
        """Members whose own dump shows them behind the frontier."""
        lag = (MemberState.BEHIND, MemberState.NO_ROWS)
        return tuple(m for m in self.members if m.state in lag)

    @property
    def unseen(self) -> tuple[Member, ...]:
        """Members no readable dump holds: known only from their peers."""
        return tuple(m for m in self.members if m.state is MemberState.NO_DUMP)


def _stall_threshold(m: Matched, comm: int) -> int:
    sl = m.comm_rows(comm)
    end, ts = m.rows["end"][sl], m.rows["ts"][sl]
    done = end > 0
    if not done.any():
        return STALL_MIN_NS
    durations = (end - ts)[done]
    step = max(1, len(durations) // P99_SAMPLE)
    p99 = float(np.percentile(durations[::step], 99))
    return max(STALL_MIN_NS, int(4 * p99))


def _proven(inc: Incident, m: Matched, comm: int) -> int:
    """The last seq of a communicator that a member completed: a collective
    any member completed proves that every member entered it.  A call that
    returned proves it where calls complete at return: blocking calls (the
    communicator's returned calls take time), or a completion seen (state
    completed, Flight Recorder); an asynchronous return is only an enqueue."""
    if inc.ends_are_completions:
        return int(m.pair_last_returned[m.pairs_of(comm)].max())
    rows = m.rows[m.comm_rows(comm)]
    ok = (rows["end"] > 0) & (rows["result"] == 0)
    if not ok.any():
        return -1
    blocking = float(np.median((rows["end"] - rows["ts"])[ok])) >= ASYNC_BELOW_NS
    proof = ok if blocking else ok & (rows["state"] == State.COMPLETED)
    return int(rows["seq"][proof].max()) if proof.any() else -1


def _proven_by_all(inc: Incident, m: Matched, comm: int) -> int:
    """The last seq of a communicator that some member completed and that
    needs every member to complete: not a rooted op, which a non-root
    completes alone (a gather's source sends and returns)."""
    rows = m.rows[m.comm_rows(comm)]
    ok = (rows["end"] > 0) & (rows["result"] == 0) & ~np.isin(rows["op"], ROOTED_OPS)
    if not ok.any():
        return -1
    if not inc.ends_are_completions:
        blocking = float(np.median((rows["end"] - rows["ts"])[ok])) >= ASYNC_BELOW_NS
        ok &= True if blocking else rows["state"] == State.COMPLETED
    return int(rows["seq"][ok].max()) if ok.any() else -1


def proc_hosts(inc: Incident) -> list[int]:
    index = {h: i for i, h in enumerate(inc.hosts)}
    return [index[p.host] for p in inc.procs]


def frontiers(inc: Incident, m: Matched, proc_host: list[int]) -> tuple[Frontier, ...]:
    """The frontier of every communicator with rows, the per-member numbers
    taken for all pairs at once (an incident of 131,072 ranks has tens of
    thousands of communicators: no numpy call per member)."""
    pairs = int(m.pair_offset[-1])
    if not pairs or not len(m.rows):
        return ()
    last = m.pair_last_seq
    starts = m.pair_offset[:-1]
    sized = np.diff(m.pair_offset) > 0
    top = np.full(len(inc.comms), -1, dtype=np.int64)
    top[sized] = np.maximum.reduceat(last, starts[sized])
    comm_of = np.repeat(np.arange(len(inc.comms)), np.diff(m.pair_offset))
    row = m.pair_last_row
    has = row >= 0
    at = np.where(has, row, 0)
    r = m.rows
    flight = has & (r["end"][at] == 0)
    front = has & (r["seq"][at] == top[comm_of])
    host = np.array(proc_host, dtype=np.int64)[r["proc"][at]] if len(proc_host) else at * 0
    now = np.array([-1 if t is None else t for t in inc.host_now], dtype=np.int64)[host]
    age = now - np.maximum(r["ts"][at], r["end"][at])
    aged = front & (now >= 0)
    ops = r["op"][at]
    members = [p for c in inc.comms for p in c.members]
    complete = [p.window_complete for p in inc.procs]
    moment, exact = evidence_moments(inc, proc_host)
    offset = np.array([_offset(inc, h) for h in range(len(inc.hosts))], dtype=np.int64)[host]
    entered = np.where(has & (offset != NO_OFFSET), r["ts"][at] + offset, NO_OFFSET)
    out = []
    cols = (last.tolist(), m.pair_last_returned.tolist(), flight.tolist(), front.tolist(),
            aged.tolist(), age.tolist(), ops.tolist())  # fmt: skip
    when = (
        [moment[h] for h in host.tolist()],
        [exact[h] for h in host.tolist()],
        entered.tolist(),
        (has & (r["state"][at] == State.ENQUEUED) & (r["end"][at] == 0)).tolist(),
    )
    for comm in np.flatnonzero(top >= 0).tolist():
        f = _frontier_of(inc, m, comm, int(top[comm]), members, complete, cols)
        out.append(_with_moments(inc, m, f, int(m.pair_offset[comm]), when))
    return tuple(out)


NO_OFFSET = np.iinfo(np.int64).min  # a host whose clock cannot be read as wall clock


def _offset(inc: Incident, host: int) -> int:
    off = inc.to_wall(host)
    return NO_OFFSET if off is None else off


def evidence_moments(inc: Incident, proc_host: list[int]) -> tuple[list[int | None], list[bool]]:
    """Per host: when its evidence was taken, wall clock, and whether that is
    exact: a dump's capture time, else its latest timestamp (a lower bound:
    Flight Recorder records no dump time); None where its clock is unknown."""
    n = len(inc.hosts)
    captured = list(inc.captured) if inc.captured else [None] * n
    latest = np.full(n, -1, dtype=np.int64)
    rows = inc.calls.rows
    if any(c is None for c in captured) and len(rows) and proc_host:
        host = np.asarray(proc_host, dtype=np.int64)[rows["proc"]]
        np.maximum.at(latest, host, np.maximum(rows["ts"], rows["end"]))
    moments: list[int | None] = []
    for h in range(n):
        off = inc.to_wall(h)
        if captured[h] is not None:
            moments.append(captured[h])
        elif off is not None and latest[h] >= 0:
            moments.append(int(latest[h]) + off)
        else:
            moments.append(None)
    return moments, [c is not None for c in captured]


def _with_moments(
    inc: Incident,
    m: Matched,
    f: Frontier,
    lo: int,
    when: tuple[list[int | None], list[bool], list[int], list[bool]],
) -> Frontier:
    """The frontier with when each member's evidence was taken, when the
    frontier began and what completions prove: only where a member lags
    (a world of 131,072 members that all agree needs none of it)."""
    if not f.laggards:
        return f
    moment, exact, entered, returned = when
    members = tuple(
        x
        if x.proc < 0
        else dataclasses.replace(
            x,
            moment=moment[lo + x.crank],
            moment_exact=exact[lo + x.crank],
            returned=returned[lo + x.crank],
        )
        for x in f.members
    )
    began = [
        entered[lo + x.crank]
        for x in f.members
        if x.state is MemberState.AT_FRONTIER and entered[lo + x.crank] != NO_OFFSET
    ]
    return dataclasses.replace(
        f,
        members=members,
        proven=_proven_by_all(inc, m, f.comm),
        began=min(began) if began else None,
    )


def _frontier_of(
    inc: Incident,
    m: Matched,
    comm: int,
    f: int,
    members: list[int],
    complete: list[bool],
    cols: tuple[list[int], list[int], list[bool], list[bool], list[bool], list[int], list[int]],
) -> Frontier:
    last, ret, flight, front, aged, age, ops = cols
    lo, hi = int(m.pair_offset[comm]), int(m.pair_offset[comm + 1])
    unseen = any(p < 0 for p in inc.comms[comm].members)
    proven = _proven(inc, m, comm) if unseen else -1
    out = []
    ages: list[int] = []
    op = 0
    flying = False
    for p in range(lo, hi):
        proc, seq, in_flight = members[p], last[p], flight[p]
        if proc < 0:
            state, seq, in_flight = MemberState.NO_DUMP, proven, False
        elif seq == f:
            flying |= in_flight
            state = MemberState.AT_FRONTIER
            if front[p]:
                op = ops[p]
                if aged[p]:
                    ages.append(age[p])
        elif seq >= 0:
            state = MemberState.BEHIND
        elif complete[proc]:
            state = MemberState.NO_ROWS
        else:
            state = MemberState.UNKNOWN
        out.append(Member(p - lo, proc, state, seq, ret[p], in_flight))
    median = int(np.median(ages)) if ages else None
    # no dump time (Flight Recorder): stuck while a call is pending there
    stuck = flying if median is None else median >= _stall_threshold(m, comm)
    return Frontier(comm, f, op, stuck, median, tuple(out))


@dataclass(frozen=True, slots=True)
class Disagreement:
    comm: int
    seq: int
    field: str
    consensus: int
    odd: tuple[tuple[int, int], ...]  # (row index, value) of the odd ones
    tie: bool


# in the order a disagreement is told: the first one found explains the rest
DESYNC_FIELDS = ("op", "count", "datatype", "redop", "root", "shape")


def disagreements(m: Matched) -> list[Disagreement]:
    """Groups whose members disagree on a field, with the majority value.
    Counts and shapes are of each rank's own data (inputs, or the outputs of
    scatter and reduce_scatter); all-to-all splits are uneven by design and
    not compared; a shape is compared where every member's is known."""
    if not len(m.rows):
        return []
    out = []
    op = m.rows["op"]
    for field in DESYNC_FIELDS:
        vals = m.rows[field]
        if field == "root":
            vals = np.where(np.isin(op, ROOTED_OPS), vals, -1)
        elif field in ("count", "shape"):
            vals = np.where(op == Op.ALL_TO_ALL, -1, vals.astype(np.int64))
            if field == "shape":
                vals[vals == 0] = -1
        lo = np.minimum.reduceat(vals, m.group_start)
        hi = np.maximum.reduceat(vals, m.group_start)
        odd = (lo != hi) & (lo >= 0) if field == "shape" else lo != hi
        for g in np.flatnonzero(odd).tolist():
            out.append(_majority(m, vals, g, field))
    return out


def _majority(m: Matched, vals: np.ndarray, g: int, field: str) -> Disagreement:
    start = int(m.group_start[g])
    idx = np.arange(start, start + int(m.group_size[g]))
    uniq, counts = np.unique(vals[idx], return_counts=True)
    best = counts.max()
    winners = uniq[counts == best]
    tie = len(winners) > 1
    consensus = int(winners[0])
    if tie:  # fall back on what the communicator did just before
        prev = g - 1
        if prev >= 0 and m.group_comm[prev] == m.group_comm[g]:
            p0 = int(m.group_start[prev])
            before = np.unique(vals[p0 : p0 + int(m.group_size[prev])])
            hits = [int(w) for w in winners if int(w) in before.tolist()]
            if len(hits) == 1:
                consensus, tie = hits[0], False
    odd = tuple((int(i), int(vals[i])) for i in idx if int(vals[i]) != consensus)
    return Disagreement(int(m.group_comm[g]), int(m.group_seq[g]), field, consensus, odd, tie)


@dataclass(frozen=True, slots=True)
class ArrivalScore:
    """How a rank arrives at a communicator's collectives, against its peers."""

    comm: int
    crank: int
    proc: int
    groups: int  # complete groups measured
    last_fraction: float  # share of groups where it is judged the last to arrive
    margin_ns: int  # median of how much later than its peers it is judged to arrive
    peer_wait_ns: int  # median duration of its peers' calls
    own_wait_ns: int  # median duration of its own calls
    method: str  # "wait" (blocking durations) or "host-lateness" / "lateness"
    nranks: int = 2
    period_ns: int = 0  # median time between a rank's entries into consecutive collectives
    device: bool = False  # judged on the device's timeline (CUDA probes)


def arrival_scores(inc: Incident, m: Matched) -> list[ArrivalScore]:
    """Blocking: the last to arrive waits least (shortest duration).  Async
    (durations tiny): entry lateness against peers, on the same host when it
    has peers there, else against all (the detector demands a large margin)."""
    out: list[ArrivalScore] = []
    done = set()
    for comm, scores in _grid_scores(inc, m):
        done.add(comm)
        out.extend(scores)
    for comm, c in enumerate(inc.comms):
        if c.nranks < 2 or comm in done:
            continue
        sl = m.comm_rows(comm)
        rows, gid = m.rows.select(("ts", "end", "crank", "proc", "device"))[sl], m.gid[sl]
        if not len(rows):
            continue
        if int(gid[-1] - gid[0]) >= RECENT_GROUPS:  # what led to the stall, not all history
            start = int(np.searchsorted(gid, gid[-1] - RECENT_GROUPS + 1))
            rows, gid = rows[start:], gid[start:]
        if rows["device"].any():
            rows = rows.select(rows.names)  # its own columns: "end" is replaced
            rows["end"] = _shared_completion(rows, gid)
        complete = _complete_groups(m, rows, gid, c.nranks) & _telling(rows, gid)
        if not complete.any():
            continue
        if not complete.all():  # else keep the views: no copy of the table
            keep = np.flatnonzero(complete)
            first, last = int(keep[0]), int(keep[-1])
            if last - first + 1 == len(keep):  # one run (the frontier is cut off): views
                rows, gid = rows[first : last + 1], gid[first : last + 1]
            else:
                rows, gid = rows.take(keep), gid[keep]
        scores = _wait_scores(inc, comm, rows, gid, c.nranks)
        if np.median(rows["end"] - rows["ts"]) < ASYNC_BELOW_NS:  # calls return at once
            scores += _lateness_scores(inc, comm, rows, gid, c.nranks)
        period = _period(rows, gid)
        device = bool(rows["device"].all())
        out.extend(
            dataclasses.replace(s, nranks=c.nranks, period_ns=period, device=device) for s in scores
        )
    return out


GRID_CHUNK = 1 << 22  # calls scored at once by _grid_scores (bounds its temporaries)


def _grid_windows(m: Matched, nranks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per communicator: the first row and the number of the complete groups
    (every member entered and returned) of its straggler window, and whether
    they are one run of two or more (then their rows are one slice; whether
    each group holds one row per rank in rank order is the caller's check)."""
    ncomms = len(nranks)
    gcomm = m.group_comm.astype(np.int64)
    lowest_end = np.minimum.reduceat(m.rows["end"], m.group_start)
    complete = (m.group_size == nranks[gcomm]) & (lowest_end > 0)
    g_lo = np.searchsorted(gcomm, np.arange(ncomms))
    g_hi = np.searchsorted(gcomm, np.arange(ncomms), side="right")
    w_lo = np.maximum(g_lo, g_hi - RECENT_GROUPS)
    before = np.r_[0, np.cumsum(complete)]
    count = before[g_hi] - before[w_lo]
    which = np.flatnonzero(complete)
    if not len(which):
        return np.zeros(ncomms, np.int64), count, np.zeros(ncomms, dtype=bool)
    first = which[np.minimum(before[w_lo], len(which) - 1)]
    last = which[np.maximum(before[g_hi] - 1, 0)]
    ok = (count >= 2) & (nranks >= 2) & (last - first + 1 == count)
    return m.group_start[first], count, ok


def _grid_scores(inc: Incident, m: Matched) -> list[tuple[int, list[ArrivalScore]]]:
    """``_wait_scores`` (and the period) of every communicator whose window
    is a grid (``_grid_windows``), communicators of one size and window
    length together, a chunk at a time: the same numbers, without a round
    of numpy calls per communicator."""
    if not len(m.rows) or not len(inc.comms):
        return []
    nranks = np.array([c.nranks for c in inc.comms], dtype=np.int64)
    start, groups, ok = _grid_windows(m, nranks)
    out: list[tuple[int, list[ArrivalScore]]] = []
    cand = np.flatnonzero(ok)
    shapes: list[list[int]] = (
        np.unique(np.stack([nranks[cand], groups[cand]]), axis=1).T.tolist() if len(cand) else []
    )
    for n, g in shapes:
        comms = cand[(nranks[cand] == n) & (groups[cand] == g)]
        per = max(1, GRID_CHUNK // (n * g))
        for i in range(0, len(comms), per):
            out += _grid_chunk(inc, m, comms[i : i + per], start, int(n), int(g))
    return out


def _grid_chunk(
    inc: Incident, m: Matched, comms: np.ndarray, start: np.ndarray, n: int, g: int
) -> list[tuple[int, list[ArrivalScore]]]:
    index = start[comms][:, None] + np.arange(g * n)[None, :]
    crank = m.rows["crank"][index].reshape(-1, g, n)
    grid = (crank == np.arange(n)).all(axis=(1, 2))
    # device-timed calls keep the per-communicator path (_telling leaves out
    # the collectives whose waits barely differ)
    grid &= ~m.rows["device"][index].any(axis=1)
    ts = m.rows["ts"][index].reshape(-1, g, n)
    dur = m.rows["end"][index].reshape(-1, g, n) - ts
    grid &= np.median(dur.reshape(len(comms), -1), axis=1) >= ASYNC_BELOW_NS
    comms, ts, dur = comms[grid], ts[grid], dur[grid]
    if not len(comms):
        return []
    gmin = dur.min(axis=2, keepdims=True)
    peers = (dur.sum(axis=2, keepdims=True) - dur) / (n - 1)
    mins = (dur == gmin).sum(axis=1)
    k = (g - 1) // 2

    def lower_median(values: np.ndarray) -> np.ndarray:
        cols = np.ascontiguousarray(values.transpose(0, 2, 1))  # a row per rank
        cols.partition(k, axis=2)
        return np.asarray(cols[:, :, k], dtype=np.int64)

    margin, own, peer = lower_median(peers - dur), lower_median(dur), lower_median(peers)
    period = np.median(np.diff(ts, axis=1).reshape(len(comms), -1), axis=1).astype(np.int64)
    out = []
    for i, comm in enumerate(comms.tolist()):
        members = inc.comms[comm].members
        out.append(
            (
                comm,
                [
                    ArrivalScore(
                        comm,
                        r,
                        members[r],
                        g,
                        float(mins[i, r]) / g,
                        int(margin[i, r]),
                        int(peer[i, r]),
                        int(own[i, r]),
                        "wait",
                        n,
                        int(period[i]),
                    )
                    for r in range(n)
                ],
            )
        )
    return out


def _period(rows: Columns, gid: np.ndarray) -> int:
    """Median interval between one rank's entries into consecutive
    collectives of a communicator (one clock: the rank's host's)."""
    if len(rows) < 2:
        return 0
    crank = rows["crank"]
    nranks = int(crank.max()) + 1
    if len(crank) % nranks == 0 and (crank.reshape(-1, nranks) == np.arange(nranks)).all():
        grid = rows["ts"].reshape(-1, nranks)  # complete groups, a row per rank each
        steps = np.diff(gid[::nranks].astype(np.int64))
        if len(steps) and (steps > 0).all():
            return int(np.median(np.diff(grid, axis=0) / steps[:, None]))
    order = np.lexsort((gid, crank))
    ts, g, cr = rows["ts"][order], gid[order].astype(np.int64), rows["crank"][order]
    same = cr[1:] == cr[:-1]
    steps = (g[1:] - g[:-1])[same]
    gaps = (ts[1:] - ts[:-1])[same]
    ok = steps > 0
    if not ok.any():
        return 0
    return int(np.median(gaps[ok] / steps[ok]))


def _shared_completion(rows: Columns, gid: np.ndarray) -> np.ndarray:
    """Per row, its return; in a group timed on the device, the earliest
    completion any member's watchdog saw.  A collective completes on all its
    members together: what one watchdog sees later is the lag of its poll
    (under CPU contention tens of ms), not a longer wait, so on the device a
    member waits from its start to that shared completion.  A start seen
    after it (the same lag on the start's side) counts as no wait."""
    starts = np.flatnonzero(np.r_[True, gid[1:] != gid[:-1]])
    size = np.diff(np.append(starts, len(gid)))
    end = rows["end"]
    device = np.repeat(np.minimum.reduceat(rows["device"], starts) == 1, size)
    done = np.where(end > 0, end, np.iinfo(np.int64).max)
    first = np.repeat(np.minimum.reduceat(done, starts), size)
    shared = np.where(first == np.iinfo(np.int64).max, 0, np.maximum(first, rows["ts"]))
    out: np.ndarray = np.where(device, shared, end).astype(end.dtype)
    return out


def _telling(rows: Columns, gid: np.ndarray) -> np.ndarray:
    """Per row: False in a device-timed group whose waits barely differ, and
    in a group where the device's start of some member's call is unknown (the
    watchdog saw it completed at its first look): its wait there is unknown,
    and host and device times do not compare.  Groups of processes without
    the CUDA probes are all telling."""
    if not rows["device"].any():
        return np.ones(len(gid), dtype=bool)
    starts = np.flatnonzero(np.r_[True, gid[1:] != gid[:-1]])
    size = np.diff(np.append(starts, len(gid)))
    dur = rows["end"] - rows["ts"]
    spread = np.maximum.reduceat(dur, starts) - np.minimum.reduceat(dur, starts)
    device = np.minimum.reduceat(rows["device"], starts) == 1
    host = np.maximum.reduceat(rows["device"], starts) == 0
    floor = float(DEVICE_WAIT_SPREAD_NS)
    if device.any():
        floor = max(floor, DEVICE_WAIT_SPREAD_SHARE * float(np.percentile(spread[device], 90)))
    out: np.ndarray = np.repeat(host | (device & (spread >= floor)), size)
    return out


def _complete_groups(m: Matched, rows: Columns, gid: np.ndarray, nranks: int) -> np.ndarray:
    full = m.group_size[gid] == nranks
    returned = np.minimum.reduceat(rows["end"], np.flatnonzero(np.r_[True, gid[1:] != gid[:-1]]))
    first = np.r_[True, gid[1:] != gid[:-1]]
    ok_group = np.repeat(returned > 0, np.diff(np.append(np.flatnonzero(first), len(gid))))
    out: np.ndarray = full & ok_group
    return out


def _median_per_rank(values: np.ndarray, crank: np.ndarray, nranks: int) -> np.ndarray:
    """Lower median of ``values`` per comm rank (0 where a rank has none)."""
    if len(crank) % nranks == 0 and len(crank):
        grid = crank.reshape(-1, nranks)
        if (grid == np.arange(nranks)).all():  # complete groups, one row per rank
            cols = np.ascontiguousarray(values.reshape(-1, nranks).T)  # a row per rank
            k = (cols.shape[1] - 1) // 2
            cols.partition(k, axis=1)
            return np.asarray(cols[:, k], dtype=np.int64)
    order = np.lexsort((values, crank))
    bounds = np.searchsorted(crank[order], np.arange(nranks + 1))
    counts = np.diff(bounds)
    mid = np.clip(bounds[:-1] + (counts - 1) // 2, 0, max(len(values) - 1, 0))
    out = values[order[mid]] if len(values) else np.zeros(nranks)
    return np.where(counts > 0, out, 0).astype(np.int64)


def _wait_scores(
    inc: Incident, comm: int, rows: Columns, gid: np.ndarray, nranks: int
) -> list[ArrivalScore]:
    dur = rows["end"] - rows["ts"]
    starts = np.flatnonzero(np.r_[True, gid[1:] != gid[:-1]])
    size = np.diff(np.append(starts, len(gid)))
    gmin = np.repeat(np.minimum.reduceat(dur, starts), size)
    gsum = np.repeat(np.add.reduceat(dur, starts), size)
    peers_mean = (gsum - dur) / np.repeat(np.maximum(size - 1, 1), size)
    is_min = (dur == gmin).astype(np.float64)
    crank = rows["crank"]
    ngroups = len(starts)
    mins = np.bincount(crank, weights=is_min, minlength=nranks)
    margin = _median_per_rank(peers_mean - dur, crank, nranks)
    own = _median_per_rank(dur, crank, nranks)
    peer = _median_per_rank(peers_mean, crank, nranks)
    members = inc.comms[comm].members
    return [
        ArrivalScore(
            comm,
            r,
            members[r],
            ngroups,
            float(mins[r]) / max(ngroups, 1),
            int(margin[r]),
            int(peer[r]),
            int(own[r]),
            "wait",
        )
        for r in range(nranks)
    ]


def _late_within(key: np.ndarray, ts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: how long after the first of its key group it entered, and
    whether it was the last of a group of two or more."""
    order = np.lexsort((ts, key))
    k, t = key[order], ts[order]
    starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
    size = np.diff(np.append(starts, len(k)))
    late = np.empty(len(ts), dtype=np.int64)
    is_last = np.empty(len(ts), dtype=np.float64)
    late[order] = t - np.repeat(t[starts], size)
    last = (t == np.repeat(np.maximum.reduceat(t, starts), size)) & (np.repeat(size, size) >= 2)
    is_last[order] = last.astype(np.float64)
    return late, is_last


def _lateness_scores(
    inc: Incident, comm: int, rows: Columns, gid: np.ndarray, nranks: int
) -> list[ArrivalScore]:
    """Entry lateness: against the ranks of the same host (one clock); a rank
    alone on its host against all ranks (clocks of several hosts: the
    detector then demands a margin far above any skew)."""
    host = np.array(proc_hosts(inc), dtype=np.int64)[rows["proc"]]
    nh = len(inc.hosts)
    ranks_per_host = np.bincount(host[gid == gid[0]], minlength=nh)
    shared = ranks_per_host[host] >= 2
    late_h, last_h = _late_within(gid.astype(np.int64) * nh + host, rows["ts"])
    late_a, last_a = _late_within(gid.astype(np.int64), rows["ts"])
    late = np.where(shared, late_h, late_a)
    is_last = np.where(shared, last_h, last_a)
    crank = rows["crank"]
    ngroups = int(np.count_nonzero(np.r_[True, gid[1:] != gid[:-1]]))
    members = inc.comms[comm].members
    lasts = np.bincount(crank, weights=is_last, minlength=nranks)
    counts = np.bincount(crank, minlength=nranks)
    lates = _median_per_rank(late, crank, nranks)
    own = _median_per_rank(rows["end"] - rows["ts"], crank, nranks)
    rank_host = np.full(nranks, -1, dtype=np.int64)
    rank_host[crank] = host
    out = []
    for r in range(nranks):
        if members[r] < 0 or not counts[r]:
            continue
        method = "host-lateness" if ranks_per_host[rank_host[r]] >= 2 else "lateness"
        score = float(lasts[r]) / max(ngroups, 1)
        out.append(
            ArrivalScore(comm, r, members[r], ngroups, score, int(lates[r]), 0, int(own[r]), method)
        )
    return out


@dataclass(frozen=True, slots=True)
class HostRetransmits:
    host: int
    local: int  # retransmits from its address inside collective windows
    remote: int  # retransmits to its address inside collective windows
    total: int  # all retransmits from its address
    calls: int = 0  # completed collective calls of its ranks


def retransmits_in_windows(inc: Incident, m: Matched) -> list[HostRetransmits]:
    rt = inc.retransmits
    nh = len(inc.hosts)
    if not len(rt):
        return []
    phost = np.array(proc_hosts(inc), dtype=np.int64)
    inside = np.zeros(len(rt), dtype=bool)
    for h in range(nh):
        sel = rt["host"] == h
        if not sel.any():
            continue
        times = m.rows.select(("ts", "end"))
        rows = times[(phost[m.rows["proc"]] == h) & (m.rows["end"] > 0)] if len(m.rows) else times
        inside[sel] = _within(rt["ts"][sel], rows["ts"], rows["end"])
    sent = rt[inside & (rt["local"] >= 0)]
    got = rt[inside & (rt["remote"] >= 0)]
    local = np.bincount(sent["local"], minlength=nh)
    remote = np.bincount(got["remote"], minlength=nh)
    total = np.bincount(rt["local"][rt["local"] >= 0], minlength=nh)
    rows = m.rows
    done = (
        np.bincount(phost[rows["proc"][rows["end"] > 0]], minlength=nh) if len(rows) else total * 0
    )
    return [
        HostRetransmits(h, int(local[h]), int(remote[h]), int(total[h]), int(done[h]))
        for h in range(nh)
    ]


def _within(points: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Whether each point lies inside any [start, end] interval."""
    if not len(starts):
        return np.zeros(len(points), dtype=bool)
    order = np.argsort(starts)
    s, e = starts[order], np.maximum.accumulate(ends[order])
    pos = np.searchsorted(s, points, side="right") - 1
    return (pos >= 0) & (e[np.clip(pos, 0, None)] >= points)


@dataclass(frozen=True, slots=True)
class SchedDelays:
    """Run-queue delay (ns) per proc, by who held the CPU when the wait ended
    (the last holder only: a long wait may have had others before it)."""

    outside: np.ndarray  # a process outside the job (or the idle task)
    by_job: np.ndarray  # a rank of the same job on the same machine
    unknown: np.ndarray  # not recorded (dumps before format 5)

    @property
    def starving(self) -> np.ndarray:
        """What counts as starvation: waits the job did not cause itself.
        Unknown holders count, as they did before holders were recorded."""
        total: np.ndarray = self.outside + self.unknown
        return total


def sched_delays(inc: Incident) -> SchedDelays:
    """Each proc's recorded run-queue delay, split by the CPU's holder: ranks
    sharing too few CPUs wait for each other, which is no interference (an
    oversubscribed job with spinning waiters would call its slowest rank
    starved)."""
    n = len(inc.procs)
    zero = np.zeros(n, dtype=np.int64)
    if not len(inc.sched) or not n:
        return SchedDelays(zero, zero.copy(), zero.copy())
    hosts, pids = np.array(proc_hosts(inc)), np.array([p.pid for p in inc.procs])
    procs = _host_pid_keys(hosts, pids)
    order = np.argsort(procs)
    rows = inc.sched
    keys = _host_pid_keys(rows["host"], rows["pid"])
    pos = np.minimum(np.searchsorted(procs[order], keys), n - 1)
    owner = order[pos]  # the proc whose thread waited, where procs[owner] == keys
    unknown = rows["holder"] == PREV_PID_UNKNOWN
    # a holder is one of the job's ranks when it runs on the waiter's machine
    # (hosts of one kernel share CPUs and pids: the lab's nodes)
    machine = np.array(inc.machines or range(len(inc.hosts)), dtype=np.int64)
    ranks = _host_pid_keys(machine[hosts], pids)
    by_job = ~unknown & np.isin(_host_pid_keys(machine[rows["host"]], rows["holder"]), ranks)

    def per_proc(sel: np.ndarray) -> np.ndarray:
        sel = sel & (procs[owner] == keys)
        out = np.zeros(n, dtype=np.int64)
        np.add.at(out, owner[sel], rows["delay"][sel])
        return out

    return SchedDelays(per_proc(~unknown & ~by_job), per_proc(by_job), per_proc(unknown))


def _host_pid_keys(hosts: np.ndarray, pids: np.ndarray) -> np.ndarray:
    """One int64 per (host or machine index, pid): pids stay below 2**32."""
    return (hosts.astype(np.int64) << 32) | pids.astype(np.int64)


@dataclass(frozen=True, slots=True)
class CommSlowdown:
    """How much slower a communicator's collectives are when retransmits fall
    inside their windows, against its own collectives without any."""

    comm: int
    hosts: tuple[int, ...]  # hosts of its ranks
    groups: int  # complete collectives measured
    hit_groups: int  # of them, with a retransmit inside a member's window
    hit_ns: int  # median duration of those (of their longest member call)
    baseline_ns: int  # median of the others (lower quartile of all when too few)


BASELINE_MIN_GROUPS = 3


def retransmit_slowdowns(inc: Incident, m: Matched) -> list[CommSlowdown]:
    """Per communicator spanning two hosts or more.  A collective's duration
    is its longest member call: a stalled link holds up the whole ring, its
    ranks finishing one after another.  Times are compared within one host:
    a retransmit counts for a call recorded on the host that saw it."""
    rt = inc.retransmits
    if not len(rt) or not len(m.rows):
        return []
    phost = np.array(proc_hosts(inc), dtype=np.int64)
    hits = _retransmits_per_row(inc, m, phost)
    out = []
    for comm, c in enumerate(inc.comms):
        hosts = tuple(sorted({int(phost[p]) for p in c.members if p >= 0}))
        if len(hosts) < 2:
            continue
        s = _slowdown(m, comm, c.nranks, hits)
        if s is not None:
            out.append(CommSlowdown(comm, hosts, *s))
    return out


def _retransmits_per_row(inc: Incident, m: Matched, phost: np.ndarray) -> np.ndarray:
    rows, rt = m.rows, inc.retransmits
    host = phost[rows["proc"]]
    hits = np.zeros(len(rows), dtype=np.int64)
    done = rows["end"] > 0
    for h in np.unique(rt["host"]).tolist():
        t = np.sort(rt["ts"][rt["host"] == h])
        sel = np.flatnonzero((host == h) & done)
        hi = np.searchsorted(t, rows["end"][sel], side="right")
        hits[sel] = hi - np.searchsorted(t, rows["ts"][sel], side="left")
    return hits


def _slowdown(
    m: Matched, comm: int, nranks: int, hits: np.ndarray
) -> tuple[int, int, int, int] | None:
    sl = m.comm_rows(comm)
    rows, gid, hit = m.rows[sl], m.gid[sl], hits[sl]
    if not len(rows):
        return None
    starts = np.flatnonzero(np.r_[True, gid[1:] != gid[:-1]])
    size = np.diff(np.append(starts, len(gid)))
    ok = (np.minimum.reduceat(rows["end"], starts) > 0) & (size == nranks)
    if not ok.any():
        return None
    dur = np.maximum.reduceat(rows["end"] - rows["ts"], starts)[ok]
    ghit = np.maximum.reduceat(hit, starts)[ok] > 0
    n_hit = int(ghit.sum())
    if not n_hit:
        return len(dur), 0, 0, int(np.median(dur))
    clean = dur[~ghit]
    base = clean if len(clean) >= BASELINE_MIN_GROUPS else dur
    q = 50 if len(clean) >= BASELINE_MIN_GROUPS else 25
    return len(dur), n_hit, int(np.median(dur[ghit])), int(np.percentile(base, q))


@dataclass(frozen=True, slots=True)
class P2pGap:
    """Point-to-point messages of one direction (``src`` to ``dst`` on a
    communicator) that one side posted and the other has not: the n-th send
    from src to dst matches the n-th receive at dst from src."""

    comm: int
    src: int  # comm ranks
    dst: int
    waiting: int  # proc that posted the unmatched calls
    missing: int  # proc of the other side, -1 without a dump
    missing_crank: int
    op: int  # what the waiting side posted: SEND or RECV
    seq: int  # its first unmatched one
    posted: int  # how many it posted beyond the other side
    other_last: int  # the other side's last seq in this direction, -1 if none
    age_ns: int | None  # since the waiting side posted the first unmatched call
    idle_ns: int | None  # since the waiting side last did anything at all


P2P_OPS = (int(Op.SEND), int(Op.RECV))


def p2p_gaps(inc: Incident) -> list[P2pGap]:
    """Every direction whose sends and receives do not pair up at the dump.
    A side whose ring wrapped past every row of the direction is unknown,
    not missing: no gap is made of it."""
    rows = inc.calls.rows
    start = max(inc.calls.matched, 0)
    p2p = rows[start:] if start else rows
    n = max((c.nranks for c in inc.comms), default=0)
    peer = p2p["root"]
    sel = np.flatnonzero(np.isin(p2p["op"], P2P_OPS) & (peer >= 0) & (peer < n))
    if not len(sel):
        return []
    t = p2p.select(("comm", "crank", "root", "op", "seq", "ts", "proc")).take(sel)
    is_send = t["op"] == Op.SEND
    # the direction of each row, as (comm, src, dst)
    src = np.where(is_send, t["crank"], t["root"]).astype(np.int64)
    dst = np.where(is_send, t["root"], t["crank"]).astype(np.int64)
    # per direction and side (comm, src, dst, is_send): the last seq posted
    packed = ((t["comm"].astype(np.int64) * n + src) * n + dst) * 2 + is_send
    keys, inverse = np.unique(packed, return_inverse=True)  # len(comms) * n * n * 2 < 2**63
    uniq = np.rec.fromarrays([keys // (2 * n * n), keys // (2 * n) % n, keys // 2 % n, keys % 2])
    top = np.full(len(uniq), -1, dtype=np.int64)
    seq = t["seq"].astype(np.int64)
    np.maximum.at(top, inverse, seq)
    # the other side of each: the same direction, the other op
    pos = np.minimum(np.searchsorted(keys, keys ^ 1), len(keys) - 1)
    other = np.where(keys[pos] == keys ^ 1, top[pos], -1)
    # each side's first call beyond what the other side posted
    ahead = np.flatnonzero(seq > other[inverse])
    ahead = ahead[np.lexsort((seq[ahead], inverse[ahead]))]
    sides, first = np.unique(inverse[ahead], return_index=True)
    hosts = proc_hosts(inc)
    latest = _latest_per_proc(inc)
    out = []
    for side, row in zip(sides.tolist(), ahead[first].tolist(), strict=True):
        comm, s, d, send = (int(x) for x in uniq[side])
        members = inc.comms[comm].members
        missing_crank = d if send else s
        if not (0 <= missing_crank < len(members)):
            continue
        missing = members[missing_crank]
        if other[side] < 0 and missing >= 0 and not inc.procs[missing].window_complete:
            continue  # its ring wrapped: unknown
        waiting = int(t["proc"][row])
        now = inc.host_now[hosts[waiting]]
        out.append(
            P2pGap(
                comm, s, d, waiting, missing, missing_crank, int(Op.SEND if send else Op.RECV),
                int(seq[row]), int(top[side] - other[side]), int(other[side]),
                None if now is None else now - int(t["ts"][row]),
                None if now is None else now - int(latest[waiting]),
            )
        )  # fmt: skip
    return out


def waiting_in_p2p(inc: Incident) -> frozenset[int]:
    """Procs blocked in a point-to-point call (posted, never returned): each
    waits for its peer, like a rank in flight at a collective's frontier.
    (Asynchronous calls return at once: none is ever found here.)"""
    rows = inc.calls.rows
    start = max(inc.calls.matched, 0)
    p2p = rows[start:] if start else rows
    if not len(p2p):
        return frozenset()
    stuck = IS_P2P_OP[p2p["op"]] & (p2p["end"] == 0)
    return frozenset(int(p) for p in np.unique(p2p["proc"][stuck]).tolist())


IS_P2P_OP = np.zeros(256, dtype=bool)
IS_P2P_OP[list(P2P_OPS)] = True


def _latest_per_proc(inc: Incident) -> np.ndarray:
    """Each proc's latest timestamp (entry or return) over all its calls."""
    rows = inc.calls.rows
    out = np.zeros(len(inc.procs), dtype=np.int64)
    if len(rows):
        np.maximum.at(out, rows["proc"], np.maximum(rows["ts"], rows["end"]))
    return out

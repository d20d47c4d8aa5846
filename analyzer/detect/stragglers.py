"""Compute straggler and CPU interference: one rank arrives last, step after
step (in a blocking collective the last to arrive waits least: durations
tell this without trusting clocks across hosts); when its threads wait in the
run queue while its peers wait for it, the verdict is CPU interference.
The metric: each rank's arrival score per communicator, over its latest
collectives (``RECENT_GROUPS``)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from stallwatch.dumpers.schema import arrival_lateness, op_name

from ..columns import Columns
from ..frontier import ASYNC_BELOW_NS
from ..incident import WINDOW_CALLS, ArrivalScore, Incident, proc_hosts
from ..match import Matched
from ..verdict import Verdict, VerdictKind
from .common import Analysis, ms
from .cpu import most_lost, sched_heavy
from .network import detect_network, lossy_hosts, received_mostly
from .paths import link_slowed

# ---- metric: how each rank arrives at its collectives --------------------------------

# A collective timed on the device whose members' waits differ little says
# nothing about who was late (the collectives that follow the first one after
# a compute phase start together): left out of arrival scores are those whose
# spread of waits is under this, or under half of the communicator's large
# spreads (its 90th percentile).
DEVICE_WAIT_SPREAD_NS = 5_000_000
DEVICE_WAIT_SPREAD_SHARE = 0.5
RECENT_GROUPS = WINDOW_CALLS  # stragglers are judged on each communicator's latest collectives


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
        if c.whole < 2 or comm in done:
            continue
        sl = m.comm_rows(comm)
        rows, gid = m.rows.select(("ts", "end", "crank", "proc", "device", "queued"))[sl], m.gid[sl]
        if not len(rows):
            continue
        if int(gid[-1] - gid[0]) >= RECENT_GROUPS:  # what led to the stall, not all history
            start = int(np.searchsorted(gid, gid[-1] - RECENT_GROUPS + 1))
            rows, gid = rows[start:], gid[start:]
        if rows["device"].any():
            rows = rows.select(rows.names)  # its own columns: "ts" and "end" are replaced
            rows["end"] = _shared_completion(rows, gid)
            rows["ts"] = _own_device_start(rows, gid)
        complete = _complete_groups(m, rows, gid, c.whole) & _telling(rows, gid)
        if not complete.any():
            continue
        if not complete.all():  # else keep the views: no copy of the table
            keep = np.flatnonzero(complete)
            first, last = int(keep[0]), int(keep[-1])
            if last - first + 1 == len(keep):  # one run (the frontier is cut off): views
                rows, gid = rows[first : last + 1], gid[first : last + 1]
            else:
                rows, gid = rows.take(keep), gid[keep]
        scores = _wait_scores(inc, comm, rows, gid, c.whole)
        if np.median(rows["end"] - rows["ts"]) < ASYNC_BELOW_NS:  # calls return at once
            scores += _lateness_scores(inc, comm, rows, gid, c.whole)
        period = _period(rows, gid)
        device = bool(rows["device"].all())
        out.extend(
            dataclasses.replace(s, nranks=c.whole, period_ns=period, device=device) for s in scores
        )
    return out


KIND_FIELDS = ("ts", "end", "crank", "proc", "device", "op", "count")


def kind_scores(inc: Incident, m: Matched) -> list[ArrivalScore]:
    """Per communicator whose latest blocking collectives are of more than
    one kind (op and count), each kind's ``_wait_scores`` alone.  A rank that
    computes longer holds its peers up at the first collective of each step
    only; at the step's later ones every member enters together.  Over all of
    a communicator's collectives, how long its pair peer waits is a median of
    a mixture (about half the collectives: the slow rank's lateness; the
    rest: nothing), which lands on either side of the margin from run to run;
    at the first kind alone it waits the whole lateness, every time."""
    out: list[ArrivalScore] = []
    for comm, c in enumerate(inc.comms):
        if c.whole < 2:
            continue
        sl = m.comm_rows(comm)
        if sl.stop - sl.start < 2 * c.whole:
            continue
        rows, gid = m.rows.select(KIND_FIELDS)[sl], m.gid[sl]
        if rows["device"].any():
            continue
        if int(gid[-1] - gid[0]) >= RECENT_GROUPS:
            start = int(np.searchsorted(gid, gid[-1] - RECENT_GROUPS + 1))
            rows, gid = rows[start:], gid[start:]
        complete = _complete_groups(m, rows, gid, c.whole)
        if not complete.any():
            continue
        keep = np.flatnonzero(complete)
        rows, gid = rows.take(keep), gid[keep]
        starts = np.flatnonzero(np.r_[True, gid[1:] != gid[:-1]])
        size = np.diff(np.append(starts, len(gid)))
        op, count = rows["op"][starts].astype(np.int64), rows["count"][starts].astype(np.int64)
        kinds, of_group = np.unique(np.stack([op, count]), axis=1, return_inverse=True)
        if kinds.shape[1] < 2:
            continue
        of_row = np.repeat(of_group.ravel(), size)
        for k in range(kinds.shape[1]):
            sel = np.flatnonzero(of_row == k)
            kr, kg = rows.take(sel), gid[sel]
            # calls that return at once (queued) tell nothing by their
            # durations; judged per kind: a node's pair whose later
            # collectives take microseconds still waits at the first
            if np.median(kr["end"] - kr["ts"]) < ASYNC_BELOW_NS:
                continue
            period = _cadence(kr, kg)
            out.extend(
                dataclasses.replace(s, nranks=c.whole, period_ns=period, op=int(kinds[0, k]))
                for s in _wait_scores(inc, comm, kr, kg, c.whole)
            )
    return out


def _cadence(rows: Columns, gid: np.ndarray) -> int:
    """Median time between one rank's entries into consecutive collectives
    of these rows (one kind: a step's, for a kind called once a step)."""
    order = np.lexsort((gid, rows["crank"]))
    ts, cr = rows["ts"][order].astype(np.int64), rows["crank"][order]
    same = cr[1:] == cr[:-1]
    gaps = (ts[1:] - ts[:-1])[same]
    return int(np.median(gaps)) if len(gaps) else 0


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
    nranks = np.array([c.whole for c in inc.comms], dtype=np.int64)
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


def _own_device_start(rows: Columns, gid: np.ndarray) -> np.ndarray:
    """Per row, its start; in a group timed on the device, the first
    member's start plus no more lateness than the member's device took of
    its own: its wait from its host's entry to its start beyond the
    quickest member's.  A host starved of CPU enqueues late, and its idle
    device starts late with it: that is no slower device (on the loaded
    2-core machine, a gpuslow rank's pair peer's host ran that late in a
    third of the collectives, and its device looked the straggler there)."""
    starts = np.flatnonzero(np.r_[True, gid[1:] != gid[:-1]])
    size = np.diff(np.append(starts, len(gid)))
    ts, queued = rows["ts"].astype(np.int64), rows["queued"].astype(np.int64)
    device = np.repeat(np.minimum.reduceat(rows["device"], starts) == 1, size)
    first = np.repeat(np.minimum.reduceat(ts, starts), size)
    quickest = np.repeat(np.minimum.reduceat(queued, starts), size)
    own = arrival_lateness(ts, first, queued, quickest)
    out: np.ndarray = np.where(device, first + own, ts).astype(rows["ts"].dtype)
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


# ---- the detector --------------------------------------------------------------------

STRAGGLER_FRACTION = 0.75  # last to arrive in at least this share of collectives
STRAGGLER_MARGIN_NS = 5_000_000  # and later than its peers by this much (median)
# Arrival lateness (async calls, no durations to go by) needs more: on a busy
# 2-core machine, healthy and hung async jobs showed ranks 6-29 ms "late"
# from scheduling noise alone.
ARRIVAL_MARGIN_NS = 50_000_000
STRAGGLER_MIN_GROUPS = 8
STRAGGLER_SIGMAS = 3.0  # last more often than chance by this many standard deviations
STRAGGLER_PERIOD_SHARE = 0.25  # margin: at least this share of the time between collectives
CROSS_HOST_MARGIN_NS = 50_000_000  # lateness across hosts: far above any clock skew


def _last_fraction_min(s: ArrivalScore) -> float:
    """Last in a share of collectives that chance would hardly give: of n
    ranks each is last 1/n of the time; three standard deviations above."""
    p = 1.0 / max(s.nranks, 2)
    return max(STRAGGLER_FRACTION, p + STRAGGLER_SIGMAS * math.sqrt(p * (1 - p) / s.groups))


def _is_straggling(s: ArrivalScore) -> bool:
    """Late consistently (in nearly every collective of many) and by a margin
    that counts against the pace of the communicator: a few ms of lateness
    under CPU contention is noise.  (The margin first: it turns away the
    ranks that are not late, nearly all of them, before any arithmetic.)"""
    return (
        s.margin_ns >= (STRAGGLER_MARGIN_NS if s.method == "wait" else ARRIVAL_MARGIN_NS)
        and s.proc >= 0
        and s.groups >= STRAGGLER_MIN_GROUPS
        and s.margin_ns >= STRAGGLER_PERIOD_SHARE * s.period_ns
        and (s.method != "lateness" or s.margin_ns >= CROSS_HOST_MARGIN_NS)
        and s.last_fraction >= _last_fraction_min(s)
    )


def _waits_on_others(a: Analysis) -> set[int]:
    """Procs that, somewhere, wait clearly longer than their peers: they are
    held up by someone, so their lateness elsewhere is inherited.  On the
    device's timeline, clearly means by the margin a straggler must show
    against the same pace: device timings are observed by polling, and a few
    ms of wait in a large communicator holds nobody up.  Somewhere: at all of
    a communicator's collectives, or at one kind of them (``kind_scores``)."""
    scores = [
        s for s in (*a.arrivals, *a.kind_arrivals)
        if s.method == "wait" and s.groups >= STRAGGLER_MIN_GROUPS
    ]  # fmt: skip
    held = {s.proc for s in scores if s.margin_ns <= -_held_margin(s)}
    return held | _waits_for_a_straggler(scores)


def _waits_for_a_straggler(scores: list[ArrivalScore]) -> set[int]:
    """Procs that wait, by the held margin, longer than a member that
    straggles at the same collectives: held up by it.  Against all its peers
    a waiter's margin is diluted by the others that wait with it (two of
    three ranks waiting for the third each wait about as long as their peers'
    middle)."""
    by_kind: dict[tuple[int, int | None], list[ArrivalScore]] = {}
    for s in scores:
        by_kind.setdefault((s.comm, s.op), []).append(s)
    out: set[int] = set()
    for members in by_kind.values():
        late = [s for s in members if _is_straggling(s)]
        if not late:  # (nearly every communicator: nobody to wait for)
            continue
        for s in members:
            if any(x.proc != s.proc and s.own_wait_ns - x.own_wait_ns >= _held_margin(s)
                   for x in late):  # fmt: skip
                out.add(s.proc)
    return out


def _held_margin(s: ArrivalScore) -> float:
    """How much longer than its peers a rank must wait to be held up: a few
    ms on the host's timeline; on the device's (observed by polling), and at
    one kind of collective (half as many samples, each a step apart: a slow
    rank itself waits a few ms more than its peers at some kind, now and
    then), the margin a straggler must show against the same pace."""
    if not s.device and s.op is None:
        return STRAGGLER_MARGIN_NS
    return max(STRAGGLER_MARGIN_NS, STRAGGLER_PERIOD_SHARE * s.period_ns)


def _early_peer_not_late_rank(a: Analysis, s: ArrivalScore) -> bool:
    """In a communicator of two, one rank arriving last is the other arriving
    first: the pair alone cannot tell a slow rank from a peer running ahead.
    The peer's other communicators tell: a peer held up by a slow rank is
    late itself at its next collectives (it left with the slow one), or on
    time once all have met; a peer running ahead of the job waits there too,
    in every one of them.  Such a pair's order is its peer's earliness, no
    fault of this rank: 8 ranks sharing 2 cores in healthy lab runs keep one
    order in a pair for a whole run (last in 75-94% of 15-16 collectives,
    20-44 ms), the early one waiting 22-23 ms longer than its peers in every
    wider communicator; a slow rank's pair peers are on time or late there."""
    if s.nranks != 2 or s.method != "wait":
        return False
    peers = {x.proc for x in a.arrivals if x.comm == s.comm and x.proc != s.proc}
    if len(peers) != 1:
        return False
    (peer,) = peers
    elsewhere = [
        x
        for x in a.arrivals
        if x.proc == peer
        and x.comm != s.comm
        and x.method == "wait"
        and x.groups >= STRAGGLER_MIN_GROUPS
    ]
    return bool(elsewhere) and all(
        x.margin_ns <= -STRAGGLER_MARGIN_NS and x.last_fraction < 1.0 / max(x.nranks, 2)
        for x in elsewhere
    )


def straggler_candidates(a: Analysis) -> list[ArrivalScore]:
    """Ranks consistently last in a communicator that never wait on anyone
    (a rank held up by a slow peer in one group arrives late in the next);
    last in a pair, not because its peer runs ahead of the job."""
    best: dict[int, ArrivalScore] = {}
    for s in a.arrivals:
        if not _is_straggling(s) or _early_peer_not_late_rank(a, s):
            continue
        cur = best.get(s.comm)
        if cur is None or (s.method == "wait", s.margin_ns) > (cur.method == "wait", cur.margin_ns):
            best[s.comm] = s
    held = _waits_on_others(a)
    per_proc: dict[int, ArrivalScore] = {}
    for s in best.values():
        if s.proc in held:
            continue
        cur = per_proc.get(s.proc)
        if cur is None or s.groups > cur.groups:
            per_proc[s.proc] = s
    return sorted(per_proc.values(), key=lambda s: s.proc)


def _late_somewhere(a: Analysis, proc: int, heavy: set[int]) -> tuple[ArrivalScore, float] | None:
    """Its clearest lateness, and the share of collectives it names: in some
    communicator it, or a rank starved with it, is the last to arrive in at
    least half of the collectives (more often than their share of the members
    would give), and it arrives later than its peers by the margin (median).
    Ranks starved alike (sharing a hogged CPU) take turns at being last: each
    alone may be last in less than half, and waits for the other about as long
    as the others do; so they are measured against the unstarved members,
    which wait far longer than either."""
    members: dict[int, list[ArrivalScore]] = {}
    for s in a.arrivals:
        if s.method == "wait":
            members.setdefault(s.comm, []).append(s)

    def judged(s: ArrivalScore) -> tuple[float, int]:
        """(share of collectives last, margin)"""
        if s.method != "wait":
            return s.last_fraction, s.margin_ns
        starved = [x for x in members[s.comm] if x.proc in heavy]
        others = [x for x in members[s.comm] if x.proc not in heavy]
        share = sum(x.last_fraction for x in starved)
        if not others or share <= len(starved) / max(s.nranks, 2):
            return s.last_fraction, s.margin_ns
        margin = min(x.own_wait_ns for x in others) - s.own_wait_ns
        return min(share, 1.0), max(s.margin_ns, margin)

    late = [
        (s, share, margin)
        for s in a.arrivals
        if s.proc == proc and s.groups >= STRAGGLER_MIN_GROUPS
        for share, margin in [judged(s)]
        if share >= 0.5 and margin >= STRAGGLER_MARGIN_NS
    ]
    if not late:
        return None
    s, share, _ = max(late, key=lambda x: (x[2], x[0].groups))
    return s, share


def _with_reading(a: Analysis, v: Verdict, proc: int, readers: frozenset[int]) -> Verdict:
    """A straggler on a host whose retransmits it explains (one of
    ``readers``, from ``slow_readers``) says so."""
    host = proc_hosts(a.incident)[proc]
    if host not in readers:
        return v
    (h,) = [x for x in a.retransmits if x.host == host]
    line = (
        f"its peers retransmit into host {a.incident.hosts[host]} ({h.remote} received against "
        f"{h.local} sent inside collective windows): a rank late to read leaves its sockets' "
        "queues full; those retransmits are its lateness's, not a lossy link's"
    )
    return dataclasses.replace(v, evidence=(*v.evidence, line))


def _starved_text(a: Analysis, proc: int) -> str:
    """How long the rank waited in the run queue, and behind whom: the CPU's
    last holder when each wait ended (unknown in dumps before format 5)."""
    d = a.sched
    outside, unknown, own = int(d.outside[proc]), int(d.unknown[proc]), int(d.by_job[proc])
    behind = [f"{ms(outside)} behind processes outside the job"] if outside or not unknown else []
    if unknown:
        behind.append(f"{ms(unknown)} behind processes not recorded (a dump before format 5)")
    text = f"its threads waited in the run queue {' and '.join(behind)}"
    if own:
        text += f" ({ms(own)} more behind the job's own ranks on its machine, not counted)"
    typical = float(np.percentile(d.starving, 25))
    return f"{text}; an unaffected rank (lower quartile) waited {ms(typical)}"


def _straggler_verdict(
    a: Analysis, s: ArrivalScore, kind: VerdictKind, starved_share: float | None = None
) -> Verdict:
    inc = a.incident
    p = inc.procs[s.proc]
    comm = inc.comms[s.comm]
    if s.method == "wait":
        how = (
            f"its calls took {ms(s.own_wait_ns)} (median) while its peers waited "
            f"{ms(s.peer_wait_ns)}: it arrives last and waits least"
        )
    elif s.method == "host-lateness":
        how = f"it enters {ms(s.margin_ns)} (median) after the other ranks of its host"
    else:
        how = (
            f"it enters {ms(s.margin_ns)} (median) after the first rank, across hosts "
            f"(far above clock skew: at least {ms(CROSS_HOST_MARGIN_NS)})"
        )
    evidence = [
        f"last to arrive in {s.last_fraction:.0%} of {s.groups} collectives on {comm.name}",
        how,
    ]
    if starved_share is not None:
        evidence.append(
            f"it or another rank starved of CPU is the last to arrive in {starved_share:.0%} "
            "of them: ranks sharing a hogged CPU take turns at being last"
        )
    if kind is VerdictKind.CPU_INTERFERENCE:
        evidence.append(_starved_text(a, s.proc))
        summary = f"{p.label()} is starved of CPU (run-queue delay) and its peers wait for it"
    else:
        summary = f"{p.label()} arrives last at collectives, {ms(s.margin_ns)} behind its peers"
    rows = a.matched.rows[a.matched.comm_rows(s.comm)]
    op = op_name(int(np.bincount(rows["op"]).argmax())) if len(rows) else None
    return Verdict(
        kind,
        (p.world_rank,),
        (p.host,),
        (p.pid,),
        comm.hash_text,
        None,
        op,
        summary,
        tuple(evidence),
        (comm.rank_of(s.crank),),
    )


def slow_readers(a: Analysis) -> frozenset[int]:
    """Hosts (indexes) whose retransmits their late ranks explain: a rank
    consistently last to a collective holds one, and the host's retransmits
    are mostly its peers' into it (``network.received_mostly``).  A rank that
    enters late reads late: the queues of its sockets fill, its peers'
    segments are dropped and retransmitted.  A lossy link drops both ways."""
    late = {proc_hosts(a.incident)[s.proc] for s in straggler_candidates(a)}
    if not late or not a.incident.retransmit_rows:
        return frozenset()
    return frozenset(h.host for h in a.retransmits if h.host in late and received_mostly(h))


def detect_network_unexplained(a: Analysis) -> list[Verdict]:
    """The network straggler, but for hosts whose late ranks explain their
    retransmits (named by ``detect_stragglers`` instead)."""
    return detect_network(a, slow_readers(a))


def detect_stragglers(a: Analysis) -> list[Verdict]:
    readers = slow_readers(a)
    lossy = {a.incident.hosts[h.host] for h in lossy_hosts(a, readers)}
    heavy = sched_heavy(a)
    link = link_slowed(a)
    # behind a slow link its host's ranks arrive late whatever their CPU: a
    # rank of it starved no more than ranks that are not late is the link's
    behind = {a.incident.hosts[link.host]} if link is not None else set()
    out = []
    named = set()
    for s in straggler_candidates(a):
        named.add(s.proc)
        if s.proc in heavy and a.incident.procs[s.proc].host not in behind:
            out.append(_straggler_verdict(a, s, VerdictKind.CPU_INTERFERENCE))
        elif s.proc in heavy:
            continue
        elif a.incident.procs[s.proc].host not in lossy and a.slow_link is None:
            # (behind a slow link, ranks arrive late in the order it holds them)
            v = _straggler_verdict(a, s, VerdictKind.COMPUTE_STRAGGLER)
            out.append(_with_reading(a, v, s.proc, readers))
    for proc in sorted(heavy - named):  # starved, and late (if less consistently)
        if a.incident.procs[proc].host in behind:
            continue
        late = _late_somewhere(a, proc, heavy)
        if late is not None:
            s, share = late
            shared = share if share > s.last_fraction else None
            out.append(_straggler_verdict(a, s, VerdictKind.CPU_INTERFERENCE, shared))
        elif (inside := _starved_through_window(a, proc)) is not None:
            out.append(inside)
    return out


def _starved_through_window(a: Analysis, proc: int) -> Verdict | None:
    """A rank starved of CPU in a slowdown's window (``sched_heavy``: its
    waits there are also a good share of what the window lost) that is not
    last to enter: the host's part of a collective runs on its CPU too (the
    lab's reductions and socket transfers, a real NCCL's proxy thread), so
    its peers wait for it inside the collective."""
    m, inc = a.matched, a.incident
    found = most_lost(a, proc)
    if found is None:
        return None
    w, lost = found
    share = float(a.sched.starving[proc]) / lost
    p, comm = inc.procs[proc], inc.comms[w.comm]
    rows = m.rows[m.comm_rows(w.comm)]
    crank = int(rows["crank"][rows["proc"] == proc][0])
    evidence = (
        f"the slow window of {comm.name} ({w.groups} collectives since seq {w.seq}, "
        f"{ms(w.span_ns)}, each kind {w.factor or 0:.1f}x slower than before) lost "
        f"{ms(lost)} against its baseline; this rank's threads waited "
        f"{ms(int(a.sched.starving[proc]))} in the run queue there ({share:.0%} of it)",
        _starved_text(a, proc),
        "it is not the last to enter: its collectives wait for its CPU from inside "
        "(the host's part of a collective runs on it)",
    )
    return Verdict(
        VerdictKind.CPU_INTERFERENCE,
        (p.world_rank,),
        (p.host,),
        (p.pid,),
        comm.hash_text,
        None,
        op_name(w.op),
        f"{p.label()} is starved of CPU (run-queue delay) through the slow window, and its "
        "peers' collectives wait for it",
        evidence,
        (crank,),
    )

"""Slowdown: an incident an agent raised because the job went on, only
slower (recorder.slowdown: a communicator's rhythm degraded, a rank of its
node persistently last, a collective held while the network failed).  It is
judged against its own baseline.

The metric: each communicator's slow window (``slow_windows``).  A member's
interval is the time from one of its calls of a kind (op and count) to the
next, on its own clock; a collective's is its members' median.  The onset is
where intervals of ``ONSET_FACTOR`` times their kind's lower quartile begin
to outnumber the others up to the dumps (the suffix where slow intervals
lead the most); the baseline is what came before.  A communicator whose
rhythm shows no such run (the agent saw a rank late, or one held
collective) is judged on its collectives of the last ``RECENT_NS`` before
its members' dumps.

The pipeline gives the straggler detectors (compute, CPU, GPU: on the
device's timeline) the slow windows' collectives instead of every rank's
latest ones: a rank slowed from some step on is last in the slow window, not
in the long baseline before it.  The network detectors judge every
collective as always (a lossy host's retransmits fall inside the slow ones,
and the baseline is what they are compared with).  When none of them names
a rank or a host, the verdict is ``slowdown``: the whole job slowed alike
(shared storage, a data loader, the job's own phase), never healthy.

Known limits: a slow window needs ``SLOW_MIN_GROUPS`` slow collectives and
a baseline before it in the dumps (the analyzer reads ``SLOW_WINDOW_CALLS``
of each rank's calls for a slowdown incident); an incident is a slowdown
only when the dump of the agent that raised it is read (its peers' dumps
say only that a peer asked).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from stallwatch.dumpers.schema import op_name

from ..columns import Columns
from ..incident import Incident, SlowWindow, proc_hosts
from ..match import Matched
from ..verdict import Verdict, VerdictKind
from .common import MAX_LISTED, Analysis, is_world, ms
from .cpu import SCHED_MIN_NS

ONSET_FACTOR = 2.0  # an interval this many times its kind's lower quartile is slow
SLOW_MIN_GROUPS = 3  # slow collectives a window needs
RECENT_NS = 30_000_000_000  # without an onset: the collectives of the last 30 s
BASE_MIN_GROUPS = 3  # collectives a baseline needs to be told


# ---- metric: each communicator's slow window ------------------------------------------


def slow_windows(inc: Incident, m: Matched) -> list[SlowWindow]:
    out = []
    for comm in range(len(inc.comms)):
        sl = m.comm_rows(comm)
        if sl.stop - sl.start >= 2:
            w = _window(inc, m, comm, sl)
            if w is not None:
                out.append(w)
    return out


def _window(inc: Incident, m: Matched, comm: int, sl: slice) -> SlowWindow | None:
    rows = m.rows.select(("ts", "end", "crank", "op", "count", "proc"))[sl]
    gid = m.gid[sl]
    starts = np.flatnonzero(np.r_[True, gid[1:] != gid[:-1]])
    kind = rows["op"][starts].astype(np.int64) << 48 | rows["count"][starts].astype(np.int64)
    interval = _group_intervals(rows, gid, starts, kind)
    first = _onset(interval, kind)
    onset = first is not None
    if first is None:
        first = _recent(inc, rows, starts)
        if first is None:
            return None
    before, after = slice(0, first), slice(first, len(starts))
    ends = rows["end"]
    done = np.minimum.reduceat(ends, starts) > 0
    duration = np.where(done, np.maximum.reduceat(ends - rows["ts"], starts), -1)
    ts = rows["ts"][starts]
    return SlowWindow(
        comm=comm,
        first_gid=int(gid[starts[first]]),
        seq=int(m.group_seq[gid[starts[first]]]),
        op=int(rows["op"][starts[first]]),
        groups=len(starts) - first,
        base_groups=first,
        base_interval_ns=_typical(interval[before], kind[before]),
        slow_interval_ns=_typical(interval[after], kind[after]),
        base_duration_ns=_median(duration[before]),
        slow_duration_ns=_median(duration[after]),
        span_ns=int(ts[-1] - ts[first]),
        onset=onset,
    )


def _group_intervals(
    rows: Columns, gid: np.ndarray, starts: np.ndarray, kind: np.ndarray
) -> np.ndarray:
    """Per collective, its members' median interval since their previous
    call of the same kind (NaN for the first of a kind)."""
    size = np.diff(np.append(starts, len(gid)))
    row_kind = np.repeat(kind, size)
    order = np.lexsort((gid, row_kind, rows["crank"]))
    ts, k, cr = rows["ts"][order], row_kind[order], rows["crank"][order]
    same = np.r_[False, (k[1:] == k[:-1]) & (cr[1:] == cr[:-1])]
    per_row = np.full(len(gid), np.nan)
    per_row[order[same]] = (ts[1:] - ts[:-1])[same[1:]]
    return _group_medians(per_row, np.repeat(np.arange(len(starts)), size), len(starts))


def _group_medians(values: np.ndarray, group: np.ndarray, groups: int) -> np.ndarray:
    """Per group, the median of its values that are not NaN (NaN if none),
    for every group at once (a communicator has thousands)."""
    known = ~np.isnan(values)
    v, g = values[known], group[known]
    order = np.lexsort((v, g))
    v = v[order]
    counts = np.bincount(g, minlength=groups)
    first = np.cumsum(counts) - counts
    out = np.full(groups, np.nan)
    has = counts > 0
    lo = first[has] + (counts[has] - 1) // 2
    hi = first[has] + counts[has] // 2
    out[has] = (v[lo] + v[hi]) / 2
    return out


def _onset(interval: np.ndarray, kind: np.ndarray) -> int | None:
    """Where the slow run that holds to the end begins: the suffix in which
    slow intervals outnumber the others by the most (None: no such run)."""
    score = np.zeros(len(interval))
    for k in np.unique(kind):
        sel = (kind == k) & ~np.isnan(interval)
        if int(sel.sum()) < 2 * BASE_MIN_GROUPS:
            continue
        low = float(np.percentile(interval[sel], 25))
        score[sel] = np.where(interval[sel] >= ONSET_FACTOR * low, 1.0, -1.0)
    suffix = np.cumsum(score[::-1])[::-1]
    if not len(suffix) or suffix.max() <= 0:
        return None
    first = int(np.argmax(suffix))
    slow = int((score[first:] > 0).sum())
    if slow < SLOW_MIN_GROUPS or first < BASE_MIN_GROUPS:
        return None
    return first


def _recent(inc: Incident, rows: Columns, starts: np.ndarray) -> int | None:
    """The first collective a member entered in the last RECENT_NS before
    its host dumped (None if no host says when it did)."""
    host = np.array(proc_hosts(inc), dtype=np.int64)[rows["proc"]]
    now = np.array([t if t is not None else -1 for t in inc.host_now], dtype=np.int64)[host]
    recent = (now > 0) & (rows["ts"] >= now - RECENT_NS)
    group_recent = np.maximum.reduceat(recent.astype(np.int8), starts) > 0
    if not group_recent.any():
        return None
    first = int(np.argmax(group_recent))
    return first if first >= BASE_MIN_GROUPS else None


def _typical(interval: np.ndarray, kind: np.ndarray) -> int | None:
    """The median over kinds of each kind's median interval."""
    meds = [
        float(np.median(interval[sel]))
        for k in np.unique(kind)
        if (sel := (kind == k) & ~np.isnan(interval)).any()
    ]
    return int(np.median(meds)) if meds else None


def _median(values: np.ndarray) -> int | None:
    known = values[values >= 0]
    return int(np.median(known)) if len(known) else None


def window_matched(
    m: Matched, windows: list[SlowWindow] | tuple[SlowWindow, ...], baseline: bool = False
) -> Matched:
    """The matched collectives with each windowed communicator's cut to its
    slow window (what the straggler metrics read), or with ``baseline`` to
    it and as many collectives before it (what the slow ones are compared
    with: the network metrics).  The rest of ``Matched`` describes the whole
    table and is not to be read from it."""
    if not windows:
        return m
    first = np.zeros(int(m.group_comm.max()) + 1 if len(m.group_comm) else 0, dtype=np.int64)
    for w in windows:
        first[w.comm] = w.first_gid - (min(w.groups, w.base_groups) if baseline else 0)
    gids = np.arange(len(m.group_start))
    keep_group = gids >= first[m.group_comm]
    idx = np.flatnonzero(keep_group[m.gid])
    rows = m.rows.take(idx)
    old = m.gid[idx]
    new = np.r_[True, old[1:] != old[:-1]] if len(idx) else np.zeros(0, dtype=bool)
    group_start = np.flatnonzero(new)
    ncomms = len(m.comm_start) - 1
    return dataclasses.replace(
        m,
        rows=rows,
        gid=np.cumsum(new) - 1,
        group_start=group_start,
        group_size=np.diff(np.append(group_start, len(idx))),
        group_comm=rows["comm"][group_start],
        group_seq=rows["seq"][group_start],
        comm_start=np.searchsorted(rows["comm"], np.arange(ncomms + 1)),
    )


def window_since(
    inc: Incident, m: Matched, windows: list[SlowWindow] | tuple[SlowWindow, ...]
) -> dict[int, int]:
    """Per host (index), when the slow windows began on its clock: its
    members' earliest entry into a window's first collective, less one slow
    interval (the step whose collective first ran slow began that much
    before it).  What else its rings hold (the run-queue waits) is read from
    there on; a host with no member in a window is not in it."""
    hosts = proc_hosts(inc)
    out: dict[int, int] = {}
    for w in windows:
        start = int(m.group_start[w.first_gid])
        rows = m.rows[start : start + int(m.group_size[w.first_gid])]
        back = w.slow_interval_ns or 0
        for proc, ts in zip(rows["proc"].tolist(), rows["ts"].tolist(), strict=True):
            h = hosts[proc]
            out[h] = min(out.get(h, ts - back), ts - back)
    return out


# ---- the detector ---------------------------------------------------------------------


def window_text(a: Analysis, w: SlowWindow) -> str:
    inc = a.incident
    comm = inc.comms[w.comm]
    since = f"since seq {w.seq} ({w.groups} collectives, {ms(w.span_ns)})"
    how = "its rhythm departs there" if w.onset else "the last moments before the dumps"
    pace = ""
    if w.slow_interval_ns is not None and w.base_interval_ns:
        f = w.factor or 0.0
        pace = (
            f": a collective every {ms(w.slow_interval_ns)} (median) against "
            f"{ms(w.base_interval_ns)} in the {w.base_groups} before ({f:.1f}x)"
        )
    took = ""
    if w.slow_duration_ns is not None and w.base_duration_ns is not None:
        took = f"; they took {ms(w.slow_duration_ns)} against {ms(w.base_duration_ns)}"
    return f"slow window of {comm.name} {since}, {how}{pace}{took}"


# the verdicts judged on the slow window (the others judge the incident whole)
ON_WINDOW = (
    VerdictKind.COMPUTE_STRAGGLER,
    VerdictKind.CPU_INTERFERENCE,
    VerdictKind.NETWORK_STRAGGLER,
)


def judged_on_window(a: Analysis, v: Verdict) -> Verdict:
    """A straggler verdict of a slowdown incident, saying the window it was
    judged on."""
    if not a.windows or v.kind not in ON_WINDOW:
        return v
    lines = [f"judged on the slow window: {window_text(a, w)}" for w in _shown(a)]
    return dataclasses.replace(v, evidence=(*v.evidence, *lines))


def _shown(a: Analysis) -> list[SlowWindow]:
    """The windows worth showing: those with an onset first, the largest
    communicators first."""
    comms = a.incident.comms
    return sorted(a.windows, key=lambda w: (not w.onset, -comms[w.comm].nranks, w.comm))[:2]


def _all_starved(a: Analysis) -> str | None:
    """Every rank's threads waited in the run queue behind processes outside
    the job (SCHED_MIN_NS and more each, in the recording): CPUs shared with
    other work, on every host alike (one host's would name its ranks)."""
    outside = a.sched.outside
    if not len(outside) or int(outside.min()) < SCHED_MIN_NS:
        return None
    return (
        f"every rank's threads waited in the run queue behind processes outside the job: "
        f"{ms(int(outside.min()))} to {ms(int(outside.max()))} each in the recording"
    )


def detect_slowdown(a: Analysis) -> list[Verdict]:
    """The whole job slowed alike: nothing else departs (run last)."""
    slow = a.incident.slowdown
    if slow is None:
        return []
    inc = a.incident
    shown = sorted(
        a.windows,
        key=lambda w: (not w.onset, not is_world(inc, w.comm), -(w.factor or 0.0), w.comm),
    )
    evidence = [window_text(a, w) for w in shown[:MAX_LISTED]]
    evidence.append(
        "no rank arrives last and no host's connections retransmit inside the slow "
        "collectives: every rank slowed alike"
    )
    starved = _all_starved(a)
    if starved is not None:
        evidence.append(starved)
    evidence.append(f"raised by {slow.host}: {slow.reason}")
    top = shown[0] if shown else None
    comm = inc.comms[top.comm] if top is not None else None
    if top is not None and top.onset and top.factor is not None:
        summary = (
            f"the whole job slowed {top.factor:.1f}x from seq {top.seq} on "
            f"{comm.name if comm else '?'} (a collective every {ms(top.slow_interval_ns or 0)} "
            f"against {ms(top.base_interval_ns or 0)}), every rank alike: no rank or host "
            + (
                "departs (every rank waited for a CPU behind processes outside the job)"
                if starved is not None
                else "departs (shared storage, a data loader, the job's own work?)"
            )
        )
    else:
        summary = (
            "the job slowed (its agent says so) and no rank or host departs, but its dumps "
            "do not show where its rhythm changed: the baseline may be gone from the rings"
        )
    return [
        Verdict(
            VerdictKind.SLOWDOWN,
            (),
            inc.hosts,
            (),
            comm.hash_text if comm is not None else None,
            top.seq if top is not None else None,
            op_name(top.op) if top is not None else None,
            summary,
            tuple(evidence),
        )
    ]

"""Network straggler: collectives slow for everyone, with TCP retransmits on
one host's rank connections inside their windows.  The metrics: retransmits
per host inside collective windows, and per communicator how much slower its
collectives with retransmits inside are than those without; and the
collectives the network held (``held_by_network``: one held 10x its
communicator's median and 1 s or more, a retransmission timeout inside, as
the agent's held-call trigger asks), with the retransmits inside them: a
link choked for seconds, or cut and back, slows one or two collectives,
too few for the rule that compares many, and its incident is dumped at once."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stallwatch.dumpers.schema import op_name

from ..frontier import ASYNC_BELOW_NS
from ..incident import CommSlowdown, Deferred, HostRetransmits, Incident, NetHeld, proc_hosts
from ..match import Matched
from ..verdict import Verdict, VerdictKind
from .common import MAX_LISTED, Analysis, ms, who
from .cpu import starved_hosts

# ---- metrics: retransmits inside collective windows, and what they slow --------------


def queued_comms(m: Matched, ncomms: int) -> np.ndarray:
    """Per communicator: whether its calls are queued (asynchronous NCCL
    seen only on the host): none was seen on a device, and they return at
    once (median under ASYNC_BELOW_NS, as the straggler detectors take it;
    a busy CPU holds a few of them for milliseconds), though it has members
    to wait for."""
    rows = m.rows
    out = np.zeros(ncomms, dtype=bool)
    for comm in range(ncomms):
        sl = m.comm_rows(comm)
        if len(np.unique(rows["crank"][sl])) < 2:  # alone: its calls wait for nobody
            continue
        end, ts, dev = rows["end"][sl], rows["ts"][sl], rows["device"][sl]
        done = end > 0
        if done.any() and not dev.any():
            out[comm] = np.median((end - ts)[done]) < ASYNC_BELOW_NS
    return out


def call_windows(m: Matched, queued: np.ndarray) -> np.ndarray:
    """Where each matched call's work may lie, as an end time (0: it did not
    return).  A blocking call works until it returns; one seen on its device,
    until it completed there.  Queued calls (``queued_comms``) run on their
    stream one after another: a rank's run of them on a communicator (entered
    less than ASYNC_BELOW_NS apart) works until, at the latest, the rank
    enters its next call there after a pause (a job that synchronises its
    streams each step enters it once the work completed).  A rank's last run
    keeps its returns."""
    rows = m.rows
    end = rows["end"]
    take = (end > 0) & queued[rows["comm"]] if len(queued) else np.zeros(len(rows), bool)
    if not take.any():
        return end
    # rows run by (comm, seq, crank): a stable sort by (comm, crank) leaves each
    # rank's calls in seq order
    order = np.lexsort((rows["crank"], rows["comm"]))
    comm, crank, ts = rows["comm"][order], rows["crank"][order], rows["ts"][order]
    n = len(order)
    same = np.r_[(comm[1:] == comm[:-1]) & (crank[1:] == crank[:-1]), False]
    gap = np.r_[np.diff(ts), 0]
    last = ~same | (gap >= ASYNC_BELOW_NS)  # the last call of a run
    at = np.where(last, np.arange(n), n)
    run_last = np.minimum.accumulate(at[::-1])[::-1]  # each call's run's last call
    after = np.where(same[run_last], ts[np.minimum(run_last + 1, n - 1)], 0)
    later = np.zeros(len(rows), dtype=np.int64)
    later[order] = after
    out = np.array(end, dtype=np.int64, copy=True)
    take &= later > end
    out[take] = later[take]
    return out


@dataclass(frozen=True, slots=True)
class CallWindows:
    """What the network metrics share, computed once per matched table:
    each process's host, which communicators' calls are queued, each
    row's window end (``call_windows``) and how long a retransmission
    timeout held it (``_held_per_row``)."""

    phost: np.ndarray
    queued: np.ndarray
    end: np.ndarray
    held: np.ndarray


def windows_of(inc: Incident, m: Matched) -> CallWindows:
    phost = np.array(proc_hosts(inc), dtype=np.int64)
    queued = queued_comms(m, len(inc.comms))
    end = call_windows(m, queued) if len(m.rows) else np.zeros(0, dtype=np.int64)
    held = (
        _held_per_row(inc, m, phost, end)
        if len(inc.retransmits) and len(m.rows)
        else np.zeros(len(m.rows), dtype=np.int64)
    )
    return CallWindows(phost, queued, end, held)


@dataclass(frozen=True, slots=True)
class NetMetrics:
    """The network metrics of one matched table (``Analysis`` fields)."""

    retransmits: Deferred[tuple[HostRetransmits, ...]]
    slowdowns: tuple[CommSlowdown, ...]
    held: tuple[NetHeld, ...]
    held_retransmits: tuple[HostRetransmits, ...]


def network_metrics(inc: Incident, m: Matched, whole: bool = True) -> NetMetrics:
    """``whole``: ``m`` is every matched call (not a slowdown's window and
    its baseline): the per-host retransmits are then the shipped query's
    (``Incident.host_retransmits``), over every collective the rings hold."""
    w = windows_of(inc, m)
    held, held_rows = held_by_network(inc, m, w)
    if whole and inc.host_retransmits is not None:
        counts = inc.host_retransmits
    else:
        counts = Deferred(lambda: tuple(retransmits_in_windows(inc, m, w=w)))
    return NetMetrics(
        counts,
        tuple(retransmit_slowdowns(inc, m, w)),
        tuple(held),
        tuple(retransmits_in_windows(inc, m, held_rows, w)) if held else (),
    )


def retransmits_in_windows(
    inc: Incident, m: Matched, only: np.ndarray | None = None, w: CallWindows | None = None
) -> list[HostRetransmits]:
    """Per host, the retransmits inside its ranks' collective windows of the
    matched rows (those ``only`` selects, if given): where the analysis is
    restricted to some collectives (a slowdown's window, the collectives
    the network held).  Over every call, the shipped query's count is the
    one (``Incident.host_retransmits``)."""
    rt = inc.retransmits
    nh = len(inc.hosts)
    if not len(rt):
        return []
    w = w or windows_of(inc, m)
    phost, end = w.phost, w.end
    keep = (end > 0) if only is None else (end > 0) & only
    inside = np.zeros(len(rt), dtype=bool)
    for h in range(nh):
        sel = rt["host"] == h
        if not sel.any():
            continue
        mine = (phost[m.rows["proc"]] == h) & keep
        inside[sel] = _within(rt["ts"][sel], m.rows["ts"][mine], end[mine])
    sent = rt[inside & (rt["local"] >= 0)]
    got = rt[inside & (rt["remote"] >= 0)]
    local = np.bincount(sent["local"], minlength=nh)
    remote = np.bincount(got["remote"], minlength=nh)
    total = np.bincount(rt["local"][rt["local"] >= 0], minlength=nh)
    rows = m.rows
    counted = rows["end"] > 0 if only is None else (rows["end"] > 0) & only
    done = np.bincount(phost[rows["proc"][counted]], minlength=nh) if len(rows) else total * 0
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


BASELINE_MIN_GROUPS = 3


def retransmit_slowdowns(
    inc: Incident, m: Matched, w: CallWindows | None = None
) -> list[CommSlowdown]:
    """Per communicator spanning two hosts or more.  A collective's duration
    is its longest member call: a stalled link holds up the whole ring, its
    ranks finishing one after another.  Times are compared within one host:
    a retransmit counts for a call recorded on the host that saw it."""
    rt = inc.retransmits
    if not len(rt) or not len(m.rows):
        return []
    w = w or windows_of(inc, m)
    phost, queued, end, held = w.phost, w.queued, w.end, w.held
    hits = _retransmits_per_row(inc, m, phost, end)
    out = []
    for comm, c in enumerate(inc.comms):
        hosts = tuple(sorted({int(phost[p]) for p in c.members if p >= 0}))
        if len(hosts) < 2:
            continue
        s = _slowdown(m, comm, c.whole, hits, end)
        if s is not None:
            held_groups, share = (
                _held_share(m, comm, c.whole, held, end) if queued[comm] else (0, 0.0)
            )
            out.append(CommSlowdown(comm, hosts, *s, bool(queued[comm]), held_groups, share))
    return out


def _retransmits_per_row(
    inc: Incident, m: Matched, phost: np.ndarray, end: np.ndarray
) -> np.ndarray:
    rows, rt = m.rows, inc.retransmits
    host = phost[rows["proc"]]
    hits = np.zeros(len(rows), dtype=np.int64)
    done = end > 0
    for h in np.unique(rt["host"]).tolist():
        t = np.sort(rt["ts"][rt["host"] == h])
        sel = np.flatnonzero((host == h) & done)
        hi = np.searchsorted(t, end[sel], side="right")
        hits[sel] = hi - np.searchsorted(t, rows["ts"][sel], side="left")
    return hits


def _complete_groups(
    gid: np.ndarray, end: np.ndarray, nranks: int
) -> tuple[np.ndarray, np.ndarray]:
    """A communicator's rows' groups: where each starts, and whether it is
    complete (every member's call in it, each window ended)."""
    starts = np.flatnonzero(np.r_[True, gid[1:] != gid[:-1]])
    size = np.diff(np.append(starts, len(gid)))
    return starts, (np.minimum.reduceat(end, starts) > 0) & (size == nranks)


def _held_per_row(inc: Incident, m: Matched, phost: np.ndarray, end: np.ndarray) -> np.ndarray:
    """How long each call's window had one of its host's job connections in
    a retransmission timeout (at most the window): the longest of the
    timeouts that sent a retransmit inside it (``backoff`` 1 or more, as the
    connection state says), each nothing acknowledged for the timeout that
    expired or longer."""
    rows, rt = m.rows, inc.retransmits
    rt = rt[(rt["known"] > 0) & (rt["backoff"] > 0)]
    held_ns = np.maximum(rt["rto"], rt["no_ack"])
    host = phost[rows["proc"]]
    held = np.zeros(len(rows), dtype=np.int64)
    for h in np.unique(rt["host"]).tolist():
        mine = rt["host"] == h
        order = np.argsort(rt["ts"][mine])
        t, length = rt["ts"][mine][order], held_ns[mine][order]
        sel = np.flatnonzero((host == h) & (end > rows["ts"]))
        lo = np.searchsorted(t, rows["ts"][sel], side="left")
        hi = np.searchsorted(t, end[sel], side="right")
        inside = np.flatnonzero(hi > lo)
        longest = [int(length[a:b].max()) for a, b in zip(lo[inside], hi[inside], strict=True)]
        held[sel[inside]] = np.minimum(longest, (end - rows["ts"])[sel[inside]])
    return held


# a collective the network held: it took HOLD_MIN_NS and HOLD_FACTOR times
# its communicator's median with a retransmission timeout of the job's
# connections inside a member's call (the agent's held-call trigger,
# recorder.slowdown: an outage or a choked link the job came back from is
# one such collective, which no median sees; a checkpoint's barrier holds
# as long with no timeout inside)
HOLD_MIN_NS = 1_000_000_000
HOLD_FACTOR = 10.0


def held_by_network(
    inc: Incident, m: Matched, w: CallWindows | None = None
) -> tuple[list[NetHeld], np.ndarray]:
    """The complete collectives of communicators spanning hosts (calls not
    queued) that the network held, and which matched rows are theirs."""
    rows = np.zeros(len(m.rows), dtype=bool)
    rt = inc.retransmits
    if not len(rt) or not len(m.rows):
        return [], rows
    w = w or windows_of(inc, m)
    phost, queued, end, held = w.phost, w.queued, w.end, w.held
    out = []
    for comm, c in enumerate(inc.comms):
        # queued calls' windows run to the next call, a checkpoint's pause
        # included: not comparable (``_held_share`` judges them)
        if queued[comm] or len({int(phost[p]) for p in c.members if p >= 0}) < 2:
            continue
        sl = m.comm_rows(comm)
        gid, e, ts = m.gid[sl], end[sl], m.rows["ts"][sl]
        if not len(gid):
            continue
        starts, ok = _complete_groups(gid, e, c.whole)
        if not ok.any():
            continue
        dur = np.maximum.reduceat(e - ts, starts)
        base = int(np.median(dur[ok]))
        g_held = np.maximum.reduceat(held[sl], starts) > 0
        hit = ok & g_held & (dur >= HOLD_MIN_NS) & (dur >= HOLD_FACTOR * base)
        for g in np.flatnonzero(hit).tolist():
            first = sl.start + int(starts[g])
            out.append(
                NetHeld(comm, int(m.rows["seq"][first]), int(m.rows["op"][first]),
                        int(dur[g]), base)
            )  # fmt: skip
        size = np.diff(np.append(starts, len(gid)))
        rows[sl] = np.repeat(hit, size)
    return out, rows


def _held_share(
    m: Matched, comm: int, nranks: int, held: np.ndarray, end: np.ndarray
) -> tuple[int, float]:
    """Of a communicator's complete collectives: how many a timeout held, and
    the share of their time (their longest member window) it held them."""
    sl = m.comm_rows(comm)
    gid, h, e, ts = m.gid[sl], held[sl], end[sl], m.rows["ts"][sl]
    if not len(gid):
        return 0, 0.0
    starts, ok = _complete_groups(gid, e, nranks)
    g_held = np.maximum.reduceat(h, starts)[ok]
    g_len = np.maximum.reduceat(e - ts, starts)[ok]
    total = int(g_len.sum())
    return int((g_held > 0).sum()), (float(g_held.sum()) / total if total > 0 else 0.0)


def _slowdown(
    m: Matched, comm: int, nranks: int, hits: np.ndarray, windows: np.ndarray
) -> tuple[int, int, int, int] | None:
    sl = m.comm_rows(comm)
    rows, gid, hit, end = m.rows[sl], m.gid[sl], hits[sl], windows[sl]
    if not len(rows):
        return None
    starts, ok = _complete_groups(gid, end, nranks)
    if not ok.any():
        return None
    dur = np.maximum.reduceat(end - rows["ts"], starts)[ok]
    ghit = np.maximum.reduceat(hit, starts)[ok] > 0
    n_hit = int(ghit.sum())
    if not n_hit:
        return len(dur), 0, 0, int(np.median(dur))
    clean = dur[~ghit]
    base = clean if len(clean) >= BASELINE_MIN_GROUPS else dur
    q = 50 if len(clean) >= BASELINE_MIN_GROUPS else 25
    return len(dur), n_hit, int(np.median(dur[ghit])), int(np.percentile(base, q))


# ---- the detector --------------------------------------------------------------------

RETRANS_MIN = 20  # retransmits inside collective windows that count
RETRANS_PER_CALL = 0.25  # and at least this many per completed collective of the host
RETRANS_CONCENTRATION = 0.75  # share of all retransmits the lossy host is involved in
SLOWDOWN = 3.0  # collectives with retransmits inside: this many times the baseline
SLOWDOWN_MIN_NS = 5_000_000  # and this much slower
SLOW_MIN_GROUPS = 3  # in at least this many collectives
SLOW_MIN_SHARE = 0.25  # and this share of the communicator's
# queued calls: the share of the collectives' time a retransmission timeout
# held them (one timeout of 200 ms every 2 s of collectives; a healthy
# network's stray timeout holds well under 1%)
HELD_MIN_SHARE = 0.1


def _concentration_min(nhosts: int) -> float:
    """Share of the retransmits a lossy host must be involved in: halfway
    between what any host gets when retransmits are spread evenly over random
    pairs (2 of n hosts) and all of them."""
    return max(RETRANS_CONCENTRATION, (1.0 + 2.0 / max(nhosts, 2)) / 2.0)


def _is_slowed(s: CommSlowdown) -> bool:
    if s.queued:  # windows up to the next call: held, not compared
        return s.held_groups >= SLOW_MIN_GROUPS and s.held_share >= HELD_MIN_SHARE
    return (
        s.hit_groups >= max(SLOW_MIN_GROUPS, SLOW_MIN_SHARE * s.groups)
        and s.hit_ns >= SLOWDOWN * s.baseline_ns
        and s.hit_ns - s.baseline_ns >= SLOWDOWN_MIN_NS
    )


def slowed_comms(a: Analysis, hosts: set[int]) -> list[CommSlowdown]:
    """Communicators spanning every one of ``hosts`` whose collectives with
    retransmits inside are markedly slower than those without."""
    return [s for s in a.slowdowns if hosts <= set(s.hosts) and _is_slowed(s)]


# retransmits into a host against those out of it (inside collective
# windows) from which its retransmits are its own ranks' lateness: a rank
# late to read leaves its sockets' queues full and its peers retransmit
# into them; a lossy link drops both ways (1.0-1.4x into the lossy node in
# the lab's seeded loss runs, 3.4x into a rank computing 150 ms late)
SLOW_READER = 2.0


def received_mostly(h: HostRetransmits) -> bool:
    """Whether a host's retransmits are mostly its peers' into it."""
    return h.remote >= SLOW_READER * max(h.local, 1)


def lossy_hosts(
    a: Analysis, explained: frozenset[int] = frozenset()
) -> tuple[HostRetransmits, ...]:
    """The host(s) involved in nearly every retransmit on the ranks'
    connections (two nodes: both ends of the one link lose alike; of hosts
    involved in nearly every one, those involved in the most: a host cut
    off or lossy towards all its peers is in every one, each peer only in
    those of its own link to it), when there
    are many per collective and the collectives they fall into are markedly
    slower than the communicator's others.  A few retransmits spread over
    the hosts, or ones that slow nothing, happen on any busy network.
    ``explained``: hosts whose retransmits a late rank on them explains
    (``stragglers.slow_readers``)."""
    return _lossy(a, explained).hosts


@dataclass(frozen=True, slots=True)
class _Lossy:
    """The hosts named, and on what: the communicators their retransmits
    slowed (the usual rule), or, when none, the collectives the network held
    (``counts``: the retransmits they were judged on)."""

    hosts: tuple[HostRetransmits, ...]
    slowed: list[CommSlowdown]
    counts: tuple[HostRetransmits, ...]


def _lossy(a: Analysis, explained: frozenset[int]) -> _Lossy:
    if a.incident.retransmit_rows < RETRANS_MIN:
        # no host is in more retransmits than the dumps hold: none can be named
        # (and the per-host query, which could only say so, is not run)
        return _Lossy((), [], ())

    def score(h: HostRetransmits) -> int:
        return h.local + h.remote

    def involved(counts: tuple[HostRetransmits, ...]) -> list[HostRetransmits]:
        total = sum(h.local for h in counts)
        share = _concentration_min(len(a.incident.hosts))
        return [
            h
            for h in counts
            if total
            and score(h) >= share * total
            and score(h) >= max(RETRANS_MIN, RETRANS_PER_CALL * h.calls)
        ]

    counts, named = a.retransmits, involved(a.retransmits)
    on_held = not named or not slowed_comms(a, {h.host for h in named})
    if on_held:  # the collectives the network held
        counts, named = a.held_retransmits, involved(a.held_retransmits)
    if named:  # beside the top: its links' other ends
        top = max(score(h) for h in named)
        named = [h for h in named if score(h) == top]
    slowed = [] if on_held else slowed_comms(a, {h.host for h in named})
    nobody = _Lossy((), [], counts)
    if not named:
        return nobody
    if all(h.host in starved_hosts(a) for h in named):
        return nobody  # a process starved of CPU stalls its connections: TCP retransmits
    if all(h.host in explained for h in named):
        return nobody  # a late rank's peers retransmit into its full queues (``explained``)
    return _Lossy(tuple(sorted(named, key=lambda h: h.host)), slowed, counts)


def detect_network(a: Analysis, explained: frozenset[int] = frozenset()) -> list[Verdict]:
    lossy = _lossy(a, explained)
    if not lossy.hosts:
        return []
    inc = a.incident
    hosts = tuple(inc.hosts[h.host] for h in lossy.hosts)
    procs = [i for i, p in enumerate(inc.procs) if p.host in hosts]
    ranks, _, pids = who(inc, procs)
    slowed, counts = lossy.slowed, lossy.counts
    # over every collective, the per-host query's count (docs/sql.md); in a
    # slowdown, over its slow window and the baseline before it
    inside = (
        "the slow window's and its baseline's collectives" if a.windows else "collective windows"
    )
    evidence = [
        f"host {x.host_name}: {x.h.local} retransmits sent and {x.h.remote} received inside "
        f"{inside} ({x.h.total} sent in all)"
        for x in (_Named(inc.hosts[h.host], h) for h in a.retransmits)
    ]
    evidence += [_slowed_text(inc, s) for s in slowed[:MAX_LISTED]]
    if not slowed:  # named on the collectives the network held
        evidence += [
            f"{op_name(h.op)} seq {h.seq} on {inc.comms[h.comm].name} was held {ms(h.duration_ns)} "
            f"against {ms(h.baseline_ns)} (its communicator's median), a retransmission timeout "
            "of the job's connections inside"
            for h in a.held[:MAX_LISTED]
        ]
    where = "on the ranks' connections" if slowed else "inside the collectives held"
    total = sum(h.local for h in counts)
    evidence += [
        f"host {inc.hosts[h.host]} is involved in {h.local + h.remote} of the {total} "
        f"retransmits {where}"
        for h in lossy.hosts
    ]
    evidence += _median_duration(a)
    rank_text = ", ".join(map(str, ranks))
    if len(hosts) == 1:
        summary = f"collectives slowed by TCP retransmits on host {hosts[0]} (ranks {rank_text})"
    else:
        summary = (
            f"collectives slowed by TCP retransmits between hosts {', '.join(hosts)}: "
            "they lose alike, so the lossy one cannot be told apart"
        )
    return [
        Verdict(
            VerdictKind.NETWORK_STRAGGLER,
            ranks,
            hosts,
            pids,
            None,
            None,
            None,
            summary,
            tuple(evidence),
        )
    ]


def _slowed_text(inc: Incident, s: CommSlowdown) -> str:
    name = inc.comms[s.comm].name
    if s.queued:
        return (
            f"retransmission timeouts of the job's connections held {s.held_groups} of "
            f"{s.groups} collectives on {name}, {s.held_share:.0%} of their time (calls "
            "queued, seen on no device: a collective's window runs to its ranks' next call "
            f"after a pause, {ms(s.hit_ns)} median with retransmits inside)"
        )
    return (
        f"{s.hit_groups} of {s.groups} collectives on {name} had retransmits "
        f"inside and took {ms(s.hit_ns)} (median) against {ms(s.baseline_ns)} for the others"
    )


@dataclass(frozen=True, slots=True)
class _Named:
    host_name: str
    h: HostRetransmits


def _median_duration(a: Analysis) -> list[str]:
    m = a.matched
    queued = queued_comms(m, len(a.incident.comms))
    end = call_windows(m, queued)
    done = end > 0
    if not done.any():
        return []
    median = float(np.median((end - m.rows["ts"])[done]))
    text = f"median collective duration (all ranks): {ms(median)}"
    if queued[m.rows["comm"][done]].any():
        text += " (queued calls: to the rank's next call after a pause)"
    return [text]

"""Network straggler: collectives slow for everyone, with TCP retransmits on
one host's rank connections inside their windows.  The metrics: retransmits
per host inside collective windows, and per communicator how much slower its
collectives with retransmits inside are than those without."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..incident import CommSlowdown, HostRetransmits, Incident, proc_hosts
from ..match import Matched
from ..verdict import Verdict, VerdictKind
from .common import MAX_LISTED, Analysis, ms, who
from .cpu import starved_hosts

# ---- metrics: retransmits inside collective windows, and what they slow --------------


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


# ---- the detector --------------------------------------------------------------------

RETRANS_MIN = 20  # retransmits inside collective windows that count
RETRANS_PER_CALL = 0.25  # and at least this many per completed collective of the host
RETRANS_CONCENTRATION = 0.75  # share of all retransmits the lossy host is involved in
SLOWDOWN = 3.0  # collectives with retransmits inside: this many times the baseline
SLOWDOWN_MIN_NS = 5_000_000  # and this much slower
SLOW_MIN_GROUPS = 3  # in at least this many collectives
SLOW_MIN_SHARE = 0.25  # and this share of the communicator's


def _concentration_min(nhosts: int) -> float:
    """Share of the retransmits a lossy host must be involved in: halfway
    between what any host gets when retransmits are spread evenly over random
    pairs (2 of n hosts) and all of them."""
    return max(RETRANS_CONCENTRATION, (1.0 + 2.0 / max(nhosts, 2)) / 2.0)


def _is_slowed(s: CommSlowdown) -> bool:
    return (
        s.hit_groups >= max(SLOW_MIN_GROUPS, SLOW_MIN_SHARE * s.groups)
        and s.hit_ns >= SLOWDOWN * s.baseline_ns
        and s.hit_ns - s.baseline_ns >= SLOWDOWN_MIN_NS
    )


def slowed_comms(a: Analysis, hosts: set[int]) -> list[CommSlowdown]:
    """Communicators spanning every one of ``hosts`` whose collectives with
    retransmits inside are markedly slower than those without."""
    return [s for s in a.slowdowns if hosts <= set(s.hosts) and _is_slowed(s)]


def lossy_hosts(a: Analysis) -> tuple[HostRetransmits, ...]:
    """The host(s) involved in nearly every retransmit on the ranks'
    connections (two nodes: both ends of the one link lose alike), when there
    are many per collective and the collectives they fall into are markedly
    slower than the communicator's others.  A few retransmits spread over
    the hosts, or ones that slow nothing, happen on any busy network."""

    def score(h: HostRetransmits) -> int:
        return h.local + h.remote

    total = sum(h.local for h in a.retransmits)
    if not total:
        return ()
    share = _concentration_min(len(a.incident.hosts))
    named = [
        h
        for h in a.retransmits
        if score(h) >= share * total and score(h) >= max(RETRANS_MIN, RETRANS_PER_CALL * h.calls)
    ]
    if not named or not slowed_comms(a, {h.host for h in named}):
        return ()
    if all(h.host in starved_hosts(a) for h in named):
        return ()  # a process starved of CPU stalls its connections: TCP retransmits
    return tuple(sorted(named, key=lambda h: h.host))


def detect_network(a: Analysis) -> list[Verdict]:
    lossy = lossy_hosts(a)
    if not lossy:
        return []
    inc = a.incident
    hosts = tuple(inc.hosts[h.host] for h in lossy)
    procs = [i for i, p in enumerate(inc.procs) if p.host in hosts]
    ranks, _, pids = who(inc, procs)
    evidence = [
        f"host {x.host_name}: {x.h.local} retransmits sent and {x.h.remote} received inside "
        f"collective windows ({x.h.total} sent in all)"
        for x in (_Named(inc.hosts[h.host], h) for h in a.retransmits)
    ]
    total = sum(h.local for h in a.retransmits)
    evidence += [
        f"host {inc.hosts[h.host]} is involved in {h.local + h.remote} of the {total} "
        "retransmits on the ranks' connections"
        for h in lossy
    ]
    evidence += [
        f"{s.hit_groups} of {s.groups} collectives on {inc.comms[s.comm].name} had retransmits "
        f"inside and took {ms(s.hit_ns)} (median) against {ms(s.baseline_ns)} for the others"
        for s in slowed_comms(a, {h.host for h in lossy})[:MAX_LISTED]
    ]
    durations = _median_duration(a)
    if durations is not None:
        evidence.append(f"median collective duration (all ranks): {ms(durations)}")
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


@dataclass(frozen=True, slots=True)
class _Named:
    host_name: str
    h: HostRetransmits


def _median_duration(a: Analysis) -> float | None:
    rows = a.matched.rows
    end, ts = rows["end"], rows["ts"]
    done = end > 0
    return float(np.median((end - ts)[done])) if done.any() else None

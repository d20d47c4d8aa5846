"""Cause before consequence, across verdict families.

A network partition (a cut, a link down, a flap, resets) is a cause: the
ranks blocked behind it are named missing by their communicators' frontiers,
the ranks whose calls failed on a reset connection exit, the collectives it
held look slowed by retransmits.  Those verdicts are named in its evidence
as consequences and leave the list.

A network straggler named on the collectives the network held is a cause
of a rank of its hosts missing from a collective for no longer than those
were held: the rank is late behind its link.

A desync is a cause: ranks that disagree on a collective wait for each other
forever or fail on the size they receive, and then hang, crash, exit or
leave no dump.  When a desync is found it comes first, and what followed it
(the other verdicts, members that left no readable dump, ranks that died) is
named in its evidence as a consequence.  The order of deaths among
themselves is ``exits``' business.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..verdict import Verdict, VerdictKind
from .common import MAX_LISTED, Analysis, ms, world_of

# what a network partition explains
EXPLAINED_BY_NETWORK = frozenset(
    {
        VerdictKind.MISSING_RANK,
        VerdictKind.RANK_EXITED,
        VerdictKind.NETWORK_STRAGGLER,
        VerdictKind.INCONCLUSIVE,
    }
)


def in_causal_order(a: Analysis, verdicts: list[Verdict]) -> list[Verdict]:
    return _desync_first(a, _network_first(_held_first(a, _within_pace_last(a, verdicts))))


def _within_pace_last(a: Analysis, verdicts: list[Verdict]) -> list[Verdict]:
    """In a slowdown, a rank missing from a collective for no longer than
    its communicator already paused between collectives before the slow
    window (a checkpoint's barrier: the lab's rank 0 pauses 1.5 s every 100
    steps) is the job's own pace, not a hang: it goes after the other
    verdicts, saying so.  A rank missing for longer stays where it was."""
    if not a.windows or not any(v.kind is VerdictKind.MISSING_RANK for v in verdicts):
        return verdicts
    pauses = {w.comm: _longest_pause(a, w.comm, w.first_gid) for w in a.windows}
    waits = {a.incident.comms[f.comm].hash_text: (f.comm, f.age_ns) for f in a.frontiers}
    rest: list[Verdict] = []
    within: list[Verdict] = []
    for v in verdicts:
        comm, age = waits.get(v.comm_id_hash or "", (-1, None))
        pause = pauses.get(comm)
        if v.kind is not VerdictKind.MISSING_RANK or age is None or not pause or age > pause:
            rest.append(v)
            continue
        line = (
            f"within the job's own pace: before its slow window this communicator's ranks "
            f"paused up to {ms(pause)} between collectives (median of each rank's longest), "
            f"and this wait is {ms(age)}: on its own, no hang"
        )
        within.append(dataclasses.replace(v, evidence=(*v.evidence, line)))
    return rest + within


def _longest_pause(a: Analysis, comm: int, first_gid: int) -> int | None:
    """The median over a communicator's members of each one's longest time
    between two of its calls there, before group ``first_gid``."""
    m = a.matched
    sl = m.comm_rows(comm)
    rows, gid = m.rows[sl], m.gid[sl]
    rows = rows[gid < first_gid]
    order = np.lexsort((rows["ts"], rows["proc"]))
    proc, ts = rows["proc"][order], rows["ts"][order].astype(np.int64)
    same = proc[1:] == proc[:-1]  # gaps between one member's calls
    if not same.any():
        return None
    gap, owner = np.diff(ts)[same], proc[1:][same]
    starts = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]])
    return int(np.median(np.maximum.reduceat(gap, starts)))


def _held_first(a: Analysis, verdicts: list[Verdict]) -> list[Verdict]:
    """A network straggler named on the collectives the network held
    (``Analysis.held``) explains a rank of its hosts missing from a
    collective for no longer than the network held one: late behind its
    link, not hung (a rank missing for longer stays a verdict of its own)."""
    net = next((v for v in verdicts if v.kind is VerdictKind.NETWORK_STRAGGLER), None)
    if net is None or not a.held:
        return verdicts
    longest = max(h.duration_ns for h in a.held)
    waits = {a.incident.comms[f.comm].hash_text: f.age_ns for f in a.frontiers}

    def behind_link(v: Verdict) -> bool:
        wait = waits.get(v.comm_id_hash or "")
        return (
            v.kind is VerdictKind.MISSING_RANK
            and bool(v.hosts)
            and set(v.hosts) <= set(net.hosts)
            and wait is not None
            and wait <= longest
        )

    explained = [v for v in verdicts if behind_link(v)]
    if not explained:
        return verdicts
    return _first(net, [], explained, verdicts, _consequences(explained))


def _network_first(verdicts: list[Verdict]) -> list[Verdict]:
    causes = [v for v in verdicts if v.kind is VerdictKind.NETWORK_PARTITION]
    if not causes:
        return verdicts
    cause = _one_end(causes[0], verdicts)
    explained = [v for v in verdicts if v.kind in EXPLAINED_BY_NETWORK and v is not cause]
    lines = _consequences(explained)
    pair, peers = causes[0], causes[1:]
    if cause is not pair:  # the pair's stop is the straggler's evidence
        lines = (f"beside it: {pair.summary}", *pair.evidence[:MAX_LISTED], *lines)
        explained.append(pair)
    return _first(cause, peers, explained, verdicts, lines)


def _one_end(partition: Verdict, verdicts: list[Verdict]) -> Verdict:
    """A partition of a pair of hosts (connections between those two alone
    stopped: either end may be the one) whose one end a network straggler
    names alone (in nearly every retransmit on the ranks' connections, its
    other links' too): that straggler is the cause, the pair's stop one of
    its connections' (a link capped or lossy loses so).  Else the partition."""
    pair = set(partition.hosts)
    if len(pair) != 2:
        return partition
    ends = (
        v
        for v in verdicts
        if v.kind is VerdictKind.NETWORK_STRAGGLER
        and len(set(v.hosts)) == 1
        and set(v.hosts) <= pair
    )
    return next(ends, partition)


def _desync_first(a: Analysis, verdicts: list[Verdict]) -> list[Verdict]:
    desyncs = sorted(
        (v for v in verdicts if v.kind is VerdictKind.DESYNC),
        key=lambda v: (v.seq if v.seq is not None else -1, v.sort_key()),
    )
    if not desyncs:
        return verdicts
    cause = desyncs[0]
    rest = [v for v in verdicts if v.kind is not VerdictKind.DESYNC]
    after = [f"after it: {v.summary}" for v in rest]
    after += _lost_after(a, cause)
    named = {r for v in rest for r in v.ranks}
    after += [
        f"after it: {p.label()} died ({_death(p.exit_code, p.exit_signal)})"
        for p in a.incident.procs
        if p.died_badly and p.world_rank not in named
    ][:MAX_LISTED]
    return _first(cause, desyncs[1:], [], verdicts, after)


def _first(
    cause: Verdict,
    peers: list[Verdict],
    explained: list[Verdict],
    verdicts: list[Verdict],
    lines: list[str] | tuple[str, ...],
) -> list[Verdict]:
    """``cause`` first with ``lines`` (what it explains) added to its
    evidence, then ``peers`` (causes of its kind), then the other verdicts
    but the ``explained`` ones, which leave the list."""
    first = dataclasses.replace(cause, evidence=cause.evidence + tuple(lines))
    gone = [cause, *peers, *explained]
    return [first, *peers, *(v for v in verdicts if not any(v is g for g in gone))]


def _consequences(explained: list[Verdict]) -> tuple[str, ...]:
    return tuple(f"consequence: {v.summary}" for v in explained)[:MAX_LISTED]


def _lost_after(a: Analysis, cause: Verdict) -> list[str]:
    """Members of the desync's communicator without a readable dump."""
    inc = a.incident
    out = []
    for f in a.frontiers:
        if inc.comms[f.comm].hash_text != cause.comm_id_hash or not f.unseen:
            continue
        ranks = [world_of(inc, f.comm, m.crank) for m in f.unseen]
        names = ", ".join(str(r) for r in ranks if r >= 0) or f"{len(ranks)} member(s)"
        out.append(
            f"after it: rank(s) {names} left no readable dump (a rank that fails on the size "
            "it receives may die): a consequence, not judged"
        )
    return out


def _death(code: int | None, signal: int | None) -> str:
    return f"signal {signal}" if signal else f"exit code {code}"

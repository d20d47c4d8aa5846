"""Compute straggler and CPU interference: one rank arrives last, step after
step (in a blocking collective the last to arrive waits least: durations
tell this without trusting clocks across hosts); when its threads wait in the
run queue while its peers wait for it, the verdict is CPU interference."""

from __future__ import annotations

import math

import numpy as np

from stallwatch.dumpers.schema import op_name

from ..rankmetrics import ArrivalScore
from ..verdict import Verdict, VerdictKind
from .common import Analysis, ms
from .cpu import sched_heavy
from .network import lossy_hosts

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
    under CPU contention is noise."""
    return (
        s.proc >= 0
        and s.groups >= STRAGGLER_MIN_GROUPS
        and s.last_fraction >= _last_fraction_min(s)
        and s.margin_ns >= (STRAGGLER_MARGIN_NS if s.method == "wait" else ARRIVAL_MARGIN_NS)
        and s.margin_ns >= STRAGGLER_PERIOD_SHARE * s.period_ns
        and (s.method != "lateness" or s.margin_ns >= CROSS_HOST_MARGIN_NS)
    )


def _waits_on_others(a: Analysis) -> set[int]:
    """Procs that, somewhere, wait clearly longer than their peers: they are
    held up by someone, so their lateness elsewhere is inherited.  On the
    device's timeline, clearly means by the margin a straggler must show
    against the same pace: device timings are observed by polling, and a few
    ms of wait in a large communicator holds nobody up."""
    return {
        s.proc
        for s in a.arrivals
        if s.method == "wait"
        and s.groups >= STRAGGLER_MIN_GROUPS
        and s.margin_ns <= -_held_margin(s)
    }


def _held_margin(s: ArrivalScore) -> float:
    if not s.device:
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
        (s.crank,),
    )


def detect_stragglers(a: Analysis) -> list[Verdict]:
    lossy = {a.incident.hosts[h.host] for h in lossy_hosts(a)}
    heavy = sched_heavy(a)
    out = []
    named = set()
    for s in straggler_candidates(a):
        named.add(s.proc)
        if s.proc in heavy:
            out.append(_straggler_verdict(a, s, VerdictKind.CPU_INTERFERENCE))
        elif a.incident.procs[s.proc].host not in lossy:
            out.append(_straggler_verdict(a, s, VerdictKind.COMPUTE_STRAGGLER))
    for proc in sorted(heavy - named):  # starved, and late (if less consistently)
        late = _late_somewhere(a, proc, heavy)
        if late is not None:
            s, share = late
            shared = share if share > s.last_fraction else None
            out.append(_straggler_verdict(a, s, VerdictKind.CPU_INTERFERENCE, shared))
    return out

"""Stage "detect": pick the departures from consensus out of the metrics.

Each detector is a plain function of an ``Analysis`` (the incident, its
matched calls and the metrics) returning verdicts, so that one can be swapped
or tested alone.  Thresholds are upper-case constants.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from dumpers.schema import Op, RedOp, datatype_name, op_name

from .match import Matched
from .metrics import (
    ArrivalScore,
    CommSlowdown,
    Disagreement,
    Frontier,
    HostRetransmits,
    Member,
    MemberState,
    P2pGap,
    proc_hosts,
)
from .model import Incident, Proc
from .verdict import Verdict, VerdictKind

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
SCHED_MIN_NS = 10_000_000  # run-queue delay that counts as interference
SCHED_DOMINANCE = 3.0  # times an unaffected rank's run-queue delay
RETRANS_MIN = 20  # retransmits inside collective windows that count
RETRANS_PER_CALL = 0.25  # and at least this many per completed collective of the host
RETRANS_CONCENTRATION = 0.75  # share of all retransmits the lossy host is involved in
SLOWDOWN = 3.0  # collectives with retransmits inside: this many times the baseline
SLOWDOWN_MIN_NS = 5_000_000  # and this much slower
SLOW_MIN_GROUPS = 3  # in at least this many collectives
SLOW_MIN_SHARE = 0.25  # and this share of the communicator's
MAX_LISTED = 16


@dataclass(frozen=True, slots=True)
class Analysis:
    incident: Incident
    matched: Matched
    frontiers: tuple[Frontier, ...]
    disagreements: tuple[Disagreement, ...]
    arrivals: tuple[ArrivalScore, ...]
    retransmits: tuple[HostRetransmits, ...]
    sched_delay: np.ndarray  # per proc, ns
    slowdowns: tuple[CommSlowdown, ...] = ()
    p2p: tuple[P2pGap, ...] = ()


Detector = Callable[[Analysis], list[Verdict]]


def _ms(ns: float) -> str:
    return f"{ns / 1e6:.1f} ms"


def _who(
    inc: Incident, procs: list[int]
) -> tuple[tuple[int, ...], tuple[str, ...], tuple[int, ...]]:
    ps = [inc.procs[p] for p in procs]
    return (
        tuple(p.world_rank for p in ps),
        tuple(sorted({p.host for p in ps})),
        tuple(p.pid for p in ps),
    )


def last_call_text(a: Analysis, proc: int) -> str:
    """What a rank last did: its latest call on any communicator."""
    rows = a.incident.calls.rows
    mine = rows[rows["proc"] == proc]
    if not len(mine):
        return "no NCCL call recorded"
    r = mine.record(int(np.argmax(mine["ts"])))
    comm = a.incident.comms[int(r["comm"])]
    state = "in flight" if int(r["end"]) == 0 else "returned"
    return f"last call {op_name(int(r['op']))} seq {int(r['seq'])} on {comm.name} ({state})"


def _member_text(a: Analysis, f: Frontier, m: Member) -> str:
    inc = a.incident
    comm = inc.comms[f.comm]
    if m.state is MemberState.NO_DUMP:
        world = f" (world rank {m.crank})" if _is_world(inc, f.comm) else ""
        return (
            f"comm rank {m.crank}{world} of {comm.name}: no dump holds it; its "
            f"{sum(1 for x in f.members if x.state is MemberState.AT_FRONTIER)} peers entered "
            f"seq {f.seq} and it is absent"
        )
    p = inc.procs[m.proc]
    entered = "nothing" if m.last_seq < 0 else f"seq {m.last_seq}"
    return (
        f"{p.label()} comm rank {m.crank} of {comm.name}: last entered {entered}, "
        f"peers at seq {f.seq}; {last_call_text(a, m.proc)}"
    )


def _is_world(inc: Incident, comm: int) -> bool:
    c = inc.comms[comm]
    return not c.is_split and c.nranks == max(x.nranks for x in inc.comms if not x.is_split)


def _victims(frontiers: tuple[Frontier, ...]) -> set[int]:
    """Procs that lag somewhere only because they wait, at the frontier of a
    stuck communicator, for some other rank."""
    out: set[int] = set()
    for f in frontiers:
        if not f.stuck:
            continue
        lagging = {m.proc for m in f.laggards}
        if not lagging:
            continue
        for m in f.members:
            if m.state is MemberState.AT_FRONTIER and m.in_flight and m.proc not in lagging:
                out.add(m.proc)
    return out


def stuck_laggards(a: Analysis) -> list[tuple[Frontier, Member]]:
    pairs = [(f, m) for f in a.frontiers if f.stuck for m in f.laggards]
    victims = _victims(a.frontiers)
    culprits = [(f, m) for f, m in pairs if m.proc < 0 or m.proc not in victims]
    return culprits or pairs


def _primary(a: Analysis, frontiers: list[Frontier]) -> Frontier:
    comms = a.incident.comms
    return min(frontiers, key=lambda f: (-comms[f.comm].nranks, comms[f.comm].comm_hash))


def detect_missing_rank(a: Analysis) -> list[Verdict]:
    inc = a.incident
    pairs = [(f, m) for f, m in stuck_laggards(a) if m.proc < 0 or not inc.procs[m.proc].died_badly]
    if not pairs:
        return []
    main = _primary(a, [f for f, _ in pairs])
    comms = inc.comms

    def order(fm: tuple[Frontier, Member]) -> tuple[int, int, int]:
        f, m = fm
        world = inc.procs[m.proc].world_rank if m.proc >= 0 else m.crank
        return (world, -comms[f.comm].nranks, comms[f.comm].comm_hash)

    evidence = [_member_text(a, f, m) for f, m in sorted(pairs, key=order)[:MAX_LISTED]]
    age = "" if main.age_ns is None else f" for {main.age_ns / 1e9:.1f} s"
    missing_dumps = sum(1 for _, m in pairs if m.proc < 0)
    if missing_dumps:
        evidence.append(f"{missing_dumps} rank(s) have no dump; judged from their peers' records")
    return [
        _missing_rank(
            inc,
            main.comm,
            [m.proc for _, m in pairs],
            [(m.crank, m.proc) for f, m in pairs if f.comm == main.comm],
            main.seq,
            op_name(main.op),
            lambda names: (
                f"rank {names} never entered {op_name(main.op)} seq {main.seq} on "
                f"{comms[main.comm].name}; the other ranks wait there{age}"
            ),
            evidence,
        )
    ]


def _missing_rank(
    inc: Incident,
    comm: int,
    procs: list[int],
    members: list[tuple[int, int]],
    seq: int,
    op: str,
    summary: Callable[[str], str],
    evidence: list[str],
) -> Verdict:
    """A missing_rank verdict on ``comm``: the culprits' procs on any
    communicator (-1: no dump), and their (comm rank, proc) in ``comm``.  A
    rank without a dump is named by its world rank when ``comm`` is the world."""
    ranks, hosts, pids = _who(inc, sorted({p for p in procs if p >= 0}))
    absent = sorted({r for r, p in members if p < 0})
    if absent and _is_world(inc, comm):
        ranks = tuple(sorted({*ranks, *absent}))
    names = ", ".join(str(r) for r in ranks)
    return Verdict(
        VerdictKind.MISSING_RANK,
        ranks,
        hosts,
        pids,
        inc.comms[comm].hash_text,
        seq,
        op,
        summary(names),
        tuple(evidence),
        tuple(r for r, _ in members),
    )


def _field_text(field: str, value: int) -> str:
    if field == "op":
        return op_name(value)
    if field == "datatype":
        return datatype_name(value)
    if field == "redop":
        try:
            return RedOp(value).name.lower()
        except ValueError:
            return f"redop_{value}"
    return str(value)


def detect_desync(a: Analysis) -> list[Verdict]:
    inc, m = a.incident, a.matched
    first: dict[tuple[int, ...], list[Disagreement]] = {}
    for d in sorted(a.disagreements, key=lambda d: (d.comm, d.seq, d.field)):
        procs = tuple(sorted({int(m.rows["proc"][i]) for i, _ in d.odd}))
        first.setdefault(procs, []).append(d)
    out = []
    for procs, ds in first.items():
        d = ds[0]
        ranks, hosts, pids = _who(inc, list(procs))
        comm = inc.comms[d.comm]
        i0, v0 = d.odd[0]
        op = op_name(int(m.rows["op"][i0]))
        names = ", ".join(str(r) for r in ranks)
        summary = (
            f"rank {names} passed {d.field}={_field_text(d.field, v0)} at seq {d.seq} on "
            f"{comm.name} where the others passed {_field_text(d.field, d.consensus)}"
        )
        if d.tie:
            summary += " (no majority: either side may be wrong)"
        evidence = [
            f"seq {x.seq} {x.field}: "
            + ", ".join(
                f"{inc.procs[int(m.rows['proc'][i])].label()} {_field_text(x.field, v)}"
                for i, v in x.odd[:MAX_LISTED]
            )
            + f"; consensus {_field_text(x.field, x.consensus)}"
            for x in ds[:MAX_LISTED]
        ]
        cranks = tuple(int(m.rows["crank"][i]) for i, _ in d.odd)
        out.append(
            Verdict(
                VerdictKind.DESYNC,
                ranks,
                hosts,
                pids,
                comm.hash_text,
                d.seq,
                op,
                summary,
                tuple(evidence),
                cranks,
            )
        )
    return out


def _death(p: Proc) -> str:
    if p.exit_signal:
        return f"was killed by signal {p.exit_signal}"
    return f"exited with code {p.exit_code}"


def _failed_calls(a: Analysis) -> set[int]:
    """Procs whose last call returned an error: they died of a peer's death."""
    rows = a.incident.calls.rows
    bad = rows[(rows["result"] > 0)]
    return {int(p) for p in np.unique(bad["proc"])}


def detect_rank_exited(a: Analysis) -> list[Verdict]:
    inc = a.incident
    dead = [i for i, p in enumerate(inc.procs) if p.died_badly]
    if not dead:
        return []
    failed = _failed_calls(a)
    culprits = [i for i in dead if i not in failed]
    if not culprits and a.disagreements:
        return []  # they exited on the error a desync caused: the desync is the finding
    culprits = culprits or dead
    out = []
    for i in culprits:
        p = inc.procs[i]
        lag = [(f, m) for f in a.frontiers for m in f.laggards if m.proc == i]
        where = _primary(a, [f for f, _ in lag]) if lag else None
        comm = inc.comms[where.comm].hash_text if where else None
        summary = f"{p.label()} {_death(p)}"
        if where is not None:
            summary += f"; its peers wait at {op_name(where.op)} seq {where.seq} on {comm}"
        evidence = [f"{p.label()} {_death(p)}", last_call_text(a, i)]
        evidence += [_member_text(a, f, m) for f, m in lag[:MAX_LISTED]]
        others = [inc.procs[j].label() for j in dead if j not in culprits]
        if others:
            evidence.append(
                "also exited, after a call failed on a peer's error: " + ", ".join(others)
            )
        out.append(
            Verdict(
                VerdictKind.RANK_EXITED,
                (p.world_rank,),
                (p.host,),
                (p.pid,),
                comm,
                where.seq if where else None,
                op_name(where.op) if where else None,
                summary,
                tuple(evidence),
            )
        )
    return out


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
    held up by someone, so their lateness elsewhere is inherited."""
    return {
        s.proc
        for s in a.arrivals
        if s.method == "wait"
        and s.groups >= STRAGGLER_MIN_GROUPS
        and s.margin_ns <= -STRAGGLER_MARGIN_NS
    }


def straggler_candidates(a: Analysis) -> list[ArrivalScore]:
    """Ranks consistently last in a communicator that never wait on anyone
    (a rank held up by a slow peer in one group arrives late in the next)."""
    best: dict[int, ArrivalScore] = {}
    for s in a.arrivals:
        if not _is_straggling(s):
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


def _sched_heavy(a: Analysis) -> set[int]:
    """Procs whose threads waited in the run queue far more than an
    unaffected rank (the lower quartile: a hog may starve several ranks)."""
    d = a.sched_delay
    if not len(d):
        return set()
    typical = max(float(np.percentile(d, 25)), 1.0)
    return {int(i) for i in np.flatnonzero((d >= SCHED_MIN_NS) & (d >= SCHED_DOMINANCE * typical))}


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
    if all(h.host in _starved_hosts(a) for h in named):
        return ()  # a process starved of CPU stalls its connections: TCP retransmits
    return tuple(sorted(named, key=lambda h: h.host))


def _starved_hosts(a: Analysis) -> set[int]:
    hosts = proc_hosts(a.incident)
    return {hosts[p] for p in _sched_heavy(a)}


def _straggler_verdict(
    a: Analysis, s: ArrivalScore, kind: VerdictKind, starved_share: float | None = None
) -> Verdict:
    inc = a.incident
    p = inc.procs[s.proc]
    comm = inc.comms[s.comm]
    if s.method == "wait":
        how = (
            f"its calls took {_ms(s.own_wait_ns)} (median) while its peers waited "
            f"{_ms(s.peer_wait_ns)}: it arrives last and waits least"
        )
    elif s.method == "host-lateness":
        how = f"it enters {_ms(s.margin_ns)} (median) after the other ranks of its host"
    else:
        how = (
            f"it enters {_ms(s.margin_ns)} (median) after the first rank, across hosts "
            f"(far above clock skew: at least {_ms(CROSS_HOST_MARGIN_NS)})"
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
        typical = float(np.percentile(a.sched_delay, 25))
        evidence.append(
            f"its threads waited {_ms(float(a.sched_delay[s.proc]))} in the run queue; "
            f"an unaffected rank (lower quartile) waited {_ms(typical)}"
        )
        summary = f"{p.label()} is starved of CPU (run-queue delay) and its peers wait for it"
    else:
        summary = f"{p.label()} arrives last at collectives, {_ms(s.margin_ns)} behind its peers"
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
    heavy = _sched_heavy(a)
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


def detect_network(a: Analysis) -> list[Verdict]:
    lossy = lossy_hosts(a)
    if not lossy:
        return []
    inc = a.incident
    hosts = tuple(inc.hosts[h.host] for h in lossy)
    procs = [i for i, p in enumerate(inc.procs) if p.host in hosts]
    ranks, _, pids = _who(inc, procs)
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
        f"inside and took {_ms(s.hit_ns)} (median) against {_ms(s.baseline_ns)} for the others"
        for s in slowed_comms(a, {h.host for h in lossy})[:MAX_LISTED]
    ]
    durations = _median_duration(a)
    if durations is not None:
        evidence.append(f"median collective duration (all ranks): {_ms(durations)}")
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


DETECTORS: tuple[Detector, ...] = (
    detect_missing_rank,
    detect_desync,
    detect_rank_exited,
    detect_stragglers,
    detect_network,
)


P2P_STALL_NS = 1_000_000_000  # a side waiting on its peer's post, idle at least this long


def detect_p2p_missing(a: Analysis) -> list[Verdict]:
    """A stall no collective shows: a rank posted sends (receives) that its
    peer never matched, and has done nothing since.  The peers that never
    posted are the culprits, unless they are themselves waiting on someone
    in the same way (a chain: its end is named; a cycle: all of it)."""
    inc = a.incident
    gaps = [
        g
        for g in a.p2p
        if g.idle_ns is not None
        and g.idle_ns >= P2P_STALL_NS
        and (g.missing < 0 or not inc.procs[g.missing].died_badly)
    ]
    if not gaps:
        return []
    waiting = {g.waiting for g in gaps}
    culprits = [g for g in gaps if g.missing < 0 or g.missing not in waiting] or gaps
    main = min(culprits, key=lambda g: (g.comm, g.missing_crank, g.src, g.dst))
    comm = inc.comms[main.comm]
    wanted = "RECV" if main.op == Op.SEND else "SEND"
    who = inc.procs[main.waiting].label()
    age = "" if main.age_ns is None else f" for {main.age_ns / 1e9:.1f} s"
    poster = main.src if main.op == Op.SEND else main.dst
    on_main = sorted({(g.missing_crank, g.missing) for g in culprits if g.comm == main.comm})
    return [
        _missing_rank(
            inc,
            main.comm,
            [g.missing for g in culprits],
            on_main,
            main.seq,
            wanted,
            lambda names: (
                f"rank {names} never posted the {wanted} matching "
                f"{op_name(main.op)} seq {main.seq} of comm rank {poster} on {comm.name}; "
                f"{who} waits there{age}"
            ),
            [_gap_text(inc, g) for g in culprits[:MAX_LISTED]],
        )
    ]


def _gap_text(inc: Incident, g: P2pGap) -> str:
    comm = inc.comms[g.comm]
    other = (
        inc.procs[g.missing].label() if g.missing >= 0 else f"comm rank {g.missing_crank} (no dump)"
    )
    mine = "sends" if g.op == Op.SEND else "receives"
    theirs = "receives" if g.op == Op.SEND else "sends"
    last = "none" if g.other_last < 0 else f"seq {g.other_last}"
    idle = "" if g.idle_ns is None else f", idle for {g.idle_ns / 1e9:.1f} s"
    return (
        f"{inc.procs[g.waiting].label()} posted {g.posted} {mine} from comm rank {g.src} to "
        f"{g.dst} on {comm.name} from seq {g.seq} that {other} never matched (its last "
        f"{theirs[:-1]}: {last}){idle}"
    )


# run when no detector above finds anything: a collective verdict explains
# the p2p calls around it better than they explain themselves
FALLBACK_DETECTORS: tuple[Detector, ...] = (detect_p2p_missing,)

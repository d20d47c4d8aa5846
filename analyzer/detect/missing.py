"""Missing rank: at a communicator's frontier some ranks entered and others
never did (collectives), or a rank posted point-to-point calls its peer never
matched and has been idle since (a stall no collective shows).  The metrics:
each communicator's frontier (``analyzer.frontier``, which other families
read too), and the point-to-point directions whose sends and receives do not
pair up (``p2p_gaps``)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from stallwatch.dumpers.schema import Op, op_name

from ..columns import Columns
from ..frontier import evidence_moments
from ..incident import SKEW_NS, Frontier, Incident, Lag, Member, MemberState, P2pGap, proc_hosts
from ..match import IS_P2P
from ..verdict import Verdict, VerdictKind, rank_text
from .busy import busy_instead, latest_reading
from .common import MAX_LISTED, Analysis, member_text, primary, who
from .exits import torn_down, torn_down_text

# ---- metrics: point-to-point calls one side posted and the other did not -------------

P2P_OPS = (int(Op.SEND), int(Op.RECV))


def p2p_gaps(inc: Incident) -> list[P2pGap]:
    """Every direction whose sends and receives do not pair up at the dump.
    A side whose ring wrapped past every row of the direction is unknown,
    not missing: no gap is made of it.  Directions are in comm ranks: a
    member whose rank is not known (``Comm.ranks``) places none of its calls,
    and a peer no known slot holds is a member without a dump."""
    rows = inc.calls.rows
    start = max(inc.calls.matched, 0)
    p2p = rows[start:] if start else rows
    sel = np.flatnonzero(np.isin(p2p["op"], P2P_OPS) & (p2p["root"] >= 0))
    if not len(sel):
        return []
    t = p2p.select(("comm", "crank", "root", "op", "seq", "ts", "proc")).take(sel)
    own = _own_ranks(inc, t["comm"], t["crank"])
    placed = np.flatnonzero(own >= 0)
    t, own = t.take(placed), own[placed]
    if not len(own):
        return []
    n = int(max(own.max(), t["root"].max())) + 1
    is_send = t["op"] == Op.SEND
    # the direction of each row, as (comm, src, dst)
    src = np.where(is_send, own, t["root"]).astype(np.int64)
    dst = np.where(is_send, t["root"], own).astype(np.int64)
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
        c = inc.comms[comm]
        missing_crank = d if send else s
        if (c.size >= 0 and missing_crank >= c.size) or (c.exact and missing_crank >= c.nranks):
            continue  # a peer outside the communicator: no call of NCCL's names one
        slot = c.slot_of(missing_crank)
        missing = c.members[slot] if slot >= 0 else -1
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
                int(t["ts"][row]),
            )
        )  # fmt: skip
    return out


def _own_ranks(inc: Incident, comm: np.ndarray, slot: np.ndarray) -> np.ndarray:
    """Each row's comm rank: its slot where every rank of its communicator is
    known, else the rank the evidence gives that slot (-1: unknown)."""
    out = slot.astype(np.int64)
    for c in np.unique(comm).tolist():
        k = inc.comms[c]
        if k.exact:
            continue
        mine = comm == c
        table = np.array(k.ranks, dtype=np.int64)
        out[mine] = table[np.clip(slot[mine], 0, len(table) - 1)]
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
    stuck = IS_P2P[p2p["op"]] & (p2p["end"] == 0)
    found = {int(p) for p in np.unique(p2p["proc"][stuck]).tolist()}
    return frozenset(found | _in_grouped_p2p(inc, p2p))


def _in_grouped_p2p(inc: Incident, rows: Columns) -> set[int]:
    """Procs whose latest call is a point-to-point one and whose latest
    thread reading (their dump's) has a thread inside ``ncclGroupEnd``:
    sends and receives inside a group return at once, queued, and the
    group's end waits for their peers."""
    out: set[int] = set()
    if not len(rows):
        return out
    order = np.lexsort((rows["ts"], rows["proc"]))
    procs = rows["proc"][order]
    last = order[np.r_[procs[1:] != procs[:-1], True]]
    for i in last[IS_P2P[rows["op"][last]]].tolist():
        proc = int(rows["proc"][i])
        reading = latest_reading(inc, proc)
        if reading is not None and any(
            t.nccl is not None and t.nccl.op is Op.GROUP_END for t in reading.threads
        ):
            out.add(proc)
    return out


def _latest_per_proc(inc: Incident) -> np.ndarray:
    """Each proc's latest timestamp (entry or return) over all its calls."""
    rows = inc.calls.rows
    out = np.zeros(len(inc.procs), dtype=np.int64)
    if len(rows):
        np.maximum.at(out, rows["proc"], np.maximum(rows["ts"], rows["end"]))
    return out


P2P_STALL_NS = 1_000_000_000  # a side waiting on its peer's post, idle at least this long


# ---- the detectors -------------------------------------------------------------------


def _victims(frontiers: tuple[Frontier, ...]) -> dict[int, bool]:
    """Procs that lag somewhere only because they wait, inside a collective
    of a stuck communicator, for a member that never entered it (a gather's
    root waits for its sources while the others have gone on): proc -> whether
    only members that cannot be judged are among those it waits for: without
    a dump, or whose dumps are proven older (read before they went on: dumps
    taken in turn).  One in flight at a stuck frontier that every member
    known entered waits too: for a member no input shows (a group whose
    members are known only from the dumps that hold its entries, one of them
    lost), or for the collective itself; never for a rank seen."""
    out: dict[int, bool] = {}
    for f in frontiers:
        if not f.stuck:
            continue
        # someone is behind m when the lowest seq is below m's; only members
        # that cannot be judged are when every other member is at m's seq or
        # past it (one pass per communicator: a world of 131,072 members)
        lowest = min(x.last_seq for x in f.members)
        judged = (x for x in f.members if x.proc >= 0 and not _read_older(f, x))
        lowest_seen = min((x.last_seq for x in judged), default=NO_SEQ)
        everyone = lowest == max(x.last_seq for x in f.members)
        for m in f.members:
            if m.proc < 0 or not m.in_flight or m.returned or lowest > m.last_seq:
                continue
            if lowest == m.last_seq and not everyone:
                continue  # among the lowest: waits for no one behind it
            unseen_only = lowest_seen >= m.last_seq
            out[m.proc] = out.get(m.proc, True) and unseen_only
    return out


NO_SEQ = 1 << 62  # above any seq


def _read_older(f: Frontier, m: Member) -> bool:
    """A laggard whose dump is proven read before it went on."""
    return m.state in (MemberState.BEHIND, MemberState.NO_ROWS) and f.lag(m) is Lag.OLDER


def taken_in_turn(a: Analysis) -> bool:
    """Whether the evidence shows dumps taken at different moments: some
    member's dump ends before what its peers prove it did since, or was
    taken before a frontier it lags began."""
    return any(f.lag(m) is Lag.OLDER for f in a.frontiers for m in f.laggards)


def moments_apart_ns(a: Analysis) -> int | None:
    """How far apart the members' evidence was taken, by its moments
    (capture times, or latest entries where no dump time is known)."""
    seen = [m.moment for f in a.frontiers for m in f.members if m.moment is not None]
    return max(seen) - min(seen) if seen else None


def behind(a: Analysis) -> list[tuple[Frontier, Member]]:
    """Laggards of stuck frontiers that are proven stuck: their evidence was
    taken after the frontier began; where that cannot be told (no dump
    time), those not shown older.  When the dumps were taken in turn (some
    are shown older: a staircase), the dumps taken last decide: where they
    stand at the frontier (``Frontier.stood_still``), a laggard that cannot
    be told is named when it is the one member absent from it whose own
    evidence is not proven older than it (the rank the standing ones wait
    for); those proven older (their peers' completions prove they went on
    after their dumps: dumped before the stall) are not, and neither is
    anyone where two or more cannot be told, or a member without a dump is
    absent too (inconclusive between them: ``detect.stall``).  A staircase
    whose latest dumps keep going names nobody."""
    in_turn = taken_in_turn(a)
    out = []
    for f in a.frontiers:
        if not f.stuck:
            continue
        lags = [(m, f.lag(m)) for m in f.laggards]
        untold = sum(lag is not Lag.OLDER for _, lag in lags) + len(f.unseen)
        lone = not in_turn or (f.stood_still and untold == 1)
        out += [(f, m) for m, lag in lags if lag is Lag.STUCK or (lag is Lag.UNPROVEN and lone)]
    return out


def stuck_laggards(a: Analysis) -> list[tuple[Frontier, Member]]:
    """Members whose own dumps show them behind a stuck frontier (``behind``);
    those that lag only because they wait for someone elsewhere are left
    out: in flight at another stuck frontier, or blocked in a point-to-point
    call (a pipeline stage waiting for its neighbour lags at the
    data-parallel collectives only because it waits).  When every one waits
    for another (a cycle), all are named; when they wait for members without
    a dump, none is (that is inconclusive)."""
    pairs = behind(a)
    if not pairs:
        return []
    victims = _victims(a.frontiers)
    for p in waiting_in_p2p(a.incident):
        victims.setdefault(p, False)  # its peer is not known to be without a dump
    culprits = [(f, m) for f, m in pairs if m.proc not in victims]
    if culprits or any(victims.get(m.proc) for _, m in pairs):
        return culprits
    return pairs


def device_laggards(a: Analysis) -> list[tuple[Frontier, Member, int]]:
    """(frontier, member, the most its peers completed) for members of a
    stuck communicator that entered as far as their peers but whose device
    completed less: a collective completes on all its members, so a member
    whose completions stop short of its peers' is the one whose GPU (or the
    thread that watches it) stopped.  Only where completion is the device's
    (Flight Recorder of NCCL)."""
    if not a.incident.device_completion:
        return []
    out = []
    for f in a.frontiers:
        if not f.stuck:
            continue
        seen = [m for m in f.members if m.proc >= 0]
        best = max((m.last_returned for m in seen), default=-1)
        out += [
            (f, m, best)
            for m in seen
            if m.state is MemberState.AT_FRONTIER and 0 <= m.last_returned < best
        ]
    return out


def _device_text(a: Analysis, f: Frontier, m: Member, best: int) -> str:
    p = a.incident.procs[m.proc]
    return (
        f"{p.label()} comm rank {a.incident.comms[f.comm].rank_text(m.crank)} of "
        f"{a.incident.comms[f.comm].name}: entered seq "
        f"{m.last_seq} like its peers, but completed nothing after seq {m.last_returned} "
        f"where a peer completed up to seq {best}"
    )


def detect_missing_rank(a: Analysis) -> list[Verdict]:
    inc = a.incident
    torn = torn_down(a)  # hung, then killed with the job: still the hang's
    alive = {i for i, p in enumerate(inc.procs) if not p.died_badly} | torn
    pairs = [(f, m) for f, m in stuck_laggards(a) if m.proc in alive]
    host = {m.proc for _, m in pairs}
    device: dict[int, tuple[Frontier, Member, int]] = {}
    for f, m, best in device_laggards(a):
        if m.proc not in host and m.proc in alive:
            cur = device.get(m.proc)
            if cur is None or best - m.last_returned > cur[2] - cur[1].last_returned:
                device[m.proc] = (f, m, best)
    if not pairs and not device:
        return []
    main = _headline(a, pairs) if pairs else primary(a, [f for f, _, _ in device.values()])
    comms = inc.comms

    def order(fm: tuple[Frontier, Member]) -> tuple[int, int, int]:
        f, m = fm
        return (inc.procs[m.proc].world_rank, -comms[f.comm].nranks, comms[f.comm].comm_hash)

    evidence = [member_text(a, f, m) for f, m in sorted(pairs, key=order)[:MAX_LISTED]]
    evidence += _consequences(a, main, pairs)
    evidence += [_device_text(a, *device[p]) for p in sorted(device)][:MAX_LISTED]
    evidence += [torn_down_text(inc.procs[p]) for p in sorted(host | set(device)) if p in torn]
    age = "" if main.age_ns is None else f" for {main.age_ns / 1e9:.1f} s"
    verdict = _missing_rank(
        inc,
        main.comm,
        [m.proc for _, m in pairs] + sorted(device),
        [(comms[main.comm].rank_of(m.crank), m.proc) for f, m in pairs if f.comm == main.comm]
        + [
            (comms[main.comm].rank_of(m.crank), m.proc)
            for f, m, _ in device.values()
            if f.comm == main.comm
        ],
        main.seq,
        op_name(main.op),
        lambda names: _summary(a, main, host, device, age),
        evidence,
        _judged_on(main, pairs, device),
    )
    busy = None if device else busy_instead(a, verdict, [(f, m.proc) for f, m in pairs], age)
    return [busy or verdict]


def _headline(a: Analysis, pairs: list[tuple[Frontier, Member]]) -> Frontier:
    """Where the culprits alone are absent: the smallest communicator whose
    frontier no one else misses (a rank that hung before its tensor-parallel
    collective leaves its partner waiting there; the data-parallel and world
    collectives that both then miss are consequences).  Failing one, the
    largest (``primary``)."""
    culprits = {m.proc for _, m in pairs}
    fronts = list({f.comm: f for f, _ in pairs}.values())
    comms = a.incident.comms
    alone = [f for f in fronts if {m.proc for m in f.laggards} <= culprits]
    if not alone:
        return primary(a, fronts)
    # of two as small, the one that began first: the first it failed to enter
    never = 1 << 62
    return min(
        alone,
        key=lambda f: (
            comms[f.comm].nranks,
            never if f.began is None else f.began,
            comms[f.comm].comm_hash,
        ),
    )


def _consequences(a: Analysis, main: Frontier, pairs: list[tuple[Frontier, Member]]) -> list[str]:
    """The other collectives the culprits hold up, largest first."""
    comms = a.incident.comms
    others = {f.comm: f for f, _ in pairs if f.comm != main.comm}.values()
    ordered = sorted(others, key=lambda f: (-comms[f.comm].nranks, comms[f.comm].comm_hash))
    return [
        f"consequence: {op_name(f.op)} seq {f.seq} on {comms[f.comm].name} "
        f"({comms[f.comm].size_text}) waits for it too"
        for f in ordered[:MAX_LISTED]
    ]


def _judged_on(
    main: Frontier,
    pairs: list[tuple[Frontier, Member]],
    device: dict[int, tuple[Frontier, Member, int]],
) -> dict[int, int]:
    """Each culprit's communicator: the main one where it lags there, else
    the first where it lags, else where its device stopped."""
    out: dict[int, int] = {}
    for f, m in pairs:
        if f.comm == main.comm or m.proc not in out:
            out[m.proc] = f.comm
    for p, (f, _, _) in device.items():
        out.setdefault(p, f.comm)
    return out


def _summary(
    a: Analysis,
    main: Frontier,
    host: set[int],
    device: dict[int, tuple[Frontier, Member, int]],
    age: str,
) -> str:
    inc = a.incident

    def ranks(procs: set[int] | list[int]) -> str:
        known = sorted(inc.procs[p].world_rank for p in procs)
        return ", ".join(rank_text(r) for r in sorted(known, key=lambda r: (r < 0, r)))

    where = f"{op_name(main.op)} seq {main.seq} on {inc.comms[main.comm].name}"
    parts = []
    if host:
        parts.append(f"rank {ranks(host)} never entered {where}; the other ranks wait there{age}")
    if device:
        stop = ", ".join(
            f"seq {m.last_returned}" for _, m, _ in (device[p] for p in sorted(device))
        )
        parts.append(
            f"rank {ranks(list(device))} entered as far as their peers but completed nothing "
            f"after {stop} (their peers completed more)"
        )
    return "; ".join(parts)


def _missing_rank(
    inc: Incident,
    comm: int,
    procs: list[int],
    members: list[tuple[int, int]],
    seq: int,
    op: str,
    summary: Callable[[str], str],
    evidence: list[str],
    judged: dict[int, int] | None = None,
) -> Verdict:
    """A missing_rank verdict on ``comm``: the culprits' procs on any
    communicator, and their (comm rank, proc) in ``comm``; ``judged``: the
    communicator each culprit was judged on, where not ``comm``."""
    culprits = sorted({p for p in procs if p >= 0})
    ranks, hosts, pids = who(inc, culprits)
    on = judged or {}
    where = tuple(inc.comms[on.get(p, comm)].hash_text for p in culprits)
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
        where,
    )


def self_blaming(gaps: tuple[P2pGap, ...] | list[P2pGap]) -> list[P2pGap]:
    """Gaps whose two sides are one rank: a rank cannot wait for itself to
    post what it did not; such evidence says the communicator's ranks were
    read wrong, and no verdict may rest on it (reported, never judged)."""
    return [g for g in gaps if g.missing >= 0 and g.missing == g.waiting]


def refused_text(inc: Incident, g: P2pGap) -> str:
    return (
        f"refused: {_gap_text(inc, g)}: its two sides are one rank, so the ranks of "
        f"{inc.comms[g.comm].name} cannot be what they were read as"
    )


def _proven_behind(a: Analysis, g: P2pGap) -> bool:
    """The peer's own evidence was taken after the waiting side posted the
    call it never matched (beyond the clocks' skew): its dump shows it
    behind, not read before it went on (as ``Frontier.lag`` asks of a
    collective's laggard)."""
    inc = a.incident
    hosts = proc_hosts(inc)
    moment, _ = evidence_moments(inc, hosts)
    offset = inc.to_wall(hosts[g.waiting])
    seen = moment[hosts[g.missing]]
    if offset is None or seen is None:
        return True  # no clock to tell: the idle waiting side is the evidence
    return seen >= g.posted_ns + offset + SKEW_NS


def detect_p2p_missing(a: Analysis) -> list[Verdict]:
    """A stall no collective shows: a rank posted sends (receives) that its
    peer never matched, and has done nothing since.  The peers that never
    posted are the culprits, unless they are themselves waiting on someone
    in the same way (a chain: its end is named; a cycle: all of it).  By the
    rules of collectives: a peer without a dump (or whose rank there is not
    known) is never blamed, nor one whose dump was taken before the call it
    never matched was posted; evidence naming one rank on both sides is
    refused (``self_blaming``)."""
    inc = a.incident
    wrong = set(map(id, self_blaming(a.p2p)))
    gaps = [
        g
        for g in a.p2p
        if g.idle_ns is not None
        and g.idle_ns >= P2P_STALL_NS
        and g.missing >= 0  # a peer without a dump is not blamed: inconclusive
        and id(g) not in wrong
        and not inc.procs[g.missing].died_badly
        and _proven_behind(a, g)
    ]
    if not gaps:
        return []
    waiting = {g.waiting for g in gaps}
    culprits = [g for g in gaps if g.missing not in waiting] or gaps
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

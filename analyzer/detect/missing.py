"""Missing rank: at a communicator's frontier some ranks entered and others
never did (collectives), or a rank posted point-to-point calls its peer never
matched and has been idle since (a stall no collective shows)."""

from __future__ import annotations

from collections.abc import Callable

from stallwatch.dumpers.schema import Op, op_name

from ..metrics import Frontier, Member, MemberState, P2pGap
from ..model import Incident
from ..verdict import Verdict, VerdictKind
from .common import MAX_LISTED, Analysis, is_world, member_text, primary, who

P2P_STALL_NS = 1_000_000_000  # a side waiting on its peer's post, idle at least this long


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


def detect_missing_rank(a: Analysis) -> list[Verdict]:
    inc = a.incident
    pairs = [(f, m) for f, m in stuck_laggards(a) if m.proc < 0 or not inc.procs[m.proc].died_badly]
    if not pairs:
        return []
    main = primary(a, [f for f, _ in pairs])
    comms = inc.comms

    def order(fm: tuple[Frontier, Member]) -> tuple[int, int, int]:
        f, m = fm
        world = inc.procs[m.proc].world_rank if m.proc >= 0 else m.crank
        return (world, -comms[f.comm].nranks, comms[f.comm].comm_hash)

    evidence = [member_text(a, f, m) for f, m in sorted(pairs, key=order)[:MAX_LISTED]]
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
    ranks, hosts, pids = who(inc, sorted({p for p in procs if p >= 0}))
    absent = sorted({r for r, p in members if p < 0})
    if absent and is_world(inc, comm):
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

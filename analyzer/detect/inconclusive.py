"""Inconclusive: the inputs do not allow a judgement.

Said when nothing departs from consensus among what could be seen, yet a
"healthy" would claim more than the inputs show: no call could be matched at
all, or members of a communicator left no readable dump.  Those members are
judged only from their peers' records: a collective any member completed
proves every member entered it; after that, nothing is known of them.  A stall
that only such members can hold up (every member with a dump entered the
frontier collective, none completed it) is inconclusive too: they may never
have entered it, or the collective may be stuck for everyone.
"""

from __future__ import annotations

from collections.abc import Iterable

from stallwatch.dumpers.schema import op_name

from ..incident import Frontier, Lag
from ..verdict import Verdict, VerdictKind
from .common import MAX_LISTED, Analysis, primary, waiting, world_of


def unseen_ranks(a: Analysis, frontiers: Iterable[Frontier]) -> list[int]:
    """The world ranks of the frontiers' members no readable dump holds."""
    ranks = {world_of(a.incident, f.comm, m.crank) for f in frontiers for m in f.unseen}
    return sorted(r for r in ranks if r >= 0)


def _names(a: Analysis, f: Frontier) -> str:
    """The members of a frontier no readable dump holds, for people: by
    world rank, else by comm rank, else counted (their ranks unknown)."""
    comm = a.incident.comms[f.comm]
    world, ranked, unknown = [], [], 0
    for m in f.unseen:
        w = world_of(a.incident, f.comm, m.crank)
        if w >= 0:
            world.append(str(w))
        elif comm.rank_of(m.crank) >= 0:
            ranked.append(comm.rank_text(m.crank))
        elif not comm.may_be_empty(m.crank):
            unknown += 1
    parts = [f"rank(s) {', '.join(world)}"] if world else []
    parts += [f"comm rank(s) {', '.join(ranked)} (world rank unknown)"] if ranked else []
    parts += [f"{unknown} member(s) whose ranks are unknown"] if unknown else []
    return " and ".join(parts)


def _surely_unseen(a: Analysis, f: Frontier) -> bool:
    """Whether a member the communicator is known to have left no dump."""
    comm = a.incident.comms[f.comm]
    return any(not comm.may_be_empty(m.crank) for m in f.unseen)


def unjudged(a: Analysis) -> list[str]:
    """For people, per communicator: which members no readable dump holds,
    and what their peers' records still prove of them."""
    out = []
    for f in a.frontiers:
        if not f.unseen:
            continue
        comm = a.incident.comms[f.comm]
        names = _names(a, f)
        if not names:  # only a member it may have
            out.append(
                f"{comm.name}: its size is not known ({comm.size_text}): ranks that left no "
                "readable dump may be members; nothing is known of them"
            )
            continue
        proven = f.unseen[0].last_seq
        known = (
            f"their peers' completions prove they entered seq {proven}; after that nothing "
            "is known of them"
            if proven >= 0
            else "none of their collectives is known to have completed"
        )
        out.append(f"{comm.name}: {names} have no readable dump: {known}")
    return out


def detect_inconclusive(a: Analysis) -> list[Verdict]:
    """Run when no detector found anything."""
    inc = a.incident
    notes = list(inc.notes)
    if not len(inc.calls):
        return [
            _verdict(
                a,
                (),
                None,
                f"nothing could be matched: 0 calls from {len(inc.sources)} input(s)",
                notes,
            )
        ]
    lost = [f for f in a.frontiers if f.unseen]
    if not lost:
        return []
    # a stall that a member left no dump of may hold up: one the split is
    # known to have (not one it may have: its size not known)
    stalls = [f for f in lost if f.stuck and _surely_unseen(a, f)] or [
        f for f in lost if f.stuck and not any(_surely_unseen(a, g) for g in lost)
    ]
    ranks = unseen_ranks(a, stalls or lost) or unseen_ranks(a, lost)
    who = f"rank(s) {', '.join(map(str, ranks))}" if ranks else "members"
    # dumps taken in turn, the latest standing at the frontier: members whose
    # own dumps lag it, not shown older, are as likely to have stopped as
    # those without a dump (detect.missing.behind names neither)
    # (but those that wait in another stuck collective: held up, not stopped)
    held = waiting(a)
    untold = sorted(
        {world_of(inc, g.comm, m.crank) for g in stalls if g.stood_still for m in g.laggards
         if g.lag(m) is Lag.UNPROVEN and m.proc not in held} - {-1}
    )  # fmt: skip
    if untold:
        f = primary(a, stalls)
        summary = (
            f"the job stood still at {op_name(f.op)} seq {f.seq} on {inc.comms[f.comm].name}, "
            f"where the dumps taken last stand: {who} left no readable dump, and "
            f"rank(s) {', '.join(map(str, untold))} never entered it, their dumps not shown "
            "older; any of them may have stopped there"
        )
        ranks = sorted({*ranks, *untold})
    elif stalls:
        # where ranks wait, in flight, over one every member returned from
        f = primary(a, [g for g in stalls if g.standing] or stalls)
        summary = (
            f"a collective is stuck at {op_name(f.op)} seq {f.seq} on {inc.comms[f.comm].name}, "
            f"and {who} left no readable dump: no rank with a dump is behind but for "
            "waiting; those without may never have entered it, or it may be stuck for all"
        )
    else:
        f = primary(a, lost)
        summary = (
            f"no rank with a dump departs from consensus, but {who} left no readable "
            "dump: what they did cannot be told"
        )
    return [_verdict(a, tuple(ranks), f, summary, unjudged(a)[:MAX_LISTED] + notes)]


def _verdict(
    a: Analysis, ranks: tuple[int, ...], f: Frontier | None, summary: str, evidence: list[str]
) -> Verdict:
    comm = a.incident.comms[f.comm] if f is not None else None
    return Verdict(
        VerdictKind.INCONCLUSIVE,
        ranks,
        (),
        (),
        comm.hash_text if comm is not None else None,
        f.seq if f is not None else None,
        op_name(f.op) if f is not None else None,
        summary,
        tuple(evidence),
    )

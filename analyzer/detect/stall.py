"""A hung job is never healthy: the evidence that the job stood still, and
the verdict when no detector named a culprit for it.

The evidence, per input:

- our dumps and live agents: an agent's watchdog dumped on a stall (a call
  in flight, or a communicator without progress, past ``--stall-timeout``);
  calls in flight at a communicator's frontier, no progress there for
  longer than the stall threshold when the dumps read their rings
  (``Frontier.stuck`` with an age, and ``Frontier.standing``);
- Flight Recorder files (no dump time): the dumps taken last stand at one
  frontier, in flight, and none completed it (``Frontier.stood_still``);
- thread readings (``stallwatch snapshot``): ranks inside one NCCL call,
  unchanged across readings for ``STALL_HELD_NS`` or more.

When it holds and no detector named a culprit (or why nothing can be
judged), the verdict is ``inconclusive``: with the candidates (ranks absent
from the frontier whose dumps may be older than it: dumps taken in turn) and
why none of them can be named; or, where every rank with a dump stands at
the frontier, what they all share.  Verdicts from the network evidence of a
stall every member shares go before this one (``detect.STALL_DETECTORS``).
"""

from __future__ import annotations

from stallwatch.dumpers.schema import op_name

from ..incident import Frontier, Lag, Member
from ..verdict import Verdict, VerdictKind
from .common import MAX_LISTED, Analysis, primary, waiting, world_of
from .positions import held_waits

STALL_HELD_NS = 1_000_000_000  # thread readings: a wait unchanged this long is a stall


def stalled_frontiers(a: Analysis) -> list[Frontier]:
    """Frontiers the job stood still at: calls in flight there past the stall
    threshold (a dump time is known; a job that ended and was dumped later
    has nothing in flight), or where the dumps taken last stand."""
    return [
        f for f in a.frontiers if (f.stuck and f.age_ns is not None and f.standing) or f.stood_still
    ]


def stall_evidence(a: Analysis) -> list[str]:
    """For people: everything that says the job was stalled."""
    inc = a.incident
    out = [f"{t}: its agent's watchdog dumped on a stall" for t in inc.stall_triggers]
    for f in stalled_frontiers(a):
        where = f"{op_name(f.op)} seq {f.seq} on {inc.comms[f.comm].name}"
        if f.age_ns is not None:
            out.append(f"{where}: in flight {f.age_ns / 1e9:.1f} s when the dumps were taken")
        else:
            n, held = len(f.standing), len(f.behind_it)
            behind = f" and {held} held behind it in other collectives" if held else ""
            out.append(
                f"{where}: the dumps taken last stand there, {n} rank(s) in flight{behind}, "
                "and none completed it"
            )
    out += held_waits(inc, STALL_HELD_NS)
    return out


def detect_stall(a: Analysis) -> list[Verdict]:
    """Run when nothing else was found: a stall without a culprit is
    inconclusive, never healthy."""
    evidence = stall_evidence(a)
    if not evidence:
        return []
    fronts = stalled_frontiers(a)
    if not fronts:
        summary = "the job stood still, but no rank departs from consensus in what was recorded"
        return [_verdict(None, None, (), summary, evidence)]
    f = primary(a, fronts)
    inc = a.incident
    where = f"{op_name(f.op)} seq {f.seq} on {inc.comms[f.comm].name}"
    # a laggard waiting in another stuck collective is held up, not a
    # candidate, where others are; where every one waits elsewhere, they
    # share a stall
    held = waiting(a)
    everyone = [(g, m) for g in fronts for m in g.laggards]
    pairs = [(g, m) for g, m in everyone if m.proc not in held] or everyone
    absent = [m for _, m in pairs]
    ranks = tuple(sorted({world_of(inc, g.comm, m.crank) for g, m in pairs}))
    if absent:
        older = [m for g, m in pairs if g.lag(m) is Lag.OLDER]
        elsewhere = _blocked_elsewhere(a, absent)
        if len(older) == len(absent):
            why = (
                "their dumps were read before it began (their peers' completions prove they "
                "went further)"
            )
        elif elsewhere:
            why = f"they wait in {elsewhere} at their dumps, a stall they share, and they "
            why += "cannot be told apart"
        else:
            why = (
                "their dumps may have been read before it began (dumps taken in turn), and "
                "they cannot be told apart"
            )
        names = ", ".join(map(str, ranks)) or f"{len(absent)} member(s)"
        summary = (
            f"the job stood still at {where}, and rank(s) {names} never entered it there, "
            f"but {why}: which of them stopped cannot be told"
        )
    else:
        summary = (
            f"the job stood still at {where}: every rank with a dump is in flight there, a "
            "stall they all share; no rank departs from consensus"
        )
    comm = inc.comms[f.comm].hash_text
    return [_verdict(f, comm, tuple(r for r in ranks if r >= 0), summary, evidence)]


def _blocked_elsewhere(a: Analysis, absent: list[Member]) -> str | None:
    """Where the absent members were blocked when their dumps were taken
    ("ALL_REDUCE", "ALL_REDUCE, SEND"), if every one of them was: they are
    behind because they wait in another call, not because their dumps are old."""
    waiting = {int(p): int(op) for p, op, _ in a.incident.waiting.tolist()}
    ops = [waiting.get(m.proc) for m in absent]
    if not ops or any(op is None for op in ops):
        return None
    return ", ".join(op_name(op) for op in sorted({op for op in ops if op is not None}))


def _verdict(
    f: Frontier | None, comm: str | None, ranks: tuple[int, ...], summary: str, evidence: list[str]
) -> Verdict:
    return Verdict(
        VerdictKind.INCONCLUSIVE,
        ranks,
        (),
        (),
        comm,
        f.seq if f is not None else None,
        op_name(f.op) if f is not None else None,
        summary,
        tuple(evidence[:MAX_LISTED]),
    )

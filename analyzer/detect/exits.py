"""Rank exited: a process holding a communicator died (exit code or signal).

When ranks die one after another, the first departure is the cause and the
ranks that exited with an error after it are its consequences: their error
surfaced in a recorded NCCL call (it returned an error), or later, where the
recorder does not see it (a stream synchronisation, an async error check).
"After" is told by each host's clock converted to wall time; across hosts a
death within ``SKEW_NS`` of another cannot be ordered by clocks, and then a
rank killed by a signal (it did not react to anything) is the cause of an
error exit, never the reverse.  A desync is the cause of the error exits of
its communicator's members that were alive when it was entered: a rank that
met a mismatched collective fails in it, or at the next synchronisation on
its stream (the recorder sees no error there), and exits with an error.
Ranks ended together by a signal from outside (``ENDING_SIGNALS``) after
their collective had stood still past its stall threshold were torn down
with a stalled job (its launcher, an operator): the stall is the finding,
judged by its own rules (a rank that never entered it, the network)."""

from __future__ import annotations

import signal

import numpy as np

from stallwatch.dumpers.schema import op_name

from ..frontier import evidence_moments, stall_threshold
from ..incident import SKEW_NS, Frontier, Proc, proc_hosts
from ..verdict import Verdict, VerdictKind
from .common import MAX_LISTED, Analysis, last_call_text, member_text, primary, world_of
from .inconclusive import unjudged


def _death(p: Proc) -> str:
    if p.exit_signal:
        return f"was killed by signal {p.exit_signal}"
    return f"exited with code {p.exit_code}"


def _before(p: Proc, q: Proc) -> bool:
    """Did ``p`` surely die before ``q``?  Same host: one clock; across hosts,
    by more than the skew."""
    if p.exit_wall_ns is None or q.exit_wall_ns is None:
        return False
    margin = 0 if p.host == q.host else SKEW_NS
    return p.exit_wall_ns < q.exit_wall_ns - margin


def _consequences(a: Analysis, dead: list[int]) -> set[int]:
    """Dead ranks that died of another's death: a call of theirs returned an
    error, or they exited with an error code after (or, across hosts, not
    clearly before) a peer was killed by a signal, or clearly after a peer
    exited with an error."""
    procs = a.incident.procs
    out = _failed_calls(a) & set(dead)
    for i in dead:
        p = procs[i]
        if p.exit_signal or p.exit_wall_ns is None:
            continue
        for j in dead:
            q = procs[j]
            if j == i or q.exit_wall_ns is None:
                continue
            if _before(q, p) or (q.exit_signal and not _before(p, q)):
                out.add(i)
                break
    return out


def _after_desync(a: Analysis, dead: list[int]) -> set[int]:
    """Ranks that exited with an error code (no signal) and were members of a
    communicator a desync was found on, alive when it was entered: they
    entered that seq or a later one there."""
    m = a.matched
    out: set[int] = set()
    for d in a.disagreements:
        members = set(a.incident.comms[d.comm].members)
        sl = m.comm_rows(d.comm)
        procs, seqs = m.rows["proc"][sl], m.rows["seq"][sl]
        for i in dead:
            p = a.incident.procs[i]
            if i not in members or p.exit_signal or p.exit_code in (None, 0):
                continue
            if ((procs == i) & (seqs >= d.seq)).any():
                out.add(i)
    return out


# the signals something outside the process sends to end it (a launcher, an
# operator, the OOM killer): never a crash of its own (SIGSEGV, SIGABRT, ...)
ENDING_SIGNALS = frozenset({signal.SIGHUP, signal.SIGINT, signal.SIGKILL, signal.SIGTERM})


def _stood_since(f: Frontier, moments: list[int | None]) -> int | None:
    """When a stuck frontier began to stand still (wall clock): its first
    entry, or the dump moments of its members' hosts (``moments``, per
    member) less its age; None if unknown."""
    if f.began is not None:
        return f.began
    known = [t for t in moments if t is not None]
    return min(known) - f.age_ns if known and f.age_ns is not None else None


def torn_down(a: Analysis) -> set[int]:
    """Ranks ended by a signal from outside, two or more of them, each after
    a communicator of its had stood still past its stall threshold (the
    job's own: ``frontier.stall_threshold``): something ended a stalled job
    (its launcher, an operator).  Their deaths are the stall's consequence;
    a death that came first, inside a collective's usual time, is a cause."""
    procs = a.incident.procs
    ended = {
        i for i, p in enumerate(procs)
        if p.died_badly and p.exit_signal in ENDING_SIGNALS and p.exit_wall_ns is not None
    }  # fmt: skip
    out: set[int] = set()
    if len(ended) < 2:
        return out
    ph = proc_hosts(a.incident)
    host_moments, _ = evidence_moments(a.incident, ph)
    for f in a.frontiers:
        moments = [host_moments[ph[m.proc]] for m in f.members if m.proc >= 0]
        began = _stood_since(f, moments) if f.stuck else None
        if began is None:
            continue
        since = began + stall_threshold(a.matched, f.comm) + SKEW_NS
        for m in f.members:
            at = procs[m.proc].exit_wall_ns if m.proc in ended else None
            if at is not None and at >= since:
                out.add(m.proc)
    return out


def torn_down_text(p: Proc) -> str:
    return f"{p.label()} {_death(p)} later, with its peers: the stalled job was torn down"


def _failed_calls(a: Analysis) -> set[int]:
    """Procs whose last call returned an error: they died of a peer's death."""
    rows = a.incident.calls.rows
    bad = rows[(rows["result"] > 0)]
    return {int(p) for p in np.unique(bad["proc"])}


def _earliest(a: Analysis, dead: list[int]) -> list[int]:
    """When every death looks like another's consequence: the first by time."""
    procs = a.incident.procs
    timed = [i for i in dead if procs[i].exit_wall_ns is not None]
    if not timed:
        return dead
    return [min(timed, key=lambda i: (procs[i].exit_wall_ns, i))]


def _unseen_peers(a: Analysis, dead: list[int]) -> list[Frontier] | None:
    """Frontiers of the communicators of the dead where members left no
    readable dump: when every death was caused by another's (a call
    returned an error, or a peer died first), the cause may be one of them,
    and the first death seen is not proven the cause; None if there is none."""
    mine = set(dead)
    found = [
        f
        for f in a.frontiers
        if f.unseen and mine & {p for p in a.incident.comms[f.comm].members if p >= 0}
    ]
    return found or None


def _caused_unseen(a: Analysis, dead: list[int], fronts: list[Frontier]) -> Verdict:
    inc = a.incident
    ranks = sorted(
        {w for f in fronts for m in f.unseen if (w := world_of(inc, f.comm, m.crank)) >= 0}
    )
    f = primary(a, fronts)
    deaths = [
        f"{inc.procs[i].label()} {_death(inc.procs[i])}; {last_call_text(a, i)}" for i in dead
    ]
    who = ", ".join(map(str, ranks)) or "members of unknown rank"
    summary = (
        f"{len(dead)} rank(s) died of an error a peer caused (a call of theirs returned an "
        f"error, or they exited after a peer died), and rank(s) {who} left no readable dump: "
        "the first to fail may be among those"
    )
    evidence = deaths[:MAX_LISTED] + unjudged(a)[:MAX_LISTED]
    return Verdict(
        VerdictKind.INCONCLUSIVE,
        tuple(ranks),
        (),
        (),
        inc.comms[f.comm].hash_text,
        f.seq,
        op_name(f.op),
        summary,
        tuple(evidence),
    )


def detect_rank_exited(a: Analysis) -> list[Verdict]:
    inc = a.incident
    dead = [i for i, p in enumerate(inc.procs) if p.died_badly]
    if not dead:
        return []
    after = _consequences(a, dead) | _after_desync(a, dead)
    waited = torn_down(a)
    culprits = [i for i in dead if i not in after and i not in waited]
    if not culprits and a.disagreements:
        return []  # they exited on the error a desync caused: the desync is the finding
    if not culprits and waited:
        return []  # killed as a stalled job was torn down: the stall is the finding
    if not culprits:
        unseen = _unseen_peers(a, dead)
        if unseen is not None:
            return [_caused_unseen(a, dead, unseen)]
    culprits = culprits or _earliest(a, dead)
    out = []
    for i in culprits:
        p = inc.procs[i]
        lag = [(f, m) for f in a.frontiers for m in f.laggards if m.proc == i]
        lag = [(f, m) for f, m in lag if f.stuck] or lag
        where = primary(a, [f for f, _ in lag]) if lag else None
        comm = inc.comms[where.comm].hash_text if where else None
        summary = f"{p.label()} {_death(p)}"
        if where is not None:
            summary += f"; its peers wait at {op_name(where.op)} seq {where.seq} on {comm}"
        evidence = [f"{p.label()} {_death(p)}", last_call_text(a, i)]
        evidence += [member_text(a, f, m) for f, m in lag[:MAX_LISTED]]
        others = [f"{inc.procs[j].label()} {_death(inc.procs[j])}" for j in dead if j in after]
        if others:
            evidence.append(
                "then, of the error it caused (a call failed, or they exited with an error "
                "after it died): " + "; ".join(others[:MAX_LISTED])
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

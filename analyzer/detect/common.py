"""What every detector shares: the ``Analysis`` it reads, and the texts that
name a rank, a member of a communicator and what a rank last did."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from stallwatch.dumpers.schema import op_name

from ..incident import (
    ArrivalScore,
    CommSlowdown,
    ConnFate,
    Deferred,
    Disagreement,
    Frontier,
    HostRetransmits,
    Incident,
    Member,
    MemberState,
    NetHeld,
    P2pGap,
    SchedDelays,
    SlowLink,
    SlowWindow,
)
from ..match import Matched
from ..verdict import Verdict

MAX_LISTED = 16  # evidence lines of one kind in a verdict


@dataclass(frozen=True, slots=True)
class Analysis:
    incident: Incident
    matched: Matched
    frontiers: tuple[Frontier, ...]
    disagreements: tuple[Disagreement, ...]
    arrivals: tuple[ArrivalScore, ...]
    retransmit_counts: Deferred[tuple[HostRetransmits, ...]]
    sched: SchedDelays  # run-queue delay per proc, by the CPU's holder
    slowdowns: tuple[CommSlowdown, ...] = ()
    p2p: tuple[P2pGap, ...] = ()
    fates: tuple[ConnFate, ...] = ()  # what became of each connection between hosts
    # a slowdown incident: each communicator's slow window (detect.slowdown)
    windows: tuple[SlowWindow, ...] = ()
    # a slowdown incident: each kind of a communicator's collectives scored
    # alone (detect.stragglers.kind_scores), to tell who is held up by a peer
    kind_arrivals: tuple[ArrivalScore, ...] = ()
    # the collectives the network held (detect.network.held_by_network), and
    # the retransmits inside them by host
    held: tuple[NetHeld, ...] = ()
    held_retransmits: tuple[HostRetransmits, ...] = ()
    # a host whose connections slowed while the job's others did not (detect.paths)
    slow_link: SlowLink | None = None
    slow_since_wall: int | None = None  # when the slowdown began (wall clock), where known

    @property
    def retransmits(self) -> tuple[HostRetransmits, ...]:
        """Per host, the job's retransmits inside collective windows
        (``detect.network.network_metrics``; the query runs when first read)."""
        return self.retransmit_counts.get()


Detector = Callable[[Analysis], list[Verdict]]


def ms(ns: float) -> str:
    return f"{ns / 1e6:.1f} ms"


def who(
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


def member_text(a: Analysis, f: Frontier, m: Member) -> str:
    inc = a.incident
    comm = inc.comms[f.comm]
    if m.state is MemberState.NO_DUMP:
        world = world_of(inc, f.comm, m.crank)
        who = f" (world rank {world})" if world >= 0 else ""
        known = (
            f"its peers' completions prove it entered seq {m.last_seq}"
            if m.last_seq >= 0
            else "nothing of it is known"
        )
        rank = comm.rank_text(m.crank)
        return f"comm rank {rank}{who} of {comm.name}: no readable dump holds it; {known}"
    p = inc.procs[m.proc]
    entered = "nothing" if m.last_seq < 0 else f"seq {m.last_seq}"
    return (
        f"{p.label()} comm rank {comm.rank_text(m.crank)} of {comm.name}: last entered {entered}, "
        f"peers at seq {f.seq}; {last_call_text(a, m.proc)}"
    )


def world_of(inc: Incident, comm: int, crank: int) -> int:
    """The world rank of a communicator's member (by its slot: ``Comm``), -1
    if it cannot be told (a member without a dump, outside the world
    communicator, whose owner no evidence names)."""
    c = inc.comms[comm]
    proc = c.members[crank]
    if proc >= 0 and inc.procs[proc].world_rank >= 0:
        return inc.procs[proc].world_rank
    if c.world_rank(crank) >= 0:
        return c.world_rank(crank)
    return c.rank_of(crank) if is_world(inc, comm) else -1


def is_world(inc: Incident, comm: int) -> bool:
    c = inc.comms[comm]
    return (
        not c.is_split
        and c.exact
        and c.nranks == max(x.nranks for x in inc.comms if not x.is_split)
    )


def waiting(a: Analysis) -> frozenset[int]:
    """Procs in flight at a stuck frontier: absent from another one, they
    wait here (a rank in its pair's collective is absent from the world's),
    held up, not a candidate for having stopped."""
    return frozenset(x.proc for f in a.frontiers if f.stuck for x in f.standing)


def primary(a: Analysis, frontiers: list[Frontier]) -> Frontier:
    comms = a.incident.comms
    return min(frontiers, key=lambda f: (-comms[f.comm].nranks, comms[f.comm].comm_hash))

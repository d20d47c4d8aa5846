"""Each verdict's culprits, one record each: who (world rank, host, pid, the
file read), where it was judged (the communicator, its rank there, the seq
it last entered there) and its state.

The one place a culprit's identity is taken from the incident's processes
(``Incident.procs``: world ranks from ``dumpers.ranks`` or, for Flight
Recorder files, the dump's own rank), for the JSON, the report's tables and
the Perfetto trace alike.  Verdicts name culprits by world rank, host and
pid (``Verdict.ranks``, ``hosts``, ``pids``); the process is the one that
matches them all.  A rank no readable input holds is a culprit with its
world rank only.
"""

from __future__ import annotations

from dataclasses import dataclass

from stallwatch.dumpers.schema import op_name

from .incident import Comm, Frontier, Incident, Member, MemberState
from .verdict import Verdict


@dataclass(frozen=True, slots=True)
class Culprit:
    world_rank: int | None
    host: str | None  # a Flight Recorder file's name: such files name no host
    pid: int | None
    file: str | None  # the input it was read from
    proc: int  # index into Incident.procs, -1 without a readable input
    communicator: str | None  # where it was judged ("0x%016x")
    rank: int | None  # its rank there
    seq: int | None  # the last seq it entered there
    op: str | None  # the op of that communicator's frontier
    state: MemberState | None  # there
    in_flight: bool | None

    def to_json(self) -> dict[str, object]:
        return {
            "rank": self.rank,
            "world_rank": self.world_rank,
            "host": self.host,
            "pid": self.pid,
            "file": self.file,
            "communicator": self.communicator,
            "seq": self.seq,
            "op": self.op,
            "state": self.state.name.lower() if self.state is not None else None,
            "in_flight": self.in_flight,
        }


def _proc_of(inc: Incident, v: Verdict, i: int) -> int:
    """The process of the verdict's i-th culprit, -1 if none is."""
    rank = v.ranks[i]
    pid = v.pids[i] if len(v.pids) == len(v.ranks) else None
    hosts = set(v.hosts)
    found = [
        k
        for k, p in enumerate(inc.procs)
        # a process whose calls no table holds (streams from a late attach)
        # has no world rank there: its pid names it
        if (rank is None or p.world_rank == rank or (p.world_rank < 0 and pid is not None))
        and (not hosts or p.host in hosts)
        and (pid is None or p.pid == pid)
        and (rank is not None or pid is not None)
    ]
    return found[0] if len(found) == 1 else -1


def _only(hosts: tuple[str, ...]) -> str | None:
    """The host of a culprit no process of the tables is: the verdict's, where
    it names one."""
    return hosts[0] if len(set(hosts)) == 1 else None


def _pid(v: Verdict, i: int) -> int | None:
    """The verdict's pid of its i-th culprit, where it names one per culprit."""
    return v.pids[i] if len(v.pids) == len(v.ranks) else None


def judged_on(v: Verdict, i: int) -> str | None:
    """The communicator where the verdict's i-th culprit was judged."""
    return v.judged[i] if len(v.judged) == len(v.ranks) else v.comm_id_hash


def _judged(
    inc: Incident, comm_id: str | None, fronts: tuple[Frontier, ...]
) -> tuple[Comm, Frontier] | None:
    for f in fronts:
        comm = inc.comms[f.comm]
        if comm.hash_text == comm_id:
            return comm, f
    return None


def _member(
    f: Frontier | None, proc: int, world_rank: int | None, comm: Comm | None
) -> Member | None:
    if f is None or comm is None:
        return None
    for m in f.members:
        if proc >= 0 and m.proc == proc:
            return m
        if proc < 0 and world_rank is not None and comm.world_rank(m.crank) == world_rank:
            return m
    return None


def _rank(comm: Comm | None, m: Member | None) -> int | None:
    """A member's rank in the communicator, None where no evidence tells it."""
    if comm is None or m is None or comm.rank_of(m.crank) < 0:
        return None
    return comm.rank_of(m.crank)


def culprits(inc: Incident, v: Verdict, fronts: tuple[Frontier, ...]) -> list[Culprit]:
    """The verdict's culprits, in the order of its ranks."""
    out = []
    for i, world in enumerate(v.ranks):
        where = judged_on(v, i)
        judged = _judged(inc, where, fronts)
        comm, f = judged if judged is not None else (None, None)
        proc = _proc_of(inc, v, i)
        p = inc.procs[proc] if proc >= 0 else None
        m = _member(f, proc, world, comm)
        out.append(
            Culprit(
                world_rank=p.world_rank if p is not None and p.world_rank >= 0 else world,
                host=p.host if p is not None else _only(v.hosts),
                pid=p.pid if p is not None and p.pid > 0 and not p.from_file else _pid(v, i),
                file=p.source if p is not None else None,
                proc=proc,
                communicator=where,
                rank=_rank(comm, m),
                seq=m.last_seq if m is not None and m.last_seq >= 0 else None,
                op=op_name(f.op) if f is not None else v.op,
                state=m.state if m is not None else None,
                in_flight=m.in_flight if m is not None else None,
            )
        )
    return out

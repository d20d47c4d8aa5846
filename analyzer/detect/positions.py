"""Judging a hang from thread positions: where every rank's threads were,
read from outside while the job was stuck (``stallwatch snapshot``, an agent's
start-up, every dump), with or without a recording of the calls before.

Per rank (a process, named by its launcher's ``RANK`` or by the recording):
the NCCL API calls its threads are inside, with their arguments, in the last
reading of its node; and whether that position held across the node's
readings (``stallwatch snapshot`` reads each node several times; an agent
reads at start-up and again at every dump).  Then, per job:

Ranks are grouped into jobs by the launcher's job id (or rendezvous address)
and world size; where ranks are known, a process that maps libnccl without
being one (no ``RANK`` and no rank in the recording) is left out.

- missing rank: some ranks wait inside NCCL collectives (or send/receive)
  and others are inside no NCCL call at all: the latter are the culprits.
  Running is not idle: a rank whose latest recorded call is in flight in
  the rings waits there whatever its threads showed, and one whose thread
  was running with its stack not read (real waiters spin: CUDA's spin
  synchronisation, NCCL's busy polling) is unknown; neither is a culprit.
  When the recording knows which communicator each waiting rank is in and
  who its members are, only ranks of those communicators are named.
- desync: every rank is inside an NCCL call, but not the same one: on one
  communicator (when the recording names communicators) or, without that,
  by the call and its arguments (op, count, datatype, reduction, root).  The
  ranks outside the largest group are the culprits; a tie names nobody.

Nothing is judged when a reading shows the waiting ranks moving on (their
position changed between readings: the job progresses), on one reading of a
rank the recording saw make NCCL calls (a dump reads its node once: a
running job's ranks are caught at different points), when every rank
waits in the same call (no rank departs: the collective itself does not
finish), or when no rank is inside an NCCL call.

Known limits: a rank whose node left no reading cannot be judged, and is
listed as such; the blocked call of an asynchronous NCCL (real GPUs, the
lab's async mode) has returned to the host long before, so host threads show
the synchronisation they wait in, not the collective: positions alone judge
blocking calls only.  Communicator pointers mean something only inside their
process: without a recording, ranks are grouped by the call's arguments.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from stallwatch.dumpers.model import CommInfo
from stallwatch.dumpers.readings import NcclCall, ProcessThreads, ThreadState
from stallwatch.dumpers.schema import Op, op_name

from ..incident import HostReadings, Incident
from ..verdict import Verdict, VerdictKind
from .common import Analysis

MAX_FRAMES_SHOWN = 4
MAX_LISTED = 16


@dataclass(frozen=True, slots=True)
class CommRef:
    """A waiting call's communicator, as the recording knows it."""

    comm_hash: int
    rank: int  # in the communicator, -1 if unknown
    nranks: int


@dataclass(frozen=True, slots=True)
class Waiting:
    thread: ThreadState
    call: NcclCall
    comm: CommRef | None  # None without a recording that knows the pointer


@dataclass(frozen=True, slots=True)
class RankPosition:
    host: str
    pid: int
    world_rank: int  # -1 if unknown
    world_size: int | None
    job: str  # the launcher's job id, "" if none
    waiting: tuple[Waiting, ...]  # threads inside NCCL calls, in the last reading
    main: ThreadState | None  # the thread that stands for the process
    readings: int  # how many readings of its node hold it
    held_ns: int  # how long its position stayed the same, up to the last reading
    error: str = ""
    member_of: frozenset[int] = frozenset()  # communicators it holds, per the recording
    # the call the rings show it in (entered, not returned), "" if none: a
    # call in flight outranks a reading that could not see the stack
    in_flight: str = ""
    recorded: bool = False  # the recording saw it enter NCCL calls

    @property
    def unknown(self) -> bool:
        """Where it is cannot be told: its thread was running and its stack
        was not read (a spinning waiter runs: CUDA's spin synchronisation,
        NCCL's busy polling), and the rings show no call in flight."""
        t = self.main
        return not self.in_flight and t is not None and t.state == "R" and not t.frames

    @property
    def outside(self) -> bool:
        """Known to be inside no NCCL call."""
        return not self.error and not self.inside and not self.in_flight and not self.unknown

    @property
    def inside(self) -> bool:
        return bool(self.waiting)

    def label(self) -> str:
        rank = f"rank {self.world_rank}" if self.world_rank >= 0 else "rank unknown"
        return f"{rank} (host {self.host}, pid {self.pid})"


# -- positions ----------------------------------------------------------------


def rank_positions(
    readings: Sequence[HostReadings], known_ranks: Mapping[tuple[str, int], int] | None = None
) -> list[RankPosition]:
    """One position per (host, pid) seen in the last reading of its host,
    of the readings the recording does not show it left (``current``)."""
    out = []
    for hr in sorted(readings, key=lambda h: h.host):
        snaps = sorted(hr.current(), key=lambda s: s.taken_ns)
        if not snaps:
            continue
        comms = {(c.pid, c.comm): c for c in hr.communicators if not c.destroy_ns}
        for proc in snaps[-1].processes:
            history = [p for s in snaps for p in s.processes if p.pid == proc.pid]
            pos = _position(hr.host, proc, history, comms, known_ranks or {})
            held = frozenset(c.comm_hash for (pid, _), c in comms.items() if pid == proc.pid)
            out.append(replace(pos, member_of=held, recorded=proc.pid in hr.entered))
    return out


def _position(
    host: str,
    proc: ProcessThreads,
    history: list[ProcessThreads],
    comms: Mapping[tuple[int, int], CommInfo],
    known_ranks: Mapping[tuple[str, int], int],
) -> RankPosition:
    rank = proc.world_rank
    if rank is None:
        rank = known_ranks.get((host, proc.pid), -1)
    waiting = tuple(
        Waiting(t, t.nccl, _comm_ref(comms.get((proc.pid, t.nccl.comm))))
        for t in proc.threads
        if t.nccl is not None and (t.nccl.op.is_collective or t.nccl.op.is_p2p)
    )
    main = (
        waiting[0].thread if waiting else next((t for t in proc.threads if t.tid == proc.pid), None)
    )
    held = _held_ns(history)
    return RankPosition(
        host, proc.pid, rank, proc.world_size, _job(proc), waiting, main, len(history), held,
        proc.error,
    )  # fmt: skip


def _comm_ref(c: CommInfo | None) -> CommRef | None:
    return None if c is None else CommRef(c.comm_hash, c.rank, c.nranks)


def _job(proc: ProcessThreads) -> str:
    """The launcher's job id (or rendezvous address), and the world size."""
    env = dict(proc.env)
    size = f"/{proc.world_size}" if proc.world_size else ""
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        if env.get(name):
            return f"{name}={env[name]}{size}"
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}{size}"
    return size


def _signature(p: ProcessThreads) -> tuple[object, ...]:
    """What must not change for a position to have held: every thread's NCCL
    call with its arguments, and the stack and system call of the others."""
    out: list[object] = []
    for t in sorted(p.threads, key=lambda t: t.tid):
        out.append((t.tid, t.nccl, t.frames if t.nccl is None else (), t.syscall))
    return tuple(out)


def _held_ns(history: list[ProcessThreads]) -> int:
    """Time from the first reading of the run of identical readings that ends
    with the last one, to the last one."""
    last = history[-1]
    first = last
    for p in reversed(history[:-1]):
        if _signature(p) != _signature(last):
            break
        first = p
    return last.taken_ns - first.taken_ns


# -- text ---------------------------------------------------------------------


def call_text(call: NcclCall) -> str:
    return call.describe()


def _thread_text(t: ThreadState) -> str:
    where = t.syscall_name or ("running" if t.state == "R" else "user code")
    wchan = f" ({t.wchan})" if t.wchan else ""
    frames = " <- ".join(t.frames[:MAX_FRAMES_SHOWN]) or "stack not read"
    return f"thread {t.tid} '{t.name}' state {t.state}, in {where}{wchan}, at {frames}"


def _held_text(p: RankPosition) -> str:
    if p.readings < 2:
        return "one reading"
    if p.held_ns <= 0:
        return f"changed between the last readings ({p.readings} readings)"
    return f"unchanged for {p.held_ns / 1e9:.1f} s over {p.readings} readings"


def position_text(p: RankPosition) -> str:
    if p.error:
        return f"{p.label()}: not read ({p.error})"
    if p.waiting:
        calls = "; ".join(
            f"{call_text(w.call)}{_comm_text(w.comm)} [{_thread_text(w.thread)}]" for w in p.waiting
        )
        return f"{p.label()}: inside {calls}; {_held_text(p)}"
    main = _thread_text(p.main) if p.main is not None else "no thread read"
    if p.in_flight:
        return f"{p.label()}: {p.in_flight} in flight in the rings; {main}; {_held_text(p)}"
    if p.unknown:
        return f"{p.label()}: position unknown (running, stack not read); {main}; {_held_text(p)}"
    return f"{p.label()}: inside no NCCL call; {main}; {_held_text(p)}"


def _comm_text(c: CommRef | None) -> str:
    if c is None:
        return ""
    rank = f" as rank {c.rank} of {c.nranks}" if c.rank >= 0 else ""
    return f" on communicator 0x{c.comm_hash:016x}{rank}"


# -- judging ----------------------------------------------------------------


def detect_positions(a: Analysis) -> list[Verdict]:
    """The fallback detector: when the recording shows no hang (it began too
    late, or there is none), the thread positions may."""
    inc = a.incident
    if not inc.readings:
        return []
    known = {(p.host, p.pid): p.world_rank for p in inc.procs if p.world_rank >= 0}
    flying = calls_in_flight(inc)
    positions = [
        replace(p, in_flight=flying.get((p.host, p.pid), ""))
        for p in rank_positions(inc.readings, known)
    ]
    return judge(positions)


def held_waits(inc: Incident, held_ns: int) -> list[str]:
    """Ranks the readings found inside an NCCL call, unchanged across them
    for ``held_ns`` or more: a stall, whoever is to blame."""
    if not inc.readings:
        return []
    known = {(p.host, p.pid): p.world_rank for p in inc.procs if p.world_rank >= 0}
    held = [p for p in rank_positions(inc.readings, known) if p.inside and p.held_ns >= held_ns]
    return [position_text(p) for p in held[:MAX_LISTED]]


def calls_in_flight(inc: Incident) -> dict[tuple[str, int], str]:
    """(host, pid) -> the collective its latest recorded call is, where that
    call was entered and has not returned."""
    out = (
        {(u.host, u.pid): u.in_flight for u in inc.late.unaligned if u.in_flight}
        if inc.late
        else {}
    )
    rows = inc.calls.rows
    if not len(rows):
        return out
    order = np.lexsort((rows["ts"], rows["proc"]))
    proc = rows["proc"][order]
    last = order[np.flatnonzero(np.diff(proc, append=-1) != 0)]
    for i in last.tolist():
        r = rows.record(i)
        if int(r["end"]) == 0:
            p = inc.procs[int(r["proc"])]
            comm = inc.comms[int(r["comm"])].name
            out[(p.host, p.pid)] = f"{op_name(int(r['op']))} seq {int(r['seq'])} on {comm}"
    return out


def judge(positions: Sequence[RankPosition]) -> list[Verdict]:
    by_job: dict[str, list[RankPosition]] = defaultdict(list)
    for p in positions:
        by_job[p.job].append(p)
    verdicts = []
    for job in sorted(by_job):
        verdicts += judge_job(by_job[job])
    return verdicts


def judge_job(ps: Sequence[RankPosition]) -> list[Verdict]:
    ps = sorted(ps, key=lambda p: (p.world_rank < 0, p.world_rank, p.host, p.pid))
    if any(p.world_rank >= 0 for p in ps):
        # ranks are known: a process with none that maps libnccl is no member
        # (a tool, a data loader), whatever it does
        ps = [p for p in ps if p.world_rank >= 0]
    read = [p for p in ps if not p.error]
    waiting = [p for p in read if p.inside]
    if not waiting or any(p.readings >= 2 and p.held_ns <= 0 for p in waiting):
        return []  # nobody waits, or the waiting ranks move on: no hang to judge
    if any(p.readings < 2 and p.recorded for p in read):
        # one look at a process the recording saw calling (a dump's own
        # reading of a running job catches its ranks at different points):
        # its recording is judged, not where one reading found it
        return []
    # a rank in flight in the rings waits too; one running whose stack was
    # not read is unknown: neither is outside NCCL
    outside = [p for p in read if p.outside]
    if outside:
        return [_missing(ps, waiting, _culprits(waiting, outside))]
    return _desync(ps, waiting)


def _culprits(waiting: list[RankPosition], outside: list[RankPosition]) -> list[RankPosition]:
    """Of the ranks inside no NCCL call, those the waiting ranks wait for: the
    members of their communicators where the recording knows who they are,
    else all of them."""
    comms = {w.comm.comm_hash for p in waiting for w in p.waiting if w.comm is not None}
    members = [p for p in outside if p.member_of & comms]
    return members or outside


def _missing(
    ps: Sequence[RankPosition], waiting: list[RankPosition], culprits: list[RankPosition]
) -> Verdict:
    calls = Counter(w.call.symbol for p in waiting for w in p.waiting)
    ops = Counter(p.waiting[0].call.op for p in waiting)
    op = ops.most_common(1)[0][0]
    names = ", ".join(p.label() for p in culprits[:MAX_LISTED])
    waits = ", ".join(f"{sym} x{n}" for sym, n in calls.most_common())
    summary = (
        f"{_ranks_text(culprits)} inside no NCCL call while {len(waiting)} rank(s) wait inside "
        f"NCCL calls ({waits}); by thread positions{_held_summary(waiting)}"
    )
    return _verdict(VerdictKind.MISSING_RANK, culprits, ps, op, _comm_of(waiting), summary, names)


def _desync(ps: Sequence[RankPosition], waiting: list[RankPosition]) -> list[Verdict]:
    groups: dict[tuple[object, ...], list[RankPosition]] = defaultdict(list)
    for p in waiting:
        groups[_call_key(p)].append(p)
    if len(groups) < 2:
        return []  # all in the same call: no rank departs
    sizes = sorted((len(g) for g in groups.values()), reverse=True)
    if sizes[0] == sizes[1]:
        return []  # no majority to depart from
    majority = max(groups.values(), key=len)
    culprits = [p for p in waiting if p not in majority]
    want = call_text(majority[0].waiting[0].call)
    summary = (
        f"{_ranks_text(culprits)} wait inside a different NCCL call than the "
        f"{len(majority)} rank(s) inside {want.split('(')[0]}: "
        f"the ranks do not call collectives in the same order; by thread positions"
        f"{_held_summary(waiting)}"
    )
    op = majority[0].waiting[0].call.op
    names = ", ".join(p.label() for p in culprits[:MAX_LISTED])
    return [_verdict(VerdictKind.DESYNC, culprits, ps, op, _comm_of(majority), summary, names)]


def _call_key(p: RankPosition) -> tuple[object, ...]:
    """The first waiting call: its communicator where the recording names it,
    else its op and arguments."""
    w = p.waiting[0]
    c = w.call
    return (w.comm.comm_hash if w.comm is not None else None, c.op, c.count, c.datatype,
            c.redop, c.root if c.op.is_collective else None)  # fmt: skip


def _comm_of(ps: list[RankPosition]) -> str | None:
    hashes = Counter(w.comm.comm_hash for p in ps for w in p.waiting if w.comm is not None)
    if not hashes:
        return None
    return f"0x{hashes.most_common(1)[0][0]:016x}"


def _ranks_text(ps: list[RankPosition]) -> str:
    ranks = [str(p.world_rank) for p in ps if p.world_rank >= 0]
    if len(ranks) == len(ps):
        return (
            ("rank " if len(ps) == 1 else "ranks ")
            + ", ".join(ranks[:MAX_LISTED])
            + (" is" if len(ps) == 1 else " are")
        )
    return ", ".join(p.label() for p in ps[:MAX_LISTED]) + (" is" if len(ps) == 1 else " are")


def _held_summary(waiting: list[RankPosition]) -> str:
    held = [p.held_ns for p in waiting if p.readings >= 2]
    if not held:
        return " (one reading)"
    return f" held at least {min(held) / 1e9:.1f} s"


def _verdict(
    kind: VerdictKind,
    culprits: list[RankPosition],
    ps: Sequence[RankPosition],
    op: Op,
    comm: str | None,
    summary: str,
    names: str,
) -> Verdict:
    evidence = [f"culprit(s): {names}"]
    evidence += [position_text(p) for p in ps]
    missing = _unread_ranks(ps)
    if missing:
        evidence.append(f"ranks with no reading (their node left no snapshot): {missing}")
    return Verdict(
        kind,
        tuple(p.world_rank for p in culprits),
        tuple(dict.fromkeys(p.host for p in culprits)),
        tuple(p.pid for p in culprits),
        comm,
        None,
        op.name,
        summary,
        tuple(evidence),
    )


def _unread_ranks(ps: Sequence[RankPosition]) -> list[int]:
    sizes = {p.world_size for p in ps if p.world_size}
    if len(sizes) != 1:
        return []
    seen = {p.world_rank for p in ps if not p.error}
    return [r for r in range(sizes.pop()) if r not in seen]

"""A stall every member shares, held by a rank that is stopped: every thread
of its process was found stopped (``T``: a stop signal such as SIGSTOP or
SIGTSTP; ``t``: a debugger's stop) in its node's latest thread reading.  A
stopped process runs nothing: the collective it entered waits for its share
of the work, and its peers stand in flight beside it, so nothing in the
recorded calls tells it apart.  Its threads' state does.

The verdict is ``cpu_interference`` (the rank gets no CPU while its peers
wait for it), naming the stopped ranks; where every rank read is stopped,
the whole job is (a job-wide pause): nobody departs, and nothing is said
here.

The metric: per process, its threads' states in the latest reading of its
node that belongs to the incident (``stopped``).

Known limits: a rank stopped after its node's reading, or whose node took
none, is not seen; a reading finds a process stopped only while it is (a
stop that ended before the dump leaves nothing here).
"""

from __future__ import annotations

from stallwatch.dumpers.schema import op_name

from ..incident import Incident
from ..verdict import Verdict, VerdictKind
from .busy import STOPPED_STATES, latest_reading
from .common import Analysis, primary
from .stall import stall_evidence, stalled_frontiers


def stopped(inc: Incident, proc: int) -> bool | None:
    """Whether every thread of process ``proc`` was stopped in the latest
    reading of its node; None if it was not read."""
    latest = latest_reading(inc, proc)
    if latest is None or not latest.threads:
        return None
    return all(t.state in STOPPED_STATES for t in latest.threads)


def detect_stopped(a: Analysis) -> list[Verdict]:
    fronts = stalled_frontiers(a)
    if not fronts or not stall_evidence(a):
        return []
    inc = a.incident
    members = sorted({m.proc for f in fronts for m in f.members if m.proc >= 0})
    states = {p: stopped(inc, p) for p in members}
    read = [p for p, s in states.items() if s is not None]
    culprits = [p for p in read if states[p]]
    if not culprits or len(culprits) == len(read):
        return []
    f = primary(a, fronts)
    where = f"{op_name(f.op)} seq {f.seq} on {inc.comms[f.comm].hash_text}"
    age = f" for {f.age_ns / 1e9:.1f} s" if f.age_ns is not None else ""
    out = []
    for p in culprits:
        proc = inc.procs[p]
        inside = any(m.proc == p and m.in_flight for m in f.members)
        at = f"inside {where}" if inside else f"while its peers wait at {where}"
        summary = (
            f"{proc.label()} is stopped (every thread in state T or t: a stop signal or a "
            f"debugger) {at}; its peers stand in flight there{age}, waiting for it"
        )
        evidence = (
            f"{proc.label()}: every thread stopped when its node read them",
            *stall_evidence(a),
        )
        out.append(
            Verdict(
                VerdictKind.CPU_INTERFERENCE,
                (proc.world_rank,),
                (proc.host,),
                (proc.pid,),
                inc.comms[f.comm].hash_text,
                f.seq,
                op_name(f.op),
                summary,
                evidence,
            )
        )
    return out

"""Rank exited: a process holding a communicator died (exit code or signal)."""

from __future__ import annotations

import numpy as np
from stallwatch.dumpers.schema import op_name

from ..model import Proc
from ..verdict import Verdict, VerdictKind
from .common import MAX_LISTED, Analysis, last_call_text, member_text, primary


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
        where = primary(a, [f for f, _ in lag]) if lag else None
        comm = inc.comms[where.comm].hash_text if where else None
        summary = f"{p.label()} {_death(p)}"
        if where is not None:
            summary += f"; its peers wait at {op_name(where.op)} seq {where.seq} on {comm}"
        evidence = [f"{p.label()} {_death(p)}", last_call_text(a, i)]
        evidence += [member_text(a, f, m) for f, m in lag[:MAX_LISTED]]
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

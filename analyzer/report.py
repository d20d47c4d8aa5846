"""Stage "report": verdicts first, then evidence, then per-communicator
frontier tables; or the JSON document of DESIGN.md."""

from __future__ import annotations

import json

from stallwatch.dumpers.schema import op_name

from .metrics import Frontier, MemberState
from .pipeline import AnalysisResult, IncidentResult
from .verdict import VerdictKind

MAX_TABLES = 8
MAX_TABLE_ROWS = 64


def to_json(result: AnalysisResult) -> str:
    doc = {
        "incidents": [
            {
                "id": r.incident.id,
                "hosts": list(r.incident.hosts),
                "verdicts": [v.to_json() for v in r.verdicts],
                "notes": list(r.incident.notes),
            }
            for r in result.incidents
        ],
        "inputs": [{"path": s.path, "ok": s.ok, "error": s.error} for s in result.inputs],
    }
    return json.dumps(doc, indent=2)


def to_text(result: AnalysisResult) -> str:
    lines: list[str] = []
    for r in result.incidents:
        lines += _incident_text(r)
    bad = [s for s in result.inputs if not s.ok]
    if bad:
        lines.append(f"inputs not read ({len(bad)} of {len(result.inputs)}):")
        lines += [f"  {s.error}" for s in bad]
    if not result.incidents:
        lines.append("nothing could be analyzed")
    return "\n".join(lines)


def _incident_text(r: IncidentResult) -> list[str]:
    inc = r.incident
    lines = [f"incident {inc.id}: {len(inc.hosts)} host(s), {len(inc.procs)} rank(s)"]
    lines += [f"  note: {n}" for n in inc.notes]
    for v in r.verdicts:
        lines.append(f"  {v.kind.value.upper()}: {v.summary}")
        if v.kind is not VerdictKind.HEALTHY:
            where = ", ".join(
                x
                for x in (
                    f"ranks {list(v.ranks)}",
                    f"hosts {list(v.hosts)}",
                    f"pids {list(v.pids)}",
                    f"comm {v.comm_id_hash}" if v.comm_id_hash else "",
                    f"seq {v.seq}" if v.seq is not None else "",
                    f"op {v.op}" if v.op else "",
                )
                if x
            )
            lines.append(f"    {where}")
        lines += [f"    - {e}" for e in v.evidence]
    shown = sorted(r.frontiers, key=lambda f: (not f.laggards, -inc.comms[f.comm].nranks))
    for f in shown[:MAX_TABLES]:
        lines += _frontier_table(r, f)
    if len(shown) > MAX_TABLES:
        lines.append(f"  ({len(shown) - MAX_TABLES} more communicators not shown)")
    lines.append("")
    return lines


def _frontier_table(r: IncidentResult, f: Frontier) -> list[str]:
    inc = r.incident
    comm = inc.comms[f.comm]
    label = f" ({comm.label})" if comm.label else ""
    stuck = "stuck" if f.stuck else "moving"
    lines = [
        f"  communicator {comm.hash_text}{label}: {comm.nranks} ranks, frontier seq {f.seq} "
        f"{op_name(f.op)} ({stuck})",
        "    rank  world  host                 pid      last entered  last returned  state",
    ]
    for m in f.members[:MAX_TABLE_ROWS]:
        p = inc.procs[m.proc] if m.proc >= 0 else None
        state = m.state.value + (
            " (in flight)" if m.in_flight and m.state is MemberState.AT_FRONTIER else ""
        )
        lines.append(
            f"    {m.crank:<5} {p.world_rank if p else '?':<6} {(p.host if p else '-')[:20]:<20} "
            f"{p.pid if p else '-':<8} {_seq(m.last_seq):<13} {_seq(m.last_returned):<14} {state}"
        )
    if len(f.members) > MAX_TABLE_ROWS:
        rest = f.members[MAX_TABLE_ROWS:]
        lag = sum(1 for m in rest if m.state is not MemberState.AT_FRONTIER)
        lines.append(f"    ... {len(rest)} more ranks, {lag} of them not at the frontier")
    return lines


def _seq(s: int) -> str:
    return "-" if s < 0 else str(s)

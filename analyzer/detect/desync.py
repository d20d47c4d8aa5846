"""Desync: ranks disagree on op, count, datatype, reduce op, root or shape at
the same seq of a communicator; the odd ones out by majority.  Of several
fields, the first in ``DESYNC_FIELDS`` order is told (an op that differs
explains a count that differs)."""

from __future__ import annotations

from stallwatch.dumpers.schema import RedOp, datatype_name, op_name

from ..incident import Incident
from ..rankmetrics import DESYNC_FIELDS, Disagreement
from ..verdict import Verdict, VerdictKind
from .common import MAX_LISTED, Analysis, who


def _field_text(inc: Incident, field: str, value: int) -> str:
    if field == "shape":
        return inc.shapes[value] if 0 < value < len(inc.shapes) else "?"
    if field == "op":
        return op_name(value)
    if field == "datatype":
        return datatype_name(value)
    if field == "redop":
        try:
            return RedOp(value).name.lower()
        except ValueError:
            return f"redop_{value}"
    return str(value)


def detect_desync(a: Analysis) -> list[Verdict]:
    inc, m = a.incident, a.matched
    first: dict[tuple[int, ...], list[Disagreement]] = {}
    for d in sorted(a.disagreements, key=lambda d: (d.comm, d.seq, DESYNC_FIELDS.index(d.field))):
        procs = tuple(sorted({int(m.rows["proc"][i]) for i, _ in d.odd}))
        first.setdefault(procs, []).append(d)
    out = []
    for procs, ds in first.items():
        d = ds[0]
        ranks, hosts, pids = who(inc, list(procs))
        comm = inc.comms[d.comm]
        i0, v0 = d.odd[0]
        op = op_name(int(m.rows["op"][i0]))
        names = ", ".join(str(r) for r in ranks)
        summary = (
            f"rank {names} passed {d.field}={_field_text(inc, d.field, v0)} at seq {d.seq} on "
            f"{comm.name} where the others passed {_field_text(inc, d.field, d.consensus)}"
        )
        if d.tie:
            summary += " (no majority: either side may be wrong)"
        evidence = [
            f"seq {x.seq} {x.field}: "
            + ", ".join(
                f"{inc.procs[int(m.rows['proc'][i])].label()} {_field_text(inc, x.field, v)}"
                for i, v in x.odd[:MAX_LISTED]
            )
            + f"; consensus {_field_text(inc, x.field, x.consensus)}"
            for x in ds[:MAX_LISTED]
        ]
        cranks = tuple(int(m.rows["crank"][i]) for i, _ in d.odd)
        out.append(
            Verdict(
                VerdictKind.DESYNC,
                ranks,
                hosts,
                pids,
                comm.hash_text,
                d.seq,
                op,
                summary,
                tuple(evidence),
                cranks,
            )
        )
    return out

"""Desync: ranks disagree on op, count, datatype, reduce op, root or shape at
the same seq of a communicator; the odd ones out by majority.  Of several
fields, the first in ``DESYNC_FIELDS`` order is told (an op that differs
explains a count that differs).  The metric: per collective, the fields its
members disagree on, with the majority value (``disagreements``)."""

from __future__ import annotations

import numpy as np

from stallwatch.dumpers.schema import Op, RedOp, datatype_name, op_name

from ..frontier import ROOTED_OPS
from ..incident import UNKNOWN_DTYPE, Disagreement, Incident
from ..match import Matched
from ..verdict import Verdict, VerdictKind
from .common import MAX_LISTED, Analysis, who

# ---- metric: who disagrees with the majority, per collective -------------------------

# in the order a disagreement is told: the first one found explains the rest
DESYNC_FIELDS = ("op", "count", "datatype", "redop", "root", "shape")


def disagreements(m: Matched) -> list[Disagreement]:
    """Groups whose members disagree on a field, with the majority value.
    Counts and shapes are of each rank's own data (inputs, or the outputs of
    scatter and reduce_scatter); all-to-all splits are uneven by design and
    not compared; a shape is compared where every member's is known."""
    if not len(m.rows):
        return []
    out = []
    op = m.rows["op"]
    for field in DESYNC_FIELDS:
        vals = m.rows[field]
        if field == "root":
            vals = np.where(np.isin(op, ROOTED_OPS), vals, -1)
        elif field in ("count", "shape"):
            vals = np.where(op == Op.ALL_TO_ALL, -1, vals.astype(np.int64))
            if field == "shape":
                vals[vals == 0] = -1
        elif field == "datatype":  # one no input names (Flight Recorder) is unknown
            vals = np.where(vals == UNKNOWN_DTYPE, -1, vals.astype(np.int64))
        lo = np.minimum.reduceat(vals, m.group_start)
        hi = np.maximum.reduceat(vals, m.group_start)
        # a value some member's input does not tell is compared where every one's does
        odd = (lo != hi) & (lo >= 0) if field in ("shape", "datatype") else lo != hi
        for g in np.flatnonzero(odd).tolist():
            out.append(_majority(m, vals, g, field))
    return out


def _majority(m: Matched, vals: np.ndarray, g: int, field: str) -> Disagreement:
    start = int(m.group_start[g])
    idx = np.arange(start, start + int(m.group_size[g]))
    uniq, counts = np.unique(vals[idx], return_counts=True)
    best = counts.max()
    winners = uniq[counts == best]
    tie = len(winners) > 1
    consensus = int(winners[0])
    if tie:  # fall back on what the communicator did just before
        prev = g - 1
        if prev >= 0 and m.group_comm[prev] == m.group_comm[g]:
            p0 = int(m.group_start[prev])
            before = np.unique(vals[p0 : p0 + int(m.group_size[prev])])
            hits = [int(w) for w in winners if int(w) in before.tolist()]
            if len(hits) == 1:
                consensus, tie = hits[0], False
    odd = tuple((int(i), int(vals[i])) for i in idx if int(vals[i]) != consensus)
    return Disagreement(int(m.group_comm[g]), int(m.group_seq[g]), field, consensus, odd, tie)


# ---- the detector --------------------------------------------------------------------


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

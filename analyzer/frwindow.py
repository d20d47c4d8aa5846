"""Which calls an export to Flight Recorder files writes, and the numbers
torch would have given them (``analyzer.frexport``).

- Each communicator is written from the window every member still holds:
  its collectives from the latest first seq among the members whose
  windows hold any of them (never past the lowest last seq, so that every
  member keeps its own), its point-to-point calls on each rank from that
  rank's first collective kept there.  torchfrtrace matches a group's n-th
  collective from the first entry of the first rank it reads and calls a
  rank without it missing: a rank whose ring no longer holds a group's
  early calls would be named for the calls its peers' rings still hold.
- A communicator one member's incomplete window holds nothing of has no
  window every member holds: it is left out, and said so.
- A point-to-point call's ``p2p_seq_id`` is the rank's count of its p2p
  calls on the group, as torch counts them: from our per-peer, per-direction
  sequences (each from 0), every direction seen so far counted in full; in
  a Flight Recorder file it is the file's own.

Known limits: a direction whose calls all fell before a rank's window is
not counted in its later calls' ``p2p_seq_id``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np

from stallwatch.dumpers.inputs import SourceKind
from stallwatch.dumpers.schema import Op

from .incident import Incident

P2P_OPS = (int(Op.SEND), int(Op.RECV))


@dataclass(frozen=True, slots=True)
class Window:
    keep: np.ndarray  # bool per row: written
    p2p_count: (
        np.ndarray
    )  # per row: the rank's p2p calls on the group up to it (torch's p2p_seq_id)
    left_out: tuple[str, ...]  # communicators not written, and why


def window(inc: Incident, cols: Mapping[str, np.ndarray], written: Collection[int]) -> Window:
    """The rows (``cols``: proc, comm, seq, ts, op, root, crank, in the
    order proc, then time) an export writes, of the procs ``written``."""
    proc, comm, seq, ts = cols["proc"], cols["comm"], cols["seq"], cols["ts"]
    p2p = np.isin(cols["op"], P2P_OPS)
    keep = np.isin(proc, np.fromiter(written, dtype=np.int64))
    notes = []
    for c in np.unique(comm[keep]).tolist():
        on_c = (comm == c) & keep
        members = [p for p in inc.comms[c].members if p >= 0 and p in written]
        held = [p for p in members if (on_c & ~p2p & (proc == p)).any()]
        if not held:
            continue  # point-to-point calls only: nothing to align them on
        lost = [p for p in members if p not in held and not inc.procs[p].window_complete]
        if lost:
            keep[on_c] = False
            who = ", ".join(inc.procs[p].label() for p in lost)
            notes.append(
                f"{inc.comms[c].name}: the windows of {who} hold none of its calls, "
                "no window every member holds: not written"
            )
            continue
        firsts = [int(seq[on_c & ~p2p & (proc == p)].min()) for p in held]
        lasts = [int(seq[on_c & ~p2p & (proc == p)].max()) for p in held]
        start = min(max(firsts), min(lasts))
        keep[on_c & ~p2p & (seq < start)] = False
        for p in held:
            kept = on_c & ~p2p & (proc == p) & keep
            keep[on_c & p2p & (proc == p) & (ts < ts[kept].min())] = False
    return Window(keep, _p2p_counts(inc, cols, p2p), tuple(notes))


def _p2p_counts(inc: Incident, cols: Mapping[str, np.ndarray], p2p: np.ndarray) -> np.ndarray:
    """Per row, the rank's p2p calls on its communicator up to it (torch's
    ``p2p_seq_id``: a p2p call's own number, a collective's the last)."""
    out = np.zeros(len(p2p), dtype=np.int64)
    own = inc.kind is SourceKind.FLIGHT_RECORDER  # the file's own p2p_seq_id
    last: dict[tuple[int, int], dict[tuple[int, int], int]] = {}  # (proc, comm) -> direction -> seq
    ours: dict[tuple[int, int], int] = {}  # (proc, comm) -> the file's last p2p_seq_id
    rows = zip(*(cols[f].tolist() for f in ("proc", "comm", "seq", "op", "root")), strict=True)
    for i, (p, c, s, op, peer) in enumerate(rows):
        if own:
            if p2p[i]:
                ours[(p, c)] = s
            out[i] = ours.get((p, c), 0)
            continue
        seen = last.setdefault((p, c), {})
        if p2p[i]:
            seen[(peer, op)] = s
        out[i] = sum(n + 1 for n in seen.values())
    return out

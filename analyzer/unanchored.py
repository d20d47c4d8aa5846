"""Streams recorded from an attach that no agent saw made: judged among
themselves by their frontiers.

When every agent arrived late (a DaemonSet rollout, an agent upgrade that
replaced an incompatible pinned layout), no recording holds a communicator's
id, and ``analyzer.late`` has nothing to align the streams (one process, one
communicator pointer, seq counted from the attach) to.  They can still be
told apart at their ends:

- a *waiter* is a stream whose latest call is in flight, and has been for at
  least ``STALL_NS`` when its dump read the rings;
- every stream of another process whose calls are the waiter's (the same op,
  count, datatype, reduce op and root, call after call) at one certain offset
  (entries matched by wall clock, ``streams.find_fits``/``streams.choose``) is placed
  against the waiter's frontier, counted back from the end: it *completed*
  the waiter's call (then it is no member of the waiter's communicator: a
  collective does not complete on one member while another is stuck inside
  it), *waits* in it too, or is *behind* (its calls end before it);
- a process none of whose streams is in flight, behind at a waiter's frontier,
  whose dump was taken after that frontier began (beyond the clocks' skew),
  is the culprit; a process that waits elsewhere is a victim, never named.

Known limits: streams whose calls look alike and run at the same moments
(two communicators of the same shape, in lock step) are told apart only by
what their ends allow (a candidate that completed the call is no member);
when no process is left that is behind and idle, nothing is named.
"""

from __future__ import annotations

import numpy as np

from stallwatch.dumpers.model import Recording
from stallwatch.dumpers.schema import op_name

from .incident import SKEW_NS, StreamWait, Unanchored
from .streams import Known, Stream, choose, find_fits, signatures

STALL_NS = 1_000_000_000  # a waiter's call in flight at least this long


def judge_streams(recs: list[Recording], streams: list[Stream]) -> Unanchored:
    captured = {(s.host, s.pid): recs[s.source].clock.realtime_ns for s in streams}
    waits = [w for s in streams if (w := _wait(recs, s, streams)) is not None]
    flying = {(s.host, s.pid) for s in streams if _last_in_flight(s)}
    culprits: set[tuple[str, int]] = set()
    for w in waits:
        for p in w.behind:
            if p not in flying and captured[p] >= w.entered_ns + SKEW_NS:
                culprits.add(p)
    return Unanchored(tuple(waits), tuple(sorted(culprits)), captured)


def _last_in_flight(s: Stream) -> bool:
    return bool(len(s.rows)) and int(s.rows["end_ns"][-1]) == 0


def _wait(recs: list[Recording], w: Stream, streams: list[Stream]) -> StreamWait | None:
    if not _last_in_flight(w):
        return None
    age = recs[w.source].clock.realtime_ns - int(w.wall[-1])
    if age < STALL_NS:
        return None
    # the waiter's own calls stand in for a communicator known to the others
    k = Known(0, -1, False, 0, {}, w.rows["seq"].astype(np.int64), signatures(w.rows), w.wall)
    front = int(w.rows["seq"][-1])
    places: dict[str, list[tuple[str, int]]] = {"behind": [], "waiting": [], "completed": []}
    for c in streams:
        if (c.host, c.pid) == (w.host, w.pid):
            continue
        best, _, _ = choose(find_fits(c, k))
        if best is None:
            continue  # other calls, or no certain offset: not placed
        where = _place(c, best.offset, front)
        if where:
            places[where].append((c.host, c.pid))
    return StreamWait(
        w.host,
        w.pid,
        w.ptr,
        op_name(int(w.rows["op"][-1])),
        age,
        int(w.wall[-1]),
        *(tuple(sorted(set(places[x]))) for x in ("behind", "waiting", "completed")),
    )


def _place(c: Stream, offset: int, front: int) -> str:
    seq = c.rows["seq"].astype(np.int64) + offset
    at = np.flatnonzero(seq == front)
    if len(at):
        return "waiting" if int(c.rows["end_ns"][at[0]]) == 0 else "completed"
    if len(seq) and int(seq.max()) < front:
        return "behind"
    return ""

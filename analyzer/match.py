"""Stage "match": each communicator's n-th collective across its ranks.

Collective calls are ordered by (communicator, seq, comm rank), through a
grid of those slots when it is dense (no sort), else with one argsort of a
packed key, then cut into groups, one per (comm, seq).  Per
(comm, rank) *pair* the window that rank retained is computed: first and last
seq entered, last seq returned, and its last row.  Progress counters that some
inputs carry without rows (Flight Recorder ``pg_status``) are merged in.

Point-to-point calls are kept out of the groups (their seq is per peer and
direction); ``detect.missing.p2p_gaps`` pairs them by direction instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stallwatch.dumpers.schema import Op

from .columns import Columns
from .incident import Calls, Incident

IS_P2P = np.zeros(256, dtype=bool)
IS_P2P[[Op.SEND, Op.RECV]] = True
GRID_SLACK = 4  # order through a grid of (comm, seq, rank) slots up to this many per row


@dataclass(frozen=True, slots=True)
class Matched:
    rows: Columns  # collective calls sorted by (comm, seq, crank)
    gid: np.ndarray  # group of each row
    group_start: np.ndarray  # first row of each group; groups are (comm, seq)
    group_size: np.ndarray
    group_comm: np.ndarray
    group_seq: np.ndarray
    pair_offset: np.ndarray  # comm -> first pair index; pair = offset[comm] + crank
    pair_last_row: np.ndarray  # row (index into rows) with the pair's highest seq, -1 none
    pair_first_seq: np.ndarray  # -1 if nothing retained
    pair_last_seq: np.ndarray  # -1 if nothing retained
    pair_last_returned: np.ndarray  # -1 if none returned
    comm_start: np.ndarray  # comm -> its first row; comm_start[comm + 1] its end

    def pairs_of(self, comm: int) -> slice:
        return slice(int(self.pair_offset[comm]), int(self.pair_offset[comm + 1]))

    def comm_rows(self, comm: int) -> slice:
        return slice(int(self.comm_start[comm]), int(self.comm_start[comm + 1]))


def _seq_range(comm: np.ndarray, seq: np.ndarray, ncomms: int) -> tuple[np.ndarray, np.ndarray]:
    """Lowest and highest seq of each communicator (hi < lo: no rows)."""
    lo = np.full(ncomms, np.iinfo(np.int64).max, dtype=np.int64)
    hi = np.full(ncomms, np.iinfo(np.int64).min, dtype=np.int64)
    if ncomms == 1:  # the common case: no scatter
        lo[0], hi[0] = int(seq.min()), int(seq.max())
    else:
        np.minimum.at(lo, comm, seq)
        np.maximum.at(hi, comm, seq)
    return lo, hi


def _grid_order(
    comm: np.ndarray, seq: np.ndarray, crank: np.ndarray, nranks: np.ndarray
) -> np.ndarray | None:
    """The order by (comm, seq, crank) without a sort: each row has a slot in
    a grid of every (comm, seq, rank) in range; rows dropped in their slots,
    read back in slot order.  None when the grid would be sparse (seqs far
    apart) or two rows share a slot (a duplicate): then sort."""
    n = len(comm)
    lo, hi = _seq_range(comm, seq, len(nranks))
    span = np.maximum(hi - lo + 1, 0)
    width = np.maximum(nranks, 1).astype(np.int64)
    size = span * width
    total = int(size.sum())
    if total > GRID_SLACK * n + 1024 or total >= np.iinfo(np.int64).max // 4:
        return None
    if len(nranks) == 1:  # no per-row gathers of the comm's numbers
        slot = seq - int(lo[0])
        slot *= int(width[0])
    else:
        base = np.zeros(len(nranks), dtype=np.int64)
        base[1:] = np.cumsum(size)[:-1]
        slot = seq - lo[comm]
        slot *= width[comm]
        slot += base[comm]
    slot += crank
    kind = np.int32 if n < (1 << 31) else np.int64
    grid: np.ndarray = np.full(total, -1, dtype=kind)
    grid[slot] = np.arange(n, dtype=kind)
    del slot
    order = grid[grid >= 0]
    if len(order) != n:  # a slot held two rows
        return None
    return order.astype(np.int64)


def _sort_order(
    comm: np.ndarray, seq: np.ndarray, crank: np.ndarray, nranks: np.ndarray
) -> np.ndarray:
    """Order by (comm, seq, crank), ties in input order.  ``crank`` must be
    within ``nranks`` of its comm."""
    if not len(comm):
        return np.zeros(0, dtype=np.int64)
    seq = seq.astype(np.int64, copy=False)
    order = _grid_order(comm, seq, crank, nranks)
    if order is not None:
        return order
    nranks_max = int(nranks.max()) if len(nranks) else 1
    lo = int(seq.min())
    seq_span = int(seq.max()) - lo + 1
    ncomms = int(comm.max()) + 1
    span = ncomms * seq_span * max(nranks_max, 1)
    if span < (1 << 62):
        key = comm.astype(np.int64) * seq_span + (seq - lo)
        key *= max(nranks_max, 1)
        key += crank
        if span < (1 << 32):  # a narrower key sorts a third faster
            key = key.astype(np.uint32)
        out: np.ndarray = np.argsort(key, kind="stable")
        return out
    return np.lexsort((crank, seq, comm))


def _collective(rows: Columns, nranks: np.ndarray) -> np.ndarray:
    keep: np.ndarray = ~IS_P2P[rows["op"]]
    if len(nranks) and int(nranks.min()) == int(nranks.max()):  # one size: no gather
        keep &= rows["crank"] < int(nranks[0])
    elif len(nranks):
        keep &= rows["crank"] < nranks[rows["comm"]]
    return keep


def order_calls(rows: Columns, nranks: np.ndarray) -> Calls:
    """Sort a calls table: matched collectives first, by (comm, seq, crank),
    the rest after.  The table is permuted in place, column by column."""
    keep = _collective(rows, nranks)
    if keep.all():  # the common case: no p2p, no index to apply to the keys
        good = len(rows)
        order = _sort_order(rows["comm"], rows["seq"], rows["crank"], nranks)
    else:
        idx = np.flatnonzero(keep)
        good = len(idx)
        comm, seq, crank = (rows[f][idx] for f in ("comm", "seq", "crank"))
        order = idx[_sort_order(comm, seq, crank, nranks)]
        order = np.concatenate([order, np.flatnonzero(~keep)])
    del keep
    rows.permute(order)
    return Calls(rows, good)


def match(inc: Incident) -> Matched:
    nranks = np.array([c.nranks for c in inc.comms], dtype=np.int64)
    raw = inc.calls.rows
    if inc.calls.matched >= 0:
        rows = raw[: inc.calls.matched]
    else:
        idx = np.flatnonzero(_collective(raw, nranks))
        comm, seq, crank = (raw[f][idx] for f in ("comm", "seq", "crank"))
        rows = raw.take(idx[_sort_order(comm, seq, crank, nranks)])
    n = len(rows)
    comm, seq, crank = rows["comm"], rows["seq"], rows["crank"]
    new = np.ones(n, dtype=bool)
    if n:
        new[1:] = (comm[1:] != comm[:-1]) | (seq[1:] != seq[:-1])
    group_start = np.flatnonzero(new)
    gid = np.cumsum(new) - 1
    group_size = np.diff(np.append(group_start, n))
    offset = np.zeros(len(nranks) + 1, dtype=np.int64)
    offset[1:] = np.cumsum(nranks)
    pair = offset[comm] + crank
    npairs = int(offset[-1])
    index = np.arange(n)
    last_row = np.full(npairs, -1, dtype=np.int64)
    np.maximum.at(last_row, pair, index)
    first_row = np.full(npairs, n, dtype=np.int64)
    np.minimum.at(first_row, pair, index)
    del index
    has = last_row >= 0
    last_seq = np.where(has, seq[np.clip(last_row, 0, max(n - 1, 0))] if n else -1, -1)
    first_seq = np.where(has, seq[np.clip(first_row, 0, max(n - 1, 0))] if n else -1, -1)
    returned = np.full(npairs, -1, dtype=np.int64)
    done = rows["end"] > 0
    np.maximum.at(returned, pair[done], seq[done])
    _merge_progress(inc, offset, last_seq, returned)
    return Matched(
        rows=rows,
        gid=gid,
        group_start=group_start,
        group_size=group_size,
        group_comm=comm[group_start],
        group_seq=seq[group_start],
        pair_offset=offset,
        pair_last_row=last_row,
        pair_first_seq=first_seq.astype(np.int64),
        pair_last_seq=last_seq.astype(np.int64),
        pair_last_returned=returned,
        comm_start=np.searchsorted(comm, np.arange(len(nranks) + 1, dtype=comm.dtype)),
    )


def _merge_progress(
    inc: Incident, offset: np.ndarray, last_seq: np.ndarray, returned: np.ndarray
) -> None:
    for comm, crank, entered, completed in inc.progress:
        if comm < len(offset) - 1 and crank < offset[comm + 1] - offset[comm]:
            p = int(offset[comm]) + crank
            last_seq[p] = max(int(last_seq[p]), entered)
            returned[p] = max(int(returned[p]), completed)

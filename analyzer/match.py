"""Stage "match": each communicator's n-th collective across its ranks.

Collective calls are sorted by (communicator, seq, comm rank) with one
argsort of a packed key, then cut into groups, one per (comm, seq).  Per
(comm, rank) *pair* the window that rank retained is computed: first and last
seq entered, last seq returned, and its last row.  Progress counters that some
inputs carry without rows (Flight Recorder ``pg_status``) are merged in.

Point-to-point calls are kept out of the groups (their seq is per peer and
direction); they only show up as "what a rank last did".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dumpers.schema import Op

from .model import Calls, Incident

IN_PLACE_ABOVE_BYTES = 3 << 30  # larger tables are permuted field by field, in place
IS_P2P = np.zeros(256, dtype=bool)
IS_P2P[[Op.SEND, Op.RECV]] = True


@dataclass(frozen=True, slots=True)
class Matched:
    rows: np.ndarray  # collective calls sorted by (comm, seq, crank)
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

    def pairs_of(self, comm: int) -> slice:
        return slice(int(self.pair_offset[comm]), int(self.pair_offset[comm + 1]))

    def comm_rows(self, comm: int) -> slice:
        lo, hi = np.searchsorted(self.rows["comm"], [comm, comm + 1])
        return slice(int(lo), int(hi))


def _sort_order(
    comm: np.ndarray, seq: np.ndarray, crank: np.ndarray, nranks_max: int
) -> np.ndarray:
    """Order by (comm, seq, crank): one argsort of a packed key when it fits."""
    if not len(comm):
        return np.zeros(0, dtype=np.int64)
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
        order: np.ndarray = np.argsort(key, kind="stable")
        return order
    return np.lexsort((crank, seq, comm))


def take_rows(rows: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``rows[index]`` of a structured table, as plain blocks of bytes: numpy
    copies structured records field by field, several times slower."""
    if not rows.flags.c_contiguous or rows.dtype.hasobject:
        same: np.ndarray = rows[index]
        return same
    blocks = rows.view(np.dtype((np.void, rows.dtype.itemsize)))
    out: np.ndarray = np.take(blocks, index).view(rows.dtype)
    return out


def _collective(rows: np.ndarray, nranks: np.ndarray) -> np.ndarray:
    keep: np.ndarray = ~IS_P2P[rows["op"]]
    if len(nranks) and int(nranks.min()) == int(nranks.max()):  # one size: no gather
        keep &= rows["crank"] < int(nranks[0])
    elif len(nranks):
        keep &= rows["crank"] < nranks[rows["comm"]]
    return keep


def order_calls(rows: np.ndarray, nranks: np.ndarray) -> Calls:
    """Sort a calls table: matched collectives first, by (comm, seq, crank),
    the rest after.  A large table is permuted in place, field by field, so
    that no second copy of it ever exists."""
    keep = _collective(rows, nranks)
    top = int(nranks.max()) if len(nranks) else 1
    if keep.all():  # the common case: no p2p, no index to apply to the keys
        good = np.arange(len(rows))
        order = _sort_order(rows["comm"], rows["seq"], rows["crank"], top)
    else:
        good = np.flatnonzero(keep)
        comm, seq, crank = (rows[f][good] for f in ("comm", "seq", "crank"))
        order = good[_sort_order(comm, seq, crank, top)]
        order = np.concatenate([order, np.flatnonzero(~keep)])
    if rows.nbytes <= IN_PLACE_ABOVE_BYTES:
        return Calls(take_rows(rows, order), len(good))  # one gather of whole records
    for name in rows.dtype.names or ():
        rows[name] = rows[name][order]
    return Calls(rows, len(good))


def match(inc: Incident) -> Matched:
    nranks = np.array([c.nranks for c in inc.comms], dtype=np.int64)
    raw = inc.calls.rows
    if inc.calls.matched >= 0:
        rows = raw[: inc.calls.matched]
    else:
        idx = np.flatnonzero(_collective(raw, nranks))
        top = int(nranks.max()) if len(nranks) else 1
        comm, seq, crank = (raw[f][idx] for f in ("comm", "seq", "crank"))
        rows = take_rows(raw, idx[_sort_order(comm, seq, crank, top)])
    n = len(rows)
    # each field read from the records is a sweep of the table: read each once
    comm, seq, crank = (np.ascontiguousarray(rows[f]) for f in ("comm", "seq", "crank"))
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
    )


def _merge_progress(
    inc: Incident, offset: np.ndarray, last_seq: np.ndarray, returned: np.ndarray
) -> None:
    for comm, crank, entered, completed in inc.progress:
        if comm < len(offset) - 1 and crank < offset[comm + 1] - offset[comm]:
            p = int(offset[comm]) + crank
            last_seq[p] = max(int(last_seq[p]), entered)
            returned[p] = max(int(returned[p]), completed)

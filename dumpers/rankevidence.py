"""What a member's own calls on a split communicator tell of its rank there
and of the communicator's size (``dumpers.ranks`` reads it where members
left no recording).

The kernel cannot see a split communicator's rank or size; NCCL checks the
arguments of every call against them.  So, of one process's rows on one
communicator:

- a call that returned success named a peer (send, receive) or a root
  (broadcast, reduce, gather, scatter) inside the communicator: it has more
  ranks than the highest one named;
- a rank never completes a send to itself without a receive from itself
  (NCCL pairs a rank's own send and receive in one group), nor the reverse:
  a peer named in one direction only, by a call the rank got past, is not
  the rank itself.  "Got past": a later collective of the same process on
  the same communicator completed (NCCL runs a communicator's operations in
  the order they were issued), seen on its device, or returned where the
  process's calls there block (their median takes ``ASYNC_BELOW_NS`` or
  more: an asynchronous return is only an enqueue).

The same rows feed the analyzer, the SQL tables (the ``communicators``
table's ``named_rank`` and ``not_ranks``) and the fan-out's client, which
reads those columns from every agent: one evidence, one derivation.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from .layout import Op, Result, State

# A call's median duration under which a communicator's calls are taken as
# asynchronous (they return once queued): an enqueue takes microseconds, a
# blocking collective waits for its slowest peer at least a network round
# trip and the data (the analyzer's frontier and network rules read it too).
ASYNC_BELOW_NS = 1_000_000

ROOTED = (Op.BROADCAST, Op.REDUCE, Op.GATHER, Op.SCATTER)
NAMING = np.zeros(256, dtype=bool)
NAMING[[int(op) for op in (Op.SEND, Op.RECV, *ROOTED)]] = True
COLLECTIVE = np.zeros(256, dtype=bool)
COLLECTIVE[[int(op) for op in Op if op.is_collective]] = True


@dataclass(frozen=True, slots=True)
class Evidence:
    """Of one member on one communicator: the highest comm rank its calls
    named (-1: none), and comm ranks its own calls prove it does not hold."""

    named: int = -1
    not_ranks: frozenset[int] = frozenset()

    def merged(self, other: Evidence) -> Evidence:
        return Evidence(max(self.named, other.named), self.not_ranks | other.not_ranks)


def ring_evidence(rows: np.ndarray, hashes: Iterable[int]) -> dict[tuple[int, int], Evidence]:
    """(pid, comm hash) -> Evidence, from one recording's NCCL rows, for the
    communicators ``hashes`` (split ones: the others know their ranks)."""
    wanted = np.array(sorted(set(hashes)), dtype=np.uint64)
    if not len(rows) or not len(wanted):
        return {}
    rows = rows[np.isin(rows["comm_hash"], wanted)]
    if not len(rows):
        return {}
    ok = (rows["result"] == Result.SUCCESS) & (rows["end_ns"] > 0) & (rows["peer"] >= 0)
    named = rows[ok & NAMING[rows["op"]]]
    out: dict[tuple[int, int], Evidence] = {}
    for pid, h, peer in zip(
        named["pid"].tolist(), named["comm_hash"].tolist(), named["peer"].tolist(), strict=True
    ):
        key = (int(pid), int(h))
        out[key] = Evidence(max(out.get(key, Evidence()).named, int(peer)))
    for key, ranks in _not_self(rows, ok).items():
        out[key] = out.get(key, Evidence()).merged(Evidence(-1, frozenset(ranks)))
    return out


def _not_self(rows: np.ndarray, ok: np.ndarray) -> dict[tuple[int, int], set[int]]:
    """Peers a process named in one direction only, by a call it got past."""
    p2p = rows[ok & ((rows["op"] == Op.SEND) | (rows["op"] == Op.RECV))]
    if not len(p2p):
        return {}
    ways: dict[tuple[int, int, int], set[int]] = defaultdict(set)
    first: dict[tuple[int, int, int], int] = {}
    for pid, h, peer, op, ts in zip(
        *(p2p[f].tolist() for f in ("pid", "comm_hash", "peer", "op", "ts_ns")), strict=True
    ):
        k = (int(pid), int(h), int(peer))
        ways[k].add(int(op))
        first[k] = min(first.get(k, ts), ts)
    one_way = {k for k, ops in ways.items() if len(ops) == 1}
    if not one_way:
        return {}
    passed = _got_past(rows, {(pid, h) for pid, h, _ in one_way})
    out: dict[tuple[int, int], set[int]] = defaultdict(set)
    for pid, h, peer in one_way:
        if first[(pid, h, peer)] < passed.get((pid, h), -1):
            out[(pid, h)].add(peer)
    return out


def _got_past(rows: np.ndarray, keys: set[tuple[int, int]]) -> dict[tuple[int, int], int]:
    """(pid, comm hash) -> when its latest collective that is proven
    completed began (its host's clock)."""
    coll = rows[COLLECTIVE[rows["op"]] & (rows["end_ns"] > 0) & (rows["result"] == 0)]
    out: dict[tuple[int, int], int] = {}
    for pid, h in keys:
        mine = coll[(coll["pid"] == pid) & (coll["comm_hash"] == h)]
        if not len(mine):
            continue
        took = mine["end_ns"].astype(np.int64) - mine["ts_ns"].astype(np.int64)
        blocking = float(np.median(took)) >= ASYNC_BELOW_NS
        done = mine if blocking else mine[mine["state"] == State.COMPLETED]
        if len(done):
            out[(pid, h)] = int(done["ts_ns"].max())
    return out


def merge(parts: Iterable[Mapping[tuple[int, int], Evidence]]) -> dict[tuple[int, int], Evidence]:
    out: dict[tuple[int, int], Evidence] = {}
    for part in parts:
        for key, ev in part.items():
            out[key] = out[key].merged(ev) if key in out else ev
    return out

"""Streams recorded from an agent's attach, and the offsets at which one
stream's calls are another's.

A *stream* is one process's calls on one communicator pointer that its agent
saw no id for (the communicator was made before the attach): seq counted from
the attach.  ``find_fits`` proposes every offset at which a stream's calls are a
set of known calls (same op, count, datatype, reduce op and root, call after
call, entries near in wall clock); ``choose`` keeps one only when it is
certain.  ``analyzer.late`` aligns streams to communicators the other dumps
know with them; ``analyzer.unanchored`` judges the streams it could not
align among themselves.  The method and its thresholds are told in
``analyzer.late``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stallwatch.dumpers.model import CommInfo, Recording
from stallwatch.dumpers.schema import NCCL_EVENT, Op

MIN_OVERLAP = 3
MAX_SKEW_NS = 1_000_000_000
SEPARATION = 4.0
SEPARATION_FLOOR_NS = 5_000_000
SEARCH_NS = 2_000_000_000  # candidate calls this near a stream's call propose offsets
ANCHORS = 16  # of a stream's first calls
COLLECTIVE = np.zeros(256, dtype=bool)
COLLECTIVE[[int(op) for op in Op if op.is_collective]] = True
SIGNATURE = ("op", "count", "datatype", "redop", "peer")


@dataclass
class Stream:
    source: int
    host: str
    pid: int
    ptr: int
    rows: np.ndarray  # its collective rows, by seq
    wall: np.ndarray  # their entries, wall clock ns
    peers: set[int]  # point-to-point peers it named
    rank: int  # learned by the agent, -1 if not


@dataclass
class Known:
    comm_hash: int
    nranks: int  # -1 for a split communicator (its size is not recorded)
    split: bool
    evident: int  # the size its members' roots and peers prove (highest + 1)
    members: dict[tuple[int, int], CommInfo]  # (source, pid) -> its info
    seqs: np.ndarray  # sorted, unique
    sig: np.ndarray  # the signature of each seq (first member's)
    wall: np.ndarray  # the median wall-clock entry of each seq


def wall_clock(rec: Recording, ts: np.ndarray) -> np.ndarray:
    return ts.astype(np.int64) - rec.clock.monotonic_ns + rec.clock.realtime_ns


SIG_DTYPE = np.dtype([(f, NCCL_EVENT[f]) for f in SIGNATURE])  # packed


def signatures(rows: np.ndarray) -> np.ndarray:
    """Each call's signature as one comparable value."""
    out = np.empty(len(rows), dtype=SIG_DTYPE)
    for f in SIGNATURE:
        out[f] = rows[f]
    return out.view(f"V{SIG_DTYPE.itemsize}")


def nccl_rows(rec: Recording) -> np.ndarray:
    ring = rec.rings.get("nccl")
    return ring.rows if ring is not None else np.zeros(0, NCCL_EVENT)


@dataclass(frozen=True, slots=True)
class Fit:
    comm_hash: int
    offset: int
    shared: int
    skew_ns: int


def find_fits(s: Stream, k: Known) -> list[Fit]:
    """Every offset at which the stream's calls are the candidate's."""
    if not len(s.rows) or not len(k.seqs):
        return []
    order = np.argsort(k.wall, kind="stable")
    kwall, kseq = k.wall[order], k.seqs[order]
    proposed: set[int] = set()
    for seq, wall in zip(s.rows["seq"][:ANCHORS].tolist(), s.wall[:ANCHORS].tolist(), strict=True):
        lo, hi = np.searchsorted(kwall, [wall - SEARCH_NS, wall + SEARCH_NS])
        proposed.update(int(x) - int(seq) for x in kseq[lo:hi].tolist())
    sseq = s.rows["seq"].astype(np.int64)
    ssig = signatures(s.rows)
    out = []
    for offset in sorted(proposed):
        at = np.searchsorted(k.seqs, sseq + offset)
        ok = at < len(k.seqs)
        ok[ok] = k.seqs[at[ok]] == sseq[ok] + offset
        shared = int(ok.sum())
        if shared < MIN_OVERLAP or not (k.sig[at[ok]] == ssig[ok]).all():
            continue
        skew = int(np.median(np.abs(s.wall[ok] - k.wall[at[ok]])))
        out.append(Fit(k.comm_hash, offset, shared, skew))
    return out


def choose(fits: list[Fit]) -> tuple[Fit | None, int | None, str]:
    """The certain fit, the runner-up's skew, or why none is certain."""
    if not fits:
        return None, None, "no communicator with a free slot has calls of the same op and size"
    fits = sorted(fits, key=lambda f: f.skew_ns)
    best, runner = fits[0], (fits[1].skew_ns if len(fits) > 1 else None)
    if best.skew_ns > MAX_SKEW_NS:
        return None, runner, f"the closest fit is {best.skew_ns / 1e6:.0f} ms off"
    if runner is not None and runner < max(
        SEPARATION * best.skew_ns, best.skew_ns + SEPARATION_FLOOR_NS
    ):
        return (
            None,
            runner,
            (
                f"two fits are as close ({best.skew_ns / 1e6:.1f} and {runner / 1e6:.1f} ms): "
                "calls closer together than the clocks can tell apart"
            ),
        )
    return best, runner, ""

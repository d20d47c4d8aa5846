"""Stage "align", its largest part: the NCCL calls of many dumps' windows,
checked and staged at once.

Each dump's window (its ranks' latest calls, ``analyzer.align``) is judged
by the plausibility rules (``analyzer.plausible``); the calls of a dump that
breaks none are copied into the stage table, with what the later stages
want of each dump: the processes of its scope, the communicators its rows
name that its table lacks, where each process was blocked, its long calls.
A dump's rows are found by their group column (``plausible.Dumps``): a batch
of dumps costs a few dozen passes of numpy over all its rows, where a dump
at a time cost as many per dump (about 2 ms each: a minute for the 16,384
dumps of a 131,072-rank job).  The results do not depend on how dumps are
batched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from stallwatch.dumpers.model import Recording
from stallwatch.dumpers.schema import Op

from .columns import Columns
from .incident import HELD_DTYPE, HELD_NS
from .plausible import Dumps, keyed, member, pair_member, rule_masks

IS_CALL = np.zeros(256, dtype=bool)  # op -> is a collective or p2p call
IS_CALL[[int(op) for op in Op if op.is_collective or op.is_p2p]] = True
WAITS_IN = IS_CALL.copy()  # calls a rank can be found blocked in: its group's end too
WAITS_IN[int(Op.GROUP_END)] = True

# stage column <- ring field, copied as they are
CALL_FIELDS = (
    ("seq", "seq"),
    ("ts", "ts_ns"),
    ("end", "end_ns"),
    ("count", "count"),
    ("root", "peer"),
    ("op", "op"),
    ("datatype", "datatype"),
    ("redop", "redop"),
    ("state", "state"),
    ("result", "result"),
    ("crank", "rank"),
    ("hash", "comm_hash"),
)
_LOW = np.uint64(0xFFFFFFFF)
NO_PIDS = np.zeros(0, dtype=np.uint32)


@dataclass(frozen=True, slots=True)
class Staged:
    """What one dump's window gave: its rows in the stage table (none if
    the window was damaged), and what the later stages want of it."""

    rows: slice
    damaged: bool
    latest: int | None  # its latest timestamp (None: no call staged)
    scope: np.ndarray  # pids (sorted): its rows' "proc" column holds indices into it
    pids: tuple[int, ...]  # pids of its call rows, beyond its communicator table's
    # (comm_hash, pid, rank, nranks) of call rows whose comm its table lacks
    row_members: tuple[tuple[int, int, int, int], ...]
    # (pid, op, entered) of each process whose latest call had not returned
    waiting: tuple[tuple[int, int, int], ...]
    held: np.ndarray | None  # its long calls (HELD_DTYPE, "proc" a pid)
    entered: tuple[tuple[int, int], ...]  # (pid, entered) of each process's latest call


def listed_pids(rec: Recording) -> np.ndarray:
    """The pids of the agent's process and communicator tables (sorted): its
    scope."""
    pids = {p.pid for p in rec.processes} | {c.pid for c in rec.communicators}
    return np.array(sorted(pids), dtype=np.uint32)


def stage_windows(
    raw: np.ndarray,
    sizes: Sequence[int],
    recs: Sequence[Recording],
    lost: Sequence[int],
    stage: Columns,
    at: int,
) -> list[Staged]:
    """Each dump's window (``raw``: NCCL rows, each dump's ``sizes[i]`` rows
    one after another, oldest first) judged and its calls written into
    ``stage`` from row ``at`` on, one dump after another (a damaged one
    writes none)."""
    bounds = np.r_[0, np.cumsum(np.asarray(sizes, dtype=np.int64))]
    scopes = [listed_pids(r) for r in recs]
    d = Dumps(raw, bounds, recs, lost, scopes)
    bad = np.zeros(len(raw), dtype=bool)
    for mask, _ in rule_masks(d):
        bad |= mask
    damaged = np.bincount(d.group[bad].astype(np.int64), minlength=len(recs)) > 0
    return _Stager(d, recs, scopes, damaged).write(stage, at)


class _Stager:
    def __init__(
        self, d: Dumps, recs: Sequence[Recording], scopes: list[np.ndarray], damaged: np.ndarray
    ) -> None:
        self.d, self.recs, self.damaged = d, recs, damaged
        raw, group = d.raw, d.group
        keep = IS_CALL[raw["op"]] & ~d.captured
        self.times = _device_timeline(d, keep)
        # an agent's process table is its scope (one node); without one, every pid
        pids = d.keys(raw["pid"])
        derived = ~d.has_scope[group] & keep
        self.scope_keys = np.union1d(d.scope_keys, pids[derived])
        groups = np.arange(len(recs) + 1, dtype=np.uint64)
        self.scope_start = np.searchsorted(self.scope_keys, keyed(groups, np.zeros_like(groups)))
        pos = np.searchsorted(self.scope_keys, pids)
        np.minimum(pos, max(len(self.scope_keys) - 1, 0), out=pos)
        self.inside = (
            self.scope_keys[pos] == pids if len(self.scope_keys) else np.zeros(len(raw), bool)
        )
        self.index = pos - self.scope_start[group.astype(np.int64)]
        keep &= self.inside & ~damaged[group.astype(np.int64)]
        self.sel = np.flatnonzero(keep)
        self.listed = scopes

    def write(self, stage: Columns, at: int) -> list[Staged]:
        d, sel, raw = self.d, self.sel, self.d.raw
        n = len(sel)
        dst = slice(at, at + n)
        stage["proc"][dst] = self.index[sel]
        for name, src in CALL_FIELDS:
            stage[name][dst] = (self.times[name] if name in self.times else raw[src])[sel]
        for name in ("device", "queued"):
            stage[name][dst] = self.times[name][sel] if name in self.times else 0
        stage["shape"][dst] = 0  # our rings record counts, not tensor shapes
        group = d.group[sel].astype(np.int64)
        counts = np.bincount(group, minlength=len(self.recs))
        starts = at + np.r_[0, np.cumsum(counts)]
        hashes = stage["hash"][dst]
        self._fill_unknown(hashes, group, sel)
        foreign = ~pair_member(d.group[sel], hashes, d.comm_group, d.comm_hash)
        used = np.zeros(len(self.scope_keys), dtype=bool)
        used[self.scope_start[group] + self.index[sel]] = True
        ts, end = stage["ts"][dst], stage["end"][dst]
        latest = _segment_max(np.maximum(ts, end), counts)
        held = self._held()
        waiting, entered = self._latest()
        # per dump, read as Python values once: a dump's own work is a few lines
        scopes = (self.scope_keys & _LOW).astype(np.uint32)
        bounds, cut, first = d.bounds.tolist(), self.scope_start.tolist(), starts.tolist()
        damaged = self.damaged.tolist()
        foreigners = np.bincount(group[foreign], minlength=len(self.recs)).tolist()
        out = []
        for g, rec in enumerate(self.recs):
            lo, hi = first[g], first[g + 1]
            if damaged[g] or bounds[g] == bounds[g + 1]:
                out.append(_empty(damaged[g], lo))
                continue
            a, b = cut[g], cut[g + 1]
            scope = scopes[a:b].copy()
            comm_pids = {c.pid for c in rec.communicators}
            pids = tuple(p for p in scope[used[a:b]].tolist() if p not in comm_pids)
            mine = slice(lo - at, hi - at)
            members = (
                _members(raw, sel[mine], foreign[mine], hashes[mine], scope, self.index)
                if foreigners[g]
                else ()
            )
            out.append(
                Staged(
                    slice(lo, hi), False, latest[g], scope, pids, members,
                    waiting.get(g, ()), held[g], entered.get(g, ()),
                )
            )  # fmt: skip
        return out

    def _fill_unknown(self, hashes: np.ndarray, group: np.ndarray, sel: np.ndarray) -> None:
        """Calls whose row carries no comm hash: their process's comm table
        gives it by pointer (0 when it is not there; of a pointer listed
        twice, the later entry), one search for the whole batch."""
        unknown = np.flatnonzero(hashes == 0)
        d = self.d
        if not len(unknown) or not len(d.comm_group):
            return
        raw, g = d.raw, group[unknown].astype(np.uint64)
        a = self.scope_start[group[unknown]] + self.index[sel[unknown]]
        pids, comms = self.scope_keys[a] & _LOW, raw["comm"][sel[unknown]]
        table = _triple_key(d.comm_group, d.comm_pid, d.comm_ptr)
        order = np.argsort(table, kind="stable")
        pos = np.searchsorted(table[order], _triple_key(g, pids, comms), side="right") - 1
        at = order[np.maximum(pos, 0)]
        hit = (pos >= 0) & (d.comm_group[at] == g) & (d.comm_pid[at] == pids)
        hit &= d.comm_ptr[at] == comms
        hashes[unknown] = np.where(hit, d.comm_hash[at], np.uint64(0))
        # a key two entries share by chance (a 64-bit mix): looked up exactly
        odd = ~hit & (pos >= 0) & (table[at] == _triple_key(g, pids, comms))
        for i in np.flatnonzero(odd).tolist():
            rec = self.recs[int(g[i])]
            hashes[unknown[i]] = hash_by_pointer(rec, pids[i : i + 1], comms[i : i + 1])[0]

    def _held(self) -> list[np.ndarray | None]:
        """Per dump, its long calls (``held_calls``)."""
        raw, d = self.d.raw, self.d
        keep = WAITS_IN[raw["op"]] & self.inside
        out, sel = _held_rows(raw, keep)
        cut = np.searchsorted(d.group[sel], np.arange(len(self.recs) + 1, dtype=np.uint64))
        return [out[cut[g] : cut[g + 1]] for g in range(len(self.recs))]

    def _latest(
        self,
    ) -> tuple[dict[int, tuple[tuple[int, int, int], ...]], dict[int, tuple[tuple[int, int], ...]]]:
        """Per dump: (pid, op, entered) of each process of its scope whose
        latest call (a group's end included) had not returned; (pid,
        entered) of each one's latest call of any kind."""
        raw = self.d.raw
        waits = WAITS_IN[raw["op"]] & ~self.d.captured & self.inside
        last = self._latest_per_pid(np.flatnonzero(waits))
        last = last[raw["end_ns"][last] == 0]
        waiting: dict[int, list[tuple[int, int, int]]] = {}
        for g, p, o, t in zip(
            self.d.group[last].tolist(),
            raw["pid"][last].tolist(),
            raw["op"][last].tolist(),
            raw["ts_ns"][last].tolist(),
            strict=True,
        ):
            waiting.setdefault(g, []).append((p, o, t))
        entered: dict[int, list[tuple[int, int]]] = {}
        last = self._latest_per_pid(np.flatnonzero(self.inside))
        for g, p, t in zip(
            self.d.group[last].tolist(),
            raw["pid"][last].tolist(),
            raw["ts_ns"][last].tolist(),
            strict=True,
        ):
            entered.setdefault(g, []).append((p, t))
        return (
            {g: tuple(v) for g, v in waiting.items()},
            {g: tuple(v) for g, v in entered.items()},
        )

    def _latest_per_pid(self, sel: np.ndarray) -> np.ndarray:
        """Of the rows ``sel`` (of processes in scope), each (dump, pid)'s
        latest entry (the last row of the latest time), by dump and pid:
        two passes over the rows, no sort (the scope's slots number them)."""
        if not len(sel):
            return sel
        ts = self.d.raw["ts_ns"][sel]
        slot = self.scope_start[self.d.group[sel].astype(np.int64)] + self.index[sel]
        latest = np.zeros(len(self.scope_keys), dtype=ts.dtype)
        np.maximum.at(latest, slot, ts)
        at = ts == latest[slot]
        last = np.full(len(self.scope_keys), -1, dtype=np.int64)
        np.maximum.at(last, slot[at], sel[at])
        out: np.ndarray = last[last >= 0]
        return out


def held_calls(raw: np.ndarray, in_scope: np.ndarray) -> np.ndarray:
    """The calls of ``raw`` (a window, or a whole ring) of processes
    ``in_scope`` that took HELD_NS and more, a group's end included: a stall
    the job came back from, however long ago (HELD_DTYPE, "proc" a pid)."""
    return _held_rows(raw, WAITS_IN[raw["op"]] & in_scope)[0]


def _held_rows(raw: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    sel = np.flatnonzero(keep & (raw["end_ns"] > 0))
    sel = sel[(raw["end_ns"][sel] - raw["ts_ns"][sel]).astype(np.int64) >= HELD_NS]
    out = np.zeros(len(sel), dtype=HELD_DTYPE)
    out["proc"], out["hash"], out["seq"] = raw["pid"][sel], raw["comm_hash"][sel], raw["seq"][sel]
    out["op"], out["ts"], out["end"] = raw["op"][sel], raw["ts_ns"][sel], raw["end_ns"][sel]
    return out, sel


def _empty(damaged: bool, at: int) -> Staged:
    return Staged(slice(at, at), damaged, None, NO_PIDS, (), (), (), None, ())


def _segment_max(values: np.ndarray, counts: np.ndarray) -> list[int | None]:
    """The largest of each run of ``counts`` values (None for an empty run)."""
    out: list[int | None] = [None] * len(counts)
    nonempty = np.flatnonzero(counts)
    if len(nonempty):
        starts = np.r_[0, np.cumsum(counts)][nonempty]
        for g, m in zip(
            nonempty.tolist(), np.maximum.reduceat(values, starts).tolist(), strict=True
        ):
            out[g] = int(m)
    return out


def _members(
    raw: np.ndarray,
    rows: np.ndarray,
    foreign: np.ndarray,
    hashes: np.ndarray,
    scope: np.ndarray,
    index: np.ndarray,
) -> tuple[tuple[int, int, int, int], ...]:
    """(comm_hash, pid, rank, nranks) of a dump's calls on communicators its
    table lacks (whose init the recorder never saw)."""
    if not foreign.any():
        return ()
    rank = raw["rank"][rows]
    foreign = foreign & (hashes != 0) & (rank >= 0)
    nranks = raw["nranks"][rows][foreign]
    pids = scope[index[rows][foreign]]
    keys = np.unique(np.rec.fromarrays([hashes[foreign], pids, rank[foreign], nranks]))
    return tuple((int(h), int(p), int(r), int(nr)) for h, p, r, nr in keys.tolist())


_M1, _M2, _M3 = (np.uint64(k) for k in (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9))


def _triple_key(group: np.ndarray, pid: np.ndarray, comm: np.ndarray) -> np.ndarray:
    """One uint64 per (dump, pid, communicator pointer): a mix, checked after."""
    with np.errstate(over="ignore"):
        key: np.ndarray = (group.astype(np.uint64) * _M3) ^ (pid.astype(np.uint64) * _M1)
        key ^= comm.astype(np.uint64) * _M2
    return key


_POINTER = np.dtype([("pid", "<u8"), ("comm", "<u8")])


def hash_by_pointer(rec: Recording, pids: np.ndarray, comms: np.ndarray) -> np.ndarray:
    """The comm hash of each (pid, comm pointer) in the process's comm table
    (0 when it is not there), looked up once per distinct pair, not per row."""
    ptr = {(c.pid, c.comm): c.comm_hash for c in rec.communicators}
    pairs = np.empty(len(pids), dtype=_POINTER)
    pairs["pid"], pairs["comm"] = pids, comms
    distinct, which = np.unique(pairs.view("V16"), return_inverse=True)
    found = [ptr.get(pair, 0) for pair in distinct.view(_POINTER).tolist()]
    out: np.ndarray = np.array(found, dtype=np.uint64)[which.ravel()]
    return out


def _device_timeline(d: Dumps, keep: np.ndarray) -> dict[str, np.ndarray]:
    """Calls of processes whose device side was observed (any call of theirs
    in their dump seen completed: the CUDA probes), on the device's
    timeline: entered when the device started them, returned when it
    completed them (0: still running there).  A call the device never
    reached is left out (``keep``): at a hang, the rank whose device stopped
    is the one that never "entered".  A call seen completed but not started
    keeps its host entry.  Other processes keep their host times.  Updates
    ``keep``; returns ts and end, and how long each call waited on its
    device's queue (its host's entry to the device's start)."""
    raw = d.raw
    done = raw["completed_ns"] > 0
    if not done.any():
        return {}
    pids = d.keys(raw["pid"])
    gpu = member(pids, np.unique(pids[done])) & keep
    started = raw["started_ns"] > 0
    ts = np.where(gpu & started, raw["started_ns"], raw["ts_ns"]).astype(np.int64)
    end = np.where(gpu, raw["completed_ns"], raw["end_ns"]).astype(np.int64)
    keep &= ~(gpu & ~started & ~done)
    device = gpu & started
    queued = np.where(device, ts - raw["ts_ns"].astype(np.int64), 0).clip(min=0)
    return {"ts": ts, "end": end, "device": device.astype(np.uint8), "queued": queued}

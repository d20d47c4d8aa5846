"""Stage "align": turn the dumps of one incident into one ``Incident``.

Each node's dump holds its own processes, communicators and rings; this stage
joins them: one proc per (host, pid), communicators with their members in
comm-rank order (split communicators whose ranks were not recorded get them
derived the way NCCL does: members ordered by (key, rank in the parent)),
world ranks (rank in the largest non-split communicator a process belongs to),
and one columnar table of calls.  A ring that overwrote rows marks its procs'
windows as incomplete, so that a seq older than what a rank retained is
"unknown", never "missing".

Inputs are sorted by host first, so the result does not depend on the order
in which files were given.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from dumpers.model import CommInfo, Recording
from dumpers.schema import NCCL_EVENT, ExitEvent, Op, TcpEvent

from .match import order_calls
from .model import CALL_DTYPE, SCHED_DTYPE, TCP_RETRANS_DTYPE, Comm, Incident, Proc

IS_CALL = np.zeros(256, dtype=bool)  # op -> is a collective or p2p call
IS_CALL[[int(op) for op in Op if op.is_collective or op.is_p2p]] = True


@dataclass(frozen=True, slots=True)
class Source:
    path: str
    recording: Recording


SCOPED_RINGS = ("nccl", "sched", "exit")


def in_scope(rec: Recording, consume: bool = False) -> Recording:
    """The recording without rows of processes its agent does not list: an
    agent's process table is its scope (one node), whatever leaked past it.
    With ``consume``, rings replaced by a filtered copy leave the original."""
    scope = np.array(
        sorted({p.pid for p in rec.processes} | {c.pid for c in rec.communicators}), dtype=np.uint32
    )
    if not len(scope):
        return rec
    rings = dict(rec.rings)
    for name in SCOPED_RINGS:
        ring = rings.get(name)
        if ring is None or not len(ring.rows):
            continue
        keep = np.isin(ring.rows["pid"], scope)
        if not keep.all():
            rings[name] = dataclasses.replace(ring, rows=ring.rows[keep])
            if consume:
                rec.rings.pop(name, None)
    if all(rings[k] is rec.rings.get(k) for k in rings):
        return rec  # nothing out of scope: the same recording, not a copy
    return dataclasses.replace(rec, rings=rings)


def incident_from_recordings(
    incident_id: str, sources: list[Source], consume: bool = False
) -> Incident:
    """One incident from its dumps.  With ``consume`` the recordings' nccl
    rings are released as they are read (the caller gives them up)."""
    sources = [Source(s.path, in_scope(s.recording, consume)) for s in sources]
    sources = sorted(sources, key=lambda s: (s.recording.host, s.path))
    hosts = tuple(sorted({s.recording.host for s in sources}))
    procs, proc_index = _procs(sources)
    comms, membership = _comms(sources, proc_index)
    procs = _with_world_ranks(procs, comms)
    calls = _calls(sources, proc_index, comms, membership, consume)
    return Incident(
        id=incident_id,
        hosts=hosts,
        host_now=tuple(_host_now(sources, h) for h in hosts),
        procs=tuple(procs),
        comms=tuple(comms),
        calls=order_calls(calls, np.array([c.nranks for c in comms], dtype=np.int64)),
        retransmits=_retransmits(sources, hosts),
        sched=_sched(sources, hosts),
        sources=tuple(s.path for s in sources),
    )


def _host_now(sources: list[Source], host: str) -> int | None:
    times = []
    for s in sources:
        rec = s.recording
        if rec.host != host:
            continue
        if rec.trigger is not None and rec.trigger.time_ns > 0:
            times.append(rec.trigger.time_ns)
        elif "nccl" in rec.rings and len(rec.rings["nccl"].rows):
            rows = rec.rings["nccl"].rows
            times.append(int(max(rows["ts_ns"].max(), rows["end_ns"].max())))
    return max(times) if times else None


def _exit_status(rec: Recording) -> dict[int, tuple[int | None, int | None]]:
    """(exit code, fatal signal) per pid: the process table's when it has one,
    else the exit ring's.  exit_group() kills the other threads with SIGKILL:
    a signal row after an exit_group row of the same pid is not a death cause."""
    status: dict[int, tuple[int | None, int | None]] = {}
    ring = rec.rings.get("exit")
    if ring is not None and len(ring.rows):
        rows = ring.rows[np.argsort(ring.rows["ts_ns"], kind="stable")]
        for pid, event, code, sig in rows[["pid", "event", "code", "signal"]].tolist():
            old_code, old_sig = status.get(pid, (None, None))
            if event == ExitEvent.EXIT_GROUP and old_code is None and old_sig is None:
                status[pid] = (int(code), None)
            elif event == ExitEvent.SIGNAL and sig > 0 and old_code is None and old_sig is None:
                status[pid] = (None, int(sig))
    for p in rec.processes:
        if p.exit_code is not None or p.exit_signal is not None:
            status[p.pid] = (p.exit_code, p.exit_signal)
    return status


def _procs(sources: list[Source]) -> tuple[list[Proc], dict[tuple[str, int], int]]:
    procs: list[Proc] = []
    index: dict[tuple[str, int], int] = {}
    for s in sources:
        rec = s.recording
        ring = rec.rings.get("nccl")
        complete = ring is None or ring.overwritten == 0
        pids = {c.pid for c in rec.communicators}
        if ring is not None and len(ring.rows):
            calls = IS_CALL[ring.rows["op"]]
            pids.update(int(p) for p in np.unique(ring.rows["pid"][calls]))
        status = _exit_status(rec)
        for pid in sorted(pids):
            key = (rec.host, pid)
            if key in index:
                continue
            code, sig = status.get(pid, (None, None))
            index[key] = len(procs)
            procs.append(Proc(rec.host, pid, -1, s.path, code, sig, complete))
    return procs, index


def _comms(
    sources: list[Source], proc_index: dict[tuple[str, int], int]
) -> tuple[list[Comm], dict[tuple[int, int], int]]:
    """Communicators and a map (proc, comm_hash) -> comm rank."""
    infos: dict[int, list[tuple[int, CommInfo]]] = defaultdict(list)
    for s in sources:
        for ci in s.recording.communicators:
            if ci.comm_hash:
                infos[ci.comm_hash].append((proc_index[(s.recording.host, ci.pid)], ci))
    for rows_hash, proc, rank, nranks in _row_members(sources, proc_index):
        if rows_hash not in infos or not any(p == proc for p, _ in infos[rows_hash]):
            infos[rows_hash].append((proc, CommInfo(0, 0, rows_hash, rank, nranks)))
    known: dict[tuple[int, int], int] = {}
    for h, lst in infos.items():
        for p, ci in lst:
            if ci.rank >= 0:
                known[(p, h)] = ci.rank
    comms: list[Comm] = []
    membership: dict[tuple[int, int], int] = {}
    for h in sorted(infos):
        members = _members(infos[h], known)
        split = any(ci.parent_hash for _, ci in infos[h])
        comms.append(Comm(h, tuple(members), is_split=split))
        for r, p in enumerate(members):
            if p >= 0:
                membership[(p, h)] = r
    return comms, membership


def _members(lst: list[tuple[int, CommInfo]], known: dict[tuple[int, int], int]) -> list[int]:
    nranks = max(ci.nranks for _, ci in lst)
    if all(ci.rank >= 0 for _, ci in lst):
        size = max(nranks, max(ci.rank for _, ci in lst) + 1)
        members = [-1] * size
        for p, ci in sorted(lst, key=lambda x: x[0]):
            if members[ci.rank] == -1:
                members[ci.rank] = p
        return members

    # ncclCommSplit: new ranks ordered by (key, rank in the parent), as NCCL does.
    def order(item: tuple[int, CommInfo]) -> tuple[int, int, int]:
        p, ci = item
        return (ci.key, known.get((p, ci.parent_hash), 1 << 30), p)

    uniq = {p: ci for p, ci in lst}
    return [p for p, _ in sorted(uniq.items(), key=order)]


def _row_members(
    sources: list[Source], proc_index: dict[tuple[str, int], int]
) -> list[tuple[int, int, int, int]]:
    """(comm_hash, proc, rank, nranks) seen in call rows, for comms whose init
    the recorder never saw."""
    out: list[tuple[int, int, int, int]] = []
    for s in sources:
        ring = s.recording.rings.get("nccl")
        if ring is None or not len(ring.rows):
            continue
        known = np.array(sorted({c.comm_hash for c in s.recording.communicators}), dtype=np.uint64)
        raw = ring.rows
        hashes = raw["comm_hash"]
        # the common case is one comm per process table: no isin then
        sel = hashes != known[0] if len(known) == 1 else ~np.isin(hashes, known)
        sel &= (hashes != 0) & (raw["rank"] >= 0)
        if not sel.any():
            continue
        rows = raw[sel]
        rows = rows[IS_CALL[rows["op"]]]
        keys = np.unique(rows[["comm_hash", "pid", "rank", "nranks"]])
        for h, pid, rank, nranks in keys.tolist():
            proc = proc_index.get((s.recording.host, int(pid)))
            if proc is not None:
                out.append((int(h), proc, int(rank), int(nranks)))
    return out


def _with_world_ranks(procs: list[Proc], comms: list[Comm]) -> list[Proc]:
    best: dict[int, tuple[int, int, int]] = {}
    for c in comms:
        if c.is_split:
            continue
        for r, p in enumerate(c.members):
            cand = (-c.nranks, c.comm_hash, r)
            if p >= 0 and (p not in best or cand < best[p]):
                best[p] = cand
    return [
        dataclasses.replace(proc, world_rank=best[i][2] if i in best else -1)
        for i, proc in enumerate(procs)
    ]


@dataclass(frozen=True, slots=True)
class _RankTable:
    """(proc, comm index) -> comm rank: a dense table when it is small enough,
    else sorted keys for searchsorted."""

    ncomms: int
    dense: np.ndarray | None
    keys: np.ndarray
    vals: np.ndarray

    @classmethod
    def build(
        cls, nprocs: int, hashes: np.ndarray, membership: dict[tuple[int, int], int]
    ) -> _RankTable:
        n = len(hashes)
        procs = np.array([p for p, _ in membership], dtype=np.int64)
        comms = np.searchsorted(hashes, np.array([h for _, h in membership], dtype=np.uint64))
        vals = np.array(list(membership.values()), dtype=np.int64)
        if nprocs * max(n, 1) <= DENSE_TABLE_MAX:
            dense = np.full((max(nprocs, 1), max(n, 1)), -1, dtype=np.int64)
            dense[procs, comms] = vals
            return cls(n, dense, np.zeros(0, np.int64), np.zeros(0, np.int64))
        keys = procs * (n + 1) + comms
        order = np.argsort(keys)
        return cls(n, None, keys[order], vals[order])

    def lookup(self, proc: np.ndarray, comm: np.ndarray) -> np.ndarray:
        if self.dense is not None:
            return np.asarray(self.dense[proc, np.minimum(comm, self.dense.shape[1] - 1)])
        if not len(self.keys):
            return np.full(len(proc), -1, dtype=np.int64)
        k = proc * (self.ncomms + 1) + comm
        pos = np.clip(np.searchsorted(self.keys, k), 0, len(self.keys) - 1)
        return np.where(self.keys[pos] == k, self.vals[pos], -1)


DENSE_TABLE_MAX = 16 << 20  # entries (8 bytes each) of the dense (proc, comm) -> rank table


def _calls(
    sources: list[Source],
    proc_index: dict[tuple[str, int], int],
    comms: list[Comm],
    membership: dict[tuple[int, int], int],
    consume: bool,
) -> np.ndarray:
    hashes = np.array([c.comm_hash for c in comms], dtype=np.uint64)
    table = _RankTable.build(len(proc_index), hashes, membership)
    total = sum(len(s.recording.rings["nccl"].rows) for s in sources if "nccl" in s.recording.rings)
    out = np.empty(total, dtype=CALL_DTYPE)  # filled in place: no list of parts to join
    n = 0
    for s in sources:
        ring = s.recording.rings.get("nccl")
        if ring is None or not len(ring.rows):
            continue
        n += _calls_of(s, ring.rows, proc_index, hashes, table, out[n:])
        if consume:  # the caller gave the recordings up: free each ring once read
            s.recording.rings.pop("nccl", None)
    return out[:n]


def _calls_of(
    s: Source,
    raw: np.ndarray,
    proc_index: dict[tuple[str, int], int],
    hashes: np.ndarray,
    table: _RankTable,
    out: np.ndarray,
) -> int:
    """Write the source's calls at the head of ``out``; return how many."""
    rec = s.recording
    if raw.dtype != NCCL_EVENT:
        raw = raw.astype(NCCL_EVENT)
    is_call = IS_CALL[raw["op"]]
    every = bool(is_call.all())
    comm_hash = raw["comm_hash"] if every else raw["comm_hash"][is_call]
    unknown = comm_hash == 0
    if unknown.any():  # fill from the process's comm table by pointer
        comm_hash = comm_hash.copy()
        ptr = {(c.pid, c.comm): c.comm_hash for c in rec.communicators}
        calls = raw[is_call]
        pid_comm = zip(calls["pid"][unknown].tolist(), calls["comm"][unknown].tolist(), strict=True)
        comm_hash[unknown] = [ptr.get(k, 0) for k in pid_comm]
    pids, inv = np.unique(raw["pid"] if every else raw["pid"][is_call], return_inverse=True)
    proc = np.array([proc_index[(rec.host, int(p))] for p in pids], dtype=np.int64)[inv]
    pos, ok = _comm_index(hashes, comm_hash)
    crank = table.lookup(proc, pos)
    crank = np.where(crank >= 0, crank, raw["rank"] if every else raw["rank"][is_call])
    keep = ok & (crank >= 0)
    n = int(keep.sum())
    dst = out[:n]
    whole = every and n == len(raw)  # the common case: plain strided copies, no gathers
    sel = slice(None) if whole else np.flatnonzero(is_call)[keep]
    dst["comm"] = pos if whole else pos[keep]
    dst["crank"] = crank if whole else crank[keep]
    dst["proc"] = proc if whole else proc[keep]
    for name, src in CALL_FIELDS:
        dst[name] = raw[src][sel]
    return n


def _comm_index(hashes: np.ndarray, comm_hash: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Index of each row's communicator, and whether it is known."""
    if not len(hashes):
        return np.zeros(len(comm_hash), dtype=np.int64), np.zeros(len(comm_hash), dtype=bool)
    if len(comm_hash) and (comm_hash == comm_hash[0]).all():  # one comm: no per-row search
        i = int(np.searchsorted(hashes, comm_hash[0]))
        known = i < len(hashes) and hashes[i] == comm_hash[0]
        pos = np.full(len(comm_hash), min(i, len(hashes) - 1), dtype=np.int64)
        return pos, np.full(len(comm_hash), known, dtype=bool)
    pos = np.clip(np.searchsorted(hashes, comm_hash), 0, len(hashes) - 1)
    return pos, hashes[pos] == comm_hash


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
)


def _addr_keys(addrs: np.ndarray) -> np.ndarray:
    """16-byte addresses as one comparable 128-bit void scalar each."""
    return np.ascontiguousarray(addrs).view("V16").ravel()


AF_INET = 2
V4_MAPPED = np.array([0] * 10 + [0xFF, 0xFF], dtype=np.uint8)
V6_LOOPBACK = np.array([0] * 15 + [1], dtype=np.uint8)


def _loopback(addrs: np.ndarray, family: np.ndarray) -> np.ndarray:
    """Per row: 127.0.0.0/8, ::1 or ::ffff:127.0.0.0/104 (IPv4 addresses
    fill the first 4 of the 16 bytes)."""
    v4 = (family == AF_INET) & (addrs[:, 0] == 127)
    mapped = (addrs[:, :12] == V4_MAPPED).all(axis=1) & (addrs[:, 12] == 127)
    one = (addrs == V6_LOOPBACK).all(axis=1) & (family != AF_INET)
    out: np.ndarray = v4 | mapped | one
    return out


def _own_address(rec: Recording) -> bytes | None:
    """The host's address: the commonest non-loopback source address of
    connections its ranks own (the owner attribution is not perfect)."""
    ring = rec.rings.get("tcp")
    if ring is None or not len(ring.rows):
        return None
    ranks = np.array(sorted({c.pid for c in rec.communicators}), dtype=np.uint32)
    rows = ring.rows[np.isin(ring.rows["pid"], ranks)]
    rows = rows[~_loopback(rows["saddr"], rows["family"])]
    if not len(rows):
        return None
    keys, counts = np.unique(_addr_keys(rows["saddr"]), return_counts=True)
    return bytes(keys[int(np.argmax(counts))].tobytes())


def _retransmits(sources: list[Source], hosts: tuple[str, ...]) -> np.ndarray:
    """Retransmits on connections between two hosts' own addresses (the
    nodes of rank processes): never loopback, never both ends on one host.
    Duplicates of one event seen by two agents are counted once."""
    owner: dict[bytes, int] = {}
    for s in sources:
        addr = _own_address(s.recording)
        if addr is not None:
            owner.setdefault(addr, hosts.index(s.recording.host))
    seen: set[tuple[bytes, int, bytes, int, int]] = set()
    out = []
    for s in sources:
        ring = s.recording.rings.get("tcp")
        if ring is None or not len(ring.rows):
            continue
        rows = ring.rows[ring.rows["event"] == TcpEvent.TCP_RETRANSMIT_SKB]
        fam = rows["family"]
        rows = rows[~(_loopback(rows["saddr"], fam) | _loopback(rows["daddr"], fam))]
        h = hosts.index(s.recording.host)
        src, dst = _addr_keys(rows["saddr"]).tolist(), _addr_keys(rows["daddr"]).tolist()
        for i in range(len(rows)):
            a, b = bytes(src[i]), bytes(dst[i])
            local, remote = owner.get(a, -1), owner.get(b, -1)
            key = (a, int(rows["sport"][i]), b, int(rows["dport"][i]), int(rows["ts_ns"][i]))
            if local < 0 or remote < 0 or local == remote or key in seen:
                continue
            seen.add(key)
            out.append((h, int(rows["pid"][i]), int(rows["ts_ns"][i]), local, remote))
    return np.array(out, dtype=TCP_RETRANS_DTYPE) if out else np.zeros(0, TCP_RETRANS_DTYPE)


def _sched(sources: list[Source], hosts: tuple[str, ...]) -> np.ndarray:
    out = []
    for s in sources:
        ring = s.recording.rings.get("sched")
        if ring is None or not len(ring.rows):
            continue
        t = np.empty(len(ring.rows), dtype=SCHED_DTYPE)
        t["host"] = hosts.index(s.recording.host)
        t["pid"] = ring.rows["pid"]
        t["ts"] = ring.rows["ts_ns"].astype(np.int64)
        t["delay"] = ring.rows["delay_ns"].astype(np.int64)
        out.append(t)
    return np.concatenate(out) if out else np.zeros(0, dtype=SCHED_DTYPE)

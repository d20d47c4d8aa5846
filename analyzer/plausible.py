"""Stage "plausibility": NCCL rows the recorder cannot write, and Flight
Recorder files that say what torch cannot have written.

A dump whose checksums matched (format version 6) holds what its agent
wrote; an older dump, or a recorder gone wrong, may hold anything.  Before a
ring's rows are used they are checked for values no agent writes:

- an op or lifecycle state the probes never set, a result NCCL never
  returns, a comm rank outside its communicator's size;
- a datatype NCCL does not know, or a count of more bytes than any buffer
  holds (``MAX_BYTES``), on a call that did not fail (NCCL refuses both);
  bytes other than the count times the datatype's size (the probe writes
  one from the other: a count or a datatype changed alone breaks it);
- a time outside the dump's window: after the dump read its rings (beyond
  ``CLOCK_SLACK_NS``), a return before its entry;
- a communicator's calls out of order: on one process and communicator,
  each collective's seq is one more than the one before (more only where
  the kernel lost rows), so a seq that goes backwards, repeats or jumps is
  damage; a communicator pointer whose calls carry a hash its process's
  table does not give it;
- a thread whose calls name two processes (a thread never moves).

A row that fails any of them makes the dump *damaged*: it is left out as a
lost dump, and its ranks are judged from their peers' records only.  Why
the whole dump and not the row: what breaks one field of a row breaks
others the rules cannot see (an op turned into another op, a count into
another count: a desync that never was), and a row left out alone leaves a
hole where its rank looks behind its peers.  Nothing here is a verdict.

Known limits: damage that yields values the recorder can write (another op,
another count, a time inside the window) passes: only checksums find it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from stallwatch.dumpers.model import Recording
from stallwatch.dumpers.schema import DATATYPE_SIZE, Op, Result, State, captured_rows

from .flightrec import FrDump

U64_MAX = (1 << 64) - 1
MAX_BYTES = 1 << 48  # 256 TiB: more than any device or host buffer holds
CLOCK_SLACK_NS = 1_000_000_000  # rows timed after the dump's clock was read, at most

KNOWN_OP = np.zeros(256, dtype=bool)
KNOWN_OP[[int(op) for op in Op if op is not Op.UNKNOWN]] = True
COLLECTIVE = np.zeros(256, dtype=bool)
COLLECTIVE[[int(op) for op in Op if op.is_collective]] = True
TAKES_DATA = COLLECTIVE.copy()
TAKES_DATA[[int(Op.SEND), int(Op.RECV)]] = True
PEERED = np.zeros(256, dtype=bool)  # ops whose peer column is a rank: the peer, or the root
PEERED[[int(Op.SEND), int(Op.RECV), int(Op.BROADCAST), int(Op.REDUCE), int(Op.GATHER),
        int(Op.SCATTER)]] = True  # fmt: skip
TYPE_SIZE = np.zeros(256, dtype=np.uint64)  # 0: a datatype NCCL does not know
TYPE_SIZE[list(DATATYPE_SIZE)] = list(DATATYPE_SIZE.values())
STATES = max(State) + 1
RESULTS = (int(Result.PENDING), int(max(Result)))


class Dumps:
    """The NCCL windows of several dumps, one after another, as the rules
    read them: ``group`` says whose (0 to n-1) each row of ``raw`` is, and per
    dump, its clock (0: none), its lost rows, its scope (the pids of its
    tables: ``scope_keys`` holds group << 32 | pid, sorted; a dump without
    any has none) and its communicator table.  The rules run over all their
    rows at once: a few dozen numpy passes in all, not a few dozen per dump
    (2,048-row windows of 16,384 dumps spent 30 s in those calls)."""

    __slots__ = ("bounds", "captured", "comm_group", "comm_hash", "comm_pid", "comm_ptr",
                 "group", "has_scope", "late", "lost", "raw", "scope_keys", "timed")  # fmt: skip

    def __init__(
        self,
        raw: np.ndarray,
        bounds: np.ndarray,
        recs: Sequence[Recording],
        lost: Sequence[int],
        scopes: Sequence[np.ndarray],
    ) -> None:
        n = len(recs)
        self.raw = raw
        self.captured = captured_rows(raw)  # read by several rules and stages: once
        self.bounds = bounds
        self.group = np.repeat(np.arange(n, dtype=np.uint64), np.diff(bounds))
        # a dump's clock: its rows cannot be timed after it read its rings
        now = [r.clock.monotonic_ns for r in recs]
        self.timed = np.array([t > 0 for t in now], dtype=bool)
        self.late = np.array([min(t + CLOCK_SLACK_NS, U64_MAX) for t in now], dtype=np.uint64)
        self.lost = np.array(lost, dtype=np.int64)
        self.has_scope = np.array([len(sc) > 0 for sc in scopes], dtype=bool)
        self.scope_keys = group_keys([np.asarray(sc, dtype=np.uint64) for sc in scopes])
        comms = [(g, c) for g, r in enumerate(recs) for c in r.communicators]
        self.comm_group = np.array([g for g, _ in comms], dtype=np.uint64)
        self.comm_pid = np.array([c.pid for _, c in comms], dtype=np.uint64)
        self.comm_ptr = np.array([c.comm for _, c in comms], dtype=np.uint64)
        self.comm_hash = np.array([c.comm_hash for _, c in comms], dtype=np.uint64)

    def keys(self, values: np.ndarray) -> np.ndarray:
        """group << 32 | value of each row (values of 32 bits: pids, tids)."""
        return keyed(self.group, values)


def keyed(group: np.ndarray, values: np.ndarray) -> np.ndarray:
    out: np.ndarray = (group.astype(np.uint64, copy=False) << np.uint64(32)) | values.astype(
        np.uint64, copy=False
    )
    return out


def group_keys(values: Sequence[np.ndarray]) -> np.ndarray:
    """group << 32 | value of each group's values (sorted within each, of 32
    bits), one array: sorted."""
    if not values:
        return np.zeros(0, dtype=np.uint64)
    sizes = [len(v) for v in values]
    group = np.repeat(np.arange(len(values), dtype=np.uint64), sizes)
    flat = np.concatenate(values) if sum(sizes) else np.zeros(0, dtype=np.uint64)
    return keyed(group, flat)


def member(values: np.ndarray, known: np.ndarray) -> np.ndarray:
    """Per value: whether it is in ``known`` (sorted)."""
    if not len(known):
        return np.zeros(len(values), dtype=bool)
    pos = np.searchsorted(known, values)
    np.minimum(pos, len(known) - 1, out=pos)
    found: np.ndarray = known[pos] == values
    return found


def pair_member(
    group: np.ndarray, values: np.ndarray, known_group: np.ndarray, known: np.ndarray
) -> np.ndarray:
    """Per row: whether (group, value) is one of the (known_group, known)
    pairs (values of 64 bits, exactly: each is first numbered among the
    known ones)."""
    if not len(known):
        return np.zeros(len(values), dtype=bool)
    distinct = np.unique(known)
    pos = np.searchsorted(distinct, values)
    np.minimum(pos, len(distinct) - 1, out=pos)
    hit = distinct[pos] == values
    table = np.unique(keyed(known_group, np.searchsorted(distinct, known)))
    found: np.ndarray = hit & member(keyed(group, pos), table)
    return found


RULE_MOVED = "a thread that names another process"


def rule_masks(d: Dumps) -> list[tuple[np.ndarray, str]]:
    """Per rule, the rows of ``d`` that break it (of each dump, only rows of
    its scope are judged, but for a thread found under another pid)."""
    raw = d.raw
    ours = ~d.has_scope[d.group] | member(d.keys(raw["pid"]), d.scope_keys)
    found = [(mask & ours, text) for mask, text in (*_field_rules(d), *_stream_rules(d, ours))]
    found.append((_moved_thread(d), RULE_MOVED))
    return found


def implausible(
    raw: np.ndarray, rec: Recording, lost: int = 0, scope: np.ndarray | None = None
) -> tuple[np.ndarray, list[str]]:
    """Per row of NCCL ``raw`` (a window of ``rec``'s ring, oldest first):
    whether the recorder could not have written it; and, per rule broken,
    one example for people.  ``lost``: rows the kernel could not record
    (seq may jump over them).  ``scope``: the pids of the agent's tables
    (sorted); rows of other processes (another job's, leaked into the ring)
    are no business of the analysis and are not judged, but for a thread
    of the job's found under another pid."""
    bad = np.zeros(len(raw), dtype=bool)
    why: list[str] = []
    if not len(raw):
        return bad, why
    none = np.zeros(0, dtype=np.uint32)
    dumps = Dumps(raw, np.array([0, len(raw)]), [rec], [lost], [none if scope is None else scope])
    for full, text in rule_masks(dumps):
        if full.any():
            bad |= full
            why.append(_example(raw, full, text))
    return bad, why


def _example(raw: np.ndarray, mask: np.ndarray, text: str) -> str:
    i = int(np.flatnonzero(mask)[0])
    n = int(np.count_nonzero(mask))
    more = f", {n - 1} more" if n > 1 else ""
    return f"{text} (pid {int(raw['pid'][i])} seq {int(raw['seq'][i])}{more})"


def _field_rules(d: Dumps) -> list[tuple[np.ndarray, str]]:
    raw = d.raw
    op = raw["op"]
    ok = raw["result"] == 0
    flying = raw["end_ns"] == 0
    accepted = ok | flying  # NCCL checks its arguments before it returns
    data = TAKES_DATA[op]
    size = TYPE_SIZE[raw["datatype"]]
    nranks, rank = raw["nranks"], raw["rank"]
    out = [
        (~KNOWN_OP[op], "an op no probe writes"),
        (raw["state"] >= STATES, "a lifecycle state no probe writes"),
        ((raw["result"] < RESULTS[0]) | (raw["result"] > RESULTS[1]),
         "a result NCCL never returns"),
        (data & accepted & (size == 0), "a datatype NCCL does not know, on a call it took"),
        (data & accepted & (size > 0) & (raw["count"] > MAX_BYTES // np.maximum(size, 1)),
         f"a count of more than {MAX_BYTES >> 40} TiB, on a call NCCL took"),
        (data & (size > 0) & (raw["bytes"] != raw["count"] * size),
         "bytes other than the count times the datatype's size"),
        ((nranks > 0) & ((rank < -1) | (rank >= nranks)), "a rank outside its communicator"),
        ((nranks > 0) & PEERED[op] & accepted & ((raw["peer"] < 0) | (raw["peer"] >= nranks)),
         "a peer or root outside its communicator, on a call NCCL took"),
    ]  # fmt: skip
    if d.timed.any():  # a dump's clock: rows cannot be timed after it read its rings
        late = d.late[d.group]
        times = raw["ts_ns"] > late
        for name in ("end_ns", "started_ns", "completed_ns"):
            times |= raw[name] > late
        out.append((times & d.timed[d.group], "a time after the dump read its rings"))
    out.append(((raw["ts_ns"] == 0) | (~flying & (raw["end_ns"] < raw["ts_ns"])),
                "a return before its entry"))  # fmt: skip
    # started and completed are when probes saw them, and two probes racing on
    # two threads can stamp a start a little after a completion (a lab job's
    # stopped device did): only a completion seen before the call was made is
    # beyond the recorder (the row exists from the call's entry)
    done = raw["completed_ns"] > 0
    out.append((done & (raw["completed_ns"] < raw["ts_ns"]),
                "a device that completed a call before the call was made"))  # fmt: skip
    return out


MAX_SIGNAL = 64  # Linux's highest signal number


def other_rings(rec: Recording) -> str | None:
    """What in ``rec``'s scheduler, TCP and exit rings no agent writes, in
    one line (None: nothing): a time after the dump read its rings, a wait
    in the run queue that began before the clock did, a signal number Linux
    does not have.  Their rows feed the straggler and network detectors: a
    run-queue delay of 39 hours (one flipped bit) once made a rank look
    starved of CPU."""
    now = rec.clock.monotonic_ns
    late = np.uint64(now + CLOCK_SLACK_NS)
    for name in ("sched", "tcp", "exit"):
        ring = rec.rings.get(name)
        if ring is None or not len(ring.rows):
            continue
        rows = ring.rows
        checks = [(rows["ts_ns"] > late if now > 0 else rows["ts_ns"] < 0, "a time after the dump")]
        if name == "sched":
            checks.append((rows["delay_ns"] > rows["ts_ns"], "a wait that began before the clock"))
        if name == "exit":
            bad = (rows["signal"] > MAX_SIGNAL) | (rows["signal"] < 0)
            checks.append((bad, "a signal Linux does not have"))
        for mask, text in checks:
            if mask.any():
                i = int(np.flatnonzero(mask)[0])
                return f"rings.{name}: damaged ({text}: row {i})"
    return None


def _stream_rules(d: Dumps, ours: np.ndarray) -> list[tuple[np.ndarray, str]]:
    return [
        (_out_of_order(d, ours), "a seq out of order on its process and communicator"),
        (_foreign_hash(d), "a communicator hash its process's table does not give"),
    ]


def _out_of_order(d: Dumps, ours: np.ndarray) -> np.ndarray:
    """Collective calls whose seq does not follow the one before on their
    (process, communicator pointer) in their dump: both rows around a step
    that goes back, repeats or (where no row was lost) jumps are suspect."""
    raw = d.raw
    sel = np.flatnonzero(COLLECTIVE[raw["op"]] & ~d.captured & ours)
    out = np.zeros(len(raw), dtype=bool)
    if len(sel) < 2:
        return out
    key = (raw["pid"][sel].astype(np.uint64) << np.uint64(32)) ^ raw["comm"][sel]
    group = d.group[sel]
    order = np.lexsort((sel, key, group))  # ring order within each stream
    rows, k, g = sel[order], key[order], group[order]
    seq = raw["seq"][rows].astype(np.int64)
    same = (k[1:] == k[:-1]) & (g[1:] == g[:-1])
    step = seq[1:] - seq[:-1]
    broken = same & ((step < 1) | ((step > 1) & (d.lost[g[1:]] == 0)))
    at = np.flatnonzero(broken)
    out[rows[at]] = True
    out[rows[at + 1]] = True
    return out


_K1, _K2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xC2B2AE3D27D4EB4F)


def _pointer_key(pid: np.ndarray, comm: np.ndarray) -> np.ndarray:
    """One uint64 per (pid, communicator pointer): a mix, compared, never read."""
    key: np.ndarray = (pid.astype(np.uint64) * _K1) ^ (comm.astype(np.uint64) * _K2)
    return key


def _foreign_hash(d: Dumps) -> np.ndarray:
    """Rows whose (process, communicator pointer) their dump's comm table
    gives hashes, carrying another (0: an id the agent did not know is no
    damage).  A pointer freed and reused holds every hash the table gives it."""
    raw = d.raw
    if not len(d.comm_group):
        return np.zeros(len(raw), dtype=bool)
    table = _pointer_key(d.comm_pid, d.comm_ptr)
    key = _pointer_key(raw["pid"], raw["comm"])
    listed = pair_member(d.group, key, d.comm_group, table)
    given = pair_member(d.group, key ^ raw["comm_hash"], d.comm_group, table ^ d.comm_hash)
    out: np.ndarray = listed & (raw["comm_hash"] != 0) & ~given
    return out


def _moved_thread(d: Dumps) -> np.ndarray:
    """Rows whose thread most rows of its dump place in another process (a
    main thread's id is its process id: it places it too)."""
    raw = d.raw
    if not len(raw):  # dumps without a call in their windows: no thread to place
        return np.zeros(0, dtype=bool)
    tid, pid = raw["tid"].astype(np.uint64), raw["pid"].astype(np.uint64)
    threads = d.keys(tid)  # (dump, thread)
    # each (dump, thread, process) once, with how many rows name it
    order = np.lexsort((pid, threads))
    t, p = threads[order], pid[order]
    first = np.flatnonzero(np.r_[True, (t[1:] != t[:-1]) | (p[1:] != p[:-1])])
    counts = np.diff(np.r_[first, len(order)])
    pt, pp = t[first], p[first]
    # per (dump, thread), the process most of its rows name (the least pid of a tie)
    best = np.lexsort((pp, -counts, pt))
    lead = best[np.r_[True, pt[best][1:] != pt[best][:-1]]]
    tids, owner = pt[lead], pp[lead].copy()
    main = member(tids, np.unique(d.keys(pid)))  # a process's main thread is its own
    owner[main] = tids[main] & np.uint64(0xFFFFFFFF)
    out: np.ndarray = owner[np.searchsorted(tids, threads)] != pid
    return out


# ---- Flight Recorder files ------------------------------------------------------------
#
# A Flight Recorder file carries no checksum.  Its entries are in record
# order (the order torch created them): their creation times never go back,
# each group's op_id grows, and its collective seq steps by one (the ring
# keeps the latest entries, one run).  An entry's op is one the reader
# knows, and one that carries data records its sizes.  A file that breaks
# any of these is damaged (a key's name changed, a number's digit): lost,
# as one that cannot be read.  None of them fails on any file of the
# corpus (1,266 files of tests/data/fr-torch and a 16-rank NCCL job).


def fr_damage(d: FrDump) -> str | None:
    """Why a Flight Recorder file is damaged, in one line; None if it is not."""
    e = d.entries
    if not len(e):
        return None
    created = e["created"].astype(np.int64)
    # shape 0: the reader found no sizes (FrDump.shapes[0] is "")
    unsized = TAKES_DATA[e["op"]] & (e["shape"] == 0)
    checks = [
        (e["op"] == Op.UNKNOWN, "an op it does not name"),
        (unsized, "a call that carries data without its sizes"),
        (created <= 0, "no creation time"),
        (np.r_[False, created[1:] < created[:-1]], "created before the entry before it"),
    ]
    for pg in np.unique(e["pg"]).tolist():
        mine = np.flatnonzero((e["pg"] == pg) & ~e["is_p2p"])
        step = np.diff(e["seq"][mine])
        ops = np.diff(e["op_id"][mine])
        bad = np.zeros(len(e), dtype=bool)
        bad[mine[1:][(step != 1) | (ops <= 0)]] = True
        checks.append((bad, "a seq or op_id out of order in its group"))
    for mask, text in checks:
        if mask.any():
            i = int(np.flatnonzero(mask)[0])
            return f"{d.path}: entries[{i}]: damaged ({text})"
    return None

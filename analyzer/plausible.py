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

import numpy as np

from stallwatch.dumpers.model import Recording
from stallwatch.dumpers.schema import DATATYPE_SIZE, Op, Result, State, captured_rows

from .flightrec import FrDump

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
    ours = np.flatnonzero(
        np.isin(raw["pid"], scope) if scope is not None and len(scope) else bad == 0
    )
    rows = raw[ours]
    found = []
    for mask, text in (*_field_rules(rows, rec), *_stream_rules(rows, rec, lost)):
        full = np.zeros(len(raw), dtype=bool)
        full[ours[mask]] = True
        found.append((full, text))
    found.append((_moved_thread(raw), "a thread that names another process"))
    for full, text in found:
        if full.any():
            bad |= full
            why.append(_example(raw, full, text))
    return bad, why


def _example(raw: np.ndarray, mask: np.ndarray, text: str) -> str:
    i = int(np.flatnonzero(mask)[0])
    n = int(np.count_nonzero(mask))
    more = f", {n - 1} more" if n > 1 else ""
    return f"{text} (pid {int(raw['pid'][i])} seq {int(raw['seq'][i])}{more})"


def _field_rules(raw: np.ndarray, rec: Recording) -> list[tuple[np.ndarray, str]]:
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
    now = rec.clock.monotonic_ns
    if now > 0:  # a dump's clock: rows cannot be timed after it read its rings
        late = np.uint64(now + CLOCK_SLACK_NS)
        times = raw["ts_ns"] > late
        for name in ("end_ns", "started_ns", "completed_ns"):
            times |= raw[name] > late
        out.append((times, "a time after the dump read its rings"))
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


def _stream_rules(raw: np.ndarray, rec: Recording, lost: int) -> list[tuple[np.ndarray, str]]:
    return [
        (_out_of_order(raw, lost), "a seq out of order on its process and communicator"),
        (_foreign_hash(raw, rec), "a communicator hash its process's table does not give"),
    ]


def _out_of_order(raw: np.ndarray, lost: int) -> np.ndarray:
    """Collective calls whose seq does not follow the one before on their
    (process, communicator pointer): both rows around a step that goes back,
    repeats or (where no row was lost) jumps are suspect."""
    sel = np.flatnonzero(COLLECTIVE[raw["op"]] & ~captured_rows(raw))
    out = np.zeros(len(raw), dtype=bool)
    if len(sel) < 2:
        return out
    key = (raw["pid"][sel].astype(np.uint64) << np.uint64(32)) ^ raw["comm"][sel]
    order = np.lexsort((sel, key))  # ring order within each stream
    rows, k = sel[order], key[order]
    seq = raw["seq"][rows].astype(np.int64)
    same = k[1:] == k[:-1]
    step = seq[1:] - seq[:-1]
    broken = same & ((step < 1) | ((step > 1) & (lost == 0)))
    at = np.flatnonzero(broken)
    out[rows[at]] = True
    out[rows[at + 1]] = True
    return out


_K1, _K2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xC2B2AE3D27D4EB4F)


def _pointer_key(pid: np.ndarray, comm: np.ndarray) -> np.ndarray:
    """One uint64 per (pid, communicator pointer): a mix, compared, never read."""
    key: np.ndarray = (pid.astype(np.uint64) * _K1) ^ (comm.astype(np.uint64) * _K2)
    return key


def _foreign_hash(raw: np.ndarray, rec: Recording) -> np.ndarray:
    """Rows whose (process, communicator pointer) the comm table gives
    hashes, carrying another (0: an id the agent did not know is no damage).
    A pointer freed and reused holds every hash the table gives it."""
    if not rec.communicators:
        return np.zeros(len(raw), dtype=bool)
    pid = np.array([c.pid for c in rec.communicators], dtype=np.uint64)
    comm = np.array([c.comm for c in rec.communicators], dtype=np.uint64)
    hashes = np.array([c.comm_hash for c in rec.communicators], dtype=np.uint64)
    table = _pointer_key(pid, comm)
    key = _pointer_key(raw["pid"], raw["comm"])
    listed = np.isin(key, table)
    given = np.isin(key ^ raw["comm_hash"], table ^ hashes)
    out: np.ndarray = listed & (raw["comm_hash"] != 0) & ~given
    return out


def _moved_thread(raw: np.ndarray) -> np.ndarray:
    """Rows whose thread most rows place in another process (a main
    thread's id is its process id: it places it too)."""
    tid, pid = raw["tid"].astype(np.uint64), raw["pid"].astype(np.uint64)
    pairs, counts = np.unique((tid << np.uint64(32)) | pid, return_counts=True)
    if len(pairs) == 1:
        return tid != pid if int(pairs[0] >> np.uint64(32)) in pid else np.zeros(len(raw), bool)
    ptid, ppid = pairs >> np.uint64(32), pairs & np.uint64(0xFFFFFFFF)
    # per thread, the process most of its rows name: its pairs by count, most first
    order = np.lexsort((-counts, ptid))
    tids, first = np.unique(ptid[order], return_index=True)
    owner = ppid[order][first]
    main = np.isin(tids, pid)  # a process's main thread is its own
    owner[main] = tids[main]
    out: np.ndarray = owner[np.searchsorted(tids, tid)] != pid
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

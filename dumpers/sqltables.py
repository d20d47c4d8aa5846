"""The table layout every part queries: Recordings -> columnar Arrow tables.

One function, :func:`tables`, turns recordings (dumps or live snapshots) into
the SQL tables of DESIGN.md, each with a ``host`` column:

    nccl_events    one row per NCCL call (ring "nccl")
    comm_events    communicator lifecycle calls (ring "comm")
    tcp_events     retransmits and connection state changes (ring "tcp")
    sched_events   run-queue delays of rank threads (ring "sched")
    exit_events    exit_group, fatal signals, process exits (ring "exit")
    processes      the processes the agent watched
    communicators  the communicators they held

Columns are built from the ring's numpy fields with vectorised operations,
never row by row.  Small string domains (host, op, datatype, state, event,
addresses) are interned: the column holds small integer codes and an Arrow
dictionary holds the names, so ``op = 'ALL_REDUCE'`` compares strings while
the data stays a byte per row.  Every event table keeps ``timestamp_ns`` in the
recording host's CLOCK_MONOTONIC domain (DESIGN.md) and adds ``wall_time``, the
same instant as a wall-clock timestamp (UTC, without a zone, as DuckDB
``TIMESTAMP_NS``) converted with the dump's sampled
clock pair.

Nullable columns: ``end_ns``/``duration_ns``/``result`` of ``nccl_events`` are
NULL while the call is in flight; ``rank``/``nranks`` are NULL when neither
the event nor the communicator table knows them; ``started_ns``,
``completed_ns`` and their ``*_after_ns`` bounds are NULL where the device side
was not observed (no CUDA runtime probed, or the call never got there).
``state`` is the furthest of scheduled / enqueued / started / completed the
call reached.

Known limits: a communicator pointer reused by the same process after a
destroy is told apart by its init/destroy times only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import cache

import numpy as np
import pyarrow as pa

from . import addresses
from .model import CommInfo, Recording
from .schema import (
    DEVICE_FIELDS,
    RING_DTYPES,
    ExitEvent,
    RedOp,
    Result,
    State,
    TcpEvent,
    datatype_name,
    op_name,
)

# The query DESIGN.md ("SQL") promises runs unchanged on dumps and on live
# agents; the demo, the benchmarks and the tests all use this one copy.
SEED_QUERY = """\
WITH slow_collectives AS (
  SELECT timestamp_ns, duration_ns, rank, nranks, comm_id_hash, pid
  FROM nccl_events WHERE op = 'ALL_REDUCE' AND duration_ns > 50000000)
SELECT s.rank, s.duration_ns/1e6 AS ms, COUNT(t.timestamp_ns) AS retransmits_in_window
FROM slow_collectives s
LEFT JOIN tcp_events t
  ON t.timestamp_ns BETWEEN s.timestamp_ns AND s.timestamp_ns + s.duration_ns
 AND t.event = 'tcp_retransmit_skb'
GROUP BY s.rank, s.duration_ns, s.timestamp_ns ORDER BY ms DESC LIMIT 20;"""

TABLE_NAMES = (
    "nccl_events",
    "comm_events",
    "tcp_events",
    "sched_events",
    "exit_events",
    "processes",
    "communicators",
)


Columns = dict[str, pa.Array]


def _enum_names(names: Callable[[int], str], size: int = 256) -> pa.Array:
    return pa.array([names(i) for i in range(size)], type=pa.string())


def _lower_name(enum_type: type, prefix: str) -> Callable[[int], str]:
    def name(value: int) -> str:
        try:
            return str(enum_type(value).name.lower())
        except ValueError:
            return f"{prefix}_{value}"

    return name


@cache
def _dictionaries() -> dict[str, pa.Array]:
    """Fixed dictionaries indexed by the u8 code stored in the rings."""
    return {
        "op": _enum_names(op_name),
        "datatype": _enum_names(datatype_name),
        "redop": _enum_names(_lower_name(RedOp, "redop")),
        "state": _enum_names(_lower_name(State, "state")),
        "tcp_event": _enum_names(_lower_name(TcpEvent, "tcp_event")),
        "exit_event": _enum_names(_lower_name(ExitEvent, "exit_event")),
    }


def _coded(codes: np.ndarray, dictionary: str) -> pa.DictionaryArray:
    return pa.DictionaryArray.from_arrays(
        pa.array(codes.astype(np.uint8, copy=False)), _dictionaries()[dictionary]
    )


def _host(host: str, n: int) -> pa.DictionaryArray:
    return pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int8)), pa.array([host]))


def _i64(values: np.ndarray) -> pa.Array:
    return pa.array(values.astype(np.int64, copy=False))


def _wall(rec: Recording, ts: np.ndarray) -> pa.Array:
    offset = rec.clock.realtime_ns - rec.clock.monotonic_ns
    return pa.array(ts + offset, type=pa.timestamp("ns"))


def _header(rec: Recording, rows: np.ndarray) -> tuple[np.ndarray, Columns]:
    ts = rows["ts_ns"].astype(np.int64)
    return ts, {
        "host": _host(rec.host, len(rows)),
        "timestamp_ns": pa.array(ts),
        "wall_time": _wall(rec, ts),
    }


def _ring(rec: Recording, name: str) -> np.ndarray:
    ring = rec.rings.get(name)
    if ring is None:
        return np.zeros(0, dtype=RING_DTYPES[name])
    return ring.rows


def _comm_matches(c: CommInfo, pid: np.ndarray, comm: np.ndarray, ts: np.ndarray) -> np.ndarray:
    match: np.ndarray = (pid == c.pid) & (comm == c.comm)
    if c.init_ns:
        match &= ts >= c.init_ns
    if c.destroy_ns:
        match &= ts <= c.destroy_ns
    return match


def _fill_from_comms(
    rec: Recording, rows: np.ndarray, ts: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """rank, nranks and comm hash, completed from the communicator table where
    the event itself did not know them (-1, or hash 0)."""
    rank = rows["rank"].astype(np.int32)
    nranks = rows["nranks"].astype(np.int32)
    comm_hash = rows["comm_hash"].astype(np.uint64)
    if not len(rows) or not rec.communicators:
        return rank, nranks, comm_hash
    need = np.flatnonzero((rank < 0) | (nranks < 0) | (comm_hash == 0))
    if not len(need):
        return rank, nranks, comm_hash
    # contiguous copies of the rows to fill: comparing them is cache friendly
    pid, comm, when = rows["pid"][need], rows["comm"][need], ts[need]
    for c in rec.communicators:
        at = need[_comm_matches(c, pid, comm, when)]
        if c.rank >= 0:
            rank[at[rank[at] < 0]] = c.rank
        if c.nranks >= 0:
            nranks[at[nranks[at] < 0]] = c.nranks
        if c.comm_hash:
            comm_hash[at[comm_hash[at] == 0]] = c.comm_hash
    return rank, nranks, comm_hash


def _maybe_null(values: np.ndarray, null: np.ndarray) -> pa.Array:
    return pa.array(values, mask=null) if null.any() else pa.array(values)


def nccl_columns(rec: Recording) -> Columns:
    rows = _ring(rec, "nccl")
    ts, cols = _header(rec, rows)
    rank, nranks, comm_hash = _fill_from_comms(rec, rows, ts)
    end = rows["end_ns"].astype(np.int64)
    pending = end == 0
    cols["end_ns"] = _maybe_null(end, pending)
    cols["duration_ns"] = _maybe_null(end - ts, pending)
    cols["op"] = _coded(rows["op"], "op")
    cols["rank"] = _maybe_null(rank, rank < 0)
    cols["nranks"] = _maybe_null(nranks, nranks < 0)
    cols["comm_id_hash"] = pa.array(comm_hash)
    for name in ("seq", "pid", "tid"):
        cols[name] = _i64(rows[name])
    cols["count"] = _i64(rows["count"])
    cols["bytes"] = _i64(rows["bytes"])
    cols["datatype"] = _coded(rows["datatype"], "datatype")
    cols["redop"] = _coded(rows["redop"], "redop")
    cols["peer"] = _maybe_null(rows["peer"].astype(np.int32), rows["peer"] < 0)
    cols["state"] = _coded(rows["state"], "state")
    result = rows["result"].astype(np.int32)
    cols["result"] = _maybe_null(result, result == Result.PENDING)
    cols["comm"] = pa.array(rows["comm"].astype(np.uint64))
    cols["stream"] = pa.array(rows["stream"].astype(np.uint64))
    cols.update(_device_columns(rows))
    return cols


def _device_columns(rows: np.ndarray) -> Columns:
    """When the device started and completed the call, as first observed
    (NULL: never), and the latest time it was still seen not to have: the
    device event lies in (``*_after_ns``, ``*_ns``]."""
    cols: Columns = {}
    for name in DEVICE_FIELDS:
        values = rows[name].astype(np.int64)
        cols[name] = _maybe_null(values, values == 0)
    return cols


def _root_addresses(unique_ids: np.ndarray) -> pa.Array:
    from .schema import decode_root_address

    return pa.array([decode_root_address(bytes(u)) or "" for u in unique_ids], pa.string())


def comm_event_columns(rec: Recording) -> Columns:
    rows = _ring(rec, "comm")
    ts, cols = _header(rec, rows)
    end = rows["end_ns"].astype(np.int64)
    pending = end == 0
    cols["end_ns"] = _maybe_null(end, pending)
    cols["duration_ns"] = _maybe_null(end - ts, pending)
    cols["op"] = _coded(rows["op"], "op")
    cols["pid"] = _i64(rows["pid"])
    cols["tid"] = _i64(rows["tid"])
    cols["comm"] = pa.array(rows["comm"].astype(np.uint64))
    cols["comm_id_hash"] = pa.array(rows["comm_hash"].astype(np.uint64))
    cols["parent_hash"] = pa.array(rows["parent_hash"].astype(np.uint64))
    for name in ("rank", "nranks", "color", "key"):
        cols[name] = pa.array(rows[name].astype(np.int32))
    cols["state"] = _coded(rows["state"], "state")
    result = rows["result"].astype(np.int32)
    cols["result"] = _maybe_null(result, result == Result.PENDING)
    cols["root_addr"] = _root_addresses(rows["unique_id"])
    return cols


def _address_keys(family: np.ndarray, raw: np.ndarray) -> np.ndarray:
    """One 64-bit key per (family, 16 address bytes), by multiply-xor mixing:
    sorting integers is ~100x faster than sorting 18-byte records."""
    words = np.ascontiguousarray(raw).view("<u8").reshape(-1, 2)
    with np.errstate(over="ignore"):
        key = words[:, 0] * np.uint64(0x9E3779B97F4A7C15)
        key ^= (words[:, 1] + np.uint64(0xBF58476D1CE4E5B9)) * np.uint64(0x94D049BB133111EB)
        key ^= family.astype(np.uint64) << np.uint64(48)
    return key


def _addresses(family: np.ndarray, raw: np.ndarray) -> pa.DictionaryArray:
    """Addresses as text, interned: format each distinct (family, bytes) once."""
    if not len(raw):
        return pa.DictionaryArray.from_arrays(pa.array([], pa.int32()), pa.array([], pa.string()))
    _, first, codes = np.unique(_address_keys(family, raw), return_index=True, return_inverse=True)
    codes = codes.reshape(-1)
    if not (
        np.array_equal(raw[first][codes], raw) and np.array_equal(family[first][codes], family)
    ):
        # two addresses mixed to one key (never seen): sort the bytes themselves
        keys = np.concatenate([family.astype("<u2").view(np.uint8).reshape(-1, 2), raw], axis=1)
        _, first, codes = np.unique(keys, axis=0, return_index=True, return_inverse=True)
        codes = codes.reshape(-1)
    names = [addresses.format_address(int(family[i]), bytes(raw[i])) for i in first]
    return pa.DictionaryArray.from_arrays(
        pa.array(codes.astype(np.int32)), pa.array(names, pa.string())
    )


def tcp_columns(rec: Recording) -> Columns:
    rows = _ring(rec, "tcp")
    _, cols = _header(rec, rows)
    cols["event"] = _coded(rows["event"], "tcp_event")
    cols["pid"] = _i64(rows["pid"])
    cols["tid"] = _i64(rows["tid"])
    cols["saddr"] = _addresses(rows["family"], rows["saddr"])
    cols["daddr"] = _addresses(rows["family"], rows["daddr"])
    cols["sport"] = pa.array(rows["sport"].astype(np.int32))
    cols["dport"] = pa.array(rows["dport"].astype(np.int32))
    cols["family"] = pa.array(rows["family"].astype(np.int32))
    cols["state"] = pa.array(rows["state"].astype(np.int32))
    cols["newstate"] = pa.array(rows["newstate"].astype(np.int32))
    cols["skaddr"] = pa.array(rows["skaddr"].astype(np.uint64))
    return cols


def sched_columns(rec: Recording) -> Columns:
    rows = _ring(rec, "sched")
    _, cols = _header(rec, rows)
    cols["pid"] = _i64(rows["pid"])
    cols["tid"] = _i64(rows["tid"])
    cols["delay_ns"] = _i64(rows["delay_ns"])
    cols["cpu"] = pa.array(rows["cpu"].astype(np.int32))
    return cols


def exit_columns(rec: Recording) -> Columns:
    rows = _ring(rec, "exit")
    _, cols = _header(rec, rows)
    cols["pid"] = _i64(rows["pid"])
    cols["tid"] = _i64(rows["tid"])
    cols["event"] = _coded(rows["event"], "exit_event")
    cols["code"] = pa.array(rows["code"].astype(np.int32))
    cols["signal"] = pa.array(rows["signal"].astype(np.int32))
    return cols


def _wall_or_null(rec: Recording, values: list[int]) -> pa.Array:
    offset = rec.clock.realtime_ns - rec.clock.monotonic_ns
    return pa.array([v + offset if v else None for v in values], pa.timestamp("ns"))


def process_columns(rec: Recording) -> Columns:
    procs = rec.processes
    start = [p.start_ns for p in procs]
    exit_ns = [p.exit_ns for p in procs]
    return {
        "host": _host(rec.host, len(procs)),
        "pid": pa.array([p.pid for p in procs], pa.int64()),
        "comm": pa.array([p.comm for p in procs], pa.string()),
        "cmdline": pa.array([p.cmdline for p in procs], pa.string()),
        "netns": pa.array([p.netns for p in procs], pa.int64()),
        "start_ns": pa.array(start, pa.int64()),
        "exit_ns": pa.array([e or None for e in exit_ns], pa.int64()),
        "exit_code": pa.array([p.exit_code for p in procs], pa.int32()),
        "exit_signal": pa.array([p.exit_signal for p in procs], pa.int32()),
        "libs": pa.array([list(p.libs) for p in procs], pa.list_(pa.string())),
        "start_time": _wall_or_null(rec, start),
        "exit_time": _wall_or_null(rec, exit_ns),
    }


def communicator_columns(rec: Recording) -> Columns:
    comms = rec.communicators
    comm_of = {p.pid: p.comm for p in rec.processes}
    return {
        "host": _host(rec.host, len(comms)),
        "pid": pa.array([c.pid for c in comms], pa.int64()),
        "process": pa.array([comm_of.get(c.pid, "") for c in comms], pa.string()),
        "comm": pa.array([c.comm for c in comms], pa.uint64()),
        "comm_id_hash": pa.array([c.comm_hash for c in comms], pa.uint64()),
        "rank": pa.array([c.rank if c.rank >= 0 else None for c in comms], pa.int32()),
        "nranks": pa.array([c.nranks if c.nranks >= 0 else None for c in comms], pa.int32()),
        "parent_hash": pa.array([c.parent_hash for c in comms], pa.uint64()),
        "color": pa.array([c.color for c in comms], pa.int32()),
        "key": pa.array([c.key for c in comms], pa.int32()),
        "root_addr": pa.array([c.root_addr for c in comms], pa.string()),
        "init_ns": pa.array([c.init_ns or None for c in comms], pa.int64()),
        "destroy_ns": pa.array([c.destroy_ns or None for c in comms], pa.int64()),
    }


_BUILDERS: dict[str, Callable[[Recording], Columns]] = {
    "nccl_events": nccl_columns,
    "comm_events": comm_event_columns,
    "tcp_events": tcp_columns,
    "sched_events": sched_columns,
    "exit_events": exit_columns,
    "processes": process_columns,
    "communicators": communicator_columns,
}


def _unify(parts: Sequence[pa.Table]) -> pa.Table:
    if len(parts) == 1:
        return parts[0]
    # Each part has its own host dictionary; Arrow keeps them chunk by chunk.
    return pa.concat_tables(parts)


def tables(recordings: Recording | Iterable[Recording]) -> dict[str, pa.Table]:
    """Every SQL table over one or many recordings, rows concatenated in the
    order the recordings are given."""
    recs = [recordings] if isinstance(recordings, Recording) else list(recordings)
    out: dict[str, pa.Table] = {}
    for name, build in _BUILDERS.items():
        if recs:
            out[name] = _unify([pa.table(build(r)) for r in recs])
        else:
            out[name] = pa.table(build(_EMPTY))
    return out


def _empty_recording() -> Recording:
    from .model import Clock, Ring

    rings = {name: Ring(np.zeros(0, dtype)) for name, dtype in RING_DTYPES.items()}
    return Recording("", "", Clock(0, 0), (), (), rings)


_EMPTY = _empty_recording()

"""The table layout every part queries: Recordings -> columnar Arrow tables.

One function, :func:`tables`, turns recordings (dumps or live snapshots) into
the SQL tables (docs/architecture.md, docs/parquet.md), each with a ``host`` column:

    nccl_events    one row per NCCL call (ring "nccl"), and per call replayed by a CUDA graph
    cuda_graphs    the NCCL calls each CUDA graph captured, in capture order
    comm_events    communicator lifecycle calls (ring "comm")
    tcp_events     the job's retransmits (with the connection's state), resets and
                   connection state changes (ring "tcp")
    sched_events   run-queue delays of rank threads (ring "sched")
    exit_events    exit_group, fatal signals, process exits (ring "exit")
    link_events    samples of the node's interfaces and RDMA ports (ring "link")
    conn_samples   each job connection's tcp_info every second (dumpers.nettables)
    iface_samples  each job interface's netdev and qdisc counters every second (nettables)
    probes         the probes between the job's nodes at an incident (nettables)
    processes      the processes the agent watched
    communicators  the communicators they held
    links          the interfaces link_events names, and the processes using them
    thread_states  where every thread of every NCCL process was, per snapshot

Columns are built from the ring's numpy fields with vectorised operations,
never row by row.  Small string domains (host, op, datatype, state, event,
addresses) are interned: the column holds small integer codes and an Arrow
dictionary holds the names, so ``op = 'ALL_REDUCE'`` compares strings while
the data stays a byte per row.

Clock: every absolute time of every table (``timestamp_ns``, ``end_ns``,
the device's ``started_ns``/``completed_ns`` and their ``*_after_ns``,
``start_ns``/``exit_ns`` of processes, ``init_ns``/``destroy_ns`` of
communicators) is on the incident's one clock: nanoseconds since the Unix
epoch (UTC), each host's CLOCK_MONOTONIC stamps converted with the realtime -
monotonic pair its own recording sampled (:func:`clock_offset`), the pair the
analyzer aligns hosts with.  A recording converts itself, so a dump, the live
agent that wrote it and the Parquet export give a row the same time, and
times of different hosts compare as well as their wall clocks agree (NTP:
milliseconds).  ``host_timestamp_ns`` keeps the host's own monotonic stamp
beside ``timestamp_ns`` (their difference is the recording's offset, the same
for every row of a recording); ``wall_time`` is ``timestamp_ns`` as DuckDB
``TIMESTAMP_NS``.  Durations (``duration_ns``, ``elapsed_ns``, ``delay_ns``,
``no_ack_ns``) are differences of one host's stamps, unchanged.  A recording
without a clock pair (realtime 0) has NULL for every converted time: unknown,
never a host's monotonic stamp passed off as the incident's clock.

Every column holds NULL where the value is unknown or means nothing for the
row (never -1 or 0 standing for "unknown"): ``end_ns``/``duration_ns``/
``result`` while a call is in flight (``elapsed_ns`` then counts up to the
recording's time instead), ``datatype``/``count``/``redop``/``seq`` of calls
that move no data (``GET_UNIQUE_ID``, ``GROUP_START``, lifecycle calls), a
``pid`` no process is known to own; ``started_ns``, ``completed_ns`` and
their ``*_after_ns`` bounds where the device side was not observed (no CUDA
runtime probed, or the call never got there).  ``state`` is the furthest of
scheduled / enqueued / started / completed the call reached.

Ids are one text form everywhere, the form the reports print: communicator
ids (``comm_id_hash``, ``parent_hash``) and pointers (``comm``, ``stream``,
``skaddr``) are ``'0x'`` and 16 hex digits, interned.

Ranks: ``rank`` is the rank in the row's communicator (recorded by the probe,
or for split communicators derived from every member's key and parent rank,
``dumpers.ranks``, over all the recordings queried together), ``world_rank``
the process's rank in the largest non-split communicator it holds.  Both are
NULL where they cannot be known exactly (one node alone cannot rank a split
whose members span nodes).

``thread_states`` has one row per thread per snapshot (``stallwatch
snapshot``, agent start-up, every dump): ``snapshot`` numbers the recording's
snapshots from 0 (oldest), ``timestamp_ns`` is when its process was read.
``nccl_call``/``op`` are NULL for a thread inside no NCCL call; the call's
arguments are NULL where they could not be read; ``comm`` is the call's
communicator pointer, ``comm_id_hash``, ``rank`` and ``nranks`` come from the
communicator table (NULL without a recording that saw the communicator
made); ``world_rank`` is the recording's, else the launcher's ``RANK`` (or
Slurm's, Open MPI's), ``world_size`` the launcher's.  A process that could not
be read is one row with a NULL ``tid`` and its ``error``.

CUDA graphs: a call made on a stream being captured is not in
``nccl_events`` (it did not run) but in ``cuda_graphs``, one row per call
(``graph``: the capture's number on its host, ``graph_node``: 1-based place
in capture order; ``launches``: how many launches of it the recording holds).
Each launch is one ``nccl_events`` row of op ``GRAPH_LAUNCH`` (``comm`` is the
``cudaGraphExec_t``, ``count`` the calls it replays, ``result`` the
``cudaError_t``) and each call it replays is a row like any other (op, count,
communicator, ``seq``, lifecycle, device times) with ``graph``,
``graph_node`` and ``replay`` (the executable's launch number, from 1) saying
where it came from; the three are NULL on rows of calls made outside graphs.

Links: ``link_events`` has one row per sample the agent wrote (a state
change, an error counter that moved, the interface's first and last sight,
and a heartbeat): ``event`` says why, the change lies in (``after_ns``,
``timestamp_ns``], and every state and counter the interface does not have
(the RDMA columns of a netdev, a counter the driver lacks) is NULL.
``links`` has one row per interface, with the processes that use it
(``pids``: a rank's connections leave through it, or it has the RDMA device
open) and their ``world_ranks``.  Dumps before format 7 have neither.

Known limits: a communicator pointer reused by the same process after a
destroy is told apart by its init/destroy times only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import cache

import numpy as np
import pyarrow as pa

from . import rankevidence
from .columns import (
    Columns,
    address_column,
    address_keys,
    by_pid,
    counter,
    enum_names,
    families,
    flag,
    header,
    hex_ids,
    host_column,
    i64,
    lower_name,
    maybe_null,
    on_clock,
    on_clock_list,
    pids,
    ring_rows,
    tcp_state_name,
    wall,
)
from .layout import LINK_COUNTERS, UNKNOWN_U8, UNKNOWN_U32, UNKNOWN_U64
from .model import CommInfo, Recording
from .nettables import conn_sample_columns, iface_sample_columns, probe_columns
from .rankevidence import Evidence
from .ranks import Ranks
from .readings import ArgsFrom, NcclCall, ProcessThreads, ThreadState, syscall_name
from .schema import (
    DEVICE_FIELDS,
    OPERSTATES,
    PHYS_STATES,
    PORT_STATES,
    PREV_PID_UNKNOWN,
    RING_DTYPES,
    ExitEvent,
    LinkEvent,
    LinkKind,
    Op,
    RedOp,
    Result,
    State,
    TcpEvent,
    TcpState,
    captured_rows,
    datatype_name,
    op_name,
)

# The seed query (docs/architecture.md, "SQL tables") runs unchanged on dumps and on live
# agents; the benchmarks and the tests use this one copy.  On the incident's
# clock it counts the retransmits of every host inside each slow AllReduce.
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

# The headline (README, the demo, docs/sql.md): each slow AllReduce with the
# retransmits of the slow rank's own connections inside its window, those its
# host sent and those its peers' hosts sent towards it (on their clocks,
# converted to the incident's).  A connection is the rank's where its local
# end (address and port) is one its process owns.
HEADLINE_QUERY = """\
WITH slow_collectives AS (
  SELECT host, pid, world_rank, seq, timestamp_ns, end_ns, duration_ns
  FROM nccl_events WHERE op = 'ALL_REDUCE' AND duration_ns > 50000000),
rank_ends AS (  -- the local address and port of the connections of each rank
  SELECT DISTINCT host, pid, saddr, sport FROM tcp_events WHERE pid IS NOT NULL),
retransmits AS (  -- on the own connections of a rank: sent from its end, or towards it
  SELECT t.timestamp_ns, e.host, e.pid, t.host = e.host AS sent
  FROM tcp_events t JOIN rank_ends e
    ON (t.host = e.host AND t.saddr = e.saddr AND t.sport = e.sport)
    OR (t.host <> e.host AND t.daddr = e.saddr AND t.dport = e.sport)
  WHERE t.event = 'tcp_retransmit_skb' AND NOT t.sampled)
SELECT s.host, s.world_rank, s.seq, s.duration_ns/1e6 AS ms,
       count(r.sent) FILTER (WHERE r.sent) AS sent,
       count(r.sent) FILTER (WHERE NOT r.sent) AS received
FROM slow_collectives s
LEFT JOIN retransmits r
  ON r.host = s.host AND r.pid = s.pid
 AND r.timestamp_ns BETWEEN s.timestamp_ns AND s.end_ns
GROUP BY ALL ORDER BY ms DESC LIMIT 20;"""

# Per host, the retransmit counts the analyzer's network verdicts print
# (analyzer.detect.network.retransmits_in_windows), by the same rules: a host's
# address is the commonest non-loopback source address of its ranks'
# connections; a retransmit counts once (two agents may see one), between
# two hosts' addresses; it is inside a window when the host that recorded it
# had a completed collective call of a process its agent lists around it (on
# the device's timeline for processes whose device side was observed; calls
# queued, asynchronous and seen on no device, until their rank's next call
# on the communicator after a pause of 1 ms: analyzer.detect.network.call_windows).
RETRANSMITS_BY_HOST_QUERY = """\
WITH rank_sources AS (  -- source addresses of the connections of the ranks of each host
  SELECT t.host, t.saddr, count(*) AS n FROM tcp_events t
  WHERE EXISTS (SELECT 1 FROM communicators c WHERE c.host = t.host AND c.pid = t.pid)
    AND NOT regexp_matches(t.saddr, '^(127\\.|::1$|::ffff:(127\\.|7f[0-9a-f]{2}:))')
  GROUP BY ALL),
host_addresses AS (  -- a host's: those of the links its ranks use, and the commonest source
  SELECT addr, min(host) AS host
  FROM (SELECT l.host, split_part(unnest(l.addresses), '/', 1) AS addr FROM links l
        WHERE l.kind = 'netdev'
          AND EXISTS (SELECT 1 FROM communicators c
                      WHERE c.host = l.host AND list_contains(l.pids, c.pid))
        UNION ALL
        SELECT host, first(saddr ORDER BY n DESC, saddr) FROM rank_sources GROUP BY host)
  WHERE NOT regexp_matches(addr, '^(127\\.|::1$)')
  GROUP BY addr),
retransmits AS (  -- from the address of one host to that of another, each event once
  SELECT DISTINCT ON (t.saddr, t.sport, t.daddr, t.dport, t.host_timestamp_ns)
         t.host, t.timestamp_ns, src.host AS sender, dst.host AS receiver
  FROM tcp_events t
  JOIN host_addresses src ON src.addr = t.saddr
  JOIN host_addresses dst ON dst.addr = t.daddr
  WHERE t.event = 'tcp_retransmit_skb' AND NOT t.sampled AND src.host <> dst.host
  ORDER BY t.saddr, t.sport, t.daddr, t.dport, t.host_timestamp_ns, t.host),
device_timed AS (SELECT DISTINCT host, pid FROM nccl_events WHERE completed_ns IS NOT NULL),
calls AS (  -- collectives of the processes the host lists
  SELECT n.* FROM nccl_events n
  WHERE n.seq IS NOT NULL AND n.op NOT IN ('SEND', 'RECV')
    AND n.pid IN (SELECT pid FROM processes p WHERE p.host = n.host
                  UNION SELECT pid FROM communicators c WHERE c.host = n.host)),
queued AS (  -- communicators whose calls return at once (median under 1 ms), with members to
             -- wait for, seen on no device: asynchronous
  SELECT comm_id_hash FROM calls GROUP BY comm_id_hash
  HAVING count(completed_ns) = 0 AND count(DISTINCT (host, pid)) >= 2
     AND median(end_ns - timestamp_ns) < 1000000),
runs AS (  -- each call, whether it ends a run (its rank's next call there after 1 ms, or none)
  SELECT c.*, q.comm_id_hash IS NOT NULL AS is_queued,
         lead(c.timestamp_ns) OVER rank_calls AS next_ts,
         next_ts IS NULL OR next_ts - c.timestamp_ns >= 1000000 AS run_end
  FROM calls c LEFT JOIN queued q ON q.comm_id_hash = c.comm_id_hash
  WINDOW rank_calls AS (PARTITION BY c.host, c.pid, c.comm ORDER BY c.timestamp_ns)),
worked AS (  -- a queued call works until the call after its run (a rank's last run: its return)
  SELECT *, first_value(CASE WHEN run_end THEN coalesce(next_ts, 0) END IGNORE NULLS)
              OVER (PARTITION BY host, pid, comm ORDER BY timestamp_ns
                    ROWS BETWEEN CURRENT ROW AND UNBOUNDED FOLLOWING) AS after_run
  FROM runs),
windows AS (  -- on the device timeline where seen; queued calls until after their run
  SELECT n.host,
         CASE WHEN d.pid IS NULL THEN n.timestamp_ns
              ELSE coalesce(n.started_ns, n.timestamp_ns) END AS lo,
         CASE WHEN d.pid IS NOT NULL THEN n.completed_ns
              WHEN n.is_queued AND n.end_ns IS NOT NULL AND n.after_run > n.end_ns
                THEN n.after_run
              ELSE n.end_ns END AS hi
  FROM worked n LEFT JOIN device_timed d ON d.host = n.host AND d.pid = n.pid),
flagged AS (
  SELECT r.sender, r.receiver,
         EXISTS (SELECT 1 FROM windows w
                 WHERE w.host = r.host AND r.timestamp_ns BETWEEN w.lo AND w.hi) AS inside
  FROM retransmits r)
SELECT h.host,
       count(f.inside) FILTER (WHERE f.sender = h.host AND f.inside) AS sent_in_windows,
       count(f.inside) FILTER (WHERE f.receiver = h.host AND f.inside) AS received_in_windows,
       count(f.inside) FILTER (WHERE f.sender = h.host) AS sent_in_all,
       (SELECT count(w.hi) FROM windows w WHERE w.host = h.host) AS collectives
FROM (SELECT DISTINCT host FROM communicators) h
LEFT JOIN flagged f ON h.host IN (f.sender, f.receiver)
GROUP BY h.host ORDER BY h.host;"""

# ``stallwatch query --example NAME`` prints one of these.
EXAMPLES = {
    "headline": HEADLINE_QUERY,
    "retransmits-by-host": RETRANSMITS_BY_HOST_QUERY,
    "seed": SEED_QUERY,
}

TABLE_NAMES = (
    "nccl_events",
    "cuda_graphs",
    "comm_events",
    "tcp_events",
    "sched_events",
    "exit_events",
    "link_events",
    "conn_samples",
    "iface_samples",
    "probes",
    "processes",
    "communicators",
    "links",
    "thread_states",
)


DATA_OPS = np.zeros(256, dtype=bool)  # ops that move data: count, datatype, seq mean something
DATA_OPS[[int(op) for op in Op if op.is_collective or op.is_p2p]] = True
REDUCING_OPS = np.zeros(256, dtype=bool)  # ops that take a reduction operator
REDUCING_OPS[[Op.ALL_REDUCE, Op.REDUCE, Op.REDUCE_SCATTER]] = True


@cache
def _dictionaries() -> dict[str, pa.Array]:
    """Fixed dictionaries indexed by the u8 code stored in the rings."""
    return {
        "op": enum_names(op_name),
        "datatype": enum_names(datatype_name),
        "redop": enum_names(lower_name(RedOp, "redop")),
        "state": enum_names(lower_name(State, "state")),
        "tcp_event": enum_names(lower_name(TcpEvent, "tcp_event")),
        "tcp_state": enum_names(tcp_state_name),
        "exit_event": enum_names(lower_name(ExitEvent, "exit_event")),
        "link_event": enum_names(lower_name(LinkEvent, "link_event")),
        "link_kind": enum_names(lower_name(LinkKind, "link_kind")),
        "operstate": enum_names(_state_name(OPERSTATES, "operstate")),
        "port_state": enum_names(_state_name(PORT_STATES, "port_state")),
        "phys_state": enum_names(_state_name(PHYS_STATES, "phys_state")),
    }


def _state_name(names: tuple[str, ...], prefix: str) -> Callable[[int], str]:
    return lambda value: names[value] if value < len(names) else f"{prefix}_{value}"


def _coded(codes: np.ndarray, dictionary: str, null: np.ndarray | None = None) -> pa.Array:
    indices = pa.array(codes.astype(np.uint8, copy=False), mask=null)
    return pa.DictionaryArray.from_arrays(indices, _dictionaries()[dictionary])


def _comm_matches(c: CommInfo, pid: np.ndarray, comm: np.ndarray, ts: np.ndarray) -> np.ndarray:
    match: np.ndarray = (pid == c.pid) & (comm == c.comm)
    if c.init_ns:
        match &= ts >= c.init_ns
    if c.destroy_ns:
        match &= ts <= c.destroy_ns
    return match


def _comm_rank(rec: Recording, c: CommInfo, known: Ranks) -> tuple[int, int]:
    """(rank, nranks) of a communicator table entry, derived where the
    recording did not know them; -1 where unknown."""
    rank = c.rank if c.rank >= 0 else known.comm.get(((rec.host, c.pid), c.comm_hash), -1)
    nranks = c.nranks if c.nranks >= 0 else known.nranks.get(c.comm_hash, -1)
    return rank, nranks


def _fill_from_comms(
    rec: Recording, rows: np.ndarray, ts: np.ndarray, known: Ranks
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """rank, nranks and comm hash, completed from the communicator table
    (and the ranks derived from it) where the event did not know them (-1,
    or hash 0)."""
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
        c_rank, c_nranks = _comm_rank(rec, c, known)
        if c_rank >= 0:
            rank[at[rank[at] < 0]] = c_rank
        if c_nranks >= 0:
            nranks[at[nranks[at] < 0]] = c_nranks
        if c.comm_hash:
            comm_hash[at[comm_hash[at] == 0]] = c.comm_hash
    return rank, nranks, comm_hash


def recording_now(rec: Recording) -> int:
    """The recording's own time (host monotonic): when it was dumped, or
    snapshotted (a Flight Recorder file: its latest entry).  Calls in flight
    are timed up to it, in SQL and in traces alike."""
    return rec.clock.monotonic_ns


def nccl_columns(rec: Recording, known: Ranks | None = None) -> Columns:
    """``nccl_events`` of one recording (``known``: ranks derived over every
    recording queried with it; by default over this one alone)."""
    rows = ring_rows(rec, "nccl")
    cols = _call_columns(rec, rows[~captured_rows(rows)], known)
    cols.pop("launches")
    return cols


# cuda_graphs: what each graph captured (the columns of its calls that
# mean something before they run)
GRAPH_COLUMNS = ("host", "timestamp_ns", "host_timestamp_ns", "wall_time", "pid", "tid",
                 "world_rank", "graph", "graph_node", "launches", "op", "rank", "nranks",
                 "comm_id_hash", "count", "bytes", "datatype", "redop", "peer", "comm",
                 "stream")  # fmt: skip


def cuda_graph_columns(rec: Recording, known: Ranks | None = None) -> Columns:
    """``cuda_graphs``: one row per NCCL call captured into a CUDA graph."""
    rows = ring_rows(rec, "nccl")
    cols = _call_columns(rec, rows[captured_rows(rows)], known)
    return {name: cols[name] for name in GRAPH_COLUMNS}


def _launches(all_rows: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """For each row, the launches of its (pid, graph) in ``all_rows``."""
    launch = all_rows[all_rows["op"] == Op.GRAPH_LAUNCH]
    if not len(rows) or not len(launch):
        return np.zeros(len(rows), dtype=np.int64)
    keys = launch["pid"].astype(np.uint64) << np.uint64(40) ^ launch["graph"]
    uniq, counts = np.unique(keys, return_counts=True)
    mine = rows["pid"].astype(np.uint64) << np.uint64(40) ^ rows["graph"]
    at = np.clip(np.searchsorted(uniq, mine), 0, len(uniq) - 1)
    return np.where(uniq[at] == mine, counts[at], 0).astype(np.int64)


def _graph_columns(rec: Recording, rows: np.ndarray) -> Columns:
    graph = rows["graph"].astype(np.int64)
    node = rows["graph_node"].astype(np.int64)
    replay = rows["replay"].astype(np.int64)
    return {
        "graph": maybe_null(graph, graph == 0),
        "graph_node": maybe_null(node, node == 0),
        "replay": maybe_null(replay, replay == 0),
        "launches": i64(_launches(ring_rows(rec, "nccl"), rows)),
    }


def _call_columns(rec: Recording, rows: np.ndarray, known: Ranks | None) -> Columns:
    known = known if known is not None else Ranks.of([rec])
    ts, cols = header(rec, rows)
    rank, nranks, comm_hash = _fill_from_comms(rec, rows, ts, known)
    end = rows["end_ns"].astype(np.int64)
    pending = end == 0
    moves = DATA_OPS[rows["op"]]
    idle = ~moves
    cols["end_ns"] = on_clock(rec, end, pending)
    cols["duration_ns"] = maybe_null(end - ts, pending)
    elapsed = np.where(pending, np.maximum(recording_now(rec) - ts, 0), end - ts)
    cols["elapsed_ns"] = pa.array(elapsed)
    cols["op"] = _coded(rows["op"], "op")
    cols["rank"] = maybe_null(rank, rank < 0)
    cols["world_rank"] = by_pid(rows["pid"], known.world_of(rec.host))
    cols["nranks"] = maybe_null(nranks, nranks < 0)
    cols["comm_id_hash"] = hex_ids(comm_hash)
    cols["seq"] = maybe_null(rows["seq"].astype(np.int64), idle)
    cols["pid"] = pids(rows["pid"])
    cols["tid"] = i64(rows["tid"])
    launch = rows["op"] == Op.GRAPH_LAUNCH  # its count: the calls it replays
    cols["count"] = maybe_null(rows["count"].astype(np.int64), idle & ~launch)
    cols["bytes"] = maybe_null(rows["bytes"].astype(np.int64), idle)
    cols["datatype"] = _coded(rows["datatype"], "datatype", idle)
    cols["redop"] = _coded(rows["redop"], "redop", ~REDUCING_OPS[rows["op"]])
    cols["peer"] = maybe_null(rows["peer"].astype(np.int32), (rows["peer"] < 0) | idle)
    cols["state"] = _coded(rows["state"], "state")
    result = rows["result"].astype(np.int32)
    cols["result"] = maybe_null(result, result == Result.PENDING)
    cols["comm"] = hex_ids(rows["comm"])
    cols["stream"] = hex_ids(rows["stream"])
    cols.update(_device_columns(rec, rows))
    cols.update(_graph_columns(rec, rows))
    return cols


def _device_columns(rec: Recording, rows: np.ndarray) -> Columns:
    """When the device started and completed the call, as first observed
    (NULL: never), and the latest time it was still seen not to have: the
    device event lies in (``*_after_ns``, ``*_ns``]."""
    return {name: on_clock(rec, rows[name]) for name in DEVICE_FIELDS}


def _root_addresses(unique_ids: np.ndarray) -> pa.Array:
    from .schema import decode_root_address

    return pa.array([decode_root_address(bytes(u)) for u in unique_ids], pa.string())


def _unless_negative(values: np.ndarray) -> pa.Array:
    values = values.astype(np.int32)
    return maybe_null(values, values < 0)


def comm_event_columns(rec: Recording, known: Ranks | None = None) -> Columns:
    known = known if known is not None else Ranks.of([rec])
    rows = ring_rows(rec, "comm")
    ts, cols = header(rec, rows)
    end = rows["end_ns"].astype(np.int64)
    pending = end == 0
    cols["end_ns"] = on_clock(rec, end, pending)
    cols["duration_ns"] = maybe_null(end - ts, pending)
    cols["op"] = _coded(rows["op"], "op")
    cols["pid"] = pids(rows["pid"])
    cols["tid"] = i64(rows["tid"])
    cols["world_rank"] = by_pid(rows["pid"], known.world_of(rec.host))
    cols["comm"] = hex_ids(rows["comm"])
    cols["comm_id_hash"] = hex_ids(rows["comm_hash"])
    cols["parent_hash"] = hex_ids(rows["parent_hash"])
    rank = rows["rank"].astype(np.int32)
    for i in np.flatnonzero(rank < 0).tolist():  # a split's own rank, where derived
        member = (rec.host, int(rows["pid"][i]))
        rank[i] = known.comm.get((member, int(rows["comm_hash"][i])), -1)
    cols["rank"] = maybe_null(rank, rank < 0)
    for name in ("nranks", "color", "key"):
        cols[name] = _unless_negative(rows[name])
    cols["state"] = _coded(rows["state"], "state")
    result = rows["result"].astype(np.int32)
    cols["result"] = maybe_null(result, result == Result.PENDING)
    cols["root_addr"] = _root_addresses(rows["unique_id"])
    return cols


def _connection_keys(rows: np.ndarray) -> np.ndarray:
    """One key per connection (addresses and ports of both ends)."""
    with np.errstate(over="ignore"):
        key = address_keys(rows["family"], rows["saddr"])
        key = key * np.uint64(0x9E3779B97F4A7C15) ^ address_keys(rows["family"], rows["daddr"])
        ports = (rows["sport"].astype(np.uint64) << np.uint64(16)) | rows["dport"]
        out: np.ndarray = key * np.uint64(0xBF58476D1CE4E5B9) ^ ports
    return out


def tcp_owners(rows: np.ndarray) -> np.ndarray:
    """The owning pid of each row, 0 where unknown: the row's own, else that
    of another row of the same connection, else (an accepted connection,
    whose first state changes run in softirq) the owner of the socket that
    listens on its local port on this host."""
    pid = rows["pid"].astype(np.int64)
    unknown = pid == 0
    if not unknown.any() or unknown.all():
        return pid
    keys = _connection_keys(rows)
    owner: dict[int, int] = dict(zip(keys[~unknown].tolist(), pid[~unknown].tolist(), strict=True))
    listening = (rows["newstate"] == TcpState.LISTEN) & ~unknown
    by_port: dict[int, int] = dict(
        zip(rows["sport"][listening].tolist(), pid[listening].tolist(), strict=True)
    )
    for i in np.flatnonzero(unknown).tolist():
        pid[i] = owner.get(int(keys[i]), by_port.get(int(rows["sport"][i]), 0))
    return pid


def tcp_columns(rec: Recording, known: Ranks | None = None) -> Columns:
    known = known if known is not None else Ranks.of([rec])
    rows = ring_rows(rec, "tcp")
    _, cols = header(rec, rows)
    pid = tcp_owners(rows)
    retransmit = rows["event"] == TcpEvent.TCP_RETRANSMIT_SKB
    change = rows["event"] == TcpEvent.INET_SOCK_SET_STATE
    cols["event"] = _coded(rows["event"], "tcp_event")
    cols["pid"] = maybe_null(pid, pid == 0)
    cols["world_rank"] = by_pid(pid, known.world_of(rec.host))
    cols["tid"] = maybe_null(rows["tid"].astype(np.int64), rows["tid"] == 0)
    cols["saddr"] = address_column(rows["family"], rows["saddr"])
    cols["daddr"] = address_column(rows["family"], rows["daddr"])
    cols["sport"] = pa.array(rows["sport"].astype(np.int32))
    cols["dport"] = pa.array(rows["dport"].astype(np.int32))
    cols["family"] = families(rows["family"])
    cols["state"] = _coded(rows["state"], "tcp_state", rows["state"] <= 0)
    cols["newstate"] = _coded(rows["newstate"], "tcp_state", ~change | (rows["newstate"] <= 0))
    cols["skaddr"] = hex_ids(rows["skaddr"])
    # the connection as the kernel had it at a retransmit (NULL: not read)
    unknown = ~retransmit | (rows["conn_known"] == 0)
    cols["backoff"] = maybe_null(rows["backoff"].astype(np.int32), unknown)
    cols["no_ack_ns"] = maybe_null(rows["no_ack_ns"].astype(np.int64), unknown)
    cols["srtt_us"] = maybe_null(rows["srtt_us"].astype(np.int64), unknown)
    cols["rto_us"] = maybe_null(rows["rto_us"].astype(np.int64), unknown | (rows["rto_us"] == 0))
    cols["unacked_bytes"] = maybe_null(rows["unacked"].astype(np.int64), unknown)
    cols["packets_out"] = maybe_null(rows["packets_out"].astype(np.int64), unknown)
    cols["retrans_out"] = maybe_null(rows["retrans_out"].astype(np.int64), unknown)
    cols["send_error"] = maybe_null(rows["err"].astype(np.int32), ~retransmit)
    cols["sampled"] = pa.array(rows["other"] == 1)
    reset_sent = rows["event"] == TcpEvent.TCP_SEND_RESET
    cols["reset_reason"] = maybe_null(rows["reason"].astype(np.int32), ~reset_sent)
    return cols


def sched_columns(rec: Recording, known: Ranks | None = None) -> Columns:
    known = known if known is not None else Ranks.of([rec])
    rows = ring_rows(rec, "sched")
    _, cols = header(rec, rows)
    cols["pid"] = pids(rows["pid"])
    cols["world_rank"] = by_pid(rows["pid"], known.world_of(rec.host))
    cols["tid"] = i64(rows["tid"])
    cols["delay_ns"] = i64(rows["delay_ns"])
    cols["cpu"] = pa.array(rows["cpu"].astype(np.int32))
    holder = rows["prev_pid"].astype(np.int64)  # 0 is the idle task: a real holder
    cols["prev_pid"] = maybe_null(holder, rows["prev_pid"] == PREV_PID_UNKNOWN)
    return cols


def exit_columns(rec: Recording, known: Ranks | None = None) -> Columns:
    known = known if known is not None else Ranks.of([rec])
    rows = ring_rows(rec, "exit")
    _, cols = header(rec, rows)
    cols["pid"] = pids(rows["pid"])
    cols["world_rank"] = by_pid(rows["pid"], known.world_of(rec.host))
    cols["tid"] = i64(rows["tid"])
    cols["event"] = _coded(rows["event"], "exit_event")
    code = rows["code"].astype(np.int32)
    cols["code"] = maybe_null(code, rows["event"] != ExitEvent.EXIT_GROUP)
    signal = rows["signal"].astype(np.int32)
    cols["signal"] = maybe_null(signal, signal <= 0)
    return cols


def _link_names(rec: Recording, ids: np.ndarray) -> pa.DictionaryArray:
    """Each row's interface name, from the links table (NULL: an id the
    table does not hold)."""
    table = sorted((li.id, li.name) for li in rec.links)
    keys = np.array([k for k, _ in table], dtype=np.int64)
    names = pa.array([n for _, n in table], pa.string())
    ids = ids.astype(np.int64)
    if not len(keys):
        return pa.DictionaryArray.from_arrays(pa.nulls(len(ids), pa.int32()), names)
    at = np.minimum(np.searchsorted(keys, ids), len(keys) - 1)
    indices = pa.array(at.astype(np.int32), mask=keys[at] != ids)
    return pa.DictionaryArray.from_arrays(indices, names)


def link_event_columns(rec: Recording, known: Ranks | None = None) -> Columns:
    rows = ring_rows(rec, "link")
    _, cols = header(rec, rows)
    cols["after_ns"] = on_clock(rec, rows["after_ns"])
    cols["interface"] = _link_names(rec, rows["link"])
    cols["kind"] = _coded(rows["link_kind"], "link_kind")
    cols["event"] = _coded(rows["event"], "link_event")
    cols["carrier"] = flag(rows["carrier"])
    cols["admin_up"] = flag(rows["admin_up"])
    for name in ("operstate", "port_state", "phys_state"):
        cols[name] = _coded(rows[name], name, rows[name] == UNKNOWN_U8)
    for name in ("carrier_changes", "carrier_up_count", "carrier_down_count"):
        cols[name] = counter(rows[name], UNKNOWN_U32)
    for name in LINK_COUNTERS:
        cols[name] = counter(rows[name], UNKNOWN_U64)
    return cols


def link_columns(rec: Recording, known: Ranks | None = None) -> Columns:
    known = known if known is not None else Ranks.of([rec])
    links = rec.links
    world = known.world_of(rec.host)
    first = on_clock_list(rec, [li.first_ns for li in links])
    gone = on_clock_list(rec, [li.gone_ns for li in links])
    return {
        "host": host_column(rec.host, len(links)),
        "interface": pa.array([li.name for li in links], pa.string()),
        "kind": pa.array([li.kind for li in links], pa.string()),
        "device": pa.array([li.device for li in links], pa.string()),
        "port": pa.array([li.port for li in links], pa.int32()),
        "ifindex": pa.array([li.ifindex for li in links], pa.int32()),
        "netdev": pa.array([li.netdev for li in links], pa.string()),
        "link_type": pa.array([li.link_type for li in links], pa.string()),
        "link_layer": pa.array([li.link_layer for li in links], pa.string()),
        "addresses": pa.array([list(li.addresses) for li in links], pa.list_(pa.string())),
        "mtu": pa.array([li.mtu for li in links], pa.int32()),
        "speed_mbps": pa.array([li.speed_mbps for li in links], pa.int64()),
        "pids": pa.array([sorted(li.pids) for li in links], pa.list_(pa.int64())),
        "world_ranks": pa.array(
            [sorted({world[p] for p in li.pids if p in world}) for li in links],
            pa.list_(pa.int32()),
        ),
        "first_seen_ns": first,
        "gone_ns": gone,
        "first_seen_time": wall(first),
        "gone_time": wall(gone),
    }


def process_columns(rec: Recording, known: Ranks | None = None) -> Columns:
    known = known if known is not None else Ranks.of([rec])
    procs = rec.processes
    start = on_clock_list(rec, [p.start_ns for p in procs])
    exit_ns = on_clock_list(rec, [p.exit_ns for p in procs])
    world = known.world_of(rec.host)
    return {
        "host": host_column(rec.host, len(procs)),
        "pid": pa.array([p.pid or None for p in procs], pa.int64()),
        "world_rank": pa.array([world.get(p.pid) for p in procs], pa.int32()),
        "comm": pa.array([p.comm or None for p in procs], pa.string()),
        "cmdline": pa.array([p.cmdline or None for p in procs], pa.string()),
        "netns": pa.array([p.netns or None for p in procs], pa.int64()),
        "start_ns": start,
        "exit_ns": exit_ns,
        "exit_code": pa.array([p.exit_code for p in procs], pa.int32()),
        "exit_signal": pa.array([p.exit_signal for p in procs], pa.int32()),
        "libs": pa.array([list(p.libs) for p in procs], pa.list_(pa.string())),
        "start_time": wall(start),
        "exit_time": wall(exit_ns),
    }


def _evidence_columns(rec: Recording) -> Columns:
    """What each member's own calls on a split communicator tell of its rank
    there (``dumpers.rankevidence``): the highest rank they named, and the
    ranks they prove it does not hold; NULL for communicators whose ranks
    are recorded."""
    comms = rec.communicators
    split = {c.comm_hash for c in comms if c.parent_hash}
    ring = rec.rings.get("nccl")
    ev = rankevidence.ring_evidence(ring.rows, split) if ring is not None and split else {}
    told = [ev.get((c.pid, c.comm_hash), Evidence()) if c.parent_hash else None for c in comms]
    return {
        "named_rank": pa.array(
            [e.named if e is not None and e.named >= 0 else None for e in told], pa.int32()
        ),
        "not_ranks": pa.array(
            [sorted(e.not_ranks) if e is not None else None for e in told], pa.list_(pa.int32())
        ),
    }


def communicator_columns(rec: Recording, known: Ranks | None = None) -> Columns:
    known = known if known is not None else Ranks.of([rec])
    comms = rec.communicators
    comm_of = {p.pid: p.comm for p in rec.processes}
    world = known.world_of(rec.host)
    rank, nranks = (
        zip(*(_comm_rank(rec, c, known) for c in comms), strict=True) if comms else ((), ())
    )
    return {
        "host": host_column(rec.host, len(comms)),
        "pid": pa.array([c.pid or None for c in comms], pa.int64()),
        "world_rank": pa.array([world.get(c.pid) for c in comms], pa.int32()),
        "process": pa.array([comm_of.get(c.pid) or None for c in comms], pa.string()),
        "comm": hex_ids(np.array([c.comm for c in comms], np.uint64)),
        "comm_id_hash": hex_ids(np.array([c.comm_hash for c in comms], np.uint64)),
        "rank": pa.array([r if r >= 0 else None for r in rank], pa.int32()),
        "nranks": pa.array([n if n >= 0 else None for n in nranks], pa.int32()),
        "parent_hash": hex_ids(np.array([c.parent_hash for c in comms], np.uint64)),
        "color": pa.array([c.color if c.color >= 0 else None for c in comms], pa.int32()),
        "key": pa.array([c.key if c.key >= 0 else None for c in comms], pa.int32()),
        "root_addr": pa.array([c.root_addr or None for c in comms], pa.string()),
        "init_ns": on_clock_list(rec, [c.init_ns for c in comms]),
        "destroy_ns": on_clock_list(rec, [c.destroy_ns for c in comms]),
        **_evidence_columns(rec),
    }


_THREAD_COLUMNS: dict[str, pa.DataType] = {
    "snapshot": pa.int32(),
    "reason": pa.string(),
    "timestamp_ns": pa.int64(),
    "host_timestamp_ns": pa.int64(),
    "pid": pa.int64(),
    "world_rank": pa.int32(),
    "world_size": pa.int32(),
    "tid": pa.int64(),
    "thread_name": pa.string(),
    "state": pa.string(),
    "wchan": pa.string(),
    "syscall": pa.string(),
    "syscall_nr": pa.int64(),
    "nccl_call": pa.string(),
    "op": pa.string(),
    "rank": pa.int32(),
    "nranks": pa.int32(),
    "count": pa.int64(),
    "datatype": pa.string(),
    "redop": pa.string(),
    "root": pa.int32(),
    "frames": pa.list_(pa.string()),
    "unwind": pa.string(),
    "python_stack": pa.list_(pa.string()),
    "error": pa.string(),
}


def _thread_row(
    rec: Recording, p: ProcessThreads, t: ThreadState | None, known: Ranks
) -> dict[str, object]:
    world = known.world_of(rec.host).get(p.pid, p.world_rank)
    row: dict[str, object] = {
        "pid": p.pid,
        "host_timestamp_ns": p.taken_ns,
        "world_rank": world,
        "world_size": p.world_size,
        "error": p.error or None,
    }
    if t is None:
        return row
    row |= {
        "tid": t.tid,
        "thread_name": t.name,
        "state": t.state,
        "wchan": t.wchan or None,
        "syscall": syscall_name(t.syscall) or None,
        "syscall_nr": t.syscall if t.syscall >= 0 else None,
        "frames": list(t.frames),
        "unwind": t.unwind,
        "python_stack": list(t.python) or None,
    }
    return row | _call_row(rec, p.pid, t.nccl, known)


def _call_row(rec: Recording, pid: int, call: NcclCall | None, known: Ranks) -> dict[str, object]:
    if call is None:
        return {}
    read = call.args_from is not ArgsFrom.NONE
    found = (c for c in rec.communicators if (c.pid, c.comm) == (pid, call.comm))
    live = next((c for c in found if not c.destroy_ns), None) if call.comm else None
    rank, nranks = _comm_rank(rec, live, known) if live is not None else (-1, -1)
    return {
        "nccl_call": call.symbol,
        "op": op_name(call.op),
        "comm": call.comm,
        "comm_id_hash": live.comm_hash if live is not None else 0,
        "rank": rank if rank >= 0 else None,
        "nranks": nranks if nranks >= 0 else None,
        "count": call.count if read else None,
        "datatype": datatype_name(call.datatype) if read else None,
        "redop": lower_name(RedOp, "redop")(call.redop) if read and call.op in _REDUCING else None,
        "root": call.root if read and call.root >= 0 else None,
    }


_REDUCING = (Op.ALL_REDUCE, Op.REDUCE, Op.REDUCE_SCATTER)


def thread_state_columns(rec: Recording, known: Ranks | None = None) -> Columns:
    known = known if known is not None else Ranks.of([rec])
    rows = []
    for i, snap in enumerate(rec.snapshots):
        for p in snap.processes:
            for t in p.threads or (None,):
                rows.append({"snapshot": i, "reason": snap.reason} | _thread_row(rec, p, t, known))
    cols: Columns = {"host": host_column(rec.host, len(rows))}
    for name, kind in _THREAD_COLUMNS.items():
        cols[name] = pa.array([r.get(name) for r in rows], kind)
    for name in ("comm", "comm_id_hash"):  # ids as every table writes them
        cols[name] = hex_ids(np.array([r.get(name) or 0 for r in rows], np.uint64))
    ts = np.array([r["host_timestamp_ns"] for r in rows], dtype=np.int64)
    cols["timestamp_ns"] = on_clock(rec, ts, np.zeros(len(ts), dtype=bool))
    cols["wall_time"] = wall(cols["timestamp_ns"])
    return cols


Builder = Callable[[Recording, Ranks | None], Columns]

BUILDERS: dict[str, Builder] = {
    "nccl_events": nccl_columns,
    "cuda_graphs": cuda_graph_columns,
    "comm_events": comm_event_columns,
    "tcp_events": tcp_columns,
    "sched_events": sched_columns,
    "exit_events": exit_columns,
    "link_events": link_event_columns,
    "conn_samples": conn_sample_columns,
    "iface_samples": iface_sample_columns,
    "probes": probe_columns,
    "processes": process_columns,
    "communicators": communicator_columns,
    "links": link_columns,
    "thread_states": thread_state_columns,
}


def _unify(parts: Sequence[pa.Table]) -> pa.Table:
    if len(parts) == 1:
        return parts[0]
    # Each part has its own dictionaries (host, ids); Arrow keeps them chunk by chunk.
    return pa.concat_tables(parts)


def tables(
    recordings: Recording | Iterable[Recording], known: Ranks | None = None
) -> dict[str, pa.Table]:
    """Every SQL table over one or many recordings, rows concatenated in the
    order the recordings are given; ranks as ``known`` says (derived over
    their whole incident), by default derived over the recordings given."""
    recs = [recordings] if isinstance(recordings, Recording) else list(recordings)
    known = Ranks.of(recs) if known is None else known
    out: dict[str, pa.Table] = {}
    for name, build in BUILDERS.items():
        if recs:
            out[name] = _unify([pa.table(build(r, known)) for r in recs])
        else:
            out[name] = pa.table(build(_EMPTY, known))
    return out


def _empty_recording() -> Recording:
    from .model import Clock, Ring

    rings = {name: Ring(np.zeros(0, dtype)) for name, dtype in RING_DTYPES.items()}
    return Recording("", "", Clock(0, 0), (), (), rings)


_EMPTY = _empty_recording()

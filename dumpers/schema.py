"""Event records, enums and identities shared by the recorder and the analyzer.

Today's records and the constants the BPF programs share are written once,
in ``dumpers.layout`` (``bpf/events.h`` is generated from it); this module
keeps the records of older dump formats, the symbol tables, the id folds and
the names.  Strings are interned as small integers in the columnar data; the
tables below map them back to names.
"""

from __future__ import annotations

import enum
import ipaddress
import struct
from typing import Any

import numpy as np

from . import layout
from .layout import (
    EventKind,
    ExitEvent,
    LinkEvent,
    LinkKind,
    Op,
    ProbeKind,
    ProbeOutcome,
    ProbeRole,
    Result,
    State,
    TcpEvent,
)

__all__ = [
    "EventKind",
    "ExitEvent",
    "LinkEvent",
    "LinkKind",
    "Op",
    "ProbeKind",
    "ProbeOutcome",
    "ProbeRole",
    "Result",
    "State",
    "TcpEvent",
]

UNIQUE_ID_BYTES = 128
MASK64 = (1 << 64) - 1


COLLECTIVE_OPS = frozenset(op for op in Op if op.is_collective)
P2P_OPS = frozenset({Op.SEND, Op.RECV})
LIFECYCLE_OPS = frozenset(op for op in Op if Op.COMM_INIT_RANK <= op <= Op.GET_UNIQUE_ID)

# NCCL symbol -> op.  ncclBcast is the in-place ncclBroadcast.
NCCL_SYMBOLS: dict[str, Op] = {
    "ncclAllReduce": Op.ALL_REDUCE,
    "ncclAllGather": Op.ALL_GATHER,
    "ncclReduceScatter": Op.REDUCE_SCATTER,
    "ncclBroadcast": Op.BROADCAST,
    "ncclBcast": Op.BROADCAST,
    "ncclReduce": Op.REDUCE,
    "ncclAlltoAll": Op.ALL_TO_ALL,
    "ncclGather": Op.GATHER,
    "ncclScatter": Op.SCATTER,
    "ncclSend": Op.SEND,
    "ncclRecv": Op.RECV,
    "ncclGroupStart": Op.GROUP_START,
    "ncclGroupEnd": Op.GROUP_END,
    "ncclCommInitRank": Op.COMM_INIT_RANK,
    "ncclCommInitRankConfig": Op.COMM_INIT_RANK_CONFIG,
    "ncclCommInitAll": Op.COMM_INIT_ALL,
    "ncclCommSplit": Op.COMM_SPLIT,
    "ncclCommDestroy": Op.COMM_DESTROY,
    "ncclCommAbort": Op.COMM_ABORT,
    "ncclCommFinalize": Op.COMM_FINALIZE,
    "ncclGetUniqueId": Op.GET_UNIQUE_ID,
}


# CUDA runtime functions probed (bpf/cuda.c), in every libcudart.so.<major>:
# symbol -> whether its return is probed too (the answer of a query or sync).
CUDA_SYMBOLS: dict[str, bool] = {
    "cudaEventRecord": False,
    "cudaEventRecord_ptsz": False,
    "cudaEventRecordWithFlags": False,
    "cudaEventRecordWithFlags_ptsz": False,
    "cudaStreamWaitEvent": False,
    "cudaStreamWaitEvent_ptsz": False,
    "cudaEventQuery": True,
    "cudaEventSynchronize": True,
    "cudaStreamQuery": True,
    "cudaStreamQuery_ptsz": True,
    "cudaStreamSynchronize": True,
    "cudaStreamSynchronize_ptsz": True,
    "cudaStreamBeginCapture": True,
    "cudaStreamBeginCapture_ptsz": True,
    "cudaStreamEndCapture": True,
    "cudaStreamEndCapture_ptsz": True,
    "cudaStreamIsCapturing": True,
    "cudaStreamIsCapturing_ptsz": True,
    "cudaStreamGetCaptureInfo": True,
    "cudaStreamGetCaptureInfo_ptsz": True,
    "cudaGraphInstantiate": True,
    "cudaGraphInstantiateWithFlags": True,
    "cudaGraphExecDestroy": False,
    "cudaGraphDestroy": False,
    "cudaGraphLaunch": True,
    "cudaGraphLaunch_ptsz": True,
    "cudaDeviceSynchronize": True,
}


class DataType(enum.IntEnum):
    """``ncclDataType_t`` values (aliases: ncclChar=Int8, ncclInt=Int32, ...)."""

    INT8 = 0
    UINT8 = 1
    INT32 = 2
    UINT32 = 3
    INT64 = 4
    UINT64 = 5
    FLOAT16 = 6
    FLOAT32 = 7
    FLOAT64 = 8
    BFLOAT16 = 9
    FLOAT8E4M3 = 10
    FLOAT8E5M2 = 11


DATATYPE_SIZE: dict[int, int] = {
    DataType.INT8: 1,
    DataType.UINT8: 1,
    DataType.INT32: 4,
    DataType.UINT32: 4,
    DataType.INT64: 8,
    DataType.UINT64: 8,
    DataType.FLOAT16: 2,
    DataType.FLOAT32: 4,
    DataType.FLOAT64: 8,
    DataType.BFLOAT16: 2,
    DataType.FLOAT8E4M3: 1,
    DataType.FLOAT8E5M2: 1,
}


class RedOp(enum.IntEnum):
    SUM = 0
    PROD = 1
    MAX = 2
    MIN = 3
    AVG = 4


class TcpState(enum.IntEnum):
    """The kernel's TCP states (include/net/tcp_states.h)."""

    ESTABLISHED = 1
    SYN_SENT = 2
    SYN_RECV = 3
    FIN_WAIT1 = 4
    FIN_WAIT2 = 5
    TIME_WAIT = 6
    CLOSE = 7
    CLOSE_WAIT = 8
    LAST_ACK = 9
    LISTEN = 10
    CLOSING = 11
    NEW_SYN_RECV = 12
    BOUND_INACTIVE = 13


# The kernel's names of a link's states, as sysfs spells them (the value is
# the index): a netdev's operstate (IF_OPER_*, /sys/class/net/*/operstate),
# an RDMA port's state and phys_state (/sys/class/infiniband/*/ports/*/).
OPERSTATES = ("unknown", "notpresent", "down", "lowerlayerdown", "testing", "dormant", "up")
PORT_STATES = ("NOP", "DOWN", "INIT", "ARMED", "ACTIVE", "ACTIVE_DEFER")
PHYS_STATES = ("<unknown>", "Sleep", "Polling", "Disabled", "PortConfigurationTraining",
               "LinkUp", "LinkErrorRecovery", "Phy Test")  # fmt: skip
PHYS_LINK_UP = 5


# Today's records come from dumpers.layout (bpf/events.h is generated from
# it); the lists below are the history older dump formats were written in.
_HEADER: list[tuple[str, str]] = [(f.name, f.numpy[1]) for f in layout.HEADER.fields]

_NCCL_V1_FIELDS: list[tuple[str, str]] = [
    *_HEADER,
    ("end_ns", "<u8"),
    ("comm", "<u8"),
    ("comm_hash", "<u8"),
    ("count", "<u8"),
    ("bytes", "<u8"),
    ("stream", "<u8"),
    ("seq", "<u8"),
    ("rank", "<i4"),
    ("nranks", "<i4"),
    ("peer", "<i4"),
    ("result", "<i4"),
    ("op", "u1"),
    ("datatype", "u1"),
    ("redop", "u1"),
    ("state", "u1"),
    ("_pad1", "<u4"),
]
# The device-side columns the CUDA probes fill (format version 2 on).
DEVICE_FIELDS = ("started_ns", "started_after_ns", "completed_ns", "completed_after_ns")
_DEVICE = [(name, "<u8") for name in DEVICE_FIELDS]
# CUDA graphs (format version 4 on): `graph_node` where `_pad1` was, and the
# capture and launch a row belongs to (dumpers/layout.py says how).
GRAPH_FIELDS = ("graph_node", "graph", "replay")
NCCL_EVENT = layout.NCCL.dtype
NCCL_EVENT_V1 = np.dtype(_NCCL_V1_FIELDS)
NCCL_EVENT_V3 = np.dtype([*_NCCL_V1_FIELDS, *_DEVICE])

COMM_EVENT = layout.COMM.dtype
TCP_EVENT = layout.TCP.dtype
# Before format version 7 a TCP row was its addresses, event and states
# alone: the connection's state (backoff where `_pad1` was, and all after
# `newstate`) reads as unknown (`conn_known` 0).
TCP_EVENT_V6 = np.dtype(
    [
        *_HEADER,
        ("skaddr", "<u8"),
        ("saddr", "u1", (16,)),
        ("daddr", "u1", (16,)),
        ("sport", "<u2"),
        ("dport", "<u2"),
        ("family", "<u2"),
        ("event", "u1"),
        ("_pad1", "u1"),
        ("state", "<i4"),
        ("newstate", "<i4"),
    ]
)

# `prev_pid` (format version 5 on): the process that held the CPU until the
# waiting thread got it, the last one only (0: the idle task); where `_pad1`
# was, so that older rows read as PREV_PID_UNKNOWN.
SCHED_EVENT = layout.SCHED.dtype
SCHED_EVENT_V4 = np.dtype([*_HEADER, ("delay_ns", "<u8"), ("cpu", "<u4"), ("_pad1", "<u4")])
PREV_PID_UNKNOWN = -1

EXIT_EVENT = layout.EXIT.dtype
LINK_EVENT = layout.LINK.dtype
CONN_SAMPLE = layout.CONN.dtype
IFACE_SAMPLE = layout.IFACE.dtype
PROBE_EVENT = layout.PROBE.dtype

# Ring name -> record dtype.  The names are those of the dump file's "rings".
RING_DTYPES: dict[str, np.dtype] = {name: s.dtype for name, s in layout.RING_STRUCTS.items()}

# Dump format version -> the rings whose dtype was different then (dumpers.format
# reads them and converts their rows to today's dtype).
RING_DTYPES_BEFORE: dict[int, dict[str, np.dtype]] = {
    1: {"nccl": NCCL_EVENT_V1},
    3: {"nccl": NCCL_EVENT_V3},
    4: {"sched": SCHED_EVENT_V4},
    6: {"tcp": TCP_EVENT_V6},
}


# link_event fields past the header, after_ns and link that hold a value or
# "unknown" (all ones in their width: layout.UNKNOWN_U8/U32/U64)
LINK_VALUE_FIELDS = tuple(
    f.name
    for f in layout.LINK.fields
    if f.name not in ("after_ns", "link", "link_kind", "event") and not f.name.startswith("_")
)


def blank_link_rows(n: int) -> np.ndarray:
    """``n`` link rows whose every state and counter is unknown."""
    rows = np.zeros(n, LINK_EVENT)
    rows["kind"] = EventKind.LINK
    rows["size"] = LINK_EVENT.itemsize
    for name in LINK_VALUE_FIELDS:
        rows[name] = np.iinfo(rows.dtype[name]).max
    return rows


# Rings that older dump formats did not have: name -> the first version with it.
RING_SINCE: dict[str, int] = {"link": 7, "conn_samples": 9, "iface_samples": 9, "probes": 9}


def captured_rows(rows: np.ndarray) -> np.ndarray:
    """Which NCCL rows are calls captured into a CUDA graph: not executed
    (each launch of the graph writes their replays as rows of their own)."""
    mask: np.ndarray = (rows["graph"] != 0) & (rows["replay"] == 0)
    return mask


def ring_dtype(name: str, version: int) -> np.dtype:
    """The dtype of ring ``name`` in a dump of format ``version``."""
    for v in sorted(RING_DTYPES_BEFORE):
        if version <= v and name in RING_DTYPES_BEFORE[v]:
            return RING_DTYPES_BEFORE[v][name]
    return RING_DTYPES[name]


def splitmix64(x: int) -> int:
    """One step of splitmix64 (Steele, Lea, Flood 2014) on a 64-bit value."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    z = x
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def fold_unique_id(unique_id: bytes) -> int:
    """The 64-bit communicator id: every 8-byte little-endian word of the
    128-byte ``ncclUniqueId`` folded in order with ``h = splitmix64(h ^ w)``.
    ``bpf/nccl.c`` computes the same value in the kernel."""
    if len(unique_id) != UNIQUE_ID_BYTES:
        raise ValueError(f"ncclUniqueId must be {UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
    h = 0
    for (word,) in struct.iter_unpack("<Q", unique_id):
        h = splitmix64(h ^ word)
    return h


SPLIT_TAG = 0x73706C6974636F6D  # "splitcom"


def split_hash(parent_hash: int, color: int, split_index: int) -> int:
    """Id of a communicator made by the ``split_index``-th (0-based)
    ``ncclCommSplit`` on a parent: the same on every member, because all of
    them split the same parent the same number of times with the same color."""
    h = splitmix64(parent_hash ^ SPLIT_TAG)
    h = splitmix64(h ^ (color & 0xFFFFFFFF))
    return splitmix64(h ^ (split_index & MASK64))


def decode_root_address(unique_id: bytes) -> str | None:
    """The bootstrap root's address that NCCL stores after an 8-byte magic:
    a ``sockaddr_in`` or ``sockaddr_in6`` (family in host order, port in
    network order).  Returns ``"host:port"`` or None if it is not one."""
    if len(unique_id) < 36:
        return None
    (family,) = struct.unpack_from("<H", unique_id, 8)
    (port,) = struct.unpack_from(">H", unique_id, 10)
    if family == 2:  # AF_INET
        return f"{ipaddress.IPv4Address(unique_id[12:16])}:{port}"
    if family == 10:  # AF_INET6
        return f"[{ipaddress.IPv6Address(unique_id[16:32])}]:{port}"
    return None


def arrival_lateness(start: Any, first_start: Any, own: Any, quickest_own: Any) -> Any:
    """How late a member of a collective arrived (the agent's slowdown
    trigger and the analyzer's arrival scores read it alike): after the
    first member to arrive, and no more than its own side took beyond the
    quickest member's.  On the host ``own`` is the entry itself, and the two
    agree; on a device it is the wait from the host's entry to the device's
    start: a device that starts late because its host enqueued late, on time
    for its queue, is late by its host's lateness, not its own.  Integers
    or numpy arrays alike."""
    return np.minimum(start - first_start, own - quickest_own)


def op_name(op: int) -> str:
    try:
        return Op(op).name
    except ValueError:
        return f"OP_{op}"


def datatype_name(datatype: int) -> str:
    try:
        return DataType(datatype).name.lower()
    except ValueError:
        return f"dtype_{datatype}"

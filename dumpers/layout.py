"""Every record the rings hold, and every constant the BPF programs share
with Python, written once.

``bpf/events.h`` is generated from this module and never edited by hand::

    python -m stallwatch.dumpers.layout --write    # regenerate bpf/events.h
    python -m stallwatch.dumpers.layout --check    # exit 1 if it is stale (scripts/check)

A record is a ``Struct`` of ``Field``s with explicit padding; the numpy
dtype (``Struct.dtype``) and the C struct (with a ``_Static_assert`` on its
size and on every field's offset) are both derived from it, so they cannot
drift.  The enums below give the C ``#define``s: each C name is the enum's
prefix and the member's name (``Op.ALL_REDUCE`` is ``OP_ALL_REDUCE``), so
a value has one name on both sides.  Records of older dump formats are not
here: ``dumpers.schema`` keeps them as history.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# ---- the constants -----------------------------------------------------------


class EventKind(enum.IntEnum):
    """``event_header.kind``: which ring a record belongs to."""

    NCCL = 1
    COMM = 2
    TCP = 3
    SCHED = 4
    EXIT = 5
    LINK = 6  # written by the agent (recorder.links), not by a BPF program
    CONN_SAMPLE = 7  # written by the agent (recorder.netsamples): a job connection's tcp_info
    IFACE_SAMPLE = 8  # written by the agent (recorder.netsamples): a job interface's counters
    PROBE = 9  # written by the agent (recorder.pathprobe, recorder.pathecho): probes of a path
    DISC = 16  # discovery: not a dump ring


class Op(enum.IntEnum):
    """NCCL call kinds (``nccl_event.op``, ``comm_event.op``); ``name`` is
    the SQL spelling (``ALL_REDUCE``)."""

    UNKNOWN = 0
    ALL_REDUCE = 1
    ALL_GATHER = 2
    REDUCE_SCATTER = 3
    BROADCAST = 4  # ncclBroadcast and ncclBcast
    REDUCE = 5
    ALL_TO_ALL = 6
    GATHER = 7
    SCATTER = 8
    SEND = 9
    RECV = 10
    GROUP_START = 11
    GROUP_END = 12
    COMM_INIT_RANK = 13
    COMM_INIT_RANK_CONFIG = 14
    COMM_INIT_ALL = 15
    COMM_SPLIT = 16
    COMM_DESTROY = 17
    COMM_ABORT = 18
    COMM_FINALIZE = 19
    GET_UNIQUE_ID = 20
    BARRIER = 21  # Flight Recorder only: NCCL has no barrier call (torch reduces a word)
    GRAPH_LAUNCH = 22  # cudaGraphLaunch of a graph that captured NCCL calls (bpf/cuda.c)

    @property
    def is_collective(self) -> bool:
        return Op.ALL_REDUCE <= self <= Op.SCATTER or self is Op.BARRIER

    @property
    def is_p2p(self) -> bool:
        return self in (Op.SEND, Op.RECV)


class State(enum.IntEnum):
    """Lifecycle: the furthest state a call reached, as the host observed it."""

    SCHEDULED = 0  # the host entered the call
    ENQUEUED = 1  # the call returned: queued on its stream (or done, if blocking)
    STARTED = 2  # the device began it (its start event was seen done)
    COMPLETED = 3  # the device finished it (its end event, or a sync, was seen done)


class Result(enum.IntEnum):
    """``ncclResult_t``; PENDING (-1) marks a call that has not returned."""

    PENDING = -1
    SUCCESS = 0
    UNHANDLED_CUDA_ERROR = 1
    SYSTEM_ERROR = 2
    INTERNAL_ERROR = 3
    INVALID_ARGUMENT = 4
    INVALID_USAGE = 5
    REMOTE_ERROR = 6
    IN_PROGRESS = 7


class TcpEvent(enum.IntEnum):
    """``tcp_event.event``: the kernel event a TCP row records (the SQL
    spelling is the name in lower case, the tracepoint's)."""

    TCP_RETRANSMIT_SKB = 1
    INET_SOCK_SET_STATE = 2
    TCP_SEND_RESET = 3  # this end sent a reset (the socket, or a segment no socket took)
    TCP_RECEIVE_RESET = 4  # the peer reset the connection
    # not a kernel event: the connection's state when the agent dumped (its
    # sock_diag read of struct tcp_info), one row per job connection
    TCP_INFO = 5


class ExitEvent(enum.IntEnum):
    """``exit_event.event``."""

    EXIT_GROUP = 1  # exit code seen (uprobe on libc _exit(status))
    SIGNAL = 2  # fatal signal generated for or delivered to it
    PROCESS_EXIT = 3  # the thread group is dead (sched_process_exit)


class DiscEvent(enum.IntEnum):
    """``disc_event.event``: what tells the agent a process may map a new library."""

    EXEC = 1  # sched_process_exec: a new program image
    LINKMAP = 2  # the dynamic loader's _dl_debug_state(): libraries came or went


class LinkKind(enum.IntEnum):
    """``link_event.link_kind``: what the row's interface is."""

    NETDEV = 1  # a network interface (rtnetlink)
    RDMA = 2  # a port of an RDMA device (sysfs: InfiniBand, RoCE)


class LinkEvent(enum.IntEnum):
    """``link_event.event``: why the agent wrote the row (the SQL spelling
    is the name in lower case).  One row says the strongest reason."""

    SEEN = 1  # the interface's first row (the agent started, or it appeared)
    HEARTBEAT = 2  # nothing changed for the heartbeat period: the state as it stands
    CARRIER_DOWN = 3  # carrier lost since the previous sample (RDMA: phys_state left LinkUp)
    CARRIER_UP = 4  # carrier back
    CARRIER_FLAP = 5  # carrier the same, but it went down and up (or up and down) in between
    STATE = 6  # another state changed: admin up/down, operstate, port state
    ERRORS = 7  # an error, drop or discard counter moved
    GONE = 8  # the interface is no more (every value unknown)


class ProbeKind(enum.IntEnum):
    """``probe_event.probe``: how a path between two of the job's nodes was
    probed (the SQL spelling is the name in lower case)."""

    ICMP = 1  # ICMP echo: the peer's kernel answers, whether its agent lives or not
    UDP = 2  # datagrams to the peer agent's responder, each answered by a small one
    TCP = 3  # a short TCP exchange with the peer agent's responder: RTT and throughput


class ProbeRole(enum.IntEnum):
    """``probe_event.role``: whose probes a row counts."""

    SENT = 1  # this host sent them to the peer; `answered` counts the answers that came back
    RECEIVED = 2  # the peer sent them to this host; `answered` counts those that arrived here


class ProbeOutcome(enum.IntEnum):
    """``probe_event.outcome``: what became of a row's probes."""

    OK = 1  # every one answered (received: every one the peer sent arrived)
    PARTIAL = 2  # some answered, some not
    LOST = 3  # none answered and nothing came back to say why
    FRAG_NEEDED = 4  # an ICMP "fragmentation needed" came back (the MTU it named: `mtu`)
    UNREACHABLE = 5  # an ICMP destination unreachable (host, net, prohibited) came back
    REFUSED = 6  # the peer's host answered that nobody listens: its agent is not there
    ERROR = 7  # not sent: a local error (`err`: the errno)


# enum -> the prefix of its C names
C_PREFIXES: tuple[tuple[type[enum.IntEnum], str], ...] = (
    (EventKind, "EVENT_"),
    (Op, "OP_"),
    (State, "STATE_"),
    (Result, "RESULT_"),
    (TcpEvent, "TCPEV_"),
    (ExitEvent, "EXITEV_"),
    (DiscEvent, "DISC_"),
    (LinkKind, "LINK_"),
    (LinkEvent, "LINKEV_"),
    (ProbeKind, "PROBE_"),
    (ProbeRole, "PROBEROLE_"),
    (ProbeOutcome, "PROBEOUT_"),
)

# The rings the BPF programs write, in the order of their heads and loss
# counters (``RING_<NAME>`` in C); the discovery ring's head is the last one.
# The link ring and the agent's network rings (RING_STRUCTS) are the agent's
# own and have neither.
RINGS = ("nccl", "comm", "tcp", "sched", "exit")
DISC_HEAD = 7
HEADS = 8  # struct ring_head slots in `heads`
# Loss counters after the rings' own (index 0..4: a ring's claim failed):
# (C name after DROP_, the counter's name in dumps and /metrics).
KERNEL_COUNTERS: tuple[tuple[str, str], ...] = (
    ("INFLIGHT_FULL", "kernel_inflight_full"),  # `inflight` full: the call is not recorded
    ("COMMS_FULL", "kernel_comms_full"),  # `comms` full: the communicator is unknown
    ("OWNER_FULL", "kernel_sock_owner_full"),  # `sock_owner` full: a socket stays unattributed
    ("RQ_FULL", "kernel_runq_maps_full"),  # run-queue maps full
    ("CUDA_QUEUE", "kernel_cuda_queue_full"),  # a stream queued more calls than cuda.h keeps
    ("GRAPH_FULL", "kernel_graph_full"),  # a graph captured more calls than cuda.h keeps
    ("TCP_FILTERED", "kernel_tcp_filtered"),  # TCP events of no job socket: left out, not lost
    ("CONN_FULL", "kernel_conn_state_full"),  # `conn_state` full: a row without connection state
)
DROP_NAMES: tuple[str, ...] = (
    *(f"kernel_lost_{ring}" for ring in RINGS),
    *(name for _, name in KERNEL_COUNTERS),
)

# ---- the records -------------------------------------------------------------

_NUMPY = {"u8": "u1", "u16": "<u2", "u32": "<u4", "u64": "<u8", "s32": "<i4", "s64": "<i8"}
_C = {"u8": "__u8", "u16": "__u16", "u32": "__u32", "u64": "__u64", "s32": "__s32", "s64": "__s64"}


@dataclass(frozen=True, slots=True)
class Field:
    name: str
    ctype: str  # u8 u16 u32 u64 s32 s64
    count: int = 1  # > 1: an array
    note: str = ""

    @property
    def numpy(self) -> tuple[str, str] | tuple[str, str, tuple[int]]:
        fmt = _NUMPY[self.ctype]
        return (self.name, fmt, (self.count,)) if self.count > 1 else (self.name, fmt)

    def c(self) -> str:
        dims = f"[{self.count}]" if self.count > 1 else ""
        return f"{_C[self.ctype]} {self.name}{dims};"


@dataclass(frozen=True, slots=True)
class Struct:
    """A record: ``struct event_header hdr`` first (its fields come first in
    the dtype, flattened), then ``fields``."""

    name: str
    fields: tuple[Field, ...]
    note: str = ""
    with_header: bool = True

    @property
    def all_fields(self) -> tuple[Field, ...]:
        return (*HEADER.fields, *self.fields) if self.with_header else self.fields

    @property
    def dtype(self) -> np.dtype:
        return np.dtype([f.numpy for f in self.all_fields])


HEADER = Struct(
    "event_header",
    (
        Field("pos", "u64", note="ring position + 1, written last; 0 = never written"),
        Field("ts_ns", "u64", note="bpf_ktime_get_ns(): CLOCK_MONOTONIC"),
        Field("kind", "u16", note="EVENT_*"),
        Field("size", "u16", note="sizeof the whole record"),
        Field("pid", "u32", note="thread group id (owner process for tcp events)"),
        Field("tid", "u32"),
        Field("_pad0", "u32"),
    ),
    "Every record begins with it.",
    with_header=False,
)

NCCL = Struct(
    "nccl_event",
    (
        Field("end_ns", "u64", note="return time, 0 while in flight"),
        Field("comm", "u64", note="ncclComm_t as a pointer value"),
        Field("comm_hash", "u64", note="folded ncclUniqueId, 0 if the comm is unknown"),
        Field("count", "u64", note="elements"),
        Field("bytes", "u64", note="count * sizeof(datatype)"),
        Field("stream", "u64"),
        Field("seq", "u64", note="per-communicator (p2p: per peer and direction)"),
        Field("rank", "s32", note="rank in comm, -1 if unknown"),
        Field("nranks", "s32"),
        Field("peer", "s32", note="root or peer, -1 if none"),
        Field("result", "s32", note="ncclResult_t, RESULT_PENDING while in flight"),
        Field("op", "u8"),
        Field("datatype", "u8"),
        Field("redop", "u8"),
        Field("state", "u8"),
        Field(
            "graph_node", "u32", note="1-based place of the call in its graph's capture, 0: none"
        ),
        Field("started_ns", "u64"),
        Field("started_after_ns", "u64"),
        Field("completed_ns", "u64"),
        Field("completed_after_ns", "u64"),
        Field("graph", "u64", note="the process's capture number (1-based), 0: not in a graph"),
        Field(
            "replay", "u64", note="the graph executable's launch number (1-based), 0: not a replay"
        ),
    ),
    """One row per NCCL API call: opened at entry, completed at return; the CUDA
probes (cuda.c) add when the device started and completed it, each as the
first observation that says so and the last that said not yet: the device
event lies in (*_after_ns, *_ns].  0 = not observed.

CUDA graphs (cuda.c): a call made on a stream being captured is a row with
`graph` set and `replay` 0 (captured, not executed: no seq, never on a
stream).  Each successful cudaGraphLaunch of a graph that captured NCCL
calls writes one row with op OP_GRAPH_LAUNCH (comm: the cudaGraphExec_t,
count: the calls it replays, seq: 0) and then one row per captured call,
in capture order, as if the call were made again: its own per-communicator
seq, queued on the launch's stream, `graph`, `graph_node` and `replay`
saying where it came from.""",
)

COMM = Struct(
    "comm_event",
    (
        Field("end_ns", "u64"),
        Field("comm", "u64"),
        Field("comm_hash", "u64"),
        Field("parent_hash", "u64", note="split: parent's hash, else 0"),
        Field("rank", "s32"),
        Field("nranks", "s32"),
        Field("color", "s32"),
        Field("key", "s32"),
        Field("op", "u8"),
        Field("state", "u8"),
        Field("_pad1", "u16"),
        Field("result", "s32"),
        Field("unique_id", "u8", 128, "the full ncclUniqueId where the call carries one"),
    ),
    "Communicator lifecycle (init, split, destroy, abort, finalize, unique id).",
)

TCP = Struct(
    "tcp_event",
    (
        Field("skaddr", "u64"),
        Field(
            "saddr",
            "u8",
            16,
            "this end's address; IPv4 in the first 4 bytes when family == AF_INET",
        ),
        Field("daddr", "u8", 16, "the peer's"),
        Field("sport", "u16"),
        Field("dport", "u16"),
        Field("family", "u16"),
        Field("event", "u8", note="TCPEV_*"),
        Field("backoff", "u8", note="retransmission timeouts in a row, this one included, 0: none"),
        Field("state", "s32", note="tcp state (old state for TCPEV_INET_SOCK_SET_STATE)"),
        Field("newstate", "s32", note="TCPEV_INET_SOCK_SET_STATE only"),
        # the connection as the kernel had it (retransmits), when conn_known
        Field("no_ack_ns", "u64", note="nothing acknowledged for at least this long"),
        Field("srtt_us", "u32", note="smoothed round-trip time"),
        Field("rto_us", "u32", note="retransmission timeout, 0: unknown"),
        Field("unacked", "u32", note="bytes sent and not acknowledged"),
        Field("packets_out", "u32", note="segments in flight"),
        Field("retrans_out", "u32", note="of them, retransmitted"),
        Field("reason", "u16", note="resets: enum sk_rst_reason"),
        Field("conn_known", "u8", note="1: the fields from no_ack_ns on were read, 0: unknown"),
        Field("other", "u8", note="1: not the job's connection, a sample (see tcp.c)"),
        Field("err", "s32", note="retransmits: the send's result (0, or -errno: not sent)"),
        Field("_pad2", "u32"),
    ),
    """A TCP event of a job's socket, decided in the kernel (bpf/tcp.c): the
header's pid is the owning process, 0 if unknown.  Retransmits carry the
connection's state as the kernel had it (read by the sock_ops program: the
row is completed right after it is written), resets their reason.  A
retransmit of another connection to a host the job talks to is a sample
(`other` 1, pid 0): at most one a second per pair of addresses.""",
)

SCHED = Struct(
    "sched_event",
    (Field("delay_ns", "u64"), Field("cpu", "u32"), Field("prev_pid", "s32")),
    """A rank thread that waited in the run queue longer than the threshold.
prev_pid: the process (tgid) that held the CPU until the thread got it,
0 for the idle task.  Only the last holder is known: a long wait may have
seen others run before it.  Dumps before format 5 had padding here; their
rows read as -1 (unknown).""",
)

EXIT = Struct(
    "exit_event",
    (
        Field("code", "s32", note="exit_group code, or -1"),
        Field("signal", "s32", note="fatal signal number, or 0"),
        Field("event", "u8", note="EXITEV_*"),
        Field("_pad1", "u8", 7),
    ),
    "A rank process's exit: its code, a fatal signal, its end.",
)

# ---- link_event: written by the agent ------------------------------------------

# Unknown, in a link_event: a value the interface does not have or that could
# not be read (SQL turns it into NULL).  Never 0: 0 is a count.
UNKNOWN_U8 = 0xFF
UNKNOWN_U32 = 0xFFFF_FFFF
UNKNOWN_U64 = 0xFFFF_FFFF_FFFF_FFFF

# A network interface's counters: struct rtnl_link_stats64 (IFLA_STATS64) in
# the kernel's order, without rx_compressed and tx_compressed.
NETDEV_COUNTERS = (
    "rx_packets", "tx_packets", "rx_bytes", "tx_bytes", "rx_errors", "tx_errors",
    "rx_dropped", "tx_dropped", "multicast", "collisions", "rx_length_errors",
    "rx_over_errors", "rx_crc_errors", "rx_frame_errors", "rx_fifo_errors",
    "rx_missed_errors", "tx_aborted_errors", "tx_carrier_errors", "tx_fifo_errors",
    "tx_heartbeat_errors", "tx_window_errors", "rx_nohandler", "rx_otherhost_dropped",
)  # fmt: skip
# An RDMA port's counters/ files (Documentation/ABI/stable/sysfs-class-infiniband:
# the PortCounters of the InfiniBand specification; port_*_data count 4-byte
# words), VL15_dropped as vl15_dropped.
RDMA_COUNTERS = (
    "symbol_error", "port_rcv_errors", "port_rcv_remote_physical_errors",
    "port_rcv_switch_relay_errors", "link_error_recovery", "port_xmit_constraint_errors",
    "port_rcv_constraint_errors", "local_link_integrity_errors",
    "excessive_buffer_overrun_errors", "port_xmit_data", "port_rcv_data",
    "port_xmit_packets", "port_rcv_packets", "unicast_rcv_packets", "unicast_xmit_packets",
    "multicast_rcv_packets", "multicast_xmit_packets", "link_downed", "port_xmit_discards",
    "vl15_dropped", "port_xmit_wait",
)  # fmt: skip
# Of an RDMA port's hw_counters/ (each driver's own set; these are mlx5's
# names, drivers/infiniband/hw/mlx5/counters.c; a driver without one leaves
# it unknown): transport errors and retransmissions, then congestion (ECN
# marks, CNPs).
RDMA_HW_COUNTERS = (
    "out_of_sequence", "packet_seq_err", "out_of_buffer", "local_ack_timeout_err",
    "rnr_nak_retry_err", "implied_nak_seq_err", "duplicate_request", "req_cqe_error",
    "resp_cqe_error", "rx_icrc_encapsulated", "roce_adp_retrans", "roce_slow_restart",
    "np_ecn_marked_roce_packets", "np_cnp_sent", "rp_cnp_handled", "rp_cnp_ignored",
)  # fmt: skip
LINK_COUNTERS = (*NETDEV_COUNTERS, *RDMA_COUNTERS, *RDMA_HW_COUNTERS)

LINK = Struct(
    "link_event",
    (
        Field("after_ns", "u64", note="the interface's previous sample: a change lies after it"),
        Field("link", "u32", note="the interface: its id in the dump's links table"),
        Field("link_kind", "u8", note="LINK_*"),
        Field("event", "u8", note="LINKEV_*"),
        Field("carrier", "u8", note="1 up, 0 down (RDMA: phys_state LinkUp or not)"),
        Field("admin_up", "u8", note="netdev: IFF_UP"),
        Field("operstate", "u8", note="netdev: IF_OPER_* (RFC 2863)"),
        Field("port_state", "u8", note="RDMA: DOWN 1, INIT 2, ARMED 3, ACTIVE 4, ACTIVE_DEFER 5"),
        Field("phys_state", "u8", note="RDMA: Sleep 1 ... LinkUp 5, LinkErrorRecovery 6"),
        Field("_pad1", "u8"),
        Field("carrier_changes", "u32", note="netdev: IFLA_CARRIER_CHANGES"),
        Field("carrier_up_count", "u32"),
        Field("carrier_down_count", "u32"),
        *(Field(name, "u64") for name in LINK_COUNTERS),
    ),
    """One sample of an interface's state and counters, written by the agent
(recorder.links, not a BPF program) when the state changed or an error
counter moved since the interface's previous row, and at least every
heartbeat.  The header's pid and tid are 0.  Every value the interface does
not have or that could not be read is unknown: 0xff, 0xffffffff or
0xffffffffffffffff by its width.  netdev rows leave the RDMA fields
unknown and RDMA rows the netdev ones.""",
)

# ---- the agent's network samples and probes ------------------------------------

# The fields of conn_sample that hold a value of struct tcp_info (the kernel's
# name without `tcpi_`, times in the unit of its suffix) or "unknown" (all
# ones in their width: a kernel whose struct tcp_info is shorter than the
# field's place does not have it).  Names match tcp_event's where they mean
# the same (saddr, daddr, sport, dport, state, backoff, srtt_us, rto_us,
# retrans_out).
CONN = Struct(
    "conn_sample",
    (
        Field("saddr", "u8", 16, "this end's address; IPv4 in the first 4 bytes"),
        Field("daddr", "u8", 16, "the peer's"),
        Field("sport", "u16"),
        Field("dport", "u16"),
        Field("family", "u16", note="AF_INET or AF_INET6"),
        Field("state", "u8", note="TCP state (TCP_ESTABLISHED 1 ...)"),
        Field(
            "ca_state",
            "u8",
            note="congestion control state: Open 0, Disorder 1, CWR 2, Recovery 3, Loss 4",
        ),
        Field("ifindex", "u32", note="the interface holding saddr (lo's for a local peer)"),
        Field("backoff", "u8", note="retransmission timeouts in a row, unanswered"),
        Field(
            "retransmits", "u8", note="icsk_retransmits: retransmissions of the head, unanswered"
        ),
        Field("delivery_rate_app_limited", "u8", note="1: the rate was limited by the sender"),
        Field("_pad1", "u8"),
        Field("rto_us", "u32", note="retransmission timeout"),
        Field("srtt_us", "u32", note="smoothed round-trip time"),
        Field("rttvar_us", "u32"),
        Field("min_rtt_us", "u32", note="the lowest RTT seen (windowed)"),
        Field("snd_cwnd", "u32", note="congestion window, segments"),
        Field("snd_mss", "u32"),
        Field("pmtu", "u32", note="the path MTU the connection uses"),
        Field("unacked", "u32", note="segments sent and not acknowledged (packets_out)"),
        Field("retrans_out", "u32", note="of them, retransmitted"),
        Field("lost", "u32", note="of them, deemed lost"),
        Field("total_retrans", "u32", note="segments retransmitted over the connection's life"),
        Field("notsent_bytes", "u32", note="written by the application, not yet sent"),
        Field("last_data_sent_ms", "u32", note="since data was last sent"),
        Field("last_data_recv_ms", "u32", note="since data was last received"),
        Field("last_ack_recv_ms", "u32", note="since the peer last acknowledged anything"),
        Field("segs_out", "u32"),
        Field("segs_in", "u32"),
        Field("snd_wnd", "u32", note="the peer's receive window, bytes"),
        Field("delivery_rate", "u64", note="bytes/s, the latest sample"),
        Field("bytes_acked", "u64"),
        Field("bytes_received", "u64"),
        Field("bytes_sent", "u64", note="retransmissions included"),
        Field("bytes_retrans", "u64"),
        Field("busy_time_us", "u64", note="time with data in flight"),
        Field("rwnd_limited_us", "u64", note="of it, limited by the peer's receive window"),
        Field("sndbuf_limited_us", "u64", note="of it, limited by the send buffer"),
    ),
    """One job connection's struct tcp_info, sampled by the agent each second
(recorder.netsamples: sock_diag), one row per connection per sample.  The
header's pid is the process that holds it (0: unknown), tid 0.  A value
the running kernel does not give is unknown: all ones in its width.""",
)

# an interface's netdev counters in an iface_sample (rtnl_link_stats64's names)
IFACE_NETDEV = (
    "rx_bytes", "tx_bytes", "rx_packets", "tx_packets", "rx_dropped", "tx_dropped",
    "rx_errors", "tx_errors",
)  # fmt: skip
IFACE_QDISC = (
    "qdisc_packets", "qdisc_drops", "qdisc_overlimits", "qdisc_requeues",
    "qdisc_backlog_bytes", "qdisc_backlog_packets",
)  # fmt: skip

IFACE = Struct(
    "iface_sample",
    (
        Field("ifindex", "u32"),
        Field("mtu", "u32"),
        Field("name", "u8", 16, "the netdev's name, NUL-padded"),
        Field(
            "qdisc_kind", "u8", 16, "its root qdisc (tbf, htb, fq_codel, noqueue...), NUL-padded"
        ),
        *(Field(name, "u64") for name in IFACE_NETDEV),
        Field("qdisc_bytes", "u64", note="bytes the root qdisc sent"),
        *(Field(name, "u32") for name in IFACE_QDISC),
        Field("qdisc_handle", "u32"),
        Field("_pad1", "u32"),
    ),
    """One job interface's counters (rtnetlink: the netdev's 64-bit counters
and its root qdisc's statistics), sampled by the agent each second
(recorder.netsamples) for every interface a job connection uses.  The
header's pid and tid are 0.  Unknown values are all ones in their width;
counters count since the interface (or its qdisc) was made.""",
)

PROBE = Struct(
    "probe_event",
    (
        Field("incident", "u8", 48, "the incident id the probes were sent for, NUL-padded"),
        Field("saddr", "u8", 16, "where the probes came from: this host when sent, else the peer"),
        Field("daddr", "u8", 16, "where they went"),
        Field("family", "u16"),
        Field("probe", "u8", note="PROBE_*"),
        Field("role", "u8", note="PROBEROLE_*"),
        Field("outcome", "u8", note="PROBEOUT_*"),
        Field("df", "u8", note="1: sent with don't-fragment"),
        Field("_pad1", "u16"),
        Field("ifindex", "u32", note="this host's interface (sent: the source's; received: where)"),
        Field("probe_size", "u32", note="bytes of each IP packet (tcp: of the exchange's payload)"),
        Field("sent", "u32", note="probes sent (tcp: exchanges)"),
        Field("answered", "u32", note="sent: answers back here; received: probes that arrived"),
        Field("rtt_us", "u32", note="median round trip of the answered (tcp: the probe's srtt)"),
        Field("mtu", "u32", note="FRAG_NEEDED: the MTU the ICMP named"),
        Field("err", "s32", note="ERROR: the errno"),
        Field("_pad2", "u32"),
        Field("round", "u64", note="the sender's round: one per incident and host, random"),
        Field("throughput_bps", "u64", note="tcp: bits/s of the exchange"),
        Field("bytes_sent", "u64", note="IP packets' bytes this host sent (tcp: payload taken)"),
        Field("bytes_received", "u64", note="received for the row (tcp: payload confirmed, read)"),
        Field("duration_us", "u64", note="first probe sent (arrived) to last answer, 0: none"),
    ),
    """Probes between the job's nodes at an incident (recorder.pathprobe sends
them, each agent's recorder.pathecho answers and counts what arrives), one
row per peer, kind and size: the header's ts_ns is the first probe's
(sent or arrived), pid and tid 0.  Unknown values are all ones in their
width (rtt_us with nothing answered, mtu but for FRAG_NEEDED).""",
)

DISC = Struct(
    "disc_event",
    (Field("event", "u32", note="DISC_*"), Field("_pad1", "u32")),
    """Discovery: not a dump ring.  The agent reads it each tick instead of
scanning /proc; one row per event, the pid in the header.""",
)

STRUCTS: tuple[Struct, ...] = (HEADER, NCCL, COMM, TCP, SCHED, EXIT, LINK, CONN, IFACE, PROBE,
                                DISC)  # fmt: skip
# Ring name -> its record, for the rings a dump holds.
RING_STRUCTS: dict[str, Struct] = {
    "nccl": NCCL,
    "comm": COMM,
    "tcp": TCP,
    "sched": SCHED,
    "exit": EXIT,
    "link": LINK,  # the agent's own ring: no head nor loss counter in the kernel
    # the agent's own too (recorder.netsamples, recorder.pathprobe), named as their tables
    "conn_samples": CONN,
    "iface_samples": IFACE,
    "probes": PROBE,
}

# ---- bpf/events.h -------------------------------------------------------------

_PREAMBLE = """\
/* GENERATED from dumpers/layout.py by `python -m stallwatch.dumpers.layout --write`:
 * do not edit.  The records every stallwatch BPF program writes and the
 * constants they share with Python, written once there.
 *
 * Every record begins with struct event_header.  Records live in rings that
 * the BPF programs write directly: an mmapable BPF array of RING_SLOTS slots
 * and a head counter.  A writer claims position `p` with an atomic add on the
 * head, fills slot p % RING_SLOTS, and writes `pos = p + 1` last; a reader
 * trusts a slot only when its `pos` equals the position it expects, which
 * detects slots that are still being written or were overwritten.
 *
 * Padding is explicit; every size and field offset is pinned with
 * _Static_assert.
 */
#ifndef STALLWATCH_EVENTS_H
#define STALLWATCH_EVENTS_H
"""


def _comment(text: str, indent: str = "") -> list[str]:
    lines = text.strip().splitlines()
    if len(lines) == 1:
        return [f"{indent}/* {lines[0]} */"]
    body = [f"{indent} * {line}".rstrip() for line in lines[1:]]
    return [f"{indent}/* {lines[0]}", *body, f"{indent} */"]


def _enum_lines(enum_type: type[enum.IntEnum], prefix: str) -> list[str]:
    lines = [""]
    if enum_type.__doc__:
        doc = enum_type.__doc__.split("\n\n")[0].replace("\n    ", " ")
        lines += _comment(doc.replace("``", "`"))
    for m in enum_type:
        value = f"({int(m)})" if m < 0 else str(int(m))  # a negative literal in parentheses
        lines.append(f"#define {prefix}{m.name} {value}")
    return lines


def _index_lines() -> list[str]:
    lines = ["", "/* Index of each ring's head in `heads`, and of its loss counter in `drops`. */"]
    lines += [f"#define RING_{ring.upper()} {i}" for i, ring in enumerate(RINGS)]
    lines += [f"#define RING_DISC {DISC_HEAD} /* the discovery ring (not dumped): the last head */"]
    lines += [f"#define RING_HEADS {HEADS}", "/* The other loss counters of `drops`. */"]
    first = len(RINGS)
    lines += [f"#define DROP_{name} {first + i}" for i, (name, _) in enumerate(KERNEL_COUNTERS)]
    lines.append(f"#define DROP_SLOTS {len(DROP_NAMES)}")
    return lines


def offset(s: Struct, name: str) -> int:
    """Where field ``name`` of record ``s`` begins, in bytes."""
    fields = s.dtype.fields
    assert fields is not None
    return int(fields[name][1])


def _struct_lines(s: Struct) -> list[str]:
    lines = ["", *_comment(s.note)] if s.note else [""]
    lines.append(f"struct {s.name} {{")
    if s.with_header:
        lines.append("\tstruct event_header hdr;")
    for f in s.fields:
        lines.append(f"\t{f.c()}" + (f" /* {f.note} */" if f.note else ""))
    lines.append("};")
    dtype = s.dtype
    lines.append(f'_Static_assert(sizeof(struct {s.name}) == {dtype.itemsize}, "{s.name} size");')
    for f in s.fields:
        off = offset(s, f.name)
        lines.append(
            f"_Static_assert(__builtin_offsetof(struct {s.name}, {f.name}) == {off}, "
            f'"{s.name}.{f.name}");'
        )
    return lines


def header_text() -> str:
    """The text of bpf/events.h."""
    lines = [_PREAMBLE.rstrip("\n")]
    for enum_type, prefix in C_PREFIXES:
        lines += _enum_lines(enum_type, prefix)
    lines += _index_lines()
    for s in STRUCTS:
        lines += _struct_lines(s)
    lines += ["", "#endif", ""]
    return "\n".join(lines)


def header_path() -> Path:
    import importlib.resources

    return Path(str(importlib.resources.files("stallwatch.bpf"))) / "events.h"


def stale(path: Path | None = None) -> bool:
    """Whether bpf/events.h differs from what this module generates."""
    target = path or header_path()
    try:
        return target.read_text() != header_text()
    except OSError:
        return True


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    target = header_path()
    if args == ["--write"]:
        target.write_text(header_text())
        print(f"wrote {target}")
        return 0
    if args == ["--check"]:
        if stale(target):
            print(
                f"{target} is stale: regenerate it with `python -m stallwatch.dumpers.layout "
                "--write` (dumpers/layout.py is its source)",
                file=sys.stderr,
            )
            return 1
        return 0
    print("usage: python -m stallwatch.dumpers.layout --write | --check", file=sys.stderr)
    return 2


def c_names(members: Iterable[enum.IntEnum]) -> list[str]:
    """The C names of enum members (``Op.SEND`` -> ``OP_SEND``)."""
    prefixes = dict(C_PREFIXES)
    return [f"{prefixes[type(m)]}{m.name}" for m in members]


if __name__ == "__main__":
    raise SystemExit(main())

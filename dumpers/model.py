"""The in-memory form of one node's recording: what a dump holds, and what the
recorder hands to the dump writer and to the query layer.

Rings are numpy structured arrays of the dtypes in ``dumpers.schema``, in
recording order, holding only complete rows.  Timestamps are CLOCK_MONOTONIC
nanoseconds of the recording host; ``Clock`` converts them to wall time.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from .readings import ThreadReading

FORMAT_NAME = "stallwatch-dump"
# 2: nccl rows carry device start and completion; 3: thread position snapshots;
# 4: CUDA graph columns; 5: sched rows name the CPU's last holder (prev_pid);
# 6: a checksum per section (header, tables, each ring); 7: TCP rows carry
# the connection's state, the link ring and the links table; 8: TCP rows of
# event tcp_info, each job connection's state when the dump was taken; 9: the
# agent's network rings: each job connection's tcp_info and each job
# interface's counters every second, the probes between nodes at an incident;
# 10: the programs on kernel hooks and the runs of each the kernel skipped.
# Older files are still read (their rows converted, no snapshots, no links,
# nothing checked); what each version added is listed in dumpers.format.
FORMAT_VERSION = 10
CHECKSUMS_SINCE = 6  # the first format version whose dumps carry checksums


class TriggerKind(enum.Enum):
    IN_FLIGHT = "in_flight"  # a call in flight longer than --stall-timeout
    NO_PROGRESS = "no_progress"  # an active communicator stopped progressing
    EXIT = "exit"  # a process holding communicators died abnormally
    MANUAL = "manual"  # stallwatch dump, SIGUSR1, POST /dump
    PEER = "peer"  # a peer agent asked
    SHUTDOWN = "shutdown"  # written on request at agent exit (--dump-on-exit)
    # a communicator's rhythm degraded for a sustained window, a rank of the
    # node persistently last, or a collective held with the network failing
    # inside it (fail-slow: recorder.slowdown)
    SLOWDOWN = "slowdown"


@dataclass(frozen=True, slots=True)
class Clock:
    """CLOCK_MONOTONIC and CLOCK_REALTIME sampled back to back."""

    monotonic_ns: int
    realtime_ns: int

    def to_wall_ns(self, monotonic_ns: int) -> int:
        return monotonic_ns - self.monotonic_ns + self.realtime_ns


@dataclass(frozen=True, slots=True)
class Trigger:
    kind: TriggerKind
    reason: str
    incident_id: str
    time_ns: int  # monotonic, when the agent decided to dump
    pid: int = 0  # the process concerned, 0 if none
    comm_hash: int = 0  # the communicator concerned, 0 if none
    origin_host: str = ""  # the host that detected it (peer dumps)


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    pid: int
    comm: str  # the kernel's 16-byte task name
    cmdline: str
    netns: int  # network namespace inode
    start_ns: int  # monotonic
    libs: tuple[str, ...]  # libnccl paths it maps
    exit_ns: int = 0  # monotonic, 0 while alive or unknown
    exit_code: int | None = None
    exit_signal: int | None = None
    # the world rank the input itself names (a Flight Recorder dump's global
    # rank); None: derived from the communicators (dumpers.ranks).  Never
    # written to a dump.
    world_rank: int | None = None


@dataclass(frozen=True, slots=True)
class CommInfo:
    """One communicator as one process holds it."""

    pid: int
    comm: int  # ncclComm_t pointer value in that process
    comm_hash: int
    rank: int  # -1 if unknown (split comms: the analyzer derives it)
    nranks: int  # -1 if unknown
    parent_hash: int = 0
    color: int = -1
    key: int = -1
    root_addr: str = ""  # decoded bootstrap root, "" if none
    init_ns: int = 0
    destroy_ns: int = 0  # 0 while alive


@dataclass(frozen=True, slots=True)
class LinkInfo:
    """One interface the link ring names (``link_event.link`` is its ``id``):
    a network interface of the agent's network namespace, or a port of an
    RDMA device.  None: unknown."""

    id: int  # 1.., never reused by one agent
    name: str  # the netdev's name; an RDMA port as "<device>:<port>" (NCCL_IB_HCA's form)
    kind: str  # "netdev" or "rdma"
    device: str | None = None  # RDMA: the device (mlx5_0); netdev: its parent device (PCI)
    port: int | None = None  # RDMA: the port number
    ifindex: int | None = None  # netdev
    netdev: str | None = None  # RDMA: the netdev the port is bound to (RoCE, IPoIB)
    link_type: str | None = None  # netdev: IFLA_INFO_KIND (veth, bridge, vlan...); None: a NIC
    link_layer: str | None = None  # RDMA: InfiniBand or Ethernet
    addresses: tuple[str, ...] = ()  # netdev: "address/prefix", IPv4 and IPv6
    mtu: int | None = None
    speed_mbps: int | None = None
    pids: tuple[int, ...] = ()  # processes in scope that use it
    first_ns: int = 0  # monotonic: when the agent first saw it
    gone_ns: int = 0  # monotonic: when it went; 0 while present


@dataclass(frozen=True, slots=True)
class ProgramMisses:
    """A BPF program on a kernel hook, and the runs of it the kernel skipped:
    its event came while a program the kernel will not nest under was
    running on that CPU (any tracing program, for a tracepoint's; itself,
    for a raw tracepoint's).  Skipped events are evidence never seen."""

    program: str  # its name in bpf/ (raw_tracepoint__tcp_retransmit_skb)
    hook: str  # the tracepoint's event (tcp_retransmit_skb)
    attachment: str  # "raw_tracepoint" or "tracepoint"
    misses: int | None  # None: unknown (kernels before 6.7 do not count them)
    # of them, the events the hook's second program ran for instead (a raw
    # tracepoint that fires in process context and in softirq); None: no such
    caught: int | None = None

    @property
    def unseen(self) -> int | None:
        """Events of the hook no program of it saw, as far as this one
        tells (a second program's skipped runs are its first's: 0)."""
        if self.misses is None:
            return None
        if self.program.endswith("__nested"):
            return 0
        return self.misses - (self.caught or 0)


@dataclass(frozen=True, slots=True)
class Ring:
    rows: np.ndarray  # structured array, ring dtype, oldest first
    overwritten: int = 0  # rows the ring dropped to make room
    lost: int = 0  # rows the kernel could not record


@dataclass(frozen=True, slots=True)
class Recording:
    """One node's recording at one moment: a dump, or a live recording."""

    host: str
    boot_id: str
    clock: Clock
    processes: tuple[ProcessInfo, ...]
    communicators: tuple[CommInfo, ...]
    rings: dict[str, Ring]
    agent_version: str = ""
    agent_args: tuple[str, ...] = ()
    trigger: Trigger | None = None  # None for a live recording
    counters: dict[str, int] = field(default_factory=dict)
    # where every thread of the node's NCCL processes was (dumpers.readings), oldest first
    snapshots: tuple[ThreadReading, ...] = ()
    # the interfaces the link ring names, and which processes use them
    links: tuple[LinkInfo, ...] = ()
    # the programs on kernel hooks and the runs the kernel skipped (none: not known)
    programs: tuple[ProgramMisses, ...] = ()
    # the format version of the dump it was read from (older ones lack what
    # later versions added: checksums before 6); this version when live
    format_version: int = FORMAT_VERSION

    @property
    def checked(self) -> bool:
        """Whether its dump carried checksums (and they matched)."""
        return self.format_version >= CHECKSUMS_SINCE

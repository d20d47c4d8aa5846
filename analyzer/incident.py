"""The analyzer's records: one incident as typed tables, and the records its
stages hand each other.

Every input (our dumps, PyTorch Flight Recorder dumps) is turned into an
``Incident``: processes (one per rank), communicators (members in comm-rank
order), and one columnar table of NCCL calls (``Calls``) plus the kernel
events that explain slowness.  Strings (hosts) are interned as small integers
in the columns; the tables beside them map them back.

Timestamps are monotonic nanoseconds *of the host that recorded them*; they
are only ever compared with timestamps of the same host.

This module is the bottom of the analyzer: it imports none of its stages.
Below the incident are the records more than one stage reads: where an
agent's late attach was aligned (``late``, ``unanchored``), thread readings
(``detect.positions``), each communicator's frontier (``frontier``), and the
metrics each detector family computes and the ``detect.common.Analysis``
carries to every detector (the functions that compute them live with their
family, in ``detect/``).
"""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Generic, TypeVar, cast

import numpy as np

# where the analyzer finds them (one home: the opener of every command)
from stallwatch.dumpers.inputs import InputStatus as InputStatus
from stallwatch.dumpers.inputs import SourceKind as SourceKind
from stallwatch.dumpers.model import CommInfo, Recording
from stallwatch.dumpers.readings import ThreadReading
from stallwatch.dumpers.schema import TcpEvent

from .columns import Columns

T = TypeVar("T")


class Deferred(Generic[T]):
    """A value computed once, when first asked for (a query the analysis may
    not need)."""

    __slots__ = ("_compute", "_value")

    def __init__(self, compute: Callable[[], T]) -> None:
        self._compute: Callable[[], T] | None = compute
        self._value: T | None = None

    def get(self) -> T:
        if self._compute is not None:
            self._value, self._compute = self._compute(), None
        return cast(T, self._value)


@dataclass(frozen=True, slots=True)
class Proc:
    """One process (a rank) as seen by the dumps."""

    host: str
    pid: int
    world_rank: int  # -1 if unknown
    source: str  # the input file it came from
    exit_code: int | None = None
    exit_signal: int | None = None
    window_complete: bool = True  # its ring never overwrote a row
    # ``host`` is the input file's name: the input names no host (nor pid),
    # as Flight Recorder dumps do not
    from_file: bool = False
    exit_wall_ns: int | None = None  # when it died, wall clock of its host

    @property
    def died_badly(self) -> bool:
        return bool(self.exit_signal) or (self.exit_code is not None and self.exit_code != 0)

    def label(self) -> str:
        rank = f"rank {self.world_rank}" if self.world_rank >= 0 else "rank unknown"
        if self.from_file:
            return f"{rank} (file {self.host})"
        return f"{rank} (host {self.host}, pid {self.pid})"


@dataclass(frozen=True, slots=True)
class Comm:
    """A communicator: ``members[r]`` is the proc index of comm rank r, -1 if
    no input holds that rank (a missing dump).

    Where the evidence does not tell every member's rank (a split one of
    whose members left no dump: ``dumpers.ranks``), ``members`` are slots:
    the members present in NCCL's order, then one -1 per member no input
    holds (one if there may be more); ``ranks`` then holds each slot's rank
    in the communicator (-1: unknown) and ``size`` its size (-1: unknown).
    Calls are matched by slot (``nranks`` slots); a rank is shown, and a
    peer's rank found, through ``rank_of`` and ``slot_of``."""

    comm_hash: int
    members: tuple[int, ...]
    label: str = ""  # the process group's name, where the input names it
    is_split: bool = False
    desc: str = ""  # the process group's description (Flight Recorder's pg_config)
    world_ranks: tuple[int, ...] = ()  # world rank of each comm rank, when known
    ranks: tuple[int, ...] = ()  # each slot's rank, -1 unknown; (): slot r is rank r
    size: int = -1  # where ``ranks`` is given: the communicator's size, -1 unknown
    size_min: int = 0  # ... and where that is unknown, the fewest it has

    def world_rank(self, crank: int) -> int:
        """The world rank of a member, -1 if unknown."""
        return self.world_ranks[crank] if crank < len(self.world_ranks) else -1

    @property
    def nranks(self) -> int:
        """Slots: the communicator's size where every rank is known."""
        return len(self.members)

    @property
    def exact(self) -> bool:
        """Every member's rank and the size are known: slot r is rank r."""
        return not self.ranks

    def rank_of(self, slot: int) -> int:
        """The comm rank of a slot, -1 if unknown."""
        if not self.ranks:
            return slot
        return self.ranks[slot] if 0 <= slot < len(self.ranks) else -1

    def slot_of(self, rank: int) -> int:
        """The slot of a comm rank, -1 if no slot is known to hold it."""
        if not self.ranks:
            return rank if 0 <= rank < len(self.members) else -1
        return self.ranks.index(rank) if rank >= 0 and rank in self.ranks else -1

    @property
    def size_text(self) -> str:
        """Its size for people: "4 ranks", "at least 3 ranks"."""
        n = self.nranks if self.exact else self.size if self.size >= 0 else self.size_min
        what = f"{n} rank" + ("" if n == 1 else "s")
        return what if self.exact or self.size >= 0 else f"at least {what}"

    @property
    def whole(self) -> int:
        """How many slots a collective of it is seen whole with: all but a
        member it may not have (``may_be_empty``: no evidence says it exists).
        A rank that waits least in a blocking collective waited for nobody,
        seen or not; a member never seen is no one's straggler."""
        n = len(self.members)
        return n if self.exact or self.size >= 0 else min(n, max(self.size_min, 1))

    def may_be_empty(self, slot: int) -> bool:
        """A slot no input holds that may hold no member at all: the size is
        not known, and the slot is beyond the fewest ranks it has."""
        return not self.exact and self.size < 0 and slot >= self.size_min

    def rank_text(self, slot: int) -> str:
        """A slot's comm rank for people ("unknown" where no input tells it)."""
        r = self.rank_of(slot)
        return str(r) if r >= 0 else "unknown"

    @property
    def hash_text(self) -> str:
        return f"0x{self.comm_hash & 0xFFFFFFFFFFFFFFFF:016x}"

    @property
    def group(self) -> str:
        """The process group, for people: "group 58: TENSOR_MODEL_PARALLEL_GROUP"."""
        if not self.label:
            return ""
        return f"group {self.label}: {self.desc}" if self.desc else f"group {self.label}"

    @property
    def name(self) -> str:
        """For people: the hash, and the process group when known."""
        return f"{self.hash_text} ({self.group})" if self.label else self.hash_text


CALL_DTYPE = np.dtype(
    [
        ("comm", "<i4"),  # index into Incident.comms
        ("crank", "<i4"),  # rank in the communicator
        ("proc", "<i4"),  # index into Incident.procs
        ("seq", "<i8"),
        ("ts", "<i8"),  # entry, host monotonic
        ("end", "<i8"),  # return, 0 while in flight
        ("count", "<u8"),
        ("root", "<i4"),  # root or peer, -1 if none
        ("op", "u1"),
        ("datatype", "u1"),
        ("redop", "u1"),
        ("state", "u1"),
        ("result", "<i4"),  # ncclResult_t, -1 while in flight
        ("device", "u1"),  # 1: ts/end are the device's start/completion (CUDA probes)
        ("queued", "<i8"),  # device: from the host's entry to the device's start (else 0)
        ("shape", "<u2"),  # index into Incident.shapes, 0 where unknown
    ]
)


@dataclass(frozen=True, slots=True)
class Calls:
    """Columnar NCCL calls of one incident (a ``Columns`` of CALL_DTYPE's
    fields).  When ``matched`` >= 0, ``rows[:matched]`` are the collective
    calls sorted by (comm, seq, comm rank) and the rest follow (p2p):
    matching is then a view, not a copy."""

    rows: Columns
    matched: int = -1

    def __len__(self) -> int:
        return len(self.rows)


# The TCP events between two hosts' own addresses that tell what became of
# a connection: retransmits (with what the kernel said of the connection),
# resets, and its state when its host dumped (``tcp_info``: backoff the
# timeouts unanswered, no_ack since the peer last acknowledged anything).
# host: the dump it came from (whose clock ts is in); local /
# remote: the hosts whose addresses are this end and the other; event:
# dumpers.schema.TcpEvent; backoff, no_ack: timeouts in a row and nothing
# acknowledged for at least so long (ns), where known (known 1); conn: one
# key per connection, the same from both of its ends.
TCP_DTYPE = np.dtype(
    [
        ("host", "<i4"),
        ("pid", "<u4"),
        ("ts", "<i8"),
        ("local", "<i4"),
        ("remote", "<i4"),
        ("event", "u1"),
        ("backoff", "u1"),
        ("known", "u1"),
        ("no_ack", "<i8"),
        ("rto", "<i8"),  # the timeout that expired (ns), 0 where unknown
        ("conn", "<u8"),
        ("other", "u1"),  # 1: not the job's connection (a sampled retransmit of other traffic)
        ("reason", "<u2"),  # a sent reset's enum sk_rst_reason (0: not said)
    ]
)
# The probes between the job's nodes at the incident (the agents' probes
# ring): host: the dump it came from; wall: its first probe, wall clock;
# src, dst: the hosts whose addresses the probes went from and to (-1 not a
# host of the incident); kind, role, outcome: dumpers.schema's ProbeKind,
# ProbeRole, ProbeOutcome; size: each IP packet's bytes (tcp: the
# exchange's payload); sent, answered: sent by the host (answered: answers
# back), or received from the peer (answered: those that arrived);
# rtt_us, throughput_bps: -1 where unknown.
PROBE_DTYPE = np.dtype(
    [
        ("host", "<i4"),
        ("wall", "<i8"),
        ("src", "<i4"),
        ("dst", "<i4"),
        ("kind", "u1"),
        ("role", "u1"),
        ("outcome", "u1"),
        ("size", "<u4"),
        ("sent", "<u4"),
        ("answered", "<u4"),
        ("rtt_us", "<i8"),
        ("throughput_bps", "<i8"),
        ("round", "<u8"),
    ]
)
# Each job connection between two hosts' own addresses, sampled every second
# (the agents' conn_samples ring: struct tcp_info): host: the dump; wall:
# the sample's time; local, remote: the hosts of this end and the other;
# conn: the connection's key (both ends alike, as TCP_DTYPE's); the rest as
# tcp_info names them, -1 where unknown.
CONN_SAMPLE_VALUES = (
    "srtt_us", "rttvar_us", "min_rtt_us", "rto_us", "delivery_rate", "bytes_acked",
    "bytes_received", "bytes_sent", "bytes_retrans", "total_retrans", "lost", "unacked",
    "notsent", "busy_us", "rwnd_limited_us", "sndbuf_limited_us", "last_ack_ms",
    "last_sent_ms", "last_recv_ms", "backoff", "ca_state", "app_limited",
)  # fmt: skip
CONN_SAMPLE_DTYPE = np.dtype(
    [
        ("host", "<i4"),
        ("wall", "<i8"),
        ("local", "<i4"),
        ("remote", "<i4"),
        ("conn", "<u8"),
        ("pid", "<u4"),
        ("state", "u1"),
        *((name, "<i8") for name in CONN_SAMPLE_VALUES),
    ]
)
# Each job interface's counters sampled every second (iface_samples), -1
# where unknown.
IFACE_VALUES = (
    "rx_bytes", "tx_bytes", "rx_packets", "tx_packets", "rx_dropped", "tx_dropped",
    "rx_errors", "tx_errors", "qdisc_drops", "qdisc_overlimits", "qdisc_backlog_bytes",
    "qdisc_backlog_packets", "qdisc_bytes",
)  # fmt: skip
IFACE_DTYPE = np.dtype(
    [
        ("host", "<i4"),
        ("wall", "<i8"),
        ("ifindex", "<u4"),
        ("name", "U16"),
        ("mtu", "<i8"),
        *((name, "<i8") for name in IFACE_VALUES),
    ]
)
# A process blocked in a call (its group's end included) when its dump was
# taken: proc, the call's op, when it entered it (its host's clock).
# Of each rank, its latest calls are read (the straggler detectors' window,
# and the frontier of every communicator it used since): an incident of
# 131,072 ranks is not read whole (analyzer.align says how).
WINDOW_CALLS = 256
# a call's datatype that no input names (a Flight Recorder entry without
# one): unknown, never compared
UNKNOWN_DTYPE = 255
WAIT_DTYPE = np.dtype([("proc", "<i4"), ("op", "u1"), ("ts", "<i8")])
# A call of the whole ring (not only the analyzed window) that took HELD_NS
# and more: proc, its communicator's hash, seq, op, entry and return (host clock).
HELD_NS = 1_000_000_000
HELD_DTYPE = np.dtype(
    [("proc", "<i4"), ("hash", "<u8"), ("seq", "<i8"), ("op", "u1"), ("ts", "<i8"), ("end", "<i8")]
)
# holder: the process that held the CPU until the waiting thread got it (the
# last one; 0 the idle task), dumpers.schema.PREV_PID_UNKNOWN if not recorded
SCHED_DTYPE = np.dtype(
    [("host", "<i4"), ("pid", "<u4"), ("ts", "<i8"), ("delay", "<i8"), ("holder", "<i8")]
)


@dataclass(frozen=True, slots=True)
class SlowTrigger:
    """A slowdown an agent raised: its host, when (its clock), the
    communicator and process it named, and why (recorder.slowdown)."""

    host: str
    time_ns: int
    comm_hash: int
    pid: int
    reason: str


@dataclass(frozen=True, slots=True)
class Incident:
    """Everything known about one incident, from every input that belongs to it."""

    id: str
    hosts: tuple[str, ...]
    host_now: tuple[int | None, ...]  # per host: when it dumped (its clock), None if unknown
    procs: tuple[Proc, ...]
    comms: tuple[Comm, ...]
    calls: Calls
    tcp: np.ndarray  # TCP_DTYPE
    sched: np.ndarray  # SCHED_DTYPE
    sources: tuple[str, ...] = ()
    # (comm, comm rank, last seq entered, last seq completed) known from
    # progress counters rather than rows (Flight Recorder pg_status)
    progress: tuple[tuple[int, int, int, int], ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)
    kind: SourceKind = SourceKind.STALLWATCH
    # when the incident was detected (wall clock, ns since the epoch, UTC) and
    # by whom and why; for inputs without a dump time (Flight Recorder) the
    # time of their latest entry, and no detector
    wall_ns: int | None = None
    detected_by: str = ""
    readings: tuple[HostReadings, ...] = ()  # thread positions per host (detect.positions)
    # the tensor shapes a call passed, as text ("[[2, 32]]"); 0 is unknown
    shapes: tuple[str, ...] = ("",)
    # completion is the device's (Flight Recorder of NCCL: a CUDA event),
    # not a host call returning
    device_completion: bool = False
    # a call that ended completed (Flight Recorder): not only enqueued, as an
    # asynchronous NCCL call returns
    ends_are_completions: bool = False
    # calls recorded from an agent's attach, and how they were aligned
    late: LateReport | None = None
    # per host: what to add to its timestamps to read them as wall clock
    # (realtime - monotonic of its dump); () where they are wall clock
    # already (Flight Recorder), None for a host whose clock is unknown
    wall_offset: tuple[int | None, ...] = ()
    # per host: when its dump read the rings (wall clock), None where no
    # input says (Flight Recorder: its latest entry bounds it from below)
    captured: tuple[int | None, ...] = ()
    # per host: the first host whose dumps came from the same running kernel
    # (one boot id): hosts that share CPUs and pids (the lab's nodes on one
    # machine); () where every host is its own
    machines: tuple[int, ...] = ()
    waiting: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=WAIT_DTYPE))
    held: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=HELD_DTYPE))
    links: tuple[LinkFate, ...] = ()  # every host's interfaces (our dumps from format 7)
    # inputs found unreadable once their rows were read (a damaged block of a
    # ring left in its file, a file changed since): left out, as lost dumps
    lost: tuple[InputStatus, ...] = ()
    # dumps an agent's watchdog wrote on a stall: "host (why)"
    stall_triggers: tuple[str, ...] = ()
    # the agent that raised the incident saw the job go on, only slower
    # (trigger kind slowdown): judged on the slow window (detect.slowdown)
    slowdown: SlowTrigger | None = None
    # the agents' network evidence (format 9 on): probes at the incident,
    # each job connection's and interface's samples
    probes: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=PROBE_DTYPE))
    # the addresses probes went to or came from that no dump's host owns (a
    # job host that left no dump here: down, cut off, or its agent gone);
    # a probe row's src or dst ``len(hosts) + i`` is the i-th
    unreached: tuple[str, ...] = ()
    conns: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=CONN_SAMPLE_DTYPE))
    ifaces: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=IFACE_DTYPE))
    # per host, the job's retransmits inside its collectives' windows over
    # every call the rings hold (query.retransmits: the shipped query's
    # count, run when first asked for); None when none went between hosts
    host_retransmits: Deferred[tuple[HostRetransmits, ...]] | None = None
    # the job's retransmit rows in all the dumps: no host is in more
    retransmit_rows: int = 0

    @property
    def retransmits(self) -> np.ndarray:
        """The TCP table's retransmits of the job's connections."""
        t = self.tcp
        rows: np.ndarray = t[(t["event"] == TcpEvent.TCP_RETRANSMIT_SKB) & (t["other"] == 0)]
        return rows

    def to_wall(self, host: int) -> int | None:
        """The offset of a host's timestamps to wall clock, None if unknown."""
        return self.wall_offset[host] if self.wall_offset else 0

    def host_index(self, host: str) -> int:
        return self.hosts.index(host)


def proc_hosts(inc: Incident) -> list[int]:
    """Each proc's host, as an index into ``inc.hosts``."""
    index = {h: i for i, h in enumerate(inc.hosts)}
    return [index[p.host] for p in inc.procs]


# ---- thread readings (detect.positions) ----------------------------------------------


@dataclass(frozen=True, slots=True)
class HostReadings:
    """One node's thread readings (oldest first) and what its recording knows
    about communicators (empty without a recording)."""

    host: str
    snapshots: tuple[ThreadReading, ...]
    communicators: tuple[CommInfo, ...] = ()
    # pid -> when the recording saw it enter its latest NCCL call: where a
    # reading before that found it is no longer where it is
    entered: Mapping[int, int] = field(default_factory=dict)

    def current(self) -> list[ThreadReading]:
        """The readings without the processes seen to enter a call after
        they were read (an agent's start-up reading, taken while the job
        still ran, is in all its dumps); a call entered while a process was
        read may be the one seen, and keeps it."""
        out = []
        for s in self.snapshots:
            kept = tuple(
                p for p in s.processes if self.entered.get(p.pid, 0) <= p.taken_ns + p.took_ns
            )
            if kept:
                out.append(s if len(kept) == len(s.processes) else replace(s, processes=kept))
        return out


def host_readings(
    recordings: Iterable[Recording], entered: Mapping[str, Mapping[int, int]] | None = None
) -> tuple[HostReadings, ...]:
    """Each host's readings (a host may have dumped several times: all of
    them, in time order) with every communicator its recordings know, and
    when the recording saw each process enter its latest NCCL call
    (``entered``: host -> pid -> the host's monotonic clock, as its readings
    are)."""
    entered = entered or {}
    snaps: dict[str, list[ThreadReading]] = defaultdict(list)
    comms: dict[str, list[CommInfo]] = defaultdict(list)
    for rec in recordings:
        if rec.snapshots:
            snaps[rec.host] += rec.snapshots
            comms[rec.host] += rec.communicators
    return tuple(
        HostReadings(
            h,
            tuple(sorted(set(snaps[h]), key=lambda s: s.taken_ns)),
            tuple(comms[h]),
            dict(entered.get(h, {})),
        )
        for h in sorted(snaps)
    )


# ---- calls recorded from an agent's attach (late, unanchored) ------------------------


@dataclass(frozen=True, slots=True)
class Alignment:
    host: str
    pid: int
    comm_ptr: int
    comm_hash: int
    rank: int  # the slot it takes in the communicator
    offset: int  # recorded seq + offset = the communicator's seq
    shared: int  # calls both had
    skew_ns: int
    runner_up_ns: int | None  # the next candidate's skew, None if there was none
    rank_from: str  # how its rank is known; "": it is not (the slot is a placeholder)

    def text(self) -> str:
        rank = f"comm rank {self.rank} ({self.rank_from})" if self.rank_from else "rank unknown"
        other = (
            f"the next candidate was {self.runner_up_ns / 1e6:.1f} ms off"
            if self.runner_up_ns is not None
            else "no other candidate"
        )
        return (
            f"host {self.host} pid {self.pid}: its calls on {self.comm_hash:#018x} were "
            f"recorded from its agent's attach (seq relative); aligned by op, sizes and "
            f"timing: its seq + {self.offset} ({self.shared} calls shared, entries "
            f"{self.skew_ns / 1e6:.1f} ms apart, {other}); {rank}"
        )


@dataclass(frozen=True, slots=True)
class Unaligned:
    host: str
    pid: int
    comm_ptr: int
    calls: int
    why: str
    # its latest call where it was entered and has not returned ("" if none):
    # the process waits there, aligned or not
    in_flight: str = ""

    def text(self) -> str:
        return (
            f"host {self.host} pid {self.pid}: {self.calls} calls on communicator pointer "
            f"{self.comm_ptr:#x}, recorded from its agent's attach, not aligned: {self.why}"
        )


@dataclass(frozen=True, slots=True)
class LateReport:
    aligned: tuple[Alignment, ...]
    unaligned: tuple[Unaligned, ...]
    # the unaligned streams judged among themselves (analyzer.unanchored)
    unanchored: Unanchored | None = None

    def uncertain(self) -> set[tuple[str, int]]:
        """(host, pid) whose rank could not be told."""
        return {(a.host, a.pid) for a in self.aligned if not a.rank_from}

    def on(self, comm_hash: int) -> list[Alignment]:
        return [a for a in self.aligned if a.comm_hash == comm_hash]


@dataclass(frozen=True, slots=True)
class StreamWait:
    """A stream stuck in a call, and where the other processes' streams of
    the same calls stand at that frontier."""

    host: str
    pid: int
    ptr: int
    op: str
    age_ns: int
    entered_ns: int  # wall clock
    behind: tuple[tuple[str, int], ...]  # (host, pid): its calls end before it
    waiting: tuple[tuple[str, int], ...]  # in flight in it too
    completed: tuple[tuple[str, int], ...]  # completed it: no member

    def text(self, name: dict[tuple[str, int], str]) -> str:
        def who(ps: tuple[tuple[str, int], ...]) -> str:
            return ", ".join(name.get(p, f"host {p[0]} pid {p[1]}") for p in ps) or "none"

        me = name.get((self.host, self.pid), f"host {self.host} pid {self.pid}")
        return (
            f"{me} waits in {self.op} on communicator pointer {self.ptr:#x} (in flight "
            f"{self.age_ns / 1e9:.1f} s at its dump); of the processes whose calls are the "
            f"same, never entered it: {who(self.behind)}; waiting in it too: "
            f"{who(self.waiting)}; completed it (so no member): {who(self.completed)}"
        )


@dataclass(frozen=True, slots=True)
class Unanchored:
    waits: tuple[StreamWait, ...]
    culprits: tuple[tuple[str, int], ...]  # (host, pid)
    captured: dict[tuple[str, int], int]  # (host, pid) -> when its dump read the rings


# ---- where each communicator stands (frontier) ---------------------------------------

# clocks of two hosts may differ this much: moments of evidence closer than
# this are not ordered (frontiers, deaths, streams' frontiers)
SKEW_NS = 50_000_000


class MemberState(enum.Enum):
    AT_FRONTIER = "at frontier"
    BEHIND = "behind"
    NO_ROWS = "no rows"  # its window is complete and holds nothing of this comm
    UNKNOWN = "unknown"  # its ring wrapped past every row of this comm
    NO_DUMP = "no dump"


@dataclass(frozen=True, slots=True)
class Member:
    crank: int
    proc: int  # -1 without a dump
    state: MemberState
    last_seq: int
    last_returned: int
    in_flight: bool
    # when its evidence was taken (wall clock): exact (a dump's capture time,
    # to the clocks' skew) or a lower bound (its latest timestamp: Flight
    # Recorder records no dump time); None where unknown
    moment: int | None = None
    moment_exact: bool = False
    # its last call is pending only because how it ended is unknown: it
    # returned (gloo retires a failed work as a finished one)
    returned: bool = False
    # its dump is proven older on another communicator: its peers there
    # completed a collective it had not entered when it was read (it went
    # on after its dump)
    older_elsewhere: bool = False


class Lag(enum.Enum):
    """Why a member's evidence ends behind its communicator's frontier."""

    STUCK = "stuck"  # its evidence was taken after the frontier began
    OLDER = "older"  # its evidence was taken before: it entered more since
    UNPROVEN = "unproven"  # its evidence cannot be ordered with the frontier


@dataclass(frozen=True, slots=True)
class Frontier:
    comm: int
    seq: int
    op: int
    stuck: bool
    age_ns: int | None  # how long the ranks at the frontier have made no progress
    members: tuple[Member, ...]
    # the last seq every member is proven to have entered (a member completed
    # it), -1 if none
    proven: int = -1
    began: int | None = None  # the earliest entry into the frontier (wall clock)
    # procs standing at other stuck frontiers that wait for this one: a
    # laggard there stands here (or further along such a chain)
    behind_it: tuple[int, ...] = ()

    def lag(self, m: Member) -> Lag:
        """Completion implies entry: a member whose evidence ends before a
        seq its peers' completions prove it entered, or inside one they
        completed, was read before it went on (here, or on another
        communicator: ``Member.older_elsewhere``).  Otherwise it is behind
        only if its evidence was taken after the frontier began (beyond the
        clocks' skew)."""
        if self.went_on(m):
            return Lag.OLDER
        if self.began is None or m.moment is None:
            return Lag.UNPROVEN
        if m.moment >= self.began + SKEW_NS:
            return Lag.STUCK
        if m.moment_exact and m.moment + SKEW_NS <= self.began:
            return Lag.OLDER
        # read before it went on elsewhere: where it stood here is no more
        # recent than that
        return Lag.OLDER if m.older_elsewhere else Lag.UNPROVEN

    def went_on(self, m: Member) -> bool:
        """Its peers' completions prove it went on after its dump: it ends
        before a seq they completed, or inside one."""
        running = m.in_flight and not m.returned
        return 0 <= m.last_seq < self.proven or (running and 0 <= m.last_seq <= self.proven)

    @property
    def laggards(self) -> tuple[Member, ...]:
        """Members whose own dump shows them behind the frontier."""
        lag = (MemberState.BEHIND, MemberState.NO_ROWS)
        return tuple(m for m in self.members if m.state in lag)

    @property
    def unseen(self) -> tuple[Member, ...]:
        """Members no readable dump holds: known only from their peers."""
        return tuple(m for m in self.members if m.state is MemberState.NO_DUMP)

    @property
    def standing(self) -> tuple[Member, ...]:
        """Members in flight at the frontier's seq (entered, never returned)."""
        return tuple(
            m
            for m in self.members
            if m.state is MemberState.AT_FRONTIER and m.in_flight and not m.returned
        )

    @property
    def left(self) -> bool:
        """Whether a member with a dump returned from its seq."""
        return any(
            m.last_returned >= self.seq or (m.state is MemberState.AT_FRONTIER and m.returned)
            for m in self.members
            if m.proc >= 0
        )

    @property
    def stood_still(self) -> bool:
        """The dumps taken last stand at it: it is stuck, two ranks or more
        wait on it (in flight at its seq, or in flight at another stuck
        collective none left that waits for one of them: ``behind_it``), and
        none returned from it.  A job that goes on while its ranks dump in
        turn completes its frontier, or has one rank there (the one dumped
        last): never two, dumped at different moments, held by one
        collective that no member ever leaves."""
        waiting = len(self.standing) + len(self.behind_it)
        return self.stuck and waiting >= 2 and not self.left


# ---- the detector families' metrics (detect/) ----------------------------------------


@dataclass(frozen=True, slots=True)
class Disagreement:
    comm: int
    seq: int
    field: str
    consensus: int
    odd: tuple[tuple[int, int], ...]  # (row index, value) of the odd ones
    tie: bool


@dataclass(frozen=True, slots=True)
class ArrivalScore:
    """How a rank arrives at a communicator's collectives, against its peers."""

    comm: int
    crank: int
    proc: int
    groups: int  # complete groups measured
    last_fraction: float  # share of groups where it is judged the last to arrive
    margin_ns: int  # median of how much later than its peers it is judged to arrive
    peer_wait_ns: int  # median duration of its peers' calls
    own_wait_ns: int  # median duration of its own calls
    method: str  # "wait" (blocking durations) or "host-lateness" / "lateness"
    nranks: int = 2
    period_ns: int = 0  # median time between a rank's entries into consecutive collectives
    device: bool = False  # judged on the device's timeline (CUDA probes)
    # judged on one kind of its collectives (this op and count), not on all
    op: int | None = None


@dataclass(frozen=True, slots=True)
class SchedDelays:
    """Run-queue delay (ns) per proc, by who held the CPU when the wait ended
    (the last holder only: a long wait may have had others before it)."""

    outside: np.ndarray  # a process outside the job (or the idle task)
    by_job: np.ndarray  # a rank of the same job on the same machine
    unknown: np.ndarray  # not recorded (dumps before format 5)

    @property
    def starving(self) -> np.ndarray:
        """What counts as starvation: waits the job did not cause itself.
        Unknown holders count, as they did before holders were recorded."""
        total: np.ndarray = self.outside + self.unknown
        return total


@dataclass(frozen=True, slots=True)
class ConnFate:
    """What became of one connection between two hosts (detect.partition),
    from the rows both of its ends recorded; times on the wall clock."""

    hosts: tuple[int, int]  # its two ends' hosts, in order
    retransmits: int
    timeouts: int  # retransmits that were retransmission timeouts
    backoff: int  # timeouts in a row, in its last run of them (0: none)
    no_ack_ns: int | None  # nothing acknowledged for at least so long, at its last retransmit
    stop_wall_ns: int | None  # when acknowledgements stopped (at the latest), last run
    last_wall_ns: int | None  # its last retransmit
    dead: bool  # still stopped when its host's dump was taken
    resets: int  # resets sent or received
    first_reset_wall_ns: int | None
    # runs of timeouts it came back from: (stopped, acknowledged again after)
    outages: tuple[tuple[int, int], ...] = ()
    other: bool = False  # not the job's: sampled retransmits of other traffic between the hosts


@dataclass(frozen=True, slots=True)
class LinkFate:
    """One interface of a host as its agent's link ring saw it (align, for
    detect.partition); times on the wall clock."""

    host: int
    name: str  # eth0, mlx5_0:1
    kind: str  # netdev, rdma
    used: bool  # a rank of the incident uses it
    # each time it lost its carrier (RDMA: its physical link): (down after,
    # up again at, or None when it was still down at the dump)
    downs: tuple[tuple[int, int | None], ...]
    # failure counters that moved over the ring: (name, increase)
    moved: tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True)
class HostRetransmits:
    host: int
    local: int  # retransmits from its address inside collective windows
    remote: int  # retransmits to its address inside collective windows
    total: int  # all retransmits from its address
    calls: int = 0  # completed collective calls of its ranks


@dataclass(frozen=True, slots=True)
class CommSlowdown:
    """How much slower a communicator's collectives are when retransmits fall
    inside their windows, against its own collectives without any."""

    comm: int
    hosts: tuple[int, ...]  # hosts of its ranks
    groups: int  # complete collectives measured
    hit_groups: int  # of them, with a retransmit inside a member's window
    hit_ns: int  # median duration of those (of their longest member call)
    baseline_ns: int  # median of the others (lower quartile of all when too few)
    # calls queued (returned at once, never seen on a device): durations are
    # windows up to the next call and cannot be compared; what counts is the
    # time a retransmission timeout of the job's connections held them
    queued: bool = False
    held_groups: int = 0  # collectives with a timeout inside a member's window
    held_share: float = 0.0  # share of their time (longest member window) held


@dataclass(frozen=True, slots=True)
class NetHeld:
    """A collective the network held (``detect.network.held_by_network``):
    it took ``duration_ns`` (its longest member call) against its
    communicator's median ``baseline_ns``, a retransmission timeout of the
    job's connections inside."""

    comm: int
    seq: int
    op: int
    duration_ns: int
    baseline_ns: int


@dataclass(frozen=True, slots=True)
class P2pGap:
    """Point-to-point messages of one direction (``src`` to ``dst`` on a
    communicator) that one side posted and the other has not: the n-th send
    from src to dst matches the n-th receive at dst from src."""

    comm: int
    src: int  # comm ranks
    dst: int
    waiting: int  # proc that posted the unmatched calls
    missing: int  # proc of the other side, -1 without a dump
    missing_crank: int
    op: int  # what the waiting side posted: SEND or RECV
    seq: int  # its first unmatched one
    posted: int  # how many it posted beyond the other side
    other_last: int  # the other side's last seq in this direction, -1 if none
    age_ns: int | None  # since the waiting side posted the first unmatched call
    idle_ns: int | None  # since the waiting side last did anything at all
    posted_ns: int = 0  # when it posted the first unmatched call (its host's clock)


@dataclass(frozen=True, slots=True)
class EndChange:
    """One end of a connection between two hosts, sampled every second: its
    round trip and delivery rate before the slowdown's onset and since."""

    host: int  # this end's host
    peer: int
    conn: int
    base_srtt_us: float | None  # median before the onset, None without one
    base_bound_us: float | None  # median of srtt + 4 rttvar before: TCP's own edge of normal
    srtt_us: float  # median since
    rate_bps: float | None  # median delivery rate since (bits/s), None where unknown
    retrans: int  # segments retransmitted since
    pid: int | None = None  # the process this end belongs to, None where unknown


@dataclass(frozen=True, slots=True)
class SlowLink:
    """A host whose connections slowed while the job's others kept their pace
    (detect.paths)."""

    host: int
    peers: tuple[int, ...]  # the hosts its slowed connections lead to
    slowed: tuple[EndChange, ...]
    others: tuple[EndChange, ...]  # connections without the host
    baseline: bool  # judged against each connection's own baseline (else against the others')


@dataclass(frozen=True, slots=True)
class SlowWindow:
    """A communicator's collectives since its rhythm departed from the
    baseline before it (detect.slowdown): its groups from ``first_gid`` (in
    the matched table) on.  Intervals are between a member's calls of one
    kind (op and count), on its own clock; a group's is its members' median.
    ``onset``: found in the rhythm; else the collectives of the last moments
    before the dumps."""

    comm: int
    first_gid: int
    seq: int  # its first collective
    op: int
    groups: int  # collectives in the window
    base_groups: int  # collectives before it
    base_interval_ns: int | None  # median, None without a baseline
    slow_interval_ns: int | None
    base_duration_ns: int | None  # of its longest member call, median
    slow_duration_ns: int | None
    span_ns: int  # from its first entry to its last (one member's clock)
    onset: bool

    @property
    def factor(self) -> float | None:
        if not self.base_interval_ns or self.slow_interval_ns is None:
            return None
        return self.slow_interval_ns / self.base_interval_ns

    @property
    def lost_ns(self) -> int:
        """What the window lost against its baseline: its span less what it
        would have taken at the baseline's rhythm (0 if not known)."""
        f = self.factor
        return int(self.span_ns * (1 - 1 / f)) if f is not None and f > 1 else 0

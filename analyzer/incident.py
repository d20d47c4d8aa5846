"""The analyzer's internal records: one incident as typed tables.

Every input (our dumps, PyTorch Flight Recorder dumps) is turned into an
``Incident``: processes (one per rank), communicators (members in comm-rank
order), and one columnar table of NCCL calls (``Calls``) plus the kernel
events that explain slowness.  Strings (hosts) are interned as small integers
in the columns; the tables beside them map them back.

Timestamps are monotonic nanoseconds *of the host that recorded them*; they
are only ever compared with timestamps of the same host.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

# where the analyzer finds them (one home: the opener of every command)
from stallwatch.dumpers.inputs import InputStatus as InputStatus
from stallwatch.dumpers.inputs import SourceKind as SourceKind

from .columns import Columns

if TYPE_CHECKING:
    from .late import LateReport
    from .positionjudge import HostReadings


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
    no input holds that rank (a missing dump)."""

    comm_hash: int
    members: tuple[int, ...]
    label: str = ""  # the process group's name, where the input names it
    is_split: bool = False
    desc: str = ""  # the process group's description (Flight Recorder's pg_config)
    world_ranks: tuple[int, ...] = ()  # world rank of each comm rank, when known

    def world_rank(self, crank: int) -> int:
        """The world rank of a member, -1 if unknown."""
        return self.world_ranks[crank] if crank < len(self.world_ranks) else -1

    @property
    def nranks(self) -> int:
        return len(self.members)

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


# host: the dump it came from (whose clock ts is in); local/remote: the hosts
# whose addresses are the sender and the receiver, -1 if unknown
TCP_RETRANS_DTYPE = np.dtype(
    [("host", "<i4"), ("pid", "<u4"), ("ts", "<i8"), ("local", "<i4"), ("remote", "<i4")]
)
# holder: the process that held the CPU until the waiting thread got it (the
# last one; 0 the idle task), dumpers.schema.PREV_PID_UNKNOWN if not recorded
SCHED_DTYPE = np.dtype(
    [("host", "<i4"), ("pid", "<u4"), ("ts", "<i8"), ("delay", "<i8"), ("holder", "<i8")]
)


@dataclass(frozen=True, slots=True)
class Incident:
    """Everything known about one incident, from every input that belongs to it."""

    id: str
    hosts: tuple[str, ...]
    host_now: tuple[int | None, ...]  # per host: when it dumped (its clock), None if unknown
    procs: tuple[Proc, ...]
    comms: tuple[Comm, ...]
    calls: Calls
    retransmits: np.ndarray  # TCP_RETRANS_DTYPE
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
    readings: tuple[HostReadings, ...] = ()  # thread positions per host (analyzer.positionjudge)
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

    def to_wall(self, host: int) -> int | None:
        """The offset of a host's timestamps to wall clock, None if unknown."""
        return self.wall_offset[host] if self.wall_offset else 0

    def host_index(self, host: str) -> int:
        return self.hosts.index(host)

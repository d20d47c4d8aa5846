"""Fault specs for ``stallwatch lab run --fault SPEC``.

A spec is ``kind:key=value,key=value``:

    hang:rank=R,step=S[,agents=ready]  rank R blocks forever before its first collective of step S
                                       (agents=ready: S steps after every agent of the run is
                                       ready, e.g. late ones: however long their start takes)
    slow:rank=R,ms=M[,step=S]          rank R computes M ms longer every step (from step S)
    loss:node=N,pct=P[,dir=D][,step=S] P% of node N's TCP packets are dropped (nftables numgen),
                                       from the start or once a rank reaches step S; D is
                                       both (default), in (to the node) or out (from it)
    rate:node=N,mbit=M[,dir=D][,step=S]
                                       node N's link is capped at M Mbit/s (tc tbf)
    partition:node=N,step=S[,ms=M][,dir=D]
                                       every packet to and from node N is dropped on its switch
                                       port from step S (with ms: for M ms, a flap; the job goes
                                       on); dir=in or out: one direction only (a one-way cut)
    mtu:node=N,bytes=B[,step=S]        packets of node N larger than B bytes (IP length) dropped
                                       both ways, small ones pass: an MTU blackhole
    syn:node=N[,step=S]                TCP SYNs to and from node N dropped: no new connection
    corrupt:node=N,pct=P[,step=S]      P% of node N's TCP packets get a byte overwritten on its
                                       switch port, with checksums computed in software: the
                                       receiver's TCP drops them as corrupt
    bulk:node=N,mbit=M[,to=K][,step=S] a neighbour outside the job streams M Mbit/s of TCP from
                                       node N to node K (default: the next node)
    linkdown:node=N,step=S[,ms=M]      node N's link loses carrier at step S (its switch port
                                       set down: eth0 shows NO-CARRIER); with ms, back after M ms
    rst:node=N,step=S                  the job's TCP connections of node N are reset at step S
    mismatch:rank=R,step=S,field=F     rank R passes a different count|dtype|op at step S
    crash:rank=R,step=S[,signal=SIG]   rank R exits with code 3 at step S, or kills itself with SIG
    cpuhog:rank=R[,step=S]             busy processes pinned to rank R's CPU (from step S)
    throttle:rank=R,pct=P[,step=S]     rank R's process capped at P% of a CPU (its cgroup's CPU
                                       quota), from the start or from step S
    stop:rank=R,step=S,ms=M            rank R is stopped (SIGSTOP) at step S and continued after
                                       M ms; rank=all stops every rank of the job together
    gpuslow:rank=R,ms=M[,step=S]       (gpu mode) rank R's device work takes M ms longer every step
    gpuhang:rank=R,step=S              (gpu mode) rank R's device stops at step S (its host goes on)
    pause:every=N,ms=M[,rank=R][,work=W]
                                       every N steps every rank pauses M ms, as for a checkpoint
                                       (with rank: only R pauses, the others wait for it in a
                                       barrier); a healthy job's long phase, not a fault; W what
                                       it does meanwhile: sleep (default), io (writes and syncs a
                                       file, as a checkpoint does), cpu (computes, as an
                                       evaluation does): no collective either way
    late:rank=R,ms=M                   rank R starts M ms after the others (its peers wait for
                                       it in their first NCCL calls); healthy, not a fault
    agentkill:node=N,step=S[,after=SEC][,signal=SIG]
                                       node N's agent is killed (SIGKILL) once a rank
                                       reaches step S (SEC later); supervision restarts it
    agentoom:node=N,step=S             node N's agent is killed by its memory bound
                                       (cgroup) at step S; supervision restarts it
    agentlate:node=N,step=S            node N's agent starts only once a rank reaches step S
    agentgone:node=N,step=S            node N's agent is killed (SIGKILL) at step S for good;
                                       its node is dumped with ``dump --pinned``

"At step S" means: once any rank reaches step S.  Faults inside a rank
(slow, gpuslow, pause, hang, mismatch, crash, gpuhang) fire exactly at the
rank's step; faults the runner injects (the network ones, cpuhog, the agent
faults) fire as soon as the runner sees a rank at that step (``lab.injector``),
and report the step they really fired at.

Agent faults need ``--record``: the lab supervises each agent as its systemd
unit would (``lab.supervise``).  Ranks are global (node n holds ranks
n*R .. n*R+R-1).  Parsing gives frozen records; ``validate`` checks them
against the topology.  Errors are one line and name the part of the spec
that is wrong.
"""

from __future__ import annotations

import enum
import signal
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from stallwatch.dumpers.errors import UsageError

SPEC_HELP = (
    "hang:rank=R,step=S[,agents=ready]  rank R blocks before its collectives of step S"
    " (agents=ready: S steps after every agent is ready)",
    "slow:rank=R,ms=M[,step=S]          rank R computes M ms longer every step (from step S)",
    "loss:node=N,pct=P[,dir=D][,step=S]  P% of node N's TCP packets are dropped (from step S;"
    " D: both, in or out)",
    "rate:node=N,mbit=M[,dir=D][,step=S]  node N's link is capped at M Mbit/s (from step S)",
    "partition:node=N,step=S[,ms=M][,dir=D]  every packet of node N dropped from step S"
    " (ms: a flap; dir=in|out: one way only)",
    "mtu:node=N,bytes=B[,step=S]        node N's packets over B bytes dropped both ways"
    " (an MTU blackhole)",
    "syn:node=N[,step=S]                TCP SYNs to and from node N dropped: no new connection",
    "corrupt:node=N,pct=P[,step=S]      P% of node N's TCP packets corrupted (dropped by TCP)",
    "bulk:node=N,mbit=M[,to=K][,step=S]  a neighbour streams M Mbit/s from node N to node K",
    "linkdown:node=N,step=S[,ms=M]      node N's link loses carrier at step S (ms: up after M ms)",
    "rst:node=N,step=S                  the job's TCP connections of node N reset at step S",
    "mismatch:rank=R,step=S,field=F     rank R passes another count|dtype|op at step S",
    "crash:rank=R,step=S[,signal=SIG]   rank R exits with code 3 at step S, or dies of SIG",
    "cpuhog:rank=R[,step=S]             busy processes pinned to rank R's CPU (from step S)",
    "throttle:rank=R,pct=P[,step=S]     rank R capped at P% of a CPU by its cgroup (from step S)",
    "stop:rank=R,step=S,ms=M            rank R (rank=all: every rank) stopped for M ms at step S",
    "gpuslow:rank=R,ms=M[,step=S]       (gpu mode) rank R's device work is M ms slower a step",
    "gpuhang:rank=R,step=S              (gpu mode) rank R's device stops at step S",
    "pause:every=N,ms=M[,rank=R][,work=W]  every N steps every rank (or rank R alone, the"
    " others waiting in a barrier) pauses M ms, sleeping, writing (io) or computing (cpu): healthy",
    "late:rank=R,ms=M                   rank R starts M ms after the others: healthy",
    "agentkill:node=N,step=S[,after=SEC][,signal=SIG]  node N's agent killed at step S, restarted",
    "agentoom:node=N,step=S             node N's agent killed by its memory bound, restarted",
    "agentlate:node=N,step=S            node N's agent started only at step S",
    "agentgone:node=N,step=S            node N's agent killed at step S for good, dump --pinned",
)
MAX_PCT = 100
MAX_STEP = 10**9
MAX_MS = 600_000.0  # compute faults and pauses: ten minutes a step at most
MAX_OUTAGE_MS = 3_600_000.0  # a flap or an outage: an hour at most


@dataclass(frozen=True, slots=True)
class Topology:
    """Nodes and ranks of one lab job."""

    nodes: int
    ranks_per_node: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_rank(self, rank: int) -> int:
        return rank % self.ranks_per_node


class Direction(enum.Enum):
    """Which of a node's packets a link fault acts on, seen from the node."""

    BOTH = "both"
    IN = "in"  # to the node (its switch port's egress)
    OUT = "out"  # from the node (its switch port's ingress)


class MismatchField(enum.Enum):
    COUNT = "count"
    DTYPE = "dtype"
    OP = "op"


@dataclass(frozen=True, slots=True)
class Hang:
    rank: int
    step: int
    # step counted from the step at which every agent of the run was ready
    # (the runner says so through a file in the run folder): a hang after late
    # agents attached comes soon after they did, not at a step guessed late enough
    agents_ready: bool = False


@dataclass(frozen=True, slots=True)
class Slow:
    rank: int
    ms: float
    step: int | None = None  # from this step on; None: from the first


@dataclass(frozen=True, slots=True)
class Loss:
    node: int
    pct: int
    step: int | None = None  # None: from before the job starts
    dir: Direction = Direction.BOTH


@dataclass(frozen=True, slots=True)
class Rate:
    node: int
    mbit: float
    step: int | None = None
    dir: Direction = Direction.BOTH


@dataclass(frozen=True, slots=True)
class Mtu:
    """Packets of the node over ``size`` bytes (IP length) dropped both ways."""

    node: int
    size: int
    step: int | None = None


@dataclass(frozen=True, slots=True)
class SynDrop:
    """TCP SYNs to and from the node dropped: its established connections go
    on, no new one is made."""

    node: int
    step: int | None = None


@dataclass(frozen=True, slots=True)
class Corrupt:
    """``pct``% of the node's TCP packets get a byte overwritten on its
    switch port; checksums are computed in software on every node, so the
    receiving TCP drops them (as a NIC would on a bad frame check)."""

    node: int
    pct: int
    step: int | None = None


@dataclass(frozen=True, slots=True)
class Bulk:
    """A neighbour outside the job streaming ``mbit`` Mbit/s of TCP from the
    node to node ``to`` (None: the next node)."""

    node: int
    mbit: float
    to: int | None = None
    step: int | None = None


@dataclass(frozen=True, slots=True)
class Partition:
    """Every packet to and from the node dropped on its switch port."""

    node: int
    step: int
    ms: float | None = None  # a flap: the drop rule removed after ms; None: for good
    dir: Direction = Direction.BOTH  # in or out: a one-way cut


@dataclass(frozen=True, slots=True)
class LinkDown:
    """The node's switch port set down: its eth0 loses carrier."""

    node: int
    step: int
    ms: float | None = None  # back up after ms; None: down for good


@dataclass(frozen=True, slots=True)
class Rst:
    """The job's TCP connections of the node reset (both ends see it)."""

    node: int
    step: int


@dataclass(frozen=True, slots=True)
class Pause:
    """Every ``every`` steps (before steps N, 2N, ...) a long phase such as a
    checkpoint: every rank, or rank ``rank`` alone, sleeps ``ms``, then
    every rank joins a barrier.  A healthy job's rhythm, not a fault."""

    every: int
    ms: float
    rank: int | None = None  # None: every rank pauses
    work: str = "sleep"  # PAUSE_WORK: what the pausing ranks do meanwhile


PAUSE_WORK = ("sleep", "io", "cpu")


@dataclass(frozen=True, slots=True)
class Late:
    """Rank ``rank`` starts ``ms`` after the others: healthy, not a fault."""

    rank: int
    ms: float


@dataclass(frozen=True, slots=True)
class Mismatch:
    rank: int
    step: int
    field: MismatchField


@dataclass(frozen=True, slots=True)
class Crash:
    rank: int
    step: int
    signal: signal.Signals | None  # None: exit with code 3


@dataclass(frozen=True, slots=True)
class CpuHog:
    rank: int
    step: int | None = None  # None: hogging from before the job starts


@dataclass(frozen=True, slots=True)
class Throttle:
    """The rank's process capped at ``pct``% of one CPU (its cgroup's quota)."""

    rank: int
    pct: int
    step: int | None = None


@dataclass(frozen=True, slots=True)
class Stop:
    """The rank (None: every rank) stopped with SIGSTOP at ``step`` and
    continued ``ms`` later."""

    rank: int | None
    step: int
    ms: float


@dataclass(frozen=True, slots=True)
class GpuSlow:
    rank: int
    ms: float
    step: int | None = None


@dataclass(frozen=True, slots=True)
class GpuHang:
    rank: int
    step: int


@dataclass(frozen=True, slots=True)
class AgentKill:
    node: int
    step: int
    after_s: float = 0.0
    signal: signal.Signals = signal.SIGKILL


@dataclass(frozen=True, slots=True)
class AgentOom:
    node: int
    step: int


@dataclass(frozen=True, slots=True)
class AgentLate:
    node: int
    step: int


@dataclass(frozen=True, slots=True)
class AgentGone:
    node: int
    step: int


Fault = (
    Hang
    | Slow
    | Loss
    | Rate
    | Partition
    | LinkDown
    | Rst
    | Mtu
    | SynDrop
    | Corrupt
    | Bulk
    | Throttle
    | Stop
    | Pause
    | Mismatch
    | Crash
    | CpuHog
    | GpuSlow
    | GpuHang
    | AgentKill
    | AgentOom
    | AgentLate
    | AgentGone
    | Late
)
RankFault = Hang | Slow | Mismatch | Crash | CpuHog | GpuSlow | GpuHang | Late
GPU_FAULTS = (GpuSlow, GpuHang)
NodeFault = Loss | Rate | Partition | LinkDown | Rst | Mtu | SynDrop | Corrupt | Bulk
# acted on a rank's process from outside it (by the runner)
ProcessFault = Throttle | Stop
AgentFault = AgentKill | AgentOom | AgentLate | AgentGone

CRASH_EXIT_CODE = 3


class _Fields:
    """The key=value part of one spec, consumed field by field."""

    def __init__(self, spec: str, kind: str, text: str) -> None:
        self.spec = spec
        self.kind = kind
        self.values: dict[str, str] = {}
        for part in text.split(",") if text else []:
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep or not key or not value.strip():
                self.fail(f"expected key=value, got {part!r}")
            if key in self.values:
                self.fail(f"{key!r} given twice")
            self.values[key] = value.strip()

    def fail(self, why: str) -> None:
        raise UsageError(f"bad fault spec {self.spec!r}: {why}")

    def take(self, key: str, conv: Callable[[str], object], what: str) -> object:
        if key not in self.values:
            self.fail(f"{self.kind} needs {key}=<{what}>")
        raw = self.values.pop(key)
        try:
            return conv(raw)
        except ValueError:
            self.fail(f"{key}={raw!r} is not {what}")
            raise  # unreachable: fail raises

    def integer(self, key: str, low: int, high: int) -> int:
        value = self.take(key, int, "an integer")
        assert isinstance(value, int)
        if not low <= value <= high:
            self.fail(f"{key}={value} is out of range {low}..{high}")
        return value

    def number(self, key: str, low: float, high: float) -> float:
        value = self.take(key, float, "a number")
        assert isinstance(value, float)
        if not low < value <= high:
            self.fail(f"{key}={value:g} must be > {low:g} and <= {high:g}")
        return value

    def optional_integer(self, key: str, low: int, high: int) -> int | None:
        return self.integer(key, low, high) if key in self.values else None

    def optional_number(self, key: str, low: float, high: float) -> float | None:
        return self.number(key, low, high) if key in self.values else None

    def done(self) -> None:
        if self.values:
            self.fail(f"unknown key(s) for {self.kind}: {', '.join(sorted(self.values))}")


def _signal(raw: str) -> signal.Signals:
    name = raw.upper()
    if name.isdigit():
        return signal.Signals(int(name))
    return signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]


def _signal_or_fail(fields: _Fields) -> signal.Signals | None:
    if "signal" not in fields.values:
        return None
    raw = fields.values.pop("signal")
    try:
        return _signal(raw)
    except (KeyError, ValueError):
        fields.fail(f"signal={raw!r} is not a signal name or number (e.g. KILL, SEGV, 9)")
        raise


def _field(fields: _Fields) -> MismatchField:
    raw = fields.take("field", str, "count|dtype|op")
    try:
        return MismatchField(raw)
    except ValueError:
        fields.fail(f"field={raw!r} must be one of count, dtype, op")
        raise


def _hang(f: _Fields) -> Fault:
    rank, step = f.integer("rank", 0, MAX_STEP), f.integer("step", 0, MAX_STEP)
    ready = False
    if "agents" in f.values:
        ready = f.take("agents", str, "ready") == "ready"
        if not ready:
            f.fail("agents= takes only 'ready'")
    return Hang(rank=rank, step=step, agents_ready=ready)


def _slow(f: _Fields) -> Fault:
    rank, ms = f.integer("rank", 0, MAX_STEP), f.number("ms", 0.0, MAX_MS)
    return Slow(rank=rank, ms=ms, step=f.optional_integer("step", 0, MAX_STEP))


def _direction(fields: _Fields) -> Direction:
    if "dir" not in fields.values:
        return Direction.BOTH
    raw = fields.values.pop("dir")
    try:
        return Direction(raw)
    except ValueError:
        fields.fail(f"dir={raw!r} must be one of both, in, out")
        raise


def _loss(f: _Fields) -> Fault:
    node, pct = f.integer("node", 0, MAX_STEP), f.integer("pct", 1, MAX_PCT)
    step = f.optional_integer("step", 0, MAX_STEP)
    return Loss(node=node, pct=pct, step=step, dir=_direction(f))


def _rate(f: _Fields) -> Fault:
    node, mbit = f.integer("node", 0, MAX_STEP), f.number("mbit", 0.0, 100_000.0)
    step = f.optional_integer("step", 0, MAX_STEP)
    return Rate(node=node, mbit=mbit, step=step, dir=_direction(f))


def _partition(f: _Fields) -> Fault:
    node, step = f.integer("node", 0, MAX_STEP), f.integer("step", 0, MAX_STEP)
    ms = f.optional_number("ms", 0.0, MAX_OUTAGE_MS)
    return Partition(node=node, step=step, ms=ms, dir=_direction(f))


# an IPv4 packet carries at least its 20-byte header and a TCP or ICMP
# header; 65,535 is the largest IP length
MIN_IP_SIZE, MAX_IP_SIZE = 28, 65_535


def _mtu(f: _Fields) -> Fault:
    node, size = f.integer("node", 0, MAX_STEP), f.integer("bytes", MIN_IP_SIZE, MAX_IP_SIZE)
    return Mtu(node=node, size=size, step=f.optional_integer("step", 0, MAX_STEP))


def _syn(f: _Fields) -> Fault:
    return SynDrop(
        node=f.integer("node", 0, MAX_STEP), step=f.optional_integer("step", 0, MAX_STEP)
    )


def _corrupt(f: _Fields) -> Fault:
    node, pct = f.integer("node", 0, MAX_STEP), f.integer("pct", 1, MAX_PCT)
    return Corrupt(node=node, pct=pct, step=f.optional_integer("step", 0, MAX_STEP))


def _bulk(f: _Fields) -> Fault:
    node, mbit = f.integer("node", 0, MAX_STEP), f.number("mbit", 0.0, 100_000.0)
    to = f.optional_integer("to", 0, MAX_STEP)
    if to == node:
        f.fail(f"to={to} is the node itself: a bulk neighbour streams to another node")
    return Bulk(node=node, mbit=mbit, to=to, step=f.optional_integer("step", 0, MAX_STEP))


def _throttle(f: _Fields) -> Fault:
    rank, pct = f.integer("rank", 0, MAX_STEP), f.integer("pct", 1, MAX_PCT)
    return Throttle(rank=rank, pct=pct, step=f.optional_integer("step", 0, MAX_STEP))


def _stop(f: _Fields) -> Fault:
    rank: int | None = None
    if f.values.get("rank") == "all":
        del f.values["rank"]
    else:
        rank = f.integer("rank", 0, MAX_STEP)
    step, ms = f.integer("step", 0, MAX_STEP), f.number("ms", 0.0, MAX_OUTAGE_MS)
    return Stop(rank=rank, step=step, ms=ms)


def _linkdown(f: _Fields) -> Fault:
    node, step = f.integer("node", 0, MAX_STEP), f.integer("step", 0, MAX_STEP)
    return LinkDown(node=node, step=step, ms=f.optional_number("ms", 0.0, MAX_OUTAGE_MS))


def _rst(f: _Fields) -> Fault:
    return Rst(node=f.integer("node", 0, MAX_STEP), step=f.integer("step", 0, MAX_STEP))


def _pause(f: _Fields) -> Fault:
    every, ms = f.integer("every", 1, MAX_STEP), f.number("ms", 0.0, MAX_MS)
    work = f.values.pop("work", "sleep")
    if work not in PAUSE_WORK:
        f.fail(f"work={work!r}: expected one of {', '.join(PAUSE_WORK)}")
    return Pause(every=every, ms=ms, rank=f.optional_integer("rank", 0, MAX_STEP), work=work)


def _late(f: _Fields) -> Fault:
    return Late(rank=f.integer("rank", 0, MAX_STEP), ms=f.number("ms", 0.0, MAX_MS))


def _mismatch(f: _Fields) -> Fault:
    rank, step = f.integer("rank", 0, MAX_STEP), f.integer("step", 0, MAX_STEP)
    return Mismatch(rank=rank, step=step, field=_field(f))


def _crash(f: _Fields) -> Fault:
    rank, step = f.integer("rank", 0, MAX_STEP), f.integer("step", 0, MAX_STEP)
    return Crash(rank=rank, step=step, signal=_signal_or_fail(f))


def _cpuhog(f: _Fields) -> Fault:
    rank = f.integer("rank", 0, MAX_STEP)
    return CpuHog(rank=rank, step=f.optional_integer("step", 0, MAX_STEP))


def _gpuslow(f: _Fields) -> Fault:
    rank, ms = f.integer("rank", 0, MAX_STEP), f.number("ms", 0.0, MAX_MS)
    return GpuSlow(rank=rank, ms=ms, step=f.optional_integer("step", 0, MAX_STEP))


def _gpuhang(f: _Fields) -> Fault:
    return GpuHang(rank=f.integer("rank", 0, MAX_STEP), step=f.integer("step", 0, MAX_STEP))


def _agentkill(f: _Fields) -> Fault:
    node, step = f.integer("node", 0, MAX_STEP), f.integer("step", 0, MAX_STEP)
    after = 0.0
    if "after" in f.values:
        after = f.number("after", -1e-9, 3600.0)
    sig = _signal_or_fail(f) or signal.SIGKILL
    return AgentKill(node=node, step=step, after_s=after, signal=sig)


def _agentoom(f: _Fields) -> Fault:
    return AgentOom(node=f.integer("node", 0, MAX_STEP), step=f.integer("step", 0, MAX_STEP))


def _agentlate(f: _Fields) -> Fault:
    return AgentLate(node=f.integer("node", 0, MAX_STEP), step=f.integer("step", 0, MAX_STEP))


def _agentgone(f: _Fields) -> Fault:
    return AgentGone(node=f.integer("node", 0, MAX_STEP), step=f.integer("step", 0, MAX_STEP))


_PARSERS: Mapping[str, Callable[[_Fields], Fault]] = {
    "hang": _hang,
    "slow": _slow,
    "loss": _loss,
    "rate": _rate,
    "partition": _partition,
    "linkdown": _linkdown,
    "rst": _rst,
    "mtu": _mtu,
    "syn": _syn,
    "corrupt": _corrupt,
    "bulk": _bulk,
    "throttle": _throttle,
    "stop": _stop,
    "mismatch": _mismatch,
    "crash": _crash,
    "cpuhog": _cpuhog,
    "gpuslow": _gpuslow,
    "gpuhang": _gpuhang,
    "pause": _pause,
    "late": _late,
    "agentkill": _agentkill,
    "agentoom": _agentoom,
    "agentlate": _agentlate,
    "agentgone": _agentgone,
}


def parse_fault(spec: str) -> Fault:
    """One spec, e.g. ``"hang:rank=3,step=5"``; raises UsageError naming the bad part."""
    kind, sep, rest = spec.strip().partition(":")
    kind = kind.strip().lower()
    if kind not in _PARSERS:
        raise UsageError(
            f"bad fault spec {spec!r}: unknown kind {kind!r} "
            f"(expected one of {', '.join(_PARSERS)})"
        )
    fields = _Fields(spec, kind, rest.strip() if sep else "")
    fault = _PARSERS[kind](fields)
    fields.done()
    return fault


def parse_faults(specs: Iterable[str]) -> tuple[Fault, ...]:
    return tuple(parse_fault(spec) for spec in specs)


def validate(
    faults: Iterable[Fault], topology: Topology, steps: int, mode: str | None = None
) -> None:
    """Ranks, nodes and steps must exist in this job; device faults need a
    device (``mode`` gpu; None: not checked)."""
    for fault in faults:
        where = f"fault {format_fault(fault)!r}"
        if mode is not None and mode != "gpu" and isinstance(fault, GPU_FAULTS):
            raise UsageError(f"{where} needs --mode gpu (the ranks have no device in {mode} mode)")
        if isinstance(fault, NodeFault | AgentFault) and fault.node >= topology.nodes:
            raise UsageError(
                f"{where}: node {fault.node} does not exist (nodes are 0..{topology.nodes - 1})"
            )
        if isinstance(fault, Bulk):
            _check_bulk(fault, topology, where)
        rank = fault.rank if not isinstance(fault, NodeFault | AgentFault) else None
        if rank is not None and rank >= topology.world_size:
            raise UsageError(
                f"{where}: rank {rank} does not exist (ranks are 0..{topology.world_size - 1})"
            )
        step = getattr(fault, "step", None)
        if step is not None and step >= steps:
            raise UsageError(f"{where}: step {step} is never reached (steps are 0..{steps - 1})")
        if isinstance(fault, Pause) and fault.every >= steps:
            raise UsageError(
                f"{where}: every={fault.every} pauses before step {fault.every}, "
                f"never reached (steps are 0..{steps - 1})"
            )
    _check_duplicates(faults)


def bulk_peer(fault: Bulk, nodes: int) -> int:
    """The node a bulk neighbour streams to."""
    return fault.to if fault.to is not None else (fault.node + 1) % nodes


def _check_bulk(fault: Bulk, topology: Topology, where: str) -> None:
    if topology.nodes < 2:
        raise UsageError(f"{where}: a bulk neighbour needs a second node to stream to")
    if fault.to is not None and fault.to >= topology.nodes:
        raise UsageError(
            f"{where}: node {fault.to} does not exist (nodes are 0..{topology.nodes - 1})"
        )


def _target(fault: Fault) -> object:
    if isinstance(fault, NodeFault | AgentFault):
        return fault.node
    if isinstance(fault, Pause):  # a checkpoint and an evaluation: two pauses of every rank
        return (fault.rank, fault.work)
    return fault.rank


def _check_duplicates(faults: Iterable[Fault]) -> None:
    seen: set[tuple[type, object]] = set()
    for fault in faults:
        key = (type(fault), _target(fault))
        if key in seen:
            raise UsageError(f"fault {format_fault(fault)!r} is given twice for the same target")
        seen.add(key)


def _dir(way: Direction) -> str:
    return "" if way is Direction.BOTH else f",dir={way.value}"


def _opt(key: str, value: float | None) -> str:
    if value is None:
        return ""
    return f",{key}={value}" if isinstance(value, int) else f",{key}={value:g}"


def format_fault(fault: Fault) -> str:
    """The canonical spec of a fault (parse_fault(format_fault(f)) == f)."""
    match fault:
        case Hang(rank, step, ready):
            return f"hang:rank={rank},step={step}" + (",agents=ready" if ready else "")
        case Slow(rank, ms, step):
            return f"slow:rank={rank},ms={ms:g}{_opt('step', step)}"
        case Loss(node, pct, step, way):
            return f"loss:node={node},pct={pct}{_opt('step', step)}{_dir(way)}"
        case Rate(node, mbit, step, way):
            return f"rate:node={node},mbit={mbit:g}{_opt('step', step)}{_dir(way)}"
        case Partition(node, step, ms, way):
            return f"partition:node={node},step={step}{_opt('ms', ms)}{_dir(way)}"
        case Mtu(node, size, step):
            return f"mtu:node={node},bytes={size}{_opt('step', step)}"
        case SynDrop(node, step):
            return f"syn:node={node}{_opt('step', step)}"
        case Corrupt(node, pct, step):
            return f"corrupt:node={node},pct={pct}{_opt('step', step)}"
        case Bulk(node, mbit, to, step):
            return f"bulk:node={node},mbit={mbit:g}{_opt('to', to)}{_opt('step', step)}"
        case Throttle(rank, pct, step):
            return f"throttle:rank={rank},pct={pct}{_opt('step', step)}"
        case Stop(rank, step, ms):
            who = "all" if rank is None else str(rank)
            return f"stop:rank={who},step={step},ms={ms:g}"
        case LinkDown(node, step, ms):
            return f"linkdown:node={node},step={step}{_opt('ms', ms)}"
        case Rst(node, step):
            return f"rst:node={node},step={step}"
        case Pause(every, ms, rank, work):
            tail = f",work={work}" if work != "sleep" else ""
            return f"pause:every={every},ms={ms:g}{_opt('rank', rank)}{tail}"
        case Late(rank, ms):
            return f"late:rank={rank},ms={ms:g}"
        case Mismatch(rank, step, field):
            return f"mismatch:rank={rank},step={step},field={field.value}"
        case Crash(rank, step, sig):
            tail = f",signal={sig.name.removeprefix('SIG')}" if sig is not None else ""
            return f"crash:rank={rank},step={step}{tail}"
        case CpuHog(rank, step):
            return f"cpuhog:rank={rank}{_opt('step', step)}"
        case GpuSlow(rank, ms, step):
            return f"gpuslow:rank={rank},ms={ms:g}{_opt('step', step)}"
        case GpuHang(rank, step):
            return f"gpuhang:rank={rank},step={step}"
        case AgentKill(node, step, after_s, sig):
            after = f",after={after_s:g}" if after_s else ""
            tail = f",signal={sig.name.removeprefix('SIG')}" if sig != signal.SIGKILL else ""
            return f"agentkill:node={node},step={step}{after}{tail}"
        case AgentOom(node, step):
            return f"agentoom:node={node},step={step}"
        case AgentLate(node, step):
            return f"agentlate:node={node},step={step}"
        case AgentGone(node, step):
            return f"agentgone:node={node},step={step}"
    raise AssertionError(fault)


def for_rank(faults: Iterable[Fault], rank: int) -> tuple[RankFault | Pause, ...]:
    """What a rank acts on itself: its own faults, and every pause (each
    rank joins the barrier after one, whoever pauses)."""
    return tuple(
        f for f in faults if (isinstance(f, RankFault) and f.rank == rank) or isinstance(f, Pause)
    )


def active(fault: Slow | GpuSlow | CpuHog | Loss | Rate | Throttle, step: int) -> bool:
    """Whether a fault that acts from a step (or from the start) acts at ``step``."""
    return fault.step is None or step >= fault.step


def pauses_at(pause: Pause, step: int) -> bool:
    """Pauses come before steps every, 2*every, ...: after every ``every`` steps."""
    return step > 0 and step % pause.every == 0

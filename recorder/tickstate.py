"""What the agent's kernel side reports to the watchdog, each tick.

This is the seam between the BPF maps (recorder.probes, recorder.agent) and the
watchdog's pure logic (recorder.watchdog): the agent reads its maps into these
records; tests build them by hand or from a replayed event source.
All times are CLOCK_MONOTONIC nanoseconds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class InflightCall:
    """An NCCL call that has entered and not returned; or, ``queued``, one
    that returned and waits on its stream: the device has not completed it
    (where the CUDA probes see the stream's completions)."""

    pid: int
    tid: int
    comm_hash: int
    op: int  # dumpers.schema.Op
    seq: int
    entered_ns: int
    queued: bool = False


@dataclass(frozen=True, slots=True)
class CommProgress:
    """One communicator in one process: when it last moved."""

    pid: int
    comm: int  # ncclComm_t pointer value
    comm_hash: int
    rank: int
    nranks: int
    last_enter_ns: int  # last entry of a collective or p2p call, 0 if none
    last_return_ns: int  # last return, 0 if none
    calls: int  # collective + p2p calls entered so far
    inflight: int  # calls entered and not returned
    destroyed: bool
    init_ns: int = 0  # when its init returned; 0: made before the agent attached


@dataclass(frozen=True, slots=True)
class ProcessState:
    pid: int
    alive: bool
    holds_comms: bool
    exit_code: int | None = None  # exit_group code, if seen
    exit_signal: int | None = None  # fatal signal, if seen
    exit_ns: int = 0


@dataclass(frozen=True, slots=True)
class Slowdown:
    """A slowdown sustained long enough to be an incident (recorder.slowdown):
    ``since_ns`` (when it began) keys the episode."""

    cause: str  # rhythm | late | held
    pid: int
    comm: int  # ncclComm_t pointer value
    comm_hash: int
    since_ns: int
    reason: str


@dataclass(frozen=True, slots=True)
class TickState:
    now_ns: int
    inflight: tuple[InflightCall, ...]
    comms: tuple[CommProgress, ...]
    processes: tuple[ProcessState, ...]
    slowdowns: tuple[Slowdown, ...] = ()

"""One rank of the lab's training job (``python -m stallwatch.commands.labrank --rank R ...``).

Each rank is its own process and drives the lab's ``libnccl.so.2`` through
ctypes, as a framework would.  Rank 0 makes the unique id and publishes it in
the run directory (written atomically; the others poll for it); every rank
joins the world communicator and splits it into a tensor-parallel group (the
ranks of one node) and a data-parallel group (the same local rank on every
node).  Then S steps, each: simulated compute (a busy loop), AllGather and
ReduceScatter on TP, the gradient AllReduce on DP, Send/Recv between pipeline
neighbours on DP (grouped), a Broadcast and the loss AllReduce on world.
Inputs are deterministic, and every result is checked with numpy.

The rank writes ``rank-<R>.json`` (``RankReport``) in the run directory after
init, after every step and at the end, so the progress of a rank that hangs or
dies is known.  It counts every NCCL call it makes, per symbol and per
communicator label (``world``, ``tp``, ``dp``; ``none`` for group calls);
``ncclCommSplit`` is counted under the label of the communicator it creates,
``ncclGetUniqueId`` and ``ncclCommInitRank`` under ``world``.

In ``gpu`` mode (``lab.gpu``) the same collectives are queued on CUDA streams
of the lab's ``libcudart.so.12`` the way PyTorch queues them (compute on a
compute stream, events around each collective, a watchdog thread polling
them, one stream synchronisation per step), and the report logs when each
collective returned and when the host first saw it complete.

With ``--graphs`` (gpu mode) the step's collectives are captured once, in
order, on one NCCL stream into a CUDA graph (stream capture, as PyTorch's
CUDA graphs do) and every step is one ``cudaGraphLaunch`` of it, between
the same events as a single collective: the step's inputs are copied into
the captured buffers before the launch and the results out after the step's
synchronisation.  A rank with a mismatch fault at step S captures a second
graph with the mismatched call at S and launches that one instead.

In-rank faults (``lab.faults``): hang, slow (from the start or from a step),
mismatch (applied to the loss AllReduce on world, the one collective every
rank joins), crash; in gpu mode gpuslow (longer device compute, from the
start or from a step) and gpuhang (the device stops); and pauses, the
checkpoint-like phases before every N-th step: the ranks named sleep, then
every rank joins a barrier (a one-element AllReduce on world).  Each fires
at the rank's own step and is written in the report as it fires
(``events``: when, on CLOCK_MONOTONIC, and at which step).  At each step's
start the rank also writes the step into ``STEPS_FILE`` (one pwrite), from
which the runner fires its own faults at a step (``lab.injector``), and reads
``END_FILE`` (one pread): a step written there by the runner (``lab run
--duration``) ends the job before it, on every rank alike.

Exit codes: 0 done and verified, 1 results wrong, 2 setup error (library, id),
3 crash fault, 4 an NCCL call failed.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from stallwatch.dumpers.errors import LabError, StallwatchError
from stallwatch.dumpers.schema import DataType, RedOp, fold_unique_id, split_hash
from stallwatch.lab import faults as F
from stallwatch.lab.gpu import DEFAULT_POLL_MS, Device
from stallwatch.lab.nccl import LabNccl, NcclError, UniqueId, unique_id_from_bytes

LIB_ENV = "STALLWATCH_LAB_LIB"
CUDART_ENV = "STALLWATCH_LAB_CUDART"
CUDART_NAME = "libcudart.so.12"
MODES = ("blocking", "async", "gpu")
ASYNC_ENV = "LABNCCL_ASYNC"
WAIT_ENV = "LABNCCL_WAIT"  # "spin": waiting host threads spin (lab/csrc/labwait.h)
WAITS = ("block", "spin")
UID_FILE = "world.uid"
# one little-endian int64 per rank: 1 + the step it is in (0: not begun);
# the runner reads it to fire faults at a step (``lab.injector``)
STEPS_FILE = "steps.bin"
END_FILE = "end.bin"  # the step every rank ends before (plus one; 0: as asked)
AGENTS_READY_FILE = "agents.ready"  # the runner writes it once every agent is ready
NO_COMM = "none"

EXIT_OK = 0
EXIT_VERIFY = 1
EXIT_SETUP = 2
EXIT_NCCL = 4

DEFAULT_ELEMENTS = 262_144  # DP gradient AllReduce: 1 MiB of float32
DEFAULT_COMPUTE_MS = 2.0  # CPU time of one step's simulated compute
STATUS_RUNNING = "running"
STATUS_DONE = "done"
STATUS_HUNG = "hung"


def report_path(run_dir: Path, rank: int) -> Path:
    return run_dir / f"rank-{rank}.json"


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# --- the report -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RankReport:
    """What one rank says about itself (``rank-<R>.json``)."""

    world_rank: int
    node: int
    local_rank: int
    pid: int
    mode: str
    steps_total: int
    steps_done: int
    verified_ok: int
    verified_failed: int
    status: str  # running | done | error | crashed | hung | verify_failed
    error: str | None
    exit_code: int | None
    calls: dict[str, dict[str, int]]
    comms: dict[str, dict[str, Any]]
    step_ms: list[float]
    step_start_ns: list[int]  # CLOCK_MONOTONIC when each step began (one clock for all ranks)
    cpu_s: float  # process CPU time since the first step began
    wall_s: float  # since the first step began
    run_delay_ms: float  # time its threads waited on a run queue since then
    compute_cpu_share: float  # CPU time / wall time inside the compute phases
    injected: list[str]
    # each in-rank fault as it fired: {"spec", "step", "at_ns", "end_ns"}
    # (CLOCK_MONOTONIC; end_ns for a pause, else None)
    events: list[dict[str, Any]]
    device_log: list[dict[str, Any]]  # gpu mode: each collective's return and completion seen

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> RankReport:
        raw = json.loads(data)
        return cls(**{name: raw[name] for name in cls.__dataclass_fields__})


def make_steps_file(run_dir: Path, world: int) -> None:
    (run_dir / STEPS_FILE).write_bytes(bytes(8 * world))
    (run_dir / END_FILE).write_bytes(bytes(8))


def end_job_at(run_dir: Path, step: int) -> None:
    """Every rank ends before ``step`` (the runner's ``--duration``)."""
    fd = os.open(run_dir / END_FILE, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.pwrite(fd, (step + 1).to_bytes(8, "little", signed=True), 0)
    finally:
        os.close(fd)


def read_steps(run_dir: Path) -> list[int]:
    """Each rank's current step (-1: not begun), from ``STEPS_FILE``."""
    try:
        data = (run_dir / STEPS_FILE).read_bytes()
    except OSError:
        return []
    return [int(v) - 1 for v in np.frombuffer(data[: len(data) // 8 * 8], "<i8")]


class StepMark:
    """Where this rank writes the step it begins (one pwrite a step)."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.rank = rank
        try:
            self.fd: int | None = os.open(run_dir / STEPS_FILE, os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            self.fd = None  # started by hand, without a runner: nobody reads it

        try:
            self.end_fd: int | None = os.open(run_dir / END_FILE, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self.end_fd = None

    def begin(self, step: int) -> None:
        if self.fd is not None:
            os.pwrite(self.fd, (step + 1).to_bytes(8, "little", signed=True), 8 * self.rank)

    def end(self) -> int | None:
        """The step the runner asked every rank to end before, if it did."""
        if self.end_fd is None:
            return None
        value = int.from_bytes(os.pread(self.end_fd, 8, 0).ljust(8, b"\0"), "little", signed=True)
        return value - 1 if value > 0 else None


def read_report(run_dir: Path, rank: int) -> RankReport | None:
    """The rank's last report, or None if it wrote none (yet)."""
    try:
        return RankReport.from_json(report_path(run_dir, rank).read_bytes())
    except (OSError, ValueError, KeyError, TypeError):
        return None


# --- the library ----------------------------------------------------------


class Nccl:
    """``lab.nccl``'s binding, each call counted per symbol and comm label."""

    def __init__(self, path: Path) -> None:
        self.api = LabNccl(path)
        if not self.api.has_stream_synchronize:
            raise LabError(f"{path} is not the lab's library (no labStreamSynchronize)")
        self.calls: defaultdict[str, defaultdict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.failed_call: str | None = None  # the NCCL call that returned an error
        self.replaying = False  # --graphs: the step's calls are a graph launch, not made

    def __call__(self, symbol: str, label: str, *args: Any) -> None:
        if self.replaying:
            return
        self.calls[symbol][label] += 1
        rc = int(self.api.raw(symbol, *args))
        if rc != 0:
            self.failed_call = symbol
            raise NcclError(
                f"{symbol} on {label}", rc, self.api.error_string(rc), self.api.last_error()
            )

    def counts(self) -> dict[str, dict[str, int]]:
        return {symbol: dict(per) for symbol, per in sorted(self.calls.items())}


@dataclass(frozen=True, slots=True)
class Comm:
    label: str
    handle: int
    rank: int
    nranks: int
    id_hash: int


def _ptr(array: npt.NDArray[Any]) -> int:
    return int(array.ctypes.data)


# --- the training step ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sizes:
    grad: int  # DP AllReduce, float32 elements
    shard: int  # TP AllGather sendcount / ReduceScatter recvcount
    bcast: int  # world Broadcast
    act: int  # pipeline Send/Recv

    @classmethod
    def from_elements(cls, elements: int) -> Sizes:
        return cls(
            grad=elements, shard=max(1, elements // 16), bcast=4096, act=max(1, elements // 8)
        )


def pattern(n: int, scale: int, shift: int) -> npt.NDArray[np.float32]:
    """Small exact integers in float32: sums stay exact (below 2**24)."""
    base = (np.arange(n, dtype=np.int64) % 13 + 1).astype(np.float32)
    return base * np.float32(scale) + np.float32(shift)


@dataclass(slots=True)
class Check:
    what: str
    got: npt.NDArray[Any]
    want: npt.NDArray[Any]


@dataclass(slots=True)
class Rank:
    """One rank's state across the run; writes its report as it goes."""

    args: RankArgs
    topo: F.Topology
    nccl: Nccl
    faults: tuple[F.RankFault | F.Pause, ...]
    sizes: Sizes
    comms: dict[str, Comm] = field(default_factory=dict)
    steps_done: int = 0
    ok: int = 0
    failed: int = 0
    step_ms: list[float] = field(default_factory=list)
    step_start_ns: list[int] = field(default_factory=list)
    base: tuple[float, float, float] = (0.0, time.monotonic(), 0.0)  # cpu, wall, run delay
    compute_wall: float = 0.0
    compute_cpu: float = 0.0
    keep: list[npt.NDArray[Any]] = field(default_factory=list)
    gpu: Device | None = None
    graphs: Graphs | None = None
    device_stopped: str | None = None  # the gpuhang fault fired
    agents_ready_at: int | None = None  # the step at which it saw every agent ready
    events: list[dict[str, Any]] = field(default_factory=list)
    marks: StepMark | None = None
    steps_total: int = 0  # as asked, or fewer: where the runner ended the job

    @property
    def rank(self) -> int:
        return int(self.args.rank)

    def report(self, status: str, error: str | None = None, code: int | None = None) -> None:
        cpu, wall, delay = _cpu_s(), time.monotonic(), _run_delay_ms()
        rep = RankReport(
            world_rank=self.rank,
            node=self.topo.node_of(self.rank),
            local_rank=self.topo.local_rank(self.rank),
            pid=os.getpid(),
            mode=self.args.mode,
            steps_total=self.steps_total or self.args.steps,
            steps_done=self.steps_done,
            verified_ok=self.ok,
            verified_failed=self.failed,
            status=status,
            error=error,
            exit_code=code,
            calls=self.nccl.counts(),
            comms={c.label: _comm_json(c) for c in self.comms.values()},
            step_ms=[round(ms, 3) for ms in self.step_ms],
            step_start_ns=list(self.step_start_ns),
            cpu_s=round(cpu - self.base[0], 4),
            wall_s=round(wall - self.base[1], 4),
            run_delay_ms=round(delay - self.base[2], 3),
            compute_cpu_share=round(self.compute_cpu / max(self.compute_wall, 1e-9), 4),
            injected=[F.format_fault(f) for f in self.faults],
            events=list(self.events),
            device_log=self.gpu.log() if self.gpu is not None else [],
        )
        write_atomic(report_path(self.args.run_dir, self.rank), rep.to_json())

    def fault(
        self, kind: type[F.RankFault | F.Pause], step: int | None = None
    ) -> F.RankFault | F.Pause | None:
        for f in self.faults:
            if isinstance(f, kind) and (step is None or getattr(f, "step", None) == step):
                return f
        return None

    def fired(
        self, fault: F.RankFault | F.Pause, step: int, at_ns: int, end_ns: int | None = None
    ) -> None:
        """Note an in-rank fault taking effect (written with the next report)."""
        spec = F.format_fault(fault)
        self.events.append({"spec": spec, "step": step, "at_ns": at_ns, "end_ns": end_ns})

    def extra_ms(self, kind: type[F.Slow | F.GpuSlow], step: int) -> float:
        """A slow fault's extra time at ``step`` (0 before its step)."""
        slow = self.fault(kind)
        if not isinstance(slow, F.Slow | F.GpuSlow) or not F.active(slow, step):
            return 0.0
        if step == (slow.step or 0):
            self.fired(slow, step, time.monotonic_ns())
        return slow.ms

    def mark_start(self) -> None:
        self.base = (_cpu_s(), time.monotonic(), _run_delay_ms())

    def compute(self, ms: float) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        busy(ms)
        self.compute_wall += time.perf_counter() - wall
        self.compute_cpu += time.thread_time() - cpu


@dataclass(slots=True)
class Graphs:
    """``--graphs``: the step's collectives captured once, launched each step.

    While a step's collectives are captured every buffer they are given is
    kept (``capturing``), in call order; while they are replayed the same
    code runs without calling NCCL and each buffer it makes is bound to the
    captured one at its place: its contents copied in before the launch and
    the captured results copied back after the step's synchronisation."""

    stream: int
    exec_: int = 0  # the step graph's executable, 0 until captured
    buffers: list[npt.NDArray[Any]] = field(default_factory=list)
    capturing: list[npt.NDArray[Any]] | None = None
    bound: list[tuple[npt.NDArray[Any], npt.NDArray[Any]]] | None = None

    def buffer(self, array: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """The array a call of this step really gets."""
        if self.capturing is not None:
            self.capturing.append(array)
            return array
        if self.bound is None:
            return array
        if len(self.bound) >= len(self.buffers):
            raise LabError("a replayed step passed more buffers than its graph captured")
        captured = self.buffers[len(self.bound)]
        captured[...] = array
        self.bound.append((captured, array))
        return captured

    def copy_back(self) -> None:
        for captured, array in self.bound or ():
            array[...] = captured
        self.bound = None


def _comm_json(comm: Comm) -> dict[str, Any]:
    return {
        "rank": comm.rank,
        "nranks": comm.nranks,
        "id_hash": f"0x{comm.id_hash:016x}",
        "handle": f"0x{comm.handle:016x}",
    }


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _run_delay_ms() -> float:
    """Time this process's threads waited on a run queue (schedstat, ns)."""
    total = 0
    try:
        for task in Path("/proc/self/task").iterdir():
            total += int((task / "schedstat").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        pass
    return total / 1e6


def busy(ms: float) -> None:
    """Compute: burn ``ms`` of this thread's CPU time (fixed work, as a real
    kernel launch would be); under CPU contention it takes longer on the wall."""
    end = time.thread_time() + ms / 1000.0
    x = 0
    while time.thread_time() < end:
        x += 1


# --- setup ----------------------------------------------------------------


def unique_id(r: Rank) -> UniqueId:
    uid = UniqueId()
    path = r.args.run_dir / UID_FILE
    if r.rank == 0:
        r.nccl("ncclGetUniqueId", "world", ctypes.byref(uid))
        write_atomic(path, bytes(uid))
        return uid
    deadline = time.monotonic() + r.args.init_timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise LabError(f"rank 0 published no unique id in {path} within {r.args.init_timeout}s")
        time.sleep(0.01)
    return unique_id_from_bytes(path.read_bytes())


def init_comms(r: Rank) -> None:
    uid = unique_id(r)
    world = ctypes.c_void_p()
    r.nccl("ncclCommInitRank", "world", ctypes.byref(world), r.topo.world_size, uid, r.rank)
    world_hash = fold_unique_id(bytes(uid))
    r.comms["world"] = Comm("world", world.value or 0, r.rank, r.topo.world_size, world_hash)
    node, local = r.topo.node_of(r.rank), r.topo.local_rank(r.rank)
    # Split order is the same on every rank: tp first (index 0), then dp (index 1).
    _split(r, "tp", color=node, key=local, index=0, size=r.topo.ranks_per_node, my=local)
    _split(r, "dp", color=local, key=node, index=1, size=r.topo.nodes, my=node)


def _split(r: Rank, label: str, color: int, key: int, index: int, size: int, my: int) -> None:
    world = r.comms["world"]
    new = ctypes.c_void_p()
    r.nccl(
        "ncclCommSplit", label, ctypes.c_void_p(world.handle), color, key, ctypes.byref(new), None
    )
    r.comms[label] = Comm(label, new.value or 0, my, size, split_hash(world.id_hash, color, index))


def destroy_comms(r: Rank) -> None:
    for label in ("dp", "tp", "world"):
        r.nccl("ncclCommDestroy", label, ctypes.c_void_p(r.comms[label].handle))


# --- one step ---------------------------------------------------------------


def run_step(r: Rank, step: int) -> None:
    started = time.monotonic_ns()
    r.step_start_ns.append(started)
    if r.marks is not None:
        r.marks.begin(step)
    pause(r, step)
    slow_ms = r.extra_ms(F.Slow, step)
    if r.gpu is None:
        r.compute(r.args.compute_ms + slow_ms)
    else:
        device_compute(r, r.gpu, step, slow_ms)
    inject_before_collectives(r, step)
    if r.gpu is not None and r.graphs is not None:
        checks = graph_step(r, r.gpu, r.graphs, step)
    else:
        checks = step_collectives(r, step)
    if r.args.mode == "async":
        for label in ("tp", "dp", "world"):
            r.nccl("labStreamSynchronize", label, ctypes.c_void_p(r.comms[label].handle))
    if r.gpu is not None:
        # what was queued is known even if the synchronisation never returns
        r.report(STATUS_HUNG if r.device_stopped else STATUS_RUNNING, error=r.device_stopped)
        r.gpu.synchronize()
    if r.graphs is not None:
        r.graphs.copy_back()
        check_async_errors(r)
    verify(r, checks)
    r.keep.clear()
    r.step_ms.append((time.monotonic_ns() - started) / 1e6)


def step_collectives(r: Rank, step: int) -> list[Check]:
    return [*tp_collectives(r, step), *dp_collectives(r, step), *world_collectives(r, step)]


def graph_step(r: Rank, gpu: Device, g: Graphs, step: int) -> list[Check]:
    """The step as one launch: of the step graph, captured at the first step
    (and again after a step that launched another), or of a graph of its own
    for a step whose calls differ on this rank (a mismatch fault)."""
    own = r.fault(F.Mismatch, step) is not None
    if own or not g.exec_:
        checks, buffers, exec_ = capture_step(r, gpu, g, step)
        if not own:
            g.exec_, g.buffers = exec_, buffers
    else:
        g.bound, exec_ = [], g.exec_
        r.nccl.replaying = True
        try:
            checks = step_collectives(r, step)
        finally:
            r.nccl.replaying = False
    with gpu.collective("graph", "graph") as stream:
        gpu.rt.graph_launch(exec_, stream)
    if own:
        gpu.rt.graph_exec_destroy(exec_)  # its launch, queued, still runs
    return checks


def check_async_errors(r: Rank) -> None:
    """A replayed call makes no NCCL call that could fail: as a framework's
    watchdog does, ask each communicator for the error of its work."""
    for label in ("tp", "dp", "world"):
        code = ctypes.c_int()
        r.nccl("ncclCommGetAsyncError", label, _comm(r, label), ctypes.byref(code))
        if code.value != 0:
            r.nccl.failed_call = "ncclCommGetAsyncError"
            raise NcclError(
                f"a replayed call on {label}", code.value, r.nccl.api.error_string(code.value),
                r.nccl.api.last_error(),
            )  # fmt: skip


def capture_step(
    r: Rank, gpu: Device, g: Graphs, step: int
) -> tuple[list[Check], list[npt.NDArray[Any]], int]:
    g.capturing = []
    gpu.rt.begin_capture(g.stream)
    try:
        checks = step_collectives(r, step)
    finally:
        graph = gpu.rt.end_capture(g.stream)
        buffers, g.capturing = g.capturing, None
    exec_ = gpu.rt.graph_instantiate(graph)
    gpu.rt.graph_destroy(graph)
    return checks, buffers, exec_


def device_compute(r: Rank, gpu: Device, step: int, host_ms: float) -> None:
    """The step's compute, as device work (a slow fault still costs CPU)."""
    if host_ms:
        r.compute(host_ms)
    hang = r.fault(F.GpuHang, step)
    if hang is not None:
        r.fired(hang, step, time.monotonic_ns())
        r.device_stopped = f"gpuhang fault: the device stops at step {step}"
        r.report(STATUS_HUNG, error=r.device_stopped)
        gpu.stop_device()  # the host goes on queueing; nothing after this runs
        return
    gpu.compute_for(r.args.compute_ms + r.extra_ms(F.GpuSlow, step))


def pause(r: Rank, step: int) -> None:
    """A checkpoint-like phase before the step (``F.Pause``): the ranks it
    names sleep, then every rank joins a barrier (a one-element AllReduce on
    world, as ``torch.distributed.barrier`` is), where the others wait."""
    for p in r.faults:
        if not isinstance(p, F.Pause) or not F.pauses_at(p, step):
            continue
        if p.rank is None or p.rank == r.rank:
            began = time.monotonic_ns()
            PAUSE_WORK[p.work](r, p.ms / 1000.0)
            r.fired(p, step, began, time.monotonic_ns())
        barrier(r)


def _checkpoint(r: Rank, seconds: float) -> None:
    """Write and sync a file for ``seconds``, as a checkpoint does."""
    path = r.args.run_dir / f"checkpoint-{r.rank}.bin"
    block = os.urandom(CHECKPOINT_BLOCK)
    end = time.monotonic() + seconds
    with open(path, "wb") as f:
        while time.monotonic() < end:
            f.write(block)
            f.flush()
            os.fsync(f.fileno())
            if f.tell() >= CHECKPOINT_MAX:
                f.seek(0)
    path.unlink(missing_ok=True)


def _evaluate(r: Rank, seconds: float) -> None:
    """Compute for ``seconds`` with no collective, as an evaluation does."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        busy(10.0)


CHECKPOINT_BLOCK = 1 << 20
CHECKPOINT_MAX = 16 << 20  # the file is rewritten from its start past this
PAUSE_WORK = {
    "sleep": lambda _r, seconds: time.sleep(seconds),
    "io": _checkpoint,
    "cpu": _evaluate,
}


def barrier(r: Rank) -> None:
    flag = np.ones(1, np.float32)
    with on_device(r, "world") as s:
        r.nccl(
            "ncclAllReduce", "world", _buf(r, flag), _buf(r, flag), 1, F32, int(RedOp.SUM),
            _comm(r, "world"), s,
        )  # fmt: skip


@contextmanager
def on_device(r: Rank, label: str, kind: str = "coll") -> Iterator[ctypes.c_void_p | None]:
    """Yields the stream for a call on ``label`` (None outside gpu mode),
    with the events around it that a framework records."""
    if r.gpu is None:
        yield None
        return
    if r.graphs is not None:  # captured on the graph's stream (replayed: no call at all)
        yield ctypes.c_void_p(r.graphs.stream)
        return
    with r.gpu.collective(label, kind) as stream:
        yield ctypes.c_void_p(stream)


def _hangs_now(r: Rank, step: int) -> bool:
    """At its step, or (agents=ready) that many steps after the one at which
    it saw the runner's word that every agent is ready."""
    for f in r.faults:
        if not isinstance(f, F.Hang):
            continue
        if not f.agents_ready:
            if f.step == step:
                return True
            continue
        if r.agents_ready_at is None and (r.args.run_dir / AGENTS_READY_FILE).exists():
            r.agents_ready_at = step
        if r.agents_ready_at is not None and step == r.agents_ready_at + f.step:
            return True
    return False


def inject_before_collectives(r: Rank, step: int) -> None:
    if _hangs_now(r, step):
        hang = r.fault(F.Hang)
        assert hang is not None
        r.fired(hang, step, time.monotonic_ns())
        r.report(STATUS_HUNG, error=f"hang fault: blocked before the collectives of step {step}")
        threading.Event().wait()  # forever: the others block in their next collective
    crash = r.fault(F.Crash, step)
    if isinstance(crash, F.Crash):
        r.fired(crash, step, time.monotonic_ns())
        r.report("crashed", error=f"crash fault at step {step}", code=F.CRASH_EXIT_CODE)
        if crash.signal is not None:
            os.kill(os.getpid(), crash.signal)
            time.sleep(1.0)  # a signal whose default action does not kill falls through
        os._exit(F.CRASH_EXIT_CODE)


def _buf(r: Rank, array: npt.NDArray[Any]) -> ctypes.c_void_p:
    r.keep.append(array)  # async mode: the buffer must outlive the call
    if r.graphs is not None:
        array = r.graphs.buffer(array)
    return ctypes.c_void_p(_ptr(array))


def _comm(r: Rank, label: str) -> ctypes.c_void_p:
    return ctypes.c_void_p(r.comms[label].handle)


F32, F64 = int(DataType.FLOAT32), int(DataType.FLOAT64)


def tp_collectives(r: Rank, step: int) -> list[Check]:
    tp, n = r.comms["tp"], r.sizes.shard
    send = pattern(n, tp.rank + 1, step)
    gathered = np.zeros(n * tp.nranks, np.float32)
    with on_device(r, "tp") as s:
        r.nccl("ncclAllGather", "tp", _buf(r, send), _buf(r, gathered), n, F32, _comm(r, "tp"), s)
    want_g = np.concatenate([pattern(n, k + 1, step) for k in range(tp.nranks)])
    full = pattern(n * tp.nranks, tp.rank + 1, step)
    shard = np.zeros(n, np.float32)
    with on_device(r, "tp") as s:
        r.nccl(
            "ncclReduceScatter", "tp", _buf(r, full), _buf(r, shard), n, F32, int(RedOp.SUM),
            _comm(r, "tp"), s,
        )  # fmt: skip
    summed = sum(pattern(n * tp.nranks, k + 1, step) for k in range(tp.nranks))
    want_rs = np.asarray(summed, np.float32)[tp.rank * n : (tp.rank + 1) * n]
    return [Check("tp allgather", gathered, want_g), Check("tp reducescatter", shard, want_rs)]


def dp_collectives(r: Rank, step: int) -> list[Check]:
    dp, n = r.comms["dp"], r.sizes.grad
    grads = pattern(n, dp.rank + 1, step)
    with on_device(r, "dp") as s:
        r.nccl(
            "ncclAllReduce", "dp", _buf(r, grads), _buf(r, grads), n, F32, int(RedOp.SUM),
            _comm(r, "dp"), s,
        )  # fmt: skip
    want = np.asarray(sum(pattern(n, k + 1, step) for k in range(dp.nranks)), np.float32)
    checks = [Check("dp allreduce", grads, want)]
    if dp.nranks > 1:
        checks += pipeline(r, step, dp)
    return checks


def pipeline(r: Rank, step: int, dp: Comm) -> list[Check]:
    """Stage k sends activations to k+1 and receives from k-1, in one group."""
    n = r.sizes.act
    act = pattern(n, dp.rank + 1, step)
    inbox = np.zeros(n, np.float32)
    with on_device(r, "dp", "p2p") as s:
        r.nccl("ncclGroupStart", NO_COMM)
        if dp.rank + 1 < dp.nranks:
            r.nccl("ncclSend", "dp", _buf(r, act), n, F32, dp.rank + 1, _comm(r, "dp"), s)
        if dp.rank > 0:
            r.nccl("ncclRecv", "dp", _buf(r, inbox), n, F32, dp.rank - 1, _comm(r, "dp"), s)
        r.nccl("ncclGroupEnd", NO_COMM)
    if dp.rank == 0:
        return []
    return [Check("dp recv", inbox, pattern(n, dp.rank, step))]


def world_collectives(r: Rank, step: int) -> list[Check]:
    world = r.comms["world"]
    # a graph's calls keep the arguments they were captured with: one root
    root, n = (0 if r.graphs is not None else step % world.nranks), r.sizes.bcast
    data = pattern(n, root + 1, step) if world.rank == root else np.zeros(n, np.float32)
    with on_device(r, "world") as s:
        r.nccl(
            "ncclBroadcast", "world", _buf(r, data), _buf(r, data), n, F32, root,
            _comm(r, "world"), s,
        )  # fmt: skip
    checks = [Check("world broadcast", data, pattern(n, root + 1, step))]
    return [*checks, loss_allreduce(r, step, world)]


def loss_allreduce(r: Rank, step: int, world: Comm) -> Check:
    count, dtype, op = 1, F64, int(RedOp.SUM)
    mismatch = r.fault(F.Mismatch, step)
    if isinstance(mismatch, F.Mismatch):
        if not r.nccl.replaying:
            r.fired(mismatch, step, time.monotonic_ns())
        count, dtype, op = _mismatched(mismatch.field, count, dtype, op)
    loss = np.array([float(world.rank + step), 0.0], np.float64)
    with on_device(r, "world") as s:
        r.nccl(
            "ncclAllReduce", "world", _buf(r, loss), _buf(r, loss), count, dtype, op,
            _comm(r, "world"), s,
        )  # fmt: skip
    want = sum(k + step for k in range(world.nranks))
    return Check("world loss allreduce", loss[:1], np.array([want], np.float64))


def _mismatched(which: F.MismatchField, count: int, dtype: int, op: int) -> tuple[int, int, int]:
    if which is F.MismatchField.COUNT:
        return count + 1, dtype, op
    if which is F.MismatchField.DTYPE:
        return count, F32, op
    return count, dtype, int(RedOp.MAX)


def verify(r: Rank, checks: Sequence[Check]) -> None:
    for check in checks:
        if np.array_equal(check.got, check.want):
            r.ok += 1
        else:
            r.failed += 1
            bad = int(np.count_nonzero(check.got != check.want))
            print(f"rank {r.rank}: {check.what}: {bad} wrong element(s)", file=sys.stderr)


# --- main -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RankArgs:
    """One rank's settings, as ``lab.runner`` passes them on the rank's
    command line (``stallwatch.commands.labrank`` reads it)."""

    rank: int
    nodes: int
    ranks_per_node: int
    steps: int
    run_dir: Path
    lib: Path | None = None
    mode: str = "blocking"
    cudart: Path | None = None  # gpu mode: the lab's runtime (default: beside lib)
    poll_ms: float = DEFAULT_POLL_MS  # gpu mode: how often the watchdog thread polls
    graphs: bool = False  # gpu mode: the step in a CUDA graph, captured once
    fault: tuple[str, ...] = ()
    elements: int = DEFAULT_ELEMENTS
    compute_ms: float = DEFAULT_COMPUTE_MS
    cpu: int | None = None  # pin this rank to one CPU
    init_timeout: float = 60.0


def start(args: RankArgs) -> Rank:
    if args.lib is None:
        raise LabError(f"no library: pass --lib or set {LIB_ENV}")
    if args.mode == "async":
        os.environ[ASYNC_ENV] = "1"
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    topo = F.Topology(args.nodes, args.ranks_per_node)
    faults = F.for_rank(F.parse_faults(args.fault), args.rank)
    rank = Rank(args, topo, Nccl(args.lib), faults, Sizes.from_elements(args.elements))
    rank.marks = StepMark(args.run_dir, args.rank)
    if args.graphs and args.mode != "gpu":
        raise LabError("--graphs needs --mode gpu (graphs are captured on CUDA streams)")
    if args.mode == "gpu":
        cudart = args.cudart or Path(args.lib).parent / CUDART_NAME
        labels = ("tp", "dp", "world", "graph") if args.graphs else ("tp", "dp", "world")
        rank.gpu = Device.open(cudart, labels, args.poll_ms)
        if args.graphs:
            rank.graphs = Graphs(rank.gpu.streams["graph"])
    return rank


def train(r: Rank) -> int:
    late = r.fault(F.Late)
    if isinstance(late, F.Late):  # its peers wait for it in their first calls
        began = time.monotonic_ns()
        time.sleep(late.ms / 1000.0)
        r.fired(late, 0, began, time.monotonic_ns())
    init_comms(r)
    r.mark_start()
    r.report(STATUS_RUNNING)
    for step in range(r.args.steps):
        end = r.marks.end() if r.marks is not None else None
        if end is not None and step >= end:
            r.steps_total = step
            break
        run_step(r, step)
        r.steps_done = step + 1
        r.report(STATUS_RUNNING)
    if r.gpu is not None:
        r.gpu.close()
        if r.gpu.error:
            raise LabError(f"the watchdog's event query failed: {r.gpu.error}")
    destroy_comms(r)
    if r.failed:
        r.report("verify_failed", error=f"{r.failed} result check(s) failed", code=EXIT_VERIFY)
        return EXIT_VERIFY
    r.report(STATUS_DONE, code=EXIT_OK)
    return EXIT_OK


def main(args: RankArgs) -> int:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        rank = start(args)
    except StallwatchError as exc:
        print(f"lab.job rank {args.rank}: error: {exc}", file=sys.stderr)
        return EXIT_SETUP
    try:
        return train(rank)
    except LabError as exc:
        code = EXIT_NCCL if rank.nccl.failed_call else EXIT_SETUP
        rank.report("error", error=str(exc), code=code)
        print(f"lab.job rank {args.rank}: error: {exc}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(code)  # comms may be broken: no destroy, no waiting on their threads

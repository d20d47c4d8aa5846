"""Thread positions: where every thread of every NCCL process was at one moment.

A ``ThreadReading`` is what ``stallwatch snapshot`` takes, what an agent takes
at start-up and into every dump: for each process, each thread's run state as
the kernel sees it (state letter, wait channel, the system call it sleeps in
and that call's arguments), its user stack as read from outside the process,
and the NCCL API call it is inside, if any, with the arguments that could be
read from that call's frame.  Nothing here needs the process to have been
recorded: a job that hung before any agent ran is judged from these alone.

Only the variables that say which rank of which job a process is
(``JOB_ENV``) are kept from its environment; the rest (tokens, keys) never
leaves the node.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .schema import NCCL_SYMBOLS, Op, RedOp, datatype_name

# The environment variables launchers set that name a process's rank and job
# (torchrun/torchelastic, Slurm, Open MPI, PMI), and nothing else.
JOB_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "SLURM_JOB_ID",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
)
RANK_ENV = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
SIZE_ENV = ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
JOB_ID_ENV = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")

NOT_IN_SYSCALL = -1  # blocked or preempted in user code
RUNNING = -2  # on a CPU when read: no registers to read without stopping it

# x86-64 system call numbers of the calls a rank thread sleeps in, or does
# file I/O in.
SYSCALL_NAMES: dict[int, str] = {
    0: "read", 1: "write", 3: "close", 7: "poll", 16: "ioctl", 17: "pread64",
    18: "pwrite64", 19: "readv", 20: "writev", 23: "select", 26: "msync", 40: "sendfile",
    24: "sched_yield", 34: "pause", 35: "nanosleep", 42: "connect", 43: "accept",
    44: "sendto", 45: "recvfrom", 46: "sendmsg", 47: "recvmsg", 61: "wait4",
    128: "rt_sigtimedwait", 130: "rt_sigsuspend", 202: "futex", 219: "restart_syscall",
    230: "clock_nanosleep", 232: "epoll_wait", 247: "waitid", 270: "pselect6",
    271: "ppoll", 281: "epoll_pwait", 288: "accept4", 299: "recvmmsg", 307: "sendmmsg",
    426: "io_uring_enter", 441: "epoll_pwait2", 449: "futex_waitv",
    # file I/O a rank is found in while it writes a checkpoint (analyzer.detect.busy)
    74: "fsync", 75: "fdatasync", 77: "ftruncate", 208: "io_getevents", 257: "openat",
    277: "sync_file_range", 285: "fallocate", 295: "preadv", 296: "pwritev",
    326: "copy_file_range",
}  # fmt: skip


def syscall_name(nr: int) -> str:
    if nr == NOT_IN_SYSCALL:
        return ""
    if nr == RUNNING:
        return "running"
    return SYSCALL_NAMES.get(nr, f"syscall_{nr}")


class ArgsFrom(enum.Enum):
    """Where the arguments of an NCCL call were read from."""

    NONE = "none"  # not read (an API without a readable argument block)
    FRAME = "frame"  # the argument block the API function builds on its frame


@dataclass(frozen=True, slots=True)
class NcclCall:
    """The NCCL API call a thread is inside (its outermost NCCL frame)."""

    symbol: str  # as exported: "ncclAllReduce"
    lib: str  # the library file, as the process maps it
    args_from: ArgsFrom = ArgsFrom.NONE
    comm: int = 0  # ncclComm_t in that process; 0 if not read
    count: int = -1  # elements; -1 if not read
    datatype: int = -1
    redop: int = -1
    root: int = -1  # root of a rooted collective, peer of send/recv
    sendbuff: int = 0
    recvbuff: int = 0

    @property
    def op(self) -> Op:
        return NCCL_SYMBOLS.get(self.symbol, Op.UNKNOWN)

    def describe(self) -> str:
        """``ncclAllReduce(count=1024, float32, sum, comm=0x55d0...)``."""
        if self.args_from is ArgsFrom.NONE:
            return f"{self.symbol}(arguments not read)"
        parts = [f"count={self.count}", datatype_name(self.datatype)]
        if self.op in (Op.ALL_REDUCE, Op.REDUCE, Op.REDUCE_SCATTER):
            parts.append(_redop(self.redop))
        if self.op in (Op.BROADCAST, Op.REDUCE, Op.GATHER, Op.SCATTER):
            parts.append(f"root={self.root}")
        if self.op.is_p2p:
            parts.append(f"peer={self.root}")
        parts.append(f"comm=0x{self.comm:016x}")
        return f"{self.symbol}({', '.join(parts)})"


def _redop(value: int) -> str:
    try:
        return RedOp(value).name.lower()
    except ValueError:
        return f"redop_{value}"


@dataclass(frozen=True, slots=True)
class ThreadState:
    tid: int
    name: str  # the kernel's task name
    state: str  # /proc stat letter: R, S, D, T, t, Z, ...
    wchan: str  # kernel function it sleeps in, "" if running or hidden
    syscall: int  # number, NOT_IN_SYSCALL or RUNNING
    syscall_args: tuple[int, ...]  # the six argument registers (in a syscall)
    sp: int  # user stack pointer, 0 if unknown
    pc: int  # user instruction pointer, 0 if unknown
    frames: tuple[str, ...]  # "module!symbol+0xoff", innermost first
    unwind: str  # how the stack was walked ("cfi", "cfi+scanned", ...); why it stopped
    nccl: NcclCall | None = None
    python: tuple[str, ...] = ()  # bonus, from py-spy where installed: "func (file:line)"

    @property
    def syscall_name(self) -> str:
        return syscall_name(self.syscall)


@dataclass(frozen=True, slots=True)
class ProcessThreads:
    """One process's threads, read at one moment."""

    pid: int
    taken_ns: int  # CLOCK_MONOTONIC when its reading began
    took_ns: int
    env: tuple[tuple[str, str], ...]  # the JOB_ENV variables it has
    threads: tuple[ThreadState, ...]
    error: str = ""  # why it could not be read (gone, permission); threads empty

    def env_int(self, names: tuple[str, ...]) -> int | None:
        env = dict(self.env)
        for name in names:
            try:
                return int(env[name])
            except (KeyError, ValueError):
                continue
        return None

    @property
    def world_rank(self) -> int | None:
        return self.env_int(RANK_ENV)

    @property
    def world_size(self) -> int | None:
        return self.env_int(SIZE_ENV)

    def nccl_threads(self) -> tuple[ThreadState, ...]:
        return tuple(t for t in self.threads if t.nccl is not None)


@dataclass(frozen=True, slots=True)
class ThreadReading:
    """Every NCCL process of a node (or the pids asked for) at one moment."""

    taken_ns: int  # CLOCK_MONOTONIC
    took_ns: int
    reason: str  # "startup", "dump", "request"
    processes: tuple[ProcessThreads, ...]
    python_tool: str = ""  # the tool that read Python stacks, "" if none

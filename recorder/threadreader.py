"""Where every thread of the node's NCCL processes is, right now, read from
outside: no probe, no ptrace, no signal, nothing the job has to have loaded.

For each process that maps a ``libnccl.so*`` (or each pid asked for) and each
of its threads:

- the kernel's view: state letter (``/proc/PID/task/TID/stat``), wait channel
  (``wchan``), and, from ``syscall``, the system call it sleeps in with its
  six arguments and the user stack and instruction pointers saved on entry;
- its user stack, walked from those two registers through ``/proc/PID/mem``
  with each module's call frame information (``recorder.unwind``): no frame
  pointers needed;
- the NCCL API call it is inside: the outermost frame whose function is one of
  the library's exported ``nccl*`` entry points (checked against the symbol's
  bounds), and, for collectives and send/receive, the arguments read back from
  that frame: NCCL and the lab's library both copy them into one block on the
  API function's stack before calling the enqueue path (``sendbuff, recvbuff,
  count, datatype, op, root/peer, comm`` in this order); the block is used only
  when exactly one place in the frame fits it.

Reading a sleeping thread does not wake or stop it: the kernel samples its
saved registers while it stays blocked (``syscall`` says ``running`` for a
thread on a CPU or waiting for one, whose stack cannot be read without
stopping it).  Such threads are read again, over about a tenth of a second
once the whole reading is done: a waiter that wakes now and then (a poll
with a timeout) is runnable for a moment, and on a loaded machine that moment
lasts until the scheduler gets to it; only a thread still running after that
is reported as running (a spinning waiter, a thread at work).  A thread that
wakes while its stack is read is read again once.

Python-level stacks (``py-spy dump --nonblocking``) are a bonus taken only when
asked for and when py-spy is installed; they are marked as such.

Known limits: x86-64 only (register layout of ``syscall``, call frame
registers); the argument block is a convention of NCCL 2.x's ``ncclInfo`` and
the lab's op record, not an ABI, and is left unread when it does not fit.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace

from stallwatch.dumpers.readings import (
    JOB_ENV,
    NOT_IN_SYSCALL,
    RUNNING,
    ArgsFrom,
    NcclCall,
    ProcessThreads,
    ThreadReading,
    ThreadState,
)
from stallwatch.dumpers.schema import NCCL_SYMBOLS

from . import discovery
from .unwind import Frame, ModuleCache, ProcessMaps, ProcessMemory, Unwinder

RUNNING_RETRIES = 3
# after a reading, threads found running are read again after these pauses
# (about 0.13 s in all, once per reading whatever the number of processes)
RUNNING_SETTLE_S = (0.002, 0.004, 0.008, 0.016, 0.032, 0.064)
READ_RETRIES = 4
PYSPY_TIMEOUT_S = 10.0
_COLD = re.compile(r"\.(cold|part|isra|constprop)(\.\d+)*$")
ARG_BLOCK = 48  # sendbuff, recvbuff, count, datatype:4, op:4, root:4, pad:4, comm
MAX_DATATYPE = 32
MAX_REDOP = 1 << 16  # user reduction ops (ncclRedOpCreatePreMulSum) count up from 5
ARG_OPS = frozenset(op for op in NCCL_SYMBOLS.values() if op.is_collective or op.is_p2p)


@dataclass(frozen=True, slots=True)
class _Syscall:
    nr: int
    args: tuple[int, ...]
    sp: int
    pc: int


@dataclass(slots=True)
class Reader:
    """Takes snapshots; keeps parsed modules between them (an agent's libc,
    Python and libnccl are read once)."""

    cache: ModuleCache = field(default_factory=ModuleCache)
    python_stacks: bool = False
    self_pid: int = field(default_factory=os.getpid)

    def read(self, pids: Iterable[int] | None = None, reason: str = "request") -> ThreadReading:
        start = time.monotonic_ns()
        chosen = sorted(set(pids)) if pids is not None else nccl_pids(self.self_pid)
        procs = settle_running([self.process(pid) for pid in chosen], self.cache)
        tool = pyspy_version() if self.python_stacks else ""
        if tool:
            procs = tuple(_with_python(p) for p in procs)
        return ThreadReading(start, time.monotonic_ns() - start, reason, procs, tool)

    def process(self, pid: int) -> ProcessThreads:
        start = time.monotonic_ns()
        with _opened(pid, self.cache) as unwinder:
            if isinstance(unwinder, str):
                return _failed(pid, start, unwinder)
            threads = tuple(
                t for tid in _tids(pid) if (t := read_thread(pid, tid, unwinder)) is not None
            )
        took = time.monotonic_ns() - start
        return ProcessThreads(pid, start, took, job_env(pid), threads)


@contextlib.contextmanager
def _opened(pid: int, cache: ModuleCache) -> Iterator[Unwinder | str]:
    """An unwinder over the process's memory, closed after; or why it could
    not be opened."""
    maps = ProcessMaps.of(pid)
    if maps is None:
        yield "process gone or not readable (/proc/PID/maps)"
        return
    try:
        mem = ProcessMemory(pid)
    except OSError as exc:
        yield f"cannot open /proc/{pid}/mem: {exc.strerror}"
        return
    try:
        yield Unwinder(pid, maps, mem, cache)
    finally:
        mem.close()


def settle_running(
    procs: list[ProcessThreads], cache: ModuleCache, pauses: tuple[float, ...] = RUNNING_SETTLE_S
) -> tuple[ProcessThreads, ...]:
    """``procs`` with each thread that was running read again after short
    pauses, until it is seen asleep or the pauses run out (then it stays as
    read: running).  A process's span (``took_ns``) grows to its last read."""
    for pause in pauses:
        running = [i for i, p in enumerate(procs) if any(t.syscall == RUNNING for t in p.threads)]
        if not running:
            break
        time.sleep(pause)
        for i in running:
            procs[i] = _reread_running(procs[i], cache)
    return tuple(procs)


def _reread_running(p: ProcessThreads, cache: ModuleCache) -> ProcessThreads:
    with _opened(p.pid, cache) as unwinder:
        if isinstance(unwinder, str):
            return p  # gone since: what was read stands
        threads = []
        for t in p.threads:
            again = read_thread(p.pid, t.tid, unwinder) if t.syscall == RUNNING else None
            threads.append(t if again is None or again.syscall == RUNNING else again)
    return replace(p, threads=tuple(threads), took_ns=time.monotonic_ns() - p.taken_ns)


def nccl_pids(self_pid: int | None = None) -> list[int]:
    """Every process that maps a libnccl, but this one."""
    me = os.getpid() if self_pid is None else self_pid
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != me and discovery.mapped_nccl_libs(int(name)):
            out.append(int(name))
    return sorted(out)


def job_env(pid: int) -> tuple[tuple[str, str], ...]:
    """The launcher's rank and job variables from the process's environment."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return ()
    wanted = set(JOB_ENV)
    out = []
    for item in raw.split(b"\0"):
        key, _, value = item.partition(b"=")
        name = key.decode(errors="replace")
        if name in wanted:
            out.append((name, value.decode(errors="replace")))
    return tuple(sorted(out))


def _tids(pid: int) -> list[int]:
    try:
        return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return []


def _failed(pid: int, start: int, why: str) -> ProcessThreads:
    return ProcessThreads(pid, start, time.monotonic_ns() - start, (), (), why)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def _syscall(pid: int, tid: int) -> _Syscall | None:
    for _ in range(RUNNING_RETRIES):
        text = _read(f"/proc/{pid}/task/{tid}/syscall")
        if text is None:
            return None
        fields = text.split()
        if fields and fields[0] != "running":
            nums = [int(x, 0) for x in fields]
            if nums[0] == NOT_IN_SYSCALL:
                return _Syscall(NOT_IN_SYSCALL, (), nums[1], nums[2])
            return _Syscall(nums[0], tuple(nums[1:7]), nums[7], nums[8])
        os.sched_yield()
    return _Syscall(RUNNING, (), 0, 0)


@dataclass(frozen=True, slots=True)
class _Reading:
    name: str
    state: str
    wchan: str
    syscall: _Syscall
    frames: list[Frame]


def read_thread(pid: int, tid: int, unwinder: Unwinder) -> ThreadState | None:
    got = _read_still(pid, tid, unwinder)
    if got is None:
        return None
    r, still = got
    sc = r.syscall
    how = _how(r.frames, sc.nr) + ("" if still else "; it ran while read")
    return ThreadState(
        tid, r.name, r.state, r.wchan, sc.nr, sc.args, sc.sp, sc.pc,
        tuple(f.label() for f in r.frames), how, nccl_call(r.frames, unwinder),
    )  # fmt: skip


def _read_still(pid: int, tid: int, unwinder: Unwinder) -> tuple[_Reading, bool] | None:
    """The thread's state, registers and stack, read while it did not run:
    its scheduler statistics and saved registers are the same before and
    after (a thread that wakes and comes back to the same call in between
    would leave a stack read half before, half after).  Retried a few times;
    the flag says whether one reading was still."""
    task = f"/proc/{pid}/task/{tid}"
    reading: _Reading | None = None
    for _ in range(READ_RETRIES):
        before = _read(f"{task}/schedstat")
        stat = _read(f"{task}/stat")
        sc = _syscall(pid, tid)
        if stat is None or sc is None:
            return None
        wchan = _read(f"{task}/wchan") or ""
        name = stat[stat.find("(") + 1 : stat.rfind(")")]
        state = stat[stat.rfind(")") + 2 : stat.rfind(")") + 3]
        if sc.nr == RUNNING:
            return _Reading(name, state, "", sc, []), True
        unwinder.mem.pages.clear()  # what was read before it ran is stale
        frames = unwinder.walk(sc.pc, sc.sp)
        reading = _Reading(name, state, "" if wchan == "0" else wchan, sc, frames)
        if _syscall(pid, tid) == sc and _read(f"{task}/schedstat") == before:
            return reading, True
    return (reading, False) if reading is not None else None


def _how(frames: list[Frame], nr: int) -> str:
    if not frames:
        return "running: not read" if nr == RUNNING else "not read"
    hows = {f.how.split(";")[0] for f in frames[1:]}
    method = "+".join(k for k in ("cfi", "scanned", "uretprobe") if k in hows or k == "cfi")
    ended = frames[-1].how.partition("; walk ended: ")[2]
    return f"{method}; stopped: {ended}" if ended else method


# -- the NCCL call -----------------------------------------------------------


def api_name(frame: Frame) -> str | None:
    """The NCCL API function this frame is in, if it is one."""
    sym = frame.symbol
    if sym is None:
        return None
    name = _COLD.sub("", sym.name)
    if name.startswith("pnccl"):
        name = name[1:]
    if name in NCCL_SYMBOLS:
        return name
    if name.startswith("nccl") and not sym.local and discovery.NCCL_LIB.search(frame.path):
        return name
    return None


def nccl_call(frames: list[Frame], unwinder: Unwinder) -> NcclCall | None:
    """The outermost NCCL API frame, with its arguments where they can be read:
    from its own frame or an inner API frame it called (``ncclBcast`` calls
    ``ncclBroadcast``, which builds the block)."""
    api = [(f, name) for f in reversed(frames) if (name := api_name(f)) is not None]
    if not api:
        return None
    outer, name = api[0]
    call = NcclCall(name, outer.path)
    if call.op not in ARG_OPS:
        return call
    for frame, _ in api:
        args = read_arg_block(unwinder, frame.sp, frame.cfa - 8) if frame.cfa else None
        if args is not None:
            return args_call(call, args)
    return call


def args_call(call: NcclCall, args: tuple[int, int, int, int, int, int, int]) -> NcclCall:
    send, recv, count, datatype, redop, root, comm = args
    return NcclCall(call.symbol, call.lib, ArgsFrom.FRAME, comm, count, datatype, redop, root,
                    send, recv)  # fmt: skip


def read_arg_block(
    unwinder: Unwinder, lo: int, hi: int
) -> tuple[int, int, int, int, int, int, int] | None:
    """(sendbuff, recvbuff, count, datatype, op, root, comm) from the one place in
    the frame [lo, hi) that holds a plausible argument block; None if none or
    more than one does."""
    data = unwinder.mem.read(lo, hi - lo) if hi > lo else None
    if not data:
        return None
    found = []
    for off in range(0, len(data) - ARG_BLOCK + 1, 8):
        block = _arg_block(data[off : off + ARG_BLOCK], unwinder)
        if block is not None:
            found.append(block)
    return found[0] if len(found) == 1 else None


def _arg_block(b: bytes, unwinder: Unwinder) -> tuple[int, int, int, int, int, int, int] | None:
    send, recv, count = (int.from_bytes(b[i : i + 8], "little") for i in (0, 8, 16))
    datatype, redop, root = (
        int.from_bytes(b[i : i + 4], "little", signed=True) for i in (24, 28, 32)
    )
    comm = int.from_bytes(b[40:48], "little")
    if not (0 <= datatype < MAX_DATATYPE and 0 <= redop < MAX_REDOP and -1 <= root < 1 << 24):
        return None
    if count >= 1 << 48 or comm == 0 or comm & 7 or not _writable(comm, unwinder):
        return None
    if not all(p == 0 or _writable(p, unwinder) for p in (send, recv)):
        return None
    return send, recv, count, datatype, redop, root, comm


def _writable(addr: int, unwinder: Unwinder) -> bool:
    m = unwinder.maps.find(addr)
    return m is not None and m.perms.startswith("rw")


# -- Python stacks (bonus) ---------------------------------------------------


def pyspy() -> str | None:
    """py-spy on the PATH, or installed beside this Python (a virtual environment)."""
    found = shutil.which("py-spy")
    if found is None:
        beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
        found = beside if os.access(beside, os.X_OK) else None
    return found


def pyspy_version() -> str:
    exe = pyspy()
    if exe is None:
        return ""
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() or "py-spy"


def python_stacks(pid: int) -> dict[int, tuple[str, ...]]:
    """tid -> Python frames (innermost first) from ``py-spy dump --nonblocking``."""
    exe = pyspy()
    if exe is None:
        return {}
    cmd = [exe, "dump", "--pid", str(pid), "--nonblocking", "--json"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=PYSPY_TIMEOUT_S)
        doc = json.loads(out.stdout) if out.returncode == 0 else []
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError):
        return {}
    stacks: dict[int, tuple[str, ...]] = {}
    for thread in doc if isinstance(doc, list) else []:
        tid = thread.get("os_thread_id") if isinstance(thread, dict) else None
        if isinstance(tid, int):
            stacks[tid] = tuple(_py_frame(f) for f in thread.get("frames", []))
    return stacks


def _py_frame(f: object) -> str:
    if not isinstance(f, dict):
        return "?"
    where = f.get("short_filename") or f.get("filename", "?")
    return f"{f.get('name', '?')} ({where}:{f.get('line', '?')})"


def _with_python(p: ProcessThreads) -> ProcessThreads:
    if p.error:
        return p
    stacks = python_stacks(p.pid)
    threads = tuple(replace(t, python=stacks.get(t.tid, ())) for t in p.threads)
    return replace(p, threads=threads)

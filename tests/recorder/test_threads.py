"""Thread positions read from outside the process (``recorder.threadreader``).

- On a hung lab job (one node, three ranks, rank 1 blocked before the
  collectives of a step), with the lab's library built with and without frame
  pointers: every waiting rank is found inside ``ncclAllGather`` with the
  arguments it passed (count, datatype, its own communicator handle), the
  hung rank inside no NCCL call, and every stack is walked to the program's
  entry point.
- A thread on a CPU when read: one that goes back to sleep within the
  reader's pauses is read asleep, with its stack; one still running after
  them is reported running, with no stack.
- The call frame interpreter against ``readelf``'s reading of the same
  files, row by row.
- The real ``libnccl.so.2``: a thread blocked inside it (the bootstrap root
  thread ``ncclGetUniqueId`` starts) is walked through its internal frames to
  the thread's start; every API symbol resolves to its public name within its
  bounds, and every call site inside an API function has a rule to its caller.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from stallwatch.dumpers.readings import (
    RUNNING,
    ArgsFrom,
    ProcessThreads,
    ThreadReading,
    ThreadState,
)
from stallwatch.dumpers.schema import NCCL_SYMBOLS, DataType
from stallwatch.lab import build
from stallwatch.lab.job import LIB_ENV, Sizes, read_report
from stallwatch.recorder import discovery
from stallwatch.recorder.cfi import RA, RBP, RSP, FrameTable
from stallwatch.recorder.elfimage import ElfImage
from stallwatch.recorder.threadreader import Reader, api_name
from stallwatch.recorder.unwind import Frame

ELEMENTS = 4096
HUNG = 1
NRANKS = 3


@dataclass(frozen=True, slots=True)
class HungJob:
    lib: Path
    pids: dict[int, int]  # world rank -> pid
    tp_handles: dict[int, int]  # world rank -> its tp communicator handle


def _start_rank(rank: int, run_dir: Path, lib: Path) -> subprocess.Popen[bytes]:
    argv = [
        sys.executable,
        "-m",
        "stallwatch.commands.labrank",
        "--rank",
        str(rank),
        "--nodes",
        "1",
    ]
    argv += ["--ranks-per-node", str(NRANKS), "--steps", "40", "--run-dir", str(run_dir)]
    argv += ["--elements", str(ELEMENTS), "--fault", f"hang:rank={HUNG},step=2"]
    env = {**os.environ, LIB_ENV: str(lib), "RANK": str(rank), "WORLD_SIZE": str(NRANKS)}
    with (run_dir / f"rank-{rank}.log").open("w") as log:
        return subprocess.Popen(argv, cwd=run_dir, env=env, stdout=log, stderr=subprocess.STDOUT)


def _waiting(snap: ThreadReading) -> int:
    return sum(1 for p in snap.processes if p.nccl_threads())


@dataclass(slots=True)
class _Job:
    procs: list[subprocess.Popen[bytes]]
    pids: dict[int, int]
    tp_handles: dict[int, int]

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


def _hung(run_dir: Path, lib: Path) -> _Job:
    """The job, once rank HUNG hung and the others wait inside a collective."""
    procs = [_start_rank(r, run_dir, lib) for r in range(NRANKS)]
    job = _Job(procs, {r: p.pid for r, p in enumerate(procs)}, {})
    try:
        deadline = time.monotonic() + 60
        while True:
            hung = read_report(run_dir, HUNG)
            snap = Reader().read(job.pids.values())
            if hung is not None and hung.status == "hung" and _waiting(snap) == NRANKS - 1:
                break
            assert time.monotonic() < deadline, "the job did not hang as asked"
            assert all(p.poll() is None for p in procs), "a rank exited"
            time.sleep(0.2)
    except BaseException:
        job.stop()
        raise
    reports = {r: read_report(run_dir, r) for r in job.pids}
    job.tp_handles = {r: int(rep.comms["tp"]["handle"], 16) for r, rep in reports.items() if rep}
    return job


@pytest.fixture(params=[True, False], ids=["frame-pointers", "no-frame-pointers"])
def hung_job(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[HungJob]:
    lib = build.ensure_built(frame_pointers=request.param)
    job = _hung(tmp_path, lib)
    try:
        yield HungJob(lib, job.pids, job.tp_handles)
    finally:
        job.stop()


def _by_pid(snap: ThreadReading) -> dict[int, ProcessThreads]:
    return {p.pid: p for p in snap.processes}


@pytest.mark.lab
def test_waiting_ranks_are_inside_the_collective_with_their_arguments(hung_job: HungJob) -> None:
    snap = Reader().read(hung_job.pids.values())
    procs = _by_pid(snap)
    for rank, pid in hung_job.pids.items():
        proc = procs[pid]
        assert proc.error == "" and proc.world_rank == rank
        in_nccl = proc.nccl_threads()
        if rank == HUNG:
            assert in_nccl == ()
            continue
        assert len(in_nccl) == 1, f"rank {rank}: {in_nccl}"
        t = in_nccl[0]
        assert t.tid == pid and t.state == "S" and t.syscall_name == "poll" and t.wchan
        call = t.nccl
        assert call is not None and call.symbol == "ncclAllGather"
        assert call.lib == str(hung_job.lib)
        assert call.args_from is ArgsFrom.FRAME
        assert (call.count, call.datatype) == (
            Sizes.from_elements(ELEMENTS).shard,
            DataType.FLOAT32,
        )
        assert call.comm == hung_job.tp_handles[rank] and call.root == -1
        assert call.sendbuff and call.recvbuff and call.sendbuff != call.recvbuff
        assert any(f.startswith("libnccl.so.2!ncclAllGather+") for f in t.frames)


@pytest.mark.lab
def test_every_stack_is_walked_to_the_entry_point(hung_job: HungJob) -> None:
    """Without frame pointers every frame follows from call frame information;
    with them, the lab's code needs rbp, which no inner frame saved: one frame
    is found by its return address and the walk goes on from there."""
    fp = hung_job.lib == build.library_path(frame_pointers=True)
    snap = Reader().read(hung_job.pids.values())
    for proc in snap.processes:
        main = next(t for t in proc.threads if t.tid == proc.pid)
        assert main.frames[-1].startswith("python3") and "!_start+" in main.frames[-1], main
        assert "stopped" not in main.unwind, main.unwind
        # any agent on this machine may hide callers behind its uretprobes (the
        # walk then resumes by scanning: test_calls_the_agent_records_...)
        if main.nccl is not None and "uretprobe" not in main.unwind:
            assert main.unwind == ("cfi+scanned" if fp else "cfi")
        others = [t for t in proc.threads if t.tid != proc.pid]
        for t in others:  # the BLAS pool's threads: walked to the thread start in libc
            assert t.frames and t.frames[-1].startswith("libc.so") and "stopped" not in t.unwind


@pytest.mark.lab
def test_reading_stops_no_thread(hung_job: HungJob) -> None:
    """The kernel samples a sleeping thread's registers; nothing attaches."""
    reader = Reader()
    for _ in range(20):
        reader.read(hung_job.pids.values())
    for pid in hung_job.pids.values():
        status = Path(f"/proc/{pid}/status").read_text()
        assert re.search(r"^TracerPid:\s+0$", status, re.M)
        assert re.search(r"^State:\s+[RS] ", status, re.M)  # never T (stopped) nor t (traced)


@contextmanager
def _spinning_then_asleep(spin_s: float) -> Iterator[int]:
    """A process that says so when it starts spinning, spins ``spin_s`` on
    the clock, then sleeps in read(2) on its stdin; its pid."""
    code = textwrap.dedent(f"""
        import os, time
        os.write(1, b"x")
        end = time.monotonic() + {spin_s}
        while time.monotonic() < end:
            pass
        os.read(0, 1)
    """)
    argv = [sys.executable, "-c", code]
    with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE) as child:
        try:
            assert child.stdout is not None and child.stdout.read(1) == b"x"
            yield child.pid
        finally:
            child.kill()


def _main_thread(reading: ThreadReading, pid: int) -> ThreadState:
    (proc,) = reading.processes
    return next(t for t in proc.threads if t.tid == pid)


@pytest.mark.parametrize("spin_s", [0.03, 0.06])
def test_a_thread_that_ran_for_a_moment_is_read_once_it_sleeps(spin_s: float) -> None:
    """Read while it spins (as a waiter that woke from a timed poll, or one a
    loaded machine has not scheduled yet): read again until it sleeps."""
    with _spinning_then_asleep(spin_s) as pid:
        t = _main_thread(Reader().read([pid]), pid)
    assert (t.state, t.syscall_name) == ("S", "read"), t
    assert t.frames and t.frames[0].startswith("libc.so.6"), t.frames


def test_a_thread_still_running_after_the_pauses_is_reported_running() -> None:
    with _spinning_then_asleep(5.0) as pid:
        started = time.monotonic()
        t = _main_thread(Reader().read([pid]), pid)
        assert time.monotonic() - started < 5.0, "the spin ended before the reading did"
    assert (t.state, t.syscall, t.frames) == ("R", RUNNING, ()), t


@pytest.mark.lab
@pytest.mark.bpf
def test_calls_the_agent_records_are_read_through_its_uretprobes(tmp_path: Path) -> None:
    """With the agent attached, every NCCL call returns through the kernel's
    uretprobe trampoline: the API frame's return address on the stack is the
    trampoline's.  The walk steps over the hidden caller and goes on."""
    from stallwatch.recorder.agent import Agent, AgentConfig
    from stallwatch.recorder.source import BccSource

    lib = build.ensure_built(frame_pointers=False)
    agent = Agent(AgentConfig(dump_dir=tmp_path / "dumps"), BccSource(1024, 1_000_000))
    try:
        agent.attach_library(str(lib), required=True)
        job = _hung(tmp_path, lib)
        try:
            snap = Reader().read(job.pids.values())
        finally:
            job.stop()
    finally:
        agent.close()
    waiting = [t for p in snap.processes for t in p.nccl_threads()]
    assert len(waiting) == NRANKS - 1
    for t in waiting:
        assert "[uprobes: caller hidden by a uretprobe]" in t.frames, t.frames
        assert t.unwind == "cfi+scanned+uretprobe", t.unwind
        assert t.frames[-1].startswith("python3") and "!_start+" in t.frames[-1], t.frames
        assert t.nccl is not None and t.nccl.count == Sizes.from_elements(ELEMENTS).shard


# -- call frame information against readelf --------------------------------

_ROW = re.compile(r"^([0-9a-f]{16}) (\S+)\s+(.*)$")


def _readelf_rows(path: Path, limit: int) -> list[tuple[int, str, dict[str, str]]]:
    """(address, CFA, {register: rule}) rows of ``readelf --debug-dump=frames-interp``."""
    out = subprocess.run(
        ["readelf", "-W", "--debug-dump=frames-interp", str(path)],
        capture_output=True, text=True, check=False,  # libc: 1 for a missing debuglink
    ).stdout  # fmt: skip
    rows: list[tuple[int, str, dict[str, str]]] = []
    header: list[str] = []
    in_fde = False
    for line in out.splitlines():
        if " CIE" in line or " FDE " in line:
            in_fde = " FDE " in line
        elif line.strip().startswith("LOC"):
            header = line.split()[2:]
            continue
        m = _ROW.match(line)
        if m and header and in_fde:
            cells = re.findall(r"\S+(?: \(\S+\))?", m.group(3))  # "r9 (r9)" is one cell
            rules = dict(zip(header, cells, strict=True))
            rows.append((int(m.group(1), 16), m.group(2), rules))
            if len(rows) >= limit:
                break
    return rows


_DWARF = {"rbx": 3, "rbp": RBP, "r12": 12, "r13": 13, "r14": 14, "r15": 15, "ra": RA}
_REGS = {
    name: i
    for i, name in enumerate(
        ("rax", "rdx", "rcx", "rbx", "rsi", "rdi", "rbp", "rsp", *(f"r{n}" for n in range(8, 16)))
    )
}


def _libc() -> Path:
    maps = Path("/proc/self/maps").read_text()
    return Path(next(m for m in re.findall(r"(/\S+/libc\.so\.6)$", maps, re.M)))


def _check_against_readelf(path: Path, limit: int) -> int:
    table = FrameTable(ElfImage(str(path)))
    checked = 0
    for loc, cfa, regs in _readelf_rows(path, limit):
        rule = table.rule(loc)
        assert rule is not None, f"{path}: no rule at {loc:#x}"
        if cfa == "exp":
            assert rule.cfa_reg == -1
        else:
            reg, off = re.fullmatch(r"(\w+)\+(\d+)", cfa).groups()  # type: ignore[union-attr]
            assert (rule.cfa_reg, rule.cfa_offset) == (_REGS[reg], int(off)), f"{loc:#x}"
        for name, want in regs.items():
            if name in _DWARF and want.startswith("c"):
                got = rule.regs.get(_DWARF[name])
                assert got is not None and got.kind == "offset", f"{loc:#x} {name}"
                assert got.value == int(want[1:]), f"{loc:#x} {name}: {got} vs {want}"
        checked += 1
    return checked


@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs readelf (binutils)")
@pytest.mark.parametrize("frame_pointers", [True, False])
def test_call_frame_rules_agree_with_readelf_on_the_lab_library(frame_pointers: bool) -> None:
    assert _check_against_readelf(build.ensure_built(frame_pointers), 100_000) > 300


@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs readelf (binutils)")
def test_call_frame_rules_agree_with_readelf_on_libc() -> None:
    assert _check_against_readelf(_libc(), 20_000) == 20_000


# -- the real libnccl.so.2 -----------------------------------------------


ROOT_THREAD = """
import ctypes, sys, time
nccl = ctypes.CDLL(sys.argv[1])
uid = ctypes.create_string_buffer(128)
print(nccl.ncclGetUniqueId(uid), flush=True)
time.sleep(120)
"""


@pytest.mark.realnccl
def test_a_thread_blocked_in_real_libnccl_is_walked_to_its_start(real_libnccl: Path) -> None:
    lib = real_libnccl
    env = {**os.environ, "NCCL_SOCKET_IFNAME": "lo"}
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(ROOT_THREAD), str(lib)],
        stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "0"
        deadline = time.monotonic() + 20
        while True:
            snap = Reader().read([proc.pid])
            inside = [
                t for t in snap.processes[0].threads
                if any(f.startswith("libnccl.so.2!") for f in t.frames)
            ]  # fmt: skip
            if inside or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        proc.kill()
        proc.communicate()
    assert len(inside) == 1, snap
    t = inside[0]
    assert t.syscall_name in ("accept", "accept4", "poll", "ppoll") and t.state == "S"
    assert "stopped" not in t.unwind, (t.unwind, t.frames)
    assert any("bootstrapRoot" in f for f in t.frames), t.frames
    assert t.frames[-1].startswith("libc.so")  # the thread's start (clone3)
    assert t.nccl is None  # NCCL's own thread, not inside an API call


def _direct_calls(image: ElfImage, start: int, size: int) -> list[int]:
    """Return addresses of the ``call rel32`` inside [start, start+size) whose
    target is the start of a function symbol or a PLT stub (``ncclBcast`` calls
    ``ncclBroadcast`` through the PLT); a byte pattern that lands on one by
    chance is rare enough not to matter."""
    code = image.code(start, size)
    out = []
    for i in range(len(code) - 4):
        if code[i] != 0xE8:
            continue
        ret = start + i + 5
        target = ret + int.from_bytes(code[i + 1 : i + 5], "little", signed=True)
        sym = image.symbol(target)
        if (sym is not None and sym.start == target) or image.in_plt(target):
            out.append(ret)
    return out


@pytest.mark.realnccl
def test_real_libnccl_api_symbols_and_call_sites(real_libnccl: Path) -> None:
    lib = real_libnccl
    image = ElfImage(str(lib))
    table = FrameTable(image)
    exported = discovery.elf_functions(str(lib), NCCL_SYMBOLS)  # another reader of the table
    for name, fn in exported.items():
        start = image.vaddr_of_offset(fn.file_offset)
        assert start is not None
        sym = image.symbol(start)
        assert sym is not None and sym.start == start
        assert sym.name == name and sym.size > 0, sym  # not the pnccl* twin
        calls = _direct_calls(image, sym.start, sym.size)
        assert calls, f"{name}: no call inside it, so no return address could point into it"
        for ret in calls:
            frame = Frame(ret, 0, 0, str(lib), ret, image.symbol(ret - 1), "cfi")
            assert api_name(frame) == name
            rule = table.rule(ret - 1)
            assert rule is not None and rule.fn_start == sym.start
            assert rule.cfa_reg in (RSP, RBP) and rule.regs[RA].value == -8
    assert len(exported) >= 15

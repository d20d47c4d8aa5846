"""Thread positions (``stallwatch snapshot``): what a snapshot of a node costs,
and that it pauses no rank.

- Time of one snapshot of a node with 8 ranks: a 1-node, 8-rank lab job that
  hung (rank 3 blocked before a collective, the other seven inside NCCL
  collectives); every thread of the 8 processes is read and its stack walked.
  A fresh reader parses every module's symbols and call frame tables (the
  command, once); an agent's reader has them cached.  Apart: finding the
  processes that map libnccl, the /proc scan the command does without
  ``--pid`` (an agent knows them already); it grows with the number of
  processes on the machine, given beside it.  Medians over repeats.
- Pauses: 8 processes that map libnccl, pinned to one CPU, each sleep 1 ms
  at a time and measure how late they wake; the reader runs on the other CPU,
  so that its own CPU time is not mistaken for a pause.  Windows of 0.5 s
  rotate between: snapshots back to back; the same snapshots with each
  process stopped (SIGSTOP) while it is read, as a ptrace-based stack dumper
  does (the control: the measure must see that); the reader spinning instead;
  idle.  The figure is the median over windows of the 99th percentile of
  every wake-up's lateness, snapshots against spinning, in the same run.
- Waiters read running: 8 processes wait as the lab's blocked ranks do (in
  poll(2) with a 200 ms timeout, a moment's work between polls), sharing one
  CPU with 12 busy loops; the reader runs on the other CPU.  Each round reads
  them twice in a row: one pass (each thread read once, as before running
  threads were read again) and a reading as taken (threads found running read
  again over about 0.13 s).  The figure is how many of the waiters' readings
  said "running" (a position that cannot be told), side by side.

``python -m bench.bench_snapshot [--quick]`` prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.common import Figure, render
from stallwatch.dumpers.readings import RUNNING, ProcessThreads
from stallwatch.lab import build
from stallwatch.lab.job import LIB_ENV, read_report
from stallwatch.recorder.threadreader import Reader, nccl_pids

RANKS = 8
HUNG = 3
SNAPSHOT_TARGET_S = 0.1
WINDOW_S = 0.5

SLEEPER = """
import ctypes, json, os, sys, time
ctypes.CDLL(sys.argv[1])  # maps libnccl: the snapshot reads this process
t0, windows, n = float(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
if sys.argv[5] != "-":
    os.sched_setaffinity(0, {int(sys.argv[5])})
late = [[] for _ in range(windows)]
while True:
    before = time.monotonic()
    w = int((before - t0) / n)
    if w >= windows:
        break
    time.sleep(0.001)
    if w >= 0:
        late[w].append(round((time.monotonic() - before - 0.001) * 1000, 3))
print(json.dumps(late))
"""

WAITER = """
import os, select, sys
if sys.argv[1] != "-":
    os.sched_setaffinity(0, {int(sys.argv[1])})
p = select.poll()
r, w = os.pipe()
p.register(r, select.POLLIN)
while True:
    p.poll(200)
    sum(range(2000))
"""
HOG = """
import os, sys
if sys.argv[1] != "-":
    os.sched_setaffinity(0, {int(sys.argv[1])})
while True:
    pass
"""
HOGS = 12


@contextmanager
def hung_job(lib: Path, run_dir: Path) -> Iterator[list[int]]:
    """A 1x8 lab job with rank HUNG hung and the others inside collectives."""
    env = {**os.environ, LIB_ENV: str(lib)}
    procs = []
    for rank in range(RANKS):
        argv = [
            sys.executable,
            "-m",
            "stallwatch.commands.labrank",
            "--rank",
            str(rank),
            "--nodes",
            "1",
        ]
        argv += ["--ranks-per-node", str(RANKS), "--steps", "50", "--run-dir", str(run_dir)]
        argv += ["--elements", "4096", "--fault", f"hang:rank={HUNG},step=2"]
        out = subprocess.DEVNULL  # the ranks' complaints when the job is torn down
        procs.append(subprocess.Popen(argv, env=env, cwd=run_dir, stdout=out, stderr=out))
    try:
        pids = [p.pid for p in procs]
        _wait_hung(run_dir, pids)
        yield pids
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _wait_hung(run_dir: Path, pids: list[int]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        report = read_report(run_dir, HUNG)
        snap = Reader().read(pids)
        waiting = sum(1 for p in snap.processes if p.nccl_threads())
        if report is not None and report.status == "hung" and waiting == RANKS - 1:
            return
        time.sleep(0.2)
    raise RuntimeError("the bench's lab job did not hang as asked")


def snapshot_times(pids: list[int], repeats: int) -> tuple[float, float, float, int]:
    """Median seconds of: a snapshot of the 8 ranks by a fresh reader (every
    module parsed, as ``stallwatch snapshot --pid`` runs), the same by a warm
    one (an agent's), and finding the NCCL processes (the /proc scan the
    command does without --pid); and how many processes that scan looked at."""
    cold, warm, scan = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        found = nccl_pids()
        scan.append(time.perf_counter() - t0)
        assert set(found) >= set(pids)
        t0 = time.perf_counter()
        reader = Reader()
        snap = reader.read(pids)
        cold.append(time.perf_counter() - t0)
        assert len(snap.processes) == RANKS
        t0 = time.perf_counter()
        reader.read(pids)
        warm.append(time.perf_counter() - t0)
    procs = sum(1 for name in os.listdir("/proc") if name.isdigit())
    return statistics.median(cold), statistics.median(warm), statistics.median(scan), procs


PHASES = ("snapshots", "stopped while read", "spinning", "idle")


def lateness(lib: Path, rounds: int) -> tuple[dict[str, float], int]:
    """Per phase, the median over its windows of the 99th percentile of the
    8 sleepers' wake-up lateness (ms); and the snapshots taken."""
    windows = len(PHASES) * rounds
    t0 = time.monotonic() + 2.0  # the sleepers start before the first window
    code = textwrap.dedent(SLEEPER)
    cpus = sorted(os.sched_getaffinity(0))
    pinned = len(cpus) >= 2
    args = [str(lib), f"{t0:.6f}", str(windows), str(WINDOW_S), str(cpus[0]) if pinned else "-"]
    procs = [
        subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True)
        for _ in range(RANKS)
    ]
    pids = [p.pid for p in procs]
    reader = Reader()
    taken = 0
    if pinned:
        os.sched_setaffinity(0, {cpus[1]})
    try:
        taken = _rotate(reader, pids, t0, windows)
    finally:
        os.sched_setaffinity(0, cpus)
    late = [json.loads(p.communicate()[0]) for p in procs]
    p99 = [_p99([x for rank in late for x in rank[w]]) for w in range(windows)]
    k = len(PHASES)
    return {name: statistics.median(p99[i::k]) for i, name in enumerate(PHASES)}, taken


def _p99(values: list[float]) -> float:
    values.sort()
    return values[int(len(values) * 0.99)] if values else 0.0


def _rotate(reader: Reader, pids: list[int], t0: float, windows: int) -> int:
    taken = 0
    while (now := time.monotonic()) < t0 + windows * WINDOW_S:
        phase = PHASES[int((now - t0) / WINDOW_S) % len(PHASES)] if now >= t0 else "idle"
        if phase == "snapshots":
            reader.read(pids)
            taken += 1
        elif phase == "stopped while read":
            for pid in pids:
                _read_stopped(reader, pid)
        elif phase == "spinning":
            _spin(0.01)
        else:
            time.sleep(0.01)
    return taken


def waiters_read_running(rounds: int) -> tuple[int, int, int]:
    """Of the waiters' main threads read in ``rounds`` rounds: how many one
    pass found running, how many a reading as taken did, and how many reads
    each way."""
    cpus = sorted(os.sched_getaffinity(0))
    pinned = len(cpus) >= 2
    cpu = str(cpus[0]) if pinned else "-"
    waiters = [subprocess.Popen([sys.executable, "-c", WAITER, cpu]) for _ in range(RANKS)]
    hogs = [subprocess.Popen([sys.executable, "-c", HOG, cpu]) for _ in range(HOGS)]
    pids = [w.pid for w in waiters]
    reader = Reader()
    one = settled = 0
    if pinned:
        os.sched_setaffinity(0, {cpus[1]})
    try:
        time.sleep(1.0)  # every waiter in its loop
        for _ in range(rounds):
            once = [reader.process(pid) for pid in pids]
            taken = reader.read(pids).processes
            one += sum(_main_running(p) for p in once)
            settled += sum(_main_running(p) for p in taken)
            time.sleep(0.05)
    finally:
        os.sched_setaffinity(0, cpus)
        for proc in waiters + hogs:
            proc.kill()
            proc.wait()
    return one, settled, rounds * RANKS


def _main_running(p: ProcessThreads) -> bool:
    return any(t.tid == p.pid and t.syscall == RUNNING for t in p.threads)


def _read_stopped(reader: Reader, pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)
    try:
        reader.process(pid)
    finally:
        os.kill(pid, signal.SIGCONT)


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def figures(quick: bool) -> list[Figure]:
    lib = build.ensure_built()
    with (
        tempfile.TemporaryDirectory(prefix="sw-bench-snap-") as tmp,
        hung_job(lib, Path(tmp)) as pids,
    ):
        cold, warm, scan, procs = snapshot_times(pids, 3 if quick else 9)
    p99, taken = lateness(lib, 3 if quick else 10)
    one, settled, reads = waiters_read_running(60 if quick else 300)
    snap, spin = p99["snapshots"], p99["spinning"]
    anchor = ", ".join(f"{name} {v:.2f} ms" for name, v in p99.items() if name != "snapshots")
    anchor += f" ({taken} snapshots)"
    return [
        Figure(
            "snapshot of 8 ranks (fresh reader)", cold * 1000, "ms", "< 100 ms",
            cold < SNAPSHOT_TARGET_S, "every module parsed, as the command with --pid",
        ),
        Figure(
            "snapshot of 8 ranks (agent's reader)", warm * 1000, "ms", "", None,
            f"fresh {cold * 1000:.1f} ms",
        ),
        Figure(
            "finding the NCCL processes (/proc scan)", scan * 1000, "ms", "", None,
            f"{procs} processes on this machine",
        ),
        Figure(
            "rank wake-up lateness p99, snapshots running", snap, "ms", "<= spinning + 0.5 ms",
            snap <= spin + 0.5, anchor,
        ),
        Figure(
            f"waiters read running, {HOGS} busy loops on their CPU", settled, "reads",
            "<= one pass / 10", settled * 10 <= one,
            f"one pass {one} of {reads} reads; reading as taken {settled} of {reads}",
        ),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_snapshot", description=__doc__)
    parser.add_argument("--quick", action="store_true")
    figs = figures(parser.parse_args(argv).quick)
    print(render(figs))
    return 0 if all(f.ok is not False for f in figs) else 1


if __name__ == "__main__":
    sys.exit(main())

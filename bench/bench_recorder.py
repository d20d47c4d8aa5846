"""The recorder's cost, measured side by side in one run.

- Cost of an NCCL call with the agent's probes attached, as a ratio to the
  same call under a bare uprobe+uretprobe pair that does nothing (the floor
  any uprobe-based recorder pays).  Calls are made from a C loop
  (``bench/csrc/ncclloop.c``) on a small NCCL-ABI library whose entry points
  begin with ``push``, so Python does not dominate.  Measured with the NCCL
  probes alone, before the CUDA runtime's are attached.
- Where those nanoseconds go: the agent's entry and return programs as the
  kernel times them (``bpf_enable_stats``), and each piece they are made of
  (``bench/csrc/components.c``) timed alone on the same call.
- Cost of the CUDA event probes per collective: a C loop doing per
  collective what PyTorch does (record a start event, the AllReduce on a
  stream, record an end event, query both) on the lab's CUDA runtime, with
  the NCCL probe alone and then with the runtime's probes too; the
  difference beside the bare uprobe pair of the same run.
- Cost of a ``cudaGraphLaunch`` of a graph that captured 6 AllReduce calls
  (a training step's collectives), with the agent's probes attached (the
  launch row and the 6 replayed rows, written in the kernel at the launch's
  return), as a ratio to the same launch under a bare uprobe+uretprobe pair
  on ``cudaGraphLaunch``; the runtime is a private copy of the lab's, the
  loop a C one (``ncclloop graphs``).
- Throughput into the rings: calls from two C loops at full speed, every one
  a row the BPF programs write straight into the mmapped ring; and loss at
  100,000 calls per second into a ring large enough for them.
- Agent CPU: ``stallwatch record`` as a separate process while a C loop makes
  1,000 NCCL calls per second and a socket churn makes about 10,000 TCP state
  events per second.
- Idle cost: the agent with no NCCL job, on this machine as it is, and on a
  loaded machine: busy loops on every CPU, a few hundred more processes, and
  a process started (exec'd) 20 times a second.  The agent runs in a network
  namespace of its own with ``--scope netns``, so that NCCL jobs of other
  tenants of a shared machine are not its work (it excludes them); what a
  /proc scan every 250 ms (its discovery before kernel events) costs on the
  same machine is measured beside it.  The figure is the median of 5
  windows, each timed in ns from every agent thread's schedstat.

``python -m bench.bench_recorder [--quick]`` prints the table (root needed).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench.common import Figure, render
from bench.fakenccl import CSRC, FakeNccl, build, build_private

PACE_RATE = 100_000
COLLECTIVES_PER_S = 1_000
TCP_EVENTS_PER_S = 10_000


def _loop_ns(fake: FakeNccl, calls: int, what: str) -> float:
    out = subprocess.run(
        [str(fake.loop), "loop", str(calls), what], check=True, capture_output=True, text=True
    )
    return float(out.stdout.split()[-1])


def _median_pair(fake: FakeNccl, calls: int, repeats: int) -> tuple[float, float]:
    """Median ns per call: (bare probes on benchBaseline, agent on ncclAllReduce),
    interleaved so that noise hits both alike."""
    base, agent = [], []
    for _ in range(repeats):
        base.append(_loop_ns(fake, calls, "baseline"))
        agent.append(_loop_ns(fake, calls, "allreduce"))
    return statistics.median(base), statistics.median(agent)


@contextlib.contextmanager
def _agent(fake: FakeNccl, ring_size: int) -> Iterator[Any]:
    from stallwatch.recorder.agent import Agent, AgentConfig
    from stallwatch.recorder.source import BccSource

    with tempfile.TemporaryDirectory() as tmp:
        agent = Agent(AgentConfig(dump_dir=Path(tmp)), BccSource(ring_size, 1_000_000))
        try:
            # Only the symbol the loops call: detaching a uprobe takes ~0.1 s.
            agent.source.attach(str(fake.lib), "ncclAllReduce")
            yield agent
        finally:
            agent.close()


def _events_ns(fake: FakeNccl, calls: int, repeats: int, cudart: Path) -> float:
    runs = []
    for _ in range(repeats):
        out = subprocess.run(
            [str(fake.loop), "events", str(calls), str(cudart)],
            check=True,
            capture_output=True,
            text=True,
        )
        runs.append(float(out.stdout.split()[-1]))
    return statistics.median(runs)


def event_cost(
    fake: FakeNccl, quick: bool, agent: Any, bare_ns: float, unprobed: float
) -> list[Figure]:
    """Per collective: the runtime's probes (2 records, 2 queries: 2 uprobes and
    2 uprobe+uretprobe pairs) against one bare uprobe+uretprobe pair."""
    from stallwatch.lab.build import ensure_cudart

    cudart = ensure_cudart()
    calls, repeats = (5_000, 3) if quick else (50_000, 7)
    without = _events_ns(fake, calls, repeats, cudart)
    for symbol in ("cudaEventRecord", "cudaEventQuery"):
        agent.source.attach(str(cudart), symbol)
    with_probes = _events_ns(fake, calls, repeats, cudart)
    extra = with_probes - without
    pair = bare_ns - unprobed
    anchor = (
        f"PyTorch's pattern per collective: {without:,.0f} ns with the NCCL probe only, "
        f"{with_probes:,.0f} ns with the runtime's too; bare uprobe pair {pair:,.0f} ns"
    )
    return [
        Figure("CUDA event probes per collective", extra, "ns", "", None, anchor),
        Figure("event probes vs bare uprobe pair", extra / pair, "x", "", None, anchor),
    ]


GRAPH_CALLS = 6  # the collectives one launch replays
GRAPH_SYMBOLS = ("cudaStreamBeginCapture", "cudaStreamEndCapture", "cudaGraphInstantiate",
                 "cudaGraphLaunch")  # fmt: skip


def _launch_ns(fake: FakeNccl, calls: int, cudart: Path) -> float:
    out = subprocess.run(
        [str(fake.loop), "graphs", str(calls), str(GRAPH_CALLS), str(cudart)],
        check=True,
        capture_output=True,
        text=True,
    )
    return float(out.stdout.split()[-1])


def graph_launch_cost(fake: FakeNccl, quick: bool, agent: Any, private: Path) -> list[Figure]:
    """Per cudaGraphLaunch: the agent's probes against a bare uprobe pair on
    the same symbol, unprobed runs and bare runs interleaved, then the agent's."""
    from stallwatch.lab.build import ensure_cudart
    from stallwatch.recorder.bareprobe import BareProbe

    cudart = private / "libcudart.so.12"
    shutil.copyfile(ensure_cudart(), cudart)  # no other agent on the machine probes it
    calls, repeats = (5_000, 3) if quick else (50_000, 7)
    unprobed, bare = [], []
    for _ in range(repeats):
        unprobed.append(_launch_ns(fake, calls, cudart))
        probe = BareProbe(str(cudart), "cudaGraphLaunch", CSRC / "noop.c")
        try:
            bare.append(_launch_ns(fake, calls, cudart))
        finally:
            probe.close()
    for symbol in GRAPH_SYMBOLS:
        agent.source.attach(str(cudart), symbol)
    rec = statistics.median(_launch_ns(fake, calls, cudart) for _ in range(repeats))
    base, none = statistics.median(bare), statistics.median(unprobed)
    anchor = (
        f"a launch replaying {GRAPH_CALLS} captured AllReduce calls: bare uprobe+uretprobe "
        f"{base:,.0f} ns, no probe {none:,.0f} ns; the agent writes {GRAPH_CALLS + 1} rows"
    )
    return [
        Figure("cudaGraphLaunch, agent attached", rec, "ns", "", None, anchor),
        Figure("graph launch cost vs bare uprobe pair", rec / base, "x", "", None, anchor),
        Figure("per replayed call above the pair", (rec - base) / GRAPH_CALLS, "ns", "", None),
    ]


def call_cost(fake: FakeNccl, quick: bool, unprobed: float, method: str) -> list[Figure]:
    calls, repeats = (20_000, 3) if quick else (200_000, 7)
    base, rec = _median_pair(fake, calls, repeats)
    ratio = rec / base
    anchor = (
        f"bare uprobe+uretprobe ({method}) {base:,.0f} ns, no probe {unprobed:,.0f} ns; "
        "the calling thread's CPU time per call"
    )
    return [
        Figure("NCCL call, agent attached", rec, "ns", "", None, anchor),
        Figure("NCCL call cost vs bare uprobe pair", ratio, "x", "<= 1.3x", ratio <= 1.3, anchor),
    ]


# What each piece of the agent's programs is for, and why it stays.
PIECES = {
    "piece_ids": "pid/tid (the process filter, the row, the thread's slot)",
    "piece_clock": "a timestamp (entry; return: the call's duration)",
    "piece_stack_arg": "the stream, NCCL's 7th argument, read from the caller's stack",
    "piece_comm_lookup": "the communicator's state by (pid, ncclComm_t), at its home slot: its seq",
    "piece_thread_slot": "the thread's in-flight slot (pairs the return with its entry)",
    "piece_ring_row": "the ring row (claimed with an atomic add, 144 bytes)",
}
# How often each piece runs in the entry and return programs of an AllReduce.
ENTRY_PIECES = {
    "piece_ids": 1,
    "piece_clock": 1,
    "piece_stack_arg": 1,
    "piece_comm_lookup": 1,
    "piece_thread_slot": 1,
    "piece_ring_row": 1,
}
RETURN_PIECES = {"piece_ids": 1, "piece_clock": 1, "piece_thread_slot": 1}


def _prog_ns(prog_fd: int, run: Callable[[], object]) -> float:
    from stallwatch.recorder import bpfsys

    before = bpfsys.prog_info(prog_fd)
    run()
    after = bpfsys.prog_info(prog_fd)
    return (after.run_time_ns - before.run_time_ns) / max(1, after.run_cnt - before.run_cnt)


def _piece_costs(fake: FakeNccl, calls: int, repeats: int) -> tuple[float, dict[str, float]]:
    """ns of a program that does nothing, as the kernel times programs, and
    of each piece alone over it (the kernel's timing is in both: it cancels)."""
    import bcc

    from stallwatch.recorder import bpfsys, discovery
    from stallwatch.recorder.uprobes import close_links

    offset = discovery.elf_functions(str(fake.lib), ["benchBaseline"])["benchBaseline"]
    module = bcc.BPF(src_file=str(CSRC / "components.c").encode())
    times: dict[str, list[float]] = {}
    try:
        for _ in range(repeats):
            for name in ("piece_nothing", *PIECES):
                prog = module.load_func(
                    name.encode(), bcc.BPF.KPROBE, attach_type=bpfsys.BPF_TRACE_UPROBE_MULTI
                )
                link = bpfsys.uprobe_multi_link(
                    prog.fd, str(fake.lib), [offset.file_offset], [0], False
                )
                try:
                    ns = _prog_ns(prog.fd, lambda: _loop_ns(fake, calls, "baseline"))
                finally:
                    close_links([link])
                times.setdefault(name, []).append(ns)
    finally:
        module.cleanup()
    nothing = statistics.median(times.pop("piece_nothing"))
    return nothing, {name: statistics.median(t) - nothing for name, t in times.items()}


def call_account(fake: FakeNccl, quick: bool, agent: Any, extra_ns: float) -> list[Figure]:
    """Where the agent's per-call nanoseconds go: its two programs as the
    kernel times them, and the pieces they are made of, each timed alone;
    both programs together beside ``extra_ns``, what the call costs above
    the bare uprobe pair (the same uprobe and uretprobe entries and exits:
    what is left is program work)."""
    from stallwatch.recorder import bpfsys

    calls, repeats = (20_000, 2) if quick else (200_000, 3)
    stats = bpfsys.enable_stats()
    try:
        progs = agent.source.probes.uprobes.progs
        noop, pieces_ns = _piece_costs(fake, calls, repeats)
        entry = statistics.median(
            _prog_ns(progs["handle_enter_all_reduce"], lambda: _loop_ns(fake, calls, "allreduce"))
            for _ in range(repeats)
        )
        ret = statistics.median(
            _prog_ns(progs["handle_nccl_return"], lambda: _loop_ns(fake, calls, "allreduce"))
            for _ in range(repeats)
        )
    finally:
        os.close(stats)
    out = []
    for name, prog_ns, pieces in (
        ("entry", entry - noop, ENTRY_PIECES),
        ("return", ret - noop, RETURN_PIECES),
    ):
        known = sum(pieces_ns[p] * n for p, n in pieces.items())
        parts = "; ".join(f"{PIECES[p]} {pieces_ns[p]:.0f}" for p in pieces)
        anchor = f"{parts}; the rest (decoding, the slot's and row's fields) {prog_ns - known:.0f}"
        out.append(Figure(f"agent {name} program, AllReduce", prog_ns, "ns", "", None, anchor))
    both = entry + ret - 2 * noop
    anchor = (
        f"the call above the bare uprobe pair: {extra_ns:,.0f} ns; "
        f"unaccounted for: {extra_ns - both:,.0f} ns"
    )
    out.append(Figure("agent programs per AllReduce", both, "ns", "", None, anchor))
    return out


def _parallel_loops(fake: FakeNccl, calls: int, n: int, what: str = "allreduce") -> float:
    """Wall seconds for ``n`` concurrent loops of ``calls`` calls each."""
    start = time.perf_counter()
    procs = [
        subprocess.Popen([str(fake.loop), "loop", str(calls), what], stdout=subprocess.DEVNULL)
        for _ in range(n)
    ]
    for p in procs:
        p.wait()
    return time.perf_counter() - start


def _paced(fake: FakeNccl, seconds: float, rate: int) -> tuple[int, int]:
    """(calls made, pid) of a C loop calling ncclAllReduce ``rate`` times a second."""
    with subprocess.Popen(
        [str(fake.loop), "pace", str(seconds), str(rate)], stdout=subprocess.PIPE, text=True
    ) as proc:
        out, _ = proc.communicate(timeout=seconds + 30)
    return int(out.split()[-1]), proc.pid


def throughput(fake: FakeNccl, quick: bool, agent: Any) -> list[Figure]:
    calls = 100_000 if quick else 1_000_000
    loops = os.cpu_count() or 1
    seconds = 0.3 if quick else 1.0
    ring = agent.source.rings()["nccl"]
    before = ring.read_head()
    wall = _parallel_loops(fake, calls, loops)
    recorded = ring.read_head() - before
    rate = recorded / wall
    floor = loops * calls / _parallel_loops(fake, calls, loops, "baseline")
    lost_kernel = agent.source.kernel_counters()["kernel_lost_nccl"]
    made, pid = _paced(fake, seconds, PACE_RATE)
    rows = ring.copy().rows
    lost = made - int((rows["pid"] == pid).sum())
    anchor = (
        f"{loops} C loops x {calls:,} calls, {recorded:,} rows, kernel lost {lost_kernel}; "
        f"bare uprobe pairs alone: {floor:,.0f} calls/s"
    )
    return [
        Figure("events into the rings", rate, "events/s", ">= 1,000,000", rate >= 1e6, anchor),
        Figure(
            f"events lost at {PACE_RATE // 1000}k/s",
            lost,
            "events",
            "0",
            lost == 0,
            f"{made:,} calls in {seconds:g} s into a {ring.capacity:,}-slot ring",
        ),
    ]


def _churn(stop: threading.Event, rate: float) -> int:
    """Open and close loopback TCP connections: about 8 state events each."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    conns = 0

    def accept() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                c, _ = server.accept()
                c.close()

    threading.Thread(target=accept, daemon=True).start()
    per_conn = 8
    period = per_conn / rate
    next_t = time.perf_counter()
    while not stop.is_set():
        with socket.create_connection(("127.0.0.1", port)):
            conns += 1
        next_t += period
        delay = next_t - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
    server.close()
    return conns


def _pin_dir(tag: str) -> Path:
    """A pin folder of this benchmark process's own (removed when it ends)."""
    from stallwatch.recorder.pinning import PIN_ROOT

    return PIN_ROOT / f"bench-{os.getpid()}-{tag}"


def _until_listening(argv: list[str], log: Path, timeout: float) -> subprocess.Popen[bytes]:
    """Starts an agent logging to ``log`` (a pipe nobody reads would fill)
    and waits until it says it is listening."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stderr=out)
    deadline = time.monotonic() + timeout
    while "listening on" not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"stallwatch record did not start: {log.read_text()[-2000:]}")
        time.sleep(0.1)
    return proc


def _start_record(fake: FakeNccl, dump_dir: str, pin_dir: Path) -> subprocess.Popen[bytes]:
    """``stallwatch record`` on the fake library."""
    argv = [sys.executable, "-m", "stallwatch", "record", "--lib", str(fake.lib)]
    argv += ["--dump-dir", dump_dir, "--listen", "127.0.0.1:0", "--pin-dir", str(pin_dir)]
    return _until_listening(argv, Path(dump_dir) / "agent.log", 120)


def agent_cpu(fake: FakeNccl, quick: bool) -> list[Figure]:
    import psutil

    from stallwatch.recorder.pinning import remove

    seconds = 2.0 if quick else 10.0
    pin_dir = _pin_dir("cpu")
    with tempfile.TemporaryDirectory() as tmp:
        proc = _start_record(fake, tmp, pin_dir)
        try:
            agent = psutil.Process(proc.pid)
            time.sleep(1.0)  # past start-up
            stop = threading.Event()
            conns: list[int] = []
            churn = threading.Thread(target=lambda: conns.append(_churn(stop, TCP_EVENTS_PER_S)))
            cpu0 = agent.cpu_times()
            t0 = time.perf_counter()
            churn.start()
            _paced(fake, seconds, COLLECTIVES_PER_S)
            stop.set()
            churn.join()
            wall = time.perf_counter() - t0
            cpu1 = agent.cpu_times()
        finally:
            proc.terminate()
            proc.wait(120)
            remove(pin_dir)
    used = (cpu1.user + cpu1.system - cpu0.user - cpu0.system) / wall
    anchor = (
        f"{COLLECTIVES_PER_S:,} calls/s + {conns[0] * 8 / wall:,.0f} tcp events/s for {wall:.1f} s"
    )
    return [Figure("agent CPU", used * 100, "% of a core", "< 1%", used < 0.01, anchor)]


IDLE_TARGET = 0.002  # of a core
EXECS_PER_S = 20
EXTRA_PROCESSES = 300
IDLE_WINDOWS = 5  # the figure is their median


def _start_idle_agent(workdir: str, pin_dir: Path) -> subprocess.Popen[bytes]:
    """``stallwatch record`` alone in a network namespace of its own."""
    record = [sys.executable, "-m", "stallwatch", "record", "--scope", "netns"]
    record += ["--dump-dir", workdir, "--listen", "127.0.0.1:0", "--pin-dir", str(pin_dir)]
    inside = "ip link set lo up && exec " + " ".join(record)
    argv = ["unshare", "--net", "sh", "-c", inside]
    return _until_listening(argv, Path(workdir) / "agent.log", 180)


def _counters(proc: subprocess.Popen[bytes], workdir: str) -> dict[str, int]:
    """The agent's own counters, from a dump it writes on SIGUSR1."""
    from stallwatch.dumpers.format import read_dump

    before = set(Path(workdir).glob("*.msgpack"))
    proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        new = set(Path(workdir).glob("*.msgpack")) - before
        if new:
            return read_dump(new.pop()).counters
        time.sleep(0.1)
    return {}


def _cpu_ns(pid: int) -> int:
    """CPU time of every thread of ``pid`` so far, in ns (schedstat: exact,
    where /proc/PID/stat counts 10 ms ticks, 0.05% of a core over 20 s)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that just ended
            total += int((task / "schedstat").read_text().split()[0])
    return total


def _cpu_shares(pid: int, seconds: float, windows: int) -> tuple[list[float], float]:
    """The agent's share of a core in each of ``windows`` windows, and over
    all of them by the kernel's ticks (psutil; includes threads that ended)."""
    import psutil

    agent = psutil.Process(pid)
    c0, w0 = agent.cpu_times(), time.perf_counter()
    shares = []
    for _ in range(windows):
        n0, t0 = _cpu_ns(pid), time.perf_counter()
        time.sleep(seconds / windows)
        shares.append((_cpu_ns(pid) - n0) / 1e9 / (time.perf_counter() - t0))
    c1, w1 = agent.cpu_times(), time.perf_counter()
    return shares, (c1.user + c1.system - c0.user - c0.system) / (w1 - w0)


@contextlib.contextmanager
def _loaded_machine() -> Iterator[None]:
    """Busy loops on every CPU, EXTRA_PROCESSES sleepers, EXECS_PER_S execs."""
    busy = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(os.cpu_count() or 1)
    ]
    sleepers = [subprocess.Popen(["sleep", "600"]) for _ in range(EXTRA_PROCESSES)]
    stop = threading.Event()

    def churn() -> None:
        while not stop.wait(1 / EXECS_PER_S):
            subprocess.run(["/bin/true"], check=False)

    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    try:
        time.sleep(1.0)
        yield
    finally:
        stop.set()
        thread.join()
        for p in [*busy, *sleepers]:
            p.kill()
            p.wait()


def _scan_share(seconds: float) -> float:
    """CPU share of the /proc scan the agent used to run every 250 ms."""
    from stallwatch.recorder.discovery import ProcessScanner

    scanner = ProcessScanner()
    scanner.scan()
    scans = max(1, int(seconds / 0.25))
    t0 = time.process_time()
    for _ in range(scans):
        scanner.scan()
    return (time.process_time() - t0) / (scans * 0.25)


def idle_cost(quick: bool) -> list[Figure]:
    from stallwatch.recorder.pinning import remove

    seconds = 4.0 if quick else 20.0
    pin_dir = _pin_dir("idle")
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        proc = _start_idle_agent(tmp, pin_dir)
        try:
            time.sleep(5.0)  # past start-up (the first scan, attaching what it finds)
            for loaded in (False, True):
                out.append(_idle_figure(proc, tmp, seconds, loaded))
        finally:
            proc.terminate()
            proc.wait(120)
            remove(pin_dir)
    return out


def _idle_figure(
    proc: subprocess.Popen[bytes], workdir: str, seconds: float, loaded: bool
) -> Figure:
    windows = IDLE_WINDOWS if seconds >= IDLE_WINDOWS else 2
    before = _counters(proc, workdir)
    with _loaded_machine() if loaded else contextlib.nullcontext():
        shares, ticks = _cpu_shares(proc.pid, seconds, windows)
        scan = _scan_share(min(seconds, 5.0))
        after = _counters(proc, workdir)
    used = statistics.median(shares)
    seen = after.get("discovery_processes", 0) - before.get("discovery_processes", 0)
    read = after.get("discovery_maps_read", 0) - before.get("discovery_maps_read", 0)
    anchor = (
        f"median of {windows} windows of {seconds / windows:g} s "
        f"({min(shares) * 100:.3f}-{max(shares) * 100:.3f}%; by 10 ms ticks over "
        f"{seconds:g} s: {ticks * 100:.2f}%); {seen / seconds:.1f} processes/s in discovery "
        f"events, {read / seconds:.1f} maps read/s; a /proc scan every 250 ms, as before: "
        f"{scan * 100:.2f}% of a core"
    )
    if loaded:
        anchor += (
            f"; load: a busy loop per CPU, {EXTRA_PROCESSES} more processes, {EXECS_PER_S} execs/s"
        )
    name = f"agent CPU when idle, {'loaded' if loaded else 'idle'} machine"
    return Figure(name, used * 100, "% of a core", "< 0.2%", used < IDLE_TARGET, anchor)


def figures(quick: bool) -> list[Figure]:
    if os.geteuid() != 0:
        raise RuntimeError("bench_recorder needs root (eBPF)")
    from stallwatch.recorder.bareprobe import BareProbe

    with tempfile.TemporaryDirectory() as private:
        # the call's library of its own: no other agent on the machine probes it
        fake = build_private(Path(private))
        repeats = 3 if quick else 7
        unprobed = statistics.median(_loop_ns(fake, 20_000, "baseline") for _ in range(repeats))
        bare = BareProbe(str(fake.lib), "benchBaseline", CSRC / "noop.c")
        try:
            with _agent(fake, 1 << 17) as agent:
                method = f"{bare.attach_method}, agent {agent.source.probes.attach_method}"
                bare_ns = statistics.median(
                    _loop_ns(fake, 20_000, "baseline") for _ in range(repeats)
                )
                # the NCCL probes alone first; the CUDA runtime's probes, once
                # attached, queue each collective on its stream (event_cost)
                cost = call_cost(fake, quick, unprobed, method)
                rec, ratio = cost[0].value, cost[1].value
                figs = [
                    *cost,
                    *call_account(fake, quick, agent, rec - rec / ratio),
                    *event_cost(fake, quick, agent, bare_ns, unprobed),
                    *graph_launch_cost(fake, quick, agent, Path(private)),
                    *throughput(fake, quick, agent),
                ]
        finally:
            bare.close()
    return [*figs, *agent_cpu(build(), quick), *idle_cost(quick)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_recorder", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    args = parser.parse_args(argv)
    print(render(figures(args.quick)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

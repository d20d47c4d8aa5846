"""The agent's footprint, beside the previous design measured in the same run.

The previous design is the checkout at ``PREVIOUS`` (taken from git into a
temporary folder): BCC compiled in the agent at every start, DuckDB and
Arrow loaded at start, a thread per HTTP connection.  Both run the same
command, ``stallwatch record --lib <the bench's NCCL-ABI library>
--keep-pinned``, each with a pin folder of its own, in turn:

- Start-up to serving: from the process's start to the first ``/healthz``
  answered (the agent serves once it records): cold (nothing pinned) with
  an empty compile cache (the programs are compiled: once per kernel), cold
  with the cache ``record --compile-only`` filled (the install's step, timed
  too), and warm (stopped with SIGTERM and started again over its pins); the
  median of ``repeats`` starts each, the designs interleaved.  The previous
  design compiles at every start: its cold figure stands beside both cold
  ones.
- Resident memory (VmRSS) after recording ``record_s`` seconds while a C
  loop makes 1,000 NCCL calls a second and ``/metrics`` is scraped every
  15 s, as Prometheus would; no SQL in the window (a query loads DuckDB and
  Arrow: the figure after one query is printed beside it).
- Threads with 1,000 idle client sockets open, and whether ``/healthz`` is
  answered then.

``python -m bench.bench_agent [--quick] [--record-s S]`` prints the table
(root needed).  The issue's figure is ``--record-s 600``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bench.common import Figure, children, render, rss_kb
from bench.fakenccl import FakeNccl, build

# The last commit of the previous design (before the loader process, the
# lazy SQL engine and bounded serving).
PREVIOUS = "f8f2cbd"
REPO = Path(__file__).resolve().parent.parent
COLD_TARGET_S, WARM_TARGET_S = 3.0, 1.0
RSS_TARGET_MB = 100.0
THREADS_TARGET = 50
IDLE_CLIENTS = 1000
CALLS_PER_S = 1000
SCRAPE_S = 15.0
START_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class Design:
    name: str
    path: Path  # what PYTHONPATH points at


@dataclass
class Running:
    design: Design
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    def get(self, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
        url = f"http://127.0.0.1:{self.port}{path}"
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()

    def status(self, key: str) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1])
        raise KeyError(key)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _previous(into: Path) -> Path | None:
    """The previous design's files, from git (None without the history)."""
    archive = into / "previous.tar"
    with archive.open("wb") as out:
        done = subprocess.run(
            ["git", "-C", str(REPO), "archive", PREVIOUS], stdout=out, check=False
        )
    if done.returncode != 0:
        return None
    target = into / "previous"
    with tarfile.open(archive) as tar:
        tar.extractall(target, filter="tar")
    return target


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(
    design: Design, fake: FakeNccl, pin_dir: Path, work: Path, *extra: str
) -> tuple[Running, float]:
    """Start the design's agent; seconds until /healthz answered."""
    port = _free_port()
    log = work / f"{design.name}-{port}.log"
    argv = [sys.executable, "-m", "stallwatch", "record", "--lib", str(fake.lib)]
    argv += ["--dump-dir", str(work / "dumps"), "--listen", f"127.0.0.1:{port}"]
    argv += ["--host-name", f"bench-{design.name}"]
    argv += ["--pin-dir", str(pin_dir), "--keep-pinned", *extra]
    env = {**os.environ, "PYTHONPATH": str(design.path)}
    t0 = time.perf_counter()
    with log.open("wb") as out:
        # in the design's folder: ``python -m`` puts the working folder first on sys.path
        proc = subprocess.Popen(argv, stdout=out, stderr=out, env=env, cwd=design.path)
    running = Running(design, proc, port, log)
    while True:
        with contextlib.suppress(OSError):
            if running.get("/healthz", timeout=1.0)[0] == 200:
                return running, time.perf_counter() - t0
        if proc.poll() is not None or time.perf_counter() - t0 > START_TIMEOUT_S:
            running.stop()
            raise RuntimeError(f"{design.name} agent did not serve: {log.read_text()[-2000:]}")
        time.sleep(0.02)


def _remove_pins(pin_dir: Path) -> None:
    from stallwatch.recorder.pinning import remove

    remove(pin_dir)


@dataclass
class Starts:
    compiling: list[float]  # cold, and the programs compiled
    cold: list[float]  # cold, from the compile cache (the previous design compiles)
    warm: list[float]
    install: list[float]  # record --compile-only into an empty cache


def _compile_only(design: Design, cache: Path) -> float:
    """Seconds of ``record --compile-only`` (the install step) into ``cache``."""
    argv = [sys.executable, "-m", "stallwatch", "record", "--compile-only"]
    argv += ["--bpf-cache", str(cache)]
    env = {**os.environ, "PYTHONPATH": str(design.path)}
    t0 = time.perf_counter()
    done = subprocess.run(
        argv, env=env, cwd=design.path, capture_output=True, text=True,
        timeout=START_TIMEOUT_S, check=False,
    )  # fmt: skip
    if done.returncode != 0 or "compiled the BPF programs" not in done.stdout:
        raise RuntimeError(f"record --compile-only failed: {done.stderr[-2000:]}")
    return time.perf_counter() - t0


def start_ups(
    designs: list[Design], fake: FakeNccl, pins: dict[str, Path], work: Path, repeats: int
) -> tuple[dict[str, Starts], dict[str, Running]]:
    """Cold and warm starts, the designs in turn; the last warm agents are
    left running (for the memory and thread figures)."""
    starts = {d.name: Starts([], [], [], []) for d in designs}
    running: dict[str, Running] = {}
    for i in range(repeats):
        for d in designs:
            # the previous design has no compile cache: every cold start compiles
            now = d.name == "now"
            cache = ("--bpf-cache", str(work / f"cache-{i}")) if now else ()
            _remove_pins(pins[d.name])
            agent, compiling = _start(d, fake, pins[d.name], work, *cache)
            agent.stop()
            if now:
                # the install's step, into a cache of its own; then a cold
                # start over it (nothing pinned)
                prepared = work / f"prepared-{i}"
                starts[d.name].install.append(_compile_only(d, prepared))
                cache = ("--bpf-cache", str(prepared))
                _remove_pins(pins[d.name])
                agent, cold = _start(d, fake, pins[d.name], work, *cache)
                if "loaded from the compile cache" not in agent.log.read_text():
                    raise RuntimeError(f"the cold start compiled: {agent.log.read_text()[-2000:]}")
                agent.stop()
            else:
                cold = compiling
            agent, warm = _start(d, fake, pins[d.name], work, *cache)
            starts[d.name].compiling.append(compiling)
            starts[d.name].cold.append(cold)
            starts[d.name].warm.append(warm)
            if i < repeats - 1:
                agent.stop()
            else:
                running[d.name] = agent
    return starts, running


def _start_figures(starts: dict[str, Starts], previous: str | None) -> list[Figure]:
    out = []
    kinds = (
        ("cold", "cold (nothing pinned; compiled at install by record --compile-only)",
         COLD_TARGET_S),
        ("warm", "warm (its own pins)", WARM_TARGET_S),
        # once per kernel (a first start, a kernel upgrade) unless the
        # install compiled: no target of its own
        ("compiling", "cold on a kernel nothing was compiled for (the loader compiles)", None),
    )  # fmt: skip
    for kind, what, target in kinds:
        now = getattr(starts["now"], kind)
        value = statistics.median(now)
        anchor = f"median of {len(now)} ({min(now):.2f}-{max(now):.2f} s)"
        if previous is not None:
            before = getattr(starts[previous], kind)
            anchor += f"; previous design: {statistics.median(before):.2f} s"
            anchor += f" ({min(before):.2f}-{max(before):.2f} s)"
        out.append(
            Figure(
                f"agent start-up to serving, {what}",
                value,
                "s",
                f"< {target:g} s" if target is not None else "once per kernel",
                value < target if target is not None else None,
                anchor,
            )
        )
    install = starts["now"].install
    out.append(
        Figure(
            "record --compile-only (the install step, nothing attached)",
            statistics.median(install),
            "s",
            "once per kernel",
            None,
            f"median of {len(install)} ({min(install):.2f}-{max(install):.2f} s)",
        )
    )
    return out


def memory(
    running: dict[str, Running], fake: FakeNccl, record_s: float, previous: str | None
) -> list[Figure]:
    """VmRSS of each agent after ``record_s`` of recording a C loop."""
    loop = subprocess.Popen(
        [str(fake.loop), "pace", f"{record_s + 5:g}", str(CALLS_PER_S)],
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + record_s
        while (left := deadline - time.monotonic()) > 0:
            for agent in running.values():
                with contextlib.suppress(OSError):
                    agent.get("/metrics")
            time.sleep(min(SCRAPE_S, max(left, 0.0)))
        rss = {name: a.status("VmRSS") / 1024 for name, a in running.items()}
        hwm = {name: a.status("VmHWM") / 1024 for name, a in running.items()}
    finally:
        loop.kill()
        loop.wait()
    queried = {name: _rss_after_query(a) for name, a in running.items()}
    value = rss["now"]
    anchor = f"peak {hwm['now']:.0f} MB; after one SQL query {queried['now']}"
    if previous is not None:
        anchor += (
            f"; previous design: {rss[previous]:.0f} MB (peak {hwm[previous]:.0f} MB, "
            f"after one SQL query {queried[previous]})"
        )
    anchor += f"; {CALLS_PER_S:,} NCCL calls/s recorded, /metrics every {SCRAPE_S:g} s"
    return [
        Figure(
            f"agent resident memory after recording {record_s:g} s",
            value,
            "MB",
            f"< {RSS_TARGET_MB:g} MB",
            value < RSS_TARGET_MB,
            anchor,
        )
    ]


def _rss_after_query(agent: Running) -> str:
    body = json.dumps({"sql": "SELECT count(*) FROM nccl_events"}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{agent.port}/query", data=body, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            resp.read()
    except (OSError, urllib.error.HTTPError) as exc:
        return f"(query failed: {exc})"
    own = agent.status("VmRSS") / 1024
    engine = sum(rss_kb(pid) for pid in children(agent.proc.pid)) / 1024
    if not engine:  # an agent that queries in its own process
        return f"{own:.0f} MB"
    return f"{own:.0f} MB (+ {engine:.0f} MB its query engine's process)"


@contextlib.contextmanager
def _idle_clients(port: int, count: int) -> Iterator[int]:
    """``count`` connections opened and left idle; yields how many opened."""
    socks = []
    try:
        for _ in range(count):
            try:
                socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            except OSError:
                break
        time.sleep(1.0)  # accepted, and a thread started for each where that is the way
        yield len(socks)
    finally:
        for s in socks:
            s.close()


def _health(agent: Running) -> str:
    t0 = time.perf_counter()
    try:
        status = agent.get("/healthz", timeout=5.0)[0]
    except OSError as exc:
        return f"health NOT answered ({getattr(exc, 'reason', exc)})"
    return f"health answered {status} in {(time.perf_counter() - t0) * 1e3:.0f} ms"


def threads(running: dict[str, Running], previous: str | None) -> list[Figure]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4 * IDLE_CLIENTS)), hard))
    seen: dict[str, tuple[int, int, str]] = {}
    for name, agent in running.items():
        with _idle_clients(agent.port, IDLE_CLIENTS) as opened:
            seen[name] = (agent.status("Threads"), opened, _health(agent))
    count, opened, health = seen["now"]
    anchor = f"{opened} sockets open, {health}"
    if previous is not None:
        p_count, p_opened, p_health = seen[previous]
        anchor += f"; previous design: {p_count} threads, {p_opened} sockets open, {p_health}"
    ok = count < THREADS_TARGET and "NOT" not in health and opened == IDLE_CLIENTS
    return [
        Figure(
            f"agent threads, {IDLE_CLIENTS:,} idle clients",
            count,
            "threads",
            f"< {THREADS_TARGET}, health answered",
            ok,
            anchor,
        )
    ]


def figures(quick: bool, record_s: float | None = None) -> list[Figure]:
    if os.geteuid() != 0:
        raise RuntimeError("bench_agent needs root (eBPF)")
    from stallwatch.recorder.pinning import PIN_ROOT

    record_s = record_s if record_s is not None else (10.0 if quick else 60.0)
    repeats = 1 if quick else 3
    fake = build()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        designs = [Design("now", REPO)]
        old = _previous(work)
        previous = "previous" if old is not None else None
        if old is not None:
            designs.insert(0, Design("previous", old))
        pins = {d.name: PIN_ROOT / f"bench-{os.getpid()}-agent-{d.name}" for d in designs}
        running: dict[str, Running] = {}
        try:
            starts, running = start_ups(designs, fake, pins, work, repeats)
            figs = _start_figures(starts, previous)
            figs += memory(running, fake, record_s, previous)
            figs += threads(running, previous)
        finally:
            for agent in running.values():
                agent.stop()
            for path in pins.values():
                _remove_pins(path)
    if previous is None:
        print(
            f"bench_agent: no git history ({PREVIOUS}): the previous design not measured",
            file=sys.stderr,
        )
    return figs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_agent", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="one start each, 10 s recorded")
    parser.add_argument(
        "--record-s", type=float, help="seconds recorded before memory is read (default 60)"
    )
    args = parser.parse_args(argv)
    print(render(figures(args.quick, args.record_s)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

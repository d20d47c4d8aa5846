"""The agent under a steady load for half an hour: resident memory flat,
nothing lost.

A real agent (``stallwatch record``, pinned, ``--max-dumps 5``, ``--job``:
only the bench's own process, whatever else runs on the machine) records a
C loop calling ncclAllReduce ``rate`` times a second.  One client thread
asks a query every second (the seed query through ``/query``; every tenth a
fan-out's ``/fetch`` of the NCCL ring's columns instead), another a dump
every minute (``POST /dump`` with the agent's own dump credential), and
reads each dump as it is written.  Every ``SAMPLE_S`` seconds the agent's
and its engine process's resident memory (VmRSS) are read (``--samples
FILE`` keeps them).

Figures:

- resident memory growth, the agent and the agent with its engine process:
  what they hold between requests (the 10th percentile of the samples: a
  dump or a query in flight adds 30-60 MB for a moment) in the last
  ``WINDOW_S`` against the first ``WINDOW_S`` once the run is warm (after
  ``WARM_S``); target < 10 MB (flat).  The medians and the peak are told
  beside it;
- calls missing from a dump: within each dump, the loop's calls between
  its first and last row that it does not hold (the agent fell behind, a
  row torn or lost); target 0.  Calls between two dumps that neither holds
  are told beside it: the ring holds the last 65 s, a minute between two
  dumps' snapshots leaves none out, a loaded machine that delays one may;
- events the kernel could not record (``stallwatch_events_lost_total``), and
  queries or dumps that failed; target 0.

``python -m bench.bench_soak [--minutes M] [--rate R]`` (root): 30 minutes by
default (``make soak``); ``--quick``: 40 s, a dump every 15 s, the memory
printed but not judged (the engine process starts within those 40 s).  Light: it can
run beside other work, whose load shows in the time figures only.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.common import Figure, children, render, rss_kb
from bench.fakenccl import FakeNccl, build

SAMPLE_S = 10.0
WARM_S = 300.0  # the engine started, the rings full, retention at work
WINDOW_S = 300.0  # samples compared: the first window once warm, the last
GROWTH_TARGET_MB = 10.0
STALLWATCH = [sys.executable, "-m", "stallwatch"]
PIN_ROOT = Path("/sys/fs/bpf/stallwatch")
SEED = (
    "WITH slow AS (SELECT timestamp_ns, duration_ns, rank FROM nccl_events "
    "WHERE op = 'ALL_REDUCE' AND duration_ns > 50000000) "
    "SELECT s.rank, count(t.timestamp_ns) FROM slow s LEFT JOIN tcp_events t "
    "ON t.timestamp_ns BETWEEN s.timestamp_ns AND s.timestamp_ns + s.duration_ns "
    "GROUP BY s.rank"
)
FETCH = "SELECT host, pid, seq, op, timestamp_ns, duration_ns FROM nccl_events"


@dataclass
class Soak:
    """What the run saw."""

    samples: list[tuple[float, float, float]] = field(default_factory=list)  # t, agent, engine
    windows: list[tuple[int, int, int]] = field(default_factory=list)  # seq min, max, count
    seen: set[int] = field(default_factory=set)  # the loop's seqs held by some dump
    queries: int = 0
    query_failures: list[str] = field(default_factory=list)
    dumps: int = 0
    dump_failures: list[str] = field(default_factory=list)
    lost: float = 0.0


class Agent:
    def __init__(self, fake: FakeNccl, folder: Path, job: str) -> None:
        import secrets
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        # named as tests.pins expects of a benchmark run by the suite: found if left
        self.pin_dir = PIN_ROOT / f"bench-{os.getpid()}-soak-{secrets.token_hex(3)}"
        self.dump_dir = folder / "dumps"
        self.log = folder / "agent.log"
        argv = [*STALLWATCH, "record", "--lib", str(fake.lib), "--dump-dir", str(self.dump_dir)]
        argv += ["--listen", f"127.0.0.1:{self.port}", "--pin-dir", str(self.pin_dir)]
        argv += ["--max-dumps", "5", "--job", job]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=out)
        deadline = time.monotonic() + 300
        while "listening on" not in self.log.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the agent did not start:\n{self.log.read_text()[-2000:]}")
            time.sleep(0.2)
        from stallwatch.query.credentials import read_local_token

        self.token = read_local_token("127.0.0.1", self.port)

    def ask(self, method: str, path: str, body: object = None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        headers = {"Authorization": f"Bearer {self.token}"} if path == "/dump" else {}
        try:
            conn.request(method, path, None if body is None else json.dumps(body), headers)
            reply = conn.getresponse()
            return reply.status, reply.read()
        finally:
            conn.close()

    def rss_mb(self) -> tuple[float, float]:
        """The agent's VmRSS and its engine process's (0 while none runs)."""
        own = rss_kb(self.proc.pid)
        return own / 1024, sum(rss_kb(c) for c in children(self.proc.pid)) / 1024

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        subprocess.run(["rm", "-rf", str(self.pin_dir)], check=False)


def _query(agent: Agent, soak: Soak) -> None:
    soak.queries += 1
    fetch = soak.queries % 10 == 0
    path, body = ("/fetch", {"queries": [FETCH]}) if fetch else ("/query", {"sql": SEED})
    try:
        status, answer = agent.ask("POST", path, body)
    except OSError as exc:
        soak.query_failures.append(f"{path}: {exc}")
        return
    if status != 200:
        soak.query_failures.append(f"{path}: {status} {answer[:120]!r}")


def _dump(agent: Agent, soak: Soak, pid: int) -> None:
    from stallwatch.dumpers.format import read_dump

    try:
        status, answer = agent.ask("POST", "/dump", {"reason": "soak"})
        doc = json.loads(answer)
        if status != 200 or doc.get("status") != "written":
            soak.dump_failures.append(f"{status} {answer[:160]!r}")
            return
        rows = read_dump(doc["path"]).rings["nccl"].rows
    except (OSError, ValueError) as exc:
        soak.dump_failures.append(str(exc))
        return
    seq = rows["seq"][rows["pid"] == pid].astype(np.int64)
    soak.dumps += 1
    if len(seq):
        soak.windows.append((int(seq.min()), int(seq.max()), len(seq)))
        soak.seen.update(int(s) for s in seq)


def _every(period_s: float, end: float, work: Callable[[], None]) -> threading.Thread:
    """``work`` every ``period_s`` seconds until ``end`` (monotonic), on a thread."""

    def loop() -> None:
        due = time.monotonic()
        while due < end:
            time.sleep(max(0.0, due - time.monotonic()))
            work()
            due += period_s

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def run(minutes: float, rate: int, dump_every_s: float, folder: Path) -> Soak:
    import secrets

    fake = build()
    job = f"soak-{secrets.token_hex(4)}"
    agent = Agent(fake, folder, job)
    soak = Soak()
    seconds = minutes * 60
    loop = subprocess.Popen(
        [str(fake.loop), "pace", f"{seconds + 30:g}", str(rate)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TORCHELASTIC_RUN_ID": job},
    )
    start = time.monotonic()
    end = start + seconds
    try:
        time.sleep(5)  # the loop found and recorded
        threads = [
            _every(1.0, end, lambda: _query(agent, soak)),
            _every(dump_every_s, end, lambda: _dump(agent, soak, loop.pid)),
        ]
        while (now := time.monotonic()) < end:
            own, engine = agent.rss_mb()
            soak.samples.append((now - start, own, own + engine))
            time.sleep(min(SAMPLE_S, max(0.0, end - time.monotonic())))
        for thread in threads:
            thread.join()
        _dump(agent, soak, loop.pid)  # the last window
        _, text = agent.ask("GET", "/metrics")
        soak.lost = sum(
            float(line.split()[1])
            for line in text.decode().splitlines()
            if line.startswith("stallwatch_events_lost_total")
        )
    finally:
        loop.send_signal(signal.SIGTERM)
        loop.communicate(timeout=60)
        agent.stop()
    return soak


def _windows(
    samples: list[tuple[float, float, float]], column: int, warm_s: float, window_s: float
) -> tuple[list[float], list[float]]:
    """The samples of the first window once warm, and of the last."""
    end = samples[-1][0]
    first = [s[column] for s in samples if warm_s <= s[0] < warm_s + window_s]
    last = [s[column] for s in samples if s[0] > end - window_s]
    return first or last, last


def _held(values: list[float]) -> float:
    """What is held between requests: the 10th percentile."""
    return statistics.quantiles(values, n=10)[0] if len(values) > 1 else values[0]


def _growth(
    samples: list[tuple[float, float, float]], column: int, warm_s: float, window_s: float
) -> tuple[float, str]:
    first, last = _windows(samples, column, warm_s, window_s)
    told = (
        f"held {_held(first):.0f} -> {_held(last):.0f} MB, median "
        f"{statistics.median(first):.0f} -> {statistics.median(last):.0f} MB"
    )
    return _held(last) - _held(first), told


def figures(
    quick: bool = False, minutes: float = 30.0, rate: int = 1000, samples: Path | None = None
) -> list[Figure]:
    minutes = 40 / 60 if quick else minutes
    dump_every = 15.0 if quick else 60.0
    warm = 10.0 if quick else min(WARM_S, minutes * 60 / 3)
    window = 10.0 if quick else min(WINDOW_S, minutes * 60 / 3)
    with tempfile.TemporaryDirectory(prefix="stallwatch-soak-") as tmp:
        soak = run(minutes, rate, dump_every, Path(tmp))
    if samples is not None:
        rows = [f"{t:.0f},{own:.1f},{both:.1f}" for t, own, both in soak.samples]
        samples.write_text("seconds,agent_mb,agent_and_engine_mb\n" + "\n".join(rows) + "\n")
    first, last = soak.windows[0][0], soak.windows[-1][1]
    between = (last - first + 1) - len({s for s in soak.seen if first <= s <= last})
    missing = sum(hi - lo + 1 - count for lo, hi, count in soak.windows)
    newest = [w[1] for w in soak.windows]
    apart = max((b - a for a, b in itertools.pairwise(newest)), default=0)
    grow_agent, agent_told = _growth(soak.samples, 1, warm, window)
    grow_both, both_told = _growth(soak.samples, 2, warm, window)
    peak = max(s[2] for s in soak.samples)
    # flat or not is told by a long run: 40 s hold the engine's start itself
    judged = None if quick else True
    span = f"{minutes:.3g} min at {rate:,} calls/s, a query a second, a dump every {dump_every:g} s"
    return [
        Figure(
            "soak: agent resident memory growth",
            grow_agent,
            "MB",
            f"< {GROWTH_TARGET_MB:g} MB",
            judged and grow_agent < GROWTH_TARGET_MB,
            f"{agent_told}; {span}",
        ),
        Figure(
            "soak: agent + engine resident memory growth",
            grow_both,
            "MB",
            f"< {GROWTH_TARGET_MB:g} MB",
            judged and grow_both < GROWTH_TARGET_MB,
            f"{both_told}, peak {peak:.0f} MB",
        ),
        Figure(
            "soak: calls missing from a dump",
            float(missing),
            "calls",
            "0",
            missing == 0,
            f"{soak.dumps} dumps, {sum(w[2] for w in soak.windows):,} of the loop's rows; "
            f"{between:,} of {last - first + 1:,} calls between the first and the last in "
            f"no dump (newest rows of two dumps at most {apart / rate:.0f} s apart)",
        ),
        Figure(
            "soak: events lost, failed queries and dumps",
            soak.lost + len(soak.query_failures) + len(soak.dump_failures),
            "",
            "0",
            not (soak.lost or soak.query_failures or soak.dump_failures),
            f"lost {soak.lost:.0f}; {soak.queries} queries, {len(soak.query_failures)} failed"
            f"{': ' + soak.query_failures[0] if soak.query_failures else ''}; "
            f"{len(soak.dump_failures)} dumps failed"
            f"{': ' + soak.dump_failures[0] if soak.dump_failures else ''}",
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_soak", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="40 s, a dump every 15 s")
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--rate", type=int, default=1000, help="NCCL calls a second")
    parser.add_argument("--samples", type=Path, metavar="FILE", help="keep the memory samples")
    args = parser.parse_args(argv)
    found = figures(args.quick, args.minutes, args.rate, args.samples)
    print(render(found))
    return 0 if all(f.ok is not False for f in found) else 1


if __name__ == "__main__":
    sys.exit(main())

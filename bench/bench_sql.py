"""SQL benchmark: the seed query (dumpers.sqltables.SEED_QUERY) on a million rows, and fan-out.

    python -m bench.bench_sql [--quick] [--repeats N]

Figures (medians over repeats, printed as figure / value / target):
- the seed query over 1M nccl_events rows and 1M tcp_events rows (< 1 s),
  with the time to build the tables from the rings shown apart;
- the seed query fanned out to 4, 64 and 1,024 agents, each an HTTP server
  on its own loopback port serving a recording like a live agent (< 100 ms,
  < 500 ms and < 2 s end to end: plan, ask, merge, run the query over the
  union), with the time when every fan-out opens new connections (as one
  ``stallwatch query --agents`` run does) beside it;
- the same fan-outs to agents that answer the fetches by scanning their
  Arrow columns (``query.scan``, as they do) and to agents that run every
  fetch in DuckDB (as they did before), asked in turn, as a ratio;
- the fan-out to 64 agents over mutual TLS as a ratio to plain HTTP;
- ``stallwatch query`` counting the NCCL calls of 256 dumps (a 3-D job of
  2,048 ranks, ``bench.incident3d``) beside ``stallwatch analyze`` on the
  same dumps, each command a process of its own: the memory each holds for
  the data (peak RSS on the 256 dumps less its peak on one of them: DuckDB
  and Arrow alone take query's process to about 150 MB, which analyze never
  loads) as a ratio, query's at most analyze's; and the time as a ratio.

The agents are HTTP servers (the real ``query.http`` surface and query
engine), spread over worker processes (8, and 32 for 1,024 agents), each on
its own loopback port; the client is the real fan-out client over TCP.  This
2-core machine stands in for 1,024 nodes, so the agents share its CPUs: on a
cluster each has its own.  Each synthetic host's monotonic clock starts ten
minutes after the previous one's, as hosts that booted at different times.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from bench.common import Figure, median_time, render
from stallwatch.dumpers.model import Clock, CommInfo, ProcessInfo, Recording, Ring
from stallwatch.dumpers.schema import NCCL_EVENT, TCP_EVENT, DataType, Op, Result, State, TcpEvent
from stallwatch.dumpers.sqltables import SEED_QUERY

ROOT = Path(__file__).resolve().parent.parent
BASE_NS = 1_000_000_000_000
COMM_HASH = 0xDEADBEEF_CAFEF00D  # above 2**63: UBIGINT all the way through


@dataclass(frozen=True, slots=True)
class Synthetic:
    """Shape of a synthetic recording: ranks doing AllReduces step after step,
    some steps slow, retransmits scattered over the whole window."""

    host: str = "node0"
    ranks: int = 4
    first_rank: int = 0
    steps: int = 100
    step_ns: int = 100_000_000
    fast_ns: int = 5_000_000
    slow_ns: int = 80_000_000
    slow_every: int = 10  # every n-th step is slow (0: none)
    tcp_rows: int = 200
    retransmit_share: float = 0.5  # the rest are inet_sock_set_state
    in_flight: int = 1  # trailing calls still in flight
    hosts: int = 4  # hosts of the job: its communicator has ranks * hosts members
    seed: int = 1
    base_ns: int = BASE_NS  # the host's monotonic clock at the first step


def _nccl_rows(s: Synthetic) -> np.ndarray:
    n = s.ranks * s.steps
    rows = np.zeros(n + s.in_flight, dtype=NCCL_EVENT)
    step = np.repeat(np.arange(s.steps), s.ranks)
    local = np.tile(np.arange(s.ranks), s.steps)
    slow = (step % s.slow_every == s.slow_every - 1) if s.slow_every else np.zeros(n, bool)
    ts = s.base_ns + step * s.step_ns + local * 1000
    rows["ts_ns"][:n] = ts
    rows["end_ns"][:n] = ts + np.where(slow, s.slow_ns + local * 1000, s.fast_ns)
    rows["pid"][:n] = 1000 + local
    rows["tid"][:n] = 1000 + local
    rows["seq"][:n] = step
    rows["rank"][:n] = -1  # filled from the communicator table
    rows["nranks"][:n] = -1
    rows["comm"][:n] = 0x7F0000001000 + local
    rows["state"][:n] = State.COMPLETED
    rows["result"][:n] = Result.SUCCESS
    tail = slice(n, n + s.in_flight)
    rows["ts_ns"][tail] = s.base_ns + s.steps * s.step_ns
    rows["pid"][tail] = 1000
    rows["rank"][tail] = s.first_rank
    rows["nranks"][tail] = s.ranks * s.hosts
    rows["comm_hash"][tail] = COMM_HASH
    rows["result"][tail] = Result.PENDING
    rows["op"] = Op.ALL_REDUCE
    rows["count"] = 1 << 20
    rows["datatype"] = DataType.FLOAT32
    rows["bytes"] = rows["count"] * 4
    rows["pos"] = np.arange(1, len(rows) + 1)
    return rows


def _tcp_rows(s: Synthetic) -> np.ndarray:
    rng = np.random.default_rng(s.seed)
    rows = np.zeros(s.tcp_rows, dtype=TCP_EVENT)
    rows["ts_ns"] = np.sort(s.base_ns + rng.integers(0, s.steps * s.step_ns, s.tcp_rows))
    retransmit = rng.random(s.tcp_rows) < s.retransmit_share
    rows["event"] = np.where(retransmit, TcpEvent.TCP_RETRANSMIT_SKB, TcpEvent.INET_SOCK_SET_STATE)
    rows["pid"] = 1000 + rng.integers(0, s.ranks, s.tcp_rows)
    rows["family"] = 2
    rows["saddr"][:, :4] = [10, 0, 0, 1]
    rows["daddr"][:, :4] = [10, 0, 0, 2]
    rows["daddr"][:, 3] += rng.integers(0, 3, s.tcp_rows).astype(np.uint8)
    rows["sport"] = 40000 + rng.integers(0, 8, s.tcp_rows)
    rows["dport"] = 29500
    rows["state"] = 1
    rows["pos"] = np.arange(1, s.tcp_rows + 1)
    return rows


def synthetic_recording(s: Synthetic) -> Recording:
    comms = tuple(
        CommInfo(
            pid=1000 + r,
            comm=0x7F0000001000 + r,
            comm_hash=COMM_HASH,
            rank=s.first_rank + r,
            nranks=s.ranks * s.hosts,
            root_addr="10.0.0.1:29500",
            init_ns=s.base_ns - 1000,
        )
        for r in range(s.ranks)
    )
    procs = tuple(
        ProcessInfo(1000 + r, "python", f"train.py --rank {r}", 4026531840, s.base_ns - 10**9, ())
        for r in range(s.ranks)
    )
    rings = {"nccl": Ring(_nccl_rows(s)), "tcp": Ring(_tcp_rows(s), overwritten=3)}
    # dumped a second after its last row (a row after the dump is damage);
    # the rows' wall times stay where they were
    after = s.steps * s.step_ns + s.slow_ns + s.ranks * 1000 + 10**9
    clock = Clock(monotonic_ns=s.base_ns + after, realtime_ns=1_790_000_000_000_000_000 + after)
    return Recording(s.host, "boot-" + s.host, clock, procs, comms, rings, agent_version="bench")


def _seed_figures(rows: int, repeats: int) -> list[Figure]:
    from stallwatch.dumpers.sqltables import tables
    from stallwatch.query.sql import LOCAL, QueryEngine

    # steps * ranks = rows; one step in 100 slow.
    shape = Synthetic(ranks=8, steps=rows // 8, step_ns=1_000_000, slow_every=100, tcp_rows=rows)
    rec = synthetic_recording(shape)
    build = median_time(lambda: tables([rec]), repeats)
    with QueryEngine([rec], LOCAL) as engine:
        engine.query("SELECT 1")  # registers the tables
        seed = median_time(lambda: engine.query(SEED_QUERY), repeats)
        all_windows = SEED_QUERY.replace(" LIMIT 20;", "")
        ((pairs, slow),) = engine.query(
            f"SELECT sum(retransmits_in_window), count(*) FROM ({all_windows})"
        ).rows
    n = f"{rows / 1e6:g}M" if rows >= 1_000_000 else f"{rows // 1000}k"
    return [
        Figure(f"sql: tables from rings, {n}+{n} rows", build * 1e3, "ms", "", None),
        Figure(
            f"sql: seed query, {n} nccl + {n} tcp rows",
            seed * 1e3,
            "ms",
            "< 1000 ms",
            seed < 1.0,
            f"{slow:,} slow AllReduces, {pairs:,} (AllReduce, retransmit) pairs",
        ),
    ]


BOOT_SPREAD_NS = 600 * 10**9  # synthetic hosts booted ten minutes apart


def agent_recording(i: int, hosts: int = 4) -> Recording:
    """Agent ``i``'s recording, one of ``hosts`` in the job.  Each host's
    monotonic clock is its own (hosts boot at different times), so the seed
    query, which names no host and is answered over all agents' rows as one
    table, joins each slow window with the retransmits of the one host whose
    clock it shares."""
    shape = Synthetic(
        host=f"node{i}",
        first_rank=4 * i,
        seed=i,
        base_ns=BASE_NS + i * BOOT_SPREAD_NS,
        hosts=hosts,
    )
    return synthetic_recording(shape)


def serve_worker(
    first: int, count: int, hosts: int, tls_dir: str | None = None, scans: bool = True
) -> None:
    """In a worker process: ``count`` agents of a job on ``hosts`` (one HTTP server and engine
    each, on its own loopback port) serving synthetic recordings; prints their
    addresses on one line, serves until stdin closes.  With ``tls_dir``
    (``lab.certs`` files), HTTPS with client certificates required; without
    ``scans``, every fetch runs in DuckDB (as before ``query.scan``)."""
    from stallwatch.query.http import RecordingsBackend, serve_http
    from stallwatch.query.tls import ServerTls

    tls = None
    if tls_dir is not None:
        folder = Path(tls_dir)
        tls = ServerTls(folder / "node0.pem", folder / "node0.key", folder / "ca.pem")
    handles = []
    for i in range(first, first + count):
        backend = RecordingsBackend([agent_recording(i, hosts)])
        # hundreds of servers in one process: each engine in it, not in a process of its own
        handles.append(
            serve_http(backend, "127.0.0.1:0", None, tls=tls, scans=scans, isolated=False)
        )
        handles[-1].engine.query("SELECT 1", None, "")  # tables made now, not at the first fan-out
    print(" ".join(h.address for h in handles), flush=True)
    sys.stdin.read()
    for h in handles:
        h.close()


@contextlib.contextmanager
def agent_processes(
    agents: int, processes: int, tls_dir: str | None = None, scans: bool = True
) -> Iterator[list[str]]:
    """``agents`` live-like agents spread over ``processes`` worker processes
    (one machine stands in for many nodes: a process per agent would spend
    the run importing DuckDB 1,024 times)."""
    per = -(-agents // processes)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = []
    try:
        for first in range(0, agents, per):
            argv = [sys.executable, "-m", "bench.bench_sql", "--serve-worker", str(first)]
            argv += [str(min(per, agents - first)), "--job-hosts", str(agents)]
            argv += ["--tls-dir", tls_dir] if tls_dir else []
            argv += [] if scans else ["--no-scans"]
            procs.append(
                subprocess.Popen(
                    argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
                )
            )
        addresses = []
        for proc in procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line.strip():
                raise RuntimeError(f"serve worker {proc.args!r} exited with {proc.wait()}")
            addresses += line.split()
        yield addresses
    finally:
        for proc in procs:
            if proc.stdin:
                proc.stdin.close()
            proc.wait(timeout=60)
            if proc.stdout:
                proc.stdout.close()


@dataclass(frozen=True, slots=True)
class _Timed:
    warm: float  # seconds, median, connections kept between fan-outs
    cold: float  # seconds, median, new connections (as one `query --agents` run)
    rows: int
    agents_cpu: float  # CPU seconds of all the agents' processes, one warm fan-out
    client_cpu: float  # CPU seconds of the client, one warm fan-out


def _cpu(procs: list[psutil.Process]) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in procs)


def _time_fanout(addrs: list[str], repeats: int, tls: Any = None, cold: bool = True) -> _Timed:
    from stallwatch.query.fanout import close_connections, query_agents

    def ask() -> Any:
        result = query_agents(addrs, SEED_QUERY, timeout=30.0, tls=tls)
        if result.failed or result.partial:
            raise RuntimeError(f"fan-out failed: {result.failed[:3]}")
        return result

    first = ask()
    me = psutil.Process()
    agents, client = _cpu(me.children()), _cpu([me])
    warm = median_time(ask, repeats)
    agents_cpu = (_cpu(me.children()) - agents) / repeats
    client_cpu = (_cpu([me]) - client) / repeats

    def cold_query() -> None:
        close_connections()
        ask()

    cold_s = median_time(cold_query, repeats) if cold else math.nan
    close_connections()
    return _Timed(warm, cold_s, len(first.rows), agents_cpu, client_cpu)


FANOUT_TARGETS_S = {4: 0.1, 64: 0.5, 1024: 2.0}


def _fanout_figure(agents: int, repeats: int, processes: int) -> Figure:
    processes = min(agents, processes)
    with agent_processes(agents, processes) as addrs:
        timed = _time_fanout(addrs, repeats)
    target = next(t for n, t in sorted(FANOUT_TARGETS_S.items()) if agents <= n)
    return Figure(
        f"sql: fan-out seed query to {agents} agents ({processes} processes)",
        timed.warm * 1e3,
        "ms",
        f"< {target * 1e3:g} ms",
        timed.warm < target,
        f"new connections each time: {timed.cold * 1e3:.0f} ms; CPU per agent asked: "
        f"{timed.agents_cpu / agents * 1e3:.2f} ms in the agents, "
        f"{timed.client_cpu / agents * 1e3:.2f} ms in the client",
    )


def _scan_figure(agents: int, repeats: int, processes: int) -> Figure:
    """Agents that answer fetches by scanning their Arrow columns
    (``query.scan``) against agents that run every fetch in DuckDB, as all
    did before: both fleets up at once, asked in turn, so that the load
    other processes put on the machine falls on both alike."""
    from stallwatch.query.fanout import close_connections, query_agents

    processes = min(agents, processes)
    times: dict[bool, list[float]] = {True: [], False: []}
    cpu = dict.fromkeys(times, 0.0)
    with (
        agent_processes(agents, processes) as new,
        agent_processes(agents, processes, scans=False) as old,
    ):
        fleets = {True: new, False: old}
        me = psutil.Process()
        procs = {
            scans: [p for p in me.children() if ("--no-scans" in p.cmdline()) != scans]
            for scans in times
        }
        for addrs in fleets.values():  # connections made, tables warm
            query_agents(addrs, SEED_QUERY, timeout=30.0)
        for _ in range(repeats):
            for scans, addrs in fleets.items():
                before = _cpu(procs[scans])
                t0 = time.perf_counter()
                result = query_agents(addrs, SEED_QUERY, timeout=30.0)
                times[scans].append(time.perf_counter() - t0)
                cpu[scans] += _cpu(procs[scans]) - before
                if result.partial:
                    raise RuntimeError(f"fan-out failed: {result.failed[:3]}")
        close_connections()
    scan_s, duck_s = (statistics.median(times[k]) for k in (True, False))
    per_agent = {k: v / repeats / agents * 1e3 for k, v in cpu.items()}
    return Figure(
        f"sql: fan-out to {agents} agents, scanning agents / DuckDB agents (before)",
        scan_s / duck_s,
        "x",
        "",
        None,
        f"{scan_s * 1e3:.0f} ms vs {duck_s * 1e3:.0f} ms, medians of {repeats} fan-outs "
        f"in turn; CPU per agent asked: {per_agent[True]:.2f} vs {per_agent[False]:.2f} ms",
    )


def _tls_figure(agents: int, repeats: int, processes: int) -> Figure:
    """The same fan-out over mutual TLS (new connections each time: every
    agent's handshake), as a ratio to plain HTTP in the same run."""
    import tempfile

    from stallwatch.lab.certs import make_certs

    with tempfile.TemporaryDirectory(prefix="stallwatch-bench-tls-") as folder:
        certs = make_certs(Path(folder), {0: "127.0.0.1"})
        with agent_processes(agents, processes) as addrs:
            plain = _time_fanout(addrs, repeats)
        with agent_processes(agents, processes, folder) as addrs:
            over_tls = _time_fanout(addrs, repeats, certs.client())
    return Figure(
        f"sql: fan-out to {agents} agents over mutual TLS / plain, new connections",
        over_tls.cold / plain.cold,
        "x",
        "",
        None,
        f"{over_tls.cold * 1e3:.0f} ms vs {plain.cold * 1e3:.0f} ms; kept connections: "
        f"{over_tls.warm * 1e3:.0f} ms vs {plain.warm * 1e3:.0f} ms",
    )


SCALE_SQL = "SELECT count(*) FROM nccl_events"
# One command in a process of its own that imports nothing else (this module
# loads Arrow, which analyze never does): its output to /dev/null, its time
# and peak RSS (VmHWM: ru_maxrss would carry the parent's over exec) as JSON.
SCALE_CHILD = """
import contextlib, json, os, sys, time
from stallwatch.commands.main import main
t0 = time.perf_counter()
with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
    code = main(sys.argv[1:])
seconds = time.perf_counter() - t0
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"seconds": seconds, "rss": hwm * 1024, "code": code}))
"""


def _scale_run(command: str, folder: Path) -> dict[str, float]:
    argv = ["query", str(folder), SCALE_SQL] if command == "query" else ["analyze", str(folder)]
    done = subprocess.run(
        [sys.executable, "-c", SCALE_CHILD, *argv],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    doc: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return doc


def _scale_figures(quick: bool, repeats: int) -> list[Figure]:
    from bench import incident3d
    from bench.incident3d import Shape

    if not quick:  # written once into the benchmarks' cache
        return _scale_figures_on(incident3d.cached_incident(Shape(2048)), Shape(2048), repeats)
    shape = Shape(256, calls=200, pp=4)
    with tempfile.TemporaryDirectory(prefix="bench-sql-scale-") as tmp:
        incident3d.write_incident(shape, Path(tmp))
        return _scale_figures_on(Path(tmp), shape, repeats)


def _scale_figures_on(folder: Path, shape: Any, repeats: int) -> list[Figure]:
    dumps = sorted(folder.glob("*.msgpack"))
    with tempfile.TemporaryDirectory(prefix="bench-sql-one-") as tmp:
        one = Path(tmp)
        (one / dumps[0].name).symlink_to(dumps[0])
        runs: dict[str, list[dict[str, float]]] = {"query": [], "analyze": []}
        floors: dict[str, list[float]] = {"query": [], "analyze": []}
        for _ in range(repeats):  # side by side, in turn
            for command in runs:
                runs[command].append(_scale_run(command, folder))
                floors[command].append(_scale_run(command, one)["rss"])
    peak = {c: statistics.median(r["rss"] for r in rs) for c, rs in runs.items()}
    floor = {c: statistics.median(f) for c, f in floors.items()}
    held = {c: max(peak[c] - floor[c], 0.0) for c in runs}
    secs = {c: statistics.median(r["seconds"] for r in rs) for c, rs in runs.items()}
    tag = f"query {SCALE_SQL!r} on {len(dumps)} dumps ({shape.nranks:,} ranks)"
    mb = {c: f"{peak[c] / 1e6:.0f} MB peak ({floor[c] / 1e6:.0f} MB on one dump)" for c in runs}
    ratio = held["query"] / held["analyze"] if held["analyze"] else float("inf")
    return [
        Figure(
            f"{tag}: memory for the data / analyze's",
            ratio,
            "x",
            "<= 1.0x",
            ratio <= 1.0,
            f"query {mb['query']}, analyze {mb['analyze']}",
        ),
        Figure(
            f"{tag}: time / analyze's",
            secs["query"] / secs["analyze"],
            "x",
            "-",
            None,
            f"query {secs['query']:.2f} s, analyze {secs['analyze']:.2f} s",
        ),
    ]


def figures(quick: bool = False, repeats: int = 5) -> list[Figure]:
    rows = 20_000 if quick else 1_000_000
    out = _seed_figures(rows, repeats)
    processes = 2 if quick else 8
    out.append(_fanout_figure(4, repeats, processes))
    out.append(_fanout_figure(8 if quick else 64, repeats, processes))
    out.append(_scan_figure(8 if quick else 64, repeats, processes))
    if not quick:
        out.append(_fanout_figure(1024, repeats, 32))
        out.append(_scan_figure(1024, repeats, 32))
    out.append(_tls_figure(8 if quick else 64, repeats, processes))
    out += _scale_figures(quick, 1 if quick else 3)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_sql", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a quick run on small data")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--serve-worker", nargs=2, type=int, metavar=("FIRST", "COUNT"),
                        help=argparse.SUPPRESS)  # fmt: skip
    parser.add_argument("--job-hosts", type=int, default=4, help=argparse.SUPPRESS)
    parser.add_argument("--tls-dir", help=argparse.SUPPRESS)
    parser.add_argument("--no-scans", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_worker:
        serve_worker(*args.serve_worker, args.job_hosts, args.tls_dir, not args.no_scans)
        return 0
    result = figures(args.quick, args.repeats)
    print(render(result))
    return 0 if all(f.ok is not False for f in result) else 1


if __name__ == "__main__":
    raise SystemExit(main())

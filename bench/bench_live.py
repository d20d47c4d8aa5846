"""The live verdict (``stallwatch analyze --agents``): every agent's current
recording fetched at once, analyzed in memory.

    python -m bench.bench_live [--quick] [--repeats N]

Figures (medians over repeats, end to end as the command spends it: ask every
agent for its recording, check each with the dump reader, analyze): the live
verdict over 4 and over 1,024 agents (target < 3 s at 1,024), with, measured
in the same run, the fetch alone and the analysis alone of those answers.

The agents are the SQL fan-out bench's fleet (``bench.bench_sql``): HTTP
servers of the real ``query.http`` surface, each serving a synthetic node of
4 ranks (400 AllReduces, 200 TCP events) on its own loopback port, spread over
worker processes; this 2-core machine stands in for 1,024 nodes, so the
agents share its CPUs.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.bench_sql import agent_processes
from bench.common import Figure, render

TARGET_S = 3.0


def _time_live(addrs: list[str], repeats: int) -> tuple[float, float, float, int]:
    """Median seconds: the live verdict, its fetch alone, its analysis alone;
    and the ranks judged."""
    from stallwatch.analyzer.live import analyze_agents
    from stallwatch.analyzer.pipeline import analyze_recordings
    from stallwatch.query.agentclient import close_connections
    from stallwatch.query.live import AgentCall, fetch_recordings

    call = AgentCall(tuple(addrs), timeout=60.0)
    whole, fetch, analysis = [], [], []
    ranks = 0
    for _ in range(repeats):
        close_connections()  # as one command run: new connections
        t0 = time.perf_counter()
        verdict = analyze_agents(call)
        whole.append(time.perf_counter() - t0)
        if verdict.gathered.failed:
            raise RuntimeError(f"agents failed: {verdict.gathered.failed[:3]}")
        ranks = sum(len(r.incident.procs) for r in verdict.result.incidents)
        close_connections()
        t0 = time.perf_counter()
        got = fetch_recordings(call, "bench")
        fetch.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        analyze_recordings([(f.label, f.recording) for f in got.fetched])
        analysis.append(time.perf_counter() - t0)
    close_connections()
    return statistics.median(whole), statistics.median(fetch), statistics.median(analysis), ranks


def _figure(agents: int, repeats: int, processes: int) -> Figure:
    processes = min(agents, processes)
    with agent_processes(agents, processes) as addrs:
        whole, fetch, analysis, ranks = _time_live(addrs, repeats)
    return Figure(
        f"live verdict: analyze --agents over {agents} agents ({processes} processes)",
        whole,
        "s",
        f"< {TARGET_S:g} s",
        whole < TARGET_S,
        f"fetch and check alone {fetch * 1e3:.0f} ms, analysis alone {analysis * 1e3:.0f} ms; "
        f"{ranks:,} ranks judged",
    )


def figures(quick: bool = False, repeats: int = 5) -> list[Figure]:
    if quick:
        return [_figure(4, 2, 2), _figure(8, 2, 2)]
    return [_figure(4, repeats, 4), _figure(1024, repeats, 32)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_live", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a quick run on few agents")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    result = figures(args.quick, args.repeats)
    print(render(result))
    return 0 if all(f.ok is not False for f in result) else 1


if __name__ == "__main__":
    raise SystemExit(main())

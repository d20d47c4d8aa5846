"""The live verdict (``stallwatch analyze --agents``): every agent's current
recording fetched at once, analyzed in memory.

    python -m bench.bench_live [--quick] [--repeats N]

Figures (medians over repeats, end to end as the command spends it: ask every
agent for its recording, check each with the dump reader, analyze): the live
verdict over 4 and over 1,024 agents (target < 1 s at 1,024, every agent
answering), with, measured in the same run, the fetch alone and the analysis
alone of those answers.  An agent that did not answer is counted and named
(the figure fails), never a reason to stop the run.
Beside each wall time, the client's CPU time (all its threads): on a shared
machine the wall time follows the load (printed: the one-minute average as
the timing starts and as it ends), the CPU time is the tool's own cost.

The agents are the SQL fan-out bench's fleet (``bench.bench_sql``): HTTP
servers of the real ``query.http`` surface, each serving a synthetic node of
4 ranks (400 AllReduces, 200 TCP events) on its own loopback port, spread over
worker processes; this 2-core machine stands in for 1,024 nodes, so the
agents share its CPUs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass

from bench.bench_sql import agent_processes
from bench.common import Figure, render

TARGET_S = 1.0


@dataclass(frozen=True, slots=True)
class _Timed:
    """Medians over repeats, in seconds: wall time, and the CPU time of the
    client process (all its threads; the agents run in other processes), which
    is steadier than wall time on a busy machine: the load slows the wall
    clock, the tool's cost is its CPU."""

    whole: float  # the live verdict end to end
    whole_cpu: float
    fetch: float  # its fetch and check alone
    fetch_cpu: float
    analysis: float  # its analysis alone
    analysis_cpu: float
    ranks: int  # judged
    asked: int  # agent answers asked for, over the repeats
    failed: tuple[str, ...]  # of those, the ones that did not come: "agent: why"


def _time_live(addrs: list[str], repeats: int) -> _Timed:
    from stallwatch.analyzer.live import analyze_agents
    from stallwatch.analyzer.pipeline import analyze_recordings
    from stallwatch.query.agentclient import close_connections
    from stallwatch.query.live import AgentCall, fetch_recordings

    call = AgentCall(tuple(addrs), timeout=60.0)
    whole, whole_cpu, fetch, fetch_cpu, analysis, cpu = [], [], [], [], [], []
    ranks = 0
    failed: list[str] = []
    for _ in range(repeats):
        close_connections()  # as one command run: new connections
        t0, c0 = time.perf_counter(), time.process_time()
        verdict = analyze_agents(call)
        whole.append(time.perf_counter() - t0)
        whole_cpu.append(time.process_time() - c0)
        failed += [f"{f.agent}: {f.error}" for f in verdict.gathered.failed]
        ranks = sum(len(r.incident.procs) for r in verdict.result.incidents)
        close_connections()
        t0, c0 = time.perf_counter(), time.process_time()
        got = fetch_recordings(call, "bench")
        fetch.append(time.perf_counter() - t0)
        failed += [f"{f.agent}: {f.error}" for f in got.failed]
        fetch_cpu.append(time.process_time() - c0)
        t0, c0 = time.perf_counter(), time.process_time()
        analyze_recordings([(f.label, f.recording) for f in got.fetched])
        analysis.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    close_connections()
    m = statistics.median
    return _Timed(
        m(whole),
        m(whole_cpu),
        m(fetch),
        m(fetch_cpu),
        m(analysis),
        m(cpu),
        ranks,
        2 * repeats * len(addrs),
        tuple(failed),
    )


def _figure(agents: int, repeats: int, processes: int) -> Figure:
    processes = min(agents, processes)
    with agent_processes(agents, processes) as addrs:
        load_before = os.getloadavg()[0]
        t = _time_live(addrs, repeats)
    answered = f"{t.asked - len(t.failed):,} of {t.asked:,} answers came"
    if t.failed:
        answered += f" (missing: {'; '.join(t.failed[:3])}{'; ...' if len(t.failed) > 3 else ''})"
    return Figure(
        f"live verdict: analyze --agents over {agents} agents ({processes} processes)",
        t.whole,
        "s",
        f"< {TARGET_S:g} s, every agent answering",
        t.whole < TARGET_S and not t.failed,
        f"{answered}; client CPU {t.whole_cpu * 1e3:.0f} ms; fetch and check alone "
        f"{t.fetch * 1e3:.0f} ms ({t.fetch_cpu * 1e3:.0f} ms CPU), analysis alone "
        f"{t.analysis * 1e3:.0f} ms ({t.analysis_cpu * 1e3:.0f} ms CPU); "
        f"{t.ranks:,} ranks judged; load {load_before:.1f} to {os.getloadavg()[0]:.1f}",
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

"""End to end in the lab's gpu mode: real agents with the CUDA probes record
the ranks' collectives and their device start and completion, then
``analyze`` judges them on the device's timeline.

- gpuslow: a rank whose device is slower (its host is not) is named
  ``compute_straggler`` in at least 9 of 10 seeded 4x2 runs (the slow rank
  drawn from the seed; one host-scope agent records each); on the same
  dumps with the device columns erased, host arrival order names nobody:
  the hosts all wait for their devices in the step's synchronisation, and
  enter the next step together.
- gpuhang: a rank whose device stops has its collective queued everywhere
  and completed nowhere; the verdict names that rank, whose device never
  started it.
"""

from __future__ import annotations

import dataclasses
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.graph_verdicts import graph_fault
from stallwatch.analyzer.pipeline import AnalysisResult, analyze_paths
from stallwatch.analyzer.verdict import VerdictKind
from stallwatch.dumpers.format import read_dump, write_dump
from stallwatch.dumpers.model import Ring
from stallwatch.dumpers.schema import DEVICE_FIELDS, State
from stallwatch.lab.runner import end_dumps

# the hangs are judged on what completed, whatever the machine's load: they
# run on the suite's parallel workers; the runs judged on timing (the slow
# device, a healthy run) run alone (solo)
pytestmark = [pytest.mark.lab, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
SEEDS = range(10)
SLOW_MS = "80"


def lab_run(folder: Path, *args: str, agents: int = 4) -> list[Path]:
    """A 4x2 gpu-mode run, recorded by an agent per node (``agents=4``) or
    by one host-scope agent for the whole job (``agents=1``)."""
    cmd = [sys.executable, "-m", "stallwatch", "lab", "run", "--mode", "gpu"]
    cmd += ["--nodes", "4", "--ranks-per-node", "2", "--steps", "16", "--record"]
    cmd += ["--dump-dir", str(folder), "--stall-timeout", "5", "--timeout", "120", *args]
    cmd += ["--agent-scope", "host"] if agents == 1 else []
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    dumps = sorted(folder.rglob("*.msgpack"))
    if "--dump-at-end" in args:  # an incident the agents raised meanwhile is another one
        dumps = end_dumps(folder)
    assert len(dumps) == agents, f"one dump per agent expected: {dumps}\n{done.stdout}{done.stderr}"
    return dumps


def slow_rank(seed: int) -> int:
    return random.Random(seed).randrange(8)


@pytest.fixture(scope="module")
def gpuslow_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[str]]:
    runs = {}
    for seed in SEEDS:
        folder = tmp_path_factory.mktemp(f"gpuslow-{seed}")
        fault = f"gpuslow:rank={slow_rank(seed)},ms={SLOW_MS}"
        # one host-scope agent records the job: the seeds judge the device's
        # timeline, not the agents (an agent per node: the hang runs below);
        # each run then starts in about half the time
        runs[seed] = [str(p) for p in lab_run(folder, "--dump-at-end", "--fault", fault, agents=1)]
    return runs


def stragglers(result: AnalysisResult) -> set[int]:
    (incident,) = result.incidents
    return {
        r for v in incident.verdicts if v.kind is VerdictKind.COMPUTE_STRAGGLER for r in v.ranks
    }


@pytest.mark.solo
def test_gpuslow_is_the_compute_straggler_in_9_of_10_seeded_runs(
    gpuslow_runs: dict[int, list[str]],
) -> None:
    named = {seed: stragglers(analyze_paths(dumps)) for seed, dumps in gpuslow_runs.items()}
    right = [seed for seed, ranks in named.items() if ranks == {slow_rank(seed)}]
    assert len(right) >= 9, {seed: (slow_rank(seed), ranks) for seed, ranks in named.items()}


def _host_only(dumps: list[Path], out: Path) -> None:
    """The same dumps as an agent without the CUDA probes would have written them."""
    out.mkdir()
    for path in dumps:
        rec = read_dump(path)
        rows = rec.rings["nccl"].rows.copy()
        for name in DEVICE_FIELDS:
            rows[name] = 0
        rows["state"] = np.minimum(rows["state"], State.ENQUEUED)
        ring = rec.rings["nccl"]
        rings = {**rec.rings, "nccl": Ring(rows, ring.overwritten, ring.lost)}
        write_dump(out / path.name, dataclasses.replace(rec, rings=rings))


@pytest.mark.solo
def test_arrival_order_alone_would_not_name_it(
    gpuslow_runs: dict[int, list[str]], tmp_path: Path
) -> None:
    seed = SEEDS[0]
    dumps = [Path(p) for p in gpuslow_runs[seed]]
    assert stragglers(analyze_paths(gpuslow_runs[seed])) == {slow_rank(seed)}
    _host_only(dumps, tmp_path / "host-only")
    assert slow_rank(seed) not in stragglers(analyze_paths([str(tmp_path / "host-only")]))


def test_gpuhang_names_the_rank_whose_device_stopped(tmp_path: Path) -> None:
    lab_run(tmp_path, "--fault", "gpuhang:rank=6,step=7")
    (incident,) = analyze_paths([str(tmp_path)]).incidents
    first = incident.verdicts[0]
    assert first.kind is VerdictKind.MISSING_RANK, [v.summary for v in incident.verdicts]
    assert list(first.ranks) == [6] and list(first.hosts) == ["node3"]


# --- CUDA graphs: each step one launch of a graph of the step's collectives ---

GRAPH_SEED = 3  # the suite runs one seed per fault; bench/graph_verdicts.py runs ten


def missing_ranks(result: AnalysisResult) -> list[int]:
    (incident,) = result.incidents
    first = incident.verdicts[0]
    assert first.kind is VerdictKind.MISSING_RANK, [v.summary for v in incident.verdicts]
    return list(first.ranks)


@pytest.mark.parametrize("kind", ["hang", "gpuhang"])
def test_a_hang_inside_a_graph_replay_names_the_rank(tmp_path: Path, kind: str) -> None:
    """hang: the rank never launches replay k; gpuhang: it launches it and its
    device never starts it.  Either way it is the rank named."""
    rank, fault = graph_fault(kind, GRAPH_SEED)
    lab_run(tmp_path, "--graphs", "--steps", "10", "--fault", fault)
    assert missing_ranks(analyze_paths([str(tmp_path)])) == [rank]


@pytest.mark.solo
def test_a_healthy_graph_run_is_healthy_and_every_replay_completed(tmp_path: Path) -> None:
    dumps = lab_run(tmp_path, "--graphs", "--steps", "10", "--dump-at-end")
    (incident,) = analyze_paths([str(p) for p in dumps]).incidents
    assert [v.kind for v in incident.verdicts] == [VerdictKind.HEALTHY]
    replays = 0
    for path in dumps:
        rows = read_dump(path).rings["nccl"].rows
        replayed = rows[(rows["replay"] > 0) & (rows["op"] <= 10)]  # the collectives and p2p
        replays += len(replayed)
        assert (replayed["completed_ns"] > 0).all() and (replayed["state"] == State.COMPLETED).all()
    # steps x (5 collectives x 8 ranks + the pipeline's sends and receives: 2 x 6)
    assert replays == 10 * (5 * 8 + 2 * 6)

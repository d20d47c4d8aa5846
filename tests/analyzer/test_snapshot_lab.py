"""A job that hung before anyone was recording, on the lab.

A 4x2 lab job hangs first (one rank blocked before the collectives of a step);
only then does anyone look:

- ``stallwatch snapshot`` in every node (``lab run --snapshot-when-stuck``),
  then ``analyze``: exactly the hung rank is named, in at least 9 of 10 seeded
  runs (hung rank and step drawn from the seed), and every other rank is shown
  inside the call it is really blocked in: its node's tensor-parallel partner
  in ``ncclAllGather`` on its tp communicator, every rank of the other nodes in
  the data-parallel ``ncclAllReduce`` on its dp communicator (the handles come
  from the ranks' own reports);
- agents started after the hang (``--record --late-agents``) and asked for a
  snapshot: one incident, the same verdict.
"""

from __future__ import annotations

import json
import random
import secrets
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from stallwatch.lab.job import DEFAULT_ELEMENTS

NODES, PER_NODE = 4, 2
SEEDS = range(10)


@dataclass(frozen=True, slots=True)
class Outcome:
    seed: int
    hung: int
    lab: dict[str, Any]
    analysis: dict[str, Any]


def _run(
    tmp: Path, hung: int, step: int, *extra: str, stall: str = "3"
) -> tuple[dict[str, Any], dict[str, Any]]:
    tmp.mkdir(parents=True, exist_ok=True)
    dumps = tmp / "dumps"
    lab = subprocess.run(
        [sys.executable, "-m", "stallwatch", "lab", "run", "--run-id", "s" + secrets.token_hex(3),
         "--nodes", str(NODES), "--ranks-per-node", str(PER_NODE), "--steps", "40",
         "--fault", f"hang:rank={hung},step={step}", "--stall-timeout", stall,
         "--dump-dir", str(dumps), "--json", *extra],
        capture_output=True, text=True, cwd=tmp, timeout=600, check=False,
    )  # fmt: skip
    assert lab.stdout, lab.stderr
    result = json.loads(lab.stdout)
    assert result["problems"] == [], result["problems"]
    done = subprocess.run(
        [sys.executable, "-m", "stallwatch", "analyze", str(dumps), "--json"],
        capture_output=True, text=True, cwd=tmp, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    return result, json.loads(done.stdout)


def _expected_call(rank: int, hung: int, comms: dict[str, dict[str, Any]]) -> str:
    """What a waiting rank is blocked in when ``hung`` stopped before a step's
    collectives: its tp partner waits in the step's first collective, the
    AllGather; every other node passes its own tp collectives and waits in
    the dp AllReduce (on ``hung`` or on its stuck partner)."""
    if rank // PER_NODE == hung // PER_NODE:
        count, handle = DEFAULT_ELEMENTS // 16, comms["tp"]["handle"]
        return f"ncclAllGather(count={count}, float32, comm={handle})"
    handle = comms["dp"]["handle"]
    return f"ncclAllReduce(count={DEFAULT_ELEMENTS}, float32, sum, comm={handle})"


def _judged_right(o: Outcome) -> list[str]:
    """Why this run's analysis is not exactly right ([] when it is)."""
    incidents = o.analysis["incidents"]
    if len(incidents) != 1:
        return [f"{len(incidents)} incidents"]
    verdicts = incidents[0]["verdicts"]
    wrong = []
    if [(v["kind"], v["ranks"]) for v in verdicts] != [("missing_rank", [o.hung])]:
        wrong.append(f"verdicts {[(v['kind'], v['ranks']) for v in verdicts]}")
        return wrong
    evidence = "\n".join(verdicts[0]["evidence"])
    for r in o.lab["ranks"]:
        rank = r["world_rank"]
        line = next((e for e in verdicts[0]["evidence"] if e.startswith(f"rank {rank} (")), "")
        if rank == o.hung:
            if "inside no NCCL call" not in line:
                wrong.append(f"rank {rank}: {line!r}")
        elif f"inside {_expected_call(rank, o.hung, r['comms'])}" not in line:
            wrong.append(f"rank {rank}: expected {_expected_call(rank, o.hung, r['comms'])}, "
                         f"found {line!r}")  # fmt: skip
    return wrong if wrong or evidence else ["no evidence"]


@pytest.mark.lab
@pytest.mark.slow
def test_snapshots_of_a_job_hung_before_any_agent_name_the_hung_rank(tmp_path: Path) -> None:
    """At least 9 of 10 seeds exactly right, and in none is a waiting rank
    blamed (a seed short of right is inconclusive, never wrong: beside other
    lab jobs a running thread's reading can miss)."""
    outcomes = []
    for seed in SEEDS:
        rng = random.Random(seed)
        hung, step = rng.randrange(NODES * PER_NODE), rng.randrange(1, 5)
        lab, analysis = _run(tmp_path / f"seed{seed}", hung, step, "--snapshot-when-stuck")
        assert len(lab["dumps"]) == NODES, lab["dumps"]
        outcomes.append(Outcome(seed, hung, lab, analysis))
    wrong = {o.seed: w for o in outcomes if (w := _judged_right(o))}
    assert len(wrong) <= 1, wrong  # the target: at least 9 of 10
    blamed = {
        o.seed: sorted(named - {o.hung, None})
        for o in outcomes
        for named in [
            {r for i in o.analysis["incidents"] for v in i["verdicts"] for r in v["ranks"]}
        ]
        if named - {o.hung, None}
    }
    assert blamed == {}, blamed  # a waiting rank is never named


@pytest.mark.lab
@pytest.mark.slow
def test_snapshots_of_a_spinning_job_never_blame_a_waiting_rank(tmp_path: Path) -> None:
    """The same with waiting threads spinning (runnable throughout, as CUDA's
    spin synchronisation and NCCL's busy polling wait), one seed.  A running
    thread's stack is not read from outside (it would have to be stopped), and
    with no recording there is no call in flight to outrank it: those ranks
    are "position unknown", never "inside no NCCL call".  Nothing can name the
    hung rank for certain; no waiting rank is named."""
    rng = random.Random(0)
    hung, step = rng.randrange(NODES * PER_NODE), rng.randrange(1, 5)
    lab, analysis = _run(tmp_path, hung, step, "--snapshot-when-stuck", "--wait", "spin")
    assert len(lab["dumps"]) == NODES, lab["dumps"]
    (incident,) = analysis["incidents"]
    named = {r for v in incident["verdicts"] for r in v["ranks"]}
    assert named <= {hung, None}, incident["verdicts"]
    assert incident["verdicts"][0]["kind"] in ("missing_rank", "inconclusive")
    for e in (e for v in incident["verdicts"] for e in v["evidence"]):
        if e.startswith("rank ") and not e.startswith(f"rank {hung} ("):
            assert "inside no NCCL call" not in e, e


@pytest.mark.lab
@pytest.mark.bpf
@pytest.mark.slow
def test_agents_started_after_the_hang_snapshot_one_incident(tmp_path: Path) -> None:
    hung = 6
    # the agents' stall timeout outlasts their start-up (compiling BPF): the
    # snapshot asked for comes first, and its incident holds every node
    lab, analysis = _run(tmp_path, hung, 2, "--record", "--late-agents", stall="15")
    assert len(lab["dumps"]) >= NODES
    o = Outcome(0, hung, lab, analysis)
    ids = {i["id"] for i in analysis["incidents"]}
    assert f"lab-{lab['run_id']}-snapshot" in ids, ids
    # the verdict exactly; a waiting rank's position may be unknown (a running
    # thread whose stack could not be read, beside other lab jobs: seen once
    # on CI), never another call than the one it waits in
    wrong = [w for w in _judged_right(o) if "position unknown (running, stack not read)" not in w]
    assert wrong == []

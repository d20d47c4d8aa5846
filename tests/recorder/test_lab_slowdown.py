"""The slowdown trigger on the real lab: one 3x2 run, agents recording as
deployed (one per node, the slowdown trigger on with its defaults), rank 0
pausing 1.5 s every 100 steps while the others wait in a barrier (a
checkpoint: healthy), then rank 3 computing 150 ms longer from step 1,200 on
(a compute straggler from mid-run, about 4x slower a step).  Judged by what
``lab run --json`` says of each fault (when it was injected, on the
monotonic clock the agents' triggers are stamped with) and by the dumps:

- the checkpoints raised nothing: the run's one incident came after the fault;
- the incident is a slowdown, raised within 30 s of the fault's start;
- every node dumped it;
- ``analyze`` names rank 3, on node 1, judged on the slow window.

One run (a few minutes on a loaded 2-core machine: the baseline needs 30 s
of steps before the fault, checkpoints included)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from stallwatch.analyzer.pipeline import analyze_paths
from stallwatch.analyzer.verdict import VerdictKind
from stallwatch.dumpers.format import read_dump
from stallwatch.dumpers.model import TriggerKind

ROOT = Path(__file__).resolve().parents[2]
S = 1_000_000_000
SLOW = "slow:rank=3,ms=150,step=1200"
CHECKPOINT = "pause:every=100,ms=1500,rank=0"

pytestmark = [pytest.mark.bpf, pytest.mark.lab, pytest.mark.slow, pytest.mark.solo]


def lab_run(folder: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "stallwatch", "lab", "run", "--json", "--record"]
    cmd += ["--nodes", "3", "--ranks-per-node", "2", "--steps", "1400"]
    cmd += ["--fault", CHECKPOINT, "--fault", SLOW, "--dump-dir", str(folder)]
    cmd += ["--timeout", "600"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=700, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_a_straggler_from_mid_run_is_an_incident_within_30_s_and_checkpoints_none(
    tmp_path: Path,
) -> None:
    run = lab_run(tmp_path)
    faults = {f["spec"]: f for f in run["faults"]}
    slow, checkpoint = faults[SLOW], faults[CHECKPOINT]
    assert slow["injected"] and checkpoint["injected"]
    assert len(checkpoint["episodes"]) >= 10  # checkpoints before the fault

    dumps = sorted(tmp_path.rglob("*.msgpack"))
    recordings = [read_dump(p) for p in dumps]
    assert sorted(r.host for r in recordings) == ["node0", "node1", "node2"], dumps
    incidents = {r.trigger.incident_id for r in recordings if r.trigger is not None}
    assert len(incidents) == 1, incidents  # one incident, and every node dumped it

    raised = [r.trigger for r in recordings if r.trigger and r.trigger.kind is TriggerKind.SLOWDOWN]
    assert raised, [r.trigger for r in recordings]
    first = min(t.time_ns for t in raised)
    # nothing before the fault: the checkpoints raised no incident
    assert first > slow["injected_ns"], (first - slow["injected_ns"]) / S
    assert first - slow["injected_ns"] <= 30 * S, (first - slow["injected_ns"]) / S

    result = analyze_paths([str(tmp_path)])
    (inc,) = result.incidents
    assert inc.incident.slowdown is not None
    v = inc.verdicts[0]
    assert v.kind is VerdictKind.COMPUTE_STRAGGLER, [x.summary for x in inc.verdicts]
    assert v.ranks == (3,) and v.hosts == ("node1",)
    assert any(e.startswith("judged on the slow window") for e in v.evidence)

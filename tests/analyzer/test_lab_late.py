"""Arriving late, on the lab: node 0's agent records from the start, node 1's
is started only when the job is 20 steps in (its communicators were made
before it attached), then node 1's rank hangs.  Real eBPF, real network
namespaces: the late agent's rows carry no communicator id and count their
seq from its attach; the analyzer aligns them and names the hung rank."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stallwatch.dumpers.format import read_dump

pytestmark = [pytest.mark.bpf, pytest.mark.lab, pytest.mark.slow]


@pytest.mark.parametrize("wait", ["block", "spin"])
def test_agents_started_at_different_moments_still_name_the_hung_rank(
    tmp_path: Path, wait: str
) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "stallwatch", "lab", "run", "--json", "--wait", wait,
         "--nodes", "2", "--ranks-per-node", "1", "--steps", "400", "--compute-ms", "20",
         "--record", "--dump-dir", str(tmp_path), "--stall-timeout", "3",
         "--fault", "agentlate:node=1,step=20", "--fault", "hang:rank=1,step=300"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    result = json.loads(run.stdout or "{}")
    assert result.get("dumps"), run.stderr[-3000:]
    late = next(a for a in result["agents"] if a["node"] == 1)
    assert late["faults"] == ["agentlate:node=1,step=20"]
    dumps = {Path(p).parent.name: read_dump(p) for p in result["dumps"]}
    assert sorted(dumps) == ["node0", "node1"], result["dumps"]
    # node 1's agent never saw the communicators made: no ids, seq from its attach
    unknown = [c for c in dumps["node1"].communicators if not c.comm_hash]
    assert unknown and all(c.init_ns == 0 for c in unknown), dumps["node1"].communicators
    rows = dumps["node1"].rings["nccl"].rows
    assert (rows["comm_hash"] == 0).any() and rows["seq"].min() == 0
    proc = subprocess.run(
        [sys.executable, "-m", "stallwatch", "analyze", str(tmp_path), "--json"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    [incident] = json.loads(proc.stdout)["incidents"]
    verdict = incident["verdicts"][0]
    hung = next(r for r in result["ranks"] if r["world_rank"] == 1)
    assert verdict["kind"] == "missing_rank", incident["verdicts"]
    assert verdict["ranks"] == [1] and verdict["pids"] == [hung["pid"]], verdict
    assert verdict["hosts"] == ["node1"]
    assert any("recorded from its agent's attach" in e for e in verdict["evidence"]), verdict

"""Chaos on the lab: what the recorder goes through while a job runs.

Each node's agent runs under the lab's systemd-style supervision (what the
unit says: memory bound, notify watchdog, restart on failure) and pins its
recording.  Real eBPF, real network namespaces, real kills:

- an agent SIGKILLed mid-job and another killed by its cgroup's memory bound
  are restarted, take over their pinned recordings, and when a rank then
  hangs, the dumps hold every call from before, during and after the
  absence, and the verdict names the hung rank;
- an agent restarted while a hang is in progress, after its dump or before
  it, leaves one dump per node, all under one incident id.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stallwatch.dumpers.format import read_dump
from stallwatch.dumpers.model import Recording

pytestmark = [pytest.mark.bpf, pytest.mark.lab, pytest.mark.slow]


def lab_run(*args: str, timeout: float = 600) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "stallwatch", "lab", "run", "--json", *args],
        capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    if not proc.stdout.strip():
        pytest.fail(f"lab run {' '.join(args)} printed nothing: {proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout)
    assert not result["problems"], result["problems"]
    return result


def analyze(dump_dir: Path) -> list[dict[str, Any]]:
    proc = subprocess.run(
        [sys.executable, "-m", "stallwatch", "analyze", str(dump_dir), "--json"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr  # findings
    incidents: list[dict[str, Any]] = json.loads(proc.stdout)["incidents"]
    return incidents


def dumps_by_node(result: dict[str, Any]) -> dict[int, list[Recording]]:
    out: dict[int, list[Recording]] = {}
    for path in result["dumps"]:
        node = int(Path(path).parent.name.removeprefix("node"))
        out.setdefault(node, []).append(read_dump(path))
    return out


def events(result: dict[str, Any], node: int) -> list[dict[str, Any]]:
    [agent] = [a for a in result["agents"] if a["node"] == node]
    found: list[dict[str, Any]] = agent["events"]
    return found


def absence(result: dict[str, Any], node: int) -> tuple[int, int]:
    """(killed, back): when the node's agent died, and when the next said READY."""
    evs = events(result, node)
    died = next(e["at_ns"] for e in evs if e["kind"] == "exited")
    back = next(e["at_ns"] for e in evs if e["kind"] == "ready" and e["at_ns"] > died)
    return died, back


def node_pids(result: dict[str, Any], node: int) -> list[int]:
    return [r["pid"] for r in result["ranks"] if r["node"] == node]


def test_killed_and_out_of_memory_agents_come_back_and_the_hang_is_named(
    tmp_path: Path,
) -> None:
    # both agents are back about 10 steps after their faults (1-2 s; the
    # timeline of a quiet run: killed at steps 5 and 10, ready again by step
    # ~21): the hang at step 150 leaves them many times that to record on
    result = lab_run(
        "--nodes", "2", "--ranks-per-node", "2", "--steps", "200", "--compute-ms", "50",
        "--record", "--dump-dir", str(tmp_path), "--stall-timeout", "3",
        "--fault", "agentkill:node=1,step=5",
        "--fault", "agentoom:node=0,step=10",
        "--fault", "hang:rank=3,step=150",
    )  # fmt: skip
    assert result["stuck_ranks"], result
    # the supervisor restarted both agents: one SIGKILLed, one by its memory bound
    kinds = {n: [e["kind"] for e in events(result, n)] for n in (0, 1)}
    assert all(k.count("started") == 2 and k.count("ready") == 2 for k in kinds.values()), kinds
    oom = next(e for e in events(result, 0) if e["kind"] == "exited")
    assert "killed by its memory bound" in oom["detail"], oom
    kill = next(e for e in events(result, 1) if e["kind"] == "exited")
    assert kill["detail"] == "signal SIGKILL", kill
    dumps = dumps_by_node(result)
    assert sorted(dumps) == [0, 1] and all(len(d) == 1 for d in dumps.values()), result["dumps"]
    for node in (0, 1):
        died, back = absence(result, node)
        rows = dumps[node][0].rings["nccl"].rows
        for pid in node_pids(result, node):
            ts = rows["ts_ns"][rows["pid"] == pid].astype(np.int64)
            before, during, after = (
                (ts < died).sum(),
                ((ts > died) & (ts < back)).sum(),
                (ts > back).sum(),
            )
            assert before > 0 and during > 0 and after > 0, (node, pid, before, during, after)
            assert len(np.unique(rows["pos"][rows["pid"] == pid])) == len(ts)  # nothing twice
    [incident] = analyze(tmp_path)
    verdict = incident["verdicts"][0]
    assert verdict["kind"] == "missing_rank" and verdict["ranks"] == [3], verdict
    assert verdict["hosts"] == ["node1"]


def one_incident_per_node(result: dict[str, Any]) -> str:
    dumps = dumps_by_node(result)
    assert sorted(dumps) == [0, 1], result["dumps"]
    assert all(len(d) == 1 for d in dumps.values()), result["dumps"]
    ids = {d[0].trigger.incident_id for d in dumps.values() if d[0].trigger is not None}
    assert len(ids) == 1, ids
    return ids.pop()


@pytest.mark.parametrize("after", ["8", "0.5"], ids=["after-its-dump", "before-its-dump"])
def test_an_agent_restarted_during_a_hang_dumps_it_once_under_one_id(
    tmp_path: Path, after: str
) -> None:
    """After its dump, the restarted agent takes up its watchdog's pinned
    state and stays in the incident's cool-down; before it, the restarted
    agent writes the node's one dump, under the same id as the peer's: a
    restart over its own pins compiles nothing and takes a fraction of a
    second, so which agent notices first depends on the machine's timing
    (the peer's notice relabels it, or comes under it, or the restarted
    agent's own watchdog raises the incident and the peer takes its id; the
    relabel itself is held by test_watchdog and test_restart)."""
    result = lab_run(
        "--nodes", "2", "--ranks-per-node", "2", "--steps", "60", "--compute-ms", "20",
        "--record", "--dump-dir", str(tmp_path), "--stall-timeout", "3",
        "--fault", "hang:rank=3,step=20",
        "--fault", f"agentkill:node=0,step=20,after={after}",
    )  # fmt: skip
    kinds = [e["kind"] for e in events(result, 0)]
    assert kinds.count("started") == 2 and kinds.count("ready") == 2, kinds
    one_incident_per_node(result)
    log = (tmp_path / "node0.agent.log").read_text()
    if after == "8":
        assert "in cool-down, not dumping" in log, log[-3000:]
    else:
        restarted = log[log.rindex("adopted the pinned recording") :]
        assert "dump written to" in restarted, log[-3000:]
    [incident] = analyze(tmp_path)
    verdict = incident["verdicts"][0]
    assert verdict["kind"] == "missing_rank" and verdict["ranks"] == [3], verdict


def test_an_agent_gone_for_good_leaves_a_recording_dump_pinned_reads(tmp_path: Path) -> None:
    """Node 1's agent is SIGKILLed at step 5 and not restarted; rank 3 (on
    node 1) hangs at step 60.  With no agent on node 1, `stallwatch dump
    --pinned` there writes its dump from what the kernel recorded alone, and
    `analyze` names rank 3 from it and node 0's agent's dump."""
    result = lab_run(
        "--nodes", "2", "--ranks-per-node", "2", "--steps", "200", "--compute-ms", "50",
        "--record", "--dump-dir", str(tmp_path), "--stall-timeout", "3",
        "--fault", "agentgone:node=1,step=5",
        "--fault", "hang:rank=3,step=60",
    )  # fmt: skip
    assert result["stuck_ranks"], result
    kinds = [e["kind"] for e in events(result, 1)]
    assert kinds.count("started") == 1 and "exited" in kinds, kinds
    died = next(e["at_ns"] for e in events(result, 1) if e["kind"] == "exited")
    dumps = dumps_by_node(result)
    assert sorted(dumps) == [0, 1] and all(len(d) == 1 for d in dumps.values()), result["dumps"]
    pinned = dumps[1][0]
    assert pinned.trigger is not None and "agent is gone" in pinned.trigger.reason
    rows = pinned.rings["nccl"].rows
    for pid in node_pids(result, 1):
        ts = rows["ts_ns"][rows["pid"] == pid].astype(np.int64)
        assert (ts < died).sum() > 0 and (ts > died).sum() > 0, (pid, len(ts))
    [incident] = analyze(tmp_path)
    verdict = incident["verdicts"][0]
    assert verdict["kind"] == "missing_rank" and verdict["ranks"] == [3], verdict
    assert verdict["hosts"] == ["node1"]

"""The recorder on the lab's training job (real processes, real TCP between
network namespaces, the lab's libnccl.so.2).

- Call accounting: an agent in this process (host scope) records a healthy
  2-node job; every rank's rows are counted against what the rank says it
  called, with op, rank, nranks, seq and communicator ids checked - blocking
  and async.
- Faults with ``--record``: one agent per node (``--scope netns``), dumps
  written on the stall; packet loss on one node shows as retransmits owned by
  that node's ranks, a CPU hog as run-queue delay, a crash as an exit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stallwatch.dumpers.format import read_dump
from stallwatch.dumpers.model import Recording
from stallwatch.dumpers.schema import NCCL_SYMBOLS, State, TcpEvent
from stallwatch.recorder.agent import Agent, AgentConfig
from stallwatch.recorder.source import BccSource

pytestmark = [pytest.mark.bpf, pytest.mark.lab]
# a start and a completion are stamped by probes on two threads: the start's
# probe, racing the completion's, may stamp a moment after it
RACE_NS = 1_000_000


def lab_run(*args: str, timeout: float = 240) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "stallwatch", "lab", "run", "--json", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if not proc.stdout.strip():
        pytest.fail(f"lab run {' '.join(args)} printed nothing: {proc.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


@pytest.fixture(scope="module")
def lab_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    from stallwatch.lab.build import ensure_built, ensure_cudart

    lib = ensure_built()
    agent = Agent(
        AgentConfig(dump_dir=tmp_path_factory.mktemp("dumps")), BccSource(1 << 16, 1_000_000)
    )
    agent.attach_library(str(lib), required=True)
    agent.attach_library(str(ensure_cudart()), required=True)
    yield agent
    agent.close()


def _expected_ops(calls: dict[str, dict[str, int]]) -> Counter[int]:
    want: Counter[int] = Counter()
    for symbol, per_label in calls.items():
        if symbol in NCCL_SYMBOLS:
            want[NCCL_SYMBOLS[symbol]] += sum(per_label.values())
    return want


def _check_rank(rows: np.ndarray, rank: dict[str, Any]) -> dict[str, int]:
    """One rank's rows against its own account; returns label -> hash seen."""
    got = Counter(int(o) for o in rows["op"])
    assert got == _expected_ops(rank["calls"]), f"rank {rank['world_rank']}"
    assert (rows["state"] == State.ENQUEUED).all() and (rows["result"] == 0).all()
    seen = {}
    for label, comm in rank["comms"].items():
        h = int(comm["id_hash"], 16)
        mine = rows[(rows["comm_hash"] == h) & np.isin(rows["op"], list(range(1, 9)))]
        assert len(mine), f"rank {rank['world_rank']}: no collective on {label}"
        assert list(mine["seq"]) == list(range(len(mine))), f"seq on {label}"
        if label == "world":  # splits: rank and nranks are the analyzer's to derive
            assert set(mine["rank"]) == {comm["rank"]}
            assert set(mine["nranks"]) == {comm["nranks"]}
        seen[label] = h
    return seen


@pytest.mark.parametrize("mode", ["blocking", "async"])
def test_one_row_per_call_with_ranks_seq_and_comm_ids(lab_agent: Agent, mode: str) -> None:
    result = lab_run("--nodes", "2", "--ranks-per-node", "2", "--steps", "6", "--mode", mode)
    assert result["ok"], result
    rec = lab_agent.recording()
    rows = rec.rings["nccl"].rows
    hashes: dict[str, set[int]] = {}
    for rank in result["ranks"]:
        seen = _check_rank(rows[rows["pid"] == rank["pid"]], rank)
        for label, h in seen.items():
            hashes.setdefault(label, set()).add(h)
    world = hashes.pop("world")
    assert len(world) == 1  # the same id on every rank
    split_ids = set().union(*hashes.values())
    assert not world & split_ids  # and different between communicators
    assert all(len(v) <= 2 for v in hashes.values())  # tp/dp: one id per group


def _device_rows(rows: np.ndarray, rank: dict[str, Any]) -> list[tuple[np.void, dict[str, Any]]]:
    """Each collective row of a rank with the rank's own log of that call:
    the n-th collective on a communicator is its n-th logged "coll" work."""
    pairs = []
    for label, comm in rank["comms"].items():
        h = int(comm["id_hash"], 16)
        mine = rows[(rows["comm_hash"] == h) & np.isin(rows["op"], list(range(1, 9)))]
        works = [w for w in rank["device_log"] if w["label"] == label and w["kind"] == "coll"]
        assert len(mine) == len(works), f"rank {rank['world_rank']} {label}"
        pairs += zip(np.sort(mine, order="seq"), works, strict=True)
    return pairs


def test_gpu_mode_completion_lies_between_return_and_the_next_observation(
    lab_agent: Agent,
) -> None:
    """Every collective's device completion, taken by the kernel from the
    runtime's event and stream calls, is after the call returned and no later
    than the first successful poll or synchronisation the rank itself saw."""
    result = lab_run("--nodes", "2", "--ranks-per-node", "2", "--steps", "10", "--mode", "gpu")
    assert result["ok"], result
    rows = lab_agent.recording().rings["nccl"].rows
    pairs = [
        p for rank in result["ranks"] for p in _device_rows(rows[rows["pid"] == rank["pid"]], rank)
    ]
    assert len(pairs) == 4 * 10 * 5
    completed = [(row, work) for row, work in pairs if row["completed_ns"]]
    assert len(completed) >= 0.99 * len(pairs)
    for row, work in completed:
        assert row["state"] == State.COMPLETED
        assert row["end_ns"] <= row["completed_after_ns"] < row["completed_ns"]
        assert row["completed_ns"] <= work["seen_ns"], (row, work)
        if row["started_ns"]:  # a start is seen before the completion, or in a race with it
            assert row["ts_ns"] <= row["started_after_ns"] < row["started_ns"]
            assert row["started_ns"] <= row["completed_ns"] + RACE_NS, row
    # every start the rank's watchdog saw before the step's synchronisation
    # began is in its row; one seen only after a synchronisation covered the
    # call tells no more than its completion, and is not kept (bpf/cuda.c,
    # mark_started): at a job's last step the watchdog often looks late
    told = [
        (row, work)
        for row, work in pairs
        if work["started_seen_ns"]
        and (not work["sync_entered_ns"] or work["started_seen_ns"] < work["sync_entered_ns"])
    ]
    missed = [
        (int(row["pid"]), int(row["seq"]), work) for row, work in told if not row["started_ns"]
    ]
    assert missed == [], missed[:5]
    # the watchdog polls start events too; on a loaded machine it often gets
    # a CPU only after the step's synchronisation (94 of 200 on a CI run):
    # what is asked is that the check above had starts to check
    assert len(told) >= len(pairs) // 10


def _dumps_by_node(result: dict[str, Any]) -> dict[int, Recording]:
    out: dict[int, Recording] = {}
    for path in result["dumps"]:
        node = int(Path(path).parent.name.removeprefix("node"))
        out[node] = read_dump(path)
    return out


def _node_pids(result: dict[str, Any], node: int) -> set[int]:
    return {r["pid"] for r in result["ranks"] if r["node"] == node and r["pid"]}


def test_faults_recorded_by_the_node_they_hit(tmp_path: Path) -> None:
    """Node 1 loses packets and rank 3 (node 1) shares its CPU with a hog;
    rank 0 crashes at step 6: every agent dumps that incident.  The lab drops
    node 1's packets in both directions, so node 0's sockets to node 1 may
    retransmit too; what must hold is that each node's retransmits are its
    own sockets', never the other node's ranks'.  The stall timeout is long:
    on a loaded machine 10% loss can hold one collective for more than 10 s
    (timeouts backing off to seconds), and a stall dumped before step 6
    would be another incident than the one this test reads."""
    result = lab_run(
        "--nodes", "2", "--ranks-per-node", "2", "--steps", "10", "--record",
        "--dump-dir", str(tmp_path), "--stall-timeout", "40",
        "--fault", "loss:node=1,pct=10",
        "--fault", "cpuhog:rank=3",
        "--fault", "crash:rank=0,step=6,signal=KILL",
    )  # fmt: skip
    dumps = _dumps_by_node(result)
    assert set(dumps) == {0, 1}, result["dumps"]
    pids = {n: _node_pids(result, n) for n in (0, 1)}
    for node, rec in dumps.items():
        recorded = {int(p) for p in rec.rings["nccl"].rows["pid"]}
        assert recorded == pids[node], f"node {node} recorded {recorded}, ranks {pids[node]}"
        tcp = rec.rings["tcp"].rows
        retrans = tcp[tcp["event"] == TcpEvent.TCP_RETRANSMIT_SKB]
        owners = {int(p) for p in retrans["pid"]} - {0}
        # Other processes of the node (its agent's peer requests) may own some.
        assert not owners & pids[1 - node], f"node {node}: retransmits of the other node's ranks"
        if node == 1:
            assert owners & pids[1], "node 1: no retransmit attributed to a rank"
    rank3 = next(r["pid"] for r in result["ranks"] if r["world_rank"] == 3)
    sched1 = dumps[1].rings["sched"].rows
    assert (sched1["pid"] == rank3).sum() > 0, "no run-queue delay for the hogged rank"
    assert set(int(p) for p in dumps[0].rings["sched"].rows["pid"]) <= pids[0]
    rank0 = next(r["pid"] for r in result["ranks"] if r["world_rank"] == 0)
    (proc0,) = [p for p in dumps[0].processes if p.pid == rank0]
    assert proc0.exit_signal == 9
    assert all(p.pid in pids[1] for p in dumps[1].processes)
    # each dump read its node's threads when it was made (the ranks a crash
    # ended may be gone by then: read or not, none of another node's)
    for node, rec in dumps.items():
        last = rec.snapshots[-1]
        assert rec.trigger is not None and last.reason == "dump"
        assert last.taken_ns >= rec.trigger.time_ns
        assert {p.pid for p in last.processes} <= pids[node]

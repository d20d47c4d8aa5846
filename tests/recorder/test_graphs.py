"""The recorder on CUDA graphs (real eBPF, the lab's libnccl.so.2 and
libcudart.so.12): two ranks as threads of one process capture an AllReduce
and a Broadcast each into a graph, launch it three times between a start and
an end event, then make one AllReduce outside the graph.

What the rings must hold: the captured calls once, as captured (no seq,
never completed); one launch row per launch; per launch, one row per
captured call in capture order, with its communicator's next seq, completed
by the event after the launch; the call after the replays numbered after
them."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from stallwatch.dumpers.schema import Op, State, captured_rows
from stallwatch.dumpers.sqltables import tables
from stallwatch.recorder.agent import Agent, AgentConfig
from stallwatch.recorder.source import BccSource

pytestmark = [pytest.mark.bpf, pytest.mark.lab]

LAUNCHES = 3

DRIVER = """
import os, sys
import numpy as np
from stallwatch.dumpers.schema import DataType, RedOp
from stallwatch.lab.cudart import LabCudart
from stallwatch.lab.nccl import LabNccl

nccl, rt = LabNccl(sys.argv[1]), LabCudart(sys.argv[2])
launches = int(sys.argv[3])
comms = nccl.comm_init_all(2)
streams = [rt.stream_create(non_blocking=True) for _ in comms]
bufs = [np.zeros(64, np.float32) for _ in comms]
for s in streams:
    rt.begin_capture(s)
with nccl.group():
    for k, comm in enumerate(comms):
        nccl.all_reduce(bufs[k], bufs[k], 64, DataType.FLOAT32, RedOp.SUM, comm, streams[k])
with nccl.group():
    for k, comm in enumerate(comms):
        nccl.broadcast(bufs[k], bufs[k], 64, DataType.FLOAT32, 0, comm, streams[k])
execs = [rt.graph_instantiate(rt.end_capture(s)) for s in streams]
start = [rt.event_create(disable_timing=True) for _ in comms]
end = [rt.event_create(disable_timing=True) for _ in comms]
for _ in range(launches):
    for k in range(2):
        rt.event_record(start[k], streams[k])
        rt.graph_launch(execs[k], streams[k])
        rt.event_record(end[k], streams[k])
    for e in end:
        rt.event_synchronize(e)
with nccl.group():
    for k, comm in enumerate(comms):
        nccl.all_reduce(bufs[k], bufs[k], 64, DataType.FLOAT32, RedOp.SUM, comm, streams[k])
for s in streams:
    rt.stream_synchronize(s)
print(os.getpid(), " ".join(hex(e) for e in execs))
"""


@pytest.fixture(scope="module")
def graph_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    from stallwatch.lab.build import ensure_built, ensure_cudart

    agent = Agent(
        AgentConfig(dump_dir=tmp_path_factory.mktemp("dumps")), BccSource(1 << 16, 1_000_000)
    )
    agent.attach_library(str(ensure_built()), required=True)
    agent.attach_library(str(ensure_cudart()), required=True)
    yield agent
    agent.close()


def _drive(agent: Agent) -> tuple[int, list[int], np.ndarray, object]:
    from stallwatch.lab.build import ensure_built, ensure_cudart

    root = Path(__file__).resolve().parent.parent.parent
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(DRIVER), str(ensure_built()),
         str(ensure_cudart()), str(LAUNCHES)],
        check=True, capture_output=True, text=True, timeout=120, cwd=root,
    ).stdout.split()  # fmt: skip
    rec = agent.recording()
    rows = rec.rings["nccl"].rows
    pid = int(out[0])
    return pid, [int(x, 16) for x in out[1:]], rows[rows["pid"] == pid], rec


def test_a_graph_is_recorded_once_captured_and_once_per_launch(graph_agent: Agent) -> None:
    pid, execs, rows, rec = _drive(graph_agent)
    data = rows[np.isin(rows["op"], [Op.ALL_REDUCE, Op.BROADCAST])]
    captured = data[captured_rows(data)]
    assert sorted(Op(o).name for o in captured["op"]) == ["ALL_REDUCE"] * 2 + ["BROADCAST"] * 2
    assert (captured["state"] == State.ENQUEUED).all() and not captured["completed_ns"].any()
    assert len(set(captured["graph"])) == 2  # one capture per stream
    launches = rows[rows["op"] == Op.GRAPH_LAUNCH]
    assert len(launches) == 2 * LAUNCHES and set(launches["comm"]) == set(execs)
    assert (launches["result"] == 0).all() and set(launches["count"]) == {2}
    for comm in set(data["comm"]):
        mine = data[(data["comm"] == comm) & ~captured_rows(data)]
        replays = mine[mine["replay"] > 0]
        assert list(replays["replay"]) == [1, 1, 2, 2, 3, 3]
        assert [Op(o).name for o in replays["op"]] == ["ALL_REDUCE", "BROADCAST"] * LAUNCHES
        assert list(replays["graph_node"]) == [1, 2] * LAUNCHES
        assert list(mine["seq"]) == list(range(2 * LAUNCHES + 1))  # the last one made after
        assert (replays["state"] == State.COMPLETED).all()
        # completed by the event after its launch: between the launch's return and the sync's
        assert (replays["completed_ns"] >= replays["end_ns"]).all()
    assert rec is not None and pid > 0


def test_the_tables_show_replays_as_calls_and_captures_in_cuda_graphs(graph_agent: Agent) -> None:
    pid, _, _, rec = _drive(graph_agent)
    t = tables(rec)  # type: ignore[arg-type]
    graphs = t["cuda_graphs"].drop_columns(["wall_time"]).to_pylist()
    mine = [g for g in graphs if g["pid"] == pid]
    assert sorted((g["graph_node"], g["op"]) for g in mine) == [
        (1, "ALL_REDUCE"), (1, "ALL_REDUCE"), (2, "BROADCAST"), (2, "BROADCAST")
    ]  # fmt: skip
    assert {g["launches"] for g in mine} == {LAUNCHES}
    calls = [c for c in t["nccl_events"].drop_columns(["wall_time"]).to_pylist() if c["pid"] == pid]
    replayed = [c for c in calls if c["replay"] is not None and c["op"] != "GRAPH_LAUNCH"]
    assert len(replayed) == 2 * 2 * LAUNCHES
    assert all(c["completed_ns"] is not None and c["seq"] is not None for c in replayed)
    made = [c for c in calls if c["op"] == "ALL_REDUCE" and c["graph"] is None]
    assert len(made) == 2 and {c["seq"] for c in made} == {2 * LAUNCHES}

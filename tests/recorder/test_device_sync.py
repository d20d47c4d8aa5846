"""The per-thread default stream and cudaDeviceSynchronize as observations
of completion (real eBPF, the lab's libnccl.so.2 and libcudart.so.12).

Two threads of one process each make an AllReduce on ``cudaStreamPerThread``
(each its own stream).  One thread synchronises its per-thread stream: its
call is complete, the other thread's is not (the same handle names another
stream there).  Then ``cudaDeviceSynchronize``: the other one is complete
too."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from stallwatch.dumpers.schema import Op, State
from stallwatch.recorder.agent import Agent, AgentConfig
from stallwatch.recorder.source import BccSource

pytestmark = [pytest.mark.bpf, pytest.mark.lab]

DRIVER = """
import os, sys, threading
import numpy as np
from stallwatch.dumpers.schema import DataType, RedOp
from stallwatch.lab.cudart import LabCudart
from stallwatch.lab.nccl import LabNccl

PER_THREAD = 2  # cudaStreamPerThread
nccl, rt = LabNccl(sys.argv[1]), LabCudart(sys.argv[2])
comms = [nccl.comm_init_all(1)[0] for _ in range(2)]
bufs = [np.ones(64, np.float32) for _ in range(2)]
tids = [0, 0]
called = threading.Barrier(3)

def work(k):
    tids[k] = threading.get_native_id()
    nccl.all_reduce(bufs[k], bufs[k], 64, DataType.FLOAT32, RedOp.SUM, comms[k], PER_THREAD)
    if k == 0:
        rt.stream_synchronize(PER_THREAD)  # this thread's stream only
    called.wait()

threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
for t in threads:
    t.start()
called.wait()
print(os.getpid(), tids[0], tids[1], flush=True)
sys.stdin.readline()
assert rt.raw("cudaDeviceSynchronize") == 0
print("synced", flush=True)
sys.stdin.readline()
"""


@pytest.fixture(scope="module")
def cuda_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    from stallwatch.lab.build import ensure_built, ensure_cudart

    agent = Agent(
        AgentConfig(dump_dir=tmp_path_factory.mktemp("dumps")), BccSource(1 << 16, 1_000_000)
    )
    agent.attach_library(str(ensure_built()), required=True)
    agent.attach_library(str(ensure_cudart()), required=True)
    yield agent
    agent.close()


def _allreduces(agent: Agent, pid: int) -> dict[int, np.void]:
    rows = agent.recording().rings["nccl"].rows
    mine = rows[(rows["pid"] == pid) & (rows["op"] == Op.ALL_REDUCE)]
    return {int(r["tid"]): r for r in mine}


def test_per_thread_streams_apart_and_a_device_sync_completes_them_all(
    cuda_agent: Agent,
) -> None:
    from stallwatch.lab.build import ensure_built, ensure_cudart

    root = Path(__file__).resolve().parent.parent.parent
    with subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(DRIVER), str(ensure_built()), str(ensure_cudart())],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=root,
    ) as proc:  # fmt: skip
        assert proc.stdin is not None and proc.stdout is not None
        pid, synced_tid, other_tid = map(int, proc.stdout.readline().split())
        before = _allreduces(cuda_agent, pid)
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "synced\n"
        after = _allreduces(cuda_agent, pid)
        proc.communicate("\n", timeout=30)
    assert set(before) == {synced_tid, other_tid}
    assert before[synced_tid]["state"] == State.COMPLETED  # its own stream's sync
    assert before[other_tid]["state"] == State.ENQUEUED  # another thread's stream: not seen
    assert after[other_tid]["state"] == State.COMPLETED  # the device sync covers it
    done = after[other_tid]
    assert done["completed_after_ns"] <= done["completed_ns"]
    assert done["completed_after_ns"] >= done["end_ns"] > 0

"""The agent on the real CUDA runtimes: ``libcudart.so.12`` of the
nvidia-cuda-runtime-cu12 wheel and ``libcudart.so.13`` of nvidia-cuda-runtime
13.x, beside the real ``libnccl.so.2``.

No GPU here: every runtime call fails with the runtime's documented code
(``cudaErrorInsufficientDriver``, 35, with no driver installed).  The agent
attaches to every stream and event function we probe (each begins with
``push``), sees each call and its answer, and a failed query or
synchronisation completes nothing: the NCCL call stays enqueued.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from stallwatch.dumpers.schema import CUDA_SYMBOLS, Op, Result, State
from stallwatch.recorder.agent import Agent, AgentConfig
from stallwatch.recorder.source import BccSource

pytestmark = [pytest.mark.bpf, pytest.mark.realnccl]

INSUFFICIENT_DRIVER = 35


def _real_libcudart(major: int) -> Path:
    try:
        import nvidia  # type: ignore[import-not-found]
    except ImportError:
        pytest.fail("no nvidia wheels installed (pip install nvidia-cuda-runtime-cu12 ...)")
    folder = "cuda_runtime" if major == 12 else f"cu{major}"
    for base in nvidia.__path__:
        lib = Path(base) / folder / "lib" / f"libcudart.so.{major}"
        if lib.exists():
            return lib
    wheel = "nvidia-cuda-runtime-cu12" if major == 12 else f"nvidia-cuda-runtime=={major}.*"
    pytest.fail(f"libcudart.so.{major} not found: pip install '{wheel}'")


DRIVER = """
import ctypes, os, sys
nccl = ctypes.CDLL(sys.argv[1])
rt = ctypes.CDLL(sys.argv[2])
stream, event = ctypes.c_void_p(0x5157), ctypes.c_void_p(0xE7E)
codes = [nccl.ncclAllReduce(None, None, ctypes.c_size_t(10), 7, 0, None, stream)]
codes += [rt.cudaEventRecord(event, stream), rt.cudaEventQuery(event),
          rt.cudaEventSynchronize(event), rt.cudaStreamSynchronize(stream),
          rt.cudaStreamQuery(stream)]
print(os.getpid(), *codes)
"""


@pytest.mark.parametrize("major", [12, 13])
def test_agent_attaches_the_real_runtime_and_sees_its_error_codes(
    tmp_path: Path, major: int, real_libnccl: Path
) -> None:
    nccl, cudart = real_libnccl, _real_libcudart(major)
    agent = Agent(AgentConfig(dump_dir=tmp_path), BccSource(1024, 1_000_000))
    try:
        agent.attach_library(str(nccl), required=True)
        attached = agent.attach_library(str(cudart), required=True)
        assert attached is not None and attached.skipped == ()
        assert set(attached.symbols) == set(CUDA_SYMBOLS)
        assert all(i.startswith("push") for i in attached.first_instructions.values())
        before = agent.source.kernel_counters()
        out = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(DRIVER), str(nccl), str(cudart)],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout.split()
        after = agent.source.kernel_counters()
        rec = agent.recording()
    finally:
        agent.close()
    pid, codes = int(out[0]), [int(c) for c in out[1:]]
    assert codes == [Result.INVALID_ARGUMENT] + [INSUFFICIENT_DRIVER] * 5
    seen = {k: after[k] - before.get(k, 0) for k in after if k.startswith("cuda_")}
    assert seen["cuda_event_records"] >= 1
    assert seen["cuda_answers_error"] >= 4  # two queries and two syncs, all refused
    assert seen["cuda_answers_done"] == 0
    rows = rec.rings["nccl"].rows
    (row,) = rows[rows["pid"] == pid]
    assert Op(row["op"]) is Op.ALL_REDUCE and row["stream"] == 0x5157
    assert row["result"] == Result.INVALID_ARGUMENT
    assert row["state"] == State.ENQUEUED and row["completed_ns"] == 0 == row["started_ns"]


HOLD = (
    "import ctypes, sys; [ctypes.CDLL(p) for p in sys.argv[1:]]; print('up', flush=True); input()"
)


@pytest.mark.parametrize("major", [12, 13])
def test_discovery_finds_the_runtime_beside_nccl_and_only_there(major: int) -> None:
    from stallwatch.lab.build import ensure_built
    from stallwatch.recorder import discovery

    nccl, cudart = ensure_built(), _real_libcudart(major)
    found = {}
    for libs in ((nccl, cudart), (cudart,)):
        with subprocess.Popen(
            [sys.executable, "-c", HOLD, *map(str, libs)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        ) as proc:
            assert proc.stdout is not None and proc.stdout.readline() == "up\n"
            found[len(libs)] = discovery.mapped_nccl_libs(proc.pid)
            proc.communicate("\n", timeout=30)
    assert found[2] is not None and {Path(p).name for p in found[2]} == {
        "libnccl.so.2",
        f"libcudart.so.{major}",
    }
    assert found[1] == ()  # a runtime without NCCL is no rank of ours

"""The lab's CUDA runtime (``libcudart.so.12``): CUDA's codes for unfinished
and finished work, in-order streams on host threads, events across streams,
and the lab's libnccl running collectives on the stream it is given."""

from __future__ import annotations

import ctypes
import re
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from stallwatch.dumpers.schema import DataType, RedOp, Result
from stallwatch.lab.build import cudart_path, ensure_built, ensure_cudart
from stallwatch.lab.cudart import FOREVER, CaptureStatus, CudaError, CudaResult, LabCudart
from stallwatch.lab.nccl import LabNccl, NcclError

MS = 1_000_000


@pytest.fixture(scope="module")
def rt() -> LabCudart:
    return LabCudart(ensure_cudart())


def _exports(lib: Path) -> dict[str, str]:
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True)
    return {
        f[2].split("@")[0]: f[2] for f in map(str.split, out.stdout.splitlines()) if len(f) == 3
    }


def _first_instructions(lib: Path) -> dict[str, str]:
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(lib)], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    pattern = r"^[0-9a-f]+ <([A-Za-z0-9_]+)>:\n\s+[0-9a-f]+:\s+(.+)$"
    return {m.group(1): m.group(2).strip() for m in re.finditer(pattern, out, re.M)}


def test_exports_carry_the_runtime_symbol_version_and_begin_with_push() -> None:
    lib = ensure_cudart()
    syms = _exports(lib)
    names = ("cudaEventRecord", "cudaEventQuery", "cudaStreamSynchronize",
             "cudaStreamSynchronize_ptsz", "cudaEventSynchronize",
             "cudaLaunchHostFunc")  # fmt: skip
    for name in names:
        assert syms.get(name) == f"{name}@@libcudart.so.12", syms.get(name)
    assert not {s for s in syms if not s.startswith(("cuda", "lab", "libcudart"))}
    first = _first_instructions(lib)
    wrong = {s: first.get(s) for s in syms if s.startswith(("cuda", "lab"))
             and not (first.get(s) or "").startswith("push   %rbp")}  # fmt: skip
    assert not wrong


def test_unfinished_work_is_not_ready_and_finished_work_is_success(rt: LabCudart) -> None:
    s = rt.stream_create()
    done = rt.event_create(disable_timing=True)
    assert rt.event_query(done) == CudaResult.SUCCESS  # never recorded: complete
    rt.launch_kernel(s, 150 * MS)
    rt.event_record(done, s)
    assert rt.event_query(done) == CudaResult.NOT_READY
    assert rt.stream_query(s) == CudaResult.NOT_READY
    assert rt.pending(s) == 2
    t0 = time.monotonic()
    rt.event_synchronize(done)
    assert time.monotonic() - t0 > 0.1
    assert rt.event_query(done) == CudaResult.SUCCESS
    assert rt.stream_query(s) == CudaResult.SUCCESS and rt.pending(s) == 0
    assert rt.raw("cudaGetLastError") == CudaResult.SUCCESS  # NOT_READY is an answer
    rt.event_destroy(done)
    rt.stream_destroy(s)


def test_streams_run_in_order_and_wait_on_events(rt: LabCudart) -> None:
    a, b = rt.stream_create(), rt.stream_create(non_blocking=True)
    ready = rt.event_create()
    order: list[str] = []
    rt.launch_kernel(a, 100 * MS)
    rt.launch_host_func(a, lambda: order.append("a"))
    rt.event_record(ready, a)
    rt.stream_wait_event(b, ready)  # b's work starts only after a reached `ready`
    rt.launch_host_func(b, lambda: order.append("b"))
    rt.stream_synchronize(b)
    assert order == ["a", "b"]
    start, end = rt.event_create(), rt.event_create()
    rt.event_record(start, a)
    rt.launch_kernel(a, 30 * MS)
    rt.event_record(end, a)
    rt.event_synchronize(end)
    assert 25.0 < rt.event_elapsed_ms(start, end) < 1000.0
    for e in (ready, start, end):
        rt.event_destroy(e)
    rt.stream_destroy(a)
    rt.stream_destroy(b)


def test_bad_handles_and_values_give_cuda_codes(rt: LabCudart) -> None:
    with pytest.raises(CudaError) as exc:
        rt.event_record(0xDEAD0, None)
    assert exc.value.code == CudaResult.INVALID_RESOURCE_HANDLE
    assert exc.value.name == "cudaErrorInvalidResourceHandle"
    assert rt.raw("cudaGetLastError") == CudaResult.INVALID_RESOURCE_HANDLE
    assert rt.raw("cudaGetLastError") == CudaResult.SUCCESS  # read and reset
    assert rt.event_query(0xDEAD0) == CudaResult.INVALID_RESOURCE_HANDLE
    assert rt.raw("cudaSetDevice", 7) == CudaResult.INVALID_DEVICE
    timing_off = rt.event_create(disable_timing=True)
    rt.event_record(timing_off, None)
    rt.event_synchronize(timing_off)
    with pytest.raises(CudaError) as exc:
        rt.event_elapsed_ms(timing_off, timing_off)
    assert exc.value.code == CudaResult.INVALID_RESOURCE_HANDLE
    assert rt.error_string(CudaResult.NOT_READY) == "device not ready"
    assert rt.device_count() == 1


def test_a_stopped_device_never_completes(rt: LabCudart) -> None:
    s = rt.stream_create()
    e = rt.event_create()
    rt.launch_kernel(s, FOREVER)
    rt.event_record(e, s)
    time.sleep(0.05)
    assert rt.event_query(e) == CudaResult.NOT_READY
    assert rt.stream_query(s) == CudaResult.NOT_READY


def test_libnccl_runs_each_collective_on_the_stream_it_is_given(rt: LabCudart) -> None:
    """Two ranks as threads (ncclCommInitAll): each AllReduce is queued on its
    rank's stream behind a kernel, returns at once, and is done when the
    event recorded after it completes."""
    nccl = LabNccl(ensure_built())
    comms = nccl.comm_init_all(2)
    streams = [rt.stream_create() for _ in comms]
    ends = [rt.event_create() for _ in comms]
    bufs = [np.full(1000, float(k + 1), np.float32) for k in range(2)]
    t0 = time.monotonic()
    with nccl.group():
        for k, comm in enumerate(comms):
            rt.launch_kernel(streams[k], 400 * MS)
            nccl.all_reduce(bufs[k], bufs[k], 1000, DataType.FLOAT32, RedOp.SUM, comm, streams[k])
    for k in range(2):
        rt.event_record(ends[k], streams[k])
    assert time.monotonic() - t0 < 0.3  # queued, not run
    assert [rt.event_query(e) for e in ends] == [CudaResult.NOT_READY] * 2
    assert not (bufs[0] == 3.0).any()
    for e in ends:
        rt.event_synchronize(e)
    assert all((b == 3.0).all() for b in bufs)
    for comm in comms:
        nccl.comm_destroy(comm)


def test_a_collective_on_a_bad_stream_is_an_unhandled_cuda_error(rt: LabCudart) -> None:
    nccl = LabNccl(ensure_built())
    comms = nccl.comm_init_all(1)
    x = np.ones(4, np.float32)
    with pytest.raises(NcclError) as exc:
        nccl.all_reduce(x, x, 4, DataType.FLOAT32, RedOp.SUM, comms[0], 0xBAD0)
    assert exc.value.result == Result.UNHANDLED_CUDA_ERROR
    assert "cudaErrorInvalidResourceHandle" in str(exc.value) or "invalid resource" in str(
        exc.value
    )
    nccl.comm_destroy(comms[0])


def test_a_thread_blocked_in_a_sync_wakes_when_the_stream_drains(rt: LabCudart) -> None:
    s = rt.stream_create()
    rt.launch_kernel(s, 80 * MS)
    woke: list[float] = []
    t = threading.Thread(target=lambda: (rt.stream_synchronize(s), woke.append(time.monotonic())))
    t0 = time.monotonic()
    t.start()
    t.join(5)
    assert woke and woke[0] - t0 > 0.07


def test_a_variant_without_frame_pointers_builds_apart() -> None:
    default = ensure_built()
    nofp = ensure_built(frame_pointers=False)
    assert nofp != default and nofp.name == default.name and nofp.exists()
    first = _first_instructions(nofp)
    # some entry point now begins without `push %rbp` (no frame to set up)
    assert any(not first.get(s, "").startswith("push   %rbp") for s in _exports(nofp)
               if s.startswith("ncclComm"))  # fmt: skip
    assert cudart_path().parent == default.parent


def test_a_capture_records_work_as_nodes_and_each_launch_replays_them_in_order(
    rt: LabCudart,
) -> None:
    s, other = rt.stream_create(non_blocking=True), rt.stream_create()
    done = rt.event_create(disable_timing=True)
    order: list[str] = []
    rt.begin_capture(s)
    assert rt.capture_status(s) is CaptureStatus.ACTIVE
    assert rt.capture_status(other) is CaptureStatus.NONE
    rt.launch_kernel(s, 30 * MS)
    rt.launch_host_func(s, lambda: order.append("a"))
    rt.event_record(done, s)
    rt.launch_host_func(s, lambda: order.append("b"))
    assert rt.raw("cudaStreamSynchronize", s) == CudaResult.STREAM_CAPTURE_UNSUPPORTED
    assert rt.capture_status(s) is CaptureStatus.INVALIDATED  # CUDA's rule: no syncing a capture
    with pytest.raises(CudaError, match="cudaErrorStreamCaptureInvalidated"):
        rt.end_capture(s)
    assert rt.capture_status(s) is CaptureStatus.NONE
    rt.begin_capture(s)
    rt.launch_kernel(s, 30 * MS)
    rt.launch_host_func(s, lambda: order.append("a"))
    rt.event_record(done, s)
    rt.launch_host_func(s, lambda: order.append("b"))
    graph = rt.end_capture(s)
    time.sleep(0.05)
    assert order == [] and rt.pending(s) == 0  # captured, not run
    exec_ = rt.graph_instantiate(graph)
    rt.graph_destroy(graph)  # the executable keeps its own copy
    rt.graph_launch(exec_, s)
    assert rt.event_query(done) == CudaResult.NOT_READY  # the record node is this launch's
    rt.graph_launch(exec_, s)
    rt.stream_synchronize(s)
    assert order == ["a", "b", "a", "b"] and rt.event_query(done) == CudaResult.SUCCESS
    rt.graph_launch(exec_, other)  # any stream
    rt.stream_synchronize(other)
    assert order == ["a", "b"] * 3
    rt.graph_exec_destroy(exec_)
    assert rt.raw("cudaGraphLaunch", exec_, s) == CudaResult.INVALID_RESOURCE_HANDLE
    assert rt.raw("cudaStreamEndCapture", s, ctypes.byref(ctypes.c_void_p())) == (
        CudaResult.STREAM_CAPTURE_UNMATCHED
    )
    assert rt.raw("cudaStreamBeginCapture", None, 0) == CudaResult.STREAM_CAPTURE_UNSUPPORTED


def test_libnccl_captures_a_collective_on_a_capturing_stream_and_runs_it_per_launch(
    rt: LabCudart,
) -> None:
    """Two ranks as threads: the AllReduce captured on each rank's stream runs
    only when the graph is launched, once per launch, on fresh inputs."""
    nccl = LabNccl(ensure_built())
    comms = nccl.comm_init_all(2)
    streams = [rt.stream_create(non_blocking=True) for _ in comms]
    bufs = [np.zeros(1000, np.float32) for _ in comms]
    for k in range(2):
        rt.begin_capture(streams[k])
    with nccl.group():
        for k, comm in enumerate(comms):
            nccl.all_reduce(bufs[k], bufs[k], 1000, DataType.FLOAT32, RedOp.SUM, comm, streams[k])
    execs = [rt.graph_instantiate(rt.end_capture(s)) for s in streams]
    for replay in range(3):
        for k in range(2):
            bufs[k][:] = float(k + 1 + replay)
        for k in range(2):
            rt.graph_launch(execs[k], streams[k])
        for s in streams:
            rt.stream_synchronize(s)
        assert all((b == 3.0 + 2 * replay).all() for b in bufs), replay
    for k, comm in enumerate(comms):
        rt.graph_exec_destroy(execs[k])
        nccl.comm_destroy(comm)

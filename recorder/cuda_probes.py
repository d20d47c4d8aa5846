"""The CUDA runtime probe family (bpf/cuda.c): one entry program told the
symbol by its attach cookie (CSYM_<symbol>), one return program for the
queries and synchronisations whose answer matters; on kernels without
uprobe_multi (no cookies) an entry program per symbol instead.  From the
first CUDA function attached on, bpf/nccl.c queues every collective on its
stream (the ``cuda_on`` map).
"""

from __future__ import annotations

from stallwatch.dumpers.schema import CUDA_SYMBOLS

from .uprobekinds import LinkKind

ENTRY_PROGRAM = "handle_cuda_enter"
RETURN_PROGRAM = "handle_cuda_return"
# symbol -> its own entry program (perf-event uprobes: no cookie)
ENTRY_PROGRAMS: dict[str, str] = {
    "cudaEventRecord": "handle_enter_event_record",
    "cudaEventRecord_ptsz": "handle_enter_event_record_ptsz",
    "cudaEventRecordWithFlags": "handle_enter_event_record_flags",
    "cudaEventRecordWithFlags_ptsz": "handle_enter_event_record_flags_ptsz",
    "cudaStreamWaitEvent": "handle_enter_stream_wait_event",
    "cudaStreamWaitEvent_ptsz": "handle_enter_stream_wait_event_ptsz",
    "cudaEventQuery": "handle_enter_event_query",
    "cudaEventSynchronize": "handle_enter_event_synchronize",
    "cudaStreamQuery": "handle_enter_stream_query",
    "cudaStreamQuery_ptsz": "handle_enter_stream_query_ptsz",
    "cudaStreamSynchronize": "handle_enter_stream_synchronize",
    "cudaStreamSynchronize_ptsz": "handle_enter_stream_synchronize_ptsz",
    "cudaStreamBeginCapture": "handle_enter_begin_capture",
    "cudaStreamBeginCapture_ptsz": "handle_enter_begin_capture_ptsz",
    "cudaStreamEndCapture": "handle_enter_end_capture",
    "cudaStreamEndCapture_ptsz": "handle_enter_end_capture_ptsz",
    "cudaStreamIsCapturing": "handle_enter_is_capturing",
    "cudaStreamIsCapturing_ptsz": "handle_enter_is_capturing_ptsz",
    "cudaStreamGetCaptureInfo": "handle_enter_capture_info",
    "cudaStreamGetCaptureInfo_ptsz": "handle_enter_capture_info_ptsz",
    "cudaGraphInstantiate": "handle_enter_graph_instantiate",
    "cudaGraphInstantiateWithFlags": "handle_enter_graph_instantiate_flags",
    "cudaGraphExecDestroy": "handle_enter_graph_exec_destroy",
    "cudaGraphDestroy": "handle_enter_graph_destroy",
    "cudaGraphLaunch": "handle_enter_graph_launch",
    "cudaGraphLaunch_ptsz": "handle_enter_graph_launch_ptsz",
    "cudaDeviceSynchronize": "handle_enter_device_synchronize",
}
COOKIES: dict[str, int] = {name: i + 1 for i, name in enumerate(ENTRY_PROGRAMS)}
PROGRAMS = (ENTRY_PROGRAM, RETURN_PROGRAM)  # linked through uprobe_multi links
assert set(ENTRY_PROGRAMS) == set(CUDA_SYMBOLS), "CUDA ENTRY_PROGRAMS out of sync"


def cflags() -> list[str]:
    return [f"-DCSYM_{name}={cookie}" for name, cookie in COOKIES.items()]


def _returns(symbol: str) -> tuple[tuple[str, LinkKind], ...]:
    return ((RETURN_PROGRAM, LinkKind.RETURN),) if CUDA_SYMBOLS[symbol] else ()


def linked_programs(symbol: str) -> tuple[tuple[str, LinkKind], ...]:
    """The programs of ``symbol`` through uprobe_multi links, the return first."""
    return (*_returns(symbol), (ENTRY_PROGRAM, LinkKind.ENTRY))


def perf_programs(symbol: str) -> tuple[tuple[str, LinkKind], ...]:
    """The programs of ``symbol`` as perf-event uprobes, the return first."""
    return (*_returns(symbol), (ENTRY_PROGRAMS[symbol], LinkKind.ENTRY))

"""A ctypes binding to a CUDA runtime, ``libcudart.so.<major>``: the lab's own
(``lab/csrc/cudart``), or a real one (which, with no GPU here, fails every
call with a documented code).

Only the stream, event, device and error functions a training framework
uses to order work and learn when it finished.  Calls that fail raise
:class:`CudaError` with the code and the runtime's own name and text for it;
``query``-style calls return the code instead (``cudaErrorNotReady`` is an
answer, not an error).  Handles are plain integers (pointer values).

Example::

    rt = LabCudart()                      # builds and loads build/lab/libcudart.so.12
    s = rt.stream_create()
    done = rt.event_create(disable_timing=True)
    rt.launch_kernel(s, 5_000_000)        # the lab's "kernel": 5 ms of device time
    rt.event_record(done, s)
    rt.event_query(done)                  # CudaResult.NOT_READY
    rt.stream_synchronize(s)
    rt.event_query(done)                  # CudaResult.SUCCESS
"""

from __future__ import annotations

import ctypes
import enum
from pathlib import Path
from typing import Any

from stallwatch.dumpers.errors import LabError

__all__ = ["FOREVER", "CaptureMode", "CaptureStatus", "CudaError", "CudaResult", "LabCudart"]

FOREVER = (1 << 64) - 1  # labLaunchKernel: a device that never finishes
STREAM_NON_BLOCKING = 0x01
EVENT_DISABLE_TIMING = 0x02


class CudaResult(enum.IntEnum):
    """``cudaError_t`` values the lab's runtime returns (CUDA's numbers)."""

    SUCCESS = 0
    INVALID_VALUE = 1
    MEMORY_ALLOCATION = 2
    INITIALIZATION_ERROR = 3
    INSUFFICIENT_DRIVER = 35
    NO_DEVICE = 100
    INVALID_DEVICE = 101
    INVALID_RESOURCE_HANDLE = 400
    ILLEGAL_STATE = 401
    NOT_READY = 600
    LAUNCH_FAILURE = 719
    NOT_SUPPORTED = 801
    STREAM_CAPTURE_UNSUPPORTED = 900
    STREAM_CAPTURE_INVALIDATED = 901
    STREAM_CAPTURE_UNMATCHED = 903
    UNKNOWN = 999


class CaptureMode(enum.IntEnum):
    """``cudaStreamCaptureMode``."""

    GLOBAL = 0
    THREAD_LOCAL = 1
    RELAXED = 2


class CaptureStatus(enum.IntEnum):
    """``cudaStreamCaptureStatus``."""

    NONE = 0
    ACTIVE = 1
    INVALIDATED = 2


class CudaError(LabError):
    """A runtime call returned an error code."""

    def __init__(self, function: str, code: int, name: str, text: str) -> None:
        self.function = function
        self.code = code
        self.name = name
        super().__init__(f"{function} returned {name} ({code}): {text}")


_P = ctypes.c_void_p
_I = ctypes.c_int
_U = ctypes.c_uint
_HOST_FN = ctypes.CFUNCTYPE(None, _P)
_PROTOTYPES: dict[str, tuple[Any, ...]] = {
    "cudaGetDeviceCount": (ctypes.POINTER(_I),),
    "cudaSetDevice": (_I,),
    "cudaGetDevice": (ctypes.POINTER(_I),),
    "cudaDeviceSynchronize": (),
    "cudaRuntimeGetVersion": (ctypes.POINTER(_I),),
    "cudaGetLastError": (),
    "cudaPeekAtLastError": (),
    "cudaStreamCreate": (ctypes.POINTER(_P),),
    "cudaStreamCreateWithFlags": (ctypes.POINTER(_P), _U),
    "cudaStreamDestroy": (_P,),
    "cudaStreamSynchronize": (_P,),
    "cudaStreamQuery": (_P,),
    "cudaStreamWaitEvent": (_P, _P, _U),
    "cudaLaunchHostFunc": (_P, _HOST_FN, _P),
    "cudaEventCreate": (ctypes.POINTER(_P),),
    "cudaEventCreateWithFlags": (ctypes.POINTER(_P), _U),
    "cudaEventRecord": (_P, _P),
    "cudaEventQuery": (_P,),
    "cudaEventSynchronize": (_P,),
    "cudaEventElapsedTime": (ctypes.POINTER(ctypes.c_float), _P, _P),
    "cudaEventDestroy": (_P,),
    "cudaStreamBeginCapture": (_P, _I),
    "cudaStreamEndCapture": (_P, ctypes.POINTER(_P)),
    "cudaStreamIsCapturing": (_P, ctypes.POINTER(_I)),
    "cudaGraphInstantiate": (ctypes.POINTER(_P), _P, ctypes.c_ulonglong),
    "cudaGraphInstantiateWithFlags": (ctypes.POINTER(_P), _P, ctypes.c_ulonglong),
    "cudaGraphLaunch": (_P, _P),
    "cudaGraphExecDestroy": (_P,),
    "cudaGraphDestroy": (_P,),
    "labLaunchKernel": (_P, ctypes.c_ulonglong),
    "labStreamPending": (_P, ctypes.POINTER(ctypes.c_ulonglong)),
}
LAB_ONLY = frozenset({"labLaunchKernel", "labStreamPending"})


class LabCudart:
    """The runtime API of one loaded library.  ``path=None`` builds and loads the lab's."""

    def __init__(self, path: str | Path | None = None) -> None:
        if path is None:
            from stallwatch.lab.build import ensure_cudart

            path = ensure_cudart()
        self.path = Path(path)
        try:
            self.cdll = ctypes.CDLL(str(self.path))
        except OSError as exc:
            raise LabError(f"cannot load CUDA runtime {self.path}: {exc}") from None
        self._fns: dict[str, Any] = {}
        for name, argtypes in _PROTOTYPES.items():
            fn = getattr(self.cdll, name, None)
            if fn is None:
                if name in LAB_ONLY:
                    continue
                raise LabError(f"{self.path} does not export {name}")
            fn.argtypes = list(argtypes)
            fn.restype = _I
            self._fns[name] = fn
        for name in ("cudaGetErrorString", "cudaGetErrorName"):
            getattr(self.cdll, name).argtypes = [_I]
            getattr(self.cdll, name).restype = ctypes.c_char_p
        self._keep: list[Any] = []  # host function trampolines stay alive

    @property
    def is_lab(self) -> bool:
        return "labLaunchKernel" in self._fns

    def raw(self, name: str, *args: Any) -> int:
        """Calls ``name`` and returns its code without raising."""
        return int(self._fns[name](*args))

    def _call(self, name: str, *args: Any) -> None:
        code = self.raw(name, *args)
        if code != CudaResult.SUCCESS:
            raise CudaError(name, code, self.error_name(code), self.error_string(code))

    def error_string(self, code: int) -> str:
        return (self.cdll.cudaGetErrorString(code) or b"").decode(errors="replace")

    def error_name(self, code: int) -> str:
        return (self.cdll.cudaGetErrorName(code) or b"").decode(errors="replace")

    def device_count(self) -> int:
        n = _I()
        self._call("cudaGetDeviceCount", ctypes.byref(n))
        return n.value

    def set_device(self, device: int) -> None:
        self._call("cudaSetDevice", device)

    def stream_create(self, non_blocking: bool = False) -> int:
        out = _P()
        flags = STREAM_NON_BLOCKING if non_blocking else 0
        self._call("cudaStreamCreateWithFlags", ctypes.byref(out), flags)
        return int(out.value or 0)

    def stream_destroy(self, stream: int) -> None:
        self._call("cudaStreamDestroy", stream)

    def stream_synchronize(self, stream: int | None) -> None:
        self._call("cudaStreamSynchronize", stream)

    def stream_query(self, stream: int | None) -> int:
        return self.raw("cudaStreamQuery", stream)

    def stream_wait_event(self, stream: int | None, event: int) -> None:
        self._call("cudaStreamWaitEvent", stream, event, 0)

    def event_create(self, disable_timing: bool = False) -> int:
        out = _P()
        flags = EVENT_DISABLE_TIMING if disable_timing else 0
        self._call("cudaEventCreateWithFlags", ctypes.byref(out), flags)
        return int(out.value or 0)

    def event_record(self, event: int, stream: int | None) -> None:
        self._call("cudaEventRecord", event, stream)

    def event_query(self, event: int) -> int:
        return self.raw("cudaEventQuery", event)

    def event_synchronize(self, event: int) -> None:
        self._call("cudaEventSynchronize", event)

    def event_elapsed_ms(self, start: int, end: int) -> float:
        ms = ctypes.c_float()
        self._call("cudaEventElapsedTime", ctypes.byref(ms), start, end)
        return float(ms.value)

    def event_destroy(self, event: int) -> None:
        self._call("cudaEventDestroy", event)

    def launch_host_func(self, stream: int | None, fn: Any) -> None:
        """``fn()`` runs on the stream's thread when the stream reaches it."""
        tramp = _HOST_FN(lambda _arg: fn())
        self._keep.append(tramp)
        self._call("cudaLaunchHostFunc", stream, tramp, None)

    def launch_kernel(self, stream: int | None, duration_ns: int) -> None:
        """The lab's "kernel": ``duration_ns`` of device time (FOREVER: never ends)."""
        if not self.is_lab:
            raise LabError(f"{self.path} is not the lab's runtime (no labLaunchKernel)")
        self._call("labLaunchKernel", stream, duration_ns)

    def pending(self, stream: int | None) -> int:
        n = ctypes.c_ulonglong()
        self._call("labStreamPending", stream, ctypes.byref(n))
        return int(n.value)

    # --- stream capture and graphs ---

    def begin_capture(self, stream: int, mode: CaptureMode = CaptureMode.THREAD_LOCAL) -> None:
        """Work enqueued on ``stream`` from now on is captured, not run."""
        self._call("cudaStreamBeginCapture", stream, int(mode))

    def end_capture(self, stream: int) -> int:
        """The graph captured on ``stream`` since :meth:`begin_capture`."""
        out = _P()
        self._call("cudaStreamEndCapture", stream, ctypes.byref(out))
        return int(out.value or 0)

    def capture_status(self, stream: int | None) -> CaptureStatus:
        status = _I()
        self._call("cudaStreamIsCapturing", stream, ctypes.byref(status))
        return CaptureStatus(status.value)

    def graph_instantiate(self, graph: int) -> int:
        out = _P()
        self._call("cudaGraphInstantiate", ctypes.byref(out), graph, 0)
        return int(out.value or 0)

    def graph_launch(self, exec_: int, stream: int | None) -> None:
        self._call("cudaGraphLaunch", exec_, stream)

    def graph_exec_destroy(self, exec_: int) -> None:
        self._call("cudaGraphExecDestroy", exec_)

    def graph_destroy(self, graph: int) -> None:
        self._call("cudaGraphDestroy", graph)

"""A ctypes binding to a ``libnccl.so.2``: the lab's own, or the real one.

Ranks of the lab's job load the library through this module, as a framework
would.  Every call that returns a non-zero ``ncclResult_t`` raises
:class:`NcclError` carrying the result, NCCL's error string and
``ncclGetLastError``'s text.  Buffers are numpy arrays (or raw addresses);
counts are elements, as in NCCL.

``labStreamSynchronize`` exists only in the lab's library (a stand-in for
``cudaStreamSynchronize``); against the real library ``stream_synchronize``
is a no-op and ``has_stream_synchronize`` is False.  ``ncclGather`` and
``ncclScatter`` are likewise optional (NCCL >= 2.28).

Example::

    nccl = LabNccl()                      # builds and loads build/lab/libnccl.so.2
    uid = nccl.get_unique_id()            # rank 0; send bytes(uid) to the others
    comm = nccl.comm_init_rank(nranks, uid, rank)
    nccl.all_reduce(x, y, x.size, DataType.FLOAT32, RedOp.SUM, comm)
    nccl.stream_synchronize(comm)
    nccl.comm_destroy(comm)
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stallwatch.dumpers.errors import LabError
from stallwatch.dumpers.schema import UNIQUE_ID_BYTES, DataType, RedOp, Result

__all__ = [
    "NCCL_SPLIT_NOCOLOR",
    "Comm",
    "DataType",
    "LabNccl",
    "NcclError",
    "RedOp",
    "Result",
    "UniqueId",
    "datatype_of",
    "unique_id_from_bytes",
]

NCCL_SPLIT_NOCOLOR = -1
NCCL_CONFIG_MAGIC = 0xCAFEBEEF
NCCL_CONFIG_UNDEF_INT = -(2**31)


class UniqueId(ctypes.Structure):
    """``ncclUniqueId``: 128 bytes, passed by value to ``ncclCommInitRank*``."""

    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]


class _Config(ctypes.Structure):
    """``ncclConfig_t`` as the lab's header lays it out (the prefix real NCCL shares)."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("blocking", ctypes.c_int),
        ("cgaClusterSize", ctypes.c_int),
        ("minCTAs", ctypes.c_int),
        ("maxCTAs", ctypes.c_int),
        ("netName", ctypes.c_char_p),
        ("splitShare", ctypes.c_int),
        ("trafficClass", ctypes.c_int),
        ("commName", ctypes.c_char_p),
        ("collnetEnable", ctypes.c_int),
        ("CTAPolicy", ctypes.c_int),
        ("shrinkShare", ctypes.c_int),
        ("nvlsCTAs", ctypes.c_int),
    ]


def unique_id_from_bytes(data: bytes) -> UniqueId:
    if len(data) != UNIQUE_ID_BYTES:
        raise ValueError(f"ncclUniqueId must be {UNIQUE_ID_BYTES} bytes, got {len(data)}")
    uid = UniqueId()
    ctypes.memmove(ctypes.addressof(uid), data, UNIQUE_ID_BYTES)
    return uid


_NUMPY_TYPES: dict[np.dtype[Any], DataType] = {
    np.dtype(np.int8): DataType.INT8,
    np.dtype(np.uint8): DataType.UINT8,
    np.dtype(np.int32): DataType.INT32,
    np.dtype(np.uint32): DataType.UINT32,
    np.dtype(np.int64): DataType.INT64,
    np.dtype(np.uint64): DataType.UINT64,
    np.dtype(np.float16): DataType.FLOAT16,
    np.dtype(np.float32): DataType.FLOAT32,
    np.dtype(np.float64): DataType.FLOAT64,
}


def datatype_of(array: np.ndarray[Any, Any]) -> DataType:
    """The NCCL datatype of a numpy array (bfloat16 has no numpy type: pass it explicitly)."""
    try:
        return _NUMPY_TYPES[array.dtype]
    except KeyError:
        raise ValueError(f"no NCCL datatype for numpy dtype {array.dtype}") from None


@dataclass(frozen=True, slots=True)
class Comm:
    """An ``ncclComm_t`` handle."""

    handle: int


class NcclError(LabError):
    """A call returned a non-zero ``ncclResult_t``."""

    def __init__(self, function: str, result: int, error_string: str, last_error: str) -> None:
        self.function = function
        self.result = Result(result) if result in Result._value2member_map_ else result
        self.error_string = error_string
        self.last_error = last_error
        name = self.result.name if isinstance(self.result, Result) else str(result)
        detail = f": {last_error}" if last_error else ""
        super().__init__(f"{function} returned {name} ({error_string}){detail}")


Buffer = np.ndarray[Any, Any] | int | None

_P = ctypes.c_void_p
_I = ctypes.c_int
_SZ = ctypes.c_size_t
_PROTOTYPES: dict[str, tuple[Any, ...]] = {
    "ncclGetVersion": (ctypes.POINTER(_I),),
    "ncclGetUniqueId": (ctypes.POINTER(UniqueId),),
    "ncclCommInitRank": (ctypes.POINTER(_P), _I, UniqueId, _I),
    "ncclCommInitRankConfig": (ctypes.POINTER(_P), _I, UniqueId, _I, ctypes.POINTER(_Config)),
    "ncclCommInitAll": (ctypes.POINTER(_P), _I, ctypes.POINTER(_I)),
    "ncclCommSplit": (_P, _I, _I, ctypes.POINTER(_P), ctypes.POINTER(_Config)),
    "ncclCommFinalize": (_P,),
    "ncclCommDestroy": (_P,),
    "ncclCommAbort": (_P,),
    "ncclCommCount": (_P, ctypes.POINTER(_I)),
    "ncclCommUserRank": (_P, ctypes.POINTER(_I)),
    "ncclCommGetAsyncError": (_P, ctypes.POINTER(_I)),
    "ncclAllReduce": (_P, _P, _SZ, _I, _I, _P, _P),
    "ncclBroadcast": (_P, _P, _SZ, _I, _I, _P, _P),
    "ncclBcast": (_P, _SZ, _I, _I, _P, _P),
    "ncclReduce": (_P, _P, _SZ, _I, _I, _I, _P, _P),
    "ncclAllGather": (_P, _P, _SZ, _I, _P, _P),
    "ncclReduceScatter": (_P, _P, _SZ, _I, _I, _P, _P),
    "ncclAlltoAll": (_P, _P, _SZ, _I, _P, _P),
    "ncclGather": (_P, _P, _SZ, _I, _I, _P, _P),
    "ncclScatter": (_P, _P, _SZ, _I, _I, _P, _P),
    "ncclSend": (_P, _SZ, _I, _I, _P, _P),
    "ncclRecv": (_P, _SZ, _I, _I, _P, _P),
    "ncclGroupStart": (),
    "ncclGroupEnd": (),
    "labStreamSynchronize": (_P,),
}
OPTIONAL_SYMBOLS = frozenset({"labStreamSynchronize", "ncclGather", "ncclScatter"})


def _address(buf: Buffer) -> int | None:
    if buf is None or isinstance(buf, int):
        return buf
    if not buf.flags.c_contiguous:
        raise ValueError("NCCL buffers must be C-contiguous arrays")
    return int(buf.ctypes.data)


def _handle(comm: Comm | None) -> int | None:
    return None if comm is None else comm.handle


class LabNccl:
    """The NCCL API of one loaded library.  ``path=None`` builds and loads the lab's."""

    def __init__(self, path: str | Path | None = None) -> None:
        if path is None:
            from stallwatch.lab.build import ensure_built

            path = ensure_built()
        self.path = Path(path)
        try:
            self.cdll = ctypes.CDLL(str(self.path))
        except OSError as exc:
            raise LabError(f"cannot load NCCL library {self.path}: {exc}") from None
        self._fns: dict[str, Any] = {}
        for name, argtypes in _PROTOTYPES.items():
            fn = getattr(self.cdll, name, None)
            if fn is None:
                if name in OPTIONAL_SYMBOLS:
                    continue
                raise LabError(f"{self.path} does not export {name}")
            fn.argtypes = list(argtypes)
            fn.restype = _I
            self._fns[name] = fn
        self.cdll.ncclGetErrorString.argtypes = [_I]
        self.cdll.ncclGetErrorString.restype = ctypes.c_char_p
        self.cdll.ncclGetLastError.argtypes = [_P]
        self.cdll.ncclGetLastError.restype = ctypes.c_char_p

    @property
    def has_stream_synchronize(self) -> bool:
        return "labStreamSynchronize" in self._fns

    def has(self, symbol: str) -> bool:
        return symbol in self._fns

    def raw(self, name: str, *args: Any) -> Result | int:
        """Calls ``name`` and returns its result code without raising."""
        code = int(self._fns[name](*args))
        return Result(code) if code in Result._value2member_map_ else code

    def _call(self, name: str, *args: Any, comm: Comm | None = None) -> None:
        code = int(self._fns[name](*args))
        if code != Result.SUCCESS:
            raise NcclError(name, code, self.error_string(code), self.last_error(comm))

    def _rooted(
        self,
        name: str,
        send: Buffer,
        recv: Buffer,
        count: int,
        dtype: int,
        root: int,
        comm: Comm,
        stream: int | None,
    ) -> None:
        """ncclBroadcast, ncclGather and ncclScatter share one signature."""
        self._call(
            name, _address(send), _address(recv), count, dtype, root, comm.handle, stream, comm=comm
        )

    def error_string(self, result: int) -> str:
        text: bytes | None = self.cdll.ncclGetErrorString(result)
        return (text or b"").decode(errors="replace")

    def last_error(self, comm: Comm | None = None) -> str:
        text: bytes | None = self.cdll.ncclGetLastError(_handle(comm))
        return (text or b"").decode(errors="replace")

    # ---- lifecycle ----

    def version(self) -> int:
        v = _I()
        self._call("ncclGetVersion", ctypes.byref(v))
        return v.value

    def get_unique_id(self) -> UniqueId:
        uid = UniqueId()
        self._call("ncclGetUniqueId", ctypes.byref(uid))
        return uid

    def comm_init_rank(self, nranks: int, uid: UniqueId, rank: int) -> Comm:
        out = _P()
        self._call("ncclCommInitRank", ctypes.byref(out), nranks, uid, rank)
        return Comm(int(out.value or 0))

    def comm_init_rank_config(
        self, nranks: int, uid: UniqueId, rank: int, *, blocking: bool = True
    ) -> Comm:
        out = _P()
        config = self._config(blocking)
        self._call("ncclCommInitRankConfig", ctypes.byref(out), nranks, uid, rank, config)
        return Comm(int(out.value or 0))

    def comm_init_all(self, ndev: int) -> list[Comm]:
        out = (_P * ndev)()
        self._call("ncclCommInitAll", out, ndev, None)
        return [Comm(int(h or 0)) for h in out]

    def comm_split(self, comm: Comm, color: int, key: int) -> Comm | None:
        """None for ranks that pass ``NCCL_SPLIT_NOCOLOR``."""
        out = _P()
        self._call("ncclCommSplit", comm.handle, color, key, ctypes.byref(out), None, comm=comm)
        return Comm(out.value) if out.value else None

    def comm_finalize(self, comm: Comm) -> None:
        self._call("ncclCommFinalize", comm.handle, comm=comm)

    def comm_destroy(self, comm: Comm) -> None:
        self._call("ncclCommDestroy", comm.handle)

    def comm_abort(self, comm: Comm) -> None:
        self._call("ncclCommAbort", comm.handle)

    def comm_count(self, comm: Comm) -> int:
        n = _I()
        self._call("ncclCommCount", comm.handle, ctypes.byref(n), comm=comm)
        return n.value

    def comm_user_rank(self, comm: Comm) -> int:
        r = _I()
        self._call("ncclCommUserRank", comm.handle, ctypes.byref(r), comm=comm)
        return r.value

    def comm_get_async_error(self, comm: Comm) -> Result:
        r = _I()
        self._call("ncclCommGetAsyncError", comm.handle, ctypes.byref(r), comm=comm)
        return Result(r.value)

    def stream_synchronize(self, comm: Comm) -> None:
        """Waits for the comm's queued ops (lab library only; a no-op elsewhere)."""
        if self.has_stream_synchronize:
            self._call("labStreamSynchronize", comm.handle, comm=comm)

    def _config(self, blocking: bool) -> _Config:
        c = _Config()
        c.size = ctypes.sizeof(_Config)
        c.magic = NCCL_CONFIG_MAGIC
        c.version = self.version()
        for field in _Config._fields_[3:]:
            if field[0] not in ("netName", "commName"):
                setattr(c, field[0], NCCL_CONFIG_UNDEF_INT)
        c.blocking = 1 if blocking else 0
        return c

    # ---- collectives and point to point ----

    def all_reduce(
        self,
        send: Buffer,
        recv: Buffer,
        count: int,
        dtype: int,
        op: int,
        comm: Comm,
        stream: int | None = None,
    ) -> None:
        self._call(
            "ncclAllReduce",
            _address(send),
            _address(recv),
            count,
            dtype,
            op,
            comm.handle,
            stream,
            comm=comm,
        )

    def broadcast(
        self,
        send: Buffer,
        recv: Buffer,
        count: int,
        dtype: int,
        root: int,
        comm: Comm,
        stream: int | None = None,
    ) -> None:
        self._rooted("ncclBroadcast", send, recv, count, dtype, root, comm, stream)

    def bcast(
        self, buf: Buffer, count: int, dtype: int, root: int, comm: Comm, stream: int | None = None
    ) -> None:
        self._call("ncclBcast", _address(buf), count, dtype, root, comm.handle, stream, comm=comm)

    def reduce(
        self,
        send: Buffer,
        recv: Buffer,
        count: int,
        dtype: int,
        op: int,
        root: int,
        comm: Comm,
        stream: int | None = None,
    ) -> None:
        self._call(
            "ncclReduce",
            _address(send),
            _address(recv),
            count,
            dtype,
            op,
            root,
            comm.handle,
            stream,
            comm=comm,
        )

    def all_gather(
        self,
        send: Buffer,
        recv: Buffer,
        sendcount: int,
        dtype: int,
        comm: Comm,
        stream: int | None = None,
    ) -> None:
        self._call(
            "ncclAllGather",
            _address(send),
            _address(recv),
            sendcount,
            dtype,
            comm.handle,
            stream,
            comm=comm,
        )

    def reduce_scatter(
        self,
        send: Buffer,
        recv: Buffer,
        recvcount: int,
        dtype: int,
        op: int,
        comm: Comm,
        stream: int | None = None,
    ) -> None:
        self._call(
            "ncclReduceScatter",
            _address(send),
            _address(recv),
            recvcount,
            dtype,
            op,
            comm.handle,
            stream,
            comm=comm,
        )

    def all_to_all(
        self,
        send: Buffer,
        recv: Buffer,
        count: int,
        dtype: int,
        comm: Comm,
        stream: int | None = None,
    ) -> None:
        self._call(
            "ncclAlltoAll",
            _address(send),
            _address(recv),
            count,
            dtype,
            comm.handle,
            stream,
            comm=comm,
        )

    def gather(
        self,
        send: Buffer,
        recv: Buffer,
        count: int,
        dtype: int,
        root: int,
        comm: Comm,
        stream: int | None = None,
    ) -> None:
        self._rooted("ncclGather", send, recv, count, dtype, root, comm, stream)

    def scatter(
        self,
        send: Buffer,
        recv: Buffer,
        count: int,
        dtype: int,
        root: int,
        comm: Comm,
        stream: int | None = None,
    ) -> None:
        self._rooted("ncclScatter", send, recv, count, dtype, root, comm, stream)

    def send(
        self, buf: Buffer, count: int, dtype: int, peer: int, comm: Comm, stream: int | None = None
    ) -> None:
        self._call("ncclSend", _address(buf), count, dtype, peer, comm.handle, stream, comm=comm)

    def recv(
        self, buf: Buffer, count: int, dtype: int, peer: int, comm: Comm, stream: int | None = None
    ) -> None:
        self._call("ncclRecv", _address(buf), count, dtype, peer, comm.handle, stream, comm=comm)

    def group_start(self) -> None:
        self._call("ncclGroupStart")

    def group_end(self) -> None:
        self._call("ncclGroupEnd")

    @contextmanager
    def group(self) -> Iterator[None]:
        """``with nccl.group(): ...``: GroupStart, then GroupEnd even if the body raises."""
        self.group_start()
        try:
            yield
        finally:
            self.group_end()

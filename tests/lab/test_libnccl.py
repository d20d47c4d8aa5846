"""The lab's NCCL-compatible library: ABI, entry-point instructions, numerics
of every collective against numpy, split communicators, groups, both modes,
and failure behaviour (mismatch, missing rank, dead peer, abort, leaks).

Multi-process tests run ranks as spawned processes talking TCP on loopback.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import queue
import re
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stallwatch.dumpers.schema import decode_root_address
from stallwatch.lab.build import ensure_built, is_up_to_date, library_path
from stallwatch.lab.nccl import (
    NCCL_SPLIT_NOCOLOR,
    Comm,
    DataType,
    LabNccl,
    NcclError,
    RedOp,
    Result,
    unique_id_from_bytes,
)

REQUIRED_SYMBOLS = frozenset(
    {
        "ncclGetVersion", "ncclGetUniqueId", "ncclCommInitRank", "ncclCommInitRankConfig",
        "ncclCommInitAll", "ncclCommSplit", "ncclCommDestroy", "ncclCommAbort",
        "ncclCommFinalize", "ncclCommCount", "ncclCommUserRank", "ncclCommGetAsyncError",
        "ncclAllReduce", "ncclBroadcast", "ncclBcast", "ncclReduce", "ncclAllGather",
        "ncclReduceScatter", "ncclAlltoAll", "ncclGather", "ncclScatter", "ncclSend",
        "ncclRecv", "ncclGroupStart", "ncclGroupEnd", "ncclGetErrorString",
        "ncclGetLastError", "labStreamSynchronize",
    }
)  # fmt: skip
ALL_TYPES = tuple(t for t in DataType if t <= DataType.BFLOAT16)
NP_TYPES: dict[DataType, Any] = {
    DataType.INT8: np.int8,
    DataType.UINT8: np.uint8,
    DataType.INT32: np.int32,
    DataType.UINT32: np.uint32,
    DataType.INT64: np.int64,
    DataType.UINT64: np.uint64,
    DataType.FLOAT16: np.float16,
    DataType.FLOAT32: np.float32,
    DataType.FLOAT64: np.float64,
    DataType.BFLOAT16: np.uint16,  # raw bits
}
FLOAT_TOL = {
    DataType.FLOAT16: 2e-2,
    DataType.BFLOAT16: 3e-2,
    DataType.FLOAT32: 1e-5,
    DataType.FLOAT64: 1e-12,
}
PER_RANK = 13  # elements per rank: allreduce uses PER_RANK * n - 2 (uneven chunks)

# A library bug can block a test inside a C call, where pytest-timeout's signal
# cannot reach it: the thread method fails the run loudly instead of hanging CI.
pytestmark = pytest.mark.timeout(120, method="thread")


@pytest.fixture(autouse=True)
def _loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "lo")
    monkeypatch.delenv("LABNCCL_ASYNC", raising=False)


@pytest.fixture(scope="module")
def nccl() -> LabNccl:
    return LabNccl(ensure_built())


# ---- data: the same on the ranks and in the checker ----


def make_input(dtype: DataType, rank: int, n: int) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(1000 * rank + int(dtype))
    if dtype == DataType.BFLOAT16:
        f = rng.uniform(-2, 2, n).astype(np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16)
    if dtype in FLOAT_TOL:
        return rng.uniform(-2, 2, n).astype(NP_TYPES[dtype])
    return rng.integers(1, 4, n).astype(NP_TYPES[dtype])


def as_float64(dtype: DataType, a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    if dtype == DataType.BFLOAT16:
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def expect_reduce(dtype: DataType, op: RedOp, parts: list[np.ndarray[Any, Any]]) -> Any:
    """numpy's answer: integers in their own type (wrapping), floats in float64."""
    s = np.stack([as_float64(dtype, p) for p in parts] if dtype in FLOAT_TOL else parts)
    t = s.dtype
    if op == RedOp.SUM:
        return s.sum(axis=0, dtype=t)
    if op == RedOp.PROD:
        return s.prod(axis=0, dtype=t)
    if op == RedOp.MAX:
        return s.max(axis=0)
    if op == RedOp.MIN:
        return s.min(axis=0)
    total = s.sum(axis=0, dtype=t)
    return total / len(parts) if dtype in FLOAT_TOL else total // len(parts)


def assert_close(dtype: DataType, got: np.ndarray[Any, Any], want: Any, what: str) -> None:
    if dtype in FLOAT_TOL:
        tol = FLOAT_TOL[dtype]
        np.testing.assert_allclose(as_float64(dtype, got), want, rtol=tol, atol=tol, err_msg=what)
    else:
        np.testing.assert_array_equal(got, want, err_msg=what)


# ---- running ranks as processes ----


def _rank_main(
    target: Callable[..., Any], rank: int, nranks: int, uid: bytes, args: tuple[Any, ...], q: Any
) -> None:
    try:
        nccl = LabNccl(library_path())
        q.put((rank, "ok", target(nccl, rank, nranks, unique_id_from_bytes(uid), q, *args)))
    except NcclError as exc:
        q.put((rank, "nccl", (int(exc.result), str(exc))))
    except BaseException as exc:
        q.put((rank, "exc", repr(exc)))


class Ranks:
    """nranks spawned processes running ``target(nccl, rank, nranks, uid, q, *args)``."""

    def __init__(self, nccl: LabNccl, target: Callable[..., Any], nranks: int, *args: Any) -> None:
        ctx = mp.get_context("spawn")
        self.q = ctx.Queue()
        uid = bytes(nccl.get_unique_id())
        self.procs = [
            ctx.Process(target=_rank_main, args=(target, r, nranks, uid, args, self.q), daemon=True)
            for r in range(nranks)
        ]
        for p in self.procs:
            p.start()

    def messages(self, count: int, timeout: float) -> list[tuple[int, str, Any]]:
        deadline = time.monotonic() + timeout
        out = []
        while len(out) < count:
            out.append(self.q.get(timeout=max(0.01, deadline - time.monotonic())))
        return out

    def results(self, timeout: float = 60.0) -> dict[int, tuple[str, Any]]:
        msgs = self.messages(len(self.procs), timeout)
        return {rank: (kind, value) for rank, kind, value in msgs}

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(5)


def run_ranks(
    nccl: LabNccl, target: Callable[..., Any], nranks: int, *args: Any, timeout: float = 60.0
) -> dict[int, Any]:
    ranks = Ranks(nccl, target, nranks, *args)
    try:
        res = ranks.results(timeout)
    finally:
        ranks.close()
    bad = {r: v for r, v in res.items() if v[0] != "ok"}
    assert not bad, f"ranks failed: {bad}"
    return {r: v[1] for r, v in res.items()}


# ---- the library as a binary ----


def _exports(lib: Path) -> dict[str, int]:
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True)
    syms = {}
    for line in out.stdout.splitlines():
        fields = line.split()
        if len(fields) == 3 and fields[1] == "T":
            syms[fields[2]] = int(fields[0], 16)
    return syms


def test_exports_exactly_the_api() -> None:
    syms = _exports(ensure_built())
    assert set(syms) >= REQUIRED_SYMBOLS, f"missing: {sorted(REQUIRED_SYMBOLS - set(syms))}"
    extra = {s for s in syms if not s.startswith(("nccl", "lab"))}
    assert not extra, f"internals exported: {sorted(extra)}"


def test_every_entry_point_begins_with_push_rbp() -> None:
    lib = ensure_built()
    syms = _exports(lib)
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(lib)], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    first: dict[str, str] = {}
    for m in re.finditer(r"^[0-9a-f]+ <([A-Za-z0-9_]+)>:\n\s+[0-9a-f]+:\s+(.+)$", out, re.M):
        first[m.group(1)] = m.group(2).strip()
    wrong = {s: first.get(s) for s in syms if not (first.get(s) or "").startswith("push   %rbp")}
    assert not wrong, f"entry points not starting with push %rbp: {wrong}"
    assert len(syms) >= len(REQUIRED_SYMBOLS)


def test_build_is_idempotent() -> None:
    lib = ensure_built()
    before = lib.stat().st_mtime_ns
    t0 = time.monotonic()
    assert ensure_built() == lib
    assert time.monotonic() - t0 < 0.5
    assert is_up_to_date()
    assert lib.stat().st_mtime_ns == before
    link = lib.parent / "libnccl.so"
    assert link.is_symlink() and link.resolve() == lib.resolve()


# ---- single-process API behaviour ----


def test_version_and_error_strings(nccl: LabNccl) -> None:
    v = nccl.version()
    assert 20000 <= v < 30000 and v // 10000 == 2
    assert nccl.error_string(Result.SUCCESS) == "no error"
    assert "remote" in nccl.error_string(Result.REMOTE_ERROR)
    assert nccl.error_string(99) == "unknown result code"


def test_null_comm_is_invalid_argument(nccl: LabNccl) -> None:
    buf = np.zeros(4, np.float32)
    addr = buf.ctypes.data
    got = nccl.raw("ncclAllReduce", addr, addr, 4, DataType.FLOAT32, RedOp.SUM, None, None)
    assert got == Result.INVALID_ARGUMENT
    assert "invalid communicator" in nccl.last_error()
    for name, args in [
        ("ncclSend", (addr, 4, DataType.FLOAT32, 0, None, None)),
        ("ncclCommDestroy", (None,)),
        ("ncclCommCount", (None, ctypes.byref(ctypes.c_int()))),
        ("ncclCommSplit", (None, 0, 0, ctypes.byref(ctypes.c_void_p()), None)),
        ("labStreamSynchronize", (None,)),
        ("ncclAllReduce", (addr, addr, 4, DataType.FLOAT32, RedOp.SUM, 0xDEAD0, None)),
    ]:
        assert nccl.raw(name, *args) == Result.INVALID_ARGUMENT, name


def test_invalid_datatype_op_root_are_invalid_argument(nccl: LabNccl) -> None:
    (comm,) = nccl.comm_init_all(1)
    buf = np.zeros(4, np.float32)
    a, h = buf.ctypes.data, comm.handle
    try:
        assert nccl.raw("ncclAllReduce", a, a, 4, 42, RedOp.SUM, h, None) == Result.INVALID_ARGUMENT
        assert "datatype 42" in nccl.last_error(comm)
        assert nccl.raw("ncclAllReduce", a, a, 4, DataType.FLOAT32, 9, h, None) == 4
        assert "reduction op 9" in nccl.last_error(comm)
        assert nccl.raw("ncclBroadcast", a, a, 4, DataType.FLOAT32, 1, h, None) == 4
        assert nccl.raw("ncclSend", a, 4, DataType.FLOAT32, -1, h, None) == 4
        assert nccl.raw("ncclAllReduce", None, a, 4, DataType.FLOAT32, 0, h, None) == 4
        assert nccl.raw("ncclGroupEnd") == Result.INVALID_USAGE
    finally:
        nccl.comm_destroy(comm)


def test_unique_id_layout_names_a_live_root(nccl: LabNccl) -> None:
    raw = bytes(nccl.get_unique_id())
    assert len(raw) == 128
    assert raw[:8] != bytes(8)
    assert int.from_bytes(raw[8:10], "little") == 2  # AF_INET, host order
    port = int.from_bytes(raw[10:12], "big")
    assert port != 0
    assert raw[16:] == bytes(112)
    assert decode_root_address(raw) == f"127.0.0.1:{port}"
    assert bytes(nccl.get_unique_id())[:8] != raw[:8]
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=2):
        pass  # the bootstrap root listens (and ignores a stranger)


@pytest.mark.parametrize("mode", ["blocking", "async"])
def test_init_all_group_collectives(
    nccl: LabNccl, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if mode == "async":
        monkeypatch.setenv("LABNCCL_ASYNC", "1")
    comms = nccl.comm_init_all(3)
    try:
        assert [nccl.comm_user_rank(c) for c in comms] == [0, 1, 2]
        assert [nccl.comm_count(c) for c in comms] == [3, 3, 3]
        xs = [make_input(DataType.FLOAT32, r, 1000) for r in range(3)]
        ys = [np.zeros(1000, np.float32) for _ in range(3)]
        gathered = [np.zeros(3000, np.float32) for _ in range(3)]
        nccl.group_start()
        with nccl.group():  # nested: runs at the outer end
            for r, c in enumerate(comms):
                nccl.all_reduce(xs[r], ys[r], 1000, DataType.FLOAT32, RedOp.SUM, c)
                nccl.all_gather(xs[r], gathered[r], 1000, DataType.FLOAT32, c)
        assert not ys[0].any(), "ops ran before the outermost ncclGroupEnd"
        nccl.group_end()
        for c in comms:
            nccl.stream_synchronize(c)
        want = expect_reduce(DataType.FLOAT32, RedOp.SUM, xs)
        for r in range(3):
            assert_close(DataType.FLOAT32, ys[r], want, f"rank {r}")
            np.testing.assert_array_equal(gathered[r], np.concatenate(xs))
    finally:
        for c in comms:
            nccl.comm_destroy(c)


def test_async_calls_return_before_the_collective_completes(
    nccl: LabNccl, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LABNCCL_ASYNC", "1")
    c0, c1 = nccl.comm_init_all(2)
    x0, x1 = np.full(4096, 1.0, np.float32), np.full(4096, 2.0, np.float32)
    empty = np.zeros(0, np.float32)
    try:
        t0 = time.monotonic()
        nccl.all_reduce(x0, x0, x0.size, DataType.FLOAT32, RedOp.SUM, c0)  # peer not there yet
        nccl.all_reduce(empty, empty, 0, DataType.FLOAT32, RedOp.SUM, c0)  # count 0 is fine
        assert time.monotonic() - t0 < 0.5
        time.sleep(0.2)
        assert (x0 == 1.0).all(), "the op completed although rank 1 had not called"
        assert nccl.comm_get_async_error(c0) == Result.SUCCESS
        nccl.all_reduce(x1, x1, x1.size, DataType.FLOAT32, RedOp.SUM, c1)
        nccl.all_reduce(empty, empty, 0, DataType.FLOAT32, RedOp.SUM, c1)
        nccl.stream_synchronize(c0)
        nccl.stream_synchronize(c1)
        assert (x0 == 3.0).all() and (x1 == 3.0).all()
    finally:
        nccl.comm_destroy(c0)
        nccl.comm_destroy(c1)


@pytest.mark.parametrize("mode", ["blocking", "async"])
def test_abort_returns_promptly_while_a_peer_hangs(
    nccl: LabNccl, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if mode == "async":
        monkeypatch.setenv("LABNCCL_ASYNC", "1")
    c0, c1 = nccl.comm_init_all(2)
    buf = np.ones(1 << 16, np.float32)
    errors: list[BaseException] = []

    def blocked() -> None:
        try:
            nccl.all_reduce(buf, buf, buf.size, DataType.FLOAT32, RedOp.SUM, c0)
            nccl.stream_synchronize(c0)  # async: the wait happens here
        except NcclError as exc:
            errors.append(exc)

    t = threading.Thread(target=blocked)
    t.start()
    time.sleep(0.3)
    assert t.is_alive(), "allreduce returned although rank 1 never called"
    t0 = time.monotonic()
    nccl.comm_abort(c0)
    assert time.monotonic() - t0 < 2.0
    t.join(2)
    assert not t.is_alive() and errors
    nccl.comm_destroy(c1)


def _fds_and_threads() -> tuple[int, int]:
    return len(os.listdir("/proc/self/fd")), threading.active_count() + len(
        os.listdir("/proc/self/task")
    )


@pytest.mark.parametrize("mode", ["blocking", "async"])
def test_no_fd_or_thread_leaks(nccl: LabNccl, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if mode == "async":
        monkeypatch.setenv("LABNCCL_ASYNC", "1")

    def cycle() -> None:
        comms = nccl.comm_init_all(3)
        sub: list[Comm | None] = [None] * 3

        def split(r: int) -> None:  # a split is collective: one thread per rank
            sub[r] = nccl.comm_split(comms[r], 0, -r)

        threads = [threading.Thread(target=split, args=(r,)) for r in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert [nccl.comm_user_rank(c) for c in sub if c] == [2, 1, 0]
        x = np.ones(64, np.int32)
        with nccl.group():
            for c in comms:
                nccl.all_reduce(x, x, 64, DataType.INT32, RedOp.SUM, c)
        for c in [*comms, *sub]:
            assert c is not None
            nccl.comm_destroy(c)

    cycle()
    time.sleep(0.2)
    before = _fds_and_threads()
    for _ in range(10):
        cycle()
    deadline = time.monotonic() + 3
    while _fds_and_threads() != before and time.monotonic() < deadline:
        time.sleep(0.05)  # detached bootstrap roots finish just after init
    assert _fds_and_threads() == before


# ---- multi-process: numerics of every collective ----


def _battery(nccl: LabNccl, rank: int, n: int, uid: Any, q: Any, big: int) -> dict[str, bytes]:
    comm = nccl.comm_init_rank(n, uid, rank)
    keep: dict[str, np.ndarray[Any, Any]] = {}
    for dt in ALL_TYPES:
        keep[f"x/{dt}"] = x = make_input(dt, rank, PER_RANK * n)  # alive until synchronised
        npt = NP_TYPES[dt]
        for op in RedOp:
            keep[f"ar/{dt}/{op}"] = y = np.zeros(PER_RANK * n - 2, npt)
            nccl.all_reduce(x, y, y.size, dt, op, comm)
            keep[f"rs/{dt}/{op}"] = y = np.zeros(PER_RANK, npt)
            nccl.reduce_scatter(x, y, PER_RANK, dt, op, comm)
            keep[f"red/{dt}/{op}"] = y = np.zeros(PER_RANK, npt)
            nccl.reduce(x, y, PER_RANK, dt, op, n - 1, comm)
        keep[f"ag/{dt}"] = y = np.zeros(PER_RANK * n * n, npt)
        nccl.all_gather(x, y, x.size, dt, comm)
        keep[f"a2a/{dt}"] = y = np.zeros(PER_RANK * n, npt)
        nccl.all_to_all(x, y, PER_RANK, dt, comm)
        keep[f"bc/{dt}"] = y = np.zeros(x.size, npt)
        nccl.broadcast(x, y, x.size, dt, 1, comm)
        keep[f"bcast/{dt}"] = y = x.copy()
        nccl.bcast(y, y.size, dt, n - 1, comm)
        keep[f"ga/{dt}"] = y = np.zeros(PER_RANK * n * n, npt)
        nccl.gather(x, y, x.size, dt, 0, comm)
        keep[f"sc/{dt}"] = y = np.zeros(PER_RANK, npt)
        nccl.scatter(x, y, PER_RANK, dt, 1, comm)
    xb = np.full(big, rank + 1, np.float32)
    keep["big"] = xb
    nccl.all_reduce(xb, xb, big, DataType.FLOAT32, RedOp.SUM, comm)  # in place
    nccl.stream_synchronize(comm)
    nccl.comm_destroy(comm)
    return {k: v.tobytes() for k, v in keep.items()}


def _check_battery(n: int, results: dict[int, dict[str, bytes]], big: int) -> None:
    for dt in ALL_TYPES:
        xs = [make_input(dt, r, PER_RANK * n) for r in range(n)]
        npt = NP_TYPES[dt]

        def got(r: int, key: str, npt: Any = npt) -> np.ndarray[Any, Any]:
            return np.frombuffer(results[r][key], npt)

        for op in RedOp:
            full = expect_reduce(dt, op, xs)
            for r in range(n):
                what = f"{dt.name} {op.name} rank {r}"
                assert_close(dt, got(r, f"ar/{dt}/{op}"), full[: PER_RANK * n - 2], "ar " + what)
                part = full[r * PER_RANK : (r + 1) * PER_RANK]
                assert_close(dt, got(r, f"rs/{dt}/{op}"), part, "rs " + what)
            assert_close(dt, got(n - 1, f"red/{dt}/{op}"), full[:PER_RANK], f"reduce {dt.name}")
        for r in range(n):
            np.testing.assert_array_equal(got(r, f"ag/{dt}"), np.concatenate(xs))
            a2a = np.concatenate([xs[p][r * PER_RANK : (r + 1) * PER_RANK] for p in range(n)])
            np.testing.assert_array_equal(got(r, f"a2a/{dt}"), a2a)
            np.testing.assert_array_equal(got(r, f"bc/{dt}"), xs[1])
            np.testing.assert_array_equal(got(r, f"bcast/{dt}"), xs[n - 1])
            np.testing.assert_array_equal(
                got(r, f"sc/{dt}"), xs[1][r * PER_RANK : (r + 1) * PER_RANK]
            )
        np.testing.assert_array_equal(got(0, f"ga/{dt}"), np.concatenate(xs))
    total = n * (n + 1) / 2
    for r in range(n):
        assert (np.frombuffer(results[r]["big"], np.float32) == total).all()


@pytest.mark.lab
@pytest.mark.parametrize(("mode", "nranks"), [("blocking", 3), ("async", 4)])
def test_collectives_match_numpy(
    nccl: LabNccl, mode: str, nranks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if mode == "async":
        monkeypatch.setenv("LABNCCL_ASYNC", "1")
    big = 1 << 20
    results = run_ranks(nccl, _battery, nranks, big)
    _check_battery(nranks, results, big)


# ---- split, send/recv ----


def _split(nccl: LabNccl, rank: int, n: int, uid: Any, q: Any) -> dict[str, Any]:
    world = nccl.comm_init_rank_config(n, uid, rank)
    tp = nccl.comm_split(world, rank // 2, rank)  # {0,1} {2,3}
    dp = nccl.comm_split(world, rank % 2, -rank)  # {2,0} {3,1}: key reverses order
    odd = nccl.comm_split(world, NCCL_SPLIT_NOCOLOR if rank == 3 else 0, 0)
    assert tp is not None and dp is not None
    me = np.array([rank], np.int64)
    tp_sum, dp_all = np.zeros(1, np.int64), np.zeros(2, np.int64)
    nccl.all_reduce(me, tp_sum, 1, DataType.INT64, RedOp.SUM, tp)
    nccl.all_gather(me, dp_all, 1, DataType.INT64, dp)
    out: dict[str, Any] = {"odd": None}
    if odd is not None:
        s = np.zeros(1, np.int64)
        nccl.all_reduce(me, s, 1, DataType.INT64, RedOp.SUM, odd)
        nccl.stream_synchronize(odd)
        out["odd"] = (nccl.comm_user_rank(odd), nccl.comm_count(odd), int(s[0]))
        nccl.comm_destroy(odd)
    for c in (tp, dp, world):
        nccl.stream_synchronize(c)
    out["tp"] = (nccl.comm_user_rank(tp), nccl.comm_count(tp), int(tp_sum[0]))
    out["dp"] = (nccl.comm_user_rank(dp), nccl.comm_count(dp), dp_all.tolist())
    for c in (tp, dp, world):
        nccl.comm_finalize(c)
        nccl.comm_destroy(c)
    return out


@pytest.mark.lab
@pytest.mark.parametrize("mode", ["blocking", "async"])
def test_split_data_and_tensor_parallel(
    nccl: LabNccl, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if mode == "async":
        monkeypatch.setenv("LABNCCL_ASYNC", "1")
    res = run_ranks(nccl, _split, 4)
    for r in range(4):
        group = [2 * (r // 2), 2 * (r // 2) + 1]
        assert res[r]["tp"] == (r % 2, 2, sum(group))
        dp_members = sorted([r % 2, r % 2 + 2], reverse=True)
        assert res[r]["dp"] == (dp_members.index(r), 2, dp_members)
    assert res[3]["odd"] is None
    assert [res[r]["odd"] for r in range(3)] == [(r, 3, 3) for r in range(3)]


def _ring(nccl: LabNccl, rank: int, n: int, uid: Any, q: Any, size: int) -> bool:
    comm = nccl.comm_init_rank(n, uid, rank)
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    out = np.full(size, rank, np.int32)
    from_prev, from_next = np.zeros(size, np.int32), np.zeros(size, np.int32)
    with nccl.group():  # both directions at once, bigger than socket buffers
        nccl.send(out, size, DataType.INT32, nxt, comm)
        nccl.send(out, size, DataType.INT32, prv, comm)
        nccl.recv(from_prev, size, DataType.INT32, prv, comm)
        nccl.recv(from_next, size, DataType.INT32, nxt, comm)
    nccl.stream_synchronize(comm)
    ok = bool((from_prev == prv).all() and (from_next == nxt).all())
    nccl.comm_destroy(comm)
    return ok


@pytest.mark.lab
@pytest.mark.parametrize("mode", ["blocking", "async"])
def test_send_recv_ring_in_a_group(
    nccl: LabNccl, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if mode == "async":
        monkeypatch.setenv("LABNCCL_ASYNC", "1")
    assert run_ranks(nccl, _ring, 4, 1 << 20) == {r: True for r in range(4)}


# ---- failures ----


def _mismatch(nccl: LabNccl, rank: int, n: int, uid: Any, q: Any, field: str) -> Any:
    comm = nccl.comm_init_rank(n, uid, rank)
    odd = rank == 1
    count = 1000 + (1 if odd and field == "count" else 0)
    dtype = DataType.FLOAT64 if odd and field == "dtype" else DataType.FLOAT32
    op = RedOp.MAX if odd and field == "op" else RedOp.SUM
    x = np.ones(count, NP_TYPES[dtype])
    try:
        nccl.all_reduce(x, x, count, dtype, op, comm)
        nccl.stream_synchronize(comm)
    except NcclError as exc:
        return (int(exc.result), str(exc), int(nccl.comm_get_async_error(comm)))
    finally:
        pass
    return None


@pytest.mark.lab
@pytest.mark.parametrize(
    ("field", "mine", "theirs", "mode"),
    [
        ("count", "count=1000", "count=1001", "blocking"),
        ("dtype", "datatype=float32", "datatype=float64", "blocking"),
        ("op", "op=sum", "op=max", "blocking"),
        ("count", "count=1000", "count=1001", "async"),
    ],
)
def test_mismatch_is_an_error_on_every_rank(
    nccl: LabNccl, field: str, mine: str, theirs: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if mode == "async":
        monkeypatch.setenv("LABNCCL_ASYNC", "1")
    res = run_ranks(nccl, _mismatch, 3, field, timeout=30)
    for r in range(3):
        assert res[r] is not None, f"rank {r} saw no error"
        code, msg, async_err = res[r]
        assert code == Result.INVALID_USAGE, msg
        assert async_err == Result.INVALID_USAGE
        assert mine in msg and theirs in msg, msg
        assert "rank 1" in msg


def _hang(nccl: LabNccl, rank: int, n: int, uid: Any, q: Any) -> str:
    comm = nccl.comm_init_rank(n, uid, rank)
    x = np.ones(256, np.float32)
    nccl.all_reduce(x, x, x.size, DataType.FLOAT32, RedOp.SUM, comm)  # warm-up: all ranks
    nccl.stream_synchronize(comm)
    q.put((rank, "entered", None))
    if rank == n - 1:
        time.sleep(3600)  # the culprit never calls
    nccl.all_reduce(x, x, x.size, DataType.FLOAT32, RedOp.SUM, comm)
    nccl.stream_synchronize(comm)
    return "returned"


@pytest.mark.lab
@pytest.mark.parametrize("mode", ["blocking", "async"])
def test_a_rank_that_never_calls_blocks_the_others(
    nccl: LabNccl, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if mode == "async":
        monkeypatch.setenv("LABNCCL_ASYNC", "1")
    ranks = Ranks(nccl, _hang, 3)
    try:
        entered = ranks.messages(3, timeout=30)
        assert sorted((r, kind) for r, kind, _ in entered) == [(r, "entered") for r in range(3)]
        with pytest.raises(queue.Empty):
            extra = ranks.messages(1, timeout=1.5)
            pytest.fail(f"a rank went past the missing one: {extra}")
        assert all(p.is_alive() for p in ranks.procs)
    finally:
        ranks.close()
    assert not any(p.is_alive() for p in ranks.procs)


def _peer_dies(nccl: LabNccl, rank: int, n: int, uid: Any, q: Any) -> Any:
    comm = nccl.comm_init_rank(n, uid, rank)
    if rank == 1:
        os._exit(3)
    time.sleep(0.3)
    x = np.ones(1 << 16, np.float32)
    try:
        nccl.all_reduce(x, x, x.size, DataType.FLOAT32, RedOp.SUM, comm)
        nccl.stream_synchronize(comm)
    except NcclError as exc:
        return (int(exc.result), str(exc))
    return None


@pytest.mark.lab
@pytest.mark.parametrize("mode", ["blocking", "async"])
def test_a_dead_peer_is_a_remote_error(
    nccl: LabNccl, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if mode == "async":
        monkeypatch.setenv("LABNCCL_ASYNC", "1")
    ranks = Ranks(nccl, _peer_dies, 2)
    try:
        (rank, kind, value), = ranks.messages(1, timeout=20)  # fmt: skip
    finally:
        ranks.close()
    assert (rank, kind) == (0, "ok")
    assert value is not None and value[0] == Result.REMOTE_ERROR, value
    assert "peer rank 1" in value[1]
    assert ranks.procs[1].exitcode == 3


@pytest.mark.realnccl
def test_binding_drives_the_real_libnccl() -> None:
    import nvidia.nccl

    path = Path(next(iter(nvidia.nccl.__path__))) / "lib" / "libnccl.so.2"
    real = LabNccl(path)
    assert not real.has_stream_synchronize
    assert real.version() // 10000 == 2
    raw = bytes(real.get_unique_id())
    assert int.from_bytes(raw[8:10], "little") == 2 and raw[10:12] != bytes(2)
    buf = np.zeros(4, np.float32)
    with pytest.raises(NcclError) as err:
        real.all_reduce(buf, buf, 4, DataType.FLOAT32, RedOp.SUM, Comm(0))
    assert err.value.result == Result.INVALID_ARGUMENT

"""Load the BPF programs of ``bpf/`` with BCC and attach them.

This is the only module that imports ``bcc``.  The four probe families are
loaded as one BPF module (BCC rewrites map accesses and generates tracepoint
argument structs only in its main source, so the files are passed together,
each after a ``#line`` marker that keeps compiler messages pointing at the
right file).  Every load or attach failure raises ``ProbeError`` naming the
program, the library and the symbol.

Known limits: x86-64 only (argument registers); uprobes on a library fire
for every process that maps it, filtering is by the ``excluded`` map.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dumpers.errors import ProbeError
from dumpers.schema import NCCL_SYMBOLS, RING_DTYPES

log = logging.getLogger("stallwatch.record")

BPF_DIR = Path(__file__).resolve().parent.parent / "bpf"
SOURCES = ("common.h", "nccl.c", "tcp.c", "sched.c", "proc.c")

# NCCL symbol -> entry program.  Every call returns through handle_nccl_return.
ENTRY_PROGRAMS: dict[str, str] = {
    "ncclAllReduce": "handle_enter_all_reduce",
    "ncclAllGather": "handle_enter_all_gather",
    "ncclReduceScatter": "handle_enter_reduce_scatter",
    "ncclBroadcast": "handle_enter_broadcast",
    "ncclBcast": "handle_enter_bcast",
    "ncclReduce": "handle_enter_reduce",
    "ncclAlltoAll": "handle_enter_all_to_all",
    "ncclGather": "handle_enter_gather",
    "ncclScatter": "handle_enter_scatter",
    "ncclSend": "handle_enter_send",
    "ncclRecv": "handle_enter_recv",
    "ncclGroupStart": "handle_enter_group_start",
    "ncclGroupEnd": "handle_enter_group_end",
    "ncclCommInitRank": "handle_enter_init_rank",
    "ncclCommInitRankConfig": "handle_enter_init_rank_config",
    "ncclCommInitAll": "handle_enter_init_all",
    "ncclCommSplit": "handle_enter_split",
    "ncclCommDestroy": "handle_enter_destroy",
    "ncclCommAbort": "handle_enter_abort",
    "ncclCommFinalize": "handle_enter_finalize",
    "ncclGetUniqueId": "handle_enter_get_unique_id",
}
RETURN_PROGRAM = "handle_nccl_return"
assert set(ENTRY_PROGRAMS) == set(NCCL_SYMBOLS), "ENTRY_PROGRAMS out of sync with schema"

# Ring name -> (index of its head in `heads`, BPF map name, cflag for its slots).
RING_MAPS: dict[str, tuple[int, str, str]] = {
    "nccl": (0, "nccl_ring", "NCCL_RING_SLOTS"),
    "comm": (1, "comm_ring", "COMM_RING_SLOTS"),
    "tcp": (2, "tcp_ring", "TCP_RING_SLOTS"),
    "sched": (3, "sched_ring", "SCHED_RING_SLOTS"),
    "exit": (4, "exit_ring", "EXIT_RING_SLOTS"),
}
# Index in the per-CPU `drops` array -> counter name (bpf/common.h DROP_*).
DROP_NAMES = (
    "kernel_lost_nccl",
    "kernel_lost_comm",
    "kernel_lost_tcp",
    "kernel_lost_sched",
    "kernel_lost_exit",
    "kernel_inflight_full",
    "kernel_comms_full",
    "kernel_sock_owner_full",
    "kernel_runq_maps_full",
)
HEAD_STRIDE_U64 = 8  # struct ring_head: one 64-byte line per ring


@dataclass(frozen=True, slots=True)
class RingSizes:
    """Slots per ring (powers of two), derived from the nccl ring's size."""

    nccl: int
    comm: int
    tcp: int
    sched: int
    exit: int

    @classmethod
    def from_nccl(cls, slots: int) -> RingSizes:
        if slots < 16 or slots & (slots - 1):
            raise ProbeError(f"--ring-size must be a power of two >= 16, got {slots}")
        return cls(
            nccl=slots,
            comm=max(64, slots // 64),
            tcp=max(64, slots // 4),
            sched=max(64, slots // 8),
            exit=max(64, slots // 256),
        )

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in RING_MAPS}

    def memory_bytes(self) -> int:
        return sum(n * RING_DTYPES[name].itemsize for name, n in self.as_dict().items())


def bpf_source() -> str:
    """The text BCC compiles: every file of ``bpf/`` in order."""
    parts = []
    for name in SOURCES:
        path = BPF_DIR / name
        try:
            text = path.read_text()
        except OSError as exc:
            raise ProbeError(f"cannot read BPF source {path}: {exc}") from exc
        parts.append(f'#line 1 "{path}"\n{text}')
    return "\n".join(parts)


def cflags(sizes: RingSizes, runq_threshold_ns: int) -> list[str]:
    flags = [f"-I{BPF_DIR}", f"-DRUNQ_THRESHOLD_NS={runq_threshold_ns}ULL"]
    flags += [f"-D{RING_MAPS[name][2]}={n}" for name, n in sizes.as_dict().items()]
    return flags


def _short(exc: Exception, limit: int = 300) -> str:
    text = str(exc)
    return text if len(text) <= limit else text[:limit] + "..."


def _mmap_array(table: Any, what: str) -> mmap.mmap:
    """Map an mmapable BPF array (element size is rounded up to 8 bytes)."""
    elem = (ctypes.sizeof(table.Leaf) + 7) & ~7
    length = elem * table.max_entries
    length = (length + mmap.PAGESIZE - 1) & ~(mmap.PAGESIZE - 1)
    try:
        return mmap.mmap(
            table.map_fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
    except OSError as exc:
        raise ProbeError(f"cannot mmap BPF map {what} (fd {table.map_fd}): {exc}") from exc


class Probes:
    """The loaded BPF module: rings mapped into numpy, maps, attachments."""

    def __init__(self, sizes: RingSizes, runq_threshold_ns: int) -> None:
        import bcc  # the only import of bcc in stallwatch

        self._bcc = bcc
        self.sizes = sizes
        try:
            self.bpf = bcc.BPF(text=bpf_source().encode(), cflags=cflags(sizes, runq_threshold_ns))
        except Exception as exc:  # BCC raises bare Exception
            raise ProbeError(f"cannot load BPF programs from {BPF_DIR}: {_short(exc)}") from exc
        self._maps: list[mmap.mmap] = []
        self.heads = self._map_heads()
        self.ring_arrays = {name: self._map_ring(name) for name in RING_MAPS}
        self.inflight = self._map_inflight()
        self._attached: list[tuple[str, str, int]] = []

    def _map_heads(self) -> np.ndarray:
        mem = _mmap_array(self.bpf[b"heads"], "heads")
        self._maps.append(mem)
        return np.frombuffer(mem, dtype="<u8", count=8 * HEAD_STRIDE_U64)

    def _map_ring(self, name: str) -> np.ndarray:
        _, map_name, _ = RING_MAPS[name]
        table = self.bpf[map_name.encode()]
        dtype = RING_DTYPES[name]
        if ctypes.sizeof(table.Leaf) != dtype.itemsize:
            raise ProbeError(
                f"BPF map {map_name}: record is {ctypes.sizeof(table.Leaf)} bytes, "
                f"dumpers.schema says {dtype.itemsize}"
            )
        mem = _mmap_array(table, map_name)
        self._maps.append(mem)
        return np.frombuffer(mem, dtype=dtype, count=table.max_entries)

    def _map_inflight(self) -> np.ndarray:
        """The per-thread call slots (bpf/nccl.c struct call_state)."""
        table = self.bpf[b"inflight"]
        mem = _mmap_array(table, "inflight")
        self._maps.append(mem)
        return np.frombuffer(mem, dtype=np.dtype(table.Leaf), count=table.max_entries)

    def head(self, ring: str) -> int:
        return int(self.heads[RING_MAPS[ring][0] * HEAD_STRIDE_U64])

    # ---- attach ---------------------------------------------------------

    def attach_symbol(self, path: str, symbol: str) -> None:
        entry = ENTRY_PROGRAMS[symbol]
        for fn_name, ret in ((entry, False), (RETURN_PROGRAM, True)):
            attach = self.bpf.attach_uretprobe if ret else self.bpf.attach_uprobe
            try:
                attach(name=path.encode(), sym=symbol.encode(), fn_name=fn_name.encode())
            except Exception as exc:  # BCC raises bare Exception
                kind = "uretprobe" if ret else "uprobe"
                raise ProbeError(
                    f"cannot attach {kind} program {fn_name} to {symbol} in {path}: {_short(exc)}"
                ) from exc
            self._attached.append((path, symbol, int(ret)))

    def attach_exit(self, libc: str) -> None:
        """The exit-code probe on libc's ``_exit``."""
        try:
            self.bpf.attach_uprobe(name=libc.encode(), sym=b"_exit", fn_name=b"handle_libc_exit")
        except Exception as exc:  # BCC raises bare Exception
            raise ProbeError(
                f"cannot attach uprobe program handle_libc_exit to _exit in {libc}: {_short(exc)}"
            ) from exc
        self._attached.append((libc, "_exit", 0))

    def detach_all(self) -> None:
        for path, symbol, ret in reversed(self._attached):
            detach = self.bpf.detach_uretprobe if ret else self.bpf.detach_uprobe
            try:
                detach(name=path.encode(), sym=symbol.encode())
            except Exception as exc:  # BCC raises bare Exception
                log.warning("detaching %s from %s: %s", symbol, path, exc)
        self._attached.clear()

    # ---- maps -----------------------------------------------------------

    def set_pid(self, map_name: str, pid: int, present: bool) -> None:
        table = self.bpf[map_name.encode()]
        key = table.Key(pid)
        if present:
            table[key] = table.Leaf(1)
        else:
            with contextlib.suppress(KeyError):
                del table[key]

    def drops(self) -> dict[str, int]:
        table = self.bpf[b"drops"]
        out = {}
        for i, name in enumerate(DROP_NAMES):
            out[name] = int(sum(table[table.Key(i)]))
        return out

    def items(self, map_name: str) -> Iterator[tuple[Any, Any]]:
        yield from self.bpf[map_name.encode()].items()

    def close(self) -> None:
        """Detach everything (the kernel takes ~0.1 s per uprobe: seconds)."""
        self._attached.clear()
        self.bpf.cleanup()
        # The numpy views keep the mappings alive until they are collected.
        self._maps.clear()


class BareProbe:
    """A do-nothing uprobe+uretprobe pair on one symbol (bpf/noop.c): the
    physical floor the benchmark compares the agent's probes with."""

    def __init__(self, path: str, symbol: str) -> None:
        import bcc

        try:
            self.bpf = bcc.BPF(src_file=str(BPF_DIR / "noop.c").encode())
            self.bpf.attach_uprobe(name=path.encode(), sym=symbol.encode(), fn_name=b"handle_noop")
            self.bpf.attach_uretprobe(
                name=path.encode(), sym=symbol.encode(), fn_name=b"handle_noop"
            )
        except Exception as exc:  # BCC raises bare Exception
            raise ProbeError(
                f"cannot attach handle_noop to {symbol} in {path}: {_short(exc)}"
            ) from exc

    def close(self) -> None:
        self.bpf.cleanup()

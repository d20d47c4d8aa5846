"""Load the BPF programs of ``bpf/`` with BCC and attach them.

This is the only module that imports ``bcc``.  The four probe families are
loaded as one BPF module (BCC rewrites map accesses and generates tracepoint
argument structs only in its main source, so the files are passed together,
each after a ``#line`` marker that keeps compiler messages pointing at the
right file).  Every load or attach failure raises ``ProbeError`` naming the
program, the library and the symbol.

Uprobes are attached through uprobe_multi links (kernel 6.6+): one entry
program, ``handle_nccl_enter``, told the symbol by the link's cookie, and one
return program.  Closing a link waits one RCU grace period, not one per
probe, and ``close`` closes all links at once from threads so that their
grace periods overlap: stopping takes a fraction of a second.  Where the
kernel has no uprobe_multi, each probe is a BCC perf-event uprobe (one entry
program per symbol), and stopping takes ~0.1 s per probe.

Known limits: x86-64 only (argument registers, syscall number); uprobes on a
library fire for every process that maps it, filtering is by the
``excluded`` map.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import errno
import importlib.resources
import logging
import mmap
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from stallwatch.dumpers.errors import ProbeError
from stallwatch.dumpers.schema import CUDA_SYMBOLS, NCCL_SYMBOLS, RING_DTYPES

from . import discovery
from .rings import check_ring_size

log = logging.getLogger("stallwatch.record")


def _bpf_dir() -> Path:
    """The BPF sources, shipped as package data of ``stallwatch.bpf``."""
    return Path(str(importlib.resources.files("stallwatch.bpf")))


BPF_DIR = _bpf_dir()
# cuda.h before nccl.c: BCC rewrites map accesses only in the text it is given
SOURCES = ("common.h", "cuda.h", "nccl.c", "cuda.c", "tcp.c", "sched.c", "proc.c")

# uprobe_multi: one entry program for every symbol (cookie = SYMBOL_COOKIES).
MULTI_ENTRY_PROGRAM = "handle_nccl_enter"
RETURN_PROGRAM = "handle_nccl_return"
# Without uprobe_multi: NCCL symbol -> entry program, one perf event each.
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
# NCCL symbol -> its cookie, SYM_<symbol> in bpf/nccl.c (0 means unknown).
SYMBOL_COOKIES: dict[str, int] = {name: i + 1 for i, name in enumerate(ENTRY_PROGRAMS)}
EXIT_PROGRAM = "handle_libc_exit"
assert set(ENTRY_PROGRAMS) == set(NCCL_SYMBOLS), "ENTRY_PROGRAMS out of sync with schema"

# The CUDA runtime (bpf/cuda.c): one entry program told the symbol by its
# cookie (CSYM_<symbol>), one return program for the queries and syncs.
CUDA_ENTRY_PROGRAM = "handle_cuda_enter"
CUDA_RETURN_PROGRAM = "handle_cuda_return"
CUDA_ENTRY_PROGRAMS: dict[str, str] = {
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
}
CUDA_COOKIES: dict[str, int] = {name: i + 1 for i, name in enumerate(CUDA_ENTRY_PROGRAMS)}
assert set(CUDA_ENTRY_PROGRAMS) == set(CUDA_SYMBOLS), "CUDA_ENTRY_PROGRAMS out of sync"
ELF_SYMBOLS = (*NCCL_SYMBOLS, *CUDA_SYMBOLS, "_exit")

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
    "kernel_cuda_queue_full",
)
# Index in the per-CPU `cuda_seen` array (bpf/cuda.c SEEN_*) -> counter name.
CUDA_SEEN_NAMES = (
    "cuda_event_records",
    "cuda_stream_waits",
    "cuda_answers_done",
    "cuda_answers_not_ready",
    "cuda_answers_error",
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
        check_ring_size(slots)
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
    flags += [f"-DSYM_{name}={cookie}" for name, cookie in SYMBOL_COOKIES.items()]
    flags += [f"-DCSYM_{name}={cookie}" for name, cookie in CUDA_COOKIES.items()]
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


# ---- uprobe_multi links through bpf(2) -------------------------------------

SYS_BPF = 321  # x86-64
BPF_LINK_CREATE = 28
BPF_TRACE_UPROBE_MULTI = 48  # enum bpf_attach_type, Linux 6.6+
BPF_F_UPROBE_MULTI_RETURN = 1
# What bpf(2) says when the kernel has no uprobe_multi links.
UNSUPPORTED_ERRNOS = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.E2BIG})
CLOSE_THREADS = 64  # links closed at once (their grace periods overlap)


class _UprobeMultiAttr(ctypes.Structure):
    """``union bpf_attr``, ``link_create`` with its ``uprobe_multi`` member."""

    _fields_ = [
        ("prog_fd", ctypes.c_uint32),
        ("target_fd", ctypes.c_uint32),
        ("attach_type", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("path", ctypes.c_uint64),
        ("offsets", ctypes.c_uint64),
        ("ref_ctr_offsets", ctypes.c_uint64),
        ("cookies", ctypes.c_uint64),
        ("cnt", ctypes.c_uint32),
        ("multi_flags", ctypes.c_uint32),
        ("pid", ctypes.c_uint32),
        ("_pad", ctypes.c_uint32),
    ]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class LinkKind(enum.Enum):
    ENTRY = "uprobe"
    RETURN = "uretprobe"


def uprobe_multi_link(
    prog_fd: int, path: str, offsets: Sequence[int], cookies: Sequence[int], kind: LinkKind
) -> int:
    """A uprobe_multi link of ``prog_fd`` on ``offsets`` (file offsets) of
    ``path`` in every process; returns its fd, raises OSError."""
    n = len(offsets)
    c_path = ctypes.create_string_buffer(os.fsencode(path))
    c_offsets = (ctypes.c_uint64 * n)(*offsets)
    c_cookies = (ctypes.c_uint64 * n)(*cookies)
    attr = _UprobeMultiAttr(
        prog_fd=prog_fd,
        attach_type=BPF_TRACE_UPROBE_MULTI,
        path=ctypes.addressof(c_path),
        offsets=ctypes.addressof(c_offsets),
        cookies=ctypes.addressof(c_cookies),
        cnt=n,
        multi_flags=BPF_F_UPROBE_MULTI_RETURN if kind is LinkKind.RETURN else 0,
    )
    fd = _libc.syscall(SYS_BPF, BPF_LINK_CREATE, ctypes.byref(attr), ctypes.sizeof(attr))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(fd)


def close_links(fds: Sequence[int]) -> None:
    """Close link (or tracepoint perf event) fds concurrently: each close
    waits for a grace period, and concurrent waits share one."""
    if not fds:
        return
    with ThreadPoolExecutor(max_workers=min(CLOSE_THREADS, len(fds))) as pool:
        for result in pool.map(_close_quietly, fds):
            if result:
                log.warning("detaching a probe: %s", result)


def _close_quietly(fd: int) -> str:
    try:
        os.close(fd)
    except OSError as exc:
        return str(exc)
    return ""


def _unsupported(exc: OSError) -> bool:
    return exc.errno in UNSUPPORTED_ERRNOS


class PerfUprobes:
    """Perf-event uprobes through libbcc's ``bpf_attach_uprobe`` with all
    seven of its arguments: BCC 0.26's Python binding declares six, so the
    kernel gets a garbage ``ref_ctr_offset`` (seen: 6), writes a counter at
    that offset of the library in every process, and refuses any other
    tool's uprobe on the same function (EINVAL, "ref_ctr_offset mismatch")."""

    def __init__(self, libbcc_name: str) -> None:
        self._attach = ctypes.CDLL(libbcc_name, use_errno=True).bpf_attach_uprobe
        self._attach.restype = ctypes.c_int
        self._attach.argtypes = [
            ctypes.c_int,  # prog fd
            ctypes.c_int,  # BPF_PROBE_ENTRY = 0, BPF_PROBE_RETURN = 1
            ctypes.c_char_p,  # event name (used only without the uprobe PMU)
            ctypes.c_char_p,  # binary path
            ctypes.c_uint64,  # file offset
            ctypes.c_int,  # pid, -1 for every process
            ctypes.c_uint32,  # ref_ctr_offset
        ]
        self.fds: list[int] = []

    def attach(self, prog_fd: int, path: str, offset: int, kind: LinkKind) -> None:
        ret = kind is LinkKind.RETURN
        event = f"{'r' if ret else 'p'}_stallwatch_{os.getpid()}_{len(self.fds)}_{offset:x}"
        fd = self._attach(prog_fd, int(ret), event.encode(), os.fsencode(path), offset, -1, 0)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err) if err else "bpf_attach_uprobe failed")
        self.fds.append(fd)


class Probes:
    """The loaded BPF module: rings mapped into numpy, maps, attachments."""

    def __init__(self, sizes: RingSizes, runq_threshold_ns: int, uprobe_multi: bool = True) -> None:
        """``uprobe_multi=False`` attaches perf-event uprobes even where the
        kernel has uprobe_multi links (the fallback, for tests)."""
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
        self._links: list[int] = []  # uprobe_multi link fds
        self._offsets: dict[str, dict[str, discovery.ElfFunction]] = {}
        self._perf = PerfUprobes(bcc.libbcc.lib._name)  # fallback: kernels before 6.6
        self._multi: bool | None = None if uprobe_multi else False  # None: untried

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

    def _multi_program(self, name: str) -> int | None:
        """The fd of program ``name`` loaded for uprobe_multi links; None
        (and perf events from now on) when this kernel cannot load it so."""
        try:
            fn = self.bpf.load_func(
                name.encode(), self._bcc.BPF.KPROBE, attach_type=BPF_TRACE_UPROBE_MULTI
            )
        except Exception as exc:  # BCC raises bare Exception
            if self._multi:
                raise ProbeError(f"cannot load uprobe program {name}: {_short(exc)}") from exc
            self._no_multi(f"cannot load {name} for uprobe_multi links: {_short(exc)}")
            return None
        return int(fn.fd)

    def _no_multi(self, why: str) -> None:
        self._multi = False
        # BCC caches programs by name, and one loaded for uprobe_multi cannot
        # be attached to a perf event: BCC must load them again.
        for name in (MULTI_ENTRY_PROGRAM, RETURN_PROGRAM, EXIT_PROGRAM, CUDA_ENTRY_PROGRAM,
                     CUDA_RETURN_PROGRAM):  # fmt: skip
            fn = self.bpf.funcs.pop(name.encode(), None)
            if fn is not None:
                os.close(fn.fd)
        log.warning(
            "%s; falling back to one perf-event uprobe per probe: stopping will take "
            "~0.1 s per attached probe",
            why,
        )

    def _offset(self, path: str, symbol: str, program: str) -> int:
        if path not in self._offsets:
            try:
                self._offsets[path] = discovery.elf_functions(path, ELF_SYMBOLS)
            except (OSError, ValueError) as exc:
                raise ProbeError(
                    f"cannot attach uprobe program {program} to {symbol} in {path}: {exc}"
                ) from exc
        fn = self._offsets[path].get(symbol)
        if fn is None:
            raise ProbeError(
                f"cannot attach uprobe program {program} to {symbol} in {path}: "
                "no such function in its symbol tables"
            )
        return fn.file_offset

    def _link(
        self, path: str, symbol: str, cookie: int, programs: Sequence[tuple[str, LinkKind]]
    ) -> bool:
        """One uprobe_multi link per (program, kind) on ``symbol``; False,
        with nothing attached, when this kernel has no uprobe_multi links."""
        if self._multi is False:
            return False
        offset = self._offset(path, symbol, programs[0][0])
        made: list[int] = []
        for program, kind in programs:
            prog_fd = self._multi_program(program)
            if prog_fd is None:
                close_links(made)
                return False
            try:
                made.append(uprobe_multi_link(prog_fd, path, [offset], [cookie], kind))
            except OSError as exc:
                close_links(made)
                if self._multi is None and _unsupported(exc):
                    self._no_multi(f"uprobe_multi link refused: {exc.strerror}")
                    return False
                raise ProbeError(
                    f"cannot attach {kind.value} program {program} to {symbol} in {path} "
                    f"(uprobe_multi link at file offset {offset:#x}): {exc.strerror}"
                ) from exc
        if self._multi is None:
            log.info("uprobes attached through uprobe_multi links")
            self._multi = True
        self._links += made
        return True

    def attach_symbol(self, path: str, symbol: str) -> None:
        if symbol in CUDA_SYMBOLS:
            self._attach_cuda(path, symbol)
            return
        programs = ((MULTI_ENTRY_PROGRAM, LinkKind.ENTRY), (RETURN_PROGRAM, LinkKind.RETURN))
        if self._link(path, symbol, SYMBOL_COOKIES[symbol], programs):
            return
        programs = ((ENTRY_PROGRAMS[symbol], LinkKind.ENTRY), (RETURN_PROGRAM, LinkKind.RETURN))
        for program, kind in programs:
            self._perf_uprobe(path, symbol, program, kind)

    def _attach_cuda(self, path: str, symbol: str) -> None:
        """A CUDA runtime function; from the first one on, nccl.c queues every
        collective on its stream (the `cuda_on` flag)."""
        flag = self.bpf[b"cuda_on"]
        flag[flag.Key(0)] = flag.Leaf(1)
        returns = ((CUDA_RETURN_PROGRAM, LinkKind.RETURN),) if CUDA_SYMBOLS[symbol] else ()
        programs = ((CUDA_ENTRY_PROGRAM, LinkKind.ENTRY), *returns)
        if self._link(path, symbol, CUDA_COOKIES[symbol], programs):
            return
        for program, kind in ((CUDA_ENTRY_PROGRAMS[symbol], LinkKind.ENTRY), *returns):
            self._perf_uprobe(path, symbol, program, kind)

    def attach_exit(self, libc: str) -> None:
        """The exit-code probe on libc's ``_exit``."""
        if not self._link(libc, "_exit", 0, ((EXIT_PROGRAM, LinkKind.ENTRY),)):
            self._perf_uprobe(libc, "_exit", EXIT_PROGRAM, LinkKind.ENTRY)

    def _perf_uprobe(self, path: str, symbol: str, program: str, kind: LinkKind) -> None:
        offset = self._offset(path, symbol, program)
        try:
            fn = self.bpf.load_func(program.encode(), self._bcc.BPF.KPROBE)
            self._perf.attach(int(fn.fd), path, offset, kind)
        except Exception as exc:  # BCC raises bare Exception; OSError from the attach
            raise ProbeError(
                f"cannot attach {kind.value} program {program} to {symbol} in {path}: {_short(exc)}"
            ) from exc

    @property
    def perf_uprobe_fds(self) -> tuple[int, ...]:
        """The perf events of the fallback (none with uprobe_multi)."""
        return tuple(self._perf.fds)

    @property
    def attach_method(self) -> str:
        """How uprobes are (or will be) attached: "uprobe_multi" or "perf event"."""
        return "perf event" if self._multi is False else "uprobe_multi"

    # ---- maps -----------------------------------------------------------

    def set_pid(self, map_name: str, pid: int, present: bool) -> None:
        table = self.bpf[map_name.encode()]
        key = table.Key(pid)
        if present:
            if map_name == "excluded":  # the programs look at `excluded` from now on
                flag = self.bpf[b"any_excluded"]
                flag[flag.Key(0)] = flag.Leaf(1)
            table[key] = table.Leaf(1)
        else:
            with contextlib.suppress(KeyError):
                del table[key]

    def set_agent_self(self, tgid: int, port: int) -> None:
        """Whose TCP rows the programs leave out: the agent's process and
        its listening port (0: none)."""
        table = self.bpf[b"agent_self"]
        leaf = table.Leaf()
        leaf.tgid, leaf.port = tgid, port
        table[table.Key(0)] = leaf

    def drops(self) -> dict[str, int]:
        table = self.bpf[b"drops"]
        out = {}
        for i, name in enumerate(DROP_NAMES):
            out[name] = int(sum(table[table.Key(i)]))
        return out

    def cuda_seen(self) -> dict[str, int]:
        """The CUDA runtime calls the probes saw, and their answers."""
        table = self.bpf[b"cuda_seen"]
        return {name: int(sum(table[table.Key(i)])) for i, name in enumerate(CUDA_SEEN_NAMES)}

    def items(self, map_name: str) -> Iterator[tuple[Any, Any]]:
        yield from self.bpf[map_name.encode()].items()

    def close(self) -> None:
        """Detach everything at once: uprobe_multi links, tracepoints and
        perf-event uprobes (old kernels: those take ~0.1 s each, in turn)."""
        links, self._links = self._links + self._perf.fds, []
        self._perf.fds = []
        # BCC would close its tracepoint perf events one by one (~0.08 s
        # each); closed together their waits overlap too.
        tracepoints = list(self.bpf.tracepoint_fds.values())
        self.bpf.tracepoint_fds.clear()
        close_links(links + tracepoints)
        self.bpf.cleanup()
        # The numpy views keep the mappings alive until they are collected.
        self._maps.clear()


class BareProbe:
    """A do-nothing uprobe+uretprobe pair on one symbol: the physical floor
    the benchmark compares the agent's probes with, attached the way the
    agent's are (``attach_method``).  ``source`` is a C file defining
    ``handle_noop`` (the benchmark keeps its own)."""

    def __init__(self, path: str, symbol: str, source: Path) -> None:
        import bcc

        self._links: list[int] = []
        try:
            self.bpf = bcc.BPF(src_file=str(source).encode())
        except Exception as exc:  # BCC raises bare Exception
            raise ProbeError(f"cannot load {source}: {_short(exc)}") from exc
        fn = discovery.elf_functions(path, [symbol]).get(symbol)
        if fn is None:
            raise ProbeError(f"cannot attach handle_noop to {symbol} in {path}: no such function")
        self.attach_method = "uprobe_multi"
        try:
            prog = self.bpf.load_func(
                b"handle_noop", bcc.BPF.KPROBE, attach_type=BPF_TRACE_UPROBE_MULTI
            )
            for kind in LinkKind:
                self._links.append(uprobe_multi_link(prog.fd, path, [fn.file_offset], [0], kind))
        except Exception as exc:  # BCC raises bare Exception; bpf(2) OSError
            close_links(self._links)
            self._links = []
            log.info("bare probe: no uprobe_multi (%s), perf-event uprobes", _short(exc))
            self._forget_multi_program()
            self._attach_perf(path, fn.file_offset)

    def _forget_multi_program(self) -> None:
        """BCC caches a program by name; one loaded for uprobe_multi cannot be
        attached to a perf event, so BCC must load it again."""
        prog = self.bpf.funcs.pop(b"handle_noop", None)
        if prog is not None:
            os.close(prog.fd)

    def _attach_perf(self, path: str, offset: int) -> None:
        import bcc

        self.attach_method = "perf event"
        perf = PerfUprobes(bcc.libbcc.lib._name)
        try:
            fn = self.bpf.load_func(b"handle_noop", bcc.BPF.KPROBE)
            for kind in LinkKind:
                perf.attach(int(fn.fd), path, offset, kind)
        except Exception as exc:  # BCC raises bare Exception; OSError from the attach
            close_links(perf.fds)
            raise ProbeError(f"cannot attach handle_noop in {path}: {_short(exc)}") from exc
        self._links += perf.fds

    def close(self) -> None:
        close_links(self._links)
        self._links = []
        self.bpf.cleanup()

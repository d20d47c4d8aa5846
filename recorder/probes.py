"""Load the BPF programs of ``bpf/`` with BCC and attach them.

This is the only module that imports ``bcc``.  The probe families are
loaded as one BPF module (BCC rewrites map accesses and generates tracepoint
argument structs only in its main source, so the files are passed together,
each after a ``#line`` marker that keeps compiler messages pointing at the
right file).  Every load or attach failure raises ``ProbeError`` naming the
program, the library and the symbol.

Attachments are BPF links made here, not by BCC: uprobes through
uprobe_multi links (kernel 6.6+: an entry program per symbol, its argument
layout compiled in, and one return program), tracepoints
through ``BPF_PERF_EVENT`` links.  A link can be pinned, and so the whole
recording can outlive the agent (``recorder.pinning``): with pins, the maps,
the programs links are made from and every link are pinned as they are
made, and an agent that finds a pin set of its own layout adopts it instead
of loading anything (BCC still compiles the source, to know the layout).
Closing an unpinned link waits one RCU grace period; ``close`` closes all
links at once from threads so that their waits overlap, and stopping takes a
fraction of a second.  Where the kernel has no uprobe_multi, each uprobe is
a BCC perf-event uprobe (one entry program per symbol; ~0.1 s each to stop)
and nothing is pinned.

Known limits: x86-64 only (argument registers, syscall numbers); uprobes on
a library fire for every process that maps it, filtering is by the
``excluded`` map.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import errno
import hashlib
import importlib.resources
import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stallwatch.dumpers.errors import PinError, ProbeError
from stallwatch.dumpers.schema import CUDA_SYMBOLS, NCCL_SYMBOLS, RING_DTYPES

from . import bpfsys, compiled, discovery, pinning
from .maps import RING_MAPS, BpfMap, Layout, MapSet, MapSpec
from .rings import check_ring_size

log = logging.getLogger("stallwatch.record")


def _bpf_dir() -> Path:
    """The BPF sources, shipped as package data of ``stallwatch.bpf``."""
    return Path(str(importlib.resources.files("stallwatch.bpf")))


BPF_DIR = _bpf_dir()
# cuda.h before nccl.c: BCC rewrites map accesses only in the text it is given
SOURCES = ("common.h", "cuda.h", "nccl.c", "cuda.c", "tcp.c", "sched.c", "proc.c")

RETURN_PROGRAM = "handle_nccl_return"
# NCCL symbol -> its entry program (the symbol's argument layout compiled in:
# no attach cookie to read, ~20 ns a call); one uprobe_multi link each, or
# one perf event each on kernels without uprobe_multi.
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
# NCCL symbol -> SYM_<symbol> in bpf/nccl.c, the case each entry program decodes.
SYMBOL_COOKIES: dict[str, int] = {name: i + 1 for i, name in enumerate(ENTRY_PROGRAMS)}
EXIT_PROGRAM = "handle_libc_exit"
LOADER_PROGRAM = "handle_dl_state"  # ld.so's _dl_debug_state: discovery
LOADER_SYMBOL = "_dl_debug_state"
# Every program attached through uprobe_multi links: loaded (and pinned) at
# start, so that an agent adopting a pin set can attach new libraries with
# them.  A program added to bpf/ that links are made from goes here.
UPROBE_PROGRAMS = (*ENTRY_PROGRAMS.values(), RETURN_PROGRAM, EXIT_PROGRAM, LOADER_PROGRAM)
TRACEPOINT_PREFIX = "tracepoint__"
# The sock_ops program (bpf/tcp.c): linked to the cgroup v2 root, it sees
# every socket of the machine and reads the connection's state at
# retransmission timeouts and retransmits.
SOCK_OPS_PROGRAM = "handle_sock_ops"
SOCK_OPS_LINK = ("cgroup", "sock_ops")
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
CUDA_COOKIES: dict[str, int] = {name: i + 1 for i, name in enumerate(CUDA_ENTRY_PROGRAMS)}
assert set(CUDA_ENTRY_PROGRAMS) == set(CUDA_SYMBOLS), "CUDA_ENTRY_PROGRAMS out of sync"
ELF_SYMBOLS = (*NCCL_SYMBOLS, *CUDA_SYMBOLS, "_exit")
UPROBE_PROGRAMS += (CUDA_ENTRY_PROGRAM, CUDA_RETURN_PROGRAM)

# What bpf(2) says when the kernel has no uprobe_multi links.
UNSUPPORTED_ERRNOS = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.E2BIG})
CLOSE_THREADS = 64  # links closed at once (their grace periods overlap)


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

    @classmethod
    def of(cls, maps: MapSet) -> RingSizes:
        return cls(**maps.ring_slots())

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


def build_key(flags: Sequence[str]) -> str:
    """What a compiled recording is made of: every file of ``bpf/`` (those
    only included too), the flags and the kernel they were compiled for;
    not where the files are (an installed wheel and a checkout of the same
    sources compile the same programs).  Pins of the same key are adopted
    with nothing compiled; the compile cache is keyed by it."""
    digest = hashlib.sha256()
    for path in sorted(BPF_DIR.glob("*.[ch]")):
        try:
            text = path.read_bytes()
        except OSError as exc:
            raise ProbeError(f"cannot read BPF source {path}: {exc}") from exc
        digest.update(path.name.encode() + b"\0" + text + b"\0")
    digest.update("\0".join(f for f in flags if not f.startswith("-I")).encode())
    digest.update(os.uname().release.encode())
    return digest.hexdigest()[:24]


def kernel_hz() -> int:
    """The kernel's tick rate (CONFIG_HZ): retransmission timeouts come in
    jiffies.  From the kernel's configuration, else measured on
    /proc/timer_list's jiffies; 0 when neither can be read (RTOs unknown)."""
    release = os.uname().release
    for reader in (_hz_from_config, _hz_measured):
        with contextlib.suppress(OSError, ValueError, EOFError):
            hz = reader(release)
            if hz:
                return hz
    return 0


HZ_VALUES = (100, 250, 300, 1000)


def _hz_from_config(release: str) -> int:
    import gzip

    texts: list[str] = []
    with contextlib.suppress(OSError):
        texts.append(Path(f"/boot/config-{release}").read_text())
    if not texts:
        with gzip.open("/proc/config.gz", "rt") as f:
            texts.append(f.read())
    for line in texts[0].splitlines():
        if line.startswith("CONFIG_HZ="):
            return int(line.partition("=")[2])
    return 0


def _hz_measured(_release: str) -> int:
    import time

    def jiffies() -> tuple[int, int]:
        for line in Path("/proc/timer_list").read_text().splitlines():
            if line.startswith("jiffies:"):
                return int(line.split()[1]), time.monotonic_ns()
        raise ValueError("no jiffies in /proc/timer_list")

    j0, t0 = jiffies()
    time.sleep(0.2)
    j1, t1 = jiffies()
    rate = (j1 - j0) * 1e9 / (t1 - t0)
    return min(HZ_VALUES, key=lambda hz: abs(hz - rate))


_HZ: list[int] = []
TRACEFS = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing"))
# Tracepoint fields that only some kernels have -> the cflag that says so
# (the programs read them only then).
OPTIONAL_FIELDS = {
    ("tcp", "tcp_retransmit_skb", "err"): "TP_RETRANSMIT_ERR",  # 6.12+
    ("tcp", "tcp_send_reset", "reason"): "TP_SEND_RESET_REASON",  # 6.10+
}


def tracepoint_fields(category: str, event: str) -> set[str]:
    """The field names of a tracepoint on this kernel (empty: unknown)."""
    for root in TRACEFS:
        try:
            text = (root / "events" / category / event / "format").read_text()
        except OSError:
            continue
        return {m.split(";")[0].split()[-1].split("[")[0] for m in text.split("field:")[1:]}
    return set()


def optional_field_flags() -> list[str]:
    flags = []
    for (category, event, name), flag in OPTIONAL_FIELDS.items():
        if name in tracepoint_fields(category, event):
            flags.append(f"-D{flag}=1")
    return flags


def cflags(sizes: RingSizes, runq_threshold_ns: int) -> list[str]:
    if not _HZ:
        _HZ.append(kernel_hz())
    flags = [f"-I{BPF_DIR}", f"-DRUNQ_THRESHOLD_NS={runq_threshold_ns}ULL", f"-DKERNEL_HZ={_HZ[0]}"]
    flags += optional_field_flags()
    flags += [f"-D{RING_MAPS[name][2]}={n}" for name, n in sizes.as_dict().items()]
    flags += [f"-DSYM_{name}={cookie}" for name, cookie in SYMBOL_COOKIES.items()]
    flags += [f"-DCSYM_{name}={cookie}" for name, cookie in CUDA_COOKIES.items()]
    return flags


def _short(exc: Exception, limit: int = 300) -> str:
    text = str(exc)
    return text if len(text) <= limit else text[:limit] + "..."


# ---- links -----------------------------------------------------------------


class LinkKind(enum.Enum):
    ENTRY = "uprobe"
    RETURN = "uretprobe"


def uprobe_multi_link(
    prog_fd: int, path: str, offsets: Sequence[int], cookies: Sequence[int], kind: LinkKind
) -> int:
    """A uprobe_multi link of ``prog_fd`` on ``offsets`` (file offsets) of
    ``path`` in every process; returns its fd, raises OSError."""
    return bpfsys.uprobe_multi_link(
        prog_fd, path, list(offsets), list(cookies), kind is LinkKind.RETURN
    )


def close_links(fds: Sequence[int]) -> None:
    """Close link (or perf event) fds concurrently: each close of an
    unpinned link waits for a grace period, and concurrent waits share one."""
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


# ---- the BCC module ----------------------------------------------------------


def _module_class(bcc: Any) -> Any:
    class Module(bcc.BPF):  # type: ignore[misc]
        """BCC's BPF without its tracepoint autoload: tracepoints are
        attached here through links, which can be pinned."""

        def _trace_autoload(self) -> None:
            return None

    return Module


def _lib_functions(lib: Any) -> None:
    lib.bpf_num_tables.restype = ctypes.c_ulonglong
    lib.bpf_num_tables.argtypes = [ctypes.c_void_p]
    lib.bpf_table_name.restype = ctypes.c_char_p
    lib.bpf_table_name.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong]


def layout_of(bpf: Any, lib: Any, flags: Sequence[str]) -> Layout:
    """Every map of the compiled module, with numpy dtypes of its records."""
    import numpy as np

    _lib_functions(lib)
    maps: dict[str, MapSpec] = {}
    for i in range(lib.bpf_num_tables(bpf.module)):
        name = lib.bpf_table_name(bpf.module, i)
        table = bpf[name]
        map_id = table.map_id
        maps[name.decode()] = MapSpec(
            name=name.decode(),
            type=int(lib.bpf_table_type_id(bpf.module, map_id)),
            key=np.dtype(table.Key),
            value=np.dtype(table.Leaf),
            max_entries=int(lib.bpf_table_max_entries_id(bpf.module, map_id)),
            flags=int(lib.bpf_table_flags_id(bpf.module, map_id)),
        )
    defines = tuple(sorted(f for f in flags if f.startswith("-D")))
    return Layout(maps, defines)


def cgroup2_root() -> Path | None:
    """Where the cgroup v2 hierarchy's root is mounted (pure v2:
    /sys/fs/cgroup; hybrid: /sys/fs/cgroup/unified), None if nowhere."""
    try:
        text = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        fields = line.split(" - ")
        if len(fields) != 2 or not fields[1].startswith("cgroup2 "):
            continue
        mount = fields[0].split()
        if mount[3] == "/":  # the root of the hierarchy, not a namespace's part of it
            return Path(mount[4])
    return None


def _linked_prog(folder: Path, name: str) -> int:
    """The id of the program a pinned link holds (0: unreadable)."""
    try:
        fd = bpfsys.obj_get(folder / "links" / name)
    except OSError:
        return 0
    try:
        return bpfsys.link_prog_id(fd)
    except OSError:
        return 0
    finally:
        os.close(fd)


def _tracepoints(bpf: Any, lib: Any) -> list[tuple[str, str, str]]:
    """(program, category, event) of every TRACEPOINT_PROBE of the module."""
    out = []
    for i in range(lib.bpf_num_functions(bpf.module)):
        name = lib.bpf_function_name(bpf.module, i).decode()
        if name.startswith(TRACEPOINT_PREFIX):
            category, _, event = name[len(TRACEPOINT_PREFIX) :].partition("__")
            out.append((name, category, event))
    return out


class Probes:
    """The loaded (or adopted) BPF recording: maps mapped into numpy, links."""

    def __init__(
        self,
        sizes: RingSizes,
        runq_threshold_ns: int,
        uprobe_multi: bool = True,
        pins: pinning.PinOptions | None = None,
        about: dict[str, Any] | None = None,
        compile_outside: bool = False,
        cache_dir: Path | None = None,
        compile_only: bool = False,
    ) -> None:
        """``uprobe_multi=False`` attaches perf-event uprobes even where the
        kernel has uprobe_multi links (the fallback, for tests).  With
        ``pins``, the recording is pinned there, or adopted from there:
        pins of this very build (``build_key``) are adopted with nothing
        compiled; else, with ``compile_outside`` (the agent), a short-lived
        process compiles and pins (``recorder.loader``) and they are
        adopted; else BCC compiles here.  ``cache_dir``: the compile cache
        (``recorder.compiled``), read by the agent and written by whoever
        compiles.  ``compile_only``: compile, check that the kernel loads
        every program, write the cache's entry; attach and pin nothing
        (``compile_into``)."""
        self.flags = cflags(sizes, runq_threshold_ns)
        self.build_key = build_key(self.flags)
        self.bpf: Any = None  # the BCC module, once compiled here
        self._bcc: Any = None
        self._lib: Any = None
        self._links: list[int] = []  # link fds
        self._tracepoint_ids: dict[str, int] = {}  # event -> its program's id
        self._linked: set[str] = set()  # pin names of the links made or adopted
        self._progs: dict[str, int] = {}  # uprobe_multi programs: name -> fd
        self._offsets: dict[str, dict[str, discovery.ElfFunction]] = {}
        self._perf: PerfUprobes | None = None  # fallback: kernels before 6.6
        self._multi: bool | None = None if uprobe_multi else False  # None: untried
        self._said_multi = False
        self.pinset: pinning.PinSet | None = None
        self.adopted = False
        self.compiled = False  # whether BCC compiled in this process
        self._cache_dir = cache_dir
        self._own_progs = False  # the programs' fds are ours to close (not BCC's)
        about = {**(about or {}), "build_key": self.build_key}
        try:
            if compile_only:
                self.maps = self._compile_into_cache()
            else:
                self.maps = self._open(pins, about, sizes, runq_threshold_ns, compile_outside)
        except BaseException:
            self.close()
            raise
        self.sizes = RingSizes.of(self.maps)

    def _compile(self) -> None:
        import bcc  # the only import of bcc in stallwatch

        self._bcc = bcc
        try:
            self.bpf = _module_class(bcc)(text=bpf_source().encode(), cflags=self.flags)
        except Exception as exc:  # BCC raises bare Exception
            raise ProbeError(f"cannot load BPF programs from {BPF_DIR}: {_short(exc)}") from exc
        self._lib = bcc.libbcc.lib
        self.layout = layout_of(self.bpf, self._lib, self.flags)
        self.compiled = True

    def _compile_into_cache(self) -> MapSet:
        if self._cache_dir is None:
            raise ProbeError("compiling for the cache needs a cache folder")
        self._compile()
        entry = self._capture()
        self._check_loads(entry)
        try:
            compiled.save(self._cache_dir, entry)
        except OSError as exc:
            raise ProbeError(f"cannot write the compile cache {self._cache_dir}: {exc}") from None
        return self._bcc_maps()

    # ---- loading or adopting ---------------------------------------------

    def _open(
        self,
        pins: pinning.PinOptions | None,
        about: dict[str, Any],
        sizes: RingSizes,
        runq_threshold_ns: int,
        compile_outside: bool,
    ) -> MapSet:
        if pins is not None and self._multi is not False:
            ready = pinning.adopt_built(pins, self.build_key)
            how = "pins of this very build: nothing compiled"
            if ready is None and compile_outside:
                # agents starting together compile once: the others wait,
                # then load what it kept
                with compiled.compiling(self._cache_dir, self.build_key):
                    maps = self._from_cache(pins, about)
                    if maps is not None:
                        return maps
                    from .loader import load_outside

                    load_outside(pins, sizes.nccl, runq_threshold_ns, about, self._cache_dir)
                ready = pinning.adopt_loaded(pins)
                how = "compiled by a loader process, which has exited"
            if ready is not None:
                return self._adopt(ready, how)
        self._compile()
        if pins is not None and self._multi is not False and self._can_multi():
            opened = pinning.open_for_agent(pins, self.layout, about)
            if opened.adopted is not None:
                return self._adopt(opened.adopted)
            assert opened.building is not None
            return self._build(opened.building)
        if pins is not None:
            log.warning(
                "this kernel has no uprobe_multi links: the recording is not pinned "
                "(it ends with the agent)"
            )
        maps = self._bcc_maps()
        self._attach_tracepoints(None)
        return maps

    def _can_multi(self) -> bool:
        """Whether the entry program loads for uprobe_multi links (6.6+)."""
        return self._multi_program(RETURN_PROGRAM) is not None

    def _bcc_maps(self) -> MapSet:
        maps = {
            name: BpfMap(spec, int(self.bpf[name.encode()].map_fd), owned=False)
            for name, spec in self.layout.maps.items()
        }
        return MapSet(self.layout, maps)

    def _build(self, building: pinning.Building) -> MapSet:
        """A fresh recording, pinned into a new folder renamed into place."""
        try:
            maps = self._bcc_maps()
            for name, m in maps.maps.items():
                building.pin_map(name, m.fd)
            for program in UPROBE_PROGRAMS:
                fd = self._multi_program(program)
                if fd is None:
                    raise ProbeError(f"cannot load uprobe program {program} for uprobe_multi links")
                building.pin_prog(program, fd)
            self._attach_tracepoints(building)
            self.pinset = building.finish()
        except BaseException:
            building.abandon()
            raise
        self.pinset.lock()
        log.info("recording pinned at %s (layout %s)", self.pinset.path, self.layout.fingerprint)
        self._keep_compiled()
        return maps

    # ---- the compile cache -------------------------------------------------

    def _check_loads(self, entry: compiled.Compiled) -> None:
        """Every program of ``entry`` loads (the kernel's verifier accepts
        it) with BCC's maps; nothing is attached, each program is closed."""
        fds = {n: int(self.bpf[n.encode()].map_fd) for n in entry.layout.maps}
        for prog in entry.programs:
            try:
                fd = bpfsys.prog_load(
                    prog.prog_type,
                    compiled.bind(prog, fds),
                    entry.license,
                    prog.name,
                    prog.attach_type,
                )
            except OSError as exc:
                raise ProbeError(f"the kernel refuses BPF program {prog.name}: {exc}") from None
            os.close(fd)

    def _keep_compiled(self) -> None:
        """What BCC compiled, kept for the next cold start (best effort)."""
        if self._cache_dir is None:
            return
        try:
            compiled.save(self._cache_dir, self._capture())
        except (OSError, ValueError) as exc:
            log.warning("compiled programs not kept in %s: %s", self._cache_dir, exc)
            return
        log.info("compiled programs kept in %s", compiled.path_for(self._cache_dir, self.build_key))

    def _capture(self) -> compiled.Compiled:
        names = {int(self.bpf[n.encode()].map_fd): n for n in self.layout.maps}
        maps = tuple(compiled.compiled_map(n, fd) for fd, n in names.items())
        kprobe, tracepoint = compiled.BPF_PROG_TYPE_KPROBE, compiled.BPF_PROG_TYPE_TRACEPOINT
        programs = [
            self._captured(p, kprobe, bpfsys.BPF_TRACE_UPROBE_MULTI, None, names)
            for p in UPROBE_PROGRAMS
        ]
        programs += [
            self._captured(p, tracepoint, 0, ("tracepoint", f"{category}:{event}"), names)
            for p, category, event in _tracepoints(self.bpf, self._lib)
        ]
        sock_ops = compiled.BPF_PROG_TYPE_SOCK_OPS
        programs.append(self._captured(SOCK_OPS_PROGRAM, sock_ops, 0, SOCK_OPS_LINK, names))
        license = self._lib.bpf_module_license(self.bpf.module).decode()
        return compiled.Compiled(self.build_key, license, self.layout, maps, tuple(programs))

    def _captured(
        self,
        name: str,
        prog_type: int,
        attach_type: int,
        link: tuple[str, str] | None,
        names: dict[int, str],
    ) -> compiled.CompiledProgram:
        insns, where = compiled.unbind(self.bpf.dump_func(name.encode()), names)
        return compiled.CompiledProgram(name, prog_type, attach_type, insns, where, link)

    def _from_cache(self, pins: pinning.PinOptions, about: dict[str, Any]) -> MapSet | None:
        """Pins made from the compile cache's entry of this build, with no
        compiler anywhere; None (nothing left behind) if there is no entry
        or the kernel refuses it."""
        entry = compiled.load(self._cache_dir, self.build_key) if self._cache_dir else None
        if entry is None:
            return None
        opened = pinning.open_for_agent(pins, entry.layout, about)
        if opened.adopted is not None:
            return self._adopt(opened.adopted, "pins of the same layout: nothing compiled")
        assert opened.building is not None
        fds: dict[str, int] = {}
        try:
            self._load_entry(entry, opened.building, fds)
            self.pinset = opened.building.finish()
        except (OSError, PinError) as exc:
            opened.building.abandon()
            self._forget_entry(fds)
            log.warning("the compile cache's programs were not loaded (%s): compiling", exc)
            return None
        self.pinset.lock()
        self.layout, self._multi, self._own_progs = entry.layout, True, True
        log.info(
            "recording pinned at %s (layout %s), loaded from the compile cache %s: "
            "nothing compiled",
            self.pinset.path,
            entry.layout.fingerprint,
            compiled.path_for(self._cache_dir or Path(), self.build_key),
        )
        maps = {n: BpfMap(spec, fds[n], owned=True) for n, spec in entry.layout.maps.items()}
        return MapSet(entry.layout, maps)

    def _load_entry(
        self, entry: compiled.Compiled, building: pinning.Building, fds: dict[str, int]
    ) -> None:
        for m in entry.maps:
            fds[m.name] = bpfsys.map_create(
                m.type, m.key_size, m.value_size, m.max_entries, m.name, m.flags
            )
            building.pin_map(m.name, fds[m.name])
        for prog in entry.programs:
            code = compiled.bind(prog, fds)
            fd = bpfsys.prog_load(prog.prog_type, code, entry.license, prog.name, prog.attach_type)
            if prog.link is None:
                self._progs[prog.name] = fd
                building.pin_prog(prog.name, fd)
                continue
            try:
                if prog.link == SOCK_OPS_LINK:
                    self._link_sock_ops(fd, building)
                    continue
                category, _, event = prog.link[1].partition(":")
                link = bpfsys.tracepoint_link(fd, category, event)
                self._tracepoint_ids[event] = bpfsys.prog_info(fd).id
            finally:
                os.close(fd)  # the link holds the program
            self._links.append(link)
            building.pin_link(pinning.tracepoint_link_name(category, event), link)

    def _forget_entry(self, fds: dict[str, int]) -> None:
        close_links(self._links)
        self._links = []
        for fd in [*fds.values(), *self._progs.values()]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._progs.clear()

    def _adopt(self, pinset: pinning.PinSet, how: str = "compiled here") -> MapSet:
        """Take over a pinned recording: its maps, programs and links."""
        self.pinset = pinset
        self.adopted = True
        self._own_progs = True
        self.layout = pinset.layout
        maps = MapSet(pinset.layout, pinset.open_maps())
        for program in UPROBE_PROGRAMS:
            fd = pinset.prog_fd(program)
            if fd is None:
                raise PinError(f"{pinset.path}: program {program} is not pinned there")
            self._progs[program] = fd
        self._linked = pinset.links()
        for name in self._linked:
            if name.startswith("tp-"):
                self._tracepoint_ids[name[3:].partition("-")[2]] = _linked_prog(pinset.path, name)
        self._multi = True
        if self.bpf is not None:  # the module's own maps and programs are not used
            for fn in self.bpf.funcs.values():
                os.close(fn.fd)
            self.bpf.funcs.clear()
            self.bpf.tables.clear()
            self.bpf.cleanup()
        made = pinset.description.get("created_realtime_ns", 0)
        log.info(
            "adopted the pinned recording at %s (made by stallwatch %s, pid %s, %d links; %s)",
            pinset.path,
            pinset.description.get("agent_version", "?"),
            pinset.description.get("agent_pid", "?"),
            len(self._linked),
            how,
        )
        log.debug("pin set created at %d", made)
        return maps

    def _link_sock_ops(self, prog_fd: int, building: pinning.Building | None) -> None:
        """The sock_ops program on the cgroup v2 root: without it (no cgroup
        v2, or a kernel refusing the link) retransmits are still recorded,
        with no connection state."""
        root = cgroup2_root()
        try:
            if root is None:
                raise OSError("no cgroup v2 hierarchy is mounted")
            link = bpfsys.cgroup_link(prog_fd, root, bpfsys.BPF_CGROUP_SOCK_OPS)
        except OSError as exc:
            log.warning(
                "TCP retransmits are recorded without the connection's state (RTO, RTT, "
                "bytes unacknowledged): cannot link %s to the cgroup root %s: %s",
                SOCK_OPS_PROGRAM,
                root,
                exc,
            )
            return
        self._links.append(link)
        if building is not None:
            building.pin_link(pinning.cgroup_link_name(SOCK_OPS_LINK[1]), link)

    def _attach_tracepoints(self, building: pinning.Building | None) -> None:
        try:
            fn = self.bpf.load_func(SOCK_OPS_PROGRAM.encode(), self._bcc.BPF.SOCK_OPS)
        except Exception as exc:  # BCC raises bare Exception
            raise ProbeError(
                f"cannot load sock_ops program {SOCK_OPS_PROGRAM}: {_short(exc)}"
            ) from exc
        self._link_sock_ops(int(fn.fd), building)
        for program, category, event in _tracepoints(self.bpf, self._lib):
            try:
                fn = self.bpf.load_func(program.encode(), self._bcc.BPF.TRACEPOINT)
                self._tracepoint_ids[event] = bpfsys.prog_info(int(fn.fd)).id
                try:
                    fd = bpfsys.tracepoint_link(int(fn.fd), category, event)
                except OSError as exc:  # no perf-event links before 5.15: BCC's way
                    if building is not None or not _unsupported(exc):
                        raise
                    self.bpf.attach_tracepoint(tp=f"{category}:{event}".encode(), fn_name=fn.name)
                    continue
            except Exception as exc:  # BCC raises bare Exception; OSError from bpf(2)
                raise ProbeError(
                    f"cannot attach tracepoint program {program} to {category}:{event}: "
                    f"{_short(exc)}"
                ) from exc
            self._links.append(fd)
            if building is not None:
                building.pin_link(pinning.tracepoint_link_name(category, event), fd)

    def tracepoints_skipped(self) -> dict[str, int]:
        """Per tracepoint (its event's name), the runs the kernel skipped: an
        event that came while another tracing program ran on its CPU (a
        softirq's retransmit interrupting a program in process context) is
        not seen by ours.  Kernels before 5.12 do not count them (0)."""
        out = {}
        for event, prog_id in self._tracepoint_ids.items():
            if not prog_id:
                continue
            try:
                fd = bpfsys.prog_fd_by_id(prog_id)
            except OSError:
                continue
            try:
                out[event] = bpfsys.prog_info(fd).recursion_misses
            finally:
                os.close(fd)
        return out

    # ---- views -------------------------------------------------------------

    @property
    def ring_arrays(self) -> dict[str, Any]:
        return self.maps.ring_arrays

    @property
    def inflight(self) -> Any:
        return self.maps.inflight

    def head(self, ring: str) -> int:
        return self.maps.head(ring)

    # ---- attach ---------------------------------------------------------

    def _multi_program(self, name: str) -> int | None:
        """The fd of program ``name`` loaded for uprobe_multi links; None
        (and perf events from now on) when this kernel cannot load it so."""
        if name in self._progs:
            return self._progs[name]
        try:
            fn = self.bpf.load_func(
                name.encode(), self._bcc.BPF.KPROBE, attach_type=bpfsys.BPF_TRACE_UPROBE_MULTI
            )
        except Exception as exc:  # BCC raises bare Exception
            if self._multi:
                raise ProbeError(f"cannot load uprobe program {name}: {_short(exc)}") from exc
            self._no_multi(f"cannot load {name} for uprobe_multi links: {_short(exc)}")
            return None
        self._progs[name] = int(fn.fd)
        return self._progs[name]

    def _no_multi(self, why: str) -> None:
        self._multi = False
        # BCC caches programs by name, and one loaded for uprobe_multi cannot
        # be attached to a perf event: BCC must load them again.
        for name in UPROBE_PROGRAMS:
            fn = self.bpf.funcs.pop(name.encode(), None)
            if fn is not None:
                os.close(fn.fd)
            self._progs.pop(name, None)
        log.warning(
            "%s; falling back to one perf-event uprobe per probe: stopping will take "
            "~0.1 s per attached probe",
            why,
        )

    def _function(self, path: str, symbol: str, program: str) -> discovery.ElfFunction:
        if path not in self._offsets:
            try:
                self._offsets[path] = discovery.elf_functions(path, [*ELF_SYMBOLS, LOADER_SYMBOL])
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
        return fn

    def _link_name(self, program: str, path: str, offset: int, kind: LinkKind) -> str:
        st = os.stat(path)
        name = pinning.link_name(program, st.st_dev, st.st_ino, offset)
        return name if kind is LinkKind.ENTRY else "r" + name

    def _link(
        self, path: str, symbol: str, cookie: int, programs: Sequence[tuple[str, LinkKind]]
    ) -> bool:
        """One uprobe_multi link per (program, kind) on ``symbol``; False,
        with nothing attached, when this kernel has no uprobe_multi links.
        A link already pinned (adopted) is not made again."""
        if self._multi is False:
            return False
        offset = self._function(path, symbol, programs[0][0]).file_offset
        made: list[tuple[str, int]] = []
        for program, kind in programs:
            name = self._link_name(program, path, offset, kind)
            if name in self._linked:
                continue
            prog_fd = self._multi_program(program)
            if prog_fd is None:
                close_links([fd for _, fd in made])
                return False
            try:
                made.append((name, uprobe_multi_link(prog_fd, path, [offset], [cookie], kind)))
            except OSError as exc:
                close_links([fd for _, fd in made])
                if self._multi is None and _unsupported(exc):
                    self._no_multi(f"uprobe_multi link refused: {exc.strerror}")
                    return False
                raise ProbeError(
                    f"cannot attach {kind.value} program {program} to {symbol} in {path} "
                    f"(uprobe_multi link at file offset {offset:#x}): {exc.strerror}"
                ) from exc
        if not self._said_multi:
            log.info("uprobes attached through uprobe_multi links")
            self._said_multi = True
        self._multi = True
        for name, fd in made:
            self._links.append(fd)
            self._linked.add(name)
            if self.pinset is not None:
                self.pinset.pin_link(name, fd)
        return True

    def attach_symbol(self, path: str, symbol: str) -> None:
        if symbol in CUDA_SYMBOLS:
            self._attach_cuda(path, symbol)
            return
        # The return first: a process calling the library while it is being
        # attached must not have an entry seen and its return missed.
        programs = ((RETURN_PROGRAM, LinkKind.RETURN), (ENTRY_PROGRAMS[symbol], LinkKind.ENTRY))
        if self._link(path, symbol, 0, programs):
            return
        for program, kind in programs:
            self._perf_uprobe(path, symbol, program, kind)

    def _attach_cuda(self, path: str, symbol: str) -> None:
        """A CUDA runtime function; from the first one on, nccl.c queues every
        collective on its stream (the `cuda_on` flag)."""
        self.maps.maps["cuda_on"].update(0, 1)
        returns = ((CUDA_RETURN_PROGRAM, LinkKind.RETURN),) if CUDA_SYMBOLS[symbol] else ()
        programs = (*returns, (CUDA_ENTRY_PROGRAM, LinkKind.ENTRY))  # the return first
        if self._link(path, symbol, CUDA_COOKIES[symbol], programs):
            return
        for program, kind in (*returns, (CUDA_ENTRY_PROGRAMS[symbol], LinkKind.ENTRY)):
            self._perf_uprobe(path, symbol, program, kind)

    def attach_exit(self, libc: str) -> None:
        """The exit-code probe on libc's ``_exit``."""
        if not self._link(libc, "_exit", 0, ((EXIT_PROGRAM, LinkKind.ENTRY),)):
            self._perf_uprobe(libc, "_exit", EXIT_PROGRAM, LinkKind.ENTRY)

    def attach_loader(self, ldso: str) -> None:
        """The discovery probe on a dynamic loader's ``_dl_debug_state``; its
        cookie leads it to the loader's list of objects (bpf/proc.c)."""
        cookie = discovery.r_debug_distance(ldso)
        if not self._link(ldso, LOADER_SYMBOL, cookie, ((LOADER_PROGRAM, LinkKind.ENTRY),)):
            self._perf_uprobe(ldso, LOADER_SYMBOL, LOADER_PROGRAM, LinkKind.ENTRY)

    def _perf_uprobe(self, path: str, symbol: str, program: str, kind: LinkKind) -> None:
        offset = self._function(path, symbol, program).file_offset
        if self.bpf is None:
            self._compile()  # adopted pins, and now a kernel refusing uprobe_multi links
        if self._perf is None:
            self._perf = PerfUprobes(self._lib._name)
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
        return tuple(self._perf.fds) if self._perf is not None else ()

    @property
    def attach_method(self) -> str:
        """How uprobes are (or will be) attached: "uprobe_multi" or "perf event"."""
        return "perf event" if self._multi is False else "uprobe_multi"

    # ---- maps -----------------------------------------------------------

    def set_pid(self, map_name: str, pid: int, present: bool) -> None:
        self.maps.set_pid(map_name, pid, present)

    def set_agent_self(self, tgid: int, port: int) -> None:
        """Whose TCP rows the programs leave out: the agent's process and
        its listening port (0: none)."""
        self.maps.set_agent_self(tgid, port)

    def drops(self) -> dict[str, int]:
        return self.maps.drops()

    def cuda_seen(self) -> dict[str, int]:
        """The CUDA runtime calls the probes saw, and their answers."""
        return self.maps.cuda_seen()

    def close(self) -> None:
        """Detach everything at once: links (unpinned ones wait a grace
        period each, together) and perf-event uprobes (old kernels: those
        take ~0.1 s each, in turn).  A pinned recording stays as it is."""
        perf = self._perf.fds if self._perf is not None else []
        links, self._links = self._links + perf, []
        if self._perf is not None:
            self._perf.fds = []
        close_links(links)
        maps = getattr(self, "maps", None)
        if maps is not None:
            maps.close()
        for name, fd in list(self._progs.items()):
            if self._own_progs:  # ours (pins, the cache); BCC's are closed by BCC
                os.close(fd)
            del self._progs[name]
        if self.pinset is not None:
            self.pinset.close()
        if self.bpf is not None:
            self.bpf.cleanup()


def compile_into(cache_dir: Path, sizes: RingSizes, runq_threshold_ns: int) -> tuple[Path, bool]:
    """The compile cache's entry of this build (these sizes and threshold,
    this kernel) at ``cache_dir``, and whether it was compiled now: an
    entry already there is kept (nothing compiled).  What an install or a
    boot runs once (``stallwatch record --compile-only``), so that an agent
    started with nothing pinned loads instead of compiling."""
    key = build_key(cflags(sizes, runq_threshold_ns))
    with compiled.compiling(cache_dir, key):
        if compiled.load(cache_dir, key) is not None:
            return compiled.path_for(cache_dir, key), False
        Probes(sizes, runq_threshold_ns, cache_dir=cache_dir, compile_only=True).close()
    return compiled.path_for(cache_dir, key), True


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
                b"handle_noop", bcc.BPF.KPROBE, attach_type=bpfsys.BPF_TRACE_UPROBE_MULTI
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

"""Uprobes: the NCCL, CUDA and process families' programs on the functions
of the libraries that processes map.

Uprobes go through uprobe_multi links (kernel 6.6+): a link per (program,
function), made here, pinned as it is made when the recording is pinned.
Where the kernel has no uprobe_multi, each uprobe is a perf-event uprobe
made through libbcc (one entry program per symbol; ~0.1 s each to stop)
and nothing is pinned.  Closing an unpinned link waits one RCU grace
period; ``close_links`` closes them all at once from threads, so that their
waits overlap.

Known limits: x86-64 only (argument registers); uprobes on a library fire
for every process that maps it, filtering is by the ``excluded`` map.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from stallwatch.dumpers.errors import ProbeError
from stallwatch.dumpers.schema import CUDA_SYMBOLS, NCCL_SYMBOLS

from . import bpfsys, cuda_probes, discovery, nccl_probes, pinning, proc_probes
from .bccmodule import BccModule, libbcc_name, short
from .uprobekinds import LinkKind

log = logging.getLogger("stallwatch.record")

# Every program attached through uprobe_multi links: loaded (and pinned) at
# start, so that an agent adopting a pin set can attach new libraries with
# them.  A program added to bpf/ that links are made from goes here.
PROGRAMS = (*nccl_probes.PROGRAMS, *proc_probes.PROGRAMS, *cuda_probes.PROGRAMS)
ELF_SYMBOLS = (*NCCL_SYMBOLS, *CUDA_SYMBOLS, proc_probes.EXIT_SYMBOL)
# What bpf(2) says when the kernel has no uprobe_multi links.
UNSUPPORTED_ERRNOS = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.E2BIG})
CLOSE_THREADS = 64  # links closed at once (their grace periods overlap)


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


def unsupported(exc: OSError) -> bool:
    return exc.errno in UNSUPPORTED_ERRNOS


class PerfUprobes:
    """Perf-event uprobes through libbcc's ``bpf_attach_uprobe`` with all
    seven of its arguments: BCC 0.26's Python binding declares six, so the
    kernel gets a garbage ``ref_ctr_offset`` (seen: 6), writes a counter at
    that offset of the library in every process, and refuses any other
    tool's uprobe on the same function (EINVAL, "ref_ctr_offset mismatch")."""

    def __init__(self, libbcc: str) -> None:
        self._attach = ctypes.CDLL(libbcc, use_errno=True).bpf_attach_uprobe
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


class Uprobes:
    """The uprobe programs and their links.  ``module`` gives the compiled
    BCC module (compiling it if need be: an adopted recording on a kernel
    that then refuses uprobe_multi links); ``pin`` pins a link as it is made
    (where the recording is pinned)."""

    def __init__(
        self,
        module: Callable[[], BccModule],
        pin: Callable[[str, int], None],
        multi: bool | None,
    ) -> None:
        self._module = module
        self._pin = pin
        self.multi = multi  # None: untried; False: perf events from now on
        self.progs: dict[str, int] = {}  # uprobe_multi programs: name -> fd
        self.own_progs = False  # the programs' fds are ours to close (not BCC's)
        self.links: list[int] = []
        self.linked: set[str] = set()  # pin names of the links made or adopted
        self._offsets: dict[str, dict[str, discovery.ElfFunction]] = {}
        self._perf: PerfUprobes | None = None
        self._said_multi = False

    # ---- programs --------------------------------------------------------

    def program(self, name: str) -> int | None:
        """The fd of program ``name`` loaded for uprobe_multi links; None
        (and perf events from now on) when this kernel cannot load it so."""
        if name in self.progs:
            return self.progs[name]
        try:
            fd = self._module().load(
                name, bpfsys.BPF_PROG_TYPE_KPROBE, bpfsys.BPF_TRACE_UPROBE_MULTI
            )
        except ProbeError as exc:
            if self.multi:
                raise ProbeError(f"cannot load uprobe program {name}: {exc}") from exc
            self._no_multi(f"cannot load {name} for uprobe_multi links: {exc}")
            return None
        self.progs[name] = fd
        return fd

    def _no_multi(self, why: str) -> None:
        self.multi = False
        # one loaded for uprobe_multi cannot be attached to a perf event
        module = self._module()
        for name in PROGRAMS:
            module.forget(name)
            self.progs.pop(name, None)
        log.warning(
            "%s; falling back to one perf-event uprobe per probe: stopping will take "
            "~0.1 s per attached probe",
            why,
        )

    # ---- links ---------------------------------------------------------------

    def _function(self, path: str, symbol: str, program: str) -> discovery.ElfFunction:
        if path not in self._offsets:
            wanted = [*ELF_SYMBOLS, proc_probes.LOADER_SYMBOL]
            try:
                self._offsets[path] = discovery.elf_functions(path, wanted)
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

    def link(
        self, path: str, symbol: str, cookie: int, programs: Sequence[tuple[str, LinkKind]]
    ) -> bool:
        """One uprobe_multi link per (program, kind) on ``symbol``; False,
        with nothing attached, when this kernel has no uprobe_multi links.
        A link already pinned (adopted) is not made again."""
        if self.multi is False:
            return False
        offset = self._function(path, symbol, programs[0][0]).file_offset
        made: list[tuple[str, int]] = []
        for program, kind in programs:
            name = self._link_name(program, path, offset, kind)
            if name in self.linked:
                continue
            prog_fd = self.program(program)
            if prog_fd is None:
                close_links([fd for _, fd in made])
                return False
            try:
                made.append((name, uprobe_multi_link(prog_fd, path, [offset], [cookie], kind)))
            except OSError as exc:
                close_links([fd for _, fd in made])
                if self.multi is None and unsupported(exc):
                    self._no_multi(f"uprobe_multi link refused: {exc.strerror}")
                    return False
                raise ProbeError(
                    f"cannot attach {kind.value} program {program} to {symbol} in {path} "
                    f"(uprobe_multi link at file offset {offset:#x}): {exc.strerror}"
                ) from exc
        self._linked_all(made)
        return True

    def _linked_all(self, made: list[tuple[str, int]]) -> None:
        if not self._said_multi:
            log.info("uprobes attached through uprobe_multi links")
            self._said_multi = True
        self.multi = True
        for name, fd in made:
            self.links.append(fd)
            self.linked.add(name)
            self._pin(name, fd)

    def perf_uprobe(self, path: str, symbol: str, program: str, kind: LinkKind) -> None:
        offset = self._function(path, symbol, program).file_offset
        module = self._module()
        if self._perf is None:
            self._perf = PerfUprobes(libbcc_name())
        try:
            fd = module.load(program, bpfsys.BPF_PROG_TYPE_KPROBE)
            self._perf.attach(fd, path, offset, kind)
        except (ProbeError, OSError) as exc:
            raise ProbeError(
                f"cannot attach {kind.value} program {program} to {symbol} in {path}: {short(exc)}"
            ) from exc

    # ---- the families ------------------------------------------------------

    def attach_nccl(self, path: str, symbol: str) -> None:
        programs = nccl_probes.programs_of(symbol)
        if not self.link(path, symbol, 0, programs):
            for program, kind in programs:
                self.perf_uprobe(path, symbol, program, kind)

    def attach_cuda(self, path: str, symbol: str) -> None:
        cookie = cuda_probes.COOKIES[symbol]
        if not self.link(path, symbol, cookie, cuda_probes.linked_programs(symbol)):
            for program, kind in cuda_probes.perf_programs(symbol):
                self.perf_uprobe(path, symbol, program, kind)

    def attach_exit(self, libc: str) -> None:
        """The exit-code probe on libc's ``_exit``."""
        symbol, program = proc_probes.EXIT_SYMBOL, proc_probes.EXIT_PROGRAM
        if not self.link(libc, symbol, 0, ((program, LinkKind.ENTRY),)):
            self.perf_uprobe(libc, symbol, program, LinkKind.ENTRY)

    def attach_loader(self, ldso: str) -> None:
        """The discovery probe on a dynamic loader's ``_dl_debug_state``; its
        cookie leads it to the loader's list of objects (bpf/proc.c)."""
        cookie = discovery.r_debug_distance(ldso)
        symbol, program = proc_probes.LOADER_SYMBOL, proc_probes.LOADER_PROGRAM
        if not self.link(ldso, symbol, cookie, ((program, LinkKind.ENTRY),)):
            self.perf_uprobe(ldso, symbol, program, LinkKind.ENTRY)

    # ---- the end -----------------------------------------------------------

    @property
    def perf_fds(self) -> tuple[int, ...]:
        """The perf events of the fallback (none with uprobe_multi)."""
        return tuple(self._perf.fds) if self._perf is not None else ()

    def take_links(self) -> list[int]:
        """Every link and perf event, handed over for closing (all at once,
        with the others)."""
        out = self.links + list(self.perf_fds)
        self.links = []
        if self._perf is not None:
            self._perf.fds = []
        return out

    def close_programs(self) -> None:
        for name, fd in list(self.progs.items()):
            if self.own_progs:  # ours (pins, the cache); BCC's are closed by BCC
                os.close(fd)
            del self.progs[name]

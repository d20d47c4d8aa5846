"""Finding the job's processes and attaching to what they run: every
libnccl (and CUDA runtime) they map, once per file; their libc's ``_exit``
for exit codes; the dynamic loaders that report the libraries a process
loads.  New processes come from the kernel's discovery events where the
source has them (a /proc scan at the first call and after lost events),
else from an incremental /proc scan.  Which of them are the job's is the
agent's to say (``classify``: its scope); this room only finds and attaches.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from stallwatch.dumpers.errors import ProbeError
from stallwatch.dumpers.schema import CUDA_SYMBOLS, NCCL_SYMBOLS

from . import discovery
from .source import EventSource

log = logging.getLogger("stallwatch.record")


@dataclass(slots=True)
class AttachedLibrary:
    path: str
    symbols: tuple[str, ...]
    skipped: tuple[str, ...]
    first_instructions: dict[str, str]


class Attacher:
    """What the agent attached, and how it finds more."""

    def __init__(
        self,
        source: EventSource,
        classify: Callable[[int, tuple[str, ...]], bool],
        placed: Callable[[int], bool | None],
        gone: Callable[[int, int], None],
        count: Callable[[str, int], None],
    ) -> None:
        """``classify``: put a process found in scope or out of it;
        ``placed``: whether it was (None: not yet); ``gone``: a process
        the scan no longer finds, and when; ``count``: the agent's counters."""
        self.source, self.classify, self.placed, self.gone = source, classify, placed, gone
        self._count = count
        self.libraries: dict[discovery.LibraryId, AttachedLibrary] = {}
        self.scanner = discovery.ProcessScanner()
        ring = source.discovery_ring()
        self.events = discovery.KernelDiscovery(ring) if ring is not None else None
        self._scan_everything = True
        self._own_root = discovery.root_id(os.getpid())
        self.loaders: set[discovery.LibraryId] = set()
        self._pacer = discovery.Pacer()
        self._libcs: set[discovery.LibraryId] = set()

    def count(self, name: str, n: int = 1) -> None:
        self._count(name, n)

    def waiting(self) -> bool:
        """Whether discovery has processes it will look at later."""
        return self._pacer.waiting()

    def attach_library(self, path: str, required: bool = False) -> AttachedLibrary | None:
        """Attach every NCCL symbol ``path`` defines, or every CUDA runtime
        symbol we probe if it is a CUDA runtime, once per file."""
        try:
            lib_id = discovery.library_id(path)
            functions = discovery.elf_functions(path, NCCL_SYMBOLS)
            wanted: tuple[str, ...] = tuple(NCCL_SYMBOLS)
            if not functions:
                functions = discovery.elf_functions(path, CUDA_SYMBOLS)
                wanted = tuple(CUDA_SYMBOLS)
        except (OSError, ValueError) as exc:
            return self._attach_failed(path, f"cannot read {path}: {exc}", required)
        if lib_id in self.libraries:
            return self.libraries[lib_id]
        if not functions:
            why = f"{path} defines no NCCL symbol (nor the CUDA runtime's)"
            return self._attach_failed(path, why, required)
        firsts = {n: discovery.first_instruction(path, f) for n, f in functions.items()}
        try:
            for name in functions:
                self.source.attach(path, name)
        except ProbeError as exc:
            return self._attach_failed(path, str(exc), required)
        skipped = tuple(s for s in wanted if s not in functions)
        lib = AttachedLibrary(path, tuple(functions), skipped, firsts)
        self.libraries[lib_id] = lib
        self._log_attached(lib)
        return lib

    def _attach_failed(self, path: str, why: str, required: bool) -> AttachedLibrary | None:
        self.count("attach_failures")
        if required:
            raise ProbeError(why)
        log.error("not recording %s: %s", path, why)
        return None

    def _log_attached(self, lib: AttachedLibrary) -> None:
        stepped = sorted(n for n, i in lib.first_instructions.items() if not discovery.emulated(i))
        kinds = sorted(set(lib.first_instructions.values()))
        log.info(
            "attached %s: %d symbols, first instructions: %s",
            lib.path,
            len(lib.symbols),
            ", ".join(kinds),
        )
        if stepped:
            log.warning(
                "%s: %d entry points do not begin with push (uprobe single-steps, slower): %s",
                lib.path,
                len(stepped),
                " ".join(f"{n}={lib.first_instructions[n]}" for n in stepped),
            )
        if lib.skipped:
            self.count("symbols_skipped", len(lib.skipped))
            log.info("%s: skipped symbols it lacks: %s", lib.path, " ".join(lib.skipped))

    def attach_pid(self, pid: int) -> None:
        """--pid: its libnccl, or its executable when NCCL is linked in."""
        libs = discovery.mapped_nccl_libs(pid)
        if libs is None:
            raise ProbeError(f"--pid {pid}: no such process")
        for lib in libs:
            self.attach_library(discovery.reachable_path(pid, lib), required=True)
        if not libs:
            exe = f"/proc/{pid}/exe"
            if "ncclAllReduce" not in discovery.elf_functions(exe, ("ncclAllReduce",)):
                raise ProbeError(f"--pid {pid}: maps no libnccl and its executable has no NCCL")
            self.attach_library(os.path.realpath(exe), required=True)
        self.classify(pid, libs)

    def attach_exit_probe(self, pid: int) -> None:
        """Exit codes come from a uprobe on the process's libc ``_exit``."""
        libc = discovery.mapped_libc(pid)
        if libc is None:
            return
        path = discovery.reachable_path(pid, libc)
        try:
            lib_id = discovery.library_id(path)
            if lib_id in self._libcs:
                return
            self.source.attach_exit(path)
        except (OSError, ProbeError) as exc:
            self.count("attach_failures")
            log.error("exit codes of pid %d will be missing: %s", pid, exc)
            return
        self._libcs.add(lib_id)
        log.info("attached exit-code probe to %s", path)

    def discover(self) -> None:
        """New NCCL processes: from the kernel's discovery events where the
        source has them (a /proc scan at the first call and after lost
        events), else from an incremental /proc scan."""
        if self.events is None:
            self._scan_incrementally()
            return
        if self._scan_everything:
            self._scan_everything = False
            self.events.mark()
            self._full_scan()
        execs, changed, lost = self.events.pending()
        if lost:
            self.count("discovery_rescans")
            self._scan_everything = True
        # A dynamically linked program's loader reports its GPU libraries:
        # an exec alone (a static program) is not looked into, unless it
        # runs under a loader probed only now (its first libraries came
        # before the probe).
        changed |= {pid for pid in execs if self._new_image(pid)}
        due = self._pacer.due(changed, time.monotonic())
        self.count("discovery_processes", len(execs | changed))
        for pid in due:
            self._examine(pid)

    def _scan_incrementally(self) -> None:
        found, gone = self.scanner.scan()
        for pid, libs in found.items():
            self._found(pid, libs)
        now = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        for pid in gone:
            self.gone(pid, now)

    def _found(self, pid: int, libs: tuple[str, ...]) -> None:
        for lib in libs:
            self.attach_library(discovery.reachable_path(pid, lib))
        self.classify(pid, libs)

    def _full_scan(self) -> None:
        """Every process's maps, once: its libnccl, and its dynamic loader
        (probed, so that its later libraries are seen as they come)."""
        own = discovery.mapped_loader(os.getpid())
        if own is not None:
            self._attach_loader(own, os.getpid())
        for pid, (libs, loader) in discovery.scan_all(os.getpid()).items():
            if loader is not None:
                self._attach_loader(loader, pid)
            if libs:
                self._found(pid, libs)

    def _new_image(self, pid: int) -> bool:
        """A process exec'd: under another root (a container) its dynamic
        loader may be one not probed yet.  True if it was probed now."""
        root = discovery.root_id(pid)
        if root is None or root == self._own_root:
            return False
        loader = discovery.mapped_loader(pid)
        return loader is not None and self._attach_loader(loader, pid)

    def _examine(self, pid: int) -> None:
        if pid == os.getpid() or self.placed(pid) is not None:
            return  # known: a process in scope keeps its libraries attached
        self.count("discovery_maps_read")
        libs = discovery.mapped_nccl_libs(pid)
        if libs:
            self._found(pid, libs)

    def _attach_loader(self, loader: str, pid: int) -> bool:
        """Probe a dynamic loader; True if it was not probed before."""
        path = discovery.reachable_path(pid, loader)
        try:
            lib_id = discovery.library_id(path)
            if lib_id in self.loaders:
                return False
            self.loaders.add(lib_id)
            self.source.attach_loader(path)
        except (OSError, ProbeError) as exc:
            self.count("attach_failures")
            log.error("libraries loaded through %s will be found late: %s", path, exc)
            return False
        log.info("discovery probe on the dynamic loader %s", path)
        return True

"""Find the NCCL libraries that processes map, and what is inside them.

- ``KernelDiscovery`` reads the kernel's discovery events (``bpf/proc.c``): a
  process that replaced its image (exec) or whose dynamic loader just loaded
  a library named like NCCL or the CUDA runtime (``_dl_debug_state``:
  start-up, dlopen; the program reads the loader's list of objects).  Only
  those processes' maps are read, when it happens: no periodic scan of /proc.  A
  process whose root is not the agent's (a container) may run another
  dynamic loader: its exec makes the agent find that loader and probe it too.
- ``scan_all`` reads every process's maps once (at start, and if the
  discovery ring ever overflows): NCCL libraries and dynamic loaders.
- What is looked for in a process's maps: a library named ``libnccl.so*``
  anywhere on disk (virtual environments included: the cu12 and cu13 wheels
  alike), and the CUDA runtime ``libcudart.so.<major>`` the same process maps.
- ``ProcessScanner`` is the fallback where there are no kernel events (the
  replay source of tests): it lists ``/proc`` and reads the maps of
  processes it has not classified yet.  Processes that map no NCCL are
  re-read while young (a Python rank loads NCCL a few seconds after it
  starts), then rarely.
- ``elf_functions`` reads the ELF symbol tables (``.dynsym`` and ``.symtab``)
  of a file: which NCCL entry points it defines and where they start, so a
  missing symbol is skipped rather than failing the attach, a statically
  linked executable is recognised, and the first instruction of each entry
  point is checked (a uprobe on ``push`` is emulated; on ``endbr64`` and most
  others the kernel single-steps it, more than ten times slower here).

Known limits: ELF64 little-endian only; processes in another mount namespace
are resolved through ``/proc/PID/root``.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from stallwatch.dumpers.model import ProcessInfo

from .maps import DISC_EXEC, DISC_LINKMAP
from .rings import RingBuffer

NCCL_LIB = re.compile(r"/libnccl\.so[^/]*$")
# NCCL and the CUDA runtime a process maps beside it (any major version:
# libcudart.so.12 from nvidia-cuda-runtime-cu12, .13 from nvidia-cuda-runtime)
GPU_LIBS = re.compile(r"/(libnccl\.so[^/]*|libcudart\.so\.[0-9]+(\.[0-9.]+)?)$")
CUDART_LIB = re.compile(r"/libcudart\.so\.[0-9]+(\.[0-9.]+)?$")
LIBC = re.compile(r"/libc(\.so\.6|-[0-9.]+\.so)$")
LOADER = re.compile(r"/ld-linux[^/]*\.so[^/]*$")
YOUNG_S = 30.0  # a process this young may still load NCCL: its maps are re-read
YOUNG_RESCAN_S = 0.5  # this often (a new process is read at its first scan)
OLD_RESCAN_S = 10.0  # older processes this often
SHT_SYMTAB = 2
SHT_DYNSYM = 11
STT_OBJECT = 1
STT_FUNC = 2


@dataclass(frozen=True, slots=True)
class LibraryId:
    dev: int
    inode: int


@dataclass(frozen=True, slots=True)
class ElfFunction:
    name: str
    file_offset: int
    vaddr: int = 0  # st_value: where it lies in the loaded image, before relocation


def _sections(data: mmap.mmap) -> list[tuple[int, int, int, int, int, int]]:
    """(type, addr, offset, size, link, entsize) of every section."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a little-endian ELF64 file")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    out = []
    for i in range(shnum):
        base = shoff + i * shentsize
        _, stype, _, addr, off, size, link, _, _, entsize = struct.unpack_from(
            "<IIQQQQIIQQ", data, base
        )
        out.append((stype, addr, off, size, link, entsize))
    return out


def elf_functions(path: str, wanted: Iterable[str]) -> dict[str, ElfFunction]:
    """The defined functions among ``wanted`` in ``path``, with file offsets."""
    return _symbols(path, wanted, (STT_FUNC,))


def r_debug_distance(loader: str) -> int:
    """Bytes from a dynamic loader's ``_dl_debug_state`` to its ``_r_debug``
    (the list of loaded objects the discovery probe reads, bpf/proc.c), as
    an attach cookie (two's complement); 0 if either is missing."""
    found = _symbols(loader, ("_dl_debug_state", "_r_debug"), (STT_FUNC, STT_OBJECT))
    if len(found) != 2:
        return 0
    return (found["_r_debug"].vaddr - found["_dl_debug_state"].vaddr) & 0xFFFF_FFFF_FFFF_FFFF


def _symbols(path: str, wanted: Iterable[str], types: tuple[int, ...]) -> dict[str, ElfFunction]:
    names = {n.encode(): n for n in wanted}
    with open(path, "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _find(data, names, types)
    finally:
        data.close()


def _find(
    data: mmap.mmap, names: dict[bytes, str], types: tuple[int, ...]
) -> dict[str, ElfFunction]:
    sections = _sections(data)
    found: dict[str, ElfFunction] = {}
    for stype, _, off, size, link, entsize in sections:
        if stype not in (SHT_SYMTAB, SHT_DYNSYM) or not entsize:
            continue
        str_off = sections[link][2]
        for base in range(off, off + size, entsize):
            st_name, st_info, _, st_shndx, st_value, _ = struct.unpack_from("<IBBHQQ", data, base)
            if st_info & 0xF not in types or st_shndx == 0 or st_shndx >= len(sections):
                continue
            end = data.find(b"\0", str_off + st_name)
            name = names.get(bytes(data[str_off + st_name : end]))
            if name is None or name in found:
                continue
            _, s_addr, s_off, _, _, _ = sections[st_shndx]
            found[name] = ElfFunction(name, st_value - s_addr + s_off, st_value)
    return found


def describe_first_instruction(code: bytes) -> str:
    """Name the first instruction of a function, as far as uprobes care."""
    if code[:1] == b"\x55":
        return "push %rbp"
    if code[:1] in (b"\x53", b"\x54", b"\x56", b"\x57") or (
        code[:1] == b"\x41" and 0x50 <= code[1] <= 0x57
    ):
        return "push"
    if code[:4] == b"\xf3\x0f\x1e\xfa":
        return "endbr64"
    if code[:1] in (b"\x48", b"\x49") and code[1:2] in (b"\xb8", b"\xb9", b"\xba", b"\xbb"):
        return "movabs"
    if code[:1] in (b"\x48", b"\x4c") and code[1:2] == b"\x8d":
        return "lea"
    if code[:1] == b"\xe9":
        return "jmp"
    if code[:1] == b"\x48" and code[1:2] in (b"\x83", b"\x81") and code[2] == 0xEC:
        return "sub %rsp"
    return "other " + code[:4].hex()


def first_instruction(path: str, fn: ElfFunction) -> str:
    with open(path, "rb") as f:
        f.seek(fn.file_offset)
        return describe_first_instruction(f.read(8))


def emulated(description: str) -> bool:
    """True when a uprobe on this instruction is emulated rather than stepped."""
    return description.startswith("push")


def library_id(path: str) -> LibraryId:
    st = os.stat(path)
    return LibraryId(st.st_dev, st.st_ino)


def mapped_nccl_libs(pid: int) -> tuple[str, ...] | None:
    """Paths of the libnccl* files mapped by ``pid``, and of the CUDA runtime
    beside them (empty if it maps no libnccl); None if it is gone."""
    libs = mapped_files(pid, GPU_LIBS, "libnccl")
    if libs and not any(NCCL_LIB.search(p) for p in libs):
        return ()
    return libs


def mapped_libc(pid: int) -> str | None:
    libs = mapped_files(pid, LIBC, "libc")
    return libs[0] if libs else None


def mapped_loader(pid: int) -> str | None:
    """The dynamic loader a process runs under (None: static, or gone)."""
    libs = mapped_files(pid, LOADER, "ld-linux")
    return libs[0] if libs else None


def root_id(pid: int | str) -> tuple[int, int] | None:
    """(device, inode) of a process's root directory; None if it is gone."""
    try:
        st = os.stat(f"/proc/{pid}/root")
    except OSError:
        return None
    return st.st_dev, st.st_ino


def scan_all(self_pid: int) -> dict[int, tuple[tuple[str, ...], str | None]]:
    """Every process: (libnccl paths, dynamic loader) from one read of its maps."""
    out: dict[int, tuple[tuple[str, ...], str | None]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == self_pid:
            continue
        pid = int(entry)
        try:
            text = Path(f"/proc/{pid}/maps").read_text()
        except (OSError, UnicodeDecodeError):
            continue
        libs, loader = _paths(text, GPU_LIBS, "libnccl"), _paths(text, LOADER, "ld-linux")
        if not any(NCCL_LIB.search(p) for p in libs):
            libs = ()  # a CUDA runtime alone is not a rank
        if libs or loader:
            out[pid] = (libs, loader[0] if loader else None)
    return out


def _paths(text: str, name: re.Pattern[str], hint: str) -> tuple[str, ...]:
    if hint not in text:  # the common case, without parsing a line
        return ()
    found: list[str] = []
    for line in text.splitlines():
        fields = line.split(maxsplit=5)
        path = fields[5].strip() if len(fields) == 6 else ""
        if path.startswith("/") and name.search(path) and path not in found:
            found.append(path)
    return tuple(found)


def mapped_files(pid: int, name: re.Pattern[str], hint: str) -> tuple[str, ...] | None:
    """Paths of files matching ``name`` mapped by ``pid``; None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/maps").read_text()
    except (OSError, UnicodeDecodeError):
        return None
    return _paths(text, name, hint)


def reachable_path(pid: int, path: str) -> str:
    """The file a process maps, as this process reaches it.  The maps name
    it as its own mount namespace does: a container's /lib64/ld-linux or
    libnccl is another file than the host's of that name, reached through
    /proc/PID/root; a chroot's shows its full path.  The inode the maps
    give decides."""
    inode = _mapped_inode(pid, path)
    for candidate in (path, f"/proc/{pid}/root{path}"):
        try:
            st = os.stat(candidate)
        except OSError:
            continue
        if inode is None or st.st_ino == inode:
            return candidate
    return f"/proc/{pid}/root{path}"


def _mapped_inode(pid: int, path: str) -> int | None:
    try:
        text = Path(f"/proc/{pid}/maps").read_text()
    except (OSError, UnicodeDecodeError):
        return None
    for line in text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].strip() == path and fields[4].isdigit():
            return int(fields[4])
    return None


def netns_of(pid: int) -> int:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return 0


def _start_ns(pid: int) -> int:
    """Process start in CLOCK_MONOTONIC ns (boot time, assuming no suspend)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    fields = stat.rsplit(")", 1)[1].split()
    ticks = int(fields[19])
    return ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def process_info(pid: int, libs: tuple[str, ...]) -> ProcessInfo | None:
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    cmdline = raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")
    return ProcessInfo(pid, comm, cmdline, netns_of(pid), _start_ns(pid), libs)


def _vsize(pid: int) -> int:
    """Virtual memory size (/proc/PID/stat): it changes when a library is
    mapped, and is much cheaper to read than the maps of a Python process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return -1
    return int(stat.rsplit(b")", 1)[1].split()[20])


@dataclass(slots=True)
class _Seen:
    first: float
    last: float = -1.0
    vsize: int = -2


@dataclass(slots=True)
class ProcessScanner:
    """Incremental scan of /proc for processes that map libnccl.  A process's
    maps are read when it is first seen, then re-read (while it is young
    often, later rarely) only if its virtual size changed."""

    self_pid: int = field(default_factory=os.getpid)
    _seen: dict[int, _Seen] = field(default_factory=dict)
    _nccl: dict[int, tuple[str, ...]] = field(default_factory=dict)
    _scans: int = 0

    def scan(self, now: float | None = None) -> tuple[dict[int, tuple[str, ...]], set[int]]:
        """New NCCL processes (pid -> libs) and pids that disappeared."""
        now = time.monotonic() if now is None else now
        pids = {int(p) for p in os.listdir("/proc") if p.isdigit()}
        gone = {p for p in self._nccl if p not in pids}
        for p in set(self._seen) - pids:
            del self._seen[p]
        for p in gone:
            del self._nccl[p]
        found: dict[int, tuple[str, ...]] = {}
        # Processes already running at the first scan are not young.
        born = now - YOUNG_S - 1 if self._scans == 0 else now
        self._scans += 1
        for pid in pids:
            if pid == self.self_pid or pid in self._nccl or not self._due(pid, now, born):
                continue
            libs = mapped_nccl_libs(pid)
            if libs:
                self._nccl[pid] = libs
                found[pid] = libs
        return found, gone

    def _due(self, pid: int, now: float, born: float) -> bool:
        seen = self._seen.setdefault(pid, _Seen(born))
        if seen.last >= 0:
            every = YOUNG_RESCAN_S if now - seen.first <= YOUNG_S else OLD_RESCAN_S
            if now - seen.last < every:
                return False
        seen.last = now
        vsize = _vsize(pid)
        changed = vsize != seen.vsize
        seen.vsize = vsize
        return changed and vsize != 0  # kernel threads have no memory

    def known(self) -> dict[int, tuple[str, ...]]:
        return dict(self._nccl)


@dataclass(slots=True)
class KernelDiscovery:
    """The processes the kernel's discovery ring names since the last read.

    ``pending`` returns (pids that exec'd, pids whose loader changed its
    objects, whether rows were lost): the ring overwrites its oldest rows, so
    more events between two reads than it holds mean a /proc scan."""

    ring: RingBuffer
    seen: int = -1  # ring positions up to this one were read

    def mark(self) -> None:
        """From now on: called before a /proc scan, so that a process that
        starts during the scan is in the scan or in the next events."""
        self.seen = self.ring.read_head()

    def pending(self) -> tuple[set[int], set[int], bool]:
        head = self.ring.read_head()
        if self.seen < 0:
            self.seen = head  # the scan at start covers what came before
        if head == self.seen:
            return set(), set(), False
        lost = head - self.seen > self.ring.capacity
        rows, head = self.ring.rows_since(self.seen)
        self.seen = _first_gap(rows["pos"], self.seen, head, self.ring.capacity)
        execs: set[int] = set()
        links: set[int] = set()
        # a few rows a tick: plain Python beats numpy's per-call overhead
        for pid, event in zip(rows["pid"].tolist(), rows["event"].tolist(), strict=True):
            if event == DISC_EXEC:
                execs.add(pid)
            elif event == DISC_LINKMAP:
                links.add(pid)
        return execs, links, lost


def _first_gap(positions: np.ndarray, seen: int, head: int, capacity: int) -> int:
    """The position up to which every row still in the ring was read: a row
    being written (its position claimed, not yet published) is read next
    time (and the rows after it again: handling them is idempotent)."""
    low = max(seen, head - capacity)
    if len(positions) == head - low:  # rows_since keeps only these positions
        return head
    expected = np.arange(low + 1, head + 1, dtype=np.uint64)
    missing = np.setdiff1d(expected, positions.astype(np.uint64))
    return int(missing[0]) - 1 if len(missing) else head


@dataclass(slots=True)
class Pacer:
    """When to look at a process an event named: ``delay_s`` after its
    first event (a short-lived process, a shell's /bin/true, is gone by
    then: nothing to read), then at most once per ``every_s``, the later
    events of a burst (a Python process importing modules dlopens hundreds
    of libraries) together, so that a library loaded in the middle of a
    burst is still seen."""

    delay_s: float = 0.15  # longer than the kernel's DISC_PERIOD_NS (bpf/proc.c)
    every_s: float = 1.0
    _last: dict[int, float] = field(default_factory=dict)
    _waiting: dict[int, float] = field(default_factory=dict)  # pid -> due

    def due(self, pids: set[int], now: float) -> set[int]:
        for pid in pids:
            if pid not in self._waiting:
                last = self._last.get(pid)
                after = now + self.delay_s  # past any call the kernel skipped
                self._waiting[pid] = after if last is None else max(after, last + self.every_s)
        out = {p for p, when in self._waiting.items() if when <= now}
        for pid in out:
            del self._waiting[pid]
            self._last[pid] = now
        if len(self._last) > PACER_KEPT:
            self._last = {p: t for p, t in self._last.items() if now - t < self.every_s}
        return out

    def waiting(self) -> bool:
        """Whether a process is still to be looked at."""
        return bool(self._waiting)


PACER_KEPT = 4096

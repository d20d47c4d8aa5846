"""Walks a thread's user stack from outside its process, with no frame pointers
and no ptrace: from the stack pointer and instruction pointer the kernel saved
when the thread entered the kernel (``/proc/PID/task/TID/syscall``), reading
its memory through ``/proc/PID/mem`` while it keeps running or sleeping.

Each frame is stepped with the call frame information of the module that holds
its instruction (``recorder.cfi``): the caller's stack pointer (the CFA) is a
known register plus an offset, the return address is saved at CFA-8, and the
callee-saved registers that later frames may need (rbp, rbx, r12-r15) are read
where the rule says they were saved.  Only rsp is known at the start.  A frame
whose CFA is based on a register not known yet (rbp, in code built with frame
pointers, when no inner frame saved it) is recovered by scanning up the stack
for its return address: the first word that points just past a call to that
very function (a direct call, a call through the PLT or a rip-relative
pointer that resolves to the function's start); failing that, the first word
just past an indirect call.  Such frames are marked ``scanned``.

A frame in an address no module covers, or a module without call frame
information, ends the walk (``how`` of the last frame says why).

A function with a uretprobe (stallwatch's own, or any other tracer's) returns
through the kernel's trampoline (the ``[uprobes]`` page): its return address
on the stack is the trampoline's, the real one is held by the kernel.  The
frame of its caller is then unknown; the walk resumes at the caller's own
return address, the first word above that is a return address from a call to
a function that calls the probed one (directly or through the PLT), failing
that from a call to a function with an indirect call in it.  The caller shows
as a ``[uprobes]`` frame.

Known limits: x86-64 only; DWARF expressions in rules (PLT stubs, signal
trampolines) end the walk; a scanned frame can be wrong when a stale return
address from an earlier call to the same function lies below the real one.
"""

from __future__ import annotations

import bisect
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from .cfi import RA, RBP, RSP, CfiError, FrameTable, Rule
from .elfimage import ElfError, ElfImage, Symbol, file_key

CALLEE_SAVED = (3, RBP, 12, 13, 14, 15)  # rbx, rbp, r12-r15 (DWARF numbers)
MAX_FRAMES = 64
UPROBES = "[uprobes]"  # the kernel's page of uprobe trampolines
SCAN_BYTES = 64 * 1024  # how far up the stack a frame's return address is looked for
WEAK_LEAD = 4096  # past an indirect-call candidate, how far a direct one is still looked for
PAGE = 4096
READ_PAGES = 4


@dataclass(frozen=True, slots=True)
class Mapping:
    start: int
    end: int
    perms: str
    offset: int
    inode: int
    path: str


class ProcessMaps:
    """``/proc/PID/maps``, sorted, for address lookups."""

    def __init__(self, text: str) -> None:
        maps = []
        for line in text.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) < 5:
                continue
            lo, _, hi = fields[0].partition("-")
            path = fields[5].strip() if len(fields) == 6 else ""
            maps.append(
                Mapping(int(lo, 16), int(hi, 16), fields[1], int(fields[2], 16),
                        int(fields[4]), path)
            )  # fmt: skip
        maps.sort(key=lambda m: m.start)
        self.maps = maps
        self._starts = [m.start for m in maps]
        code = [m for m in maps if "x" in m.perms and m.path.startswith("/")]
        self.code_lo = np.array([m.start for m in code], dtype=np.uint64)
        self.code_hi = np.array([m.end for m in code], dtype=np.uint64)

    def code_words(self, words: np.ndarray) -> np.ndarray:
        """Indices of the words that point into executable file mappings."""
        i = np.searchsorted(self.code_lo, words, side="right") - 1
        inside = (i >= 0) & (words < self.code_hi[np.maximum(i, 0)])
        return np.flatnonzero(inside)

    @classmethod
    def of(cls, pid: int) -> ProcessMaps | None:
        try:
            with open(f"/proc/{pid}/maps") as f:
                return cls(f.read())
        except (OSError, UnicodeDecodeError):
            return None

    def find(self, addr: int) -> Mapping | None:
        i = bisect.bisect_right(self._starts, addr) - 1
        if i >= 0 and addr < self.maps[i].end:
            return self.maps[i]
        return None


class ProcessMemory:
    """Reads of another process's memory, a few pages at a time, cached for
    the duration of one snapshot (the thread is asleep; a page read twice
    would not be worth the syscall)."""

    def __init__(self, pid: int) -> None:
        self.fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
        self.pages: dict[int, bytes] = {}
        self.reads = 0

    def read(self, addr: int, n: int) -> bytes | None:
        out = b""
        while len(out) < n:
            page = (addr + len(out)) & ~(PAGE - 1)
            data = self.pages.get(page)
            if data is None:
                data = self._fetch(page)
                if data is None:
                    return None
            lo = addr + len(out) - page
            out += data[lo : lo + n - len(out)]
        return out

    def _fetch(self, page: int) -> bytes | None:
        self.reads += 1
        try:
            data = os.pread(self.fd, READ_PAGES * PAGE, page)
        except OSError:
            try:
                data = os.pread(self.fd, PAGE, page)
            except OSError:
                return None
        if len(data) < PAGE:
            return None
        for i in range(len(data) // PAGE):
            self.pages[page + i * PAGE] = data[i * PAGE : (i + 1) * PAGE]
        return self.pages[page]

    def u64(self, addr: int) -> int | None:
        data = self.read(addr, 8)
        return None if data is None else int.from_bytes(data, "little")

    def words(self, start: int, end: int) -> np.ndarray:
        """The u64 words of [start, end) that can be read, from ``start`` on."""
        data = b""
        while start + len(data) < end:
            chunk = self.read(start + len(data), min(PAGE, end - start - len(data)) & ~7)
            if not chunk:
                break
            data += chunk
        return np.frombuffer(data[: len(data) & ~7], dtype="<u8")

    def close(self) -> None:
        os.close(self.fd)


@dataclass(slots=True)
class Module:
    image: ElfImage
    frames: FrameTable | None
    cfi_error: str = ""
    # function start (vaddr) -> (targets of its direct calls, those in the PLT,
    # has an indirect call)
    calls: dict[int, tuple[frozenset[int], tuple[int, ...], bool]] = field(default_factory=dict)

    def calls_of(self, start: int, end: int) -> tuple[frozenset[int], tuple[int, ...], bool]:
        """What the function [start, end) calls, read from its bytes once (a
        byte scan: an opcode inside another instruction can add a target)."""
        found = self.calls.get(start)
        if found is None:
            body = np.frombuffer(self.image.code(start, min(end - start, 1 << 16)), np.uint8)
            at = np.flatnonzero(body[:-4] == 0xE8)
            b = body.astype(np.int64)
            rel32 = b[at + 1] | b[at + 2] << 8 | b[at + 3] << 16 | b[at + 4] << 24
            rel32 = np.where(rel32 >= 1 << 31, rel32 - (1 << 32), rel32)
            targets = frozenset((start + at + 5 + rel32).tolist())
            plt = tuple(t for t in targets if self.image.in_plt(t))
            indirect = bool(np.any((body[:-1] == 0xFF) & ((body[1:] >> 3) & 7 == 2)))
            found = self.calls[start] = (targets, plt, indirect)
        return found


@dataclass(slots=True)
class ModuleCache:
    """Parsed ELF files by (device, inode, mtime): shared across processes and
    snapshots, so the Python binary and libc are read once per agent."""

    modules: dict[tuple[int, int, int], Module | None] = field(default_factory=dict)

    def get(self, path: str) -> Module | None:
        key = file_key(path)
        if key is None:
            return None
        if key not in self.modules:
            self.modules[key] = self._open(path)
        return self.modules[key]

    @staticmethod
    def _open(path: str) -> Module | None:
        try:
            image = ElfImage(path)
        except ElfError:
            return None
        try:
            return Module(image, FrameTable(image))
        except (CfiError, ValueError, IndexError, struct.error) as exc:
            return Module(image, None, str(exc))


@dataclass(frozen=True, slots=True)
class Frame:
    pc: int  # run-time address (a return address, except in the first frame)
    sp: int  # the frame's stack pointer
    cfa: int  # its caller's stack pointer; 0 if not known
    path: str  # module file as the process maps it; "" if none
    vaddr: int  # pc as the module's virtual address
    symbol: Symbol | None
    how: str  # "first", "cfi", "scanned", "uretprobe"; the last may say why the walk ended
    fn_start: int = 0  # run-time address of its function's start (call frame information)

    def label(self) -> str:
        if self.path == UPROBES:
            return "[uprobes: caller hidden by a uretprobe]"
        mod = os.path.basename(self.path) if self.path else "?"
        if self.symbol is None:
            return f"{mod}+{self.vaddr:#x}" if self.path else f"{self.pc:#x}"
        return f"{mod}!{self.symbol.name}+{self.vaddr - self.symbol.start:#x}"


@dataclass(slots=True)
class _Place:
    mapping: Mapping
    module: Module
    vaddr: int
    bias: int  # run-time address minus the module's virtual address


class Unwinder:
    """Stack walks in one process."""

    def __init__(self, pid: int, maps: ProcessMaps, mem: ProcessMemory, cache: ModuleCache) -> None:
        self.pid, self.maps, self.mem, self.cache = pid, maps, mem, cache
        self._modules: dict[str, Module | None] = {}
        self._plt: dict[int, int | None] = {}

    def module(self, path: str) -> Module | None:
        if path not in self._modules:
            self._modules[path] = self.cache.get(_reachable(self.pid, path))
        return self._modules[path]

    def place(self, addr: int) -> _Place | None:
        m = self.maps.find(addr)
        if m is None or "x" not in m.perms or not m.path.startswith("/"):
            return None
        mod = self.module(m.path)
        if mod is None:
            return None
        vaddr = mod.image.vaddr_of_offset(addr - m.start + m.offset)
        if vaddr is None:
            return None
        return _Place(m, mod, vaddr, addr - vaddr)

    def walk(self, pc: int, sp: int, max_frames: int = MAX_FRAMES) -> list[Frame]:
        regs: dict[int, int] = {RSP: sp}
        frames: list[Frame] = []
        how = "first"
        while len(frames) < max_frames:
            if frames and self._trampoline(pc):
                frames.append(Frame(pc, regs[RSP], 0, UPROBES, 0, None, "uretprobe"))
                resumed = self._after_trampoline(regs[RSP], frames[-2].fn_start)
                if resumed is None:
                    frames[-1] = _ended(frames[-1], "no return address found above the uretprobe")
                    break
                pc, regs, how = resumed
                continue
            place = self.place(pc)
            if place is None:
                why = "address outside any mapped file" if frames else "no module at the pc"
                frames.append(_ended(Frame(pc, regs[RSP], 0, "", 0, None, how), why))
                break
            sym = place.module.image.symbol(place.vaddr)
            step = self._step(place, pc, regs, first=not frames)
            cfa, start = (step[0], step[4]) if isinstance(step, tuple) else (0, 0)
            frame = Frame(pc, regs[RSP], cfa, place.mapping.path, place.vaddr, sym, how, start)
            frames.append(frame)
            if not isinstance(step, tuple):
                if step != "end":
                    frames[-1] = _ended(frame, step)
                break
            _, pc, regs, how, _ = step
        return frames

    def _trampoline(self, addr: int) -> bool:
        m = self.maps.find(addr)
        return m is not None and m.path == UPROBES

    def _after_trampoline(self, sp: int, probed: int) -> tuple[int, dict[int, int], str] | None:
        """Where the walk resumes above a caller whose return address a
        uretprobe hides: (pc, registers, how), or None."""
        found = self._find_return(sp, lambda ra: self._returns_past_a_caller_of(ra, probed))
        if found is None:
            return None
        slot, word = found
        return word, {RSP: slot + 8}, "scanned"

    def _find_return(self, sp: int, judge: Callable[[int], str]) -> tuple[int, int] | None:
        """(slot, word) of the first stack word above ``sp`` that ``judge``
        calls "direct", else of the first it calls "indirect" if no direct one
        follows within WEAK_LEAD bytes.  Only words that point into code are
        judged (the window is filtered in one vectorised pass)."""
        stack = self.maps.find(sp)
        end = min(sp + SCAN_BYTES, stack.end if stack else sp)
        words = self.mem.words(sp, end)
        weak: tuple[int, int] | None = None
        for i in self.maps.code_words(words):
            slot, word = sp + 8 * int(i), int(words[i])
            if weak is not None and slot - weak[0] > WEAK_LEAD:
                break
            kind = judge(word)
            if kind == "direct":
                return slot, word
            if kind == "indirect" and weak is None:
                weak = (slot, word)
        return weak

    def _returns_past_a_caller_of(self, ra: int, probed: int) -> str:
        """ "direct" if ``ra`` returns from a call to a function that calls
        ``probed`` (directly or through the PLT), "indirect" if from a call
        to a function with an indirect call or through a register, else ""."""
        place = self.place(ra)
        if place is None or not probed:
            return ""
        code = place.module.image.code(place.vaddr - 7, 7)
        if len(code) != 7:
            return ""
        if code[2] == 0xE8:
            callee = ra + int.from_bytes(code[3:], "little", signed=True)
            callee = self._plt_target(callee) or callee
            return self._calls(callee, probed)
        return "indirect" if _indirect_call(code) else ""

    def _calls(self, fn: int, target: int) -> str:
        """How the function starting at ``fn`` may call ``target``."""
        place = self.place(fn)
        table = place.module.frames if place is not None else None
        rule = table.rule(place.vaddr) if table is not None and place is not None else None
        if place is None or rule is None or rule.fn_start != place.vaddr:
            return ""
        targets, plt, indirect = place.module.calls_of(rule.fn_start, rule.fn_end)
        if target - place.bias in targets:
            return "direct"
        if any(self._plt_target(stub + place.bias) == target for stub in plt):
            return "direct"
        return "indirect" if indirect else ""

    def _step(
        self, place: _Place, pc: int, regs: dict[int, int], first: bool
    ) -> tuple[int, int, dict[int, int], str, int] | str:
        """(cfa, return address, caller's registers, how, the function's
        run-time start) or why the walk ends."""
        table = place.module.frames
        if table is None:
            return f"no call frame information ({place.module.cfi_error})"
        # A return address points past its call: look up the call itself.
        rule = table.rule(place.vaddr if first else place.vaddr - 1)
        if rule is None:
            return "no call frame information for this address"
        if rule.cfa_reg < 0:
            return "call frame rule is an expression"
        how = "cfi"
        base = regs.get(rule.cfa_reg)
        if base is not None:
            cfa = base + rule.cfa_offset
        else:
            found = self._scan(regs[RSP], rule.fn_start + place.bias)
            if found is None:
                return "return address not found by scanning"
            cfa, how = found, "scanned"
        caller = self._caller(rule, cfa, regs, how)
        return caller if isinstance(caller, str) else (*caller, rule.fn_start + place.bias)

    def _caller(
        self, rule: Rule, cfa: int, regs: dict[int, int], how: str
    ) -> tuple[int, int, dict[int, int], str] | str:
        ra_rule = rule.regs.get(RA)
        if ra_rule is not None and ra_rule.kind == "undefined":
            return "end"
        if cfa <= regs[RSP] or cfa & 7:
            return "stack pointer does not grow towards the caller"
        off = ra_rule.value if ra_rule is not None and ra_rule.kind == "offset" else -8
        ra = self.mem.u64(cfa + off)
        if not ra:
            return "end" if ra == 0 else "stack not readable"
        caller: dict[int, int] = {RSP: cfa}
        for reg in CALLEE_SAVED:
            value = self._register(rule, reg, cfa, regs)
            if value is not None:
                caller[reg] = value
        return cfa, ra, caller, how

    def _register(self, rule: Rule, reg: int, cfa: int, regs: dict[int, int]) -> int | None:
        r = rule.regs.get(reg)
        if r is None or r.kind == "same":
            return regs.get(reg)
        if r.kind == "offset":
            return self.mem.u64(cfa + r.value)
        if r.kind == "val_offset":
            return cfa + r.value
        if r.kind == "register":
            return regs.get(r.value)
        return None

    # -- recovery by scanning ------------------------------------------------

    def _scan(self, sp: int, fn_start: int) -> int | None:
        """The CFA of the frame of the function at ``fn_start``, whose sp is
        ``sp``: one past the first stack word that returns from a call to it
        (failing that, from an indirect call)."""
        found = self._find_return(sp, lambda ra: self.call_before(ra, fn_start))
        return None if found is None else found[0] + 8

    def call_before(self, ra: int, target: int) -> str:
        """ "direct" if the instruction before ``ra`` calls ``target`` (directly,
        through a PLT stub or a pointer in memory); "indirect" for a call
        through a register or memory this cannot resolve; "" otherwise."""
        place = self.place(ra)
        if place is None:
            return ""
        code = place.module.image.code(place.vaddr - 7, 7)
        if len(code) != 7:
            return ""
        if code[2] == 0xE8:  # call rel32
            dest = ra + int.from_bytes(code[3:], "little", signed=True)
            if dest == target or self._plt_target(dest) == target:
                return "direct"
            return ""
        if code[1:3] == b"\xff\x15":  # call *rel32(%rip)
            ptr = self.mem.u64(ra + int.from_bytes(code[3:], "little", signed=True))
            return "direct" if ptr == target else ""
        return "indirect" if _indirect_call(code) else ""

    def _plt_target(self, stub: int) -> int | None:
        """Where a PLT stub jumps: ``jmp *rel32(%rip)``, maybe after endbr64/bnd."""
        if stub not in self._plt:
            self._plt[stub] = self._read_plt(stub)
        return self._plt[stub]

    def _read_plt(self, stub: int) -> int | None:
        place = self.place(stub)
        if place is None or not place.module.image.in_plt(place.vaddr):
            return None
        code = place.module.image.code(place.vaddr, 16)
        for at in (0, 4):
            for prefix in (b"\xff\x25", b"\xf2\xff\x25"):
                if code[at : at + len(prefix)] == prefix:
                    rel_at = at + len(prefix)
                    rel = int.from_bytes(code[rel_at : rel_at + 4], "little", signed=True)
                    return self.mem.u64(stub + rel_at + 4 + rel)
        return None


def _indirect_call(code: bytes) -> bool:
    """Whether the 7 bytes before a return address end with ``call *...``
    through a register or memory (ModRM reg field 2)."""
    for length in (2, 3, 4, 6, 7):
        op = code[7 - length :]
        start = 1 if op[0] in range(0x40, 0x50) else 0  # REX prefix
        if len(op) - start < 2 or op[start] != 0xFF:
            continue
        modrm = op[start + 1]
        if (modrm >> 3) & 7 != 2:
            continue
        if _modrm_length(modrm, op[start + 2 : start + 3]) == len(op) - start - 1:
            return True
    return False


def _modrm_length(modrm: int, sib: bytes) -> int:
    """Bytes taken by a ModRM byte and what follows it (SIB, displacement)."""
    mod, rm = modrm >> 6, modrm & 7
    if mod == 3:
        return 1
    n = 1
    if rm == 4:
        n += 1
        if mod == 0 and sib and sib[0] & 7 == 5:
            return n + 4
    if mod == 0 and rm == 5:
        return n + 4
    return n + {0: 0, 1: 1, 2: 4}[mod]


def _ended(frame: Frame, why: str) -> Frame:
    return replace(frame, how=f"{frame.how}; walk ended: {why}")


def _reachable(pid: int, path: str) -> str:
    if path.endswith(" (deleted)"):
        path = path[: -len(" (deleted)")]
    if os.path.exists(path):
        return path
    return f"/proc/{pid}/root{path}"

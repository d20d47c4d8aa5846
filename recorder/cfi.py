"""Call frame information (``.eh_frame``): at a given instruction of a function,
where its caller's stack pointer is (the CFA, "canonical frame address") and
where the registers it must preserve were saved.  Every x86-64 ELF object
carries it, for C++ exceptions and for debuggers, whether or not it was built
with frame pointers; it is what lets ``recorder.unwind`` walk a stack that has
no frame-pointer chain.

``FrameTable(image)`` finds the FDE (frame description entry) of an address
through ``.eh_frame_hdr``'s sorted table and runs its CFA program up to that
address, giving a ``Rule``.

Known limits: DWARF expressions (``DW_CFA_def_cfa_expression``, used by PLT
stubs and signal trampolines, and register rules by expression) are reported
as such and end an unwind there; the pointer encodings handled are those GCC
and LLVM emit (absolute, pc-relative, data-relative; 2, 4, 8-byte and LEB128).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field

import numpy as np

from .elfimage import ElfImage, Section

RSP = 7
RBP = 6
RA = 16
_U = {0x02: "<H", 0x03: "<I", 0x04: "<Q", 0x0A: "<h", 0x0B: "<i", 0x0C: "<q", 0x00: "<Q"}
DW_EH_PE_OMIT = 0xFF
DW_EH_PE_PCREL = 0x10
DW_EH_PE_DATAREL = 0x30


class CfiError(Exception):
    """Call frame information this reader cannot follow."""


@dataclass(frozen=True, slots=True)
class RegRule:
    kind: str  # "offset" (saved at CFA+value), "val_offset" (is CFA+value),
    #            "register" (in register value), "same", "undefined", "expression"
    value: int = 0


@dataclass(frozen=True, slots=True)
class Rule:
    """How to find the caller's frame at one instruction."""

    cfa_reg: int  # -1 when the CFA is given by an expression
    cfa_offset: int
    regs: dict[int, RegRule]
    fn_start: int  # the FDE's first address (the function's start)
    fn_end: int  # one past its last
    signal_frame: bool = False


@dataclass(slots=True)
class _Cie:
    code_align: int
    data_align: int
    ra_reg: int
    fde_enc: int
    signal: bool
    program: bytes


@dataclass(slots=True)
class _State:
    cfa_reg: int = RSP
    cfa_offset: int = 8
    regs: dict[int, RegRule] = field(default_factory=dict)


def _uleb(data: bytes | mmap.mmap, pos: int) -> tuple[int, int]:
    out = shift = 0
    while True:
        b = data[pos]
        pos += 1
        out |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return out, pos


def _sleb(data: bytes | mmap.mmap, pos: int) -> tuple[int, int]:
    out = shift = 0
    while True:
        b = data[pos]
        pos += 1
        out |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            if b & 0x40:
                out -= 1 << shift
            return out, pos


class FrameTable:
    """The call frame information of one ELF image."""

    def __init__(self, image: ElfImage) -> None:
        self.image = image
        self.data = image.data
        eh = image.section(".eh_frame")
        if eh is None:
            raise CfiError(f"{image.path}: no .eh_frame")
        self.eh = eh
        self._cies: dict[int, _Cie] = {}
        self._rules: dict[int, Rule | None] = {}  # the same return addresses recur
        hdr = image.section(".eh_frame_hdr")
        starts, fdes = self._table(hdr) if hdr is not None else self._walk()
        order = np.argsort(starts, kind="stable")
        self.starts = starts[order]
        self.fdes = fdes[order]

    # -- locating an FDE -------------------------------------------------

    def _table(self, hdr: Section) -> tuple[np.ndarray, np.ndarray]:
        version, ptr_enc, count_enc, table_enc = self.data[hdr.offset : hdr.offset + 4]
        if version != 1 or table_enc != 0x3B:  # datarel | sdata4, as every linker writes it
            return self._walk()
        pos = hdr.offset + 4
        _, pos = self._pointer(ptr_enc, pos, hdr.addr + 4, hdr.addr)
        count, pos = self._pointer(count_enc, pos, hdr.addr + (pos - hdr.offset), hdr.addr)
        table = np.frombuffer(self.data, "<i4", 2 * count, pos).reshape(count, 2)
        starts = table[:, 0].astype(np.int64) + hdr.addr
        fdes = table[:, 1].astype(np.int64) + hdr.addr - self.eh.addr + self.eh.offset
        return starts, fdes

    def _walk(self) -> tuple[np.ndarray, np.ndarray]:
        """Every FDE of .eh_frame, for a file without a lookup table."""
        starts, fdes = [], []
        pos, end = self.eh.offset, self.eh.offset + self.eh.size
        while pos + 4 <= end:
            length, body = self._length(pos)
            if length == 0:
                break
            (cie_ptr,) = struct.unpack_from("<I", self.data, body)
            if cie_ptr != 0:
                cie = self._cie(body - cie_ptr)
                start, _ = self._pointer(cie.fde_enc, body + 4, self._vaddr(body + 4), 0)
                starts.append(start)
                fdes.append(pos)
            pos = body + length
        return np.array(starts, np.int64), np.array(fdes, np.int64)

    def _vaddr(self, file_offset: int) -> int:
        return file_offset - self.eh.offset + self.eh.addr

    def _length(self, pos: int) -> tuple[int, int]:
        (length,) = struct.unpack_from("<I", self.data, pos)
        if length == 0xFFFFFFFF:
            (length,) = struct.unpack_from("<Q", self.data, pos + 4)
            return length, pos + 12
        return length, pos + 4

    def _pointer(self, enc: int, pos: int, here: int, datarel: int) -> tuple[int, int]:
        if enc == DW_EH_PE_OMIT:
            return 0, pos
        fmt = enc & 0x0F
        if fmt == 0x01:
            value, pos = _uleb(self.data, pos)
        elif fmt == 0x09:
            value, pos = _sleb(self.data, pos)
        elif fmt in _U:
            code = _U[fmt]
            (value,) = struct.unpack_from(code, self.data, pos)
            pos += struct.calcsize(code)
        else:
            raise CfiError(f"{self.image.path}: pointer encoding {enc:#x}")
        app = enc & 0x70
        if app == DW_EH_PE_PCREL:
            value += here
        elif app == DW_EH_PE_DATAREL:
            value += datarel
        return value, pos

    def _cie(self, pos: int) -> _Cie:
        cached = self._cies.get(pos)
        if cached is not None:
            return cached
        length, body = self._length(pos)
        end = body + length
        p = body + 4
        version = self.data[p]
        p += 1
        aug_end = self.data.find(b"\0", p)
        aug = bytes(self.data[p:aug_end]).decode(errors="replace")
        p = aug_end + 1
        if "eh" in aug:
            p += 8
        code_align, p = _uleb(self.data, p)
        data_align, p = _sleb(self.data, p)
        if version == 1:
            ra_reg, p = self.data[p], p + 1
        else:
            ra_reg, p = _uleb(self.data, p)
        fde_enc, signal = 0x00, False
        if aug.startswith("z"):
            aug_len, p = _uleb(self.data, p)
            q, p = p, p + aug_len
            for ch in aug[1:]:
                if ch == "R":
                    fde_enc, q = self.data[q], q + 1
                elif ch == "L":
                    q += 1
                elif ch == "P":
                    enc = self.data[q]
                    _, q = self._pointer(enc & 0x7F, q + 1, self._vaddr(q + 1), 0)
                elif ch == "S":
                    signal = True
        cie = _Cie(code_align, data_align, ra_reg, fde_enc, signal, bytes(self.data[p:end]))
        self._cies[pos] = cie
        return cie

    def rule(self, vaddr: int) -> Rule | None:
        """The rule at ``vaddr`` (the file's virtual address), None if no FDE covers it."""
        if vaddr not in self._rules:
            self._rules[vaddr] = self._rule(vaddr)
        return self._rules[vaddr]

    def _rule(self, vaddr: int) -> Rule | None:
        i = int(np.searchsorted(self.starts, vaddr, side="right")) - 1
        if i < 0:
            return None
        pos = int(self.fdes[i])
        length, body = self._length(pos)
        (cie_ptr,) = struct.unpack_from("<I", self.data, body)
        cie = self._cie(body - cie_ptr)
        p = body + 4
        start, p = self._pointer(cie.fde_enc, p, self._vaddr(p), 0)
        size, p = self._pointer(cie.fde_enc & 0x0F, p, 0, 0)
        if not start <= vaddr < start + size:
            return None
        aug_len, p = _uleb(self.data, p)
        program = bytes(self.data[p + aug_len : body + length])
        init = _State()
        _run(cie.program, cie, init, start, start, None)
        state = _State(init.cfa_reg, init.cfa_offset, dict(init.regs))
        _run(program, cie, state, start, vaddr, init)
        regs = dict(state.regs)
        if cie.ra_reg != RA and cie.ra_reg in regs:
            regs[RA] = regs[cie.ra_reg]
        return Rule(state.cfa_reg, state.cfa_offset, regs, start, start + size, cie.signal)


def _run(prog: bytes, cie: _Cie, st: _State, loc: int, until: int, init: _State | None) -> None:
    """Runs a CFA program from ``loc`` while the location is not past ``until``."""
    stack: list[_State] = []
    p, n = 0, len(prog)
    while p < n:
        op = prog[p]
        p += 1
        high, low = op & 0xC0, op & 0x3F
        if high == 0x40:  # advance_loc
            loc += low * cie.code_align
            if loc > until:
                return
        elif high == 0x80:  # offset
            off, p = _uleb(prog, p)
            st.regs[low] = RegRule("offset", off * cie.data_align)
        elif high == 0xC0:  # restore
            _restore(st, init, low)
        else:
            loc, p = _extended(prog, p, op, cie, st, loc, stack, init)
            if loc > until:
                return


def _restore(st: _State, init: _State | None, reg: int) -> None:
    if init is not None and reg in init.regs:
        st.regs[reg] = init.regs[reg]
    else:
        st.regs.pop(reg, None)


def _extended(
    prog: bytes, p: int, op: int, cie: _Cie, st: _State, loc: int, stack: list[_State],
    init: _State | None,
) -> tuple[int, int]:  # fmt: skip
    """One of the opcodes without an operand in the opcode byte; returns (loc, p)."""
    if op == 0x00:  # nop
        return loc, p
    if op in (0x02, 0x03, 0x04):  # advance_loc1/2/4
        width = {0x02: 1, 0x03: 2, 0x04: 4}[op]
        delta = int.from_bytes(prog[p : p + width], "little")
        return loc + delta * cie.code_align, p + width
    if op == 0x01:  # set_loc (absolute pointers only in practice)
        (value,) = struct.unpack_from("<Q", prog, p)
        return value, p + 8
    if op in (0x05, 0x11):  # offset_extended(_sf)
        reg, p = _uleb(prog, p)
        off, p = _uleb(prog, p) if op == 0x05 else _sleb(prog, p)
        st.regs[reg] = RegRule("offset", off * cie.data_align)
    elif op in (0x14, 0x15):  # val_offset(_sf)
        reg, p = _uleb(prog, p)
        off, p = _uleb(prog, p) if op == 0x14 else _sleb(prog, p)
        st.regs[reg] = RegRule("val_offset", off * cie.data_align)
    elif op == 0x06:  # restore_extended
        reg, p = _uleb(prog, p)
        _restore(st, init, reg)
    elif op in (0x07, 0x08):  # undefined, same_value
        reg, p = _uleb(prog, p)
        st.regs[reg] = RegRule("undefined" if op == 0x07 else "same")
    elif op == 0x09:  # register
        reg, p = _uleb(prog, p)
        other, p = _uleb(prog, p)
        st.regs[reg] = RegRule("register", other)
    elif op == 0x0A:  # remember_state
        stack.append(_State(st.cfa_reg, st.cfa_offset, dict(st.regs)))
    elif op == 0x0B:  # restore_state
        if stack:
            saved = stack.pop()
            st.cfa_reg, st.cfa_offset, st.regs = saved.cfa_reg, saved.cfa_offset, saved.regs
    else:
        p = _cfa_op(prog, p, op, cie, st)
    return loc, p


def _cfa_op(prog: bytes, p: int, op: int, cie: _Cie, st: _State) -> int:
    if op == 0x0C:  # def_cfa
        st.cfa_reg, p = _uleb(prog, p)
        st.cfa_offset, p = _uleb(prog, p)
    elif op == 0x12:  # def_cfa_sf
        st.cfa_reg, p = _uleb(prog, p)
        off, p = _sleb(prog, p)
        st.cfa_offset = off * cie.data_align
    elif op == 0x0D:  # def_cfa_register
        st.cfa_reg, p = _uleb(prog, p)
    elif op == 0x0E:  # def_cfa_offset
        st.cfa_offset, p = _uleb(prog, p)
    elif op == 0x13:  # def_cfa_offset_sf
        off, p = _sleb(prog, p)
        st.cfa_offset = off * cie.data_align
    elif op == 0x0F:  # def_cfa_expression
        length, p = _uleb(prog, p)
        st.cfa_reg = -1
        p += length
    elif op in (0x10, 0x16):  # expression, val_expression
        reg, p = _uleb(prog, p)
        length, p = _uleb(prog, p)
        st.regs[reg] = RegRule("expression")
        p += length
    elif op == 0x2E:  # GNU_args_size
        _, p = _uleb(prog, p)
    elif op == 0x2F:  # GNU_negative_offset_extended
        reg, p = _uleb(prog, p)
        off, p = _uleb(prog, p)
        st.regs[reg] = RegRule("offset", -off * cie.data_align)
    else:
        raise CfiError(f"unknown call frame instruction {op:#x}")
    return p

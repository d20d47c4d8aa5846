"""What the thread-position reader needs from an ELF file on disk: its loadable
segments (to turn a run-time address into the file's own virtual address), its
function symbols with their bounds, its code bytes, and its call frame
information (``.eh_frame`` through the sorted table of ``.eh_frame_hdr``).

Everything is read from a read-only ``mmap`` of the file, lazily: a module is
opened when a stack frame first lands in it, its symbols are sorted (numpy)
the first time one is asked for.  Call frame information is interpreted per
frame by ``recorder.unwind``.

Known limits: ELF64 little-endian (x86-64) only; a module without
``.eh_frame_hdr`` has its ``.eh_frame`` walked once to build the same table.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np

SHT_SYMTAB = 2
SHT_DYNSYM = 11
STT_FUNC = 2
STT_GNU_IFUNC = 10
STB_LOCAL = 0
PT_LOAD = 1
PF_X = 1

_ROW = np.dtype([("value", "<u8"), ("size", "<u8"), ("name", "<u8"), ("local", "u1")])
_SYM = np.dtype(
    [("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"),
     ("value", "<u8"), ("size", "<u8")]
)  # fmt: skip


class ElfError(Exception):
    """A file that is not an ELF64 little-endian object, or a broken one."""


@dataclass(frozen=True, slots=True)
class Section:
    name: str
    type: int
    addr: int
    offset: int
    size: int
    link: int
    entsize: int


@dataclass(frozen=True, slots=True)
class Segment:
    vaddr: int
    offset: int
    filesz: int
    flags: int


@dataclass(frozen=True, slots=True)
class Symbol:
    name: str
    start: int  # the file's virtual address
    size: int
    local: bool = False  # STB_LOCAL: not visible outside its file


class _Symbols:
    """Function symbols sorted by address, for lookups of the enclosing one."""

    def __init__(self, image: ElfImage) -> None:
        tables = []
        for sec in image.sections:
            if sec.type in (SHT_SYMTAB, SHT_DYNSYM) and sec.entsize == _SYM.itemsize:
                rows = np.frombuffer(image.data, _SYM, sec.size // _SYM.itemsize, sec.offset)
                kind = rows["info"] & 0xF
                keep = ((kind == STT_FUNC) | (kind == STT_GNU_IFUNC)) & (rows["shndx"] != 0)
                strtab = image.sections[sec.link].offset
                part = np.empty(int(keep.sum()), _ROW)
                part["value"] = rows["value"][keep]
                part["size"] = rows["size"][keep]
                part["name"] = rows["name"][keep].astype(np.uint64) + strtab
                part["local"] = (rows["info"][keep] >> 4) == STB_LOCAL
                tables.append(part)
        merged = np.concatenate(tables) if tables else np.empty(0, _ROW)
        self.rows = merged[np.argsort(merged["value"], kind="stable")]
        self.starts = self.rows["value"]
        self.image = image

    def covering(self, vaddr: int) -> list[tuple[str, int, int, bool]]:
        """(name, start, size, local) of every symbol whose bounds hold ``vaddr``,
        nearest start first (aliases share a start)."""
        i = int(np.searchsorted(self.starts, vaddr, side="right"))
        out: list[tuple[str, int, int, bool]] = []
        j = i - 1
        while j >= 0 and i - j <= 64:
            row = self.rows[j]
            start, size = int(row["value"]), int(row["size"])
            if out and start != out[0][1]:
                break
            if start <= vaddr < start + max(size, 1):
                out.append((self.image.cstring(int(row["name"])), start, size, bool(row["local"])))
            elif not out and vaddr - start > 1 << 20:
                break
            j -= 1
        return out


class ElfImage:
    """One ELF file, mapped read-only."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            with open(path, "rb") as f:
                self.data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise ElfError(f"{path}: cannot map: {exc}") from exc
        if self.data[:4] != b"\x7fELF" or self.data[4] != 2 or self.data[5] != 1:
            raise ElfError(f"{path}: not a little-endian ELF64 file")
        try:
            self.segments = self._segments()
            self.sections = self._sections()
        except struct.error as exc:
            raise ElfError(f"{path}: truncated headers") from exc
        self._symbols: _Symbols | None = None
        self._symbol_at: dict[int, Symbol | None] = {}
        self._by_name = {s.name: s for s in self.sections}
        self._plt = [
            (sec.addr, sec.addr + sec.size)
            for name in (".plt", ".plt.sec", ".plt.got")
            if (sec := self._by_name.get(name)) is not None
        ]

    def _segments(self) -> tuple[Segment, ...]:
        (phoff,) = struct.unpack_from("<Q", self.data, 0x20)
        phentsize, phnum = struct.unpack_from("<HH", self.data, 0x36)
        out = []
        for i in range(phnum):
            ptype, flags, off, vaddr, _, filesz, _, _ = struct.unpack_from(
                "<IIQQQQQQ", self.data, phoff + i * phentsize
            )
            if ptype == PT_LOAD:
                out.append(Segment(vaddr, off, filesz, flags))
        return tuple(out)

    def _sections(self) -> tuple[Section, ...]:
        (shoff,) = struct.unpack_from("<Q", self.data, 0x28)
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", self.data, 0x3A)
        raw = []
        for i in range(shnum):
            name, stype, _, addr, off, size, link, _, _, entsize = struct.unpack_from(
                "<IIQQQQIIQQ", self.data, shoff + i * shentsize
            )
            raw.append((name, stype, addr, off, size, link, entsize))
        names_at = raw[shstrndx][3] if shstrndx < len(raw) else 0
        return tuple(
            Section(self.cstring(names_at + n) if names_at else "", t, a, o, s, lk, e)
            for n, t, a, o, s, lk, e in raw
        )

    def cstring(self, offset: int) -> str:
        end = self.data.find(b"\0", offset)
        return self.data[offset : end if end >= 0 else offset].decode(errors="replace")

    def section(self, name: str) -> Section | None:
        return self._by_name.get(name)

    def vaddr_of_offset(self, file_offset: int) -> int | None:
        """The virtual address at which this file offset is loaded."""
        for seg in self.segments:
            if seg.offset <= file_offset < seg.offset + seg.filesz:
                return file_offset - seg.offset + seg.vaddr
        return None

    def offset_of_vaddr(self, vaddr: int) -> int | None:
        for seg in self.segments:
            if seg.vaddr <= vaddr < seg.vaddr + seg.filesz:
                return vaddr - seg.vaddr + seg.offset
        return None

    def executable(self, vaddr: int) -> bool:
        return any(
            seg.vaddr <= vaddr < seg.vaddr + seg.filesz and seg.flags & PF_X
            for seg in self.segments
        )

    def code(self, vaddr: int, n: int) -> bytes:
        """``n`` bytes of the file at ``vaddr`` (fewer at the end of a segment)."""
        off = self.offset_of_vaddr(vaddr)
        if off is None or vaddr < 0:
            return b""
        return bytes(self.data[off : off + n])

    def symbols_at(self, vaddr: int) -> list[tuple[str, int, int, bool]]:
        if self._symbols is None:
            self._symbols = _Symbols(self)
        return self._symbols.covering(vaddr)

    def symbol(self, vaddr: int) -> Symbol | None:
        """The function holding ``vaddr``; among aliases the global name that
        does not start with the profiling prefix NCCL gives its ``pnccl*`` twins."""
        if vaddr in self._symbol_at:
            return self._symbol_at[vaddr]
        found = self.symbols_at(vaddr)
        sym = Symbol(*min(found, key=_preference)) if found else None
        self._symbol_at[vaddr] = sym
        return sym

    def in_plt(self, vaddr: int) -> bool:
        return any(lo <= vaddr < hi for lo, hi in self._plt)

    def close(self) -> None:
        self.data.close()


def _preference(sym: tuple[str, int, int, bool]) -> tuple[bool, bool, int]:
    name, _, _, local = sym
    return (local, name.startswith("pnccl"), len(name))


def file_key(path: str) -> tuple[int, int, int] | None:
    """(device, inode, mtime) of a file, to cache its image by."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns)

"""The running kernel's own description of its types (BTF), read in user space.

The BPF programs are compiled by BCC against the build machine's kernel
headers, which are another version's: a struct field's offset from them may
be wrong here, and BCC cannot relocate it.  Where a program must read a
kernel struct (a raw tracepoint gets the tracepoint's arguments, pointers
among them, not the tracepoint's fields), the offsets come from here: the
kernel's BTF (``/sys/kernel/btf/vmlinux``), read at load, passed to the
compiler as flags.

Only what that needs is decoded: the type section is walked once to index
each type record, and then a struct's members (through anonymous structs
and unions, as C names them), a typedef's target and a function
prototype's parameters are read on demand.  The format is the kernel's
``Documentation/bpf/btf.rst``: a header, type records of 12 bytes each
followed by data that depends on their kind, and a string section.

Known limits: bit fields are refused (no field the programs read is one on
the kernels BTF exists for); only vmlinux's BTF (not a module's) is read.
"""

from __future__ import annotations

import struct
from array import array
from dataclasses import dataclass
from pathlib import Path

VMLINUX = Path("/sys/kernel/btf/vmlinux")
MAGIC = 0xEB9F

# enum btf_kind (include/uapi/linux/btf.h)
INT, PTR, ARRAY, STRUCT, UNION, ENUM, FWD, TYPEDEF = 1, 2, 3, 4, 5, 6, 7, 8
VOLATILE, CONST, RESTRICT, FUNC, FUNC_PROTO, VAR, DATASEC, FLOAT = 9, 10, 11, 12, 13, 14, 15, 16
DECL_TAG, TYPE_TAG, ENUM64 = 17, 18, 19
# bytes after the 12-byte record: fixed, and per vlen item
_EXTRA = {INT: 4, ARRAY: 12, VAR: 4, DECL_TAG: 4}
_PER_ITEM = {STRUCT: 12, UNION: 12, ENUM: 8, FUNC_PROTO: 8, DATASEC: 12, ENUM64: 12}
_QUALIFIERS = frozenset({TYPEDEF, VOLATILE, CONST, RESTRICT, TYPE_TAG})
_HEADER = struct.Struct("<HBBIIIII")
_TYPE = struct.Struct("<III")
_PAIR = struct.Struct("<II")


class BtfError(ValueError):
    """The kernel's BTF cannot say what was asked (absent, damaged, or a
    type or member it does not have)."""


@dataclass(frozen=True, slots=True)
class Member:
    """Where a member lies in its outermost struct, in bytes."""

    offset: int
    size: int


class KernelTypes:
    """The types of one BTF blob (the running kernel's: ``load``)."""

    def __init__(self, blob: bytes) -> None:
        if len(blob) < _HEADER.size:
            raise BtfError("BTF: shorter than its header")
        magic, _version, _flags, hdr_len, type_off, type_len, str_off, str_len = (
            _HEADER.unpack_from(blob, 0)
        )
        if magic != MAGIC:
            raise BtfError(f"BTF: magic {magic:#x}, expected {MAGIC:#x}")
        self._types = memoryview(blob)[hdr_len + type_off : hdr_len + type_off + type_len]
        self._strings = blob[hdr_len + str_off : hdr_len + str_off + str_len]
        if len(self._types) != type_len or len(self._strings) != str_len:
            raise BtfError("BTF: its sections run past its end")
        self._named: dict[tuple[int, int], int] = {}  # (name offset, kind) -> id
        self._at = self._index()

    @classmethod
    def load(cls, path: Path = VMLINUX) -> KernelTypes:
        try:
            return cls(path.read_bytes())
        except OSError as exc:
            raise BtfError(f"cannot read the kernel's BTF {path}: {exc.strerror}") from None

    def _index(self) -> array[int]:
        """The offset of each type record by id (id 0 is void), and the ids
        of named structs and typedefs (the first of a name)."""
        at = array("I", [0])
        pos, end, types, named = 0, len(self._types), self._types, self._named
        while pos < end:
            name, info, _size = _TYPE.unpack_from(types, pos)
            kind, vlen = (info >> 24) & 0x1F, info & 0xFFFF
            if name and kind in (STRUCT, TYPEDEF):
                named.setdefault((name, kind), len(at))
            at.append(pos)
            pos += _TYPE.size + _EXTRA.get(kind, 0) + _PER_ITEM.get(kind, 0) * vlen
        if pos != end:
            raise BtfError("BTF: a type record runs past the type section")
        return at

    # ---- records -----------------------------------------------------------

    def _record(self, type_id: int) -> tuple[int, int, int, int, int]:
        """(name offset, kind, vlen, kind_flag, size or type) of a type."""
        if not 0 < type_id < len(self._at):
            raise BtfError(f"BTF: no type {type_id}")
        name, info, size = _TYPE.unpack_from(self._types, self._at[type_id])
        return name, (info >> 24) & 0x1F, info & 0xFFFF, info >> 31, size

    def _name(self, offset: int) -> str:
        end = self._strings.index(b"\0", offset)
        return self._strings[offset:end].decode()

    def _string(self, name: str) -> int:
        """The string section's offset of ``name`` (-1: absent).  Strings
        are deduplicated: a name is found once, after a NUL."""
        if not name:
            return 0
        at = self._strings.find(b"\0" + name.encode() + b"\0")
        return at + 1 if at >= 0 else -1

    def find(self, name: str, kind: int) -> int:
        """The id of the struct or typedef ``name``; BtfError if none."""
        found = self._named.get((self._string(name), kind))
        if found is not None:
            return found
        raise BtfError(f"the kernel's BTF has no {_KIND_NAMES.get(kind, kind)} {name}")

    def _skip_qualifiers(self, type_id: int) -> int:
        for _ in range(32):  # a chain of typedefs and qualifiers
            _name, kind, _vlen, _flag, target = self._record(type_id)
            if kind not in _QUALIFIERS:
                return type_id
            type_id = target
        raise BtfError(f"BTF: type {type_id} is a loop of qualifiers")

    def size_of(self, type_id: int) -> int:
        type_id = self._skip_qualifiers(type_id)
        _name, kind, _vlen, _flag, size = self._record(type_id)
        if kind in (INT, STRUCT, UNION, ENUM, ENUM64, FLOAT):
            return size
        if kind == PTR:
            return 8
        if kind == ARRAY:
            elem, _index, count = struct.unpack_from("<III", self._types, self._at[type_id] + 12)
            return self.size_of(elem) * int(count)
        raise BtfError(f"BTF: type {type_id} (kind {kind}) has no size")

    # ---- members -----------------------------------------------------------

    def _members(self, type_id: int) -> list[tuple[int, int, int]]:
        """(name offset, type, bit offset) of a struct's or union's members
        (a bit field's type is -1: nothing here reads one)."""
        _name, kind, vlen, flag, _size = self._record(type_id)
        if kind not in (STRUCT, UNION):
            raise BtfError(f"BTF: type {type_id} is not a struct or union")
        out = []
        base = self._at[type_id] + _TYPE.size
        for i in range(vlen):
            name, member_type, offset = _TYPE.unpack_from(self._types, base + 12 * i)
            if flag and offset >> 24:
                member_type = -1
            out.append((name, member_type, offset & 0xFFFFFF if flag else offset))
        return out

    def _lookup(self, type_id: int, name: int) -> tuple[int, int] | None:
        """(bit offset, type) of member ``name``, looking into anonymous
        members as C does; None if there is none."""
        for member, member_type, bits in self._members(type_id):
            if member == name:
                return bits, member_type
            if member == 0 and member_type >= 0:
                inner = self._skip_qualifiers(member_type)
                if self._record(inner)[1] in (STRUCT, UNION):
                    found = self._lookup(inner, name)
                    if found is not None:
                        return bits + found[0], found[1]
        return None

    def member(self, struct_name: str, path: str) -> Member:
        """Where ``struct_name``'s member ``path`` (``a.b.c``: members of
        members) lies: its byte offset from the struct's start and size."""
        type_id = self.find(struct_name, STRUCT)
        bits = 0
        for part in path.split("."):
            name = self._string(part)
            found = self._lookup(self._skip_qualifiers(type_id), name) if name > 0 else None
            if found is None:
                raise BtfError(f"the kernel's struct {struct_name} has no member {path}")
            if found[1] < 0:
                raise BtfError(f"struct {struct_name}'s member {path} is a bit field")
            bits += found[0]
            type_id = found[1]
        if bits % 8:
            raise BtfError(f"struct {struct_name}'s member {path} is not byte aligned")
        return Member(bits // 8, self.size_of(type_id))

    # ---- tracepoints ---------------------------------------------------------

    def tracepoint_args(self, event: str) -> tuple[str, ...]:
        """The arguments a raw tracepoint of ``event`` gets, by their type
        names (``struct sock *``, ``int``...): the prototype of the kernel's
        ``btf_trace_<event>`` without its leading ``void *`` (the
        tracepoint's private data)."""
        proto = self._skip_qualifiers(self.find(f"btf_trace_{event}", TYPEDEF))
        _name, kind, _vlen, _flag, target = self._record(proto)
        if kind == PTR:
            proto = self._skip_qualifiers(target)
        _name, kind, vlen, _flag, _ret = self._record(proto)
        if kind != FUNC_PROTO:
            raise BtfError(f"BTF: btf_trace_{event} is not a function pointer")
        base = self._at[proto] + _TYPE.size
        params = [_PAIR.unpack_from(self._types, base + 8 * i)[1] for i in range(vlen)]
        return tuple(self.type_name(p) for p in params[1:])

    def type_name(self, type_id: int) -> str:
        """A C spelling of a type, enough to recognise it (``struct sock *``)."""
        if type_id == 0:
            return "void"
        name, kind, _vlen, _flag, target = self._record(type_id)
        if kind == PTR:
            return self.type_name(target) + " *"
        if kind in (CONST, VOLATILE, RESTRICT, TYPE_TAG):
            return self.type_name(target)
        prefix = {STRUCT: "struct ", UNION: "union ", ENUM: "enum ", ENUM64: "enum "}
        return prefix.get(kind, "") + self._name(name)


_KIND_NAMES = {STRUCT: "struct", UNION: "union", TYPEDEF: "typedef", FUNC: "function"}

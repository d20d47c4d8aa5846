"""Flight Recorder files written as torch writes them.

torch dumps its recorder with the pickler of ``torch/csrc/jit/serialization
/pickler.cpp`` (protocol 2, no type tags), and the bytes differ from what
Python's ``pickle`` makes of the same dict:

- strings are memoized by value (``BINUNICODE`` then ``BINPUT`` the first
  time, ``BINGET`` after), containers only when the same one is referenced
  again (a frame shared by many entries' stacks), and then after they are
  built (``BINPUT`` after ``SETITEMS``), never before;
- every dict is ``EMPTY_DICT MARK ... SETITEMS`` and every list
  ``EMPTY_LIST MARK ... APPENDS``, empty ones too; tuples of two are
  ``TUPLE2``;
- integers take the smallest of ``BININT1``, ``BININT2``, ``BININT`` and
  else an 8-byte ``LONG1``; memo ids above 255 ``LONG_BINPUT``/``LONG_BINGET``.

``dumps`` writes those bytes (checked byte for byte against files torch
wrote, ``tests/analyzer/test_frwrite.py``), so that what we write unpickles
at the cost torch's own files do, and readers that pattern-match torch's
output (ours, torchfrtrace, NVRx) see the same stream.  ``dumps_json``
writes the JSON form (``_dump_fr_trace_json``) as torch's JSON writer does:
keys sorted, no spaces (byte for byte on torch's JSON dumps too); a tuple
is a list, None is null.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import Any

__all__ = ["dumps", "dumps_json"]

_PROTO = b"\x80\x02"
_STOP = b"."
_DICT_OPEN = b"}("
_LIST_OPEN = b"]("
_SETITEMS = b"u"
_APPENDS = b"e"
_TUPLE2 = b"\x86"
_NONE = b"N"
_TRUE = b"\x88"
_FALSE = b"\x89"
_CONTAINERS = frozenset((dict, list, tuple))
_pack_u16 = struct.Struct("<H").pack
_pack_i32 = struct.Struct("<i").pack
_pack_u32 = struct.Struct("<I").pack
_pack_i64 = struct.Struct("<q").pack


def _int(n: int) -> bytes:
    if 0 <= n <= 0xFF:
        return b"K" + bytes((n,))
    if 0 <= n <= 0xFFFF:
        return b"M" + _pack_u16(n)
    if -(1 << 31) <= n < (1 << 31):
        return b"J" + _pack_i32(n)
    return b"\x8a\x08" + _pack_i64(n)


class _Writer:
    """One pickle's memo and output."""

    def __init__(self, shared: set[int]) -> None:
        self.out: list[bytes] = []
        self.memo_id = 0
        self.gets: dict[object, bytes] = {}  # a string, or a shared container's id -> BINGET
        self.shared = shared

    def put(self) -> tuple[bytes, bytes]:
        """The next BINPUT, and the BINGET that fetches it later."""
        i = self.memo_id
        self.memo_id += 1
        if i <= 0xFF:
            return b"q" + bytes((i,)), b"h" + bytes((i,))
        return b"r" + _pack_u32(i), b"j" + _pack_u32(i)

    def value(self, v: object) -> None:
        if isinstance(v, str):
            self.string(v)
        elif isinstance(v, bool):  # before int: a bool is one
            self.out.append(_TRUE if v else _FALSE)
        elif isinstance(v, int):
            self.out.append(_int(v))
        elif v is None:
            self.out.append(_NONE)
        elif isinstance(v, (dict, list, tuple)):
            self.container(v)
        elif isinstance(v, float):
            self.out.append(b"G" + struct.pack(">d", v))
        elif isinstance(v, Mapping):
            self.container(v)
        else:
            raise TypeError(f"a Flight Recorder file holds no {type(v).__name__}")

    def string(self, v: str) -> None:
        got = self.gets.get(v)
        if got is not None:
            self.out.append(got)
            return
        raw = v.encode("utf-8", "surrogatepass")
        put, get = self.put()
        self.out.append(b"X" + _pack_u32(len(raw)) + raw + put)
        self.gets[v] = get

    def container(self, v: Mapping[Any, Any] | list[Any] | tuple[Any, ...]) -> None:
        key = id(v)
        got = self.gets.get(key)
        if got is not None:
            self.out.append(got)
            return
        value = self.value
        if isinstance(v, Mapping):
            self.out.append(_DICT_OPEN)
            for k, x in v.items():
                value(k)
                value(x)
            self.out.append(_SETITEMS)
        elif isinstance(v, tuple) and len(v) == 2:
            value(v[0])
            value(v[1])
            self.out.append(_TUPLE2)
        else:
            self.out.append(_LIST_OPEN)
            # a stack: frames written before, fetched at C speed
            gets = list(map(self.gets.get, map(id, v)))
            if gets and None not in gets:
                self.out.append(b"".join(g for g in gets if g is not None))
            else:
                for x in v:
                    value(x)
            self.out.append(_APPENDS)
        if key in self.shared:
            put, get = self.put()
            self.out.append(put)
            self.gets[key] = get


def _shared(doc: object) -> set[int]:
    """Ids of the containers referenced more than once (torch memoizes a
    value whose use count is above one: the frames its entries share)."""
    seen: set[int] = {id(doc)}
    twice: set[int] = set()
    todo: list[Any] = [doc]
    while todo:
        v = todo.pop()
        items = v.values() if isinstance(v, dict) else v
        inner = [x for x in items if type(x) in _CONTAINERS]
        for x in inner:
            key = id(x)
            if key in seen:
                twice.add(key)
            else:
                seen.add(key)
                todo.append(x)
    return twice


def dumps(doc: Mapping[str, Any]) -> bytes:
    """``doc`` as torch's pickler writes it."""
    w = _Writer(_shared(doc) | {id(doc)})  # the whole dump too: torch holds it twice
    w.out.append(_PROTO)
    w.value(doc)
    w.out.append(_STOP)
    return b"".join(w.out)


def dumps_json(doc: Mapping[str, Any]) -> bytes:
    """``doc`` in the JSON form."""
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()

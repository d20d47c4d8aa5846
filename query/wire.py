"""What crosses the wire between agents and their clients: the formats the
server (``query.http``) writes and the clients (``query.fanout``,
``query.live``, the command line) read, in one place.

JSON: integers are written exactly, whatever their size (communicator hashes
are UBIGINT and often above 2**63; Python's ``json`` reads them back exactly,
JavaScript's ``JSON.parse`` does not — read them with a big-integer aware
parser, or select ``printf('%x', comm_id_hash)``).  Timestamps become ISO 8601
strings, non-finite floats ``null``, bytes hex strings.

``application/x-stallwatch-arrow`` (``POST /fetch``): per query, in order, an
8-byte big-endian length and an Arrow IPC stream of its rows; the schema
metadata says the host (``stallwatch.host``) and whether the rows were cut
short (``stallwatch.truncated``: b"1").

``application/x-stallwatch-dumps`` (``POST /recording``, ``POST /collect``):
8-byte big-endian length frames, the first a JSON object ``{"host",
"incident_id", "names": [file name, ...]}``, then one dump (the msgpack dump
format, checked by its reader) per name.
"""

from __future__ import annotations

import datetime
import decimal
import json
import math
import struct
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import mmap

    import pyarrow as pa

ARROW_FRAMES = "application/x-stallwatch-arrow"
DUMP_FRAMES = "application/x-stallwatch-dumps"


# ---- JSON ------------------------------------------------------------------


def _json_default(value: object) -> object:
    if isinstance(value, datetime.datetime | datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    if isinstance(value, uuid.UUID):
        return str(value)
    return str(value)


def _finite(value: object) -> object:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value


def encode_json(doc: object) -> bytes:
    """Strict JSON (no NaN tokens), exact integers."""
    try:
        text = json.dumps(doc, default=_json_default, allow_nan=False)
    except ValueError:
        text = json.dumps(_finite(doc), default=_json_default, allow_nan=False)
    return text.encode()


# ---- length-prefixed frames ----------------------------------------------

_LENGTH = struct.Struct(">Q")


def join_frames(parts: Iterable[bytes | memoryview]) -> bytes:
    """Each part behind its 8-byte big-endian length."""
    out = bytearray()
    for part in parts:
        out += _LENGTH.pack(len(part))
        out += part
    return bytes(out)


def split_frames(data: bytes | bytearray | memoryview | mmap.mmap) -> list[memoryview]:
    """The inverse of :func:`join_frames`; ValueError on a malformed body."""
    view, parts, at = memoryview(data), [], 0
    while at < len(view):
        if at + _LENGTH.size > len(view):
            raise ValueError("a frame length is cut short")
        (size,) = _LENGTH.unpack_from(view, at)
        at += _LENGTH.size
        if at + size > len(view):
            raise ValueError(f"a frame of {size} bytes is cut short")
        parts.append(view[at : at + size])
        at += size
    return parts


@dataclass(frozen=True, slots=True)
class DumpBundle:
    """An answer of ``/recording`` or ``/collect``: dumps as bytes, by name."""

    host: str
    incident_id: str | None
    names: tuple[str, ...]
    blobs: tuple[bytes | memoryview, ...]


def encode_dumps(bundle: DumpBundle) -> bytes:
    return b"".join(dumps_parts(bundle))


def dumps_parts(bundle: DumpBundle) -> list[bytes | memoryview]:
    """:func:`encode_dumps` as the parts to send one after the other (the
    dumps themselves not copied)."""
    return dump_frames(bundle.host, bundle.incident_id, bundle.names, [[b] for b in bundle.blobs])


def dump_frames(
    host: str,
    incident_id: str | None,
    names: Sequence[str],
    dumps: Sequence[Sequence[bytes | memoryview]],
) -> list[bytes | memoryview]:
    """The frames of :func:`encode_dumps`, each dump given as the pieces it
    is made of (``dumpers.format.encode_parts``: never joined), to send one
    after the other."""
    head = {"host": host, "incident_id": incident_id, "names": list(names)}
    parts = frame_parts(encode_json(head))
    for pieces in dumps:
        parts += frame_parts(*pieces)
    return parts


def decode_dumps(data: bytes) -> DumpBundle:
    """The inverse of :func:`encode_dumps`; ValueError on a malformed body
    (the dumps themselves are checked by the dump reader, not here)."""
    frames = split_frames(data)
    if not frames:
        raise ValueError("no frames")
    try:
        head = json.loads(bytes(frames[0]))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"the first frame is not JSON: {exc}") from None
    names = head.get("names") if isinstance(head, dict) else None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError("the first frame has no list of names")
    if len(names) != len(frames) - 1:
        raise ValueError(f"{len(names)} names for {len(frames) - 1} dumps")
    host, incident = head.get("host"), head.get("incident_id")
    return DumpBundle(
        host if isinstance(host, str) else "",
        incident if isinstance(incident, str) else None,
        tuple(names),
        tuple(bytes(f) for f in frames[1:]),
    )


def encode_frames(host: str, results: Sequence[tuple[pa.Table, bool]]) -> bytes:
    """Each table as an Arrow IPC stream behind its 8-byte length; the host
    and whether the table was cut short ride in its schema metadata."""
    return join_frames([arrow_stream(table, truncated, host) for table, truncated in results])


def arrow_stream(table: pa.Table, truncated: bool, host: str) -> memoryview:
    """One table of :func:`encode_frames`, without its length (Arrow's
    buffer, not copied)."""
    import pyarrow as pa

    meta = {b"stallwatch.truncated": b"1" if truncated else b"0",
            b"stallwatch.host": host.encode()}  # fmt: skip
    table = table.replace_schema_metadata(meta)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return memoryview(sink.getvalue())


def frame_parts(*parts: bytes | memoryview) -> list[bytes | memoryview]:
    """One frame of :func:`join_frames` (its bytes the ``parts`` one after
    the other), as its length and those parts, to send as they are."""
    return [_LENGTH.pack(sum(map(part_size, parts))), *parts]


def part_size(part: bytes | memoryview) -> int:
    """Bytes of a part to send (a memoryview's, whatever its item size)."""
    return part.nbytes if isinstance(part, memoryview) else len(part)


@dataclass(frozen=True, slots=True)
class Frame:
    table: pa.Table
    truncated: bool
    host: str


def decode_frames(data: bytes) -> list[Frame]:
    """The inverse of :func:`encode_frames`; ValueError on a malformed body."""
    import pyarrow as pa

    results = []
    for frame in split_frames(data):
        try:
            table = pa.ipc.open_stream(pa.py_buffer(frame)).read_all()
        except pa.ArrowException as exc:
            raise ValueError(f"a frame is not an Arrow stream: {exc}") from None
        meta = table.schema.metadata or {}
        truncated = meta.get(b"stallwatch.truncated") == b"1"
        host = meta.get(b"stallwatch.host", b"").decode(errors="replace")
        results.append(Frame(table.replace_schema_metadata(None), truncated, host))
    return results

"""The dump file: one node's ``Recording`` as a msgpack document.

Layout (format version 10; every key is required, no other key is allowed;
``format`` and ``version`` come first, in this version and every later one,
so that a newer layout is recognised as such before anything else is read)::

    {"format": "stallwatch-dump", "version": 10,
     "host": str, "boot_id": str,
     "agent": {"version": str, "args": [str, ...]},
     "trigger": null | {"kind": str, "reason": str, "incident_id": str, "time_ns": u64,
                        "pid": u32, "comm_hash": u64, "origin_host": str},
     "clock": {"monotonic_ns": u64, "realtime_ns": u64},
     "processes": [{"pid", "comm", "cmdline", "netns", "start_ns", "libs": [str],
                    "exit_ns", "exit_code": i32 | null, "exit_signal": i32 | null}, ...],
     "communicators": [{"pid", "comm", "comm_hash", "rank", "nranks", "parent_hash",
                        "color", "key", "root_addr", "init_ns", "destroy_ns"}, ...],
     "snapshots": [thread positions, as in dumpers.readingsdoc],
     "links": [interfaces, as in dumpers.linksdoc],            # version 7 on
     "programs": [kernel hooks' programs, as in dumpers.programsdoc],  # version 10 on
     "rings": {name: {"dtype": numpy descr as lists, "rows": n, "data": bin,
                      "overwritten": u64, "lost": u64}},
     "counters": {str: u64},
     "checksums": {"algorithm": "crc32", "block": bytes,
                   "header": u32, "tables": u32,
                   "rings": {name: {"meta": u32, "data": [u32, ...]}}}}

Checksums (version 6): one per section, CRC-32 (``zlib.crc32``).  The
*header* is ``format``, ``version``, ``host``, ``boot_id``, ``agent``,
``trigger``, ``clock``, ``counters`` and (version 10) ``programs``; the
*tables* are ``processes``, ``communicators``, ``snapshots`` and (version 7)
``links``: each is checked over the msgpack
encoding of the map of those keys to their values, in that order (msgpack
encodes a value one way only, so the reader re-encodes what it read).  A
ring's ``meta`` is checked over ``[dtype, rows, overwritten, lost]``; its
``data`` in blocks of ``block`` bytes, one CRC each, so that a reader that
reads only a ring's latest rows (``DeferredRing.read``) checks the blocks
it reads.  A section
whose checksum differs is refused with ``DumpChecksumError`` naming the file
and the section: the dump is then as good as lost.  CRC-32 finds every burst
of up to 32 flipped bits and all but one in 2**32 of other damage; it is no
defence against someone who rewrites a file on purpose.

A communicator with ``comm_hash`` 0 is one whose id the agent could not
know: made before it attached (``init_ns`` 0; its calls' ``seq`` count from
the first call the agent saw, relative to the attach) or split from such a
one; its rows carry hash 0 and its pointer, and the analyzer aligns them
with the calls of its other members.

Each ring is stored as its numpy dtype description plus the raw little-endian
rows (``rows * itemsize`` bytes), so writing and reading cost one copy and no
per-row Python.  Ring names must be those of ``dumpers.schema.RING_DTYPES`` and
their dtype must equal that entry exactly: a ring this reader does not know is
refused, not skipped, because a new ring means a new format version.

Older versions are read and brought to today's records: version 1's NCCL
rows lack the device columns (``started_ns`` ... ``completed_after_ns``, 0
here: not observed) and numbered the lifecycle scheduled 0, returned 1,
completed 2 (returned is ``ENQUEUED`` now; completed is 3).  Before
version 5, sched rows did not name the process that held the CPU: their
``prev_pid`` is ``PREV_PID_UNKNOWN`` (-1; 0 is the idle task).
Before version 7, TCP rows carried no connection state (backoff, RTO,
RTT, bytes unacknowledged, nothing acknowledged since): it reads as unknown
(``conn_known`` 0), and only retransmits and state changes were recorded
(resets are rows from version 7 on).  Versions 1 and 2 have no
``snapshots``: they are read as recordings without thread positions.
Version 6 adds a checksum per section; before it dumps are read
unchecked (``Recording.checked`` says so).  Version 7 adds the ``link``
ring (the agent's samples of its interfaces, ``recorder.links``) and the
``links`` table it names; older versions are read with neither (no link
rows), and refused if they hold a ``link`` ring.  Version 8 adds TCP rows
of event ``tcp_info`` (5): each job connection's state as the kernel had it
when the dump was taken; older dumps have none.  Version 9 adds the
agent's network rings: ``conn_samples`` (each job connection's ``tcp_info``
every second), ``iface_samples`` (each job interface's netdev and root qdisc
counters every second) and ``probes`` (the probes between the job's nodes at
an incident, sent and received); older versions are read with none, and
refused if they hold one.  Version 10 adds
``programs``: the BPF programs on kernel hooks, how each is attached, and
the runs of each the kernel skipped (null: not counted); older dumps have
none (nothing known).
The top-level keys each version added are in ``TOP_KEYS_SINCE``; a ring's
earlier dtypes in ``dumpers.schema.RING_DTYPES_BEFORE``.

The reader refuses anything else with ``DumpFormatError`` (or
``DumpVersionError`` for a newer version), naming the file and the field; it
never lets another exception escape, whatever the bytes.  Ring data is read
from the file straight into a fresh writable array (one copy, no per-row
Python); the ring's rows are a view of it.

``write_dump`` is atomic: the document goes to a hidden temporary file in the
target directory, which is flushed and fsynced, renamed into place, and the
directory fsynced.  No partial file is ever visible under the final name.
"""

from __future__ import annotations

import functools
import io
import logging
import os
import re
import secrets
import struct
import time
import zlib
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, NoReturn, cast

import msgpack
import numpy as np

from .errors import (
    DumpChecksumError,
    DumpError,
    DumpFormatError,
    DumpVersionError,
    DumpWriteError,
)
from .linksdoc import links_doc, read_links
from .model import (
    CHECKSUMS_SINCE,
    FORMAT_NAME,
    FORMAT_VERSION,
    Clock,
    CommInfo,
    ProcessInfo,
    Recording,
    Ring,
    Trigger,
    TriggerKind,
)
from .programsdoc import programs_doc, read_programs
from .readingsdoc import read_snapshots, snapshots_doc
from .schema import PREV_PID_UNKNOWN, RING_DTYPES, RING_SINCE, State, ring_dtype

log = logging.getLogger(__name__)

DUMP_SUFFIX = ".msgpack"
TEMP_MARKER = ".tmp-"  # hidden temporary files: ".<final name>.tmp-<pid>-<random>"

U32 = (0, 2**32 - 1)
U64 = (0, 2**64 - 1)
I32 = (-(2**31), 2**31 - 1)

_Chunk = bytes | memoryview

CHECKSUM = "crc32"
# bytes of ring data under one checksum: a reader of a ring's latest rows
# reads up to one block before them to check the first (a node's window of
# 2,048 rows is 320 KiB); crc32 runs at 3.7-4.2 GB/s here from 16 KiB blocks up
CHECK_BLOCK = 1 << 16
CHECK_BLOCK_RANGE = (1 << 12, 1 << 30)  # what a reader accepts as a file's block size
HEADER_KEYS = (
    *("format", "version", "host", "boot_id", "agent", "trigger", "clock", "counters"),
    "programs",
)
TABLE_KEYS = ("processes", "communicators", "snapshots", "links")
RING_META = ("dtype", "rows", "overwritten", "lost")


def section_crc(values: object) -> int:
    """The checksum of a section: CRC-32 of the msgpack encoding of its values
    (a packer per call: readers run on several threads)."""
    return zlib.crc32(msgpack.packb(values, use_bin_type=True))


def block_crcs(data: bytes | memoryview, block: int = CHECK_BLOCK) -> list[int]:
    """CRC-32 of each ``block`` bytes of ``data`` (the last block shorter)."""
    view = memoryview(data).cast("B")
    return [zlib.crc32(view[i : i + block]) for i in range(0, len(view), block)]


def _section(doc: Mapping[str, object], keys: tuple[str, ...]) -> int:
    return section_crc({k: doc[k] for k in keys if k in doc})


def checksums_doc(doc: Mapping[str, object], block: int = CHECK_BLOCK) -> dict[str, object]:
    """The ``checksums`` of a document: its values as they are written, each
    ring's data as bytes (a ring whose data is not bytes has no block)."""
    rings = doc.get("rings")
    sums: dict[str, object] = {}
    for name, ring in (rings if isinstance(rings, dict) else {}).items():
        r = ring if isinstance(ring, dict) else {}
        data = r.get("data")
        blocks = block_crcs(data, block) if isinstance(data, bytes | memoryview) else []
        sums[name] = {"meta": section_crc([r.get(k) for k in RING_META]), "data": blocks}
    return {
        "algorithm": CHECKSUM,
        "block": block,
        "header": _section(doc, HEADER_KEYS),
        "tables": _section(doc, TABLE_KEYS),
        "rings": sums,
    }


# ---------------------------------------------------------------- encoding


def _descr(dtype: np.dtype) -> list[object]:
    """The dtype's ``descr`` with tuples as lists (what msgpack gives back)."""

    def conv(item: object) -> object:
        if isinstance(item, tuple | list):
            return [conv(x) for x in item]
        return item

    return [conv(x) for x in dtype.descr]


@functools.cache
def _expected_descr(name: str, version: int) -> list[object]:
    """What a dump of ``version`` says ring ``name``'s dtype is, for the
    writer (this version) and the reader alike (made once: building a descr
    is most of the check of a small ring; compare, never mutate, the list)."""
    return _descr(ring_dtype(name, version))


V1_COMPLETED = 2  # version 1's number for the completed state


def upgrade_rows(name: str, rows: np.ndarray, version: int) -> np.ndarray:
    """Rows of ring ``name`` from a dump of format ``version``, in today's
    dtype (a copy when they differ; the rows themselves when not)."""
    today = RING_DTYPES[name]
    if rows.dtype == today:
        return rows
    out = np.zeros(len(rows), dtype=today)
    for field in rows.dtype.names or ():
        if field in (today.names or ()):  # padding that became a field is zero then
            out[field] = rows[field]
    if name == "nccl" and version <= 1:
        out["state"][rows["state"] == V1_COMPLETED] = State.COMPLETED
    if name == "sched" and version <= 4:  # who held the CPU was not recorded: unknown, not idle
        out["prev_pid"] = PREV_PID_UNKNOWN
    return out


def _trigger_doc(t: Trigger | None) -> dict[str, object] | None:
    if t is None:
        return None
    return {
        "kind": t.kind.value,
        "reason": t.reason,
        "incident_id": t.incident_id,
        "time_ns": t.time_ns,
        "pid": t.pid,
        "comm_hash": t.comm_hash,
        "origin_host": t.origin_host,
    }


def _process_doc(p: ProcessInfo) -> dict[str, object]:
    return {
        "pid": p.pid,
        "comm": p.comm,
        "cmdline": p.cmdline,
        "netns": p.netns,
        "start_ns": p.start_ns,
        "libs": list(p.libs),
        "exit_ns": p.exit_ns,
        "exit_code": p.exit_code,
        "exit_signal": p.exit_signal,
    }


def _comm_doc(c: CommInfo) -> dict[str, object]:
    return {
        "pid": c.pid,
        "comm": c.comm,
        "comm_hash": c.comm_hash,
        "rank": c.rank,
        "nranks": c.nranks,
        "parent_hash": c.parent_hash,
        "color": c.color,
        "key": c.key,
        "root_addr": c.root_addr,
        "init_ns": c.init_ns,
        "destroy_ns": c.destroy_ns,
    }


def _header_doc(rec: Recording) -> dict[str, object]:
    """Everything but the rings, in file order."""
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "host": rec.host,
        "boot_id": rec.boot_id,
        "agent": {"version": rec.agent_version, "args": list(rec.agent_args)},
        "trigger": _trigger_doc(rec.trigger),
        "clock": {"monotonic_ns": rec.clock.monotonic_ns, "realtime_ns": rec.clock.realtime_ns},
        "processes": [_process_doc(p) for p in rec.processes],
        "communicators": [_comm_doc(c) for c in rec.communicators],
        "snapshots": snapshots_doc(rec.snapshots),
        "links": links_doc(rec.links),
        "programs": programs_doc(rec.programs),
    }


def _ring_bytes(name: str, ring: Ring) -> memoryview:
    expected = RING_DTYPES.get(name)
    if expected is None:
        raise ValueError(f"ring {name!r}: unknown ring name (known: {', '.join(RING_DTYPES)})")
    rows = ring.rows
    if rows.dtype != expected or rows.ndim != 1:
        raise ValueError(
            f"ring {name!r}: expected a 1-D array of the schema dtype, got {rows.dtype}"
        )
    return np.ascontiguousarray(rows).view(np.uint8).data


def _bin_header(n: int) -> bytes:
    if n < 256:
        return struct.pack(">BB", 0xC4, n)
    if n < 65536:
        return struct.pack(">BH", 0xC5, n)
    return struct.pack(">BI", 0xC6, n)


def _chunks(rec: Recording) -> Iterator[_Chunk]:
    """The encoded document in pieces; ring data is yielded as views, not
    copied.  Rings are checked here, before the first piece is asked for."""
    ring_data = {name: _ring_bytes(name, ring) for name, ring in rec.rings.items()}
    return _pieces(rec, ring_data)


def _pieces(rec: Recording, ring_data: dict[str, memoryview]) -> Iterator[_Chunk]:
    """msgpack has no streaming API for ``bin``: its header is written by hand
    (bin 8/16/32, as in the msgpack spec)."""
    packer = msgpack.Packer(use_bin_type=True)
    header = _header_doc(rec)
    counters = dict(rec.counters)
    yield packer.pack_map_header(len(header) + 3)
    for key, value in header.items():
        yield packer.pack(key) + packer.pack(value)
    yield packer.pack("rings") + packer.pack_map_header(len(rec.rings))
    rings: dict[str, dict[str, object]] = {}
    for name, ring in rec.rings.items():
        data = ring_data[name]
        rings[name] = r = {
            "dtype": _expected_descr(name, FORMAT_VERSION),
            "rows": len(ring.rows),
            "overwritten": ring.overwritten,
            "lost": ring.lost,
        }
        yield packer.pack(name) + packer.pack_map_header(len(r) + 1)
        for key, value in r.items():
            yield packer.pack(key) + packer.pack(value)
        yield packer.pack("data") + _bin_header(len(data))
        yield data
        r["data"] = data
    yield packer.pack("counters") + packer.pack(counters)
    sums = checksums_doc({**header, "counters": counters, "rings": rings})
    yield packer.pack("checksums") + packer.pack(sums)


def encode(rec: Recording) -> bytes:
    """The dump document of ``rec``.  Raises ValueError for a Recording that
    breaks the model (unknown ring, wrong dtype, value out of range)."""
    return b"".join(encode_parts(rec))


# ring data this large is sent from its array; what lies between is joined
VIEW_FROM = 64 * 1024


def encode_parts(rec: Recording) -> list[bytes | memoryview]:
    """:func:`encode` as the pieces to send one after the other: the rings'
    data from ``VIEW_FROM`` bytes as views of their arrays (a dump sent is
    never joined in memory), the small pieces between them joined (a few
    sends, not one per field)."""
    parts: list[bytes | memoryview] = []
    small: list[bytes | memoryview] = []
    try:
        for chunk in _chunks(rec):
            if isinstance(chunk, memoryview) and chunk.nbytes >= VIEW_FROM:
                if small:
                    parts.append(b"".join(small))
                    small = []
                parts.append(chunk)
            else:
                small.append(chunk)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"recording of {rec.host!r} cannot be encoded: {exc}") from exc
    if small:
        parts.append(b"".join(small))
    return parts


# ---------------------------------------------------------------- writing


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def safe_name(text: str, limit: int = 64) -> str:
    """``text`` as one file name: letters, digits, ``._-`` (others ``_``)."""
    cleaned = _UNSAFE.sub("_", text).strip("._") or "unknown"
    return cleaned[:limit]


def dump_file_name(rec: Recording) -> str:
    """``<host>-<incident id>-<UTC time>.msgpack``, every part sanitized."""
    trig = rec.trigger
    incident = trig.incident_id if trig else "snapshot"
    wall_ns = rec.clock.to_wall_ns(trig.time_ns) if trig else rec.clock.realtime_ns
    secs, ns = divmod(wall_ns, 10**9)
    try:
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(secs)) + f"{ns // 10**6:03d}Z"
    except (OverflowError, OSError, ValueError):
        stamp = "unknown-time"
    return f"{safe_name(rec.host)}-{safe_name(incident, 96)}-{stamp}{DUMP_SUFFIX}"


def _target(dir_or_path: str | os.PathLike[str], rec: Recording) -> Path:
    path = Path(dir_or_path)
    if path.suffix == DUMP_SUFFIX and not path.is_dir():
        return path
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DumpWriteError(
            f"{path}: cannot create the dump folder: {exc.strerror or exc}"
        ) from exc
    final = path / dump_file_name(rec)
    n = 1
    while final.exists():
        final = path / f"{final.name.removesuffix(DUMP_SUFFIX).rsplit('~', 1)[0]}~{n}{DUMP_SUFFIX}"
        n += 1
    return final


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_temp(temp: Path, chunks: Iterator[_Chunk]) -> None:
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "wb") as out:
        for chunk in chunks:
            out.write(chunk)
        out.flush()
        os.fsync(out.fileno())


def write_dump(dir_or_path: str | os.PathLike[str], rec: Recording) -> Path:
    """Write ``rec`` atomically; returns the final path.

    ``dir_or_path`` is a folder, created if missing (the file is named by
    ``dump_file_name``, with ``~N`` added if that name is taken), or the
    file's path if it ends in ``.msgpack``.  Raises
    DumpWriteError naming the path and the reason (disk full, read-only,
    permissions); the temporary file is removed on failure."""
    final = _target(dir_or_path, rec)
    chunks = _chunks(rec)  # a Recording that breaks the model fails here, before any I/O
    return _write_atomic(final, chunks)


def write_dump_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write a dump's bytes as they are (a copy fetched from an agent, already
    checked by ``decode``) to ``path``, atomically as ``write_dump`` does."""
    return _write_atomic(Path(path), iter((data,)))


def _write_atomic(final: Path, chunks: Iterator[_Chunk]) -> Path:
    temp = final.with_name(f".{final.name}{TEMP_MARKER}{os.getpid()}-{secrets.token_hex(4)}")
    try:
        _write_temp(temp, chunks)
        os.replace(temp, final)
    except OSError as exc:
        _remove_quietly(temp)
        raise DumpWriteError(f"{final}: cannot write dump: {exc.strerror or exc}") from exc
    except BaseException:
        _remove_quietly(temp)
        raise
    try:
        _fsync_dir(final.parent)
    except OSError as exc:  # the file is in place; only its durability is in doubt
        log.warning("%s: written, but fsync of its directory failed: %s", final, exc)
    return final


def _remove_quietly(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("%s: cannot remove temporary file: %s", path, exc)


# ---------------------------------------------------------------- reading


class _Checker:
    """Field access on a decoded document that fails with the field's path."""

    def __init__(self, name: str) -> None:
        self.name = name

    def fail(self, path: str, problem: str) -> NoReturn:
        raise DumpFormatError(f"{self.name}: {path}: {problem}")

    def damaged(self, section: str, problem: str) -> NoReturn:
        raise DumpChecksumError(f"{self.name}: {section}: damaged ({problem})")

    def map(self, obj: object, path: str, keys: tuple[str, ...] | None) -> dict[str, object]:
        if not isinstance(obj, dict):
            self.fail(path, f"expected a map, found {_kind(obj)}")
        if keys is not None:
            missing = [k for k in keys if k not in obj]
            if missing:
                self.fail(path, f"missing field {missing[0]!r}")
            extra = [k for k in obj if k not in keys]
            if extra:
                self.fail(path, f"unexpected field {str(extra[0])[:40]!r}")
        return obj

    def array(self, obj: object, path: str) -> list[object]:
        if not isinstance(obj, list):
            self.fail(path, f"expected an array, found {_kind(obj)}")
        return obj

    def integer(self, obj: object, path: str, bounds: tuple[int, int] = U64) -> int:
        if not isinstance(obj, int) or isinstance(obj, bool):
            self.fail(path, f"expected an integer, found {_kind(obj)}")
        lo, hi = bounds
        if not lo <= obj <= hi:
            self.fail(path, f"expected an integer in [{lo}, {hi}], found {obj}")
        return obj

    def opt_int(self, obj: object, path: str, bounds: tuple[int, int]) -> int | None:
        return None if obj is None else self.integer(obj, path, bounds)

    def string(self, obj: object, path: str) -> str:
        if not isinstance(obj, str):
            self.fail(path, f"expected a string, found {_kind(obj)}")
        return obj

    def strings(self, obj: object, path: str) -> tuple[str, ...]:
        return tuple(self.string(x, f"{path}[{i}]") for i, x in enumerate(self.array(obj, path)))


def _kind(obj: object) -> str:
    if obj is None:
        return "nil"
    return {bytes: "binary", str: "string", list: "array", dict: "map", bool: "boolean"}.get(
        type(obj), type(obj).__name__
    )


# the document's keys, each with the format version that brought it
TOP_KEYS_SINCE: tuple[tuple[str, int], ...] = (
    *((k, 1) for k in ("format", "version", "host", "boot_id", "agent", "trigger", "clock")),
    *((k, 1) for k in ("processes", "communicators", "rings", "counters")),
    ("snapshots", 3),
    ("checksums", CHECKSUMS_SINCE),
    ("links", 7),
    ("programs", 10),
)


@functools.cache
def top_keys(version: int) -> tuple[str, ...]:
    """The keys a document of format ``version`` holds."""
    return tuple(k for k, since in TOP_KEYS_SINCE if version >= since)


_TRIGGER_KEYS = ("kind", "reason", "incident_id", "time_ns", "pid", "comm_hash", "origin_host")
# world_rank: only an input that names it (Flight Recorder) sets it, never a dump
_PROCESS_KEYS = tuple(k for k in ProcessInfo.__dataclass_fields__ if k != "world_rank")
_COMM_KEYS = tuple(CommInfo.__dataclass_fields__)
_RING_KEYS = ("dtype", "rows", "data", "overwritten", "lost")


_BIN_LENGTH_BYTES = {0xC4: 1, 0xC5: 2, 0xC6: 4}


class _Source:
    """The file as msgpack's Unpacker reads it, plus the bytes that
    ``_read_bin`` takes straight from the file, around the Unpacker."""

    def __init__(self, stream: BinaryIO, size: int, defer: frozenset[str] = frozenset()) -> None:
        self.stream = stream
        self.size = size
        self.defer = defer  # rings whose data is skipped, not read (_skip_bin)
        self.pos = 0  # bytes taken from the stream
        self.bypassed = 0  # of which read around the Unpacker
        self.up = msgpack.Unpacker(
            self,
            raw=False,
            strict_map_key=True,
            # the whole file when every ring is read; a header's worth when
            # rings are left in the file (thousands of dumps: no 64 KiB each)
            read_size=1 << 14 if defer else 1 << 16,
            max_buffer_size=max(size, 1 << 20),
            max_str_len=size,
            max_bin_len=size,
            max_array_len=size,
            max_map_len=size,
            max_ext_len=size,
        )

    def read(self, n: int) -> bytes:
        data = self.stream.read(n)
        self.pos += len(data)
        return data

    def offset(self) -> int:
        """Bytes of the document consumed so far."""
        return int(self.up.tell()) + self.bypassed

    def read_payload(self, n: int) -> np.ndarray | None:
        """``n`` bytes into a fresh array; None if the file ends first."""
        if n > self.size - self.offset():
            return None
        out = np.empty(n, dtype=np.uint8)
        buffered = min(n, self.pos - self.offset())
        out[:buffered] = np.frombuffer(self.up.read_bytes(buffered), dtype=np.uint8)
        view = memoryview(out)[buffered:]  # type: ignore[arg-type]
        while view:
            got = self.stream.readinto(view)  # type: ignore[attr-defined]
            if not got:
                return None
            view = view[got:]
            self.pos += got
            self.bypassed += got
        return out

    def skip_payload(self, n: int) -> bool:
        """Pass over ``n`` bytes (a seek); False if the file ends first."""
        if n > self.size - self.offset():
            return False
        buffered = min(n, self.pos - self.offset())
        self.up.read_bytes(buffered)
        if n > buffered:
            self.stream.seek(n - buffered, io.SEEK_CUR)
            self.pos += n - buffered
            self.bypassed += n - buffered
        return True


def _bin_length(src: _Source, c: _Checker, path: str) -> int:
    """The length in a bin object's header (its bytes follow)."""
    marker = src.up.read_bytes(1)
    width = _BIN_LENGTH_BYTES.get(marker[0]) if marker else None
    if width is None:
        c.fail(path, "expected binary data")
    raw = src.up.read_bytes(width)
    if len(raw) != width:
        c.fail(path, "truncated: the file ends inside the data")
    return int.from_bytes(raw, "big")


def _read_bin(src: _Source, c: _Checker, path: str) -> np.ndarray:
    """A bin object read straight into an array: one copy, however large."""
    payload = src.read_payload(_bin_length(src, c, path))
    if payload is None:
        c.fail(path, "truncated: the file ends inside the data")
    return payload


@dataclass(frozen=True, slots=True)
class _Skipped:
    """A bin object left in the file: where its bytes are."""

    offset: int
    nbytes: int


def _skip_bin(src: _Source, c: _Checker, path: str) -> _Skipped:
    """A bin object's place in the file, its bytes skipped (a seek)."""
    n = _bin_length(src, c, path)
    start = src.offset()
    if not src.skip_payload(n):
        c.fail(path, "truncated: the file ends inside the data")
    return _Skipped(start, n)


def _walk_map(src: _Source, c: _Checker, path: str) -> dict[str, object]:
    """A map whose ``rings.*.data`` values are read by ``_read_bin``; every
    other value is unpacked by msgpack."""
    try:
        n = src.up.read_map_header()
    except msgpack.UnpackValueError:
        c.fail(path, "expected a map" + (", not a stallwatch dump" if path == "document" else ""))
    out: dict[str, object] = {}
    for _ in range(n):
        key = src.up.unpack()
        if not isinstance(key, str):
            c.fail(path, f"expected string keys, found {_kind(key)}")
        sub = f"{path}.{key[:40]}" if path != "document" else key
        if sub == "rings" or (path == "rings" and key in RING_DTYPES):
            out[key] = _walk_map(src, c, sub)
        elif path.startswith("rings.") and key == "data":
            skip = path[len("rings.") :] in src.defer
            out[key] = _skip_bin(src, c, sub) if skip else _read_bin(src, c, sub)
        else:
            out[key] = src.up.unpack()
        if path == "document" and key in ("format", "version") and len(out) == 2:
            _check_header(out, c)  # the writer puts these first: a newer layout stops here
    return out


def _unpack(
    stream: BinaryIO, size: int, name: str, defer: frozenset[str] = frozenset()
) -> tuple[dict[str, object], int]:
    """The document, and how many bytes follow it."""
    if size == 0:
        raise DumpFormatError(f"{name}: empty file, not a stallwatch dump")
    c = _Checker(name)
    src = _Source(stream, size, defer)
    try:
        doc = _walk_map(src, c, "document")
    except (DumpFormatError, DumpVersionError):
        raise
    except msgpack.OutOfData:
        raise DumpFormatError(f"{name}: truncated (the file ends inside the document)") from None
    except (Exception, RecursionError, MemoryError) as exc:  # msgpack raises many kinds
        detail = f"{type(exc).__name__}: {exc}"[:120]
        raise DumpFormatError(
            f"{name}: corrupt, or not a stallwatch dump (invalid msgpack: {detail})"
        ) from None
    return doc, size - src.offset()


def _check_header(doc: dict[str, object], c: _Checker) -> int:
    fmt = doc.get("format")
    if fmt != FORMAT_NAME:
        found = repr(fmt)[:60] if "format" in doc else "no format field"
        c.fail("format", f"not a stallwatch dump (expected {FORMAT_NAME!r}, found {found})")
    version = c.integer(doc.get("version"), "version", (-(2**63), 2**64 - 1))
    if version > FORMAT_VERSION:
        raise DumpVersionError(
            f"{c.name}: written by a newer stallwatch (format version {version}, "
            f"this reader understands up to {FORMAT_VERSION})"
        )
    if version < 1:
        c.fail("version", f"expected a format version from 1 to {FORMAT_VERSION}, found {version}")
    return version


_SUM_KEYS = ("algorithm", "block", "header", "tables", "rings")


@dataclass(frozen=True, slots=True)
class _Sums:
    """The checksums of a file's ring data (the rest is checked when read)."""

    block: int
    rings: dict[str, tuple[int, ...]]  # ring name -> the CRC of each block of its data


def _is_u32(x: object) -> bool:
    return type(x) is int and 0 <= x < 1 << 32


def _sums_doc(obj: object, c: _Checker) -> dict[str, object]:
    """The ``checksums`` map, its shape checked (a damaged one checks nothing)."""
    if not isinstance(obj, dict) or tuple(obj) != _SUM_KEYS:
        c.damaged("checksums", "missing or unreadable")
    lo, hi = CHECK_BLOCK_RANGE
    block = obj["block"]
    rings = obj["rings"]
    ok = (
        obj["algorithm"] == CHECKSUM
        and type(block) is int
        and lo <= block <= hi
        and _is_u32(obj["header"])
        and _is_u32(obj["tables"])
        and isinstance(rings, dict)
        and all(
            isinstance(r, dict)
            and tuple(r) == ("meta", "data")
            and _is_u32(r["meta"])
            and isinstance(r["data"], list)
            and all(_is_u32(x) for x in r["data"])
            for r in rings.values()
        )
    )
    if not ok:
        c.damaged("checksums", "unreadable")
    return obj


def _same(c: _Checker, section: str, got: int, want: object) -> None:
    if got != want:
        c.damaged(section, f"checksum {got:08x}, written {want:08x}")


def _check_sums(doc: dict[str, object], c: _Checker, version: int) -> _Sums | None:
    """Every section's checksum against the file's, before any field is
    trusted; ring data left in the file (deferred) is checked when read.
    None for a dump written before checksums."""
    if version < CHECKSUMS_SINCE:
        return None
    sums = _sums_doc(doc.get("checksums"), c)
    for section, keys in (("header", HEADER_KEYS), ("tables", TABLE_KEYS)):
        _same(c, section, _section(doc, keys), sums[section])
    rings = doc.get("rings")
    written = cast(dict[str, dict[str, Any]], sums["rings"])  # _sums_doc checked its shape
    if not isinstance(rings, dict) or list(rings) != list(written):
        c.damaged("rings", "its rings are not those the checksums were written for")
    block = cast(int, sums["block"])
    out: dict[str, tuple[int, ...]] = {}
    for name, ring in rings.items():
        r = ring if isinstance(ring, dict) else {}
        path = f"rings.{str(name)[:40]}"
        _same(c, path, section_crc([r.get(k) for k in RING_META]), written[name]["meta"])
        crcs = tuple(written[name]["data"])
        data = r.get("data")
        if isinstance(data, np.ndarray | _Skipped):
            if len(crcs) != -(-data.nbytes // block):
                c.damaged(path, f"{len(crcs)} checksums for {data.nbytes} bytes of data")
            if isinstance(data, np.ndarray):
                _check_blocks(c.name, path, data.data, crcs, block)
        out[name] = crcs
    return _Sums(block, out)


def _check_blocks(
    name: str, path: str, data: memoryview, crcs: tuple[int, ...], block: int
) -> None:
    for k, got in enumerate(block_crcs(data, block)):
        if got != crcs[k]:
            lo, hi = k * block, min((k + 1) * block, len(data)) - 1
            raise DumpChecksumError(
                f"{name}: {path}: damaged (bytes {lo}-{hi} of its data: checksum {got:08x}, "
                f"written {crcs[k]:08x})"
            )


def _read_trigger(obj: object, c: _Checker) -> Trigger | None:
    if obj is None:
        return None
    t = c.map(obj, "trigger", _TRIGGER_KEYS)
    kind = c.string(t["kind"], "trigger.kind")
    try:
        trigger_kind = TriggerKind(kind)
    except ValueError:
        c.fail("trigger.kind", f"unknown trigger kind {kind[:40]!r}")
    return Trigger(
        kind=trigger_kind,
        reason=c.string(t["reason"], "trigger.reason"),
        incident_id=c.string(t["incident_id"], "trigger.incident_id"),
        time_ns=c.integer(t["time_ns"], "trigger.time_ns"),
        pid=c.integer(t["pid"], "trigger.pid", U32),
        comm_hash=c.integer(t["comm_hash"], "trigger.comm_hash"),
        origin_host=c.string(t["origin_host"], "trigger.origin_host"),
    )


def _read_process(obj: object, path: str, c: _Checker) -> ProcessInfo:
    p = c.map(obj, path, _PROCESS_KEYS)
    return ProcessInfo(
        pid=c.integer(p["pid"], f"{path}.pid", U32),
        comm=c.string(p["comm"], f"{path}.comm"),
        cmdline=c.string(p["cmdline"], f"{path}.cmdline"),
        netns=c.integer(p["netns"], f"{path}.netns"),
        start_ns=c.integer(p["start_ns"], f"{path}.start_ns"),
        libs=c.strings(p["libs"], f"{path}.libs"),
        exit_ns=c.integer(p["exit_ns"], f"{path}.exit_ns"),
        exit_code=c.opt_int(p["exit_code"], f"{path}.exit_code", I32),
        exit_signal=c.opt_int(p["exit_signal"], f"{path}.exit_signal", I32),
    )


# per field of a communicator entry: the bounds of its integer, or None for text
_COMM_BOUNDS: dict[str, tuple[int, int] | None] = {
    "pid": U32, "comm": U64, "comm_hash": U64, "rank": I32, "nranks": I32,
    "parent_hash": U64, "color": I32, "key": I32, "root_addr": None, "init_ns": U64,
    "destroy_ns": U64,
}  # fmt: skip


def _comms_fast(objs: list[object]) -> tuple[CommInfo, ...] | None:
    """A well-formed communicator table, checked field by field across all
    its entries (a host's table lists one entry per rank and communicator,
    and thousands of dumps repeat it); None when anything is off, for
    ``_read_comm`` to name the entry and field."""
    keys = tuple(_COMM_BOUNDS)
    maps = [m for m in objs if type(m) is dict and tuple(m) == keys]
    if not maps or len(maps) != len(objs):
        return None
    columns = list(zip(*(m.values() for m in maps), strict=True))
    for col, bounds in zip(columns, _COMM_BOUNDS.values(), strict=True):
        if bounds is None:
            if set(map(type, col)) != {str}:
                return None
        elif set(map(type, col)) != {int} or min(col) < bounds[0] or max(col) > bounds[1]:
            return None
    return tuple(CommInfo(*values) for values in zip(*columns, strict=True))


def _read_comm(obj: object, path: str, c: _Checker) -> CommInfo:
    m = c.map(obj, path, _COMM_KEYS)
    return CommInfo(
        pid=c.integer(m["pid"], f"{path}.pid", U32),
        comm=c.integer(m["comm"], f"{path}.comm"),
        comm_hash=c.integer(m["comm_hash"], f"{path}.comm_hash"),
        rank=c.integer(m["rank"], f"{path}.rank", I32),
        nranks=c.integer(m["nranks"], f"{path}.nranks", I32),
        parent_hash=c.integer(m["parent_hash"], f"{path}.parent_hash"),
        color=c.integer(m["color"], f"{path}.color", I32),
        key=c.integer(m["key"], f"{path}.key", I32),
        root_addr=c.string(m["root_addr"], f"{path}.root_addr"),
        init_ns=c.integer(m["init_ns"], f"{path}.init_ns"),
        destroy_ns=c.integer(m["destroy_ns"], f"{path}.destroy_ns"),
    )


def _advise(path: str, offset: int, length: int) -> None:
    """posix_fadvise(WILLNEED) on a range of a file, if the system has it."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None or length <= 0:
        return
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        advise(fd, offset, length, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


def prefetch_head(path: str | os.PathLike[str], length: int = 1 << 16) -> None:
    """Ask the kernel to start reading a file's first bytes (its header),
    without waiting: done for many files before any is parsed."""
    _advise(os.fspath(path), 0, length)


@dataclass(frozen=True, slots=True)
class DeferredRing:
    """A ring whose rows were left in the file (``read_dump_deferred``):
    where they are, read when wanted into a buffer the caller reuses, so that
    a large set of dumps is never all in memory at once."""

    path: str
    name: str
    offset: int  # of the rows in the file
    rows: int
    overwritten: int
    lost: int
    stamp: tuple[int, int, int]  # the file's (inode, size, mtime ns) when it was read
    version: int = FORMAT_VERSION  # of the file: older rows are converted when read
    checksums: tuple[int, ...] = ()  # of each block of its data; () before format 6
    block: int = CHECK_BLOCK  # bytes per checksum

    @property
    def nbytes(self) -> int:
        return self.rows * ring_dtype(self.name, self.version).itemsize

    def prefetch(self, first: int = 0) -> None:
        """Ask the kernel to start reading the rows from ``first`` on (no
        wait): many dumps' rows are then fetched from disk side by side
        rather than one file after another.  Best effort: errors are left
        for ``read`` to report."""
        first = min(max(first, 0), self.rows)
        size = ring_dtype(self.name, self.version).itemsize
        _advise(self.path, self.offset + first * size, (self.rows - first) * size)

    def read(self, buffer: bytearray | None = None, first: int = 0) -> np.ndarray:
        """The rows from ``first`` on (the latest ones: rings are oldest
        first), in ``buffer`` (long enough; the result is a view of it,
        unless the file is of an older format: then converted rows in fresh
        memory) or in fresh memory.  The blocks of data they lie in are
        checked against their checksums (the bytes of the first block
        before ``first`` are read for it, apart).  DumpError if the file is
        gone or changed since it was read, DumpChecksumError if a block is
        damaged."""
        first = min(max(first, 0), self.rows)
        size = ring_dtype(self.name, self.version).itemsize
        nbytes = (self.rows - first) * size
        out = buffer if buffer is not None else bytearray(nbytes)
        if len(out) < nbytes:
            raise ValueError(f"buffer of {len(out)} bytes for {nbytes}")
        view = memoryview(out)[:nbytes]
        start = first * size  # in the ring's data
        lead = start % self.block if self.checksums and nbytes else 0
        try:
            with open(self.path, "rb", buffering=0) as f:
                st = os.fstat(f.fileno())
                if (st.st_ino, st.st_size, st.st_mtime_ns) != self.stamp:
                    raise DumpError(f"{self.path}: changed since it was first read")
                f.seek(self.offset + start - lead)
                head = bytearray(lead)
                self._fill(f, memoryview(head))
                self._fill(f, view)
        except FileNotFoundError:
            raise DumpError(f"{self.path}: removed since it was first read") from None
        except OSError as exc:
            raise DumpError(f"{self.path}: cannot read: {exc.strerror or exc}") from None
        if self.checksums:
            self._check(head, view, start)
        dtype = ring_dtype(self.name, self.version)
        rows = np.frombuffer(out, dtype=dtype, count=self.rows - first)
        return upgrade_rows(self.name, rows, self.version)

    def _fill(self, f: BinaryIO, view: memoryview) -> None:
        while view:
            got = f.readinto(view)  # type: ignore[attr-defined]
            if not got:
                raise DumpError(f"{self.path}: truncated since it was first read")
            view = view[got:]

    def _check(self, head: bytearray, view: memoryview, start: int) -> None:
        """The blocks that hold the data from ``start`` on: ``head`` is the
        first one's bytes before ``start``, ``view`` the data after it."""
        total = self.rows * ring_dtype(self.name, self.version).itemsize
        k = start // self.block
        crc, at = zlib.crc32(head), 0
        while at < len(view):
            end = min((k + 1) * self.block, total) - start
            crc = zlib.crc32(view[at:end], crc)
            if crc != self.checksums[k]:
                lo, hi = k * self.block, end + start - 1
                raise DumpChecksumError(
                    f"{self.path}: rings.{self.name}: damaged (bytes {lo}-{hi} of its data: "
                    f"checksum {crc:08x}, written {self.checksums[k]:08x})"
                )
            at, k, crc = end, k + 1, 0


@dataclass(frozen=True, slots=True)
class _Deferred:
    offset: int
    rows: int
    overwritten: int
    lost: int
    version: int
    checksums: tuple[int, ...] = ()
    block: int = CHECK_BLOCK


def _read_ring(
    name: str, obj: object, c: _Checker, version: int, sums: _Sums | None
) -> Ring | _Deferred:
    path = f"rings.{name[:40]}"
    if name not in RING_DTYPES:
        c.fail(path, f"unknown ring (this reader knows {', '.join(RING_DTYPES)})")
    if version < RING_SINCE.get(name, 0):
        c.fail(path, f"no such ring in format version {version} (from {RING_SINCE[name]} on)")
    dtype = ring_dtype(name, version)
    r = c.map(obj, path, _RING_KEYS)
    if r["dtype"] != _expected_descr(name, version):
        c.fail(
            f"{path}.dtype",
            f"does not match this reader's schema for that ring (version {version})",
        )
    rows = c.integer(r["rows"], f"{path}.rows")
    data = r["data"]
    if not isinstance(data, np.ndarray | _Skipped):  # _walk_map reads every ring's data itself
        c.fail(f"{path}.data", f"expected binary, found {_kind(data)}")
    if data.nbytes != rows * dtype.itemsize:
        c.fail(
            f"{path}.data",
            f"expected {rows * dtype.itemsize} bytes for {rows} rows, found {data.nbytes}",
        )
    if isinstance(data, _Skipped):
        return _Deferred(
            data.offset,
            rows,
            c.integer(r["overwritten"], f"{path}.overwritten"),
            c.integer(r["lost"], f"{path}.lost"),
            version,
            sums.rings[name] if sums is not None else (),
            sums.block if sums is not None else CHECK_BLOCK,
        )
    return Ring(
        rows=upgrade_rows(name, data.view(dtype), version),
        overwritten=c.integer(r["overwritten"], f"{path}.overwritten"),
        lost=c.integer(r["lost"], f"{path}.lost"),
    )


def _read_rings(
    obj: object, c: _Checker, version: int, sums: _Sums | None
) -> dict[str, Ring | _Deferred]:
    rings = c.map(obj, "rings", None)
    return {name: _read_ring(name, ring, c, version, sums) for name, ring in rings.items()}


def _read_counters(obj: object, c: _Checker) -> dict[str, int]:
    counters = c.map(obj, "counters", None)
    out: dict[str, int] = {}
    for key, value in counters.items():
        name = c.string(key, "counters (a key)")
        out[name] = c.integer(value, f"counters.{name[:40]}")
    return out


def decode(data: bytes, name: str) -> Recording:
    """Parse and validate a dump; ``name`` (usually the path) heads every error."""
    return _decode_stream(io.BytesIO(data), len(data), name)


def _decode_stream(stream: BinaryIO, size: int, name: str) -> Recording:
    return _decode_parts(stream, size, name, frozenset())[0]


def _decode_parts(
    stream: BinaryIO, size: int, name: str, defer: frozenset[str]
) -> tuple[Recording, dict[str, _Deferred]]:
    c = _Checker(name)
    doc, trailing = _unpack(stream, size, name, defer)
    version = _check_header(doc, c)
    if trailing:
        c.fail("document", f"{trailing} unexpected bytes after the document")
    sums = _check_sums(doc, c, version)
    doc = c.map(doc, "document", top_keys(version))
    agent = c.map(doc["agent"], "agent", ("version", "args"))
    clock = c.map(doc["clock"], "clock", ("monotonic_ns", "realtime_ns"))
    procs = c.array(doc["processes"], "processes")
    comms = c.array(doc["communicators"], "communicators")
    rings = _read_rings(doc["rings"], c, version, sums)
    rec = Recording(
        host=c.string(doc["host"], "host"),
        boot_id=c.string(doc["boot_id"], "boot_id"),
        clock=Clock(
            monotonic_ns=c.integer(clock["monotonic_ns"], "clock.monotonic_ns"),
            realtime_ns=c.integer(clock["realtime_ns"], "clock.realtime_ns"),
        ),
        processes=tuple(_read_process(p, f"processes[{i}]", c) for i, p in enumerate(procs)),
        communicators=_comms_fast(comms)
        or tuple(_read_comm(m, f"communicators[{i}]", c) for i, m in enumerate(comms)),
        rings={k: r for k, r in rings.items() if isinstance(r, Ring)},
        agent_version=c.string(agent["version"], "agent.version"),
        agent_args=c.strings(agent["args"], "agent.args"),
        trigger=_read_trigger(doc["trigger"], c),
        counters=_read_counters(doc["counters"], c),
        snapshots=read_snapshots(doc["snapshots"], c) if version >= 3 else (),
        links=read_links(doc["links"], c) if version >= 7 else (),
        programs=read_programs(doc["programs"], c) if version >= 10 else (),
        format_version=version,
    )
    return rec, {k: r for k, r in rings.items() if isinstance(r, _Deferred)}


def read_dump(path: str | os.PathLike[str]) -> Recording:
    """Read and validate one dump file.  DumpError if it cannot be opened,
    DumpFormatError/DumpVersionError if it is not a dump this reader accepts."""
    return read_dump_deferred(path, ())[0]


def dump_trigger(path: Path) -> Trigger | None:
    """A dump file's trigger (None: a dump taken with none), its header read
    once per version of the file (its mtime and size), the rings left
    unread: for whoever looks at a folder of dumps again and again (the
    agent's retention, the lab waiting for its nodes' dumps).  DumpError if
    it cannot be read (gone, being written, not a dump)."""
    try:
        st = path.stat()
    except OSError as exc:
        raise DumpError(f"{path}: cannot read: {exc.strerror or exc}") from None
    got = _trigger_at(path, (st.st_mtime_ns, st.st_size))
    if isinstance(got, str):
        raise DumpError(got)
    return got


@functools.lru_cache(maxsize=4096)
def _trigger_at(path: Path, stamp: tuple[int, int]) -> Trigger | str | None:
    """The trigger, or why the file cannot be read (kept as such: a file
    that changes has another stamp)."""
    try:
        return read_dump_deferred(path, RING_DTYPES)[0].trigger
    except DumpError as exc:
        return str(exc)


def read_dump_deferred(
    path: str | os.PathLike[str], defer: Collection[str]
) -> tuple[Recording, dict[str, DeferredRing]]:
    """``read_dump``, leaving the rows of the rings named in ``defer`` in the
    file: those rings are validated (dtype, size) and returned apart, to be
    read when wanted (``DeferredRing.read``); the recording lacks them."""
    name = os.fspath(path)
    try:
        with open(path, "rb", buffering=0) as stream:
            st = os.fstat(stream.fileno())
            rec, deferred = _decode_parts(stream, st.st_size, name, frozenset(defer))
            stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
            return rec, {
                k: DeferredRing(
                    name,
                    k,
                    d.offset,
                    d.rows,
                    d.overwritten,
                    d.lost,
                    stamp,
                    d.version,
                    d.checksums,
                    d.block,
                )
                for k, d in deferred.items()
            }
    except IsADirectoryError:
        raise DumpFormatError(f"{name}: is a directory, not a dump file") from None
    except FileNotFoundError:
        raise DumpError(f"{name}: no such file") from None
    except OSError as exc:
        raise DumpError(f"{name}: cannot read: {exc.strerror or exc}") from None

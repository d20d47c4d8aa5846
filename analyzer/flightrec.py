"""PyTorch Flight Recorder dumps, pickle or JSON: one file read into a ``FrDump``.

A dump is data, never code: pickles are read with an unpickler whose
``find_class`` refuses every global, so only dicts, lists, tuples, strings,
bytes, numbers, booleans and None can be built.  One dump per rank; the rank
comes from a ``rank`` field when present, else from the file name
(``..._<rank>``, as torch names them).  ``frincident`` turns the dumps of a
folder into one incident.

Field sets read (the format's ``version``):
- 1.x: ``seq_id`` (one sequence for every op), ``pg_id`` names the group,
  no ``process_group``, ``is_p2p`` or dtypes (p2p told by the op's name).
- 2.0-2.1: ``process_group`` (name, desc), ``collective_seq_id`` and
  ``p2p_seq_id``, ``op_id`` (one per op inside a coalesced group).
- 2.2+: ``is_p2p``, ``input_dtypes``/``output_dtypes``; later ``pg_status``
  (per ``pg_id``: last enqueued, started, completed), ``nccl_version`` (2.9)
  then ``comm_lib_version`` (2.10), ``duration_ms`` when timing is on.
The JSON form writes ``process_group`` as a list, absent times as 0 and the
``pg_status`` counters as strings.

Recorders: a backend's name leads each profiling name ("nccl:", "gloo:", and
from torch 2.14 c10d's FlightRecorderHook's: "c10d:" in 2.14, the backend's
own name after 2.15, "nccl2:").  An entry's group is its process group and
that backend: one group served by two backends is two communicators, each
sequenced by its own recorder.  The hook retires an entry when its op is
issued on backends that push no completion (and in 2.14 on all): for its
entries only a completion ends a call, and a retired one reads as returned
(``State.ENQUEUED``).

What each field means here: ``profiling_name`` ("nccl:all_reduce",
"gloo:broadcast", "nccl:send 0->1") gives the op and the peer; the sizes and
dtypes of the side that carries this rank's own data give count, shape and
datatype (the output side for scatter, reduce_scatter and recv: a scatter's
non-root ranks have no input); an entry has ended when it is ``retired``,
``completed`` or has a completion time (gloo never fills ``state``, and
retires a work that failed as it retires one that succeeded).  Ops of one
coalesced group share a ``collective_seq_id``: they become one call, its
count the sum and its shape the list of theirs.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import gc
import io
import json
import marshal
import math
import operator
import pickle
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path
from typing import Any

import numpy as np

from stallwatch.dumpers.errors import DumpFormatError, DumpVersionError
from stallwatch.dumpers.inputs import looks_like_flightrec
from stallwatch.dumpers.schema import DataType, Op, State

from .incident import UNKNOWN_DTYPE, WINDOW_CALLS

__all__ = [
    "FrDump",
    "Origin",
    "backend_of",
    "is_hooked",
    "looks_like_flightrec",
    "rank_in_name",
    "read_flightrec",
    "stack_of",
]

COALESCED = 254  # an end-of-group marker entry ("nccl:coalesced"), folded away
OPS: dict[str, int] = {
    "all_reduce": Op.ALL_REDUCE,
    "allreduce": Op.ALL_REDUCE,
    "allreduce_coalesced": Op.ALL_REDUCE,
    "all_gather": Op.ALL_GATHER,
    "allgather": Op.ALL_GATHER,
    "all_gather_single": Op.ALL_GATHER,
    "all_gather_v": Op.ALL_GATHER,
    "_all_gather_base": Op.ALL_GATHER,
    "all_gather_into_tensor_coalesced": Op.ALL_GATHER,
    "allgather_coalesced": Op.ALL_GATHER,
    "ALLGATHER_coalesced": Op.ALL_GATHER,
    "reduce_scatter": Op.REDUCE_SCATTER,
    "reduce_scatter_single": Op.REDUCE_SCATTER,
    "reduce_scatter_v": Op.REDUCE_SCATTER,
    "_reduce_scatter_base": Op.REDUCE_SCATTER,
    "reduce_scatter_tensor_coalesced": Op.REDUCE_SCATTER,
    "REDUCE_SCATTER_coalesced": Op.REDUCE_SCATTER,
    "broadcast": Op.BROADCAST,
    "_broadcast_oop": Op.BROADCAST,
    "reduce": Op.REDUCE,
    "_reduce_oop": Op.REDUCE,
    "all_to_all": Op.ALL_TO_ALL,
    "all_to_all_single": Op.ALL_TO_ALL,
    "all_to_all_v_single": Op.ALL_TO_ALL,
    "alltoall": Op.ALL_TO_ALL,
    "alltoall_base": Op.ALL_TO_ALL,
    "gather": Op.GATHER,
    "scatter": Op.SCATTER,
    "barrier": Op.BARRIER,
    "all_reduce_barrier": Op.BARRIER,
    "send": Op.SEND,
    "recv": Op.RECV,
    "coalesced": COALESCED,
}
# ops whose own data is their output (a scatter's non-root ranks pass no input)
OUTPUT_SIDE = np.zeros(256, dtype=bool)
OUTPUT_SIDE[[Op.SCATTER, Op.REDUCE_SCATTER, Op.RECV]] = True
IS_P2P_OP = np.zeros(256, dtype=bool)
IS_P2P_OP[[Op.SEND, Op.RECV]] = True
DTYPES: dict[str, int] = {
    "Float": DataType.FLOAT32,
    "BFloat16": DataType.BFLOAT16,
    "Half": DataType.FLOAT16,
    "Double": DataType.FLOAT64,
    "Long": DataType.INT64,
    "Int": DataType.INT32,
    "Byte": DataType.UINT8,
    "Char": DataType.INT8,
    "Bool": DataType.UINT8,
    "UInt32": DataType.UINT32,
    "UInt64": DataType.UINT64,
    "Float8_e4m3fn": DataType.FLOAT8E4M3,
    "Float8_e5m2": DataType.FLOAT8E5M2,
}
STATES = {"scheduled": State.SCHEDULED, "started": State.STARTED, "completed": State.COMPLETED}
# backends whose process groups write to a Flight Recorder themselves (torch's
# recordsFlightRecorderNatively, and the vendor builds torchfrtrace knows);
# any other name in a profiling name is c10d's FlightRecorderHook's
NATIVE_BACKENDS = frozenset({"", "nccl", "gloo", "xccl", "ncclx", "rccl", "rcclx", "mccl", "hccl"})
_RANK_IN_NAME = re.compile(r"(\d+)(?:\.json|\.pkl|\.pickle)?$")
_PEER = re.compile(r"(\d+)\s*(?:->|<-)\s*(\d+)")


_PREFETCH = 64 << 10  # bytes the unpickler sees at once: less than its own prefetch


class _DataOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused global {module}.{name}: a dump is data, not code")


FR_ENTRY = np.dtype(
    [
        ("pg_id", "<i8"),
        ("pg", "<i4"),  # index into FrDump.pg_names and pg_backends
        ("seq", "<i8"),  # collective_seq_id, or p2p_seq_id for p2p
        ("op_id", "<i8"),
        ("is_p2p", "?"),
        ("op", "u1"),
        ("count", "<u8"),  # elements of this rank's own data
        ("shape", "<u4"),  # index into FrDump.shapes
        ("datatype", "u1"),
        ("state", "u1"),
        ("ended", "?"),  # retired or completed (failed or not)
        ("created", "<i8"),
        ("completed", "<i8"),
        ("peer", "<i4"),
    ]
)


@dataclass(frozen=True, slots=True)
class FrDump:
    path: str
    rank: int
    version: str
    backend: str  # "nccl", "gloo", ... from the ops' names; "" without entries
    pg_ranks: dict[str, tuple[int, ...]]  # group name -> world ranks (pg_config, non-empty)
    pg_desc: dict[str, str]  # group name -> description (entries, pg_config)
    pg_status: dict[int, tuple[int, int]]  # pg_id -> (last enqueued, last completed)
    pg_names: tuple[str, ...]  # the groups its entries name
    shapes: tuple[str, ...]  # entries' "shape" indexes it
    entries: np.ndarray  # FR_ENTRY, in record order
    wrapped: bool  # its ring overwrote entries (the first kept is not record 0)
    notes: tuple[str, ...] = ()  # what of it could not be used, and why
    # the backend of each of pg_names' entries ("pg" indexes both): a group
    # served by two backends is two communicators, each sequenced by its own
    # recorder (a "cpu:gloo,cuda:nccl2" group: gloo's and the hook's)
    pg_backends: tuple[str, ...] = ()
    origin: Origin | None = None  # a file stallwatch wrote: what torch's format cannot hold


@dataclass(frozen=True, slots=True)
class Origin:
    """The ``stallwatch`` section of a file ``stallwatch export
    --flight-recorder`` wrote (``analyzer.frexport``): what Flight Recorder
    has no field for, which adds to what the file says and never changes
    it (the seqs are the file's, as torch numbers them; whether the ring
    wrapped is its record ids').  Unknown values are None."""

    pid: int | None
    exit_code: int | None
    exit_signal: int | None
    exit_wall_ns: int | None
    comms: dict[str, int]  # group name -> our communicator id (its hash)
    # calls that returned an error: (group name, seq, p2p, result, return time)
    errors: tuple[tuple[str, int, bool, int, int], ...] = ()


def rank_in_name(path: str) -> int | None:
    """The rank torch puts at the end of a dump's file name, if any."""
    m = _RANK_IN_NAME.search(Path(path).name)
    return int(m.group(1)) if m else None


def _unpickle(data: bytes) -> Any:
    """``data`` unpickled with globals refused.  The C unpickler prefetches
    from a stream that can ``peek`` and otherwise calls ``read`` once per
    opcode (torch writes protocol 2: no frames to read at once): from a bare
    BytesIO that cost 4.6 times what ``pickle.loads`` does (callgrind, 2,000
    entries with stacks), behind a buffer 1.1 times."""
    stream = io.BufferedReader(io.BytesIO(data), buffer_size=_PREFETCH)
    return _DataOnly(stream).load()


def _parse(path: str, data: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(data) if data.lstrip()[:1] == b"{" else _unpickle(data)
    except (
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        TypeError,
        IndexError,
        KeyError,
        AttributeError,
        RecursionError,
        MemoryError,
    ) as exc:
        raise DumpFormatError(f"{path}: not a readable Flight Recorder dump: {exc}") from None
    if not isinstance(doc, dict):
        raise DumpFormatError(
            f"{path}: Flight Recorder dump must be a dict, found {type(doc).__name__}"
        )
    return doc


def read_flightrec(path: str) -> FrDump:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise DumpFormatError(f"{path}: cannot read: {exc.strerror or exc}") from None
    with _gc_paused():
        return _read(path, data)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """The cycle collector off while a dump's tens of thousands of dicts are
    built and read: they hold no cycles, and its passes over them cost a
    fifth of the time."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _read(path: str, data: bytes) -> FrDump:
    doc = _parse(path, data)
    version = doc.get("version")
    if not isinstance(version, str):
        raise DumpFormatError(f"{path}: field 'version': expected a string, found {version!r}")
    if version.split(".")[0] not in ("1", "2"):
        raise DumpVersionError(
            f"{path}: Flight Recorder version {version}; this reader knows 1.x and 2.x"
        )
    rank = _rank(path, doc)
    notes: list[str] = []
    ranks, desc = _pg_config(path, doc.get("pg_config", {}), notes)
    everything = doc.get("entries", [])
    if not isinstance(everything, list):
        raise DumpFormatError(f"{path}: field 'entries': expected a list")
    start = _window_start(everything)
    entries = everything[start:] if start else everything
    names: dict[tuple[str, str], int] = {}
    shapes: dict[str, int] = {"": 0}
    arr = _entries_by_column(entries, names, shapes)
    if arr is None:  # something is malformed: entry by entry, to say which and why
        names, shapes = {}, {"": 0}
        rows = [_entry(path, start + i, e, names, shapes) for i, e in enumerate(entries)]
        try:
            arr = np.array(rows, dtype=FR_ENTRY) if rows else np.zeros(0, dtype=FR_ENTRY)
        except (OverflowError, ValueError, TypeError) as exc:
            raise DumpFormatError(f"{path}: entries: a value out of range: {exc}") from None
    arr, shape_list = _fold_coalesced(arr, list(shapes))
    for name, d in _descs(entries).items():
        desc.setdefault(name, d)
    status = _pg_status(path, doc.get("pg_status", {}))
    origin = _origin(path, doc.get("stallwatch"))
    return FrDump(
        path,
        rank,
        version,
        _backend(entries),
        ranks,
        desc,
        status,
        tuple(n for n, _ in names),
        tuple(shape_list),
        arr,
        start > 0 or _wrapped(entries),
        tuple(notes),
        tuple(b for _, b in names),
        origin,
    )


Frame = tuple[str, str, int]  # function, file, line


def stack_of(path: str, group: str, backend: str | None, seq: int, p2p: bool) -> tuple[Frame, ...]:
    """The Python stack torch recorded for one call of a dump (the entry of
    that group, backend and seq), innermost first; () where it recorded none.
    Read only for the calls a verdict cites: the reader never builds frames'
    text, and a file is read again for them, whole."""
    try:
        with _gc_paused():
            entries = _parse(path, Path(path).read_bytes()).get("entries")
    except (DumpFormatError, OSError):
        return ()
    key = "p2p_seq_id" if p2p else "collective_seq_id"
    for e in reversed(entries if isinstance(entries, list) else []):
        if not isinstance(e, dict) or e.get(key, e.get("seq_id")) != seq:
            continue
        pg = e.get("process_group")
        name = str(pg[0]) if isinstance(pg, (list, tuple)) and pg else str(e.get("pg_id"))
        if name != group or (
            backend is not None and backend_of(str(e.get("profiling_name"))) != backend
        ):
            continue
        frames = e.get("frames")
        if not isinstance(frames, list):
            return ()
        return tuple(
            (str(f.get("name", "?")), str(f.get("filename", "?")), int(f.get("line") or 0))
            for f in frames
            if isinstance(f, dict)
        )
    return ()


def _origin(path: str, section: object) -> Origin | None:
    """The ``stallwatch`` section, if the file has one."""
    if section is None:
        return None

    def number(key: str) -> int | None:
        v = section.get(key) if isinstance(section, dict) else None
        if v is None or (isinstance(v, int) and not isinstance(v, bool)):
            return v
        raise DumpFormatError(f"{path}: field 'stallwatch.{key}': expected an integer or null")

    if not isinstance(section, dict):
        raise DumpFormatError(f"{path}: field 'stallwatch': expected a dict")
    try:
        comms = {str(k): int(str(v), 16) for k, v in section.get("comms", {}).items()}
        errors = tuple(
            (
                str(e["group"]),
                int(e["seq"]),
                bool(e["p2p"]),
                int(e["result"]),
                int(e["end_ns"]),
            )
            for e in section.get("errors", [])
        )
    except (AttributeError, KeyError, TypeError, ValueError):
        raise DumpFormatError(
            f"{path}: field 'stallwatch': comms or errors malformed (expected group -> "
            "'0x...', and group, seq, p2p, result, end_ns per error)"
        ) from None
    return Origin(
        number("pid"),
        number("exit_code"),
        number("exit_signal"),
        number("exit_wall_ns"),
        comms,
        errors,
    )


def _window_start(entries: list[Any]) -> int:
    """The first entry read: of a rank's ring only its latest WINDOW_CALLS
    calls are, as of our own dumps (``incident.WINDOW_CALLS``), and older ones
    count as overwritten.  A coalesced group is never cut: its ops share a
    group and a seq, and the window opens at its first."""
    start = max(0, len(entries) - WINDOW_CALLS)
    try:
        first = _call_key(entries[start]) if start else None
        while start and _call_key(entries[start - 1]) == first:
            start -= 1
    except (AttributeError, KeyError, TypeError, IndexError):
        return 0  # malformed: read whole, entry by entry, to say where
    return start


def _call_key(e: dict[str, Any]) -> tuple[object, ...]:
    """What the ops of one coalesced group share."""
    seq = e.get("collective_seq_id", e.get("seq_id"))
    return (e.get("process_group"), e.get("pg_id"), e.get("is_p2p"), seq, e.get("p2p_seq_id"))


def _rank(path: str, doc: dict[str, Any]) -> int:
    if isinstance(doc.get("rank"), int):
        return int(doc["rank"])
    rank = rank_in_name(path)
    if rank is None:
        raise DumpFormatError(f"{path}: no 'rank' field and no rank at the end of the file name")
    return rank


def _pg_config(
    path: str, cfg: object, notes: list[str]
) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """Groups' members and descriptions, as far as they can be read: torch
    writes groups under an empty name, or ranks as '[]'; those name no group
    and say nothing (membership then comes from the entries)."""
    ranks: dict[str, tuple[int, ...]] = {}
    desc: dict[str, str] = {}
    if not isinstance(cfg, dict):
        notes.append(f"{path}: pg_config is not a dict: group members from the entries")
        return ranks, desc
    for name, c in cfg.items():
        try:
            r = c["ranks"]
            members = _ranks_text(r) if isinstance(r, str) else tuple(int(x) for x in r)
        except (KeyError, TypeError, ValueError, SyntaxError, AttributeError, MemoryError):
            notes.append(f"{path}: pg_config[{name!r}]: ranks unreadable: members from the entries")
            continue
        if str(name) and members:
            ranks[str(name)] = members
            if isinstance(c.get("desc"), str) and c["desc"]:
                desc[str(name)] = c["desc"]
    return ranks, desc


@functools.lru_cache(maxsize=256)
def _ranks_text(text: str) -> tuple[int, ...]:
    """A group's ranks as torch writes them ("[0, 1, ...]"): parsed once for
    all the dumps that repeat them."""
    return tuple(int(x) for x in ast.literal_eval(text))


def _pg_status(path: str, st: object) -> dict[int, tuple[int, int]]:
    if not isinstance(st, dict):
        return {}
    out = {}
    for k, v in st.items():
        try:
            out[int(k)] = (int(v["last_enqueued_collective"]), int(v["last_completed_collective"]))
        except (KeyError, TypeError, ValueError):
            raise DumpFormatError(
                f"{path}: pg_status[{k!r}]: expected last_*_collective counters"
            ) from None
    return out


def _descs(entries: list[Any]) -> dict[str, str]:
    """Group name -> description, from the entries' ``process_group`` (every
    entry is a dict by now: a malformed one was refused)."""
    groups = filter(None, map(dict.get, entries, repeat("process_group")))
    try:
        distinct = dict.fromkeys(map(tuple, groups))
    except TypeError:
        return {}
    out: dict[str, str] = {}
    for g in distinct:
        if len(g) == 2:
            out.setdefault(str(g[0]), str(g[1]))
    return out


def _backend(entries: list[Any]) -> str:
    for e in entries[:1]:
        name = e.get("profiling_name") if isinstance(e, dict) else None
        if isinstance(name, str):
            return name.split(":", 1)[0]
    return ""


def _wrapped(entries: list[Any]) -> bool:
    first = entries[0] if entries else None
    return (
        isinstance(first, dict)
        and isinstance(first.get("record_id"), int)
        and (first["record_id"] > 0)
    )


@functools.lru_cache(maxsize=4096)
def _op_and_peer(name: str) -> tuple[int, int]:
    short = name.split(":", 1)[-1].split(" ", 1)[0]
    peer = _PEER.search(name)
    return int(OPS.get(short, Op.UNKNOWN)), int(peer.group(2)) if peer else -1


def backend_of(profiling_name: str) -> str:
    """The recorder's name for the backend ("nccl", "gloo", "nccl2", "c10d"):
    what a profiling name holds before its colon."""
    head, colon, _ = profiling_name.partition(":")
    return head if colon else ""


def is_hooked(backend: str) -> bool:
    """Whether entries of this backend come from c10d's FlightRecorderHook
    (torch 2.14 on): every backend but those recording natively.  Its
    ``retired`` may mean only that the call was issued and returned (the
    post-hook, on backends that push no completion, and in 2.14 on all):
    only a completion says the collective finished."""
    return backend not in NATIVE_BACKENDS


def _count(sizes: object) -> int:
    total = 0
    if isinstance(sizes, list):
        for shape in sizes:
            if isinstance(shape, list):
                total += math.prod(int(x) for x in shape)
    return total


def _group(e: dict[str, Any]) -> str:
    g = e.get("process_group")
    return str(g[0]) if g is not None else str(e["pg_id"])


def _seq(e: dict[str, Any], p2p: bool) -> int:
    if "collective_seq_id" not in e:  # 1.x: one sequence
        return int(e["seq_id"])
    return int(e["p2p_seq_id"] if p2p else e["collective_seq_id"])


def _entry(
    path: str, i: int, e: object, names: dict[tuple[str, str], int], shapes: dict[str, int]
) -> tuple[object, ...]:
    if not isinstance(e, dict):
        raise DumpFormatError(f"{path}: entries[{i}]: expected a dict")
    try:
        name = str(e["profiling_name"])
        op, peer = _op_and_peer(name)
        backend = backend_of(name)
        is_p2p = bool(e["is_p2p"]) if "is_p2p" in e else bool(IS_P2P_OP[op])
        sizes, dtypes = _own_side(op, e)
        completed = int(e.get("time_discovered_completed_ns") or 0)
        state = STATES.get(str(e.get("state")), State.SCHEDULED)
        retired = bool(e.get("retired"))
        ended = state == State.COMPLETED or completed > 0
        if is_hooked(backend) and retired and not ended:
            state = State.ENQUEUED  # retired at issue: the call returned, no more
        seq = _seq(e, is_p2p)
        return (
            int(e.get("pg_id", -1)),
            names.setdefault((_group(e), backend), len(names)),
            seq,
            int(e.get("op_id", seq)),
            is_p2p,
            op,
            _count(sizes),
            _shape_code(shapes, repr(sizes)),
            DTYPES.get(str(dtypes[0]), UNKNOWN_DTYPE) if dtypes else UNKNOWN_DTYPE,
            state,
            ended or (retired and not is_hooked(backend)),
            int(e.get("time_created_ns") or 0),
            completed,
            peer,
        )
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise DumpFormatError(f"{path}: entries[{i}]: missing or malformed field {exc}") from None


def _own_side(op: int, e: dict[str, Any]) -> tuple[object, list[Any]]:
    """The sizes and dtypes of the side carrying this rank's own data."""
    first, second = ("output", "input") if OUTPUT_SIDE[op] else ("input", "output")
    sizes = e.get(f"{first}_sizes")
    dtypes = e.get(f"{first}_dtypes") or e.get(f"{second}_dtypes") or []
    return sizes, dtypes


def _shape_code(shapes: dict[str, int], text: str) -> int:
    """The code of a shape's text (``repr`` of its sizes), 0 for none."""
    return 0 if text == "None" else shapes.setdefault(text, len(shapes))


# the fields of a 2.2+ entry that a call is made of, fetched in one pass
_FIELDS = (
    "is_p2p",
    "pg_id",
    "process_group",
    "collective_seq_id",
    "p2p_seq_id",
    "op_id",
    "profiling_name",
    "input_sizes",
    "output_sizes",
    "input_dtypes",
    "output_dtypes",
    "state",
    "retired",
    "time_created_ns",
    "time_discovered_completed_ns",
)
_GET_FIELDS = operator.itemgetter(*_FIELDS)


def _entries_by_column(
    entries: list[Any], names: dict[tuple[str, str], int], shapes: dict[str, int]
) -> np.ndarray | None:
    """The entries as FR_ENTRY rows: every field of every entry fetched in
    one pass of C code (``itemgetter``), turned into columns (``zip``), and
    strings coded through a small table of the distinct values.  None if any
    entry is malformed, or of a field set other than 2.2+'s: ``_entry`` then
    reads each (and says which)."""
    out = np.zeros(len(entries), dtype=FR_ENTRY)
    if not entries:
        return out
    try:
        if set(map(type, entries)) != {dict}:
            return None
        col = dict(zip(_FIELDS, zip(*map(_GET_FIELDS, entries), strict=True), strict=True))
        p2p = np.fromiter(map(bool, col["is_p2p"]), dtype=bool, count=len(entries))
        out["is_p2p"] = p2p
        out["pg_id"] = col["pg_id"]
        cseq = np.array(col["collective_seq_id"], dtype=np.int64)
        out["seq"] = np.where(p2p, col["p2p_seq_id"], cseq) if p2p.any() else cseq
        out["op_id"] = col["op_id"]
        names_of_ops, which = _distinct(col["profiling_name"])
        op_peer = np.array([_op_and_peer(str(n)) for n in names_of_ops], dtype=np.int64)
        op = op_peer[which, 0]
        out["op"], out["peer"] = op, op_peer[which, 1]
        backends = [backend_of(str(n)) for n in names_of_ops]
        groups, group_of = _distinct([g[0] for g in col["process_group"]])
        pairs, pair_of = _distinct((group_of * len(backends) + which).tolist())
        codes = [
            names.setdefault(
                (str(groups[k // len(backends)]), backends[k % len(backends)]), len(names)
            )
            for k in pairs
        ]
        out["pg"] = np.array(codes, dtype=np.int64)[pair_of]
        _sizes_by_column(col, OUTPUT_SIDE[op], out, shapes)
        hooked = np.array([is_hooked(b) for b in backends], dtype=bool)[which]
        _times_by_column(col, out, hooked)
    except (AttributeError, KeyError, TypeError, ValueError, IndexError, OverflowError):
        names.clear()
        shapes.clear()
        shapes[""] = 0
        return None
    return out


def _sizes_by_column(
    col: dict[str, tuple[Any, ...]],
    output_side: np.ndarray,
    out: np.ndarray,
    shapes: dict[str, int],
) -> None:
    """count, shape and datatype of each entry's own side; counts and shape
    texts computed once per distinct shape (a job repeats a few)."""
    sizes = list(col["input_sizes"])
    dtypes = list(col["input_dtypes"])
    for i in np.flatnonzero(output_side).tolist():  # scatter, reduce_scatter, recv
        sizes[i] = col["output_sizes"][i]
        dtypes[i] = col["output_dtypes"][i] or dtypes[i]
    firsts = [d[0] if d else None for d in dtypes]
    if None in firsts:  # no dtype on that side: the first of either
        either = [i or o for i, o in zip(col["input_dtypes"], col["output_dtypes"], strict=True)]
        firsts = [f if f is not None else _first(e) for f, e in zip(firsts, either, strict=True)]
    # the shapes keyed by marshal's bytes, a seventh of repr's time (version 2: no
    # back-references, so a value's bytes do not depend on which lists the
    # pickle shared; equal bytes, equal repr), repr of the distinct ones only
    _, which = _distinct(list(map(marshal.dumps, sizes, repeat(2))))
    first = np.unique(which, return_index=True)[1].tolist()
    out["count"] = np.array([_count_fast(sizes[i]) for i in first], dtype=np.uint64)[which]
    texts = [repr(sizes[i]) for i in first]
    out["shape"] = np.array([_shape_code(shapes, t) for t in texts], dtype=np.int64)[which]
    out["datatype"] = _coded(
        firsts, lambda d: DTYPES.get(str(d), UNKNOWN_DTYPE) if d else UNKNOWN_DTYPE
    )


def _first(values: list[Any]) -> Any:
    return values[0] if values else None


def _times_by_column(col: dict[str, tuple[Any, ...]], out: np.ndarray, hooked: np.ndarray) -> None:
    n = len(out)
    out["state"] = _coded(col["state"], lambda v: STATES.get(str(v), State.SCHEDULED))
    out["created"] = [t or 0 for t in col["time_created_ns"]]
    out["completed"] = [t or 0 for t in col["time_discovered_completed_ns"]]
    retired = np.fromiter(map(bool, col["retired"]), dtype=bool, count=n)
    ended = (out["state"] == State.COMPLETED) | (out["completed"] > 0)
    out["ended"] = ended | (retired & ~hooked)
    issued = retired & hooked & ~ended  # retired at issue: the call returned, no more
    out["state"][issued] = State.ENQUEUED


def _coded(values: Sequence[Any], code: Callable[[Any], int]) -> np.ndarray:
    """``[code(v) for v in values]`` with ``code`` called once per distinct
    value (values repeat: a few groups, ops, dtypes and states)."""
    distinct, which = _distinct(values)
    out: np.ndarray = np.array([code(v) for v in distinct], dtype=np.int64)[which]
    return out


def _distinct(values: Sequence[Any]) -> tuple[list[Any], np.ndarray]:
    """The distinct values in order of first appearance, and the index of
    each value among them."""
    distinct = dict.fromkeys(values)
    index = {v: i for i, v in enumerate(distinct)}
    return list(distinct), np.array(list(map(index.__getitem__, values)), dtype=np.int64)


def _count_fast(sizes: object) -> int:
    """``_count`` for the usual shape, a list of lists of ints."""
    if isinstance(sizes, list):
        return sum(map(math.prod, sizes))
    return 0


def _fold_coalesced(arr: np.ndarray, shapes: list[str]) -> tuple[np.ndarray, list[str]]:
    """Entries of one coalesced group (a rank's collectives sharing a group
    and a collective_seq_id, closed by a "coalesced" marker) as one call:
    its op the ops' own when they agree, its count their sum, its shape
    their shapes in order; it has ended when its marker (else every op) has.
    Markers of point-to-point groups are dropped."""
    coll = ~arr["is_p2p"]
    key = arr["pg"].astype(np.int64) * (1 << 40) + arr["seq"]
    marker = arr["op"] == COALESCED
    ordered = np.sort(key[coll])
    if not marker.any() and not (ordered[1:] == ordered[:-1]).any():
        return arr, shapes
    keep = np.ones(len(arr), dtype=bool)
    keep[marker & ~coll] = False
    idx = np.flatnonzero(coll)
    order = idx[np.argsort(key[idx], kind="stable")]
    bounds = np.flatnonzero(np.diff(key[order])) + 1
    for run in np.split(order, bounds):
        if len(run) > 1:
            _fold(arr, run, shapes)
            keep[run[1:]] = False
    arr = arr[keep]
    arr["op"][arr["op"] == COALESCED] = Op.UNKNOWN
    return arr, shapes


def _fold(arr: np.ndarray, run: np.ndarray, shapes: list[str]) -> None:
    """Fold the entries ``run`` (record order) into the first of them."""
    rows = arr[run]
    ops = rows[rows["op"] != COALESCED]
    mark = rows[rows["op"] == COALESCED]
    first = int(run[0])
    kinds = set(ops["op"].tolist())
    arr["op"][first] = kinds.pop() if len(kinds) == 1 else Op.UNKNOWN
    arr["count"][first] = int(ops["count"].sum())
    text = "+".join(shapes[int(s)] for s in ops["shape"].tolist())
    if text not in shapes:
        shapes.append(text)
    arr["shape"][first] = shapes.index(text)
    if len(ops):
        arr["datatype"][first] = ops["datatype"][0]
    ends = mark if len(mark) else rows
    arr["ended"][first] = bool(ends["ended"].all())
    arr["state"][first] = int(ends["state"].min())
    arr["completed"][first] = int(ends["completed"].max()) if arr["ended"][first] else 0
    arr["created"][first] = int(rows["created"].min())

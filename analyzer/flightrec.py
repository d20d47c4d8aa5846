"""PyTorch Flight Recorder dumps (format versions 2.x), pickle or JSON.

A dump is data, never code: pickles are read with an unpickler whose
``find_class`` refuses every global, so only dicts, lists, tuples, strings,
bytes, numbers, booleans and None can be built.  One dump per rank; the rank
comes from a ``rank`` field when present, else from the file name
(``..._<rank>``, as torch names them).  All dumps of one folder form one
incident.

Mapping: a process group (``process_group`` name, members from ``pg_config``)
is a communicator; ``collective_seq_id`` (``p2p_seq_id`` for p2p) is seq;
``profiling_name`` ("nccl:all_reduce") gives the op; ``input_sizes`` and
``input_dtypes`` give count and datatype; ``time_created_ns`` and
``time_discovered_completed_ns`` give entry and completion (wall clock of the
rank's host, compared only within one rank).  ``pg_status`` progress counters
are used for groups that run collectives only (torch counts p2p ops in them
too), mapped to names through the ``pg_id`` that member ranks share.

Known limits: dumps that keep only active entries (as these do) say nothing
of completed work except through ``pg_status``; ``all_to_all`` counts differ
by design and are not compared.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import gc
import hashlib
import io
import json
import math
import pickle
import re
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import repeat
from operator import itemgetter
from pathlib import Path
from typing import Any

import numpy as np
from stallwatch.dumpers.errors import DumpFormatError, DumpVersionError
from stallwatch.dumpers.schema import DataType, Op, State

from .columns import Columns
from .model import (
    CALL_DTYPE,
    SCHED_DTYPE,
    TCP_RETRANS_DTYPE,
    Calls,
    Comm,
    Incident,
    Proc,
    SourceKind,
)

OPS: dict[str, Op] = {
    "all_reduce": Op.ALL_REDUCE,
    "allreduce": Op.ALL_REDUCE,
    "allreduce_coalesced": Op.ALL_REDUCE,
    "all_gather": Op.ALL_GATHER,
    "allgather": Op.ALL_GATHER,
    "_all_gather_base": Op.ALL_GATHER,
    "all_gather_into_tensor_coalesced": Op.ALL_GATHER,
    "allgather_coalesced": Op.ALL_GATHER,
    "reduce_scatter": Op.REDUCE_SCATTER,
    "_reduce_scatter_base": Op.REDUCE_SCATTER,
    "reduce_scatter_tensor_coalesced": Op.REDUCE_SCATTER,
    "broadcast": Op.BROADCAST,
    "reduce": Op.REDUCE,
    "all_to_all": Op.ALL_TO_ALL,
    "alltoall": Op.ALL_TO_ALL,
    "alltoall_base": Op.ALL_TO_ALL,
    "gather": Op.GATHER,
    "scatter": Op.SCATTER,
    "send": Op.SEND,
    "recv": Op.RECV,
}
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
    "Float8_e4m3fn": DataType.FLOAT8E4M3,
    "Float8_e5m2": DataType.FLOAT8E5M2,
}
STATES = {"scheduled": State.SCHEDULED, "started": State.STARTED, "completed": State.COMPLETED}
UNKNOWN_DTYPE = 255
_RANK_IN_NAME = re.compile(r"(\d+)(?:\.json|\.pkl|\.pickle)?$")
_PEER = re.compile(r"(\d+)\s*(?:->|<-)\s*(\d+)")


class _DataOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused global {module}.{name}: a dump is data, not code")


FR_ENTRY = np.dtype(
    [
        ("pg_id", "<i8"),
        ("pg", "<i4"),  # index into FrDump.pg_names
        ("seq", "<i8"),
        ("is_p2p", "?"),
        ("op", "u1"),
        ("count", "<u8"),
        ("datatype", "u1"),
        ("state", "u1"),
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
    pg_ranks: dict[str, tuple[int, ...]]  # group name -> world ranks
    pg_desc: dict[str, str]
    pg_status: dict[int, tuple[int, int]]  # pg_id -> (last enqueued, last completed)
    pg_names: tuple[str, ...]  # the groups its entries name
    entries: np.ndarray  # FR_ENTRY


def looks_like_flightrec(head: bytes) -> bool:
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return True  # a pickle (msgpack's 0x80 is an empty map: never a dump)
    return head.lstrip()[:1] == b"{"


def _parse(path: str, data: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(data) if data.lstrip()[:1] == b"{" else _DataOnly(io.BytesIO(data)).load()
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
    if not version.startswith("2."):
        raise DumpVersionError(f"{path}: Flight Recorder version {version}; this reader knows 2.x")
    rank = _rank(path, doc)
    ranks, desc = _pg_config(path, doc.get("pg_config", {}))
    entries = doc.get("entries", [])
    if not isinstance(entries, list):
        raise DumpFormatError(f"{path}: field 'entries': expected a list")
    names: dict[str, int] = {}
    arr = _entries_by_column(entries, names)
    if arr is None:  # something is malformed: entry by entry, to say which and why
        names = {}
        rows = [_entry(path, i, e, names) for i, e in enumerate(entries)]
        try:
            arr = np.array(rows, dtype=FR_ENTRY) if rows else np.zeros(0, dtype=FR_ENTRY)
        except (OverflowError, ValueError, TypeError) as exc:
            raise DumpFormatError(f"{path}: entries: a value out of range: {exc}") from None
    status = _pg_status(path, doc.get("pg_status", {}))
    return FrDump(path, rank, version, ranks, desc, status, tuple(names), arr)


def _rank(path: str, doc: dict[str, Any]) -> int:
    if isinstance(doc.get("rank"), int):
        return int(doc["rank"])
    m = _RANK_IN_NAME.search(Path(path).name)
    if m is None:
        raise DumpFormatError(f"{path}: no 'rank' field and no rank at the end of the file name")
    return int(m.group(1))


def _pg_config(path: str, cfg: object) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    if not isinstance(cfg, dict):
        raise DumpFormatError(f"{path}: field 'pg_config': expected a dict")
    ranks: dict[str, tuple[int, ...]] = {}
    desc: dict[str, str] = {}
    for name, c in cfg.items():
        try:
            r = c["ranks"]
            ranks[str(name)] = _ranks_text(r) if isinstance(r, str) else tuple(int(x) for x in r)
            desc[str(name)] = str(c.get("desc", ""))
        except (KeyError, TypeError, ValueError, SyntaxError, AttributeError):
            raise DumpFormatError(
                f"{path}: pg_config[{name!r}]: expected 'ranks' as a list"
            ) from None
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


def _count(sizes: object) -> int:
    total = 0
    if isinstance(sizes, list):
        for shape in sizes:
            if isinstance(shape, list):
                total += math.prod(int(x) for x in shape)
    return total


@functools.lru_cache(maxsize=4096)
def _op_and_peer(name: str) -> tuple[int, int]:
    short = name.split(":", 1)[-1].split(" ", 1)[0]
    peer = _PEER.search(name)
    return int(OPS.get(short, Op.UNKNOWN)), int(peer.group(2)) if peer else -1


def _entry(path: str, i: int, e: object, names: dict[str, int]) -> tuple[object, ...]:
    if not isinstance(e, dict):
        raise DumpFormatError(f"{path}: entries[{i}]: expected a dict")
    try:
        is_p2p = bool(e.get("is_p2p", False))
        op, peer = _op_and_peer(str(e["profiling_name"]))
        dtypes = e.get("input_dtypes") or e.get("output_dtypes")
        pg = names.setdefault(str(e["process_group"][0]), len(names))
        return (
            int(e.get("pg_id", -1)),
            pg,
            int(e["p2p_seq_id"] if is_p2p else e["collective_seq_id"]),
            is_p2p,
            op,
            _count(e.get("input_sizes")),
            DTYPES.get(str(dtypes[0]), UNKNOWN_DTYPE) if dtypes else UNKNOWN_DTYPE,
            STATES.get(str(e.get("state")), State.SCHEDULED),
            int(e.get("time_created_ns") or 0),
            int(e.get("time_discovered_completed_ns") or 0),
            peer,
        )
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise DumpFormatError(f"{path}: entries[{i}]: missing or malformed field {exc}") from None


def _entries_by_column(entries: list[Any], names: dict[str, int]) -> np.ndarray | None:
    """The entries as FR_ENTRY rows, one field of every entry at a time: a
    pass of C code per field (``map``), strings coded through a small table
    of the distinct values.  None if any entry is malformed: ``_entry`` then
    finds which."""
    out = np.zeros(len(entries), dtype=FR_ENTRY)
    if not entries:
        return out
    try:
        if not all(type(e) is dict for e in entries):
            return None
        p2p = np.array(list(map(bool, map(dict.get, entries, repeat("is_p2p")))), dtype=bool)
        out["is_p2p"] = p2p
        out["pg_id"] = list(map(dict.get, entries, repeat("pg_id"), repeat(-1)))
        groups = [g[0] for g in map(itemgetter("process_group"), entries)]
        out["pg"] = _coded(groups, lambda g: names.setdefault(str(g), len(names)))
        if p2p.any():
            out["seq"] = [
                e["p2p_seq_id"] if p else e["collective_seq_id"]
                for e, p in zip(entries, p2p.tolist(), strict=True)
            ]
        else:
            out["seq"] = list(map(itemgetter("collective_seq_id"), entries))
        names_of_ops, which = _distinct(list(map(itemgetter("profiling_name"), entries)))
        op_peer = np.array([_op_and_peer(str(n)) for n in names_of_ops], dtype=np.int64)
        out["op"], out["peer"] = op_peer[which, 0], op_peer[which, 1]
        out["count"] = list(map(_count_fast, map(dict.get, entries, repeat("input_sizes"))))
        firsts = [d[0] if d else None for d in map(dict.get, entries, repeat("input_dtypes"))]
        if None in firsts:  # no input: the output's
            firsts = [
                (e.get("input_dtypes") or e.get("output_dtypes") or (None,))[0] for e in entries
            ]
        out["datatype"] = _coded(
            firsts, lambda d: DTYPES.get(str(d), UNKNOWN_DTYPE) if d else UNKNOWN_DTYPE
        )
        states = list(map(dict.get, entries, repeat("state")))
        out["state"] = _coded(states, lambda v: STATES.get(str(v), State.SCHEDULED))
        out["created"] = [t or 0 for t in map(dict.get, entries, repeat("time_created_ns"))]
        out["completed"] = [
            t or 0 for t in map(dict.get, entries, repeat("time_discovered_completed_ns"))
        ]
    except (AttributeError, KeyError, TypeError, ValueError, IndexError, OverflowError):
        names.clear()
        return None
    return out


def _coded(values: list[Any], code: Callable[[Any], int]) -> np.ndarray:
    """``[code(v) for v in values]`` with ``code`` called once per distinct
    value (values repeat: a few groups, ops, dtypes and states)."""
    distinct, which = _distinct(values)
    out: np.ndarray = np.array([code(v) for v in distinct], dtype=np.int64)[which]
    return out


def _distinct(values: list[Any]) -> tuple[list[Any], np.ndarray]:
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


def _comm_hash(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"pg:{name}".encode(), digest_size=8).digest(), "little")


def incidents_from_flightrec(dumps: list[FrDump]) -> list[Incident]:
    groups: dict[str, list[FrDump]] = defaultdict(list)
    for d in dumps:
        groups[str(Path(d.path).parent)].append(d)
    return [
        _incident(k, sorted(v, key=lambda d: (d.rank, d.path))) for k, v in sorted(groups.items())
    ]


def _incident(folder: str, dumps: list[FrDump]) -> Incident:
    procs = tuple(Proc(Path(d.path).name, 0, d.rank, d.path, from_file=True) for d in dumps)
    by_rank = {d.rank: i for i, d in enumerate(dumps)}
    pg_ranks: dict[str, tuple[int, ...]] = {}
    for d in dumps:
        for k, v in d.pg_ranks.items():
            pg_ranks.setdefault(k, v)
        for n in d.pg_names:
            pg_ranks.setdefault(n, ())
    names = sorted(pg_ranks, key=lambda n: (_comm_hash(n), n))
    comms = tuple(
        Comm(
            _comm_hash(n),
            tuple(by_rank.get(r, -1) for r in pg_ranks[n]),
            label=n,
            desc=next((d.pg_desc[n] for d in dumps if d.pg_desc.get(n)), ""),
        )
        for n in names
    )
    index = {n: i for i, n in enumerate(names)}
    rows = np.concatenate(
        [_rows(p, d, pg_ranks, index) for p, d in enumerate(dumps)] or [np.zeros(0, CALL_DTYPE)]
    )
    return Incident(
        id=Path(folder).name,
        hosts=tuple(p.host for p in procs),
        host_now=tuple(None for _ in procs),
        procs=procs,
        comms=comms,
        calls=Calls(Columns.from_records(rows)),
        retransmits=np.zeros(0, dtype=TCP_RETRANS_DTYPE),
        sched=np.zeros(0, dtype=SCHED_DTYPE),
        sources=tuple(d.path for d in dumps),
        progress=_progress(dumps, pg_ranks, index),
        kind=SourceKind.FLIGHT_RECORDER,
        wall_ns=int(rows["ts"].max()) if len(rows) else None,  # the latest entry
    )


def _rows(
    p: int, d: FrDump, pg_ranks: dict[str, tuple[int, ...]], index: dict[str, int]
) -> np.ndarray:
    """One dump's entries as calls; entries of groups it is not a member of are dropped."""
    comm = np.array([index[n] for n in d.pg_names], dtype=np.int64)
    crank = np.array(
        [pg_ranks[n].index(d.rank) if d.rank in pg_ranks[n] else -1 for n in d.pg_names],
        dtype=np.int64,
    )
    e = d.entries
    if not len(e):
        return np.zeros(0, dtype=CALL_DTYPE)
    e = e[crank[e["pg"]] >= 0]
    out = np.zeros(len(e), dtype=CALL_DTYPE)
    out["comm"], out["crank"], out["proc"] = comm[e["pg"]], crank[e["pg"]], p
    out["seq"], out["ts"], out["end"] = e["seq"], e["created"], e["completed"]
    out["count"], out["root"], out["op"] = e["count"], e["peer"], e["op"]
    out["datatype"], out["state"] = e["datatype"], e["state"]
    return out


def _progress(
    dumps: list[FrDump], pg_ranks: dict[str, tuple[int, ...]], index: dict[str, int]
) -> tuple[tuple[int, int, int, int], ...]:
    """pg_status counters of collective-only groups, by the pg_id their members share."""
    named: dict[int, set[str]] = defaultdict(set)
    has_p2p: set[str] = set()
    for d in dumps:
        if not len(d.entries):
            continue
        e = d.entries
        key = e["pg"].astype(np.int64) * 2 + e["is_p2p"]  # (group, p2p): no structured sort
        for k in np.unique(key).tolist():
            pg, p2p = divmod(k, 2)
            for pg_id in np.unique(e["pg_id"][key == k]).tolist():
                named[int(pg_id)].add(d.pg_names[pg])
            if p2p:
                has_p2p.add(d.pg_names[pg])
    out = []
    for d in dumps:
        for pg_id, (enq, done) in d.pg_status.items():
            cands = [n for n in named.get(pg_id, ()) if d.rank in pg_ranks[n] and n not in has_p2p]
            if len(cands) == 1:
                n = cands[0]
                out.append((index[n], pg_ranks[n].index(d.rank), enq, done))
    return tuple(sorted(out))

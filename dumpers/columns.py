"""Columns every SQL table is built of (``dumpers.sqltables`` and
``dumpers.nettables`` alike): the host, times on the incident's clock,
NULL for unknown, counters, addresses, interned names.

Clock: a recording's CLOCK_MONOTONIC stamps are put on the incident's one
clock (ns since the epoch) with the realtime - monotonic pair that recording
sampled (``clock_offset``); ``dumpers.sqltables`` says why.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pyarrow as pa

from . import addresses
from .layout import UNKNOWN_U8
from .model import Recording
from .schema import RING_DTYPES, TcpState

Columns = dict[str, pa.Array]

FAMILY_CODES = np.full(1 << 16, -1, dtype=np.int8)  # AF_* -> index into FAMILY_NAMES
FAMILY_CODES[[2, 10]] = [0, 1]
FAMILY_NAMES = ("ipv4", "ipv6")


def enum_names(names: Callable[[int], str], size: int = 256) -> pa.Array:
    return pa.array([names(i) for i in range(size)], type=pa.string())


def lower_name(enum_type: type, prefix: str) -> Callable[[int], str]:
    def name(value: int) -> str:
        try:
            return str(enum_type(value).name.lower())
        except ValueError:
            return f"{prefix}_{value}"

    return name


def tcp_state_name(value: int) -> str:
    try:
        return TcpState(value).name
    except ValueError:
        return f"TCP_STATE_{value}"


def host_column(host: str, n: int) -> pa.DictionaryArray:
    return pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int8)), pa.array([host]))


def i64(values: np.ndarray) -> pa.Array:
    return pa.array(values.astype(np.int64, copy=False))


def pids(values: np.ndarray) -> pa.Array:
    """pid 0 is no process's (the idle task): an input that names no pid
    (Flight Recorder's) says 0, NULL here."""
    values = values.astype(np.int64, copy=False)
    return maybe_null(values, values == 0)


def by_pid(pids: np.ndarray, values: dict[int, int]) -> pa.Array:
    """Per row, ``values`` of its pid (NULL where it has none), by a binary
    search among the few pids that have one."""
    if not values:
        return pa.nulls(len(pids), pa.int32())
    keys = np.array(sorted(values), dtype=np.int64)
    found = np.array([values[k] for k in keys.tolist()], dtype=np.int32)
    pids = pids.astype(np.int64, copy=False)
    pos = np.minimum(np.searchsorted(keys, pids), len(keys) - 1)
    return maybe_null(found[pos], keys[pos] != pids)


def clock_offset(rec: Recording) -> int | None:
    """What turns the recording's monotonic stamps into the incident's clock
    (ns since the epoch): realtime - monotonic of the pair it sampled; None
    where it has no pair (realtime 0)."""
    if rec.clock.realtime_ns <= 0:
        return None
    return rec.clock.realtime_ns - rec.clock.monotonic_ns


def on_clock(rec: Recording, stamps: np.ndarray, unknown: np.ndarray | None = None) -> pa.Array:
    """Monotonic stamps of the recording on the incident's clock (int64 ns
    since the epoch): NULL where ``unknown`` (default: a stamp of 0, the
    rings' "not observed") and everywhere when the recording has no clock
    pair."""
    stamps = stamps.astype(np.int64, copy=False)
    offset = clock_offset(rec)
    if offset is None:
        return pa.nulls(len(stamps), pa.int64())
    return maybe_null(stamps + offset, stamps == 0 if unknown is None else unknown)


def on_clock_list(rec: Recording, stamps: Sequence[int]) -> pa.Array:
    """:func:`on_clock` of a table's stamps (0: unknown)."""
    return on_clock(rec, np.array(stamps, dtype=np.int64))


def wall(times: pa.Array) -> pa.Array:
    """Times on the incident's clock as DuckDB ``TIMESTAMP_NS``."""
    return times.cast(pa.timestamp("ns"))


def header(rec: Recording, rows: np.ndarray) -> tuple[np.ndarray, Columns]:
    """The columns every event table starts with; and the rows' monotonic
    stamps, from which durations are taken."""
    ts = rows["ts_ns"].astype(np.int64)
    times = on_clock(rec, ts, np.zeros(len(ts), dtype=bool))
    return ts, {
        "host": host_column(rec.host, len(rows)),
        "timestamp_ns": times,
        "host_timestamp_ns": pa.array(ts),
        "wall_time": wall(times),
    }


def ring_rows(rec: Recording, name: str) -> np.ndarray:
    ring = rec.rings.get(name)
    if ring is None:
        return np.zeros(0, dtype=RING_DTYPES[name])
    return ring.rows


def maybe_null(values: np.ndarray, null: np.ndarray) -> pa.Array:
    return pa.array(values, mask=null) if null.any() else pa.array(values)


def address_keys(family: np.ndarray, raw: np.ndarray) -> np.ndarray:
    """One 64-bit key per (family, 16 address bytes), by multiply-xor mixing:
    sorting integers is ~100x faster than sorting 18-byte records."""
    words = np.ascontiguousarray(raw).view("<u8").reshape(-1, 2)
    with np.errstate(over="ignore"):
        key = words[:, 0] * np.uint64(0x9E3779B97F4A7C15)
        key ^= (words[:, 1] + np.uint64(0xBF58476D1CE4E5B9)) * np.uint64(0x94D049BB133111EB)
        key ^= family.astype(np.uint64) << np.uint64(48)
    return key


def address_column(family: np.ndarray, raw: np.ndarray) -> pa.DictionaryArray:
    """Addresses as text, interned: format each distinct (family, bytes) once."""
    if not len(raw):
        return pa.DictionaryArray.from_arrays(pa.array([], pa.int32()), pa.array([], pa.string()))
    _, first, codes = np.unique(address_keys(family, raw), return_index=True, return_inverse=True)
    codes = codes.reshape(-1)
    if not (
        np.array_equal(raw[first][codes], raw) and np.array_equal(family[first][codes], family)
    ):
        # two addresses mixed to one key (never seen): sort the bytes themselves
        keys = np.concatenate([family.astype("<u2").view(np.uint8).reshape(-1, 2), raw], axis=1)
        _, first, codes = np.unique(keys, axis=0, return_index=True, return_inverse=True)
        codes = codes.reshape(-1)
    names = [addresses.format_address(int(family[i]), bytes(raw[i])) for i in first]
    return pa.DictionaryArray.from_arrays(
        pa.array(codes.astype(np.int32)), pa.array(names, pa.string())
    )


def families(family: np.ndarray) -> pa.DictionaryArray:
    codes = FAMILY_CODES[family]
    indices = pa.array(codes, mask=codes < 0)
    return pa.DictionaryArray.from_arrays(indices, pa.array(FAMILY_NAMES, pa.string()))


def flag(values: np.ndarray) -> pa.Array:
    """A u8 flag as a boolean, NULL where unknown."""
    return pa.array(values == 1, mask=values == UNKNOWN_U8)


def counter(values: np.ndarray, unknown: int) -> pa.Array:
    """A counter as int64, NULL where unknown (past int64: never a real count)."""
    values = values.astype(np.uint64, copy=False)
    null = (values == np.uint64(unknown)) | (values > np.uint64(2**63 - 1))
    return maybe_null(values.astype(np.int64), null)


def hex_ids(values: np.ndarray) -> pa.DictionaryArray:
    """64-bit ids as ``0x%016x`` text, interned (a few distinct per table);
    0 (no id) is NULL."""
    values = values.astype(np.uint64, copy=False)
    encoded = pa.array(values, mask=values == 0).dictionary_encode()
    names = [f"0x{v:016x}" for v in encoded.dictionary.to_pylist()]
    return pa.DictionaryArray.from_arrays(encoded.indices, pa.array(names, pa.string()))

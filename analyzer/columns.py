"""A table of equal-length columns, indexed like a numpy structured array.

The analyzer's stages read a few fields of tens of millions of calls at a
time.  Stored record by record, every field read sweeps every record (a
48-byte stride to read 8 bytes); stored column by column, it reads that field
alone.  ``Columns`` keeps the structured array's way of indexing, so stages
read ``t["ts"]`` (a column), ``t[mask]``, ``t[index]`` or ``t[a:b]`` (a
table of those rows: slices are views, the others copies).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np

from .parallel import in_parallel


class Columns:
    __slots__ = ("_cols", "_n")

    def __init__(self, columns: Mapping[str, np.ndarray]) -> None:
        cols = dict(columns)
        lengths = {len(c) for c in cols.values()}
        if len(lengths) > 1:
            raise ValueError(f"columns of unequal length: {sorted(lengths)}")
        self._cols = cols
        self._n = lengths.pop() if lengths else 0

    @classmethod
    def empty(cls, dtype: np.dtype, n: int = 0) -> Columns:
        """Uninitialised columns of ``dtype``'s fields."""
        return cls({name: np.empty(n, dtype=dtype[name]) for name in dtype.names or ()})

    @classmethod
    def zeros(cls, dtype: np.dtype, n: int = 0) -> Columns:
        return cls({name: np.zeros(n, dtype=dtype[name]) for name in dtype.names or ()})

    @classmethod
    def from_records(cls, records: np.ndarray) -> Columns:
        names = records.dtype.names or ()
        return cls({name: np.ascontiguousarray(records[name]) for name in names})

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._cols)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self._cols.values())

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[str]:
        return iter(self._cols)

    @overload
    def __getitem__(self, key: str) -> np.ndarray: ...

    @overload
    def __getitem__(self, key: slice | np.ndarray) -> Columns: ...

    def __getitem__(self, key: str | slice | np.ndarray) -> np.ndarray | Columns:
        if isinstance(key, str):
            return self._cols[key]
        return Columns({name: c[key] for name, c in self._cols.items()})

    def __setitem__(self, name: str, values: np.ndarray) -> None:
        if len(values) != self._n:
            raise ValueError(f"column {name!r} has {len(values)} rows, the table {self._n}")
        self._cols[name] = values

    def select(self, names: Sequence[str]) -> Columns:
        """A table of these columns only (no copy)."""
        return Columns({name: self._cols[name] for name in names})

    def pop(self, name: str) -> np.ndarray:
        """Take a column out of the table (the table no longer holds it)."""
        col = self._cols.pop(name)
        if not self._cols:
            self._n = 0
        return col

    def record(self, i: int) -> dict[str, int]:
        """Row ``i`` as Python integers."""
        return {name: int(c[i]) for name, c in self._cols.items()}

    def take(self, index: np.ndarray) -> Columns:
        return Columns({name: np.take(c, index) for name, c in self._cols.items()})

    def permute(self, order: np.ndarray) -> None:
        """Reorder rows in place, column by column on a few threads (numpy
        lets go of the GIL while it gathers): at most one copy per thread
        exists beside the table."""
        names = list(self._cols)

        def one(name: str) -> None:
            self._cols[name] = np.take(self._cols[name], order)

        in_parallel(one, names)

    def to_records(self, dtype: np.dtype) -> np.ndarray:
        out = np.empty(self._n, dtype=dtype)
        for name in dtype.names or ():
            out[name] = self._cols[name]
        return out


SHARED_FOLDER = "/dev/shm"  # memory files: a table handed to another process


@dataclass(frozen=True, slots=True)
class Handed:
    """A table handed to another process in a file of shared memory
    (``hand_over``): its path, and each column's name, dtype and place."""

    path: str
    rows: int
    layout: tuple[tuple[str, str, int], ...]  # (name, dtype, offset)

    def take(self) -> Columns:
        """The table, each column a view of its own mapping of the file's
        memory, then the file removed: a column's memory goes with its last
        view (a table let go column by column never holds all of itself
        twice)."""
        try:
            with open(self.path, "r+b") as f:
                cols = {
                    name: _mapped(f.fileno(), np.dtype(dt), self.rows, at)
                    for name, dt, at in self.layout
                }
        finally:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        return Columns(cols)


def _mapped(fd: int, dtype: np.dtype, rows: int, at: int) -> np.ndarray:
    size = rows * dtype.itemsize
    if not size:
        return np.zeros(0, dtype=dtype)
    return np.frombuffer(mmap.mmap(fd, size, offset=at), dtype, rows)


def hand_over(table: Columns) -> Columns | Handed:
    """``table`` as a file of shared memory another process takes (a
    table of many MB pickled between processes costs a copy on each side
    and both their CPU); the table itself where there is no such folder."""
    if not os.path.isdir(SHARED_FOLDER):
        return table
    layout, at = [], 0
    for name in table:  # each column at a page of its own: mapped alone
        col = table[name]
        layout.append((name, col.dtype.str, at))
        at += -(-col.nbytes // mmap.ALLOCATIONGRANULARITY) * mmap.ALLOCATIONGRANULARITY
    fd, path = tempfile.mkstemp(prefix=f"stallwatch-{os.getpid()}-", dir=SHARED_FOLDER)
    try:
        os.ftruncate(fd, at)
        if at:
            with mmap.mmap(fd, at) as mapped:
                for name, _, start in layout:
                    col = table[name]
                    place = np.frombuffer(mapped, col.dtype, len(col), start)
                    place[:] = col
                    del place  # the mapping closes with no view of it left
    except OSError:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        return table
    os.close(fd)
    return Handed(path, len(table), tuple(layout))

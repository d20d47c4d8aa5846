"""Rings that BPF programs write directly and numpy reads without a drain.

A ring is a structured array of a power-of-two number of slots plus a head
counter (positions claimed so far).  The writer of position ``p`` (0-based)
fills slot ``p & (slots - 1)`` and stores ``pos = p + 1`` last.  A copy
reads nothing per event in Python: it copies the array, reads the head after
the copy (``H``), and keeps the rows whose ``pos`` lies in ``(H - slots, H]``
and matches their slot.  A row still being written carries the older ``pos``
of its slot, which is out of that window, so torn rows are never shown; they
appear in a later copy.  Rows older than ``H - slots`` were overwritten
and are counted.

``RingWriter`` does in Python what ``bpf/common.h`` does in the kernel; the
replay source and the unit tests use it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from stallwatch.dumpers.errors import UsageError
from stallwatch.dumpers.model import Ring

MIN_RING_SLOTS = 16


def check_ring_size(slots: int) -> int:
    """``--ring-size``: the NCCL ring's slots, a power of two (the BPF
    programs index slots with a mask), at least ``MIN_RING_SLOTS``."""
    if slots < MIN_RING_SLOTS or slots & (slots - 1):
        raise UsageError(f"--ring-size: expected a power of two >= {MIN_RING_SLOTS}, got {slots}")
    return slots


@dataclass(frozen=True, slots=True)
class RingBuffer:
    """A view of one ring: its slots and a way to read its head."""

    name: str
    slots: np.ndarray  # structured array, len is a power of two
    read_head: Callable[[], int]
    read_lost: Callable[[], int] = lambda: 0

    def __post_init__(self) -> None:
        n = len(self.slots)
        if n == 0 or n & (n - 1):
            raise ValueError(f"ring {self.name}: slot count must be a power of two, got {n}")

    @property
    def capacity(self) -> int:
        return len(self.slots)

    def rows_since(self, after: int) -> tuple[np.ndarray, int]:
        """The complete rows after position ``after`` (oldest first) and the
        head: only those slots are copied, not the ring."""
        head = self.read_head()
        n = min(head - after, self.capacity)
        if n <= 0:
            return self.slots[:0].copy(), head
        want = np.arange(head - n + 1, head + 1, dtype=np.int64)
        rows = self.slots[(want - 1) & (self.capacity - 1)]  # a copy
        rows = rows[rows["pos"].astype(np.int64) == want]
        return rows, head

    def copy(self, keep: Callable[[np.ndarray], np.ndarray] | None = None) -> Ring:
        """Complete rows, oldest first; ``keep`` filters them (a boolean mask)."""
        copy = self.slots.copy()
        head = self.read_head()
        rows = complete_rows(copy, head)
        if keep is not None and len(rows):
            rows = rows[keep(rows)]
        return Ring(rows=rows, overwritten=max(0, head - self.capacity), lost=self.read_lost())


def complete_rows(copy: np.ndarray, head: int) -> np.ndarray:
    """The rows of a copied ring that were complete when ``head`` was read
    (after the copy), in position order."""
    n = len(copy)
    pos = copy["pos"].astype(np.int64)
    low = max(0, head - n)
    slot = np.arange(n, dtype=np.int64)
    valid = (pos > low) & (pos <= head) & (((pos - 1) & (n - 1)) == slot)
    rows = copy[valid]
    ordered: np.ndarray = rows[np.argsort(rows["pos"], kind="stable")]
    return ordered


class RingWriter:
    """A ring in process memory, written the way the BPF programs write theirs."""

    def __init__(self, name: str, dtype: np.dtype, slots: int) -> None:
        self.head = 0
        self.lost = 0
        self.buffer = RingBuffer(
            name, np.zeros(slots, dtype=dtype), lambda: self.head, lambda: self.lost
        )

    def append(self, rows: np.ndarray) -> None:
        """Append a batch in order, stamping positions (O(1) per batch in numpy)."""
        n = self.buffer.capacity
        count = len(rows)
        if count == 0:
            return
        positions = np.arange(self.head + 1, self.head + count + 1, dtype=np.uint64)
        # Only the last `n` rows of a batch longer than the ring survive.
        if count > n:
            rows, positions = rows[-n:], positions[-n:]
        stamped = rows.copy()
        stamped["pos"] = positions
        self.buffer.slots[(positions - 1) % n] = stamped
        self.head += count

"""Ring protocol (recorder.rings): ordered snapshots, wrap-around, torn rows."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stallwatch.dumpers.schema import NCCL_EVENT
from stallwatch.recorder.rings import RingBuffer, RingWriter, complete_rows


def _rows(start: int, n: int) -> np.ndarray:
    rows = np.zeros(n, dtype=NCCL_EVENT)
    rows["seq"] = np.arange(start, start + n)
    return rows


@settings(max_examples=60, deadline=None)
@given(
    slots_log2=st.integers(min_value=2, max_value=7),
    batches=st.lists(st.integers(min_value=0, max_value=300), max_size=12),
)
def test_snapshot_keeps_the_newest_rows_in_order_and_counts_the_rest(
    slots_log2: int, batches: list[int]
) -> None:
    slots = 1 << slots_log2
    writer = RingWriter("nccl", NCCL_EVENT, slots)
    total = 0
    for n in batches:
        writer.append(_rows(total, n))
        total += n
    ring = writer.buffer.copy()
    kept = min(total, slots)
    assert len(ring.rows) == kept
    assert ring.overwritten == total - kept
    assert list(ring.rows["seq"]) == list(range(total - kept, total))
    assert list(ring.rows["pos"]) == list(range(total - kept + 1, total + 1))


def test_a_row_being_written_is_not_shown() -> None:
    writer = RingWriter("nccl", NCCL_EVENT, 8)
    writer.append(_rows(0, 10))  # positions 1..10: slot 2 holds position 3
    copy = writer.buffer.slots.copy()
    assert copy[2]["pos"] == 3
    # A writer claimed position 11 (slot 2) and has not published it yet:
    # the head says 11, the slot still holds position 3, out of the window.
    rows = complete_rows(copy, 11)
    assert 11 not in rows["pos"]
    assert list(rows["pos"]) == [4, 5, 6, 7, 8, 9, 10]


def test_rows_overwritten_during_the_copy_are_excluded() -> None:
    writer = RingWriter("nccl", NCCL_EVENT, 4)
    writer.append(_rows(0, 4))  # positions 1..4
    copy = writer.buffer.slots.copy()
    # Two more were claimed while copying (head read after the copy is 6):
    # positions 1 and 2 may be torn and must be dropped even though intact.
    rows = complete_rows(copy, 6)
    assert list(rows["pos"]) == [3, 4]


def test_keep_filter_and_lost_counter() -> None:
    writer = RingWriter("nccl", NCCL_EVENT, 16)
    rows = _rows(0, 6)
    rows["pid"] = [1, 2, 1, 2, 1, 2]
    writer.append(rows)
    writer.lost = 3
    ring = writer.buffer.copy(lambda r: r["pid"] == 2)
    assert list(ring.rows["seq"]) == [1, 3, 5]
    assert ring.lost == 3


def test_slot_count_must_be_a_power_of_two() -> None:
    with pytest.raises(ValueError, match="power of two"):
        RingBuffer("nccl", np.zeros(6, dtype=NCCL_EVENT), lambda: 0)


@settings(max_examples=60, deadline=None)
@given(
    slots_log2=st.integers(min_value=2, max_value=6),
    batches=st.lists(st.integers(min_value=0, max_value=100), min_size=1, max_size=8),
    after=st.integers(min_value=0, max_value=400),
)
def test_rows_since_copies_only_the_new_slots_and_agrees_with_a_snapshot(
    slots_log2: int, batches: list[int], after: int
) -> None:
    writer = RingWriter("nccl", NCCL_EVENT, 1 << slots_log2)
    total = 0
    for n in batches:
        writer.append(_rows(total, n))
        total += n
    rows, head = writer.buffer.rows_since(after)
    assert head == total
    every = writer.buffer.copy().rows
    assert list(rows["pos"]) == [p for p in every["pos"].tolist() if p > after]
    slot = writer.buffer.slots
    if total and after < total:
        last = (total - 1) & (len(slot) - 1)
        slot[last]["pos"] = 0  # the newest row is being written: not shown
        rows, _ = writer.buffer.rows_since(after)
        assert total not in rows["pos"].tolist()

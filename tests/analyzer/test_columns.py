"""The analyzer's column machinery on its own: ``Columns``, the low-bits key
lookup, the grid order against a plain sort, and the runs the ring reading
is cut into."""

from __future__ import annotations

import os

import numpy as np
import pytest

from stallwatch.analyzer.align import _positions, _runs
from stallwatch.analyzer.columns import Columns
from stallwatch.analyzer.incident import CALL_DTYPE
from stallwatch.analyzer.match import _grid_order, _sort_order


def test_table_indexes_like_a_structured_array() -> None:
    t = Columns.zeros(CALL_DTYPE, 5)
    t["seq"][:] = [4, 3, 2, 1, 0]
    assert t.names == CALL_DTYPE.names and len(t) == 5
    assert t[1:3]["seq"].tolist() == [3, 2] and np.shares_memory(t[1:3]["seq"], t["seq"])
    assert t[t["seq"] > 2]["seq"].tolist() == [4, 3]
    assert t.take(np.array([4, 0]))["seq"].tolist() == [0, 4]
    assert t.record(0)["seq"] == 4 and t.select(("seq",)).names == ("seq",)
    t.permute(np.argsort(t["seq"]))
    assert t["seq"].tolist() == [0, 1, 2, 3, 4]
    assert Columns.from_records(t.to_records(CALL_DTYPE))["seq"].tolist() == [0, 1, 2, 3, 4]
    col = t.pop("seq")
    assert "seq" not in t.names and len(col) == 5
    with pytest.raises(ValueError, match="unequal length"):
        Columns({"a": np.zeros(2), "b": np.zeros(3)})
    with pytest.raises(ValueError, match="has 2 rows, the table 5"):
        t["seq"] = np.zeros(2)


@pytest.mark.parametrize(
    "keys",
    [
        [1040, 1041, 1042, 1047],  # a node's pids: told apart by their low bits
        [7 << 20, 9 << 20, 11 << 20],  # low 16 bits all equal: binary search
        [2**64 - 5, 3, 2**63 + 1],  # comm hashes
    ],
)
def test_positions_by_low_bits_or_search(keys: list[int]) -> None:
    known = np.array(sorted(keys), dtype=np.uint64)
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.choice(known, 500), np.array([5, 1043, 2**62], np.uint64)])
    pos, found = _positions(known, values)
    assert found.tolist() == [int(v) in keys for v in values]
    assert (known[pos[found]] == values[found]).all()


def test_grid_order_is_the_sort_order() -> None:
    """Two communicators of different sizes, seqs starting anywhere, rows in
    no order; then a duplicate (two rows in one slot) and a sparse range,
    which both go to the sort: the same order every time."""
    rng = np.random.default_rng(1)
    nranks = np.array([4, 3], dtype=np.int64)
    comm = np.repeat([0, 1], [4 * 20, 3 * 15]).astype(np.int32)
    seq = np.concatenate([np.repeat(np.arange(100, 120), 4), np.repeat(np.arange(7, 22), 3)])
    crank = np.concatenate([np.tile(np.arange(4), 20), np.tile(np.arange(3), 15)]).astype(np.int32)
    keep = rng.random(len(comm)) > 0.1  # some rows missing: holes in the grid
    shuffle = rng.permutation(int(keep.sum()))
    comm, seq, crank = (x[keep][shuffle] for x in (comm, seq, crank))

    assert _grid_order(comm, seq.astype(np.int64), crank, nranks) is not None  # the grid path

    def sorted_by_lexsort(c: np.ndarray, s: np.ndarray, r: np.ndarray) -> np.ndarray:
        return np.lexsort((np.arange(len(c)), r, s, c))

    assert (
        _sort_order(comm, seq, crank, nranks).tolist()
        == sorted_by_lexsort(comm, seq, crank).tolist()
    )
    dup = (
        np.concatenate([comm, comm[:1]]),
        np.concatenate([seq, seq[:1]]),
        np.concatenate([crank, crank[:1]]),
    )
    assert _sort_order(*dup, nranks).tolist() == sorted_by_lexsort(*dup).tolist()
    assert _grid_order(*dup[:1], dup[1].astype(np.int64), dup[2], nranks) is None
    sparse = seq.copy()
    sparse[0] += 10**9
    assert (
        _sort_order(comm, sparse, crank, nranks).tolist()
        == sorted_by_lexsort(comm, sparse, crank).tolist()
    )


def test_runs_cover_every_source_once_with_their_offsets() -> None:
    sizes = [5, 0, 7, 3, 3, 9, 0, 1]
    for n in (1, 2, 3, 4, 16):
        runs = _runs(sizes, n)
        assert len(runs) <= max(n, 1)
        assert [i for first, stop, _ in runs for i in range(first, stop)] == list(range(len(sizes)))
        assert all(start == sum(sizes[:first]) for first, _, start in runs)
    assert _runs([0, 0], 4) == [(0, 2, 0)]


def test_a_table_handed_over_in_shared_memory_comes_back_whole_and_leaves_no_file() -> None:
    from stallwatch.analyzer.columns import Handed, hand_over

    table = Columns({"a": np.arange(1000, dtype=np.int64), "b": np.arange(1000).astype(np.uint8)})
    handed = hand_over(table[10:900])  # a view: its rows, not the table's
    assert isinstance(handed, Handed) and os.path.exists(handed.path)
    back = handed.take()
    assert not os.path.exists(handed.path)  # the memory goes with the last view
    assert back["a"].tolist() == list(range(10, 900)) and back["b"].dtype == np.uint8
    assert back["b"].tolist() == [x % 256 for x in range(10, 900)]
    empty = hand_over(Columns({"a": np.zeros(0, dtype=np.int64)}))
    assert isinstance(empty, Handed) and len(empty.take()["a"]) == 0

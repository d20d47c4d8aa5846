"""Communicator and world ranks derived from every member's records
(``dumpers.ranks``), and what the SQL tables make of them."""

from __future__ import annotations

import dataclasses
import random

import numpy as np

from stallwatch.dumpers.model import Clock, CommInfo, ProcessInfo, Recording, Ring
from stallwatch.dumpers.ranks import resolve
from stallwatch.dumpers.schema import RING_DTYPES, Op, State
from stallwatch.dumpers.sqltables import tables

WORLD = 0xAAAA
NODES, PER_NODE = 3, 2


def _tp(node: int) -> int:  # a split per node: color = node, key = local rank
    return 0x1000 + node


def _dp(local: int) -> int:  # a split across nodes: color = local rank, key = node
    return 0x2000 + local


def job_comms(node: int) -> list[CommInfo]:
    """What node ``node``'s agent records of a job like the lab's: a world
    communicator whose ranks the probe read, and two splits whose ranks it
    could not (keys chosen so that key order differs from parent order)."""
    out = []
    for local in range(PER_NODE):
        pid, world = 100 * node + local, node * PER_NODE + local
        out.append(CommInfo(pid, 1, WORLD, world, NODES * PER_NODE))
        out.append(CommInfo(pid, 2, _tp(node), -1, -1, WORLD, node, PER_NODE - local))
        out.append(CommInfo(pid, 3, _dp(local), -1, -1, WORLD, local, NODES - node))
    return out


def test_splits_are_ranked_by_key_then_parent_rank() -> None:
    entries = [((f"n{n}", c.pid), c) for n in range(NODES) for c in job_comms(n)]
    found = resolve(entries)
    assert found.split == {_tp(n) for n in range(NODES)} | {_dp(i) for i in range(PER_NODE)}
    # keys count down: the highest parent rank comes first
    assert found.members[_tp(1)] == (("n1", 101), ("n1", 100))
    assert found.members[_dp(0)] == (("n2", 200), ("n1", 100), ("n0", 0))
    world = found.world_ranks()
    assert world == {
        ("n" + str(n), 100 * n + i): n * PER_NODE + i for n in range(3) for i in (0, 1)
    }


def test_the_order_of_the_inputs_changes_nothing() -> None:
    entries = [((f"n{n}", c.pid), c) for n in range(NODES) for c in job_comms(n)]
    first = resolve(entries)
    for seed in range(5):
        random.Random(seed).shuffle(entries)
        again = resolve(entries)
        assert again.members == first.members and again.world_ranks() == first.world_ranks()


def test_a_split_of_a_split_takes_its_parent_rank_as_derived() -> None:
    """Four ranks split in two halves (keys reversed), each half split again:
    the second split's order follows the first split's derived ranks."""
    half, quarter = 0xB0, 0xC0
    entries: list[tuple[int, CommInfo]] = []
    for p in range(4):
        entries.append((p, CommInfo(p, 1, WORLD, p, 4)))
        entries.append((p, CommInfo(p, 2, half + p // 2, -1, -1, WORLD, p // 2, 9 - p)))
        # same key for all: the order is the rank in the half (derived, reversed)
        entries.append((p, CommInfo(p, 3, quarter + p // 2, -1, -1, half + p // 2, 0, 0)))
    found = resolve(reversed(entries))
    assert found.members[half] == (1, 0) and found.members[half + 1] == (3, 2)
    assert found.members[quarter] == (1, 0) and found.members[quarter + 1] == (3, 2)


def test_one_node_alone_leaves_a_split_unranked_rather_than_guess() -> None:
    one_node = [(("n0", c.pid), c) for c in job_comms(0)]
    found = resolve(one_node)
    # node 0 holds 2 of the world's 6 ranks: another node's ranks may have
    # the same color, so no split can be ranked from what is there
    assert {h for _, h in found.ranks()} == {WORLD}
    assert found.world_ranks() == {("n0", 0): 0, ("n0", 1): 1}
    dp = found.comms[_dp(0)]
    assert dp.slots == (("n0", 0), None) and dp.ranks == (None, None)  # never "rank 0 of 1"
    assert (dp.size, dp.size_min) == (None, 1)
    assert found.uncertain() == {_tp(0), _dp(0), _dp(1)}
    # every member of the parent there: the split is complete, and ranked
    whole = [((f"n{n}", c.pid), c) for n in range(NODES) for c in job_comms(n)]
    assert all(c.exact for c in resolve(whole).comms.values()) and not resolve(whole).uncertain()


def _recording(node: int) -> Recording:
    rows = np.zeros(2 * PER_NODE, RING_DTYPES["nccl"])
    for local in range(PER_NODE):
        for j, (comm, comm_hash) in enumerate(((2, _tp(node)), (3, _dp(local)))):
            row = rows[2 * local + j]
            row["pid"], row["comm"], row["comm_hash"] = 100 * node + local, comm, comm_hash
            row["rank"], row["nranks"], row["op"] = -1, -1, Op.ALL_REDUCE
            row["ts_ns"], row["end_ns"], row["state"] = 10, 20, State.ENQUEUED
    procs = tuple(
        ProcessInfo(100 * node + i, "python", "train.py", 1, 1, ("libnccl.so.2",))
        for i in range(PER_NODE)
    )
    rings = {name: Ring(np.zeros(0, dtype)) for name, dtype in RING_DTYPES.items()}
    rings["nccl"] = Ring(rows)
    return Recording(f"n{node}", "boot", Clock(100, 10**18), procs, tuple(job_comms(node)), rings)


def _ranks(recs: list[Recording]) -> list[tuple[str, int, str, int | None, int | None, int]]:
    keys = ("host", "pid", "comm_id_hash", "rank", "world_rank", "nranks")
    t = tables(recs)["nccl_events"].select(keys).to_pydict()
    # pid 0 (this test's first process) is no process's: NULL, sorted first
    return sorted(
        zip(*(t[k] for k in keys), strict=True),
        key=lambda r: tuple((v is not None, v if v is not None else 0) for v in r),
    )


def test_sql_ranks_split_rows_over_all_dumps_and_leaves_one_node_unknown() -> None:
    recs = [_recording(n) for n in range(NODES)]
    everything = _ranks(recs)
    assert all(r[3] is not None and r[5] is not None for r in everything)
    dp0 = [(host, pid, rank) for host, pid, h, rank, _, _ in everything if h == f"0x{_dp(0):016x}"]
    assert dp0 == [("n0", None, 2), ("n1", 100, 1), ("n2", 200, 0)]
    alone = _ranks(recs[:1])
    # world ranks are known per node; split ranks are not, rather than wrong
    assert [r[4] for r in alone] == [0, 0, 1, 1]
    assert all(r[3] is None for r in alone)
    # the communicator table says the same
    comms = tables(recs)["communicators"].to_pydict()
    split = [
        (h, r, n)
        for h, r, n, p in zip(
            comms["comm_id_hash"], comms["rank"], comms["nranks"], comms["parent_hash"], strict=True
        )
        if p is not None
    ]
    assert len(split) == 2 * NODES * PER_NODE and all(r is not None for _, r, _ in split)
    assert {n for h, _, n in split if h == f"0x{_dp(1):016x}"} == {NODES}


def test_sql_unknown_values_are_null_not_minus_one() -> None:
    rec = _recording(0)
    comm = np.zeros(1, RING_DTYPES["comm"])
    comm["rank"] = comm["nranks"] = comm["color"] = comm["key"] = -1
    comm["op"], comm["result"] = Op.GET_UNIQUE_ID, -1
    nccl = np.zeros(1, RING_DTYPES["nccl"])
    nccl["op"], nccl["rank"], nccl["nranks"], nccl["peer"], nccl["result"] = (
        Op.GET_UNIQUE_ID,
        -1,
        -1,
        -1,
        0,
    )
    nccl["count"], nccl["datatype"] = 7, 3
    rec = dataclasses.replace(rec, rings={**rec.rings, "comm": Ring(comm), "nccl": Ring(nccl)})
    t = tables([rec])
    got = t["comm_events"].select(["rank", "nranks", "color", "key", "comm_id_hash", "result"])
    assert got.to_pylist() == [dict.fromkeys(got.column_names)]
    row = t["nccl_events"].drop_columns(["wall_time"]).to_pylist()[0]
    nulls = ("rank", "nranks", "comm_id_hash", "seq", "count", "bytes", "datatype", "redop", "peer")
    assert {k: row[k] for k in nulls} == dict.fromkeys(nulls)
    assert (row["op"], row["result"], row["comm"]) == ("GET_UNIQUE_ID", 0, None)

"""Ranks of split communicators when a member's recording is lost
(``dumpers.ranks``, ``dumpers.rankevidence``): what every source tells,
never what counting the members present would say.

The job is the lab's (lab.job): a world communicator the probe ranks, split
into a tensor-parallel group per node (split 0: color node, key local rank)
and a data-parallel group per local rank (split 1: color local rank, key
node), pipeline stages on the data-parallel group (stage k sends to k+1 and
receives from k-1), every call blocking (it returns when done) unless said.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from stallwatch.dumpers.model import Clock, CommInfo, ProcessInfo, Recording, Ring
from stallwatch.dumpers.rankevidence import Evidence, ring_evidence
from stallwatch.dumpers.ranks import Ranks, of_dumps, resolve
from stallwatch.dumpers.schema import RING_DTYPES, Op, State, split_hash
from stallwatch.dumpers.sqltables import tables
from stallwatch.query.fanout import _identity

WORLD = 0x5EED
TP, DP = 0, 1  # split indexes
STEPS = 3


def tp(node: int) -> int:
    return split_hash(WORLD, node, TP)


def dp(local: int) -> int:
    return split_hash(WORLD, local, DP)


def pointer(h: int) -> int:
    """The ncclComm_t of a communicator, the same in every process here:
    1 the world's, 2 a tensor-parallel group's, 3 a data-parallel one's."""
    return 1 if h == WORLD else 2 if h in {tp(n) for n in range(8)} else 3


def _rows(calls: list[tuple[int, int, int, int, int]], blocking: bool) -> np.ndarray:
    """(pid, comm hash, op, peer, entry) -> ring rows, returned with success."""
    rows = np.zeros(len(calls), RING_DTYPES["nccl"])
    took = 5_000_000 if blocking else 10_000
    for row, (pid, h, op, peer, ts) in zip(rows, calls, strict=True):
        row["pid"], row["comm_hash"], row["op"], row["peer"] = pid, h, op, peer
        row["ts_ns"], row["end_ns"], row["result"] = ts, ts + took, 0
        row["comm"] = pointer(h)
        row["rank"] = row["nranks"] = -1
        row["state"] = State.ENQUEUED
    return rows


def node(n: int, nodes: int, per: int, blocking: bool = True) -> Recording:
    """What node ``n``'s agent records of ``nodes`` x ``per`` ranks."""
    comms, calls, procs = [], [], []
    for local in range(per):
        pid, world = 1000 * n + local + 1, n * per + local
        procs.append(ProcessInfo(pid, "python", "train.py", 1, 1, ("libnccl.so.2",)))
        comms.append(CommInfo(pid, 1, WORLD, world, nodes * per, init_ns=1))
        comms.append(CommInfo(pid, 2, tp(n), -1, -1, WORLD, n, local, init_ns=2))
        comms.append(CommInfo(pid, 3, dp(local), -1, -1, WORLD, local, n, init_ns=3))
        for step in range(STEPS):
            t = 10**9 * (step + 1)
            calls.append((pid, tp(n), Op.ALL_REDUCE, -1, t))
            calls.append((pid, dp(local), Op.ALL_REDUCE, -1, t + 10**7))
            if n + 1 < nodes:  # the DP rank is the node: ranks k sends to k+1
                calls.append((pid, dp(local), Op.SEND, n + 1, t + 2 * 10**7))
            if n > 0:
                calls.append((pid, dp(local), Op.RECV, n - 1, t + 2 * 10**7))
        calls.append((pid, dp(local), Op.ALL_REDUCE, -1, 10**9 * (STEPS + 1)))
    rings = {name: Ring(np.zeros(0, dtype)) for name, dtype in RING_DTYPES.items()}
    rings["nccl"] = Ring(_rows(calls, blocking))
    return Recording(f"node{n}", "boot", Clock(10**10, 10**18), tuple(procs), tuple(comms), rings)


def job(nodes: int, per: int, lost: set[int], blocking: bool = True) -> list[Recording]:
    return [node(n, nodes, per, blocking) for n in range(nodes) if n not in lost]


def found(recs: list[Recording]) -> dict[int, tuple[tuple[str, int] | None, ...]]:
    known = Ranks.of(recs)
    out: dict[int, list[tuple[str, int] | None]] = {}
    for ((host, pid), h), r in known.comm.items():
        out.setdefault(h, [None] * known.nranks.get(h, r + 1))
        if len(out[h]) <= r:
            out[h] += [None] * (r + 1 - len(out[h]))
        out[h][r] = (host, pid)
    return {h: tuple(v) for h, v in out.items()}


def test_every_member_there_ranks_every_split_by_its_order() -> None:
    got = found(job(4, 2, set()))
    assert got[dp(0)] == tuple((f"node{n}", 1000 * n + 1) for n in range(4))
    assert got[tp(2)] == (("node2", 2001), ("node2", 2002))


def test_a_lost_node_leaves_its_ranks_holes_never_shifts_the_others() -> None:
    """The demo's shape: node1 lost.  The data-parallel groups hold 4 ranks
    (a member named rank 3, and the two splits share node1's two ranks);
    each present member's rank follows from whom it sends to and receives
    from; the hole's owner is rank 2 or 3: unknown."""
    recs = job(4, 2, {1})
    membership = resolve(
        [((r.host, c.pid), c) for r in recs for c in r.communicators],
        {
            ((r.host, pid), h): ev
            for r in recs
            for (pid, h), ev in ring_evidence(r.rings["nccl"].rows, {dp(0), dp(1)}).items()
        },
    )
    d0 = membership.comms[dp(0)]
    assert d0.slots == (("node0", 1), None, ("node2", 2001), ("node3", 3001))
    assert d0.exact and d0.owner(1) is None  # world rank 2 or 3: not the next one
    world = membership.comms[WORLD]
    assert world.owners[2:4] == (2, 3)
    # a node's own tensor-parallel group: node1's ranks may belong to it too
    t0 = membership.comms[tp(0)]
    assert t0.ranks == (None, None, None) and t0.size is None and t0.size_min == 2
    # the SQL tables say the same
    got = found(recs)
    assert got[dp(0)] == d0.slots and tp(0) not in got


def test_one_absent_rank_names_the_owner_of_the_one_hole() -> None:
    membership = Ranks.of(job(4, 1, {2}))
    assert membership.nranks[dp(0)] == 4
    assert {r: m for (m, h), r in membership.comm.items() if h == dp(0)} == {
        0: ("node0", 1),
        1: ("node1", 1001),
        3: ("node3", 3001),
    }
    entries = [((r.host, c.pid), c) for r in job(4, 1, {2}) for c in r.communicators]
    recs = job(4, 1, {2})
    ev = {
        ((r.host, pid), h): e
        for r in recs
        for (pid, h), e in ring_evidence(r.rings["nccl"].rows, {dp(0)}).items()
    }
    assert resolve(entries, ev).comms[dp(0)].owners == (None, None, 2, None)


def test_asynchronous_returns_prove_no_rank() -> None:
    """Calls that return at once are only queued: a send to a peer never
    received says nothing of the sender's own rank; the size is still
    known (named ranks, and the shared absent members)."""
    recs = job(4, 2, {1}, blocking=False)
    known = Ranks.of(recs)
    assert known.nranks[dp(0)] == 4
    assert not [m for (m, h) in known.comm if h == dp(0)]


def test_without_the_rings_nothing_is_guessed() -> None:
    recs = job(4, 2, {1})
    known = Ranks.of(recs, evidence={})
    assert not [m for (m, h) in known.comm if h in (dp(0), dp(1), tp(0))]
    assert dp(0) not in known.nranks


def test_contradicting_evidence_ranks_nothing() -> None:
    """A member that named a rank its complete communicator cannot have:
    the evidence contradicts itself, and no rank of that split is known."""
    recs = job(2, 2, set())
    entries = [((r.host, c.pid), c) for r in recs for c in r.communicators]
    ev = {(("node0", 1), dp(0)): Evidence(named=5)}
    c = resolve(entries, ev).comms[dp(0)]
    assert set(c.ranks) == {None} and c.size is None


def test_an_unsure_order_ranks_nothing() -> None:
    """Two members of one key whose parent ranks are not known (no member
    recorded the parent): NCCL's order between them cannot be told."""
    parent = 0xABC
    entries = [
        (("a", 1), CommInfo(1, 1, 0x77, -1, -1, parent, 0, 0)),
        (("b", 2), CommInfo(2, 1, 0x77, -1, -1, parent, 0, 0)),
    ]
    assert resolve(entries).comms[0x77].ranks == (None, None, None)


def _one(rows: list[tuple[int, int, int]], **fields: int) -> dict[tuple[int, int], Evidence]:
    calls = [(7, 0x99, op, peer, ts) for op, peer, ts in rows]
    raw = _rows(calls, blocking=True)
    for name, value in fields.items():
        raw[name] = value
    return ring_evidence(raw, {0x99})


def test_evidence_names_only_what_nccl_accepted() -> None:
    assert _one([(Op.SEND, 3, 10)])[(7, 0x99)].named == 3
    assert _one([(Op.BROADCAST, 5, 10)])[(7, 0x99)].named == 5
    assert _one([(Op.SEND, 3, 10)], result=4) == {}  # refused: ncclInvalidArgument
    assert _one([(Op.SEND, 3, 10)], end_ns=0) == {}  # in flight: not checked yet


def test_a_rank_is_not_a_peer_it_got_past_one_way() -> None:
    past = [(Op.SEND, 3, 10), (Op.ALL_REDUCE, -1, 20)]
    assert _one(past)[(7, 0x99)].not_ranks == {3}
    # no collective after it completed: never got past it
    assert _one([(Op.ALL_REDUCE, -1, 5), (Op.SEND, 3, 10)])[(7, 0x99)].not_ranks == set()
    # a send to itself and a receive from itself pair up: it may be rank 3
    both = [(Op.SEND, 3, 10), (Op.RECV, 3, 10), (Op.ALL_REDUCE, -1, 20)]
    assert _one(both)[(7, 0x99)].not_ranks == set()
    # asynchronous returns prove no completion; a device's completion does
    quick = _rows([(7, 0x99, op, peer, ts) for op, peer, ts in past], blocking=False)
    assert ring_evidence(quick, {0x99})[(7, 0x99)].not_ranks == set()
    quick["state"] = State.COMPLETED
    assert ring_evidence(quick, {0x99})[(7, 0x99)].not_ranks == {3}


def test_the_fan_out_derives_what_the_dumps_do() -> None:
    """The fan-out's client ranks from every agent's communicator table,
    whose evidence columns carry what the rings tell."""
    recs = job(4, 2, {1})
    comms = pa.concat_tables([tables([r])["communicators"] for r in recs])
    assert _identity(comms) == Ranks.of(recs)


@pytest.mark.parametrize("lost", [{0}, {1}, {3}, {0, 2}])
def test_every_surface_gets_the_dumps_ranks(lost: set[int], tmp_path: object) -> None:
    recs = job(4, 2, lost)
    assert of_dumps([("unread", r) for r in recs]) == Ranks.of(recs)
    t = tables(recs)["nccl_events"].select(["host", "pid", "comm_id_hash", "rank"]).to_pylist()
    known = Ranks.of(recs)
    for row in t:
        member = (row["host"], row["pid"])
        assert row["rank"] == known.comm.get((member, int(row["comm_id_hash"], 16))), row

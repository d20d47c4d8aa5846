"""Flight Recorder groups told apart by what they are, and the in-turn rules
across groups: each rule on files built by hand (named ``synthetic`` here),
positive and negative.  The real torch jobs that drove them, two halves or a
pipeline of two-stage groups each known to its members as ``pg_id`` 1, are
in tests/data/fr-torch (``halves-*``, ``links-*``, ``inturn-halves-*``,
``inturn-links-*``; test_fr_corpus and test_fr_in_turn judge them), and
this module checks that they are what they say.

The jobs built here: a world group "0" of 4 ranks and two halves, "1"
(ranks 0, 1) and "2" (ranks 2, 3), each half its members' ``pg_id`` 1; each
step a world all_reduce, then a half's.  gloo's files (its last entry reads
as pending, ``retired`` or not), dumped in turn.
"""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass
from pathlib import Path

from stallwatch.analyzer.frwrite import dumps
from stallwatch.analyzer.incident import Frontier
from stallwatch.analyzer.pipeline import IncidentResult, analyze_paths
from stallwatch.analyzer.verdict import VerdictKind

CORPUS = Path(__file__).resolve().parents[1] / "data" / "fr-torch"
WORLD = 4
HALF = {0: "1", 1: "1", 2: "2", 3: "2"}
CONFIG = {
    "0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"},
    "1": {"name": "1", "desc": "undefined", "ranks": "[0, 1]"},
    "2": {"name": "2", "desc": "undefined", "ranks": "[2, 3]"},
}
T0 = 1_790_000_000_000_000_000
STEP_NS = 10_000_000


# --- the real corpus: groups that share a local pg_id -----------------------


def _pg_ids(run: str) -> dict[int, dict[int, set[str]]]:
    """rank -> pg_id -> the groups its entries name with it."""
    out: dict[int, dict[int, set[str]]] = {}
    for p in (CORPUS / run / "pickle").iterdir():
        rank = int(p.name.rsplit("_", 1)[1])
        for e in pickle.loads(p.read_bytes())["entries"]:  # torch's own plain dicts
            out.setdefault(rank, {}).setdefault(e["pg_id"], set()).add(e["process_group"][0])
    return out


def test_the_real_jobs_hold_groups_that_share_a_local_pg_id() -> None:
    runs = sorted(
        p.name
        for p in CORPUS.iterdir()
        if p.name.split("-")[0] in ("halves", "links")
        or p.name.startswith(("inturn-halves", "inturn-links"))
    )
    assert len(runs) >= 28
    for run in runs:
        ids = _pg_ids(run)
        named = {g for per in ids.values() for g in per.get(1, set())}
        # pg_id 1 names two groups or more across the ranks, one on each rank
        assert len(named) >= 2, run
        assert all(len(ids[r].get(1, {""})) == 1 for r in ids), run


# --- files built by hand ------------------------------------------------------


@dataclass(frozen=True)
class Rank:
    """What a rank's dump holds: its full steps, then where it was read."""

    steps: int  # world and half all_reduces done, both
    then: tuple[str, ...] = ()  # the calls after them, the last one pending
    returned: bool = False  # its last call returned (retired), then it stopped


def _files(tmp: Path, ranks: dict[int, Rank]) -> Path:
    for rank, r in ranks.items():
        calls: list[tuple[str, int]] = []
        for s in range(1, r.steps + 1):
            calls += [("0", s), (HALF[rank], s)]
        nxt = {"0": r.steps + 1, HALF[rank]: r.steps + 1}
        for g in r.then:
            calls.append((g, nxt[g]))
            nxt[g] += 1
        entries = [
            {
                "record_id": i,
                "pg_id": 0 if g == "0" else 1,
                "process_group": (g, CONFIG[g]["desc"]),
                "collective_seq_id": s,
                "p2p_seq_id": 0,
                "op_id": s,
                "profiling_name": "gloo:all_reduce",
                "time_created_ns": T0 + (2 * s + (g != "0")) * STEP_NS,
                "input_sizes": [[8]],
                "input_dtypes": ["Float"],
                "output_sizes": [[8]],
                "output_dtypes": ["Float"],
                "state": "scheduled",
                "time_discovered_started_ns": None,
                "time_discovered_completed_ns": None,
                "retired": i < len(calls) - 1 or r.returned,
                "timeout_ms": 300000,
                "is_p2p": False,
            }
            for i, (g, s) in enumerate(calls)
        ]
        mine = {k: v for k, v in CONFIG.items() if k in ("0", HALF[rank])}
        doc = {
            "version": "2.10",
            "pg_config": mine,
            "pg_status": {},
            "entries": entries,
        }
        (tmp / f"synthetic_trace_rank_{rank}").write_bytes(dumps(doc))
    return tmp


def _judged(tmp: Path, ranks: dict[int, Rank]) -> IncidentResult:
    (inc,) = analyze_paths([str(_files(tmp, ranks))]).incidents
    return inc


def _frontier(r: IncidentResult, group: str) -> Frontier:
    return next(f for f in r.frontiers if r.incident.comms[f.comm].label == group)


# rank 0 read early (world 4 pending: its peers' completions of world 6
# prove it went on); rank 3 stopped after world 6, before its half's 6th
HUNG = {
    0: Rank(3, ("0",)),
    1: Rank(6, ("0",)),  # in flight at world 7
    2: Rank(5, ("0", "2")),  # world 6 done, in flight at its half's 6th
    3: Rank(5, ("0",), returned=True),  # world 6, then stopped
}


def test_synthetic_a_pair_held_by_the_ranks_waiting_behind_it_names_its_absent_member(
    tmp_path: Path,
) -> None:
    """Half "2" has one member standing at its frontier (rank 2, at seq 6)
    and one absent (rank 3); rank 1 stands at the world's seq 7, which
    rank 2 never entered because it waits in its half: two ranks, read at
    different moments, held by one collective none left.  Rank 3 is named,
    alone (rank 0 is proven read before it went on)."""
    r = _judged(tmp_path, HUNG)
    half = _frontier(r, "2")
    world_rank = {i: p.world_rank for i, p in enumerate(r.incident.procs)}
    assert [world_rank[m.proc] for m in half.standing] == [2]
    assert [world_rank[p] for p in half.behind_it] == [1] and half.stood_still
    (v,) = r.verdicts
    assert (v.kind, v.ranks, v.seq) == (VerdictKind.MISSING_RANK, (3,), 6), v.summary


def test_synthetic_a_pair_whose_waiting_ranks_went_on_is_a_staircase(tmp_path: Path) -> None:
    """The same, but rank 1 read later, past the world's seq 7 (it left it):
    nothing holds the ranks behind half "2", and a staircase of dumps taken
    in turn is healthy."""
    r = _judged(tmp_path, {**HUNG, 1: Rank(7, ("0",))})
    half = _frontier(r, "2")
    assert half.behind_it == () and not half.stood_still
    assert [v.kind for v in r.verdicts] == [VerdictKind.HEALTHY], r.verdicts[0].summary


def test_synthetic_a_rank_waiting_for_one_read_older_is_not_named(tmp_path: Path) -> None:
    """Rank 3 read first (world 4 pending), proven by its peers to have gone
    on; rank 2 waits in its half's seq 6, ranks 0 and 1 in the world's 7.
    Rank 2 only waits (for rank 3, whose dump is older): neither is named,
    and the stall is inconclusive, naming rank 3 alone as the one that may
    have stopped."""
    r = _judged(tmp_path, {**HUNG, 0: Rank(6, ("0",)), 3: Rank(3, ("0",), returned=True)})
    (v,) = r.verdicts
    assert (v.kind, v.ranks) == (VerdictKind.INCONCLUSIVE, (3,)), v.summary
    assert "the job stood still" in v.summary


def test_synthetic_a_rank_waiting_for_one_not_read_older_names_it(tmp_path: Path) -> None:
    """Rank 3 not shown older (it stands behind its half at seq 5, the world
    at 6, as its peers completed): the same waits name it."""
    r = _judged(tmp_path, {**HUNG, 0: Rank(6, ("0",))})
    (v,) = r.verdicts
    assert (v.kind, v.ranks) == (VerdictKind.MISSING_RANK, (3,)), v.summary


def test_synthetic_a_dump_read_older_on_one_group_is_older_on_the_others(
    tmp_path: Path,
) -> None:
    """Rank 3 read with world 5 pending and its half at seq 4: on the world
    its peers' completions of seq 6 prove it went on; on its half nothing
    does (rank 2 stands at seq 5, never completed).  Its dump is older
    there too, and no rank is named."""
    ranks = {
        0: Rank(6, ("0",)),
        1: Rank(6, ("0",)),
        2: Rank(4, ("0", "2")),
        3: Rank(4, ("0",), returned=True),
    }
    r = _judged(tmp_path, ranks)
    half = _frontier(r, "2")
    (m,) = half.laggards
    assert m.older_elsewhere
    assert all(v.kind is not VerdictKind.MISSING_RANK for v in r.verdicts), r.verdicts[0].summary
    assert r.verdicts[0].kind is VerdictKind.INCONCLUSIVE and 3 in r.verdicts[0].ranks


def test_synthetic_a_dump_older_on_no_group_is_not_marked_so(tmp_path: Path) -> None:
    r = _judged(tmp_path, HUNG)
    half = _frontier(r, "2")
    assert not any(m.older_elsewhere for m in half.laggards)


# --- pg_status: a rank's own file maps its pg_ids -----------------------------


def _nccl_files(tmp: Path, status: dict[int, dict[str, dict[str, int]]], config: bool) -> Path:
    """Four ranks, NCCL (completions are the device's): world "0" (pg_id 0)
    and a pipeline of pairs "1" = {0, 1}, "2" = {1, 2}, "3" = {2, 3}, each
    rank's pairs its pg_ids 1 and 2 in the order it made them (rank 1: "1",
    "2"; rank 2: "2", "3"; rank 3: "3" as pg_id 1).  Each step a rank
    reduces with the stage before it, then with the one after it (twice on
    "3"), then in the world.  At step 5 rank 2 stops before its all_reduce
    on "2": rank 1 waits in it, rank 3 in "3"'s seq 9, rank 0 in the
    world's 5.  Rank 2's ring holds its world and "2" calls only (its "3"
    calls fell out of it) while its pg_status still counts "3", pg_id 2,
    to seq 8."""
    pairs = {0: ["1"], 1: ["1", "2"], 2: ["2", "3"], 3: ["3"]}
    ranks_of = {"0": [0, 1, 2, 3], "1": [0, 1], "2": [1, 2], "3": [2, 3]}
    hung = {0: ("0", 5), 1: ("2", 5), 3: ("3", 9)}
    for rank in range(4):
        pg_id = {"0": 0, **{g: i + 1 for i, g in enumerate(pairs[rank])}}
        calls: list[tuple[str, int]] = []
        for s in range(1, 6):
            for g in [*pairs[rank], "0"]:
                calls += [(g, 2 * s - 1), (g, 2 * s)] if g == "3" else [(g, s)]
        if rank in hung:
            calls = calls[: calls.index(hung[rank]) + 1]
        else:  # rank 2: steps 1-4; its "3" calls fell out of its ring
            calls = [(g, s) for g, s in calls if s <= (8 if g == "3" else 4) and g != "3"]
        entries = []
        for i, (g, s) in enumerate(calls):
            t = T0 + i * STEP_NS
            pending = rank in hung and i == len(calls) - 1
            entries.append(
                {
                    "record_id": i,
                    "pg_id": pg_id[g],
                    "process_group": (g, "default_pg" if g == "0" else "undefined"),
                    "collective_seq_id": s,
                    "p2p_seq_id": 0,
                    "op_id": s,
                    "profiling_name": "nccl:all_reduce",
                    "time_created_ns": t,
                    "input_sizes": [[8]],
                    "input_dtypes": ["Float"],
                    "output_sizes": [[8]],
                    "output_dtypes": ["Float"],
                    "state": "scheduled" if pending else "completed",
                    "time_discovered_started_ns": None if pending else t + 1000,
                    "time_discovered_completed_ns": None if pending else t + 2000,
                    "retired": not pending,
                    "timeout_ms": 600000,
                    "is_p2p": False,
                }
            )
        cfg = {g: {"name": g, "desc": "", "ranks": json.dumps(ranks_of[g])} for g in pg_id}
        doc = {
            "version": "2.10",
            "pg_config": cfg if config else {},
            "pg_status": status.get(rank, {}),
            "entries": entries,
        }
        (tmp / f"synthetic_trace_rank_{rank}").write_bytes(dumps(doc))
    return tmp


def _status(enq: int, done: int) -> dict[str, int]:
    return {
        "last_enqueued_collective": enq,
        "last_started_collective": -1,
        "last_completed_collective": done,
    }


RANK_2_STATUS = {2: {"0": _status(4, 4), "1": _status(4, 4), "2": _status(8, 8)}}


def test_synthetic_a_pg_id_is_never_read_as_another_rank_s_group(tmp_path: Path) -> None:
    """Rank 2's pg_id 2 is "3", whose calls its ring lost; rank 1 uses
    pg_id 2 for "2", a group rank 2 is in too.  Read through rank 1's
    numbering, rank 2's counters of "3" (seq 8) would put it past pair "2"'s
    frontier (seq 5) and name rank 1; its own file cannot say which group
    its pg_id 2 is (no pg_config), so the counter is not read, and rank 2
    is named."""
    (r,) = analyze_paths([str(_nccl_files(tmp_path, RANK_2_STATUS, config=False))]).incidents
    pair = _frontier(r, "2")
    by_world = {r.incident.procs[m.proc].world_rank: m for m in pair.members}
    assert (pair.seq, by_world[2].last_seq) == (5, 4)
    v = r.verdicts[0]
    assert (v.kind, v.ranks) == (VerdictKind.MISSING_RANK, (2,)), v.summary


def test_synthetic_a_rank_s_own_pg_config_maps_its_pg_ids(tmp_path: Path) -> None:
    """With its pg_config (its groups "0", "2", "3": pg_ids 0, 1, 2 in the
    order it made them), rank 2's pg_id 2 is read as "3": its counter says
    rank 2 completed "3" to seq 8, one behind rank 3; pair "2" still has it
    at seq 4, and rank 2 is named."""
    (r,) = analyze_paths([str(_nccl_files(tmp_path, RANK_2_STATUS, config=True))]).incidents
    other = _frontier(r, "3")
    by_world = {r.incident.procs[m.proc].world_rank: m for m in other.members}
    assert (other.seq, by_world[2].last_seq, by_world[2].last_returned) == (9, 8, 8)
    pair = _frontier(r, "2")
    assert {r.incident.procs[m.proc].world_rank: m.last_seq for m in pair.members}[2] == 4
    v = r.verdicts[0]
    assert (v.kind, v.ranks) == (VerdictKind.MISSING_RANK, (2,)), v.summary

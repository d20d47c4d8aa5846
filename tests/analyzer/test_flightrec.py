"""PyTorch Flight Recorder dumps: the restricted unpickler, the JSON form,
and the four real incidents of a 16-rank job (nvidia-resiliency-ext's
fr_traces).  For each incident the failed ranks are derived by the analyzer
from the dumps alone; the tests check its reasoning, step by step."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from stallwatch.analyzer.flightrec import read_flightrec
from stallwatch.analyzer.incident import Frontier, MemberState
from stallwatch.analyzer.load import load_inputs
from stallwatch.analyzer.pipeline import (
    IncidentResult,
    analyze_incident,
    analyze_paths,
    group_incidents,
)
from stallwatch.analyzer.verdict import VerdictKind
from stallwatch.dumpers.errors import DumpFormatError, DumpVersionError


def _fr(fixtures_dir: Path) -> Path:
    return fixtures_dir / "pytorch-fr-nccl-16rank"


def _result(fixtures_dir: Path, name: str) -> IncidentResult:
    loaded, statuses = load_inputs([str(_fr(fixtures_dir) / name)])
    assert len(loaded) == 16 and all(s.ok for s in statuses)
    (inc,) = group_incidents(loaded)
    return analyze_incident(inc)


def _lagging(r: IncidentResult) -> dict[str, dict[int, tuple[int, int]]]:
    """group name -> {world rank: (its last seq entered, the group's frontier)}
    for every rank behind its group's frontier."""
    out: dict[str, dict[int, tuple[int, int]]] = {}
    for f in r.frontiers:
        for m in f.laggards:
            world = r.incident.procs[m.proc].world_rank
            out.setdefault(r.incident.comms[f.comm].label, {})[world] = (m.last_seq, f.seq)
    return out


def _frontier(r: IncidentResult, label: str) -> Frontier:
    return next(f for f in r.frontiers if r.incident.comms[f.comm].label == label)


def test_gpu_error_1st_names_ranks_12_and_14(fixtures_dir: Path) -> None:
    r = _result(fixtures_dir, "gpu_error_1st")
    lag = _lagging(r)
    # Rank 12 is the only rank behind anywhere on the host side, and it is
    # behind in every collective group it shares with 13-15: in its
    # tensor-parallel group ("41", ranks 12-13) it last entered seq 42817
    # while rank 13 has _all_gather_base seq 42826 pending; in "58", "69",
    # "74", "94" it is one or two seqs behind.
    assert {w for g in lag.values() for w in g} == {12}
    assert lag["41"][12] == (42817, 42826)
    assert set(lag) == {"41", "58", "69", "74", "94"}
    # Every pending entry is still "scheduled": nothing completed after the fault.
    assert set(r.incident.calls.rows["state"].tolist()) == {0}
    # Rank 14 entered as far as its peers, but its device completed nothing
    # after seq 42805 of "42" (ranks 14-15) while rank 15 completed up to
    # 42818: a collective completes on all its members, so rank 14's GPU (or
    # the thread watching it) stopped where rank 12's did.
    f = _frontier(r, "42")
    by_world = {r.incident.procs[m.proc].world_rank: m for m in f.members}
    assert by_world[14].state is MemberState.AT_FRONTIER
    assert (by_world[14].last_returned, by_world[15].last_returned) == (42805, 42818)
    (v,) = r.verdicts
    assert v.kind is VerdictKind.MISSING_RANK and v.ranks == (12, 14)
    assert any("rank 14" in e and "completed nothing after seq 42805" in e for e in v.evidence)


def test_device_lag_is_read_only_where_completion_is_the_device_s(fixtures_dir: Path) -> None:
    """The same dumps, as if completion were a host call returning: rank 14
    is no longer named (a rank whose calls return later is not behind)."""
    import dataclasses

    r = _result(fixtures_dir, "gpu_error_1st")
    inc = dataclasses.replace(r.incident, device_completion=False)
    (v,) = analyze_incident(inc).verdicts
    assert v.ranks == (12,)


def test_gpu_error_2nd_names_ranks_9_and_14(fixtures_dir: Path) -> None:
    r = _result(fixtures_dir, "gpu_error_2nd")
    lag = _lagging(r)
    # Two ranks fail together: 9 (in data-parallel group "37", ranks 8-11)
    # and 14 ("38", ranks 12-15) both stopped at _all_gather_base seq 87760
    # while their group mates reached 87771; in the 8-rank groups "64", "72",
    # "90" both are behind and no one else is.
    assert {w for g in lag.values() for w in g} == {9, 14}
    assert lag["37"] == {9: (87760, 87771)}
    assert lag["38"] == {14: (87760, 87771)}
    assert set(lag["64"]) == {9, 14}
    (v,) = r.verdicts
    assert v.kind is VerdictKind.MISSING_RANK and v.ranks == (9, 14)


def test_lock_gil_1st_names_ranks_9_and_14(fixtures_dir: Path) -> None:
    r = _result(fixtures_dir, "lock_gil_1st")
    # Ranks 9 and 14 held the GIL: their dumps have no pending entry at all.
    index = {p.world_rank: i for i, p in enumerate(r.incident.procs)}
    rows = r.incident.calls.rows
    assert not ((rows["proc"] == index[9]) | (rows["proc"] == index[14])).any()
    # Their pg_status (shared pg_id 5 = group "37"/"38") says they last
    # enqueued seq 88683, while their group mates wait at 88688.
    lag = _lagging(r)
    assert lag["37"] == {9: (88683, 88688)}
    assert lag["38"] == {14: (88683, 88688)}
    f = _frontier(r, "64")
    assert {r.incident.procs[m.proc].world_rank for m in f.laggards} == {9, 14}
    (v,) = r.verdicts
    assert v.kind is VerdictKind.MISSING_RANK and v.ranks == (9, 14)


def test_lock_gil_2nd_names_ranks_10_and_15(fixtures_dir: Path) -> None:
    r = _result(fixtures_dir, "lock_gil_2nd")
    # Ranks 10 and 15 have empty dumps; every collective group holding one of
    # them has peers pending at its frontier ("40": 11 at 31451; "42": 14 at
    # 43682; "57", "73", "93" and "58", "74", "94"), and no other rank lags.
    lag = _lagging(r)
    assert {w for g in lag.values() for w in g} == {10, 15}
    f = _frontier(r, "40")
    states = {r.incident.procs[m.proc].world_rank: m.state for m in f.members}
    assert states[11] is MemberState.AT_FRONTIER and states[10] is not MemberState.AT_FRONTIER
    (v,) = r.verdicts
    assert v.kind is VerdictKind.MISSING_RANK and v.ranks == (10, 15)


def test_same_verdict_whatever_the_order(fixtures_dir: Path) -> None:
    folder = _fr(fixtures_dir) / "gpu_error_2nd"
    files = sorted(str(p) for p in folder.iterdir())
    a = analyze_paths(files)
    b = analyze_paths(files[::-1])
    assert [v.to_json() for v in a.incidents[0].verdicts] == [
        v.to_json() for v in b.incidents[0].verdicts
    ]


def test_json_form_reads_like_the_pickle(fixtures_dir: Path, tmp_path: Path) -> None:
    src = _fr(fixtures_dir) / "lock_gil_2nd"
    out = tmp_path / "lock_gil_2nd"
    out.mkdir()
    for p in src.iterdir():
        with open(p, "rb") as f:
            doc = pickle.load(f)  # trusted fixture, converted for the test only
        (out / p.name).write_text(json.dumps(doc))
    res = analyze_paths([str(out)])
    (v,) = res.incidents[0].verdicts
    assert v.kind is VerdictKind.MISSING_RANK and v.ranks == (10, 15)


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        import os

        return (os.system, ("touch /tmp/stallwatch-pwned",))


def test_restricted_unpickler_refuses_globals(tmp_path: Path) -> None:
    p = tmp_path / "_dump_0"
    p.write_bytes(pickle.dumps({"version": "2.9", "entries": [_Evil()]}, protocol=4))
    with pytest.raises(DumpFormatError, match="refused global"):
        read_flightrec(str(p))
    assert not Path("/tmp/stallwatch-pwned").exists()


def test_newer_major_version_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "_dump_0"
    p.write_bytes(pickle.dumps({"version": "3.0", "entries": []}))
    with pytest.raises(DumpVersionError, match=r"3\.0"):
        read_flightrec(str(p))


def test_malformed_entry_names_file_and_field(tmp_path: Path) -> None:
    p = tmp_path / "_dump_3"
    p.write_bytes(pickle.dumps({"version": "2.9", "pg_config": {}, "entries": [{"pg_id": 0}]}))
    with pytest.raises(DumpFormatError, match=r"_dump_3: entries\[0\]"):
        read_flightrec(str(p))


CORPUS = Path(__file__).resolve().parents[1] / "data" / "fr-torch"


def test_column_reading_matches_entry_by_entry(fixtures_dir: Path) -> None:
    """The fast reader (a field of every entry at a time) gives the rows the
    validating one (entry by entry) gives, on every real dump."""
    from stallwatch.analyzer import flightrec

    checked = 0
    paths = sorted(_fr(fixtures_dir).glob("*/*")) + sorted(CORPUS.glob("*/*/nccl_trace_rank_*"))
    for p in paths:
        entries = flightrec._parse(str(p), p.read_bytes())["entries"]
        names: dict[str, int] = {}
        shapes: dict[str, int] = {"": 0}
        slow = [flightrec._entry(str(p), i, e, names, shapes) for i, e in enumerate(entries)]
        fast_names: dict[str, int] = {}
        fast_shapes: dict[str, int] = {"": 0}
        fast = flightrec._entries_by_column(entries, fast_names, fast_shapes)
        assert fast is not None and fast_names == names and fast_shapes == shapes
        assert fast.tolist() == [tuple(r) for r in slow], p
        checked += len(slow)
    assert checked > 2000  # every entry of the 64 dumps and of the corpus


def _entry(seq: int, **over: object) -> dict[str, object]:
    e: dict[str, object] = {
        "record_id": seq,
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "op_id": seq,
        "is_p2p": False,
        "pg_id": 0,
        "process_group": ("0", "default_pg"),
        "profiling_name": "nccl:all_reduce",
        "input_sizes": [[4]],
        "output_sizes": [[4]],
        "input_dtypes": ["Float"],
        "output_dtypes": ["Float"],
        "state": "completed",
        "retired": True,
        "time_created_ns": 5 + seq,
        "time_discovered_completed_ns": 6 + seq,
    }
    e.update(over)
    return e


def _write(folder: Path, rank: int, doc: dict[str, object]) -> Path:
    folder.mkdir(exist_ok=True)
    p = folder / f"nccl_trace_rank_{rank}"
    p.write_bytes(pickle.dumps(doc))
    return p


def test_field_set_of_version_1(tmp_path: Path) -> None:
    """1.x: one ``seq_id``, groups by ``pg_id``, no process_group, no dtypes."""
    old = {"version": "1.4", "pg_config": {}, "entries": []}
    for rank in range(3):
        entries = [
            {
                "seq_id": s,
                "pg_id": 0,
                "profiling_name": "nccl:all_reduce",
                "input_sizes": [[8]],
                "output_sizes": [[8]],
                "state": "completed" if s < 3 else "scheduled",
                "time_created_ns": s,
            }
            for s in range(1, 3 if rank == 2 else 4)
        ]
        _write(tmp_path, rank, {**old, "entries": entries})
    d = read_flightrec(str(tmp_path / "nccl_trace_rank_0"))
    assert d.pg_names == ("0",) and d.entries["seq"].tolist() == [1, 2, 3]
    (v,) = analyze_paths([str(tmp_path)]).incidents[0].verdicts
    assert v.kind is VerdictKind.MISSING_RANK and v.ranks == (2,) and v.seq == 3


def test_coalesced_ops_are_one_call(tmp_path: Path) -> None:
    """NCCL records each op of a coalesced group under one collective_seq_id,
    closed by a "coalesced" marker: one call, its count the sum, its shape
    the list; a rank that coalesced other sizes departs."""
    for rank in range(3):
        sizes = [[3], [5]] if rank != 1 else [[4], [4]]
        entries = [
            _entry(1),
            _entry(2, op_id=2, input_sizes=[sizes[0]]),
            _entry(2, op_id=3, input_sizes=[sizes[1]]),
            _entry(2, op_id=4, profiling_name="nccl:coalesced", input_sizes=[], output_sizes=[]),
            _entry(3, op_id=5),
        ]
        _write(tmp_path, rank, {"version": "2.9", "pg_config": {}, "entries": entries})
    d = read_flightrec(str(tmp_path / "nccl_trace_rank_0"))
    assert d.entries["seq"].tolist() == [1, 2, 3]
    assert d.entries["count"].tolist() == [4, 8, 4]
    assert d.shapes[int(d.entries["shape"][1])] == "[[3]]+[[5]]"
    (v,) = analyze_paths([str(tmp_path)]).incidents[0].verdicts
    assert v.kind is VerdictKind.DESYNC and v.ranks == (1,) and v.seq == 2
    assert "shape=[[4]]+[[4]]" in v.summary


def test_unreadable_pg_config_is_a_note_not_a_lost_dump(tmp_path: Path) -> None:
    for rank in range(2):
        cfg = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1"}}
        _write(tmp_path, rank, {"version": "2.10", "pg_config": cfg, "entries": [_entry(1)]})
    res = analyze_paths([str(tmp_path)])
    assert all(s.ok for s in res.inputs)
    (inc,) = res.incidents
    assert any("ranks unreadable" in n for n in inc.incident.notes)
    assert [v.kind for v in inc.verdicts] == [VerdictKind.HEALTHY]


def test_gloo_groups_are_read_from_the_entries() -> None:
    """torch 2.13's gloo: pg_config keyed by '' (no group of the entries), the
    same pg_id naming other subgroups on other ranks: members come from the
    default group's description and from which dumps hold a group."""
    r = analyze_paths([str(CORPUS / "groups-healthy-8" / "pickle")]).incidents[0]
    members = {
        c.label: sorted(r.incident.procs[p].world_rank for p in c.members) for c in r.incident.comms
    }
    assert members["0"] == list(range(8))
    assert sorted(members.values()) == sorted(
        [list(range(8)), [0, 1, 2, 3], [0, 1], [2, 3], [4, 5], [6, 7]]
    )
    assert any("members are the ranks whose dumps hold" in n for n in r.incident.notes)
    assert [v.kind for v in r.verdicts] == [VerdictKind.HEALTHY]
    # every rank's pg_status read, per its own pg_ids: world, half, pair
    assert len(r.incident.progress) == 8 + 4 + 8


def test_a_malformed_entry_among_good_ones_is_still_named(tmp_path: Path) -> None:
    good = {
        "collective_seq_id": 1,
        "p2p_seq_id": 0,
        "is_p2p": False,
        "pg_id": 0,
        "process_group": ("0", "default_pg"),
        "profiling_name": "nccl:all_reduce",
        "input_sizes": [[4]],
        "input_dtypes": ["Float"],
        "state": "completed",
        "time_created_ns": 5,
        "time_discovered_completed_ns": 6,
    }
    bad = {**good, "collective_seq_id": None}
    p = tmp_path / "_dump_1"
    p.write_bytes(pickle.dumps({"version": "2.9", "pg_config": {}, "entries": [good, bad, good]}))
    with pytest.raises(DumpFormatError, match=r"_dump_1: entries\[1\]"):
        read_flightrec(str(p))


def test_worker_processes_read_what_one_process_reads(
    fixtures_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many Flight Recorder files are read on worker processes: the same
    dumps, in the same order, and a bad file still reported on its own."""
    from stallwatch.analyzer import load

    folder = tmp_path / "gpu_error_1st"
    folder.mkdir()
    for p in (_fr(fixtures_dir) / "gpu_error_1st").iterdir():
        (folder / p.name).write_bytes(p.read_bytes())
    (folder / "_dump_99").write_bytes(b"\x80\x04garbage")
    monkeypatch.setenv("STALLWATCH_THREADS", "1")
    one, one_status = load_inputs([str(folder)])
    monkeypatch.setenv("STALLWATCH_THREADS", "2")
    monkeypatch.setattr(load, "POOL_MIN_BYTES", 0)
    pooled = load._pool_for([str(p) for p in folder.iterdir()])
    assert pooled is not None  # the path under test really uses processes
    pooled[0].shutdown()
    many, many_status = load_inputs([str(folder)])
    assert [s.ok for s in many_status] == [s.ok for s in one_status]
    assert [s.error for s in many_status if not s.ok] == [
        s.error for s in one_status if not s.ok
    ] and "_dump_99" in str(many_status[-1].error)
    assert [d.path for d in many] == [d.path for d in one]  # type: ignore[union-attr]
    assert all((a.entries == b.entries).all() for a, b in zip(many, one, strict=True))  # type: ignore[union-attr]
    verdicts = [analyze_incident(inc).verdicts for inc in group_incidents(many)]
    assert [v.to_json() for v in verdicts[0]] == [
        v.to_json() for v in analyze_incident(group_incidents(one)[0]).verdicts
    ]


def test_of_a_long_ring_the_latest_calls_are_read(tmp_path: Path) -> None:
    """As of our own dumps, a rank's latest WINDOW_CALLS calls are read and
    the older ones count as overwritten; a coalesced group at the window's
    edge is read whole (cut, its count would depart from its peers')."""
    from stallwatch.analyzer.incident import WINDOW_CALLS

    for rank in range(3):
        group = [_entry(336, op_id=336 + i, input_sizes=[[2]]) for i in range(10)]
        group.append(_entry(336, op_id=346, profiling_name="nccl:coalesced"))
        later = [_entry(s, op_id=s + 10) for s in range(337, 337 + 254)]
        entries = [_entry(s) for s in range(1, 336)] + group + later
        assert len(entries) == 600 and 600 - WINDOW_CALLS in range(335, 346)
        _write(tmp_path, rank, {"version": "2.10", "pg_config": {}, "entries": entries})
    d = read_flightrec(str(tmp_path / "nccl_trace_rank_0"))
    assert d.wrapped
    assert d.entries["seq"][0] == 336 and d.entries["count"][0] == 20
    assert len(d.entries) == 1 + 254
    (v,) = analyze_paths([str(tmp_path)]).incidents[0].verdicts
    assert v.kind is VerdictKind.HEALTHY


def test_our_section_malformed_names_the_field(tmp_path: Path) -> None:
    """A file stallwatch wrote carries a ``stallwatch`` section; a malformed
    one is refused, naming the field."""
    for section, field in (
        ({"pid": "12"}, "stallwatch.pid"),
        ({"comms": {"0": "not hex"}}, "stallwatch"),
        ([1, 2], "stallwatch"),
    ):
        p = _write(
            tmp_path,
            0,
            {"version": "2.10", "pg_config": {}, "entries": [_entry(1)], "stallwatch": section},
        )
        with pytest.raises(DumpFormatError, match=rf"nccl_trace_rank_0: field '{field}'"):
            read_flightrec(str(p))


def test_the_stack_of_a_cited_rank_is_read_for_it_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dumps with stack frames (torch records them by default): the reader
    leaves them; a verdict's culprit gets the stack of its cited call as
    evidence, read from its file alone once the verdict is known."""
    from stallwatch.analyzer import frincident

    folder = CORPUS.parent / "fr-stacks" / "allreduce-hang-4"
    read: list[str] = []
    real = frincident.stack_of

    def spy(path: str, *args: object) -> object:
        read.append(Path(path).name)
        return real(path, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(frincident, "stack_of", spy)
    (inc,) = analyze_paths([str(folder)]).incidents
    v = inc.verdicts[0]
    assert v.kind is VerdictKind.MISSING_RANK and v.ranks == (2,)
    assert read == ["nccl_trace_rank_2"]
    (line,) = [e for e in v.evidence if "called from" in e]
    assert "ALL_REDUCE seq 3" in line
    assert "sync_grads (train.py:" in line and "step (train.py:" in line
    assert line.index("all_reduce (distributed_c10d.py:") < line.index("<module> (train.py:")

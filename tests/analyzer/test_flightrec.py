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
from stallwatch.analyzer.load import load_inputs
from stallwatch.analyzer.metrics import Frontier, MemberState
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


def test_gpu_error_1st_names_rank_12(fixtures_dir: Path) -> None:
    r = _result(fixtures_dir, "gpu_error_1st")
    lag = _lagging(r)
    # Rank 12 is the only rank behind anywhere, and it is behind in every
    # collective group it shares with 13-15: in its tensor-parallel group
    # ("41", ranks 12-13) it last entered seq 42817 while rank 13 has
    # _all_gather_base seq 42826 pending; in "58", "69", "74", "94" it is one
    # or two seqs behind.  Its own last entry is all_to_all 20536 on "74",
    # which 13-15 completed and left behind (they are at 20538): rank 12 is
    # the one that stopped making progress; the others wait for it.
    assert {w for g in lag.values() for w in g} == {12}
    assert lag["41"][12] == (42817, 42826)
    assert set(lag) == {"41", "58", "69", "74", "94"}
    # Every pending entry is still "scheduled": nothing completed after the fault.
    assert set(r.incident.calls.rows["state"].tolist()) == {0}
    (v,) = r.verdicts
    assert v.kind is VerdictKind.MISSING_RANK and v.ranks == (12,)


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


def test_column_reading_matches_entry_by_entry(fixtures_dir: Path) -> None:
    """The fast reader (a field of every entry at a time) gives the rows the
    validating one (entry by entry) gives, on every real dump."""
    from stallwatch.analyzer import flightrec

    checked = 0
    for p in sorted(_fr(fixtures_dir).glob("*/*")):
        entries = flightrec._parse(str(p), p.read_bytes())["entries"]
        names: dict[str, int] = {}
        slow = [flightrec._entry(str(p), i, e, names) for i, e in enumerate(entries)]
        fast_names: dict[str, int] = {}
        fast = flightrec._entries_by_column(entries, fast_names)
        assert fast is not None and fast_names == names
        assert fast.tolist() == [tuple(r) for r in slow]
        checked += len(slow)
    assert checked > 900  # every entry of the 64 dumps


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

"""Rows the recorder cannot write (``analyzer.plausible``): each rule on a
synthetic positive and negative case, and the analysis of a dump that holds
one: left out as damaged, never a verdict of its own."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from stallwatch.analyzer.flightrec import FrDump, read_flightrec
from stallwatch.analyzer.pipeline import analyze_paths, analyze_recordings
from stallwatch.analyzer.plausible import fr_damage, implausible, other_rings
from stallwatch.analyzer.verdict import VerdictKind
from stallwatch.dumpers.model import CommInfo, Recording, Ring
from stallwatch.dumpers.schema import DataType, Op, Result
from tests.analyzer.synth import BASE_JOB, recordings, with_


def _node(hang: tuple[int, int] | None = None) -> Recording:
    """Node 0 of a synthetic 2x2 job (ranks 0 and 1), its last rows in flight."""
    return recordings(with_(BASE_JOB, hang=hang) if hang else BASE_JOB)[0]


def _rows(rec: Recording) -> np.ndarray:
    return rec.rings["nccl"].rows.copy()


def _last_call(rows: np.ndarray, pid: int) -> int:
    calls = np.flatnonzero((rows["pid"] == pid) & (rows["op"] == Op.ALL_REDUCE))
    return int(calls[-1])


def _judge(rec: Recording, rows: np.ndarray, lost: int = 0) -> list[str]:
    bad, why = implausible(rows, rec, lost)
    assert bad.any() == bool(why)
    return why


def test_a_recorded_window_is_plausible() -> None:
    rec = _node()
    assert _judge(rec, _rows(rec)) == []
    assert _judge(rec, _rows(rec)[-50:]) == []  # a window of the latest rows


Change = Callable[[np.ndarray, int], None]


def _set(field: str, value: int) -> Change:
    def change(rows: np.ndarray, i: int) -> None:
        rows[field][i] = value

    return change


def _rooted(root: int) -> Change:
    """A broadcast from ``root`` (a flipped bit once made root 134217734 on
    a communicator of 8: a desync blamed on a rank that had none)."""

    def change(rows: np.ndarray, i: int) -> None:
        rows["op"][i], rows["peer"][i] = Op.BROADCAST, root

    return change


CASES: list[tuple[str, Change, Change | None]] = [
    # (the rule's words, a value it refuses, the closest value it takes)
    ("an op no probe writes", _set("op", 0x41), _set("op", Op.ALL_GATHER)),
    ("a lifecycle state", _set("state", 9), _set("state", 3)),
    ("a result NCCL never returns", _set("result", 77), _set("result", Result.REMOTE_ERROR)),
    ("a datatype NCCL does not know", _set("datatype", 39), None),
    ("a count of more than 256 TiB", _set("count", 2**54 + 1), None),
    ("bytes other than the count", _set("count", 1025), _set("datatype", DataType.INT32)),
    ("a rank outside its communicator", _set("rank", 4), _set("rank", 3)),
    ("a peer or root outside", _rooted(4), _rooted(3)),
    ("a time after the dump", _set("ts_ns", 2**62), None),
    ("a return before its entry", _set("end_ns", 1), None),
    ("a seq out of order", _set("seq", 2), None),
]


@pytest.mark.parametrize(("words", "bad", "good"), CASES, ids=[c[0] for c in CASES])
def test_each_rule_refuses_what_no_recorder_writes(
    words: str, bad: Change, good: Change | None
) -> None:
    rec = _node()
    pid = rec.processes[0].pid
    rows = _rows(rec)
    i = int(np.flatnonzero(rows["pid"] == pid)[-4])  # a call in the middle of its stream
    bad(rows, i)
    why = [w for w in _judge(rec, rows) if w.startswith(words)]
    assert len(why) == 1 and f"pid {pid}" in why[0]
    if good is not None:
        rows = _rows(rec)
        good(rows, i)
        assert _judge(rec, rows) == []


def test_a_datatype_or_count_nccl_refused_is_a_failed_call_not_damage() -> None:
    rec = _node()
    rows = _rows(rec)
    i = _last_call(rows, rec.processes[0].pid)
    rows["datatype"][i], rows["count"][i] = 39, 2**60
    rows["result"][i] = Result.INVALID_ARGUMENT
    rows["end_ns"][i] = rows["ts_ns"][i] + 1000
    assert _judge(rec, rows) == []
    rows["result"][i] = Result.SUCCESS
    (why,) = _judge(rec, rows)
    assert why.startswith("a datatype NCCL does not know") and 39 not in set(DataType)
    rows["datatype"][i] = DataType.FLOAT32
    rows["bytes"][i] = rows["count"][i] * 4
    (why,) = _judge(rec, rows)
    assert why.startswith("a count of more than 256 TiB")


def test_seq_steps_by_one_on_each_process_and_communicator() -> None:
    rec = _node()
    pid = rec.processes[0].pid
    rows = _rows(rec)
    calls = np.flatnonzero(rows["pid"] == pid)
    i, before = int(calls[-1]), int(rows["seq"][calls[-2]])
    for seq in (before, before - 1, before + 2):  # repeats, goes back, jumps
        again = rows.copy()
        again["seq"][i] = seq
        (why,) = _judge(rec, again)
        assert why.startswith("a seq out of order"), seq
    # a jump where the kernel lost rows is no damage
    jumped = rows.copy()
    jumped["seq"][i] = before + 3
    assert _judge(rec, jumped) and _judge(rec, jumped, lost=5) == []
    # another communicator's stream is its own
    other = rows.copy()
    other["comm"][i] ^= 0x10
    other["comm_hash"][i] = 0
    other["seq"][i] = 0
    assert _judge(rec, other) == []


def test_a_communicator_pointer_keeps_the_hash_its_table_gives() -> None:
    rec = _node()
    pid = rec.processes[0].pid
    rows = _rows(rec)
    i = _last_call(rows, pid)
    rows["comm_hash"][i] ^= 1 << 40
    (why,) = _judge(rec, rows)
    assert why.startswith("a communicator hash its process's table does not give")
    rows["comm_hash"][i] = 0  # an id its agent did not know: no damage
    assert _judge(rec, rows) == []
    # a pointer freed and reused for a new communicator: both hashes are its
    rows = _rows(rec)
    new = rows["comm_hash"][i] ^ (1 << 40)
    rows["comm_hash"][i] = new
    c = next(c for c in rec.communicators if c.pid == pid and c.comm == rows["comm"][i])
    comms = (*rec.communicators, dataclasses.replace(c, comm_hash=int(new)))
    reused = dataclasses.replace(rec, communicators=comms)
    assert not any("hash" in w for w in _judge(reused, rows))


def test_a_thread_never_moves_to_another_process() -> None:
    rec = _node()
    a, b = (p.pid for p in rec.processes[:2])
    rows = _rows(rec)
    i = _last_call(rows, b)
    rows["pid"][i] = a  # rank 1's call under rank 0's pid: its thread is rank 1's
    assert any(w.startswith("a thread that names another process") for w in _judge(rec, rows))
    rows = _rows(rec)
    rows["tid"][rows["pid"] == a] = 777_777  # a worker thread of its own: no damage
    assert _judge(rec, rows) == []


def _with_row(rec: Recording, change: Callable[[np.ndarray], None]) -> Recording:
    rows = _rows(rec)
    change(rows)
    ring = rec.rings["nccl"]
    return dataclasses.replace(rec, rings={**rec.rings, "nccl": Ring(rows, ring.overwritten, 0)})


@pytest.mark.parametrize(
    ("field", "value"), [("datatype", 39), ("count", 18014398509481985), ("seq", 2**40)]
)
def test_a_damaged_dump_is_lost_and_names_no_one(field: str, value: int) -> None:
    """The issue's flips: a desync on datatype 39 or a count of 2**54 + 1, a
    seq far ahead (its rank looked at a frontier every other rank missed),
    all in node 0's dump where rank 3 (node 1) hung: node 0 is left out as
    damaged; rank 3 is named, or the verdict is inconclusive."""
    recs = recordings(with_(BASE_JOB, hang=(3, 12)))

    def change(rows: np.ndarray) -> None:
        i = int(np.flatnonzero(rows["pid"] == recs[0].processes[1].pid)[-2])
        rows[field][i] = value

    damaged = [("node0.msgpack", _with_row(recs[0], change)), ("node1.msgpack", recs[1])]
    result = analyze_recordings(damaged)
    (lost,) = result.lost
    assert lost.path == "node0.msgpack" and "rings.nccl: damaged (" in str(lost.error)
    named = {r for v in result.incidents[0].verdicts for r in v.ranks}
    kinds = {v.kind for v in result.incidents[0].verdicts}
    assert VerdictKind.DESYNC not in kinds and VerdictKind.HEALTHY not in kinds
    assert kinds == {VerdictKind.INCONCLUSIVE} or named == {3}


def test_a_plausible_dump_is_judged_as_before() -> None:
    recs = recordings(with_(BASE_JOB, hang=(3, 12)))
    result = analyze_recordings([(f"node{i}", r) for i, r in enumerate(recs)])
    assert not result.lost
    (v,) = result.incidents[0].verdicts
    assert v.kind is VerdictKind.MISSING_RANK and v.ranks == (3,)


def test_comm_tables_are_left_as_they_are() -> None:
    """Only rows are judged: an agent's table of communicators is its own."""
    rec = _node()
    extra = CommInfo(4242, 0xABC, 0x1234, 0, 2)
    assert (
        _judge(dataclasses.replace(rec, communicators=(*rec.communicators, extra)), _rows(rec))
        == []
    )


def test_a_device_completes_a_call_after_the_call_was_made() -> None:
    rec = _node()
    rows = _rows(rec)
    i = _last_call(rows, rec.processes[0].pid)
    rows["started_ns"][i], rows["completed_ns"][i] = rows["ts_ns"][i] + 10, rows["ts_ns"][i] + 20
    assert _judge(rec, rows) == []
    # a start seen 711 ns after the completion, as two probes racing stamped
    # them on a lab job whose device stopped: the recorder writes that
    rows["started_ns"][i] = rows["completed_ns"][i] + 711
    assert _judge(rec, rows) == []
    rows["started_ns"][i] = 0
    rows["completed_ns"][i] = rows["ts_ns"][i] - 1
    (why,) = _judge(rec, rows)
    assert why.startswith("a device that completed a call before the call was made")


def test_scheduler_tcp_and_exit_rows_no_agent_writes() -> None:
    """A run-queue delay of 39 hours (one bit of 3.6 ms flipped) made a rank
    look starved of CPU: such a row makes the dump damaged."""
    rec = recordings(with_(BASE_JOB, cpuhog=2))[1]
    assert other_rings(rec) is None
    for name, field, value, words in [
        ("sched", "delay_ns", 0x80000036FF22, "a wait that began before the clock"),
        ("sched", "ts_ns", 2**62, "a time after the dump"),
        ("exit", "signal", 99, "a signal Linux does not have"),
    ]:
        ring = rec.rings[name]
        rows = ring.rows.copy()
        if not len(rows):  # a row of its own
            rows = np.zeros(1, rows.dtype)
            rows["ts_ns"] = 1
        rows[field][0] = value
        broken = dataclasses.replace(rec, rings={**rec.rings, name: Ring(rows)})
        why = other_rings(broken)
        assert why is not None and why.startswith(f"rings.{name}: damaged ({words}"), why


FR = Path(__file__).resolve().parents[1] / "data" / "fr-torch"


def test_flight_recorder_files_of_the_corpus_are_not_damaged() -> None:
    files = sorted(FR.glob("*/pickle/*")) + sorted(FR.glob("*-4/json/*"))
    assert len(files) > 300
    assert [fr_damage(read_flightrec(str(f))) for f in files] == [None] * len(files)


def _entries(d: FrDump, change: Callable[[np.ndarray], None]) -> FrDump:
    e = d.entries.copy()
    change(e)
    return dataclasses.replace(d, entries=e)


@pytest.mark.parametrize(
    ("words", "change"),
    [
        ("a seq or op_id out of order", lambda e: e["seq"].__setitem__(-1, e["seq"][-1] + 2)),
        ("a seq or op_id out of order", lambda e: e["op_id"].__setitem__(-2, e["op_id"][-1])),
        ("created before the entry before it", lambda e: e["created"].__setitem__(-1, 5)),
        ("no creation time", lambda e: e["created"].__setitem__(0, 0)),
        ("an op it does not name", lambda e: e["op"].__setitem__(2, Op.UNKNOWN)),
        ("a call that carries data without its sizes", lambda e: e["shape"].__setitem__(1, 0)),
    ],
)
def test_a_damaged_flight_recorder_file(words: str, change: Callable[[np.ndarray], None]) -> None:
    d = read_flightrec(str(FR / "allreduce-hang-4" / "pickle" / "nccl_trace_rank_0"))
    assert fr_damage(d) is None
    why = fr_damage(_entries(d, change))
    assert why is not None and why.endswith(f"damaged ({words} in its group)" if "seq" in words
                                            else f"damaged ({words})"), why  # fmt: skip


def _first_kinds(folder: Path) -> list[VerdictKind]:
    (inc,) = analyze_paths([str(folder)]).incidents
    return [v.kind for v in inc.verdicts]


def test_a_datatype_no_input_names_is_unknown_never_a_desync(tmp_path: Path) -> None:
    """One damaged letter of a Flight Recorder dtype ('Float' read as
    'Flmat') once made a datatype desync: a name the reader does not know is
    unknown, compared where every member's is known.  A datatype torch
    names that differs (the corpus' dtype run: 'Double') stays a desync."""
    run = FR / "allreduce-healthy-4" / "json"
    for f in sorted(run.iterdir()):
        doc = json.loads(f.read_text())
        if f.name.endswith("_1.json"):
            last = [e for e in doc["entries"] if e["input_dtypes"]][-1]
            last["input_dtypes"] = last["output_dtypes"] = ["Flmat"]
        (tmp_path / f.name).write_text(json.dumps(doc))
    assert _first_kinds(run) == [VerdictKind.HEALTHY]
    assert _first_kinds(tmp_path) == [VerdictKind.HEALTHY]
    assert _first_kinds(FR / "allreduce-dtype-4" / "json")[0] is VerdictKind.DESYNC

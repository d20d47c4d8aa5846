"""``stallwatch analyze`` end to end on dump files: exit codes, bad inputs
reported per file, JSON as in docs/architecture.md, text report layout."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from stallwatch.analyzer.verdict import VerdictKind
from stallwatch.commands.main import main
from stallwatch.dumpers.format import write_dump
from tests.analyzer.synth import BASE_JOB, recordings, with_


def run(argv: list[str]) -> int:
    return main(["analyze", *argv])


def write(tmp: Path, **fault: object) -> list[Path]:
    return [write_dump(tmp, r) for r in recordings(with_(BASE_JOB, **fault))]


def test_healthy_dumps_exit_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(tmp_path)
    assert run([str(tmp_path)]) == 0
    assert "HEALTHY" in capsys.readouterr().out


def test_hang_exits_1_with_verdict_first_then_tables(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(tmp_path, hang=(3, 30))
    assert run([str(tmp_path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[1].strip().startswith("MISSING_RANK: rank 3 ")
    table = out.index(next(line for line in out if line.strip().startswith("communicator ")))
    assert "frontier seq 30" in out[table]
    assert any("behind" in line and " 29 " in line for line in out[table:])


def test_json_document(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = write(tmp_path, hang=(1, 12))
    assert run([str(p) for p in paths] + ["--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    (inc,) = doc["incidents"]
    assert inc["id"] == "inc-1" and inc["hosts"] == ["node0", "node1"]
    v = inc["verdicts"][0]
    assert {
        "kind",
        "ranks",
        "hosts",
        "pids",
        "comm_id_hash",
        "seq",
        "op",
        "summary",
        "evidence",
    } <= set(v)
    assert (v["kind"], v["ranks"], v["hosts"], v["seq"], v["op"]) == (
        "missing_rank",
        [1],
        ["node0"],
        12,
        "ALL_REDUCE",
    )
    assert v["comm_id_hash"] == "0x5eed000000000001"
    assert [i["ok"] for i in doc["inputs"]] == [True, True]


def test_bad_inputs_reported_rest_analyzed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = write(tmp_path, hang=(2, 20))
    data = good[0].read_bytes()
    (tmp_path / "truncated.msgpack").write_bytes(data[: len(data) // 2])
    (tmp_path / "foreign.msgpack").write_text("hello, not a dump\n")
    corrupt = bytearray(data)
    corrupt[40:60] = b"\xff" * 20
    (tmp_path / "corrupt.msgpack").write_bytes(bytes(corrupt))
    assert run([str(tmp_path), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    status = {Path(i["path"]).name: i for i in doc["inputs"]}
    for name in ("truncated.msgpack", "foreign.msgpack", "corrupt.msgpack"):
        assert status[name]["ok"] is False
        assert name in status[name]["error"]
    assert doc["incidents"][0]["verdicts"][0]["ranks"] == [2]


def test_nothing_readable_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a.msgpack").write_bytes(b"\x00\x01garbage")
    assert run([str(tmp_path / "a.msgpack"), str(tmp_path / "missing.msgpack")]) == 2
    out = capsys.readouterr().out
    assert "a.msgpack" in out and "missing.msgpack" in out


def test_progress_on_stderr_for_long_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from stallwatch.analyzer import load, progress
    from stallwatch.analyzer.pipeline import analyze_paths

    write(tmp_path)
    monkeypatch.setattr(progress, "PROGRESS_EVERY_S", 0.0)
    loaded, statuses = load.load_inputs([str(tmp_path)], progress=True)
    assert len(loaded) == 2 and all(s.ok for s in statuses)
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "stallwatch analyze: loaded 1/2 files",
        "stallwatch analyze: loaded 2/2 files",
    ]
    analyze_paths([str(tmp_path)], progress=True)  # rings are read after the rest
    assert "stallwatch analyze: read the NCCL calls of 2/2 dumps" in capsys.readouterr().err
    analyze_paths([str(tmp_path)], progress=False)
    assert not capsys.readouterr().err


def test_one_stall_named_twice_is_one_incident_and_two_stalls_stay_two(tmp_path: Path) -> None:
    from stallwatch.analyzer.align import Source
    from stallwatch.analyzer.pipeline import group_incidents

    a, b = recordings(with_(BASE_JOB, hang=(3, 30)))
    b = dataclasses.replace(b, trigger=dataclasses.replace(b.trigger, incident_id="other"))
    (inc,) = group_incidents([Source("a", a), Source("b", b)])
    assert inc.hosts == ("node0", "node1") and "other" in inc.id
    # the same host in both: two incidents of one job, kept apart
    a2 = dataclasses.replace(a, trigger=dataclasses.replace(a.trigger, incident_id="later"))
    assert len(group_incidents([Source("a", a), Source("a2", a2), Source("b", b)])) == 3


def test_through_the_stallwatch_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from stallwatch.cli import main

    write(tmp_path, crash=(1, 10, 9))
    assert main(["analyze", str(tmp_path)]) == 1
    assert "RANK_EXITED: rank 1 " in capsys.readouterr().out
    assert main(["analyze", str(tmp_path / "nothing-here")]) == 2


@pytest.mark.parametrize("node", [0, 1])
def test_a_dump_changed_during_analysis_is_lost_and_never_blamed(tmp_path: Path, node: int) -> None:
    """Rings are read when wanted: a file rewritten (or found damaged)
    between the two reads is a lost dump, its ranks judged from their peers
    alone.  Their calls only left out, its ranks looked behind: rank 0 (node
    0 rewritten) or ranks 2 and 3 (node 1) were blamed beside the hung rank 1."""
    from stallwatch.analyzer.load import load_inputs
    from stallwatch.analyzer.pipeline import analyze_incident, group_incidents

    paths = write(tmp_path, hang=(1, 12))
    loaded, statuses = load_inputs([str(tmp_path)], defer=("nccl",))
    assert all(s.ok for s in statuses)
    paths[node].write_bytes(paths[node].read_bytes()[:100])
    (inc,) = group_incidents(loaded, consume=True)
    (lost,) = inc.lost
    assert lost.path == str(paths[node]) and "changed since it was first read" in str(lost.error)
    assert len(inc.calls) > 0 and {p.host for p in inc.procs} == {f"node{1 - node}"}
    (v,) = analyze_incident(inc).verdicts
    if node == 0:  # the hung rank's own dump is lost: it cannot be told from its node's peer
        assert v.kind is VerdictKind.INCONCLUSIVE and set(v.ranks) == {0, 1}
    else:
        assert v.kind is VerdictKind.MISSING_RANK and v.ranks == (1,)


def test_deferred_and_in_memory_rings_give_one_answer(tmp_path: Path) -> None:
    from stallwatch.analyzer.load import load_inputs
    from stallwatch.analyzer.pipeline import analyze_incident, group_incidents

    write(tmp_path, hang=(2, 20))
    answers = []
    for defer in ((), ("nccl",)):
        loaded, _ = load_inputs([str(tmp_path)], defer=defer)
        (inc,) = group_incidents(loaded, consume=True)
        answers.append([v.to_json() for v in analyze_incident(inc).verdicts])
    assert answers[0] == answers[1] and answers[0][0]["ranks"] == [2]


def test_threads_do_not_change_the_calls_or_the_verdict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rings are read by several threads, each into its own run of the table;
    rows they drop (not calls) leave gaps that are closed.  One thread or
    three, the calls table and the verdicts are the same."""
    import numpy as np

    from stallwatch.analyzer.load import load_inputs
    from stallwatch.analyzer.pipeline import analyze_incident, group_incidents
    from stallwatch.dumpers.model import Ring
    from stallwatch.dumpers.schema import Op

    recs = recordings(with_(BASE_JOB, nodes=4, hang=(5, 17)))
    for i, rec in enumerate(recs):
        rows = rec.rings["nccl"].rows
        extra = rows[: 7 + i].copy()
        extra["op"] = Op.GROUP_START  # not calls: dropped as rings are read
        both = np.concatenate([rows, extra])
        rec.rings["nccl"] = Ring(both[np.argsort(both["ts_ns"], kind="stable")])
        write_dump(tmp_path, rec)
    results = []
    for n in ("1", "3"):
        monkeypatch.setenv("STALLWATCH_THREADS", n)
        loaded, _ = load_inputs([str(tmp_path)], defer=("nccl",))
        (inc,) = group_incidents(loaded, consume=True)
        results.append((inc, [v.to_json() for v in analyze_incident(inc).verdicts]))
    (one, v1), (three, v3) = results
    assert v1 == v3 and v1[0]["ranks"] == [5]
    assert one.calls.rows.names == three.calls.rows.names
    assert all(np.array_equal(one.calls.rows[k], three.calls.rows[k]) for k in one.calls.rows)
    assert not (one.calls.rows["op"] == Op.GROUP_START).any()

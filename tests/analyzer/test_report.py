"""What ``stallwatch analyze`` prints, for people and for programs, on real
lab dumps (tests/data/lab-hang-2x2: a 2x2 lab job whose rank 3 hung) and on
real PyTorch Flight Recorder dumps (16 ranks, shared fixtures)."""

from __future__ import annotations

import io
import json
import pickle
import re
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from stallwatch.analyzer import report
from stallwatch.analyzer.pipeline import AnalysisResult, analyze_paths
from stallwatch.analyzer.shortid import shorten
from stallwatch.dumpers.format import read_dump
from stallwatch.query.output import text_for

ROOT = Path(__file__).resolve().parents[2]
LAB = ROOT / "tests" / "data" / "lab-hang-2x2"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module")
def lab() -> AnalysisResult:
    return analyze_paths([str(LAB)])


@pytest.fixture(scope="module")
def fr_folder(fixtures_dir: Path) -> Path:
    return fixtures_dir / "pytorch-fr-nccl-16rank" / "gpu_error_1st"


@pytest.fixture(scope="module")
def fr(fr_folder: Path) -> AnalysisResult:
    return analyze_paths([str(fr_folder)])


def lines(result: AnalysisResult, show_all: bool = False, wide: bool = False) -> list[str]:
    return report.to_text(result, show_all, wide).splitlines()


def headers(out: list[str]) -> list[int]:
    return [i for i, line in enumerate(out) if line.startswith("  communicator ")]


def _wall(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")


# ---- order: verdict, time, unread inputs, tables -----------------------------


def test_lab_report_reads_verdict_then_time_then_tables(lab: AnalysisResult) -> None:
    out = lines(lab)
    assert out[0].startswith("incident ") and "2 hosts (node0, node1), 4 ranks" in out[0]
    # the first collective of its step that it alone misses: its tensor-parallel
    # partner's ALL_GATHER (the data-parallel ALL_REDUCE waits for it too)
    assert out[1].startswith("  MISSING_RANK: rank 3 never entered ALL_GATHER seq 12")
    (time,) = [i for i, line in enumerate(out) if line.startswith("  time: ")]
    assert 1 < time < headers(out)[0]
    # the time is the detecting agent's trigger, on the wall clock of its dump
    dumps = [read_dump(p) for p in sorted(LAB.glob("*.msgpack"))]
    seen = [
        (d.clock.to_wall_ns(d.trigger.time_ns), d.host, d.trigger.reason)
        for d in dumps
        if d.trigger is not None and d.trigger.kind.value != "peer"
    ]
    wall, host, reason = min(seen)  # the first agent that saw it itself
    assert f"time: {_wall(wall)}" in out[time] and f" UTC, detected by {host} (" in out[time]
    (r,) = lab.incidents  # its communicator's id as the report shortens them, whole with --wide
    assert shorten(reason, report.incident_ids(r)) in out[time] and reason not in out[time]
    assert reason in lines(lab, wide=True)[time]
    tables = json.loads(report.to_json(lab))["incidents"][0]["communicators"]
    assert all(t["short_id"] == report.incident_ids(r)[t["comm_id_hash"]] for t in tables)
    assert {t["short_id"] for t in tables} == set(report.incident_ids(r).values())


def test_fr_report_time_is_the_latest_entry(fr: AnalysisResult, fr_folder: Path) -> None:
    latest = 0
    for p in fr_folder.iterdir():
        doc = _unpickle(p)
        latest = max([latest, *(e.get("time_created_ns") or 0 for e in doc["entries"])])
    (time,) = [line for line in lines(fr) if line.startswith("  time: ")]
    assert time.startswith(f"  time: {_wall(latest)}") and "the latest entry" in time


def _unpickle(path: Path) -> dict[str, Any]:
    class DataOnly(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            raise pickle.UnpicklingError(f"{module}.{name}")

    doc: dict[str, Any] = DataOnly(io.BytesIO(path.read_bytes())).load()
    return doc


def test_unread_inputs_come_before_the_verdict_and_the_tables(tmp_path: Path) -> None:
    """The verdicts were reached without them: that is said first."""
    for p in LAB.glob("*.msgpack"):
        shutil.copy(p, tmp_path / p.name)
    (tmp_path / "node9.msgpack").write_bytes(b"\x00 not a dump")
    result = analyze_paths([str(tmp_path)])
    out = lines(result)
    (at,) = [i for i, line in enumerate(out) if line.startswith("  inputs not read")]
    assert out[at] == "  inputs not read (1 of 3):"
    assert "node9.msgpack" in out[at + 1] and out[at + 1].startswith("    - ")
    verdict = next(i for i, line in enumerate(out) if "MISSING_RANK" in line)
    assert at < verdict < headers(out)[0]


# ---- lists for people, (stuck) only where stuck, a reason beside behind ----


@pytest.mark.parametrize("which", ["lab", "fr"])
def test_no_python_lists_in_the_report(which: str, request: pytest.FixtureRequest) -> None:
    text = report.to_text(request.getfixturevalue(which), show_all=True)
    assert not re.search(r"\[\d|\['|\(\d+\)", text), "a Python repr or an unexplained (n)"
    where = [line for line in text.splitlines() if line.startswith("    rank")]
    assert where and all("; " in w or w.startswith("    rank ") for w in where)


def test_the_culprits_line_lists_plainly(lab: AnalysisResult, fr: AnalysisResult) -> None:
    assert "    rank 3; host node1; pid 10265; comm 0x" in lines(lab)[2]
    out = lines(fr)
    # no pid: the files have none (12 stopped; 14's GPU completed less)
    assert out[2].startswith("    ranks 12, 14; files _dump_12, _dump_14; comm 0x")


@pytest.mark.parametrize("which", ["lab", "fr"])
def test_stuck_only_where_a_rank_waits(which: str, request: pytest.FixtureRequest) -> None:
    result: AnalysisResult = request.getfixturevalue(which)
    (r,) = result.incidents
    tables = report.comm_tables(r)
    assert {t.status for t in tables} >= {"stuck"}
    for t in tables:
        waiting = t.laggards or any(m.in_flight and m.reason == "" for m in t.members)
        assert (t.status == "stuck") == bool(waiting), t.comm_id_hash
    text = report.to_text(result, show_all=True, wide=True)
    for t in tables:
        (head,) = [
            line
            for line in text.splitlines()
            if line.startswith(f"  communicator {t.comm_id_hash}")
        ]
        assert ("stuck" in head) == (t.status == "stuck")
    if which == "lab":  # the world communicator: every rank returned from seq 11
        idle = [t for t in tables if t.status == "idle"]
        assert idle and all(m.state == "at frontier, returned" for t in idle for m in t.members)


@pytest.mark.parametrize("which", ["lab", "fr"])
def test_a_reason_beside_every_rank_behind(which: str, request: pytest.FixtureRequest) -> None:
    result: AnalysisResult = request.getfixturevalue(which)
    (r,) = result.incidents
    behind = [m for t in report.comm_tables(r) for m in t.members if m.state == "behind"]
    # a culprit's row says so, and why, from its verdict's evidence
    assert behind and all(
        m.reason.startswith(("last call ", "exited"))
        or (m.culprit and m.reason.startswith(f"CULPRIT ({m.culprit}): "))
        for m in behind
    )
    text = report.to_text(result, show_all=True)
    rows = [line for line in text.splitlines() if re.search(r"\sbehind\s", line)]
    assert len(rows) == len(behind) and all("last call " in row for row in rows)


def test_the_lab_reason_says_where_the_rank_waits(lab: AnalysisResult) -> None:
    (r,) = lab.incidents
    by_comm = {t.comm_id_hash: t for t in report.comm_tables(r)}
    frontier = by_comm["0x91ef9ed60ece528c"]  # rank 2 is behind: it waits in the tp split
    (m,) = [m for m in frontier.members if m.state == "behind"]
    assert m.world_rank == 2
    assert re.fullmatch(
        r"last call ALL_GATHER seq 12 on 0xcd5090e17828ee10, in flight \(entered \d+\.\d s ago\)",
        m.reason,
    )


# ---- --all ------------------------------------------------------------------


def test_all_shows_every_communicator(fr: AnalysisResult) -> None:
    (r,) = fr.incidents
    total = len(r.frontiers)
    short, full = lines(fr), lines(fr, show_all=True)
    assert len(headers(short)) == report.MAX_TABLES < total == len(headers(full))
    hidden = total - report.MAX_TABLES
    assert f"  ({hidden} more communicators not shown; --all shows them)" in short
    assert not any("not shown" in line for line in full)


def test_all_shows_every_rank(lab: AnalysisResult, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(report, "MAX_TABLE_ROWS", 1)
    short, full = lines(lab), lines(lab, show_all=True)
    assert "    ... 3 more ranks, 0 of them not at the frontier" in short
    assert not any(line.startswith("    ... ") for line in full)
    assert len(full) > len(short)


def test_the_cli_takes_all(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from stallwatch.cli import main

    assert main(["analyze", str(LAB), "--all"]) == 1
    assert capsys.readouterr().out.count("  communicator ") == 5


# ---- JSON ----------------------------------------------------------------------


@pytest.mark.parametrize("which", ["lab", "fr"])
def test_json_has_the_communicator_tables(which: str, request: pytest.FixtureRequest) -> None:
    result: AnalysisResult = request.getfixturevalue(which)
    doc = json.loads(report.to_json(result))
    (inc,) = doc["incidents"]
    (r,) = result.incidents
    assert len(inc["communicators"]) == len(r.frontiers)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", inc["time"])
    for c in inc["communicators"]:
        assert re.fullmatch(r"0x[0-9a-f]{16}", c["comm_id_hash"])
        assert c["status"] in ("stuck", "idle", "moving") and c["nranks"] == len(c["members"])
        for m in c["members"]:
            assert set(m) >= {"rank", "world_rank", "host", "pid", "state", "reason"}
            assert (m["state"] == "behind") <= bool(m["reason"])
    if which == "fr":
        assert inc["kind"] == "flight_recorder" and inc["detected_by"] is None
        groups = {c["group"] for c in inc["communicators"]}
        assert "group 41: TENSOR_MODEL_PARALLEL_GROUP" in groups
        assert all(m["pid"] is None for c in inc["communicators"] for m in c["members"])
    else:
        assert inc["kind"] == "stallwatch" and inc["detected_by"].startswith("node0 (")


# ---- Flight Recorder: ranks and groups as the files name them ------------------


def test_fr_names_files_ranks_and_groups(fr: AnalysisResult, fr_folder: Path) -> None:
    out = lines(fr, show_all=True)
    n = len(list(fr_folder.iterdir()))
    assert out[0] == f"incident gpu_error_1st: {n} Flight Recorder files, 16 ranks"
    assert "host" not in out[0] and "pid 0" not in "\n".join(out)
    desc = {}
    for p in fr_folder.iterdir():
        desc.update({n: c["desc"] for n, c in _unpickle(p)["pg_config"].items()})
    heads = [out[i] for i in headers(out)]
    for head in heads:
        found = re.match(r"  communicator 0x[0-9a-f]{4} \(group (\w+): (\w+)\): \d+ ranks", head)
        assert found is not None and desc[found[1]] == found[2], head
    assert any("(group 58: TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP)" in h for h in heads)
    table = out[headers(out)[0] + 1].split()
    assert "file" in table and "host" not in table and "pid" not in table
    assert any(line.split()[:3] == ["0", "12", "_dump_12"] for line in out)


# ---- terminal or not -------------------------------------------------------


def test_rich_on_a_terminal_plain_text_elsewhere(lab: AnalysisResult) -> None:
    def draw(c: Any) -> None:
        report.render(c, lab)

    plain = text_for(draw, io.StringIO())
    assert "\x1b[" not in plain and "─" not in plain
    assert plain == report.to_text(lab)
    boxed = text_for(draw, Terminal())
    assert "\x1b[" in boxed and "─" in boxed  # colours, rich's box
    assert "MISSING_RANK" in boxed


def test_progress_is_a_bar_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    from stallwatch.analyzer import progress

    err = Terminal()
    monkeypatch.setattr(progress.sys, "stderr", err)
    shown = progress.Progress("loaded {}/{} files", 3, True)
    for _ in range(3):
        shown.step()
    shown.close()
    assert "stallwatch analyze: loaded files" in err.getvalue() and "3/3" in err.getvalue()

"""``stallwatch export --perfetto``: the file is valid trace-event JSON and
every recorded NCCL call is one slice, on synthetic recordings and on the
dumps of a real lab run."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest

from stallwatch.analyzer.export import export
from stallwatch.analyzer.perfetto import Marker, build_trace, write_trace
from stallwatch.cli import main
from stallwatch.dumpers.format import read_dump, write_dump
from stallwatch.dumpers.model import Recording
from stallwatch.dumpers.schema import TcpEvent, op_name
from tests.analyzer.synth import Job, recordings

ROOT = Path(__file__).resolve().parents[2]
METADATA_NAMES = {"process_name", "thread_name", "process_sort_index", "thread_sort_index"}
Event = dict[str, Any]  # parsed JSON


# --- checks against the trace-event format -------------------------------------


def check_trace_format(doc: object) -> list[Event]:
    """Raise AssertionError where the document departs from the trace-event
    format (the JSON object form); return its events."""
    assert isinstance(doc, dict) and isinstance(doc.get("traceEvents"), list)
    events: list[Event] = doc["traceEvents"]
    named_procs: set[int] = set()
    named_threads: set[tuple[int, int]] = set()
    for e in events:
        assert isinstance(e, dict), e
        assert isinstance(e.get("name"), str) and isinstance(e.get("ph"), str), e
        assert type(e.get("pid")) is int and type(e.get("tid")) is int, e
        ph = e["ph"]
        if ph == "M":
            assert e["name"] in METADATA_NAMES and isinstance(e["args"], dict), e
            if e["name"].endswith("_sort_index"):
                assert type(e["args"]["sort_index"]) is int, e
                continue
            assert isinstance(e["args"]["name"], str), e
            if e["name"] == "process_name":
                named_procs.add(e["pid"])
            else:
                named_threads.add((e["pid"], e["tid"]))
            continue
        assert isinstance(e.get("ts"), int | float) and not isinstance(e["ts"], bool), e
        if ph == "X":
            assert isinstance(e.get("dur"), int | float) and e["dur"] >= 0, e
        elif ph in ("i", "I"):
            assert e.get("s", "t") in ("g", "p", "t"), e
        else:
            raise AssertionError(f"unexpected phase {ph!r}: {e}")
        if "args" in e:
            assert isinstance(e["args"], dict), e
    for e in events:  # every drawn track and process is named
        if e["ph"] == "X" or (e["ph"] == "i" and e.get("s") == "t"):
            assert e["pid"] in named_procs and (e["pid"], e["tid"]) in named_threads, e
    return events


def host_names(events: Iterable[Event]) -> dict[int, str]:
    return {
        int(e["pid"]): str(e["args"]["name"])
        for e in events
        if e["ph"] == "M" and e["name"] == "process_name"
    }


def slice_keys(events: Sequence[Event]) -> Counter[tuple[str, int, int, int, str, int]]:
    hosts = host_names(events)
    out: Counter[tuple[str, int, int, int, str, int]] = Counter()
    for e in events:
        if e["ph"] == "X" and e.get("cat") == "nccl":
            a: dict[str, Any] = e["args"]
            key = (hosts[int(e["pid"])], a["pid"], a["tid"], a["host_ts_ns"], a["op"], a["seq"])
            out[key] += 1
    return out


def row_keys(recs: Iterable[Recording]) -> Counter[tuple[str, int, int, int, str, int]]:
    out: Counter[tuple[str, int, int, int, str, int]] = Counter()
    for rec in recs:
        if "nccl" not in rec.rings:
            continue
        for r in rec.rings["nccl"].rows:
            key = (rec.host, int(r["pid"]), int(r["tid"]), int(r["ts_ns"]))
            out[(*key, op_name(int(r["op"])), int(r["seq"]))] += 1
    return out


def assert_every_call_once(events: Sequence[Event], recs: Sequence[Recording]) -> None:
    rows = row_keys(recs)
    assert sum(rows.values()) > 0
    assert slice_keys(events) == rows


# --- synthetic recordings (fast) -------------------------------------------------


def test_synthetic_job_every_call_is_one_slice_on_its_rank_track(tmp_path: Path) -> None:
    recs = recordings(Job(nodes=2, ranks_per_node=2, steps=12, hang=(3, 9)))
    out = tmp_path / "trace.json"
    write_trace(out, build_trace(recs, [Marker("missing_rank", "rank 3", ("node1",), (3,))]))
    events = check_trace_format(json.loads(out.read_text()))
    assert_every_call_once(events, recs)
    hosts = host_names(events)
    assert sorted(hosts.values()) == ["node0", "node1"]
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"
    }
    for e in events:
        if e["ph"] == "X":
            a = e["args"]
            assert f"pid {a['pid']}" in threads[(e["pid"], e["tid"])]
            assert a["comm_id_hash"] in threads[(e["pid"], e["tid"])]
            assert {"op", "seq", "bytes", "state"} <= set(a)


def test_slices_carry_sqls_times_and_a_dump_without_a_clock_pair_is_named() -> None:
    """A slice's ``ts_ns`` is SQL's ``timestamp_ns`` (the incident's clock),
    ``host_ts_ns`` the host's own stamp, and the slice is drawn at ``ts_ns``.
    A dump without its clock pair is drawn on its own clock, its host named
    so, its ``ts_ns`` unknown."""
    good, lost = recordings(Job(nodes=2, steps=6))
    lost = dataclasses.replace(lost, clock=dataclasses.replace(lost.clock, realtime_ns=0))
    events = check_trace_format(build_trace([good, lost]))
    hosts = host_names(events)
    assert sorted(hosts.values()) == [good.host, f"{lost.host} (no clock pair)"]
    offset = good.clock.realtime_ns - good.clock.monotonic_ns
    slices = [e for e in events if e["ph"] == "X" and e["cat"] == "nccl"]
    for e in slices:
        a = e["args"]
        if hosts[int(e["pid"])] == good.host:
            assert a["ts_ns"] == a["host_ts_ns"] + offset
            assert e["ts"] == pytest.approx(a["ts_ns"] / 1e3)
        else:
            assert a["ts_ns"] is None and e["ts"] == pytest.approx(a["host_ts_ns"] / 1e3)
    assert {hosts[int(e["pid"])] for e in slices} == set(hosts.values())


def test_kernel_events_are_instants_on_the_owning_ranks_track() -> None:
    recs = recordings(Job(steps=20, loss_node=1, cpuhog=2))
    events = check_trace_format(build_trace(recs))
    hosts = host_names(events)
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"
    }
    kernel = [e for e in events if e["ph"] == "i" and e["cat"] in ("tcp", "sched")]
    expected = sum(
        int((r.rings["tcp"].rows["event"] == TcpEvent.TCP_RETRANSMIT_SKB).sum())
        + len(r.rings["sched"].rows)
        for r in recs
    )
    assert expected > 0 and len(kernel) == expected
    owners = {(rec.host, int(p)) for rec in recs for p in rec.rings["sched"].rows["pid"]}
    for e in kernel:
        assert e["s"] == "t"
        label = str(threads[(e["pid"], e["tid"])])
        if e["cat"] == "sched":
            pid = int(label.split("pid ")[1].split(")")[0])
            assert (hosts[int(e["pid"])], pid) in owners


def test_verdict_markers_on_the_timeline_and_on_their_hosts() -> None:
    recs = recordings(Job(nodes=2, steps=8, hang=(1, 5)))
    marker = Marker("missing_rank", "rank 1 never entered", ("node0",), (1,))
    events = check_trace_format(build_trace(recs, [marker]))
    marks = [e for e in events if e.get("cat") == "verdict"]
    assert {e["s"] for e in marks} == {"g", "p"}
    node0 = next(p for p, h in host_names(events).items() if h == "node0")
    assert [e["pid"] for e in marks if e["s"] == "p"] == [node0]
    last_call = max(float(e["ts"]) for e in events if e["ph"] == "X")
    assert all(float(e["ts"]) >= last_call for e in marks)


def test_export_command_reads_dumps_and_adds_the_analyzers_verdicts(tmp_path: Path) -> None:
    recs = recordings(Job(nodes=2, ranks_per_node=2, steps=12, hang=(2, 7)))
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    for rec in recs:
        write_dump(dumps / f"{rec.host}.msgpack", rec)
    (dumps / "broken.msgpack").write_bytes(b"\x93not a dump")
    out = tmp_path / "trace.json"
    result = export([str(dumps)], out)
    assert [s.ok for s in result.inputs].count(False) == 1
    events = check_trace_format(json.loads(out.read_text()))
    assert_every_call_once(events, [read_dump(p) for p in sorted(dumps.glob("node*"))])
    verdicts = [e for e in events if e.get("cat") == "verdict" and e["s"] == "g"]
    missing = [e for e in verdicts if e["name"] == "verdict: missing_rank"]
    assert len(missing) == 1 and missing[0]["args"]["ranks"] == [2]


CORPUS = ROOT / "tests" / "data" / "fr-torch"


@pytest.mark.parametrize("form", ["pickle", "json"])
def test_flight_recorder_dumps_are_drawn(
    form: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every entry of every rank's Flight Recorder dump is one slice on its
    rank's track, at its wall-clock time; the analyzer's verdict is marked."""
    import pickle as pk

    folder = CORPUS / "allreduce-hang-4" / form
    out = tmp_path / "trace.json"
    assert main(["export", "--perfetto", str(folder), "-o", str(out)]) == 0
    assert "15 NCCL call(s)" in capsys.readouterr().out  # 4 all_reduces each, 3 on rank 2
    events = check_trace_format(json.loads(out.read_text()))
    hosts = host_names(events)
    assert sorted(hosts.values()) == sorted(p.name for p in folder.iterdir())
    entries = Counter()
    for p in sorted((CORPUS / "allreduce-hang-4" / "pickle").iterdir()):
        with open(p, "rb") as f:
            doc = pk.load(f)  # trusted test data: our reader's result is compared with it
        for e in doc["entries"]:
            if e["profiling_name"] != "gloo:barrier":
                entries[(p.name, e["time_created_ns"], e["collective_seq_id"])] += 1
    drawn = Counter(
        (hosts[int(e["pid"])].removesuffix(".json"), e["args"]["ts_ns"], e["args"]["seq"])
        for e in events
        if e["ph"] == "X"
    )
    assert drawn == entries and sum(drawn.values()) == 15
    marks = [e for e in events if e.get("cat") == "verdict" and e["s"] == "g"]
    assert [e["name"] for e in marks] == ["verdict: missing_rank"]
    assert marks[0]["args"]["ranks"] == [2]


def test_export_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.msgpack"
    bad.write_bytes(b"garbage")
    assert main(["export", "--perfetto", str(bad), "-o", str(tmp_path / "t.json")]) == 2
    assert "bad.msgpack" in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()
    rec = recordings(Job(steps=4))[0]
    write_dump(tmp_path / "ok.msgpack", rec)
    args = [str(tmp_path / "ok.msgpack"), "-o", str(tmp_path / "t.json")]
    assert main(["export", "--perfetto", *args]) == 0
    capsys.readouterr()
    args = [str(tmp_path / "ok.msgpack"), str(bad), "-o", str(tmp_path / "t.json")]
    assert main(["export", "--perfetto", *args]) == 1  # written, an input skipped
    captured = capsys.readouterr()
    assert "skipped" in captured.err and "bad.msgpack" in captured.err
    assert "ui.perfetto.dev" in captured.out
    with pytest.raises(SystemExit) as usage:
        main(["export", "--perfetto", str(bad)])  # no -o
    assert usage.value.code == 2


# --- a real lab run ----------------------------------------------------------------


@pytest.mark.lab
def test_export_of_a_recorded_lab_hang(tmp_path: Path) -> None:
    dumps = tmp_path / "dumps"
    lab = [sys.executable, "-m", "stallwatch", "lab", "run", "--nodes", "2", "--steps", "12"]
    lab += ["--fault", "hang:rank=3,step=6", "--record", "--dump-dir", str(dumps)]
    lab += ["--stall-timeout", "3"]
    ran = subprocess.run(lab, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert ran.returncode == 1, ran.stderr
    files = sorted(dumps.rglob("*.msgpack"))
    assert len(files) == 2, ran.stdout + ran.stderr
    out = tmp_path / "trace.json"
    cmd = [sys.executable, "-m", "stallwatch", "export", "--perfetto", str(dumps), "-o", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    events = check_trace_format(json.loads(out.read_text()))
    assert_every_call_once(events, [read_dump(f) for f in files])
    kinds = {e["name"] for e in events if e.get("cat") == "verdict"}
    assert "verdict: missing_rank" in kinds
    assert os.path.getsize(out) > 0

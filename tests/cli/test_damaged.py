"""A damaged dump, through every command that reads dumps: refused with one
line naming the file and the damaged section, the others read, exit 1; the
analysis goes on as for a lost dump, and never blames one of its ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stallwatch.commands.main import main
from stallwatch.dumpers import format as fmt
from stallwatch.dumpers.format import write_dump
from tests.analyzer.synth import BASE_JOB, recordings, with_


def _hang(tmp: Path) -> list[Path]:
    """Rank 1 (node 0) hangs at step 12; ranks 2 and 3 are node 1's."""
    return [write_dump(tmp, r) for r in recordings(with_(BASE_JOB, hang=(1, 12)))]


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def _damage_latest_row(path: Path) -> None:
    """A bit of the count of the ring's latest NCCL row: a row the analyzer reads."""
    _, deferred = fmt.read_dump_deferred(path, ["nccl"])
    ring = deferred["nccl"]
    _flip(path, ring.offset + ring.nbytes - 160 + 40)


def _one_line(err: str, command: str, path: Path, section: str) -> None:
    lines = [line for line in err.splitlines() if "damaged" in line]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"stallwatch {command}: skipped {path}: {section}: damaged (")


def test_analyze_leaves_a_damaged_dump_out_and_blames_none_of_its_ranks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = _hang(tmp_path)
    _damage_latest_row(paths[1])
    assert main(["analyze", str(tmp_path), "--json"]) == 1
    out, err = capsys.readouterr()
    _one_line(err, "analyze", paths[1], "rings.nccl")
    doc = json.loads(out)
    lost = [i for i in doc["inputs"] if not i["ok"]]
    assert [i["path"] for i in lost] == [str(paths[1])] and "rings.nccl: damaged" in lost[0][
        "error"
    ]
    assert all(i["checked"] for i in doc["inputs"] if i["ok"])
    (inc,) = doc["incidents"]
    blamed = {r for v in inc["verdicts"] if v["kind"] != "inconclusive" for r in v["ranks"]}
    assert blamed == {1}


def test_a_damaged_header_is_refused_as_the_dump_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = _hang(tmp_path)
    _flip(paths[0], paths[0].read_bytes().index(b"node0") + 2)
    assert main(["analyze", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    # the report names it, once; stderr only with --json (one line per failure)
    assert "damaged" not in err, err
    assert "inputs not read (1 of 2)" in out and out.count(f"{paths[0]}: header: damaged") == 1


def test_query_and_export_say_the_same(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = _hang(tmp_path)
    _damage_latest_row(paths[1])
    sql = "SELECT host, count(*) AS n FROM nccl_events GROUP BY host"
    assert main(["query", str(tmp_path), sql, "--format", "csv"]) == 1
    out, err = capsys.readouterr()
    _one_line(err, "query", paths[1], "rings.nccl")
    assert out.splitlines()[0] == "host,n" and [r.split(",")[0] for r in out.splitlines()[1:]] == [
        "node0"
    ]
    trace = tmp_path / "trace.json"
    assert main(["export", "--perfetto", *map(str, paths), "-o", str(trace)]) == 1
    _one_line(capsys.readouterr().err, "export", paths[1], "rings.nccl")
    parquet = tmp_path / "pq"
    assert main(["export", "--parquet", *map(str, paths), "-o", str(parquet)]) == 1
    _one_line(capsys.readouterr().err, "export", paths[1], "rings.nccl")
    hosts = sorted(p.name for p in parquet.glob("nccl_events/*/host=*"))
    assert hosts == ["host=node0"]

"""Text from an input reaches a terminal escaped: a dump request's reason
(anyone on loopback can set it), a host name or a file name holding a newline
and escape codes prints as text, never as a verdict line of its own or a
colour, in every report; JSON stays JSON (escaped by its own rules)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from stallwatch.commands.main import main
from stallwatch.dumpers.format import write_dump
from stallwatch.query.output import printable
from tests.analyzer.synth import BASE_JOB, recordings, with_

REASON = "x\n  MISSING_RANK: rank 0 is \x1b[31mthe culprit\x1b[0m\r\x07"
HOST_TAIL = "\x1b]0;owned\x07"


def test_printable_escapes_controls_and_keeps_other_text() -> None:
    assert printable("a\nb\tc\r\x1b[2J\x7f\x9b") == "a\\nb\\tc\\r\\x1b[2J\\x7f\\x9b"
    assert printable("rank\u202eevil\u200b") == "rank\\u202eevil\\u200b"
    assert printable("nœud-7 ノード /tmp/a b") == "nœud-7 ノード /tmp/a b"


def _dumps(tmp: Path) -> list[Path]:
    out = []
    for rec in recordings(with_(BASE_JOB, hang=(1, 12))):
        assert rec.trigger is not None
        trigger = dataclasses.replace(rec.trigger, reason=REASON)
        out.append(write_dump(tmp, dataclasses.replace(rec, trigger=trigger)))
    (tmp / "evil\n\x1b[2J.msgpack").write_bytes(b"\x85junk")  # a lost input's name
    return out


def test_a_reason_with_escape_codes_prints_escaped_in_analyze(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _dumps(tmp_path)
    assert main(["analyze", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert "\x1b" not in out + err and "\x07" not in out + err and "\r" not in out + err
    verdicts = [line for line in out.splitlines() if line.strip().startswith("MISSING_RANK")]
    assert len(verdicts) == 1 and verdicts[0].strip().startswith("MISSING_RANK: rank 1 ")
    assert "(x\\n  MISSING_RANK: rank 0 is \\x1b[31mthe culprit\\x1b[0m\\r\\x07)" in out
    (lost,) = [line for line in out.splitlines() if "evil" in line]  # the report names it
    assert "evil\\n\\x1b[2J.msgpack" in lost


def test_json_keeps_the_text_as_it_is(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _dumps(tmp_path)
    assert main(["analyze", str(tmp_path), "--json"]) == 1
    out = capsys.readouterr().out
    assert "\x1b" not in out  # JSON escapes controls itself ("\u001b")
    assert REASON in json.loads(out)["incidents"][0]["detected_by"]


def test_query_escapes_a_host_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for rec in recordings(with_(BASE_JOB)):
        write_dump(tmp_path, dataclasses.replace(rec, host=rec.host + HOST_TAIL))
    sql = "SELECT DISTINCT host FROM nccl_events ORDER BY host"
    assert main(["query", str(tmp_path), sql]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "node0\\x1b]0;owned\\x07" in out
    assert main(["analyze", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "node1\\x1b]0;owned\\x07" in out

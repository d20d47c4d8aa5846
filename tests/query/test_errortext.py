"""A failed query says what DuckDB says, line by line, and an unknown table
is answered with the tables a query can read, never DuckDB's guess among
its own catalog."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from stallwatch.dumpers.sqltables import TABLE_NAMES
from stallwatch.query.errortext import error_lines

ROOT = Path(__file__).resolve().parents[2]
DUMPS = ROOT / "tests" / "data" / "lab-hang-2x2"


def unknown(name: str, guess: str) -> str:
    return (
        f'Catalog Error: Table with name {name} does not exist!\nDid you mean "{guess}"?\n\n'
        f"LINE 1: SELECT * FROM {name}\n                      ^^^"
    )


def test_an_unknown_table_near_one_of_ours_is_named_as_ours() -> None:
    lines = error_lines(unknown("nccl_event", "pg_depend"))
    assert lines[1] == 'Did you mean "nccl_events"?'
    assert not any("pg_depend" in line for line in lines)
    assert lines[2:] == ["LINE 1: SELECT * FROM nccl_event", "                      ^^^"]


def test_an_unknown_table_near_none_lists_every_table() -> None:
    lines = error_lines(unknown("foo", "duckdb_columns"))
    assert lines[1] == f"The tables: {', '.join(TABLE_NAMES)}."
    assert not any("duckdb_columns" in line for line in lines)


def test_other_errors_keep_their_lines_and_guesses() -> None:
    text = 'Binder Error: Referenced column "nope" not found!\nCandidate bindings: "host"\n\nX'
    assert error_lines(text) == [
        'Binder Error: Referenced column "nope" not found!',
        'Candidate bindings: "host"',
        "X",
    ]
    assert error_lines("one line") == ["one line"]


def query(sql: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "stallwatch", "query", str(DUMPS), sql]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_the_command_prints_one_message_in_real_lines() -> None:
    done = query("SELECT host FROM nccl_event")
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.splitlines()  # notes on the inputs come first
    err = lines[next(i for i, line in enumerate(lines) if "error:" in line) :]
    assert (
        err[0]
        == "stallwatch query: error: Catalog Error: Table with name nccl_event does not exist!"
    )
    assert err[1:] == [
        '  Did you mean "nccl_events"?',
        "  LINE 1: SELECT host FROM nccl_event",
        "                           ^^^^^^^^^^",
    ], err
    assert "\\n" not in done.stderr
    syntax = query("SELEC 1")
    assert syntax.returncode == 2 and "\\n" not in syntax.stderr
    assert syntax.stderr.splitlines()[-2:] == ["  LINE 1: SELEC 1", "          ^^^^^"]

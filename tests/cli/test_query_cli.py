"""``stallwatch query`` on dumps and agents, and ``stallwatch serve``."""

from __future__ import annotations

import csv
import io
import json
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bench.bench_sql import SEED_QUERY, Synthetic, synthetic_recording
from stallwatch.commands import main as cli
from stallwatch.dumpers.format import read_dump, write_dump
from stallwatch.query.sql import LOCAL, QueryEngine

Run = Callable[..., tuple[int, str, str]]

# The query/serve commands alone, so that these tests do not depend on the
# other parts' commands importing.
DRIVER = (
    "import sys, stallwatch.commands.main as c; "
    "c.COMMAND_MODULES = ('stallwatch.commands.query', 'stallwatch.commands.serve'); "
    "sys.exit(c.main(sys.argv[1:]))"
)


@pytest.fixture
def run(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Iterator[Run]:
    monkeypatch.setattr(
        cli, "COMMAND_MODULES", ("stallwatch.commands.query", "stallwatch.commands.serve")
    )

    def invoke(*argv: str) -> tuple[int, str, str]:
        code = cli.main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    yield invoke


@pytest.fixture(scope="module")
def dump_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("dumps")
    for i in range(3):
        rec = synthetic_recording(
            Synthetic(host=f"node{i}", first_rank=4 * i, steps=50, tcp_rows=300 if i == 1 else 0)
        )
        write_dump(folder, rec)
    return folder


def test_query_on_a_folder_prints_an_aligned_table(run: Run, dump_dir: Path) -> None:
    code, out, err = run(
        "query",
        str(dump_dir),
        "SELECT host, count(*) AS n FROM nccl_events GROUP BY host ORDER BY host",
    )
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["host", "n"]
    assert set(lines[1]) == {"-", " "}
    assert [line.split() for line in lines[2:5]] == [[f"node{i}", "201"] for i in range(3)]
    assert lines[-1] == "(3 rows)"
    assert len({len(line) for line in lines[:5]}) == 1  # aligned


def test_query_seed_as_json_matches_the_engine(run: Run, dump_dir: Path) -> None:
    files = sorted(str(p) for p in dump_dir.iterdir())
    code, out, _ = run("query", files[1], SEED_QUERY, "--format", "json")
    assert code == 0
    doc = json.loads(out)
    with QueryEngine([read_dump(files[1])], LOCAL) as engine:
        expected = engine.query(SEED_QUERY)
    assert doc["columns"] == list(expected.columns)
    assert sorted(tuple(r) for r in doc["rows"]) == sorted(expected.rows)  # ties: any order
    assert sum(r[2] for r in doc["rows"]) > 0


def test_query_csv(run: Run, dump_dir: Path) -> None:
    code, out, _ = run(
        "query",
        str(dump_dir),
        "SELECT host, duration_ns FROM nccl_events WHERE state = 'scheduled' ORDER BY host",
        "--format",
        "csv",
    )
    assert code == 0
    rows = list(csv.reader(io.StringIO(out)))
    assert rows == [["host", "duration_ns"]] + [[f"node{i}", ""] for i in range(3)]


def test_query_skips_a_file_that_is_not_a_dump(run: Run, dump_dir: Path, tmp_path: Path) -> None:
    """As analyze and export do: a dump that cannot be read is named and
    skipped (exit 1); a file that is no dump at all is named and ignored."""
    bad = tmp_path / "notes.msgpack"
    bad.write_text("hello")
    good = next(dump_dir.iterdir())
    code, out, err = run("query", str(good), str(bad), "SELECT count(*) FROM nccl_events")
    assert code == 1 and out.strip()
    assert f"skipped {bad}" in err and "Traceback" not in err
    foreign = tmp_path / "expected.json"
    foreign.write_text('{"scenario": "hang"}')
    code, out, err = run("query", str(good), str(foreign), "SELECT count(*) FROM nccl_events")
    assert code == 0 and out.strip()
    assert f"ignored {foreign}" in err
    code, out, err = run("query", str(bad), "SELECT count(*) FROM nccl_events")
    assert code == 2 and out == "" and "no readable dump" in err
    code, out, err = run(
        "query", str(good), str(bad), "SELECT count(*) AS n FROM nccl_events", "--skip-bad"
    )
    assert code == 1
    assert f"skipped {bad}" in err
    assert out.splitlines()[2].strip() == "201"


CORPUS = Path(__file__).resolve().parents[1] / "data" / "fr-torch"


@pytest.mark.parametrize("form", ["pickle", "json"])
def test_query_reads_flight_recorder_dumps(run: Run, form: str, tmp_path: Path) -> None:
    """Their entries are nccl_events rows, host the file they came from, rank
    and nranks in their process group; an unreadable one is skipped and
    named, and the exit code says the result is partial."""
    folder = CORPUS / "rooted-hang-4" / form
    sql = (
        "SELECT host, rank, nranks, op, count(*) AS n, max(seq) AS last, "
        "sum(CASE WHEN end_ns IS NULL THEN 1 ELSE 0 END) AS pending "
        "FROM nccl_events GROUP BY ALL ORDER BY host, op"
    )
    code, out, err = run("query", str(folder), sql, "--format", "json")
    assert code == 0, err
    rows = json.loads(out)["rows"]
    hosts = sorted(p.name for p in folder.iterdir())
    assert sorted({r[0] for r in rows}) == hosts
    assert {(r[1], r[2]) for r in rows} == {(0, 4), (1, 4), (2, 4), (3, 4)}
    ops = {r[3] for r in rows}
    assert ops >= {"BROADCAST", "REDUCE", "SCATTER", "GATHER"}
    # rank 2 stopped before the last gather (seq 12); its root, rank 1, waits
    # in it; ranks 0 and 3 went on to the final barrier (seq 13).  gloo does
    # not tell a failed call from one that succeeded: each rank's last call
    # is pending, the ones before it completed.
    last = {k: max(r[5] for r in rows if r[1] == k) for k in range(4)}
    assert last == {0: 13, 1: 12, 2: 11, 3: 13}
    pending = {k: sum(r[6] for r in rows if r[1] == k) for k in range(4)}
    assert pending == {0: 1, 1: 1, 2: 1, 3: 1}
    lost = tmp_path / "lost"
    lost.mkdir()
    for p in folder.iterdir():
        (lost / p.name).write_bytes(p.read_bytes())
    broken = sorted(lost.iterdir())[0]
    broken.write_bytes(broken.read_bytes()[:40])
    code, out, err = run("query", str(lost), "SELECT count(*) FROM nccl_events", "--skip-bad")
    assert code == 1 and broken.name in err
    code, _, err = run("query", str(lost), "SELECT count(*) FROM nccl_events")
    assert code == 1 and broken.name in err  # skipped by default, as analyze does


def test_query_usage_errors(run: Run, dump_dir: Path, tmp_path: Path) -> None:
    code, _, err = run("query", "SELECT 1")
    assert code == 2 and "give dump files" in err
    code, _, err = run("query", str(tmp_path / "missing"), "SELECT 1")
    assert code == 2 and "no such file" in err
    code, _, err = run("query", str(dump_dir), "DELETE FROM nccl_events")
    assert code == 2 and "only SELECT" in err
    code, _, err = run("query", str(dump_dir), "SELECT 1", "--agents", "a:1")
    assert code == 2 and "only the SQL" in err


@pytest.fixture
def served(dump_dir: Path, tmp_path: Path) -> Iterator[tuple[str, str]]:
    token_file = tmp_path / "token"
    token_file.write_text("serve-token\n")
    files = sorted(dump_dir.iterdir())
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, "serve", str(files[1]), "--listen", "127.0.0.1:0",
         "--token-file", str(token_file)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("listening on "), proc.stderr.read() if proc.stderr else line
    try:
        yield line.split()[-1], str(token_file)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=10)
        proc.stdout.close()
        if proc.stderr:
            proc.stderr.close()
    assert code == 0


@pytest.mark.solo  # bounded by time: judged alone
def test_serve_then_query_agents(run: Run, served: tuple[str, str], dump_dir: Path) -> None:
    address, token_file = served
    code, out, err = run(
        "query", "--agents", address, "--token-file", token_file, SEED_QUERY, "--format", "json"
    )
    assert code == 0, err
    doc = json.loads(out)
    assert doc["columns"] == ["rank", "ms", "retransmits_in_window"] and doc["failed"] == []
    served_dump = sorted(dump_dir.iterdir())[1]
    with QueryEngine([read_dump(served_dump)], LOCAL) as engine:
        local = engine.query(SEED_QUERY)
    assert sorted(map(tuple, doc["rows"])) == sorted(local.rows)
    code, _, err = run("query", "--agents", address, "SELECT 1")
    assert code == 2 and "401" in err


def test_query_agents_partial_and_none(run: Run, served: tuple[str, str]) -> None:
    address, token_file = served
    dead = "127.0.0.1:1"
    code, out, err = run(
        "query", "--agents", f"{address},{dead}", "--token-file", token_file,
        "SELECT host, count(*) AS n FROM nccl_events GROUP BY host",
    )  # fmt: skip
    assert code == 1
    assert f"agent {dead}: cannot reach" in err and "partial result: 1 of 2" in err
    assert out.splitlines()[2].split() == ["node1", "201"]
    code, out, err = run("query", "--agents", dead, "SELECT 1", "--timeout", "1")
    assert code == 2 and "none of 1 agents answered" in err and out == ""


def test_serve_refuses_non_loopback_without_tls_and_token(run: Run, dump_dir: Path) -> None:
    code, _, err = run("serve", str(dump_dir), "--listen", "0.0.0.0:0")
    assert code == 2 and "--token-file" in err and "--tls-cert" in err


def test_help_has_examples(run: Run, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run("query", "--help")
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert "examples:" in help_text and "--agents" in help_text and "exit codes" in help_text


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_query_table_is_rich_on_a_terminal_and_plain_elsewhere() -> None:
    from stallwatch.commands.query import format_table

    args = (("rank", "op"), ("INTEGER", "VARCHAR"), [(5, "ALL_REDUCE"), (None, "SEND")])
    plain = format_table(*args, file=io.StringIO()).splitlines()
    assert plain == [
        "rank   op",
        "----- -----------",
        "   5   ALL_REDUCE",
        "NULL   SEND",
        "(2 rows)",
    ]
    boxed = format_table(*args, file=_Terminal())
    assert "\x1b[" in boxed and "─" in boxed and "ALL_REDUCE" in boxed

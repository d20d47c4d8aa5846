"""The same input rules and limits on every command: foreign files named and
ignored, Flight Recorder export ids unique, the local query bounded as an
agent's, ids never cut, help pages complete, and a snapshot with nothing to
read saying so."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from rich.text import Text

from stallwatch.cli import main
from stallwatch.dumpers.sqltables import TABLE_NAMES
from stallwatch.query.output import id_widths, new_table
from tests.conftest import ROOT, SHARED

DATA = ROOT / "tests" / "data"
FR16 = SHARED / "fixtures" / "pytorch-fr-nccl-16rank"


def test_a_file_that_is_no_dump_is_named_and_ignored_everywhere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A healthy run's folder holds its scenario's expected.json beside the
    dumps: every command names it once and is still clean (exit 0)."""
    folder = tmp_path / "allreduce-healthy-4"
    shutil.copytree(DATA / "fr-torch" / "allreduce-healthy-4", folder)
    assert (folder / "expected.json").is_file()
    runs = {
        "analyze": ["analyze", str(folder / "pickle"), str(folder / "expected.json")],
        "query": ["query", str(folder), "SELECT count(*) FROM nccl_events"],
        "export": ["export", "--parquet", str(folder), "-o", str(tmp_path / "pq")],
        "perfetto": ["export", "--perfetto", str(folder), "-o", str(tmp_path / "t.json")],
    }
    for name, argv in runs.items():
        assert main(argv) == 0, name
        err = capsys.readouterr().err
        assert err.count("expected.json") == 1 and "ignored" in err, (name, err)


def test_a_truncated_dump_is_skipped_by_every_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "lab"
    shutil.copytree(DATA / "lab-hang-2x2", folder)
    broken = folder / "node1.msgpack"
    broken.write_bytes(broken.read_bytes()[:4000])
    runs = [
        ["analyze", str(folder)],
        ["query", str(folder), "SELECT count(*) FROM nccl_events"],
        ["export", "--parquet", str(folder), "-o", str(tmp_path / "pq")],
        ["export", "--perfetto", str(folder), "-o", str(tmp_path / "t.json")],
    ]
    for argv in runs:
        assert main(argv) == 1, argv
        out, err = capsys.readouterr()
        assert "Traceback" not in err, (argv, err)
        # named once: on stderr, or in analyze's report (its inputs not read)
        said = out if argv[0] == "analyze" else err
        assert (out + err).count(str(broken)) == 1 and str(broken) in said, (argv, out, err)


def test_flight_recorder_export_ids_are_unique_and_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two jobs whose folders share a name are two incidents; '.' has a name."""
    one, two = tmp_path / "a" / "job", tmp_path / "b" / "job"
    shutil.copytree(DATA / "fr-torch" / "allreduce-hang-4" / "pickle", one)
    shutil.copytree(DATA / "fr-torch" / "allreduce-healthy-4" / "pickle", two)
    out = tmp_path / "pq"
    assert main(["export", "--parquet", str(one), "-o", str(out)]) == 0
    assert main(["export", "--parquet", str(two), "-o", str(out)]) == 0
    parts = sorted(p.name for p in (out / "nccl_events").iterdir())
    assert len(parts) == 2 and all(p.startswith("incident=job-") for p in parts), parts
    # the same folder again is the same incident: refused, never rewritten
    assert main(["export", "--parquet", str(one), "-o", str(out)]) == 2
    assert main(["export", "--parquet", str(one), "-o", str(out), "--incident", "mine"]) == 0
    assert (out / "nccl_events" / "incident=mine").is_dir()
    cwd = os.getcwd()
    try:
        os.chdir(one)
        assert main(["export", "--parquet", ".", "-o", str(tmp_path / "dot")]) == 0
    finally:
        os.chdir(cwd)
    (dot,) = (tmp_path / "dot" / "nccl_events").iterdir()
    assert dot.name.startswith("incident=job-") and "%" not in dot.name
    capsys.readouterr()


def test_a_local_query_has_the_agents_row_and_memory_limits(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Killed by the kernel before (exit 137): now 10,000 rows and a note."""
    code = main(
        ["query", str(DATA / "lab-hang-2x2"), "SELECT * FROM range(100000000)", "--format", "csv"]
    )
    out, err = capsys.readouterr()
    assert code == 0 and len(out.splitlines()) == 1 + 10_000
    *notes, last = err.splitlines()
    assert "only the first 10000 rows" in last
    assert [n for n in notes if "written before checksums" not in n] == []  # lab dumps of format 1


def test_query_help_lists_every_table(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["query", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(t in text for t in TABLE_NAMES), [t for t in TABLE_NAMES if t not in text]


def test_ids_are_never_cut_on_a_narrow_terminal() -> None:
    """On 60 columns the other columns wrap; the id stays whole."""
    rows = [["0xe211a78d4ede4e73", "a long text that can wrap " * 4, 42]]
    buf = io.StringIO()
    c = Console(file=buf, width=60, force_terminal=True, color_system=None)
    table = new_table(
        c, [("comm_id_hash", False), ("note", False), ("n", True)], id_widths(rows, 3)
    )
    table.add_row(*(Text(str(v)) for v in rows[0]))
    c.print(table)
    assert "0xe211a78d4ede4e73" in buf.getvalue()


def test_dump_prints_for_people_by_default_like_every_command() -> None:
    from stallwatch.commands.main import build_parser

    for command in ("dump", "analyze", "query", "export"):
        args = build_parser().parse_args([command, *_minimal(command)])
        assert args.format == "table", command


def _minimal(command: str) -> list[str]:
    return {
        "dump": ["--agent", "127.0.0.1:1"],
        "analyze": ["d"],
        "query": ["d", "SELECT 1"],
        "export": ["--perfetto", "d", "-o", "t.json"],
    }[command]


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs root")
def test_a_snapshot_with_nothing_to_read_exits_1_in_one_line(tmp_path: Path) -> None:
    """In a network namespace of its own no NCCL process runs: no dump."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        ["unshare", "--net", sys.executable, "-m", "stallwatch", "snapshot", "--scope", "netns",
         "--dump-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stderr.count("\n") == 1 and "nothing to read" in done.stderr
    assert not list(tmp_path.iterdir())


def test_table_widths_fit_without_cutting_a_word() -> None:
    """Headers wrap first, then the widest text; never below a column's
    longest word; nothing fits below the sum of those."""
    from stallwatch.query.output import COLUMN_GAP, fit_widths

    cells = [
        ["rank", "last entered", "state", "why"],
        ["0", "12", "at frontier, in flight", ""],
        ["1", "11", "behind", "CULPRIT (missing_rank): last entered seq 11, peers at seq 12"],
    ]
    natural = [4, 12, 22, 60]
    assert fit_widths(cells, 200) == natural
    fitted = fit_widths(cells, 80)
    assert fitted is not None and sum(fitted) + COLUMN_GAP * 3 == 80
    assert fitted[1] == len("entered") and fitted[2] == 22  # the header wrapped, not the state
    tight = fit_widths(cells, 4 + 7 + 9 + 15 + COLUMN_GAP * 3)
    assert tight == [4, 7, 9, 15]  # "frontier," and "(missing_rank):" whole
    assert fit_widths(cells, 4 + 7 + 9 + 15 + COLUMN_GAP * 3 - 1) is None

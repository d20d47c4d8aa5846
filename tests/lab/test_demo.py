"""``stallwatch lab demo``: the analysis names the injected rank, for a fixed
seed and for random ones; the files it names exist; the commands it prints
run as printed.  The lab tests run the real demo (root, namespaces, eBPF)."""

from __future__ import annotations

import json
import secrets
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from stallwatch.dumpers.errors import UsageError
from stallwatch.dumpers.format import read_dump
from stallwatch.lab.demo import (
    HEADLINE_QUERY,
    STEPS,
    Console,
    LabProcess,
    check_dump_dir,
    choose_injection,
    command_text,
    culprit_found,
    paths_for,
)
from tests.analyzer.test_export import assert_every_call_once, check_trace_format

ROOT = Path(__file__).resolve().parents[2]
DEMO_TIMEOUT = 240


# --- fast ---------------------------------------------------------------------------


def test_the_lab_process_pipes_are_closed_once_it_finished() -> None:
    """Its output is read to the end and its pipes closed (left to the
    garbage collector, they warn in whatever code runs next)."""
    import io

    console = Console(io.StringIO(), io.StringIO(), quiet=True)
    lab = LabProcess.start(
        (sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr)"), console
    )
    assert lab.finish() == 0
    assert lab.stdout == ["out"] and lab.stderr == ["err"]
    assert lab.proc.stdout is not None and lab.proc.stdout.closed
    assert lab.proc.stderr is not None and lab.proc.stderr.closed


def test_injection_is_drawn_from_the_seed_alone_and_fits_the_job() -> None:
    assert choose_injection(42, 4, 2) == choose_injection(42, 4, 2)
    drawn = {choose_injection(seed, 4, 2) for seed in range(200)}
    assert {i.rank for i in drawn} == set(range(8))
    for inj in drawn:
        assert 3 <= inj.step < STEPS - 2
        assert inj.node == inj.rank // 2
        assert inj.spec == f"hang:rank={inj.rank},step={inj.step}"


def test_culprit_found_needs_every_missing_rank_verdict_to_name_exactly_the_rank() -> None:
    hang = {"kind": "missing_rank", "ranks": [5]}
    other = {"kind": "network_straggler", "ranks": [0, 1]}
    assert culprit_found([hang, other], 5)
    assert not culprit_found([hang], 4)
    assert not culprit_found([other], 5)
    assert not culprit_found([{"kind": "missing_rank", "ranks": [5, 6]}], 5)
    assert not culprit_found([hang, {"kind": "missing_rank", "ranks": [2]}], 5)


def test_printed_commands_split_back_into_the_argv_that_ran() -> None:
    argv = [sys.executable, "-m", "stallwatch", "query", "/tmp/a b", HEADLINE_QUERY, "it's"]
    assert shlex.split(command_text(argv)) == argv
    assert "'\"'\"'" not in command_text(["q", HEADLINE_QUERY])  # readable SQL quoting


def test_dump_dir_with_dumps_is_refused_and_the_trace_stays_outside(tmp_path: Path) -> None:
    dump_dir, trace = paths_for(tmp_path / "d")
    assert not trace.is_relative_to(dump_dir)
    assert dump_dir.is_relative_to(tmp_path / "d") and trace.is_relative_to(tmp_path / "d")
    (dump_dir / "node0").mkdir(parents=True)
    check_dump_dir(dump_dir)  # empty: fine
    (dump_dir / "node0" / "x.msgpack").write_bytes(b"")
    with pytest.raises(UsageError, match="already holds dumps"):
        check_dump_dir(dump_dir)


def test_without_out_the_demo_writes_under_the_cache_not_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    dump_dir, trace = paths_for(None)
    assert dump_dir.is_relative_to(tmp_path / "cache" / "stallwatch")
    assert trace.parent == dump_dir.parent
    assert not dump_dir.is_relative_to(tmp_path / "d")


# --- the real demo --------------------------------------------------------------------


def run_demo(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "stallwatch", "lab", "demo", *args]
    argv += ["--out", str(tmp_path / "demo")]
    return subprocess.run(
        argv, cwd=tmp_path, capture_output=True, text=True, timeout=DEMO_TIMEOUT, check=False
    )


def check_json_run(tmp_path: Path, seed: int, nodes: int = 4) -> dict[str, Any]:
    done = run_demo(tmp_path, "--seed", str(seed), "--json", "--nodes", str(nodes))
    assert done.returncode in (0, 1), done.stderr
    doc: dict[str, Any] = json.loads(done.stdout)
    inj = choose_injection(seed, nodes, 2)
    assert doc["injected"] == {"rank": inj.rank, "step": inj.step, "node": inj.node}
    assert doc["culprit_found"] is True, f"seed {seed}: {json.dumps(doc['verdicts'], indent=1)}"
    assert done.returncode == 0
    dumps = [Path(p) for p in doc["dumps"]]
    assert len(dumps) == nodes and all(p.is_file() and p.stat().st_size for p in dumps)
    trace = json.loads(Path(str(doc["trace"])).read_text())
    assert_every_call_once(check_trace_format(trace), [read_dump(p) for p in dumps])
    print(f"demo seed {seed}, {nodes} nodes: seconds {doc['seconds']}", file=sys.stderr)
    return doc


@pytest.mark.lab
def test_demo_fixed_seed_names_the_injected_rank(tmp_path: Path) -> None:
    doc = check_json_run(tmp_path, 7)
    seconds: dict[str, float] = doc["seconds"]
    assert 0 < seconds["dumps_written"] < seconds["total"]
    assert set(doc["commands"]) >= {"lab_run", "analyze", "query", "export"}


@pytest.mark.lab
def test_demo_random_seed_smaller_job(tmp_path: Path) -> None:
    check_json_run(tmp_path, secrets.randbelow(1_000_000), nodes=2)


def shown_report(stdout: str, marker: str) -> tuple[str, str]:
    """The command printed after ``$`` that contains ``marker``, and the output
    the demo showed under it (indented by four spaces)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("$ ") and marker in line)
    command, end = lines[start][2:], start + 1
    while not _complete(command):  # a quoted argument spans lines (the SQL)
        command, end = f"{command}\n{lines[end]}", end + 1
    body = []
    for line in lines[end:]:
        if not line.startswith("    "):
            break
        body.append(line[4:])
    return command, "\n".join(body)


def _complete(command: str) -> bool:
    try:
        shlex.split(command)
    except ValueError:
        return False
    return True


def test_a_report_for_people_fits_the_terminal_the_demo_prints_to(tmp_path: Path) -> None:
    """On a terminal the demo runs analyze and the query on a terminal as
    wide as its own beside the block's indent: the report fits, as analyze
    by hand does (piped, the same command prints one record per line)."""
    import re

    from stallwatch.lab.demo import BLOCK_INDENT, run_on_terminal, stallwatch

    folder = str(ROOT / "tests" / "data" / "lab-hang-4x2")
    argv = stallwatch("analyze", folder)
    piped = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert max(len(line) for line in piped.stdout.splitlines()) > 100  # too wide for a terminal
    shown = run_on_terminal(argv, 100 - BLOCK_INDENT)
    assert shown.returncode == piped.returncode == 1
    plain = re.sub(r"\x1b\[[0-9;]*m", "", shown.stdout)  # the terminal's colours
    assert "\r" not in plain and "MISSING_RANK: rank 5 never entered" in plain
    assert max(len(line) for line in plain.splitlines()) <= 100 - BLOCK_INDENT, plain

"""``export --flight-recorder`` says how to read its files with torchfrtrace:
where they hold point-to-point calls (on which torchfrtrace, torch 2.13 and
2.14, fails), the export that leaves them out, as a command that runs as
printed, then torchfrtrace on its folder."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from stallwatch.analyzer.frexport import flight_recorder_docs
from stallwatch.analyzer.pipeline import analyze_paths

ROOT = Path(__file__).resolve().parents[2]
HANG = ROOT / "tests" / "data" / "lab-hang-2x2"  # the lab's job: sends and reduces per step


def export(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "stallwatch", "export", "--flight-recorder", *args]
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_with_p2p_calls_the_hint_is_the_export_that_leaves_them_out(tmp_path: Path) -> None:
    done = export(str(HANG), "-o", "fr", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (incident,) = analyze_paths([str(HANG)]).incidents
    docs, _ = flight_recorder_docs(incident.incident)
    names = [e["profiling_name"] for d in docs.values() for e in d["entries"]]
    p2p = sum(1 for n in names if n.startswith(("nccl:send", "nccl:recv")))
    assert p2p > 0
    lines = done.stdout.splitlines()
    assert lines[0].endswith(f"{len(names)} call(s), {p2p} of them point-to-point"), lines
    assert "fails on point-to-point calls" in lines[1]
    again, frtrace = (line.strip() for line in lines[2:4])
    assert frtrace == "torchfrtrace fr-collectives -p rank_"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    rerun = subprocess.run(shlex.split(again), cwd=tmp_path, capture_output=True, text=True,
                           env=env, timeout=120)  # fmt: skip
    assert rerun.returncode == 0, rerun.stderr
    assert f"{len(names) - p2p} call(s)" in rerun.stdout
    assert "point-to-point" not in rerun.stdout  # none left: the plain hint
    assert "torchfrtrace reads them: torchfrtrace fr-collectives -p rank_" in rerun.stdout
    assert sorted(p.name for p in (tmp_path / "fr-collectives").iterdir()) == sorted(
        p.name for p in (tmp_path / "fr").iterdir()
    )


def test_the_command_list_and_the_help_name_every_export() -> None:
    top = subprocess.run([sys.executable, "-m", "stallwatch", "--help"], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    (line,) = [x for x in top.stdout.splitlines() if x.strip().startswith("export")]
    described = " ".join(top.stdout[top.stdout.index(line) :].split()[:20])
    assert all(w in described for w in ("Perfetto", "Flight Recorder", "Parquet")), described
    own = subprocess.run([sys.executable, "-m", "stallwatch", "export", "--help"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    flat = " ".join(own.stdout.split())
    assert "--flight-recorder: write the incident as PyTorch Flight Recorder files" in flat
    assert "--collectives-only" in flat and "torchfrtrace" in flat

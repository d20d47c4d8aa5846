"""The Flight Recorder benchmark runs (small sizes): files with and without
stacks, ours beside unpickling alone (and torchfrtrace where torch is
installed), the verdict right on both."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest

from bench import bench_flightrec
from bench.common import Figure

pytestmark = pytest.mark.solo  # speed figures: measured alone


def test_the_files_are_torch_s(tmp_path: Path) -> None:
    """What the bench reads is what torch writes: one frame dict per distinct
    frame, shared by the stacks of every entry; rank 7 one entry short."""
    bench_flightrec.write_flightrec(tmp_path, 8, 20, depth=12)
    docs = {p.name: pickle.loads(p.read_bytes()) for p in tmp_path.iterdir()}
    assert sorted(docs) == [f"nccl_trace_rank_{r}" for r in range(8)]
    entries = docs["nccl_trace_rank_0"]["entries"]
    assert len(entries) == 20 and len(docs["nccl_trace_rank_7"]["entries"]) == 19
    frames = [f for e in entries for f in e["frames"]]
    assert all(len(e["frames"]) == 12 for e in entries)
    assert len({id(f) for f in frames}) < len(frames) / 4  # written once, fetched after
    assert entries[-1]["state"] == "scheduled" and not entries[-1]["retired"]


@pytest.mark.slow
def test_bench_quick_runs_and_is_right() -> None:
    figures = bench_flightrec.figures(quick=True, stacks=12)
    torch = bench_flightrec.has_torchfrtrace()
    assert len(figures) == 2 * (7 if torch else 6)
    assert all(f.ok is not False for f in figures), [(f.name, f.value, f.anchor) for f in figures]
    timed = [f for f in figures if f.name.endswith(": time")]
    assert [f.name for f in timed] == [
        "FR 64 x 200 stacks of 12: time",
        "FR 64 x 200 no stacks: time",
    ]
    assert all("verdict right" in f.anchor for f in timed)
    floor = [f for f in figures if f.name.endswith("unpickling alone, CPU")]
    assert len(floor) == 2 and all(f.value > 0 for f in floor)


def test_another_size_judges_no_target(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--ranks``/``--entries`` measure a smaller size on a busy machine: both
    sets at that size, no target judged; the issue's size alone is judged."""
    sets: list[tuple[int, int, int, bool, int]] = []

    def one_set(*args: Any) -> list[Figure]:
        sets.append(args)
        return []

    monkeypatch.setattr(bench_flightrec, "_set", one_set)
    bench_flightrec.figures(stacks=40, ranks=128, entries=500)
    bench_flightrec.figures(stacks=40)
    assert sets == [
        (128, 500, 40, False, 3),
        (128, 500, 0, False, 3),
        (512, 2000, 40, True, 3),
        (512, 2000, 0, True, 3),
    ]
    for args, text in (
        (["--ranks", "7"], "--ranks: at least 8"),
        (["--entries", "1"], "at least 2"),
    ):
        with pytest.raises(SystemExit) as exc:
            bench_flightrec.main(args)
        assert exc.value.code == 2 and text in capsys.readouterr().err

"""Waits on the device's timeline: the rules that name a rank whose device
is slow when the watchdogs that observe completion lag under CPU contention,
and lateness inherited from a wait elsewhere."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import cast

import numpy as np

from stallwatch.analyzer.columns import Columns
from stallwatch.analyzer.detect.common import Analysis
from stallwatch.analyzer.detect.stragglers import straggler_candidates
from stallwatch.analyzer.pipeline import analyze_paths
from stallwatch.analyzer.rankmetrics import ArrivalScore, _shared_completion
from stallwatch.analyzer.verdict import VerdictKind
from stallwatch.dumpers.format import read_dump

MS = 1_000_000
DATA = Path(__file__).resolve().parents[1] / "data" / "lab-gpuslow-4x2"


def test_a_collective_completes_once_for_all_its_members() -> None:
    # two device-timed groups of three, then a host-timed one; rank 2's
    # watchdog saw the first completion 40 ms late, rank 1's start was seen
    # after the completion rank 0 saw
    rows = Columns(
        {
            "ts": np.array([0, 5, 30, 100, 101, 102, 200, 210, 220]) * MS,
            "end": np.array([50, 52, 90, 150, 149, 151, 260, 270, 250]) * MS,
            "device": np.array([1, 1, 1, 1, 1, 1, 0, 0, 0], dtype=np.uint8),
        }
    )
    rows["ts"][4] = 151 * MS
    gid = np.array([0, 0, 0, 1, 1, 1, 2, 2, 2])
    end = _shared_completion(rows, gid)
    assert (end[:3] == 50 * MS).all()  # the earliest completion seen
    assert end[3] == 149 * MS and end[4] == 151 * MS  # a start seen after: no wait
    assert (end[6:] == rows["end"][6:]).all()  # host-timed calls keep their return


def _score(
    comm: int, proc: int, margin_ms: float, last: float, device: bool = True
) -> ArrivalScore:
    return ArrivalScore(
        comm, proc % 4, proc, 16, last, int(margin_ms * MS), 60 * MS, 10 * MS, "wait",
        nranks=4, period_ns=80 * MS, device=device,
    )  # fmt: skip


def _candidates(scores: list[ArrivalScore]) -> set[int]:
    a = cast(Analysis, SimpleNamespace(arrivals=tuple(scores)))
    return {s.proc for s in straggler_candidates(a)}


def test_lateness_inherited_from_a_wait_is_excused() -> None:
    # proc 1 waits 80 ms for proc 0 in one communicator, then arrives 85 ms
    # late in the next: its lateness is proc 0's
    scores = [
        _score(0, 0, 80, 1.0),
        _score(0, 1, -80, 0.0),
        _score(1, 1, 85, 1.0),
        _score(1, 2, -30, 0.0),
    ]
    assert _candidates(scores) == {0}


def test_recorded_gpuslow_run_names_the_slow_device() -> None:
    # A real recording the analyzer once called healthy (see its README).
    # What made it hard is in the data: world AllReduces whose device start
    # no watchdog saw (completed at the first look).
    unseen = 0
    for path in sorted(DATA.glob("*.msgpack")):
        rows = read_dump(path).rings["nccl"].rows
        unseen += int(np.count_nonzero((rows["completed_ns"] > 0) & (rows["started_ns"] == 0)))
    assert unseen >= 1
    (inc,) = analyze_paths([str(DATA)]).incidents
    kinds = [v.kind for v in inc.verdicts]
    assert kinds == [VerdictKind.COMPUTE_STRAGGLER], [v.summary for v in inc.verdicts]
    assert inc.verdicts[0].ranks == (6,) and inc.verdicts[0].hosts == ("node3",)

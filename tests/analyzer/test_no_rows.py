"""A member whose record holds none of its communicator's calls.

Every member of a communicator takes part in each of its collectives, so a
member whose complete window holds none of them, while a collective before
the frontier ended on its peers, has a record that is not all it did (a
Flight Recorder file that lost its entries, a ring that lost rows): unknown,
never "never entered".  Where nothing ended before the frontier (the job's
first collective), the same empty record is the culprit's.  Built from a
real torch 2.13 Flight Recorder hang (rank 2 hung at ALL_REDUCE seq 4).
"""

from __future__ import annotations

import json
from pathlib import Path

from stallwatch.analyzer.incident import MemberState
from stallwatch.analyzer.pipeline import analyze_paths
from stallwatch.analyzer.verdict import VerdictKind

SRC = Path(__file__).resolve().parents[1] / "data" / "fr-torch" / "allreduce-hang-4" / "json"


def _write(folder: Path, first_only: bool) -> Path:
    """Rank 3's file without its entries; with ``first_only``, the others
    hold only their first collective, still in flight."""
    folder.mkdir()
    for r in range(4):
        doc = json.loads((SRC / f"nccl_trace_rank_{r}.json").read_text())
        if r == 3:
            del doc["entries"]  # torch writes no key where there is no entry
        elif first_only:
            doc["entries"] = [{**doc["entries"][0], "retired": False}]
        (folder / f"nccl_trace_rank_{r}.json").write_text(json.dumps(doc))
    return folder


def _judged(folder: Path) -> tuple[list[tuple[VerdictKind, tuple[int, ...]]], MemberState]:
    (r,) = analyze_paths([str(folder)]).incidents
    (front,) = r.frontiers
    return [(v.kind, v.ranks) for v in r.verdicts], front.members[3].state


def test_an_empty_record_beside_ended_collectives_is_unknown(tmp_path: Path) -> None:
    verdicts, state = _judged(_write(tmp_path / "lost-entries", first_only=False))
    assert verdicts[0] == (VerdictKind.MISSING_RANK, (2,))
    assert all(3 not in ranks for _, ranks in verdicts)
    assert state is MemberState.UNKNOWN


def test_an_empty_record_at_the_first_collective_is_the_culprit(tmp_path: Path) -> None:
    verdicts, state = _judged(_write(tmp_path / "first", first_only=True))
    assert verdicts[0] == (VerdictKind.MISSING_RANK, (3,))
    assert state is MemberState.NO_ROWS

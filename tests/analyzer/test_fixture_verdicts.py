"""Every real recording kept in tests/data is judged as its truth says: each
folder's ``expected.json`` holds what the run was (``truth``) and the
verdicts it supports, first ones first, with the ranks and hosts they name.
A rule changed for one input is judged here on every other real input too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stallwatch.analyzer.pipeline import analyze_paths

DATA = Path(__file__).resolve().parents[1] / "data"
FIXTURES = sorted(
    p.parent.relative_to(DATA).as_posix()
    for p in DATA.glob("**/expected.json")
    if any(p.parent.glob("*.msgpack"))
)


def test_every_recorded_lab_incident_has_its_truth() -> None:
    recorded = {p.parent.relative_to(DATA).as_posix() for p in DATA.glob("**/*.msgpack")}
    assert recorded and recorded == set(FIXTURES)


@pytest.mark.parametrize("name", FIXTURES)
def test_a_real_recording_gets_the_verdict_its_truth_supports(name: str) -> None:
    expected = json.loads((DATA / name / "expected.json").read_text())
    (inc,) = analyze_paths([str(DATA / name)]).incidents
    want = expected["verdicts"]
    got = [
        {"kind": v.kind.value, "ranks": sorted(v.ranks), "hosts": sorted(set(v.hosts))}
        for v in inc.verdicts[: len(want)]
    ]
    assert got == [{**w, "ranks": sorted(w["ranks"]), "hosts": sorted(w["hosts"])} for w in want]

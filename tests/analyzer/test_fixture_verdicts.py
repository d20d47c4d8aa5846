"""Every real recording kept in tests/data is judged as its truth says:
``tests/data/verdicts.json`` holds, per folder of dumps, what the run was
(``truth``) and the verdicts it supports, first ones first, with the ranks
and hosts they name (kept apart from the dumps: a folder given to
``analyze`` holds inputs only).  A rule changed for one input is judged here
on every other real input too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stallwatch.analyzer.pipeline import analyze_paths

DATA = Path(__file__).resolve().parents[1] / "data"
TRUTH = json.loads((DATA / "verdicts.json").read_text())
FIXTURES = sorted(TRUTH)


def test_every_recorded_lab_incident_has_its_truth() -> None:
    recorded = {p.parent.relative_to(DATA).as_posix() for p in DATA.glob("**/*.msgpack")}
    assert recorded and recorded == set(FIXTURES)


@pytest.mark.parametrize("name", FIXTURES)
def test_a_real_recording_gets_the_verdict_its_truth_supports(name: str) -> None:
    expected = TRUTH[name]
    (inc,) = analyze_paths([str(DATA / name)]).incidents
    want = expected["verdicts"]
    got = [
        {"kind": v.kind.value, "ranks": sorted(v.ranks), "hosts": sorted(set(v.hosts))}
        for v in inc.verdicts[: len(want)]
    ]
    assert got == [{**w, "ranks": sorted(w["ranks"]), "hosts": sorted(w["hosts"])} for w in want]


def test_a_rank_waiting_in_its_groups_end_for_a_peer_without_a_dump_is_not_missing() -> None:
    """tests/data/lab-partition-apart-4x2: rank 2's grouped send and receive
    were queued and its thread waits in ``ncclGroupEnd`` for rank 0, whose
    node's dump is absent; nobody with a dump is named: the host its peers'
    probes all failed to reach is, by its address, with the ranks no dump
    holds."""
    (inc,) = analyze_paths([str(DATA / "lab-partition-apart-4x2")]).incidents
    assert [v.kind.value for v in inc.verdicts] == ["network_partition"], inc.verdicts
    (v,) = inc.verdicts
    assert v.hosts == ("10.201.45.1",) and v.ranks == (0, 1) and not v.pids
    assert not set(v.hosts) & {"node1", "node2", "node3"}  # no host with a dump named

"""The verdict sits where the culprit alone is absent: a rank that hangs
before a subgroup collective is named on that subgroup's collective, and the
larger collectives it then blocks are its consequences.

Real inputs: torch 2.13 Flight Recorder dumps of a job with world, half and
pair groups whose rank k stops before its pair's 3rd all_reduce
(tests/data/fr-torch/groups-hang-*), and a 2x2 lab job recorded by real
agents whose rank 3 hung (tests/data/lab-hang-2x2: its tensor-parallel and
data-parallel partners wait for it, each in a 2-rank communicator, and the
world waits for them all)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stallwatch.analyzer.pipeline import analyze_paths
from stallwatch.analyzer.verdict import VerdictKind

DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.mark.parametrize(("run", "culprit"), [("groups-hang-4", 2), ("groups-hang-8", 4)])
def test_the_pair_collective_is_the_headline(run: str, culprit: int) -> None:
    (r,) = analyze_paths([str(DATA / "fr-torch" / run / "pickle")]).incidents
    v = r.verdicts[0]
    assert v.kind is VerdictKind.MISSING_RANK and v.ranks == (culprit,)
    comm = next(c for c in r.incident.comms if c.hash_text == v.comm_id_hash)
    assert comm.nranks == 2, v.summary  # the pair, not the world of the evidence
    assert f"on {comm.name}" in v.summary
    world = max(r.incident.comms, key=lambda c: c.nranks)
    assert any(e.startswith("consequence:") and world.hash_text in e for e in v.evidence)


def test_a_lab_hang_is_named_on_the_smallest_communicator_it_alone_misses() -> None:
    (r,) = analyze_paths([str(DATA / "lab-hang-2x2")]).incidents
    v = r.verdicts[0]
    assert v.kind is VerdictKind.MISSING_RANK and v.ranks == (3,)
    comms = {c.hash_text: c for c in r.incident.comms}
    assert comms[v.comm_id_hash].nranks == 2
    front = next(f for f in r.frontiers if r.incident.comms[f.comm].hash_text == v.comm_id_hash)
    assert [m.proc for m in front.laggards] == [
        next(i for i, p in enumerate(r.incident.procs) if p.world_rank == 3)
    ]

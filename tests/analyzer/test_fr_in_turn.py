"""Flight Recorder dumps taken in turn (tests/data/fr-torch/inturn-*): a real
PyTorch 2.13 job (gloo, 4 and 8 ranks) whose ranks dump one after another,
10, 50 or 200 ms apart, while the job runs (healthy), after one rank stopped
for good (hang), or while one rank stops (hangs: the hang starts between two
dumps; the rank that stops dumps first, early, in the middle or last).

In every form (pickle, JSON; pg_config as torch 2.13's gloo writes it, keyed
by '', and fixed, one key per group): a healthy job dumped in turn is healthy
and says the dumps were taken at different moments, never a culprit; a hung
job dumped in turn names the hung rank alone; so does a job that hung while
it was dumped: the dumps taken last stand at the collective the rank never
entered, and of the ranks absent from it, the ones dumped before the hang
are proven (by their peers' completions) to have gone on after their dumps,
while the rank that stopped is not.  Where it dumped first (before it
stopped), every absent rank is proven older: inconclusive, naming them.
The rule before (a dump that cannot be ordered with the frontier is excused
when the dumps were taken in turn) called every one of these jobs healthy;
the rule after it (inconclusive whenever two ranks or more are absent)
named none of the culprits the issue's 8-rank job (three ranks dumped
before the hang) asks for.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from stallwatch.analyzer.pipeline import analyze_paths
from stallwatch.analyzer.verdict import VerdictKind

CORPUS = Path(__file__).resolve().parents[1] / "data" / "fr-torch"
RUNS = sorted(p.name for p in CORPUS.glob("inturn-*") if (p / "expected.json").is_file())
FORMS = ["pickle", "json", "pickle-pg", "json-pg"]


def expected(run: str) -> dict[str, object]:
    doc: dict[str, object] = json.loads((CORPUS / run / "expected.json").read_text())
    return doc


def last_seqs(run: str) -> list[int]:
    out = []
    for p in sorted((CORPUS / run / "pickle").iterdir()):
        entries = pickle.loads(p.read_bytes())["entries"]  # torch's own plain dicts
        out.append(max(int(e["collective_seq_id"]) for e in entries))
    return out


def test_the_in_turn_corpus_is_there() -> None:
    healthy = [r for r in RUNS if "healthy" in r]
    hung = [r for r in RUNS if "-hang-" in r]
    during = [r for r in RUNS if "-hangs-" in r]
    assert len(healthy) >= 6 and len(hung) >= 4 and len(during) >= 16
    # groups that share a local pg_id (test_fr_groups): hung before and while dumped
    assert {r.split("-")[1] for r in during} >= {"halves", "links", "hangs"}
    places = {r.split("-")[-2] for r in during}
    assert places == {"first", "early", "middle", "late"}
    assert {expected(r)["dumps_in_turn_ms"] for r in during} >= {50, 200}
    assert {expected(r)["world"] for r in during} == {4, 8}
    spacings = {expected(r)["dumps_in_turn_ms"] for r in RUNS}
    assert spacings >= {10, 50, 200}
    for r in healthy:
        # taken in turn for real: the dumps end at different seqs
        assert len(set(last_seqs(r))) >= 2, (r, last_seqs(r))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("run", RUNS)
def test_first_verdict(run: str, form: str) -> None:
    want = expected(run)["verdict"]
    assert isinstance(want, dict)
    paths = sorted(str(p) for p in (CORPUS / run / form).iterdir())
    for order in (paths, paths[::-1]):
        (inc,) = analyze_paths(order).incidents
        v = inc.verdicts[0]
        assert (v.kind.value, list(v.ranks)) == (want["kind"], want["ranks"]), v.summary
        if v.kind is VerdictKind.HEALTHY:
            assert "the dumps were taken at different moments" in v.summary
            assert "ms apart by entry times" in v.summary
        elif v.kind is VerdictKind.INCONCLUSIVE:
            assert len(inc.verdicts) == 1 and "the job stood still at " in v.summary
            assert any("the dumps taken last stand there" in e for e in v.evidence)
        else:
            op = "BROADCAST" if "-links-" in run else "ALL_REDUCE"
            assert len(inc.verdicts) == 1 and f"never entered {op}" in v.summary


@pytest.mark.parametrize("run", [r for r in RUNS if "hang" in r])
def test_a_job_that_hung_is_never_healthy_and_its_culprit_is_named(run: str) -> None:
    """The culprit named alone, or among the ranks an inconclusive names."""
    (culprit,) = expected(run)["truth"]["ranks"]  # type: ignore[index]
    for form in FORMS:
        (inc,) = analyze_paths([str(CORPUS / run / form)]).incidents
        kinds = {v.kind for v in inc.verdicts}
        assert VerdictKind.HEALTHY not in kinds
        for v in inc.verdicts:
            if v.kind is VerdictKind.MISSING_RANK:
                assert list(v.ranks) == [culprit], v.summary
            else:
                assert v.kind is VerdictKind.INCONCLUSIVE and culprit in v.ranks, v.summary


@pytest.mark.parametrize("run", [r for r in RUNS if r.startswith("inturn-healthy")])
def test_the_fixed_pg_config_names_the_group(run: str) -> None:
    (inc,) = analyze_paths([str(CORPUS / run / "pickle-pg")]).incidents
    assert [c.desc for c in inc.incident.comms] == ["default_pg"]
    world = expected(run)["world"]
    assert inc.incident.comms[0].world_ranks == tuple(range(int(str(world))))


def test_a_lost_dump_of_a_rank_dumped_before_the_hang_leaves_it_inconclusive(
    tmp_path: Path,
) -> None:
    """Rank 0 dumped before rank 4 stopped; its dump lost, nothing proves it
    went on after it, and it may be the one that stopped: the stall is never
    healthy, no rank is blamed, and both are named as candidates."""
    run = "inturn-hangs-50ms-middle-8"
    for p in (CORPUS / run / "pickle").iterdir():
        data = p.read_bytes()
        (tmp_path / p.name).write_bytes(data[:100] if p.name.endswith("_0") else data)
    (inc,) = analyze_paths([str(tmp_path)]).incidents
    v = inc.verdicts[0]
    assert v.kind is VerdictKind.INCONCLUSIVE and v.ranks == (0, 4), v.summary
    assert "where the dumps taken last stand" in v.summary
    assert all(w.kind is VerdictKind.INCONCLUSIVE for w in inc.verdicts)
    (whole,) = analyze_paths([str(CORPUS / run / "pickle")]).incidents
    assert [(w.kind, w.ranks) for w in whole.verdicts] == [(VerdictKind.MISSING_RANK, (4,))]

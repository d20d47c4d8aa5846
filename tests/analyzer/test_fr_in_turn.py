"""Flight Recorder dumps taken in turn (tests/data/fr-torch/inturn-*): a real
PyTorch 2.13 job (gloo, 4 and 8 ranks) whose ranks dump one after another,
10, 50 or 200 ms apart, while the job runs (healthy) or after one rank
stopped for good (hang).

In every form (pickle, JSON; pg_config as torch 2.13's gloo writes it, keyed
by '', and fixed, one key per group): a healthy job dumped in turn is healthy
and says the dumps were taken at different moments, never a culprit; a hung
job dumped in turn names the hung rank alone.
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
    hung = [r for r in RUNS if "hang" in r]
    assert len(healthy) >= 6 and len(hung) >= 4
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
        else:
            assert len(inc.verdicts) == 1 and "never entered ALL_REDUCE" in v.summary


@pytest.mark.parametrize("run", [r for r in RUNS if "healthy" in r])
def test_the_fixed_pg_config_names_the_group(run: str) -> None:
    (inc,) = analyze_paths([str(CORPUS / run / "pickle-pg")]).incidents
    assert [c.desc for c in inc.incident.comms] == ["default_pg"]
    world = expected(run)["world"]
    assert inc.incident.comms[0].world_ranks == tuple(range(int(str(world))))

"""The Flight Recorder corpus (tests/data/fr-torch): dumps a real PyTorch 2.13
wrote (gloo, 4 and 8 ranks), each with the first verdict its dumps support.

Every run, in both forms torch writes (pickle and JSON), in many file orders
(every order of 4 files; a seeded sample and the reverse for 8): the first
verdict's kind and world ranks are the expected ones.  Healthy runs exit 0;
everything else exits 1.  Then the same runs with dumps made unreadable:
a lost dump is judged only from its peers' records, listed before the
verdicts (once, on stdout: the report names it), and never blamed.
"""

from __future__ import annotations

import itertools
import json
import random
import shutil
from pathlib import Path

import pytest

from stallwatch.analyzer.pipeline import AnalysisResult, analyze_paths
from stallwatch.analyzer.verdict import Verdict, VerdictKind
from stallwatch.cli import main

CORPUS = Path(__file__).resolve().parents[1] / "data" / "fr-torch"
RUNS = sorted(p.name for p in CORPUS.iterdir() if (p / "expected.json").is_file())


def expected(run: str) -> dict[str, object]:
    doc: dict[str, object] = json.loads((CORPUS / run / "expected.json").read_text())
    return doc


def files(run: str, form: str) -> list[str]:
    return sorted(str(p) for p in (CORPUS / run / form).iterdir())


def orders(paths: list[str]) -> list[list[str]]:
    if len(paths) <= 4:
        return [list(p) for p in itertools.permutations(paths)]
    rng = random.Random(len(paths))
    sample = [paths, paths[::-1]]
    for _ in range(10):
        p = list(paths)
        rng.shuffle(p)
        sample.append(p)
    return sample


def first(result: AnalysisResult) -> Verdict:
    (incident,) = result.incidents
    return incident.verdicts[0]


def test_the_corpus_is_there() -> None:
    assert len(RUNS) >= 50
    worlds = {expected(r)["world"] for r in RUNS}
    assert worlds == {4, 8}
    kinds = {expected(r)["verdict"]["kind"] for r in RUNS}  # type: ignore[index]
    assert kinds >= {"healthy", "missing_rank", "desync", "inconclusive"}


@pytest.mark.parametrize("run", RUNS)
def test_dumps_are_what_the_run_says(run: str) -> None:
    doc = expected(run)
    facts = doc["ranks"]
    assert isinstance(facts, list)
    dumped = sorted(f["rank"] for f in facts if f["dumped"])
    for form, suffix in (("pickle", ""), ("json", ".json")):
        names = sorted(p.name for p in (CORPUS / run / form).iterdir())
        assert names == sorted(f"nccl_trace_rank_{r}{suffix}" for r in dumped)
    assert doc["no_dump"] == [f["rank"] for f in facts if not f["dumped"]]


@pytest.mark.parametrize("form", ["pickle", "json"])
@pytest.mark.parametrize("run", RUNS)
def test_first_verdict_in_every_order(run: str, form: str) -> None:
    want = expected(run)["verdict"]
    assert isinstance(want, dict)
    paths = files(run, form)
    for order in orders(paths) if form == "pickle" else orders(paths)[:3]:
        v = first(analyze_paths(order))
        assert (v.kind.value, list(v.ranks)) == (want["kind"], want["ranks"]), (order, v.summary)


@pytest.mark.parametrize("run", RUNS)
def test_exit_code(run: str, capsys: pytest.CaptureFixture[str]) -> None:
    healthy = expected(run)["verdict"]["kind"] == "healthy"  # type: ignore[index]
    code = main(["analyze", str(CORPUS / run / "pickle"), "--json"])
    assert code == (0 if healthy else 1)
    doc = json.loads(capsys.readouterr().out)
    assert all(i["ok"] for i in doc["inputs"])


def _copy(run: str, tmp: Path) -> Path:
    out = tmp / run
    shutil.copytree(CORPUS / run / "pickle", out)
    return out


def _lose(folder: Path, rank: int, how: str) -> Path:
    p = folder / f"nccl_trace_rank_{rank}"
    if how == "truncated":
        p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2])
    else:
        p.write_text("not a dump\n")
    return p


# dumped at the end: a healthy job dumped in turn (test_fr_in_turn) that loses
# a dump may lose with it the only proof that its dumps were taken at
# different moments, and then reads as the hang it is indistinguishable from
HEALTHY = [
    r
    for r in RUNS
    if expected(r)["verdict"]["kind"] == "healthy"  # type: ignore[index]
    and not expected(r).get("dumps_in_turn_ms")
]
HANGS = [r for r in RUNS if expected(r)["verdict"]["kind"] == "missing_rank"]  # type: ignore[index]


@pytest.mark.parametrize("how", ["truncated", "not a dump"])
@pytest.mark.parametrize("run", HEALTHY)
def test_a_lost_dump_of_a_healthy_run_is_inconclusive(
    run: str, how: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _copy(run, tmp_path)
    world = expected(run)["world"]
    assert isinstance(world, int)
    lost = world - 1
    path = _lose(folder, lost, how)
    code = main(["analyze", str(folder)])
    out, err = capsys.readouterr()
    assert code == 1
    assert (out + err).count(str(path)) == 1  # named once: in the report, before the verdicts
    assert out.index(str(path)) < out.index("INCONCLUSIVE")  # lost inputs before the verdicts
    v = first(analyze_paths([str(folder)]))
    assert v.kind is VerdictKind.INCONCLUSIVE and v.ranks == (lost,)


@pytest.mark.parametrize("run", HANGS)
def test_a_lost_dump_is_not_blamed_and_hides_no_culprit(run: str, tmp_path: Path) -> None:
    culprits = expected(run)["verdict"]["ranks"]  # type: ignore[index]
    assert isinstance(culprits, list)
    world = expected(run)["world"]
    assert isinstance(world, int)
    other = next(r for r in range(world) if r not in culprits)
    folder = _copy(run, tmp_path / "other")
    _lose(folder, other, "truncated")
    v = first(analyze_paths([str(folder)]))
    if expected(run).get("dump_order"):
        # a hang that began while the dumps were taken in turn: the lost
        # rank, whenever its dump was taken, may be the one that stopped
        # (inconclusive); where it was the one proven dumped earlier, the
        # sign of dumps taken in turn is lost with it (the culprit is named)
        named = (v.kind, list(v.ranks)) == (VerdictKind.MISSING_RANK, culprits)
        assert named or (v.kind is VerdictKind.INCONCLUSIVE and other in v.ranks), v.summary
    else:
        assert v.kind is VerdictKind.MISSING_RANK and list(v.ranks) == culprits, v.summary
    # the culprit's own dump lost: nobody with a dump is behind; the lost one
    # is not blamed, the stall is not called healthy
    folder = _copy(run, tmp_path / "culprit")
    for r in culprits:
        _lose(folder, r, "not a dump")
    v = first(analyze_paths([str(folder)]))
    assert v.kind is not VerdictKind.HEALTHY
    assert not (v.kind is VerdictKind.MISSING_RANK and set(v.ranks) & set(culprits)), v.summary


def test_nothing_readable_is_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _copy("allreduce-hang-4", tmp_path)
    for r in range(4):
        _lose(folder, r, "truncated")
    assert main(["analyze", str(folder)]) == 2
    out, err = capsys.readouterr()
    assert "nccl_trace_rank_0" in out + err

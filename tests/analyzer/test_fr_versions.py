"""Flight Recorder files of the recorders torch writes after 2.13
(tests/data/fr-versions, built from the recorder's source: README.md there):
c10d's FlightRecorderHook as torch 2.14 shipped it (one recorder holding
gloo's entries and the hook's "c10d:" ones), as torch 2.15 ships it for
"nccl", nccl2 by default (entries only scheduled or completed, timed-out
work unretired, graph-captured collectives not recorded, one file per
process written from the abort hook: ``synthetic-hook215-*``), and as it is
after 2.15 (one recorder per backend, "nccl2:" names, a file per backend per
rank, a backend that pushes no completion); and torch 2.14's and 2.15's
``pg_config['']`` on the real 2.13 corpus' subgroup jobs.

Every job's first verdict, in both forms and in every order of its files;
then the files a rank stuck in teardown would not leave.
"""

from __future__ import annotations

import ast
import itertools
import json
import pickle
import shutil
from pathlib import Path

import pytest

from stallwatch.analyzer.flightrec import read_flightrec
from stallwatch.analyzer.frwrite import dumps
from stallwatch.analyzer.pipeline import analyze_paths
from stallwatch.analyzer.verdict import Verdict, VerdictKind
from stallwatch.dumpers.schema import State

DATA = Path(__file__).resolve().parents[1] / "data"
VERSIONS = DATA / "fr-versions"
JOBS = sorted(p.name for p in VERSIONS.iterdir() if (p / "expected.json").is_file())


def _want(job: str) -> dict[str, object]:
    doc: dict[str, object] = json.loads((VERSIONS / job / "expected.json").read_text())
    return doc


def _first(paths: list[str]) -> Verdict:
    (inc,) = analyze_paths(paths).incidents
    return inc.verdicts[0]


def test_the_jobs_are_there() -> None:
    assert len(JOBS) == 10
    assert {str(_want(j)["source"]).split(":")[0] for j in JOBS} == {
        "torch 2.14",
        "torch 2.15",
        "after torch 2.15",
    }
    # built by hand, to the source's schema: named so
    assert all(
        j.startswith("synthetic-") for j in JOBS if str(_want(j)["source"]).startswith("torch 2.15")
    )


@pytest.mark.parametrize("form", ["pickle", "json"])
@pytest.mark.parametrize("job", JOBS)
def test_first_verdict_in_every_order(job: str, form: str) -> None:
    want = _want(job)["verdict"]
    assert isinstance(want, dict)
    paths = sorted(str(p) for p in (VERSIONS / job / form).iterdir())
    orders = itertools.permutations(paths) if len(paths) <= 4 else [paths, paths[::-1]]
    for order in orders:
        v = _first(list(order))
        assert (v.kind.value, list(v.ranks)) == (want["kind"], want["ranks"]), v.summary


def test_a_group_of_two_backends_is_two_communicators() -> None:
    """torch 2.14: gloo records a 'cpu:gloo,cuda:nccl2' group's CPU ops with
    its own sequence, the hook every op with another: one group, two
    communicators, each matched on its own seqs (read as one, the CPU and
    CUDA calls of a seq disagree on every count)."""
    d = read_flightrec(str(VERSIONS / "hook214-mixed-hang-4" / "pickle" / "nccl_trace_rank_0"))
    assert sorted(set(zip(d.pg_names, d.pg_backends, strict=True))) == [
        ("0", "c10d"),
        ("0", "gloo"),
    ]
    (inc,) = analyze_paths([str(VERSIONS / "hook214-mixed-hang-4" / "pickle")]).incidents
    assert sorted(c.label for c in inc.incident.comms) == ["0 (c10d)", "0 (gloo)"]
    v = inc.verdicts[0]
    assert v.kind is VerdictKind.MISSING_RANK and "group 0 (c10d): default_pg" in v.summary


def test_the_hook_s_retired_is_not_a_completion() -> None:
    """The hook retires an entry when its op is issued (in 2.14 always; after
    2.15 on backends that push no completion): the call returned, nothing
    more.  Read as ended, the ranks waiting in a CUDA all_reduce look done."""
    d = read_flightrec(str(VERSIONS / "hook216-custom-hang-4" / "pickle" / "mycomm_trace_rank_0"))
    raw = pickle.loads((VERSIONS / "hook216-custom-hang-4/pickle/mycomm_trace_rank_0").read_bytes())
    assert all(e["retired"] and e["state"] == "scheduled" for e in raw["entries"])
    assert not d.entries["ended"].any()
    assert set(d.entries["state"].tolist()) == {State.ENQUEUED}  # issued, returned


def test_a_rank_s_files_are_one_rank() -> None:
    """After 2.15 a rank dumps each backend's recorder on its own: its files
    are one process, named together."""
    (inc,) = analyze_paths([str(VERSIONS / "hook216-nccl2-hang-4" / "pickle")]).incidents
    procs = inc.incident.procs
    assert [p.world_rank for p in procs] == [0, 1, 2, 3]
    assert procs[2].host == "gloo_trace_rank_2, nccl2_trace_rank_2"
    assert len(inc.incident.sources) == 8


# --- torch 2.15: the hook's recorder, dumped once from the abort hook ----------


def _raw(job: str) -> dict[int, dict[str, object]]:
    return {
        int(p.name.rsplit("_", 1)[1]): pickle.loads(p.read_bytes())
        for p in (VERSIONS / job / "pickle").iterdir()
    }


def test_torch_2_15_entries_are_only_scheduled_or_completed() -> None:
    """No CUDA events: an entry is "scheduled" until its completion is
    pushed, then "completed" with its started time the completion's; a
    timed-out or failed one stays scheduled and unretired.  Read: a
    completed entry ended, an unretired one is in flight."""
    for job in (j for j in JOBS if j.startswith("synthetic-hook215")):
        for rank, doc in _raw(job).items():
            entries = doc["entries"]
            assert isinstance(entries, list)
            assert {e["state"] for e in entries} <= {"scheduled", "completed"}, job
            for e in entries:
                done = e["state"] == "completed"
                assert e["retired"] is done
                assert (
                    e["time_discovered_started_ns"] == e["time_discovered_completed_ns"]
                ) or not done
            path = next((VERSIONS / job / "pickle").glob(f"*_rank_{rank}"))
            d = read_flightrec(str(path))
            assert d.entries["ended"].tolist() == [e["state"] == "completed" for e in entries]


def test_torch_2_15_writes_a_file_only_where_a_process_aborted() -> None:
    """The hung rank never aborts (no collective of its times out): it
    leaves no file, is never blamed, and is named as the one no dump shows
    while every other rank waits."""
    ranks = sorted(_raw("synthetic-hook215-nccl2-hang-4"))
    assert ranks == [0, 1, 3]
    (inc,) = analyze_paths([str(VERSIONS / "synthetic-hook215-nccl2-hang-4" / "pickle")]).incidents
    (v,) = inc.verdicts
    assert v.kind is VerdictKind.INCONCLUSIVE and v.ranks == (2,), v.summary
    assert "left no readable dump" in v.summary


def test_torch_2_15_graph_captured_collectives_leave_no_entry() -> None:
    """A captured collective is not recorded and advances no sequence (its
    group's op_id counts it): the eager calls' seqs follow one another, the
    files are not damaged, and the healthy job is healthy."""
    for rank, doc in _raw("synthetic-hook215-nccl2-graphs-healthy-4").items():
        entries = doc["entries"]
        assert isinstance(entries, list)
        seqs = [e["collective_seq_id"] for e in entries]
        ops = [e["op_id"] for e in entries]
        assert seqs == list(range(1, len(seqs) + 1)), rank
        assert any(b - a > 1 for a, b in itertools.pairwise(ops)), rank  # the captured ones
    (inc,) = analyze_paths(
        [str(VERSIONS / "synthetic-hook215-nccl2-graphs-healthy-4" / "pickle")]
    ).incidents
    assert [v.kind for v in inc.verdicts] == [VerdictKind.HEALTHY]
    assert all(
        s.ok
        for s in analyze_paths(
            [str(VERSIONS / "synthetic-hook215-nccl2-graphs-healthy-4" / "pickle")]
        ).inputs
    )


def test_torch_2_15_dumps_of_one_stall_are_not_a_culprit() -> None:
    """Every process dumped standing in one all_reduce (one failed there, the
    others timed out waiting): a stall they share, never healthy, no rank
    named; with subgroups, a rank waiting in its pair is not a candidate
    beside the one no file shows."""
    (inc,) = analyze_paths([str(VERSIONS / "synthetic-hook215-nccl2-error-4" / "pickle")]).incidents
    (v,) = inc.verdicts
    assert v.kind is VerdictKind.INCONCLUSIVE and v.ranks == (), v.summary
    assert "a stall they all share" in v.summary
    (inc,) = analyze_paths(
        [str(VERSIONS / "synthetic-hook215-nccl2-groups-hang-4" / "pickle")]
    ).incidents
    (v,) = inc.verdicts
    assert v.kind is VerdictKind.INCONCLUSIVE and v.ranks == (3,), v.summary


def _copy(job: str, tmp: Path) -> Path:
    out = tmp / job
    shutil.copytree(VERSIONS / job / "pickle", out)
    return out


def test_files_a_rank_in_teardown_never_wrote(tmp_path: Path) -> None:
    """Missing files are the normal case: a rank without its nccl2 file (its
    gloo one there) has no dump of the nccl2 communicator, and is judged
    only from its peers; without any file, from its peers everywhere; the
    culprit's files gone, nobody is blamed."""
    folder = _copy("hook216-nccl2-hang-4", tmp_path / "one")
    (folder / "nccl2_trace_rank_1").unlink()
    (inc,) = analyze_paths([str(folder)]).incidents
    v = inc.verdicts[0]
    assert v.kind is VerdictKind.MISSING_RANK and v.ranks == (2,), v.summary
    assert any("rank(s) 1 have no readable dump" in u for u in inc.unjudged)
    folder = _copy("hook216-nccl2-hang-4", tmp_path / "both")
    for p in folder.glob("*_rank_1"):
        p.unlink()
    v = _first([str(folder)])
    assert v.kind is VerdictKind.MISSING_RANK and v.ranks == (2,), v.summary
    folder = _copy("hook216-nccl2-hang-4", tmp_path / "culprit")
    for p in folder.glob("*_rank_2"):
        p.unlink()
    v = _first([str(folder)])
    assert v.kind is VerdictKind.INCONCLUSIVE and v.ranks == (2,), v.summary


def test_a_recorder_dumped_twice_is_read_once(tmp_path: Path) -> None:
    """Two files of one rank holding the same communicator (a recorder dumped
    on failure and again by the debug server): the later one is read."""
    folder = _copy("hook216-nccl2-hang-4", tmp_path)
    doc = pickle.loads((folder / "nccl2_trace_rank_0").read_bytes())
    doc["entries"] = doc["entries"][:-3]  # dumped earlier: fewer entries
    (folder / "early_nccl2_trace_rank_0").write_bytes(dumps(doc))
    (inc,) = analyze_paths([str(folder)]).incidents
    assert inc.verdicts[0].ranks == (2,)
    assert any(
        "early_nccl2_trace_rank_0: rank 0's calls on '0 (nccl2)'" in n for n in inc.incident.notes
    )


# --- pg_config[''] of torch 2.14 and 2.15 on the 2.13 corpus -------------------

CORPUS = DATA / "fr-torch"
GROUPS = sorted(p.name for p in CORPUS.glob("groups-*"))


def _pg_config_of(version: str, doc: dict[str, object], rank: int, world: int) -> None:
    """gloo registers every group under the empty name (its uid and desc are
    not set yet): 2.13 writes the ranks of the first group ('[0, 1, ...]' for
    the world, '[]' later); 2.14 the first subgroup's ranks on every rank,
    members or not; 2.15 the first subgroup's on its members and the world's
    on the others.  The groups job's first subgroup is ``half``."""
    half = list(range(world // 2))
    ranks = half if version == "2.14" or rank in half else list(range(world))
    doc["pg_config"] = {"": {"name": "", "desc": "", "ranks": str(ranks)}}


@pytest.mark.parametrize("version", ["2.14", "2.15"])
@pytest.mark.parametrize("run", GROUPS)
def test_pg_config_of_later_gloo(run: str, version: str, tmp_path: Path) -> None:
    want = json.loads((CORPUS / run / "expected.json").read_text())["verdict"]
    world = int(run.rsplit("-", 1)[1])
    out = tmp_path / run
    out.mkdir()
    for p in (CORPUS / run / "pickle").iterdir():
        doc = pickle.loads(p.read_bytes())
        assert ast.literal_eval(doc["pg_config"][""]["ranks"]) in ([], list(range(world)))
        _pg_config_of(version, doc, int(p.name.rsplit("_", 1)[1]), world)
        (out / p.name).write_bytes(dumps(doc))
    v = _first([str(out)])
    assert (v.kind.value, list(v.ranks)) == (want["kind"], want["ranks"]), v.summary

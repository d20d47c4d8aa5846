"""torchfrtrace (torch 2.13's ``torch.distributed.flight_recorder.fr_trace``,
torch from the test extra) on ``stallwatch export --flight-recorder`` of
recorded lab incidents: a hang, a desync and a crash on 2 nodes x 2 ranks
and 4 x 2, each recorded twice, once short (tests/data/lab-<fault>-<shape>:
every rank's window holds all its calls) and once long enough that the
windows read of every rank are incomplete and start at different seqs of
one communicator (tests/data/lab-<fault>-<shape>-wrapped).

- torchfrtrace's first report names the rank ``analyze`` names.  The lab's
  job sends and reduces in the same communicators, which torchfrtrace
  cannot read (``find_coalesced_group_with_non_p2p`` takes a collective and
  the p2p call after it for one coalesced group; docs/flight-recorder.md):
  it reads the exports without point-to-point calls (``--collectives-only``).
- Each group is written from the window every member holds, its seqs as
  torch numbers them.
- No verdict depends on the files' ``stallwatch`` section: without it, the
  same ranks at the same seqs (it adds how a process ended: a crash reads as
  a rank that stopped, without it).

torchfrtrace runs in one process for every folder (its ``main`` with the
command line's arguments: torch is imported once), and once as users run it.
"""

from __future__ import annotations

import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from stallwatch.analyzer.pipeline import AnalysisResult, analyze_paths
from stallwatch.cli import main
from stallwatch.dumpers.schema import Op

DATA = Path(__file__).resolve().parents[1] / "data"
CULPRITS = {
    "hang-2x2": ("missing_rank", (3,)),
    "hang-4x2": ("missing_rank", (5,)),
    "desync-2x2": ("desync", (1,)),
    "desync-4x2": ("desync", (6,)),
    "crash-2x2": ("rank_exited", (2,)),
    "crash-4x2": ("rank_exited", (5,)),
}
NAMES = sorted(CULPRITS) + sorted(f"{n}-wrapped" for n in CULPRITS)
FR_TRACE = "torch.distributed.flight_recorder.fr_trace"
# torchfrtrace's main on each folder given, its reports after a marker line
DRIVER = f"""
import sys
from {FR_TRACE} import main
for folder in sys.argv[1:]:
    print("=== " + folder, file=sys.stderr, flush=True)
    try:
        main([folder, "-p", "rank_"])
    except Exception as exc:
        print("!!! " + type(exc).__name__ + ": " + str(exc), file=sys.stderr, flush=True)
"""


def _culprit(name: str) -> tuple[str, tuple[int, ...]]:
    return CULPRITS[name.removesuffix("-wrapped")]


def first_report(text: str) -> set[int] | str:
    """The ranks torchfrtrace's first report names (missing, or the culprit
    of a mismatch), else what it said."""
    missing = re.search(
        r"Not all ranks joining collective.*?missing ranks: \{([\d, ]+)\}", text, re.S
    )
    culprit = re.search(r"has errors.*?Culprit rank (\d+)", text, re.S)
    found = [m for m in (missing, culprit) if m is not None]
    if not found:
        return text.strip()[-300:] or "nothing"
    first = min(found, key=lambda m: m.start())
    return {int(x) for x in first.group(1).split(",")}


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, AnalysisResult]]:
    """Each incident analyzed, and exported by the command without p2p calls."""
    out = {}
    for name in NAMES:
        folder = tmp_path_factory.mktemp(name) / "fr"
        code = main(
            ["export", "--flight-recorder", str(DATA / f"lab-{name}"), "--collectives-only",
             "-o", str(folder)]
        )  # fmt: skip
        assert code == 0, name
        out[name] = (folder, analyze_paths([str(DATA / f"lab-{name}")]))
    return out


@pytest.fixture(scope="module")
def reports(exported: dict[str, tuple[Path, AnalysisResult]]) -> dict[str, str]:
    folders = [str(exported[n][0]) for n in NAMES]
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, *folders], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    parts = re.split(r"^=== (.+)$", done.stderr, flags=re.M)
    by_folder = dict(zip(parts[1::2], parts[2::2], strict=True))
    return {n: by_folder[str(exported[n][0])] for n in NAMES}


def test_the_incidents_are_what_they_say(exported: dict[str, tuple[Path, AnalysisResult]]) -> None:
    for name in NAMES:
        (inc,) = exported[name][1].incidents
        v = inc.verdicts[0]
        assert (v.kind.value, v.ranks) == _culprit(name), name
        complete = {p.window_complete for p in inc.incident.procs}
        assert complete == ({False} if name.endswith("-wrapped") else {True}), name


def _starts(folder: Path) -> dict[str, dict[int, int]]:
    """Group -> rank -> the first collective seq of the group in its file."""
    out: dict[str, dict[int, int]] = {}
    for p in folder.iterdir():
        rank = int(p.name.removeprefix("rank_"))
        for e in pickle.loads(p.read_bytes())["entries"]:  # plain dicts, as torch's
            out.setdefault(e["process_group"][0], {}).setdefault(rank, e["collective_seq_id"])
    return out


def test_the_wrapped_windows_start_apart_and_the_files_start_together(
    exported: dict[str, tuple[Path, AnalysisResult]],
) -> None:
    """Of each fault, a wrapped incident has a communicator whose members'
    windows start at different seqs; in the files every group starts at one
    seq on every rank that holds it."""
    apart = set()
    for name in NAMES:
        folder, result = exported[name]
        assert all(len(set(g.values())) == 1 for g in _starts(folder).values()), name
        (inc,) = result.incidents
        rows = inc.incident.calls.rows
        rows = rows[~np.isin(rows["op"], [Op.SEND, Op.RECV])]
        for c in range(len(inc.incident.comms)):
            mine = rows[rows["comm"] == c]
            firsts = {int(mine["seq"][mine["proc"] == p].min()) for p in set(mine["proc"].tolist())}
            if len(firsts) > 1:
                apart.add(name)
    assert {n.split("-")[0] for n in apart} == {"hang", "desync", "crash"}, apart
    assert all(n.endswith("-wrapped") for n in apart), apart


@pytest.mark.parametrize("name", NAMES)
def test_torchfrtrace_names_the_rank_analyze_names(
    name: str, exported: dict[str, tuple[Path, AnalysisResult]], reports: dict[str, str]
) -> None:
    (inc,) = exported[name][1].incidents
    assert first_report(reports[name]) == set(inc.verdicts[0].ranks), reports[name][:2000]


def test_torchfrtrace_as_users_run_it(exported: dict[str, tuple[Path, AnalysisResult]]) -> None:
    folder = exported["hang-4x2-wrapped"][0]
    done = subprocess.run(
        [sys.executable, "-m", FR_TRACE, str(folder), "-p", "rank_"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert first_report(done.stdout + done.stderr) == {5}


def _without_section(folder: Path, out: Path) -> Path:
    out.mkdir()
    for p in folder.iterdir():
        doc = pickle.loads(p.read_bytes())
        doc.pop("stallwatch")
        (out / p.name).write_bytes(pickle.dumps(doc))
    return out


@pytest.mark.parametrize("name", NAMES)
def test_no_verdict_depends_on_the_private_section(
    name: str, exported: dict[str, tuple[Path, AnalysisResult]], tmp_path: Path
) -> None:
    """The files' verdicts name the dumps' ranks at the dumps' seqs, counted
    from 1 as torch counts (ours from 0), with the section and without it;
    without it a crash is a rank that stopped (how it ended is the
    section's)."""
    folder, result = exported[name]
    (dumps,) = result.incidents
    (files,) = analyze_paths([str(folder)]).incidents
    (bare,) = analyze_paths([str(_without_section(folder, tmp_path / "bare"))]).incidents
    want = dumps.verdicts[0]
    for got in (files.verdicts[0], bare.verdicts[0]):
        assert got.ranks == want.ranks, got.summary
    assert files.verdicts[0].kind is want.kind
    assert (files.verdicts[0].seq, files.verdicts[0].op) == ((want.seq or 0) + 1, want.op)
    kind = "missing_rank" if want.kind.value == "rank_exited" else want.kind.value
    assert bare.verdicts[0].kind.value == kind, bare.verdicts[0].summary
    if want.kind.value != "rank_exited":
        assert (bare.verdicts[0].seq, bare.verdicts[0].op) == ((want.seq or 0) + 1, want.op)

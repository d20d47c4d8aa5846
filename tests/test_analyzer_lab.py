"""End to end: real lab incidents recorded by real agents, then analyzed.

Each case runs ``stallwatch lab run --record`` (network namespaces, one
agent per node, the lab's libnccl doing real collectives over TCP), then
``analyze`` on the dumps it wrote, and checks the verdict names the rank the
fault was injected into, and its host.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from analyzer.pipeline import analyze_paths
from analyzer.verdict import VerdictKind

ROOT = Path(__file__).resolve().parent.parent

CASES = [
    # (id, lab arguments, expected first verdict, culprit ranks, culprit hosts)
    ("hang", ["--nodes", "2", "--fault", "hang:rank=3,step=8"], "missing_rank", [3], ["node1"]),
    (
        "hang-async-4",
        ["--nodes", "4", "--mode", "async", "--fault", "hang:rank=5,step=8"],
        "missing_rank",
        [5],
        ["node2"],
    ),
    (
        "crash",
        ["--nodes", "2", "--fault", "crash:rank=2,step=8,signal=KILL"],
        "rank_exited",
        [2],
        ["node1"],
    ),
    (
        "mismatch",
        ["--nodes", "2", "--fault", "mismatch:rank=1,step=8,field=count"],
        "desync",
        [1],
        ["node0"],
    ),
]


def lab_run(tmp: Path, args: list[str]) -> list[Path]:
    cmd = [
        sys.executable,
        "-m",
        "stallwatch",
        "lab",
        "run",
        "--ranks-per-node",
        "2",
        "--steps",
        "20",
        "--record",
        "--dump-dir",
        str(tmp),
        "--stall-timeout",
        "5",
        *args,
    ]
    subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    return sorted(tmp.rglob("*.msgpack"))


@pytest.mark.lab
@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "kind", "ranks", "hosts"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_lab_incident_is_named(
    tmp_path: Path, args: list[str], kind: str, ranks: list[int], hosts: list[str]
) -> None:
    dumps = lab_run(tmp_path, args)
    nodes = int(args[args.index("--nodes") + 1])
    assert len(dumps) == nodes, f"expected one dump per node, found {dumps}"
    result = analyze_paths([str(tmp_path)])
    assert all(s.ok for s in result.inputs)
    (incident,) = result.incidents
    first = incident.verdicts[0]
    assert first.kind is VerdictKind(kind), [v.summary for v in incident.verdicts]
    assert list(first.ranks) == ranks and list(first.hosts) == hosts
    assert not result.healthy


SLOW_CASES = [
    # A rank that is slow on every step, then (so that the agents dump) a hang
    # of rank 0 late in the run: the hang is the first verdict, the straggler
    # must be named beside it.
    ("slow", ["--fault", "slow:rank=1,ms=100"], "compute_straggler", 1),
    # The hog is pinned to rank 2's CPU; on a machine with two CPUs rank 0
    # shares it and is starved too: rank 2 must be among those named.
    ("cpuhog", ["--fault", "cpuhog:rank=2"], "cpu_interference", 2),
]


@pytest.mark.lab
@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "kind", "rank"), [c[1:] for c in SLOW_CASES], ids=[c[0] for c in SLOW_CASES]
)
def test_lab_straggler_is_named(tmp_path: Path, args: list[str], kind: str, rank: int) -> None:
    dumps = lab_run(tmp_path, ["--nodes", "2", "--fault", "hang:rank=0,step=18", *args])
    assert len(dumps) == 2
    (incident,) = analyze_paths([str(tmp_path)]).incidents
    kinds = {v.kind: v for v in incident.verdicts}
    assert VerdictKind(kind) in kinds, [v.summary for v in incident.verdicts]
    named = {r for v in incident.verdicts if v.kind is VerdictKind(kind) for r in v.ranks}
    assert rank in named
    assert VerdictKind.MISSING_RANK in kinds and kinds[VerdictKind.MISSING_RANK].ranks == (0,)

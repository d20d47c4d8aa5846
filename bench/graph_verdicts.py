"""Verdicts inside CUDA graph replays, over seeded lab runs.

Each run is the lab's 4x2 job in gpu mode with ``--graphs`` (each step one
launch of a graph of the step's collectives), recorded by one agent per
node; the seed draws the faulty rank and the step (past the capture):

- hang: the rank never launches replay k;
- gpuhang: it launches it and its device never starts it.

A run counts when the first verdict is ``missing_rank`` naming exactly the
injected rank.

    python -m bench.graph_verdicts [--seeds N]   (root: network namespaces, eBPF)
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import Figure, render

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("hang", "gpuhang")


def graph_fault(kind: str, seed: int) -> tuple[int, str]:
    """The rank and the fault spec a seed draws: any rank, a step past the capture."""
    rng = random.Random(f"{kind}-{seed}")
    rank, step = rng.randrange(8), rng.randrange(2, 9)
    return rank, f"{kind}:rank={rank},step={step}"


def recorded_run(folder: Path, *args: str) -> list[Path]:
    """The lab's 4x2 gpu job with --graphs, recorded into ``folder``; its dumps."""
    cmd = [sys.executable, "-m", "stallwatch", "lab", "run", "--mode", "gpu", "--graphs"]
    cmd += ["--nodes", "4", "--ranks-per-node", "2", "--steps", "10", "--record"]
    cmd += ["--dump-dir", str(folder), "--stall-timeout", "5", "--timeout", "120", *args]
    subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    return sorted(folder.rglob("*.msgpack"))


def first_verdict(folder: Path) -> tuple[str, list[int]]:
    from stallwatch.analyzer.pipeline import analyze_paths

    incidents = analyze_paths([str(folder)]).incidents
    if len(incidents) != 1 or not incidents[0].verdicts:
        return f"{len(incidents)} incidents", []
    v = incidents[0].verdicts[0]
    return v.kind.value, [int(r) for r in v.ranks if r is not None]


def figures(seeds: int, kinds: tuple[str, ...] = KINDS) -> list[Figure]:
    out = []
    for kind in kinds:
        right, wrong = 0, []
        for seed in range(seeds):
            rank, fault = graph_fault(kind, seed)
            with tempfile.TemporaryDirectory() as tmp:
                recorded_run(Path(tmp), "--fault", fault)
                verdict = first_verdict(Path(tmp))
            if verdict == ("missing_rank", [rank]):
                right += 1
            else:
                wrong.append(f"{fault}: {verdict[0]} {verdict[1]}")
            print(f"{fault}: {verdict[0]} {verdict[1]}", file=sys.stderr, flush=True)
        anchor = "; ".join(wrong) or f"every seed of {seeds}"
        name = f"{kind} in a replay, injected rank named"
        out.append(Figure(name, right, f"of {seeds}", "", None, anchor))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.graph_verdicts", description=__doc__)
    parser.add_argument("--seeds", type=int, default=10, help="runs per fault")
    parser.add_argument("--kind", choices=KINDS, action="append", help="only this fault")
    args = parser.parse_args(argv)
    print(render(figures(args.seeds, tuple(args.kind or KINDS))))
    return 0


if __name__ == "__main__":
    sys.exit(main())

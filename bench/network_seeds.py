"""Network faults over seeds: the lab job with a neighbour churning TCP
connections, one network fault injected mid-run on a node the seed picks, at
a step it picks; counts the runs whose first verdict is a network verdict
naming that node alone (the pair, with two nodes).

Faults: ``partition`` (every packet of the node dropped for good),
``flap`` (dropped for 3-5 s, then the job goes on; dumped at its end),
``linkdown`` (the node's veth loses carrier for good), ``loss`` (8% of the
node's packets dropped from a step; dumped at the end: a network
straggler), ``rst`` (the node's connections reset).  The lossy-node
straggler of the issue runs apart (``--lossy``): 4x2, 4-8% loss from the
start, blocking and async, dumped at the end, no neighbour.

    python -m bench.network_seeds [--seeds 10] [--faults partition flap ...]
                                  [--shapes 3x2 4x2] [--waits block spin] [--lossy]
                                  [--out DIR] [--reanalyze | --resume]

``--reanalyze`` runs nothing: it analyzes again the runs kept in ``--out``
(the recordings are the expensive part; a rule changed is judged on them).
``--resume`` runs only the runs not kept in ``--out`` yet and analyzes the
kept ones again: a run of many seeds stopped part way goes on.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FAULTS = ("partition", "flap", "linkdown", "loss", "rst")
SHAPES = ((3, 2), (4, 2))
WAITS = ("block", "spin")
CHURN = 2000  # neighbour connections a second
STEPS = 260
NETWORK_KINDS = ("network_partition", "network_straggler")


@dataclass(frozen=True)
class Run:
    fault: str
    nodes: int
    ranks_per_node: int
    wait: str
    mode: str
    seed: int
    churn: int = CHURN

    @property
    def name(self) -> str:
        shape = f"{self.nodes}x{self.ranks_per_node}"
        return f"{self.fault}-{shape}-{self.wait}-{self.mode}-seed{self.seed}"

    def pick(self) -> tuple[int, int, float]:
        """The node, the step and (flaps) the outage the seed picks."""
        rnd = random.Random(f"{self.fault}-{self.nodes}x{self.ranks_per_node}-{self.seed}")
        return rnd.randrange(self.nodes), rnd.randrange(60, 120), rnd.uniform(3000, 5000)


def spec(run: Run) -> tuple[list[str], bool]:
    """The lab's fault options for a run, and whether it is dumped at its end."""
    node, step, ms = run.pick()
    if run.fault == "partition":
        return [f"partition:node={node},step={step}"], False
    if run.fault == "flap":
        return [f"partition:node={node},step={step},ms={ms:.0f}"], True
    if run.fault == "linkdown":
        return [f"linkdown:node={node},step={step}"], False
    if run.fault == "loss":
        return [f"loss:node={node},pct=8,step={step}"], True
    if run.fault == "rst":
        return [f"rst:node={node},step={step}"], False
    if run.fault == "lossy":
        pct = random.Random(run.seed).randint(4, 8)
        return [f"loss:node={node},pct={pct}"], True
    raise ValueError(run.fault)


def analyze(folder: Path) -> dict[str, Any]:
    verdict = subprocess.run(
        [sys.executable, "-m", "stallwatch", "analyze", str(folder / "dumps"), "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    (folder / "analyze.json").write_text(verdict.stdout)
    try:
        return dict(json.loads(verdict.stdout))
    except ValueError:
        return {"incidents": [], "error": verdict.stderr.strip()[-300:]}


def lab_run(run: Run, folder: Path) -> dict[str, Any]:
    faults, at_end = spec(run)
    argv = [sys.executable, "-m", "stallwatch", "lab", "run", "--record", "--json"]
    argv += ["--nodes", str(run.nodes), "--ranks-per-node", str(run.ranks_per_node)]
    _, step, _ = run.pick()
    # a lossy job is slow: its run ends some 60 steps after the loss began
    steps = {"loss": step + 60, "lossy": 100}.get(run.fault, STEPS)
    argv += ["--steps", str(steps), "--wait", run.wait, "--timeout", "900"]
    argv += ["--mode", run.mode, "--dump-dir", str(folder / "dumps")]
    argv += ["--stall-timeout", "30" if at_end else "5"]
    argv += ["--dump-at-end"] if at_end else []
    argv += ["--neighbour-churn", str(run.churn)] if run.churn else []
    for f in faults:
        argv += ["--fault", f]
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    (folder / "lab.json").write_text(done.stdout)
    (folder / "lab.err").write_text(done.stderr)
    return analyze(folder)


def names_the_node_alone(run: Run, result: dict[str, Any]) -> tuple[bool, str]:
    """Whether the first verdict is a network verdict naming the node (the
    pair, with two nodes) and no other host."""
    node, _, _ = run.pick()
    verdicts = [v for inc in result.get("incidents", []) for v in inc.get("verdicts", [])]
    if not verdicts:
        return False, result.get("error", "no verdict")
    top = verdicts[0]
    want = {f"node{node}"} if run.nodes > 2 else {f"node{k}" for k in range(run.nodes)}
    good = top["kind"] in NETWORK_KINDS and set(top["hosts"]) == want
    return good, f"{top['kind']}: {top['summary']}"


def runs(faults: list[str], shapes: list[tuple[int, int]], waits: list[str], seeds: int,
         lossy: bool) -> list[Run]:  # fmt: skip
    out = [
        Run(fault, n, r, wait, "blocking", seed)
        for seed in range(seeds)
        for fault in faults
        for n, r in shapes
        for wait in waits
    ]
    if lossy:
        out += [
            Run("lossy", 4, 2, "block", mode, seed, churn=0)
            for seed in range(seeds)
            for mode in ("blocking", "async")
        ]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS))
    p.add_argument("--shapes", nargs="+", default=[f"{n}x{r}" for n, r in SHAPES])
    p.add_argument("--waits", nargs="+", choices=WAITS, default=list(WAITS))
    p.add_argument("--lossy", action="store_true", help="the lossy-node straggler runs too")
    p.add_argument("--only-lossy", action="store_true", help="the lossy-node straggler alone")
    p.add_argument("--out", type=Path, default=None, help="keep the dumps here")
    p.add_argument("--reanalyze", action="store_true", help="analyze the runs kept in --out again")
    p.add_argument(
        "--resume", action="store_true", help="run what --out lacks, analyze what it keeps"
    )
    args = p.parse_args(argv)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    out = args.out or Path(tempfile.mkdtemp(prefix="network-seeds-"))
    todo = runs([] if args.only_lossy else args.faults, shapes, args.waits, args.seeds,  # type: ignore[arg-type]
                args.lossy or args.only_lossy)  # fmt: skip
    tally: dict[str, list[int]] = {}
    for run in todo:
        if args.reanalyze and not (out / run.name / "dumps").is_dir():
            continue
        kept = (out / run.name / "lab.json").is_file() and (out / run.name / "dumps").is_dir()
        again = args.reanalyze or (args.resume and kept)
        result = analyze(out / run.name) if again else lab_run(run, out / run.name)
        good, top = names_the_node_alone(run, result)
        key = f"{run.fault} {run.nodes}x{run.ranks_per_node} {run.wait} {run.mode}"
        count = tally.setdefault(key, [0, 0])
        count[0] += good
        count[1] += 1
        node, step, _ = run.pick()
        print(f"{run.name} node{node} step {step}: {'ok' if good else 'WRONG'}: {top}", flush=True)
    print("== " + "; ".join(f"{k}: {g}/{n}" for k, (g, n) in tally.items()), flush=True)
    return 0 if all(g == n for g, n in tally.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Slowdowns over seeds: the lab job recorded by its agents as deployed (the
slowdown trigger on, its defaults), a fault injected mid-run on a rank or a
node the seed picks, at a step it picks; for each run, the time from the
fault's start (``lab run --json``, monotonic) to the first incident an agent
raised (the dumps' triggers, same clock), whether every node dumped it, and
whether the first verdict names the fault's rank (or node) and nothing else (a
node's network fault: as a network verdict, not a rank of it).

Faults: ``slow`` (a rank computes 150 ms longer a step), ``cpuhog`` (busy
processes on a rank's CPU), ``gpuslow`` (gpu mode: a rank's device work
150 ms slower), ``rate`` (a node's link capped at 8 Mbit/s), ``loss`` (8% of
a node's packets dropped), ``flap`` (a node cut off for 3-5 s, then back).
Every run has checkpoints before the fault (rank 0 pausing 1.5 s every 100
steps, the others waiting): an incident before the fault is a false one.

``--rejudge DIR`` judges the runs an earlier ``--out DIR`` kept again, by
today's analyzer (the lab's account and the dumps are read; no job runs).

``--healthy MINUTES`` runs healthy jobs instead, with checkpoints, across the
modes (blocking with blocked and spinning waits, async, gpu, gpu with
graphs) until that much time has passed, and counts incidents (none is
right).

    python -m bench.slowdown_seeds [--seeds 10] [--first-seed 0] [--faults slow rate ...]
                                   [--shapes 3x2 4x2] [--before 1200] [--after 250]
                                   [--healthy MINUTES [--modes gpu-block ...]] [--out DIR]

``--before`` is the steps before the fault (the trigger needs 30 s of
baseline: at 30-100 ms a step, 1,200 is enough), but at most
``BEFORE_CAP`` in gpu mode (0.13-0.7 s a step here, with the machine quiet
or loaded: 1,200 steps took 4-14 minutes; 400 are 52 s or more, more than
the 30 s a baseline needs); small values are for a smoke test only.
``--after`` is the steps after it, but at most ``AFTER_CAP`` of a fault that
slows each step (a rate cap: 3-4 s a step on 3x2, so 250 steps took 16
minutes a run; 25 are 90 s or more, three times the 30 s an incident is
asked within; a device 150 ms slower: 0.28 s a step or more, 150 steps 42 s).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stallwatch.dumpers.format import read_dump
from stallwatch.dumpers.model import TriggerKind

FAULTS = ("slow", "cpuhog", "gpuslow", "rate", "loss", "flap")
RANK_FAULTS = ("slow", "cpuhog", "gpuslow")
NETWORK_VERDICTS = ("network_partition", "network_straggler")
SHAPES = ((3, 2), (4, 2))
CHECKPOINT = "pause:every=100,ms=1500,rank=0"
WITHIN_NS = 30_000_000_000
AFTER_CAP = {"rate": 25, "gpuslow": 150}  # steps after the fault, at most (see the docstring)
BEFORE_CAP = {"gpuslow": 400}  # steps before it, at most (gpu mode: see the docstring)
# (mode, wait, graphs) of the healthy runs
MODES = (("blocking", "block", False), ("blocking", "spin", False), ("async", "block", False),
         ("gpu", "block", False), ("gpu", "block", True))  # fmt: skip
RAISED = (TriggerKind.SLOWDOWN, TriggerKind.IN_FLIGHT, TriggerKind.NO_PROGRESS, TriggerKind.EXIT)


@dataclass(frozen=True)
class Run:
    fault: str
    nodes: int
    ranks_per_node: int
    seed: int
    before: int  # steps before the fault (it begins within 100 more)
    after: int  # steps after it (at most AFTER_CAP's)

    @property
    def name(self) -> str:
        return f"{self.fault}-{self.nodes}x{self.ranks_per_node}-seed{self.seed}"

    def pick(self) -> tuple[int, int, float]:
        """The rank (or node), the step and (flaps) the outage the seed picks;
        never rank 0, whose checkpoints the others wait for."""
        rnd = random.Random(self.name)
        n = self.nodes * self.ranks_per_node if self.fault in RANK_FAULTS else self.nodes
        who = rnd.randrange(1, n)
        before = min(self.before, BEFORE_CAP.get(self.fault, self.before))
        return who, before + rnd.randrange(0, 100), rnd.uniform(3000, 5000)

    def spec(self) -> str:
        who, step, ms = self.pick()
        return {
            "slow": f"slow:rank={who},ms=150,step={step}",
            "cpuhog": f"cpuhog:rank={who},step={step}",
            "gpuslow": f"gpuslow:rank={who},ms=150,step={step}",
            "rate": f"rate:node={who},mbit=8,step={step}",
            "loss": f"loss:node={who},pct=8,step={step}",
            "flap": f"partition:node={who},step={step},ms={ms:.0f}",
        }[self.fault]


def lab(folder: Path, argv: list[str]) -> dict[str, Any]:
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "stallwatch", "lab", "run", "--record", "--json"]
    cmd += ["--dump-dir", str(folder / "dumps"), "--timeout", "1500", *argv]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    (folder / "lab.json").write_text(done.stdout)
    (folder / "lab.err").write_text(done.stderr)
    try:
        return dict(json.loads(done.stdout))
    except ValueError:
        return {"error": done.stderr.strip()[-300:]}


def triggers(folder: Path) -> list[tuple[str, Any]]:
    """(host, trigger) of every dump the run left."""
    out = []
    for path in sorted((folder / "dumps").rglob("*.msgpack")):
        rec = read_dump(path)
        out.append((rec.host, rec.trigger))
    return out


def top_verdict(folder: Path) -> dict[str, Any] | None:
    cmd = [sys.executable, "-m", "stallwatch", "analyze", str(folder / "dumps"), "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    (folder / "analyze.json").write_text(done.stdout)
    try:
        incidents = json.loads(done.stdout)["incidents"]
    except (ValueError, KeyError):
        return None
    verdicts = [v for inc in incidents for v in inc["verdicts"]]
    return verdicts[0] if verdicts else None


def judge(run: Run, folder: Path) -> tuple[bool, str]:
    who, step, _ = run.pick()
    steps = step + min(run.after, AFTER_CAP.get(run.fault, run.after))
    argv = ["--nodes", str(run.nodes), "--ranks-per-node", str(run.ranks_per_node)]
    argv += ["--steps", str(steps), "--fault", CHECKPOINT, "--fault", run.spec()]
    argv += ["--mode", "gpu"] if run.fault == "gpuslow" else []
    result = lab(folder, argv)
    return judged(run.fault, run.nodes, who, run.spec(), folder, result)


def judged(
    kind: str, nodes: int, who: int, spec: str, folder: Path, result: dict[str, Any]
) -> tuple[bool, str]:
    """A run's outcome from what its lab run said and the dumps it left."""
    fault = next((f for f in result.get("faults", []) if f["spec"] == spec), None)
    if fault is None or not fault.get("injected"):
        return False, f"fault not injected: {result.get('error', '')}"
    seen = triggers(folder)
    raised = [t.time_ns for _, t in seen if t is not None and t.kind in RAISED]
    if not raised:
        return False, "no incident"
    delay = min(raised) - int(fault["injected_ns"])
    nodes_asked, nodes = nodes, {h for h, t in seen if t is not None}
    top = top_verdict(folder)
    if top is None:
        return False, f"{delay / 1e9:.1f} s, no verdict"
    if kind in RANK_FAULTS:
        named = top["ranks"] == [who]
    else:  # the node, and the network as the cause (not a rank of it)
        named = set(top["hosts"]) == {f"node{who}"} and top["kind"] in NETWORK_VERDICTS
    good = 0 < delay <= WITHIN_NS and len(nodes) == nodes_asked and named
    return good, f"{delay / 1e9:.1f} s, {len(nodes)} nodes dumped, {top['kind']}: {top['summary']}"


RUN_FOLDER = re.compile(r"(?P<fault>[a-z]+)-(?P<nodes>\d+)x\d+-seed\d+")


def rejudge(out: Path) -> int:
    """Every run kept under ``out`` judged again, by today's analyzer, from
    its lab run's account and its dumps (no job is run)."""
    tally: dict[str, list[int]] = {}
    for folder in sorted(p for p in out.iterdir() if RUN_FOLDER.fullmatch(p.name)):
        match = RUN_FOLDER.fullmatch(folder.name)
        assert match is not None
        try:
            result = json.loads((folder / "lab.json").read_text())
        except (OSError, ValueError):
            print(f"{folder.name}: no lab account (lab.json)", flush=True)
            continue
        kind = match["fault"]
        spec = next((f["spec"] for f in result.get("faults", []) if f["spec"] != CHECKPOINT), "")
        who = re.search(r"(?:rank|node)=(\d+)", spec)
        if who is None:
            print(f"{folder.name}: no fault in its lab account", flush=True)
            continue
        good, text = judged(kind, int(match["nodes"]), int(who[1]), spec, folder, result)
        count = tally.setdefault(folder.name.rsplit("-seed", 1)[0], [0, 0])
        count[0] += good
        count[1] += 1
        print(f"{folder.name} {spec}: {'ok' if good else 'WRONG'}: {text}", flush=True)
    print("== " + "; ".join(f"{k}: {g}/{n}" for k, (g, n) in tally.items()), flush=True)
    return 0 if tally and all(g == n for g, n in tally.values()) else 1


def mode_name(mode: str, wait: str, graphs: bool) -> str:
    return f"{mode}-{wait}{'-graphs' if graphs else ''}"


def healthy(minutes: float, out: Path, steps: int, modes: list[str]) -> int:
    """Healthy runs with checkpoints across the modes until ``minutes``
    passed; every incident raised is printed (0 is right)."""
    chosen = [m for m in MODES if mode_name(*m) in modes]
    began, false, i = time.monotonic(), 0, 0
    while time.monotonic() - began < minutes * 60:
        mode, wait, graphs = chosen[i % len(chosen)]
        argv = ["--nodes", "3", "--ranks-per-node", "2", "--steps", str(steps)]
        argv += ["--mode", mode, "--wait", wait, "--fault", CHECKPOINT]
        argv += ["--graphs"] if graphs else []
        folder = out / f"healthy-{i}-{mode_name(mode, wait, graphs)}"
        t0 = time.monotonic()
        lab(folder, argv)
        raised = [t for _, t in triggers(folder) if t is not None and t.kind in RAISED]
        false += len(raised)
        print(f"{folder.name}: {time.monotonic() - t0:.0f} s, {len(raised)} incident(s) "
              f"{[t.reason for t in raised]}", flush=True)  # fmt: skip
        i += 1
    print(f"== {i} healthy runs, {(time.monotonic() - began) / 60:.1f} min: {false} incident(s)")
    return 0 if false == 0 else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=10, help="how many seeds")
    p.add_argument("--first-seed", type=int, default=0, help="the first of them")
    p.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS))
    p.add_argument("--shapes", nargs="+", default=[f"{n}x{r}" for n, r in SHAPES])
    p.add_argument("--before", type=int, default=1200, help="steps before the fault")
    p.add_argument("--after", type=int, default=250, help="steps after the fault")
    p.add_argument("--healthy", type=float, metavar="MINUTES", help="healthy runs instead")
    names = [mode_name(*m) for m in MODES]
    p.add_argument("--modes", nargs="+", choices=names, default=names, help="of healthy runs")
    p.add_argument("--out", type=Path, default=None, help="keep the dumps here")
    p.add_argument(
        "--rejudge", type=Path, metavar="DIR", help="judge the runs kept in DIR again (no job)"
    )
    args = p.parse_args(argv)
    if args.rejudge is not None:
        if not args.rejudge.is_dir():
            p.error(f"--rejudge: {args.rejudge} is not a folder")
        return rejudge(args.rejudge)
    out = args.out or Path(tempfile.mkdtemp(prefix="slowdown-seeds-"))
    if args.healthy is not None:
        return healthy(args.healthy, out, args.before + args.after, args.modes)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    tally: dict[str, list[int]] = {}
    for seed in range(
        args.first_seed, args.first_seed + args.seeds
    ):  # seed by seed: stopped early, the counts stay even
        for fault in args.faults:
            for n, r in shapes:
                run = Run(fault, n, r, seed, args.before, args.after)
                good, text = judge(run, out / run.name)
                count = tally.setdefault(f"{fault} {n}x{r}", [0, 0])
                count[0] += good
                count[1] += 1
                print(f"{run.name} {run.spec()}: {'ok' if good else 'WRONG'}: {text}", flush=True)
    print("== " + "; ".join(f"{k}: {g}/{n}" for k, (g, n) in tally.items()), flush=True)
    return 0 if all(g == n for g, n in tally.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

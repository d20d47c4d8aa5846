"""From a fault to the verdict in the detecting agent's log, with the agents
as deployed (``lab run --agent-defaults``: no ``--stall-timeout``; each
communicator's own bound, the 5 s floor, 60 s the ceiling).

Each draw picks, from its seed, a shape (3x2 or 4x2), a fault (a rank that
hangs, a rank that crashes, a rank that passes another count, datatype or op,
a node cut off), its rank or node and its step, and runs the lab job with one
agent per node.  Measured: from the fault firing (the rank's own time, or the
injector's) to the first ``incident ...: verdict:`` line of any agent's log,
and whether each published verdict (its last revision) equals what
``stallwatch analyze`` says of the same dump files.  Prints one line per
draw, then p50, p95 and the largest; exit 1 if the p95 is over 10 s or a
published verdict differs from analyze's.

    python -m bench.verdict_latency [--draws 20] [--first-seed S] [--mode gpu] [--out DIR]

``--mode gpu`` runs the jobs on the lab's CUDA runtime (calls return at once
and complete on the device: their hangs are raised from the work queued on
it); the default is blocking.

Run it alone (``flock /work/.../quiet.lock``): its times are wall times of
the lab's processes on a shared machine.
"""

from __future__ import annotations

import argparse
import glob
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

SHAPES = ((3, 2), (4, 2))
FAULTS = ("hang", "crash", "desync", "partition")
STEPS = 400
TARGET_P95_S = 10.0
EXPECTED = {
    "hang": "missing_rank",
    "crash": "rank_exited",
    "desync": "desync",
    "partition": "network_partition",
}
VERDICT_LINE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*incident (\S+): verdict: (.*)$"
)
INCIDENT_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*incident (\S+) \((\w+)\):")


@dataclass(frozen=True)
class Draw:
    seed: int

    def pick(self) -> tuple[int, int, str, int, int, str]:
        """nodes, ranks per node, fault, target (rank or node), step, spec."""
        rnd = random.Random(f"verdict-latency-{self.seed}")
        nodes, per = rnd.choice(SHAPES)
        fault = rnd.choice(FAULTS)
        step = rnd.randrange(150, 300)
        if fault == "partition":
            node = rnd.randrange(nodes)
            return nodes, per, fault, node, step, f"partition:node={node},step={step}"
        rank = rnd.randrange(nodes * per)
        if fault == "hang":
            return nodes, per, fault, rank, step, f"hang:rank={rank},step={step}"
        if fault == "crash":
            sig = rnd.choice(("", ",signal=KILL", ",signal=SEGV"))
            return nodes, per, fault, rank, step, f"crash:rank={rank},step={step}{sig}"
        field = rnd.choice(("count", "dtype", "op"))
        return nodes, per, fault, rank, step, f"mismatch:rank={rank},step={step},field={field}"


def _wall(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _iso_wall(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def lab_run(draw: Draw, folder: Path, mode: str = "blocking") -> dict[str, Any]:
    nodes, per, _, _, _, spec = draw.pick()
    argv = [sys.executable, "-m", "stallwatch", "lab", "run", "--record", "--json", "--mode", mode]
    argv += ["--agent-defaults", "--stall-timeout", "15", "--timeout", "600"]
    argv += ["--nodes", str(nodes), "--ranks-per-node", str(per), "--steps", str(STEPS)]
    argv += ["--dump-dir", str(folder / "dumps"), "--fault", spec]
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    (folder / "lab.json").write_text(done.stdout)
    (folder / "lab.err").write_text(done.stderr)
    try:
        return dict(json.loads(done.stdout))
    except ValueError:
        return {}


def fault_wall(result: dict[str, Any]) -> float | None:
    for f in result.get("faults", []):
        if f.get("injected_wall"):
            return _iso_wall(f["injected_wall"])
    return None


def log_lines(folder: Path, pattern: re.Pattern[str]) -> list[tuple[float, str, str]]:
    """(wall time, agent, the line's groups after the time) of every agent log."""
    out = []
    for log in sorted((folder / "dumps").glob("*.agent.log")):
        for line in log.read_text(errors="replace").splitlines():
            m = pattern.match(line)
            if m:
                out.append((_wall(m.group(1)), log.name.split(".")[0], "|".join(m.groups()[1:])))
    return sorted(out)


def key_of(doc: dict[str, Any]) -> list[tuple[str, list[Any], list[Any]]]:
    return [
        (v["kind"], v.get("ranks", []), v.get("hosts", []))
        for inc in doc.get("incidents", [])
        for v in inc.get("verdicts", [])
    ]


def check_published(folder: Path) -> list[tuple[str, bool, str]]:
    """Each published verdict file against ``analyze`` of the dump files it
    was gathered from: (incident, equal, what it says)."""
    out = []
    for path in sorted((folder / "dumps").rglob("*.verdict.json")):
        doc = json.loads(path.read_text())
        names = {Path(i["path"]).name for i in doc.get("inputs", []) if i.get("ok")}
        files = [
            p for p in glob.glob(str(folder / "dumps" / "*" / "*.msgpack"))
            if Path(p).name in names
        ]  # fmt: skip
        again = subprocess.run(
            [sys.executable, "-m", "stallwatch", "analyze", "--json", *files],
            capture_output=True,
            text=True,
            timeout=600,
        )
        try:
            theirs = json.loads(again.stdout)
        except ValueError:
            theirs = {}
        pub = doc["publication"]
        top = key_of(doc)[:1]
        said = f"rev {pub['revision']}, {len(files)} dumps: {top}"
        out.append((pub["incident"], key_of(doc) == key_of(theirs), said))
    return out


def measure(draw: Draw, folder: Path, reuse: bool, mode: str = "blocking") -> dict[str, Any]:
    kept = (folder / "lab.json").is_file()
    result = json.loads((folder / "lab.json").read_text()) if reuse and kept else {}
    if not result:
        result = lab_run(draw, folder, mode)
    fired = fault_wall(result)
    verdicts = log_lines(folder, VERDICT_LINE)
    incidents = log_lines(folder, INCIDENT_LINE)
    first = verdicts[0] if verdicts else None
    detected = incidents[0] if incidents else None
    return {
        "fired": fired,
        "detect_s": None if fired is None or detected is None else detected[0] - fired,
        "verdict_s": None if fired is None or first is None else first[0] - fired,
        "line": None if first is None else f"{first[1]}: {first[2]}",
        "published": check_published(folder),
    }


def quantile(values: list[float], q: float) -> float:
    """The nearest-rank quantile (p95 of 20: the 19th)."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, -(-int(q * 100) * len(ordered) // 100) - 1))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draws", type=int, default=20)
    p.add_argument("--first-seed", type=int, default=None, help="default: a fresh random one")
    p.add_argument("--out", type=Path, default=None, help="keep the runs here")
    p.add_argument("--reuse", action="store_true", help="measure the runs kept in --out again")
    p.add_argument("--mode", choices=("blocking", "gpu"), default="blocking")
    args = p.parse_args(argv)
    first = (
        args.first_seed if args.first_seed is not None else random.SystemRandom().randrange(1 << 30)
    )
    out = args.out or Path(tempfile.mkdtemp(prefix="verdict-latency-"))
    print(f"seeds {first}..{first + args.draws - 1}, runs in {out}", flush=True)
    latencies, wrong = [], 0
    for seed in range(first, first + args.draws):
        draw = Draw(seed)
        nodes, per, fault, _, _, spec = draw.pick()
        began = time.monotonic()
        m = measure(draw, out / f"seed{seed}", args.reuse, args.mode)
        took = time.monotonic() - began
        lat = m["verdict_s"]
        if lat is not None:
            latencies.append(lat)
        det = "?" if m["detect_s"] is None else f"{m['detect_s']:.1f}"
        shown = "none" if lat is None else f"{lat:.1f}"
        named = "" if m["line"] and f"|{EXPECTED[fault]}:" in m["line"] else " (UNEXPECTED kind)"
        print(
            f"seed {seed} {nodes}x{per} {args.mode} {spec}: detected {det} s, verdict {shown} s "
            f"(run {took:.0f} s): {m['line']}{named}",
            flush=True,
        )
        for incident, equal, said in m["published"]:
            wrong += not equal
            print(f"    {incident}: {'= analyze' if equal else 'DIFFERS from analyze'}: {said}")
        if lat is None:
            latencies.append(float("inf"))
    finite = [x for x in latencies if x != float("inf")]
    p50, p95 = quantile(latencies, 0.5), quantile(latencies, 0.95)
    print(
        f"== {len(latencies)} draws: verdict after the fault p50 {p50:.1f} s, p95 {p95:.1f} s, "
        f"max {max(finite, default=float('nan')):.1f} s; {len(latencies) - len(finite)} without "
        f"a verdict; {wrong} published verdict(s) differ from analyze of the same dumps",
        flush=True,
    )
    return 0 if p95 <= TARGET_P95_S and not wrong else 1


if __name__ == "__main__":
    sys.exit(main())

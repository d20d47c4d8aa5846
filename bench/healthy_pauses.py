"""No incident on a healthy job that pauses, with the agents as deployed
(``lab run --agent-defaults``): lab jobs on 3x2 and 4x2 whose every rank
checkpoints 20 s together, whose rank 1 starts 20 s after the others, and
which evaluate for 30 s without a collective; counted: the incidents the
agents raised (their logs' ``incident ID (kind)`` lines, peers' requests
apart) over the jobs' time.

``--one-rank`` runs the other case: rank 1 alone checkpoints (writes and
syncs a file) for 20 s while the others wait for it in a barrier, twice.
The first pause may raise an incident, whose published verdict must say
what the rank was doing (busy outside NCCL, never a hang); the second must
raise none (not even one held back by the cool-down).

    python -m bench.healthy_pauses [--minutes 10] [--shapes 3x2 4x2] [--one-rank]
        [--mode blocking|async|gpu] [--out DIR]

``--mode gpu`` runs the jobs on the lab's CUDA runtime: their calls return
at once and complete on the device, where the stall bound applies to work
queued and not completed (``recorder.stallbound``).

Each run is one lab job of ``--minutes`` (it is given many steps and
stopped then: the lab's teardown kills its ranks, and the exits that kill
makes are the lab's, not counted); run it under the quiet lock, in batches.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any

INCIDENT = re.compile(r"^(\S+ \S+) .*incident (\S+) \((\w+)\): (.*)$")
SUPPRESSED = "in cool-down, not dumping"
VERDICT = re.compile(r"incident (\S+): verdict: (.*)$")
STEPS = 1_000_000  # never reached: the run is stopped at --minutes
# a 20 s checkpoint of every rank, a 30 s evaluation (no collective), rank 1
# 20 s late; one rank's 20 s checkpoint while the others wait.  A step took
# 0.15-0.75 s on the lab's shared 2 cores (--compute-ms 50, load 20-70):
# pauses come every minute or few
HEALTHY = ("pause:every=300,ms=20000,work=io", "pause:every=400,ms=30000,work=cpu",
           "late:rank=1,ms=20000")  # fmt: skip
ONE_RANK = ("pause:every=60,ms=20000,rank=1,work=io",)


def lab_run(
    shape: tuple[int, int], minutes: float, faults: list[str], folder: Path, mode: str = "blocking"
) -> dict[str, Any]:
    argv = [sys.executable, "-m", "stallwatch", "lab", "run", "--record", "--json", "--mode", mode]
    # the lab's own wait for a rank to move: more than the longest pause
    argv += ["--agent-defaults", "--stall-timeout", "45", "--timeout", str(int(minutes * 60))]
    argv += ["--nodes", str(shape[0]), "--ranks-per-node", str(shape[1])]
    argv += ["--steps", str(STEPS), "--compute-ms", "50", "--dump-dir", str(folder / "dumps")]
    for f in faults:
        argv += ["--fault", f]
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=minutes * 60 + 900)
    (folder / "lab.json").write_text(done.stdout)
    (folder / "lab.err").write_text(done.stderr)
    try:
        return dict(json.loads(done.stdout))
    except ValueError:
        return {}


def agent_lines(folder: Path) -> tuple[list[tuple[float, str, str, str]], int, list[str]]:
    """The incidents agents raised (wall time, node, kind, reason), the
    episodes held back by a cool-down, and the verdict lines."""
    raised, held, verdicts = [], 0, []
    for log in sorted((folder / "dumps").glob("*.agent.log")):
        node = log.name.split(".")[0]
        for line in log.read_text(errors="replace").splitlines():
            m = INCIDENT.search(line)
            if m and m.group(3) != "peer":
                when = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                raised.append((when, node, m.group(3), m.group(4)))
            held += SUPPRESSED in line
            v = VERDICT.search(line)
            if v:
                verdicts.append(f"{node}: {v.group(2)}")
    return raised, held, verdicts


def _pid_of(reason: str) -> str:
    m = re.match(r"pid (\d+),", reason)
    return m.group(1) if m else ""


def _one_rank_problems(
    result: dict[str, Any],
    raised: list[tuple[float, str, str, str]],
    held: int,
    verdicts: list[str],
) -> int:
    """The first pause may raise an incident, said busy (never a hang); the
    later ones none, not even held back by a cool-down."""
    episodes = [e for f in result.get("faults", []) for e in f.get("episodes", [])]
    if len(episodes) < 2:
        print("    PROBLEM: fewer than two pauses were taken")
        return 1
    second = datetime.fromisoformat(episodes[1]["at_wall"].replace("Z", "+00:00")).timestamp()
    later = [r for r in raised if r[0] >= second - 1.0]
    hangs = [v for v in verdicts if "missing_rank" in v]
    busy = [v for v in verdicts if "busy outside NCCL" in v]
    problems = len(later) + held + len(hangs) + (1 if raised and not busy else 0)
    if problems:
        print(f"    PROBLEM: {len(later)} raised at a later pause, {held} held back, "
              f"{len(hangs)} hang verdict(s), busy said: {bool(busy)}")  # fmt: skip
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--shapes", nargs="+", default=["3x2", "4x2"])
    p.add_argument("--one-rank", action="store_true")
    p.add_argument("--mode", choices=("blocking", "async", "gpu"), default="blocking")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="healthy-pauses-"))
    bad = 0
    for text in args.shapes:
        shape = (int(text.split("x")[0]), int(text.split("x")[1]))
        faults = list(ONE_RANK if args.one_rank else HEALTHY)
        folder = out / f"{text}-{args.mode}-{'one-rank' if args.one_rank else 'healthy'}"
        result = lab_run(shape, args.minutes, faults, folder, args.mode)
        raised, held, verdicts = agent_lines(folder)
        ranks = result.get("ranks", [])
        killed = {str(r["pid"]) for r in ranks if r.get("killed_by_lab")}
        raised = [r for r in raised if not (r[2] == "exit" and _pid_of(r[3]) in killed)]
        ran = max((r.get("wall_s", 0.0) for r in ranks), default=0.0)
        steps = max((r.get("steps_done", 0) for r in ranks), default=0)
        pauses = [len(f.get("episodes", [])) for f in result.get("faults", [])]
        print(
            f"{text} {args.mode} {' '.join(faults)}:"
            f" the job ran {ran / 60:.1f} min, {steps} steps, "
            f"pauses taken {pauses}; {len(raised)} incident(s) raised (the lab's kills at "
            f"its end apart), {held} held back by a cool-down",
            flush=True,
        )
        for _, node, kind, reason in raised:
            print(f"    incident on {node} ({kind}): {reason[:300]}")
        for line in verdicts:
            print(f"    verdict {line[:400]}")
        if args.one_rank:  # (the lab's kills at its end are held back: the first's cool-down)
            bad += _one_rank_problems(result, raised, max(0, held - len(killed)), verdicts)
        else:
            bad += len(raised) + held
    print(f"== {'one-rank pauses' if args.one_rank else 'healthy'}: {bad} problem(s)", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

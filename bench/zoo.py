"""The fault zoo, judged: runs draws of ``lab.zoo`` (a job and a fault at
random, each with its truth), analyzes each draw's dumps with ``stallwatch
analyze --json`` and prints top-1 accuracy per mechanism, the wrong
culprits (another host or rank named), HEALTHY on a fault that stalled or
slowed the job, and incidents and culprits on healthy draws, with the seed
of every miss.

    python -m bench.zoo --draws N [--out DIR] [--resume] [--json]
                        [--seeds S,S,...] [--mechanisms M,...] [--shapes NxR,...]
                        [--waits W,...] [--neighbours N,...] [--rejudge]

Seeds are fresh on every run unless given (``--seeds``): figures that count
come from draws no rule was fitted to.  ``--out`` keeps each draw's dumps
and truth (``OUT/<seed>/``); ``--resume`` runs only the draws ``--out`` does
not hold yet and judges the kept ones again; ``--rejudge`` runs nothing and
judges every kept draw with today's analyzer.

How a draw is judged (``judge``):

- the verdict judged (top-1) is the first verdict of the first incident an
  agent raised on its own (a stall, a slowdown, an exit); where none was
  raised, that of the dumps the lab asked for at the end of the run;
- right: a kind the truth accepts (``lab.zoo.accepted_kinds``) naming the
  culprit alone (its host for a network fault, both hosts of a two-node job
  allowed; its rank for a rank fault); on a healthy draw, no verdict names
  anyone; on a fault that affected nothing (``lab.zoo.affected``), its
  culprit or a verdict naming nobody (``healthy``, ``slowdown``);
- wrong culprit: any verdict of any incident that names a host or rank the
  truth does not allow (``inconclusive`` names nobody: a miss, never a
  wrong culprit);
- healthy on a fault: the top verdict is ``healthy`` though the job stalled
  or slowed.
"""

from __future__ import annotations

import argparse
import json
import secrets
import subprocess
import sys
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from stallwatch.lab import zoo

END_INCIDENT = "-end"  # the lab's end-of-run dumps: incident lab-<run id>-end


@dataclass(frozen=True, slots=True)
class Judged:
    seed: int
    mechanism: str
    shape: str
    mode: str
    expect: str
    culprit: str  # host or rank, for people
    affected: bool
    top: str  # kind and summary of the verdict judged
    right: bool
    wrong_culprit: bool
    healthy_on_fault: bool
    incidents_raised: int  # incidents the agents raised on their own
    what: str


def analyze(folder: Path) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "stallwatch", "analyze", str(folder / "dumps"), "--json"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    (folder / "analyze.json").write_text(done.stdout)
    try:
        return dict(json.loads(done.stdout))
    except ValueError:
        return {"incidents": [], "error": (done.stderr.strip() or "no output")[-300:]}


def _raised(incidents: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [i for i in incidents if not str(i.get("id", "")).endswith(END_INCIDENT)]


def judged_incident(incidents: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    raised = sorted(_raised(incidents), key=lambda i: str(i.get("time") or ""))
    if raised:
        return raised[0]
    return incidents[0] if incidents else None


def _names(verdict: Mapping[str, Any]) -> tuple[set[str], set[int]]:
    return set(verdict.get("hosts") or []), set(verdict.get("ranks") or [])


def names_culprit(truth: zoo.Truth, verdict: Mapping[str, Any]) -> bool:
    hosts, ranks = _names(verdict)
    if truth.culprit_rank is not None:
        return ranks == {truth.culprit_rank}
    return bool(hosts) and hosts <= set(truth.hosts)


def wrong_names(truth: zoo.Truth, verdict: Mapping[str, Any]) -> bool:
    if verdict.get("kind") not in zoo.NAMING_KINDS:
        return False
    hosts, ranks = _names(verdict)
    return bool(hosts - set(truth.hosts) or ranks - set(truth.ranks))


def judge(record: Mapping[str, Any], analysis: Mapping[str, Any]) -> Judged:
    truth = zoo.Truth.from_json(record["truth"])
    # measured again from the run: the rule of what counts as affected may have changed
    affect = zoo.affected(truth, record["lab"]).to_json() if "lab" in record else {}
    affect = affect or dict(record.get("affect") or {})
    job = record.get("job") or {}
    incidents = list(analysis.get("incidents") or [])
    verdicts = [v for i in incidents for v in i.get("verdicts") or []]
    chosen = judged_incident(incidents)
    top = (chosen.get("verdicts") or [None])[0] if chosen is not None else None
    kind = top.get("kind") if top else None
    wrong = any(wrong_names(truth, v) for v in verdicts)
    affected = bool(affect.get("affected"))
    if truth.expect is zoo.Expect.HEALTHY:
        right = not any(v.get("kind") in zoo.NAMING_KINDS for v in verdicts)
    else:
        hit = top is not None and kind in zoo.accepted_kinds(truth) and names_culprit(truth, top)
        nobody = kind in zoo.KINDS[zoo.Expect.HEALTHY] or top is None
        right = hit or (not affected and nobody)
        right = right and not wrong
    summary = f"{kind}: {top.get('summary', '')}" if top else analysis.get("error", "no verdict")
    return Judged(
        seed=int(record["seed"]),
        mechanism=truth.mechanism,
        shape=f"{job.get('nodes')}x{job.get('ranks_per_node')}",
        mode=str(job.get("mode")),
        expect=truth.expect.value,
        culprit=_culprit(truth),
        affected=affected,
        top=str(summary)[:240],
        right=right,
        wrong_culprit=wrong,
        healthy_on_fault=affected and kind == "healthy" and truth.expect is not zoo.Expect.HEALTHY,
        incidents_raised=len(_raised(incidents)),
        what=truth.what,
    )


def _culprit(truth: zoo.Truth) -> str:
    if truth.culprit_rank is not None:
        return f"rank {truth.culprit_rank}"
    return truth.culprit_host or "-"


def run_one(seed: int, space: zoo.Space, out: Path) -> dict[str, Any]:
    folder = out / str(seed)
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "lab.err").open("w") as log:
        return zoo.run_draw(zoo.draw(seed, space=space), folder, progress_out=log)


def table(rows: Sequence[Judged]) -> str:
    by: dict[str, list[Judged]] = defaultdict(list)
    for r in rows:
        by[r.mechanism].append(r)
    lines = ["| mechanism | draws | right | top-1 | wrong culprits | healthy on a fault |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for mech in sorted(by, key=lambda m: zoo.MECHANISMS.index(m)):
        rs = by[mech]
        good = sum(r.right for r in rs)
        lines.append(
            f"| {mech} | {len(rs)} | {good} | {good / len(rs):.0%} | "
            f"{sum(r.wrong_culprit for r in rs)} | {sum(r.healthy_on_fault for r in rs)} |"
        )
    good = sum(r.right for r in rows)
    lines.append(
        f"| **all** | {len(rows)} | {good} | {good / max(len(rows), 1):.1%} | "
        f"{sum(r.wrong_culprit for r in rows)} | {sum(r.healthy_on_fault for r in rows)} |"
    )
    healthy = [r for r in rows if r.expect == zoo.Expect.HEALTHY.value]
    lines.append("")
    lines.append(
        f"healthy draws: {len(healthy)}; with an incident raised: "
        f"{sum(r.incidents_raised > 0 for r in healthy)}; with a culprit named: "
        f"{sum(not r.right for r in healthy)}"
    )
    return "\n".join(lines)


def _seeds(args: argparse.Namespace, out: Path) -> list[int]:
    if args.seeds:
        return [int(s) for s in args.seeds.split(",") if s.strip()]
    kept = sorted(int(p.name) for p in out.glob("*") if (p / "draw.json").is_file())
    if args.rejudge:
        return kept
    fresh = [secrets.randbelow(2**31) for _ in range(max(0, args.draws - len(kept)))]
    return (kept if args.resume else []) + fresh


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.zoo", description=__doc__.splitlines()[0])
    p.add_argument("--draws", type=int, default=20, help="draws to run (default 20)")
    p.add_argument("--seeds", default="", help="these seeds instead of fresh ones")
    p.add_argument("--out", type=Path, default=None, help="keep each draw here (OUT/<seed>)")
    p.add_argument("--resume", action="store_true", help="run what --out lacks, judge the rest")
    p.add_argument("--rejudge", action="store_true", help="judge every draw kept in --out again")
    p.add_argument("--json", action="store_true", help="each draw as JSON, then the table")
    for flag in ("--mechanisms", "--shapes", "--waits", "--neighbours"):
        p.add_argument(flag, default="", help=f"the space's {flag[2:]} (comma separated)")
    args = p.parse_args(argv)
    space = zoo.Space.parse(args.mechanisms, args.shapes, args.waits, args.neighbours)
    out = args.out or Path(f"zoo-bench-{secrets.token_hex(3)}")
    rows = []
    for seed in _seeds(args, out):
        folder = out / str(seed)
        kept = (folder / "draw.json").is_file()
        if args.rejudge and not kept:
            continue
        again = kept and (args.rejudge or args.resume)
        record = (
            json.loads((folder / "draw.json").read_text()) if again else run_one(seed, space, out)
        )
        row = judge(record, analyze(folder))
        rows.append(row)
        (folder / "judged.json").write_text(json.dumps(asdict(row), indent=1))
        mark = "ok" if row.right else ("WRONG CULPRIT" if row.wrong_culprit else "MISS")
        line = json.dumps(asdict(row)) if args.json else (
            f"seed {seed} {row.mechanism} {row.shape} {row.mode}: {mark}: {row.what}; "
            f"affected {row.affected}; top: {row.top}"
        )  # fmt: skip
        print(line, flush=True)
    print(table(rows))
    misses = [r for r in rows if not r.right]
    if misses:
        print("misses: " + ", ".join(f"{r.seed} ({r.mechanism})" for r in misses))
    print(f"out: {out}")
    return 0 if not misses else 1


if __name__ == "__main__":
    sys.exit(main())

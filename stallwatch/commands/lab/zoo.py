"""``stallwatch lab zoo``: one draw of the fault zoo (``lab.zoo``): a job and a
fault drawn at random, run with an agent per node, its truth written beside
the dumps; the seed replays it."""

from __future__ import annotations

import argparse
import json
import secrets
import shlex
import sys
from pathlib import Path

from stallwatch.dumpers.errors import ExitCode

from ..options import HelpFormatter

ZOO_EPILOG = """\
examples:
  stallwatch lab zoo                       # a fresh draw: prints its seed, runs it
  stallwatch lab zoo --seed 1234 --dry-run # what seed 1234 draws, and the lab command
  stallwatch lab zoo --seed 1234 --out runs/1234 && stallwatch analyze runs/1234/dumps
  python -m bench.zoo --draws 50           # many draws, judged: accuracy per mechanism

The draw's truth (the faulted host or rank, the verdict it calls for, whether
the job was affected) is in OUT/draw.json, the dumps in OUT/dumps.

exit codes: 0 the draw ran (whatever the job did), 2 bad input or the lab
could not be set up
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "zoo",
        help="run one random draw of the fault zoo (a job and a fault); the seed replays it",
        description="Draw a lab job and a fault at random from a wide space (mechanism, size, "
        "direction, placement, onset), run it with an agent per node, and write the truth "
        "beside the dumps.",
        epilog=ZOO_EPILOG,
        formatter_class=HelpFormatter,
    )
    p.add_argument("--seed", type=int, default=None,
                   help="the draw to run (default: a fresh random seed, printed)")  # fmt: skip
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="where the dumps and draw.json go (default: zoo-SEED)")  # fmt: skip
    p.add_argument("--dry-run", action="store_true",
                   help="print the draw and its lab command; run nothing")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the draw (and outcome) as JSON")
    space = p.add_argument_group("the space draws come from (default: all of it)")
    space.add_argument("--mechanisms", default="", metavar="M,...",
                       help="only these mechanisms (e.g. cut,mtu,rate,congest)")  # fmt: skip
    space.add_argument("--shapes", default="", metavar="NxR,...",
                       help="only these shapes (nodes x ranks per node, e.g. 3x2,4x2)")  # fmt: skip
    space.add_argument("--waits", default="", metavar="W,...", help="block, spin")
    space.add_argument("--neighbours", default="", metavar="N,...", help="none, churn, bulk")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from stallwatch.lab import zoo  # the lab's machinery loads only when it runs

    space = zoo.Space.parse(args.mechanisms, args.shapes, args.waits, args.neighbours)
    seed = args.seed if args.seed is not None else secrets.randbelow(2**31)
    draw = zoo.draw(seed, space=space)
    out = args.out or Path(f"zoo-{seed}")
    command = ["stallwatch", "lab", "run", *draw.lab_argv(str(out / "dumps"))]
    if not args.json:
        job = draw.job
        print(f"zoo seed {seed}{' ' + ' '.join(space.args()) if space.args() else ''}: "
              f"{draw.truth.what} ({job.shape}, {job.mode}, {job.wait} waits, "
              f"neighbour {job.neighbour})")  # fmt: skip
        naming = f" naming {', '.join(draw.truth.hosts)}" if draw.truth.hosts else ""
        print(f"  expects: {draw.truth.expect.value}{naming}")
        print(f"  replay: {shlex.join(command)}", flush=True)
    if args.dry_run:
        if args.json:
            print(json.dumps({**draw.to_json(), "command": command}, indent=1))
        return ExitCode.OK
    record = zoo.run_draw(draw, out, progress_out=None if args.json else sys.stderr)
    if args.json:
        print(json.dumps(record, indent=1, sort_keys=True))
    else:
        affect = record["affect"]
        print(f"  affected: {affect['affected']} (stalled {affect['stalled']}, "
              f"median step x{affect['factor']}); dumps in {out / 'dumps'}")  # fmt: skip
    return ExitCode.OK

"""``stallwatch lab demo``: the guided end-to-end example (``lab.demo``).

Exit codes: 0 the analysis named the injected rank; 1 it did not (or no
dump was written); 2 bad usage, or the lab could not run.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from stallwatch.dumpers.errors import ExitCode, UsageError
from stallwatch.lab.demo import PERFETTO_UI, DemoConfig, new_seed, paths_for, run_demo

from ..options import HelpFormatter, add_format_option

EPILOG = f"""\
examples:
  stallwatch lab demo                  # a random rank hangs; the analyzer finds it
  stallwatch lab demo --seed 7 --json  # reproducible, for programs
  stallwatch lab demo --nodes 2 --out /tmp/demo

needs root (network namespaces, eBPF). The dumps and the trace stay in the
demo's folder (--out, else a new one under ~/.cache/stallwatch/, printed) so
that the printed commands can be run again.
exit codes: 0 the analysis named the injected rank, 1 it did not, 2 bad usage
or the lab could not run. Open the trace at {PERFETTO_UI}."""


def _at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo",
        help="the guided example: a 4-node job hangs, every node dumps, find the rank",
        description="Run a recorded lab job with a hang at a random rank and step, then "
        "analyze the dumps, run the seed SQL query, write a Perfetto trace, and print "
        "each command for running it by hand.",
        epilog=EPILOG,
        formatter_class=HelpFormatter,
    )
    p.add_argument("--seed", type=_at_least(0), default=None, metavar="N",
                   help="picks the hung rank and step (default: random, printed)")  # fmt: skip
    p.add_argument("--nodes", type=_at_least(1), default=4, metavar="N", help="nodes")
    p.add_argument("--ranks-per-node", type=_at_least(1), default=2, metavar="R",
                   help="ranks on each node")  # fmt: skip
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="the demo's folder: DIR/dumps (must hold no dumps yet) and "
                   "DIR/trace.json (default: a new folder under ~/.cache/stallwatch)")  # fmt: skip
    add_format_option(p)
    p.add_argument(
        "--keep",
        action="store_true",
        help="keep the agents' logs beside the dumps (kept on a miss)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.nodes * args.ranks_per_node < 2:
        raise UsageError("--nodes x --ranks-per-node must be at least 2: a hang needs peers")
    dump_dir, trace = paths_for(args.out)
    cfg = DemoConfig(
        seed=new_seed() if args.seed is None else args.seed,
        nodes=args.nodes,
        ranks_per_node=args.ranks_per_node,
        dump_dir=dump_dir,
        trace=trace,
        json=args.format == "json",
        keep=args.keep,
    )
    result = run_demo(cfg)
    return ExitCode.OK if result.culprit_found else ExitCode.FINDINGS

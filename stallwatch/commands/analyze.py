"""``stallwatch analyze PATH... [--format table|json]``: name the culprit rank, and why.

Exit codes: 0 healthy, 1 findings (an inconclusive verdict, or an input that
could not be read, counts as one), 2 nothing could be read.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from stallwatch.analyzer.report import MAX_TABLE_ROWS, MAX_TABLES

from .options import HelpFormatter, add_format_option

EXAMPLES = """\
examples:
  stallwatch analyze dumps/                      every dump under a folder
  stallwatch analyze dumps/*.msgpack --json      for programs (= --format json)
  stallwatch analyze dumps/ --all                every communicator, every rank
  stallwatch analyze fr_traces/                  PyTorch Flight Recorder dumps (_dump_<rank>)
  STALLWATCH_THREADS=1 stallwatch analyze dumps/ on one core (default: up to 4)

exit codes: 0 healthy, 1 findings (inconclusive, or an input lost), 2 nothing could be read
"""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "analyze",
        help="name the rank that departs from consensus, and why",
        description="Load dumps (ours, and PyTorch Flight Recorder's), match each "
        "communicator's n-th collective across its ranks, report verdicts.",
        epilog=EXAMPLES,
        formatter_class=HelpFormatter,
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="dump files or folders")
    add_format_option(p)
    p.add_argument(
        "--all",
        dest="show_all",
        action="store_true",
        help=f"show every communicator and every rank (default: the {MAX_TABLES} most "
        f"telling communicators, {MAX_TABLE_ROWS} ranks each; --json always has them all)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from stallwatch.analyzer.pipeline import analyze_paths
    from stallwatch.analyzer.report import print_report, to_json

    result = analyze_paths(args.paths, progress=sys.stderr.isatty() or len(args.paths) > 1)
    for s in result.inputs:
        if not s.ok:
            print(f"stallwatch analyze: {s.note}", file=sys.stderr)
    if args.format == "json":
        print(to_json(result))
    else:
        print_report(result, args.show_all)
    if not result.anything_read:
        return 2
    return 0 if result.healthy else 1

"""``stallwatch analyze PATH... [--format table|json]``: name the culprit rank, and why.

Exit codes: 0 healthy, 1 findings, 2 nothing could be read.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from stallwatch.query.output import HelpFormatter, add_format_option

EXAMPLES = """\
examples:
  stallwatch analyze dumps/                      every dump under a folder
  stallwatch analyze dumps/*.msgpack --json      for programs (= --format json)
  stallwatch analyze fr_traces/                  PyTorch Flight Recorder dumps (_dump_<rank>)
  STALLWATCH_THREADS=1 stallwatch analyze dumps/ on one core (default: up to 4)

exit codes: 0 healthy, 1 findings, 2 nothing could be read
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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .pipeline import analyze_paths
    from .report import to_json, to_text

    result = analyze_paths(args.paths, progress=sys.stderr.isatty() or len(args.paths) > 1)
    print(to_json(result) if args.format == "json" else to_text(result))
    if not result.anything_read:
        return 2
    return 0 if result.healthy else 1

"""The ``stallwatch`` command: one parser, subcommands registered by the parts.

Each part registers its own subcommands (``register(subparsers)``) and imports
its heavy dependencies (BCC, DuckDB) only when its command runs, so that
``stallwatch analyze`` works on a laptop with no BCC and no root.

Exit codes everywhere: 0 clean, 1 findings, 2 bad input or usage.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from stallwatch.dumpers.errors import StallwatchError

from . import __version__

EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_USAGE = 2

# Modules that define register(subparsers); each adds its subcommands.
COMMAND_MODULES = (
    "stallwatch.recorder.cli",
    "stallwatch.analyzer.cli",
    "stallwatch.sqlcli",
    "stallwatch.analyzer.exportcli",
    "stallwatch.lab.cli",
)

EPILOG = """\
examples:
  stallwatch lab demo                         a 4-node job hangs; find the rank
  stallwatch record --dump-dir /var/lib/stallwatch --stall-timeout 60
  stallwatch dump --reason "loss spike at step 1200"
  stallwatch analyze dumps/                   name the culprit rank, and why
  stallwatch query dumps/*.msgpack "SELECT op, count(*) FROM nccl_events GROUP BY op"
  stallwatch query --agents node1:9400,node2:9400 "SELECT * FROM tcp_events LIMIT 5"
"""


class _Parser(argparse.ArgumentParser):
    """argparse exits 2 on usage errors already; keep its one-line message."""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="stallwatch",
        description="Flight recorder for distributed training: records every NCCL call "
        "and the kernel events that explain a stall, then names the rank that caused it.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"stallwatch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
    except StallwatchError as exc:
        print(f"stallwatch {args.command}: error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", EXIT_USAGE)
    except KeyboardInterrupt:
        print(f"stallwatch {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return EXIT_OK
    return code


if __name__ == "__main__":
    sys.exit(main())

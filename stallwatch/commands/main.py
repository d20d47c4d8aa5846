"""The ``stallwatch`` command: one parser, one module per subcommand.

Every module of ``stallwatch.commands`` listed in ``COMMAND_MODULES`` has
``register(subparsers)``, which adds its subcommand and sets ``func`` to its
``run(args) -> int``.  A command imports the parts it drives (and their heavy
dependencies: BCC, DuckDB) only when it runs, so that ``stallwatch analyze``
works on a laptop with no BCC and no root.

One grammar for every command: options go before or after its paths
(``parse``), each prints data with ``--format`` (``--json`` its short form)
and shows its defaults, examples (lines a shell runs as printed) and exit
codes in ``--help`` (``commands.options``); a command that has subcommands,
given none (``stallwatch`` alone), prints them.

Exit codes everywhere (``ExitCode``): 0 clean, 1 findings, 2 bad input or usage.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

from stallwatch import __version__
from stallwatch.dumpers.errors import ExitCode, StallwatchError
from stallwatch.query.output import note

from .options import HelpFormatter

# Modules that define register(subparsers); each adds its subcommand.
COMMAND_MODULES = (
    "stallwatch.commands.record",
    "stallwatch.commands.dump",
    "stallwatch.commands.snapshot",
    "stallwatch.commands.analyze",
    "stallwatch.commands.collect",
    "stallwatch.commands.query",
    "stallwatch.commands.serve",
    "stallwatch.commands.export",
    "stallwatch.commands.lab",
    "stallwatch.commands.completion",
)

EPILOG = """\
examples:
  stallwatch lab demo                   # a 4-node job hangs; find the rank
  stallwatch record --dump-dir /var/lib/stallwatch --stall-timeout 60
  stallwatch dump --reason "loss spike at step 1200"
  stallwatch snapshot --agents node1:9400,node2:9400    # where every rank is, now
  stallwatch analyze dumps/             # name the culprit rank, and why
  stallwatch analyze --agents node1:9400,node2:9400     # the same, live, from the agents
  stallwatch collect --agents node1:9400,node2:9400 -o incident/    # every node's dumps
  stallwatch query dumps/*.msgpack "SELECT op, count(*) FROM nccl_events GROUP BY op"
  stallwatch query --agents node1:9400,node2:9400 "SELECT * FROM tcp_events LIMIT 5"
  source <(stallwatch completion bash)  # commands and options complete on TAB

Options that reach agents are the same on every command: --agents or
--agents-file, --token-file, --tls-ca (--tls-cert, --tls-key), --timeout.

exit codes (every command): 0 clean, 1 findings or a partial result, 2 bad
input or usage; each command's --help says what they mean for it.
"""


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or with ``only`` (a command's name) of
    that command alone: a command that runs needs no other's module, and
    ``stallwatch record`` starts without loading the analyzer, the lab and
    Arrow (a third of the agent's memory, and half a second)."""
    parser = argparse.ArgumentParser(
        prog="stallwatch",
        description="Flight recorder for distributed training: records every NCCL call "
        "and the kernel events that explain a stall, then names the rank that caused it.",
        epilog=EPILOG,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"stallwatch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    modules = [m for m in COMMAND_MODULES if m.rpartition(".")[2] == only] or COMMAND_MODULES
    for name in modules:
        importlib.import_module(name).register(sub)
    return parser


def _commands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction[Any] | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    return None


def _exit_options(parser: argparse.ArgumentParser, head: list[str]) -> None:
    """Options before a command name: only those that print and exit
    (``--help``, ``--version``) belong to the parser above the command."""
    exits = (argparse._HelpAction, argparse._VersionAction)
    for action in parser._actions:
        if isinstance(action, exits) and set(action.option_strings) & set(head):
            parser.parse_args([action.option_strings[-1]])
    parser.error(f"unrecognized arguments: {' '.join(head)} (options go after the command name)")


def parse(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """Options anywhere: before or after a command's paths.  argparse mixes
    options and positionals freely only in a parser without subcommands, so
    the command names are taken first and the command's own parser reads the
    rest, intermixed."""
    argv = list(argv)
    commands = _commands(parser)
    if commands is None:
        return parser.parse_intermixed_args(argv)
    if not argv:  # ``stallwatch`` or ``stallwatch lab`` alone: the commands
        parser.print_help()
        parser.exit(ExitCode.OK)
    for i, token in enumerate(argv):
        if token in commands.choices:
            if argv[:i]:
                _exit_options(parser, argv[:i])
            args = parse(commands.choices[token], argv[i + 1 :])
            setattr(args, commands.dest, token)
            return args
        if not token.startswith("-"):
            break
    return parser.parse_args(argv)  # help, version, or argparse's message, exit 2


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    first = next((token for token in argv if not token.startswith("-")), None)
    parser = build_parser(only=first)
    args = parse(parser, argv)
    try:
        code: int = args.func(args)
    except StallwatchError as exc:
        note(args.command, f"error: {exc}")
        return getattr(exc, "exit_code", ExitCode.USAGE)
    except KeyboardInterrupt:
        print(f"stallwatch {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return ExitCode.OK
    return code


if __name__ == "__main__":
    sys.exit(main())

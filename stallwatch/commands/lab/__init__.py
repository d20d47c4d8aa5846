"""``stallwatch lab ...``: the lab's subcommands, one module each in this
package (``register(subparsers)``, ``run(args) -> int``, as every command),
listed in ``SUBCOMMANDS``."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from ..options import HelpFormatter
from . import demo, run, zoo

LAB_EPILOG = """\
examples:
  stallwatch lab demo                  # the guided example (a hang, found)
  stallwatch lab run --nodes 4 --fault hang:rank=5,step=10 --record --dump-dir dumps/
  stallwatch lab run --help            # the job's options and fault specs
  stallwatch lab zoo                   # a random job and fault; its seed replays it

exit codes: those of lab run and lab demo (their --help)
"""


SUBCOMMANDS: Sequence[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None]] = (
    run.register,
    demo.register,
    zoo.register,
)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    lab = subparsers.add_parser(
        "lab",
        help="a multi-node training job on this machine, with faults on demand",
        description="The lab: nodes as network namespaces, ranks as processes, real "
        "collectives over TCP through the lab's NCCL-compatible library.",
        epilog=LAB_EPILOG,
        formatter_class=HelpFormatter,
    )
    sub = lab.add_subparsers(dest="lab_command", metavar="LAB_COMMAND")
    sub.required = True
    for add in SUBCOMMANDS:
        add(sub)

"""``python -m stallwatch.commands.labchurn --listen IP --peer IP --rate N ...``:
one node's TCP neighbour in the lab (``lab.churn``); ``lab.runner`` starts one
such process per node, inside its network namespace, with ``--neighbour-churn``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from stallwatch.lab.churn import CHURN_PORT, ChurnArgs


def parse_args(argv: Sequence[str] | None) -> ChurnArgs:
    p = argparse.ArgumentParser(
        prog="python -m stallwatch.commands.labchurn",
        description="Open and close short TCP connections to a peer, and serve the peer's.",
    )
    p.add_argument("--listen", required=True, metavar="IP", help="this node's address")
    p.add_argument("--peer", required=True, metavar="IP", help="the node to connect to")
    p.add_argument("--rate", type=float, required=True, metavar="N",
                   help="connections a second to open")  # fmt: skip
    p.add_argument("--stats", type=Path, required=True, metavar="FILE",
                   help="where to write the counts (JSON)")  # fmt: skip
    p.add_argument("--go", type=Path, required=True, metavar="FILE",
                   help="start connecting once this file exists")  # fmt: skip
    p.add_argument("--port", type=int, default=CHURN_PORT, help="the port to listen and connect on")
    ns = p.parse_args(argv)
    return ChurnArgs(ns.listen, ns.peer, ns.rate, ns.stats, ns.go, ns.port)


def main(argv: Sequence[str] | None = None) -> int:
    from stallwatch.lab import churn

    return churn.run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

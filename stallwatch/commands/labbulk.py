"""``python -m stallwatch.commands.labbulk sink|source ...``: one end of the
lab's bulk neighbour (``lab.bulk``); ``lab.runner`` starts a sink in the
receiving node and a source in the sending node, inside their network
namespaces, for a ``bulk:`` fault."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from stallwatch.lab.bulk import BULK_PORT


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m stallwatch.commands.labbulk",
        description="Stream TCP to a peer at a rate, or take such a stream and discard it.",
    )
    sub = p.add_subparsers(dest="role", required=True)
    s = sub.add_parser("sink", help="listen and discard")
    s.add_argument("--listen", required=True, metavar="IP", help="this node's address")
    src = sub.add_parser("source", help="stream to a sink")
    src.add_argument("--peer", required=True, metavar="IP", help="the sink's address")
    src.add_argument("--mbit", type=float, required=True, metavar="M", help="Mbit/s to send")
    for q in (s, src):
        q.add_argument("--stats", type=Path, required=True, metavar="FILE",
                       help="where to write the counts (JSON)")  # fmt: skip
        q.add_argument("--port", type=int, default=BULK_PORT, help="the sink's port")
    ns = p.parse_args(argv)
    from stallwatch.lab import bulk

    if ns.role == "sink":
        return bulk.sink(ns.listen, ns.stats, ns.port)
    return bulk.source(ns.peer, ns.mbit, ns.stats, ns.port)


if __name__ == "__main__":
    sys.exit(main())

"""``python -m stallwatch.commands.labrank --rank R ...``: one rank of the lab's
training job (``lab.job``); ``lab.runner`` starts one such process per rank,
inside its node's network namespace."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from stallwatch.lab.gpu import DEFAULT_POLL_MS
from stallwatch.lab.job import (
    CUDART_ENV,
    CUDART_NAME,
    DEFAULT_COMPUTE_MS,
    DEFAULT_ELEMENTS,
    LIB_ENV,
    MODES,
    RankArgs,
)


def parse_args(argv: Sequence[str] | None) -> RankArgs:
    p = argparse.ArgumentParser(
        prog="python -m stallwatch.commands.labrank", description="One rank of the lab's job."
    )
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--ranks-per-node", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--lib", type=Path, default=os.environ.get(LIB_ENV))
    p.add_argument("--mode", choices=MODES, default="blocking")
    p.add_argument("--cudart", type=Path, default=os.environ.get(CUDART_ENV),
                   help=f"gpu mode: the lab's {CUDART_NAME} (default: beside --lib)")  # fmt: skip
    p.add_argument("--poll-ms", type=float, default=DEFAULT_POLL_MS,
                   help="gpu mode: how often the watchdog thread polls its events")  # fmt: skip
    p.add_argument("--graphs", action="store_true",
                   help="gpu mode: the step in a CUDA graph, captured once")  # fmt: skip
    p.add_argument("--fault", action="append", default=[])
    p.add_argument("--elements", type=int, default=DEFAULT_ELEMENTS)
    p.add_argument("--compute-ms", type=float, default=DEFAULT_COMPUTE_MS)
    p.add_argument("--cpu", type=int, default=None, help="pin this rank to one CPU")
    p.add_argument("--init-timeout", type=float, default=60.0)
    ns = p.parse_args(argv)
    lib = None if ns.lib is None else Path(ns.lib)
    cudart = None if ns.cudart is None else Path(ns.cudart)
    return RankArgs(**{**vars(ns), "lib": lib, "cudart": cudart, "fault": tuple(ns.fault)})


def main(argv: Sequence[str] | None = None) -> int:
    from stallwatch.lab import job

    return job.main(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

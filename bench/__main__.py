"""``python -m bench [--quick] [NAME...]``: run every benchmark, print one table."""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
import traceback

from bench.common import Figure, render

MODULES = (
    "bench_agent",
    "bench_recorder",
    "bench_tcp",
    "bench_links",
    "bench_netsamples",
    "bench_dumps",
    "bench_analyzer",
    "bench_flightrec",
    "bench_accuracy",
    "bench_sql",
    "bench_live",
    "bench_snapshot",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    parser.add_argument(
        "--agent-record-s",
        type=float,
        metavar="S",
        help="bench_agent: seconds the agents record before their memory is read "
        "(default 60; the issue's figure: 600)",
    )
    parser.add_argument(
        "names", nargs="*", help=f"benchmarks to run (default: {' '.join(MODULES)})"
    )
    args = parser.parse_args(argv)
    figures: list[Figure] = []
    failed = []
    for name in args.names or MODULES:
        print(f"bench: running {name} ...", file=sys.stderr, flush=True)
        try:
            module = importlib.import_module(f"bench.{name}")
            kwargs = {"quick": args.quick}
            if "big" in inspect.signature(module.figures).parameters:
                kwargs["big"] = not args.quick  # the 16,384-rank case: full runs only
            if "record_s" in inspect.signature(module.figures).parameters:
                kwargs["record_s"] = args.agent_record_s
            figures += module.figures(**kwargs)
        except Exception:  # a broken benchmark must not hide the others
            traceback.print_exc()
            failed.append(name)
    print(render(figures))
    if failed:
        print(f"bench: failed to run: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0 if all(f.ok is not False for f in figures) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Every agent late, over seeds: the lab job of tests/analyzer/test_lab_late_all
(every agent started once the job is 20 steps in, then a random rank hangs),
on 2x2 and 4x2, with waiting threads blocking and spinning, with one agent per
node (netns) and with one host-scope agent for every node (host); counts the
runs whose first verdict names the hung rank alone.

    python -m bench.late_seeds [--seeds 10] [--scope netns host] [--out DIR]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

from tests.analyzer.late_lab import SCOPES, names_the_hung_rank_alone, run_all_late

SHAPES = ((2, 2), (4, 2))
WAITS = ("block", "spin")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--scope", nargs="+", choices=SCOPES, default=list(SCOPES),
                   help="netns: one agent per node; host: one agent for every node")  # fmt: skip
    p.add_argument("--out", type=Path, default=None, help="keep the dumps here")
    args = p.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="late-seeds-"))
    ok = {(s, shape, w): 0 for s in args.scope for shape in SHAPES for w in WAITS}
    # seed by seed over every scope, shape and mode: stopped early, the counts stay even
    for seed in range(args.seeds):
        for scope, (nodes, rpn), wait in ok:
            hung = random.Random(seed).randrange(nodes * rpn)
            folder = out / f"{scope}-{nodes}x{rpn}-{wait}-seed{seed}"
            r = run_all_late(folder, nodes, rpn, hung, wait, scope)
            good = names_the_hung_rank_alone(r)
            ok[scope, (nodes, rpn), wait] += good
            top = r.verdicts[0]["summary"] if r.verdicts else "no verdict"
            print(f"{scope} {nodes}x{rpn} {wait} seed {seed} hung {hung}: "
                  f"{'ok' if good else 'WRONG'}: {top}", flush=True)  # fmt: skip
        counts = ", ".join(f"{s} {n}x{r} {w} {k}/{seed + 1}" for (s, (n, r), w), k in ok.items())
        print(f"== after seed {seed}: {counts}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

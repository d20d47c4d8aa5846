"""The late-agent lab tests beside busy loops: tests/analyzer/test_lab_late.py
(agents started at different moments) and test_lab_late_all.py (every agent
late, one agent per node and one host agent) run round after round while
processes that never sleep take CPU beside them; counts the rounds in which
every test passed.

    python -m bench.late_busy [--rounds 10] [--loops 3]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ("tests/analyzer/test_lab_late.py", "tests/analyzer/test_lab_late_all.py")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--loops", type=int, default=3, help="busy loops beside the tests")
    args = p.parse_args(argv)
    loops = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.loops)
    ]
    good = 0
    try:
        for r in range(args.rounds):
            load = os.getloadavg()[0]
            start = time.monotonic()
            done = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS],
                cwd=ROOT, capture_output=True, text=True, check=False,
            )  # fmt: skip
            last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr
            good += done.returncode == 0
            print(f"round {r + 1}: {last} ({time.monotonic() - start:.0f} s, load {load:.1f} "
                  f"at its start); {good} of {r + 1} rounds all passed", flush=True)  # fmt: skip
    finally:
        for proc in loops:
            proc.kill()
            proc.wait()
    return 0 if good == args.rounds else 1


if __name__ == "__main__":
    sys.exit(main())

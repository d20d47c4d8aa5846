"""Analyzer benchmark: ``stallwatch analyze`` on synthetic incidents.

    python -m bench.bench_analyzer [--quick] [--big] [--clean-cache]

Incidents are 3-D parallel jobs (``bench.incident3d``: tensor-parallel
groups of 8 per host, pipeline stages by send/recv, data-parallel groups
across hosts, four communicators per rank, 2,000 calls in each rank's ring)
with one injected fault, a hang or a straggler; the child prints its verdict
and the figure fails unless it names the injected rank with the right kind.

Figures (one run each, in a child process so that peak RSS is the analysis'):
- 512 ranks x 2,000 calls, a hang and a straggler: time (< 1 s) and peak RSS
  (< 1 GB);
- with --big, 16,384 ranks x 2,000 (hang, straggler: < 5 s, < 2 GB) and
  131,072 ranks x 2,000 on 16,384 hosts (hang: < 60 s, < 12 GB).  Their dumps
  (about 4.7 and 38 GB) are written once into a cache folder
  (``$STALLWATCH_BENCH_CACHE``, else ``~/.cache/stallwatch-bench``) and
  reused by later runs; ``--clean-cache`` removes it.  The anchor gives the
  CPU time beside the wall time: these machines are shared.

PyTorch Flight Recorder files are ``bench.bench_flightrec``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import incident3d
from bench.common import Figure, render
from bench.incident3d import Shape


def peak_rss() -> int:
    """This process's peak resident set (VmHWM), in bytes.  Not ru_maxrss:
    Linux carries that over exec from the parent (the benchmark runner)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(folder: str) -> None:
    from stallwatch.analyzer.pipeline import analyze_paths

    t0, c0 = time.perf_counter(), _cpu()
    res = analyze_paths([folder])
    elapsed, cpu = time.perf_counter() - t0, _cpu() - c0
    rss = peak_rss()
    workers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    v = res.incidents[0].verdicts[0]
    doc = {"seconds": elapsed, "cpu": cpu, "rss": rss, "workers_rss": workers}
    print(json.dumps({**doc, "kind": v.kind.value, "ranks": list(v.ranks)}))


def _cpu() -> float:
    """CPU seconds of this process and of its worker processes (reaped)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def measure(
    folder: Path, mode: str = "--child", env: dict[str, str] | None = None
) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-m", "bench.bench_analyzer", mode, str(folder)],
        check=True,
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
        env={**os.environ, **(env or {})},
    )
    doc: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return doc


def _judge(r: dict[str, object], truth: dict[str, object]) -> tuple[bool, str]:
    right = r["kind"] == truth["kind"] and r["ranks"] == truth["ranks"]
    return right, f"verdict {r['kind']} {r['ranks']} ({'right' if right else 'WRONG'})"


def _median_run(folder: Path, repeats: int) -> dict[str, object]:
    """The run of median time among ``repeats`` (these machines are shared)."""
    runs = sorted((measure(folder) for _ in range(repeats)), key=lambda r: float(r["seconds"]))  # type: ignore[arg-type]
    return runs[len(runs) // 2]


def _ours(
    shape: Shape, t_max: float, gb_max: float, cached: bool = False, repeats: int = 3
) -> list[Figure]:
    """One 3-D incident analyzed: its time (median of ``repeats`` runs) and
    peak RSS against targets."""
    tag = f"analyze 3-D {shape.fault} {shape.nranks:,} ranks x {shape.calls:,}"
    if cached:
        shown = _progress(f"bench: writing the {tag} dumps (once, into {incident3d.cache_root()})")
        folder = incident3d.cached_incident(shape, shown)
        r, truth = _median_run(folder, repeats), incident3d.truth_of(folder)
    else:
        with tempfile.TemporaryDirectory(prefix="bench-analyzer-") as tmp:
            truth = incident3d.write_incident(shape, Path(tmp))
            r = _median_run(Path(tmp), repeats)
    right, verdict = _judge(r, truth)
    secs, cpu = float(r["seconds"]), float(r["cpu"])  # type: ignore[arg-type]
    gb = float(r["rss"]) / 1e9  # type: ignore[arg-type]
    workers = float(r["workers_rss"]) / 1e9  # type: ignore[arg-type]
    return [
        Figure(
            f"{tag}: time",
            secs,
            "s",
            f"< {t_max:g} s",
            secs < t_max and right,
            f"{verdict}; CPU {cpu:.1f} s; median of {repeats}",
        ),
        Figure(
            f"{tag}: peak RSS",
            gb,
            "GB",
            f"< {gb_max:g} GB",
            gb < gb_max and right,
            f"child process VmHWM (its header-reading workers: {workers:.2f} GB each at most)",
        ),
    ]


def _progress(what: str):  # type: ignore[no-untyped-def]
    shown = {"step": 0}

    def step(done: int, total: int) -> None:
        if done == 1:
            print(what, file=sys.stderr, flush=True)
        if done * 10 // total > shown["step"]:
            shown["step"] = done * 10 // total
            print(f"bench:   {done:,}/{total:,} hosts", file=sys.stderr, flush=True)

    return step


def figures(quick: bool = False, big: bool = False) -> list[Figure]:
    small = Shape(128, calls=200, pp=4) if quick else Shape(512)
    figs = _ours(small, 1.0, 1.0) + _ours(
        Shape(small.nranks, small.calls, "straggler", small.pp), 1.0, 1.0
    )
    if big:
        figs += _ours(Shape(16384), 5.0, 2.0, cached=True)
        figs += _ours(Shape(16384, fault="straggler"), 5.0, 2.0, cached=True)
        figs += _ours(Shape(131072), 60.0, 12.0, cached=True, repeats=1)
    return figs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_analyzer", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--big", action="store_true", help="also 16,384 ranks x 2,000")
    parser.add_argument(
        "--clean-cache", action="store_true", help="remove the cached big incidents and exit"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.clean_cache:
        shutil.rmtree(incident3d.cache_root(), ignore_errors=True)
        print(f"removed {incident3d.cache_root()}")
        return 0
    if args.child:
        child(args.child)
        return 0
    figs = figures(quick=args.quick, big=args.big)
    print(render(figs))
    return 0 if all(f.ok is not False for f in figs) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())

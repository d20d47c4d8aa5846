"""Analyzer benchmark: ``stallwatch analyze`` on synthetic incidents.

    python -m bench.bench_analyzer [--quick] [--big]

Figures (one run each, in a child process so that peak RSS is the analysis'):
- 512 ranks x 2,000 collectives from our dumps (64 nodes x 8 ranks, one
  rank hung at the last step): load + analyze time (< 1 s) and peak RSS
  (< 1 GB);
- with --big, 16,384 ranks x 2,000 (< 30 s, < 8 GB);
- PyTorch Flight Recorder pickles of 512 ranks x 2,000 entries: our time
  (on every core, and on one); when torch is installed (``pip install
  '.[compare]'``), torchfrtrace's on the same files and the ratio (>= 10x).

The child prints its verdict so that a benchmark of a wrong answer fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pickle
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from stallwatch.dumpers.format import write_dump
from stallwatch.dumpers.model import (
    Clock,
    CommInfo,
    ProcessInfo,
    Recording,
    Ring,
    Trigger,
    TriggerKind,
)
from stallwatch.dumpers.schema import NCCL_EVENT, DataType, Op, State

from bench.common import Figure, render

WORLD = 0xBE7C_0000_0000_0001
MS = 1_000_000


def synth_node(node: int, rpn: int, nranks: int, steps: int, hung: int) -> Recording:
    ranks = np.arange(node * rpn, node * rpn + rpn)
    rows = np.zeros(len(ranks) * steps, dtype=NCCL_EVENT)
    seq = np.tile(np.arange(steps), len(ranks))
    rank = np.repeat(ranks, steps)
    rng = np.random.default_rng(node)
    ts = 10**9 + seq * 20 * MS + rng.integers(0, MS, len(rows))
    rows["ts_ns"], rows["seq"], rows["rank"], rows["nranks"] = ts, seq, rank, nranks
    rows["end_ns"] = 10**9 + (seq + 1) * 20 * MS - 2 * MS
    rows["pid"] = rows["tid"] = 1000 + rank
    rows["comm"], rows["comm_hash"], rows["count"], rows["bytes"] = 0x10, WORLD, 1 << 20, 4 << 20
    rows["op"], rows["datatype"], rows["state"], rows["peer"] = (
        Op.ALL_REDUCE,
        DataType.FLOAT32,
        State.COMPLETED,
        -1,
    )
    last = seq == steps - 1
    rows["end_ns"][last] = 0
    rows["state"][last] = State.SCHEDULED
    rows["result"] = np.where(last, -1, 0)
    keep = ~(last & (rank == hung))
    rows = rows[keep]
    rows = rows[np.argsort(rows["ts_ns"], kind="stable")]
    now = 10**9 + steps * 20 * MS + 10_000 * MS
    procs = tuple(ProcessInfo(1000 + int(r), "python", "train", 1, 0, ()) for r in ranks)
    comms = tuple(CommInfo(1000 + int(r), 0x10, WORLD, int(r), nranks) for r in ranks)
    return Recording(
        f"node{node:05d}",
        "boot",
        Clock(now, now),
        procs,
        comms,
        {"nccl": Ring(rows)},
        trigger=Trigger(TriggerKind.PEER, "bench", "bench-1", now),
    )


def write_ours(folder: Path, nranks: int, steps: int, rpn: int = 8) -> int:
    hung = nranks // 3
    for node in range(nranks // rpn):
        write_dump(folder, synth_node(node, rpn, nranks, steps, hung))
    return hung


def write_flightrec(folder: Path, nranks: int, entries: int) -> None:
    cfg = {"0": {"name": "0", "desc": "default_pg", "ranks": str(list(range(nranks)))}}
    for r in range(nranks):
        ents = [
            {
                "collective_seq_id": s,
                "p2p_seq_id": 0,
                "is_p2p": False,
                "pg_id": 0,
                "op_id": s,
                "record_id": s,
                "process_group": ("0", "default_pg"),
                "profiling_name": "nccl:all_reduce",
                "input_sizes": [[1024]],
                "input_dtypes": ["Float"],
                "output_sizes": [[1024]],
                "output_dtypes": ["Float"],
                "state": "completed" if s < entries - 1 else "scheduled",
                "time_created_ns": 10**18 + s * 10**6,
                "time_discovered_started_ns": None,
                "time_discovered_completed_ns": 10**18 + s * 10**6 + 500
                if s < entries - 1
                else None,
                "retired": False,
                "timeout_ms": 600000,
                "thread_id": "1",
                "thread_name": "py",
            }
            for s in range(entries - (1 if r == 7 else 0))
        ]
        doc = {"version": "2.9", "pg_config": cfg, "pg_status": {}, "entries": ents}
        (folder / f"_dump_{r}").write_bytes(pickle.dumps(doc, protocol=4))


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

    t0 = time.perf_counter()
    res = analyze_paths([folder])
    elapsed = time.perf_counter() - t0
    rss = peak_rss()
    v = res.incidents[0].verdicts[0]
    print(
        json.dumps({"seconds": elapsed, "rss": rss, "kind": v.kind.value, "ranks": list(v.ranks)})
    )


def torch_child(folder: str) -> None:
    """torchfrtrace (torch's own Flight Recorder analyzer) on the folder;
    its report goes to /dev/null, its time and peak RSS to stdout."""
    import contextlib

    from torch.distributed.flight_recorder.fr_trace import main as fr_trace

    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        t0 = time.perf_counter()
        fr_trace([folder])
        elapsed = time.perf_counter() - t0
    rss = peak_rss()
    print(json.dumps({"seconds": elapsed, "rss": rss}))


def has_torchfrtrace() -> bool:
    return importlib.util.find_spec("torch") is not None and (
        importlib.util.find_spec("torch.distributed.flight_recorder.fr_trace") is not None
    )


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


def _ours(nranks: int, steps: int, t_max: float, gb_max: float, tag: str) -> list[Figure]:
    with tempfile.TemporaryDirectory(prefix="bench-analyzer-") as tmp:
        hung = write_ours(Path(tmp), nranks, steps)
        r = measure(Path(tmp))
    right = r["kind"] == "missing_rank" and r["ranks"] == [hung]
    secs, gb = float(r["seconds"]), float(r["rss"]) / 1e9  # type: ignore[arg-type]
    anchor = f"verdict {r['kind']} {r['ranks']} ({'right' if right else 'WRONG'})"
    return [
        Figure(
            f"analyze {tag} ranks x {steps} (our dumps): time",
            secs,
            "s",
            f"< {t_max:g} s",
            secs < t_max and right,
            anchor,
        ),
        Figure(
            f"analyze {tag} ranks x {steps} (our dumps): peak RSS",
            gb,
            "GB",
            f"< {gb_max:g} GB",
            gb < gb_max,
            "child process VmHWM",
        ),
    ]


def _fr(nranks: int, entries: int, judged: bool = True) -> list[Figure]:
    """Ours (on every core, and on one) and torchfrtrace on the same files.
    The 10x target is judged at full size only (``judged``)."""
    with tempfile.TemporaryDirectory(prefix="bench-fr-") as tmp:
        write_flightrec(Path(tmp), nranks, entries)
        r = measure(Path(tmp))
        one = measure(Path(tmp), env={"STALLWATCH_THREADS": "1"})
        theirs = measure(Path(tmp), "--torchfrtrace") if has_torchfrtrace() else None
    right = all(x["kind"] == "missing_rank" and x["ranks"] == [7] for x in (r, one))
    wrong = "" if right else "; WRONG verdict"
    secs, secs1 = float(r["seconds"]), float(one["seconds"])  # type: ignore[arg-type]
    tag = f"analyze FR {nranks} ranks x {entries} entries"
    if theirs is None:
        return [
            Figure(
                f"{tag}: time",
                secs,
                "s",
                "10x faster than torchfrtrace",
                None if right else False,
                "torchfrtrace: torch not installed, not measured" + wrong,
            ),
        ]
    t_theirs = float(theirs["seconds"])  # type: ignore[arg-type]
    gb_theirs, gb = float(theirs["rss"]) / 1e9, float(r["rss"]) / 1e9  # type: ignore[arg-type]
    return [
        Figure(f"{tag}: time", secs, "s", "-", None, f"peak RSS {gb:.2f} GB" + wrong),
        Figure(
            f"{tag}: torchfrtrace time",
            t_theirs,
            "s",
            "-",
            None,
            f"torch's analyzer, same files; peak RSS {gb_theirs:.2f} GB",
        ),
        Figure(
            f"{tag}: torchfrtrace / ours",
            t_theirs / secs,
            "x",
            ">= 10x" if judged else "-",
            (t_theirs / secs >= 10 and right) if judged else (None if right else False),
            f"ours {secs:.2f} s vs {t_theirs:.1f} s",
        ),
        Figure(
            f"{tag}: torchfrtrace / ours, one thread",
            t_theirs / secs1,
            "x",
            "-",
            None,
            f"STALLWATCH_THREADS=1: ours {secs1:.2f} s",
        ),
    ]


def figures(quick: bool = False, big: bool = False) -> list[Figure]:
    n, steps = (64, 200) if quick else (512, 2000)
    figs = _ours(n, steps, 1.0, 1.0, str(n))
    if big:
        figs += _ours(16384, 2000, 30.0, 8.0, "16384")
    figs += _fr(64 if quick else 512, 200 if quick else 2000, judged=not quick)
    return figs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_analyzer", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--big", action="store_true", help="also 16,384 ranks x 2,000")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--torchfrtrace", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child)
        return 0
    if args.torchfrtrace:
        torch_child(args.torchfrtrace)
        return 0
    figs = figures(quick=args.quick, big=args.big)
    print(render(figs))
    return 0 if all(f.ok is not False for f in figs) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())

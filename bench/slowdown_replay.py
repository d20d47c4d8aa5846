"""Dumps replayed through the slowdown trigger, tick by tick, as the agent
would have judged their NCCL rows: how close each stream came to each
condition, for choosing its thresholds on healthy runs (and checking that a
fault's runs cross them).

For every stream (one process's communicator) of each dump, over the ticks
(200 ms) of the replay:

- ``factor``: the highest slowdown factor held at every tick for the window
  (10 s), against the 3x asked;
- ``last``: the highest share of a kind of collective a rank was the last
  to arrive at (of the latest 16), held for the window;
- ``late``: the highest lateness held for the window by a rank last often
  enough at a kind of collective (90% on the host, 85% on the device), as a
  share of its communicator's baseline interval (the margin is that share:
  0.5 on the host, 0.1 on the device), and whether it was read from the
  host's entries or the device's starts.

Each dump is replayed alone (one node's ranks, as its agent sees them); the
rows must reach back past the trigger's 30 s baseline (a lab run dumped at
its end: ``lab run --record --dump-at-end``).

    python -m bench.slowdown_replay DUMP_OR_DIR... [--from-ns NS]
"""

from __future__ import annotations

import argparse
from collections import deque
from pathlib import Path

import numpy as np

from stallwatch.dumpers.format import read_dump
from stallwatch.recorder.slowdown import (
    SlowdownConfig,
    SlowdownWatch,
    last_share_needed,
    replay_ticks,
)

TICK_NS = 200_000_000


def replay(rows: np.ndarray, config: SlowdownConfig) -> dict[tuple[int, int], dict[str, object]]:
    """Per (pid, comm hash): the highest factor and lateness share held for
    the window, and whether lateness was read on the device."""
    watch = SlowdownWatch(config)
    window = int(config.window_s * 1e9)
    held: dict[tuple[int, int], dict[str, deque[tuple[int, float]]]] = {}
    best: dict[tuple[int, int], dict[str, object]] = {}
    comms = {
        (int(pid), int(h)): int(c)
        for pid, h, c in zip(rows["pid"], rows["comm_hash"], rows["comm"], strict=True)
    }
    for now, _ in replay_ticks(watch, rows, TICK_NS):
        for g in watch.gauges():
            key = (g.pid, g.comm_hash)
            device = watch.device_stream(g.pid, comms.get(key, 0))
            late = 0.0
            if (
                g.last_share is not None
                and g.last_share >= last_share_needed(device)
                and g.lateness_ns is not None
                and g.baseline_lateness_ns is not None
                and g.baseline_interval_ns
            ):
                late = (g.lateness_ns - g.baseline_lateness_ns) / g.baseline_interval_ns
            seen = held.setdefault(key, {"factor": deque(), "late": deque(), "share": deque()})
            out = best.setdefault(key, {"rank": g.rank, "factor": 0.0, "late": 0.0, "share": 0.0})
            out["device"] = device
            values = (("factor", g.factor or 0.0), ("late", late), ("share", g.last_share or 0.0))
            for name, value in values:
                q = seen[name]
                q.append((now, value))
                while q and now - q[0][0] > window:
                    q.popleft()
                if now - q[0][0] >= window - TICK_NS:  # a whole window's ticks
                    out[name] = max(float(out[name]), min(v for _, v in q))  # type: ignore[arg-type]
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.slowdown_replay", description=__doc__)
    p.add_argument("paths", nargs="+", type=Path)
    p.add_argument("--from-ns", type=int, default=0, help="only the rows entered from then on")
    args = p.parse_args(argv)
    files = [
        f
        for path in args.paths
        for f in (sorted(path.rglob("*.msgpack")) if path.is_dir() else [path])
    ]
    config = SlowdownConfig()
    for f in files:
        rec = read_dump(f)
        rows = rec.rings["nccl"].rows
        rows = rows[rows["ts_ns"] >= args.from_ns]
        if not len(rows):
            continue
        span = (int(rows["ts_ns"].max()) - int(rows["ts_ns"].min())) / 1e9
        print(f"{rec.host} ({f.name}): {len(rows)} rows over {span:.0f} s")
        for (pid, comm_hash), out in sorted(replay(rows, config).items()):
            where = "device" if out["device"] else "host"
            print(
                f"  pid {pid} rank {out['rank']} comm {comm_hash:#018x}: "
                f"factor {out['factor']:.2f}x, last {out['share']:.0%}, "
                f"late {out['late']:.3f} of the cycle ({where})"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

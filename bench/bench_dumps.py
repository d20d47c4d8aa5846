"""Dump benchmark: writing and reading a dump of a million ring entries.

    python -m bench.bench_dumps [--quick] [--repeats N] [--rows N] [--dir DIR]

Figures (medians over repeats, printed as figure / value / target):
- atomic write of a dump holding 1M nccl ring entries (< 0.5 s): encode,
  temporary file, fsync, rename, fsync of the folder; anchor: the same bytes
  written and fsynced raw, in the same run (the disk's floor);
- validating read of it back (< 0.2 s); anchor: the raw file read into numpy;
- the watchdog's check of one tick with 64 ranks (no target; it runs every
  150 ms).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import numpy as np

from bench.common import Figure, median_time, render
from dumpers.format import read_dump, write_dump
from dumpers.model import Clock, Recording, Ring, Trigger, TriggerKind
from dumpers.schema import NCCL_EVENT, Op, State
from recorder.model import CommProgress, ProcessState, TickState
from recorder.watchdog import Watchdog

WRITE_TARGET_S = 0.5
READ_TARGET_S = 0.2


def _recording(rows: int) -> Recording:
    ring = np.zeros(rows, NCCL_EVENT)
    ring["ts_ns"] = np.arange(rows, dtype=np.uint64) * 1000 + 10**12
    ring["end_ns"] = ring["ts_ns"] + 700
    ring["comm_hash"] = 0xDEADBEEF_CAFEF00D
    ring["seq"] = np.arange(rows)
    ring["op"] = Op.ALL_REDUCE
    ring["state"] = State.COMPLETED
    trigger = Trigger(TriggerKind.IN_FLIGHT, "bench", "bench-incident", 10**12)
    return Recording(
        host="bench",
        boot_id="bench",
        clock=Clock(10**12, 1_790_000_000 * 10**9),
        processes=(),
        communicators=(),
        rings={"nccl": Ring(ring, overwritten=5, lost=0)},
        trigger=trigger,
    )


def _raw_write(path: Path, data: memoryview) -> None:
    with open(path, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())


def _raw_read(path: Path) -> np.ndarray:
    out = np.empty(path.stat().st_size, np.uint8)
    with open(path, "rb", buffering=0) as src:
        src.readinto(memoryview(out))  # type: ignore[arg-type]
    return out


def _io_figures(rows: int, repeats: int, folder: Path) -> list[Figure]:
    rec = _recording(rows)
    written: list[Path] = []

    def write() -> None:
        written.append(write_dump(folder, rec))

    t_write = median_time(write, repeats)
    path = written[-1]
    size_mb = path.stat().st_size / 1e6
    raw = folder / "raw.bin"
    t_raw_write = median_time(
        lambda: _raw_write(raw, rec.rings["nccl"].rows.view(np.uint8).data), repeats
    )
    back = read_dump(path)
    assert back.rings["nccl"].rows.tobytes() == rec.rings["nccl"].rows.tobytes()
    t_read = median_time(lambda: read_dump(path), repeats)
    t_raw_read = median_time(lambda: _raw_read(raw), repeats)
    label = f"{rows / 1e6:g}M" if rows >= 1_000_000 else f"{rows:,}"
    return [
        Figure(
            f"dumps: atomic write, {label} nccl entries ({size_mb:.0f} MB)",
            t_write,
            "s",
            f"< {WRITE_TARGET_S} s",
            t_write < WRITE_TARGET_S,
            f"raw write+fsync: {t_raw_write:.3f} s",
        ),
        Figure(
            f"dumps: validating read, {label} nccl entries",
            t_read,
            "s",
            f"< {READ_TARGET_S} s",
            t_read < READ_TARGET_S,
            f"raw read into numpy: {t_raw_read:.3f} s",
        ),
    ]


def _watchdog_figure(repeats: int) -> Figure:
    now = 100 * 10**9
    ranks = range(1000, 1064)
    state = TickState(
        now,
        (),
        tuple(
            CommProgress(p, p, 7, p % 8, 64, now - 10**8, now - 10**8, 100, 0, False) for p in ranks
        ),
        tuple(ProcessState(p, True, True) for p in ranks),
    )
    wd = Watchdog(60 * 10**9, "bench")
    loops = 1000
    t = median_time(lambda: [wd.check(state) for _ in range(loops)], repeats) / loops
    return Figure(
        "dumps: watchdog check of one tick, 64 ranks", t * 1e6, "us", "-", None, "runs every 150 ms"
    )


def figures(
    quick: bool = False, repeats: int = 5, rows: int | None = None, folder: Path | None = None
) -> list[Figure]:
    n = rows if rows is not None else (50_000 if quick else 1_000_000)
    with tempfile.TemporaryDirectory(prefix="bench-dumps-", dir=folder) as tmp:
        out = _io_figures(n, repeats, Path(tmp))
    out.append(_watchdog_figure(repeats))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.bench_dumps",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="a quick run on small data")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", type=int, default=None, help="nccl ring entries (1M)")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (a temp dir)")
    args = parser.parse_args(argv)
    result = figures(args.quick, args.repeats, args.rows, args.dir)
    print(render(result))
    return 0 if all(f.ok is not False for f in result) else 1


if __name__ == "__main__":
    raise SystemExit(main())

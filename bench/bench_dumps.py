"""Dump benchmark: writing and reading a dump of a million ring entries.

    python -m bench.bench_dumps [--quick] [--repeats N] [--rows N] [--dir DIR]

Figures (medians over repeats, printed as figure / value / target):
- atomic write of a dump holding 1M nccl ring entries (< 0.5 s): encode,
  temporary file, fsync, rename, fsync of the folder; anchor: the same bytes
  written and fsynced raw, in the same run (the disk's floor);
- validating read of it back (< 0.2 s); anchor: the raw file read into numpy;
- what the checksums (format version 6) cost, side by side in one run (no
  target: the read above has its own, checksums included): the validating
  read against the same dump without them (as format 5 wrote it), the read
  of the ring's latest 65,536 rows (what ``analyze`` reads of a node's
  ring) with and without checking their blocks, and the write's checksums
  against the whole write;
- four agents on loopback HTTP (the real server of ``analyzer.http``, the
  real peers client, 65,536-entry nccl rings): from the tick that detects a
  hang, on two nodes at once, to the last node's dump renamed into place
  under the one shared incident id (< 0.5 s).  In one process: the lab's
  benchmark measures the same with agents in network namespaces;
- the watchdog's check of one tick with 64 ranks (no target; it runs every
  150 ms).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import numpy as np

from bench.common import Figure, median_time, render
from stallwatch.dumpers.errors import DumpError
from stallwatch.dumpers.format import _descr, block_crcs, read_dump, read_dump_deferred, write_dump
from stallwatch.dumpers.model import Clock, Recording, Ring, Trigger, TriggerKind
from stallwatch.dumpers.schema import NCCL_EVENT, RING_DTYPES, TCP_EVENT_V6, Op, State
from stallwatch.recorder.peers import peer_notifier
from stallwatch.recorder.tickstate import CommProgress, InflightCall, ProcessState, TickState
from stallwatch.recorder.watchdog import DumpScheduler, Incidents, Watchdog

WRITE_TARGET_S = 0.5
READ_TARGET_S = 0.2
WINDOW_ROWS = 65_536  # of a ring, read by analyze (a node's ranks x its window)


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
    raw = folder / "raw.bin"
    t_raw_write = median_time(
        lambda: _raw_write(raw, rec.rings["nccl"].rows.view(np.uint8).data), repeats
    )
    back = read_dump(path)
    assert back.rings["nccl"].rows.tobytes() == rec.rings["nccl"].rows.tobytes()
    t_read = median_time(lambda: read_dump(path), repeats)
    t_raw_read = median_time(lambda: _raw_read(raw), repeats)
    label = f"{rows / 1e6:g}M" if rows >= 1_000_000 else f"{rows:,}"
    return [*_plain_figures(path, rec, label, t_write, t_raw_write, t_read, t_raw_read),
            *_checksum_figures(path, rec, repeats, label, t_write)]  # fmt: skip


def _unchecked_copy(path: Path) -> Path:
    """The dump as format 5 wrote it: no checksums (nor links, nor the TCP
    rows' connection state of format 7, nor format 10's programs)."""
    doc = msgpack.unpackb(path.read_bytes(), raw=False)
    del doc["checksums"]
    doc.pop("links", None)
    doc.pop("programs", None)
    doc["rings"].pop("link", None)
    tcp = doc["rings"].get("tcp")
    if tcp is not None:
        rows = np.frombuffer(tcp["data"], dtype=RING_DTYPES["tcp"])
        old = np.zeros(len(rows), TCP_EVENT_V6)
        for name in TCP_EVENT_V6.names or ():
            old[name] = rows[name]
        tcp["dtype"], tcp["data"] = _descr(TCP_EVENT_V6), old.tobytes()
    doc["version"] = 5
    old = path.with_name("unchecked.msgpack")
    old.write_bytes(msgpack.packb(doc, use_bin_type=True))
    return old


def _checksum_figures(
    path: Path, rec: Recording, repeats: int, label: str, t_write: float
) -> list[Figure]:
    old = _unchecked_copy(path)
    t_checked, t_plain = _side_by_side(lambda: read_dump(path), lambda: read_dump(old), repeats)
    ring = read_dump_deferred(path, ["nccl"])[1]["nccl"]
    bare = dataclasses.replace(ring, checksums=())
    first = max(ring.rows - WINDOW_ROWS, 0)
    buffer = bytearray(ring.nbytes)
    t_window, t_window_bare = _side_by_side(
        lambda: ring.read(buffer, first), lambda: bare.read(buffer, first), repeats
    )
    data = rec.rings["nccl"].rows.view(np.uint8).data
    t_sums = median_time(lambda: block_crcs(data), repeats)
    ratio, window = t_checked / t_plain, t_window / t_window_bare
    return [
        Figure(
            f"dumps: validating read with checksums, {label} nccl entries",
            ratio,
            "x",
            "-",
            None,
            f"{t_checked:.3f} s against {t_plain:.3f} s without (format 5)",
        ),
        Figure(
            f"dumps: a ring's latest {min(WINDOW_ROWS, ring.rows):,} rows read, blocks checked",
            window,
            "x",
            "-",
            None,
            f"{t_window * 1e3:.1f} ms against {t_window_bare * 1e3:.1f} ms unchecked",
        ),
        Figure(
            "dumps: checksums of the ring's data, written with it",
            t_sums / t_write,
            "x",
            "-",
            None,
            f"{t_sums:.3f} s of the {t_write:.3f} s write",
        ),
    ]


def _side_by_side(
    a: Callable[[], object], b: Callable[[], object], repeats: int
) -> tuple[float, float]:
    """Median times of ``a`` and ``b``, run in turn (the load of the moment
    falls on both alike)."""
    ta, tb = [], []
    for _ in range(repeats):
        ta.append(median_time(a, 1))
        tb.append(median_time(b, 1))
    return statistics.median(ta), statistics.median(tb)


def _plain_figures(
    path: Path,
    rec: Recording,
    label: str,
    t_write: float,
    t_raw_write: float,
    t_read: float,
    t_raw_read: float,
) -> list[Figure]:
    size_mb = path.stat().st_size / 1e6
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


class _Agent:
    """The part of an agent that the HTTP server and the peers see."""

    def __init__(self, host: str, folder: Path, rec: Recording) -> None:
        self.host = host
        self.folder = folder
        snapshot = lambda: dataclasses.replace(rec, host=host)  # noqa: E731
        scheduler = DumpScheduler.for_directory(folder, snapshot)
        self.incidents = Incidents(Watchdog(2 * 10**9, host), scheduler)

    def recording(self) -> Recording:
        return self.incidents.scheduler.recording()

    def metrics_text(self) -> str:
        return ""

    def request_dump(
        self,
        reason: str,
        incident_id: str | None,
        origin: str | None,
        by_client: bool = True,
        *,
        kind: str | None = None,
    ) -> object:
        origin_kind = next((k for k in TriggerKind if k.value == kind), None)
        return self.incidents.request_dump(
            reason, incident_id, origin, by_client, origin_kind=origin_kind
        )


def _converged(agents: list[_Agent]) -> bool:
    dumps = [list(a.folder.glob("*.msgpack")) for a in agents]
    if not all(len(d) == 1 for d in dumps):
        return False
    ids = set()
    for d in dumps:
        try:
            ids.add(read_dump(d[0]).trigger.incident_id)  # type: ignore[union-attr]
        except DumpError:
            if d[0].exists():
                raise
            # relabelled meanwhile: an agent that detected the stall with
            # the larger id writes its dump under the other id, then
            # removes the first
            return False
    return len(ids) == 1


def _one_incident(folder: Path, rec: Recording) -> float:
    from stallwatch.query.http import serve_http

    agents = [_Agent(f"node{n}", folder / f"node{n}", rec) for n in range(4)]
    servers = [serve_http(a, "127.0.0.1:0", token="bench") for a in agents]
    try:
        addresses = [s.address for s in servers]
        for agent, address in zip(agents, addresses, strict=True):
            others = [a for a in addresses if a != address]
            agent.incidents.notify = peer_notifier(others, agent.host, "bench")
        now = time.monotonic_ns()
        stuck = TickState(
            now,
            (InflightCall(1, 1, 7, Op.ALL_REDUCE, 57, now - 3 * 10**9),),
            (CommProgress(1, 1, 7, 0, 4, now - 3 * 10**9, now - 3 * 10**9, 57, 1, False),),
            (ProcessState(1, True, True),),
        )
        start = time.perf_counter()
        agents[1].incidents.tick(stuck)
        agents[2].incidents.tick(stuck)
        while not _converged(agents):
            if time.perf_counter() - start > 10:
                raise RuntimeError("4 agents did not converge on one incident in 10 s")
            time.sleep(0.005)
        return time.perf_counter() - start
    finally:
        for server in servers:
            server.close()


def _peers_figure(repeats: int, quick: bool, folder: Path) -> Figure:
    rec = _recording(4096 if quick else 65_536)
    quiet = logging.getLogger("stallwatch")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # each incident logs a few warnings: not the table's
    try:
        times = [_one_incident(folder / f"run{i}", rec) for i in range(repeats)]
    finally:
        quiet.setLevel(level)
    median = statistics.median(times)
    return Figure(
        "dumps: 4 agents on loopback HTTP, detection to last dump in place",
        median,
        "s",
        "< 0.5 s",
        median < 0.5,
        f"{len(rec.rings['nccl'].rows):,}-entry rings, 2 nodes detect at once",
    )


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
        out.append(_peers_figure(min(repeats, 3), quick or n < 100_000, Path(tmp)))
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

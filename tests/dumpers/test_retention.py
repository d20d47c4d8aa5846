"""Retention of the dump folder: newest kept, the new dump never removed,
incidents counted apart from requested dumps, other files left alone,
temporary files of writers gone (or stale) cleaned, live ones counted."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import time
from pathlib import Path

import pytest

from stallwatch.dumpers import format as fmt
from stallwatch.dumpers.model import Trigger, TriggerKind
from stallwatch.dumpers.retention import STALE_TEMP_S, enforce
from stallwatch.dumpers.schema import RING_DTYPES
from tests.dump_samples import sample_recording


def _dumps(folder: Path, sizes: list[int]) -> list[Path]:
    """Dump-named files, oldest first, with distinct modification times."""
    paths = []
    base = time.time() - 1000
    for i, size in enumerate(sizes):
        path = folder / f"n1-inc{i}-20261122T0000{i:02d}000Z.msgpack"
        path.write_bytes(b"x" * size)
        os.utime(path, (base + i, base + i))
        paths.append(path)
    return paths


def _names(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


def test_keeps_the_newest_by_count(tmp_path: Path) -> None:
    paths = _dumps(tmp_path, [10] * 5)
    removed = enforce(tmp_path, max_dumps=2, max_bytes=None)
    assert sorted(removed) == sorted(paths[:3])
    assert _names(tmp_path) == {p.name for p in paths[3:]}


def test_keeps_the_newest_by_bytes(tmp_path: Path) -> None:
    paths = _dumps(tmp_path, [100, 10, 10, 30, 40])
    removed = enforce(tmp_path, max_dumps=None, max_bytes=85)
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) == 80
    # 40 + 30 + 10 fit, the next 10 would not: it and everything older go
    assert sorted(removed) == sorted(paths[:2])
    assert _names(tmp_path) == {p.name for p in paths[2:]}


def test_no_limits_remove_nothing(tmp_path: Path) -> None:
    _dumps(tmp_path, [10] * 3)
    assert enforce(tmp_path, None, None) == []
    assert len(_names(tmp_path)) == 3


def test_never_removes_the_dump_just_written(tmp_path: Path) -> None:
    old = _dumps(tmp_path, [10, 10])
    new = fmt.write_dump(tmp_path, sample_recording(2000))  # about 230 kB: over the limit
    removed = enforce(tmp_path, max_dumps=1, max_bytes=1000, keep=new)
    assert sorted(removed) == sorted(old)
    assert _names(tmp_path) == {new.name}
    # even if its clock says it is older than the others: it takes the one slot
    os.utime(new, (1, 1))
    more = _dumps(tmp_path, [10])
    assert enforce(tmp_path, max_dumps=1, max_bytes=None, keep=new.name) == more
    assert new.exists()


def test_ignores_other_files_and_cleans_only_stale_temporaries(tmp_path: Path) -> None:
    _dumps(tmp_path, [10] * 3)
    others = ["notes.txt", "n1-x.msgpack.bak", ".hidden.msgpack", "README"]
    for name in others:
        (tmp_path / name).write_text("keep me")
    (tmp_path / "sub.msgpack").mkdir()
    fresh = tmp_path / f".n1-a.msgpack.tmp-{os.getppid()}-abcd"  # its writer lives
    stale = tmp_path / f".n1-b.msgpack.tmp-{os.getppid()}-ef01"
    fresh.write_bytes(b"partial")
    stale.write_bytes(b"partial")
    old = time.time() - STALE_TEMP_S - 60
    os.utime(stale, (old, old))
    removed = enforce(tmp_path, max_dumps=1, max_bytes=None)
    assert stale in removed and fresh.exists() and not stale.exists()
    assert len(removed) == 3  # the stale temporary and the two oldest dumps
    for name in [*others, "sub.msgpack"]:
        assert (tmp_path / name).exists()


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_killed_writers_temporary_file_goes_and_a_live_ones_counts(tmp_path: Path) -> None:
    """A SIGKILL during a dump write left a 10 MB hidden file that no later
    agent removed and --max-dump-bytes did not count."""
    dumps = _dumps(tmp_path, [100, 100])
    killed = tmp_path / f".n1-c.msgpack.tmp-{_dead_pid()}-0001"
    killed.write_bytes(b"x" * 500)
    assert enforce(tmp_path, max_dumps=None, max_bytes=None) == [killed]
    writing = tmp_path / f".n1-d.msgpack.tmp-{os.getppid()}-0002"  # its writer lives
    writing.write_bytes(b"x" * 150)
    assert enforce(tmp_path, max_dumps=None, max_bytes=300) == [dumps[0]]
    assert writing.exists() and dumps[1].exists()


def _write(folder: Path, kind: TriggerKind, n: int) -> Path:
    rec = sample_recording(10)
    trig = Trigger(kind, "r", f"inc-{kind.value}-{n}", 1_000_000_000 + n, origin_host="h")
    path = fmt.write_dump(folder, dataclasses.replace(rec, trigger=trig))
    os.utime(path, (1_000 + n, 1_000 + n))
    return path


def _incident(path: Path) -> bool:
    rec, _ = fmt.read_dump_deferred(path, RING_DTYPES)
    return rec.trigger is not None and rec.trigger.kind is not TriggerKind.MANUAL


def test_requested_dumps_never_displace_an_incident(tmp_path: Path) -> None:
    """--max-dumps 3 counts incidents and requested dumps apart: a stall's
    dump and two of a peer's survive a hundred requested ones; the bytes
    limit takes requested dumps first."""
    stall = _write(tmp_path, TriggerKind.IN_FLIGHT, 0)
    peer = _write(tmp_path, TriggerKind.PEER, 1)
    for n in range(2, 102):
        new = _write(tmp_path, TriggerKind.MANUAL, n)
        enforce(tmp_path, max_dumps=3, max_bytes=None, keep=new, kept=_incident)
    left = {p.name for p in tmp_path.glob("*.msgpack")}
    assert {stall.name, peer.name} <= left and len(left) == 5
    size = stall.stat().st_size
    newest = _write(tmp_path, TriggerKind.MANUAL, 200)
    enforce(tmp_path, max_dumps=3, max_bytes=3 * size + size // 2, keep=newest, kept=_incident)
    left = {p.name for p in tmp_path.glob("*.msgpack")}
    assert left == {stall.name, peer.name, newest.name}


def test_negative_limits_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_dumps must be >= 0, got -1"):
        enforce(tmp_path, -1, None)

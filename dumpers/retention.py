"""Retention of a dump folder (``--max-dumps``, ``--max-dump-bytes``).

Dumps are the visible ``*.msgpack`` files of the folder; newest means the
latest modification time (file name as the tie-break).  Other files are never
touched, except the hidden temporary files of ``dumpers.format.write_dump``
left behind by a writer that crashed: those are removed once they are older
than ``STALE_TEMP_S``, long after any live writer would have finished.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from .format import DUMP_SUFFIX, TEMP_MARKER

log = logging.getLogger(__name__)

STALE_TEMP_S = 3600.0


@dataclass(frozen=True, slots=True)
class _Entry:
    path: Path
    mtime_ns: int
    size: int


def _scan(dump_dir: Path) -> tuple[list[_Entry], list[_Entry]]:
    """(dumps newest first, temporary files)."""
    dumps: list[_Entry] = []
    temps: list[_Entry] = []
    with os.scandir(dump_dir) as it:
        for item in it:
            try:
                if not item.is_file(follow_symlinks=False):
                    continue
                st = item.stat(follow_symlinks=False)
            except OSError:  # vanished meanwhile
                continue
            entry = _Entry(Path(item.path), st.st_mtime_ns, st.st_size)
            if item.name.startswith(".") and TEMP_MARKER in item.name:
                temps.append(entry)
            elif item.name.endswith(DUMP_SUFFIX) and not item.name.startswith("."):
                dumps.append(entry)
    dumps.sort(key=lambda e: (e.mtime_ns, e.path.name), reverse=True)
    return dumps, temps


def _remove(path: Path) -> bool:
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    except OSError as exc:
        log.warning("%s: cannot remove old dump: %s", path, exc.strerror or exc)
        return False
    return True


def _excess(
    dumps: list[_Entry], keep: str | None, max_dumps: int | None, max_bytes: int | None
) -> list[_Entry]:
    """The dumps to remove: ``keep`` (a file name) stays and counts first;
    then, newest first, from the first dump that would break a limit, it and
    every older one."""
    kept = [e for e in dumps if e.path.name == keep]
    kept_count, kept_bytes = len(kept), sum(e.size for e in kept)
    doomed: list[_Entry] = []
    for entry in dumps:
        if entry.path.name == keep:
            continue
        over_count = max_dumps is not None and kept_count + 1 > max_dumps
        over_bytes = max_bytes is not None and kept_bytes + entry.size > max_bytes
        if doomed or over_count or over_bytes:
            doomed.append(entry)
        else:
            kept_count += 1
            kept_bytes += entry.size
    return doomed


def enforce(
    dump_dir: str | os.PathLike[str],
    max_dumps: int | None,
    max_bytes: int | None,
    keep: str | os.PathLike[str] | None = None,
    now: float | None = None,
) -> list[Path]:
    """Remove the oldest dumps until at most ``max_dumps`` remain and they
    hold at most ``max_bytes`` (None: no limit).  ``keep`` (the dump just
    written) is never removed, even if it alone exceeds a limit.  Returns the
    paths removed, stale temporary files included."""
    for name, value in (("max_dumps", max_dumps), ("max_bytes", max_bytes)):
        if value is not None and value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    folder = Path(dump_dir)
    dumps, temps = _scan(folder)
    cutoff_ns = int(((time.time() if now is None else now) - STALE_TEMP_S) * 1e9)
    doomed = [e for e in temps if e.mtime_ns < cutoff_ns]
    doomed += _excess(dumps, Path(keep).name if keep else None, max_dumps, max_bytes)
    removed = [e.path for e in doomed if _remove(e.path)]
    for path in removed:
        log.info("retention: removed %s", path)
    return removed

"""Retention of a dump folder (``--max-dumps``, ``--max-dump-bytes``).

Dumps are the visible ``*.msgpack`` files of the folder; newest means the
latest modification time (file name as the tie-break).  With ``kept`` (what
the agent passes: dumps a watchdog raised, here or on a peer), those are
counted apart from the others (dumps clients asked for): each class keeps
its newest ``max_dumps``, and the bytes are held under ``max_bytes`` by
removing the others first, oldest first, so that requests can never displace
an incident.  Other files are never touched, except the hidden temporary
files of ``dumpers.format.write_dump``: one whose writer is gone (killed
while writing: its pid is in the name) is removed, as is any older than
``STALE_TEMP_S``; the others count against ``max_bytes`` while they last.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
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
    dumps: list[_Entry],
    keep: str | None,
    max_dumps: int | None,
    max_bytes: int | None,
    used: int = 0,
) -> list[_Entry]:
    """The dumps of one class to remove: ``keep`` (a file name) stays and
    counts first; then, newest first, from the first dump that would break a
    limit (``used`` bytes are taken already), it and every older one."""
    kept = [e for e in dumps if e.path.name == keep]
    kept_count, kept_bytes = len(kept), used + sum(e.size for e in kept)
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


def _writer_gone(entry: _Entry) -> bool:
    """A temporary file ``.<name>.tmp-<pid>-<random>`` whose writer no
    longer runs (a pid taken again later keeps the file to its age limit)."""
    pid = entry.path.name.rpartition(TEMP_MARKER)[2].split("-", 1)[0]
    if not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def enforce(
    dump_dir: str | os.PathLike[str],
    max_dumps: int | None,
    max_bytes: int | None,
    keep: str | os.PathLike[str] | None = None,
    now: float | None = None,
    kept: Callable[[Path], bool] | None = None,
) -> list[Path]:
    """Remove the oldest dumps until at most ``max_dumps`` remain (of each
    class, with ``kept``: see the module docstring) and they hold at most
    ``max_bytes`` with the temporary files (None: no limit).  ``keep`` (the
    dump just written) is never removed, even if it alone exceeds a limit.
    Returns the paths removed, temporary files of writers gone included."""
    for name, value in (("max_dumps", max_dumps), ("max_bytes", max_bytes)):
        if value is not None and value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    folder = Path(dump_dir)
    dumps, temps = _scan(folder)
    cutoff_ns = int(((time.time() if now is None else now) - STALE_TEMP_S) * 1e9)
    stale = [e for e in temps if e.mtime_ns < cutoff_ns or _writer_gone(e)]
    writing = sum(e.size for e in temps if e not in stale)
    keep_name = Path(keep).name if keep else None
    incidents = [e for e in dumps if kept is not None and kept(e.path)]
    others = [e for e in dumps if e not in incidents]
    doomed = _excess(incidents, keep_name, max_dumps, max_bytes, writing)
    held = writing + sum(e.size for e in incidents if e not in doomed)
    doomed += _excess(others, keep_name, max_dumps, max_bytes, held)
    removed = [e.path for e in [*stale, *doomed] if _remove(e.path)]
    for path in removed:
        log.info("retention: removed %s", path)
    return removed

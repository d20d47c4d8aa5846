"""Dump folders: what one holds (each dump's incident and time, read from its
header, the rings left in the file, newest first: the agent's ``GET /dumps``
and ``POST /collect``), and the per-node layout that dumps fetched from
agents are saved in (``stallwatch collect``, ``analyze --agents --save``)::

    DIR/<host>/<host>-<incident>-<time>.msgpack

which ``analyze DIR``, ``query DIR`` and ``export DIR`` read like any folder.

A file that is not a readable dump (half written by a crashed writer of
another tool, foreign) is left out and logged: it would be refused by every
reader anyway.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from .errors import DumpError, DumpFormatError
from .format import DUMP_SUFFIX, decode, read_dump_deferred, safe_name, write_dump_bytes
from .model import Recording
from .schema import RING_DTYPES

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DumpFile:
    name: str  # the file's name in the folder
    incident_id: str | None  # None: written with no trigger (a plain recording)
    host: str
    wall_ns: int  # when it was taken, wall clock of its host
    bytes: int


def list_dumps(folder: Path) -> list[DumpFile]:
    """The folder's dumps, newest first (by the time they were taken)."""
    out = []
    try:
        paths = [p for p in folder.iterdir() if _is_dump(p)]
    except OSError as exc:
        log.warning("%s: cannot list dumps: %s", folder, exc.strerror or exc)
        return []
    for path in paths:
        try:
            rec, _ = read_dump_deferred(path, RING_DTYPES)
            size = path.stat().st_size
        except (DumpError, OSError) as exc:
            log.info("%s: not listed: %s", path, exc)
            continue
        trig = rec.trigger
        wall = rec.clock.to_wall_ns(trig.time_ns) if trig else rec.clock.realtime_ns
        incident = trig.incident_id if trig is not None and trig.incident_id else None
        out.append(DumpFile(path.name, incident, rec.host, wall, size))
    out.sort(key=lambda d: (d.wall_ns, d.name), reverse=True)
    return out


def _is_dump(path: Path) -> bool:
    return path.name.endswith(DUMP_SUFFIX) and not path.name.startswith(".") and path.is_file()


def save_dump(out_dir: Path, host: str, name: str, data: bytes) -> tuple[Path, Recording]:
    """Check ``data`` with the dump reader, then write it as it is to
    ``out_dir/<host>/<name>`` (both sanitized: they come from an agent),
    atomically; DumpFormatError (naming ``host``'s ``name``) if it is not a
    dump, DumpWriteError if it cannot be written."""
    file_name = safe_name(Path(name).name, 200)
    if not file_name.endswith(DUMP_SUFFIX):
        raise DumpFormatError(f"{host}: {name!r} is not named as a dump (*{DUMP_SUFFIX})")
    rec = decode(data, f"{host}:{file_name}")
    folder = out_dir / safe_name(host)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DumpError(f"{folder}: cannot create: {exc.strerror or exc}") from None
    return write_dump_bytes(folder / file_name, data), rec

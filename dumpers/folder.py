"""What a dump folder holds: each dump's incident and time, read from its
header (the rings stay in the file), newest first.  Served by the agent as
``GET /dumps`` and used by ``POST /collect`` (``stallwatch collect``).

A file that is not a readable dump (half written by a crashed writer of
another tool, foreign) is left out and logged: it would be refused by every
reader anyway.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from .errors import DumpError
from .format import DUMP_SUFFIX, read_dump_deferred
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

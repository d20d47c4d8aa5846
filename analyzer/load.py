"""Stage "load": files and folders in, recordings and Flight Recorder dumps out.

Paths are expanded and every file's kind told by ``dumpers.inputs`` (the one
opener of every command: foreign files named and ignored, unreadable ones
lost).  Each input is read on its own; one that cannot be used (truncated,
corrupt) is reported in its ``InputStatus`` and the others are still read.

``open_incidents`` is what every reader of recordings uses (``query``,
``serve``, ``export``): the inputs grouped into incidents, Flight Recorder
files turned into one recording per rank.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import threading
from collections.abc import Collection, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import cast

from stallwatch.dumpers.errors import DumpError
from stallwatch.dumpers.format import prefetch_head
from stallwatch.dumpers.inputs import (
    SKIPPED_IN_FOLDERS,
    InputStatus,
    SourceKind,
    classify,
    expand,
    flight_incident_id,
    group_dumps,
    group_flight,
    head_of,
    incident_key,
    looks_like_flightrec,
    read_dump_input,
    read_status,
    sorted_statuses,
)
from stallwatch.dumpers.model import Recording

from .align import Source, prestage
from .columns import Columns, Handed, hand_over
from .flightrec import FrDump, read_flightrec
from .parallel import threads
from .plausible import fr_damage
from .progress import Progress

Loaded = Source | FrDump

__all__ = [
    "SKIPPED_IN_FOLDERS",
    "IncidentInputs",
    "Loaded",
    "expand",
    "head_of",
    "load_inputs",
    "load_one",
    "open_incidents",
]


def load_one(
    path: str, defer: Collection[str] = (), flight: bool | None = None
) -> tuple[Loaded | None, InputStatus]:
    """One input (a dump or a Flight Recorder file); our dumps' rings named
    in ``defer`` are left in the file (read when their rows are wanted, see
    ``Source.deferred``).  ``flight``: whether it is a Flight Recorder file,
    when the caller knows (``dumpers.inputs.classify``)."""
    if flight is None:
        head = head_of(path)
        flight = head is not None and looks_like_flightrec(head)
    if flight:
        try:
            fr = read_flightrec(path)
        except DumpError as exc:
            return None, InputStatus(path, False, str(exc), SourceKind.FLIGHT_RECORDER)
        damaged = fr_damage(fr)
        if damaged is not None:  # lost, as one that cannot be read (analyzer.plausible)
            return None, InputStatus(path, False, damaged, SourceKind.FLIGHT_RECORDER)
        return fr, InputStatus(path, True, None, SourceKind.FLIGHT_RECORDER)
    read = read_dump_input(path, defer)
    if isinstance(read, InputStatus):
        return None, read
    rec, deferred = read
    return Source(path, rec, deferred), read_status(path, rec)


# Flight Recorder pickles cost seconds of unpickling per thousand entries,
# all of it under the GIL: many of them are read in worker processes.
POOL_MIN_BYTES = 16 << 20  # of Flight Recorder files, below which one process reads them
POOL_MIN_DUMPS = 1024  # of our dumps, from which their headers are parsed on workers too


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _pool_for(
    files: list[str], min_bytes: int | None = None
) -> tuple[ProcessPoolExecutor, int] | None:
    """Worker processes for the files, when they are many and big enough
    (``min_bytes``, POOL_MIN_BYTES by default) to pay for starting them."""
    workers = min(threads(), len(files))
    least = POOL_MIN_BYTES if min_bytes is None else min_bytes
    if workers < 2 or (least and sum(_size(f) for f in files) < least):
        return None
    # fork is instant, but not safe beside other threads: then a fresh interpreter
    method = "fork" if threading.active_count() == 1 else "forkserver"
    try:
        return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method)), workers
    except (OSError, ValueError):
        return None


def _read_all(
    files: list[str], flight: Collection[str], defer: Collection[str]
) -> Iterator[tuple[Loaded | None, InputStatus]]:
    """load_one of each file, in order; Flight Recorder files on worker
    processes when they pay, the rest here meanwhile."""
    if defer:  # thousands of dumps: their headers fetched from disk side by side
        for f in files:
            prefetch_head(f)
    fr = [f for f in files if f in flight]
    pooled = _pool_for(fr)
    if pooled is None and len(files) - len(fr) >= POOL_MIN_DUMPS and defer:
        # thousands of our dumps: their headers (tables, validation) are
        # parsed on worker processes too, the rings staying in the files
        fr, pooled = files, _pool_for(files, 0)
    if pooled is None:
        yield from (load_one(f, defer, f in flight) for f in files)
        return
    pool, workers = pooled
    size = max(1, len(fr) // (8 * workers))
    chunks = [fr[i : i + size] for i in range(0, len(fr), size)]
    with pool:
        results = pool.map(
            _load_chunk,
            chunks,
            [tuple(defer)] * len(chunks),
            [[f in flight for f in chunk] for chunk in chunks],
        )
        done = (item for chunk in results for item in _taken(chunk))
        wanted = set(fr)
        for f in files:  # results come in the order of fr: the order of files
            yield next(done) if f in wanted else load_one(f, defer, f in flight)


def _load_chunk(
    paths: list[str], defer: tuple[str, ...], flights: list[bool]
) -> list[tuple[Loaded | None, InputStatus]]:
    """load_one of each file (on a worker); with the NCCL rings left in the
    files, our dumps' windows are read and their calls staged here too
    (``align.prestage``): the work of every dump is on every core, the
    incident's process only joins their rows."""
    got = [load_one(p, defer, flight) for p, flight in zip(paths, flights, strict=True)]
    if "nccl" not in defer:
        return got
    ours = prestage([item for item, _ in got if isinstance(item, Source)])
    if ours and ours[0].staged is not None:  # one table for the chunk: a file of shared memory
        handed = hand_over(cast(Columns, ours[0].staged.table))
        ours = [_with_table(s, handed) for s in ours]
    staged = iter(ours)
    return [(next(staged) if isinstance(item, Source) else item, st) for item, st in got]


def _with_table(s: Source, table: Columns | Handed) -> Source:
    assert s.staged is not None
    return dataclasses.replace(s, staged=dataclasses.replace(s.staged, table=table))


def _taken(
    chunk: list[tuple[Loaded | None, InputStatus]],
) -> list[tuple[Loaded | None, InputStatus]]:
    """A worker's chunk with its table of staged calls taken from shared memory."""
    first = next((x for x, _ in chunk if isinstance(x, Source) and x.staged is not None), None)
    if first is None or first.staged is None or not isinstance(first.staged.table, Handed):
        return chunk
    table = first.staged.table.take()
    return [(_with_table(x, table) if isinstance(x, Source) else x, st) for x, st in chunk]


def load_inputs(
    paths: Sequence[str], progress: bool = False, defer: Collection[str] = ()
) -> tuple[list[Loaded], list[InputStatus]]:
    """Every input named (files, folders); with ``defer``, our dumps' rings
    of those names stay in their files until wanted."""
    found = classify(paths)
    flight = set(found.flight)
    wanted = set(found.dumps) | flight
    files = [f for f in found.heads if f in wanted]
    statuses = list(found.statuses)
    loaded: list[Loaded] = []
    shown = Progress("loaded {}/{} files", len(files), progress)
    for item, status in _read_all(files, flight, defer):
        statuses.append(status)
        if item is not None:
            loaded.append(item)
        shown.step()
    shown.close()
    return loaded, sorted_statuses(statuses)


@dataclass(frozen=True, slots=True)
class IncidentInputs:
    """One incident's recordings, each with the file it came from (a Flight
    Recorder file's recording is that rank's)."""

    key: str  # unique among the incidents opened
    id: str  # as analyze shows it
    recordings: tuple[tuple[str, Recording], ...]
    flight_recorder: bool = False


def open_incidents(
    paths: Sequence[str], defer: Collection[str] = ()
) -> tuple[list[IncidentInputs], list[InputStatus]]:
    """The inputs as incidents of recordings, grouped as ``analyze`` groups
    them; with ``defer``, our dumps' rings of those names are not read (for
    a first pass over headers)."""
    from .frincident import flight_recordings

    found = classify(paths)
    statuses = list(found.statuses)
    ours: list[tuple[str, Recording]] = []
    for f in found.dumps:
        read = read_dump_input(f, defer)
        if isinstance(read, InputStatus):
            statuses.append(read)
            continue
        ours.append((f, read[0]))
        statuses.append(read_status(f, read[0]))
    groups = group_dumps(ours, lambda x: incident_key(x[1]), lambda x: x[1].host)
    out = [IncidentInputs(k, k, tuple(v)) for k, v in groups.items()]
    for folder, files in group_flight(found.flight).items():
        recs, more = flight_recordings(files)
        statuses += more
        if recs:
            out.append(IncidentInputs(folder, flight_incident_id(folder), tuple(recs), True))
    return out, sorted_statuses(statuses)

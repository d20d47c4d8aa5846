"""Stage "load": files and folders in, recordings and Flight Recorder dumps out.

Each input is read on its own; one that cannot be used (truncated, foreign,
corrupt) is reported in its ``InputStatus`` and the others are still read.
Folders are walked recursively in name order.  The kind of a file is told by
its first bytes: a pickle (PyTorch Flight Recorder), JSON (Flight Recorder's
JSON form), else our msgpack dump.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import Collection, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from stallwatch.dumpers.errors import DumpError
from stallwatch.dumpers.format import prefetch_head, read_dump_deferred

from .align import Source
from .flightrec import FrDump, looks_like_flightrec, read_flightrec
from .model import InputStatus, SourceKind
from .parallel import threads
from .progress import Progress

Loaded = Source | FrDump


SKIPPED_IN_FOLDERS = (".log", ".txt", ".md", ".json.tmp", ".tmp")


def _wanted(f: Path) -> bool:
    """In a folder: dumps and Flight Recorder files, not the agent's logs."""
    return f.is_file() and not f.name.startswith(".") and not f.name.endswith(SKIPPED_IN_FOLDERS)


def expand(paths: Sequence[str]) -> tuple[list[str], list[InputStatus]]:
    """Files named, and files under folders named; missing paths reported.
    A file named explicitly is always read; in folders, logs are skipped."""
    files: list[str] = []
    bad: list[InputStatus] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            found = sorted(str(f) for f in path.rglob("*") if _wanted(f))
            if not found:
                bad.append(InputStatus(p, False, f"{p}: folder holds no files"))
            files.extend(found)
        elif path.exists():
            files.append(p)
        else:
            bad.append(InputStatus(p, False, f"{p}: no such file or folder"))
    return files, bad


def load_one(
    path: str, defer: Collection[str] = (), head: bytes | None = None
) -> tuple[Loaded | None, InputStatus]:
    """One input; our dumps' rings named in ``defer`` are left in the file
    (read when their rows are wanted, see ``Source.deferred``).  ``head``:
    its first bytes, when the caller has read them already."""
    if head is None:
        try:
            with open(path, "rb") as f:
                head = f.read(16)
        except OSError as exc:
            return None, InputStatus(path, False, f"{path}: cannot read: {exc.strerror or exc}")
    try:
        if looks_like_flightrec(head):
            fr = read_flightrec(path)
            return fr, InputStatus(path, True, None, SourceKind.FLIGHT_RECORDER)
        rec, deferred = read_dump_deferred(path, defer)
        return Source(path, rec, deferred), InputStatus(path, True, None, SourceKind.STALLWATCH)
    except DumpError as exc:
        return None, InputStatus(path, False, str(exc))


# Flight Recorder pickles cost seconds of unpickling per thousand entries,
# all of it under the GIL: many of them are read in worker processes.
POOL_MIN_BYTES = 16 << 20  # of Flight Recorder files, below which one process reads them
POOL_MIN_DUMPS = 1024  # of our dumps, from which their headers are parsed on workers too


def head_of(path: str) -> bytes | None:
    """The first bytes, which tell the kind of file; None if unreadable
    (load_one then says why)."""
    try:
        with open(path, "rb") as f:
            return f.read(16)
    except OSError:
        return None


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
    files: list[str], defer: Collection[str]
) -> Iterator[tuple[Loaded | None, InputStatus]]:
    """load_one of each file, in order; Flight Recorder files on worker
    processes when they pay, the rest here meanwhile."""
    if defer:  # thousands of dumps: their headers fetched from disk side by side
        for f in files:
            prefetch_head(f)
    heads = {f: head_of(f) for f in files}
    fr = [f for f in files if (head := heads[f]) is not None and looks_like_flightrec(head)]
    pooled = _pool_for(fr)
    if pooled is None and len(files) - len(fr) >= POOL_MIN_DUMPS and defer:
        # thousands of our dumps: their headers (tables, validation) are
        # parsed on worker processes too, the rings staying in the files
        fr, pooled = files, _pool_for(files, 0)
    if pooled is None:
        yield from (load_one(f, defer, heads[f]) for f in files)
        return
    pool, workers = pooled
    with pool:
        results = pool.map(
            _load_one_deferred,
            fr,
            [tuple(defer)] * len(fr),
            chunksize=max(1, len(fr) // (8 * workers)),
        )
        wanted = set(fr)
        for f in files:  # results come in the order of fr: the order of files
            yield next(results) if f in wanted else load_one(f, defer, heads[f])


def _load_one_deferred(path: str, defer: tuple[str, ...]) -> tuple[Loaded | None, InputStatus]:
    return load_one(path, defer)


def load_inputs(
    paths: Sequence[str], progress: bool = False, defer: Collection[str] = ()
) -> tuple[list[Loaded], list[InputStatus]]:
    """Every input named (files, folders); with ``defer``, our dumps' rings
    of those names stay in their files until wanted."""
    files, statuses = expand(paths)
    loaded: list[Loaded] = []
    shown = Progress("loaded {}/{} files", len(files), progress)
    for item, status in _read_all(files, defer):
        statuses.append(status)
        if item is not None:
            loaded.append(item)
        shown.step()
    shown.close()
    statuses.sort(key=lambda s: os.fspath(s.path))
    return loaded, statuses

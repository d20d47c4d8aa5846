"""The SQL tables of a set of dumps as Parquet, for existing engines.

Layout (``docs/parquet.md`` documents every column)::

    DIR/_stallwatch.json                    format name and version, the tables
    DIR/<table>/incident=<id>/host=<host>/part-<dump>.parquet

One folder per table, Hive-style partitions below it (what DuckDB's
``hive_partitioning``, Spark, Trino and Athena discover), one file per dump
and table.  ``incident`` and ``host`` live in the folder names only, never in
the files (engines refuse or duplicate a column found in both).  A table that
a dump holds no row of still gets a file of its schema: every table of every
partition exists, so an engine never finds a table missing.

Incident ids: a triggered incident's own id; a Flight Recorder folder's
name, or ``snapshot`` (dumps no trigger named), with a digest of the files
(``export_id``); ``--incident`` names it.

Appending: an incident is written once.  Its files are written into a staging
folder (hidden from engines by its leading dot), then each table's
``incident=<id>`` folder is renamed into place; an incident already in the
folder is refused, never rewritten, and nothing else is touched.  Partition
values are escaped the way Hive does it (``%XX`` for ``/``, ``=``, ``%`` and
other characters engines treat specially).

Versions: 2 put every table's absolute times on the incident's clock (ns
since the epoch, ``dumpers.sqltables``) with the host's own monotonic stamp in
``host_timestamp_ns``; version 1 folders hold each host's monotonic clock in
``timestamp_ns`` and are not mixed with them.

Known limits: a folder written by another format version is refused, not
migrated.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from stallwatch.dumpers.errors import DumpError, UsageError
from stallwatch.dumpers.inputs import SNAPSHOT_KEY, unique_id
from stallwatch.dumpers.model import Recording
from stallwatch.dumpers.ranks import Ranks
from stallwatch.dumpers.ranks import of_dumps as ranks_of_dumps
from stallwatch.dumpers.schema import RING_DTYPES
from stallwatch.dumpers.sqltables import TABLE_NAMES, tables

from .incident import InputStatus, SourceKind
from .load import IncidentInputs, open_incidents

FORMAT_NAME = "stallwatch-parquet"
FORMAT_VERSION = 2
META_FILE = "_stallwatch.json"  # a leading underscore: engines skip it as data
PARTITIONS = ("incident", "host")
# left as they are in partition folder names; every other character as %XX
SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-+@")


@dataclass(frozen=True, slots=True)
class Written:
    """One incident exported."""

    incident: str
    hosts: tuple[str, ...]
    files: int
    rows: dict[str, int]  # per table


def escape(value: str) -> str:
    """A partition value as Hive writes it in a folder name."""
    out = "".join(c if c in SAFE else "".join(f"%{b:02X}" for b in c.encode()) for c in value)
    return out if out and out not in (".", "..") else "%" + out.encode().hex().upper()


def _meta() -> dict[str, object]:
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "tables": list(TABLE_NAMES),
        "partitions": list(PARTITIONS),
        "documentation": "docs/parquet.md of stallwatch",
    }


def _check_folder(root: Path) -> None:
    """The folder is new, empty, or one of ours of this version."""
    if root.exists() and not root.is_dir():
        raise UsageError(f"-o {root}: exists and is not a folder")
    meta = root / META_FILE
    if meta.is_file():
        try:
            doc = json.loads(meta.read_text())
            ok = doc.get("format") == FORMAT_NAME
            version = doc.get("version")
        except (OSError, ValueError, AttributeError):
            ok, version = False, None
        if not ok:
            raise UsageError(f"-o {root}: {META_FILE} is not a {FORMAT_NAME} description")
        if version != FORMAT_VERSION:
            raise UsageError(
                f"-o {root}: holds format version {version}; this stallwatch writes "
                f"{FORMAT_VERSION} and never mixes them (export into a new folder)"
            )
    elif root.is_dir() and any(not p.name.startswith(".") for p in root.iterdir()):
        raise UsageError(f"-o {root}: a folder that is not a stallwatch Parquet export")


def _write_meta(root: Path) -> None:
    meta = root / META_FILE
    if meta.is_file():
        return
    tmp = root / f".{META_FILE}.{uuid.uuid4().hex}"
    tmp.write_text(json.dumps(_meta(), indent=2) + "\n")
    os.replace(tmp, meta)


def _file_table(table: pa.Table) -> pa.Table:
    """What goes into a file: the partition columns dropped (the folder says
    them), wall-clock columns in microseconds, the format version in the
    schema's metadata.  Microseconds: what SQL hands back for them anyway,
    and the one unit every engine reads (Spark refuses nanosecond
    timestamps); ``timestamp_ns``, ``host_timestamp_ns`` and the other
    ``*_ns`` columns keep the nanoseconds."""
    if "host" in table.column_names:
        table = table.drop_columns(["host"])
    for i, field in enumerate(table.schema):
        if pa.types.is_timestamp(field.type):
            us = table.column(i).cast(pa.timestamp("us"), safe=False)
            table = table.set_column(i, field.with_type(pa.timestamp("us")), us)
    meta = dict(table.schema.metadata or {})
    meta[b"stallwatch.format"] = FORMAT_NAME.encode()
    meta[b"stallwatch.version"] = str(FORMAT_VERSION).encode()
    return table.replace_schema_metadata(meta)


def _stem(path: str, taken: set[str]) -> str:
    """The file's name: ``part-`` and the dump's (engines skip files whose
    names begin with ``_`` or ``.``, as Flight Recorder's ``_dump_3`` does)."""
    base = "part-" + escape(Path(path).name.removesuffix(".msgpack"))
    name, n = base, 1
    while name in taken:
        n += 1
        name = f"{base}-{n}"
    taken.add(name)
    return name


def write_incident(
    root: Path,
    incident: str,
    recordings: Iterable[tuple[str, Recording]],
    known: Ranks | None = None,
) -> Written:
    """Write one incident's recordings (``(source path, recording)``, read
    one at a time) under ``root``, their ranks as ``known`` says (derived
    over the whole incident; by default over each recording alone).
    UsageError if the incident is there."""
    root.mkdir(parents=True, exist_ok=True)
    _check_folder(root)
    part = f"incident={escape(incident)}"
    _refuse_existing(root, incident)
    stage = root / f".staging-{uuid.uuid4().hex}"
    try:
        written = _write_stage(stage, part, incident, recordings, known)
        for t in TABLE_NAMES:
            (root / t).mkdir(exist_ok=True)
            os.rename(stage / t / part, root / t / part)
        _write_meta(root)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return written


def _refuse_existing(root: Path, incident: str) -> None:
    part = f"incident={escape(incident)}"
    if any((root / t / part).exists() for t in TABLE_NAMES):
        raise UsageError(
            f"-o {root}: incident {incident} is already exported there (an incident is "
            "written once, never rewritten; --incident ID names it otherwise)"
        )


def _write_stage(
    stage: Path,
    part: str,
    incident: str,
    recordings: Iterable[tuple[str, Recording]],
    known: Ranks | None,
) -> Written:
    rows: dict[str, int] = defaultdict(int)
    hosts: set[str] = set()
    stems: dict[str, set[str]] = defaultdict(set)
    files = 0
    for path, rec in recordings:
        hosts.add(rec.host)
        stem = _stem(path, stems[rec.host])
        for name, table in tables(rec, known).items():
            folder = stage / name / part / f"host={escape(rec.host)}"
            folder.mkdir(parents=True, exist_ok=True)
            pq.write_table(_file_table(table), folder / f"{stem}.parquet")
            rows[name] += table.num_rows
            files += 1
    for t in TABLE_NAMES:
        (stage / t / part).mkdir(parents=True, exist_ok=True)
    return Written(incident, tuple(sorted(hosts)), files, dict(rows))


def export_id(inc: IncidentInputs) -> str:
    """The incident id an export writes by default: a triggered incident's
    own id; a Flight Recorder folder's name, or ``snapshot``, with a digest
    of the files (two jobs whose folders share a name never collide)."""
    if not inc.flight_recorder and inc.key != SNAPSHOT_KEY:
        return inc.id
    return unique_id(inc.id, [os.path.abspath(p) for p, _ in inc.recordings])


def export_parquet(
    paths: Sequence[str], root: Path, incident: str | None = None
) -> tuple[list[Written], list[InputStatus]]:
    """Every readable input under ``root``, one incident at a time (grouped
    as ``stallwatch analyze`` groups them), each read whole before it is
    written: ranks are derived over all its recordings (a split
    communicator's ranks need every member's).  ``incident``: the id to
    write (one incident only).  Returns what was written and the inputs'
    statuses.  Incidents already there are refused before anything is
    written."""
    planned, statuses = open_incidents(paths, defer=tuple(RING_DTYPES))
    if not planned:
        raise UsageError(_nothing_read(statuses))
    if incident is not None and len(planned) > 1:
        raise UsageError(
            f"--incident {incident}: the inputs hold {len(planned)} incidents "
            f"({', '.join(p.id for p in planned)}); export them one at a time"
        )
    ids = [incident if incident is not None else export_id(p) for p in planned]
    _check_folder(root)
    for i in ids:
        _refuse_existing(root, i)
    out = []
    lost: dict[str, InputStatus] = {}
    for inc, i in zip(planned, ids, strict=True):
        known = ranks_of_dumps(inc.recordings)
        out.append(write_incident(root, i, _read_each(inc, lost), known))
    return out, [lost.get(s.path, s) for s in statuses]


def _nothing_read(statuses: Sequence[InputStatus]) -> str:
    why = "; ".join(s.error or s.path for s in statuses if not s.ok) or "no input"
    return f"no dump could be read ({why})"


def _read_each(
    inc: IncidentInputs, lost: dict[str, InputStatus]
) -> Iterable[tuple[str, Recording]]:
    """The incident's recordings whole, one at a time: our dumps read again
    with their rings (the first pass read their headers).  One that cannot
    be read now (a damaged ring, a file changed since) is left out and
    ``lost`` says why."""
    from stallwatch.dumpers.format import read_dump

    for path, rec in inc.recordings:
        if inc.flight_recorder:
            yield path, rec
            continue
        try:
            whole = read_dump(path)
        except DumpError as exc:
            lost[path] = InputStatus(path, False, str(exc), SourceKind.STALLWATCH)
            continue
        yield path, whole

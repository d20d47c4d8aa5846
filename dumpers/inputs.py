"""The one input opener: paths in, classified files and incidents out.

Every reader (``analyze``, ``query``, ``serve``, ``export``) starts here, so
every command treats a file the same way:

- paths are expanded: a file named is read; a folder is walked recursively in
  name order, hidden files, the agent's logs and its published verdicts
  (``SKIPPED_IN_FOLDERS``) left out; a missing path, or a folder without files, is a lost input;
- each file's first bytes tell its kind: our msgpack dump, or a PyTorch
  Flight Recorder dump (a pickle, or JSON with Flight Recorder's keys);
  a file whose bytes tell neither but whose name does (``*.msgpack``, or the
  name of its folder's Flight Recorder dumps but the rank) is a dump that
  cannot be read; anything else (a README, a scenario's ``expected.json``)
  is *foreign*: named and ignored, never a lost input;
- a file of a known kind that cannot be read (truncated, corrupt) is a lost
  input: skipped with a one-line note, the others read (exit 1 when any is
  lost, 2 when nothing could be read);
- inputs are grouped into incidents: our dumps by their trigger's incident
  id (dumps without one, or of agents that named one stall twice, see
  ``group_dumps``), Flight Recorder files by their folder.

Flight Recorder files are only recognised here; reading them is the
analyzer's (``analyzer.load``), which turns them into recordings too.
"""

from __future__ import annotations

import enum
import hashlib
import os
import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from .errors import DumpError
from .format import DeferredRing, read_dump_deferred
from .model import CHECKSUMS_SINCE, Recording

T = TypeVar("T")

# the agent's logs, its published verdicts (recorder.verdicts) and files being written
SKIPPED_IN_FOLDERS = (".log", ".txt", ".md", ".verdict.json", ".json.tmp", ".tmp")
HEAD_BYTES = 16  # enough to tell a pickle or one of our dumps
JSON_HEAD_BYTES = 1 << 16  # of a JSON file, searched for Flight Recorder's keys
# top-level keys of a Flight Recorder JSON dump (torch writes some of them first)
FR_JSON_KEYS = (b'"entries"', b'"pg_config"', b'"pg_status"', b'"comm_lib_version"',
                b'"nccl_version"', b'"nccl_comm_state"')  # fmt: skip
SNAPSHOT_KEY = "snapshot"  # the incident of dumps no trigger named


class SourceKind(enum.Enum):
    STALLWATCH = "stallwatch"
    FLIGHT_RECORDER = "flight_recorder"
    FOREIGN = "foreign"  # not a dump: named and ignored


@dataclass(frozen=True, slots=True)
class InputStatus:
    """What became of one input file: read (``ok``), ignored (foreign), or
    lost (``error`` says why)."""

    path: str
    ok: bool
    error: str | None = None
    kind: SourceKind | None = None
    # read, but written before checksums (format version 6): damage in it
    # cannot be told
    unchecked: bool = False

    @property
    def ignored(self) -> bool:
        return self.kind is SourceKind.FOREIGN

    @property
    def lost(self) -> bool:
        return not self.ok and not self.ignored

    @property
    def note(self) -> str:
        """The one line a command prints about an input not read."""
        return f"ignored {self.error}" if self.ignored else f"skipped {self.error or self.path}"


UNCHECKED_SHOWN = 3  # paths named in the note on dumps read unchecked


def input_notes(statuses: Sequence[InputStatus]) -> list[str]:
    """What a command says about its inputs, one line each: every input not
    read, and one line for the dumps read without checksums."""
    out = [s.note for s in statuses if not s.ok]
    old = [s.path for s in statuses if s.ok and s.unchecked]
    if old:
        more = len(old) - UNCHECKED_SHOWN
        shown = ", ".join(old[:UNCHECKED_SHOWN]) + (f" and {more} more" if more > 0 else "")
        read = sum(1 for s in statuses if s.ok and s.kind is SourceKind.STALLWATCH)
        out.append(
            f"note: {len(old)} of {read} dumps were written before checksums (format version "
            f"{CHECKSUMS_SINCE}): damage in them cannot be told ({shown})"
        )
    return out


def read_status(path: str, rec: Recording) -> InputStatus:
    """The status of one of our dumps, read."""
    return InputStatus(path, True, None, SourceKind.STALLWATCH, unchecked=not rec.checked)


def looks_like_dump(head: bytes) -> bool:
    """Our msgpack dump: a map whose first key is ``format``."""
    return (
        len(head) > 8
        and (0x80 <= head[0] <= 0x8F or head[0] in (0xDE, 0xDF))
        and (b"\xa6format" in head[:HEAD_BYTES])
    )


def looks_like_flightrec(head: bytes) -> bool:
    """A pickle (msgpack's 0x80 is an empty map: never a dump), or JSON
    holding one of Flight Recorder's top-level keys."""
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return True
    return head.lstrip()[:1] == b"{" and any(k in head for k in FR_JSON_KEYS)


def head_of(path: str) -> bytes | None:
    """The first bytes, which tell the kind of file (a JSON file's first
    64 KiB); None if unreadable."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEAD_BYTES)
            if head.lstrip()[:1] == b"{":
                head += f.read(JSON_HEAD_BYTES)
            return head
    except OSError:
        return None


def kind_of(head: bytes | None) -> SourceKind | None:
    """The kind a file's first bytes tell; None for an unreadable file."""
    if head is None:
        return None
    if looks_like_flightrec(head):
        return SourceKind.FLIGHT_RECORDER
    return SourceKind.STALLWATCH if looks_like_dump(head) else SourceKind.FOREIGN


def _wanted(f: Path) -> bool:
    """In a folder: dumps and Flight Recorder files, not the agent's logs."""
    return f.is_file() and not f.name.startswith(".") and not f.name.endswith(SKIPPED_IN_FOLDERS)


def expand(paths: Sequence[str]) -> tuple[list[str], list[InputStatus]]:
    """Files named, and files under folders named; missing paths reported."""
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


@dataclass(frozen=True, slots=True)
class Classified:
    """The files of some paths by kind, in the order found; ``statuses``
    holds the paths lost (missing, unreadable) and the files ignored."""

    dumps: tuple[str, ...]
    flight: tuple[str, ...]
    statuses: tuple[InputStatus, ...]
    heads: dict[str, bytes]


_RANK_AT_END = re.compile(r"\d+(?:\.json|\.pkl|\.pickle)?$")
DUMP_SUFFIX = ".msgpack"


def _fr_name(path: str) -> tuple[str, str] | None:
    """(folder, name without its rank) of a file named as torch names Flight
    Recorder dumps (``..._<rank>``); None for other names."""
    name = Path(path).name
    m = _RANK_AT_END.search(name)
    return (flight_folder(path), name[: m.start()]) if m else None


def classify(paths: Sequence[str]) -> Classified:
    files, statuses = expand(paths)
    kinds: dict[str, SourceKind] = {}
    heads: dict[str, bytes] = {}
    for f in files:
        head = head_of(f)
        if head is None:
            statuses.append(InputStatus(f, False, f"{f}: cannot read the file"))
            continue
        heads[f] = head
        kinds[f] = kind_of(head) or SourceKind.FOREIGN
    # a rank's dump that is garbage is a lost dump, not a foreign file
    fr_names = {_fr_name(f) for f, k in kinds.items() if k is SourceKind.FLIGHT_RECORDER}
    for f, k in kinds.items():
        if k is SourceKind.FOREIGN and f.endswith(DUMP_SUFFIX):
            kinds[f] = SourceKind.STALLWATCH
        elif k is SourceKind.FOREIGN and _fr_name(f) in fr_names - {None}:
            kinds[f] = SourceKind.FLIGHT_RECORDER
    for f, k in kinds.items():
        if k is SourceKind.FOREIGN:
            why = f"{f}: not a stallwatch or Flight Recorder dump"
            statuses.append(InputStatus(f, False, why, SourceKind.FOREIGN))
    dumps = tuple(f for f, k in kinds.items() if k is SourceKind.STALLWATCH)
    flight = tuple(f for f, k in kinds.items() if k is SourceKind.FLIGHT_RECORDER)
    return Classified(dumps, flight, tuple(statuses), heads)


def read_dump_input(
    path: str, defer: Collection[str] = ()
) -> tuple[Recording, dict[str, DeferredRing]] | InputStatus:
    """One of our dumps (the rings named in ``defer`` left in the file), or
    the status saying why it is lost."""
    try:
        return read_dump_deferred(path, defer)
    except DumpError as exc:
        return InputStatus(path, False, str(exc), SourceKind.STALLWATCH)


# ---- incidents ----------------------------------------------------------------


def incident_key(rec: Recording) -> str:
    """The incident a dump belongs to: its trigger's id, else ``snapshot``."""
    trig = rec.trigger
    return trig.incident_id if trig is not None and trig.incident_id else SNAPSHOT_KEY


def flight_folder(path: str) -> str:
    """The incident a Flight Recorder file belongs to: its folder (resolved,
    so ``.`` has a name and two folders of one name stay apart)."""
    return str(Path(os.path.abspath(path)).parent)


def flight_incident_id(folder: str) -> str:
    """The incident id shown for a Flight Recorder folder: its name."""
    return Path(folder).name or folder


def unique_id(key: str, members: Sequence[str]) -> str:
    """An incident id that names the key and, for keys not unique by
    themselves (a Flight Recorder folder's name, ``snapshot``), a digest of
    what it holds: two jobs never share it."""
    digest = hashlib.blake2b("\0".join(sorted(members)).encode(), digest_size=4).hexdigest()
    return f"{key}-{digest}"


def group_dumps(
    items: Sequence[T], key: Callable[[T], str], host: Callable[[T], str]
) -> dict[str, list[T]]:
    """Our dumps by incident key.  Agents that detected one stall apart may
    name it twice; when no host has dumps in two incidents, the dumps are one
    job's: one incident, named by the keys joined with ``+``."""
    groups: dict[str, list[T]] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    if len(groups) < 2:
        return groups
    hosts = [host(s) for v in groups.values() for s in v]
    if len(hosts) != len(set(hosts)):
        return dict(sorted(groups.items()))
    return {"+".join(sorted(groups)): [s for k in sorted(groups) for s in groups[k]]}


def group_flight(paths: Sequence[str]) -> dict[str, list[str]]:
    """Flight Recorder files by folder (see ``flight_folder``)."""
    out: dict[str, list[str]] = {}
    for p in paths:
        out.setdefault(flight_folder(p), []).append(p)
    return dict(sorted(out.items()))


def sorted_statuses(statuses: Sequence[InputStatus]) -> list[InputStatus]:
    return sorted(statuses, key=lambda s: os.fspath(s.path))


__all__ = [
    "SKIPPED_IN_FOLDERS",
    "Classified",
    "InputStatus",
    "SourceKind",
    "classify",
    "expand",
    "flight_folder",
    "flight_incident_id",
    "group_dumps",
    "group_flight",
    "head_of",
    "incident_key",
    "input_notes",
    "kind_of",
    "looks_like_dump",
    "looks_like_flightrec",
    "read_dump_input",
    "read_status",
    "unique_id",
]

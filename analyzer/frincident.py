"""Flight Recorder dumps of one folder as one incident, and as recordings.

A process group (its ``process_group`` name) is a communicator.  Its members
come from ``pg_config`` when a dump names the group there with ranks; torch
2.13's gloo writes every group under the empty name (the last one created
wins) and ``'[]'`` for later groups, so otherwise: the default group
(``default_pg``) holds every rank of the job (ranks 0 .. the highest rank a
file of the folder names, unreadable files included), any other group the
ranks whose dumps hold its entries (a note says so).  A file that could not
be read still names its rank: that member has no dump.

``pg_status`` progress counters (per ``pg_id``, which is each rank's own
count of its groups: the same number names different groups on different
ranks) are mapped to a group through the rank's own file only: its entries,
else its pg_config (its groups in the order it made them), never another
rank's pg_ids.  Their unit is the backend's:
gloo counts every op (``op_id``, send and recv included, which gloo never
records), translated through the rank's entries; NCCL counts collectives and
p2p ops apart in one counter, so groups with p2p ops are left out.

Completion: NCCL's is the device's (a CUDA event).  gloo ends a work that
failed on a peer's death as it ends one that succeeded: a rank's entry
counts as completed only when the rank went on to a later call, and gloo's
completion counters are not used.

Several recorders: a communicator is a process group and the backend that
recorded its calls (a "cpu:gloo,cuda:nccl2" group is two, labelled
"0 (gloo)" and "0 (nccl2)" where a folder holds both).  After torch 2.15 a
rank dumps each backend's recorder into a file of its own: a rank's files
are one rank, and a rank whose file of a backend is missing has no dump of
that backend's communicators.  Two files of one rank holding the same
communicator: the one whose entries of it end later is read.

Known limits: times are wall clock of each rank's host, compared only within
one rank; a group no dump holds an entry of is not seen; a member of a
subgroup that recorded nothing in it is not known to be one.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from stallwatch.dumpers.errors import DumpError
from stallwatch.dumpers.inputs import (
    InputStatus,
    SourceKind,
    flight_folder,
    flight_incident_id,
    group_flight,
)
from stallwatch.dumpers.model import Clock, CommInfo, ProcessInfo, Recording, Ring
from stallwatch.dumpers.schema import DATATYPE_SIZE, NCCL_EVENT, EventKind, Op, State, op_name

from .columns import Columns
from .flightrec import FrDump, is_hooked, rank_in_name, read_flightrec, stack_of
from .incident import (
    CALL_DTYPE,
    SCHED_DTYPE,
    TCP_DTYPE,
    Calls,
    Comm,
    Incident,
    Proc,
)
from .plausible import fr_damage
from .verdict import Verdict

DEFAULT_PG = "default_pg"


def comm_hash(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"pg:{name}".encode(), digest_size=8).digest(), "little")


def incidents_from_flightrec(dumps: list[FrDump], lost: Sequence[str] = ()) -> list[Incident]:
    """One incident per folder; ``lost``: input files that could not be read
    (those in a folder of dumps name a rank without a dump)."""
    groups: dict[str, list[FrDump]] = defaultdict(list)
    for d in dumps:
        groups[flight_folder(d.path)].append(d)
    gone = group_flight(lost)
    return [
        _incident(k, sorted(v, key=lambda d: (d.rank, d.path)), gone.get(k, []))
        for k, v in sorted(groups.items())
    ]


def _incident(folder: str, dumps: list[FrDump], lost: list[str]) -> Incident:
    have = {d.rank for d in dumps}
    lost_ranks = {r for p in lost if (r := rank_in_name(p)) is not None} - have
    labels = _labels(dumps)
    kept, notes = _kept(dumps, labels)
    members, more = _memberships(dumps, labels, lost_ranks)
    notes += more
    ranks = sorted(have)
    by_rank = {r: i for i, r in enumerate(ranks)}
    files: dict[int, list[FrDump]] = defaultdict(list)
    for d in dumps:
        files[d.rank].append(d)
    procs = tuple(_proc(r, files[r]) for r in ranks)
    hashes = _hashes(dumps, labels, members)
    names = sorted(members, key=lambda n: (hashes[n], n))
    by_label = _label_keys(labels)
    descs = {lab: _desc(dumps, name) for lab, (name, _) in by_label.items()}
    recorded = _recorders(files)
    comms = tuple(
        Comm(
            hashes[n],
            tuple(
                by_rank[r] if r in by_rank and recorded(r, by_label.get(n, (n, ""))[1]) else -1
                for r in members[n]
            ),
            n,
            desc=descs.get(n, ""),
            world_ranks=members[n],
        )
        for n in names
    )
    index = {n: i for i, n in enumerate(names)}
    shapes: dict[str, int] = {"": 0}
    # straight into columns, each dump's slice in turn: no records to join
    rows = Columns.zeros(CALL_DTYPE, sum(int(k.sum()) for k in kept))
    at = 0
    for d, keep in zip(dumps, kept, strict=True):
        n = int(keep.sum())
        _rows(rows[at : at + n], by_rank[d.rank], d, keep, labels, members, index, shapes)
        at += n
    return Incident(
        id=flight_incident_id(folder),
        hosts=tuple(p.host for p in procs),
        host_now=tuple(None for _ in procs),
        procs=procs,
        comms=comms,
        calls=Calls(rows),
        tcp=np.zeros(0, dtype=TCP_DTYPE),
        sched=np.zeros(0, dtype=SCHED_DTYPE),
        sources=tuple(d.path for d in dumps),
        progress=_progress(dumps, labels, members, index),
        notes=tuple(n for d in dumps for n in d.notes) + tuple(notes),
        shapes=tuple(shapes),
        # a collective completes on all its members, so completions compare
        # across ranks wherever an ended call is a finished one: every
        # backend but gloo (which ends a failed call as a finished one)
        device_completion=not any("gloo" in d.pg_backends for d in dumps)
        and any(len(d.entries) for d in dumps),
        ends_are_completions=True,
        kind=SourceKind.FLIGHT_RECORDER,
        wall_ns=int(rows["ts"].max()) if len(rows) else None,  # the latest entry
    )


def _proc(rank: int, files: list[FrDump]) -> Proc:
    """A rank, from its files; what a file stallwatch wrote says beyond torch's
    format (its pid, how it ended) from that file's own section."""
    origin = next((d.origin for d in files if d.origin is not None), None)
    return Proc(
        ", ".join(Path(d.path).name for d in files),
        (origin.pid or 0) if origin else 0,
        rank,
        files[0].path,
        exit_code=origin.exit_code if origin else None,
        exit_signal=origin.exit_signal if origin else None,
        window_complete=not any(d.wrapped for d in files),
        from_file=True,
        exit_wall_ns=origin.exit_wall_ns if origin else None,
    )


Labels = dict[tuple[str, str], str]  # (group name, backend) -> communicator label


def _labels(dumps: list[FrDump]) -> Labels:
    """Each (group, backend) of the folder's entries as a communicator: the
    group's name, or "name (backend)" where the folder holds the group under
    more than one backend (each recorder sequences its calls on its own)."""
    keys = {k for d in dumps for k in zip(d.pg_names, _backends(d), strict=True)}
    count: dict[str, int] = defaultdict(int)
    for name, _ in keys:
        count[name] += 1
    return {(n, b): (f"{n} ({b or 'unnamed'})" if count[n] > 1 else n) for n, b in keys}


def _hashes(
    dumps: list[FrDump], labels: Labels, members: dict[str, tuple[int, ...]]
) -> dict[str, int]:
    """Each communicator's id: the hash of its label, or, in files stallwatch
    wrote, the id of the communicator it was recorded as (the same on every
    file: a file that disagrees is not followed)."""
    ours: dict[str, set[int]] = defaultdict(set)
    for d in dumps:
        if d.origin is not None:
            for name, h in d.origin.comms.items():
                ours[name].add(h)
    by_label = _label_keys(labels)
    out = {}
    for lab in members:
        name = by_label[lab][0] if lab in by_label else lab
        given = ours.get(name, set())
        out[lab] = next(iter(given)) if len(given) == 1 and lab == name else comm_hash(lab)
    return out


def _recorders(files: dict[int, list[FrDump]]) -> Callable[[int, str], bool]:
    """Whether a rank's files hold the recorder of a backend: one that
    recorded it, or one that recorded nothing (whose it is, is unknown).  A
    rank whose other backends' files are there but not this one's has no
    dump of its communicators (torch after 2.15 dumps each backend's recorder
    on its own; a rank stuck in teardown may leave some and not others)."""
    seen = {r: {b for d in ds for b in d.pg_backends} for r, ds in files.items()}
    empty = {r for r, ds in files.items() if any(not len(d.entries) for d in ds)}

    def recorded(rank: int, backend: str) -> bool:
        return rank in empty or backend in seen.get(rank, ())

    return recorded


def _label_keys(labels: Labels) -> dict[str, tuple[str, str]]:
    return {lab: key for key, lab in labels.items()}


def _backends(d: FrDump) -> tuple[str, ...]:
    return d.pg_backends or (d.backend,) * len(d.pg_names)


def _dump_labels(d: FrDump, labels: Labels) -> list[str]:
    return [labels[k] for k in zip(d.pg_names, _backends(d), strict=True)]


def _desc(dumps: list[FrDump], name: str) -> str:
    return next((d.pg_desc[name] for d in dumps if d.pg_desc.get(name)), "")


def _kept(dumps: list[FrDump], labels: Labels) -> tuple[list[np.ndarray], list[str]]:
    """Per dump, which of its entries are read.  A rank may leave several
    files (one per backend's recorder: torch after 2.15); when two of them
    hold the same communicator (a recorder dumped twice), the one whose
    entries of it end later is read and the other's are left out."""
    latest: dict[tuple[int, str], tuple[int, int]] = {}  # (rank, label) -> (latest ts, dump)
    for i, d in enumerate(dumps):
        for pg, lab in enumerate(_dump_labels(d, labels)):
            mine = d.entries["created"][d.entries["pg"] == pg]
            last = int(mine.max()) if len(mine) else -1
            cur = latest.get((d.rank, lab))
            if cur is None or last > cur[0]:
                latest[(d.rank, lab)] = (last, i)
    kept, notes = [], []
    for i, d in enumerate(dumps):
        drop = [
            pg for pg, lab in enumerate(_dump_labels(d, labels)) if latest[(d.rank, lab)][1] != i
        ]
        keep = ~np.isin(d.entries["pg"], drop)
        if drop:
            other = Path(dumps[latest[(d.rank, _dump_labels(d, labels)[drop[0]])][1]].path).name
            notes.append(
                f"{Path(d.path).name}: rank {d.rank}'s calls on "
                + ", ".join(repr(_dump_labels(d, labels)[pg]) for pg in drop)
                + f" are read from {other}, which holds later ones"
            )
        kept.append(keep)
    return kept, notes


def _memberships(
    dumps: list[FrDump], labels: Labels, lost_ranks: set[int]
) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    """Communicator label -> world ranks in comm-rank order, and notes on
    communicators whose members had to be inferred.  A group's pg_config
    ranks hold for each backend serving it."""
    held: dict[str, set[int]] = defaultdict(set)
    configured: dict[str, tuple[int, ...]] = {}
    desc: dict[str, str] = {}
    for d in dumps:
        for lab in _dump_labels(d, labels):
            held[lab].add(d.rank)
        for n, r in d.pg_ranks.items():
            configured.setdefault(n, r)
        for n, t in d.pg_desc.items():
            desc.setdefault(n, t)
    world = 1 + max([d.rank for d in dumps] + list(lost_ranks))
    out: dict[str, tuple[int, ...]] = {}
    inferred: list[str] = []
    by_label = _label_keys(labels)
    for lab in sorted(set(held) | (set(configured) - {n for n, _ in labels})):
        name = by_label[lab][0] if lab in by_label else lab
        if name in configured:
            extra = sorted(held[lab] - set(configured[name]))
            out[lab] = configured[name] + tuple(extra)  # a dump holding its entries is a member
        elif desc.get(name) == DEFAULT_PG:
            out[lab] = tuple(range(max(world, max(held[lab]) + 1)))
        else:
            out[lab] = tuple(sorted(held[lab]))
            inferred.append(lab)
    notes = []
    if inferred:
        notes.append(
            "no readable pg_config for group(s) "
            + ", ".join(repr(n) for n in inferred[:8])
            + (" ..." if len(inferred) > 8 else "")
            + ": members are the ranks whose dumps hold their entries"
        )
    return out, notes


def _rows(
    out: Columns,
    p: int,
    d: FrDump,
    keep: np.ndarray,
    labels: Labels,
    members: dict[str, tuple[int, ...]],
    index: dict[str, int],
    shapes: dict[str, int],
) -> None:
    """One dump's entries (those ``keep`` says) as calls, written into
    ``out`` (views of its slice of the incident's columns, zeroed)."""
    e = d.entries if keep.all() else d.entries[keep]
    if not len(e):
        return
    labs = _dump_labels(d, labels)
    comm = np.array([index[lab] for lab in labs], dtype=np.int64)
    crank = np.array([members[lab].index(d.rank) for lab in labs], dtype=np.int64)
    shape = np.array([shapes.setdefault(s, len(shapes)) for s in d.shapes], dtype=np.int64)
    pg = e["pg"]
    out["comm"][:], out["crank"][:], out["proc"][:] = comm[pg], crank[pg], p
    out["seq"][:], out["ts"][:] = e["seq"], e["created"]
    # an entry that ended without a completion time (gloo) ended when it began,
    # as far as anyone can tell
    done = np.where(e["completed"] > 0, e["completed"], np.maximum(e["created"], 1))
    ended = e["ended"]
    gloo_last = _backends(d)[int(pg[-1])] == "gloo"
    if gloo_last:
        # gloo retires a work that failed as one that succeeded: only a rank
        # that went on to a later call shows its call succeeded; its last
        # call's outcome is unknown, and counts as pending
        returned = bool(ended[-1])
        ended = ended.copy()
        ended[-1] = False
    out["end"][:] = np.where(ended, done, 0)
    out["result"][:] = np.where(ended, 0, -1)
    if d.origin is not None and d.origin.errors:
        _failed(out, e, d.pg_names, d.origin.errors)
    out["count"][:], out["root"][:], out["op"][:] = e["count"], e["peer"], e["op"]
    out["datatype"][:], out["state"][:] = e["datatype"], e["state"]
    if gloo_last and returned:
        out["state"][-1] = State.ENQUEUED  # it returned (retired); how is unknown
    out["shape"][:] = np.minimum(shape[e["shape"]], np.iinfo(np.uint16).max)


def _failed(
    out: Columns,
    e: np.ndarray,
    names: tuple[str, ...],
    errors: Sequence[tuple[str, int, bool, int, int]],
) -> None:
    """Calls that returned an error, as a file stallwatch wrote lists them
    (Flight Recorder has no field for a result): returned, with its code."""
    for name, seq, p2p, result, end in errors:
        groups = [pg for pg, n in enumerate(names) if n == name]
        hit = np.isin(e["pg"], groups) & (e["seq"] == seq) & (e["is_p2p"] == p2p)
        out["result"][hit] = result
        out["end"][hit] = end


def _pg_labels(dumps: list[FrDump], labels: Labels) -> tuple[list[dict[int, str | None]], set[str]]:
    """Per dump, pg_id -> the communicator it names on that rank (None where
    its own entries name several: recorders of two backends in one file
    number their groups each from 0), and the communicators with p2p
    entries.  A pg_id is the rank's own count of its groups: the same number
    names other groups on other ranks, so only the rank's own file says
    which group it is (``_pg_ids_of``)."""
    own: list[dict[int, str | None]] = []
    p2p: set[str] = set()
    for d in dumps:
        e = d.entries
        labs = _dump_labels(d, labels)
        mine: dict[int, str | None] = {}
        if len(e):
            key = e["pg"].astype(np.int64) * 2 + e["is_p2p"]  # (group, p2p): no structured sort
            for k in np.unique(key).tolist():
                pg, is_p2p = divmod(k, 2)
                for pg_id in np.unique(e["pg_id"][key == k]).tolist():
                    seen = mine.get(int(pg_id), labs[pg])
                    mine[int(pg_id)] = labs[pg] if seen == labs[pg] else None
                if is_p2p:
                    p2p.add(labs[pg])
        for pg_id, name in _pg_ids_of(d, mine).items():
            mine.setdefault(pg_id, _label_of(labels, name, d))
        own.append(mine)
    return own, p2p


def _pg_ids_of(d: FrDump, named: dict[int, str | None]) -> dict[int, str]:
    """pg_id -> group name, from the rank's own file where its entries do
    not say: torch numbers a rank's groups (pg_id) in the order the rank
    created them and names groups by a counter in creation order, so where
    its pg_status holds as many groups as its pg_config holds groups it is
    a member of, all named by numbers, the two orders pair them up; read
    only when every pg_id its entries name agrees with that pairing."""
    mine = [n for n, ranks in d.pg_ranks.items() if d.rank in ranks]
    if not mine or len(mine) != len(d.pg_status) or not all(n.isdigit() for n in mine):
        return {}
    pairs = dict(zip(sorted(d.pg_status), sorted(mine, key=int), strict=True))
    if any(
        name is not None and pairs.get(pg_id) != _name_of(name) for pg_id, name in named.items()
    ):
        return {}
    return pairs


def _name_of(label: str) -> str:
    return _split_label(label)[0]


def _label_of(labels: Labels, name: str, d: FrDump) -> str | None:
    """The communicator of a group name in a dump of its backend (any, for
    a dump without entries), if one."""
    backends = set(_backends(d))
    found = {lab for (n, b), lab in labels.items() if n == name and (not backends or b in backends)}
    return found.pop() if len(found) == 1 else None


def _progress(
    dumps: list[FrDump], labels: Labels, members: dict[str, tuple[int, ...]], index: dict[str, int]
) -> tuple[tuple[int, int, int, int], ...]:
    """(comm, comm rank, last seq entered, last seq completed) from pg_status,
    in the unit of the backend that wrote it: NCCL counts collectives (and p2p
    ops apart, in the same counter: groups with p2p ops are left out), gloo
    counts ops (translated through the rank's entries, and its completions
    may be failures), and the hook's counters changed units between torch
    versions (op ids, then seqs): they are not used, nor are a file's that
    holds two backends' recorders."""
    own, p2p = _pg_labels(dumps, labels)
    by_label = _label_keys(labels)
    out = []
    for d, mine in zip(dumps, own, strict=True):
        if len(set(_backends(d))) > 1:
            continue  # recorders of two backends in one file: whose counter is whose?
        for pg_id, (enq, done) in d.pg_status.items():
            lab = mine.get(pg_id)
            if lab is None or lab not in members or d.rank not in members[lab]:
                continue
            backend = by_label[lab][1]
            if is_hooked(backend) or (d.backend and backend != d.backend):
                continue
            if backend == "gloo":  # its completions may be failures: entries tell
                enq, done = _seq_of_op(d, lab, labels, enq), -1
            elif lab in p2p:
                continue
            if enq >= 0:
                out.append((index[lab], members[lab].index(d.rank), enq, done))
    return tuple(sorted(out))


def _seq_of_op(d: FrDump, label: str, labels: Labels, op_id: int) -> int:
    """The collective seq of a group's op counter on this rank: the latest
    entry at or before that op (-1 if its ring holds none)."""
    e = d.entries
    labs = _dump_labels(d, labels)
    if label not in labs:
        return -1
    mine = e[(e["pg"] == labs.index(label)) & ~e["is_p2p"] & (e["op_id"] <= op_id)]
    return int(mine["seq"].max()) if len(mine) else -1


MAX_STACKS = 4  # culprits of a verdict whose stacks are read
STACK_FRAMES = 8  # frames of a stack shown


def with_stacks(inc: Incident, verdicts: Sequence[Verdict]) -> list[Verdict]:
    """Each verdict with, as evidence, the Python stack torch recorded for
    its culprits' cited call (the call at the verdict's seq, else their
    last), read from their files now: frames are read only for the ranks a
    verdict names."""
    out = []
    for v in verdicts:
        ranks = [r for r in v.ranks if r is not None][:MAX_STACKS]
        lines = [line for r in ranks if (line := _stack_line(inc, v, r))]
        out.append(dataclasses.replace(v, evidence=v.evidence + tuple(lines)) if lines else v)
    return out


def _stack_line(inc: Incident, v: Verdict, rank: int) -> str | None:
    p = next((i for i, pr in enumerate(inc.procs) if pr.world_rank == rank), None)
    rows = inc.calls.rows
    mine = np.flatnonzero(rows["proc"] == p) if p is not None else np.zeros(0, dtype=np.int64)
    if p is None or not len(mine):
        return None
    hashes = np.array([inc.comms[c].hash_text == v.comm_id_hash for c in range(len(inc.comms))])
    cited = mine[
        hashes[rows["comm"][mine]] & (rows["seq"][mine] == (v.seq if v.seq is not None else -1))
    ]
    i = int(cited[0]) if len(cited) else int(mine[np.argmax(rows["ts"][mine])])
    comm = inc.comms[int(rows["comm"][i])]
    name, backend = _split_label(comm.label)
    seq, op = int(rows["seq"][i]), int(rows["op"][i])
    files = [s for s in inc.sources if rank_in_name(s) == rank]
    for f in files:
        frames = stack_of(f, name, backend, seq, op in (Op.SEND, Op.RECV))
        if frames:
            shown = " < ".join(
                f"{fn} ({Path(file).name}:{line})" for fn, file, line in frames[:STACK_FRAMES]
            )
            more = f" < ... {len(frames) - STACK_FRAMES} more" if len(frames) > STACK_FRAMES else ""
            return (
                f"{inc.procs[p].label()}: its {op_name(op)} seq {seq} on {comm.group} was "
                f"called from {shown}{more} (its file's stack, innermost first)"
            )
    return None


def _split_label(label: str) -> tuple[str, str | None]:
    """A communicator's group name and backend ("0 (nccl2)"), None where the
    label names no backend (a group served by one)."""
    if label.endswith(")") and " (" in label:
        name, backend = label[:-1].rsplit(" (", 1)
        return name, backend
    return label, None


def flight_recordings(
    paths: Sequence[str],
) -> tuple[list[tuple[str, Recording]], list[InputStatus]]:
    """Flight Recorder files as recordings (``recordings_of`` of the
    incidents they form), each with its file, and every file's status."""
    dumps: list[FrDump] = []
    statuses: list[InputStatus] = []
    lost: list[str] = []
    for p in paths:
        try:
            d = read_flightrec(p)
        except DumpError as exc:
            statuses.append(InputStatus(p, False, str(exc), SourceKind.FLIGHT_RECORDER))
            lost.append(p)
            continue
        damaged = fr_damage(d)
        if damaged is not None:  # lost, as one that cannot be read (analyzer.plausible)
            statuses.append(InputStatus(p, False, damaged, SourceKind.FLIGHT_RECORDER))
            lost.append(p)
            continue
        dumps.append(d)
        statuses.append(InputStatus(p, True, None, SourceKind.FLIGHT_RECORDER))
    recs = [
        (rec.processes[0].cmdline, rec)
        for inc in incidents_from_flightrec(dumps, lost)
        for rec in recordings_of(inc)
    ]
    return recs, statuses


def recordings_of(inc: Incident) -> list[Recording]:
    """A Flight Recorder incident as one recording per rank, for SQL and
    traces: host is the dump's file name, the pid unknown (0, NULL in the
    tables), the world rank the dump's own; it holds every group the rank
    is a member of (those it recorded nothing in too).  Times are the rank's
    wall clock; the recording's time is its latest entry's (what calls in
    flight are timed up to: the dumps carry no dump time)."""
    rows = inc.calls.rows
    out = []
    for p, proc in enumerate(inc.procs):
        mine = rows[rows["proc"] == p]
        comms = tuple(
            CommInfo(0, 0, c.comm_hash, c.members.index(p), c.nranks)
            for c in inc.comms
            if p in c.members
        )
        latest = int(max(mine["ts"].max(), mine["end"].max())) if len(mine) else 0
        out.append(
            Recording(
                host=proc.host,
                boot_id="",
                clock=Clock(latest, latest),  # rows are wall clock already
                processes=(ProcessInfo(0, "", proc.source, 0, 0, (), world_rank=proc.world_rank),),
                communicators=comms,
                rings={"nccl": Ring(_nccl_events(inc, mine))},
            )
        )
    return out


def _nccl_events(inc: Incident, mine: Columns) -> np.ndarray:
    ev = np.zeros(len(mine), dtype=NCCL_EVENT)
    hashes = np.array([c.comm_hash for c in inc.comms], dtype=np.uint64)
    nranks = np.array([c.nranks for c in inc.comms], dtype=np.int32)
    size = np.zeros(256, dtype=np.uint64)
    for dtype, n in DATATYPE_SIZE.items():
        size[dtype] = n
    ev["kind"], ev["size"] = EventKind.NCCL, NCCL_EVENT.itemsize
    ev["ts_ns"], ev["end_ns"], ev["seq"] = mine["ts"], mine["end"], mine["seq"]
    ev["comm_hash"], ev["nranks"] = hashes[mine["comm"]], nranks[mine["comm"]]
    ev["rank"], ev["peer"], ev["result"] = mine["crank"], mine["root"], mine["result"]
    ev["count"], ev["op"], ev["datatype"] = mine["count"], mine["op"], mine["datatype"]
    ev["bytes"] = mine["count"] * size[mine["datatype"]]
    ev["state"] = mine["state"]
    order = np.argsort(ev["ts_ns"], kind="stable")
    return ev[order]

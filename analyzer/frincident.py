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
ranks) are mapped to a group through the rank's own entries, else through the
``pg_id`` its group mates use for the group.  Their unit is the backend's:
gloo counts every op (``op_id``, send and recv included, which gloo never
records), translated through the rank's entries; NCCL counts collectives and
p2p ops apart in one counter, so groups with p2p ops are left out.

Completion: NCCL's is the device's (a CUDA event).  gloo ends a work that
failed on a peer's death as it ends one that succeeded: a rank's entry
counts as completed only when the rank went on to a later call, and gloo's
completion counters are not used.

Known limits: times are wall clock of each rank's host, compared only within
one rank; a group no dump holds an entry of is not seen; a member of a
subgroup that recorded nothing in it is not known to be one.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Sequence
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
from stallwatch.dumpers.schema import DATATYPE_SIZE, NCCL_EVENT, EventKind, State

from .columns import Columns
from .flightrec import FrDump, rank_in_name, read_flightrec
from .incident import (
    CALL_DTYPE,
    SCHED_DTYPE,
    TCP_RETRANS_DTYPE,
    Calls,
    Comm,
    Incident,
    Proc,
)
from .plausible import fr_damage

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
    members, notes = _memberships(dumps, lost_ranks)
    procs = tuple(
        Proc(Path(d.path).name, 0, d.rank, d.path, window_complete=not d.wrapped, from_file=True)
        for d in dumps
    )
    by_rank = {d.rank: i for i, d in enumerate(dumps)}
    names = sorted(members, key=lambda n: (comm_hash(n), n))
    comms = tuple(
        Comm(
            comm_hash(n),
            tuple(by_rank.get(r, -1) for r in members[n]),
            n,
            desc=next((d.pg_desc[n] for d in dumps if d.pg_desc.get(n)), ""),
            world_ranks=members[n],
        )
        for n in names
    )
    index = {n: i for i, n in enumerate(names)}
    shapes: dict[str, int] = {"": 0}
    # straight into columns, each dump's slice in turn: no records to join
    rows = Columns.zeros(CALL_DTYPE, sum(len(d.entries) for d in dumps))
    at = 0
    for p, d in enumerate(dumps):
        _rows(rows[at : at + len(d.entries)], p, d, members, index, shapes)
        at += len(d.entries)
    return Incident(
        id=flight_incident_id(folder),
        hosts=tuple(p.host for p in procs),
        host_now=tuple(None for _ in procs),
        procs=procs,
        comms=comms,
        calls=Calls(rows),
        retransmits=np.zeros(0, dtype=TCP_RETRANS_DTYPE),
        sched=np.zeros(0, dtype=SCHED_DTYPE),
        sources=tuple(d.path for d in dumps),
        progress=_progress(dumps, members, index),
        notes=tuple(n for d in dumps for n in d.notes) + tuple(notes),
        shapes=tuple(shapes),
        device_completion=any(d.backend not in ("", "gloo") for d in dumps),
        ends_are_completions=True,
        kind=SourceKind.FLIGHT_RECORDER,
        wall_ns=int(rows["ts"].max()) if len(rows) else None,  # the latest entry
    )


def _memberships(
    dumps: list[FrDump], lost_ranks: set[int]
) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    """Group name -> world ranks in comm-rank order, and notes on groups
    whose members had to be inferred."""
    held: dict[str, set[int]] = defaultdict(set)
    configured: dict[str, tuple[int, ...]] = {}
    desc: dict[str, str] = {}
    for d in dumps:
        for n in d.pg_names:
            held[n].add(d.rank)
        for n, r in d.pg_ranks.items():
            configured.setdefault(n, r)
        for n, t in d.pg_desc.items():
            desc.setdefault(n, t)
    world = 1 + max([d.rank for d in dumps] + list(lost_ranks))
    out: dict[str, tuple[int, ...]] = {}
    inferred: list[str] = []
    for n in sorted(set(held) | set(configured)):
        if n in configured:
            extra = sorted(held[n] - set(configured[n]))
            out[n] = configured[n] + tuple(extra)  # a dump holding its entries is a member
        elif desc.get(n) == DEFAULT_PG:
            out[n] = tuple(range(max(world, max(held[n]) + 1)))
        else:
            out[n] = tuple(sorted(held[n]))
            inferred.append(n)
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
    members: dict[str, tuple[int, ...]],
    index: dict[str, int],
    shapes: dict[str, int],
) -> None:
    """One dump's entries as calls, written into ``out`` (views of its slice
    of the incident's columns, zeroed)."""
    e = d.entries
    if not len(e):
        return
    comm = np.array([index[n] for n in d.pg_names], dtype=np.int64)
    crank = np.array([members[n].index(d.rank) for n in d.pg_names], dtype=np.int64)
    shape = np.array([shapes.setdefault(s, len(shapes)) for s in d.shapes], dtype=np.int64)
    pg = e["pg"]
    out["comm"][:], out["crank"][:], out["proc"][:] = comm[pg], crank[pg], p
    out["seq"][:], out["ts"][:] = e["seq"], e["created"]
    # an entry that ended without a completion time (gloo) ended when it began,
    # as far as anyone can tell
    done = np.where(e["completed"] > 0, e["completed"], np.maximum(e["created"], 1))
    ended = e["ended"]
    if d.backend == "gloo":
        # gloo retires a work that failed as one that succeeded: only a rank
        # that went on to a later call shows its call succeeded; its last
        # call's outcome is unknown, and counts as pending
        returned = bool(ended[-1])
        ended = ended.copy()
        ended[-1] = False
    out["end"][:] = np.where(ended, done, 0)
    out["result"][:] = np.where(ended, 0, -1)
    out["count"][:], out["root"][:], out["op"][:] = e["count"], e["peer"], e["op"]
    out["datatype"][:], out["state"][:] = e["datatype"], e["state"]
    if d.backend == "gloo" and returned:
        out["state"][-1] = State.ENQUEUED  # it returned (retired); how is unknown
    out["shape"][:] = np.minimum(shape[e["shape"]], np.iinfo(np.uint16).max)


def _pg_names(dumps: list[FrDump]) -> tuple[list[dict[int, str]], dict[int, set[str]], set[str]]:
    """Per dump, pg_id -> the group its own entries name; over all dumps,
    pg_id -> every group named with it; and the groups with p2p entries."""
    own: list[dict[int, str]] = []
    anywhere: dict[int, set[str]] = defaultdict(set)
    p2p: set[str] = set()
    for d in dumps:
        e = d.entries
        mine: dict[int, str] = {}
        if len(e):
            key = e["pg"].astype(np.int64) * 2 + e["is_p2p"]  # (group, p2p): no structured sort
            for k in np.unique(key).tolist():
                pg, is_p2p = divmod(k, 2)
                for pg_id in np.unique(e["pg_id"][key == k]).tolist():
                    mine[int(pg_id)] = d.pg_names[pg]
                    anywhere[int(pg_id)].add(d.pg_names[pg])
                if is_p2p:
                    p2p.add(d.pg_names[pg])
        own.append(mine)
    return own, anywhere, p2p


def _progress(
    dumps: list[FrDump], members: dict[str, tuple[int, ...]], index: dict[str, int]
) -> tuple[tuple[int, int, int, int], ...]:
    """(comm, comm rank, last seq entered, last seq completed) from pg_status."""
    own, anywhere, p2p = _pg_names(dumps)
    out = []
    for d, mine in zip(dumps, own, strict=True):
        for pg_id, (enq, done) in d.pg_status.items():
            name = mine.get(pg_id)
            if name is None:
                cands = [n for n in anywhere.get(pg_id, ()) if d.rank in members[n]]
                name = cands[0] if len(cands) == 1 else None
            if name is None or d.rank not in members[name]:
                continue
            if d.backend == "gloo":  # its completions may be failures: entries tell
                enq, done = _seq_of_op(d, name, enq), -1
            elif name in p2p:
                continue
            if enq >= 0:
                out.append((index[name], members[name].index(d.rank), enq, done))
    return tuple(sorted(out))


def _seq_of_op(d: FrDump, name: str, op_id: int) -> int:
    """The collective seq of a group's op counter on this rank: the latest
    entry at or before that op (-1 if its ring holds none)."""
    e = d.entries
    mine = e[(e["pg"] == d.pg_names.index(name)) & ~e["is_p2p"] & (e["op_id"] <= op_id)]
    return int(mine["seq"].max()) if len(mine) else -1


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

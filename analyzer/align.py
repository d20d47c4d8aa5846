"""Stage "align": turn the dumps of one incident into one ``Incident``.

Each node's dump holds its own processes, communicators and rings; this stage
joins them: one proc per (host, pid), communicators with their members in
comm-rank order and world ranks (``dumpers.ranks``: split communicators
whose ranks were not recorded get them derived the way NCCL does),
and one columnar table of calls.  A ring that overwrote rows marks its procs'
windows as incomplete, so that a seq older than what a rank retained is
"unknown", never "missing".

Inputs are sorted by host first, so the result does not depend on the order
in which files were given.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

from stallwatch.dumpers import addresses, rankevidence, ranks
from stallwatch.dumpers.errors import DumpError
from stallwatch.dumpers.format import DeferredRing
from stallwatch.dumpers.layout import LINK_COUNTERS, UNKNOWN_U64, LinkEvent
from stallwatch.dumpers.model import CommInfo, Recording, Ring, TriggerKind
from stallwatch.dumpers.rankevidence import Evidence
from stallwatch.dumpers.schema import NCCL_EVENT, TCP_EVENT, ExitEvent, TcpEvent

from . import late
from .callrows import NO_PIDS, Staged, held_calls, listed_pids, stage_windows
from .columns import Columns, Handed
from .incident import (
    CALL_DTYPE,
    HELD_DTYPE,
    SCHED_DTYPE,
    TCP_DTYPE,
    WAIT_DTYPE,
    WINDOW_CALLS,
    Calls,
    Comm,
    Deferred,
    HostRetransmits,
    Incident,
    InputStatus,
    LateReport,
    LinkFate,
    Proc,
    SlowTrigger,
    SourceKind,
    host_readings,
)
from .match import order_calls
from .netrows import conn_rows, connection_keys, iface_rows, owner_of, probe_rows
from .parallel import in_parallel, threads
from .plausible import implausible, other_rings
from .progress import Progress


@dataclass(frozen=True, slots=True)
class Source:
    path: str
    recording: Recording
    # rings left in the file by the loader, read when their rows are wanted
    deferred: Mapping[str, DeferredRing] = field(default_factory=dict)
    # its window's calls, staged where it was read (``prestage``)
    staged: Prestaged | None = None


@dataclass(frozen=True, slots=True)
class Prestaged:
    """A source's window of ``calls`` per rank, staged by the process that
    read its file (a worker, beside its header: ``prestage``): its rows of
    the stage table of the sources read with it, and what else _extract
    says of it (``_Extract``'s fields after the source)."""

    table: Columns | Handed  # handed to the process that reads it (analyzer.load)
    calls: int
    said: tuple[object, ...]


SCOPED_RINGS = ("sched", "exit")  # nccl rows are scoped as they are read (_extract)


def in_scope(rec: Recording, consume: bool = False) -> Recording:
    """The recording without rows of processes its agent does not list: an
    agent's process table is its scope (one node), whatever leaked past it.
    With ``consume``, rings replaced by a filtered copy leave the original."""
    scope = _listed_pids(rec)
    if not len(scope):
        return rec
    rings = dict(rec.rings)
    for name in SCOPED_RINGS:
        ring = rings.get(name)
        if ring is None or not len(ring.rows):
            continue
        keep = _member_of(ring.rows["pid"], scope)
        if not keep.all():
            rings[name] = dataclasses.replace(ring, rows=ring.rows[keep])
            if consume:
                rec.rings.pop(name, None)
    if all(rings[k] is rec.rings.get(k) for k in rings):
        return rec  # nothing out of scope: the same recording, not a copy
    return dataclasses.replace(rec, rings=rings)


_listed_pids = listed_pids


def _member_of(values: np.ndarray, known: np.ndarray) -> np.ndarray:
    """Per value: whether it is in ``known`` (sorted, unique)."""
    return _positions(known, values)[1]


LOW_BITS_MAX = 16  # a key table of up to 64k slots


def _positions(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Index of each value in ``keys`` (sorted, unique), and whether it is
    there.  When the keys' low bits tell them apart (a node's pids, a few comm
    hashes), a table indexed by those bits answers with one gather per value:
    a binary search mispredicts its branches on values in no order and costs
    several times as much.  Finding those bits costs a few sets of the keys:
    for a handful of values the search is cheaper."""
    n = len(keys)
    if not n:
        return np.zeros(len(values), dtype=np.int64), np.zeros(len(values), dtype=bool)
    if n <= 1 << LOW_BITS_MAX and len(values) >= 64 * n:
        ks = [int(k) for k in keys.tolist()]
        for bits in range(max(1, (n - 1).bit_length()), LOW_BITS_MAX + 1):
            mask = (1 << bits) - 1
            if len({k & mask for k in ks}) == n:
                slot = np.zeros(mask + 1, dtype=np.int64)
                slot[[k & mask for k in ks]] = np.arange(n)
                pos: np.ndarray = slot[values & values.dtype.type(mask)]
                return pos, keys[pos] == values
    pos = np.searchsorted(keys, values)
    np.minimum(pos, n - 1, out=pos)
    return pos, keys[pos] == values


def incident_from_recordings(
    incident_id: str, sources: list[Source], consume: bool = False, progress: bool = False
) -> Incident:
    """One incident from its dumps.  With ``consume`` the recordings' nccl
    rings are released as they are read (the caller gives them up); with
    ``progress``, reading them is shown on stderr."""
    scoped = [(s, in_scope(s.recording, consume)) for s in sources]
    sources = [s if r is s.recording else dataclasses.replace(s, recording=r) for s, r in scoped]
    sources = sorted(sources, key=lambda s: (s.recording.host, s.path))
    early = [(s, why) for s in sources if (why := other_rings(s.recording)) is not None]
    sources = [s for s in sources if all(s is not d for d, _ in early)]
    sources, report = _align_late(sources)
    hosts = tuple(sorted({s.recording.host for s in sources}))
    owner = address_owners(sources, hosts)
    tcp = _tcp(sources, hosts, owner)
    shown = Progress("read the NCCL calls of {}/{} dumps", len(sources), progress)
    # retransmission timeouts: a stall the job may have come back from, long
    # before the window (detect.partition's flap)
    whole = bool((tcp["backoff"] > 0).any() or (tcp["known"] == 0).any())
    slow = _slowdown(sources)
    per_rank = SLOW_WINDOW_CALLS if slow is not None else WINDOW_CALLS
    uncertain = ranks.uncertain_splits(s.recording for s in sources)
    stage, extracts = _extract_all(sources, consume, shown, whole, per_rank, uncertain)
    shown.close()
    # a dump whose rows could not be read (damaged, changed since) is lost:
    # its ranks are judged as those of a dump never found, from their peers
    lost = tuple(InputStatus(s.path, False, f"{s.path}: {why}", SourceKind.STALLWATCH)
                 for s, why in early)  # fmt: skip
    damaged = tuple(InputStatus(e.source.path, False, e.error, SourceKind.STALLWATCH)
                    for e in extracts if e.error)  # fmt: skip
    lost += damaged
    if damaged:
        extracts = [e for e in extracts if not e.error]
        sources = [e.source for e in extracts]
        hosts = tuple(sorted({s.recording.host for s in sources}))
        owner = address_owners(sources, hosts)
        tcp = _tcp(sources, hosts, owner)
    now = _host_now(extracts)
    counts, rows = _host_counts(sources, tcp, hosts)
    firsts, proc_index = _proc_index(extracts)
    comms, membership, world = _comms(extracts, proc_index)
    procs = _procs(extracts, firsts, world, report.uncertain() if report else set())
    calls = _calls(stage, extracts, proc_index, comms, membership)
    clocks = _clocks(sources)
    return Incident(
        id=incident_id,
        hosts=hosts,
        host_now=tuple(now.get(h) for h in hosts),
        procs=tuple(procs),
        comms=tuple(comms),
        calls=calls,
        tcp=tcp,
        sched=_sched(sources, hosts),
        sources=tuple(s.path for s in sources),
        lost=lost,
        stall_triggers=_stall_triggers(sources),
        wall_ns=(detected := _detection(sources))[0],
        detected_by=detected[1],
        readings=host_readings((s.recording for s in sources), _entered_by_host(extracts)),
        late=report,
        wall_offset=tuple(clocks.get(h, (None, None))[0] for h in hosts),
        captured=tuple(clocks.get(h, (None, None))[1] for h in hosts),
        machines=_machines(sources, hosts),
        waiting=_waiting_procs(extracts, proc_index),
        held=_held_calls(extracts, proc_index),
        links=_links(sources, hosts, procs),
        slowdown=slow,
        probes=(probed := probe_rows(recs := [s.recording for s in sources], hosts, owner))[0],
        unreached=probed[1],
        conns=conn_rows(recs, hosts, owner),
        ifaces=iface_rows(recs, hosts),
        host_retransmits=counts,
        retransmit_rows=rows,
    )


def _host_counts(
    sources: list[Source], tcp: np.ndarray, hosts: tuple[str, ...]
) -> tuple[Deferred[tuple[HostRetransmits, ...]] | None, int]:
    """Per host, the retransmits inside its collectives' windows, as the
    shipped query counts them over the dumps (``query.retransmits``: one
    definition for the report and the SQL), run when first asked for; None
    when no retransmit of the job's connections went between two hosts.
    And how many retransmit rows of the job's the dumps hold."""
    rows = 0
    for s in sources:
        ring = s.recording.rings.get("tcp")
        if ring is not None and len(ring.rows):
            r = ring.rows
            rows += int(((r["event"] == TcpEvent.TCP_RETRANSMIT_SKB) & (r["other"] == 0)).sum())
    between = (tcp["event"] == TcpEvent.TCP_RETRANSMIT_SKB) & (tcp["other"] == 0)
    if not between.any():
        return None, rows
    return Deferred(functools.partial(_query_counts, list(sources), hosts)), rows


def _query_counts(sources: list[Source], hosts: tuple[str, ...]) -> tuple[HostRetransmits, ...]:
    from stallwatch.query.retransmits import retransmits_by_host

    got = retransmits_by_host([functools.partial(_with_calls, s) for s in sources])
    return tuple(
        HostRetransmits(i, c.sent_in_windows, c.received_in_windows, c.sent_in_all, c.collectives)
        for i, h in enumerate(hosts)
        if (c := got.get(h)) is not None
    )


def _with_calls(s: Source) -> Recording | None:
    """The source's recording with every row of its NCCL ring (read again
    from its file where it was left there); None if it cannot be read."""
    later = s.deferred.get("nccl")
    if later is None:
        return s.recording
    try:
        rows = later.read()
    except DumpError:
        return None
    ring = Ring(rows, later.overwritten, later.lost)
    return dataclasses.replace(s.recording, rings={**s.recording.rings, "nccl": ring})


def _entered_by_host(extracts: list[_Extract]) -> dict[str, dict[int, int]]:
    out: dict[str, dict[int, int]] = defaultdict(dict)
    for e in extracts:
        seen = out[e.source.recording.host]
        for pid, ts in e.entered:
            seen[pid] = max(seen.get(pid, 0), ts)
    return out


def _slowdown(sources: list[Source]) -> SlowTrigger | None:
    """The earliest slowdown an agent of the incident raised itself (the
    others dumped it at its request), None if it is no slowdown."""
    raised = [
        SlowTrigger(s.recording.host, t.time_ns, t.comm_hash, t.pid, t.reason)
        for s in sources
        if (t := s.recording.trigger) is not None and t.kind is TriggerKind.SLOWDOWN
    ]
    return min(raised, key=lambda t: t.time_ns) if raised else None


def _held_calls(extracts: list[_Extract], proc_index: dict[tuple[str, int], int]) -> np.ndarray:
    parts = []
    for e in extracts:
        if e.held is None or not len(e.held):
            continue
        host = e.source.recording.host
        procs = np.array([proc_index.get((host, int(p)), -1) for p in e.held["proc"]])
        rows = e.held[procs >= 0].copy()
        rows["proc"] = procs[procs >= 0]
        parts.append(rows)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=HELD_DTYPE)


def _waiting_procs(extracts: list[_Extract], proc_index: dict[tuple[str, int], int]) -> np.ndarray:
    rows = [
        (proc_index[key], op, ts)
        for e in extracts
        for pid, op, ts in e.waiting
        if (key := (e.source.recording.host, pid)) in proc_index
    ]
    return np.array(rows, dtype=WAIT_DTYPE) if rows else np.zeros(0, dtype=WAIT_DTYPE)


STALL_TRIGGERS = (TriggerKind.IN_FLIGHT, TriggerKind.NO_PROGRESS)


def _stall_triggers(sources: list[Source]) -> tuple[str, ...]:
    """The dumps an agent's watchdog wrote on a stall, as "host (why)"."""
    return tuple(
        f"{s.recording.host} ({t.reason})"
        for s in sources
        if (t := s.recording.trigger) is not None and t.kind in STALL_TRIGGERS
    )


def _machines(sources: list[Source], hosts: tuple[str, ...]) -> tuple[int, ...]:
    """Per host, the first host recorded on the same running kernel: one boot
    id is one machine, whatever names its agents gave it.  A host without a
    boot id is a machine of its own."""
    boots = {s.recording.host: s.recording.boot_id for s in sources if s.recording.boot_id}
    first: dict[str, int] = {}
    return tuple(first.setdefault(boots.get(h) or f"host {h}", i) for i, h in enumerate(hosts))


def _clocks(sources: list[Source]) -> dict[str, tuple[int, int]]:
    """Per host, of its latest dump: realtime - monotonic (its timestamps as
    wall clock) and when it read its rings (the clock is sampled right after),
    to compare the moments dumps of different hosts were taken."""
    out: dict[str, tuple[int, int]] = {}
    for s in sorted(sources, key=lambda s: s.recording.clock.realtime_ns):
        clock = s.recording.clock
        if clock.realtime_ns > 0:
            out[s.recording.host] = (clock.realtime_ns - clock.monotonic_ns, clock.realtime_ns)
    return out


def _detection(sources: list[Source]) -> tuple[int | None, str]:
    """When the incident was detected (wall clock) and by whom: the earliest
    trigger of an agent that saw it itself (a peer's request only names
    that agent), else the latest snapshot time."""
    triggers = [
        (s.recording.clock.to_wall_ns(t.time_ns), t.kind is TriggerKind.PEER, s.recording.host, t)
        for s in sources
        if (t := s.recording.trigger) is not None and t.time_ns > 0
    ]
    if not triggers:
        walls = [s.recording.clock.realtime_ns for s in sources]
        return (max(walls) if walls else None), ""
    wall, peer, host, t = min(triggers, key=lambda x: (x[1], x[0]))
    if peer:  # the peers' reason reads "origin: why"
        origin = t.origin_host or host
        return wall, f"{origin} ({t.reason.removeprefix(f'{origin}: ')})"
    return wall, f"{host} ({t.reason})"


def _align_late(sources: list[Source]) -> tuple[list[Source], LateReport | None]:
    """Calls recorded from an agent's attach (``analyzer.late``), aligned
    before anything is matched.  Their rings are read here, all of them: the
    consensus they are aligned to is every other rank's."""
    if not late.has_late(s.recording for s in sources):
        return sources, None
    loaded = []
    for s in sources:
        rec, deferred = s.recording, dict(s.deferred)
        ring = deferred.pop("nccl", None)
        if ring is not None:
            try:
                rows = ring.read()
            except DumpError:
                rows = None  # unreadable now: _extract says so
            if rows is not None:
                rings = {**rec.rings, "nccl": Ring(rows, ring.overwritten, ring.lost)}
                rec = dataclasses.replace(rec, rings=rings)
            else:
                deferred["nccl"] = ring
        # its rows are aligned below: what was staged of them before is not theirs
        loaded.append(dataclasses.replace(s, recording=rec, deferred=deferred, staged=None))
    recs, report = late.align([s.recording for s in loaded])
    return [dataclasses.replace(s, recording=r) for s, r in zip(loaded, recs, strict=True)], report


@dataclass(frozen=True, slots=True)
class _Extract:
    """One source's call rows, copied out of its ring into the stage table
    (a ring's records are read once, while they are in the CPU's cache)."""

    source: Source
    rows: slice  # its rows in the stage table
    complete: bool  # its ring never overwrote a row
    latest: int | None  # its latest timestamp
    scope: np.ndarray  # pids (sorted): its rows' "proc" column holds indices into it
    pids: tuple[int, ...]  # pids of its call rows, beyond its communicator table's
    # (comm_hash, pid, rank, nranks) of call rows whose comm its table lacks
    row_members: tuple[tuple[int, int, int, int], ...]
    error: str | None = None  # why its rows could not be read
    # (pid, op, entered) of each process whose latest call (a group's end
    # included) had not returned when the dump was taken
    waiting: tuple[tuple[int, int, int], ...] = ()
    held: np.ndarray | None = None  # its long calls (HELD_DTYPE, "proc" a pid), window or not
    # (pid, entered) of each process's latest call: its thread readings
    # before that are no longer where it is
    entered: tuple[tuple[int, int], ...] = ()
    # (pid, comm hash) -> what its calls on a split communicator tell of its
    # rank there (dumpers.rankevidence), where a member left no dump
    evidence: Mapping[tuple[int, int], Evidence] = field(default_factory=dict)


# the stage: CALL_DTYPE's columns, "proc" holding indices into the source's
# scope and "crank" the rows' own ranks until _calls resolves them, and the
# rows' comm hashes
STAGE_DTYPE = np.dtype([*((n, CALL_DTYPE[n]) for n in CALL_DTYPE.names or ()), ("hash", "<u8")])


def _extract_all(
    sources: list[Source],
    consume: bool,
    shown: Progress | None = None,
    whole: bool = False,
    calls: int | None = None,
    uncertain: frozenset[int] = frozenset(),
) -> tuple[Columns, list[_Extract]]:
    """Every source's call rows into one stage table, a few threads each
    taking a run of sources (and its own run of the table).  A ring left in
    its file is read into the thread's one buffer, copied out, forgotten.
    ``whole``: each ring's long calls are looked for beyond the window too
    (the whole ring is read: a stall the job came back from).  The whole
    ring is read too where it holds calls on ``uncertain`` communicators
    (splits a member of which left no dump): what they tell of ranks."""
    per_rank = WINDOW_CALLS if calls is None else calls  # of each rank, the latest
    if not whole and all(s.staged is not None and s.staged.calls == per_rank for s in sources):
        stage, joined = _joined(sources, shown)
        return stage, [_told(e, uncertain) for e in joined]
    windows = [_window(s, per_rank) for s in sources]
    sizes = [keep for _, keep in windows]
    for s, (skip, _) in zip(sources, windows, strict=True):
        later = s.deferred.get("nccl")
        if later is not None:  # the rows of every dump fetched from disk side by side
            later.prefetch(skip)
    stage = Columns.empty(STAGE_DTYPE, sum(sizes))  # filled in place: no list of parts to join

    def run(part: tuple[int, int, int]) -> list[_Extract]:
        first, stop, at = part
        batch = _Batch(stage, at, max(BATCH_ROWS, max(sizes[first:stop], default=0)))
        for s, (skip, _) in zip(sources[first:stop], windows[first:stop], strict=True):
            later = s.deferred.get("nccl")
            told = uncertain & {c.comm_hash for c in s.recording.communicators}
            if whole or told:  # the whole ring is read (long calls, ranks' evidence): alone
                batch.flush()
                batch.out.append(_one(s, later, skip, consume, stage, batch.at, whole, told))
                batch.at = batch.out[-1].rows.stop
            elif later is None:
                ring = s.recording.rings.get("nccl")
                complete = ring is None or (ring.overwritten == 0 and not skip)
                batch.add(s, ring.rows[skip:] if ring is not None else None, complete,
                          ring.lost if ring is not None else 0)  # fmt: skip
                if consume:  # the caller gave the recordings up: free each ring once read
                    s.recording.rings.pop("nccl", None)
            else:
                batch.read(s, later, skip)
            if shown is not None:
                shown.step()
        batch.flush()
        return batch.out

    parts = _runs(sizes, threads())
    extracts: list[_Extract] = []
    at = 0
    for (_, _, start), done in zip(parts, in_parallel(run, parts), strict=True):
        stop = done[-1].rows.stop if done else start
        if start != at:  # rows a run dropped (out of scope, not calls) leave a gap: close it
            for name in stage:
                stage[name][at : at + stop - start] = stage[name][start:stop]
            shift = at - start
            done = [
                dataclasses.replace(e, rows=slice(e.rows.start + shift, e.rows.stop + shift))
                for e in done
            ]
        at += stop - start
        extracts.extend(done)
    return stage[:at], extracts


def _with_evidence(e: _Extract, ring: np.ndarray, hashes: frozenset[int]) -> _Extract:
    """The extract with what its whole ring tells of ranks in ``hashes``."""
    if e.error is not None or not len(ring):
        return e
    ring = ring if ring.dtype == NCCL_EVENT else ring.astype(NCCL_EVENT)
    return dataclasses.replace(e, evidence=rankevidence.ring_evidence(ring, hashes))


def _told(e: _Extract, uncertain: frozenset[int]) -> _Extract:
    """A source staged where it was read, with what its whole ring tells of
    ranks on the ``uncertain`` communicators it is a member of (none where
    the ring cannot be read again: its ranks there stay unknown)."""
    told = uncertain & {c.comm_hash for c in e.source.recording.communicators}
    if not told or e.error is not None:
        return e
    later = e.source.deferred.get("nccl")
    if later is None:
        ring = e.source.recording.rings.get("nccl")
        return e if ring is None else _with_evidence(e, ring.rows, told)
    try:
        return _with_evidence(e, later.read(), told)
    except DumpError:
        return e


def prestage(sources: list[Source], calls: int = WINDOW_CALLS) -> list[Source]:
    """The sources with their windows' calls staged (``_extract`` without
    the incident): done by each process that reads dump files, so that the
    calls of thousands of dumps are judged and staged on every core, and
    the incident's process only joins them (``_joined``)."""
    windows = [_window(s, calls) for s in sources]
    for s, (skip, _) in zip(sources, windows, strict=True):
        later = s.deferred.get("nccl")
        if later is not None:  # the rows of every dump fetched from disk side by side
            later.prefetch(skip)
    sizes = [keep for _, keep in windows]
    stage = Columns.empty(STAGE_DTYPE, sum(sizes))
    batch = _Batch(stage, 0, max(BATCH_ROWS, max(sizes, default=0)))
    for s, (skip, _) in zip(sources, windows, strict=True):
        later = s.deferred.get("nccl")
        if later is not None:
            batch.read(s, later, skip)
        else:
            ring = s.recording.rings.get("nccl")
            complete = ring is None or (ring.overwritten == 0 and not skip)
            rows = ring.rows[skip:] if ring is not None else None
            batch.add(s, rows, complete, ring.lost if ring is not None else 0)
    batch.flush()
    table = stage[: batch.at]
    return [
        dataclasses.replace(s, staged=Prestaged(table, calls, _said(e)))
        for s, e in zip(sources, batch.out, strict=True)
    ]


_SAID = tuple(f.name for f in dataclasses.fields(_Extract))[1:]


def _said(e: _Extract) -> tuple[object, ...]:
    return tuple(getattr(e, name) for name in _SAID)


def _joined(sources: list[Source], shown: Progress | None) -> tuple[Columns, list[_Extract]]:
    """The stage table of sources staged where they were read: their rows
    joined, column by column, in the sources' order (their tables are used
    up: each column is let go once joined)."""
    extracts: list[_Extract] = []
    parts: list[tuple[Columns, slice]] = []
    at = 0
    for s in sources:
        assert s.staged is not None and isinstance(s.staged.table, Columns)
        parts.append((s.staged.table, s.staged.said[0]))  # type: ignore[arg-type]
        e = _Extract(dataclasses.replace(s, staged=None), *s.staged.said)  # type: ignore[arg-type]
        n = e.rows.stop - e.rows.start
        extracts.append(dataclasses.replace(e, rows=slice(at, at + n)))
        at += n
        if shown is not None:
            shown.step()
    if not parts:
        return Columns.empty(STAGE_DTYPE, 0), extracts
    tables = list({id(t): t for t, _ in parts}.values())
    joined = {}
    for name in STAGE_DTYPE.names or ():
        joined[name] = np.concatenate([t[name][rows] for t, rows in parts])
        for t in tables:  # each column let go once joined: one copy at most, not two
            t.pop(name)
    return Columns(joined), extracts


def _runs(sizes: list[int], n: int) -> list[tuple[int, int, int]]:
    """``sizes`` cut into up to ``n`` runs of about equal total: (first,
    stop, offset of the run's first row)."""
    total = sum(sizes)
    if not total:
        return [(0, len(sizes), 0)]
    out: list[tuple[int, int, int]] = []
    first = start = at = 0
    for i, size in enumerate(sizes):
        at += size
        if at * n >= total * (len(out) + 1) or i == len(sizes) - 1:
            out.append((first, i + 1, start))
            first, start = i + 1, at
    return out


# Of each rank, its latest calls are read (the straggler detectors' window,
# RECENT_GROUPS, and the frontier of every communicator it used since):
# an incident of 131,072 ranks is not read whole.  A ring holds a node's
# ranks interleaved: its last WINDOW_CALLS (incident.py) x (ranks it lists) rows.  Older
# rows are left in the file, like rows the ring overwrote: a communicator a
# rank used only before them is unknown for that rank, never missing.
# A slowdown is judged on its slow window against the baseline before it:
# more of each rank's calls are read (a job slowed tenfold makes in 20 s what
# it made in 2 before; detect.slowdown)
SLOW_WINDOW_CALLS = 16 * WINDOW_CALLS


def _window(s: Source, calls: int = WINDOW_CALLS) -> tuple[int, int]:
    """Rows of the source's NCCL ring to skip (the oldest) and to read:
    ``calls`` per rank it lists."""
    later = s.deferred.get("nccl")
    ring = s.recording.rings.get("nccl")
    total = later.rows if later is not None else (len(ring.rows) if ring is not None else 0)
    ranks = len(_listed_pids(s.recording))
    keep = min(total, calls * ranks) if ranks else total
    return total - keep, keep


BATCH_ROWS = 1 << 14  # NCCL rows of many dumps judged and staged at once (2.6 MB: in cache)


_NCCL_RAW = np.dtype((np.void, NCCL_EVENT.itemsize))


class _Batch:
    """Consecutive sources' windows, gathered into one buffer and judged and
    staged together (``analyzer.callrows``) once it is full."""

    def __init__(self, stage: Columns, at: int, rows: int) -> None:
        self.stage, self.at = stage, at
        self.buffer = np.empty(rows, dtype=NCCL_EVENT)
        self.held: list[tuple[Source, int, bool, int]] = []  # (source, rows, complete, lost)
        self.used = 0
        self.out: list[_Extract] = []

    def _room(self, n: int) -> np.ndarray:
        if self.used + n > len(self.buffer):
            self.flush()
        view = self.buffer[self.used : self.used + n]
        return view

    def add(self, s: Source, rows: np.ndarray | None, complete: bool, lost: int) -> None:
        n = 0 if rows is None else len(rows)
        if rows is not None and n:
            rows = rows if rows.dtype == NCCL_EVENT else rows.astype(NCCL_EVENT)
            # as records of raw bytes: numpy copies a structured array field by field
            self._room(n).view(_NCCL_RAW)[:] = rows.view(_NCCL_RAW)
        self.held.append((s, n, complete, lost))
        self.used += n

    def read(self, s: Source, later: DeferredRing, skip: int) -> None:
        n = later.rows - skip
        room = self._room(n)
        try:
            rows = later.read(memoryview(room.view(np.uint8)), skip)  # type: ignore[arg-type]
        except DumpError as exc:
            self.flush()
            self.out.append(
                _Extract(s, slice(self.at, self.at), True, None, NO_PIDS, (), (), str(exc))
            )
            return
        if rows.base is None or not np.shares_memory(rows, room):  # an older format, converted
            room[:] = rows
        self.held.append((s, n, later.overwritten == 0 and not skip, later.lost))
        self.used += n

    def flush(self) -> None:
        if not self.held:
            return
        sizes = [n for _, n, _, _ in self.held]
        recs = [s.recording for s, _, _, _ in self.held]
        lost = [x for _, _, _, x in self.held]
        raw = self.buffer[: self.used]
        staged = stage_windows(raw, sizes, recs, lost, self.stage, self.at)
        at = 0
        for (s, n, complete, x), st in zip(self.held, staged, strict=True):
            self.out.append(_extracted(s, st, complete, raw[at : at + n], x))
            at += n
        self.at = self.out[-1].rows.stop
        self.held, self.used = [], 0


def _one(
    s: Source,
    later: DeferredRing | None,
    skip: int,
    consume: bool,
    stage: Columns,
    at: int,
    whole: bool = True,
    told: frozenset[int] = frozenset(),
) -> _Extract:
    """One source whose whole ring is read: its long calls looked for in
    all of it (``whole``), what it tells of ranks on the ``told``
    communicators."""
    if later is None:
        ring = s.recording.rings.get("nccl")
        if consume:  # the caller gave the recordings up: free each ring once read
            s.recording.rings.pop("nccl", None)
        if ring is None:
            return _extract(s, None, True, stage, at)
        complete = ring.overwritten == 0 and not skip
        every = ring.rows
        e = _extract(s, every[skip:], complete, stage, at, ring.lost, every if whole else None)
    else:
        try:
            every = later.read()
        except DumpError as exc:
            return _Extract(s, slice(at, at), True, None, NO_PIDS, (), (), str(exc))
        complete = later.overwritten == 0 and not skip
        e = _extract(s, every[skip:], complete, stage, at, later.lost, every if whole else None)
    return _with_evidence(e, every, told) if told else e


def _extract(
    s: Source,
    raw: np.ndarray | None,
    complete: bool,
    stage: Columns,
    at: int,
    lost: int = 0,
    every: np.ndarray | None = None,
) -> _Extract:
    """One source's window ``raw``; ``every``: the whole ring, where the
    long calls are looked for (else the window)."""
    if raw is None or not len(raw):
        return _Extract(s, slice(at, at), complete, None, NO_PIDS, (), ())
    raw = raw if raw.dtype == NCCL_EVENT else raw.astype(NCCL_EVENT)
    (st,) = stage_windows(raw, [len(raw)], [s.recording], [lost], stage, at)
    return _extracted(s, st, complete, raw, lost, every)


def _extracted(
    s: Source,
    st: Staged,
    complete: bool,
    raw: np.ndarray,
    lost: int,
    every: np.ndarray | None = None,
) -> _Extract:
    if not len(raw):
        return _Extract(s, st.rows, complete, None, NO_PIDS, (), ())
    if st.damaged:  # a damaged dump: lost, never judged on (analyzer.plausible)
        bad, why = implausible(raw, s.recording, lost, listed_pids(s.recording))
        n = int(np.count_nonzero(bad))
        error = f"{s.path}: rings.nccl: damaged ({n} row(s) the recorder cannot write: "
        return _Extract(s, st.rows, complete, None, NO_PIDS, (), (), error + "; ".join(why) + ")")
    held = st.held
    if every is not None and len(every) > len(raw):
        every = every if every.dtype == NCCL_EVENT else every.astype(NCCL_EVENT)
        held = held_calls(every, _member_of(every["pid"], st.scope))
    return _Extract(
        s, st.rows, complete, st.latest, st.scope, st.pids, st.row_members,
        waiting=st.waiting, held=held, entered=st.entered,
    )  # fmt: skip


def _host_now(extracts: list[_Extract]) -> dict[str, int]:
    """Per host, when it dumped (its clock): the trigger's time, else its
    latest recorded timestamp."""
    out: dict[str, int] = {}
    for e in extracts:
        rec = e.source.recording
        t = rec.trigger.time_ns if rec.trigger is not None and rec.trigger.time_ns > 0 else None
        t = t if t is not None else e.latest
        if t is not None:
            out[rec.host] = max(out.get(rec.host, t), t)
    return out


def _exit_status(rec: Recording) -> dict[int, tuple[int | None, int | None, int | None]]:
    """(exit code, fatal signal, when: wall clock) per pid: the process
    table's when it has one, else the exit ring's.  exit_group() kills the
    other threads with SIGKILL: a signal row after an exit_group row of the
    same pid is not a death cause."""
    status: dict[int, tuple[int | None, int | None, int | None]] = {}
    ring = rec.rings.get("exit")
    if ring is not None and len(ring.rows):
        rows = ring.rows[np.argsort(ring.rows["ts_ns"], kind="stable")]
        for pid, event, code, sig, ts in rows[["pid", "event", "code", "signal", "ts_ns"]].tolist():
            known = pid in status
            wall = rec.clock.to_wall_ns(int(ts))
            if event == ExitEvent.EXIT_GROUP and not known:
                status[pid] = (int(code), None, wall)
            elif event == ExitEvent.SIGNAL and sig > 0 and not known:
                status[pid] = (None, int(sig), wall)
    for p in rec.processes:
        if p.exit_code is not None or p.exit_signal is not None:
            when = status.get(p.pid, (None, None, None))[2]
            if p.exit_ns:
                when = rec.clock.to_wall_ns(p.exit_ns)
            status[p.pid] = (p.exit_code, p.exit_signal, when)
    return status


def _proc_index(
    extracts: list[_Extract],
) -> tuple[list[tuple[int, int]], dict[tuple[str, int], int]]:
    """Each (host, pid) of the extracts' ranks, numbered in order: (extract,
    pid) of the first that holds it, and its number by (host, pid)."""
    firsts: list[tuple[int, int]] = []
    index: dict[tuple[str, int], int] = {}
    for i, e in enumerate(extracts):
        rec = e.source.recording
        for pid in sorted({c.pid for c in rec.communicators} | set(e.pids)):
            if (rec.host, pid) not in index:
                index[(rec.host, pid)] = len(firsts)
                firsts.append((i, pid))
    return firsts, index


def _procs(
    extracts: list[_Extract],
    firsts: list[tuple[int, int]],
    world: dict[int, int],
    uncertain: set[tuple[str, int]],
) -> list[Proc]:
    """The procs numbered by ``_proc_index``, with their world ranks
    (``dumpers.ranks``), unknown for a process aligned to a slot its calls
    could not tell (``analyzer.late``), and how each exited."""
    status: dict[int, dict[int, tuple[int | None, int | None, int | None]]] = {}
    procs: list[Proc] = []
    for n, (i, pid) in enumerate(firsts):
        e = extracts[i]
        rec = e.source.recording
        if i not in status:
            status[i] = _exit_status(rec)
        code, sig, when = status[i].get(pid, (None, None, None))
        rank = -1 if (rec.host, pid) in uncertain else world.get(n, -1)
        procs.append(
            Proc(rec.host, pid, rank, e.source.path, code, sig, e.complete, exit_wall_ns=when)
        )
    return procs


def _comms(
    extracts: list[_Extract], proc_index: dict[tuple[str, int], int]
) -> tuple[list[Comm], dict[tuple[int, int], int], dict[int, int]]:
    """Communicators, a map (proc, comm_hash) -> its slot there (its comm
    rank where every rank is known: ``Comm.ranks``), and world ranks (proc ->
    rank), by the rules of ``dumpers.ranks``."""
    entries: list[tuple[int, CommInfo]] = []
    for e in extracts:
        rec = e.source.recording
        entries += [
            (proc_index[(rec.host, ci.pid)], ci) for ci in rec.communicators if ci.comm_hash
        ]
    tabled = {(p, ci.comm_hash) for p, ci in entries}
    for rows_hash, proc, rank, nranks in _row_members(extracts, proc_index):
        if (proc, rows_hash) not in tabled:
            entries.append((proc, CommInfo(0, 0, rows_hash, rank, nranks)))
    evidence = {
        (proc_index[(e.source.recording.host, pid)], h): ev
        for e in extracts
        for (pid, h), ev in e.evidence.items()
        if (e.source.recording.host, pid) in proc_index
    }
    found = ranks.resolve(entries, evidence)
    comms = [_comm(h, c, h in found.split) for h, c in sorted(found.comms.items())]
    slots = {
        (p, h): i for h, c in found.comms.items() for i, p in enumerate(c.slots) if p is not None
    }
    return comms, slots, found.world_ranks()


def _comm(h: int, c: ranks.CommMembers[int], split: bool) -> Comm:
    """The analyzer's communicator: its members by slot, with their ranks
    where the evidence does not tell them all (``Comm.ranks``)."""
    members = tuple(-1 if p is None else p for p in c.slots)
    world = tuple(-1 if w is None else w for w in c.owners)
    if c.exact:
        return Comm(
            h, members, is_split=split, world_ranks=world if any(w >= 0 for w in world) else ()
        )
    return Comm(
        h, members, is_split=split,
        ranks=tuple(-1 if r is None else r for r in c.ranks),
        size=-1 if c.size is None else c.size, size_min=c.size_min,
    )  # fmt: skip


def _row_members(
    extracts: list[_Extract], proc_index: dict[tuple[str, int], int]
) -> list[tuple[int, int, int, int]]:
    """(comm_hash, proc, rank, nranks) seen in call rows, for comms whose init
    the recorder never saw."""
    out: list[tuple[int, int, int, int]] = []
    for e in extracts:
        for h, pid, rank, nranks in e.row_members:
            proc = proc_index.get((e.source.recording.host, pid))
            if proc is not None:
                out.append((h, proc, rank, nranks))
    return out


def _calls(
    stage: Columns,
    extracts: list[_Extract],
    proc_index: dict[tuple[str, int], int],
    comms: list[Comm],
    membership: dict[tuple[int, int], int],
) -> Calls:
    """The stage's pids, comm hashes and own ranks resolved into procs, comm
    indices and comm ranks; rows of no known communicator dropped.  Each
    source is resolved against its own few communicators (its table and
    the comms its rows name): per source, a small table of (process,
    communicator) -> rank, and per row a lookup in its source's, all rows
    in one pass of numpy, however many communicators the incident has."""
    hashes = np.array([c.comm_hash for c in comms], dtype=np.uint64)
    t = _SourceTables(extracts, proc_index, hashes, membership)
    e, sel = t.rows_of(extracts, len(stage))
    scope_index = stage["proc"][sel].astype(np.int64)
    row_hash = stage["hash"][sel]
    slot = t.local_slot(e, row_hash)
    ok = t.known[slot]
    cell = t.rank_base[e] + scope_index * t.nlocal[e] + (slot - t.local_base[e])
    crank = t.ranks[np.where(ok, cell, -1)]
    unset = crank < 0
    if unset.any():  # not a member by the comm tables: the row's own rank
        crank[unset] = stage["crank"][sel][unset]
    crank[~ok] = -1
    stage["proc"][sel] = t.procs[t.proc_base[e] + scope_index]
    stage["comm"][sel] = t.where[slot]
    stage["crank"][sel] = crank
    valid = bool((crank >= 0).all())
    # the columns move out of the stage: ordering them frees each old one
    rows = Columns({name: stage.pop(name) for name in CALL_DTYPE.names or ()})
    stage.pop("hash")
    if not valid:
        rows = rows[rows["crank"] >= 0]
    return order_calls(rows, np.array([c.nranks for c in comms], dtype=np.int64))


class _SourceTables:
    """Per source of the stage, flattened side by side: its scope's procs,
    the comm hashes its rows can name (``_local_comms``) with their index
    in the incident's communicators (``where``; ``known``: whether it has
    one), and each (scope pid, local comm)'s rank there (-1: none).  The
    last entry of ``where``, ``known`` and ``ranks`` stands for none."""

    def __init__(
        self,
        extracts: list[_Extract],
        proc_index: dict[tuple[str, int], int],
        hashes: np.ndarray,
        membership: dict[tuple[int, int], int],
    ) -> None:
        procs = [
            [proc_index.get((e.source.recording.host, p), -1) for p in e.scope.tolist()]
            for e in extracts
        ]
        local = [_local_comms(e) for e in extracts]
        self.procs = np.array([p for ps in procs for p in ps], dtype=np.int64)
        self.proc_base = _starts([len(ps) for ps in procs])
        self.nlocal = np.array([len(h) for h in local], dtype=np.int64)
        self.local_base = _starts(self.nlocal.tolist())
        flat = np.concatenate([np.zeros(0, dtype=np.uint64), *local])
        self.hashes = np.unique(flat)  # every source's, as one key space
        source = np.arange(len(extracts), dtype=np.int64).repeat(self.nlocal)
        self.keys = source * len(self.hashes) + np.searchsorted(self.hashes, flat)
        where = np.minimum(np.searchsorted(hashes, flat), max(len(hashes) - 1, 0))
        known = hashes[where] == flat if len(hashes) else np.zeros(len(flat), dtype=bool)
        self.where, self.known = np.r_[where, 0], np.r_[known, False]
        self.ranks = np.array(
            [membership.get((p, int(h)), -1) for ps, hs in zip(procs, local, strict=True)
             for p in ps for h in hs.tolist()] + [-1],
            dtype=np.int64,
        )  # fmt: skip
        self.rank_base = _starts([len(ps) * len(hs) for ps, hs in zip(procs, local, strict=True)])

    @staticmethod
    def rows_of(extracts: list[_Extract], n: int) -> tuple[np.ndarray, slice | np.ndarray]:
        """The stage rows of the sources (of ``n``: all of them, as a slice,
        where the sources' rows follow one another), and the source of each."""
        sizes = np.array([e.rows.stop - e.rows.start for e in extracts], dtype=np.int64)
        first = np.array([e.rows.start for e in extracts], dtype=np.int64)
        e = np.arange(len(extracts), dtype=np.int64).repeat(sizes)
        starts = _starts(sizes.tolist())
        if int(sizes.sum()) == n and np.array_equal(first[sizes > 0], starts[sizes > 0]):
            return e, slice(0, n)
        sel = np.arange(int(sizes.sum()), dtype=np.int64) - starts.repeat(sizes)
        return e, sel + first.repeat(sizes)

    def local_slot(self, e: np.ndarray, row_hash: np.ndarray) -> np.ndarray:
        """Per row of source ``e``: the flat index of its comm hash among
        its source's local ones (the last, none, if it is not there)."""
        none = len(self.keys)
        if not none:
            return np.full(len(e), none, dtype=np.int64)
        u = np.minimum(np.searchsorted(self.hashes, row_hash), len(self.hashes) - 1)
        slot, ok = _positions(self.keys, e * len(self.hashes) + u)
        ok &= self.hashes[u] == row_hash
        out: np.ndarray = np.where(ok, slot, none)
        return out


def _starts(sizes: list[int]) -> np.ndarray:
    """Where each of consecutive runs of ``sizes`` starts."""
    out: np.ndarray = np.r_[0, np.cumsum(np.asarray(sizes, dtype=np.int64))][:-1]
    return out.astype(np.int64)


def _local_comms(e: _Extract) -> np.ndarray:
    """The comm hashes a source's rows can name (sorted): its table's, and
    those of comms its table lacks."""
    known = {c.comm_hash for c in e.source.recording.communicators if c.comm_hash}
    known |= {h for h, _, _, _ in e.row_members}
    return np.array(sorted(known), dtype=np.uint64)


def _comm_index(hashes: np.ndarray, comm_hash: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Index of each row's communicator, and whether it is known."""
    if not len(hashes):
        return np.zeros(len(comm_hash), dtype=np.int64), np.zeros(len(comm_hash), dtype=bool)
    if len(comm_hash) and (comm_hash == comm_hash[0]).all():  # one comm: no per-row search
        i = int(np.searchsorted(hashes, comm_hash[0]))
        known = i < len(hashes) and hashes[i] == comm_hash[0]
        pos = np.full(len(comm_hash), min(i, len(hashes) - 1), dtype=np.int64)
        return pos, np.full(len(comm_hash), known, dtype=bool)
    return _positions(hashes, comm_hash)


def _addr_keys(addrs: np.ndarray) -> np.ndarray:
    """16-byte addresses as one comparable 128-bit void scalar each."""
    return np.ascontiguousarray(addrs).view("V16").ravel()


# TCP rows joined at once (about 90 MB): a pass of numpy over many hosts'
# rows, not a copy of every ring of an incident of thousands of hosts
TCP_CHUNK_ROWS = 1 << 20


def _tcp_chunks(sources: list[Source]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The sources' TCP rows, in their order, as tables of consecutive
    sources' rows (about TCP_CHUNK_ROWS each), with the source (index into
    ``sources``) of each row: numpy passes over many hosts at once, where a
    pass per host cost more in calls than in rows."""
    parts: list[np.ndarray] = []
    owners: list[np.ndarray] = []
    held = 0
    for i, s in enumerate(sources):
        ring = s.recording.rings.get("tcp")
        if ring is not None and len(ring.rows):
            parts.append(ring.rows if ring.rows.dtype == TCP_EVENT else ring.rows.astype(TCP_EVENT))
            owners.append(np.full(len(ring.rows), i, dtype=np.int64))
            held += len(ring.rows)
        if held >= TCP_CHUNK_ROWS or (parts and i == len(sources) - 1):
            yield _concat_rows(parts, TCP_EVENT), np.concatenate(owners)
            parts, owners, held = [], [], 0


def _concat_rows(parts: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
    """Arrays of one structured ``dtype`` joined.  As records of raw bytes:
    numpy promotes structured dtypes pair by pair in Python, which costs
    more than the copy when there are a thousand small parts."""
    raw = np.dtype((np.void, dtype.itemsize))
    out: np.ndarray = np.concatenate([p.view(raw) for p in parts]).view(dtype)
    return out


def _own_addresses(sources: list[Source], rows: np.ndarray, source: np.ndarray) -> dict[int, bytes]:
    """Per source of ``rows`` (consecutive sources' TCP rows), the host's
    address: the commonest non-loopback source address of connections its
    ranks own (the owner attribution is not perfect); of equally common
    ones, the lowest (bytewise)."""
    out: dict[int, bytes] = {}
    run = range(int(source[0]), int(source[-1]) + 1) if len(source) else range(0)
    ranks = [(i << 32) | c.pid for i in run for c in sources[i].recording.communicators]
    if not ranks:
        return out
    keys = (source.astype(np.uint64) << np.uint64(32)) | rows["pid"].astype(np.uint64)
    own = _member_of(keys, np.unique(np.array(ranks, dtype=np.uint64)))
    own &= ~addresses.is_loopback(rows["saddr"], rows["family"])
    if not own.any():
        return out
    addrs, addr_of = addresses.distinct(rows["saddr"][own])
    pairs, counts = _tally((source[own] - run.start) * len(addrs) + addr_of)
    src, addr = np.divmod(pairs, len(addrs))
    src += run.start
    # per source: the highest count first, then the lowest address (sorted: addr)
    order = np.lexsort((addr, -counts, src))
    first = order[np.r_[True, src[order][1:] != src[order][:-1]]]
    for i, a in zip(src[first].tolist(), addr[first].tolist(), strict=True):
        out[i] = addrs[a].tobytes()
    return out


def _tally(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(keys, return_counts=True)`` of non-negative integers: a
    count per value where they are few beside the rows (a pass, not a sort)."""
    top = int(keys.max()) + 1 if len(keys) else 0
    if top > 4 * len(keys):
        pairs, counts = np.unique(keys, return_counts=True)
        return pairs, counts
    tally = np.bincount(keys, minlength=top)
    found = np.flatnonzero(tally)
    return found, tally[found]


def _tcp(
    sources: list[Source], hosts: tuple[str, ...], owner: dict[bytes, int] | None = None
) -> np.ndarray:
    """Retransmits, resets and states at the dump (``tcp_info``) of
    connections between two hosts' own addresses (the nodes of rank
    processes; ``owner``: ``address_owners``, where known already): never
    loopback, never both ends on one host.  Duplicates of one event seen
    by two agents are counted once (the first, in the order of ``sources``)."""
    host_of = {h: i for i, h in enumerate(hosts)}
    owner = address_owners(sources, hosts) if owner is None else owner
    found = [_between_hosts(rows, source, owner) for rows, source in _tcp_chunks(sources)]
    if not found:
        return np.zeros(0, dtype=TCP_DTYPE)
    rows = _concat_rows([f[0] for f in found], TCP_EVENT)
    source, local, remote = (np.concatenate([f[k] for f in found]) for k in (1, 2, 3))
    first = np.sort(np.unique(_event_keys(rows), return_index=True)[1])
    rows = rows[first]
    out = np.zeros(len(first), dtype=TCP_DTYPE)
    host = np.array([host_of[s.recording.host] for s in sources], dtype=np.int64)
    out["host"] = host[source[first]]
    out["pid"], out["ts"] = rows["pid"], rows["ts_ns"]
    out["local"], out["remote"] = local[first], remote[first]
    out["event"], out["backoff"], out["known"] = rows["event"], rows["backoff"], rows["conn_known"]
    out["no_ack"] = np.where(rows["conn_known"] > 0, rows["no_ack_ns"].astype(np.int64), 0)
    out["rto"] = np.where(rows["conn_known"] > 0, rows["rto_us"].astype(np.int64) * 1000, 0)
    out["conn"] = connection_keys(rows)
    out["other"] = rows["other"]
    out["reason"] = rows["reason"]
    return out


def address_owners(sources: list[Source], hosts: tuple[str, ...]) -> dict[bytes, int]:
    """Each host's own addresses (16 bytes, IPv4 in the first 4) -> its
    index: those of the links its ranks use, and the one its own TCP rows
    leave from most."""
    host_of = {h: i for i, h in enumerate(hosts)}
    own: dict[int, bytes] = {}
    for rows, source in _tcp_chunks(sources):
        own.update(_own_addresses(sources, rows, source))
    owner: dict[bytes, int] = {}
    for s in sources:  # the addresses of the links its ranks use, where known
        for addr in _rank_link_addresses(s.recording):
            owner.setdefault(addr, host_of[s.recording.host])
    for i in sorted(own):
        owner.setdefault(own[i], host_of[sources[i].recording.host])
    return owner


# what tells a connection's fate (state changes are the rest of the table):
# its retransmits, its resets, and its state when the dump was taken
_FATE = np.zeros(256, dtype=bool)
_FATE[[TcpEvent.TCP_RETRANSMIT_SKB, TcpEvent.TCP_SEND_RESET, TcpEvent.TCP_RECEIVE_RESET,
       TcpEvent.TCP_INFO]] = True  # fmt: skip


def _rank_link_addresses(rec: Recording) -> list[bytes]:
    """The non-loopback addresses of the network interfaces the recording's
    ranks use (its links table, format 7 on): a host's own addresses even
    where none of its connections left a row."""
    ranks = {c.pid for c in rec.communicators}
    out = []
    for link in rec.links:
        if link.kind != "netdev" or not ranks & set(link.pids):
            continue
        for text in link.addresses:
            try:
                ip = ipaddress.ip_address(text.partition("/")[0].partition("%")[0])
            except ValueError:
                continue
            if not ip.is_loopback:
                out.append(addresses.pack(ip))
    return out


def _between_hosts(
    rows: np.ndarray, source: np.ndarray, owner: dict[bytes, int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Of TCP rows, the retransmits and resets between one host's own
    address and another's, with their sources and both hosts."""
    at = np.flatnonzero(_FATE[rows["event"]])  # the rows' fields gathered once, at the end
    fam, saddr, daddr = rows["family"][at], rows["saddr"][at], rows["daddr"][at]
    keep = ~addresses.is_loopback(saddr, fam) & ~addresses.is_loopback(daddr, fam)
    at, saddr, daddr = at[keep], saddr[keep], daddr[keep]
    local, remote = owner_of(saddr, owner), owner_of(daddr, owner)
    keep = (local >= 0) & (remote >= 0) & (local != remote)
    at = at[keep]
    return rows[at], source[at], local[keep], remote[keep]


_EVENT_KEY = np.dtype(
    [("saddr", "V16"), ("sport", "<u2"), ("daddr", "V16"), ("dport", "<u2"), ("ts", "<u8")]
)


def _event_keys(rows: np.ndarray) -> np.ndarray:
    """One retransmit as both agents of a connection record it: its ends and
    its time, as one bytes-comparable value per row."""
    keys = np.empty(len(rows), dtype=_EVENT_KEY)
    keys["saddr"], keys["daddr"] = _addr_keys(rows["saddr"]), _addr_keys(rows["daddr"])
    keys["sport"], keys["dport"], keys["ts"] = rows["sport"], rows["dport"], rows["ts_ns"]
    return keys.view(f"V{_EVENT_KEY.itemsize}")


def _sched(sources: list[Source], hosts: tuple[str, ...]) -> np.ndarray:
    host_of = {h: i for i, h in enumerate(hosts)}
    out = []
    for s in sources:
        ring = s.recording.rings.get("sched")
        if ring is None or not len(ring.rows):
            continue
        t = np.empty(len(ring.rows), dtype=SCHED_DTYPE)
        t["host"] = host_of[s.recording.host]
        t["pid"] = ring.rows["pid"]
        t["ts"] = ring.rows["ts_ns"].astype(np.int64)
        t["delay"] = ring.rows["delay_ns"].astype(np.int64)
        t["holder"] = ring.rows["prev_pid"].astype(np.int64)
        out.append(t)
    return _concat_rows(out, SCHED_DTYPE) if out else np.zeros(0, dtype=SCHED_DTYPE)


# An interface's counters that count failures (not traffic): their movement
# over the ring is evidence (dumpers.layout's names).
FAILURE_COUNTERS = tuple(
    n
    for n in LINK_COUNTERS
    if not n.endswith(("_packets", "_bytes", "_data", "multicast", "_wait"))
    and not n.startswith(("np_", "rp_"))
)


def _links(
    sources: list[Source], hosts: tuple[str, ...], procs: list[Proc]
) -> tuple[LinkFate, ...]:
    """Every host's interfaces from its link ring: when each lost its carrier
    and got it back, which failure counters moved, whether a rank uses it."""
    host_of = {h: i for i, h in enumerate(hosts)}
    ranks = {(p.host, p.pid) for p in procs}
    out: list[LinkFate] = []
    for s in sources:
        rec = s.recording
        ring = rec.rings.get("link")
        if ring is None or not len(ring.rows) or not rec.links:
            continue
        offset = rec.clock.realtime_ns - rec.clock.monotonic_ns if rec.clock.realtime_ns else 0
        for info in rec.links:
            rows = ring.rows[ring.rows["link"] == info.id]
            if not len(rows):
                continue
            rows = rows[np.argsort(rows["ts_ns"], kind="stable")]
            used = any((rec.host, pid) in ranks for pid in info.pids)
            out.append(
                LinkFate(
                    host_of[rec.host], info.name, info.kind, used,
                    _downs(rows, offset), _moved(rows),
                )
            )  # fmt: skip
    return tuple(out)


def _downs(rows: np.ndarray, offset: int) -> tuple[tuple[int, int | None], ...]:
    """(down after, up at or None) of each carrier loss the rows show."""
    out: list[tuple[int, int | None]] = []
    down: int | None = None
    for r in rows:
        carrier, event = int(r["carrier"]), int(r["event"])
        ts, after = int(r["ts_ns"]) + offset, int(r["after_ns"]) + offset
        if event == LinkEvent.CARRIER_FLAP:  # down and up between two samples
            out.append((after, ts))
        elif carrier == 0 and down is None:
            down = after if event == LinkEvent.CARRIER_DOWN else ts
        elif carrier == 1 and down is not None:
            out.append((down, ts))
            down = None
    if down is not None:
        out.append((down, None))
    return tuple(out)


def _moved(rows: np.ndarray) -> tuple[tuple[str, int], ...]:
    """Failure counters that grew between the first and the last row that knew them."""
    out = []
    for name in FAILURE_COUNTERS:
        values = rows[name]
        known = values[values != UNKNOWN_U64]
        if len(known) >= 2 and int(known[-1]) > int(known[0]):
            out.append((name, int(known[-1]) - int(known[0])))
    return tuple(out)

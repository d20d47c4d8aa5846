"""Stage "late": calls recorded from an agent's attach, aligned with their peers.

An agent that attaches while a job runs (a first rollout, a node whose agent
was down) never saw the communicators made before it: their calls carry the
communicator's pointer but no id (hash 0, ``dumpers.format``), and their seq
counts from the first call the agent saw.  Before anything is matched, this
stage puts each such *stream* (one process, one communicator pointer) into a
communicator the other dumps know, at the seq where it belongs:

- candidates: communicators with members no input holds (a slot the
  stream can fill), or, failing that, the other unknown streams;
- the offset: for each of the stream's first calls, the candidate's calls
  whose wall-clock entry (each host's clock, converted with its dump's
  sampled clock) is near it propose offsets; an offset holds when every call
  the two share has the same op, count, datatype, reduce op and root, at
  least ``MIN_OVERLAP`` of them; its skew is the median gap between the
  shared calls' entries;
- certain: the best offset's skew is under ``MAX_SKEW_NS`` and every other
  candidate (another offset, another communicator) is ``SEPARATION`` times
  further off (and by ``SEPARATION_FLOOR_NS``): a periodic job whose calls
  are closer together than clocks can tell apart is not aligned, and so is
  never judged on a guess;
- the stream's rank in the communicator: the rank its rows carry if the
  agent learned it, else the only slot left, else the only slot its
  point-to-point peers leave (a rank does not send to itself); failing all
  three, the process takes a free slot but its rank is reported unknown.

A stream no alignment is certain for is left out of the matching and
reported: the incident's verdicts then include ``inconclusive`` (never a
silent healthy).  Every verdict on a communicator a stream was aligned to
says so in its evidence.

Known limits: point-to-point calls of an aligned stream are left out (their
seq is per peer: not aligned); streams are aligned to communicators the
other dumps know, not with each other (two late ranks alone in a
communicator stay unaligned); a communicator split from one made before the
attach has no known id either and is aligned the same way.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable

import numpy as np

from stallwatch.dumpers.model import CommInfo, Recording, Ring
from stallwatch.dumpers.schema import Op, captured_rows, op_name

from .incident import Alignment, Incident, LateReport, Unaligned
from .streams import (
    COLLECTIVE,
    Fit,
    Known,
    Stream,
    choose,
    find_fits,
    nccl_rows,
    signatures,
    wall_clock,
)
from .unanchored import judge_streams
from .verdict import Verdict, VerdictKind, known_rank, rank_text

# ---- what the inputs hold ---------------------------------------------------


def has_late(recordings: Iterable[Recording]) -> bool:
    """Whether any recording holds a communicator whose id its agent could not know."""
    return any(not c.comm_hash for rec in recordings for c in rec.communicators)


def _late_streams(recs: list[Recording]) -> list[Stream]:
    out = []
    for i, rec in enumerate(recs):
        rows = nccl_rows(rec)
        rows = rows[rows["comm_hash"] == 0]
        rows = rows[rows["comm"] != 0]
        if not len(rows):
            continue
        keys = np.unique(rows[["pid", "comm"]])
        for pid, ptr in keys.tolist():
            mine = rows[(rows["pid"] == pid) & (rows["comm"] == ptr)]
            p2p = mine[np.isin(mine["op"], [Op.SEND, Op.RECV])]
            coll = mine[COLLECTIVE[mine["op"]] & ~captured_rows(mine)]
            coll = coll[np.argsort(coll["seq"], kind="stable")]
            ranks = coll["rank"][coll["rank"] >= 0]
            out.append(
                Stream(
                    i,
                    rec.host,
                    int(pid),
                    int(ptr),
                    coll,
                    wall_clock(rec, coll["ts_ns"]),
                    {int(p) for p in p2p["peer"].tolist()},
                    int(ranks[0]) if len(ranks) else -1,
                )
            )
    return out


def _known_comms(recs: list[Recording]) -> dict[int, Known]:
    infos: dict[int, dict[tuple[int, int], CommInfo]] = defaultdict(dict)
    for i, rec in enumerate(recs):
        for ci in rec.communicators:
            if ci.comm_hash:
                infos[ci.comm_hash][(i, ci.pid)] = ci
    out = {}
    for h, members in infos.items():
        seqs, sigs, walls = [], [], []
        evident = 0
        for (i, pid), _ in members.items():
            rows = nccl_rows(recs[i])
            rows = rows[(rows["comm_hash"] == np.uint64(h)) & (rows["pid"] == pid)]
            if len(rows):
                evident = max(evident, int(rows["peer"].max()) + 1)
            rows = rows[COLLECTIVE[rows["op"]] & ~captured_rows(rows)]
            seqs.append(rows["seq"].astype(np.int64))
            sigs.append(signatures(rows))
            walls.append(wall_clock(recs[i], rows["ts_ns"]))
        if not seqs or not sum(len(s) for s in seqs):
            continue
        seq, sig, wall = np.concatenate(seqs), np.concatenate(sigs), np.concatenate(walls)
        order = np.lexsort((wall, seq))
        seq, sig, wall = seq[order], sig[order], wall[order]
        uniq, first = np.unique(seq, return_index=True)
        med = np.array([np.median(w) for w in np.split(wall, first[1:])], dtype=np.int64)
        nranks = max(ci.nranks for ci in members.values())
        split = any(ci.parent_hash for ci in members.values()) or nranks < 0
        out[h] = Known(h, nranks, split, evident, dict(members), uniq, sig[first], med)
    return out


# ---- ranks --------------------------------------------------------------------------


def _free_slots(k: Known, size: int) -> set[int]:
    taken = {ci.rank for ci in k.members.values() if ci.rank >= 0}
    return set(range(size)) - taken


def _rank_of(s: Stream, free: set[int], guessed: bool) -> tuple[int, str]:
    """Its slot, and how it is known ("" when it is not: it takes the lowest
    free slot so that its calls are matched, but no rank is claimed).
    ``guessed``: a slot was given on no evidence already, so what is left
    proves nothing."""
    if s.rank >= 0 and s.rank in free:
        return s.rank, "its agent learned it"
    if len(free) == 1 and not guessed:
        return min(free), "the only slot no other member holds"
    left = free - s.peers
    if s.peers and len(left) == 1:
        return next(iter(left)), "the only free slot it did not send to or receive from"
    return min(free) if free else -1, ""


# ---- the stage ---------------------------------------------------------------------


def align(recs: list[Recording]) -> tuple[list[Recording], LateReport | None]:
    """The recordings with every stream that could be aligned moved into
    its communicator (rows and tables), and what was done."""
    if not has_late(recs):
        return recs, None
    streams = _late_streams(recs)
    known = _known_comms(recs)
    aligned: list[tuple[Stream, Fit, int | None]] = []
    unaligned: list[Unaligned] = []
    for s in streams:
        fits = [f for k in known.values() if _has_room(k) for f in find_fits(s, k)]
        best, runner, why = choose(fits)
        if best is None:
            unaligned.append(Unaligned(s.host, s.pid, s.ptr, len(s.rows), why, _flying(s)))
        else:
            aligned.append((s, best, runner))
    alignments = _assign_ranks(aligned, known)
    left = [
        s
        for s in streams
        if (s.host, s.pid, s.ptr) in {(u.host, u.pid, u.comm_ptr) for u in unaligned}
    ]
    return _rewrite(recs, alignments, known), LateReport(
        tuple(a for _, a in alignments),
        tuple(unaligned),
        judge_streams(recs, left) if left else None,
    )


def _flying(s: Stream) -> str:
    """Its latest call, if it is in flight: "ALL_GATHER seq 998 of its
    recording (seq from the attach) on communicator pointer 0x..."."""
    if not len(s.rows):
        return ""
    last = s.rows[np.argmax(s.rows["ts_ns"])]
    if int(last["end_ns"]) != 0:
        return ""
    return (
        f"{op_name(int(last['op']))} seq {int(last['seq'])} (counted from its agent's attach) "
        f"on communicator pointer {s.ptr:#x}"
    )


def _has_room(k: Known) -> bool:
    """Members no input holds: by the recorded size, or, for a split
    communicator (its size is not recorded), by the ranks its members named
    as roots and peers."""
    return len(k.members) < (k.evident if k.split else k.nranks)


def _size(k: Known, joining: int) -> int:
    return max(k.evident, len(k.members) + joining) if k.split else k.nranks


def _assign_ranks(
    aligned: list[tuple[Stream, Fit, int | None]], known: dict[int, Known]
) -> list[tuple[Stream, Alignment]]:
    by_comm: dict[int, list[tuple[Stream, Fit, int | None]]] = defaultdict(list)
    for item in aligned:
        by_comm[item[1].comm_hash].append(item)
    out = []
    for h, items in by_comm.items():
        k = known[h]
        size = _size(k, len(items))
        free = _free_slots(k, size) if not k.split else set(range(size))
        # those whose rank is learned or forced first: the others choose among what is left
        ordered = sorted(items, key=lambda x: (x[0].rank < 0, not x[0].peers, x[0].host, x[0].pid))
        guessed = False
        for s, fit, runner in ordered:
            rank, how = _rank_of(s, free, guessed)
            guessed = guessed or not how
            free.discard(rank)
            out.append(
                (
                    s,
                    Alignment(
                        s.host,
                        s.pid,
                        s.ptr,
                        h,
                        rank,
                        fit.offset,
                        fit.shared,
                        fit.skew_ns,
                        runner,
                        how,
                    ),
                )
            )
    return out


def _rewrite(
    recs: list[Recording], alignments: list[tuple[Stream, Alignment]], known: dict[int, Known]
) -> list[Recording]:
    recs = list(recs)
    per_source: dict[int, list[tuple[Stream, Alignment]]] = defaultdict(list)
    for s, a in alignments:
        per_source[s.source].append((s, a))
    ranks = _ranks_with_late(alignments, known)
    for i, items in per_source.items():
        rec = recs[i]
        rows = nccl_rows(rec).copy()
        comms = [c for c in rec.communicators if c.comm_hash]
        for s, a in items:
            k = known[a.comm_hash]
            rank = ranks.get((a.comm_hash, i, s.pid), -1)
            size = ranks.get((a.comm_hash, -1, -1), k.nranks)
            mine = (rows["pid"] == s.pid) & (rows["comm"] == s.ptr) & (rows["comm_hash"] == 0)
            coll = mine & COLLECTIVE[rows["op"]] & ~captured_rows(rows)
            rows["seq"][coll] += np.uint64(a.offset)
            rows["comm_hash"][coll] = a.comm_hash
            rows["rank"][coll], rows["nranks"][coll] = rank, size
            comms.append(CommInfo(s.pid, s.ptr, a.comm_hash, rank, size))
        ring = rec.rings["nccl"]
        rings = {**rec.rings, "nccl": Ring(rows, ring.overwritten, ring.lost)}
        recs[i] = dataclasses.replace(rec, rings=rings, communicators=tuple(comms))
    return _ranks_of_known(recs, ranks)


def _ranks_with_late(
    alignments: list[tuple[Stream, Alignment]], known: dict[int, Known]
) -> dict[tuple[int, int, int], int]:
    """(comm, source, pid) -> rank for every member of a communicator a
    stream joined; (comm, -1, -1) -> its size.  A split communicator's known
    members keep their order (key, rank in the parent) in the slots left."""
    out: dict[tuple[int, int, int], int] = {}
    joined: dict[int, list[tuple[Stream, Alignment]]] = defaultdict(list)
    for s, a in alignments:
        joined[a.comm_hash].append((s, a))
    for h, items in joined.items():
        k = known[h]
        size = _size(k, len(items))
        out[(h, -1, -1)] = size
        taken = set()
        for s, a in items:
            out[(h, s.source, s.pid)] = a.rank
            taken.add(a.rank)
        if k.split:
            free = iter(sorted(set(range(size)) - taken))
            order = sorted(k.members.items(), key=lambda m: (m[1].key, m[0]))
            for (i, pid), _ in order:
                out[(h, i, pid)] = next(free, -1)
    return out


def _ranks_of_known(
    recs: list[Recording], ranks: dict[tuple[int, int, int], int]
) -> list[Recording]:
    """Split communicators a stream joined: their known members get explicit
    ranks too (one order for all the communicator's members)."""
    out = []
    for i, rec in enumerate(recs):
        comms = []
        for c in rec.communicators:
            r = ranks.get((c.comm_hash, i, c.pid))
            if r is not None and c.rank < 0:
                c = dataclasses.replace(c, rank=r, nranks=ranks[(c.comm_hash, -1, -1)])
            comms.append(c)
        out.append(dataclasses.replace(rec, communicators=tuple(comms)))
    return out


# ---- verdicts -----------------------------------------------------------------------

EVIDENCE_LINES = 4  # alignments named per verdict (then how many more)


def amend(inc: Incident, verdicts: list[Verdict]) -> list[Verdict]:
    """Verdicts on a communicator a stream was aligned to say so; streams
    that could not be aligned make the incident ``inconclusive`` for them
    (and never healthy).  The order is kept (causes before consequences).
    An ``inconclusive`` that names only ranks whose calls could not be
    aligned (or no process holds, while an unaligned one's rank is unknown)
    is folded into the one saying why: those ranks did leave a dump."""
    report = inc.late
    if report is None:
        return verdicts
    out = [_with_alignments(v, report) for v in verdicts]
    named = _by_frontiers(inc, report)
    if named is not None:
        # the unaligned streams were judged among themselves: the hang they
        # show comes first; what could not be aligned is its evidence
        rest = [v for v in out if v.kind not in (VerdictKind.HEALTHY, VerdictKind.INCONCLUSIVE)]
        return [named, *rest]
    if report.unaligned:
        why = _inconclusive(inc, report.unaligned)
        folded = [v for v in out if _about(inc, v, why)]
        out = [v for v in out if v.kind is not VerdictKind.HEALTHY and v not in folded]
        seen = tuple(f"also {v.summary} (its unaligned calls may be theirs)" for v in folded)
        out.append(dataclasses.replace(why, evidence=(*why.evidence, *seen)))
    return out


def _by_frontiers(inc: Incident, report: LateReport) -> Verdict | None:
    """A hang named by the frontiers of streams no agent saw made."""
    u = report.unanchored
    if u is None or not u.culprits:
        return None
    world = {(p.host, p.pid): p.world_rank for p in inc.procs if p.world_rank >= 0}
    for h in inc.readings:  # a rank no recorded call names: its launcher's RANK
        for snap in h.snapshots:
            for proc in snap.processes:
                if proc.world_rank is not None:
                    world.setdefault((h.host, proc.pid), proc.world_rank)
    name = {p: f"rank {rank_text(r)} (host {p[0]}, pid {p[1]})" for p, r in world.items()}
    blocked = [w for w in u.waits if set(w.behind) & set(u.culprits)]
    # the headline: a wait only the culprits miss, of the fewest peers (the
    # subgroup's collective; the larger ones it blocks are consequences)
    main = min(
        blocked,
        key=lambda w: (
            not set(w.behind) <= set(u.culprits),
            len(w.behind) + len(w.waiting),
            -w.age_ns,
        ),
    )
    culprits = sorted(u.culprits, key=lambda p: (world.get(p, -1) < 0, world.get(p, -1), p))
    who = ", ".join(name.get(p, f"host {p[0]} pid {p[1]}") for p in culprits)
    waiters = sorted({(w.host, w.pid) for w in blocked})
    me = name.get((main.host, main.pid), f"host {main.host} pid {main.pid}")
    summary = (
        f"{who} never entered the {main.op} {me} waits in ({main.age_ns / 1e9:.1f} s); "
        f"{len(waiters)} rank(s) wait for it; by the frontiers of streams recorded from their "
        "agents' attach (no agent saw the communicators made)"
    )
    evidence = [w.text(name) for w in blocked][:EVIDENCE_LINES]
    evidence += [u_.text() for u_ in report.unaligned][:EVIDENCE_LINES]
    more = len(report.unaligned) - EVIDENCE_LINES
    if more > 0:
        evidence.append(f"and {more} more stream(s) not aligned to a communicator id")
    return Verdict(
        VerdictKind.MISSING_RANK,
        tuple(world.get(p, -1) for p in culprits),
        tuple(sorted({p[0] for p in culprits})),
        tuple(p[1] for p in culprits),
        None,
        None,
        main.op,
        summary,
        tuple(evidence),
    )


def _about(inc: Incident, v: Verdict, unaligned: Verdict) -> bool:
    """An ``inconclusive`` about the unaligned ranks only."""
    if v.kind is not VerdictKind.INCONCLUSIVE or not v.ranks:
        return False
    could_be = set(unaligned.ranks) - {None}
    if None in unaligned.ranks:
        held = {p.world_rank for p in inc.procs}
        could_be |= set(v.ranks) - held
    return set(v.ranks) <= could_be


def _with_alignments(v: Verdict, report: LateReport) -> Verdict:
    if v.kind is VerdictKind.HEALTHY:
        lines = [a.text() for a in report.aligned]
    elif v.comm_id_hash is not None:
        lines = [a.text() for a in report.on(int(v.comm_id_hash, 16))]
    else:
        lines = []
    if not lines:
        return v
    more = len(lines) - EVIDENCE_LINES
    shown = lines[:EVIDENCE_LINES] + ([f"and {more} more aligned the same way"] if more > 0 else [])
    return dataclasses.replace(v, evidence=(*v.evidence, *shown))


def _inconclusive(inc: Incident, unaligned: tuple[Unaligned, ...]) -> Verdict:
    world = {(p.host, p.pid): p.world_rank for p in inc.procs}
    hosts = tuple(sorted({u.host for u in unaligned}))
    pids = tuple(sorted({u.pid for u in unaligned}))
    known = {world.get((u.host, u.pid), -1) for u in unaligned}
    ranks = tuple(known_rank(r) for r in sorted(known, key=lambda r: (r < 0, r)))
    streams = len(unaligned)
    return Verdict(
        VerdictKind.INCONCLUSIVE,
        ranks,
        hosts,
        pids,
        None,
        None,
        None,
        f"{streams} communicator stream(s) of {len(pids)} process(es), recorded from their "
        "agent's attach, could not be aligned with the other members' calls: not judged",
        tuple(u.text() for u in unaligned),
    )

"""Stage "frontier": where each communicator's members stand, from matched calls.

Per communicator, the frontier is the highest seq any member entered; each
member is at it, behind it, or unknown (its ring wrapped, or no readable
dump holds it), with when its evidence was taken and what its peers'
completions prove it did.  A frontier is stuck when the ranks at it have
made no progress for long (``STALL_MIN_NS`` and 4x the communicator's p99
call duration, against each host's own dump time).  The missing-rank,
exit and inconclusive detectors, the culprits and the report read it.
Every time difference is taken between two timestamps of the same host.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from stallwatch.dumpers.schema import Op, State

from .incident import Frontier, Incident, Lag, Member, MemberState
from .match import Matched

ROOTED_OPS = np.array([Op.BROADCAST, Op.REDUCE, Op.GATHER, Op.SCATTER], dtype=np.uint8)
STALL_MIN_NS = 1_000_000_000  # a frontier older than this (and than 4x p99) is stuck
ASYNC_BELOW_NS = 1_000_000  # median call duration under which calls are taken as async
P99_SAMPLE = 1 << 20  # durations sampled for the stall threshold's p99


def stall_threshold(m: Matched, comm: int) -> int:
    """How long a communicator's frontier stands still before it is stuck:
    ``STALL_MIN_NS``, or 4x the p99 of its completed calls' durations."""
    sl = m.comm_rows(comm)
    end, ts = m.rows["end"][sl], m.rows["ts"][sl]
    done = end > 0
    if not done.any():
        return STALL_MIN_NS
    durations = (end - ts)[done]
    step = max(1, len(durations) // P99_SAMPLE)
    p99 = float(np.percentile(durations[::step], 99))
    return max(STALL_MIN_NS, int(4 * p99))


def _proven(inc: Incident, m: Matched, comm: int) -> int:
    """The last seq of a communicator that a member completed: a collective
    any member completed proves that every member entered it.  A call that
    returned proves it where calls complete at return: blocking calls (the
    communicator's returned calls take time), or a completion seen (state
    completed, Flight Recorder); an asynchronous return is only an enqueue."""
    if inc.ends_are_completions:
        return int(m.pair_last_returned[m.pairs_of(comm)].max())
    rows = m.rows[m.comm_rows(comm)]
    ok = (rows["end"] > 0) & (rows["result"] == 0)
    if not ok.any():
        return -1
    blocking = float(np.median((rows["end"] - rows["ts"])[ok])) >= ASYNC_BELOW_NS
    proof = ok if blocking else ok & (rows["state"] == State.COMPLETED)
    return int(rows["seq"][proof].max()) if proof.any() else -1


def _proven_by_all(inc: Incident, m: Matched, comm: int) -> int:
    """The last seq of a communicator that some member completed and that
    needs every member to complete: not a rooted op, which a non-root
    completes alone (a gather's source sends and returns)."""
    rows = m.rows[m.comm_rows(comm)]
    ok = (rows["end"] > 0) & (rows["result"] == 0) & ~np.isin(rows["op"], ROOTED_OPS)
    if not ok.any():
        return -1
    if not inc.ends_are_completions:
        blocking = float(np.median((rows["end"] - rows["ts"])[ok])) >= ASYNC_BELOW_NS
        ok &= True if blocking else rows["state"] == State.COMPLETED
    return int(rows["seq"][ok].max()) if ok.any() else -1


def frontiers(inc: Incident, m: Matched, proc_host: list[int]) -> tuple[Frontier, ...]:
    """The frontier of every communicator with rows, the per-member numbers
    taken for all pairs at once (an incident of 131,072 ranks has tens of
    thousands of communicators: no numpy call per member)."""
    pairs = int(m.pair_offset[-1])
    if not pairs or not len(m.rows):
        return ()
    last = m.pair_last_seq
    starts = m.pair_offset[:-1]
    sized = np.diff(m.pair_offset) > 0
    top = np.full(len(inc.comms), -1, dtype=np.int64)
    top[sized] = np.maximum.reduceat(last, starts[sized])
    comm_of = np.repeat(np.arange(len(inc.comms)), np.diff(m.pair_offset))
    row = m.pair_last_row
    has = row >= 0
    at = np.where(has, row, 0)
    r = m.rows
    flight = has & (r["end"][at] == 0)
    front = has & (r["seq"][at] == top[comm_of])
    host = np.array(proc_host, dtype=np.int64)[r["proc"][at]] if len(proc_host) else at * 0
    now = np.array([-1 if t is None else t for t in inc.host_now], dtype=np.int64)[host]
    age = now - np.maximum(r["ts"][at], r["end"][at])
    aged = front & (now >= 0)
    ops = r["op"][at]
    members = [p for c in inc.comms for p in c.members]
    complete = [p.window_complete for p in inc.procs]
    moment, exact = evidence_moments(inc, proc_host)
    offset = np.array([_offset(inc, h) for h in range(len(inc.hosts))], dtype=np.int64)[host]
    entered = np.where(has & (offset != NO_OFFSET), r["ts"][at] + offset, NO_OFFSET)
    out = []
    returned = (has & (r["state"][at] == State.ENQUEUED) & (r["end"][at] == 0)).tolist()
    cols = (last.tolist(), m.pair_last_returned.tolist(), flight.tolist(), front.tolist(),
            aged.tolist(), age.tolist(), ops.tolist(), returned)  # fmt: skip
    when = (
        [moment[h] for h in host.tolist()],
        [exact[h] for h in host.tolist()],
        entered.tolist(),
        returned,
    )
    for comm in np.flatnonzero(top >= 0).tolist():
        f = _frontier_of(inc, m, comm, int(top[comm]), members, complete, cols)
        out.append(_with_moments(inc, m, f, int(m.pair_offset[comm]), when))
    return tuple(_waits_behind(_older_elsewhere(out)))


def _older_elsewhere(fronts: list[Frontier]) -> list[Frontier]:
    """Members whose dump is proven older on one communicator marked so on
    every other: their peers' completions there prove they went on after
    their dumps were read, so where the dumps show them on any communicator
    is old too (a pipeline stage read before it forwarded, whose next stage
    waits in the broadcast it then never sent: the broadcast's root is not
    recorded, so its receiver's completions prove nothing of it)."""
    older = {m.proc for f in fronts for m in f.laggards if f.went_on(m)}
    out = []
    for f in fronts:
        if any(m.proc in older for m in f.laggards):
            members = tuple(
                dataclasses.replace(m, older_elsewhere=True) if m.proc in older else m
                for m in f.members
            )
            f = dataclasses.replace(f, members=members)
        out.append(f)
    return out


def _waits_behind(fronts: list[Frontier]) -> list[Frontier]:
    """Each stuck frontier that none left with the procs that wait for it
    from elsewhere (``Frontier.behind_it``): in flight at another such
    frontier one of whose laggards (its dump not proven older) stands at
    this one (ranks in the world's all_reduce wait for one blocked in its
    pair's collective), or further along such a chain.  A group of two has
    at most one member standing at its frontier; the ranks held behind it
    are what show it stood still."""
    held = [i for i, f in enumerate(fronts) if f.stuck and f.laggards and not f.left]
    if len(held) < 2:
        return fronts
    stands: dict[int, list[int]] = {}  # proc -> the held frontiers it stands at
    for i in held:
        for x in fronts[i].standing:
            stands.setdefault(x.proc, []).append(i)
    waiting_on: dict[int, set[int]] = {}  # frontier -> the frontiers that wait for it
    for i in held:
        # a laggard whose dump is proven older (it went on after it) does not
        # hold this frontier up from where its dump shows it
        for x in (x for x in fronts[i].laggards if fronts[i].lag(x) is not Lag.OLDER):
            for j in stands.get(x.proc, ()):
                if j != i:
                    waiting_on.setdefault(j, set()).add(i)
    out = list(fronts)
    for j in waiting_on:
        chain, todo = {j}, [j]
        while todo:
            for k in waiting_on.get(todo.pop(), ()):
                if k not in chain:
                    chain.add(k)
                    todo.append(k)
        own = {x.proc for x in fronts[j].standing}
        behind = {x.proc for k in chain - {j} for x in fronts[k].standing} - own
        out[j] = dataclasses.replace(fronts[j], behind_it=tuple(sorted(behind)))
    return out


def _ended_before(m: Matched, comm: int, f: int) -> bool:
    """Whether a collective of ``comm`` before its frontier ``f`` ended on a
    member: every member took part in it, so a member whose window holds
    none of the communicator's calls has a record that is not all it did
    (a Flight Recorder file that lost its entries, a ring that lost rows):
    unknown, never proof that it did not enter."""
    r = m.rows
    lo, hi = np.searchsorted(r["comm"], [comm, comm + 1])
    part = r[int(lo) : int(hi)]
    return bool(((part["seq"] < f) & (part["end"] != 0)).any())


NO_OFFSET = np.iinfo(np.int64).min  # a host whose clock cannot be read as wall clock


def _offset(inc: Incident, host: int) -> int:
    off = inc.to_wall(host)
    return NO_OFFSET if off is None else off


def evidence_moments(inc: Incident, proc_host: list[int]) -> tuple[list[int | None], list[bool]]:
    """Per host: when its evidence was taken, wall clock, and whether that is
    exact: a dump's capture time, else its latest timestamp (a lower bound:
    Flight Recorder records no dump time); None where its clock is unknown."""
    n = len(inc.hosts)
    captured = list(inc.captured) if inc.captured else [None] * n
    latest = np.full(n, -1, dtype=np.int64)
    rows = inc.calls.rows
    if any(c is None for c in captured) and len(rows) and proc_host:
        host = np.asarray(proc_host, dtype=np.int64)[rows["proc"]]
        np.maximum.at(latest, host, np.maximum(rows["ts"], rows["end"]))
    moments: list[int | None] = []
    for h in range(n):
        off = inc.to_wall(h)
        if captured[h] is not None:
            moments.append(captured[h])
        elif off is not None and latest[h] >= 0:
            moments.append(int(latest[h]) + off)
        else:
            moments.append(None)
    return moments, [c is not None for c in captured]


def _with_moments(
    inc: Incident,
    m: Matched,
    f: Frontier,
    lo: int,
    when: tuple[list[int | None], list[bool], list[int], list[bool]],
) -> Frontier:
    """The frontier with when each member's evidence was taken, when the
    frontier began and what completions prove: only where a member lags
    (a world of 131,072 members that all agree needs none of it)."""
    if not f.laggards:
        return f
    moment, exact, entered, returned = when
    members = tuple(
        x
        if x.proc < 0
        else dataclasses.replace(
            x,
            moment=moment[lo + x.crank],
            moment_exact=exact[lo + x.crank],
            returned=returned[lo + x.crank],
        )
        for x in f.members
    )
    began = [
        entered[lo + x.crank]
        for x in f.members
        if x.state is MemberState.AT_FRONTIER and entered[lo + x.crank] != NO_OFFSET
    ]
    return dataclasses.replace(
        f,
        members=members,
        proven=_proven_by_all(inc, m, f.comm),
        began=min(began) if began else None,
    )


def _frontier_of(
    inc: Incident,
    m: Matched,
    comm: int,
    f: int,
    members: list[int],
    complete: list[bool],
    cols: tuple[
        list[int], list[int], list[bool], list[bool], list[bool], list[int], list[int], list[bool]
    ],
) -> Frontier:
    last, ret, flight, front, aged, age, ops, returned = cols
    lo, hi = int(m.pair_offset[comm]), int(m.pair_offset[comm + 1])
    unseen = any(p < 0 for p in inc.comms[comm].members)
    proven = _proven(inc, m, comm) if unseen else -1
    out = []
    ages: list[int] = []
    op = 0
    flying = False
    for p in range(lo, hi):
        proc, seq, in_flight = members[p], last[p], flight[p]
        if proc < 0:
            state, seq, in_flight = MemberState.NO_DUMP, proven, False
        elif seq == f:
            flying |= in_flight
            state = MemberState.AT_FRONTIER
            if front[p]:
                op = ops[p]
                if aged[p]:
                    ages.append(age[p])
        elif seq >= 0:
            state = MemberState.BEHIND
        elif complete[proc] and not _ended_before(m, comm, f):
            state = MemberState.NO_ROWS
        else:
            state = MemberState.UNKNOWN
        out.append(Member(p - lo, proc, state, seq, ret[p], in_flight, returned=returned[p]))
    median = int(np.median(ages)) if ages else None
    # no dump time (Flight Recorder): stuck while a call is pending there
    stuck = flying if median is None else median >= stall_threshold(m, comm)
    return Frontier(comm, f, op, stuck, median, tuple(out))

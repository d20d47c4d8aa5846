"""Communicator and world ranks, from what every member recorded.

One home for the rule, used by the SQL tables and by the analyzer alike:

- a communicator made by ``ncclCommInitRank*`` knows each member's rank
  and its size (the probe reads them; any member's init tells the size);
- one made by ``ncclCommSplit`` does not (the rank is inside NCCL's opaque
  communicator): NCCL orders the members of each new communicator by (key,
  rank in the parent), so the ranks follow from every member's key and
  parent rank, the parent's rank itself possibly derived (a split of a
  split);
- a process's world rank is its rank in the largest non-split communicator
  it belongs to (on a tie, the one with the lowest id).

Where a parent's members all left a recording, so did every member of its
splits: they are ranked exactly.  Where some did not (a node's dump lost,
one agent's recording alone), a split's members present are still in
NCCL's order, but where the absent ones fall in it is not known.  Its size
and its members' ranks then come from every source that tells them, never
from counting the members present:

- every member of the parent takes part in each of its splits, so the
  splits of one call (their ids say which: ``schema.split_hash``) share the
  parent's absent members between them;
- a split holds more ranks than the highest its members named in calls
  that succeeded, and a member holds none of the ranks its own calls prove
  it does not (``dumpers.rankevidence``);
- the members present keep NCCL's order.

A rank these allow one value for is known; otherwise it is unknown (None),
never the next free one.  A rank no input holds has a known owner (world
rank) only where exactly one absent member of the parent can fill it.

``Ranks.of`` is the one derivation of a rank's identity over the
recordings of one incident, used by the SQL tables (``query``, ``serve``),
the Parquet export, the fan-out's client and the Perfetto trace alike, as
the analyzer uses ``resolve``: a member is a (host, pid) pair (a Flight
Recorder file: its name, pid 0 for unknown), its world rank the one its
input names (a Flight Recorder dump's global rank) or else derived as
above.

Members are keyed by whatever the caller uses for a process (the analyzer's
proc index, the SQL layer's (host, pid)); keys must order, as a last tie
break that keeps the result independent of input order.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from . import rankevidence
from .model import CommInfo, Recording
from .rankevidence import Evidence
from .schema import split_hash

K = TypeVar("K", int, tuple[str, int])
Member = tuple[str, int]  # (host, pid)

UNKNOWN_PARENT_RANK = 1 << 30  # sorts a member whose parent rank is unknown last
# a split's index among its parent's splits is searched up to the member's
# own count of them and this far beyond (splits it made with no color leave
# no communicator of its own)
SPLIT_INDEX_SEARCH = 64


@dataclass(frozen=True, slots=True)
class CommMembers(Generic[K]):
    """One communicator's members as far as the evidence tells.

    Exact (every rank and the size known): ``slots[r]`` is the member of
    comm rank r, None where no input holds it.  Otherwise ``slots`` holds
    the members present in NCCL's order, then one None per member known to
    be absent (one if there may be more, none known).  ``ranks`` is each
    slot's comm rank (None: unknown); ``size`` the communicator's size
    (None: unknown, at least ``size_min``); ``owners`` the world rank of
    each slot no input holds, where it can be told."""

    slots: tuple[K | None, ...]
    ranks: tuple[int | None, ...]
    size: int | None
    size_min: int
    owners: tuple[int | None, ...] = ()

    @property
    def exact(self) -> bool:
        return self.size is not None and self.ranks == tuple(range(self.size))

    def owner(self, slot: int) -> int | None:
        return self.owners[slot] if slot < len(self.owners) else None


def _exact(slots: Sequence[K | None]) -> CommMembers[K]:
    n = len(slots)
    return CommMembers(tuple(slots), tuple(range(n)), n, n)


@dataclass(frozen=True, slots=True)
class Membership(Generic[K]):
    """Every communicator's members (``comms``); ``split`` the ids of split
    communicators."""

    comms: dict[int, CommMembers[K]]
    split: frozenset[int]

    @property
    def members(self) -> dict[int, tuple[K | None, ...]]:
        """Communicator id -> its slots (``CommMembers.slots``)."""
        return {h: c.slots for h, c in self.comms.items()}

    def ranks(self) -> dict[tuple[K, int], int]:
        """(member, communicator id) -> rank in that communicator, where known."""
        return {
            (k, h): r
            for h, c in self.comms.items()
            for k, r in zip(c.slots, c.ranks, strict=True)
            if k is not None and r is not None
        }

    def sizes(self) -> dict[int, int]:
        """Communicator id -> its size, where known."""
        return {h: c.size for h, c in self.comms.items() if c.size is not None}

    def uncertain(self) -> frozenset[int]:
        """Split communicators whose ranks or size are not all known."""
        return frozenset(h for h in self.split if not self.comms[h].exact)

    def world_ranks(self) -> dict[K, int]:
        """Member -> its rank in the largest non-split communicator it is in."""
        best: dict[K, tuple[int, int, int]] = {}
        for h, c in self.comms.items():
            if h in self.split:
                continue
            for k, r in zip(c.slots, c.ranks, strict=True):
                if k is None or r is None:
                    continue
                cand = (-len(c.slots), h, r)
                if k not in best or cand < best[k]:
                    best[k] = cand
        return {k: b[2] for k, b in best.items()}


Evidences = Mapping[tuple[K, int], Evidence]


def resolve(
    entries: Iterable[tuple[K, CommInfo]], evidence: Evidences[K] | None = None
) -> Membership[K]:
    """Every communicator's members, from (member, CommInfo) pairs (several
    pairs of one member and communicator are one) and what members' own
    calls tell (``evidence``: (member, communicator id) -> Evidence)."""
    infos: dict[int, dict[K, CommInfo]] = defaultdict(dict)
    for k, ci in entries:
        if ci.comm_hash:
            known = infos[ci.comm_hash].get(k)
            if known is None or (known.rank < 0 <= ci.rank):
                infos[ci.comm_hash][k] = ci
    split = frozenset(h for h, ms in infos.items() if any(ci.parent_hash for ci in ms.values()))
    ev: Evidences[K] = evidence or {}
    comms: dict[int, CommMembers[K]] = {}
    for h in sorted(infos):
        if all(ci.rank >= 0 for ci in infos[h].values()):
            comms[h] = _by_rank(infos[h], ev, h)
    _world_owners(comms, split)
    for group in _sibling_groups(infos, set(infos) - set(comms)):
        comms.update(_split_call(infos, group, comms, ev))
    return Membership(comms, split)


def _by_rank(lst: dict[K, CommInfo], ev: Evidences[K], h: int) -> CommMembers[K]:
    named = max((ev[(k, h)].named for k in lst if (k, h) in ev), default=-1)
    nranks = max(ci.nranks for ci in lst.values())
    size = max(nranks, max(ci.rank for ci in lst.values()) + 1, named + 1)
    out: list[K | None] = [None] * size
    for k in sorted(lst):
        r = lst[k].rank
        if out[r] is None:
            out[r] = k
    return _exact(out)


def _world_owners(comms: dict[int, CommMembers[K]], split: frozenset[int]) -> None:
    """A rank of the world communicator (the largest non-split one) that no
    input holds is that world rank."""
    ranked = [h for h in comms if h not in split]
    if not ranked:
        return
    top = max(len(comms[h].slots) for h in ranked)
    for h in ranked:
        c = comms[h]
        if len(c.slots) == top and None in c.slots:
            owners = tuple(r if k is None else None for r, k in enumerate(c.slots))
            comms[h] = CommMembers(c.slots, c.ranks, c.size, c.size_min, owners)


def _parents_first(infos: dict[int, dict[K, CommInfo]], todo: set[int]) -> list[int]:
    """The communicators ``todo``, each after the communicators it was split
    from."""
    order: list[int] = []
    seen: set[int] = set()

    def visit(h: int) -> None:
        if h in seen:
            return
        seen.add(h)
        for ci in infos[h].values():
            if ci.parent_hash in infos:
                visit(ci.parent_hash)
        order.append(h)

    for h in sorted(todo):
        visit(h)
    return [h for h in order if h in todo]


def _split_calls(infos: dict[int, dict[K, CommInfo]], todo: set[int]) -> dict[int, tuple[int, int]]:
    """Split communicator -> (its parent, which of the parent's splits made
    it, 0-based), from its id: the same on every member
    (``schema.split_hash``).  Left out where no member's color gives its id
    (an agent that attached after some splits counts from its attach)."""
    made: dict[tuple[K, int], list[tuple[int, int]]] = defaultdict(list)
    for h in todo:
        for k, ci in infos[h].items():
            made[(k, ci.parent_hash)].append((ci.init_ns, h))
    place = {(k, h): i for (k, _), hs in made.items() for i, (_, h) in enumerate(sorted(hs))}
    out: dict[int, tuple[int, int]] = {}
    for h in todo:
        k = min(infos[h])
        ci = infos[h][k]
        if ci.color < 0:
            continue
        at = place[(k, h)]  # its own count of the parent's splits: about the index
        for i in range(at + SPLIT_INDEX_SEARCH):
            if split_hash(ci.parent_hash, ci.color, i) == h:
                out[h] = (ci.parent_hash, i)
                break
    return out


def _sibling_groups(infos: dict[int, dict[K, CommInfo]], todo: set[int]) -> list[list[int]]:
    """The split communicators ``todo`` in groups, one per split call (same
    parent, same split index: between them they hold the parent's members),
    each group after the groups its parents are in."""
    calls = _split_calls(infos, todo)
    by_call: dict[tuple[int, int], list[int]] = defaultdict(list)
    for h, call in calls.items():
        by_call[call].append(h)
    groups: list[list[int]] = []
    placed: set[int] = set()
    for h in _parents_first(infos, todo):
        if h in placed:
            continue
        group = sorted(by_call[calls[h]]) if h in calls else [h]
        groups.append(group)
        placed.update(group)
    return groups


@dataclass(slots=True)
class _Split(Generic[K]):
    """One split communicator while its ranks are solved: its members
    present in NCCL's order, whether that order is sure, and the bounds of
    its size."""

    order: list[K]
    sure: bool
    lo: int
    hi: int | None = None
    domains: list[list[int]] | None = None


def _split_call(
    infos: dict[int, dict[K, CommInfo]],
    group: list[int],
    comms: dict[int, CommMembers[K]],
    ev: Evidences[K],
) -> dict[int, CommMembers[K]]:
    """The communicators one split call made, solved together: they share
    the parent's absent members."""
    parent_hash = next(iter(infos[group[0]].values())).parent_hash
    parent = comms.get(parent_hash)
    pos = {k: i for i, k in enumerate(parent.slots) if k is not None} if parent else {}
    absent = None
    if parent is not None and parent.size is not None:
        absent = parent.size - len(pos)
    splits = {h: _ordered(infos[h], pos, ev, h) for h in group}
    if absent == 0 and all(s.sure and s.lo == len(s.order) for s in splits.values()):
        return {h: _exact(s.order) for h, s in splits.items()}  # every member is here
    for _ in range(3):  # bounds tighten each other through the shared absent members
        claimed = sum(s.lo - len(s.order) for s in splits.values())  # absent ones, at least
        for h, s in splits.items():
            own = s.lo - len(s.order)
            s.hi = None if absent is None else len(s.order) + absent - (claimed - own)
            if s.hi is not None and s.hi < s.lo:
                s.hi = None  # the evidence contradicts itself: nothing is sure
            s.domains = _solve(s, ev, h)
            if s.domains is not None and s.domains[-1]:
                s.lo = max(s.lo, s.domains[-1][0] + 1)
            claimed += s.lo - len(s.order) - own
    out = {h: _members(s) for h, s in splits.items()}
    return _owned(out, parent, absent)


def _ordered(lst: dict[K, CommInfo], pos: dict[K, int], ev: Evidences[K], h: int) -> _Split[K]:
    def key(k: K) -> tuple[int, int]:
        return (lst[k].key, pos.get(k, UNKNOWN_PARENT_RANK))

    order = sorted(lst, key=lambda k: (*key(k), k))
    keys = [key(k) for k in order]
    # two members of one key whose parent ranks are unknown: their order is not
    sure = all(a != b or a[1] != UNKNOWN_PARENT_RANK for a, b in itertools.pairwise(keys))
    named = max((ev[(k, h)].named for k in order if (k, h) in ev), default=-1)
    return _Split(order, sure, max(len(order), named + 1))


def _solve(s: _Split[K], ev: Evidences[K], h: int) -> list[list[int]] | None:
    """Each member's possible ranks: from its place in NCCL's order, the
    size's bound, and the ranks it is proven not to hold; None when nothing
    bounds them (the size has no bound, or the order is not sure)."""
    if s.hi is None or not s.sure:
        return None
    extra = s.hi - len(s.order)
    domains = []
    for i, k in enumerate(s.order):
        no = ev[(k, h)].not_ranks if (k, h) in ev else frozenset()
        domains.append([r for r in range(i, i + extra + 1) if r not in no])
    changed = True
    while changed:  # members keep their order: each bounds its neighbours
        changed = False
        for i in range(1, len(domains)):
            lo = domains[i - 1][0] + 1 if domains[i - 1] else 0
            kept = [r for r in domains[i] if r >= lo]
            changed |= len(kept) != len(domains[i])
            domains[i] = kept
        for i in range(len(domains) - 2, -1, -1):
            hi = domains[i + 1][-1] - 1 if domains[i + 1] else -1
            kept = [r for r in domains[i] if r <= hi]
            changed |= len(kept) != len(domains[i])
            domains[i] = kept
        if any(not d for d in domains):
            return None  # the evidence contradicts itself: nothing is sure
    return domains


def _members(s: _Split[K]) -> CommMembers[K]:
    ranks: list[int | None] = [None] * len(s.order)
    if s.domains is not None:
        ranks = [d[0] if len(d) == 1 else None for d in s.domains]
    size = s.hi if s.hi is not None and s.hi == s.lo and s.domains is not None else None
    if size is not None and None not in ranks:
        slots: list[K | None] = [None] * size
        for k, r in zip(s.order, ranks, strict=True):
            if r is not None:
                slots[r] = k
        return _exact(slots)
    more: int
    if size is not None:
        more = size - len(s.order)
    elif s.lo > len(s.order):
        more = s.lo - len(s.order)
    else:
        more = 0 if s.hi is not None and s.hi <= len(s.order) else 1
    present: list[K | None] = list(s.order)
    present += [None] * more
    ranks += [None] * more
    return CommMembers(tuple(present), tuple(ranks), size, s.lo)


def _owned(
    out: dict[int, CommMembers[K]], parent: CommMembers[K] | None, absent: int | None
) -> dict[int, CommMembers[K]]:
    """The owner of a split's one slot no input holds, where the parent has
    exactly one absent member it can be (every split's size known)."""
    if parent is None or absent != 1 or any(c.size is None for c in out.values()):
        return out
    holes = [(h, i) for h, c in out.items() for i, k in enumerate(c.slots) if k is None]
    world = [parent.owner(i) for i, k in enumerate(parent.slots) if k is None]
    if len(holes) != 1 or len(world) != 1 or world[0] is None:
        return out
    (h, i), c = holes[0], out[holes[0][0]]
    owners = tuple(world[0] if j == i else None for j in range(len(c.slots)))
    return out | {h: CommMembers(c.slots, c.ranks, c.size, c.size_min, owners)}


@dataclass(frozen=True, slots=True)
class Ranks:
    """Communicator and world ranks known over a set of recordings (one
    incident's, or every recording queried together): unknown rather than
    guessed."""

    comm: dict[tuple[Member, int], int]  # ((host, pid), comm hash) -> rank
    nranks: dict[int, int]  # comm hash -> size, where known
    world: dict[Member, int]

    @classmethod
    def of(
        cls,
        recordings: Iterable[Recording],
        evidence: Mapping[tuple[Member, int], Evidence] | None = None,
    ) -> Ranks:
        """Over recordings; ``evidence`` where their NCCL rings are not
        loaded (read from them otherwise, where a split needs it)."""
        recs = list(recordings)
        entries = [((r.host, c.pid), c) for r in recs for c in r.communicators]
        found = resolve(entries, evidence)
        if evidence is None and found.uncertain():
            found = resolve(entries, evidence_of(recs, found.uncertain()))
        named = {
            (r.host, p.pid): p.world_rank
            for r in recs
            for p in r.processes
            if p.world_rank is not None and p.world_rank >= 0
        }
        return cls(found.ranks(), found.sizes(), found.world_ranks() | named)

    def world_of(self, host: str) -> dict[int, int]:
        """pid -> world rank, of one host's members."""
        return {pid: r for (h, pid), r in self.world.items() if h == host}

    def merged(self, other: Ranks) -> Ranks:
        """Both incidents' ranks (members of one are never the other's)."""
        return Ranks(self.comm | other.comm, self.nranks | other.nranks, self.world | other.world)


def evidence_of(
    recs: Iterable[Recording], hashes: Iterable[int]
) -> dict[tuple[Member, int], Evidence]:
    """(member, communicator id) -> Evidence, from the NCCL rings the
    recordings hold, for the communicators ``hashes``."""
    wanted = set(hashes)
    out: dict[tuple[Member, int], Evidence] = {}
    for rec in recs:
        ring = rec.rings.get("nccl")
        if ring is None or not wanted & {c.comm_hash for c in rec.communicators}:
            continue
        for (pid, h), ev in rankevidence.ring_evidence(ring.rows, wanted).items():
            key = ((rec.host, pid), h)
            out[key] = out[key].merged(ev) if key in out else ev
    return out


def uncertain_splits(recordings: Iterable[Recording]) -> frozenset[int]:
    """Split communicators whose ranks the communicator tables alone do not
    tell (a member's recording is not among them): where reading the NCCL
    rings for evidence may tell more."""
    entries = [((r.host, c.pid), c) for r in recordings for c in r.communicators]
    if _every_member_here(entries):
        return frozenset()  # every parent complete: every split is ranked exactly
    return resolve(entries).uncertain()


def _every_member_here(entries: list[tuple[Member, CommInfo]]) -> bool:
    """Whether every communicator whose size is recorded has all its members
    here, and every split's parent is here: the common case, told without
    deriving anything."""
    members: dict[int, set[Member]] = defaultdict(set)
    size: dict[int, int] = {}
    parents = set()
    for k, ci in entries:
        if not ci.comm_hash:
            continue
        members[ci.comm_hash].add(k)
        if ci.parent_hash:
            parents.add(ci.parent_hash)
        elif ci.rank >= 0:
            size[ci.comm_hash] = max(size.get(ci.comm_hash, 0), ci.nranks, ci.rank + 1)
    if not parents <= set(size):
        return False
    return all(len(members[h]) >= n for h, n in size.items())


def of_dumps(dumps: Iterable[tuple[str, Recording]]) -> Ranks:
    """``Ranks.of`` over (path, recording) pairs whose NCCL rings may have
    been left in their files (a first pass over headers): where the
    communicator tables leave a split uncertain, the rings of the dumps that
    hold its members are read for evidence (a dump that cannot be read tells
    nothing)."""
    from .errors import DumpError
    from .format import read_dump

    pairs = list(dumps)
    recs = [r for _, r in pairs]
    uncertain = uncertain_splits(recs)
    if not uncertain:
        return Ranks.of(recs, {})
    evidence: dict[tuple[Member, int], Evidence] = {}
    for path, rec in pairs:
        if not uncertain & {c.comm_hash for c in rec.communicators}:
            continue
        if "nccl" not in rec.rings:
            try:
                rec = read_dump(path)
            except (DumpError, OSError):
                continue
        evidence.update(evidence_of([rec], uncertain))
    return Ranks.of(recs, evidence)

"""Communicator ranks and world ranks, from what every member recorded.

One home for the rule, used by the SQL tables and by the analyzer alike:

- a communicator made by ``ncclCommInitRank*`` knows each member's rank (the
  probe reads it);
- one made by ``ncclCommSplit`` does not (the rank is inside NCCL's opaque
  communicator): NCCL orders the members of each new communicator by (key,
  rank in the parent), so the ranks follow from every member's key and
  parent rank, the parent's rank itself possibly derived (a split of a
  split);
- a process's world rank is its rank in the largest non-split communicator
  it belongs to (on a tie, the one with the lowest id).

``Ranks.of`` is the one derivation of a rank's identity over the
recordings of one incident, used by the SQL tables (``query``, ``serve``),
the Parquet export, the fan-out's client and the Perfetto trace alike: a
member is a (host, pid) pair (a Flight Recorder file: its name, pid 0 for
unknown), its world rank the one its input names (a Flight Recorder dump's
global rank) or else derived as above, exactly (unknown rather than guessed).

Members are keyed by whatever the caller uses for a process (the analyzer's
proc index, the SQL layer's (host, pid)); keys must order, as a last tie
break that keeps the result independent of input order.

Known limit: a split communicator's ranks are derived from the members
given.  A member whose recording is missing is not counted, so the ranks of
those after it come out one lower.  With ``exact`` (the SQL tables), a split
communicator is ranked only when every member of its parent is present (then
so is every member of the split): one node's recording alone (a live agent)
leaves the ranks of a split whose members span nodes unknown rather than
guess.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from .model import CommInfo, Recording

K = TypeVar("K", int, tuple[str, int])
Member = tuple[str, int]  # (host, pid)

UNKNOWN_PARENT_RANK = 1 << 30  # sorts a member whose parent rank is unknown last


@dataclass(frozen=True, slots=True)
class Membership(Generic[K]):
    """``members[h][r]`` is the member of rank r in communicator h (None when
    no input holds that rank); ``split`` the ids of split communicators."""

    members: dict[int, tuple[K | None, ...]]
    split: frozenset[int]

    def ranks(self) -> dict[tuple[K, int], int]:
        """(member, communicator id) -> rank in that communicator."""
        return {
            (k, h): r for h, ms in self.members.items() for r, k in enumerate(ms) if k is not None
        }

    def world_ranks(self) -> dict[K, int]:
        """Member -> its rank in the largest non-split communicator it is in."""
        best: dict[K, tuple[int, int, int]] = {}
        for h, ms in self.members.items():
            if h in self.split:
                continue
            for r, k in enumerate(ms):
                cand = (-len(ms), h, r)
                if k is not None and (k not in best or cand < best[k]):
                    best[k] = cand
        return {k: b[2] for k, b in best.items()}


def resolve(entries: Iterable[tuple[K, CommInfo]], exact: bool = False) -> Membership[K]:
    """Every communicator's members in rank order, from (member, CommInfo)
    pairs (several pairs of one member and communicator are one).

    With ``exact``, a split communicator is ranked only when every member
    of its parent is present; otherwise from the members given."""
    infos: dict[int, dict[K, CommInfo]] = defaultdict(dict)
    for k, ci in entries:
        if ci.comm_hash:
            known = infos[ci.comm_hash].get(k)
            if known is None or (known.rank < 0 <= ci.rank):
                infos[ci.comm_hash][k] = ci
    split = frozenset(h for h, ms in infos.items() if any(ci.parent_hash for ci in ms.values()))
    members: dict[int, tuple[K | None, ...]] = {}
    for h in sorted(infos, key=lambda h: (h in split, h)):
        if all(ci.rank >= 0 for ci in infos[h].values()):
            members[h] = _by_rank(infos[h])
    for h in _parents_first(infos, set(infos) - set(members)):
        members[h] = _by_split_order(infos[h], members, exact)
    return Membership(members, split)


def _by_rank(lst: dict[K, CommInfo]) -> tuple[K | None, ...]:
    nranks = max(ci.nranks for ci in lst.values())
    size = max(nranks, max(ci.rank for ci in lst.values()) + 1)
    out: list[K | None] = [None] * size
    for k in sorted(lst):
        r = lst[k].rank
        if out[r] is None:
            out[r] = k
    return tuple(out)


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


def _by_split_order(
    lst: dict[K, CommInfo], members: dict[int, tuple[K | None, ...]], exact: bool
) -> tuple[K | None, ...]:
    """NCCL's order for a split: (key, rank in the parent)."""

    def parent_rank(k: K, ci: CommInfo) -> int:
        parent = members.get(ci.parent_hash, ())
        return parent.index(k) if k in parent else UNKNOWN_PARENT_RANK

    if exact and not all(_complete(members.get(ci.parent_hash)) for ci in lst.values()):
        return (None,) * max(ci.nranks for ci in lst.values())
    keyed = {k: (ci.key, parent_rank(k, ci), k) for k, ci in lst.items()}
    return tuple(sorted(lst, key=keyed.__getitem__))


def _complete(members: tuple[K | None, ...] | None) -> bool:
    return members is not None and None not in members


@dataclass(frozen=True, slots=True)
class Ranks:
    """Communicator and world ranks known over a set of recordings (one
    incident's, or every recording queried together), exact: unknown
    rather than guessed."""

    comm: dict[tuple[Member, int], int]  # ((host, pid), comm hash) -> rank
    nranks: dict[int, int]  # comm hash -> size, where every rank is known
    world: dict[Member, int]

    @classmethod
    def of(cls, recordings: Iterable[Recording]) -> Ranks:
        recs = list(recordings)
        entries = [((r.host, c.pid), c) for r in recs for c in r.communicators]
        found = resolve(entries, exact=True)
        sizes = {h: len(m) for h, m in found.members.items() if m and None not in m}
        named = {
            (r.host, p.pid): p.world_rank
            for r in recs
            for p in r.processes
            if p.world_rank is not None and p.world_rank >= 0
        }
        return cls(found.ranks(), sizes, found.world_ranks() | named)

    def world_of(self, host: str) -> dict[int, int]:
        """pid -> world rank, of one host's members."""
        return {pid: r for (h, pid), r in self.world.items() if h == host}

    def merged(self, other: Ranks) -> Ranks:
        """Both incidents' ranks (members of one are never the other's)."""
        return Ranks(self.comm | other.comm, self.nranks | other.nranks, self.world | other.world)

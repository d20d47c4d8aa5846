"""Verdicts: a closed enum, most severe first, and the record each carries.

Unknown stays unknown: a world rank, comm rank or pid that no input tells is
``None`` in a verdict (null in JSON, "unknown" in text), never the tables'
sentinels (-1 for a rank, 0 for a pid a Flight Recorder file does not name).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class VerdictKind(enum.Enum):
    MISSING_RANK = "missing_rank"
    DESYNC = "desync"
    RANK_EXITED = "rank_exited"
    NETWORK_PARTITION = "network_partition"  # a cut, a link down, a flap, resets
    COMPUTE_STRAGGLER = "compute_straggler"
    NETWORK_STRAGGLER = "network_straggler"
    CPU_INTERFERENCE = "cpu_interference"
    INCONCLUSIVE = "inconclusive"  # the inputs do not allow a judgement
    HEALTHY = "healthy"

    @property
    def severity(self) -> int:
        """0 is the most severe."""
        return list(VerdictKind).index(self)


def known_rank(value: int | None) -> int | None:
    """A rank as a verdict holds it: None where the tables hold a sentinel."""
    return value if value is not None and value >= 0 else None


def known_pid(value: int | None) -> int | None:
    return value if value is not None and value > 0 else None


def rank_text(value: int | None) -> str:
    """A world rank for people: "unknown" where no input tells it."""
    rank = known_rank(value)
    return "unknown" if rank is None else str(rank)


@dataclass(frozen=True, slots=True)
class Verdict:
    kind: VerdictKind
    ranks: tuple[int | None, ...]  # world ranks, None where unknown
    hosts: tuple[str, ...]
    pids: tuple[int | None, ...]  # None where unknown
    comm_id_hash: str | None  # "0x%016x"
    seq: int | None
    op: str | None  # SQL spelling, e.g. ALL_REDUCE
    summary: str
    evidence: tuple[str, ...]
    comm_ranks: tuple[int | None, ...] = ()  # the culprits' ranks in that communicator
    # per culprit (index by index with ranks), the communicator where it was
    # judged ("0x%016x"), where that is not comm_id_hash
    judged: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # every detector builds its verdict from tables that mark unknown
        # with -1 (ranks) or 0 (pids): one guard here, so none can leak
        object.__setattr__(self, "ranks", tuple(known_rank(r) for r in self.ranks))
        object.__setattr__(self, "comm_ranks", tuple(known_rank(r) for r in self.comm_ranks))
        object.__setattr__(self, "pids", tuple(known_pid(p) for p in self.pids))

    def sort_key(self) -> tuple[int, tuple[tuple[bool, int], ...], str]:
        ranks = tuple((r is None, r or 0) for r in self.ranks)
        return (self.kind.severity, ranks, self.comm_id_hash or "")

    def to_json(self) -> dict[str, object]:
        return {
            "kind": self.kind.value,
            "ranks": list(self.ranks),
            "comm_ranks": list(self.comm_ranks),
            "hosts": list(self.hosts),
            "pids": list(self.pids),
            "comm_id_hash": self.comm_id_hash,
            "seq": self.seq,
            "op": self.op,
            "summary": self.summary,
            "evidence": list(self.evidence),
        }

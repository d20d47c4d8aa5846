"""Verdicts: a closed enum, most severe first, and the record each carries."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class VerdictKind(enum.Enum):
    MISSING_RANK = "missing_rank"
    DESYNC = "desync"
    RANK_EXITED = "rank_exited"
    COMPUTE_STRAGGLER = "compute_straggler"
    NETWORK_STRAGGLER = "network_straggler"
    CPU_INTERFERENCE = "cpu_interference"
    INCONCLUSIVE = "inconclusive"  # the inputs do not allow a judgement
    HEALTHY = "healthy"

    @property
    def severity(self) -> int:
        """0 is the most severe."""
        return list(VerdictKind).index(self)


@dataclass(frozen=True, slots=True)
class Verdict:
    kind: VerdictKind
    ranks: tuple[int, ...]  # world ranks (-1 where unknown)
    hosts: tuple[str, ...]
    pids: tuple[int, ...]
    comm_id_hash: str | None  # "0x%016x"
    seq: int | None
    op: str | None  # SQL spelling, e.g. ALL_REDUCE
    summary: str
    evidence: tuple[str, ...]
    comm_ranks: tuple[int, ...] = ()  # the culprits' ranks in that communicator

    def sort_key(self) -> tuple[int, tuple[int, ...], str]:
        return (self.kind.severity, self.ranks, self.comm_id_hash or "")

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

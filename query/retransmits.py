"""Per host, the job's TCP retransmits inside its collectives' windows: one
count, defined once (``dumpers.sqltables.RETRANSMITS_BY_HOST_QUERY``).

``stallwatch query DUMPS --example retransmits-by-host`` runs that query;
the analyzer's network verdicts print what this module returns, the same
query run over the same recordings: the report and the SQL count the same
events in the same windows (every completed collective the rings hold).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from stallwatch.dumpers.ranks import Ranks
from stallwatch.dumpers.sqltables import RETRANSMITS_BY_HOST_QUERY

from .feed import Load, Needs, feed, needs
from .sql import run_on_tables


@dataclass(frozen=True, slots=True)
class HostCount:
    """Retransmits sent and received inside collective windows, sent in all,
    and the completed collectives counted, of one host."""

    sent_in_windows: int
    received_in_windows: int
    sent_in_all: int
    collectives: int


@functools.cache
def _reads() -> Needs:
    """The columns the query reads (parsed once)."""
    return needs(RETRANSMITS_BY_HOST_QUERY)


def retransmits_by_host(loads: Sequence[Load], known: Ranks | None = None) -> dict[str, HostCount]:
    """The query over the recordings ``loads`` read, one at a time (their
    rows narrowed to what it reads): host -> its counts."""
    tables = feed(loads, known or Ranks({}, {}, {}), _reads())
    rows = run_on_tables(tables, RETRANSMITS_BY_HOST_QUERY).rows
    return {str(h): HostCount(int(a), int(b), int(c), int(d)) for h, a, b, c, d in rows}

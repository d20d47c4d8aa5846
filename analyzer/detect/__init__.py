"""Stage "detect": pick the departures from consensus out of the metrics.

Each detector is a plain function of an ``Analysis`` (the incident, its
matched calls and the metrics) returning verdicts, so that one can be swapped
or tested alone.  One module per verdict family, its thresholds (upper-case
constants) beside it: ``missing`` (collective frontier, point-to-point),
``desync``, ``exits``, ``stragglers`` (compute, CPU interference),
``network``; ``cpu`` tells starved ranks for the last two.  Thread positions
(``analyzer.positionjudge``) judge a hang the recording does not show.
"""

from __future__ import annotations

from ..positionjudge import detect_positions
from .common import Analysis, Detector
from .desync import detect_desync
from .exits import detect_rank_exited
from .missing import detect_missing_rank, detect_p2p_missing
from .network import detect_network
from .stragglers import detect_stragglers

DETECTORS: tuple[Detector, ...] = (
    detect_missing_rank,
    detect_desync,
    detect_rank_exited,
    detect_stragglers,
    detect_network,
)

# run when no detector above finds anything: a collective verdict explains
# the p2p calls around it better than they explain themselves, and what was
# recorded better than where threads were found
FALLBACK_DETECTORS: tuple[Detector, ...] = (detect_p2p_missing, detect_positions)

__all__ = ["DETECTORS", "FALLBACK_DETECTORS", "Analysis", "Detector"]

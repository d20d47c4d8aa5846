"""Stage "detect": per-rank metrics, and the departures from consensus
picked out of them.

Each detector is a plain function of an ``Analysis`` (the incident, its
matched calls, its frontiers and the metrics) returning verdicts, so that one
can be swapped or tested alone.  One module per verdict family, holding the
metrics it computes (functions that measure, none decides), its thresholds
(upper-case constants) and its detector: ``missing`` (collective frontier,
point-to-point gaps), ``desync`` (disagreements), ``exits``, ``stragglers``
(arrival scores; compute, CPU interference), ``network`` (retransmits inside
collective windows, the slowdowns they bring), ``partition`` (what became
of each connection between hosts: a cut, a link down, a flap, resets, when
the job stalls all together); ``cpu`` measures run-queue
delay and tells starved ranks for the last two; ``positions`` judges a hang
the recording does not show from thread readings.  The records the metrics
fill sit in ``analyzer.incident`` (the ``Analysis`` carries them to every
detector); ``inconclusive`` and ``causes`` run after the others.
"""

from __future__ import annotations

from .common import Analysis, Detector
from .desync import detect_desync
from .exits import detect_rank_exited
from .missing import detect_missing_rank, detect_p2p_missing
from .partition import detect_lossy_stall, detect_partition
from .paths import detect_slow_link
from .positions import detect_positions
from .stall import detect_stall
from .stopped import detect_stopped
from .stragglers import detect_network_unexplained, detect_stragglers

DETECTORS: tuple[Detector, ...] = (
    detect_partition,
    detect_slow_link,
    detect_missing_rank,
    detect_desync,
    detect_rank_exited,
    detect_stragglers,
    detect_network_unexplained,
)

# run when no detector above finds anything: a collective verdict explains
# the p2p calls around it better than they explain themselves, and what was
# recorded better than where threads were found
FALLBACK_DETECTORS: tuple[Detector, ...] = (detect_p2p_missing, detect_positions)

# run last, when no verdict was found and nothing is unjudged
# (``inconclusive``), before a healthy is said: a hung job is never healthy.
# Each takes the evidence of a stall no rank departs from; the first that
# finds anything is the verdict.  The network's verdicts on a stall every
# member shares go before ``detect_stall``, which says only that the job
# stood still and what every rank shares: a link down or connections no
# longer acknowledged are ``detect_partition``'s (above); connections that
# kept losing data up to the dumps, each time acknowledged again, are
# ``detect_lossy_stall``'s.  A rank found stopped (its threads in state T)
# holds a stall its peers share in flight beside it: ``detect_stopped``.
STALL_DETECTORS: tuple[Detector, ...] = (detect_stopped, detect_lossy_stall, detect_stall)

__all__ = ["DETECTORS", "FALLBACK_DETECTORS", "STALL_DETECTORS", "Analysis", "Detector"]

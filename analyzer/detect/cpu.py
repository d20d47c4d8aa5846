"""Run-queue delay: which ranks are starved of CPU, and the hosts they run on.
Used by the straggler detectors (CPU interference) and by the network
detector (a starved process stalls its connections: its retransmits are the
starvation's, not a lossy link's)."""

from __future__ import annotations

import numpy as np

from ..rankmetrics import proc_hosts
from .common import Analysis

SCHED_MIN_NS = 10_000_000  # run-queue delay that counts as interference
SCHED_DOMINANCE = 3.0  # times an unaffected rank's run-queue delay


def sched_heavy(a: Analysis) -> set[int]:
    """Procs whose threads waited in the run queue far more than an
    unaffected rank (the lower quartile: a hog may starve several ranks).
    Only waits the job did not cause count: a rank that waited for the
    job's own ranks on its machine is not starved by interference."""
    d = a.sched.starving
    if not len(d):
        return set()
    typical = max(float(np.percentile(d, 25)), 1.0)
    return {int(i) for i in np.flatnonzero((d >= SCHED_MIN_NS) & (d >= SCHED_DOMINANCE * typical))}


def starved_hosts(a: Analysis) -> set[int]:
    hosts = proc_hosts(a.incident)
    return {hosts[p] for p in sched_heavy(a)}

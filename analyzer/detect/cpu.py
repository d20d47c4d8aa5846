"""Run-queue delay: each rank's, by who held the CPU when its wait ended
(the metric); which ranks are starved of CPU, and the hosts they run on.
Used by the straggler detectors (CPU interference) and by the network
detector (a starved process stalls its connections: its retransmits are the
starvation's, not a lossy link's)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from stallwatch.dumpers.schema import PREV_PID_UNKNOWN

from ..incident import Incident, SchedDelays, SlowWindow, proc_hosts
from .common import Analysis

# ---- metric: run-queue delay per rank, by the CPU's holder ---------------------------


def sched_delays(inc: Incident, since: Mapping[int, int] | None = None) -> SchedDelays:
    """Each proc's recorded run-queue delay, split by the CPU's holder: ranks
    sharing too few CPUs wait for each other, which is no interference (an
    oversubscribed job with spinning waiters would call its slowest rank
    starved).  ``since``: per host, only the waits that ended from then on
    (a slowdown's window: a rank starved since its fault began stands out
    there, where over the whole ring every rank's waits behind the machine's
    other work can hide it); hosts not in it, all of theirs."""
    n = len(inc.procs)
    zero = np.zeros(n, dtype=np.int64)
    rows = inc.sched
    if since and len(rows):
        start = np.array([since.get(h, np.iinfo(np.int64).min) for h in range(len(inc.hosts))])
        rows = rows[rows["ts"] >= start[rows["host"]]]
    if not len(rows) or not n:
        return SchedDelays(zero, zero.copy(), zero.copy())
    hosts, pids = np.array(proc_hosts(inc)), np.array([p.pid for p in inc.procs])
    procs = _host_pid_keys(hosts, pids)
    order = np.argsort(procs)
    keys = _host_pid_keys(rows["host"], rows["pid"])
    pos = np.minimum(np.searchsorted(procs[order], keys), n - 1)
    owner = order[pos]  # the proc whose thread waited, where procs[owner] == keys
    unknown = rows["holder"] == PREV_PID_UNKNOWN
    # a holder is one of the job's ranks when it runs on the waiter's machine
    # (hosts of one kernel share CPUs and pids: the lab's nodes)
    machine = np.array(inc.machines or range(len(inc.hosts)), dtype=np.int64)
    ranks = _host_pid_keys(machine[hosts], pids)
    by_job = ~unknown & np.isin(_host_pid_keys(machine[rows["host"]], rows["holder"]), ranks)

    def per_proc(sel: np.ndarray) -> np.ndarray:
        sel = sel & (procs[owner] == keys)
        out = np.zeros(n, dtype=np.int64)
        np.add.at(out, owner[sel], rows["delay"][sel])
        return out

    return SchedDelays(per_proc(~unknown & ~by_job), per_proc(by_job), per_proc(unknown))


def _host_pid_keys(hosts: np.ndarray, pids: np.ndarray) -> np.ndarray:
    """One int64 per (host or machine index, pid): pids stay below 2**32."""
    return (hosts.astype(np.int64) << 32) | pids.astype(np.int64)


# ---- who is starved of CPU -----------------------------------------------------------

SCHED_MIN_NS = 10_000_000  # run-queue delay that counts as interference
SCHED_DOMINANCE = 3.0  # times an unaffected rank's run-queue delay


# in a slowdown, a rank's waits in the slow window must be at least this
# share of what a window of its communicators lost to have slowed the job
STARVED_LOST_SHARE = 0.5


def sched_heavy(a: Analysis) -> set[int]:
    """Procs whose threads waited in the run queue far more than an
    unaffected rank (the lower quartile: a hog may starve several ranks).
    Only waits the job did not cause count: a rank that waited for the
    job's own ranks on its machine is not starved by interference.  In a
    slowdown (waits read in its window), the waits must also be at least
    ``STARVED_LOST_SHARE`` of what the window lost (``most_lost``): a short
    window on a loaded machine puts some rank at 3x the others by chance,
    and a wait that small beside what was lost did not slow the job."""
    d = a.sched.starving
    if not len(d):
        return set()
    typical = max(float(np.percentile(d, 25)), 1.0)
    heavy = np.flatnonzero((d >= SCHED_MIN_NS) & (d >= SCHED_DOMINANCE * typical))
    if not a.windows:
        return {int(i) for i in heavy}
    out = set()
    for i in heavy.tolist():
        lost = most_lost(a, i)
        if lost is not None and d[i] >= STARVED_LOST_SHARE * lost[1]:
            out.add(i)
    return out


def most_lost(a: Analysis, proc: int) -> tuple[SlowWindow, int] | None:
    """Of the slow windows of communicators ``proc`` is in, the one that lost
    the most against its baseline, and what it lost (None: in none)."""
    m = a.matched
    best = None
    for w in a.windows:
        lost = w.lost_ns
        if lost <= 0 or (best is not None and lost <= best[1]):
            continue
        if (m.rows["proc"][m.comm_rows(w.comm)] == proc).any():
            best = (w, lost)
    return best


def starved_hosts(a: Analysis) -> set[int]:
    hosts = proc_hosts(a.incident)
    return {hosts[p] for p in sched_heavy(a)}

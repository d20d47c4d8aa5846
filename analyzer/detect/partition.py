"""Network partition, link down, flap, resets: the job stalls (or stalls for
a while) all together, and the network evidence points at one host or one
pair of hosts.  The ranks blocked behind it are consequences.

The metrics: what became of each connection between two hosts
(``ConnFate``), from the rows both of its ends recorded: retransmission
timeouts in a row and how long nothing was acknowledged (the kernel's own
account, read at each retransmit), whether it was still stopped when its
host's dump was taken or was acknowledged again (a flap), and its resets;
and which ranks were blocked in a call at their dumps.

The rules:
- A connection stopped being acknowledged when it had ``DEAD_BACKOFF``
  timeouts in a row and nothing acknowledged for ``DEAD_NO_ACK_NS``; a run
  its end followed with a retransmit that was no timeout in a row ended
  there (the count starts anew only once something was acknowledged); the
  last run was still stopped at the dump when the kernel's state of it then (the agent's
  ``tcp_info`` row, format 9 on) says the peer was last heard before its
  last timeout, or, without that row, when its next timeout was not yet due
  (an RTO doubles: a connection acknowledged again shows no more timeouts;
  a loaded machine can run a timer late, and the kernel skips a tracepoint
  program now and then, so the row is the better account).
- The host named is the one every such connection shares (with three hosts
  or more); when they are all between the same two hosts (or the job has
  two), the pair: both ends of one link look alike, unless one of the two
  lost the carrier of a link the ranks use (a fact of that host alone).
- A stall: every rank with a dump blocked in a call (a collective, or a
  group's end with its sends and receives) for ``STALL_NS`` at its dump,
  with connections stopped at the dump.  A flap: the job went on, but the
  collectives of some window took ``SLOW_NS`` and more on every member
  while connections were stopped and later acknowledged again: an outage
  that is the only one its hosts' connections went through (loss stops
  them again and again, a link's outage once) and stopped two pairs of
  hosts together for half ``FLAP_MIN_NS``, or one pair for all of it; of a
  pair, the host other traffic from a third host failed to reach
  meanwhile.  Resets: the
  job's connections reset before any rank failed or died (a rank that dies
  resets its own connections after it; those are its death's); of a pair
  they name, the one that went on aborting its connections to a third host
  (reason TCP_STATE, its processes alive) after the first death.

Known limits: connections recorded without their state (agents before
format 7, sockets made before the agent attached) count as stopped only
from the spacing of their retransmits (each gap 1.5x the one before, as
timeouts back off); a link of RDMA traffic shows here only through the
TCP connections around it (bootstrap, the store) and the links table.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable
from typing import Protocol

import numpy as np

from stallwatch.dumpers.schema import TcpEvent, op_name

from ..incident import ConnFate, Incident, LinkFate, proc_hosts
from ..verdict import Verdict, VerdictKind
from .common import MAX_LISTED, Analysis, who
from .inconclusive import unseen_ranks
from .paths import ProbeFinding, finding_summary, host_name, probe_finding

DEAD_BACKOFF = 2  # timeouts in a row: nothing acknowledged through two RTOs
DEAD_NO_ACK_NS = 1_000_000_000  # and nothing acknowledged for at least this long
STALL_NS = 1_000_000_000  # every rank blocked at least this long at its dump
SLOW_NS = 1_000_000_000  # a collective this long on every member, with stopped links
# an outage the job came back from counts when it stopped connections of two
# pairs of hosts at once, each for half this long: a link's outage stops its
# host's connections to every peer with data in flight together, while
# packet loss brings runs of timeouts one connection at a time (8% loss on
# one node of 4: a connection 0.7 s without an acknowledgement, a collective
# held 3.2 s; in one seed, one connection 3.7 s, no other pair's stopped
# with it, and other runs of theirs before and after).  An outage of this
# long on one pair counts where the TCP table holds that pair alone, or
# where it is the only one its hosts' connections went through (a flap, once).
FLAP_MIN_NS = 2_000_000_000
DUE_SLACK_NS = 500_000_000  # a timeout due this long before the dump and not seen: acked
# the peer last heard (tcp_info at the dump) this long before a run's last
# timeout or earlier: still stopped (the kernel keeps that time in jiffies)
HEARD_SLACK_NS = 20_000_000
# a call failing this close to the resets failed on them (a reset of many
# sockets, one after another, on a loaded machine takes a while)
RESET_WINDOW_NS = 2_000_000_000
LINK_SLACK_NS = 2_000_000_000  # a link down this long before the stall began is its cause too
BACKOFF_GROWTH = 1.5  # timeouts back off: each gap this much longer than the one before
MIN_RTO_NS = 150_000_000  # below the kernel's smallest RTO (200 ms): no timeout

RESET_EVENTS = (int(TcpEvent.TCP_SEND_RESET), int(TcpEvent.TCP_RECEIVE_RESET))
SK_RST_REASON_TCP_STATE = 14  # enum sk_rst_reason (Linux 6.10+): tcp_abort, tcp_disconnect


# ---- metrics: what became of each connection between two hosts -------------------------


def connection_fates(inc: Incident) -> tuple[ConnFate, ...]:
    """One record per connection between two hosts' own addresses."""
    t = inc.tcp
    if not len(t):
        return ()
    walls = np.array([_offset(inc, h) for h in range(len(inc.hosts))], dtype=np.int64)
    wall = t["ts"] + walls[t["host"]]
    now = np.array([_now(inc, h) for h in range(len(inc.hosts))], dtype=np.int64)
    order = np.lexsort((wall, t["conn"]))
    t, wall = t[order], wall[order]
    starts = np.flatnonzero(np.r_[True, t["conn"][1:] != t["conn"][:-1]])
    ends = np.append(starts[1:], len(t))
    return tuple(
        _fate(t[a:b], wall[a:b], now) for a, b in zip(starts.tolist(), ends.tolist(), strict=True)
    )


def _offset(inc: Incident, host: int) -> int:
    off = inc.to_wall(host)
    return off if off is not None else 0


def _now(inc: Incident, host: int) -> int:
    """When the host's dump was taken, its own clock (-1 if unknown)."""
    now = inc.host_now[host] if host < len(inc.host_now) else None
    return now if now is not None else -1


def _fate(rows: np.ndarray, wall: np.ndarray, now: np.ndarray) -> ConnFate:
    """One connection, from the rows of both of its ends: each end told
    alone (its own timeouts, on its own clock), then together."""
    ends = [_end_fate(rows[rows["host"] == h], wall[rows["host"] == h], now)
            for h in np.unique(rows["host"]).tolist()]  # fmt: skip
    x, y = int(rows["local"][0]), int(rows["remote"][0])
    stops = [e.stop_wall_ns for e in ends if e.stop_wall_ns is not None]
    resets = [e.first_reset_wall_ns for e in ends if e.first_reset_wall_ns is not None]
    no_ack = [e.no_ack_ns for e in ends if e.no_ack_ns is not None]
    lasts = [e.last_wall_ns for e in ends if e.last_wall_ns is not None]
    return ConnFate(
        hosts=(min(x, y), max(x, y)),
        retransmits=sum(e.retransmits for e in ends),
        timeouts=sum(e.timeouts for e in ends),
        backoff=max(e.backoff for e in ends),
        no_ack_ns=max(no_ack) if no_ack else None,
        stop_wall_ns=min(stops) if stops else None,
        last_wall_ns=max(lasts) if lasts else None,
        dead=any(e.dead for e in ends),
        resets=sum(e.resets for e in ends),
        first_reset_wall_ns=min(resets) if resets else None,
        outages=tuple(sorted(o for e in ends for o in e.outages)),
        other=bool(rows["other"].any()),
    )


def _end_fate(rows: np.ndarray, wall: np.ndarray, now: np.ndarray) -> ConnFate:
    """One end of a connection: the rows its host recorded, in time order."""
    hosts = (int(rows["local"][0]), int(rows["remote"][0]))
    resets = np.isin(rows["event"], RESET_EVENTS)
    info = rows["event"] == TcpEvent.TCP_INFO
    at_dump = rows[info][-1] if info.any() else None
    rt, rt_wall = rows[~resets & ~info], wall[~resets & ~info]
    first_reset = int(wall[resets].min()) if resets.any() else None
    stuck = None
    if at_dump is not None and (not len(rt) or int(at_dump["ts"]) >= int(rt["ts"][-1])):
        stuck = _stuck_at_dump(at_dump, int(wall[info][-1]), len(rt))
    if not len(rt):
        if stuck is None:
            return ConnFate(hosts, 0, 0, 0, None, None, None, False, int(resets.sum()), first_reset)
        return ConnFate(hosts, 0, stuck.backoff, stuck.backoff, stuck.no_ack, stuck.stop_wall,
                        None, True, int(resets.sum()), first_reset)  # fmt: skip
    known = rt["known"] > 0
    if known.all():
        backoff, no_ack = rt["backoff"].astype(np.int64), rt["no_ack"]
    else:
        backoff, no_ack = _backoff_from_spacing(rt["ts"]), np.zeros(len(rt), dtype=np.int64)
        backoff[known], no_ack[known] = rt["backoff"][known], rt["no_ack"][known]
    host_now = int(now[int(rt["host"][0])])
    runs = [
        dataclasses.replace(
            _run(rt[a:b], rt_wall[a:b], backoff[a:b], no_ack[a:b], known[a:b], host_now,
                 at_dump if b == len(rt) else None, followed=b < len(rt)),
            end=b,
        )
        for a, b in _runs_of(backoff)
    ]  # fmt: skip
    last = runs[-1] if runs and runs[-1].end == len(rt) else None
    if last is None and stuck is not None:  # its timeouts left no row: its state at the dump
        runs.append(last := stuck)
    dead = last is not None and last.dead
    return ConnFate(
        hosts=hosts,
        retransmits=len(rt),
        timeouts=int(np.count_nonzero(backoff)),
        backoff=last.backoff if last is not None else 0,
        no_ack_ns=last.no_ack if last is not None else None,
        stop_wall_ns=last.stop_wall if last is not None else None,
        last_wall_ns=int(rt_wall[-1]),
        dead=dead,
        resets=int(resets.sum()),
        first_reset_wall_ns=first_reset,
        outages=tuple((r.stop_wall, r.back_wall) for r in runs if r.back_wall is not None),
    )


@dataclasses.dataclass(frozen=True, slots=True)
class _Run:
    """A run of retransmission timeouts on one end of a connection."""

    end: int  # index after its last row
    backoff: int
    no_ack: int  # nothing acknowledged for at least (up to the dump, if dead)
    stop_wall: int
    dead: bool  # still stopped at the dump
    back_wall: int | None  # stopped for long enough, then acknowledged again after this


def _runs_of(backoff: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of rows with backoff >= 1; a run ends where
    the count does not grow (acknowledged in between, then timed out anew:
    1, 2, 3, 1, 2 is two runs)."""
    on = backoff > 0
    starts = on & np.r_[True, ~on[:-1] | (backoff[1:] <= backoff[:-1])]
    ends = on & np.r_[~on[1:] | (backoff[1:] <= backoff[:-1]), True]
    return list(
        zip(np.flatnonzero(starts).tolist(), (np.flatnonzero(ends) + 1).tolist(), strict=True)
    )


def _run(
    rt: np.ndarray, wall: np.ndarray, backoff: np.ndarray, no_ack: np.ndarray, known: np.ndarray,
    host_now: int, at_dump: np.ndarray | None = None, followed: bool = False,
) -> _Run:  # fmt: skip
    """``followed``: the end recorded retransmits after the run's last
    timeout that were no timeout in a row (its count starts anew only once
    something was acknowledged): the run ended there, whenever the dump."""
    end = len(rt) - 1
    stopped_for = int(no_ack[end]) if known[end] else _spread(rt["ts"])
    stop_wall = int(wall[end]) - stopped_for
    stuck = int(backoff.max())
    # told from spacing alone, one timeout more is asked for
    needed = DEAD_BACKOFF if known[end] else DEAD_BACKOFF + 1
    if stuck < needed or stopped_for < DEAD_NO_ACK_NS / 2:
        return _Run(0, stuck, stopped_for, stop_wall, False, None)
    last = int(rt["ts"][end])
    if followed:
        dead = False
    elif at_dump is not None and int(at_dump["ts"]) >= last:
        # the kernel's account at the dump: the peer heard from since the
        # run's last timeout, or not (whatever timeout rows the ring lost,
        # however late a loaded machine ran the timer)
        heard = int(at_dump["ts"]) - int(at_dump["no_ack"])
        dead = heard + HEARD_SLACK_NS < last
    else:
        due = _next_timeout(rt["ts"], rt["rto"])
        dead = host_now >= 0 and (due is None or host_now <= due + DUE_SLACK_NS)
    if dead:  # nothing acknowledged since, up to the dump
        return _Run(0, stuck, stopped_for + host_now - int(rt["ts"][end]), stop_wall, True, None)
    return _Run(0, stuck, stopped_for, stop_wall, False, int(wall[end]))


def _stuck_at_dump(at_dump: np.ndarray, wall: int, end: int) -> _Run | None:
    """A run of timeouts told by the state at the dump alone: its rows were
    lost, not its fate (``DEAD_BACKOFF`` timeouts unanswered, the peer
    silent for ``DEAD_NO_ACK_NS``)."""
    silent = int(at_dump["no_ack"])
    if at_dump["backoff"] < DEAD_BACKOFF or silent < DEAD_NO_ACK_NS:
        return None
    return _Run(end, int(at_dump["backoff"]), silent, wall - silent, True, None)


def _backoff_from_spacing(ts: np.ndarray) -> np.ndarray:
    """Timeouts in a row told from when retransmits came: a gap of at least
    the smallest RTO starts a run, and each gap ``BACKOFF_GROWTH`` times the
    one before continues it (the first gap of a run is the time since
    whatever came before: it is not compared)."""
    out = np.zeros(len(ts), dtype=np.int64)
    gaps = np.diff(ts.astype(np.int64))
    for i in range(1, len(ts)):
        gap = gaps[i - 1]
        if gap < MIN_RTO_NS:
            continue
        grew = out[i - 1] <= 1 or gap >= BACKOFF_GROWTH * gaps[i - 2]
        out[i] = out[i - 1] + 1 if grew else 1
    return out


def _spread(ts: np.ndarray) -> int:
    return int(ts[-1] - ts[0]) if len(ts) > 1 else 0


def _next_timeout(ts: np.ndarray, rto: np.ndarray) -> int | None:
    """When the run's next timeout was due (host clock): the RTO doubles."""
    if rto[-1] > 0:
        return int(ts[-1] + 2 * rto[-1])
    if len(ts) >= 2:
        return int(ts[-1] + 2 * (ts[-1] - ts[-2]))
    return None


# ---- where the job stood ---------------------------------------------------------------


def blocked_procs(inc: Incident) -> dict[int, tuple[int, int]]:
    """proc -> (op, blocked for ns at its dump), of the procs blocked in a call."""
    hosts = proc_hosts(inc)
    out: dict[int, tuple[int, int]] = {}
    for proc, op, ts in inc.waiting.tolist():
        now = inc.host_now[hosts[proc]]
        if now is not None:
            out[int(proc)] = (int(op), int(now) - int(ts))
    return out


def _died(inc: Incident) -> bool:
    return any(p.died_badly for p in inc.procs)


def stalled_together(inc: Incident) -> dict[int, tuple[int, int]] | None:
    """Every rank with calls blocked in one for STALL_NS at its dump, and none
    died: the procs and where they wait; None when some rank was free."""
    if not inc.procs or any(p.died_badly for p in inc.procs):
        return None
    with_calls = set(np.unique(inc.calls.rows["proc"]).tolist()) if len(inc.calls) else set()
    blocked = {p: w for p, w in blocked_procs(inc).items() if w[1] >= STALL_NS}
    if not with_calls or not with_calls <= set(blocked):
        return None
    return blocked


# ---- naming the host ------------------------------------------------------------------


class _Between(Protocol):
    @property
    def hosts(self) -> tuple[int, int]: ...


def shared_hosts(conns: Iterable[_Between], nhosts: int) -> tuple[int, ...]:
    """The host every connection touches (the pair, when two hosts are)."""
    conns = list(conns)
    if not conns:
        return ()
    common = set(conns[0].hosts)
    for c in conns[1:]:
        common &= set(c.hosts)
    if nhosts <= 2 or len(common) == 2:
        return tuple(sorted(common)) if len(common) == 2 else ()
    return tuple(common) if len(common) == 1 else ()


# ---- the verdicts ---------------------------------------------------------------------


def detect_partition(a: Analysis) -> list[Verdict]:
    inc = a.incident
    fates = a.fates
    probed = probe_finding(inc) if len(inc.probes) else None
    if not fates and not inc.links and probed is None:
        return []
    stalled = stalled_together(inc)
    if stalled is None and probed is not None and inc.stall_triggers and not _died(inc):
        stalled = {}  # an agent saw the job stand still; its calls were queued, not blocked
    if stalled is not None:
        dead = [f for f in fates if f.dead and not f.other]
        hosts = shared_hosts(dead, len(inc.hosts))
        hosts = _narrowed(inc, hosts, stalled) if stalled else hosts
        if not hosts:  # no TCP account (RDMA traffic): a link the ranks use went down
            hosts = tuple(sorted({lk.host for lk in _down_links(inc, stalled)}))
            hosts = hosts if len(hosts) == 1 or (len(hosts) == 2 and len(inc.hosts) == 2) else ()
        if probed is not None and (len(probed.hosts) == 1 or not hosts):
            hosts = probed.hosts  # the probes reach every pair, whatever carried data
        elif probed is not None and probed.hosts != hosts:
            probed = None
        if hosts:
            return [_stall_verdict(a, hosts, dead, stalled, probed)]
    flap = _flap(a)
    if flap is not None:
        return [flap]
    reset = _reset(a)
    return [reset] if reset is not None else []


def _narrowed(
    inc: Incident, hosts: tuple[int, ...], stalled: dict[int, tuple[int, int]]
) -> tuple[int, ...]:
    """Of a pair the job's connections name (every stopped one between the
    two), the one whose link the ranks use went down (a carrier is one
    host's own), else the one that other traffic failed to reach too, from
    a third host, since the stall began: the job's connection to a cut host
    may have carried nothing when its link went, other traffic to it did."""
    if len(hosts) != 2:
        return hosts
    down = {lk.host for lk in _down_links(inc, stalled)} & set(hosts)
    if len(down) == 1:
        return tuple(down)
    return _unreached(inc, hosts, _stall_began(inc, stalled) - LINK_SLACK_NS)


def _unreached(
    inc: Incident, hosts: tuple[int, ...], since_wall: int, until_wall: int | None = None
) -> tuple[int, ...]:
    """Of a pair, the one that other traffic from a third host failed to
    reach (sampled retransmits) in [since_wall, until_wall]; else the pair."""
    if len(hosts) != 2 or len(inc.hosts) < 3:
        return hosts
    reached = {h: 0 for h in hosts}
    for f in inc_other_failures(inc, since_wall, until_wall):
        far = set(f) - set(hosts)
        for h in set(f) & set(hosts):
            reached[h] += bool(far)
    failing = [h for h, n in reached.items() if n]
    return (failing[0],) if len(failing) == 1 else hosts


def inc_other_failures(
    inc: Incident, since_wall: int, until_wall: int | None = None
) -> list[tuple[int, int]]:
    """The pairs of hosts of sampled retransmits of other traffic (not the
    job's) since ``since_wall`` (and up to ``until_wall``)."""
    t = inc.tcp
    rows = t[(t["other"] == 1) & (t["event"] == TcpEvent.TCP_RETRANSMIT_SKB)]
    walls = np.array([_offset(inc, h) for h in range(len(inc.hosts))], dtype=np.int64)
    wall = rows["ts"] + walls[rows["host"]]
    keep = wall >= since_wall
    if until_wall is not None:
        keep &= wall <= until_wall
    rows = rows[keep]
    return [(int(a), int(b)) for a, b in zip(rows["local"], rows["remote"], strict=True)]


def _stall_began(inc: Incident, stalled: dict[int, tuple[int, int]]) -> int:
    hosts = proc_hosts(inc)
    return min(
        (inc.host_now[hosts[p]] or 0) - age + _offset(inc, hosts[p])
        for p, (_, age) in stalled.items()
    )


def _names(inc: Incident, hosts: Iterable[int]) -> tuple[str, ...]:
    return tuple(host_name(inc, h) for h in hosts)


def _hosts_verdict(
    inc: Incident,
    kind: VerdictKind,
    hosts: tuple[int, ...],
    summary: str,
    evidence: list[str],
    a: Analysis | None = None,
) -> Verdict:
    """A network verdict naming ``hosts`` and every rank on them: of a host
    without a dump here, the ranks no dump holds, where it is the only such
    host the probes found (no other host can hold them)."""
    procs = [i for i, h in enumerate(proc_hosts(inc)) if h in hosts]
    ranks, _, pids = who(inc, procs)
    if a is not None and len(inc.unreached) == 1 and len(inc.hosts) in hosts:
        ranks = tuple(sorted({*ranks, *unseen_ranks(a, a.frontiers)}))
    names = _names(inc, hosts)
    return Verdict(kind, ranks, names, pids, None, None, None, summary, tuple(evidence))


def _stall_verdict(
    a: Analysis,
    hosts: tuple[int, ...],
    dead: list[ConnFate],
    stalled: dict[int, tuple[int, int]],
    probed: ProbeFinding | None = None,
) -> Verdict:
    inc = a.incident
    names = _names(inc, hosts)
    down = [lk for lk in _down_links(inc, stalled) if lk.host in hosts]
    longest = max((f.no_ack_ns or 0) for f in dead) if dead else 0
    peers = sorted({inc.hosts[h] for f in dead for h in f.hosts} - set(names))
    acked = f" (nothing acknowledged for {_s(longest)} and more)" if dead else ""
    if down:
        lk = down[0]
        summary = (
            f"host {inc.hosts[lk.host]}'s link {lk.name} went down: "
            + (f"its connections to {', '.join(peers)} stopped being acknowledged{acked}; "
               if dead else "")
            + "every rank waits"
        )  # fmt: skip
    elif len(hosts) == 1:
        summary = (
            f"the network cut host {names[0]} off: its connections to {', '.join(peers)} "
            f"stopped being acknowledged{acked}; every rank waits"
        )
    else:
        summary = (
            f"traffic between hosts {names[0]} and {names[1]} stopped{acked}; both ends of "
            "one link look alike; every rank waits"
        )
    evidence = _link_lines(inc, hosts) + _connection_lines(inc, dead) + _blocked_lines(a, stalled)
    if probed is not None:
        if not down:  # a carrier lost says more than what the probes found beyond it
            summary = f"{finding_summary(inc, probed)}; every rank waits"
        evidence = [*probed.lines, *evidence]
    return _hosts_verdict(inc, VerdictKind.NETWORK_PARTITION, hosts, summary, evidence, a)


def _down_links(inc: Incident, stalled: dict[int, tuple[int, int]]) -> list[LinkFate]:
    """Links the ranks use that lost their carrier (physical link) and were
    still down at the dump, or went down since the stall began."""
    if not stalled:
        return []
    began = _stall_began(inc, stalled)
    return [
        lk
        for lk in inc.links
        if lk.used and any(up is None or down >= began - LINK_SLACK_NS for down, up in lk.downs)
    ]


def _link_lines(inc: Incident, hosts: Iterable[int]) -> list[str]:
    """What the named hosts' links the ranks use went through."""
    out = []
    for lk in inc.links:
        if lk.host not in hosts or not lk.used or not (lk.downs or lk.moved):
            continue
        where = f"host {inc.hosts[lk.host]} {lk.kind} {lk.name}"
        for down, up in lk.downs[-MAX_LISTED:]:
            back = "still down at the dump" if up is None else f"up again {_s(up - down)} later"
            out.append(f"{where}: lost its carrier at {_clock(down)}, {back}")
        if lk.moved:
            counts = ", ".join(f"{name} +{n}" for name, n in lk.moved)
            out.append(f"{where}: failure counters moved over the recording: {counts}")
    return out


def _clock(wall_ns: int) -> str:
    """A wall-clock time for people (UTC, to the millisecond)."""
    import datetime

    t = datetime.datetime.fromtimestamp(wall_ns / 1e9, tz=datetime.UTC)
    return t.strftime("%H:%M:%S.%f")[:-3] + " UTC"


def _connection_lines(inc: Incident, conns: list[ConnFate]) -> list[str]:
    by_pair: dict[tuple[int, int], list[ConnFate]] = defaultdict(list)
    for f in conns:
        by_pair[f.hosts].append(f)
    out = []
    for (x, y), fs in sorted(by_pair.items()):
        no_ack = max((f.no_ack_ns or 0) for f in fs)
        out.append(
            f"hosts {inc.hosts[x]} and {inc.hosts[y]}: {len(fs)} connection(s) stopped being "
            f"acknowledged: {sum(f.retransmits for f in fs)} retransmits, up to "
            f"{max(f.backoff for f in fs)} timeouts in a row, nothing acknowledged for "
            f"{_s(no_ack)}"
        )
    alive = [p for p in _pairs(inc) if p not in by_pair]
    if alive:
        text = ", ".join(f"{inc.hosts[x]}-{inc.hosts[y]}" for x, y in alive[:MAX_LISTED])
        out.append(f"connections between the other hosts kept being acknowledged: {text}")
    return out


def _pairs(inc: Incident) -> list[tuple[int, int]]:
    """The pairs of hosts whose connections the TCP table holds."""
    t = inc.tcp
    t = t[t["event"] != TcpEvent.TCP_INFO]  # every connection has one: not a failure
    lo, hi = np.minimum(t["local"], t["remote"]), np.maximum(t["local"], t["remote"])
    return sorted({(int(x), int(y)) for x, y in zip(lo.tolist(), hi.tolist(), strict=True)})


def _blocked_lines(a: Analysis, stalled: dict[int, tuple[int, int]]) -> list[str]:
    """Where the ranks wait: the consequences."""
    inc = a.incident
    by_op: dict[int, list[int]] = defaultdict(list)
    for proc, (op, _) in stalled.items():
        by_op[op].append(proc)
    out = []
    for op, procs in sorted(by_op.items()):
        ranks = ", ".join(str(r) for r in sorted(inc.procs[p].world_rank for p in procs))
        age = max(stalled[p][1] for p in procs)
        out.append(f"consequence: ranks {ranks} wait in {op_name(op)} (up to {_s(age)})")
    return out


def _s(ns: float) -> str:
    return f"{ns / 1e9:.1f} s"


def _flap(a: Analysis) -> Verdict | None:
    """Connections stopped and acknowledged again while every rank waited in
    a call (a collective, or a group's end with its sends and receives) of
    SLOW_NS and more: the job stalled for it, and went on."""
    inc = a.incident
    waits = _long_waits(inc)
    if not waits:
        return None
    everyone = set(np.unique(inc.calls.rows["proc"]).tolist()) if len(inc.calls) else set()

    def within(outage: tuple[int, int]) -> bool:
        waiting = {p for p, (s, e) in waits if s <= outage[1] and outage[0] <= e}
        return bool(everyone) and everyone <= waiting

    outages = [
        (f, o)
        for f in a.fates
        if not f.other
        for o in f.outages
        if o[1] - o[0] >= FLAP_MIN_NS / 2 and within(o)
    ]
    pairs = len(_pairs(inc))

    def isolated(f: ConnFate, o: tuple[int, int]) -> bool:
        """No other outage of a connection of its hosts, before or after it:
        loss stops their connections again and again, a link's outage once."""
        return not any(
            set(g.hosts) & set(f.hosts) and (p[1] < o[0] or o[1] < p[0])
            for g in a.fates
            if not g.other
            for p in g.outages
        )

    def counts(f: ConnFate, o: tuple[int, int]) -> bool:
        long = o[1] - o[0] >= FLAP_MIN_NS
        if pairs <= 1:
            return long
        beside = any(g.hosts != f.hosts and p[0] <= o[1] and o[0] <= p[1] for g, p in outages)
        return (long or beside) and isolated(f, o)

    kept = {o for f, o in outages if counts(f, o)}
    inside = [f for f in a.fates if any(o in kept for o in f.outages)]
    flapped = [
        lk for lk in inc.links if lk.used and any(up and within((d, up)) for d, up in lk.downs)
    ]
    hosts = shared_hosts(inside, len(inc.hosts))
    if not hosts and not inside:  # no TCP account (RDMA traffic): the links alone
        hosts = tuple(sorted({lk.host for lk in flapped}))
        hosts = hosts if len(hosts) == 1 else ()
    if not hosts:
        return None
    spans = [o for f in inside for o in f.outages if o in kept]
    spans += [
        (d, up)
        for lk in flapped
        if lk.host in hosts
        for d, up in lk.downs
        if up and within((d, up))
    ]
    start, end = min(s for s, _ in spans), max(e for _, e in spans)
    hosts = _unreached(inc, hosts, start - LINK_SLACK_NS, end)
    names = _names(inc, hosts)
    longest = max(e - s for p, (s, e) in waits if s <= end and start <= e)
    place = f"host {names[0]} off" if len(hosts) == 1 else f"hosts {names[0]} and {names[1]} apart"
    summary = (
        f"the network cut {place} and it came back: its connections went unacknowledged for "
        f"up to {_s(end - start)}, and every rank waited for it (a call of up to {_s(longest)})"
    )
    evidence = _link_lines(inc, hosts) + _outage_lines(inc, inside)
    evidence += _held_lines(a, start, end)
    return _hosts_verdict(
        inc, VerdictKind.NETWORK_PARTITION, hosts, summary, evidence[: 2 * MAX_LISTED]
    )


def _long_waits(inc: Incident) -> list[tuple[int, tuple[int, int]]]:
    """(proc, (entered, returned) on the wall clock) of every call of the
    whole rings that took SLOW_NS and more (a group's end included)."""
    rows = inc.held
    rows = rows[rows["end"] - rows["ts"] >= SLOW_NS]
    if not len(rows):
        return []
    hosts = np.array(proc_hosts(inc), dtype=np.int64)
    walls = np.array([_offset(inc, h) for h in range(len(inc.hosts))], dtype=np.int64)
    wall = walls[hosts[rows["proc"]]]
    return [
        (int(p), (int(s), int(e)))
        for p, s, e in zip(rows["proc"], rows["ts"] + wall, rows["end"] + wall, strict=True)
    ]


def _held_lines(a: Analysis, start: int, end: int) -> list[str]:
    """The long calls the ranks waited in during [start, end], one line per op."""
    inc = a.incident
    rows = inc.held
    hosts = np.array(proc_hosts(inc), dtype=np.int64)
    walls = np.array([_offset(inc, h) for h in range(len(inc.hosts))], dtype=np.int64)
    wall = walls[hosts[rows["proc"]]] if len(rows) else np.zeros(0, dtype=np.int64)
    during = (
        (rows["end"] - rows["ts"] >= SLOW_NS)
        & (rows["ts"] + wall <= end)
        & (rows["end"] + wall >= start)
    )
    out = []
    for op in np.unique(rows["op"][during]).tolist():
        mine = rows[during & (rows["op"] == op)]
        ranks = sorted({inc.procs[int(p)].world_rank for p in mine["proc"]})
        out.append(
            f"ranks {', '.join(map(str, ranks))} waited in {op_name(op)} up to "
            f"{_s(int((mine['end'] - mine['ts']).max()))}"
        )
    return out


def _outage_lines(inc: Incident, conns: list[ConnFate]) -> list[str]:
    by_pair: dict[tuple[int, int], list[ConnFate]] = defaultdict(list)
    for f in conns:
        by_pair[f.hosts].append(f)
    return [
        f"hosts {inc.hosts[x]} and {inc.hosts[y]}: {len(fs)} connection(s) stopped being "
        f"acknowledged for up to {_s(max(b - s for f in fs for s, b in f.outages))}, then "
        f"were acknowledged again ({sum(f.timeouts for f in fs)} timeouts)"
        for (x, y), fs in sorted(by_pair.items())
    ]


def _reset(a: Analysis) -> Verdict | None:
    """The job's connections reset, and the ranks failed on them: the first
    rank that died saw its own host's connections reset before it died (on
    that host's one clock); a process that dies first resets its own
    connections after it, and its death is the cause."""
    inc = a.incident
    reset = [f for f in a.fates if f.resets and f.first_reset_wall_ns is not None]
    if not reset:
        return None
    first_reset = min(f.first_reset_wall_ns or 0 for f in reset)
    death = _first_death(inc)
    if death is not None:
        host, died = death
        before = _first_reset_on(inc, host)
        if before is None or before > died:
            return None  # a rank died first: its death reset its connections
    failures = [t for t in (death[1] if death else None, _first_error_wall(inc)) if t is not None]
    if failures and abs(min(failures) - first_reset) > RESET_WINDOW_NS:
        return None  # the resets and the failures are unrelated
    if death is not None:  # the resets before the first death: those after are its own
        reset = [f for f in reset if (f.first_reset_wall_ns or 0) <= death[1]]
    hosts = shared_hosts(reset, len(inc.hosts))
    if not hosts:
        return None
    aborted: dict[int, int] = {}
    if len(hosts) == 2 and death is not None:
        aborted = _aborted_beyond(inc, hosts, death[1])
        if len(aborted) == 1:
            hosts = tuple(aborted)
    names = _names(inc, hosts)
    peers = sorted({inc.hosts[h] for f in reset for h in f.hosts} - set(names))
    where = f"host {names[0]}" if len(hosts) == 1 else f"hosts {names[0]} and {names[1]}"
    summary = (
        f"the job's connections of {where} were reset ({sum(f.resets for f in reset)} resets, "
        f"with {', '.join(peers) or 'its peer'}); the ranks failed after them"
    )
    deaths = [
        f"consequence: {p.label()} exited ({_death(p.exit_code, p.exit_signal)})"
        for p in inc.procs
        if p.died_badly
    ][:MAX_LISTED]
    by_pair: dict[tuple[int, int], list[ConnFate]] = defaultdict(list)
    for f in reset:
        by_pair[f.hosts].append(f)
    evidence = [
        f"hosts {inc.hosts[x]} and {inc.hosts[y]}: {len(fs)} connection(s) reset "
        f"({sum(f.resets for f in fs)} resets sent and received)"
        for (x, y), fs in sorted(by_pair.items())
    ]
    evidence += [
        f"host {inc.hosts[h]} went on aborting its connections to other hosts, their processes "
        f"alive ({n} resets, reason TCP_STATE: sockets the kernel aborted)"
        for h, n in aborted.items()
        if h in hosts
    ]
    return _hosts_verdict(inc, VerdictKind.NETWORK_PARTITION, hosts, summary, evidence + deaths)


def _aborted_beyond(inc: Incident, pair: tuple[int, ...], since_wall: int) -> dict[int, int]:
    """Of a pair whose connection's resets came before the first death: the
    hosts of the pair that went on, within RESET_WINDOW_NS, resetting their
    connections to a third host with reason TCP_STATE (the kernel aborted a
    socket its process held: a destroyed socket, an abortive close) before
    that process exited: what their connections went through, not a death's
    (a dying process's resets say ABORT_ON_CLOSE or NO_SOCKET, or come after
    its exit).  Host -> resets."""
    t = inc.tcp
    sent = t[
        (t["event"] == TcpEvent.TCP_SEND_RESET)
        & (t["reason"] == SK_RST_REASON_TCP_STATE)
        & np.isin(t["local"], pair)
        & ~np.isin(t["remote"], pair)
    ]
    hosts = proc_hosts(inc)
    exited = {(hosts[i], p.pid): p.exit_wall_ns for i, p in enumerate(inc.procs) if p.exit_wall_ns}
    out: dict[int, int] = {}
    for row in sent:
        host = int(row["local"])
        wall = int(row["ts"]) + _offset(inc, int(row["host"]))
        gone = exited.get((int(row["host"]), int(row["pid"])))
        if since_wall < wall <= since_wall + RESET_WINDOW_NS and (gone is None or wall < gone):
            out[host] = out.get(host, 0) + 1
    return out


# ---- a stall held by loss -------------------------------------------------------------

# retransmits since the stall began on one host's (or one pair's) connections,
# a timeout among them, and the last of them this close to its host's dump
# (or within two of its timeouts: the next one was still to come)
LOSSY_STALL_MIN = 4
LOSSY_RECENT_NS = 1_000_000_000


@dataclasses.dataclass(frozen=True, slots=True)
class _Lossy:
    """A connection between two hosts that kept losing while the job stood still."""

    hosts: tuple[int, int]
    retransmits: int
    timeouts: int
    rto_ns: int  # the longest timeout that expired (0: unknown)


def lossy_during_stall(inc: Incident, began_wall: int) -> list[_Lossy]:
    """The job's connections that retransmitted since ``began_wall`` and
    were still retransmitting when their hosts' dumps were taken: data the
    stalled calls wait for, lost and sent again (a connection whose
    retransmits ended long before the dump was acknowledged since)."""
    t = inc.tcp
    t = t[(t["other"] == 0) & (t["event"] == TcpEvent.TCP_RETRANSMIT_SKB)]
    if not len(t):
        return []
    walls = np.array([_offset(inc, h) for h in range(len(inc.hosts))], dtype=np.int64)
    now = np.array([_now(inc, h) for h in range(len(inc.hosts))], dtype=np.int64)
    t = t[t["ts"] + walls[t["host"]] >= began_wall]
    out = []
    for conn in np.unique(t["conn"]).tolist():
        rows = t[t["conn"] == conn]
        recent, timeouts = False, 0
        for h in np.unique(rows["host"]).tolist():
            mine = rows[rows["host"] == h]
            mine = mine[np.argsort(mine["ts"], kind="stable")]
            last = int(mine["ts"][-1])
            rto = int(mine["rto"][-1])
            recent |= now[h] >= 0 and now[h] - last <= max(LOSSY_RECENT_NS, 2 * rto)
            # rows without the connection's state: timeouts told from their spacing
            spaced = _backoff_from_spacing(mine["ts"])
            timeouts += int(np.count_nonzero(np.where(mine["known"] > 0, mine["backoff"], spaced)))
        if not recent:
            continue
        x, y = int(rows["local"][0]), int(rows["remote"][0])
        out.append(_Lossy((min(x, y), max(x, y)), len(rows), timeouts, int(rows["rto"].max())))
    return out


def detect_lossy_stall(a: Analysis) -> list[Verdict]:
    """Every rank blocked in a call and no connection stopped for good, but
    the job's connections of one host (or between the two hosts of a job of
    two) lost and resent data all through the stall, up to the dumps: packet
    loss held the collectives every rank waits on past the stall timeout (a
    lossy link under a loaded host: timeouts backing off to seconds).  Run
    only when no other detector found anything: a rank that departs is the
    culprit, loss beside it or not."""
    inc = a.incident
    stalled = stalled_together(inc)
    if stalled is None:
        return []
    lossy = lossy_during_stall(inc, _stall_began(inc, stalled))
    hosts = shared_hosts(lossy, len(inc.hosts))
    total = sum(c.retransmits for c in lossy)
    if not hosts or total < LOSSY_STALL_MIN or not any(c.timeouts for c in lossy):
        return []
    names = _names(inc, hosts)
    longest = max(age for _, age in stalled.values())
    rto = max(c.rto_ns for c in lossy)
    backed = f", timeouts backing off to {_s(rto)}" if rto else ""
    where = (
        f"host {names[0]}'s connections"
        if len(hosts) == 1
        else f"the connections between hosts {names[0]} and {names[1]}"
    )
    summary = (
        f"the job stood still for {_s(longest)} while {where} kept losing data: "
        f"{total} retransmits since the stall began{backed}, still retransmitting when the "
        "dumps were taken; every rank waits on the collectives that loss holds"
        + ("; both ends of one link look alike" if len(hosts) == 2 else "")
    )
    by_pair: dict[tuple[int, int], list[_Lossy]] = defaultdict(list)
    for c in lossy:
        by_pair[c.hosts].append(c)
    evidence = [
        f"hosts {inc.hosts[x]} and {inc.hosts[y]}: {len(cs)} connection(s) retransmitting "
        f"since the stall began: {sum(c.retransmits for c in cs)} retransmits, "
        f"{sum(c.timeouts for c in cs)} of them timeouts, acknowledged between them (lossy, "
        "not cut)"
        for (x, y), cs in sorted(by_pair.items())
    ]
    evidence += _link_lines(inc, hosts) + _blocked_lines(a, stalled)
    verdict = _hosts_verdict(
        inc, VerdictKind.NETWORK_STRAGGLER, hosts, summary, evidence[: 2 * MAX_LISTED]
    )
    return [verdict]


def _death(code: int | None, signal: int | None) -> str:
    return f"signal {signal}" if signal else f"code {code}"


def _first_death(inc: Incident) -> tuple[int, int] | None:
    """The host of the first rank that died badly, and when (its wall clock)."""
    hosts = proc_hosts(inc)
    deaths = [(p.exit_wall_ns, hosts[i]) for i, p in enumerate(inc.procs)
              if p.died_badly and p.exit_wall_ns]  # fmt: skip
    if not deaths:
        return None
    when, host = min(deaths)
    return host, when


def _first_reset_on(inc: Incident, host: int) -> int | None:
    """The first reset a host's own dump recorded (its wall clock)."""
    t = inc.tcp
    mine = t[(t["host"] == host) & np.isin(t["event"], RESET_EVENTS)]
    return int(mine["ts"].min()) + _offset(inc, host) if len(mine) else None


def _first_error_wall(inc: Incident) -> int | None:
    """When the first call returned an error (wall clock)."""
    rows = inc.calls.rows
    if not len(rows):
        return None
    failed = rows["result"] > 0
    if not failed.any():
        return None
    hosts = np.array(proc_hosts(inc), dtype=np.int64)
    walls = np.array([_offset(inc, h) for h in range(len(inc.hosts))], dtype=np.int64)
    return int((rows["end"][failed] + walls[hosts[rows["proc"][failed]]]).min())

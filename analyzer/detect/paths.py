"""The paths between the job's hosts, as the agents' probes at the incident
found them: which host every failed probe shares, in which direction, and
above which size.

The metric (``path_report``): for each ordered pair of hosts and each size
probed, whether probes crossed from one to the other.  A probe answered
crossed both ways (UDP: at its size out, a small answer back; ICMP echo: at
its size both ways).  One that arrived at the peer's responder crossed one
way, whether or not its answer came back.  One the sender sent, that was
not answered, and that the peer's responder did not count although it
listened when it came (the peer's dump holds what its responder counted
after that time, and its agent probed too: its responder ran) was lost on
the way there; without the peer's count, it was lost one way or the other.
One the peer's host refused (no agent listened: it was down, or not yet
back) was not lost: the host answered.  A TCP exchange with the peer's
agent is its own size: it needs the handshake both ways.

The finding (``probe_finding``):
- every pair of hosts whose probes were lost shares one host (three hosts
  or more), and every pair without it got its probes across: that host; two
  hosts, or lost probes between one pair only of three or more: the pair;
- the direction: probes to the host lost and its own arriving (``in``), or
  the reverse (``out``), where the peers' counts tell;
- the size: probes up to ``SMALL_MAX`` bytes crossed and larger ones were
  lost on every such path: lost above the largest size that crossed (an MTU
  blackhole: a hop with a smaller MTU that sends no ICMP "fragmentation
  needed");
- datagrams crossed both ways and TCP exchanges failed: new connections
  fail (SYNs dropped, a port filtered).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from stallwatch.dumpers.schema import ProbeKind, ProbeOutcome, ProbeRole

from ..incident import EndChange, Incident, SlowLink, SlowWindow
from ..match import Matched
from ..verdict import Verdict, VerdictKind
from .common import MAX_LISTED, Analysis, who
from .cpu import sched_heavy
from .slowdown import window_since

# IPv4's smallest datagram every host must take whole (RFC 791: 576 bytes):
# a path that loses packets this small loses every packet, not the large ones
SMALL_MAX = 576
TCP_SIZE = -1  # the size key of a TCP exchange (it needs both ways at once)
# a responder's count holds what arrived until its dump: probes sent this
# long before the peer's dump had time to arrive (a loaded machine's
# scheduling delay, far above the lab's sub-millisecond path)
ARRIVAL_SLACK_NS = 1_000_000_000


@dataclass(slots=True)
class Crossing:
    """What the probes of one ordered pair of hosts, at one size, did."""

    crossed: bool = False  # some arrived at the other end (or were answered)
    lost_one_way: bool = False  # sent, unanswered, and the peer counted none
    lost_round_trip: bool = False  # sent and unanswered; the peer's count unknown


@dataclass(frozen=True, slots=True)
class ProbeFinding:
    hosts: tuple[int, ...]  # one host, or a pair nothing can separate
    way: str  # both, in (to the host), out (from it), unknown
    above: int | None  # packets larger than this crossed no path of the host; None: any size
    lost_at: int | None  # the smallest size lost there
    tcp_only: bool  # datagrams crossed, TCP exchanges did not
    lines: tuple[str, ...]  # evidence, for people
    # the host has a dump, its peers none here, and it reached none of them
    alone: bool = False
    peers: tuple[str, ...] = ()  # of one host: the peers its lost probes went to or came from


@dataclass(slots=True)
class PathReport:
    """Per (src, dst) host pair and size: the crossings; sizes in bytes."""

    crossings: dict[tuple[int, int, int], Crossing] = field(default_factory=dict)

    def at(self, src: int, dst: int, size: int) -> Crossing:
        return self.crossings.setdefault((src, dst, size), Crossing())

    def pairs(self) -> set[tuple[int, int]]:
        return {(min(s, d), max(s, d)) for s, d, _ in self.crossings}

    def sizes(self, a: int, b: int) -> list[int]:
        return sorted({z for s, d, z in self.crossings if {s, d} == {a, b}})

    def lost(self, a: int, b: int) -> bool:
        """Some probe between the two was lost (a way, or a round trip)."""
        return any(
            c.lost_one_way or (c.lost_round_trip and not self._answered_way(s, d, z))
            for (s, d, z), c in self.crossings.items()
            if {s, d} == {a, b}
        )

    def _answered_way(self, s: int, d: int, z: int) -> bool:
        """A round trip s->d->s lost at size z, where both ways are known to cross."""
        there, back = self.crossings.get((s, d, z)), self.crossings.get((d, s, min(z, SMALL_MAX)))
        return bool(there and there.crossed and back and back.crossed)


def _size(row: np.void) -> int:
    return TCP_SIZE if int(row["kind"]) == ProbeKind.TCP else int(row["size"])


def path_report(inc: Incident) -> PathReport:
    p = inc.probes
    report = PathReport()
    keep = (p["src"] >= 0) & (p["dst"] >= 0) & (p["src"] != p["dst"])
    p = p[keep]
    received = p[p["role"] == ProbeRole.RECEIVED]
    probing = set(np.unique(p["host"]).tolist())  # hosts whose agents probed: their responders ran
    counted: dict[tuple[int, int, int], int] = defaultdict(int)  # (src, dst, size): dst counted
    for r in received:
        counted[(int(r["src"]), int(r["dst"]), _size(r))] += int(r["answered"])
        if int(r["answered"]) > 0:
            report.at(int(r["src"]), int(r["dst"]), _size(r)).crossed = True
    for r in p[p["role"] == ProbeRole.SENT]:
        src, dst, size = int(r["src"]), int(r["dst"]), _size(r)
        if int(r["answered"]) > 0:
            report.at(src, dst, size).crossed = True
            back = size if int(r["kind"]) == ProbeKind.ICMP else min(size, SMALL_MAX)
            if size != TCP_SIZE:
                report.at(dst, src, back).crossed = True
            continue
        if int(r["sent"]) == 0 or int(r["outcome"]) == ProbeOutcome.ERROR:
            continue  # nothing left this host: no evidence of the path
        if int(r["outcome"]) == ProbeOutcome.REFUSED:
            continue  # the peer's host answered that its agent was not there: no loss
        if int(r["kind"]) != ProbeKind.ICMP and dst not in probing:
            continue  # the peer's agent answers these, not known to run; its kernel, echoes
        c = report.at(src, dst, size)
        if counted[(src, dst, size)] > 0:
            continue  # it arrived; the answer was lost on the way back (told by the other way)
        one_way = int(r["kind"]) == ProbeKind.UDP  # ICMP has no count; TCP needs both ways
        if one_way and dst in probing and _listened(inc, dst, int(r["wall"])):
            c.lost_one_way = True
        else:
            c.lost_round_trip = True
    return report


def _listened(inc: Incident, host: int, sent_wall: int) -> bool:
    """Whether the host's responder counted arrivals long enough after
    ``sent_wall`` (its dump read later) to have counted this probe."""
    captured = inc.captured[host] if host < len(inc.captured) else None
    return captured is not None and captured >= sent_wall + ARRIVAL_SLACK_NS


def host_name(inc: Incident, host: int) -> str:
    """A host's name; one without a dump here, its address (``unreached``)."""
    return inc.hosts[host] if host < len(inc.hosts) else inc.unreached[host - len(inc.hosts)]


def probe_finding(inc: Incident) -> ProbeFinding | None:
    report = path_report(inc)
    pairs = report.pairs()
    bad = {pair for pair in pairs if report.lost(*pair)}
    if not bad:
        return None
    common = set.intersection(*(set(pair) for pair in bad))
    if len(inc.hosts) + len(inc.unreached) > 2 and len(common) == 1:
        (host,) = common
        if any(host not in pair for pair in bad):
            return None
        if inc.unreached and not _beside(report, host) and not _alone(inc, bad, host):
            return None
        hosts: tuple[int, ...] = (host,)
    elif len(bad) == 1:
        hosts = tuple(sorted(next(iter(bad))))
    else:
        return None
    peers = sorted({h for pair in bad for h in pair} - set(hosts)) if len(hosts) == 1 else []
    return _finding(inc, report, hosts, peers, bad)


def _beside(report: PathReport, host: int) -> bool:
    """Probes between two other hosts crossed: what isolates ``host`` is
    not the network at large (a host without a dump here, named from its
    peers' dumps, is named only so)."""
    return any(c.crossed for (s, d, _), c in report.crossings.items() if host not in (s, d))


def _alone(inc: Incident, bad: set[tuple[int, int]], host: int) -> bool:
    """A host with a dump whose probes to every peer (two or more, none of
    them with a dump here) were lost: one cut explains it, where the
    alternative is every peer gone at once."""
    peers = {h for pair in bad for h in pair} - {host}
    return host < len(inc.hosts) and len(peers) >= 2 and min(peers) >= len(inc.hosts)


def _finding(
    inc: Incident,
    report: PathReport,
    hosts: tuple[int, ...],
    peers: list[int],
    bad: set[tuple[int, int]],
) -> ProbeFinding:
    host = hosts[0]
    others = peers or [hosts[1]]
    way = _way(report, host, others)  # of a pair: as seen from its first host
    sizes = sorted({z for a, b in bad for z in report.sizes(a, b) if z != TCP_SIZE})
    crossed, lost = _sizes(report, bad)
    above, lost_at = None, None
    if crossed and lost and max(crossed) < min(lost) and min(sizes) <= SMALL_MAX:
        above, lost_at = max(crossed), min(lost)
    tcp_only = bool(sizes) and not lost and any(
        report.crossings.get((s, d, TCP_SIZE), Crossing()).lost_one_way
        or report.crossings.get((s, d, TCP_SIZE), Crossing()).lost_round_trip
        for a, b in bad for s, d in ((a, b), (b, a))
    )  # fmt: skip
    lines = tuple(_lines(inc, report, bad))
    alone = len(hosts) == 1 and _alone(inc, bad, host)
    names = tuple(host_name(inc, h) for h in peers)
    return ProbeFinding(hosts, way, above, lost_at, tcp_only, lines, alone, names)


def _sizes(report: PathReport, bad: set[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Datagram sizes that crossed every bad path both ways, and sizes lost on some."""
    crossed, lost = set(), set()
    for (s, d, z), c in report.crossings.items():
        if z == TCP_SIZE or (min(s, d), max(s, d)) not in bad:
            continue
        if c.lost_one_way or (c.lost_round_trip and not c.crossed):
            lost.add(z)
        elif c.crossed:
            crossed.add(z)
    return sorted(crossed - lost), sorted(lost)


def _way(report: PathReport, host: int, peers: Iterable[int]) -> str:
    """in: probes to the host were lost, its own crossed; out: the reverse."""
    to_lost = from_lost = to_crossed = from_crossed = False
    for (s, d, _), c in report.crossings.items():
        if d == host and s in peers:
            to_lost |= c.lost_one_way
            to_crossed |= c.crossed
        elif s == host and d in peers:
            from_lost |= c.lost_one_way
            from_crossed |= c.crossed
    if to_lost and not from_lost and from_crossed:
        return "in"
    if from_lost and not to_lost and to_crossed:
        return "out"
    if to_lost and from_lost:
        return "both"
    return "unknown"


def _lines(inc: Incident, report: PathReport, bad: set[tuple[int, int]]) -> list[str]:
    out = []
    for a, b in sorted(bad):
        for s, d in ((a, b), (b, a)):
            crossed = [z for z in report.sizes(a, b) if report.at(s, d, z).crossed]
            lost = [z for z in report.sizes(a, b) if not report.at(s, d, z).crossed and (
                report.at(s, d, z).lost_one_way or report.at(s, d, z).lost_round_trip)]  # fmt: skip
            if not crossed and not lost:
                continue
            text = f"probes {host_name(inc, s)} -> {host_name(inc, d)}:"
            if crossed:
                text += f" crossed at {_size_text(crossed)}"
            if lost:
                text += (";" if crossed else "") + f" lost at {_size_text(lost)}"
                if not any(report.at(s, d, z).lost_one_way for z in lost):
                    text += " (or their answers, on the way back)"
            out.append(text)
    return out


def _size_text(sizes: list[int]) -> str:
    datagrams = [z for z in sizes if z != TCP_SIZE]
    if len(datagrams) > 3:
        text = f"{len(datagrams)} sizes from {datagrams[0]} to {datagrams[-1]} bytes"
    else:
        text = f"{', '.join(map(str, datagrams))} bytes" if datagrams else ""
    if len(datagrams) != len(sizes):
        text = f"{text} and a TCP exchange" if text else "a TCP exchange"
    return text


def finding_summary(inc: Incident, f: ProbeFinding) -> str:
    """One line for people: what the probes found."""
    names = [host_name(inc, h) for h in f.hosts]
    if len(names) == 2:
        a, b = names
        ways = {
            "in": f"from {b} to {a} are lost, from {a} to {b} they pass",
            "out": f"from {a} to {b} are lost, from {b} to {a} they pass",
        }
        lost = ways.get(f.way)
        if f.above is not None:
            lost = f"above {f.above} bytes between {a} and {b} are lost, small ones pass"
        what = f"packets {lost}" if lost else f"probes between {a} and {b} are lost"
        return f"{what}; with two hosts nothing tells whose link it is"
    name = names[0]
    if f.above is not None:
        return (
            f"packets above {f.above} bytes to and from {name} are lost (at {f.lost_at} and "
            f"more), small ones pass: an MTU mismatch on {name}'s path"
        )
    if f.tcp_only:
        return f"new TCP connections to and from {name} fail while datagrams pass"
    if f.alone:
        return (
            f"{name} reached none of its {len(f.peers)} peers ({', '.join(f.peers)}): no probe "
            f"it sent them was answered; one cut of {name} explains it (their dumps were out "
            "of its reach)"
        )
    if f.way == "in":
        return f"packets to {name} are lost while its own reach its peers: it is cut off one way"
    if f.way == "out":
        return f"packets from {name} are lost while its peers' reach it: it is cut off one way"
    if f.hosts[0] >= len(inc.hosts):
        return (
            f"host {name} is reached by no other host: probes to and from it are lost, "
            "between every other pair they pass; it left no dump (down, or cut off)"
        )
    return f"probes to and from {name} are lost, between every other pair they pass"


# ---- the job's connections over time: a slow link ------------------------------------

# TCP's delayed-ACK timer at its shortest (the kernel's TCP_DELACK_MIN, HZ/25):
# a round-trip sample may hold that much wait for an ACK with no queue at all
DELACK_MIN_US = 40_000
MIN_SAMPLES = 3  # a connection end's samples a median is taken of (one a second)
RECENT_NS = 30_000_000_000  # without an onset: the samples of the last 30 s before the dump


def end_changes(inc: Incident, onset_wall: int | None) -> list[EndChange]:
    c = inc.conns
    if not len(c):
        return []
    out = []
    keys = np.lexsort((c["wall"], c["host"], c["conn"]))
    c = c[keys]
    cut = np.flatnonzero(
        np.r_[True, (c["conn"][1:] != c["conn"][:-1]) | (c["host"][1:] != c["host"][:-1])]
    )
    for a, b in zip(cut.tolist(), [*cut[1:].tolist(), len(c)], strict=True):
        rows = c[a:b]
        rows = rows[rows["srtt_us"] >= 0]
        if not len(rows):
            continue
        since = onset_wall if onset_wall is not None else int(rows["wall"][-1]) - RECENT_NS
        before, after = rows[rows["wall"] < since], rows[rows["wall"] >= since]
        if len(after) < MIN_SAMPLES:
            continue
        base = before if onset_wall is not None and len(before) >= MIN_SAMPLES else None
        # a rate sample limited by the sender (nothing to send) says nothing of the path
        rate = after["delivery_rate"][(after["delivery_rate"] >= 0) & (after["app_limited"] == 0)]
        retrans = after["total_retrans"][after["total_retrans"] >= 0]
        start = (
            before["total_retrans"][-1] if base is not None else (retrans[0] if len(retrans) else 0)
        )
        out.append(
            EndChange(
                host=int(rows["local"][0]),
                peer=int(rows["remote"][0]),
                conn=int(rows["conn"][0]),
                base_srtt_us=float(np.median(base["srtt_us"])) if base is not None else None,
                base_bound_us=(
                    float(np.median(base["srtt_us"] + 4 * base["rttvar_us"]))
                    if base is not None
                    else None
                ),
                srtt_us=float(np.median(after["srtt_us"])),
                rate_bps=float(np.median(rate)) * 8 if len(rate) else None,
                retrans=int(retrans[-1] - max(start, 0)) if len(retrans) else 0,
                pid=int(rows["pid"][-1]) or None,
            )
        )
    return out


def _slowed(e: EndChange) -> bool:
    """Against its own baseline: its round trip rose past TCP's own edge of
    normal and past what a delayed ACK can add."""
    if e.base_srtt_us is None or e.base_bound_us is None:
        return False
    return e.srtt_us > max(e.base_bound_us, e.base_srtt_us + DELACK_MIN_US)


def slow_link(inc: Incident, onset_wall: int | None) -> SlowLink | None:
    """The host every slowed connection of the job touches (three hosts or
    more), with connections between the other hosts that kept their pace."""
    if len(inc.hosts) < 3:
        return None
    ends = end_changes(inc, onset_wall)
    judged = [e for e in ends if e.base_srtt_us is not None]
    if len(judged) >= max(3, len(ends) // 2):
        slowed = [e for e in judged if _slowed(e)]
        return _shared(inc, slowed, judged, baseline=True)
    return _across(inc, ends)


def _shared(
    inc: Incident, slowed: list[EndChange], judged: list[EndChange], baseline: bool
) -> SlowLink | None:
    if not slowed:
        return None
    common = set.intersection(*({e.host, e.peer} for e in slowed))
    if len(common) != 1:
        return None
    (host,) = common
    others = [e for e in judged if host not in (e.host, e.peer)]
    if not others:  # nothing to tell the host's connections from the job's own pace
        return None
    peers = tuple(sorted({e.host if e.peer == host else e.peer for e in slowed}))
    return SlowLink(host, peers, tuple(slowed), tuple(others), baseline)


def _across(inc: Incident, ends: list[EndChange]) -> SlowLink | None:
    """Without a baseline: the host whose connections' round trips sit a
    delayed ACK above the median of the connections without it, where none
    of those does.  A host found only through its connections to another
    host found (the slow host's connections are most of those without this
    one, and lift their median) is that host's peer, not a second slow
    host: only a host with a slowed connection that touches no other host
    found is kept."""
    found = []
    for host in range(len(inc.hosts)):
        others = [e for e in ends if host not in (e.host, e.peer)]
        mine = [e for e in ends if host in (e.host, e.peer)]
        if len(others) < MIN_SAMPLES or not mine:
            continue
        bound = float(np.median([e.srtt_us for e in others])) + DELACK_MIN_US
        slowed = [e for e in mine if e.srtt_us > bound]
        if slowed and not any(e.srtt_us > bound for e in others):
            peers = tuple(sorted({e.host if e.peer == host else e.peer for e in slowed}))
            found.append(SlowLink(host, peers, tuple(slowed), tuple(others), False))
    hosts = {s.host for s in found}
    found = [s for s in found if any(not {e.host, e.peer} & (hosts - {s.host}) for e in s.slowed)]
    return found[0] if len(found) == 1 else None


@dataclass(frozen=True, slots=True)
class Load:
    """A host's job interfaces over a window: what they carried, and how much
    of it the job's own connections account for (bits/s)."""

    name: str
    tx_bps: float
    rx_bps: float
    job_tx_bps: float
    job_rx_bps: float
    qdisc_drops: int
    qdisc_overlimits: int

    @property
    def other_tx_bps(self) -> float:
        return max(0.0, self.tx_bps - self.job_tx_bps)

    @property
    def other_rx_bps(self) -> float:
        return max(0.0, self.rx_bps - self.job_rx_bps)


def _rate(values: np.ndarray, walls: np.ndarray) -> float:
    ok = values >= 0
    values, walls = values[ok], walls[ok]
    if len(values) < 2 or walls[-1] <= walls[0]:
        return 0.0
    return float(values[-1] - values[0]) * 8e9 / float(walls[-1] - walls[0])


def host_load(inc: Incident, host: int, since_wall: int) -> list[Load]:
    """The host's job interfaces since ``since_wall``: the traffic, and the
    job's part of it (its connections' bytes sent and received)."""
    c = inc.conns
    mine = c[(c["host"] == host) & (c["local"] == host) & (c["wall"] >= since_wall)]
    job_tx = job_rx = 0.0
    for key in np.unique(mine["conn"]):
        rows = mine[mine["conn"] == key]
        job_tx += _rate(rows["bytes_sent"], rows["wall"])
        job_rx += _rate(rows["bytes_received"], rows["wall"])
    out = []
    f = inc.ifaces
    f = f[(f["host"] == host) & (f["wall"] >= since_wall)]
    for index in np.unique(f["ifindex"]):
        rows = f[f["ifindex"] == index]
        if len(rows) < 2:
            continue
        drops, over = rows["qdisc_drops"], rows["qdisc_overlimits"]
        out.append(
            Load(
                str(rows["name"][0]),
                _rate(rows["tx_bytes"], rows["wall"]),
                _rate(rows["rx_bytes"], rows["wall"]),
                job_tx,
                job_rx,
                int(drops[-1] - drops[0]) if drops[0] >= 0 and drops[-1] >= 0 else 0,
                int(over[-1] - over[0]) if over[0] >= 0 and over[-1] >= 0 else 0,
            )
        )
    return out


def _mbit(bps: float) -> str:
    return f"{bps / 1e6:.1f} Mbit/s"


def _ms(us: float) -> str:
    return f"{us / 1000:.1f} ms"


def slow_link_lines(inc: Incident, s: SlowLink, since_wall: int) -> list[str]:
    name = inc.hosts[s.host]
    lines = []
    for peer in s.peers:
        ends = [e for e in s.slowed if {e.host, e.peer} == {s.host, peer}]
        rtt = float(np.median([e.srtt_us for e in ends]))
        rates = [e.rate_bps for e in ends if e.rate_bps is not None]
        text = f"{name} - {inc.hosts[peer]}: {len(ends)} connection end(s) slowed, round trip "
        text += _ms(rtt) + " (median)"
        base = [e.base_srtt_us for e in ends if e.base_srtt_us is not None]
        if base:
            text += f" against {_ms(float(np.median(base)))} before"
        if rates:
            text += f", delivery rate {_mbit(float(np.median(rates)))}"
        retrans = sum(e.retrans for e in ends)
        if retrans:
            text += f", {retrans} segments retransmitted"
        lines.append(text)
    kept = float(np.median([e.srtt_us for e in s.others]))
    pairs = sorted({(min(e.host, e.peer), max(e.host, e.peer)) for e in s.others})
    lines.append(
        "connections between the other hosts kept their pace: round trip "
        f"{_ms(kept)} (median; {', '.join(f'{inc.hosts[a]}-{inc.hosts[b]}' for a, b in pairs)})"
    )
    for load in host_load(inc, s.host, since_wall):
        text = (
            f"{name}'s {load.name} carried {_mbit(load.tx_bps)} out and {_mbit(load.rx_bps)} in; "
            f"the job's connections {_mbit(load.job_tx_bps)} and {_mbit(load.job_rx_bps)}"
        )
        if load.qdisc_drops or load.qdisc_overlimits:
            text += (
                f"; its queue dropped {load.qdisc_drops} packets and held back "
                f"{load.qdisc_overlimits} over its rate"
            )
        lines.append(text)
    return lines


def load_text(inc: Incident, s: SlowLink, since_wall: int) -> str | None:
    """The traffic on the host's link that is not the job's, when it is a
    good part of it ("node1's eth0 carried 32 Mbit/s that is not the job's")."""
    loads = host_load(inc, s.host, since_wall)
    other = [(ld, max(ld.other_tx_bps, ld.other_rx_bps)) for ld in loads]
    # a load worth naming: at least half what the job itself moved over the link
    other = [(ld, bps) for ld, bps in other if 2 * bps >= max(ld.job_tx_bps, ld.job_rx_bps)]
    if not other:
        return None
    ld, bps = max(other, key=lambda x: x[1])
    way = "out" if ld.other_tx_bps >= ld.other_rx_bps else "in"
    return f"{inc.hosts[s.host]}'s {ld.name} carried {_mbit(bps)} {way} that is not the job's"


def onset_wall(inc: Incident, windows: Iterable[SlowWindow], m: Matched) -> int | None:
    """When the slow windows began, wall clock (the earliest host's)."""
    found = [w for w in windows if w.onset]
    if not found:
        return None
    walls = [ts + (inc.to_wall(h) or 0) for h, ts in window_since(inc, m, found).items()]
    return min(walls) if walls else None


def link_slowed(a: Analysis) -> SlowLink | None:
    """The slow link, where starvation does not explain it: a host whose
    ranks are starved of CPU answers late on their own connections (``cpu``'s
    verdicts judge it), but where connections of its processes that are not
    starved slowed as well, the link slowed them."""
    s = a.slow_link
    if s is None:
        return None
    inc = a.incident
    starved = {(inc.procs[p].host, inc.procs[p].pid) for p in sched_heavy(a)}
    name = inc.hosts[s.host]
    if all(host != name for host, _ in starved):
        return s
    beyond = any(
        e.host == s.host and e.pid is not None and (name, e.pid) not in starved for e in s.slowed
    )
    return s if beyond else None


def detect_slow_link(a: Analysis) -> list[Verdict]:
    """A slowdown pinned to a link: the host whose connections' round trips
    rose (against their own baseline, or above every connection without it)
    while the job's other connections kept their pace, and not only those of
    its processes starved of CPU (``link_slowed``)."""
    s = link_slowed(a)
    inc = a.incident
    if s is None:
        return []
    since = a.slow_since_wall if a.slow_since_wall is not None else 0
    name = inc.hosts[s.host]
    peers = ", ".join(inc.hosts[p] for p in s.peers)
    rtt = float(np.median([e.srtt_us for e in s.slowed]))
    kept = float(np.median([e.srtt_us for e in s.others]))
    base = [e.base_srtt_us for e in s.slowed if e.base_srtt_us is not None]
    was = f" from {_ms(float(np.median(base)))}" if base else ""
    summary = (
        f"host {name}'s link slowed the job: its connections to {peers} took {_ms(rtt)} a round "
        f"trip{was} while those between the other hosts kept {_ms(kept)}"
    )
    load = load_text(inc, s, since)
    if load is not None:
        summary += f"; {load}"
    evidence = slow_link_lines(inc, s, since)
    probed = probe_finding(inc) if len(inc.probes) else None
    if probed is not None and probed.hosts == (s.host,):  # a full queue drops probes too
        evidence += [f"at the incident, {line}" for line in probed.lines]
    procs = [i for i, p in enumerate(inc.procs) if p.host == name]
    ranks, hosts, pids = who(inc, procs)
    return [
        Verdict(
            VerdictKind.NETWORK_STRAGGLER,
            ranks,
            hosts,
            pids,
            None,
            None,
            None,
            summary,
            tuple(evidence[:MAX_LISTED]),
        )
    ]

"""The paths between hosts (analyzer.detect.paths): the probes at an incident
name the host every lost probe shares, the direction and the size; the
connections sampled every second pin a slowdown to the host whose round
trips rose.  Synthetic tables, each rule both ways."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest

from stallwatch.analyzer.columns import Columns
from stallwatch.analyzer.detect import paths
from stallwatch.analyzer.detect.common import Analysis
from stallwatch.analyzer.incident import (
    CALL_DTYPE,
    CONN_SAMPLE_DTYPE,
    CONN_SAMPLE_VALUES,
    IFACE_DTYPE,
    IFACE_VALUES,
    PROBE_DTYPE,
    SCHED_DTYPE,
    TCP_DTYPE,
    Calls,
    Incident,
    Proc,
    SchedDelays,
)
from stallwatch.analyzer.verdict import VerdictKind
from stallwatch.dumpers.schema import ProbeKind, ProbeOutcome, ProbeRole

S = 1_000_000_000
T0 = 1_800_000_000 * S  # wall clock of the probes
SIZES = (128, 256, 512, 576, 1024, 1200, 1400, 1500)


def incident(
    nhosts: int,
    probes: np.ndarray | None = None,
    conns: np.ndarray | None = None,
    ifaces: np.ndarray | None = None,
    captured: int = T0 + 5 * S,
) -> Incident:
    return Incident(
        id="inc",
        hosts=tuple(f"node{k}" for k in range(nhosts)),
        host_now=(None,) * nhosts,
        procs=(),
        comms=(),
        calls=Calls(Columns.zeros(CALL_DTYPE)),
        tcp=np.zeros(0, dtype=TCP_DTYPE),
        sched=np.zeros(0, dtype=SCHED_DTYPE),
        captured=(captured,) * nhosts,
        wall_offset=(0,) * nhosts,
        probes=probes if probes is not None else np.zeros(0, dtype=PROBE_DTYPE),
        conns=conns if conns is not None else np.zeros(0, dtype=CONN_SAMPLE_DTYPE),
        ifaces=ifaces if ifaces is not None else np.zeros(0, dtype=IFACE_DTYPE),
    )


def probe_rows(
    nhosts: int, crosses: object, kinds: Iterable[ProbeKind] = (ProbeKind.UDP,)
) -> np.ndarray:
    """Every host probes every other at every size: ``crosses(src, dst, size)``
    says whether a packet of that size gets from src to dst.  A UDP probe is
    answered when it crosses there and its small answer crosses back; the
    responder counts what arrives."""
    rows = []
    for src in range(nhosts):
        for dst in range(nhosts):
            if src == dst:
                continue
            for kind in kinds:
                for size in SIZES:
                    there = crosses(src, dst, size)  # type: ignore[operator]
                    back = crosses(dst, src, min(size, 128) if kind == ProbeKind.UDP else size)  # type: ignore[operator]
                    answered = 3 if there and back else 0
                    rows.append((src, src, dst, kind, ProbeRole.SENT,
                                 ProbeOutcome.OK if answered else ProbeOutcome.LOST, size, 3,
                                 answered))  # fmt: skip
                    if kind == ProbeKind.UDP and there:
                        rows.append((dst, src, dst, kind, ProbeRole.RECEIVED, ProbeOutcome.OK,
                                     size, 3, 3))  # fmt: skip
    out = np.zeros(len(rows), dtype=PROBE_DTYPE)
    for i, (host, src, dst, kind, role, outcome, size, sent, answered) in enumerate(rows):
        out[i] = (host, T0, src, dst, kind, role, outcome, size, sent, answered, -1, -1, 1)
    return out


def finding(nhosts: int, crosses: object) -> paths.ProbeFinding | None:
    return paths.probe_finding(incident(nhosts, probe_rows(nhosts, crosses)))


def test_healthy_paths_find_nothing() -> None:
    assert finding(4, lambda s, d, z: True) is None


@pytest.mark.parametrize("host", [0, 2])
def test_a_host_cut_off_is_named_alone_both_ways(host: int) -> None:
    f = finding(4, lambda s, d, z: host not in (s, d))
    assert f is not None and f.hosts == (host,) and f.way == "both" and f.above is None
    assert "probes to and from" in paths.finding_summary(incident(4), f)


def test_a_one_way_cut_names_the_host_and_the_direction() -> None:
    into = finding(3, lambda s, d, z: d != 1)  # packets to node1 lost
    assert into is not None and into.hosts == (1,) and into.way == "in"
    out_of = finding(3, lambda s, d, z: s != 1)
    assert out_of is not None and out_of.hosts == (1,) and out_of.way == "out"
    assert "packets to node1 are lost" in paths.finding_summary(incident(3), into)


def test_without_the_peers_counts_a_lost_probe_has_no_direction() -> None:
    """The cut host's agent left no probe rows (its dump lost): its kernel's
    unanswered echoes name it, and nothing says whether probes to it arrived."""
    rows = probe_rows(3, lambda s, d, z: d != 1, kinds=(ProbeKind.UDP, ProbeKind.ICMP))
    f = paths.probe_finding(incident(3, rows[rows["host"] != 1]))
    assert f is not None and f.hosts == (1,) and f.way == "unknown"


def test_a_host_whose_agent_is_gone_is_no_lost_path() -> None:
    """Node 1's agent is dead: its responder answers no datagram and accepts
    no TCP probe, while its kernel answers every echo.  Paths that carry the
    echoes are not cut; only ICMP is evidence for a host whose agent left no
    probe rows."""
    rows = probe_rows(3, lambda s, d, z: True, kinds=(ProbeKind.UDP, ProbeKind.ICMP))
    mine = rows[rows["host"] != 1]
    dead = (mine["dst"] == 1) & (mine["kind"] == ProbeKind.UDP)
    mine["answered"][dead] = 0
    mine["outcome"][dead] = ProbeOutcome.LOST
    assert paths.probe_finding(incident(3, mine)) is None
    mine["answered"][mine["dst"] == 1] = 0  # the echoes lost too: the host is cut
    mine["outcome"][mine["dst"] == 1] = ProbeOutcome.LOST
    f = paths.probe_finding(incident(3, mine))
    assert f is not None and f.hosts == (1,)


def test_probes_refused_while_the_peers_agent_restarted_are_no_lost_path() -> None:
    """Node 1's agent was down while node 0 probed it (its host refused the
    datagrams and the TCP exchange: nobody listened), then came back and
    probed node 0: those refusals are the host answering, not a cut; the same
    probes lost without a word are."""
    rows = probe_rows(2, lambda s, d, z: True, kinds=(ProbeKind.UDP, ProbeKind.TCP))
    down = (rows["host"] == 0) & (rows["dst"] == 1)
    rows["answered"][down] = 0
    rows["outcome"][down] = ProbeOutcome.REFUSED
    rows = rows[~((rows["host"] == 1) & (rows["role"] == ProbeRole.RECEIVED))]
    assert paths.probe_finding(incident(2, rows)) is None
    rows["outcome"][rows["outcome"] == ProbeOutcome.REFUSED] = ProbeOutcome.LOST
    f = paths.probe_finding(incident(2, rows))
    assert f is not None and f.hosts == (0, 1)


def test_a_peer_dump_read_before_the_probes_came_counts_nothing() -> None:
    rows = probe_rows(3, lambda s, d, z: d != 1)
    f = paths.probe_finding(incident(3, rows, captured=T0))  # read as they were sent
    assert f is not None and f.way == "unknown"


def test_an_mtu_blackhole_is_named_with_its_size() -> None:
    f = finding(4, lambda s, d, z: z <= 1024 or 3 not in (s, d))
    assert f is not None and f.hosts == (3,) and (f.above, f.lost_at) == (1024, 1200)
    text = paths.finding_summary(incident(4), f)
    assert "above 1024 bytes to and from node3 are lost" in text


def test_small_probes_lost_too_is_no_size_threshold() -> None:
    f = finding(4, lambda s, d, z: 3 not in (s, d) or 512 < z <= 1024)
    assert f is not None and f.hosts == (3,) and f.above is None


def test_two_hosts_are_a_pair() -> None:
    f = finding(2, lambda s, d, z: False)
    assert f is not None and f.hosts == (0, 1)


def test_two_hosts_cut_one_way_are_a_pair_with_the_direction() -> None:
    f = finding(2, lambda s, d, z: d != 1)
    assert f is not None and f.hosts == (0, 1)
    text = paths.finding_summary(incident(2), f)
    assert text.startswith("packets from node0 to node1 are lost, from node1 to node0 they pass")


def test_lost_probes_on_two_separate_pairs_name_nobody() -> None:
    f = finding(4, lambda s, d, z: {s, d} not in ({0, 1}, {2, 3}))
    assert f is None


def test_one_pair_of_three_hosts_is_that_pair() -> None:
    f = finding(3, lambda s, d, z: {s, d} != {0, 2})
    assert f is not None and f.hosts == (0, 2)


def _split(nhosts: int, dumps: Iterable[int], crosses: object) -> Incident:
    """Every host probed every other at the incident (UDP, TCP and echoes),
    but only ``dumps`` hosts' dumps are here: the others are known by the
    addresses probes went to (``unreached``), after the hosts with a dump."""
    kept = list(dumps)
    order = kept + [h for h in range(nhosts) if h not in kept]  # old index -> new
    rows = probe_rows(nhosts, crosses, kinds=(ProbeKind.UDP, ProbeKind.TCP, ProbeKind.ICMP))
    rows = rows[np.isin(rows["host"], kept)]
    for name in ("host", "src", "dst"):
        rows[name] = np.array([order.index(int(x)) for x in rows[name]], dtype=np.int32)
    inc = incident(len(kept), rows)
    absent = tuple(f"10.0.0.{h + 1}" for h in order[len(kept) :])
    return dataclasses.replace(inc, unreached=absent)


def test_a_host_without_a_dump_that_no_peer_reaches_is_named_by_its_address() -> None:
    """Node 0 is cut off; its dump is not here: every probe of its three
    peers to it was lost, theirs to each other crossed."""
    inc = _split(4, (1, 2, 3), lambda s, d, z: 0 not in (s, d))
    f = paths.probe_finding(inc)
    assert f is not None and f.hosts == (3,) and not f.alone
    assert paths.host_name(inc, 3) == "10.0.0.1"
    text = paths.finding_summary(inc, f)
    assert text.startswith("host 10.0.0.1 is reached by no other host") and "no dump" in text


def test_a_host_without_a_dump_whose_peers_cannot_reach_each_other_is_not_named() -> None:
    """The same, but the network at large is down: the peers' probes to
    each other were lost too; nothing isolates one host."""
    inc = _split(4, (1, 2, 3), lambda s, d, z: False)
    assert paths.probe_finding(inc) is None


def test_a_host_that_reached_none_of_its_peers_names_itself_alone() -> None:
    """Node 0's own dump only (its incident gathered no peer's): every probe
    it sent its three peers went unanswered."""
    inc = _split(4, (0,), lambda s, d, z: 0 not in (s, d))
    f = paths.probe_finding(inc)
    assert f is not None and f.hosts == (0,) and f.alone
    assert f.peers == ("10.0.0.2", "10.0.0.3", "10.0.0.4")
    assert paths.finding_summary(inc, f).startswith("node0 reached none of its 3 peers")


def test_a_host_with_one_peer_unreached_is_no_more_than_the_pair() -> None:
    """Alone with a single peer it cannot reach, nothing tells whose link it
    is; a peer's dump alone, that reaches the others and not node 0: the pair."""
    lone = paths.probe_finding(_split(2, (0,), lambda s, d, z: False))
    assert lone is not None and lone.hosts == (0, 1) and not lone.alone
    peer = paths.probe_finding(_split(4, (1,), lambda s, d, z: 0 not in (s, d)))
    assert peer is not None and len(peer.hosts) == 2 and not peer.alone


def test_a_host_without_a_dump_whose_host_refused_is_not_cut() -> None:
    """Node 0's agent is gone, its host up: it refused the datagrams and the
    TCP exchanges, and answered the echoes."""
    inc = _split(4, (1, 2, 3), lambda s, d, z: True)
    p = inc.probes
    gone = (p["dst"] == 3) & (p["kind"] != ProbeKind.ICMP) & (p["role"] == ProbeRole.SENT)
    p["answered"][gone], p["outcome"][gone] = 0, ProbeOutcome.REFUSED
    assert paths.probe_finding(inc) is None


def test_datagrams_crossing_and_tcp_failing_is_new_connections_failing() -> None:
    rows = probe_rows(3, lambda s, d, z: True, kinds=(ProbeKind.UDP,))
    tcp = np.zeros(4, dtype=PROBE_DTYPE)
    for i, (src, dst) in enumerate(((0, 2), (2, 0), (1, 2), (2, 1))):
        tcp[i] = (src, T0, src, dst, ProbeKind.TCP, ProbeRole.SENT, ProbeOutcome.LOST, 65536, 1,
                  0, -1, -1, 1)  # fmt: skip
    f = paths.probe_finding(incident(3, np.concatenate([rows, tcp])))
    assert f is not None and f.hosts == (2,) and f.tcp_only
    assert "new TCP connections" in paths.finding_summary(incident(3), f)


# ---- connections over time ----------------------------------------------------------


def conn_rows(nhosts: int, srtt: object, seconds: int = 60, rttvar_us: int = 200) -> np.ndarray:
    """Two connections between every pair of hosts, both ends sampled every
    second; ``srtt(a, b, t)`` gives the round trip (us) at second t."""
    rows = []
    key = 1
    for a in range(nhosts):
        for b in range(a + 1, nhosts):
            for _ in range(2):
                for t in range(seconds):
                    for local, remote in ((a, b), (b, a)):
                        rows.append((local, T0 + t * S, local, remote, key, srtt(a, b, t)))  # type: ignore[operator]
                key += 1
    out = np.zeros(len(rows), dtype=CONN_SAMPLE_DTYPE)
    for name in CONN_SAMPLE_VALUES:
        out[name] = -1
    for i, (host, wall, local, remote, key, rtt) in enumerate(rows):
        out[i]["host"], out[i]["wall"], out[i]["local"], out[i]["remote"] = (
            host,
            wall,
            local,
            remote,
        )
        out[i]["conn"], out[i]["srtt_us"], out[i]["rttvar_us"] = key, rtt, rttvar_us
        out[i]["total_retrans"], out[i]["app_limited"] = 0, 1
    return out


ONSET = T0 + 30 * S


def test_a_slowdown_is_pinned_to_the_host_whose_round_trips_rose() -> None:
    rtt = lambda a, b, t: 100_000 if t >= 30 and 1 in (a, b) else 300  # noqa: E731
    s = paths.slow_link(incident(4, conns=conn_rows(4, rtt)), ONSET)
    assert s is not None and s.host == 1 and s.peers == (0, 2, 3) and s.baseline


def test_a_rise_within_a_delayed_ack_is_not_a_slow_link() -> None:
    rtt = lambda a, b, t: 300 + 30_000 * (t >= 30 and 1 in (a, b))  # noqa: E731
    assert paths.slow_link(incident(4, conns=conn_rows(4, rtt)), ONSET) is None


def test_a_job_slowed_alike_pins_nothing() -> None:
    rtt = lambda a, b, t: 100_000 if t >= 30 else 300  # noqa: E731
    assert paths.slow_link(incident(4, conns=conn_rows(4, rtt)), ONSET) is None


def test_without_a_baseline_the_host_above_the_others_is_named() -> None:
    rtt = lambda a, b, t: 90_000 if 2 in (a, b) else 12_000  # noqa: E731
    s = paths.slow_link(incident(3, conns=conn_rows(3, rtt, seconds=20)), None)
    assert s is not None and s.host == 2 and not s.baseline
    healthy = lambda a, b, t: 12_000 + 20_000 * (2 in (a, b))  # noqa: E731
    assert paths.slow_link(incident(3, conns=conn_rows(3, healthy, seconds=20)), None) is None


def test_without_a_baseline_a_peer_of_the_slow_host_is_not_named_with_it() -> None:
    """Four hosts, node3's link slow, no baseline: of the connections
    without node0, two of three are node3's, so their median is node3's
    pace, and node0's own connections to node3 (the slowest) sit above it.
    Every such connection of node0 touches node3: node0 is its peer."""

    def rtt(a: int, b: int, t: int) -> int:
        if {a, b} == {0, 3}:
            return 160_000
        return 110_000 if 3 in (a, b) else 12_000

    s = paths.slow_link(incident(4, conns=conn_rows(4, rtt, seconds=20)), None)
    assert s is not None and s.host == 3 and s.peers == (0, 1, 2)
    # two slow hosts, each with a slowed connection of its own: nobody alone
    both = lambda a, b, t: 110_000 if {a, b} & {0, 3} else 12_000  # noqa: E731
    assert paths.slow_link(incident(4, conns=conn_rows(4, both, seconds=20)), None) is None


def starved_analysis(slowed_pids: set[int]) -> Analysis:
    """Three hosts of two ranks (pids 10 + 2 host + local rank); node1's
    connections slowed, those of ``slowed_pids`` among its own ends; rank
    pid 12 (node1's first) starved of CPU by outside processes, 10x the
    others."""
    rtt = lambda a, b, t: 120_000 if 1 in (a, b) else 12_000  # noqa: E731
    conns = conn_rows(3, rtt, seconds=20)
    mine = conns["local"] == 1
    pids = np.where(conns["conn"] % 2 == 0, 12, 13)  # each connection is one rank's
    conns["pid"] = np.where(mine, pids, 10 + 2 * conns["local"])
    conns["srtt_us"][mine & ~np.isin(conns["pid"], list(slowed_pids))] = 12_000
    procs = tuple(Proc(f"node{h}", 10 + 2 * h + r, 2 * h + r, f"node{h}") for h in range(3)
                  for r in range(2))  # fmt: skip
    inc = dataclasses.replace(incident(3, conns=conns), procs=procs)
    outside = np.full(6, 20_000_000, dtype=np.int64)
    outside[2] = 200_000_000
    zero = np.zeros(6, dtype=np.int64)
    return Analysis(inc, None, (), (), (), None, SchedDelays(outside, zero, zero),  # type: ignore[arg-type]
                    slow_link=paths.slow_link(inc, None))  # fmt: skip


def test_a_slow_link_beyond_its_starved_rank_is_the_links() -> None:
    """The connections of node1's rank that is not starved slowed too: the
    link slowed them, not the starvation of the other rank."""
    a = starved_analysis({12, 13})
    assert a.slow_link is not None and a.slow_link.host == 1
    assert paths.link_slowed(a) is a.slow_link
    [v] = paths.detect_slow_link(a)
    assert v.kind is VerdictKind.NETWORK_STRAGGLER and set(v.hosts) == {"node1"}


def test_a_slow_link_of_its_starved_rank_alone_is_the_starvations() -> None:
    """Only the starved rank's own connections answer late: a starved
    process does that, and the CPU verdicts judge it."""
    a = starved_analysis({12})
    assert a.slow_link is not None and a.slow_link.host == 1
    assert paths.link_slowed(a) is None and paths.detect_slow_link(a) == []


def test_two_hosts_pin_no_slow_link() -> None:
    rtt = lambda a, b, t: 100_000 if t >= 30 else 300  # noqa: E731
    assert paths.slow_link(incident(2, conns=conn_rows(2, rtt)), ONSET) is None


def test_the_load_that_is_not_the_jobs_is_named() -> None:
    rtt = lambda a, b, t: 100_000 if t >= 30 and 1 in (a, b) else 300  # noqa: E731
    conns = conn_rows(4, rtt)
    mine = (conns["host"] == 1) & (conns["local"] == 1)
    seconds = (conns["wall"] - T0) // S
    conns["bytes_sent"] = np.where(mine, seconds * 1_000_000, 0)  # 8 Mbit/s a connection end
    conns["bytes_received"] = np.where(mine, seconds * 1_000_000, 0)
    ifaces = np.zeros(60, dtype=IFACE_DTYPE)
    ifaces["host"], ifaces["wall"], ifaces["ifindex"], ifaces["name"] = (
        1,
        T0 + np.arange(60) * S,
        2,
        "eth0",
    )
    for name in IFACE_VALUES:
        ifaces[name] = 0
    ifaces["tx_bytes"] = np.arange(60) * 10_000_000  # 80 Mbit/s out: 32 of it not the job's
    ifaces["rx_bytes"] = np.arange(60) * 6_000_000
    inc = incident(4, conns=conns, ifaces=ifaces)
    s = paths.slow_link(inc, ONSET)
    assert s is not None
    text = paths.load_text(inc, s, ONSET)
    assert text == "node1's eth0 carried 32.0 Mbit/s out that is not the job's"


def test_a_lab_run_whose_agent_restarted_during_the_probes_finds_no_lost_path() -> None:
    """The recorded race (tests/data/lab-agent-restart-2x2): node 1 probed
    node 0 while node 0's agent was down and back before the dump."""
    from stallwatch.analyzer.pipeline import analyze_paths

    data = Path(__file__).parent.parent / "data" / "lab-agent-restart-2x2"
    (inc,) = analyze_paths([str(data)]).incidents
    assert [v.kind.value for v in inc.verdicts] == ["missing_rank"], inc.verdicts

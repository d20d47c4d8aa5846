"""Probes between the job's nodes (recorder.pathprobe, recorder.pathecho) on
the lab's veths, every node probing the others at once as agents do at an
incident: a one-direction cut on one node's switch port is seen as such
from both ends (its probes arrive, their answers do not; what it is sent
never arrives), and an MTU blackhole on one node's port is seen with its
size (small packets pass both ways, large ones are lost, the limit found
to a few bytes); the probes keep to their bounds of time and bytes."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

from stallwatch.dumpers.layout import ProbeKind, ProbeOutcome, ProbeRole
from stallwatch.lab import netns
from stallwatch.recorder.pathecho import PathEcho
from stallwatch.recorder.pathprobe import (
    MAX_PEER_BYTES,
    Peer,
    ProbeConfig,
    Prober,
    between,
    choose_peers,
    ladder,
    silent_peers,
)
from stallwatch.recorder.pathwire import ProbeRing, probe_key
from tests.recorder.netlab import Lab, lab_network

PORT = 9401
KEY = probe_key("a token the agents share")
CONFIG = ProbeConfig(port=PORT, max_peers=8, window_s=2.0)
BLACKHOLE = 1200  # bytes: what the switch port lets through, IP header included


def _ip(text: str) -> bytes:
    return socket.inet_aton(text).ljust(16, b"\0")


@dataclass
class Node:
    echo: PathEcho
    ring: ProbeRing
    prober: Prober


def _nodes(lab: Lab, n: int) -> list[Node]:
    out = []
    for k in range(n):
        ring = ProbeRing(4096)
        echo = PathEcho(PORT, KEY, ring)
        assert netns.in_netns(lab.node(k).netns, echo.start)
        out.append(Node(echo, ring, Prober(CONFIG, KEY, ring)))
    return out


def _round(
    lab: Lab, nodes: list[Node], incident: str, silent: dict[int, frozenset[str]] | None = None
) -> dict[int, np.ndarray]:
    """Every node probes every other at once; each node's ring after (and
    in ``silent``, the peers each found silent: ``silent_peers``)."""
    done: dict[int, float] = {}

    def probe(k: int) -> Callable[[], None]:
        me = lab.node(k)
        peers = [Peer(_ip(me.ip), _ip(o.ip), socket.AF_INET)
                 for o in lab.net.nodes if o.index != k]  # fmt: skip

        def run() -> None:
            t0 = time.monotonic()
            rows = netns.in_netns(me.netns, lambda: nodes[k].prober.probe(incident, peers))
            done[k] = time.monotonic() - t0
            if silent is not None:
                silent[k] = silent_peers(peers, rows)

        return run

    threads = [threading.Thread(target=probe(k)) for k in range(len(nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(2.0 <= s < 3.5 for s in done.values()), done  # the window, and no more
    out = {}
    for k, node in enumerate(nodes):
        node.echo.flush()
        rows = node.ring.copy().rows
        out[k] = rows[[bytes(i).rstrip(b"\0") == incident.encode() for i in rows["incident"]]]
    return out


def _rows(rows: np.ndarray, kind: ProbeKind, role: ProbeRole, src: str, dst: str) -> np.ndarray:
    pick = (rows["probe"] == kind) & (rows["role"] == role)
    pick &= (rows["saddr"] == np.frombuffer(_ip(src), np.uint8)).all(axis=1)
    pick &= (rows["daddr"] == np.frombuffer(_ip(dst), np.uint8)).all(axis=1)
    out: np.ndarray = rows[pick]
    return out


def _budget(rows: np.ndarray) -> None:
    sent = rows[rows["role"] == ProbeRole.SENT]
    for dst in np.unique(sent["daddr"], axis=0):
        mine = sent[(sent["daddr"] == dst).all(axis=1)]
        assert int(mine["bytes_sent"].sum()) <= MAX_PEER_BYTES


@pytest.mark.lab
def test_a_one_direction_cut_is_seen_from_both_ends() -> None:
    """Every IPv4 packet the switch sends node 0 is dropped (the lab's
    one-way cut, ``partition:node=0,dir=in``: its port's egress).  Node 0's
    probes reach nodes 1 and 2 (their responders count every copy of every
    size) and no answer comes back; what 1 and 2 send node 0 is lost and
    never arrives; between 1 and 2 every probe is answered."""
    with lab_network(3) as lab:
        nodes = _nodes(lab, 3)
        try:
            lab.cut(0, "in")
            silent: dict[int, frozenset[str]] = {}
            rings = _round(lab, nodes, "20260101T000000000-node1-00002a", silent)
        finally:
            for n in nodes:
                n.echo.close()
        ip = [lab.node(k).ip for k in range(3)]

    for other in (1, 2):
        out = _rows(rings[0], ProbeKind.UDP, ProbeRole.SENT, ip[0], ip[other])
        assert len(out) >= 5 and (out["answered"] == 0).all(), out[["probe_size", "answered"]]
        assert (out["outcome"] == ProbeOutcome.LOST).all()
        assert set(out["probe_size"].tolist()) >= set(ladder(1500))
        arrived = _rows(rings[other], ProbeKind.UDP, ProbeRole.RECEIVED, ip[0], ip[other])
        assert set(arrived["probe_size"].tolist()) == set(out["probe_size"].tolist())
        assert (arrived["answered"] == arrived["sent"]).all() and (arrived["sent"] == 3).all()
        assert (arrived["outcome"] == ProbeOutcome.OK).all()
        icmp = _rows(rings[0], ProbeKind.ICMP, ProbeRole.SENT, ip[0], ip[other])
        assert len(icmp) and (icmp["answered"] == 0).all()  # nothing answers: not a dead agent
        tcp = _rows(rings[0], ProbeKind.TCP, ProbeRole.SENT, ip[0], ip[other])
        assert len(tcp) == 1 and tcp["outcome"][0] == ProbeOutcome.LOST  # its SYN-ACK never came

        back = _rows(rings[other], ProbeKind.UDP, ProbeRole.SENT, ip[other], ip[0])
        assert len(back) >= 5 and (back["answered"] == 0).all()
        assert not len(_rows(rings[0], ProbeKind.UDP, ProbeRole.RECEIVED, ip[other], ip[0]))

    # node 0 heard nothing (its verdict need not wait for its peers); they
    # heard nothing of node 0, and each other
    assert silent == {0: {ip[1], ip[2]}, 1: {ip[0]}, 2: {ip[0]}}, silent
    fine = _rows(rings[1], ProbeKind.UDP, ProbeRole.SENT, ip[1], ip[2])
    assert len(fine) == len(ladder(1500)) and (fine["outcome"] == ProbeOutcome.OK).all()
    assert (fine["rtt_us"] < 200_000).all()
    tcp = _rows(rings[1], ProbeKind.TCP, ProbeRole.SENT, ip[1], ip[2])
    assert tcp["outcome"][0] == ProbeOutcome.OK and tcp["throughput_bps"][0] > 10**6
    got = _rows(rings[2], ProbeKind.TCP, ProbeRole.RECEIVED, ip[1], ip[2])
    assert len(got) == 1 and got["bytes_received"][0] == CONFIG.tcp_bytes
    for ring in rings.values():
        _budget(ring)


@pytest.mark.lab
def test_an_mtu_blackhole_is_seen_with_its_size_both_ways() -> None:
    """Packets longer than 1,200 bytes are dropped both ways on node 2's
    switch port (the lab's ``mtu:node=2,bytes=1200``).  Node 0's probes to
    node 2, and node 2's to node 0, pass up to the limit and are lost above
    it, found to within a few bytes;
    the TCP exchange (its segments are 1,500 bytes) does not complete;
    between nodes 0 and 1 every size passes."""
    with lab_network(3) as lab:
        nodes = _nodes(lab, 3)
        try:
            lab.mtu(2, BLACKHOLE)
            rings = _round(lab, nodes, "20260101T000000000-node0-00002b")
        finally:
            for n in nodes:
                n.echo.close()
        ip = [lab.node(k).ip for k in range(3)]

    for a, b in ((0, 2), (2, 0), (1, 2)):
        out = _rows(rings[a], ProbeKind.UDP, ProbeRole.SENT, ip[a], ip[b])
        sizes, ok = out["probe_size"].astype(int), out["answered"] > 0
        assert ok[sizes <= BLACKHOLE].all() and not ok[sizes > BLACKHOLE].any(), (sizes, ok)
        largest, smallest = sizes[ok].max(), sizes[~ok].min()
        assert largest <= BLACKHOLE < smallest and smallest - largest <= 10, (largest, smallest)
        assert (out["outcome"][~ok] == ProbeOutcome.LOST).all()
        arrived = _rows(rings[b], ProbeKind.UDP, ProbeRole.RECEIVED, ip[a], ip[b])
        assert arrived["probe_size"].max() == largest  # nothing larger reached b
        assert not len(_rows(rings[a], ProbeKind.ICMP, ProbeRole.SENT, ip[a], ip[b]))
        tcp = _rows(rings[a], ProbeKind.TCP, ProbeRole.SENT, ip[a], ip[b])
        assert tcp["outcome"][0] in (ProbeOutcome.LOST, ProbeOutcome.PARTIAL)
        assert tcp["bytes_received"][0] < CONFIG.tcp_bytes

    fine = _rows(rings[0], ProbeKind.UDP, ProbeRole.SENT, ip[0], ip[1])
    assert (fine["outcome"] == ProbeOutcome.OK).all() and fine["probe_size"].max() == 1500
    for ring in rings.values():
        _budget(ring)


def _conn(local: str, remote: str, **values: int) -> np.void:
    from stallwatch.dumpers.schema import CONN_SAMPLE

    row = np.zeros(1, CONN_SAMPLE)[0]
    row["saddr"] = np.frombuffer(_ip(local), np.uint8)
    row["daddr"], row["family"] = np.frombuffer(_ip(remote), np.uint8), 2
    row["srtt_us"] = values.get("srtt_us", 100)
    row["backoff"] = values.get("backoff", 0)
    return row  # type: ignore[no-any-return]


def test_peers_are_the_job_connections_remote_nodes_the_nearest_when_many() -> None:
    me = "10.0.0.10"
    rows = np.array([_conn(me, f"10.0.0.{k}") for k in range(1, 40) if k != 10]
                    + [_conn(me, me), _conn("127.0.0.1", "127.0.0.1"),
                       _conn(me, "10.0.0.33", backoff=3)])  # fmt: skip
    own = {(_ip(me), socket.AF_INET)}
    few = choose_peers(rows[:5], own, 8)
    assert [p.text("remote") for p in few] == [f"10.0.0.{k}" for k in range(1, 6)]
    many = choose_peers(rows, own, 8)
    got = sorted(int(p.text("remote").rsplit(".", 1)[1]) for p in many)
    assert got == [7, 8, 9, 11, 12, 13, 14, 33], got  # 33 in trouble, then both sides of 10
    assert all(p.text("local") == me for p in many)


def test_the_ladder_and_its_refinement() -> None:
    assert ladder(1500) == [128, 256, 512, 1024, 1500]
    assert ladder(9000) == [128, 256, 512, 1024, 2048, 4096, 8192, 9000]
    assert between(1024, 1500) == [1083, 1143, 1202, 1262, 1321, 1381, 1440]


@pytest.mark.lab
def test_a_peer_whose_agent_is_dead_answers_echo_and_refuses_the_probes() -> None:
    """Node 1 runs no responder: its kernel says nobody listens (ICMP port
    unreachable, a TCP reset), so the datagrams and the exchange are
    ``refused``, not lost, and ICMP echo, which its kernel answers, passes
    at every size: the path is fine, the agent is not there."""
    with lab_network(2) as lab:
        (node,) = _nodes(lab, 1)
        try:
            me, peer = lab.node(0), lab.node(1)
            peers = [Peer(_ip(me.ip), _ip(peer.ip), socket.AF_INET)]
            tallies = netns.in_netns(me.netns, lambda: node.prober.probe("dead-agent", peers))
        finally:
            node.echo.close()
        rows = node.ring.copy().rows
    assert silent_peers(peers, tallies) == frozenset()  # its host answered: not silent
    udp = _rows(rows, ProbeKind.UDP, ProbeRole.SENT, me.ip, peer.ip)
    assert len(udp) == len(ladder(1500)) and (udp["outcome"] == ProbeOutcome.REFUSED).all()
    assert (udp["answered"] == 0).all()
    icmp = _rows(rows, ProbeKind.ICMP, ProbeRole.SENT, me.ip, peer.ip)
    assert sorted(icmp["probe_size"].tolist()) == ladder(1500)
    assert (icmp["outcome"] == ProbeOutcome.OK).all() and (icmp["rtt_us"] < 1_000_000).all()
    tcp = _rows(rows, ProbeKind.TCP, ProbeRole.SENT, me.ip, peer.ip)
    assert tcp["outcome"][0] == ProbeOutcome.REFUSED

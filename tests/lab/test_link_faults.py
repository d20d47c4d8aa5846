"""The lab's link and process faults do what they say, on real namespaces and
processes (no job, no agent): a one-way cut drops one direction only, an MTU
blackhole drops what is larger and passes what is smaller, SYN drops refuse
new connections and leave established ones alone, corruption reaches the
receiver's TCP as checksum errors, a rate cap one way sits on that way's
device, the bulk neighbour moves its bytes, a throttle caps a process's CPU
and a stop freezes it."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stallwatch.lab import bulk, netns
from stallwatch.lab import faults as F
from stallwatch.lab.procfaults import RankActs

pytestmark = pytest.mark.lab

IP_MTU_DISCOVER, IP_PMTUDISC_DO = 10, 2  # <linux/in.h>: set DF, never fragment


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    made: list[socket.socket] = []
    yield made
    for s in made:
        s.close()


@pytest.fixture
def net() -> Iterator[netns.Network]:
    run_id = "t" + secrets.token_hex(3)
    run_dir = netns.RUNS_DIR / run_id  # a live run's mark: other runs' cleanup leaves it
    run_dir.mkdir(parents=True)
    (run_dir / "runner.pid").write_text(str(os.getpid()))
    made = netns.create(run_id, 3)
    try:
        yield made
    finally:
        netns.destroy(made)
        shutil.rmtree(run_dir)


def _udp(node: netns.Node, keep: list[socket.socket]) -> socket.socket:
    def make() -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind((node.ip, 0))
        s.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
        s.settimeout(0.3)
        return s

    made = netns.in_netns(node.netns, make)
    keep.append(made)
    return made


def _arrived(src: socket.socket, dst: socket.socket, size: int, count: int = 5) -> int:
    """Datagrams of ``size`` bytes of UDP payload sent that the other end received."""
    for _ in range(count):
        with contextlib.suppress(OSError):
            src.sendto(b"x" * size, dst.getsockname())
    got = 0
    with contextlib.suppress(TimeoutError):
        while got < count:
            dst.recv(65536)
            got += 1
    return got


def test_a_one_way_cut_drops_what_goes_to_the_node_and_passes_what_leaves_it(
    net: netns.Network, sockets: list[socket.socket]
) -> None:
    a, b, c = (_udp(n, sockets) for n in net.nodes)
    assert _arrived(b, a, 100) == 5 and _arrived(a, b, 100) == 5
    netns.add_partition(net, net.nodes[0], "in")
    assert _arrived(b, a, 100) == 0 and _arrived(c, a, 100) == 0  # to node 0: dropped
    assert _arrived(a, b, 100) == 5 and _arrived(a, c, 100) == 5  # from node 0: passes
    assert _arrived(b, c, 100) == 5  # the others' traffic is untouched
    assert netns.partition_drops(net, net.nodes[0]) >= 10
    netns.remove_partition(net, net.nodes[0])
    netns.add_partition(net, net.nodes[0], "out")
    assert _arrived(a, b, 100) == 0 and _arrived(b, a, 100) == 5


def test_an_mtu_blackhole_drops_larger_packets_both_ways_and_passes_smaller(
    net: netns.Network, sockets: list[socket.socket]
) -> None:
    a, b, c = (_udp(n, sockets) for n in net.nodes)
    netns.add_mtu(net, net.nodes[1], 1000)  # IP length: 20 + 8 + payload
    assert _arrived(a, b, 972) == 5 and _arrived(b, a, 972) == 5  # 1,000 bytes: passes
    assert _arrived(a, b, 973) == 0 and _arrived(b, a, 973) == 0  # 1,001 bytes: dropped
    assert _arrived(a, c, 1400) == 5  # other nodes' large packets pass
    assert netns.table_packets(net, "mtu_n1") >= 10


def _tcp_pair(
    net: netns.Network, keep: list[socket.socket]
) -> tuple[socket.socket, socket.socket, socket.socket]:
    a, b = net.nodes[0], net.nodes[1]
    server = netns.in_netns(b.netns, lambda: socket.create_server((b.ip, 0)))
    keep.append(server)
    client = netns.in_netns(a.netns, lambda: socket.create_connection(server.getsockname(), 2))
    keep.append(client)
    accepted, _ = server.accept()
    keep.append(accepted)
    return server, client, accepted


def test_syn_drops_refuse_new_connections_and_keep_established_ones(
    net: netns.Network, sockets: list[socket.socket]
) -> None:
    server, client, accepted = _tcp_pair(net, sockets)
    netns.add_syn_drop(net, net.nodes[1])
    client.sendall(b"still here")
    assert accepted.recv(10) == b"still here"
    a = net.nodes[0]
    with pytest.raises(OSError):  # its SYN is dropped: times out
        netns.in_netns(a.netns, lambda: socket.create_connection(server.getsockname(), 1.0))
    assert netns.table_packets(net, "syn_n1") >= 1


def test_corruption_reaches_the_receivers_tcp_as_checksum_errors(
    net: netns.Network, sockets: list[socket.socket]
) -> None:
    _, client, accepted = _tcp_pair(net, sockets)
    before = netns.tcp_counters(net.nodes[1].netns)["InCsumErrors"]
    netns.add_corrupt(net, net.nodes[1], 5)
    data = os.urandom(256 << 10)
    client.settimeout(30)
    accepted.settimeout(30)
    client.sendall(data)
    got = bytearray()
    while len(got) < len(data):
        got += accepted.recv(1 << 20)
    assert bytes(got) == data  # TCP dropped every corrupt packet and sent it again
    assert netns.tcp_counters(net.nodes[1].netns)["InCsumErrors"] > before
    assert netns.table_packets(net, "corrupt_n1") > 0


def _qdiscs(ns: str, dev: str) -> str:
    return netns.sh(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev])


def test_a_rate_cap_one_way_sits_on_that_ways_device(net: netns.Network) -> None:
    node = net.nodes[2]
    netns.add_rate(net, node, 8.0, "in")
    assert "tbf" in _qdiscs(net.switch, node.port)  # towards the node: its switch port
    assert "tbf" not in _qdiscs(node.netns, netns.NODE_DEV)
    netns.add_rate(net, net.nodes[1], 8.0, "out")
    assert "tbf" in _qdiscs(net.nodes[1].netns, netns.NODE_DEV)
    assert "tbf" not in _qdiscs(net.switch, net.nodes[1].port)


def test_the_bulk_neighbour_streams_its_rate(net: netns.Network, tmp_path: Path) -> None:
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(node: netns.Node, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
        with log.open("w") as out:
            proc = subprocess.Popen([*node.exec_prefix(), *argv], stdout=out,
                                    stderr=subprocess.STDOUT)  # fmt: skip
        procs.append(proc)
        return proc

    try:
        started, how = bulk.start(F.Bulk(node=0, mbit=40.0), net.nodes, tmp_path, spawn)
        assert "from node 0 to node 1" in how and len(started) == 2
        time.sleep(2.0)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(5)
    sink = bulk.BulkStats.read(tmp_path / "bulk-0-1-sink.json")
    source = bulk.BulkStats.read(tmp_path / "bulk-0-1-source.json")
    assert sink is not None and source is not None and sink.connected
    assert source.started_ns is not None and source.stopped_ns is not None
    seconds = (source.stopped_ns - source.started_ns) / 1e9
    rate = source.bytes * 8 / seconds / 1e6
    assert 20 < rate < 50  # paced at 40 Mbit/s: never far above it
    assert sink.bytes > 0


_BUSY = "import time\nwhile True:\n    pass\n"


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_throttle_caps_the_ranks_cpu_and_a_stop_freezes_it() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _BUSY])
    acts = RankActs("t" + secrets.token_hex(3), {0: proc})
    try:
        how = acts(F.Throttle(rank=0, pct=20), True)
        assert "20%" in how
        time.sleep(0.3)
        cpu0, t0 = _cpu_s(proc.pid), time.monotonic()
        time.sleep(2.0)
        share = (_cpu_s(proc.pid) - cpu0) / (time.monotonic() - t0)
        assert share < 0.35  # a busy loop held near its 20% quota
        acts(F.Stop(rank=None, step=0, ms=1.0), True)
        time.sleep(0.1)
        assert _state(proc.pid) == "T"
        acts(F.Stop(rank=None, step=0, ms=1.0), False)
        time.sleep(0.1)
        assert _state(proc.pid) in ("R", "S")
    finally:
        proc.kill()
        proc.wait(5)
        acts.release()

"""The job's TCP sockets as the agent reads them from /proc: its listeners by
their own end (one on every address standing for each address of its
namespace too), its connections by both ends, in the kernel's byte order."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys

import pytest

from stallwatch.recorder import sockets

TCP_TABLE = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:1B59 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 111 1
   1: 0100000A:9C40 0200000A:1B59 01 00000000:00000000 00:00000000 00000000     0        0 222 1
   2: 0100000A:9C41 0200000A:1B59 06 00000000:00000000 03:00000000 00000000     0        0 0 3
   3: 0100000A:9C42 0200000A:1B59 01 00000000:00000000 00:00000000 00000000     0        0 333 1
"""
FIB_TRIE = """\
Main:
  +-- 0.0.0.0/0 3 0 5
     |-- 10.0.0.0
        /24 link UNICAST
     |-- 10.0.0.1
        /32 host LOCAL
Local:
  +-- 127.0.0.0/8 2 0 2
     |-- 127.0.0.1
        /32 host LOCAL
"""


def v4(text: str) -> bytes:
    return socket.inet_aton(text).ljust(16, b"\0")


def test_a_tcp_table_gives_the_processes_listeners_and_connections() -> None:
    listeners, conns = sockets.parse_tcp_table(TCP_TABLE, socket.AF_INET, {111, 222})
    assert listeners == {(bytes(16), 7001, socket.AF_INET)}  # on every address
    assert conns == {(v4("10.0.0.1"), v4("10.0.0.2"), 40000, 7001, socket.AF_INET)}
    # not 333 (another process's), not the TIME_WAIT row


def test_the_namespaces_own_addresses_come_from_its_local_routes() -> None:
    assert sockets.local_ipv4(FIB_TRIE) == {v4("10.0.0.1"), v4("127.0.0.1")}
    line = "fe800000000000000000000000000001 02 40 20 80 eth0\n"
    assert sockets.local_ipv6(line) == {bytes.fromhex("fe80" + "0" * 27 + "1")}


def test_a_live_process_listening_everywhere_stands_for_each_of_its_addresses() -> None:
    server = socket.create_server(("0.0.0.0", 0))
    client = socket.create_connection(("127.0.0.1", server.getsockname()[1]))
    try:
        port, mine = server.getsockname()[1], client.getsockname()[1]
        listeners, conns = sockets.process_sockets(os.getpid())
        assert (bytes(16), port, socket.AF_INET) in listeners
        assert (v4("127.0.0.1"), port, socket.AF_INET) in listeners
        assert (v4("127.0.0.1"), v4("127.0.0.1"), mine, port, socket.AF_INET) in conns
        # its local end alone is no endpoint: another connection may reuse the port
        assert (v4("127.0.0.1"), mine, socket.AF_INET) not in listeners
        found = sockets.job_sockets([os.getpid()])
        assert found.listeners[(bytes(16), port, socket.AF_INET)] == os.getpid()
    finally:
        client.close()
        server.close()
    assert sockets.process_sockets(2**22 + 12345) == (set(), set())  # no such process


def test_the_sock_diag_reading_equals_the_proc_reading() -> None:
    """One dump of the namespace's listeners and connections, matched by
    inode, says what /proc/<pid>/net/tcp says of this process; sockets in
    TIME_WAIT (a neighbour's churn) are in neither."""
    server = socket.create_server(("0.0.0.0", 0))
    client = socket.create_connection(("127.0.0.1", server.getsockname()[1]))
    accepted, _ = server.accept()
    closed = socket.create_connection(("127.0.0.1", server.getsockname()[1]))
    far, _ = server.accept()
    closed.close()  # the active closer's end goes to TIME_WAIT
    far.close()
    reader = sockets.SocketReader()
    try:
        assert reader.job_sockets([os.getpid()]) == sockets.JobSockets(
            *({k: os.getpid() for k in found} for found in sockets.process_sockets(os.getpid()))
        )
        listeners, conns = sockets.process_sockets(os.getpid(), reader._table(
            sockets.netns_of(os.getpid()) or 0, os.getpid()) or [])  # fmt: skip
        mine, port = client.getsockname()[1], server.getsockname()[1]
        assert (v4("127.0.0.1"), v4("127.0.0.1"), mine, port, socket.AF_INET) in conns
        assert (v4("127.0.0.1"), v4("127.0.0.1"), port, mine, socket.AF_INET) in conns
        assert len({c for c in conns if port in c[2:4]}) == 2  # not the one in TIME_WAIT
        assert (bytes(16), port, socket.AF_INET) in listeners
        assert reader.fallbacks == 0
    finally:
        reader.close()
        for s in (client, accepted, server):
            s.close()


@pytest.mark.bpf
def test_a_process_of_another_network_namespace_is_read_in_its_own() -> None:
    """A rank in a namespace of its own (a container): its namespace is
    asked by a socket made in it, not the agent's."""
    code = (
        "import socket, sys\n"
        "s = socket.create_server(('127.0.0.1', 7001))\n"
        "print('ready', flush=True)\n"
        "sys.stdin.read()\n"
    )
    command = f'ip link set lo up && exec {sys.executable} -c "{code}"'
    with subprocess.Popen(["unshare", "--net", "sh", "-c", command], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as child:  # fmt: skip
        reader = sockets.SocketReader()
        try:
            assert child.stdout is not None and child.stdout.readline() == "ready\n"
            assert sockets.netns_of(child.pid) != sockets.netns_of(os.getpid())
            found = reader.job_sockets([child.pid])
            assert found.listeners == {(v4("127.0.0.1"), 7001, socket.AF_INET): child.pid}
            assert reader.fallbacks == 0
        finally:
            reader.close()
            child.kill()


@pytest.mark.bpf
def test_ipv6_is_asked_only_where_the_namespace_has_an_ipv6_socket() -> None:
    """A dump of a family walks every socket of the host: none for IPv6
    where the namespace holds no IPv6 TCP socket (its sockstat6)."""
    code = (
        "import socket, sys\n"
        "s = socket.create_server(('::1', 7002), family=socket.AF_INET6) if sys.argv[1] == '6' "
        "else socket.create_server(('127.0.0.1', 7002))\n"
        "print('ready', flush=True)\n"
        "sys.stdin.read()\n"
    )
    for six in ("4", "6"):
        command = f'ip link set lo up && exec {sys.executable} -c "{code}" {six}'
        with subprocess.Popen(["unshare", "--net", "sh", "-c", command], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) as child:  # fmt: skip
            try:
                assert child.stdout is not None and child.stdout.readline() == "ready\n"
                families = sockets._families(child.pid)
                found = sockets.job_sockets([child.pid])
            finally:
                child.kill()
        if six == "4":
            assert families == (socket.AF_INET,)
            assert set(found.listeners) == {(v4("127.0.0.1"), 7002, socket.AF_INET)}
        else:
            assert families == (socket.AF_INET, socket.AF_INET6)
            loopback = socket.inet_pton(socket.AF_INET6, "::1")
            assert set(found.listeners) == {(loopback, 7002, socket.AF_INET6)}


def test_a_connections_state_is_struct_tcp_info_as_the_socket_itself_gives_it() -> None:
    """sock_diag's INET_DIAG_INFO and getsockopt(TCP_INFO) are one struct:
    parsed alike, and read for the job's connections only."""
    from stallwatch.recorder.netlink import parse_tcp_info

    ls = socket.create_server(("127.0.0.1", 0))
    c = socket.create_connection(ls.getsockname())
    s, _ = ls.accept()
    try:
        c.sendall(b"x" * 1000)
        s.recv(1000)
        raw = c.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 512)
        own = parse_tcp_info(raw, 0, len(raw))
        reader = sockets.SocketReader()
        try:
            states = reader.connection_states([os.getpid()])
        finally:
            reader.close()
        mine = [sk for pid, sk in states if sk.sport == c.getsockname()[1]]
        assert len(mine) == 1 and all(pid == os.getpid() for pid, _ in states)
        got = mine[0].info
        assert own is not None and got is not None
        assert (got.retransmits, got.rto_us, got.packets_out) == (0, own.rto_us, 0)
        assert got.unacked_bytes == 0 and 0 < got.srtt_us < 100_000
        assert got.last_ack_recv_ms < 5_000
        # an older kernel's shorter struct: no byte counts (unknown, not 0)
        assert parse_tcp_info(raw, 0, 104) == dataclasses.replace(own, unacked_bytes=None)
        assert parse_tcp_info(raw, 0, 40) is None
    finally:
        for x in (c, s, ls):
            x.close()


def test_a_dumps_state_rows_follow_the_rings_rows() -> None:
    import numpy as np

    from stallwatch.dumpers.model import Ring
    from stallwatch.dumpers.schema import TCP_EVENT, TcpEvent
    from stallwatch.recorder.netlink import TcpInfo, TcpSocket

    ring = Ring(np.zeros(3, dtype=TCP_EVENT), overwritten=7)
    ring.rows["pos"] = [5, 6, 7]
    src, dst = bytes([10, 0, 0, 1]) + bytes(12), bytes([10, 0, 0, 2]) + bytes(12)
    sk = TcpSocket(2, 1, src, dst, 40000, 7001, 99,
                   TcpInfo(3, 1_600_000, 250, 4_200, 12, 12, 1 << 40))  # fmt: skip
    out = sockets.with_states(ring, [(1234, sk)], 10**12)
    assert out.overwritten == 7 and len(out.rows) == 4
    row = out.rows[-1]
    assert (row["pos"], row["ts_ns"], row["pid"]) == (8, 10**12, 1234)
    assert row["event"] == TcpEvent.TCP_INFO
    assert bytes(row["saddr"]) == src and bytes(row["daddr"]) == dst
    assert (row["sport"], row["dport"], row["backoff"], row["conn_known"]) == (40000, 7001, 3, 1)
    assert row["no_ack_ns"] == 4_200_000_000 and row["rto_us"] == 1_600_000
    assert row["unacked"] == 0xFFFFFFFF  # more than the column holds: its largest


@pytest.mark.bpf
def test_a_job_with_more_sockets_than_the_kernels_table_holds_fills_it_and_goes_on() -> None:
    """A real BPF hash map of 4 entries given 6 connections: 4 are kept,
    2 counted as refused; nothing raised (a process holding 4,200 sockets
    once stopped the agent: the kernel's table refused the update, E2BIG).
    Given 3 afterwards: exactly those 3."""
    import numpy as np

    from stallwatch.recorder import bpfsys
    from stallwatch.recorder.maps import BpfMap, MapSpec, _replace

    key, value = np.dtype([("port", "<u4")]), np.dtype("<u4")
    fd = bpfsys.map_create(bpfsys.BPF_MAP_TYPE_HASH, key.itemsize, value.itemsize, 4, "test_full")
    table = BpfMap(MapSpec("test_full", bpfsys.BPF_MAP_TYPE_HASH, key, value, 4, 0), fd, True)
    try:
        keys = np.zeros(6, dtype=key)
        keys["port"] = np.arange(1000, 1006)
        assert _replace(table, keys, list(range(6))) == 2
        held, _ = table.items()
        assert len(held) == 4 and set(held["port"].tolist()) < set(range(1000, 1006))
        assert _replace(table, keys[3:], [7, 8, 9]) == 0
        held, values = table.items()
        assert sorted(zip(held["port"].tolist(), values.tolist(), strict=True)) == [
            (1003, 7),
            (1004, 8),
            (1005, 9),
        ]
    finally:
        os.close(fd)

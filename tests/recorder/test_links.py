"""The link sampler (recorder.links): real rtnetlink on real veths in
namespaces made here, RDMA ports from the fixture sysfs tree
(tests/recorder/data/rdma-sysfs, after the kernel's documentation of it), which
process uses which interface, the ring's bounds, and the rules that decide
a row."""

from __future__ import annotations

import os
import shutil
import socket
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from lab.netns import in_netns
from stallwatch.dumpers.layout import NETDEV_COUNTERS, UNKNOWN_U64, LinkEvent, LinkKind
from stallwatch.dumpers.model import Clock, Recording
from stallwatch.dumpers.sqltables import tables
from stallwatch.query.sql import LOCAL, QueryEngine
from stallwatch.recorder.links import (
    FIRST_COUNTER,
    LinkConfig,
    LinkSampler,
    decide,
    netdev_reading,
    rdma_reading,
)
from stallwatch.recorder.netlink import (
    IFLA_IFNAME,
    IFLA_STATS64,
    NetdevSample,
    Rtnl,
    parse_link,
)

DATA = Path(__file__).resolve().parent / "data" / "rdma-sysfs" / "class"
HOUR = 3600.0


def _events(rows: np.ndarray, link: int | None = None) -> list[str]:
    picked = rows if link is None else rows[rows["link"] == link]
    return [LinkEvent(e).name.lower() for e in picked["event"].tolist()]


def _ids(sampler: LinkSampler) -> dict[str, int]:
    return {li.name: li.id for li in sampler.table() if not li.gone_ns}


# ---------------------------------------------------------------- real veths


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def pair() -> Iterator[tuple[str, str]]:
    """Namespaces A and B joined by a veth pair: a0 (10.9.0.1/24, in A) and
    b0 (10.9.0.2/24, MTU 1000, in B)."""
    tag = uuid.uuid4().hex[:6]
    a, b = f"swlk-{tag}-a", f"swlk-{tag}-b"
    _ip("netns", "add", a)
    _ip("netns", "add", b)
    try:
        _ip("-n", a, "link", "add", "a0", "type", "veth", "peer", "name", "b0", "netns", b)
        _ip("-n", a, "addr", "add", "10.9.0.1/24", "dev", "a0")
        _ip("-n", b, "addr", "add", "10.9.0.2/24", "dev", "b0")
        _ip("-n", b, "link", "set", "b0", "mtu", "1000")
        for ns, dev in ((a, "lo"), (a, "a0"), (b, "lo"), (b, "b0")):
            _ip("-n", ns, "link", "set", dev, "up")
        yield a, b
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _send_oversized(ns: str, count: int) -> None:
    """Datagrams longer than b0's MTU: the veth drops them (a0's tx_dropped)."""
    code = (
        "import socket\n"
        "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        f"for _ in range({count}): s.sendto(b'x' * 1400, ('10.9.0.2', 9))\n"
    )
    subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code], check=True)


def _tick_for_operstate(sampler: LinkSampler, link: int, states: tuple[int, ...]) -> np.ndarray:
    """Tick until the link's last row has one of ``states``; the rows."""
    deadline = time.monotonic() + 5
    while True:
        rows = sampler.copy().rows
        mine = rows[rows["link"] == link]
        if mine[-1]["operstate"] in states or time.monotonic() > deadline:
            assert mine[-1]["operstate"] in states, mine[-1]["operstate"]
            return rows
        sampler.tick()
        time.sleep(0.01)


def _tick_until(sampler: LinkSampler, want: int, force: bool = False) -> None:
    """Tick until at least ``want`` rows were written (the kernel's news
    reaches the socket within milliseconds; allow a loaded machine 5 s)."""
    written, deadline = 0, time.monotonic() + 5
    while written < want and time.monotonic() < deadline:
        written += sampler.tick(force=force)
        time.sleep(0.01)
    assert written >= want


@pytest.mark.bpf
def test_carrier_down_up_drops_and_gone_on_real_veths(pair: tuple[str, str]) -> None:
    a, b = pair
    cfg = LinkConfig(rdma_root=Path("/nonexistent"), heartbeat_s=HOUR)
    sampler = in_netns(a, lambda: LinkSampler(cfg))  # its sockets are A's
    try:
        assert sampler.tick() == 2  # lo and a0, first seen
        eth = _ids(sampler)["a0"]
        seen = sampler.copy().rows
        assert _events(seen) == ["seen", "seen"]
        first = seen[seen["link"] == eth][0]
        assert (first["carrier"], first["operstate"], first["admin_up"]) == (1, 6, 1)
        assert sampler.tick(force=True) == 0  # nothing changed: no row

        before = time.monotonic_ns()
        _ip("-n", b, "link", "set", "b0", "down")  # the far end: a0 loses its carrier
        _tick_until(sampler, 1)
        down = sampler.copy().rows[2]
        assert _events(sampler.copy().rows[2:3]) == ["carrier_down"]
        assert down["link"] == eth and down["carrier"] == 0
        assert down["carrier_down_count"] == first["carrier_down_count"] + 1
        assert down["after_ns"] < before < down["ts_ns"] <= time.monotonic_ns()
        # The oper state is down, or lowerlayerdown where the peer's ifindex
        # differs from its own (the kernel's rule), once the kernel's linkwatch
        # has run: a reading between carrier off and linkwatch (once on CI)
        # shows the state still up, and a ``state`` row follows.
        settled = _tick_for_operstate(sampler, eth, (2, 3))
        assert down["operstate"] in (2, 3) or (
            down["operstate"] == 6 and _events(settled[3:4]) == ["state"]
        )

        _ip("-n", b, "link", "set", "b0", "up")
        _tick_until(sampler, 1)
        assert "carrier_up" in _events(sampler.copy().rows, eth)
        _tick_for_operstate(sampler, eth, (6,))  # linkwatch again: up before the drops

        tx = int(sampler.copy().rows[-1]["tx_dropped"])
        _send_oversized(a, 5)
        _tick_until(sampler, 1, force=True)
        dropped = sampler.copy().rows[-1]
        assert _events(sampler.copy().rows[-1:]) == ["errors"]
        assert dropped["link"] == eth and dropped["tx_dropped"] == tx + 5

        _ip("-n", a, "link", "del", "a0")
        _tick_until(sampler, 1)
        gone = sampler.copy().rows[-1]
        assert _events(sampler.copy().rows[-1:]) == ["gone"] and gone["link"] == eth
        assert gone["rx_packets"] == UNKNOWN_U64
        (info,) = [li for li in sampler.table() if li.id == eth]
        assert info.gone_ns == gone["ts_ns"] and info.addresses[0] == "10.9.0.1/24"
        assert info.link_type == "veth" and info.mtu == 1500 and info.speed_mbps == 10_000

        rec = Recording("node0", "", Clock(0, 0), (), (), {"link": sampler.copy()},
                        links=sampler.table())  # fmt: skip
        with QueryEngine([rec], LOCAL) as engine:
            got = engine.query(
                "SELECT event, carrier, operstate, tx_dropped FROM link_events "
                "WHERE interface = 'a0' ORDER BY timestamp_ns"
            ).rows
        assert [g[0] for g in got][:2] == ["seen", "carrier_down"]
        assert got[1][1] is False
        assert {"down", "lowerlayerdown"} & {g[2] for g in got[1:3]}
        assert got[-1] == ("gone", None, None, None)
        assert ("errors", True, "up", tx + 5) in got
    finally:
        sampler.close()


@pytest.mark.bpf
def test_a_heartbeat_shows_the_state_when_nothing_changes(pair: tuple[str, str]) -> None:
    a, _ = pair
    cfg = LinkConfig(rdma_root=Path("/nonexistent"), heartbeat_s=0.3)
    sampler = in_netns(a, lambda: LinkSampler(cfg))
    try:
        sampler.tick()
        assert sampler.tick(force=True) == 0
        time.sleep(0.35)
        assert sampler.tick(force=True) == 2
        assert _events(sampler.copy().rows[2:]) == ["heartbeat", "heartbeat"]
    finally:
        sampler.close()


@pytest.mark.bpf
def test_a_ranks_connections_map_it_to_the_netdev_they_leave_by(pair: tuple[str, str]) -> None:
    a, b = pair
    server = subprocess.Popen(
        ["ip", "netns", "exec", a, sys.executable, "-c",
         "import socket, sys, time\n"
         "s = socket.create_server(('10.9.0.1', 29500))\n"
         "print('ready', flush=True)\n"
         "c, _ = s.accept()\n"
         "time.sleep(30)\n"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    client = None
    sampler = in_netns(a, lambda: LinkSampler(LinkConfig(rdma_root=Path("/nonexistent"))))
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        client = subprocess.Popen(
            ["ip", "netns", "exec", b, sys.executable, "-c",
             "import socket, time\n"
             "c = socket.create_connection(('10.9.0.1', 29500))\n"
             "time.sleep(30)\n"],
        )  # fmt: skip
        sampler.tick()
        pid = server.pid  # `ip netns exec` execs the interpreter: the same pid
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            sampler.map_users([pid, client.pid])
            if any(li.pids for li in sampler.table()):
                break
            time.sleep(0.05)
        by_name = {li.name: li for li in sampler.table()}
        # the client is another namespace's: none of A's interfaces carries it
        assert by_name["a0"].pids == (pid,) and by_name["lo"].pids == ()
    finally:
        sampler.close()
        for proc in (server, client):
            if proc is not None:
                proc.kill()
                proc.wait()
        if server.stdout is not None:
            server.stdout.close()


# ---------------------------------------------------------------- RDMA fixture


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    """A copy of the fixture tree, to change between samples."""
    shutil.copytree(DATA, tmp_path / "class")
    return tmp_path / "class"


def _write(path: Path, text: str) -> None:
    path.write_text(text + "\n")


def test_rdma_ports_counters_moving_between_two_samples(sysfs: Path) -> None:
    ib = sysfs / "infiniband"
    cfg = LinkConfig(rdma_root=ib, heartbeat_s=HOUR, rdma_counters_s=0.0)
    sampler = LinkSampler(cfg, rtnl=None)
    assert sampler.tick() == 4
    ids = _ids(sampler)
    assert set(ids) == {"mlx4_0:1", "mlx4_0:2", "mlx5_0:1", "mlx5_1:1"}
    rows = sampler.copy().rows
    by = {li.name: li for li in sampler.table()}
    roce, hdr = by["mlx5_0:1"], by["mlx5_1:1"]
    assert (roce.device, roce.port, roce.netdev, roce.link_layer) == (
        "mlx5_0", 1, "ens1f0", "Ethernet")  # fmt: skip
    assert (hdr.netdev, hdr.link_layer, hdr.speed_mbps) == ("ib0", "InfiniBand", 200_000)
    first = {int(r["link"]): r for r in rows}
    assert first[ids["mlx4_0:2"]]["carrier"] == 0 and first[ids["mlx4_0:2"]]["port_state"] == 1
    assert first[ids["mlx5_1:1"]]["symbol_error"] == 3
    assert first[ids["mlx5_0:1"]]["np_cnp_sent"] == 12884
    # mlx5's InfiniBand port has no congestion counters, mlx4 no hw_counters: unknown
    assert first[ids["mlx5_1:1"]]["np_cnp_sent"] == UNKNOWN_U64
    assert first[ids["mlx4_0:1"]]["out_of_sequence"] == UNKNOWN_U64

    port = ib / "mlx5_1" / "ports" / "1"
    _write(port / "counters" / "symbol_error", "10")
    _write(port / "counters" / "link_error_recovery", "2")
    _write(ib / "mlx5_0" / "ports" / "1" / "hw_counters" / "np_cnp_sent", "13000")  # congestion
    _write(ib / "mlx4_0" / "ports" / "1" / "state", "1: DOWN")
    _write(ib / "mlx4_0" / "ports" / "1" / "phys_state", "2: Polling")
    assert sampler.tick(force=True) == 2  # the congestion counter alone writes no row
    new = sampler.copy().rows[4:]
    assert _events(new[new["link"] == ids["mlx4_0:1"]]) == ["carrier_down"]
    errs = new[new["link"] == ids["mlx5_1:1"]]
    assert _events(errs) == ["errors"]
    assert (errs["symbol_error"][0], errs["link_error_recovery"][0]) == (10, 2)
    assert errs["after_ns"][0] == first[ids["mlx5_1:1"]]["ts_ns"]

    _write(port / "counters" / "link_downed", "1")  # down and up between two readings
    assert sampler.tick(force=True) == 1
    assert _events(sampler.copy().rows[-1:]) == ["carrier_flap"]

    shutil.rmtree(ib / "mlx4_0")
    assert sampler.tick(force=True) == 2
    assert _events(sampler.copy().rows[-2:]) == ["gone", "gone"]
    gone = [li for li in sampler.table() if li.gone_ns]
    assert sorted(li.name for li in gone) == ["mlx4_0:1", "mlx4_0:2"]


def test_rdma_counters_are_read_every_few_seconds_and_for_every_row(sysfs: Path) -> None:
    now = [10**12]
    ib = sysfs / "infiniband"
    cfg = LinkConfig(rdma_root=ib, heartbeat_s=10.0, rdma_counters_s=5.0)
    sampler = LinkSampler(cfg, rtnl=None, clock=lambda: now[0])
    sampler.tick()
    symbol = ib / "mlx5_1" / "ports" / "1" / "counters" / "symbol_error"
    _write(symbol, "50")
    now[0] += 2 * 10**9
    assert sampler.tick() == 0  # counters not read yet: a MAD each, not every second
    now[0] += 3 * 10**9
    assert sampler.tick() == 1
    assert sampler.copy().rows[-1]["symbol_error"] == 50
    now[0] += 10 * 10**9
    assert sampler.tick() == 4  # heartbeats, each with counters read then
    _write(symbol, "51")
    _write(ib / "mlx5_1" / "ports" / "1" / "phys_state", "6: LinkErrorRecovery")
    now[0] += 10**9
    assert sampler.tick() == 1  # a state change reads the counters at once
    row = sampler.copy().rows[-1]
    assert (row["carrier"], row["phys_state"], row["symbol_error"]) == (0, 6, 51)


def test_ranks_map_to_the_rdma_device_they_have_open(sysfs: Path, tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    for pid, uverbs in ((4001, "uverbs1"), (4002, "uverbs0"), (4003, None)):
        fd = proc / str(pid) / "fd"
        fd.mkdir(parents=True)
        os.symlink("/dev/null", fd / "0")
        os.symlink("socket:[77]", fd / "3")
        if uverbs:
            os.symlink(f"/dev/infiniband/{uverbs}", fd / "7")
    cfg = LinkConfig(rdma_root=sysfs / "infiniband", verbs_root=sysfs / "infiniband_verbs",
                     proc_root=proc)  # fmt: skip
    sampler = LinkSampler(cfg, rtnl=None)
    sampler.tick()
    sampler.map_users([4001, 4002, 4003, 4999])  # 4999: gone already
    pids = {li.name: li.pids for li in sampler.table()}
    assert pids == {"mlx4_0:1": (), "mlx4_0:2": (), "mlx5_0:1": (4002,), "mlx5_1:1": (4001,)}
    assert [li.pids for li in sampler.table(keep=lambda p: p != 4002)][2] == ()
    sampler.forget_pids([4001])
    assert {li.name: li.pids for li in sampler.table()}["mlx5_1:1"] == ()


def test_a_process_that_uses_nothing_yet_is_looked_at_again_soon(
    sysfs: Path, tmp_path: Path
) -> None:
    now = [10**12]
    fd = tmp_path / "proc" / "4001" / "fd"
    fd.mkdir(parents=True)
    cfg = LinkConfig(rdma_root=sysfs / "infiniband", verbs_root=sysfs / "infiniband_verbs",
                     proc_root=tmp_path / "proc", map_period_s=30.0)  # fmt: skip
    sampler = LinkSampler(cfg, rtnl=None, clock=lambda: now[0])

    def users() -> tuple[int, ...]:
        return {li.name: li.pids for li in sampler.table()}["mlx5_1:1"]

    sampler.tick(lambda: [4001])  # started: nothing open yet
    os.symlink("/dev/infiniband/uverbs1", fd / "9")
    now[0] += 10**9
    sampler.tick(lambda: [4001])
    assert users() == ()  # looked at again 2 s after the first time, not every tick
    now[0] += 10**9
    sampler.tick(lambda: [4001])
    assert users() == (4001,)
    (fd / "9").unlink()  # a process seen on an interface stays on it
    now[0] += 31 * 10**9
    sampler.tick(lambda: [4001])
    assert users() == (4001,)


def test_the_ring_is_bounded_and_gone_links_leave_with_their_rows(sysfs: Path) -> None:
    ib = sysfs / "infiniband"
    cfg = LinkConfig(slots=16, rdma_root=ib, heartbeat_s=0.0, rdma_counters_s=0.0)
    sampler = LinkSampler(cfg, rtnl=None)
    assert sampler.memory_bytes == 16 * 544
    for _ in range(10):
        sampler.tick(force=True)
    ring = sampler.copy()
    assert len(ring.rows) == 16 and ring.overwritten == 40 - 16
    shutil.rmtree(ib / "mlx4_0")
    sampler.tick(force=True)  # two heartbeats, two gone
    assert {li.name for li in sampler.table() if li.gone_ns} == {"mlx4_0:1", "mlx4_0:2"}
    for _ in range(8):  # 16 more rows: no row names mlx4_0 any more
        sampler.tick(force=True)
    assert {li.name for li in sampler.table()} == {"mlx5_0:1", "mlx5_1:1"}
    names = {li.id for li in sampler.table()}
    assert set(sampler.copy().rows["link"].tolist()) <= names


# ---------------------------------------------------------------- rules


def _netdev(carrier: int, changes: int, rx_errors: int = 0, admin: bool = True) -> NetdevSample:
    stats = [100, 200, 0, 0, rx_errors] + [0] * 20
    up, down = changes // 2 + changes % 2, changes // 2
    oper = 6 if carrier else 2
    return NetdevSample(
        2, "eth0", admin, oper, carrier, changes, up, down, 1500, tuple(stats), None, None
    )


@pytest.mark.parametrize(
    ("old", "new", "quiet_s", "event"),
    [
        (None, _netdev(1, 2), 0, LinkEvent.SEEN),
        (_netdev(1, 2), _netdev(0, 3), 0, LinkEvent.CARRIER_DOWN),
        (_netdev(0, 3), _netdev(1, 4), 0, LinkEvent.CARRIER_UP),
        (_netdev(1, 2), _netdev(1, 4), 0, LinkEvent.CARRIER_FLAP),  # down and up between
        (_netdev(1, 2), _netdev(1, 2, admin=False), 0, LinkEvent.STATE),
        (_netdev(1, 2), _netdev(1, 2, rx_errors=3), 0, LinkEvent.ERRORS),
        (_netdev(1, 2), _netdev(1, 2), 9.9, None),  # traffic alone: no row
        (_netdev(1, 2), _netdev(1, 2), 10.0, LinkEvent.HEARTBEAT),
    ],
)
def test_why_a_netdev_row_is_written(
    old: NetdevSample | None, new: NetdevSample, quiet_s: float, event: LinkEvent | None
) -> None:
    before = netdev_reading(old) if old is not None else None
    got = decide(before, netdev_reading(new), LinkKind.NETDEV, int(quiet_s * 1e9), 10**10)
    assert got is event


def test_a_value_that_becomes_readable_or_unreadable_is_no_change() -> None:
    known = rdma_reading(4, 5, [0] * 37)
    unknown = rdma_reading(4, None, [None] * 37)
    assert decide(known, unknown, LinkKind.RDMA, 0, 10**10) is None
    assert decide(unknown, known, LinkKind.RDMA, 0, 10**10) is None
    down = rdma_reading(1, 3, [0] * 37)
    assert decide(known, down, LinkKind.RDMA, 0, 10**10) is LinkEvent.CARRIER_DOWN


def _link_message(stats: tuple[int, ...]) -> bytes:
    def attr(kind: int, payload: bytes) -> bytes:
        raw = struct.pack("=HH", 4 + len(payload), kind) + payload
        return raw + b"\0" * (-len(raw) % 4)

    body = struct.pack("=BxHiII", 0, 1, 7, 0x1, 0)
    body += attr(IFLA_IFNAME, b"eth7\0") + attr(
        IFLA_STATS64, struct.pack(f"={len(stats)}Q", *stats)
    )
    return body


def test_an_older_kernels_shorter_counters_are_unknown_not_zero() -> None:
    # 23 counters: a kernel before rx_nohandler's neighbour rx_otherhost_dropped (6.0) sent fewer
    raw = _link_message(tuple(range(1, 24)))
    sample = parse_link(raw, 0, len(raw))
    assert sample is not None and (sample.ifindex, sample.name, sample.admin_up) == (
        7,
        "eth7",
        True,
    )
    assert sample.carrier is None and sample.carrier_changes is None
    reading = netdev_reading(sample)
    got = dict(zip(NETDEV_COUNTERS, reading[FIRST_COUNTER:], strict=False))
    assert got["rx_packets"] == 1 and got["tx_window_errors"] == 21
    assert got["rx_nohandler"] == UNKNOWN_U64 and got["rx_otherhost_dropped"] == UNKNOWN_U64


def test_sock_diag_gives_connected_sockets_local_addresses_not_listeners() -> None:
    rtnl = Rtnl()
    try:
        for host, family in (("127.0.0.1", socket.AF_INET), ("::1", socket.AF_INET6)):
            with socket.create_server((host, 0), family=family) as server:
                client = socket.create_connection(server.getsockname()[:2])
                accepted, _ = server.accept()
                table = rtnl.tcp_local_addresses()
                for sock in (client, accepted):
                    assert table[os.fstat(sock.fileno()).st_ino] == host
                assert os.fstat(server.fileno()).st_ino not in table  # a listener: no link
                client.close()
                accepted.close()
    finally:
        rtnl.close()


def test_tables_of_a_sampler_recording_name_every_row(sysfs: Path) -> None:
    sampler = LinkSampler(LinkConfig(rdma_root=sysfs / "infiniband"), rtnl=None)
    sampler.tick()
    rec = Recording("n", "", Clock(0, 0), (), (), {"link": sampler.copy()}, links=sampler.table())
    t = tables(rec)["link_events"]
    assert t.num_rows == 4 and t.column("interface").null_count == 0
    assert sorted(t.column("interface").to_pylist()) == [
        "mlx4_0:1", "mlx4_0:2", "mlx5_0:1", "mlx5_1:1"]  # fmt: skip


# ---------------------------------------------------------------- in the agent


def test_the_agent_dumps_its_link_ring_and_links_and_serves_them_as_metrics(
    sysfs: Path, tmp_path: Path
) -> None:
    from stallwatch.dumpers.format import read_dump
    from stallwatch.dumpers.model import ProcessInfo
    from stallwatch.recorder.agent import Agent, AgentConfig
    from stallwatch.recorder.source import ReplaySource

    fd = tmp_path / "proc" / "4001" / "fd"
    fd.mkdir(parents=True)
    os.symlink("/dev/infiniband/uverbs1", fd / "9")
    links = LinkConfig(rdma_root=sysfs / "infiniband", verbs_root=sysfs / "infiniband_verbs",
                       proc_root=tmp_path / "proc")  # fmt: skip
    config = AgentConfig(dump_dir=tmp_path / "dumps", host_name="node-l", links=links)
    agent = Agent(config, ReplaySource())
    try:
        agent.procs.add(ProcessInfo(4001, "python3", "train.py", 0, 1, ()))
        agent.tick()
        answer = agent.request_dump("by test")
        dumped = read_dump(str(answer["path"]))
        by_name = {li.name: li for li in dumped.links}
        assert {"mlx4_0:1", "mlx4_0:2", "mlx5_0:1", "mlx5_1:1"} <= set(by_name)
        assert by_name["mlx5_1:1"].pids == (4001,) and by_name["mlx5_0:1"].pids == ()
        rows = dumped.rings["link"].rows
        assert set(rows["link"].tolist()) == {li.id for li in dumped.links}
        assert (rows["event"] == LinkEvent.SEEN).sum() == len(dumped.links)
        text = agent.metrics_text()
        assert 'stallwatch_link_carrier{interface="mlx4_0:2",kind="rdma"} 0.0' in text
        assert 'stallwatch_link_processes{interface="mlx5_1:1",kind="rdma"} 1.0' in text
        assert 'stallwatch_events_recorded_total{kind="link"}' in text
    finally:
        agent.close()

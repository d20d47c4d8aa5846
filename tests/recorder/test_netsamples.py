"""Each job connection's tcp_info and each job interface's counters, sampled
into their rings (recorder.netsamples): the struct as the kernel's headers
lay it out, unknown where a kernel sends less, and on the lab's veths a
connection that is throttled by a qdisc and then cut, seen second by
second."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from stallwatch.dumpers.layout import UNKNOWN_U8, UNKNOWN_U32, UNKNOWN_U64
from stallwatch.lab import netns
from stallwatch.recorder import netsamples
from stallwatch.recorder.netlink import RouteAsk
from stallwatch.recorder.netsamples import TCP_INFO_FIELDS, NetSampleConfig, NetSampler
from stallwatch.recorder.sockets import JobSockets
from tests.recorder.netlab import SINK, SOURCE, lab_network, wait_for


def _offsets_in_headers(fields: list[str], tmp: Path) -> dict[str, int]:
    """offsetof(struct tcp_info, tcpi_<name>) from the installed kernel
    headers, for the fields they have."""
    wanted = list(fields)
    for _ in range(len(fields)):
        src = tmp / "tcpi.c"
        lines = [f'printf("{n} %zu\\n", offsetof(struct tcp_info, tcpi_{n}));' for n in wanted]
        src.write_text("#include <stddef.h>\n#include <stdio.h>\n#include <linux/tcp.h>\n"
                       "int main(void) {\n" + "\n".join(lines) + "\nreturn 0; }\n")  # fmt: skip
        done = subprocess.run(["cc", "-o", str(tmp / "tcpi"), str(src)], capture_output=True,
                              text=True, check=False)  # fmt: skip
        if done.returncode == 0:
            out = subprocess.run([str(tmp / "tcpi")], capture_output=True, text=True, check=True)
            return {k: int(v) for k, v in (line.split() for line in out.stdout.splitlines())}
        missing = set(re.findall(r"no member named .?tcpi_(\w+)", done.stderr))
        assert missing, done.stderr
        wanted = [n for n in wanted if n not in missing]
    raise AssertionError("no field compiled")


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_tcp_info_fields_sit_where_the_kernel_headers_put_them(tmp_path: Path) -> None:
    names = [n for n in TCP_INFO_FIELDS if n != "flags"]
    found = _offsets_in_headers(names, tmp_path)
    assert len(found) >= len(names) - 2, sorted(set(names) - set(found))  # snd_wnd: 5.4 on
    for name, offset in found.items():
        assert TCP_INFO_FIELDS[name][0] == offset, name


def test_a_shorter_tcp_info_leaves_what_it_lacks_unknown() -> None:
    """A 4.9 kernel's struct ends before busy_time (168 bytes: delivery_rate
    is its last field); here the first 104 bytes only: no byte counters."""
    info = bytearray(104)
    info[4], info[8:12] = 3, (204_000).to_bytes(4, "little")  # backoff, rto
    info[68:72] = (150).to_bytes(4, "little")  # rtt
    full = bytearray(netsamples.TCP_INFO_BYTES)
    full[7] = 1  # delivery rate app-limited
    full[160:168] = (10**6).to_bytes(8, "little")
    conns = [(bytes(16), bytes(16), 1, 2, 2)] * 2
    rows = netsamples.conn_rows(5, conns, [bytes(info), bytes(full)], [42, 0], [3, UNKNOWN_U32])
    short, whole = rows
    assert (short["backoff"], short["rto_us"], short["srtt_us"]) == (3, 204_000, 150)
    assert short["bytes_acked"] == UNKNOWN_U64 and short["min_rtt_us"] == UNKNOWN_U32
    assert short["delivery_rate_app_limited"] == UNKNOWN_U8
    assert whole["delivery_rate"] == 10**6 and whole["delivery_rate_app_limited"] == 1
    assert (short["pid"], whole["pid"], short["ifindex"]) == (42, 0, 3)


def _ip(text: str) -> bytes:
    return socket.inet_aton(text).ljust(16, b"\0")


@pytest.mark.lab
def test_a_connection_throttled_then_cut_is_seen_second_by_second() -> None:
    """Node 0 streams to node 1 over the lab's switch.  The sampler, in
    node 0's namespace, reads the connection and eth0 every 0.25 s: bytes
    acknowledged grow; a tbf on eth0 then shows as its root qdisc, holding
    packets back (overlimits) with a backlog; a drop of everything the
    switch sends node 0 (the lab's one-way cut) then stops acknowledgements: the connection backs
    off and retransmits, nothing acknowledged for the cut's length."""
    with lab_network(2) as lab:
        n0, n1 = lab.node(0), lab.node(1)
        lab.spawn(1, SINK, n1.ip, "7100")
        source = lab.spawn(0, SOURCE, n1.ip, "7100")
        config = NetSampleConfig(conn_slots=1024, iface_slots=256, period_s=0.25)
        sampler = netns.in_netns(n0.netns, lambda: NetSampler(config))
        eth0 = next(s.ifindex for s in netns.in_netns(n0.netns, lambda: RouteAsk().links())
                    if s.name == "eth0")  # fmt: skip
        given: list[JobSockets] = []

        def tick() -> int:
            return sampler.tick(lambda: [source.pid], given.append)

        wait_for(lambda: tick() and len(sampler.latest), 15)
        conn = sampler.latest[0]
        assert bytes(conn["saddr"]) == _ip(n0.ip) and bytes(conn["daddr"]) == _ip(n1.ip)
        assert (conn["dport"], conn["pid"], conn["ifindex"]) == (7100, source.pid, eth0)
        assert given and given[-1].connections  # the kernel's filter was given the job's sockets

        def run(seconds: float) -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                tick()
                time.sleep(0.05)

        run(1.5)
        lab.tc(0, "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", "8mbit", "burst", "16kb",
               "latency", "200ms")  # fmt: skip
        throttled_at = sampler.clock()
        run(2.0)
        lab.cut(0, "in")  # everything the switch sends node 0: acknowledgements too
        cut_at = sampler.clock()
        run(3.0)
        assert lab.uncut(0) > 0
        run(1.0)
        conns = sampler.conn_writer.buffer.copy().rows
        ifaces = sampler.iface_writer.buffer.copy().rows
        sampler.close()

    mine = conns[conns["dport"] == 7100]
    assert len(np.unique(mine["sport"])) == 1 and len(mine) >= 20, len(mine)
    gaps = np.diff(mine["ts_ns"].astype(np.int64))
    assert np.median(gaps) < 0.4e9, gaps  # a row every period
    before = mine[mine["ts_ns"] < throttled_at]
    assert (np.diff(before["bytes_acked"].astype(np.int64)) > 0).sum() >= 3
    assert (mine["srtt_us"] < UNKNOWN_U32).all() and (mine["state"] == 1).all()
    during = mine[mine["ts_ns"] > cut_at + 1_500_000_000]
    during = during[during["ts_ns"] < cut_at + 3_000_000_000]
    assert len(during) and (during["backoff"] >= 1).any(), during[["backoff", "retrans_out"]]
    assert during["last_ack_recv_ms"].max() >= 1000  # nothing acknowledged for a second and more
    assert (during["unacked"] > 0).all()
    assert mine["total_retrans"].max() > mine["total_retrans"].min()

    eth = ifaces[ifaces["ifindex"] == eth0]
    assert len(eth) >= 20 and {bytes(n).rstrip(b"\0") for n in eth["name"]} == {b"eth0"}
    kinds = [bytes(k).rstrip(b"\0").decode() for k in eth["qdisc_kind"]]
    assert kinds[0] == "noqueue" and kinds[-1] == "tbf", kinds
    tbf = eth[[k == "tbf" for k in kinds]]
    assert tbf["qdisc_overlimits"].max() > 0 and tbf["qdisc_bytes"].max() > 0
    assert (np.diff(eth["tx_bytes"].astype(np.int64)) >= 0).all()
    assert eth["tx_bytes"][-1] > eth["tx_bytes"][0] and (eth["mtu"] == 1500).all()


class _Sockets:
    """A seam for the kernel's socket tables: the job's connections as a list
    the test changes; each open one answers with an empty tcp_info."""

    def __init__(self, conns: list[tuple[bytes, bytes, int, int, int]]) -> None:
        self.conns = conns
        self.reads = 0

    def job_sockets(self, pids: object) -> JobSockets:
        self.reads += 1
        return JobSockets(connections={c: 7 for c in self.conns}, netns={c: 1 for c in self.conns})

    def tcp_infos(self, conns: dict[int, list[tuple[bytes, bytes, int, int, int]]]) -> dict:
        return {c: b"" for cs in conns.values() for c in cs if c in self.conns}


def _conn(port: int) -> tuple[bytes, bytes, int, int, int]:
    return (_ip("10.0.0.1").ljust(16, b"\0"), _ip("10.0.0.2").ljust(16, b"\0"), port, 9000, 2)


def test_connections_opened_as_others_close_are_sampled_from_the_next_tick() -> None:
    """A job's bootstrap connections close as its mesh opens: the sample that
    finds them gone has the job's sockets read again at the next tick, not
    ``ENDPOINTS_S`` later (the mesh went unsampled for 5 s)."""
    now = [0]
    reader = _Sockets([_conn(1)])
    config = NetSampleConfig(conn_slots=64, iface_slots=8, period_s=1.0)
    sampler = NetSampler(config, reader=reader, route=None, clock=lambda: now[0])  # type: ignore[arg-type]

    def tick_at(seconds: float) -> int:
        now[0] = int(seconds * 1e9)
        return sampler.tick(lambda: [7], lambda js: None)

    assert tick_at(0.0) == 1
    reader.conns = [_conn(2), _conn(3)]  # the bootstrap's closed, the mesh's open
    assert tick_at(1.0) == 0  # the old one is gone: nothing to sample
    assert tick_at(1.2) == 0 and reader.reads == 2  # read again at once (due: sampled at 2.2)
    assert tick_at(2.2) == 2
    assert {int(p) for p in sampler.latest["sport"]} == {2, 3}
    assert tick_at(3.2) == 2 and reader.reads == 2  # nothing closed: not read again before 5 s

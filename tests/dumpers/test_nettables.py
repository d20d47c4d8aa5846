"""The network rings' SQL tables (dumpers.nettables): values as the rings
hold them, unknown as NULL, names as text, times on the incident's clock;
through a dump file and back."""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np

from stallwatch.dumpers import format as fmt
from stallwatch.dumpers.layout import (
    UNKNOWN_U8,
    UNKNOWN_U32,
    UNKNOWN_U64,
    EventKind,
    ProbeKind,
    ProbeOutcome,
    ProbeRole,
)
from stallwatch.dumpers.model import Clock, LinkInfo, Recording, Ring
from stallwatch.dumpers.schema import CONN_SAMPLE, IFACE_SAMPLE, PROBE_EVENT, RING_DTYPES
from stallwatch.dumpers.sqltables import tables

OFFSET = 1_790_000_000 * 10**9  # realtime - monotonic of the recording


def _addr(text: str) -> np.ndarray:
    return np.frombuffer(socket.inet_aton(text).ljust(16, b"\0"), np.uint8)


def _text(text: str, width: int) -> np.ndarray:
    return np.frombuffer(text.encode().ljust(width, b"\0"), np.uint8)


def _conn_rows() -> np.ndarray:
    rows = np.zeros(2, CONN_SAMPLE)
    rows["pos"], rows["ts_ns"] = (1, 2), (5 * 10**9, 6 * 10**9)
    rows["kind"], rows["size"] = EventKind.CONN_SAMPLE, CONN_SAMPLE.itemsize
    rows["pid"] = (4242, 0)  # the second's owner is unknown
    rows["family"], rows["state"], rows["ca_state"] = socket.AF_INET, 1, (0, 4)
    rows["saddr"], rows["daddr"] = _addr("10.0.0.1"), _addr("10.0.0.2")
    rows["sport"], rows["dport"] = 40000, 29500
    rows["ifindex"] = (2, UNKNOWN_U32)
    rows["srtt_us"], rows["min_rtt_us"], rows["rto_us"] = 120, 80, 204_000
    rows["bytes_acked"] = (10_000, 20_000)
    rows["delivery_rate_app_limited"] = (1, UNKNOWN_U8)
    rows["snd_wnd"] = (65535, UNKNOWN_U32)  # an older kernel's shorter tcp_info
    rows["busy_time_us"] = (7, UNKNOWN_U64)
    return rows


def _iface_rows() -> np.ndarray:
    rows = np.zeros(1, IFACE_SAMPLE)
    rows["pos"], rows["ts_ns"], rows["kind"] = 1, 5 * 10**9, EventKind.IFACE_SAMPLE
    rows["ifindex"], rows["mtu"], rows["name"] = 2, 1500, _text("eth0", 16)
    rows["qdisc_kind"], rows["qdisc_handle"] = _text("tbf", 16), 0x80010000
    rows["tx_bytes"], rows["qdisc_drops"], rows["qdisc_overlimits"] = 123456, 3, 42
    rows["rx_errors"] = UNKNOWN_U64
    return rows


def _probe_rows() -> np.ndarray:
    rows = np.zeros(2, PROBE_EVENT)
    rows["pos"], rows["ts_ns"], rows["kind"] = (1, 2), 7 * 10**9, EventKind.PROBE
    rows["incident"] = _text("20260101T000000000-node0-00002a", 48)
    rows["round"] = 0xABC
    rows["family"], rows["ifindex"], rows["df"] = socket.AF_INET, 2, 1
    rows["probe"] = (ProbeKind.UDP, ProbeKind.TCP)
    rows["role"] = (ProbeRole.SENT, ProbeRole.RECEIVED)
    rows["outcome"] = (ProbeOutcome.LOST, ProbeOutcome.OK)
    rows["saddr"][0], rows["daddr"][0] = _addr("10.0.0.1"), _addr("10.0.0.2")
    rows["saddr"][1], rows["daddr"][1] = _addr("10.0.0.2"), _addr("10.0.0.1")
    rows["probe_size"], rows["sent"], rows["answered"] = (1500, 262144), (3, 1), (0, 1)
    rows["rtt_us"], rows["mtu"] = (UNKNOWN_U32, UNKNOWN_U32), UNKNOWN_U32
    rows["throughput_bps"] = (UNKNOWN_U64, 9_000_000)
    return rows


def _recording() -> Recording:
    rings = {name: Ring(np.zeros(0, dtype)) for name, dtype in RING_DTYPES.items()}
    rings["conn_samples"] = Ring(_conn_rows())
    rings["iface_samples"] = Ring(_iface_rows())
    rings["probes"] = Ring(_probe_rows())
    links = (LinkInfo(1, "eth0", "netdev", ifindex=2, addresses=("10.0.0.1/24",)),)
    clock = Clock(10 * 10**9, 10 * 10**9 + OFFSET)
    return Recording("node0", "boot", clock, (), (), rings, links=links)


def test_the_network_tables_say_what_the_rings_hold(tmp_path: Path) -> None:
    rec = fmt.read_dump(fmt.write_dump(tmp_path, _recording()))  # through a file
    t = tables(rec)
    conn = t["conn_samples"].to_pylist()
    assert [r["timestamp_ns"] for r in conn] == [5 * 10**9 + OFFSET, 6 * 10**9 + OFFSET]
    assert [r["host_timestamp_ns"] for r in conn] == [5 * 10**9, 6 * 10**9]
    assert [r["pid"] for r in conn] == [4242, None]
    assert [r["interface"] for r in conn] == ["eth0", None]
    assert [r["ifindex"] for r in conn] == [2, None]
    assert [r["ca_state"] for r in conn] == ["open", "loss"]
    assert [r["delivery_rate_app_limited"] for r in conn] == [True, None]
    assert [r["snd_wnd"] for r in conn] == [65535, None]
    assert [r["busy_time_us"] for r in conn] == [7, None]
    first = conn[0]
    assert (first["saddr"], first["daddr"], first["sport"], first["dport"]) == (
        "10.0.0.1", "10.0.0.2", 40000, 29500)  # fmt: skip
    assert (first["state"], first["srtt_us"], first["bytes_acked"]) == ("ESTABLISHED", 120, 10_000)

    (iface,) = t["iface_samples"].to_pylist()
    assert (iface["name"], iface["qdisc_kind"], iface["mtu"]) == ("eth0", "tbf", 1500)
    assert (iface["qdisc_drops"], iface["qdisc_overlimits"], iface["tx_bytes"]) == (3, 42, 123456)
    assert iface["rx_errors"] is None and iface["qdisc_handle"] == 0x80010000

    sent, got = t["probes"].to_pylist()
    assert sent["incident"] == got["incident"] == "20260101T000000000-node0-00002a"
    assert sent["round"] == "0x0000000000000abc"
    assert (sent["kind"], sent["role"], sent["outcome"]) == ("udp", "sent", "lost")
    assert (got["kind"], got["role"], got["outcome"]) == ("tcp", "received", "ok")
    assert (sent["saddr"], sent["daddr"], got["saddr"]) == ("10.0.0.1", "10.0.0.2", "10.0.0.2")
    assert (sent["size"], sent["sent"], sent["answered"], sent["df"]) == (1500, 3, 0, True)
    assert sent["rtt_us"] is None and sent["mtu"] is None and sent["err"] is None
    assert sent["throughput_bps"] is None and got["throughput_bps"] == 9_000_000
    assert sent["interface"] == "eth0"

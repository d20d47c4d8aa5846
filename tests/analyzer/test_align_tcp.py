"""Retransmits (and resets) between hosts, as align gathers them over every
dump's TCP rows at once: which host owns an address, which events count, one
event seen by both ends counted once, and one key per connection from both
of its ends."""

from __future__ import annotations

import ipaddress

import numpy as np
import pytest

from stallwatch.analyzer import align
from stallwatch.analyzer.align import Source, _tcp
from stallwatch.dumpers.addresses import AF_INET, AF_INET6, pack
from stallwatch.dumpers.model import Clock, CommInfo, Recording, Ring
from stallwatch.dumpers.schema import TCP_EVENT, TcpEvent

RANK_PID = 100
Row = tuple[bytes, bytes, int, int, int, int]  # saddr, daddr, ts, pid, family, event


def _row(src: str, dst: str, ts: int, pid: int = RANK_PID, retransmit: bool = True) -> Row:
    family = AF_INET6 if ":" in src else AF_INET
    a, b = ipaddress.ip_address(src), ipaddress.ip_address(dst)
    event = TcpEvent.TCP_RETRANSMIT_SKB if retransmit else TcpEvent.INET_SOCK_SET_STATE
    return (pack(a), pack(b), ts, pid, family, event)


def _source(host: str, rows: list[Row]) -> Source:
    table = np.zeros(len(rows), dtype=TCP_EVENT)
    for r, (src, dst, ts, pid, family, event) in zip(table, rows, strict=True):
        r["saddr"], r["daddr"] = np.frombuffer(src, np.uint8), np.frombuffer(dst, np.uint8)
        r["ts_ns"], r["pid"], r["family"], r["event"] = ts, pid, family, event
        r["sport"], r["dport"] = 40000, 29500
    comms = (CommInfo(RANK_PID, 1, 7, 0, 2),)
    rec = Recording(host, "boot", Clock(0, 0), (), comms, {"tcp": Ring(table)})
    return Source(f"{host}.msgpack", rec)


def _count(sources: list[Source]) -> list[tuple[int, ...]]:
    hosts = tuple(s.recording.host for s in sources)
    table = _tcp(sources, hosts)
    return [tuple(r) for r in table[["host", "pid", "ts", "local", "remote"]].tolist()]


@pytest.mark.parametrize("chunk", [1, align.TCP_CHUNK_ROWS])
def test_one_event_seen_by_both_ends_counts_once_for_the_first_dump(
    chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the dumps' rows joined one dump at a time, or all at once
    monkeypatch.setattr(align, "TCP_CHUNK_ROWS", chunk)
    a = _source("a", [_row("10.0.0.1", "10.0.0.2", 5), _row("10.0.0.1", "10.0.0.2", 9)])
    b = _source(
        "b",
        [
            _row("10.0.0.2", "10.0.0.1", 7),
            _row("10.0.0.1", "10.0.0.2", 5),  # a's event, seen by b too
            _row("10.0.0.2", "10.0.0.1", 8),
        ],
    )
    # (host of the dump, pid, ts, local host, remote host), in the dumps' order
    assert _count([a, b]) == [
        (0, RANK_PID, 5, 0, 1),
        (0, RANK_PID, 9, 0, 1),
        (1, RANK_PID, 7, 1, 0),
        (1, RANK_PID, 8, 1, 0),
    ]


def test_loopback_one_host_and_unknown_addresses_do_not_count() -> None:
    a = _source(
        "a",
        [
            _row("10.0.0.1", "10.0.0.2", 1),
            _row("127.0.0.1", "127.0.0.1", 2),
            _row("::1", "::1", 3),
            _row("::ffff:127.0.0.1", "10.0.0.2", 4),
            _row("10.0.0.1", "10.0.0.1", 5),  # both ends on one host
            _row("10.0.0.1", "10.9.9.9", 6),  # an address no host owns
            _row("10.0.0.1", "10.0.0.2", 8, retransmit=False),
        ],
    )
    b = _source("b", [_row("10.0.0.2", "10.0.0.1", 7)])
    assert _count([a, b]) == [(0, RANK_PID, 1, 0, 1), (1, RANK_PID, 7, 1, 0)]


def test_a_host_owns_its_commonest_address_the_lowest_of_a_tie() -> None:
    # host a's ranks send from two addresses equally often: the lower is its own;
    # rows of a process that is no rank say nothing about the host's address
    a = _source(
        "a",
        [
            _row("10.0.0.3", "10.0.0.2", 1),
            _row("10.0.0.1", "10.0.0.2", 2),
            _row("10.0.0.9", "10.0.0.2", 3, pid=999),
            _row("10.0.0.9", "10.0.0.2", 4, pid=999),
        ],
    )
    b = _source("b", [_row("10.0.0.2", "10.0.0.3", 5), _row("10.0.0.2", "10.0.0.1", 6)])
    assert _count([a, b]) == [(0, RANK_PID, 2, 0, 1), (1, RANK_PID, 6, 1, 0)]


def test_a_connection_has_one_key_from_both_ends_and_resets_count() -> None:
    a = _source("a", [_row("10.0.0.1", "10.0.0.2", 5), _row("10.0.0.1", "10.0.0.2", 6)])
    b = _source("b", [_row("10.0.0.2", "10.0.0.1", 7), _row("10.0.0.2", "10.0.0.1", 8)])
    rows_b = b.recording.rings["tcp"].rows
    rows_b["sport"], rows_b["dport"] = 29500, 40000  # the same connection's other end
    rows_b["event"][1] = TcpEvent.TCP_RECEIVE_RESET
    rows_a = a.recording.rings["tcp"].rows
    rows_a["dport"][1] = 29501  # another connection between the same hosts
    table = _tcp([a, b], ("a", "b"))
    assert len(table) == 4
    keys = {int(r["ts"]): int(r["conn"]) for r in table}
    assert keys[5] == keys[7] == keys[8] != keys[6]
    assert sorted(table["event"].tolist()) == [1, 1, 1, int(TcpEvent.TCP_RECEIVE_RESET)]

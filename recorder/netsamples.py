"""The job's network over time: each job connection's ``struct tcp_info`` and
each job interface's counters, sampled each second into rings of their own
(``conn_samples``, ``iface_samples``: ``dumpers.layout.CONN``, ``IFACE``),
so that a slowdown's dump shows which link slowed, and how.

The job's sockets (its processes' listeners and connections, for the
kernel's TCP filter) are read every ``ENDPOINTS_S`` and at once when a
process is placed in scope (``recorder.sockets``: one sock_diag dump per
namespace of the job); their connections are what is sampled.  A sample
asks the kernel for each connection by its addresses and ports, in batches
of requests written at once (``SockDiag.tcp_infos``: a lookup in the
kernel's hash each, never a walk of every socket of the host), and for each
interface a connection leaves through, its link and root qdisc by index
(``RouteAsk.link_and_qdisc``; no ``tc`` process).  A connection's interface
is the one holding its local address (the loopback's when its peer is this
host; the loopback is not sampled).

A row's ``ts_ns`` is when its sample was read; the values are the kernel's
(a field this kernel's ``struct tcp_info`` lacks is unknown, all ones).
Counters count since the connection (interface, qdisc) began: the
difference between two rows is what happened between them.

The dump's own reading of the job's connections (``tcp_info`` rows after
the TCP ring's, ``with_states``) is here too: it tells whether each
connection was still unacknowledged when the dump was taken.

Known limits: a connection opened between two readings of the job's
sockets is sampled from the next (``ENDPOINTS_S`` at most; the next tick
after a sample found a job connection closed); interfaces and
addresses are those of the agent's network namespace: in ``host`` scope the
connections of ranks in other namespaces are sampled with no interface.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from stallwatch.dumpers.layout import (
    IFACE_NETDEV,
    UNKNOWN_U8,
    UNKNOWN_U32,
    UNKNOWN_U64,
    EventKind,
)
from stallwatch.dumpers.model import Ring
from stallwatch.dumpers.schema import CONN_SAMPLE, IFACE_SAMPLE

from .netlink import NetdevSample, NetlinkError, QdiscSample, RouteAsk
from .rings import RingBuffer, RingWriter
from .sockets import Connection, JobSockets, SocketReader, with_states

log = logging.getLogger("stallwatch.record")

ENDPOINTS_S = 5.0  # the job's TCP sockets are read again this often

# struct tcp_info (include/uapi/linux/tcp.h) as far as it is read: name ->
# (offset, numpy type).  A kernel that sends a shorter struct lacks the fields
# past its end; they read as all ones (unknown).
TCP_INFO_FIELDS: dict[str, tuple[int, str]] = {
    "state": (0, "u1"), "ca_state": (1, "u1"), "retransmits": (2, "u1"), "backoff": (4, "u1"),
    "flags": (7, "u1"),  # bit 0: tcpi_delivery_rate_app_limited
    "rto": (8, "<u4"), "snd_mss": (16, "<u4"), "unacked": (24, "<u4"), "lost": (32, "<u4"),
    "retrans": (36, "<u4"), "last_data_sent": (44, "<u4"), "last_data_recv": (52, "<u4"),
    "last_ack_recv": (56, "<u4"), "pmtu": (60, "<u4"), "rtt": (68, "<u4"), "rttvar": (72, "<u4"),
    "snd_cwnd": (80, "<u4"), "total_retrans": (100, "<u4"), "bytes_acked": (120, "<u8"),
    "bytes_received": (128, "<u8"), "segs_out": (136, "<u4"), "segs_in": (140, "<u4"),
    "notsent_bytes": (144, "<u4"), "min_rtt": (148, "<u4"), "delivery_rate": (160, "<u8"),
    "busy_time": (168, "<u8"), "rwnd_limited": (176, "<u8"), "sndbuf_limited": (184, "<u8"),
    "bytes_sent": (200, "<u8"), "bytes_retrans": (208, "<u8"), "snd_wnd": (228, "<u4"),
}  # fmt: skip
TCP_INFO_BYTES = 232  # through tcpi_snd_wnd
TCP_INFO = np.dtype(
    {
        "names": list(TCP_INFO_FIELDS),
        "formats": [t for _, t in TCP_INFO_FIELDS.values()],
        "offsets": [o for o, _ in TCP_INFO_FIELDS.values()],
        "itemsize": TCP_INFO_BYTES,
    }
)
# conn_sample field <- tcp_info field
FROM_TCP_INFO = {
    "state": "state", "ca_state": "ca_state", "backoff": "backoff",
    "retransmits": "retransmits", "rto_us": "rto", "srtt_us": "rtt", "rttvar_us": "rttvar",
    "min_rtt_us": "min_rtt", "snd_cwnd": "snd_cwnd", "snd_mss": "snd_mss", "pmtu": "pmtu",
    "unacked": "unacked", "retrans_out": "retrans", "lost": "lost",
    "total_retrans": "total_retrans", "notsent_bytes": "notsent_bytes",
    "last_data_sent_ms": "last_data_sent", "last_data_recv_ms": "last_data_recv",
    "last_ack_recv_ms": "last_ack_recv", "segs_out": "segs_out", "segs_in": "segs_in",
    "snd_wnd": "snd_wnd", "delivery_rate": "delivery_rate", "bytes_acked": "bytes_acked",
    "bytes_received": "bytes_received", "bytes_sent": "bytes_sent",
    "bytes_retrans": "bytes_retrans", "busy_time_us": "busy_time",
    "rwnd_limited_us": "rwnd_limited", "sndbuf_limited_us": "sndbuf_limited",
}  # fmt: skip
# rtnl_link_stats64 index of each of IFACE_NETDEV
_STATS64_AT = {"rx_packets": 0, "tx_packets": 1, "rx_bytes": 2, "tx_bytes": 3, "rx_errors": 4,
               "tx_errors": 5, "rx_dropped": 6, "tx_dropped": 7}  # fmt: skip
Address = tuple[bytes, int]  # 16 address bytes, family


@dataclass(frozen=True, slots=True)
class NetSampleConfig:
    conn_slots: int = 16384  # rows (a power of two): 20 connections for 13 minutes
    iface_slots: int = 2048
    period_s: float = 1.0


def tcp_info_rows(infos: list[bytes]) -> np.ndarray:
    """Each ``struct tcp_info`` as a row of ``TCP_INFO``; the bytes a
    kernel did not send are all ones."""
    width = TCP_INFO_BYTES
    blob = b"".join(i[:width] if len(i) >= width else i.ljust(width, b"\xff") for i in infos)
    rows: np.ndarray = np.frombuffer(blob, TCP_INFO, len(infos))
    return rows


def conn_rows(
    ts_ns: int,
    conns: list[Connection],
    infos: list[bytes],
    owners: list[int],
    ifindexes: list[int],
) -> np.ndarray:
    """The ``conn_samples`` rows of one sample (``owners``: pid, 0 unknown;
    ``ifindexes``: UNKNOWN_U32 unknown)."""
    n = len(conns)
    rows = np.zeros(n, CONN_SAMPLE)
    rows["ts_ns"], rows["kind"], rows["size"] = ts_ns, EventKind.CONN_SAMPLE, CONN_SAMPLE.itemsize
    rows["pid"], rows["ifindex"] = owners, ifindexes
    if not n:
        return rows
    rows["saddr"] = np.frombuffer(b"".join(c[0] for c in conns), np.uint8).reshape(n, 16)
    rows["daddr"] = np.frombuffer(b"".join(c[1] for c in conns), np.uint8).reshape(n, 16)
    rows["sport"], rows["dport"] = [c[2] for c in conns], [c[3] for c in conns]
    rows["family"] = [c[4] for c in conns]
    info = tcp_info_rows(infos)
    for field, name in FROM_TCP_INFO.items():
        rows[field] = info[name]
    known = info["delivery_rate"] != np.uint64(UNKNOWN_U64)
    rows["delivery_rate_app_limited"] = np.where(known, info["flags"] & 1, UNKNOWN_U8)
    return rows


def _text(value: str, width: int = 16) -> np.ndarray:
    return np.frombuffer(value.encode()[: width - 1].ljust(width, b"\0"), np.uint8)


def iface_row(ts_ns: int, link: NetdevSample, qdisc: QdiscSample | None) -> np.ndarray:
    """One ``iface_samples`` row (an array of one)."""
    rows: np.ndarray = np.zeros(1, IFACE_SAMPLE)
    row = rows[0]
    row["ts_ns"], row["kind"], row["size"] = ts_ns, EventKind.IFACE_SAMPLE, IFACE_SAMPLE.itemsize
    row["ifindex"], row["name"] = link.ifindex, _text(link.name)
    row["mtu"] = UNKNOWN_U32 if link.mtu is None else link.mtu
    for name in IFACE_NETDEV:
        at = _STATS64_AT[name]
        row[name] = link.stats[at] if at < len(link.stats) else UNKNOWN_U64
    if qdisc is None:
        for name in ("qdisc_packets", "qdisc_drops", "qdisc_overlimits", "qdisc_requeues",
                     "qdisc_backlog_bytes", "qdisc_backlog_packets", "qdisc_handle"):  # fmt: skip
            row[name] = UNKNOWN_U32
        row["qdisc_bytes"] = UNKNOWN_U64
        return rows
    row["qdisc_kind"], row["qdisc_handle"] = _text(qdisc.kind), qdisc.handle
    row["qdisc_bytes"], row["qdisc_packets"] = qdisc.bytes, min(qdisc.packets, UNKNOWN_U32 - 1)
    row["qdisc_drops"], row["qdisc_overlimits"] = qdisc.drops, qdisc.overlimits
    row["qdisc_requeues"] = qdisc.requeues
    row["qdisc_backlog_bytes"] = qdisc.backlog_bytes
    row["qdisc_backlog_packets"] = qdisc.backlog_packets
    return rows


def _address(text: str) -> Address | None:
    host = text.split("/", 1)[0]
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            return socket.inet_pton(family, host).ljust(16, b"\0"), family
        except OSError:
            continue
    return None


class NetSampler:
    """The job's sockets for the kernel's filter, and its connections and
    interfaces sampled into their rings; the agent calls ``tick``."""

    def __init__(
        self,
        config: NetSampleConfig | None = None,
        reader: SocketReader | None = None,
        route: Callable[[], RouteAsk] | None = RouteAsk,  # None: no interfaces (tests)
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.config = cfg = config or NetSampleConfig()
        self.reader = reader or SocketReader()
        self.clock = clock
        self.conn_writer = RingWriter("conn_samples", CONN_SAMPLE, cfg.conn_slots)
        self.iface_writer = RingWriter("iface_samples", IFACE_SAMPLE, cfg.iface_slots)
        self.errors = 0  # samples that could not be read
        self.cpu_ns = 0  # CPU time the samples took (this thread's)
        try:
            self.route: RouteAsk | None = route() if route is not None else None
        except NetlinkError as exc:
            log.warning("netsamples: no rtnetlink (%s): interfaces are not sampled", exc)
            self.route = None
        self._endpoints_due = 0.0
        self._last_js = JobSockets()
        self._next_ns = 0
        self._job: dict[int, list[Connection]] = {}  # namespace -> connections
        self._owners: dict[Connection, int] = {}
        self._iface_of: dict[Connection, int] = {}
        self._ifindex: dict[Address, int] = {}  # own addresses -> interface
        self._loopback: int | None = None
        self.latest = np.zeros(0, CONN_SAMPLE)  # the last sample's rows

    # ---- what the agent sees ------------------------------------------------

    def buffers(self) -> dict[str, RingBuffer]:
        return {"conn_samples": self.conn_writer.buffer, "iface_samples": self.iface_writer.buffer}

    def copy(self) -> dict[str, Ring]:
        return {name: buf.copy() for name, buf in self.buffers().items()}

    @property
    def memory_bytes(self) -> int:
        return sum(b.capacity * b.slots.dtype.itemsize for b in self.buffers().values())

    def own(self) -> set[Address]:
        """This namespace's addresses (as last read: with the job's sockets)."""
        return set(self._ifindex)

    def ifindex_of(self, addr: bytes, family: int) -> int:
        """The interface holding one of this namespace's addresses (UNKNOWN_U32: none)."""
        return self._ifindex.get((addr.ljust(16, b"\0"), family), UNKNOWN_U32)

    def place(self) -> None:
        """A process was placed in scope: its sockets are read at the next tick."""
        self._endpoints_due = 0.0

    def with_states(self, ring: Ring, pids: Iterable[int]) -> Ring:
        """The TCP ring with each job connection's state as the kernel has
        it now (``tcp_info`` rows): whether it was still unacknowledged at
        the dump, told by the kernel, not from which retransmits the ring
        kept.  A failed read leaves the ring as it is."""
        try:
            states = self.reader.connection_states(pids)
        except (OSError, NetlinkError) as exc:
            self.errors += 1
            log.warning("reading the job's connections for the dump: %s", exc)
            return ring
        return with_states(ring, states, time.monotonic_ns())

    # ---- each tick ----------------------------------------------------------

    def tick(
        self, pids: Callable[[], Iterable[int]], job_sockets: Callable[[JobSockets], None]
    ) -> int:
        """The job's sockets every ``ENDPOINTS_S`` (given to ``job_sockets``,
        the kernel's filter), a sample once ``period_s`` passed; returns the
        rows written."""
        now = time.monotonic()
        if now >= self._endpoints_due:
            self._endpoints_due = now + ENDPOINTS_S
            self._learn(self.reader.job_sockets(pids()))
            job_sockets(self._last_js)
        now_ns = self.clock()
        if now_ns < self._next_ns or not self._owners:
            return 0
        self._next_ns = now_ns + int(self.config.period_s * 1e9)
        return self.sample()

    def _learn(self, js: JobSockets) -> None:
        self._last_js = js
        by_ns: dict[int, list[Connection]] = {}
        for conn, ns in js.netns.items():
            by_ns.setdefault(ns, []).append(conn)
        self._job, self._owners = by_ns, dict(js.connections)
        if self.route is not None and self._owners:
            try:
                self._set_addresses(self.route.addresses())
            except NetlinkError as exc:
                self._failed("rtnetlink addresses", exc)
        self._iface_of = {c: self._interface(c) for c in self._owners}

    def _set_addresses(self, table: dict[int, tuple[str, ...]]) -> None:
        self._ifindex = {a: index for index, texts in table.items() for t in texts
                         if (a := _address(t)) is not None}  # fmt: skip
        lo = _address("127.0.0.1")
        self._loopback = self._ifindex.get(lo) if lo is not None else None

    def sample(self) -> int:
        """Read every job connection and interface now; returns the rows
        written.  Its CPU time adds to ``cpu_ns``."""
        cpu = time.thread_time_ns()
        try:
            return self._sample()
        finally:
            self.cpu_ns += time.thread_time_ns() - cpu

    def _sample(self) -> int:
        ts = self.clock()
        infos = self.reader.tcp_infos(self._job)
        gone = [c for c in self._owners if c not in infos]
        for conns in self._job.values():  # closed since: asked no more
            conns[:] = [c for c in conns if c in infos]
        for c in gone:
            del self._owners[c]
        if gone:  # a job that closes connections opens others (a bootstrap's, a reconnect)
            self._endpoints_due = 0.0
        conns = list(infos)
        ifindexes = [self._iface_of.get(c, UNKNOWN_U32) for c in conns]
        rows = conn_rows(ts, conns, [infos[c] for c in conns],
                         [self._owners.get(c, 0) for c in conns], ifindexes)  # fmt: skip
        self.conn_writer.append(rows)
        self.latest = rows
        ifaces = sorted({i for i in ifindexes if i not in (UNKNOWN_U32, self._loopback)})
        return len(rows) + self._sample_ifaces(ts, ifaces)

    def _interface(self, conn: Connection) -> int:
        local, remote, _, _, family = conn
        if (remote, family) in self._ifindex or remote[:1] == b"\x7f":
            return self._loopback if self._loopback is not None else UNKNOWN_U32
        return self._ifindex.get((local, family), UNKNOWN_U32)

    def _sample_ifaces(self, ts: int, ifaces: list[int]) -> int:
        if not ifaces or self.route is None:
            return 0
        try:
            read = self.route.link_and_qdisc(ifaces)
        except NetlinkError as exc:
            self._failed("rtnetlink link and qdisc", exc)
            return 0
        rows = [iface_row(ts, link, qdisc) for link, qdisc in read if link is not None]
        if rows:
            self.iface_writer.append(np.concatenate(rows))
        return len(rows)

    def _failed(self, what: str, exc: Exception) -> None:
        self.errors += 1
        if self.errors in (1, 10, 100, 1000):
            log.warning("netsamples: %s failed (%s failures so far): %s", what, self.errors, exc)

    def close(self) -> None:
        self.reader.close()
        if self.route is not None:
            self.route.close()

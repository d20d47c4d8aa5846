"""rtnetlink from the standard library: the network interfaces of the
agent's network namespace and their addresses, asked for (``RTM_GETLINK``,
``RTM_GETADDR`` dumps) and heard of as they change (a second socket in the
link and address multicast groups).  No new dependency: a dump is one
``sendto`` and a few ``recv_into``, parsed with ``struct``.

What a link message says (``include/uapi/linux/if_link.h``): its index and
flags (``IFF_UP``), name, MTU, operstate (RFC 2863), carrier, the carrier's
change counts (``IFLA_CARRIER_CHANGES``; up and down apart since Linux 4.16),
the 64-bit counters (``struct rtnl_link_stats64``, longer in newer kernels:
counters a kernel does not send are unknown), its kind (``IFLA_INFO_KIND``:
veth, bridge, vlan; none for a NIC) and parent device (a PCI address).

A link speed is not in rtnetlink: ``link_speed_mbps`` asks ethtool's ioctl
on a socket of this namespace (``/sys/class/net`` may be another
namespace's: it is the one sysfs was mounted in).

Which TCP sockets of this namespace carry traffic, and from which local
address, ``tcp_local_addresses`` asks sock_diag (``NETLINK_SOCK_DIAG``, the
kernel's filter on the socket state): ``/proc/net/tcp`` formats every socket
of the host as text, TIME_WAIT ones included (15 ms on a machine with a few
thousand, measured on a loaded one), a dump of the connected ones a fraction.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import socket
import struct
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeGuard

NETLINK_ROUTE, NETLINK_SOCK_DIAG = 0, 4
SOCK_DIAG_BY_FAMILY = 20
# TCP states whose sockets carry traffic: not LISTEN, TIME_WAIT nor CLOSE
TCP_CARRYING = sum(1 << s for s in (1, 2, 3, 4, 5, 8, 9, 11))
RTM_NEWLINK, RTM_DELLINK, RTM_GETLINK = 16, 17, 18
RTM_NEWADDR, RTM_DELADDR, RTM_GETADDR = 20, 21, 22
RTM_NEWQDISC, RTM_GETQDISC = 36, 38
TC_H_ROOT = 0xFFFFFFFF
TCA_KIND, TCA_STATS, TCA_STATS2 = 1, 3, 7
TCA_STATS_BASIC, TCA_STATS_QUEUE = 1, 3
NLM_F_REQUEST, NLM_F_ACK, NLM_F_ECHO, NLM_F_DUMP = 0x1, 0x4, 0x8, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
# multicast groups (RTMGRP_*): links, IPv4 and IPv6 addresses
GROUPS = 0x1 | 0x10 | 0x100

IFLA_IFNAME, IFLA_MTU, IFLA_OPERSTATE, IFLA_LINKINFO = 3, 4, 16, 18
IFLA_STATS64, IFLA_CARRIER, IFLA_CARRIER_CHANGES = 23, 33, 35
IFLA_CARRIER_UP_COUNT, IFLA_CARRIER_DOWN_COUNT, IFLA_PARENT_DEV_NAME = 47, 48, 56
IFLA_INFO_KIND = 1
IFA_ADDRESS, IFA_LOCAL = 1, 2
IFF_UP = 0x1

_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_IFINFOMSG = struct.Struct("=BxHiII")  # family, type, index, flags, change
_IFADDRMSG = struct.Struct("=BBBBi")  # family, prefixlen, flags, scope, index
_RTATTR = struct.Struct("=HH")  # len, type
_DIAG_REQ = struct.Struct("=BBBxI48x")  # inet_diag_req_v2: family, protocol, ext, states, id
# inet_diag_req_v2 naming one socket: its id is sport, dport (big-endian),
# src, dst, ifindex, and the cookie (INET_DIAG_NOCOOKIE: any)
_DIAG_ONE = struct.Struct("=BBBxI2s2s16s16sIII")
_DIAG_ONE_LEN = 16 + _DIAG_ONE.size  # with its netlink header
NOCOOKIE = 0xFFFFFFFF
DIAG_BATCH = 64  # requests sent in one write: their answers fit the socket's buffer
_TCMSG = struct.Struct("=BxxxiIII")  # family, ifindex, handle, parent, info
_GNET_BASIC = struct.Struct("=QI")  # bytes, packets
_GNET_QUEUE = struct.Struct("=IIIII")  # qlen, backlog, drops, requeues, overlimits
_TC_STATS = struct.Struct("=QIIIIIII")  # bytes, packets, drops, overlimits, bps, pps, qlen, backlog
# inet_diag_msg with the ports: family, state, sport, dport (big-endian), src, dst, inode
_DIAG_PORTS = struct.Struct("=BBxx2s2s16s16s4x8x16xI")
INET_DIAG_MSG_SIZE = 72  # sizeof(struct inet_diag_msg): its attributes follow
INET_DIAG_INFO = 2  # the attribute that holds struct tcp_info
# struct tcp_info (include/uapi/linux/tcp.h): the offsets of the fields read
# (tcpi_retransmits, tcpi_rto, tcpi_unacked, tcpi_retrans, tcpi_last_ack_recv,
# tcpi_rtt; then tcpi_bytes_acked, tcpi_bytes_sent, tcpi_bytes_retrans, 4.19+)
_TCPI = struct.Struct("=2xB5xI12xI8xI16xI8xI")
_TCPI_BYTES_ACKED, _TCPI_BYTES_SENT = struct.Struct("=Q"), struct.Struct("=QQ")
_TCPI_BYTES_AT = (120, 200, 216)  # bytes_acked; bytes_sent and bytes_retrans; their end
_U32 = struct.Struct("=I")
RECV_BYTES = 1 << 16
# an answer the kernel never gives must not hold the agent's loop: a wait
# longer than this fails the read (a sock_diag dump of a namespace under a
# neighbour's churn took 0.05 s; a million sockets would take seconds)
ASK_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class NetdevSample:
    """One link message: a network interface as the kernel had it."""

    ifindex: int
    name: str
    admin_up: bool
    operstate: int | None
    carrier: int | None
    carrier_changes: int | None
    carrier_up: int | None
    carrier_down: int | None
    mtu: int | None
    stats: tuple[int, ...]  # struct rtnl_link_stats64, as long as the kernel sent it
    link_type: str | None  # IFLA_INFO_KIND
    parent: str | None  # IFLA_PARENT_DEV_NAME


@dataclass(frozen=True, slots=True)
class Heard:
    """What the multicast socket brought since it was last read."""

    links: tuple[NetdevSample, ...]  # new or changed, in the order heard
    removed: tuple[int, ...]  # ifindexes of links that went
    addresses_changed: bool
    overrun: bool  # messages were lost (the socket's buffer was full): read everything again


class NetlinkError(OSError):
    """rtnetlink could not be asked (no socket, or the kernel refused)."""


def _attrs(buf: bytes, start: int, end: int) -> Iterator[tuple[int, int, int]]:
    """(type, payload start, payload end) of each attribute in buf[start:end]."""
    while start + 4 <= end:
        length, kind = _RTATTR.unpack_from(buf, start)
        if length < 4 or start + length > end:
            return
        yield kind & 0x3FFF, start + 4, start + length  # without NLA_F_NESTED and friends
        start += (length + 3) & ~3


def _text(buf: bytes, start: int, end: int) -> str:
    return buf[start:end].split(b"\0", 1)[0].decode(errors="replace")


def _u32(buf: bytes, start: int, end: int) -> int | None:
    return _U32.unpack_from(buf, start)[0] if end - start >= 4 else None


_LINK_ATTRS = frozenset(
    {IFLA_IFNAME, IFLA_MTU, IFLA_OPERSTATE, IFLA_LINKINFO, IFLA_STATS64, IFLA_CARRIER,
     IFLA_CARRIER_CHANGES, IFLA_CARRIER_UP_COUNT, IFLA_CARRIER_DOWN_COUNT, IFLA_PARENT_DEV_NAME}
)  # fmt: skip


def parse_link(buf: bytes, start: int, end: int) -> NetdevSample | None:
    """The link of an ``RTM_NEWLINK`` message (its payload is buf[start:end])."""
    if end - start < _IFINFOMSG.size:
        return None
    _, _, index, flags, _ = _IFINFOMSG.unpack_from(buf, start)
    found: dict[int, tuple[int, int]] = {}
    at = start + _IFINFOMSG.size
    unpack = _RTATTR.unpack_from
    while at + 4 <= end:  # _attrs inlined: a message has some 40 attributes, we want 10
        length, kind = unpack(buf, at)
        if length < 4 or at + length > end:
            break
        if kind in _LINK_ATTRS:
            found[kind] = (at + 4, at + length)
        at += (length + 3) & ~3

    def u32(kind: int) -> int | None:
        at = found.get(kind)
        return _u32(buf, *at) if at else None

    def u8(kind: int) -> int | None:
        at = found.get(kind)
        return buf[at[0]] if at and at[1] > at[0] else None

    name = found.get(IFLA_IFNAME)
    stats = found.get(IFLA_STATS64)
    info = found.get(IFLA_LINKINFO)
    parent = found.get(IFLA_PARENT_DEV_NAME)
    return NetdevSample(
        ifindex=index,
        name=_text(buf, *name) if name else f"if{index}",
        admin_up=bool(flags & IFF_UP),
        operstate=u8(IFLA_OPERSTATE),
        carrier=u8(IFLA_CARRIER),
        carrier_changes=u32(IFLA_CARRIER_CHANGES),
        carrier_up=u32(IFLA_CARRIER_UP_COUNT),
        carrier_down=u32(IFLA_CARRIER_DOWN_COUNT),
        mtu=u32(IFLA_MTU),
        stats=struct.unpack_from(f"={(stats[1] - stats[0]) // 8}Q", buf, stats[0]) if stats else (),
        link_type=_link_kind(buf, *info) if info else None,
        parent=_text(buf, *parent) if parent else None,
    )


def _link_kind(buf: bytes, start: int, end: int) -> str | None:
    for kind, a, b in _attrs(buf, start, end):
        if kind == IFLA_INFO_KIND:
            return _text(buf, a, b)
    return None


def parse_address(buf: bytes, start: int, end: int) -> tuple[int, str] | None:
    """(ifindex, "address/prefix") of an ``RTM_NEWADDR`` message."""
    if end - start < _IFADDRMSG.size:
        return None
    family, prefix, _, _, index = _IFADDRMSG.unpack_from(buf, start)
    found = {kind: buf[a:b] for kind, a, b in _attrs(buf, start + _IFADDRMSG.size, end)}
    raw = found.get(IFA_LOCAL) or found.get(IFA_ADDRESS)  # IFA_ADDRESS: the peer's on p2p links
    if raw is None or family not in (socket.AF_INET, socket.AF_INET6):
        return None
    return index, f"{socket.inet_ntop(family, raw)}/{prefix}"


def _messages(buf: bytes, n: int) -> Iterator[tuple[int, int, int, int]]:
    """(type, seq, payload start, payload end) of each message in buf[:n]."""
    at = 0
    while at + _NLMSGHDR.size <= n:
        length, kind, _, seq, _ = _NLMSGHDR.unpack_from(buf, at)
        if length < _NLMSGHDR.size or at + length > n:
            return
        yield kind, seq, at + _NLMSGHDR.size, at + length
        at += (length + 3) & ~3


@dataclass(frozen=True, slots=True)
class TcpSocket:
    """One socket of a sock_diag dump; addresses as 16 bytes (IPv4 in the
    first 4, the rest zero), ports in host order."""

    family: int
    state: int  # TCP_ESTABLISHED 1 ... TCP_LISTEN 10
    src: bytes
    dst: bytes
    sport: int
    dport: int
    inode: int  # 0: a request socket (SYN_RECV), no file
    info: TcpInfo | None = None  # asked for and given (``SockDiag.tcp(info=True)``)


@dataclass(frozen=True, slots=True)
class TcpInfo:
    """What the kernel says of a connection now (``struct tcp_info``)."""

    retransmits: int  # retransmission timeouts in a row, unanswered (icsk_retransmits)
    rto_us: int
    srtt_us: int
    last_ack_recv_ms: int  # since the peer last acknowledged anything
    packets_out: int  # segments sent and not acknowledged (tcpi_unacked)
    retrans_out: int  # of them, retransmitted
    unacked_bytes: int | None  # sent and not acknowledged; None before Linux 4.19


def parse_tcp_info(buf: bytes, start: int, end: int) -> TcpInfo | None:
    """A ``struct tcp_info`` at buf[start:end] (shorter in older kernels)."""
    if end - start < _TCPI.size:
        return None
    retransmits, rto, unacked, retrans, last_ack_recv, rtt = _TCPI.unpack_from(buf, start)
    acked_at, sent_at, bytes_end = _TCPI_BYTES_AT
    unacked_bytes = None
    if end - start >= bytes_end:
        (acked,) = _TCPI_BYTES_ACKED.unpack_from(buf, start + acked_at)
        sent, retransmitted = _TCPI_BYTES_SENT.unpack_from(buf, start + sent_at)
        unacked_bytes = max(0, sent - retransmitted - acked)
    return TcpInfo(retransmits, rto, rtt, last_ack_recv, unacked, retrans, unacked_bytes)


@dataclass(frozen=True, slots=True)
class QdiscSample:
    """A device's root qdisc and its statistics (``tc -s qdisc``'s numbers)."""

    ifindex: int
    kind: str  # noqueue, fq_codel, mq, tbf, htb...
    handle: int
    bytes: int  # sent
    packets: int
    drops: int
    overlimits: int
    requeues: int
    backlog_bytes: int
    backlog_packets: int


def parse_qdisc(buf: bytes, start: int, end: int) -> QdiscSample | None:
    """The qdisc of an ``RTM_NEWQDISC`` message (its payload is buf[start:end])."""
    if end - start < _TCMSG.size:
        return None
    _, ifindex, handle, _, _ = _TCMSG.unpack_from(buf, start)
    kind = ""
    basic = queue = None
    legacy: tuple[int, ...] | None = None
    for attr, a, b in _attrs(buf, start + _TCMSG.size, end):
        if attr == TCA_KIND:
            kind = _text(buf, a, b)
        elif attr == TCA_STATS and b - a >= _TC_STATS.size:
            legacy = _TC_STATS.unpack_from(buf, a)
        elif attr == TCA_STATS2:
            for inner, x, y in _attrs(buf, a, b):
                if inner == TCA_STATS_BASIC and y - x >= _GNET_BASIC.size:
                    basic = _GNET_BASIC.unpack_from(buf, x)
                elif inner == TCA_STATS_QUEUE and y - x >= _GNET_QUEUE.size:
                    queue = _GNET_QUEUE.unpack_from(buf, x)
    if basic is None or queue is None:
        if legacy is None:
            return None
        sent, packets, drops, overlimits, _, _, qlen, backlog = legacy
        basic, queue = (sent, packets), (qlen, backlog, drops, 0, overlimits)
    qlen, backlog, drops, requeues, overlimits = queue
    return QdiscSample(ifindex, kind, handle, basic[0], basic[1], drops, overlimits, requeues,
                       backlog, qlen)  # fmt: skip


def _ask_each(
    sock: socket.socket, seq: int, requests: list[tuple[int, bytes]], buf: bytearray
) -> dict[int, tuple[int, int, int, bytes] | int]:
    """Requests that are not dumps, written at once (the kernel answers each
    in turn): request i (its type and body) gets seq ``seq + i``.  Returns,
    per i, its answer (type, payload start, end, buffer) or the errno the
    kernel answered with.  Each is asked with NLM_F_ACK, so that each ends
    with an acknowledgement even where the kernel has nothing to say (a
    device's built-in qdisc); a qdisc with NLM_F_ECHO too: the kernel
    answers a qdisc get as a notification, to the asker only if asked to."""
    out: dict[int, tuple[int, int, int, bytes] | int] = {}
    acked: set[int] = set()
    packed = b"".join(
        _NLMSGHDR.pack(_NLMSGHDR.size + len(body), kind, NLM_F_REQUEST | NLM_F_ACK
                       | (NLM_F_ECHO if kind == RTM_GETQDISC else 0), seq + i, 0) + body
        for i, (kind, body) in enumerate(requests)
    )  # fmt: skip
    try:
        sock.send(packed)
    except OSError as exc:
        raise NetlinkError(exc.errno, f"netlink request: {exc.strerror}") from None
    while len(acked) < len(requests):
        try:
            n = sock.recv_into(buf)
        except OSError as exc:
            raise NetlinkError(exc.errno, f"netlink answer: {exc.strerror or exc}") from None
        got = bytes(memoryview(buf)[:n])
        for msg, their_seq, a, b in _messages(got, n):
            i = their_seq - seq
            if not 0 <= i < len(requests):
                continue  # an answer to an earlier request that was given up
            if msg != NLMSG_ERROR:
                out.setdefault(i, (msg, a, b, got))
                continue
            acked.add(i)
            code = -struct.unpack_from("=i", got, a)[0]
            if code:
                out[i] = code
    return out


def _dump(
    sock: socket.socket, seq: int, kind: int, body: bytes, buf: bytearray
) -> Iterator[tuple[int, int, int, bytes]]:
    """The answers to one dump request: (type, payload start, end, buffer)."""
    header = _NLMSGHDR.pack(_NLMSGHDR.size + len(body), kind, NLM_F_REQUEST | NLM_F_DUMP, seq, 0)
    try:
        sock.send(header + body)
    except OSError as exc:
        raise NetlinkError(exc.errno, f"netlink request: {exc.strerror}") from None
    while True:
        try:
            n = sock.recv_into(buf)
        except OSError as exc:
            raise NetlinkError(exc.errno, f"netlink answer: {exc.strerror}") from None
        got = bytes(memoryview(buf)[:n])
        for msg, their_seq, a, b in _messages(got, n):
            if their_seq != seq:
                continue  # an answer to an earlier request that was given up
            if msg == NLMSG_DONE:
                return
            if msg == NLMSG_ERROR:
                code = -struct.unpack_from("=i", got, a)[0]
                raise NetlinkError(code, f"netlink: {errno.errorcode.get(code, code)}")
            yield msg, a, b, got


class SockDiag:
    """One sock_diag socket, of the network namespace of the thread that
    makes it (``recorder.sockets`` makes one per namespace of the job)."""

    def __init__(self) -> None:
        try:
            self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG)
        except OSError as exc:
            raise NetlinkError(exc.errno, f"sock_diag socket: {exc.strerror}") from None
        self._seq = 0
        self._buf = bytearray(RECV_BYTES)
        self._sock.settimeout(ASK_TIMEOUT_S)
        self._bodies: dict[tuple[bytes, bytes, int, int, int], bytes] = {}
        self._view = memoryview(self._buf)
        self._info_at = 0  # where a socket's tcp_info was in its message
        self.close = weakref.finalize(self, _close, [self._sock])

    def tcp(
        self,
        states: int,
        families: tuple[int, ...] = (socket.AF_INET, socket.AF_INET6),
        info: bool = False,
    ) -> list[TcpSocket]:
        """The namespace's TCP sockets in ``states`` (a mask of 1 << state),
        of ``families``: the kernel skips the others (TIME_WAIT) unformatted.
        Each family is one walk of the host's whole socket hash.  With
        ``info``, each socket's ``struct tcp_info`` too."""
        out = []
        ext = 1 << (INET_DIAG_INFO - 1) if info else 0
        for family in families:
            self._seq += 1
            body = _DIAG_REQ.pack(family, socket.IPPROTO_TCP, ext, states)
            for kind, a, b, buf in _dump(
                self._sock, self._seq, SOCK_DIAG_BY_FAMILY, body, self._buf
            ):
                if kind != SOCK_DIAG_BY_FAMILY:
                    continue
                got, state, sport, dport, src, dst, inode = _DIAG_PORTS.unpack_from(buf, a)
                tcpi = None
                if info:
                    for attr, x, y in _attrs(buf, a + INET_DIAG_MSG_SIZE, b):
                        if attr == INET_DIAG_INFO:
                            tcpi = parse_tcp_info(buf, x, y)
                out.append(TcpSocket(got, state, src, dst, int.from_bytes(sport, "big"),
                                     int.from_bytes(dport, "big"), inode, tcpi))  # fmt: skip
        return out

    def tcp_infos(self, conns: list[tuple[bytes, bytes, int, int, int]]) -> list[bytes | None]:
        """Each connection's ``struct tcp_info`` as the kernel gives it (its
        length says which fields this kernel has), asked socket by socket
        (``(local address, remote address, local port, remote port,
        family)``: the kernel looks each up in its hash, nothing is walked);
        None for one it does not have (closed).  Requests go in batches of
        ``DIAG_BATCH`` written at once; each is answered by one message, the
        socket's or an error."""
        out: list[bytes | None] = [None] * len(conns)
        bodies = self._bodies
        self._bodies = {c: bodies.get(c) or _diag_one(c) for c in conns}
        for first in range(0, len(conns), DIAG_BATCH):
            batch = conns[first : first + DIAG_BATCH]
            seq = self._seq + 1
            self._seq += len(batch)
            packed = b"".join(
                _NLMSGHDR.pack(_DIAG_ONE_LEN, SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, seq + i, 0)
                + self._bodies[c]
                for i, c in enumerate(batch)
            )
            try:
                self._sock.send(packed)
            except OSError as exc:
                raise NetlinkError(exc.errno, f"sock_diag request: {exc.strerror}") from None
            self._answers(seq, len(batch), out, first)
        return out

    def _answers(self, seq: int, n: int, out: list[bytes | None], first: int) -> None:
        """The ``n`` answers from ``seq`` on, each socket's tcp_info into
        ``out[first + i]``: parsed in the receive buffer, one copy each (its
        place in a message is that of the previous one, where it is)."""
        buf, view, pending = self._buf, self._view, n
        header, attr = _NLMSGHDR.unpack_from, _RTATTR.unpack_from
        while pending:
            try:
                got = self._sock.recv_into(buf)
            except OSError as exc:
                raise NetlinkError(exc.errno, f"sock_diag answer: {exc.strerror or exc}") from None
            at = 0
            while at + _NLMSGHDR.size <= got:
                length, kind, _, their_seq, _ = header(buf, at)
                if length < _NLMSGHDR.size or at + length > got:
                    break
                i = their_seq - seq
                if 0 <= i < n:
                    pending -= 1
                    if kind == SOCK_DIAG_BY_FAMILY:
                        out[first + i] = self._info(buf, view, at, at + length, attr)
                at += (length + 3) & ~3

    def _info(self, buf: bytearray, view: memoryview, at: int, end: int,
              attr: Callable[[bytearray, int], tuple[int, int]]) -> bytes | None:  # fmt: skip
        a = at + self._info_at
        if a + 4 <= end:
            alen, atype = attr(buf, a)
            if atype & 0x3FFF == INET_DIAG_INFO and a + alen <= end:
                return bytes(view[a + 4 : a + alen])
        a = at + _NLMSGHDR.size + INET_DIAG_MSG_SIZE
        while a + 4 <= end:
            alen, atype = attr(buf, a)
            if alen < 4:
                return None
            if atype & 0x3FFF == INET_DIAG_INFO:
                self._info_at = a - at
                return bytes(view[a + 4 : a + alen])
            a += (alen + 3) & ~3
        return None


def _diag_one(conn: tuple[bytes, bytes, int, int, int]) -> bytes:
    """The sock_diag request body that names one connection."""
    laddr, raddr, lport, rport, family = conn
    return _DIAG_ONE.pack(family, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1), TCP_CARRYING,
                          lport.to_bytes(2, "big"), rport.to_bytes(2, "big"), laddr, raddr, 0,
                          NOCOOKIE, NOCOOKIE)  # fmt: skip


class RouteAsk:
    """One rtnetlink socket of this network namespace that asks (and hears
    nothing): links, addresses, a link and its root qdisc by index."""

    def __init__(self) -> None:
        try:
            self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE)
        except OSError as exc:
            raise NetlinkError(exc.errno, f"rtnetlink socket: {exc.strerror}") from None
        self._sock.bind((0, 0))
        self._seq = 0
        self._buf = bytearray(RECV_BYTES)
        self._sock.settimeout(ASK_TIMEOUT_S)
        self.close = weakref.finalize(self, _close, [self._sock])

    def links(self) -> list[NetdevSample]:
        out = []
        for kind, a, b, buf in self._dump(RTM_GETLINK, _IFINFOMSG.pack(0, 0, 0, 0, 0)):
            if kind == RTM_NEWLINK and (sample := parse_link(buf, a, b)) is not None:
                out.append(sample)
        return out

    def addresses(self) -> dict[int, tuple[str, ...]]:
        """ifindex -> its addresses, "address/prefix", IPv4 then IPv6."""
        out: dict[int, list[str]] = {}
        for kind, a, b, buf in self._dump(RTM_GETADDR, _IFADDRMSG.pack(0, 0, 0, 0, 0)):
            if kind == RTM_NEWADDR and (found := parse_address(buf, a, b)) is not None:
                out.setdefault(found[0], []).append(found[1])
        return {k: tuple(v) for k, v in out.items()}

    def link_and_qdisc(
        self, ifindexes: list[int]
    ) -> list[tuple[NetdevSample | None, QdiscSample | None]]:
        """Each interface and its root qdisc, asked by index, all at once
        (None: gone; a qdisc the kernel does not report, a device's built-in
        noqueue or noop, is None too)."""
        requests: list[tuple[int, bytes]] = []
        for index in ifindexes:
            requests.append((RTM_GETLINK, _IFINFOMSG.pack(0, 0, index, 0, 0)))
            requests.append((RTM_GETQDISC, _TCMSG.pack(0, index, 0, TC_H_ROOT, 0)))
        answers = _ask_each(self._sock, self._seq + 1, requests, self._buf)
        self._seq += len(requests)
        out = []
        for i in range(len(ifindexes)):
            link, qdisc = answers.get(2 * i), answers.get(2 * i + 1)
            netdev = parse_link(*link[3:], *link[1:3]) if _is(link, RTM_NEWLINK) else None
            root = parse_qdisc(*qdisc[3:], *qdisc[1:3]) if _is(qdisc, RTM_NEWQDISC) else None
            out.append((netdev, root))
        return out

    def _dump(self, kind: int, body: bytes) -> Iterator[tuple[int, int, int, bytes]]:
        self._seq += 1
        return _dump(self._sock, self._seq, kind, body, self._buf)


def _is(answer: object, kind: int) -> TypeGuard[tuple[int, int, int, bytes]]:
    return isinstance(answer, tuple) and answer[0] == kind


class Rtnl:
    """Two rtnetlink sockets of this network namespace: one asks, one hears."""

    def __init__(self) -> None:
        self._ask = RouteAsk()
        self._hear: socket.socket | None = None
        try:
            hear = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE)
            hear.bind((0, GROUPS))
            hear.setblocking(False)
            self._hear = hear
        except OSError:  # links are still read each sample, only later
            pass
        self._buf = bytearray(RECV_BYTES)
        # made now: a socket belongs to the namespace of the thread that makes it
        try:
            self._ethtool: socket.socket | None = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        except OSError:
            self._ethtool = None
        try:
            self._diag: SockDiag | None = SockDiag()
        except NetlinkError:
            self._diag = None
        # closed with this object, whoever forgets to close it
        socks = [self._hear, self._ethtool]
        self.close = weakref.finalize(self, _close_all, socks, self._diag, self._ask)

    @property
    def fd(self) -> int | None:
        """The listening socket's descriptor: readable when a link or address changed."""
        return self._hear.fileno() if self._hear is not None else None

    def tcp_local_addresses(self) -> dict[int, str]:
        """socket inode -> local address, of this namespace's TCP sockets
        that carry traffic (connected, connecting, closing)."""
        if self._diag is None:
            raise NetlinkError(0, "sock_diag: no socket")
        out: dict[int, str] = {}
        for sk in self._diag.tcp(TCP_CARRYING):
            raw = sk.src[:4] if sk.family == socket.AF_INET else sk.src
            out[sk.inode] = socket.inet_ntop(sk.family, raw)
        return out

    def links(self) -> list[NetdevSample]:
        return self._ask.links()

    def addresses(self) -> dict[int, tuple[str, ...]]:
        """ifindex -> its addresses, "address/prefix", IPv4 then IPv6."""
        return self._ask.addresses()

    def heard(self) -> Heard:
        """Everything the listening socket holds, without waiting."""
        links: list[NetdevSample] = []
        removed: list[int] = []
        addresses = overrun = False
        while self._hear is not None:
            try:
                n = self._hear.recv_into(self._buf)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno != errno.ENOBUFS:
                    raise NetlinkError(exc.errno, f"rtnetlink: {exc.strerror}") from None
                overrun = True
                continue
            buf = bytes(memoryview(self._buf)[:n])
            for msg, _, a, b in _messages(buf, n):
                if msg == RTM_NEWLINK and (sample := parse_link(buf, a, b)) is not None:
                    links.append(sample)
                elif msg == RTM_DELLINK and b - a >= _IFINFOMSG.size:
                    removed.append(_IFINFOMSG.unpack_from(buf, a)[2])
                elif msg in (RTM_NEWADDR, RTM_DELADDR):
                    addresses = True
        return Heard(tuple(links), tuple(removed), addresses, overrun)

    def link_speed_mbps(self, name: str) -> int | None:
        """The link's speed as ethtool reports it (ETHTOOL_GSET), None where
        the driver has none (loopback, a link that is down)."""
        if self._ethtool is None:
            return None
        cmd = ctypes.create_string_buffer(_U32.pack(ETHTOOL_GSET) + bytes(40))
        ifreq = struct.pack("16sP", name.encode()[:15], ctypes.addressof(cmd)).ljust(40, b"\0")
        try:
            fcntl.ioctl(self._ethtool.fileno(), SIOCETHTOOL, ifreq)
        except OSError:
            return None
        low, high = (
            struct.unpack_from("=H", cmd.raw, 12)[0],
            struct.unpack_from("=H", cmd.raw, 28)[0],
        )
        speed = low | high << 16
        return None if speed in (0, 0xFFFF, 0xFFFFFFFF) else speed


def _close_all(sockets: list[socket.socket | None], diag: SockDiag | None, ask: RouteAsk) -> None:
    _close(sockets)
    ask.close()
    if diag is not None:
        diag.close()


def _close(sockets: list[socket.socket | None]) -> None:
    for sock in sockets:
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()


SIOCETHTOOL = 0x8946
ETHTOOL_GSET = 0x1

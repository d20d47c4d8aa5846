"""Probes of the job's own paths at an incident: from the address the ranks
use to each peer node's job address (the remote ends of the job's
connections, ``recorder.netsamples``), as the kernel routes the job's
packets.  Every agent probes at the same incident (its peers dump it too),
so each path is probed from both ends, and each end's responder
(``recorder.pathecho``) counts what arrives: a direction that loses
packets shows on both sides.

One round (``Prober.probe``), every peer at once, ``window_s`` (2 s) at
most:

1. UDP datagrams with don't-fragment (``IP_PMTUDISC_PROBE``: sent as
   they are, whatever the host's path MTU cache says) to the peer's
   responder, ``copies`` of each size of a ladder: powers of two from 128
   bytes and the route's MTU (``IP_MTU``); each is answered by a small one.
2. Where some sizes were answered and a larger one never was, the sizes
   between the largest answered and the smallest lost, twice (7 sizes
   each, so the limit is known to about 1/64 of that gap: 7 bytes below a
   1,500-byte MTU): "packets above 1,200 bytes lost, small ones pass".
   Where no datagram was answered (the peer's agent is dead, or the path is
   cut), ICMP echo at the ladder's sizes: the peer's kernel answers.
3. Beside them, a TCP exchange with the peer's responder: ``tcp_bytes``
   (256 KiB) from the job's address; its RTT (the connection's smoothed
   RTT) and throughput.

An ICMP error that comes back says why a size failed (``IP_RECVERR``):
fragmentation needed (and the MTU named), unreachable, or port unreachable
(``refused``: the host answers, its agent is not there).  A round waits for
answers at least TCP's minimum retransmission timeout (200 ms, the
kernel's ``TCP_RTO_MIN``) and three of the peer's smoothed round trips (the
job's connection's, then the probes' own), at most 600 ms, so that three
rounds fit in the window; then it waits out the window, so that the peers'
probes (they began when they heard of the incident) have reached this
node's responder before the dump is taken.

Bounds: the window; per peer at most ``MAX_PEER_BYTES`` (1 MB: a ladder to
a 9,000-byte MTU is 25 KB a copy); ``max_peers`` peers: a job's connections
go to its ring and tree neighbours already (NCCL connects to those), and
where they reach more nodes than that (a full mesh), those whose
connections are in trouble first, then the nearest in address order on
both sides (ranks are placed in node order: the rings' neighbours).

Known limits: ICMP echo over IPv4 only; a peer's address that is not on
this node's namespace (a host-scope agent beside containers) is probed
from the agent's own namespace.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from stallwatch.dumpers.layout import UNKNOWN_U32, ProbeKind, ProbeOutcome, ProbeRole
from stallwatch.dumpers.model import Ring, Trigger, TriggerKind

from .pathecho import PathEcho
from .pathwire import (
    ANSWER,
    HEADER_BYTES,
    ICMP_OVERHEAD,
    PROBE,
    TCP_DONE,
    TCP_HELLO,
    UDP_OVERHEAD,
    Header,
    ProbeRing,
    Tally,
    pack,
    probe_key,
    unpack,
)

log = logging.getLogger("stallwatch.record")

IP_MTU_DISCOVER, IP_PMTUDISC_PROBE, IP_RECVERR, IP_MTU = 10, 3, 11, 14
IPV6_MTU_DISCOVER, IPV6_PMTUDISC_PROBE, IPV6_RECVERR, IPV6_MTU = 23, 3, 25, 24
MSG_ERRQUEUE = 0x2000
SO_EE_ORIGIN_ICMP, SO_EE_ORIGIN_ICMP6 = 2, 3
_EXTENDED_ERR = struct.Struct("=IBBBBII")  # errno, origin, type, code, pad, info, data
TCP_RTO_MIN_NS = 200_000_000  # the kernel's TCP_RTO_MIN: a later answer is one TCP gives up on
ROUND_MAX_NS = 600_000_000  # three rounds in a 2 s window
END_MARGIN_NS = 50_000_000  # the rows are written before the window ends
REFINE_SIZES = 7
MIN_SIZE = 128
MAX_PEER_BYTES = 1 << 20
TCP_SYN_SENT = 2
TCP_SHARE = 0.75  # the TCP exchange ends by this share of the window


@dataclass(frozen=True, slots=True)
class ProbeConfig:
    port: int = 0  # the agents' probe port; 0: no probes and no responder
    max_peers: int = 8
    window_s: float = 2.0
    copies: int = 3  # of each size of the first ladder (2 of each later size)
    tcp_bytes: int = 1 << 18
    slots: int = 4096  # rows of the probes ring


@dataclass(frozen=True, slots=True)
class Peer:
    """A path to probe: the job's own ends of it."""

    local: bytes  # this node's job address (16 bytes, IPv4 in the first 4)
    remote: bytes  # the peer's
    family: int
    ifindex: int = UNKNOWN_U32
    srtt_us: int | None = None
    troubled: bool = False  # its connections back off, retransmit or wait for acknowledgements

    def text(self, which: str) -> str:
        raw = self.local if which == "local" else self.remote
        return socket.inet_ntop(self.family, raw[:4] if self.family == socket.AF_INET else raw)


def _is_loopback(addr: bytes, family: int) -> bool:
    return addr[:1] == b"\x7f" if family == socket.AF_INET else addr == bytes(15) + b"\x01"


def choose_peers(rows: np.ndarray, own: Iterable[tuple[bytes, int]], max_peers: int) -> list[Peer]:
    """The peers to probe, from one sample of the job's connections
    (``conn_samples`` rows): each remote address that is not this node's,
    with the local address most of its connections use; those in trouble
    first, then the nearest in address order around this node's."""
    mine = set(own)
    by_remote: dict[tuple[bytes, int], list[np.void]] = {}
    for r in rows:
        key = (bytes(r["daddr"]), int(r["family"]))
        if key in mine or _is_loopback(*key):
            continue
        by_remote.setdefault(key, []).append(r)
    peers = []
    for (remote, family), conns in by_remote.items():
        locals_ = [bytes(c["saddr"]) for c in conns]
        local = max(set(locals_), key=locals_.count)
        rtts = sorted(int(c["srtt_us"]) for c in conns if c["srtt_us"] != UNKNOWN_U32)
        troubled = any(
            c["backoff"] not in (0, 0xFF) or c["retrans_out"] not in (0, UNKNOWN_U32) for c in conns
        )
        peers.append(Peer(local, remote, family, int(conns[0]["ifindex"]),
                          rtts[len(rtts) // 2] if rtts else None, troubled))  # fmt: skip
    if len(peers) <= max_peers:
        return sorted(peers, key=lambda p: p.remote)
    return _nearest(peers, max_peers)


def _nearest(peers: list[Peer], max_peers: int) -> list[Peer]:
    """Up to half in trouble, then neighbours in address order, alternately
    after and before this node's own address (a ring: the last is next to
    the first), until ``max_peers``."""
    chosen = [p for p in sorted(peers, key=lambda p: p.remote) if p.troubled][: max_peers // 2]
    ring = sorted(peers, key=lambda p: p.remote)
    own = peers[0].local
    after = [p for p in ring if p.remote > own] + [p for p in ring if p.remote < own]
    before = after[::-1]
    for pair in zip(after, before, strict=True):
        for p in pair:
            if len(chosen) < max_peers and p not in chosen:
                chosen.append(p)
    return sorted(chosen, key=lambda p: p.remote)


def ladder(mtu: int) -> list[int]:
    """Powers of two from MIN_SIZE below the MTU, and the MTU."""
    out, size = [], MIN_SIZE
    while size < mtu:
        out.append(size)
        size *= 2
    return [*out, mtu]


def between(low: int, high: int, n: int = REFINE_SIZES) -> list[int]:
    """``n`` sizes evenly between ``low`` and ``high`` (both excluded)."""
    step = (high - low) / (n + 1)
    return sorted({int(low + step * k) for k in range(1, n + 1)} - {low, high})


@dataclass(slots=True)
class _Sent:
    tally: Tally
    sent_ns: int


@dataclass
class _Udp:
    """One peer's datagrams: its socket and what was sent on it."""

    peer: Peer
    sock: socket.socket
    mtu: int
    overhead: int
    tallies: dict[int, Tally] = field(default_factory=dict)  # by size
    sent: dict[int, _Sent] = field(default_factory=dict)  # by seq
    seq: int = 0
    rtts_ns: list[int] = field(default_factory=list)


class Prober:
    """Sends one round of probes to a set of peers (``probe``)."""

    def __init__(self, config: ProbeConfig, key: bytes, ring: ProbeRing,
                 clock: Callable[[], int] = time.monotonic_ns) -> None:  # fmt: skip
        self.config, self.key, self.ring, self.clock = config, key, ring, clock

    def probe(self, incident: str, peers: list[Peer]) -> list[Tally]:
        """Probe every peer (blocking: the window); the rows are written to
        the ring and returned."""
        t0 = self.clock()
        end = t0 + int(self.config.window_s * 1e9)
        rnd = secrets.randbits(64)
        tcp: list[Tally] = []
        threads = [
            threading.Thread(target=lambda p=p: tcp.append(self._exchange(p, incident, rnd, t0)),
                             name="path-probe-tcp", daemon=True)
            for p in peers
        ]  # fmt: skip
        for t in threads:
            t.start()
        udp = [u for p in peers if (u := self._udp_socket(p, incident, rnd, t0)) is not None]
        tallies = self._udp_rounds(udp, incident, rnd, end)
        for u in udp:
            u.sock.close()
        for t in threads:
            t.join(max(0.0, (end - self.clock()) / 1e9) + 1.0)
        tallies += tcp
        self.ring.append(tallies)
        left = end - self.clock()
        if left > 0:  # the peers' probes reach this node's responder meanwhile
            time.sleep(left / 1e9)
        return tallies

    # ---- UDP and ICMP -------------------------------------------------------

    def _udp_socket(self, peer: Peer, incident: str, rnd: int, t0: int) -> _Udp | None:
        family = peer.family
        sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            if family == socket.AF_INET:
                sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_PROBE)
                sock.setsockopt(socket.IPPROTO_IP, IP_RECVERR, 1)
            else:
                sock.setsockopt(socket.IPPROTO_IPV6, IPV6_MTU_DISCOVER, IPV6_PMTUDISC_PROBE)
                sock.setsockopt(socket.IPPROTO_IPV6, IPV6_RECVERR, 1)
            sock.bind((peer.text("local"), 0))
            sock.connect((peer.text("remote"), self.config.port))
            mtu = sock.getsockopt(*((socket.IPPROTO_IP, IP_MTU) if family == socket.AF_INET
                                    else (socket.IPPROTO_IPV6, IPV6_MTU)))  # fmt: skip
        except OSError as exc:
            sock.close()
            t = Tally(ProbeKind.UDP, ProbeRole.SENT, family, peer.local, peer.remote, 0, t0,
                      incident, rnd, ifindex=peer.ifindex, outcome=ProbeOutcome.ERROR,
                      err=exc.errno or 0)  # fmt: skip
            self.ring.append([t])
            return None
        sock.setblocking(False)
        return _Udp(peer, sock, int(mtu), UDP_OVERHEAD[socket.AddressFamily(family)])

    def _udp_rounds(self, udp: list[_Udp], incident: str, rnd: int, end: int) -> list[Tally]:
        copies = self.config.copies
        for u in udp:
            self._send(u, ladder(u.mtu), copies, incident, rnd)
        base = max([u.peer.srtt_us or 0 for u in udp], default=0) * 1000
        self._wait(udp, self._deadline(base, end))
        icmp = _Icmp.open([u for u in udp if not self._answered(u)], self.key)
        icmp_rows: list[Tally] = []
        for _ in range(2):  # refine where some sizes pass and a larger one never did
            spans = {id(u): s for u in udp if (s := self._bracket(u)) is not None}
            if not spans and icmp is None:
                break
            if end - END_MARGIN_NS - self.clock() < TCP_RTO_MIN_NS:
                break  # no time for a round's answers
            rtt = max((max(u.rtts_ns) for u in udp if u.rtts_ns), default=base)
            deadline = self._deadline(rtt, end)
            for u in udp:
                if id(u) in spans:
                    self._send(u, between(*spans[id(u)]), 2, incident, rnd)
            if icmp is not None:
                icmp.send(incident, rnd, 2, self.clock)
            self._wait(udp, deadline, icmp)
            if icmp is not None:  # once: the ladder's sizes tell a dead agent from a dead path
                icmp_rows = icmp.tallies()
                icmp.close()
                icmp = None
        if icmp is not None:  # no time was left for it
            icmp.close()
        for u in udp:
            _refused_port(u)
        tallies = [t for u in udp for t in sorted(u.tallies.values(), key=lambda t: t.size)]
        return tallies + icmp_rows

    def _deadline(self, rtt_ns: int, end: int) -> int:
        wait = min(max(TCP_RTO_MIN_NS, 3 * rtt_ns), ROUND_MAX_NS)
        return min(self.clock() + wait, end - END_MARGIN_NS)

    def _send(self, u: _Udp, sizes: list[int], copies: int, incident: str, rnd: int) -> None:
        for size in sizes:
            if size in u.tallies or size - u.overhead < HEADER_BYTES:
                continue
            now = self.clock()
            t = u.tallies[size] = Tally(ProbeKind.UDP, ProbeRole.SENT, u.peer.family, u.peer.local,
                                        u.peer.remote, size, now, incident, rnd,
                                        ifindex=u.peer.ifindex, rtts_us=[])  # fmt: skip
            for _ in range(copies):
                u.seq += 1
                now = self.clock()
                h = Header(PROBE, copies, u.seq, rnd, now, size, True, incident)
                if not self._send_one(u, t, pack(h, self.key, size - u.overhead)):
                    continue
                t.sent += 1
                t.bytes_sent += size
                u.sent[u.seq] = _Sent(t, now)

    def _send_one(self, u: _Udp, t: Tally, data: bytes) -> bool:
        """Send one probe; an error an earlier probe's ICMP left on the
        socket (a connected UDP socket says it at its next send) is that
        probe's news, said again here, and the probe is sent again."""
        for _ in range(2):
            try:
                u.sock.send(data)
                return True
            except OSError as exc:
                _blame(t, exc.errno or 0, None)
                if exc.errno not in (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH):
                    return False
        return False

    def _answered(self, u: _Udp) -> bool:
        return any(t.answered for t in u.tallies.values())

    def _bracket(self, u: _Udp) -> tuple[int, int] | None:
        """(largest size answered, smallest larger size never answered)
        where they are more than 8 bytes apart."""
        done = sorted((t.size, t.answered > 0) for t in u.tallies.values() if t.sent)
        lost = [s for s, ok in done if not ok]
        passed = [s for s, ok in done if ok and (not lost or s < min(lost))]
        if not lost or not passed or min(lost) - max(passed) <= 8:
            return None
        return max(passed), min(lost)

    def _wait(self, udp: list[_Udp], deadline: int, icmp: _Icmp | None = None) -> None:
        poller = select.poll()
        by_fd = {u.sock.fileno(): u for u in udp}
        for fd in by_fd:
            poller.register(fd, select.POLLIN | select.POLLERR)
        if icmp is not None:
            poller.register(icmp.fd, select.POLLIN)
        while True:
            if all(len(u.sent) == sum(t.answered for t in u.tallies.values()) for u in udp) and (
                icmp is None or icmp.all_answered()
            ):
                return
            left = deadline - self.clock()
            if left <= 0:
                return
            for fd, ev in poller.poll(max(1, left // 1_000_000)):
                if icmp is not None and fd == icmp.fd:
                    icmp.receive(self.clock)
                    continue
                u = by_fd[fd]
                if ev & select.POLLERR:
                    self._errors(u)
                if ev & select.POLLIN:
                    self._answers(u)

    def _answers(self, u: _Udp) -> None:
        while True:
            try:
                data = u.sock.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._errors(u)
                return
            now = self.clock()
            h = unpack(data, self.key)
            sent = u.sent.get(h.seq) if h is not None and h.type == ANSWER else None
            if h is None or sent is None or h.round != sent.tally.round:
                continue
            t = sent.tally
            if t.answered < t.sent:
                t.answered += 1
                t.bytes_received += len(data) + u.overhead
                t.last_ns = now
                assert t.rtts_us is not None
                t.rtts_us.append((now - sent.sent_ns) // 1000)
                u.rtts_ns.append(now - sent.sent_ns)

    def _errors(self, u: _Udp) -> None:
        """ICMP errors the kernel queued for the socket: which probe, and why."""
        while True:
            try:
                data, anc, _, _ = u.sock.recvmsg(HEADER_BYTES, 512, MSG_ERRQUEUE)
            except (BlockingIOError, InterruptedError, OSError):
                return
            h = unpack(data, self.key)
            sent = u.sent.get(h.seq) if h is not None else None
            for _, _, value in anc:
                if sent is None or len(value) < _EXTENDED_ERR.size:
                    continue
                err, origin, _, _, _, info, _ = _EXTENDED_ERR.unpack_from(value)
                _blame(sent.tally, err, info if origin in (SO_EE_ORIGIN_ICMP, SO_EE_ORIGIN_ICMP6)
                       else None)  # fmt: skip

    # ---- TCP ----------------------------------------------------------------

    def _exchange(self, peer: Peer, incident: str, rnd: int, t0: int) -> Tally:
        """Connect to the peer's responder from the job's address, send
        ``tcp_bytes``, read what it says arrived."""
        end = t0 + int(self.config.window_s * TCP_SHARE * 1e9)
        size = min(self.config.tcp_bytes, MAX_PEER_BYTES // 2)
        t = Tally(ProbeKind.TCP, ProbeRole.SENT, peer.family, peer.local, peer.remote, size,
                  self.clock(), incident, rnd, ifindex=peer.ifindex, df=False,
                  rtts_us=[])  # fmt: skip
        sock = socket.socket(peer.family, socket.SOCK_STREAM)
        t.sent = 1  # an exchange, begun with the connection
        try:
            sock.bind((peer.text("local"), 0))
            sock.settimeout(max(0.05, (end - self.clock()) / 1e9))
            sock.connect((peer.text("remote"), self.config.port))
            first = self.clock()
            hello = Header(TCP_HELLO, 1, 0, rnd, first, size, False, incident)
            data = memoryview(pack(hello, self.key) + bytes(size))
            written = 0
            while written < len(data):  # what the kernel took counts, if it ends in a timeout
                sock.settimeout(max(0.01, (end - self.clock()) / 1e9))
                written += sock.send(data[written:])
                t.bytes_sent = max(0, written - HEADER_BYTES)
            done = self._read_done(sock, end)
            now = t.last_ns = self.clock()
            if done is not None:
                t.bytes_received = done.size
                t.answered = int(done.size >= size)
                t.throughput_bps = int(done.size * 8 * 1e9 / max(now - first, 1))
        except TimeoutError:
            pass  # partial or lost: said by what came back
        except OSError as exc:
            _blame(t, exc.errno or 0, None)
        finally:
            _tcp_rtt(sock, t)
            if t.sent and not t.answered and t.outcome is None:
                t.outcome = ProbeOutcome.PARTIAL if t.bytes_received else ProbeOutcome.LOST
            sock.close()
        return t

    def _read_done(self, sock: socket.socket, end: int) -> Header | None:
        buf = b""
        while len(buf) < HEADER_BYTES:
            sock.settimeout(max(0.01, (end - self.clock()) / 1e9))
            data = sock.recv(HEADER_BYTES - len(buf))
            if not data:
                return None
            buf += data
        h = unpack(buf, self.key)
        return h if h is not None and h.type == TCP_DONE else None


def _refused_port(u: _Udp) -> None:
    """The peer's host said nobody listens on the probe port: so of every
    size it answered nothing to (its kernel rate-limits such ICMP errors,
    so not every probe gets its own)."""
    if any(t.answered for t in u.tallies.values()):
        return
    if any(t.outcome is ProbeOutcome.REFUSED for t in u.tallies.values()):
        for t in u.tallies.values():
            if t.outcome is None:
                t.outcome = ProbeOutcome.REFUSED


def _tcp_rtt(sock: socket.socket, t: Tally) -> None:
    """The probe connection's smoothed RTT and bytes acknowledged (struct tcp_info)."""
    with contextlib.suppress(OSError):
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 232)
        rtt = struct.unpack_from("=I", info, 68)[0] if len(info) >= 72 else 0
        if rtt and info[0] != TCP_SYN_SENT:  # answered once: its RTT was measured
            t.rtts_us = [rtt]
        if len(info) >= 128 and not t.bytes_received:
            acked = struct.unpack_from("=Q", info, 120)[0]
            t.bytes_received = max(0, acked - 1 - HEADER_BYTES) if acked else 0


def _blame(t: Tally, err: int, icmp_info: int | None) -> None:
    """What an error says of a probe's fate (the first error that says most)."""
    if err == errno.EMSGSIZE and icmp_info is not None:
        t.outcome, t.mtu = ProbeOutcome.FRAG_NEEDED, icmp_info
    elif err == errno.ECONNREFUSED:
        t.outcome = t.outcome or ProbeOutcome.REFUSED
    elif err in (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EACCES, errno.EPERM):
        t.outcome = t.outcome or ProbeOutcome.UNREACHABLE
    elif err not in (errno.ETIMEDOUT, 0) and t.outcome is None:
        t.outcome, t.err = ProbeOutcome.ERROR, err


# ---- ICMP echo ---------------------------------------------------------------


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    total += total >> 16
    return int(~total & 0xFFFF)


class _Icmp:
    """ICMP echo at a ladder's sizes to peers whose responder answered
    nothing: the peer's kernel answers whether its agent runs or not."""

    def __init__(self, udp: list[_Udp], key: bytes, sock: socket.socket) -> None:
        self.udp, self.key, self.sock = udp, key, sock
        self.fd = sock.fileno()
        self.ident = secrets.randbits(16)
        self.seq = 0
        self.sent: dict[int, _Sent] = {}
        self._tallies: list[Tally] = []

    @classmethod
    def open(cls, udp: list[_Udp], key: bytes) -> _Icmp | None:
        udp = [u for u in udp if u.peer.family == socket.AF_INET]
        if not udp:
            return None
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
            sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_PROBE)
            sock.setblocking(False)
        except OSError as exc:
            log.warning("probes: no ICMP echo (%s)", exc)
            return None
        return cls(udp, key, sock)

    def send(self, incident: str, rnd: int, copies: int, clock: Callable[[], int]) -> None:
        for u in self.udp:
            dest = (u.peer.text("remote"), 0)
            for size in ladder(u.mtu):
                t = Tally(ProbeKind.ICMP, ProbeRole.SENT, u.peer.family, u.peer.local,
                          u.peer.remote, size, clock(), incident, rnd, ifindex=u.peer.ifindex,
                          rtts_us=[])  # fmt: skip
                self._tallies.append(t)
                payload = bytes(max(0, size - ICMP_OVERHEAD[socket.AF_INET]))
                for _ in range(copies):
                    self.seq = (self.seq + 1) & 0xFFFF
                    head = struct.pack("!BBHHH", 8, 0, 0, self.ident, self.seq)
                    packet = head[:2] + struct.pack("!H", _checksum(head + payload)) + head[4:]
                    now = clock()
                    try:
                        self.sock.sendto(packet + payload, dest)
                    except OSError as exc:
                        _blame(t, exc.errno or 0, None)
                        continue
                    t.sent += 1
                    t.bytes_sent += size
                    self.sent[self.seq] = _Sent(t, now)

    def all_answered(self) -> bool:
        return all(t.answered >= t.sent for t in self._tallies)

    def receive(self, clock: Callable[[], int]) -> None:
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except (BlockingIOError, InterruptedError, OSError):
                return
            now = clock()
            ihl = (data[0] & 0x0F) * 4 if data else 0
            if len(data) < ihl + 8:
                continue
            kind, code = data[ihl], data[ihl + 1]
            if kind == 0:  # echo reply
                ident, seq = struct.unpack_from("!HH", data, ihl + 4)
                self._answer(ident, seq, now, len(data))
            elif kind == 3 and len(data) >= ihl + 8 + 28:  # unreachable: our echo inside
                inner = ihl + 8 + (data[ihl + 8] & 0x0F) * 4
                if len(data) >= inner + 8 and data[inner] == 8:
                    ident, seq = struct.unpack_from("!HH", data, inner + 4)
                    sent = self.sent.get(seq) if ident == self.ident else None
                    if sent is not None:
                        mtu = struct.unpack_from("!H", data, ihl + 6)[0]
                        _blame(sent.tally, errno.EMSGSIZE if code == 4 else errno.EHOSTUNREACH,
                               mtu if code == 4 else None)  # fmt: skip

    def _answer(self, ident: int, seq: int, now: int, nbytes: int) -> None:
        sent = self.sent.get(seq) if ident == self.ident else None
        if sent is None:
            return
        t = sent.tally
        if t.answered < t.sent:
            t.answered += 1
            t.bytes_received += nbytes
            t.last_ns = now
            assert t.rtts_us is not None
            t.rtts_us.append((now - sent.sent_ns) // 1000)

    def tallies(self) -> list[Tally]:
        return self._tallies

    def close(self) -> None:
        self.sock.close()


# ---- the agent's probes ----------------------------------------------------------


def silent_peers(peers: list[Peer], rows: list[Tally]) -> frozenset[str]:
    """The peers (as text) that this node sent probes to and that answered
    none of them, of any kind, and refused none (a refusal is their host
    answering)."""
    heard: set[bytes] = set()
    sent: set[bytes] = set()
    for t in rows:
        if t.role is not ProbeRole.SENT or not t.sent:
            continue
        key = t.dst[:16].ljust(16, b"\0")
        sent.add(key)
        if t.answered or t.decided() in (ProbeOutcome.REFUSED, ProbeOutcome.OK):
            heard.add(key)
    return frozenset(
        p.text("remote")
        for p in peers
        if (key := p.remote[:16].ljust(16, b"\0")) in sent and key not in heard
    )


# Incidents of these kinds are probed: a stall or a slowdown, here or a
# peer's (a peer's exit is not: a process ended, its network is not in doubt).
PROBED = frozenset({TriggerKind.IN_FLIGHT, TriggerKind.NO_PROGRESS, TriggerKind.SLOWDOWN})
KNOWN_ORIGINS = 256


class PathProbes:
    """The agent's probes of its paths: its responder, always on, and a
    round at each incident that probing can tell something of
    (``at_incident``, before the dump is taken)."""

    def __init__(
        self,
        config: ProbeConfig,
        token: str | None,
        peers: Callable[[], list[Peer]],
        ifindex_of: Callable[[bytes, int], int],
    ) -> None:
        self.config, self.peers = config, peers
        key = probe_key(token)
        self.ring = ProbeRing(config.slots)
        self.echo = PathEcho(config.port, key, self.ring,
                             ifindex_of=lambda a, f: ifindex_of(a, f))  # fmt: skip
        self.serving = self.echo.start()
        self.prober = Prober(config, key, self.ring)
        self.rounds = 0
        self._origins: dict[str, TriggerKind | None] = {}
        # per incident probed here: the peers (their addresses as text) that
        # answered no probe at all, nor refused one (``unreached``)
        self._unreached: dict[str, frozenset[str]] = {}
        if not token:
            log.warning("probes: no --token-file: any host on the path can make this agent "
                        "answer probes (and count them)")  # fmt: skip

    def note_origin(self, incident_id: str | None, kind: TriggerKind | None) -> None:
        """A peer asked for a dump of its incident, of this kind (None: it did not say)."""
        if incident_id:
            self._origins[incident_id] = kind
            while len(self._origins) > KNOWN_ORIGINS:
                del self._origins[next(iter(self._origins))]

    def worth_probing(self, trigger: Trigger) -> bool:
        if trigger.kind is TriggerKind.PEER:
            origin = self._origins.get(trigger.incident_id)
            return origin is None or origin in PROBED
        return trigger.kind in PROBED

    def at_incident(self, trigger: Trigger) -> None:
        """Probe the job's peers for ``trigger``'s incident (at most the
        window); nothing for an incident probing cannot tell of."""
        if not self.worth_probing(trigger):
            return
        peers = self.peers()
        if not peers:
            log.info("incident %s: no peer to probe (no job connection to another node)",
                     trigger.incident_id)  # fmt: skip
            return
        self.rounds += 1
        rows = self.prober.probe(trigger.incident_id, peers)
        lost = sum(1 for t in rows if t.answered < t.sent)
        log.warning("incident %s: probed %d peer(s): %d of %d probe rows short of answers",
                    trigger.incident_id, len(peers), lost, len(rows))  # fmt: skip
        self._unreached[trigger.incident_id] = silent_peers(peers, rows)
        while len(self._unreached) > KNOWN_ORIGINS:
            del self._unreached[next(iter(self._unreached))]

    def unreached(self, incident_id: str) -> frozenset[str]:
        """The peers this node's probes of the incident found silent: no
        probe of any kind answered, none refused (empty: not probed)."""
        return self._unreached.get(incident_id, frozenset())

    def copy(self) -> Ring:
        self.echo.flush()
        return self.ring.copy()

    def counters(self) -> dict[str, int]:
        return {"probe_rounds": self.rounds, **self.echo.counters}

    def close(self) -> None:
        self.echo.close()

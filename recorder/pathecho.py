"""Every agent's responder to its peers' path probes (``recorder.pathprobe``
sends them; ``recorder.pathwire`` is their format): a UDP and a TCP socket
on the probe port of every address of the agent's namespace, served by one
thread that sleeps in ``poll`` while nobody probes.

- A UDP probe whose MAC checks is answered at once with a header alone,
  from the address it was sent to, and counted: per sender, round and size,
  one ``received`` row (how many arrived of the copies the sender says it
  sent, their bytes, the interface they came in through), written once that
  round has been quiet for ``QUIET_NS``, or when the agent records
  (``flush``).  So a path that delivers one direction and loses the other
  shows here as probes received whose answers the sender never got.
- A TCP exchange (a hello naming its size, then that many bytes) is read to
  its end, answered with what arrived, and counted as one ``received`` row
  with the throughput seen here (first byte to last).

Bounds: answers at most ``ANSWERS_PER_S`` a second (a token bucket: never
a flood's reflector, and never more bytes than a probe brought), at most
``MAX_EXCHANGES`` TCP exchanges at once, each at most ``MAX_EXCHANGE_BYTES``
and ``EXCHANGE_IDLE_NS`` idle; what is refused is counted.

Known limits: IPv4 and IPv6 (two sockets each); a probe port taken by
another process leaves the agent without a responder (logged): its peers'
probes then find ``refused``, as for a dead agent.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from stallwatch.dumpers.layout import UNKNOWN_U32, ProbeKind, ProbeRole

from .pathwire import (
    ANSWER,
    HEADER_BYTES,
    PROBE,
    TCP_DONE,
    TCP_HELLO,
    UDP_OVERHEAD,
    Header,
    ProbeRing,
    Tally,
    pack,
    unpack,
)

log = logging.getLogger("stallwatch.record")

QUIET_NS = 1_000_000_000  # a round's received probes are written once it is quiet this long
ANSWERS_PER_S = 4000  # 64 peers' ladders at once, twice over
MAX_EXCHANGES = 64
MAX_EXCHANGE_BYTES = 1 << 20  # the prober's budget per peer
EXCHANGE_IDLE_NS = 3_000_000_000
IP_PKTINFO = 8  # <linux/in.h>
IPV6_RECVPKTINFO, IPV6_PKTINFO = 49, 50  # <linux/in6.h>
_PKTINFO4 = struct.Struct("=i4s4s")  # ifindex, spec_dst, addr
_PKTINFO6 = struct.Struct("=16si")  # addr, ifindex


@dataclass(slots=True)
class _Exchange:
    sock: socket.socket
    peer: bytes
    family: int
    local: bytes
    ifindex: int
    opened_ns: int
    header: Header | None = None
    got: int = 0
    first_ns: int = 0
    last_ns: int = 0
    buf: bytes = b""


def _raw(family: int, addr: str) -> bytes:
    if family == socket.AF_INET6 and addr.startswith("::ffff:") and "." in addr:
        return socket.inet_aton(addr[7:])
    return socket.inet_pton(family, addr.split("%", 1)[0])


class PathEcho:
    """The responder; ``start`` binds and starts its thread."""

    def __init__(
        self,
        port: int,
        key: bytes,
        ring: ProbeRing,
        clock: Callable[[], int] = time.monotonic_ns,
        ifindex_of: Callable[[bytes, int], int] | None = None,
    ) -> None:
        self.port, self.key, self.ring, self.clock = port, key, ring, clock
        self.ifindex_of = ifindex_of  # where pktinfo says nothing (a TCP exchange)
        self.counters = {"probe_answers": 0, "probe_refused": 0, "probe_foreign": 0}
        self._udp: list[socket.socket] = []
        self._tcp: list[socket.socket] = []
        self._exchanges: dict[int, _Exchange] = {}
        self._pending: dict[tuple[object, ...], Tally] = {}
        self._lock = threading.Lock()
        self._tokens, self._tokens_at = float(ANSWERS_PER_S), 0
        self._stop_r, self._stop_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread: threading.Thread | None = None

    def start(self) -> bool:
        """Bind every socket; False (logged) if the port cannot be had."""
        for family, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
            try:
                self._bind(family, host)
            except OSError as exc:
                if family == socket.AF_INET or exc.errno not in (errno.EAFNOSUPPORT,
                                                                 errno.EADDRNOTAVAIL):  # fmt: skip
                    log.warning("probes: no responder on port %d (%s): peers' probes of this "
                                "node will find nobody", self.port, exc)  # fmt: skip
                    self.close()
                    return False
        self._thread = threading.Thread(target=self._serve, name="path-echo", daemon=True)
        self._thread.start()
        return True

    def _bind(self, family: int, host: str) -> None:
        udp = socket.socket(family, socket.SOCK_DGRAM)
        tcp = socket.socket(family, socket.SOCK_STREAM)
        for s in (udp, tcp):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.setblocking(False)
        if family == socket.AF_INET:
            udp.setsockopt(socket.IPPROTO_IP, IP_PKTINFO, 1)
        else:
            udp.setsockopt(socket.IPPROTO_IPV6, IPV6_RECVPKTINFO, 1)
        try:
            udp.bind((host, self.port))
            tcp.bind((host, self.port))
            tcp.listen(MAX_EXCHANGES)
        except OSError:
            udp.close()
            tcp.close()
            raise
        self._udp.append(udp)
        self._tcp.append(tcp)

    # ---- the thread --------------------------------------------------------

    def _serve(self) -> None:
        poller = select.poll()
        poller.register(self._stop_r, select.POLLIN)
        fds: dict[int, Callable[[], None]] = {}
        for s in self._udp:
            fds[s.fileno()] = lambda s=s: self._datagrams(s)  # type: ignore[misc]
        for s in self._tcp:
            fds[s.fileno()] = lambda s=s: self._accept(s, poller)  # type: ignore[misc]
        for fd in fds:
            poller.register(fd, select.POLLIN)
        while True:
            busy = self._pending or self._exchanges
            for fd, _ in poller.poll(250 if busy else None):
                if fd == self._stop_r:
                    return
                if fd in fds:
                    fds[fd]()
                elif fd in self._exchanges:
                    self._read_exchange(fd, poller)
            self._expire(poller)
            self.flush(self.clock() - QUIET_NS)

    def _take_token(self, now: int) -> bool:
        self._tokens = min(
            ANSWERS_PER_S, self._tokens + (now - self._tokens_at) * ANSWERS_PER_S / 1e9
        )
        self._tokens_at = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True

    def _datagrams(self, sock: socket.socket) -> None:
        while True:
            try:
                data, anc, _, addr = sock.recvmsg(1 << 16, 64)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            self._datagram(sock, data, anc, addr)

    def _datagram(self, sock: socket.socket, data: bytes, anc: list[tuple[int, int, bytes]],
                  addr: tuple[object, ...]) -> None:  # fmt: skip
        now = self.clock()
        h = unpack(data, self.key)
        if h is None or h.type != PROBE:
            self.counters["probe_foreign"] += 1
            return
        family = sock.family
        local, ifindex, answer_anc = b"", 0, []
        for level, kind, value in anc:
            if level == socket.IPPROTO_IP and kind == IP_PKTINFO and len(value) >= _PKTINFO4.size:
                ifindex, _, local = _PKTINFO4.unpack_from(value)
                answer_anc = [(level, kind, _PKTINFO4.pack(0, local, bytes(4)))]
            elif level == socket.IPPROTO_IPV6 and kind == IPV6_PKTINFO:
                local, ifindex = _PKTINFO6.unpack_from(value)
                answer_anc = [(level, kind, _PKTINFO6.pack(local, 0))]
        peer = _raw(family, str(addr[0]))
        size = len(data) + UDP_OVERHEAD[family]
        with self._lock:
            key = (h.round, peer, h.size)
            t = self._pending.get(key)
            if t is None:
                t = self._pending[key] = Tally(ProbeKind.UDP, ProbeRole.RECEIVED, family, peer,
                                               local, h.size, now, h.incident, h.round,
                                               ifindex=ifindex, df=h.df, sent=h.copies)  # fmt: skip
            t.answered += 1
            t.bytes_received += size
            t.last_ns = now
        if not self._take_token(now):
            self.counters["probe_refused"] += 1
            return
        answer = pack(Header(ANSWER, h.copies, h.seq, h.round, h.sent_ns, size, h.df, h.incident),
                      self.key)  # fmt: skip
        with contextlib.suppress(OSError):
            sock.sendmsg([answer], answer_anc, 0, addr)
            self.counters["probe_answers"] += 1

    def _accept(self, listener: socket.socket, poller: select.poll) -> None:
        while True:
            try:
                conn, addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            if len(self._exchanges) >= MAX_EXCHANGES:
                self.counters["probe_refused"] += 1
                conn.close()
                continue
            conn.setblocking(False)
            family = listener.family
            local = _raw(family, str(conn.getsockname()[0]))
            ifindex = UNKNOWN_U32 if self.ifindex_of is None else self.ifindex_of(local, family)
            self._exchanges[conn.fileno()] = _Exchange(
                conn, _raw(family, str(addr[0])), family, local, ifindex, self.clock()
            )
            poller.register(conn.fileno(), select.POLLIN)

    def _read_exchange(self, fd: int, poller: select.poll) -> None:
        ex = self._exchanges[fd]
        while True:
            try:
                data = ex.sock.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:
                return self._end_exchange(fd, poller, answered=False)
            now = self.clock()
            if ex.header is None:
                ex.buf += data
                if len(ex.buf) < HEADER_BYTES:
                    continue
                h = unpack(ex.buf, self.key)
                if h is None or h.type != TCP_HELLO or h.size > MAX_EXCHANGE_BYTES:
                    self.counters["probe_foreign"] += 1
                    return self._end_exchange(fd, poller, answered=False, count=False)
                ex.header, data, ex.buf = h, ex.buf[HEADER_BYTES:], b""
                if not data:
                    continue
            if not ex.got:
                ex.first_ns = now
            ex.got += len(data)
            ex.last_ns = now
            if ex.got >= ex.header.size:
                return self._end_exchange(fd, poller, answered=True)

    def _end_exchange(
        self, fd: int, poller: select.poll, answered: bool, count: bool = True
    ) -> None:
        ex = self._exchanges.pop(fd)
        poller.unregister(fd)
        h = ex.header
        if answered and h is not None:
            done = pack(Header(TCP_DONE, 1, h.seq, h.round, h.sent_ns, ex.got, h.df, h.incident),
                        self.key)  # fmt: skip
            with contextlib.suppress(OSError):
                ex.sock.setblocking(True)
                ex.sock.settimeout(0.5)
                ex.sock.sendall(done)
        ex.sock.close()
        if not count or h is None:
            return
        took_ns = max(ex.last_ns - ex.first_ns, 1)
        t = Tally(ProbeKind.TCP, ProbeRole.RECEIVED, ex.family, ex.peer, ex.local, h.size,
                  ex.first_ns or ex.opened_ns, h.incident, h.round, ifindex=ex.ifindex, df=False,
                  sent=1, answered=int(ex.got >= h.size), last_ns=ex.last_ns,
                  bytes_received=ex.got)  # fmt: skip
        if ex.got > 1 and ex.last_ns > ex.first_ns:
            t.throughput_bps = int(ex.got * 8 * 1e9 / took_ns)
        self.ring.append([t])

    def _expire(self, poller: select.poll) -> None:
        now = self.clock()
        for fd, ex in list(self._exchanges.items()):
            if now - max(ex.last_ns, ex.opened_ns) > EXCHANGE_IDLE_NS:
                self._end_exchange(fd, poller, answered=False)

    # ---- what the agent sees ------------------------------------------------

    def flush(self, before_ns: int | None = None) -> None:
        """Write the received rows of rounds quiet since ``before_ns``
        (None: every round, as the agent records)."""
        with self._lock:
            done = [
                k for k, t in self._pending.items() if before_ns is None or t.last_ns < before_ns
            ]
            tallies = [self._pending.pop(k) for k in done]
        self.ring.append(tallies)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._stop_w, b"\0")
        if self._thread is not None:
            self._thread.join(5)
        for s in [*self._udp, *self._tcp, *(e.sock for e in self._exchanges.values())]:
            s.close()
        self._udp, self._tcp = [], []
        for fd in (self._stop_r, self._stop_w):
            with contextlib.suppress(OSError):
                os.close(fd)

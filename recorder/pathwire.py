"""What the agents' probes of each other's paths share: the probe's wire
format, its authentication, the rows they write and the ring that holds
them (``probes``: ``dumpers.layout.PROBE``).

A probe (UDP datagram, or the opening of a TCP exchange) begins with a
header, in network byte order::

    magic "SWPB", version 1, type (probe 1, answer 2, tcp hello 3, tcp done 4),
    copies u16 (how many of this size the sender sends), seq u32, round u64,
    sent_ns u64 (the sender's clock, echoed), size u32 (the IP packet's
    bytes; tcp: the exchange's payload), df u8, 3 bytes of padding,
    incident 48 bytes (NUL-padded), then 16 bytes of HMAC-SHA256 over all that

and is padded with zeros to its size.  The key is derived from the agents'
bearer token (``--token-file``: peers share it), so that only a peer agent's
probes are answered and counted; agents without a token use an empty key
(anyone on the path can then make them answer, never more bytes than they
were sent).  An answer is a header alone (100 bytes): a probe's answer
travels back small, so that what each side's probes find is one direction's
size limit, and the other side's probes find the other's.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
import threading
from dataclasses import dataclass

import numpy as np

from stallwatch.dumpers.layout import (
    UNKNOWN_U32,
    UNKNOWN_U64,
    EventKind,
    ProbeKind,
    ProbeOutcome,
    ProbeRole,
)
from stallwatch.dumpers.model import Ring
from stallwatch.dumpers.schema import PROBE_EVENT

from .rings import RingBuffer, RingWriter

MAGIC = b"SWPB"
VERSION = 1
PROBE, ANSWER, TCP_HELLO, TCP_DONE = 1, 2, 3, 4
_HEADER = struct.Struct("!4sBBHIQQIB3x48s")
MAC_BYTES = 16
HEADER_BYTES = _HEADER.size + MAC_BYTES  # 100
INCIDENT_BYTES = 48
# an IPv4 (IPv6) packet carries 20 (40) bytes of IP header and 8 of UDP
# before the probe's own
UDP_OVERHEAD = {socket.AF_INET: 28, socket.AF_INET6: 48}
ICMP_OVERHEAD = {socket.AF_INET: 28}


@dataclass(frozen=True, slots=True)
class Header:
    type: int
    copies: int
    seq: int
    round: int
    sent_ns: int
    size: int
    df: bool
    incident: str


def probe_key(token: str | None) -> bytes:
    """The probes' MAC key, from the agents' shared token (b"" without one)."""
    if not token:
        return b""
    return hashlib.sha256(b"stallwatch path probe\0" + token.encode()).digest()


def pack(h: Header, key: bytes, size: int = 0) -> bytes:
    """The header, its MAC, and zeros up to ``size`` bytes."""
    incident = h.incident.encode()[:INCIDENT_BYTES]
    body = _HEADER.pack(MAGIC, VERSION, h.type, h.copies, h.seq, h.round, h.sent_ns, h.size,
                        int(h.df), incident)  # fmt: skip
    mac = hmac.new(key, body, hashlib.sha256).digest()[:MAC_BYTES]
    return (body + mac).ljust(size, b"\0")


def unpack(data: bytes, key: bytes) -> Header | None:
    """The header of ``data``, or None if it is not a peer agent's (too
    short, another magic or version, a MAC that does not match)."""
    if len(data) < HEADER_BYTES:
        return None
    body, mac = data[: _HEADER.size], data[_HEADER.size : HEADER_BYTES]
    magic, version, kind, copies, seq, rnd, sent_ns, size, df, incident = _HEADER.unpack(body)
    if magic != MAGIC or version != VERSION:
        return None
    if not hmac.compare_digest(mac, hmac.new(key, body, hashlib.sha256).digest()[:MAC_BYTES]):
        return None
    text = incident.rstrip(b"\0").decode(errors="replace")
    return Header(kind, copies, seq, rnd, sent_ns, size, bool(df), text)


def address16(addr: bytes) -> np.ndarray:
    return np.frombuffer(addr.ljust(16, b"\0"), np.uint8)


@dataclass(slots=True)
class Tally:
    """What a row says: its probes, their answers, what came back."""

    kind: ProbeKind
    role: ProbeRole
    family: int
    src: bytes  # 16 bytes
    dst: bytes
    size: int
    first_ns: int
    incident: str
    round: int
    ifindex: int = UNKNOWN_U32
    df: bool = True
    sent: int = 0
    answered: int = 0
    last_ns: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    rtts_us: list[int] | None = None
    throughput_bps: int = UNKNOWN_U64
    outcome: ProbeOutcome | None = None  # None: from the counts
    mtu: int = UNKNOWN_U32
    err: int = 0

    def decided(self) -> ProbeOutcome:
        if self.outcome is not None:
            return self.outcome
        if self.sent and self.answered >= self.sent:
            return ProbeOutcome.OK
        return ProbeOutcome.PARTIAL if self.answered else ProbeOutcome.LOST


def rows_of(tallies: list[Tally]) -> np.ndarray:
    rows = np.zeros(len(tallies), PROBE_EVENT)
    for i, t in enumerate(tallies):
        r = rows[i]
        r["ts_ns"], r["kind"], r["size"] = t.first_ns, EventKind.PROBE, PROBE_EVENT.itemsize
        r["incident"] = np.frombuffer(
            t.incident.encode()[:INCIDENT_BYTES].ljust(INCIDENT_BYTES, b"\0"), np.uint8
        )
        r["saddr"], r["daddr"], r["family"] = address16(t.src), address16(t.dst), t.family
        r["probe"], r["role"], r["outcome"], r["df"] = t.kind, t.role, t.decided(), int(t.df)
        r["ifindex"], r["probe_size"], r["sent"], r["answered"] = (
            t.ifindex,
            t.size,
            t.sent,
            t.answered,
        )
        rtts = sorted(t.rtts_us or ())
        r["rtt_us"] = min(rtts[len(rtts) // 2], UNKNOWN_U32 - 1) if rtts else UNKNOWN_U32
        r["mtu"], r["err"], r["round"] = t.mtu, t.err, t.round
        r["throughput_bps"] = t.throughput_bps
        r["bytes_sent"], r["bytes_received"] = t.bytes_sent, t.bytes_received
        last = max(t.last_ns, t.first_ns)
        r["duration_us"] = (last - t.first_ns) // 1000
    return rows


class ProbeRing:
    """The ``probes`` ring: written by the prober and the responder's thread."""

    def __init__(self, slots: int) -> None:
        self._writer = RingWriter("probes", PROBE_EVENT, slots)
        self._lock = threading.Lock()

    @property
    def buffer(self) -> RingBuffer:
        return self._writer.buffer

    def append(self, tallies: list[Tally]) -> None:
        if tallies:
            rows = rows_of(tallies)
            with self._lock:
                self._writer.append(rows)

    def copy(self) -> Ring:
        with self._lock:
            return self._writer.buffer.copy()

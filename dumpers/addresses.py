"""The 16-byte address fields of ``tcp_event`` (``saddr``, ``daddr``).

The kernel writes IPv4 addresses into the first 4 bytes (zeros after) when the
socket's family is AF_INET, and IPv6 ones whole; a dual-stack socket talking
IPv4 shows IPv4-mapped IPv6 (``::ffff:a.b.c.d``).  Every part that reads or
compares these fields (the agent's scope filter, the analyzer's host
addresses, the SQL tables) does it through this module.
"""

from __future__ import annotations

import ipaddress

import numpy as np

AF_INET = 2
AF_INET6 = 10
FIELD_BYTES = 16
V4_MAPPED = np.array([0] * 10 + [0xFF, 0xFF], dtype=np.uint8)
V6_LOOPBACK = np.array([0] * 15 + [1], dtype=np.uint8)


def pack(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bytes:
    """An address as the kernel's 16-byte field (IPv4 first, then zeros)."""
    return ip.packed.ljust(FIELD_BYTES, b"\0")


def format_address(family: int, raw: bytes) -> str:
    """Text of one field: dotted IPv4, IPv6, or hex for another family."""
    if family == AF_INET:
        return str(ipaddress.IPv4Address(raw[:4]))
    if family == AF_INET6:
        return str(ipaddress.IPv6Address(raw))
    return raw.hex()


def as_rows(addrs: np.ndarray) -> np.ndarray:
    """Fields as an (n, 16) uint8 array."""
    return np.ascontiguousarray(addrs, dtype=np.uint8).reshape(-1, FIELD_BYTES)


def ipv4_unmapped(addrs: np.ndarray) -> np.ndarray:
    """A copy with IPv4-mapped IPv6 (``::ffff:a.b.c.d``) rewritten as IPv4
    (four bytes, then zeros), so that both spellings compare equal."""
    out = as_rows(addrs).copy()
    mapped = (out[:, :12] == V4_MAPPED).all(axis=1)
    out[mapped, :4] = out[mapped, 12:]
    out[mapped, 4:] = 0
    return out


def words(addrs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Fields as two unsigned 64-bit words each (bytes 0-7, 8-15), read
    big-endian: ordered as the bytes are, and compared a word at a time,
    not a byte."""
    pair = as_rows(addrs).view(">u8").astype(np.uint64)
    return pair[:, 0], pair[:, 1]


def distinct(addrs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct fields, in byte order (an (n, 16) uint8 array), and the
    index of each row's there: ``np.unique`` by 16-byte value, as passes
    over integers (a sort of 16-byte voids compares them a byte at a time,
    several times as slow).  IPv4 fields (zeros after the first 4 bytes)
    differ in their first word alone."""
    hi, lo = words(addrs)
    if not lo.any():
        his, which = np.unique(hi, return_inverse=True)
        out = np.zeros((len(his), 2), dtype=">u8")
        out[:, 0] = his
        return out.view(np.uint8), which.ravel()
    his, hi_of = np.unique(hi, return_inverse=True)
    los, lo_of = np.unique(lo, return_inverse=True)
    pairs, which = np.unique(hi_of.ravel() * len(los) + lo_of.ravel(), return_inverse=True)
    out = np.empty((len(pairs), 2), dtype=">u8")
    out[:, 0], out[:, 1] = his[pairs // len(los)], los[pairs % len(los)]
    return out.view(np.uint8), which.ravel()


def is_loopback(addrs: np.ndarray, family: np.ndarray) -> np.ndarray:
    """Per row: 127.0.0.0/8, ::1 or ::ffff:127.0.0.0/104."""
    hi, lo = words(addrs)
    v4 = (family == AF_INET) & (hi >> np.uint64(56) == 127)
    # ::ffff:127.x.y.z: bytes 0-9 zero, 10-11 0xff, 12 127
    mapped = (hi == 0) & (lo >> np.uint64(24) == 0xFFFF7F)
    one = (hi == 0) & (lo == 1) & (family != AF_INET)
    out: np.ndarray = v4 | mapped | one
    return out


def is_shared(addrs: np.ndarray) -> np.ndarray:
    """Per row (IPv4-mapped already unmapped): addresses every network
    namespace has, which say nothing about whose a socket is: unspecified,
    127.0.0.0/8, ::1."""
    rows = as_rows(addrs)
    v4_rest_zero = (rows[:, 4:] == 0).all(axis=1)
    unspecified = (rows == 0).all(axis=1)
    v4_loopback = v4_rest_zero & (rows[:, 0] == 127)
    v6_loopback = (rows == V6_LOOPBACK).all(axis=1)
    shared: np.ndarray = unspecified | v4_loopback | v6_loopback
    return shared

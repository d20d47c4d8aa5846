"""The 16-byte address fields (``dumpers.addresses``): loopback and distinct
values, computed a word at a time, agree with the bytes' own definition on
any field, IPv4, IPv4-mapped and IPv6 alike, read from a structured row
as the analyzer reads them."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from stallwatch.dumpers import addresses
from stallwatch.dumpers.addresses import AF_INET, AF_INET6

MAPPED = bytes(10) + b"\xff\xff"
LOOPBACK6 = bytes(15) + b"\x01"

# fields drawn near the edges the rules draw: 127 and its neighbours in
# the first byte and after the mapped prefix, ::1 and ::2, IPv4 with zeros after
_byte = st.sampled_from([0, 1, 126, 127, 128, 255])
_v4 = st.tuples(_byte, _byte, _byte, _byte).map(lambda b: bytes(b) + bytes(12))
_mapped = st.tuples(_byte, _byte).map(lambda b: MAPPED + bytes([b[0], 0, 0, b[1]]))
_near_mapped = st.tuples(st.integers(0, 11), _byte).map(
    lambda p: bytes(MAPPED[: p[0]] + bytes([p[1]]) + MAPPED[p[0] + 1 :]) + b"\x7f\x00\x00\x01"
)
_six = st.sampled_from([LOOPBACK6, bytes(15) + b"\x02", bytes(16), b"\x20\x01\x0d\xb8" + bytes(12)])
_field = st.one_of(_v4, _mapped, _near_mapped, _six, st.binary(min_size=16, max_size=16))
_row = st.tuples(_field, st.sampled_from([AF_INET, AF_INET6, 0, 17]))


def _loopback(raw: bytes, family: int) -> bool:
    """The definition, byte by byte."""
    v4 = family == AF_INET and raw[0] == 127
    mapped = raw[:12] == MAPPED and raw[12] == 127
    return v4 or mapped or (raw == LOOPBACK6 and family != AF_INET)


def _table(rows: list[tuple[bytes, int]]) -> np.ndarray:
    """The fields inside records, as the rings hold them (a strided view)."""
    dtype = np.dtype([("pid", "<u4"), ("saddr", "u1", 16), ("family", "<u2")])
    table = np.zeros(len(rows), dtype=dtype)
    for i, (raw, family) in enumerate(rows):
        table["saddr"][i] = np.frombuffer(raw, dtype=np.uint8)
        table["family"][i] = family
    return table


@settings(max_examples=300, deadline=None)
@given(st.lists(_row, max_size=40))
def test_loopback_is_the_bytes_definition(rows: list[tuple[bytes, int]]) -> None:
    table = _table(rows)
    got = addresses.is_loopback(table["saddr"], table["family"])
    assert got.tolist() == [_loopback(raw, family) for raw, family in rows]


@settings(max_examples=300, deadline=None)
@given(st.lists(_row, max_size=40))
def test_distinct_fields_in_byte_order(rows: list[tuple[bytes, int]]) -> None:
    table = _table(rows)
    values, which = addresses.distinct(table["saddr"])
    expected = sorted({raw for raw, _ in rows})
    assert [v.tobytes() for v in values] == expected
    assert [values[i].tobytes() for i in which.tolist()] == [raw for raw, _ in rows]


def test_distinct_ipv4_alone_and_with_ipv6() -> None:
    """IPv4 fields alone (the first word tells them apart) and beside IPv6
    ones that share that word: the same values either way."""
    v4 = [bytes([10, 0, 0, n]) + bytes(12) for n in (3, 1, 3, 2)]
    six = [bytes([10, 0, 0, 1]) + bytes(11) + b"\x01"]
    for rows in (v4, v4 + six):
        values, which = addresses.distinct(_table([(r, AF_INET) for r in rows])["saddr"])
        assert [v.tobytes() for v in values] == sorted(set(rows))
        assert [values[i].tobytes() for i in which.tolist()] == rows

"""A checksum per section of a dump (format version 6): a damaged header,
table, ring description or block of ring data is refused with one line
naming the file and the section; dumps written before checksums still read,
unchecked."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest

from stallwatch.dumpers import format as fmt
from stallwatch.dumpers.errors import DumpChecksumError, DumpError, DumpFormatError
from stallwatch.dumpers.model import CHECKSUMS_SINCE, FORMAT_VERSION
from tests.dump_samples import assert_same, sample_recording
from tests.dumpers.test_format import _as_version_6

BLOCK = fmt.CHECK_BLOCK
ROW = 160  # bytes of an NCCL row today


def _flip(data: bytes, at: int, bit: int = 0) -> bytes:
    out = bytearray(data)
    out[at] ^= 1 << bit
    return bytes(out)


def _nccl_offset(path: Path) -> int:
    _, deferred = fmt.read_dump_deferred(path, ["nccl"])
    return deferred["nccl"].offset


def _write(tmp_path: Path, data: bytes, name: str = "n1.msgpack") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_a_dump_carries_a_checksum_per_section_and_reads_back_checked() -> None:
    rec = sample_recording(100)
    doc = msgpack.unpackb(fmt.encode(rec), raw=False)
    assert list(doc)[-1] == "checksums" and doc["version"] == FORMAT_VERSION >= CHECKSUMS_SINCE
    sums = doc["checksums"]
    assert sums["algorithm"] == "crc32" and sums["block"] == BLOCK
    assert list(sums["rings"]) == list(rec.rings)
    assert all(len(r["data"]) == 1 for r in sums["rings"].values())  # each under a block
    back = fmt.decode(fmt.encode(rec), "n1")
    assert_same(rec, back)
    assert back.checked and back.format_version == FORMAT_VERSION


# (the text that is damaged, the section named): a value of each section
SECTIONS = [
    (b"node-1", "header"),  # the host
    (b"allreduce seq 57", "header"),  # the trigger's reason
    (b"train.py --rank 1", "tables"),  # a process's command line
    (b"10.0.0.1:29500", "tables"),  # a communicator's bootstrap root
]


@pytest.mark.parametrize(("text", "section"), SECTIONS, ids=[s[0].decode() for s in SECTIONS])
def test_a_flipped_bit_in_a_section_refuses_the_dump_naming_file_and_section(
    text: bytes, section: str
) -> None:
    data = fmt.encode(sample_recording(100))
    at = data.index(text) + 2
    with pytest.raises(DumpChecksumError) as err:
        fmt.decode(_flip(data, at), "dumps/n1.msgpack")
    message = str(err.value)
    assert message.startswith(f"dumps/n1.msgpack: {section}: damaged (checksum ")
    assert "\n" not in message


def test_a_ring_description_and_a_ring_row_are_checked(tmp_path: Path) -> None:
    data = fmt.encode(sample_recording(100))
    # the tcp ring's lost counter (3: a positive fixint right after its key)
    lost = data.index(b"\xa4lost\x03", data.index(b"\xa3tcp")) + 5
    with pytest.raises(DumpChecksumError, match=r"^n1: rings\.tcp: damaged \(checksum"):
        fmt.decode(_flip(data, lost), "n1")
    path = _write(tmp_path, data)
    row = _nccl_offset(path) + 37 * ROW + 40  # a count field of row 37
    with pytest.raises(DumpChecksumError) as err:
        fmt.decode(_flip(data, row, 5), "n1")
    assert str(err.value).startswith("n1: rings.nccl: damaged (bytes 0-15999 of its data:")


def _big(tmp_path: Path) -> tuple[Path, bytes, int]:
    """A dump whose NCCL ring spans three blocks (the last one short)."""
    rec = sample_recording(2 * BLOCK // ROW + 100)
    data = fmt.encode(rec)
    path = _write(tmp_path, data)
    return path, data, _nccl_offset(path)


def test_rings_left_in_the_file_are_checked_block_by_block_as_read(tmp_path: Path) -> None:
    path, data, start = _big(tmp_path)
    rows = len(fmt.decode(data, "x").rings["nccl"].rows)
    whole = fmt.read_dump_deferred(path, ["nccl"])[1]["nccl"]
    assert len(whole.checksums) == 3 and whole.block == BLOCK
    # damage in the second block, outside the rows a reader of the latest
    # 10 reads (the third block's): those read; the whole ring does not
    _write(tmp_path, _flip(data, start + BLOCK + 10))
    ring = fmt.read_dump_deferred(path, ["nccl"])[1]["nccl"]
    assert (rows - 10) * ROW > 2 * BLOCK
    assert len(ring.read(first=rows - 10)) == 10
    with pytest.raises(DumpChecksumError) as err:
        ring.read()
    assert str(err.value) == (
        f"{path}: rings.nccl: damaged (bytes {BLOCK}-{2 * BLOCK - 1} of its data: "
        f"checksum {_crc_of(path, start, 1):08x}, written {whole.checksums[1]:08x})"
    )
    # the rows read start inside the second block: its bytes before them
    # are read too, and checked with it
    first = (BLOCK + 20) // ROW + 1
    with pytest.raises(DumpChecksumError, match=r"rings\.nccl: damaged"):
        ring.read(bytearray(ring.nbytes), first)
    # the decoder of a whole dump (query, export, serve) refuses it too
    with pytest.raises(DumpChecksumError, match=r"rings\.nccl: damaged"):
        fmt.read_dump(path)


def _crc_of(path: Path, start: int, block: int) -> int:
    data = path.read_bytes()[start + block * BLOCK : start + (block + 1) * BLOCK]
    return fmt.block_crcs(data)[0]


def test_damage_in_the_checksums_themselves_refuses_the_dump() -> None:
    data = fmt.encode(sample_recording(100))
    at = data.index(b"\xa6tables") + 8  # inside the tables' checksum
    with pytest.raises(DumpChecksumError, match=r"^n1: tables: damaged \(checksum"):
        fmt.decode(_flip(data, at), "n1")
    doc = msgpack.unpackb(data, raw=False)
    doc["checksums"]["block"] = 3
    with pytest.raises(DumpChecksumError, match=r"^n1: checksums: damaged \(unreadable\)"):
        fmt.decode(msgpack.packb(doc, use_bin_type=True), "n1")
    del doc["checksums"]
    with pytest.raises(DumpChecksumError, match=r"checksums: damaged \(missing or unreadable"):
        fmt.decode(msgpack.packb(doc, use_bin_type=True), "n1")


def test_a_version_flipped_back_refuses_the_dump() -> None:
    """A damaged version that names one without checksums leaves an
    unexpected field: refused, never read unchecked."""
    doc = msgpack.unpackb(fmt.encode(sample_recording(100)), raw=False)
    doc["version"] = CHECKSUMS_SINCE - 1
    # the first field the older version lacks: links (7) or checksums (6)
    with pytest.raises(DumpFormatError, match=r"unexpected field '(links|checksums)'"):
        fmt.decode(msgpack.packb(doc, use_bin_type=True), "n1")


def test_dumps_written_before_checksums_read_unchecked() -> None:
    folder = Path(__file__).resolve().parents[1] / "data" / "lab-hang-2x2"
    recs = [fmt.read_dump(p) for p in sorted(folder.glob("*.msgpack"))]
    assert recs and all(not r.checked and r.format_version < CHECKSUMS_SINCE for r in recs)
    doc = _as_version_6(sample_recording(100))
    del doc["checksums"]
    doc["version"] = 5
    old = fmt.decode(msgpack.packb(doc, use_bin_type=True), "n1")
    assert not old.checked and len(old.rings["nccl"].rows) == 100


def test_a_flipped_bit_in_any_byte_of_a_dump_is_refused_or_changes_nothing() -> None:
    """A bit of each byte of a dump flipped, one byte at a time (5,382
    dumps): every one is refused but those where the bit changes nothing
    read (the checksums' block size, when every ring fits in one block)."""
    rec = sample_recording(4)
    data = fmt.encode(rec)
    block = data.index(b"\xa5block") + 6
    read: list[int] = []
    for at in range(len(data)):
        try:
            back = fmt.decode(_flip(data, at, at % 8), "n1")
        except DumpError:  # a version flipped upwards is a newer dump's
            continue
        assert_same(rec, back)
        read.append(at)
    assert len(data) > 5000 and set(read) <= set(range(block, block + 5))

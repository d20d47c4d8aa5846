"""The reader never crashes: mutated and truncated real dumps either read back
as a valid Recording or are refused with the reader's own errors."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stallwatch.dumpers import format as fmt
from stallwatch.dumpers.errors import DumpFormatError, DumpVersionError
from stallwatch.dumpers.model import Recording
from tests.dump_samples import assert_same, sample_recording

# msgpack type bytes that announce large or nested objects, and the reserved one
INTERESTING = [
    0x00,
    0x7F,
    0x80,
    0x8F,
    0x90,
    0x9F,
    0xC0,
    0xC1,
    0xC3,
    0xC4,
    0xC5,
    0xC6,
    0xCF,
    0xD3,
    0xD9,
    0xDB,
    0xDC,
    0xDD,
    0xDE,
    0xDF,
    0xFF,
]


LAB_DUMPS = Path(__file__).resolve().parents[1] / "data" / "lab-hang-2x2"


def _seed_dumps() -> list[bytes]:
    """Dumps the lab wrote (real rings, processes, communicators), and two
    synthetic ones whose structure dominates (mutations hit fields, not rows)."""
    small = sample_recording(8)
    bigger = sample_recording(300, host="n2", incident="inc-2")
    lab = [p.read_bytes() for p in sorted(LAB_DUMPS.glob("*.msgpack"))]
    return [fmt.encode(small), fmt.encode(bigger), *lab]


def test_the_lab_dumps_read_and_share_one_incident() -> None:
    recs = [fmt.read_dump(p) for p in sorted(LAB_DUMPS.glob("*.msgpack"))]
    assert [r.host for r in recs] == ["node0", "node1"]
    assert len({r.trigger.incident_id for r in recs if r.trigger}) == 1
    assert all(len(r.rings["nccl"].rows) > 50 for r in recs)


SEEDS = _seed_dumps()
Mutation = Callable[[random.Random, bytearray], None]


def _flip_bit(rng: random.Random, data: bytearray) -> None:
    i = rng.randrange(len(data))
    data[i] ^= 1 << rng.randrange(8)


def _replace_byte(rng: random.Random, data: bytearray) -> None:
    data[rng.randrange(len(data))] = rng.choice([*INTERESTING, rng.randrange(256)])


def _insert(rng: random.Random, data: bytearray) -> None:
    i = rng.randrange(len(data) + 1)
    data[i:i] = bytes(rng.choice(INTERESTING) for _ in range(rng.randint(1, 6)))


def _delete(rng: random.Random, data: bytearray) -> None:
    i = rng.randrange(len(data))
    del data[i : i + rng.randint(1, 8)]


def _truncate(rng: random.Random, data: bytearray) -> None:
    del data[rng.randrange(len(data)) :]


MUTATIONS: list[Mutation] = [_flip_bit, _replace_byte, _insert, _delete, _truncate]


def _check(data: bytes, name: str = "fuzz.msgpack") -> Recording | None:
    """Read ``data``: only the reader's own errors may escape; a dump that
    reads must write back to the same Recording."""
    try:
        rec = fmt.decode(data, name)
    except (DumpFormatError, DumpVersionError) as exc:
        assert str(exc).startswith(f"{name}: "), str(exc)
        return None
    assert_same(rec, fmt.decode(fmt.encode(rec), name))
    return rec


def test_thousands_of_mutations_and_truncations() -> None:
    rng = random.Random(20261122)
    outcomes = {"refused": 0, "read": 0}
    for i in range(3000):
        data = bytearray(SEEDS[i % len(SEEDS)])
        for _ in range(rng.choice((1, 1, 1, 2, 4))):
            if data:
                rng.choice(MUTATIONS)(rng, data)
        outcomes["read" if _check(bytes(data)) else "refused"] += 1
    # both outcomes must occur, or the fuzzer is not exercising the reader
    assert outcomes["refused"] > 600 and outcomes["read"] > 50, outcomes


def test_every_truncation_of_a_small_dump() -> None:
    data = SEEDS[0]
    for cut in range(len(data)):
        assert _check(data[:cut]) is None
    for data in SEEDS[2:]:  # the lab's dumps, cut every 29 bytes
        for cut in range(0, len(data), 29):
            assert _check(data[:cut]) is None


def test_mutated_files_on_disk(tmp_path: Path) -> None:
    """The file reader takes another path (ring data read around msgpack)."""
    rng = random.Random(7)
    path = tmp_path / "fuzz.msgpack"
    for _ in range(300):
        data = bytearray(SEEDS[1])
        rng.choice(MUTATIONS)(rng, data)
        path.write_bytes(data)
        try:
            from_file = fmt.read_dump(path)
        except (DumpFormatError, DumpVersionError) as exc:
            assert str(exc).startswith(f"{path}: ")
            assert _check(bytes(data), str(path)) is None
        else:
            back = _check(bytes(data), str(path))
            assert back is not None
            assert_same(from_file, back)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.sampled_from(range(len(SEEDS))),
    edits=st.lists(
        st.tuples(st.integers(0, 2**20), st.binary(max_size=9), st.integers(0, 9)),
        min_size=1,
        max_size=4,
    ),
)
def test_hypothesis_splices(seed: int, edits: list[tuple[int, bytes, int]]) -> None:
    data = bytearray(SEEDS[seed])
    for where, insert, remove in edits:
        i = where % (len(data) + 1)
        data[i : i + remove] = insert
    _check(bytes(data))

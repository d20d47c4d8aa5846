"""The NCCL windows of many dumps judged and staged at once
(``analyzer.callrows``), and staged by the processes that read the files
(``align.prestage``): the same table and the same per-dump findings as each
dump alone, whatever the batches, a damaged dump among them included.  Real
lab dumps (tests/data) and synthetic jobs."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import pytest

from bench.bench_sql import Synthetic, synthetic_recording
from stallwatch.analyzer import align
from stallwatch.analyzer.columns import Columns
from stallwatch.analyzer.load import load_one
from stallwatch.dumpers.errors import DumpError
from stallwatch.dumpers.format import read_dump
from stallwatch.dumpers.model import Recording
from stallwatch.dumpers.schema import Op

DATA = Path(__file__).resolve().parents[1] / "data"
SAID = ("rows", "complete", "latest", "scope", "pids", "row_members", "error", "waiting",
        "held", "entered")  # fmt: skip


def _dumps() -> list[align.Source]:
    out = []
    for path in sorted(DATA.rglob("*.msgpack")):
        try:
            out.append(align.Source(str(path), read_dump(path)))
        except DumpError:
            continue
    synthetic = [synthetic_recording(Synthetic(host=f"n{i}", first_rank=4 * i)) for i in range(3)]
    return out + [align.Source(f"synthetic/{r.host}", r) for r in synthetic]


def _damaged(sources: list[align.Source], seed: int) -> list[align.Source]:
    """Every other source with one field of one row changed (most of them
    break a rule: the dump is then lost, its neighbours not)."""
    rng = random.Random(seed)
    out = []
    for i, s in enumerate(sources):
        ring = s.recording.rings.get("nccl")
        if i % 2 or ring is None or not len(ring.rows):
            out.append(s)
            continue
        rows = ring.rows.copy()
        row = rng.randrange(len(rows))
        name = rng.choice(["op", "seq", "rank", "ts_ns", "comm_hash", "tid", "completed_ns"])
        rows[name][row] = rng.choice([0, 1, 7, 200])
        rings = {**s.recording.rings, "nccl": dataclasses.replace(ring, rows=rows)}
        out.append(dataclasses.replace(s, recording=dataclasses.replace(s.recording, rings=rings)))
    return out


def _staged(
    sources: list[align.Source], batch_rows: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[Columns, list[align._Extract]]:
    monkeypatch.setattr(align, "BATCH_ROWS", batch_rows)
    monkeypatch.setenv("STALLWATCH_THREADS", "1")
    copies = [dataclasses.replace(s, recording=_fresh(s.recording)) for s in sources]
    return align._extract_all(copies, False)


def _fresh(rec: Recording) -> Recording:
    return dataclasses.replace(rec, rings=dict(rec.rings))


def _same(a: tuple[Columns, list[align._Extract]], b: tuple[Columns, list[align._Extract]]) -> None:
    (table_a, said_a), (table_b, said_b) = a, b
    # "comm" is filled later (its communicator's index), not by this stage
    for name in (n for n in table_a if n != "comm"):
        assert np.array_equal(table_a[name], table_b[name]), name
    assert len(said_a) == len(said_b)
    for x, y in zip(said_a, said_b, strict=True):
        for name in SAID:
            u, v = getattr(x, name), getattr(y, name)
            if isinstance(u, np.ndarray) or isinstance(v, np.ndarray):
                assert u is not None and v is not None and np.array_equal(u, v), name
                assert u.dtype == v.dtype, name
            else:
                assert u == v, (x.source.path, name)


@pytest.mark.parametrize("seed", [None, 1, 2])
def test_a_batch_stages_what_each_dump_stages_alone(
    seed: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    sources = _dumps() if seed is None else _damaged(_dumps(), seed)
    alone = _staged(sources, 1, monkeypatch)  # a batch per dump
    together = _staged(sources, 1 << 20, monkeypatch)  # every dump in one batch
    _same(alone, together)
    if seed is not None:
        lost = [e for e in together[1] if e.error]
        assert lost and all("damaged" in (e.error or "") for e in lost)
        assert all(not e.error for e in together[1][1::2])  # the untouched neighbours


def test_dumps_without_calls_in_their_windows_stage_nothing_and_lose_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Dumps whose NCCL rings are empty (agents started after a job hung
    before its first call): a batch of them alone, and beside dumps with
    calls, stages what each dump stages alone."""
    sources = _dumps()
    empty = []
    for s in sources[:3]:
        ring = s.recording.rings["nccl"]
        rings = {**s.recording.rings, "nccl": dataclasses.replace(ring, rows=ring.rows[:0])}
        rec = dataclasses.replace(s.recording, rings=rings)
        empty.append(dataclasses.replace(s, recording=rec))
    table, said = _staged(empty, 1 << 20, monkeypatch)
    assert len(table["ts"]) == 0 and len(said) == 3
    assert not any(e.error for e in said) and all(e.rows.stop == e.rows.start for e in said)
    mixed = [*empty, *sources[3:]]
    _same(_staged(mixed, 1, monkeypatch), _staged(mixed, 1 << 20, monkeypatch))


def test_a_damaged_dump_says_which_rule_it_broke_in_a_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sources = _dumps()[:4]
    s = sources[1]
    ring = s.recording.rings["nccl"]
    rows = ring.rows.copy()
    rows["op"][np.flatnonzero(rows["op"] == Op.ALL_REDUCE)[0]] = 0x41
    rec = dataclasses.replace(
        s.recording, rings={**s.recording.rings, "nccl": dataclasses.replace(ring, rows=rows)}
    )
    sources[1] = dataclasses.replace(s, recording=rec)
    _, said = _staged(sources, 1 << 20, monkeypatch)
    assert [bool(e.error) for e in said] == [False, True, False, False]
    assert "an op no probe writes" in (said[1].error or "")


def test_dumps_staged_where_they_were_read_join_into_the_same_table(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    paths = sorted(str(p) for p in DATA.rglob("*.msgpack"))
    loaded = [load_one(p, ("nccl",))[0] for p in paths]
    sources = [s for s in loaded if isinstance(s, align.Source)]
    assert len(sources) > 10
    read_here = _staged(sources, align.BATCH_ROWS, monkeypatch)
    staged = align.prestage(sources[:7]) + align.prestage(sources[7:])  # two workers' chunks
    joined = align._extract_all(staged, False)
    _same(read_here, joined)
    assert all(e.source.staged is None for e in joined[1])  # the workers' tables let go


def test_calls_without_a_hash_take_their_pointer_s_from_the_table(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The synthetic agents' rows carry no comm hash (as a late agent's):
    each takes its process's table entry for its pointer, the later of two
    entries of one pointer (freed and reused), 0 where the table has none."""
    sources = _dumps()[-3:]
    s = sources[1]
    comms = list(s.recording.communicators)
    reused = dataclasses.replace(comms[0], comm_hash=0x1234)
    rows = s.recording.rings["nccl"].rows.copy()
    stray = np.flatnonzero(rows["comm_hash"] == 0)[:3]
    rows["comm"][stray] = 0xDEAD0000  # a pointer no table entry gives
    rec = dataclasses.replace(
        s.recording,
        communicators=(*comms, reused),
        rings={
            **s.recording.rings,
            "nccl": dataclasses.replace(s.recording.rings["nccl"], rows=rows),
        },
    )
    sources[1] = dataclasses.replace(s, recording=rec)
    table, said = _staged(sources, 1 << 20, monkeypatch)
    mine = table["hash"][said[1].rows]
    staged = rows[rows["op"] == Op.ALL_REDUCE]  # the calls, in ring order
    unknown = staged["comm_hash"] == 0
    assert np.array_equal(mine == 0x1234, unknown & (staged["comm"] == comms[0].comm))
    assert np.array_equal(mine == 0, unknown & (staged["comm"] == 0xDEAD0000))
    assert (mine == 0x1234).sum() > 50
    assert _staged(sources, 1, monkeypatch)[0]["hash"].tolist() == table["hash"].tolist()

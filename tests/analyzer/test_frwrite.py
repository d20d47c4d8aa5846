"""Flight Recorder files written as torch writes them: every real dump we
hold (torch 2.13's gloo corpus, dumps with stack frames, NVIDIA's 2.9 NCCL
dumps) unpickled and written again gives back torch's bytes."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from stallwatch.analyzer.frwrite import dumps, dumps_json

DATA = Path(__file__).resolve().parents[1] / "data"


def _real_pickles(fixtures_dir: Path) -> list[Path]:
    return (
        sorted((DATA / "fr-torch").glob("*/pickle/nccl_trace_rank_*"))
        + sorted((DATA / "fr-stacks").glob("*/nccl_trace_rank_*"))
        + sorted((fixtures_dir / "pytorch-fr-nccl-16rank").glob("*/_dump_*"))
    )


def test_torch_s_bytes_again(fixtures_dir: Path) -> None:
    paths = _real_pickles(fixtures_dir)
    assert len(paths) > 400
    for p in paths:
        raw = p.read_bytes()
        assert dumps(pickle.loads(raw)) == raw, p


def test_torch_s_json_again() -> None:
    paths = sorted((DATA / "fr-torch").glob("*/json/nccl_trace_rank_*.json"))
    assert len(paths) > 300
    for p in paths:
        raw = p.read_bytes()
        assert dumps_json(json.loads(raw)) == raw, p


def test_frames_are_written_once_and_fetched_after() -> None:
    """torch memoizes a value held more than once: each distinct frame is
    written the first time and fetched from the memo after (the stacks of the
    fixture share their frames, a dump holds each frame once)."""
    p = sorted((DATA / "fr-stacks").glob("*/nccl_trace_rank_0"))[0]
    doc = pickle.loads(p.read_bytes())
    frames = [f for e in doc["entries"] for f in e["frames"]]
    assert len({id(f) for f in frames}) < len(frames)  # shared, as unpickled
    copy = pickle.loads(dumps(doc))
    assert copy == doc
    again = [f for e in copy["entries"] for f in e["frames"]]
    assert len({id(f) for f in again}) == len({id(f) for f in frames})


def test_python_pickle_differs_from_torch_s() -> None:
    """Why a writer of our own: Python's pickler memoizes every container
    before its items, torch only shared ones after them."""
    p = sorted((DATA / "fr-stacks").glob("*/nccl_trace_rank_0"))[0]
    doc = pickle.loads(p.read_bytes())
    assert pickle.dumps(doc, protocol=2) != p.read_bytes() == dumps(doc)


def test_long_memo_ids_and_wide_integers() -> None:
    """Past 255 memoized values torch writes LONG_BINPUT/LONG_BINGET; integers
    take the smallest opcode that holds them, 8-byte LONG1 beyond 32 bits."""
    doc = {
        "version": "2.10",
        "entries": [{f"key{i}": i for i in range(300)}],
        "ints": [0, 255, 256, 65535, 65536, -1, -(1 << 31), 1 << 40, -(1 << 40)],
        "names": [f"s{i}" for i in range(300)] + ["s299"],
        "flags": [True, False, None, 1.5],
    }
    raw = dumps(doc)
    assert pickle.loads(raw) == doc
    assert b"r" + (299).to_bytes(4, "little") in raw  # LONG_BINPUT of a late string
    assert b"\x8a\x08" + (1 << 40).to_bytes(8, "little", signed=True) in raw


def test_json_form() -> None:
    doc = {"version": "2.10", "entries": [{"x": None, "process_group": ("0", "default_pg")}]}
    assert dumps_json(doc) == (
        b'{"entries":[{"process_group":["0","default_pg"],"x":null}],"version":"2.10"}'
    )


def test_what_a_flight_recorder_file_cannot_hold_is_refused() -> None:
    with pytest.raises(TypeError, match="holds no set"):
        dumps({"version": "2.10", "entries": {1, 2}})

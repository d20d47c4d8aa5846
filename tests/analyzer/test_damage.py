"""Damaged evidence never names a culprit: recorded incidents damaged at
random, seed after seed, then analyzed as ``stallwatch analyze`` does.

The incidents: the lab's 2x2 hang (rank 3), its GPU hang (rank 3's device
stops), its 4x2 GPU straggler (rank 6), written as today's agent writes them
(format version 6, with checksums); real torch Flight Recorder files of hung
jobs (pickle and JSON; hung before the dumps, and dumped in turn).  The
damage, to one file (sometimes two): bits flipped (one, or twenty), the file
cut short, two spans of bytes swapped (fields moved).  Every damaged incident
must end without a traceback, with exit code 0, 1 or 2, and no verdict may
blame a rank (any kind but inconclusive and healthy) other than the one the
fault was injected into; a hung job is never called healthy.

Dumps written before checksums (format versions 1 to 5) are not among them:
damage that yields values a recorder can write (one op turned into another)
is found by checksums alone (analyzer.plausible says what is found without).
"""

from __future__ import annotations

import contextlib
import io
import json
import random
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from stallwatch.commands.main import main
from stallwatch.dumpers import format as fmt

DATA = Path(__file__).resolve().parents[1] / "data"
PER_INCIDENT = 65  # damaged copies of each incident below: 8 x 65 = 520


@dataclass(frozen=True)
class Incident:
    name: str
    files: tuple[tuple[str, bytes], ...]
    culprits: set[int]  # the ranks the fault was injected into
    hung: bool


def _ours(folder: str) -> tuple[tuple[str, bytes], ...]:
    """A recorded lab incident as today's agent writes it (format 6)."""
    paths = sorted((DATA / folder).glob("*.msgpack"))
    return tuple((p.name, fmt.encode(fmt.read_dump(p))) for p in paths)


def _fr(run: str, form: str) -> tuple[tuple[str, bytes], ...]:
    folder = DATA / "fr-torch" / run / form
    return tuple((p.name, p.read_bytes()) for p in sorted(folder.iterdir()))


@cache
def incidents() -> tuple[Incident, ...]:
    return (
        Incident("lab hang", _ours("lab-hang-2x2"), {3}, True),
        Incident("lab gpu hang", _ours("damage/lab-gpuhang-2x2"), {3}, True),
        Incident("lab gpu straggler", _ours("lab-gpuslow-4x2"), {6}, False),
        Incident("fr hang, pickle", _fr("allreduce-hang-8", "pickle"), {4}, True),
        Incident("fr hang, json", _fr("allreduce-hang-4", "json"), {2}, True),
        Incident("fr in turn", _fr("inturn-hang-200ms-4", "json-pg"), {2}, True),
        Incident("fr hang while dumped", _fr("inturn-hangs-50ms-late-4", "pickle"), {2}, True),
        Incident("fr groups", _fr("groups-hang-4", "pickle"), {2}, True),
    )


def _flip(rng: random.Random, data: bytearray) -> str:
    n = rng.choice([1, 1, 3, 20])
    for _ in range(n):
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    return f"{n} bit(s) flipped"


def _cut(rng: random.Random, data: bytearray) -> str:
    at = rng.randrange(len(data))
    del data[at:]
    return f"cut at byte {at}"


def _swap(rng: random.Random, data: bytearray) -> str:
    width = rng.choice([1, 2, 4, 8])
    i, j = rng.randrange(len(data) - width), rng.randrange(len(data) - width)
    data[i : i + width], data[j : j + width] = data[j : j + width], data[i : i + width]
    return f"{width} bytes at {i} and {j} swapped"


def damaged(inc: Incident, seed: int) -> tuple[list[tuple[str, bytes]], str]:
    rng = random.Random(f"{inc.name}/{seed}")
    files = list(inc.files)
    done = []
    for k in rng.sample(range(len(files)), 2 if rng.random() < 0.2 else 1):
        name, data = files[k]
        copy = bytearray(data)
        done.append(f"{name}: {rng.choice([_flip, _flip, _cut, _swap])(rng, copy)}")
        files[k] = (name, bytes(copy))
    return files, "; ".join(done)


def analyze(folder: Path, *options: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["analyze", str(folder), *options])
    return code, out.getvalue(), err.getvalue()


def judge(inc: Incident, folder: Path, seed: int) -> tuple[list[str], bool]:
    """What is wrong with the analysis of one damaged incident ([]: nothing),
    and whether an input was refused (a line on stderr)."""
    code, out, err = analyze(folder, "--json")
    if code not in (0, 1, 2):
        return [f"exit code {code}"], bool(err)
    if code == 2:  # nothing could be read: a line on stderr, no document
        return [] if err.strip() else ["exit code 2 without a line on stderr"], True
    doc = json.loads(out)
    verdicts = [v for i in doc["incidents"] for v in i["verdicts"]]
    blamed = {
        r for v in verdicts if v["kind"] not in ("inconclusive", "healthy") for r in v["ranks"]
    }
    wrong = []
    if blamed - inc.culprits:
        summaries = [f"{v['kind']} {v['ranks']}: {v['summary']}" for v in verdicts]
        wrong.append(f"blames {sorted(blamed - inc.culprits)}: {summaries}")
    if inc.hung and any(v["kind"] == "healthy" for v in verdicts):
        wrong.append("a hung job called healthy")
    if seed % 8 == 0:  # the report for people too: it must render whatever was read
        analyze(folder)
    return wrong, bool(err.strip())


@pytest.mark.parametrize("which", range(8), ids=lambda i: incidents()[i].name)
def test_damaged_incidents_never_blame_another_rank(which: int, tmp_path: Path) -> None:
    inc = incidents()[which]
    failures = []
    refused = 0
    for seed in range(PER_INCIDENT):
        files, how = damaged(inc, seed)
        folder = tmp_path / f"seed{seed}"
        folder.mkdir()
        for name, data in files:
            (folder / name).write_bytes(data)
        wrong, noted = judge(inc, folder, seed)
        failures += [f"seed {seed} ({how}): {w}" for w in wrong]
        refused += noted
    assert failures == [], "\n".join(failures[:10])
    # the damage reached the analysis: inputs were refused, with a line
    assert refused >= PER_INCIDENT // 4, refused


def test_the_incidents_undamaged_name_their_culprit(tmp_path: Path) -> None:
    for inc in incidents():
        folder = tmp_path / inc.name.replace(" ", "-").replace(",", "")
        folder.mkdir()
        for name, data in inc.files:
            (folder / name).write_bytes(data)
        code, out, err = analyze(folder, "--json")
        assert err == "", (inc.name, err)
        doc = json.loads(out)
        (first,) = [i["verdicts"][0] for i in doc["incidents"]]
        # named alone, or among the candidates of an inconclusive (the hang
        # while dumped: the ranks dumped before it may have stopped too)
        assert code == 1 and set(inc.culprits) <= set(first["ranks"]), (inc.name, first)
        assert first["kind"] == "inconclusive" or set(first["ranks"]) == set(inc.culprits)

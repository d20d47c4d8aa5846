"""A lost dump never moves the blame onto a healthy host: every incident
the lab recorded and this repository keeps, each node's dump removed in
turn, and cut short at several points (a cut dump is refused, named, and
counts as lost), analyzed as ``stallwatch analyze --json`` does.

The verdict must name the true culprit, a subset of it, or be
``inconclusive``: never a rank on a host whose dump is present and that
holds no culprit, and never ``healthy`` (every incident here departs from
consensus: a hang, a crash, a desync, a straggler, a lossy or cut link).

The incidents: every ``tests/data/lab-*`` and ``net-*`` one, the GPU hang of
``tests/data/damage``, and ``tests/data/shapes``: a hang in every shape the
lab runs that the others do not cover (host threads spinning, asynchronous
NCCL, GPU streams, CUDA graphs) and the demo's own 4x2 job.  Every lab job
sends point to point between pipeline stages on its split data-parallel
communicators: the traffic whose ranks a lost dump used to shift.

``CULPRITS`` says, for each, the ranks the fault was injected into (or,
for a link, the ranks of the host whose link it was) and their hosts.

And with a dump left out, every surface reads the same ranks: what
``analyze --json`` shows of each member (its rank, the communicator's size,
null where unknown) is what the SQL tables, the Parquet export and the
fan-out to agents serving the dumps say (``dumpers.ranks``, one derivation).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pytest

from stallwatch.analyzer.parquet import export_parquet
from stallwatch.analyzer.pipeline import analyze_paths
from stallwatch.analyzer.report import to_json
from stallwatch.commands.main import main
from stallwatch.dumpers.format import read_dump
from stallwatch.query.fanout import close_connections, query_agents
from stallwatch.query.http import RecordingsBackend, serve_http
from tests.query.agreement import sql_rows

DATA = Path(__file__).resolve().parents[1] / "data"
CUTS = (0.25, 0.5, 0.75)  # where each dump is cut, as a share of its bytes


@dataclass(frozen=True, slots=True)
class Truth:
    ranks: frozenset[int]  # the culprits
    hosts: frozenset[str]  # where they run


def _truth(ranks: set[int], hosts: set[str]) -> Truth:
    return Truth(frozenset(ranks), frozenset(hosts))


CULPRITS = {
    # both ranks whose CPU the hog took are starved alike (its README)
    "lab-cpuhog-2x2": _truth({0, 2}, {"node0", "node1"}),
    # rank 3 hangs as node 0's agent is killed and restarted (its README)
    "lab-agent-restart-2x2": _truth({3}, {"node1"}),
    "lab-crash-2x2": _truth({2}, {"node1"}),
    "lab-crash-4x2": _truth({5}, {"node2"}),
    # the same faults at step 80, the rings wrapped past their start
    "lab-crash-2x2-wrapped": _truth({2}, {"node1"}),
    "lab-crash-4x2-wrapped": _truth({5}, {"node2"}),
    "lab-desync-2x2-wrapped": _truth({1}, {"node0"}),
    "lab-desync-4x2-wrapped": _truth({6}, {"node3"}),
    "lab-hang-2x2-wrapped": _truth({3}, {"node1"}),
    "lab-hang-4x2-wrapped": _truth({5}, {"node2"}),
    "lab-desync-2x2": _truth({1}, {"node0"}),
    "lab-desync-4x2": _truth({6}, {"node3"}),
    "lab-gpuslow-4x2": _truth({6}, {"node3"}),
    "lab-hang-2x2": _truth({3}, {"node1"}),
    "lab-hang-4x2": _truth({5}, {"node2"}),
    # node0 (10.201.45.1) cut off: its ranks are the truth, its dump is not
    # among these (its peers name it by its address)
    "lab-partition-apart-4x2": _truth({0, 1}, {"node0", "10.201.45.1"}),
    # the same run: node0's own dump of its own incident, alone
    "lab-partition-alone-4x2": _truth({0, 1}, {"node0"}),
    "net-flap-4x1": _truth({2}, {"node2"}),
    "net-loss-3x2": _truth({2, 3}, {"node1"}),
    "net-loss-4x1": _truth({2}, {"node2"}),
    # the lossy link between the two nodes (both ends lose alike), a hog
    # beside rank 3: the pair is named (its README)
    "net-loss-stall-2x2": _truth({0, 1, 2, 3}, {"node0", "node1"}),
    "net-partition-4x1": _truth({2}, {"node2"}),
    "damage/lab-gpuhang-2x2": _truth({3}, {"node1"}),
    "shapes/hang-spin-3x2": _truth({3}, {"node1"}),
    "shapes/hang-async-3x2": _truth({3}, {"node1"}),
    "shapes/hang-gpu-3x2": _truth({3}, {"node1"}),
    "shapes/hang-graphs-3x2": _truth({3}, {"node1"}),
    "shapes/hang-demo-4x2": _truth({3}, {"node1"}),
}


def kept() -> list[str]:
    """Every recorded lab incident of tests/data (a new one must say its
    culprits above: this list fails the test until it does)."""
    found = [p.name for p in DATA.glob("lab-*")] + [p.name for p in DATA.glob("net-*")]
    found += [f"damage/{p.name}" for p in DATA.glob("damage/lab-*")]
    found += [f"shapes/{p.name}" for p in DATA.glob("shapes/*") if p.is_dir()]
    return sorted(found)


def test_every_kept_incident_is_judged_here() -> None:
    assert kept() == sorted(CULPRITS)


def host_of(path: Path) -> str:
    """The node a lab dump came from: its name's first part."""
    return path.name.split("-")[0].split(".")[0]


def damaged(name: str, root: Path) -> Iterator[tuple[str, Path, str | None]]:
    """(what was done, the folder analyzed, the file cut if one was): each
    node's dump removed, then cut at each of ``CUTS``."""
    files = sorted((DATA / name).glob("*.msgpack"))
    for f in files:  # (a lone dump removed leaves nothing to analyze)
        for how in ("removed", *CUTS) if len(files) > 1 else CUTS:
            folder = root / f"{host_of(f)}-{how}"
            folder.mkdir()
            for g in files:
                if g != f:
                    shutil.copy(g, folder / g.name)
                elif how != "removed":
                    data = g.read_bytes()
                    (folder / g.name).write_bytes(data[: int(len(data) * float(how))])
            label = "removed" if how == "removed" else f"cut at {how:.0%}"
            yield f"{host_of(f)}'s dump {label}", folder, None if how == "removed" else f.name


def analyze(folder: Path, cut: str | None) -> dict[str, object]:
    """``analyze --json`` on the folder; ``cut``: the file cut short, which
    must be named on stderr and among the inputs lost."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["analyze", str(folder), "--json"])
    lone = cut is not None and len(list(folder.iterdir())) == 1  # its only input lost
    # a finding, or an input lost: never clean; nothing readable at all: an error
    assert code == (2 if lone else 1), (code, err.getvalue())
    doc: dict[str, object] = json.loads(out.getvalue())
    assert not lone or doc["incidents"] == [], doc
    if cut is not None:
        assert cut in err.getvalue(), err.getvalue()
        inputs = doc["inputs"]
        assert isinstance(inputs, list)
        assert [i["ok"] for i in inputs if i["path"].endswith(cut)] == [False]
    return doc


def judge(truth: Truth, doc: dict[str, object]) -> list[str]:
    """What is wrong with one analysis ([]: nothing)."""
    wrong = []
    incidents = doc["incidents"]
    assert isinstance(incidents, list)
    for inc in incidents:
        for v in inc["verdicts"]:
            kind = v["kind"]
            if kind == "healthy":
                wrong.append(f"healthy: {v['summary']}")
            if kind in ("healthy", "inconclusive"):
                continue
            ranks = {r for r in v["ranks"] if r is not None}
            hosts = set(v["hosts"]) | {c["host"] for c in v["culprits"] if c["host"]}
            if ranks - truth.ranks or hosts - truth.hosts:
                wrong.append(f"{kind} ranks {sorted(ranks)} hosts {sorted(hosts)}: {v['summary']}")
    return wrong


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CULPRITS))
def test_a_lost_dump_blames_no_healthy_host(name: str, tmp_path: Path) -> None:
    truth = CULPRITS[name]
    failures = []
    for what, folder, cut in damaged(name, tmp_path):
        doc = analyze(folder, cut)
        failures += [f"{what}: {w}" for w in judge(truth, doc)]
    assert failures == [], "\n".join(failures)


def _analyze_ranks(folder: Path) -> dict[tuple[str, int, str], tuple[int | None, int | None]]:
    """(host, pid, communicator) -> (its rank there, the size) as
    ``analyze --json`` says them."""
    doc = json.loads(to_json(analyze_paths([str(folder)])))
    out = {}
    for inc in doc["incidents"]:
        for c in inc["communicators"]:
            for m in c["members"]:
                if m["host"] is not None:
                    out[(m["host"], m["pid"], c["comm_id_hash"])] = (m["rank"], c["nranks"])
    return out


SQL_RANKS = "SELECT host, pid, comm_id_hash, rank, nranks FROM communicators"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["shapes/hang-demo-4x2", "lab-hang-4x2", "net-flap-4x1"])
def test_a_lost_dump_leaves_every_surface_one_answer(name: str, tmp_path: Path) -> None:
    """Each node's dump left out: the ranks and sizes analyze shows are
    those of the SQL tables over the same dumps, of the Parquet export read
    by DuckDB, and of the fan-out over the dumps served one agent each."""
    files = sorted((DATA / name).glob("*.msgpack"))
    for lost in files:
        folder = tmp_path / host_of(lost)
        folder.mkdir()
        for f in files:
            if f != lost:
                shutil.copy(f, folder / f.name)
        shown = _analyze_ranks(folder)
        rows = sql_rows(folder, SQL_RANKS)
        sql = {(h, p, c): (r, n) for h, p, c, r, n in rows}
        assert {k: v for k, v in sql.items() if k in shown} == shown, lost.name
        assert any(r is None for r, _ in shown.values()), "a split's ranks are left unknown"
        export_parquet([str(folder)], tmp_path / f"pq-{host_of(lost)}")
        table = f"read_parquet('{tmp_path / f'pq-{host_of(lost)}'}/communicators/**/*.parquet')"
        got = duckdb.sql(SQL_RANKS.replace("communicators", table)).fetchall()
        assert sorted(got, key=str) == sorted(rows, key=str), lost.name
        handles = [
            serve_http(RecordingsBackend([read_dump(f)]), "127.0.0.1:0", None)
            for f in sorted(folder.glob("*.msgpack"))
        ]
        try:
            fanned = query_agents([h.address for h in handles], SQL_RANKS, timeout=120.0)
        finally:
            close_connections()
            for h in handles:
                h.close()
        assert not fanned.failed and sorted(map(tuple, fanned.rows), key=str) == sorted(
            rows, key=str
        ), lost.name

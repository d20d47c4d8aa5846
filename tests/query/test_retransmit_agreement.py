"""The SQL tables' one clock, and the per-host retransmit query that gives the
analyzer's numbers.

On every real network incident recorded by the lab (tests/data/net-*: a lossy
node, one whose ranks' rings hold more calls than the analyzer reads of them, a
node cut off for good, a node cut off for 4 s, a lossy pair that stood still),
the shipped per-host query
(``dumpers.sqltables.RETRANSMITS_BY_HOST_QUERY``, ``stallwatch query --example
retransmits-by-host``) returns per host exactly what the analyzer's network
verdicts print and judge on (``analyzer.detect.network.network_metrics``, which
runs that query: ``query.retransmits``): retransmits sent and received inside
collective windows, sent in all, completed collectives.  With two hosts'
monotonic clocks moved by hours (as on hosts that booted at different
times, tests/clockshift.py), no verdict, no count of
that query, of the seed query or of the headline changes; the seed query read
on the hosts' own clocks (``host_timestamp_ns``) does, which is what it did
before the tables had one clock.  The same queries fanned out to agents
serving the dumps answer what they answer locally.

The lab test records a partition (every packet of one node dropped from a
step on, the agents dump at the stall) and checks the agreement on it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from stallwatch.analyzer.incident import WINDOW_CALLS
from stallwatch.analyzer.pipeline import analyze_paths
from stallwatch.dumpers.format import read_dump
from stallwatch.dumpers.sqltables import HEADLINE_QUERY, RETRANSMITS_BY_HOST_QUERY, SEED_QUERY
from stallwatch.query.fanout import close_connections, query_agents
from stallwatch.query.http import RecordingsBackend, serve_http
from tests.clockshift import shifted_copy
from tests.conftest import ROOT
from tests.query.agreement import assert_agree, sql_counts, sql_rows

DATA = ROOT / "tests" / "data"
# every network incident the lab recorded and this repository keeps
FIXTURES = tuple(sorted(p.name for p in DATA.glob("net-*") if p.is_dir()))
HOUR = 3600 * 10**9
SHIFTS = {"node1": 5 * HOUR, "node2": 29 * HOUR}  # booted 5 and 29 hours after node0


def test_every_kept_network_incident_is_compared() -> None:
    kept = {"net-loss-4x1", "net-loss-3x2", "net-loss-stall-2x2", "net-partition-4x1"}
    assert set(FIXTURES) >= kept | {"net-flap-4x1"}


@pytest.mark.parametrize("name", FIXTURES)
def test_per_host_retransmits_in_sql_are_the_analyzers(name: str) -> None:
    got = assert_agree(DATA / name)
    nodes = {p.name.split("-")[0] for p in (DATA / name).glob("*.msgpack")}
    assert set(got) == nodes and len(nodes) >= 2
    assert all(calls > 0 for *_, calls in got.values())


PRINTED = re.compile(
    r"host (\S+): (\d+) retransmits sent and (\d+) received inside collective windows "
    r"\((\d+) sent in all\)"
)


@pytest.mark.parametrize("name", ["net-loss-4x1", "net-loss-3x2"])
def test_the_report_prints_the_querys_counts(name: str) -> None:
    """What a person reads in the network verdict is the query's answer,
    also where the rings hold more calls than the analyzer reads of each
    rank (net-loss-3x2: 400 calls a host)."""
    result = analyze_paths([str(DATA / name)])
    lines = [e for r in result.incidents for v in r.verdicts for e in v.evidence]
    printed = {
        m[1]: (int(m[2]), int(m[3]), int(m[4])) for e in lines if (m := PRINTED.fullmatch(e))
    }
    sql = sql_counts(DATA / name)
    assert printed and printed == {h: (a, b, c) for h, (a, b, c, _) in sql.items()}
    if name == "net-loss-3x2":  # more than the calls a rank the analyzer reads
        for path in (DATA / name).glob("*.msgpack"):
            rows = read_dump(path).rings["nccl"].rows
            assert min(np.unique(rows["pid"], return_counts=True)[1]) > WINDOW_CALLS, path


def test_inside_windows_counts_the_retransmits_of_the_cut_and_the_loss() -> None:
    """The windows matter: most of a lossy node's and of a flap's
    retransmits fall inside completed collectives; a cut for good leaves
    most outside (the collective in flight never completed)."""
    for name, most_inside in (("net-loss-4x1", True), ("net-flap-4x1", True)):
        counts = sql_counts(DATA / name)
        inside = sum(c[0] for c in counts.values())
        assert (inside * 2 > sum(c[2] for c in counts.values())) is most_inside, name
    counts = sql_counts(DATA / "net-partition-4x1")
    assert sum(c[0] for c in counts.values()) * 2 < sum(c[2] for c in counts.values())


@pytest.fixture(scope="module")
def shifted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("shifted")
    out = {}
    for name in FIXTURES:
        shifted_copy(DATA / name, root / name, SHIFTS)
        out[name] = root / name
    return out


def _verdicts(folder: Path) -> list[tuple[object, ...]]:
    result = analyze_paths([str(folder)])
    return [
        (v.kind, v.ranks, v.hosts, v.pids, v.comm_id_hash, v.seq, v.summary, v.evidence)
        for r in result.incidents
        for v in r.verdicts
    ]


@pytest.mark.parametrize("name", FIXTURES)
def test_hosts_clocks_hours_apart_change_no_verdict_and_no_count(
    name: str, shifted: dict[str, Path]
) -> None:
    here, there = DATA / name, shifted[name]
    assert _verdicts(there) == _verdicts(here)
    assert assert_agree(there) == sql_counts(here)
    for sql in (SEED_QUERY, HEADLINE_QUERY):
        assert sql_rows(there, sql) == sql_rows(here, sql)
    times = "SELECT host, min(timestamp_ns), min(host_timestamp_ns) FROM nccl_events GROUP BY 1"
    before = {h: (t, m) for h, t, m in sql_rows(here, times)}
    after = {h: (t, m) for h, t, m in sql_rows(there, times)}
    for host, (t, m) in after.items():
        assert t == before[host][0]  # the incident's clock: unmoved
        assert m - before[host][1] == SHIFTS.get(host, 0)  # the host's own: moved


def test_the_seed_query_on_host_clocks_is_what_the_shift_breaks(shifted: dict[str, Path]) -> None:
    """What the seed query meant before the one clock: each host's monotonic
    stamps joined across hosts.  On hosts whose clocks are hours apart, its
    windows catch other hosts' retransmits of other moments, or none."""
    on_host_clocks = SEED_QUERY.replace("timestamp_ns", "host_timestamp_ns")
    name = "net-loss-4x1"
    assert sql_rows(shifted[name], on_host_clocks) != sql_rows(DATA / name, on_host_clocks)
    assert sql_rows(DATA / name, on_host_clocks) == sql_rows(DATA / name, SEED_QUERY)


def test_the_headline_counts_a_lossy_ranks_own_retransmits() -> None:
    """node2 lost 8% of its packets: its slow AllReduces hold retransmits its
    own connections sent, and retransmits its peers sent towards it."""
    rows = sql_rows(DATA / "net-loss-4x1", HEADLINE_QUERY)
    assert rows and all(r[3] > 50 for r in rows)
    node2 = [r for r in rows if r[0] == "node2"]
    assert sum(r[4] for r in node2) > 0 and sum(r[5] for r in node2) > 0
    assert sum(r[4] + r[5] for r in node2) > sum(r[4] + r[5] for r in rows if r[0] == "node3")


def test_docs_show_the_queries_as_shipped_and_the_headline_as_it_answers() -> None:
    text = (ROOT / "docs" / "sql.md").read_text()
    for sql in (SEED_QUERY, HEADLINE_QUERY, RETRANSMITS_BY_HOST_QUERY):
        assert f"```sql\n{sql}\n```" in text
    shown = text[text.index("tests/data/net-loss-4x1: node2") :].split("```")[1]
    printed = [line.split() for line in shown.strip().splitlines()[2:]]
    rows = sql_rows(DATA / "net-loss-4x1", HEADLINE_QUERY)[: len(printed)]
    assert printed == [
        [h, str(w), str(q), f"{ms:.6g}", str(s), str(r)] for h, w, q, ms, s, r in rows
    ]


@pytest.fixture
def agents() -> Iterator[list[str]]:
    """Each node of the loss incident served as a live agent would be (its
    tables built from its recording, converted with its own clock pair)."""
    folder = DATA / "net-loss-4x1"
    handles = [
        serve_http(RecordingsBackend([read_dump(p)]), "127.0.0.1:0", None)
        for p in sorted(folder.glob("*.msgpack"))
    ]
    try:
        yield [h.address for h in handles]
    finally:
        close_connections()
        for h in handles:
            h.close()


@pytest.mark.parametrize("sql", [RETRANSMITS_BY_HOST_QUERY, HEADLINE_QUERY, SEED_QUERY])
def test_fanned_out_the_queries_answer_what_the_dumps_do(agents: list[str], sql: str) -> None:
    result = query_agents(agents, sql, timeout=30.0)
    assert not result.failed, result.failed
    local = sql_rows(DATA / "net-loss-4x1", sql)
    assert local and [tuple(r) for r in result.rows] == local


# ---- the lab --------------------------------------------------------------


@pytest.mark.lab
@pytest.mark.slow
def test_partition_recorded_by_the_lab_agrees(tmp_path: Path) -> None:
    """Node 2 cut off for good at step 8: every agent dumps at the stall."""
    cmd = [sys.executable, "-m", "stallwatch", "lab", "run", "--nodes", "4"]
    cmd += ["--ranks-per-node", "1", "--steps", "30", "--fault", "partition:node=2,step=8"]
    cmd += ["--record", "--dump-dir", str(tmp_path), "--stall-timeout", "5", "--timeout", "120"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    dumps = sorted(tmp_path.rglob("*.msgpack"))
    assert len(dumps) == 4, f"one dump per node expected: {dumps}\n{done.stdout}{done.stderr}"
    counts = assert_agree(tmp_path)
    # the cut node's connections retransmitted: from it (when it had data
    # unacknowledged) or towards it (when it waited to receive, as under load)
    assert counts["node2"][1] + counts["node2"][2] > 0, counts

"""The link ring on the lab: a node's link goes down mid-run (``linkdown``: its
switch port set down, its eth0 loses carrier) and comes back; its agent's
dump holds the carrier-down and carrier-up rows, timed inside the outage,
with eth0 mapped to that node's ranks.  The same run's dumps hold every job
connection's tcp_info and eth0's counters each second (recorder.netsamples),
the outage in them.  One run, judged by several assertions (the dumps,
their SQL, the other node's quiet link)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stallwatch.dumpers.format import read_dump
from stallwatch.dumpers.layout import LinkEvent
from stallwatch.dumpers.model import Recording
from stallwatch.lab.runner import end_dumps
from stallwatch.query.sql import LOCAL, QueryEngine

pytestmark = [pytest.mark.bpf, pytest.mark.lab]
ROOT = Path(__file__).resolve().parents[2]
SPEC = "linkdown:node=1,step=15,ms=2000"


def _lab_run(folder: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "stallwatch", "lab", "run", "--json", "--nodes", "2",
           "--ranks-per-node", "2", "--steps", "160", "--record", "--dump-at-end",
           "--dump-dir", str(folder), "--stall-timeout", "20", "--timeout", "150",
           "--fault", SPEC]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    if not done.stdout.strip():
        pytest.fail(f"lab run printed nothing: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


@dataclass(frozen=True)
class LinkRun:
    result: dict[str, Any]
    recs: dict[int, Recording]
    start: int  # the outage, node 1's monotonic clock (the machine's)
    end: int
    pids: dict[int, set[int]]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> LinkRun:
    folder = tmp_path_factory.mktemp("linkdown")
    result = _lab_run(folder)
    fault = next(f for f in result["faults"] if f["spec"] == SPEC)
    assert fault["injected"], fault
    # the end of the run's (an incident the agents raised meanwhile is another one)
    dumps = {int(p.parent.name.removeprefix("node")): p for p in end_dumps(folder)}
    assert set(dumps) == {0, 1}, result["dumps"]
    recs = {n: read_dump(p) for n, p in dumps.items()}
    pids = {n: {r["pid"] for r in result["ranks"] if r["node"] == n} for n in (0, 1)}
    return LinkRun(result, recs, fault["injected_ns"], fault["ended_ns"], pids)


def _eth0_rows(rec: Recording) -> Any:
    (eth0,) = [li for li in rec.links if li.name == "eth0" and not li.gone_ns]
    rows = rec.rings["link"].rows
    return eth0, rows[rows["link"] == eth0.id]


def test_a_nodes_link_down_and_up_are_in_its_dump_with_its_ranks(run: LinkRun) -> None:
    recs, pids, start, end = run.recs, run.pids, run.start, run.end

    eth0, rows = _eth0_rows(recs[1])
    events = [LinkEvent(e) for e in rows["event"].tolist()]
    down = rows[[e is LinkEvent.CARRIER_DOWN for e in events]]
    up = rows[[e is LinkEvent.CARRIER_UP for e in events]]
    assert len(down) == 1 and len(up) == 1, events
    # read inside the outage: after the port was set down, before it came back
    assert start < down["ts_ns"][0] < end, (start, down["ts_ns"][0], end)
    assert down["carrier"][0] == 0 and down["carrier_down_count"][0] >= 1
    # back after the outage, its previous reading inside it
    assert up["ts_ns"][0] > end and start < up["after_ns"][0] < end
    assert up["carrier"][0] == 1
    assert up["carrier_changes"][0] == down["carrier_changes"][0] + 1
    assert rows["ts_ns"][0] < start  # its state before the incident is in the dump too
    assert set(eth0.pids) == pids[1] and eth0.addresses

    _, quiet = _eth0_rows(recs[0])  # the other node's link never went down
    assert not {LinkEvent(e) for e in quiet["event"].tolist()} & {
        LinkEvent.CARRIER_DOWN, LinkEvent.CARRIER_UP, LinkEvent.CARRIER_FLAP}  # fmt: skip

    with QueryEngine(list(recs.values()), LOCAL) as engine:
        got = engine.query(
            "SELECT e.host, e.event, l.world_ranks FROM link_events e JOIN links l "
            "ON l.host = e.host AND l.interface = e.interface "
            "WHERE e.event IN ('carrier_down', 'carrier_up') ORDER BY e.timestamp_ns"
        ).rows
    assert got == [
        (recs[1].host, "carrier_down", [2, 3]),
        (recs[1].host, "carrier_up", [2, 3]),
    ]


def test_every_job_connection_and_eth0_are_sampled_each_second_the_outage_in_them(
    run: LinkRun,
) -> None:
    """Each rank connection's tcp_info about every second, its owner known;
    the connections across the link that went down had data acknowledged by
    nothing during the outage (and backed off); eth0 of each node sampled beside them, its counters
    only growing; the tables say the same."""
    for n, rec in run.recs.items():
        rows = rec.rings["conn_samples"].rows
        assert len(rows) and set(rows["pid"].tolist()) == run.pids[n], (n, set(rows["pid"]))
        ends = {(bytes(r["saddr"]), int(r["sport"]), bytes(r["daddr"]), int(r["dport"]))
                for r in rows}  # fmt: skip
        last = int(rows["ts_ns"].max())
        lasting = 0  # the mesh's connections, open to the end (the bootstrap's come and go)
        for key in ends:
            mine = rows[(rows["sport"] == key[1]) & (rows["dport"] == key[3])]
            if len(mine) < 3:
                continue
            ts = mine["ts_ns"].astype(np.int64)
            gaps = np.diff(ts) / 1e9
            assert 0.8 < float(np.median(gaps)) < 1.5, (n, key, gaps)
            lasting += int(ts[-1]) == last
        assert lasting >= 2 * 3, (n, lasting)  # each rank: its 3 peers' connections at least
        eth0 = rec.rings["iface_samples"].rows
        eth0 = eth0[[bytes(x).rstrip(b"\0") == b"eth0" for x in eth0["name"]]]
        assert len(eth0) >= 5 and (np.diff(eth0["tx_bytes"].astype(np.int64)) >= 0).all()

    # the connections across the link, from either end (the end whose last
    # send came before the outage had it acknowledged: nothing outstanding)
    inside = []
    for n, other in ((1, 0), (0, 1)):
        theirs = {bytes(r["saddr"]) for r in run.recs[other].rings["conn_samples"].rows}
        rows = run.recs[n].rings["conn_samples"].rows
        across = rows[[bytes(a) in theirs for a in rows["daddr"]]]
        inside.append(across[(across["ts_ns"] > run.start + 1_000_000_000)
                             & (across["ts_ns"] < run.end)])  # fmt: skip
    assert all(len(x) for x in inside), "no sample of the connections across inside the outage"
    both = np.concatenate(inside)
    stalled = both[(both["unacked"] > 0) & (both["last_ack_recv_ms"] >= 1000)]
    assert len(stalled) and (stalled["backoff"] >= 1).any(), both[["unacked", "backoff"]]

    with QueryEngine(list(run.recs.values()), LOCAL) as engine:
        got = engine.query(
            "SELECT host, count(DISTINCT world_rank), count(*) FILTER (WHERE pid IS NULL), "
            "min(srtt_us) > 0 FROM conn_samples GROUP BY host ORDER BY host"
        ).rows
        eth = engine.query(
            "SELECT DISTINCT host, name, qdisc_kind FROM iface_samples ORDER BY host"
        ).rows
    assert got == [(run.recs[0].host, 2, 0, True), (run.recs[1].host, 2, 0, True)]
    assert eth == [(run.recs[0].host, "eth0", "noqueue"), (run.recs[1].host, "eth0", "noqueue")]

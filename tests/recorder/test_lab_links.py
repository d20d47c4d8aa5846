"""The link ring on the lab: a node's link goes down mid-run (``linkdown``: its
switch port set down, its eth0 loses carrier) and comes back; its agent's
dump holds the carrier-down and carrier-up rows, timed inside the outage,
with eth0 mapped to that node's ranks.  One run, judged by several
assertions (the dumps, their SQL, the other node's quiet link)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

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
           "--ranks-per-node", "2", "--steps", "40", "--record", "--dump-at-end",
           "--dump-dir", str(folder), "--stall-timeout", "20", "--timeout", "150",
           "--fault", SPEC]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    if not done.stdout.strip():
        pytest.fail(f"lab run printed nothing: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def _eth0_rows(rec: Recording) -> Any:
    (eth0,) = [li for li in rec.links if li.name == "eth0" and not li.gone_ns]
    rows = rec.rings["link"].rows
    return eth0, rows[rows["link"] == eth0.id]


def test_a_nodes_link_down_and_up_are_in_its_dump_with_its_ranks(tmp_path: Path) -> None:
    result = _lab_run(tmp_path)
    fault = next(f for f in result["faults"] if f["spec"] == SPEC)
    assert fault["injected"], fault
    start, end = fault["injected_ns"], fault["ended_ns"]
    # the end of the run's (an incident the agents raised meanwhile is another one)
    dumps = {int(p.parent.name.removeprefix("node")): p for p in end_dumps(tmp_path)}
    assert set(dumps) == {0, 1}, result["dumps"]
    recs = {n: read_dump(p) for n, p in dumps.items()}
    pids = {n: {r["pid"] for r in result["ranks"] if r["node"] == n} for n in (0, 1)}

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

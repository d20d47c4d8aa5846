"""Faults that begin while the job runs, on the real lab: each run is judged
from outside the job (the switch's counters, the node's link as the node
sees it, the kernels' TCP counters, the ranks' step times and errors) and by
what ``lab run --json`` says of each fault (when, at which step, what was
measured).  Few runs, several faults and assertions each."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

import pytest

from tests.lab.test_run import Run, assert_all_done, lab_run

MS = 1_000_000  # ns


def assert_done(run: Run, world: int, steps: int) -> None:
    """Every rank finished; if not, the failure says where each stopped."""
    where = [(r["world_rank"], r["steps_done"], r["step_ms"][-5:]) for r in run.result["ranks"]]
    assert run.result["gave_up"] is None, (run.result["gave_up"], where)
    assert_all_done(run, world, steps)


def fault(run: Run, spec: str) -> dict[str, Any]:
    faults: list[dict[str, Any]] = run.result["faults"]
    return next(f for f in faults if f["spec"] == spec)


def step_ms(run: Run, rank: int, steps: Iterable[int]) -> list[float]:
    return [run.rank(rank)["step_ms"][s] for s in steps]


def steps_from(run: Run, rank: int, at_ns: int, n: int = 3) -> list[float]:
    """The durations of the rank's first ``n`` steps not over by ``at_ns``
    (CLOCK_MONOTONIC, the fault's): the step an outage fell in, and the
    next ones (the step the injector saw is a moment older on a loaded
    machine)."""
    r = run.rank(rank)
    going = [ms for start, ms in zip(r["step_start_ns"], r["step_ms"], strict=True)
             if start + ms * MS >= at_ns]  # fmt: skip
    return going[:n]


def waited_ms(run: Run, rank: int, by: int, step: int) -> float:
    """How long ``rank``'s step took counted from the moment ``by``'s same step
    began: a bound on what rank waited for by, however late rank started."""
    mine, theirs = run.rank(rank), run.rank(by)
    return (mine["step_start_ns"][step] - theirs["step_start_ns"][step]) / MS + mine["step_ms"][
        step
    ]


@pytest.mark.lab
def test_a_partition_flap_and_a_link_down_and_up_and_the_job_finishes() -> None:
    """Two outages in one 3x1 run: node 2 partitioned for 1.5 s (a flap),
    then node 1's link down for 1.5 s; the job goes on after each and
    finishes.  The stall timeout is longer than a flap's retransmission
    backoff (about 3 s)."""
    flap, down = "partition:node=2,step=10,ms=1500", "linkdown:node=1,step=35,ms=1500"
    run = lab_run("--nodes", "3", "--ranks-per-node", "1", "--steps", "60", "--fault", flap,
                  "--fault", down, "--stall-timeout", "8", "--json", timeout=240)  # fmt: skip
    assert_done(run, world=3, steps=60)

    f = fault(run, flap)
    assert f["injected"] and 10 <= f["step"] <= 12, f
    assert 1500 * MS <= f["ended_ns"] - f["injected_ns"] < 2500 * MS
    assert f["measured"]["dropped_packets"] > 0  # the switch dropped the node's packets
    for rank in range(3):  # every rank waited the flap out in one of its steps
        assert max(steps_from(run, rank, f["injected_ns"])) >= 1400, rank

    d = fault(run, down)
    assert d["injected"] and 35 <= d["step"] <= 37
    assert 1500 * MS <= d["ended_ns"] - d["injected_ns"] < 2500 * MS
    before, during, after = (d["measured"][k] for k in ("link_before", "link_during", "link_after"))
    assert (before["carrier"], during["carrier"], after["carrier"]) == (1, 0, 1)
    assert (before["operstate"], during["operstate"], after["operstate"]) == ("up", "down", "up")
    assert during["carrier_changes"] == before["carrier_changes"] + 1
    assert after["carrier_changes"] == before["carrier_changes"] + 2
    for rank in range(3):
        assert max(steps_from(run, rank, d["injected_ns"])) >= 1400, rank


@pytest.mark.lab
@pytest.mark.solo  # judges at which step the job stood: timing, alone
def test_a_partition_for_good_stops_the_job_at_its_step() -> None:
    spec = "partition:node=1,step=10"
    run = lab_run("--nodes", "2", "--ranks-per-node", "1", "--steps", "500", "--fault", spec,
                  "--stall-timeout", "3", "--json")  # fmt: skip
    assert run.code == 1, run.err
    assert "no rank made progress for 3 s" in run.result["gave_up"]
    c = fault(run, spec)
    assert c["injected"] and 10 <= c["step"] <= 12 and c["ended_ns"] is None
    assert c["measured"]["dropped_packets"] > 0  # counted at the end of the run
    for r in run.result["ranks"]:  # no rank got past the step where the cut came
        # (the steps begun before it, by the fault's CLOCK_MONOTONIC: the step
        # the injector saw is a moment older on a loaded machine)
        begun = sum(1 for t in r["step_start_ns"] if t < c["injected_ns"])
        assert begun - 1 <= r["steps_done"] <= begun + 1, (begun, r["steps_done"])
        assert r["killed_by_lab"] and r["status"] == "stuck"


@pytest.mark.lab
@pytest.mark.solo  # judges at which step the job stood: timing, alone
def test_reset_ends_every_ranks_collective_with_an_error() -> None:
    """rst: node 1's connections aborted (ss -K); its peers receive RSTs.
    No rank hangs: every one's NCCL call returns ncclRemoteError, as real
    NCCL's, and it exits on its own with code 4."""
    spec = "rst:node=1,step=15"
    run = lab_run("--nodes", "2", "--steps", "40", "--fault", spec, "--stall-timeout", "10",
                  "--json")  # fmt: skip
    assert run.code == 1, run.err
    assert run.result["gave_up"] is None  # every rank exited by itself
    f = fault(run, spec)
    assert f["injected"] and f["step"] >= 15 and f["measured"]["sockets_reset"] >= 2
    for r in run.result["ranks"]:
        assert (r["status"], r["exit_code"], r["killed_by_lab"]) == ("error", 4, False), r
        assert "REMOTE_ERROR" in r["error"], r["error"]
        assert 15 <= r["steps_done"] <= f["step"] + 1
    peers = [r["error"] for r in run.result["ranks"] if r["node"] == 0]
    assert any("reset the connection" in e for e in peers), peers
    before = f["measured"]["tcp_before"]
    # the peers' kernel counted connections reset by the other end ...
    assert run.node(0)["tcp"]["EstabResets"] > before["0"]["EstabResets"]
    # ... and node 1's kernel sent the resets
    sent = run.node(1)["tcp"]["OutRsts"] - before["1"]["OutRsts"]
    assert sent >= f["measured"]["sockets_reset"]


@pytest.mark.lab
@pytest.mark.solo
def test_loss_from_a_step_beside_a_neighbour_churning_2000_connections_a_second() -> None:
    """Solo: judges a connection rate and retransmits per step.  A neighbour
    outside the job opens 2,000 connections a second between the nodes
    (ActiveOpens, counted by the kernels) from before the job starts; from
    step 20 node 1 loses 5% of its TCP packets: retransmits before the step
    are a healthy run's few, after it many; the job finishes (a stall timeout
    of 30 s: on a loaded machine a retransmission backoff can hold a step
    for seconds)."""
    spec = "loss:node=1,pct=5,step=20"
    run = lab_run("--nodes", "2", "--steps", "40", "--neighbour-churn", "2000", "--fault", spec,
                  "--stall-timeout", "30", "--json")  # fmt: skip
    assert_done(run, world=4, steps=40)
    churn = run.result["neighbour_churn"]
    assert churn["target_per_s"] == 2000 and churn["processes"] == 2
    assert 1600 <= churn["active_opens_per_s"] <= 2400, churn
    assert churn["connections"] >= 0.8 * 2000 * churn["seconds"], churn
    assert "neighbour churn: 2,000/s asked" in lab_run_table_line(run)

    f = fault(run, spec)
    assert f["injected"] and f["step"] >= 20
    before = f["measured"]["tcp_before"]["1"]["RetransSegs"]
    after = run.node(1)["tcp_retrans_segs"] - before
    steps_after = 40 - f["step"]
    assert after >= 50
    assert after / steps_after > 5 * (before / f["step"] + 0.1), (before, after)


def lab_run_table_line(run: Run) -> str:
    """The line the table output shows for the neighbour, from the same result."""
    from stallwatch.lab.neighbour import ChurnOutcome

    return ChurnOutcome(**run.result["neighbour_churn"]).line()


@pytest.mark.lab
@pytest.mark.solo
def test_rate_cap_from_a_step_slows_the_steps_after_it() -> None:
    """Solo: judges step times."""
    spec = "rate:node=1,mbit=40,step=12"
    run = lab_run("--nodes", "2", "--steps", "24", "--fault", spec, "--json")
    assert_done(run, world=4, steps=24)
    f = fault(run, spec)
    assert f["injected"] and 12 <= f["step"] <= 14
    for r in range(4):
        fast = statistics.median(step_ms(run, r, range(1, 12)))
        capped = statistics.median(step_ms(run, r, range(f["step"] + 1, 24)))
        assert capped > 2.5 * fast, (r, fast, capped)


@pytest.mark.lab
@pytest.mark.solo
def test_slow_and_cpuhog_from_a_step_and_checkpoint_pauses() -> None:
    """Solo: judges step times, with generous margins (the machine is
    shared).  2x1, compute 10 ms: rank 0 slow by 50 ms from step 15, a hog
    on rank 1's CPU from step 30; rank 1 pauses 300 ms every 10 steps (its
    peer waits in the barrier) and every rank 200 ms every 25 steps."""
    slow, hog = "slow:rank=0,ms=50,step=15", "cpuhog:rank=1,step=30"
    alone, everyone = "pause:every=10,ms=300,rank=1", "pause:every=25,ms=200"
    run = lab_run("--nodes", "2", "--ranks-per-node", "1", "--steps", "40", "--compute-ms", "10",
                  "--fault", slow, "--fault", hog, "--fault", alone, "--fault", everyone,
                  "--json")  # fmt: skip
    assert_done(run, world=2, steps=40)
    pauses = {10, 20, 30, 25}

    def median(rank: int, steps: range) -> float:
        return statistics.median(step_ms(run, rank, [s for s in steps if s not in pauses]))

    assert fault(run, slow)["step"] == 15  # fired by the rank itself, at its step
    for s in set(range(15, 40)) - pauses:
        assert waited_ms(run, 1, 0, s) >= 50, s  # rank 1 waited for rank 0's extra compute
    assert median(1, range(15, 30)) - median(1, range(15)) >= 25

    h = fault(run, hog)
    assert h["injected"] and 30 <= h["step"] <= 32 and "busy processes" in h["how"]
    assert median(1, range(h["step"] + 1, 40)) - median(1, range(15, 30)) >= 50

    a, e = fault(run, alone), fault(run, everyone)
    assert [x["step"] for x in a["episodes"]] == [10, 20, 30]
    assert [x["step"] for x in e["episodes"]] == [25]
    for x in a["episodes"]:
        assert x["end_ns"] - x["at_ns"] >= 300 * MS
        assert waited_ms(run, 0, 1, x["step"]) >= 300  # rank 0 waited in the barrier
    assert min(step_ms(run, r, [25])[0] for r in (0, 1)) >= 200
    for r in run.result["ranks"]:  # each pause ended in a barrier on world
        assert r["calls"]["ncclAllReduce"] == {"dp": 40, "world": 40 + len(pauses)}


@pytest.mark.lab
@pytest.mark.solo
def test_gpuslow_from_a_step() -> None:
    """Solo: judges step times.  Rank 1's device is 150 ms slower from step
    6: every rank's steps from there wait for it, and the steps before are
    faster by at least half that (medians of 5 steps; a device step's end
    is smeared over the next one's start, and a loaded machine's waiting
    ranks lose time that a long wait then hides: 60 ms gave medians 24 ms
    apart here, twice, at a load of 6-12)."""
    spec = "gpuslow:rank=1,ms=150,step=6"
    run = lab_run("--nodes", "2", "--steps", "12", "--mode", "gpu", "--fault", spec, "--json")
    assert_done(run, world=4, steps=12)
    f = fault(run, spec)
    assert (f["injected"], f["step"]) == (True, 6)  # fired by the rank itself, at its step
    for r in range(4):
        for s in range(6, 12):
            assert waited_ms(run, r, 1, s) >= 150, (r, s)
        early, late = step_ms(run, r, range(1, 6)), step_ms(run, r, range(7, 12))
        assert statistics.median(late) - statistics.median(early) >= 75, (r, early, late)

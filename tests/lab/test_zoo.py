"""The fault zoo's draws (lab.zoo) and how bench.zoo judges a verdict against
a draw's truth: pure logic, no lab run."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from bench import zoo as bench_zoo
from stallwatch.commands.main import build_parser
from stallwatch.dumpers.errors import UsageError
from stallwatch.lab import faults as F
from stallwatch.lab import zoo

SEEDS = range(3000)


def test_a_seed_replays_its_draw_and_seeds_differ() -> None:
    assert zoo.draw(42, cpus=2) == zoo.draw(42, cpus=2)
    assert len({zoo.draw(s, cpus=2).to_json().__repr__() for s in range(50)}) == 50


def test_every_mechanism_is_drawn_and_healthy_draws_are_a_fifth_or_so() -> None:
    counts = Counter(zoo.draw(s, cpus=2).truth.mechanism for s in SEEDS)
    assert set(counts) == set(zoo.MECHANISMS)
    assert 0.17 < counts["healthy"] / len(SEEDS) < 0.27


@pytest.mark.parametrize("cpus", [1, 2, 8])
def test_every_draw_fits_the_machine_and_its_own_job(cpus: int) -> None:
    """Each draw's faults parse and fit its topology and steps; its shape
    keeps to RANKS_PER_CPU; device faults only in gpu mode; the lab command
    printed for it gives the same job and faults."""
    parser = build_parser()
    for seed in range(0, 1500, 3):
        d = zoo.draw(seed, cpus=cpus)
        j = d.job
        assert 2 <= j.nodes <= 6 and 1 <= j.ranks_per_node <= 4
        assert j.world <= max(2, zoo.RANKS_PER_CPU * cpus)
        faults = F.parse_faults((*d.faults, *d.noise))
        F.validate(faults, F.Topology(j.nodes, j.ranks_per_node), j.steps, j.mode)
        if any(isinstance(f, F.GPU_FAULTS) for f in faults):
            assert j.mode == "gpu"
        args = parser.parse_args(["lab", "run", *d.lab_argv("dumps")])
        assert (args.nodes, args.ranks_per_node, args.mode, args.wait) == (
            j.nodes, j.ranks_per_node, j.mode, j.wait)  # fmt: skip
        assert F.parse_faults(args.fault) == faults
        assert args.record and args.dump_at_end == j.dump_at_end


def test_the_truth_names_the_faulted_place() -> None:
    for seed in SEEDS:
        d = zoo.draw(seed, cpus=2)
        t, nodes = d.truth, d.job.nodes
        if t.expect is zoo.Expect.HEALTHY:
            assert t.hosts == () and t.ranks == ()
        elif t.culprit_rank is not None:
            assert t.ranks == (t.culprit_rank,)
            assert t.hosts == (f"node{t.culprit_rank // d.job.ranks_per_node}",)
            assert any(f"rank={t.culprit_rank}" in f for f in d.faults)
        else:
            node = int(t.culprit_host.removeprefix("node"))  # type: ignore[union-attr]
            assert any(f"node={node}" in f for f in d.faults)
            # a pair only where nothing can separate the two: a two-node job
            assert t.hosts == ((t.culprit_host,) if nodes > 2 else ("node0", "node1"))


def test_a_space_narrows_the_draws_and_says_so() -> None:
    space = zoo.Space.parse("cut,mtu", "3x2,4x2", "spin", "churn,bulk")
    for seed in range(200):
        d = zoo.draw(seed, cpus=2, space=space)
        assert d.truth.mechanism in ("cut", "mtu")
        assert d.job.shape in ("3x2", "4x2") and d.job.wait == "spin"
        assert d.job.neighbour in ("churn", "bulk")
    assert space.args() == ["--mechanisms", "cut,mtu", "--shapes", "3x2,4x2", "--waits", "spin",
                            "--neighbours", "churn,bulk"]  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"mechanisms": "cut,teleport"}, "unknown mechanism teleport"),
        ({"shapes": "3by2"}, "bad shape '3by2'"),
        ({"shapes": "1x4"}, "bad shape '1x4'"),
        ({"waits": "nap"}, "unknown wait nap"),
    ],
)
def test_a_bad_space_is_refused_naming_what(kwargs: dict[str, str], names: str) -> None:
    with pytest.raises(UsageError, match=names):
        zoo.Space.parse(**kwargs)


def _ranks(steps_ms: list[float], n: int = 2) -> list[dict[str, Any]]:
    return [{"step_ms": list(steps_ms)} for _ in range(n)]


def _truth(step: int | None = 100) -> zoo.Truth:
    return zoo.Truth("rate", zoo.Expect.NETWORK, "node1", None, ("node1",), (2, 3), "mid", step,
                     "capped")  # fmt: skip


def test_affected_compares_the_median_step_after_the_onset_with_before() -> None:
    slowed = zoo.affected(_truth(), {"ranks": _ranks([50.0] * 100 + [80.0] * 50)})
    assert slowed.factor == pytest.approx(1.6) and slowed.affected and not slowed.stalled
    same = zoo.affected(_truth(), {"ranks": _ranks([50.0] * 100 + [55.0] * 50)})
    assert not same.affected
    noisy = [30.0, 60.0, 90.0] * 34  # a shared machine: steps vary by half and more
    within = zoo.affected(_truth(), {"ranks": _ranks(noisy[:100] + [85.0] * 50)})
    assert within.factor is not None and within.factor > 1.25 and not within.affected
    one_long = zoo.affected(
        _truth(), {"ranks": _ranks([50.0] * 100 + [50.0, 9000.0] + [50.0] * 40)}
    )
    assert one_long.affected and one_long.longest_s == pytest.approx(9.0)  # it stood still 9 s
    hiccup = zoo.affected(_truth(), {"ranks": _ranks(
        [50.0] * 100 + [50.0, 2000.0] + [50.0] * 40)})  # fmt: skip
    assert not hiccup.affected
    stuck = zoo.affected(_truth(), {"ranks": _ranks([50.0] * 100), "gave_up": "no rank made "
                                    "progress for 20 s"})  # fmt: skip
    assert stuck.affected and stuck.stalled


def _record(truth: zoo.Truth, affected: bool = True) -> dict[str, Any]:
    after = [90.0] * 50 if affected else [50.0] * 50
    return {"seed": 7, "truth": truth.to_json(), "lab": {"ranks": _ranks([50.0] * 100 + after)},
            "job": {"nodes": 3, "ranks_per_node": 2, "mode": "blocking"}}  # fmt: skip


def _verdict(kind: str, hosts: list[str], ranks: list[int]) -> dict[str, Any]:
    return {"kind": kind, "hosts": hosts, "ranks": ranks, "summary": "s"}


def _analysis(*incidents: tuple[str, list[dict[str, Any]]]) -> dict[str, Any]:
    return {"incidents": [{"id": i, "time": f"2026-01-01T00:00:0{k}Z", "verdicts": v}
                          for k, (i, v) in enumerate(incidents)]}  # fmt: skip


def test_a_network_verdict_naming_the_host_alone_is_right() -> None:
    good = _verdict("network_straggler", ["node1", "node1"], [2, 3])
    row = bench_zoo.judge(_record(_truth()), _analysis(("inc", [good])))
    assert row.right and not row.wrong_culprit


def test_naming_the_pair_where_three_nodes_tell_them_apart_is_a_wrong_culprit() -> None:
    pair = _verdict("network_partition", ["node0", "node1"], [0, 2])
    row = bench_zoo.judge(_record(_truth()), _analysis(("inc", [pair])))
    assert not row.right and row.wrong_culprit


def test_the_incident_an_agent_raised_is_judged_before_the_end_dumps() -> None:
    wrong_kind = _verdict("compute_straggler", ["node1"], [2])
    right = _verdict("network_straggler", ["node1"], [2, 3])
    both = _analysis(("lab-x-end", [right]), ("agent-inc", [wrong_kind]))
    row = bench_zoo.judge(_record(_truth()), both)
    assert not row.right and not row.wrong_culprit and row.incidents_raised == 1


def test_inconclusive_is_a_miss_and_healthy_on_a_slowed_job_is_counted() -> None:
    row = bench_zoo.judge(_record(_truth()), _analysis(("i", [_verdict("inconclusive", [], [])])))
    assert not row.right and not row.wrong_culprit and not row.healthy_on_fault
    row = bench_zoo.judge(_record(_truth()), _analysis(("i", [_verdict("healthy", [], [])])))
    assert not row.right and row.healthy_on_fault


def test_a_fault_that_affected_nothing_may_be_called_healthy_but_never_blame_another() -> None:
    healthy = _analysis(("lab-x-end", [_verdict("healthy", [], [])]))
    assert bench_zoo.judge(_record(_truth(), affected=False), healthy).right
    other = _analysis(("lab-x-end", [_verdict("network_straggler", ["node2"], [4, 5])]))
    row = bench_zoo.judge(_record(_truth(), affected=False), other)
    assert not row.right and row.wrong_culprit


def test_a_healthy_draw_is_right_only_when_no_verdict_names_anyone() -> None:
    truth = zoo.Truth("healthy", zoo.Expect.HEALTHY, None, None, (), (), "mid", None, "quiet")
    quiet = _analysis(("lab-x-end", [_verdict("healthy", [], [])]))
    assert bench_zoo.judge(_record(truth, affected=False), quiet).right
    blamed = _analysis(("lab-x-end", [_verdict("healthy", [], [])]),
                       ("inc", [_verdict("compute_straggler", ["node0"], [0])]))  # fmt: skip
    row = bench_zoo.judge(_record(truth, affected=False), blamed)
    assert not row.right and row.wrong_culprit and row.incidents_raised == 1


def test_a_rank_fault_is_right_only_naming_that_rank() -> None:
    truth = zoo.Truth("hang", zoo.Expect.HANG, "node1", 3, ("node1",), (3,), "mid", 50, "hangs")
    assert bench_zoo.judge(_record(truth), _analysis(("i", [_verdict("missing_rank", ["node1"],
                                                                     [3])]))).right  # fmt: skip
    both = _analysis(("i", [_verdict("missing_rank", ["node1", "node1"], [2, 3])]))
    row = bench_zoo.judge(_record(truth), both)
    assert not row.right and row.wrong_culprit

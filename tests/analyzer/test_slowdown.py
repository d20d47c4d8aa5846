"""A slowdown incident judged against its own baseline (analyzer.detect.
slowdown), on synthetic jobs whose fault begins mid-run: the slow window is
where the rhythm departs, the straggler detectors judge it, and a job slowed
alike is a slowdown, never healthy."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stallwatch.analyzer.align import incident_from_recordings
from stallwatch.analyzer.detect.slowdown import slow_windows
from stallwatch.analyzer.match import match
from stallwatch.analyzer.pipeline import analyze_incident, analyze_recordings
from stallwatch.analyzer.report import to_json
from stallwatch.analyzer.verdict import VerdictKind
from tests.analyzer.synth import Job, pid_of, recordings

# 3 nodes of 2 ranks, 10 ms of compute a step; a fault from step 300 of 360
BASE = Job(nodes=3, ranks_per_node=2, steps=360, from_step=300)


def verdicts(job: Job) -> list[tuple[VerdictKind, tuple[int | None, ...], tuple[str, ...]]]:
    result = analyze_recordings([(r.host, r) for r in recordings(job)])
    (inc,) = result.incidents
    return [(v.kind, v.ranks, v.hosts) for v in inc.verdicts]


def top(job: Job):  # type: ignore[no-untyped-def]
    result = analyze_recordings([(r.host, r) for r in recordings(job)])
    return result.incidents[0].verdicts[0]


def test_the_slow_window_begins_where_the_rhythm_departs() -> None:
    job = Job(**{**BASE.__dict__, "all_slow_ms": 60.0, "slowdown_by": 1})
    inc = incident_from_recordings("i", [_source(r) for r in recordings(job)])
    assert inc.slowdown is not None and inc.slowdown.host == "node1"
    (w,) = slow_windows(inc, match(inc))
    assert w.onset and 299 <= w.seq <= 302, w.seq
    assert w.groups == 360 - w.seq and w.base_groups == w.seq
    factor = w.factor
    assert factor is not None and 5.0 < factor < 7.0  # (10 + 60 + 2) / (10 + 2) ms
    assert w.base_interval_ns is not None and 10e6 < w.base_interval_ns < 15e6


@pytest.mark.parametrize(
    ("slow_ms", "onset"),
    [
        (18.0, True),  # steps of 12 ms taking 30 ms: 2.5 times the pace, slow from step 300
        (6.0, False),  # 18 ms: 1.5 times, no run of slow intervals to begin anywhere
    ],
)
def test_the_onset_is_where_intervals_run_past_twice_their_pace(
    slow_ms: float, onset: bool
) -> None:
    job = Job(**{**BASE.__dict__, "all_slow_ms": slow_ms, "slowdown_by": 1})
    inc = incident_from_recordings("i", [_source(r) for r in recordings(job)])
    windows = slow_windows(inc, match(inc))
    if onset:
        (w,) = windows
        assert w.onset and 299 <= w.seq <= 302 and w.base_groups == w.seq, w
    else:
        assert windows == []


def _source(rec):  # type: ignore[no-untyped-def]
    from stallwatch.analyzer.align import Source

    return Source(rec.host, rec)


def test_a_job_slowed_alike_is_a_slowdown_never_healthy() -> None:
    job = Job(**{**BASE.__dict__, "all_slow_ms": 60.0, "slowdown_by": 1})
    result = analyze_recordings([(r.host, r) for r in recordings(job)])
    assert not result.healthy  # a finding: exit code 1
    doc = json.loads(to_json(result))  # validated against the published schema
    assert doc["incidents"][0]["verdicts"][0]["kind"] == "slowdown"
    v = result.incidents[0].verdicts[0]
    assert v.kind is VerdictKind.SLOWDOWN and v.ranks == ()
    assert v.summary.startswith("the whole job slowed") and "from seq 30" in v.summary
    assert any("every rank slowed alike" in e for e in v.evidence)
    assert any(e.startswith("raised by node1: slowdown:") for e in v.evidence)
    assert v.seq is not None and v.op == "ALL_REDUCE"
    # the same dumps taken for another reason: nothing departs, healthy as before
    assert top(Job(**{**BASE.__dict__, "all_slow_ms": 60.0})).kind is VerdictKind.HEALTHY


def test_a_job_slowed_alike_on_starved_cpus_says_so() -> None:
    """Other work on every CPU starves every rank alike: nobody departs, and
    the run-queue waits behind processes outside the job are the evidence."""
    job = Job(**{**BASE.__dict__, "all_slow_ms": 60.0, "slowdown_by": 1, "hog_all": True})
    v = top(job)
    assert v.kind is VerdictKind.SLOWDOWN and v.ranks == ()
    assert "waited for a CPU behind processes outside the job" in v.summary
    assert any("run queue behind processes outside the job: 480.0 ms" in e for e in v.evidence)
    # the same slowdown without the waits: no such claim
    plain = top(Job(**{**BASE.__dict__, "all_slow_ms": 60.0, "slowdown_by": 1}))
    assert "outside the job" not in plain.summary
    assert not any("run queue" in e for e in plain.evidence)


def test_a_rank_slowed_mid_run_is_named_on_the_slow_window() -> None:
    job = Job(**{**BASE.__dict__, "slow": (3, 60.0), "slowdown_by": 0})
    v = top(job)
    assert v.kind is VerdictKind.COMPUTE_STRAGGLER and v.ranks == (3,)
    assert any(e.startswith("judged on the slow window: slow window of") for e in v.evidence)
    # without the window (no slowdown raised it), the 60 slow steps are a
    # minority of the latest 256 collectives: it goes unnamed
    assert top(Job(**{**BASE.__dict__, "slow": (3, 60.0)})).kind is VerdictKind.HEALTHY


def test_a_cpu_hog_mid_run_is_cpu_interference_and_a_lossy_node_a_network_straggler() -> None:
    hog = top(Job(**{**BASE.__dict__, "cpuhog": 2, "slowdown_by": 2}))
    assert hog.kind is VerdictKind.CPU_INTERFERENCE and hog.ranks == (2,)
    lossy = top(Job(**{**BASE.__dict__, "loss_node": 1, "slowdown_by": 0}))
    assert lossy.kind is VerdictKind.NETWORK_STRAGGLER and lossy.hosts == ("node1",)


def test_a_rank_starved_through_the_slow_window_is_named_though_it_enters_on_time() -> None:
    """Its collectives wait for its CPU from inside (the lab's cpuhog on a
    3x2 job, seed 1: a network straggler before, then a bare slowdown).
    Every rank also waits behind the machine's other work all along (8 ms a
    step): over the whole ring the starved rank waited 2.3x the others, in
    the slow window 8.5x."""
    job = Job(**{**BASE.__dict__, "starved_inside": 2, "slowdown_by": 1, "background_wait_ms": 8.0})
    v = top(job)
    assert (v.kind, v.ranks) == (VerdictKind.CPU_INTERFERENCE, (2,)), v.summary
    assert any("not the last to enter" in e for e in v.evidence), v.evidence
    assert any(e.startswith("the slow window of") and "run queue there" in e for e in v.evidence)


def test_a_rank_starved_a_little_in_a_job_wide_slowdown_is_not_its_cause() -> None:
    """Its run-queue wait in the window (5 ms a step) is far less than half
    of what the window lost (65 ms a step): the job slowed alike."""
    job = Job(
        **{**BASE.__dict__, "all_slow_ms": 60.0, "starved_inside": 2, "inside_ms": 5.0}
        | {"slowdown_by": 1}
    )
    v = top(job)
    assert v.kind is VerdictKind.SLOWDOWN and v.ranks == (), v.summary


def test_a_lossy_node_whose_rank_waited_a_little_for_a_cpu_is_still_the_network() -> None:
    """Node 1's rank 2 waited 2 ms a step in the run queue in the window,
    many times the others' (nothing): a short window on a loaded machine
    does that by chance.  Far less than half of what the window lost, it is
    no starvation that stalls the node's connections."""
    job = Job(
        **{**BASE.__dict__, "loss_node": 1, "starved_inside": 2, "inside_ms": 2.0}
        | {"slowdown_by": 0}
    )
    v = top(job)
    assert (v.kind, v.hosts) == (VerdictKind.NETWORK_STRAGGLER, ("node1",)), v.summary


@pytest.mark.parametrize(
    ("dump_after_ms", "first"), [(1000.0, "compute_straggler"), (5000.0, "missing_rank")]
)
def test_a_rank_missing_within_the_jobs_own_pauses_comes_after_the_slowdowns_cause(
    dump_after_ms: float, first: str
) -> None:
    """Every rank paused 1.5 s every 50 steps before the fault (checkpoints);
    rank 2 is 60 ms slower a step from step 300, and at the dumps rank 0 has
    not entered the last collective: for 1 s, within the job's own pauses (a
    checkpoint caught at the dump: the lab's cpuhog 4x2, seed 8), it goes
    after the straggler; for 5 s, longer than any pause the job made, it
    stays first."""
    job = Job(
        **{**BASE.__dict__, "slow": (2, 60.0), "slowdown_by": 1, "pause": (50, 1500.0)}
        | {"hang": (0, 359), "dump_after_ms": dump_after_ms}
    )
    result = analyze_recordings([(r.host, r) for r in recordings(job)])
    kinds = [v.kind.value for v in result.incidents[0].verdicts]
    assert kinds[0] == first and set(kinds) == {"compute_straggler", "missing_rank"}, kinds
    missing = next(v for v in result.incidents[0].verdicts if v.kind is VerdictKind.MISSING_RANK)
    within = [e for e in missing.evidence if e.startswith("within the job's own pace")]
    assert bool(within) == (first == "compute_straggler"), missing.evidence


def test_a_rank_starved_before_the_slow_window_is_judged_on_the_window() -> None:
    """Rank 3 slowed from the fault, and starved of CPU before it only: in
    the window it computes longer, it is not starved there."""
    job = Job(**{**BASE.__dict__, "slow": (3, 60.0), "starved_before": 3, "slowdown_by": 0})
    v = top(job)
    assert (v.kind, v.ranks) == (VerdictKind.COMPUTE_STRAGGLER, (3,)), v.summary


def test_a_slowdown_whose_dumps_show_no_change_says_so() -> None:
    """The rings no longer hold the baseline (or the agent saw a rank late
    that every dump shows on time): still a slowdown, saying what is missing."""
    v = top(Job(**{**BASE.__dict__, "slowdown_by": 0}))
    assert v.kind is VerdictKind.SLOWDOWN
    assert "do not show where its rhythm changed" in v.summary


def test_a_slowdown_incident_is_judged_whole_when_something_else_departs() -> None:
    """A rank hung after the slowdown began: the hang is the verdict."""
    v = top(Job(**{**BASE.__dict__, "all_slow_ms": 60.0, "hang": (4, 340), "slowdown_by": 0}))
    assert v.kind is VerdictKind.MISSING_RANK and v.ranks == (4,)
    assert not any("slow window" in e for e in v.evidence)  # judged on its frontier


def test_analyze_incident_without_a_slowdown_reads_no_window() -> None:
    job = Job(**{**BASE.__dict__, "all_slow_ms": 60.0})
    inc = incident_from_recordings("i", [_source(r) for r in recordings(job)])
    assert inc.slowdown is None
    assert analyze_incident(inc).verdicts[0].kind is VerdictKind.HEALTHY


def test_checkpoints_are_no_onset_and_a_slowdown_after_them_is_found() -> None:
    """Every rank pausing 1.5 s every 25 steps: no slow window begins at a
    checkpoint; a rank slowed after a dozen of them is still named on its
    window, and the whole job slowed alike still found where it began."""
    raised = Job(**{**BASE.__dict__, "pause": (25, 1500.0), "slowdown_by": 0})
    inc = incident_from_recordings("i", [_source(r) for r in recordings(raised)])
    assert not any(w.onset for w in slow_windows(inc, match(inc)))
    assert "do not show where its rhythm changed" in top(raised).summary
    slow = top(Job(**{**raised.__dict__, "slow": (3, 60.0)}))
    assert slow.kind is VerdictKind.COMPUTE_STRAGGLER and slow.ranks == (3,)
    alike = top(Job(**{**raised.__dict__, "all_slow_ms": 60.0}))
    assert alike.kind is VerdictKind.SLOWDOWN and "from seq 30" in alike.summary


def test_group_medians_are_numpys_per_group_leaving_nan_out() -> None:
    from stallwatch.analyzer.detect.slowdown import _group_medians

    rng = np.random.default_rng(0)
    for _ in range(100):
        groups = int(rng.integers(1, 20))
        group = np.repeat(np.arange(groups), rng.integers(1, 6, groups))
        values = rng.integers(0, 100, len(group)).astype(float)
        values[rng.random(len(group)) < 0.3] = np.nan
        got = _group_medians(values, group, groups)
        for g in range(groups):
            known = values[(group == g) & ~np.isnan(values)]
            want = float(np.median(known)) if len(known) else np.nan
            assert np.isnan(got[g]) if np.isnan(want) else got[g] == want


# The lab's shape: each node's two ranks share a pair communicator (an
# AllGather after the compute, then a ReduceScatter and a small AllReduce
# entered together), then the ranks of one local index across nodes an
# AllReduce.  The slow rank's pair peer leaves the AllGather with it and is
# last in its own data-parallel AllReduce every step: inherited lateness.
LAB = Job(nodes=3, ranks_per_node=2, steps=360, from_step=300, lab_shape=True, slowdown_by=0)


def _lab(slow: int, seed: int = 1) -> list[tuple[VerdictKind, tuple[int, ...]]]:
    """(kind, pids) of each verdict (the job has no world communicator)."""
    job = Job(**{**LAB.__dict__, "slow": (slow, 150.0), "seed": seed})
    result = analyze_recordings([(r.host, r) for r in recordings(job)])
    return [(v.kind, v.pids) for v in result.incidents[0].verdicts]


@pytest.mark.parametrize("slow", [1, 2, 3, 4, 5])
def test_in_the_labs_shape_the_slow_rank_is_named_not_its_pair_peer(slow: int) -> None:
    """Over all of the pair's collectives its peer waits at a third of them
    (the median of its wait says nothing); at the AllGathers, at all: it is
    held up, and its lateness elsewhere is the slow rank's."""
    assert _lab(slow) == [(VerdictKind.COMPUTE_STRAGGLER, (pid_of(slow),))]


def test_without_each_kind_alone_the_pair_peer_would_be_named_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import stallwatch.analyzer.pipeline as pipeline

    monkeypatch.setattr(pipeline, "kind_scores", lambda inc, m: [])
    got = _lab(3)
    assert (VerdictKind.COMPUTE_STRAGGLER, (pid_of(2),)) in got, got  # rank 3's pair peer


def test_in_the_labs_shape_a_job_slowed_alike_names_nobody() -> None:
    job = Job(**{**LAB.__dict__, "all_slow_ms": 150.0})
    result = analyze_recordings([(r.host, r) for r in recordings(job)])
    assert [v.kind for v in result.incidents[0].verdicts] == [VerdictKind.SLOWDOWN]


def test_held_up_at_one_kind_means_waiting_as_long_as_a_straggler_must_be_late() -> None:
    """A slow rank itself waits a few ms more than its peers at some kind of
    collective now and then (a 4x2 lab seed: 5.1 ms at a world Broadcast,
    a step of 350 ms): that is no peer holding it up.  Its pair peer waits
    the whole lateness (160-210 ms) at the step's first collective.  Over
    all of a communicator's collectives, a few ms still count."""
    from types import SimpleNamespace
    from typing import cast

    from stallwatch.analyzer.detect.common import Analysis
    from stallwatch.analyzer.detect.stragglers import _waits_on_others
    from stallwatch.analyzer.incident import ArrivalScore

    ms = 1_000_000

    def score(proc: int, margin_ms: float, op: int | None) -> ArrivalScore:
        return ArrivalScore(0, proc, proc, 38, 0.1, int(margin_ms * ms), 0, 0, "wait", 8,
                            350 * ms, False, op)  # fmt: skip

    a = SimpleNamespace(
        arrivals=(score(2, -6.0, None),),
        kind_arrivals=(score(1, -5.1, 4), score(0, -160.0, 2), score(3, -80.0, 2)),
    )
    assert _waits_on_others(cast(Analysis, a)) == {0, 2}


# a node's link choked for one collective (a rate cap's queue, the lab's
# ``rate``): held 3 s, then the job goes on and the incident is dumped at once
CHOKED = Job(**{**BASE.__dict__, "steps": 306, "choke": (1, 300, 3000.0), "slowdown_by": 0})


def test_a_collective_the_network_held_names_the_host_in_its_retransmits() -> None:
    """One collective held 3 s with retransmission timeouts inside, every
    retransmit on the choked node's connections: too few slow collectives
    for a slow window or the retransmit rule (3 asked), named on the held
    one; the peers, each only on its own link to it, are not."""
    v = top(CHOKED)
    assert v.kind is VerdictKind.NETWORK_STRAGGLER and v.hosts == ("node1",), v.summary
    assert any("seq 300" in e and "was held 300" in e for e in v.evidence), v.evidence
    assert any(e.startswith("host node1 is involved in 120 of the 120") for e in v.evidence)


@pytest.mark.parametrize(
    "change",
    [
        {"choke": (-1, 300, 3000.0)},  # every link choked alike: no host departs
        {"choke": (1, 300, 900.0)},  # held under HOLD_MIN_NS: no held collective
        # calls queued: a window runs to the rank's next call, a checkpoint's
        # pause included, so none is held; one held collective goes unnamed
        # there (a known limit: the queued rule asks for 3)
        {"mode": "async"},
    ],
)
def test_a_held_collective_names_no_host_when_none_departs_or_it_was_short(
    change: dict[str, object],
) -> None:
    v = top(Job(**{**CHOKED.__dict__, **change}))
    assert v.kind is VerdictKind.SLOWDOWN and v.hosts == ("node0", "node1", "node2"), v.summary


@pytest.mark.parametrize(
    ("rank", "after_ms", "behind_link"),
    [
        (3, 1500.0, True),  # on the choked node, missing 1.5 s: late behind its link
        (4, 1500.0, False),  # on another node: a rank of its own
        (3, 5000.0, False),  # missing longer than the network held anything: hung
    ],
)
def test_a_rank_missing_behind_a_link_the_network_held_is_its_consequence(
    rank: int, after_ms: float, behind_link: bool
) -> None:
    """A rank that has not entered a collective since its link held the one
    before for 3 s (the lab's rate cap, seed 8: rank 3 on the capped node
    behind by 1.0 s at the dump, named missing)."""
    job = Job(**{**CHOKED.__dict__, "hang": (rank, 305), "dump_after_ms": after_ms})
    got = verdicts(job)
    if behind_link:
        assert [k for k, _, _ in got] == [VerdictKind.NETWORK_STRAGGLER], got
        v = top(job)
        assert any(e.startswith(f"consequence: rank {rank} never entered") for e in v.evidence)
    else:
        assert got[0][:2] == (VerdictKind.MISSING_RANK, (rank,)), got
        assert got[1][0] is VerdictKind.NETWORK_STRAGGLER

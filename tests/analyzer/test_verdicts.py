"""Every verdict from synthetic jobs, blocking and async, with skew, shuffled
inputs, wrapped rings and a missing dump."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import pytest

from stallwatch.analyzer.align import Source
from stallwatch.analyzer.detect.cpu import sched_delays
from stallwatch.analyzer.pipeline import analyze_incident, analyze_paths, group_incidents
from stallwatch.analyzer.verdict import Verdict, VerdictKind
from stallwatch.dumpers.model import Recording, Ring
from stallwatch.dumpers.schema import (
    EXIT_EVENT,
    PREV_PID_UNKNOWN,
    SCHED_EVENT,
    TCP_EVENT,
    ExitEvent,
    State,
    TcpEvent,
)
from tests.analyzer.synth import MS, Job, _addr, host_of, pid_of, recordings, with_

BASE = Job()


def verdicts(job: Job, drop_node: int | None = None, shuffle: int | None = None) -> list[Verdict]:
    recs = recordings(job)
    sources = [Source(f"dump-{r.host}.msgpack", r) for i, r in enumerate(recs) if i != drop_node]
    if shuffle is not None:
        random.Random(shuffle).shuffle(sources)
    (inc,) = group_incidents(sources)
    return list(analyze_incident(inc).verdicts)


def kinds(vs: list[Verdict]) -> list[VerdictKind]:
    return [v.kind for v in vs]


@pytest.mark.parametrize("mode", ["blocking", "async"])
def test_healthy_job_is_healthy(mode: str) -> None:
    assert kinds(verdicts(with_(BASE, mode=mode))) == [VerdictKind.HEALTHY]


@pytest.mark.parametrize("mode", ["blocking", "async"])
@pytest.mark.parametrize("rank", [0, 3])
def test_hang_names_exactly_the_hung_rank(mode: str, rank: int) -> None:
    vs = verdicts(with_(BASE, mode=mode, hang=(rank, 30)))
    assert kinds(vs) == [VerdictKind.MISSING_RANK]
    v = vs[0]
    assert v.ranks == (rank,)
    assert v.hosts == (host_of(BASE.node_of(rank)),)
    assert v.pids == (pid_of(rank),)
    assert v.seq == 30 and v.op == "ALL_REDUCE"
    assert v.comm_id_hash is not None and v.comm_id_hash.startswith("0x")


def _exited(
    recs: list[Recording], codes: dict[int, tuple[int | None, int | None]]
) -> list[Recording]:
    """The recordings with ranks given an exit (code, signal) in their node's process table."""
    return [
        dataclasses.replace(
            rec,
            processes=tuple(
                dataclasses.replace(p, exit_code=codes[p.pid][0], exit_signal=codes[p.pid][1])
                if p.pid in codes
                else p
                for p in rec.processes
            ),
        )
        for rec in recs
    ]


def _judged(recs: list[Recording]) -> list[Verdict]:
    (inc,) = group_incidents([Source(f"dump-{r.host}.msgpack", r) for r in recs])
    return list(analyze_incident(inc).verdicts)


def test_error_exits_after_a_desync_are_its_consequences() -> None:
    """A mismatched collective fails on its members, at the call or at their
    next synchronisation (unseen by the recorder): ranks alive at it that then
    exit with an error code are the desync's consequences, not culprits."""
    recs = recordings(with_(BASE, mismatch=(2, 25, "op")))
    vs = _judged(_exited(recs, {pid_of(r): (4, None) for r in range(BASE.nranks)}))
    assert kinds(vs) == [VerdictKind.DESYNC] and vs[0].ranks == (2,)


def test_a_rank_killed_by_a_signal_beside_a_desync_is_still_named() -> None:
    recs = recordings(with_(BASE, mismatch=(2, 25, "op")))
    vs = _judged(_exited(recs, {pid_of(1): (None, 9), pid_of(3): (4, None)}))
    assert kinds(vs) == [VerdictKind.DESYNC, VerdictKind.RANK_EXITED]
    assert vs[1].ranks == (1,)


@pytest.mark.parametrize("field", ["count", "dtype", "op"])
def test_mismatch_names_the_odd_rank(field: str) -> None:
    vs = verdicts(with_(BASE, mismatch=(2, 25, field)))
    assert kinds(vs)[0] is VerdictKind.DESYNC
    assert vs[0].ranks == (2,) and vs[0].seq == 25
    assert VerdictKind.MISSING_RANK not in kinds(vs)


def test_crash_is_rank_exited_not_missing_rank() -> None:
    vs = verdicts(with_(BASE, crash=(1, 20, 9)))
    assert kinds(vs) == [VerdictKind.RANK_EXITED]
    assert vs[0].ranks == (1,) and "signal 9" in vs[0].summary
    assert vs[0].seq == 20


def test_crash_names_the_dead_rank_not_those_its_death_failed() -> None:
    # every rank died; only rank 1 died first (signal), the others exited 4
    # after their pending call returned REMOTE_ERROR
    vs = verdicts(with_(BASE, crash=(1, 20, 9), peers_fail=True))
    assert kinds(vs) == [VerdictKind.RANK_EXITED]
    assert vs[0].ranks == (1,)
    assert any("of the error it caused" in e and "rank 3" in e for e in vs[0].evidence)


def test_deaths_a_lost_dump_may_have_caused_name_no_first_to_die() -> None:
    """The dead rank's node left no dump: the ranks seen died of a peer's
    error (their calls returned REMOTE_ERROR); the first of them to exit is
    not the cause, a rank of the lost node may be: inconclusive, naming
    those.  With that node's dump there, the rank killed is named."""
    job = with_(BASE, crash=(3, 20, 9), peers_fail=True)
    (v,) = verdicts(job, drop_node=BASE.node_of(3))
    assert v.kind is VerdictKind.INCONCLUSIVE and set(v.ranks) == {2, 3}
    assert "died of an error a peer caused" in v.summary
    assert [x.ranks for x in verdicts(job)] == [(3,)]


# An asynchronous job: rank 1 is killed; its peers' errors surface outside any
# recorded call (a stream synchronisation) and they exit 4 a few ms later.
# Clocks of the hosts disagree by up to 20 ms either way: the kill still
# comes first, and the error exits are its consequences.
@pytest.mark.parametrize("skew", [{}, {0: 20 * MS}, {1: -20 * MS}, {0: -20 * MS, 1: 20 * MS}])
def test_the_first_death_is_the_cause_of_later_error_exits(skew: dict[int, int]) -> None:
    job = with_(BASE, mode="async", crash=(1, 20, 9), peers_exit_ms=3.0, wall_skew_ns=skew)
    vs = verdicts(job)
    assert kinds(vs) == [VerdictKind.RANK_EXITED], [v.summary for v in vs]
    assert vs[0].ranks == (1,)
    assert any("exited with code 4" in e and "rank 0" in e for e in vs[0].evidence)


def test_an_error_exit_clearly_first_is_the_cause() -> None:
    # rank 2 exits with code 1 (no signal); the others exit 4 a second later
    job = with_(BASE, mode="async", crash=(2, 20, 0), peers_exit_ms=1000.0)
    vs = verdicts(with_(job, wall_skew_ns={0: 30 * MS}))
    assert kinds(vs) == [VerdictKind.RANK_EXITED] and vs[0].ranks == (2,)


def test_error_exits_closer_than_the_skew_are_not_ordered() -> None:
    # two error exits 10 ms apart on different hosts: clocks cannot order them
    job = with_(BASE, mode="async", crash=(2, 20, 0), peers_exit_ms=10.0)
    vs = verdicts(job)
    assert {r for v in vs if v.kind is VerdictKind.RANK_EXITED for r in v.ranks} == {0, 1, 2}


# Blocking calls give durations, which name a rank 20 ms slow; async calls
# give only arrival lateness, which must pass ARRIVAL_MARGIN_NS (50 ms) to
# stand above scheduling noise.
@pytest.mark.parametrize(("mode", "slow_ms"), [("blocking", 20.0), ("async", 60.0)])
def test_slow_rank_is_compute_straggler(mode: str, slow_ms: float) -> None:
    vs = verdicts(with_(BASE, mode=mode, slow=(3, slow_ms)))
    assert kinds(vs) == [VerdictKind.COMPUTE_STRAGGLER]
    assert vs[0].ranks == (3,) and vs[0].hosts == ("node1",)


def test_async_lone_slow_rank_is_named_across_hosts_despite_skew() -> None:
    # one rank per host, calls return at once: only cross-host lateness can
    # tell, and 100 ms of lateness is far above 5 ms of skew
    job = with_(BASE, mode="async", ranks_per_node=1, nodes=4, slow=(2, 100.0))
    for skew in ({}, {2: -5 * MS}, {1: 5 * MS}):
        vs = verdicts(with_(job, skew_ns=skew))
        assert kinds(vs) == [VerdictKind.COMPUTE_STRAGGLER] and vs[0].ranks == (2,)


def test_async_lone_ranks_with_skew_alone_are_healthy() -> None:
    job = with_(BASE, mode="async", ranks_per_node=1, nodes=4, skew_ns={3: 40 * MS})
    assert kinds(verdicts(job)) == [VerdictKind.HEALTHY]


def test_loss_names_the_lossy_host() -> None:
    # 4 nodes: node 1 is an end of every retransmitting connection
    vs = verdicts(with_(BASE, nodes=4, loss_node=1))
    assert kinds(vs) == [VerdictKind.NETWORK_STRAGGLER]
    assert vs[0].hosts == ("node1",)


def test_loss_between_two_nodes_names_both_ends() -> None:
    # 2 nodes: every retransmit is between the two, both ends lose alike
    vs = verdicts(with_(BASE, nodes=2, loss_node=1))
    assert kinds(vs) == [VerdictKind.NETWORK_STRAGGLER]
    assert vs[0].hosts == ("node0", "node1")
    assert "cannot be told apart" in vs[0].summary


def test_async_loss_is_named_by_the_timeouts_that_held_its_collectives() -> None:
    """Queued calls return at once: a collective's window runs to its ranks'
    next call after a pause, and what proves it slowed is the time a
    retransmission timeout held it (durations of such windows compare
    nothing: every one may hold retransmits)."""
    vs = verdicts(with_(BASE, mode="async", nodes=4, loss_node=1, loss_rto_ms=200.0))
    assert kinds(vs) == [VerdictKind.NETWORK_STRAGGLER], [v.summary for v in vs]
    assert vs[0].hosts == ("node1",)
    (held,) = [e for e in vs[0].evidence if "retransmission timeouts" in e]
    assert "calls queued" in held and "of their time" in held


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({}, "fast retransmits only: nothing held the collectives"),
        # a 200 ms timeout every other step of 2 s: 5% of the time
        ({"loss_rto_ms": 200.0, "compute_ms": 2000.0}, "timeouts hold too little of the time"),
    ],
)
def test_async_retransmits_that_held_little_name_nobody(
    changes: dict[str, float], why: str
) -> None:
    job = with_(BASE, mode="async", nodes=4, loss_node=1, steps=20, **changes)
    assert kinds(verdicts(job)) == [VerdictKind.HEALTHY], why


def test_queued_calls_work_until_their_ranks_next_call_after_a_pause() -> None:
    from stallwatch.analyzer.detect.network import call_windows, queued_comms
    from stallwatch.analyzer.match import match

    for mode in ("async", "blocking"):
        recs = recordings(with_(BASE, mode=mode))
        (inc,) = group_incidents([Source(f"dump-{r.host}.msgpack", r) for r in recs])
        m = match(inc)
        queued = queued_comms(m, len(inc.comms))
        end = call_windows(m, queued)
        rows = m.rows
        if mode == "blocking":
            assert not queued.any() and np.array_equal(end, rows["end"])
            continue
        assert queued.all()
        pairs = zip(rows["comm"].tolist(), rows["crank"].tolist(), strict=True)
        for comm, crank in set(pairs):
            mine = np.flatnonzero((rows["comm"] == comm) & (rows["crank"] == crank))
            assert np.array_equal(end[mine[:-1]], rows["ts"][mine[1:]])  # its next call
            assert end[mine[-1]] == rows["end"][mine[-1]]  # the last keeps its return


def test_retransmits_into_a_late_ranks_host_are_its_lateness() -> None:
    """A rank that computes late reads late: its peers retransmit into its
    full queues.  The straggler is named, the retransmits are evidence of it."""
    # rank 2 computes 150 ms longer from step 10 of 40, and its host's queues fill
    job = with_(BASE, nodes=4, slow=(2, 150.0), from_step=10, loss_node=1, loss_into=True)
    vs = verdicts(job)
    assert kinds(vs) == [VerdictKind.COMPUTE_STRAGGLER], [v.summary for v in vs]
    assert vs[0].ranks == (2,)
    assert any("retransmit into host node1" in e for e in vs[0].evidence)


def test_retransmits_into_a_host_no_late_rank_explains_are_the_network() -> None:
    # node1 drops what it receives from step 10 (a NIC's receive errors): no rank is late
    vs = verdicts(with_(BASE, nodes=4, from_step=10, loss_node=1, loss_into=True))
    net = [v for v in vs if v.kind is VerdictKind.NETWORK_STRAGGLER]
    assert len(net) == 1 and net[0].hosts == ("node1",), [v.summary for v in vs]


def _sent_back(recs: list[Recording], node: int, into_per_out: float) -> list[Recording]:
    """The recordings with ``node`` retransmitting too (its first rank),
    towards the peers that retransmit into it: one of its own for every
    ``into_per_out`` of theirs, in the same collectives."""
    host = host_of(node)
    into = np.concatenate([r.rings["tcp"].rows for r in recs if r.host != host])
    into = into[into["event"] == TcpEvent.TCP_RETRANSMIT_SKB]
    out = into[np.linspace(0, len(into) - 1, round(len(into) / into_per_out)).astype(int)].copy()
    out["saddr"], out["daddr"] = out["daddr"].copy(), out["saddr"].copy()
    out["pid"] = pid_of(node * BASE.ranks_per_node)
    (rec,) = [r for r in recs if r.host == host]
    tcp = Ring(np.concatenate([rec.rings["tcp"].rows, out]))
    sent = dataclasses.replace(rec, rings={**rec.rings, "tcp": tcp})
    return [sent if r is rec else r for r in recs]


@pytest.mark.parametrize(
    ("into_per_out", "slow_reader"),
    [
        # a lossy link drops both ways: about as many retransmits into the
        # host as out of it (1.0-1.4x in the lab's loss runs)
        (1.25, False),
        # a late reader's peers retransmit into its full queues, far more
        # than it sends back (3.4x into a rank 150 ms late in the lab)
        (3.0, True),
    ],
)
def test_a_late_ranks_host_is_a_slow_reader_only_when_retransmits_mostly_come_into_it(
    into_per_out: float, slow_reader: bool
) -> None:
    """Rank 2 (node1) computes 150 ms longer from step 10, and node1's
    connections retransmit both ways: its lateness explains them only when
    they mostly come into it; otherwise the link is lossy and is named."""
    job = with_(BASE, nodes=4, slow=(2, 150.0), from_step=10, loss_node=1, loss_into=True)
    recs = _sent_back(recordings(job), 1, into_per_out)
    (inc,) = group_incidents([Source(f"dump-{r.host}.msgpack", r) for r in recs])
    vs = list(analyze_incident(inc).verdicts)
    if slow_reader:
        assert kinds(vs) == [VerdictKind.COMPUTE_STRAGGLER], [v.summary for v in vs]
        assert vs[0].ranks == (2,)
    else:
        assert kinds(vs) == [VerdictKind.NETWORK_STRAGGLER], [v.summary for v in vs]
        assert vs[0].hosts == ("node1",)


@pytest.mark.parametrize(("held_ms", "held"), [(1200.0, False), (2800.0, True)])
def test_a_collective_is_held_by_the_network_only_far_beyond_its_median(
    held_ms: float, held: bool
) -> None:
    """Collectives of 200 ms; node1's link choked for one of them, with
    retransmission timeouts inside, and the agent raised a slowdown.  Held
    1.2 s longer (1.4 s: past the 1 s floor, but 7 times the median, under
    what the agent's held-call trigger asks) it names no host; held 2.8 s
    longer (3 s: 15 times) it names node1."""
    job = Job(nodes=3, steps=306, from_step=300, xfer_ms=200.0, slowdown_by=0,
              choke=(1, 300, held_ms))  # fmt: skip
    (v, *_) = verdicts(job)
    if held:
        assert v.kind is VerdictKind.NETWORK_STRAGGLER and v.hosts == ("node1",), v.summary
    else:
        assert v.kind is VerdictKind.SLOWDOWN and len(v.hosts) == 3, v.summary


def _with_noise_retransmits(recs: list[Recording], nodes: int) -> list[Recording]:
    """Retransmits as a loaded machine has them: in every other collective
    window, spread over all the node pairs, none slowing anything; plus many
    on loopback and on sockets whose both ends are on one host."""
    out = []
    for k, rec in enumerate(recs):
        nccl = rec.rings["nccl"].rows
        mid = (nccl["ts_ns"] + np.maximum(nccl["end_ns"], nccl["ts_ns"])) // 2
        loop = np.zeros(16, dtype=np.uint8)
        loop[:4] = (127, 0, 0, 1)
        pairs = []
        for i, t in enumerate(mid[::2].tolist()):
            peer = (k + 1 + i % (nodes - 1)) % nodes
            pairs += [(t, _addr(k), _addr(peer)), (t, loop, loop), (t + 1, _addr(k), _addr(k))]
        rows = np.zeros(len(pairs), dtype=TCP_EVENT)
        for row, (t, src, dst) in zip(rows, pairs, strict=True):
            row["ts_ns"], row["saddr"], row["daddr"] = t, src, dst
            row["pid"], row["family"] = int(nccl["pid"][0]), 2
            row["event"] = TcpEvent.TCP_RETRANSMIT_SKB
        out.append(dataclasses.replace(rec, rings={**rec.rings, "tcp": Ring(rows)}))
    return out


@pytest.mark.parametrize("nodes", [2, 4])
def test_retransmits_that_slow_nothing_are_no_network_straggler(nodes: int) -> None:
    recs = _with_noise_retransmits(recordings(with_(BASE, nodes=nodes)), nodes)
    (inc,) = group_incidents([Source(f"dump-{r.host}.msgpack", r) for r in recs])
    assert len(inc.retransmits) >= 20  # counted: between two nodes' addresses
    assert kinds(list(analyze_incident(inc).verdicts)) == [VerdictKind.HEALTHY]


def test_retransmits_of_a_cpu_starved_pair_are_cpu_interference() -> None:
    # 2 nodes: a hog starves rank 2 so that its connections retransmit
    vs = verdicts(with_(BASE, cpuhog=2, loss_node=1))
    assert kinds(vs) == [VerdictKind.CPU_INTERFERENCE]
    assert vs[0].ranks == (2,)


def test_cpuhog_is_cpu_interference() -> None:
    vs = verdicts(with_(BASE, cpuhog=2))
    assert kinds(vs) == [VerdictKind.CPU_INTERFERENCE]
    assert vs[0].ranks == (2,)


def test_cpu_interference_says_how_long_outsiders_held_the_cpu() -> None:
    (v,) = verdicts(with_(BASE, cpuhog=2))
    # 40 waits of 12 ms, each ended by the hog
    assert any("waited in the run queue 480.0 ms behind processes outside" in e for e in v.evidence)


def test_run_queue_delay_behind_the_jobs_own_ranks_is_no_interference() -> None:
    # As the lab's slow rank with spinning peers on two CPUs: it waits in the
    # run queue as long as a hogged rank, but behind the job's own ranks on
    # its host; that is the job's own oversubscription, and the rank is slow.
    vs = verdicts(with_(BASE, cpuhog=2, held_by="job"))
    assert kinds(vs) == [VerdictKind.COMPUTE_STRAGGLER], [v.summary for v in vs]
    assert vs[0].ranks == (2,)


@pytest.mark.parametrize("one_kernel", [False, True])
def test_run_queue_delay_is_split_by_the_cpus_holder(one_kernel: bool) -> None:
    # rank 0 (node0) waits behind: rank 1 (node0: the job), itself (another
    # thread), rank 2's pid (on node1: an outsider on another machine; the
    # job's when both nodes are one kernel, as the lab's are), the idle
    # task, an unknown holder
    recs = recordings(BASE)
    if one_kernel:
        recs = [dataclasses.replace(r, boot_id="one-boot") for r in recs]
    holders = [pid_of(1), pid_of(0), pid_of(2), 0, PREV_PID_UNKNOWN]
    rows = np.zeros(len(holders), dtype=SCHED_EVENT)
    rows["pid"] = rows["tid"] = pid_of(0)
    rows["delay_ns"] = [1 * MS, 2 * MS, 4 * MS, 8 * MS, 16 * MS]
    rows["prev_pid"] = holders
    rows["ts_ns"] = recs[0].clock.monotonic_ns  # each wait ended as the dump was taken
    node0 = dataclasses.replace(recs[0], rings={**recs[0].rings, "sched": Ring(rows)})
    (inc,) = group_incidents([Source(f"dump-{r.host}.msgpack", r) for r in [node0, recs[1]]])
    d = sched_delays(inc)
    (rank0,) = [i for i, p in enumerate(inc.procs) if p.pid == pid_of(0)]
    by_job = 3 * MS + (4 * MS if one_kernel else 0)
    got = (int(d.by_job[rank0]), int(d.outside[rank0]), int(d.unknown[rank0]))
    assert got == (by_job, 15 * MS - by_job, 16 * MS)
    assert int(d.starving[rank0]) == 31 * MS - by_job


def test_run_queue_delay_with_its_cpu_holder_unknown_counts_as_before() -> None:
    # dumps before format 5 do not say who held the CPU: starved as ever
    (v,) = verdicts(with_(BASE, cpuhog=2, held_by="unknown"))
    assert v.kind is VerdictKind.CPU_INTERFERENCE and v.ranks == (2,)
    assert any("480.0 ms behind processes not recorded" in e for e in v.evidence), v.evidence


@pytest.mark.parametrize("seed", range(6))
def test_ranks_sharing_a_hogged_cpu_are_both_cpu_interference(seed: int) -> None:
    # As in the lab on two CPUs: the hog's CPU is rank 0's and rank 2's.
    # Starved alike, they take turns at being last, each in about half of the
    # collectives (in less than half, for one of them, with most seeds); the
    # two together are last in nearly all, while ranks 1 and 3 wait.
    vs = verdicts(with_(BASE, cpuhog=2, hog_shared=0, seed=seed))
    assert kinds(vs) == [VerdictKind.CPU_INTERFERENCE] * 2, [v.summary for v in vs]
    assert sorted(r for v in vs for r in v.ranks) == [0, 2]
    assert all("starved of CPU" in v.summary for v in vs)


def test_recorded_lab_run_with_ranks_sharing_a_hogged_cpu() -> None:
    # A real recording the analyzer once called healthy (see its README):
    # rank 2's lead over its peers is small, as it waits for rank 0 too; the
    # unstarved ranks 1 and 3 wait about 45 ms longer than it.
    folder = Path(__file__).resolve().parents[1] / "data" / "lab-cpuhog-2x2"
    (inc,) = analyze_paths([str(folder)]).incidents
    vs = list(inc.verdicts)
    assert kinds(vs) == [VerdictKind.CPU_INTERFERENCE] * 2, [v.summary for v in vs]
    assert [(v.ranks, v.hosts) for v in vs] == [((0,), ("node0",)), ((2,), ("node1",))]
    assert any("take turns at being last" in e for v in vs for e in v.evidence)


FAULTS = [
    {},
    {"hang": (1, 30)},
    {"mismatch": (2, 25, "count")},
    {"crash": (1, 20, 9)},
    {"slow": (3, 20.0)},
    {"loss_node": 1},
    {"cpuhog": 2},
]


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: next(iter(f), "healthy"))
def test_skew_of_a_few_ms_changes_no_verdict(fault: dict[str, object]) -> None:
    job = with_(BASE, **fault)
    plain = [(v.kind, v.ranks, v.hosts) for v in verdicts(job)]
    for skew in (3 * MS, -5 * MS, 40 * MS):
        skewed = with_(job, skew_ns={1: skew})
        assert [(v.kind, v.ranks, v.hosts) for v in verdicts(skewed)] == plain


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: next(iter(f), "healthy"))
def test_same_verdicts_whatever_the_file_order(fault: dict[str, object]) -> None:
    job = with_(BASE, nodes=4, **fault)
    first = [v.to_json() for v in verdicts(job)]
    for seed in range(4):
        assert [v.to_json() for v in verdicts(job, shuffle=seed)] == first


def test_rings_wrapped_at_different_points_give_no_false_missing_rank() -> None:
    job = with_(BASE, nodes=4, wrap={0: 30, 1: 5, 3: 61})
    assert kinds(verdicts(job)) == [VerdictKind.HEALTHY]
    hung = with_(job, hang=(2, 35))
    vs = verdicts(hung)
    assert kinds(vs) == [VerdictKind.MISSING_RANK] and vs[0].ranks == (2,)


def test_missing_dump_is_judged_from_its_peers() -> None:
    # node 1 (ranks 2, 3) wrote no dump; rank 3 hung: its peers on node 0 are
    # at the frontier, and nothing shows whether rank 2 or rank 3 (or both)
    # never entered it: neither is blamed, and the stall is not "healthy"
    vs = verdicts(with_(BASE, hang=(3, 30)), drop_node=1)
    assert kinds(vs) == [VerdictKind.INCONCLUSIVE]
    assert vs[0].ranks == (2, 3)
    assert vs[0].seq == 30
    # their peers completed seq 29: that much is proven of them
    assert any("no readable dump" in e and "entered seq 29" in e for e in vs[0].evidence)


def test_an_asynchronous_return_proves_nothing_of_a_lost_rank() -> None:
    # calls return at once (enqueued, not completed): their returns do not
    # prove that the ranks of the lost node entered anything
    recs = recordings(with_(BASE, mode="async", hang=(3, 30)))
    for r in recs:
        rows = r.rings["nccl"].rows
        rows["state"][rows["end_ns"] > 0] = State.STARTED
    (inc,) = group_incidents([Source(r.host, r) for i, r in enumerate(recs) if i != 1])
    res = analyze_incident(inc)
    assert [v.kind for v in res.verdicts] == [VerdictKind.INCONCLUSIVE]
    assert res.verdicts[0].ranks == (2, 3)
    assert any("none of their collectives is known to have completed" in u for u in res.unjudged)


def test_a_lost_dump_beside_the_hung_rank_names_the_hung_rank_only() -> None:
    # 3 nodes; node 2 (ranks 4, 5) wrote no dump; rank 3 hung on node 1
    job = with_(BASE, nodes=3, hang=(3, 30))
    vs = verdicts(job, drop_node=2)
    assert kinds(vs) == [VerdictKind.MISSING_RANK]
    assert vs[0].ranks == (3,)


def test_a_lost_dump_of_a_healthy_job_is_inconclusive() -> None:
    vs = verdicts(BASE, drop_node=1)
    assert kinds(vs) == [VerdictKind.INCONCLUSIVE]
    assert vs[0].ranks == (2, 3)


def test_split_communicator_ranks_are_derived() -> None:
    (inc,) = group_incidents([Source(r.host, r) for r in recordings(with_(BASE, split=True))])
    split = [c for c in inc.comms if c.is_split]
    assert len(split) == 1
    ranks = [inc.procs[p].world_rank for p in split[0].members]
    assert ranks == [0, 2]
    assert kinds(list(analyze_incident(inc).verdicts)) == [VerdictKind.HEALTHY]


def test_rows_of_processes_outside_the_agents_scope_are_ignored() -> None:
    # another job's process leaked into node 0's ring with a clashing call:
    # it is in no process table, so it is none of this incident's business
    recs = recordings(BASE)
    rows = recs[0].rings["nccl"].rows
    foreign = rows[:5].copy()
    foreign["pid"] = foreign["tid"] = 4242  # its rows, by its own thread
    foreign["count"] = 7
    rings = dict(recs[0].rings)
    rings["nccl"] = dataclasses.replace(rings["nccl"], rows=np.concatenate([rows, foreign]))
    recs[0] = dataclasses.replace(recs[0], rings=rings)
    (inc,) = group_incidents([Source(r.host, r) for r in recs])
    assert 4242 not in {p.pid for p in inc.procs}
    assert kinds(list(analyze_incident(inc).verdicts)) == [VerdictKind.HEALTHY]


def _ended(recs: list[Recording], sig: dict[int, int], before_dump_ms: float) -> list[Recording]:
    """Ranks ended by a signal ``before_dump_ms`` before their node's dump
    (as the kernel's exit ring records it)."""
    out = []
    for rec in recs:
        mine = [p.pid for p in rec.processes if p.pid in sig]
        x = np.zeros(len(mine), dtype=EXIT_EVENT)
        for i, pid in enumerate(mine):
            x[i]["pid"], x[i]["event"], x[i]["signal"] = pid, ExitEvent.SIGNAL, sig[pid]
            x[i]["code"] = -1
            x[i]["ts_ns"] = rec.clock.monotonic_ns - int(before_dump_ms * MS)
        rings = dict(rec.rings, exit=Ring(np.concatenate([rec.rings["exit"].rows, x])))
        out.append(dataclasses.replace(rec, rings=rings))
    return _exited(out, {pid: (None, s) for pid, s in sig.items()})


@pytest.mark.parametrize("mode", ["blocking", "async"])
@pytest.mark.parametrize("sig", [9, 15])
def test_ranks_killed_while_they_waited_for_a_hung_rank_are_not_its_cause(
    mode: str, sig: int
) -> None:
    """Rank 3 hangs; seconds later its launcher kills every rank (the waiting
    ones and the hung one).  The waiting ranks' deaths ended a stall that had
    begun: only rank 3 is named."""
    recs = recordings(with_(BASE, mode=mode, hang=(3, 30)))
    vs = _judged(_ended(recs, {pid_of(r): sig for r in range(BASE.nranks)}, 1000.0))
    assert [v.ranks for v in vs] == [(3,)], vs
    vs = _judged(_ended(recs, {pid_of(r): sig for r in range(BASE.nranks) if r != 3}, 1000.0))
    assert kinds(vs) == [VerdictKind.MISSING_RANK] and vs[0].ranks == (3,), vs  # it is alive


def test_a_rank_that_crashed_while_it_waited_is_still_named() -> None:
    """A crash of its own (SIGSEGV) in a waiting rank is no launcher's kill:
    it is named beside the hung rank."""
    recs = recordings(with_(BASE, hang=(3, 30)))
    vs = _judged(_ended(recs, {pid_of(1): 11}, 1000.0))
    assert VerdictKind.RANK_EXITED in kinds(vs)
    assert next(v for v in vs if v.kind is VerdictKind.RANK_EXITED).ranks == (1,)


def test_a_shared_stall_torn_down_is_still_a_stall_and_no_exit_is_named() -> None:
    """Every rank stands in flight at a collective (a stall they share, no
    network evidence), and 4 s later the launcher kills them all: no rank's
    death is the cause, and the stall is still said (never healthy)."""
    job = with_(BASE, nodes=3, ranks_per_node=1, cut=(1, 30), rdma=True)
    recs = recordings(job)
    vs = _judged(_ended(recs, {pid_of(r): 9 for r in range(3)}, 1000.0))
    assert kinds(vs) == [VerdictKind.INCONCLUSIVE] and "stood still" in vs[0].summary, vs


def test_a_rank_killed_first_inside_a_collective_is_named_beside_the_teardown() -> None:
    """Rank 1 is killed 100 ms into the collective (within its usual time:
    the cause); the launcher kills the others 4 s later: rank 1 alone."""
    job = with_(BASE, nodes=3, ranks_per_node=1, cut=(1, 30), rdma=True)
    recs = _ended(recordings(job), {pid_of(0): 9, pid_of(2): 9}, 1000.0)
    recs = _ended(recs, {pid_of(1): 9}, 4900.0)
    vs = _judged(recs)
    assert [(v.kind, v.ranks) for v in vs if v.kind is VerdictKind.RANK_EXITED] == [
        (VerdictKind.RANK_EXITED, (1,))
    ], vs

"""Fault specs: parsing, canonical form, validation against the topology."""

from __future__ import annotations

import shlex
import signal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stallwatch.dumpers.errors import UsageError
from stallwatch.lab import faults as F

TOPO = F.Topology(nodes=2, ranks_per_node=2)


@pytest.mark.parametrize(
    ("spec", "fault"),
    [
        ("hang:rank=3,step=5", F.Hang(rank=3, step=5)),
        ("hang:rank=3,step=5,agents=ready", F.Hang(3, 5, agents_ready=True)),
        ("slow:rank=0,ms=40", F.Slow(rank=0, ms=40.0)),
        ("loss:node=1,pct=5", F.Loss(node=1, pct=5)),
        ("rate:node=0,mbit=2.5", F.Rate(node=0, mbit=2.5)),
        ("mismatch:rank=2,step=1,field=dtype", F.Mismatch(2, 1, F.MismatchField.DTYPE)),
        ("crash:rank=1,step=4", F.Crash(rank=1, step=4, signal=None)),
        ("crash:rank=1,step=4,signal=KILL", F.Crash(1, 4, signal.SIGKILL)),
        ("crash:rank=1,step=4,signal=sigsegv", F.Crash(1, 4, signal.SIGSEGV)),
        ("crash:rank=1,step=4,signal=6", F.Crash(1, 4, signal.SIGABRT)),
        ("cpuhog:rank=3", F.CpuHog(rank=3)),
        ("gpuslow:rank=5,ms=20", F.GpuSlow(rank=5, ms=20.0)),
        ("gpuhang:rank=2,step=7", F.GpuHang(rank=2, step=7)),
        ("agentkill:node=1,step=5,after=2", F.AgentKill(node=1, step=5, after_s=2.0)),
        ("agentoom:node=0,step=10", F.AgentOom(node=0, step=10)),
        ("agentlate:node=1,step=3", F.AgentLate(node=1, step=3)),
        ("agentgone:node=1,step=5", F.AgentGone(node=1, step=5)),
        (" HANG: step=2 , rank=1 ", F.Hang(rank=1, step=2)),
        ("slow:rank=0,ms=40,step=10", F.Slow(rank=0, ms=40.0, step=10)),
        ("loss:node=1,pct=5,step=7", F.Loss(node=1, pct=5, step=7)),
        ("rate:node=0,mbit=8,step=0", F.Rate(node=0, mbit=8.0, step=0)),
        ("partition:node=1,step=50", F.Partition(node=1, step=50)),
        ("partition:node=1,step=50,ms=3500", F.Partition(node=1, step=50, ms=3500.0)),
        ("linkdown:node=0,step=3", F.LinkDown(node=0, step=3)),
        ("linkdown:node=0,ms=250.5,step=3", F.LinkDown(node=0, step=3, ms=250.5)),
        ("rst:node=1,step=9", F.Rst(node=1, step=9)),
        ("cpuhog:rank=3,step=12", F.CpuHog(rank=3, step=12)),
        ("gpuslow:rank=5,ms=20,step=4", F.GpuSlow(rank=5, ms=20.0, step=4)),
        ("pause:every=50,ms=2000", F.Pause(every=50, ms=2000.0)),
        ("pause:every=50,ms=2000,rank=0", F.Pause(every=50, ms=2000.0, rank=0)),
        ("loss:node=1,pct=5,dir=in", F.Loss(1, 5, dir=F.Direction.IN)),
        ("rate:node=0,mbit=8,dir=out,step=3", F.Rate(0, 8.0, 3, F.Direction.OUT)),
        ("partition:node=1,step=5,dir=in", F.Partition(1, 5, dir=F.Direction.IN)),
        ("partition:node=1,step=5,dir=both", F.Partition(1, 5)),
        ("mtu:node=1,bytes=1200,step=4", F.Mtu(node=1, size=1200, step=4)),
        ("syn:node=0", F.SynDrop(node=0)),
        ("corrupt:node=1,pct=3,step=2", F.Corrupt(node=1, pct=3, step=2)),
        ("bulk:node=0,mbit=30", F.Bulk(node=0, mbit=30.0)),
        ("bulk:node=0,mbit=30,to=1,step=5", F.Bulk(node=0, mbit=30.0, to=1, step=5)),
        ("throttle:rank=1,pct=30,step=5", F.Throttle(rank=1, pct=30, step=5)),
        ("stop:rank=2,step=3,ms=1500", F.Stop(rank=2, step=3, ms=1500.0)),
        ("stop:rank=all,step=3,ms=1500", F.Stop(rank=None, step=3, ms=1500.0)),
    ],
)
def test_parse(spec: str, fault: F.Fault) -> None:
    assert F.parse_fault(spec) == fault
    assert F.parse_fault(F.format_fault(fault)) == fault


@pytest.mark.parametrize(
    ("spec", "names"),
    [
        ("explode:rank=1", "unknown kind 'explode'"),
        ("hang:rank=1", "hang needs step=<an integer>"),
        ("hang:rank=x,step=1", "rank='x' is not an integer"),
        ("hang:rank=1,step=2,color=red", "unknown key(s) for hang: color"),
        ("hang:rank=1,rank=2,step=1", "'rank' given twice"),
        ("hang:rank=1,step", "expected key=value, got 'step'"),
        ("hang:rank=1,step=2,agents=late", "agents= takes only 'ready'"),
        ("loss:node=0,pct=0", "pct=0 is out of range 1..100"),
        ("loss:node=0,pct=101", "pct=101 is out of range 1..100"),
        ("rate:node=0,mbit=0", "mbit=0 must be > 0"),
        ("slow:rank=0,ms=-5", "ms=-5 must be > 0"),
        ("mismatch:rank=0,step=1,field=root", "field='root' must be one of count, dtype, op"),
        ("crash:rank=0,step=1,signal=NOPE", "signal='NOPE' is not a signal name"),
        ("hang:rank=-1,step=1", "rank=-1 is out of range"),
        ("", "unknown kind ''"),
        ("partition:node=1", "partition needs step=<an integer>"),
        ("partition:node=1,step=2,ms=0", "ms=0 must be > 0"),
        ("partition:node=1,step=2,ms=soon", "ms='soon' is not a number"),
        ("linkdown:step=2", "linkdown needs node=<an integer>"),
        ("linkdown:node=1,step=2,ms=-3", "ms=-3 must be > 0"),
        ("rst:node=1,step=2,ms=100", "unknown key(s) for rst: ms"),
        ("loss:node=0,pct=5,step=x", "step='x' is not an integer"),
        ("rate:node=0,mbit=5,step=-1", "step=-1 is out of range"),
        ("cpuhog:rank=0,step=1.5", "step='1.5' is not an integer"),
        ("pause:every=0,ms=100", "every=0 is out of range 1.."),
        ("pause:ms=100", "pause needs every=<an integer>"),
        ("pause:every=5", "pause needs ms=<a number>"),
        ("pause:every=5,ms=100,node=1", "unknown key(s) for pause: node"),
        ("loss:node=0,pct=5,dir=up", "dir='up' must be one of both, in, out"),
        ("mtu:node=0,bytes=10", "bytes=10 is out of range 28..65535"),
        ("mtu:node=0", "mtu needs bytes=<an integer>"),
        ("bulk:node=1,mbit=5,to=1", "to=1 is the node itself"),
        ("throttle:rank=1,pct=0", "pct=0 is out of range 1..100"),
        ("stop:rank=1,step=2", "stop needs ms=<a number>"),
        ("stop:rank=some,step=2,ms=5", "rank='some' is not an integer"),
    ],
)
def test_bad_specs_say_what_is_wrong(spec: str, names: str) -> None:
    with pytest.raises(UsageError) as info:
        F.parse_fault(spec)
    message = str(info.value)
    assert names in message
    assert repr(spec) in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("spec", "names"),
    [
        ("hang:rank=4,step=1", "rank 4 does not exist (ranks are 0..3)"),
        ("cpuhog:rank=9", "rank 9 does not exist"),
        ("loss:node=2,pct=5", "node 2 does not exist (nodes are 0..1)"),
        ("rate:node=7,mbit=5", "node 7 does not exist"),
        ("crash:rank=0,step=20", "step 20 is never reached (steps are 0..19)"),
        ("partition:node=2,step=5", "node 2 does not exist (nodes are 0..1)"),
        ("linkdown:node=1,step=20,ms=5", "step 20 is never reached"),
        ("rst:node=5,step=1", "node 5 does not exist"),
        ("loss:node=1,pct=5,step=25", "step 25 is never reached"),
        ("slow:rank=1,ms=5,step=20", "step 20 is never reached"),
        ("cpuhog:rank=0,step=99", "step 99 is never reached"),
        ("pause:every=20,ms=100", "every=20 pauses before step 20, never reached"),
        ("pause:every=5,ms=100,rank=4", "rank 4 does not exist (ranks are 0..3)"),
        ("mtu:node=2,bytes=900", "node 2 does not exist"),
        ("bulk:node=0,mbit=5,to=3", "node 3 does not exist (nodes are 0..1)"),
        ("throttle:rank=4,pct=5", "rank 4 does not exist"),
        ("stop:rank=4,step=1,ms=5", "rank 4 does not exist"),
        ("stop:rank=all,step=21,ms=5", "step 21 is never reached"),
    ],
)
def test_validate_against_topology(spec: str, names: str) -> None:
    with pytest.raises(UsageError, match=names.replace("(", r"\(").replace(")", r"\)")):
        F.validate([F.parse_fault(spec)], TOPO, steps=20)


def test_validate_accepts_the_edges() -> None:
    specs = ["hang:rank=3,step=19", "loss:node=1,pct=100", "cpuhog:rank=0"]
    specs += ["partition:node=1,step=19,ms=1", "rst:node=0,step=0", "pause:every=19,ms=1,rank=3"]
    F.validate(F.parse_faults(specs), TOPO, steps=20)


def test_one_fault_per_kind_and_target_but_pauses_of_different_ranks() -> None:
    F.validate(F.parse_faults(["pause:every=5,ms=9", "pause:every=3,ms=9,rank=1"]), TOPO, 20)
    F.validate(F.parse_faults(["partition:node=0,step=3", "linkdown:node=0,step=9"]), TOPO, 20)
    # a checkpoint and an evaluation of every rank: two phases of one job
    F.validate(F.parse_faults(["pause:every=5,ms=9", "pause:every=7,ms=9,work=cpu"]), TOPO, 20)
    for twice in (["pause:every=5,ms=9", "pause:every=3,ms=1"], ["rst:node=1,step=2"] * 2):
        with pytest.raises(UsageError, match="given twice"):
            F.validate(F.parse_faults(twice), TOPO, steps=20)


def test_pause_work_and_a_late_start_parse_and_format_back() -> None:
    for spec in ("pause:every=5,ms=20000,rank=1,work=io", "pause:every=9,ms=30,work=cpu",
                 "late:rank=2,ms=20000"):  # fmt: skip
        assert F.format_fault(F.parse_fault(spec)) == spec
    assert F.parse_fault("pause:every=5,ms=9").work == "sleep"  # type: ignore[union-attr]
    assert F.for_rank(F.parse_faults(["late:rank=2,ms=9"]), 2) == (F.Late(2, 9.0),)
    with pytest.raises(UsageError, match="work='disk'"):
        F.parse_fault("pause:every=5,ms=9,work=disk")
    with pytest.raises(UsageError, match="rank 9 does not exist"):
        F.validate(F.parse_faults(["late:rank=9,ms=9"]), TOPO, 20)


def test_device_faults_need_gpu_mode() -> None:
    faults = F.parse_faults(["gpuslow:rank=1,ms=5", "gpuhang:rank=0,step=2"])
    F.validate(faults, TOPO, steps=5, mode="gpu")
    for fault in faults:
        with pytest.raises(UsageError, match="needs --mode gpu"):
            F.validate([fault], TOPO, steps=5, mode="blocking")


def test_the_same_fault_twice_on_one_target_is_refused() -> None:
    with pytest.raises(UsageError, match="given twice"):
        F.validate(F.parse_faults(["slow:rank=1,ms=5", "slow:rank=1,ms=9"]), TOPO, steps=5)


def test_for_rank_picks_only_that_ranks_faults() -> None:
    faults = F.parse_faults(["slow:rank=1,ms=5", "hang:rank=2,step=1", "loss:node=0,pct=3"])
    assert F.for_rank(faults, 1) == (F.Slow(1, 5.0),)
    assert F.for_rank(faults, 0) == ()


def test_every_rank_gets_every_pause() -> None:
    """Whoever pauses, every rank joins the barrier after it."""
    faults = F.parse_faults(["pause:every=5,ms=9,rank=1", "partition:node=0,step=3"])
    assert F.for_rank(faults, 0) == F.for_rank(faults, 1) == (F.Pause(5, 9.0, rank=1),)


def test_faults_from_a_step_act_from_that_step() -> None:
    late, always = F.Slow(0, 5.0, step=10), F.Slow(0, 5.0)
    assert [F.active(late, s) for s in (0, 9, 10, 11)] == [False, False, True, True]
    assert F.active(always, 0) and F.active(F.Loss(1, 5), 0)
    pause = F.Pause(every=4, ms=1.0)
    assert [s for s in range(13) if F.pauses_at(pause, s)] == [4, 8, 12]  # never before step 0


def test_the_runner_injects_network_faults_and_hogs_the_ranks_the_rest() -> None:
    from stallwatch.lab.injector import runner_faults

    runner = ["partition:node=0,step=1", "linkdown:node=0,step=1,ms=5", "rst:node=1,step=2"]
    runner += ["loss:node=0,pct=5,step=3", "rate:node=0,mbit=5", "cpuhog:rank=1,step=4"]
    runner += ["mtu:node=1,bytes=900", "syn:node=1,step=2", "corrupt:node=0,pct=2"]
    runner += ["bulk:node=0,mbit=5", "throttle:rank=0,pct=20", "stop:rank=all,step=2,ms=9"]
    ranks = ["slow:rank=0,ms=5,step=3", "gpuslow:rank=1,ms=5", "pause:every=2,ms=5"]
    ranks += ["hang:rank=0,step=1", "agentkill:node=0,step=1"]
    faults = F.parse_faults(runner + ranks)
    assert runner_faults(faults) == list(faults[: len(runner)])


_MS = st.floats(0.001, 1e5).map(lambda x: float(f"{x:g}"))
_STEP = st.none() | st.integers(0, 10**9)
_faults = st.one_of(
    st.builds(F.Hang, st.integers(0, 999), st.integers(0, 999), st.booleans()),
    st.builds(F.Slow, st.integers(0, 999), st.floats(0.001, 1e5).map(lambda x: float(f"{x:g}"))),
    st.builds(F.Loss, st.integers(0, 99), st.integers(1, 100)),
    st.builds(F.Rate, st.integers(0, 99), st.floats(0.01, 1e4).map(lambda x: float(f"{x:g}"))),
    st.builds(
        F.Mismatch, st.integers(0, 999), st.integers(0, 999), st.sampled_from(F.MismatchField)
    ),
    st.builds(
        F.Crash,
        st.integers(0, 999),
        st.integers(0, 999),
        st.sampled_from([None, signal.SIGKILL, signal.SIGSEGV, signal.SIGTERM]),
    ),
    st.builds(F.CpuHog, st.integers(0, 999)),
    st.builds(F.GpuSlow, st.integers(0, 999), st.floats(0.001, 1e5).map(lambda x: float(f"{x:g}"))),
    st.builds(F.GpuHang, st.integers(0, 999), st.integers(0, 999)),
    st.builds(F.Slow, st.integers(0, 999), _MS, _STEP),
    st.builds(F.Loss, st.integers(0, 99), st.integers(1, 100), _STEP),
    st.builds(F.Rate, st.integers(0, 99), _MS, _STEP),
    st.builds(F.Partition, st.integers(0, 99), st.integers(0, 10**9), st.none() | _MS),
    st.builds(F.LinkDown, st.integers(0, 99), st.integers(0, 10**9), st.none() | _MS),
    st.builds(F.Rst, st.integers(0, 99), st.integers(0, 10**9)),
    st.builds(F.CpuHog, st.integers(0, 999), _STEP),
    st.builds(F.GpuSlow, st.integers(0, 999), _MS, _STEP),
    st.builds(F.Pause, st.integers(1, 10**9), _MS, st.none() | st.integers(0, 999)),
    st.builds(F.Loss, st.integers(0, 99), st.integers(1, 100), _STEP, st.sampled_from(F.Direction)),
    st.builds(F.Rate, st.integers(0, 99), _MS, _STEP, st.sampled_from(F.Direction)),
    st.builds(
        F.Partition,
        st.integers(0, 99),
        st.integers(0, 10**9),
        st.none() | _MS,
        st.sampled_from(F.Direction),
    ),
    st.builds(F.Mtu, st.integers(0, 99), st.integers(28, 65535), _STEP),
    st.builds(F.SynDrop, st.integers(0, 99), _STEP),
    st.builds(F.Corrupt, st.integers(0, 99), st.integers(1, 100), _STEP),
    st.builds(F.Bulk, st.integers(0, 99), _MS, st.none() | st.integers(100, 200), _STEP),
    st.builds(F.Throttle, st.integers(0, 999), st.integers(1, 100), _STEP),
    st.builds(F.Stop, st.none() | st.integers(0, 999), st.integers(0, 10**9), _MS),
)


@given(_faults)
def test_format_and_parse_round_trip(fault: F.Fault) -> None:
    assert F.parse_fault(F.format_fault(fault)) == fault


def _help_examples() -> list[list[str]]:
    """``stallwatch lab run --help``'s examples, each split as the shell would."""
    from stallwatch.commands.lab.run import RUN_EPILOG

    text = RUN_EPILOG.split("examples:", 1)[1].split("exit codes:", 1)[0]
    joined = text.replace("\\\n", " ")  # continuation lines
    return [shlex.split(line) for line in joined.splitlines() if line.strip()]


def test_every_help_example_is_valid_shell_with_valid_faults() -> None:
    """Each example parses as one command (continuations joined, as a shell
    would), every fault spec in it parses and fits its topology."""
    from stallwatch.commands.main import build_parser

    examples = _help_examples()
    assert len(examples) >= 10
    kinds = set()
    for argv in examples:
        assert argv[:3] == ["stallwatch", "lab", "run"], argv
        args = build_parser().parse_args(argv[1:])
        faults = F.parse_faults(args.fault)
        kinds |= {type(f) for f in faults}
        F.validate(faults, F.Topology(args.nodes, args.ranks_per_node), args.steps, args.mode)
    assert {F.Partition, F.LinkDown, F.Rst, F.Pause, F.Rate, F.Slow} <= kinds
    assert any("--neighbour-churn" in argv for argv in examples)


def test_spec_help_lists_every_kind() -> None:
    listed = {line.split(":", 1)[0] for line in F.SPEC_HELP}
    assert listed == set(F._PARSERS)

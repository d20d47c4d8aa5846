"""The fault zoo: a lab job and a fault drawn at random from a wide space,
each draw replayed exactly by its seed (``stallwatch lab zoo --seed N``).

A draw is a job (2-6 nodes x 1-4 ranks, at most ``RANKS_PER_CPU`` ranks per
CPU of the machine; blocking, async or gpu mode; waiting threads that block
or spin; CUDA graphs or not; no neighbour, a neighbour churning TCP
connections, or a bulk stream outside the job), one fault of one mechanism
with a random size, direction, placement and onset, and the truth the
verdict is judged against: which host or rank is at fault, what kind of
verdict it calls for, and which hosts and ranks a verdict may name at all.

Mechanisms (``MECHANISMS``), each built with the kernel's own tools
(``lab.faults``): the network ones on one node's link (loss 1-20% either
or both ways, a one-way cut, a partition, flaps of 0.5-10 s, link down, an
MTU blackhole at a random size, SYN drops, rate caps of 2-200 Mbit/s
either or both ways, a congested link (a cap and a bulk stream that is not
the job's), resets, corruption); the compute ones on one rank (10-500 ms
slower, a CPU hog, a cgroup CPU quota, stopped for 1-30 s); the ones that
stop the job (hang, crash, desync; a device that is slower or stops, in
gpu mode); and healthy draws with benign noise (checkpoint pauses, a
neighbour, every link capped alike, the whole job stopped briefly).

Onset: ``early`` (steps 25-40: in effect from the start, with enough steps
before it that the draw itself shows whether the fault slowed the job) or
``mid`` (steps 150-600).  Whether the job was affected is measured on the
run (``affected``): it stood still (for good, or for ``STOOD_STILL_S`` and
more, then went on), or its median step after the onset was both
``SLOWED_FACTOR`` times its median before and above nine in ten of its
steps before (a shared machine's steps vary by half and more).  A fault that affected
nothing expects its culprit or a verdict naming nobody, never another host.

This module only draws and describes; ``stallwatch lab zoo`` runs a draw
(``lab.runner``) and writes the truth beside the dumps, and ``python -m
bench.zoo`` runs many and judges the analyzer's verdicts against them.
"""

from __future__ import annotations

import enum
import json
import math
import os
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from stallwatch.dumpers.errors import UsageError
from stallwatch.lab import faults as F
from stallwatch.lab import runner

RANKS_PER_CPU = 4  # the lab's job on a shared machine: ranks per CPU at most
HEALTHY_SHARE = 0.22  # of the draws
# a job whose median step after the onset is this many times its median
# before, and above the 90th percentile of its steps before, was affected
# (below it, a fault that slowed nothing: its culprit or nobody may be named)
SLOWED_FACTOR = 1.25
BEFORE_QUANTILE = 0.9
# a step this long after the onset: the job stood still that long and came
# back (a flap, a stopped rank); DESIGN's floor of the stall bound
STOOD_STILL_S = 5.0
# the lab's patience with a job no rank moves in (the agents run as deployed:
# each communicator's own stall bound, 5 s at least): a 10 s flap recovers within
STALL_TIMEOUT_S = 20.0
RUN_AFTER_FAULT_S = 40.0  # how long a job that goes on runs after its fault's step
DEADLINE_S = 3600.0


class Expect(enum.Enum):
    """The verdict a draw calls for, by family."""

    NETWORK = "network"  # network_partition or network_straggler, naming the host
    COMPUTE = "compute"  # compute_straggler or cpu_interference, naming the rank
    HANG = "hang"  # missing_rank naming the rank
    EXIT = "exit"  # rank_exited naming the rank
    DESYNC = "desync"  # desync naming the rank
    HEALTHY = "healthy"  # no verdict names anyone


# the verdict kinds each family accepts as right, and the kinds that name a culprit
KINDS: Mapping[Expect, frozenset[str]] = {
    Expect.NETWORK: frozenset({"network_partition", "network_straggler"}),
    Expect.COMPUTE: frozenset({"compute_straggler", "cpu_interference"}),
    Expect.HANG: frozenset({"missing_rank"}),
    Expect.EXIT: frozenset({"rank_exited"}),
    Expect.DESYNC: frozenset({"desync"}),
    Expect.HEALTHY: frozenset({"healthy", "slowdown"}),
}
NAMING_KINDS = frozenset().union(*(KINDS[e] for e in Expect if e is not Expect.HEALTHY))

NETWORK = ("loss", "cut", "partition", "flap", "linkdown", "mtu", "syn", "rate", "congest",
           "rst", "corrupt")  # fmt: skip
COMPUTE = ("slow", "cpuhog", "throttle", "stop", "gpuslow")
STOPPING = ("hang", "crash", "desync", "gpuhang")
MECHANISMS = (*NETWORK, *COMPUTE, *STOPPING, "healthy")
GPU_ONLY = ("gpuslow", "gpuhang")
# faults after which the job stands still for good: the agents' stall dumps judge them
# (an MTU blackhole too: the job's segments are full-sized, at the interface's MTU)
STALLS = ("cut", "partition", "linkdown", "mtu", "rst", "hang", "crash", "desync", "gpuhang")


@dataclass(frozen=True, slots=True)
class Space:
    """Where draws come from: every mechanism, shape, wait and neighbour by
    default; narrowed to study one part (a seed replays only within the same
    space, which ``stallwatch lab zoo`` and ``bench.zoo`` print with it)."""

    mechanisms: tuple[str, ...] = ()
    shapes: tuple[tuple[int, int], ...] = ()
    waits: tuple[str, ...] = ()
    neighbours: tuple[str, ...] = ()

    def args(self) -> list[str]:
        """The command-line options that give this space."""
        out = []
        for flag, values in (
            ("--mechanisms", self.mechanisms),
            ("--shapes", tuple(f"{n}x{r}" for n, r in self.shapes)),
            ("--waits", self.waits),
            ("--neighbours", self.neighbours),
        ):
            out += [flag, ",".join(values)] if values else []
        return out

    @classmethod
    def parse(cls, mechanisms: str = "", shapes: str = "", waits: str = "",
              neighbours: str = "") -> Space:  # fmt: skip
        def items(text: str, allowed: Sequence[str], what: str) -> tuple[str, ...]:
            got = tuple(x.strip() for x in text.split(",") if x.strip())
            bad = [x for x in got if x not in allowed]
            if bad:
                raise UsageError(f"unknown {what} {', '.join(bad)} (one of {', '.join(allowed)})")
            return got

        dims = []
        for text in (x.strip() for x in shapes.split(",") if x.strip()):
            n, sep, r = text.partition("x")
            if not (sep and n.isdigit() and r.isdigit() and int(n) >= 2 and int(r) >= 1):
                raise UsageError(f"bad shape {text!r}: NODESxRANKS, e.g. 3x2 (2 nodes at least)")
            dims.append((int(n), int(r)))
        return cls(
            items(mechanisms, MECHANISMS, "mechanism"),
            tuple(dims),
            items(waits, ("block", "spin"), "wait"),
            items(neighbours, ("none", "churn", "bulk"), "neighbour"),
        )


@dataclass(frozen=True, slots=True)
class ZooJob:
    nodes: int
    ranks_per_node: int
    mode: str  # blocking, async, gpu
    wait: str  # block, spin
    graphs: bool
    neighbour: str  # none, churn, bulk
    churn: int  # the churning neighbour's connections a second
    elements: int  # float32 elements of the step's gradient AllReduce
    steps: int
    duration: float | None  # lab run --duration: the job ends that long after the fault
    dump_at_end: bool

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def shape(self) -> str:
        return f"{self.nodes}x{self.ranks_per_node}"


@dataclass(frozen=True, slots=True)
class Truth:
    mechanism: str
    expect: Expect
    culprit_host: str | None  # the faulted node (a rank fault: the rank's node)
    culprit_rank: int | None  # rank faults
    hosts: tuple[str, ...]  # the hosts a verdict may name
    ranks: tuple[int, ...]  # the ranks a verdict may name
    onset: str  # early, mid
    step: int | None  # the fault's step
    what: str  # for people

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["expect"] = self.expect.value
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Truth:
        return cls(
            mechanism=str(raw["mechanism"]),
            expect=Expect(raw["expect"]),
            culprit_host=raw.get("culprit_host"),
            culprit_rank=raw.get("culprit_rank"),
            hosts=tuple(raw.get("hosts") or ()),
            ranks=tuple(raw.get("ranks") or ()),
            onset=str(raw.get("onset", "")),
            step=raw.get("step"),
            what=str(raw.get("what", "")),
        )


@dataclass(frozen=True, slots=True)
class Draw:
    seed: int
    job: ZooJob
    faults: tuple[str, ...]
    truth: Truth
    noise: tuple[str, ...] = field(default_factory=tuple)  # benign extras (pauses, neighbours)
    space: Space = field(default_factory=lambda: Space())

    def lab_argv(self, dump_dir: str) -> list[str]:
        """The ``stallwatch lab run`` arguments that replay this draw."""
        j = self.job
        argv = ["--nodes", str(j.nodes), "--ranks-per-node", str(j.ranks_per_node)]
        argv += ["--steps", str(j.steps), "--mode", j.mode, "--wait", j.wait]
        argv += ["--elements", str(j.elements), "--stall-timeout", f"{STALL_TIMEOUT_S:g}"]
        argv += ["--timeout", f"{DEADLINE_S:g}"]
        argv += ["--graphs"] if j.graphs else []
        argv += ["--neighbour-churn", str(j.churn)] if j.neighbour == "churn" else []
        argv += ["--duration", f"{j.duration:g}"] if j.duration is not None else []
        argv += ["--record", "--agent-defaults", "--dump-dir", dump_dir]
        argv += ["--dump-at-end"] if j.dump_at_end else []
        for spec in (*self.faults, *self.noise):
            argv += ["--fault", spec]
        return argv

    def to_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "space": self.space.args(),
            "job": asdict(self.job),
            "faults": list(self.faults),
            "noise": list(self.noise),
            "truth": self.truth.to_json(),
        }


def node_name(node: int) -> str:
    return f"node{node}"


def _log_uniform(rnd: random.Random, low: float, high: float) -> float:
    return math.exp(rnd.uniform(math.log(low), math.log(high)))


def _shape(rnd: random.Random, cpus: int, mechanism: str, space: Space) -> tuple[int, int]:
    most = max(2, RANKS_PER_CPU * cpus)
    shapes = [(n, r) for n in range(2, 7) for r in range(1, 5) if n * r <= most]
    if space.shapes:
        shapes = list(space.shapes)
    if mechanism in ("cpuhog", "throttle"):  # a CPU of its own for the hogged rank
        shapes = [(n, r) for n, r in shapes if n * r > 1] or shapes
    return rnd.choice(shapes)


def _mode(rnd: random.Random, mechanism: str) -> tuple[str, bool]:
    if mechanism in GPU_ONLY:
        return "gpu", rnd.random() < 0.5
    mode = rnd.choices(("blocking", "async", "gpu"), weights=(2, 1, 1))[0]
    return mode, mode == "gpu" and rnd.random() < 0.5


def _onset(rnd: random.Random, mechanism: str) -> tuple[str, int]:
    if mechanism in STALLS:  # judged by the stall: a short history before it will do
        return "mid", rnd.randint(30, 200)
    if rnd.random() < 0.3:
        return "early", rnd.randint(25, 40)
    return "mid", rnd.randint(150, 600)


def draw(seed: int, cpus: int | None = None, space: Space | None = None) -> Draw:
    """The draw of ``seed`` on a machine with ``cpus`` CPUs (default: this
    one's), in ``space`` (default: everything)."""
    rnd = random.Random(seed)
    cpus = cpus or os.cpu_count() or 1
    space = space or Space()
    if space.mechanisms:
        mechanism = rnd.choice(space.mechanisms)
    else:
        healthy = rnd.random() < HEALTHY_SHARE
        mechanism = "healthy" if healthy else rnd.choice(MECHANISMS[:-1])
    nodes, rpn = _shape(rnd, cpus, mechanism, space)
    mode, graphs = _mode(rnd, mechanism)
    wait = rnd.choice(space.waits or ("block", "spin"))
    neighbour = (
        rnd.choice(space.neighbours)
        if space.neighbours
        else rnd.choices(("none", "churn", "bulk"), weights=(2, 1, 1))[0]
    )
    churn = rnd.choice((200, 500, 1000, 2000)) if neighbour == "churn" else 0
    elements = int(_log_uniform(rnd, 16_384, 262_144))
    onset, step = _onset(rnd, mechanism)
    spec, truth = _fault(rnd, mechanism, nodes, rpn, onset, step)
    noise = _noise(rnd, mechanism, nodes, neighbour, spec)
    stalls = mechanism in STALLS
    job = ZooJob(
        nodes=nodes,
        ranks_per_node=rpn,
        mode=mode,
        wait=wait,
        graphs=graphs,
        neighbour=neighbour,
        churn=churn,
        elements=elements,
        steps=step + 400 if stalls else 100_000,
        duration=None if stalls else RUN_AFTER_FAULT_S,
        dump_at_end=not stalls,
    )
    return Draw(seed, job, tuple(spec), truth, tuple(noise), space)


def _noise(
    rnd: random.Random, mechanism: str, nodes: int, neighbour: str, spec: Sequence[str]
) -> list[str]:
    out = []
    if neighbour == "bulk" and not any(s.startswith("bulk:") for s in spec):
        src = rnd.randrange(nodes)
        out.append(f"bulk:node={src},mbit={rnd.choice((5, 10, 20, 40))}")
    if mechanism != "healthy" and rnd.random() < 0.2:  # a checkpoint now and then
        out.append(f"pause:every={rnd.randint(100, 300)},ms={rnd.randint(300, 1500)}")
    return out


def _fault(
    rnd: random.Random, mechanism: str, nodes: int, rpn: int, onset: str, step: int
) -> tuple[list[str], Truth]:
    if mechanism == "healthy":
        return _healthy(rnd, nodes, step)
    if mechanism in NETWORK:
        return _network(rnd, mechanism, nodes, rpn, onset, step)
    return _rank(rnd, mechanism, nodes, rpn, onset, step)


def _ranks_of(node: int, rpn: int) -> tuple[int, ...]:
    return tuple(range(node * rpn, node * rpn + rpn))


def _network(
    rnd: random.Random, mechanism: str, nodes: int, rpn: int, onset: str, step: int
) -> tuple[list[str], Truth]:
    node = rnd.randrange(nodes)
    way = rnd.choice(("both", "in", "out"))
    at = f",step={step}"
    wayopt = "" if way == "both" else f",dir={way}"
    name = node_name(node)
    spec: list[str]
    if mechanism == "loss":
        pct = rnd.randint(1, 20)
        spec, what = [f"loss:node={node},pct={pct}{at}{wayopt}"], f"{name} loses {pct}% ({way})"
    elif mechanism == "cut":
        way = rnd.choice(("in", "out"))
        spec, what = [f"partition:node={node}{at},dir={way}"], f"{name} cut off one way ({way})"
    elif mechanism == "partition":
        spec, what = [f"partition:node={node}{at}"], f"{name} cut off"
    elif mechanism == "flap":
        ms = round(_log_uniform(rnd, 500, 10_000))
        spec, what = [f"partition:node={node}{at},ms={ms}"], f"{name} cut off for {ms} ms"
    elif mechanism == "linkdown":
        spec, what = [f"linkdown:node={node}{at}"], f"{name}'s link down"
    elif mechanism == "mtu":
        size = rnd.randint(576, 1400)
        spec, what = [f"mtu:node={node},bytes={size}{at}"], f"{name} drops packets over {size} B"
    elif mechanism == "syn":
        spec, what = [f"syn:node={node}{at}"], f"{name} drops TCP SYNs"
    elif mechanism == "rate":
        mbit = round(_log_uniform(rnd, 2, 200), 1)
        spec = [f"rate:node={node},mbit={mbit:g}{at}{wayopt}"]
        what = f"{name} capped at {mbit:g} Mbit/s ({way})"
    elif mechanism == "congest":
        mbit = round(_log_uniform(rnd, 5, 100), 1)
        load = round(mbit * rnd.uniform(1.0, 2.0), 1)
        spec = [f"rate:node={node},mbit={mbit:g}{at}", f"bulk:node={node},mbit={load:g}{at}"]
        what = f"{name} capped at {mbit:g} Mbit/s under {load:g} Mbit/s not the job's"
    elif mechanism == "rst":
        spec, what = [f"rst:node={node}{at}"], f"{name}'s connections reset"
    else:  # corrupt
        pct = rnd.randint(1, 20)
        spec, what = [f"corrupt:node={node},pct={pct}{at}"], f"{name} corrupts {pct}%"
    # two nodes: nothing but the probes' direction can tell the host from its peer
    hosts = (name,) if nodes > 2 else tuple(node_name(k) for k in range(nodes))
    ranks = tuple(r for h in hosts for r in _ranks_of(int(h[4:]), rpn))
    truth = Truth(mechanism, Expect.NETWORK, name, None, hosts, ranks, onset, step,
                  f"{what} from step {step}")  # fmt: skip
    return spec, truth


_RANK_EXPECT = {
    "slow": Expect.COMPUTE,
    "cpuhog": Expect.COMPUTE,
    "throttle": Expect.COMPUTE,
    "stop": Expect.COMPUTE,
    "gpuslow": Expect.COMPUTE,
    "hang": Expect.HANG,
    "gpuhang": Expect.HANG,
    "crash": Expect.EXIT,
    "desync": Expect.DESYNC,
}


def _rank(
    rnd: random.Random, mechanism: str, nodes: int, rpn: int, onset: str, step: int
) -> tuple[list[str], Truth]:
    rank = rnd.randrange(nodes * rpn)
    at = f",step={step}"
    if mechanism == "slow":
        ms = round(_log_uniform(rnd, 10, 500))
        spec, what = f"slow:rank={rank},ms={ms}{at}", f"rank {rank} {ms} ms slower a step"
    elif mechanism == "gpuslow":
        ms = round(_log_uniform(rnd, 10, 500))
        spec, what = f"gpuslow:rank={rank},ms={ms}{at}", f"rank {rank}'s device {ms} ms slower"
    elif mechanism == "cpuhog":
        spec, what = f"cpuhog:rank={rank}{at}", f"rank {rank}'s CPU hogged"
    elif mechanism == "throttle":
        pct = rnd.randint(5, 50)
        spec, what = f"throttle:rank={rank},pct={pct}{at}", f"rank {rank} capped at {pct}% CPU"
    elif mechanism == "stop":
        ms = round(_log_uniform(rnd, 1000, 30_000))
        spec, what = f"stop:rank={rank}{at},ms={ms}", f"rank {rank} stopped for {ms} ms"
    elif mechanism == "hang":
        spec, what = f"hang:rank={rank}{at}", f"rank {rank} hangs"
    elif mechanism == "gpuhang":
        spec, what = f"gpuhang:rank={rank}{at}", f"rank {rank}'s device stops"
    elif mechanism == "crash":
        sig = rnd.choice(("", "KILL", "SEGV", "ABRT"))
        spec = f"crash:rank={rank}{at}" + (f",signal={sig}" if sig else "")
        what = f"rank {rank} crashes" + (f" (SIG{sig})" if sig else " (exit code 3)")
    else:  # desync
        which = rnd.choice(("count", "dtype", "op"))
        spec, what = (
            f"mismatch:rank={rank}{at},field={which}",
            f"rank {rank} passes another {which}",
        )
    host = node_name(rank // rpn)
    truth = Truth(mechanism, _RANK_EXPECT[mechanism], host, rank, (host,), (rank,), onset, step,
                  f"{what} from step {step}")  # fmt: skip
    return [spec], truth


def _healthy(rnd: random.Random, nodes: int, step: int) -> tuple[list[str], Truth]:
    kind = rnd.choice(("quiet", "checkpoints", "capped", "stopped"))
    if kind == "checkpoints":
        every, ms = rnd.randint(50, 200), rnd.randint(500, 3000)
        spec, what = [f"pause:every={every},ms={ms}"], f"every rank pauses {ms} ms every {every}"
    elif kind == "capped":
        mbit = round(_log_uniform(rnd, 20, 500), 1)
        spec = [f"rate:node={k},mbit={mbit:g}" for k in range(nodes)]
        what = f"every link capped alike at {mbit:g} Mbit/s"
    elif kind == "stopped":
        ms = round(_log_uniform(rnd, 500, 4000))
        spec, what = [f"stop:rank=all,step={step},ms={ms}"], f"the whole job stopped {ms} ms"
    else:
        spec, what = [], "nothing but the neighbours"
    truth = Truth("healthy", Expect.HEALTHY, None, None, (), (), "mid", None, what)
    return spec, truth


# --- what the run shows -------------------------------------------------------------


def job_step_ms(ranks: Sequence[Mapping[str, Any]]) -> list[float]:
    """Each step's duration for the job: the median over its ranks (a
    synchronous job's ranks take each step together)."""
    series = [r.get("step_ms") or [] for r in ranks]
    length = min((len(s) for s in series), default=0)
    return [statistics.median(s[k] for s in series) for k in range(length)]


@dataclass(frozen=True, slots=True)
class Affect:
    stalled: bool  # the lab gave up: no rank moved for its patience
    factor: float | None  # median step after the onset over the median before
    above_before: bool  # the median after is above BEFORE_QUANTILE of the steps before
    longest_s: float | None  # the longest step after the onset

    @property
    def affected(self) -> bool:
        slowed = self.factor is not None and self.factor >= SLOWED_FACTOR and self.above_before
        stood = self.longest_s is not None and self.longest_s >= STOOD_STILL_S
        return self.stalled or slowed or stood

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "affected": self.affected}


def affected(truth: Truth, result: Mapping[str, Any]) -> Affect:
    """Whether the run shows the fault affected the job (``lab run --json``)."""
    gave_up = result.get("gave_up") or ""
    stalled = "no rank made progress" in gave_up
    steps = job_step_ms(result.get("ranks") or [])
    onset = truth.step if truth.step is not None else 0
    before = steps[max(3, onset - 100) : onset]
    after = steps[onset + 2 :]
    factor, above = None, False
    if before and after:
        late = statistics.median(after)
        factor = round(late / max(statistics.median(before), 1e-3), 3)
        above = late > sorted(before)[min(len(before) - 1, int(BEFORE_QUANTILE * len(before)))]
    longest = round(max(steps[onset:]) / 1000, 3) if steps[onset:] else None
    return Affect(stalled, factor, above, longest)


def accepted_kinds(truth: Truth) -> frozenset[str]:
    """The verdict kinds that are right for this draw's fault."""
    kinds = KINDS[truth.expect]
    if truth.mechanism == "stop":  # stopped past the stall bound, it is missing from the collective
        kinds = kinds | KINDS[Expect.HANG]
    return kinds


def config(d: Draw, dump_dir: Path) -> runner.RunConfig:
    """The lab run of a draw."""
    j = d.job
    return runner.RunConfig(
        nodes=j.nodes,
        ranks_per_node=j.ranks_per_node,
        steps=j.steps,
        mode=j.mode,
        graphs=j.graphs,
        faults=F.parse_faults((*d.faults, *d.noise)),
        record=True,
        agent_defaults=True,  # the agents as deployed: each communicator's own stall bound
        dump_dir=dump_dir,
        dump_at_end=j.dump_at_end,
        stall_timeout=STALL_TIMEOUT_S,
        # the job's pace is the machine's (a shared one runs it ten times
        # slower): it ends by its duration or its stall, never by a deadline
        timeout=DEADLINE_S,
        duration=j.duration,
        elements=j.elements,
        wait=j.wait,
        neighbour_churn=j.churn,
    )


def run_draw(d: Draw, out: Path, progress_out: TextIO | None = None) -> dict[str, Any]:
    """Runs the draw's job with its agents into ``out/dumps`` and writes
    ``out/draw.json``: the draw, its truth, the lab's result and whether the
    fault affected the job."""
    out.mkdir(parents=True, exist_ok=True)
    result = runner.run(config(d, out / "dumps"), progress_out=progress_out)
    lab = json.loads(result.to_json())
    record = {
        **d.to_json(),
        "lab": lab,
        "affect": affected(d.truth, lab).to_json(),
        "command": ["stallwatch", "lab", "run", *d.lab_argv(str(out / "dumps"))],
    }
    (out / "draw.json").write_text(json.dumps(record, indent=1, sort_keys=True))
    return record

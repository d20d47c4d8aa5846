"""``stallwatch lab run``: set up the nodes, run the job, wait, report, tear down.

One run:
1. checks (faults against the topology, root, tools, the library), and removes
   what dead runs left behind;
2. makes the nodes (``lab.netns``), and with ``--record`` starts one agent
   per node inside its namespace (``stallwatch record --scope netns``,
   listening on the node's address with a token and mutual TLS, certificates
   made for the run by ``lab.certs``) and waits for its ``/healthz``; with
   ``--agent-scope host``, one agent for the whole machine instead (``record
   --scope host --job <run id>``: every node's ranks in one dump, other jobs
   on the machine left out), in the switch's namespace (the run's own, so its
   port is free), listening on the switch's own address there.  A run with
   agents gives the host's shell a seat on the switch (``netns``), and once
   the agents answer, writes what a client needs into ``<run dir>/client``
   (``agents.txt``, ``token``, ``ca.pem``, ``client.pem``, ``client.key``:
   the folder docs/runbook.md asks an operator to have at hand) and prints
   the commands that reach them from that shell (``lab.narrate``);
3. applies the faults that act from the start (link faults, CPU hogs:
   ``lab.injector``), starts the neighbour (``--neighbour-churn``:
   ``lab.neighbour``), then one ``python -m stallwatch.commands.labrank`` per
   rank inside its node; the injector's thread fires the faults that act from
   a step, and ends flaps;
4. waits: the job ends, or no rank makes progress for ``--stall-timeout``
   seconds (progress is read from the ranks' reports), or ``--timeout`` passes;
   a recorded job that fails is given time for every agent to write its dump;
   with ``--dump-at-end`` a job that finished has every agent asked for one
   (``POST /dump``, one incident ``lab-<run id>-end``);
   a job that stopped progressing can be looked at as someone arriving late
   would: ``--snapshot-when-stuck`` runs ``stallwatch snapshot`` in every node
   (dumps of thread positions, no recording); ``--late-agents`` starts the
   agents only then and asks each for a snapshot (``POST /snapshot``, one
   incident ``lab-<run id>-snapshot``);
5. stops the neighbour (after the dumps), reads what each fault did
   (``lab.faultlog``: when it began and ended, at which step), and
   tears everything down, always (``finally``, SIGINT, SIGTERM, ``atexit``):
   ranks, hogs and agents are killed, namespaces (and with them links,
   nftables tables and qdiscs) deleted, the run directory removed.

The lab never imports the recorder: agents are separate processes, as on a
real cluster.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import json
import math
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from stallwatch.dumpers.errors import AgentError, DumpError, LabError
from stallwatch.lab import bulk, job, netns
from stallwatch.lab import faults as F
from stallwatch.lab.certs import LabCerts, make_certs
from stallwatch.lab.chaos import Chaos, post_query
from stallwatch.lab.churn import CHURN_PORT
from stallwatch.lab.faultlog import Episode, FaultRecord, Moment, wall_offset_ns
from stallwatch.lab.injector import Injector, runner_faults
from stallwatch.lab.logs import last_line
from stallwatch.lab.narrate import HOLD_S, STUCK_S, Narrator, command_text, program, wrapped
from stallwatch.lab.neighbour import ChurnOutcome, Neighbour
from stallwatch.lab.procfaults import RankActs
from stallwatch.lab.supervise import Service, Supervisor
from stallwatch.query.agentclient import AgentClient

AGENT_PORT = 9400
HOST_SCOPE, NETNS_SCOPE = "host", "netns"
AGENT_SCOPES = (NETNS_SCOPE, HOST_SCOPE)
HOST_AGENT_IP = "127.0.0.1"  # the host agent, where the switch has no address of its own
AGENT_START_TIMEOUT = 90.0
DUMP_GRACE = 20.0  # after the job is given up: time for agents to dump
# `stallwatch record`'s own --stall-timeout (its agents run as processes: the
# lab imports nothing of theirs; a test holds the two equal)
AGENT_CEILING_S = 60.0
HOGS_PER_RANK = 2
HOG_CODE = (  # the comment names the run, so leftovers can be found
    "# {run_dir}\nimport os\nos.sched_setaffinity(0, {{{cpu}}})\nos.nice({nice})\n"
    "while True:\n    pass\n"
)
HOG_NICE = -10  # a waking rank would otherwise run at once on sleeper credit
AGENT_STOP_GRACE = 30.0  # detaching uprobes from a library takes the agent seconds
PINNED_DUMP_TIMEOUT = 120.0  # dump --pinned: no BCC, but the dump's own reading
CHAOS_GRACE = 90.0  # with agent faults: time for restarted agents to come back
POLL = 0.1
# Each node's agent runs as its systemd unit would (deploy/systemd): bounded
# memory, the notify protocol and its watchdog, restarted on failure.  The
# lab's nodes share the machine's CPUs, so no CPU quota here.
AGENT_SERVICE = Service(
    memory_max=1 << 30,
    cpu_quota_pct=None,
    watchdog_s=30.0,
    restart_s=1.0,
    start_timeout_s=AGENT_START_TIMEOUT,
    stop_timeout_s=AGENT_STOP_GRACE,
)


@dataclass(frozen=True, slots=True)
class RunConfig:
    nodes: int = 2
    ranks_per_node: int = 2
    steps: int = 20
    mode: str = "blocking"
    graphs: bool = False  # gpu mode: each step's collectives one CUDA graph launch
    faults: tuple[F.Fault, ...] = ()
    record: bool = False
    dump_dir: Path = Path("dumps")
    dump_at_end: bool = False  # with record: every agent dumps once the ranks finished
    stall_timeout: float = 10.0
    # with record: the agents run with record's defaults, as deployed (no
    # --stall-timeout: each communicator's own bound, 60 s the ceiling);
    # stall_timeout is then only how long the lab waits for a rank to move.
    # Otherwise every call's bound is stall_timeout (floor and ceiling)
    agent_defaults: bool = False
    # None: no deadline but with --duration (the stall timeout still gives up)
    timeout: float | None = None
    # the job ends this long after it reached the latest step a fault names
    # (after its first step, if none names one): every rank at the same step,
    # a few steps after the fastest one then; None: after --steps
    duration: float | None = None
    elements: int = job.DEFAULT_ELEMENTS
    compute_ms: float = job.DEFAULT_COMPUTE_MS
    run_id: str | None = None
    lib: Path | None = None
    snapshot_when_stuck: bool = False  # stallwatch snapshot in every node once stuck
    late_agents: bool = False  # with record: agents start once the job is stuck
    # how waiting host threads wait: "block" (in poll(2), asleep) or "spin"
    # (runnable throughout, as CUDA's spin sync and NCCL's busy polling)
    wait: str = "block"
    # with record: "netns", one agent per node in its namespace; "host", one
    # agent for the machine (every node's ranks), known to agent faults as node 0
    agent_scope: str = "netns"
    # a TCP neighbour outside the job: this many connections a second in
    # total between the nodes, from before the job starts (0: none)
    neighbour_churn: int = 0
    # with record: where a client's files (agents.txt, token, certificates)
    # go, kept after the run; None: <run dir>/client, removed with the run
    client_dir: Path | None = None

    @property
    def topology(self) -> F.Topology:
        return F.Topology(self.nodes, self.ranks_per_node)

    @property
    def deadline_s(self) -> float | None:
        """When the lab gives up in any case: ``--timeout``; with
        ``--duration``, the end's last steps however slow the job is then;
        else never (a job that stops moving is given up on its own)."""
        if self.timeout is not None:
            return self.timeout
        if self.duration is not None:
            return 60.0 + 1.5 * self.duration
        return None


@dataclass(frozen=True, slots=True)
class RankOutcome:
    world_rank: int
    node: int
    local_rank: int
    pid: int | None
    steps_done: int
    status: str
    exit_code: int | None
    exit_signal: str | None
    killed_by_lab: bool
    stuck: bool
    verified: bool
    verified_ok: int
    verified_failed: int
    error: str | None
    calls: dict[str, dict[str, int]]
    comms: dict[str, dict[str, Any]]
    step_ms: list[float]
    step_start_ns: list[int]  # CLOCK_MONOTONIC, comparable across ranks
    cpu_s: float
    wall_s: float
    run_delay_ms: float
    compute_cpu_share: float
    device_log: list[dict[str, Any]]  # gpu mode: each collective's return and completion seen
    events: list[dict[str, Any]]  # its in-rank faults as they fired (RankReport.events)

    @property
    def healthy(self) -> bool:
        """Every step done and verified, and it exited cleanly, or was still
        exiting when the lab ended the run (its work was done)."""
        if self.status == STATUS_EXITING:
            return self.verified
        return (
            self.status == job.STATUS_DONE
            and self.verified
            and (self.exit_code == 0 or self.killed_by_lab)
        )


@dataclass(frozen=True, slots=True)
class NodeOutcome:
    """One node's kernel TCP counters at the end (read inside its namespace)."""

    index: int
    netns: str
    ip: str
    tcp_out_segs: int
    tcp_retrans_segs: int
    tcp: dict[str, int]  # the whole Tcp: line of /proc/net/snmp (EstabResets, ActiveOpens, ...)


@dataclass(frozen=True, slots=True)
class RunResult:
    run_id: str
    nodes: int
    ranks_per_node: int
    steps: int
    mode: str
    faults: list[FaultRecord]  # in the order given, each with when it began and ended
    ranks: list[RankOutcome]
    nodes_seen: list[NodeOutcome]
    duration_s: float
    gave_up: str | None  # why the lab stopped waiting, None if the job ended
    recorded: bool
    dump_dir: str | None
    dumps: list[str]
    problems: list[str] = field(default_factory=list)  # teardown trouble
    # per node, what its agent's supervisor saw (starts, exits, restarts; at_ns
    # is CLOCK_MONOTONIC, the clock of the recorded rows) and the agent faults
    # applied to it
    agents: list[dict[str, Any]] = field(default_factory=list)
    neighbour_churn: ChurnOutcome | None = None

    @property
    def ok(self) -> bool:
        return self.gave_up is None and all(r.healthy for r in self.ranks)

    @property
    def stuck_ranks(self) -> list[int]:
        return [r.world_rank for r in self.ranks if r.stuck]

    def to_json(self) -> str:
        data = asdict(self)
        data["ok"] = self.ok
        data["stuck_ranks"] = self.stuck_ranks
        return json.dumps(data, indent=2, sort_keys=True)


# --- preflight --------------------------------------------------------------


def _euid() -> int:
    return os.geteuid()


def preflight(cfg: RunConfig) -> Path:
    """Everything that can be refused before anything is made; returns the library."""
    if cfg.nodes < 1 or cfg.ranks_per_node < 1 or cfg.steps < 1:
        raise LabError("--nodes, --ranks-per-node and --steps must be at least 1")
    if cfg.neighbour_churn < 0:
        raise LabError(f"--neighbour-churn {cfg.neighbour_churn}: must be at least 0")
    F.validate(cfg.faults, cfg.topology, cfg.steps, cfg.mode)
    agent_faults = [
        F.format_fault(f)
        for f in cfg.faults
        if isinstance(f, F.AgentFault) or (isinstance(f, F.Hang) and f.agents_ready)
    ]
    if agent_faults and not cfg.record:
        raise LabError(f"fault {agent_faults[0]!r} needs --record (an agent per node)")
    check_agent_scope(cfg)
    if _euid() != 0:
        raise LabError("lab run needs root (it makes network namespaces): run it with sudo")
    netns.check_tools()
    if cfg.run_id is not None:
        netns.check_run_id(cfg.run_id)
    return library(cfg.lib)


def check_agent_scope(cfg: RunConfig) -> None:
    """A host-scope run has one agent, node 0's in agent faults: a fault
    naming another node's agent names none."""
    if cfg.agent_scope not in AGENT_SCOPES:
        raise LabError(f"--agent-scope {cfg.agent_scope!r}: one of {', '.join(AGENT_SCOPES)}")
    if cfg.agent_scope != HOST_SCOPE:
        return
    for f in cfg.faults:
        if isinstance(f, F.AgentFault) and f.node != 0:
            raise LabError(
                f"fault {F.format_fault(f)!r}: --agent-scope host runs one agent for every "
                "node, named node=0 in agent faults"
            )


def library(explicit: Path | None) -> Path:
    path = explicit or (Path(os.environ[job.LIB_ENV]) if os.environ.get(job.LIB_ENV) else None)
    if path is None:
        from stallwatch.lab.build import ensure_built

        path = ensure_built()
    if not path.is_file():
        raise LabError(f"the lab's NCCL library {path} does not exist")
    return path.resolve()


def cudart_of(lib: Path) -> Path:
    """The lab's CUDA runtime beside its libnccl (gpu mode)."""
    return lib.parent / job.CUDART_NAME


# --- the processes ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AgentSite:
    """Where one agent runs: its key (its node; the host agent's is 0), the
    network namespace it runs and listens in, its address there, and its
    name (host name, dump folder, log)."""

    index: int
    netns: str
    ip: str
    name: str
    who: str  # in messages: "node 1", "the host"

    def exec_prefix(self) -> list[str]:
        return ["nsenter", f"--net={netns.NETNS_DIR / self.netns}", "--"]


@dataclass(slots=True)
class JobWatch:
    """What the waiting loops last told of the job."""

    steps: tuple[int, ...] = ()
    moved_at: float = field(default_factory=time.monotonic)
    exited_at: float | None = None  # when a rank was first seen gone
    # per node: its ranks' steps, and when one of them last moved
    node_steps: dict[int, tuple[int, ...]] = field(default_factory=dict)
    node_moved_at: dict[int, float] = field(default_factory=dict)
    stuck: bool = False
    next_look: float = 0.0
    chaos_told: int = 0  # lines of the agent faults' log already told


@dataclass(slots=True)
class Lab:
    """What one run made; ``teardown`` removes all of it and may be called twice."""

    cfg: RunConfig
    lib: Path
    run_id: str
    run_dir: Path
    net: netns.Network | None = None
    ranks: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    from_ns: int | None = None  # CLOCK_MONOTONIC: --duration counts from here
    ended_at_step: int | None = None  # where --duration ended the job
    hogs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    agents: dict[int, Supervisor] = field(default_factory=dict)
    chaos: Chaos | None = None
    injector: Injector | None = None
    rank_acts: RankActs | None = None  # throttles and stops of the ranks' processes
    neighbour: Neighbour | None = None
    killed: set[int] = field(default_factory=set)
    logs: list[TextIO] = field(default_factory=list)
    token: str = ""  # the agents' bearer token
    certs: LabCerts | None = None  # the agents' TLS (made per run, mutual)
    switch_ip: str | None = None  # the switch's own address (a host agent listens there)
    narrator: Narrator = field(default_factory=lambda: Narrator(None))  # what the run says
    watch: JobWatch = field(default_factory=lambda: JobWatch())
    torn_down: bool = False

    def log_file(self, log: Path) -> TextIO:
        out = log.open("w")
        self.logs.append(out)
        return out

    def spawn(
        self,
        node: netns.Node | AgentSite,
        argv: list[str],
        log: Path,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        out = self.log_file(log)
        return subprocess.Popen(
            [*node.exec_prefix(), *argv],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=self.run_dir,
            env={**self.env(), **(env or {})},
            start_new_session=True,  # Ctrl-C reaches the runner only; it tears down
        )

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env[job.LIB_ENV] = str(self.lib)
        env["NCCL_SOCKET_IFNAME"] = netns.NODE_DEV
        env.setdefault("NCCL_DEBUG", "WARN")
        if self.cfg.mode == "async":
            env[job.ASYNC_ENV] = "1"
        else:
            env.pop(job.ASYNC_ENV, None)
        if self.cfg.wait == "spin":
            env[job.WAIT_ENV] = "spin"
        else:
            env.pop(job.WAIT_ENV, None)
        return env

    def node(self, index: int) -> netns.Node:
        assert self.net is not None
        return self.net.nodes[index]

    def sites(self) -> tuple[AgentSite, ...]:
        """Where the agents run: one per node, or the host's one."""
        assert self.net is not None
        if self.cfg.agent_scope == HOST_SCOPE:
            ip = self.switch_ip or HOST_AGENT_IP
            return (AgentSite(0, self.net.switch, ip, HOST_SCOPE, "the host"),)
        return tuple(
            AgentSite(n.index, n.netns, n.ip, f"node{n.index}", f"node {n.index}")
            for n in self.net.nodes
        )

    def site(self, index: int) -> AgentSite:
        return next(s for s in self.sites() if s.index == index)

    def teardown(self) -> list[str]:
        if self.torn_down:
            return []
        self.torn_down = True
        if self.injector is not None:
            self.injector.stop()  # before the links it acts on go
        problems = _stop_agents(self.agents)
        for proc in [*self.ranks.values(), *self.hogs]:
            _kill(proc)
        if self.rank_acts is not None:
            self.rank_acts.release()
        if self.neighbour is not None:
            self.neighbour.kill()
        if self.net is not None:
            problems += netns.destroy(self.net)
        for out in self.logs:
            out.close()
        for index in range(self.cfg.nodes):  # the agents' pinned recordings
            netns.remove_pins(agent_pin_dir(self.run_id, index))
        _remove_tree(self.run_dir)
        return problems


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def _stop_agents(agents: dict[int, Supervisor]) -> list[str]:
    for sup in agents.values():  # all at once: each may take seconds to stop
        sup.request_stop()
    problems = []
    deadline = time.monotonic() + AGENT_STOP_GRACE
    for node, sup in agents.items():
        if sup.wait_stopped(deadline - time.monotonic()) is not None:
            where = f" (it was in {sup.hung_in})" if sup.hung_in else ""
            problems.append(
                f"agent of node {node} ignored SIGTERM for {AGENT_STOP_GRACE:g} s{where}"
            )
    return problems


def _remove_tree(path: Path) -> None:
    if not path.is_dir():
        return
    for child in path.iterdir():
        if child.is_dir():
            _remove_tree(child)
        else:
            with contextlib.suppress(OSError):
                child.unlink()
    with contextlib.suppress(OSError):
        path.rmdir()


@contextlib.contextmanager
def signals_as_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP unwind like Ctrl-C, so ``finally`` tears down."""

    def raise_interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers; the caller owns signals then
        return
    saved = {s: signal.signal(s, raise_interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def signals_ignored() -> Iterator[None]:
    """A second Ctrl-C must not cut the teardown short."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    saved = {s: signal.signal(s, signal.SIG_IGN) for s in sigs}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


# --- setup ------------------------------------------------------------------


def make_lab(cfg: RunConfig, lib: Path, progress_out: TextIO | None = None) -> Lab:
    netns.cleanup_stale()
    run_id = cfg.run_id or netns.new_run_id()
    if any(netns.run_of(ns) == run_id for ns in netns.list_netns()):
        raise LabError(f"run id {run_id!r} is in use (namespaces {netns.PREFIX}{run_id}-* exist)")
    run_dir = netns.RUNS_DIR / run_id
    run_dir.mkdir(parents=True, exist_ok=False)
    (run_dir / "runner.pid").write_text(str(os.getpid()))
    return Lab(cfg, lib, run_id, run_dir, narrator=Narrator(progress_out))


def set_up(lab: Lab) -> None:
    say = lab.narrator.say
    say(f"lab run {lab.run_id}: setting up {lab.cfg.nodes} node(s)")
    lab.net = netns.create(lab.run_id, lab.cfg.nodes, host_port=lab.cfg.record)
    if lab.cfg.record and lab.cfg.agent_scope == HOST_SCOPE:
        lab.switch_ip = netns.address_switch(lab.net)
    lab.rank_acts = RankActs(lab.run_id, lab.ranks)
    lab.injector = Injector(
        net=lab.net,
        faults=runner_faults(lab.cfg.faults),
        run_dir=lab.run_dir,
        start_hog=lambda fault: start_hog(lab, fault),
        keep_ports=(AGENT_PORT, CHURN_PORT, bulk.BULK_PORT),
        start_bulk=lambda fault: start_bulk(lab, fault),
        on_ranks=lab.rank_acts,
    )
    if lab.cfg.record:
        lab.chaos = make_chaos(lab)
    if lab.cfg.record and not lab.cfg.late_agents:
        start_agents(lab)
    lab.injector.apply_from_start()
    job.make_steps_file(lab.run_dir, lab.cfg.topology.world_size)
    if lab.cfg.neighbour_churn:
        lab.neighbour = Neighbour(lab.cfg.neighbour_churn, lab.net.nodes, lab.run_dir, lab.spawn)
        lab.neighbour.start()
    lab.injector.start()
    start_ranks(lab)
    topo = lab.cfg.topology
    say(f"job started: {topo.world_size} rank(s) on {topo.nodes} node(s), {lab.cfg.steps} "
        f"step(s), {lab.cfg.mode}")  # fmt: skip


def cpu_of(rank: int, world_size: int, hogged: Collection[int], cpus: int | None = None) -> int:
    """The CPU a rank is pinned to when a cpuhog fault runs: its own where
    there are as many CPUs as ranks.  With fewer (this lab's nodes share one
    machine), each hogged rank still gets a CPU of its own, as on a node with
    cores for every rank, and the other ranks share the remaining CPUs: a
    hog then steals from its rank alone, not from neighbours that happen to
    share the CPU (on two cores they would be half the job)."""
    n = cpus or os.cpu_count() or 1
    alone = sorted(set(hogged))
    if n >= world_size or not alone or len(alone) >= n:
        return rank % n
    if rank in alone:
        return alone.index(rank)
    others = [r for r in range(world_size) if r not in alone]
    return len(alone) + others.index(rank) % (n - len(alone))


def _hogged(cfg: RunConfig) -> list[int]:
    return [f.rank for f in cfg.faults if isinstance(f, F.CpuHog)]


def start_hog(lab: Lab, fault: F.CpuHog) -> str:
    """The busy processes of one cpuhog fault, now; says how."""
    world = lab.cfg.topology.world_size
    cpu = cpu_of(fault.rank, world, _hogged(lab.cfg))
    code = HOG_CODE.format(run_dir=lab.run_dir, cpu=cpu, nice=HOG_NICE)
    node = lab.node(lab.cfg.topology.node_of(fault.rank))
    for k in range(HOGS_PER_RANK):
        log = lab.run_dir / f"hog-{fault.rank}-{k}.log"
        hog = lab.spawn(node, [sys.executable, "-c", code], log)
        _renice_autogroup(hog.pid, HOG_NICE)
        lab.hogs.append(hog)
    return f"{HOGS_PER_RANK} busy processes and the rank pinned to CPU {cpu}"


def start_bulk(lab: Lab, fault: F.Bulk) -> str:
    """A bulk neighbour's two processes, now; says how."""
    assert lab.net is not None
    procs, how = bulk.start(fault, lab.net.nodes, lab.run_dir, lab.spawn)
    lab.hogs.extend(procs)  # they go with the run, as the hogs do
    return how


def _renice_autogroup(pid: int, nice: int) -> None:
    """With autogroup, every session shares the CPU equally whatever its tasks'
    nice values: renice the hog's session too, or the rank would not notice it."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))


def rank_argv(lab: Lab, rank: int) -> list[str]:
    cfg = lab.cfg
    argv = [
        sys.executable,
        "-m",
        "stallwatch.commands.labrank",
        "--rank",
        str(rank),
        "--nodes",
        str(cfg.nodes),
    ]
    argv += ["--ranks-per-node", str(cfg.ranks_per_node), "--steps", str(cfg.steps)]
    argv += ["--run-dir", str(lab.run_dir), "--lib", str(lab.lib), "--mode", cfg.mode]
    argv += ["--elements", str(cfg.elements), "--compute-ms", f"{cfg.compute_ms:g}"]
    if cfg.graphs:
        argv.append("--graphs")
    for fault in F.for_rank(cfg.faults, rank):
        argv += ["--fault", F.format_fault(fault)]
    if hogged := _hogged(cfg):
        # every rank pinned: the hog's rank alone on its CPU where it can be
        argv += ["--cpu", str(cpu_of(rank, cfg.topology.world_size, hogged))]
    return argv


def launcher_env(lab: Lab, rank: int) -> dict[str, str]:
    """What torchrun sets in every rank's environment: who it is, in which job."""
    topo = lab.cfg.topology
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(topo.local_rank(rank)),
        "GROUP_RANK": str(topo.node_of(rank)),
        "WORLD_SIZE": str(topo.world_size),
        "LOCAL_WORLD_SIZE": str(topo.ranks_per_node),
        "TORCHELASTIC_RUN_ID": lab.run_id,
    }


def start_ranks(lab: Lab) -> None:
    topo = lab.cfg.topology
    for rank in range(topo.world_size):
        node = lab.node(topo.node_of(rank))
        log = lab.run_dir / f"rank-{rank}.log"
        lab.ranks[rank] = lab.spawn(node, rank_argv(lab, rank), log, launcher_env(lab, rank))


# --- agents (--record) ------------------------------------------------------


def agent_dump_dir(cfg: RunConfig, node: int) -> Path:
    """Where node ``node``'s agent (the host agent: 0) writes."""
    name = HOST_SCOPE if cfg.agent_scope == HOST_SCOPE else f"node{node}"
    return cfg.dump_dir.resolve() / name  # agents run elsewhere


def agent_pin_dir(run_id: str, node: int) -> Path:
    """The node's agent's pinned recording (removed at teardown)."""
    return netns.PIN_ROOT / f"{netns.PIN_PREFIX}{run_id}-node{node}"


def agent_argv(lab: Lab, site: AgentSite, token_file: Path) -> list[str]:
    """``stallwatch record`` for one site, listening on its own address."""
    peers = [f"{s.ip}:{AGENT_PORT}" for s in lab.sites() if s.index != site.index]
    argv = [sys.executable, "-m", "stallwatch", "record", "--scope", lab.cfg.agent_scope]
    argv += ["--dump-dir", str(agent_dump_dir(lab.cfg, site.index))]
    if not lab.cfg.agent_defaults:  # one bound for every call, as the lab's tests expect
        timeout = f"{lab.cfg.stall_timeout:g}"
        argv += ["--stall-timeout", timeout, "--stall-floor", timeout]
    argv += ["--listen", f"{site.ip}:{AGENT_PORT}", "--token-file", str(token_file)]
    assert lab.certs is not None
    argv += lab.certs.agent_args(site.index)
    argv += ["--host-name", site.name]  # namespaces share the machine's hostname
    if lab.cfg.agent_scope == HOST_SCOPE:  # other jobs on this machine (other lab runs) stay out
        argv += ["--job", lab.run_id]  # the ranks' TORCHELASTIC_RUN_ID
    # kept like a deployed agent's: a supervised restart takes it over
    argv += ["--pin-dir", str(agent_pin_dir(lab.run_id, site.index)), "--keep-pinned"]
    if peers:
        argv += ["--peers", ",".join(peers)]
    if lab.cfg.mode == "gpu":
        argv += ["--lib", str(cudart_of(lab.lib))]
    return [*argv, "--lib", str(lab.lib)]


def _token_file(lab: Lab) -> Path:
    return lab.run_dir / "agent.token"


def start_agents(lab: Lab) -> None:
    """Every agent, under its supervisor (but those that start late)."""
    token = lab.token = secrets.token_hex(16)
    token_file = _token_file(lab)
    token_file.touch(mode=0o600)
    token_file.write_text(token)
    lab.certs = make_certs(lab.run_dir / "tls", {s.index: s.ip for s in lab.sites()})
    lab.cfg.dump_dir.mkdir(parents=True, exist_ok=True)
    late = lab.chaos.late_nodes() if lab.chaos is not None else set()
    starting = [s for s in lab.sites() if s.index not in late]
    lab.narrator.say(
        f"starting {len(starting)} agent(s): each compiles its eBPF programs (seconds; "
        "a minute on a loaded machine)"
    )
    lab.narrator.phase()
    for site in lab.sites():
        agent_dump_dir(lab.cfg, site.index).mkdir(parents=True, exist_ok=True)
        if site.index not in late:
            start_agent(lab, site.index)
    for site in starting:
        wait_healthy(lab, site, token)
    client = write_client_dir(lab)
    say_client_commands(lab, client, late)


CLIENT_DIR = "client"
# in flight, longest first: what the runbook asks the agents live
LIVE_SQL = (
    "SELECT host, world_rank, op, seq, elapsed_ns/1e9 AS s FROM nccl_events "
    "WHERE state = 'scheduled' ORDER BY elapsed_ns DESC, world_rank LIMIT 10"
)


def write_client_dir(lab: Lab) -> Path:
    """What a client of the agents needs, named as docs/runbook.md names it:
    agents.txt, token, ca.pem, client.pem, client.key (keys readable by
    root alone); in ``--client-dir`` (kept after the run, so that what a
    rehearsal writes there outlives it), else removed with the run."""
    assert lab.certs is not None
    folder = lab.cfg.client_dir or lab.run_dir / CLIENT_DIR
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    agents = "".join(f"{s.ip}:{AGENT_PORT}\n" for s in lab.sites())
    (folder / "agents.txt").write_text(agents)
    files = {"token": _token_file(lab), "ca.pem": lab.certs.ca}
    files |= {"client.pem": lab.certs.client_cert, "client.key": lab.certs.client_key}
    for name, source in files.items():
        target = folder / name
        target.touch(mode=0o600)
        target.write_bytes(source.read_bytes())
    return folder


def client_commands(lab: Lab, folder: Path) -> list[list[str]]:
    """The commands that reach the agents from the host's shell, as argv."""
    reach = ["--agents-file", str(folder / "agents.txt"), "--token-file", str(folder / "token")]
    reach += ["--tls-ca", str(folder / "ca.pem"), "--tls-cert", str(folder / "client.pem")]
    reach += ["--tls-key", str(folder / "client.key")]
    me = program()
    return [
        [*me, "analyze", *reach],
        [*me, "query", *reach, LIVE_SQL],
        [*me, "collect", *reach, "-o", "incident/"],
    ]


def say_client_commands(lab: Lab, folder: Path, late: set[int]) -> None:
    sites = lab.sites()
    where = ", ".join(f"{s.name} {s.ip}:{AGENT_PORT}" for s in sites if s.index not in late)
    lab.narrator.say(f"agents ready: {where}")
    if late:
        lab.narrator.say(f"(the agents of node(s) {sorted(late)} start later: an agent fault)")
    commands = [wrapped(argv) for argv in client_commands(lab, folder)]
    lab.narrator.say(
        "from this shell, while the job runs: the live verdict, the calls in flight, the dumps\n"
        + "\n".join(commands)
    )
    kept = (
        "kept after the run" if lab.cfg.client_dir else "gone at teardown: --client-dir keeps one"
    )
    lab.narrator.say(f"(in {folder}, {kept}; docs/runbook.md runs as printed there)")


def _agent_log(lab: Lab, site: AgentSite) -> Path:
    return lab.cfg.dump_dir / f"{site.name}.agent.log"


def start_agent(lab: Lab, index: int) -> None:
    site = lab.site(index)
    log = _agent_log(lab, site)
    sup = Supervisor(
        name=f"{netns.PREFIX}{lab.run_id}-agent{index}",
        argv=[*site.exec_prefix(), *agent_argv(lab, site, _token_file(lab))],
        service=AGENT_SERVICE,
        notify_path=lab.run_dir / f"notify-node{index}.sock",
        log_file=lab.log_file(log),
        env=lab.env(),
        cwd=lab.run_dir,
    )
    try:
        sup.start()
    except OSError as exc:  # no cgroup hierarchy to bound it in: run it unbounded
        sup.service = dataclasses.replace(AGENT_SERVICE, memory_max=None)
        sup.note(f"no memory bound: {exc}")
        sup.start()
    lab.agents[index] = sup


def wait_healthy(lab: Lab, site: AgentSite, token: str) -> None:
    """Ask the agent's /healthz once its log says it listens: a connection
    refused before that would be recorded by its own, already attached
    probes as a connection of the node (it learns its port a moment later)."""
    sup = lab.agents[site.index]
    url = f"https://{site.ip}:{AGENT_PORT}/healthz"
    log = _agent_log(lab, site)
    client = _client(lab, site, 1.0, token)
    deadline = time.monotonic() + AGENT_START_TIMEOUT
    while time.monotonic() < deadline:
        narrate_agents(lab)
        exits = [e for e in sup.events if e.kind == "exited"]
        if exits:
            code = exits[0].code
            raise LabError(
                f"the agent of {site.who} exited with {code} "
                f"before answering {url}: {last_line(log)}"
            )
        if _says_listening(log) and netns.in_netns(site.netns, lambda: _healthz(client)):
            return
        time.sleep(0.25)
    raise LabError(f"the agent of {site.who} did not answer {url} in {AGENT_START_TIMEOUT}s")


def agent_logs(lab: Lab) -> dict[str, Path]:
    return {site.name: _agent_log(lab, site) for site in lab.sites()}


def narrate_agents(lab: Lab) -> None:
    """Tell what the agents' logs say; while some do not listen yet, a
    heartbeat says how many do."""
    n = lab.narrator
    n.agent_logs(agent_logs(lab))
    if not n.listening >= {s.name for s in lab.sites()}:
        waited = time.monotonic() - n.phase_since
        n.heartbeat(
            lambda: (
                f"waiting for the agents: {len(n.listening)} of {len(lab.sites())} "
                f"listening after {waited:.0f} s (compiling their eBPF programs)"
            )
        )


def _says_listening(log: Path) -> bool:
    try:
        return "listening on " in log.read_text(errors="replace")
    except OSError:
        return False


def _client(lab: Lab, site: AgentSite, timeout: float, token: str | None = None) -> AgentClient:
    """The agent of ``site``, over HTTPS with the lab's client certificate."""
    assert lab.certs is not None
    address = f"https://{site.ip}:{AGENT_PORT}"
    return AgentClient(address, token or lab.token, lab.certs.client(), timeout)


def make_chaos(lab: Lab) -> Chaos:
    def query(index: int, body: bytes) -> None:
        site = lab.site(index)
        client = _client(lab, site, 30.0)
        netns.in_netns(site.netns, functools.partial(post_query, client, body))

    agent_faults = [f for f in lab.cfg.faults if isinstance(f, F.AgentFault)]
    return Chaos(
        faults=agent_faults,
        agents=lab.agents,
        start_agent=lambda index: start_agent(lab, index),
        reached=lambda: max(progress(lab)[0], default=0) - 1,
        query=query,
        stall_timeout_s=lab.cfg.stall_timeout,
    )


def agent_outcomes(lab: Lab) -> list[dict[str, Any]]:
    out = []
    for index, sup in sorted(lab.agents.items()):
        mine = [f for f in lab.cfg.faults if isinstance(f, F.AgentFault) and f.node == index]
        starts = sum(1 for e in sup.events if e.kind == "started")
        out.append(
            {
                "node": index,
                "starts": starts,
                "faults": [F.format_fault(f) for f in mine],
                "events": [
                    {"at_ns": int(e.at * 1e9), "kind": e.kind, "pid": e.pid, "detail": e.detail}
                    for e in sup.events
                ],
            }
        )
    return out


def _healthz(client: AgentClient) -> bool:
    try:
        return client.get("/healthz").ok
    except AgentError:
        return False


def _dumps(cfg: RunConfig) -> bool:
    return cfg.record or cfg.snapshot_when_stuck


def dumps_found(cfg: RunConfig) -> list[Path]:
    if not cfg.dump_dir.is_dir():
        return []
    return sorted(p for p in cfg.dump_dir.rglob("*.msgpack") if not p.name.startswith("."))


def end_incident(run_id: str) -> str:
    """The incident id of a run's ``--dump-at-end`` dumps."""
    return f"lab-{run_id}-end"


def end_dumps(folder: Path) -> list[Path]:
    """The ``--dump-at-end`` dumps under ``folder`` (an incident the agents
    raised during the run is another incident, dumped beside them)."""
    from stallwatch.dumpers.format import dump_trigger

    out = []
    for path in sorted(folder.rglob("*.msgpack")):
        try:
            trigger = dump_trigger(path)
        except DumpError:
            continue
        if trigger is not None and re.fullmatch(r"lab-\w+-end", trigger.incident_id):
            out.append(path)
    return out


def agent_bound(cfg: RunConfig) -> float:
    """The longest the agents let a communicator stand still unraised: the
    lab's stall timeout, or as deployed (``--agent-defaults``) their own
    ceiling (a job given up by the lab is not killed before they dump it)."""
    return max(cfg.stall_timeout, AGENT_CEILING_S) if cfg.agent_defaults else cfg.stall_timeout


def wait_for_dumps(lab: Lab) -> None:
    """Every node's agent writes a dump raised since its node's ranks last
    moved or a rank exited (a stall after a slowdown: a dump of the slowdown
    is none of the stall's; a cut node dumps its own incident, its peers'
    never reach it, and the others' ranks may move on in their own node's
    communicators after it dumped), or DUMP_GRACE passes.
    With agent faults, also until they were all applied and the agents they
    touched had time to raise the stall again (``Chaos.settled``)."""
    chaos = lab.chaos
    grace = DUMP_GRACE + (CHAOS_GRACE if chaos is not None and chaos.faults else 0)
    deadline = time.monotonic() + agent_bound(lab.cfg) + grace
    gone = chaos.gone_nodes() if chaos is not None else set()
    nodes = [s.index for s in lab.sites() if s.index not in gone]  # dumped by pinned_dumps
    lab.narrator.phase()
    while time.monotonic() < deadline:
        if chaos is not None:
            chaos.poll()
        if lab.injector is not None:
            lab.injector.check()
        narrate_job(lab, waiting_for_dumps=True)
        w = lab.watch  # the stall's or the exit's, not an earlier incident's
        since = {
            agent_dump_dir(lab.cfg, n): int(
                (min(w.node_moved_at.get(n, 0.0), w.exited_at or math.inf) - LOOK_S) * 1e9
            )
            for n in nodes
        }
        dumped = dumped_since(since)
        if dumped and (chaos is None or chaos.settled()):
            return
        time.sleep(0.25)


VERDICT_GRACE = 30.0  # after the dumps: time for the detecting agent to publish its verdict
# the incidents whose verdict the detecting agent publishes (recorder.verdicts)
PUBLISHED = ("in_flight", "no_progress", "exit", "slowdown")


def wait_for_verdict(lab: Lab) -> None:
    """Until an agent published the verdict of an incident it detected
    (``<incident>.verdict.json`` beside its dumps) from every node's dump
    (revised, if its first lacked some), or VERDICT_GRACE passes; not at all
    when no agent detected one (the dumps are peers' or asked for)."""
    if not any(_detected(p) for p in dumps_found(lab.cfg)):
        return
    deadline = time.monotonic() + VERDICT_GRACE
    while time.monotonic() < deadline and not _verdicts_complete(lab.cfg):
        narrate_job(lab, waiting_for_dumps=True)
        time.sleep(0.25)
    narrate_job(lab, waiting_for_dumps=True)


def _verdicts_complete(cfg: RunConfig) -> bool:
    found = verdicts_found(cfg)
    try:
        docs = [json.loads(p.read_text()) for p in found]
        return bool(docs) and all(not d["publication"]["agents_missing"] for d in docs)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _detected(path: Path) -> bool:
    from stallwatch.dumpers.format import dump_trigger

    try:
        trigger = dump_trigger(path)
    except DumpError:
        return False
    return trigger is not None and trigger.kind.value in PUBLISHED


def verdicts_found(cfg: RunConfig) -> list[Path]:
    if not cfg.dump_dir.is_dir():
        return []
    return sorted(p for p in cfg.dump_dir.rglob("*.verdict.json") if not p.name.startswith("."))


def dumped_since(since_ns: Mapping[Path, int]) -> bool:
    """Whether each folder holds a dump raised at its time or later
    (monotonic; a dump with no trigger, taken on request, counts), a dump
    being written or unreadable being none yet."""
    return all(any(t >= ns for t in _trigger_times(f)) for f, ns in since_ns.items())


def _trigger_times(folder: Path) -> list[int]:
    from stallwatch.dumpers.format import dump_trigger

    out = []
    for path in folder.glob("*.msgpack"):
        if path.name.startswith("."):
            continue
        try:
            trigger = dump_trigger(path)
        except DumpError:
            continue
        out.append(trigger.time_ns if trigger is not None else 1 << 62)
    return out


def pinned_dumps(lab: Lab) -> list[str]:
    """``stallwatch dump --pinned`` in every node whose agent is gone for
    good (``agentgone``), as an operator would: the kernel recorded into its
    pins alone.  Returns problems."""
    gone = lab.chaos.gone_nodes() if lab.chaos is not None else set()
    problems = []
    for index in sorted(gone):
        site = lab.site(index)
        argv = [sys.executable, "-m", "stallwatch", "dump", "--pinned"]
        argv += ["--pin-dir", str(agent_pin_dir(lab.run_id, index))]
        argv += ["--dump-dir", str(agent_dump_dir(lab.cfg, index))]
        argv += ["--reason", f"lab: {site.who}'s agent is gone"]
        log = lab.cfg.dump_dir / f"{site.name}.pinned.log"
        proc = lab.spawn(site, argv, log)
        try:
            code = proc.wait(PINNED_DUMP_TIMEOUT)
        except subprocess.TimeoutExpired:
            _kill(proc)
            code = None
        if code != 0:
            problems.append(f"dump --pinned on {site.who} failed: {last_line(log)}")
    return problems


def request_end_dumps(lab: Lab) -> list[str]:
    """Ask every agent (but those gone for good) to dump now, one incident
    for all (``lab-<run id>-end``), as an operator's ``stallwatch dump``
    does: a request of a client, which an incident's cool-down does not
    hold back (a peer's would be); then wait until each wrote a new file.
    Returns problems, each with what the agent answered."""
    gone = lab.chaos.gone_nodes() if lab.chaos is not None else set()
    sites = [s for s in lab.sites() if s.index not in gone]
    before = {s.index: _dump_count(lab.cfg, s.index) for s in sites}
    body = json.dumps({"reason": "end of lab run", "incident_id": end_incident(lab.run_id)})

    def ask(site: AgentSite) -> str | None:  # every agent at once, as the command does
        post = functools.partial(_end_dump_answer, _client(lab, site, 30.0), body.encode())
        return netns.in_netns(site.netns, post)

    with ThreadPoolExecutor(max(1, len(sites))) as pool:
        answers = dict(zip([s.index for s in sites], pool.map(ask, sites), strict=True))
    deadline = time.monotonic() + DUMP_GRACE
    while time.monotonic() < deadline:
        if all(_dump_count(lab.cfg, i) > n for i, n in before.items()):
            return []
        time.sleep(0.25)
    late = [s for s in sites if _dump_count(lab.cfg, s.index) <= before[s.index]]
    return [
        f"no dump at the end from {s.who} within {DUMP_GRACE:g} s: it answered "
        f"{answers[s.index] or 'written'}; now it says {_end_dump_outcome(lab, s)}"
        for s in late
    ]


def _end_dump_outcome(lab: Lab, site: AgentSite) -> str:
    """What the agent says became of the end-of-run dump (``outcome_of``)."""
    body = json.dumps({"outcome_of": end_incident(lab.run_id)}).encode()

    def ask() -> str:
        try:
            return _client(lab, site, 30.0).post("/dump", body).body.decode(errors="replace")
        except AgentError as exc:
            return str(exc)

    return netns.in_netns(site.netns, ask)


SNAPSHOT_TIMEOUT = 120.0


def snapshot_nodes(lab: Lab) -> list[str]:
    """``stallwatch snapshot`` inside every node at once, as someone who logs
    in to each would; the dumps go to ``<dump dir>/node<N>``.  Returns problems."""
    assert lab.net is not None
    procs = {}
    for node in lab.net.nodes:
        out = lab.cfg.dump_dir.resolve() / f"node{node.index}"
        out.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "stallwatch", "snapshot", "--scope", "netns"]
        argv += ["--host-name", f"node{node.index}", "--dump-dir", str(out)]
        procs[node.index] = lab.spawn(node, argv, lab.cfg.dump_dir / f"node{node.index}.snap.log")
    problems = []
    for index, proc in procs.items():
        try:
            code = proc.wait(timeout=SNAPSHOT_TIMEOUT)
        except subprocess.TimeoutExpired:
            _kill(proc)
            code = None
        if code != 0:
            log = lab.cfg.dump_dir / f"node{index}.snap.log"
            problems.append(f"stallwatch snapshot on node {index} failed: {last_line(log)}")
    return problems


def request_snapshots(lab: Lab) -> list[str]:
    """Ask every agent for a snapshot and a dump, one incident for all."""
    sites = lab.sites()
    before = {s.index: _dump_count(lab.cfg, s.index) for s in sites}
    body = json.dumps(
        {"reason": "lab: snapshot of a stuck job", "incident_id": f"lab-{lab.run_id}-snapshot"}
    ).encode()

    def ask(site: AgentSite) -> str | None:  # every agent at once, as the command does
        post = functools.partial(_post_dump, _client(lab, site, 30.0), "/snapshot", body)
        return netns.in_netns(site.netns, post)

    with ThreadPoolExecutor(len(sites)) as pool:
        answers = list(pool.map(ask, sites))
    problems = [
        f"the agent of {site.who} refused the snapshot: {answer}"
        for site, answer in zip(sites, answers, strict=True)
        if answer is not None
    ]
    deadline = time.monotonic() + DUMP_GRACE
    while time.monotonic() < deadline:
        if all(_dump_count(lab.cfg, i) > n for i, n in before.items()):
            return problems
        time.sleep(0.25)
    late = [i for i, n in before.items() if _dump_count(lab.cfg, i) <= n]
    return [*problems, f"no snapshot dump from node(s) {late} within {DUMP_GRACE:g} s"]


def _dump_count(cfg: RunConfig, node: int) -> int:
    return sum(1 for p in agent_dump_dir(cfg, node).glob("*.msgpack") if not p.name.startswith("."))


def _end_dump_answer(client: AgentClient, body: bytes) -> str | None:
    """None when the agent writes the dump asked for, else what it said."""
    try:
        reply = client.post("/dump", body)
        if not reply.ok:
            return reply.error_text()
        doc = reply.json()
    except AgentError as exc:
        return str(exc)
    status = doc.get("status") if isinstance(doc, dict) else None
    if status in ("written", "queued"):
        return None
    return f"{status} (incident {doc.get('incident_id')})" if status else "no status"


def _post_dump(client: AgentClient, path: str, body: bytes) -> str | None:
    """None when the agent took the request, else why not."""
    try:
        reply = client.post(path, body)
    except AgentError as exc:
        return str(exc)
    return None if reply.ok else f"HTTP {reply.status}"


# --- waiting ------------------------------------------------------------------


def progress(lab: Lab) -> tuple[tuple[int, ...], frozenset[int]]:
    steps = tuple(
        (rep.steps_done + 1 if rep is not None else 0)
        for rep in (job.read_report(lab.run_dir, r) for r in sorted(lab.ranks))
    )
    exited = frozenset(r for r, p in lab.ranks.items() if p.poll() is not None)
    return steps, exited


def say_agents_ready(lab: Lab) -> None:
    """Once every agent is ready (a late one included), the file that
    a ``hang:...,agents=ready`` rank waits for (written once)."""
    path = lab.run_dir / job.AGENTS_READY_FILE
    if not lab.cfg.record or path.exists() or len(lab.agents) < len(lab.sites()):
        return
    if all(sup.ready_count() > 0 for sup in lab.agents.values()):
        job.write_atomic(path, b"ready\n")


def wait_for_job(lab: Lab, started: float) -> str | None:
    """None when every rank exited, or did its last step and had
    ``--stall-timeout`` to exit (destroying communicators is local work: one
    that takes longer is killed, and said so, but the job is done);
    otherwise why the lab stopped waiting."""
    last, last_change = progress(lab), time.monotonic()
    finished_at: float | None = None  # when every rank had done its last step
    lab.narrator.phase()
    while True:
        if lab.chaos is not None:
            lab.chaos.poll()
        if lab.injector is not None:
            lab.injector.check()
        say_agents_ready(lab)
        narrate_job(lab)
        end_when_due(lab)
        now = time.monotonic()
        current = progress(lab)
        if len(current[1]) == len(lab.ranks):
            return None
        if all(step > last_step(lab) for step in current[0]):  # steps_done + 1 each
            finished_at = finished_at or now
            if now - finished_at > lab.cfg.stall_timeout:
                return None
        elif current != last:
            last, last_change = current, now
        elif now - last_change > lab.cfg.stall_timeout:
            return f"no rank made progress for {lab.cfg.stall_timeout:g} s"
        deadline = lab.cfg.deadline_s
        if finished_at is None and deadline is not None and now - started > deadline:
            why = "--timeout" if lab.cfg.timeout is not None else "--duration's deadline"
            return f"the job did not finish within {deadline:g} s ({why})"
        time.sleep(POLL)


def last_step(lab: Lab) -> int:
    """How many steps every rank does: ``--steps``, or fewer where
    ``--duration`` ended the job."""
    return lab.ended_at_step if lab.ended_at_step is not None else lab.cfg.steps


# a rank between reading the steps and the end being written may begin one
# more step; each checks the end before every step
END_MARGIN_STEPS = 3


def end_when_due(lab: Lab) -> None:
    """With ``--duration``: once that long has passed since the job reached
    the latest step a fault names (or began its first step), every rank is
    asked to end a few steps after the fastest."""
    if lab.cfg.duration is None or lab.ended_at_step is not None:
        return
    reached = max(job.read_steps(lab.run_dir), default=-1)
    if lab.from_ns is None:
        if reached < max((s for f in lab.cfg.faults if (s := getattr(f, "step", None))), default=0):
            return
        lab.from_ns = time.monotonic_ns()
    if time.monotonic_ns() - lab.from_ns < lab.cfg.duration * 1e9:
        return
    step = min(reached + END_MARGIN_STEPS, lab.cfg.steps)
    job.end_job_at(lab.run_dir, step)
    lab.ended_at_step = step
    lab.narrator.say(
        f"--duration {lab.cfg.duration:g} s reached: every rank ends before step {step}"
    )


LOOK_S = 0.25  # how often the narration looks at the ranks, faults and logs


def narrate_job(lab: Lab, waiting_for_dumps: bool = False) -> None:
    """Tell what changed: faults that took effect, the job stuck or moving
    again, what the agents' logs say; between them, a heartbeat."""
    w, n = lab.watch, lab.narrator
    now = time.monotonic()
    if now < w.next_look:
        return
    w.next_look = now + LOOK_S
    if lab.cfg.record:
        n.agent_logs(agent_logs(lab))
    reports = {r: job.read_report(lab.run_dir, r) for r in sorted(lab.ranks)}
    narrate_faults(lab, reports)
    steps = tuple((rep.steps_done + 1 if rep is not None else 0) for rep in reports.values())
    running = sum(1 for proc in lab.ranks.values() if proc.poll() is None)
    if running < len(lab.ranks) and w.exited_at is None:
        w.exited_at = now
    topo = lab.cfg.topology
    for node in range(lab.cfg.nodes):
        mine = tuple(s for r, s in zip(reports, steps, strict=True) if topo.node_of(r) == node)
        if w.node_steps.get(node) != mine:
            w.node_steps[node], w.node_moved_at[node] = mine, now
    if steps != w.steps:
        if w.stuck and running:
            n.say(f"the job moves again: step {min(steps, default=0)}")
            n.phase()
        w.steps, w.moved_at, w.stuck = steps, now, False
    elif not w.stuck and running and now - w.moved_at >= STUCK_S:
        w.stuck = True
        step = min(steps, default=0)
        after = f"; the agents call it a stall after {lab.cfg.stall_timeout:g} s"
        n.say(f"the job is stuck at step {step}: no rank moved for {STUCK_S:g} s"
              f"{after if lab.cfg.record else ''}")  # fmt: skip
        n.phase()
    n.heartbeat(lambda: _job_line(lab, steps, running, now - w.moved_at, waiting_for_dumps))


def _job_line(
    lab: Lab, steps: tuple[int, ...], running: int, still: float, waiting_for_dumps: bool
) -> str:
    total = lab.cfg.steps
    first = min(min(steps, default=0), total)
    if waiting_for_dumps:
        sites = lab.sites()
        dumped = sum(1 for s in sites if any(agent_dump_dir(lab.cfg, s.index).glob("*.msgpack")))
        return f"waiting for the dumps: {dumped} of {len(sites)} agent(s) dumped"
    if lab.watch.stuck:
        return f"the job is stuck at step {first}: no rank moved for {still:.0f} s"
    fastest = min(max(steps, default=0), total)
    return f"step {first} of {total} (the slowest rank; the fastest: {fastest}), {running} running"


def narrate_faults(lab: Lab, reports: dict[int, job.RankReport | None]) -> None:
    """Each fault once, as it takes effect (and a runner's fault as it ends)."""
    n = lab.narrator
    records = list(lab.injector.records().values()) if lab.injector is not None else []
    for rec in records:
        if rec.injected:
            n.once(f"fault {rec.spec}", f"fault {rec.spec}: {rec.how}, {rec.when()}")
        if rec.ended_wall is not None:
            n.once(f"end {rec.spec}", f"fault {rec.spec} ended: {rec.when()}")
    if lab.chaos is not None:
        for line in lab.chaos.log[lab.watch.chaos_told :]:
            n.say(f"agent fault: {line}")
        lab.watch.chaos_told = len(lab.chaos.log)
    for rank, rep in reports.items():
        for event in rep.events if rep is not None else []:
            spec = event.get("spec")
            n.once(f"fault {spec}", f"fault {spec}: rank {rank}, at step {event.get('step')}")


def stop_stuck(lab: Lab) -> dict[int, job.RankReport | None]:
    """Kill the ranks still running, all at once (a rank that sees its peer die
    would report that instead of where it was stuck); returns their last reports."""
    alive = {rank: proc for rank, proc in lab.ranks.items() if proc.poll() is None}
    stuck = {rank: job.read_report(lab.run_dir, rank) for rank in alive}
    for proc in alive.values():
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    for proc in alive.values():
        _kill(proc)
    lab.killed.update(alive)
    return stuck


# --- the outcome --------------------------------------------------------------


def outcome(lab: Lab, rank: int, stuck: dict[int, job.RankReport | None]) -> RankOutcome:
    proc = lab.ranks.get(rank)
    rep = stuck[rank] if rank in stuck else job.read_report(lab.run_dir, rank)
    code = proc.returncode if proc is not None else None
    killed = rank in lab.killed
    sig = signal.Signals(-code).name if code is not None and code < 0 else None
    topo = lab.cfg.topology
    error = rep.error if rep is not None else None
    if error is None and code not in (0, None) and not killed:
        error = last_line(lab.run_dir / f"rank-{rank}.log")
    status = _status(rep, killed, last_step(lab))
    return RankOutcome(
        world_rank=rank,
        node=topo.node_of(rank),
        local_rank=topo.local_rank(rank),
        pid=proc.pid if proc is not None else None,
        steps_done=rep.steps_done if rep is not None else 0,
        status=status,
        exit_code=code if code is None or code >= 0 else None,
        exit_signal=sig,
        killed_by_lab=killed,
        stuck=killed and status not in (job.STATUS_DONE, STATUS_EXITING),
        verified=rep is not None and rep.verified_failed == 0 and rep.steps_done == rep.steps_total,
        verified_ok=rep.verified_ok if rep is not None else 0,
        verified_failed=rep.verified_failed if rep is not None else 0,
        error=error,
        calls=rep.calls if rep is not None else {},
        comms=rep.comms if rep is not None else {},
        step_ms=rep.step_ms if rep is not None else [],
        step_start_ns=rep.step_start_ns if rep is not None else [],
        cpu_s=rep.cpu_s if rep is not None else 0.0,
        wall_s=rep.wall_s if rep is not None else 0.0,
        run_delay_ms=rep.run_delay_ms if rep is not None else 0.0,
        compute_cpu_share=rep.compute_cpu_share if rep is not None else 0.0,
        device_log=rep.device_log if rep is not None else [],
        events=rep.events if rep is not None else [],
    )


# a rank that did its last step and was still destroying its communicators
# or exiting when the lab ended the run
STATUS_EXITING = "exiting"


def _status(rep: job.RankReport | None, killed: bool, last: int) -> str:
    if rep is None:
        return "no report"
    if killed and rep.status == job.STATUS_RUNNING:
        return STATUS_EXITING if rep.steps_done >= last else "stuck"
    return rep.status


def node_outcomes(lab: Lab) -> list[NodeOutcome]:
    assert lab.net is not None
    seen = []
    for node in lab.net.nodes:
        tcp = netns.tcp_counters(node.netns)
        seen.append(
            NodeOutcome(node.index, node.netns, node.ip, tcp["OutSegs"], tcp["RetransSegs"], tcp)
        )
    return seen


# --- the run ----------------------------------------------------------------


def run(cfg: RunConfig, progress_out: TextIO | None = None) -> RunResult:
    lib = preflight(cfg)
    started = time.monotonic()
    lab = make_lab(cfg, lib, progress_out)
    say = lab.narrator.say
    atexit.register(lab.teardown)
    problems: list[str] = []
    try:
        with signals_as_interrupt():
            set_up(lab)
            gave_up = wait_for_job(lab, started)
            if gave_up is not None:
                say(f"lab run {lab.run_id}: {gave_up}; giving up")
                problems += look_late(lab)
            else:
                say(f"the job ended: every rank exited ({_exits(lab)})")
            failed = gave_up is not None or any(p.returncode for p in lab.ranks.values())
            if cfg.record and failed:
                wait_for_dumps(lab)
                problems += pinned_dumps(lab)
                wait_for_verdict(lab)
            if cfg.record and cfg.dump_at_end:
                tell_dumps(lab)  # the incident's, before the end's
                say(f"lab run {lab.run_id}: asking every agent for a dump (--dump-at-end)")
                problems += request_end_dumps(lab)
            if cfg.record and (failed or cfg.dump_at_end or dumps_found(cfg)):
                say_dumps(lab)
            assert lab.injector is not None
            lab.injector.finish()
            churn = lab.neighbour.stop() if lab.neighbour is not None else None
            stuck = stop_stuck(lab)
            ranks = [outcome(lab, r, stuck) for r in range(cfg.topology.world_size)]
            nodes = node_outcomes(lab)
            agents = agent_outcomes(lab)
            records = fault_records(lab, ranks)
    finally:
        with signals_ignored():
            say(f"lab run {lab.run_id}: tearing down (the agents detach their probes: seconds)")
            problems += lab.teardown()
        atexit.unregister(lab.teardown)
    leftovers = [ns for ns in netns.list_netns() if netns.run_of(ns) == lab.run_id]
    problems += [f"namespace {ns} was left behind" for ns in leftovers]
    return RunResult(
        run_id=lab.run_id,
        nodes=cfg.nodes,
        ranks_per_node=cfg.ranks_per_node,
        steps=cfg.steps,
        mode=cfg.mode,
        faults=records,
        ranks=ranks,
        nodes_seen=nodes,
        duration_s=round(time.monotonic() - started, 3),
        gave_up=gave_up,
        recorded=cfg.record,
        dump_dir=str(cfg.dump_dir) if _dumps(cfg) else None,
        dumps=[str(p) for p in dumps_found(cfg)] if _dumps(cfg) else [],
        problems=problems,
        agents=agents,
        neighbour_churn=churn,
    )


def fault_records(lab: Lab, ranks: Sequence[RankOutcome]) -> list[FaultRecord]:
    """Every fault of the run, in the order given: the injector's and the
    agents' as they noted them, the ranks' from what each rank reported."""
    assert lab.injector is not None
    known: dict[Any, FaultRecord] = dict(lab.injector.records())
    if lab.chaos is not None:
        known.update(lab.chaos.records())
    offset = wall_offset_ns()
    return [
        known[f] if f in known else _rank_fault_record(f, ranks, offset) for f in lab.cfg.faults
    ]


def _rank_fault_record(fault: F.Fault, ranks: Sequence[RankOutcome], offset_ns: int) -> FaultRecord:
    """A fault inside the ranks, from their events: one episode per step it
    fired at (a pause on every rank: from the first rank's start to the
    last one's end)."""
    spec = F.format_fault(fault)
    by_step: dict[int, list[dict[str, Any]]] = {}
    for r in ranks:
        for event in r.events:
            if event.get("spec") == spec:
                by_step.setdefault(int(event["step"]), []).append(event)
    episodes = []
    for step, events in sorted(by_step.items()):
        start = Moment.from_mono(min(int(e["at_ns"]) for e in events), offset_ns)
        ends = [int(e["end_ns"]) for e in events if e.get("end_ns") is not None]
        end = Moment.from_mono(max(ends), offset_ns) if ends else None
        episodes.append(Episode(step, start, end))
    where = "inside the ranks" if isinstance(fault, F.Pause) else "inside the rank"
    return FaultRecord.of(spec, where, episodes)


def look_late(lab: Lab) -> list[str]:
    """What someone arriving after the hang does (--snapshot-when-stuck,
    --late-agents); returns problems."""
    problems = []
    if lab.cfg.snapshot_when_stuck:
        lab.narrator.say(f"lab run {lab.run_id}: stallwatch snapshot in every node")
        problems += snapshot_nodes(lab)
    if lab.cfg.record and lab.cfg.late_agents:
        lab.narrator.say(f"lab run {lab.run_id}: starting the agents now, then a snapshot")
        start_agents(lab)
        problems += request_snapshots(lab)
    return problems


def _exits(lab: Lab) -> str:
    codes = [p.returncode for p in lab.ranks.values()]
    bad = sum(1 for c in codes if c)
    return "all with code 0" if not bad else f"{bad} of {len(codes)} with a failure"


def tell_dumps(lab: Lab) -> None:
    """Tell the dumps written, once they stand (an agent may still be
    folding its own into a peer's incident: ``narrate.HOLD_S``)."""
    deadline = time.monotonic() + 2 * HOLD_S
    lab.narrator.agent_logs(agent_logs(lab))
    while lab.narrator.dumps.held and time.monotonic() < deadline:
        time.sleep(LOOK_S)
        lab.narrator.agent_logs(agent_logs(lab))
    lab.narrator.agent_logs(agent_logs(lab), everything=True)


def say_dumps(lab: Lab) -> None:
    """The dumps written, and the command for the verdict."""
    tell_dumps(lab)
    found = dumps_found(lab.cfg)
    if not found:
        lab.narrator.say("no dump was written (the report below says what happened)")
        return
    verdict = command_text([*program(), "analyze", str(lab.cfg.dump_dir)])
    lab.narrator.say(f"{len(found)} dump(s) in {lab.cfg.dump_dir}; the verdict: {verdict}")


# --- the summary for people ---------------------------------------------------

_COLUMNS = ("rank", "node", "pid", "steps", "status", "exit", "verified", "ms/step", "error")


def summary(result: RunResult) -> str:
    rows = [_COLUMNS, *(_row(r, result.steps) for r in result.ranks)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    verdict = "ok: every rank finished and verified" if result.ok else "FAILED"
    head = [
        f"lab run {result.run_id}: {result.nodes} node(s) x {result.ranks_per_node} rank(s), "
        f"{result.steps} step(s), {result.mode}, {result.duration_s:.1f} s: {verdict}"
    ]
    head += [f"fault {f.spec}: {f.how}; {f.when()}" for f in result.faults]
    if result.neighbour_churn is not None:
        head.append(result.neighbour_churn.line())
    if result.gave_up:
        head.append(f"gave up: {result.gave_up}; stuck ranks: {result.stuck_ranks or 'none'}")
    tail = [f"dump: {d}" for d in result.dumps] + [f"teardown: {p}" for p in result.problems]
    return "\n".join([*head, *lines, *tail])


def _row(r: RankOutcome, steps: int) -> Sequence[str]:
    exit_text = r.exit_signal or ("-" if r.exit_code is None else str(r.exit_code))
    mean = sum(r.step_ms) / len(r.step_ms) if r.step_ms else 0.0
    return (
        str(r.world_rank),
        str(r.node),
        str(r.pid or "-"),
        f"{r.steps_done}/{steps}",
        r.status,
        exit_text + _killed_text(r),
        "yes" if r.verified else _unverified(r, steps),
        f"{mean:.1f}",
        r.error or "",
    )


def _killed_text(r: RankOutcome) -> str:
    if not r.killed_by_lab:
        return ""
    if r.status in (job.STATUS_DONE, STATUS_EXITING):
        return " (killed by lab while exiting, after its last step)"
    return " (killed by lab)"


def _unverified(r: RankOutcome, steps: int) -> str:
    if r.verified_failed:
        return f"no ({r.verified_failed} wrong)"
    return "no (incomplete)" if r.steps_done < steps else "no"

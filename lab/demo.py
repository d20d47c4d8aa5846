"""``stallwatch lab demo``: the guided end-to-end example.

A 4-node x 2-rank job runs in the lab with one agent per node; one rank,
chosen at random from ``--seed``, hangs before a collective of a random step.
The agents see the stall, tell their peers, and every node dumps.  Then the
demo runs, on those dumps, ``stallwatch analyze``, the headline SQL query
(``dumpers.sqltables.HEADLINE_QUERY``), and ``stallwatch export --perfetto``, and prints each
command so that it can be run again by hand.

Every stage is a subprocess (``python -m stallwatch ...``): the commands
printed are the ones that ran.  Progress goes to stderr; the narration, the
reports and the commands to stdout (with ``--json``, a summary instead).

The analysis starts as soon as every node has written its dump, while the lab
tears down: agents take seconds to detach their uprobes, and nothing in the
analysis waits for them.

The command is ``stallwatch.commands.lab.demo``.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import random
import re
import secrets
import shutil
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TextIO

from stallwatch.dumpers.errors import ExitCode, LabError, UsageError
from stallwatch.dumpers.sqltables import HEADLINE_QUERY
from stallwatch.lab.narrate import agent_line, program
from stallwatch.lab.narrate import command_text as command_text

STEPS = 16
FIRST_HANG_STEP = 3  # every communicator has seen a few collectives by then
STALL_TIMEOUT = 5.0
POLL_S = 0.2
SETTLE_S = 1.0
SETTLE_MAX_S = 5.0
HEARTBEAT_S = 10.0
LAB_EXIT_TIMEOUT = 180.0  # the lab's own deadlines end it well before this
PERFETTO_UI = "https://ui.perfetto.dev"
BLOCK_INDENT = 4  # a command's output, shown under it
LAB_CLOCK = re.compile(r"^\[ *[\d.]+s\] ")  # the seconds lab run prefixes its lines with
# lab run's commands for reaching its agents from a shell, which the demo
# does not relay: it tears the agents down once they dumped
CLIENT_LINES = ("from this shell", " ", "(in /")


@dataclass(frozen=True, slots=True)
class Injection:
    """The hang the demo injects: a global rank, the step it blocks at, its node."""

    rank: int
    step: int
    node: int

    @property
    def spec(self) -> str:
        return f"hang:rank={self.rank},step={self.step}"


@dataclass(frozen=True, slots=True)
class DemoConfig:
    seed: int
    nodes: int
    ranks_per_node: int
    dump_dir: Path  # absolute: the lab's agents run in another working folder
    trace: Path
    json: bool
    keep: bool
    steps: int = STEPS
    stall_timeout: float = STALL_TIMEOUT


@dataclass(frozen=True, slots=True)
class Stage:
    """One subprocess that ran: the exact argv, how long, what it said."""

    name: str
    argv: tuple[str, ...]
    seconds: float
    returncode: int
    stdout: str
    stderr: str

    @property
    def command(self) -> str:
        return command_text(self.argv)


@dataclass(frozen=True, slots=True)
class DemoResult:
    seed: int
    nodes: int
    ranks_per_node: int
    injected: Injection
    dumps: tuple[str, ...]
    trace: str
    verdicts: tuple[dict[str, object], ...]
    culprit_found: bool
    seconds: dict[str, float]
    stages: tuple[Stage, ...]

    def to_json(self) -> str:
        inj = self.injected
        return json.dumps(
            {
                "seed": self.seed,
                "nodes": self.nodes,
                "ranks_per_node": self.ranks_per_node,
                "mode": "blocking",
                "injected": {"rank": inj.rank, "step": inj.step, "node": inj.node},
                "dumps": list(self.dumps),
                "trace": self.trace,
                "verdicts": list(self.verdicts),
                "culprit_found": self.culprit_found,
                "seconds": self.seconds,
                "commands": {s.name: s.command for s in self.stages},
            },
            indent=2,
        )


def choose_injection(seed: int, nodes: int, ranks_per_node: int, steps: int = STEPS) -> Injection:
    """The rank and step to hang, drawn from ``seed`` alone."""
    rng = random.Random(seed)
    rank = rng.randrange(nodes * ranks_per_node)
    step = rng.randrange(FIRST_HANG_STEP, steps - 2)
    return Injection(rank, step, rank // ranks_per_node)


def culprit_found(verdicts: Sequence[Mapping[str, object]], rank: int) -> bool:
    """A missing_rank verdict exists and every one names exactly ``rank``."""
    missing = [v for v in verdicts if v.get("kind") == "missing_rank"]
    return bool(missing) and all(v.get("ranks") == [rank] for v in missing)


def default_folder(now: datetime | None = None) -> Path:
    """A new folder under the user's cache (``$XDG_CACHE_HOME``, else
    ``~/.cache``): the demo never writes into the current folder unasked."""
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "stallwatch" / f"demo-{stamp}"


def paths_for(out: Path | None) -> tuple[Path, Path]:
    """(dump folder, trace file) inside the demo's folder (``--out``, or a new
    one under the cache).  The trace stays outside the dump folder, so that
    ``analyze DIR`` reads dumps only."""
    root = default_folder() if out is None else out.resolve()
    return root / "dumps", root / "trace.json"


def check_dump_dir(dump_dir: Path) -> None:
    if dump_dir.exists() and not dump_dir.is_dir():
        raise UsageError(f"--out: {dump_dir} exists and is not a folder")
    if dump_dir.is_dir() and any(dump_dir.rglob("*.msgpack")):
        raise UsageError(
            f"--out: {dump_dir} already holds dumps; the demo's would mix with them "
            "(give an empty or new folder)"
        )


def stallwatch(*args: str) -> tuple[str, ...]:
    """This stallwatch, as a shell finds it (``stallwatch`` where the PATH
    leads to it: the commands printed are the ones that ran)."""
    return (*program(), *args)


# --- output -------------------------------------------------------------------------


@dataclass(slots=True)
class Console:
    """Narration to ``out`` (muted with --json), progress lines to ``err``."""

    out: TextIO
    err: TextIO
    quiet: bool
    started: float = field(default_factory=time.monotonic)
    last_progress: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def progress(self, text: str) -> None:
        with self.lock:
            print(f"  [{self.elapsed():5.1f}s] {text}", file=self.err, flush=True)
            self.last_progress = time.monotonic()

    def say(self, text: str = "") -> None:
        if not self.quiet:
            print(text, file=self.out, flush=True)

    def heading(self, text: str) -> None:
        self.say(f"\n== {text}")

    def block(self, text: str) -> None:
        pad = " " * BLOCK_INDENT
        self.say("\n".join(pad + line for line in text.rstrip("\n").splitlines()))

    def columns(self) -> int | None:
        """The width of the terminal the narration goes to, if it goes to one."""
        if self.quiet or not self.out.isatty():
            return None
        try:
            return os.get_terminal_size(self.out.fileno()).columns
        except (OSError, ValueError):  # not a real file descriptor
            return shutil.get_terminal_size().columns


# --- the lab stage ------------------------------------------------------------------


@dataclass(slots=True)
class LabWatch:
    """Reads the agents' logs (for the demo's timings: ``lab run`` itself
    tells what they say) and the dump folder while the lab runs."""

    dump_dir: Path
    nodes: int
    console: Console
    offsets: dict[Path, int] = field(default_factory=dict)
    milestones: dict[str, float] = field(default_factory=dict)
    agents_up: int = 0
    stopped: int = 0

    def dumps(self) -> list[Path]:
        return sorted(p for p in self.dump_dir.rglob("*.msgpack") if not p.name.startswith("."))

    def all_dumped(self) -> bool:
        nodes = {p.parent.name for p in self.dumps()}
        return len(nodes) >= self.nodes

    def poll(self) -> None:
        for n in range(self.nodes):
            log = self.dump_dir / f"node{n}.agent.log"
            for line in self._new_lines(log):
                self._agent_line(n, line)
        if self.all_dumped():
            self.milestones.setdefault("dumps_written", self.console.elapsed())

    def _new_lines(self, log: Path) -> list[str]:
        try:
            with log.open("rb") as f:
                f.seek(self.offsets.get(log, 0))
                data = f.read()
        except OSError:
            return []
        complete = data[: data.rfind(b"\n") + 1]
        self.offsets[log] = self.offsets.get(log, 0) + len(complete)
        return complete.decode(errors="replace").splitlines()

    def _agent_line(self, node: int, line: str) -> None:
        found = agent_line(line)
        kind = found[0] if found is not None else None
        if kind == "listening":
            self.agents_up += 1
            if self.agents_up == self.nodes:
                self.milestones["agents_up"] = self.console.elapsed()
        if kind == "stall":
            self.milestones.setdefault("stall_detected", self.console.elapsed())
        if kind == "stopping":
            self.milestones.setdefault("agents_stopping", self.console.elapsed())
        if kind == "stopped":
            self.stopped += 1
            if self.stopped == self.nodes:
                self.milestones["agents_stopped"] = self.console.elapsed()


def _pump(stream: TextIO, sink: Callable[[str], None]) -> None:
    with stream:  # closed at its end: the process's pipe is ours to close
        for line in stream:
            sink(line.rstrip("\n"))


@dataclass(slots=True)
class LabProcess:
    """``stallwatch lab run ... --record`` as a subprocess, watched."""

    argv: tuple[str, ...]
    proc: subprocess.Popen[str]
    stdout: list[str]
    stderr: list[str]
    threads: list[threading.Thread]
    started: float = field(default_factory=time.monotonic)
    seconds: float = 0.0  # from start to exit, once finished

    @classmethod
    def start(cls, argv: tuple[str, ...], console: Console) -> LabProcess:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, bufsize=1,
        )  # fmt: skip
        out: list[str] = []
        err: list[str] = []

        def on_err(line: str) -> None:
            err.append(line)
            said = LAB_CLOCK.sub("", line, count=1)  # on the demo's clock
            if not said.startswith(CLIENT_LINES):  # the demo tears the agents down at once
                console.progress(said)

        assert proc.stdout is not None and proc.stderr is not None
        threads = [
            threading.Thread(target=_pump, args=(proc.stdout, out.append), daemon=True),
            threading.Thread(target=_pump, args=(proc.stderr, on_err), daemon=True),
        ]
        for t in threads:
            t.start()
        return cls(argv, proc, out, err, threads)

    def finish(self, timeout: float = LAB_EXIT_TIMEOUT) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.terminate()  # the runner tears down on SIGTERM like on Ctrl-C
            code = self.proc.wait(timeout=60)
        for t in self.threads:
            t.join(timeout=5)
        self.seconds = round(time.monotonic() - self.started, 2)
        return code


def lab_argv(cfg: DemoConfig, inj: Injection) -> tuple[str, ...]:
    return stallwatch(
        "lab", "run", "--nodes", str(cfg.nodes), "--ranks-per-node", str(cfg.ranks_per_node),
        "--steps", str(cfg.steps), "--fault", inj.spec, "--record",
        "--dump-dir", str(cfg.dump_dir), "--stall-timeout", f"{cfg.stall_timeout:g}",
    )  # fmt: skip


def wait_for_dumps(lab: LabProcess, watch: LabWatch, console: Console) -> None:
    """Until every node has dumped, or the lab ended without it."""
    while lab.proc.poll() is None and not watch.all_dumped():
        watch.poll()
        if time.monotonic() - console.last_progress > HEARTBEAT_S:
            console.progress(f"waiting: {watch.agents_up}/{watch.nodes} agents up, "
                             f"{len(watch.dumps())} dump(s)")  # fmt: skip
        time.sleep(POLL_S)
    watch.poll()
    settle(watch)


def settle(watch: LabWatch) -> None:
    """Until the dump files stay the same for SETTLE_S: an agent that detected
    the stall itself renames its dump to the incident its peer named first."""
    deadline = time.monotonic() + SETTLE_MAX_S
    seen, since = watch.dumps(), time.monotonic()
    while time.monotonic() - since < SETTLE_S and time.monotonic() < deadline:
        time.sleep(POLL_S)
        watch.poll()
        now = watch.dumps()
        if now != seen:
            seen, since = now, time.monotonic()


# --- the analysis stages --------------------------------------------------------------


def run_stage(
    name: str, argv: tuple[str, ...], console: Console, for_people: bool = False
) -> Stage:
    """One command; ``for_people`` (a report the demo shows) on a terminal
    as wide as what is left of the demo's beside the block's indent, when
    the demo prints to one: the report fits it, as by hand."""
    text = command_text(("stallwatch", *argv[len(program()) :]))
    first = text.split("\n")[0]
    console.progress(f"{name}: {first}{' ...' if first != text else ''}")
    started = time.monotonic()
    columns = console.columns() if for_people else None
    if columns is not None:
        done = run_on_terminal(argv, columns - BLOCK_INDENT)
    else:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    seconds = round(time.monotonic() - started, 2)
    console.progress(f"{name}: exit {done.returncode} after {seconds:.1f} s")
    return Stage(name, argv, seconds, done.returncode, done.stdout, done.stderr)


def run_on_terminal(argv: Sequence[str], columns: int) -> subprocess.CompletedProcess[str]:
    """``argv`` with its stdout on a pseudo-terminal ``columns`` wide (its
    stderr on a pipe), as a person's shell runs it; the output with the
    terminal's line ends made plain."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {**os.environ, "COLUMNS": str(columns)}
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=slave,
                            stderr=subprocess.PIPE, env=env)  # fmt: skip
    os.close(slave)
    err: list[bytes] = []
    stderr = proc.stderr
    assert stderr is not None
    reader = threading.Thread(target=lambda: err.append(stderr.read()), daemon=True)
    reader.start()
    out = bytearray()
    while True:
        try:
            data = os.read(master, 1 << 16)
        except OSError:  # EIO: the command closed its end
            break
        if not data:
            break
        out += data
    os.close(master)
    code = proc.wait()
    reader.join()
    stderr.close()
    text = out.decode(errors="replace").replace("\r\n", "\n")
    return subprocess.CompletedProcess(argv, code, text, b"".join(err).decode(errors="replace"))


def verdicts_of(stage: Stage) -> tuple[dict[str, object], ...]:
    try:
        doc = json.loads(stage.stdout)
        return tuple(v for inc in doc["incidents"] for v in inc["verdicts"])
    except (ValueError, KeyError, TypeError):
        return ()


def show_stage(console: Console, stage: Stage, ok_codes: Sequence[int] = (0, 1)) -> None:
    console.say(f"$ {stage.command}")
    console.block(stage.stdout or "(no output)")
    if stage.returncode not in ok_codes or (stage.stderr.strip() and stage.returncode):
        console.block(stage.stderr)


# --- the demo --------------------------------------------------------------------------


def narrate_start(console: Console, cfg: DemoConfig, inj: Injection) -> None:
    world = cfg.nodes * cfg.ranks_per_node
    console.say(
        f"stallwatch demo (seed {cfg.seed}): a training job of {cfg.nodes} nodes x "
        f"{cfg.ranks_per_node} ranks ({world} ranks) runs {cfg.steps} steps of collectives.\n"
        "Each node is a network namespace with its own stallwatch agent recording every NCCL\n"
        "call with eBPF. We inject a hang: rank "
        f"{inj.rank} (on node{inj.node}) will block before its collectives of step {inj.step}.\n"
        f"The other ranks will wait for it; after {cfg.stall_timeout:g} s an agent calls it a "
        "stall,\ntells its peers, and every node dumps its rings. Then we ask the analyzer "
        "who did it.\n"
        f"Dumps go to {cfg.dump_dir}. Setting up takes a few seconds (progress below)."
    )


def run_lab(cfg: DemoConfig, inj: Injection, console: Console) -> tuple[LabProcess, LabWatch]:
    console.heading("1. the job runs, hangs, and every node dumps")
    lab = LabProcess.start(lab_argv(cfg, inj), console)
    watch = LabWatch(cfg.dump_dir, cfg.nodes, console)
    try:
        wait_for_dumps(lab, watch, console)
    except BaseException:
        lab.finish()
        raise
    if lab.proc.poll() is not None and lab.proc.returncode == ExitCode.USAGE:
        lab.finish()
        raise LabError("lab run failed: " + (lab.stderr[-1] if lab.stderr else "no message"))
    return lab, watch


def show_dumps(console: Console, dumps: Sequence[Path], nodes: int) -> None:
    if not dumps:
        console.say("No dump was written: the lab's report below says what happened.")
        return
    console.say(f"{len(dumps)} dump(s) from {nodes} node(s); the hung rank's node dumps too, "
                "on its peers' request:")  # fmt: skip
    for p in dumps:
        console.say(f"    {p}  ({p.stat().st_size / 1e6:.2f} MB)")


def analysis_stages(cfg: DemoConfig, console: Console) -> list[Stage]:
    d = str(cfg.dump_dir)
    console.heading("2. stallwatch analyze: the culprit")
    console.say("The analyzer matches each communicator's n-th collective across ranks; "
                "the rank that never\nentered the frontier collective is the culprit.")  # fmt: skip
    report = run_stage("analyze", stallwatch("analyze", d), console, for_people=True)
    show_stage(console, report)
    as_json = run_stage("analyze_json", stallwatch("analyze", d, "--json"), console)
    console.heading("3. SQL: slow AllReduces and their ranks' retransmits inside them")
    nodes = [str(p) for p in sorted(cfg.dump_dir.glob("node*")) if p.is_dir()]
    query = run_stage(
        "query", stallwatch("query", *nodes, HEADLINE_QUERY), console, for_people=True
    )
    show_stage(console, query, ok_codes=(0,))
    console.say("Each row: an AllReduce slower than 50 ms, with the TCP retransmits of its "
                "rank's own\nconnections inside its window: sent from the rank's end, and "
                "received (its peers' hosts\nsent them; every host's times are on one clock). "
                "Calls still in flight at the dump have\nno duration yet; a lossy link would "
                "show many retransmits here.")  # fmt: skip
    console.heading("4. the incident as a timeline")
    export = run_stage("export", stallwatch("export", "--perfetto", d, "-o", str(cfg.trace)),
                       console)  # fmt: skip
    show_stage(console, export, ok_codes=(0,))
    console.say(f"Open {PERFETTO_UI}, click 'Open trace file' and pick {cfg.trace}: one "
                "process per node,\none track per rank and communicator, the verdict as a "
                "marker at the dump time.")  # fmt: skip
    return [report, as_json, query, export]


def finish_lab(lab: LabProcess, watch: LabWatch, console: Console) -> float:
    """Waits for the lab's teardown; returns how long the demo waited for it."""
    started = time.monotonic()
    if lab.proc.poll() is None:
        console.progress("waiting for the lab to tear down (agents detach their probes)")
    deadline = started + LAB_EXIT_TIMEOUT
    while lab.proc.poll() is None and time.monotonic() < deadline:
        watch.poll()
        time.sleep(POLL_S)
    watch.poll()
    code = lab.finish()
    waited = round(time.monotonic() - started, 2)
    console.progress(f"lab run: exit {code} (1 is expected: a rank hung)")
    console.heading("the lab's own report")
    console.block("\n".join(lab.stdout))
    return waited


def remove_agent_logs(cfg: DemoConfig) -> None:
    for n in range(cfg.nodes):
        (cfg.dump_dir / f"node{n}.agent.log").unlink(missing_ok=True)


def by_hand(console: Console, lab: LabProcess, stages: Sequence[Stage]) -> None:
    console.heading("run it by hand")
    for s in (command_text(lab.argv), *(s.command for s in stages if s.name != "analyze_json")):
        console.say(f"  {s}")
    if program() != ["stallwatch"]:
        console.say("(`stallwatch` alone where the PATH leads to this one: scripts/setup links "
                    "it; analyze --json for programs)")  # fmt: skip


def run_demo(cfg: DemoConfig, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> DemoResult:
    check_dump_dir(cfg.dump_dir)
    cfg.dump_dir.mkdir(parents=True, exist_ok=True)
    console = Console(out, err, quiet=cfg.json)
    inj = choose_injection(cfg.seed, cfg.nodes, cfg.ranks_per_node, cfg.steps)
    narrate_start(console, cfg, inj)
    lab, watch = run_lab(cfg, inj, console)
    try:
        dumps = watch.dumps()
        show_dumps(console, dumps, cfg.nodes)
        stages = analysis_stages(cfg, console) if dumps else []
    finally:
        waited = finish_lab(lab, watch, console)
    verdicts = verdicts_of(stages[1]) if stages else ()
    found = culprit_found(verdicts, inj.rank)
    if found and not cfg.keep:
        remove_agent_logs(cfg)
    seconds = timings(watch, stages, waited, console.elapsed()) | {"lab_run": lab.seconds}
    lab_stage = Stage("lab_run", lab.argv, lab.seconds, lab.proc.returncode,
                      "\n".join(lab.stdout), "\n".join(lab.stderr))  # fmt: skip
    result = DemoResult(
        seed=cfg.seed,
        nodes=cfg.nodes,
        ranks_per_node=cfg.ranks_per_node,
        injected=inj,
        dumps=tuple(map(str, dumps)),
        trace=str(cfg.trace),
        verdicts=verdicts,
        culprit_found=found,
        seconds=seconds,
        stages=(lab_stage, *stages),
    )
    conclude(console, result, lab, stages)
    return result


def timings(
    watch: LabWatch, stages: Sequence[Stage], waited: float, total: float
) -> dict[str, float]:
    m = watch.milestones
    out = {  # milestones: seconds since the demo started (0: not seen)
        "agents_up": m.get("agents_up", 0.0),
        "stall_detected": m.get("stall_detected", 0.0),
        "dumps_written": m.get("dumps_written", 0.0),
        "agents_stopping": m.get("agents_stopping", 0.0),
    }
    if "agents_stopping" in m and "agents_stopped" in m:  # a duration
        out["agents_detach"] = m["agents_stopped"] - m["agents_stopping"]
    out |= {s.name: s.seconds for s in stages}
    out["lab_teardown_wait"] = waited
    out["total"] = round(total, 2)
    return {k: round(v, 2) for k, v in out.items()}


def conclude(
    console: Console, result: DemoResult, lab: LabProcess, stages: Sequence[Stage]
) -> None:
    inj = result.injected
    if result.culprit_found:
        console.heading(f"found it: the analyzer named rank {inj.rank}, the rank we hung "
                        f"(node{inj.node}, step {inj.step})")  # fmt: skip
    else:
        named = [v.get("ranks") for v in result.verdicts if v.get("kind") == "missing_rank"]
        console.heading(f"MISSED: we hung rank {inj.rank} at step {inj.step}; the missing_rank "
                        f"verdicts name {named or 'nobody'}")  # fmt: skip
    by_hand(console, lab, stages)
    s = result.seconds
    console.progress(f"done in {s['total']:.0f} s (dumps after {s['dumps_written']:.0f} s; "
                     f"waited {s['lab_teardown_wait']:.0f} s for the lab's teardown)")  # fmt: skip
    if console.quiet:
        print(result.to_json(), file=console.out, flush=True)


def new_seed() -> int:
    return secrets.randbelow(1_000_000)

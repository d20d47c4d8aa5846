"""The live verdict on a real hang: a 4x2 lab job (one agent per node, real
eBPF, token and mutual TLS) hangs; ``stallwatch analyze --agents`` over the
4 agents, run from node 0's namespace while the job is still hung and
before any agent wrote a dump (their stall timeout is far away), names the
hung rank.  The job is the one docs/runbook.md's rehearsal command makes
(parsed by the command line's own parser, run here); the 10-seed loop
(``python -m tests.analyzer.test_live_lab SEEDS``, ``live_verdict_on_hang``)
hangs a rank drawn at random instead.

The same hung job rehearses the runbook from the host's shell: the commands
the lab prints once its agents are ready, run exactly as printed, and then
docs/runbook.md's runnable commands, in a new login shell, in the folder
the rehearsal command names (``tests.docs.runnable``), which outlives the lab.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from stallwatch.commands.lab.run import config_from
from stallwatch.commands.main import build_parser, parse
from stallwatch.dumpers.format import read_dump
from stallwatch.lab import faults, job, netns, runner
from stallwatch.lab.runner import AGENT_PORT, Lab, agent_dump_dir
from tests.docs import runnable

pytestmark = [pytest.mark.bpf, pytest.mark.lab, pytest.mark.slow]

NODES, RANKS_PER_NODE = 4, 2
# The agents would dump the hang after this long: the live verdict comes first.
AGENT_STALL_TIMEOUT_S = 120.0
QUIET_S = 3.0  # no rank moved for this long: the job is hung


@dataclass(frozen=True, slots=True)
class LiveOutcome:
    culprit: int
    step: int
    kind: str | None  # the first verdict's
    ranks: tuple[int, ...]  # its world ranks
    exit_code: int
    dumps_before: int  # dump files on the nodes when the verdict came
    still_hung: bool  # every rank still running when the verdict came
    seconds: float  # the command, end to end
    report: str

    @property
    def named(self) -> bool:
        return self.kind == "missing_rank" and self.ranks == (self.culprit,)


def _dumps(lab: Lab) -> int:
    return sum(len(list(agent_dump_dir(lab.cfg, k).glob("*.msgpack"))) for k in range(NODES))


def quiet(since: float) -> bool:
    return time.monotonic() - since >= QUIET_S


def _wait_hung(lab: Lab, culprit: int, timeout: float = 180.0) -> int:
    """Until the culprit says it hangs and no rank moved for QUIET_S (the
    agents told ready as the runner tells them, for ``agents=ready``);
    returns the step it hangs at."""
    deadline = time.monotonic() + timeout
    last, since = runner.progress(lab), time.monotonic()
    while time.monotonic() < deadline:
        runner.say_agents_ready(lab)
        time.sleep(0.2)
        now = runner.progress(lab)
        report = job.read_report(lab.run_dir, culprit)
        if now != last:
            last, since = now, time.monotonic()
        elif report is not None and report.status == job.STATUS_HUNG and quiet(since):
            return report.steps_done
        assert not now[1], f"ranks exited: {sorted(now[1])}"
    raise AssertionError(f"rank {culprit} did not hang within {timeout:g} s: {last}")


def _client_args(lab: Lab) -> list[str]:
    """--agents and how to reach them (the run's token and mutual TLS)."""
    assert lab.certs is not None
    tls = lab.certs.client()
    assert tls.cert is not None and tls.key is not None
    agents = ",".join(f"{lab.node(k).ip}:{AGENT_PORT}" for k in range(NODES))
    return [
        *("--agents", agents, "--token-file", str(lab.run_dir / "agent.token")),
        *("--tls-ca", str(tls.ca), "--tls-cert", str(tls.cert), "--tls-key", str(tls.key)),
    ]


def stallwatch_in_node0(lab: Lab, *args: str) -> subprocess.CompletedProcess[str]:
    """A ``stallwatch`` command as an operator on node 0 would run it."""
    argv = [*lab.node(0).exec_prefix(), sys.executable, "-m", "stallwatch", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=lab.run_dir)


@dataclass(frozen=True, slots=True)
class HungLab:
    lab: Lab
    culprit: int
    step: int
    said: io.StringIO  # what the lab printed while it set up and ran


@contextlib.contextmanager
def hung_lab(seed: int, dump_dir: Path) -> Iterator[HungLab]:
    """A 4x2 lab job, one agent per node, hung at a rank and step drawn from
    ``seed``; torn down on the way out."""
    rng = random.Random(seed)
    culprit, step = rng.randrange(NODES * RANKS_PER_NODE), rng.randint(2, 5)
    cfg = runner.RunConfig(
        nodes=NODES,
        ranks_per_node=RANKS_PER_NODE,
        steps=step + 4,
        timeout=300.0,
        record=True,
        dump_dir=dump_dir,
        stall_timeout=AGENT_STALL_TIMEOUT_S,
        faults=faults.parse_faults([f"hang:rank={culprit},step={step}"]),
        run_id=netns.new_run_id("v"),  # a subnet no other lab of the machine routes
    )
    with _hung(cfg) as hung:
        yield hung


def rehearsal_config(home: Path, dump_dir: Path) -> runner.RunConfig:
    """The lab job of docs/runbook.md's rehearsal, its command parsed by the
    command line's own parser (``~`` is ``home``), its dumps in ``dump_dir``
    and on a subnet no other lab of the machine routes."""
    ((command,),) = [b.commands for b in runnable.of_context("rehearsal")]
    argv = shlex.split(command.replace("\\\n", " "))
    assert argv[:3] == ["stallwatch", "lab", "run"], argv
    saved = os.environ.get("HOME")
    os.environ["HOME"] = str(home)  # the shell's ~, as the command line expands it
    try:
        cfg = config_from(parse(build_parser(), argv[1:]))
    finally:
        if saved is not None:
            os.environ["HOME"] = saved
    return dataclasses.replace(cfg, dump_dir=dump_dir, run_id=netns.new_run_id("v"))


@contextlib.contextmanager
def _hung(cfg: runner.RunConfig) -> Iterator[HungLab]:
    """The job of ``cfg`` (one hang fault), up to its hang; torn down on the
    way out."""
    (culprit,) = [f.rank for f in cfg.faults if isinstance(f, faults.Hang)]
    said = io.StringIO()
    lab = runner.make_lab(cfg, runner.preflight(cfg), said)
    try:
        runner.set_up(lab)
        step = _wait_hung(lab, culprit)
        yield HungLab(lab, culprit, step, said)
    finally:
        lab.teardown()
        for proc in lab.ranks.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=60)


def live_verdict(hung: HungLab) -> LiveOutcome:
    """``stallwatch analyze --agents ... --json`` from node 0, now."""
    lab = hung.lab
    started = time.monotonic()
    done = stallwatch_in_node0(lab, "analyze", *_client_args(lab), "--json")
    seconds = time.monotonic() - started
    still_hung = all(p.poll() is None for p in lab.ranks.values())
    try:
        incidents = json.loads(done.stdout)["incidents"]
    except (ValueError, KeyError):  # said in the report: exit code and stderr
        incidents = []
    first = incidents[0]["verdicts"][0] if incidents else {}
    return LiveOutcome(
        hung.culprit,
        hung.step,
        first.get("kind"),
        tuple(first.get("ranks", ())),
        done.returncode,
        _dumps(lab),
        still_hung,
        seconds,
        done.stdout + done.stderr,
    )


def live_verdict_on_hang(seed: int, dump_dir: Path) -> LiveOutcome:
    with hung_lab(seed, dump_dir) as hung:
        return live_verdict(hung)


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The home of the rehearsal's shells (its ``~``)."""
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def hung(home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HungLab]:
    """docs/runbook.md's rehearsal, hung; once it is torn down, what the
    runbook wrote in its client folder is still there."""
    cfg = rehearsal_config(home, tmp_path_factory.mktemp("live-lab"))
    assert cfg.client_dir == home / "rehearsal"
    with _hung(cfg) as the_lab:
        yield the_lab
        kept = sorted(p.name for p in cfg.client_dir.iterdir())
    assert sorted(p.name for p in cfg.client_dir.iterdir()) == kept  # the teardown kept them


def test_live_verdict_names_the_hung_rank_before_any_dump(hung: HungLab) -> None:
    got = live_verdict(hung)
    assert got.still_hung and got.dumps_before == 0, got
    assert got.named and got.exit_code == 1, got


# ---- the lab's printed commands, from the host's shell ------------------------------


def printed_commands(said: str) -> list[str]:
    """The commands the lab printed for reaching its agents, each with its
    continuation lines, as a person would copy them."""
    block = said.split("from this shell, while the job runs", 1)[1].split("\n[", 1)[0]
    commands: list[str] = []
    for line in block.splitlines()[1:]:
        if commands and commands[-1].endswith("\\"):
            commands[-1] += "\n" + line
        else:
            commands.append(line.strip())
    return commands


def test_the_printed_commands_run_from_the_host_shell(
    hung: HungLab, home: Path, tmp_path: Path
) -> None:
    """Once its agents are ready, the lab prints how to reach them; run as
    printed from the host's shell while the job hangs (no dump yet): the
    live verdict names the hung rank, the query lists the calls in flight,
    collect names every agent and why it has nothing yet."""
    said = hung.said.getvalue()
    commands = printed_commands(said)
    assert [c.split()[1] for c in commands] == ["analyze", "query", "collect"], said
    assert all(len(line) < 100 for c in commands for line in c.splitlines()), commands
    printed = runnable.Block(runnable.ROOT / "lab run", 0, tuple(commands), True, "runbook", 0)
    verdict, query, collect = runnable.run_in_login_shell([printed], tmp_path, home)
    assert verdict.code == 1, verdict
    assert f"MISSING_RANK: rank {hung.culprit} never entered" in verdict.output, verdict
    # every rank but the hung one waits in a call (blocking mode: one each)
    in_flight = {int(line.split()[1]) for line in query.output.splitlines() if line[:4] == "node"}
    assert query.code == 0 and f"({NODES * RANKS_PER_NODE - 1} rows)" in query.output, query
    assert in_flight == set(range(NODES * RANKS_PER_NODE)) - {hung.culprit}, query
    assert collect.code == 2 and collect.output.count("holds no dump of any incident") == NODES
    assert _dumps(hung.lab) == 0  # nothing of this wrote one


# ---- the runbook, as printed ------------------------------------------------------

RUNBOOK = Path(__file__).resolve().parents[2] / "docs" / "runbook.md"


def _first_verdict(done: subprocess.CompletedProcess[str]) -> tuple[str, list[int]]:
    assert done.returncode == 1, done.stderr  # findings
    first = json.loads(done.stdout)["incidents"][0]["verdicts"][0]
    return first["kind"], first["ranks"]


def test_runbook_runs_as_printed(hung: HungLab, home: Path) -> None:
    """docs/runbook.md, its runnable commands in order, in one new login
    shell (``cd ~/rehearsal`` first: the folder the lab wrote for a client,
    agents.txt, token, ca.pem, client.pem, client.key) while the job hangs:
    the live verdict, a dump, collect, analyze, SQL on the dumps and live,
    Perfetto; each ends as its block says."""
    where = home / "rehearsal"
    assert f"(in {where}, kept after the run" in hung.said.getvalue()
    blocks = runnable.of_context("runbook")
    assert blocks[0].commands == ("cd ~/rehearsal",)
    ran = runnable.run_in_login_shell(blocks, home, home)
    assert len(ran) >= 10 and "OUTPUT:" not in RUNBOOK.read_text()
    runnable.check(ran)
    named = f"MISSING_RANK: rank {hung.culprit} never entered"
    verdicts = [r for r in ran if r.command.startswith("stallwatch analyze")]
    assert len(verdicts) == 2 and all(named in r.output for r in verdicts), verdicts
    (collected,) = [r for r in ran if r.command.startswith("stallwatch collect")]
    assert f"{NODES} of {NODES} agents sent their dumps" in collected.output
    assert sorted(p.name for p in (where / "incident").iterdir()) == [
        f"node{k}" for k in range(NODES)
    ]
    assert json.loads((where / "trace.json").read_text())["traceEvents"]


def test_collect_gathers_the_incident_but_a_stopped_agents(hung: HungLab, tmp_path: Path) -> None:
    """The agent of a node without the culprit is stopped; collect brings the
    other three nodes' dumps of the newest incident into one folder, names the
    stopped one as lost, and analyze on the folder says what it says on
    those three nodes' dumps where they lie."""
    lab = hung.lab
    if _dumps(lab) < NODES:  # the runbook's test had every node dump: else, now
        address = f"{lab.node(0).ip}:{AGENT_PORT}"
        asked = stallwatch_in_node0(lab, "dump", "--agent", address, *_client_args(lab)[2:])
        assert asked.returncode == 0, asked.stderr
        runner.wait_for_dumps(lab)
    assert _dumps(lab) == NODES
    culprit_node = hung.culprit // RANKS_PER_NODE
    stopped = next(k for k in range(1, NODES) if k != culprit_node)
    lab.agents[stopped].request_stop()
    assert lab.agents[stopped].wait_stopped(120) is None

    out = tmp_path / "incident"
    done = stallwatch_in_node0(lab, "collect", *_client_args(lab), "-o", str(out), "--json")
    assert done.returncode == 1, done.stderr  # one agent sent nothing
    doc = json.loads(done.stdout)
    newest = read_dump(max(agent_dump_dir(lab.cfg, 0).glob("*.msgpack"))).trigger
    assert newest is not None and doc["incident_id"] == newest.incident_id
    lost = {r["agent"] for r in doc["agents"] if r["lost"]}
    assert lost == {f"{lab.node(stopped).ip}:{AGENT_PORT}"}
    hosts = sorted(p.name for p in out.iterdir())
    assert hosts == [f"node{k}" for k in range(NODES) if k != stopped]

    where = [str(agent_dump_dir(lab.cfg, k)) for k in range(NODES) if k != stopped]
    on_nodes = _first_verdict(stallwatch_in_node0(lab, "analyze", *where, "--json"))
    collected = _first_verdict(stallwatch_in_node0(lab, "analyze", str(out), "--json"))
    assert collected == on_nodes == ("missing_rank", [hung.culprit])


def main(argv: list[str]) -> int:
    """The seed loop: one line per seed, then the count named."""
    seeds = [int(a) for a in argv] or list(range(10))
    named = 0
    for seed in seeds:
        with tempfile.TemporaryDirectory(prefix="live-seed-") as tmp:
            got = live_verdict_on_hang(seed, Path(tmp))
        named += got.named and got.still_hung and got.dumps_before == 0
        print(
            f"seed {seed}: hang rank {got.culprit} step {got.step}: {got.kind} {list(got.ranks)} "
            f"in {got.seconds:.2f} s, still hung {got.still_hung}, dumps {got.dumps_before}",
            flush=True,
        )
    print(f"{named} of {len(seeds)} named while hung, before any dump")
    return 0 if named == len(seeds) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

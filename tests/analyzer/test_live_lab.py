"""The live verdict on a real hang: a 4x2 lab job (one agent per node, real
eBPF, token and mutual TLS) hangs at a random rank; ``stallwatch analyze
--agents`` over the 4 agents, run from node 0's namespace while the job is
still hung and before any agent wrote a dump (their stall timeout is far
away), names the hung rank.  ``live_verdict_on_hang`` is also what the
10-seed loop runs (``python -m tests.analyzer.test_live_lab SEEDS``).

The same hung job rehearses the runbook from the host's shell: the commands
the lab prints once its agents are ready, run exactly as printed, and then
docs/runbook.md's commands, in the folder the lab wrote for a client.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from stallwatch.dumpers.format import read_dump
from stallwatch.lab import faults, netns, runner
from stallwatch.lab.runner import AGENT_PORT, Lab, agent_dump_dir

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


def _wait_hung(lab: Lab, step: int, timeout: float = 120.0) -> None:
    """Until the ranks got to the hang and none moved for QUIET_S."""
    deadline = time.monotonic() + timeout
    last, since = runner.progress(lab), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = runner.progress(lab)
        if now != last:
            last, since = now, time.monotonic()
        elif min(last[0]) >= step and time.monotonic() - since >= QUIET_S:
            return
        assert not now[1], f"ranks exited: {sorted(now[1])}"
    raise AssertionError(f"the job did not hang at step {step} within {timeout:g} s: {last}")


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
    said = io.StringIO()
    lab = runner.make_lab(cfg, runner.preflight(cfg), said)
    try:
        runner.set_up(lab)
        _wait_hung(lab, step)
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
def hung(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HungLab]:
    seed = random.SystemRandom().randrange(1 << 16)
    print(f"hung lab: seed {seed}")
    with hung_lab(seed, tmp_path_factory.mktemp("live-lab")) as the_lab:
        yield the_lab


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


def test_the_printed_commands_run_from_the_host_shell(hung: HungLab, tmp_path: Path) -> None:
    """Once its agents are ready, the lab prints how to reach them; run as
    printed from the host's shell while the job hangs (no dump yet): the
    live verdict names the hung rank, the query lists the calls in flight,
    collect names every agent and why it has nothing yet."""
    said = hung.said.getvalue()
    commands = printed_commands(said)
    assert [c.split()[1] for c in commands] == ["analyze", "query", "collect"], said
    assert all(len(line) < 100 for c in commands for line in c.splitlines()), commands
    ran = run_as_printed(commands, tmp_path)
    verdict, query, collect = ran
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
RUNBOOK_BLOCK = re.compile(r"^```sh runbook\n(.*?)^```$", re.M | re.S)


def runbook_commands(text: str) -> list[str]:
    """The commands of the runbook's ``sh runbook`` blocks, in order, each
    with its continuation lines (comments and blank lines dropped)."""
    commands: list[str] = []
    for block in RUNBOOK_BLOCK.findall(text):
        pending = ""
        for line in block.splitlines():
            if not pending and (not line.strip() or line.lstrip().startswith("#")):
                continue
            pending += line + "\n"
            if not line.endswith("\\"):
                commands.append(pending.rstrip("\n"))
                pending = ""
        assert not pending, f"a command of the runbook ends in a continuation: {pending!r}"
    return commands


MARKER = "@@stallwatch-exit="


@dataclass(frozen=True, slots=True)
class Ran:
    command: str
    code: int
    output: str


def _split_runs(commands: list[str], done: subprocess.CompletedProcess[str]) -> list[Ran]:
    """out0 MARKER rc0 \\n out1 MARKER rc1 \\n ...: each command's output and code."""
    parts = done.stdout.split(MARKER)
    outputs = [parts[0]] + [p.split("\n", 1)[1] if "\n" in p else "" for p in parts[1:]]
    codes = [int(p.split("\n", 1)[0]) for p in parts[1:]]
    assert len(codes) == len(commands), done.stdout + done.stderr
    return [Ran(c, code, out) for c, code, out in zip(commands, codes, outputs, strict=False)]


def run_as_printed(commands: list[str], where: Path) -> list[Ran]:
    """Each command in one bash session of the host's shell (its variables
    kept from one to the next), ``stallwatch`` on its PATH, as an operator
    would paste them."""
    script = "exec 2>&1\n" + "".join(f'{c}\necho "{MARKER}$?"\n' for c in commands)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    done = subprocess.run(
        ["bash", "--norc", "--noprofile"],
        input=script,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=where,
        env=env,
    )
    return _split_runs(commands, done)


def _first_verdict(done: subprocess.CompletedProcess[str]) -> tuple[str, list[int]]:
    assert done.returncode == 1, done.stderr  # findings
    first = json.loads(done.stdout)["incidents"][0]["verdicts"][0]
    return first["kind"], first["ranks"]


def test_runbook_runs_as_printed(hung: HungLab) -> None:
    """docs/runbook.md, its ``sh runbook`` commands in order, in one shell of
    the host, in the folder the lab wrote for a client (agents.txt, token,
    ca.pem, client.pem, client.key) while the job hangs: the live verdict, a
    dump, collect, analyze, SQL on the dumps and live, Perfetto."""
    where = hung.lab.run_dir / runner.CLIENT_DIR
    assert f"(in {where}, gone at teardown" in hung.said.getvalue()
    commands = runbook_commands(RUNBOOK.read_text())
    assert len(commands) >= 8 and "OUTPUT:" not in RUNBOOK.read_text()
    ran = run_as_printed(commands, where)
    for r in ran:
        findings = r.command.startswith("stallwatch analyze")
        assert r.code == (1 if findings else 0), f"{r.command}: exit {r.code}\n{r.output}"
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

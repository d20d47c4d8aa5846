"""How a lab run ends, and what it says of it: a job whose every rank did
its last step is never FAILED (a rank still exiting is killed and shown
``exiting``); there is no deadline unless ``--timeout`` sets one, and every
option's default is in ``--help``; ``--dump-at-end`` dumps at the end even
when the agents dumped an incident first; ``--client-dir`` outlives the run."""

from __future__ import annotations

import dataclasses
import io
import json
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stallwatch.commands.main import build_parser
from stallwatch.dumpers.format import dump_trigger
from stallwatch.lab import job, runner
from stallwatch.lab.narrate import Narrator
from tests.lab.test_run import ROOT, assert_nothing_left

LAB_RUN = (
    next(
        sub
        for name, sub in build_parser()._subparsers._group_actions[0].choices.items()  # type: ignore[union-attr]
        if name == "lab"
    )
    ._subparsers._group_actions[0]
    .choices["run"]
)  # type: ignore[union-attr]


def test_every_option_of_lab_run_says_its_default() -> None:
    """Flags are off unless given; every other option's help names its
    default, a ``None`` one too (what none means)."""
    flat = " ".join(LAB_RUN.format_help().split())
    shown = LAB_RUN._get_formatter()
    for action in LAB_RUN._actions:
        if not action.option_strings or action.nargs == 0 or action.dest == "help":
            continue
        assert "default" in shown._get_help_string(action), action.option_strings
    assert "--timeout SEC give up after SEC in all (default: none" in flat


def _report(run_dir: Path, rank: int, steps_done: int, steps: int) -> None:
    rep = job.RankReport(
        world_rank=rank, node=0, local_rank=rank, pid=0, mode="blocking", steps_total=steps,
        steps_done=steps_done, verified_ok=5 * steps_done, verified_failed=0,
        status=job.STATUS_RUNNING, error=None, exit_code=None, calls={}, comms={}, step_ms=[],
        step_start_ns=[], cpu_s=0.0, wall_s=0.0, run_delay_ms=0.0, compute_cpu_share=0.0,
        injected=[], events=[], device_log=[],
    )  # fmt: skip
    job.write_atomic(job.report_path(run_dir, rank), rep.to_json())


@pytest.fixture
def slow_exits(tmp_path: Path) -> Iterator[runner.Lab]:
    """Two rank processes that did their last step and do not exit (they
    sleep), as a rank stuck destroying its communicators would."""
    cfg = runner.RunConfig(nodes=1, ranks_per_node=2, steps=3, stall_timeout=1.0)
    lab = runner.Lab(cfg, Path("/nonexistent"), "x", tmp_path, narrator=Narrator(io.StringIO()))
    for rank in range(2):
        _report(tmp_path, rank, 3, 3)
        lab.ranks[rank] = subprocess.Popen(["sleep", "60"])
    yield lab
    for proc in lab.ranks.values():
        proc.kill()
        proc.wait()


def test_ranks_that_did_their_last_step_end_the_job_and_it_is_not_failed(
    slow_exits: runner.Lab,
) -> None:
    lab = slow_exits
    started = time.monotonic()
    assert runner.wait_for_job(lab, started) is None  # not given up: ended
    assert 1.0 <= time.monotonic() - started < 10  # after --stall-timeout to exit
    stuck = runner.stop_stuck(lab)
    ranks = [runner.outcome(lab, r, stuck) for r in range(2)]
    assert [(r.status, r.stuck, r.healthy) for r in ranks] == [("exiting", False, True)] * 2
    result = runner.RunResult(
        run_id="x", nodes=1, ranks_per_node=2, steps=3, mode="blocking", faults=[], ranks=ranks,
        nodes_seen=[], duration_s=1.0, gave_up=None, recorded=False, dump_dir=None, dumps=[],
    )  # fmt: skip
    assert result.ok
    text = runner.summary(result)
    assert "ok: every rank finished and verified" in text.splitlines()[0]
    assert "killed by lab while exiting, after its last step" in text


def test_ranks_short_of_their_last_step_are_stuck_and_the_job_failed(
    slow_exits: runner.Lab,
) -> None:
    lab = slow_exits
    _report(lab.run_dir, 1, 2, 3)  # one step short
    gave_up = runner.wait_for_job(lab, time.monotonic())
    assert gave_up == "no rank made progress for 1 s"
    stuck = runner.stop_stuck(lab)
    ranks = [runner.outcome(lab, r, stuck) for r in range(2)]
    assert [(r.status, r.stuck, r.healthy) for r in ranks] == [
        ("exiting", False, True),
        ("stuck", True, False),
    ]


def test_no_deadline_unless_one_is_given(slow_exits: runner.Lab) -> None:
    lab = slow_exits
    _report(lab.run_dir, 1, 2, 3)
    lab.cfg = dataclasses.replace(lab.cfg, stall_timeout=30.0, timeout=0.5)
    assert runner.wait_for_job(lab, time.monotonic()) == (
        "the job did not finish within 0.5 s (--timeout)"
    )
    assert runner.RunConfig().timeout is None


@pytest.mark.lab
def test_dump_at_end_dumps_after_an_incident_and_the_client_folder_stays(
    tmp_path: Path,
) -> None:
    """A rank crashes: the agents dump that incident; the run then asks each
    for its end-of-run dump too, which the incident's cool-down does not hold
    back.  The client's files are where --client-dir says, after the run."""
    run_id = "t" + secrets.token_hex(3)
    argv = [sys.executable, "-m", "stallwatch", "lab", "run", "--run-id", run_id, "--json"]
    # the crash a second and more into the job: its agents record both ranks first
    argv += ["--nodes", "2", "--ranks-per-node", "1", "--steps", "30", "--compute-ms", "50"]
    argv += ["--record", "--fault", "crash:rank=1,step=20", "--stall-timeout", "5"]
    argv += ["--dump-at-end"]
    argv += ["--dump-dir", str(tmp_path / "dumps"), "--client-dir", str(tmp_path / "client")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert_nothing_left(run_id)
    assert done.returncode == 1, done.stderr  # a rank crashed
    result = json.loads(done.stdout)
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((tmp_path / "dumps").glob("*.log")))
    assert result["problems"] == [], f"{result['problems']}\n{done.stderr[-3000:]}\n{logs}"
    ends = runner.end_dumps(tmp_path / "dumps")
    assert sorted(p.parent.name for p in ends) == ["node0", "node1"], result["dumps"]
    incidents = {dump_trigger(Path(p)).incident_id for p in result["dumps"]}  # type: ignore[union-attr]
    assert runner.end_incident(run_id) in incidents and len(incidents) >= 2, result["dumps"]
    assert sorted(p.name for p in (tmp_path / "client").iterdir()) == [
        "agents.txt", "ca.pem", "client.key", "client.pem", "token",
    ]  # fmt: skip

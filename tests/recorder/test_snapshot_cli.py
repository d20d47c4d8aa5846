"""``stallwatch snapshot``: this node into a dump, every agent at once, and
the mistakes a user can make, each in one line with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from stallwatch.dumpers.format import read_dump
from stallwatch.dumpers.model import Recording
from stallwatch.lab import build
from stallwatch.query.http import ServerHandle, serve_http
from stallwatch.recorder.threadreader import pyspy

SLEEPER = """
import ctypes, sys, time
ctypes.CDLL(sys.argv[1])
print("ready", flush=True)
time.sleep(120)
"""


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stallwatch", "snapshot", *args],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


@pytest.fixture
def sleeper() -> Iterator[int]:
    """A process that maps the lab's libnccl and sleeps (RANK=3 of 4)."""
    env = {"RANK": "3", "WORLD_SIZE": "4", "SECRET_TOKEN": "never-dumped"}
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(SLEEPER), str(build.ensure_built())],
        stdout=subprocess.PIPE, text=True, env={**env, "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield proc.pid
    finally:
        proc.kill()
        proc.communicate()


def test_this_node_into_a_dump(tmp_path: Path, sleeper: int) -> None:
    done = _cli("--pid", str(sleeper), "--samples", "2", "--interval", "0",
                "--dump-dir", str(tmp_path), "--host-name", "n7", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["host"] == "n7" and out["positions"][0]["world_rank"] == 3
    rec: Recording = read_dump(out["path"])
    assert rec.host == "n7" and rec.trigger is not None and rec.trigger.reason
    assert [p.pid for p in rec.processes] == [sleeper]
    assert len(rec.snapshots) == 2
    proc = rec.snapshots[-1].processes[0]
    assert dict(proc.env) == {"RANK": "3", "WORLD_SIZE": "4"}  # nothing else of its environment
    main = next(t for t in proc.threads if t.tid == sleeper)
    assert main.syscall_name == "clock_nanosleep" and main.nccl is None
    assert any("time_sleep" in f for f in main.frames), main.frames


def test_table_output_names_each_process(tmp_path: Path, sleeper: int) -> None:
    done = _cli("--pid", str(sleeper), "--samples", "1", "--dump-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert f"pid {sleeper} rank 3: inside no NCCL call" in done.stdout
    assert done.stdout.splitlines()[-1].startswith(f"wrote {tmp_path}/")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--pid", "999999999"), "--pid 999999999: no such process"),
        (("--samples", "0"), "--samples: expected >= 1, got 0"),
        (("--interval", "99"), "--interval: expected seconds from 0 to 60, got 99.0"),
        (("--agents", "a:1", "--pid", "1"), "--pid and --scope choose what this node reads"),
        (("--agents", "nohost"), "expected HOST:PORT"),
    ],
)
def test_usage_errors_are_one_line(args: tuple[str, ...], needle: str) -> None:
    done = _cli(*args)
    assert done.returncode == 2, done
    assert needle in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


class _Agent:
    """An agent's side of POST /snapshot."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.asked: list[tuple[str, str | None, int, float]] = []

    def recording(self) -> Recording:
        raise AssertionError("not asked for")

    def metrics_text(self) -> str:
        return ""

    def request_snapshot(
        self, reason: str, incident_id: str | None, samples: int, interval_s: float
    ) -> object:
        self.asked.append((reason, incident_id, samples, interval_s))
        positions = [{"pid": 7, "world_rank": 1, "error": "", "threads": [
            {"tid": 7, "name": "python", "state": "S", "syscall": "poll", "wchan": "",
             "nccl": "ncclAllReduce(count=8, float32, sum, comm=0x10)"}]}]  # fmt: skip
        return {"host": self.host, "incident_id": incident_id, "status": "written",
                "path": f"/d/{self.host}.msgpack", "positions": positions}  # fmt: skip


def test_every_agent_at_once_under_one_incident() -> None:
    agents = [_Agent("n0"), _Agent("n1")]
    servers: list[ServerHandle] = [serve_http(a, "127.0.0.1:0", None) for a in agents]
    try:
        where = ",".join(s.address for s in servers)
        done = _cli("--agents", where, "--samples", "2", "--interval", "0.1")
        dead = _cli("--agents", f"{where},127.0.0.1:1")
    finally:
        for s in servers:
            s.close()
    assert done.returncode == 0, done.stderr
    ids = {a.asked[0][1] for a in agents}
    assert len(ids) == 1 and None not in ids
    assert all(a.asked[0][2:] == (2, 0.1) for a in agents)
    assert "n0: written /d/n0.msgpack" in done.stdout and "n1: written /d/n1.msgpack" in done.stdout
    assert "pid 7 rank 1: thread 7 inside ncclAllReduce(count=8" in done.stdout
    # a partial answer: the agent that failed named once, on stderr; the others shown
    assert dead.returncode == 1, dead.stderr
    assert dead.stderr.count("127.0.0.1:1") == 1 and "127.0.0.1:1: unreachable" in dead.stderr
    assert "127.0.0.1:1" not in dead.stdout and "2 of 3 agents read their nodes" in dead.stdout
    assert "n0: written" in dead.stdout


def test_every_agent_over_mutual_tls_and_a_wrong_ca_named(tmp_path: Path) -> None:
    from tests.query.certs import make_certs

    certs = make_certs(tmp_path)
    agents = [_Agent("n0"), _Agent("n1")]
    servers = [serve_http(a, "127.0.0.1:0", "tok", tls=certs.server(mutual=True)) for a in agents]
    token = tmp_path / "token"
    token.write_text("tok")
    client = ["--token-file", str(token), "--tls-cert", str(certs.client_cert)]
    client += ["--tls-key", str(certs.client_key)]
    try:
        where = ",".join(s.address for s in servers)
        done = _cli("--agents", where, "--tls-ca", str(certs.ca), *client, "--interval", "0.1")
        wrong = _cli("--agents", where, "--tls-ca", str(certs.other_ca), *client)
    finally:
        for s in servers:
            s.close()
    assert done.returncode == 0, done.stderr
    assert all(len(a.asked) == 1 for a in agents)
    assert "n0: written /d/n0.msgpack" in done.stdout
    assert wrong.returncode == 2  # no agent answered
    assert wrong.stderr.count(f"not trusted by --tls-ca {certs.other_ca}") == 2, wrong.stderr
    assert len(wrong.stderr.splitlines()) == 2  # one line per agent, nothing more
    assert "Traceback" not in wrong.stderr


@pytest.mark.skipif(pyspy() is None, reason="py-spy is in the test extras")
def test_python_stacks_are_a_marked_bonus(tmp_path: Path, sleeper: int) -> None:
    done = _cli("--pid", str(sleeper), "--samples", "1", "--python-stacks",
                "--dump-dir", str(tmp_path), "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    rec = read_dump(json.loads(done.stdout)["path"])
    snap = rec.snapshots[-1]
    assert snap.python_tool.startswith("py-spy ")
    main = next(t for t in snap.processes[0].threads if t.tid == sleeper)
    assert main.python == ("<module> (<string>:5)",), main.python

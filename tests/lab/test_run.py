"""``stallwatch lab run``: the real job in network namespaces, healthy and with
every fault, each fault's effect seen from outside the job; bad input; and
nothing left behind after success, failure and Ctrl-C."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from stallwatch.dumpers.errors import LabError
from stallwatch.lab import netns, runner
from stallwatch.lab.certs import LabCerts, make_certs
from stallwatch.lab.runner import cpu_of

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Run:
    run_id: str
    code: int
    out: str
    err: str

    @property
    def result(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.out)
        return data

    def rank(self, world_rank: int) -> dict[str, Any]:
        ranks: list[dict[str, Any]] = self.result["ranks"]
        return next(r for r in ranks if r["world_rank"] == world_rank)

    def node(self, index: int) -> dict[str, Any]:
        nodes: list[dict[str, Any]] = self.result["nodes_seen"]
        return next(n for n in nodes if n["index"] == index)


def lab_run(*args: str, timeout: float = 120.0, env: dict[str, str] | None = None) -> Run:
    run_id = "t" + secrets.token_hex(3)
    done = subprocess.run(
        [sys.executable, "-m", "stallwatch", "lab", "run", "--run-id", run_id, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
        check=False,
    )
    run = Run(run_id, done.returncode, done.stdout, done.stderr)
    assert_nothing_left(run_id)
    return run


def assert_nothing_left(run_id: str) -> None:
    assert [ns for ns in netns.list_netns() if netns.run_of(ns) == run_id] == []
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    assert f"{netns.PREFIX}{run_id}-" not in listed.stdout
    assert not (netns.RUNS_DIR / run_id).exists()
    assert not Path(f"/sys/class/net/{netns.host_dev(run_id)}").exists()  # the host's seat
    marker = str(netns.RUNS_DIR / run_id)
    left = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if marker in cmdline:  # ranks, hogs and agents all name the run directory
            left.append((proc.info["pid"], cmdline))
    assert left == []


def median_step_ms(run: Run) -> float:
    return float(statistics.median(ms for r in run.result["ranks"] for ms in r["step_ms"]))


@pytest.fixture(scope="module")
def healthy() -> Run:
    return lab_run("--nodes", "2", "--ranks-per-node", "2", "--steps", "20", "--json")


def assert_steps_wait_for(run: Run, rank: int, ms: float) -> None:
    """Every rank's every step ends at least ``ms`` after ``rank``'s same step
    began: ``rank`` spends ``ms`` first thing in each step, and each step ends in
    collectives that need its part.  Per-step durations say less: a rank that
    ends step k late also starts step k+1 late, and that step looks short."""
    began = run.rank(rank)["step_start_ns"]
    for r in run.result["ranks"]:
        assert len(r["step_ms"]) == len(began)
        steps = zip(began, r["step_start_ns"], r["step_ms"], strict=True)
        for step, (slow_began_ns, start_ns, took_ms) in enumerate(steps):
            waited_ms = (start_ns - slow_began_ns) / 1e6 + took_ms
            assert waited_ms >= ms, (r["world_rank"], step, waited_ms)


def assert_all_done(run: Run, world: int, steps: int) -> None:
    assert run.code == 0, run.err
    result = run.result
    assert result["ok"] is True
    assert result["gave_up"] is None
    assert [r["world_rank"] for r in result["ranks"]] == list(range(world))
    for r in result["ranks"]:
        assert r["status"] == "done", r
        assert (r["steps_done"], r["exit_code"], r["exit_signal"]) == (steps, 0, None)
        assert r["verified"] is True and r["verified_failed"] == 0
        assert r["verified_ok"] >= 5 * steps
        assert isinstance(r["pid"], int)


# --- healthy ------------------------------------------------------------------


@pytest.mark.lab
def test_healthy_blocking_job(healthy: Run) -> None:
    assert_all_done(healthy, world=4, steps=20)
    result = healthy.result
    assert (result["nodes"], result["ranks_per_node"], result["mode"]) == (2, 2, "blocking")
    assert result["dumps"] == [] and result["faults"] == []
    assert [r["node"] for r in result["ranks"]] == [0, 0, 1, 1]
    assert len({r["pid"] for r in result["ranks"]}) == 4


@pytest.mark.lab
def test_healthy_job_counts_every_nccl_call(healthy: Run) -> None:
    for r in healthy.result["ranks"]:
        calls = r["calls"]
        assert calls["ncclAllReduce"] == {"dp": 20, "world": 20}
        assert calls["ncclAllGather"] == {"tp": 20}
        assert calls["ncclReduceScatter"] == {"tp": 20}
        assert calls["ncclBroadcast"] == {"world": 20}
        assert calls["ncclGroupStart"] == calls["ncclGroupEnd"] == {"none": 20}
        assert calls["ncclCommSplit"] == {"tp": 1, "dp": 1}
        assert calls["ncclCommInitRank"] == {"world": 1}
        assert calls["ncclCommDestroy"] == {"world": 1, "tp": 1, "dp": 1}
        # pipeline: dp rank 0 (node 0) sends, dp rank 1 (node 1) receives
        p2p = "ncclSend" if r["node"] == 0 else "ncclRecv"
        assert calls[p2p] == {"dp": 20}
        assert ("ncclGetUniqueId" in calls) == (r["world_rank"] == 0)
    # every member of a communicator computed the same id
    worlds = {r["comms"]["world"]["id_hash"] for r in healthy.result["ranks"]}
    assert len(worlds) == 1


@pytest.mark.lab
def test_healthy_async_job() -> None:
    run = lab_run("--ranks-per-node", "2", "--steps", "20", "--mode", "async", "--json")
    assert_all_done(run, world=4, steps=20)
    for r in run.result["ranks"]:
        assert r["calls"]["labStreamSynchronize"] == {"world": 20, "tp": 20, "dp": 20}


@pytest.mark.lab
def test_healthy_four_nodes() -> None:
    run = lab_run("--nodes", "4", "--ranks-per-node", "2", "--steps", "20", "--json")
    assert_all_done(run, world=8, steps=20)
    assert sorted({r["node"] for r in run.result["ranks"]}) == [0, 1, 2, 3]
    assert len({n["ip"] for n in run.result["nodes_seen"]}) == 4


def _device_logs_complete(run: Run, steps: int) -> None:
    """Every collective of every rank was seen complete after its call returned."""
    for r in run.result["ranks"]:
        log = r["device_log"]
        assert len(log) == 6 * steps, r["world_rank"]  # tp 2, dp 1 + p2p group, world 2
        for work in log:
            assert work["seen_ns"] >= work["returned_ns"] > 0
            assert work["seen_by"] in ("poll", "sync")
        assert sum(w["seen_by"] == "poll" for w in log) > len(log) // 2  # the watchdog's


@pytest.mark.lab
@pytest.mark.parametrize("nodes", [2, 4])
def test_healthy_gpu_job(nodes: int) -> None:
    run = lab_run("--nodes", str(nodes), "--steps", "8", "--mode", "gpu", "--json")
    assert_all_done(run, world=2 * nodes, steps=8)
    assert run.result["mode"] == "gpu"
    _device_logs_complete(run, steps=8)


@pytest.mark.lab
@pytest.mark.solo
def test_gpuslow_slows_the_device_not_the_host() -> None:
    run = lab_run("--nodes", "2", "--steps", "6", "--mode", "gpu", "--fault",
                  "gpuslow:rank=1,ms=60", "--json")  # fmt: skip
    assert_all_done(run, world=4, steps=6)
    cpu = {r["world_rank"]: r["cpu_s"] for r in run.result["ranks"]}
    assert cpu[1] < max(cpu[k] for k in (0, 2, 3)) + 0.2  # no extra CPU burnt
    assert_steps_wait_for(run, rank=1, ms=60)  # everyone's steps wait for rank 1's device


@pytest.mark.lab
def test_gpuhang_stops_every_rank_in_its_step_synchronisation() -> None:
    run = lab_run("--steps", "8", "--mode", "gpu", "--fault", "gpuhang:rank=2,step=3",
                  "--stall-timeout", "3", "--json")  # fmt: skip
    assert run.code == 1, run.err
    result = run.result
    assert result["stuck_ranks"] == [0, 1, 2, 3]
    assert run.rank(2)["status"] == "hung" and "device stops at step 3" in run.rank(2)["error"]
    for r in result["ranks"]:
        assert r["steps_done"] == 3
        log = r["device_log"]
        assert len(log) == 24  # the hung step's collectives were all queued ...
        assert all(w["seen_ns"] for w in log[:18])
        assert not any(w["seen_ns"] for w in log[18:] if w["label"] == "world")  # ... not done
    # the stopped device started none of them
    assert not any(w["seen_ns"] or w["started_seen_ns"] for w in run.rank(2)["device_log"][18:])


@pytest.mark.lab
def test_graphs_capture_the_step_once_and_replay_it_every_step() -> None:
    run = lab_run("--steps", "6", "--mode", "gpu", "--graphs", "--json")
    assert_all_done(run, world=4, steps=6)  # every replay's results verified
    for r in run.result["ranks"]:
        assert r["calls"]["ncclAllReduce"] == {"dp": 1, "world": 1}  # captured once
        log = r["device_log"]
        assert [w["kind"] for w in log] == ["graph"] * 6  # one launch a step
        assert all(w["seen_ns"] >= w["returned_ns"] > 0 for w in log)


@pytest.mark.lab
def test_a_mismatch_under_graphs_launches_another_graph_on_that_rank() -> None:
    fault = "mismatch:rank=1,step=2,field=count"
    run = lab_run("--steps", "4", "--mode", "gpu", "--graphs", "--fault", fault, "--json")
    assert run.code == 1, run.err
    calls = {r["world_rank"]: r["calls"]["ncclAllReduce"]["world"] for r in run.result["ranks"]}
    assert calls == {0: 1, 1: 2, 2: 1, 3: 1}  # its own graph captured at step 2
    # the replays' failure comes back as the communicators' asynchronous error
    assert all(r["steps_done"] == 2 and r["exit_code"] == 4 for r in run.result["ranks"])
    assert "mismatched calls" in (run.rank(1)["error"] or "")


@pytest.mark.lab
def test_summary_for_people_is_a_table() -> None:
    run = lab_run("--nodes", "1", "--ranks-per-node", "2", "--steps", "3")
    assert run.code == 0, run.err
    lines = run.out.splitlines()
    assert "ok: every rank finished and verified" in lines[0]
    assert lines[1].split()[:4] == ["rank", "node", "pid", "steps"]
    assert [line.split()[3] for line in lines[2:4]] == ["3/3", "3/3"]


# --- faults -------------------------------------------------------------------


@pytest.mark.lab
def test_hang_blocks_the_others_and_the_lab_gives_up() -> None:
    started = time.monotonic()
    run = lab_run("--steps", "20", "--fault", "hang:rank=3,step=4", "--stall-timeout", "3",
                  "--json")  # fmt: skip
    assert time.monotonic() - started < 30
    assert run.code == 1, run.err
    result = run.result
    assert "no rank made progress for 3 s" in result["gave_up"]
    assert result["stuck_ranks"] == [0, 1, 2, 3]
    assert run.rank(3)["status"] == "hung"
    for r in result["ranks"]:
        assert r["steps_done"] == 4  # nobody got past the step where rank 3 stopped
        assert r["killed_by_lab"] and r["exit_signal"] == "SIGKILL"
        assert r["status"] in ("stuck", "hung")


@pytest.mark.lab
@pytest.mark.solo
def test_slow_rank_makes_slower_steps() -> None:
    run = lab_run("--steps", "6", "--fault", "slow:rank=1,ms=150", "--json")
    assert run.code == 0, run.err
    slow_cpu = run.rank(1)["cpu_s"]
    others = [run.rank(r)["cpu_s"] for r in (0, 2, 3)]
    assert slow_cpu - max(others) > 0.6 * 6 * 0.150  # the extra compute really ran
    assert_steps_wait_for(run, rank=1, ms=150)  # and everybody waited for it


@pytest.mark.lab
@pytest.mark.solo
def test_loss_raises_the_nodes_retransmit_counter(healthy: Run) -> None:
    steps = 10
    run = lab_run("--steps", str(steps), "--fault", "loss:node=1,pct=5", "--json")
    assert run.code == 0, run.err  # TCP recovers: results still right
    lossy = run.node(1)["tcp_retrans_segs"]
    # per step: the healthy run is longer, and on a busy machine a healthy
    # run sees a few spurious retransmits per step (57 in 20 steps, seen)
    baseline = max(n["tcp_retrans_segs"] for n in healthy.result["nodes_seen"])
    per_step, healthy_per_step = lossy / steps, baseline / healthy.result["steps"]
    assert lossy >= 50
    assert per_step > 5 * (healthy_per_step + 0.1), (lossy, baseline)
    assert run.result["faults"][0]["spec"] == "loss:node=1,pct=5"


@pytest.mark.lab
@pytest.mark.solo
def test_rate_cap_slows_the_steps(healthy: Run) -> None:
    run = lab_run("--steps", "6", "--fault", "rate:node=1,mbit=40", "--json")
    assert run.code == 0, run.err
    assert median_step_ms(run) > 2.5 * median_step_ms(healthy)


@pytest.mark.lab
@pytest.mark.parametrize("field", ["count", "dtype", "op"])
def test_mismatch_is_an_error_in_the_ranks(field: str) -> None:
    run = lab_run("--steps", "6", "--fault", f"mismatch:rank=2,step=3,field={field}", "--json",
                  "--stall-timeout", "5")  # fmt: skip
    assert run.code == 1
    culprit = run.rank(2)
    assert culprit["status"] == "error" and culprit["exit_code"] == 4
    assert "INVALID_USAGE" in culprit["error"]
    assert "ncclAllReduce on world" in culprit["error"]
    assert culprit["steps_done"] == 3
    erred = [r for r in run.result["ranks"] if r["exit_code"] not in (0, None)]
    assert len(erred) >= 2  # the culprit and at least one peer it was matched with


@pytest.mark.lab
def test_crash_exit_code_is_seen() -> None:
    run = lab_run("--steps", "10", "--fault", "crash:rank=1,step=2", "--stall-timeout", "5",
                  "--json")  # fmt: skip
    assert run.code == 1
    crashed = run.rank(1)
    assert (crashed["exit_code"], crashed["exit_signal"]) == (3, None)
    assert crashed["status"] == "crashed" and crashed["steps_done"] == 2
    assert not crashed["killed_by_lab"]


@pytest.mark.lab
def test_crash_by_signal_is_seen() -> None:
    run = lab_run("--steps", "10", "--fault", "crash:rank=2,step=1,signal=KILL",
                  "--stall-timeout", "5", "--json")  # fmt: skip
    assert run.code == 1
    crashed = run.rank(2)
    assert (crashed["exit_code"], crashed["exit_signal"]) == (None, "SIGKILL")
    assert not crashed["killed_by_lab"]
    assert crashed["steps_done"] == 1


@pytest.mark.lab
@pytest.mark.solo
def test_cpuhog_takes_the_ranks_cpu() -> None:
    # compute longer than a scheduler slice: a shorter burst runs on wake-up credit
    run = lab_run("--nodes", "2", "--ranks-per-node", "1", "--steps", "5", "--compute-ms", "10",
                  "--fault", "cpuhog:rank=0", "--json")  # fmt: skip
    assert run.code == 0, run.err
    hogged, other = run.rank(0), run.rank(1)
    assert hogged["run_delay_ms"] > 1.5 * other["run_delay_ms"]
    assert hogged["compute_cpu_share"] < 0.5
    assert hogged["compute_cpu_share"] < other["compute_cpu_share"]


def test_a_hogged_rank_gets_a_cpu_of_its_own_where_there_are_too_few() -> None:
    # 3x2 on two CPUs: the hog's rank alone on CPU 0, the other five on CPU 1
    assert [cpu_of(r, 6, [3], cpus=2) for r in range(6)] == [1, 1, 1, 0, 1, 1]
    # two hogged ranks on four CPUs: one each, the others share CPUs 2 and 3
    assert [cpu_of(r, 8, [5, 1], cpus=4) for r in range(8)] == [2, 0, 3, 2, 3, 1, 2, 3]
    # a CPU for every rank: its own, whatever is hogged
    assert [cpu_of(r, 4, [2], cpus=8) for r in range(4)] == [0, 1, 2, 3]
    # as many hogged ranks as CPUs: none can be alone, ranks go round
    assert [cpu_of(r, 4, [0, 1], cpus=2) for r in range(4)] == [0, 1, 0, 1]


# --- bad input ------------------------------------------------------------------


@pytest.mark.lab
@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--fault", "hang:rank=1"], "hang needs step="),
        (["--fault", "boom:rank=1"], "unknown kind 'boom'"),
        (["--fault", "hang:rank=4,step=1"], "rank 4 does not exist (ranks are 0..3)"),
        (["--fault", "loss:node=2,pct=5"], "node 2 does not exist (nodes are 0..1)"),
        (["--fault", "crash:rank=0,step=20"], "step 20 is never reached"),
        (["--nodes", "0"], "--nodes: must be at least 1"),
        (["--fault", "gpuslow:rank=1,ms=5"], "needs --mode gpu"),
        (["--graphs"], "--graphs needs --mode gpu"),
        (["--fault", "hang:rank=1,step=2,agents=ready"], "needs --record"),
        (["--agent-scope", "host"], "--agent-scope needs --record"),
        (
            ["--record", "--agent-scope", "host", "--fault", "agentlate:node=1,step=2"],
            "--agent-scope host runs one agent for every node, named node=0",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], names: str) -> None:
    run = lab_run(*args)
    assert run.code == 2
    assert names in run.err
    assert len(run.err.strip().splitlines()) == 1 or "usage:" in run.err
    assert "Traceback" not in run.err


@pytest.mark.lab
def test_missing_tools_is_one_line_and_exit_2() -> None:
    env = dict(os.environ, PATH="/nonexistent")
    run = lab_run("--steps", "2", env=env)
    assert run.code == 2
    assert run.err.strip().count("\n") == 0
    assert "the lab needs ip, nft, tc, nsenter, ethtool on PATH" in run.err


@pytest.mark.lab
def test_not_root_is_one_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from stallwatch.cli import main

    monkeypatch.setattr(runner, "_euid", lambda: 1000)
    before = netns.list_netns()
    assert main(["lab", "run", "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs root" in err
    assert netns.list_netns() == before


# --- teardown on Ctrl-C -----------------------------------------------------------


@pytest.mark.lab
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_tears_everything_down(sig: signal.Signals) -> None:
    run_id = "t" + secrets.token_hex(3)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stallwatch",
            "lab",
            "run",
            "--run-id",
            run_id,
            "--steps",
            "100000",
            "--fault",
            "cpuhog:rank=1",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120  # a job starts in seconds; beside a loaded suite, more
        while not list((netns.RUNS_DIR / run_id).glob("rank-*.json")):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the job never started"
            time.sleep(0.1)
        assert len([ns for ns in netns.list_netns() if netns.run_of(ns) == run_id]) == 3
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=180)  # its teardown, beside a loaded suite
    finally:
        if proc.poll() is None:  # the test failed: what the runner started must not outlive it
            proc.kill()
            proc.communicate()  # reaped, its pipes closed
            netns.cleanup_stale()
    assert proc.returncode == 130
    assert "interrupted" in err
    assert_nothing_left(run_id)


# --- the host's seat on the switch ----------------------------------------------------


def _same_subnet(run_id: str) -> str:
    """Another run id whose subnet is ``run_id``'s."""
    while True:
        other = secrets.token_hex(3)
        if other != run_id and netns.subnet(other) == netns.subnet(run_id):
            return other


@pytest.mark.lab
def test_the_host_shell_reaches_the_nodes_through_its_seat_and_nothing_is_left() -> None:
    """A run with agents puts a veth of the root namespace on its switch: a
    node's address answers from the host's shell (a listener inside node 1,
    a connection from here); a run whose subnet that seat routes already is
    refused in one line; the seat goes with the run."""
    run_id = netns.new_run_id()
    net = netns.create(run_id, 2, host_port=True)
    try:
        assert net.host_ip == f"{netns.subnet(run_id)}.{netns.HOST_OCTET}"
        assert netns.subnet(run_id) in netns.routed_subnets()
        assert netns.subnet(netns.new_run_id()) != netns.subnet(run_id)
        node = net.nodes[1]
        listen = (
            "import socket; s = socket.create_server(('0.0.0.0', 9411)); print('up', flush=True);"
            "c, a = s.accept(); c.sendall(a[0].encode())"
        )
        argv = [*node.exec_prefix(), sys.executable, "-c", listen]
        with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) as server:
            assert server.stdout is not None and server.stdout.readline().strip() == "up"
            with socket.create_connection((node.ip, 9411), timeout=5) as conn:
                assert conn.recv(64).decode() == net.host_ip  # from the host's seat, no NAT
            server.wait(timeout=10)
        with pytest.raises(LabError, match=rf"subnet {netns.subnet(run_id)}\.0/24 is routed"):
            netns.create(_same_subnet(run_id), 1, host_port=True)
    finally:
        assert netns.destroy(net) == []
    assert not Path(f"/sys/class/net/{netns.host_dev(run_id)}").exists()
    assert netns.subnet(run_id) not in netns.routed_subnets()


# --- --record plumbing (the agent is another part: only its command line here) ----


def test_agent_command_line(tmp_path: Path) -> None:
    cfg = runner.RunConfig(nodes=3, record=True, dump_dir=tmp_path / "d", stall_timeout=7.5)
    lab = runner.Lab(cfg, Path("/x/libnccl.so.2"), "abc", tmp_path)
    nodes = tuple(netns.Node(k, f"swlab-abc-n{k}", f"10.201.9.{k + 1}", f"n{k}") for k in range(3))
    lab.net = netns.Network("abc", "swlab-abc-sw", nodes)
    tls = tmp_path / "tls"
    lab.certs = LabCerts(tls, tls / "ca.pem", tls / "client.pem", tls / "client.key")
    argv = runner.agent_argv(lab, lab.site(1), tmp_path / "token")
    assert argv[:6] == [sys.executable, "-m", "stallwatch", "record", "--scope", "netns"]

    def opt(name: str) -> str:
        return argv[argv.index(name) + 1]

    assert opt("--dump-dir") == str(tmp_path / "d" / "node1")
    assert opt("--stall-timeout") == "7.5"
    assert opt("--listen") == "10.201.9.2:9400"
    assert opt("--token-file") == str(tmp_path / "token")
    # its own certificate, and the run's CA for its clients (mutual TLS) and its peers
    assert (opt("--tls-cert"), opt("--tls-key")) == (str(tls / "node1.pem"), str(tls / "node1.key"))
    assert opt("--tls-client-ca") == opt("--tls-ca") == str(tls / "ca.pem")
    assert opt("--peers") == "10.201.9.1:9400,10.201.9.3:9400"
    assert opt("--lib") == "/x/libnccl.so.2"
    assert opt("--host-name") == "node1"
    assert opt("--pin-dir") == "/sys/fs/bpf/stallwatch/lab-abc-node1"  # removed at teardown
    assert "--keep-pinned" in argv  # a supervised restart takes the recording over
    # the agent runs inside the node's namespace
    assert lab.site(1).exec_prefix() == ["nsenter", "--net=/run/netns/swlab-abc-n1", "--"]
    assert "--job" not in argv


def test_host_agent_command_line(tmp_path: Path) -> None:
    """--agent-scope host: one agent for every node, in the switch's
    namespace on its own address (loopback without one), kept to the run's
    job, no peers."""
    cfg = runner.RunConfig(nodes=3, record=True, dump_dir=tmp_path / "d", agent_scope="host")
    lab = runner.Lab(cfg, Path("/x/libnccl.so.2"), "abc", tmp_path)
    nodes = tuple(netns.Node(k, f"swlab-abc-n{k}", f"10.201.9.{k + 1}", f"n{k}") for k in range(3))
    lab.net = netns.Network("abc", "swlab-abc-sw", nodes)
    tls = tmp_path / "tls"
    lab.certs = LabCerts(tls, tls / "ca.pem", tls / "client.pem", tls / "client.key")
    [site] = lab.sites()
    argv = runner.agent_argv(lab, site, tmp_path / "token")
    assert argv[:6] == [sys.executable, "-m", "stallwatch", "record", "--scope", "host"]

    def opt(name: str) -> str:
        return argv[argv.index(name) + 1]

    assert opt("--job") == "abc"  # the ranks' TORCHELASTIC_RUN_ID: other jobs stay out
    assert (opt("--listen"), opt("--host-name")) == ("127.0.0.1:9400", "host")
    lab.switch_ip = "10.201.9.253"  # with the host's seat: the switch's own address
    seated = runner.agent_argv(lab, lab.sites()[0], tmp_path / "token")
    assert seated[seated.index("--listen") + 1] == "10.201.9.253:9400"
    assert opt("--dump-dir") == str(tmp_path / "d" / "host")
    assert "--peers" not in argv
    assert site.exec_prefix() == ["nsenter", "--net=/run/netns/swlab-abc-sw", "--"]


def test_rank_command_line_carries_its_faults(tmp_path: Path) -> None:
    from stallwatch.lab import faults

    specs = ["cpuhog:rank=1", "slow:rank=1,ms=5", "hang:rank=0,step=2", "loss:node=0,pct=5"]
    cfg = runner.RunConfig(faults=faults.parse_faults(specs))
    lab = runner.Lab(cfg, Path("/x/lib.so"), "abc", tmp_path)
    argv = runner.rank_argv(lab, 1)
    assert argv[1:3] == ["-m", "stallwatch.commands.labrank"]
    given = [argv[i + 1] for i, a in enumerate(argv) if a == "--fault"]
    assert given == ["cpuhog:rank=1", "slow:rank=1,ms=5"]
    world = cfg.topology.world_size
    cpus = {r: (a := runner.rank_argv(lab, r))[a.index("--cpu") + 1] for r in range(world)}
    assert cpus == {r: str(cpu_of(r, world, [1])) for r in range(world)}  # every rank pinned
    if (os.cpu_count() or 1) >= 2:  # the hogged rank alone on its CPU
        assert list(cpus.values()).count(cpus[1]) == 1, cpus
    healthy = runner.Lab(runner.RunConfig(), Path("/x/lib.so"), "abc", tmp_path)
    assert "--cpu" not in runner.rank_argv(healthy, 0)


@pytest.mark.lab
def test_a_failure_during_setup_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from stallwatch.cli import main

    def broken(*_args: object) -> None:
        raise LabError("nft: simulated failure")

    monkeypatch.setattr(netns, "add_loss", broken)
    run_id = "t" + secrets.token_hex(3)
    assert main(["lab", "run", "--run-id", run_id, "--fault", "loss:node=1,pct=5"]) == 2
    assert "simulated failure" in capsys.readouterr().err
    assert_nothing_left(run_id)


@pytest.mark.lab
def test_an_agent_that_dies_at_start_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from stallwatch.cli import main

    def dying_agent(*_args: object) -> list[str]:
        return [sys.executable, "-c", "import sys; sys.exit('no BPF for you')"]

    monkeypatch.setattr(runner, "agent_argv", dying_agent)
    run_id = "t" + secrets.token_hex(3)
    argv = ["lab", "run", "--run-id", run_id, "--record", "--dump-dir", str(tmp_path)]
    assert main(argv) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after one progress line
    assert last.startswith("stallwatch lab: error: the agent of node 0 exited with 1")
    assert last.endswith("no BPF for you")
    assert_nothing_left(run_id)


def test_lab_certificates_serve_and_verify(tmp_path: Path) -> None:
    """The run's certificates, made by openssl, are what the agents and the
    lab's own requests use: a node's certificate names its address and
    chains to the run's CA; the client's does too."""
    import ssl

    certs = make_certs(tmp_path / "tls", {0: "10.201.9.1", 1: "10.201.9.2"})
    for index in (0, 1):
        certs.server(index).context()  # loads: key matches certificate, CA parses
    client = certs.client().context()
    assert client.verify_mode == ssl.CERT_REQUIRED and client.check_hostname
    assert not (tmp_path / "tls" / "ca.key").exists()  # nothing more can be signed
    assert (tmp_path / "tls" / "node1.key").stat().st_mode & 0o077 == 0
    text = subprocess.run(
        ["openssl", "x509", "-in", str(tmp_path / "tls" / "node1.pem"), "-noout", "-text"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "IP Address:10.201.9.2" in text and "TLS Web Client Authentication" in text


def test_a_node_has_dumped_the_stall_once_a_dump_raised_since_its_ranks_stopped_is_there(
    tmp_path: Path,
) -> None:
    """``wait_for_dumps`` waits for each node's dump raised since its own
    ranks last moved: a stall raised after a slowdown is a second incident,
    and a node's dump of the first is none of it; a cut node dumps its own
    incident while the others' ranks still move on in their own node."""
    import dataclasses

    from stallwatch.dumpers.format import read_dump, write_dump

    src = sorted((ROOT / "tests" / "data" / "lab-hang-2x2").glob("*.msgpack"))[0]
    rec = read_dump(src)
    assert rec.trigger is not None
    at = rec.trigger.time_ns
    first = write_dump(tmp_path, rec)
    other = tmp_path / "node1"
    write_dump(other, rec)
    assert runner.dumped_since({tmp_path: at, other: at})
    assert not runner.dumped_since({tmp_path: at + 1, other: at + 1})  # the slowdown's only
    # node0 cut off (its ranks stopped before its dump), node1's moved on after it
    assert runner.dumped_since({tmp_path: at - 10, other: at - 10})
    assert not runner.dumped_since({tmp_path: at - 10, other: at + 1})
    later = dataclasses.replace(rec.trigger, time_ns=at + 5, incident_id="20990101T0-node0-ab")
    write_dump(tmp_path, dataclasses.replace(rec, trigger=later))
    (other / ".tmp-half.msgpack").write_bytes(first.read_bytes()[:100])  # being written
    (other / "torn.msgpack").write_bytes(first.read_bytes()[:1000])
    assert runner.dumped_since({tmp_path: at + 1})
    assert not runner.dumped_since({tmp_path: at + 1, other: at + 1})  # node1: not the stall
    assert not runner.dumped_since({tmp_path: 0, tmp_path / "none": 0})

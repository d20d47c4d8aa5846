"""The agent's network evidence: what sampling the job's connections and
interfaces costs each second, what probing the job's peers costs at an
incident, and what the agents of a lab job cost with both.

- Sampling (``recorder.netsamples``): ``CONNECTIONS`` TCP connections of
  this process in a network namespace of its own, beside ``TIME_WAITS``
  sockets that a neighbour's churn leaves; one sample asks the kernel for
  each connection by its ends (sock_diag, no dump), CPU time
  (``time.process_time``) per connection, the median of ``repeats`` runs;
  beside it, in the same run, the namespace's sock_diag dump with each
  socket's tcp_info (how the dump's own reading of the job's connections
  is made), and one interface's link and root qdisc.  At one sample a
  second, microseconds per sample are microseconds per second.
- Probes (``recorder.pathprobe``): the lab's switch with 65 nodes, a
  responder in each peer (one process holding them all), node 0 probing 8
  and 64 peers, healthy, then behind an MTU blackhole on node 0's switch
  port (packets above 1,200 bytes dropped both ways: the rounds that find
  the limit run, and their bytes count): the round's wall time (the window,
  by design), the time to its last answer, its CPU, and the bytes sent to
  the busiest peer and to all.
- The agents of a 4x2 lab job (``stallwatch lab run --record``, block
  waits): each agent's share of a core over ``JOB_WINDOW_S`` of the job's
  steps (schedstat), the median of the four; the connections each sampled.
  The idle agent's figure is ``bench_recorder``'s (it runs every thread of
  the agent, its probe responder included).

``python -m bench.bench_netsamples [--quick]`` prints the table (root needed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from bench.common import Figure, render

REPO = Path(__file__).resolve().parent.parent
CONNECTIONS = 500  # each of them in a pair: 1,000 sockets sampled
TIME_WAITS = 10_000
PORT = 9401
MAX_PEER_BYTES = 1 << 20
BLACKHOLE = 1200
# The agent's budget with a job is 1% of a core (bench_recorder's "agent
# CPU"); sampling may take a quarter of it on a node whose ranks hold 200
# connections (8 GPUs' NCCL sockets to their ring and tree peers): 12.5 us of
# CPU per connection per second.
PER_CONNECTION_TARGET_US = 0.01 / 4 / 200 * 1e6
JOB_WINDOW_S = 20.0
# the agent's budget with a job is 1% of a core (bench_recorder's "agent
# CPU"); its samples of the job's network may take a tenth of it on a lab
# node (some 20 connections and one interface)
SAMPLING_SHARE_TARGET = 0.001


def _cpu_us(fn: Callable[[], object], n: int, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        t0 = time.process_time()
        for _ in range(n):
            fn()
        runs.append((time.process_time() - t0) / n * 1e6)
    return statistics.median(runs)


# ---- sampling, inside a namespace of its own ---------------------------------


def _pairs(n: int) -> list[socket.socket]:
    server = socket.create_server(("10.78.0.1", 0), backlog=1024)
    port = server.getsockname()[1]
    out = []
    for _ in range(n):
        out.append(socket.create_connection(("10.78.0.1", port)))
        out.append(server.accept()[0])
    for s in out[::2]:
        s.sendall(b"x" * 1000)  # data went both ways: every counter moved
    server.close()
    return out


def _time_waits(n: int) -> None:
    server = socket.create_server(("10.78.0.1", 0), backlog=1024)
    port = server.getsockname()[1]
    for _ in range(n):
        client = socket.create_connection(("10.78.0.1", port))
        server.accept()[0].close()
        client.close()
    server.close()


def child_sampling(quick: bool) -> dict[str, float]:
    from stallwatch.recorder.netlink import RouteAsk
    from stallwatch.recorder.netsamples import NetSampleConfig, NetSampler

    repeats = 3 if quick else 7
    conns = _pairs(CONNECTIONS // 10 if quick else CONNECTIONS)
    _time_waits(TIME_WAITS // 10 if quick else TIME_WAITS)
    me = os.getpid()
    sampler = NetSampler(NetSampleConfig(conn_slots=1 << 16))
    sampler.tick(lambda: [me], lambda js: None)  # the job's sockets, and a first sample
    sampled = len(sampler.latest)
    route = RouteAsk()
    veth = next(s.ifindex for s in route.links() if s.name == "ve0")
    out = {
        "sampled": float(sampled),
        "sample_us": _cpu_us(sampler.sample, 5, repeats),
        "dump_us": _cpu_us(lambda: sampler.reader.connection_states([me]), 5, repeats),
        "iface_us": _cpu_us(lambda: route.link_and_qdisc([veth]), 50, repeats),
        "time_waits": float(TIME_WAITS // 10 if quick else TIME_WAITS),
    }
    for s in conns:
        s.close()
    sampler.close()
    route.close()
    return out


def sampling(quick: bool) -> dict[str, float]:
    ns = f"swbench-net-{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        for args in (
            ["link", "add", "ve0", "type", "veth", "peer", "name", "vp0"],
            ["link", "set", "ve0", "up"],
            ["link", "set", "vp0", "up"],
            ["link", "set", "lo", "up"],
            ["addr", "add", "10.78.0.1/24", "dev", "ve0"],
        ):
            subprocess.run(["ip", "-n", ns, *args], check=True, capture_output=True)  # fmt: skip
        cmd = [sys.executable, "-m", "bench.bench_netsamples", "--child-sampling"]
        done = subprocess.run(["ip", "netns", "exec", ns, *cmd, *(["--quick"] if quick else [])],
                              cwd=REPO, capture_output=True, text=True, check=False,
                              env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"bench_netsamples in {ns} failed: {done.stderr[-2000:]}")
        result: dict[str, float] = json.loads(done.stdout)
        return result
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


# ---- probes, on the lab's switch ---------------------------------------------


def child_echo(run_id: str, nodes: int, token: str) -> None:
    """A responder in each of nodes 1..nodes-1, until killed."""
    from stallwatch.lab import netns
    from stallwatch.recorder.pathecho import PathEcho
    from stallwatch.recorder.pathwire import ProbeRing, probe_key

    echoes = []
    for k in range(1, nodes):
        echo = PathEcho(PORT, probe_key(token), ProbeRing(1024))
        if not netns.in_netns(f"{netns.PREFIX}{run_id}-n{k}", echo.start):
            raise SystemExit(f"no responder in node {k}")
        echoes.append(echo)
    print("ready", flush=True)
    while True:
        time.sleep(3600)


@contextlib.contextmanager
def _lab(nodes: int) -> Iterator[object]:
    from stallwatch.lab import netns

    run_id = netns.new_run_id("b")
    run_dir = netns.RUNS_DIR / run_id
    run_dir.mkdir(parents=True)
    (run_dir / "runner.pid").write_text(str(os.getpid()))
    net = netns.create(run_id, nodes)
    try:
        yield net
    finally:
        netns.destroy(net)
        shutil.rmtree(run_dir, ignore_errors=True)


def probes(quick: bool) -> list[dict[str, float]]:
    from stallwatch.lab import netns
    from stallwatch.recorder.pathprobe import Peer, ProbeConfig, Prober
    from stallwatch.recorder.pathwire import ProbeRing, probe_key

    counts = (8,) if quick else (8, 64)
    token = secrets.token_hex(8)
    out = []
    with _lab(max(counts) + 1) as net:
        assert isinstance(net, netns.Network)
        cmd = [sys.executable, "-m", "bench.bench_netsamples", "--child-echo", net.run_id,
               str(len(net.nodes)), token]  # fmt: skip
        echo = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
        try:
            assert echo.stdout is not None and echo.stdout.readline().strip() == "ready"
            me = net.nodes[0]

            def ip(text: str) -> bytes:
                return socket.inet_aton(text).ljust(16, b"\0")

            for blackhole in (False, True):
                if blackhole:
                    port = me.port
                    ruleset = "".join(
                        f'  chain {name} {{ type filter hook {hook} device "{port}" priority 0;\n'
                        f"    ip length > {BLACKHOLE} drop\n  }}\n"
                        for name, hook in (("from_node", "ingress"), ("to_node", "egress"))
                    )
                    netns.sh(["ip", "netns", "exec", net.switch, "nft", "-f", "-"],
                             stdin=f"table netdev mtu {{\n{ruleset}}}\n")  # fmt: skip
                for n in counts:
                    config = ProbeConfig(port=PORT, max_peers=n)
                    prober = Prober(config, probe_key(token), ProbeRing(1 << 14))
                    peers = [
                        Peer(ip(me.ip), ip(p.ip), socket.AF_INET) for p in net.nodes[1 : n + 1]
                    ]
                    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
                    rows = netns.in_netns(me.netns, lambda: prober.probe("bench", peers))  # noqa: B023
                    wall = time.monotonic() - t0
                    r1 = resource.getrusage(resource.RUSAGE_SELF)
                    start = min(t.first_ns for t in rows)
                    answered = [t.last_ns for t in rows if t.answered]
                    per_peer: dict[bytes, int] = {}
                    for t in rows:
                        per_peer[t.dst] = per_peer.get(t.dst, 0) + t.bytes_sent
                    out.append({
                        "peers": float(n),
                        "blackhole": float(blackhole),
                        "wall_s": wall,
                        "active_s": (max(answered) - start) / 1e9 if answered else 0.0,
                        "cpu_s": r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime,
                        "max_peer_bytes": float(max(per_peer.values())),
                        "all_bytes": float(sum(per_peer.values())),
                        "rows": float(len(rows)),
                        "lost_rows": float(sum(1 for t in rows if not t.answered)),
                    })  # fmt: skip
        finally:
            echo.kill()
            echo.communicate(timeout=10)  # its pipe closed too
    return out


# ---- the agents of a lab job ----------------------------------------------------


def _agents(run_id: str) -> list[int]:
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if b"record" in argv and any(f"lab-{run_id}-node".encode() in a for a in argv):
                out.append(int(proc.name))
    return out


def _cpu_ns(pid: int) -> int:
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            total += int((task / "schedstat").read_text().split()[0])
    return total


def _dump_counters(agents: list[int], folder: Path) -> dict[int, dict[str, int]]:
    """Each node's agent's counters, from the dumps of one incident: one
    agent is sent SIGUSR1 and asks its peers (their manual dumps are not
    probed); the newest dump of each node's folder, once all are there."""
    from stallwatch.dumpers.errors import DumpError
    from stallwatch.dumpers.format import read_dump

    before = set(folder.glob("node*/*.msgpack"))
    os.kill(agents[0], 10)  # SIGUSR1
    deadline = time.monotonic() + 60
    out: dict[int, dict[str, int]] = {}
    while time.monotonic() < deadline and len(out) < len(agents):
        time.sleep(1.0)
        for node in folder.glob("node*/"):
            new = sorted(set(node.glob("*.msgpack")) - before, key=lambda p: p.stat().st_mtime)
            with contextlib.suppress(DumpError, OSError):  # relabelled meanwhile: read again
                if new:
                    out[int(node.name.removeprefix("node"))] = read_dump(new[-1]).counters
    return out


def _node_of(pid: int) -> int:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    pin = next(a for a in argv if b"/lab-" in a)
    return int(pin.rsplit(b"node", 1)[1])


def lab_job(quick: bool) -> dict[str, float]:
    """The agents of a 4x2 job: their CPU over a window of its steps, and
    what of it their samples took (their own counter, by two dumps around
    the window)."""
    from stallwatch.dumpers.format import read_dump
    from stallwatch.lab import netns

    run_id = netns.new_run_id("j")
    window = 5.0 if quick else JOB_WINDOW_S
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        cmd = [sys.executable, "-m", "stallwatch", "lab", "run", "--nodes", "4",
               "--ranks-per-node", "2", "--steps", "1000000", "--record", "--run-id", run_id,
               "--dump-dir", tmp, "--timeout", str(window + 120), "--json"]  # fmt: skip
        lab = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:  # every agent records its ranks
                logs = list(folder.glob("node*.agent.log"))
                if len(logs) == 4 and all("recording pid" in p.read_text() for p in logs):
                    break
                time.sleep(1)
            time.sleep(10)  # the ranks' connections are sampled
            agents = _agents(run_id)
            first = _dump_counters(agents, folder)
            before = {p: _cpu_ns(p) for p in agents}
            t0 = time.monotonic()
            time.sleep(window)
            took = time.monotonic() - t0
            shares = {_node_of(p): (_cpu_ns(p) - before[p]) / 1e9 / took for p in agents}
            last = _dump_counters(agents, folder)
        finally:
            lab.terminate()
            lab.wait(180)
        sampling = [
            (last[n]["netsample_cpu_us"] - first[n]["netsample_cpu_us"]) / 1e6 / took
            for n in shares
            if n in first and n in last
        ]
        conns = []
        for path in folder.glob("node*/*.msgpack"):
            rows = read_dump(path).rings["conn_samples"].rows
            conns.append(len({(int(r["sport"]), int(r["dport"])) for r in rows}))
    values = list(shares.values())
    return {
        "agents": float(len(values)),
        "median": statistics.median(values) if values else float("nan"),
        "max": max(values) if values else float("nan"),
        "sampling": statistics.median(sampling) if sampling else float("nan"),
        "connections": float(statistics.median(conns)) if conns else 0.0,
        "window_s": window,
    }


def figures(quick: bool) -> list[Figure]:
    if os.geteuid() != 0:
        raise RuntimeError("bench_netsamples needs root (network namespaces)")
    s = sampling(quick)
    per_conn = s["sample_us"] / s["sampled"]
    figs = [
        Figure(
            "sampling cost per connection per second",
            per_conn,
            "us CPU",
            f"< {PER_CONNECTION_TARGET_US:g} us",
            per_conn < PER_CONNECTION_TARGET_US,
            f"{int(s['sampled']):,} connections asked one by one, beside "
            f"{int(s['time_waits']):,} TIME_WAITs: {s['sample_us']:,.0f} us a sample; the "
            f"namespace's sock_diag dump with tcp_info: {s['dump_us']:,.0f} us "
            f"({s['dump_us'] / s['sample_us']:.1f}x); one interface's link and root qdisc: "
            f"{s['iface_us']:.0f} us",
        )
    ]
    for p in probes(quick):
        what = "MTU blackhole" if p["blackhole"] else "healthy"
        figs.append(Figure(
            f"probe round, {int(p['peers'])} peers, {what}: time",
            p["wall_s"],
            "s",
            "<= 2.5 s",
            p["wall_s"] <= 2.5,
            f"last answer after {p['active_s']:.2f} s; {p['cpu_s']:.2f} s CPU; "
            f"{int(p['rows'])} rows, {int(p['lost_rows'])} short of answers",
        ))  # fmt: skip
        figs.append(Figure(
            f"probe round, {int(p['peers'])} peers, {what}: bytes to the busiest peer",
            p["max_peer_bytes"] / 1024,
            "KiB",
            "<= 1024 KiB",
            p["max_peer_bytes"] <= 1 << 20,
            f"{p['all_bytes'] / 2**20:.1f} MiB to all {int(p['peers'])}",
        ))  # fmt: skip
    j = lab_job(quick)
    figs.append(
        Figure(
            "agent CPU, 4x2 lab job (each agent): sampling's part",
            j["sampling"] * 100,
            "% of a core",
            f"< {SAMPLING_SHARE_TARGET * 100:g}%",
            j["sampling"] < SAMPLING_SHARE_TARGET,
            f"median of {int(j['agents'])} agents over {j['window_s']:g} s of steps, "
            f"{int(j['connections'])} connections and eth0 sampled each second (the agent's "
            f"own counter); the whole agent: {j['median'] * 100:.2f}% "
            f"(max {j['max'] * 100:.2f}%)",
        )
    )
    return figs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_netsamples", description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child-sampling", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-echo", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_sampling:
        print(json.dumps(child_sampling(args.quick)))
        return 0
    if args.child_echo:
        run_id, nodes, token = args.child_echo
        child_echo(run_id, int(nodes), token)
        return 0
    figs = figures(args.quick)
    print(render(figs))
    return 0 if all(f.ok is not False for f in figs) else 1


if __name__ == "__main__":
    raise SystemExit(main())

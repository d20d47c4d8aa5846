"""The link sampler's cost (``recorder.links``), beside the obvious way to
read the same things, measured in the same run.

Set-up: a network namespace of its own with 11 interfaces (lo and five veth
pairs) and a copy of the fixture sysfs tree's four RDMA ports
(``tests/recorder/data/rdma-sysfs``); every figure is measured in one process inside
that namespace (``ip netns exec``: its /sys is the namespace's), CPU time
(``time.process_time``: user and system) per operation, the median of
``repeats`` runs of ``n`` operations each.

- A reading of every netdev: one rtnetlink dump, parsed, each interface's
  row decided (``LinkSampler.tick(force=True)`` with no RDMA ports); beside
  it the same state and counters read from sysfs as node_exporter reads
  them (``operstate``, ``carrier``, ``carrier_changes``, ``statistics/*``
  of every interface: a file each).
- A reading of every RDMA port (states and every counter), its files kept
  open and read with ``pread``; beside it each file opened, read and closed
  every time.
- A tick with nothing to read (the agent ticks every 200 ms while a job
  runs; the sampler reads at most once a second).
- Mapping one process to its interfaces: its descriptors and its
  namespace's TCP table, with 100 connections open.
- Reading a process's TCP sockets for the kernel's TCP filter (every 5 s
  and when a process is placed) beside ``TIME_WAIT`` sockets that a
  neighbour's churn leaves (10,000, made in the namespace): one sock_diag
  dump filtered by state (``recorder.sockets.SocketReader``), beside the
  namespace's ``/proc/<pid>/net/tcp{,6}`` text, which formats every one.
- The sampler's share of a core at its rate: a netdev reading and a port
  state reading a second, the RDMA counters every 5 s, four empty ticks a
  second.  The idle agent's whole budget is 0.2% of a core
  (``bench_recorder``'s idle figure measures the agent with it); the
  sampler's target is a quarter of that.

``python -m bench.bench_links [--quick]`` prints the table (root needed).
Figures quoted from a shared machine say so.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from bench.common import Figure, render

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "recorder" / "data" / "rdma-sysfs" / "class"
PAIRS = 5  # veth pairs: 10 interfaces and lo
SHARE_TARGET = 0.0005  # of a core: a quarter of the idle agent's 0.2%
CONNECTIONS = 100
TIME_WAITS = 10_000


def _cpu_us(fn: Callable[[], object], n: int, repeats: int) -> float:
    """Median CPU time of one call, in microseconds."""
    runs = []
    for _ in range(repeats):
        t0 = time.process_time()
        for _ in range(n):
            fn()
        runs.append((time.process_time() - t0) / n * 1e6)
    return statistics.median(runs)


def _sysfs_netdevs() -> int:
    """What node_exporter reads: a file per value of every interface."""
    read = 0
    for name in os.listdir("/sys/class/net"):
        base = f"/sys/class/net/{name}"
        for leaf in ("operstate", "carrier", "carrier_changes"):
            read += _read(f"{base}/{leaf}")
        stats = f"{base}/statistics"
        for leaf in os.listdir(stats):
            read += _read(f"{stats}/{leaf}")
    return read


def _read(path: str) -> int:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        return len(os.read(fd, 64))
    except OSError:  # carrier of an interface that is down
        return 0
    finally:
        os.close(fd)


def _connections(n: int) -> tuple[socket.socket, list[socket.socket]]:
    """``n`` TCP connections to a listener of this process, on a veth's address."""
    server = socket.create_server(("10.77.0.1", 0))
    port = server.getsockname()[1]
    clients = [socket.create_connection(("10.77.0.1", port)) for _ in range(n)]
    accepted = [server.accept()[0] for _ in range(n)]
    return server, clients + accepted


def child(quick: bool, sysfs: Path) -> dict[str, float]:
    """The measurements, run inside the namespace."""
    from stallwatch.recorder.links import LinkConfig, LinkSampler
    from stallwatch.recorder.rdma import Files, RdmaPorts

    n, repeats = (50, 3) if quick else (500, 7)
    nowhere = Path("/nonexistent")
    netdevs = LinkSampler(LinkConfig(rdma_root=nowhere, heartbeat_s=3600.0))
    netdevs.tick(force=True)
    interfaces = len(netdevs.table())
    out = {
        "interfaces": float(interfaces),
        "netlink_us": _cpu_us(lambda: netdevs.tick(force=True), n, repeats),
        "sysfs_us": _cpu_us(_sysfs_netdevs, n, repeats),
        "tick_us": _cpu_us(netdevs.tick, n * 10, repeats),
    }
    held, reopened = RdmaPorts(sysfs), RdmaPorts(sysfs, Files(budget=0))
    ports = held.ports()
    reopened.ports()

    def read_all(rdma: RdmaPorts) -> None:
        for port in ports:
            rdma.state(port)
            rdma.counters(port)

    def states(rdma: RdmaPorts) -> None:
        for port in ports:
            rdma.state(port)

    read_all(held)
    out |= {
        "ports": float(len(ports)),
        "rdma_held_us": _cpu_us(lambda: read_all(held), n, repeats),
        "rdma_reopened_us": _cpu_us(lambda: read_all(reopened), n, repeats),
        "rdma_states_us": _cpu_us(lambda: states(held), n, repeats),
        "held_fds": float(held.files.held),
    }
    server, conns = _connections(CONNECTIONS)
    me = os.getpid()
    out["map_us"] = _cpu_us(lambda: netdevs.map_users([me]), max(5, n // 10), repeats)
    out["mapped"] = float(sum(1 for li in netdevs.table() if me in li.pids))
    out |= _job_sockets(me, TIME_WAITS // 10 if quick else TIME_WAITS, repeats)
    for c in [server, *conns]:
        c.close()
    netdevs.close()
    held.close()
    reopened.close()
    return out


def _time_waits(n: int) -> int:
    """``n`` connections opened and closed by their client: ``n`` sockets in
    TIME_WAIT for a minute, as a neighbour's churn leaves them."""
    server = socket.create_server(("10.77.0.1", 0), backlog=1024)
    port = server.getsockname()[1]
    for _ in range(n):
        client = socket.create_connection(("10.77.0.1", port))
        server.accept()[0].close()
        client.close()
    server.close()
    return n


def _job_sockets(me: int, waits: int, repeats: int) -> dict[str, float]:
    from stallwatch.recorder import sockets

    _time_waits(waits)
    reader = sockets.SocketReader()
    by_diag = reader.job_sockets([me])
    by_proc = sockets.process_sockets(me)
    same = set(by_diag.listeners) == by_proc[0] and set(by_diag.connections) == by_proc[1]
    runs = max(3, repeats)
    out = {
        "time_waits": float(waits),
        "sockets_same": float(same),
        "diag_us": _cpu_us(lambda: reader.job_sockets([me]), 5, runs),
        "proc_us": _cpu_us(lambda: sockets.process_sockets(me), 5, runs),
    }
    reader.close()
    return out


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def measure(quick: bool) -> dict[str, float]:
    ns = f"swbench-links-{uuid.uuid4().hex[:6]}"
    _ip("netns", "add", ns)
    try:
        for i in range(PAIRS):
            _ip("-n", ns, "link", "add", f"ve{i}", "type", "veth", "peer", "name", f"vp{i}")
            for dev in (f"ve{i}", f"vp{i}"):
                _ip("-n", ns, "link", "set", dev, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "addr", "add", "10.77.0.1/24", "dev", "ve0")
        with tempfile.TemporaryDirectory() as tmp:
            tree = Path(tmp) / "class"
            shutil.copytree(FIXTURE, tree)
            cmd = [sys.executable, "-m", "bench.bench_links", "--child", str(tree / "infiniband")]
            cmd += ["--quick"] if quick else []
            done = subprocess.run(
                ["ip", "netns", "exec", ns, *cmd],
                cwd=REPO,
                capture_output=True,
                text=True,
                check=False,
                env={**os.environ, "PYTHONPATH": str(REPO)},
            )
            if done.returncode != 0:
                raise RuntimeError(f"bench_links in {ns} failed: {done.stderr[-2000:]}")
            result: dict[str, float] = json.loads(done.stdout)
            return result
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def figures(quick: bool) -> list[Figure]:
    if os.geteuid() != 0:
        raise RuntimeError("bench_links needs root (a network namespace of its own)")
    m = measure(quick)
    ifs, ports = int(m["interfaces"]), int(m["ports"])
    share = (m["netlink_us"] + m["rdma_states_us"] + m["rdma_held_us"] / 5 + 4 * m["tick_us"]) / 1e6
    return [
        Figure(
            f"link reading, {ifs} netdevs (rtnetlink dump)",
            m["netlink_us"],
            "us CPU",
            "-",
            None,
            f"sysfs files as node_exporter reads them: {m['sysfs_us']:.0f} us "
            f"({m['sysfs_us'] / m['netlink_us']:.1f}x)",
        ),
        Figure(
            f"RDMA reading, {ports} ports, every counter (files kept open)",
            m["rdma_held_us"],
            "us CPU",
            "-",
            None,
            f"each file opened again: {m['rdma_reopened_us']:.0f} us "
            f"({m['rdma_reopened_us'] / m['rdma_held_us']:.1f}x); {int(m['held_fds'])} fds held; "
            f"states alone {m['rdma_states_us']:.0f} us",
        ),
        Figure("link tick with nothing to read", m["tick_us"], "us CPU", "-", None),
        Figure(
            f"mapping a process with {CONNECTIONS * 2} TCP sockets to its links",
            m["map_us"],
            "us CPU",
            "-",
            None,
            f"mapped to {int(m['mapped'])} interface(s); once per process every 30 s",
        ),
        Figure(
            f"a process's TCP sockets for the filter, beside {int(m['time_waits']):,} "
            "in TIME_WAIT (sock_diag)",
            m["diag_us"],
            "us CPU",
            ">= 3x less than /proc",
            m["sockets_same"] == 1.0 and m["proc_us"] >= 3 * m["diag_us"],
            f"/proc/<pid>/net/tcp: {m['proc_us']:,.0f} us ({m['proc_us'] / m['diag_us']:.0f}x); "
            f"the same sockets: {'yes' if m['sockets_same'] else 'NO'}",
        ),
        Figure(
            "link sampler, share of a core",
            share * 100,
            "% of a core",
            f"< {SHARE_TARGET * 100:g}%",
            share < SHARE_TARGET,
            f"{ifs} netdevs and {ports} RDMA port states a second, RDMA counters every 5 s, "
            "5 ticks a second; the idle agent's budget is 0.2%",
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_links", description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", metavar="RDMA_ROOT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.quick, Path(args.child))))
        return 0
    figs = figures(args.quick)
    print(render(figs))
    return 0 if all(f.ok is not False for f in figs) else 1


if __name__ == "__main__":
    raise SystemExit(main())

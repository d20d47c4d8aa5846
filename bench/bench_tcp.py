"""The TCP programs' cost, and what they keep, beside the previous design in one run.

Both designs' BPF programs are loaded at once, each by a process of its own
from its own checkout (the previous design from git, ``PREVIOUS``: every TCP
row written, filtered in user space), so that every TCP event of the run
passes through both; the kernel times each program (``bpf_enable_stats``).
The workload, for ``RUN_S`` seconds:

- a neighbour: a process outside the job opening and closing connections on
  loopback as fast as it can (``NEIGHBOUR_PER_S`` a second at most), as a
  data loader or a storage client would;
- the job: a process placed in scope in both designs, sending over a veth
  pair that drops ``LOSS_PCT``% of its packets (retransmits).

Figures: nanoseconds per event of each TCP program (what the kernel spends
on every event of the machine), the job's cost per send (the send program
runs in the job's own thread at each send), the CPU all TCP programs take
per second of this workload, the rows each design writes into the TCP ring
per second, and the job's retransmits still in a ring of ``TCP_SLOTS`` slots
at the end (the previous design's ring is the neighbour's).

``python -m bench.bench_tcp [--quick]`` prints the table (root needed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.common import Figure, render

PREVIOUS = "aa30975"  # the last commit before the TCP evidence was decided in the kernel
REPO = Path(__file__).resolve().parent.parent
RUN_S, QUICK_RUN_S = 30.0, 8.0
NEIGHBOUR_PER_S = 3000
LOSS_PCT = 5
TCP_SLOTS = 4096  # the TCP ring of an agent with --ring-size 16384
PORT = 7101
PROGRAMS = (
    "tracepoint__sock__sock_send_length",
    "tracepoint__sock__sock_recv_length",
    "tracepoint__sock__inet_sock_set_state",
    "tracepoint__tcp__tcp_retransmit_skb",
    "tracepoint__tcp__tcp_send_reset",
    "tracepoint__tcp__tcp_receive_reset",
    "handle_sock_ops",
)

# Run with PYTHONPATH at a design's checkout: load its programs (compiled
# here, nothing pinned), place the job in scope, report the programs' run
# statistics between two cues and what its TCP ring holds at the end.
LOADER = """
import json, sys
import numpy as np
from stallwatch.recorder import bpfsys, probes
job, slots, names = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")
p = probes.Probes(probes.RingSizes.from_nccl(slots * 4), 1_000_000)
p.set_pid("tracked", job, True)
def stats():
    out = {}
    for raw, fn in p.bpf.funcs.items():
        name = raw.decode()
        if name in names:
            info = bpfsys.prog_info(int(fn.fd))
            out[name] = [info.run_cnt, info.run_time_ns]
    return out
print("ready", flush=True)
sys.stdin.readline()
before, head0 = stats(), p.maps.head("tcp")
print("started", flush=True)
sys.stdin.readline()
after, head1 = stats(), p.maps.head("tcp")
rows = p.maps.ring_arrays["tcp"].copy()
valid = (rows["pos"] > max(head1 - len(rows), 0)) & (rows["pos"] <= head1)
mine = valid & (rows["pid"] == job) & (rows["event"] == 1)
print(json.dumps({"before": before, "after": after, "rows": head1 - head0,
                  "job_retransmits": int(mine.sum())}), flush=True)
p.close()
"""

NEIGHBOUR = """
import socket, sys, threading, time
srv = socket.create_server(("127.0.0.1", 0), backlog=1024)
port = srv.getsockname()[1]
def serve():
    while True:
        c, _ = srv.accept()
        c.close()
threading.Thread(target=serve, daemon=True).start()
rate, seconds = float(sys.argv[1]), float(sys.argv[2])
start = time.monotonic()
n = 0
while (now := time.monotonic()) < start + seconds:
    if n > rate * (now - start):
        time.sleep(0.001)
        continue
    socket.create_connection(("127.0.0.1", port)).close()
    n += 1
print(n, flush=True)
"""

SENDER = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
c.setblocking(False)
print("connected", flush=True)
sys.stdin.readline()
end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    try:
        c.send(b"x" * 16384)
    except BlockingIOError:
        time.sleep(0.002)
"""

SINK = """
import socket, sys
s = socket.create_server(("0.0.0.0", int(sys.argv[1])))
print("listening", flush=True)
c, _ = s.accept()
while c.recv(65536):
    pass
"""


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def _lossy_pair() -> Iterator[tuple[str, str, str]]:
    """Namespaces a and b on a veth pair, b dropping LOSS_PCT% of what it receives."""
    tag = uuid.uuid4().hex[:5]
    a, b = f"swbench-{tag}-a", f"swbench-{tag}-b"
    try:
        _sh("ip", "netns", "add", a)
        _sh("ip", "netns", "add", b)
        _sh("ip", "link", "add", f"bt{tag}a", "netns", a, "type", "veth", "peer", "name",
            f"bt{tag}b", "netns", b)  # fmt: skip
        for ns, dev, ip in ((a, f"bt{tag}a", "10.79.0.1"), (b, f"bt{tag}b", "10.79.0.2")):
            _sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
        nft = ("ip", "netns", "exec", b, "nft")
        _sh(*nft, "add table inet loss")
        _sh(*nft, "add chain inet loss in { type filter hook input priority 0; }")
        _sh(
            *nft, f"add rule inet loss in tcp dport {PORT} numgen random mod 100 lt {LOSS_PCT} drop"
        )
        yield a, b, "10.79.0.2"
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def _previous(into: Path) -> Path | None:
    archive = into / "previous.tar"
    with archive.open("wb") as out:
        done = subprocess.run(
            ["git", "-C", str(REPO), "archive", PREVIOUS], stdout=out, check=False
        )
    if done.returncode != 0:
        return None
    target = into / "previous"
    with tarfile.open(archive) as tar:
        tar.extractall(target, filter="tar")
    return target


def _spawn(
    argv: list[str], env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.Popen[str]:
    """``cwd``: a design's checkout (``python -c`` imports from there first)."""
    return subprocess.Popen(
        argv, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=cwd
    )


def _say(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()


def _hear(proc: subprocess.Popen[str], want: str | None = None) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if want is not None and line != want:
        raise RuntimeError(f"expected {want!r} from {proc.args!r}, got {line!r}")
    return line


def _measure(designs: dict[str, Path], run_s: float) -> tuple[dict[str, Any], int]:
    """Both designs loaded at once through one workload; per design its
    loader's report; and the neighbour's connections made."""
    stats_fd = _enable_stats()
    procs: list[subprocess.Popen[str]] = []
    try:
        with _lossy_pair() as (a, b, b_ip):
            sink = _spawn(["ip", "netns", "exec", b, sys.executable, "-c", SINK, str(PORT)])
            procs.append(sink)
            _hear(sink, "listening")
            sender = _spawn(
                [
                    "ip",
                    "netns",
                    "exec",
                    a,
                    sys.executable,
                    "-c",
                    SENDER,
                    b_ip,
                    str(PORT),
                    str(run_s),
                ]
            )
            procs.append(sender)
            _hear(sender, "connected")
            loaders = {}
            for name, root in designs.items():
                env = {**os.environ, "PYTHONPATH": str(root)}
                argv = [
                    sys.executable,
                    "-c",
                    LOADER,
                    str(sender.pid),
                    str(TCP_SLOTS),
                    ",".join(PROGRAMS),
                ]
                loaders[name] = _spawn(argv, env, cwd=root)
                procs.append(loaders[name])
            for proc in loaders.values():
                _hear(proc, "ready")
            for proc in loaders.values():
                _say(proc)
                _hear(proc, "started")
            neighbour = _spawn([sys.executable, "-c", NEIGHBOUR, str(NEIGHBOUR_PER_S), str(run_s)])
            procs.append(neighbour)
            _say(sender)
            made = int(_hear(neighbour))
            sender.wait(run_s + 30)
            time.sleep(0.5)
            reports = {}
            for name, proc in loaders.items():
                _say(proc)
                reports[name] = json.loads(_hear(proc))
            return reports, made
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()
        os.close(stats_fd)


def _enable_stats() -> int:
    sys.path.insert(0, str(REPO))
    from stallwatch.recorder import bpfsys

    return bpfsys.enable_stats()


def _per_event(report: dict[str, Any], program: str) -> tuple[int, float] | None:
    before, after = report["before"].get(program), report["after"].get(program)
    if before is None or after is None or after[0] == before[0]:
        return None
    runs = after[0] - before[0]
    return runs, (after[1] - before[1]) / runs


def _cpu_ms_per_s(report: dict[str, Any], run_s: float) -> float:
    spent = sum(a[1] - report["before"][p][1] for p, a in report["after"].items())
    return spent / 1e6 / run_s


def figures(quick: bool = False) -> list[Figure]:
    run_s = QUICK_RUN_S if quick else RUN_S
    with tempfile.TemporaryDirectory(prefix="stallwatch-bench-tcp-") as tmp:
        designs = {"now": REPO}
        previous = _previous(Path(tmp))
        if previous is not None:
            designs["previous"] = previous
        reports, made = _measure(designs, run_s)
    now, before = reports["now"], reports.get("previous")
    out: list[Figure] = []
    for program in PROGRAMS:
        mine = _per_event(now, program)
        if mine is None:
            continue
        theirs = _per_event(before, program) if before is not None else None
        anchor = f"{mine[0] / run_s:,.0f} events/s"
        if theirs is not None:
            anchor += f"; previous design: {theirs[1]:.0f} ns"
        short = program.removeprefix("tracepoint__").replace("__", ":")
        out.append(Figure(f"TCP program {short}, per event", mine[1], "ns", "-", None, anchor))
    send = _per_event(now, "tracepoint__sock__sock_send_length")
    if send is not None:
        old = _per_event(before, "tracepoint__sock__sock_send_length") if before else None
        anchor = f"previous design: {old[1]:.0f} ns" if old else "no previous design"
        out.append(
            Figure("the job's cost per send (its own thread)", send[1], "ns", "-", None, anchor)
        )
    rate = made / run_s
    anchor = f"neighbour at {rate:,.0f} connections/s, job on a {LOSS_PCT}% lossy link"
    if before is not None:
        anchor += f"; previous design: {_cpu_ms_per_s(before, run_s):.2f} ms/s"
    out.append(Figure("all TCP programs, CPU per second", _cpu_ms_per_s(now, run_s), "ms/s",
                      "-", None, anchor))  # fmt: skip
    anchor = f"previous design: {before['rows'] / run_s:,.0f}/s" if before else ""
    out.append(Figure("TCP ring rows written", now["rows"] / run_s, "/s", "-", None, anchor))
    kept_now = now["job_retransmits"]
    ok = kept_now > 0 and (before is None or kept_now >= before["job_retransmits"])
    anchor = f"{TCP_SLOTS} slots after {run_s:.0f} s of churn"
    if before is not None:
        anchor += f"; previous design kept {before['job_retransmits']}"
    out.append(Figure("the job's retransmits still in the ring", kept_now, "rows",
                      ">= previous design's, > 0", ok, anchor))  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_tcp", description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    figs = figures(args.quick)
    print(render(figs))
    return 0 if all(f.ok is not False for f in figs) else 1


if __name__ == "__main__":
    raise SystemExit(main())

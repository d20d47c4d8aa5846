"""The TCP programs' cost, and what they keep: as raw tracepoints (the agent's
attachment) against tracepoints (the fallback) and the previous design, in
one run.

The three designs' BPF programs are loaded at once, each by a process of its
own (the previous design from its git commit, ``PREVIOUS``: every TCP row
written, filtered in user space; the other two from this checkout, one told
to attach to tracepoints), so that every TCP event of the run passes through
all three; the kernel times each program (``bpf_enable_stats``).  The
workload, for ``RUN_S`` seconds:

- a neighbour: a process outside the job opening and closing connections on
  loopback as fast as it can (``NEIGHBOUR_PER_S`` a second at most), as a
  data loader or a storage client would;
- the job: a process placed in scope in every design, sending over a veth
  pair that drops ``LOSS_PCT``% of its packets (retransmits).

A program's time is not all an event costs: before a tracepoint's program
runs, the kernel copies the event's fields into a buffer (the raw
tracepoint's program reads what it needs itself, inside its time).  That
cost of each attachment is measured apart, on sock_send_length: a C loop of
sends (``bench/csrc/sendloop.c``, the thread's CPU time per send) with a
program that does nothing attached as a tracepoint's, as a raw
tracepoint's, and with none, in turn, medians over ``ATTACH_REPEATS``.

Figures: nanoseconds per event of each TCP program (what the kernel spends
on every event of the machine) per attachment, the attachments' own cost,
the job's cost per send (the send program and its attachment, in the job's
own thread), the CPU all TCP programs take per second of this workload, the
runs the kernel skipped, the rows each design writes into the TCP ring per
second, and the job's retransmits still in a ring of ``TCP_SLOTS`` slots at
the end (the previous design's ring is the neighbour's).

``python -m bench.bench_tcp [--quick]`` prints the table (root needed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench.common import Figure, render
from bench.fakenccl import CSRC
from stallwatch.recorder.tcp_probes import PAIR_CAUGHT, PAIRED

PREVIOUS = "aa30975"  # the last commit before the TCP evidence was decided in the kernel
REPO = Path(__file__).resolve().parent.parent
RUN_S, QUICK_RUN_S = 30.0, 8.0
NEIGHBOUR_PER_S = 3000
LOSS_PCT = 5
TCP_SLOTS = 4096  # the TCP ring of an agent with --ring-size 16384
PORT = 7101
HOOKS = (
    ("sock", "sock_send_length"),
    ("sock", "sock_recv_length"),
    ("sock", "inet_sock_set_state"),
    ("tcp", "tcp_retransmit_skb"),
    ("tcp", "tcp_send_reset"),
    ("tcp", "tcp_receive_reset"),
)
SOCK_OPS = "handle_sock_ops"
RAW, TRACEPOINT = "raw tracepoints", "tracepoints"


def program(design: str, category: str, event: str) -> str:
    """A hook's program as BCC names it in ``design``."""
    return f"raw_tracepoint__{event}" if design == RAW else f"tracepoint__{category}__{event}"


def second(event: str) -> str:
    """A paired raw tracepoint's second program (for the runs the kernel
    skipped the first for: bpf/tcp.c, RAW_PAIR)."""
    return f"raw_tracepoint__{event}__nested"


PROGRAMS = (
    *(program(d, c, e) for d in (RAW, TRACEPOINT) for c, e in HOOKS),
    *(second(e) for e in PAIRED),
    SOCK_OPS,
)
ATTACH_REPEATS, QUICK_ATTACH_REPEATS = 15, 5
SENDS = 300_000  # per timing of the send loop

# Run with PYTHONPATH at a design's checkout: load its programs (compiled
# here, nothing pinned), place the job in scope, report the programs' run
# statistics between two cues and what its TCP ring holds at the end.
LOADER = """
import json, sys
import numpy as np
from stallwatch.recorder import bpfsys, probes
job, slots, names, raw = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(","), sys.argv[4]
paired, caught_map = sys.argv[5].split(","), sys.argv[6]
try:  # this checkout: the rooms of the recorder
    from stallwatch.recorder.bpfbuild import RingSizes
    p = probes.Probes(RingSizes.from_nccl(slots * 4), 1_000_000, raw_tracepoints=raw == "1")
    funcs = p.module.bpf.funcs
except ImportError:  # the previous design
    p = probes.Probes(probes.RingSizes.from_nccl(slots * 4), 1_000_000)
    funcs = p.bpf.funcs
p.set_pid("tracked", job, True)
def stats():
    out = {}
    for raw, fn in funcs.items():
        name = raw.decode()
        if name in names:
            info = bpfsys.prog_info(int(fn.fd))
            out[name] = [info.run_cnt, info.run_time_ns, getattr(info, "recursion_misses", 0)]
    caught = p.maps.maps.get(caught_map)
    if caught is not None:  # the runs each paired hook's second program ran for
        out.update({"caught:" + e: [0, 0, caught.percpu_sum(i)] for i, e in enumerate(paired)})
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


def _measure(designs: dict[str, tuple[Path, str]], run_s: float) -> tuple[dict[str, Any], int]:
    """Every design loaded at once through one workload (design -> its
    checkout and whether it asks for raw tracepoints: "1", "0", "-" for a
    design that has no such choice); per design its loader's report; and
    the neighbour's connections made."""
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
            for name, (root, raw) in designs.items():
                env = {**os.environ, "PYTHONPATH": str(root)}
                argv = [
                    sys.executable,
                    "-c",
                    LOADER,
                    str(sender.pid),
                    str(TCP_SLOTS),
                    ",".join(PROGRAMS),
                    raw,
                    ",".join(PAIRED),
                    PAIR_CAUGHT,
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


def _per_event(report: dict[str, Any] | None, name: str) -> tuple[int, float] | None:
    if report is None:
        return None
    before, after = report["before"].get(name), report["after"].get(name)
    if before is None or after is None or after[0] == before[0]:
        return None
    runs = after[0] - before[0]
    return runs, (after[1] - before[1]) / runs


def _skipped(report: dict[str, Any], names: tuple[str, ...] | None = None) -> int:
    after = report["after"]
    return sum(a[2] - report["before"][p][2] for p, a in after.items() if not names or p in names)


def _unseen(report: dict[str, Any]) -> tuple[int, int]:
    """(the first programs' skipped runs, those of them no program ran for)."""
    firsts = tuple(program(RAW, c, e) for c, e in HOOKS)
    skipped = _skipped(report, firsts)
    return skipped, skipped - _skipped(report, tuple(f"caught:{e}" for e in PAIRED))


def _cpu_ms_per_s(report: dict[str, Any], run_s: float) -> float:
    spent = sum(a[1] - report["before"][p][1] for p, a in report["after"].items())
    return spent / 1e6 / run_s


def _send_loop() -> Path:
    out = Path(tempfile.mkdtemp(prefix="stallwatch-bench-send-")) / "sendloop"
    cc = shutil.which("cc") or "gcc"
    subprocess.run([cc, "-O2", "-o", str(out), str(CSRC / "sendloop.c")], check=True)
    return out


def _send_ns(loop: Path) -> float:
    done = subprocess.run([str(loop), str(SENDS)], capture_output=True, text=True, check=True)
    return float(done.stdout)


def attachment_cost(repeats: int) -> dict[str, float]:
    """CPU ns per send with a program that does nothing on sock_send_length,
    as a tracepoint's and as a raw tracepoint's, above none: medians of
    ``repeats`` rounds, each timing the three in turn."""
    from stallwatch.recorder import bpfsys
    from stallwatch.recorder.bccmodule import BccModule

    loop = _send_loop()
    module = BccModule(src_file=CSRC / "emptyhooks.c")
    try:
        tp = module.load("tracepoint__sock__sock_send_length", bpfsys.BPF_PROG_TYPE_TRACEPOINT)
        raw = module.load("raw_tracepoint__sock_send_length", bpfsys.BPF_PROG_TYPE_RAW_TRACEPOINT)
        links: dict[str, Callable[[], int]] = {
            TRACEPOINT: lambda: bpfsys.tracepoint_link(tp, "sock", "sock_send_length"),
            RAW: lambda: bpfsys.raw_tracepoint_open(raw, "sock_send_length"),
        }
        times: dict[str, list[float]] = {"none": [], TRACEPOINT: [], RAW: []}
        for _ in range(repeats):
            times["none"].append(_send_ns(loop))
            for name, make in links.items():
                fd = make()
                try:
                    times[name].append(_send_ns(loop))
                finally:
                    os.close(fd)
    finally:
        module.cleanup()
        shutil.rmtree(loop.parent, ignore_errors=True)
    bare = statistics.median(times["none"])
    return {
        "none": bare,
        **{k: statistics.median(v) - bare for k, v in times.items() if k != "none"},
    }


def _program_figures(reports: dict[str, Any], run_s: float) -> list[Figure]:
    raw, tp, before = reports[RAW], reports[TRACEPOINT], reports.get("previous")
    out = []
    for category, event in HOOKS:
        mine = _per_event(raw, program(RAW, category, event))
        if mine is None:
            continue
        anchor = f"{mine[0] / run_s:,.0f} events/s"
        both = _per_event(raw, second(event))
        if both is not None:  # the second program runs at every event too
            anchor += f", its second program {both[1]:.0f} ns of it"
            mine = (mine[0], mine[1] + both[1])
        theirs = _per_event(tp, program(TRACEPOINT, category, event))
        if theirs is not None:
            anchor += f"; as a tracepoint's: {theirs[1]:.0f} ns"
        old = _per_event(before, program(TRACEPOINT, category, event))
        if old is not None:
            anchor += f"; previous design: {old[1]:.0f} ns"
        skipped = [
            _skipped(r, (program(d, category, event),)) for d, r in ((RAW, raw), (TRACEPOINT, tp))
        ]
        if any(skipped):
            caught = _skipped(raw, (f"caught:{event}",))
            anchor += f"; runs skipped: {skipped[0]} ({caught} run by its second program)"
            anchor += f", as a tracepoint's {skipped[1]}"
        name = f"TCP program {category}:{event}, per event (raw tracepoint)"
        out.append(Figure(name, mine[1], "ns", "-", None, anchor))
    return out


def _attachment_figures(reports: dict[str, Any], cost: dict[str, float]) -> list[Figure]:
    anchor = (
        f"as a tracepoint: {cost[TRACEPOINT]:.0f} ns (the kernel copies its fields first); "
        f"a send with none: {cost['none']:.0f} ns"
    )
    out = [Figure("an empty program's own cost per event, raw tracepoint", cost[RAW], "ns", "-",
                  None, anchor)]  # fmt: skip
    send = {
        d: _per_event(reports[d], program(d, "sock", "sock_send_length")) for d in (RAW, TRACEPOINT)
    }
    raw, tp = send[RAW], send[TRACEPOINT]
    if raw is not None and tp is not None:
        anchor = f"as tracepoints: {tp[1] + cost[TRACEPOINT]:.0f} ns (program {tp[1]:.0f})"
        name = "the job's cost per send (its own thread), raw tracepoint"
        out.append(
            Figure(name, raw[1] + cost[RAW], "ns", "-", None, f"program {raw[1]:.0f}; {anchor}")
        )
    return out


def _whole_ms_per_s(report: dict[str, Any], run_s: float, attach_ns: float) -> float:
    """The programs' time and, for each run, what its attachment costs
    before it (an empty program's cost on sock_send_length, the same for
    every hook: an estimate), per second.  sock_ops is no tracepoint's."""
    runs = sum(
        a[0] - report["before"][p][0] for p, a in report["after"].items() if p in PROGRAMS[:-1]
    )
    return _cpu_ms_per_s(report, run_s) + runs * attach_ns / 1e6 / run_s


def _totals(
    reports: dict[str, Any], run_s: float, made: int, cost: dict[str, float]
) -> list[Figure]:
    now, tp, before = reports[RAW], reports[TRACEPOINT], reports.get("previous")
    rate = made / run_s
    anchor = (
        f"neighbour at {rate:,.0f} connections/s, job on a {LOSS_PCT}% lossy link; "
        f"as tracepoints: {_cpu_ms_per_s(tp, run_s):.2f} ms/s"
    )
    if before is not None:
        anchor += f"; previous design: {_cpu_ms_per_s(before, run_s):.2f} ms/s"
    out = [Figure("all TCP programs, CPU per second (raw tracepoints)", _cpu_ms_per_s(now, run_s),
                  "ms/s", "-", None, anchor)]  # fmt: skip
    whole = {d: _whole_ms_per_s(reports[d], run_s, cost[d]) for d in (RAW, TRACEPOINT)}
    anchor = (
        f"as tracepoints: {whole[TRACEPOINT]:.2f} ms/s (each run's attachment an empty program's)"
    )
    name = "all TCP programs and their attachments, CPU per second (raw tracepoints)"
    out.append(Figure(name, whole[RAW], "ms/s", "-", None, anchor))
    skipped, unseen = _unseen(now)
    anchor = f"first programs skipped {skipped}, the rest their second ran for; "
    anchor += f"as tracepoints skipped and unseen: {_skipped(tp)}"
    name = "TCP events no program ran for (raw tracepoints)"
    out.append(Figure(name, unseen, "events", "0", unseen == 0, anchor))
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


def figures(quick: bool = False) -> list[Figure]:
    run_s = QUICK_RUN_S if quick else RUN_S
    with tempfile.TemporaryDirectory(prefix="stallwatch-bench-tcp-") as tmp:
        designs = {RAW: (REPO, "1"), TRACEPOINT: (REPO, "0")}
        previous = _previous(Path(tmp))
        if previous is not None:
            designs["previous"] = (previous, "-")
        reports, made = _measure(designs, run_s)
    cost = attachment_cost(QUICK_ATTACH_REPEATS if quick else ATTACH_REPEATS)
    return [
        *_program_figures(reports, run_s),
        *_attachment_figures(reports, cost),
        *_totals(reports, run_s, made, cost),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_tcp", description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    figs = figures(args.quick)
    print(render(figs))
    return 0 if all(f.ok is not False for f in figs) else 1


if __name__ == "__main__":
    raise SystemExit(main())

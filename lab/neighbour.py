"""The TCP neighbour of a run (``lab run --neighbour-churn N``): one
``lab.churn`` process per node (``python -m stallwatch.commands.labchurn``),
started before the ranks and stopped once the job ended and the agents
dumped, and what they achieved.

The rate is judged by the kernel: the nodes' ``ActiveOpens`` (``/proc/net/snmp``,
one count per connect(), read inside each namespace) just before the
processes are told to go and once they stopped.  The job's own connects
(its mesh, at start-up) and the lab's requests to the agents count there
too: a few dozen, against N a second.  The processes' own counts (made,
failed, timed out) are reported beside it.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from stallwatch.dumpers.errors import LabError
from stallwatch.lab import netns
from stallwatch.lab.churn import CHURN_PORT, GO_FILE, ChurnStats
from stallwatch.lab.logs import last_line

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0

Spawn = Callable[[netns.Node, list[str], Path], "subprocess.Popen[bytes]"]


@dataclass(frozen=True, slots=True)
class ChurnOutcome:
    """What the neighbour did, in ``lab run --json`` (``neighbour_churn``)."""

    target_per_s: int
    processes: int
    port: int
    seconds: float  # from the go to the stop
    connections: int  # made and closed, as the clients counted them
    failed: int  # refused, reset or unreachable
    timed_out: int  # not closed by the server within the churn's timeout
    per_s: float  # connections / seconds
    active_opens: int  # the nodes' ActiveOpens over the same time
    active_opens_per_s: float
    cpu_s: float  # the processes' CPU time, all together

    def line(self) -> str:
        return (
            f"neighbour churn: {self.target_per_s:,}/s asked, {self.active_opens_per_s:,.0f}/s "
            f"opened (ActiveOpens), {self.connections:,} connections made in "
            f"{self.seconds:.1f} s ({self.per_s:,.0f}/s), {self.failed + self.timed_out:,} failed, "
            f"{self.cpu_s / self.seconds:.0%} of a CPU"
        )


def churn_argv(listen_ip: str, peer_ip: str, rate: float, stats: Path, go: Path) -> list[str]:
    argv = [sys.executable, "-m", "stallwatch.commands.labchurn", "--listen", listen_ip]
    argv += ["--peer", peer_ip, "--rate", f"{rate:g}", "--stats", str(stats), "--go", str(go)]
    return argv


@dataclass
class Neighbour:
    rate: int  # connections a second, over every node
    nodes: tuple[netns.Node, ...]
    run_dir: Path
    spawn: Spawn
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    opens_before: int = 0
    began: float = 0.0

    def stats_path(self, node: netns.Node) -> Path:
        return self.run_dir / f"churn-{node.index}.json"

    def log_path(self, node: netns.Node) -> Path:
        return self.run_dir / f"churn-{node.index}.log"

    def start(self) -> None:
        """Every node's process listening, then the go: they begin connecting."""
        share = self.rate / len(self.nodes)
        go = self.run_dir / GO_FILE
        for k, node in enumerate(self.nodes):
            peer = self.nodes[(k + 1) % len(self.nodes)]
            argv = churn_argv(node.ip, peer.ip, share, self.stats_path(node), go)
            self.procs.append(self.spawn(node, argv, self.log_path(node)))
        self._wait_listening()
        self.opens_before = self._active_opens()
        go.touch()
        self.began = time.monotonic()

    def _wait_listening(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        for node, proc in zip(self.nodes, self.procs, strict=True):
            while not _listening(self.stats_path(node)):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise LabError(
                        f"the neighbour's churn process in {node.netns} did not start: "
                        f"{last_line(self.log_path(node))}"
                    )
                time.sleep(0.02)

    def _active_opens(self) -> int:
        return sum(netns.tcp_counters(n.netns)["ActiveOpens"] for n in self.nodes)

    def stop(self) -> ChurnOutcome:
        """Stop them; what they did."""
        ended = time.monotonic()
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
        opens = self._active_opens() - self.opens_before
        stats = [ChurnStats.read(self.stats_path(n)) or ChurnStats() for n in self.nodes]
        seconds = max(ended - self.began, 1e-9)
        made = sum(s.made for s in stats)
        return ChurnOutcome(
            target_per_s=self.rate,
            processes=len(self.procs),
            port=CHURN_PORT,
            seconds=round(seconds, 3),
            connections=made,
            failed=sum(s.failed for s in stats),
            timed_out=sum(s.timed_out for s in stats),
            per_s=round(made / seconds, 1),
            active_opens=opens,
            active_opens_per_s=round(opens / seconds, 1),
            cpu_s=round(sum(s.cpu_s for s in stats), 3),
        )

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)


def _listening(path: Path) -> bool:
    stats = ChurnStats.read(path)
    return stats is not None and stats.listening

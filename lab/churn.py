"""A TCP neighbour outside the job (``lab run --neighbour-churn N``): short
connections between the nodes, as a data loader or a storage client on the
same machines makes, from before the job starts until it ends.

Each node runs one churn process (plain Python: it never loads libnccl), in
the node's namespace, listening on ``CHURN_PORT`` (a port the job never uses:
its ranks listen on ephemeral ports, the agents on 9400).  It accepts every
connection and closes it at once, and it opens connections to the next
node's churn process at its share of N per second (node k to node k+1, the
last to node 0; a single node to itself), waits for the server's close and
closes too.  The server closes first, as an HTTP/1.0 server does, so the
TIME_WAIT sockets pile up on the servers (about 14,000 a node at 1,000 a
second, measured) and the clients' ports stay free: a client that closed
first would run out of ephemeral ports towards one server within 30 s at
that rate.

Pacing: the connections due since the start are opened every ``TICK_S``; one
not closed by its server within ``CONNECT_TIMEOUT_S`` (a partitioned node) is
counted as timed out and dropped.  As many may be open at once as the rate
opens in twice that time (at least ``MIN_IN_FLIGHT``; the file limit is
raised to match), so the neighbour keeps opening N a second while a node it
talks to is cut off, as a client with a connect timeout would (with at most
512 open, a 3-node run whose node 2 was cut off for the last 7 of its 13 s
opened 1,680 a second; with this bound 2,000).  What the processes cost is
reported (``cpu_s``): 26% of a CPU for three at 2,000 a second in total.

The process writes its counts (``ChurnStats``) into its stats file every
``REPORT_S`` and when SIGTERM stops it; it starts connecting only once the
run's go file exists, so the runner can read the nodes' ``ActiveOpens``
counters (``/proc/net/snmp``) first and judge the rate by the kernel's count.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import selectors
import signal
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

CHURN_PORT = 9500
TICK_S = 0.005
MIN_IN_FLIGHT = 512
CONNECT_TIMEOUT_S = 2.0
REPORT_S = 0.5
BACKLOG = 4096
GO_FILE = "churn.go"
CLIENT = "client"  # the selector's mark of a client socket (the server's is None)


@dataclass(slots=True)
class ChurnStats:
    """What one churn process did (its stats file, JSON)."""

    listening: bool = False
    started_ns: int | None = None  # CLOCK_MONOTONIC: the first connection
    stopped_ns: int | None = None
    attempts: int = 0  # connections opened
    made: int = 0  # closed by the server: made and done
    failed: int = 0  # refused, reset, unreachable
    timed_out: int = 0
    accepted: int = 0  # as the server
    cpu_s: float = 0.0  # the process's CPU time (user and system)

    def write(self, path: Path) -> None:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(asdict(self)))
        os.replace(tmp, path)

    @classmethod
    def read(cls, path: Path) -> ChurnStats | None:
        try:
            raw = json.loads(path.read_text())
            return cls(**{k: raw[k] for k in cls.__dataclass_fields__})
        except (OSError, ValueError, KeyError, TypeError):
            return None


@dataclass(frozen=True, slots=True)
class ChurnArgs:
    listen_ip: str
    peer_ip: str
    rate: float  # connections a second this process opens
    stats: Path
    go: Path
    port: int = CHURN_PORT


class _Churner:
    def __init__(self, args: ChurnArgs) -> None:
        self.args = args
        self.stats = ChurnStats()
        self.sel = selectors.DefaultSelector()
        # open client sockets by fd, oldest first: (when opened, socket)
        self.inflight: dict[int, tuple[float, socket.socket]] = {}
        self.stopping = False
        self.max_in_flight = max(MIN_IN_FLIGHT, int(args.rate * CONNECT_TIMEOUT_S * 2))
        _raise_file_limit(self.max_in_flight + 64)
        self.server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.server.bind((args.listen_ip, args.port))
        self.server.listen(BACKLOG)
        self.server.setblocking(False)
        self.sel.register(self.server, selectors.EVENT_READ, None)

    def run(self) -> None:
        self.stats.listening = True
        self.stats.write(self.args.stats)
        while not self.stopping and not self.args.go.exists():
            self._serve(0.01)
        began = time.monotonic()
        self.stats.started_ns = time.monotonic_ns()
        reported = began
        while not self.stopping:
            now = time.monotonic()
            self._open(int((now - began) * self.args.rate) - self.stats.attempts)
            self._serve(TICK_S)
            self._expire(time.monotonic())
            if now - reported >= REPORT_S:
                self._report()
                reported = now
        self.stats.stopped_ns = time.monotonic_ns()
        self._report()

    def _report(self) -> None:
        times = os.times()
        self.stats.cpu_s = round(times.user + times.system, 3)
        self.stats.write(self.args.stats)

    def _open(self, due: int) -> None:
        for _ in range(max(0, min(due, self.max_in_flight - len(self.inflight)))):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
            self.stats.attempts += 1
            code = sock.connect_ex((self.args.peer_ip, self.args.port))
            if code not in (0, errno.EINPROGRESS):
                self.stats.failed += 1
                sock.close()
                continue
            # readable once the server closed it (EOF) or it failed
            self.sel.register(sock, selectors.EVENT_READ, CLIENT)
            self.inflight[sock.fileno()] = (time.monotonic(), sock)

    def _serve(self, timeout: float) -> None:
        for key, _ in self.sel.select(timeout):
            if key.data is None:
                self._accept()
            else:
                self._done(key.fileobj)  # type: ignore[arg-type]

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # e.g. EMFILE: the clients time out, which is counted
            self.stats.accepted += 1
            conn.close()

    def _done(self, sock: socket.socket) -> None:
        try:
            ok = sock.recv(1) == b""
        except OSError:
            ok = False
        if ok:
            self.stats.made += 1
        else:
            self.stats.failed += 1
        self._drop(sock)

    def _drop(self, sock: socket.socket) -> None:
        del self.inflight[sock.fileno()]
        self.sel.unregister(sock)
        sock.close()

    def _expire(self, now: float) -> None:
        while self.inflight:
            opened, sock = next(iter(self.inflight.values()))
            if now - opened < CONNECT_TIMEOUT_S:
                return
            self.stats.timed_out += 1
            self._drop(sock)


def _raise_file_limit(want: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        top = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (top, hard))


def run(args: ChurnArgs) -> int:
    churner = _Churner(args)

    def stop(_signum: int, _frame: object) -> None:
        churner.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    with contextlib.suppress(KeyboardInterrupt):
        churner.run()
    return 0

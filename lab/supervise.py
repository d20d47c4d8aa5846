"""Supervision as systemd gives it to the agent's unit, for the lab.

The lab's machine runs no systemd, and the agent's unit
(``deploy/systemd/stallwatch.service``) is what operators run it under, so
the lab supervises each node's agent the same way:

- a cgroup per agent with the unit's bounds (``MemoryMax=``, ``CPUQuota=``):
  cgroup v2 where the memory controller is enabled, else the v1
  ``memory`` and ``cpu`` hierarchies; the kernel kills an agent that outgrows
  its memory bound, as it would under systemd;
- ``Type=notify``: ``$NOTIFY_SOCKET`` (a path: abstract sockets belong to a
  network namespace, and agents run in their node's), ``READY=1`` ends the
  start (``TimeoutStartSec=``), only the agent's own pid is heard
  (``NotifyAccess=main``, by the sender's credentials);
- the service watchdog (``WatchdogSec=``): no ``WATCHDOG=1`` for that long
  and the agent gets SIGABRT, then SIGKILL, and counts as failed;
- ``Restart=on-failure`` after ``RestartSec=``: a non-zero exit, a signal
  other than the stop signal, a watchdog or start timeout; a stop asked for
  (``stop``) is not restarted.

Every start, exit and restart is kept in ``events`` for tests to read.
The lab never imports the agent: it runs it as a command.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

log = logging.getLogger("stallwatch.lab")

CGROUP_ROOT = Path("/sys/fs/cgroup")
ABORT_TIMEOUT_S = 5.0  # TimeoutAbortSec: SIGABRT, then SIGKILL
POLL_S = 0.05
LOG_TAIL_BYTES = 64 * 1024  # enough for every thread's stack in a report
FAULT_HEADER = "Fatal Python error"
FRAME = re.compile(r'\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
OWN_PACKAGE = "stallwatch"


@dataclass(frozen=True, slots=True)
class Service:
    """The unit settings the supervisor applies (systemd's names)."""

    memory_max: int | None = None  # bytes
    cpu_quota_pct: int | None = None  # CPUQuota=, percent of one CPU
    watchdog_s: float | None = None  # WatchdogSec=
    restart_s: float = 1.0  # RestartSec=
    start_timeout_s: float = 120.0  # TimeoutStartSec=
    stop_timeout_s: float = 30.0  # TimeoutStopSec=
    start_limit: int = 5  # StartLimitBurst= (within the supervisor's life)
    no_restart_codes: tuple[int, ...] = (2,)  # RestartPreventExitStatus=: bad usage


@dataclass(frozen=True, slots=True)
class Event:
    at: float  # monotonic
    kind: str  # started, ready, exited, watchdog, start-timeout, restarting, stopped, gave-up
    pid: int
    detail: str = ""
    code: int | None = None  # exited: the return code (negative: the signal)

    def text(self) -> str:
        return f"{self.kind} pid {self.pid}" + (f": {self.detail}" if self.detail else "")


# ---- cgroups -------------------------------------------------------------------


def _own_cgroup(controller: str) -> str | None:
    """This process's cgroup path in a v1 hierarchy (``controller``) or v2 ("")."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if (controller and controller in names.split(",")) or (not controller and names == ""):
            return path
    return None


def _v2_mount() -> Path | None:
    for line in Path("/proc/self/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) > 2 and parts[2] == "cgroup2":
            return Path(parts[1])
    return None


class Cgroup:
    """One agent's cgroup: v2 when it can bound memory, else v1 memory + cpu."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.v2: Path | None = None
        self.v1: dict[str, Path] = {}
        mount, own = _v2_mount(), _own_cgroup("")
        if mount is not None and own is not None:
            parent = mount / own.lstrip("/")
            control = parent / "cgroup.subtree_control"
            if control.exists() and "memory" in control.read_text().split():
                self.v2 = parent / name
        if self.v2 is None:
            for controller in ("memory", "cpu"):
                path = _own_cgroup(controller)
                base = CGROUP_ROOT / controller
                if path is not None and base.is_dir():
                    self.v1[controller] = base / path.lstrip("/") / name
        if self.v2 is None and "memory" not in self.v1:
            raise OSError(f"no cgroup hierarchy to bound the memory of {name} in")
        for d in self.dirs:
            d.mkdir(exist_ok=True)

    @property
    def dirs(self) -> list[Path]:
        return [self.v2] if self.v2 is not None else list(self.v1.values())

    def set_memory_max(self, limit: int | None) -> None:
        if self.v2 is not None:
            (self.v2 / "memory.max").write_text("max" if limit is None else str(limit))
        else:
            (self.v1["memory"] / "memory.limit_in_bytes").write_text(
                "-1" if limit is None else str(limit)
            )

    def memory_current(self) -> int:
        if self.v2 is not None:
            return int((self.v2 / "memory.current").read_text())
        return int((self.v1["memory"] / "memory.usage_in_bytes").read_text())

    def set_cpu_quota(self, pct: int | None) -> None:
        period = 100_000
        quota = None if pct is None else period * pct // 100
        if self.v2 is not None:
            (self.v2 / "cpu.max").write_text(f"{quota or 'max'} {period}")
        elif "cpu" in self.v1:
            (self.v1["cpu"] / "cpu.cfs_period_us").write_text(str(period))
            (self.v1["cpu"] / "cpu.cfs_quota_us").write_text(str(quota or -1))

    def oom_kills(self) -> int:
        """Processes the kernel killed for this cgroup's memory bound so far."""
        path = (
            self.v2 / "memory.events"
            if self.v2 is not None
            else self.v1["memory"] / "memory.oom_control"
        )
        try:
            lines = path.read_text().splitlines()
        except OSError:
            return 0
        for line in lines:
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def add(self, pid: int) -> None:
        for d in self.dirs:
            (d / "cgroup.procs").write_text(str(pid))

    def remove(self) -> None:
        for d in self.dirs:
            with contextlib.suppress(OSError):
                d.rmdir()


# ---- the notify socket ----------------------------------------------------------


class NotifySocket:
    """``$NOTIFY_SOCKET``: datagrams of KEY=VALUE lines, with the sender's pid."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.sock.bind(str(path))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.settimeout(POLL_S)

    def receive(self) -> tuple[int, dict[str, str]] | None:
        """(sender pid, fields) of one datagram, or None if none came."""
        try:
            data, anc, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
        except (TimeoutError, BlockingIOError):
            return None
        pid = 0
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid = struct.unpack("iII", payload[:12])[0]
        fields = {}
        for line in data.decode(errors="replace").splitlines():
            key, sep, value = line.partition("=")
            if sep:
                fields[key] = value
        return pid, fields

    def close(self) -> None:
        self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


# ---- the supervisor ---------------------------------------------------------------


@dataclass
class Supervisor:
    """Runs ``argv`` as a supervised service until ``stop``."""

    name: str
    argv: Sequence[str]
    service: Service
    notify_path: Path
    log_file: TextIO
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    events: list[Event] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    cgroup: Cgroup | None = None
    _oom_kills: int = 0
    _gone: bool = False  # killed for good (agentgone): not restarted
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # where its threads were when it ignored a stop (its faulthandler's report)
    hung_in: str = ""

    def start(self) -> None:
        bounded = self.service.memory_max is not None or self.service.cpu_quota_pct is not None
        if bounded:
            self.cgroup = Cgroup(self.name)
            self.cgroup.set_memory_max(self.service.memory_max)
            self.cgroup.set_cpu_quota(self.service.cpu_quota_pct)
        self._notify = NotifySocket(self.notify_path)
        self._thread = threading.Thread(
            target=self._run, name=f"supervise-{self.name}", daemon=True
        )
        self._thread.start()

    @property
    def pid(self) -> int | None:
        proc = self.proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def ready_count(self) -> int:
        return sum(1 for e in self.events if e.kind == "ready")

    def wait_ready(self, count: int, timeout: float) -> bool:
        """Until the service said READY=1 ``count`` times in all."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready_count() >= count:
                return True
            if any(e.kind == "gave-up" for e in self.events):
                return False
            time.sleep(POLL_S)
        return False

    def note(self, text: str) -> None:
        self._event("note", 0, text)

    def _event(self, kind: str, pid: int, detail: str = "", code: int | None = None) -> None:
        with self._lock:
            self.events.append(Event(time.monotonic(), kind, pid, detail, code))
        log.info("%s: %s (pid %d) %s", self.name, kind, pid, detail)

    def _spawn(self) -> subprocess.Popen[bytes]:
        if self.cgroup is not None:  # each start gets the unit's bound again
            self.cgroup.set_memory_max(self.service.memory_max)
        env = {**self.env, "NOTIFY_SOCKET": str(self.notify_path)}
        if self.service.watchdog_s:
            env["WATCHDOG_USEC"] = str(int(self.service.watchdog_s * 1e6))
        proc = subprocess.Popen(
            list(self.argv),
            stdin=subprocess.DEVNULL,
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            cwd=self.cwd,
            env=env,
            start_new_session=True,
        )
        if self.cgroup is not None:
            with contextlib.suppress(OSError):  # gone already: its exit is seen below
                self.cgroup.add(proc.pid)
                self._oom_kills = self.cgroup.oom_kills()
        self._event("started", proc.pid)
        return proc

    def _run(self) -> None:
        starts = 0
        while not self._stop.is_set():
            if starts >= self.service.start_limit:
                self._event("gave-up", 0, f"{starts} starts")
                return
            starts += 1
            self.proc = self._spawn()
            failure = self._watch(self.proc)
            if failure is None or self._stop.is_set():
                return
            self._event("restarting", self.proc.pid, f"after {failure}")
            if self._stop.wait(self.service.restart_s):
                return

    def _watch(self, proc: subprocess.Popen[bytes]) -> str | None:
        """Until the process ends: why it failed, or None (stopped, or exit 0)."""
        ready = False
        started = last_ping = time.monotonic()
        while True:
            msg = self._notify.receive()
            now = time.monotonic()
            if msg is not None and msg[0] == proc.pid:
                fields = msg[1]
                if fields.get("READY") == "1" and not ready:
                    ready, last_ping = True, now
                    self._event("ready", proc.pid, fields.get("STATUS", ""))
                if fields.get("WATCHDOG") == "1":
                    last_ping = now
            code = proc.poll()
            if code is not None:
                return self._exited(proc, code)
            if self._stop.is_set():
                return None
            if not ready and now - started > self.service.start_timeout_s:
                self._event("start-timeout", proc.pid)
                self._kill(proc, signal.SIGTERM)
                return "a start timeout"
            watchdog = self.service.watchdog_s
            if ready and watchdog and now - last_ping > watchdog:
                self._event("watchdog", proc.pid, f"no WATCHDOG=1 for {now - last_ping:.1f} s")
                self._kill(proc, signal.SIGABRT)
                return "a watchdog timeout"

    def _exited(self, proc: subprocess.Popen[bytes], code: int) -> str | None:
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"
        if code == -signal.SIGKILL and self.cgroup is not None:
            kills = self.cgroup.oom_kills()
            if kills > self._oom_kills:
                how += " (killed by its memory bound)"
            self._oom_kills = kills
        self._event("exited", proc.pid, how, code)
        if self._stop.is_set() or self._gone or code == 0 or code in self.service.no_restart_codes:
            return None
        return how

    def _kill(self, proc: subprocess.Popen[bytes], first: signal.Signals) -> None:
        _signal_then_kill(proc, first)
        self._event("exited", proc.pid, f"killed after {first.name}")

    def request_stop(self) -> None:
        """SIGTERM and no restart (``wait_stopped`` waits for it)."""
        self._stop.set()
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()

    def wait_stopped(self, timeout: float | None = None) -> str | None:
        """Until it stopped, SIGKILL after ``timeout`` (the stop timeout);
        a problem in one line, or None."""
        self.request_stop()
        timeout = self.service.stop_timeout_s if timeout is None else timeout
        problem = None
        proc = self.proc
        if proc is not None and proc.poll() is None:
            try:
                proc.wait(max(0.1, timeout))
            except subprocess.TimeoutExpired:
                # SIGABRT first: a Python service writes where it hung (faulthandler)
                _signal_then_kill(proc, signal.SIGABRT)
                problem = f"{self.name} ignored SIGTERM for {timeout:g} s"
                self.hung_in = hung_in(_log_text(self.log_file))
                if self.hung_in:
                    problem += f" (it was in {self.hung_in})"
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._event("stopped", proc.pid if proc is not None else 0)
        self._notify.close()
        if self.cgroup is not None:
            self.cgroup.remove()
        return problem

    def kill(self, sig: signal.Signals = signal.SIGKILL, restart: bool = True) -> int | None:
        """Signal the running service (a chaos fault): the pid signalled.
        ``restart=False``: it is not restarted (gone for good)."""
        if not restart:
            self._gone = True  # its exit is still watched and told
        pid = self.pid
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return pid


def _signal_then_kill(proc: subprocess.Popen[bytes], first: signal.Signals) -> None:
    """``first``, then SIGKILL after ABORT_TIMEOUT_S; until it is gone."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(first)
    try:
        proc.wait(ABORT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()


def _log_text(log_file: TextIO) -> str:
    """The tail of the service's log, as written so far ("" if unreadable)."""
    with contextlib.suppress(OSError, ValueError):
        log_file.flush()
        with open(log_file.name, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - LOG_TAIL_BYTES))
            return f.read().decode(errors="replace")
    return ""


def hung_in(log: str) -> str:
    """Where a Python service's threads were, from the last report its
    faulthandler wrote (``Fatal Python error``, every thread's stack, the
    innermost call first): each thread's innermost frame, and the innermost
    of the service's own package when that one is not, identical threads
    counted; the signalled thread first.  "" when the log holds no report."""
    start = log.rfind(FAULT_HEADER)
    if start < 0:
        return ""
    threads: list[tuple[bool, list[tuple[str, str]]]] = []
    for line in log[start:].splitlines()[1:]:
        if line.startswith(("Thread 0x", "Current thread 0x")):
            threads.append((line.startswith("Current"), []))
            continue
        frame = FRAME.match(line)
        if frame is not None and threads:
            where = f"{Path(frame['file']).name}:{frame['line']}"
            threads[-1][1].append((f"{frame['func']} ({where})", frame["file"]))
    counts: dict[str, int] = {}
    for current, frames in sorted(threads, key=lambda t: not t[0]):
        if not frames:
            continue
        said = frames[0][0]
        own = next((f for f, path in frames if f"/{OWN_PACKAGE}/" in path), None)
        if own is not None and own != said:
            said += f" under {own}"
        key = ("signalled thread: " if current else "") + said
        counts[key] = counts.get(key, 0) + 1
    return "; ".join(k if n == 1 else f"{n} threads: {k}" for k, n in counts.items())

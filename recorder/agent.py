"""The always-on agent: discovery, tables, snapshots, dumps, the main loop.

``Agent`` owns an event source (BPF in production, a replay in tests) and the
communicator and process tables.  Each tick (every 200 ms) it reads the
new rows of the small ``comm`` and ``exit`` rings and the ``comms`` and
``inflight`` maps; it never reads the big rings except to snapshot them.
Every 250 ms it scans for processes that map libnccl, attaches once to each
distinct library file and puts each process in scope or out of it.

Scope ``netns`` keeps only the processes of the agent's network namespace
(others are excluded in the kernel, and their rows recorded before they were
classified are dropped from snapshots and from the watchdog's input; a pid
gone before it could be classified is dropped too, as it may be another
node's) and the TCP events of sockets whose own (source) address belongs to
this namespace, or, for loopback and unbound sockets, whose owner is in
scope: a connection between two nodes shows in each node's dump through that
node's end only.  A kept TCP row owned by a process out of scope (the agent's
own peer requests, say) has pid 0 in snapshots.

``/metrics`` renders ``analyzer.http.agent_metrics`` of ``Agent.stats()``,
then the other counters; peers are asked through ``recorder.peers``.

Known limits: communicators created before the agent started have hash 0
and their ``seq`` counts from the agent's start; rank and nranks of split
communicators are left to the analyzer (-1 here); a process that exits
without glibc's ``_exit`` (a raw exit_group) has no exit code, only its
signal or its end (SIGKILL: the kernel's kill of its other threads); in
``netns`` scope, a rank that ends within a discovery period of its start is
not recorded; the TCP scope filter knows this namespace's addresses as
they were at most ``ADDRESS_REFRESH_S`` ago.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from analyzer.http import AgentStats, Metric, RingStats, agent_metrics, render_metrics
from dumpers.errors import ProbeError
from dumpers.model import Clock, Recording, Ring, Trigger
from dumpers.schema import NCCL_SYMBOLS

from . import discovery
from .model import CommProgress, ProcessState, TickState
from .peers import peer_notifier
from .rings import complete_rows
from .source import EventSource
from .tables import CommTable, ProcessTable
from .watchdog import DumpScheduler, Incidents, Watchdog

log = logging.getLogger("stallwatch.record")

TICK_S = 0.2
DISCOVERY_S = 0.25
ADDRESS_REFRESH_S = 5.0
DUMP_RETRY_S = 5.0
PEER_TIMEOUT_S = 3.0  # a peer answers once its dump is written
_GAUGES = frozenset({"dumps_pending"})
_HELP = {
    "kernel_inflight_full": "NCCL calls not recorded: the in-flight map was full.",
    "kernel_comms_full": "Communicators not tracked: the communicator map was full.",
    "kernel_sock_owner_full": "Sockets left unattributed: the socket-owner map was full.",
    "kernel_runq_maps_full": "Run-queue samples lost: the run-queue maps were full.",
    "attach_failures": "Libraries or probes that could not be attached.",
    "symbols_skipped": "NCCL symbols an attached library lacks.",
    "dumps_pending": "Dumps waiting to be written (retried).",
}


@dataclass(frozen=True, slots=True)
class AgentConfig:
    dump_dir: Path = Path("dumps")
    stall_timeout_s: float = 60.0
    libs: tuple[str, ...] = ()
    pids: tuple[int, ...] = ()
    scope: str = "host"  # host | netns
    ring_size: int = 65536
    peers: tuple[str, ...] = ()
    listen: str = "127.0.0.1:9400"
    token: str | None = None
    max_dumps: int | None = None
    max_dump_bytes: int | None = None
    runq_threshold_ms: float = 1.0
    host_name: str = ""
    args: tuple[str, ...] = ()
    version: str = ""


@dataclass(slots=True)
class AttachedLibrary:
    path: str
    symbols: tuple[str, ...]
    skipped: tuple[str, ...]
    first_instructions: dict[str, str]


@dataclass(slots=True)
class Counters:
    """User-space counters, exported with the kernel's in every dump."""

    values: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, n: int = 1) -> None:
        self.values[name] = self.values.get(name, 0) + n


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def sample_clock() -> Clock:
    mono = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    real = time.clock_gettime_ns(time.CLOCK_REALTIME)
    return Clock(mono, real)


def local_addresses() -> set[bytes]:
    """Addresses of this network namespace as 16-byte tcp_event fields.
    Loopback addresses exist in every namespace and say nothing: left out."""
    import psutil

    out: set[bytes] = set()
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                ip = ipaddress.ip_address(a.address.split("%")[0])
            except ValueError:
                continue
            if not ip.is_loopback:
                out.add(ip.packed.ljust(16, b"\0"))
    return out


_V4_MAPPED = bytes(10) + b"\xff\xff"
_V6_LOOPBACK = bytes(15) + b"\x01"


def _ipv4_unmapped(addrs: np.ndarray) -> np.ndarray:
    """16-byte address fields with IPv4-mapped IPv6 (``::ffff:a.b.c.d``)
    rewritten as IPv4 (four bytes, then zeros), as ``local_addresses`` has them."""
    out = np.ascontiguousarray(addrs, dtype=np.uint8).reshape(-1, 16).copy()
    mapped = (out[:, :12] == np.frombuffer(_V4_MAPPED, np.uint8)).all(axis=1)
    out[mapped, :4] = out[mapped, 12:]
    out[mapped, 4:] = 0
    return out


def _shared_address(addrs: np.ndarray) -> np.ndarray:
    """Addresses every namespace has: unspecified, 127.0.0.0/8, ::1."""
    v4_rest_zero = (addrs[:, 4:] == 0).all(axis=1)
    unspecified = (addrs == 0).all(axis=1)
    v4_loopback = v4_rest_zero & (addrs[:, 0] == 127)
    v6_loopback = (addrs == np.frombuffer(_V6_LOOPBACK, np.uint8)).all(axis=1)
    shared: np.ndarray = unspecified | v4_loopback | v6_loopback
    return shared


class Agent:
    """One node's recorder: the source, the tables, dumps."""

    def __init__(self, config: AgentConfig, source: EventSource) -> None:
        self.config = config
        self.source = source
        self.host = config.host_name or socket.gethostname()
        self.boot_id = boot_id()
        self.comms = CommTable()
        self.procs = ProcessTable()
        self.counters = Counters()
        self.scanner = discovery.ProcessScanner()
        self.libraries: dict[discovery.LibraryId, AttachedLibrary] = {}
        self.in_scope: set[int] = set()
        self.out_of_scope: set[int] = set()
        self.my_netns = discovery.netns_of(os.getpid())
        self._addresses: set[bytes] = set()
        self._addresses_at = 0.0
        self._heads = {"comm": -1, "exit": -1}
        self._lock = threading.RLock()
        self._libcs: set[discovery.LibraryId] = set()
        self.incidents = self._make_incidents()

    # ---- discovery ------------------------------------------------------

    def attach_library(self, path: str, required: bool = False) -> AttachedLibrary | None:
        """Attach every NCCL symbol ``path`` defines, once per file."""
        try:
            lib_id = discovery.library_id(path)
            functions = discovery.elf_functions(path, NCCL_SYMBOLS)
        except (OSError, ValueError) as exc:
            return self._attach_failed(path, f"cannot read {path}: {exc}", required)
        if lib_id in self.libraries:
            return self.libraries[lib_id]
        if not functions:
            return self._attach_failed(path, f"{path} defines no NCCL symbol", required)
        firsts = {n: discovery.first_instruction(path, f) for n, f in functions.items()}
        try:
            for name in functions:
                self.source.attach(path, name)
        except ProbeError as exc:
            return self._attach_failed(path, str(exc), required)
        skipped = tuple(s for s in NCCL_SYMBOLS if s not in functions)
        lib = AttachedLibrary(path, tuple(functions), skipped, firsts)
        self.libraries[lib_id] = lib
        self._log_attached(lib)
        return lib

    def _attach_failed(self, path: str, why: str, required: bool) -> AttachedLibrary | None:
        self.counters.add("attach_failures")
        if required:
            raise ProbeError(why)
        log.error("not recording %s: %s", path, why)
        return None

    def _log_attached(self, lib: AttachedLibrary) -> None:
        stepped = sorted(n for n, i in lib.first_instructions.items() if not discovery.emulated(i))
        kinds = sorted(set(lib.first_instructions.values()))
        log.info(
            "attached %s: %d symbols, first instructions: %s",
            lib.path,
            len(lib.symbols),
            ", ".join(kinds),
        )
        if stepped:
            log.warning(
                "%s: %d entry points do not begin with push (uprobe single-steps, slower): %s",
                lib.path,
                len(stepped),
                " ".join(f"{n}={lib.first_instructions[n]}" for n in stepped),
            )
        if lib.skipped:
            self.counters.add("symbols_skipped", len(lib.skipped))
            log.info("%s: skipped symbols it lacks: %s", lib.path, " ".join(lib.skipped))

    def attach_pid(self, pid: int) -> None:
        """--pid: its libnccl, or its executable when NCCL is linked in."""
        libs = discovery.mapped_nccl_libs(pid)
        if libs is None:
            raise ProbeError(f"--pid {pid}: no such process")
        for lib in libs:
            self.attach_library(discovery.reachable_path(pid, lib), required=True)
        if not libs:
            exe = f"/proc/{pid}/exe"
            if "ncclAllReduce" not in discovery.elf_functions(exe, ("ncclAllReduce",)):
                raise ProbeError(f"--pid {pid}: maps no libnccl and its executable has no NCCL")
            self.attach_library(os.path.realpath(exe), required=True)
        self.classify(pid, libs)

    def classify(self, pid: int, libs: tuple[str, ...] = ()) -> bool:
        """Put a process in scope or out of it (in the kernel too)."""
        if pid in self.in_scope or pid in self.out_of_scope:
            return pid in self.in_scope
        info = discovery.process_info(pid, libs)
        if info is None:
            return False
        inside = self.config.scope == "host" or info.netns == self.my_netns
        self.source.set_scope(pid, tracked=inside, excluded=not inside)
        if inside:
            self.in_scope.add(pid)
            self.procs.add(info)
            self._attach_exit_probe(pid)
            log.info("recording pid %d (%s): %s", pid, info.comm, info.cmdline[:120])
        else:
            self.out_of_scope.add(pid)
        return inside

    def _attach_exit_probe(self, pid: int) -> None:
        """Exit codes come from a uprobe on the process's libc ``_exit``."""
        libc = discovery.mapped_libc(pid)
        if libc is None:
            return
        path = discovery.reachable_path(pid, libc)
        try:
            lib_id = discovery.library_id(path)
            if lib_id in self._libcs:
                return
            self.source.attach_exit(path)
        except (OSError, ProbeError) as exc:
            self.counters.add("attach_failures")
            log.error("exit codes of pid %d will be missing: %s", pid, exc)
            return
        self._libcs.add(lib_id)
        log.info("attached exit-code probe to %s", path)

    def discover(self) -> None:
        found, gone = self.scanner.scan()
        for pid, libs in found.items():
            for lib in libs:
                self.attach_library(discovery.reachable_path(pid, lib))
            self.classify(pid, libs)
        now = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        for pid in gone:
            self.procs.mark_gone(pid, now)

    # ---- tick -----------------------------------------------------------

    def _new_rows(self, ring: str, again: bool = False) -> np.ndarray | None:
        """The ring's complete rows if its head moved (or ``again``)."""
        buf = self.source.rings()[ring]
        head = buf.read_head()
        if head == self._heads[ring] and not again:
            return None
        self._heads[ring] = head
        return complete_rows(buf.slots.copy(), buf.read_head())

    def tick(self) -> TickState:
        """Update the tables from the small rings and maps; the watchdog's input."""
        with self._lock:
            comm_rows = self._new_rows("comm", again=self.comms.pending)
            if comm_rows is not None:
                self.comms.apply_rows(self._in_scope_rows(comm_rows))
            exit_rows = self._new_rows("exit")
            if exit_rows is not None:
                self.procs.apply_exit_rows(self._in_scope_rows(exit_rows))
            progress = [p for p in self.source.comm_progress() if self._keep_pid(p.pid)]
            now = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
            self.comms.apply_progress(progress, now)
            return self._tick_state(progress, now)

    def _tick_state(self, progress: list[CommProgress], now: int) -> TickState:
        inflight = tuple(c for c in self.source.inflight_calls() if self._keep_pid(c.pid))
        holders = {p.pid for p in progress if not p.destroyed}
        states = []
        for info in self.procs.infos():
            alive = not info.exit_ns and os.path.exists(f"/proc/{info.pid}")
            states.append(
                ProcessState(
                    pid=info.pid,
                    alive=alive,
                    holds_comms=info.pid in holders,
                    exit_code=info.exit_code,
                    exit_signal=info.exit_signal,
                    exit_ns=info.exit_ns,
                )
            )
        return TickState(now, inflight, tuple(progress), tuple(states))

    def tick_state(self) -> TickState:
        return self.tick()

    # ---- scope ----------------------------------------------------------

    def _keep_pid(self, pid: int) -> bool:
        """In scope.  A process gone before discovery classified it has no
        namespace left to check: the host scope keeps it, ``netns`` cannot
        tell whose it was and drops it (it may be another node's rank)."""
        if pid in self.in_scope:
            return True
        if pid in self.out_of_scope:
            return False
        if self.classify(pid):
            return True
        return self.config.scope == "host" and not os.path.exists(f"/proc/{pid}")

    def _pid_mask(self, pids: np.ndarray) -> np.ndarray:
        unique = np.unique(pids)
        drop = [int(p) for p in unique if not self._keep_pid(int(p))]
        return (
            ~np.isin(pids, np.array(drop, dtype=pids.dtype)) if drop else np.ones(len(pids), bool)
        )

    def _in_scope_rows(self, rows: np.ndarray) -> np.ndarray:
        return rows[self._pid_mask(rows["pid"])] if len(rows) else rows

    def _tcp_mask(self, rows: np.ndarray) -> np.ndarray:
        """A connection between two nodes shows in each node's dump through
        that node's end only: a row belongs here when the socket's own
        (source) address is one of this namespace's; a loopback or unbound
        socket, whose address every namespace has, when its owner is in scope."""
        now = time.monotonic()
        if now - self._addresses_at > ADDRESS_REFRESH_S:
            self._addresses = local_addresses()
            self._addresses_at = now
        saddr = _ipv4_unmapped(rows["saddr"])
        local = np.array([list(a) for a in self._addresses] or [[0] * 16], dtype=np.uint8)
        is_local = (saddr[:, None, :] == local[None, :, :]).all(axis=2).any(axis=1)
        owned = np.isin(rows["pid"], self._scope_pids(rows["pid"].dtype))
        mask: np.ndarray = np.where(_shared_address(saddr), owned, is_local)
        return mask

    def _scope_pids(self, dtype: np.dtype) -> np.ndarray:
        return np.array(sorted(self.in_scope), dtype=dtype)

    # ---- snapshot and dumps ---------------------------------------------

    def snapshot(self, trigger: Trigger | None = None) -> Recording:
        self.tick()
        with self._lock:
            rings = self._rings()
            counters = {**self.source.kernel_counters(), **self.counters.values}
            counters.update(self.incidents.counters())
            for name, ring in rings.items():
                counters[f"ring_{name}_overwritten"] = ring.overwritten
            return Recording(
                host=self.host,
                boot_id=self.boot_id,
                clock=sample_clock(),
                processes=self.procs.infos(),
                communicators=tuple(
                    c
                    for c in self.comms.infos()
                    if c.pid in self.in_scope or self.config.scope == "host"
                ),
                rings=rings,
                agent_version=self.config.version,
                agent_args=self.config.args,
                trigger=trigger,
                counters=counters,
            )

    def _rings(self) -> dict[str, Ring]:
        netns = self.config.scope == "netns"
        out = {}
        for name, buf in self.source.rings().items():
            keep: Callable[[np.ndarray], np.ndarray] | None = None
            if netns:
                keep = self._tcp_mask if name == "tcp" else (lambda r: self._pid_mask(r["pid"]))
            ring = buf.snapshot(keep)
            if netns and name == "tcp" and len(ring.rows):
                # A socket of this node owned by a process out of scope (or
                # not yet classified) stays, unattributed.
                pids = ring.rows["pid"]
                pids[~np.isin(pids, self._scope_pids(pids.dtype))] = 0
            out[name] = ring
        return out

    def recording(self) -> Recording:
        return self.snapshot()

    def request_dump(
        self, reason: str, incident_id: str | None = None, origin: str | None = None
    ) -> dict[str, object]:
        """``POST /dump``, ``stallwatch dump``, SIGUSR1, peers."""
        answer = self.incidents.request_dump(reason, incident_id, origin)
        return {"host": self.host, **answer}

    def _make_incidents(self) -> Incidents:
        from dumpers.format import read_dump, write_dump
        from dumpers.retention import enforce

        cfg = self.config
        scheduler = DumpScheduler(
            snapshot=self.snapshot,
            write=lambda rec: write_dump(cfg.dump_dir, rec),
            retention=lambda path: enforce(cfg.dump_dir, cfg.max_dumps, cfg.max_dump_bytes, path),
            read=read_dump,
        )
        watchdog = Watchdog(int(cfg.stall_timeout_s * 1e9), self.host)
        notify = (
            peer_notifier(cfg.peers, self.host, cfg.token, PEER_TIMEOUT_S) if cfg.peers else None
        )
        return Incidents(watchdog, scheduler, notify)

    # ---- metrics --------------------------------------------------------

    def stats(self) -> AgentStats:
        """What ``/metrics`` reports (analyzer.http renders it)."""
        kernel = self.source.kernel_counters()
        rings = tuple(
            RingStats(
                kind=name,
                recorded=(head := buf.read_head()),
                lost=kernel.get(f"kernel_lost_{name}", 0),
                overwritten=max(0, head - buf.capacity),
                held=min(head, buf.capacity),
                capacity=buf.capacity,
            )
            for name, buf in self.source.rings().items()
        )
        incidents = self.incidents.counters()
        return AgentStats(
            rings=rings,
            dumps_written=incidents["dumps_written"],
            dump_failures=incidents["dump_write_failures"],
            stalls_detected=incidents["stalls_detected"],
            libraries_attached=len(self.libraries),
            processes_watched=len(self.procs.alive()),
        )

    def metrics_text(self) -> str:
        """Prometheus text: the families of ``agent_metrics``, then the other
        counters of the kernel side, the agent and the watchdog."""
        covered = {"dumps_written", "dump_write_failures", "stalls_detected"}
        extra = {
            **{k: v for k, v in self.source.kernel_counters().items() if "_lost_" not in k},
            **self.counters.values,
            **{k: v for k, v in self.incidents.counters().items() if k not in covered},
        }
        families = agent_metrics(self.stats())
        for name, value in sorted(extra.items()):
            gauge = name in _GAUGES
            families.append(
                Metric(
                    f"stallwatch_{name}" if gauge else f"stallwatch_{name}_total",
                    _HELP.get(name, name.replace("_", " ").capitalize() + "."),
                    "gauge" if gauge else "counter",
                    (({}, float(value)),),
                )
            )
        return render_metrics(families)

    def close(self) -> None:
        self.source.close()


class Stop:
    """What the signal handlers set; the loop polls it between ticks."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.dump_requested = False


def run_loop(agent: Agent, stop: Stop) -> None:
    """Discovery every 250 ms; each tick (200 ms) the watchdog checks and dumps."""
    next_discovery = 0.0
    while not stop.event.is_set():
        now = time.monotonic()
        if now >= next_discovery:
            agent.discover()
            next_discovery = now + DISCOVERY_S
        if stop.dump_requested:
            stop.dump_requested = False
            agent.request_dump("SIGUSR1")
        agent.incidents.tick(agent.tick())
        stop.event.wait(TICK_S)

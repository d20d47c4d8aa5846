"""The always-on agent: discovery, tables, recordings, dumps, the main loop.

``Agent`` owns an event source (BPF in production, a replay in tests) and the
communicator and process tables.  Each tick (every 200 ms) it reads the
new rows of the small ``comm`` and ``exit`` rings and the ``comms`` and
``inflight`` maps; it never reads the big rings except to copy them.
Every 250 ms it scans for processes that map libnccl, attaches once to each
distinct library file and puts each process in scope or out of it.

Which processes and TCP rows it keeps is its scope (``recorder.scope``).
``/metrics`` is rendered by ``recorder.prometheus`` from ``Agent.stats()`` and
the plain counters; peers are asked through ``recorder.peers``.

Known limits: communicators created before the agent attached (and split
from one) have hash 0 in the tables, rows and dumps (init_ns 0 marks those
made before the attach) and their ``seq`` counts from the first call the
agent saw: the analyzer aligns them with their peers; rank and nranks of split
communicators are left to the analyzer (-1 here); a process that exits
without glibc's ``_exit`` (a raw exit_group) has no exit code, only its
signal or its end (SIGKILL: the kernel's kill of its other threads); in
``netns`` scope, a rank that ends within a discovery period of its start is
not recorded.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from stallwatch.dumpers.errors import PinError
from stallwatch.dumpers.model import Recording, Ring, Trigger, TriggerKind
from stallwatch.dumpers.schema import PROBE_EVENT
from stallwatch.query.tls import ClientTls, ServerTls

from . import discovery
from .attach import AttachedLibrary, Attacher
from .hostclock import boot_id, sample_clock
from .links import LinkConfig, LinkSampler
from .netsamples import NetSampleConfig, NetSampler
from .pathprobe import PathProbes, Peer, ProbeConfig, choose_peers
from .peers import PeerList, PeerSource, peer_notifier
from .pinning import PinSet
from .positions import PositionKeeper, reading_summary
from .prometheus import AgentStats, LinkState, RingStats, agent_metrics_text
from .registry import CommRegistry, ProcessRegistry
from .scope import Scope
from .slowdown import (
    RowFollower,
    SlowdownConfig,
    SlowdownWatch,
    StreamGauges,
    held_slowdown,
    network_evidence,
)
from .source import EventSource
from .stallbound import DEFAULT_CEILING_S, DEFAULT_FLOOR_S, StallBounds, queued_calls
from .tickstate import CommProgress, ProcessState, Slowdown, TickState
from .verdicts import Judge, publisher_of
from .watchdog import DumpScheduler, Incidents, Watchdog

log = logging.getLogger("stallwatch.record")

# A tick reads the communicator and in-flight maps only while a process in
# scope is alive or ended less than this ago (or the small rings moved): an
# idle agent reads a few ring heads and nothing else.
QUIET_NS = 10_000_000_000
PIN_CHECK_S = 1.0  # the pinned recording's folder is looked at this often
DUMP_RETRY_S = 5.0
PEER_TIMEOUT_S = 5.0  # a peer answers once its dump is written (after 2 s of probes)


@dataclass(frozen=True, slots=True)
class AgentConfig:
    dump_dir: Path = Path("dumps")
    stall_timeout_s: float = DEFAULT_CEILING_S  # the ceiling of every communicator's stall bound
    stall_floor_s: float = DEFAULT_FLOOR_S  # and its floor (recorder.stallbound)
    libs: tuple[str, ...] = ()
    pids: tuple[int, ...] = ()
    scope: str = "host"  # host | netns
    job: str | None = None  # only this job's processes (recorder.scope)
    ring_size: int = 65536
    peers: tuple[str, ...] = ()
    peers_from: PeerSource | None = None  # --peers-from: asked again at each incident
    listen: str = "127.0.0.1:9400"
    token: str | None = None
    dump_token: str | None = None  # opens POST /dump only (query.credentials)
    scrape_token: str | None = None  # opens GET /metrics only
    tls: ServerTls | None = None  # HTTPS for the agent's surface
    peer_tls: ClientTls | None = None  # HTTPS to the peers
    max_dumps: int | None = None
    max_dump_bytes: int | None = None
    runq_threshold_ms: float = 1.0
    keep_own_traffic: bool = False  # record the agent's own TCP connections too
    host_name: str = ""
    args: tuple[str, ...] = ()
    version: str = ""
    pin_dir: Path | None = None  # the recording is pinned there (None: it dies with us)
    replace_pinned: bool = False  # replace a pin set of another layout
    keep_pinned: bool = False  # stopped, leave the pins (a service); else remove them
    bpf_cache: Path | None = None  # compiled programs kept there (recorder.compiled)
    links: LinkConfig = field(default_factory=LinkConfig)  # the link sampler (recorder.links)
    netsamples: NetSampleConfig = field(default_factory=NetSampleConfig)  # recorder.netsamples
    probes: ProbeConfig = field(default_factory=ProbeConfig)  # recorder.pathprobe (port 0: none)
    slowdown: SlowdownConfig = field(default_factory=SlowdownConfig)  # recorder.slowdown
    # the verdict of each incident it detects, gathered from every node's dump
    # (recorder.verdicts; None: not published) and posted to --notify
    judge: Judge | None = None
    notify_url: str | None = None


@dataclass(slots=True)
class Counters:
    """User-space counters, exported with the kernel's in every dump."""

    values: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, n: int = 1) -> None:
        self.values[name] = self.values.get(name, 0) + n


class Agent:
    """One node's recorder: the source, the tables, dumps."""

    def __init__(self, config: AgentConfig, source: EventSource, netns: int | None = None) -> None:
        """``netns``: the network namespace of the scope (default: this
        process's; a pinned recording read elsewhere gives its agent's)."""
        self.config = config
        self.source = source
        self.host = config.host_name or socket.gethostname()
        self.boot_id = boot_id()
        self.comms = CommRegistry()
        self.procs = ProcessRegistry()
        self.counters = Counters()
        self._maps_busy = True  # the last read of the maps found something
        self._gone_since: dict[int, int] = {}  # pids seen gone, not in the process table
        self.scope = Scope(config.scope, self.classify, netns=netns, job=config.job)
        self.attacher = Attacher(source, self.classify, self.scope.placed, self.procs.mark_gone,
                                 self.counters.add)  # fmt: skip
        self._heads = {"comm": -1, "exit": -1}
        self._lock = threading.RLock()
        self.incidents = self._make_incidents()
        self.incidents.scheduler.tidy()
        self._pins_checked = 0.0
        # the HTTP surface's connection counters, once it serves (recorder.service)
        self.serving_counters: Callable[[], dict[str, int]] = dict
        self.positions = PositionKeeper(
            lambda: sorted(self.scope.inside), int(config.stall_timeout_s * 1e9)
        )
        self.links = LinkSampler(config.links)
        self.netsamples = NetSampler(config.netsamples)
        self.paths: PathProbes | None = None  # probes of the job's paths at an incident
        if config.probes.port and not self.read_only:
            self.paths = PathProbes(config.probes, config.token, self._probe_peers,
                                    self.netsamples.ifindex_of)  # fmt: skip
            self.incidents.before_dump = self.paths.at_incident
        # the NCCL rows already in a ring adopted from an earlier agent teach
        # the slowdown trigger each communicator's rhythm at once
        self.slowdown = SlowdownWatch(config.slowdown)
        self._follower = RowFollower(source.rings()["nccl"])
        self._take_over()

    def _take_over(self) -> None:
        """What an earlier agent left in the kernel: the processes it placed
        in scope or out of it, and (pinned) its watchdog's incidents."""
        tracked, excluded = self.source.scope_pids()
        for pid in excluded:
            self.scope.record(pid, False)
        for pid in tracked:
            self.scope.record(pid, True)
            info = discovery.process_info(pid, discovery.mapped_nccl_libs(pid) or ())
            if info is not None:
                self.procs.add(info)
        pins = self.source.pinset
        if pins is None:
            return
        self.incidents.watchdog.restore(pins.load_state().get("watchdog", {}))
        if tracked or excluded:
            log.info(
                "took over %d processes in scope, %d out of it, from the pinned recording",
                len(tracked),
                len(excluded),
            )

    @property
    def read_only(self) -> bool:
        """Reading a pinned recording with no agent: nothing is attached."""
        pins = self.source.pinset
        return pins is not None and pins.read_only

    # ---- discovery: recorder.attach finds them, the agent places them -----

    @property
    def libraries(self) -> dict[discovery.LibraryId, AttachedLibrary]:
        return self.attacher.libraries

    @property
    def events(self) -> discovery.KernelDiscovery | None:
        return self.attacher.events

    def attach_library(self, path: str, required: bool = False) -> AttachedLibrary | None:
        return self.attacher.attach_library(path, required)

    def attach_pid(self, pid: int) -> None:
        self.attacher.attach_pid(pid)

    def discover(self) -> None:
        self.attacher.discover()

    def classify(self, pid: int, libs: tuple[str, ...] = ()) -> bool:
        """Put a process in scope or out of it (in the kernel too)."""
        known = self.scope.placed(pid)
        if known is not None:
            return known
        # placed from its rows before the scan found it: its libraries too
        libs = libs or discovery.mapped_nccl_libs(pid) or ()
        info = discovery.process_info(pid, libs)
        if info is None:
            return False
        inside = self.scope.admits(info.netns, pid)
        self.source.set_scope(pid, tracked=inside, excluded=not inside)
        self.scope.record(pid, inside)
        if not inside:  # what it made before it was excluded: not this node's to watch
            self.source.forget_process(pid, keep_scope=True)
        if inside:
            self.netsamples.place()  # its sockets join the TCP filter at the next tick
            self.procs.add(info)
            if not self.read_only:
                self.attacher.attach_exit_probe(pid)
            log.info("recording pid %d (%s): %s", pid, info.comm, info.cmdline[:120])
        return inside

    # ---- tick -----------------------------------------------------------

    def _new_rows(self, ring: str, after: int, again: bool = False) -> np.ndarray | None:
        """The ring's complete rows after position ``after`` if its head
        moved (or ``again``): only the new slots are copied."""
        buf = self.source.rings()[ring]
        if buf.read_head() == self._heads[ring] and not again:
            return None
        rows, self._heads[ring] = buf.rows_since(after)
        return rows

    def tick(self) -> TickState:
        """Update the tables from the small rings and maps; the watchdog's input."""
        with self._lock:
            self.links.tick(self.procs.alive)
            if not self.read_only:  # the job's sockets for the TCP filter, and their samples
                self.netsamples.tick(lambda: self.scope.inside, self.source.set_job_sockets)
            comm_rows = self._new_rows("comm", self.comms.done, again=self.comms.pending)
            if comm_rows is not None:
                self.comms.apply_rows(self.scope.rows(comm_rows))
            exit_rows = self._new_rows("exit", self.procs.done)
            if exit_rows is not None:
                self.procs.apply_exit_rows(self.scope.rows(exit_rows))
            now = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
            moved = comm_rows is not None or exit_rows is not None
            if not moved and not self._maps_busy and not self.procs.watched(now, QUIET_NS):
                return TickState(now, (), (), ())  # nothing to watch: the maps are not read
            raw = self.source.comm_progress()
            self._forget_ended(raw, now)
            progress = [p for p in raw if self.scope.keep_pid(p.pid)]
            self.comms.apply_progress(progress, now)
            state = self._tick_state(progress, now, self._slowdowns(now))
            self._maps_busy = bool(raw) or bool(state.inflight)
            return state

    def _forget_ended(self, progress: list[CommProgress], now: int) -> None:
        """Processes ended more than QUIET_NS ago leave the kernel's maps
        (their communicators stay in the tables and dumps): the maps do not
        fill up over days of jobs, and an idle agent has nothing to read."""
        for pid in {p.pid for p in progress}:
            info = self.procs.get(pid)
            if info is not None and info.exit_ns:
                ended = info.exit_ns
            elif os.path.exists(f"/proc/{pid}"):
                continue
            else:
                ended = self._gone_since.setdefault(pid, now)
            if now - ended > QUIET_NS:
                self.source.forget_process(pid)
                self._gone_since.pop(pid, None)

    def _slowdowns(self, now: int) -> tuple[Slowdown, ...]:
        """The slowdown trigger's turn: the NCCL rows that appeared or
        settled since the last tick, what is slow now, and the held calls
        with network trouble inside them (the rings are read only then)."""
        if self.read_only:
            return ()
        new, settled = self._follower.poll(now, self.slowdown.device_stream)
        keep = self.scope.ring_filter("nccl")
        if keep is not None:
            new = new[keep(new)] if len(new) else new
            settled = settled[keep(settled)] if len(settled) else settled
        self.slowdown.feed(new, settled)
        self.incidents.watchdog.bounds.feed(settled)
        found = self.slowdown.judge(now)
        held = self.slowdown.held(now)
        if held:
            tcp = self.source.rings()["tcp"].copy(self.scope.ring_filter("tcp")).rows
            links = self.links.copy().rows
            for call in held:
                evidence = network_evidence(call, tcp, links)
                if evidence is not None:
                    found.append(held_slowdown(call, evidence))
        alive = self.procs.alive()
        self.slowdown.forget(alive)
        self.incidents.watchdog.bounds.forget(set(alive))
        return tuple(found)

    def _tick_state(
        self, progress: list[CommProgress], now: int, slowdowns: tuple[Slowdown, ...] = ()
    ) -> TickState:
        inflight = tuple(c for c in self.source.inflight_calls() if self.scope.keep_pid(c.pid))
        inflight += tuple(self.positions.inflight(now, progress))  # began before the attach
        waiting = self._follower.waiting  # queued on a device, not completed (polled this tick)
        if len(waiting):
            queued = queued_calls(waiting, self.slowdown.device_stream)
            inflight += tuple(c for c in queued if self.scope.keep_pid(c.pid))
        holders = {p.pid for p in progress if not p.destroyed}
        states = []
        for info in self.procs.infos():
            alive = not info.exit_ns and os.path.exists(f"/proc/{info.pid}")
            if not alive and not info.exit_ns:  # gone without an exit row
                self.procs.mark_gone(info.pid, now)
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
        return TickState(now, inflight, tuple(progress), tuple(states), slowdowns)

    def tick_state(self) -> TickState:
        return self.tick()

    # ---- recording and dumps --------------------------------------------

    def recording(self, trigger: Trigger | None = None, dump: bool | None = None) -> Recording:
        """Everything the agent holds now (the query layer's ``Backend``);
        with ``dump`` (by default where there is a trigger; the dump
        scheduler sets its trigger after), what a dump holds besides: a
        thread reading taken now, who uses which link now, and each job
        connection's state now, as ``tcp_info`` rows after the TCP ring's."""
        if dump is None:
            dump = trigger is not None
        self.tick()
        # read before the lock: reading the threads takes a tenth of a second
        snapshots = self.positions.for_recording(dump=dump)
        with self._lock:
            rings = self._rings()
            rings["link"] = self.links.copy()
            rings.update(self.netsamples.copy())
            rings["probes"] = self.paths.copy() if self.paths else Ring(np.zeros(0, PROBE_EVENT))
            if dump:  # who uses which link now (queries: as last read)
                self.links.refresh_users(self.procs.alive())
            if dump and "tcp" in rings and not self.read_only:
                rings["tcp"] = self.netsamples.with_states(rings["tcp"], self.scope.inside)
            counters = {**self.source.kernel_counters(), **self.counters.values}
            counters["link_read_failures"] = self.links.errors
            counters["netsample_read_failures"] = self.netsamples.errors
            counters["netsample_cpu_us"] = self.netsamples.cpu_ns // 1000
            counters.update(self.paths.counters() if self.paths else {})
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
                    if c.pid in self.scope.inside or not self.scope.filters
                ),
                rings=rings,
                agent_version=self.config.version,
                agent_args=self.config.args,
                trigger=trigger,
                counters=counters,
                programs=self.source.kernel_misses(),
                snapshots=snapshots,
                links=self.links.table(keep=lambda pid: self.procs.get(pid) is not None),
            )

    def _rings(self) -> dict[str, Ring]:
        out = {}
        for name, buf in self.source.rings().items():
            ring = buf.copy(self.scope.ring_filter(name))
            if self.scope.filters and name == "tcp" and len(ring.rows):
                self.scope.unattribute_foreign(ring.rows)
            out[name] = ring
        return out

    def live_recordings(self, incident_id: str, reason: str) -> list[Recording]:
        """``POST /recording``: what a dump would hold now (a fresh thread
        reading too), under the asker's incident id; nothing is written and
        no incident is raised here (``stallwatch analyze --agents``)."""
        trigger = Trigger(
            TriggerKind.MANUAL, reason, incident_id, time.monotonic_ns(), origin_host=self.host
        )
        return [self.recording(trigger)]

    @property
    def dump_dir(self) -> Path:
        """Where this agent's dumps are (``GET /dumps``, ``POST /collect``)."""
        return self.config.dump_dir

    def request_dump(
        self,
        reason: str,
        incident_id: str | None = None,
        origin: str | None = None,
        by_client: bool = True,
        *,
        kind: str | None = None,
    ) -> dict[str, object]:
        """``POST /dump``, ``stallwatch dump``, peers; SIGUSR1 (not a client:
        not rate-limited).  ``kind``: what the peer's incident is, its
        trigger's kind (one this agent does not know is taken for no
        slowdown)."""
        origin_kind = next((k for k in TriggerKind if k.value == kind), None)
        if self.paths is not None and origin:
            self.paths.note_origin(incident_id, origin_kind)
        answer = self.incidents.request_dump(
            reason, incident_id, origin, by_client, origin_kind=origin_kind
        )
        return {"host": self.host, **answer}

    def dump_outcome(self, incident_id: str) -> dict[str, object]:
        """What became of an incident's dump (``POST /dump``, ``outcome_of``)."""
        return {"host": self.host, **self.incidents.outcome(incident_id)}

    def request_snapshot(
        self, reason: str, incident_id: str | None = None, samples: int = 3, interval_s: float = 0.5
    ) -> dict[str, object]:
        """``POST /snapshot``: read this node's threads, then dump with them."""
        snaps = self.positions.take_series(samples, interval_s, "request")
        answer = self.request_dump(reason, incident_id)
        return {**answer, "positions": reading_summary(snaps[-1])}

    def _make_incidents(self) -> Incidents:
        cfg = self.config
        scheduler = DumpScheduler.for_directory(
            cfg.dump_dir,
            lambda: self.recording(dump=True),  # the trigger is the scheduler's
            cfg.max_dumps,
            cfg.max_dump_bytes,
        )
        ceiling = int(cfg.stall_timeout_s * 1e9)
        bounds = StallBounds(ceiling, int(cfg.stall_floor_s * 1e9))
        watchdog = Watchdog(ceiling, self.host, bounds=bounds)
        incidents = Incidents(watchdog, scheduler)
        peers = PeerList(cfg.peers, cfg.peers_from)
        if peers:
            incidents.notify = peer_notifier(
                peers,
                self.host,
                cfg.token,
                PEER_TIMEOUT_S,
                cfg.peer_tls,
                incidents.peer_answered,
            )
        pins = self.source.pinset
        if pins is not None and not pins.read_only:
            watchdog.on_change = lambda: self._save_state(pins)
        self.verdicts = (
            None
            if cfg.judge is None
            else publisher_of(
                cfg.judge,
                incidents,
                (cfg.listen, peers),
                cfg.dump_dir,
                self.host,
                cfg.notify_url,
                lambda incident: self.paths.unreached(incident) if self.paths else frozenset(),
            )
        )
        return incidents

    def _save_state(self, pins: PinSet) -> None:
        """The watchdog's incidents, kept with the pinned recording: an agent
        restarted during a stall knows the incident it already dumped."""
        try:
            pins.save_state({"watchdog": self.incidents.watchdog.state()})
        except (OSError, PinError) as exc:
            log.warning("cannot keep the watchdog's state in %s: %s", pins.path, exc)

    # ---- metrics --------------------------------------------------------

    def stats(self) -> AgentStats:
        """What ``/metrics`` reports besides the plain counters."""
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
            for name, buf in {
                **self.source.rings(),
                "link": self.links.writer.buffer,
                **self.netsamples.buffers(),
                **({"probes": self.paths.ring.buffer} if self.paths else {}),
            }.items()
        )
        incidents = self.incidents.counters()
        return AgentStats(
            rings=rings,
            dumps_written=incidents["dumps_written"],
            dump_failures=incidents["dump_write_failures"],
            stalls_detected=incidents["stalls_detected"],
            libraries_attached=len(self.libraries),
            processes_watched=len(self.procs.alive()),
            links=self._link_states(),
            streams=self._stream_gauges(),
            incidents=self.verdicts.latest() if self.verdicts is not None else (),
        )

    def _stream_gauges(self) -> tuple[StreamGauges, ...]:
        with self._lock:  # the loop's tick changes them
            return tuple(self.slowdown.gauges())

    def _link_states(self) -> tuple[LinkState, ...]:
        with self._lock:  # the loop's tick changes them
            return self.links.states(keep=lambda pid: self.procs.get(pid) is not None)

    def metrics_text(self) -> str:
        """Prometheus text: ``stats()`` and the plain counters of the kernel
        side (losses are in the ring families), the agent and the watchdog."""
        counters = {
            **{k: v for k, v in self.source.kernel_counters().items() if "_lost_" not in k},
            **self.counters.values,
            **self.incidents.counters(),
            **self.serving_counters(),
            **(self.verdicts.counters() if self.verdicts is not None else {}),
            "link_read_failures": self.links.errors,
            "netsample_read_failures": self.netsamples.errors,
            "netsample_cpu_us": self.netsamples.cpu_ns // 1000,
            **(self.paths.counters() if self.paths else {}),
        }
        return agent_metrics_text(self.stats(), counters)

    def watch_pins(self) -> None:
        """The pinned recording's folder as this agent left it: what was
        removed or replaced is logged, counted and pinned again."""
        pins = self.source.pinset
        now = time.monotonic()
        if pins is None or pins.read_only or now < self._pins_checked + PIN_CHECK_S:
            return
        self._pins_checked = now
        damage = pins.damage()
        if damage is None:
            return
        try:
            pins.restore()
        except PinError as exc:
            self.counters.add("pins_restore_failures")
            log.error("%s: not pinned again: %s (a SIGKILL now loses the recording)", damage, exc)
            return
        self.counters.add("pins_restored")  # once it is: /metrics is read meanwhile
        log.warning("%s: pinned again (the kernel recorded on meanwhile)", damage)

    def serving(self, port: int) -> None:
        """The HTTP surface listens on ``port``: its connections, and the
        agent's requests to peers, are not the job's (unless asked for)."""
        if not self.config.keep_own_traffic:
            self.source.ignore_own_traffic(os.getpid(), port)

    def busy(self) -> bool:
        """Whether the loop has something to watch: a process in scope alive
        or ended lately, calls in flight, a process discovery will look at."""
        now = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        if self.events is None or self._maps_busy or self.attacher.waiting():
            return True  # (without kernel events, /proc is scanned)
        return self.procs.watched(now, QUIET_NS)

    def _probe_peers(self) -> list[Peer]:
        """The nodes the job's connections go to, as last sampled."""
        with self._lock:
            rows, own = self.netsamples.latest, self.netsamples.own()
        return choose_peers(rows, own, self.config.probes.max_peers)

    def close(self) -> None:
        if self.paths is not None:
            self.paths.close()
        self.links.close()
        self.netsamples.close()
        self.source.close()

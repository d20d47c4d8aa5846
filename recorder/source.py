"""The seam between the agent and the kernel: one ``EventSource`` interface.

``BccSource`` is the real thing (BPF programs loaded by ``recorder.probes``,
or a pinned recording adopted, rings mapped from the kernel);
``PinnedSource`` reads a pinned recording with no agent and no BCC
(``stallwatch dump --pinned``); ``ReplaySource`` holds rings and map contents
in process memory, filled by tests with the same ring protocol the BPF
programs use, so that ring, table and watchdog logic has fast unit tests.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from stallwatch.dumpers.errors import ProbeError
from stallwatch.dumpers.model import ProgramMisses
from stallwatch.dumpers.schema import RING_DTYPES

from . import kernelhooks
from .bpfsys import RingbufBell
from .kernelhooks import SECOND
from .maps import DISCOVERY_BELL, RING_MAPS, MapSet
from .pinning import PinOptions, PinSet
from .prometheus import SKIPPED_PREFIX
from .rings import RingBuffer, RingWriter
from .sockets import JobSockets
from .tcp_probes import PAIR_CAUGHT, PAIRED
from .tickstate import CommProgress, InflightCall

log = logging.getLogger("stallwatch.record")


class EventSource(Protocol):
    """Where events come from, and the few maps the agent reads each tick."""

    @property
    def pinset(self) -> PinSet | None:
        """The pinned recording this source reads, if any (state is kept there)."""

    def rings(self) -> dict[str, RingBuffer]: ...

    def kernel_counters(self) -> dict[str, int]: ...

    def kernel_misses(self) -> tuple[ProgramMisses, ...]:
        """Per kernel hook, its program and the runs the kernel skipped."""

    def comm_progress(self) -> list[CommProgress]: ...

    def inflight_calls(self) -> list[InflightCall]: ...

    def attach(self, path: str, symbol: str) -> None:
        """Attach entry and return probes of one NCCL symbol; ProbeError on failure."""

    def attach_exit(self, libc: str) -> None:
        """Attach the exit-code probe to a libc; ProbeError on failure."""

    def attach_loader(self, ldso: str) -> None:
        """Attach the discovery probe to a dynamic loader; ProbeError on failure."""

    def discovery_ring(self) -> RingBuffer | None:
        """The kernel's discovery events, or None (then /proc is scanned)."""

    def doorbell(self) -> RingbufBell | None:
        """What wakes the agent's loop when a process loads a GPU library
        (None: nothing does; the loop wakes on its own)."""

    def set_scope(self, pid: int, tracked: bool, excluded: bool) -> None: ...

    def ignore_own_traffic(self, pid: int, port: int) -> None:
        """Record no TCP rows of process ``pid`` (the agent) nor of sockets
        whose local port is ``port`` (its listener); 0 for none."""

    def set_job_sockets(self, sockets: JobSockets) -> None:
        """The listeners and connections the job's processes hold: the
        kernel keeps the rows of their connections."""

    def scope_pids(self) -> tuple[set[int], set[int]]:
        """(tracked, excluded) as the kernel holds them (an earlier agent's, if adopted)."""

    def forget_process(self, pid: int, keep_scope: bool = False) -> None:
        """An ended process (or, ``keep_scope``, one out of scope) leaves
        the kernel's maps: communicators, threads, and its place in scope."""

    def close(self) -> None: ...


class MapSource:
    """What the agent reads from the maps of a recording, whoever opened them."""

    @property
    def pinset(self) -> PinSet | None:
        return None

    def __init__(self, maps: MapSet) -> None:
        self.maps = maps
        self._sockets_refused = 0  # the job's sockets the kernel's tables had no room for
        self._rings = {
            name: RingBuffer(
                name,
                maps.ring_arrays[name],
                lambda n=name: maps.head(n),  # type: ignore[misc]
                lambda n=name: maps.drops()[f"kernel_lost_{n}"],  # type: ignore[misc]
            )
            for name in RING_MAPS
        }

    def rings(self) -> dict[str, RingBuffer]:
        return self._rings

    def discovery_ring(self) -> RingBuffer | None:
        view = self.maps.discovery
        return RingBuffer("discovery", view, self.maps.discovery_head) if view is not None else None

    def doorbell(self) -> RingbufBell | None:
        bell = self.maps.maps.get(DISCOVERY_BELL)
        return RingbufBell(bell.fd) if bell is not None and not bell.read_only else None

    def kernel_counters(self) -> dict[str, int]:
        """The kernel's counters: the rings' losses, the CUDA calls seen, and
        per kernel hook the events no program of it saw, where the kernel
        counts them."""
        skipped: dict[str, int] = {}
        for p in self.kernel_misses():
            if p.unseen is not None:
                key = SKIPPED_PREFIX + p.hook
                skipped[key] = skipped.get(key, 0) + p.unseen
        return {**self.maps.drops(), **self.maps.cuda_seen(), **skipped}

    def kernel_misses(self) -> tuple[ProgramMisses, ...]:
        """Per kernel hook, its programs and the runs the kernel skipped,
        and of a paired hook's first program the runs its second caught."""
        # caught before the misses: each caught run follows its first's
        # skipped one, so read in this order caught never exceeds misses
        table = self.maps.maps.get(PAIR_CAUGHT)
        caught = {h: table.percpu_sum(i) for i, h in enumerate(PAIRED)} if table is not None else {}
        out = []
        for p in self.hook_programs():
            if p.hook in caught and not p.program.endswith(SECOND):
                p = replace(p, caught=caught[p.hook])
            out.append(p)
        return tuple(out)

    def hook_programs(self) -> tuple[ProgramMisses, ...]:
        """None known here: a recording read from its maps alone."""
        return ()

    def comm_progress(self) -> list[CommProgress]:
        values = self.maps.communicators()
        keys = values[["pid", "comm"]]
        if not len(keys):
            return []
        slots = self.maps.inflight
        live = slots[np.flatnonzero(slots["tid"])]
        live = live[live["entered_ns"] != 0]
        busy = Counter(zip(live["pid"].tolist(), live["comm"].tolist(), strict=True))
        returned = self._last_returns(values["last_pos"])
        return [
            CommProgress(
                pid=int(k["pid"]),
                comm=int(k["comm"]),
                comm_hash=int(v["hash"]),
                rank=int(v["rank"]),
                nranks=int(v["nranks"]),
                last_enter_ns=int(v["last_enter_ns"]),
                last_return_ns=int(r),
                calls=int(v["calls"]),
                inflight=busy[(int(k["pid"]), int(k["comm"]))],
                destroyed=bool(v["destroyed"]),
                init_ns=int(v["init_ns"]),
            )
            for k, v, r in zip(keys, values, returned, strict=True)
        ]

    def _last_returns(self, last_pos: np.ndarray) -> np.ndarray:
        """When each communicator's last call returned: the end time of its
        row in the nccl ring (0 while in flight, or once overwritten: its
        entry time is then the later anyway)."""
        ring = self.maps.ring_arrays["nccl"]
        pos = last_pos.astype(np.int64)
        rows = ring[(pos - 1) & (len(ring) - 1)]
        mine = (pos > 0) & (rows["pos"].astype(np.int64) == pos)
        return np.where(mine, rows["end_ns"], 0).astype(np.int64)

    def inflight_calls(self) -> list[InflightCall]:
        slots = self.maps.inflight
        live = slots[np.flatnonzero(slots["tid"])]  # a copy of the few busy slots
        live = live[live["entered_ns"] != 0]
        return [
            InflightCall(
                pid=int(row["pid"]),
                tid=int(row["tid"]),
                comm_hash=int(row["comm_hash"]),
                op=int(row["op"]),
                seq=int(row["seq"]),
                entered_ns=int(row["entered_ns"]),
            )
            for row in live
        ]

    def scope_pids(self) -> tuple[set[int], set[int]]:
        """(tracked, excluded): the processes an earlier agent placed."""
        return self.maps.pids("tracked"), self.maps.pids("excluded")

    def forget_process(self, pid: int, keep_scope: bool = False) -> None:
        self.maps.forget(pid, keep_scope)


class BccSource(MapSource):
    """The BPF programs of ``bpf/``, loaded (or adopted, with ``pins``) and read."""

    def __init__(
        self,
        ring_slots: int,
        runq_threshold_ns: int,
        pins: PinOptions | None = None,
        about: dict[str, Any] | None = None,
        compile_outside: bool = False,
        cache_dir: Path | None = None,
        raw_tracepoints: bool = True,
    ) -> None:
        """``compile_outside``, ``cache_dir``, ``raw_tracepoints``: see
        ``Probes`` (the agent compiles nothing itself)."""
        from .bpfbuild import RingSizes
        from .probes import Probes

        self.probes = Probes(
            RingSizes.from_nccl(ring_slots),
            runq_threshold_ns,
            pins=pins,
            about=about,
            compile_outside=compile_outside,
            cache_dir=cache_dir,
            raw_tracepoints=raw_tracepoints,
        )
        self.sizes = self.probes.sizes
        super().__init__(self.probes.maps)

    @property
    def pinset(self) -> PinSet | None:
        return self.probes.pinset

    @property
    def adopted(self) -> bool:
        return self.probes.adopted

    def hook_programs(self) -> tuple[ProgramMisses, ...]:
        return self.probes.kernel_misses()

    def attach(self, path: str, symbol: str) -> None:
        self.probes.attach_symbol(path, symbol)

    def attach_exit(self, libc: str) -> None:
        self.probes.attach_exit(libc)

    def attach_loader(self, ldso: str) -> None:
        self.probes.attach_loader(ldso)

    def set_scope(self, pid: int, tracked: bool, excluded: bool) -> None:
        self.probes.set_pid("tracked", pid, tracked)
        self.probes.set_pid("excluded", pid, excluded)

    def ignore_own_traffic(self, pid: int, port: int) -> None:
        self.probes.set_agent_self(pid, port)

    def set_job_sockets(self, sockets: JobSockets) -> None:
        refused = self.probes.maps.set_job_sockets(sockets.listeners, sockets.connections)
        if refused and refused != self._sockets_refused:
            log.warning(
                "the job holds %d sockets more than the kernel's tables of its sockets hold: "
                "their TCP rows are not kept (their samples are)",
                refused,
            )
        self._sockets_refused = refused

    def close(self) -> None:
        self.probes.close()


class PinnedSource(MapSource):
    """A pinned recording read with no agent running (``stallwatch dump
    --pinned``): nothing is attached and nothing written."""

    def __init__(self, pinset: PinSet) -> None:
        self._pins = pinset
        super().__init__(MapSet(pinset.layout, pinset.open_maps(read_only=True)))

    @property
    def pinset(self) -> PinSet:
        return self._pins

    def hook_programs(self) -> tuple[ProgramMisses, ...]:
        """From the pinned links: the programs they hold."""
        return kernelhooks.pinned(self.pinset.path, self.pinset.links()).misses()

    def attach(self, path: str, symbol: str) -> None:
        raise ProbeError(f"reading the pinned recording at {self.pinset.path}: nothing is attached")

    def attach_exit(self, libc: str) -> None:
        self.attach(libc, "_exit")

    def attach_loader(self, ldso: str) -> None:
        self.attach(ldso, "_dl_debug_state")

    def set_scope(self, pid: int, tracked: bool, excluded: bool) -> None:
        return None  # the pinned maps are the recording's, not this reader's

    def ignore_own_traffic(self, pid: int, port: int) -> None:
        return None

    def set_job_sockets(self, sockets: JobSockets) -> None:
        return None

    def forget_process(self, pid: int, keep_scope: bool = False) -> None:
        return None

    def close(self) -> None:
        self.maps.close()
        self.pinset.close()


@dataclass(slots=True)
class ReplaySource:
    """Rings and maps in memory; tests append rows and set map contents."""

    ring_slots: int = 1024
    writers: dict[str, RingWriter] = field(default_factory=dict)
    comms: list[CommProgress] = field(default_factory=list)
    inflight: list[InflightCall] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
    misses: tuple[ProgramMisses, ...] = ()
    attached: list[tuple[str, str]] = field(default_factory=list)
    missing_symbols: Sequence[str] = ()
    tracked: set[int] = field(default_factory=set)
    excluded: set[int] = field(default_factory=set)
    own_traffic: tuple[int, int] = (0, 0)  # (pid, port) whose TCP rows are left out
    job_sockets: JobSockets = field(default_factory=JobSockets)
    closed: bool = False

    @property
    def pinset(self) -> PinSet | None:
        return None

    def __post_init__(self) -> None:
        for name in RING_MAPS:  # the kernel's rings: the agent keeps the link ring itself
            slots = self.ring_slots if name == "nccl" else max(64, self.ring_slots // 8)
            self.writers.setdefault(name, RingWriter(name, RING_DTYPES[name], slots))

    def rings(self) -> dict[str, RingBuffer]:
        return {name: w.buffer for name, w in self.writers.items()}

    def kernel_counters(self) -> dict[str, int]:
        return dict(self.counters)

    def kernel_misses(self) -> tuple[ProgramMisses, ...]:
        return self.misses

    def comm_progress(self) -> list[CommProgress]:
        return list(self.comms)

    def inflight_calls(self) -> list[InflightCall]:
        return list(self.inflight)

    def attach(self, path: str, symbol: str) -> None:
        from stallwatch.dumpers.errors import ProbeError

        if symbol in self.missing_symbols:
            raise ProbeError(f"cannot attach {symbol} in {path}: no such symbol")
        self.attached.append((path, symbol))

    def attach_exit(self, libc: str) -> None:
        self.attached.append((libc, "_exit"))

    def attach_loader(self, ldso: str) -> None:
        self.attached.append((ldso, "_dl_debug_state"))

    def discovery_ring(self) -> RingBuffer | None:
        return None  # no kernel: the agent scans /proc

    def doorbell(self) -> RingbufBell | None:
        return None

    def set_scope(self, pid: int, tracked: bool, excluded: bool) -> None:
        (self.tracked.add if tracked else self.tracked.discard)(pid)
        (self.excluded.add if excluded else self.excluded.discard)(pid)

    def ignore_own_traffic(self, pid: int, port: int) -> None:
        self.own_traffic = (pid, port)

    def set_job_sockets(self, sockets: JobSockets) -> None:
        self.job_sockets = sockets

    def scope_pids(self) -> tuple[set[int], set[int]]:
        return set(self.tracked), set(self.excluded)

    def forget_process(self, pid: int, keep_scope: bool = False) -> None:
        self.comms = [c for c in self.comms if c.pid != pid]
        if not keep_scope:
            self.tracked.discard(pid)
            self.excluded.discard(pid)

    def close(self) -> None:
        self.closed = True

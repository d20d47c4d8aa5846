"""The BPF maps the agent reads and writes, by fd, with numpy dtypes.

A ``Layout`` describes every map of the loaded BPF module: its type, the
numpy dtypes of its keys and values (taken from the compiled structs), its
size and flags, plus the ``-D`` settings the programs were built with.  Its
``fingerprint`` is what a pinned recording is adopted by: two layouts with
the same fingerprint read and write the same bytes in the same places, so a
new agent can take over maps and programs an earlier one left pinned.  A map
added to ``bpf/`` is part of the layout without anything to declare.

A ``MapSet`` holds one fd per map, whoever opened it (BCC when the agent
loads the programs itself, ``recorder.pinning`` when it adopts a pinned
recording or ``stallwatch dump --pinned`` reads one), and gives the agent
what it reads: the rings and the in-flight slots as numpy views of the
mmapped arrays, the loss counters, hash maps as numpy arrays.  No BCC here.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import mmap
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.lib.format import descr_to_dtype, dtype_to_descr

from stallwatch.dumpers import layout
from stallwatch.dumpers.errors import ProbeError
from stallwatch.dumpers.schema import RING_DTYPES

from . import bpfsys

# Ring name -> (index of its head in `heads`, BPF map name, cflag for its slots).
RING_MAPS: dict[str, tuple[int, str, str]] = {
    ring: (i, f"{ring}_ring", f"{ring.upper()}_RING_SLOTS") for i, ring in enumerate(layout.RINGS)
}
# Index in the per-CPU `drops` array -> counter name (DROP_* of bpf/events.h).
DROP_NAMES = layout.DROP_NAMES
# Index in the per-CPU `cuda_seen` array (bpf/cuda.c SEEN_*) -> counter name.
CUDA_SEEN_NAMES = (
    "cuda_event_records",
    "cuda_stream_waits",
    "cuda_answers_done",
    "cuda_answers_not_ready",
    "cuda_answers_error",
    "cuda_graph_calls",
)
HEAD_STRIDE_U64 = 8  # struct ring_head: one 64-byte line per ring
# The discovery ring (bpf/proc.c): read each tick, never dumped.
DISCOVERY_MAP, DISCOVERY_HEAD = "disc_ring", layout.DISC_HEAD
DISCOVERY_BELL = "disc_bell"  # a ring buffer rung when a process loads a GPU library
DISCOVERY_EVENT = layout.DISC.dtype
DISC_EXEC, DISC_LINKMAP = int(layout.DiscEvent.EXEC), int(layout.DiscEvent.LINKMAP)
BPF_F_MMAPABLE = 1 << 10
# Each communicator's state (bpf/nccl.c), a slot of an mmapped array; its
# `pid` is set once the slot is a communicator's.
COMM_STATES = "comm_states"


def _replace(table: BpfMap, keys: np.ndarray, pids: list[int]) -> int:
    """A hash map holding exactly ``keys`` -> ``pids`` from now on, as many
    as it has room for; returns how many it had no room for (a full hash
    map refuses new keys: E2BIG)."""
    held, _ = table.items()
    wanted = {k.tobytes() for k in keys}
    for k in held:
        if k.tobytes() not in wanted:
            bpfsys.map_delete(table.fd, k.tobytes())
    values = np.array(pids, dtype=table.spec.value)
    return _update_all(table, keys, values)


def _update_all(table: BpfMap, keys: np.ndarray, values: np.ndarray) -> int:
    """Each key -> its value; the number of keys a full map refused."""
    refused = 0
    for k, v in zip(keys, values, strict=True):
        try:
            bpfsys.map_update(table.fd, k.tobytes(), v.tobytes())
        except OSError as exc:
            if exc.errno != errno.E2BIG:
                raise
            refused += 1
    return refused


def descr_json(dtype: np.dtype) -> Any:
    """A dtype as JSON (numpy's own description, padding included)."""
    return json.loads(json.dumps(dtype_to_descr(dtype)))


def dtype_from_json(doc: Any) -> np.dtype:
    def entry(e: list[Any]) -> tuple[Any, ...]:
        fmt = fmt_of(e[1])
        return (e[0], fmt, tuple(e[2])) if len(e) > 2 else (e[0], fmt)

    def fmt_of(f: Any) -> Any:
        return [entry(e) for e in f] if isinstance(f, list) else f

    dtype: np.dtype = descr_to_dtype(fmt_of(doc))
    return dtype


@dataclass(frozen=True, slots=True)
class MapSpec:
    name: str
    type: int
    key: np.dtype
    value: np.dtype
    max_entries: int
    flags: int

    def to_json(self) -> dict[str, Any]:
        return {
            "type": self.type,
            "key": descr_json(self.key),
            "value": descr_json(self.value),
            "max_entries": self.max_entries,
            "flags": self.flags,
        }

    @classmethod
    def from_json(cls, name: str, doc: dict[str, Any]) -> MapSpec:
        return cls(
            name,
            int(doc["type"]),
            dtype_from_json(doc["key"]),
            dtype_from_json(doc["value"]),
            int(doc["max_entries"]),
            int(doc["flags"]),
        )


@dataclass(frozen=True, slots=True)
class Layout:
    """Every map of the BPF module and the settings its programs were built with."""

    maps: dict[str, MapSpec]
    defines: tuple[str, ...]  # -DNAME=VALUE flags, sorted

    def to_json(self) -> dict[str, Any]:
        return {
            "maps": {n: s.to_json() for n, s in sorted(self.maps.items())},
            "defines": list(self.defines),
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Layout:
        maps = {n: MapSpec.from_json(n, m) for n, m in doc["maps"].items()}
        return cls(maps, tuple(doc["defines"]))

    @property
    def fingerprint(self) -> str:
        text = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def difference(self, other: Layout) -> str:
        """The first way ``other`` (pinned) differs from this one, in words."""
        mine, theirs = set(self.maps), set(other.maps)
        if mine - theirs:
            return f"map {sorted(mine - theirs)[0]} is missing there"
        if theirs - mine:
            return f"it has a map {sorted(theirs - mine)[0]} this agent does not know"
        for name in sorted(mine):
            a, b = self.maps[name], other.maps[name]
            for what, x, y in (
                ("type", a.type, b.type),
                ("entries", a.max_entries, b.max_entries),
                ("flags", a.flags, b.flags),
                ("key bytes", a.key.itemsize, b.key.itemsize),
                ("value bytes", a.value.itemsize, b.value.itemsize),
            ):
                if x != y:
                    return f"map {name}: {what} {y} there, {x} here"
            if a.key != b.key or a.value != b.value:
                return f"map {name}: its record's fields differ"
        extra = sorted(set(self.defines) ^ set(other.defines))
        if extra:
            return f"built with other settings ({extra[0]})"
        return "nothing"


class BpfMap:
    """One map by fd (``owned``: closed with the map set)."""

    def __init__(self, spec: MapSpec, fd: int, owned: bool, read_only: bool = False) -> None:
        self.spec = spec
        self.fd = fd
        self.owned = owned
        self.read_only = read_only
        self._batch: bpfsys.BatchReader | bool | None = None  # False: not supported
        info = bpfsys.MapInfo(spec.type, 0, spec.key.itemsize, spec.value.itemsize, 0, 0, "")
        self._value_bytes = bpfsys.value_bytes(info)

    def _key(self, key: int) -> bytes:
        return np.array([key], dtype=self.spec.key).tobytes()

    def lookup_raw(self, key: int) -> bytes | None:
        return bpfsys.map_lookup(self.fd, self._key(key), self._value_bytes)

    def update(self, key: int, value: int) -> None:
        bpfsys.map_update(self.fd, self._key(key), np.array([value], self.spec.value).tobytes())

    def delete(self, key: int) -> None:
        bpfsys.map_delete(self.fd, self._key(key))

    def percpu_sum(self, index: int) -> int:
        raw = self.lookup_raw(index)
        return int(np.frombuffer(raw, dtype="<u8").sum()) if raw else 0

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """Every (key, value) of a hash map, as two structured arrays."""
        if self._batch is None and self.spec.type == bpfsys.BPF_MAP_TYPE_HASH:
            self._batch = bpfsys.BatchReader(
                self.fd, self.spec.key.itemsize, self.spec.value.itemsize, self.spec.max_entries
            )
        if isinstance(self._batch, bpfsys.BatchReader):
            try:
                raw_keys, raw_values = self._batch.read()
            except OSError:  # no batch lookup in this kernel: one key at a time
                self._batch = False
            else:
                return (
                    np.frombuffer(raw_keys, dtype=self.spec.key),
                    np.frombuffer(raw_values, dtype=self.spec.value),
                )
        keys = list(bpfsys.map_keys(self.fd, self.spec.key.itemsize))
        values = []
        kept = []
        for k in keys:
            v = bpfsys.map_lookup(self.fd, k, self._value_bytes)
            if v is not None:  # deleted since listed
                kept.append(k)
                values.append(v)
        key_arr = np.frombuffer(b"".join(kept), dtype=self.spec.key)
        val_arr = np.frombuffer(b"".join(values), dtype=self.spec.value)
        return key_arr, val_arr

    def mmap(self) -> tuple[mmap.mmap, np.ndarray]:
        """An mmapable array map as a numpy array of its values."""
        if not self.spec.flags & BPF_F_MMAPABLE:
            raise ProbeError(f"BPF map {self.spec.name} is not mmapable")
        elem = (self.spec.value.itemsize + 7) & ~7
        length = elem * self.spec.max_entries
        length = (length + mmap.PAGESIZE - 1) & ~(mmap.PAGESIZE - 1)
        prot = mmap.PROT_READ if self.read_only else mmap.PROT_READ | mmap.PROT_WRITE
        try:
            mem = mmap.mmap(self.fd, length, flags=mmap.MAP_SHARED, prot=prot)
        except OSError as exc:
            raise ProbeError(f"cannot mmap BPF map {self.spec.name} (fd {self.fd}): {exc}") from exc
        if elem != self.spec.value.itemsize:
            raise ProbeError(f"BPF map {self.spec.name}: records of {elem} bytes are not packed")
        view = np.frombuffer(mem, dtype=self.spec.value, count=self.spec.max_entries)
        return mem, view

    def close(self) -> None:
        if self.owned:
            with contextlib.suppress(OSError):
                os.close(self.fd)


@dataclass
class MapSet:
    """The maps of one recording, and the views the agent reads."""

    layout: Layout
    maps: dict[str, BpfMap]
    _mems: list[mmap.mmap] = field(default_factory=list)
    ring_arrays: dict[str, np.ndarray] = field(default_factory=dict)
    heads: np.ndarray = field(default_factory=lambda: np.zeros(0, "<u8"))
    inflight: np.ndarray = field(default_factory=lambda: np.zeros(0, "<u8"))
    comm_states: np.ndarray = field(default_factory=lambda: np.zeros(0, "<u8"))
    discovery: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.heads = self._view("heads").view("<u8")
        for ring, (_, map_name, _) in RING_MAPS.items():
            expected = RING_DTYPES[ring]
            actual = self.maps[map_name].spec.value
            if actual.itemsize != expected.itemsize:
                raise ProbeError(
                    f"BPF map {map_name}: record is {actual.itemsize} bytes, "
                    f"dumpers.schema says {expected.itemsize}"
                )
            self.ring_arrays[ring] = self._view(map_name).view(expected)
        self.inflight = self._view("inflight")
        self.comm_states = self._view(COMM_STATES)
        if DISCOVERY_MAP in self.maps:
            self.discovery = self._view(DISCOVERY_MAP).view(DISCOVERY_EVENT)

    def _view(self, name: str) -> np.ndarray:
        mem, view = self.maps[name].mmap()
        self._mems.append(mem)
        return view

    def head(self, ring: str) -> int:
        return int(self.heads[RING_MAPS[ring][0] * HEAD_STRIDE_U64])

    def discovery_head(self) -> int:
        return int(self.heads[DISCOVERY_HEAD * HEAD_STRIDE_U64])

    def ring_slots(self) -> dict[str, int]:
        return {ring: len(a) for ring, a in self.ring_arrays.items()}

    def drops(self) -> dict[str, int]:
        table = self.maps["drops"]
        return {name: table.percpu_sum(i) for i, name in enumerate(DROP_NAMES)}

    def cuda_seen(self) -> dict[str, int]:
        """The CUDA runtime calls the probes saw, and their answers."""
        table = self.maps.get("cuda_seen")
        if table is None:
            return {}
        return {name: table.percpu_sum(i) for i, name in enumerate(CUDA_SEEN_NAMES)}

    def set_agent_self(self, tgid: int, port: int) -> None:
        """Whose TCP rows the programs leave out (bpf/tcp.c ``agent_self``)."""
        table = self.maps["agent_self"]
        value = np.zeros(1, dtype=table.spec.value)
        value["tgid"], value["port"] = tgid, port
        bpfsys.map_update(table.fd, np.array([0], table.spec.key).tobytes(), value.tobytes())

    def set_job_sockets(
        self,
        listeners: dict[tuple[bytes, int, int], int],
        connections: dict[tuple[bytes, bytes, int, int, int], int],
    ) -> int:
        """The job's listeners and connections, whose rows the TCP programs
        keep (bpf/tcp.c ``job_endpoints``, ``job_conns``): exactly these from
        now on, each with the pid that holds it; a listener the programs
        learn since is added by them.  Returns how many the maps had no
        room for (a job holding more than their ``max_entries``: those
        connections' rows are not kept)."""
        refused = 0
        listen = self.maps.get("job_endpoints")
        if listen is not None and not listen.read_only:
            keys = np.zeros(len(listeners), dtype=listen.spec.key)
            for i, (addr, port, family) in enumerate(listeners):
                keys[i]["addr"] = np.frombuffer(addr, dtype=np.uint8)
                keys[i]["port"], keys[i]["family"] = port, family
            refused += _replace(listen, keys, list(listeners.values()))
        peers = self.maps.get("job_peers")
        if peers is not None and not peers.read_only and connections:
            keys = np.zeros(len(connections), dtype=peers.spec.key)
            for i, (_, raddr, _, _, family) in enumerate(connections):
                keys[i]["addr"] = np.frombuffer(raddr, dtype=np.uint8)
                keys[i]["family"] = family
            unique = np.unique(keys)
            refused += _update_all(peers, unique, np.ones(len(unique), dtype=peers.spec.value))
        conns = self.maps.get("job_conns")
        if conns is not None and not conns.read_only:
            keys = np.zeros(len(connections), dtype=conns.spec.key)
            for i, (laddr, raddr, lport, rport, family) in enumerate(connections):
                keys[i]["laddr"] = np.frombuffer(laddr, dtype=np.uint8)
                keys[i]["raddr"] = np.frombuffer(raddr, dtype=np.uint8)
                keys[i]["lport"], keys[i]["rport"], keys[i]["family"] = lport, rport, family
            refused += _replace(conns, keys, list(connections.values()))
        return refused

    def items(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        return self.maps[name].items()

    def set_pid(self, map_name: str, pid: int, present: bool) -> None:
        table = self.maps[map_name]
        if present:
            if map_name == "excluded":  # the programs look at `excluded` from now on
                self.maps["any_excluded"].update(0, 1)
            table.update(pid, 1)
        else:
            table.delete(pid)

    def forget(self, pid: int, keep_scope: bool = False) -> None:
        """Every entry of process ``pid`` in the hash maps that hold one:
        keyed by it (a ``pid`` field, or the key itself), or, for the
        run-queue maps, by its threads (``rq_tids`` names their process);
        and its communicators' state slots.
        ``keep_scope``: not its place in ``tracked``/``excluded``."""
        tids: list[int] = []
        if "rq_tids" in self.maps:
            keys, values = self.items("rq_tids")
            tids = [int(k) for k, v in zip(keys, values, strict=True) if int(v) == pid]
        for name, m in self.maps.items():
            if m.spec.type != bpfsys.BPF_MAP_TYPE_HASH:
                continue
            if name in ("rq_tids", "rq_enqueued", "rq_totals"):
                for tid in tids:
                    m.delete(tid)
                continue
            if name in ("sock_owner", "job_endpoints", "job_conns"):  # the value: its pid
                keys, values = m.items()
                for k in keys[values == pid]:
                    bpfsys.map_delete(m.fd, k.tobytes())
                continue
            key = m.spec.key
            if key.names is not None and "pid" in key.names:
                keys, _ = m.items()
                for k in keys[keys["pid"] == pid]:
                    bpfsys.map_delete(m.fd, k.tobytes())
            elif key.names is None and name in ("tracked", "excluded") and not keep_scope:
                m.delete(pid)
        self._free_comm_slots(pid)

    def communicators(self) -> np.ndarray:
        """A copy of every communicator's state slot in use."""
        states = self.comm_states
        return states[np.flatnonzero((states["pid"] != 0) & (states["comm"] != 0))]

    def _free_comm_slots(self, pid: int) -> None:
        """Free a dead process's slots: its pid first, as the programs do."""
        states = self.comm_states
        if self.maps[COMM_STATES].read_only or not len(states):
            return
        for i in np.flatnonzero(states["pid"] == pid):
            states["pid"][i] = 0
            states["comm"][i] = 0

    def pids(self, map_name: str) -> set[int]:
        """The keys of a pid set (``tracked``, ``excluded``)."""
        keys, _ = self.items(map_name)
        return {int(k) for k in keys}

    def close(self) -> None:
        # numpy views keep their mapping alive until collected: drop ours
        self.ring_arrays = {}
        self._mems.clear()
        for m in self.maps.values():
            m.close()

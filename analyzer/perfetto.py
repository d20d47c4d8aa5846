"""An incident as a Chrome/Perfetto trace (the JSON trace-event format).

One trace process per host, one track (thread) per rank and communicator,
each NCCL call a complete slice ("X") carrying op, seq, bytes and state,
and where the CUDA probes saw it complete, its device span (seen started, or
queued, to seen completed) on a "device" track beside the host's;
TCP retransmits and run-queue delays are instant events on the owning rank's
"kernel" track; each verdict is a global instant marker.  Times are the
incident's clock, as in SQL (``dumpers.sqltables``): wall clock
microseconds, each host's monotonic stamps converted with the clock pair its
dump sampled, so hosts line up as well as their clocks do.  The times a
slice carries in its arguments are SQL's: ``ts_ns`` on that clock (null for
a dump without a clock pair), ``host_ts_ns`` the host's own monotonic stamp.

Open the file at https://ui.perfetto.dev or chrome://tracing.

Known limits: a call still in flight when the dump was taken is drawn up to
the dump time, with state "scheduled"; calls outside the rings' windows are
not shown; a dump without a clock pair is drawn at its host's monotonic
times, its host named "(no clock pair)", apart from every other host.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stallwatch.dumpers.columns import clock_offset
from stallwatch.dumpers.errors import UsageError
from stallwatch.dumpers.model import Recording
from stallwatch.dumpers.ranks import Ranks
from stallwatch.dumpers.schema import PREV_PID_UNKNOWN, State, TcpEvent, datatype_name, op_name
from stallwatch.dumpers.sqltables import recording_now

_STATE_NAMES = {int(s): s.name.lower() for s in State}
_DEVICE_TRACK = "device"
_KERNEL_TRACK = "kernel"
_CULPRIT_TRACK = "verdict"


@dataclass(frozen=True, slots=True)
class Marker:
    """A verdict to pin on the timeline."""

    kind: str
    summary: str
    hosts: tuple[str, ...] = ()  # the culprits', index by index with ranks and pids
    ranks: tuple[int | None, ...] = ()  # None where unknown
    pids: tuple[int | None, ...] = ()

    def culprits(self) -> list[tuple[str, int, int | None]]:
        """(host, pid, world rank) of each culprit (pid 0, rank None:
        unknown), where the verdict names its host."""
        if len(self.hosts) != len(self.pids):
            return []
        ranks = self.ranks if len(self.ranks) == len(self.hosts) else (None,) * len(self.hosts)
        return [(h, p or 0, r) for h, p, r in zip(self.hosts, self.pids, ranks, strict=True) if h]


class _Tracks:
    """Stable small integers for hosts (trace pid) and tracks (trace tid)."""

    def __init__(self, unclocked: frozenset[str] = frozenset()) -> None:
        self.hosts: dict[str, int] = {}
        self.tracks: dict[tuple[str, int, str], int] = {}
        self.meta: list[dict[str, object]] = []
        self.unclocked = unclocked  # hosts drawn on their own clock

    def host(self, host: str) -> int:
        if host not in self.hosts:
            self.hosts[host] = len(self.hosts) + 1
            hp = self.hosts[host]
            name = f"{host} (no clock pair)" if host in self.unclocked else host
            self.meta.append(_meta("process_name", hp, 0, name))
            self.meta.append(  # hosts in name order, as they were added
                {"ph": "M", "name": "process_sort_index", "pid": hp, "tid": 0,
                 "args": {"sort_index": hp}}
            )  # fmt: skip
        return self.hosts[host]

    def track(self, host: str, pid: int, label: str) -> tuple[int, int]:
        hp = self.host(host)
        key = (host, pid, label)
        if key not in self.tracks:
            self.tracks[key] = len(self.tracks) + 1
            self.meta.append(_meta("thread_name", hp, self.tracks[key], label))
        return hp, self.tracks[key]


def _meta(name: str, pid: int, tid: int, value: str) -> dict[str, object]:
    return {"ph": "M", "name": name, "pid": pid, "tid": tid, "args": {"name": value}}


def _rank_label(ranks: dict[int, int], pid: int) -> str:
    """A rank's track: its world rank (dumpers.ranks) and pid, where known."""
    rank = ranks.get(pid)
    if rank is None:
        return f"pid {pid}" if pid else "rank unknown"
    return f"rank {rank} (pid {pid})" if pid else f"rank {rank}"


def _known(value: int) -> int | None:
    return value if value >= 0 else None


def _nccl_slices(
    rec: Recording, tracks: _Tracks, ranks: dict[int, int], known: Ranks
) -> list[dict[str, object]]:
    ring = rec.rings.get("nccl")
    if ring is None or len(ring.rows) == 0:
        return []
    rows = ring.rows
    # calls in flight drawn up to the recording's time, as SQL's elapsed_ns
    end_ns = np.where(
        rows["end_ns"] > 0, rows["end_ns"], np.maximum(recording_now(rec), rows["ts_ns"])
    )
    ts_us = (rows["ts_ns"].astype(np.int64) + _to_trace(rec)) / 1e3
    dur_us = (end_ns.astype(np.int64) - rows["ts_ns"].astype(np.int64)) / 1e3
    out: list[dict[str, object]] = []
    for i, row in enumerate(rows):
        comm_label = f"0x{int(row['comm_hash']):016x}" if row["comm_hash"] else "no comm"
        rank = known.comm.get(((rec.host, int(row["pid"])), int(row["comm_hash"])))
        rank = rank if rank is not None else _known(int(row["rank"]))
        label = f"{_rank_label(ranks, int(row['pid']))} comm {comm_label}"
        hp, tid = tracks.track(rec.host, int(row["pid"]), label)
        op = op_name(int(row["op"]))
        out.append(
            {
                "ph": "X",
                "name": op,
                "cat": "nccl",
                "pid": hp,
                "tid": tid,
                "ts": float(ts_us[i]),
                "dur": max(float(dur_us[i]), 0.0),
                "args": {
                    "op": op,
                    "seq": int(row["seq"]),
                    "count": int(row["count"]),
                    "bytes": int(row["bytes"]),
                    "datatype": datatype_name(int(row["datatype"])),
                    "state": _STATE_NAMES.get(int(row["state"]), str(int(row["state"]))),
                    "result": int(row["result"]),
                    "in_flight": int(row["end_ns"]) == 0,
                    # as SQL's elapsed_ns: in flight, up to the recording's time
                    "elapsed_ns": int(end_ns[i]) - int(row["ts_ns"]),
                    "rank": rank,
                    "world_rank": ranks.get(int(row["pid"])),
                    "nranks": _known(int(row["nranks"])),
                    "peer": _known(int(row["peer"])),
                    "comm_id_hash": comm_label,
                    "host": rec.host,
                    "pid": int(row["pid"]) or None,
                    "tid": int(row["tid"]),
                    "ts_ns": _on_clock(rec, int(row["ts_ns"])),  # as in SQL
                    "host_ts_ns": int(row["ts_ns"]),
                },
            }
        )
        device = _device_slice(rec, tracks, row, label, op)
        if device is not None:
            out.append(device)
    return out


def _device_slice(
    rec: Recording, tracks: _Tracks, row: np.void, label: str, op: str
) -> dict[str, object] | None:
    """The call on the device, on a track beside the host's: from when it was
    seen started (or, unseen, when the host queued it) to when it was seen
    completed.  None where no completion was observed."""
    done = int(row["completed_ns"])
    if not done:
        return None
    begin = int(row["started_ns"]) or int(row["end_ns"]) or int(row["ts_ns"])
    hp, tid = tracks.track(rec.host, int(row["pid"]), f"{label} {_DEVICE_TRACK}")
    to_us = _to_trace(rec)
    return {
        "ph": "X",
        "name": op,
        "cat": "device",
        "pid": hp,
        "tid": tid,
        "ts": (begin + to_us) / 1e3,
        "dur": max(done - begin, 0) / 1e3,
        "args": {
            "seq": int(row["seq"]),
            "started_seen": bool(row["started_ns"]),
            "started_after_ns": _on_clock(rec, int(row["started_after_ns"])),
            "completed_after_ns": _on_clock(rec, int(row["completed_after_ns"])),
            "completed_ns": _on_clock(rec, done),
        },
    }


def _to_trace(rec: Recording) -> int:
    """What places the recording's stamps on the trace's clock: the
    incident's (SQL's), or for a dump without a clock pair its own."""
    offset = clock_offset(rec)
    return 0 if offset is None else offset


def _on_clock(rec: Recording, stamp: int) -> int | None:
    """A stamp on the incident's clock, as SQL has it: None where unknown
    (0: not observed; no clock pair)."""
    offset = clock_offset(rec)
    return stamp + offset if stamp and offset is not None else None


def _instants(rec: Recording, tracks: _Tracks, ranks: dict[int, int]) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    to_us = _to_trace(rec)
    tcp = rec.rings.get("tcp")
    if tcp is not None:
        for row in tcp.rows[tcp.rows["event"] == TcpEvent.TCP_RETRANSMIT_SKB]:
            pid = int(row["pid"])
            hp, tid = tracks.track(rec.host, pid, f"{_rank_label(ranks, pid)} {_KERNEL_TRACK}")
            out.append(
                {
                    "ph": "i",
                    "s": "t",
                    "name": "tcp_retransmit_skb",
                    "cat": "tcp",
                    "pid": hp,
                    "tid": tid,
                    "ts": (int(row["ts_ns"]) + to_us) / 1e3,
                    "args": {"sport": int(row["sport"]), "dport": int(row["dport"])},
                }
            )
    sched = rec.rings.get("sched")
    if sched is not None:
        for row in sched.rows:
            pid = int(row["pid"])
            hp, tid = tracks.track(rec.host, pid, f"{_rank_label(ranks, pid)} {_KERNEL_TRACK}")
            out.append(
                {
                    "ph": "i",
                    "s": "t",
                    "name": "runqueue_delay",
                    "cat": "sched",
                    "pid": hp,
                    "tid": tid,
                    "ts": (int(row["ts_ns"]) + to_us) / 1e3,
                    "args": _sched_args(row),
                }
            )
    return out


def _sched_args(row: np.void) -> dict[str, object]:
    args: dict[str, object] = {"delay_ms": int(row["delay_ns"]) / 1e6, "tid": int(row["tid"])}
    if int(row["prev_pid"]) != PREV_PID_UNKNOWN:  # unknown before format 5: left out
        args["prev_pid"] = int(row["prev_pid"])
    return args


def _markers(
    markers: Sequence[Marker], at_us: float, tracks: _Tracks, known: Ranks
) -> list[dict[str, object]]:
    """Each verdict once on the whole timeline, once on each host it names,
    and once on each culprit's own track (made for a culprit that recorded
    nothing, as a Flight Recorder rank that hung before any entry)."""
    out: list[dict[str, object]] = []
    for m in markers:
        args: dict[str, object] = {
            "summary": m.summary,
            "hosts": list(m.hosts),
            "ranks": list(m.ranks),
            "pids": list(m.pids),
        }
        name = f"verdict: {m.kind}"
        out.append(_marker(name, "g", 0, at_us, args))
        out += [
            _marker(name, "p", tracks.host(h), at_us, args) for h in dict.fromkeys(m.hosts) if h
        ]
        for host, pid, rank in m.culprits():
            world = known.world_of(host)
            if not pid and rank is not None:  # a rank no dump holds (its host named)
                world = {0: rank}
            label = f"{_rank_label(world, pid)} {_CULPRIT_TRACK}"
            hp, tid = tracks.track(host, pid, label)
            who = {"host": host, "pid": pid or None, "world_rank": world.get(pid)}
            out.append(_marker(name, "t", hp, at_us, args | {"culprit": who}) | {"tid": tid})
    return out


def _marker(
    name: str, scope: str, pid: int, ts: float, args: dict[str, object]
) -> dict[str, object]:
    return {"ph": "i", "s": scope, "name": name, "cat": "verdict", "pid": pid, "tid": 0, "ts": ts,
            "args": args}  # fmt: skip


def build_trace(
    recordings: Iterable[Recording], markers: Sequence[Marker] = (), known: Ranks | None = None
) -> dict[str, object]:
    """The trace document for some recordings (one incident, usually);
    ranks as ``known`` says (derived over the whole incident: by default
    over the recordings given)."""
    recs = sorted(recordings, key=lambda r: r.host)
    known = Ranks.of(recs) if known is None else known
    tracks = _Tracks(frozenset(r.host for r in recs if clock_offset(r) is None))
    events: list[dict[str, object]] = []
    last_us = 0.0
    for rec in recs:
        ranks = known.world_of(rec.host)
        events += _nccl_slices(rec, tracks, ranks, known)
        events += _instants(rec, tracks, ranks)
        if rec.trigger is not None:
            last_us = max(last_us, rec.clock.to_wall_ns(rec.trigger.time_ns) / 1e3)
    if not last_us and events:
        last_us = max(float(e["ts"]) for e in events)  # type: ignore[arg-type]
    events += _markers(markers, last_us, tracks, known)
    return {"traceEvents": tracks.meta + events, "displayTimeUnit": "ms"}


def write_trace(path: Path, trace: dict[str, object]) -> None:
    try:
        path.write_text(json.dumps(trace, separators=(",", ":"), allow_nan=False))
    except OSError as exc:
        raise UsageError(f"{path}: cannot write the trace: {exc.strerror or exc}") from exc


__all__ = ["Marker", "build_trace", "write_trace"]

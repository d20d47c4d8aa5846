"""Our recordings as PyTorch Flight Recorder files (``stallwatch export
--flight-recorder``; the command is ``stallwatch.commands.export``).

An incident, as the analyzer reads it (the calls of each rank it judges:
aligned, matched, each rank's world rank derived), is written as torch writes
its recorder's dumps: one file per rank, ``rank_<world rank>``, format
version 2.10, pickled by torch's pickler (``analyzer.frwrite``), or its JSON
form.  Each NCCL call is an entry of its process group:

- a communicator is a process group named by a number ("0" the first one
  that spans every rank, "default_pg"; a group a Flight Recorder file named
  by a number keeps it), its description ``nccl_comm_0x<hash>`` (what a
  torch group would call ``undefined``) and its members' world ranks in
  ``pg_config``; ``pg_id`` is the rank's own count of its groups;
- ``collective_seq_id`` is the call's seq on its communicator, counted from
  1 as torch counts (a p2p call carries the last collective's);
  ``p2p_seq_id`` the rank's p2p calls on it as torch counts them, ``op_id``
  the two together, as torch's NCCL process group does; ``record_id`` the
  entry's place in its file, from 1 on every file where some rank's window
  is incomplete (torch's sign of a wrapped ring), else from 0;
- each communicator is written from the window every member still holds
  (``analyzer.frwindow``): torchfrtrace matches from the first entry it
  reads, and would name a rank whose ring no longer holds what its peers'
  still do;
- ``profiling_name`` as torch's NCCL process group writes it
  (``nccl:all_reduce``, ``nccl:_all_gather_base``, ``nccl:send 0->1`` with
  ranks in the group); sizes as torch records the tensors (an all_gather's
  output is its input times the group's size, flat: NCCL passes no shapes)
  and dtypes torch's names;
- state: a call the device was seen to finish is ``completed`` (with its
  times), one it was seen to start ``started``, any other ``scheduled``;
  ``retired`` when it finished or returned without error, as torch's
  watchdog retires a work;
- ``pg_status`` per group: the last seq entered and the last one finished.

What Flight Recorder has no field for (the host, the pid, how the process
ended, whether the ring had overwritten older calls) goes into a section of
its own, ``stallwatch``, which torch's tools do not read and ours does: the
files read back to the same verdict, and without it to the same ranks.

Known limits: the calls written are those the analyzer reads of each rank
(its latest 256, ``align.WINDOW_CALLS``); a broadcast's or a reduce's root,
result codes and the per-peer p2p sequences have no Flight Recorder field and
are not written; a rank whose world rank is unknown cannot be named
``rank_<world rank>`` and is left out (named in the result).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stallwatch.dumpers.errors import DumpWriteError, UsageError
from stallwatch.dumpers.inputs import SourceKind
from stallwatch.dumpers.schema import DataType, Op, State

from .frwindow import window
from .frwrite import dumps, dumps_json
from .incident import Comm, Incident
from .pipeline import IncidentResult

VERSION = "2.10"
SECTION = "stallwatch"  # what Flight Recorder has no field for (read by flightrec)
DEFAULT_PG = "default_pg"

OP_NAMES: dict[int, str] = {
    Op.ALL_REDUCE: "all_reduce",
    Op.ALL_GATHER: "_all_gather_base",
    Op.REDUCE_SCATTER: "_reduce_scatter_base",
    Op.BROADCAST: "broadcast",
    Op.REDUCE: "reduce",
    Op.ALL_TO_ALL: "all_to_all_single",
    Op.GATHER: "gather",
    Op.SCATTER: "scatter",
    Op.BARRIER: "barrier",
    Op.SEND: "send",
    Op.RECV: "recv",
}
DTYPE_NAMES: dict[int, str] = {
    DataType.INT8: "Char",
    DataType.UINT8: "Byte",
    DataType.INT32: "Int",
    DataType.UINT32: "UInt32",
    DataType.INT64: "Long",
    DataType.UINT64: "UInt64",
    DataType.FLOAT16: "Half",
    DataType.FLOAT32: "Float",
    DataType.FLOAT64: "Double",
    DataType.BFLOAT16: "BFloat16",
    DataType.FLOAT8E4M3: "Float8_e4m3fn",
    DataType.FLOAT8E5M2: "Float8_e5m2",
}
UNDEFINED_DTYPE = "Undefined"  # c10's name of no dtype


@dataclass(frozen=True, slots=True)
class FrWritten:
    """One incident's files: for the command's summary and for tests."""

    incident: str
    folder: Path
    files: tuple[Path, ...]
    ranks: tuple[int, ...]  # world ranks written
    calls: int
    left_out: tuple[str, ...]  # what could not be written, and why


@dataclass(frozen=True, slots=True)
class _Group:
    name: str
    desc: str
    ranks: tuple[int, ...]  # world ranks in group-rank order


def _groups(inc: Incident) -> list[_Group]:
    """Each communicator as a process group: a name torch would give it (a
    number), its description and its members' world ranks."""
    world = {p.world_rank for p in inc.procs if p.world_rank >= 0}
    taken = {c.label for c in inc.comms if c.label.isdigit()}
    default = next(
        (i for i, c in enumerate(inc.comms) if not c.label and set(_world_ranks(inc, c)) == world),
        None,
    )
    if "0" in taken:
        default = None
    elif default is not None:
        taken.add("0")
    spare = (str(i) for i in range(1 << 30) if str(i) not in taken)
    out: list[_Group] = []
    for i, c in enumerate(inc.comms):
        if c.label.isdigit() and c.label not in {g.name for g in out}:
            name = c.label
        elif i == default:
            name = "0"
        else:
            name = next(spare)
        desc = c.desc or (DEFAULT_PG if i == default else f"nccl_comm_{c.hash_text}")
        out.append(_Group(name, desc, _world_ranks(inc, c)))
    return out


def _world_ranks(inc: Incident, c: Comm) -> tuple[int, ...]:
    return tuple(
        c.world_rank(k) if c.world_rank(k) >= 0 else (inc.procs[p].world_rank if p >= 0 else -1)
        for k, p in enumerate(c.members)
    )


def _ranks_text(ranks: Sequence[int]) -> str:
    return "[" + ", ".join(str(r) for r in ranks) + "]"


def _sizes(op: int, count: int, n: int, root: bool) -> tuple[list[list[int]], list[list[int]]]:
    """Input and output sizes as torch's NCCL process group records the
    tensors of a call of ``count`` elements (NCCL's count) in a group of
    ``n``; ``root``: this rank is the op's root."""
    if op == Op.ALL_GATHER:
        return [[count]], [[count * n]]
    if op == Op.REDUCE_SCATTER:
        return [[count * n]], [[count]]
    if op == Op.ALL_TO_ALL:
        return [[count * n]], [[count * n]]
    if op == Op.GATHER:
        return [[count]], [[count]] * n if root else []
    if op == Op.SCATTER:
        return ([[count]] * n if root else []), [[count]]
    return [[count]], [[count]]


def _state(state: int, ended: bool) -> str:
    if state == State.COMPLETED and ended:
        return "completed"
    if state in (State.STARTED, State.COMPLETED) and not ended:
        return "started"
    return "scheduled"


class _RankDoc:
    """One rank's Flight Recorder dump, built call by call."""

    def __init__(self, inc: Incident, p: int, groups: list[_Group], first_record: int) -> None:
        self.inc, self.p, self.groups = inc, p, groups
        proc = inc.procs[p]
        self.rank = proc.world_rank
        mine = [i for i, c in enumerate(inc.comms) if p in c.members]
        self.pg_id = {c: k for k, c in enumerate(sorted(mine, key=lambda c: int(groups[c].name)))}
        self.cseq = dict.fromkeys(mine, 0)  # the last collective seq entered, per comm
        self.status = {c: {"enq": -1, "done": -1} for c in mine}
        self.errors: list[dict[str, object]] = []  # calls that returned an error
        host = inc.hosts.index(proc.host) if proc.host in inc.hosts else -1
        self.offset = inc.to_wall(host) if host >= 0 else None
        self.entries: list[dict[str, Any]] = []
        self.first_record = first_record
        # torch counts a group's collectives from 1 (NCCL's seq, as we record
        # it, from 0); a Flight Recorder file's own seqs are torch's already
        self.base = 1 if inc.kind is SourceKind.STALLWATCH else 0

    def wall(self, ts: int) -> int:
        return ts + self.offset if self.offset is not None else 0

    def add(self, row: dict[str, int], p2p_count: int) -> None:
        """A call, with the rank's p2p calls on its group up to it."""
        comm, op = row["comm"], row["op"]
        c = self.inc.comms[comm]
        is_p2p = op in (Op.SEND, Op.RECV)
        if is_p2p:  # a p2p call carries the group's last collective seq
            seq = p2p_count
        else:
            self.cseq[comm] = row["seq"] + self.base
            seq = self.cseq[comm]
        cseq = self.cseq[comm]
        ended = row["end"] > 0 and row["result"] == 0
        done = row["state"] == State.COMPLETED
        name = OP_NAMES[op]
        if is_p2p:
            arrow = "->" if op == Op.SEND else "<-"
            name = f"{name} {c.rank_of(row['crank'])}{arrow}{row['root']}"
        inputs, outputs = _sizes(op, row["count"], c.nranks, row["root"] == c.rank_of(row["crank"]))
        dtype = [DTYPE_NAMES.get(row["datatype"], UNDEFINED_DTYPE)]
        group = self.groups[comm]
        self.entries.append(
            {
                "record_id": self.first_record + len(self.entries),
                "pg_id": self.pg_id[comm],
                "process_group": (group.name, group.desc),
                "thread_name": None,  # not recorded
                "thread_id": None,
                "collective_seq_id": cseq,
                "p2p_seq_id": p2p_count,
                # torch's op_id counts every call on the group: collectives
                # and p2p calls so far
                "op_id": cseq + p2p_count,
                "profiling_name": f"nccl:{name}",
                "time_created_ns": self.wall(row["ts"]),
                "input_sizes": inputs,
                "input_dtypes": dtype * len(inputs),
                "output_sizes": outputs,
                "output_dtypes": dtype * len(outputs),
                "state": _state(row["state"], ended),
                "time_discovered_started_ns": self.wall(row["ts"])
                if row["state"] >= State.STARTED
                else None,
                "time_discovered_completed_ns": self.wall(row["end"]) if done and ended else None,
                "retired": ended,
                "timeout_ms": None,  # not recorded
                "is_p2p": is_p2p,
            }
        )
        st = self.status[comm]
        st["enq"] = seq
        if ended:
            st["done"] = seq
        if row["end"] > 0 and row["result"] > 0:
            self.errors.append(
                {
                    "group": group.name,
                    "seq": seq,
                    "p2p": is_p2p,
                    "result": row["result"],
                    "end_ns": self.wall(row["end"]),
                }
            )

    def doc(self) -> dict[str, Any]:
        proc = self.inc.procs[self.p]
        pg_config = {
            self.groups[c].name: {
                "name": self.groups[c].name,
                "desc": self.groups[c].desc,
                "ranks": _ranks_text(self.groups[c].ranks),
            }
            for c in sorted(self.pg_id, key=self.pg_id.__getitem__)
        }
        pg_status = {
            str(self.pg_id[c]): {
                "last_enqueued_collective": st["enq"],
                "last_started_collective": -1,
                "last_completed_collective": st["done"],
            }
            for c, st in sorted(self.status.items(), key=lambda kv: self.pg_id[kv[0]])
        }
        section = {
            "format": 1,
            "incident": self.inc.id,
            "host": proc.host,
            "pid": proc.pid or None,
            "window_complete": proc.window_complete,
            "exit_code": proc.exit_code,
            "exit_signal": proc.exit_signal,
            "exit_wall_ns": proc.exit_wall_ns,
            "comms": {
                self.groups[c].name: self.inc.comms[c].hash_text
                for c in sorted(self.pg_id, key=self.pg_id.__getitem__)
            },
            "errors": self.errors,
        }
        return {
            "version": VERSION,
            "pg_config": pg_config,
            "comm_lib_version": "",
            "pg_status": pg_status,
            "entries": self.entries,
            SECTION: section,
        }


def flight_recorder_docs(
    inc: Incident, p2p: bool = True
) -> tuple[dict[int, dict[str, Any]], list[str]]:
    """World rank -> its dump, and what could not be written; without
    ``p2p``, point-to-point calls are left out.  Each communicator is written
    from the window every member holds (``analyzer.frwindow``)."""
    groups = _groups(inc)
    left_out: list[str] = []
    rows = inc.calls.rows
    order = np.lexsort((rows["seq"], rows["ts"], rows["proc"]))
    written: dict[int, int] = {}  # proc -> world rank
    for p, proc in enumerate(inc.procs):
        if proc.world_rank < 0:
            left_out.append(
                f"{proc.label()}: its world rank is unknown (no rank_<world rank> file)"
            )
        elif proc.world_rank in written.values():
            left_out.append(f"{proc.label()}: a second process of world rank {proc.world_rank}")
        else:
            written[p] = proc.world_rank
    # torchfrtrace reads a trace from the latest first record_id of every
    # rank's, and drops the entries before it: every file starts at one, 1
    # where some rank's window is incomplete (its ring wrapped: where torch's
    # own files say so), 0 where none is
    first = 0 if all(inc.procs[p].window_complete for p in written) else 1
    by_proc = {p: _RankDoc(inc, p, groups, first) for p in written}
    fields = ("proc", "comm", "crank", "seq", "ts", "end", "count", "root", "op")
    arrays = {f: rows[f][order] for f in (*fields, "datatype", "state", "result")}
    win = window(inc, arrays, by_proc.keys())
    left_out += win.left_out
    cols = {f: v.tolist() for f, v in arrays.items()}
    keep, counts = win.keep.tolist(), win.p2p_count.tolist()
    unknown = 0
    for i in range(len(order)):
        row = {f: v[i] for f, v in cols.items()}
        doc = by_proc.get(row["proc"])
        if doc is None or not keep[i]:
            continue
        if row["op"] not in OP_NAMES:
            unknown += 1
            continue
        if not p2p and row["op"] in (Op.SEND, Op.RECV):
            continue
        doc.add(row, counts[i])
    if unknown:
        left_out.append(f"{unknown} call(s) of an op Flight Recorder has no name for")
    return {d.rank: d.doc() for d in by_proc.values()}, left_out


def export_flight_recorder(
    results: Sequence[IncidentResult], out: Path, json_form: bool = False, p2p: bool = True
) -> list[FrWritten]:
    """Each incident's files into ``out`` (one incident), or into
    ``out/<incident id>/`` (several); without ``p2p``, point-to-point calls
    are left out.  A file already there is refused, never rewritten; nothing
    is written then."""
    plans = []
    for r in results:
        folder = out if len(results) == 1 else out / _safe(r.incident.id)
        docs, left_out = flight_recorder_docs(r.incident, p2p)
        suffix = ".json" if json_form else ""
        files = {rank: folder / f"rank_{rank}{suffix}" for rank in docs}
        plans.append((r, folder, docs, files, left_out))
    there = [f for *_, files, _ in plans for f in files.values() if f.exists()]
    if there:
        raise UsageError(f"{there[0]}: already there (an export never rewrites a file)")
    written = []
    for r, folder, docs, files, left_out in plans:
        for rank, doc in docs.items():
            _write(files[rank], dumps_json(_json_form(doc)) if json_form else dumps(doc))
        written.append(
            FrWritten(
                r.incident.id,
                folder,
                tuple(files[k] for k in sorted(files)),
                tuple(sorted(docs)),
                sum(len(d["entries"]) for d in docs.values()),
                tuple(left_out),
            )
        )
    return written


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name) or "incident"


def _write(path: Path, data: bytes) -> None:
    """Atomically: a temporary file beside it, then renamed."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as exc:
        raise DumpWriteError(f"{path}: cannot write: {exc.strerror or exc}") from None


def _json_form(doc: dict[str, Any]) -> dict[str, Any]:
    """The JSON form torch writes: absent times 0, pg_status counters as
    strings, an empty nccl_comm_state."""
    entries = [
        {k: (0 if v is None and k.startswith("time_") else v) for k, v in e.items()}
        for e in doc["entries"]
    ]
    status = {k: {n: str(c) for n, c in v.items()} for k, v in doc["pg_status"].items()}
    return {**doc, "entries": entries, "pg_status": status, "nccl_comm_state": {}}

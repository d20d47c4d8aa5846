"""The communicator and process tables, kept apart from the rings.

A long job overwrites its oldest ring rows; it must never lose the id of a
communicator because the row of its init was overwritten.  The agent feeds
these tables, each tick, with the new rows of the small ``comm`` and ``exit``
rings and with the ``comms`` BPF map (which survives any ring), and they keep
what they learned for the life of the agent: destroyed communicators stay,
with their destroy time, and exited processes keep their exit code or signal.

Applying a row is idempotent: a row still in flight (state SCHEDULED) is
applied again once it completes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np

from stallwatch.dumpers.model import CommInfo, ProcessInfo
from stallwatch.dumpers.schema import ExitEvent, Op, State, decode_root_address

from .tickstate import CommProgress

_INITS = (Op.COMM_INIT_RANK, Op.COMM_INIT_RANK_CONFIG, Op.COMM_INIT_ALL)
_CLOSES = (Op.COMM_DESTROY, Op.COMM_ABORT, Op.COMM_FINALIZE)
_SIGKILL = 9
_Key = tuple[int, int, int]  # pid, comm pointer, comm hash


class CommRegistry:
    """(pid, ncclComm_t, id hash) -> CommInfo, from comm rows and the comms map."""

    def __init__(self) -> None:
        self._comms: dict[_Key, CommInfo] = {}
        self._roots: dict[int, str] = {}  # id hash -> decoded root (ncclGetUniqueId)
        self._done = 0  # comm ring positions below this are final
        self.pending = False  # rows still in flight: read the ring again

    @property
    def done(self) -> int:
        """Ring positions up to this one are applied for good."""
        return self._done

    def apply_rows(self, rows: np.ndarray) -> None:
        """New rows of the comm ring (oldest first)."""
        rows = rows[rows["pos"] > self._done]
        pending = rows["pos"][rows["state"] == State.SCHEDULED]
        for row in rows:
            if row["state"] != State.SCHEDULED and row["result"] == 0:
                self._apply(row)
        if len(rows):
            self._done = int(pending.min()) - 1 if len(pending) else int(rows["pos"].max())
        self.pending = bool(len(pending))

    def _apply(self, row: np.void) -> None:
        op, pid, comm = int(row["op"]), int(row["pid"]), int(row["comm"])
        if op == Op.GET_UNIQUE_ID:
            root = decode_root_address(bytes(row["unique_id"]))
            if root:
                self._roots[int(row["comm_hash"])] = root
        elif op in _CLOSES:
            self._close(pid, comm, int(row["ts_ns"]))
        elif comm and (op in _INITS or op == Op.COMM_SPLIT):
            self._add(row, op, pid, comm)

    def _add(self, row: np.void, op: int, pid: int, comm: int) -> None:
        h = int(row["comm_hash"])
        root = decode_root_address(bytes(row["unique_id"])) if op != Op.COMM_INIT_ALL else None
        split = op == Op.COMM_SPLIT
        self._comms[(pid, comm, h)] = CommInfo(
            pid=pid,
            comm=comm,
            comm_hash=h,
            rank=-1 if split else int(row["rank"]),
            nranks=-1 if split else int(row["nranks"]),
            parent_hash=int(row["parent_hash"]),
            color=int(row["color"]) if split else -1,
            key=int(row["key"]) if split else -1,
            root_addr=root or "",
            init_ns=int(row["end_ns"]) or int(row["ts_ns"]),
        )

    def _close(self, pid: int, comm: int, when: int) -> None:
        for key, info in self._comms.items():
            if key[0] == pid and key[1] == comm and not info.destroy_ns and info.init_ns <= when:
                self._comms[key] = dataclasses.replace(info, destroy_ns=when)

    def apply_progress(self, progress: Iterable[CommProgress], now_ns: int) -> None:
        """Communicators the map knows and the ring lost (or never carried).
        One made before the agent attached is kept with hash 0 and init 0:
        its id is unknown and its calls' seq count from the attach (the
        analyzer aligns them across ranks)."""
        for p in progress:
            key = (p.pid, p.comm, p.comm_hash)
            info = self._comms.get(key)
            if info is None:
                info = CommInfo(p.pid, p.comm, p.comm_hash, p.rank, p.nranks, init_ns=p.init_ns)
            if p.destroyed and not info.destroy_ns:
                info = dataclasses.replace(info, destroy_ns=now_ns)
            self._comms[key] = info

    def forget_pids(self, pids: Iterable[int]) -> None:
        drop = set(pids)
        self._comms = {k: v for k, v in self._comms.items() if k[0] not in drop}

    def infos(self) -> tuple[CommInfo, ...]:
        out = []
        for info in self._comms.values():
            if not info.root_addr and info.comm_hash in self._roots:
                info = dataclasses.replace(info, root_addr=self._roots[info.comm_hash])
            out.append(info)
        return tuple(sorted(out, key=lambda c: (c.pid, c.init_ns, c.comm)))


def _zapped(info: ProcessInfo, row: np.void) -> bool:
    """A SIGKILL to another thread once the process's fatal signal is known:
    the kernel ending the thread group, not the cause of the end (the BPF
    side drops these; this guards against their order in the ring)."""
    return (
        info.exit_signal is not None
        and int(row["signal"]) == _SIGKILL
        and int(row["tid"]) != int(row["pid"])
    )


class ProcessRegistry:
    """pid -> ProcessInfo for the processes in scope, exits included."""

    def __init__(self) -> None:
        self._procs: dict[int, ProcessInfo] = {}
        self._done = 0

    def add(self, info: ProcessInfo) -> None:
        old = self._procs.get(info.pid)
        if old is None or old.exit_ns or old.start_ns != info.start_ns:
            self._procs[info.pid] = info

    def get(self, pid: int) -> ProcessInfo | None:
        return self._procs.get(pid)

    @property
    def done(self) -> int:
        return self._done

    def apply_exit_rows(self, rows: np.ndarray) -> None:
        rows = rows[rows["pos"] > self._done]
        for row in rows:
            self._apply_exit(row)
        if len(rows):
            self._done = int(rows["pos"].max())

    def _apply_exit(self, row: np.void) -> None:
        pid = int(row["pid"])
        info = self._procs.get(pid) or ProcessInfo(pid, "", "", 0, 0, ())
        kind = int(row["event"])
        if kind == ExitEvent.EXIT_GROUP:
            # exit() after a handled signal: the code is what counts.
            info = dataclasses.replace(info, exit_code=int(row["code"]), exit_signal=None)
        elif kind == ExitEvent.SIGNAL and info.exit_code is None:
            if not _zapped(info, row):
                info = dataclasses.replace(info, exit_signal=int(row["signal"]))
        elif kind == ExitEvent.PROCESS_EXIT:
            info = dataclasses.replace(info, exit_ns=int(row["ts_ns"]))
        self._procs[pid] = info

    def mark_gone(self, pid: int, now_ns: int) -> None:
        info = self._procs.get(pid)
        if info is not None and not info.exit_ns:
            self._procs[pid] = dataclasses.replace(info, exit_ns=now_ns)

    def watched(self, now_ns: int, horizon_ns: int) -> bool:
        """Any process alive, or ended less than ``horizon_ns`` ago."""
        return any(not i.exit_ns or now_ns - i.exit_ns < horizon_ns for i in self._procs.values())

    def alive(self) -> list[int]:
        return [p for p, i in self._procs.items() if not i.exit_ns]

    def infos(self) -> tuple[ProcessInfo, ...]:
        return tuple(sorted(self._procs.values(), key=lambda p: p.pid))

"""The ``snapshots`` section of a dump (format version 3): thread positions
(``dumpers.readings``) as msgpack, and their validating reader.

Layout, every key required, no other allowed::

    "snapshots": [{"taken_ns": u64, "took_ns": u64, "reason": str, "python_tool": str,
                   "processes": [{"pid": u32, "taken_ns": u64, "took_ns": u64,
                                  "env": [[name, value], ...], "error": str,
                                  "threads": [THREAD, ...]}, ...]}, ...]
    THREAD = {"tid": u32, "name": str, "state": str, "wchan": str, "syscall": i64,
              "syscall_args": [u64 x 0 or 6], "sp": u64, "pc": u64, "frames": [str],
              "unwind": str, "python": [str], "nccl": null | CALL}
    CALL = {"symbol": str, "lib": str, "args_from": "none" | "frame", "comm": u64,
            "count": i64, "datatype": i32, "redop": i32, "root": i32,
            "sendbuff": u64, "recvbuff": u64}
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .readings import ArgsFrom, NcclCall, ProcessThreads, ThreadReading, ThreadState

if TYPE_CHECKING:
    from .format import _Checker

U32 = (0, 2**32 - 1)
U64 = (0, 2**64 - 1)
I32 = (-(2**31), 2**31 - 1)
I64 = (-(2**63), 2**63 - 1)

_SNAPSHOT_KEYS = ("taken_ns", "took_ns", "reason", "python_tool", "processes")
_PROCESS_KEYS = ("pid", "taken_ns", "took_ns", "env", "error", "threads")
_THREAD_KEYS = tuple(ThreadState.__dataclass_fields__)
_CALL_KEYS = tuple(NcclCall.__dataclass_fields__)


def snapshots_doc(snaps: tuple[ThreadReading, ...]) -> list[dict[str, object]]:
    return [
        {
            "taken_ns": s.taken_ns,
            "took_ns": s.took_ns,
            "reason": s.reason,
            "python_tool": s.python_tool,
            "processes": [_process_doc(p) for p in s.processes],
        }
        for s in snaps
    ]


def _process_doc(p: ProcessThreads) -> dict[str, object]:
    return {
        "pid": p.pid,
        "taken_ns": p.taken_ns,
        "took_ns": p.took_ns,
        "env": [list(kv) for kv in p.env],
        "error": p.error,
        "threads": [_thread_doc(t) for t in p.threads],
    }


def _thread_doc(t: ThreadState) -> dict[str, object]:
    return {
        "tid": t.tid,
        "name": t.name,
        "state": t.state,
        "wchan": t.wchan,
        "syscall": t.syscall,
        "syscall_args": list(t.syscall_args),
        "sp": t.sp,
        "pc": t.pc,
        "frames": list(t.frames),
        "unwind": t.unwind,
        "nccl": None if t.nccl is None else _call_doc(t.nccl),
        "python": list(t.python),
    }


def _call_doc(c: NcclCall) -> dict[str, object]:
    return {
        "symbol": c.symbol,
        "lib": c.lib,
        "args_from": c.args_from.value,
        "comm": c.comm,
        "count": c.count,
        "datatype": c.datatype,
        "redop": c.redop,
        "root": c.root,
        "sendbuff": c.sendbuff,
        "recvbuff": c.recvbuff,
    }


# ---------------------------------------------------------------- reading


def read_snapshots(obj: object, c: _Checker) -> tuple[ThreadReading, ...]:
    items = c.array(obj, "snapshots")
    return tuple(_read_snapshot(s, f"snapshots[{i}]", c) for i, s in enumerate(items))


def _read_snapshot(obj: object, path: str, c: _Checker) -> ThreadReading:
    s = c.map(obj, path, _SNAPSHOT_KEYS)
    procs = c.array(s["processes"], f"{path}.processes")
    return ThreadReading(
        taken_ns=c.integer(s["taken_ns"], f"{path}.taken_ns"),
        took_ns=c.integer(s["took_ns"], f"{path}.took_ns"),
        reason=c.string(s["reason"], f"{path}.reason"),
        processes=tuple(_read_process(p, f"{path}.processes[{i}]", c) for i, p in enumerate(procs)),
        python_tool=c.string(s["python_tool"], f"{path}.python_tool"),
    )


def _read_process(obj: object, path: str, c: _Checker) -> ProcessThreads:
    p = c.map(obj, path, _PROCESS_KEYS)
    env = []
    for i, kv in enumerate(c.array(p["env"], f"{path}.env")):
        pair = c.strings(kv, f"{path}.env[{i}]")
        if len(pair) != 2:
            c.fail(f"{path}.env[{i}]", f"expected [name, value], found {len(pair)} strings")
        env.append((pair[0], pair[1]))
    threads = c.array(p["threads"], f"{path}.threads")
    return ProcessThreads(
        pid=c.integer(p["pid"], f"{path}.pid", U32),
        taken_ns=c.integer(p["taken_ns"], f"{path}.taken_ns"),
        took_ns=c.integer(p["took_ns"], f"{path}.took_ns"),
        env=tuple(env),
        threads=tuple(_read_thread(t, f"{path}.threads[{i}]", c) for i, t in enumerate(threads)),
        error=c.string(p["error"], f"{path}.error"),
    )


def _read_thread(obj: object, path: str, c: _Checker) -> ThreadState:
    t = c.map(obj, path, _THREAD_KEYS)
    args = c.array(t["syscall_args"], f"{path}.syscall_args")
    if len(args) not in (0, 6):
        c.fail(f"{path}.syscall_args", f"expected 0 or 6 arguments, found {len(args)}")
    return ThreadState(
        tid=c.integer(t["tid"], f"{path}.tid", U32),
        name=c.string(t["name"], f"{path}.name"),
        state=c.string(t["state"], f"{path}.state"),
        wchan=c.string(t["wchan"], f"{path}.wchan"),
        syscall=c.integer(t["syscall"], f"{path}.syscall", I64),
        syscall_args=tuple(c.integer(a, f"{path}.syscall_args[{i}]") for i, a in enumerate(args)),
        sp=c.integer(t["sp"], f"{path}.sp"),
        pc=c.integer(t["pc"], f"{path}.pc"),
        frames=c.strings(t["frames"], f"{path}.frames"),
        unwind=c.string(t["unwind"], f"{path}.unwind"),
        nccl=None if t["nccl"] is None else _read_call(t["nccl"], f"{path}.nccl", c),
        python=c.strings(t["python"], f"{path}.python"),
    )


def _read_call(obj: object, path: str, c: _Checker) -> NcclCall:
    m = c.map(obj, path, _CALL_KEYS)
    how = c.string(m["args_from"], f"{path}.args_from")
    try:
        args_from = ArgsFrom(how)
    except ValueError:
        c.fail(f"{path}.args_from", f"unknown value {how[:40]!r}")
    return NcclCall(
        symbol=c.string(m["symbol"], f"{path}.symbol"),
        lib=c.string(m["lib"], f"{path}.lib"),
        args_from=args_from,
        comm=c.integer(m["comm"], f"{path}.comm"),
        count=c.integer(m["count"], f"{path}.count", I64),
        datatype=c.integer(m["datatype"], f"{path}.datatype", I32),
        redop=c.integer(m["redop"], f"{path}.redop", I32),
        root=c.integer(m["root"], f"{path}.root", I32),
        sendbuff=c.integer(m["sendbuff"], f"{path}.sendbuff"),
        recvbuff=c.integer(m["recvbuff"], f"{path}.recvbuff"),
    )

"""Flight Recorder dumps in the formats torch writes after 2.13, built from
the recorder's public source (see README.md beside this file for the source
each follows); the bytes are torch's pickler's (``analyzer.frwrite``).

    python tests/data/fr-versions/generate.py

A small simulation of what each rank's recorders hold: the calls a job makes,
in order, each recorded the way the recorder of that version records it
(sequence counters, op ids, profiling names, sizes, state, retired, times,
pg_config, pg_status), then dumped.  Every job has 4 ranks; one stops for
good before a given call (``hang``) and the others wait in that call, or
every rank runs to the end.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))

from stallwatch.analyzer.frwrite import dumps, dumps_json  # noqa: E402

WORLD = 4
T0 = 1_790_000_000_000_000_000  # ns, wall clock of the first call
STEP_NS = 2_000_000
WORLD_RANKS = str(list(range(WORLD)))


@dataclass
class Recorder:
    """One FlightRecorder<c10::Event> instance of one rank."""

    entries: list[dict[str, Any]] = field(default_factory=list)
    pg_config: dict[str, dict[str, str]] = field(default_factory=dict)
    pg_status: dict[int, dict[str, int]] = field(default_factory=dict)

    def record(self, pg_id: int, group: tuple[str, str], **e: Any) -> dict[str, Any]:
        """An entry with torch's keys in torch's order (FlightRecorder's
        getCollectiveTrace), without stacks."""
        entry = {
            "record_id": len(self.entries),
            "pg_id": pg_id,
            "process_group": group,
            "thread_name": "pt_main_thread",
            "thread_id": "140173624043328",
            "collective_seq_id": e["cseq"],
            "p2p_seq_id": e["pseq"],
            "op_id": e["op_id"],
            "profiling_name": e["name"],
            "time_created_ns": e["t"],
            "input_sizes": e["inputs"],
            "input_dtypes": ["Float"] * len(e["inputs"]),
            "output_sizes": e["outputs"],
            "output_dtypes": ["Float"] * len(e["outputs"]),
            "state": "scheduled",
            "time_discovered_started_ns": None,
            "time_discovered_completed_ns": None,
            "retired": False,
            "timeout_ms": 600000,
            "is_p2p": e["p2p"],
        }
        self.entries.append(entry)
        return entry

    def doc(self) -> dict[str, Any]:
        status = {
            str(k): {
                "last_enqueued_collective": v["enq"],
                "last_started_collective": -1,
                "last_completed_collective": v["done"],
            }
            for k, v in sorted(self.pg_status.items())
        }
        return {
            "version": "2.10",
            "pg_config": dict(sorted(self.pg_config.items())),
            "comm_lib_version": "",
            "pg_status": status,
            "entries": self.entries,
        }


@dataclass(frozen=True)
class Call:
    """One call a rank makes: on which device's backend, what."""

    device: str  # "cpu" (gloo) or "cuda" (the hooked backend)
    op: str  # the dispatcher op: all_reduce, _all_gather_base, send, recv
    size: int
    peer: int = -1  # send/recv: the group rank of the other end


def steps(n: int, rank: int, p2p: bool) -> list[list[Call]]:
    """The job: each step a CPU all_reduce, then on CUDA an all_reduce, an
    all_gather into one tensor and (``p2p``) a ring of send/recv."""
    out = []
    for _ in range(n):
        step = [Call("cpu", "all_reduce", 8), Call("cuda", "all_reduce", 1024)]
        step.append(Call("cuda", "_all_gather_base", 256))
        if p2p:
            nxt, prev = (rank + 1) % WORLD, (rank - 1) % WORLD
            first, second = (
                (Call("cuda", "send", 64, nxt), Call("cuda", "recv", 64, prev))
                if rank % 2 == 0
                else (Call("cuda", "recv", 64, prev), Call("cuda", "send", 64, nxt))
            )
            step += [first, second]
        out.append(step)
    return out


def sizes(call: Call) -> tuple[list[list[int]], list[list[int]]]:
    """Input and output sizes as the hook sees them (the dispatcher's
    tensors; all_reduce in place)."""
    if call.op == "_all_gather_base":
        return [[call.size]], [[call.size * WORLD]]
    if call.op == "send":
        return [[call.size]], []
    if call.op == "recv":
        return [], [[call.size]]
    return [[call.size]], [[call.size]]


@dataclass
class Rank:
    """A rank's counters: the group's op ids (Ops.cpp, one per op it
    dispatches), gloo's own sequence, and the hook's two sequences."""

    rank: int
    op_id: int = 0
    gloo_seq: int = 0
    hook_cseq: int = 0
    hook_pseq: int = 0


# --- torch 2.14: the hook as first merged ----------------------------------


def v214(r: Rank, rec: Recorder, call: Call, t: int) -> list[dict[str, Any]]:
    """PR #189363 (hooks/FlightRecorderHook.cpp at commit 75f5d4b87e56): the
    hook records every op of the group into the process-wide recorder, gloo's
    too, as "c10d:<op>" with its own names (allreduce, allgather) and no peer
    in p2p names; sizes as dispatched (an in-place op has no outputs); the
    post-hook retires the entry as soon as the op is issued.  gloo still
    records its own ops there natively, with its own sequence."""
    r.op_id += 1
    p2p = call.op in ("send", "recv")
    if p2p:
        r.hook_pseq += 1
    else:
        r.hook_cseq += 1
    inputs, outputs = sizes(call)
    if call.op == "all_reduce":
        outputs = []
    name = {"all_reduce": "allreduce", "_all_gather_base": "allgather"}.get(call.op, call.op)
    hook = rec.record(
        0,
        ("0", "default_pg"),
        cseq=r.hook_cseq,
        pseq=r.hook_pseq,
        op_id=r.op_id,
        name=f"c10d:{name}",
        t=t,
        inputs=inputs,
        outputs=outputs,
        p2p=p2p,
    )
    rec.pg_status.setdefault(0, {"enq": 0, "done": 0})["enq"] = r.op_id
    out = [hook]
    if call.device == "cpu":
        r.gloo_seq += 1
        out.append(
            rec.record(
                0,
                ("0", "default_pg"),
                cseq=r.gloo_seq,
                pseq=0,
                op_id=r.gloo_seq,
                name=f"gloo:{call.op}",
                t=t + 1000,
                inputs=[[call.size]],
                outputs=[[call.size]],
                p2p=False,
            )
        )
    return out


def v214_issued(r: Rank, rec: Recorder, recorded: list[dict[str, Any]]) -> None:
    """The post-hook: the op was issued (a CUDA op returns at once, a gloo
    one as a Work the caller then waits on)."""
    recorded[0]["retired"] = True
    rec.pg_status[0]["done"] = recorded[0]["op_id"]


# --- after torch 2.15: one recorder per backend ------------------------------


def v216(
    r: Rank, recs: dict[str, Recorder], call: Call, t: int, backend: str
) -> list[dict[str, Any]]:
    """PR #192233 with #192858 (hooks/FlightRecorderHook.cpp on main after
    2.15): a backend that records natively (gloo) keeps its own entries and
    the hook skips its ops; every other backend's ops go to that backend's
    own recorder instance as "<backend>:<dispatcher op>", p2p names with
    group ranks; in-place ops mirror their inputs as outputs."""
    r.op_id += 1
    if call.device == "cpu":
        r.gloo_seq += 1
        return [
            recs["gloo"].record(
                0,
                ("0", "default_pg"),
                cseq=r.gloo_seq,
                pseq=0,
                op_id=r.gloo_seq,
                name=f"gloo:{call.op}",
                t=t,
                inputs=[[call.size]],
                outputs=[[call.size]],
                p2p=False,
            )
        ]
    p2p = call.op in ("send", "recv")
    if p2p:
        r.hook_pseq += 1
    else:
        r.hook_cseq += 1
    inputs, outputs = sizes(call)
    name = call.op
    if p2p:
        arrow = "->" if call.op == "send" else "<-"
        name = f"{call.op} {r.rank}{arrow}{call.peer}"
    rec = recs[backend]
    entry = rec.record(
        0,
        ("0", "default_pg"),
        cseq=r.hook_cseq,
        pseq=r.hook_pseq,
        op_id=r.op_id,
        name=f"{backend}:{name}",
        t=t,
        inputs=inputs,
        outputs=outputs,
        p2p=p2p,
    )
    rec.pg_status.setdefault(0, {"enq": 0, "done": 0})["enq"] = r.op_id
    return [entry]


def complete(entry: dict[str, Any], t: int) -> None:
    """The backend pushed the op's completion (nccl2 has completion hooks;
    gloo retires a work that ended)."""
    if not entry["profiling_name"].startswith("gloo:"):
        entry["state"] = "completed"
        entry["time_discovered_started_ns"] = t + 200_000
        entry["time_discovered_completed_ns"] = t + 800_000
    entry["retired"] = True


# --- the jobs ----------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    name: str
    text: str  # what the job does, for expected.json
    source: str  # the recorder source it follows
    hang: tuple[int, int, int] | None  # (rank, step, call index) it stops before
    run: Callable[[Job], dict[str, dict[int, Recorder]]]  # file prefix -> rank -> recorder
    verdict: dict[str, Any]
    steps: int = 6
    p2p: bool = False


def _stopped(job: Job, rank: int, step: int, i: int) -> bool:
    return (
        job.hang is not None
        and (rank, step, i) >= (job.hang[0], job.hang[1], job.hang[2])
        and (rank == job.hang[0])
    )


def _blocked(job: Job, step: int, i: int) -> bool:
    """Whether a call at (step, i) can complete: not once the stopped rank
    never entered the collective it waits in, nor anything after it."""
    return job.hang is not None and (step, i) >= (job.hang[1], job.hang[2])


def _run_214(job: Job) -> dict[str, dict[int, Recorder]]:
    out: dict[int, Recorder] = {}
    for rank in range(WORLD):
        r, rec = Rank(rank), Recorder()
        rec.pg_config[""] = {"name": "", "desc": "", "ranks": WORLD_RANKS}  # gloo's
        rec.pg_config["0"] = {"name": "0", "desc": "default_pg", "ranks": WORLD_RANKS}
        for s, calls in enumerate(steps(job.steps, rank, job.p2p)):
            for i, call in enumerate(calls):
                if _stopped(job, rank, s, i):
                    break
                t = T0 + (s * 10 + i) * STEP_NS
                recorded = v214(r, rec, call, t)
                v214_issued(r, rec, recorded)
                if len(recorded) == 2 and not _blocked(job, s, i):
                    complete(recorded[1], t)  # gloo's own entry: the work ended
                if call.device == "cpu" and _blocked(job, s, i):
                    break  # the caller waits in it for good
            else:
                continue
            break
        out[rank] = rec
    return {"nccl_trace_rank_": out}


def _run_216(job: Job, backend: str, completes: bool) -> dict[str, dict[int, Recorder]]:
    files: dict[str, dict[int, Recorder]] = {"gloo_trace_rank_": {}, f"{backend}_trace_rank_": {}}
    for rank in range(WORLD):
        r = Rank(rank)
        recs = {"gloo": Recorder(), backend: Recorder()}
        recs["gloo"].pg_config[""] = {"name": "", "desc": "", "ranks": WORLD_RANKS}
        recs[backend].pg_config["0"] = {"name": "0", "desc": "default_pg", "ranks": WORLD_RANKS}
        done = False
        for s, calls in enumerate(steps(job.steps, rank, job.p2p)):
            for i, call in enumerate(calls):
                if _stopped(job, rank, s, i):
                    done = True
                    break
                t = T0 + (s * 10 + i) * STEP_NS
                (entry,) = v216(r, recs, call, t, backend)
                blocked = _blocked(job, s, i)
                if call.device == "cpu":
                    status = recs["gloo"].pg_status.setdefault(0, {"enq": 0, "done": 0})
                    status["enq"] = entry["op_id"]
                    if blocked:
                        done = True  # the caller waits in it for good
                        break
                    complete(entry, t)
                    status["done"] = entry["op_id"]
                elif completes and not blocked:
                    complete(entry, t)
                    recs[backend].pg_status[0]["done"] = entry["op_id"]
                elif not completes:
                    # retired when issued (the op returns at once on a device
                    # stream): no completion will ever come
                    entry["retired"] = True
                    recs[backend].pg_status[0]["done"] = entry["op_id"]
            if done:
                break
        files["gloo_trace_rank_"][rank] = recs["gloo"]
        files[f"{backend}_trace_rank_"][rank] = recs[backend]
    return files


# --- torch 2.15: the hook's recorder, dumped once from the abort hook ---------


@dataclass(frozen=True)
class Op215:
    """One op a rank dispatches: its group, the dispatcher op, its size, and
    whether it is issued under a CUDA graph capture."""

    group: str
    op: str
    size: int
    captured: bool = False


@dataclass(frozen=True)
class Job215:
    """A 4-rank job on "nccl" (nccl2 by default in torch 2.15): its groups,
    each rank's steps, which op blocks for good on which rank (it never
    completes: its peers wait for a rank that never issued it, or it
    errored), and whether the dumps are asked for at the end (a healthy job:
    the abort hook writes none)."""

    name: str
    text: str
    groups: dict[str, tuple[int, ...]]  # name -> world ranks, in creation order
    steps: Callable[[int, int], list[Op215]]  # (rank, step) -> its ops
    nsteps: int
    stop: dict[int, tuple[int, int]]  # rank -> (step, op index) it stops before, for good
    blocks: Callable[[int, int, Op215], bool]  # (rank, step, op): it never completes
    verdict: dict[str, Any]
    on_demand: bool = False  # dumped at the end through the API, not by an abort


TIMEOUT_NS = 600_000_000_000  # the default collective timeout (10 min)
SOURCE_215 = (
    "torch 2.15: hooks/FlightRecorderHook.cpp at commit 04f962648a58 and "
    "FlightRecorderDetail.hpp at commit 1189309e9a32 (retire_completed)"
)


def _run_215(job: Job215) -> dict[str, dict[int, Recorder]]:
    """Each rank's nccl2 recorder, as the hook fills it: an entry per op it
    dispatches but under a graph capture (which advances neither sequence;
    the group's op_id counts it), "nccl2:<op>", sizes mirrored for in-place
    ops, no CUDA events (an entry is "scheduled" until the backend pushes
    its completion, then "completed", its started time the completion's,
    and retired); an op that failed or timed out stays unretired.  A rank
    dumps once, when its first blocked op times out (the abort hook), only
    what it recorded before; a rank that never blocks in an op never aborts
    and leaves no file."""
    out: dict[int, Recorder] = {}
    for rank in range(WORLD):
        rec = Recorder()
        mine = [g for g, ranks in job.groups.items() if rank in ranks]
        pg_id = {g: i for i, g in enumerate(mine)}
        for g in mine:
            desc = "default_pg" if g == "0" else "undefined"
            rec.pg_config[g] = {"name": g, "desc": desc, "ranks": str(list(job.groups[g]))}
        cseq, pseq, op_ids = dict.fromkeys(mine, 0), dict.fromkeys(mine, 0), dict.fromkeys(mine, 0)
        t = T0
        aborted_at: int | None = None
        for step in range(job.nsteps):
            for i, op in enumerate(job.steps(rank, step)):
                if (step, i) >= job.stop.get(rank, (job.nsteps, 0)):
                    break
                t += STEP_NS
                op_ids[op.group] += 1
                if op.captured:
                    continue  # not recorded: it runs at replay
                p2p = op.op in ("send", "recv")
                if p2p:
                    pseq[op.group] += 1
                else:
                    cseq[op.group] += 1
                inputs, outputs = [[op.size]], [[op.size]]
                if op.op == "_all_gather_base":
                    outputs = [[op.size * len(job.groups[op.group])]]
                entry = rec.record(
                    pg_id[op.group],
                    (op.group, rec.pg_config[op.group]["desc"]),
                    cseq=cseq[op.group],
                    pseq=pseq[op.group],
                    op_id=op_ids[op.group],
                    name=f"nccl2:{op.op}",
                    t=t,
                    inputs=inputs,
                    outputs=outputs,
                    p2p=p2p,
                )
                status = rec.pg_status.setdefault(pg_id[op.group], {"enq": -1, "done": -1})
                status["enq"] = op_ids[op.group]
                if job.blocks(rank, step, op):
                    aborted_at = t + TIMEOUT_NS if aborted_at is None else aborted_at
                    continue  # the host goes on to its step's end, then waits
                done = t + STEP_NS // 2
                entry["state"] = "completed"
                entry["time_discovered_started_ns"] = done
                entry["time_discovered_completed_ns"] = done
                entry["retired"] = True
                status["done"] = op_ids[op.group]
            if aborted_at is not None or (rank in job.stop and step >= job.stop[rank][0]):
                break  # its host waits for the step for good
        if aborted_at is not None or job.on_demand:
            out[rank] = rec
    return {"nccl_trace_rank_": out}


def _world_step(rank: int, step: int) -> list[Op215]:
    return [Op215("0", "all_reduce", 1024), Op215("0", "_all_gather_base", 256)]


def _after(job_stop: tuple[int, int]) -> Callable[[int, int, Op215], bool]:
    """Ops from (step, op index) on never complete (a peer never issued
    them, and everything queued behind them waits)."""

    def blocks(rank: int, step: int, op: Op215) -> bool:
        return step >= job_stop[0]

    return blocks


def _pairs_step(rank: int, step: int) -> list[Op215]:
    return [Op215("0", "all_reduce", 1024), Op215("1" if rank < 2 else "2", "all_reduce", 64)]


def _pairs_blocks(rank: int, step: int, op: Op215) -> bool:
    """Rank 3 stops before its pair's 3rd all_reduce: rank 2 waits in it,
    ranks 0 and 1 in the world's 4th."""
    return (op.group == "2" and step >= 2) or (op.group == "0" and step >= 3)


def _graph_step(rank: int, step: int) -> list[Op215]:
    """Two eager warm-up steps, then each step's all_reduce and all_gather
    captured once (step 2) into a graph replayed after (no op dispatched),
    then an eager all_reduce of the loss."""
    if step < 2:
        return _world_step(rank, step)
    captured = step == 2
    ops = [Op215("0", "all_reduce", 1024, True), Op215("0", "_all_gather_base", 256, True)]
    return [*(ops if captured else []), Op215("0", "all_reduce", 1)]


JOBS_215 = [
    Job215(
        "synthetic-hook215-nccl2-hang",
        "a world group on 'nccl' (nccl2): each step an all_reduce and an all_gather, then "
        "a host sync; rank 2 stops before the 4th step; the others time out in it and each "
        "dumps once, from the abort hook; rank 2 never aborts and leaves no file",
        {"0": (0, 1, 2, 3)},
        _world_step,
        6,
        {2: (3, 0)},
        _after((3, 0)),
        {"kind": "inconclusive", "ranks": [2]},
    ),
    Job215(
        "synthetic-hook215-nccl2-error",
        "the same job; rank 1's all_reduce of the 3rd step fails (an NCCL error: its work "
        "ends unsuccessful and stays unretired), its backend aborts and it dumps at once; "
        "its peers time out in the same all_reduce and dump later: every file stands "
        "there, no rank departs",
        {"0": (0, 1, 2, 3)},
        _world_step,
        6,
        {},
        _after((2, 0)),
        {"kind": "inconclusive", "ranks": []},
    ),
    Job215(
        "synthetic-hook215-nccl2-groups-hang",
        "a world group and pairs (0, 1) and (2, 3), each a pg_id of the hook's own "
        "counter: each step a world all_reduce, then the pair's; rank 3 stops before its "
        "pair's 3rd; rank 2 times out there first and dumps, ranks 0 and 1 later in the "
        "world's 4th; rank 3 leaves no file",
        {"0": (0, 1, 2, 3), "1": (0, 1), "2": (2, 3)},
        _pairs_step,
        6,
        {3: (2, 1)},
        _pairs_blocks,
        {"kind": "inconclusive", "ranks": [3]},
    ),
    Job215(
        "synthetic-hook215-nccl2-graphs-hang",
        "a world group: two eager steps, then each step's all_reduce and all_gather "
        "captured in a CUDA graph (not recorded: no entry, no seq; op_id counts them) "
        "and replayed, and an eager all_reduce of the loss; rank 2 stops before the 5th "
        "step's replay; the others' eager all_reduce waits behind theirs and times out",
        {"0": (0, 1, 2, 3)},
        _graph_step,
        8,
        {2: (4, 0)},
        _after((4, 0)),
        {"kind": "inconclusive", "ranks": [2]},
    ),
    Job215(
        "synthetic-hook215-nccl2-graphs-healthy",
        "the same job to its end, every rank's recorder dumped at the end through the API "
        "(no abort)",
        {"0": (0, 1, 2, 3)},
        _graph_step,
        8,
        {},
        lambda rank, step, op: False,
        {"kind": "healthy", "ranks": []},
        on_demand=True,
    ),
]


JOBS = [
    Job(
        "hook214-mixed-hang",
        "a 'cpu:gloo,cuda:nccl2' world group, the hook attached: each step a CPU "
        "all_reduce (gloo) then a CUDA all_reduce and all_gather (nccl2); rank 2 "
        "stops before the 4th step's CUDA all_reduce",
        "torch 2.14: PR #189363, hooks/FlightRecorderHook.cpp at commit 75f5d4b87e56",
        (2, 3, 1),
        _run_214,
        {"kind": "missing_rank", "ranks": [2]},
    ),
    Job(
        "hook214-mixed-healthy",
        "the same job, every rank to the end",
        "torch 2.14: PR #189363, hooks/FlightRecorderHook.cpp at commit 75f5d4b87e56",
        None,
        _run_214,
        {"kind": "healthy", "ranks": []},
    ),
    Job(
        "hook216-nccl2-hang",
        "a 'cpu:gloo,cuda:nccl2' world group: each step a CPU all_reduce (gloo), then "
        "on CUDA an all_reduce, an all_gather and a ring of send/recv (nccl2); rank 2 "
        "stops before the 4th step's CUDA all_reduce; each rank dumps gloo's recorder "
        "and nccl2's into two files",
        "after torch 2.15: PRs #192233 and #192858 (per-backend recorders, completion hooks)",
        (2, 3, 1),
        lambda j: _run_216(j, "nccl2", completes=True),
        {"kind": "missing_rank", "ranks": [2]},
        p2p=True,
    ),
    Job(
        "hook216-nccl2-healthy",
        "the same job, every rank to the end",
        "after torch 2.15: PRs #192233 and #192858 (per-backend recorders, completion hooks)",
        None,
        lambda j: _run_216(j, "nccl2", completes=True),
        {"kind": "healthy", "ranks": []},
        p2p=True,
    ),
    Job(
        "hook216-custom-hang",
        "the same job on 'cpu:gloo,cuda:mycomm', a backend with no completion hooks "
        "(the hook retires each entry when its op is issued); rank 1 stops before the "
        "3rd step's CUDA all_reduce",
        "after torch 2.15: PRs #192233 and #192858 (retired at issue, no completion)",
        (1, 2, 1),
        lambda j: _run_216(j, "mycomm", completes=False),
        {"kind": "missing_rank", "ranks": [1]},
    ),
]


def main() -> int:
    for job in JOBS:
        stopped = None if job.hang is None else job.hang[0]
        _write(job.name, job.run(job), job.text, job.source, stopped, job.verdict)
    for j in JOBS_215:
        stopped = next(iter(j.stop), None)
        _write(j.name, _run_215(j), j.text, SOURCE_215, stopped, j.verdict)
    return 0


def _write(
    name: str,
    files: dict[str, dict[int, Recorder]],
    text: str,
    source: str,
    stopped: int | None,
    verdict: dict[str, Any],
) -> None:
    out = HERE / f"{name}-{WORLD}"
    shutil.rmtree(out, ignore_errors=True)
    (out / "pickle").mkdir(parents=True)
    (out / "json").mkdir()
    for prefix, ranks in files.items():
        for rank, rec in ranks.items():
            doc = rec.doc()
            (out / "pickle" / f"{prefix}{rank}").write_bytes(dumps(doc))
            (out / "json" / f"{prefix}{rank}.json").write_bytes(dumps_json(_json(doc)))
    expected = {"job": text, "source": source, "world": WORLD, "stopped": stopped}
    (out / "expected.json").write_text(
        json.dumps({**expected, "verdict": verdict}, indent=2) + "\n"
    )
    print(f"wrote {out.name}")


def _json(doc: dict[str, Any]) -> dict[str, Any]:
    """The JSON form (dump_json): absent times are 0, pg_status counters
    strings."""
    entries = [
        {k: (0 if v is None and k.startswith("time_") else v) for k, v in e.items()}
        for e in doc["entries"]
    ]
    status = {k: {n: str(c) for n, c in v.items()} for k, v in doc["pg_status"].items()}
    return {**doc, "entries": entries, "pg_status": status, "nccl_comm_state": {}}


if __name__ == "__main__":
    sys.exit(main())

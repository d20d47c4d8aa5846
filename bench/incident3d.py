"""Synthetic incidents shaped like a large 3-D parallel training job.

A job of ``nranks`` ranks on hosts of 8 runs tensor, pipeline and data
parallelism (Megatron's layout, tensor-parallel rank fastest):

- tensor parallel (TP): the 8 ranks of a host; per layer and microbatch an
  ALL_GATHER and a REDUCE_SCATTER of activations (sequence parallel), twice
  (attention, MLP), forward and backward;
- pipeline parallel (PP): ``pp`` stages, host ``stage * dp + d``; each
  microbatch's activations go forward by SEND/RECV to the next stage and its
  gradients back to the previous one, on the pipeline's communicator;
- data parallel (DP): the ranks of one stage and tensor-parallel index on
  every pipeline (across hosts); at the end of each step REDUCE_SCATTER of
  the gradients and ALL_GATHER of the parameters in buckets (a distributed
  optimizer), and an ALL_REDUCE of the loss;
- and the world communicator (ranks in it, no calls in the window).

Each rank is a member of four communicators; every host's dump lists them
all.  Sizes are those of a 8k-hidden model in bf16 (gradients in fp32).

Time: blocking calls.  A rank enters its next call a gap (plus jitter) after
its last one returned; a collective returns when its last member has entered
plus a transfer time; a point-to-point call after its transfer time (stages
are not held up by their neighbours: the analyzer does not judge p2p timing).
Steps start together on every host.

Faults, one per incident:
- ``hang``: one rank (mid-pipeline) never enters a TP collective of the
  forward pass.  Its host's other ranks wait in that collective; the other
  stages of its pipeline wait in their next SEND/RECV after the hang; every
  other host finishes its step and waits in the first DP REDUCE_SCATTER.
  The agents dump 30 s later.  Truth: ``missing_rank`` naming that rank.
- ``straggler``: one rank computes ``SLOW_MS`` longer before each TP
  collective, every step; its host's peers wait for it.  Truth:
  ``compute_straggler`` naming that rank.

Each rank's ring holds its latest ``calls`` calls (older ones overwritten and
counted, as an agent's ring does).  Every host's dump is written in the
dump format, fully (no sparse or shortened files): ``write_incident``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stallwatch.dumpers.format import dump_file_name, encode
from stallwatch.dumpers.model import (
    FORMAT_VERSION,
    Clock,
    CommInfo,
    ProcessInfo,
    Recording,
    Ring,
    Trigger,
    TriggerKind,
)
from stallwatch.dumpers.schema import NCCL_EVENT, DataType, Op, RedOp, State

GENERATOR_VERSION = 2  # bump when the incidents change: cached ones are made anew
MS = 1_000_000
TP = 8
TP_KIND, PP_KIND, DP_KIND = 0, 1, 2
GAP_NS = 2 * MS  # compute between two calls
JITTER_NS = 500_000
XFER_NS = {TP_KIND: 1 * MS, PP_KIND: 1 * MS, DP_KIND: 3 * MS}
SLOW_MS = 12  # the straggler's extra compute before each TP collective
DUMP_AFTER_NS = 30_000 * MS  # the stall timeout: agents dump this long after the hang
T0 = 10**12  # monotonic time of the first step
WALL0 = 1_790_000_000 * 10**9

WORLD_HASH = 0xD000_0000_0000_0001
TP_BASE, PP_BASE, DP_BASE = 0xA << 60, 0xB << 60, 0xC << 60


@dataclass(frozen=True, slots=True)
class Shape:
    nranks: int
    calls: int = 2000  # per rank, in its ring
    fault: str = "hang"  # or "straggler"
    pp: int = 8
    microbatches: int = 4
    layers: int = 2  # per stage
    buckets: int = 4

    @property
    def hosts(self) -> int:
        return self.nranks // TP

    @property
    def dp(self) -> int:
        return self.nranks // (TP * self.pp)

    @property
    def culprit(self) -> int:
        """The rank the fault is injected into: mid-pipeline, a third of the
        way through the data-parallel replicas, tensor-parallel index 5."""
        return ((self.pp // 2) * self.dp + self.dp // 3) * TP + 5

    @property
    def key(self) -> str:
        return (
            f"3d-{self.fault}-{self.nranks}x{self.calls}-pp{self.pp}-g{GENERATOR_VERSION}"
            f"-f{FORMAT_VERSION}-r{NCCL_EVENT.itemsize}"
        )

    def check(self) -> None:
        if self.nranks % (TP * self.pp) or self.dp < 2:
            raise ValueError(f"{self.nranks} ranks do not fill {self.pp} stages of 8-rank hosts")


@dataclass(frozen=True, slots=True)
class Schedule:
    """One step of one stage: per call, its communicator kind, op, count,
    datatype, peer (comm rank, p2p) and its seq counter's key."""

    kind: np.ndarray
    op: np.ndarray
    count: np.ndarray
    dtype: np.ndarray
    peer: np.ndarray

    def __len__(self) -> int:
        return len(self.kind)


AG_COUNT = 4096 * 8192 // TP  # a sequence-parallel activation shard, bf16
PP_COUNT = 4096 * 8192 // TP
BUCKET = 50_000_000  # gradient elements per DP bucket


def schedule(shape: Shape, stage: int) -> Schedule:
    calls: list[tuple[int, int, int, int, int]] = []
    layer = [
        (TP_KIND, Op.ALL_GATHER, AG_COUNT, DataType.BFLOAT16, -1),
        (TP_KIND, Op.REDUCE_SCATTER, AG_COUNT, DataType.BFLOAT16, -1),
    ]
    tp = layer * (2 * shape.layers)  # attention and MLP of each layer
    first, last = stage == 0, stage == shape.pp - 1
    for _ in range(shape.microbatches):  # forward
        if not first:
            calls.append((PP_KIND, Op.RECV, PP_COUNT, DataType.BFLOAT16, stage - 1))
        calls += tp
        if not last:
            calls.append((PP_KIND, Op.SEND, PP_COUNT, DataType.BFLOAT16, stage + 1))
    for _ in range(shape.microbatches):  # backward
        if not last:
            calls.append((PP_KIND, Op.RECV, PP_COUNT, DataType.BFLOAT16, stage + 1))
        calls += tp
        if not first:
            calls.append((PP_KIND, Op.SEND, PP_COUNT, DataType.BFLOAT16, stage - 1))
    share = BUCKET // shape.dp
    calls += [(DP_KIND, Op.REDUCE_SCATTER, share, DataType.FLOAT32, -1)] * shape.buckets
    calls += [(DP_KIND, Op.ALL_GATHER, share, DataType.BFLOAT16, -1)] * shape.buckets
    calls.append((DP_KIND, Op.ALL_REDUCE, 1, DataType.FLOAT32, -1))
    cols = np.array(calls, dtype=np.int64).T
    return Schedule(*cols)


def _jitter(rank: np.ndarray, index: int) -> np.ndarray:
    """Deterministic jitter per (rank, call index): a hash, no RNG state."""
    x = rank.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(index * 0x632BE5AB)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(31)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(29)
    return (x % np.uint64(JITTER_NS)).astype(np.int64)


def _seqs(sched: Schedule, steps: int) -> np.ndarray:
    """Per call of the whole run: its seq on its communicator (collectives
    count per comm, p2p per peer and direction, from the job's start)."""
    p2p = sched.kind == PP_KIND
    key = np.where(p2p, sched.kind * 10**6 + sched.op * 10**3 + sched.peer + 1, sched.kind)
    keys = np.tile(key, steps)
    out = np.zeros(len(keys), dtype=np.int64)
    for k in np.unique(keys).tolist():
        sel = keys == k
        out[sel] = np.arange(int(sel.sum()))
    return out


@dataclass
class _Stage:
    """The times of one stage's hosts: ts/end per (host, call, lane); 0 ts:
    no call (after the rank stopped); 0 end: in flight."""

    ts: np.ndarray
    end: np.ndarray


def step_length(shape: Shape) -> int:
    longest = max(len(schedule(shape, s)) for s in range(shape.pp))
    per_call = GAP_NS + JITTER_NS + max(XFER_NS.values()) + SLOW_MS * MS
    return longest * per_call + 50 * MS


def steps_needed(shape: Shape) -> int:
    shortest = min(len(schedule(shape, s)) for s in range(shape.pp))
    return -(-(shape.calls + 2) // shortest) + 1


@dataclass(frozen=True, slots=True)
class Hang:
    step: int
    index: int  # call index in the step where the culprit stops
    at_ns: int  # when it would have entered


def _simulate(shape: Shape, stage: int, steps: int, hang: Hang | None) -> _Stage:
    sched = schedule(shape, stage)
    n = len(sched)
    hosts = np.arange(stage * shape.dp, (stage + 1) * shape.dp)
    ranks = hosts[:, None] * TP + np.arange(TP)[None, :]
    ts = np.zeros((shape.dp, steps * n, TP), dtype=np.int64)
    end = np.zeros_like(ts)
    alive = np.ones((shape.dp, TP), dtype=bool)
    culprit = shape.culprit
    c_host, c_lane = divmod(culprit, TP)
    mine = (hosts == c_host)[:, None] & (np.arange(TP) == c_lane)[None, :]
    pipeline = (hosts % shape.dp == c_host % shape.dp)[:, None] & np.ones(TP, dtype=bool)
    length = step_length(shape)
    for step in range(steps):
        t = np.full((shape.dp, TP), T0 + step * length, dtype=np.int64)
        for k in range(n):
            i = step * n + k
            kind = int(sched.kind[k])
            arrive = t + GAP_NS + _jitter(ranks, i)
            if shape.fault == "straggler" and kind == TP_KIND:
                arrive[mine] += SLOW_MS * MS
            enter = alive.copy()
            flight = np.zeros_like(alive)
            if hang is not None and step == hang.step:
                enter, flight = _hang_rules(shape, sched, k, hang, arrive, alive, mine, pipeline)
            if kind == TP_KIND:
                done = np.where(enter, arrive, 0).max(axis=1, keepdims=True) + XFER_NS[kind]
            elif kind == DP_KIND:
                done = np.where(enter, arrive, 0).max(axis=0, keepdims=True) + XFER_NS[kind]
            else:
                done = arrive + XFER_NS[kind]
            done = np.broadcast_to(done, arrive.shape)
            ts[:, i, :] = np.where(enter, arrive, 0)
            end[:, i, :] = np.where(enter & ~flight, done, 0)
            alive &= ~flight & enter
            t = np.where(alive, done, t)
        if hang is not None and step == hang.step:
            return _Stage(ts[:, : (step + 1) * n], end[:, : (step + 1) * n])
    return _Stage(ts, end)


def _hang_rules(
    shape: Shape,
    sched: Schedule,
    k: int,
    hang: Hang,
    arrive: np.ndarray,
    alive: np.ndarray,
    mine: np.ndarray,
    pipeline: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Who enters call ``k`` of the hung step, and who stays in it (in flight)."""
    kind = int(sched.kind[k])
    enter = alive.copy()
    flight = np.zeros_like(alive)
    if k >= hang.index and mine.any():
        host = mine.any(axis=1)
        enter[mine] = False  # the culprit never enters
        flight[host] = alive[host] & ~mine[host]  # its host's peers wait in this call
        enter[host] &= ~mine[host]
    others = pipeline & ~mine.any(axis=1, keepdims=True)
    if kind == PP_KIND:  # the rest of its pipeline waits in its next p2p call after the hang
        late = others & (arrive >= hang.at_ns)
        flight |= late & alive
    if kind == DP_KIND:  # every other host waits in the first DP call
        flight |= alive & ~mine.any(axis=1, keepdims=True)
    return enter & alive, flight & alive


def hang_point(shape: Shape) -> Hang:
    """The culprit stops before the first TP collective of the second
    microbatch's forward pass, in the last step; ``at_ns`` is about when
    it would have entered (steps start together everywhere)."""
    sched = schedule(shape, shape.pp // 2)
    steps = steps_needed(shape)
    index = int(np.flatnonzero(sched.kind == TP_KIND)[4 * shape.layers])
    per_call = GAP_NS + JITTER_NS // 2 + XFER_NS[TP_KIND]
    return Hang(steps - 1, index, T0 + (steps - 1) * step_length(shape) + index * per_call)


def _comms(shape: Shape, host: int) -> tuple[CommInfo, ...]:
    stage, d = divmod(host, shape.dp)
    out = []
    for lane in range(TP):
        pid = 1000 + lane
        rank = host * TP + lane
        out += [
            CommInfo(pid, 0x7000 + 0x10 * lane, WORLD_HASH, rank, shape.nranks),
            CommInfo(pid, 0x7001 + 0x10 * lane, TP_BASE | host, lane, TP),
            CommInfo(pid, 0x7002 + 0x10 * lane, PP_BASE | (d * TP + lane), stage, shape.pp),
            CommInfo(pid, 0x7003 + 0x10 * lane, DP_BASE | (stage * TP + lane), d, shape.dp),
        ]
    return tuple(out)


def _rows(shape: Shape, host: int, sim: _Stage, row: int, sched: Schedule, seqs: np.ndarray):  # type: ignore[no-untyped-def]
    """One host's ring: each rank's latest ``calls`` calls, in entry order."""
    stage, d = divmod(host, shape.dp)
    ts, end = sim.ts[row], sim.end[row]  # (calls, lane)
    made = ts > 0
    total = made.sum(axis=0)
    keep = made & (np.cumsum(made, axis=0) > (total - shape.calls)[None, :])
    idx, lane = np.nonzero(keep)  # row-major: call by call, lanes within a call
    n = len(sched)
    k = idx % n
    kind = sched.kind[k]
    rows = np.zeros(len(idx), dtype=NCCL_EVENT)
    rows["ts_ns"], rows["end_ns"] = ts[idx, lane], end[idx, lane]
    rows["pid"] = rows["tid"] = 1000 + lane
    rows["kind"], rows["size"] = 1, NCCL_EVENT.itemsize
    hashes = np.array([TP_BASE | host, 0, DP_BASE], dtype=np.uint64)
    comm_hash = hashes[kind].copy()
    comm_hash[kind == PP_KIND] = PP_BASE | (d * TP + lane[kind == PP_KIND]).astype(np.uint64)
    comm_hash[kind == DP_KIND] |= (stage * TP + lane[kind == DP_KIND]).astype(np.uint64)
    rows["comm_hash"] = comm_hash
    rows["comm"] = 0x7001 + kind + 0x10 * lane
    rows["rank"] = np.select([kind == TP_KIND, kind == PP_KIND], [lane, stage], d)
    rows["nranks"] = np.select([kind == TP_KIND, kind == PP_KIND], [TP, shape.pp], shape.dp)
    rows["seq"] = seqs[idx]
    rows["op"], rows["count"], rows["datatype"] = sched.op[k], sched.count[k], sched.dtype[k]
    rows["bytes"] = rows["count"] * np.where(sched.dtype[k] == DataType.FLOAT32, 4, 2)
    rows["peer"], rows["redop"] = sched.peer[k], RedOp.SUM
    done = rows["end_ns"] > 0
    rows["state"] = np.where(done, State.ENQUEUED, State.SCHEDULED)  # blocking: returned = done
    rows["result"] = np.where(done, 0, -1)
    overwritten = int((total - np.minimum(total, shape.calls)).sum())
    return rows, overwritten


def _recording(shape: Shape, host: int, rows: np.ndarray, overwritten: int, now: int) -> Recording:
    skew = (host * 7919) % (3 * MS)  # a few ms of clock skew between hosts
    rows = rows.copy()
    for f in ("ts_ns", "end_ns"):
        rows[f] = np.where(rows[f] > 0, rows[f] + skew, 0)
    procs = tuple(
        ProcessInfo(1000 + lane, "python", "pretrain_gpt.py", 4026531840, T0 - 60_000 * MS, ())
        for lane in range(TP)
    )
    trig = Trigger(TriggerKind.PEER, "3-D bench incident", f"bench3d-{shape.fault}", now + skew)
    return Recording(
        host=f"host{host:05d}",
        boot_id="bench",
        clock=Clock(now + skew, WALL0),
        processes=procs,
        communicators=_comms(shape, host),
        rings={"nccl": Ring(rows, overwritten=overwritten)},
        trigger=trig,
    )


def write_incident(
    shape: Shape, folder: Path, progress: Callable[[int, int], None] | None = None
) -> dict[str, object]:
    """Every host's dump into ``folder``; returns the truth."""
    shape.check()
    folder.mkdir(parents=True, exist_ok=True)
    hang = hang_point(shape) if shape.fault == "hang" else None
    steps = hang.step + 1 if hang else steps_needed(shape)
    last = 0
    stages = [(s, _simulate(shape, s, steps, hang)) for s in range(shape.pp)]
    for _, sim in stages:
        last = max(last, int(sim.ts.max()), int(sim.end.max()))
    now = (hang.at_ns + DUMP_AFTER_NS) if hang else last + 200 * MS
    written = 0
    for stage, sim in stages:
        sched = schedule(shape, stage)
        seqs = _seqs(sched, sim.ts.shape[1] // len(sched))
        for row in range(shape.dp):
            host = stage * shape.dp + row
            rows, over = _rows(shape, host, sim, row, sched, seqs)
            rec = _recording(shape, host, rows, over, now)
            (folder / dump_file_name(rec)).write_bytes(encode(rec))
            written += 1
            if progress is not None:
                progress(written, shape.hosts)
    kind = "missing_rank" if shape.fault == "hang" else "compute_straggler"
    truth = {"kind": kind, "ranks": [shape.culprit], "shape": dataclasses.asdict(shape)}
    (folder / "TRUTH.json.tmp").write_text(json.dumps(truth))
    os.replace(folder / "TRUTH.json.tmp", folder / ".truth.json")
    return truth


def cache_root() -> Path:
    base = os.environ.get("STALLWATCH_BENCH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "stallwatch-bench"
    )
    return Path(base)


def cached_incident(shape: Shape, progress: Callable[[int, int], None] | None = None) -> Path:
    """The incident's folder in the cache, written once and reused by later
    runs (a folder without its truth file is an interrupted write: redone).
    Folders of other shapes' keys that are stale (older generator or format)
    are removed first, so the cache never holds two versions of one size."""
    root = cache_root()
    folder = root / shape.key
    if (folder / ".truth.json").is_file():
        return folder
    prefix = f"3d-{shape.fault}-{shape.nranks}x{shape.calls}-"
    if root.is_dir():
        for old in root.iterdir():
            if old.name.startswith(prefix) and old.name != shape.key:
                shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(folder, ignore_errors=True)
    write_incident(shape, folder, progress)
    return folder


def truth_of(folder: Path) -> dict[str, object]:
    doc: dict[str, object] = json.loads((folder / ".truth.json").read_text())
    return doc

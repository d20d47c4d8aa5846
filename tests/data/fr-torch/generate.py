"""Make the Flight Recorder corpus: real PyTorch jobs (gloo on CPU), healthy and
faulty, each rank's Flight Recorder dumped by torch itself.

Needs torch 2.13 (CPU build is enough): ``pip install torch==2.13.0``, then

    python tests/data/fr-torch/generate.py                 # every scenario
    python tests/data/fr-torch/generate.py --list
    python tests/data/fr-torch/generate.py allreduce-hang-4 rooted-healthy-8

Each run writes ``<scenario>-<world>/``: ``pickle/nccl_trace_rank_<r>`` (what
``_dump_fr_trace`` returned, byte for byte), ``json/nccl_trace_rank_<r>.json``
(``_dump_fr_trace_json``), and ``expected.json``: what was done, what happened
to each rank (dumped or not, exit status, the error it saw), the truth, and the
first verdict the dumps support.

How a job runs: this process hosts a TCPStore; one process per rank joins it
(``init_process_group("gloo", store=...)``) and runs the job's steps.  Gloo
has no watchdog that dumps on a timeout, so the job triggers the dumps itself
through its store: each rank reports on the store when it is done, fails or
hangs; when every rank has reported or died, or nothing has changed for a few
seconds (ranks blocked in a collective), the launcher sets ``fr/dump``; a
thread in every live rank then dumps both forms, and only when every live rank
has dumped are they told to exit, so that no rank sees a peer leave before it
has dumped.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _dump_fr_trace, _dump_fr_trace_json

HERE = Path(__file__).resolve().parent
BUFFER = 16  # TORCH_FR_BUFFER_SIZE: entries each rank keeps
QUIET_S = 5.0  # no rank changed state this long: the rest are blocked
TIMEOUT = datetime.timedelta(seconds=300)  # gloo's: far beyond any run
FILE = "nccl_trace_rank_"  # torch's default dump file prefix


@dataclass
class Job:
    """What a rank's steps see: its rank, the scenario and the store."""

    rank: int
    world: int
    fault: str
    culprit: int
    store: dist.Store
    groups: dict[str, object] = field(default_factory=dict)
    spacing_ms: float = 0.0  # dumps taken in turn, this far apart
    stop_after_dumps: int = 0  # "hang-while-dumped": the culprit stops once this many dumped

    def at(self, fault: str, rank: int | None = None) -> bool:
        return self.fault == fault and self.rank == (self.culprit if rank is None else rank)

    def hang(self) -> None:
        """Stop here for good (a rank stuck outside any collective)."""
        self.store.set(f"state/{self.rank}", "hung")
        self.store.set("fr/hung", "1")
        while True:
            time.sleep(1)

    def killed_inside(self, work: dist.Work) -> None:
        """SIGKILL this rank while ``work`` (just started) is in flight."""
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)


# --- the jobs: steps of collectives, with the fault named by Job.fault ------


def root(world: int, k: int) -> int:
    """Roots other than 0: the k-th of the rooted ops."""
    return [1, 2, 3, 1][k] if world == 4 else [3, 5, 7, 6][k]


def allreduce_job(j: Job) -> None:
    for step in range(6):
        dtype, shape, op = torch.float32, (64,), dist.ReduceOp.SUM
        if step == 3:
            if j.at("hang"):
                j.hang()
            if j.at("skip"):
                continue
            if j.at("count"):
                shape = (65,)
            if j.at("shape"):
                shape = (2, 32)
            if j.at("dtype"):
                dtype = torch.float64
            if j.at("redop"):
                op = dist.ReduceOp.MAX
            if j.fault == "crash":
                work = dist.all_reduce(torch.ones(1 << 24), async_op=True)
                if j.at("crash"):
                    j.killed_inside(work)
                work.wait()
                continue
        dist.all_reduce(torch.ones(shape, dtype=dtype), op=op)


def rooted_job(j: Job) -> None:
    w = j.world
    for step in range(3):
        n = 9 if step == 2 and j.at("bcast_count") else 8
        dist.broadcast(torch.ones(n), src=root(w, 0))
        dist.reduce(torch.ones(8), dst=root(w, 1))
        src = root(w, 2)
        chunks = [torch.ones(8) for _ in range(w)] if j.rank == src else None
        dist.scatter(torch.zeros(8), chunks, src=src)
        if step == 2 and j.at("hang"):
            j.hang()
        dst = root(w, 3)
        n = 9 if step == 2 and j.at("gather_count") else 8
        out = [torch.zeros(8) for _ in range(w)] if j.rank == dst else None
        dist.gather(torch.ones(n), out, dst=dst)


def alltoall_job(j: Job) -> None:
    w, r = j.world, j.rank
    for step in range(4):
        if step == 2 and j.at("hang"):
            j.hang()
        send = [(r + d + step) % 3 + 1 for d in range(w)]  # uneven, different per rank
        recv = [(s + r + step) % 3 + 1 for s in range(w)]  # what each source sends to r
        out = torch.zeros(sum(recv))
        dist.all_to_all_single(out, torch.ones(sum(send)), recv, send)
        dist.all_to_all([torch.zeros(2) for _ in range(w)], [torch.ones(2) for _ in range(w)])


def barrier_job(j: Job) -> None:
    for step in range(5):
        dist.all_reduce(torch.ones(16))
        if step == 3 and j.at("hang"):
            j.hang()
        dist.barrier()


def p2p_job(j: Job) -> None:
    """A pipeline: stage r receives from r-1 and sends to r+1, then all stages
    reduce.  Gloo's Flight Recorder records no send or recv."""
    w, r = j.world, j.rank
    for step in range(4):
        act = torch.zeros(32)
        if r > 0:
            dist.recv(act, r - 1)
        if step == 2 and j.at("nosend"):
            j.hang()  # never posts its send (and so never reaches the reduce)
        if r < w - 1:
            dist.send(act + 1, r + 1)
        dist.all_reduce(torch.ones(8))


def coalesced_job(j: Job) -> None:
    for step in range(4):
        sizes = [3, 5]
        if step == 2 and j.at("shape"):
            sizes = [4, 4]  # the same elements in all, split otherwise
        if step == 2 and j.at("hang"):
            j.hang()
        dist.all_reduce_coalesced([torch.ones(s) for s in sizes])
        with dist._coalescing_manager(async_ops=False):
            dist.all_reduce(torch.ones(4))
            dist.all_reduce(torch.ones(6))


def groups_job(j: Job) -> None:
    w, r = j.world, j.rank
    half = dist.new_group(list(range(w // 2)))
    pair, _ = dist.new_subgroups(2)
    for step in range(4):
        dist.all_reduce(torch.ones(8))
        if r < w // 2:
            dist.all_reduce(torch.ones(4), group=half)
        if step == 2 and j.at("hang"):
            j.hang()
        dist.all_reduce(torch.ones(2), group=pair)


def wrap_job(j: Job) -> None:
    """Rings of different sizes per rank (set at start-up), and ranks of the
    first pair do extra collectives: every rank's ring wraps elsewhere."""
    pair, _ = dist.new_subgroups(2)
    for step in range(14):
        if step == 12 and j.at("hang"):
            j.hang()
        dist.all_reduce(torch.ones(8))
        if j.rank < 2:
            dist.all_reduce(torch.ones(2), group=pair)


def halves_job(j: Job) -> None:
    """World all_reduces and all_reduces in halves (new_subgroups): ranks
    0..w/2-1 and w/2..w-1 each know their half as their group pg_id 1."""
    half, _ = dist.new_subgroups(j.world // 2)
    for step in range(16):
        dist.all_reduce(torch.ones(8))
        if step == 12 and j.at("hang"):
            j.hang()
        dist.all_reduce(torch.ones(4), group=half)


def links_job(j: Job) -> None:
    """A pipeline of broadcasts, stage r to stage r+1 in a group of the two
    (new_group per link): every rank's first link is its pg_id 1."""
    w, r = j.world, j.rank
    links = [dist.new_group([s, s + 1]) for s in range(w - 1)]
    for step in range(4):
        act = torch.zeros(32)
        if r > 0:
            dist.broadcast(act, src=r - 1, group=links[r - 1])
        if step == 2 and j.at("hang"):
            j.hang()  # never forwards (and so never reaches the reduce)
        if r < w - 1:
            dist.broadcast(act + 1, src=r, group=links[r])
        dist.all_reduce(torch.ones(8))


def wrap_buffer(rank: int) -> int:
    return 6 + 3 * rank


STEP_S = 0.01  # the in-turn job's compute between collectives
HANG_AT_S = 1.0  # the in-turn job's culprit stops after this long


def in_turn_steps(world: int, spacing_ms: float) -> int:
    """Steps enough to outlast the dumps: they begin 1 s after every rank
    runs and end world * spacing later (and a loaded machine's slowness)."""
    return int((3.0 + world * spacing_ms / 1e3) / STEP_S) + 200


def in_turn_job(j: Job) -> None:
    """all_reduces with compute between them; with the fault, rank k stops
    for good (outside any collective) after HANG_AT_S ("hang"), or halfway
    between two dumps once ``stop_after_dumps`` ranks have dumped
    ("hang-while-dumped": the ranks dumped before are a few collectives
    behind, not caught between two calls at the very moment it stopped)."""
    t0 = time.monotonic()
    seen: float | None = None  # when it saw the dumps it stops after
    for _ in range(in_turn_steps(j.world, j.spacing_ms)):
        time.sleep(STEP_S)
        seen = in_turn_stop(j, t0, seen)
        dist.all_reduce(torch.ones(64))


def in_turn_halves_job(j: Job) -> None:
    """The in-turn job with an all_reduce in halves after each world one
    (new_subgroups: each half is its members' pg_id 1); rank k stops
    before its half's all_reduce."""
    half, _ = dist.new_subgroups(j.world // 2)
    t0 = time.monotonic()
    seen: float | None = None
    for _ in range(in_turn_steps(j.world, j.spacing_ms)):
        time.sleep(STEP_S)
        dist.all_reduce(torch.ones(64))
        seen = in_turn_stop(j, t0, seen)
        dist.all_reduce(torch.ones(16), group=half)


def in_turn_links_job(j: Job) -> None:
    """The in-turn job as a pipeline of broadcasts (links_job): stage r
    receives from r-1 and forwards to r+1 in groups of two, then all stages
    reduce; rank k stops before it forwards."""
    w, r = j.world, j.rank
    links = [dist.new_group([s, s + 1]) for s in range(w - 1)]
    t0 = time.monotonic()
    seen: float | None = None
    for _ in range(in_turn_steps(j.world, j.spacing_ms)):
        time.sleep(STEP_S)
        act = torch.zeros(32)
        if r > 0:
            dist.broadcast(act, src=r - 1, group=links[r - 1])
        seen = in_turn_stop(j, t0, seen)
        if r < w - 1:
            dist.broadcast(act + 1, src=r, group=links[r])
        dist.all_reduce(torch.ones(16))


def in_turn_stop(j: Job, t0: float, seen: float | None) -> float | None:
    """Stop here for good when the fault says so (see in_turn_job); returns
    when the culprit saw the dumps it stops after."""
    if j.at("hang") and time.monotonic() - t0 > HANG_AT_S:
        j.hang()
    if j.at("hang-while-dumped"):
        if seen is None and j.store.add("fr/dumps", 0) >= j.stop_after_dumps:
            seen = time.monotonic()
        if seen is not None and time.monotonic() - seen >= j.spacing_ms / 2e3:
            j.hang()
    return seen


@dataclass(frozen=True)
class Scenario:
    name: str
    job: Callable[[Job], None]
    fault: str  # "" healthy
    text: str  # what is done
    truth: str  # the verdict kind the fault is
    culprit: Callable[[int], int] = lambda w: w // 2
    buffer: Callable[[int], int] = lambda r: BUFFER
    # >0: the ranks dump in turn, rank r this much after rank r-1, while the
    # job runs (healthy) or after the culprit stopped (hang)
    spacing_ms: float = 0.0
    # "hang-while-dumped": where the culprit comes in the dump order ("first",
    # "early", "middle", "late"); the others dump in rank order
    place: str = ""


def stop_after_dumps(world: int) -> int:
    """How many ranks dump before the culprit stops ("hang-while-dumped")."""
    return world // 2 - 1


def dump_order(scn: Scenario, world: int) -> list[int]:
    """The ranks in the order they dump: rank order, but for the culprit of
    a "hang-while-dumped" run, placed first (it dumps before it stops), or
    early, in the middle or last among those that dump after it stopped."""
    if not scn.place:
        return list(range(world))
    k = scn.culprit(world)
    n = stop_after_dumps(world)
    at = {"first": 0, "early": n, "middle": (n + world - 1) // 2, "late": world - 1}[scn.place]
    others = [r for r in range(world) if r != k]
    return [*others[:at], k, *others[at:]]


def _k(w: int) -> int:
    return w // 2


SCENARIOS = [
    Scenario("allreduce-healthy", allreduce_job, "", "6 all_reduces", "healthy"),
    Scenario(
        "allreduce-hang",
        allreduce_job,
        "hang",
        "rank k stops before the 4th all_reduce",
        "missing_rank",
    ),
    Scenario(
        "allreduce-skip",
        allreduce_job,
        "skip",
        "rank k skips the 4th all_reduce and goes on: gloo pairs its later calls "
        "with its peers' earlier ones, and its final barrier meets their last all_reduce",
        "desync",
    ),
    Scenario(
        "allreduce-crash",
        allreduce_job,
        "crash",
        "rank k is killed (SIGKILL) inside the 4th all_reduce (a large one)",
        "rank_exited",
    ),
    Scenario(
        "allreduce-count", allreduce_job, "count", "rank k passes 65 elements, not 64", "desync"
    ),
    Scenario(
        "allreduce-shape",
        allreduce_job,
        "shape",
        "rank k passes shape [2, 32], the others [64] (same element count)",
        "desync",
    ),
    Scenario(
        "allreduce-dtype",
        allreduce_job,
        "dtype",
        "rank k passes float64, the others float32",
        "desync",
    ),
    Scenario(
        "allreduce-redop",
        allreduce_job,
        "redop",
        "rank k reduces with MAX, the others SUM",
        "desync",
    ),
    Scenario(
        "rooted-healthy",
        rooted_job,
        "",
        "broadcast, reduce, scatter, gather with roots other than 0, 3 steps",
        "healthy",
    ),
    Scenario(
        "rooted-hang",
        rooted_job,
        "hang",
        "rank k (not a root) stops before the last gather",
        "missing_rank",
    ),
    Scenario(
        "rooted-gather-count",
        rooted_job,
        "gather_count",
        "rank k passes 9 elements to the last gather, the others 8",
        "desync",
    ),
    Scenario(
        "rooted-bcast-count",
        rooted_job,
        "bcast_count",
        "rank k passes 9 elements to the last broadcast, the others 8",
        "desync",
    ),
    Scenario(
        "alltoall-healthy",
        alltoall_job,
        "",
        "all_to_all_single with uneven splits, and all_to_all, 4 steps",
        "healthy",
    ),
    Scenario(
        "alltoall-hang", alltoall_job, "hang", "rank k stops before the 3rd step", "missing_rank"
    ),
    Scenario("barrier-healthy", barrier_job, "", "all_reduce and barrier, 5 steps", "healthy"),
    Scenario(
        "barrier-hang", barrier_job, "hang", "rank k stops before the 4th barrier", "missing_rank"
    ),
    Scenario(
        "p2p-healthy",
        p2p_job,
        "",
        "a pipeline of send/recv between stages, then all_reduce, 4 steps",
        "healthy",
    ),
    Scenario(
        "p2p-nosend",
        p2p_job,
        "nosend",
        "stage k never posts its 3rd send (it stops); the later stages wait in recv",
        "missing_rank",
    ),
    Scenario(
        "coalesced-healthy",
        coalesced_job,
        "",
        "all_reduce_coalesced and a coalescing manager of two all_reduces, 4 steps",
        "healthy",
    ),
    Scenario(
        "coalesced-shape",
        coalesced_job,
        "shape",
        "rank k coalesces tensors of 4 and 4 elements, the others 3 and 5",
        "desync",
    ),
    Scenario(
        "coalesced-hang",
        coalesced_job,
        "hang",
        "rank k stops before the 3rd all_reduce_coalesced",
        "missing_rank",
    ),
    Scenario(
        "groups-healthy",
        groups_job,
        "",
        "world, half (new_group) and pairs (new_subgroups) all_reduces, 4 steps",
        "healthy",
    ),
    Scenario(
        "groups-hang",
        groups_job,
        "hang",
        "rank k stops before its pair's 3rd all_reduce",
        "missing_rank",
    ),
    Scenario(
        "wrap-healthy",
        wrap_job,
        "",
        "14 steps, rings of 6 + 3*rank entries, extra pair collectives on ranks 0 and 1",
        "healthy",
        buffer=wrap_buffer,
    ),
    Scenario(
        "wrap-hang",
        wrap_job,
        "hang",
        "14 steps, rings of 6 + 3*rank entries; rank k stops before the 13th step",
        "missing_rank",
        buffer=wrap_buffer,
    ),
    Scenario(
        "halves-healthy",
        halves_job,
        "",
        "world all_reduces and all_reduces in halves (new_subgroups), 16 steps: each half "
        "is its members' pg_id 1",
        "healthy",
    ),
    Scenario(
        "halves-hang",
        halves_job,
        "hang",
        "rank k stops before its half's 13th all_reduce (both halves are pg_id 1)",
        "missing_rank",
        culprit=lambda w: w // 2 + 1,
    ),
    Scenario(
        "links-healthy",
        links_job,
        "",
        "a pipeline of broadcasts in groups of two stages (new_group per link), then "
        "all_reduce, 4 steps: a rank's first link is its pg_id 1",
        "healthy",
    ),
    Scenario(
        "links-hang",
        links_job,
        "hang",
        "stage k stops before its 3rd broadcast to the next stage; the later stages wait "
        "in their link's broadcast",
        "missing_rank",
    ),
]


for _ms in (10, 50, 200):
    SCENARIOS.append(
        Scenario(
            f"inturn-healthy-{_ms}ms",
            in_turn_job,
            "",
            f"all_reduces 10 ms apart; each rank dumps {_ms} ms after the one before, "
            "while the job runs",
            "healthy",
            spacing_ms=_ms,
        )
    )
for _ms in (50, 200):
    for _place in ("first", "early", "middle", "late"):
        SCENARIOS.append(
            Scenario(
                f"inturn-hangs-{_ms}ms-{_place}",
                in_turn_job,
                "hang-while-dumped",
                f"all_reduces 10 ms apart; 1 s after every rank runs, the ranks dump "
                f"{_ms} ms apart; rank k stops for good halfway between two dumps, once "
                f"the first ranks in the dump order have dumped; it dumps {_place} in that "
                "order",
                "missing_rank",
                spacing_ms=_ms,
                place=_place,
            )
        )
HALVES_TEXT = "world all_reduces and all_reduces in halves (each half its members' pg_id 1)"
SCENARIOS.append(
    Scenario(
        "inturn-halves-healthy-50ms",
        in_turn_halves_job,
        "",
        f"{HALVES_TEXT}, 10 ms apart; each rank dumps 50 ms after the one before, while "
        "the job runs",
        "healthy",
        spacing_ms=50,
    )
)
SCENARIOS.append(
    Scenario(
        "inturn-halves-hang-50ms",
        in_turn_halves_job,
        "hang",
        f"{HALVES_TEXT}, 10 ms apart; rank k stops before its half's all_reduce after "
        f"{HANG_AT_S:.0f} s, then each rank dumps 50 ms after the one before",
        "missing_rank",
        culprit=lambda w: w // 2 + 1,
        spacing_ms=50,
    )
)
for _place in ("first", "early", "middle", "late"):
    SCENARIOS.append(
        Scenario(
            f"inturn-halves-hangs-50ms-{_place}",
            in_turn_halves_job,
            "hang-while-dumped",
            f"{HALVES_TEXT}, 10 ms apart; 1 s after every rank runs, the ranks dump 50 ms "
            "apart; rank k stops for good before its half's all_reduce, halfway between two "
            f"dumps, once the first ranks in the dump order have dumped; it dumps {_place} "
            "in that order",
            "missing_rank",
            culprit=lambda w: w // 2 + 1,
            spacing_ms=50,
            place=_place,
        )
    )
LINKS_TEXT = "a pipeline of broadcasts in groups of two stages (a rank's first link its pg_id 1)"
SCENARIOS.append(
    Scenario(
        "inturn-links-healthy-50ms",
        in_turn_links_job,
        "",
        f"{LINKS_TEXT}, then all_reduce, 10 ms apart; each rank dumps 50 ms after the one "
        "before, while the job runs",
        "healthy",
        spacing_ms=50,
    )
)
SCENARIOS.append(
    Scenario(
        "inturn-links-hang-50ms",
        in_turn_links_job,
        "hang",
        f"{LINKS_TEXT}, then all_reduce, 10 ms apart; stage k stops before it forwards after "
        f"{HANG_AT_S:.0f} s, then each rank dumps 50 ms after the one before",
        "missing_rank",
        spacing_ms=50,
    )
)
for _place in ("first", "early", "middle", "late"):
    SCENARIOS.append(
        Scenario(
            f"inturn-links-hangs-50ms-{_place}",
            in_turn_links_job,
            "hang-while-dumped",
            f"{LINKS_TEXT}, then all_reduce, 10 ms apart; 1 s after every rank runs, the "
            "ranks dump 50 ms apart; stage k stops for good before it forwards, halfway "
            "between two dumps, once the first ranks in the dump order have dumped; it dumps "
            f"{_place} in that order",
            "missing_rank",
            spacing_ms=50,
            place=_place,
        )
    )
for _ms in (10, 200):
    SCENARIOS.append(
        Scenario(
            f"inturn-hang-{_ms}ms",
            in_turn_job,
            "hang",
            f"all_reduces 10 ms apart; rank k stops after {HANG_AT_S:.0f} s, then each rank "
            f"dumps {_ms} ms after the one before",
            "missing_rank",
            spacing_ms=_ms,
        )
    )


# --- one rank ----------------------------------------------------------------


def rank_main(scn_name: str, rank: int, world: int, port: int, out: str) -> None:
    scn = next(s for s in SCENARIOS if s.name == scn_name)
    os.environ["TORCH_FR_BUFFER_SIZE"] = str(scn.buffer(rank))
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=TIMEOUT)
    job = Job(rank, world, scn.fault, scn.culprit(world), store, spacing_ms=scn.spacing_ms,
              stop_after_dumps=stop_after_dumps(world))  # fmt: skip
    # its own connection: a client blocked in wait() holds its socket
    side = dist.TCPStore("127.0.0.1", port, None, False, timeout=TIMEOUT)
    place = dump_order(scn, world).index(rank)
    delay = place * scn.spacing_ms / 1e3
    # "hang-while-dumped": the ranks after the first few dump only once the
    # culprit has stopped, and HUNG_FOR_S later (its peers then wait in the
    # collective it never entered, even on a loaded machine)
    after = scn.fault == "hang-while-dumped" and place >= stop_after_dumps(world)
    args = (side, rank, Path(out), delay, after)
    threading.Thread(target=dumper, args=args, daemon=True).start()
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("pg", store),
        rank=rank,
        world_size=world,
        timeout=TIMEOUT,
    )
    store.set(f"state/{rank}", "running")
    try:
        scn.job(job)
        dist.barrier()
        store.set(f"state/{rank}", "done")
    except Exception as exc:  # the error a rank saw is a fact of the run
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        text = text.split(" This is typically")[0][:200]
        store.set(f"state/{rank}", f"error: {type(exc).__name__}: {text}")
    while True:  # the dumper thread ends the process
        time.sleep(1)


HUNG_FOR_S = 0.1  # "hang-while-dumped": the dumps after the culprit stopped, at least this later


def dumper(store: dist.Store, rank: int, out: Path, delay: float, after_hang: bool) -> None:
    try:
        store.wait(["fr/dump"], TIMEOUT)
        time.sleep(delay)  # dumps in turn
        if after_hang:
            store.wait(["fr/hung"], TIMEOUT)
            time.sleep(HUNG_FOR_S)
        pickled = _dump_fr_trace(includeStackTraces=False)
        as_json = _dump_fr_trace_json()
        (out / "pickle" / f"{FILE}{rank}").write_bytes(pickled)
        (out / "json" / f"{FILE}{rank}.json").write_bytes(as_json)
        if (out / "pickle-pg").is_dir():
            write_pg_fixed(out, rank, pickled, as_json)
        store.set(f"dumped/{rank}", "1")
        store.add("fr/dumps", 1)
        store.wait(["fr/exit"], TIMEOUT)
    except Exception:
        traceback.print_exc()
    os._exit(0)


def pg_config_fixed() -> dict[str, dict[str, str]]:
    """pg_config as it should be (and as later torch versions write it): one
    key per process group of this rank, its name, description and world
    ranks, from torch's own record of its groups."""
    c10d = dist.distributed_c10d
    out = {}
    for pg in c10d._world.pg_map:
        cfg = c10d._get_pg_config(pg)
        name = str(cfg["pg_name"])
        out[name] = {"name": name, "desc": str(cfg["pg_desc"]), "ranks": str(list(cfg["ranks"]))}
    return out


def write_pg_fixed(out: Path, rank: int, pickled: bytes, as_json: bytes) -> None:
    """The same dump with pg_config fixed (torch 2.13's gloo keys every group
    by ''): ``pickle-pg/`` and ``json-pg/``, everything else as torch wrote it."""
    fixed = pg_config_fixed()
    doc = pickle.loads(pickled)  # torch's own dump of this very process
    doc["pg_config"] = fixed
    (out / "pickle-pg").mkdir(exist_ok=True)
    (out / "pickle-pg" / f"{FILE}{rank}").write_bytes(pickle.dumps(doc))
    jdoc = json.loads(as_json)
    jdoc["pg_config"] = fixed
    (out / "json-pg").mkdir(exist_ok=True)
    (out / "json-pg" / f"{FILE}{rank}.json").write_text(json.dumps(jdoc, separators=(",", ":")))


# --- the launcher --------------------------------------------------------------


def states(store: dist.Store, world: int) -> dict[int, str]:
    keys = [f"state/{r}" for r in range(world)]
    have = [store.check([k]) for k in keys]
    return {
        r: store.get(k).decode() for r, (k, ok) in enumerate(zip(keys, have, strict=True)) if ok
    }


def run(scn: Scenario, world: int, root_dir: Path) -> dict[str, object]:
    out = root_dir / f"{scn.name}-{world}"
    shutil.rmtree(out, ignore_errors=True)
    (out / "pickle").mkdir(parents=True)
    (out / "json").mkdir()
    if scn.spacing_ms:
        (out / "pickle-pg").mkdir()
        (out / "json-pg").mkdir()
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=TIMEOUT, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=rank_main, args=(scn.name, r, world, store.port, str(out)))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    if scn.spacing_ms:
        when_to_dump(store, procs, world, scn)
    else:
        seen = settle(store, procs, world)
    store.set("fr/dump", "1")
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(store.check([f"dumped/{r}"]) for r in alive):
        time.sleep(0.1)
    if scn.spacing_ms:
        seen = settle(store, procs, world)  # the healthy job runs to its end
    store.set("fr/exit", "1")
    for p in procs:
        p.join(20)
        if p.is_alive():
            p.kill()
            p.join()
    facts = []
    for r, p in enumerate(procs):
        dumped = (out / "pickle" / f"{FILE}{r}").exists()
        code = p.exitcode
        facts.append(
            {
                "rank": r,
                "dumped": dumped,
                "state": state_text(seen.get(r)) if r in alive else "died",
                "exit": None if r in alive else exit_text(code),
            }
        )
    return expected(scn, world, facts, out)


def when_to_dump(store: dist.Store, procs: list[mp.Process], world: int, scn: Scenario) -> None:
    """Dumps in turn: healthy, 1 s after every rank runs (the job runs on
    while they dump); hang, 1 s after the culprit stopped (its peers wait
    in the collective it never entered)."""
    k = scn.culprit(world)
    start = time.monotonic()
    while time.monotonic() - start < 240:
        seen = states(store, world)
        if scn.fault == "hang" and seen.get(k) == "hung":
            break
        running = len(seen) == world and set(seen.values()) == {"running"}
        if scn.fault in ("", "hang-while-dumped") and running:
            break
        time.sleep(0.05)
    else:
        raise SystemExit(f"{scn.name}: the job never got to its dumps")
    time.sleep(1.0)


def state_text(state: str | None) -> str:
    return "blocked (in a collective)" if state in (None, "running") else state


def exit_text(code: int | None) -> str | None:
    if code is None:
        return None
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"code {code}"


def settle(store: dist.Store, procs: list[mp.Process], world: int) -> dict[int, str]:
    """Wait until every rank has reported or died, or nothing changed for
    QUIET_S (some are blocked)."""
    last, since = None, time.monotonic()
    start = time.monotonic()
    while True:
        seen = states(store, world)
        dead = tuple(r for r, p in enumerate(procs) if p.exitcode is not None)
        now = (tuple(sorted(seen.items())), dead)
        if now != last:
            last, since = now, time.monotonic()
        over = all(seen.get(r, "running") != "running" for r in range(world) if r not in dead)
        if over and time.monotonic() - since > 0.5:
            return seen
        if len(set(seen) | set(dead)) == world and time.monotonic() - since > QUIET_S:
            return seen
        if time.monotonic() - start > 240:
            raise SystemExit(f"{procs}: no rank reported in 240 s")
        time.sleep(0.1)


# --- what the dumps should be judged -----------------------------------------


def expected(scn: Scenario, world: int, facts: list[dict[str, object]], out: Path) -> dict:
    k = scn.culprit(world)
    dumped = [f["rank"] for f in facts if f["dumped"]]
    lost = sorted(r for r in range(world) if r not in dumped)
    truth_ranks = [] if scn.truth == "healthy" else [k]
    verdict, ranks, why = scn.truth, truth_ranks, ""
    if scn.fault == "crash":
        verdict, ranks = "inconclusive", [k]
        why = (
            "rank k left no dump; gloo ends a collective that failed on a peer's death as it "
            "ends one that succeeded, so its peers' dumps look as if the job stopped there: "
            "nothing can be judged of rank k"
        )
    elif scn.fault == "redop":
        verdict, ranks = "healthy", []
        why = "Flight Recorder records no reduce op: this mismatch leaves no trace in the dumps"
    elif scn.fault == "nosend":
        ranks = list(range(k, world))
        why = (
            "gloo's Flight Recorder records no send or recv: the later stages, waiting in a "
            "recv (each for the one before), look exactly like stage k, which never posted "
            "the send"
        )
    elif scn.truth == "desync" and k not in dumped:
        verdict, ranks = "inconclusive", [k]
        why = (
            "the odd rank died of the mismatch and left no dump; the ranks that dumped agree "
            "among themselves"
        )
    elif scn.fault == "hang-while-dumped" and scn.place == "first":
        verdict = "inconclusive"
        ranks = sorted(dump_order(scn, world)[: stop_after_dumps(world)])
        why = (
            "the ranks that dumped after rank k stopped stand at the collective it never "
            "entered; every rank absent from it dumped before it stopped (rank k among "
            "them), each proven by its peers' completions to have gone on after its dump, "
            "and any of them may have stopped there"
        )
    elif scn.fault == "hang-while-dumped":
        why = (
            "the ranks that dumped after rank k stopped stand at the collective it never "
            "entered; of the ranks absent from it, those that dumped before it stopped are "
            "proven (by their peers' completions) to have gone on after their dumps: rank k "
            "is the one whose own evidence is not shown older"
        )
    elif lost and scn.truth == "desync":
        why = (
            f"rank(s) {lost} died of the mismatch (gloo aborts on a size it did not expect) "
            "and left no dump: a consequence, named after the desync"
        )
    doc = {
        "scenario": scn.name,
        "world": world,
        "job": scn.text.replace("rank k", f"rank {k}").replace("stage k", f"stage {k}"),
        "torch": torch.__version__,
        "backend": "gloo",
        "buffer": [scn.buffer(r) for r in range(world)],
        "dumps_in_turn_ms": scn.spacing_ms or None,
        "dump_order": dump_order(scn, world) if scn.spacing_ms else None,
        "truth": {"kind": scn.truth, "ranks": truth_ranks},
        "verdict": {"kind": verdict, "ranks": ranks, "why": why},
        "no_dump": lost,
        "ranks": facts,
    }
    (out / "expected.json").write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="<scenario>-<world> to make (default: all)")
    parser.add_argument("--out", default=str(HERE), help="folder (default: beside this script)")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--missing", action="store_true", help="only runs not made yet")
    args = parser.parse_args(argv)
    runs = [(s, w) for s in SCENARIOS for w in (4, 8)]
    if args.list:
        print("\n".join(f"{s.name}-{w}" for s, w in runs))
        return 0
    if args.names:
        runs = [(s, w) for s, w in runs if f"{s.name}-{w}" in args.names]
    if args.missing:
        made = Path(args.out)
        runs = [(s, w) for s, w in runs if not (made / f"{s.name}-{w}" / "expected.json").exists()]
    for scn, world in runs:
        t0 = time.monotonic()
        doc = run(scn, world, Path(args.out))
        print(
            f"{scn.name}-{world}: {time.monotonic() - t0:.1f} s, verdict {doc['verdict']}, "
            f"no dump {doc['no_dump']}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Synthetic multi-node jobs as ``Recording``s, for the analyzer's unit tests.

A job of ``nodes * ranks_per_node`` ranks runs ``steps`` AllReduces on one
world communicator (and optionally a split one).  Each step a rank computes
for ``compute_ms`` (plus ``slow_ms`` for the slow rank), then enters the
collective; in blocking mode every rank returns when the last one has
arrived plus the transfer time, so the last to arrive waits least.  In async
mode calls return at once and the step ends when the transfer is done.
Faults shape the last steps the way the lab's faults do.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from stallwatch.dumpers.layout import LINK, LINK_COUNTERS, UNKNOWN_U64, LinkEvent, LinkKind
from stallwatch.dumpers.model import (
    Clock,
    CommInfo,
    LinkInfo,
    ProcessInfo,
    Recording,
    Ring,
    Trigger,
    TriggerKind,
)
from stallwatch.dumpers.schema import (
    EXIT_EVENT,
    NCCL_EVENT,
    PREV_PID_UNKNOWN,
    SCHED_EVENT,
    TCP_EVENT,
    DataType,
    ExitEvent,
    Op,
    State,
    TcpEvent,
    split_hash,
)

LINK_EVENT = LINK.dtype
WORLD = 0x5EED_0000_0000_0001
MS = 1_000_000


@dataclass(frozen=True)
class Job:
    nodes: int = 2
    ranks_per_node: int = 2
    steps: int = 40
    mode: str = "blocking"  # or "async"
    compute_ms: float = 10.0
    xfer_ms: float = 2.0
    jitter_ms: float = 0.5
    hang: tuple[int, int] | None = None  # (rank, step)
    crash: tuple[int, int, int] | None = None  # (rank, step, signal)
    peers_fail: bool = False  # after a crash, the others' calls fail and they exit 4
    # after a crash, the others exit 4 this long after it, no call of theirs
    # failing (their error surfaced outside NCCL calls: a stream sync)
    peers_exit_ms: float | None = None
    wall_skew_ns: dict[int, int] = field(default_factory=dict)  # node -> wall clock offset
    mismatch: tuple[int, int, str] | None = None  # (rank, step, field)
    slow: tuple[int, float] | None = None  # (rank, extra ms per step)
    loss_node: int | None = None
    # each lossy step held by a retransmission timeout this long (0: fast
    # retransmits only): its retransmits are the timeouts, sent once it expired
    loss_rto_ms: float = 0.0
    # the loss node's packets dropped on the way in only, in every collective
    # from the fault's step: its peers retransmit into it, it retransmits
    # nothing (a slow reader's full queues, or a NIC dropping what it receives)
    loss_into: bool = False
    cpuhog: int | None = None  # rank
    hog_shared: int | None = None  # a rank sharing the hogged CPU: starved alike
    hog_all: bool = False  # every rank starved alike (other work on every CPU)
    # a rank starved of CPU from the fault's step that enters on time: every
    # collective takes inside_ms longer (its part of it waits for its CPU),
    # and it waits that long in the run queue each step
    starved_inside: int | None = None
    inside_ms: float = 60.0
    # every rank waits this long in the run queue each step, all along,
    # behind processes outside the job (the machine's other work)
    background_wait_ms: float = 0.0
    # a rank starved (1.2 s of run-queue waits) before the fault's step only
    starved_before: int | None = None
    # who held the CPU when each wait ended: "outside" (a hog, HOG_PID),
    # "job" (another rank of the node: too few CPUs for the job), "unknown"
    # (a dump before format 5)
    held_by: str = "outside"
    skew_ns: dict[int, int] = field(default_factory=dict)  # node -> offset
    wrap: dict[int, int] = field(default_factory=dict)  # node -> rows dropped (oldest)
    split: bool = False
    seed: int = 1
    # network faults from a step: a node cut off for good (cut), or for
    # flap_ms and back (flap); its connections reset (reset); a connection
    # between two nodes stopped (link: (node, node, step); with flap, the
    # flap stops that pair's connection alone); with_state False:
    # the TCP rows carry no connection state (dumps before format 7)
    cut: tuple[int, int] | None = None  # (node, step)
    flap: tuple[int, int, float] | None = None  # (node, step, ms)
    reset: tuple[int, int] | None = None  # (node, step)
    link: tuple[int, int, int] | None = None
    # the collective of a step held by loss on a node's connections past the
    # dump: retransmits all along, acknowledged between them (never two
    # timeouts in a row for a second), the last ``lossy_quiet_ms`` before it
    lossy_stall: tuple[int, int] | None = None  # (node, step)
    lossy_quiet_ms: float = 0.0
    # a node's link choked for one step's collective (node, step, ms): it is
    # held ms longer, the node's connections retransmitting all along inside
    # it, each a timeout acknowledged before the next (a rate-capped link's
    # queue), then the job goes on; node -1: every link choked alike
    choke: tuple[int, int, float] | None = None
    # after a flap's last timeout, each stopped connection retransmits again
    # without a timeout (acknowledged, then resending what was lost: the
    # lab's flaps show it within milliseconds of the link's return)
    flap_resent: bool = False
    dump_after_ms: float = 5000.0  # the dumps taken this long after the job's last step
    with_state: bool = True
    # the dumps end with each connection's state then (tcp_info rows, format
    # 8 on); lost_timeouts: the last timeouts of each stopped connection left
    # no row (the kernel skipped its program, or ran the timer late)
    at_dump: bool = False
    lost_timeouts: int = 0
    # a node's link loses its carrier at the network fault's step (cut: for
    # good; flap: for flap_ms); rdma: the job's traffic crosses no TCP
    # connection (InfiniBand): the link ring is all the network evidence;
    # unused_link: the link that goes down is one no rank uses
    link_down: bool = False
    rdma: bool = False
    unused_link: bool = False
    # fail-slow: the slow rank, the CPU hog and the lossy link act from this
    # step on (0: from the start); every rank computes ``all_slow_ms`` longer
    # from it (a job-wide slowdown: shared storage); ``slowdown_by``: the node
    # whose agent raised the incident as a slowdown (the others dumped it at
    # its request)
    from_step: int = 0
    all_slow_ms: float = 0.0
    slowdown_by: int | None = None
    # checkpoints: every N steps, every rank computes M ms longer (healthy)
    pause: tuple[int, float] | None = None
    # other traffic (not the job's) failing from the fault's step on: a node
    # sends to another and retransmits (sampled rows, one a second)
    others: tuple[tuple[int, int], ...] = ()
    # the lab's shape instead of one world AllReduce a step: each node's
    # ranks share a pair communicator (an AllGather after the compute, then
    # a ReduceScatter and a small AllReduce entered together, in any order;
    # each done 50 us after its last member entered),
    # then ranks of one local index across nodes an AllReduce (data parallel)
    lab_shape: bool = False

    @property
    def nranks(self) -> int:
        return self.nodes * self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node


HOG_PID = 4242  # no rank's


def pid_of(rank: int) -> int:
    return 1000 + rank


def host_of(node: int) -> str:
    return f"node{node}"


def _row(
    rank: int, nranks: int, seq: int, ts: int, end: int, comm_hash: int, crank: int
) -> np.void:
    r: np.void = np.zeros(1, dtype=NCCL_EVENT)[0]
    r["ts_ns"], r["end_ns"], r["pid"], r["tid"] = ts, end, pid_of(rank), pid_of(rank)
    r["kind"], r["size"] = 1, NCCL_EVENT.itemsize
    r["comm"], r["comm_hash"], r["count"], r["bytes"] = 0x1000 + rank, comm_hash, 1024, 4096
    r["seq"], r["rank"], r["nranks"], r["peer"] = seq, crank, nranks, -1
    r["result"] = 0 if end else -1
    r["op"], r["datatype"], r["redop"] = Op.ALL_REDUCE, DataType.FLOAT32, 0
    r["state"] = State.COMPLETED if end else State.SCHEDULED
    return r


Window = tuple[int, int, bool]  # entry, return, whether a lossy link slowed it


def pair_hash(node: int) -> int:
    return 0x9A17_0000_0000_0000 + node


def dp_hash(local: int) -> int:
    return 0xD9_0000_0000_0000 + local


PAIR_KINDS = ((Op.ALL_GATHER, 1024), (Op.REDUCE_SCATTER, 1024), (Op.ALL_REDUCE, 8))
# within a node, a collective whose members enter together takes microseconds
# (the lab's: its later pair collectives' median is under the 1 ms the
# analyzer takes for calls that return at once)
PAIR_XFER_NS = 50_000


def _lab_timeline(job: Job) -> tuple[dict[int, list[np.void]], int, dict[int, list[Window]]]:
    """``Job.lab_shape``: per step, each node's pair collectives, then the
    data-parallel AllReduces (every rank returns when the last of its
    communicator entered, plus the transfer time)."""
    rng = np.random.default_rng(job.seed)
    rows: dict[int, list[np.void]] = {k: [] for k in range(job.nodes)}
    windows: dict[int, list[Window]] = {k: [] for k in range(job.nodes)}
    slow_rank, slow_ms = job.slow if job.slow else (-1, 0.0)
    per, xfer = job.ranks_per_node, int(job.xfer_ms * MS)
    t = 1_000 * MS

    def jitter() -> int:
        return int(rng.uniform(0, job.jitter_ms) * MS)

    def collective(members: list[int], entries: dict[int, int], seq: int, chash: int,
                   op: int, count: int, comm_base: int, xfer: int) -> int:  # fmt: skip
        done = max(entries[r] for r in members) + xfer
        for crank, r in enumerate(members):
            row = _row(r, len(members), seq, entries[r], done, chash, crank)
            row["op"], row["count"], row["bytes"] = op, count, count * 4
            row["comm"] = comm_base + r
            rows[job.node_of(r)].append(row)
            windows[job.node_of(r)].append((entries[r], done, False))
        return done

    for step in range(job.steps):
        extra = {r: slow_ms if r == slow_rank and step >= job.from_step else 0.0
                 for r in range(job.nranks)}  # fmt: skip
        ready = {r: t + int((job.compute_ms + extra[r]) * MS) + jitter() for r in range(job.nranks)}
        after = {}
        for k in range(job.nodes):
            pair = [k * per + i for i in range(per)]
            entries = ready
            for i, (op, count) in enumerate(PAIR_KINDS):
                done = collective(pair, entries, step * len(PAIR_KINDS) + i, pair_hash(k),
                                  op, count, 0x3000, PAIR_XFER_NS)  # fmt: skip
                entries = {r: done + jitter() for r in pair}
            after.update(entries)
        ends = []
        for local in range(per):
            dp = [k * per + local for k in range(job.nodes)]
            ends.append(
                collective(dp, after, step, dp_hash(local), Op.ALL_REDUCE, 4096, 0x4000, xfer)
            )
        t = max(ends)
    return rows, t, windows


def _timeline(job: Job) -> tuple[dict[int, list[np.void]], int, dict[int, list[Window]]]:
    """Rows per node (true time), the end of the job, and windows per node."""
    if job.lab_shape:
        return _lab_timeline(job)
    rng = np.random.default_rng(job.seed)
    n = job.nranks
    rows: dict[int, list[np.void]] = {k: [] for k in range(job.nodes)}
    windows: dict[int, list[Window]] = {k: [] for k in range(job.nodes)}
    t = 1_000 * MS
    stop = {r: job.steps for r in range(n)}
    for fault in (job.hang, job.crash):
        if fault is not None:
            stop[fault[0]] = fault[1]
    slow_rank, slow_ms = job.slow if job.slow else (-1, 0.0)
    if job.cpuhog is not None:
        slow_rank, slow_ms = job.cpuhog, 15.0
    slowed = {slow_rank} | ({job.hog_shared} if job.hog_shared is not None else set())
    cut_step = _cut_step(job)
    for step in range(job.steps):
        faulty = step >= job.from_step
        # a lossy link slows the collectives whose packets it drops (half of
        # them), by far more than the jitter: retransmits fall inside exactly those
        lossy = job.loss_node is not None and (step % 2 == 0 or job.loss_into) and faulty
        xfer = job.xfer_ms * (8 if lossy else 1) + (job.loss_rto_ms if lossy else 0.0)
        if job.flap is not None and step == job.flap[1]:
            xfer += job.flap[2]
        if job.choke is not None and step == job.choke[1]:
            xfer += job.choke[2]
        if job.starved_inside is not None and faulty:
            xfer += job.inside_ms
        arrive = {}
        for r in range(n):
            extra = slow_ms if r in slowed and faulty else 0.0
            extra += job.all_slow_ms if faulty else 0.0
            if job.pause is not None and step and step % job.pause[0] == 0:
                extra += job.pause[1]
            ms = job.compute_ms + extra + rng.uniform(0, job.jitter_ms)
            arrive[r] = t + int(ms * MS)
        entered = [r for r in range(n) if step < stop[r]]
        hung = len(entered) < n or (job.mismatch is not None and step == job.mismatch[1])
        hung |= step == cut_step
        done = max(arrive.values()) + int(xfer * MS)
        for r in entered:
            blocked_end = 0 if hung else done
            end = arrive[r] + 20_000 if job.mode == "async" else blocked_end
            row = _row(r, n, step, arrive[r], end, WORLD, r)
            if hung and job.mode == "async":
                row["state"] = State.ENQUEUED  # returned; never completes without the hung rank
            rows[job.node_of(r)].append(row)
            windows[job.node_of(r)].append((arrive[r], done, lossy))
        t = done
        if hung:
            return rows, t, windows
    return rows, t, windows


def _cut_step(job: Job) -> int | None:
    """The step whose collective never ends: the network stopped under it."""
    if job.cut is not None:
        return job.cut[1]
    if job.link is not None and job.flap is None:  # with a flap: that pair's flap
        return job.link[2]
    if job.lossy_stall is not None:
        return job.lossy_stall[1]
    return None


def _split_rows(job: Job, rows: dict[int, list[np.void]]) -> None:
    """A split communicator (color = rank % 2) doing one collective per world step."""
    sh = split_hash(WORLD, 0, 0)
    for lst in rows.values():
        extra = []
        for r in lst:
            rank = int(r["rank"])
            if rank % 2 == 0:
                x = r.copy()
                x["comm_hash"], x["rank"], x["nranks"], x["comm"] = sh, -1, -1, 0x2000 + rank
                x["ts_ns"] += 1
                extra.append(x)
        lst.extend(extra)


def recordings(job: Job, incident: str = "inc-1") -> list[Recording]:
    rows, t_end, windows = _timeline(job)
    if job.split:
        _split_rows(job, rows)
    if job.mismatch is not None:
        _apply_mismatch(job, rows)
    if job.reset is not None:
        _apply_reset(job, rows)
    now = t_end + int(job.dump_after_ms * MS)
    return [_node(job, k, rows[k], windows[k], now, incident) for k in range(job.nodes)]


RESET_FAIL_MS = 5.0  # a rank's call fails this long after its connections are reset
RESET_EXIT_MS = 5.0  # and it exits 4 this long after


def _step_entry(rows: dict[int, list[np.void]], step: int) -> int:
    """When the first rank entered the step's collective."""
    return min(int(r["ts_ns"]) for lst in rows.values() for r in lst if int(r["seq"]) == step)


def _apply_reset(job: Job, rows: dict[int, list[np.void]]) -> None:
    """Every rank's call of the reset step fails (REMOTE_ERROR) after the reset;
    the later steps are gone (they exited)."""
    assert job.reset is not None
    step = job.reset[1]
    t = _step_entry(rows, step)
    for k, lst in rows.items():
        rows[k] = [r for r in lst if int(r["seq"]) <= step]
        for r in rows[k]:
            if int(r["seq"]) == step:
                r["end_ns"], r["result"] = t + int(RESET_FAIL_MS * MS), 6


def _apply_mismatch(job: Job, rows: dict[int, list[np.void]]) -> None:
    assert job.mismatch is not None
    rank, step, fld = job.mismatch
    for r in rows[job.node_of(rank)]:
        if int(r["rank"]) == rank and int(r["seq"]) == step and int(r["comm_hash"]) == WORLD:
            # bytes as the probe writes them: the count times the datatype's size
            if fld == "count":
                r["count"], r["bytes"] = 2048, 2048 * 4
            elif fld == "dtype":
                r["datatype"], r["bytes"] = DataType.FLOAT16, int(r["count"]) * 2
            elif fld == "op":
                r["op"] = Op.ALL_GATHER


def _node(
    job: Job, k: int, lst: list[np.void], windows: list[Window], now: int, incident: str
) -> Recording:
    skew = job.skew_ns.get(k, 0)
    ranks = [r for r in range(job.nranks) if job.node_of(r) == k]
    arr = np.array(sorted(lst, key=lambda r: int(r["ts_ns"])), dtype=NCCL_EVENT)
    arr["ts_ns"] = arr["ts_ns"].astype(np.int64) + skew
    arr["end_ns"] = np.where(arr["end_ns"] > 0, arr["end_ns"].astype(np.int64) + skew, 0)
    dropped = job.wrap.get(k, 0)
    arr = arr[dropped:]
    procs, comms = [], []
    for r in ranks:
        code, sig = None, None
        if job.crash is not None and job.crash[0] == r:
            sig, code = (job.crash[2], None) if job.crash[2] else (None, 1)
        elif (job.crash is not None and job.peers_exit_ms is not None) or job.reset is not None:
            code = 4
        elif job.crash is not None and job.peers_fail:
            code = 4
            mine = np.flatnonzero(arr["pid"] == pid_of(r))
            last = mine[-1]  # its pending call returned REMOTE_ERROR
            arr["end_ns"][last], arr["result"][last] = int(arr["ts_ns"][last]) + 5 * MS, 6
        procs.append(
            ProcessInfo(
                pid_of(r),
                "python",
                "train.py",
                1,
                0,
                ("libnccl.so.2",),
                exit_code=code,
                exit_signal=sig,
            )
        )
        if job.lab_shape:
            local = r % job.ranks_per_node
            comms.append(CommInfo(pid_of(r), 0x3000 + r, pair_hash(k), local, job.ranks_per_node))
            comms.append(CommInfo(pid_of(r), 0x4000 + r, dp_hash(local), k, job.nodes))
        else:
            comms.append(CommInfo(pid_of(r), 0x1000 + r, WORLD, r, job.nranks))
        if job.split and r % 2 == 0:
            comms.append(
                CommInfo(
                    pid_of(r),
                    0x2000 + r,
                    split_hash(WORLD, 0, 0),
                    -1,
                    -1,
                    parent_hash=WORLD,
                    color=0,
                    key=0,
                )
            )
    links, link_rows = _links(job, k, lst, now, skew, ranks)
    rings = {
        "link": Ring(link_rows),
        "nccl": Ring(arr, overwritten=dropped),
        "tcp": Ring(np.concatenate([_tcp(job, k, windows, skew), _net(job, k, lst, now, skew)])),
        "sched": Ring(_sched(job, k, windows, skew)),
        "exit": Ring(_reset_exits(job, k, arr) if job.reset else _exit(job, k, now + skew)),
    }
    trig = Trigger(TriggerKind.PEER, "test", incident, now + skew)
    if job.slowdown_by == k:
        why = "slowdown: pid 1000 (rank 0 of 4 on communicator ...) calls every ..."
        trig = Trigger(TriggerKind.SLOWDOWN, why, incident, now + skew, pid_of(ranks[0]), WORLD)
    return Recording(
        host_of(k),
        f"boot{k}",
        Clock(now + skew, 1_700_000_000 * 10**9 + job.wall_skew_ns.get(k, 0)),
        tuple(procs),
        tuple(comms),
        rings,
        trigger=trig,
        links=links,
    )


def _addr(node: int) -> np.ndarray:
    a = np.zeros(16, dtype=np.uint8)
    a[:4] = (10, 0, 0, node + 1)
    return a


def _tcp(job: Job, k: int, windows: list[Window], skew: int) -> np.ndarray:
    out = np.zeros(0, dtype=TCP_EVENT)
    windows = [w for w in windows if w[2]]
    if job.loss_node is None or not windows:
        return out
    peers = [p for p in range(job.nodes) if p != k]
    # retransmits where this node sends into the lossy link: the lossy node on
    # all its connections, the others only towards it
    targets = peers if k == job.loss_node else ([job.loss_node] if k != job.loss_node else [])
    n = len(windows) * len(targets) // (1 if k == job.loss_node else 3)
    if job.loss_into:
        targets = [] if k == job.loss_node else [job.loss_node]
        n = len(windows) * len(targets)
        if not targets:  # its address known from a connection of its own
            own = np.zeros(1, dtype=TCP_EVENT)
            own["ts_ns"], own["pid"], own["family"] = (
                windows[0][0] + skew,
                pid_of(k * job.ranks_per_node),
                2,
            )
            own["event"], own["saddr"], own["daddr"] = (
                TcpEvent.INET_SOCK_SET_STATE,
                _addr(k),
                _addr(peers[0]),
            )
            return own
    out = np.zeros(max(n, 0), dtype=TCP_EVENT)
    for i in range(len(out)):
        a, b, _ = windows[(i * 7) % len(windows)]
        out[i]["ts_ns"] = (a + b) // 2 + skew
        if job.loss_rto_ms:  # a timeout: sent when it expired, backoff 1
            out[i]["ts_ns"] = a + int(job.loss_rto_ms * MS) + skew
            out[i]["conn_known"], out[i]["backoff"] = 1, 1
            out[i]["rto_us"] = int(job.loss_rto_ms * 1000)
        out[i]["pid"] = pid_of(k * job.ranks_per_node)
        out[i]["event"] = TcpEvent.TCP_RETRANSMIT_SKB
        out[i]["saddr"] = _addr(k)
        out[i]["daddr"] = _addr(targets[i % len(targets)])
        out[i]["family"] = 2
    if k != job.loss_node and not len(out):
        return out
    # a state-change row so that every host's own address is known
    return out


def _sched(job: Job, k: int, windows: list[Window], skew: int) -> np.ndarray:
    ranks = [r for r in range(job.nranks) if job.node_of(r) == k]
    rows = []
    # windows are one per rank and step: those from the faulty step on
    hogged = [w for w in windows if w[0] >= _from_ns(job, windows)]
    early = [w for w in windows if w[0] < _from_ns(job, windows)]
    steps = windows[:: len(ranks)] if ranks else []  # one a step

    def wait(r: int, ts: int, delay: int, holder: int) -> None:
        x = np.zeros(1, dtype=SCHED_EVENT)[0]
        x["pid"], x["tid"], x["delay_ns"] = pid_of(r), pid_of(r), delay
        x["prev_pid"], x["ts_ns"] = holder, ts + skew
        rows.append(x)

    for r in ranks:
        starved = job.hog_all or r in (job.cpuhog, job.hog_shared)
        n, delay = (40, 12 * MS) if starved else (2, int(0.2 * MS))
        neighbour = pid_of(ranks[(ranks.index(r) + 1) % len(ranks)])
        holder = {"outside": HOG_PID, "job": neighbour, "unknown": PREV_PID_UNKNOWN}[job.held_by]
        for i in range(min(n, len(hogged))):
            wait(r, hogged[i][0], delay, holder)
        if r == job.starved_inside:
            for w in hogged[:: len(ranks)]:
                wait(r, w[0], int(job.inside_ms * MS), HOG_PID)
        if r == job.starved_before:
            for w in early[: 100 * len(ranks) : len(ranks)]:
                wait(r, w[0], 12 * MS, HOG_PID)
        if job.background_wait_ms:
            for w in steps:
                wait(r, w[0], int(job.background_wait_ms * MS), HOG_PID)
    return np.array(rows, dtype=SCHED_EVENT)


def _from_ns(job: Job, windows: list[Window]) -> int:
    """When the faults acting from ``from_step`` began (windows: a rank's
    per step, in order)."""
    if not job.from_step or not windows:
        return 0
    per_step = max(1, len(windows) // max(job.steps, 1))
    return windows[min(job.from_step * per_step, len(windows) - 1)][0]


def _exit(job: Job, k: int, now: int) -> np.ndarray:
    """The crash (a signal, or exit code 1 when its signal is 0) 4 s before
    the dump; with ``peers_exit_ms``, every other rank's exit 4 after it."""
    if job.crash is None:
        return np.zeros(0, dtype=EXIT_EVENT)
    rows = []
    crashed_at = now - 4_000 * MS
    rank, _, sig = job.crash
    if job.node_of(rank) == k:
        event = ExitEvent.SIGNAL if sig else ExitEvent.EXIT_GROUP
        rows.append((pid_of(rank), event, sig, -1 if sig else 1, crashed_at))
    if job.peers_exit_ms is not None:
        later = crashed_at + int(job.peers_exit_ms * MS)
        rows += [
            (pid_of(r), ExitEvent.EXIT_GROUP, 0, 4, later)
            for r in range(job.nranks)
            if r != rank and job.node_of(r) == k
        ]
    x = np.zeros(len(rows), dtype=EXIT_EVENT)
    for i, (pid, event, signal, code, ts) in enumerate(rows):
        x[i]["pid"], x[i]["event"], x[i]["signal"], x[i]["code"], x[i]["ts_ns"] = (
            pid,
            event,
            signal,
            code,
            ts,
        )
    return x


RTO_MS = 200.0
PORT_BASE = 40000


def _reset_exits(job: Job, k: int, calls: np.ndarray) -> np.ndarray:
    """Every rank of node k exits 4 after its call failed on the reset."""
    ranks = [r for r in range(job.nranks) if job.node_of(r) == k]
    failed = calls["end_ns"][calls["result"] == 6]
    at = int(failed.min()) + int(RESET_EXIT_MS * MS) if len(failed) else 0
    x = np.zeros(len(ranks), dtype=EXIT_EVENT)
    for i, r in enumerate(ranks):
        x[i]["pid"], x[i]["event"], x[i]["code"], x[i]["ts_ns"] = (
            pid_of(r), ExitEvent.EXIT_GROUP, 4, at
        )  # fmt: skip
    return x


def _conn_row(job: Job, k: int, peer: int, ts: int) -> np.void:
    """A row of node k's end of its connection to ``peer`` (ports fixed per pair)."""
    x: np.void = np.zeros(1, dtype=TCP_EVENT)[0]
    x["ts_ns"], x["pid"], x["family"] = ts, pid_of(k * job.ranks_per_node), 2
    x["saddr"], x["daddr"] = _addr(k), _addr(peer)
    x["sport"], x["dport"] = PORT_BASE + 100 * k + peer, PORT_BASE + 100 * peer + k
    x["event"] = TcpEvent.TCP_RETRANSMIT_SKB
    return x


def _timeouts(job: Job, k: int, peer: int, start: int, until: int) -> list[np.void]:
    """Node k's retransmission timeouts on its connection to ``peer`` after
    acknowledgements stopped at ``start``: the RTO doubles each time."""
    out = []
    rto, t, n = int(RTO_MS * MS), start, 0
    while t + rto <= until:
        t += rto
        n += 1
        x = _conn_row(job, k, peer, t)
        if job.with_state:
            x["conn_known"], x["backoff"], x["no_ack_ns"] = 1, n, t - start
            x["rto_us"], x["srtt_us"], x["unacked"] = rto // 1000, 300, 65536
        out.append(x)
        rto *= 2
    return out


def _at_dump(job: Job, k: int, peer: int, now: int, timeouts: int, heard: int) -> np.void:
    """Node k's ``tcp_info`` row of its connection to ``peer`` at its dump:
    ``timeouts`` still unanswered, the peer last heard at ``heard``."""
    x = _conn_row(job, k, peer, now)
    x["event"], x["conn_known"], x["srtt_us"] = TcpEvent.TCP_INFO, 1, 300
    x["backoff"], x["no_ack_ns"] = timeouts, now - heard
    x["rto_us"] = int(RTO_MS * 1000) * 2**timeouts
    return x


LOSS_GAP_MS = 700.0


def _losses(job: Job, k: int, peer: int, start: int, until: int) -> list[np.void]:
    """Node k's retransmits on its connection to ``peer`` from ``start`` to
    ``until`` on a lossy link: a timeout, a second one in a row, then
    acknowledged, again and again (what 10% loss looks like)."""
    out = []
    t, n = start, 0
    while t + int(LOSS_GAP_MS * MS) <= until:
        t += int(LOSS_GAP_MS * MS)
        backoff = 1 + n % 2
        x = _conn_row(job, k, peer, t)
        if job.with_state:
            x["conn_known"], x["backoff"] = 1, backoff
            x["no_ack_ns"] = int(RTO_MS * MS) * (2**backoff - 1)
            x["rto_us"], x["srtt_us"], x["unacked"] = int(RTO_MS * 1000) * backoff, 300, 65536
        out.append(x)
        n += 1
    return out


CHOKE_GAP_MS = 100.0


def _choked(job: Job, k: int, peer: int, start: int, until: int) -> list[np.void]:
    """Node k's retransmits on its connection to ``peer`` through a choked
    link from ``start`` to ``until``: a timeout every CHOKE_GAP_MS, each
    acknowledged before the next (never two in a row)."""
    out = []
    t = start
    while t + int(CHOKE_GAP_MS * MS) <= until:
        t += int(CHOKE_GAP_MS * MS)
        x = _conn_row(job, k, peer, t)
        x["conn_known"], x["backoff"], x["no_ack_ns"] = 1, 1, int(RTO_MS * MS)
        x["rto_us"], x["srtt_us"], x["unacked"] = int(RTO_MS * 1000), 300, 65536
        out.append(x)
    return out


def _links(
    job: Job, k: int, calls: list[np.void], now: int, skew: int, ranks: list[int]
) -> tuple[tuple[LinkInfo, ...], np.ndarray]:
    """Node k's link ring: its one interface seen at the start; where the
    network fault hits node k's link, its carrier lost at the fault's step
    (and back after a flap)."""
    name, kind = ("mlx5_0:1", "rdma") if job.rdma else ("eth0", "netdev")
    users = () if job.unused_link else tuple(pid_of(r) for r in ranks)
    info = LinkInfo(1, name, kind, pids=users)
    first = min(int(r["ts_ns"]) for r in calls) if calls else now
    samples = [(first, first - 1_000 * MS, LinkEvent.SEEN, 1)]
    fault = _network_fault(job) if job.link_down else None
    if fault is not None and fault[0] == k:
        at = [int(r["ts_ns"]) for r in calls if int(r["seq"]) == fault[1]]
        down = min(at) if at else now
        samples.append((down + 3 * MS, down, LinkEvent.CARRIER_DOWN, 0))
        if job.flap is not None:
            up = down + int(job.flap[2] * MS)
            samples.append((up + 3 * MS, up, LinkEvent.CARRIER_UP, 1))
    rows = np.zeros(len(samples), dtype=LINK_EVENT)
    for row, (ts, after, event, carrier) in zip(rows, samples, strict=True):
        for field_name in LINK_COUNTERS:
            row[field_name] = UNKNOWN_U64
        row["ts_ns"], row["after_ns"], row["link"] = ts + skew, after + skew, 1
        row["event"], row["carrier"] = event, carrier
        row["link_kind"] = LinkKind.RDMA if job.rdma else LinkKind.NETDEV
    return (info,), rows


def _net(job: Job, k: int, calls: list[np.void], now: int, skew: int) -> np.ndarray:
    """Node k's rows of a cut, a flap, a reset or a stopped link; and one
    acknowledged retransmit on each of its connections early on (every
    host's own address is then known, as a busy link shows)."""
    if (
        job.cut is None
        and job.flap is None
        and job.reset is None
        and job.link is None
        and job.lossy_stall is None
        and job.choke is None
    ):
        return np.zeros(0, dtype=TCP_EVENT)
    if job.rdma:  # the job's traffic crosses no TCP connection
        return np.zeros(0, dtype=TCP_EVENT)
    first = min(int(r["ts_ns"]) for r in calls) if calls else now
    rows = [_conn_row(job, k, p, first + MS) for p in range(job.nodes) if p != k]
    if job.with_state:
        for x in rows:
            x["conn_known"], x["srtt_us"] = 1, 300
    node, step = _network_fault(job)
    at = [int(r["ts_ns"]) for r in calls if int(r["seq"]) == step]
    start = min(at) if at else now
    touched = [p for p in range(job.nodes) if p != k and (node in (k, p, -1))]
    if job.link is not None:
        a, b = job.link[0], job.link[1]
        touched = [p for p in range(job.nodes) if p != k and {k, p} == {a, b}]
    for a, b in job.others:  # other traffic failing since the fault: a sample a second
        if a == k:
            for i in range(4):
                x = _conn_row(job, k, b, start + (i + 1) * 1_000 * MS)
                x["pid"], x["other"], x["sport"], x["dport"] = 0, 1, 50000 + i, 9500
                rows.append(x)
    if job.reset is not None:
        for p in touched:
            x = _conn_row(job, k, p, start)
            x["event"] = TcpEvent.TCP_SEND_RESET if k == node else TcpEvent.TCP_RECEIVE_RESET
            rows.append(x)
    elif job.lossy_stall is not None:
        for p in touched:
            rows += _losses(job, k, p, start, now - int(job.lossy_quiet_ms * MS))
    elif job.choke is not None:
        for p in touched:
            rows += _choked(job, k, p, start, start + int(job.choke[2] * MS))
    else:
        until = now if job.flap is None else start + int(job.flap[2] * MS)
        for p in touched:
            timeouts = _timeouts(job, k, p, start, until)
            rows += timeouts[: len(timeouts) - job.lost_timeouts]
            if job.flap_resent and job.flap is not None:
                x = _conn_row(job, k, p, until + 5 * MS)
                x["conn_known"], x["srtt_us"], x["rto_us"] = 1, 300, int(RTO_MS * 1000)
                rows.append(x)
            if job.at_dump and job.flap is None:  # still stopped: heard before it stopped
                rows.append(_at_dump(job, k, p, now, len(timeouts), start - 5 * MS))
            elif job.at_dump:  # came back: heard since
                rows.append(_at_dump(job, k, p, now, 0, until + 5 * MS))
    if job.at_dump:
        rows += [_at_dump(job, k, p, now, 0, now - 5 * MS) for p in range(job.nodes)
                 if p != k and p not in touched]  # fmt: skip
    out = np.array(rows, dtype=TCP_EVENT)
    out["ts_ns"] = out["ts_ns"].astype(np.int64) + skew
    return out


def _network_fault(job: Job) -> tuple[int, int]:
    for fault in (job.cut, job.reset, job.lossy_stall):
        if fault is not None:
            return fault[0], fault[1]
    if job.choke is not None:
        return job.choke[0], job.choke[1]
    if job.flap is not None:
        return job.flap[0], job.flap[1]
    assert job.link is not None
    return job.link[0], job.link[2]


def with_(job: Job, **changes: object) -> Job:
    return dataclasses.replace(job, **changes)  # type: ignore[arg-type]


BASE_JOB = Job()

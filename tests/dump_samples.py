"""Real-shaped Recordings for the dump tests: one built by hand, and a
Hypothesis strategy over every field and over ring contents."""

from __future__ import annotations

import contextlib
import dataclasses
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from hypothesis import strategies as st

from stallwatch.dumpers.model import (
    Clock,
    CommInfo,
    LinkInfo,
    ProcessInfo,
    ProgramMisses,
    Recording,
    Ring,
    Trigger,
    TriggerKind,
)
from stallwatch.dumpers.readings import (
    ArgsFrom,
    NcclCall,
    ProcessThreads,
    ThreadReading,
    ThreadState,
)
from stallwatch.dumpers.schema import (
    RING_DTYPES,
    DataType,
    LinkEvent,
    LinkKind,
    Op,
    RedOp,
    State,
    blank_link_rows,
)

U64_MAX = 2**64 - 1


def random_rows(name: str, n: int, seed: int = 0) -> np.ndarray:
    """``n`` rows of ring ``name`` with every byte random (u64 extremes included)."""
    dtype = RING_DTYPES[name]
    raw = np.random.default_rng(seed).integers(0, 256, n * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype)


def nccl_rows(n: int, comm_hash: int = 0xF00D_0000_0000_BEEF) -> np.ndarray:
    rows = np.zeros(n, RING_DTYPES["nccl"])
    rows["ts_ns"] = np.arange(n, dtype=np.uint64) * 1000 + 10**9
    rows["end_ns"] = rows["ts_ns"] + 500
    rows["comm_hash"] = comm_hash
    rows["seq"] = np.arange(n)
    rows["op"] = Op.ALL_REDUCE
    rows["state"] = State.COMPLETED
    rows["count"] = 1 << 20
    return rows


# a raw tracepoint's count (a pair: the runs its second caught), a
# tracepoint's, and one the kernel did not count
SAMPLE_PROGRAMS = (
    ProgramMisses(
        "raw_tracepoint__tcp_retransmit_skb", "tcp_retransmit_skb", "raw_tracepoint", 3, 3
    ),
    ProgramMisses(
        "raw_tracepoint__tcp_retransmit_skb__nested", "tcp_retransmit_skb", "raw_tracepoint", 1
    ),
    ProgramMisses("tracepoint__signal__signal_deliver", "signal_deliver", "tracepoint", 17),
    ProgramMisses("raw_tracepoint__sched_switch", "sched_switch", "raw_tracepoint", None),
)


def sample_recording(
    n_rows: int = 100, host: str = "node-1", incident: str = "inc-1", time_ns: int = 5 * 10**9
) -> Recording:
    """A two-rank node with every ring filled and every field set."""
    hash_ = U64_MAX - 1234  # comm hashes are often above 2**63
    procs = tuple(
        ProcessInfo(
            pid=1000 + i,
            comm="python3",
            cmdline=f"python3 train.py --rank {i}",
            netns=4026531840,
            start_ns=10**9,
            libs=("/usr/lib/libnccl.so.2",),
            exit_ns=0 if i == 0 else 4 * 10**9,
            exit_code=None if i == 0 else 1,
            exit_signal=None if i == 0 else 9,
        )
        for i in range(2)
    )
    comms = tuple(
        CommInfo(
            pid=1000 + i,
            comm=0x7F00_0000_1000 + i,
            comm_hash=hash_,
            rank=i,
            nranks=2,
            parent_hash=0,
            root_addr="10.0.0.1:29500",
            init_ns=10**9 + 5,
        )
        for i in range(2)
    )
    rings = {
        name: Ring(random_rows(name, n_rows // 4 + 1, seed=i), 7, 3)
        for i, name in enumerate(RING_DTYPES)
    }
    rings["nccl"] = Ring(nccl_rows(n_rows, hash_), overwritten=12, lost=1)
    return Recording(
        host=host,
        boot_id="0f3e0c0a-1b2c-4d5e-8f90-123456789abc",
        clock=Clock(monotonic_ns=6 * 10**9, realtime_ns=1_790_000_000 * 10**9),
        processes=procs,
        communicators=comms,
        rings=rings,
        agent_version="0.1.0",
        agent_args=("record", "--stall-timeout", "2"),
        trigger=Trigger(
            TriggerKind.IN_FLIGHT,
            "allreduce seq 57 in flight 2.1 s",
            incident,
            time_ns,
            pid=1000,
            comm_hash=hash_,
            origin_host=host,
        ),
        counters={"events_total": 123456, "drops": 0},
        snapshots=(sample_snapshot(1000, 4 * 10**9), sample_snapshot(1000, 5 * 10**9)),
        links=sample_links(),
        programs=SAMPLE_PROGRAMS,
    )


def sample_links() -> tuple[LinkInfo, ...]:
    """A node's eth0 used by both ranks, its loopback, and an RDMA port one rank opened."""
    eth0 = LinkInfo(
        1, "eth0", "netdev", device="0000:3b:00.0", ifindex=2,
        addresses=("10.0.0.2/24", "fe80::1/64"), mtu=9000, speed_mbps=100_000,
        pids=(1000, 1001), first_ns=10**9,
    )  # fmt: skip
    lo = LinkInfo(2, "lo", "netdev", ifindex=1, addresses=("127.0.0.1/8",), mtu=65536)
    ib = LinkInfo(
        3, "mlx5_0:1", "rdma", device="mlx5_0", port=1, netdev="eth0", link_layer="Ethernet",
        speed_mbps=100_000, pids=(1000,), first_ns=10**9, gone_ns=4 * 10**9,
    )  # fmt: skip
    return (eth0, lo, ib)


def sample_snapshot(pid: int, taken_ns: int) -> ThreadReading:
    """One rank inside ncclAllReduce, its helper thread in user code."""
    call = NcclCall(
        "ncclAllReduce", "/usr/lib/libnccl.so.2", ArgsFrom.FRAME, 0x7F00_0000_1000, 1 << 20,
        DataType.FLOAT32, RedOp.SUM, -1, 0x7F12_0000_0000, 0x7F13_0000_0000,
    )  # fmt: skip
    waiting = ThreadState(
        pid, "python3", "S", "poll_schedule_timeout.constprop.0", 7, (1, 2, 200, 0, 0, 2**64 - 1),
        0x7FFD_0000_1000, 0x7F00_1234_5678,
        ("libc.so.6!poll+0x4f", "libnccl.so.2!ncclAllReduce+0x31", "python3!_start+0x21"),
        "cfi+scanned", call, ("train_step (train.py:88)",),
    )  # fmt: skip
    helper = ThreadState(pid + 7, "pt_helper", "R", "", -2, (), 0, 0, (), "running: not read")
    env = (("LOCAL_RANK", "0"), ("RANK", "0"), ("WORLD_SIZE", "2"))
    proc = ProcessThreads(pid, taken_ns, 2_000_000, env, (waiting, helper))
    gone = ProcessThreads(pid + 1, taken_ns, 1000, (), (), "process gone")
    return ThreadReading(taken_ns, 3_000_000, "request", (proc, gone), "py-spy 0.4.0")


def assert_same(a: Recording, b: Recording) -> None:
    """Field by field; rings by dtype and identical bytes."""
    for name in (
        "host",
        "boot_id",
        "clock",
        "processes",
        "communicators",
        "agent_version",
        "agent_args",
        "trigger",
        "counters",
        "snapshots",
        "links",
        "programs",
    ):
        assert getattr(a, name) == getattr(b, name), name
    assert list(a.rings) == list(b.rings)
    for name, ring in a.rings.items():
        other = b.rings[name]
        assert other.rows.dtype == ring.rows.dtype, name
        assert len(other.rows) == len(ring.rows), name
        assert other.rows.tobytes() == ring.rows.tobytes(), name
        assert (other.overwritten, other.lost) == (ring.overwritten, ring.lost), name


# ---------------------------------------------------------------- strategies

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, U64_MAX)
i32 = st.integers(-(2**31), 2**31 - 1)
text = st.text(max_size=40)


@st.composite
def rings(draw: st.DrawFn) -> dict[str, Ring]:
    names = draw(st.lists(st.sampled_from(sorted(RING_DTYPES)), unique=True, max_size=5))
    out = {}
    for name in names:
        itemsize = RING_DTYPES[name].itemsize
        n = draw(st.integers(0, 20))
        raw = draw(st.binary(min_size=n * itemsize, max_size=n * itemsize))
        extreme = draw(st.sampled_from([None, 0x00, 0xFF]))
        if extreme is not None:  # all-zero or all-ones rows: u64 extremes everywhere
            raw = bytes([extreme]) * len(raw)
        out[name] = Ring(np.frombuffer(raw, RING_DTYPES[name]).copy(), draw(u64), draw(u64))
    return out


processes = st.builds(
    ProcessInfo,
    pid=u32,
    comm=text,
    cmdline=text,
    netns=u64,
    start_ns=u64,
    libs=st.lists(text, max_size=3).map(tuple),
    exit_ns=u64,
    exit_code=st.none() | i32,
    exit_signal=st.none() | i32,
)

communicators = st.builds(
    CommInfo,
    pid=u32,
    comm=u64,
    comm_hash=u64,
    rank=i32,
    nranks=i32,
    parent_hash=u64,
    color=i32,
    key=i32,
    root_addr=text,
    init_ns=u64,
    destroy_ns=u64,
)

calls = st.builds(
    NcclCall,
    symbol=text,
    lib=text,
    args_from=st.sampled_from(ArgsFrom),
    comm=u64,
    count=st.integers(-(2**63), 2**63 - 1),
    datatype=i32,
    redop=i32,
    root=i32,
    sendbuff=u64,
    recvbuff=u64,
)
threads = st.builds(
    ThreadState,
    tid=u32,
    name=text,
    state=text,
    wchan=text,
    syscall=st.integers(-(2**63), 2**63 - 1),
    syscall_args=st.just(()) | st.tuples(u64, u64, u64, u64, u64, u64),
    sp=u64,
    pc=u64,
    frames=st.lists(text, max_size=4).map(tuple),
    unwind=text,
    nccl=st.none() | calls,
    python=st.lists(text, max_size=3).map(tuple),
)
snapshots = st.builds(
    ThreadReading,
    taken_ns=u64,
    took_ns=u64,
    reason=text,
    processes=st.lists(
        st.builds(
            ProcessThreads,
            pid=u32,
            taken_ns=u64,
            took_ns=u64,
            env=st.lists(st.tuples(text, text), max_size=3).map(tuple),
            threads=st.lists(threads, max_size=3).map(tuple),
            error=text,
        ),
        max_size=3,
    ).map(tuple),
    python_tool=text,
)

triggers = st.builds(
    Trigger,
    kind=st.sampled_from(TriggerKind),
    reason=text,
    incident_id=text,
    time_ns=u64,
    pid=u32,
    comm_hash=u64,
    origin_host=text,
)

opt_text = st.none() | text
links = st.builds(
    LinkInfo,
    id=u32,
    name=text,
    kind=st.sampled_from(["netdev", "rdma"]),
    device=opt_text,
    port=st.none() | u32,
    ifindex=st.none() | i32,
    netdev=opt_text,
    link_type=opt_text,
    link_layer=opt_text,
    addresses=st.lists(text, max_size=3).map(tuple),
    mtu=st.none() | u32,
    speed_mbps=st.none() | u32,
    pids=st.lists(u32, max_size=4).map(tuple),
    first_ns=u64,
    gone_ns=u64,
)

recordings = st.builds(
    Recording,
    host=text,
    boot_id=text,
    clock=st.builds(Clock, monotonic_ns=u64, realtime_ns=u64),
    processes=st.lists(processes, max_size=12).map(tuple),
    communicators=st.lists(communicators, max_size=24).map(tuple),
    rings=rings(),
    agent_version=text,
    agent_args=st.lists(text, max_size=4).map(tuple),
    trigger=st.none() | triggers,
    counters=st.dictionaries(text, u64, max_size=5),
    snapshots=st.lists(snapshots, max_size=2).map(tuple),
    links=st.lists(links, max_size=4, unique_by=lambda li: li.id).map(tuple),
)


# ---------------------------------------------------------------- a small real tmpfs


@contextlib.contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``where`` (root only), unmounted after."""
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def remount(where: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(where)], check=True)


def with_link_rows(rec: Recording, node: int) -> Recording:
    """eth0 used by the node's four ranks, an RDMA port by its first; node 1's
    eth0 goes down and comes back, the port counts symbol errors."""
    pids = tuple(p.pid for p in rec.processes)
    events = [LinkEvent.SEEN, LinkEvent.SEEN, LinkEvent.HEARTBEAT]
    if node == 1:
        events += [LinkEvent.CARRIER_DOWN, LinkEvent.CARRIER_UP, LinkEvent.ERRORS]
    rows = blank_link_rows(len(events))
    base = int(rec.rings["nccl"].rows["ts_ns"][0])
    for i, event in enumerate(events):
        rdma = i == 1 or event is LinkEvent.ERRORS
        row = rows[i]
        row["ts_ns"], row["after_ns"] = base + i * 10**9, base + i * 10**9 - 5 if i else 0
        row["link"], row["event"] = (2 if rdma else 1), event
        row["link_kind"] = LinkKind.RDMA if rdma else LinkKind.NETDEV
        row["carrier"] = 0 if event is LinkEvent.CARRIER_DOWN else 1
        if rdma:
            row["port_state"], row["phys_state"], row["symbol_error"] = 4, 5, 7 * i
        else:
            row["operstate"], row["rx_errors"], row["carrier_changes"] = 6, node + i, 2 + i
    links = (
        LinkInfo(1, "eth0", "netdev", ifindex=2, addresses=(f"10.0.{node}.2/24",), mtu=9000,
                 pids=pids, first_ns=base),
        LinkInfo(2, "mlx5_0:1", "rdma", device="mlx5_0", port=1, netdev="eth0",
                 link_layer="Ethernet", speed_mbps=100_000, pids=pids[:1], first_ns=base),
    )  # fmt: skip
    return dataclasses.replace(rec, rings={**rec.rings, "link": Ring(rows)}, links=links)

"""The recorder against real eBPF: uprobes on a small NCCL-ABI library driven
from C, and kernel tracepoints (TCP retransmits, run-queue delay, exits).

One agent (one BPF load) serves most tests: loading takes seconds (and
detaching a perf-event uprobe, the fallback before Linux 6.6, ~0.1 s each).
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from bench.fakenccl import FakeNccl, build, build_private, link_loop
from stallwatch.dumpers.model import Recording
from stallwatch.dumpers.schema import (
    NCCL_SYMBOLS,
    PREV_PID_UNKNOWN,
    Op,
    Result,
    State,
    fold_unique_id,
    split_hash,
)
from stallwatch.recorder import discovery
from stallwatch.recorder.agent import Agent, AgentConfig
from stallwatch.recorder.source import BccSource

pytestmark = pytest.mark.bpf

SCENARIO_OPS = [
    Op.COMM_INIT_RANK,
    *[Op.ALL_REDUCE] * 3,
    Op.BROADCAST,
    Op.REDUCE,
    Op.ALL_GATHER,
    Op.REDUCE_SCATTER,
    Op.BROADCAST,
    Op.ALL_TO_ALL,
    Op.GATHER,
    Op.SCATTER,
    Op.GROUP_START,
    Op.SEND,
    Op.SEND,
    Op.RECV,
    Op.GROUP_END,
    Op.COMM_SPLIT,
    Op.ALL_REDUCE,
    Op.COMM_SPLIT,
    Op.COMM_INIT_RANK_CONFIG,
    Op.ALL_REDUCE,
    Op.COMM_INIT_ALL,
    Op.COMM_FINALIZE,
    Op.COMM_DESTROY,
    Op.COMM_ABORT,
    Op.ALL_REDUCE,
]


@pytest.fixture(scope="module")
def fake() -> FakeNccl:
    return build()


@pytest.fixture(scope="module")
def agent(fake: FakeNccl, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    config = AgentConfig(dump_dir=tmp_path_factory.mktemp("dumps"), host_name="bpf-test")
    a = Agent(config, BccSource(1 << 15, 1_000_000))
    a.attach_library(str(fake.lib), required=True)
    yield a
    a.close()


def run_driver(loop: Path, *args: str) -> dict[str, str]:
    out = subprocess.run(
        [str(loop), *args], check=True, capture_output=True, text=True, timeout=30
    ).stdout
    return dict(line.split(" ", 1) for line in out.splitlines())


def rows_of(rec: Recording, ring: str, pid: int) -> np.ndarray:
    rows = rec.rings[ring].rows
    return rows[rows["pid"] == pid]


def wait_for(what: str, check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_scenario_one_row_per_call_with_the_right_arguments(agent: Agent, fake: FakeNccl) -> None:
    assert isinstance(agent.source, BccSource)
    assert agent.source.probes.attach_method == "uprobe_multi"
    check_scenario(agent, fake)


def test_without_uprobe_multi_perf_event_probes_record_the_same(
    fake: FakeNccl, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel without uprobe_multi links (before 6.6) refuses them with
    EINVAL: the agent falls back to a perf event per probe, same rows."""
    import stallwatch.recorder.uprobes as uprobes

    def refuse(*_: object) -> int:
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))

    monkeypatch.setattr(uprobes, "uprobe_multi_link", refuse)
    a = Agent(AgentConfig(dump_dir=tmp_path, host_name="bpf-perf"), BccSource(1 << 12, 1_000_000))
    try:
        assert a.attach_library(str(fake.lib), required=True) is not None
        assert isinstance(a.source, BccSource)
        assert a.source.probes.attach_method == "perf event"
        assert len(a.source.probes.perf_uprobe_fds) == 2 * len(NCCL_SYMBOLS)
        check_scenario(a, fake)
    finally:
        a.close()


def check_scenario(agent: Agent, fake: FakeNccl) -> None:
    out = run_driver(fake.loop, "scenario", "-", "2", "4")
    pid, comm = int(out["pid"]), int(out["comm"], 16)
    uid = bytes.fromhex(out["uid"])
    h = fold_unique_id(uid)
    rec = agent.recording()
    rows = rows_of(rec, "nccl", pid)
    assert [Op(o) for o in rows["op"]] == [Op.GET_UNIQUE_ID, *SCENARIO_OPS]
    assert (rows["state"] == State.ENQUEUED).all()
    assert (rows["end_ns"] >= rows["ts_ns"]).all()
    init = rows[1]
    assert (init["rank"], init["nranks"], init["comm"], init["comm_hash"]) == (2, 4, comm, h)
    ar = rows[rows["op"] == Op.ALL_REDUCE][:3]
    assert list(ar["seq"]) == [0, 1, 2]
    assert (ar["count"] == 1000).all() and (ar["datatype"] == 7).all()
    assert (ar["bytes"] == 4000).all() and (ar["stream"] == 0x5157).all()
    assert (ar["comm_hash"] == h).all() and (ar["rank"] == 2).all()
    (reduce,) = rows[rows["op"] == Op.REDUCE]  # comm and stream on the stack
    assert (reduce["count"], reduce["datatype"], reduce["redop"], reduce["peer"]) == (11, 4, 2, 3)
    assert (reduce["comm_hash"], reduce["seq"], reduce["stream"]) == (h, 4, 0x5157)
    bcast = rows[rows["op"] == Op.BROADCAST]
    assert list(bcast["peer"]) == [1, 2] and list(bcast["count"]) == [10, 14]
    sends, recvs = rows[rows["op"] == Op.SEND], rows[rows["op"] == Op.RECV]
    assert list(sends["seq"]) == [0, 1] and list(sends["peer"]) == [1, 1]
    assert list(recvs["seq"]) == [0] and list(recvs["peer"]) == [3]
    assert rows[-1]["result"] == Result.INVALID_ARGUMENT and rows[-1]["comm_hash"] == 0


def test_scenario_communicators(agent: Agent, fake: FakeNccl) -> None:
    out = run_driver(fake.loop, "scenario", "-", "1", "2")
    pid, sub, comm2 = int(out["pid"]), int(out["sub"], 16), int(out["comm2"], 16)
    h, h2 = fold_unique_id(bytes.fromhex(out["uid"])), fold_unique_id(bytes.fromhex(out["uid2"]))
    assert h != h2  # ids that share NCCL's header bytes still differ
    rec = agent.recording()
    comms = {c.comm: c for c in rec.communicators if c.pid == pid}
    assert comms[int(out["comm"], 16)].comm_hash == h
    assert comms[int(out["comm"], 16)].root_addr == "10.0.0.1:29500"
    assert (comms[sub].comm_hash, comms[sub].parent_hash) == (split_hash(h, 5, 0), h)
    assert (comms[sub].color, comms[sub].key, comms[sub].rank) == (5, 7, -1)
    assert comms[comm2].comm_hash == h2 and comms[comm2].destroy_ns > 0
    all0, all1 = (comms[int(p, 16)] for p in out["all"].split())
    assert all0.comm_hash == all1.comm_hash != 0 and (all0.rank, all1.rank) == (0, 1)
    rows = rows_of(rec, "nccl", pid)
    on_sub = rows[(rows["op"] == Op.ALL_REDUCE) & (rows["count"] == 19)]
    assert list(on_sub["comm_hash"]) == [split_hash(h, 5, 0)]
    uids = rows_of(rec, "comm", pid)
    (get_id,) = uids[uids["op"] == Op.GET_UNIQUE_ID]
    assert bytes(get_id["unique_id"]) == bytes.fromhex(out["uid"])


def test_split_hash_identical_across_members(agent: Agent, fake: FakeNccl) -> None:
    uid = os.urandom(128).hex()
    a = run_driver(fake.loop, "scenario", uid, "0", "2")
    b = run_driver(fake.loop, "scenario", uid, "1", "2")
    rec = agent.recording()
    subs = {
        c.pid: c.comm_hash
        for c in rec.communicators
        if c.pid in (int(a["pid"]), int(b["pid"])) and c.parent_hash
    }
    assert len(subs) == 2 and len(set(subs.values())) == 1
    assert fold_unique_id(bytes.fromhex(uid)) not in subs.values()


def test_ring_wrap_counts_overwritten_and_keeps_the_comm_table(
    agent: Agent, fake: FakeNccl
) -> None:
    slots = agent.source.rings()["nccl"].capacity
    calls = slots + 1000
    out = run_driver(fake.loop, "wrap", str(calls))
    head_before = agent.source.rings()["nccl"].read_head()
    rec = agent.recording()
    head_after = agent.source.rings()["nccl"].read_head()
    ring = rec.rings["nccl"]
    # The agent records every NCCL process of the machine: beside a parallel
    # suite, other tests' processes write this ring too, and a row of theirs
    # being written as the ring is copied is left out (torn rows never show).
    mine = ring.rows[ring.rows["pid"] == int(out["pid"])]
    others = len(ring.rows) - len(mine)
    assert len(ring.rows) == slots or (len(ring.rows) < slots and others > 0)
    # the head the copy read (others may write on after it)
    assert head_before - slots <= ring.overwritten <= head_after - slots
    assert ring.overwritten >= calls + 2 - slots
    # the driver has exited: its newest rows are all there, none torn
    assert list(mine["seq"]) == list(range(calls - len(mine), calls))
    assert len(mine) > 0  # alone on the machine: every slot (others == 0 above)
    h = fold_unique_id(bytes.fromhex(out["uid"]))
    assert (mine["comm_hash"] == h).all()
    assert not (mine["op"] == Op.COMM_INIT_RANK).any()  # overwritten ...
    (info,) = [c for c in rec.communicators if c.comm == int(out["comm"], 16) and c.comm_hash == h]
    assert (info.rank, info.nranks) == (1, 2)  # ... but kept here
    assert rec.counters["ring_nccl_overwritten"] == ring.overwritten


def test_new_process_with_its_own_library_copy_is_found_within_a_second(
    agent: Agent, fake: FakeNccl, tmp_path: Path
) -> None:
    venv_lib = tmp_path / "venv" / "site-packages" / "nvidia" / "nccl" / "lib"
    venv_lib.mkdir(parents=True)
    shutil.copy(fake.lib, venv_lib / "libnccl.so.2")
    loop = link_loop(venv_lib / "libnccl.so.2", tmp_path / "ncclloop")
    agent.discover()
    with spawn(
        [str(loop), "wrap", "5"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "WAIT": "1"},
    ) as proc:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().startswith("ready")
        started = time.monotonic()
        paths = lambda: {lib.path for lib in agent.libraries.values()}  # noqa: E731
        while str(venv_lib / "libnccl.so.2") not in paths():
            assert time.monotonic() - started < 1.0, "library not attached within a second"
            agent.discover()
            time.sleep(0.25)
        assert proc.pid in agent.scope.inside
        _go(proc)
        proc.wait(10)
    rows = rows_of(agent.recording(), "nccl", proc.pid)
    assert list(rows["op"]) == [Op.GET_UNIQUE_ID, Op.COMM_INIT_RANK] + [Op.ALL_REDUCE] * 5


@contextlib.contextmanager
def spawn(cmd: list[str], **kw: object) -> Iterator[subprocess.Popen[str]]:
    """A child process, killed and reaped (pipes closed) on the way out."""
    proc = subprocess.Popen(cmd, text=True, **kw)  # type: ignore[call-overload]
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(10)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def waiting_python(code: str) -> contextlib.AbstractContextManager[subprocess.Popen[str]]:
    """A Python process that runs ``code`` once it reads a line."""
    return spawn(
        [sys.executable, "-c", f"import sys; sys.stdin.readline()\n{code}"],
        stdin=subprocess.PIPE,
    )


def _go(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()


def test_exit_code_and_fatal_signal_recorded(agent: Agent) -> None:
    with (
        waiting_python("import time; time.sleep(0.1); sys.exit(3)") as coded,
        waiting_python("import time; time.sleep(60)") as killed,
    ):
        for p in (coded, killed):
            agent.source.set_scope(p.pid, tracked=True, excluded=False)
            agent.classify(p.pid)
        _go(coded)
        _go(killed)
        coded.wait(10)
        time.sleep(0.2)
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)

    def exits() -> dict[int, tuple[int | None, int | None, int]]:
        agent.tick()
        return {
            p.pid: (p.exit_code, p.exit_signal, p.exit_ns)
            for p in agent.procs.infos()
            if p.pid in (coded.pid, killed.pid)
        }

    wait_for("both exits", lambda: all(v[2] for v in exits().values()))
    got = exits()
    assert got[coded.pid][:2] == (3, None)
    assert got[killed.pid][:2] == (None, signal.SIGKILL)


RANK_LOOP = """
import sys, time
sys.stdin.readline()
end = time.monotonic() + 2
while time.monotonic() < end:
    time.sleep(0.002)
    x = sum(range(20000))
"""


def test_run_queue_delay_under_a_cpu_hog(agent: Agent) -> None:
    cpu = (os.cpu_count() or 1) - 1

    def pinned() -> None:  # before exec: every row recorded once tracked is on `cpu`
        os.sched_setaffinity(0, {cpu})

    py = [sys.executable, "-c"]
    with (
        spawn([*py, "while True: pass"], preexec_fn=pinned) as hog,
        spawn([*py, RANK_LOOP], stdin=subprocess.PIPE, preexec_fn=pinned) as rank,
    ):
        agent.source.set_scope(rank.pid, tracked=True, excluded=False)
        agent.classify(rank.pid)
        time.sleep(0.1)
        _go(rank)
        rank.wait(20)
    rows = rows_of(agent.recording(), "sched", rank.pid)
    assert len(rows) > 0, "no run-queue delay recorded for the hogged process"
    assert (rows["delay_ns"] >= 1_000_000).all()
    assert (rows["tid"] == rank.pid).all()
    assert (rows["cpu"] == cpu).all()
    # the hog, untracked, is named as the CPU's holder (the only other task on
    # that CPU, bar kernel threads and the idle task)
    holders = rows["prev_pid"].tolist()
    assert hog.pid in holders, holders
    assert rank.pid not in holders and PREV_PID_UNKNOWN not in holders


NS = f"swtest-{uuid.uuid4().hex[:6]}"


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=10)


@pytest.fixture
def lossy_link() -> Iterator[tuple[str, str]]:
    """Namespace ``a`` (10.77.0.1) and ``b`` (10.77.0.2) on a veth pair, with
    30% of a's outgoing packets dropped by nftables."""
    a, b = f"{NS}-a", f"{NS}-b"
    try:
        _sh("ip", "netns", "add", a)
        _sh("ip", "netns", "add", b)
        _sh(
            "ip",
            "link",
            "add",
            f"{NS[-6:]}a",
            "netns",
            a,
            "type",
            "veth",
            "peer",
            "name",
            f"{NS[-6:]}b",
            "netns",
            b,
        )
        for ns, dev, addr in (
            (a, f"{NS[-6:]}a", "10.77.0.1/24"),
            (b, f"{NS[-6:]}b", "10.77.0.2/24"),
        ):
            _sh("ip", "-n", ns, "addr", "add", addr, "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        # loss on the receiver's side: a drop in the sender's own output hook
        # comes back to TCP as a local send error, not always as a retransmit
        nft = ("ip", "netns", "exec", b, "nft")
        _sh(*nft, "add table inet loss")
        _sh(*nft, "add chain inet loss in { type filter hook input priority 0; }")
        _sh(*nft, "add rule inet loss in tcp dport 7777 numgen random mod 100 lt 10 drop")
        yield a, b
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


SERVER = """
import socket
s = socket.create_server(("10.77.0.2", 7777))
c, _ = s.accept()
while c.recv(65536):
    pass
"""
CLIENT = """
import socket, sys, time
sys.stdin.readline()
for _ in range(50):
    try:
        c = socket.create_connection(("10.77.0.2", 7777), timeout=5)
        c.settimeout(None)  # losses back off the sender for seconds at times
        break
    except OSError:
        time.sleep(0.1)
end = time.monotonic() + 2
while time.monotonic() < end:
    c.sendall(b"x" * 65536)
"""


def test_tcp_retransmits_attributed_to_the_owning_process(
    agent: Agent, lossy_link: tuple[str, str]
) -> None:
    a, b = lossy_link
    exec_in = lambda ns: ["ip", "netns", "exec", ns, sys.executable, "-c"]  # noqa: E731
    with (
        spawn([*exec_in(b), SERVER]),
        spawn([*exec_in(a), CLIENT], stdin=subprocess.PIPE) as client,
    ):
        agent.source.set_scope(client.pid, tracked=True, excluded=False)
        agent.classify(client.pid)
        _go(client)
        client.wait(30)
    rows = rows_of(agent.recording(), "tcp", client.pid)
    retrans = rows[rows["event"] == 1]
    assert len(retrans) > 0, "no retransmit attributed to the sending process"
    assert (retrans["dport"] == 7777).all()
    assert bytes(retrans[0]["daddr"][:4]) == bytes([10, 77, 0, 2])


def test_an_excluded_process_is_dropped_in_the_kernel(agent: Agent, fake: FakeNccl) -> None:
    """A process user space excludes (another namespace) leaves no row: the
    programs drop it (this agent is in host scope: user space filters
    nothing); the others are recorded as before."""
    code = (
        f"import ctypes\nlib = ctypes.CDLL({str(fake.lib)!r})\n"
        "for _ in range(5):\n    lib.ncclAllReduce(None, None, 1, 7, 0, None, None)\n"
    )
    with waiting_python(code) as out, waiting_python(code) as kept:
        agent.source.set_scope(out.pid, tracked=False, excluded=True)
        for p in (out, kept):
            _go(p)
            assert p.wait(30) == 0
    rec = agent.recording()
    assert len(rows_of(rec, "nccl", kept.pid)) == 5
    assert len(rows_of(rec, "nccl", out.pid)) == 0


def test_the_loaders_probe_writes_a_row_for_gpu_libraries_only(
    agent: Agent, fake: FakeNccl, tmp_path: Path
) -> None:
    """The discovery probe reads the dynamic loader's list of objects: a
    process loading other libraries (Python's extension modules, an NCCL-ABI
    library named otherwise, loaded then closed) writes no row; loading
    libnccl writes one, under a long folder too, and so does a library whose
    path is too long to read whole (the agent then reads the maps: nothing
    is missed).  Such a row rings the agent's doorbell: poll(2) on it wakes
    an idle agent.  A file name longer than any GPU library's writes none
    (the probe looks for the name's start only in a path's last 48
    characters)."""
    other = tmp_path / ("lib" + "y" * 70 + ".so")
    shutil.copy(build_private(tmp_path).lib, other)
    deep = tmp_path.joinpath(*["d" * 60] * 4)
    deep.mkdir(parents=True)
    shutil.copy(fake.lib, deep / "libnccl.so.2")
    mid = tmp_path.joinpath(*["m" * 60] * 2)  # a path of 150-250 characters
    mid.mkdir(parents=True)
    shutil.copy(fake.lib, mid / "libnccl.so.2")
    assert len(str(mid / "libnccl.so.2")) < 255 < len(str(deep / "libnccl.so.2"))
    code = (
        "import sys, ctypes, _ctypes, decimal, json, sqlite3\n"
        f"_ctypes.dlclose(ctypes.CDLL({str(other)!r})._handle)\n"
        "print('others', flush=True)\n"
        "ctypes.CDLL(sys.stdin.readline().strip())\n"
        "print('loaded', flush=True)\n"
        "sys.stdin.readline()\n"
    )
    agent.discover()  # the dynamic loaders are probed
    assert agent.events is not None
    bell = agent.source.doorbell()
    assert bell is not None
    rung = select.poll()
    rung.register(bell.fd, select.POLLIN)
    for lib in (fake.lib, mid / "libnccl.so.2", deep / "libnccl.so.2"):
        events = discovery.KernelDiscovery(agent.events.ring)
        events.mark()
        with spawn(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        ) as proc:
            assert proc.stdin is not None and proc.stdout is not None
            assert proc.stdout.readline().strip() == "others"
            _, linked, lost = events.pending()
            assert not lost and proc.pid not in linked, "a row without a GPU library"
            bell.clear()  # (other processes of the machine may have rung it)
            assert rung.poll(0) == []
            proc.stdin.write(f"{lib}\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "loaded"
            _, linked, _ = events.pending()
            assert proc.pid in linked, f"no row for {lib}"
            assert rung.poll(0) != [], "the doorbell did not ring"
    bell.close()


def test_a_process_under_another_root_is_found_through_its_own_loader(
    agent: Agent, fake: FakeNccl, tmp_path: Path
) -> None:
    """A chroot, as a container: its own dynamic loader, libc and libnccl,
    at the paths the host has too.  Its exec is a discovery event; the agent
    finds its loader (another file than the host's /lib64/ld-linux), probes
    it, and attaches its libnccl: each by its own inode."""
    root = tmp_path / "root"
    for sub in ("lib", "lib64"):
        (root / sub).mkdir(parents=True)
    shutil.copy(
        os.path.realpath("/lib64/ld-linux-x86-64.so.2"), root / "lib64" / "ld-linux-x86-64.so.2"
    )
    shutil.copy(os.path.realpath("/lib/x86_64-linux-gnu/libc.so.6"), root / "lib" / "libc.so.6")
    shutil.copy(fake.lib, root / "lib" / "libnccl.so.2")
    shutil.copy(fake.loop, root / "ncclloop")
    agent.discover()
    env = {"WAIT": "1", "LD_LIBRARY_PATH": "/lib"}
    with spawn(
        [shutil.which("chroot") or "/usr/sbin/chroot", str(root), "/ncclloop", "wrap", "3"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
    ) as proc:  # fmt: skip
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().startswith("ready")
        wanted = {
            os.stat(root / "lib64" / "ld-linux-x86-64.so.2").st_ino,
            os.stat(root / "lib" / "libnccl.so.2").st_ino,
        }

        def attached() -> set[int]:
            agent.discover()
            libs = {lid.inode for lid in agent.libraries}
            return libs | {lid.inode for lid in agent.attacher.loaders}

        wait_for("the container's loader and libnccl", lambda: wanted <= attached())
        assert proc.pid in agent.scope.inside
        _go(proc)
        proc.wait(10)
    rows = rows_of(agent.recording(), "nccl", proc.pid)
    assert list(rows["op"]) == [Op.GET_UNIQUE_ID, Op.COMM_INIT_RANK] + [Op.ALL_REDUCE] * 3


def test_an_ended_process_leaves_the_kernels_maps(agent: Agent, fake: FakeNccl) -> None:
    out = run_driver(fake.loop, "wrap", "2")
    comm = int(out["comm"], 16)
    source = agent.source
    assert isinstance(source, BccSource)
    pids = {int(k["pid"]) for k in source.maps.items("comms")[0]}
    (pid,) = [p for p in pids if not Path(f"/proc/{p}").exists()][-1:]
    assert pid in {int(s["pid"]) for s in source.maps.communicators()}
    source.forget_process(pid)
    keys, _ = source.maps.items("comms")
    assert pid not in {int(k) for k in keys["pid"]}
    assert (pid, comm) not in {(int(k["pid"]), int(k["comm"])) for k in keys}
    assert pid not in {int(s["pid"]) for s in source.maps.communicators()}


COMM_SLOTS_LOG2 = 14  # bpf/nccl.c
NOBODY = 0x7FFFFFFF  # above any pid_max


def _comm_home(pid: int, comm: int) -> int:
    mixed = ((comm ^ (pid << 48)) * 0x9E3779B97F4A7C15) & (2**64 - 1)
    return mixed >> (64 - COMM_SLOTS_LOG2)


def test_a_communicator_whose_home_slot_is_taken_is_found_beyond_it(
    agent: Agent, fake: FakeNccl
) -> None:
    """Every state slot but one in 16 held by another: a communicator is
    put in the next free slot, and its calls find it there (through
    ``comms``) and count its progress."""
    source = agent.source
    assert isinstance(source, BccSource)
    states = source.maps.comm_states
    taken = np.flatnonzero((states["pid"] == 0) & (np.arange(len(states)) % 16 != 0))
    states["comm"][taken] = 1
    states["pid"][taken] = NOBODY
    try:
        out = run_driver(fake.loop, "wrap", "3")
    finally:
        states["pid"][taken] = 0
        states["comm"][taken] = 0
    comm = int(out["comm"], 16)
    found = source.maps.communicators()
    [(slot, pid)] = [
        (i, int(found["pid"][k]))
        for k, i in enumerate(np.flatnonzero((states["pid"] != 0) & (states["comm"] != 0)))
        if int(found["comm"][k]) == comm
    ]
    assert slot % 16 == 0 and 0 <= (slot - _comm_home(pid, comm)) % len(states) < 32
    [progress] = [p for p in source.comm_progress() if p.comm == comm and p.pid == pid]
    assert progress.calls == 3


def test_a_communicators_last_return_is_its_last_rows_end(agent: Agent, fake: FakeNccl) -> None:
    """The return program touches no communicator state: the agent reads
    when a communicator's last call returned from that call's ring row."""
    out = run_driver(fake.loop, "wrap", "4")
    comm = int(out["comm"], 16)
    [progress] = [p for p in agent.source.comm_progress() if p.comm == comm]
    rows = rows_of(agent.recording(), "nccl", progress.pid)
    last = rows[rows["op"] == Op.ALL_REDUCE][-1]
    assert progress.calls == 4
    assert progress.last_enter_ns == int(last["ts_ns"])
    assert progress.last_return_ns == int(last["end_ns"]) > progress.last_enter_ns


def test_attaching_while_a_process_calls_in_a_loop_misses_no_return(tmp_path: Path) -> None:
    """Probes attached while a process is inside its calls: the return probe
    goes first, so no call is seen entering without its return (a thread
    would otherwise look inside that call forever), and a thread whose last
    return was not seen starts afresh at its next call."""
    from bench.fakenccl import build_private

    fake = build_private(tmp_path)
    late = Agent(AgentConfig(dump_dir=tmp_path, host_name="late"), BccSource(1 << 16, 1_000_000))
    with spawn([str(fake.loop), "pace", "3", "1000000"], stdout=subprocess.PIPE) as loop:
        try:
            time.sleep(0.5)
            late.attach_library(str(fake.lib), required=True)  # while it calls
            loop.communicate(timeout=60)
            assert [c for c in late.source.inflight_calls() if c.pid == loop.pid] == []
            rows = rows_of(late.recording(), "nccl", loop.pid)
        finally:
            late.close()
    assert len(rows) > 1000  # not one stale call and nothing after it
    assert (rows["state"] == State.ENQUEUED).all()
    assert (np.diff(rows["seq"].astype(np.int64)) == 1).all()  # the ring kept the newest

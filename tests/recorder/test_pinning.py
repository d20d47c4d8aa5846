"""The recording pinned under bpffs: it outlives the agent.

Real agents (``stallwatch record`` processes) on the small NCCL-ABI library,
killed with SIGKILL as the OOM killer or an operator would; a C loop calls
ncclAllReduce at a steady rate across the agent's life, its death, the time
no agent runs and the next agent's life.  Every pin folder is this
session's own (``tests.pins``) and removed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.fakenccl import FakeNccl, build
from stallwatch.dumpers.errors import PinError
from stallwatch.dumpers.format import read_dump
from stallwatch.dumpers.model import Recording
from stallwatch.query.credentials import read_local_token
from stallwatch.recorder import compiled, pinning
from stallwatch.recorder.maps import Layout, MapSpec
from tests import pins

STALLWATCH = [sys.executable, "-m", "stallwatch"]


# ---------------------------------------------------------------- layouts (no kernel)


def _layout(value: str = "<u8", entries: int = 64, defines: tuple[str, ...] = ()) -> Layout:
    key = np.dtype("<u4")
    maps = {
        "ring": MapSpec("ring", 2, key, np.dtype([("pos", "<u8"), ("v", value)]), entries, 1024),
        "hash": MapSpec("hash", 1, np.dtype([("a", "<u4"), ("b", "<u4")]), key, 128, 0),
    }
    return Layout(maps, defines)


def test_a_layout_survives_json_and_its_fingerprint_names_every_difference() -> None:
    base = _layout()
    again = Layout.from_json(json.loads(json.dumps(base.to_json())))
    assert again == base and again.fingerprint == base.fingerprint
    others = {
        "map ring: entries 64 there, 128 here": _layout(entries=128),
        "map ring: its record's fields differ": _layout(value="<i8"),
        "map ring: value bytes 16 there, 12 here": _layout(value="<u4"),
        "built with other settings (-DX=1)": _layout(defines=("-DX=1",)),
    }
    for words, other in others.items():
        assert other.fingerprint != base.fingerprint
        assert other.difference(base) == words
    fewer = Layout({"ring": base.maps["ring"]}, ())
    assert fewer.difference(base) == "it has a map hash this agent does not know"
    assert base.difference(base) == "nothing"


# ---------------------------------------------------------------- real agents


@pytest.fixture(scope="module")
def fake() -> FakeNccl:
    return build()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Agent:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, line: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while line not in self.text():
            assert self.proc.poll() is None, self.text()[-3000:]
            assert time.monotonic() < deadline, f"no {line!r} in:\n{self.text()[-3000:]}"
            time.sleep(0.1)

    def dump(self, reason: str) -> Recording:
        body = json.dumps({"reason": reason}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/dump", data=body, method="POST"
        )
        token = read_local_token("127.0.0.1", self.port)  # an agent without a token makes one
        request.add_header("Authorization", f"Bearer {token}")
        with urllib.request.urlopen(request, timeout=60) as response:
            return read_dump(json.loads(response.read())["path"])


def start_agent(fake: FakeNccl, pin_dir: Path, tmp: Path, *extra: str, keep: bool = True) -> Agent:
    """An agent on ``fake``'s library; ``keep``: as a service (--keep-pinned)."""
    port = _free_port()
    log = tmp / f"agent-{port}.log"
    argv = [*STALLWATCH, "record", "--lib", str(fake.lib), "--dump-dir", str(tmp / "dumps")]
    argv += ["--listen", f"127.0.0.1:{port}", "--pin-dir", str(pin_dir), *extra]
    argv += ["--keep-pinned"] if keep else []
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=out)
    return Agent(proc, port, log)


def stop(agent: Agent) -> None:
    if agent.proc.poll() is None:
        agent.proc.send_signal(signal.SIGTERM)
        agent.proc.wait(60)


@pytest.fixture
def pin_dir() -> Iterator[Path]:
    path = pins.pin_dir("pinning")
    yield path
    pins.remove(path)


def pace_rows(rec: Recording, pid: int) -> np.ndarray:
    rows = rec.rings["nccl"].rows
    mine = rows[rows["pid"] == pid]
    return mine[np.argsort(mine["seq"])]


@pytest.mark.bpf
@pytest.mark.slow
def test_killed_agent_loses_nothing_and_the_next_one_records_on(
    fake: FakeNccl, pin_dir: Path, tmp_path: Path
) -> None:
    """A C loop calls ncclAllReduce 300 times a second.  The first
    agent is SIGKILLed 3 s in; the kernel records alone; `dump --pinned`
    reads what it recorded; a second agent adopts the pins: its dump holds
    every call once, in order, from before, during and after the absence
    (the loop stops a second after the adoption, however long that took)."""
    first = start_agent(fake, pin_dir, tmp_path)
    second = loop = None
    try:
        first.wait_for("listening on")
        loop = subprocess.Popen(
            [str(fake.loop), "pace", "600", "300"], stdout=subprocess.PIPE, text=True
        )
        time.sleep(3)
        first.proc.kill()
        first.proc.wait()
        killed = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        time.sleep(2)
        pinned = subprocess.run(
            [*STALLWATCH, "dump", "--pinned", "--pin-dir", str(pin_dir), "--reason", "no agent",
             "--json"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert pinned.returncode == 0, pinned.stderr
        alone = read_dump(json.loads(pinned.stdout)["path"])
        assert alone.trigger is not None and "no agent" in alone.trigger.reason
        rows = pace_rows(alone, loop.pid)
        assert list(rows["seq"]) == list(range(len(rows)))
        assert (rows["ts_ns"] > killed).sum() > 300, "the kernel recorded nothing alone"
        second = start_agent(fake, pin_dir, tmp_path)
        second.wait_for("listening on")
        assert "adopted the pinned recording" in second.text()
        adopted = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        time.sleep(1)
        loop.terminate()
        out, _ = loop.communicate(timeout=60)
        calls = int(out.split()[-1])
        rec = second.dump("after the restart")
        rows = pace_rows(rec, loop.pid)
        assert len(rows) == calls, f"{len(rows)} rows for {calls} calls"
        assert list(rows["seq"]) == list(range(calls))  # no gap, nothing twice
        assert len(np.unique(rows["pos"])) == calls
        ts = rows["ts_ns"]
        assert (ts < killed).sum() > 300 and ((ts > killed) & (ts < adopted)).sum() > 300
        assert (ts > adopted).sum() > 30
    finally:
        if loop is not None and loop.poll() is None:
            loop.kill()
            loop.wait()
        for agent in (first, second):
            if agent is not None:
                stop(agent)
    assert pin_dir.is_dir()  # stopped, the agent left the recording pinned


def _compiler_mapped(pid: int) -> list[str]:
    """BCC's and LLVM's libraries mapped into a process."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return sorted({w for w in maps.split() if "libbcc" in w or "LLVM" in w or "clang" in w})


def _ours_under_bpffs(pin_dir: Path) -> list[str]:
    """What of this pin folder is on bpffs: itself, or a half-made sibling."""
    return sorted(p.name for p in pin_dir.parent.iterdir() if p.name.startswith(pin_dir.name))


@pytest.mark.bpf
def test_ctrl_c_on_a_foreground_agent_leaves_nothing_and_keep_pinned_keeps_it(
    fake: FakeNccl, pin_dir: Path, tmp_path: Path
) -> None:
    """The unit's way (--keep-pinned): SIGTERM leaves the recording pinned
    and a C loop's calls go on being recorded; an agent started by hand then
    adopts it, and Ctrl-C (SIGINT) on it removes every pin: nothing of it is
    left under bpffs (with its fds closed too, nothing holds a probe).  No
    agent maps BCC or LLVM: the first had a loader process compile (and keep
    what it compiled), the second adopted its pins, a third, with nothing
    pinned, loaded the kept programs itself and records."""
    loop = subprocess.Popen([str(fake.loop), "pace", "600", "200"], stdout=subprocess.DEVNULL)
    cache = ("--bpf-cache", str(tmp_path / "bpf-cache"))
    agents: list[Agent] = []

    def started(*args: Any, **kwargs: Any) -> Agent:
        agents.append(start_agent(*args, **kwargs))
        return agents[-1]

    try:
        service = started(fake, pin_dir, tmp_path, *cache)
        service.wait_for("listening on")
        assert "compiled by a loader process, which has exited" in service.text()
        assert "compiled programs kept in" in service.text()
        assert not _compiler_mapped(service.proc.pid)
        stop(service)
        assert service.proc.returncode == 0, service.text()[-3000:]
        assert "the recording stays pinned at" in service.text()
        assert (pin_dir / "links").is_dir() and len(list((pin_dir / "links").iterdir())) >= 2
        by_hand = started(fake, pin_dir, tmp_path, *cache, keep=False)
        by_hand.wait_for("listening on")
        assert "adopted the pinned recording" in by_hand.text()
        # the same build's pins: no loader ran, BCC was never loaded
        assert "pins of this very build: nothing compiled" in by_hand.text()
        assert not _compiler_mapped(by_hand.proc.pid)
        # a start over its own pins takes a fraction of a second: give the
        # loop (200 calls/s) the time to make 200 more calls, recorded
        time.sleep(1.0)
        rows = pace_rows(by_hand.dump("before Ctrl-C"), loop.pid)
        assert len(rows) > 100 and list(rows["seq"]) == list(range(len(rows)))
        by_hand.proc.send_signal(signal.SIGINT)
        assert by_hand.proc.wait(60) == 0, by_hand.text()[-3000:]
        assert "removing the pinned recording" in by_hand.text()
        assert _ours_under_bpffs(pin_dir) == []
        assert loop.poll() is None  # the job runs on, unrecorded
        # nothing pinned now: the next start loads the compile cache's programs itself
        cold = started(fake, pin_dir, tmp_path, *cache, keep=False)
        cold.wait_for("listening on")
        assert "loaded from the compile cache" in cold.text()
        assert "compiled by a loader process" not in cold.text()
        assert not _compiler_mapped(cold.proc.pid)
        assert len(pace_rows(cold.dump("from the cache's programs"), loop.pid)) > 0
        cold.proc.send_signal(signal.SIGINT)
        assert cold.proc.wait(60) == 0, cold.text()[-3000:]
        assert _ours_under_bpffs(pin_dir) == []
    finally:
        for agent in agents:  # a failed step leaves none running
            stop(agent)
        loop.kill()
        loop.wait()


@pytest.mark.bpf
def test_compile_only_fills_the_cache_and_the_first_start_compiles_nothing(
    fake: FakeNccl, pin_dir: Path, tmp_path: Path
) -> None:
    """`record --compile-only` (an install's or a boot's step) compiles for
    this kernel into the cache and attaches nothing; run again it compiles
    nothing; an agent then started with nothing pinned loads the programs
    without a loader process and records."""
    cache = tmp_path / "bpf-cache"
    sizes = ("--ring-size", "4096")
    run = [*STALLWATCH, "record", "--compile-only", "--bpf-cache", str(cache), *sizes]
    first = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout.startswith("compiled the BPF programs for this kernel into"), first.stdout
    entries = list(cache.glob("*.json"))
    assert len(entries) == 1 and entries[0].name in first.stdout
    assert not pin_dir.exists() and _ours_under_bpffs(pin_dir) == []  # nothing pinned
    again = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "(nothing compiled)" in again.stdout, again.stderr
    assert "compiled programs" not in again.stderr
    loop = subprocess.Popen([str(fake.loop), "pace", "600", "200"], stdout=subprocess.DEVNULL)
    agent = start_agent(fake, pin_dir, tmp_path, "--bpf-cache", str(cache), *sizes, keep=False)
    try:
        agent.wait_for("listening on")
        assert "loaded from the compile cache" in agent.text()
        assert "compiled by a loader process" not in agent.text()
        assert not _compiler_mapped(agent.proc.pid)
        time.sleep(0.5)
        assert len(pace_rows(agent.dump("from the prepared programs"), loop.pid)) > 0
    finally:
        stop(agent)
        loop.kill()
        loop.wait()
    assert _ours_under_bpffs(pin_dir) == []


def test_compile_only_names_an_unusable_cache_and_a_contradiction(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")
    for extra, words in (
        (["--bpf-cache", str(blocked / "cache")], f"--bpf-cache {blocked / 'cache'}: "),
        (["--no-bpf-cache"], "--compile-only and --no-bpf-cache"),
    ):
        done = subprocess.run(
            [*STALLWATCH, "record", "--compile-only", *extra],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and words in lines[0], done.stderr


@pytest.mark.bpf
@pytest.mark.slow
def test_a_pin_set_of_another_layout_is_named_and_left_unless_replaced(
    fake: FakeNccl, pin_dir: Path, tmp_path: Path
) -> None:
    first = start_agent(fake, pin_dir, tmp_path, "--ring-size", "4096")
    try:
        first.wait_for("listening on")
        busy = start_agent(fake, pin_dir, tmp_path, "--ring-size", "4096")
        assert busy.proc.wait(180) == 2
        last = busy.text().strip().splitlines()[-1]
        assert "another agent (pid" in last and "records into it" in last, last
    finally:
        stop(first)
    made = json.dumps(sorted(os.listdir(pin_dir / "maps")))
    other = start_agent(fake, pin_dir, tmp_path, "--ring-size", "8192")
    assert other.proc.wait(180) == 2
    last = other.text().strip().splitlines()[-1]
    assert last.startswith("stallwatch record: error: pinned recording at"), last
    assert "has another layout (map " in last and "left in place" in last, last
    assert json.dumps(sorted(os.listdir(pin_dir / "maps"))) == made  # untouched
    replaced = start_agent(fake, pin_dir, tmp_path, "--ring-size", "8192", "--replace-pinned")
    try:
        replaced.wait_for("listening on")
        assert "recording pinned at" in replaced.text()
    finally:
        stop(replaced)
    found = pinning.PinSet.open(pin_dir, read_only=True)
    try:
        assert found.layout.maps["nccl_ring"].max_entries == 8192
    finally:
        found.close()


@pytest.mark.bpf
def test_dump_pinned_with_nothing_pinned_is_one_line(tmp_path: Path) -> None:
    absent = pins.pin_dir("absent")
    proc = subprocess.run(
        [*STALLWATCH, "dump", "--pinned", "--pin-dir", str(absent), "--dump-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"stallwatch dump: error: no pinned recording at {absent}"


@pytest.mark.bpf
def test_a_folder_left_half_made_by_a_dead_agent_is_removed(pin_dir: Path) -> None:
    half = pin_dir.with_name(f"{pin_dir.name}{pinning.NEW_MARK}999999999")
    (half / "maps").mkdir(parents=True)
    live = pin_dir.with_name(f"{pin_dir.name}{pinning.NEW_MARK}{os.getpid()}")
    live.mkdir()
    try:
        pinning._remove_abandoned(pin_dir)
        assert not half.exists()  # its agent is dead: it was never finished
        assert live.exists()  # its maker lives: it may be finishing it
    finally:
        pins.remove(half)
        pins.remove(live)


@pytest.mark.bpf
def test_cleanup_of_something_else_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PinError, match="not on a BPF file system"):
        pinning.cleanup(tmp_path)
    assert tmp_path.is_dir()


def test_the_compile_cache_names_each_map_load_and_binds_new_fds(tmp_path: Path) -> None:
    """Instructions that load a map fd (ld_imm64, src_reg 1) are kept by map
    name with the fd zeroed, and given the new fds when bound; an fd of no
    map of the layout is refused; an entry reads back as it was written."""
    ld_map = struct.pack("<BBhi", 0x18, 0x10 | 1, 0, 7) + struct.pack("<BBhi", 0, 0, 0, 0)
    ld_num = struct.pack("<BBhi", 0x18, 0x01, 0, 7) + struct.pack("<BBhi", 0, 0, 0, 0)
    exit_ = struct.pack("<BBhi", 0x95, 0, 0, 0)
    insns = ld_map + ld_num + ld_map + exit_
    unbound, where = compiled.unbind(insns, {7: "ring"})
    assert where == ((0, "ring"), (4, "ring"))
    assert unbound[4:8] == b"\0\0\0\0" and unbound[20:24] == struct.pack("<i", 7)
    program = compiled.CompiledProgram("p", 2, 48, unbound, where, None)
    bound = compiled.bind(program, {"ring": 42})
    assert compiled.unbind(bound, {42: "ring"}) == (unbound, where)
    with pytest.raises(ValueError, match="loads fd 7, which is no map"):
        compiled.unbind(insns, {8: "ring"})
    entry = compiled.Compiled(
        "k1", "GPL", _layout(), (compiled.CompiledMap("ring", 2, 4, 16, 64, 1024),), (program,)
    )
    compiled.save(tmp_path, entry)
    assert compiled.load(tmp_path, "k1") == entry
    assert compiled.load(tmp_path, "k2") is None  # another build
    compiled.path_for(tmp_path, "k1").write_text("{not json")
    assert compiled.load(tmp_path, "k1") is None  # passed over: the loader compiles
    compiled.path_for(tmp_path, "k1").unlink()
    for n in range(compiled.KEEP_ENTRIES + 2):  # one build after another
        compiled.save(tmp_path, dataclasses.replace(entry, build_key=f"b{n}"))
        made = compiled.path_for(tmp_path, f"b{n}")
        os.utime(made, (1000 + n, 1000 + n))  # in order, whatever the clock's grain
    kept = sorted(p.stem for p in tmp_path.glob("*.json"))
    assert kept == [f"b{n}" for n in range(2, compiled.KEEP_ENTRIES + 2)]


def test_the_build_key_is_the_sources_flags_and_kernel_not_where_the_files_are(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An installed wheel and a checkout of the same sources share a key
    (and so the compile cache); a header that is only included changes it."""
    from stallwatch.recorder import bpfbuild

    flags = bpfbuild.cflags(bpfbuild.RingSizes.from_nccl(4096), 1_000_000)
    here = bpfbuild.build_key(flags)
    copy = tmp_path / "elsewhere" / "bpf"
    copy.mkdir(parents=True)
    for source in bpfbuild.BPF_DIR.glob("*.[ch]"):
        (copy / source.name).write_bytes(source.read_bytes())
    monkeypatch.setattr(bpfbuild, "BPF_DIR", copy)
    moved = bpfbuild.cflags(bpfbuild.RingSizes.from_nccl(4096), 1_000_000)
    assert moved != flags and bpfbuild.build_key(moved) == here
    assert (
        bpfbuild.build_key(bpfbuild.cflags(bpfbuild.RingSizes.from_nccl(8192), 1_000_000)) != here
    )
    events = copy / "events.h"
    assert "events.h" not in bpfbuild.SOURCES  # reached only through #include
    events.write_text(events.read_text() + "\n/* a changed event */\n")
    assert bpfbuild.build_key(moved) != here


def test_compiling_is_one_process_at_a_time_per_build(tmp_path: Path) -> None:
    """The second process to look for a build waits until the first has
    compiled (and kept) it; another build does not wait."""
    import threading

    order: list[str] = []
    inside = threading.Event()

    def first() -> None:
        with compiled.compiling(tmp_path, "k1"):
            inside.set()
            time.sleep(0.3)
            order.append("first done")

    thread = threading.Thread(target=first)
    thread.start()
    inside.wait(10)
    with compiled.compiling(tmp_path, "k2"):
        order.append("other build")  # not held up
    with compiled.compiling(tmp_path, "k1"):
        order.append("second in")
    thread.join()
    assert order == ["other build", "first done", "second in"]
    with compiled.compiling(None, "k1"):  # no cache folder: nothing to hold
        order.append("no cache")
    blocked = tmp_path / "file"
    blocked.write_text("")
    with compiled.compiling(blocked / "cache", "k1"):  # unwritable: compiles anyway
        order.append("unwritable")
    assert order[-2:] == ["no cache", "unwritable"]


@pytest.mark.bpf
def test_agents_starting_together_compile_once(fake: FakeNccl, tmp_path: Path) -> None:
    """Three agents started at once with nothing pinned and an empty cache
    (a lab's nodes, jobs sharing a node): one loader compiles, the other two
    wait for it and load what it kept."""
    cache = ("--bpf-cache", str(tmp_path / "bpf-cache"), "--ring-size", "2048")
    dirs = [pins.pin_dir(f"together{i}") for i in range(3)]
    agents = [start_agent(fake, d, tmp_path, *cache, keep=False) for d in dirs]
    try:
        for agent in agents:
            agent.wait_for("listening on", timeout=300)
        logs = [agent.text() for agent in agents]
        compiled_here = [t for t in logs if "compiled by a loader process" in t]
        loaded = [t for t in logs if "loaded from the compile cache" in t]
        assert len(compiled_here) == 1 and len(loaded) == 2, logs
    finally:
        for agent in agents:
            stop(agent)
        for d in dirs:
            pins.remove(d)


@pytest.mark.bpf
def test_a_pinned_recording_read_alone_names_each_hooks_program_and_its_skipped_runs(
    pin_dir: Path,
) -> None:
    """What ``dump --pinned`` writes in ``programs``: every kernel hook's
    program from its pinned link, as the agent that pinned it attached it
    (the TCP and scheduler families' as raw tracepoints), with the kernel's
    count of skipped runs where it keeps one."""
    from stallwatch.recorder.kernelhooks import misses_counted
    from stallwatch.recorder.source import BccSource, PinnedSource

    source = BccSource(1 << 12, 1_000_000, pins=pinning.PinOptions(pin_dir))
    try:
        live = source.kernel_misses()
        alone = PinnedSource(pinning.PinSet.open(pin_dir, read_only=True))
        try:
            pinned = alone.kernel_misses()
        finally:
            alone.close()
    finally:
        source.close()
    assert [(p.program, p.hook, p.attachment) for p in pinned] == [
        (p.program, p.hook, p.attachment) for p in live
    ]
    attached = {p.hook: p.attachment for p in pinned}
    assert attached["tcp_retransmit_skb"] == attached["sched_switch"] == "raw_tracepoint"
    assert attached["signal_generate"] == "tracepoint"
    assert all((p.misses is not None) == misses_counted() for p in pinned)

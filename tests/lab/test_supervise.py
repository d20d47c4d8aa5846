"""The lab's systemd-style supervisor on small services written for the
test: they speak the notify protocol with the agent's own ``Notifier``.
Real processes, real cgroups (the memory bound is the kernel's), real
signals.  The agent itself under supervision: tests/recorder/test_supervision.py."""

from __future__ import annotations

import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stallwatch.lab.supervise import Service, Supervisor, hung_in

pytestmark = pytest.mark.lab

# A service: READY=1, then WATCHDOG=1 every 0.1 s; its behaviour after
# that is the argument: "ping" forever, "hang" (stops pinging), "exit N",
# "grow" (allocates until the memory bound kills it), "child" (a child
# process sends READY, not the main one), "deaf" (ignores SIGTERM, its
# threads asleep in ``parked_here``).
SERVICE = textwrap.dedent(
    """
    import os, sys, time
    from stallwatch.recorder.notify import Notifier
    what = sys.argv[1:]
    n = Notifier()
    if what[0] == "child":
        if os.fork() == 0:
            Notifier().ready("from a child")
            os._exit(0)
        time.sleep(60)
    n.ready("up")
    if what[0] == "exit":
        sys.exit(int(what[1]))
    if what[0] == "deaf":
        import faulthandler, signal, threading
        faulthandler.enable(all_threads=True)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        def parked_here():
            time.sleep(60)
        for _ in range(2):
            threading.Thread(target=parked_here, daemon=True).start()
        parked_here()
    hold = []
    for i in range(600):
        if what[0] == "grow":
            hold.append(bytearray(8 << 20))
        if what[0] != "hang" or i < 5:
            n.send(WATCHDOG="1")
        time.sleep(0.1)
    """
)


@pytest.fixture
def supervised(tmp_path: Path) -> Iterator[list[Supervisor]]:
    made: list[Supervisor] = []
    yield made
    for sup in made:
        sup.wait_stopped(5)
        sup.log_file.close()


def start(made: list[Supervisor], tmp_path: Path, what: str, **service: object) -> Supervisor:
    name = f"swtest-{len(made)}-{int(time.time() * 1000) % 100000}"
    log = (tmp_path / f"{name}.log").open("w")
    base = {"restart_s": 0.2, "start_timeout_s": 30.0, "stop_timeout_s": 5.0}
    sup = Supervisor(
        name=name,
        argv=[sys.executable, "-c", SERVICE, *what.split()],
        service=Service(**{**base, **service}),  # type: ignore[arg-type]
        notify_path=tmp_path / f"{name}.sock",
        log_file=log,
    )
    made.append(sup)
    sup.start()
    return sup


def kinds(sup: Supervisor) -> list[str]:
    return [e.kind for e in sup.events]


def wait_until(check, timeout: float = 30.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


def test_a_service_that_stops_pinging_is_killed_and_restarted(
    supervised: list[Supervisor], tmp_path: Path
) -> None:
    sup = start(supervised, tmp_path, "hang", watchdog_s=1.0)
    assert sup.wait_ready(2, timeout=60), sup.events
    first_ready = next(e for e in sup.events if e.kind == "ready")
    watchdog = next(e for e in sup.events if e.kind == "watchdog")
    assert 1.0 <= watchdog.at - first_ready.at < 5.0  # five pings, then 1 s of silence
    exits = [e for e in sup.events if e.kind == "exited"]
    assert exits[0].detail == "killed after SIGABRT"
    assert kinds(sup)[:6] == ["started", "ready", "watchdog", "exited", "restarting", "started"]


def test_a_service_that_pings_is_left_alone(supervised: list[Supervisor], tmp_path: Path) -> None:
    sup = start(supervised, tmp_path, "ping", watchdog_s=1.0)
    assert sup.wait_ready(1, timeout=60)
    time.sleep(3)
    assert kinds(sup) == ["started", "ready"]


def test_failures_restart_but_exit_2_does_not(supervised: list[Supervisor], tmp_path: Path) -> None:
    failing = start(supervised, tmp_path, "exit 1", start_limit=3)
    assert wait_until(lambda: "gave-up" in kinds(failing)), failing.events
    assert kinds(failing).count("started") == 3 and kinds(failing).count("ready") == 3
    usage = start(supervised, tmp_path, "exit 2")
    assert wait_until(lambda: "exited" in kinds(usage))
    time.sleep(1)
    assert kinds(usage) == ["started", "ready", "exited"]
    assert usage.events[-1].code == 2


def test_the_memory_bound_kills_and_the_service_comes_back(
    supervised: list[Supervisor], tmp_path: Path
) -> None:
    sup = start(supervised, tmp_path, "grow", memory_max=96 << 20)
    assert wait_until(lambda: kinds(sup).count("started") >= 2, 60), sup.events
    exited = next(e for e in sup.events if e.kind == "exited")
    assert exited.code == -9 and "killed by its memory bound" in exited.detail, exited
    assert sup.cgroup is not None and sup.cgroup.oom_kills() >= 1


def test_only_the_main_process_is_heard(supervised: list[Supervisor], tmp_path: Path) -> None:
    sup = start(supervised, tmp_path, "child", start_timeout_s=3.0)
    assert wait_until(lambda: "start-timeout" in kinds(sup), 30), sup.events
    assert "ready" not in kinds(sup)[: kinds(sup).index("start-timeout")]


def test_a_service_deaf_to_sigterm_is_aborted_and_says_where_it_was(
    supervised: list[Supervisor], tmp_path: Path
) -> None:
    sup = start(supervised, tmp_path, "deaf")
    assert sup.wait_ready(1, timeout=60), sup.events
    time.sleep(0.3)  # past its signal(SIGTERM, SIG_IGN)
    problem = sup.wait_stopped(1.0)
    assert problem is not None and problem.startswith(f"{sup.name} ignored SIGTERM for 1 s")
    assert sup.hung_in.startswith("signalled thread: parked_here (<string>:"), sup.hung_in
    assert "2 threads: parked_here (<string>:" in sup.hung_in, sup.hung_in
    assert problem.endswith(f"(it was in {sup.hung_in})")


# what faulthandler wrote for an agent stuck at its end: the main thread
# joins a worker at the interpreter's exit, the worker waits in a request
REPORT = """2026-11-28 06:14:57,137 stallwatch record: INFO stopped
Fatal Python error: Aborted

Thread 0x00007f1c3df9c6c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/opt/v/lib/python3.11/site-packages/stallwatch/query/server.py", line 88 in answer
  File "/usr/lib/python3.11/concurrent/futures/thread.py", line 58 in run

Thread 0x00007f1c3df9c6d0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/opt/v/lib/python3.11/site-packages/stallwatch/query/server.py", line 88 in answer

Current thread 0x00007f1c3eddfb80 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 1132 in _wait_for_tstate_lock
  File "/usr/lib/python3.11/concurrent/futures/thread.py", line 31 in _python_exit
"""


def test_the_report_names_each_threads_innermost_frame_and_its_own_code() -> None:
    assert hung_in(REPORT) == (
        "signalled thread: _wait_for_tstate_lock (threading.py:1132); "
        "2 threads: wait (threading.py:320) under answer (server.py:88)"
    )


def test_no_report_no_place() -> None:
    assert hung_in("") == ""
    assert hung_in("INFO stopped\nTraceback (most recent call last):\n") == ""
    # an earlier report, then a restart that wrote none: the last report is read
    assert hung_in(REPORT + "INFO stopped\n").startswith("signalled thread")

"""The agent's main loop and what stops it (``recorder.service`` runs them).

Each tick (200 ms; 1 s when there is nothing to watch, or at once when the
kernel rings its doorbell, a link changes or a signal comes): discovery, the
watchdog's checks and dumps, the pinned folder looked at, and the service
manager told that the loop turns.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .agent import Agent
    from .notify import Notifier

TICK_S = 0.2
# Nothing to watch (no process in scope, nothing in flight, nobody to look
# at): the loop wakes this often, or at once when the kernel rings its
# doorbell (a process loaded a GPU library) or a signal comes.
IDLE_TICK_S = 1.0
DISCOVERY_S = 0.25  # the /proc scan's period where there are no kernel events


class Stop:
    """What the signal handlers set; the loop reads it between ticks, and
    waits on its pipe, so that a signal ends the wait at once."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.dump_requested = False
        self.fd, self._write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def set(self) -> None:
        self.event.set()
        self.wake()

    def request_dump(self) -> None:
        self.dump_requested = True
        self.wake()

    def wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # full: a wake-up is pending anyway
            os.write(self._write_fd, b"\0")

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.fd, 64):
                pass


def run_loop(agent: Agent, stop: Stop, notifier: Notifier | None = None) -> None:
    """Each tick (200 ms; 1 s when there is nothing to watch, or when the
    kernel rings): discovery (the kernel's events, or a /proc scan every
    250 ms where there are none), the watchdog checks and dumps, and the
    service manager hears that the loop turns (a wedged agent stops pinging
    and is restarted)."""
    bell = agent.source.doorbell()
    waits = select.poll()
    waits.register(stop.fd, select.POLLIN)
    if bell is not None:
        waits.register(bell.fd, select.POLLIN)
    if agent.links.fd is not None:  # a link changed: sample it now, not at the next tick
        waits.register(agent.links.fd, select.POLLIN)
    next_discovery = 0.0
    try:
        while not stop.event.is_set():
            now = time.monotonic()
            if agent.events is not None or now >= next_discovery:
                agent.discover()
                next_discovery = now + DISCOVERY_S
            if agent.positions.startup is None:
                agent.positions.take_startup()  # what the job was doing before we came
            if stop.dump_requested:
                stop.dump_requested = False
                agent.request_dump("SIGUSR1", by_client=False)
            agent.incidents.tick(agent.tick())
            agent.watch_pins()
            if notifier is not None:
                notifier.ping()
            waits.poll(1000 * (TICK_S if agent.busy() else IDLE_TICK_S))
            stop.drain()
            if bell is not None:
                bell.clear()  # before discovery reads the rows: a later one rings again
    finally:
        if bell is not None:
            bell.close()

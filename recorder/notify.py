"""The service manager's notify protocol (sd_notify), without systemd's libraries.

Under ``Type=notify`` systemd passes ``$NOTIFY_SOCKET`` (a path, or ``@name``
for the abstract namespace) and the agent sends it newline-separated
``KEY=VALUE`` datagrams: ``READY=1`` once it records and serves,
``WATCHDOG=1`` while its main loop turns (``WatchdogSec=``: systemd passes
``$WATCHDOG_USEC``, and kills and restarts an agent that stays silent for
longer: a wedged agent), ``STATUS=`` a line for ``systemctl status``,
``STOPPING=1`` when it shuts down.  ``$WATCHDOG_PID``, when set, names the
process the watchdog is for; another process (a child) sends no pings.

Without ``$NOTIFY_SOCKET`` every call does nothing.  A send that fails is
logged once and never stops the agent.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping

log = logging.getLogger("stallwatch.record")


class Notifier:
    def __init__(self, env: Mapping[str, str] | None = None, pid: int | None = None) -> None:
        env = os.environ if env is None else env
        self.address = _address(env.get("NOTIFY_SOCKET", ""))
        self.interval_s = _watchdog_interval(env, os.getpid() if pid is None else pid)
        self._last_ping = 0.0
        self._warned = False

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, **fields: str) -> bool:
        """One datagram of ``KEY=VALUE`` lines; False if it could not be sent."""
        if self.address is None:
            return False
        text = "\n".join(f"{k}={v}" for k, v in fields.items()).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.sendto(text, self.address)
        except OSError as exc:
            if not self._warned:
                log.warning("cannot notify the service manager at %r: %s", self.address, exc)
                self._warned = True
            return False
        return True

    def ready(self, status: str) -> None:
        self.send(READY="1", STATUS=status)
        self._last_ping = time.monotonic()

    def stopping(self, status: str) -> None:
        self.send(STOPPING="1", STATUS=status)

    def status(self, status: str) -> None:
        self.send(STATUS=status)

    def ping(self, now: float | None = None) -> bool:
        """``WATCHDOG=1`` if half the watchdog interval passed since the last."""
        if self.interval_s is None:
            return False
        now = time.monotonic() if now is None else now
        if now - self._last_ping < self.interval_s / 2:
            return False
        self._last_ping = now
        return self.send(WATCHDOG="1")


def _address(value: str) -> str | bytes | None:
    if not value:
        return None
    if value.startswith("@"):  # the abstract namespace: a leading NUL byte
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    log.warning("ignoring NOTIFY_SOCKET=%r: neither a path nor @name", value)
    return None


def _watchdog_interval(env: Mapping[str, str], pid: int) -> float | None:
    """Seconds of ``$WATCHDOG_USEC``, when this process is the one watched."""
    usec, for_pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if for_pid and (not for_pid.isdigit() or int(for_pid) != pid):
        return None
    return int(usec) / 1e6

"""The agent's side of the service manager's notify protocol, against a real
datagram socket (what systemd listens on), with no systemd anywhere."""

from __future__ import annotations

import os
import secrets
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stallwatch.recorder.notify import Notifier


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    path = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(1.0)
    yield str(path), sock
    sock.close()


def received(sock: socket.socket) -> list[str]:
    out = []
    sock.settimeout(0.05)
    try:
        while True:
            out.append(sock.recv(4096).decode())
    except TimeoutError:
        return out


def test_ready_pings_and_stopping(listener: tuple[str, socket.socket]) -> None:
    path, sock = listener
    n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000"})
    assert n.enabled and n.interval_s == 2.0
    n.ready("recording")
    assert received(sock) == ["READY=1\nSTATUS=recording"]
    t = time.monotonic()
    assert not n.ping(t + 0.5)  # READY counts as the first: pings every half interval
    assert n.ping(t + 1.01)
    assert not n.ping(t + 1.5)
    assert n.ping(t + 2.02)
    n.stopping("stopping")
    assert received(sock) == ["WATCHDOG=1", "WATCHDOG=1", "STOPPING=1\nSTATUS=stopping"]


def test_no_watchdog_for_another_process(listener: tuple[str, socket.socket]) -> None:
    path, sock = listener
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"}
    n = Notifier(env, pid=os.getpid())
    assert n.interval_s is None and not n.ping()
    mine = Notifier({**env, "WATCHDOG_PID": str(os.getpid())})
    assert mine.ping()
    assert received(sock) == ["WATCHDOG=1"]


def test_without_a_socket_nothing_is_sent() -> None:
    n = Notifier({"WATCHDOG_USEC": "1000000"})
    assert not n.enabled and not n.send(READY="1")
    assert not Notifier({"NOTIFY_SOCKET": "relative/path"}).enabled


def test_abstract_socket_and_a_vanished_one() -> None:
    name = f"stallwatch-test-{secrets.token_hex(4)}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(b"\0" + name.encode())
        sock.settimeout(1.0)
        assert Notifier({"NOTIFY_SOCKET": f"@{name}"}).send(STATUS="hello")
        assert sock.recv(4096) == b"STATUS=hello"
    gone = Notifier({"NOTIFY_SOCKET": f"@{name}"})
    assert not gone.send(READY="1")  # logged once, never raised
    assert not gone.send(READY="1")

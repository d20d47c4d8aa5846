"""The agent under systemd-style supervision (the lab's supervisor, which
applies what the unit says): it says READY=1, pings the watchdog from its
loop, and when it is wedged (stopped with SIGSTOP: its loop no longer turns)
it is killed and restarted, and the new agent takes over the pinned
recording."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from bench.fakenccl import build
from stallwatch.lab.supervise import Service, Supervisor
from tests import pins

pytestmark = [pytest.mark.bpf, pytest.mark.lab, pytest.mark.slow]


def test_a_wedged_agent_is_restarted_and_takes_over_its_recording(tmp_path: Path) -> None:
    pinned = pins.pin_dir("supervised")
    argv = [sys.executable, "-m", "stallwatch", "record", "--lib", str(build().lib)]
    argv += ["--dump-dir", str(tmp_path / "dumps"), "--listen", "127.0.0.1:0"]
    argv += ["--pin-dir", str(pinned), "--keep-pinned"]
    log = (tmp_path / "agent.log").open("w")
    service = Service(watchdog_s=3.0, restart_s=0.5, start_timeout_s=180, stop_timeout_s=60)
    sup = Supervisor("swtest-agent", argv, service, tmp_path / "notify.sock", log, dict(os.environ))
    sup.start()
    try:
        assert sup.wait_ready(1, timeout=180), (tmp_path / "agent.log").read_text()[-3000:]
        time.sleep(4)  # past a watchdog interval: the agent's loop pings
        assert [e.kind for e in sup.events] == ["started", "ready"], sup.events
        wedged = sup.kill(signal.SIGSTOP)
        assert sup.wait_ready(2, timeout=180), sup.events
        kinds = [e.kind for e in sup.events]
        assert kinds[:6] == ["started", "ready", "watchdog", "exited", "restarting", "started"]
        assert sup.pid != wedged
        text = (tmp_path / "agent.log").read_text()
        assert "adopted the pinned recording" in text, text[-3000:]
    finally:
        sup.wait_stopped()
        log.close()
        pins.remove(pinned)

"""``stallwatch record`` and ``stallwatch dump`` on the command line."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stallwatch.cli import main
from stallwatch.dumpers.schema import NCCL_SYMBOLS
from tests import pins


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ring-size", "1000"], "--ring-size: expected a power of two"),
        (["--stall-timeout", "0"], "--stall-timeout"),
        (["--peers", "nohostport"], "--peers: expected HOST:PORT"),
        (["--max-dumps", "-1"], "--max-dumps"),
        (["--token-file", "/nonexistent/token"], "--token-file /nonexistent/token"),
        (["--slowdown-hold-wait", "-1"], "--slowdown-hold-wait: expected >= 0, got -1"),
        (
            ["--slowdown-device-late-share", "-0.1"],
            "--slowdown-device-late-share: expected >= 0, got -0.1",
        ),
        (["--slowdown-factor", "0.5"], "--slowdown-factor: expected 0 (off) or more than 1"),
    ],
)
def test_record_bad_arguments_exit_2_with_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["record", "--dump-dir", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "Traceback" not in err and len(err.splitlines()) == 1


def test_record_checks_its_listen_address_before_anything_is_attached(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A non-loopback --listen without TLS, and an address taken: refused in
    one line, exit 2, before the agent starts (it was refused only after
    every probe had been attached and detached)."""
    from stallwatch.recorder import service

    def must_not_start(config: object) -> int:
        raise AssertionError("the agent started")

    monkeypatch.setattr(service, "run_agent", must_not_start)
    assert main(["record", "--dump-dir", str(tmp_path), "--listen", "0.0.0.0:9400"]) == 2
    err = capsys.readouterr().err.strip()
    assert "a non-loopback address needs TLS and a token" in err and len(err.splitlines()) == 1
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        listen = f"127.0.0.1:{port}"
        assert main(["record", "--dump-dir", str(tmp_path), "--listen", listen]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--listen {listen}: cannot listen: Address already in use" in err


def test_dump_with_no_agent_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    port = _free_port()
    assert main(["dump", "--agent", f"127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"127.0.0.1:{port} unreachable" in err and len(err.splitlines()) == 1


def test_print_bpf_shows_every_probe_family(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["record", "--print-bpf"]) == 0
    out = capsys.readouterr().out
    for name in ("handle_nccl_return", "tcp_retransmit_skb", "sched_switch", "signal_deliver"):
        assert name in out


@pytest.mark.solo  # bounded by time: judged alone
@pytest.mark.bpf
def test_record_serves_dumps_stops_within_seconds_and_cleanup_unpins(tmp_path: Path) -> None:
    from bench.fakenccl import build

    port = _free_port()
    pinned = pins.pin_dir("cli")
    argv = [sys.executable, "-m", "stallwatch", "record", "--lib", str(build().lib)]
    argv += ["--dump-dir", str(tmp_path / "dumps"), "--listen", f"127.0.0.1:{port}"]
    argv += ["--ring-size", "1024", "--host-name", "cli-test", "--pin-dir", str(pinned)]
    argv += ["--keep-pinned"]
    try:
        _record_and_stop(argv, port, tmp_path)
        # the recording outlives the agent; --cleanup removes every pin
        assert {"maps", "progs", "links", "meta"} <= {p.name for p in pinned.iterdir()}
        assert len(list((pinned / "links").iterdir())) >= 2 * len(NCCL_SYMBOLS)
        cleanup = [sys.executable, "-m", "stallwatch", "record", "--cleanup", "--pin-dir"]
        done = subprocess.run([*cleanup, str(pinned)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert f"removed the pinned recording at {pinned}" in done.stdout
        assert not pinned.exists()
        again = subprocess.run([*cleanup, str(pinned)], capture_output=True, text=True, timeout=60)
        assert (again.returncode, again.stdout.strip()) == (0, f"nothing pinned at {pinned}")
    finally:
        pins.remove(pinned)


def _record_and_stop(argv: list[str], port: int, tmp_path: Path) -> None:
    with subprocess.Popen(argv, stderr=subprocess.PIPE, text=True) as agent:
        assert agent.stderr is not None
        log: list[str] = []
        listening = threading.Event()

        def drain() -> None:  # a pipe nobody reads would block the agent's log
            assert agent.stderr is not None
            for line in agent.stderr:
                log.append(line)
                if "listening on" in line:
                    listening.set()

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        assert listening.wait(120), "".join(log)
        attached = [line for line in log if "attached" in line and "push %rbp" in line]
        assert attached and f": {len(NCCL_SYMBOLS)} symbols" in attached[0], log
        assert any("through uprobe_multi links" in line for line in log), log
        assert any("MiB in total" in line for line in log)
        dump = subprocess.run(
            [sys.executable, "-m", "stallwatch", "dump", "--agent", f"127.0.0.1:{port}",
             "--reason", "cli test", "--json"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert dump.returncode == 0, dump.stderr
        answer = json.loads(dump.stdout)
        assert answer["host"] == "cli-test" and Path(answer["path"]).is_file()
        os.kill(agent.pid, signal.SIGUSR1)
        time.sleep(1.0)
        started = time.monotonic()
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(60) == 0, "".join(log)
        # Every NCCL symbol attached: 42 uprobes and 10 tracepoints detached
        # (one perf event each, closed in turn, took 5-25 s).
        assert time.monotonic() - started < 4, "".join(log)
        reader.join(10)
    assert len(list((tmp_path / "dumps").glob("*.msgpack"))) == 2  # POST /dump and SIGUSR1
    assert "stopped" in log[-1]
    assert any("the recording stays pinned at" in line for line in log), log

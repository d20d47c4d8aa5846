"""A bulk neighbour outside the job (fault ``bulk:node=N,mbit=M[,to=K]``): one
TCP stream from node N to node K, as a checkpoint upload, a data loader's
prefetch or another tenant's transfer shares a real node's link with the job.

Two plain Python processes (they never load libnccl, so no agent records
them): a sink in node K listening on ``BULK_PORT`` (a port the job never
uses) that reads and discards, and a source in node N that writes
``CHUNK`` bytes at a time, paced to M Mbit/s from its start (a token bucket:
what is due since the start, never more); under a link capped below M the
writes block and it takes what the link gives.  Each writes what it moved
(``BulkStats``) into its stats file every ``REPORT_S`` and when SIGTERM
stops it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from stallwatch.dumpers.errors import LabError
from stallwatch.lab import faults as F
from stallwatch.lab import netns

BULK_PORT = 9501
CHUNK = 64 * 1024
REPORT_S = 0.5
CONNECT_RETRY_S = 0.2
CONNECT_TIMEOUT_S = 30.0
START_TIMEOUT_S = 30.0

Spawn = Callable[[netns.Node, list[str], Path], "subprocess.Popen[bytes]"]


@dataclass(slots=True)
class BulkStats:
    """What one bulk process moved (its stats file, JSON)."""

    listening: bool = False
    connected: bool = False
    started_ns: int | None = None  # CLOCK_MONOTONIC: the first byte
    stopped_ns: int | None = None
    bytes: int = 0  # written (source) or read (sink)

    def write(self, path: Path) -> None:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(asdict(self)))
        os.replace(tmp, path)

    @classmethod
    def read(cls, path: Path) -> BulkStats | None:
        try:
            raw = json.loads(path.read_text())
            return cls(**{k: raw[k] for k in cls.__dataclass_fields__})
        except (OSError, ValueError, KeyError, TypeError):
            return None


class _Stopped(Exception):
    pass


def _on_term(_signum: int, _frame: object) -> None:
    raise _Stopped


def sink(listen_ip: str, stats_path: Path, port: int = BULK_PORT) -> int:
    """Accept one stream at a time and discard what it carries."""
    stats = BulkStats()
    signal.signal(signal.SIGTERM, _on_term)
    server = socket.create_server((listen_ip, port), reuse_port=False)
    stats.listening = True
    stats.write(stats_path)
    last = time.monotonic()
    try:
        while True:
            conn, _ = server.accept()
            stats.connected = True
            with conn:
                while data := conn.recv(1 << 20):
                    if stats.started_ns is None:
                        stats.started_ns = time.monotonic_ns()
                    stats.bytes += len(data)
                    if time.monotonic() - last > REPORT_S:
                        stats.write(stats_path)
                        last = time.monotonic()
    except _Stopped:
        pass
    stats.stopped_ns = time.monotonic_ns()
    stats.write(stats_path)
    return 0


def _connect(peer_ip: str, port: int) -> socket.socket:
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            return socket.create_connection((peer_ip, port), timeout=CONNECT_TIMEOUT_S)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(CONNECT_RETRY_S)


def source(peer_ip: str, mbit: float, stats_path: Path, port: int = BULK_PORT) -> int:
    """Stream to the peer's sink at ``mbit`` Mbit/s until stopped."""
    stats = BulkStats()
    signal.signal(signal.SIGTERM, _on_term)
    payload = os.urandom(CHUNK)
    per_s = mbit * 1e6 / 8
    try:
        conn = _connect(peer_ip, port)
        conn.settimeout(None)
        stats.connected = True
        began = time.monotonic()
        stats.started_ns = time.monotonic_ns()
        last = began
        while True:
            due = (time.monotonic() - began) * per_s - stats.bytes
            if due < CHUNK:
                time.sleep(min(0.05, (CHUNK - due) / per_s))
                continue
            conn.sendall(payload)
            stats.bytes += CHUNK
            if time.monotonic() - last > REPORT_S:
                stats.write(stats_path)
                last = time.monotonic()
    except _Stopped:
        pass
    except OSError as exc:  # the link went away: say so, keep the counts
        with contextlib.suppress(OSError):
            stats_path.with_suffix(".error").write_text(str(exc))
    stats.stopped_ns = time.monotonic_ns()
    stats.write(stats_path)
    return 0


def start(
    fault: F.Bulk, nodes: tuple[netns.Node, ...], run_dir: Path, spawn: Spawn
) -> tuple[list[subprocess.Popen[bytes]], str]:
    """The sink, listening, then the source: the processes, and how."""
    src, dst = nodes[fault.node], nodes[F.bulk_peer(fault, len(nodes))]
    cmd = [sys.executable, "-m", "stallwatch.commands.labbulk"]
    sink_stats = run_dir / f"bulk-{src.index}-{dst.index}-sink.json"
    sink_argv = [*cmd, "sink", "--listen", dst.ip, "--stats", str(sink_stats)]
    sink_proc = spawn(dst, sink_argv, sink_stats.with_suffix(".log"))
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ((st := BulkStats.read(sink_stats)) is not None and st.listening):
        if sink_proc.poll() is not None or time.monotonic() > deadline:
            sink_proc.kill()
            raise LabError(f"the bulk neighbour's sink in {dst.netns} did not start")
        time.sleep(0.02)
    src_stats = run_dir / f"bulk-{src.index}-{dst.index}-source.json"
    src_argv = [*cmd, "source", "--peer", dst.ip, "--mbit", f"{fault.mbit:g}"]
    src_proc = spawn(src, [*src_argv, "--stats", str(src_stats)], src_stats.with_suffix(".log"))
    how = (
        f"a TCP stream outside the job from node {src.index} to node {dst.index} "
        f"(port {BULK_PORT}) paced at {fault.mbit:g} Mbit/s"
    )
    return [sink_proc, src_proc], how

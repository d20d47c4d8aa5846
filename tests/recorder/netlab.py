"""The lab's nodes without a job: namespaces joined by the lab's switch
(``lab.netns``), processes started inside them, and the lab's link faults
on their switch ports, for tests of what the agent reads of the network
(its samples and probes) on real veths."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from stallwatch.lab import netns

# a TCP sink: accepts connections on PORT and reads them until they close
SINK = """
import socket, sys, threading
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
def drain(conn):
    while conn.recv(1 << 16):
        pass
while True:
    threading.Thread(target=drain, args=(server.accept()[0],), daemon=True).start()
"""
# a TCP source: connects to HOST:PORT (once the sink listens) and writes 64
# KiB every 10 ms (6.5 MB/s)
SOURCE = """
import socket, sys, time
while True:
    try:
        conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
        break
    except ConnectionRefusedError:
        time.sleep(0.1)
chunk = bytes(1 << 16)
while True:
    conn.sendall(chunk)
    time.sleep(0.01)
"""


@dataclass
class Lab:
    net: netns.Network
    children: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def node(self, k: int) -> netns.Node:
        return self.net.nodes[k]

    def spawn(self, k: int, script: str, *args: str) -> subprocess.Popen[bytes]:
        cmd = [*self.node(k).exec_prefix(), sys.executable, "-c", script, *args]
        child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.children.append(child)
        return child

    def cut(self, k: int, way: str = "in") -> None:
        """The lab's one-way cut (``partition:...,dir=``) of node ``k``."""
        netns.add_partition(self.net, self.node(k), way)

    def uncut(self, k: int) -> int:
        return netns.remove_partition(self.net, self.node(k))

    def mtu(self, k: int, size: int) -> None:
        """The lab's MTU blackhole (``mtu:node=N,bytes=B``) on node ``k``."""
        netns.add_mtu(self.net, self.node(k), size)

    def tc(self, k: int, *args: str) -> None:
        netns.sh(["ip", "netns", "exec", self.node(k).netns, "tc", *args])


@contextlib.contextmanager
def lab_network(nodes: int) -> Iterator[Lab]:
    """``nodes`` namespaces on the lab's switch, removed after (with what
    runs inside); marked as a live run's, so that other runs' clean-up
    leaves them."""
    run_id = netns.new_run_id("t")
    run_dir = netns.RUNS_DIR / run_id
    run_dir.mkdir(parents=True)
    (run_dir / "runner.pid").write_text(str(os.getpid()))
    net = netns.create(run_id, nodes)
    lab = Lab(net)
    try:
        yield lab
    finally:
        for child in lab.children:
            child.kill()
            child.communicate(timeout=10)  # its stderr pipe closed too
        netns.destroy(net)
        shutil.rmtree(run_dir, ignore_errors=True)


def wait_for(check: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError(f"not true within {timeout} s")
        time.sleep(0.05)


def token() -> str:
    return secrets.token_hex(8)

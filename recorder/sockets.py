"""The job's TCP sockets, for the kernel's TCP filter.

The TCP programs (bpf/tcp.c) keep a socket's rows when its owner is a
tracked process, when it is one of the job's connections (`job_conns`: both
ends), or when either end is a job listener (`job_endpoints`).  The programs
learn owners and a tracked listener's endpoint themselves; this module gives
them what a tracked process already holds, read from ``/proc/<pid>/fd`` (its
socket inodes) and ``/proc/<pid>/net/tcp{,6}`` (the sockets of its network
namespace): connections made before the agent came, or before discovery
placed the process, are the job's too.

A connected socket is known by both of its ends, never by its local end
alone: under a neighbour's churn the kernel hands the same ephemeral port to
another process's connection to another peer (seen: the lab's neighbour
reused a rank's ephemeral port within a minute).  A listener is known by its
own end (a connection accepted on it, or made to it, is the job's); one on
every address (0.0.0.0, ::) stands for itself and for each address of its
namespace.

An endpoint is ``(address, port, family)``: the address as the 16 bytes of a
tcp_event field (IPv4 in the first 4), the port in host order; a connection
is ``(local address, remote address, local port, remote port, family)``.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field

Endpoint = tuple[bytes, int, int]
Connection = tuple[bytes, bytes, int, int, int]

LISTEN = "0A"
# /proc/net/tcp states of a connection that carries the job's traffic
# (TIME_WAIT and the closing states carry none)
_CONNECTED = {"01", "02", "03"}  # ESTABLISHED, SYN_SENT, SYN_RECV
ANY = bytes(16)


@dataclass
class JobSockets:
    """What the kernel's filter is given: listeners and connections, each with
    the pid that holds it."""

    listeners: dict[Endpoint, int] = field(default_factory=dict)
    connections: dict[Connection, int] = field(default_factory=dict)


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets process ``pid`` holds (empty: gone)."""
    fd_dir = f"/proc/{pid}/fd"
    out: set[int] = set()
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(f"{fd_dir}/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(int(target[8:-1]))
    return out


def _address(hex_text: str) -> bytes:
    """A /proc/net/tcp address: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_text)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return words.ljust(16, b"\0")


def _end(text: str) -> tuple[bytes, int]:
    addr, _, port = text.partition(":")
    return _address(addr), int(port, 16)


def parse_tcp_table(
    text: str, family: int, inodes: set[int]
) -> tuple[set[Endpoint], set[Connection]]:
    """The listeners and connections of ``inodes`` in a /proc/net/tcp{,6} text."""
    listeners: set[Endpoint] = set()
    conns: set[Connection] = set()
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10 or (fields[3] != LISTEN and fields[3] not in _CONNECTED):
            continue
        try:
            if int(fields[9]) not in inodes:
                continue
            (laddr, lport), (raddr, rport) = _end(fields[1]), _end(fields[2])
        except ValueError:
            continue
        if fields[3] == LISTEN:
            listeners.add((laddr, lport, family))
        else:
            conns.add((laddr, raddr, lport, rport, family))
    return listeners, conns


def local_ipv4(fib_trie: str) -> set[bytes]:
    """The addresses of a namespace's own (LOCAL) routes, from /proc/net/fib_trie."""
    out: set[bytes] = set()
    last = ""
    for line in fib_trie.splitlines():
        text = line.strip()
        if text.startswith("|--"):
            last = text[3:].strip()
        elif text == "/32 host LOCAL" and last:
            with contextlib.suppress(OSError):
                out.add(socket.inet_aton(last).ljust(16, b"\0"))
    return out


def local_ipv6(if_inet6: str) -> set[bytes]:
    """A namespace's IPv6 addresses, from /proc/net/if_inet6."""
    out: set[bytes] = set()
    for line in if_inet6.splitlines():
        fields = line.split()
        if fields and len(fields[0]) == 32:
            with contextlib.suppress(ValueError):
                out.add(bytes.fromhex(fields[0]))
    return out


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def process_sockets(pid: int) -> tuple[set[Endpoint], set[Connection]]:
    """The listeners and connections process ``pid`` holds."""
    inodes = socket_inodes(pid)
    listeners: set[Endpoint] = set()
    conns: set[Connection] = set()
    if not inodes:
        return listeners, conns
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        found = parse_tcp_table(_read(f"/proc/{pid}/net/{table}"), family, inodes)
        listeners |= found[0]
        conns |= found[1]
    if any(addr == ANY for addr, _, _ in listeners):  # on every address
        net = f"/proc/{pid}/net"
        mine: dict[int, set[bytes]] = {
            socket.AF_INET: local_ipv4(_read(f"{net}/fib_trie")),
            socket.AF_INET6: local_ipv6(_read(f"{net}/if_inet6")),
        }
        listeners |= {(a, port, fam) for addr, port, fam in listeners if addr == ANY
                      for a in mine[fam]}  # fmt: skip
    return listeners, conns


def job_sockets(pids: Iterable[int]) -> JobSockets:
    """Every listener and connection of the processes ``pids``, and whose it is."""
    out = JobSockets()
    for pid in sorted(pids):
        listeners, conns = process_sockets(pid)
        for endpoint in listeners:
            out.listeners.setdefault(endpoint, pid)
        for conn in conns:
            out.connections.setdefault(conn, pid)
    return out

"""The TCP endpoints of the job's processes, for the kernel's TCP filter.

The TCP programs (bpf/tcp.c) keep a socket's rows when its owner is a
tracked process or when either end is a job endpoint.  The programs learn a
tracked listener's endpoint themselves; this module gives them the local
end of every TCP socket a tracked process holds, read from
``/proc/<pid>/fd`` (its socket inodes) and ``/proc/<pid>/net/tcp{,6}`` (the
sockets of its network namespace): connections made before the agent came,
or before discovery placed the process, are the job's too.

An endpoint is ``(address, port, family)``: the address as the 16 bytes of a
tcp_event field (IPv4 in the first 4), the port in host order.  A listener
on every address (0.0.0.0, ::) stands for itself (the programs match an
accepted connection's own end to it) and for each address of its namespace
(so that the other end of a connection to it, on this host, matches too).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterable

Endpoint = tuple[bytes, int, int]

# /proc/net/tcp states worth an endpoint: a socket that carries or accepts
# the job's traffic (TIME_WAIT and the closing states carry none)
_STATES = {"01", "02", "03", "0A"}  # ESTABLISHED, SYN_SENT, SYN_RECV, LISTEN
ANY = bytes(16)


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


def parse_tcp_table(text: str, family: int, inodes: set[int]) -> set[Endpoint]:
    """Local ends of the sockets of ``inodes`` in a /proc/net/tcp{,6} text."""
    out: set[Endpoint] = set()
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10 or fields[3] not in _STATES:
            continue
        try:
            inode = int(fields[9])
            if inode not in inodes:
                continue
            addr, _, port = fields[1].partition(":")
            out.add((_address(addr), int(port, 16), family))
        except ValueError:
            continue
    return out


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


def process_endpoints(pid: int) -> set[Endpoint]:
    """The local ends of the TCP sockets process ``pid`` holds."""
    inodes = socket_inodes(pid)
    if not inodes:
        return set()
    out: set[Endpoint] = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        out |= parse_tcp_table(_read(f"/proc/{pid}/net/{table}"), family, inodes)
    if any(addr == ANY for addr, _, _ in out):  # listeners on every address
        net = f"/proc/{pid}/net"
        mine: dict[int, set[bytes]] = {
            socket.AF_INET: local_ipv4(_read(f"{net}/fib_trie")),
            socket.AF_INET6: local_ipv6(_read(f"{net}/if_inet6")),
        }
        out |= {(a, port, fam) for addr, port, fam in out if addr == ANY for a in mine[fam]}
    return out


def job_endpoints(pids: Iterable[int]) -> dict[Endpoint, int]:
    """Every local TCP end of the processes ``pids``, and whose it is."""
    out: dict[Endpoint, int] = {}
    for pid in sorted(pids):
        for endpoint in process_endpoints(pid):
            out.setdefault(endpoint, pid)
    return out

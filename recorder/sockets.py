"""The job's TCP sockets, for the kernel's TCP filter.

The TCP programs (bpf/tcp.c) keep a socket's rows when its owner is a
tracked process, when it is one of the job's connections (`job_conns`: both
ends), or when either end is a job listener (`job_endpoints`).  The programs
learn owners and a tracked listener's endpoint themselves; this module gives
them what a tracked process already holds, read from ``/proc/<pid>/fd`` (its
socket inodes) and the sockets of its network namespace: connections made
before the agent came, or before discovery placed the process, are the job's
too.

The namespace's sockets come from one sock_diag dump per namespace of the
job (``SocketReader``, a socket made in that namespace), which the kernel
filters by state: listeners and connections carrying traffic, never the
TIME_WAIT sockets a neighbour's churn leaves by the thousand.
``/proc/<pid>/net/tcp`` formats every one of those as text: measured in a
lab node under a neighbour's churn (8,500-9,100 sockets) 0.56-4.75 s a read
against 0.04-0.05 s for the dump, and 30 s and more on a 2-core machine with
eight spinning ranks, which starved the agent's loop into its service
manager's watchdog.  It is read only where a namespace cannot be asked.

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
import ctypes
import dataclasses
import functools
import logging
import os
import socket
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from stallwatch.dumpers.model import Ring
from stallwatch.dumpers.schema import TCP_EVENT, EventKind, TcpEvent

from .netlink import NetlinkError, SockDiag, TcpSocket

log = logging.getLogger(__name__)

Endpoint = tuple[bytes, int, int]
Connection = tuple[bytes, bytes, int, int, int]

LISTEN = "0A"
# /proc/net/tcp states of a connection that carries the job's traffic
# (TIME_WAIT and the closing states carry none)
_CONNECTED = {"01", "02", "03"}  # ESTABLISHED, SYN_SENT, SYN_RECV
ANY = bytes(16)
TCP_LISTEN = 10
_CONNECTED_STATES = {1, 2, 3}  # the same, as sock_diag gives them
DIAG_STATES = sum(1 << st for st in (*_CONNECTED_STATES, TCP_LISTEN))
CLONE_NEWNET = 0x40000000


@dataclass
class JobSockets:
    """What the kernel's filter is given: listeners and connections, each with
    the pid that holds it."""

    listeners: dict[Endpoint, int] = field(default_factory=dict)
    connections: dict[Connection, int] = field(default_factory=dict)
    # the namespace each connection is in (bookkeeping: not what the filter is given)
    netns: dict[Connection, int] = field(default_factory=dict, compare=False)


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


def process_sockets(
    pid: int, table: list[TcpSocket] | None = None
) -> tuple[set[Endpoint], set[Connection]]:
    """The listeners and connections process ``pid`` holds, of ``table``
    (its namespace's sock_diag dump), or of ``/proc/<pid>/net/tcp{,6}``."""
    inodes = socket_inodes(pid)
    listeners: set[Endpoint] = set()
    conns: set[Connection] = set()
    if not inodes:
        return listeners, conns
    if table is not None:
        for sk in table:
            if sk.inode not in inodes:
                continue
            if sk.state == TCP_LISTEN:
                listeners.add((sk.src, sk.sport, sk.family))
            elif sk.state in _CONNECTED_STATES:
                conns.add((sk.src, sk.dst, sk.sport, sk.dport, sk.family))
    else:
        for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
            found = parse_tcp_table(_read(f"/proc/{pid}/net/{name}"), family, inodes)
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


def netns_of(pid: int) -> int | None:
    """The inode of process ``pid``'s network namespace; None if gone."""
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def _made_in_netns(pid: int) -> SockDiag:
    """A sock_diag socket of ``pid``'s network namespace: made by a thread of
    ours that joins it (setns moves the calling thread alone) and ends."""
    made: list[SockDiag] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                if _libc().setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns: {os.strerror(err)}")
            finally:
                os.close(fd)
            made.append(SockDiag())
        except (OSError, NetlinkError) as exc:
            failed.append(exc)

    thread = threading.Thread(target=run, name="netns-sockdiag", daemon=True)
    thread.start()
    thread.join()
    if failed or not made:
        raise failed[0] if failed else OSError("sock_diag: no socket made")
    return made[0]


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _families(pid: int) -> tuple[int, ...]:
    """IPv4, and IPv6 unless ``pid``'s namespace has no IPv6 TCP socket at
    all (its ``sockstat6``: a listener on ``::`` counts): a dump of a family
    walks every socket of the host, the namespace's or not."""
    for line in _read(f"/proc/{pid}/net/sockstat6").splitlines():
        if line.startswith("TCP6:"):
            fields = line.split()
            if fields[1:3] == ["inuse", "0"]:
                return (socket.AF_INET,)
    return (socket.AF_INET, socket.AF_INET6)


def _by_netns(pids: Iterable[int]) -> dict[int, list[int]]:
    """The processes ``pids`` by network namespace (those gone are left out)."""
    by_ns: dict[int, list[int]] = {}
    for pid in sorted(pids):
        ns = netns_of(pid)
        if ns is not None:
            by_ns.setdefault(ns, []).append(pid)
    return by_ns


class SocketReader:
    """``job_sockets`` by one sock_diag dump per network namespace of the
    job; each namespace's socket is kept while a process of the job is in it."""

    def __init__(self) -> None:
        self._own = netns_of(os.getpid())
        self._diag: dict[int, SockDiag | None] = {}
        self.fallbacks = 0  # namespaces read from /proc: sock_diag could not be asked

    def job_sockets(self, pids: Iterable[int]) -> JobSockets:
        """Every listener and connection of the processes ``pids``, and whose it is."""
        by_ns = _by_netns(pids)
        for ns in set(self._diag) - set(by_ns):  # no process of the job there now
            diag = self._diag.pop(ns)
            if diag is not None:
                diag.close()
        out = JobSockets()
        for ns, members in by_ns.items():
            table = self._table(ns, members[0])
            for pid in members:
                listeners, conns = process_sockets(pid, table)
                for endpoint in listeners:
                    out.listeners.setdefault(endpoint, pid)
                for conn in conns:
                    out.connections.setdefault(conn, pid)
                    out.netns.setdefault(conn, ns)
        return out

    def tcp_infos(self, conns: dict[int, list[Connection]]) -> dict[Connection, bytes]:
        """The ``struct tcp_info`` of each connection (by namespace, as
        ``JobSockets.netns`` says), asked socket by socket; a connection
        closed since, or of a namespace sock_diag cannot be asked in, is
        left out."""
        out: dict[Connection, bytes] = {}
        for ns, wanted in conns.items():
            diag = self._diag.get(ns)
            if diag is None:
                continue
            try:
                infos = diag.tcp_infos(wanted)
            except NetlinkError as exc:
                log.warning("sock_diag: tcp_info of the job's connections: %s", exc)
                continue
            out.update((c, info) for c, info in zip(wanted, infos, strict=True) if info)
        return out

    def connection_states(self, pids: Iterable[int]) -> list[tuple[int, TcpSocket]]:
        """The connections of the processes ``pids`` as the kernel has them
        now (``TcpSocket.info``), each with the pid that holds it; none of a
        namespace that sock_diag cannot be asked in."""
        out: list[tuple[int, TcpSocket]] = []
        for ns, members in _by_netns(pids).items():
            table = self._table(ns, members[0], info=True)
            if table is None:
                continue
            for pid in members:
                inodes = socket_inodes(pid)
                out += [(pid, sk) for sk in table
                        if sk.inode in inodes and sk.state in _CONNECTED_STATES
                        and sk.info is not None]  # fmt: skip
        return out

    def _table(self, ns: int, pid: int, info: bool = False) -> list[TcpSocket] | None:
        if ns not in self._diag:
            try:
                self._diag[ns] = SockDiag() if ns == self._own else _made_in_netns(pid)
            except (OSError, NetlinkError) as exc:
                self._diag[ns] = None
                self.fallbacks += 1
                log.warning("sock_diag for the network namespace of pid %d: %s; "
                            "reading /proc/%d/net/tcp instead", pid, exc, pid)  # fmt: skip
        diag = self._diag[ns]
        if diag is None:
            return None
        try:
            return diag.tcp(DIAG_STATES, _families(pid), info=info)
        except NetlinkError as exc:
            log.warning("sock_diag dump for pid %d's namespace failed: %s", pid, exc)
            return None

    def close(self) -> None:
        for diag in self._diag.values():
            if diag is not None:
                diag.close()
        self._diag.clear()


def with_states(ring: Ring, states: list[tuple[int, TcpSocket]], ts_ns: int) -> Ring:
    """``ring`` (a copy of the TCP ring) with one ``tcp_info`` row per
    connection of ``states`` after its rows, at ``ts_ns`` (CLOCK_MONOTONIC,
    the kernel rows' clock): a dump tells whether each connection was still
    unacknowledged when it was taken, whatever retransmit rows its ring lost."""
    rows = np.zeros(len(states), dtype=TCP_EVENT)
    last = int(ring.rows["pos"].max()) if len(ring.rows) else 0
    for i, (pid, sk) in enumerate(states):
        info = sk.info
        assert info is not None
        r = rows[i]
        r["pos"], r["ts_ns"], r["pid"] = last + i + 1, ts_ns, pid
        r["kind"], r["size"] = EventKind.TCP, TCP_EVENT.itemsize
        r["saddr"], r["daddr"] = np.frombuffer(sk.src, np.uint8), np.frombuffer(sk.dst, np.uint8)
        r["sport"], r["dport"] = sk.sport, sk.dport
        r["family"], r["event"], r["state"] = sk.family, TcpEvent.TCP_INFO, sk.state
        r["backoff"] = min(info.retransmits, 255)
        r["no_ack_ns"] = info.last_ack_recv_ms * 1_000_000
        r["srtt_us"], r["rto_us"] = info.srtt_us, info.rto_us
        r["unacked"] = min(info.unacked_bytes or 0, 0xFFFFFFFF)
        r["packets_out"], r["retrans_out"] = info.packets_out, info.retrans_out
        r["conn_known"] = 1
    joined = np.concatenate([ring.rows.astype(TCP_EVENT, copy=False), rows])
    return dataclasses.replace(ring, rows=joined)


def job_sockets(pids: Iterable[int]) -> JobSockets:
    """Every listener and connection of the processes ``pids`` (a reader of
    its own: the agent keeps one)."""
    reader = SocketReader()
    try:
        return reader.job_sockets(pids)
    finally:
        reader.close()

"""Asking peer agents to dump the same incident (``--peers``).

Client side of ``POST /dump`` (the server is ``analyzer.http``)::

    POST http://HOST:PORT/dump   Authorization: Bearer <token>   (if a token is set)
    {"reason": str, "incident_id": str, "origin": str, "kind": str}
    -> 200 {"incident_id": str, "status": "written|queued|duplicate|cooldown", "path": str|null}

All peers are asked at once, one thread each, and the whole round ends after
``timeout`` seconds whatever the peers do.  With TLS (an ``ssl.SSLContext``
from ``query.tls.ClientTls``: the CA that signed the peers' certificates, and
the agent's own certificate for peers that ask for one), peers are reached
over HTTPS, through ``query.agentclient``.  ``notify_in_background`` runs a
round on a daemon thread, so that the agent's tick never waits for the network.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from stallwatch.dumpers.errors import AgentError, UsageError
from stallwatch.dumpers.model import Trigger
from stallwatch.query.agentclient import AgentClient
from stallwatch.query.tls import ClientTls

log = logging.getLogger("stallwatch.peers")

DEFAULT_TIMEOUT_S = 1.0


Peers = Sequence[str] | Callable[[], Sequence[str]]  # a list, or where to get it now


def current_peers(peers: Peers) -> Sequence[str]:
    return peers() if callable(peers) else peers


def parse_peers(text: str, what: str = "--peers") -> list[str]:
    """``host:port,host:port`` (``[v6]:port`` too) -> the list, checked."""
    peers = [p.strip() for p in text.split(",") if p.strip()]
    for peer in peers:
        host, sep, port = peer.removeprefix("http://").rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UsageError(f"{what}: expected HOST:PORT, found {peer!r}")
    return peers


def ask_peer(
    peer: str,
    body: bytes,
    token: str | None,
    timeout: float,
    tls: ssl.SSLContext | None = None,
) -> str:
    """One request; the peer's status, or ``error: <why>``."""
    return ask_peer_answer(peer, body, token, timeout, tls)[0]


def ask_peer_answer(
    peer: str,
    body: bytes,
    token: str | None,
    timeout: float,
    tls: ssl.SSLContext | None = None,
) -> tuple[str, str | None]:
    """One request; the peer's status (or ``error: <why>``) and the incident
    id it answered with (its own, when it says ``duplicate``)."""
    try:
        reply = AgentClient(peer, token, tls, timeout).post("/dump", body)
        if not reply.ok:
            return f"error: HTTP {reply.status} {reply.reason}", None
        answer = reply.json()
    except (AgentError, UsageError) as exc:  # unreachable, no answer in time, TLS, not JSON
        return f"error: {exc}", None
    if not isinstance(answer, dict) or not isinstance(answer.get("status"), str):
        return "error: answer without a status", None
    incident = answer.get("incident_id")
    return answer["status"], incident if isinstance(incident, str) else None


def notify_peers(
    peers: Sequence[str],
    incident_id: str,
    reason: str,
    origin_host: str,
    token: str | None,
    timeout: float = DEFAULT_TIMEOUT_S,
    tls: ssl.SSLContext | None = None,
    answered: Callable[[str, str, str | None], object] | None = None,
    kind: str | None = None,
) -> dict[str, str]:
    """Ask every peer to dump ``incident_id``; returns peer -> its status
    (``written``, ``queued``, ``duplicate``, ``cooldown``) or ``error: ...``.
    Returns within ``timeout`` seconds (plus thread start-up).  ``answered``
    gets (peer, status, the incident id it answered with) as each answers.
    ``kind``: the incident's trigger kind (a peer's cool-down after a
    slowdown holds back only slowdowns)."""
    doc = {"reason": reason, "incident_id": incident_id, "origin": origin_host}
    body = json.dumps({**doc, "kind": kind} if kind else doc)
    results: dict[str, str] = {}

    def ask(peer: str) -> None:
        status, their_id = ask_peer_answer(peer, body.encode(), token, timeout, tls)
        results[peer] = status
        if answered is not None:
            answered(peer, status, their_id)

    threads = [threading.Thread(target=ask, args=(p,), daemon=True) for p in peers]
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return {p: results.get(p, f"error: no answer within {timeout:g} s") for p in peers}


def notify_in_background(
    peers: Peers,
    incident_id: str,
    reason: str,
    origin_host: str,
    token: str | None,
    timeout: float = DEFAULT_TIMEOUT_S,
    done: Callable[[dict[str, str]], object] | None = None,
    tls: ssl.SSLContext | None = None,
    answered: Callable[[str, str, str | None], object] | None = None,
    kind: str | None = None,
) -> threading.Thread:
    """``notify_peers`` on a daemon thread; logs each answer, then calls ``done``."""

    def run() -> None:
        results = notify_peers(
            current_peers(peers),
            incident_id,
            reason,
            origin_host,
            token,
            timeout,
            tls,
            answered,
            kind,
        )
        for peer, status in results.items():
            level = logging.WARNING if status.startswith("error") else logging.INFO
            log.log(level, "incident %s: peer %s: %s", incident_id, peer, status)
        if done is not None:
            done(results)

    thread = threading.Thread(target=run, name=f"peers-{incident_id}", daemon=True)
    thread.start()
    return thread


def peer_notifier(
    peers: Peers,
    host: str,
    token: str | None,
    timeout: float = DEFAULT_TIMEOUT_S,
    tls: ClientTls | None = None,
    answered: Callable[[Trigger, str, str | None, str], object] | None = None,
) -> Callable[[Trigger], object]:
    """The ``notify`` callable of ``recorder.watchdog.Incidents``: each local
    incident is sent to every peer in the background (over HTTPS with
    ``tls``; its files are read now, once); ``answered`` gets (the trigger, a
    peer's status, the id it answered with, the peer).  ``peers`` is a list, or a
    callable asked for the current list at each incident (``--peers-from``),
    on the background thread: a DNS lookup never holds up the agent's tick."""
    context = tls.context() if tls is not None else None

    def notify(trigger: Trigger) -> object:
        if not callable(peers) and not peers:
            return None
        reason = f"{host}: {trigger.reason}"

        def each(peer: str, status: str, their_id: str | None) -> None:
            if answered is not None:
                answered(trigger, status, their_id, peer)

        return notify_in_background(
            peers,
            trigger.incident_id,
            reason,
            host,
            token,
            timeout,
            tls=context,
            answered=each,
            kind=trigger.kind.value,
        )

    return notify


# --------------------------------------------------------------------------- --peers-from
#
# Where the peer list comes from when the fleet changes with every job: a
# Kubernetes headless Service (its addresses, resolved again at each incident),
# the Slurm job's node list (expanded as Slurm does), or a file (read again
# when it changes).  A source never raises once the agent runs: a failed
# lookup keeps the last list it had, and says so in the log.

Resolver = Callable[[str], list[str]]  # a host name -> its addresses


def resolve_addresses(name: str) -> list[str]:
    """The addresses DNS gives for ``name`` (a headless Service's: one per pod)."""
    infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


class PeersFrom(Enum):
    K8S_SERVICE = "k8s-service"
    SLURM = "slurm"
    FILE = "file"


@dataclass(frozen=True, slots=True)
class Own:
    """What names this agent, so that it never asks itself: its host names
    (lower case) and the port it listens on."""

    names: frozenset[str]
    port: int

    def excludes(self, peer: str) -> bool:
        host, _, port = peer.rpartition(":")
        return port == str(self.port) and host.strip("[]").lower() in self.names


def self_names(listen: str, host_name: str = "") -> Own:
    """This agent's names: the listen address, ``--host-name``, the host name
    (full and short), and Slurm's name for the node when run by a prolog."""
    host, _, port = listen.rpartition(":")
    full = socket.gethostname()
    names = {host.strip("[]"), host_name, full, full.split(".")[0]}
    names.add(os.environ.get("SLURMD_NODENAME", ""))
    return Own(frozenset(n.lower() for n in names if n), int(port))


def with_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(slots=True)
class ServicePeers:
    """A headless Service's addresses, looked up again at every incident."""

    name: str
    port: int
    own: Own
    resolver: Resolver = resolve_addresses
    last: tuple[str, ...] = ()

    def peers(self) -> tuple[str, ...]:
        try:
            addresses = self.resolver(self.name)
        except OSError as exc:  # socket.gaierror: no such name, no DNS answer
            log.warning(
                "--peers-from k8s-service %s: %s; keeping %d peers", self.name, exc, len(self.last)
            )
            return self.last
        found = (with_port(a, self.port) for a in addresses)
        self.last = tuple(p for p in found if not self.own.excludes(p))
        return self.last


@dataclass(frozen=True, slots=True)
class FixedPeers:
    """A list known at start: ``--peers``, or the Slurm job's nodes."""

    listed: tuple[str, ...]

    def peers(self) -> tuple[str, ...]:
        return self.listed


@dataclass(frozen=True, slots=True)
class _Stamp:
    inode: int
    size: int
    mtime_ns: int


@dataclass(slots=True)
class FilePeers:
    """One peer a line (``HOST`` or ``HOST:PORT``; ``#`` comments), read
    again when the file changes (its inode, size or modification time)."""

    path: Path
    port: int
    own: Own
    stamp: _Stamp | None = None
    last: tuple[str, ...] = ()

    def peers(self) -> tuple[str, ...]:
        try:
            st = self.path.stat()
            stamp = _Stamp(st.st_ino, st.st_size, st.st_mtime_ns)
            if stamp != self.stamp:
                self.last = self.read()
                self.stamp = stamp
                log.info("peers from %s: %s", self.path, ", ".join(self.last) or "none")
        except (OSError, UsageError) as exc:
            log.warning(
                "--peers-from file %s: %s; keeping %d peers", self.path, exc, len(self.last)
            )
        return self.last

    def read(self) -> tuple[str, ...]:
        try:
            text = self.path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(
                f"--peers-from file {self.path}: {getattr(exc, 'strerror', None) or exc}"
            ) from None
        words = (
            w for line in text.splitlines() for w in line.split("#")[0].replace(",", " ").split()
        )
        listed = [w if _has_port(w) else with_port(w, self.port) for w in words]
        checked = parse_peers(",".join(listed), f"--peers-from file {self.path}")
        return tuple(p for p in checked if not self.own.excludes(p))


def _has_port(word: str) -> bool:
    return word.rpartition("]")[2].count(":") == 1 if word.startswith("[") else word.count(":") == 1


PeerSource = ServicePeers | FixedPeers | FilePeers


def peer_source(
    kind_and_arg: Sequence[str], own: Own, resolver: Resolver = resolve_addresses
) -> PeerSource:
    """``--peers-from KIND [ARG]`` -> the source, checked now (exit 2 if not usable)."""
    kind, *rest = kind_and_arg
    try:
        source = PeersFrom(kind)
    except ValueError:
        names = ", ".join(k.value for k in PeersFrom)
        raise UsageError(f"--peers-from: expected one of {names}, got {kind!r}") from None
    wants = 0 if source is PeersFrom.SLURM else 1
    if len(rest) != wants:
        what = "no argument" if wants == 0 else "one argument"
        raise UsageError(f"--peers-from {kind}: expected {what}, got {len(rest)}")
    if source is PeersFrom.SLURM:
        return slurm_peers(os.environ.get("SLURM_JOB_NODELIST"), own)
    if source is PeersFrom.FILE:
        peers = FilePeers(Path(rest[0]), own.port, own)
        peers.read()  # a missing or malformed file is named at start
        return peers
    name, sep, port = rest[0].rpartition(":")
    if not sep:
        return ServicePeers(rest[0], own.port, own, resolver)
    if not name or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--peers-from k8s-service: expected NAME[:PORT], got {rest[0]!r}")
    return ServicePeers(name, int(port), own, resolver)


def slurm_peers(nodelist: str | None, own: Own) -> FixedPeers:
    if not nodelist:
        raise UsageError(
            "--peers-from slurm: SLURM_JOB_NODELIST is not set (run by a Slurm prolog?)"
        )
    try:
        hosts = expand_hostlist(nodelist)
    except ValueError as exc:
        raise UsageError(f"--peers-from slurm: SLURM_JOB_NODELIST={nodelist!r}: {exc}") from None
    peers = (with_port(h, own.port) for h in hosts)
    return FixedPeers(tuple(p for p in peers if not own.excludes(p)))


# --------------------------------------------------------------------------- Slurm host lists
#
# Written here rather than taken from python-hostlist (GPL, the project is
# Apache-2.0) or `scontrol show hostnames` (absent where the agent runs in a
# container).  Grammar, as Slurm's hostlist.c reads it:
#   list  := expr ("," expr)*          commas inside brackets do not split
#   expr  := (text | "[" ranges "]")+  several bracket groups: a product,
#                                      the leftmost group varying slowest
#   ranges:= range ("," range)*;  range := N | N "-" M   (N <= M; the width
#            of N is kept as zero padding: [01-10] -> 01 .. 10)

MAX_HOSTS = 1 << 20  # a typo such as [1-99999999] must not eat the agent's memory


def expand_hostlist(text: str) -> list[str]:
    """``node[01-04,07],gpu-a[1-2]-b[3,5]`` -> every host name, in Slurm's
    order, duplicates kept out (first place wins)."""
    hosts: dict[str, None] = {}
    for expr in _split_top(text):
        for host in _expand_expr(expr):
            hosts.setdefault(host)
            if len(hosts) > MAX_HOSTS:
                raise ValueError(f"more than {MAX_HOSTS} hosts")
    return list(hosts)


def _split_top(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested '[' at {i}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"']' without '[' at {i}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError("'[' without ']'")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_expr(expr: str) -> list[str]:
    head, bracket, tail = expr.partition("[")
    if not bracket:
        if any(ch.isspace() for ch in expr):
            raise ValueError(f"space in host name {expr!r}")
        return [expr]
    inside, _, after = tail.partition("]")
    suffixes = _expand_expr(after) if after else [""]
    return [head + n + s for n in _expand_ranges(inside) for s in suffixes]


def _expand_ranges(inside: str) -> list[str]:
    numbers: list[str] = []
    for part in inside.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"expected N or N-M inside brackets, found {part!r}")
        first, last = int(lo), int(hi) if dash else int(lo)
        if last < first:
            raise ValueError(f"range {part!r} runs backwards")
        if last - first >= MAX_HOSTS:
            raise ValueError(f"range {part!r} holds more than {MAX_HOSTS} hosts")
        numbers.extend(str(n).zfill(len(lo)) for n in range(first, last + 1))
    return numbers


@dataclass(frozen=True, slots=True)
class PeerList:
    """``--peers`` and ``--peers-from`` together: the agent's peers now."""

    listed: tuple[str, ...] = ()
    source: PeerSource | None = None

    def __call__(self) -> tuple[str, ...]:
        found = self.source.peers() if self.source is not None else ()
        return tuple(dict.fromkeys((*self.listed, *found)))

    def __bool__(self) -> bool:
        return bool(self.listed) or self.source is not None

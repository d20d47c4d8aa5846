"""The lab's nodes: one network namespace per node, joined by a switch.

Run ``<id>`` makes namespaces ``swlab-<id>-n<k>`` (the nodes) and
``swlab-<id>-sw`` (the switch: a bridge ``br0`` with one port ``n<k>`` per
node).  Node k has ``eth0`` with ``10.201.<b>.<k+1>/24`` (``b`` derived from
the run id) and ``lo`` up.  Everything a run makes lives inside its
namespaces: deleting them removes the links, nftables tables and qdiscs with
them; the processes inside are killed first (``ip netns pids``).

With ``host_port`` (runs with agents) the root namespace gets one link of the
run's, the operator's seat: a veth ``swl-<id>`` whose other end is a port of
the switch, with ``10.201.<b>.254/24``, so that the agents' addresses are
reachable from the host's shell as a cluster's nodes are from an operator's
machine (a connected route; no forwarding, no NAT; IPv6 off on it, so it
sends nothing unasked).  A subnet that the root namespace already routes (an
other run's seat, a network of the machine) is never used: new run ids avoid
it, and an explicit one is refused.  It goes with the switch's namespace.

Link faults act on the node's switch port, i.e. on its link, as a lossy cable
or a capped port would:
- loss: an nftables ``netdev`` table in the switch namespace drops P% of the
  node's TCP packets in both directions (``numgen random mod 100 < P``).  A drop
  inside the node's own stack (inet output hook) is reported to TCP as a local
  send error and retried without counting a retransmit (measured: +1 RetransSegs
  against +6,000 on the link), so it would not look like loss at all.
- rate: ``tc tbf`` on the node's ``eth0`` (egress) and on its switch port
  (traffic towards the node).
- partition: the same kind of table drops every packet of the node (all
  protocols, both directions), counting them; deleting it ends a flap.
- link down: the switch's end of the node's veth is set down, so the node's
  ``eth0`` loses carrier (``NO-CARRIER``, carrier 0, operstate ``DOWN``,
  ``carrier_changes`` +1; +2 once back up), as with a pulled cable or a dead
  switch port.  Its addresses and routes stay; what it sends is dropped by
  its own device (TCP retransmits with backoff).  Read inside the node
  (``link_state``) through ``ip netns exec``, which mounts the node's sysfs.
- reset: ``ss -K`` (SOCK_DESTROY, the kernel has CONFIG_INET_DIAG_DESTROY)
  inside the node on its established TCP connections but the agents' and the
  neighbour's ports.  The kernel aborts each socket (``tcp_abort``): the node's
  own sockets fail with ECONNABORTED, and an RST goes to each peer, whose
  socket fails with ECONNRESET.  Measured on this kernel (6.18), a 2x2 job,
  node 1 reset: ``tcp:tcp_send_reset`` fired 8 times, once per socket ``ss``
  aborted (state ESTABLISHED, reason TCP_STATE, in the context of ``ss``, not
  of the rank that owns the socket), ``tcp:tcp_receive_reset`` 8 times (node
  0's 6 sockets, and node 1's own 2 ends of connections inside the node, reset
  before ``ss`` reached them), ``sock:inet_sock_set_state`` ESTABLISHED ->
  CLOSE 16 times; EstabResets +10 on node 1 and +6 on node 0, OutRsts +8 on
  node 1.  The lab's libnccl then returns ncclRemoteError from the collective
  on every rank (as real NCCL's socket transport does for any failed send or
  recv), and every rank exits with code 4.

``cleanup_stale()`` removes what dead runs left behind: a live run keeps its
runner's pid in ``/run/stallwatch-lab/<id>/runner.pid``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from stallwatch.dumpers.errors import LabError

PREFIX = "swlab-"
RUNS_DIR = Path("/run/stallwatch-lab")
# the agents' pinned recordings (stallwatch record --pin-dir): one per node
PIN_ROOT = Path("/sys/fs/bpf/stallwatch")
PIN_PREFIX = "lab-"
NETNS_DIR = Path("/run/netns")
TOOLS = ("ip", "nft", "tc", "nsenter", "ethtool")
NODE_DEV = "eth0"
BRIDGE = "br0"
CLONE_NEWNET = 0x40000000
RUN_ID_RE = re.compile(r"^[a-z0-9]{1,8}$")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Node:
    index: int
    netns: str
    ip: str
    port: str  # its port on the switch

    def exec_prefix(self) -> list[str]:
        """Run a command inside this node's network namespace."""
        return ["nsenter", f"--net={NETNS_DIR / self.netns}", "--"]


@dataclass(frozen=True, slots=True)
class Network:
    run_id: str
    switch: str
    nodes: tuple[Node, ...]
    host_ip: str | None = None  # the root namespace's address on the switch, if any


def new_run_id(prefix: str = "") -> str:
    """A random run id (after ``prefix``, at most 2 letters) whose subnet
    the root namespace does not route."""
    taken = routed_subnets()
    for _ in range(64):
        run_id = prefix + secrets.token_hex(3)
        if subnet(run_id) not in taken:
            return run_id
    raise LabError("every lab subnet (10.201.1-250.0/24) is routed here: too many runs at once")


def check_run_id(run_id: str) -> str:
    if not RUN_ID_RE.match(run_id):
        raise LabError(f"run id {run_id!r} must be 1-8 lower-case letters or digits")
    return run_id


def check_tools() -> None:
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        raise LabError(
            f"the lab needs {', '.join(missing)} on PATH "
            "(Debian: iproute2, nftables, util-linux, ethtool)"
        )


def sh(cmd: Sequence[str], stdin: str | None = None, check: bool = True) -> str:
    """Run one tool; a failure raises LabError with the command and its stderr."""
    try:
        done = subprocess.run(
            list(cmd), input=stdin, capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LabError(f"{' '.join(cmd)}: {exc}") from exc
    if check and done.returncode != 0:
        why = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        raise LabError(f"{' '.join(cmd)}: {why[0]}")
    return done.stdout


def names(run_id: str, nodes: int) -> tuple[str, list[str]]:
    return f"{PREFIX}{run_id}-sw", [f"{PREFIX}{run_id}-n{k}" for k in range(nodes)]


def subnet(run_id: str) -> str:
    return f"10.201.{int.from_bytes(run_id.encode(), 'big') % 250 + 1}"


HOST_OCTET = 254  # the host's address on a run's subnet (its seat on the switch)
HOST_PORT = "host"  # the seat's port on the switch


def host_dev(run_id: str) -> str:
    """The seat's veth in the root namespace (at most 15 characters)."""
    return f"swl-{run_id}"


def routed_subnets() -> set[str]:
    """The ``10.201.<b>`` prefixes the root namespace has routes to."""
    try:
        out = sh(["ip", "-4", "-o", "route", "show", "root", "10.201.0.0/16"], check=False)
    except LabError:
        return set()
    return set(re.findall(r"^(10\.201\.\d+)\.", out, re.M))


def check_subnet_free(run_id: str) -> None:
    if subnet(run_id) in routed_subnets():
        raise LabError(
            f"run id {run_id!r}: its subnet {subnet(run_id)}.0/24 is routed here already "
            "(another run's, or a network of this machine): give another --run-id"
        )


def create(run_id: str, nodes: int, host_port: bool = False) -> Network:
    """Namespaces, switch and links (with ``host_port``, the root namespace's
    seat on the switch too); on failure, what was made is removed."""
    switch, node_names = names(run_id, nodes)
    net = Network(
        run_id,
        switch,
        tuple(
            Node(k, name, f"{subnet(run_id)}.{k + 1}", f"n{k}") for k, name in enumerate(node_names)
        ),
        f"{subnet(run_id)}.{HOST_OCTET}" if host_port else None,
    )
    if host_port:
        check_subnet_free(run_id)
    try:
        _make_switch(switch)
        for node in net.nodes:
            _make_node(switch, node)
        if net.host_ip is not None:
            _make_host_port(switch, run_id, net.host_ip)
    except BaseException:
        destroy(net)
        raise
    return net


def _make_switch(switch: str) -> None:
    sh(["ip", "netns", "add", switch])
    sh(["ip", "-n", switch, "link", "set", "lo", "up"])
    sh(["ip", "-n", switch, "link", "add", BRIDGE, "type", "bridge"])
    sh(["ip", "-n", switch, "link", "set", BRIDGE, "up"])


def _make_node(switch: str, node: Node) -> None:
    ns = node.netns
    sh(["ip", "netns", "add", ns])
    veth = ["type", "veth", "peer", "name", NODE_DEV, "netns", ns]
    sh(["ip", "-n", switch, "link", "add", node.port, *veth])
    sh(["ip", "-n", switch, "link", "set", node.port, "master", BRIDGE, "up"])
    sh(["ip", "-n", ns, "addr", "add", f"{node.ip}/24", "dev", NODE_DEV])
    sh(["ip", "-n", ns, "link", "set", NODE_DEV, "up"])
    sh(["ip", "-n", ns, "link", "set", "lo", "up"])


def _make_host_port(switch: str, run_id: str, ip: str) -> None:
    dev = host_dev(run_id)
    sh(["ip", "link", "add", dev, "type", "veth", "peer", "name", HOST_PORT, "netns", switch])
    sh(["ip", "-n", switch, "link", "set", HOST_PORT, "master", BRIDGE, "up"])
    with contextlib.suppress(OSError):  # a kernel without IPv6 has nothing to turn off
        Path(f"/proc/sys/net/ipv6/conf/{dev}/disable_ipv6").write_text("1")
    sh(["ip", "addr", "add", f"{ip}/24", "dev", dev])
    sh(["ip", "link", "set", dev, "up"])


SWITCH_OCTET = 253  # the switch's own address, for a host-scope agent to listen on


def address_switch(net: Network) -> str:
    """Give the switch's bridge an address on the run's subnet (a host-scope
    agent, which runs there, listens on it); returns it."""
    ip = f"{subnet(net.run_id)}.{SWITCH_OCTET}"
    sh(["ip", "-n", net.switch, "addr", "add", f"{ip}/24", "dev", BRIDGE])
    return ip


def _remove_host_port(run_id: str) -> list[str]:
    dev = host_dev(run_id)
    if not Path(f"/sys/class/net/{dev}").exists():
        return []  # gone with the switch's namespace
    try:
        sh(["ip", "link", "delete", dev])
    except LabError as exc:
        return [str(exc)]
    return []


def destroy(net: Network) -> list[str]:
    """Kill what runs inside, delete the namespaces; returns problems, raises nothing."""
    problems: list[str] = _remove_host_port(net.run_id) if net.host_ip is not None else []
    for ns in [*(node.netns for node in net.nodes), net.switch]:
        problems += delete_netns(ns)
    return problems


def delete_netns(ns: str) -> list[str]:
    if not (NETNS_DIR / ns).exists():
        return []
    problems = kill_inside(ns)
    try:
        sh(["ip", "netns", "delete", ns])
    except LabError as exc:
        problems.append(str(exc))
    return problems


def pids_inside(ns: str) -> list[int]:
    try:
        out = sh(["ip", "netns", "pids", ns], check=False)
    except LabError:
        return []
    return [int(tok) for tok in out.split() if tok.isdigit()]


def kill_inside(ns: str, grace: float = 0.0) -> list[str]:
    """SIGKILL every process in the namespace and wait until they are gone."""
    deadline = time.monotonic() + 5.0 + grace
    pids = pids_inside(ns)
    while pids and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
        pids = pids_inside(ns)
    return [f"processes {pids} in {ns} would not die"] if pids else []


# --- link faults -------------------------------------------------------------


# which of a node's packets a rule acts on, seen from the node: what its
# switch port receives from it (ingress: "out") and sends to it (egress: "in")
WAYS = ("both", "in", "out")


def add_loss(net: Network, node: Node, pct: int, way: str = "both") -> None:
    rule = f"meta l4proto tcp numgen random mod 100 < {pct} counter drop"
    _nft_table(net, f"loss_{node.port}", node, rule, way)


def add_rate(net: Network, node: Node, mbit: float, way: str = "both") -> None:
    # burst must hold at least one MTU-sized packet per timer tick.
    burst = max(16, int(mbit * 1000 / 8 / 100))  # kbyte: 10 ms at the rate
    tbf = ["tbf", "rate", f"{mbit}mbit", "burst", f"{burst}kb", "latency", "200ms"]
    if way in ("both", "out"):
        sh(["ip", "netns", "exec", node.netns, "tc", "qdisc", "add", "dev", NODE_DEV, "root", *tbf])
    if way in ("both", "in"):
        sh(
            [
                "ip",
                "netns",
                "exec",
                net.switch,
                "tc",
                "qdisc",
                "add",
                "dev",
                node.port,
                "root",
                *tbf,
            ]
        )


def _nft_table(net: Network, table: str, node: Node, rule: str, way: str = "both") -> None:
    if way not in WAYS:
        raise LabError(f"a link rule acts {' or '.join(WAYS)}, not {way!r}")
    chains = []
    if way in ("both", "out"):
        chains.append(
            f'  chain from_node {{ type filter hook ingress device "{node.port}" priority 0;\n'
            f"    {rule}\n  }}\n"
        )
    if way in ("both", "in"):
        chains.append(
            f'  chain to_node {{ type filter hook egress device "{node.port}" priority 0;\n'
            f"    {rule}\n  }}\n"
        )
    ruleset = f"table netdev {table} {{\n{''.join(chains)}}}\n"
    sh(["ip", "netns", "exec", net.switch, "nft", "-f", "-"], stdin=ruleset)


def add_partition(net: Network, node: Node, way: str = "both") -> None:
    """Every packet to and from the node dropped, and counted, on its switch
    port; one way (``in`` or ``out``), every IPv4 packet of that way, as an
    ACL or a route that blackholes one direction would: ARP still passes
    (were it dropped too, the node's neighbour entries would fail within a
    minute and the cut would act both ways)."""
    rule = "counter drop" if way == "both" else "meta protocol ip counter drop"
    _nft_table(net, f"partition_{node.port}", node, rule, way)


def add_mtu(net: Network, node: Node, size: int) -> None:
    """IPv4 packets of the node longer than ``size`` bytes dropped both ways:
    an MTU blackhole (a hop with a smaller MTU that sends no ICMP)."""
    _nft_table(net, f"mtu_{node.port}", node, f"ip length > {size} counter drop")


def add_syn_drop(net: Network, node: Node) -> None:
    """TCP SYNs to and from the node dropped (SYN-ACKs pass: only the opening
    of a connection is refused, by silence)."""
    _nft_table(net, f"syn_{node.port}", node, "tcp flags & (syn|ack) == syn counter drop")


def add_corrupt(net: Network, node: Node, pct: int) -> None:
    """``pct``% of the node's TCP packets get a byte of their TCP header past
    its first 20 bytes, or of the payload, overwritten on its switch port.
    Over veth a sender leaves the checksum to the receiver's trust
    (CHECKSUM_PARTIAL), which would let corrupt data through to the job; so
    every node's ``eth0`` computes checksums in software first (``ethtool -K
    eth0 tx off``), and the receiver's TCP drops the packet as a NIC would
    a frame that fails its check (``InCsumErrors``)."""
    for n in net.nodes:
        sh(["ip", "netns", "exec", n.netns, "ethtool", "-K", NODE_DEV, "tx", "off"])
    rule = f"meta l4proto tcp numgen random mod 100 < {pct} @th,160,8 set 0x5a counter"
    _nft_table(net, f"corrupt_{node.port}", node, rule)


def table_packets(net: Network, table: str) -> int:
    """Packets the rules of one of the switch's netdev tables counted so far."""
    out = sh(["ip", "netns", "exec", net.switch, "nft", "-j", "list", "table", "netdev", table])
    try:
        items = json.loads(out)["nftables"]
    except (ValueError, KeyError, TypeError) as exc:
        raise LabError(f"nft -j list table {table}: unreadable ({exc})") from exc
    return sum(
        int(expr["counter"]["packets"])
        for item in items
        for expr in item.get("rule", {}).get("expr", [])
        if "counter" in expr
    )


def partition_drops(net: Network, node: Node) -> int:
    """Packets the node's partition table dropped so far."""
    return table_packets(net, f"partition_{node.port}")


def remove_partition(net: Network, node: Node) -> int:
    """Ends a partition; returns the packets it dropped."""
    dropped = partition_drops(net, node)
    sh(["ip", "netns", "exec", net.switch, "nft", "delete", "table", "netdev",
        f"partition_{node.port}"])  # fmt: skip
    return dropped


def set_link(net: Network, node: Node, up: bool) -> None:
    """The switch's end of the node's link, down (the node loses carrier) or up."""
    sh(["ip", "-n", net.switch, "link", "set", node.port, "up" if up else "down"])


LINK_FILES = ("carrier", "operstate", "carrier_changes")


def link_state(node: Node) -> dict[str, int | str | None]:
    """The node's ``eth0`` as the node sees it (its sysfs): carrier (None
    when the device itself is down), operstate, carrier_changes."""
    script = "; ".join(
        f"cat /sys/class/net/{NODE_DEV}/{name} 2>/dev/null || echo -" for name in LINK_FILES
    )
    out = sh(["ip", "netns", "exec", node.netns, "sh", "-c", script]).split()
    if len(out) != len(LINK_FILES):
        raise LabError(f"{node.netns}: unreadable link state of {NODE_DEV}: {out}")
    carrier, operstate, changes = out
    return {
        "carrier": None if carrier == "-" else int(carrier),
        "operstate": operstate,
        "carrier_changes": None if changes == "-" else int(changes),
    }


def reset_connections(node: Node, keep_ports: Sequence[int]) -> int:
    """Abort the node's established TCP connections (``ss -K``) but those to
    or from ``keep_ports``; returns how many sockets were reset."""
    keep = " or ".join(f"sport = :{p} or dport = :{p}" for p in keep_ports)
    filt = ["state", "established", *(["not", "(", keep, ")"] if keep else [])]
    out = sh(["ip", "netns", "exec", node.netns, "ss", "-K", "-t", "-n", "-H", *filt])
    return sum(1 for line in out.splitlines() if line.strip())


TCP_SETTINGS = frozenset({"RtoAlgorithm", "RtoMin", "RtoMax", "MaxConn"})  # not counters


def tcp_counters(ns: str) -> dict[str, int]:
    """The Tcp: line of /proc/net/snmp inside a namespace (RetransSegs,
    OutSegs, ActiveOpens, EstabResets, ...), read by a thread that joined it."""
    text = in_netns(ns, lambda: Path("/proc/thread-self/net/snmp").read_text())
    rows = [line.split() for line in text.splitlines() if line.startswith("Tcp:")]
    if len(rows) < 2:
        raise LabError(f"no Tcp: counters in /proc/net/snmp of {ns}")
    pairs = zip(rows[0][1:], rows[1][1:], strict=True)
    return {key: int(value) for key, value in pairs if key not in TCP_SETTINGS}


# --- running code inside a namespace -------------------------------------------


def in_netns(ns: str, fn: Callable[[], T]) -> T:
    """Call fn on a fresh thread that has joined the namespace (setns is per thread)."""
    result: list[T] = []
    errors: list[BaseException] = []

    def body() -> None:
        try:
            _setns(NETNS_DIR / ns)
            result.append(fn())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=body, name=f"netns-{ns}", daemon=True)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]


def _setns(path: Path) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise LabError(f"setns({path}): {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


# --- leftovers -----------------------------------------------------------------


def list_netns(prefix: str = PREFIX) -> list[str]:
    if not NETNS_DIR.is_dir():
        return []
    return sorted(p.name for p in NETNS_DIR.iterdir() if p.name.startswith(prefix))


def run_of(ns: str) -> str | None:
    match = re.match(rf"^{PREFIX}([a-z0-9]+)-(sw|n\d+)$", ns)
    return match.group(1) if match else None


def run_alive(run_id: str) -> bool:
    try:
        pid = int((RUNS_DIR / run_id / "runner.pid").read_text())
    except (OSError, ValueError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale() -> list[str]:
    """Delete the namespaces (and their processes) of runs whose runner is dead."""
    removed: list[str] = []
    for ns in list_netns():
        run_id = run_of(ns)
        if run_id is None or run_alive(run_id):
            continue
        delete_netns(ns)
        removed.append(ns)
    for run_dir in RUNS_DIR.glob("*") if RUNS_DIR.is_dir() else []:
        if not run_alive(run_dir.name):
            shutil.rmtree(run_dir, ignore_errors=True)
    for seat in Path("/sys/class/net").glob(host_dev("*")):  # left by a dead run
        if not run_alive(seat.name.removeprefix(host_dev(""))):
            _remove_host_port(seat.name.removeprefix(host_dev("")))
    for pins in PIN_ROOT.glob(f"{PREFIX_PINS_GLOB}") if PIN_ROOT.is_dir() else []:
        run_id = pins.name.removeprefix(PIN_PREFIX).split("-", 1)[0]
        if not run_alive(run_id):
            remove_pins(pins)
    return removed


PREFIX_PINS_GLOB = f"{PIN_PREFIX}*"


def remove_pins(path: Path) -> None:
    """Unpin an agent's recording: its probes detach once no agent holds them."""
    shutil.rmtree(path, ignore_errors=True)

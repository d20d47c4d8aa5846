"""Faults the runner injects from outside the job: network faults on a node's
link and CPU hogs, from the start or once a rank reaches a step.

From the start (before any rank runs): ``loss``, ``rate``, ``mtu``, ``syn``,
``corrupt``, ``bulk`` and ``cpuhog`` without a step; ``throttle`` without a
step as soon as the ranks run.  At a step: ``partition``, ``linkdown``,
``rst``, ``stop``, and the others with ``step=S``.  Each rank writes the step
it begins into ``job.STEPS_FILE`` (one pwrite a step); a thread here reads it
every ``POLL_S`` and fires a fault as soon as any rank is at its step or
later, then ends a flap or an outage (``ms=M``) M ms after it began.  A fault
records the step it really fired at: on a fast job the thread may see a rank
one or two steps past S.

How each is done (the mechanisms are in ``lab.netns``):
- partition: an nftables netdev table on the node's switch port drops (and
  counts) every packet both ways; ``ms``: the table is deleted after M ms.
- linkdown: the switch's end of the node's veth is set down (the node's
  ``eth0`` loses carrier); ``ms``: set up again.  The node's link state is
  read before, during and after.
- rst: ``ss -K`` inside the node on the job's established connections (the
  agents' and the neighbour's ports are left alone).
- loss, rate, mtu, syn, corrupt: nftables tables or tbf qdiscs as from the
  start, applied at the step; they last.
- cpuhog, bulk: the runner's processes, started at the step.
- throttle: the rank's process moved into a cgroup with a CPU quota.
- stop: SIGSTOP to the rank's process (every rank's), SIGCONT ``ms`` later.

Every network fault records every node's TCP counters (``/proc/net/snmp``)
just before it acts, so a test or a benchmark can tell what happened before
the fault from what happened after.  A failure to inject stops the run: the
runner's waiting loop raises it (``check``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stallwatch.dumpers.errors import LabError
from stallwatch.lab import faults as F
from stallwatch.lab import job, netns
from stallwatch.lab.faultlog import Episode, FaultRecord, Moment

POLL_S = 0.01
LINK_SETTLE_S = 1.0  # how long to wait for the node's carrier to follow its switch port

LinkFault = F.Loss | F.Rate | F.Partition | F.LinkDown | F.Rst | F.Mtu | F.SynDrop | F.Corrupt
RunnerFault = LinkFault | F.CpuHog | F.Bulk | F.Throttle | F.Stop
StartHog = Callable[[F.CpuHog], str]  # starts the hogs, says how
StartBulk = Callable[[F.Bulk], str]  # starts a bulk neighbour, says how
# acts on the ranks' processes (True: the fault begins; False: it ends), says how
OnRanks = Callable[[F.Throttle | F.Stop, bool], str]
_RUNNER_KINDS = (
    F.Loss, F.Rate, F.Partition, F.LinkDown, F.Rst, F.Mtu, F.SynDrop, F.Corrupt,
    F.CpuHog, F.Bulk, F.Throttle, F.Stop,
)  # fmt: skip
# the nftables table each counting link fault keeps on the switch, by kind
_TABLES = {F.Loss: "loss", F.Partition: "partition", F.Mtu: "mtu", F.SynDrop: "syn",
           F.Corrupt: "corrupt"}  # fmt: skip


@dataclass(slots=True)
class _Planned:
    fault: RunnerFault
    fired: Episode | None = None
    ends_at: float | None = None  # time.monotonic() when a flap ends
    how: str = ""
    measured: dict[str, Any] = field(default_factory=dict)

    @property
    def step(self) -> int | None:
        return self.fault.step


def runner_faults(faults: Iterable[F.Fault]) -> list[RunnerFault]:
    """The faults this module injects (the others act inside the ranks or
    on the agents)."""
    return [f for f in faults if isinstance(f, _RUNNER_KINDS)]


@dataclass
class Injector:
    """The runner's faults of one run, and what became of them."""

    net: netns.Network
    faults: Sequence[RunnerFault]
    run_dir: Path
    start_hog: StartHog
    keep_ports: Sequence[int]  # reset leaves connections on these ports alone
    start_bulk: StartBulk | None = None
    on_ranks: OnRanks | None = None
    _planned: list[_Planned] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _error: BaseException | None = None

    def __post_init__(self) -> None:
        self._planned = [_Planned(f) for f in self.faults]

    # --- the run's side -------------------------------------------------------

    def apply_from_start(self) -> None:
        """The faults without a step, before any rank starts (a throttle
        acts on the ranks' processes: once they run, in the thread)."""
        for p in self._planned:
            if p.step is None and not isinstance(p.fault, F.Throttle):
                self._fire(p, None)

    def start(self) -> None:
        if any(p.fired is None or p.ends_at is not None for p in self._planned):
            self._thread = threading.Thread(target=self._loop, name="lab-injector", daemon=True)
            self._thread.start()

    def check(self) -> None:
        """Raise what went wrong in the thread, if anything did."""
        if self._error is not None:
            raise LabError(f"injecting a fault failed: {self._error}") from self._error

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def finish(self) -> None:
        """Stop, and read what a fault that lasted did until now."""
        self.stop()
        for p in self._planned:
            table = _TABLES.get(type(p.fault))
            if table is not None and p.fired is not None and p.fired.end is None:
                key = "corrupted_packets" if isinstance(p.fault, F.Corrupt) else "dropped_packets"
                port = self._node(p).port
                p.measured[key] = netns.table_packets(self.net, f"{table}_{port}")
            if isinstance(p.fault, F.LinkDown) and p.fired is not None and p.fired.end is None:
                p.measured["link_at_end"] = netns.link_state(self._node(p))

    def records(self) -> dict[RunnerFault, FaultRecord]:
        return {
            p.fault: FaultRecord.of(
                F.format_fault(p.fault),
                p.how or _how(p.fault, self.net),
                [p.fired] if p.fired is not None else [],
                p.measured,
            )
            for p in self._planned
        }

    # --- the thread -------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._tick():
                    return
                self._stop.wait(POLL_S)
        except BaseException as exc:  # raised in the runner's loop by check()
            self._error = exc

    def _tick(self) -> bool:
        """Fire what is due, end what is over; False once nothing is left to do."""
        reached = max(job.read_steps(self.run_dir), default=-1)
        now = time.monotonic()
        left = False
        for p in self._planned:
            if p.fired is None and (p.step is not None or isinstance(p.fault, F.Throttle)):
                if reached >= (p.step or 0):
                    self._fire(p, reached)
                left = True
            if p.ends_at is not None:
                if now >= p.ends_at:
                    self._end(p)
                else:
                    left = True
        return left or any(p.ends_at is not None for p in self._planned)

    # --- the faults -------------------------------------------------------------

    def _node(self, p: _Planned) -> netns.Node:
        assert not isinstance(p.fault, F.CpuHog | F.Throttle | F.Stop)
        return self.net.nodes[p.fault.node]

    def _fire(self, p: _Planned, step: int | None) -> None:
        fault = p.fault
        if isinstance(fault, F.CpuHog | F.Bulk | F.Throttle | F.Stop):
            start = Moment.now()
            p.how = self._local(fault)
            p.fired = Episode(step, start)
            if isinstance(fault, F.Stop):
                p.ends_at = start.mono_ns / 1e9 + fault.ms / 1000.0
            return
        node = self._node(p)
        p.measured["tcp_before"] = {
            str(n.index): netns.tcp_counters(n.netns) for n in self.net.nodes
        }
        if isinstance(fault, F.LinkDown):
            p.measured["link_before"] = netns.link_state(node)
        start = Moment.now()
        _act(fault, self.net, node, p.measured, self.keep_ports)
        p.fired = Episode(step, start)
        if isinstance(fault, F.LinkDown):
            p.measured["link_during"] = _settled_link(node, carrier=0)
        ms = fault.ms if isinstance(fault, F.Partition | F.LinkDown) else None
        if ms is not None:
            p.ends_at = start.mono_ns / 1e9 + ms / 1000.0  # time.monotonic()'s clock

    def _local(self, fault: F.CpuHog | F.Bulk | F.Throttle | F.Stop) -> str:
        """A fault the runner's own processes or the ranks' act out."""
        if isinstance(fault, F.CpuHog):
            return self.start_hog(fault)
        if isinstance(fault, F.Bulk):
            if self.start_bulk is None:
                raise LabError("this run cannot start a bulk neighbour")
            return self.start_bulk(fault)
        if self.on_ranks is None:
            raise LabError("this run cannot act on its ranks' processes")
        return self.on_ranks(fault, True)

    def _end(self, p: _Planned) -> None:
        fault = p.fault
        assert p.fired is not None
        p.ends_at = None
        end = Moment.now()
        if isinstance(fault, F.Stop):
            assert self.on_ranks is not None
            self.on_ranks(fault, False)
            p.fired = Episode(p.fired.step, p.fired.start, end)
            return
        node = self._node(p)
        if isinstance(fault, F.Partition):
            p.measured["dropped_packets"] = netns.remove_partition(self.net, node)
        else:
            netns.set_link(self.net, node, up=True)
            p.measured["link_after"] = _settled_link(node, carrier=1)
        p.fired = Episode(p.fired.step, p.fired.start, end)


def _act(
    fault: LinkFault,
    net: netns.Network,
    node: netns.Node,
    measured: dict[str, Any],
    keep_ports: Sequence[int],
) -> None:
    if isinstance(fault, F.Loss):
        netns.add_loss(net, node, fault.pct, fault.dir.value)
    elif isinstance(fault, F.Rate):
        netns.add_rate(net, node, fault.mbit, fault.dir.value)
    elif isinstance(fault, F.Partition):
        netns.add_partition(net, node, fault.dir.value)
    elif isinstance(fault, F.Mtu):
        netns.add_mtu(net, node, fault.size)
    elif isinstance(fault, F.SynDrop):
        netns.add_syn_drop(net, node)
    elif isinstance(fault, F.Corrupt):
        netns.add_corrupt(net, node, fault.pct)
    elif isinstance(fault, F.LinkDown):
        netns.set_link(net, node, up=False)
    else:
        measured["sockets_reset"] = netns.reset_connections(node, keep_ports)


def _settled_link(node: netns.Node, carrier: int) -> dict[str, int | str | None]:
    """The node's link state once its carrier shows ``carrier`` (or as it is
    after LINK_SETTLE_S: the record then says what it was)."""
    deadline = time.monotonic() + LINK_SETTLE_S
    state = netns.link_state(node)
    while state["carrier"] != carrier and time.monotonic() < deadline:
        time.sleep(0.02)
        state = netns.link_state(node)
    return state


_WAYS = {
    F.Direction.BOTH: "both ways",
    F.Direction.IN: "to the node only",
    F.Direction.OUT: "from the node only",
}


def _how(fault: RunnerFault, net: netns.Network) -> str:
    if isinstance(fault, F.CpuHog):
        return "busy processes pinned to the rank's CPU"
    if isinstance(fault, F.Throttle):
        return f"the rank's process in a cgroup with a CPU quota of {fault.pct}%"
    if isinstance(fault, F.Stop):
        return f"SIGSTOP, SIGCONT after {fault.ms:g} ms"
    if isinstance(fault, F.Bulk):
        return f"a TCP stream of {fault.mbit:g} Mbit/s outside the job"
    node = net.nodes[fault.node]
    port = f"switch port {node.port}"
    if isinstance(fault, F.Loss):
        return f"nftables netdev drop of {fault.pct}% of TCP packets on {port}, {_WAYS[fault.dir]}"
    if isinstance(fault, F.Rate):
        where = {
            F.Direction.BOTH: f"{node.netns} {netns.NODE_DEV} and on {port}",
            F.Direction.OUT: f"{node.netns} {netns.NODE_DEV}",
            F.Direction.IN: port,
        }[fault.dir]
        return f"tc tbf at {fault.mbit:g} Mbit/s on {where}"
    if isinstance(fault, F.Mtu):
        return f"nftables netdev drop of IPv4 packets over {fault.size} bytes on {port}, both ways"
    if isinstance(fault, F.SynDrop):
        return f"nftables netdev drop of TCP SYNs on {port}, both ways"
    if isinstance(fault, F.Corrupt):
        return (
            f"nftables netdev overwrite of a byte in {fault.pct}% of TCP packets on {port}, "
            "both ways; every node checksums in software"
        )
    if isinstance(fault, F.Partition):
        flap = f", removed after {fault.ms:g} ms" if fault.ms is not None else ""
        return f"nftables netdev drop of every packet on {port}, {_WAYS[fault.dir]}{flap}"
    if isinstance(fault, F.LinkDown):
        back = f", up again after {fault.ms:g} ms" if fault.ms is not None else ""
        return f"{port} set down: {node.netns} {netns.NODE_DEV} loses carrier{back}"
    return f"ss -K on the established TCP connections in {node.netns} (SOCK_DESTROY)"

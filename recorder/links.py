"""The link sampler: the node's network interfaces and RDMA ports, sampled
into a ring of their own, each mapped to the processes that use it.

Fabrics that bypass the kernel's TCP stack (InfiniBand, RoCE, EFA) leave no
retransmit to record; their links' state and their NICs' counters still
show a cut cable, a flapping port or a lossy link.  Each tick (at most every
``period_s``, at once when rtnetlink says a link changed) ``LinkSampler.tick``
reads, in the agent's network namespace:

- every netdev, by one rtnetlink dump (``recorder.netlink``): admin and
  oper state, carrier and its change counts, the 64-bit counters;
- every RDMA port under ``rdma_root`` (``recorder.rdma``): port and
  physical state each sample, the PortCounters and the driver's
  ``hw_counters`` every ``rdma_counters_s`` and whenever a row is due (a
  PortCounters read is a MAD to the adapter: not every second).

A row (``dumpers.layout.LINK``) goes into the ring when the interface is
first seen, its carrier went down or up (or flapped between two readings:
its change counts moved, RDMA's ``link_downed``), another state changed,
an error, drop or discard counter moved (``ERROR_COUNTERS``), it went, and
otherwise every ``heartbeat_s`` (so that a dump shows the state before an
incident).  Traffic and congestion counters ride along in those rows.  A
row's ``after_ns`` is the interface's previous reading: what it reports
happened in (``after_ns``, ``ts_ns``].

The ring is a user-space ring (``recorder.rings``) of ``slots`` rows,
allocated once; the interfaces it names are a table beside it (ids never
reused; a gone interface is kept while a row names it).  Which processes use
an interface (``recorder.linkusers``) is read for each watched process every
``map_period_s`` (sooner, after 2, 4, 8 ... s, while it uses nothing yet: a
rank connects some seconds after it starts), for all of them soon after a
link row that is not a heartbeat, and at each recording; a process once seen
on an interface stays on it.

Known limits: netdevs are those of the agent's network namespace; a
counter's movement is seen at the next reading (1 s for netdevs, up to
``rdma_counters_s`` for RDMA counters); a carrier flap inside one reading
shows as ``carrier_flap`` (the counts moved), with its bounds; a netdev's
oper state follows its carrier when the kernel's linkwatch runs (within
milliseconds, later on a loaded machine), so a reading between the two shows
the carrier down with the oper state still up, and a ``state`` row follows.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from stallwatch.dumpers.layout import (
    LINK_COUNTERS,
    NETDEV_COUNTERS,
    RDMA_COUNTERS,
    RDMA_HW_COUNTERS,
    UNKNOWN_U8,
    UNKNOWN_U32,
    UNKNOWN_U64,
    EventKind,
    LinkEvent,
    LinkKind,
)
from stallwatch.dumpers.model import LinkInfo, Ring
from stallwatch.dumpers.schema import LINK_EVENT, LINK_VALUE_FIELDS, PHYS_LINK_UP

from . import linkusers
from .netlink import NetdevSample, NetlinkError, Rtnl
from .prometheus import LinkState
from .rdma import DEFAULT_ROOT, DEFAULT_VERBS_ROOT, PortId, RdmaPorts
from .rings import RingWriter

log = logging.getLogger("stallwatch.record")

# Counters whose movement writes a row: errors, drops, discards, recoveries,
# retransmissions.  The others (traffic, congestion) ride along.
ERROR_COUNTERS = frozenset(
    {
        "rx_errors", "tx_errors", "rx_dropped", "tx_dropped", "collisions", "rx_length_errors",
        "rx_over_errors", "rx_crc_errors", "rx_frame_errors", "rx_fifo_errors",
        "rx_missed_errors", "tx_aborted_errors", "tx_carrier_errors", "tx_fifo_errors",
        "tx_heartbeat_errors", "tx_window_errors",
        "symbol_error", "port_rcv_errors", "port_rcv_remote_physical_errors",
        "port_rcv_switch_relay_errors", "link_error_recovery", "port_xmit_constraint_errors",
        "port_rcv_constraint_errors", "local_link_integrity_errors",
        "excessive_buffer_overrun_errors", "link_downed", "port_xmit_discards", "vl15_dropped",
        "out_of_sequence", "packet_seq_err", "out_of_buffer", "local_ack_timeout_err",
        "rnr_nak_retry_err", "implied_nak_seq_err", "duplicate_request", "req_cqe_error",
        "resp_cqe_error", "rx_icrc_encapsulated", "roce_adp_retrans",
    }
)  # fmt: skip
CONGESTION_COUNTERS = frozenset(
    {"port_xmit_wait", "roce_slow_restart", "np_ecn_marked_roce_packets", "np_cnp_sent",
     "rp_cnp_handled", "rp_cnp_ignored"}
)  # fmt: skip

# Positions in a reading (LINK_VALUE_FIELDS order): states, change counts, counters.
_AT = {name: i for i, name in enumerate(LINK_VALUE_FIELDS)}
CARRIER = _AT["carrier"]
STATES = tuple(_AT[n] for n in ("admin_up", "operstate", "port_state", "phys_state"))
FLAPS = tuple(_AT[n] for n in ("carrier_changes", "carrier_up_count", "carrier_down_count"))
LINK_DOWNED = _AT["link_downed"]
ERRORS = tuple(_AT[n] for n in LINK_COUNTERS if n in ERROR_COUNTERS)
UNKNOWN = tuple(
    {1: UNKNOWN_U8, 4: UNKNOWN_U32, 8: UNKNOWN_U64}[LINK_EVENT[n].itemsize]
    for n in LINK_VALUE_FIELDS
)
FIRST_COUNTER = _AT[LINK_COUNTERS[0]]
# where _pad1 sits among the values (the row is written as one tuple)
_FIELDS = LINK_EVENT.names or ()
_PAD1_AT = _FIELDS.index("_pad1") - _FIELDS.index("carrier")
# rtnl_link_stats64 index of each NETDEV_COUNTERS entry (rx/tx_compressed left out)
_STATS64_AT = (*range(21), 23, 24)
_pick_stats = operator.itemgetter(*_STATS64_AT)
_NO_NETDEV = (UNKNOWN_U64,) * len(NETDEV_COUNTERS)
_NO_RDMA = (UNKNOWN_U64,) * (len(RDMA_COUNTERS) + len(RDMA_HW_COUNTERS))

Reading = tuple[int, ...]  # one value per LINK_VALUE_FIELDS, unknown as all ones
MAP_FIRST_NS = 2_000_000_000  # a process that uses nothing yet is looked at again after 2 s
MAP_SOON_NS = 5_000_000_000  # after a link changed: everyone, at most this often


@dataclass(frozen=True, slots=True)
class LinkConfig:
    slots: int = 4096  # rows in the ring (a power of two)
    period_s: float = 1.0  # a reading at least this often (at once when a link changes)
    heartbeat_s: float = 10.0  # a row at least this often per interface
    rdma_counters_s: float = 5.0  # RDMA counters at least this often
    map_period_s: float = 30.0  # which processes use which interface
    rdma_root: Path = DEFAULT_ROOT
    verbs_root: Path = DEFAULT_VERBS_ROOT
    proc_root: Path = linkusers.PROC


@dataclass(slots=True)
class _Iface:
    """One interface as the sampler keeps it."""

    id: int
    kind: LinkKind
    name: str
    first_ns: int
    reading: Reading | None = None
    read_ns: int = 0  # the last reading
    counters_ns: int = 0  # the last reading of its counters (RDMA: not every reading)
    row_ns: int = 0  # its last row
    last_pos: int = 0  # that row's ring position
    gone_ns: int = 0
    ifindex: int | None = None
    device: str | None = None
    port: int | None = None
    netdev: str | None = None
    link_type: str | None = None
    link_layer: str | None = None
    addresses: tuple[str, ...] = ()
    mtu: int | None = None
    speed_mbps: int | None = None
    pids: set[int] = field(default_factory=set)

    def info(self, keep: Callable[[int], bool]) -> LinkInfo:
        return LinkInfo(
            id=self.id,
            name=self.name,
            kind=self.kind.name.lower(),
            device=self.device,
            port=self.port,
            ifindex=self.ifindex,
            netdev=self.netdev,
            link_type=self.link_type,
            link_layer=self.link_layer,
            addresses=self.addresses,
            mtu=self.mtu,
            speed_mbps=self.speed_mbps,
            pids=tuple(sorted(p for p in self.pids if keep(p))),
            first_ns=self.first_ns,
            gone_ns=self.gone_ns,
        )


def _known(value: int | None, unknown: int) -> int:
    return unknown if value is None else value


def netdev_reading(s: NetdevSample) -> Reading:
    stats = s.stats
    if len(stats) > _STATS64_AT[-1]:
        counters = _pick_stats(stats)
    else:  # an older kernel's shorter struct: the counters it lacks are unknown
        counters = tuple(stats[i] if i < len(stats) else UNKNOWN_U64 for i in _STATS64_AT)
    return (
        _known(s.carrier, UNKNOWN_U8),
        int(s.admin_up),
        _known(s.operstate, UNKNOWN_U8),
        UNKNOWN_U8,
        UNKNOWN_U8,
        _known(s.carrier_changes, UNKNOWN_U32),
        _known(s.carrier_up, UNKNOWN_U32),
        _known(s.carrier_down, UNKNOWN_U32),
        *counters,
        *_NO_RDMA,
    )


def rdma_reading(
    port_state: int | None, phys_state: int | None, counters: Iterable[int | None]
) -> Reading:
    carrier = UNKNOWN_U8 if phys_state is None else int(phys_state == PHYS_LINK_UP)
    return (
        carrier,
        UNKNOWN_U8,
        UNKNOWN_U8,
        _known(port_state, UNKNOWN_U8),
        _known(phys_state, UNKNOWN_U8),
        UNKNOWN_U32,
        UNKNOWN_U32,
        UNKNOWN_U32,
        *_NO_NETDEV,
        *(_known(c, UNKNOWN_U64) for c in counters),
    )


def _moved(old: Reading, new: Reading, at: Iterable[int]) -> bool:
    """Whether a value at ``at`` changed, known on both sides."""
    return any(old[i] != new[i] and UNKNOWN[i] not in (old[i], new[i]) for i in at)


def decide(old: Reading | None, new: Reading, kind: LinkKind, quiet_ns: int,
           heartbeat_ns: int) -> LinkEvent | None:  # fmt: skip
    """Why a row is due (the strongest reason), None if none is;
    ``quiet_ns``: the time since the interface's last row."""
    if old is None:
        return LinkEvent.SEEN
    if _moved(old, new, (CARRIER,)):
        return LinkEvent.CARRIER_UP if new[CARRIER] == 1 else LinkEvent.CARRIER_DOWN
    flaps = FLAPS if kind is LinkKind.NETDEV else (LINK_DOWNED,)
    if _moved(old, new, flaps):
        return LinkEvent.CARRIER_FLAP
    if _moved(old, new, STATES):
        return LinkEvent.STATE
    if _moved(old, new, ERRORS):
        return LinkEvent.ERRORS
    if quiet_ns >= heartbeat_ns:
        return LinkEvent.HEARTBEAT
    return None


def _row(ts: int, after: int, iface: _Iface, event: LinkEvent, reading: Reading) -> tuple[int, ...]:
    """One ring row as a tuple in the record's field order."""
    head = (0, ts, EventKind.LINK, LINK_EVENT.itemsize, 0, 0, 0, after, iface.id, iface.kind, event)
    return (*head, *reading[:_PAD1_AT], 0, *reading[_PAD1_AT:])


class LinkSampler:
    """Samples the node's links into its ring; the agent calls ``tick``."""

    def __init__(
        self,
        config: LinkConfig | None = None,
        rtnl: Callable[[], Rtnl] | None = Rtnl,  # None: RDMA ports only (tests)
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.config = cfg = config or LinkConfig()
        self.clock = clock
        self.writer = RingWriter("link", LINK_EVENT, cfg.slots)
        self.rdma = RdmaPorts(cfg.rdma_root)
        self.errors = 0  # readings that failed
        try:
            self.rtnl: Rtnl | None = rtnl() if rtnl is not None else None
        except NetlinkError as exc:
            log.warning("links: no rtnetlink (%s): network interfaces are not sampled", exc)
            self.rtnl = None
            self.errors += 1
        self._ifaces: dict[int, _Iface] = {}  # by id: present ones, and gone ones a row names
        self._live: dict[tuple[object, ...], int] = {}  # what identifies a present one -> id
        self._next_id = 1
        self._pending: list[tuple[int, ...]] = []
        self._last_sample = 0
        self._last_map = 0
        self._map_soon = False
        self._next_map: dict[int, int] = {}  # pid -> when to look at it again
        self._wait: dict[int, int] = {}  # pid -> how long to wait after that
        self._addresses_stale = True

    # ---- what the agent sees ------------------------------------------------

    @property
    def fd(self) -> int | None:
        """Readable when rtnetlink says a link or an address changed."""
        return self.rtnl.fd if self.rtnl is not None else None

    @property
    def memory_bytes(self) -> int:
        return self.writer.buffer.capacity * LINK_EVENT.itemsize

    def copy(self) -> Ring:
        return self.writer.buffer.copy()

    def table(self, keep: Callable[[int], bool] = lambda pid: True) -> tuple[LinkInfo, ...]:
        """The interfaces the ring names (and those present), with the
        processes ``keep`` accepts among those that use them."""
        return tuple(i.info(keep) for i in sorted(self._ifaces.values(), key=lambda i: i.id))

    def states(self, keep: Callable[[int], bool] = lambda pid: True) -> tuple[LinkState, ...]:
        """Each present interface's latest reading (``/metrics``)."""
        out = []
        for i in sorted(self._ifaces.values(), key=lambda i: i.id):
            r = i.reading
            if r is None or i.gone_ns:
                continue
            known = {n: r[_AT[n]] for n in LINK_COUNTERS if r[_AT[n]] != UNKNOWN_U64}
            changes = r[_AT["carrier_changes"]]
            out.append(
                LinkState(
                    name=i.name,
                    kind=i.kind.name.lower(),
                    carrier=None if r[CARRIER] == UNKNOWN_U8 else r[CARRIER],
                    carrier_changes=None if changes == UNKNOWN_U32 else changes,
                    processes=sum(1 for p in i.pids if keep(p)),
                    errors={n: v for n, v in known.items() if n in ERROR_COUNTERS},
                    congestion={n: v for n, v in known.items() if n in CONGESTION_COUNTERS},
                )
            )
        return tuple(out)

    # ---- sampling -----------------------------------------------------------

    def tick(self, pids: Callable[[], Iterable[int]] = tuple, force: bool = False) -> int:
        """Read what changed (rtnetlink's news), everything once ``period_s``
        passed (or ``force``), write the rows due; map processes to
        interfaces when it is time.  Returns the rows written."""
        heard = self._hear()
        now = self.clock()
        due = force or heard or now - self._last_sample >= self.config.period_s * 1e9
        if due:
            self._read_all()
            self._last_sample = self.clock()
        written = self._flush()
        mapping = self._due_for_mapping(list(pids()), self.clock())
        if mapping:
            self.map_users(mapping)
        return written

    def _hear(self) -> bool:
        """Handle what the multicast socket brought; True if a full reading is due."""
        if self.rtnl is None:
            return False
        try:
            heard = self.rtnl.heard()
        except NetlinkError as exc:
            self._failed("rtnetlink", exc)
            return True
        now = self.clock()
        for sample in heard.links:
            self._netdev(sample, now)
        for ifindex in heard.removed:
            for iface in self._by_kind(LinkKind.NETDEV):
                if iface.ifindex == ifindex:
                    self._gone(iface, now)
        self._addresses_stale |= heard.addresses_changed
        return heard.overrun

    def _read_all(self) -> None:
        if self.rtnl is not None:
            try:
                samples = self.rtnl.links()
                addresses = self.rtnl.addresses() if self._addresses_stale else None
            except NetlinkError as exc:
                self._failed("rtnetlink", exc)
            else:
                now = self.clock()
                seen = {self._netdev(s, now) for s in samples}
                for iface in self._by_kind(LinkKind.NETDEV):
                    if iface.id not in seen:
                        self._gone(iface, now)
                if addresses is not None:
                    self._set_addresses(addresses)
        self._read_rdma()

    def _failed(self, what: str, exc: Exception) -> None:
        self.errors += 1
        if self.errors in (1, 10, 100, 1000):
            log.warning("links: %s failed (%s failures so far): %s", what, self.errors, exc)

    def _by_kind(self, kind: LinkKind) -> list[_Iface]:
        return [self._ifaces[i] for i in self._live.values() if self._ifaces[i].kind is kind]

    def _iface(self, key: tuple[object, ...], kind: LinkKind, name: str, now: int) -> _Iface:
        known = self._live.get(key)
        if known is not None:
            return self._ifaces[known]
        iface = _Iface(self._next_id, kind, name, now)
        self._next_id += 1
        self._ifaces[iface.id] = iface
        self._live[key] = iface.id
        return iface

    def _netdev(self, s: NetdevSample, now: int) -> int:
        iface = self._iface(("netdev", s.ifindex, s.name), LinkKind.NETDEV, s.name, now)
        iface.ifindex, iface.mtu = s.ifindex, s.mtu
        iface.link_type, iface.device = s.link_type, s.parent
        reading = netdev_reading(s)
        if iface.reading is None or (reading[CARRIER] == 1 and iface.reading[CARRIER] != 1):
            assert self.rtnl is not None
            iface.speed_mbps = self.rtnl.link_speed_mbps(s.name)  # settled when the link comes up
        self._consider(iface, reading, now, iface.read_ns)
        return iface.id

    def _read_rdma(self) -> None:
        ports = self.rdma.ports()
        present = set()
        for port in ports:
            present.add(self._rdma(port))
        for iface in self._by_kind(LinkKind.RDMA):
            if iface.id not in present:
                self._gone(iface, self.clock())

    def _rdma(self, port: PortId) -> int:
        now = self.clock()
        iface = self._iface(("rdma", port.device, port.port), LinkKind.RDMA, port.name, now)
        state = self.rdma.state(port)
        old = iface.reading
        counters_due = (
            old is None
            or (state.port_state, state.phys_state) != _port_states(old)
            or now - iface.counters_ns >= self.config.rdma_counters_s * 1e9
            or now - iface.row_ns >= self.config.heartbeat_s * 1e9
        )
        if old is None or (state.phys_state == PHYS_LINK_UP and old[CARRIER] != 1):
            info = self.rdma.info(port)
            iface.device, iface.port = port.device, port.port
            iface.link_layer, iface.speed_mbps, iface.netdev = (
                info.link_layer,
                info.speed_mbps,
                info.netdev,
            )
        if counters_due:
            counters: Iterable[int | None] = self.rdma.counters(port)
            now = self.clock()
            after = iface.counters_ns  # errors lie after the previous reading of the counters
            iface.counters_ns = now
        else:
            assert old is not None
            counters = old[FIRST_COUNTER + len(NETDEV_COUNTERS) :]
            after = iface.read_ns
        reading = rdma_reading(state.port_state, state.phys_state, counters)
        self._consider(iface, reading, now, after)
        return iface.id

    def _consider(self, iface: _Iface, reading: Reading, now: int, counters_after: int) -> None:
        """Write a row if one is due for this reading."""
        event = decide(
            iface.reading,
            reading,
            iface.kind,
            now - iface.row_ns,
            int(self.config.heartbeat_s * 1e9),
        )
        after = counters_after if event is LinkEvent.ERRORS else iface.read_ns
        iface.reading, iface.read_ns = reading, now
        if event is not None:
            self._pending.append(_row(now, after, iface, event, reading))
            iface.row_ns = now
            if event not in (LinkEvent.HEARTBEAT, LinkEvent.SEEN):
                self._map_soon = True

    def _gone(self, iface: _Iface, now: int) -> None:
        self._live = {k: v for k, v in self._live.items() if v != iface.id}
        iface.gone_ns = now
        self._pending.append(_row(now, iface.read_ns, iface, LinkEvent.GONE, UNKNOWN))
        iface.row_ns = now

    def _flush(self) -> int:
        """Write the rows due into the ring, in one batch."""
        if not self._pending:
            return 0
        rows = np.array(self._pending, dtype=LINK_EVENT)
        first = self.writer.head + 1
        self.writer.append(rows)
        for n, link in enumerate(rows["link"].tolist()):
            self._ifaces[link].last_pos = first + n
        self._pending.clear()
        self._forget_overwritten()
        return len(rows)

    def _forget_overwritten(self) -> None:
        """Gone interfaces no row names any more leave the table."""
        oldest = self.writer.head - self.writer.buffer.capacity
        for iface in list(self._ifaces.values()):
            if iface.gone_ns and iface.last_pos <= oldest:
                del self._ifaces[iface.id]

    # ---- processes ----------------------------------------------------------

    def _due_for_mapping(self, alive: list[int], now: int) -> list[int]:
        """The processes to map now: all of them soon after a link changed
        (who is behind it), else each on its own schedule: every
        ``map_period_s``, sooner (2, 4, 8 ... s) while it uses nothing yet (a
        rank connects some seconds after it starts)."""
        living = set(alive)
        self._next_map = {p: t for p, t in self._next_map.items() if p in living}
        self._wait = {p: w for p, w in self._wait.items() if p in living}
        if self._map_soon and alive and now - self._last_map >= MAP_SOON_NS:
            return alive
        return [p for p in alive if now >= self._next_map.get(p, 0)]

    def refresh_users(self, pids: Iterable[int], within_s: float = 1.0) -> None:
        """``map_users`` unless it ran less than ``within_s`` ago (a recording
        maps what its processes use now; queries may ask many a second)."""
        if self.clock() - self._last_map >= within_s * 1e9:
            self.map_users(pids)

    def map_users(self, pids: Iterable[int]) -> None:
        """Which of ``pids`` use which interface now (added to what was seen)."""
        pids = list(pids)
        if not pids:
            return
        now = self._last_map = self.clock()
        self._map_soon = False
        if self._addresses_stale and self.rtnl is not None:
            try:
                self._set_addresses(self.rtnl.addresses())
            except NetlinkError as exc:
                self._failed("rtnetlink", exc)
        by_address: dict[str, list[_Iface]] = {}
        by_device: dict[str, list[_Iface]] = {}
        for iface in self._ifaces.values():
            if iface.gone_ns:
                continue
            for a in iface.addresses:
                by_address.setdefault(a.split("/", 1)[0], []).append(iface)
            if iface.kind is LinkKind.RDMA and iface.device:
                by_device.setdefault(iface.device, []).append(iface)
        cfg = self.config
        tcp = _Once(self._tcp_sockets)
        for pid in pids:
            used = linkusers.usage(pid, tcp, cfg.proc_root, cfg.verbs_root)
            found = [i for a in used.addresses for i in by_address.get(a, ())] if used else []
            found += [i for d in used.rdma_devices for i in by_device.get(d, ())] if used else []
            for iface in found:
                iface.pids.add(pid)
            wait = self._wait.get(pid, MAP_FIRST_NS)
            if found:
                wait = int(cfg.map_period_s * 1e9)
            self._next_map[pid] = now + wait
            self._wait[pid] = min(2 * wait, int(cfg.map_period_s * 1e9))

    def _tcp_sockets(self) -> dict[int, str]:
        if self.rtnl is None:
            return {}
        try:
            return self.rtnl.tcp_local_addresses()
        except NetlinkError as exc:
            self._failed("sock_diag", exc)
            return {}

    def _set_addresses(self, addresses: dict[int, tuple[str, ...]]) -> None:
        for iface in self._by_kind(LinkKind.NETDEV):
            if iface.ifindex is not None:
                iface.addresses = addresses.get(iface.ifindex, ())
        self._addresses_stale = False

    def forget_pids(self, pids: Iterable[int]) -> None:
        gone = set(pids)
        for iface in self._ifaces.values():
            iface.pids -= gone
        for pid in gone:
            self._wait.pop(pid, None)

    def close(self) -> None:
        if self.rtnl is not None:
            self.rtnl.close()
        self.rdma.close()


class _Once:
    """A value computed at the first call, for one round of mapping."""

    def __init__(self, make: Callable[[], dict[int, str]]) -> None:
        self._make = make
        self._value: dict[int, str] | None = None

    def __call__(self) -> dict[int, str]:
        if self._value is None:
            self._value = self._make()
        return self._value


def _port_states(reading: Reading) -> tuple[int | None, int | None]:
    port, phys = reading[_AT["port_state"]], reading[_AT["phys_state"]]
    return (None if port == UNKNOWN_U8 else port, None if phys == UNKNOWN_U8 else phys)

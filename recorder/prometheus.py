"""The agent's own metrics, for ``GET /metrics``.

The agent owns its metrics (names, help, kinds) and ``prometheus_client``
renders the exposition format: ``agent_metrics_text`` is what the HTTP
surface of the query layer serves through ``Agent.metrics_text``.  Counter
families are named without ``_total``; the client adds it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .slowdown import StreamGauges
from .verdicts import Published, incident_families

if TYPE_CHECKING:  # loaded at the first scrape, not when the agent starts
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

SKIPPED_PREFIX = "kernel_skipped_"  # per tracepoint: one family, labelled
GAUGES = frozenset(
    {
        "dumps_pending",
        "http_connections_open",
        "query_engine_running",
        "query_engine_peak_resident_bytes",
    }
)
HELP = {
    "kernel_inflight_full": "NCCL calls not recorded: the in-flight map was full.",
    "kernel_comms_full": "Communicators not tracked: the communicator map was full.",
    "kernel_sock_owner_full": "Sockets left unattributed: the socket-owner map was full.",
    "kernel_runq_maps_full": "Run-queue samples lost: the run-queue maps were full.",
    "kernel_cuda_queue_full": "NCCL calls without device times: their stream queue overflowed.",
    "kernel_graph_full": "NCCL calls captured into a CUDA graph beyond what a replay rewrites.",
    "kernel_tcp_filtered": "TCP events of sockets that are not the job's: counted, not recorded "
    "(a neighbour's connections never evict the job's).",
    "kernel_conn_state_full": "Retransmits recorded without the connection's state: the "
    "connection-state map was full.",
    "cuda_event_records": "cudaEventRecord calls seen.",
    "cuda_stream_waits": "cudaStreamWaitEvent calls seen.",
    "cuda_answers_done": "CUDA queries and synchronisations that answered cudaSuccess.",
    "cuda_answers_not_ready": "CUDA queries that answered cudaErrorNotReady.",
    "cuda_answers_error": "CUDA queries and synchronisations that answered another error.",
    "attach_failures": "Libraries or probes that could not be attached.",
    "symbols_skipped": "NCCL symbols an attached library lacks.",
    "dumps_pending": "Dumps waiting to be written (retried).",
    "dump_requests_rate_limited": "Clients' dump requests refused: too many lately.",
    "pins_restored": "Times the pinned recording's folder was found removed or changed, "
    "and pinned again.",
    "pins_restore_failures": "Times it could not be pinned again (the log says why).",
    "http_connections_refused": "Client connections closed at accept: no room, and no "
    "idle connection to displace.",
    "http_connections_timed_out": "Client connections closed because a request, TLS "
    "handshake or first request they owed did not arrive in time.",
    "http_connections_evicted": "Idle connections closed to make room for a new one "
    "(unauthenticated ones first).",
    "http_requests_unauthenticated": "Requests refused for a missing or wrong credential.",
    "http_requests_busy": "Requests answered busy at once: their kind of work was at its limit.",
    "http_connections_open": "Client connections open on the agent's HTTP surface.",
    "query_engine_starts": "Processes of the SQL engine started (at a query, after one ended).",
    "query_engine_stopped": "Engine processes stopped: a query outlived its time limit.",
    "query_engine_failed": "Engine processes that ended in a query (out of their memory, a crash).",
    "query_engine_busy": "Queries answered busy at once: the engine was running another.",
    "query_engine_running": "1 while the SQL engine's process runs (it ends when idle).",
    "query_engine_peak_resident_bytes": "The largest resident set an engine process reported.",
    "link_read_failures": "Readings of the node's links that failed (rtnetlink).",
    "netsample_read_failures": "Readings of the job's interfaces that failed (rtnetlink).",
    "netsample_cpu_us": "CPU time the samples of the job's connections and interfaces took "
    "(microseconds).",
    "probe_rounds": "Rounds of probes of the job's paths this agent sent (one per incident).",
    "probe_answers": "Peers' path probes this agent answered.",
    "probe_refused": "Peers' path probes or exchanges refused: over the answer rate or the "
    "exchanges at once.",
    "probe_foreign": "Datagrams or exchanges on the probe port that were not a peer agent's "
    "(another key, or not a probe).",
    "slowdowns_detected": "Slowdowns the watchdog raised as incidents (a communicator's "
    "rhythm degraded, a rank persistently last, a collective held by the network).",
    "verdicts_published": "Verdicts of this agent's incidents published (revisions too).",
    "verdict_failures": "Gatherings of an incident's verdict that gave none (the log says why).",
    "notify_sent": "Verdict notices the --notify webhook took.",
    "notify_failures": "Posts to the --notify webhook that failed (each retried while it may be).",
    "notify_dropped": "Verdict notices given up: refused, too old, or displaced.",
}


@dataclass(frozen=True, slots=True)
class RingStats:
    kind: str  # ring name: nccl, comm, tcp, sched, exit
    recorded: int  # events written since the recording began
    lost: int  # events the kernel could not record
    overwritten: int  # rows dropped to make room
    held: int  # rows in the ring now
    capacity: int


@dataclass(frozen=True, slots=True)
class LinkState:
    """An interface's latest reading (recorder.links), for ``/metrics``."""

    name: str  # eth0, mlx5_0:1
    kind: str  # netdev, rdma
    carrier: int | None  # 1 up, 0 down, None unknown
    carrier_changes: int | None  # netdev: IFLA_CARRIER_CHANGES
    processes: int  # watched processes that use it
    errors: dict[str, int]  # its error, drop and discard counters (those it has)
    congestion: dict[str, int]  # its congestion counters (those it has)


@dataclass(frozen=True, slots=True)
class AgentStats:
    """What a live agent reports on ``/metrics``, besides its plain counters."""

    rings: tuple[RingStats, ...]
    dumps_written: int
    dump_failures: int
    stalls_detected: int
    libraries_attached: int
    processes_watched: int
    links: tuple[LinkState, ...] = ()
    streams: tuple[StreamGauges, ...] = ()  # the slowdown trigger's view (recorder.slowdown)
    incidents: tuple[Published, ...] = ()  # the latest verdicts published (recorder.verdicts)


# counters that AgentStats already reports under a name of its own
COVERED = frozenset({"dumps_written", "dump_write_failures", "stalls_detected"})


def _per_ring(
    stats: AgentStats, family: CounterMetricFamily | GaugeMetricFamily, value: Callable[..., float]
) -> Metric:
    for r in stats.rings:
        family.add_metric([r.kind], float(value(r)))
    return family


def stats_families(stats: AgentStats) -> Iterator[Metric]:
    """The families of :class:`AgentStats`."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    yield _per_ring(
        stats,
        CounterMetricFamily(
            "stallwatch_events_recorded", "Events recorded, per kind.", labels=["kind"]
        ),
        lambda r: r.recorded,
    )
    yield _per_ring(
        stats,
        CounterMetricFamily(
            "stallwatch_events_lost",
            "Events the kernel could not record (ring full), per kind.",
            labels=["kind"],
        ),
        lambda r: r.lost,
    )
    yield _per_ring(
        stats,
        CounterMetricFamily(
            "stallwatch_events_overwritten",
            "Rows a ring dropped to make room, per kind.",
            labels=["kind"],
        ),
        lambda r: r.overwritten,
    )
    yield _per_ring(
        stats,
        GaugeMetricFamily(
            "stallwatch_ring_fill_ratio", "Share of each ring holding rows.", labels=["kind"]
        ),
        lambda r: r.held / r.capacity if r.capacity else 0.0,
    )
    yield CounterMetricFamily(
        "stallwatch_dumps_written", "Dumps written.", value=stats.dumps_written
    )
    yield CounterMetricFamily(
        "stallwatch_dump_failures", "Dumps that could not be written.", value=stats.dump_failures
    )
    yield CounterMetricFamily(
        "stallwatch_stalls_detected", "Stalls the watchdog detected.", value=stats.stalls_detected
    )
    yield GaugeMetricFamily(
        "stallwatch_libraries_attached",
        "NCCL libraries with probes attached.",
        value=stats.libraries_attached,
    )
    yield GaugeMetricFamily(
        "stallwatch_processes_watched",
        "Processes in the agent's scope.",
        value=stats.processes_watched,
    )


def link_families(links: Iterable[LinkState]) -> Iterator[Metric]:
    """Per interface: carrier, carrier changes, failure and congestion
    counters, processes behind it (an alert on a downed link needs no dump:
    ``stallwatch_link_carrier == 0 and stallwatch_link_processes > 0``)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    links = list(links)
    labels = ["interface", "kind"]
    carrier = GaugeMetricFamily(
        "stallwatch_link_carrier",
        "Whether the interface has a carrier (RDMA: its physical state is LinkUp).",
        labels=labels,
    )
    changes = CounterMetricFamily(
        "stallwatch_link_carrier_changes",
        "Carrier changes of a network interface since it was made.",
        labels=labels,
    )
    users = GaugeMetricFamily(
        "stallwatch_link_processes",
        "Watched processes that use the interface (connections, RDMA devices).",
        labels=labels,
    )
    errors = CounterMetricFamily(
        "stallwatch_link_errors",
        "The interface's error, drop and discard counters, by the kernel's name.",
        labels=[*labels, "counter"],
    )
    congestion = CounterMetricFamily(
        "stallwatch_link_congestion",
        "The interface's congestion counters (ECN marks, CNPs, transmit waits).",
        labels=[*labels, "counter"],
    )
    for link in links:
        at = [link.name, link.kind]
        if link.carrier is not None:
            carrier.add_metric(at, float(link.carrier))
        if link.carrier_changes is not None:
            changes.add_metric(at, float(link.carrier_changes))
        users.add_metric(at, float(link.processes))
        for name, value in sorted(link.errors.items()):
            errors.add_metric([*at, name], float(value))
        for name, value in sorted(link.congestion.items()):
            congestion.add_metric([*at, name], float(value))
    yield from (carrier, changes, users, errors, congestion)


# name, help, what of a stream, scale (ns -> s)
_STREAM_GAUGES: tuple[tuple[str, str, Callable[[StreamGauges], float | int | None], float], ...] = (
    (
        "slowdown_factor",
        "How many times slower than its baseline a communicator calls now (per signature, "
        "the median of its latest intervals over its baseline; the median over signatures).",
        lambda g: g.factor,
        1.0,
    ),
    (
        "collective_interval_seconds",
        "The time between a communicator's calls of one kind now (median).",
        lambda g: g.interval_ns,
        1e-9,
    ),
    (
        "collective_interval_baseline_seconds",
        "The time between its calls in its baseline (median over the last minutes).",
        lambda g: g.baseline_interval_ns,
        1e-9,
    ),
    (
        "collective_duration_seconds",
        "Its latest calls' duration (median; on the device where the CUDA probes see it).",
        lambda g: g.duration_ns,
        1e-9,
    ),
    (
        "collective_duration_baseline_seconds",
        "Its calls' duration in its baseline (median).",
        lambda g: g.baseline_duration_ns,
        1e-9,
    ),
    (
        "last_arrival_share",
        "Of this node's ranks on the communicator, how often this one entered its latest "
        "collectives last (only ranks of one node are compared; of the kind of collective, "
        "op and size, it is most often last at).",
        lambda g: g.last_share,
        1.0,
    ),
    (
        "arrival_lateness_seconds",
        "How long after the first of this node's ranks it entered its latest collectives of "
        "that kind (median).",
        lambda g: g.lateness_ns,
        1e-9,
    ),
    (
        "arrival_lateness_baseline_seconds",
        "The same lateness in its baseline.",
        lambda g: g.baseline_lateness_ns,
        1e-9,
    ),
)


def stream_families(streams: Iterable[StreamGauges]) -> Iterator[Metric]:
    """Per communicator and rank of this node, what the slowdown trigger
    watches (a value not known yet is left out, never 0): an alert can page
    before any dump, ``stallwatch_slowdown_factor >= 3`` for a while."""
    from prometheus_client.core import GaugeMetricFamily

    streams = list(streams)
    labels = ["comm", "rank", "nranks", "pid"]
    for name, text, value, scale in _STREAM_GAUGES:
        family = GaugeMetricFamily(f"stallwatch_{name}", text, labels=labels)
        for g in streams:
            v = value(g)
            if v is not None:
                at = [f"{g.comm_hash:#018x}", str(g.rank), str(g.nranks), str(g.pid)]
                family.add_metric(at, float(v) * scale)
        yield family


def counter_families(counters: Mapping[str, int]) -> Iterator[Metric]:
    """Plain counters of the kernel side, the agent and the watchdog, one
    family each (a few are gauges)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    skipped = CounterMetricFamily(
        "stallwatch_kernel_tracepoint_skipped",
        "Events of a kernel hook the kernel did not run our program for (evidence not seen, "
        "e.g. a retransmit): a tracepoint's came while another tracing program ran on the "
        "CPU, a raw tracepoint's while the program itself did. Absent: not counted (< 6.7).",
        labels=["tracepoint"],
    )
    for name, value in sorted(counters.items()):
        if name.startswith(SKIPPED_PREFIX):
            skipped.add_metric([name[len(SKIPPED_PREFIX) :]], float(value))
    if skipped.samples:
        yield skipped
    for name, value in sorted(counters.items()):
        if name in COVERED or name.startswith(SKIPPED_PREFIX):
            continue
        help_text = HELP.get(name, name.replace("_", " ").capitalize() + ".")
        if name in GAUGES:
            yield GaugeMetricFamily(f"stallwatch_{name}", help_text, value=float(value))
        else:
            yield CounterMetricFamily(f"stallwatch_{name}", help_text, value=float(value))


class _Families:
    """A collector of fixed families, for one rendering."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self._families


def render(families: Iterable[Metric]) -> str:
    """Prometheus text exposition format."""
    from prometheus_client.exposition import generate_latest
    from prometheus_client.registry import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry).decode()


def agent_metrics_text(stats: AgentStats, counters: Mapping[str, int]) -> str:
    return render(
        [
            *stats_families(stats),
            *link_families(stats.links),
            *stream_families(stats.streams),
            *incident_families(stats.incidents),
            *counter_families(counters),
        ]
    )

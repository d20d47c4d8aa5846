"""The agent's metrics families, rendered by prometheus_client, parse back."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from stallwatch.recorder.prometheus import AgentStats, LinkState, RingStats, agent_metrics_text


def test_agent_metrics_render_and_parse() -> None:
    stats = AgentStats(
        rings=(
            RingStats("nccl", recorded=5000, lost=7, overwritten=904, held=4096, capacity=4096),
            RingStats("tcp", recorded=12, lost=0, overwritten=0, held=12, capacity=1024),
        ),
        dumps_written=2,
        dump_failures=1,
        stalls_detected=3,
        libraries_attached=1,
        processes_watched=4,
    )
    text = agent_metrics_text(stats, {})
    families = {f.name: f for f in text_string_to_metric_families(text)}

    def values(name: str) -> dict[str, float]:
        samples = families[name].samples
        return {
            s.labels.get("kind", ""): s.value for s in samples if not s.name.endswith("_created")
        }

    assert families["stallwatch_events_recorded"].type == "counter"
    assert values("stallwatch_events_recorded") == {"nccl": 5000, "tcp": 12}
    assert values("stallwatch_events_lost") == {"nccl": 7, "tcp": 0}
    assert values("stallwatch_ring_fill_ratio") == {"nccl": 1.0, "tcp": 12 / 1024}
    assert values("stallwatch_dumps_written") == {"": 2}
    assert values("stallwatch_stalls_detected") == {"": 3}
    assert families["stallwatch_libraries_attached"].type == "gauge"


def test_plain_counters_are_counters_and_pending_dumps_a_gauge() -> None:
    stats = AgentStats((), 0, 0, 0, 0, 0)
    text = agent_metrics_text(
        stats, {"attach_failures": 2, "dumps_pending": 1, "stalls_detected": 9}
    )
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["stallwatch_attach_failures"].type == "counter"
    assert families["stallwatch_attach_failures"].samples[0].value == 2
    assert families["stallwatch_dumps_pending"].type == "gauge"
    # reported once, by AgentStats, not again as a plain counter
    assert [s.value for s in families["stallwatch_stalls_detected"].samples] == [0.0]


def test_tracepoint_runs_the_kernel_skipped_are_one_family_by_tracepoint() -> None:
    stats = AgentStats((), 0, 0, 0, 0, 0)
    counters = {"kernel_skipped_tcp_retransmit_skb": 107, "kernel_skipped_sched_wakeup": 445}
    families = {f.name: f for f in text_string_to_metric_families(
        agent_metrics_text(stats, {**counters, "attach_failures": 0}))}  # fmt: skip
    skipped = families["stallwatch_kernel_tracepoint_skipped"]
    assert skipped.type == "counter"
    got = {s.labels["tracepoint"]: s.value for s in skipped.samples if s.name.endswith("_total")}
    assert got == {"tcp_retransmit_skb": 107.0, "sched_wakeup": 445.0}
    assert not any(name.startswith("stallwatch_kernel_skipped") for name in families)


def test_the_http_surfaces_refusals_are_a_counter_and_open_connections_a_gauge() -> None:
    stats = AgentStats((), 0, 0, 0, 0, 0)
    served = {"http_connections_refused": 5, "http_connections_open": 1000}
    text = agent_metrics_text(stats, {**served, "http_connections_timed_out": 3})
    families = {f.name: f for f in text_string_to_metric_families(text)}
    refused = families["stallwatch_http_connections_refused"]
    assert refused.type == "counter" and refused.samples[0].value == 5
    assert refused.samples[0].name == "stallwatch_http_connections_refused_total"
    assert families["stallwatch_http_connections_open"].type == "gauge"
    assert families["stallwatch_http_connections_timed_out"].samples[0].value == 3


def test_links_carrier_errors_and_users_per_interface() -> None:
    links = (
        LinkState("eth0", "netdev", 0, 5, 4, {"rx_errors": 2, "tx_dropped": 9}, {}),
        LinkState("mlx5_0:1", "rdma", 1, None, 1, {"link_downed": 1}, {"np_cnp_sent": 12884}),
        LinkState("lo", "netdev", None, 0, 0, {}, {}),
    )
    text = agent_metrics_text(AgentStats((), 0, 0, 0, 0, 0, links=links), {})
    families = {f.name: f for f in text_string_to_metric_families(text)}

    def values(name: str) -> dict[tuple[str, ...], float]:
        samples = families[name].samples
        keys = ("interface", "kind", "counter")
        return {
            tuple(s.labels[k] for k in keys if k in s.labels): s.value
            for s in samples
            if not s.name.endswith("_created")
        }

    # the alert on a downed link needs no dump: carrier 0 where processes are behind it
    assert families["stallwatch_link_carrier"].type == "gauge"
    assert values("stallwatch_link_carrier") == {("eth0", "netdev"): 0, ("mlx5_0:1", "rdma"): 1}
    assert values("stallwatch_link_processes")[("eth0", "netdev")] == 4
    assert values("stallwatch_link_carrier_changes") == {("eth0", "netdev"): 5, ("lo", "netdev"): 0}
    assert families["stallwatch_link_errors"].type == "counter"
    assert values("stallwatch_link_errors") == {
        ("eth0", "netdev", "rx_errors"): 2,
        ("eth0", "netdev", "tx_dropped"): 9,
        ("mlx5_0:1", "rdma", "link_downed"): 1,
    }
    assert values("stallwatch_link_congestion") == {("mlx5_0:1", "rdma", "np_cnp_sent"): 12884}

"""The network evidence's benchmark at a small size: the sampler's cost per
connection beside the namespace dump, and a round of probes to 8 peers on
the lab's switch, healthy and behind an MTU blackhole (the 4x2 lab job's
figure runs in ``make bench`` only: it starts four agents)."""

from __future__ import annotations

import pytest

from bench import bench_netsamples

pytestmark = [pytest.mark.lab, pytest.mark.slow]


def test_sampling_costs_each_connection_a_lookup() -> None:
    s = bench_netsamples.sampling(quick=True)
    assert s["sampled"] == bench_netsamples.CONNECTIONS // 10 * 2  # both ends of each pair
    assert s["sample_us"] > 0 and s["dump_us"] > 0 and s["iface_us"] > 0


def test_a_round_of_probes_keeps_to_its_window_and_bytes() -> None:
    healthy, blackhole = bench_netsamples.probes(quick=True)
    assert healthy["peers"] == blackhole["peers"] == 8
    assert healthy["lost_rows"] == 0 and blackhole["lost_rows"] > 0
    for p in (healthy, blackhole):
        assert 2.0 <= p["wall_s"] < 3.0, p
        assert 0 < p["max_peer_bytes"] <= bench_netsamples.MAX_PEER_BYTES, p
    assert blackhole["rows"] > healthy["rows"]  # the rounds that find the limit

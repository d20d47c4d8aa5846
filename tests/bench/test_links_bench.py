"""The link sampler's benchmark runs at a small size, in a namespace of its
own, and reports each figure with its side-by-side anchor."""

from __future__ import annotations

import pytest

from bench import bench_links
from bench.common import render

pytestmark = [pytest.mark.bpf, pytest.mark.slow]


def test_bench_links_quick_figures() -> None:
    figures = bench_links.figures(quick=True)
    table = render(figures)
    by_name = {f.name.split(",")[0]: f for f in figures}
    assert set(by_name) == {
        "link reading",
        "RDMA reading",
        "link tick with nothing to read",
        "mapping a process with 200 TCP sockets to its links",
        "a process's TCP sockets for the filter",
        "link sampler",
    }, table
    assert all(f.value > 0 for f in figures), table
    assert "11 netdevs" in figures[0].name and "sysfs files" in figures[0].anchor, table
    assert "4 ports" in figures[1].name and "117 fds held" in figures[1].anchor, table
    assert (
        "mapped to 1 interface"
        in by_name["mapping a process with 200 TCP sockets to its links"].anchor
    ), table  # its connections leave by the veth that holds their address
    assert by_name["link sampler"].ok is not None, table
    # the filter's sock_diag reading finds what /proc/<pid>/net/tcp does, beside TIME_WAITs
    sockets = by_name["a process's TCP sockets for the filter"]
    assert "1,000 in TIME_WAIT" in sockets.name and "the same sockets: yes" in sockets.anchor, table

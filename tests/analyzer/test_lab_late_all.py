"""Every agent late, on the lab: each node's agent (or the one host-scope
agent of the whole machine) starts only once the job is 20 steps in (every
communicator was made before any attach: no recording holds a communicator
id), then one rank hangs.  Real eBPF, real network namespaces, waiting
threads blocking in poll or spinning.  The streams are judged among
themselves by their frontiers (``analyzer.unanchored``): the hung rank alone
is named.  (``bench/late_seeds.py`` runs the same over 10 seeds, both wait
modes and both agent scopes.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.analyzer.late_lab import names_the_hung_rank_alone, run_all_late

pytestmark = [pytest.mark.bpf, pytest.mark.lab, pytest.mark.slow]


@pytest.mark.parametrize(
    ("nodes", "ranks_per_node", "hung", "wait", "scope"),
    [(2, 2, 1, "block", "netns"), (4, 2, 5, "spin", "netns"), (2, 2, 2, "spin", "host")],
)
def test_every_agent_late_names_the_hung_rank(
    tmp_path: Path, nodes: int, ranks_per_node: int, hung: int, wait: str, scope: str
) -> None:
    r = run_all_late(tmp_path, nodes, ranks_per_node, hung, wait, scope)
    # one dump per agent: every node's, or the host agent's one holding every rank
    assert len(r.dumps) == (1 if scope == "host" else nodes), r.stderr[-3000:]
    assert r.code == 1
    assert names_the_hung_rank_alone(r), r.verdicts
    assert "by the frontiers of streams" in str(r.verdicts[0]["summary"])

"""A lab run whose node is cut off mid-run, for tests of network evidence.

Every packet to and from one node is dropped on its switch port (an
nftables ``netdev`` table in the switch's namespace, both directions, as
the lab's loss fault is made), once every rank has done ``at_step`` steps:
for ``hold_s`` seconds and then restored (a flap: the job goes on, with the
retransmits and backoff of the cut inside its collectives), or for good (a
partition: the job stalls and the agents dump).  The lab runs as
``stallwatch lab run`` runs it (``lab.runner.run``); the cut is made beside
it, from the run's id alone.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from stallwatch.lab import job, netns, runner

POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class Cut:
    node: int
    at_step: int
    hold_s: float | None  # None: never restored


def _ruleset(port: str) -> str:
    hook = f'device "{port}" priority 0; counter drop; }}'
    return (
        f"table netdev cut_{port} {{\n"
        f"  chain from_node {{ type filter hook ingress {hook}\n"
        f"  chain to_node {{ type filter hook egress {hook}\n"
        "}\n"
    )


def _steps_done(run_id: str, ranks: int) -> int:
    reports = [job.read_report(netns.RUNS_DIR / run_id, r) for r in range(ranks)]
    return min((rep.steps_done if rep is not None else -1) for rep in reports)


def _cutter(run_id: str, ranks: int, cut: Cut, stop: threading.Event, done: list[str]) -> None:
    switch, _ = netns.names(run_id, cut.node + 1)
    port = f"n{cut.node}"
    while not stop.is_set() and _steps_done(run_id, ranks) < cut.at_step:
        time.sleep(POLL_S)
    if stop.is_set():
        return
    netns.sh(["ip", "netns", "exec", switch, "nft", "-f", "-"], stdin=_ruleset(port))
    done.append("cut")
    if cut.hold_s is None or stop.wait(cut.hold_s):
        return
    netns.sh(["ip", "netns", "exec", switch, "nft", "delete", "table", "netdev", f"cut_{port}"])
    done.append("restored")


def run_with_cut(cfg: runner.RunConfig, cut: Cut) -> tuple[runner.RunResult, list[str]]:
    """The lab run of ``cfg`` (its run id chosen here) with ``cut`` made
    beside it; returns the run's result and what the cut did ("cut",
    "restored")."""
    run_id = "c" + secrets.token_hex(3)
    cfg = runner.RunConfig(**{**_fields(cfg), "run_id": run_id})
    stop, done = threading.Event(), []
    ranks = cfg.nodes * cfg.ranks_per_node
    thread = threading.Thread(target=_cutter, args=(run_id, ranks, cut, stop, done), daemon=True)
    thread.start()
    try:
        result = runner.run(cfg)
    finally:
        stop.set()
        thread.join(30)
    return result, done


def _fields(cfg: runner.RunConfig) -> dict[str, object]:
    return {name: getattr(cfg, name) for name in runner.RunConfig.__dataclass_fields__}


def record_cut(
    folder: Path, cut: Cut, nodes: int = 4, steps: int = 30, stall_timeout: float = 5.0
) -> runner.RunResult:
    """One agent per node records a job of ``nodes`` x 1 rank with ``cut``;
    a flap's run is dumped at its end, a partition's when it stalls."""
    cfg = runner.RunConfig(
        nodes=nodes,
        ranks_per_node=1,
        steps=steps,
        record=True,
        dump_dir=folder,
        dump_at_end=cut.hold_s is not None,
        stall_timeout=stall_timeout,
    )
    result, done = run_with_cut(cfg, cut)
    want = ["cut"] if cut.hold_s is None else ["cut", "restored"]
    assert done == want, f"the cut did {done}, not {want}: {runner.summary(result)}"
    return result

"""Running a lab job whose every agent starts late (every communicator made
before any attach), and analyzing what it dumped: shared by the lab tests and
the seeds loop (``bench/late_seeds.py``).  The agents are one per node
(``netns``) or one for the whole machine (``host``: ``lab run --agent-scope
host``, every node's ranks in its one dump)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LATE_STEP = 20  # every agent starts once a rank is this far
# the hang comes this many steps after every agent is ready (however long
# their start takes under load): the job runs on under the agents for a while
# first; a job hung before any agent is the snapshot tests' case
HANG_STEP = 50
STEPS = 3000  # never all done: the hang comes first
SCOPES = ("netns", "host")


@dataclass(frozen=True, slots=True)
class LateRun:
    hung: int
    hung_pid: int | None
    dumps: list[str]
    code: int  # analyze's exit code
    verdicts: list[dict[str, object]]
    stderr: str


def run_all_late(
    folder: Path,
    nodes: int,
    ranks_per_node: int,
    hung: int,
    wait: str,
    scope: str = "netns",
    timeout: int = 600,
) -> LateRun:
    """``lab run`` with every agent late (an agentlate fault on every node's,
    or on the host agent: node 0), rank ``hung`` hanging HANG_STEP steps after
    every agent is ready, then ``analyze --json`` over its dumps."""
    agents = 1 if scope == "host" else nodes
    late = [f"agentlate:node={n},step={LATE_STEP}" for n in range(agents)]
    cmd = [sys.executable, "-m", "stallwatch", "lab", "run", "--json", "--agent-scope", scope,
           "--nodes", str(nodes), "--ranks-per-node", str(ranks_per_node),
           "--steps", str(STEPS), "--compute-ms", "20", "--wait", wait,
           "--record", "--dump-dir", str(folder), "--stall-timeout", "3",
           *(x for f in late for x in ("--fault", f)),
           "--fault", f"hang:rank={hung},step={HANG_STEP},agents=ready"]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    result = json.loads(run.stdout or "{}")
    pid = next((r["pid"] for r in result.get("ranks", []) if r["world_rank"] == hung), None)
    proc = subprocess.run(
        [sys.executable, "-m", "stallwatch", "analyze", str(folder), "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    doc = json.loads(proc.stdout or "{}")
    verdicts = [v for i in doc.get("incidents", []) for v in i["verdicts"]]
    return LateRun(hung, pid, result.get("dumps", []), proc.returncode, verdicts, run.stderr)


def names_the_hung_rank_alone(r: LateRun) -> bool:
    """The first verdict is a missing rank naming the hung rank (and its pid)
    and nothing else; no verdict names another rank."""
    if not r.verdicts:
        return False
    top = r.verdicts[0]
    named = {x for v in r.verdicts for x in v["ranks"]}  # type: ignore[attr-defined]
    return (
        top["kind"] == "missing_rank"
        and top["ranks"] == [r.hung]
        and top["pids"] == [r.hung_pid]
        and named <= {r.hung, None}
    )

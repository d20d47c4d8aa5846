"""``stallwatch lab run``: the lab's multi-node training job, faults on demand
(``lab.runner``)."""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

from stallwatch.dumpers.errors import ExitCode, LabError
from stallwatch.lab import faults as F
from stallwatch.lab.job import DEFAULT_COMPUTE_MS, DEFAULT_ELEMENTS, MODES, WAITS

from ..options import HelpFormatter, add_format_option

if TYPE_CHECKING:
    from stallwatch.lab.runner import RunConfig

SPEC_WIDTH = 38  # where a fault's description begins, in --help


def _spec_lines(width: int = 96) -> list[str]:
    """``F.SPEC_HELP``, each description wrapped under itself."""
    lines = []
    for line in F.SPEC_HELP:
        spec, _, what = line.partition("  ")
        head = f"  {spec}".ljust(SPEC_WIDTH) if len(spec) + 4 <= SPEC_WIDTH else f"  {spec}\n"
        indent = " " * SPEC_WIDTH
        body = textwrap.fill(what.strip(), width, initial_indent=indent, subsequent_indent=indent)
        lines.append(head + body[len(indent) :] if not head.endswith("\n") else head + body)
    return lines


RUN_EPILOG = f"""\
fault specs (ranks are global: node n holds ranks n*R .. n*R+R-1):
{chr(10).join(_spec_lines())}

examples:
  stallwatch lab run --nodes 2 --ranks-per-node 2 --steps 20 --json
  stallwatch lab run --nodes 4 --fault hang:rank=5,step=10 --stall-timeout 5
  stallwatch lab run --fault loss:node=1,pct=5 --mode async
  stallwatch lab run --nodes 3 --steps 400 --fault partition:node=2,step=100,ms=4000 --json
  stallwatch lab run --nodes 3 --steps 400 --fault linkdown:node=1,step=100,ms=3000
  stallwatch lab run --nodes 3 --steps 200 --fault rst:node=1,step=50 --record --dump-dir dumps/
  stallwatch lab run --nodes 4 --steps 300 --fault rate:node=3,mbit=8,step=100 --record \\
      --dump-at-end --dump-dir dumps/
  stallwatch lab run --nodes 3 --steps 300 --fault slow:rank=4,ms=80,step=100
  stallwatch lab run --nodes 3 --steps 300 --fault pause:every=50,ms=2000,rank=0
  stallwatch lab run --nodes 3 --steps 600 --neighbour-churn 2000 --json
  stallwatch lab run --nodes 4 --mode gpu --fault gpuslow:rank=5,ms=80 --record --dump-at-end
  stallwatch lab run --nodes 4 --fault hang:rank=5,step=10 --record --dump-dir dumps/
  stallwatch lab run --nodes 2 --record --dump-at-end --dump-dir dumps/
  stallwatch lab run --nodes 2 --steps 3000 --record --agent-scope host \\
      --fault agentlate:node=0,step=20 --fault hang:rank=1,step=50,agents=ready

exit codes: 0 every rank finished and verified; 1 the job failed (faults, stuck or
crashed ranks); 2 bad input, or the lab could not be set up (root, tools)."""


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {value:g}")
    return value


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "run",
        help="run the multi-node training job, with faults on demand",
        description="Run the lab's training job: nodes are network namespaces, ranks are "
        "processes doing real collectives over TCP through the lab's libnccl.",
        epilog=RUN_EPILOG,
        formatter_class=HelpFormatter,
    )
    p.add_argument("--nodes", type=_positive_int, default=2, metavar="N", help="nodes")
    p.add_argument("--ranks-per-node", type=_positive_int, default=2, metavar="R",
                   help="ranks on each node")  # fmt: skip
    p.add_argument("--steps", type=_positive_int, default=20, metavar="S", help="training steps")
    p.add_argument("--mode", choices=MODES, default="blocking",
                   help="blocking collectives; async: returning at once like real NCCL; gpu: on "
                   "CUDA streams of the lab's libcudart, used as PyTorch does")  # fmt: skip
    p.add_argument("--wait", choices=WAITS, default="block",
                   help="how waiting host threads wait: block (asleep in poll) or spin "
                   "(runnable throughout, as CUDA's spin synchronisation and NCCL's busy "
                   "polling wait)")  # fmt: skip
    p.add_argument("--graphs", action="store_true",
                   help="gpu mode: capture each step's collectives in a CUDA graph once and "
                   "replay it every step")  # fmt: skip
    p.add_argument("--fault", action="append", default=[], metavar="SPEC",
                   help="a fault to inject (repeatable; specs below; default: none, a "
                   "healthy job)")  # fmt: skip
    p.add_argument("--neighbour-churn", type=_positive_int, default=None, metavar="N",
                   help="a TCP neighbour outside the job: N short connections a second "
                   "in total between the nodes (not the job's processes), from before "
                   "the job starts until it ended and the agents dumped; the rate "
                   "reached is reported (default: none)")  # fmt: skip
    p.add_argument("--record", action="store_true", help="one stallwatch agent per node")
    p.add_argument("--agent-scope", choices=("netns", "host"), default=None,
                   help="with --record: netns, one agent per node in its namespace; host, one "
                   "agent for the whole machine (record --scope host: every node's ranks in "
                   "one dump), named node=0 by agent faults (default: netns)")  # fmt: skip
    p.add_argument("--dump-dir", type=Path, default=Path("dumps"), metavar="DIR",
                   help="with --record: where the agents write dumps")  # fmt: skip
    p.add_argument(
        "--dump-at-end",
        action="store_true",
        help="with --record: at the end of the run (the job ended, or was given up), ask "
        "each agent for a dump, after the dumps of any incident",
    )
    p.add_argument("--client-dir", type=Path, default=None, metavar="DIR",
                   help="with --record: write what a client of the agents needs (agents.txt, "
                   "token, ca.pem, client.pem, client.key) into DIR, kept after the run "
                   "(default: a folder of the run's, gone at teardown)")  # fmt: skip
    p.add_argument(
        "--stall-timeout",
        type=_positive_float,
        default=10.0,
        metavar="SEC",
        help="the agents' stall timeout; also: give up when no rank progresses this long",
    )
    p.add_argument(
        "--agent-defaults",
        action="store_true",
        help="with --record: the agents run with record's defaults, as deployed (each "
        "communicator's own bound, 60 s the ceiling); --stall-timeout is then the lab's wait only",
    )
    p.add_argument(
        "--timeout",
        type=_positive_float,
        default=None,
        metavar="SEC",
        help="give up after SEC in all (default: none: the run lasts while the job moves, and "
        "gives up once no rank progressed for --stall-timeout; with --duration, 60 s plus "
        "1.5 times the duration)",
    )
    p.add_argument("--duration", type=_positive_float, default=None, metavar="SEC",
                   help="end the job SEC seconds after it reached the latest step a fault "
                   "names (after its first step if none does), every rank at the same step, "
                   "however many of --steps remain (default: run every step)")  # fmt: skip
    add_format_option(p)
    p.add_argument("--elements", type=_positive_int, default=DEFAULT_ELEMENTS, metavar="N",
                   help="float32 elements of the gradient AllReduce")  # fmt: skip
    p.add_argument("--compute-ms", type=_positive_float, default=DEFAULT_COMPUTE_MS, metavar="MS",
                   help="CPU time of each step's simulated compute")  # fmt: skip
    p.add_argument(
        "--snapshot-when-stuck",
        action="store_true",
        help="once no rank progresses: stallwatch snapshot in every node, dumps in --dump-dir",
    )
    p.add_argument(
        "--late-agents",
        action="store_true",
        help="with --record: start the agents only once the job is stuck, then a snapshot",
    )
    p.add_argument("--run-id", default=None, help="names the namespaces (default: random)")
    p.add_argument("--lib", type=Path, default=None,
                   help="the lab's libnccl.so.2 to use (default: built from lab/csrc)")  # fmt: skip
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from stallwatch.lab import runner  # the lab's machinery loads only when it runs

    cfg = config_from(args)
    as_json = args.format == "json"
    result = runner.run(cfg, progress_out=None if as_json else sys.stderr)
    print(result.to_json() if as_json else runner.summary(result))
    return ExitCode.OK if result.ok else ExitCode.FINDINGS


def config_from(args: argparse.Namespace) -> RunConfig:
    """The run the parsed options ask for (refusing what goes together with
    nothing)."""
    from stallwatch.lab import runner

    if args.dump_at_end and not args.record:
        raise LabError("--dump-at-end needs --record (the agents write the dumps)")
    if args.late_agents and not args.record:
        raise LabError("--late-agents needs --record")
    if args.client_dir is not None and not args.record:
        raise LabError("--client-dir needs --record (it is how to reach the agents)")
    if args.agent_scope is not None and not args.record:
        raise LabError("--agent-scope needs --record (it says where the agents run)")
    if args.graphs and args.mode != "gpu":
        raise LabError("--graphs needs --mode gpu (graphs are captured on CUDA streams)")

    return runner.RunConfig(
        nodes=args.nodes,
        ranks_per_node=args.ranks_per_node,
        steps=args.steps,
        mode=args.mode,
        graphs=args.graphs,
        faults=F.parse_faults(args.fault),
        record=args.record,
        dump_dir=args.dump_dir,
        dump_at_end=args.dump_at_end,
        stall_timeout=args.stall_timeout,
        agent_defaults=args.agent_defaults,
        timeout=args.timeout,
        duration=args.duration,
        elements=args.elements,
        compute_ms=args.compute_ms,
        run_id=args.run_id,
        lib=args.lib,
        snapshot_when_stuck=args.snapshot_when_stuck,
        late_agents=args.late_agents,
        wait=args.wait,
        agent_scope=args.agent_scope or "netns",
        neighbour_churn=args.neighbour_churn or 0,
        client_dir=args.client_dir.expanduser().resolve() if args.client_dir else None,
    )

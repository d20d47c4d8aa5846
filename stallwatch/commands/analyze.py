"""``stallwatch analyze PATH... [--format table|json]``: name the culprit rank, and why.
``stallwatch analyze --agents HOST:PORT,... [--save DIR]``: the same, live, on
the agents' current recordings (nothing written unless ``--save``).

Exit codes: 0 healthy, 1 findings (an inconclusive verdict, or an input that
could not be read, counts as one), 2 nothing could be read.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stallwatch.analyzer.report import MAX_TABLE_ROWS, MAX_TABLES
from stallwatch.dumpers.errors import UsageError
from stallwatch.dumpers.inputs import input_notes
from stallwatch.query.output import note

from .options import (
    HelpFormatter,
    add_agent_options,
    add_format_option,
    agent_call_from,
    wants_agents,
)

if TYPE_CHECKING:
    from stallwatch.analyzer.pipeline import AnalysisResult
    from stallwatch.query.live import AgentCall

EXAMPLES = """\
examples:
  stallwatch analyze dumps/                    # every dump under a folder
  stallwatch analyze dumps/*.msgpack --json    # for programs (= --format json)
  stallwatch analyze dumps/ --all              # every communicator, every rank
  stallwatch analyze fr_traces/                # PyTorch Flight Recorder dumps (_dump_<rank>)
  STALLWATCH_THREADS=1 stallwatch analyze dumps/    # on one core (default: up to 4)
  # live: the agents' current recordings
  stallwatch analyze --agents node1:9400,node2:9400 --token-file /etc/stallwatch/token \\
      --tls-ca /etc/stallwatch/ca.pem
  stallwatch analyze --agents-file nodes.txt --save incident/    # ... and keep them as dumps
  stallwatch analyze --agents-file nodes.txt --incident 20261123T170635508-node2-329539
      # one incident's dumps as the agents wrote them (what an agent publishes)

exit codes: 0 healthy, 1 findings (inconclusive, or an input lost), 2 nothing could be read
"""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "analyze",
        help="name the rank that departs from consensus, and why",
        description="Load dumps (ours, and PyTorch Flight Recorder's), match each "
        "communicator's n-th collective across its ranks, report verdicts.",
        epilog=EXAMPLES,
        formatter_class=HelpFormatter,
    )
    p.add_argument("paths", nargs="*", metavar="PATH", help="dump files or folders")
    add_agent_options(p)  # live, instead of PATH
    p.add_argument(
        "--save",
        type=Path,
        metavar="DIR",
        help="with --agents: write the answers as one incident (DIR/<host>/)",
    )
    p.add_argument(
        "--incident",
        metavar="ID",
        help="with --agents: the agents' dumps of this incident, as written (not their "
        "current recordings)",
    )
    # an agent's verdict child (recorder.verdicts): started at once, it loads
    # the analyzer, then reads {"timeout": s, "token": str|null, "agents":
    # [HOST:PORT, ...]} on stdin (the agents: those of --agents to ask)
    p.add_argument("--request-stdin", action="store_true", help=argparse.SUPPRESS)
    add_format_option(p)
    p.add_argument(
        "--wide",
        action="store_true",
        help="communicator ids whole (default: their shortest prefix unique in the incident, "
        "as comm_id_hash LIKE '0xcd50%%' finds it in SQL; --json always has them whole)",
    )
    p.add_argument(
        "--all",
        dest="show_all",
        action="store_true",
        help=f"show every communicator and every rank (default: the {MAX_TABLES} most "
        f"telling communicators, {MAX_TABLE_ROWS} ranks each; --json always has them all)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from stallwatch.analyzer.pipeline import analyze_paths

    live = wants_agents(args)
    if live == bool(args.paths):
        raise UsageError("give dump files or folders, or --agents/--agents-file (not both)")
    if args.save is not None and not live:
        raise UsageError("--save goes with --agents: dumps given as paths are saved already")
    if args.incident is not None and not live:
        raise UsageError("--incident goes with --agents: give the incident's dumps as paths")
    if live:
        return _run_live(args)
    result = analyze_paths(args.paths, progress=sys.stderr.isatty() or len(args.paths) > 1)
    return _report(args, result)


def _run_live(args: argparse.Namespace) -> int:
    from stallwatch.analyzer.live import analyze_agents
    from stallwatch.analyzer.report import to_json  # noqa: F401 (loaded before waiting)
    from stallwatch.query.agentclient import close_connections

    call = agent_call_from(args)
    if args.request_stdin:
        call = _stdin_request(call)
    try:
        verdict = analyze_agents(call, args.save, args.incident)
    finally:
        close_connections()
    if args.save is not None:
        saved = f"saved {len(verdict.saved)} dump(s) in {args.save}"
        print(f"stallwatch analyze: {saved}", file=sys.stderr)
    return _report(args, verdict.result)


def _stdin_request(call: AgentCall) -> AgentCall:
    """The agents, timeout and token an agent's verdict child is given once
    it is ready (one JSON line on stdin); the agents, of those of --agents."""
    try:
        doc = json.loads(sys.stdin.readline() or "{}")
        timeout = float(doc.get("timeout", call.timeout))
        token = doc.get("token") or call.token
        agents = tuple(str(a) for a in doc.get("agents", call.agents))
    except (ValueError, TypeError, AttributeError) as exc:
        raise UsageError(f"--request-stdin: expected one JSON object line: {exc}") from None
    if timeout <= 0 or not (token is None or isinstance(token, str)):
        raise UsageError("--request-stdin: expected a timeout > 0 and a token string or null")
    if not agents or not set(agents) <= set(call.agents):
        raise UsageError("--request-stdin: expected agents among those of --agents")
    return dataclasses.replace(call, timeout=timeout, token=token, agents=agents)


def _report(args: argparse.Namespace, result: AnalysisResult) -> int:
    from stallwatch.analyzer.report import print_report, to_json

    # each once: the text report names the lost ones itself
    shown = [s for s in result.inputs if args.format == "json" or not s.lost]
    for line in input_notes(shown):
        note("analyze", line)
    if args.format == "json":
        print(to_json(result))
    else:
        print_report(result, args.show_all, args.wide)
    if not result.anything_read:
        return 2
    return 0 if result.healthy else 1

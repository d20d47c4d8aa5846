"""``stallwatch snapshot``: where every rank's threads are now, as a dump.

Without ``--agents`` it reads this node (every process that maps a libnccl,
or the ``--pid``s given) and writes a dump that holds the readings and no
recording: ``stallwatch analyze`` judges from the positions alone.  With
``--agents`` every agent is asked at once (``POST /snapshot``) to read its
node and dump, all under one incident id, with whatever it has recorded.

Each node is read ``--samples`` times, ``--interval`` apart (default 3 over
1 s): the analyzer judges a hang only from positions that held.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from stallwatch.dumpers.errors import AgentError, ExitCode, UsageError
from stallwatch.query.agentclient import AgentClient
from stallwatch.query.output import printable
from stallwatch.recorder import discovery
from stallwatch.recorder.positions import reading_summary, summary_lines

from .options import (
    HelpFormatter,
    add_agent_options,
    add_format_option,
    add_process_options,
    agent_call_from,
    wants_agents,
)

EPILOG = """\
examples:
  stallwatch snapshot                      # this node, into ./dumps
  stallwatch snapshot --pid 4242 --pid 4243 --dump-dir /tmp/hang
  stallwatch snapshot --agents node1:9400,node2:9400    # every node, one incident
  stallwatch analyze dumps/                # then: which rank is missing

Reading another process's threads needs the right to trace it (root, or the
same user with ptrace allowed); nothing is stopped or attached. With --agents,
each agent has its readings' time (--samples x --interval), then --timeout.

exit codes: 0 read and dumped; 1 nothing to read on this node (no NCCL process:
no dump), or some agents could not be reached or refused (each named on stderr,
the others' answers printed); 2 bad usage, or no agent answered.
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "snapshot",
        help="where every rank's threads are now (a dump analyze can judge)",
        description="Read where every thread of every NCCL process is (the NCCL call it is "
        "blocked in and its arguments, the system call it sleeps in, its stack), without "
        "stopping it, and write it as a dump.",
        epilog=EPILOG,
        formatter_class=HelpFormatter,
    )
    add_process_options(
        p,
        pid_help="read this process (repeatable; default: every process mapping libnccl)",
        scope_help="netns: only processes in this network namespace (as record --scope)",
    )
    p.add_argument(
        "--dump-dir",
        type=Path,
        default=Path("dumps"),
        help="where this node's dump goes (with --agents, each agent writes into its own)",
    )
    p.add_argument("--samples", type=int, default=3, metavar="N", help="readings of each node")
    p.add_argument(
        "--interval", type=float, default=0.5, metavar="SEC", help="seconds between readings"
    )
    p.add_argument(
        "--python-stacks",
        action="store_true",
        help="also Python stacks, if py-spy is installed (slower)",
    )
    p.add_argument(
        "--reason", default="stallwatch snapshot", metavar="TEXT", help="written in the dump"
    )
    add_agent_options(p)  # every node: the agents read their nodes and dump, as one incident
    p.add_argument("--host-name", default="", help="host name in the dump (default: hostname)")
    add_format_option(p)
    p.set_defaults(func=run)


def _check(args: argparse.Namespace) -> None:
    if args.samples < 1:
        raise UsageError(f"--samples: expected >= 1, got {args.samples}")
    if not 0 <= args.interval <= 60:
        raise UsageError(f"--interval: expected seconds from 0 to 60, got {args.interval}")
    if wants_agents(args) and (args.pid or args.scope != "host"):
        raise UsageError("--pid and --scope choose what this node reads: not with --agents")
    for pid in args.pid:
        if pid <= 0 or not os.path.exists(f"/proc/{pid}"):
            raise UsageError(f"--pid {pid}: no such process")


def run(args: argparse.Namespace) -> int:
    _check(args)
    if wants_agents(args):
        return _ask_agents(args)
    return _local(args)


# -- this node -------------------------------------------------------------


def _local(args: argparse.Namespace) -> int:
    from stallwatch.dumpers.format import write_dump
    from stallwatch.recorder.positions import read_series, readings_recording
    from stallwatch.recorder.threadreader import Reader, nccl_pids
    from stallwatch.recorder.watchdog import new_incident_id

    host = args.host_name or socket.gethostname()
    reader = Reader(python_stacks=args.python_stacks)
    pids = list(args.pid) or nccl_pids()
    netns = args.scope == "netns"
    if netns:
        mine = discovery.netns_of(os.getpid())
        pids = [p for p in pids if discovery.netns_of(p) == mine]
    if not pids:  # nothing to read: no dump, one line, findings' exit code
        where = " in this network namespace" if netns else ""
        what = "none of the --pid processes" if args.pid else "no process maps a libnccl"
        print(f"stallwatch snapshot: {host}: {what}{where}: nothing to read", file=sys.stderr)
        return ExitCode.FINDINGS
    snaps = read_series(reader, pids, args.samples, args.interval, "request")
    rec = readings_recording(host, snaps, args.reason, new_incident_id(host))
    path = write_dump(args.dump_dir, rec)
    if args.format == "json":
        doc = {"host": host, "path": str(path), "positions": reading_summary(snaps[-1])}
        print(json.dumps(doc, indent=2, sort_keys=True))
        return ExitCode.OK
    print(printable(f"{host}: {len(snaps[-1].processes)} process(es), {len(snaps)} reading(s)"))
    if not snaps[-1].processes:
        where = " in this network namespace" if netns else ""
        print(f"  {'no --pid process is' if args.pid else 'no process maps a libnccl'}{where}")
    for line in summary_lines(reading_summary(snaps[-1])):
        print(f"  {printable(line)}")
    print(printable(f"wrote {path}"))
    return ExitCode.OK


# -- every node, through its agent --------------------------------------------


def _ask_agents(args: argparse.Namespace) -> int:
    from stallwatch.recorder.watchdog import new_incident_id

    call = agent_call_from(args)
    agents = list(call.agents)
    incident = new_incident_id(args.host_name or socket.gethostname())
    body = {"reason": args.reason, "incident_id": incident, "samples": args.samples,
            "interval_s": args.interval}  # fmt: skip
    # the agent answers once its readings are taken: their time, then --timeout
    timeout = args.samples * args.interval + call.timeout
    clients = [AgentClient(a, call.token, call.tls, timeout) for a in agents]
    with ThreadPoolExecutor(len(agents)) as pool:
        answers = list(pool.map(functools.partial(_ask, body=body), clients))
    failed = [(a, ans) for a, ans in zip(agents, answers, strict=True) if isinstance(ans, str)]
    if args.format == "json":
        doc = {"incident_id": incident, "agents": dict(zip(agents, answers, strict=True))}
        print(json.dumps(doc, indent=2, sort_keys=True))
    else:
        _print_answers(incident, agents, answers)
    for agent, why in failed:  # one line each, here only
        print(f"stallwatch snapshot: agent {printable(agent)}: {printable(why)}", file=sys.stderr)
    if len(failed) == len(agents):
        return ExitCode.USAGE
    return ExitCode.FINDINGS if failed else ExitCode.OK


Answer = dict[str, object] | str  # the agent's JSON object, or why there is none


def _ask(client: AgentClient, body: dict[str, object]) -> Answer:
    try:
        reply = client.post_json("/snapshot", body)
    except AgentError as exc:
        return f"unreachable: {exc}"
    if not reply.ok:
        return f"refused: {reply.error_text()}"
    try:
        answer = reply.json()
    except AgentError as exc:
        return f"unreachable: {exc}"
    return answer if isinstance(answer, dict) else "answered something other than a JSON object"


def _print_answers(incident: str, agents: list[str], answers: list[Answer]) -> None:
    came = sum(not isinstance(ans, str) for ans in answers)
    print(printable(f"incident {incident}: {came} of {len(agents)} agents read their nodes"))
    for agent, ans in zip(agents, answers, strict=True):
        if isinstance(ans, str):  # named on stderr
            continue
        print(printable(f"{ans.get('host', agent)}: {ans.get('status')} {ans.get('path')}"))
        for line in summary_lines(ans.get("positions", [])):
            print(f"  {printable(line)}")

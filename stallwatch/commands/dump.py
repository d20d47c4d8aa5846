"""``stallwatch dump``: ask a running agent to dump now, or write a dump from
the pinned recording when no agent runs."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from stallwatch.dumpers.errors import AgentError, ExitCode
from stallwatch.query.agentclient import AgentClient
from stallwatch.query.output import printable

from .options import (
    HelpFormatter,
    add_client_tls,
    add_format_option,
    add_pin_dir,
    add_token_option,
    client_tls_from,
    read_token,
)

EPILOG = """\
examples:
  stallwatch dump                                  the agent on this node
  stallwatch dump --agent node3:9400 --token-file /etc/stallwatch/token \\
      --tls-ca /etc/stallwatch/ca.pem --reason "loss spike at step 1200"
  stallwatch dump --pinned                         no agent running: dump what the
                                                   kernel recorded into the pins

exit codes: 0 the agent wrote (or is retrying) the dump; 2 the agent could not be
reached or refused, or nothing is pinned at --pin-dir.
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "dump",
        help="ask a running agent to dump its rings now",
        description="POST /dump to a running agent and print where it wrote the dump.",
        epilog=EPILOG,
        formatter_class=HelpFormatter,
    )
    p.add_argument("--agent", default="127.0.0.1:9400", metavar="ADDR:PORT", help="the agent")
    p.add_argument(
        "--reason",
        default="requested by stallwatch dump",
        metavar="TEXT",
        help="why: kept in the dump's trigger",
    )
    add_token_option(p, "the agent's bearer token")
    add_client_tls(p, what="the agent")
    p.add_argument(
        "--pinned",
        action="store_true",
        help="no agent: write a dump from the pinned recording at --pin-dir (root)",
    )
    add_pin_dir(p)
    p.add_argument(
        "--dump-dir",
        type=Path,
        metavar="DIR",
        help="with --pinned: where the dump goes (default: the agent's --dump-dir)",
    )
    add_format_option(p, ("table", "json"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.pinned:
        from stallwatch.recorder.agent import dump_pinned

        answer = dump_pinned(args.pin_dir, args.dump_dir, args.reason, tuple(sys.argv[1:]))
        _print_answer(answer, args.format)
        return ExitCode.OK
    client = AgentClient(args.agent, read_token(args.token_file), client_tls_from(args), 30.0)
    try:
        reply = client.post_json("/dump", {"reason": args.reason})
        written = reply.json() if reply.ok else None
    except AgentError as exc:
        raise AgentError(f"agent {args.agent} unreachable: {exc}") from None
    if written is None:
        detail = reply.body.decode(errors="replace").strip()
        raise AgentError(f"agent {args.agent} refused the dump: {reply.status} {detail}")
    _print_answer(written, args.format)
    return ExitCode.OK


def _print_answer(answer: dict[str, object], fmt: str) -> None:
    if fmt == "table":
        for key, value in sorted(answer.items()):
            print(printable(f"{key:<14} {value}"))
    else:
        print(json.dumps(answer, indent=2, sort_keys=True))

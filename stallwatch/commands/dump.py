"""``stallwatch dump``: ask a running agent to dump now, or write a dump from
the pinned recording when no agent runs."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from stallwatch.dumpers.errors import AgentError, ExitCode, UsageError
from stallwatch.query.agentclient import AgentClient, parse_address
from stallwatch.query.credentials import read_local_token
from stallwatch.query.output import printable
from stallwatch.query.server import is_loopback

from .options import (
    HelpFormatter,
    add_client_tls,
    add_format_option,
    add_pin_dir,
    add_timeout_option,
    add_token_option,
    client_tls_from,
    read_token,
)

EPILOG = """\
examples:
  # the agent on this node (as root: the agent's dump credential is read
  # from /run/stallwatch if it has no token)
  stallwatch dump
  stallwatch dump --agent node3:9400 --token-file /etc/stallwatch/token \\
      --tls-ca /etc/stallwatch/ca.pem --reason "loss spike at step 1200"
  # no agent running: dump what the kernel recorded into the pins
  stallwatch dump --pinned

A dump the agent cannot write at once (disk full, permissions) is retried by
the agent; this command waits up to --wait seconds for the outcome.

exit codes: 0 the dump is written (its path printed); 1 the agent could not
write it within --wait (its reason printed: it retries, or gave it up); 2 bad
usage, the agent unreachable or refusing (credential, too many dumps asked for
lately), or nothing pinned at --pin-dir.
"""

POLL_S = 0.5


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
    add_token_option(p, "the agent's bearer token, or its dump credential")
    add_timeout_option(p, what="the agent")
    p.add_argument(
        "--wait",
        type=float,
        default=10.0,
        metavar="SEC",
        help="how long to wait for a dump the agent could not write at once",
    )
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
        from stallwatch.recorder.pinneddump import dump_pinned

        answer = dump_pinned(args.pin_dir, args.dump_dir, args.reason, tuple(sys.argv[1:]))
        _print_answer(answer, args.format)
        return ExitCode.OK
    if args.wait < 0:
        raise UsageError(f"--wait: expected seconds >= 0, got {args.wait:g}")
    client = AgentClient(args.agent, _token(args), client_tls_from(args), args.timeout)
    answer = _ask(client, args.agent, {"reason": args.reason})
    incident = answer.get("incident_id")
    deadline = time.monotonic() + args.wait
    while answer.get("status") == "queued" and isinstance(incident, str):
        if time.monotonic() + POLL_S > deadline:
            break
        time.sleep(POLL_S)
        answer = _ask(client, args.agent, {"outcome_of": incident})
    _print_answer(answer, args.format)
    if answer.get("status") == "written":
        return ExitCode.OK
    why = answer.get("error") or f"status {answer.get('status')}"
    retrying = " (the agent retries it)" if answer.get("status") == "queued" else ""
    print(f"stallwatch dump: not written{retrying}: {why}", file=sys.stderr)
    return ExitCode.FINDINGS


def _ask(client: AgentClient, agent: str, doc: dict[str, object]) -> dict[str, object]:
    """One POST /dump; AgentError (exit 2) for no answer or a refusal."""
    try:
        reply = client.post_json("/dump", doc)
        answer = reply.json() if reply.ok else None
    except AgentError as exc:
        raise AgentError(f"agent {agent} unreachable: {exc}") from None
    if reply.status == 429:
        retry = reply.json().get("retry_in_s", "?")
        raise AgentError(
            f"agent {agent} refused the dump: clients asked for too many dumps lately; "
            f"ask again in {retry} s"
        )
    if not isinstance(answer, dict):
        raise AgentError(f"agent {agent} refused the dump: {reply.error_text()}")
    return answer


def _token(args: argparse.Namespace) -> str | None:
    """--token-file's, or the dump credential an agent on this node without a
    token keeps for root (query.credentials)."""
    token = read_token(args.token_file)
    if token is not None:
        return token
    address = parse_address(args.agent)
    if not is_loopback(address.host):
        return None
    return read_local_token(address.host, address.port)


def _print_answer(answer: dict[str, object], fmt: str) -> None:
    if fmt == "table":
        for key, value in sorted(answer.items()):
            print(printable(f"{key:<14} {value}"))
    else:
        print(json.dumps(answer, indent=2, sort_keys=True))

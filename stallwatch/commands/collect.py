"""``stallwatch collect [INCIDENT] --agents HOST:PORT,... -o DIR``: one
incident's dumps from every agent, in one folder.

Exit codes: 0 every agent sent its dumps of the incident, 1 some did not (each
named: unreachable, refused, or no dump of it), 2 nothing collected (no
incident anywhere, no agent reached) or bad usage.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stallwatch.dumpers.errors import ExitCode
from stallwatch.query.output import new_table, printable, show

from .options import HelpFormatter, add_agent_options, add_format_option, agent_call_from

if TYPE_CHECKING:
    from rich.console import Console

    from stallwatch.query.live import Collected

EXAMPLES = """\
examples:
  stallwatch collect --agents node1:9400,node2:9400 -o incident/    # the newest incident
  stallwatch collect 20261123T170635508-node2-329539 --agents-file nodes.txt -o incident/ \\
      --token-file /etc/stallwatch/token --tls-ca /etc/stallwatch/ca.pem
  stallwatch analyze incident/             # then, the verdict

The dumps land as DIR/<host>/<file>, each checked by the dump reader on
arrival and written as the agent kept it; every agent that sent nothing is
named with its reason (unreachable, refused, no dump of the incident).

exit codes: 0 every agent sent its dumps, 1 some did not, 2 nothing collected
"""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "collect",
        help="fetch one incident's dumps from every agent into one folder",
        description="Fetch one incident's dumps (the newest incident any agent holds when "
        "none is named) from every agent, check each, and write them as DIR/<host>/<file>, "
        "the layout analyze, query and export read.",
        epilog=EXAMPLES,
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "incident", nargs="?", metavar="INCIDENT", help="the incident id (default: the newest)"
    )
    p.add_argument(
        "-o", "--out", type=Path, required=True, metavar="DIR", help="the folder to write into"
    )
    add_agent_options(p)
    add_format_option(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from stallwatch.query.agentclient import close_connections
    from stallwatch.query.live import collect

    call = agent_call_from(args)
    try:
        got = collect(call, args.incident, args.out)
    finally:
        close_connections()
    rows = _rows(call.agents, got)
    if args.format == "json":
        doc = {"incident_id": got.incident_id, "out": str(args.out), "agents": rows}
        from stallwatch.query.wire import encode_json

        print(encode_json(doc).decode())
    else:
        show(lambda c: _table(c, got.incident_id, args.out, rows))
    if not got.saved:
        print(f"stallwatch collect: nothing collected: {_why_nothing(got, rows)}", file=sys.stderr)
        return ExitCode.USAGE
    return ExitCode.FINDINGS if got.failed else ExitCode.OK


NO_INCIDENT = "holds no dump of any incident"


def _rows(agents: tuple[str, ...], got: Collected) -> list[dict[str, Any]]:
    """Per agent, in the order given: its host, files, bytes, or why none
    (an agent that answered with no dump at all says so too)."""
    rows: dict[str, dict[str, Any]] = {
        a: {"agent": a, "host": None, "files": [], "bytes": 0, "lost": None} for a in agents
    }
    for fetched, path in got.saved:
        row = rows[fetched.agent]
        row["host"] = fetched.host
        row["files"].append(str(path))
        row["bytes"] += len(fetched.blob)
    for failure in got.failed:
        rows[failure.agent]["lost"] = failure.error
    if got.incident_id is None:
        for row in rows.values():
            row["lost"] = row["lost"] or NO_INCIDENT
    return list(rows.values())


def _why_nothing(got: Collected, rows: list[dict[str, Any]]) -> str:
    answered = sum(1 for r in rows if r["lost"] in (None, NO_INCIDENT))
    if not answered:
        return f"none of {len(rows)} agents answered (each agent's reason above)"
    if got.incident_id is None:
        return f"{answered} of {len(rows)} agents answered, none holds a dump"
    return f"no agent sent a dump of incident {got.incident_id}"


def _table(c: Console, incident: str | None, out: Path, rows: list[dict[str, Any]]) -> None:
    came = sum(1 for r in rows if r["files"])
    if incident is None:
        c.print(f"no incident to collect: 0 of {len(rows)} agents sent a dump")
    else:
        c.print(
            printable(
                f"incident {incident}: {came} of {len(rows)} agents sent their dumps into {out}"
            )
        )
    columns = [("agent", False), ("host", False), ("dumps", True), ("size", True), ("lost", False)]
    t = new_table(c, columns)
    for r in rows:
        size = _size(r["bytes"]) if r["files"] else ""
        cells = (r["agent"], r["host"] or "", str(len(r["files"])), size, r["lost"] or "")
        t.add_row(*(printable(x) for x in cells))
    c.print(t)


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"

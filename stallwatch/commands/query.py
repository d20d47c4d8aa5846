"""``stallwatch query``: SQL on dumps, and on live agents.

Exit codes of ``query``: 0 every input answered; 1 a partial result (some
agents failed, or unreadable dumps were skipped: the rows printed miss their
data, and each missing input is named on stderr; files that are no dump are
named and ignored); 2 bad usage, a refused or failed query, no readable
dump, or no agent answered.
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from rich.console import Console
from rich.text import Text

from stallwatch.dumpers.errors import ExitCode, UsageError
from stallwatch.dumpers.inputs import InputStatus, input_notes
from stallwatch.dumpers.model import Recording
from stallwatch.query.output import id_widths, new_table, note, printable, text_for

from .options import (
    HelpFormatter,
    add_client_tls,
    add_format_option,
    add_token_option,
    client_tls_from,
    read_token,
)

QUERY_EPILOG = """\
tables: nccl_events, comm_events, tcp_events, sched_events, exit_events,
        processes, communicators, thread_states, cuda_graphs (each with a host column;
        timestamp_ns is the host's monotonic clock in ns, wall_time the same
        instant in UTC; *_ns columns are nanoseconds, elapsed_ns of a call in
        flight counts up to the dump's time; rank is the rank in the row's
        communicator, world_rank the process's, derived over every dump
        given; ids are '0x...' text as the reports print them, never cut;
        NULL where unknown, a pid a Flight Recorder file does not name too).
        Flight Recorder files are read as one dump per rank (host: the file's
        name). At most 10,000 rows are printed and a query may use 1 GB of
        memory, as on an agent (one line on stderr says when it was cut).
        The rows of every dump given share one table: where hosts must not
        mix (a time-window join), join on host too (t.host = s.host).

examples:
  stallwatch query dumps/ "SELECT host, op, count(*) FROM nccl_events GROUP BY ALL"
  stallwatch query dumps/*.msgpack --format csv \\
      "SELECT rank, seq, duration_ns/1e6 AS ms FROM nccl_events ORDER BY ms DESC LIMIT 10"
  stallwatch query dumps/ "SELECT count(*) FROM tcp_events" --json
  stallwatch query dumps/ \\
      "SELECT comm_id_hash, list(world_rank ORDER BY rank) FROM communicators GROUP BY 1"
  stallwatch query --agents node1:9400,node2:9400 --token-file /etc/stallwatch/token \\
      --tls-ca /etc/stallwatch/ca.pem \\
      "SELECT host, count(*) FROM tcp_events WHERE event = 'tcp_retransmit_skb' GROUP BY host"

exit codes: 0 all inputs answered, 1 partial result (failed agents or skipped
dumps are named on stderr), 2 bad usage, failed query, or nothing answered.
Only one SELECT statement is allowed; queries cannot read files or the network.
With --agents, the answer is what the same SQL returns over all the agents'
dumps in one query: ORDER BY, LIMIT, DISTINCT and aggregates apply across the
cluster (each agent sends only the rows or partial aggregates the query needs;
the client runs the query over their union). At most --concurrency agents are
asked at once, each given --timeout seconds; agents that did not answer are
named on stderr, and the rows are those of the others (exit 1).
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    q = subparsers.add_parser(
        "query",
        usage="stallwatch query [options] PATH... SQL\n"
        "       stallwatch query [options] --agents HOST:PORT,... SQL",
        help="run one SQL query on dumps, or on live agents in parallel",
        description="Run one read-only SQL SELECT on dump files and folders, or send it "
        "to live agents (--agents) in parallel and merge their rows.",
        epilog=QUERY_EPILOG,
        formatter_class=HelpFormatter,
    )
    q.add_argument(
        "args", nargs="+", metavar="PATH|SQL", help="dump files or folders, then the SQL (last)"
    )
    q.add_argument("--agents", metavar="HOST:PORT,...", help="query these live agents instead")
    add_token_option(q, "bearer token for the agents")
    q.add_argument(
        "--timeout", type=float, default=5.0, metavar="SEC", help="per agent, once it is asked"
    )
    q.add_argument("--concurrency", type=int, default=128, metavar="N", help="agents asked at once")
    add_client_tls(q)
    add_format_option(q, ("table", "json", "csv"))
    q.add_argument("--limit", type=int, metavar="N", help="at most N rows")
    q.add_argument(
        "--skip-bad",
        action="store_true",
        help="kept for old scripts: unreadable dumps are always skipped (named, exit 1)",
    )
    q.set_defaults(func=run)


# ---- inputs ----------------------------------------------------------------


def read_recordings(paths: Sequence[str]) -> tuple[list[Recording], list[InputStatus]]:
    """Dumps read (ours, and PyTorch Flight Recorder dumps as one recording
    per rank) through the one input opener, as ``analyze`` and ``export``
    read them: the recordings, and every input's status (``input_notes``
    says them for people)."""
    from stallwatch.analyzer.load import open_incidents

    incidents, statuses = open_incidents(paths)
    return [rec for inc in incidents for _, rec in inc.recordings], statuses


# ---- output ----------------------------------------------------------------


def _cell(value: object) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, float):
        return f"{value:.6g}" if abs(value) < 1e15 else repr(value)
    return str(value)


def format_table(
    columns: Sequence[str],
    types: Sequence[str],
    rows: Sequence[Sequence[Any]],
    file: TextIO | None = None,
) -> str:
    """Aligned columns for people (rich's table on a terminal, plain text
    for ``file`` otherwise): numbers right-aligned, NULL spelled out."""

    def draw(c: Console) -> None:
        heads = [(n, _is_numeric(t)) for n, t in zip(columns, types, strict=True)]
        table = new_table(c, heads, id_widths(rows, len(columns)))
        for row in rows:
            table.add_row(*(Text(printable(_cell(v))) for v in row))
        c.print(table)
        c.print(Text(f"({len(rows)} row{'s' if len(rows) != 1 else ''})"))

    return text_for(draw, file)


def _is_numeric(sql_type: str) -> bool:
    head = sql_type.split("(")[0].upper()
    return head in {
        "TINYINT", "SMALLINT", "INTEGER", "BIGINT", "HUGEINT", "UTINYINT", "USMALLINT",
        "UINTEGER", "UBIGINT", "UHUGEINT", "FLOAT", "DOUBLE", "DECIMAL",
    }  # fmt: skip


def format_csv(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(columns)
    writer.writerows([["" if v is None else v for v in r] for r in rows])
    return buf.getvalue().rstrip("\n")


def render(fmt: str, doc: dict[str, Any]) -> str:
    if fmt == "json":
        from stallwatch.query.http import encode_json

        return encode_json(doc).decode()
    if fmt == "csv":
        return format_csv(doc["columns"], doc["rows"])
    return format_table(doc["columns"], doc["types"], doc["rows"])


# ---- commands --------------------------------------------------------------


def _split_args(args: argparse.Namespace) -> tuple[list[str], str]:
    *paths, sql = args.args
    if args.agents and paths:
        raise UsageError("with --agents, give only the SQL (no dump paths)")
    if not args.agents and not paths:
        raise UsageError("give dump files or folders, then the SQL (or --agents HOST:PORT,...)")
    if args.limit is not None and args.limit < 0:
        raise UsageError(f"--limit must be 0 or more, got {args.limit}")
    return paths, sql


def run(args: argparse.Namespace) -> int:
    paths, sql = _split_args(args)
    if args.agents:
        return _query_agents(args, sql)
    recordings, statuses = read_recordings(paths)
    for line in input_notes(statuses):
        note("query", line)
    if not recordings:
        raise UsageError("no readable dump among the inputs")
    from stallwatch.query.sql import QUERY, QueryEngine

    with QueryEngine(recordings, QUERY) as engine:
        result = engine.query(sql, args.limit)
    if result.truncated and args.limit is None:
        print(
            f"stallwatch query: only the first {QUERY.max_rows} rows are printed "
            "(as an agent sends at most; aggregate, or --limit N for fewer)",
            file=sys.stderr,
        )
    doc = {**_table(result), "skipped": [s.note for s in statuses if not s.ok]}
    print(render(args.format, doc))
    return ExitCode.FINDINGS if any(s.lost for s in statuses) else ExitCode.OK


def _query_agents(args: argparse.Namespace, sql: str) -> int:
    from stallwatch.query.fanout import close_connections, query_agents

    agents = [a for a in args.agents.split(",") if a.strip()]
    token = read_token(args.token_file)
    client_tls = client_tls_from(args)
    try:
        result = query_agents(
            agents, sql, token, args.timeout, args.limit, client_tls, args.concurrency
        )
    finally:
        close_connections()
    for f in result.failed:
        note("query", f"agent {f.agent}: {f.error}")
    for a in result.answers:
        if a.truncated:
            print(
                f"stallwatch query: agent {a.agent}: had more rows than it may send; "
                "the answer lacks the rest",
                file=sys.stderr,
            )
    if not result.answers:
        print(f"stallwatch query: none of {len(agents)} agents answered", file=sys.stderr)
        return ExitCode.USAGE
    if result.partial:
        print(
            f"stallwatch query: partial result: {sum(not a.truncated for a in result.answers)} "
            f"of {len(agents)} "
            "agents answered in full",
            file=sys.stderr,
        )
    doc = {
        **_table(result),
        "agents": len(agents),
        "failed": [{"agent": f.agent, "error": f.error} for f in result.failed],
    }
    print(render(args.format, doc))
    return ExitCode.FINDINGS if result.partial else ExitCode.OK


def _table(result: Any) -> dict[str, Any]:
    """The result's table, as both the local and the fan-out answer print it."""
    return {
        "columns": list(result.columns),
        "types": list(result.types),
        "rows": result.rows,
        "truncated": result.truncated,
    }

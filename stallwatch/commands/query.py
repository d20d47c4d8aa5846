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
import functools
import io
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TextIO

from rich.console import Console
from rich.text import Text

from stallwatch.dumpers.errors import DumpError, ExitCode, UsageError
from stallwatch.dumpers.inputs import InputStatus, input_notes
from stallwatch.dumpers.model import Recording
from stallwatch.dumpers.sqltables import EXAMPLES
from stallwatch.query.output import id_widths, new_table, note, printable, text_for

if TYPE_CHECKING:
    import pyarrow as pa

from .options import (
    HelpFormatter,
    add_agent_options,
    add_format_option,
    agent_call_from,
    wants_agents,
)

QUERY_EPILOG = """\
tables: nccl_events, comm_events, tcp_events, sched_events, exit_events,
        link_events, conn_samples, iface_samples, probes, processes,
        communicators, links, thread_states, cuda_graphs (each with a host column;
        every time of every host is on one clock, the incident's: timestamp_ns,
        end_ns, ... are ns since the epoch, each host's monotonic stamps
        converted with its own clock pair, so hosts join on time;
        host_timestamp_ns is the host's own monotonic stamp, wall_time
        timestamp_ns in UTC; durations are *_ns too, elapsed_ns of a call in
        flight counts up to the dump's time; rank is the rank in the row's
        communicator, world_rank the process's, derived over every dump
        given; ids are '0x...' text as the reports print them, never cut;
        NULL where unknown, a pid a Flight Recorder file does not name too).
        Flight Recorder files are read as one dump per rank (host: the file's
        name). At most 10,000 rows are printed and a query may use 1 GB of
        memory, as on an agent (one line on stderr says when it was cut).
        The rows of every dump given share one table: query one incident's
        dumps (a later dump of a host repeats the rows its rings still held).

examples:
  stallwatch query dumps/ "SELECT host, op, count(*) FROM nccl_events GROUP BY ALL"
  stallwatch query dumps/ --example headline   # slow AllReduces, their ranks' retransmits
  stallwatch query --example retransmits-by-host   # print a named query's SQL
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
        "       stallwatch query [options] --agents HOST:PORT,... SQL\n"
        "       stallwatch query [options] --agents-file FILE SQL\n"
        "       stallwatch query [options] [PATH... | --agents HOST:PORT,...] --example NAME",
        help="run one SQL query on dumps, or on live agents in parallel",
        description="Run one read-only SQL SELECT on dump files and folders, or send it "
        "to live agents (--agents) in parallel and merge their rows.",
        epilog=QUERY_EPILOG,
        formatter_class=HelpFormatter,
    )
    q.add_argument(
        "args", nargs="*", metavar="PATH|SQL", help="dump files or folders, then the SQL (last)"
    )
    q.add_argument(
        "--example",
        choices=sorted(EXAMPLES),
        metavar="NAME",
        help=f"run this named query ({', '.join(sorted(EXAMPLES))}) instead of SQL "
        "given; with no dumps or agents, print its SQL",
    )
    add_agent_options(q)  # live, instead of PATH
    q.add_argument("--concurrency", type=int, default=128, metavar="N", help="agents asked at once")
    add_format_option(q, ("table", "json", "csv"))
    q.add_argument("--limit", type=int, metavar="N", help="at most N rows")
    q.add_argument(
        "--skip-bad",
        action="store_true",
        help="kept for old scripts: unreadable dumps are always skipped (named, exit 1)",
    )
    q.set_defaults(func=run)


# ---- inputs ----------------------------------------------------------------


def read_tables(
    paths: Sequence[str], sql: str, progress: bool
) -> tuple[dict[str, pa.Table] | None, list[InputStatus]]:
    """The tables ``sql`` reads over the dumps (``query.feed``): every
    input's header first (incidents, ranks), then one dump at a time read
    whole, its rows turned into what the query reads and the dump let go, so
    that memory holds the columns the query reads and one dump; None when no
    dump is readable.  Progress as ``analyze`` shows it.  Also: every
    input's status (``input_notes`` says them for people)."""
    from stallwatch.analyzer.load import open_incidents
    from stallwatch.analyzer.progress import Progress
    from stallwatch.dumpers import ranks
    from stallwatch.dumpers.format import read_dump
    from stallwatch.dumpers.inputs import SourceKind
    from stallwatch.dumpers.schema import RING_DTYPES
    from stallwatch.query.feed import feed, needs

    incidents, found = open_incidents(paths, defer=tuple(RING_DTYPES))
    statuses = list(found)
    heads = [(path, rec, i.flight_recorder) for i in incidents for path, rec in i.recordings]
    if not heads:
        return None, statuses

    def load(path: str, head: Recording, flight: bool) -> Recording | None:
        if flight:  # a Flight Recorder file's recording is whole already
            return head
        try:
            return read_dump(path)
        except DumpError as exc:  # a ring that fails its reader: lost, as on any read
            statuses.append(InputStatus(path, False, str(exc), SourceKind.STALLWATCH))
            return None

    loads = [functools.partial(load, *h) for h in heads]
    shown = Progress("read {}/{} dumps", len(heads), progress, command="query")
    try:
        known = ranks.of_dumps((path, h) for path, h, _ in heads)
        built = feed(loads, known, needs(sql), shown.step)
    finally:
        shown.close()
    return built, statuses


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
        from stallwatch.query.wire import encode_json

        return encode_json(doc).decode()
    if fmt == "csv":
        return format_csv(doc["columns"], doc["rows"])
    return format_table(doc["columns"], doc["types"], doc["rows"])


# ---- commands --------------------------------------------------------------


def _split_args(args: argparse.Namespace) -> tuple[list[str], str]:
    if args.example is not None:
        paths, sql = list(args.args), EXAMPLES[args.example]
    elif not args.args:
        raise UsageError("give dump files or folders, then the SQL (or --example NAME)")
    else:
        *paths, sql = args.args
    if wants_agents(args) and paths:
        raise UsageError("with --agents/--agents-file, give only the SQL (no dump paths)")
    if not wants_agents(args) and not paths:
        raise UsageError("give dump files or folders, then the SQL (or --agents HOST:PORT,...)")
    if args.limit is not None and args.limit < 0:
        raise UsageError(f"--limit must be 0 or more, got {args.limit}")
    return paths, sql


def run(args: argparse.Namespace) -> int:
    from stallwatch.dumpers.errors import QueryError

    try:
        return _run(args)
    except QueryError as exc:
        say_query_error(str(exc))
        return ExitCode.USAGE


def say_query_error(message: str, file: TextIO | None = None) -> None:
    """One message on stderr: its first line after ``stallwatch query:
    error:``, DuckDB's further lines (the excerpt of the SQL, the caret
    under it) indented beneath, each line escaped."""
    from stallwatch.query.errortext import error_lines

    first, *rest = error_lines(message) or ["the query failed"]
    lines = [f"stallwatch query: error: {printable(first)}", *(f"  {printable(r)}" for r in rest)]
    print("\n".join(lines), file=file if file is not None else sys.stderr)


def _run(args: argparse.Namespace) -> int:
    if args.example is not None and not args.args and not wants_agents(args):
        print(EXAMPLES[args.example])
        return ExitCode.OK
    paths, sql = _split_args(args)
    if wants_agents(args):
        return _query_agents(args, sql)
    from stallwatch.query.sql import QUERY, QueryEngine, check_sql

    check_sql(sql, QUERY)  # refused or unparsable: before any dump is read
    progress = sys.stderr.isatty() or len(paths) > 1
    built, statuses = read_tables(paths, sql, progress)
    for line in input_notes(statuses):
        note("query", line)
    if built is None:
        raise UsageError("no readable dump among the inputs")
    with QueryEngine(built, QUERY) as engine:
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

    call = agent_call_from(args)
    agents = call.agents
    try:
        result = query_agents(
            agents, sql, call.token, call.timeout, args.limit, call.tls, args.concurrency
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

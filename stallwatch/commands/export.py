"""``stallwatch export PATH... --perfetto -o FILE``: the incident as a timeline;
``stallwatch export PATH... --parquet -o DIR``: the SQL tables as Parquet.

Perfetto: dumps are read by the analyzer's loader (files or folders; unreadable files
are named one per line on stderr and the others still used), analyzed, and
drawn (``analyzer.export``, ``analyzer.perfetto``): one trace process per host,
one track per rank and communicator, each verdict as a marker.

Parquet: every SQL table of every readable dump (Flight Recorder ones
included, as ``query`` reads them: ``frincident.read_as_recordings``),
Hive-partitioned by incident and host (``analyzer.parquet``;
``docs/parquet.md`` documents the columns).  Another incident can be added to
the same folder later; one already there is refused, never rewritten.

Exit codes: 0 written from every input; 1 written, but inputs that could not
be read were skipped (named on stderr); 2 bad usage or nothing could be read.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from stallwatch.dumpers.errors import ExitCode, UsageError
from stallwatch.dumpers.inputs import input_notes
from stallwatch.query.output import note

from .options import HelpFormatter, add_format_option

EXAMPLES = """\
examples:
  stallwatch export --perfetto dumps/ -o trace.json
  stallwatch export dumps/node*/*.msgpack --perfetto -o incident.json
  stallwatch export --parquet dumps/incident-42/ -o /data/stallwatch-parquet
  duckdb -c "SELECT host, count(*) FROM read_parquet(
      '/data/stallwatch-parquet/nccl_events/**/*.parquet', hive_partitioning=true) GROUP BY host"

Open a trace at https://ui.perfetto.dev (Open trace file) or chrome://tracing.
Parquet: one folder per table, incident=<id>/host=<host>/ below it; adding
another incident later never rewrites the ones already there.
exit codes: 0 written, 1 written with unreadable inputs skipped, 2 bad usage or no
dump could be read.
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "export",
        help="the incident as a Perfetto timeline, or the SQL tables as Parquet",
        description="--perfetto: write dumps as a trace-event JSON file: one process per "
        "host, one track per rank and communicator, every NCCL call a slice, kernel events "
        "as instants, the analyzer's verdicts as markers.  --parquet: write every SQL table "
        "of the dumps as Hive-partitioned Parquet (incident=/host=) into a folder, for "
        "DuckDB, Spark, Trino and other engines.",
        epilog=EXAMPLES,
        formatter_class=HelpFormatter,
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="dump files or folders")
    kind = p.add_mutually_exclusive_group(required=True)
    kind.add_argument(
        "--perfetto", action="store_true", help="a trace-event JSON file for ui.perfetto.dev"
    )
    kind.add_argument(
        "--parquet", action="store_true", help="Parquet files under a folder (-o DIR)"
    )
    p.add_argument(
        "-o",
        "--output",
        required=True,
        type=Path,
        metavar="FILE|DIR",
        help="where to write: the trace file, or the Parquet folder",
    )
    p.add_argument(
        "--incident",
        metavar="ID",
        help="--parquet: the incident id to write (default: the trigger's id; a Flight "
        "Recorder folder's name or 'snapshot' with a digest of the files)",
    )
    add_format_option(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.parquet:
        return run_parquet(args)
    if args.incident is not None:
        raise UsageError("--incident names a Parquet export's incident (with --parquet)")
    from stallwatch.analyzer.export import export

    result = export(args.paths, args.output)
    for line in input_notes(result.inputs):
        note("export", line)
    kinds = [m.kind for m in result.markers]
    if args.format == "json":
        doc = {
            "path": str(result.path),
            "dumps": result.recordings,
            "calls": result.calls,
            "verdicts": kinds,
            "inputs": [{"path": s.path, "ok": s.ok, "error": s.error} for s in result.inputs],
        }
        print(json.dumps(doc, indent=2))
    else:
        print(
            f"wrote {result.path}: {result.recordings} dump(s), {result.calls} NCCL call(s), "
            f"verdicts: {', '.join(kinds) or 'none'}\n"
            "open it at https://ui.perfetto.dev (Open trace file)"
        )
    return ExitCode.FINDINGS if any(s.lost for s in result.inputs) else ExitCode.OK


def run_parquet(args: argparse.Namespace) -> int:
    from stallwatch.analyzer.parquet import export_parquet

    written, statuses = export_parquet(args.paths, args.output, args.incident)
    for line in input_notes(statuses):
        note("export", line)
    code = ExitCode.FINDINGS if any(s.lost for s in statuses) else ExitCode.OK
    if args.format == "json":
        doc = {
            "path": str(args.output),
            "incidents": [
                {"id": w.incident, "hosts": list(w.hosts), "files": w.files, "rows": w.rows}
                for w in written
            ],
            "inputs": [{"path": s.path, "ok": s.ok, "error": s.error} for s in statuses],
        }
        print(json.dumps(doc, indent=2))
        return code
    for w in written:
        rows = ", ".join(f"{n} {k}" for k, n in w.rows.items() if n)
        print(
            f"wrote incident {w.incident} to {args.output}: {len(w.hosts)} host(s), "
            f"{w.files} file(s); rows: {rows or 'none'}"
        )
    return code

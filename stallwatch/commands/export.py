"""``stallwatch export PATH... --perfetto -o FILE``: the incident as a timeline;
``stallwatch export PATH... --parquet -o DIR``: the SQL tables as Parquet;
``stallwatch export PATH... --flight-recorder -o DIR`` (or ``--agents``): the
incident as PyTorch Flight Recorder files.

Perfetto: dumps are read by the analyzer's loader (files or folders; unreadable files
are named one per line on stderr and the others still used), analyzed, and
drawn (``analyzer.export``, ``analyzer.perfetto``): one trace process per host,
one track per rank and communicator, each verdict as a marker.

Parquet: every SQL table of every readable dump (Flight Recorder ones
included, as ``query`` reads them: ``frincident.read_as_recordings``),
Hive-partitioned by incident and host (``analyzer.parquet``;
``docs/parquet.md`` documents the columns).  Another incident can be added to
the same folder later; one already there is refused, never rewritten.

Flight Recorder: the incident as the analyzer reads it (dumps, or the live
agents' current recordings with ``--agents``), one file per rank,
``rank_<world rank>``, format 2.10, pickled as torch pickles them or, with
``--json``, in torch's JSON form (``analyzer.frexport``); torchfrtrace and
NVRx's attribution read them as torch's own.  ``--collectives-only`` leaves
point-to-point calls out, for torchfrtrace (torch 2.13 and 2.14), which groups
a collective with the send or recv after it when their seqs are alike and then
fails on a group that does both in turn.  A file already there is refused,
never rewritten.

Exit codes: 0 written from every input; 1 written, but inputs that could not
be read were skipped (named on stderr); 2 bad usage or nothing could be read.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from stallwatch.dumpers.errors import ExitCode, UsageError
from stallwatch.dumpers.inputs import input_notes
from stallwatch.query.output import note

if TYPE_CHECKING:
    from stallwatch.analyzer.incident import Incident

from .options import (
    HelpFormatter,
    add_agent_options,
    add_format_option,
    agent_call_from,
    wants_agents,
)

EXAMPLES = """\
examples:
  stallwatch export --perfetto dumps/ -o trace.json
  stallwatch export dumps/node*/*.msgpack --perfetto -o incident.json
  stallwatch export --parquet dumps/incident-42/ -o /data/stallwatch-parquet
  duckdb -c "SELECT host, count(*) FROM read_parquet(
      '/data/stallwatch-parquet/nccl_events/**/*.parquet', hive_partitioning=true) GROUP BY host"
  stallwatch export --flight-recorder dumps/incident-42/ -o fr/
  stallwatch export --flight-recorder dumps/incident-42/ --collectives-only -o fr-coll/
  torchfrtrace fr-coll/ -p rank_
  stallwatch export --flight-recorder --agents node1:9400,node2:9400 -o fr/ --json

Open a trace at https://ui.perfetto.dev (Open trace file) or chrome://tracing.
Parquet: one folder per table, incident=<id>/host=<host>/ below it; adding
another incident later never rewrites the ones already there.
Flight Recorder: rank_<world rank> per rank (one folder per incident when the
inputs hold several); --json writes torch's JSON form (and prints this summary
as JSON). torchfrtrace (torch 2.13, 2.14) fails on files that hold point-to-point
calls: export them for it with --collectives-only (the summary says when).
exit codes: 0 written, 1 written with unreadable inputs skipped, 2 bad usage or no
dump could be read.
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "export",
        help="the incident as a Perfetto timeline, as PyTorch Flight Recorder files, or the "
        "SQL tables as Parquet",
        description="--perfetto: write dumps as a trace-event JSON file: one process per "
        "host, one track per rank and communicator, every NCCL call a slice, kernel events "
        "as instants, the analyzer's verdicts as markers.  --flight-recorder: write the "
        "incident as PyTorch Flight Recorder files, one per rank (rank_<world rank>), for "
        "torchfrtrace and NVRx's attribution.  --parquet: write every SQL table of the dumps "
        "as Hive-partitioned Parquet (incident=/host=) into a folder, for DuckDB, Spark, "
        "Trino and other engines.",
        epilog=EXAMPLES,
        formatter_class=HelpFormatter,
    )
    p.add_argument("paths", nargs="*", metavar="PATH", help="dump files or folders")
    kind = p.add_mutually_exclusive_group(required=True)
    kind.add_argument(
        "--perfetto", action="store_true", help="a trace-event JSON file for ui.perfetto.dev"
    )
    kind.add_argument(
        "--parquet", action="store_true", help="Parquet files under a folder (-o DIR)"
    )
    kind.add_argument(
        "--flight-recorder",
        action="store_true",
        help="PyTorch Flight Recorder files, rank_<world rank>, under a folder (-o DIR)",
    )
    p.add_argument(
        "-o",
        "--output",
        required=True,
        type=Path,
        metavar="FILE|DIR",
        help="where to write: the trace file, or the Parquet or Flight Recorder folder",
    )
    p.add_argument(
        "--collectives-only",
        action="store_true",
        help="--flight-recorder: leave point-to-point calls out (for torchfrtrace)",
    )
    add_agent_options(p)  # --flight-recorder, live, instead of PATH
    p.add_argument(
        "--incident",
        metavar="ID",
        help="--parquet: the incident id to write (default: the trigger's id; a Flight "
        "Recorder folder's name or 'snapshot' with a digest of the files)",
    )
    add_format_option(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    live = wants_agents(args)
    if live and not args.flight_recorder:
        raise UsageError("--agents goes with --flight-recorder (the others export dumps)")
    if args.collectives_only and not args.flight_recorder:
        raise UsageError("--collectives-only goes with --flight-recorder")
    if args.flight_recorder:
        return run_flight_recorder(args, live)
    if not args.paths:
        raise UsageError("give dump files or folders to export")
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


def run_flight_recorder(args: argparse.Namespace, live: bool) -> int:
    from stallwatch.analyzer.frexport import export_flight_recorder
    from stallwatch.analyzer.pipeline import analyze_paths

    if live == bool(args.paths):
        raise UsageError("give dump files or folders, or --agents/--agents-file (not both)")
    if args.incident is not None:
        raise UsageError("--incident names a Parquet export's incident (with --parquet)")
    if live:
        from stallwatch.analyzer.live import analyze_agents
        from stallwatch.query.agentclient import close_connections

        call = agent_call_from(args)
        try:
            result = analyze_agents(call).result
        finally:
            close_connections()
    else:
        result = analyze_paths(args.paths)
    for line in input_notes(result.inputs):
        note("export", line)
    if not result.anything_read or not result.incidents:
        why = "; ".join(s.error or s.path for s in result.inputs if not s.ok) or "no input"
        raise UsageError(f"no dump could be read ({why})")
    json_form = args.format == "json"
    written = export_flight_recorder(
        result.incidents, args.output, json_form, p2p=not args.collectives_only
    )
    p2p_calls = [0 if args.collectives_only else p2p_written(r.incident) for r in result.incidents]
    for w in written:
        for why in w.left_out:
            note("export", f"{w.incident}: left out: {why}")
    if json_form:
        doc = {
            "path": str(args.output),
            "form": "json",
            "incidents": [
                {
                    "id": w.incident,
                    "folder": str(w.folder),
                    "ranks": list(w.ranks),
                    "files": [str(f) for f in w.files],
                    "calls": w.calls,
                    "p2p_calls": p2p,
                    "left_out": list(w.left_out),
                }
                for w, p2p in zip(written, p2p_calls, strict=True)
            ],
            "inputs": [{"path": s.path, "ok": s.ok, "error": s.error} for s in result.inputs],
        }
        print(json.dumps(doc, indent=2))
    else:
        for w, p2p in zip(written, p2p_calls, strict=True):
            print(
                f"wrote incident {w.incident} to {w.folder}: {len(w.files)} Flight Recorder "
                f"file(s) (ranks {_ranks_text(w.ranks)}), {w.calls} call(s)"
                + (f", {p2p} of them point-to-point" if p2p else "")
            )
            print(_torchfrtrace_hint(args, live, w.folder, p2p, several=len(written) > 1))
    lost = any(s.lost for s in result.inputs) or any(w.left_out for w in written)
    return ExitCode.FINDINGS if lost else ExitCode.OK


TORCHFRTRACE = "torchfrtrace"  # the console script torch installs (its fr_trace module)


def p2p_written(inc: Incident) -> int:
    """The point-to-point calls among those written: of the processes whose
    world rank is known (a file each)."""
    import numpy as np

    from stallwatch.dumpers.schema import Op

    rows = inc.calls.rows
    known = [p for p, proc in enumerate(inc.procs) if proc.world_rank >= 0]
    mask = np.isin(rows["op"], [int(Op.SEND), int(Op.RECV)]) & np.isin(rows["proc"], known)
    return int(mask.sum())


def _torchfrtrace_hint(
    args: argparse.Namespace, live: bool, folder: Path, p2p: int, several: bool
) -> str:
    """How to read the files with torchfrtrace, which (torch 2.13, 2.14) fails
    on point-to-point calls (it takes a collective and the send or recv
    after it for one coalesced group, then asks the collective for a peer):
    with them in the files, the export that leaves them out, then the tool."""
    if not p2p:
        return f"torchfrtrace reads them: {TORCHFRTRACE} {shlex.quote(str(folder))} -p rank_"
    if live:
        return (
            "torchfrtrace fails on point-to-point calls: for it, export again with "
            f"--collectives-only, then {TORCHFRTRACE} DIR -p rank_"
        )
    out = Path(f"{str(args.output).rstrip('/')}-collectives")
    files = out / folder.name if several else out  # one folder per incident, as here
    paths = " ".join(shlex.quote(p) for p in args.paths)
    return (
        "torchfrtrace fails on point-to-point calls; for it, leave them out:\n"
        f"  stallwatch export --flight-recorder {paths} --collectives-only "
        f"-o {shlex.quote(str(out))}\n"
        f"  {TORCHFRTRACE} {shlex.quote(str(files))} -p rank_"
    )


def _ranks_text(ranks: tuple[int, ...]) -> str:
    if ranks and list(ranks) == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(str(r) for r in ranks) or "none"

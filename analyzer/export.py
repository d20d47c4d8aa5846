"""The incident as a Perfetto timeline (``stallwatch export --perfetto``; the
command is ``stallwatch.commands.export``).

Dumps are read by the analyzer's loader (files or folders; unreadable files
are named one per line on stderr and the others still used), analyzed, and
drawn with ``analyzer.perfetto``: one trace process per host, one track per
rank and communicator, each verdict as a marker.

PyTorch Flight Recorder dumps are drawn too: one trace process per dump
(named by its file), their entries as slices on each rank's wall clock.

The Parquet export is ``analyzer.parquet``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from stallwatch.dumpers.errors import UsageError
from stallwatch.dumpers.model import Recording

from .culprits import culprits
from .incident import InputStatus
from .perfetto import Marker
from .pipeline import IncidentResult


@dataclass(frozen=True, slots=True)
class Exported:
    """What one export drew: for the command's summary and for tests."""

    path: Path
    recordings: int
    calls: int
    markers: tuple[Marker, ...]
    inputs: tuple[InputStatus, ...]


def markers_of(results: Sequence[IncidentResult]) -> tuple[Marker, ...]:
    """The analyzer's verdicts as trace markers, each naming its culprits
    (``analyzer.culprits``: host, world rank and pid index by index; a
    verdict without culprits names the hosts it concerns)."""
    out = []
    for r in results:
        for v in r.verdicts:
            found = culprits(r.incident, v, r.frontiers)
            if not found:
                out.append(Marker(v.kind.value, v.summary, tuple(v.hosts), tuple(v.ranks)))
                continue
            hosts = tuple(c.host or "" for c in found)
            ranks = tuple(c.world_rank for c in found)
            pids = tuple(c.pid for c in found)
            out.append(Marker(v.kind.value, v.summary, hosts, ranks, pids))
    return tuple(out)


def export(paths: Sequence[str], output: Path) -> Exported:
    """Load, analyze, draw, write.  Raises UsageError when nothing is readable."""
    from stallwatch.dumpers.inputs import group_dumps, incident_key
    from stallwatch.dumpers.ranks import Ranks

    from .align import Source
    from .flightrec import FrDump
    from .frincident import incidents_from_flightrec, recordings_of
    from .load import load_inputs
    from .perfetto import build_trace, write_trace
    from .pipeline import analyze_incident, group_incidents

    loaded, statuses = load_inputs(paths)
    if not loaded:
        raise UsageError(_nothing_read(statuses))
    ours = [s for s in loaded if isinstance(s, Source)]
    lost = [s.path for s in statuses if s.lost]
    fr = incidents_from_flightrec([d for d in loaded if isinstance(d, FrDump)], lost)
    groups = group_dumps(ours, lambda s: incident_key(s.recording), lambda s: s.recording.host)
    per_incident: list[list[Recording]] = [[s.recording for s in v] for v in groups.values()]
    per_incident += [recordings_of(inc) for inc in fr]
    known = Ranks({}, {}, {})
    for recs in per_incident:  # ranks derived within each incident, as analyze does
        known = known.merged(Ranks.of(recs))
    recordings = [r for recs in per_incident for r in recs]
    incidents = [*group_incidents(ours), *fr]
    markers = markers_of([analyze_incident(inc) for inc in incidents])
    write_trace(output, build_trace(recordings, markers, known))
    calls = sum(len(r.rings["nccl"].rows) for r in recordings if "nccl" in r.rings)
    return Exported(output, len(recordings), calls, markers, tuple(statuses))


def _nothing_read(statuses: Sequence[InputStatus]) -> str:
    why = "; ".join(s.error or s.path for s in statuses if not s.ok) or "no input"
    return f"no dump could be read ({why})"

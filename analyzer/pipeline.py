"""The staged analyzer: load -> validate -> group into incidents -> align ->
match -> metrics -> detect -> verdicts -> report.

Known limits:
- Of each rank only its latest calls are read (``align.WINDOW_CALLS``):
  the frontier of every communicator it used since and the straggler
  window.  Older rows are treated as a wrapped ring's: unknown, never
  missing; a desync older than them is not seen.
- Point-to-point calls are judged only when no collective explains the
  stall: a rank that posted sends (receives) its peer never matched and has
  been idle 1 s since names that peer (``detect_p2p_missing``), by the
  rules of collectives: never a peer without a dump, or whose rank in a
  split the evidence does not tell (``dumpers.ranks``), nor one whose dump
  was taken before the call it never matched; evidence naming one rank on
  both sides is refused and said.  Their sizes and timing are not judged.
- A hang is told from a snapshot by how long the frontier made no progress
  (the dump time of the host, against its own timestamps): at least 1 s and
  4x the communicator's p99 call duration.
- Stragglers in asynchronous mode (calls return at once) are found by entry
  lateness: among ranks of one host exactly; across hosts only when a rank
  is 50 ms or more behind, far above clock skew.
- Stragglers must be last far more often than chance would make them (three
  standard deviations over 1/n of a communicator's collectives) and late by
  a quarter of the time between its collectives at least: a few ms of
  lateness under CPU contention is noise.  A rank slowed by less goes unnamed.
- Retransmits count only on connections between two nodes' own addresses
  (never loopback, never both ends on one host); per host, inside every
  completed collective the rings hold, by the shipped per-host query
  (``query.retransmits``: the report and the SQL count alike), and only when the
  collectives they fall into are markedly slower (3x) than the
  communicator's others (or, when nearly all have some, its lower quartile).
  A busy machine retransmits now and then on every link: that is noise.
  When every host named holds a rank starved of CPU, the starvation is the
  finding (a starved process stalls its connections into retransmits).
  Asynchronous calls return at once: seen on no device, a collective's
  window runs to its ranks' next call after a pause, durations of such
  windows compare nothing, and it is slowed when retransmission timeouts of
  the job's connections held a tenth of its communicator's time.
- Packet loss between exactly two nodes looks the same from both ends: both
  hosts are named.  With three or more, the host involved in nearly every
  retransmit (halfway between its even share, 2 of n hosts, and all).
- Of several dead ranks, the first to die is the cause; those whose call
  returned an error, or that exited with an error after it (by each host's
  wall clock; across hosts only beyond 50 ms of skew, or after a rank killed
  by a signal), died of it and are named in its evidence, not blamed.
- Flight Recorder dumps carry wall-clock times of their own host and no dump
  time: a frontier where an entry is still pending is taken as stuck.
- Evidence has a moment (``incident.Frontier.lag``): our dumps' capture
  times, a Flight Recorder file's latest entry (a lower bound).  A rank
  behind a frontier is stuck when its evidence was taken after the frontier
  began (beyond 50 ms of skew); it was read before it went on when its
  peers' completions prove it entered a later seq, or it was inside a
  collective they completed (on that communicator or another).  When some
  dump is shown older (dumps taken in turn), the dumps taken last decide:
  where they stand at the frontier (``Frontier.stood_still``: two ranks or
  more in flight there, or held behind it in another stuck collective), the
  one member absent from it whose evidence is not shown older is named; a
  member waiting in another stuck collective is not a candidate; with
  several that cannot be told (a lost dump among them), none is, and the
  stall is inconclusive.  A staircase
  whose latest dumps keep going is healthy.  Without any sign of dumps
  taken in turn, a Flight Recorder rank one collective behind, between
  calls, is indistinguishable from one that stopped there, and is named (a
  dump taken in turn that is lost can take that sign with it).  A rank read
  in its gap between two calls just before another, dumped earlier,
  stopped looks like the one that stopped, and is named in its place.
- A hung job is never healthy (``detect.stall``): a watchdog's stall dump,
  calls in flight past the stall threshold, the latest Flight Recorder dumps
  standing at one collective or threads held in one NCCL call make the
  verdict, when nothing else is found, ``inconclusive`` (the candidates and
  why none can be named, or what every rank shares).
- A rank without a readable dump is judged only from its peers' records (a
  collective any member completed proves every member entered it) and never
  blamed beyond them: when only such ranks could hold a stall up, or nothing
  departs but they cannot be seen, the verdict is ``inconclusive``.
- Calls an agent recorded from its attach on communicators made before it
  (seq relative to the attach) are aligned with their peers first
  (``analyzer.late``); those that cannot be, with certainty, are not judged
  and the incident is ``inconclusive`` for them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from stallwatch.dumpers.inputs import group_dumps, incident_key, read_status
from stallwatch.dumpers.model import Recording

from . import late
from .align import Source, incident_from_recordings
from .detect import DETECTORS, FALLBACK_DETECTORS, STALL_DETECTORS, Analysis, Detector
from .detect.causes import in_causal_order
from .detect.cpu import sched_delays
from .detect.desync import disagreements
from .detect.inconclusive import detect_inconclusive, unjudged
from .detect.missing import moments_apart_ns, p2p_gaps, refused_text, self_blaming, taken_in_turn
from .detect.network import network_metrics
from .detect.partition import connection_fates
from .detect.paths import onset_wall, slow_link
from .detect.slowdown import (
    detect_slowdown,
    judged_on_window,
    slow_windows,
    window_matched,
    window_since,
)
from .detect.stragglers import arrival_scores, kind_scores
from .flightrec import FrDump
from .frincident import incidents_from_flightrec, with_stacks
from .frontier import frontiers
from .incident import Frontier, Incident, InputStatus, SourceKind, proc_hosts
from .load import Loaded, load_inputs
from .match import match
from .verdict import Verdict, VerdictKind


@dataclass(frozen=True, slots=True)
class IncidentResult:
    incident: Incident
    verdicts: tuple[Verdict, ...]
    frontiers: tuple[Frontier, ...]
    unjudged: tuple[str, ...] = ()  # what no readable dump could show


@dataclass(frozen=True, slots=True)
class AnalysisResult:
    incidents: tuple[IncidentResult, ...]
    inputs: tuple[InputStatus, ...]

    @property
    def anything_read(self) -> bool:
        return any(s.ok for s in self.inputs)

    @property
    def lost(self) -> tuple[InputStatus, ...]:
        """Inputs that could not be read (foreign files are ignored, not lost)."""
        return tuple(s for s in self.inputs if s.lost)

    @property
    def ignored(self) -> tuple[InputStatus, ...]:
        """Files that are no dump (named, not read)."""
        return tuple(s for s in self.inputs if s.ignored)

    @property
    def healthy(self) -> bool:
        """Every incident healthy, and nothing lost on the way."""
        verdicts = [v for r in self.incidents for v in r.verdicts]
        return (
            bool(verdicts)
            and not self.lost
            and all(v.kind is VerdictKind.HEALTHY for v in verdicts)
        )


def analyze_incident(inc: Incident, detectors: Sequence[Detector] = DETECTORS) -> IncidentResult:
    m = match(inc)
    hosts = proc_hosts(inc)
    fronts = frontiers(inc, m, hosts)
    # a slowdown is judged on its slow window: who arrives last in it, and
    # whose connections retransmit in it against as long a baseline before it
    windows = tuple(slow_windows(inc, m)) if inc.slowdown is not None else ()
    compared = window_matched(m, windows, baseline=True)
    slow = window_matched(m, windows)
    net = network_metrics(inc, compared, whole=not windows)
    since = onset_wall(inc, windows or slow_windows(inc, m), m) if len(inc.conns) else None
    a = Analysis(
        incident=inc,
        matched=m,
        frontiers=fronts,
        disagreements=tuple(disagreements(m)),
        arrivals=tuple(arrival_scores(inc, slow)),
        retransmit_counts=net.retransmits,
        sched=sched_delays(inc, window_since(inc, m, windows)),
        slowdowns=net.slowdowns,
        fates=connection_fates(inc),
        windows=windows,
        kind_arrivals=tuple(kind_scores(inc, slow)) if windows else (),
        held=net.held,
        held_retransmits=net.held_retransmits,
        slow_link=slow_link(inc, since) if len(inc.conns) else None,
        slow_since_wall=since,
    )
    verdicts = [v for d in detectors for v in d(a)]
    refused: list[str] = []
    if not verdicts and detectors is DETECTORS:
        a = dataclasses.replace(a, p2p=tuple(p2p_gaps(inc)))
        refused = [refused_text(inc, g) for g in self_blaming(a.p2p)]
        verdicts = [v for d in FALLBACK_DETECTORS for v in d(a)]
    verdicts = in_causal_order(a, sorted(verdicts, key=Verdict.sort_key))
    verdicts = [judged_on_window(a, v) for v in verdicts]
    if not verdicts:
        verdicts = detect_inconclusive(a) or _stalled(a) or detect_slowdown(a) or [_healthy(a)]
    verdicts = late.amend(inc, verdicts)
    if inc.kind is SourceKind.FLIGHT_RECORDER:  # the stacks of the calls they cite
        verdicts = with_stacks(inc, verdicts)
    return IncidentResult(inc, tuple(verdicts), fronts, (*unjudged(a), *refused))


def _stalled(a: Analysis) -> list[Verdict]:
    """The first stall detector that finds anything (a hung job is never healthy)."""
    for detect in STALL_DETECTORS:
        found = detect(a)
        if found:
            return found
    return []


def _healthy(a: Analysis) -> Verdict:
    inc = a.incident
    n = len(a.matched.group_start)
    summary = (
        f"no rank departs from consensus ({len(inc.procs)} ranks, {len(inc.comms)} "
        f"communicators, {n} collectives matched)"
    )
    evidence: tuple[str, ...] = (f"{len(inc.calls)} calls from {len(inc.sources)} input(s)",)
    if taken_in_turn(a):
        apart = moments_apart_ns(a)
        by = "" if apart is None else f", {apart / 1e6:.0f} ms apart by entry times"
        summary += f"; the dumps were taken at different moments{by}"
        evidence += (
            "a dump that ends behind its peers ends before what their completions prove it "
            "did since, or was taken before their frontier began: nothing shows a rank stuck",
        )
    return Verdict(VerdictKind.HEALTHY, (), inc.hosts, (), None, None, None, summary, evidence)


def group_incidents(
    loaded: Iterable[Loaded],
    consume: bool = False,
    progress: bool = False,
    lost: Sequence[str] = (),
) -> list[Incident]:
    """Inputs into incidents; ``lost``: the paths of inputs that could not be
    read (a Flight Recorder file among dumps of its folder names a rank)."""
    ours: list[Source] = []
    fr: list[FrDump] = []
    for item in loaded:
        if isinstance(item, FrDump):
            fr.append(item)
        else:
            ours.append(item)
    groups = group_dumps(ours, lambda s: incident_key(s.recording), lambda s: s.recording.host)
    out = [incident_from_recordings(k, v, consume, progress) for k, v in groups.items()]
    out.extend(incidents_from_flightrec(fr, lost))
    return out


def analyze_paths(paths: Sequence[str], progress: bool = False) -> AnalysisResult:
    # NCCL rings stay in their files until align reads each, copies what it
    # needs and forgets it: a cluster's dumps are never all in memory
    loaded, statuses = load_inputs(paths, progress=progress, defer=("nccl",))
    lost = [s.path for s in statuses if s.lost]
    incidents = group_incidents(loaded, consume=True, progress=progress, lost=lost)
    del loaded
    results = tuple(analyze_incident(inc) for inc in incidents)
    return AnalysisResult(results, _with_lost(statuses, incidents))


def _with_lost(
    statuses: Sequence[InputStatus], incidents: list[Incident]
) -> tuple[InputStatus, ...]:
    """The inputs' statuses, those found unreadable while their rows were
    read (``Incident.lost``) lost."""
    later = {s.path: s for inc in incidents for s in inc.lost}
    return tuple(later.get(s.path, s) for s in statuses)


def analyze_recordings(
    answers: Sequence[tuple[str, Recording]], lost: Sequence[InputStatus] = ()
) -> AnalysisResult:
    """The same analysis on recordings held in memory (the agents' answers
    to ``analyze --agents``), each named by where it came from; ``lost``: the
    inputs that could not be had (agents that did not answer), reported as
    lost inputs like unreadable files."""
    sources = [Source(name, rec) for name, rec in answers]
    statuses = [read_status(name, rec) for name, rec in answers]
    statuses += lost
    incidents = group_incidents(sources, lost=[s.path for s in lost])
    results = tuple(analyze_incident(inc) for inc in incidents)
    return AnalysisResult(results, _with_lost(sorted(statuses, key=lambda s: s.path), incidents))

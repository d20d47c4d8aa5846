"""The verdict where people look.  Once an incident this agent detected is
dumped here, it gathers the verdict from every node's dump of it and
publishes it:

- ``<dump dir>/<incident>.verdict.json``: the ``analyze --json`` document
  (docs/analyze.schema.json) with its ``publication`` (revision, when, by
  which agent, which nodes' dumps were in it);
- one line in the log, ``incident ID: verdict ...: KIND: ranks R on HOSTS: summary``;
- ``/metrics``: ``stallwatch_incident_info{incident,kind,hosts,ranks,revision}``
  and ``stallwatch_incident_timestamp_seconds{incident}``;
- with ``--notify URL``, a webhook (``recorder.webhook``).

The verdict is the live verdict's: ``stallwatch analyze --agents ...
--incident ID --json``, every agent's dumps of the incident as written, so
it is what ``analyze`` says of the same dumps.  The agent carries no
analysis: a ``Judge`` runs it, in production a child process
(``ChildJudge``; the command line is the composition root's, in
``stallwatch.commands.record``), so that the analysis' memory and time are
never the recording's, and a judge that fails or hangs is killed and logged.

When: the first verdict once every peer answered the incident's dump
request, or, for those that did not, after ``PEER_WAIT_FACTOR`` times as
long as this node's own dump took (its peers do the same work at the same
moment); each agent is then given that long to send its dump.  A peer
that this node's probes of the incident found silent (no probe of any kind
answered or refused: ``recorder.pathprobe.silent_peers``) is not waited
for: a node cut off from its peers publishes what its own dump says.  A verdict
some node's dump was missing from is gathered again, with the ordinary
timeout, at the dump scheduler's retry times (``REGATHER_S``), and one that
differs is published again under the next revision: in the file, the metric
and the notice.  An incident relabelled to a peer's earlier id is that
peer's to publish.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from stallwatch.dumpers.errors import UsageError
from stallwatch.dumpers.model import Trigger, TriggerKind
from stallwatch.query.agentclient import parse_address

from .webhook import Notice, Webhook

if TYPE_CHECKING:
    from prometheus_client.core import Metric

log = logging.getLogger("stallwatch.verdict")

SECOND_NS = 1_000_000_000
VERDICT_SUFFIX = ".verdict.json"
# The peers dump as this node did, at the same moment: twice its own dump's
# time is the wait for their answers, and each agent's time to send its dump
# to the first verdict (never less than MIN_WAIT_S: a dump written from the
# page cache in a few ms says nothing of a peer's network).
PEER_WAIT_FACTOR = 2.0
MIN_WAIT_S = 1.0
# A verdict some node's dump was missing from is gathered again when the
# dump scheduler retries a failed write (0.5 s doubling, up to 30 s: by 7.5,
# 15.5, 30 and 60 s a peer's dump that failed has had its 4th to 7th try),
# with the ordinary timeout of the live verdict.
REGATHER_S = (7.5, 15.5, 30.0, 60.0)
REGATHER_TIMEOUT_S = 10.0  # query.live.LIVE_TIMEOUT_S
AWAIT_POLL_S = 0.05  # how often the wait for the peers looks at what the probes found
# The judge's own start (an interpreter, the analyzer's imports) on top of
# the agents' time; past it, the child is killed.
JUDGE_SLACK_S = 30.0
# Incidents shown on /metrics: the latest; older ones are in their files.
SHOWN = 8
# Incidents this agent raised whose verdict it publishes (a peer's request,
# a client's or a shutdown's dump is the asker's).
PEER_DUMPED = frozenset({"written", "duplicate"})  # a peer's answers that say its dump is there
PUBLISHED_KINDS = frozenset(
    {TriggerKind.IN_FLIGHT, TriggerKind.NO_PROGRESS, TriggerKind.EXIT, TriggerKind.SLOWDOWN}
)


@dataclass(frozen=True, slots=True)
class Judgement:
    """What a judge answered: the ``analyze --json`` document, or why none."""

    document: dict[str, object] | None
    error: str | None = None


Judge = Callable[[str, Sequence[str], float], Judgement]  # (incident, agents, timeout)


@dataclass(frozen=True, slots=True)
class Published:
    """A verdict as published: its first (most severe) verdict, and all of
    them as ``(kind, ranks, hosts)`` to tell a revision by."""

    incident_id: str
    revision: int
    kind: str
    hosts: tuple[str, ...]
    ranks: tuple[int | None, ...]
    summary: str
    detected_wall_ns: int
    published_wall_ns: int
    nodes: tuple[str, ...]  # the agents whose dumps were in it
    missing: tuple[str, ...]  # the agents asked whose dumps were not
    path: Path | None
    key: tuple[tuple[str, tuple[int | None, ...], tuple[str, ...]], ...]

    @property
    def complete(self) -> bool:
        return not self.missing


class ChildJudge:
    """Runs the live verdict as a child process: ``argv(incident, agents)``
    is its command line (``analyze ... --request-stdin --json``).  A child
    is started when the incident is raised (``warm``), so that it has
    loaded the analyzer by the time the dumps are written; it is then given
    the agents to ask, its timeout and their token on stdin (the token never
    on a command line)."""

    def __init__(
        self, argv: Callable[[str, Sequence[str]], list[str]], token: str | None = None
    ) -> None:
        self.argv, self.token = argv, token
        self._lock = threading.Lock()
        self._ready: dict[str, subprocess.Popen[bytes]] = {}

    def warm(self, incident_id: str, agents: Sequence[str]) -> None:
        """Start the child for an incident now (one waiting at a time)."""
        try:
            proc = self._spawn(incident_id, agents)
        except OSError as exc:
            log.warning("incident %s: cannot start the verdict's child: %s", incident_id, exc)
            return
        with self._lock:
            stale = list(self._ready.values())
            self._ready = {incident_id: proc}
        for old in stale:
            _stop(old)

    def __call__(self, incident_id: str, agents: Sequence[str], timeout_s: float) -> Judgement:
        """The verdict from ``agents`` (the warm child's, whichever agents it
        was started with: they are told on stdin)."""
        with self._lock:
            ready = self._ready.pop(incident_id, None)
        try:
            proc = ready if ready is not None else self._spawn(incident_id, agents)
        except OSError as exc:
            return Judgement(None, f"cannot run the verdict's child: {exc.strerror or exc}")
        ask = {"timeout": timeout_s, "token": self.token, "agents": list(agents)}
        try:
            out, err = proc.communicate(
                (json.dumps(ask) + "\n").encode(), timeout=timeout_s + JUDGE_SLACK_S
            )
        except subprocess.TimeoutExpired:
            _stop(proc)
            return Judgement(None, f"no verdict within {timeout_s + JUDGE_SLACK_S:g} s")
        return _answer(proc.returncode, out, err)

    def _spawn(self, incident_id: str, agents: Sequence[str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            self.argv(incident_id, agents),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.communicate()


def _answer(code: int, out: bytes, err: bytes) -> Judgement:
    """0 healthy, 1 findings: a document; anything else: why not."""
    if code not in (0, 1):
        last = err.decode(errors="replace").strip().splitlines()[-1:] or [""]
        return Judgement(None, f"exit code {code}: {last[0][:300]}")
    try:
        doc = json.loads(out)
    except ValueError as exc:
        return Judgement(None, f"the answer is not JSON: {exc}")
    return Judgement(doc if isinstance(doc, dict) else None, None)


# ---- reading the document ----------------------------------------------------------


def _incident_doc(doc: dict[str, object], incident_id: str) -> dict[str, object] | None:
    incidents = [i for i in _list(doc.get("incidents")) if isinstance(i, dict)]
    mine = [i for i in incidents if i.get("id") == incident_id] or incidents
    return mine[0] if mine else None


def _list(value: object) -> list[object]:
    return value if isinstance(value, list) else []


def _verdicts(inc: dict[str, object]) -> list[dict[str, object]]:
    return [v for v in _list(inc.get("verdicts")) if isinstance(v, dict)]


def _ranks(v: dict[str, object]) -> tuple[int | None, ...]:
    return tuple(r if isinstance(r, int) else None for r in _list(v.get("ranks")))


def _hosts(v: dict[str, object]) -> tuple[str, ...]:
    """The hosts a verdict names, each once (``hosts`` is per culprit)."""
    return tuple(dict.fromkeys(str(h) for h in _list(v.get("hosts")) if h is not None))


def nodes_in(doc: dict[str, object], agents: Sequence[str]) -> tuple[str, ...]:
    """The agents whose dumps were read (inputs are named ``agent/file``)."""
    read = {
        str(i.get("path", "")).rsplit("/", 1)[0]
        for i in _list(doc.get("inputs"))
        if isinstance(i, dict) and i.get("ok")
    }
    return tuple(a for a in agents if a in read)


def summarize(
    doc: dict[str, object],
    incident_id: str,
    agents: Sequence[str],
    detected_wall_ns: int,
    revision: int = 1,
) -> Published | None:
    """The verdict a document holds for the incident, or None if it holds none."""
    inc = _incident_doc(doc, incident_id)
    verdicts = _verdicts(inc) if inc is not None else []
    if not verdicts:
        return None
    first = verdicts[0]
    nodes = nodes_in(doc, agents)
    return Published(
        incident_id=incident_id,
        revision=revision,
        kind=str(first.get("kind", "inconclusive")),
        hosts=_hosts(first),
        ranks=_ranks(first),
        summary=str(first.get("summary", "")),
        detected_wall_ns=detected_wall_ns,
        published_wall_ns=time.time_ns(),
        nodes=nodes,
        missing=tuple(a for a in agents if a not in nodes),
        path=None,
        key=tuple((str(v.get("kind")), _ranks(v), _hosts(v)) for v in verdicts),
    )


# ---- publishing --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Dumped:
    """An incident this agent detected, dumped here."""

    trigger: Trigger
    dump_s: float  # how long this node's dump took
    peers: threading.Thread | None  # the peers' round (they answer once dumped)


class VerdictPublisher:
    """Publishes the verdicts of the incidents this agent detects."""

    def __init__(
        self,
        judge: Judge,
        agents: Callable[[], Sequence[str]],
        dump_dir: Path,
        host: str,
        relabelled: Callable[[str], bool] = lambda _id: False,
        answers: Callable[[str], Mapping[str, str]] = lambda _id: {},
        webhook: Webhook | None = None,
        regather_s: Sequence[float] = REGATHER_S,
        clock: Callable[[], int] = time.monotonic_ns,
        unreached: Callable[[str], frozenset[str]] = lambda _id: frozenset(),
    ) -> None:
        """``agents``: every agent to gather from (this one and its peers),
        asked at each incident; ``relabelled(id)``: whether this node's
        incident was given a peer's earlier id (then it is the peer's);
        ``answers(id)``: what each peer answered to the request to dump it;
        ``unreached(id)``: the peer hosts this node's probes of the incident
        found silent (no probe answered or refused: not waited for)."""
        self.judge, self.agents, self.dump_dir, self.host = judge, agents, dump_dir, host
        self.relabelled, self.webhook, self.regather_s = relabelled, webhook, regather_s
        self.answers, self.unreached = answers, unreached
        self.clock = clock
        self._lock = threading.Lock()
        self._shown: OrderedDict[str, Published] = OrderedDict()
        self.failures = 0  # gatherings that gave no verdict
        self.published = 0  # verdicts (revisions too) published
        self.threads: list[threading.Thread] = []

    def raised(self, trigger: Trigger) -> None:
        """An incident of ours is raised: a judge that can, gets ready now."""
        warm = getattr(self.judge, "warm", None)
        if trigger.kind not in PUBLISHED_KINDS or warm is None:
            return
        incident = trigger.incident_id
        threading.Thread(  # the peers' list may need a lookup: never in the tick
            target=lambda: warm(incident, tuple(self.agents())), name=f"judge-{incident}"
        ).start()

    def dumped(self, event: Dumped) -> None:
        """An incident of ours is dumped here: its verdict, in the background."""
        if event.trigger.kind not in PUBLISHED_KINDS:
            return
        thread = threading.Thread(
            target=self._run, args=(event,), name=f"verdict-{event.trigger.incident_id}"
        )
        thread.daemon = True
        self.threads = [t for t in self.threads if t.is_alive()] + [thread]
        thread.start()

    def counters(self) -> dict[str, int]:
        """For /metrics (each a counter)."""
        out = {"verdicts_published": self.published, "verdict_failures": self.failures}
        if self.webhook is not None:
            w = self.webhook.stats
            out |= {"notify_sent": w.sent, "notify_failures": w.failures}
            out["notify_dropped"] = w.dropped
        return out

    def latest(self) -> tuple[Published, ...]:
        with self._lock:
            return tuple(self._shown.values())

    def _run(self, event: Dumped) -> None:
        try:
            self._publish_all(event)
        except Exception:  # a verdict is never worth the agent
            log.exception("incident %s: the verdict failed", event.trigger.incident_id)

    def _publish_all(self, event: Dumped) -> None:
        incident = event.trigger.incident_id
        wait = max(MIN_WAIT_S, PEER_WAIT_FACTOR * event.dump_s)
        if event.peers is not None:
            self._await_peers(event.peers, incident, wait)
        detected = time.time_ns() - (self.clock() - event.trigger.time_ns)
        started = time.monotonic()
        current: Published | None = None
        for at in (0.0, *self.regather_s):
            if current is not None and current.complete:
                return
            if self.relabelled(incident):
                log.info("incident %s is a peer's under an earlier id: theirs to publish", incident)
                return
            if at:
                if event.peers is not None:
                    event.peers.join()  # the round ends within its own timeout
                time.sleep(max(0.0, at - (time.monotonic() - started)))
            agents = tuple(self.agents())
            ask = agents if at else self._dumped_by(incident, agents)
            timeout = REGATHER_TIMEOUT_S if at else wait
            current = self._gather(incident, agents, ask, timeout, detected, current)

    def _await_peers(self, round_: threading.Thread, incident: str, wait: float) -> None:
        """Wait up to ``wait`` for the peers' answers to the dump request,
        ending once every peer answered or was found silent by this node's
        probes (a cut-off node's requests wait out their timeout: no use)."""
        deadline = time.monotonic() + wait
        while round_.is_alive() and (left := deadline - time.monotonic()) > 0:
            silent = self.unreached(incident)
            if silent:
                said = self.answers(incident)
                peers = tuple(self.agents())[1:]
                if all(a in said or host_of(a) in silent for a in peers):
                    log.info("incident %s: not waiting for peers %s: no probe reached them",
                             incident, ", ".join(sorted(silent)))  # fmt: skip
                    return
            round_.join(min(left, AWAIT_POLL_S))

    def _dumped_by(self, incident: str, agents: tuple[str, ...]) -> tuple[str, ...]:
        """For the first verdict: this agent, and the peers that said their
        dump is written (one that did not answer, or could not write, is
        asked again for the revision)."""
        said = self.answers(incident)
        return agents[:1] + tuple(a for a in agents[1:] if said.get(a) in PEER_DUMPED)

    def _gather(
        self,
        incident: str,
        agents: tuple[str, ...],
        ask: tuple[str, ...],
        timeout_s: float,
        detected: int,
        before: Published | None,
    ) -> Published | None:
        """Gather the verdict from ``ask`` (of ``agents``); publish it if it
        is the first or differs."""
        got = self.judge(incident, ask, timeout_s)
        revision = 1 if before is None else before.revision + 1
        doc = got.document
        found = None if doc is None else summarize(doc, incident, agents, detected, revision)
        if doc is None or found is None:
            self.failures += 1
            why = got.error or "no verdict in it"
            log.error("incident %s: no verdict gathered: %s", incident, why)
            return before
        if before is not None and found.key == before.key:  # no revision: more nodes read
            same = replace(before, nodes=found.nodes, missing=found.missing)
            with self._lock:
                if same.incident_id in self._shown:
                    self._shown[same.incident_id] = same
            return same
        return self._publish(found, doc)

    def _publish(self, found: Published, doc: dict[str, object]) -> Published:
        path = self.dump_dir / f"{found.incident_id}{VERDICT_SUFFIX}"
        found = replace(found, path=path)
        doc = {**doc, "publication": publication_doc(found, self.host)}
        try:
            _write_atomic(path, json.dumps(doc, indent=2).encode())
        except OSError as exc:
            log.error("incident %s: cannot write %s: %s", found.incident_id, path, exc)
            found = replace(found, path=None)
        with self._lock:
            self._shown[found.incident_id] = found
            self._shown.move_to_end(found.incident_id)
            while len(self._shown) > SHOWN:
                self._shown.popitem(last=False)
            self.published += 1
        notice = notice_of(found, self.host)
        log.warning("incident %s: verdict: %s", found.incident_id, verdict_line(found))
        if self.webhook is not None:
            self.webhook.send(notice)
        return found


class _Incidents(Protocol):
    """What the publisher is wired to (``recorder.watchdog.Incidents``)."""

    relabelled: dict[str, str]
    on_raised: Callable[[Trigger], object] | None
    on_dumped: Callable[[Dumped], object] | None

    def answers(self, incident_id: str) -> dict[str, str]: ...


def publisher_of(
    judge: Judge,
    incidents: _Incidents,
    agents: tuple[str, Callable[[], Sequence[str]]],
    dump_dir: Path,
    host: str,
    notify_url: str | None = None,
    unreached: Callable[[str], frozenset[str]] = lambda _id: frozenset(),
) -> VerdictPublisher:
    """The agent's publisher, wired to its incidents: ``agents`` is this
    agent's address and where its peers' come from; ``unreached``: the
    peers its probes found silent, per incident."""
    own, peers = agents
    publisher = VerdictPublisher(
        judge,
        lambda: (own, *peers()),
        dump_dir,
        host,
        relabelled=lambda incident: incident in incidents.relabelled,
        answers=incidents.answers,
        webhook=Webhook(notify_url) if notify_url else None,
        unreached=unreached,
    )
    incidents.on_raised = publisher.raised
    incidents.on_dumped = publisher.dumped
    return publisher


def host_of(agent: str) -> str:
    """The host of an agent's address (``query.agentclient.parse_address``:
    ``host:port``, ``[v6]:port``, a URL); one it cannot read, as given."""
    try:
        return parse_address(agent).host
    except UsageError:
        return agent


def verdict_line(p: Published) -> str:
    """``missing_rank: rank 3 on node1: <summary> (revision 2; dumps of 3 of 4 nodes)``."""
    ranks = ", ".join("unknown" if r is None else str(r) for r in p.ranks) or "none"
    hosts = ", ".join(p.hosts) or "no host"
    nodes = len(p.nodes)
    asked = nodes + len(p.missing)
    return (
        f"{p.kind}: rank{'s' if len(p.ranks) != 1 else ''} {ranks} on {hosts}: {p.summary} "
        f"(revision {p.revision}; dumps of {nodes} of {asked} nodes)"
    )


def notice_of(p: Published, host: str) -> Notice:
    return Notice(
        p.incident_id, p.revision, p.kind, p.hosts, p.ranks, p.summary,
        p.detected_wall_ns, host, str(p.path or ""),
    )  # fmt: skip


def publication_doc(p: Published, host: str) -> dict[str, object]:
    """What the verdict file says of its publication (docs/analyze.schema.json)."""
    return {
        "incident": p.incident_id,
        "revision": p.revision,
        "published_by": host,
        "detected": _iso(p.detected_wall_ns),
        "published": _iso(p.published_wall_ns),
        "agents_read": list(p.nodes),
        "agents_missing": list(p.missing),
    }


def _iso(wall_ns: int) -> str:
    secs, ns = divmod(wall_ns, SECOND_NS)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(secs)) + f".{ns // 1_000_000:03d}Z"


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ---- /metrics -----------------------------------------------------------------------


def incident_families(shown: Iterable[Published]) -> Iterator[Metric]:
    """``stallwatch_incident_info`` (1, labelled) and its time, per incident shown."""
    from prometheus_client.core import GaugeMetricFamily

    info = GaugeMetricFamily(
        "stallwatch_incident_info",
        "An incident this agent detected, with its published verdict: kind, hosts, ranks "
        "(comma-separated) and revision; the latest few.",
        labels=["incident", "kind", "hosts", "ranks", "revision"],
    )
    when = GaugeMetricFamily(
        "stallwatch_incident_timestamp_seconds",
        "When the incident was detected (Unix time).",
        labels=["incident"],
    )
    for p in shown:
        ranks = ",".join("unknown" if r is None else str(r) for r in p.ranks)
        info.add_metric([p.incident_id, p.kind, ",".join(p.hosts), ranks, str(p.revision)], 1.0)
        when.add_metric([p.incident_id], p.detected_wall_ns / SECOND_NS)
    yield info
    yield when

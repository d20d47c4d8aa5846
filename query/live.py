"""Asking agents for what they hold: their current recordings
(``POST /recording``, for ``analyze --agents``) and one incident's dump files
(``GET /dumps`` then ``POST /collect``, for ``collect``).

Every agent is asked at once through the fan-out's pooled client
(:func:`~stallwatch.query.fanout.call_agents`); each dump that comes back is
checked by the dump reader on arrival, so an agent that sends something the
reader refuses is a failed agent, named with the reader's reason, like one
that does not answer.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from stallwatch.dumpers.errors import DumpError, UsageError
from stallwatch.dumpers.folder import save_dump
from stallwatch.dumpers.format import decode
from stallwatch.dumpers.model import Recording

from .agentclient import parse_address
from .fanout import DEFAULT_CONCURRENCY, AgentFailure, call_agents
from .tls import ClientTls
from .wire import DUMP_FRAMES, DumpBundle, decode_dumps

LIVE_REASON = "live verdict (stallwatch analyze --agents)"
# An agent reads its rings and its ranks' threads before it answers, and a
# cluster's worth of answers is a few MB each: more than a SQL fetch's time.
LIVE_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class AgentCall:
    """How to reach the agents: the same for every call."""

    agents: tuple[str, ...]
    token: str | None = None
    tls: ClientTls | None = None
    timeout: float = LIVE_TIMEOUT_S
    concurrency: int = DEFAULT_CONCURRENCY


def agents_from(listed: str | None, file: Path | None) -> tuple[str, ...]:
    """``--agents A,B`` and ``--agents-file FILE`` (one ``HOST:PORT`` a line,
    or several separated by commas; ``#`` comments), together, each once."""
    agents = [a.strip() for a in (listed or "").split(",") if a.strip()]
    if file is not None:
        try:
            text = file.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            why = getattr(exc, "strerror", None) or exc
            raise UsageError(f"--agents-file {file}: {why}") from None
        for line in text.splitlines():
            agents += [a.strip() for a in line.split("#")[0].split(",") if a.strip()]
    if not agents:
        raise UsageError("no agents given (--agents HOST:PORT,... or --agents-file FILE)")
    for agent in agents:
        parse_address(agent)  # HOST:PORT, named in a usage error if not
    return tuple(dict.fromkeys(agents))


@dataclass(frozen=True, slots=True)
class Fetched:
    """One dump an agent sent, checked by the reader."""

    agent: str
    host: str
    name: str  # its file name
    blob: bytes  # as sent
    recording: Recording

    @property
    def label(self) -> str:
        """Where it came from, as inputs are named in reports."""
        return f"{self.agent}/{self.name}"


@dataclass(frozen=True, slots=True)
class Gathered:
    incident_id: str | None
    fetched: tuple[Fetched, ...]
    failed: tuple[AgentFailure, ...]
    elapsed_ms: float


def _bundle(content_type: str, body: bytes) -> DumpBundle:
    if content_type != DUMP_FRAMES:
        raise ValueError(f"the answer is {content_type or 'untyped'}, not dumps: an older agent?")
    return decode_dumps(body)


def _checked(agent: str, bundle: DumpBundle) -> list[Fetched]:
    out = []
    for name, sent in zip(bundle.names, bundle.blobs, strict=True):
        blob = bytes(sent)  # decode_dumps gives bytes: no copy
        try:
            rec = decode(blob, f"{agent}/{name}")
        except DumpError as exc:
            raise ValueError(str(exc)) from None
        out.append(Fetched(agent, bundle.host or rec.host, name, blob, rec))
    return out


def _fetch_bundles(call: AgentCall, path: str, doc: dict[str, object]) -> Gathered:
    start = time.perf_counter()
    replies, failed = call_agents(
        call.agents,
        path,
        lambda agent, ctype, body: _checked(agent, _bundle(ctype, body)),
        doc,
        call.token,
        call.timeout,
        call.tls,
        call.concurrency,
    )
    incident = doc.get("incident_id")
    return Gathered(
        incident if isinstance(incident, str) else None,
        tuple(f for reply in replies for f in reply.value),
        tuple(failed),
        (time.perf_counter() - start) * 1e3,
    )


def fetch_recordings(call: AgentCall, incident_id: str, reason: str = LIVE_REASON) -> Gathered:
    """Every agent's current recording, under one incident id (so that the
    analyzer reads them as one incident), nothing written anywhere."""
    return _fetch_bundles(call, "/recording", {"incident_id": incident_id, "reason": reason})


@dataclass(frozen=True, slots=True)
class Listed:
    """One dump an agent keeps (``GET /dumps``)."""

    agent: str
    name: str
    incident_id: str | None
    wall_ns: int
    bytes: int


def _listing(agent: str, _content_type: str, body: bytes) -> list[Listed]:
    try:
        doc = json.loads(body)
        return [
            Listed(agent, str(d["name"]), d["incident_id"], int(d["wall_ns"]), int(d["bytes"]))
            for d in doc["dumps"]
        ]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"the list of dumps is not what an agent sends: {exc}") from None


def list_dumps(call: AgentCall) -> tuple[list[Listed], list[AgentFailure]]:
    """What every agent keeps, newest first per agent."""
    replies, failed = call_agents(
        call.agents,
        "/dumps",
        _listing,
        None,
        call.token,
        call.timeout,
        call.tls,
        call.concurrency,
    )
    return [d for reply in replies for d in reply.value], failed


def latest_incident(listed: Sequence[Listed]) -> str | None:
    """The incident of the newest dump any agent holds."""
    named = [d for d in listed if d.incident_id is not None]
    return max(named, key=lambda d: (d.wall_ns, d.name)).incident_id if named else None


def fetch_incident(call: AgentCall, incident_id: str) -> Gathered:
    """Every agent's dump files of ``incident_id``, as written, checked."""
    return _fetch_bundles(call, "/collect", {"incident_id": incident_id})


@dataclass(frozen=True, slots=True)
class Collected:
    """What ``collect`` brought home: the files written, per agent, and the
    agents that sent nothing (unreachable, refused, or no such incident)."""

    incident_id: str | None
    saved: tuple[tuple[Fetched, Path], ...]
    failed: tuple[AgentFailure, ...]
    elapsed_ms: float


def collect(call: AgentCall, incident_id: str | None, out_dir: Path) -> Collected:
    """One incident's dumps (the newest incident any agent holds when None)
    from every agent, checked, saved as ``out_dir/<host>/<file>``."""
    start = time.perf_counter()
    failed: list[AgentFailure] = []
    if incident_id is None:
        listed, failed = list_dumps(call)
        incident_id = latest_incident(listed)
        if incident_id is None:
            return Collected(None, (), tuple(failed), (time.perf_counter() - start) * 1e3)
        # agents that could not list are asked again below, and named once
        failed = []
    got = fetch_incident(call, incident_id)
    saved = []
    failures = list(got.failed)
    for f in got.fetched:
        try:
            path, _ = save_dump(out_dir, f.host, f.name, f.blob)
        except DumpError as exc:
            failures.append(AgentFailure(f.agent, str(exc)))
            continue
        saved.append((f, path))
    order = {a: i for i, a in enumerate(call.agents)}
    failures.sort(key=lambda x: order.get(x.agent, len(order)))
    return Collected(
        incident_id, tuple(saved), tuple(failures), (time.perf_counter() - start) * 1e3
    )

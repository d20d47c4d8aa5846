"""The live verdict (``stallwatch analyze --agents``): every agent's current
recording, fetched at once under one incident id, analyzed in memory as its
dumps would be; nothing is written unless asked (``save``: the answers, as
sent, in the per-node layout every other command reads).  With an incident
id (``--incident``), every agent's dumps of that incident instead, as
written: the verdict ``analyze`` gives on the same files (the one an agent
publishes after its incident, ``recorder.verdicts``).

Agents that do not answer, or send what the dump reader refuses, are lost
inputs under the rules for unreadable dumps: their ranks are judged only from
their peers' evidence, and never blamed beyond it.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from stallwatch.dumpers.folder import save_dump
from stallwatch.query.live import AgentCall, Gathered, fetch_incident, fetch_recordings

from .incident import InputStatus
from .pipeline import AnalysisResult, analyze_recordings


@dataclass(frozen=True, slots=True)
class LiveVerdict:
    result: AnalysisResult
    gathered: Gathered
    saved: tuple[Path, ...]  # with ``save``: the files written


def new_live_id() -> str:
    """``live-<UTC time to the ms>-<random>``: sorts by time, unique."""
    wall = time.time_ns()
    secs, ns = divmod(wall, 1_000_000_000)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(secs)) + f"{ns // 1_000_000:03d}"
    return f"live-{stamp}-{secrets.token_hex(3)}"


def analyze_agents(
    call: AgentCall, save: Path | None = None, incident_id: str | None = None
) -> LiveVerdict:
    """The agents' current recordings, or (``incident_id``) their dumps of it."""
    if incident_id is not None:
        got = fetch_incident(call, incident_id)
    else:
        got = fetch_recordings(call, new_live_id())
    saved: tuple[Path, ...] = ()
    if save is not None:  # first: what was fetched is kept whatever the analysis does
        saved = tuple(save_dump(save, f.host, f.name, f.blob)[0] for f in got.fetched)
    lost = [InputStatus(f.agent, False, f"{f.agent}: {f.error}") for f in got.failed]
    result = analyze_recordings([(f.label, f.recording) for f in got.fetched], lost)
    return LiveVerdict(result, got, saved)

"""``stallwatch dump --pinned``: a dump of a pinned recording read with no
agent (and no BCC), as its agent would have written it."""

from __future__ import annotations

import time
from pathlib import Path

from stallwatch.dumpers.errors import DumpWriteError
from stallwatch.dumpers.model import Trigger, TriggerKind

from .agent import Agent, AgentConfig, log


def dump_pinned(
    pin_dir: Path, dump_dir: Path | None, reason: str, args: tuple[str, ...] = ()
) -> dict[str, object]:
    """``stallwatch dump --pinned``: a dump of the pinned recording at
    ``pin_dir``, read with no agent (and no BCC).  It is run where the agent
    ran: in ``netns`` scope, its TCP rows are kept by this namespace's
    addresses."""
    from stallwatch import __version__
    from stallwatch.dumpers.format import write_dump

    from .incidentids import new_incident_id
    from .pinning import PinSet
    from .source import PinnedSource

    pins = PinSet.open(pin_dir, read_only=True)
    about = pins.description
    if pins.locked_by_other():
        log.warning(
            "an agent (pid %s) records into %s: dumping its pins all the same",
            about.get("agent_pid", "?"),
            pin_dir,
        )
    target = dump_dir or Path(str(about.get("dump_dir", "dumps")))
    config = AgentConfig(
        dump_dir=target,
        scope=str(about.get("scope", "host")),
        job=str(about["job"]) if about.get("job") else None,
        host_name=str(about.get("host_name", "")),
        args=args,
        version=__version__,
    )
    netns = about.get("netns")
    agent = Agent(config, PinnedSource(pins), netns=int(netns) if netns else None)
    try:
        now = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        incident = new_incident_id(agent.host)
        why = f"{reason} (from the pinned recording at {pin_dir}, no agent)"
        trigger = Trigger(TriggerKind.MANUAL, why, incident, now, origin_host=agent.host)
        rec = agent.recording(trigger)
    finally:
        agent.close()
    try:
        target.mkdir(parents=True, exist_ok=True)
        path = write_dump(target, rec)
    except OSError as exc:
        raise DumpWriteError(f"--dump-dir {target}: {exc.strerror or exc}") from None
    return {"host": agent.host, "incident_id": incident, "status": "written", "path": str(path)}

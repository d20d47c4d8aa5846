"""When each fault of a lab run happened: ``lab run --json`` reports, for every
fault, a ``FaultRecord``.

A record says whether the fault took effect, at which step (the highest
step a rank was in; None for a fault applied before the job began), when
it was injected and, for flaps and outages, when it ended: as
CLOCK_MONOTONIC nanoseconds (the recorder's clock: the rows of a dump on
this machine compare with them directly) and as wall time (UTC, ISO 8601,
milliseconds) read together with them.  A fault that acts more than once
(a pause every N steps) has one episode per time; the record's injected
and ended times are its first episode's start and its last one's end.
``measured`` holds what was read around the injection: the nodes' TCP
counters, the link's state, the packets a partition dropped, the sockets
a reset aborted.

Benchmarks use these times to judge "an incident within 30 s of the
fault's start".
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any


@dataclass(frozen=True, slots=True)
class Moment:
    """One instant on both clocks (read back to back)."""

    mono_ns: int
    wall_ns: int

    @classmethod
    def now(cls) -> Moment:
        return cls(time.monotonic_ns(), time.time_ns())

    @classmethod
    def from_mono(cls, mono_ns: int, offset_ns: int) -> Moment:
        """A CLOCK_MONOTONIC time taken elsewhere (a rank), with the wall
        clock's offset from it (``wall_offset_ns``)."""
        return cls(mono_ns, mono_ns + offset_ns)


def wall_offset_ns() -> int:
    now = Moment.now()
    return now.wall_ns - now.mono_ns


def iso(wall_ns: int) -> str:
    when = datetime.fromtimestamp(wall_ns / 1e9, UTC)
    return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass(frozen=True, slots=True)
class Episode:
    """One stretch of a fault: from ``start`` to ``end`` (None: it lasted
    to the end of the run)."""

    step: int | None
    start: Moment
    end: Moment | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "at_ns": self.start.mono_ns,
            "at_wall": iso(self.start.wall_ns),
            "end_ns": self.end.mono_ns if self.end is not None else None,
            "end_wall": iso(self.end.wall_ns) if self.end is not None else None,
        }


@dataclass(frozen=True, slots=True)
class FaultRecord:
    spec: str
    how: str
    injected: bool
    step: int | None  # the step it fired at; None: before the job began, or never
    injected_ns: int | None  # CLOCK_MONOTONIC
    injected_wall: str | None  # UTC, ISO 8601
    ended_ns: int | None  # a flap's or an outage's end; None: it lasted (or never began)
    ended_wall: str | None
    episodes: list[dict[str, Any]] = field(default_factory=list)
    measured: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        spec: str,
        how: str,
        episodes: list[Episode],
        measured: dict[str, Any] | None = None,
    ) -> FaultRecord:
        first = episodes[0] if episodes else None
        end = episodes[-1].end if episodes else None
        return cls(
            spec=spec,
            how=how,
            injected=first is not None,
            step=first.step if first is not None else None,
            injected_ns=first.start.mono_ns if first is not None else None,
            injected_wall=iso(first.start.wall_ns) if first is not None else None,
            ended_ns=end.mono_ns if end is not None else None,
            ended_wall=iso(end.wall_ns) if end is not None else None,
            episodes=[e.to_json() for e in episodes],
            measured=dict(measured or {}),
        )

    def when(self) -> str:
        """For people: when it began and ended."""
        if not self.injected:
            return "never injected (the job ended or stopped before its step)"
        begun = "before the job began" if self.step is None else f"at step {self.step}"
        text = f"{begun} ({_clock(self.injected_wall)})"
        if len(self.episodes) > 1:
            text += f", {len(self.episodes)} times"
        if self.ended_wall is not None:
            text += f", ended {_clock(self.ended_wall)}"
        return text


def _clock(wall: str | None) -> str:
    """The time of day of an ISO time, as the table shows it."""
    if wall is None:
        return "?"
    return wall.split("T", 1)[-1].rstrip("Z") + " UTC"

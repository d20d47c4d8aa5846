"""A dump rewritten as if its host's monotonic clock read differently.

Hosts of a real cluster booted at different times: their CLOCK_MONOTONIC
stamps of one moment differ by hours, while their wall clocks agree.
:func:`shift_clock` moves every monotonic stamp of a recording (ring rows,
processes, communicators, the trigger, thread readings) and the monotonic
half of its clock pair by the same amount, so that the recording says the
same as before about every moment, on another host's clock.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from stallwatch.dumpers.format import read_dump, write_dump
from stallwatch.dumpers.model import Clock, Recording, Ring
from stallwatch.dumpers.readings import ThreadReading

# ring fields that are moments (0: not observed) and those that are spans
MOMENTS = frozenset(
    {
        *("ts_ns", "end_ns", "started_ns", "started_after_ns", "completed_ns"),
        *("completed_after_ns", "after_ns"),
    }
)
SPANS = frozenset({"no_ack_ns", "delay_ns"})


def _moved(value: int, delta: int) -> int:
    return value + delta if value else 0


def _ring(ring: Ring, delta: int) -> Ring:
    rows = ring.rows.copy()
    for name in rows.dtype.names or ():
        if not name.endswith("_ns"):
            continue
        assert name in MOMENTS | SPANS, f"a time field this helper does not know: {name}"
        if name in MOMENTS:
            column = rows[name]
            column[column != 0] += np.uint64(delta)
    return dataclasses.replace(ring, rows=rows)


def _reading(r: ThreadReading, delta: int) -> ThreadReading:
    procs = tuple(dataclasses.replace(p, taken_ns=_moved(p.taken_ns, delta)) for p in r.processes)
    return dataclasses.replace(r, taken_ns=_moved(r.taken_ns, delta), processes=procs)


def shift_clock(rec: Recording, delta: int) -> Recording:
    """``rec`` as its host would have recorded it with a monotonic clock
    ``delta`` ns ahead (the wall clock unchanged)."""
    assert delta >= 0, "monotonic stamps are unsigned: shift forwards"
    trigger = rec.trigger
    if trigger is not None:
        trigger = dataclasses.replace(trigger, time_ns=_moved(trigger.time_ns, delta))
    return dataclasses.replace(
        rec,
        clock=Clock(rec.clock.monotonic_ns + delta, rec.clock.realtime_ns),
        rings={name: _ring(ring, delta) for name, ring in rec.rings.items()},
        processes=tuple(
            dataclasses.replace(
                p, start_ns=_moved(p.start_ns, delta), exit_ns=_moved(p.exit_ns, delta)
            )
            for p in rec.processes
        ),
        communicators=tuple(
            dataclasses.replace(
                c, init_ns=_moved(c.init_ns, delta), destroy_ns=_moved(c.destroy_ns, delta)
            )
            for c in rec.communicators
        ),
        trigger=trigger,
        snapshots=tuple(_reading(r, delta) for r in rec.snapshots),
        links=tuple(
            dataclasses.replace(
                li, first_ns=_moved(li.first_ns, delta), gone_ns=_moved(li.gone_ns, delta)
            )
            for li in rec.links
        ),
    )


def shifted_copy(src: Path, dst: Path, deltas: dict[str, int]) -> list[Path]:
    """Every dump under ``src`` written under ``dst`` (same relative place),
    the hosts named in ``deltas`` shifted by their amount."""
    out = []
    for path in sorted(src.rglob("*.msgpack")):
        rec = read_dump(path)
        if rec.host in deltas:
            rec = shift_clock(rec, deltas[rec.host])
        target = dst / path.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        out.append(write_dump(target, rec))
    return out

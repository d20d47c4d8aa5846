"""What every recording of this host says of it, read the same way by the
agent and by a recording made without one (``recorder.positions``): the
boot it belongs to and its clock pair."""

from __future__ import annotations

import time
from pathlib import Path

from stallwatch.dumpers.model import Clock


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def sample_clock() -> Clock:
    """CLOCK_MONOTONIC and CLOCK_REALTIME read back to back: what turns the
    rings' monotonic stamps into wall time."""
    mono = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    real = time.clock_gettime_ns(time.CLOCK_REALTIME)
    return Clock(mono, real)

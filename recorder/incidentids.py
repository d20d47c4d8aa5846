"""Incident ids, and the bucket that paces the dumps clients ask for.

An incident id is ``<UTC time to the ms>-<host>-<suffix>``: it sorts by
detection time across hosts, so two nodes that detected one stall at once
converge on the smaller (``recorder.watchdog``).
"""

from __future__ import annotations

import calendar
import itertools
import re
import secrets
import time

SECOND_NS = 1_000_000_000

_HOST_UNSAFE = re.compile(r"[^A-Za-z0-9]+")
_SUFFIX_BITS = 24
# a counter from a random start: an agent never repeats a suffix (random
# ones of 24 bits did, once in about 130 runs of 500 ids); each agent starts
# at its own random point
_SUFFIXES = itertools.count(secrets.randbits(_SUFFIX_BITS))


ID_CLOCK_SLACK_NS = SECOND_NS  # clocks of two nodes, and ids to the ms


def incident_wall_ns(incident_id: str) -> int | None:
    """When an incident id says it was raised (UTC, to the ms), or None."""
    stamp = incident_id.split("-", 1)[0]
    try:
        when = calendar.timegm(time.strptime(stamp[:15], "%Y%m%dT%H%M%S"))
        ms = int(stamp[15:18])
    except ValueError:
        return None
    return when * SECOND_NS + ms * 1_000_000


def new_incident_id(host: str, wall_ns: int | None = None) -> str:
    """``<UTC time to the ms>-<host>-<suffix>``, URL-safe, about 40 characters;
    sorts by detection time across hosts (to the ms, then host, then chance).
    The suffix (6 hex digits) counts from a random start: unique within a process."""
    wall = time.time_ns() if wall_ns is None else wall_ns
    secs, ns = divmod(wall, SECOND_NS)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(secs)) + f"{ns // 1_000_000:03d}"
    name = _HOST_UNSAFE.sub("-", host).strip("-")[:16] or "host"
    suffix = next(_SUFFIXES) % (1 << _SUFFIX_BITS)
    return f"{stamp}-{name}-{suffix:06x}"


# Dumps clients may ask for (stallwatch dump, POST /dump): a burst of 3, then
# one every 20 s.  Each may displace an older requested dump (--max-dumps),
# never an incident's; peers and signals are not counted here.
CLIENT_DUMPS_BURST = 3
CLIENT_DUMP_EVERY_NS = 20 * SECOND_NS


class TokenBucket:
    """``burst`` tokens, one more every ``every_ns``."""

    def __init__(self, burst: int, every_ns: int) -> None:
        self.burst, self.every_ns = burst, every_ns
        self._tokens = float(burst)
        self._at: int | None = None

    def take(self, now_ns: int) -> int:
        """0 if a token was taken; else how long until one is there (ns)."""
        if self._at is not None:
            self._tokens = min(self.burst, self._tokens + (now_ns - self._at) / self.every_ns)
        self._at = now_ns
        if self._tokens >= 1:
            self._tokens -= 1
            return 0
        return int((1 - self._tokens) * self.every_ns)

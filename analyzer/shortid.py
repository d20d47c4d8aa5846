"""Short communicator ids, for people: the fewest leading hex digits (at
least ``MIN_HEX``) that still tell every communicator of the incident apart,
the same length for all of them, as git shortens a commit.  A short id is a
prefix of the full one, so it is copied whole from a report and found with
``comm_id_hash LIKE '0xcd50%'`` in SQL; ``analyze --wide`` and ``--json``
print the full ids, and the JSON carries each communicator's short id beside
it (one function for both: ``short_ids``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

MIN_HEX = 4
FULL_ID = re.compile(r"0x[0-9a-f]{16}")


def short_ids(full: Iterable[str]) -> dict[str, str]:
    """Each full id ("0x" and 16 hex digits) to its short form; other
    texts are left out (they are not ids)."""
    ids = sorted({h for h in full if FULL_ID.fullmatch(h)})
    digits = MIN_HEX
    while len({h[: 2 + digits] for h in ids}) < len(ids):
        digits += 1
    return {h: h[: 2 + digits] for h in ids}


def shorten(text: str, ids: Mapping[str, str]) -> str:
    """``text`` with every full id of ``ids`` in its short form."""
    if not ids:
        return text
    return FULL_ID.sub(lambda m: ids.get(m.group(0), m.group(0)), text)

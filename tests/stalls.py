"""Every incident the suite recorded in which a stall was detected, judged
again at the end of the run: none may be healthy.

The lab runs of the suite write their dumps under pytest's temporary folder.
At the end of a session (on each worker) every dump there whose trigger is a
stall the watchdog saw (a call in flight past the stall timeout, a
communicator that stopped progressing) has its incident analyzed with every
dump of the same folder and incident id; a HEALTHY verdict on it is a
failure of the run, listed with the folder (conftest.py).  Dumps that cannot
be read (tests damage some on purpose) are passed over.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

from stallwatch.analyzer.pipeline import analyze_paths
from stallwatch.analyzer.verdict import VerdictKind
from stallwatch.dumpers.errors import DumpError
from stallwatch.dumpers.format import read_dump_deferred
from stallwatch.dumpers.model import TriggerKind

STALLS = (TriggerKind.IN_FLIGHT, TriggerKind.NO_PROGRESS)
RINGS = ("nccl", "comm", "tcp", "sched", "exit", "link")  # left in the file: only the trigger


def stalled_dumps(root: Path) -> dict[Path, set[str]]:
    """Run folder -> its dumps whose trigger is a stall."""
    out: dict[Path, set[str]] = defaultdict(set)
    for path in sorted(root.rglob("*.msgpack")):
        try:
            rec, _ = read_dump_deferred(path, RINGS)
        except (DumpError, OSError):
            continue
        if rec.trigger is not None and rec.trigger.kind in STALLS:
            out[_run_folder(path, root)].add(str(path))
    return out


def _run_folder(path: Path, root: Path) -> Path:
    """The folder of the run a dump belongs to: its own, or the one above a
    lab run's folder of a node (``node<k>``)."""
    return path.parent.parent if re.fullmatch(r"node\d+", path.parent.name) else path.parent


def healthy_stalls(root: Path) -> list[str]:
    """One line per incident under ``root`` with a stalled dump judged healthy
    (each run folder analyzed whole, as its test analyzes it)."""
    out = []
    for folder, stalled in sorted(stalled_dumps(root).items()):
        for r in analyze_paths([str(folder)]).incidents:
            if stalled & set(r.incident.sources) and any(
                v.kind is VerdictKind.HEALTHY for v in r.verdicts
            ):
                out.append(f"{folder}: incident {r.incident.id} stalled and was judged healthy")
    return out

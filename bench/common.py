"""One row of the benchmark table, and the table.

Every benchmark module exposes ``figures(quick: bool) -> list[Figure]``.
Comparisons are ratios measured side by side in the same run; absolute
figures are medians over repeats.  These machines are shared and noisy.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Figure:
    name: str
    value: float
    unit: str
    target: str  # e.g. "< 0.5 s", "<= 1.3x"
    ok: bool | None  # None when there is no target to meet
    anchor: str = ""  # what it is compared against, measured in the same run

    def value_text(self) -> str:
        if self.unit == "x":
            return f"{self.value:.2f}x"
        if abs(self.value) >= 100:
            return f"{self.value:,.0f} {self.unit}"
        return f"{self.value:.3g} {self.unit}"


def median_time(fn: Callable[[], object], repeats: int = 5) -> float:
    """Median wall time of ``fn`` in seconds."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def render(figures: Sequence[Figure]) -> str:
    head = ("figure", "value", "target", "ok", "anchor (same run)")
    rows = [
        (
            f.name,
            f.value_text(),
            f.target,
            "-" if f.ok is None else ("yes" if f.ok else "NO"),
            f.anchor,
        )
        for f in figures
    ]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [head, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def rss_kb(pid: int) -> int:
    """A process's resident memory (VmRSS), 0 once it is gone."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def children(pid: int) -> list[int]:
    """The pids of a process's children (those of every one of its threads)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out

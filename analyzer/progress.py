"""Progress of the long stages of ``analyze`` (and of ``query``, which
reads dumps the same way) on stderr, for people waiting.

On a terminal, a rich progress bar that disappears when the stage ends.
Elsewhere (a log, a pipe), a line at most every ``PROGRESS_EVERY_S``
("stallwatch analyze: loaded 120/2048 files") and the final count when any
line was shown.  Steps may come from several threads.
"""

from __future__ import annotations

import sys
import threading
import time

from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as Bar

from stallwatch.query.output import console

PROGRESS_EVERY_S = 0.5


class Progress:
    def __init__(self, template: str, total: int, enabled: bool, command: str = "analyze") -> None:
        """``template`` takes the count and the total: "loaded {}/{} files";
        ``command`` names who speaks."""
        self.template = template
        self.command = command
        self.total = total
        self.enabled = enabled
        self.count = 0
        self.shown = -1
        self.last = time.monotonic()
        self._lock = threading.Lock()
        self._bar: Bar | None = None
        if enabled and sys.stderr.isatty():
            self._bar = _bar(template, command)
            self._task = self._bar.add_task("", total=total)
            self._bar.start()

    def step(self, n: int = 1) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.advance(self._task, n)  # rich locks and redraws on its own thread
            return
        with self._lock:
            self.count += n
            now = time.monotonic()
            if now - self.last >= PROGRESS_EVERY_S:
                self.last = now
                self._show()

    def close(self) -> None:
        """The final count, if a line was shown and it is not the last one."""
        if self._bar is not None:
            self._bar.stop()
            return
        with self._lock:
            if self.enabled and self.shown >= 0 and self.shown != self.count:
                self._show()

    def _show(self) -> None:
        self.shown = self.count
        text = self.template.format(self.count, self.total)
        print(f"stallwatch {self.command}: {text}", file=sys.stderr, flush=True)


def _bar(template: str, command: str) -> Bar:
    """A transient bar: "stallwatch analyze: loaded files ━━━━ 120/2048 0:00:03"."""
    what = template.replace("{}/{}", "").replace("  ", " ").strip()
    return Bar(
        TextColumn(f"stallwatch {command}: {what}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console(sys.stderr, terminal=True),
        transient=True,
    )

"""The lab's processes' logs: what one says last, for one-line errors."""

from __future__ import annotations

from pathlib import Path


def last_line(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return lines[-1] if lines else "(empty log)"

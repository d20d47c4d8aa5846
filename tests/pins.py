"""Pin folders for tests: unique to this test session, and checked at its end.

Every pinned recording a test makes goes under ``PIN_ROOT`` in a folder
named by ``pin_dir``; the suite's conftest fails the session if any of its
folders is left behind (and removes them)."""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path

PIN_ROOT = Path("/sys/fs/bpf/stallwatch")
SESSION_PREFIX = f"test-{os.getpid()}-"


def pin_dir(tag: str) -> Path:
    return PIN_ROOT / f"{SESSION_PREFIX}{tag}-{secrets.token_hex(3)}"


def leftovers() -> list[Path]:
    if not PIN_ROOT.is_dir():
        return []
    return sorted(p for p in PIN_ROOT.iterdir() if p.name.startswith(SESSION_PREFIX))


def remove(path: Path) -> None:
    """Unpin a folder (bpffs: unlink each pin, then the folders)."""
    shutil.rmtree(path, ignore_errors=True)

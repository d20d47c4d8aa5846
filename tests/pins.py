"""Pin folders for tests: unique to this test session, and checked at its end.

Every pinned recording a test makes goes under ``PIN_ROOT`` in a folder
named by ``pin_dir``; the suite's conftest fails the session if any of its
folders is left behind (and removes them).  So does the agent's default
folder appearing during the session (an agent started with neither
``--pin-dir`` nor ``--no-pin``), and a folder of a benchmark run in it."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from pathlib import Path

PIN_ROOT = Path("/sys/fs/bpf/stallwatch")
DEFAULT = PIN_ROOT / "agent"  # the agent's default --pin-dir
SESSION_PREFIX = f"test-{os.getpid()}-"
BENCH_PREFIX = f"bench-{os.getpid()}-"  # bench.bench_recorder's folders, run in this process
_DEFAULT_WAS_THERE = DEFAULT.exists()
_ROOT_WAS_THERE = PIN_ROOT.exists()


def pin_dir(tag: str) -> Path:
    return PIN_ROOT / f"{SESSION_PREFIX}{tag}-{secrets.token_hex(3)}"


def leftovers() -> list[Path]:
    if not PIN_ROOT.is_dir():
        return []
    ours = (SESSION_PREFIX, BENCH_PREFIX)
    left = [p for p in PIN_ROOT.iterdir() if p.name.startswith(ours)]
    if DEFAULT.exists() and not _DEFAULT_WAS_THERE:
        left.append(DEFAULT)
    return sorted(left)


def remove(path: Path) -> None:
    """Unpin a folder (bpffs: unlink each pin, then the folders)."""
    shutil.rmtree(path, ignore_errors=True)


def tidy_root() -> None:
    """Remove ``PIN_ROOT`` if this session made it and left it empty."""
    if not _ROOT_WAS_THERE:
        with contextlib.suppress(OSError):  # not empty: another run pins there
            PIN_ROOT.rmdir()

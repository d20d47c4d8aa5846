"""Builds the lab's NCCL-compatible ``libnccl.so.2`` from ``lab/csrc`` with the
system C compiler (plus a ``libnccl.so`` link), into ``build/lab/`` of a
source checkout, or, installed, into ``$XDG_CACHE_HOME/stallwatch/lab``
(``~/.cache``); ``STALLWATCH_LAB_BUILD`` names another folder.  Rebuilds only
when a source (or this file) is newer than the library; concurrent callers
serialise on a lock file.

``python -m stallwatch.lab.build`` builds (or says it is up to date);
``ensure_built()`` does the same from Python and returns the library's path.

Flags: entry points must begin with ``push %rbp`` like real libnccl's, so that
a uprobe on them is emulated rather than single-stepped: hence frame pointers,
no CET ``endbr64`` (``-fcf-protection=none``), and no shrink-wrapping or
sibling calls that could move the prologue or replace it with a jump.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

from stallwatch.dumpers.errors import LabError

LAB_DIR = Path(__file__).resolve().parent
SOURCE_DIR = LAB_DIR / "csrc"


def _build_dir() -> Path:
    named = os.environ.get("STALLWATCH_LAB_BUILD")
    if named:
        return Path(named)
    checkout = LAB_DIR.parent
    if (checkout / "pyproject.toml").is_file():
        return checkout / "build" / "lab"
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "stallwatch" / "lab"


BUILD_DIR = _build_dir()
LIB_NAME = "libnccl.so.2"
LINK_NAME = "libnccl.so"
CFLAGS = (
    "-std=gnu11",
    "-O2",
    "-g",
    "-fPIC",
    "-shared",
    "-pthread",
    "-fno-omit-frame-pointer",
    "-fcf-protection=none",
    "-fno-shrink-wrap",
    "-fno-optimize-sibling-calls",
    "-fno-schedule-insns2",
    "-mno-omit-leaf-frame-pointer",
    "-fvisibility=hidden",
    "-Wall",
    "-Wextra",
    "-Wno-unused-parameter",
    f"-Wl,-soname,{LIB_NAME}",
)


def library_path() -> Path:
    """Where the built library lives (whether or not it is built yet)."""
    return BUILD_DIR / LIB_NAME


def sources() -> list[Path]:
    return sorted(SOURCE_DIR.glob("*.c"))


def _inputs() -> list[Path]:
    return [*sources(), *SOURCE_DIR.glob("*.h"), Path(__file__).resolve()]


def is_up_to_date() -> bool:
    lib = library_path()
    if not lib.exists():
        return False
    newest = max(p.stat().st_mtime_ns for p in _inputs())
    return lib.stat().st_mtime_ns >= newest


def _compiler() -> str:
    cc = os.environ.get("CC", "gcc")
    if shutil.which(cc) is None:
        raise LabError(f"C compiler {cc!r} not found (install gcc, or set CC)")
    return cc


def _compile(out: Path) -> None:
    cmd = [_compiler(), *CFLAGS, "-o", str(out), *map(str, sources())]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        detail = proc.stderr.strip().splitlines()[:20]
        raise LabError(f"building {LIB_NAME} failed: {' '.join(cmd)}\n" + "\n".join(detail))


def ensure_built() -> Path:
    """Builds the library if any source is newer; returns its path."""
    lib = library_path()
    if is_up_to_date():
        return lib
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    with open(BUILD_DIR / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_up_to_date():
            tmp = BUILD_DIR / f".{LIB_NAME}.{os.getpid()}.tmp"
            try:
                _compile(tmp)
                os.replace(tmp, lib)
            finally:
                tmp.unlink(missing_ok=True)
        link = BUILD_DIR / LINK_NAME
        if not link.is_symlink() or os.readlink(link) != LIB_NAME:
            link.unlink(missing_ok=True)
            link.symlink_to(LIB_NAME)
    return lib


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m stallwatch.lab.build", description=f"Build the lab's {LIB_NAME}."
    )
    parser.parse_args(argv)
    fresh = is_up_to_date()
    try:
        lib = ensure_built()
    except LabError as exc:
        print(f"lab.build: {exc}", file=sys.stderr)
        return 2
    print(f"lab.build: {lib} {'up to date' if fresh else 'built'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

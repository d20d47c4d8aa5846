"""Builds the lab's libraries with the system C compiler, into ``build/lab/``
of a source checkout, or, installed, into ``$XDG_CACHE_HOME/stallwatch/lab``
(``~/.cache``); ``STALLWATCH_LAB_BUILD`` names another folder:

- ``libnccl.so.2`` (plus a ``libnccl.so`` link) from ``lab/csrc/*.c``: NCCL's
  public ABI;
- ``libcudart.so.12`` from ``lab/csrc/cudart/*.c``: the CUDA runtime's stream
  and event ABI, whose streams the lab's libnccl runs its collectives on (it
  finds the runtime the process loaded, or the one beside it).

Each is rebuilt only when one of its sources (or this file) is newer;
concurrent callers serialise on a lock file.

``python -m stallwatch.lab.build`` builds (or says they are up to date); ``ensure_built()``
does the same from Python and returns libnccl's path, ``ensure_cudart()`` the
runtime's.

Flags: entry points must begin with ``push %rbp`` like the real libraries',
so that a uprobe on them is emulated rather than single-stepped: hence frame
pointers, no CET ``endbr64`` (``-fcf-protection=none``), and no shrink-wrapping
or sibling calls that could move the prologue or replace it with a jump.
``ensure_built(frame_pointers=False)`` builds a variant of libnccl without
frame pointers into ``build/lab/nofp/`` (for tests that read stacks without
them); its entry points need not begin with ``push``.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from stallwatch.dumpers.errors import LabError

LAB_DIR = Path(__file__).resolve().parent
SOURCE_DIR = LAB_DIR / "csrc"
CUDART_DIR = SOURCE_DIR / "cudart"


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
NOFP_DIR = BUILD_DIR / "nofp"
LIB_NAME = "libnccl.so.2"
LINK_NAME = "libnccl.so"
CUDART_NAME = "libcudart.so.12"
COMMON_FLAGS = (
    "-std=gnu11",
    "-O2",
    "-g",
    "-fPIC",
    "-shared",
    "-pthread",
    "-fcf-protection=none",
    "-fvisibility=hidden",
    "-Wall",
    "-Wextra",
    "-Wno-unused-parameter",
)
FRAME_POINTER_FLAGS = (
    "-fno-omit-frame-pointer",
    "-fno-shrink-wrap",
    "-fno-optimize-sibling-calls",
    "-fno-schedule-insns2",
    "-mno-omit-leaf-frame-pointer",
)
NO_FRAME_POINTER_FLAGS = ("-fomit-frame-pointer", "-momit-leaf-frame-pointer")
CFLAGS = (*COMMON_FLAGS, *FRAME_POINTER_FLAGS, f"-Wl,-soname,{LIB_NAME}")


@dataclass(frozen=True, slots=True)
class Target:
    """One library: where its sources are and how it is linked."""

    name: str
    out_dir: Path
    source_dir: Path
    flags: tuple[str, ...]

    @property
    def path(self) -> Path:
        return self.out_dir / self.name

    def sources(self) -> list[Path]:
        return sorted(self.source_dir.glob("*.c"))

    def inputs(self) -> list[Path]:
        headers = [*SOURCE_DIR.glob("*.h"), *self.source_dir.glob("*.h")]
        maps = list(self.source_dir.glob("*.map"))
        return [*self.sources(), *headers, *maps, Path(__file__).resolve()]


def _nccl_target(frame_pointers: bool) -> Target:
    fp = FRAME_POINTER_FLAGS if frame_pointers else NO_FRAME_POINTER_FLAGS
    # the runtime is found beside the library (or one folder up, for variants)
    rpath = "-Wl,-rpath,$ORIGIN:$ORIGIN/.."
    flags = (*COMMON_FLAGS, *fp, f"-Wl,-soname,{LIB_NAME}", rpath, "-ldl")
    return Target(LIB_NAME, BUILD_DIR if frame_pointers else NOFP_DIR, SOURCE_DIR, flags)


CUDART = Target(
    CUDART_NAME,
    BUILD_DIR,
    CUDART_DIR,
    (
        *COMMON_FLAGS,
        *FRAME_POINTER_FLAGS,
        f"-I{SOURCE_DIR}",
        f"-Wl,-soname,{CUDART_NAME}",
        f"-Wl,--version-script={CUDART_DIR / 'libcudart.map'}",
    ),
)


def library_path(frame_pointers: bool = True) -> Path:
    """Where the built libnccl lives (whether or not it is built yet)."""
    return _nccl_target(frame_pointers).path


def cudart_path() -> Path:
    """Where the built runtime lives (whether or not it is built yet)."""
    return CUDART.path


def sources() -> list[Path]:
    return _nccl_target(True).sources()


def _fresh(target: Target) -> bool:
    if not target.path.exists():
        return False
    newest = max(p.stat().st_mtime_ns for p in target.inputs())
    return target.path.stat().st_mtime_ns >= newest


def is_up_to_date(frame_pointers: bool = True) -> bool:
    return _fresh(_nccl_target(frame_pointers)) and _fresh(CUDART)


def _compiler() -> str:
    cc = os.environ.get("CC", "gcc")
    if shutil.which(cc) is None:
        raise LabError(f"C compiler {cc!r} not found (install gcc, or set CC)")
    return cc


def _compile(target: Target, out: Path) -> None:
    cmd = [_compiler(), *target.flags, "-o", str(out), *map(str, target.sources())]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        detail = proc.stderr.strip().splitlines()[:20]
        raise LabError(f"building {target.name} failed: {' '.join(cmd)}\n" + "\n".join(detail))


def _build(target: Target) -> None:
    """Builds ``target`` if it is stale; the caller holds the lock."""
    if _fresh(target):
        return
    target.out_dir.mkdir(parents=True, exist_ok=True)
    tmp = target.out_dir / f".{target.name}.{os.getpid()}.tmp"
    try:
        _compile(target, tmp)
        os.replace(tmp, target.path)
    finally:
        tmp.unlink(missing_ok=True)


def ensure_built(frame_pointers: bool = True) -> Path:
    """Builds the libraries if any source is newer; returns libnccl's path
    (``frame_pointers=False``: the variant without frame pointers)."""
    nccl = _nccl_target(frame_pointers)
    if _fresh(nccl) and _fresh(CUDART):
        return nccl.path
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    with open(BUILD_DIR / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _build(CUDART)
        _build(nccl)
        link = nccl.out_dir / LINK_NAME
        if not link.is_symlink() or os.readlink(link) != LIB_NAME:
            link.unlink(missing_ok=True)
            link.symlink_to(LIB_NAME)
    return nccl.path


def ensure_cudart() -> Path:
    """Builds the libraries if needed; returns the runtime's path."""
    ensure_built()
    return CUDART.path


USAGE = f"usage: python -m stallwatch.lab.build\n\nBuild the lab's {LIB_NAME} and {CUDART_NAME}."


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv:  # it takes no options: print how to call it, as a parser would
        asked = argv[0] in ("-h", "--help")
        print(USAGE, file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    fresh = is_up_to_date()
    try:
        lib = ensure_built()
    except LabError as exc:
        print(f"lab.build: {exc}", file=sys.stderr)
        return 2
    state = "up to date" if fresh else "built"
    print(f"lab.build: {lib} and {CUDART.path.name} {state}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

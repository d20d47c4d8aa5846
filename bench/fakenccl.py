"""Build the tiny NCCL-ABI library and C driver of ``bench/csrc`` (recorder
tests and benchmarks): ``libnccl.so.2`` whose entry points begin with
``push``, and ``ncclloop`` linked against it (or against another library).
Both take NCCL's declarations from the lab's header, ``lab/csrc/labnccl.h``."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
NCCL_HEADER_DIR = Path(__file__).resolve().parent.parent / "lab" / "csrc"  # labnccl.h
LIB_FLAGS = (
    "-O0",
    "-fno-omit-frame-pointer",
    "-fcf-protection=none",
    "-shared",
    "-fPIC",
    f"-I{NCCL_HEADER_DIR}",
    "-Wl,-soname,libnccl.so.2",
)


@dataclass(frozen=True, slots=True)
class FakeNccl:
    lib: Path  # .../libnccl.so.2
    loop: Path  # the driver, linked against ``lib``


def _digest() -> str:
    h = hashlib.sha256()
    for path in (CSRC / "fakenccl.c", CSRC / "ncclloop.c", NCCL_HEADER_DIR / "labnccl.h"):
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr}")


def link_loop(lib: Path, out: Path) -> Path:
    """``ncclloop`` linked against ``lib`` (any libnccl.so.2 with NCCL's ABI)."""
    cc = shutil.which("cc") or "gcc"
    _run(
        [
            cc,
            "-O2",
            f"-I{NCCL_HEADER_DIR}",
            "-o",
            str(out),
            str(CSRC / "ncclloop.c"),
            str(lib),
            f"-Wl,-rpath,{lib.parent}",
        ]
    )
    return out


def build(root: Path | None = None) -> FakeNccl:
    """Build once per source version into ``root`` (default: the temp dir)."""
    base = (root or Path(tempfile.gettempdir())) / f"stallwatch-fakenccl-{_digest()}"
    lib, loop = base / "libnccl.so.2", base / "ncclloop"
    if lib.exists() and loop.exists():
        return FakeNccl(lib, loop)
    work = Path(tempfile.mkdtemp(prefix="fakenccl-", dir=base.parent))
    cc = shutil.which("cc") or "gcc"
    _run([cc, *LIB_FLAGS, "-o", str(work / "libnccl.so.2"), str(CSRC / "fakenccl.c")])
    link_loop(work / "libnccl.so.2", work / "ncclloop")
    # Rebuild the driver at its final place so its rpath is right.
    try:
        work.rename(base)
    except OSError:  # another process won the race
        shutil.rmtree(work, ignore_errors=True)
        return FakeNccl(lib, loop)
    link_loop(lib, loop)
    return FakeNccl(lib, loop)


PRIVATE_SONAME = "libswbenchcalls.so"


def build_private(root: Path) -> FakeNccl:
    """A copy of its own in ``root``, named so that no NCCL discovery finds
    it (neither ``libnccl.so*`` nor its soname): on a shared machine, other
    agents attach their probes to the shared build's file too, and a call
    then pays for theirs."""
    cc = shutil.which("cc") or "gcc"
    lib = root / PRIVATE_SONAME
    flags = [f for f in LIB_FLAGS if not f.startswith("-Wl,-soname")]
    _run([cc, *flags, f"-Wl,-soname,{PRIVATE_SONAME}", "-o", str(lib), str(CSRC / "fakenccl.c")])
    return FakeNccl(lib, link_loop(lib, root / "ncclloop"))

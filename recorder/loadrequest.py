"""Asking a short-lived process to compile the BPF programs and pin them.

BCC compiles with LLVM, and LLVM's memory is never given back: the
long-lived agent does not compile.  ``load_outside`` runs
``recorder.loader`` as a process of its own (``python -m
stallwatch.recorder.loader``, the request as JSON on stdin) and waits for
it; a refusal comes back as one JSON line on stdout, raised here as the
error it was.  Its log lines go to the agent's stderr.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from stallwatch.dumpers import errors
from stallwatch.dumpers.errors import ProbeError, StallwatchError

from .pinning import PinOptions

LOAD_TIMEOUT_S = 300.0  # BCC compiling on a loaded machine
LOADER_MODULE = "stallwatch.recorder.loader"
# errors the loader may report, by class name (anything else is a ProbeError)
_ERRORS: dict[str, type[StallwatchError]] = {
    cls.__name__: cls
    for cls in vars(errors).values()
    if isinstance(cls, type) and issubclass(cls, StallwatchError)
}


def load_outside(
    pins: PinOptions,
    ring_slots: int,
    runq_threshold_ns: int,
    about: dict[str, Any],
    cache_dir: Path | None = None,
    raw_tracepoints: bool = True,
) -> None:
    """Compile and pin in a short-lived process; raise what it refused with."""
    request = {
        "pin_dir": str(pins.path),
        "replace": pins.replace,
        "ring_slots": ring_slots,
        "runq_threshold_ns": runq_threshold_ns,
        "about": about,
        "cache_dir": str(cache_dir) if cache_dir is not None else None,
        "raw_tracepoints": raw_tracepoints,
    }
    argv = [sys.executable, "-m", LOADER_MODULE]
    try:
        done = subprocess.run(
            argv,
            input=json.dumps(request),
            stdout=subprocess.PIPE,
            text=True,
            timeout=LOAD_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ProbeError(f"compiling the BPF programs ({' '.join(argv)}): {exc}") from None
    if done.returncode == 0:
        return
    raise refusal(done.stdout, done.returncode)


def refusal(out: str, code: int) -> StallwatchError:
    """The error a loader's last line of output reports."""
    try:
        doc = json.loads(out.strip().splitlines()[-1])
        cls = _ERRORS.get(str(doc["kind"]), ProbeError)
        return cls(str(doc["error"]))
    except (IndexError, KeyError, TypeError, ValueError):
        return ProbeError(f"compiling the BPF programs failed (exit code {code})")

"""Compile the BPF programs and pin them, in a process that then exits.

BCC compiles with LLVM, and LLVM's memory is never given back: the
long-lived agent does not compile.  ``load_outside`` runs this module as a
short-lived process (``python -m stallwatch.recorder.loader``, the request
as JSON on stdin); it compiles, then builds the pin set at the agent's
``--pin-dir`` (or finds the one there of the same layout, or refuses one of
another layout, as ``recorder.pinning`` says) and exits; the agent adopts
the pins.  Its log lines go to the agent's stderr; a refusal comes back as
one JSON line on stdout, raised in the agent as the error it was.

An agent restarted over pins of the very same build (``probes.build_key``:
the BPF sources, the flags, the kernel) adopts them without running this.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

from stallwatch.dumpers import errors
from stallwatch.dumpers.errors import PinError, ProbeError, StallwatchError

from .pinning import PinOptions

log = logging.getLogger("stallwatch.record")

LOAD_TIMEOUT_S = 300.0  # BCC compiling on a loaded machine
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
) -> None:
    """Compile and pin in a short-lived process; raise what it refused with."""
    request = {
        "pin_dir": str(pins.path),
        "replace": pins.replace,
        "ring_slots": ring_slots,
        "runq_threshold_ns": runq_threshold_ns,
        "about": about,
        "cache_dir": str(cache_dir) if cache_dir is not None else None,
    }
    argv = [sys.executable, "-m", "stallwatch.recorder.loader"]
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
    raise _refusal(done.stdout, done.returncode)


def _refusal(out: str, code: int) -> StallwatchError:
    try:
        doc = json.loads(out.strip().splitlines()[-1])
        cls = _ERRORS.get(str(doc["kind"]), ProbeError)
        return cls(str(doc["error"]))
    except (IndexError, KeyError, TypeError, ValueError):
        return ProbeError(f"compiling the BPF programs failed (exit code {code})")


def _load(request: dict[str, Any]) -> None:
    from .probes import Probes, RingSizes

    pins = PinOptions(Path(request["pin_dir"]), bool(request["replace"]))
    sizes = RingSizes.from_nccl(int(request["ring_slots"]))
    cache = request.get("cache_dir")
    probes = Probes(
        sizes,
        int(request["runq_threshold_ns"]),
        pins=pins,
        about=request["about"],
        cache_dir=Path(cache) if cache else None,
    )
    probes.close()  # the recording stays pinned, for the agent


def main() -> int:
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format="%(asctime)s stallwatch record: %(levelname)s %(message)s",
    )
    try:
        _load(json.loads(sys.stdin.read()))
    except StallwatchError as exc:
        print(json.dumps({"kind": type(exc).__name__, "error": str(exc)}))
        return 2
    except (KeyError, TypeError, ValueError) as exc:
        print(json.dumps({"kind": PinError.__name__, "error": f"bad load request: {exc}"}))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

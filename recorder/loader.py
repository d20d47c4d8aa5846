"""Compile the BPF programs and pin them, in a process that then exits.

Run by ``recorder.loadrequest.load_outside`` (``python -m
stallwatch.recorder.loader``, the request as JSON on stdin): it compiles,
then builds the pin set at the agent's ``--pin-dir`` (or finds the one
there of the same layout, or refuses one of another layout, as
``recorder.pinning`` says) and exits; the agent adopts the pins.  A refusal
goes out as one JSON line on stdout.

An agent restarted over pins of the very same build (``bpfbuild.build_key``:
the BPF sources, the flags, the kernel) adopts them without running this.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

from stallwatch.dumpers.errors import PinError, StallwatchError

from .bpfbuild import RingSizes
from .pinning import PinOptions
from .probes import Probes


def _load(request: dict[str, Any]) -> None:
    pins = PinOptions(Path(request["pin_dir"]), bool(request["replace"]))
    sizes = RingSizes.from_nccl(int(request["ring_slots"]))
    cache = request.get("cache_dir")
    probes = Probes(
        sizes,
        int(request["runq_threshold_ns"]),
        pins=pins,
        about=request["about"],
        cache_dir=Path(cache) if cache else None,
        raw_tracepoints=bool(request.get("raw_tracepoints", True)),
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

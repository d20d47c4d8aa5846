"""A do-nothing uprobe+uretprobe pair on one symbol: the physical floor the
benchmark compares the agent's probes with, attached the way the agent's
are (uprobe_multi links, else perf-event uprobes)."""

from __future__ import annotations

import logging
from pathlib import Path

from stallwatch.dumpers.errors import ProbeError

from . import bpfsys, discovery
from .bccmodule import BccModule, libbcc_name, short
from .uprobekinds import LinkKind
from .uprobes import PerfUprobes, close_links, uprobe_multi_link

log = logging.getLogger("stallwatch.record")

PROGRAM = "handle_noop"


class BareProbe:
    """``source`` is a C file defining ``handle_noop`` (the benchmark keeps
    its own)."""

    def __init__(self, path: str, symbol: str, source: Path) -> None:
        self._links: list[int] = []
        self.module = BccModule(src_file=source)
        fn = discovery.elf_functions(path, [symbol]).get(symbol)
        if fn is None:
            raise ProbeError(f"cannot attach {PROGRAM} to {symbol} in {path}: no such function")
        self.attach_method = "uprobe_multi"
        try:
            prog = self.module.load(
                PROGRAM, bpfsys.BPF_PROG_TYPE_KPROBE, bpfsys.BPF_TRACE_UPROBE_MULTI
            )
            for kind in LinkKind:
                self._links.append(uprobe_multi_link(prog, path, [fn.file_offset], [0], kind))
        except (ProbeError, OSError) as exc:
            close_links(self._links)
            self._links = []
            log.info("bare probe: no uprobe_multi (%s), perf-event uprobes", short(exc))
            # one loaded for uprobe_multi cannot be attached to a perf event
            self.module.forget(PROGRAM)
            self._attach_perf(path, fn.file_offset)

    def _attach_perf(self, path: str, offset: int) -> None:
        self.attach_method = "perf event"
        perf = PerfUprobes(libbcc_name())
        try:
            prog = self.module.load(PROGRAM, bpfsys.BPF_PROG_TYPE_KPROBE)
            for kind in LinkKind:
                perf.attach(prog, path, offset, kind)
        except (ProbeError, OSError) as exc:
            close_links(perf.fds)
            raise ProbeError(f"cannot attach {PROGRAM} in {path}: {short(exc)}") from exc
        self._links += perf.fds

    def close(self) -> None:
        close_links(self._links)
        self._links = []
        self.module.cleanup()

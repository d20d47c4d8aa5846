"""The programs of ``bpf/`` on kernel hooks: tracepoints and raw tracepoints,
how each is attached (a link that can be pinned), and how many of its runs
the kernel skipped.

The kernel skips a *tracepoint*'s program whenever any other tracing
program (a tracepoint's, a kprobe's, a perf event's, another tool's) is
running on that CPU: a softirq's retransmit that arrives in the middle of
one is not seen.  It skips a *raw tracepoint*'s program only when that very
program would run inside itself.  Since Linux 6.7 it counts each skip in
the program's ``recursion_misses`` (``bpf_prog_info``); before, the field
(5.12 on) counted only trampoline programs' recursions, and a tracepoint's
0 there meant nothing: the count is unknown (None), never 0.

A hook's program is named by BCC's convention: ``tracepoint__<category>__
<event>`` (``TRACEPOINT_PROBE``) or ``raw_tracepoint__<event>``
(``RAW_TRACEPOINT_PROBE``); a raw tracepoint that fires in a process's
context and in softirq has a second program, ``raw_tracepoint__<event>__
nested``, attached after the first, for the events the kernel skipped the
first for (bpf/tcp.c, RAW_PAIR): of the first's skipped runs, ``caught``
says how many the second ran for.  Pinned, a link is ``tp-<category>-
<event>``, ``rtp-<event>`` or ``rtp-<event>-nested``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from stallwatch.dumpers.model import ProgramMisses

from . import bpfsys

TRACEPOINT_PREFIX = "tracepoint__"
RAW_PREFIX = "raw_tracepoint__"
SECOND = "__nested"  # a hook's second program: its name's suffix
TRACEPOINT, RAW = "tracepoint", "raw_tracepoint"  # attachments, as dumps name them
MISSES_COUNTED_SINCE = (6, 7)
TRACEFS = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing"))


@dataclass(frozen=True, slots=True)
class Hook:
    """One program on one kernel hook."""

    program: str
    event: str
    category: str = ""  # a tracepoint's; a raw tracepoint is named by its event alone

    @property
    def second(self) -> bool:
        """The second program of a hook (attached after the first)."""
        return self.program.endswith(SECOND)

    @property
    def attachment(self) -> str:
        return TRACEPOINT if self.category else RAW

    @property
    def prog_type(self) -> int:
        return (
            bpfsys.BPF_PROG_TYPE_TRACEPOINT
            if self.category
            else bpfsys.BPF_PROG_TYPE_RAW_TRACEPOINT
        )

    @property
    def pin_name(self) -> str:
        if self.category:
            return f"tp-{self.category}-{self.event}"
        return f"rtp-{self.event}-nested" if self.second else f"rtp-{self.event}"

    @property
    def cache_link(self) -> tuple[str, str]:
        """How the compile cache names the attachment."""
        if self.category:
            return (TRACEPOINT, f"{self.category}:{self.event}")
        return (RAW, self.event)

    def attach(self, prog_fd: int) -> int:
        """The link of ``prog_fd`` on this hook (OSError from the kernel)."""
        if self.category:
            return bpfsys.tracepoint_link(prog_fd, self.category, self.event)
        return bpfsys.raw_tracepoint_open(prog_fd, self.event)


def hook_of_function(name: str) -> Hook | None:
    """The hook a module's function is for, by its name (None: no hook's)."""
    if name.startswith(TRACEPOINT_PREFIX):
        category, _, event = name[len(TRACEPOINT_PREFIX) :].partition("__")
        return Hook(name, event, category)
    if name.startswith(RAW_PREFIX):
        return Hook(name, name[len(RAW_PREFIX) :].removesuffix(SECOND))
    return None


def in_order(hooks: list[Hook]) -> list[Hook]:
    """Hooks in the order to attach them: a hook's second program after its
    first (the kernel runs a tracepoint's programs in attach order)."""
    return sorted(hooks, key=lambda h: h.second)


def hook_of_cache(program: str, link: tuple[str, str]) -> Hook | None:
    """The hook of a compile cache's entry (None: not a kernel hook's)."""
    kind, target = link
    if kind == TRACEPOINT:
        category, _, event = target.partition(":")
        return Hook(program, event, category)
    if kind == RAW:
        return Hook(program, target)  # a second program: named so
    return None


def hook_of_pin(pin: str) -> Hook | None:
    """The hook a pinned link is on, by its pin name (its program named as
    BCC names it)."""
    if pin.startswith("tp-"):
        category, _, event = pin[3:].partition("-")
        return Hook(f"{TRACEPOINT_PREFIX}{category}__{event}", event, category)
    if pin.startswith("rtp-"):
        event = pin[4:].removesuffix("-nested")
        return Hook(RAW_PREFIX + event + (SECOND if event != pin[4:] else ""), event)
    return None


def kernel_release(release: str | None = None) -> tuple[int, int]:
    """(major, minor) of the running kernel ("6.18.44-..." -> (6, 18))."""
    text = release if release is not None else os.uname().release
    parts = text.split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (IndexError, ValueError):
        return 0, 0


def misses_counted(release: str | None = None) -> bool:
    """Whether this kernel counts a tracing program's skipped runs."""
    return kernel_release(release) >= MISSES_COUNTED_SINCE


class Attached:
    """The hooks' programs as the kernel holds them (by id: the recording
    may have been made by another process and adopted)."""

    def __init__(self) -> None:
        self._ids: dict[Hook, int] = {}

    def add(self, hook: Hook, prog_fd: int) -> None:
        self._ids[hook] = bpfsys.prog_info(prog_fd).id

    def add_id(self, hook: Hook, prog_id: int) -> None:
        self._ids[hook] = prog_id

    def misses(self) -> tuple[ProgramMisses, ...]:
        """Each hook's program and the runs the kernel skipped (None:
        unknown, on kernels that do not count them, or a program gone)."""
        counted = misses_counted()
        out = []
        for hook, prog_id in sorted(self._ids.items(), key=lambda kv: (kv[0].event, kv[0].second)):
            misses = _recursion_misses(prog_id) if counted and prog_id else None
            out.append(ProgramMisses(hook.program, hook.event, hook.attachment, misses))
        return tuple(out)


def _recursion_misses(prog_id: int) -> int | None:
    try:
        fd = bpfsys.prog_fd_by_id(prog_id)
    except OSError:
        return None
    try:
        return bpfsys.prog_info(fd).recursion_misses
    except OSError:
        return None
    finally:
        os.close(fd)


def linked_prog(links: Path, name: str) -> int:
    """The id of the program a pinned link holds (0: unreadable)."""
    try:
        fd = bpfsys.obj_get(links / name)
    except OSError:
        return 0
    try:
        return bpfsys.link_prog_id(fd)
    except OSError:
        return 0
    finally:
        os.close(fd)


def pinned(folder: Path, names: set[str]) -> Attached:
    """The hooks of a pinned recording, by its links' pin names."""
    out = Attached()
    for name in sorted(names):
        hook = hook_of_pin(name)
        if hook is not None:
            out.add_id(hook, linked_prog(folder / "links", name))
    return out


def tracepoint_fields(category: str, event: str) -> set[str]:
    """The field names of a tracepoint on this kernel (empty: unknown)."""
    for root in TRACEFS:
        try:
            text = (root / "events" / category / event / "format").read_text()
        except OSError:
            continue
        return {m.split(";")[0].split()[-1].split("[")[0] for m in text.split("field:")[1:]}
    return set()

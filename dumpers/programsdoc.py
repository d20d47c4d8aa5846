"""The ``programs`` section of a dump (format version 10): the BPF programs
on kernel hooks and the runs of each that the kernel skipped
(``dumpers.model.ProgramMisses``), as msgpack, and their validating reader.

Layout, every key required, no other allowed; ``null`` is unknown::

    "programs": [{"program": str, "hook": str,
                  "attachment": "raw_tracepoint" | "tracepoint",
                  "misses": u64 | null, "caught": u64 | null}, ...]

``misses`` is null where the kernel does not count skipped runs (before
Linux 6.7): unknown, never 0.  ``caught``: of them, the events the hook's
second program (``<program>__nested``) ran for instead; null for a program
that has none.
"""

from __future__ import annotations

from typing import NoReturn, Protocol

from .model import ProgramMisses

ATTACHMENTS = ("raw_tracepoint", "tracepoint")
_KEYS = ("program", "hook", "attachment", "misses", "caught")
U64 = (0, 2**64 - 1)


class Checker(Protocol):
    """What the reader needs of the dump reader's field checker."""

    def fail(self, path: str, problem: str) -> NoReturn: ...

    def map(self, obj: object, path: str, keys: tuple[str, ...] | None) -> dict[str, object]: ...

    def array(self, obj: object, path: str) -> list[object]: ...

    def opt_int(self, obj: object, path: str, bounds: tuple[int, int]) -> int | None: ...

    def string(self, obj: object, path: str) -> str: ...


def programs_doc(programs: tuple[ProgramMisses, ...]) -> list[dict[str, object]]:
    return [
        {
            "program": p.program,
            "hook": p.hook,
            "attachment": p.attachment,
            "misses": p.misses,
            "caught": p.caught,
        }
        for p in programs
    ]


def read_programs(obj: object, c: Checker) -> tuple[ProgramMisses, ...]:
    items = c.array(obj, "programs")
    return tuple(_read_program(x, f"programs[{i}]", c) for i, x in enumerate(items))


def _read_program(obj: object, path: str, c: Checker) -> ProgramMisses:
    m = c.map(obj, path, _KEYS)
    attachment = c.string(m["attachment"], f"{path}.attachment")
    if attachment not in ATTACHMENTS:
        c.fail(
            f"{path}.attachment",
            f"expected one of {', '.join(ATTACHMENTS)}, found {attachment[:40]!r}",
        )
    return ProgramMisses(
        program=c.string(m["program"], f"{path}.program"),
        hook=c.string(m["hook"], f"{path}.hook"),
        attachment=attachment,
        misses=c.opt_int(m["misses"], f"{path}.misses", U64),
        caught=c.opt_int(m["caught"], f"{path}.caught", U64),
    )

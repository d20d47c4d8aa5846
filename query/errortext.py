"""A failed query's message, as people read it: DuckDB's message lines kept
as lines (its ``LINE 1:`` excerpt and the caret under it line up only
there), and an unknown table answered with the tables a query can read,
never with DuckDB's guess among its own catalog (``duckdb_columns``,
``pg_collation``), which no query here can use to any purpose."""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence

from stallwatch.dumpers.sqltables import TABLE_NAMES

_UNKNOWN_TABLE = re.compile(r"Table with name (\S+) does not exist!")
_GUESS = re.compile(r"^Did you mean \"[^\"]*\"\?$")


def error_lines(message: str, tables: Sequence[str] = TABLE_NAMES) -> list[str]:
    """The message's lines, blank ones dropped; for an unknown table, the
    closest of ``tables`` (or all of them) in place of DuckDB's guess."""
    lines = [line.rstrip() for line in message.splitlines() if line.strip()]
    unknown = _UNKNOWN_TABLE.search(lines[0]) if lines else None
    if unknown is None:
        return lines
    rest = [line for line in lines[1:] if not _GUESS.match(line)]
    close = difflib.get_close_matches(unknown.group(1).strip('"'), tables, n=1)
    hint = f'Did you mean "{close[0]}"?' if close else f"The tables: {', '.join(tables)}."
    return [lines[0], hint, *rest]

"""How every command prints for people: rich tables on a terminal, plain
aligned text elsewhere.  (Help and the ``--format`` option are
``stallwatch.commands.options``.)
"""

from __future__ import annotations

import io
import re
import sys
from collections.abc import Callable, Sequence
from typing import TextIO

from rich import box
from rich.box import Box
from rich.console import Console
from rich.table import Table

# ---- tables and text for people -------------------------------------------
#
# Every command prints its tables through rich: on a terminal boxed, with a
# bold header and the terminal's width; anywhere else (a pipe, a file, a
# test) plain aligned columns, no colour, no escape codes, lines never
# wrapped, so that what is printed can be grepped and diffed.

# Text from an input (a dump request's reason, a host, a file or process
# group name, a command line) is shown with its control characters escaped,
# on a terminal or not: C0 and C1 controls, DEL, and the invisible format
# characters that reorder or hide text (bidi overrides, zero widths).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(m: re.Match[str]) -> str:
    c = m.group()
    return _NAMED.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def printable(text: str) -> str:
    """``text`` with control characters escaped (``\\x1b``, ``\\n``,
    ``\\u202e``): it can neither move the cursor, colour the terminal nor
    start a line of its own."""
    return _CONTROL.sub(_escaped, text)


def note(command: str, text: str) -> None:
    """One line on stderr for people: ``stallwatch <command>: <text>``, escaped."""
    print(f"stallwatch {command}: {printable(text)}", file=sys.stderr)


# A header underlined with dashes, columns apart by spaces: the plain form.
PLAIN_BOX = Box("    \n    \n -  \n    \n    \n    \n    \n    \n", ascii=True)
PLAIN_WIDTH = 100_000  # wide enough that rich never wraps a line


def console(file: TextIO | None = None, terminal: bool | None = None) -> Console:
    """A console for people: a terminal's own when ``file`` is one (or
    ``terminal`` says so), else plain text."""
    file = file if file is not None else sys.stdout
    if terminal is None:
        terminal = file.isatty()
    if terminal:
        return Console(file=file, highlight=False, markup=False, emoji=False)
    return Console(
        file=file,
        width=PLAIN_WIDTH,
        force_terminal=False,
        no_color=True,
        highlight=False,
        markup=False,
        emoji=False,
        soft_wrap=True,
    )


def new_table(
    c: Console,
    columns: Sequence[tuple[str, bool]],
    whole: Sequence[int] = (),
    widths: Sequence[int] | None = None,
    header: bool = True,
) -> Table:
    """A table of ``(header, right-aligned)`` columns in the console's form.
    ``whole``: per column, the width its cells need never to be cut (ids,
    which the next query needs whole); on a narrow terminal the other
    columns wrap instead.  ``widths``: every column's width, fixed (cells
    wrap inside it; see ``fit_widths``); ``header=False`` for rows printed
    under a header drawn apart, at the same widths."""
    if c.is_terminal:
        t = Table(box=box.SIMPLE_HEAD, header_style="bold", pad_edge=False, show_edge=False)
    else:
        t = Table(box=PLAIN_BOX, header_style="", pad_edge=False, show_edge=False)
    t.show_header = header
    for i, (head, right) in enumerate(columns):
        keep = whole[i] if i < len(whole) else 0
        t.add_column(
            head,
            justify="right" if right else "left",
            no_wrap=not c.is_terminal or bool(keep),
            min_width=keep or None,
            width=widths[i] if widths is not None and c.is_terminal else None,
            overflow="fold",
        )
    return t


COLUMN_GAP = 3  # between two columns of ``new_table`` on a terminal (padding, rule, padding)


def fit_widths(cells: Sequence[Sequence[str]], width: int) -> list[int] | None:
    """Column widths for ``new_table`` that fit ``width``, the header first
    in ``cells`` (one sequence per row): each column as wide as its widest
    cell, or, where they do not fit, narrowed but never below its longest
    word, so that text wraps between words and no word is cut: headers
    wrap first (a column no wider than its cells), then the cells (the
    column with the most room to spare first).  None when even the longest
    words do not fit."""
    n = len(cells[0])
    natural = [max(len(row[i]) for row in cells) for i in range(n)]
    least = [max((len(w) for row in cells for w in row[i].split()), default=1) for i in range(n)]
    body = [max((len(row[i]) for row in cells[1:]), default=0) for i in range(n)]
    budget = width - COLUMN_GAP * (n - 1)
    if sum(least) > budget:
        return None
    widths = list(natural)
    for floor in ([max(b, low) for b, low in zip(body, least, strict=True)], least):
        while sum(widths) > budget:
            spare = [w - f for w, f in zip(widths, floor, strict=True)]
            if max(spare) <= 0:
                break
            widths[spare.index(max(spare))] -= 1
    return widths


ID_TEXT = re.compile(r"0x[0-9a-f]{8,16}")


def id_widths(rows: Sequence[Sequence[object]], n: int) -> list[int]:
    """Per column, the width of its longest id ('0x...'), 0 without one."""
    out = [0] * n
    for row in rows:
        for i, v in enumerate(row):
            if isinstance(v, str) and ID_TEXT.fullmatch(v):
                out[i] = max(out[i], len(v))
    return out


def plain_text(render: Callable[[Console], None]) -> str:
    """What ``render`` prints on a plain console, as one string (the blanks
    that pad table cells at the ends of lines dropped)."""
    buffer = io.StringIO()
    render(console(buffer, terminal=False))
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines())


def text_for(render: Callable[[Console], None], file: TextIO | None = None) -> str:
    """What ``render`` prints, as a string for ``file`` (stdout): with the
    terminal's width and colours when it is one, plain text otherwise."""
    file = file if file is not None else sys.stdout
    if not file.isatty():
        return plain_text(render)
    c = console(file, terminal=True)
    with c.capture() as captured:
        render(c)
    return captured.get().rstrip("\n")


def show(render: Callable[[Console], None], file: TextIO | None = None) -> None:
    """Print for people: through rich on a terminal, plain text elsewhere."""
    print(text_for(render, file), file=file if file is not None else sys.stdout)

"""How every command prints for people: rich tables on a terminal, plain
aligned text elsewhere.  (Help and the ``--format`` option are
``stallwatch.commands.options``.)
"""

from __future__ import annotations

import io
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


def new_table(c: Console, columns: Sequence[tuple[str, bool]]) -> Table:
    """A table of ``(header, right-aligned)`` columns in the console's form."""
    if c.is_terminal:
        t = Table(box=box.SIMPLE_HEAD, header_style="bold", pad_edge=False, show_edge=False)
    else:
        t = Table(box=PLAIN_BOX, header_style="", pad_edge=False, show_edge=False)
    for header, right in columns:
        t.add_column(header, justify="right" if right else "left", no_wrap=not c.is_terminal)
    return t


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

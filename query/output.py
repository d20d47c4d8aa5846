"""How every command presents itself: help that shows defaults, and one
output option, ``--format`` (``--json`` is its short form).

Every part registers its own subcommands; they all take their formatter and
their output option from here, so that the grammar is the same everywhere.
"""

from __future__ import annotations

import argparse
import io
import sys
from collections.abc import Callable, Sequence
from typing import TextIO

from rich import box
from rich.box import Box
from rich.console import Console
from rich.table import Table

_NO_DEFAULT = (None, False, argparse.SUPPRESS)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Epilogs (examples, exit codes) kept as written; each option's default
    shown after its help, unless it has none or the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or "default" in text or "%(default)" in text:
            return text
        if action.default in _NO_DEFAULT or action.default == []:
            return text
        if isinstance(action, argparse._StoreConstAction):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def add_format_option(
    parser: argparse.ArgumentParser,
    formats: tuple[str, ...] = ("table", "json"),
    default: str = "table",
) -> None:
    """``--format {formats}`` and ``--json`` for ``--format json``."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--format",
        choices=formats,
        default=default,
        help="how to print the result: table for people, json for programs"
        + (", csv for spreadsheets" if "csv" in formats else ""),
    )
    group.add_argument(
        "--json",
        dest="format",
        action="store_const",
        const="json",
        help="short for --format json",
    )


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

"""How every command presents itself: help that shows defaults, and one
output option, ``--format`` (``--json`` is its short form).

Every part registers its own subcommands; they all take their formatter and
their output option from here, so that the grammar is the same everywhere.
"""

from __future__ import annotations

import argparse

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

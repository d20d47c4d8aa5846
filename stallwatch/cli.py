"""The console script's entry point (``stallwatch = "stallwatch.cli:main"``);
the command line itself is ``stallwatch.commands`` (``commands.main`` builds
the parser)."""

from stallwatch.commands.main import build_parser, main, parse

__all__ = ["build_parser", "main", "parse"]

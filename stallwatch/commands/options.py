"""The option groups every command shares, each defined once: how help reads
(``HelpFormatter``), the output option (``--format``, ``--json`` its short
form), the processes a command reads (``--pid``/``--scope``), the bearer
token (``--token-file``) and TLS for servers and for clients of agents.

A command takes its options from here so that the same flag means the same
thing, with the same type and the same errors, on every command.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from stallwatch.dumpers.errors import UsageError
from stallwatch.query.tls import ClientTls, ServerTls, server_tls

if TYPE_CHECKING:
    from stallwatch.query.live import AgentCall

_NO_DEFAULT = (None, False, argparse.SUPPRESS)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Epilogs (examples, exit codes) kept as written, a one-paragraph
    description wrapped to the terminal; each option's default shown after
    its help, unless it has none or the help already says it."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text.strip():  # laid out by hand: examples, exit codes
            return super()._fill_text(text, width, indent)
        return argparse.HelpFormatter._fill_text(self, text, width, indent)

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


# ---- which processes: --pid, --scope ------------------------------------------


def add_process_options(parser: argparse.ArgumentParser, pid_help: str, scope_help: str) -> None:
    """``--pid`` (repeatable) and ``--scope host|netns``: what a command reads
    on this node (the helps say what the command does with them)."""
    parser.add_argument(
        "--pid", action="append", type=int, default=[], metavar="PID", help=pid_help
    )
    parser.add_argument("--scope", choices=("host", "netns"), default="host", help=scope_help)


# ---- the bearer token -----------------------------------------------------------


def add_token_option(parser: argparse.ArgumentParser, help: str) -> None:
    parser.add_argument("--token-file", type=Path, metavar="FILE", help=help)


def read_token(path: Path | None, option: str = "--token-file") -> str | None:
    """The token in a file (surrounding whitespace ignored), or None."""
    if path is None:
        return None
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise UsageError(f"{option} {path}: cannot read: {exc.strerror or exc}") from None
    if not token:
        raise UsageError(f"{option} {path}: the file is empty")
    return token


# ---- TLS ----------------------------------------------------------------------


def add_server_tls(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tls-cert",
        type=Path,
        metavar="FILE",
        help="serve HTTPS with this PEM certificate (needed with a non-loopback --listen)",
    )
    parser.add_argument("--tls-key", type=Path, metavar="FILE", help="its PEM private key")
    parser.add_argument(
        "--tls-client-ca",
        type=Path,
        metavar="FILE",
        help="mutual TLS: clients must present a certificate this CA signed",
    )


def add_client_tls(parser: argparse.ArgumentParser, what: str = "the agents") -> None:
    parser.add_argument(
        "--tls-ca",
        type=Path,
        metavar="FILE",
        help=f"reach {what} over HTTPS, their certificates signed by this CA",
    )
    if "--tls-cert" not in parser._option_string_actions:
        parser.add_argument(
            "--tls-cert",
            type=Path,
            metavar="FILE",
            help="client certificate, for agents that ask for one (mutual TLS)",
        )
        parser.add_argument("--tls-key", type=Path, metavar="FILE", help="its PEM private key")


def server_tls_from(args: argparse.Namespace) -> ServerTls | None:
    return server_tls(args.tls_cert, args.tls_key, getattr(args, "tls_client_ca", None))


def client_tls_from(args: argparse.Namespace) -> ClientTls | None:
    """TLS for a client command: with --tls-ca (or a client certificate)."""
    if args.tls_ca is None and args.tls_cert is None and args.tls_key is None:
        return None
    tls = ClientTls(args.tls_ca, args.tls_cert, args.tls_key)
    tls.context()  # every file checked now: a bad one is named before anything is sent
    return tls


# ---- the pinned recording ---------------------------------------------------------


def add_pin_dir(parser: argparse.ArgumentParser) -> None:
    from stallwatch.recorder.pinning import DEFAULT_PIN_DIR

    parser.add_argument(
        "--pin-dir",
        type=Path,
        default=DEFAULT_PIN_DIR,
        metavar="DIR",
        help="the agent's folder on bpffs for its pinned recording (one per agent)",
    )


# ---- which agents: --agents, --agents-file, and how to reach them ----------------

# One default for every command that asks agents (analyze --agents, query
# --agents, collect, dump, snapshot --agents): long enough for an agent to
# read its rings and threads or write a dump on a busy node, short enough
# that one dead agent is named within seconds at 3 a.m.
AGENT_TIMEOUT_S = 10.0


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"expected seconds from 0 to 3600, got {text}")
    return value


def add_timeout_option(parser: argparse.ArgumentParser, what: str = "each agent") -> None:
    """``--timeout SEC``: how long an agent may take to answer, once asked."""
    parser.add_argument(
        "--timeout",
        type=_seconds,
        default=AGENT_TIMEOUT_S,
        metavar="SEC",
        help=f"seconds {what} may take to answer, once asked",
    )


def add_agent_options(parser: argparse.ArgumentParser) -> None:
    """``--agents``, ``--agents-file``, the token, client TLS and the
    timeout: the agents a live command asks, the same on every command."""
    parser.add_argument("--agents", metavar="HOST:PORT,...", help="ask these live agents")
    parser.add_argument(
        "--agents-file",
        type=Path,
        metavar="FILE",
        help="the agents, one HOST:PORT a line (# comments), with or instead of --agents",
    )
    add_token_option(parser, help="bearer token for the agents")
    add_timeout_option(parser)
    add_client_tls(parser)


def wants_agents(args: argparse.Namespace) -> bool:
    return args.agents is not None or args.agents_file is not None


def agent_call_from(args: argparse.Namespace) -> AgentCall:
    """The agents named and how to reach them, every file checked now."""
    from stallwatch.query.live import AgentCall, agents_from

    agents = agents_from(args.agents, args.agents_file)
    return AgentCall(agents, read_token(args.token_file), client_tls_from(args), args.timeout)

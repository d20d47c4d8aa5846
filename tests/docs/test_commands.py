"""Every ``stallwatch`` command the pages print parses as the command line
reads it, and every ``stallwatch lab run`` among them (in a block or inline,
and in ``lab run --help``'s examples) asks for a job the lab can run: its
faults fit its nodes, ranks, steps and mode, its options go together.
Nothing runs: this is what the runnable blocks (``test_runnable``) cannot
afford for the long lab runs of docs/lab.md."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from stallwatch.commands.lab.run import RUN_EPILOG, config_from
from stallwatch.commands.main import build_parser, parse
from stallwatch.lab import faults as F
from stallwatch.lab import runner
from tests.docs.runnable import FENCE, PAGES, ROOT

# what the pages' shell variables stand for, where a command uses one
VARIABLES = {
    "$TLS": "--token-file token --tls-ca ca.pem --tls-cert client.pem --tls-key client.key",
    '"$(head -1 agents.txt)"': "node1:9400",
    "$STALLWATCH_COLLECT_DIR/$SLURM_JOB_ID": "incidents/1234",
}
INLINE = re.compile(r"`(stallwatch lab run [^`]+)`")


OPERATORS = {"&", "&&", "|", "||", ";", ">", ">>", "<"}


def _argv(command: str) -> list[str]:
    """The words of the command itself: variables as the page sets them,
    up to the first shell operator (``&``, ``|``, ``>``...)."""
    for name, value in VARIABLES.items():
        command = command.replace(name, value)
    lex = shlex.shlex(command.replace("\\\n", " "), posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    lex.commenters = "#"
    words = []
    for word in lex:
        if word in OPERATORS:
            break
        words.append(word)
    return words


COMMANDS = set(build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]


def _a_command(line: str) -> bool:
    """A line that runs stallwatch, not one it printed (``stallwatch lab:
    error: ...``, ``stallwatch demo (seed 3): ...``)."""
    words = line.split()
    return len(words) > 1 and words[0] == "stallwatch" and words[1] in COMMANDS


def _closed(command: str) -> bool:
    try:
        shlex.split(command)
    except ValueError:
        return False
    return True


def block_commands() -> list[tuple[str, str]]:
    """(where, command) of every line of a fenced block that starts with
    ``stallwatch`` (its continuation lines joined)."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            if m.group(1) not in ("", "sh"):
                continue
            line = text[: m.start()].count("\n") + 1
            pending = ""
            for i, raw in enumerate(m.group(3).splitlines()):
                if not pending and not _a_command(raw):
                    continue
                if raw.endswith("\\"):
                    pending += raw.strip().removesuffix("\\") + " "
                    continue
                pending += raw.strip()
                if _closed(pending):  # a quoted argument may span lines (SQL)
                    found.append((f"{page.relative_to(ROOT)}:{line + 1 + i}", pending))
                    pending = ""
                else:
                    pending += "\n"
    return found


def lab_run_commands() -> list[tuple[str, str]]:
    """Every ``stallwatch lab run`` of the pages, blocks and inline, and of
    lab run's own examples."""
    found = [(w, c) for w, c in block_commands() if c.startswith("stallwatch lab run ")]
    for page in PAGES:
        for m in INLINE.finditer(page.read_text()):
            found.append((str(page.relative_to(ROOT)), " ".join(m.group(1).split())))
    examples = RUN_EPILOG.split("examples:", 1)[1].split("\n\n", 1)[0]
    for command in re.split(r"(?<!\\)\n", examples):
        if command.strip():
            found.append(("lab run --help", " ".join(command.replace("\\\n", " ").split())))
    return found


@pytest.mark.parametrize(("where", "command"), block_commands())
def test_every_command_printed_parses(where: str, command: str) -> None:
    argv = _argv(command)
    try:
        parse(build_parser(), argv[1:])
    except SystemExit as exc:
        if exc.code != 0:  # --help and --version exit 0
            raise AssertionError(f"{where}: {command}: the command line refuses it") from None


@pytest.mark.parametrize(("where", "command"), lab_run_commands())
def test_every_lab_run_printed_asks_for_a_job_the_lab_can_run(where: str, command: str) -> None:
    argv = _argv(command)
    if argv[3:] in ([], ["--help"]):
        return
    args = parse(build_parser(), argv[1:])
    cfg = config_from(args)
    F.validate(cfg.faults, cfg.topology, cfg.steps, cfg.mode)
    runner.check_agent_scope(cfg)


def test_the_pages_print_lab_runs_and_the_check_refuses_a_wrong_one() -> None:
    assert len(lab_run_commands()) > 20
    args = parse(build_parser(), ["lab", "run", "--fault", "loss:node=2,pct=8"])
    cfg = config_from(args)
    with pytest.raises(Exception, match="node 2 does not exist"):
        F.validate(cfg.faults, cfg.topology, cfg.steps, cfg.mode)


def test_pages_exist() -> None:
    assert all(isinstance(p, Path) and p.is_file() for p in PAGES)

"""``stallwatch completion bash|zsh|fish``: the bash script loaded in bash and
asked what a TAB offers, for every command and every option the parser has;
the zsh and fish scripts carry the same commands, options and values."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from stallwatch.commands.completion import walk
from stallwatch.commands.main import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = list(walk(build_parser()))


def script(shell: str, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["completion", shell]) == 0
    return capsys.readouterr().out


def tab(script_text: str, *lines: tuple[str, ...]) -> list[list[str]]:
    """What bash's completion offers for each line (its last word being typed),
    the script loaded in one bash, run in the repository's folder."""
    calls = []
    for words in lines:
        quoted = " ".join(f"'{w}'" for w in words)
        calls.append(
            f"COMP_WORDS=({quoted}); COMP_CWORD={len(words) - 1}; COMPREPLY=(); _stallwatch; "
            'printf "%s\\n" "${COMPREPLY[@]}"; echo @@'
        )
    done = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", script_text + "\n" + "\n".join(calls)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 0 and not done.stderr, done.stderr
    return [part.split() for part in done.stdout.split("@@\n")[: len(lines)]]


def test_bash_completes_commands_options_and_their_values(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = script("bash", capsys)
    got = tab(
        text,
        ("stallwatch", "an"),
        ("stallwatch", ""),
        ("stallwatch", "lab", ""),
        ("stallwatch", "lab", "run", "--mode", ""),
        ("stallwatch", "analyze", "--format", "j"),
        ("stallwatch", "analyze", "tests/data/lab-hang-2"),
        ("stallwatch", "collect", "-o", "tests/dat"),
        ("stallwatch", "analyze", "--agents", ""),
        ("stallwatch", "completion", ""),
        ("stallwatch", "query", "--agents-file", "pyproject.t"),
    )
    assert got[0] == ["analyze"]
    assert set(got[1]) == {name for name, _ in COMMANDS[0].commands} >= {"analyze", "lab"}
    assert sorted(got[2]) == ["demo", "run", "zoo"]
    assert sorted(got[3]) == ["async", "blocking", "gpu"]
    assert got[4] == ["json"]
    # a path argument: files
    assert sorted(got[5]) == ["tests/data/lab-hang-2x2", "tests/data/lab-hang-2x2-wrapped"]
    assert got[6] == ["tests/data"]  # -o DIR: folders
    assert got[7] == []  # an agent's address: nothing to guess
    assert got[8] == ["bash", "zsh", "fish"]
    assert got[9] == ["pyproject.toml"]


def test_bash_offers_every_option_of_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    text = script("bash", capsys)
    lines = [("stallwatch", *c.path, "-") for c in COMMANDS]
    for command, offered in zip(COMMANDS, tab(text, *lines), strict=True):
        wanted = {f for o in command.options for f in o.flags if f.startswith("-")}
        assert wanted and set(offered) == wanted, (command.path, wanted ^ set(offered))


def _every_option(parser: argparse.ArgumentParser) -> set[str]:
    found: set[str] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _every_option(sub)
        elif action.help != argparse.SUPPRESS:
            found |= {f for f in action.option_strings if f.startswith("--")}
    return found


@pytest.mark.parametrize("shell", ["zsh", "fish"])
def test_zsh_and_fish_scripts_hold_every_command_and_option(
    shell: str, capsys: pytest.CaptureFixture[str]
) -> None:
    text = script(shell, capsys)
    names = {name for c in COMMANDS for name, _ in c.commands}
    options = _every_option(build_parser())
    if shell == "fish":  # complete -l NAME for --NAME
        options = {f"-l {o[2:]}" for o in options}
        assert all(f"-a {name} " in text for name in names)
    else:
        assert text.startswith("#compdef stallwatch") and all(f"{n}:" in text for n in names)
    missing = [o for o in sorted(options) if o not in text]
    assert not missing, missing
    assert "(table json)" in text or "'table json'" in text  # --format's values


def test_an_unknown_shell_is_one_usage_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "stallwatch", "completion", "tcsh"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith("stallwatch")

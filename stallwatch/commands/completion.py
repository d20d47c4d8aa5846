"""``stallwatch completion bash|zsh|fish``: a shell completion script, written
from the parser itself (commands, their options, each option's choices, and
whether it takes a file or a folder), so it never lags behind the commands.

The scripts are static: pressing TAB runs no Python (a ``stallwatch`` start
costs about half a second on a loaded node; argcomplete would pay it on every
TAB).  shtab writes bash and zsh from argparse but not fish; one small
writer for all three keeps them alike.

Exit codes: 0 printed; 2 an unknown shell.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from stallwatch.dumpers.errors import ExitCode

from .options import HelpFormatter

SHELLS = ("bash", "zsh", "fish")
EPILOG = """\
examples:
  stallwatch completion bash > /etc/bash_completion.d/stallwatch
  source <(stallwatch completion bash)     # this shell only
  stallwatch completion zsh > "${fpath[1]}/_stallwatch"
  stallwatch completion fish > ~/.config/fish/completions/stallwatch.fish

exit codes: 0 printed; 2 an unknown shell
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "completion",
        help="a shell completion script for bash, zsh or fish",
        description="Print a completion script for the shell: commands, options and their "
        "values complete on TAB.",
        epilog=EPILOG,
        formatter_class=HelpFormatter,
    )
    p.add_argument("shell", choices=SHELLS, help="the shell the script is for")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .main import build_parser  # every command's, not only this one's

    commands = list(walk(build_parser()))
    write = {"bash": bash_script, "zsh": zsh_script, "fish": fish_script}[args.shell]
    print(write(commands), end="")
    return ExitCode.OK


# ---- what a shell needs to know of the parser ----------------------------------

FILE, DIR, CHOICE, VALUE, FLAG = "file", "dir", "choice", "value", "flag"


@dataclass(frozen=True, slots=True)
class Option:
    flags: tuple[str, ...]
    help: str
    takes: str  # FILE, DIR, CHOICE, VALUE or FLAG
    choices: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Command:
    path: tuple[str, ...]  # () is stallwatch itself, ("lab", "run") ...
    help: str
    options: tuple[Option, ...]
    commands: tuple[tuple[str, str], ...]  # its subcommands: (name, help)
    args: str  # what its positionals take: FILE, CHOICE or VALUE ("" for none)
    arg_choices: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        return "/".join(self.path)


def walk(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = (), help: str = ""
) -> Iterator[Command]:
    """Every command of the tree, parents before their subcommands."""
    subs = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    helps = {c.dest: c.help or "" for c in subs._choices_actions} if subs is not None else {}
    positionals = [a for a in parser._actions if not a.option_strings and a is not subs]
    args, arg_choices = _positionals(positionals)
    yield Command(
        path,
        help,
        tuple(
            _option(a) for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS
        ),
        tuple((name, helps.get(name, "")) for name in (subs.choices if subs is not None else {})),
        args,
        arg_choices,
    )
    if subs is not None:
        for name, sub in subs.choices.items():
            yield from walk(sub, (*path, name), helps.get(name, ""))


_FILES = re.compile(r"FILE|PATH|DUMP")


def _option(action: argparse.Action) -> Option:
    flags = tuple(action.option_strings)
    text = (action.help or "").replace("%(default)s", str(action.default))
    if action.nargs == 0:
        return Option(flags, text, FLAG)
    if action.choices:
        return Option(flags, text, CHOICE, tuple(str(c) for c in action.choices))
    metavar = action.metavar if isinstance(action.metavar, str) else ""
    if "DIR" in metavar:
        return Option(flags, text, DIR)
    if action.type is Path or _FILES.search(metavar):
        return Option(flags, text, FILE)
    return Option(flags, text, VALUE)


def _positionals(actions: list[argparse.Action]) -> tuple[str, tuple[str, ...]]:
    for a in actions:
        if a.choices:
            return CHOICE, tuple(str(c) for c in a.choices)
    if any(_FILES.search(str(a.metavar or a.dest).upper()) for a in actions):
        return FILE, ()
    return (VALUE, ()) if actions else ("", ())


def _words(values: Iterator[str] | tuple[str, ...] | list[str]) -> str:
    return " ".join(values)


# ---- bash ------------------------------------------------------------------------


def bash_script(commands: list[Command]) -> str:
    known = " | ".join(f'"{c.key}"' for c in commands if c.path)
    lines = [
        "# bash completion for stallwatch (written by: stallwatch completion bash)",
        "_stallwatch() {",
        '    local cur="${COMP_WORDS[COMP_CWORD]}" prev="${COMP_WORDS[COMP_CWORD-1]}"',
        '    local cmd="" word i',
        "    for ((i = 1; i < COMP_CWORD; i++)); do",
        '        word="${cmd:+$cmd/}${COMP_WORDS[i]}"',
        '        case "$word" in',
        f'            {known}) cmd="$word" ;;',
        "        esac",
        "    done",
        "    COMPREPLY=()",
        '    case "$cmd:$prev" in',
    ]
    for c in commands:
        for o in c.options:
            if o.takes == FLAG:
                continue
            pattern = "|".join(f'"{c.key}:{f}"' for f in o.flags)
            reply = {
                CHOICE: f'COMPREPLY=($(compgen -W "{_words(o.choices)}" -- "$cur"))',
                FILE: 'COMPREPLY=($(compgen -f -- "$cur"))',
                DIR: 'COMPREPLY=($(compgen -d -- "$cur"))',
                VALUE: ":",  # a value only the user knows
            }[o.takes]
            lines.append(f"        {pattern}) {reply}; return ;;")
    lines += ["    esac", '    if [[ "$cur" == -* ]]; then', '        case "$cmd" in']
    for c in commands:
        flags = _words(f for o in c.options for f in o.flags)
        lines.append(f'            "{c.key}") COMPREPLY=($(compgen -W "{flags}" -- "$cur")) ;;')
    lines += ["        esac", "        return", "    fi", '    case "$cmd" in']
    for c in commands:
        if c.commands:
            names = _words(n for n, _ in c.commands)
            lines.append(f'        "{c.key}") COMPREPLY=($(compgen -W "{names}" -- "$cur")) ;;')
        elif c.args == CHOICE:
            words = _words(c.arg_choices)
            lines.append(f'        "{c.key}") COMPREPLY=($(compgen -W "{words}" -- "$cur")) ;;')
        elif c.args == FILE:
            lines.append(f'        "{c.key}") COMPREPLY=($(compgen -f -- "$cur")) ;;')
    lines += ["    esac", "}", "complete -o filenames -F _stallwatch stallwatch", ""]
    return "\n".join(lines)


# ---- zsh -------------------------------------------------------------------------


def _zsh_quote(text: str) -> str:
    """Inside a single-quoted _arguments spec: no quotes, brackets or colons."""
    text = text.replace("'", "").replace("[", "(").replace("]", ")").replace(":", " -")
    return text.replace("\\", "").replace("`", "")


def _zsh_item(name: str, text: str) -> str:
    """``name:description`` inside ``((...))``: blanks and parentheses escaped."""
    item = f"{name}:{_zsh_quote(text)}"
    for c in " ()":
        item = item.replace(c, "\\" + c)
    return item


def _zsh_spec(o: Option) -> list[str]:
    what = {
        FLAG: "",
        CHOICE: f":value:({_words(o.choices)})",
        FILE: ":file:_files",
        DIR: ":folder:_files -/",
        VALUE: ":value: ",
    }[o.takes]
    repeat = "*" if "repeatable" in o.help else ""
    return [f"'{repeat}{flag}[{_zsh_quote(o.help)}]{what}'" for flag in o.flags]


def zsh_script(commands: list[Command]) -> str:
    depth = {c.key: len(c.path) for c in commands}
    known = "|".join(f'"{c.key}"' for c in commands if c.path)
    lines = [
        "#compdef stallwatch",
        "# zsh completion for stallwatch (written by: stallwatch completion zsh)",
        "_stallwatch() {",
        '    local cmd="" word i',
        "    for ((i = 2; i < CURRENT; i++)); do",
        '        word="${cmd:+$cmd/}${words[i]}"',
        f'        case "$word" in {known}) cmd="$word" ;; esac',
        "    done",
        '    case "$cmd" in',
    ]
    for c in commands:
        shift = depth[c.key]
        specs = [s for o in c.options for s in _zsh_spec(o)]
        if c.commands:
            names = " ".join(_zsh_item(n, h) for n, h in c.commands)
            specs.append(f"'1:command:(({names}))'")
        elif c.args == CHOICE:
            specs.append(f"'1:value:({_words(c.arg_choices)})'")
        elif c.args == FILE:
            specs.append("'*:file:_files'")
        body = " \\\n                ".join(specs)
        lines += [
            f'        "{c.key}")',
            f"            shift {shift} words; (( CURRENT -= {shift} ))" if shift else "",
            f"            _arguments -s \\\n                {body} ;;",
        ]
    lines += ["    esac", "}", 'if [[ "$funcstack[1]" == _stallwatch ]]; then _stallwatch "$@";',
              "else compdef _stallwatch stallwatch; fi", ""]  # fmt: skip
    return "\n".join(line for line in lines if line)


# ---- fish ------------------------------------------------------------------------


def _fish_quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _fish_condition(c: Command, commands: list[Command]) -> str:
    """Completions of command ``c``: its path seen, none of its subcommands."""
    if not c.path:
        return "__fish_use_subcommand"
    seen = [f"__fish_seen_subcommand_from {name}" for name in c.path]
    subs = _words(n for n, _ in c.commands)
    if subs:
        seen.append(f"not __fish_seen_subcommand_from {subs}")
    return "; and ".join(seen)


def fish_script(commands: list[Command]) -> str:
    lines = [
        "# fish completion for stallwatch (written by: stallwatch completion fish)",
        "complete -c stallwatch -f",
    ]
    for c in commands:
        when = _fish_quote(_fish_condition(c, commands))
        for name, text in c.commands:
            lines.append(f"complete -c stallwatch -n {when} -a {name} -d {_fish_quote(text)}")
        if c.args == CHOICE:
            lines.append(
                f"complete -c stallwatch -n {when} -a {_fish_quote(_words(c.arg_choices))}"
            )
        elif c.args == FILE:
            lines.append(f"complete -c stallwatch -n {when} -F")
        for o in c.options:
            names = " ".join(
                f"-l {f[2:]}" if f.startswith("--") else f"-s {f[1:]}" for f in o.flags
            )
            takes = {
                FLAG: "",
                CHOICE: f" -x -a {_fish_quote(_words(o.choices))}",
                FILE: " -r -F",
                DIR: " -r -F",
                VALUE: " -x",
            }[o.takes]
            lines.append(
                f"complete -c stallwatch -n {when} {names}{takes} -d {_fish_quote(o.help)}"
            )
    return "\n".join(lines) + "\n"

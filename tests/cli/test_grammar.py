"""One command-line grammar: options before or after a command's paths, one
output option (``--format``, ``--json`` its short form), defaults and examples
in every ``--help``, and ``record`` refusing, in one line and before it
compiles anything, what it cannot do."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from stallwatch.commands.main import build_parser, main, parse
from stallwatch.dumpers.format import write_dump
from tests.analyzer.synth import BASE_JOB, recordings

NOBODY = 65534


def leaves(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every command that runs (``lab`` is a group: ``lab run``, ``lab demo``)."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
        return
    for name, sub in subs[0].choices.items():
        yield from leaves(sub, (*path, name))


COMMANDS = {" ".join(p): sub for p, sub in leaves(build_parser())}


def test_every_command_is_known() -> None:
    want = {"record", "dump", "analyze", "query", "serve", "export", "lab run", "lab demo"}
    assert want <= set(COMMANDS)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_shows_examples_and_every_default(name: str) -> None:
    sub = COMMANDS[name]
    text = sub.format_help()
    assert "examples:" in text, name
    flat = " ".join(text.split())
    for action in sub._actions:
        default = action.default
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        if default in (None, False, argparse.SUPPRESS, []) or isinstance(
            action, argparse._StoreConstAction | argparse._HelpAction
        ):
            continue
        assert f"default: {default}" in flat, f"{name} {action.option_strings[0]}"


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (["analyze", "--format", "json", "d1", "d2"], {"paths": ["d1", "d2"], "format": "json"}),
        (["analyze", "d1", "--json", "d2"], {"paths": ["d1", "d2"], "format": "json"}),
        (["analyze", "d1", "d2", "--format", "table"], {"paths": ["d1", "d2"], "format": "table"}),
        (["query", "d/", "--format", "csv", "SQL"], {"args": ["d/", "SQL"], "format": "csv"}),
        (["query", "--limit", "3", "d/", "SQL"], {"args": ["d/", "SQL"], "limit": 3}),
        (["query", "d/", "SQL", "--json"], {"args": ["d/", "SQL"], "format": "json"}),
        (["serve", "d/", "--listen", "127.0.0.1:1"], {"paths": ["d/"], "listen": "127.0.0.1:1"}),
        (["serve", "--listen", "127.0.0.1:1", "d/"], {"paths": ["d/"], "listen": "127.0.0.1:1"}),
        (["export", "d/", "--perfetto", "-o", "t.json"], {"paths": ["d/"], "perfetto": True}),
        (["export", "--perfetto", "d/", "-o", "t.json"], {"paths": ["d/"], "perfetto": True}),
        (["export", "-o", "t.json", "d/", "--perfetto"], {"paths": ["d/"], "perfetto": True}),
        (["record", "--lib", "/x", "--stall-timeout", "5"], {"lib": ["/x"], "stall_timeout": 5}),
        (["dump", "--reason", "r", "--format", "table"], {"reason": "r", "format": "table"}),
        (["lab", "run", "--nodes", "3", "--json"], {"nodes": 3, "format": "json"}),
        (["lab", "demo", "--seed", "7", "--json"], {"seed": 7, "format": "json"}),
    ],
)  # fmt: skip
def test_options_before_or_after_the_paths(argv: list[str], want: dict[str, object]) -> None:
    args = parse(build_parser(), argv)
    got = {k: getattr(args, k) for k in want}
    if "output" in vars(args):
        assert str(args.output) == "t.json"
    assert got == want
    assert args.command == argv[0]


def test_usage_errors_exit_2_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["bogus"], ["--bogus", "analyze", "x"], ["analyze", "--agents"], ["lab", "x"]):
        with pytest.raises(SystemExit) as exc:
            parse(build_parser(), argv)
        assert exc.value.code == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("stallwatch"), (argv, err)
        assert "Traceback" not in "\n".join(err)


@pytest.mark.parametrize("argv", [[], ["lab"]])
def test_a_command_group_alone_prints_its_commands(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(build_parser(), argv)
    out = capsys.readouterr().out
    assert exc.value.code == 0
    wanted = ("analyze", "collect", "query", "lab") if not argv else ("run", "demo")
    assert out.startswith("usage: ") and all(f"\n    {w} " in out for w in wanted), out


# ---- --help: fits 100 columns, examples a shell runs, exit codes ---------------------


def _groups() -> dict[str, argparse.ArgumentParser]:
    """The root parser and every command that has commands (``lab``)."""
    root = build_parser()
    subs = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    groups = {"": root}
    for name, sub in subs.choices.items():
        if any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
            groups[name] = sub
    return groups


EVERY_HELP = {**_groups(), **COMMANDS}


def help_text(parser: argparse.ArgumentParser) -> str:
    """As printed on an 80-column terminal."""
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "80"
    try:
        return parser.format_help()
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved


def examples(text: str) -> list[str]:
    """The example commands of a help text as printed, each with its
    continuation lines (and lines inside its quotes); comment lines dropped."""
    lines = text.split("\nexamples:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    out, pending = [], ""
    for line in lines:
        if not pending and line.strip().startswith("#"):
            continue
        pending += line.strip() + "\n"
        if line.endswith("\\") or _open_quote(pending):
            continue
        out.append(pending.strip())
        pending = ""
    assert not pending, pending
    return out


def _command_words(line: str) -> list[str]:
    """The words of the first command of a shell line (up to a redirection,
    a pipe or a list operator), continuation lines joined as the shell does."""
    lex = shlex.shlex(line.replace("\\\n", " "), posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    words = []
    for word in lex:
        if set(word) <= set("();<>|&"):
            break
        words.append(word)
    return words


def _open_quote(text: str) -> bool:
    try:
        shlex.split(text, comments=True)
    except ValueError:
        return True
    return False


@pytest.mark.parametrize("name", sorted(EVERY_HELP))
def test_help_fits_and_its_examples_run_in_a_shell(name: str) -> None:
    """Under 100 columns; every example is valid shell (bash -n), and the
    stallwatch ones parse as given (descriptions are shell comments)."""
    text = help_text(EVERY_HELP[name])
    wide = [line for line in text.splitlines() if len(line) >= 100]
    assert not wide, wide
    found = examples(text)
    assert found, name
    for line in found:
        checked = subprocess.run(["bash", "-n", "-c", line], capture_output=True, text=True)
        assert checked.returncode == 0, (line, checked.stderr)
        argv = _command_words(line)
        while argv and re.fullmatch(r"\w+=\S*", argv[0]):  # VAR=value before the command
            argv.pop(0)
        if argv[0] != "stallwatch":
            continue
        try:
            parse(build_parser(), argv[1:])
        except SystemExit as exc:  # --help exits 0
            assert exc.code == 0, f"{name}: {line!r} is refused (exit {exc.code})"


@pytest.mark.parametrize("name", sorted(EVERY_HELP))
def test_help_says_the_exit_codes(name: str) -> None:
    text = " ".join(help_text(EVERY_HELP[name]).split())
    assert re.search(r"exit codes( \(every command\))?: ", text), name
    if name in COMMANDS and name != "lab":
        assert "0 " in text.split("exit codes", 1)[1], name


def test_one_timeout_and_one_way_to_name_agents_on_every_command_that_asks_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from stallwatch.commands.options import AGENT_TIMEOUT_S

    for name in ("analyze", "query", "collect", "snapshot", "dump"):
        options = COMMANDS[name]._option_string_actions
        assert options["--timeout"].default == AGENT_TIMEOUT_S, name
        assert "--token-file" in options and "--tls-ca" in options, name
        if name != "dump":  # one agent: --agent
            assert {"--agents", "--agents-file"} <= set(options), name
        with pytest.raises(SystemExit) as exc:
            parse(build_parser(), [name, "--timeout", "0", *(["SQL"] if name == "query" else [])])
        err = capsys.readouterr().err.strip().splitlines()
        assert exc.value.code == 2 and "--timeout: expected seconds" in err[-1], (name, err)


def test_version_before_a_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(build_parser(), ["--version", "analyze", "x"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("stallwatch ")


@pytest.fixture
def dumps(tmp_path: Path) -> Path:
    folder = tmp_path / "dumps"
    for rec in recordings(BASE_JOB):
        write_dump(folder, rec)
    return folder


def test_analyze_query_export_end_to_end_either_order(
    dumps: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def out(argv: list[str]) -> tuple[int, str]:
        code = main(argv)
        return code, capsys.readouterr().out

    a = out(["analyze", str(dumps), "--format", "json"])
    b = out(["analyze", "--json", str(dumps)])
    assert a[0] == b[0] == 0 and json.loads(a[1]) == json.loads(b[1])
    sql = "SELECT host, count(*) AS n FROM nccl_events GROUP BY host ORDER BY host"
    q1 = out(["query", str(dumps), "--format", "csv", sql])
    q2 = out(["query", "--format", "csv", str(dumps), sql])
    q3 = out(["query", str(dumps), sql, "--format", "csv"])
    assert q1 == q2 == q3 and q1[1].splitlines()[0] == "host,n"
    for i, argv in enumerate(
        (
            ["--perfetto", str(dumps)],
            [str(dumps), "--perfetto"],
            [str(dumps), "--json", "--perfetto"],
        )
    ):
        trace = tmp_path / f"t{i}.json"
        code, text = out(["export", *argv, "-o", str(trace)])
        assert code == 0 and trace.stat().st_size > 0, text
    assert json.loads(text)["path"] == str(trace)


def _as_nobody(argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``stallwatch record`` as an unprivileged user, with a ``bcc`` module
    first on the path that fails loudly if anything imports it: a refusal
    must come before any BPF program is compiled."""
    trap = tmp_path / "trap"
    (trap / "bcc").mkdir(parents=True)
    (trap / "bcc" / "__init__.py").write_text("raise SystemExit('bcc was imported')\n")
    os.chmod(tmp_path, 0o755)
    for p in (trap, trap / "bcc", trap / "bcc" / "__init__.py"):
        os.chmod(p, 0o755)
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(trap), "HOME": str(tmp_path)}
    cmd = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
           "--inh-caps=-all", sys.executable, "-m", "stallwatch", *argv]  # fmt: skip
    return subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv"
)
def test_record_as_non_root_says_what_is_missing_before_compiling(tmp_path: Path) -> None:
    done = _as_nobody(["record", "--dump-dir", str(tmp_path / "d")], tmp_path)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1, done.stderr
    assert "CAP_BPF" in lines[0] and "CAP_PERFMON" in lines[0] and "root" in lines[0]
    assert "bcc was imported" not in done.stderr


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv"
)
def test_record_checks_its_flags_first(tmp_path: Path) -> None:
    done = _as_nobody(["record", "--ring-size", "100"], tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "stallwatch record: error: --ring-size: expected a power of two >= 16, got 100"
    ]


def test_record_names_a_missing_library_before_compiling(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import stallwatch.recorder.privileges as privileges

    monkeypatch.setattr(privileges, "missing_for_recording", list)
    monkeypatch.setitem(sys.modules, "bcc", None)  # importing it now fails
    code = main(["record", "--lib", str(tmp_path / "nope.so"), "--dump-dir", str(tmp_path)])
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        f"stallwatch record: error: --lib {tmp_path / 'nope.so'}: no such file"
    )

"""The shell blocks of README.md and docs/*.md marked as runnable, and a
fresh login shell to run them in.

A block is runnable when its fence's info string is ``sh run`` followed by
any of these words:

- ``lab``: it needs root and the lab (namespaces, agents, eBPF): it runs in
  the lab phase (pytest marker ``lab``);
- ``in=WHERE``: where it runs (``CONTEXTS``): an empty folder (``scratch``,
  the default), a folder holding ``dumps/`` (a recorded lab hang), the
  clone's root (``clone``), the rehearsal's client folder while its job
  hangs (``runbook``), or the rehearsal's own ``lab run`` (``rehearsal``);
- ``exit=N``: every command of the block ends with N (default 0).

Every runnable block of one page and place runs in one shell, in page
order (a variable one block sets is there for the next), each command on
its own line as a person pastes it; a command continued with ``\\`` is one
command.  The shell is a login shell (``bash --login``) of an empty
environment and an empty home, as a new user's first shell: the PATH its
profile makes, with ``stallwatch`` on it as ``scripts/setup`` puts it there
(a link to this checkout's console script, first, so that a machine with
several clones runs this one's).
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
# where a block runs, and which test runs it
CONTEXTS = {
    "scratch": "tests/docs/test_runnable.py (an empty folder)",
    "dumps": "tests/docs/test_runnable.py (a folder holding dumps/: a recorded lab hang)",
    "clone": "tests/docs/test_runnable.py (the clone's root)",
    "runbook": "tests/analyzer/test_live_lab.py (the rehearsal's client folder, its job hung)",
    "rehearsal": "tests/analyzer/test_live_lab.py (its lab is this lab run, parsed and run)",
}
FENCE = re.compile(r"^```(\S*)([^\n]*)\n(.*?)^```$", re.M | re.S)
MARKER = "@@stallwatch-exit="


@dataclass(frozen=True, slots=True)
class Block:
    page: Path
    line: int  # of its opening fence
    commands: tuple[str, ...]
    lab: bool
    where: str
    exit: int

    @property
    def name(self) -> str:
        where = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page
        return f"{where}:{self.line}"


def commands_of(text: str) -> list[str]:
    """A block's commands, each with its continuation lines (blank lines
    and whole-line comments dropped)."""
    commands: list[str] = []
    pending = ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line + "\n"
        if not line.endswith("\\"):
            commands.append(pending.rstrip("\n"))
            pending = ""
    if pending:
        raise ValueError(f"a command ends in a continuation: {pending!r}")
    return commands


def _option(word: str) -> tuple[str, str]:
    name, _, value = word.partition("=")
    return name, value


def blocks(pages: tuple[Path, ...] = PAGES) -> list[Block]:
    """Every runnable block of ``pages``, in page order."""
    found = []
    for page in pages:
        text = page.read_text()
        for m in FENCE.finditer(text):
            words = m.group(2).split()
            if m.group(1) != "sh" or not words or words[0] != "run":
                continue
            opts = dict(_option(w) for w in words[1:])
            unknown = set(opts) - {"lab", "in", "exit"}
            where = opts.get("in", "scratch")
            if unknown or where not in CONTEXTS:
                raise ValueError(f"{page.name}: fence {m.group(0).splitlines()[0]!r}")
            line = text[: m.start()].count("\n") + 1
            commands = tuple(commands_of(m.group(3)))
            found.append(
                Block(page, line, commands, "lab" in opts, where, int(opts.get("exit", 0)))
            )
    return found


def of_context(where: str, pages: tuple[Path, ...] = PAGES) -> list[Block]:
    return [b for b in blocks(pages) if b.where == where]


@dataclass(frozen=True, slots=True)
class Ran:
    block: Block
    command: str
    code: int
    output: str  # its stdout
    errors: str  # the shell's stderr, every command's

    def __str__(self) -> str:
        return (f"{self.block.name}: {self.command}\nexit {self.code}\n{self.output[-3000:]}\n"
                f"stderr of the shell:\n{self.errors[-3000:]}")  # fmt: skip


def stallwatch_bin(folder: Path) -> Path:
    """A folder holding one ``stallwatch``: a link to this checkout's
    console script, as scripts/setup's /usr/local/bin/stallwatch is."""
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / "stallwatch"
    if not link.exists():
        link.symlink_to(Path(sys.executable).with_name("stallwatch"))
    return folder


def login_shell_env(home: Path) -> dict[str, str]:
    """A new user's environment before their profile runs."""
    home.mkdir(parents=True, exist_ok=True)
    return {"HOME": str(home), "USER": "root", "LOGNAME": "root", "SHELL": "/bin/bash",
            "TERM": "dumb", "LANG": "C.UTF-8"}  # fmt: skip


def run_in_login_shell(runs: list[Block], cwd: Path, home: Path, timeout: float = 900) -> list[Ran]:
    """The blocks' commands, in order, in one fresh login shell in ``cwd``:
    each command's exit code and its stdout (the shell's stderr beside)."""
    bin_dir = stallwatch_bin(home.parent / f"{home.name}-bin")
    steps = [(b, c) for b in runs for c in b.commands]
    script = f'export PATH="{bin_dir}:$PATH"\ncd {cwd}\n'
    script += "".join(f'{c}\necho "{MARKER}$?"\n' for _, c in steps)
    done = subprocess.run(
        ["bash", "--login", "-s"],
        input=script,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=login_shell_env(home),
    )
    parts = done.stdout.split(MARKER)
    outputs = [parts[0]] + [p.split("\n", 1)[1] if "\n" in p else "" for p in parts[1:]]
    codes = [int(p.split("\n", 1)[0]) for p in parts[1:]]
    if len(codes) != len(steps):
        raise AssertionError(f"the shell stopped after {len(codes)} of {len(steps)} commands:\n"
                             + done.stdout[-3000:] + done.stderr[-3000:])  # fmt: skip
    return [
        Ran(b, c, code, out, done.stderr)
        for (b, c), code, out in zip(steps, codes, outputs, strict=False)
    ]


def by_page(runs: list[Block]) -> dict[Path, list[Block]]:
    out: dict[Path, list[Block]] = {}
    for b in runs:
        out.setdefault(b.page, []).append(b)
    return out


def check(ran: list[Ran]) -> None:
    """Every command ended as its block says."""
    wrong = [r for r in ran if r.code != r.block.exit]
    assert not wrong, "\n\n".join(str(r) for r in wrong)


def login_path(home: Path) -> str:
    """The PATH a fresh login shell has, before anything of ours."""
    done = subprocess.run(
        ["bash", "--login", "-c", 'printf %s "$PATH"'],
        capture_output=True, text=True, timeout=30, env=login_shell_env(home),
    )  # fmt: skip
    return done.stdout

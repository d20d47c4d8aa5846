"""What a lab run says while it runs: one line per phase, on stderr for
``lab run`` (the demo relays them), so that nothing is silent for more than a
few seconds and an operator can rehearse the runbook on the lab.

The phases: the nodes made; each agent listening (read from its log) and,
once all are, the commands that reach them from the host's shell, as
printed (``client_commands``); the ranks started; each fault as it takes
effect (the runner's from the injector's records, the ranks' own from their
reports); the job stuck (no rank moved for ``STUCK_S``) or moving again;
what the agents say of the stall (detected, a peer's request, a dump
written: their logs); every node dumped, and the command for the verdict.
A dump is told once it stands: an agent that detected a stall a peer
detected first rewrites its dump under the peer's incident id (the peers
converge on the earlier one), so a dump is told ``HOLD_S`` after it was
written, as the file it became (what was folded into what is said).
Between them, a heartbeat (what is awaited, and for how long) every
``HEARTBEAT_S`` for the first minute of a wait, every ``SLOW_HEARTBEAT_S``
after it.

Shell words are quoted for a person to read (``command_text``): SQL with
single quotes goes in double quotes where nothing in it would expand.
"""

from __future__ import annotations

import re
import shlex
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

HEARTBEAT_S = 5.0
SLOW_HEARTBEAT_S = 30.0
STUCK_S = 3.0  # no rank moved for this long: the job is said to be stuck
WIDTH = 96  # printed commands are wrapped to this many columns
# A dump is told this long after its agent wrote it, unless a relabelling
# tells it first: two agents that detect one stall converge on one incident
# id at once (the detector notifies its peers before it writes), well
# within a second on a loaded machine; twice that, to be safe.
HOLD_S = 2.0


AGENT_PATTERNS: tuple[tuple[str, re.Pattern[str], str], ...] = (  # the first match counts
    ("listening", re.compile(r"listening on (\S+)"), "agent up, listening on {0}"),
    ("recording", re.compile(r"recording pid (\d+)"), "agent records rank process {0}"),
    ("dump", re.compile(r"incident (\S+): dump written to (\S+)"), "dump written: {1}"),
    (
        "relabel",
        re.compile(r"incident (\S+) is (.+)'s (\S+): relabelling"),
        "its incident {0} is {1}'s {2}: its dump is rewritten under that id",
    ),
    ("verdict", re.compile(r"incident \S+: verdict: (.*)"), "verdict: {0}"),
    ("peer", re.compile(r"incident \S+ \(peer\): (.*)"), "a peer asks for a dump: {0}"),
    ("asked", re.compile(r"incident \S+ \(manual\): (.*)"), "a dump is asked for: {0}"),
    ("stall", re.compile(r"incident \S+ \((\w+)\): (.*)"), "stall detected ({0}): {1}"),
    ("stopping", re.compile(r"stopping: (.*)"), "agent stopping: {0}"),
    ("stopped", re.compile(r"INFO stopped$"), "agent stopped"),
)


def agent_line(line: str) -> tuple[str, str] | None:
    """(kind, what to say) of an agent's log line worth telling, or None."""
    found = agent_event(line)
    return None if found is None else (found[0], found[2])


def agent_event(line: str) -> tuple[str, tuple[str, ...], str] | None:
    """(kind, the parts it names, what to say) of an agent's log line worth
    telling, or None."""
    for kind, pattern, text in AGENT_PATTERNS:
        m = pattern.search(line)
        if m is not None:
            return kind, m.groups(), text.format(*m.groups())
    return None


@dataclass(frozen=True, slots=True)
class _Fold:
    old: str  # the agent's own incident id
    origin: str  # whose incident it was folded into ("node1", "a peer")


@dataclass(slots=True)
class DumpLines:
    """Each agent's dumps, told once they stand (``HOLD_S``): a dump that
    an agent rewrote under a peer's incident id is told as the file it
    became, with what was folded into what; one rewritten after it was told
    is said to be."""

    held: dict[tuple[str, str], tuple[str, float]] = field(default_factory=dict)
    told: dict[tuple[str, str], str] = field(default_factory=dict)  # (agent, incident) -> file
    folds: dict[tuple[str, str], _Fold] = field(default_factory=dict)  # by the new id

    def written(self, agent: str, incident: str, path: str) -> None:
        self.held[(agent, incident)] = (path, time.monotonic())

    def relabelled(self, agent: str, old: str, origin: str, new: str) -> str | None:
        """What to say now, if anything (a dump already told is rewritten)."""
        self.held.pop((agent, old), None)
        before = self.folds.pop((agent, old), None)  # folded once already: its own id stays
        self.folds[(agent, new)] = _Fold(before.old if before else old, origin)
        told = self.told.pop((agent, old), None)
        if told is None:
            return None
        return f"its incident {old} is {origin}'s {new}: {told} is rewritten under that id"

    def standing(self, everything: bool = False) -> list[tuple[str, str]]:
        """(agent, what to say) of the dumps held ``HOLD_S`` (or all)."""
        now, out = time.monotonic(), []
        for key, (path, at) in list(self.held.items()):
            if everything or now - at >= HOLD_S:
                del self.held[key]
                self.told[key] = path
                fold = self.folds.pop(key, None)
                text = f"dump written: {path}"
                if fold is not None:
                    text += f" (its own incident {fold.old} folded into {fold.origin}'s {key[1]})"
                out.append((key[0], text))
        return out


@dataclass(slots=True)
class LogTail:
    """The complete lines a log file gained since the last look."""

    path: Path
    offset: int = 0

    def new_lines(self) -> list[str]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        complete = data[: data.rfind(b"\n") + 1]
        self.offset += len(complete)
        return complete.decode(errors="replace").splitlines()


@dataclass(slots=True)
class Narrator:
    """Says each line once, with the seconds since the run began; keeps
    what it said about agents (how many listen, which dumped)."""

    out: TextIO | None
    started: float = field(default_factory=time.monotonic)
    last: float = field(default_factory=time.monotonic)
    phase_since: float = field(default_factory=time.monotonic)
    tails: dict[str, LogTail] = field(default_factory=dict)
    listening: set[str] = field(default_factory=set)
    dumped: set[str] = field(default_factory=set)
    told: set[str] = field(default_factory=set)  # keys of things said once
    dumps: DumpLines = field(default_factory=DumpLines)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def say(self, text: str) -> None:
        with self.lock:
            self.last = time.monotonic()
            if self.out is not None:
                elapsed = self.last - self.started
                print(f"[{elapsed:5.1f}s] {text}", file=self.out, flush=True)

    def once(self, key: str, text: str) -> None:
        if key not in self.told:
            self.told.add(key)
            self.say(text)

    def phase(self) -> None:
        """A new wait begins: its heartbeat starts fast again."""
        self.phase_since = time.monotonic()

    def heartbeat(self, what: Callable[[], str]) -> None:
        now = time.monotonic()
        every = HEARTBEAT_S if now - self.phase_since < 60 else SLOW_HEARTBEAT_S
        if now - self.last >= every:
            self.say(what())

    def agent_logs(self, logs: dict[str, Path], everything: bool = False) -> None:
        """Tell what each agent's log (by name) says that matters; the dumps
        once they stand (``everything``: all of them now)."""
        for name, path in logs.items():
            tail = self.tails.setdefault(name, LogTail(path))
            for line in tail.new_lines():
                found = agent_event(line)
                if found is None:
                    continue
                kind, parts, text = found
                if kind == "listening":
                    self.listening.add(name)
                if kind == "dump":
                    self.dumped.add(name)
                    self.dumps.written(name, *parts)
                    continue
                if kind == "relabel":
                    said = self.dumps.relabelled(name, *parts)
                    if said is not None:
                        self.say(f"{name}: {said}")
                    continue
                self.say(f"{name}: {text}")
        for name, text in self.dumps.standing(everything):
            self.say(f"{name}: {text}")


# --- commands a person runs ------------------------------------------------------


def quote(arg: str) -> str:
    """shlex.quote, but SQL with single quotes goes in double quotes when that
    is safe (nothing the shell expands inside them): easier to read."""
    if "'" in arg and not any(c in arg for c in '"$`\\!'):
        return f'"{arg}"'
    return shlex.quote(arg)


def command_text(argv: Sequence[str]) -> str:
    return " ".join(quote(a) for a in argv)


def wrapped(argv: Sequence[str], width: int = WIDTH, indent: str = "    ") -> str:
    """``command_text``, continued on new lines (``\\``) before ``width``:
    each option starts a line with its value, as a shell reads it back."""
    words = [quote(a) for a in argv]
    groups: list[str] = []
    for word in words:
        lone_option = bool(groups) and groups[-1].startswith("-") and " " not in groups[-1]
        if lone_option and not word.startswith("-"):
            groups[-1] += " " + word  # an option and its value stay together
        else:
            groups.append(word)
    lines = [indent + groups[0]]
    for group in groups[1:]:
        if len(lines[-1]) + 1 + len(group) + 2 > width:
            lines[-1] += " \\"
            lines.append(indent + "    " + group)
        else:
            lines[-1] += " " + group
    return "\n".join(_fold_quoted(line, width, indent + "    ") for line in lines)


def _fold_quoted(line: str, width: int, indent: str) -> str:
    """A line too wide for one double-quoted word (SQL) goes on at blanks
    inside the quotes: the shell drops a backslash-newline there too, and
    the blanks it leaves are the same to SQL."""
    head, sep, quoted = line.partition('"')
    plain = quoted.endswith('"') and not any(c in quoted[:-1] for c in '"$`\\!')
    if len(line) <= width or not sep or not plain:
        return line  # nothing to fold, or a word quoted otherwise (quote): kept whole
    out, current = [], head + sep
    for word in quoted.split(" "):
        if len(current) + 1 + len(word) + 2 > width and current.strip():
            out.append(current + " \\")
            current = indent + word
        else:
            current += ("" if current.endswith(('"', " ")) else " ") + word
    return "\n".join([*out, current])


def program() -> list[str]:
    """How to start this stallwatch from a shell: its name where PATH finds
    this one, else the console script beside the interpreter, else the
    interpreter with ``-m``."""
    script = Path(sys.executable).with_name("stallwatch")
    found = shutil.which("stallwatch")
    if found is not None and script.is_file() and Path(found).resolve() == script.resolve():
        return ["stallwatch"]
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-m", "stallwatch"]

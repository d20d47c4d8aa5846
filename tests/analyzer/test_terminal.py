"""Every report in tests/data as ``stallwatch analyze`` prints it on a real
terminal (a pseudo-terminal, resized to 80 and then 120 columns): no line
wider than the terminal, every communicator id whole (short by default, full
with ``--wide``), no word cut (every word on the terminal is one of the plain
report's); piped, one record per line."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import sys
import termios
from pathlib import Path

import pytest

from stallwatch.analyzer import report
from stallwatch.analyzer.pipeline import AnalysisResult, analyze_paths
from stallwatch.analyzer.shortid import shorten

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
WIDTHS = (80, 120)
REPORTS = [p for p in sorted(DATA.iterdir()) if p.is_dir() and p.name != "fr-torch"]
REPORTS += [p for p in sorted((DATA / "fr-torch").iterdir()) if p.is_dir()]

# In the child: each report printed at each width (the terminal resized
# first, as a person would), between markers.
DRIVER = """
import fcntl, struct, sys, termios
from stallwatch.analyzer.pipeline import analyze_paths
from stallwatch.analyzer.report import print_report
for path in sys.argv[2:]:
    result = analyze_paths([path])
    for cols in map(int, sys.argv[1].split(",")):
        for wide in (False, True):
            fcntl.ioctl(1, termios.TIOCSWINSZ, struct.pack("HHHH", 50, cols, 0, 0))
            print(f"@@ {cols} {int(wide)} {path}", flush=True)
            print_report(result, wide=wide)
print("@@ done", flush=True)
"""
ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07\x1b]*(\x07|\x1b\\)")
HEX = re.compile(r"0x[0-9a-f]+")


def on_a_terminal(paths: list[Path]) -> dict[tuple[int, bool, str], list[str]]:
    """What the driver printed on a pseudo-terminal, per (width, wide, path)."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: stdout is the terminal
        os.chdir(ROOT)
        os.execv(sys.executable, [sys.executable, "-c", DRIVER, "80,120", *map(str, paths)])
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 80, 0, 0))
    out = b""
    while b"@@ done" not in out:
        ready, _, _ = select.select([fd], [], [], 120)
        assert ready, out[-2000:].decode(errors="replace")
        try:
            chunk = os.read(fd, 1 << 16)
        except OSError:  # the child is gone
            break
        if not chunk:
            break
        out += chunk
    os.waitpid(pid, 0)
    text = ESCAPES.sub("", out.decode(errors="replace")).replace("\r", "")
    blocks: dict[tuple[int, bool, str], list[str]] = {}
    for part in text.split("@@ ")[1:]:
        head, _, body = part.partition("\n")
        if head.startswith("done"):
            continue
        cols, wide, path = head.split(" ", 2)
        blocks[(int(cols), wide == "1", path)] = body.rstrip("\n").splitlines()
    return blocks


@pytest.fixture(scope="module")
def printed() -> dict[tuple[int, bool, str], list[str]]:
    return on_a_terminal(REPORTS)


@pytest.fixture(scope="module")
def results() -> dict[str, AnalysisResult]:
    return {str(p): analyze_paths([str(p)]) for p in REPORTS}


def _ids(result: AnalysisResult) -> tuple[set[str], set[str]]:
    full = {c.hash_text for r in result.incidents for c in r.incident.comms}
    short = {s for r in result.incidents for s in report.incident_ids(r).values()}
    return full, short


def test_every_report_was_printed_at_both_widths(
    printed: dict[tuple[int, bool, str], list[str]],
) -> None:
    assert len(REPORTS) > 60
    assert set(printed) == {
        (cols, wide, str(p)) for p in REPORTS for cols in WIDTHS for wide in (False, True)
    }


@pytest.mark.parametrize("cols", WIDTHS)
def test_no_line_wider_than_the_terminal_and_every_id_whole(
    cols: int,
    printed: dict[tuple[int, bool, str], list[str]],
    results: dict[str, AnalysisResult],
) -> None:
    for path, result in results.items():
        full, short = _ids(result)
        for wide in (False, True):
            lines = printed[(cols, wide, path)]
            assert lines and lines[0].startswith("incident "), (path, lines[:3])
            wider = [line for line in lines if len(line) > cols]
            assert not wider, (cols, path, wider)
            found = {h for line in lines for h in HEX.findall(line)}
            ids = found & (full | short)
            # every hex word is an id whole, or another 16-digit value whole
            assert all(h in ids or len(h) == 18 for h in found), (path, found - ids)
            assert ids, path
            assert ids <= (full if wide else short), (path, wide, ids)


@pytest.mark.parametrize("cols", WIDTHS)
def test_no_word_is_cut(
    cols: int,
    printed: dict[tuple[int, bool, str], list[str]],
    results: dict[str, AnalysisResult],
) -> None:
    """Every word on the terminal is a word of the plain report (the table's
    rules and its "why:" lines are the terminal's own)."""
    for path, result in results.items():
        for wide in (False, True):
            plain = set(report.to_text(result, show_all=False, wide=wide).split()) | {"why:"}
            words = {w for line in printed[(cols, wide, path)] for w in line.split()}
            cut = {w for w in words - plain if set(w) != {"─"}}
            assert not cut, (cols, wide, path, sorted(cut)[:10])


def test_piped_the_report_keeps_one_record_per_line(results: dict[str, AnalysisResult]) -> None:
    """Not on a terminal: never wrapped, each member's why whole on its row."""
    for path, result in results.items():
        text = report.to_text(result, show_all=True).splitlines()
        for r in result.incidents:
            ids = report.incident_ids(r)
            for t in report.comm_tables(r):
                for m in t.members:
                    row = f"{m.host}" if m.host else ""
                    why = shorten(m.reason, ids)
                    assert any(row in line and why in line for line in text), (path, why)
        assert not any(line.lstrip().startswith("why:") for line in text), path

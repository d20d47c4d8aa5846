"""The README stays a front page (under 10 KB: what it is, the two commands,
what the demo shows, where to go next), and every document any page points
to is in the repository."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from stallwatch.analyzer.pipeline import analyze_paths

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "deploy" / "README.md"]


def test_readme_is_a_front_page() -> None:
    text = README.read_text()
    assert len(text.encode()) < 10 * 1024
    for command in ("make demo", "make test"):
        assert re.search(rf"^{command}\b", text, re.M), command
        target = command.split()[1]
        assert re.search(rf"^{target}:", (ROOT / "Makefile").read_text(), re.M), target
    assert "docs/runbook.md" in text


def test_every_page_pointed_to_exists() -> None:
    for page in PAGES:
        for ref in re.findall(r"\b((?:docs|deploy)/[\w./-]+\.(?:md|json))", page.read_text()):
            assert (ROOT / ref).is_file(), f"{page.relative_to(ROOT)} points to {ref}"


def test_the_readmes_program_prints_each_culprit_of_a_real_incident() -> None:
    """The README's Python block, run as printed on a recorded lab hang (its
    folder in place of dumps/), prints the culprits the analyzer names."""
    block = re.search(r"## From a program.*?```python\n(.*?)```", README.read_text(), re.S)
    assert block is not None
    folder = ROOT / "tests" / "data" / "lab-hang-2x2"
    code = block.group(1).replace('"dumps/"', repr(str(folder)))
    assert str(folder) in code
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    expected = [  # a verdict's ranks, hosts and pids are its culprits, index by index
        f"{v.kind.value} {rank} {host} {pid}"
        for inc in analyze_paths([str(folder)]).incidents
        for v in inc.verdicts
        for rank, host, pid in zip(v.ranks, v.hosts, v.pids, strict=True)
    ]
    assert expected and done.stdout.splitlines() == expected

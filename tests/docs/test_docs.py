"""The README stays a front page (under 10 KB: what it is, the two commands,
what the demo shows, where to go next), and every document any page points
to is in the repository."""

from __future__ import annotations

import re
from pathlib import Path

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

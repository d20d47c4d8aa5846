"""The docs run as printed: every shell block of README.md and docs/*.md
marked runnable (``tests.docs.runnable`` says how a block is marked) runs in
a fresh login shell, each command ending as its block says; the blocks that
need the lab run in the lab phase.  The runbook's blocks run on the lab job
that tests/analyzer/test_live_lab.py makes from the runbook's own rehearsal
command, while it hangs (one lab run for both)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
from pathlib import Path

import pytest

from stallwatch.dumpers.sqltables import HEADLINE_QUERY
from stallwatch.lab.demo import choose_injection
from tests.docs import runnable
from tests.docs.runnable import ROOT, Block, check, of_context, run_in_login_shell
from tests.lab.test_demo import shown_report

HANG = ROOT / "tests" / "data" / "lab-hang-4x2"  # a recorded lab hang: rank 5 never entered


def test_every_runnable_block_is_run_by_a_test_of_the_suite() -> None:
    found = runnable.blocks()
    assert found, "no runnable block"
    by_where = {w: [b for b in found if b.where == w] for w in runnable.CONTEXTS}
    assert all(by_where.values()), {w: len(b) for w, b in by_where.items()}  # every place used
    for b in found:
        assert b.commands, b.name
        needs_lab = b.where in ("runbook", "rehearsal") or any(
            c.startswith(("make demo", "stallwatch lab ")) and "--help" not in c for c in b.commands
        )
        assert b.lab == needs_lab, f"{b.name}: `lab` marks exactly the blocks that need the lab"
    runbook = ROOT / "docs" / "runbook.md"
    assert {b.page for b in found if b.where in ("runbook", "rehearsal")} == {runbook}
    (rehearsal,) = by_where["rehearsal"]
    assert len(rehearsal.commands) == 1 and rehearsal.commands[0].startswith("stallwatch lab run")


def test_the_set_up_puts_stallwatch_on_the_path_of_a_new_login_shell(tmp_path: Path) -> None:
    """scripts/setup links /usr/local/bin/stallwatch to the clone's console
    script; a new login shell (its profile's PATH) finds it there."""
    setup = (ROOT / "scripts" / "setup").read_text()
    assert "LINK=${STALLWATCH_LINK-/usr/local/bin/stallwatch}" in setup
    path = runnable.login_path(tmp_path / "home")
    found = shutil.which("stallwatch", path=path)
    assert found is not None, f"no stallwatch on a login shell's PATH {path}"
    target = Path(found).resolve()
    assert target.name == "stallwatch" and target.parent.parent.name.startswith(".venv"), target


def _run_pages(blocks: list[Block], cwd: Path, home: Path) -> None:
    for page in runnable.by_page(blocks).values():
        check(run_in_login_shell(page, cwd, home))


def test_the_blocks_that_run_in_an_empty_folder(tmp_path: Path) -> None:
    (tmp_path / "here").mkdir()
    blocks = [b for b in of_context("scratch") if not b.lab]
    _run_pages(blocks, tmp_path / "here", tmp_path / "home")


def test_the_blocks_that_run_beside_dumps(tmp_path: Path) -> None:
    """In a folder holding dumps/: a recorded lab hang, as a recorded lab
    run or the demo leaves them."""
    here = tmp_path / "here"
    shutil.copytree(HANG, here / "dumps", ignore=shutil.ignore_patterns("*.md", "*.json"))
    blocks = [b for b in of_context("dumps") if not b.lab]
    _run_pages(blocks, here, tmp_path / "home")


@pytest.mark.lab
def test_the_blocks_that_run_in_the_clone(tmp_path: Path) -> None:
    """``make demo`` as the README prints it, from the clone's root: a
    random rank hangs, the demo names it, and the commands it says to run
    by hand run as printed and print what it showed."""
    (block,) = [b for b in of_context("clone") if b.lab]
    assert block.commands == ("make demo     # the main job: a 4-node training job hangs; "
                              "stallwatch finds the rank",)  # fmt: skip
    home = tmp_path / "home"
    (ran,) = run_in_login_shell([block], ROOT, home)
    out = ran.output
    assert ran.code == 0, ran
    seed = int(re.search(r"stallwatch demo \(seed (\d+)\)", out).group(1))  # type: ignore[union-attr]
    inj = choose_injection(seed, 4, 2)
    assert f"rank {inj.rank} (on node{inj.node})" in out and f"step {inj.step}" in out
    assert f"the analyzer named rank {inj.rank}" in out and "ui.perfetto.dev" in out
    assert str(home / ".cache" / "stallwatch") in out  # the demo's own folder, not the clone
    command, report = shown_report(out, " analyze ")
    assert command.startswith("stallwatch analyze ")  # stallwatch on the PATH: as it ran
    assert f"MISSING_RANK: rank {inj.rank} never entered" in report
    by_hand = out[out.index("== run it by hand") :]
    assert command in by_hand and "lab run" in by_hand and "export --perfetto" in by_hand
    query, _ = shown_report(out, " query ")
    assert shlex.split(query)[-1] == HEADLINE_QUERY
    assert "[" in ran.errors and "dump written" in ran.errors  # progress on stderr
    again = [Block(block.page, block.line, (command,), True, "clone", 1),
             Block(block.page, block.line, (query,), True, "clone", 0)]  # fmt: skip
    analyzed, queried = run_in_login_shell(again, ROOT, home)
    check([analyzed, queried])
    assert analyzed.output.rstrip("\n") == report
    assert os.path.isdir(home / ".cache" / "stallwatch")

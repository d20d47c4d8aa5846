"""The verdict constants' mutation check (bench/constants.py): which constants
it finds, and the source of a mutant."""

from __future__ import annotations

import ast

from bench import constants as C


def test_it_finds_the_rule_thresholds_and_leaves_presentation_out() -> None:
    found = {(c.path, c.name): c for c in C.constants()}
    dead = found[("analyzer/detect/partition.py", "DEAD_BACKOFF")]
    assert dead.value == 2 and dead.is_int
    share = found[("analyzer/detect/cpu.py", "STARVED_LOST_SHARE")]
    assert share.value == 0.5 and not share.is_int
    assert ("recorder/slowdown.py", "LATE_LAST_SHARE") in found
    assert not any(name in C.NOT_RULES for _, name in found)
    assert len(found) >= 50


def test_a_mutant_multiplies_one_assignment_and_keeps_the_module_valid() -> None:
    source = "A = 3\nB = (\n    2 * A\n)  # six\nC_NS = 1_000_000_000 // 4\nD = 0.75\n"
    tree = ast.parse(source)
    known: dict[str, float] = {}
    values = {}
    for stmt in tree.body:
        name, value = C._assignment(stmt)
        assert name is not None and value is not None
        number = C._number(value, known)
        assert number is not None
        known[name] = values[name] = number
    assert values == {"A": 3, "B": 6, "C_NS": 250_000_000, "D": 0.75}
    b = C.Constant("rules.py", "B", 2, 4, 6.0, True)
    mutant = C.mutated_source(source, b, 0.5)
    namespace: dict[str, object] = {}
    exec(compile(mutant, "mutant", "exec"), namespace)
    assert (namespace["A"], namespace["B"], namespace["C_NS"]) == (3, 3, 250_000_000)
    d = C.Constant("rules.py", "D", 6, 6, 0.75, False)
    namespace = {}
    exec(compile(C.mutated_source(source, d, 2.0), "mutant", "exec"), namespace)
    assert namespace["D"] == 1.5


def test_a_mutant_whose_tests_time_out_is_not_counted_killed() -> None:
    """No test failed: nothing shows the constant pinned (before, a timeout
    read as a kill)."""
    killed, by = C._pytest(C.ROOT, ["tests/bench/test_constants.py"], timeout=0.01)
    assert (killed, by) == (False, "timed out")

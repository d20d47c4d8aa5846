"""Does every verdict constant matter?  Each threshold of a rule that decides
an incident or a verdict is multiplied by 2 and by 0.5, one at a time, in a
copy of the checkout, and the tests are run on the copy: a mutant that no
test notices is a constant nothing pins (a derivation that no case checks).

    python -m bench.constants [--only NAME,...] [--list] [--keep DIR]

The constants are the module-level numbers of the rule modules
(``MODULES``), but those that only shape what is shown or how fast it is
computed (``NOT_RULES``, each with why).  Each mutant runs first the test
files that name its constant or its module, then, if they all pass, the
rest of the unit tests (no lab, no eBPF): the first failure kills it.
Prints one line per mutant and the survivors; exit 1 if any survived.
"""

from __future__ import annotations

import argparse
import ast
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = (
    "analyzer/detect/*.py",
    "analyzer/frontier.py",
    "analyzer/streams.py",
    "analyzer/unanchored.py",
    "analyzer/incident.py",
    "analyzer/late.py",
    "recorder/slowdown.py",
    "recorder/stallbound.py",
)
# constants of those modules that decide no verdict: what is shown, how much
# is computed at once, and identifiers of the formats
NOT_RULES = {
    "MAX_LISTED": "how many evidence lines a verdict lists",
    "MAX_FRAMES_SHOWN": "how many stack frames a verdict shows",
    "EVIDENCE_LINES": "how many alignments a verdict names",
    "GRID_CHUNK": "how many calls are scored at once (memory, not outcome)",
    "P99_SAMPLE": "how many durations are sampled for a p99 (speed)",
    "UNKNOWN_DTYPE": "the format's code of an unknown datatype",
    "NO_SEQ": "a sentinel above any seq",
    "SK_RST_REASON_TCP_STATE": "the kernel's enum value of a reset's reason",
    "BUCKET_CAP": "how many samples a bucket keeps (memory)",
    "SEQS_KEPT": "how many collectives wait for their local members (memory)",
    "OPEN_MAX": "how many rows stay open (memory)",
    "SECOND_NS": "a unit",
    "MS": "a unit",
}
UNIT_TESTS = ["tests/analyzer", "tests/recorder", "tests/dumpers", "tests/lab/test_zoo.py"]
MARKS = "not lab and not bpf and not realnccl"


@dataclass(frozen=True, slots=True)
class Constant:
    path: str  # relative to the checkout
    name: str
    line: int  # 1-based, where its assignment begins
    end_line: int
    value: float
    is_int: bool

    @property
    def module(self) -> str:
        return self.path.removesuffix(".py").replace("/", ".")


def _number(node: ast.expr, known: dict[str, float]) -> float | None:
    """The value of a literal arithmetic expression (over numbers and the
    module's constants seen before it), or None."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return float(node.value)
    if isinstance(node, ast.Name):
        return known.get(node.id)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = _number(node.operand, known)
        return None if v is None else -v
    if isinstance(node, ast.BinOp):
        a, b = _number(node.left, known), _number(node.right, known)
        if a is None or b is None:
            return None
        ops = {ast.Add: a + b, ast.Sub: a - b, ast.Mult: a * b}
        if isinstance(node.op, ast.Div | ast.FloorDiv) and b:
            return a / b if isinstance(node.op, ast.Div) else a // b
        if isinstance(node.op, ast.LShift):
            return float(int(a) << int(b))
        return ops.get(type(node.op))
    return None


def constants(root: Path = ROOT) -> Iterator[Constant]:
    for pattern in MODULES:
        for path in sorted(root.glob(pattern)):
            tree = ast.parse(path.read_text())
            known: dict[str, float] = {}
            for stmt in tree.body:
                target, value = _assignment(stmt)
                if target is None or value is None:
                    continue
                number = _number(value, known)
                if number is None:
                    continue
                known[target] = number
                if target in NOT_RULES or not target.isupper():
                    continue
                is_int = not _has_float(value)
                rel = path.relative_to(root).as_posix()
                end = stmt.end_lineno or stmt.lineno
                yield Constant(rel, target, stmt.lineno, end, number, is_int)


def _assignment(stmt: ast.stmt) -> tuple[str | None, ast.expr | None]:
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
        target = stmt.targets[0]
        return (target.id, stmt.value) if isinstance(target, ast.Name) else (None, None)
    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value:
        return stmt.target.id, stmt.value
    return None, None


def _has_float(node: ast.expr) -> bool:
    for n in ast.walk(node):
        if isinstance(n, ast.Constant) and isinstance(n.value, float):
            return True
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div):
            return True
    return False


def mutated_source(text: str, c: Constant, factor: float) -> str:
    """The module's text with the constant's assignment multiplied."""
    lines = text.splitlines(keepends=True)
    value = int(c.value * factor) if c.is_int else c.value * factor
    head = lines[c.line - 1]
    indent = head[: len(head) - len(head.lstrip())]
    lines[c.line - 1 : c.end_line] = [f"{indent}{c.name} = {value!r}  # mutant x{factor:g}\n"]
    return "".join(lines)


def _copy(dest: Path) -> None:
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.split(b"\0")  # fmt: skip
    for raw in files:
        if not raw:
            continue
        rel = Path(raw.decode())
        src, dst = ROOT / rel, dest / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            dst.symlink_to(src.readlink())
        elif src.is_file():
            shutil.copy2(src, dst)


def _targeted(copy: Path, c: Constant) -> list[str]:
    """Test files that name the constant or import its module, first."""
    stem = c.module.rsplit(".", 1)[-1]
    hits = []
    for test in sorted((copy / "tests").rglob("test_*.py")):
        text = test.read_text()
        if c.name in text or f"{stem} import" in text or f".{stem}" in text:
            hits.append(test.relative_to(copy).as_posix())
    return hits


def _pytest(copy: Path, paths: list[str], timeout: float) -> tuple[bool, str]:
    """(killed, by what) after running ``paths`` on the copy."""
    if not paths:
        return False, ""
    argv = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-m", MARKS,
            "-n", "2", "--no-header", *paths]  # fmt: skip
    try:
        done = subprocess.run(argv, cwd=copy, capture_output=True, text=True, timeout=timeout,
                              env=_env(copy))  # fmt: skip
    except subprocess.TimeoutExpired:  # no test failed: nothing says it is pinned
        return False, "timed out"
    if done.returncode in (0, 5):  # passed, or nothing collected
        return False, ""
    failed = [ln for ln in done.stdout.splitlines() if ln.startswith("FAILED") or "Error" in ln]
    return True, (failed[0] if failed else done.stdout.strip().splitlines()[-1])[:160]


def _env(copy: Path) -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": str(copy)}


def run_mutant(copy: Path, c: Constant, factor: float, timeout: float) -> tuple[bool, str]:
    path = copy / c.path
    original = path.read_text()
    path.write_text(mutated_source(original, c, factor))
    try:
        targeted = _targeted(copy, c)
        killed, by = _pytest(copy, targeted, timeout)
        if not killed:
            rest = [p for p in UNIT_TESTS if p not in targeted]
            killed, by = _pytest(copy, rest, timeout)
        return killed, by
    finally:
        path.write_text(original)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.constants", description=__doc__.split("\n")[0]
    )
    p.add_argument("--only", default="", help="these constants (comma separated names)")
    p.add_argument("--list", action="store_true", help="list the constants; mutate nothing")
    p.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds a mutant's tests may take"
    )
    p.add_argument("--keep", type=Path, default=None, help="make the copy here and keep it")
    args = p.parse_args(argv)
    only = {n.strip() for n in args.only.split(",") if n.strip()}
    found = [c for c in constants() if not only or c.name in only]
    if args.list:
        for c in found:
            print(f"{c.path}:{c.line} {c.name} = {c.value:g}")
        return 0
    base = args.keep or Path(tempfile.mkdtemp(prefix="stallwatch-mutants-"))
    copy = base / "checkout"
    _copy(copy)
    shared = base / "shared"  # the fixtures the tests read beside the checkout
    if (ROOT.parent / "shared").is_dir() and not shared.exists():
        shared.symlink_to(ROOT.parent / "shared")
    survivors = []
    try:
        for c in found:
            for factor in (2.0, 0.5):
                t0 = time.monotonic()
                killed, by = run_mutant(copy, c, factor, args.timeout)
                took = time.monotonic() - t0
                mark = f"killed by {by}" if killed else "SURVIVED" + (f" ({by})" if by else "")
                print(f"{c.path}:{c.line} {c.name} x{factor:g}: {mark} ({took:.0f} s)", flush=True)
                if not killed:
                    survivors.append(f"{c.name} x{factor:g}")
    finally:
        if args.keep is None:
            shutil.rmtree(base, ignore_errors=True)
    print(f"{len(found)} constants, {2 * len(found)} mutants, {len(survivors)} survived"
          + (f": {', '.join(survivors)}" if survivors else ""))  # fmt: skip
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())

"""Accuracy on the Flight Recorder corpus: each run of tests/data/fr-torch
(dumps a real PyTorch wrote), its truth, the first verdict its dumps support,
stallwatch's first verdict, and, when torch is installed, what torchfrtrace
(torch's own analyzer) reports on the same pickles.

    python -m bench.bench_accuracy [--markdown]

A figure per run: 1 when stallwatch's first verdict (kind and world ranks) is
the one the dumps support, else 0.  ``--markdown`` prints the table of
docs/flight-recorder.md instead.

Then the other direction: recorded lab incidents (tests/data/lab-hang-2x2,
lab-hang-4x2, lab-desync-*, lab-crash-*) exported as Flight Recorder files (``stallwatch
export --flight-recorder``, with and without their point-to-point calls): our
verdict on the files (the same as on the dumps, or the figure fails) and, when
torch is installed, what torchfrtrace reports first on them (the figure fails
when it does not name our culprit).  ``--markdown-export`` prints that table.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.bench_flightrec import has_torchfrtrace
from bench.common import Figure, render

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "data" / "fr-torch"
FR_TIMEOUT_S = 300


@dataclass(frozen=True, slots=True)
class Row:
    run: str
    job: str
    truth: str
    supported: str  # what the dumps support (the expected first verdict)
    ours: str
    theirs: str | None  # torchfrtrace's report, None when torch is not installed

    @property
    def right(self) -> bool:
        return self.ours == self.supported


def _verdict(kind: str, ranks: list[int]) -> str:
    return f"{kind} {ranks}" if ranks else kind


def _ours(folder: Path) -> str:
    from stallwatch.analyzer.pipeline import analyze_paths

    (incident,) = analyze_paths([str(folder)]).incidents
    v = incident.verdicts[0]
    return _verdict(v.kind.value, list(v.ranks))


def torchfrtrace(folder: Path, prefix: str) -> str:
    """What torchfrtrace reports first: missing ranks, a culprit of a
    mismatch, that it cannot decide, nothing, or how it failed."""
    cmd = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(folder)]
    try:
        done = subprocess.run(
            [*cmd, "--prefix", prefix],
            capture_output=True,
            text=True,
            timeout=FR_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"no answer in {FR_TIMEOUT_S} s"
    text = done.stdout + done.stderr
    if "Traceback (most recent call last)" in text:
        last = [line for line in text.splitlines() if line.strip()][-1].strip()
        missing = re.search(r"Missing dump files from ranks (\{[\d, ]+\})", last)
        if missing:
            return f"stops: no dump of {missing.group(1)}"
        return f"crashes: {last[:60]}"
    for pattern, form in (
        (r"missing ranks: (\{[\d, ]+\})", "missing ranks {}"),
        (r"error msg: Culprit rank (\d+); Error type: (\w+)", "culprit rank {} ({})"),
        (r"missed FR dumps from ranks \((\{[\d, ]+\})\)", "cannot decide: no dump of {}"),
    ):
        m = re.search(pattern, text)
        if m:
            return form.format(*m.groups())
    return "no errors found"


# The 16-rank NCCL fixtures (outside the repository, when present): the ranks
# made to fail in each incident, from their source's description
FIXTURES = ROOT.parent / "shared" / "fixtures" / "pytorch-fr-nccl-16rank"
FIXTURE_TRUTH = {
    "gpu_error_1st": [12, 14],
    "gpu_error_2nd": [9, 14],
    "lock_gil_1st": [9, 14],
    "lock_gil_2nd": [10, 15],
}


def fixture_rows(with_torch: bool) -> list[Row]:
    out = []
    for name, ranks in FIXTURE_TRUTH.items():
        folder = FIXTURES / name
        if not folder.is_dir():
            continue
        truth = _verdict("missing_rank", ranks)
        out.append(
            Row(
                f"nccl-16rank/{name}",
                "real NCCL job (2.9 dumps): GPU error or GIL held on these ranks",
                truth,
                truth,
                _ours(folder),
                torchfrtrace(folder, "_dump_") if with_torch else None,
            )
        )
    return out


def rows(with_torch: bool) -> list[Row]:
    out = fixture_rows(with_torch)
    for exp in sorted(CORPUS.glob("*/expected.json")):
        doc = json.loads(exp.read_text())
        folder = exp.parent / "pickle"
        truth, want = doc["truth"], doc["verdict"]
        out.append(
            Row(
                exp.parent.name,
                doc["job"],
                _verdict(truth["kind"], truth["ranks"]),
                _verdict(want["kind"], want["ranks"]),
                _ours(folder),
                torchfrtrace(folder, "nccl_trace_rank_") if with_torch else None,
            )
        )
    return out


LAB = ROOT / "tests" / "data"
LAB_INCIDENTS = {
    f"{name}{wrapped}": LAB / f"lab-{name}{wrapped}"
    for name in ("hang-2x2", "crash-2x2", "crash-4x2", "desync-2x2", "desync-4x2", "hang-4x2")
    for wrapped in ("", "-wrapped")  # -wrapped: every rank's window incomplete
}


@dataclass(frozen=True, slots=True)
class ExportRow:
    incident: str
    dumps: str  # our first verdict on the dumps
    back: str  # ours on the exported files
    theirs: str | None  # torchfrtrace on the files, None when torch is not installed
    theirs_collectives: str | None  # ... on the files without point-to-point calls

    @property
    def right(self) -> bool:
        return self.back == self.dumps

    @property
    def same_culprit(self) -> bool | None:
        """Whether torchfrtrace's first report (on the files it can read)
        names our first verdict's ranks."""
        if self.theirs_collectives is None:
            return None
        ranks = set(re.findall(r"\d+", self.dumps.split(" ", 1)[-1]))
        return bool(ranks) and set(re.findall(r"\d+", self.theirs_collectives)) == ranks


def export_rows(with_torch: bool) -> list[ExportRow]:
    import tempfile

    from stallwatch.analyzer.frexport import export_flight_recorder
    from stallwatch.analyzer.pipeline import analyze_paths

    out = []
    for name, folder in LAB_INCIDENTS.items():
        result = analyze_paths([str(folder)])
        with tempfile.TemporaryDirectory(prefix="bench-fr-export-") as tmp:
            whole, collectives = Path(tmp) / "all", Path(tmp) / "collectives"
            export_flight_recorder(result.incidents, whole)
            export_flight_recorder(result.incidents, collectives, p2p=False)
            v = result.incidents[0].verdicts[0]
            out.append(
                ExportRow(
                    name,
                    _verdict(v.kind.value, list(v.ranks)),
                    _ours(whole),
                    torchfrtrace(whole, "rank_") if with_torch else None,
                    torchfrtrace(collectives, "rank_") if with_torch else None,
                )
            )
    return out


def export_markdown(table: list[ExportRow]) -> str:
    head = (
        "| incident | stallwatch on the dumps | stallwatch on the files | torchfrtrace | "
        "torchfrtrace, p2p calls left out |\n|---|---|---|---|---|"
    )
    lines = [
        f"| {r.incident} | {r.dumps} | {r.back} | {r.theirs or 'not run'} | "
        f"{r.theirs_collectives or 'not run'} |"
        for r in table
    ]
    return "\n".join([head, *lines])


def _export_figures(quick: bool) -> list[Figure]:
    return [
        Figure(
            f"FR export {r.incident}",
            1.0 if r.right else 0.0,
            "",
            f"= {r.dumps}",
            r.right and r.same_culprit is not False,
            f"ours on the files {r.back}"
            + (
                "; torchfrtrace not run"
                if r.theirs is None
                else f"; torchfrtrace: {r.theirs}; p2p calls left out: {r.theirs_collectives}"
            ),
        )
        for r in export_rows(with_torch=has_torchfrtrace() and not quick)
    ]


def figures(quick: bool = False) -> list[Figure]:
    table = rows(with_torch=has_torchfrtrace() and not quick)
    exports = _export_figures(quick)
    figs = [
        Figure(
            f"FR corpus {r.run}",
            1.0 if r.right else 0.0,
            "",
            f"= {r.supported}",
            r.right,
            f"ours {r.ours}; truth {r.truth}"
            + ("" if r.theirs is None else f"; torchfrtrace: {r.theirs}"),
        )
        for r in table
    ]
    figs += exports
    right = sum(r.right for r in table)
    figs.append(
        Figure(
            "FR corpus: first verdict as the dumps support",
            right / max(len(table), 1) * 100,
            "%",
            "= 100 %",
            right == len(table),
            f"{right} of {len(table)} runs"
            + ("" if table and table[0].theirs is not None else "; torchfrtrace not run"),
        )
    )
    return figs


def markdown(table: list[Row]) -> str:
    """One line per job, its 4- and 8-rank runs side by side."""
    head = (
        "| job | fault | truth | the dumps show | stallwatch | torchfrtrace |\n"
        "|---|---|---|---|---|---|"
    )
    jobs: dict[str, list[Row]] = {}
    for r in table:
        jobs.setdefault(re.sub(r"-(4|8)$", "", r.run), []).append(r)

    def cell(values: list[str]) -> str:
        if len(set(values)) == 1:
            return values[0]
        kinds = {v.split(" [")[0] for v in values}
        if len(kinds) == 1 and all(" [" in v for v in values):  # "desync [2] / [4]"
            return kinds.pop() + " " + " / ".join("[" + v.split(" [", 1)[1] for v in values)
        return " / ".join(values)

    lines = []
    for job, runs in jobs.items():
        ours = [r.ours + ("" if r.right else " (WRONG)") for r in runs]
        theirs = [r.theirs if r.theirs is not None else "not run" for r in runs]
        fault = re.sub(r"(rank|stage) \d+", r"\1 k", runs[0].job)
        lines.append(
            f"| {job} | {fault} | {cell([r.truth for r in runs])} | "
            f"{cell([r.supported for r in runs])} | {cell(ours)} | {cell(theirs)} |"
        )
    return "\n".join([head, *lines])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_accuracy", description=__doc__)
    parser.add_argument(
        "--markdown", action="store_true", help="the table of docs/flight-recorder.md"
    )
    parser.add_argument(
        "--markdown-export",
        action="store_true",
        help="the export table of docs/flight-recorder.md",
    )
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown(rows(with_torch=has_torchfrtrace())))
        return 0
    if args.markdown_export:
        print(export_markdown(export_rows(with_torch=has_torchfrtrace())))
        return 0
    figs = figures()
    print(render(figs))
    return 0 if all(f.ok is not False for f in figs) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Stage "report": what people read at 3 a.m., and the JSON for programs.

Text, per incident, in this order: the inputs that could not be read and
what could not be judged without them (the verdicts were reached without
them), the verdicts (kind and one line, the culprits, the evidence), when it
happened (wall clock, UTC) and which agent detected it and why, then one table per
communicator: its frontier (the latest seq any member entered), whether it
is stuck, and per member the last seq entered and returned, its state, and
beside every member not at the frontier, why.  By default the
``MAX_TABLES`` most telling communicators (with laggards first, then stuck
ones, then the largest), ``MAX_TABLE_ROWS`` members each; ``show_all``
shows every one.

Layout.  Communicator ids are shortened (``shortid``: the fewest leading hex
digits that tell the incident's communicators apart); ``wide`` prints them
whole, as the JSON always does.  On a terminal, at any width from 80, lines
wrap between words (continuations indented), no word and no id is cut, and
a table takes the widths its cells need: columns that hold text wrap at
blanks, and when even that does not fit, the "why" of each member goes on a
line under its row instead of a column.  Anywhere else (a pipe, a file) the
text is plain, one line per record, never wrapped, so it can be grepped.

Flight Recorder dumps name no host and no pid: their ranks are shown with
the file they came from, and process groups by their name and description.

JSON (docs/architecture.md, "Analysis JSON"), with, per incident, its time and detector and
the communicator tables, always whole.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.padding import Padding
from rich.text import Text

from stallwatch.dumpers.schema import op_name
from stallwatch.query.output import fit_widths, new_table, plain_text, printable, show

from .culprits import Culprit, culprits, judged_on
from .incident import Frontier, Incident, InputStatus, Member, MemberState, SourceKind
from .pipeline import AnalysisResult, IncidentResult
from .shortid import short_ids, shorten
from .verdict import Verdict, VerdictKind

MAX_TABLES = 8
MAX_TABLE_ROWS = 64
MAX_LISTED = 10  # values of a list shown in a line; the rest are counted


# ---- what the tables hold -------------------------------------------------


@dataclass(frozen=True, slots=True)
class MemberRow:
    rank: int | None  # in the communicator, None where no evidence tells it
    world_rank: int | None
    host: str | None  # the file, for inputs that name no host
    pid: int | None
    last_entered: int | None
    last_returned: int | None
    state: str  # for people: "at frontier, in flight"
    in_flight: bool
    reason: str  # why it is not at the frontier ("" when it is); a culprit's verdict
    kind: MemberState = MemberState.AT_FRONTIER
    culprit: str | None = None  # the kind of the verdict that names it here


@dataclass(frozen=True, slots=True)
class CommTable:
    comm_id_hash: str
    group: str  # the process group, where the input names it
    nranks: int | None  # None where no evidence tells it (a member's dump lost)
    is_split: bool
    seq: int  # the frontier
    op: str
    status: str  # stuck | idle (every member returned) | moving
    age_ns: int | None  # how long the frontier has made no progress
    members: tuple[MemberRow, ...]
    laggards: int
    size: str = ""  # for people: "4 ranks", "at least 2 ranks"
    nranks_min: int = 0  # where nranks is unknown: the fewest it has

    @property
    def headline(self) -> str:
        age = f" for {self.age_ns / 1e9:.1f} s" if self.age_ns is not None else ""
        status = {
            "stuck": f"stuck{age}",
            "idle": f"every rank returned, none called again{age}",
            "moving": "moving",
        }[self.status]
        return f"{self.size}, frontier seq {self.seq} {self.op}, {status}"

    def to_json(self, short_id: str | None = None) -> dict[str, object]:
        return {
            "comm_id_hash": self.comm_id_hash,
            "short_id": short_id,
            "group": self.group or None,
            "nranks": self.nranks,
            "nranks_min": self.nranks_min,
            "is_split": self.is_split,
            "frontier_seq": self.seq,
            "op": self.op,
            "status": self.status,
            "age_s": None if self.age_ns is None else round(self.age_ns / 1e9, 3),
            "members": [
                {
                    "rank": m.rank,
                    "world_rank": m.world_rank,
                    "host": m.host,
                    "pid": m.pid,
                    "last_entered": m.last_entered,
                    "last_returned": m.last_returned,
                    "state": m.kind.name.lower(),
                    "in_flight": m.in_flight,
                    "reason": m.reason or None,
                    "culprit": m.culprit,
                }
                for m in self.members
            ],
        }


def comm_tables(r: IncidentResult) -> list[CommTable]:
    """Every communicator's table: first those where a verdict judged its
    culprits (in the verdicts' order, each culprit's row marked with the
    verdict), then the most telling."""
    last = _last_calls(r.incident)
    tables = [_comm_table(r.incident, f, last) for f in r.frontiers]
    rank = {"stuck": 0, "idle": 1, "moving": 2}
    tables.sort(key=lambda t: (not t.laggards, rank[t.status], -(t.nranks or t.nranks_min)))
    judged = _judged_comms(r)
    marked = {t.comm_id_hash: _marked(r, t) for t in tables if t.comm_id_hash in judged}
    first = [marked[h] for h in judged if h in marked]
    return first + [t for t in tables if t.comm_id_hash not in marked]


def _judged_comms(r: IncidentResult) -> list[str]:
    """The communicators where the verdicts judged their culprits, in order."""
    found = [judged_on(v, i) for v in r.verdicts for i in range(len(v.ranks))]
    return list(dict.fromkeys(h for h in found if h))


def judged_count(r: IncidentResult) -> int:
    """How many of ``comm_tables`` are where a verdict judged its culprits."""
    return len(_judged_comms(r))


def _marked(r: IncidentResult, t: CommTable) -> CommTable:
    """The table with each culprit judged on it marked: "CULPRIT (kind):"
    and why, from the verdict's evidence on this communicator."""
    inc = r.incident
    rows = list(t.members)
    for v in r.verdicts:
        for c in culprits(inc, v, r.frontiers):
            if c.communicator != t.comm_id_hash:
                continue
            at = next((i for i, m in enumerate(rows) if m.rank == c.rank), None)
            if at is None or c.rank is None:
                continue
            why = _evidence_on(inc, v, c) or rows[at].reason or v.summary
            reason = f"CULPRIT ({v.kind.value}): {why}"
            rows[at] = dataclasses.replace(rows[at], reason=reason, culprit=v.kind.value)
    return dataclasses.replace(t, members=tuple(rows))


def _evidence_on(inc: Incident, v: Verdict, c: Culprit) -> str:
    """The verdict's evidence about this culprit on its communicator."""
    if c.proc < 0:
        return ""
    label = inc.procs[c.proc].label()
    comm = next((x for x in inc.comms if x.hash_text == c.communicator), None)
    for e in v.evidence:
        if e.startswith(label) and comm is not None and f"{comm.name}: " in e:
            return e.split(f"{comm.name}: ", 1)[1]
    return ""


def _status(f: Frontier) -> str:
    if not f.stuck:
        return "moving"
    waiting = any(m.in_flight and m.state is MemberState.AT_FRONTIER for m in f.members)
    return "stuck" if f.laggards or waiting else "idle"


def _comm_table(inc: Incident, f: Frontier, last: dict[int, int]) -> CommTable:
    comm = inc.comms[f.comm]
    rows = tuple(_member_row(inc, f, m, last) for m in f.members)
    size = comm.nranks if comm.exact else (comm.size if comm.size >= 0 else None)
    return CommTable(
        comm.hash_text,
        comm.group,
        size,
        comm.is_split,
        f.seq,
        op_name(f.op),
        _status(f),
        f.age_ns,
        rows,
        len(f.laggards),
        comm.size_text,
        size if size is not None else comm.size_min,
    )


def _member_row(inc: Incident, f: Frontier, m: Member, last: dict[int, int]) -> MemberRow:
    p = inc.procs[m.proc] if m.proc >= 0 else None
    state = m.state.value
    if m.state is MemberState.AT_FRONTIER:
        state += ", in flight" if m.in_flight else ", returned"
    rank = inc.comms[f.comm].rank_of(m.crank)
    return MemberRow(
        rank=rank if rank >= 0 else None,
        world_rank=p.world_rank if p is not None and p.world_rank >= 0 else None,
        host=p.host if p is not None else None,
        pid=p.pid if p is not None and not p.from_file else None,
        last_entered=m.last_seq if m.last_seq >= 0 else None,
        last_returned=m.last_returned if m.last_returned >= 0 else None,
        state=state,
        in_flight=m.in_flight,
        reason=_reason(inc, f, m, last),
        kind=m.state,
    )


_REASONS = {
    MemberState.NO_ROWS: "no call on this communicator in its recorded window",
    MemberState.UNKNOWN: "its ring wrapped past this communicator's calls",
    MemberState.NO_DUMP: "no readable input holds this rank",
}


def _reason(inc: Incident, f: Frontier, m: Member, last: dict[int, int]) -> str:
    """Why a member is not at the frontier: how it ended, or its last call."""
    if m.state is MemberState.AT_FRONTIER:
        return ""
    if m.state is MemberState.NO_DUMP and inc.comms[f.comm].may_be_empty(m.crank):
        return "its size is not known: ranks without a readable dump may be members"
    if m.state is MemberState.NO_DUMP and m.last_seq >= 0:
        return f"{_REASONS[m.state]}: its peers' completions prove it entered seq {m.last_seq}"
    if m.state in _REASONS:
        return _REASONS[m.state]
    p = inc.procs[m.proc]
    if p.died_badly:
        return f"exited ({_exit_text(p.exit_code, p.exit_signal)})"
    row = last.get(m.proc)
    if row is None:
        return "no call recorded"
    calls = inc.calls.rows
    comm, end = int(calls["comm"][row]), int(calls["end"][row])
    where = "" if comm == f.comm else f" on {inc.comms[comm].name}"
    what = f"last call {op_name(int(calls['op'][row]))} seq {int(calls['seq'][row])}{where}"
    now = inc.host_now[inc.hosts.index(p.host)] if p.host in inc.hosts else None
    since = now - max(int(calls["ts"][row]), end) if now is not None else None
    age = f" {since / 1e9:.1f} s ago" if since is not None and since >= 0 else ""
    if end == 0:
        return f"{what}, in flight" + (f" (entered{age})" if age else "")
    return f"{what}, returned{age}"


def _exit_text(code: int | None, signal: int | None) -> str:
    return f"killed by signal {signal}" if signal else f"exit code {code}"


def _last_calls(inc: Incident) -> dict[int, int]:
    """Each proc's latest call (row index), by its host's clock."""
    rows = inc.calls.rows
    if not len(rows):
        return {}
    proc, ts = rows["proc"], np.maximum(rows["ts"], rows["end"])
    order = np.lexsort((ts, proc))
    last = order[np.flatnonzero(np.diff(proc[order], append=-1) != 0)]
    return dict(zip(proc[last].tolist(), last.tolist(), strict=True))


# ---- JSON -------------------------------------------------------------------


def _wall(ns: int | None, iso: bool = False) -> str | None:
    if ns is None:
        return None
    t = datetime.fromtimestamp(ns / 1e9, tz=UTC)
    if iso:
        return t.isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return t.strftime("%Y-%m-%d %H:%M:%S.") + f"{t.microsecond // 1000:03d} UTC"


FORMAT_VERSION = 3  # docs/analyze.schema.json; 1: before culprits and enums; 2: before
# ranks and sizes a lost dump leaves unknown (null)


def verdict_json(r: IncidentResult, v: Verdict) -> dict[str, object]:
    """A verdict as JSON: the keys of docs/architecture.md ("Analysis JSON"; its
    ranks, hosts and pids one culprit each, index by index, where it names
    culprits) and one object per culprit."""
    doc = v.to_json()
    found = culprits(r.incident, v, r.frontiers)
    if found:
        doc["ranks"] = [c.world_rank for c in found]
        doc["hosts"] = [c.host for c in found]
        doc["pids"] = [c.pid for c in found]
    doc["culprits"] = [c.to_json() for c in found]
    return doc


def to_json(result: AnalysisResult) -> str:
    doc = {
        "format": FORMAT_VERSION,
        "incidents": [
            {
                "id": r.incident.id,
                "kind": r.incident.kind.value,
                "hosts": list(r.incident.hosts),
                "time": _wall(r.incident.wall_ns, iso=True),
                "detected_by": r.incident.detected_by or None,
                "verdicts": [verdict_json(r, v) for v in r.verdicts],
                "notes": list(r.incident.notes),
                "unjudged": list(r.unjudged),
                "communicators": _tables_json(r),
            }
            for r in result.incidents
        ],
        "inputs": [
            {
                "path": s.path,
                "ok": s.ok,
                "error": s.error,
                "kind": s.kind.value if s.kind else None,
                "checked": not s.unchecked if s.ok and s.kind is SourceKind.STALLWATCH else None,
            }
            for s in result.inputs
        ],
    }
    _validate(doc)
    return json.dumps(doc, indent=2)


def incident_ids(r: IncidentResult) -> dict[str, str]:
    """Each communicator id of the incident to its short form, as the text
    report prints it."""
    return short_ids(c.hash_text for c in r.incident.comms)


def _tables_json(r: IncidentResult) -> list[dict[str, object]]:
    ids = incident_ids(r)
    return [t.to_json(ids.get(t.comm_id_hash)) for t in comm_tables(r)]


def _validate(doc: dict[str, object]) -> None:
    """With STALLWATCH_VALIDATE_JSON naming a JSON Schema (the test suite
    sets it to docs/analyze.schema.json, for every process it starts), the
    document is checked against it: a key or value the schema does not
    promise fails loudly instead of reaching a program."""
    schema = os.environ.get("STALLWATCH_VALIDATE_JSON")
    if not schema:
        return
    jsonschema = importlib.import_module("jsonschema")  # a test dependency only
    jsonschema.validate(doc, json.loads(Path(schema).read_text()))


# ---- text -------------------------------------------------------------------


def to_text(result: AnalysisResult, show_all: bool = False, wide: bool = False) -> str:
    """The report as plain text (what is printed when not on a terminal)."""
    return plain_text(lambda c: render(c, result, show_all, wide))


def print_report(result: AnalysisResult, show_all: bool = False, wide: bool = False) -> None:
    """The report on stdout: rich tables on a terminal, plain text elsewhere."""
    show(lambda c: render(c, result, show_all, wide))


def render(c: Console, result: AnalysisResult, show_all: bool = False, wide: bool = False) -> None:
    bad = [s for s in result.inputs if s.lost]
    for i, r in enumerate(result.incidents):
        _incident(c, r, bad if i == 0 else [], len(result.inputs), show_all, wide)
    if not result.incidents:
        _unread(c, bad, len(result.inputs), 0)
        _line(c, 0, "nothing could be analyzed")


HANG = 2  # a wrapped line's continuations, this much further in


def _line(c: Console, indent: int, text: str, style: str = "", hang: int = HANG) -> None:
    """One record: on a terminal wrapped between words to its width, the
    continuations indented; elsewhere one line."""
    text = printable(text)
    if not c.is_terminal:
        c.print(Text(" " * indent + text))
        return
    lines = textwrap.wrap(
        text,
        width=c.width,
        initial_indent=" " * indent,
        subsequent_indent=" " * (indent + hang),
        break_long_words=False,
        break_on_hyphens=False,
    )
    c.print(Text("\n".join(lines), style=style))


def _listing(word: str, values: Sequence[object]) -> str:
    """ "rank 5", "ranks 3, 5", "ranks 0, 1, ..., 9 (120 in all)"."""
    shown = ", ".join("unknown" if v is None else str(v) for v in values[:MAX_LISTED])
    more = f", ... ({len(values)} in all)" if len(values) > MAX_LISTED else ""
    return f"{word}{'s' if len(values) != 1 else ''} {shown}{more}"


def _header(inc: Incident) -> str:
    ranks = f"{len(inc.procs)} rank{'s' if len(inc.procs) != 1 else ''}"
    if inc.kind is SourceKind.FLIGHT_RECORDER:
        n = len(inc.sources)
        return f"incident {inc.id}: {n} Flight Recorder file{'s' if n != 1 else ''}, {ranks}"
    hosts = f"{len(inc.hosts)} host{'s' if len(inc.hosts) != 1 else ''}"
    names = ", ".join(inc.hosts[:MAX_LISTED]) + (", ..." if len(inc.hosts) > MAX_LISTED else "")
    read = sum(len(h.snapshots[-1].processes) for h in inc.readings if h.snapshots)
    if read:  # a job that hung before anyone recorded has no ranks, only positions
        ranks += f", {read} process{'es' if read != 1 else ''} read by thread snapshot"
    return f"incident {inc.id}: {hosts} ({names}), {ranks}"


def _incident(
    c: Console,
    r: IncidentResult,
    bad: list[InputStatus],
    n_inputs: int,
    show_all: bool,
    wide: bool = False,
) -> None:
    inc = r.incident
    ids = {} if wide else incident_ids(r)
    _line(c, 0, _header(inc), "bold")
    for note in inc.notes:
        _line(c, 2, f"note: {shorten(note, ids)}")
    _unread(c, bad, n_inputs, 2)
    for u in r.unjudged:
        _line(c, 2, f"not judged: {shorten(u, ids)}", "yellow")
    for v in r.verdicts:
        _verdict(c, inc, _short_verdict(v, ids))
    _when(c, inc, ids)
    tables = [_short_table(t, ids) for t in comm_tables(r)]
    shown = tables if show_all else tables[: max(MAX_TABLES, judged_count(r))]
    for t in shown:
        _table(c, inc, t, show_all)
    if len(shown) < len(tables):
        _line(c, 2, f"({len(tables) - len(shown)} more communicators not shown; --all shows them)")
    _line(c, 0, "")


def _short_verdict(v: Verdict, ids: dict[str, str]) -> Verdict:
    if not ids:
        return v
    return dataclasses.replace(
        v,
        summary=shorten(v.summary, ids),
        evidence=tuple(shorten(e, ids) for e in v.evidence),
        comm_id_hash=shorten(v.comm_id_hash, ids) if v.comm_id_hash else v.comm_id_hash,
    )


def _short_table(t: CommTable, ids: dict[str, str]) -> CommTable:
    if not ids:
        return t
    members = tuple(dataclasses.replace(m, reason=shorten(m.reason, ids)) for m in t.members)
    return dataclasses.replace(t, comm_id_hash=shorten(t.comm_id_hash, ids), members=members)


def _verdict(c: Console, inc: Incident, v: Verdict) -> None:
    bad = v.kind is not VerdictKind.HEALTHY
    style = "bold yellow" if v.kind is VerdictKind.INCONCLUSIVE else "bold red"
    _line(c, 2, f"{v.kind.value.upper()}: {v.summary}", style if bad else "bold green")
    if bad:
        files = inc.kind is SourceKind.FLIGHT_RECORDER
        where = [
            _listing("rank", v.ranks) if v.ranks else "",
            _listing("file" if files else "host", list(dict.fromkeys(v.hosts))) if v.hosts else "",
            _listing("pid", v.pids) if v.pids and any(v.pids) else "",
            f"comm {v.comm_id_hash}" if v.comm_id_hash else "",
            f"seq {v.seq}" if v.seq is not None else "",
            f"op {v.op}" if v.op else "",
        ]
        _line(c, 4, "; ".join(w for w in where if w))
    for e in v.evidence:
        _line(c, 4, f"- {e}")


def _when(c: Console, inc: Incident, ids: dict[str, str]) -> None:
    if inc.wall_ns is None:
        return
    if inc.kind is SourceKind.FLIGHT_RECORDER:
        _line(c, 2, f"time: {_wall(inc.wall_ns)}, the latest entry (the dumps carry no dump time)")
    elif inc.detected_by:
        _line(c, 2, f"time: {_wall(inc.wall_ns)}, detected by {shorten(inc.detected_by, ids)}")
    else:
        _line(c, 2, f"time: {_wall(inc.wall_ns)}, when the latest snapshot was taken")


def _unread(c: Console, bad: list[InputStatus], n_inputs: int, indent: int) -> None:
    if not bad:
        return
    _line(c, indent, f"inputs not read ({len(bad)} of {n_inputs}):", "yellow")
    for s in bad:
        _line(c, indent + 2, f"- {s.error or s.path}")


def _table(c: Console, inc: Incident, t: CommTable, show_all: bool) -> None:
    group = f" ({t.group})" if t.group else ""
    style = "bold" if t.status == "stuck" else ""
    _line(c, 2, f"communicator {t.comm_id_hash}{group}: {t.headline}", style)
    files = inc.kind is SourceKind.FLIGHT_RECORDER
    columns = [("rank", True), ("world", True), ("file" if files else "host", False)]
    columns += [] if files else [("pid", True)]
    columns += [("last entered", True), ("last returned", True), ("state", False), ("why", False)]
    rows = t.members if show_all else _first_rows(t.members)
    body = []
    for m in rows:
        cells = [_cell(m.rank), _cell(m.world_rank), _cell(m.host)]
        cells += [] if files else [_cell(m.pid)]
        cells += [_cell(m.last_entered), _cell(m.last_returned), m.state, m.reason]
        body.append(([printable(x) for x in cells], m))
    if c.is_terminal:
        _fitted_table(c, columns, body)
    else:
        table = new_table(c, columns)
        for cells, _ in body:
            table.add_row(*(Text(x) for x in cells))
        c.print(Padding(table, (0, 0, 0, TABLE_INDENT), expand=False))
    if len(rows) < len(t.members):
        rest = [m for m in t.members if m not in rows]
        lag = sum(1 for m in rest if m.kind is not MemberState.AT_FRONTIER)
        _line(c, 4, f"... {len(rest)} more ranks, {lag} of them not at the frontier")


TABLE_INDENT = 4
WHY_MIN = 30  # narrower than this, a member's why goes on a line under its row


def _fitted_table(
    c: Console, columns: list[tuple[str, bool]], body: list[tuple[list[str], MemberRow]]
) -> None:
    """A member table at the terminal's width: every column as wide as its
    cells need (text wrapping between words where they do not fit), or,
    when the why column would be too narrow, that column as a line under
    each row that has one (no member has one: no column)."""
    room = c.width - TABLE_INDENT
    heads = [h for h, _ in columns]
    rows = [cells for cells, _ in body]
    natural_why = max(len(cells[-1]) for cells in rows) if rows else 0
    widths = fit_widths([heads, *rows], room) if natural_why else None
    if widths is not None and widths[-1] >= min(natural_why, WHY_MIN):
        _rows_table(c, columns, body, widths)
        return
    narrow = fit_widths([heads[:-1], *(cells[:-1] for cells in rows)], room)
    if not natural_why:
        _rows_table(c, columns[:-1], [(cells[:-1], m) for cells, m in body], narrow)
        return
    c.print(Padding(new_table(c, columns[:-1], widths=narrow), (0, 0, 0, TABLE_INDENT)))
    for cells, m in body:  # each row, then its why under it, at the header's widths
        _rows_table(c, columns[:-1], [(cells[:-1], m)], narrow, header=False)
        if m.reason:
            _line(c, TABLE_INDENT + 3, f"why: {m.reason}", _row_style(c, m), hang=5)


def _rows_table(
    c: Console,
    columns: list[tuple[str, bool]],
    body: list[tuple[list[str], MemberRow]],
    widths: list[int] | None,
    header: bool = True,
) -> None:
    table = new_table(c, columns, widths=widths, header=header)
    for cells, m in body:
        table.add_row(*(Text(x) for x in cells), style=_row_style(c, m))
    c.print(Padding(table, (0, 0, 0, TABLE_INDENT), expand=False))


def _first_rows(members: tuple[MemberRow, ...]) -> tuple[MemberRow, ...]:
    """The first MAX_TABLE_ROWS members, and every culprit after them."""
    late = tuple(m for m in members[MAX_TABLE_ROWS:] if m.culprit)
    return members[:MAX_TABLE_ROWS] + late


def _row_style(c: Console, m: MemberRow) -> str:
    if not c.is_terminal or not m.reason:
        return ""
    return "red"


def _cell(value: object) -> str:
    return "-" if value is None else str(value)

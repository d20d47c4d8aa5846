"""The tables of one query over many dumps, fed a dump at a time.

``stallwatch query`` on a cluster's dumps used to read every dump whole and
build every table of every one before DuckDB saw a row: 256 dumps of 2,048
ranks took 1.56 GB to count rows that ``analyze`` judges in 115 MB.  Here a
query is first asked what it reads (``needs``: DuckDB's own parse, the tables
it names and the columns it may name in them), then each dump is read,
turned into those tables' rows, narrowed to those columns and let go before
the next one is read: what stays is the columns the query reads.

The columns kept are every name the query mentions (a superset: a name that
is an alias or a struct field is kept where a table has a column of that
name), so a query binds as it would over the whole tables and an unqualified
name keeps its meaning.  Where the rows a query sees depend on columns it
does not name, every column is kept: ``*`` and ``COLUMNS(...)``, a whole row
named by its table (``SELECT n FROM nccl_events n``), ``NATURAL`` joins,
column aliases of a table (``FROM t(a, b)``), ``PIVOT``, ``DESCRIBE`` and
``SUMMARIZE``; where it may look at the catalog (``information_schema``,
``duckdb_*()``) or cannot be parsed here, every table is built whole.
Tables a query does not name are not built, nor registered: a name the parse
missed fails loudly ("does not exist"), it never reads an empty table.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import duckdb
import pyarrow as pa

from stallwatch.dumpers.model import Recording
from stallwatch.dumpers.ranks import Ranks
from stallwatch.dumpers.sqltables import BUILDERS, TABLE_NAMES, tables

from .limits import LOCAL
from .sql import sandboxed_connection

KEEP_ALWAYS = "host"  # a table whose columns the query does not name still counts its rows
CATALOG_SCHEMAS = frozenset({"information_schema", "pg_catalog"})
WHOLE_REFS = frozenset({"NATURAL"})
WHOLE_NODES = frozenset({"STAR", "PIVOT", "SHOW_REF"})


@dataclass(frozen=True, slots=True)
class Needs:
    """Per table the query reads, the columns to keep (None: every one)."""

    columns: Mapping[str, frozenset[str] | None]

    def __iter__(self) -> Iterator[str]:
        return iter(self.columns)

    def keep(self, table: pa.Table, name: str) -> pa.Table:
        wanted = self.columns.get(name)
        if wanted is None:
            return table
        kept = [c for c in table.column_names if c in wanted or c == KEEP_ALWAYS]
        return table.select(kept)


EVERYTHING = Needs({name: None for name in TABLE_NAMES})


@dataclass(slots=True)
class _Seen:
    tables: set[str]
    names: set[str]  # every name mentioned: columns, their qualifiers, fields
    rows: set[str]  # single-part names (a table or an alias there names a whole row)
    aliases: set[str]
    whole: bool = False  # the rows depend on columns not named
    catalog: bool = False  # it may look at the catalog


def needs(sql: str) -> Needs:
    """What ``sql`` reads, as far as its parse tells; everything when it
    does not parse here (the engine then says why, or runs it)."""
    con = sandboxed_connection(LOCAL)
    try:
        rows = con.execute("SELECT json_serialize_sql(?)", [sql]).fetchall()
        doc = json.loads(rows[0][0]) if rows else {}
    except (duckdb.Error, ValueError, IndexError):  # the engine will say why, or run it
        return EVERYTHING
    finally:
        con.close()
    if not isinstance(doc, dict) or doc.get("error") or not doc.get("statements"):
        return EVERYTHING
    seen = _Seen(set(), set(), set(), set())
    for node in _nodes(doc["statements"]):
        _look(node, seen)
    if seen.catalog:
        return EVERYTHING
    ours = seen.tables & set(TABLE_NAMES)
    whole = seen.whole or bool(seen.rows & (ours | seen.aliases))
    return Needs({t: None if whole else frozenset(seen.names) for t in ours})


def _nodes(tree: object) -> Iterator[dict[str, Any]]:
    stack = [tree]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            yield item
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _look(node: dict[str, Any], seen: _Seen) -> None:
    kind = node.get("type")
    if kind in WHOLE_NODES or node.get("class") == "STAR":
        seen.whole = True
    if kind == "COLUMN_REF":
        parts = [str(p) for p in node.get("column_names") or []]
        seen.names.update(parts)
        if len(parts) == 1:
            seen.rows.add(parts[0])
    elif kind == "BASE_TABLE":
        seen.tables.add(str(node.get("table_name", "")))
        if str(node.get("schema_name", "")).lower() in CATALOG_SCHEMAS:
            seen.catalog = True
        if node.get("column_name_alias"):
            seen.whole = True
    elif kind == "JOIN":
        seen.names.update(str(c) for c in node.get("using_columns") or [])
        if node.get("ref_type") in WHOLE_REFS:
            seen.whole = True
    elif kind == "TABLE_FUNCTION":
        name = json.dumps(node.get("function", "")).lower()
        if "duckdb_" in name or "pragma_" in name:
            seen.catalog = True
    if kind in {"BASE_TABLE", "SUBQUERY", "TABLE_FUNCTION", "JOIN"} and node.get("alias"):
        seen.aliases.add(str(node["alias"]))


Load = Callable[[], Recording | None]  # reads one recording (None: it could not be read)


def feed(
    loads: Sequence[Load],
    known: Ranks,
    want: Needs,
    step: Callable[[], None] = lambda: None,
) -> dict[str, pa.Table]:
    """The tables ``want`` names over the recordings ``loads`` read, one at a
    time: read, turned into those tables' rows narrowed to the columns kept,
    and let go before the next is read; rows in the order of ``loads``;
    ``step`` after each recording (progress).  (Threads reading several at
    once were no faster on a loaded 2-core machine, and held more.)"""
    parts: dict[str, list[pa.Table]] = {name: [] for name in want}
    for load in loads:
        rec = load()
        if rec is not None:
            for name in want:
                parts[name].append(want.keep(pa.table(BUILDERS[name](rec, known)), name))
        del rec
        step()
    empty = tables([], known)  # every table's schema, for a table no recording fed
    return {
        name: pa.concat_tables(got) if got else want.keep(empty[name], name)
        for name, got in parts.items()
    }

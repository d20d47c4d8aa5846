"""Fetch queries answered from the Arrow columns directly, without DuckDB.

Most of what a fan-out asks an agent (``query.plan``) is one table's columns
and a filter: ``SELECT "host", "pid" FROM "nccl_events" WHERE (...)``.
Through DuckDB each such query cost the agent about a millisecond (parse,
bind, plan, run, export to Arrow), nearly all of it fixed cost, on a few
hundred rows: over 1,024 agents, most of a fan-out's CPU.  :func:`compile_scan`
turns such a query, read from DuckDB's own syntax tree (``json_serialize_sql``),
into a :class:`Scan`: the projection and a filter that pyarrow compute
evaluates over the table's columns, with SQL's meaning:

- comparisons (``=``, ``<>``, ``<``, ``<=``, ``>``, ``>=``), ``BETWEEN``,
  ``[NOT] IN`` a list of constants, ``IS [NOT] NULL``, ``AND``, ``OR``,
  ``NOT``, in three-valued logic (``NULL AND FALSE`` is ``FALSE``, a
  comparison with NULL is NULL), a row kept only where the filter is TRUE;
- a column compared only with a constant or a column of its own kind:
  integer columns with integer literals that fit the column's type (or
  integer columns of the same signedness), text columns (interned ones
  included) with text literals or text columns, byte for byte as DuckDB
  compares text.

Anything else is not compiled (None) and runs in DuckDB as before: floats
(DuckDB orders NaN above every number and equal to itself, Arrow does not),
times, casts, functions, NULL literals, ``*``, aliases, ``ORDER BY``,
``LIMIT``, ``DISTINCT``, ``GROUP BY``, subqueries, names spelt in another
case than the table's (DuckDB would still find them).  The rows come in the
table's order, with the schema DuckDB gives the same query (interned text as
plain text), so a client cannot tell which path answered.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

Node = dict[str, Any]
Mask = Callable[[pa.Table], Any]  # a table -> a boolean array, NULL where unknown

_COMPARE = {
    "COMPARE_EQUAL": pc.equal,
    "COMPARE_NOTEQUAL": pc.not_equal,
    "COMPARE_LESSTHAN": pc.less,
    "COMPARE_LESSTHANOREQUALTO": pc.less_equal,
    "COMPARE_GREATERTHAN": pc.greater,
    "COMPARE_GREATERTHANOREQUALTO": pc.greater_equal,
}
_MIRROR = {  # ``5 < x`` is ``x > 5``
    "COMPARE_EQUAL": "COMPARE_EQUAL",
    "COMPARE_NOTEQUAL": "COMPARE_NOTEQUAL",
    "COMPARE_LESSTHAN": "COMPARE_GREATERTHAN",
    "COMPARE_LESSTHANOREQUALTO": "COMPARE_GREATERTHANOREQUALTO",
    "COMPARE_GREATERTHAN": "COMPARE_LESSTHAN",
    "COMPARE_GREATERTHANOREQUALTO": "COMPARE_LESSTHANOREQUALTO",
}
# Keys of a SELECT node that must be empty for a plain scan.
_EMPTY = ("modifiers", "group_expressions", "group_sets", "having", "sample", "qualify")


class _NotScan(Exception):
    """The query is not a plain scan: DuckDB answers it."""


@dataclass(frozen=True, slots=True)
class Scan:
    table: str
    columns: tuple[str, ...]
    mask: Mask | None  # None: every row
    schema: pa.Schema  # what DuckDB would send for the same query

    def run(self, table: pa.Table) -> pa.Table:
        out = table.select(list(self.columns))
        if self.mask is not None:
            out = out.filter(self.mask(table))  # NULL: dropped, as in WHERE
        return out.cast(self.schema)


def result_type(kind: pa.DataType) -> pa.DataType:
    """The Arrow type DuckDB gives a column of this type in a query result
    (an interned text column comes out as text)."""
    return kind.value_type if pa.types.is_dictionary(kind) else kind


def compile_scan(node: Node, tables: Mapping[str, pa.Schema]) -> Scan | None:
    """The :class:`Scan` that answers the SELECT ``node`` (a statement's node
    from ``json_serialize_sql``) over ``tables``, or None if it is not one."""
    try:
        return _compile(node, tables)
    except _NotScan:
        return None


def _compile(node: Node, tables: Mapping[str, pa.Schema]) -> Scan:
    if node.get("type") != "SELECT_NODE" or any(node.get(k) for k in _EMPTY):
        raise _NotScan
    if node.get("cte_map", {}).get("map") or node.get("aggregate_handling") != "STANDARD_HANDLING":
        raise _NotScan
    source = node.get("from_table") or {}
    name = str(source.get("table_name"))
    if source.get("type") != "BASE_TABLE" or name not in tables:
        raise _NotScan
    if source.get("schema_name") or source.get("catalog_name") or source.get("sample"):
        raise _NotScan
    if source.get("at_clause") or source.get("column_name_alias"):
        raise _NotScan
    schema = tables[name]
    ref = _Columns(schema, source.get("alias") or name)
    columns = tuple(_projected(ref, item) for item in node.get("select_list", []))
    if not columns or len(set(columns)) != len(columns):
        raise _NotScan  # DuckDB renames repeated names
    where = node.get("where_clause")
    mask = None if where is None else _predicate(ref, where)
    out = pa.schema([pa.field(c, result_type(schema.field(c).type)) for c in columns])
    return Scan(name, columns, mask, out)


@dataclass(frozen=True, slots=True)
class _Columns:
    schema: pa.Schema
    alias: str  # the name the query gives the table

    def name(self, expr: Node) -> str:
        if expr.get("class") != "COLUMN_REF":
            raise _NotScan
        parts = list(expr.get("column_names", ()))
        if len(parts) == 2 and parts[0] == self.alias:
            parts = parts[1:]
        if len(parts) != 1 or parts[0] not in self.schema.names:
            raise _NotScan
        return str(parts[0])

    def kind(self, column: str) -> pa.DataType:
        return result_type(self.schema.field(column).type)


def _projected(ref: _Columns, item: Node) -> str:
    if item.get("alias"):
        raise _NotScan
    return ref.name(item)


def _predicate(ref: _Columns, expr: Node) -> Mask:
    cls, kind = expr.get("class"), str(expr.get("type"))
    if cls == "CONJUNCTION" and kind in ("CONJUNCTION_AND", "CONJUNCTION_OR"):
        parts = [_predicate(ref, child) for child in expr["children"]]
        return _fold(pc.and_kleene if kind == "CONJUNCTION_AND" else pc.or_kleene, parts)
    if cls == "COMPARISON" and kind in _COMPARE:
        return _comparison(ref, kind, expr["left"], expr["right"])
    if cls == "BETWEEN" and kind == "COMPARE_BETWEEN":
        low = _comparison(ref, "COMPARE_GREATERTHANOREQUALTO", expr["input"], expr["lower"])
        high = _comparison(ref, "COMPARE_LESSTHANOREQUALTO", expr["input"], expr["upper"])
        return _fold(pc.and_kleene, [low, high])
    if cls == "OPERATOR":
        return _operator(ref, kind, expr.get("children", []))
    raise _NotScan


def _operator(ref: _Columns, kind: str, children: list[Node]) -> Mask:
    if kind == "OPERATOR_NOT" and len(children) == 1:
        inner = _predicate(ref, children[0])
        return lambda t: pc.invert(inner(t))
    if kind in ("OPERATOR_IS_NULL", "OPERATOR_IS_NOT_NULL") and len(children) == 1:
        column = ref.name(children[0])
        test = pc.is_null if kind == "OPERATOR_IS_NULL" else pc.is_valid
        return lambda t: test(t.column(column))
    if kind in ("COMPARE_IN", "COMPARE_NOT_IN") and len(children) >= 2:
        # x IN (a, b) is x = a OR x = b, NULLs included
        equals = [_comparison(ref, "COMPARE_EQUAL", children[0], c) for c in children[1:]]
        found = _fold(pc.or_kleene, equals)
        return found if kind == "COMPARE_IN" else (lambda t: pc.invert(found(t)))
    raise _NotScan


def _fold(combine: Callable[[Any, Any], Any], parts: list[Mask]) -> Mask:
    def mask(t: pa.Table) -> Any:
        result = parts[0](t)
        for part in parts[1:]:
            result = combine(result, part(t))
        return result

    return mask


def _comparison(ref: _Columns, kind: str, left: Node, right: Node) -> Mask:
    if left.get("class") != "COLUMN_REF":
        left, right, kind = right, left, _MIRROR[kind]
    column = ref.name(left)
    compare = _COMPARE[kind]
    if right.get("class") == "COLUMN_REF":
        other = ref.name(right)
        if not _same_kind(ref.kind(column), ref.kind(other)):
            raise _NotScan
        return lambda t: compare(_decoded(t.column(column)), _decoded(t.column(other)))
    value = _literal(ref.kind(column), right)
    return lambda t: _against(compare, t.column(column), value)


def _against(compare: Callable[..., Any], column: pa.ChunkedArray, value: pa.Scalar) -> Any:
    """``compare`` of every row with ``value``; for interned text, once per
    distinct text, then looked up per row (a NULL code gives NULL)."""
    if not pa.types.is_dictionary(column.type):
        return compare(column, value)
    chunks = [pc.take(compare(c.dictionary, value), c.indices) for c in column.chunks]
    return pa.chunked_array(chunks, pa.bool_())


def _same_kind(a: pa.DataType, b: pa.DataType) -> bool:
    if pa.types.is_integer(a) and pa.types.is_integer(b):
        return bool(pa.types.is_signed_integer(a) == pa.types.is_signed_integer(b))
    return bool(pa.types.is_string(a) and pa.types.is_string(b))


def _decoded(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """Interned text as text: two columns' dictionaries differ."""
    if pa.types.is_dictionary(column.type):
        return column.cast(column.type.value_type)
    return column


def _literal(kind: pa.DataType, expr: Node) -> pa.Scalar:
    """The constant ``expr`` as a scalar of the column's type ``kind``, if it
    is one DuckDB would compare the same way."""
    literal = expr.get("literal") if expr.get("class") == "CONSTANT" else None
    if not isinstance(literal, dict):
        raise _NotScan
    text = literal.get("text")
    if literal.get("kind") == "STRING" and pa.types.is_string(kind) and isinstance(text, str):
        return pa.scalar(text, kind)
    if literal.get("kind") == "INTEGER" and pa.types.is_integer(kind) and isinstance(text, str):
        digits = text.removeprefix("-")
        if not (digits.isascii() and digits.isdigit()):
            raise _NotScan  # 0x10, 1_000: leave DuckDB's readings to DuckDB
        value = int(text)
        bounds = np.iinfo(kind.to_pandas_dtype())
        if not bounds.min <= value <= bounds.max:
            raise _NotScan  # DuckDB widens the column; nothing to gain here
        return pa.scalar(value, kind)
    raise _NotScan

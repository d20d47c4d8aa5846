"""The bodies of ``POST /query`` and ``POST /fetch``, made by the engine
(``query.sql``) within one request's limits (``Limits``): how many queries
it may ask, its rows across all of them, its bytes.  Beyond the rows, the
rest is cut and marked truncated; beyond the queries or the bytes, a clear
error (``QueryRefused``, ``AnswerTooLarge``), and nothing past the limit is
ever held in memory.  Used where the engine runs: in the agent's engine
process (``query.engineproc``), or in the caller's own process.
"""

from __future__ import annotations

from collections.abc import Sequence

from stallwatch.dumpers.errors import AnswerTooLarge, QueryRefused

from .sql import QueryEngine, too_large
from .wire import arrow_stream, encode_json, frame_parts


def query_answer(engine: QueryEngine, sql: str, limit: int | None, host: str) -> bytes:
    """``POST /query``'s JSON body."""
    cap = engine.limits.max_answer_bytes
    result = engine.query(sql, limit, max_bytes=cap)  # refused while its rows are read
    body = encode_json(
        {
            "host": host,
            "columns": list(result.columns),
            "types": list(result.types),
            "rows": result.rows,
            "truncated": result.truncated,
            "elapsed_ms": round(result.elapsed_ms, 3),
        }
    )
    if cap is not None and len(body) > cap:
        raise AnswerTooLarge(too_large(cap))
    return body


def fetch_answer(
    engine: QueryEngine, queries: Sequence[str], host: str
) -> list[bytes | memoryview]:
    """``POST /fetch``'s body, as the parts to send one after the other: each
    query's rows as an Arrow IPC stream behind its 8-byte length
    (``query.wire``), the rows and bytes counted across all the queries."""
    limits = engine.limits
    if limits.max_fetch_queries is not None and len(queries) > limits.max_fetch_queries:
        raise QueryRefused(
            f"{len(queries)} queries in one request: the limit is {limits.max_fetch_queries}"
        )
    rows_left, bytes_left = limits.max_fetch_rows, limits.max_answer_bytes
    parts: list[bytes | memoryview] = []
    for sql in queries:
        try:
            table, truncated = engine.fetch_arrow(sql, max_rows=rows_left, max_bytes=bytes_left)
        except AnswerTooLarge:  # said with the request's limit, not what was left of it
            raise AnswerTooLarge(too_large(limits.max_answer_bytes or 0)) from None
        rows, stream = table.num_rows, arrow_stream(table, truncated, host)
        del table
        parts += frame_parts(stream)
        if rows_left is not None:
            rows_left = max(0, rows_left - rows)
        if bytes_left is not None:
            bytes_left -= len(stream)
            if bytes_left < 0:
                raise AnswerTooLarge(too_large(limits.max_answer_bytes or 0))
    return parts

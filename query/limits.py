"""What one query may use: rows, time, memory, threads (``query.sql`` applies
them).  Apart from the engine so that whoever passes limits (the agent's
HTTP surface at start) does not load DuckDB for it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Limits:
    """What one query may use; None means unlimited."""

    max_rows: int | None = 10_000
    # rows a fan-out may take in columnar form, across all the queries of
    # one request (a ring of the default size holds 65,536 rows of a table):
    # the rest is cut and marked truncated
    max_fetch_rows: int | None = 1_000_000
    time_limit_s: float | None = 10.0
    max_sql_bytes: int | None = 64 * 1024
    # DuckDB's buffer manager; not every allocation of DuckDB is under it
    # (query.engineproc bounds the rest)
    memory_limit: str | None = "128MB"
    threads: int | None = 1
    # one request's answer: the queries it may ask, and its bytes (beyond
    # either, a clear error); the whole ring of 65,536 NCCL rows is 18 MB
    max_fetch_queries: int | None = 16
    max_answer_bytes: int | None = 32 * 2**20


# For people querying their own dumps on their own machine.
LOCAL = Limits(
    max_rows=None,
    max_fetch_rows=None,
    time_limit_s=None,
    max_sql_bytes=None,
    memory_limit=None,
    threads=None,
    max_fetch_queries=None,
    max_answer_bytes=None,
)
# For queries that come from the network (the agent, `stallwatch serve`).
NETWORK = Limits()
# `stallwatch query` on dumps: the agent's row limit and a memory limit (a
# query that would fill the machine's memory is cut off with a one-line
# error, never killed by the kernel), without its time and size limits.
QUERY = Limits(
    max_rows=NETWORK.max_rows,
    max_fetch_rows=None,
    time_limit_s=None,
    max_sql_bytes=None,
    memory_limit="1GB",
    threads=None,
    max_fetch_queries=None,
    max_answer_bytes=None,
)

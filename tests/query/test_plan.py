"""What each agent is asked to send for a fan-out (``query.plan``): as little
as the query allows, never less than it needs.  That the answers are right
is checked against local queries in test_fanout.py."""

from __future__ import annotations

import pytest

from bench.bench_sql import SEED_QUERY
from stallwatch.dumpers.errors import QueryError, QueryRefused
from stallwatch.query.plan import IDENTITY, IDENTITY_SQL, Plan, plan


def fetch_of(p: Plan, table: str) -> str:
    (sql,) = [f.sql for f in p.fetches if f.table == table]
    return sql


def test_the_seed_query_sends_slow_all_reduces_and_retransmits_only() -> None:
    p = plan(SEED_QUERY)
    assert p.kind == "rows" and p.final_sql == SEED_QUERY
    nccl, tcp = fetch_of(p, "nccl_events"), fetch_of(p, "tcp_events")
    assert "op = 'ALL_REDUCE'" in nccl and "duration_ns > 50000000" in nccl
    assert "'tcp_retransmit_skb'" in tcp
    # only the columns the query names (and host)
    assert "bytes" not in nccl and "saddr" not in tcp and '"host"' in tcp
    assert p.columns == ("rank", "ms", "retransmits_in_window")


def test_aggregates_are_sent_as_partials_per_group() -> None:
    p = plan("SELECT host, count(*) AS n, avg(duration_ns) FROM nccl_events GROUP BY host")
    assert p.kind == "aggregate"
    fetch = fetch_of(p, "nccl_events")
    assert 'GROUP BY "host"' in fetch and "count_star()" in fetch
    assert "sum(duration_ns)" in fetch and "count(duration_ns)" in fetch  # avg = sum / count
    assert "sum(_sw_p0) AS n" in p.final_sql and "(sum(_sw_p1) /" in p.final_sql


def test_where_goes_to_the_agents_and_leaves_the_final_query() -> None:
    p = plan("SELECT count(*) FROM nccl_events WHERE seq = 3")
    assert "WHERE (seq = 3)" in fetch_of(p, "nccl_events") and "WHERE" not in p.final_sql


def test_ranks_are_derived_on_the_client_over_every_agent() -> None:
    """One agent alone cannot rank a split communicator spanning nodes: a
    query reading ranks takes the rows with their identity, every agent's
    communicators, and filters on ranks after the client filled them."""
    p = plan("SELECT count(*) FROM nccl_events WHERE rank = 3 AND op = 'ALL_REDUCE'")
    assert p.derives_ranks and p.final_sql.endswith("WHERE rank = 3 AND op = 'ALL_REDUCE'")
    fetch = fetch_of(p, "nccl_events")
    assert "op = 'ALL_REDUCE'" in fetch and "rank = 3" not in fetch
    assert all(f'"{c}"' in fetch for c in ("host", "pid", "comm_id_hash"))
    assert fetch_of(p, IDENTITY) == IDENTITY_SQL
    assert not plan("SELECT count(*) FROM nccl_events").derives_ranks


def test_top_rows_and_distinct_are_pushed() -> None:
    top = plan(
        "SELECT seq, duration_ns / 1e6 AS ms FROM nccl_events ORDER BY ms DESC LIMIT 5 OFFSET 3"
    )
    fetch = fetch_of(top, "nccl_events")
    assert "ORDER BY (duration_ns / 1e6) DESC" in fetch and fetch.endswith("LIMIT 8")
    distinct = plan("SELECT DISTINCT seq FROM nccl_events")
    assert fetch_of(distinct, "nccl_events").startswith("SELECT DISTINCT host, seq")
    # a limit without an order: any rows do, so no agent sends more
    assert fetch_of(plan("SELECT * FROM tcp_events LIMIT 10 OFFSET 2"), "tcp_events").endswith(
        "LIMIT 12"
    )
    # DISTINCT then LIMIT: the top rows of each part are not the top distinct ones
    both = plan("SELECT DISTINCT seq FROM nccl_events ORDER BY seq LIMIT 2")
    assert "LIMIT" not in fetch_of(both, "nccl_events")


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT median(duration_ns) FROM nccl_events",  # does not combine
        "SELECT string_agg(op, ',' ORDER BY seq) FROM nccl_events",
        "SELECT rank, row_number() OVER () FROM nccl_events",
    ],
)
def test_what_does_not_combine_is_sent_as_rows(sql: str) -> None:
    p = plan(sql)
    assert p.kind == "rows" and p.final_sql == sql
    assert "GROUP BY" not in fetch_of(p, "nccl_events")


@pytest.mark.parametrize(
    "sql",
    [
        # an alias of the select list, which the agents' fetch does not have
        "SELECT duration_ns / 1e6 AS ms FROM nccl_events WHERE ms > 50",
        # volatile: the agents' random() is not the client's
        "SELECT rank FROM nccl_events WHERE random() < 0.5",
        # the outer side of a left join keeps every row
        "SELECT n.rank FROM nccl_events n LEFT JOIN tcp_events t ON n.rank = 0 AND t.pid = n.pid",
    ],
)
def test_what_cannot_filter_an_agents_rows_is_not_pushed(sql: str) -> None:
    assert "WHERE" not in fetch_of(plan(sql), "nccl_events")


def test_a_cte_named_like_a_table_is_not_filtered_as_that_table() -> None:
    sql = (
        "WITH tcp_events AS (SELECT * FROM nccl_events WHERE seq = 1) "
        "SELECT count(*) FROM tcp_events WHERE pid > 0"
    )
    p = plan(sql)
    assert all("pid > 0" not in f.sql for f in p.fetches)
    assert "seq = 1" in fetch_of(p, "nccl_events")


def test_bad_queries_fail_in_the_plan() -> None:
    with pytest.raises(QueryRefused, match="only SELECT"):
        plan("CREATE TABLE x AS SELECT 1")
    with pytest.raises(QueryError, match="nope"):
        plan("SELECT nope FROM nccl_events")
    with pytest.raises(QueryRefused, match="exactly one"):
        plan("SELECT 1; SELECT 2")

"""The link tables in the Parquet export: what DuckDB reads from the folder
is what ``stallwatch query`` returns on the dumps, list columns and NULLs
included."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest

from bench.bench_sql import Synthetic, synthetic_recording
from stallwatch.dumpers.format import write_dump
from tests.analyzer.test_parquet import (
    _expected,
    _json_round,
    _ordered,
    _rows,
    duckdb_views,
    run_cli,
)
from tests.dump_samples import with_link_rows

QUERIES = (
    "SELECT host, interface, kind, event, after_ns, carrier, operstate, port_state, "
    "phys_state, carrier_changes, rx_errors, symbol_error, np_cnp_sent, wall_time "
    "FROM link_events ORDER BY host, timestamp_ns",
    "SELECT host, interface, kind, device, port, ifindex, netdev, link_type, link_layer, "
    "addresses, mtu, speed_mbps, pids, world_ranks, first_seen_ns, gone_ns, first_seen_time "
    "FROM links ORDER BY host, interface",
    "SELECT e.host, e.interface, l.world_ranks FROM link_events e JOIN links l "
    "ON l.host = e.host AND l.interface = e.interface WHERE e.event = 'carrier_down'",
)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    folder = tmp_path_factory.mktemp("links") / "incident"
    folder.mkdir()
    for i in range(2):
        rec = synthetic_recording(Synthetic(host=f"node{i}", first_rank=4 * i, seed=i))
        write_dump(folder, with_link_rows(rec, i))
    return [folder]


@pytest.mark.parametrize("sql", QUERIES, ids=["link_events", "links", "a cut link"])
def test_link_tables_in_parquet_read_as_on_the_dumps(
    dumps: list[Path], tmp_path: Path, sql: str
) -> None:
    root = tmp_path / "parquet"
    code, _, err = run_cli(["export", "--parquet", str(dumps[0]), "-o", str(root)])
    assert code == 0, err
    expected = _expected(dumps, sql)
    assert expected, "an empty answer proves nothing"
    con = duckdb.connect()
    duckdb_views(con, root)
    assert _rows(_json_round(con.execute(sql).fetchall()), _ordered(sql)) == expected

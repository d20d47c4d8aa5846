"""What the analyzer reads of each dump: every rank's latest calls (the
frontier and the straggler window), not the whole ring; and incidents shaped
like 3-D parallel jobs, where the stages blocked in send/recv are not blamed."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from bench.incident3d import Shape, write_incident
from stallwatch.analyzer import align
from stallwatch.analyzer.incident import MemberState
from stallwatch.analyzer.pipeline import analyze_paths
from stallwatch.analyzer.verdict import VerdictKind
from stallwatch.dumpers.format import read_dump, read_dump_deferred, write_dump
from stallwatch.dumpers.model import Recording, Ring
from stallwatch.dumpers.schema import (
    CONN_SAMPLE,
    IFACE_SAMPLE,
    PROBE_EVENT,
    EventKind,
    ProbeKind,
    ProbeOutcome,
    ProbeRole,
)
from tests.analyzer.synth import Job, recordings


def _write(job: Job, folder: Path) -> Path:
    for rec in recordings(job):
        write_dump(folder, rec)
    return folder


def test_a_deferred_ring_reads_its_latest_rows(tmp_path: Path) -> None:
    path = next(_write(Job(steps=30), tmp_path).iterdir())
    whole = read_dump(path).rings["nccl"].rows
    _, deferred = read_dump_deferred(path, ("nccl",))
    ring = deferred["nccl"]
    assert np.array_equal(ring.read(), whole)
    assert np.array_equal(ring.read(bytearray(ring.nbytes), 7), whole[7:])
    assert len(ring.read(None, ring.rows)) == 0


def test_each_rank_is_read_from_its_latest_calls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(align, "WINDOW_CALLS", 12)
    job = Job(nodes=2, ranks_per_node=2, steps=40, hang=(3, 30))
    res = analyze_paths([str(_write(job, tmp_path))])
    (r,) = res.incidents
    assert len(r.incident.calls) == 4 * 12  # of 30 or 31 calls per rank
    assert not any(p.window_complete for p in r.incident.procs)
    (v,) = r.verdicts
    assert v.kind is VerdictKind.MISSING_RANK and v.ranks == (3,)


def test_a_comm_used_only_before_the_window_is_unknown_not_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the split communicator's one collective per step is outside a window of
    # one call for half of the ranks' rows: it must never make a laggard
    monkeypatch.setattr(align, "WINDOW_CALLS", 1)
    res = analyze_paths([str(_write(Job(steps=20, split=True), tmp_path))])
    (r,) = res.incidents
    states = {m.state for f in r.frontiers for m in f.members}
    assert MemberState.BEHIND not in states and MemberState.NO_ROWS not in states
    assert [v.kind for v in r.verdicts] == [VerdictKind.HEALTHY]


@pytest.mark.parametrize("fault", ["hang", "straggler"])
def test_3d_incidents_name_the_injected_rank(tmp_path: Path, fault: str) -> None:
    shape = Shape(256, calls=400, fault=fault, pp=4)
    truth = write_incident(shape, tmp_path)
    res = analyze_paths([str(tmp_path)])
    (r,) = res.incidents
    v = r.verdicts[0]
    assert (v.kind.value, list(v.ranks)) == (truth["kind"], truth["ranks"])
    assert len(r.incident.comms) == 1 + shape.hosts + shape.dp * 8 + shape.pp * 8
    if fault == "hang":  # stages waiting in send/recv lag at the DP collectives, unblamed
        lagging = {m.proc for f in r.frontiers if f.stuck for m in f.laggards}
        assert len(lagging) > 1


def _address(node: int) -> np.ndarray:
    return np.array([10, 0, 0, node + 1] + [0] * 12, dtype=np.uint8)  # as synth's hosts


def _with_network(rec: Recording, nodes: int) -> Recording:
    """The recording with a second's network evidence: its connection to
    the next node sampled, its interface's counters (and address), a probe
    to the next node lost."""
    k, ts = int(rec.host.removeprefix("node")), rec.clock.monotonic_ns - 10**9
    peer = (k + 1) % nodes
    conn = np.zeros(1, CONN_SAMPLE)
    conn["ts_ns"], conn["kind"], conn["family"], conn["state"] = ts, EventKind.CONN_SAMPLE, 2, 1
    conn["saddr"], conn["daddr"], conn["sport"], conn["dport"] = _address(k), _address(peer), 4, 5
    conn["srtt_us"], conn["total_retrans"] = 100 + k, k
    iface = np.zeros(1, IFACE_SAMPLE)
    iface["ts_ns"], iface["kind"], iface["ifindex"], iface["mtu"] = (
        ts,
        EventKind.IFACE_SAMPLE,
        2,
        1500,
    )
    iface["tx_bytes"], iface["qdisc_drops"] = 1000 * (k + 1), k
    probe = np.zeros(1, PROBE_EVENT)
    probe["ts_ns"], probe["kind"], probe["probe"] = ts, EventKind.PROBE, ProbeKind.UDP
    probe["role"], probe["outcome"] = ProbeRole.SENT, ProbeOutcome.LOST
    probe["saddr"], probe["daddr"], probe["probe_size"], probe["sent"] = (
        _address(k),
        _address(peer),
        1500,
        3,
    )
    rings = {**rec.rings, "conn_samples": Ring(conn), "iface_samples": Ring(iface),
             "probes": Ring(probe)}  # fmt: skip
    links = tuple(
        dataclasses.replace(link, addresses=(f"10.0.0.{k + 1}/24",)) for link in rec.links
    )
    return dataclasses.replace(rec, rings=rings, links=links)


def test_worker_processes_read_the_headers_one_process_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stallwatch.analyzer import align, load

    job = Job(nodes=4, ranks_per_node=2, steps=30, hang=(5, 20))
    for rec in recordings(job):
        write_dump(tmp_path, _with_network(rec, job.nodes))
    folder = tmp_path
    monkeypatch.setattr(load, "POOL_MIN_DUMPS", 2)
    monkeypatch.setenv("STALLWATCH_THREADS", "2")
    pools = []
    real = load._pool_for

    def counted(files: list[str], min_bytes: int | None = None) -> object:
        got = real(files, min_bytes)
        pools.append(got)
        return got

    monkeypatch.setattr(load, "_pool_for", counted)
    joined = []
    real_join = align._joined
    monkeypatch.setattr(align, "_joined", lambda *a: joined.append(1) or real_join(*a))
    pooled = analyze_paths([str(folder)])
    assert any(p is not None for p in pools)  # the headers were read on workers
    assert joined  # and the calls staged there
    monkeypatch.setenv("STALLWATCH_THREADS", "1")
    alone = analyze_paths([str(folder)])
    assert pooled.inputs == alone.inputs
    assert [r.verdicts for r in pooled.incidents] == [r.verdicts for r in alone.incidents]
    assert pooled.incidents[0].incident.procs == alone.incidents[0].incident.procs
    # the calls, staged on the workers as they read the files (align.prestage)
    calls, here = pooled.incidents[0].incident.calls.rows, alone.incidents[0].incident.calls.rows
    assert all(np.array_equal(calls[n], here[n]) for n in here) and len(here) > 100
    # and the dumps' network evidence came with them: every host's rows
    ours, theirs = pooled.incidents[0].incident, alone.incidents[0].incident
    for name in ("probes", "conns", "ifaces"):
        got = getattr(ours, name)
        assert np.array_equal(got, getattr(theirs, name)) and len(got) == job.nodes, name
    assert set(ours.conns["remote"]) == set(range(job.nodes))
    (v,) = pooled.incidents[0].verdicts
    assert v.kind is VerdictKind.MISSING_RANK and v.ranks == (5,)


def test_dumps_staged_on_workers_tell_the_ranks_a_lost_dump_left_uncertain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lab job with one node's dump left out: the split communicators'
    ranks that the remaining rings tell (their whole rings read again where
    the workers staged only the windows) are those one process finds."""
    import shutil

    from stallwatch.analyzer import load
    from stallwatch.analyzer.report import to_json

    data = Path(__file__).resolve().parents[1] / "data" / "shapes" / "hang-demo-4x2"
    files = sorted(data.glob("*.msgpack"))
    for f in files[1:]:
        shutil.copy(f, tmp_path / f.name)
    monkeypatch.setattr(load, "POOL_MIN_DUMPS", 2)

    def ranks_shown() -> list[object]:
        doc = json.loads(to_json(analyze_paths([str(tmp_path)])))
        return [c["members"] for inc in doc["incidents"] for c in inc["communicators"]]

    staged = []
    real = align._told
    monkeypatch.setattr(align, "_told", lambda e, u: staged.append(bool(u)) or real(e, u))
    monkeypatch.setenv("STALLWATCH_THREADS", "2")
    pooled = ranks_shown()
    assert staged and any(staged)  # staged on the workers, with splits left uncertain
    monkeypatch.setenv("STALLWATCH_THREADS", "1")
    assert pooled == ranks_shown()
    told = [m["rank"] for members in pooled for m in members]  # type: ignore[attr-defined]
    assert any(r is None for r in told) and any(r is not None for r in told)

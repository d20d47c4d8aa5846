"""The dump format: round trip, validation, foreign inputs, the atomic writer."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import pickle
import re
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from stallwatch.dumpers import format as fmt
from stallwatch.dumpers.errors import DumpError, DumpFormatError, DumpVersionError, DumpWriteError
from stallwatch.dumpers.model import FORMAT_VERSION, ProgramMisses, Recording, Ring
from stallwatch.dumpers.schema import (
    DEVICE_FIELDS,
    NCCL_EVENT_V1,
    NCCL_EVENT_V3,
    PREV_PID_UNKNOWN,
    RING_DTYPES,
    SCHED_EVENT_V4,
    TCP_EVENT_V6,
    State,
)
from tests.dump_samples import (
    U64_MAX,
    assert_same,
    nccl_rows,
    recordings,
    remount,
    sample_recording,
    tmpfs,
)


def _doc(rec: Recording) -> dict[str, object]:
    return msgpack.unpackb(fmt.encode(rec), raw=False)  # type: ignore[no-any-return]


def _decode_doc(doc: object, name: str = "dumps/n1.msgpack") -> Recording:
    return fmt.decode(msgpack.packb(doc, use_bin_type=True), name)


def _reseal(doc: dict[str, object]) -> None:
    """The checksums of a document changed on purpose, written again: what
    its fields hold is then checked, not only that they changed."""
    if "checksums" in doc:
        doc["checksums"] = fmt.checksums_doc(doc)


# ---------------------------------------------------------------- round trip


def test_round_trip_through_a_file(tmp_path: Path) -> None:
    rec = sample_recording(1000)
    path = fmt.write_dump(tmp_path, rec)
    back = fmt.read_dump(path)
    assert_same(rec, back)
    assert back.trigger is not None and back.trigger.comm_hash > 2**63
    assert back.rings["nccl"].rows.flags.writeable


def test_round_trip_with_empty_rings_and_no_trigger() -> None:
    rings = {name: Ring(np.zeros(0, dt)) for name, dt in RING_DTYPES.items()}
    rec = dataclasses.replace(sample_recording(), rings=rings, trigger=None, counters={})
    assert_same(rec, fmt.decode(fmt.encode(rec), "x"))


def test_u64_extremes_survive() -> None:
    rows = nccl_rows(3)
    rows["comm_hash"] = [0, 2**63, U64_MAX]
    rows["seq"] = U64_MAX
    rec = dataclasses.replace(sample_recording(), rings={"nccl": Ring(rows, U64_MAX, U64_MAX)})
    back = fmt.decode(fmt.encode(rec), "x")
    assert back.rings["nccl"].rows["comm_hash"].tolist() == [0, 2**63, U64_MAX]
    assert back.rings["nccl"].lost == U64_MAX


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recordings)
def test_round_trip_any_recording(rec: Recording) -> None:
    assert_same(rec, fmt.decode(fmt.encode(rec), "hypothesis"))


def test_file_name_is_host_incident_time_and_sanitized(tmp_path: Path) -> None:
    rec = sample_recording(host="gpu node/7", incident="../../etc/passwd")
    path = fmt.write_dump(tmp_path, rec)
    assert path.parent == tmp_path
    assert re.fullmatch(r"gpu_node_7-etc_passwd-\d{8}T\d{9}Z\.msgpack", path.name), path.name
    again = fmt.write_dump(tmp_path, rec)
    assert again != path and again.exists() and path.exists()


def test_write_to_an_explicit_path(tmp_path: Path) -> None:
    target = tmp_path / "mine.msgpack"
    assert fmt.write_dump(target, sample_recording()) == target
    assert [p.name for p in tmp_path.iterdir()] == ["mine.msgpack"]


def test_encode_refuses_a_recording_that_breaks_the_model(tmp_path: Path) -> None:
    bad_name = dataclasses.replace(sample_recording(), rings={"gpu": Ring(nccl_rows(2))})
    bad_dtype = dataclasses.replace(sample_recording(), rings={"tcp": Ring(nccl_rows(2))})
    for rec, words in ((bad_name, "unknown ring"), (bad_dtype, "schema dtype")):
        with pytest.raises(ValueError, match=words):
            fmt.write_dump(tmp_path, rec)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- validation


def _old_ring(doc: dict[str, object], rec: Recording, name: str, dtype: np.dtype) -> np.ndarray:
    """Ring ``name`` of ``doc`` rewritten in an older ``dtype`` (the fields it
    shares with today's copied, the others zero); returns its rows."""
    rows = rec.rings[name].rows
    old = np.zeros(len(rows), dtype)
    for field in dtype.names or ():
        if field in (rows.dtype.names or ()):
            old[field] = rows[field]
    ring = doc["rings"][name]  # type: ignore[index]
    ring["dtype"] = fmt._descr(dtype)
    ring["data"] = old.tobytes()
    return old


NET_RINGS = ("conn_samples", "iface_samples", "probes")


def _as_version_9(rec: Recording) -> dict[str, object]:
    """``rec``'s document as version 9 wrote it: no programs."""
    doc = _doc(rec)
    del doc["programs"]
    doc["version"] = 9
    _reseal(doc)
    return doc


def _as_version_8(rec: Recording) -> dict[str, object]:
    """``rec``'s document as versions 7 and 8 wrote it: no network rings."""
    doc = _as_version_9(rec)
    for name in NET_RINGS:
        del doc["rings"][name]  # type: ignore[attr-defined]
    doc["version"] = 8
    _reseal(doc)
    return doc


def _as_version_6(rec: Recording) -> dict[str, object]:
    """``rec``'s document as versions 1 to 6 wrote it: TCP rows without the
    connection's state, no link ring, no links."""
    doc = _as_version_8(rec)
    _old_ring(doc, rec, "tcp", TCP_EVENT_V6)
    del doc["links"]
    del doc["rings"]["link"]  # type: ignore[attr-defined]
    doc["version"] = 6
    _reseal(doc)  # version 6 has checksums (of what it holds)
    return doc


def _as_version_4(rec: Recording) -> dict[str, object]:
    """``rec``'s document as versions 1 to 4 wrote its sched rows: without
    ``prev_pid`` (``_pad1`` where it is now, zero)."""
    doc = _as_version_6(rec)
    del doc["checksums"]  # version 6's
    _old_ring(doc, rec, "sched", SCHED_EVENT_V4)
    return doc


def _as_version_1(rec: Recording) -> bytes:
    """``rec`` written as format version 1 wrote it: NCCL rows without the
    device columns, the completed state numbered 2."""
    doc = _as_version_4(rec)
    doc["version"] = 1
    del doc["snapshots"]  # version 3's
    old = _old_ring(doc, rec, "nccl", NCCL_EVENT_V1)  # _pad1: graph_node since version 4
    old["state"][rec.rings["nccl"].rows["state"] == State.COMPLETED] = 2
    doc["rings"]["nccl"]["data"] = old.tobytes()  # type: ignore[index]
    return msgpack.packb(doc, use_bin_type=True)  # type: ignore[no-any-return]


def _as_version_3(rec: Recording) -> dict[str, object]:
    """``rec``'s document as versions 2 and 3 wrote it: NCCL rows without the
    graph columns (``_pad1`` where ``graph_node`` is now)."""
    doc = _as_version_4(rec)
    _old_ring(doc, rec, "nccl", NCCL_EVENT_V3)
    return doc


def test_version_3_rows_are_read_into_todays_with_no_graph(tmp_path: Path) -> None:
    rec = sample_recording(50)
    doc = _as_version_3(rec)
    doc["version"] = 3
    path = tmp_path / "v3.msgpack"
    path.write_bytes(msgpack.packb(doc, use_bin_type=True))
    rows = fmt.read_dump(path).rings["nccl"].rows
    assert rows.dtype == RING_DTYPES["nccl"]
    want = rec.rings["nccl"].rows.copy()
    for name in ("graph", "graph_node", "replay"):
        want[name] = 0
    assert (rows == want).all()


def test_version_6_tcp_rows_have_no_connection_state(tmp_path: Path) -> None:
    rec = sample_recording(50)
    rows = rec.rings["tcp"].rows
    rows["conn_known"], rows["backoff"], rows["srtt_us"] = 1, 3, 250
    doc = _as_version_6(rec)
    doc["version"] = 6
    path = tmp_path / "v6.msgpack"
    path.write_bytes(msgpack.packb(doc, use_bin_type=True))
    back = fmt.read_dump(path).rings["tcp"].rows
    assert back.dtype == RING_DTYPES["tcp"] and len(back) == len(rows) > 0
    assert (back["conn_known"] == 0).all() and (back["backoff"] == 0).all()
    assert (back["srtt_us"] == 0).all()
    assert (back["sport"] == rows["sport"]).all() and (back["daddr"] == rows["daddr"]).all()


def test_version_4_sched_rows_name_no_cpu_holder(tmp_path: Path) -> None:
    rec = sample_recording(50)
    rows = rec.rings["sched"].rows
    rows["prev_pid"] = np.arange(len(rows)) % 3  # 0, the idle task, among them
    doc = _as_version_4(rec)
    doc["version"] = 4
    path = tmp_path / "v4.msgpack"
    path.write_bytes(msgpack.packb(doc, use_bin_type=True))
    back = fmt.read_dump(path).rings["sched"].rows
    assert back.dtype == RING_DTYPES["sched"] and len(back) == len(rows) > 0
    assert (back["prev_pid"] == PREV_PID_UNKNOWN).all()  # unknown, not 0 (idle)
    want = rows.copy()
    want["prev_pid"] = PREV_PID_UNKNOWN
    assert (back == want).all()
    _, deferred = fmt.read_dump_deferred(path, ["sched"])
    assert deferred["sched"].nbytes == len(rows) * SCHED_EVENT_V4.itemsize
    assert (deferred["sched"].read() == want).all()
    # today's rows keep the holder, the idle task's 0 included
    today = fmt.decode(fmt.encode(rec), "x").rings["sched"].rows
    assert (today["prev_pid"] == rows["prev_pid"]).all()


def test_version_1_dumps_are_read_into_todays_rows(tmp_path: Path) -> None:
    rec = sample_recording(50)
    rows = rec.rings["nccl"].rows
    rows["state"][:10] = State.ENQUEUED  # version 1 called it "started": returned
    for name in DEVICE_FIELDS:
        rows[name] = 0  # version 1 had none
    path = tmp_path / "old.msgpack"
    path.write_bytes(_as_version_1(rec))
    back = fmt.read_dump(path)
    assert back.rings["nccl"].rows.dtype == RING_DTYPES["nccl"]
    assert (back.rings["nccl"].rows == rows).all()
    assert (rows["state"] == State.COMPLETED).any()  # 2 then, 3 now
    _, deferred = fmt.read_dump_deferred(path, ["nccl"])
    assert deferred["nccl"].nbytes == 50 * NCCL_EVENT_V1.itemsize
    assert (deferred["nccl"].read(bytearray(deferred["nccl"].nbytes)) == rows).all()


def test_a_version_3_gpu_lab_dump_still_reads_with_no_graphs() -> None:
    folder = Path(__file__).parent.parent / "data" / "lab-gpuslow-4x2"
    for path in sorted(folder.glob("*.msgpack")):
        rows = fmt.read_dump(path).rings["nccl"].rows
        assert rows.dtype == RING_DTYPES["nccl"] and len(rows) > 100
        assert (rows["completed_ns"] > 0).any()  # version 3's device columns kept
        for name in ("graph", "graph_node", "replay"):  # version 4's: no graph then
            assert not rows[name].any()


def test_a_version_1_lab_dump_still_reads() -> None:
    back = fmt.read_dump(Path(__file__).parent.parent / "data" / "lab-hang-2x2" / "node0.msgpack")
    assert back.snapshots == ()  # thread positions came with version 3
    rows = back.rings["nccl"].rows
    assert len(rows) > 100 and set(np.unique(rows["state"])) == {State.SCHEDULED, State.ENQUEUED}
    assert not rows["completed_ns"].any()


def test_newer_version_is_refused_with_its_message() -> None:
    doc = _doc(sample_recording())
    doc["version"] = FORMAT_VERSION + 1
    doc["something_new"] = [1, 2, 3]
    with pytest.raises(DumpVersionError) as err:
        _decode_doc(doc)
    assert str(err.value) == (
        f"dumps/n1.msgpack: written by a newer stallwatch (format version "
        f"{FORMAT_VERSION + 1}, this reader understands up to {FORMAT_VERSION})"
    )


def test_newer_version_with_another_layout_is_still_a_version_error() -> None:
    doc = _doc(sample_recording())
    doc["version"] = FORMAT_VERSION + 1
    doc["rings"]["nccl"]["data"] = [b"chunk", b"chunk"]  # whatever a later version does
    del doc["host"]
    with pytest.raises(DumpVersionError, match="written by a newer stallwatch"):
        _decode_doc(doc)


def test_a_missing_dump_folder_is_created(tmp_path: Path) -> None:
    path = fmt.write_dump(tmp_path / "a" / "b", sample_recording())
    assert path.parent == tmp_path / "a" / "b" and path.exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(DumpWriteError, match="cannot create the dump folder"):
        fmt.write_dump(tmp_path / "file" / "dumps", sample_recording())


def _ring_data_too_short(doc: dict) -> None:
    doc["rings"]["nccl"]["data"] = b"12345"


def _set(path: str, value: object):  # type: ignore[no-untyped-def]
    def mutate(doc: dict) -> None:
        *parents, last = path.split(".")
        node = doc
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return mutate


def _delete(path: str):  # type: ignore[no-untyped-def]
    def mutate(doc: dict) -> None:
        *parents, last = path.split(".")
        node = doc
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        del node[last]

    return mutate


BAD_FIELDS = [
    (_ring_data_too_short, "rings.nccl.data: expected 16000 bytes for 100 rows, found 5"),
    (_set("rings.nccl.rows", 99), "rings.nccl.data: expected 15840 bytes for 99 rows"),
    (_set("rings.nccl.rows", -1), "rings.nccl.rows: expected an integer in"),
    (_set("rings.nccl.data", "text"), "rings.nccl.data: expected binary data"),
    (_set("rings.nccl.dtype", [["pos", "<u8"]]), "rings.nccl.dtype: does not match"),
    (_set("rings.gpu", {"dtype": [], "rows": 0}), "rings.gpu: unknown ring"),
    (_set("rings.tcp.lost", True), "rings.tcp.lost: expected an integer, found boolean"),
    (_delete("rings.tcp.overwritten"), "rings.tcp: missing field 'overwritten'"),
    (_set("format", "other-dump"), "format: not a stallwatch dump"),
    (_set("version", "1"), "version: expected an integer, found string"),
    (_set("version", 0), "version: expected a format version from 1"),
    (_delete("host"), "document: missing field 'host'"),
    (_set("host", b"node"), "host: expected a string, found binary"),
    (_set("extra", 1), "document: unexpected field 'extra'"),
    (_set("clock.monotonic_ns", -5), "clock.monotonic_ns: expected an integer in [0, "),
    (_set("clock", [1, 2]), "clock: expected a map, found array"),
    (_set("agent.args", ["a", 3]), "agent.args[1]: expected a string, found int"),
    (_set("trigger.kind", "bored"), "trigger.kind: unknown trigger kind 'bored'"),
    (_set("trigger.pid", 2**32), "trigger.pid: expected an integer in [0, 4294967295]"),
    (_set("trigger.time_ns", 1.5), "trigger.time_ns: expected an integer, found float"),
    (_set("processes.1.exit_code", 2**40), "processes[1].exit_code: expected an integer in"),
    (_set("processes.0.libs", "x"), "processes[0].libs: expected an array, found string"),
    (_set("processes", {}), "processes: expected an array, found map"),
    (_delete("communicators.1.rank"), "communicators[1]: missing field 'rank'"),
    (_set("communicators.0.comm_hash", None), "communicators[0].comm_hash: expected an integ"),
    (_set("counters.drops", -1), "counters.drops: expected an integer in"),
    (_delete("snapshots"), "document: missing field 'snapshots'"),
    (_set("snapshots.0.processes.0.pid", -1), "snapshots[0].processes[0].pid: expected an int"),
    (_set("snapshots.1.processes.0.env.0", ["A"]), "snapshots[1].processes[0].env[0]: expected"),
    (
        _set("snapshots.0.processes.0.threads.0.syscall_args", [1]),
        "snapshots[0].processes[0].threads[0].syscall_args: expected 0 or 6 arguments, found 1",
    ),
    (
        _set("snapshots.0.processes.0.threads.0.nccl.args_from", "guess"),
        "snapshots[0].processes[0].threads[0].nccl.args_from: unknown value 'guess'",
    ),
    (
        _delete("snapshots.0.processes.0.threads.1.unwind"),
        "snapshots[0].processes[0].threads[1]: missing field 'unwind'",
    ),
    (_delete("links"), "document: missing field 'links'"),
    (_set("links.0.kind", "wifi"), "links[0].kind: expected one of netdev, rdma, found 'wifi'"),
    (_set("links.2.id", 1), "links[2].id: id 1 names two interfaces"),
    (_set("links.1.mtu", -1), "links[1].mtu: expected an integer in [0, 4294967295]"),
    (_set("links.0.pids.1", "1001"), "links[0].pids[1]: expected an integer, found string"),
    (_set("links.0.device", 7), "links[0].device: expected a string, found int"),
    (_delete("links.2.gone_ns"), "links[2]: missing field 'gone_ns'"),
    (_delete("programs"), "document: missing field 'programs'"),
    (
        _set("programs.0.attachment", "kprobe"),
        "programs[0].attachment: expected one of raw_tracepoint, tracepoint, found 'kprobe'",
    ),
    (_set("programs.1.misses", -1), "programs[1].misses: expected an integer in [0, "),
    (_set("programs.2.misses", "0"), "programs[2].misses: expected an integer, found string"),
    (_delete("programs.0.hook"), "programs[0]: missing field 'hook'"),
    (_set("programs.1.program", 5), "programs[1].program: expected a string, found int"),
    (_delete("programs.2.caught"), "programs[2]: missing field 'caught'"),
    (_set("programs.0.caught", "3"), "programs[0].caught: expected an integer, found string"),
]


@pytest.mark.parametrize(("mutate", "message"), BAD_FIELDS)
def test_every_field_is_checked(mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    doc = _doc(sample_recording(100))
    mutate(doc)
    _reseal(doc)
    with pytest.raises(DumpFormatError) as err:
        _decode_doc(doc)
    assert str(err.value).startswith(f"dumps/n1.msgpack: {message}"), str(err.value)


@pytest.mark.parametrize("version", [1, 2])
def test_versions_before_3_are_read_without_thread_positions(version: int) -> None:
    rec = sample_recording()
    raw = msgpack.unpackb(_as_version_1(rec), raw=False) if version == 1 else _as_version_3(rec)
    raw["version"] = version
    raw.pop("snapshots", None)
    back = _decode_doc(raw)
    assert back.snapshots == () and back.host == "node-1" and len(back.rings["nccl"].rows) == 100
    raw["snapshots"] = []
    with pytest.raises(DumpFormatError, match="document: unexpected field 'snapshots'"):
        _decode_doc(raw)


def test_versions_before_7_are_read_without_links_and_refuse_a_link_ring() -> None:
    rec = sample_recording()
    assert rec.links and len(rec.rings["link"].rows)
    doc = _as_version_6(rec)
    back = _decode_doc(doc)
    assert back.links == () and "link" not in back.rings
    assert len(back.rings["nccl"].rows) == 100
    doc["links"] = []
    _reseal(doc)
    with pytest.raises(DumpFormatError, match="document: unexpected field 'links'"):
        _decode_doc(doc)
    doc = _as_version_6(rec)
    doc["rings"]["link"] = _doc(rec)["rings"]["link"]  # type: ignore[index]
    _reseal(doc)
    with pytest.raises(DumpFormatError, match=r"rings\.link: no such ring in format version 6"):
        _decode_doc(doc)


def test_versions_before_9_are_read_without_network_rings_and_refuse_one() -> None:
    rec = sample_recording()
    assert all(len(rec.rings[name].rows) for name in NET_RINGS)
    back = _decode_doc(_as_version_8(rec))
    assert not set(NET_RINGS) & set(back.rings) and back.format_version == 8
    assert len(back.rings["link"].rows) == len(rec.rings["link"].rows)
    for name in NET_RINGS:
        doc = _as_version_8(rec)
        doc["rings"][name] = _doc(rec)["rings"][name]  # type: ignore[index]
        _reseal(doc)
        with pytest.raises(
            DumpFormatError, match=rf"rings\.{name}: no such ring in format version 8"
        ):
            _decode_doc(doc)


def test_programs_skipped_runs_unknown_stay_null_and_versions_before_10_have_none() -> None:
    rec = sample_recording()
    assert any(p.misses is None for p in rec.programs)
    doc = _doc(rec)
    written = doc["programs"]
    assert isinstance(written, list)
    assert [p["misses"] for p in written] == [p.misses for p in rec.programs]
    assert _decode_doc(doc).programs == rec.programs
    doc["version"] = 9
    _reseal(doc)
    with pytest.raises(DumpFormatError, match="document: unexpected field 'programs'"):
        _decode_doc(doc)
    del doc["programs"]
    _reseal(doc)
    back = _decode_doc(doc)
    assert back.programs == () and back.format_version == 9
    assert all(len(back.rings[name].rows) == len(rec.rings[name].rows) for name in NET_RINGS)


def test_a_hooks_unseen_events_are_its_first_programs_skipped_runs_its_second_did_not_run() -> None:
    first, second, tracepoint, uncounted = (
        ProgramMisses("raw_tracepoint__e", "e", "raw_tracepoint", 7, 5),
        ProgramMisses("raw_tracepoint__e__nested", "e", "raw_tracepoint", 2),
        ProgramMisses("tracepoint__c__e", "e", "tracepoint", 4),
        ProgramMisses("tracepoint__c__f", "f", "tracepoint", None),
    )
    assert (first.unseen, second.unseen, tracepoint.unseen, uncounted.unseen) == (2, 0, 4, None)


def test_trailing_bytes_and_truncation_are_refused() -> None:
    data = fmt.encode(sample_recording())
    with pytest.raises(DumpFormatError, match="x: document: 3 unexpected bytes after"):
        fmt.decode(data + b"abc", "x")
    for cut in (1, 40, len(data) // 2, len(data) - 1):
        with pytest.raises(DumpFormatError, match=r"^x: .*truncated"):
            fmt.decode(data[:cut], "x")


# ---------------------------------------------------------------- foreign inputs


def test_foreign_files_are_refused_naming_the_file(tmp_path: Path, fixtures_dir: Path) -> None:
    fr_dump = next((fixtures_dir / "pytorch-fr-nccl-16rank").glob("*/_dump_0"))
    inputs = {
        "json.msgpack": json.dumps({"format": "stallwatch-dump", "version": 1}).encode(),
        "pickle.msgpack": pickle.dumps({"format": "stallwatch-dump"}),
        "empty.msgpack": b"",
        "text.msgpack": b"hello, world\n",
        "random.msgpack": np.random.default_rng(1).bytes(4096),
        "fr.msgpack": fr_dump.read_bytes(),
        "array.msgpack": msgpack.packb([1, 2, 3]),
    }
    for name, data in inputs.items():
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(DumpFormatError, match=f"^{re.escape(str(path))}: "):
            fmt.read_dump(path)


def test_directory_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DumpFormatError, match="is a directory"):
        fmt.read_dump(tmp_path)
    missing = tmp_path / "nope.msgpack"
    with pytest.raises(DumpError, match=f"^{re.escape(str(missing))}: no such file"):
        fmt.read_dump(missing)


# ---------------------------------------------------------------- atomic writer


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.mark.parametrize("failing", ["fsync", "replace", "write"])
def test_failed_write_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    def no_space(*args: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def half_written(rec: Recording):  # type: ignore[no-untyped-def]
        yield b"\x8b" * 1000
        no_space()

    if failing == "write":
        monkeypatch.setattr(fmt, "_chunks", half_written)
    else:
        monkeypatch.setattr(fmt.os, failing, no_space)
    with pytest.raises(DumpWriteError, match="cannot write dump: No space left on device"):
        fmt.write_dump(tmp_path, sample_recording())
    assert _files(tmp_path) == []


def test_no_partial_file_is_visible_while_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[list[str]] = []
    real_fsync = os.fsync

    def watching_fsync(fd: int) -> None:
        seen.append(_files(tmp_path))
        real_fsync(fd)

    monkeypatch.setattr(fmt.os, "fsync", watching_fsync)
    path = fmt.write_dump(tmp_path, sample_recording())
    file_sync = seen[0]
    assert len(file_sync) == 1 and file_sync[0].startswith(f".{path.name}.tmp-")
    assert seen[1] == [path.name]  # the directory, after the rename
    assert _files(tmp_path) == [path.name]


def test_interrupted_encoding_cleans_the_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def chunks(rec: Recording):  # type: ignore[no-untyped-def]
        yield b"\x8b"
        raise KeyboardInterrupt

    monkeypatch.setattr(fmt, "_chunks", chunks)
    with pytest.raises(KeyboardInterrupt):
        fmt.write_dump(tmp_path, sample_recording())
    assert _files(tmp_path) == []


@pytest.mark.bpf
def test_disk_full_and_read_only_on_a_real_tmpfs(tmp_path: Path) -> None:
    rec = sample_recording(20_000)  # about 11 MB
    with tmpfs(tmp_path / "mnt", "1m") as mnt:
        with pytest.raises(DumpWriteError) as err:
            fmt.write_dump(mnt, rec)
        assert str(err.value).startswith(f"{mnt}/node-1-inc-1-")
        assert str(err.value).endswith("cannot write dump: No space left on device")
        assert _files(mnt) == []
        remount(mnt, "size=16m")
        remount(mnt, "ro")
        with pytest.raises(DumpWriteError, match="cannot write dump: Read-only file system"):
            fmt.write_dump(mnt, rec)
        remount(mnt, "rw")
        assert_same(rec, fmt.read_dump(fmt.write_dump(mnt, rec)))


def test_the_benchmark_runs_on_a_small_size(tmp_path: Path) -> None:
    from bench import bench_dumps

    figures = bench_dumps.figures(rows=5000, repeats=1, folder=tmp_path)
    assert [f.ok for f in figures[:2]] == [True, True]
    assert "with checksums" in figures[2].name and figures[2].value > 0
    assert "checked" in figures[3].name and "written with it" in figures[4].name
    assert "4 agents" in figures[5].name and figures[5].value < 5  # converged, or raised
    assert "5,000 nccl entries" in figures[0].name
    assert list(tmp_path.iterdir()) == []  # its temporary folder is gone


def test_deferred_rings_stay_in_the_file_until_read(tmp_path: Path) -> None:
    rec = sample_recording(n_rows=300)
    path = fmt.write_dump(tmp_path, rec)
    head, later = fmt.read_dump_deferred(path, ("nccl", "tcp"))
    assert set(head.rings) == set(rec.rings) - {"nccl", "tcp"}
    assert set(later) == {"nccl", "tcp"}
    full = fmt.read_dump(path)
    buffer = bytearray(later["nccl"].nbytes + later["tcp"].nbytes)  # one buffer, reused
    for name in ("nccl", "tcp"):
        rows = later[name].read(buffer)
        assert rows.dtype == RING_DTYPES[name]
        assert np.array_equal(rows, full.rings[name].rows)
        assert later[name].overwritten == full.rings[name].overwritten
    assert np.array_equal(later["nccl"].read(), full.rings["nccl"].rows)  # fresh memory


def test_deferred_ring_of_a_changed_or_removed_file_is_refused(tmp_path: Path) -> None:
    path = fmt.write_dump(tmp_path, sample_recording(n_rows=50))
    _, later = fmt.read_dump_deferred(path, ("nccl",))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # truncated in place
    with pytest.raises(DumpError, match="changed since it was first read"):
        later["nccl"].read()
    path.unlink()
    with pytest.raises(DumpError, match="removed since it was first read"):
        later["nccl"].read()


def test_deferred_read_still_validates_sizes(tmp_path: Path) -> None:
    path = fmt.write_dump(tmp_path, sample_recording(n_rows=50))
    _, later = fmt.read_dump_deferred(path, ("nccl",))
    cut = tmp_path / "cut.msgpack"
    cut.write_bytes(path.read_bytes()[: later["nccl"].offset + 10])  # inside the skipped rows
    with pytest.raises(DumpFormatError, match=r"cut\.msgpack: rings\.nccl\.data: truncated"):
        fmt.read_dump_deferred(cut, ("nccl",))


def test_the_communicator_table_fast_path_reads_what_the_checked_path_reads(
    tmp_path: Path,
) -> None:
    assert tuple(fmt._COMM_BOUNDS) == fmt._COMM_KEYS  # the fields, in CommInfo's order
    rec = sample_recording(10)
    path = fmt.write_dump(tmp_path, rec)
    doc = msgpack.unpackb(path.read_bytes(), raw=False)
    fast = fmt._comms_fast(doc["communicators"])
    slow = tuple(fmt._read_comm(m, "c", fmt._Checker("x")) for m in doc["communicators"])
    assert fast == slow == rec.communicators
    bad = [dict(m) for m in doc["communicators"]]
    bad[-1]["rank"] = 2**40  # out of bounds: left to the checked path, which names it
    assert fmt._comms_fast(bad) is None

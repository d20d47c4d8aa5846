"""``stallwatch export --flight-recorder``: recorded lab incidents (a hang, a
desync and a crash, on 2 nodes x 2 ranks and 4 x 2: tests/data/lab-hang-2x2,
lab-hang-4x2, lab-desync-*, lab-crash-*) written as PyTorch Flight Recorder
files.

- They read back, through our own reader, to the verdicts of the dumps: the
  same kinds, ranks, seqs (as torch numbers them: from 1), ops and
  communicators.
- Every field torchfrtrace (torch 2.13's ``torch/distributed/flight_recorder``)
  and NVRx's attribution (``nvidia_resiliency_ext/attribution/trace_analyzer/
  fr_attribution.py``) read is there, of the type and in the form they read
  it, each named below from its source (what torchfrtrace itself says on
  them, and on incidents whose windows wrapped: test_frtrace).
- The command: the JSON form, leaving p2p calls out, live agents, refusing to
  rewrite, usage errors.
"""

from __future__ import annotations

import ast
import json
import pickle
import re
from pathlib import Path
from typing import Any

import pytest

from stallwatch.analyzer.frexport import export_flight_recorder
from stallwatch.analyzer.pipeline import AnalysisResult, analyze_paths
from stallwatch.analyzer.verdict import Verdict
from stallwatch.cli import main
from stallwatch.dumpers.format import read_dump
from stallwatch.query.agentclient import close_connections
from stallwatch.query.http import RecordingsBackend, serve_http

DATA = Path(__file__).resolve().parents[1] / "data"
CULPRITS = {
    "hang-2x2": ("missing_rank", [3]),
    "hang-4x2": ("missing_rank", [5]),
    "desync-2x2": ("desync", [1]),
    "desync-4x2": ("desync", [6]),
    "crash-2x2": ("rank_exited", [2]),
    "crash-4x2": ("rank_exited", [5]),
}
INCIDENTS = {name: DATA / f"lab-{name}" for name in CULPRITS}


def _key(v: Verdict, base: int = 0) -> tuple[object, ...]:
    """What a verdict says; ``base``: added to its seq (the files count
    from 1, as torch does; our dumps from 0, as NCCL does)."""
    return (v.kind.value, v.ranks, None if v.seq is None else v.seq + base, v.op, v.comm_id_hash)


def _export(name: str, out: Path, json_form: bool = False, p2p: bool = True) -> AnalysisResult:
    result = analyze_paths([str(INCIDENTS[name])])
    export_flight_recorder(result.incidents, out, json_form, p2p)
    return result


def test_the_incidents_are_what_they_say() -> None:
    for name, (kind, ranks) in CULPRITS.items():
        (inc,) = analyze_paths([str(INCIDENTS[name])]).incidents
        v = inc.verdicts[0]
        assert (v.kind.value, list(v.ranks)) == (kind, ranks), name


@pytest.mark.parametrize("form", ["pickle", "json"])
@pytest.mark.parametrize("name", sorted(CULPRITS))
def test_the_export_reads_back_to_the_same_verdicts(name: str, form: str, tmp_path: Path) -> None:
    """Kinds, world ranks, seqs (as torch numbers them: ours plus one), ops
    and communicators of every verdict: what torch's format holds plus our
    section (pids, exits, results of failed calls, the communicators' ids)
    is what the verdicts were drawn from."""
    original = _export(name, tmp_path, json_form=form == "json")
    files = sorted(p.name for p in tmp_path.iterdir())
    world = len(original.incidents[0].incident.procs)
    suffix = ".json" if form == "json" else ""
    assert files == sorted(f"rank_{r}{suffix}" for r in range(world))
    (back,) = analyze_paths([str(tmp_path)]).incidents
    (first,) = original.incidents
    assert [_key(v) for v in back.verdicts] == [_key(v, 1) for v in first.verdicts]
    assert all(s.ok for s in analyze_paths([str(tmp_path)]).inputs)


def test_the_culprit_is_the_same_without_point_to_point_calls(tmp_path: Path) -> None:
    for name, (kind, ranks) in CULPRITS.items():
        _export(name, tmp_path / name, p2p=False)
        docs = [pickle.loads(p.read_bytes()) for p in (tmp_path / name).iterdir()]
        assert not any(e["is_p2p"] for d in docs for e in d["entries"])
        (back,) = analyze_paths([str(tmp_path / name)]).incidents
        v = back.verdicts[0]
        assert (v.kind.value, list(v.ranks)) == (kind, ranks), name


# --- what torchfrtrace reads (torch 2.13: torch/distributed/flight_recorder) ----

COLLECTIVES = {  # components/types.py: COLLECTIVES, P2P
    "broadcast", "_broadcast_oop", "reduce", "_reduce_oop", "all_gather",
    "all_gather_single", "all_gather_v", "all_reduce", "_all_gather_base",
    "all_gather_into_tensor_coalesced", "reduce_scatter", "reduce_scatter_single",
    "reduce_scatter_v", "reduce_scatter_tensor_coalesced", "_reduce_scatter_base",
    "gather", "scatter", "all_to_all", "all_to_all_single", "all_to_all_v_single",
    "all_reduce_barrier", "barrier", "split", "new_window", "allreduce_coalesced",
    "ALLGATHER_coalesced", "REDUCE_SCATTER_coalesced",
}  # fmt: skip
P2P = {"send", "recv"}
BACKENDS = {"nccl", "ncclx", "xccl", "gloo", "rccl", "rcclx", "mccl", "hccl"}  # types.Op
PREFIX = re.compile(r"([\w\-\_]*?)(\d+)$")  # components/loader.py: exp


def _torchfrtrace_reads(folder: Path) -> None:
    files = sorted(folder.iterdir())
    # loader._determine_prefix: one common prefix before the rank
    prefixes = {PREFIX.search(p.name).group(1) for p in files}  # type: ignore[union-attr]
    assert prefixes == {"rank_"}
    docs = {int(p.name[len("rank_") :]): pickle.loads(p.read_bytes()) for p in files}
    # loader.read_dump: entries, version, pg_config; utils.check_version: one version,
    # get_version_detail: "major.minor"
    assert {d["version"] for d in docs.values()} == {"2.10"}
    guids: dict[tuple[str, int], str] = {}
    members: dict[str, tuple[str, set[int]]] = {}
    for rank, d in docs.items():
        # builder.build_groups_memberships: desc, ranks (ast.literal_eval), and
        # one desc and one membership per group across ranks
        for uid, cfg in d["pg_config"].items():
            ranks = ast.literal_eval(cfg["ranks"])
            assert all(isinstance(r, int) for r in ranks) and rank in ranks
            guid = uid + str(hash(frozenset(ranks)))
            guids[(uid, rank)] = guid
            assert members.setdefault(guid, (cfg["desc"], set(ranks))) == (cfg["desc"], set(ranks))
    for rank, d in docs.items():
        # utils.align_trace_from_beginning: record_id; the ranks start alike
        assert [e["record_id"] for e in d["entries"]] == list(range(len(d["entries"])))
        for e in d["entries"]:
            # builder.build_collectives, types.EntryState, types.Op
            pg, desc = e["process_group"]
            guid = guids[(pg, rank)]  # the group of every entry is in the rank's pg_config
            assert desc == members[guid][0]
            backend, name = e["profiling_name"].split(":")
            assert backend in BACKENDS
            op, *meta = name.split(" ")
            assert op in COLLECTIVES | P2P
            size = len(members[guid][1])
            if op in P2P:  # "send 0->1", "recv 1<-0": group ranks
                a, b = map(int, meta[0].split("->" if op == "send" else "<-"))
                assert 0 <= a < size and 0 <= b < size
            for key in ("collective_seq_id", "p2p_seq_id", "time_created_ns"):
                assert isinstance(e[key], int)
            for key in ("input_sizes", "output_sizes"):
                assert all(isinstance(x, int) for s in e[key] for x in s)
            assert len(e["input_dtypes"]) == len(e["input_sizes"])
            assert len(e["output_dtypes"]) == len(e["output_sizes"])
            assert e["state"] in ("scheduled", "started", "completed")
            assert isinstance(e["is_p2p"], bool) and e["is_p2p"] == (op in P2P)
            if op in ("_all_gather_base", "all_gather"):  # types.Op.match: sizes of the group
                assert e["output_sizes"][0][0] == e["input_sizes"][0][0] * size


# --- what NVRx's attribution reads (trace_analyzer/fr_attribution.py) -----------


def _nvrx_reads(folder: Path) -> None:
    for p in sorted(folder.iterdir()):
        # process_file: the rank is the file name's last "_" part; pickle.load,
        # then json.loads(json.dumps(data))
        rank = p.stem.split("_")[-1]
        assert rank.isdigit()
        data = json.loads(json.dumps(pickle.loads(p.read_bytes())))
        for group, mapping in data["pg_config"].items():
            int(group)  # print_pg_configs, analyze_matches: int(process group)
            ranks = [int(r) for r in mapping["ranks"].strip("[]").split(",")]
            assert int(rank) in ranks and isinstance(mapping["desc"], str)
        for e in data["entries"]:
            # extract_collectives: the fields of its Collective
            for key in ("collective_seq_id", "pg_id", "op_id", "time_created_ns"):
                assert isinstance(e[key], int)
            for key in ("record_id", "p2p_seq_id"):
                assert isinstance(e.get(key, -1), int)
            assert isinstance(e["profiling_name"], str) and len(e["process_group"]) == 2
            for key in ("input_sizes", "output_sizes", "input_dtypes", "output_dtypes"):
                assert isinstance(e[key], list)
            assert e["state"] in ("scheduled", "started", "completed")
            # analyze_matches: pg_status[rank][str(pg_id)], integer counters
            status = data["pg_status"][str(e["pg_id"])]
            assert isinstance(status["last_completed_collective"], int)
            assert isinstance(status["last_enqueued_collective"], int)


@pytest.mark.parametrize("name", sorted(CULPRITS))
def test_what_torchfrtrace_and_nvrx_read_is_there(name: str, tmp_path: Path) -> None:
    _export(name, tmp_path)
    _torchfrtrace_reads(tmp_path)
    _nvrx_reads(tmp_path)


def test_the_hang_as_nvrx_reads_it(tmp_path: Path) -> None:
    """NVRx takes the entries still ``scheduled`` of each group, and ranks
    whose ``pg_status`` enqueued less than the group's most: the ranks that
    wait in the hung all_gather of the hang-4x2 incident have it pending,
    rank 5 (which never entered it) has nothing pending there and enqueued
    less."""
    _export("hang-4x2", tmp_path)
    docs = {int(p.name[5:]): pickle.loads(p.read_bytes()) for p in tmp_path.iterdir()}
    group = next(
        name
        for name, cfg in docs[5]["pg_config"].items()
        if cfg["desc"] == "nccl_comm_0xa416ab2a98cd4ea8"
    )
    pending: dict[int, list[int]] = {}
    enqueued: dict[int, int] = {}
    for rank, d in docs.items():
        mine = [e for e in d["entries"] if e["process_group"][0] == group]
        if not mine:
            continue
        pending[rank] = [e["collective_seq_id"] for e in mine if not e["retired"]]
        enqueued[rank] = d["pg_status"][str(mine[0]["pg_id"])]["last_enqueued_collective"]
    assert sorted(pending) == [4, 5]
    assert pending[5] == [] and pending[4] == [enqueued[4]]
    assert enqueued[5] == enqueued[4] - 1


# --- the command ----------------------------------------------------------------


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["export", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = str(INCIDENTS["hang-4x2"])
    code, out, _ = _run(capsys, "--flight-recorder", folder, "-o", str(tmp_path / "a"))
    assert code == 0 and "8 Flight Recorder file(s) (ranks 0-7)" in out
    assert f"torchfrtrace {tmp_path / 'a'}-collectives -p rank_" in out  # p2p calls left out
    code, _, err = _run(capsys, "--flight-recorder", folder, "-o", str(tmp_path / "a"))
    assert code == 2 and "rank_0: already there" in err
    code, out, _ = _run(capsys, "--flight-recorder", folder, "-o", str(tmp_path / "j"), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["form"] == "json" and doc["incidents"][0]["ranks"] == list(range(8))
    one = json.loads((tmp_path / "j" / "rank_5.json").read_bytes())
    assert one["pg_status"]["0"]["last_enqueued_collective"].lstrip("-").isdigit()  # strings
    code, _, _ = _run(capsys, "--flight-recorder", folder, "-o", str(tmp_path / "c"))
    assert code == 0


def test_what_cannot_be_read_or_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lost = tmp_path / "in"
    lost.mkdir()
    for p in INCIDENTS["hang-2x2"].glob("*.msgpack"):
        (lost / p.name).write_bytes(p.read_bytes())
    broken = lost / "node1.msgpack"
    broken.write_bytes(broken.read_bytes()[:100])
    code, _, err = _run(capsys, "--flight-recorder", str(lost), "-o", str(tmp_path / "out"))
    assert code == 1 and "node1.msgpack" in err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["rank_0", "rank_1"]
    broken.write_bytes(b"not a dump")
    (lost / "node0.msgpack").write_bytes(b"not a dump either")
    code, _, err = _run(capsys, "--flight-recorder", str(lost), "-o", str(tmp_path / "none"))
    assert code == 2 and "no dump could be read" in err
    for args, text in (
        (["--flight-recorder", "-o", "x"], "give dump files or folders, or --agents"),
        (["--flight-recorder", "d", "--agents", "a:1", "-o", "x"], "not both"),
        (["--perfetto", "--agents", "a:1", "-o", "x"], "--agents goes with --flight-recorder"),
        (["--perfetto", "d", "--collectives-only", "-o", "x"], "goes with --flight-recorder"),
        (["--perfetto", "-o", "x"], "give dump files or folders"),
    ):
        code, _, err = _run(capsys, *args)
        assert code == 2 and text in err, args


def _section_free(folder: Path) -> dict[str, Any]:
    out = {}
    for p in sorted(folder.iterdir()):
        doc = pickle.loads(p.read_bytes())
        doc["stallwatch"].pop("incident")
        out[p.name] = doc
    return out


def test_live_agents(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--agents``: the agents' current recordings, the same files as their
    dumps give (but for the incident id a live fetch gives itself)."""
    handles = [
        serve_http(RecordingsBackend([read_dump(p)]), "127.0.0.1:0", None)
        for p in sorted(INCIDENTS["hang-2x2"].glob("*.msgpack"))
    ]
    try:
        agents = ",".join(h.address for h in handles)
        code, _, err = _run(
            capsys, "--flight-recorder", "--agents", agents, "-o", str(tmp_path / "live")
        )
    finally:
        for h in handles:
            h.close()
        close_connections()
    assert code == 0, err
    _export("hang-2x2", tmp_path / "dumps")
    assert _section_free(tmp_path / "live") == _section_free(tmp_path / "dumps")

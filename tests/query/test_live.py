"""The live surface: ``POST /recording`` (what a dump would hold, nothing
written), ``GET /dumps`` and ``POST /collect`` (a dump folder's incidents),
the dump frames they travel in, and the analyzer on recordings in memory
giving what it gives on the same dumps as files."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator, Sequence
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from stallwatch.analyzer.live import analyze_agents
from stallwatch.analyzer.pipeline import AnalysisResult, analyze_paths, analyze_recordings
from stallwatch.analyzer.report import to_json
from stallwatch.analyzer.verdict import VerdictKind
from stallwatch.cli import main
from stallwatch.dumpers.errors import DumpFormatError
from stallwatch.dumpers.folder import list_dumps, save_dump
from stallwatch.dumpers.format import decode, read_dump, write_dump
from stallwatch.dumpers.model import Recording, Trigger, TriggerKind
from stallwatch.query.agentclient import close_connections
from stallwatch.query.http import RecordingsBackend, serve_http
from stallwatch.query.live import AgentCall, collect, fetch_recordings
from stallwatch.query.wire import DUMP_FRAMES, DumpBundle, decode_dumps, encode_dumps, join_frames
from tests.deploy.test_deploy import free_port
from tests.dump_samples import assert_same, sample_recording
from tests.query.test_http import request

DATA = Path(__file__).resolve().parents[1] / "data"
JSON = {"Content-Type": "application/json"}


class LiveFake:
    """A live agent's side of the seam: a recording stamped with the
    asker's incident id, and a dump folder."""

    def __init__(self, rec: Recording, dump_dir: Path) -> None:
        self.rec, self.dump_dir, self.host = rec, dump_dir, rec.host
        self.asked: list[tuple[str, str]] = []

    def recording(self) -> Recording:
        return self.rec

    def metrics_text(self) -> str:
        return ""

    def live_recordings(self, incident_id: str, reason: str) -> Sequence[Recording]:
        self.asked.append((incident_id, reason))
        trig = Trigger(TriggerKind.MANUAL, reason, incident_id, self.rec.clock.monotonic_ns)
        return [replace(self.rec, trigger=trig)]


@pytest.fixture
def live(tmp_path: Path) -> Iterator[tuple[str, LiveFake]]:
    fake = LiveFake(sample_recording(host="node7"), tmp_path / "dumps")
    handle = serve_http(fake, "127.0.0.1:0", None)
    yield handle.address, fake
    handle.close()


def post(address: str, path: str, doc: dict[str, object]) -> tuple[int, object]:
    return request(address, "POST", path, json.dumps(doc).encode(), JSON)


def test_recording_is_what_a_dump_would_hold_under_the_askers_incident(
    live: tuple[str, LiveFake],
) -> None:
    address, fake = live
    status, body = post(address, "/recording", {"incident_id": "live-1", "reason": "on call"})
    assert status == 200 and isinstance(body, bytes)
    bundle = decode_dumps(body)
    assert (bundle.host, bundle.incident_id) == ("node7", "live-1")
    (name,) = bundle.names
    rec = decode(bundle.blobs[0], name)  # the validating reader
    assert rec.trigger is not None and rec.trigger.incident_id == "live-1"
    assert rec.trigger.reason == "on call"
    assert_same(rec, replace(fake.rec, trigger=rec.trigger))
    assert fake.asked == [("live-1", "on call")]
    assert not fake.dump_dir.exists()  # nothing written


def test_recording_without_an_incident_gets_one(live: tuple[str, LiveFake]) -> None:
    address, fake = live
    status, body = post(address, "/recording", {})
    assert status == 200 and isinstance(body, bytes)
    incident = decode_dumps(body).incident_id
    assert incident is not None and incident.startswith("live-")
    assert fake.asked[0][0] == incident


def test_serve_answers_recording_with_the_dumps_it_serves() -> None:
    recs = [sample_recording(host="a"), sample_recording(50, host="b", incident="inc-2")]
    handle = serve_http(RecordingsBackend(recs), "127.0.0.1:0", None)
    try:
        status, body = post(handle.address, "/recording", {"incident_id": "ignored"})
        assert status == 200 and isinstance(body, bytes)
        bundle = decode_dumps(body)
        got = [decode(b, n) for n, b in zip(bundle.names, bundle.blobs, strict=True)]
        for mine, theirs in zip(got, recs, strict=True):
            assert_same(mine, theirs)  # their own triggers, not the asker's
        assert post(handle.address, "/collect", {"incident_id": "x"})[0] == 501
        assert request(handle.address, "GET", "/dumps")[0] == 501
    finally:
        handle.close()


def written(folder: Path, host: str, incident: str | None, at_ns: int) -> Path:
    rec = sample_recording(host=host)
    trig = None if incident is None else Trigger(TriggerKind.IN_FLIGHT, "stuck", incident, at_ns)
    return write_dump(folder, replace(rec, trigger=trig))


def test_dumps_lists_the_folder_newest_first_and_collect_sends_one_incident(
    live: tuple[str, LiveFake],
) -> None:
    address, fake = live
    folder = fake.dump_dir
    base = fake.rec.clock.monotonic_ns
    old = written(folder, "node7", "inc-old", base)
    new = written(folder, "node7", "inc-new", base + 60 * 10**9)
    (folder / "notes.txt").write_text("not a dump")
    (folder / "broken.msgpack").write_bytes(b"\x00" * 40)
    status, doc = request(address, "GET", "/dumps")
    assert status == 200 and isinstance(doc, dict)
    assert [(d["name"], d["incident_id"]) for d in doc["dumps"]] == [
        (new.name, "inc-new"),
        (old.name, "inc-old"),
    ]
    assert doc["dumps"][0]["bytes"] == new.stat().st_size
    status, body = post(address, "/collect", {"incident_id": "inc-old"})
    assert status == 200 and isinstance(body, bytes)
    bundle = decode_dumps(body)
    assert bundle.names == (old.name,) and bundle.blobs == (old.read_bytes(),)
    status, err = post(address, "/collect", {"incident_id": "inc-none"})
    assert status == 404 and isinstance(err, dict) and "inc-none" in err["error"]
    assert post(address, "/collect", {})[0] == 400


def test_list_dumps_of_a_missing_folder_is_empty(tmp_path: Path) -> None:
    assert list_dumps(tmp_path / "absent") == []
    written(tmp_path, "n1", None, 5)
    (only,) = list_dumps(tmp_path)
    assert only.incident_id is None and only.host == "n1"


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"", "no frames"),
        (b"\x00\x00\x00\x00\x00\x00\x00\x09{}", "cut short"),
        (join_frames([b"[1]"]), "no list of names"),
        (join_frames([b'{"names": ["a", "b"]}', b"x"]), "2 names for 1 dumps"),
        (join_frames([b"\xff"]), "not JSON"),
    ],
)
def test_decode_dumps_refuses_a_malformed_answer(body: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        decode_dumps(body)


def test_a_dump_that_fails_its_reader_is_named() -> None:
    bundle = decode_dumps(encode_dumps(DumpBundle("h", None, ("x.msgpack",), (b"junk",))))
    with pytest.raises(DumpFormatError, match=r"x\.msgpack"):
        decode(bundle.blobs[0], bundle.names[0])
    assert DUMP_FRAMES == "application/x-stallwatch-dumps"


@pytest.mark.parametrize("scenario", ["lab-hang-2x2", "lab-cpuhog-2x2", "lab-gpuslow-4x2"])
def test_analysis_in_memory_is_the_analysis_of_the_files(scenario: str) -> None:
    paths = sorted(str(p) for p in (DATA / scenario).glob("*.msgpack"))
    on_files = analyze_paths(paths)
    in_memory = analyze_recordings([(p, read_dump(p)) for p in paths])
    assert to_json(in_memory) == to_json(on_files)
    assert on_files.incidents  # something was judged


def test_lost_agents_are_lost_inputs() -> None:
    paths = sorted(str(p) for p in (DATA / "lab-hang-2x2").glob("*.msgpack"))
    from stallwatch.analyzer.incident import InputStatus

    lost = InputStatus("node9:9400", False, "node9:9400: cannot reach the agent: refused")
    result = analyze_recordings([(paths[0], read_dump(paths[0]))], [lost])
    assert result.lost == (lost,)
    assert not result.healthy
    doc = json.loads(to_json(result))
    assert {"path": "node9:9400", "ok": False}.items() <= doc["inputs"][-1].items()


def test_saved_dumps_take_the_per_node_layout_as_sent(tmp_path: Path) -> None:
    # a recorded dump: analyze reads it (random rows are refused as damaged)
    rec = read_dump(sorted((DATA / "lab-hang-2x2").glob("*.msgpack"))[0])
    data = encode_dumps(DumpBundle("x", None, (), ()))  # not a dump at all
    with pytest.raises(DumpFormatError, match=r"node3:bad\.msgpack"):
        save_dump(tmp_path, "node3", "bad.msgpack", data)
    from stallwatch.dumpers.format import encode

    blob = encode(rec)
    path, back = save_dump(tmp_path, "node3", "../../escape/n3.msgpack", blob)
    assert path == tmp_path / "node3" / "n3.msgpack" and path.read_bytes() == blob
    assert_same(back, rec)
    path, _ = save_dump(tmp_path, "../evil host", "n4.msgpack", blob)
    assert path.parent.parent == tmp_path and path.parent.name == "evil_host"
    with pytest.raises(DumpFormatError, match="not named as a dump"):
        save_dump(tmp_path, "node3", "n3.txt", blob)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "evil_host",
        "evil_host/n4.msgpack",
        "node3",
        "node3/n3.msgpack",
    ]
    assert [s.path for s in analyze_paths([str(tmp_path)]).inputs if s.ok] == [
        str(tmp_path / "evil_host" / "n4.msgpack"),
        str(tmp_path / "node3" / "n3.msgpack"),
    ]


# ---------------------------------------------------------------- the client side


@pytest.fixture
def lab_fleet() -> Iterator[list[str]]:
    """Each node of a recorded lab hang served by an agent of its own."""
    handles = [
        serve_http(RecordingsBackend([read_dump(p)]), "127.0.0.1:0", None)
        for p in sorted((DATA / "lab-hang-2x2").glob("*.msgpack"))
    ]
    yield [h.address for h in handles]
    for h in handles:
        h.close()
    close_connections()


def verdicts(result: AnalysisResult) -> object:
    return incidents_of(to_json(result))


def incidents_of(text: str) -> object:
    """The incidents of ``analyze --json``, each culprit's input file left
    out: the same culprit is a file on disk, or the agent it came from."""
    incidents = json.loads(text)["incidents"]
    for inc in incidents:
        for v in inc["verdicts"]:
            for c in v.get("culprits", []):
                c.pop("file", None)
    return incidents


def test_live_verdict_is_the_verdict_of_the_dumps(lab_fleet: list[str], tmp_path: Path) -> None:
    live = analyze_agents(AgentCall(tuple(lab_fleet), timeout=10), save=tmp_path / "saved")
    files = analyze_paths([str(DATA / "lab-hang-2x2")])
    assert verdicts(live.result) == verdicts(files)
    assert live.result.incidents[0].verdicts[0].kind is VerdictKind.MISSING_RANK
    assert [s.path.split("/")[0] for s in live.result.inputs] == sorted(lab_fleet)
    # saved: one incident in the per-node layout, read like any folder
    assert {p.parent.name for p in live.saved} == {"node0", "node1"}
    assert verdicts(analyze_paths([str(tmp_path / "saved")])) == verdicts(files)


def test_live_agents_that_do_not_answer_are_lost_inputs(lab_fleet: list[str]) -> None:
    dead = f"127.0.0.1:{free_port()}"
    live = analyze_agents(AgentCall((lab_fleet[0], dead), timeout=5))
    (lost,) = live.result.lost
    assert lost.path == dead and lost.error is not None and lost.error.startswith(dead + ": ")
    assert len(live.gathered.fetched) == 1 and not live.result.healthy


def test_live_recordings_share_the_askers_incident(tmp_path: Path) -> None:
    fakes = [LiveFake(sample_recording(host=f"n{k}"), tmp_path / f"d{k}") for k in range(3)]
    handles = [serve_http(f, "127.0.0.1:0", None) for f in fakes]
    try:
        got = fetch_recordings(AgentCall(tuple(h.address for h in handles)), "live-x", "why")
    finally:
        for h in handles:
            h.close()
    assert [f.host for f in got.fetched] == ["n0", "n1", "n2"] and not got.failed
    assert {f.recording.trigger.incident_id for f in got.fetched if f.recording.trigger} == {
        "live-x"
    }
    assert [fake.asked for fake in fakes] == [[("live-x", "why")]] * 3


class _Junk(BaseHTTPRequestHandler):
    """An agent of another kind: dump frames around bytes that are no dump."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        body = encode_dumps(DumpBundle("odd", "live-y", ("odd.msgpack",), (b"\x93junk",)))
        self.send_response(200)
        self.send_header("Content-Type", DUMP_FRAMES)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_an_answer_the_reader_refuses_fails_that_agent(lab_fleet: list[str]) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Junk)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    odd = f"127.0.0.1:{server.server_address[1]}"
    try:
        got = fetch_recordings(AgentCall((odd, lab_fleet[0])), "live-y")
    finally:
        server.shutdown()
        server.server_close()
    assert [f.host for f in got.fetched] == ["node0"]
    (failed,) = got.failed
    assert failed.agent == odd and f"{odd}/odd.msgpack" in failed.error


def test_collect_brings_the_newest_incident_home_and_names_who_sent_nothing(
    tmp_path: Path,
) -> None:
    fakes = [LiveFake(sample_recording(host=f"n{k}"), tmp_path / f"d{k}") for k in range(3)]
    base = fakes[0].rec.clock.monotonic_ns
    for k, fake in enumerate(fakes):
        written(fake.dump_dir, fake.host, "inc-old", base)
        if k != 2:  # n2 never dumped the newest incident
            written(fake.dump_dir, fake.host, "inc-new", base + 10**9)
    handles = [serve_http(f, "127.0.0.1:0", None) for f in fakes]
    stopped = f"127.0.0.1:{free_port()}"
    agents = (handles[0].address, stopped, handles[1].address, handles[2].address)
    out = tmp_path / "incident"
    try:
        got = collect(AgentCall(agents, timeout=5), None, out)
        old = collect(AgentCall(agents, timeout=5), "inc-old", tmp_path / "old")
    finally:
        for h in handles:
            h.close()
    assert got.incident_id == "inc-new"
    assert sorted(p.relative_to(out).parts[0] for _, p in got.saved) == ["n0", "n1"]
    assert [f.agent for f in got.failed] == [stopped, handles[2].address]
    assert "cannot reach" in got.failed[0].error and "no dump of incident" in got.failed[1].error
    for fetched, path in got.saved:
        assert path.read_bytes() == (fetched_dir(fakes, fetched.host) / fetched.name).read_bytes()
    assert len(old.saved) == 3 and [f.agent for f in old.failed] == [stopped]


def fetched_dir(fakes: list[LiveFake], host: str) -> Path:
    return next(f.dump_dir for f in fakes if f.host == host)


# ---------------------------------------------------------------- the commands


def test_analyze_agents_prints_the_verdict_of_the_dumps(
    lab_fleet: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    listed = tmp_path / "agents.txt"
    listed.write_text(f"# the job's nodes\n{lab_fleet[0]}\n{lab_fleet[1]}  # node1\n")
    save = tmp_path / "saved"
    assert main(["analyze", "--agents-file", str(listed), "--json", "--save", str(save)]) == 1
    out, err = capsys.readouterr()
    assert incidents_of(out) == verdicts(analyze_paths([str(DATA / "lab-hang-2x2")]))
    assert f"saved 2 dump(s) in {save}" in err
    assert main(["analyze", str(save)]) == 1  # the saved incident, read as any folder
    text = capsys.readouterr().out
    assert "MISSING_RANK" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["analyze"], "give dump files or folders, or --agents"),
        (["analyze", "x.msgpack", "--agents", "a:1"], "give dump files or folders, or --agents"),
        (["analyze", "x.msgpack", "--save", "d"], "--save goes with --agents"),
        (["analyze", "--agents", "nohostport"], "expected HOST:PORT"),
        (["analyze", "--agents-file", "/nonexistent/agents"], "--agents-file /nonexistent/agents"),
        (["collect", "--agents", "a:1"], "required: -o/--out"),
        (["collect", "-o", "d"], "no agents given"),
    ],
)
def test_live_commands_refuse_bad_usage_in_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with contextlib.suppress(SystemExit):
        assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and "Traceback" not in "".join(err)


def test_collect_summarises_what_came_and_what_did_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fakes = [LiveFake(sample_recording(host=f"n{k}"), tmp_path / f"d{k}") for k in range(2)]
    for fake in fakes:
        written(fake.dump_dir, fake.host, "inc-7", fake.rec.clock.monotonic_ns)
    handles = [serve_http(f, "127.0.0.1:0", None) for f in fakes]
    stopped = f"127.0.0.1:{free_port()}"
    agents = ",".join([handles[0].address, stopped, handles[1].address])
    out = tmp_path / "incident"
    try:
        code = main(["collect", "--agents", agents, "-o", str(out)])
        empty = main(["collect", "inc-none", "--agents", handles[0].address, "-o", str(out)])
    finally:
        for h in handles:
            h.close()
    assert code == 1 and empty == 2
    text = capsys.readouterr().out
    assert "incident inc-7: 2 of 3 agents sent their dumps" in text
    (lost_line,) = [line for line in text.splitlines() if line.startswith(stopped)]
    assert "cannot reach the agent" in lost_line
    assert sorted(p.name for p in out.iterdir()) == ["n0", "n1"]


def test_collect_with_nothing_names_each_agents_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No incident anywhere: one agent unreachable, one that answers with no
    dump; each agent's reason in the table, one line on stderr, exit 2."""
    fake = LiveFake(sample_recording(host="n0"), tmp_path / "d0")  # keeps no dump
    handle = serve_http(fake, "127.0.0.1:0", None)
    stopped = f"127.0.0.1:{free_port()}"
    out = tmp_path / "incident"
    try:
        code = main(["collect", "--agents", f"{stopped},{handle.address}", "-o", str(out)])
    finally:
        handle.close()
    first = capsys.readouterr()
    assert code == 2
    text = first.out
    assert "no incident to collect: 0 of 2 agents sent a dump" in text
    rows = {line.split()[0]: line for line in text.splitlines() if line.startswith("127.")}
    assert "cannot reach the agent" in rows[stopped]
    assert "holds no dump of any incident" in rows[handle.address]
    err = first.err.strip().splitlines()
    assert err[-1].startswith("stallwatch collect: nothing collected")
    assert len(err) == 1 and not out.exists()


def test_collect_unreachable_agents_say_why_in_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stopped = f"127.0.0.1:{free_port()}"
    assert main(["collect", "--agents", stopped, "-o", str(tmp_path / "x"), "--json"]) == 2
    out, err = capsys.readouterr()
    (row,) = json.loads(out)["agents"]
    assert row["agent"] == stopped and "cannot reach the agent" in row["lost"]
    why = "none of 1 agents answered (each agent's reason above)"
    assert err.strip() == f"stallwatch collect: nothing collected: {why}"

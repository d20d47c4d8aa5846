"""Where peers come from (``--peers-from``): a Slurm node list, a headless
Service's DNS answer (a fake resolver behind the seam), a file that changes;
and an incident sent to the peers a changing file names at that moment."""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stallwatch.cli import main
from stallwatch.dumpers.errors import UsageError
from stallwatch.dumpers.model import Trigger, TriggerKind
from stallwatch.recorder.peers import (
    FilePeers,
    Own,
    PeerList,
    ServicePeers,
    expand_hostlist,
    peer_notifier,
    peer_source,
    self_names,
    slurm_peers,
)

OWN = Own(frozenset({"gpu2", "10.0.0.2"}), 9400)

# ---------------------------------------------------------------- Slurm host lists


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("a[1-2]-b[3,5]", ["a1-b3", "a1-b5", "a2-b3", "a2-b5"]),
        ("gpu[1-2],cpu7,io[08-10]", ["gpu1", "gpu2", "cpu7", "io08", "io09", "io10"]),
        ("n[8-10]", ["n8", "n9", "n10"]),  # no padding: the low end has one digit
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("rack[1-2]n[1,3]", ["rack1n1", "rack1n3", "rack2n1", "rack2n3"]),
        ("10.0.0.[1-3]", ["10.0.0.1", "10.0.0.2", "10.0.0.3"]),
        ("[1-2]x", ["1x", "2x"]),
        ("gpu7", ["gpu7"]),
        ("n[5],n[5-6],n5", ["n5", "n6"]),  # once each, in first place
        ("node[1-2], node3 ,", ["node1", "node2", "node3"]),
    ],
)
def test_expand_hostlist_as_slurm_does(nodelist: str, hosts: list[str]) -> None:
    assert expand_hostlist(nodelist) == hosts


@pytest.mark.parametrize(
    ("nodelist", "why"),
    [
        ("node[1-4", "'\\[' without '\\]'"),
        ("node1-4]", "'\\]' without '\\['"),
        ("node[[1-2]]", "nested"),
        ("node[4-1]", "backwards"),
        ("node[a-b]", "expected N or N-M"),
        ("node[1-]", "expected N or N-M"),
        ("node[]", "expected N or N-M"),
        ("node[1-99999999]", "more than"),
        ("node 1", "space in host name"),
    ],
)
def test_expand_hostlist_refuses_what_slurm_would_not_write(nodelist: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        expand_hostlist(nodelist)


@st.composite
def host_groups(draw: st.DrawFn) -> tuple[str, list[str]]:
    """A Slurm-style compressed list and, built independently, what it names."""
    exprs, expected = [], []
    for _ in range(draw(st.integers(1, 4))):
        prefix = draw(st.sampled_from(["gpu", "node-", "r1n", "10.0.0."]))
        width = draw(st.integers(1, 3))
        ranges = draw(
            st.lists(st.tuples(st.integers(0, 60), st.integers(0, 5)), min_size=1, max_size=3)
        )
        parts = []
        for lo, span in ranges:
            hi = lo + span
            parts.append(f"{lo:0{width}d}" if span == 0 else f"{lo:0{width}d}-{hi:0{width}d}")
            expected.extend(f"{prefix}{n:0{width}d}" for n in range(lo, hi + 1))
        exprs.append(f"{prefix}[{','.join(parts)}]")
    return ",".join(exprs), list(dict.fromkeys(expected))


@given(host_groups())
def test_expand_hostlist_names_every_host_of_its_ranges(case: tuple[str, list[str]]) -> None:
    nodelist, expected = case
    assert expand_hostlist(nodelist) == expected


def test_slurm_peers_are_the_jobs_other_nodes_on_the_agents_port() -> None:
    peers = slurm_peers("gpu[1-3],10.0.0.[2-3]", OWN)
    assert peers.peers() == ("gpu1:9400", "gpu3:9400", "10.0.0.3:9400")


def test_slurm_source_reads_the_jobs_node_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[01-04,07]")
    monkeypatch.setenv("SLURMD_NODENAME", "node03")
    source = peer_source(["slurm"], self_names("0.0.0.0:9400"))
    assert source.peers() == tuple(f"node{n}:9400" for n in ("01", "02", "04", "07"))


@pytest.mark.parametrize(
    ("spec", "env", "message"),
    [
        (["slurm"], {}, "SLURM_JOB_NODELIST is not set"),
        (["slurm"], {"SLURM_JOB_NODELIST": "gpu[3-1]"}, "SLURM_JOB_NODELIST='gpu\\[3-1\\]'"),
        (["slurm", "x"], {}, "--peers-from slurm: expected no argument"),
        (["k8s-service"], {}, "--peers-from k8s-service: expected one argument"),
        (["k8s-service", "svc:0"], {}, "expected NAME\\[:PORT\\]"),
        (["consul", "x"], {}, "--peers-from: expected one of k8s-service, slurm, file"),
        (["file", "/nonexistent/peers"], {}, "--peers-from file /nonexistent/peers"),
    ],
)
def test_peer_source_names_what_is_wrong(
    spec: list[str], env: dict[str, str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(UsageError, match=message):
        peer_source(spec, OWN)


def test_record_with_an_unusable_source_exits_2_before_loading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    assert main(["record", "--dump-dir", str(tmp_path), "--peers-from", "slurm"]) == 2
    err = capsys.readouterr().err.strip()
    assert "SLURM_JOB_NODELIST is not set" in err and len(err.splitlines()) == 1


# ---------------------------------------------------------------- a headless Service


class FakeDns:
    """What DNS answers for the Service now (a list of addresses, or an error)."""

    def __init__(self) -> None:
        self.answer: list[str] | OSError = []
        self.asked: list[str] = []

    def __call__(self, name: str) -> list[str]:
        self.asked.append(name)
        if isinstance(self.answer, OSError):
            raise self.answer
        return list(self.answer)


def test_service_peers_follow_the_dns_answer() -> None:
    dns = FakeDns()
    source = peer_source(["k8s-service", "stallwatch-peers.stallwatch.svc"], OWN, dns)
    assert isinstance(source, ServicePeers)
    dns.answer = ["10.0.0.1", "10.0.0.2", "fd00::7"]
    assert source.peers() == ("10.0.0.1:9400", "[fd00::7]:9400")  # never itself
    dns.answer = ["10.0.0.1", "10.0.0.4"]  # a node left, another came
    assert source.peers() == ("10.0.0.1:9400", "10.0.0.4:9400")
    dns.answer = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    assert source.peers() == ("10.0.0.1:9400", "10.0.0.4:9400")  # the last answer kept
    assert dns.asked == ["stallwatch-peers.stallwatch.svc"] * 3


def test_service_port_can_be_given() -> None:
    dns = FakeDns()
    dns.answer = ["10.0.0.2", "10.0.0.3"]
    # on port 9500 the agent at 10.0.0.2 is another one than this (which listens on 9400)
    assert peer_source(["k8s-service", "svc:9500"], OWN, dns).peers() == (
        "10.0.0.2:9500",
        "10.0.0.3:9500",
    )


def test_real_resolver_answers_for_localhost() -> None:
    """The seam's production side: getaddrinfo, one address each, sorted."""
    source = peer_source(["k8s-service", "localhost"], Own(frozenset(), 9400))
    assert "127.0.0.1:9400" in source.peers()


# ---------------------------------------------------------------- a file


def touch_later(path: Path, text: str) -> None:
    """Rewrite with a modification time that surely differs from the last."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(text)
    os.utime(path, ns=(before + 10**9, before + 10**9))


def test_file_peers_are_read_again_when_the_file_changes(tmp_path: Path) -> None:
    path = tmp_path / "peers"
    path.write_text("# the job's nodes\ngpu1\ngpu2\n10.0.0.9:9500, gpu3  # spare\n")
    source = peer_source(["file", str(path)], OWN)
    assert isinstance(source, FilePeers)
    assert source.peers() == ("gpu1:9400", "10.0.0.9:9500", "gpu3:9400")
    touch_later(path, "gpu4\ngpu5\ngpu6\n[fd00::1]:9400\n")
    assert source.peers() == ("gpu4:9400", "gpu5:9400", "gpu6:9400", "[fd00::1]:9400")
    touch_later(path, "gpu4\ngpu5:notaport\n")  # half-written by hand: the last list stays
    assert source.peers() == ("gpu4:9400", "gpu5:9400", "gpu6:9400", "[fd00::1]:9400")
    touch_later(path, "gpu7\n")
    assert source.peers() == ("gpu7:9400",)
    replacement = tmp_path / "peers.new"  # replaced by rename, as config tools do
    replacement.write_text("gpu8\n")
    replacement.rename(path)
    assert source.peers() == ("gpu8:9400",)
    path.unlink()
    assert source.peers() == ("gpu8:9400",)


def test_file_peers_are_not_read_while_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "peers"
    path.write_text("gpu1\n")
    source = FilePeers(path, 9400, OWN)
    assert source.peers() == ("gpu1:9400",)
    stamp = source.stamp
    assert source.peers() == ("gpu1:9400",) and source.stamp is stamp


def test_peer_list_joins_peers_and_a_source_once_each(tmp_path: Path) -> None:
    path = tmp_path / "peers"
    path.write_text("gpu1\ngpu3\n")
    both = PeerList(("gpu3:9400", "gpu9:9400"), FilePeers(path, 9400, OWN))
    assert both() == ("gpu3:9400", "gpu9:9400", "gpu1:9400")
    assert not PeerList() and PeerList(source=FilePeers(path, 9400, OWN))


# ---------------------------------------------------------------- incidents go to today's peers


class _Dumps(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append(body["incident_id"])  # type: ignore[attr-defined]
        answer = json.dumps({"incident_id": body["incident_id"], "status": "written"}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def two_peers() -> Iterator[list[ThreadingHTTPServer]]:
    servers = []
    for _ in range(2):
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Dumps)
        server.seen = []  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    yield servers
    for server in servers:
        server.shutdown()
        server.server_close()


def trigger(incident: str) -> Trigger:
    return Trigger(TriggerKind.IN_FLIGHT, "stuck", incident, 7_000_000_000)


def test_each_incident_goes_to_the_peers_the_file_names_then(
    tmp_path: Path, two_peers: list[ThreadingHTTPServer]
) -> None:
    first, second = (f"127.0.0.1:{s.server_address[1]}" for s in two_peers)
    path = tmp_path / "peers"
    path.write_text(first + "\n")
    notify = peer_notifier(PeerList((), FilePeers(path, 9400, OWN)), "gpu2", None, 2.0)
    thread = notify(trigger("inc-1"))
    assert isinstance(thread, threading.Thread)
    thread.join(3)
    touch_later(path, second + "\n")
    thread = notify(trigger("inc-2"))
    assert isinstance(thread, threading.Thread)
    thread.join(3)
    assert [s.seen for s in two_peers] == [["inc-1"], ["inc-2"]]  # type: ignore[attr-defined]

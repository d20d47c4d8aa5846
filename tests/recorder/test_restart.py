"""An agent restarted during a stall: its watchdog takes up the state the
last one left with the pinned recording, and its peers' answers bring its
dump under the incident id they already used.  Real HTTP between the nodes,
real dump files; the kernel side is in test_pinning.py and the lab's chaos
tests."""

from __future__ import annotations

import time
from pathlib import Path

from stallwatch.dumpers.format import read_dump
from stallwatch.dumpers.model import TriggerKind
from stallwatch.recorder import peers as peers_mod
from stallwatch.recorder.tickstate import TickState
from stallwatch.recorder.watchdog import DumpScheduler, Incidents, Watchdog
from tests.dump_samples import sample_recording
from tests.recorder.test_watchdog import TIMEOUT, S, call, comm, proc


class Node:
    """One agent's incidents, served over HTTP; ``restart`` makes a new one."""

    def __init__(self, host: str, folder: Path) -> None:
        self.host = host
        self.folder = folder
        self.incidents = self._incidents()
        self.saved: dict[str, object] = {}

    def _incidents(self) -> Incidents:
        wd = Watchdog(TIMEOUT, self.host)
        wd.on_change = lambda: self.saved.update(wd.state())
        sched = DumpScheduler.for_directory(
            self.folder, lambda: sample_recording(200, host=self.host)
        )
        return Incidents(wd, sched)

    def restart(self, keep_state: bool) -> None:
        """A new agent process: nothing of the old one but what was saved."""
        self.incidents = self._incidents()
        if keep_state:
            self.incidents.watchdog.restore(dict(self.saved))

    def recording(self):  # type: ignore[no-untyped-def]
        return sample_recording(10, host=self.host)

    def metrics_text(self) -> str:
        return ""

    def request_dump(
        self, reason: str, incident_id: str | None, origin: str | None, *, kind: str | None = None
    ) -> object:
        said = TriggerKind(kind) if kind else None  # what the peer's incident is
        answer = self.incidents.request_dump(reason, incident_id, origin, origin_kind=said)
        return {"host": self.host, **answer}

    def dumps(self) -> list[str]:
        """The incident id of every dump in the folder."""
        return sorted(read_dump(p).trigger.incident_id for p in self.folder.glob("*.msgpack"))  # type: ignore[union-attr]


def stuck(ago_s: float) -> TickState:
    now = time.monotonic_ns()
    started = now - int(ago_s * S)
    return TickState(now, (call(1, started),), (comm(1, started),), (proc(1),))


def wire(nodes: list[Node], addresses: list[str]) -> None:
    for node, address in zip(nodes, addresses, strict=True):
        others = [a for a in addresses if a != address]
        node.incidents.notify = peers_mod.peer_notifier(
            others, node.host, None, 2.0, answered=node.incidents.peer_answered
        )


def wait_for(check, timeout: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return bool(check())


def test_restarted_after_its_dump_it_does_not_dump_the_stall_again(tmp_path: Path) -> None:
    node = Node("node-0", tmp_path)
    [trigger] = node.incidents.watchdog.check(stuck(3))
    node.incidents.scheduler.submit(trigger)
    assert node.dumps() == [trigger.incident_id]
    node.restart(keep_state=True)
    assert node.incidents.tick(stuck(4)) == []  # the same stall: still in its cool-down
    assert node.dumps() == [trigger.incident_id]
    assert node.incidents.watchdog.stats.suppressed == 1
    # a peer asking for that incident again is answered "duplicate"
    answer = node.incidents.request_dump("peer", trigger.incident_id, "node-1")
    assert answer["status"] == "duplicate"
    # the check above can fail: without the saved state the stall is dumped again
    node.restart(keep_state=False)
    assert len(node.incidents.tick(stuck(5))) == 1
    assert len(node.dumps()) == 2


def test_restarted_before_its_dump_it_takes_the_peers_incident_id(tmp_path: Path) -> None:
    """Node 0's agent is down while node 1 dumps incident A (the request to
    node 0 fails); back, node 0 finds the stall itself and raises B: node 1
    answers "duplicate, A", and node 0's dump is relabelled A."""
    from stallwatch.query.http import serve_http

    (tmp_path / "n0").mkdir()
    (tmp_path / "n1").mkdir()
    nodes = [Node("node-0", tmp_path / "n0"), Node("node-1", tmp_path / "n1")]
    servers = [serve_http(n, "127.0.0.1:0", token=None) for n in nodes]
    try:
        addresses = [s.address for s in servers]
        down = "127.0.0.1:9"  # node 0 while its agent is away: nothing listens
        wire(nodes, [down, addresses[1]])
        nodes[1].incidents.tick(stuck(3))
        assert wait_for(lambda: len(nodes[1].dumps()) == 1)
        [first] = nodes[1].dumps()
        assert nodes[0].dumps() == []
        nodes[0].restart(keep_state=True)  # nothing was saved: it never knew
        wire(nodes, addresses)
        nodes[0].incidents.tick(stuck(5))
        assert wait_for(lambda: nodes[0].dumps() == [first]), nodes[0].dumps()
        assert nodes[1].dumps() == [first]
        assert nodes[0].incidents.watchdog.stats.merged == 1
    finally:
        for server in servers:
            server.close()


def test_a_duplicate_with_a_later_id_changes_nothing(tmp_path: Path) -> None:
    node = Node("node-0", tmp_path)
    [trigger] = node.incidents.watchdog.check(stuck(3))
    node.incidents.scheduler.submit(trigger)
    later = trigger.incident_id.replace("-node-0-", "-node-9-").replace("T", "U", 1)
    node.incidents.peer_answered(trigger, "duplicate", later)
    node.incidents.peer_answered(trigger, "written", "00000000T000000000-x-000000")
    assert node.dumps() == [trigger.incident_id]


def test_an_older_incident_in_a_peers_cool_down_is_not_taken(tmp_path: Path) -> None:
    """The peer refuses (cool-down) and names an incident raised before this
    stall began: another stall, whose id this dump must not take."""
    from stallwatch.recorder.watchdog import new_incident_id

    node = Node("node-0", tmp_path)
    [trigger] = node.incidents.watchdog.check(stuck(3))
    node.incidents.scheduler.submit(trigger)
    long_ago = new_incident_id("node-1", time.time_ns() - 60 * S)
    node.incidents.peer_answered(trigger, "cooldown", long_ago)
    assert node.dumps() == [trigger.incident_id]
    just_now = new_incident_id("node-1", time.time_ns() - 1 * S)  # after the stall began
    assert just_now < trigger.incident_id
    node.incidents.peer_answered(trigger, "cooldown", just_now)
    assert node.dumps() == [just_now]


def test_incident_ids_tell_when_they_were_raised() -> None:
    from stallwatch.recorder.watchdog import incident_wall_ns, new_incident_id

    wall = 1_790_000_000_123_456_789
    assert incident_wall_ns(new_incident_id("h", wall)) == wall - wall % 1_000_000
    assert incident_wall_ns("lab-abc-end") is None

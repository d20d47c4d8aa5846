"""The published verdict (recorder.verdicts) behind its judge seam, and the
--notify webhook (recorder.webhook) posting to a real local receiver."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from stallwatch.dumpers.model import Trigger, TriggerKind
from stallwatch.recorder import verdicts as vd
from stallwatch.recorder import webhook as wh
from stallwatch.recorder.prometheus import AgentStats, agent_metrics_text
from stallwatch.recorder.verdicts import Dumped, Judgement, VerdictPublisher
from stallwatch.recorder.webhook import Notice, Webhook, alert_payload

INCIDENT = "20261207T120000000-node1-00002a"
AGENTS = ("10.0.0.1:9400", "10.0.0.2:9400")


def analyze_doc(kind: str, ranks: list[int], hosts: list[str], read: Sequence[str]) -> dict:
    """An analyze --json document as the child prints it (the parts read)."""
    return {
        "format": 2,
        "incidents": [
            {
                "id": INCIDENT,
                "verdicts": [
                    {"kind": kind, "ranks": ranks, "hosts": hosts, "summary": f"{kind} here"}
                ],
            }
        ],
        "inputs": [{"path": f"{a}/node.msgpack", "ok": True, "error": None} for a in read]
        + [{"path": a, "ok": False, "error": "no answer"} for a in AGENTS if a not in read],
    }


class FakeJudge:
    def __init__(self, answers: list[Judgement]) -> None:
        self.answers = answers
        self.asked: list[tuple[str, tuple[str, ...], float]] = []

    def __call__(self, incident: str, agents: Sequence[str], timeout: float) -> Judgement:
        self.asked.append((incident, tuple(agents), timeout))
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def publish(tmp_path: Path, judge: FakeJudge, **kw: object) -> VerdictPublisher:
    pub = VerdictPublisher(
        judge, lambda: AGENTS, tmp_path, "node1", regather_s=(0.01, 0.02, 0.03), **kw
    )
    trigger = Trigger(TriggerKind.IN_FLIGHT, "stuck", INCIDENT, time.monotonic_ns(), 7, 1, "node1")
    pub.dumped(Dumped(trigger, 0.05, None))
    for t in pub.threads:
        t.join(10)
    return pub


def test_a_first_verdict_missing_a_dump_is_revised_when_the_dumps_contradict_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("WARNING", "stallwatch.verdict")
    first = analyze_doc("inconclusive", [], [], read=AGENTS[:1])
    then = analyze_doc("missing_rank", [3], ["node2"], read=AGENTS)
    judge = FakeJudge([Judgement(first), Judgement(then)])
    pub = publish(tmp_path, judge)
    # the first was asked with the short wait (twice the dump's 50 ms, 1 s at least)
    assert judge.asked[0][2] == vd.MIN_WAIT_S and judge.asked[1][2] == vd.REGATHER_TIMEOUT_S
    assert len(judge.asked) == 2  # complete at the second: no more
    doc = json.loads((tmp_path / f"{INCIDENT}.verdict.json").read_text())
    assert doc["publication"]["revision"] == 2
    assert doc["publication"]["agents_missing"] == []
    assert doc["incidents"][0]["verdicts"][0]["kind"] == "missing_rank"
    lines = [r.getMessage() for r in caplog.records if "verdict:" in r.getMessage()]
    assert len(lines) == 2 and "revision 1" in lines[0] and "dumps of 1 of 2 nodes" in lines[0]
    assert "missing_rank: rank 3 on node2" in lines[1] and "revision 2" in lines[1]
    [shown] = pub.latest()
    text = agent_metrics_text(AgentStats((), 0, 0, 0, 0, 0, incidents=pub.latest()), {})
    assert (
        f'stallwatch_incident_info{{hosts="node2",incident="{INCIDENT}",kind="missing_rank",'
        f'ranks="3",revision="2"}} 1.0' in text
    )
    assert f'stallwatch_incident_timestamp_seconds{{incident="{INCIDENT}"}}' in text
    assert shown.detected_wall_ns / 1e9 == pytest.approx(time.time(), abs=30)


def test_the_same_verdict_from_the_complete_dumps_is_no_revision(tmp_path: Path) -> None:
    same = analyze_doc("missing_rank", [3], ["node2"], read=AGENTS[:1])
    judge = FakeJudge(
        [Judgement(same), Judgement(analyze_doc("missing_rank", [3], ["node2"], AGENTS))]
    )
    pub = publish(tmp_path, judge)
    assert pub.published == 1 and pub.latest()[0].revision == 1 and pub.latest()[0].complete


def test_a_complete_first_verdict_is_gathered_once(tmp_path: Path) -> None:
    judge = FakeJudge([Judgement(analyze_doc("rank_exited", [1], ["node1"], AGENTS))])
    pub = publish(tmp_path, judge)
    assert len(judge.asked) == 1 and pub.published == 1


def test_an_incident_relabelled_to_a_peers_id_is_the_peers_to_publish(tmp_path: Path) -> None:
    judge = FakeJudge([Judgement(analyze_doc("missing_rank", [3], ["node2"], AGENTS))])
    pub = publish(tmp_path, judge, relabelled=lambda incident: incident == INCIDENT)
    assert not judge.asked and pub.published == 0
    assert not list(tmp_path.iterdir())


def test_a_judge_that_fails_is_counted_and_asked_again(tmp_path: Path) -> None:
    judge = FakeJudge([Judgement(None, "exit code 2: nothing could be read")])
    pub = publish(tmp_path, judge)
    assert pub.failures == 4 and pub.published == 0 and not pub.latest()


def test_a_request_or_a_peers_incident_publishes_nothing(tmp_path: Path) -> None:
    judge = FakeJudge([Judgement(analyze_doc("missing_rank", [3], ["node2"], AGENTS))])
    pub = VerdictPublisher(judge, lambda: AGENTS, tmp_path, "node1")
    for kind in (TriggerKind.MANUAL, TriggerKind.PEER, TriggerKind.SHUTDOWN):
        pub.dumped(Dumped(Trigger(kind, "asked", INCIDENT, 0), 0.1, None))
    assert not pub.threads and not judge.asked


ECHO = "import json, sys; r = json.loads(sys.stdin.readline()); print(json.dumps({'got': r}))"


def test_the_child_judge_is_started_early_and_given_its_request_on_stdin() -> None:
    import sys

    started: list[tuple[str, tuple[str, ...]]] = []

    def argv(incident: str, agents: Sequence[str]) -> list[str]:
        started.append((incident, tuple(agents)))
        return [sys.executable, "-c", ECHO]

    judge = vd.ChildJudge(argv, "secret")
    judge.warm(INCIDENT, AGENTS)
    got = judge(INCIDENT, AGENTS[:1], 1.5)  # fewer agents than it was started with
    assert got == Judgement(
        {"got": {"timeout": 1.5, "token": "secret", "agents": list(AGENTS[:1])}}, None
    )
    assert started == [(INCIDENT, AGENTS)]  # the warm child answered: no second one
    judge(INCIDENT, AGENTS, 1.0)  # not warmed (any more): a child of its own
    assert started[-1] == (INCIDENT, AGENTS)


def test_the_child_judge_names_a_childs_failure() -> None:
    import sys

    def judge_of(code: str) -> Judgement:
        return vd.ChildJudge(lambda i, a: [sys.executable, "-c", code])(INCIDENT, AGENTS, 1.0)

    assert judge_of("import sys; sys.stdin.readline(); print('{}'); sys.exit(1)").document == {}
    two = judge_of("import sys; sys.stderr.write('nothing could be read\\n'); sys.exit(2)")
    assert two.document is None and two.error == "exit code 2: nothing could be read"
    assert (judge_of("print('not json')").error or "").startswith("the answer is not JSON")


# ---- the webhook, to a real local receiver ------------------------------------------


class Receiver:
    """A local HTTP server that answers with the statuses given, in turn,
    and keeps every body it was posted."""

    def __init__(self, statuses: list[int]) -> None:
        self.statuses, self.bodies = statuses, []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.bodies.append((self.path, self.headers["Content-Type"], body))
                status = outer.statuses.pop(0) if len(outer.statuses) > 1 else outer.statuses[0]
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/stallwatch"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver([200])
    yield r
    r.close()


NOTICE = Notice(
    INCIDENT, 2, "missing_rank", ("node2",), (3,), "rank 3 never entered ALL_REDUCE seq 57",
    1_796_644_800_000_000_000, "node1", f"/var/lib/stallwatch/dumps/{INCIDENT}.verdict.json",
)  # fmt: skip


def wait_until(check, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_webhook_posts_what_alertmanager_receivers_and_chats_read(receiver: Receiver) -> None:
    hook = Webhook(receiver.url)
    hook.send(NOTICE)
    wait_until(lambda: hook.stats.sent == 1)
    [(path, ctype, body)] = receiver.bodies
    assert path == "/hooks/stallwatch" and ctype == "application/json"
    doc = json.loads(body)
    # Alertmanager's webhook document (version 4)
    assert doc["version"] == "4" and doc["status"] == "firing"
    assert doc["groupLabels"] == {"incident": INCIDENT}
    [alert] = doc["alerts"]
    assert alert["status"] == "firing" and alert["startsAt"] == "2026-12-07T12:00:00.000Z"
    assert alert["labels"] == {
        "alertname": "StallwatchIncident",
        "severity": "critical",
        "incident": INCIDENT,
        "kind": "missing_rank",
        "hosts": "node2",
        "ranks": "3",
        "revision": "2",
        "detected_by": "node1",
    }
    assert alert["annotations"]["summary"] == "rank 3 never entered ALL_REDUCE seq 57"
    assert doc["commonLabels"] == alert["labels"]
    # a chat webhook's line
    assert doc["text"] == (
        f"stallwatch incident {INCIDENT}, revision 2: missing_rank: rank 3 on node2: "
        "rank 3 never entered ALL_REDUCE seq 57"
    )
    hook.close()


def test_the_webhook_retries_a_receiver_that_fails_and_gives_up_one_that_refuses() -> None:
    flaky = Receiver([500, 502, 200])
    waits: list[float] = []
    hook = Webhook(flaky.url, sleep=waits.append)
    hook.send(NOTICE)
    wait_until(lambda: hook.stats.sent == 1)
    assert len(flaky.bodies) == 3 and waits == [1.0, 2.0] and hook.stats.failures == 2
    refusing = Receiver([400])
    hook2 = Webhook(refusing.url, sleep=waits.append)
    hook2.send(NOTICE)
    wait_until(lambda: hook2.stats.dropped == 1)
    assert len(refusing.bodies) == 1 and hook2.stats.sent == 0
    for r in (flaky, refusing):
        r.close()


def test_the_webhook_gives_up_after_the_cooldown_and_holds_a_bounded_queue() -> None:
    now = [0.0]
    stalled = threading.Event()

    def post(url: str, body: bytes, timeout: float):  # type: ignore[no-untyped-def]
        stalled.wait(10)
        from stallwatch.dumpers.errors import AgentError

        raise AgentError("cannot reach the agent: Connection refused")

    def sleep(s: float) -> None:
        now[0] += s

    hook = Webhook("http://127.0.0.1:9/x", post=post, clock=lambda: now[0], sleep=sleep)
    for _ in range(wh.QUEUE_MAX + 3):
        hook.send(NOTICE)
    assert hook.stats.dropped >= 2  # the oldest beyond the bound (the first is being sent)
    stalled.set()
    wait_until(hook.idle)
    assert hook.stats.sent == 0
    assert now[0] <= wh.GIVE_UP_S * (wh.QUEUE_MAX + 3)  # each given up by its deadline
    assert hook.stats.dropped == wh.QUEUE_MAX + 3


def test_the_payload_says_unknown_ranks_as_such() -> None:
    from dataclasses import replace

    doc = alert_payload(replace(NOTICE, ranks=(None, 5), hosts=("node1", "node3"), revision=1))
    assert doc["commonLabels"]["ranks"] == "unknown,5"  # type: ignore[index]
    assert ", revision" not in str(doc["text"])


def test_the_first_verdict_asks_only_the_peers_that_dumped_and_the_revision_asks_all(
    tmp_path: Path,
) -> None:
    cut_off = analyze_doc("network_partition", [2, 3], ["node2"], read=AGENTS[:1])
    judge = FakeJudge([Judgement(cut_off)])
    said = {AGENTS[1]: "error: no answer within 3 s"}
    pub = publish(tmp_path, judge, answers=lambda incident: said)
    assert judge.asked[0][1] == AGENTS[:1]  # not the peer that did not answer
    assert all(asked == AGENTS for _, asked, _ in judge.asked[1:])
    assert len(judge.asked) == 1 + 3  # still missing: asked at every regathering
    assert pub.latest()[0].missing == AGENTS[1:] and pub.published == 1


def _first_ask_after(tmp_path: Path, silent: frozenset[str], dump_s: float) -> float:
    """Seconds from the dump to the first gathering, the peers' round still
    waiting on a peer that never answers (a cut-off node's request)."""
    judge = FakeJudge([Judgement(analyze_doc("network_partition", [0], ["node1"], AGENTS[:1]))])
    asked_at: list[float] = []
    judged = judge.__call__

    def timed(incident: str, agents: Sequence[str], timeout: float) -> Judgement:
        asked_at.append(time.monotonic())
        return judged(incident, agents, timeout)

    pub = VerdictPublisher(timed, lambda: AGENTS, tmp_path, "node1", regather_s=(),
                           unreached=lambda incident: silent)  # fmt: skip
    stop = threading.Event()
    round_ = threading.Thread(target=stop.wait, args=(30,), daemon=True)
    round_.start()
    trigger = Trigger(TriggerKind.IN_FLIGHT, "stuck", INCIDENT, time.monotonic_ns(), 7, 1, "node1")
    began = time.monotonic()
    pub.dumped(Dumped(trigger, dump_s, round_))
    for t in pub.threads:
        t.join(30)
    stop.set()
    return asked_at[0] - began


def test_a_peer_no_probe_reached_is_not_waited_for(tmp_path: Path) -> None:
    """Node 1's probes of the incident reached nothing of 10.0.0.2: its
    verdict is gathered at once, not after the wait for the peers' dumps
    (twice its own dump's time: 4 s here); a peer the probes reached, or
    another host silent, is waited for."""
    assert vd.host_of("10.0.0.2:9400") == "10.0.0.2" and vd.host_of("[fd00::2]:9400") == "fd00::2"
    assert vd.host_of("https://node2:9400/") == "node2"
    assert _first_ask_after(tmp_path, frozenset({"10.0.0.2"}), 2.0) < 3.0  # not the 4 s
    assert _first_ask_after(tmp_path, frozenset({"10.0.0.3"}), 1.0) >= 1.9


def test_a_host_of_several_culprits_is_said_once(tmp_path: Path) -> None:
    """``hosts`` of analyze --json is per culprit: two ranks of one cut host
    are one host in the line, the metric and the notice."""
    cut = analyze_doc("network_partition", [2, 3], ["node1", "node1"], read=AGENTS)
    pub = publish(tmp_path, FakeJudge([Judgement(cut)]))
    (shown,) = pub.latest()
    assert shown.hosts == ("node1",) and shown.ranks == (2, 3)
    assert vd.verdict_line(shown).startswith("network_partition: ranks 2, 3 on node1: ")

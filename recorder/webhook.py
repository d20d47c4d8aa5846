"""``--notify URL``: each published verdict posted as JSON that both
Alertmanager-style receivers and chat webhooks accept.

The body is Alertmanager's webhook document (``version`` 4: ``status``,
``groupLabels``, ``commonLabels``, ``commonAnnotations``, ``alerts`` with
``labels``, ``annotations``, ``startsAt``), so whatever reads Alertmanager's
notifications (a pager bridge, an incident tool) reads ours, plus ``text``,
the one line a chat webhook (Slack, Mattermost, Rocket.Chat) shows.  The
labels name the incident, the verdict's kind, hosts and ranks, and the
revision: a revised verdict is posted again.

Retried, bounded, never in the way of recording: posts go out from one
thread of their own, from a queue of at most ``QUEUE_MAX`` (the oldest is
dropped, and counted), each retried with backoff until ``GIVE_UP_S``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from stallwatch.dumpers.errors import AgentError
from stallwatch.query.agentclient import Reply, post_url

log = logging.getLogger("stallwatch.notify")

# One post waits this long for an answer: a webhook answers at once, and
# the sender's thread must not hold a verdict behind one that hangs.
POST_TIMEOUT_S = 10.0
# Retried for as long as the verdict is news: until the watchdog's cool-down
# (recorder.watchdog.MIN_COOLDOWN_NS, 5 min) has passed, after which a new
# incident may be raised and this one's notice is stale; first after 1 s,
# doubling (1, 2, 4, ... s: nine tries over 5 min).
GIVE_UP_S = 300.0
FIRST_RETRY_S = 1.0
# Notices waiting: an incident is raised at most once a cool-down, with its
# revisions (recorder.verdicts.REGATHERS, 4, and the first): 16 hold three
# incidents' worth of a receiver that refuses everything.
QUEUE_MAX = 16


def _iso(wall_ns: int) -> str:
    secs, ns = divmod(wall_ns, 1_000_000_000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(secs)) + f".{ns // 1_000_000:03d}Z"


@dataclass(frozen=True, slots=True)
class Notice:
    """What a verdict's notification says."""

    incident_id: str
    revision: int
    kind: str
    hosts: tuple[str, ...]
    ranks: tuple[int | None, ...]
    summary: str
    detected_wall_ns: int
    agent_host: str  # the agent that detected and published it
    verdict_path: str  # where its verdict.json is, on that agent's node

    def text(self) -> str:
        """The one line for people (the log's and the chat's)."""
        ranks = ", ".join("unknown" if r is None else str(r) for r in self.ranks) or "none"
        hosts = ", ".join(self.hosts) or "none"
        rev = f", revision {self.revision}" if self.revision > 1 else ""
        word = "rank" if len(self.ranks) == 1 else "ranks"
        return (
            f"stallwatch incident {self.incident_id}{rev}: {self.kind}: {word} {ranks} "
            f"on {hosts}: {self.summary}"
        )


def alert_payload(n: Notice) -> dict[str, object]:
    """The webhook body: Alertmanager's webhook document, and ``text``."""
    labels = {
        "alertname": "StallwatchIncident",
        "severity": "critical",
        "incident": n.incident_id,
        "kind": n.kind,
        "hosts": ",".join(n.hosts),
        "ranks": ",".join("unknown" if r is None else str(r) for r in n.ranks),
        "revision": str(n.revision),
        "detected_by": n.agent_host,
    }
    annotations = {
        "summary": n.summary,
        "description": f"{n.text()} (verdict: {n.agent_host}:{n.verdict_path})",
    }
    alert = {
        "status": "firing",
        "labels": labels,
        "annotations": annotations,
        "startsAt": _iso(n.detected_wall_ns),
        "endsAt": "0001-01-01T00:00:00Z",
        "generatorURL": "",
        "fingerprint": hashlib.sha256(n.incident_id.encode()).hexdigest()[:16],
    }
    return {
        "version": "4",
        "groupKey": f'{{}}:{{incident="{n.incident_id}"}}',
        "truncatedAlerts": 0,
        "status": "firing",
        "receiver": "stallwatch",
        "groupLabels": {"incident": n.incident_id},
        "commonLabels": labels,
        "commonAnnotations": annotations,
        "externalURL": "",
        "alerts": [alert],
        "text": n.text(),
    }


@dataclass
class WebhookStats:
    sent: int = 0  # notices the receiver took (2xx)
    failures: int = 0  # attempts that failed (each retried while it may be)
    dropped: int = 0  # notices given up: refused for good, too old, or displaced


Post = Callable[[str, bytes, float], Reply]


class Webhook:
    """Posts notices to ``url`` from a thread of its own."""

    def __init__(
        self,
        url: str,
        post: Post = post_url,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], object] | None = None,
    ) -> None:
        self.url, self.post, self.clock = url, post, clock
        self.stats = WebhookStats()
        self._queue: deque[tuple[Notice, float]] = deque()
        self._wake = threading.Condition()
        self._sleep = sleep
        self._stop = False
        self._sending = False  # a notice is out of the queue, being delivered
        self._thread = threading.Thread(target=self._run, name="notify", daemon=True)
        self._thread.start()

    def send(self, notice: Notice) -> None:
        """Queue a notice; never waits."""
        with self._wake:
            if len(self._queue) >= QUEUE_MAX:
                old, _ = self._queue.popleft()
                self.stats.dropped += 1
                log.error("notify: incident %s's notice dropped: too many waiting", old.incident_id)
            self._queue.append((notice, self.clock()))
            self._wake.notify()

    def close(self, wait_s: float = 0.0) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(wait_s)

    def idle(self) -> bool:
        with self._wake:
            return not self._queue and not self._sending

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._stop:
                    self._wake.wait()
                if self._stop:
                    return
                notice, queued = self._queue.popleft()
                self._sending = True
            self._deliver(notice, queued)
            with self._wake:
                self._sending = False

    def _deliver(self, notice: Notice, queued: float) -> None:
        body = json.dumps(alert_payload(notice)).encode()
        wait = FIRST_RETRY_S
        while True:
            why = self._attempt(body)
            if why is None:
                self.stats.sent += 1
                log.info("notify: incident %s posted to %s", notice.incident_id, self.url)
                return
            self.stats.failures += 1
            late = self.clock() + wait - queued > GIVE_UP_S
            if why.startswith("refused") or late:
                self.stats.dropped += 1
                log.error("notify: incident %s not posted: %s", notice.incident_id, why)
                return
            log.warning("notify: incident %s: %s; again in %g s", notice.incident_id, why, wait)
            if self._pause(wait):
                return
            wait *= 2

    def _attempt(self, body: bytes) -> str | None:
        """None if taken; else why not (``refused ...`` if asking again is useless)."""
        try:
            reply = self.post(self.url, body, POST_TIMEOUT_S)
        except AgentError as exc:
            return str(exc)
        if 200 <= reply.status < 300:
            return None
        if reply.status in (408, 425, 429) or reply.status >= 500:
            return f"HTTP {reply.status} {reply.reason}"
        return f"refused: HTTP {reply.status} {reply.reason}"

    def _pause(self, seconds: float) -> bool:
        """Wait before a retry; True if the sender is stopping."""
        if self._sleep is not None:
            self._sleep(seconds)
            return self._stop
        with self._wake:
            self._wake.wait_for(lambda: self._stop, seconds)
            return self._stop

"""Agent faults while the job runs: what a node's recorder goes through.

- ``agentkill``: the agent is killed (SIGKILL unless said otherwise) once a
  rank reaches the step, ``after`` seconds later; its supervisor restarts it
  (``Restart=on-failure``), and the new agent takes over the pinned recording.
- ``agentoom``: the agent's cgroup bound is lowered to what it uses now plus
  a little, and a query makes it allocate: the kernel kills it for its
  memory bound; the supervisor restores the unit's bound and restarts it.
- ``agentlate``: the node's agent is started only once a rank reaches the
  step: it attaches while the job runs (communicators already made).
- ``agentgone``: the agent is SIGKILLed and not restarted; the kernel goes on
  recording into its pins, and the runner dumps the node with ``stallwatch
  dump --pinned`` once the job is stuck, as an operator would.

``Chaos.poll`` runs from the runner's waiting loops; ``settled`` says when
every fault was applied and every agent it touched has been back for long
enough to have detected a stall on its own (stall timeout plus a margin):
only then are a hung job's dumps final.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from stallwatch.dumpers.errors import AgentError, LabError
from stallwatch.lab import faults as F
from stallwatch.lab.faultlog import Episode, FaultRecord, Moment
from stallwatch.lab.supervise import Supervisor
from stallwatch.query.agentclient import AgentClient

OOM_MARGIN = 1 << 20  # the bound: what the agent uses now plus this
SETTLE_MARGIN_S = 3.0  # past the stall timeout, for a restarted agent's first ticks
# About 500 MB of anonymous memory in one list: more than the agent's page
# cache, which the kernel would reclaim for a smaller query instead of
# killing it (the file pages charged to its cgroup, such as the compiler's,
# vary from run to run); under the agent's own 1 GB query limit.
OOM_QUERY = "SELECT length(list(i)) AS n FROM range(30000000) t(i)"
_HOW: dict[type, str] = {
    F.AgentKill: "the node's agent killed, restarted by its supervisor",
    F.AgentOom: "the node's agent killed by its cgroup memory bound, restarted",
    F.AgentLate: "the node's agent started only then",
    F.AgentGone: "the node's agent killed for good; the node dumped with dump --pinned",
}


@dataclass
class _Pending:
    fault: F.AgentFault
    due: float | None = None  # monotonic, once its step is reached
    done: bool = False
    applied: float = 0.0  # monotonic
    fired: Episode | None = None  # when, and at which step (lab run --json)


@dataclass
class Chaos:
    """The agent faults of one run and what became of them."""

    faults: Sequence[F.AgentFault]
    agents: dict[int, Supervisor]
    start_agent: Callable[[int], None]
    reached: Callable[[], int]  # the highest step a rank has reached
    query: Callable[[int, bytes], None]  # POST /query to a node's agent (in its namespace)
    stall_timeout_s: float
    log: list[str] = field(default_factory=list)
    _pending: list[_Pending] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._pending = [_Pending(f) for f in self.faults]

    def late_nodes(self) -> set[int]:
        return {f.node for f in self.faults if isinstance(f, F.AgentLate)}

    def gone_nodes(self) -> set[int]:
        return {f.node for f in self.faults if isinstance(f, F.AgentGone)}

    def poll(self) -> None:
        if all(p.done for p in self._pending):
            return
        step = self.reached()
        now = time.monotonic()
        for p in self._pending:
            if p.done:
                continue
            if p.due is None and step >= p.fault.step:
                after = p.fault.after_s if isinstance(p.fault, F.AgentKill) else 0.0
                p.due = now + after
            if p.due is not None and now >= p.due:
                at = Moment.now()
                self._apply(p.fault)
                p.done, p.applied, p.fired = True, time.monotonic(), Episode(step, at)

    def _apply(self, fault: F.AgentFault) -> None:
        node = fault.node
        if isinstance(fault, F.AgentLate):
            self._say(f"node {node}: starting its agent at step {fault.step}")
            self.start_agent(node)
            return
        sup = self.agents.get(node)
        if sup is None:
            raise LabError(f"fault {F.format_fault(fault)!r}: node {node} has no agent to kill")
        if isinstance(fault, F.AgentKill):
            pid = sup.kill(fault.signal)
            self._say(f"node {node}: agent pid {pid} sent {fault.signal.name}")
            return
        if isinstance(fault, F.AgentGone):
            pid = sup.kill(restart=False)
            self._say(f"node {node}: agent pid {pid} killed for good")
            return
        self._oom(node, sup)

    def _oom(self, node: int, sup: Supervisor) -> None:
        if sup.cgroup is None:
            raise LabError(f"node {node}: its agent runs in no cgroup: no memory bound to hit")
        used = sup.cgroup.memory_current()
        sup.cgroup.set_memory_max(used + OOM_MARGIN)
        self._say(f"node {node}: agent pid {sup.pid} bounded to {used + OOM_MARGIN} bytes")
        body = json.dumps({"sql": OOM_QUERY}).encode()
        # the query never answers if the bound kills the agent: off the loop
        threading.Thread(target=self.query, args=(node, body), daemon=True).start()

    def records(self) -> dict[F.AgentFault, FaultRecord]:
        return {
            p.fault: FaultRecord.of(
                F.format_fault(p.fault),
                _HOW[type(p.fault)],
                [p.fired] if p.fired is not None else [],
            )
            for p in self._pending
        }

    def settled(self) -> bool:
        """Every fault applied and its effect seen (a killed agent exited),
        and every agent it touched ready again for a stall timeout and a
        margin."""
        now = time.monotonic()
        for p in self._pending:
            sup = self.agents.get(p.fault.node)
            if not p.done or sup is None:
                return False
            since = p.applied
            if not isinstance(p.fault, F.AgentLate):
                exits = [e.at for e in sup.events if e.kind == "exited" and e.at >= since]
                if not exits:
                    return False
                since = exits[0]
            if isinstance(p.fault, F.AgentGone):
                continue  # it stays gone
            ready = [e.at for e in sup.events if e.kind == "ready" and e.at >= since]
            if not ready or now - ready[0] < self.stall_timeout_s + SETTLE_MARGIN_S:
                return False
        return True

    def _say(self, text: str) -> None:
        self.log.append(text)


def post_query(client: AgentClient, body: bytes) -> None:
    """Best effort: the agent may die answering."""
    with contextlib.suppress(AgentError):
        client.post("/query", body)

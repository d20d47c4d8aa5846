"""The ``gpu`` mode of a lab rank: the CUDA runtime used the way PyTorch's
NCCL process group uses it, on the lab's ``libcudart.so.12``.

- Compute is device work on a compute stream (``labLaunchKernel``); the host
  only enqueues it.
- Each communicator has its own NCCL stream.  Before a collective the NCCL
  stream waits for the compute stream through an event; a start event is
  recorded on the NCCL stream before the call and an end event after it;
  the compute stream then waits for the end event (``work.wait()``).
- A watchdog thread polls the outstanding work with ``cudaEventQuery``: the
  start event until it reports done (the collective started), then the end
  event (it completed).
- Each step ends with one ``cudaStreamSynchronize`` of the compute stream
  (PyTorch's ``loss.item()``), after which the host reads the results.

For every collective the rank logs when its call returned, when the host
first saw it start (the watchdog's query of its start event) and complete
(the watchdog's successful query, or the step's synchronisation that covered
it, whichever came first), and when the first synchronisation after it was
entered: all in CLOCK_MONOTONIC nanoseconds, the clock the recorder stamps
with.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from stallwatch.dumpers.errors import LabError
from stallwatch.lab.cudart import FOREVER, CudaResult, LabCudart

DEFAULT_POLL_MS = 2.0
SEEN_BY_POLL = "poll"
SEEN_BY_SYNC = "sync"


@dataclass(slots=True)
class Work:
    """One collective (or group of p2p calls) queued on an NCCL stream."""

    label: str
    index: int  # the n-th work on this label's stream
    kind: str  # "coll", "p2p", or "graph" (a graph launch: the step's collectives)
    start: int
    end: int
    returned_ns: int = 0
    started_seen_ns: int = 0
    seen_ns: int = 0
    seen_by: str = ""

    def log(self, sync_entered_ns: int) -> dict[str, object]:
        return {
            "label": self.label,
            "index": self.index,
            "kind": self.kind,
            "returned_ns": self.returned_ns,
            "started_seen_ns": self.started_seen_ns,
            "seen_ns": self.seen_ns,
            "seen_by": self.seen_by,
            "sync_entered_ns": sync_entered_ns,
        }


def _order(work: Work) -> int:
    return work.returned_ns


@dataclass(slots=True)
class Device:
    rt: LabCudart
    compute: int
    streams: dict[str, int]
    poll_s: float
    ready: dict[str, int] = field(default_factory=dict)
    pool: list[int] = field(default_factory=list)
    outstanding: deque[Work] = field(default_factory=deque)
    finished: list[Work] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    syncs: list[int] = field(default_factory=list)  # when each synchronisation was entered
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    error: str | None = None

    @classmethod
    def open(cls, path: Path, labels: tuple[str, ...], poll_ms: float) -> Device:
        rt = LabCudart(path)
        if not rt.is_lab:
            raise LabError(f"{path} is not the lab's CUDA runtime (no labLaunchKernel)")
        rt.set_device(0)
        streams = {label: rt.stream_create(non_blocking=True) for label in labels}
        dev = cls(rt, rt.stream_create(non_blocking=True), streams, poll_ms / 1000.0)
        dev.ready = {label: rt.event_create(disable_timing=True) for label in labels}
        dev.thread = threading.Thread(target=dev._watch, name="watchdog", daemon=True)
        dev.thread.start()
        return dev

    def _event(self) -> int:
        with self.lock:
            if self.pool:
                return self.pool.pop()
        return self.rt.event_create(disable_timing=True)

    def compute_for(self, ms: float) -> None:
        self.rt.launch_kernel(self.compute, int(ms * 1e6))

    def stop_device(self) -> None:
        """A kernel that never ends: everything queued after it waits forever."""
        self.rt.launch_kernel(self.compute, FOREVER)

    @contextmanager
    def collective(self, label: str, kind: str = "coll") -> Iterator[int]:
        """Around one NCCL call (or group) on ``label``'s stream, which it yields."""
        stream = self.streams[label]
        self.rt.event_record(self.ready[label], self.compute)
        self.rt.stream_wait_event(stream, self.ready[label])
        start, end = self._event(), self._event()
        self.rt.event_record(start, stream)
        yield stream
        returned = time.monotonic_ns()
        self.rt.event_record(end, stream)
        self.rt.stream_wait_event(self.compute, end)
        index = self.counts.get(label, 0)
        self.counts[label] = index + 1
        with self.lock:
            self.outstanding.append(Work(label, index, kind, start, end, returned))

    def synchronize(self) -> None:
        """The step's one synchronisation: the compute stream, which waited
        for every end event of the step."""
        self.syncs.append(time.monotonic_ns())
        self.rt.stream_synchronize(self.compute)
        now = time.monotonic_ns()
        with self.lock:
            for work in self.outstanding:
                if not work.seen_ns:
                    work.seen_ns, work.seen_by = now, SEEN_BY_SYNC

    def _watch(self) -> None:
        while not self.stop.wait(self.poll_s):
            try:
                self._poll()
            except LabError as exc:  # a failed query: the rank reports it
                self.error = str(exc)
                return

    def _poll(self) -> None:
        with self.lock:
            works = list(self.outstanding)
        blocked: set[str] = set()  # a stream runs in order: nothing after it is done
        for work in works:
            if work.label in blocked:
                continue
            if not work.started_seen_ns:
                if self.rt.event_query(work.start) != CudaResult.SUCCESS:
                    blocked.add(work.label)
                    continue
                work.started_seen_ns = time.monotonic_ns()
            if self.rt.event_query(work.end) != CudaResult.SUCCESS:
                blocked.add(work.label)
                continue
            now = time.monotonic_ns()
            with self.lock:
                if not work.seen_ns:
                    work.seen_ns, work.seen_by = now, SEEN_BY_POLL
                self.outstanding.remove(work)
                self.finished.append(work)
                self.pool += [work.start, work.end]

    def log(self) -> list[dict[str, object]]:
        """Every collective queued so far, in order; ``seen_ns`` 0: not seen
        complete; ``sync_entered_ns``: when the first synchronisation after
        its call was entered (it covered the call), 0 if none was."""
        with self.lock:
            works = sorted([*self.finished, *self.outstanding], key=_order)
        syncs = list(self.syncs)
        out = []
        for w in works:
            i = bisect.bisect_left(syncs, w.returned_ns)
            out.append(w.log(syncs[i] if i < len(syncs) else 0))
        return out

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=5)

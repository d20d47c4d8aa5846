"""A hang of a job whose calls return at once and complete on the device
(the lab's gpu mode: its CUDA runtime, polled by a watchdog thread), with
the agents as deployed: the work its peers queued and the device never
completed is a stall at the communicator's own bound, not at the 60 s
ceiling that only silence reaches (recorder.stallbound)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stallwatch.dumpers.model import TriggerKind
from stallwatch.recorder.stallbound import DEFAULT_CEILING_S, DEFAULT_FLOOR_S

from .test_chaos import analyze, dumps_by_node, lab_run

pytestmark = [pytest.mark.bpf, pytest.mark.lab, pytest.mark.slow]


def test_a_gpu_jobs_hang_is_raised_at_its_bound_from_the_work_queued_on_the_device(
    tmp_path: Path,
) -> None:
    result = lab_run(
        "--nodes", "2", "--ranks-per-node", "2", "--mode", "gpu", "--steps", "60",
        "--fault", "hang:rank=3,step=20", "--record", "--agent-defaults",
        "--dump-dir", str(tmp_path), "--timeout", "200",
    )  # fmt: skip
    [fault] = result["faults"]
    fired = fault["injected_ns"]
    triggers = [d.trigger for ds in dumps_by_node(result).values() for d in ds]
    raised = [t for t in triggers if t is not None and t.kind is TriggerKind.IN_FLIGHT]
    assert raised, triggers
    first = min(raised, key=lambda t: t.time_ns)
    assert "queued on its stream, not completed by the device" in first.reason, first.reason
    # raised at the bound its reason names (the floor, or a rhythm below the
    # ceiling), seconds after the hang: not at the ceiling
    after_s = (first.time_ns - fired) / 1e9
    assert DEFAULT_FLOOR_S <= after_s < DEFAULT_CEILING_S / 2, (after_s, first.reason)
    assert "ceiling 60 s" in first.reason and "set by the ceiling" not in first.reason
    [incident] = analyze(tmp_path)
    verdict = incident["verdicts"][0]
    assert verdict["kind"] == "missing_rank" and verdict["ranks"] == [3], verdict

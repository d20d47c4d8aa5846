"""bench/slowdown_replay.py: what it measures on rows built by hand (a gpu
job whose one device starts late from a step, and one where none does)."""

from __future__ import annotations

from bench.slowdown_replay import replay
from stallwatch.recorder.slowdown import SlowdownConfig
from tests.recorder.test_slowdown import device_job


def test_a_late_device_is_measured_against_its_cycle_and_a_healthy_one_is_not() -> None:
    late = device_job(300, lambda step, pid: 150.0 * (pid == 101 and step >= 150))
    got = {pid: out for (pid, _), out in replay(late, SlowdownConfig()).items()}
    assert got[101]["device"] is True
    # 150 ms on a cycle of about 0.6 s, held for the window
    assert 0.2 < float(got[101]["late"]) < 0.3, got  # type: ignore[arg-type]
    assert got[100]["late"] == 0.0
    assert all(float(out["factor"]) < 1.5 for out in got.values())  # type: ignore[arg-type]
    healthy = replay(device_job(300, seed=1, jitter_ms=30.0), SlowdownConfig())
    assert [out["late"] for out in healthy.values()] == [0.0, 0.0]

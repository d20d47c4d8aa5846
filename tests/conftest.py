"""Suite-wide rules.

Tests marked ``bpf``/``lab``/``realnccl`` need root and a kernel with eBPF;
off CI they are skipped where that is missing.  On CI (``CI=true``) a skipped
test fails the run: a skip must never pass for a test that ran.  A test that
pins a recording under /sys/fs/bpf does it in a folder of ``tests.pins`` and
removes it: a folder of this session left at its end fails the run.  Every
incident the run recorded in which a stall was detected is judged again at
its end (``tests.stalls``): one judged healthy fails the run.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import pins, stalls

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
ON_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
# every analyze --json document of the suite, in this process and the ones
# it starts, is validated against the published schema (analyzer.report)
SCHEMA = ROOT / "docs" / "analyze.schema.json"
os.environ["STALLWATCH_VALIDATE_JSON"] = str(SCHEMA)
_skipped: list[str] = []
_left_pins: list[str] = []
_healthy_stalls: list[str] = []


def _can_bpf() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    if not Path("/sys/kernel/btf/vmlinux").exists():
        return "needs a kernel with BTF"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _can_bpf()
    if reason is None:
        return
    for item in items:
        if any(item.get_closest_marker(m) for m in ("bpf", "lab", "realnccl")):
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped:
        _skipped.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if ON_CI and _skipped and exitstatus == 0:
        session.exitstatus = 1
    left = pins.leftovers()
    for path in left:  # a test that pins must unpin: fail the run, then clean
        pins.remove(path)
    pins.tidy_root()
    if left:
        _left_pins.extend(str(p) for p in left)
        session.exitstatus = 1
    _judge_stalls(session)


def _judge_stalls(session: pytest.Session) -> None:
    """No incident of this run in which a stall was detected is healthy."""
    factory = getattr(session.config, "_tmp_path_factory", None)
    if factory is None or session.testscollected == 0 or hasattr(session.config, "workerinput"):
        return  # the controller scans every worker's folders once they are done
    try:
        root = factory.getbasetemp()
    except OSError:
        return
    _healthy_stalls.extend(stalls.healthy_stalls(Path(root)))
    if _healthy_stalls:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for line in _healthy_stalls:
        terminalreporter.write_line(f"a hung job judged healthy: {line}", red=True)
    if _left_pins:
        terminalreporter.write_line(
            f"pins left behind under /sys/fs/bpf by this run: {', '.join(_left_pins)}", red=True
        )
    if ON_CI and _skipped:
        terminalreporter.write_line(
            f"CI: {len(_skipped)} test(s) skipped; on CI every test must run: "
            + ", ".join(_skipped[:10]),
            red=True,
        )


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    path = SHARED / "fixtures"
    if not path.is_dir():
        pytest.fail(f"shared fixtures not found at {path}")
    return path


@pytest.fixture(scope="session")
def real_libnccl() -> Path:
    """The real libnccl.so.2 of the nvidia-nccl-cu12 wheel (loads without a GPU)."""
    try:
        import nvidia.nccl  # type: ignore[import-not-found]
    except ImportError:
        pytest.fail("nvidia-nccl-cu12 is not installed (pip install nvidia-nccl-cu12)")
    lib = Path(next(iter(nvidia.nccl.__path__))) / "lib" / "libnccl.so.2"
    if not lib.is_file():
        pytest.fail(f"{lib} not found in the nvidia-nccl-cu12 wheel")
    return lib


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One local Spark session for the whole run (starting one takes seconds)."""
    pytest.importorskip("pyspark", reason="pyspark is a test dependency (scripts/setup)")
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2]")
        .appName("stallwatch-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.sources.partitionColumnTypeInference.enabled", "false")
        .config("spark.driver.memory", "1g")
        # list partitions on the driver: no Spark job per folder listing
        .config("spark.sql.sources.parallelPartitionDiscovery.threshold", "100000")
        .config("spark.sql.adaptive.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    try:
        yield session
    finally:
        session.stop()

"""The package as it ships: a wheel built from the repository holds every part
under the one ``stallwatch`` namespace with the BPF and lab C sources as
package data; the import contracts of pyproject.toml hold on it (and breaks when a
part imports against the layers); and, installed into a fresh virtual
environment, its ``stallwatch`` records a lab job from the installed copy only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PARTS = ("dumpers", "query", "recorder", "analyzer", "lab")


def _run(cmd: list[str | Path], cwd: Path, env: dict[str, str] | None = None, timeout: float = 600):
    done = subprocess.run(
        [str(c) for c in cmd],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # from a copy without the checkout's build/ folder: setuptools builds in
    # build/lib and ships whatever an earlier build left there (modules since
    # moved or removed)
    source = tmp_path_factory.mktemp("source") / "stallwatch"
    shutil.copytree(
        ROOT,
        source,
        symlinks=True,
        ignore=shutil.ignore_patterns(
            "build", ".venv*", ".git", "__pycache__", ".*cache*", "*.egg-info", "tests"
        ),
    )
    done = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", out, source], out)
    assert done.returncode == 0, done.stderr
    (path,) = out.glob("stallwatch-*.whl")
    return path


@pytest.fixture(scope="module")
def unpacked(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    return site


def test_wheel_holds_one_namespace_and_the_c_sources(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.startswith("stallwatch-")}
    assert tops == {"stallwatch"}, tops  # no generic top-level `lab`, `recorder`...
    for part in PARTS:
        assert f"stallwatch/{part}/__init__.py" in names, part
    for source in ("nccl.c", "tcp.c", "sched.c", "proc.c", "common.h", "events.h"):
        assert f"stallwatch/bpf/{source}" in names, source
    assert any(n.startswith("stallwatch/lab/csrc/") and n.endswith(".c") for n in names)
    assert "stallwatch/lab/csrc/labnccl.h" in names
    assert not any("/tests/" in n or n.startswith("bench/") for n in names)


def _lint_imports(site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(site)}
    return _run([BIN / "lint-imports", "--config", ROOT / "pyproject.toml"], site, env)


def test_the_import_contract_holds_on_the_package(unpacked: Path) -> None:
    done = _lint_imports(unpacked)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


@pytest.mark.parametrize(
    ("module", "imports", "contract"),
    [
        ("recorder/rings.py", "stallwatch.analyzer.verdict", "layers"),
        ("query/sql.py", "stallwatch.analyzer.incident", "layers"),
        ("dumpers/schema.py", "stallwatch.query.sql", "layers"),
        ("lab/faults.py", "stallwatch.recorder.rings", "separate processes"),
        ("analyzer/verdict.py", "bcc", "laptop"),
    ],
)
def test_an_import_against_the_layers_breaks_the_contract(
    unpacked: Path, tmp_path: Path, module: str, imports: str, contract: str
) -> None:
    site = tmp_path / "site"
    shutil.copytree(unpacked, site)
    path = site / "stallwatch" / module
    path.write_text(path.read_text() + f"\nimport {imports}  # noqa\n")
    done = _lint_imports(site)
    assert done.returncode != 0, done.stdout
    broken = done.stdout.split("Broken contracts")[-1]
    assert contract in broken and imports in broken, done.stdout


def _fresh_venv(where: Path, wheel: Path) -> Path:
    """A new virtual environment with the wheel and BCC linked in, as
    scripts/setup links it (BCC comes from Debian, not from PyPI)."""
    done = _run([sys.executable, "-m", "venv", where], where.parent)
    assert done.returncode == 0, done.stderr
    py = where / "bin" / "python"
    site = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], where)
    bcc = Path(sysconfig.get_paths()["purelib"]) / "bcc"
    (Path(site.stdout.strip()) / "bcc").symlink_to(bcc.resolve())
    done = _run([py, "-m", "pip", "install", "-q", wheel], where, timeout=900)
    assert done.returncode == 0, done.stderr
    return py


@pytest.mark.bpf
@pytest.mark.lab
@pytest.mark.slow
def test_the_installed_wheel_records_a_lab_job(wheel: Path, tmp_path: Path) -> None:
    py = _fresh_venv(tmp_path / "venv", wheel)
    work = tmp_path / "work"  # not the repository: nothing of its folders on the path
    work.mkdir()
    where = _run([py, "-c", "import stallwatch.recorder as r, stallwatch.bpf as b; "
                  "print(r.__file__); print(b.__file__)"], work)  # fmt: skip
    assert where.returncode == 0, where.stderr
    assert all(line.startswith(str(tmp_path / "venv")) for line in where.stdout.split()), where
    env = {**os.environ, "STALLWATCH_LAB_BUILD": str(tmp_path / "labbuild")}
    env.pop("PYTHONPATH", None)
    stallwatch = tmp_path / "venv" / "bin" / "stallwatch"
    dumps = tmp_path / "dumps"
    run = _run(
        [stallwatch, "lab", "run", "--nodes", "1", "--ranks-per-node", "2", "--steps", "30",
         "--record", "--dump-at-end", "--dump-dir", dumps, "--json"],
        work, env, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert (tmp_path / "labbuild" / "libnccl.so.2").exists()  # built from the shipped sources
    sql = "SELECT count(*) AS n FROM nccl_events WHERE op = 'ALL_REDUCE'"
    count = _run([stallwatch, "query", dumps, "--format", "csv", sql], work, env)
    assert count.returncode == 0, count.stderr
    assert int(count.stdout.split()[-1]) >= 2 * 30, count.stdout

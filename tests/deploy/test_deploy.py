"""The deployment files under deploy/: systemd unit, Kubernetes DaemonSet, Slurm scripts.

The unit is checked by ``systemd-analyze`` (verify, and its offline security
score), and its ExecStart line is run for real: this machine's PID 1 is not
systemd, so the test runs the command in what systemd would give it (the
unit's capability bounding set, no-new-privileges, a read-only file system but
/tmp and the dump folder), sees the agent answer /healthz and record calls to
the real libnccl, then stops it with the unit's KillSignal within
TimeoutStopSec.
The DaemonSet is parsed and its security properties checked, and the Slurm
prolog/epilog run against a fake agent that records its arguments and serves
/healthz.  Where the agents find their peers (the headless Service, the
Slurm job's node list, a file) is checked against the agent's own parser and
peer sources.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from stallwatch.dumpers.format import read_dump
from stallwatch.dumpers.schema import Op, Result
from stallwatch.query.credentials import read_local_token
from stallwatch.query.tls import ServerTls
from tests import pins
from tests.query.certs import make_certs

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "systemd" / "stallwatch.service"
CLEANUP_UNIT = DEPLOY / "systemd" / "stallwatch-cleanup.service"
DAEMONSET = DEPLOY / "kubernetes" / "stallwatch-daemonset.yaml"
PROMETHEUS = DEPLOY / "prometheus" / "stallwatch-scrape.yaml"
SLURM = DEPLOY / "slurm"
STALLWATCH = Path(sys.executable).parent / "stallwatch"
Doc = dict[str, Any]  # one parsed Kubernetes object

# What eBPF uprobes and tracepoints need, and why: see the unit's comments.
EBPF_CAPS = {
    "CAP_BPF",
    "CAP_PERFMON",
    "CAP_SYS_RESOURCE",
    "CAP_SYS_PTRACE",
    "CAP_DAC_READ_SEARCH",
    "CAP_NET_ADMIN",
}


@pytest.fixture(scope="module")
def libnccl(real_libnccl: Path) -> Path:
    return real_libnccl


# --------------------------------------------------------------------------- systemd


@dataclass(frozen=True, slots=True)
class Unit:
    """A systemd unit file: section -> key -> every value, in order."""

    sections: dict[str, dict[str, list[str]]]

    def values(self, section: str, key: str) -> list[str]:
        return self.sections.get(section, {}).get(key, [])

    def get(self, section: str, key: str) -> str:
        values = self.values(section, key)
        if not values:
            raise KeyError(f"{UNIT.name}: [{section}] has no {key}=")
        return values[-1]

    def words(self, section: str, key: str) -> set[str]:
        return {w for v in self.values(section, key) for w in v.split()}


def parse_unit(text: str) -> Unit:
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in text.replace("\\\n", " ").splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"{UNIT.name}: {line!r} before any section"
        key, sep, value = line.partition("=")
        assert sep, f"{UNIT.name}: {line!r} is not KEY=VALUE"
        current.setdefault(key.strip(), []).append(value.strip())
    return Unit(sections)


@pytest.fixture(scope="module")
def unit() -> Unit:
    return parse_unit(UNIT.read_text())


def unit_env(unit: Unit) -> dict[str, str]:
    env: dict[str, str] = {}
    for assignment in unit.values("Service", "Environment"):
        for word in shlex.split(assignment):
            key, _, value = word.partition("=")
            env[key] = value
    return env


def exec_start_argv(unit: Unit, env: dict[str, str]) -> list[str]:
    """ExecStart as systemd expands it: ``${X}`` one word, ``$X`` split on spaces."""
    argv: list[str] = []
    for word in shlex.split(unit.get("Service", "ExecStart")):
        bare = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word)
        if bare:
            argv.extend(env.get(bare.group(1), "").split())
            continue
        argv.append(re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda m: env.get(m[1], ""), word))
    return argv


def option(argv: list[str], name: str) -> str:
    for i, word in enumerate(argv):
        if word == name:
            return argv[i + 1]
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    raise AssertionError(f"{name} not in {argv}")


def seconds(text: str) -> float:
    """A systemd time span such as ``10s``, ``1min 30s``, ``500ms`` or ``5``."""
    units = {"ms": 0.001, "s": 1.0, "sec": 1.0, "min": 60.0, "m": 60.0, "h": 3600.0}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", text):
        total += float(number) * units[unit or "s"]
    return total


def systemd_analyze() -> str:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze not installed (Debian package: systemd)")
    return tool


def runnable_copy(tmp_path: Path, unit: Path = UNIT) -> Path:
    """The unit with ExecStart's binary pointed at this checkout's stallwatch."""
    unit_text = unit.read_text()
    binary = shlex.split(parse_unit(unit_text).get("Service", "ExecStart"))[0]
    target = tmp_path / unit.name
    target.write_text(unit_text.replace(binary, str(STALLWATCH)))
    return target


@pytest.mark.parametrize("path", [UNIT, CLEANUP_UNIT], ids=lambda p: p.name)
def test_unit_passes_systemd_analyze_verify(tmp_path: Path, path: Path) -> None:
    tool = systemd_analyze()
    copy = runnable_copy(tmp_path, path)
    if path == CLEANUP_UNIT:  # its Conflicts= and After= name the agent's unit
        runnable_copy(tmp_path, UNIT)
    proc = subprocess.run([tool, "verify", str(copy)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    # verify exits 0 on unknown keys and bad values, but says so on stderr.
    assert proc.stderr.strip() == "", proc.stderr


def test_unit_supervises_the_agent_and_keeps_its_recording_pinned(unit: Unit) -> None:
    """Type=notify with a watchdog (the agent speaks the protocol: lab and
    recorder tests), restarts on failure but not on bad usage (exit 2), and
    names the pin folder that the cleanup unit removes."""
    service = {key: values[-1] for key, values in unit.sections["Service"].items()}
    assert service["Type"] == "notify" and service["NotifyAccess"] == "main"
    assert 10 <= seconds(service["WatchdogSec"]) <= 120
    assert seconds(service["TimeoutStartSec"]) >= 60  # BCC compiles at start
    assert service["RestartPreventExitStatus"] == "2"
    argv = exec_start_argv(unit, unit_env(unit))
    pin_dir = option(argv, "--pin-dir")
    assert pin_dir.startswith("/sys/fs/bpf/")
    assert "--keep-pinned" in argv  # stopped or restarted, the recording stays
    cleanup = parse_unit(CLEANUP_UNIT.read_text())
    argv = shlex.split(cleanup.get("Service", "ExecStart"))
    assert argv[1:] == ["record", "--cleanup", "--pin-dir", pin_dir]
    assert cleanup.get("Unit", "Conflicts") == UNIT.name
    assert cleanup.get("Unit", "After") == UNIT.name
    assert cleanup.get("Service", "Type") == "oneshot"


@pytest.mark.solo  # bounded by time: judged alone
@pytest.mark.bpf
def test_cleanup_units_command_removes_the_pins_without_capabilities(tmp_path: Path) -> None:
    """The cleanup unit runs as root with no capability at all: unpinning is
    file removal on bpffs, and the lock check needs no bpf(2)."""
    from bench.fakenccl import build

    pinned = pins.pin_dir("cleanup-unit")
    argv = [str(STALLWATCH), "record", "--lib", str(build().lib), "--dump-dir", str(tmp_path)]
    argv += ["--listen", f"127.0.0.1:{free_port()}", "--pin-dir", str(pinned), "--keep-pinned"]
    log = tmp_path / "agent.log"
    with log.open("wb") as out:
        agent = subprocess.Popen(argv, stderr=out)
    try:
        deadline = time.monotonic() + 120
        while not (pinned / "links").is_dir() or len(list((pinned / "links").iterdir())) < 40:
            assert agent.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        cleanup = parse_unit(CLEANUP_UNIT.read_text())
        caps = cleanup.get("Service", "CapabilityBoundingSet").split()
        command = [str(STALLWATCH), *shlex.split(cleanup.get("Service", "ExecStart"))[1:]]
        command[command.index("--pin-dir") + 1] = str(pinned)
        busy = subprocess.run(
            capability_sandbox(set(caps)) + command, capture_output=True, text=True
        )
        assert busy.returncode == 2 and "records into it; stop it first" in busy.stderr
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(60) == 0
        assert pinned.is_dir()  # a stopped agent with --keep-pinned leaves it pinned
        done = subprocess.run(
            capability_sandbox(set(caps)) + command, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        assert not pinned.exists()
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        pins.remove(pinned)


def test_systemd_analyze_verify_reports_a_broken_unit(tmp_path: Path) -> None:
    """The check above can fail: a misspelt hardening key does not pass silently."""
    tool = systemd_analyze()
    copy = runnable_copy(tmp_path)
    copy.write_text(copy.read_text().replace("ProtectSystem=strict", "ProtectSytem=strict"))
    proc = subprocess.run([tool, "verify", str(copy)], capture_output=True, text=True, timeout=60)
    assert "ProtectSytem" in proc.stderr


def test_unit_exposure_score_is_low(tmp_path: Path) -> None:
    tool = systemd_analyze()
    proc = subprocess.run(
        [tool, "security", "--offline=true", "--threshold=45", str(runnable_copy(tmp_path))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    score = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", proc.stdout)
    assert score, proc.stdout[-2000:] + proc.stderr
    assert proc.returncode == 0, f"exposure {score[1]} above 4.5:\n{proc.stdout}"


def test_unit_grants_only_the_ebpf_capabilities(unit: Unit) -> None:
    assert unit.words("Service", "CapabilityBoundingSet") == EBPF_CAPS
    assert unit.words("Service", "AmbientCapabilities") == EBPF_CAPS
    assert unit.get("Service", "NoNewPrivileges") == "yes"


def test_unit_is_hardened_and_restarts(unit: Unit) -> None:
    service = {key: values[-1] for key, values in unit.sections["Service"].items()}
    expected = {
        "ProtectSystem": "strict",
        "ProtectHome": "read-only",
        "PrivateTmp": "yes",
        "Restart": "on-failure",
        "KillSignal": "SIGTERM",
        "LimitMEMLOCK": "infinity",
    }
    assert {k: service.get(k) for k in expected} == expected
    assert "stallwatch" in unit.words("Service", "StateDirectory")
    assert 0 < seconds(service["RestartSec"]) <= 60
    assert 0 < seconds(service["TimeoutStopSec"]) <= 120
    assert re.fullmatch(r"\d+[KMG]", service["MemoryMax"])
    assert 0 < int(service["CPUQuota"].rstrip("%")) <= 100
    assert int(service["Nice"]) >= 0
    # BCC needs the kernel headers and every rank's /proc/PID.
    assert "ProtectKernelModules" not in service
    assert service.get("ProtectProc", "default") == "default"


def test_unit_dump_dir_is_writable_under_the_sandbox(unit: Unit) -> None:
    dump_dir = Path(option(exec_start_argv(unit, unit_env(unit)), "--dump-dir"))
    writable = [Path(p.lstrip("-")) for p in unit.words("Service", "ReadWritePaths")]
    writable += [Path("/var/lib") / d for d in unit.words("Service", "StateDirectory")]
    assert any(dump_dir == w or w in dump_dir.parents for w in writable), (dump_dir, writable)


def test_unit_gives_the_agent_its_dump_credentials_folder(unit: Unit) -> None:
    from stallwatch.query.credentials import RUN_DIR

    runtime = [Path("/run") / d for d in unit.words("Service", "RuntimeDirectory")]
    assert RUN_DIR in runtime and unit.get("Service", "RuntimeDirectoryMode") == "0700"


def test_unit_exec_start_parses_with_the_real_cli(unit: Unit) -> None:
    from stallwatch.commands.main import build_parser

    extra = "--peers node2:9400 --peers-from file /etc/stallwatch/peers"
    argv = exec_start_argv(unit, unit_env(unit) | {"STALLWATCH_ARGS": extra})
    assert Path(argv[0]).name == "stallwatch" and Path(argv[0]).is_absolute()
    args = build_parser().parse_args(argv[1:])
    assert args.command == "record"
    assert args.peers_from == ["file", "/etc/stallwatch/peers"]
    # the unit's comment shows the same option
    assert "--peers-from file /etc/stallwatch/peers" in UNIT.read_text()
    assert option(argv, "--listen") == "127.0.0.1:9400"


# --------------------------------------------------------------------------- the unit, run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def http_json(
    url: str, body: dict[str, object] | None = None, token: str | None = None
) -> tuple[int, object]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    request.add_header("Content-Type", "application/json")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


@dataclass(frozen=True, slots=True)
class RunningAgent:
    proc: subprocess.Popen[bytes]
    base: str  # http://127.0.0.1:PORT
    log: Path
    dump_dir: Path
    notify: socket.socket  # what the agent tells the service manager

    def notified(self, timeout: float) -> list[str]:
        """The notify datagrams received within ``timeout`` seconds."""
        out: list[str] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                out.append(self.notify.recv(4096).decode())
            except TimeoutError:
                if out:
                    break
        return out

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def metrics(self) -> str:
        with urllib.request.urlopen(self.base + "/metrics", timeout=10) as response:
            text: str = response.read().decode()
            return text

    def wait_healthy(self, timeout: float) -> dict[str, object]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"agent exited with {self.proc.returncode} before /healthz answered:\n"
                    + self.log_tail()
                )
            try:
                status, doc = http_json(self.base + "/healthz")
            except OSError:
                time.sleep(0.2)
                continue
            assert status == 200, (status, doc)
            assert isinstance(doc, dict)
            return doc
        raise AssertionError(f"no answer from {self.base} within {timeout} s:\n{self.log_tail()}")


def capability_sandbox(bounding: set[str]) -> list[str]:
    """setpriv with a bounding set and no-new-privileges (what systemd applies)."""
    caps = "".join(",+" + c.removeprefix("CAP_").lower() for c in sorted(bounding))
    return ["setpriv", f"--bounding-set=-all{caps}", "--inh-caps=-all", "--no-new-privs"]


# ProtectSystem=strict, ProtectHome=read-only, ReadWritePaths=, PrivateTmp=, in
# a private mount namespace: every mount read-only but the API file systems,
# /tmp and the writable paths (given colon-separated as $1).
READ_ONLY_SANDBOX = """
set -e
writable=$1; shift
for w in ${writable//:/ }; do mount --bind "$w" "$w"; done
while read -r _ _ _ _ mp _; do
    case "$mp" in /proc|/proc/*|/sys|/sys/*|/dev|/dev/*) continue;; esac
    case ":$writable:" in *":$mp:"*) continue;; esac
    mount -o remount,bind,ro "$mp" || { echo "sandbox: cannot make $mp read-only" >&2; exit 1; }
done < /proc/self/mountinfo
exec "$@"
"""


def filesystem_sandbox(unit: Unit, dump_dir: Path) -> list[str]:
    assert unit.get("Service", "ProtectSystem") == "strict"
    assert unit.get("Service", "PrivateTmp") == "yes"
    runtime = [f"/run/{d}" for d in unit.words("Service", "RuntimeDirectory")]
    for folder in runtime:  # systemd makes them
        Path(folder).mkdir(mode=0o700, exist_ok=True)
    writable = ["/tmp", str(dump_dir), *runtime]
    unshare = ["unshare", "--mount", "--propagation", "private"]
    return [*unshare, "bash", "-c", READ_ONLY_SANDBOX, "sandbox", ":".join(writable)]


NCCL_CALLER = textwrap.dedent(
    """
    import ctypes, sys
    import os
    lib = ctypes.CDLL(sys.argv[1])
    n = int(sys.argv[2])
    results = [lib.ncclAllReduce(None, None, ctypes.c_size_t(1024), 7, 0, None, None)
               for _ in range(n)]
    print(os.getpid(), *sorted(set(results)))
    """
)


def call_real_nccl(lib: Path, times: int) -> str:
    """Calls ncclAllReduce on a null communicator; prints its pid and the results."""
    return subprocess.run(
        [sys.executable, "-c", NCCL_CALLER, str(lib), str(times)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout


@pytest.fixture
def agent_from_unit(unit: Unit, libnccl: Path, tmp_path: Path) -> Iterator[RunningAgent]:
    port = free_port()
    env = unit_env(unit) | {
        "STALLWATCH_LISTEN": f"127.0.0.1:{port}",
        # The unit's documented way to add arguments: the real libnccl by path.
        "STALLWATCH_ARGS": f"--lib {libnccl}",
    }
    argv = exec_start_argv(unit, env)
    argv[0] = str(STALLWATCH)
    dump_dir = tmp_path / "dumps"
    dump_dir.mkdir()  # systemd creates it (StateDirectory=)
    pinned = pins.pin_dir("unit")  # the unit's own folder, for a test
    swap = {option(argv, "--dump-dir"): str(dump_dir), option(argv, "--pin-dir"): str(pinned)}
    argv = [swap.get(w, w) for w in argv]
    log_path = tmp_path / "agent.log"
    notify = tmp_path / "notify.sock"  # Type=notify: systemd's socket, here the test's
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(str(notify))
    receiver.settimeout(0.2)
    with log_path.open("wb") as log:
        caps = unit.words("Service", "CapabilityBoundingSet")
        sandbox = filesystem_sandbox(unit, dump_dir) + capability_sandbox(caps)
        env_run = os.environ | {"NOTIFY_SOCKET": str(notify)}
        proc = subprocess.Popen(sandbox + argv, stdout=log, stderr=log, env=env_run)
    try:
        yield RunningAgent(proc, f"http://127.0.0.1:{port}", log_path, dump_dir, receiver)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        receiver.close()
        pins.remove(pinned)


@pytest.mark.solo  # bounded by time: judged alone
@pytest.mark.bpf
@pytest.mark.slow
@pytest.mark.realnccl
def test_unit_exec_start_records_and_stops_on_kill_signal(
    unit: Unit, agent_from_unit: RunningAgent, libnccl: Path
) -> None:
    agent = agent_from_unit
    assert agent.wait_healthy(timeout=60)["status"] == "ok"
    ready = agent.notified(timeout=10)
    assert any(m.startswith("READY=1") for m in ready), ready  # Type=notify: the start ends
    attached = re.search(r"^stallwatch_libraries_attached ([\d.]+)$", agent.metrics(), re.M)
    assert attached and float(attached[1]) >= 1, agent.metrics()
    pid, *results = map(int, call_real_nccl(libnccl, times=3).split())
    assert results == [Result.INVALID_ARGUMENT]  # a null communicator is refused, not run

    # no token: the agent's own dump credential, kept for root in its RuntimeDirectory
    token = read_local_token("127.0.0.1", int(agent.base.rpartition(":")[2]))
    assert token is not None, agent.log_tail()
    assert http_json(agent.base + "/dump", {"reason": "deploy test"})[0] == 401
    status, answer = http_json(agent.base + "/dump", {"reason": "deploy test"}, token)
    assert status == 200, (answer, agent.log_tail())
    dumps = sorted(agent.dump_dir.glob("*.msgpack"))
    assert len(dumps) == 1, (answer, dumps)
    rows = read_dump(dumps[0]).rings["nccl"].rows
    mine = rows[rows["pid"] == pid]
    assert len(mine) == 3, f"{len(mine)} rows recorded for pid {pid}: {mine}"
    assert set(mine["op"]) == {Op.ALL_REDUCE}
    assert set(mine["count"]) == {1024}
    assert set(mine["result"]) == {Result.INVALID_ARGUMENT}

    stop_signal = signal.Signals[unit.get("Service", "KillSignal")]
    timeout = seconds(unit.get("Service", "TimeoutStopSec"))
    started = time.monotonic()
    agent.proc.send_signal(stop_signal)
    try:
        code = agent.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(
            f"agent still running {timeout} s after {stop_signal.name}:\n{agent.log_tail()}"
        )
    assert code == 0, f"agent exited {code} on {stop_signal.name}:\n{agent.log_tail()}"
    assert time.monotonic() - started < timeout
    assert any("STOPPING=1" in m for m in agent.notified(timeout=2)), agent.log_tail()


@pytest.mark.bpf
@pytest.mark.realnccl
@pytest.mark.parametrize("dropped", ["CAP_BPF", "CAP_PERFMON"])
def test_unit_capabilities_cannot_lose_bpf_or_perfmon(
    unit: Unit, dropped: str, libnccl: Path, tmp_path: Path
) -> None:
    """The set is not larger than needed there: without either, no probe loads."""
    caps = unit.words("Service", "CapabilityBoundingSet") - {dropped}
    argv = [str(STALLWATCH), "record", "--dump-dir", str(tmp_path), "--lib", str(libnccl)]
    argv += ["--listen", f"127.0.0.1:{free_port()}", "--pin-dir", str(pins.pin_dir("caps"))]
    proc = subprocess.run(
        capability_sandbox(caps) + argv, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "BPF" in proc.stderr.splitlines()[-1], proc.stderr[-3000:]


# --------------------------------------------------------------------------- Kubernetes


@pytest.fixture(scope="module")
def manifests() -> list[Doc]:
    docs = [d for d in yaml.safe_load_all(DAEMONSET.read_text()) if d]
    assert all(isinstance(d, dict) for d in docs)
    return docs


def of_kind(docs: list[Doc], kind: str) -> Doc:
    found = [d for d in docs if d.get("kind") == kind]
    assert len(found) == 1, f"{DAEMONSET.name}: expected one {kind}, found {len(found)}"
    return found[0]


@pytest.fixture(scope="module")
def pod(manifests: list[Doc]) -> Doc:
    ds = of_kind(manifests, "DaemonSet")
    assert ds["metadata"]["namespace"] == "stallwatch"
    assert of_kind(manifests, "Namespace")["metadata"]["name"] == "stallwatch"
    selector = ds["spec"]["selector"]["matchLabels"]
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items()
    spec: Doc = ds["spec"]["template"]["spec"]
    return spec


@pytest.fixture(scope="module")
def agent(pod: Doc) -> Doc:
    (container,) = pod["containers"]
    result: Doc = container
    return result


def k8s_argv(agent: Doc) -> list[str]:
    """command + args, with the downward-API variables Kubernetes substitutes."""
    argv = [*agent["command"], *agent.get("args", [])]
    return [w.replace("$(NODE_IP)", "10.1.2.3") for w in argv]


def mounts_by_path(pod: Doc, agent: Doc) -> dict[str, tuple[Doc, Doc]]:
    volumes = {v["name"]: v for v in pod["volumes"]}
    return {m["mountPath"]: (m, volumes[m["name"]]) for m in agent["volumeMounts"]}


def test_daemonset_shares_host_pid_and_network(pod: Doc) -> None:
    assert pod["hostPID"] is True
    assert pod["hostNetwork"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pod.get("automountServiceAccountToken") is False


def test_daemonset_capabilities_match_the_unit(agent: Doc) -> None:
    sc = agent["securityContext"]
    assert sc["privileged"] is False
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert sc["seccompProfile"]["type"] == "RuntimeDefault"
    assert sc["appArmorProfile"]["type"] == "Unconfined"  # maps of other profiles
    assert {"CAP_" + c for c in sc["capabilities"]["add"]} == EBPF_CAPS


def test_daemonset_mounts_what_ebpf_needs(pod: Doc, agent: Doc) -> None:
    mounts = mounts_by_path(pod, agent)
    for path in ("/sys/kernel/debug", "/sys/kernel/tracing", "/sys/fs/bpf", "/lib/modules"):
        _, volume = mounts[path]
        assert volume["hostPath"]["path"] == path
    for path in ("/lib/modules", "/usr/src"):
        assert mounts[path][0].get("readOnly") is True, path
    assert "emptyDir" in mounts["/tmp"][1]


def test_daemonset_writes_only_dumps_pins_the_compile_cache_and_tmp(pod: Doc, agent: Doc) -> None:
    argv = k8s_argv(agent)
    dump_dir = option(argv, "--dump-dir")
    mounts = mounts_by_path(pod, agent)
    _, volume = mounts[dump_dir]
    assert volume["hostPath"]["path"] == "/var/lib/stallwatch/dumps"
    assert volume["hostPath"]["type"] == "DirectoryOrCreate"
    # the compiled programs stay on the node (record's default --bpf-cache):
    # a pod started with nothing pinned loads them instead of compiling
    assert "--bpf-cache" not in argv and "--no-bpf-cache" not in argv
    _, cache = mounts["/var/cache/stallwatch"]
    assert cache["hostPath"] == {"path": "/var/cache/stallwatch", "type": "DirectoryOrCreate"}
    writable = {p for p, (m, _) in mounts.items() if not m.get("readOnly")}
    assert writable == {dump_dir, "/tmp", "/sys/fs/bpf", "/var/cache/stallwatch"}
    # the node's own bpffs, so that the pinned recording outlives the pod
    assert option(argv, "--pin-dir").startswith("/sys/fs/bpf/")
    assert "--keep-pinned" in argv  # a stopped or updated pod leaves it to the next
    _, bpffs = mounts["/sys/fs/bpf"]
    assert bpffs["hostPath"]["path"] == "/sys/fs/bpf"


def test_daemonset_token_secret_backs_the_token_file(pod: Doc, agent: Doc) -> None:
    argv = k8s_argv(agent)
    listen_host = option(argv, "--listen").rpartition(":")[0]
    assert listen_host not in ("127.0.0.1", "localhost", "::1")  # so the token is needed
    token_file = Path(option(argv, "--token-file"))
    mount, volume = mounts_by_path(pod, agent)[str(token_file.parent)]
    assert mount["readOnly"] is True
    assert volume["secret"]["secretName"] == "stallwatch-token"
    assert volume["secret"]["defaultMode"] == 0o400


def test_daemonset_tls_secret_backs_the_certificate_files(pod: Doc, agent: Doc) -> None:
    argv = k8s_argv(agent)
    files = {option(argv, flag) for flag in ("--tls-cert", "--tls-key", "--tls-ca")}
    folders = {str(Path(f).parent) for f in files}
    assert len(files) == 3 and len(folders) == 1
    mount, volume = mounts_by_path(pod, agent)[folders.pop()]
    assert mount["readOnly"] is True and volume["secret"]["secretName"] == "stallwatch-tls"
    assert {Path(f).name for f in files} == {"tls.crt", "tls.key", "ca.crt"}  # kubernetes.io/tls


def test_daemonset_args_parse_with_the_real_cli(agent: Doc) -> None:
    from stallwatch.commands.main import build_parser

    argv = k8s_argv(agent)
    assert argv[0] == "stallwatch"
    assert build_parser().parse_args(argv[1:]).command == "record"
    port = int(option(argv, "--listen").rpartition(":")[2])
    assert [p["containerPort"] for p in agent["ports"]] == [port]


def test_daemonset_finds_its_peers_through_a_headless_service(
    manifests: list[Doc], pod: Doc, agent: Doc
) -> None:
    """The agents' --peers-from names the manifest's headless Service, which
    selects the agent pods on the agents' port; resolved (by a fake DNS), it
    gives the other nodes' agents and never the pod's own."""
    from stallwatch.cli import build_parser
    from stallwatch.recorder.peers import peer_source, self_names

    service = of_kind(manifests, "Service")
    spec = service["spec"]
    assert spec["clusterIP"] == "None" and spec["publishNotReadyAddresses"] is True
    ds = of_kind(manifests, "DaemonSet")
    assert spec["selector"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    args = build_parser().parse_args(k8s_argv(agent)[1:])
    port = int(args.listen.rpartition(":")[2])
    assert [(p["port"], p["targetPort"]) for p in spec["ports"]] == [(port, port)]
    kind, name = args.peers_from
    meta = service["metadata"]
    assert (kind, name) == ("k8s-service", f"{meta['name']}.{meta['namespace']}.svc")
    answers = {name: ["10.1.2.1", "10.1.2.3", "10.1.2.9"]}  # 10.1.2.3: this pod's node
    source = peer_source(args.peers_from, self_names(args.listen), answers.__getitem__)
    assert source.peers() == (f"10.1.2.1:{port}", f"10.1.2.9:{port}")


def cpu_millis(q: str) -> float:
    return float(q[:-1]) if q.endswith("m") else float(q) * 1000


def mem_bytes(q: str) -> float:
    suffixes = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "K": 1e3, "M": 1e6, "G": 1e9}
    for suffix, factor in suffixes.items():
        if q.endswith(suffix):
            return float(q[: -len(suffix)]) * factor
    return float(q)


def test_daemonset_bounds_resources(agent: Doc) -> None:
    res = agent["resources"]
    assert 0 < cpu_millis(res["requests"]["cpu"]) <= cpu_millis(res["limits"]["cpu"]) <= 1000
    assert 0 < mem_bytes(res["requests"]["memory"]) <= mem_bytes(res["limits"]["memory"])
    assert mem_bytes(res["limits"]["memory"]) <= 2 * 2**30


def test_daemonset_runs_on_gpu_nodes(pod: Doc) -> None:
    assert pod["nodeSelector"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]


def probe_target(probe: Doc) -> str:
    if "httpGet" in probe:
        return str(probe["httpGet"]["path"])
    return " ".join(probe["exec"]["command"])


def test_daemonset_probes_healthz_and_stops_in_time(pod: Doc, agent: Doc, unit: Unit) -> None:
    for name in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert "/healthz" in probe_target(agent[name]), name
    stop = seconds(unit.get("Service", "TimeoutStopSec"))
    assert stop < pod["terminationGracePeriodSeconds"] <= 150


@dataclass(frozen=True, slots=True)
class _HealthOnly:
    """The least an HTTP backend is: enough for /healthz."""

    host: str = "probe-test"

    def recording(self) -> object:
        raise NotImplementedError

    def metrics_text(self) -> str:
        return ""


def run_probe(agent: Doc, name: str, port: int, token_file: Path, tls: Path) -> int:
    """The probe's command as the kubelet runs it, pointed at a local server."""
    command = [
        w.replace("/etc/stallwatch/token", str(token_file))
        .replace(":9400/", f":{port}/")
        .replace("/etc/stallwatch-tls/", f"{tls}/")
        for w in agent[name]["exec"]["command"]
    ]
    command[0] = sys.executable  # the image's python3
    env = os.environ | {"NODE_IP": "127.0.0.1"}
    return subprocess.run(command, env=env, capture_output=True, timeout=30).returncode


def test_daemonset_probe_passes_the_agents_token_check(agent: Doc, tmp_path: Path) -> None:
    from stallwatch.query.http import serve_http

    token_file = Path(option(k8s_argv(agent), "--token-file"))
    assert str(token_file) in " ".join(agent["livenessProbe"]["exec"]["command"])
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.write_text("correct-horse\n")
    bad.write_text("wrong\n")
    certs = make_certs(tmp_path, "node-a.example")  # not the probe's address: names unchecked
    certs.ca.rename(tmp_path / "ca.crt")
    (tmp_path / "other").mkdir()
    other = make_certs(tmp_path / "other")
    other.other_ca.rename(tmp_path / "other" / "ca.crt")  # a CA that signed nothing here
    handle = serve_http(
        _HealthOnly(),  # type: ignore[arg-type]
        "127.0.0.1:0",
        token="correct-horse",
        tls=ServerTls(certs.cert, certs.key),
    )
    try:
        port = int(handle.address.rpartition(":")[2])
        for name in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert run_probe(agent, name, port, good, tmp_path) == 0, name
        assert run_probe(agent, "livenessProbe", port, bad, tmp_path) != 0
        # an agent whose certificate another CA signed is not taken for ours
        assert run_probe(agent, "livenessProbe", port, good, tmp_path / "other") != 0
    finally:
        handle.close()


def test_daemonset_scrape_credential_comes_from_the_token_secret(pod: Doc, agent: Doc) -> None:
    argv = k8s_argv(agent)
    scrape = Path(option(argv, "--scrape-token-file"))
    assert scrape.parent == Path(option(argv, "--token-file")).parent
    _, volume = mounts_by_path(pod, agent)[str(scrape.parent)]
    assert volume["secret"]["secretName"] == "stallwatch-token"
    assert f"--from-file={scrape.name}=" in DAEMONSET.read_text()  # how the Secret is made


def test_prometheus_example_scrapes_with_the_read_only_credential(
    manifests: list[Doc], agent: Doc, tmp_path: Path
) -> None:
    """The scrape job's files are the DaemonSet's CA and scrape credential,
    it keeps the agents' Service; scraped as it says, a real server answers
    /metrics to that credential and nothing else."""
    (job,) = yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"]
    argv = k8s_argv(agent)
    assert job["scheme"] == "https" and job["metrics_path"] == "/metrics"
    credentials = Path(job["authorization"]["credentials_file"])
    assert credentials.name == Path(option(argv, "--scrape-token-file")).name
    assert Path(job["tls_config"]["ca_file"]).name == Path(option(argv, "--tls-ca")).name
    service = of_kind(manifests, "Service")["metadata"]
    (sd,) = job["kubernetes_sd_configs"]
    assert sd["namespaces"]["names"] == [service["namespace"]]
    assert {"regex": service["name"], "action": "keep"}.items() <= job["relabel_configs"][0].items()
    from stallwatch.query.http import serve_http

    certs = make_certs(tmp_path, "127.0.0.1")
    handle = serve_http(
        _HealthOnly(),  # type: ignore[arg-type]
        "127.0.0.1:0",
        token="the-agents-own",
        scrape_token="read-only",
        tls=ServerTls(certs.cert, certs.key),
    )
    try:
        context = ssl.create_default_context(cafile=str(certs.ca))
        url = f"https://{handle.address}"
        scrape = {"Authorization": f"{job['authorization']['type']} read-only"}
        for path, body, want in (("/metrics", None, 200), ("/query", b"{}", 403)):
            request = urllib.request.Request(url + path, data=body, headers=scrape)
            try:
                with urllib.request.urlopen(request, timeout=10, context=context) as answer:
                    status = answer.status
            except urllib.error.HTTPError as exc:
                status = exc.code
            assert status == want, path
    finally:
        handle.close()


# --------------------------------------------------------------------------- Slurm

FAKE_AGENT = """\
#!{python}
# A stand-in for `stallwatch record`: records its argv and Slurm environment, serves GET /healthz on
# --listen's port (bearer token checked as the real agent does), writes two
# dumps, and exits 0 on SIGTERM (unless FAKE_IGNORE_TERM is set).
import http.server, json, os, signal, sys, threading
from pathlib import Path

argv = sys.argv[1:]
state = Path(os.environ["FAKE_STATE"])
if "--cleanup" in argv:  # the epilog unpins the job's recording
    (state / "cleanup.json").write_text(json.dumps(argv))
    sys.exit(0)
(state / "argv.json").write_text(json.dumps(argv))
slurm = {{k: v for k, v in os.environ.items() if k.startswith(("SLURM_", "SLURMD_"))}}
(state / "env.json").write_text(json.dumps(slurm))
opt = lambda name: argv[argv.index(name) + 1] if name in argv else None
token = Path(opt("--token-file")).read_text().strip() if opt("--token-file") else None
tls = opt("--tls-cert") is not None  # plain HTTP then gets the real agent's 400
dump_dir = Path(opt("--dump-dir"))
for name in ("incident-1.msgpack", "incident-2.msgpack"):
    (dump_dir / name).write_bytes(os.urandom(256))

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        ok = token is None or self.headers.get("Authorization") == "Bearer " + token
        sent = "Authorization" in self.headers
        note = "plain-refused" if tls else ("authorized" if ok else "refused")
        with (state / "healthz.log").open("a") as f:
            f.write(note + (" with-token" if sent else "") + "\\n")
        self.send_response(400 if tls else 200 if ok else 401)
        self.end_headers()
        self.wfile.write(b'{{"status": "ok"}}')
    def log_message(self, *args):
        pass

server = http.server.HTTPServer(("127.0.0.1", int(opt("--listen").rpartition(":")[2])), Handler)
threading.Thread(target=server.serve_forever, daemon=True).start()

def stop(signum, frame):
    (state / "stopped").write_text(signal.Signals(signum).name)
    sys.exit(0)

signal.signal(signal.SIGTERM, signal.SIG_IGN if os.environ.get("FAKE_IGNORE_TERM") else stop)
while True:
    signal.pause()
"""


@dataclass(frozen=True, slots=True)
class SlurmNode:
    env: dict[str, str]
    state: Path  # the fake agent's notes
    state_dir: Path
    collect: Path
    port: int

    @property
    def dump_dir(self) -> Path:
        return self.state_dir / self.env["SLURM_JOB_ID"]

    @property
    def pin_dir(self) -> str:
        return f"{self.env['STALLWATCH_PIN_ROOT']}/slurm-{self.env['SLURM_JOB_ID']}"

    @property
    def pid_file(self) -> Path:
        return Path(self.env["STALLWATCH_RUN_DIR"]) / (self.env["SLURM_JOB_ID"] + ".pid")

    def run(self, script: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(SLURM / script)],
            env=self.env | extra,
            capture_output=True,
            text=True,
            timeout=60,
        )

    def argv(self) -> list[str]:
        argv: list[str] = json.loads((self.state / "argv.json").read_text())
        return argv


def write_executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[SlurmNode]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    write_executable(bin_dir / "stallwatch", FAKE_AGENT.format(python=sys.executable))
    (tmp_path / "fake").mkdir()
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    tls = tmp_path / "tls"
    tls.mkdir()
    certs = make_certs(tls, "127.0.0.1", "127.0.0.2", "127.0.0.3", "gpu2")
    certs.cert.rename(tls / "node.pem")
    certs.key.rename(tls / "node.key")
    port = free_port()
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "gpu[1-3]",
        "SLURMD_NODENAME": "gpu2",
        "FAKE_STATE": str(tmp_path / "fake"),
        "STALLWATCH_CONF": str(tmp_path / "no-such-conf"),
        "STALLWATCH_BIN": str(bin_dir / "stallwatch"),
        "STALLWATCH_STATE_DIR": str(tmp_path / "state"),
        "STALLWATCH_RUN_DIR": str(tmp_path / "run"),
        "STALLWATCH_TOKEN_FILE": str(token),
        "STALLWATCH_TLS_DIR": str(tls),
        "STALLWATCH_PORT": str(port),
        "STALLWATCH_READY_TIMEOUT": "20",
        "STALLWATCH_COLLECT_DIR": str(tmp_path / "shared"),
        "STALLWATCH_PIN_ROOT": str(pins.pin_dir("slurm")),
    }
    if "PYTHONPATH" in os.environ:  # the checkout under test, not only the installed one
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    n = SlurmNode(env, tmp_path / "fake", tmp_path / "state", tmp_path / "shared", port)
    yield n
    pid = n.pid_file.read_text().strip() if n.pid_file.exists() else ""
    if pid and Path(f"/proc/{pid}").exists():
        os.kill(int(pid), signal.SIGKILL)
    pins.remove(Path(env["STALLWATCH_PIN_ROOT"]))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is not running: it is waiting for its parent
    return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "Z"


@pytest.mark.parametrize("script", ["prolog.sh", "epilog.sh", "common.sh"])
def test_slurm_scripts_parse(script: str) -> None:
    proc = subprocess.run(["bash", "-n", str(SLURM / script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_slurm_scripts_pass_shellcheck() -> None:
    tool = shutil.which("shellcheck")
    if tool is None:
        pytest.skip("shellcheck not installed (Debian package: shellcheck)")
    scripts = [str(SLURM / s) for s in ("prolog.sh", "epilog.sh", "common.sh")]
    proc = subprocess.run([tool, "-x", *scripts], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_prolog_starts_one_agent_for_the_job(node: SlurmNode) -> None:
    proc = node.run("prolog.sh")
    assert proc.returncode == 0, proc.stderr
    port, tls = str(node.port), node.env["STALLWATCH_TLS_DIR"]
    assert node.argv() == [
        "record",
        "--dump-dir",
        str(node.dump_dir),
        "--stall-timeout",
        "60",
        "--pin-dir",
        node.pin_dir,
        "--keep-pinned",
        "--listen",
        f"0.0.0.0:{port}",
        "--token-file",
        node.env["STALLWATCH_TOKEN_FILE"],
        "--tls-cert",
        f"{tls}/node.pem",
        "--tls-key",
        f"{tls}/node.key",
        "--tls-ca",
        f"{tls}/ca.pem",
        "--peers-from",
        "slurm",
    ]
    pid = int(node.pid_file.read_text())
    assert alive(pid)
    assert "record" in Path(f"/proc/{pid}/cmdline").read_text()
    # The prolog waited for the agent's answer, and never sent the token in clear.
    assert set((node.state / "healthz.log").read_text().split()) == {"plain-refused"}
    assert node.dump_dir.stat().st_mode & 0o777 == 0o700

    again = node.run("prolog.sh")
    assert again.returncode == 0
    assert "already running" in again.stderr
    assert int(node.pid_file.read_text()) == pid


def test_epilog_stops_the_agent_and_collects_its_dumps(node: SlurmNode) -> None:
    assert node.run("prolog.sh").returncode == 0
    pid = int(node.pid_file.read_text())
    originals = {p.name: p.read_bytes() for p in node.dump_dir.glob("*.msgpack")}
    assert len(originals) == 2

    proc = node.run("epilog.sh")
    assert proc.returncode == 0, proc.stderr
    assert not alive(pid)
    assert (node.state / "stopped").read_text() == "SIGTERM"
    assert not node.pid_file.exists()
    shared = node.collect / "4242"
    collected = {p.name: p.read_bytes() for p in shared.glob("*.msgpack")}
    assert collected == {f"gpu2-{name}": data for name, data in originals.items()}
    assert "started agent" in (shared / "gpu2-agent.log").read_text()
    cleanup = json.loads((node.state / "cleanup.json").read_text())
    assert cleanup == ["record", "--cleanup", "--pin-dir", node.pin_dir]
    assert not list(shared.glob("*.part"))
    assert not node.dump_dir.exists()  # collected, so no longer kept on the node


def test_epilog_keeps_dumps_on_the_node_without_a_collect_dir(node: SlurmNode) -> None:
    assert node.run("prolog.sh").returncode == 0
    assert node.run("epilog.sh", STALLWATCH_COLLECT_DIR="").returncode == 0
    assert len(list(node.dump_dir.glob("*.msgpack"))) == 2
    assert not node.collect.exists()


def test_epilog_kills_an_agent_that_ignores_sigterm(node: SlurmNode) -> None:
    assert node.run("prolog.sh", FAKE_IGNORE_TERM="1").returncode == 0
    pid = int(node.pid_file.read_text())
    started = time.monotonic()
    proc = node.run("epilog.sh", STALLWATCH_STOP_TIMEOUT="1")
    assert proc.returncode == 0
    assert 1 <= time.monotonic() - started < 10
    assert not alive(pid)
    assert "SIGKILL" in proc.stderr


def test_epilog_leaves_a_reused_pid_alone(node: SlurmNode) -> None:
    other = subprocess.Popen(["sleep", "30"])
    try:
        node.pid_file.parent.mkdir(parents=True)
        node.pid_file.write_text(f"{other.pid}\n")
        assert node.run("epilog.sh").returncode == 0
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


@pytest.mark.parametrize("absent", ["STALLWATCH_TOKEN_FILE", "STALLWATCH_TLS_DIR"])
def test_prolog_without_token_or_tls_listens_on_loopback_alone(
    node: SlurmNode, absent: str
) -> None:
    proc = node.run("prolog.sh", **{absent: str(node.state / "absent")})
    assert proc.returncode == 0, proc.stderr
    assert "loopback only" in proc.stderr and str(node.state / "absent") in proc.stderr
    argv = node.argv()
    assert option(argv, "--listen") == f"127.0.0.1:{node.port}"
    assert "--peers" not in argv and "--token-file" not in argv and "--tls-cert" not in argv
    # the loopback agent was asked for /healthz with the token
    assert "authorized" in (node.state / "healthz.log").read_text().split()


def test_prolog_asks_for_client_certificates_when_told(node: SlurmNode) -> None:
    assert node.run("prolog.sh", STALLWATCH_TLS_MUTUAL="1").returncode == 0
    tls = node.env["STALLWATCH_TLS_DIR"]
    assert option(node.argv(), "--tls-client-ca") == f"{tls}/ca.pem"


def test_prolog_takes_extra_args(node: SlurmNode) -> None:
    extra = "--lib /opt/nccl/lib/libnccl.so.2 --scope host"
    proc = node.run("prolog.sh", STALLWATCH_EXTRA_ARGS=extra)
    assert proc.returncode == 0, proc.stderr
    assert node.argv()[-4:] == extra.split()


def test_prolog_agent_finds_the_jobs_other_nodes(
    node: SlurmNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent the prolog starts inherits its environment, and expands the
    job's node list as Slurm does, leaving itself out."""
    from stallwatch.cli import build_parser
    from stallwatch.recorder.peers import peer_source, self_names

    assert node.run("prolog.sh", SLURM_JOB_NODELIST="gpu[1-3],io[07-08]").returncode == 0
    args = build_parser().parse_args(node.argv())
    env = json.loads((node.state / "env.json").read_text())
    assert env["SLURM_JOB_NODELIST"] == "gpu[1-3],io[07-08]"
    for key in ("SLURM_JOB_NODELIST", "SLURMD_NODENAME"):
        monkeypatch.setenv(key, env[key])
    source = peer_source(args.peers_from, self_names(args.listen, args.host_name))
    port = node.port
    assert source.peers() == (f"gpu1:{port}", f"gpu3:{port}", f"io07:{port}", f"io08:{port}")


def test_prolog_single_node_job_has_no_peers(node: SlurmNode) -> None:
    assert node.run("prolog.sh", SLURM_JOB_NODELIST="", SLURMD_NODENAME="gpu2").returncode == 0
    assert "--peers-from" not in node.argv() and "--peers" not in node.argv()


@pytest.mark.bpf
@pytest.mark.slow
def test_slurm_scripts_run_the_real_agent(node: SlurmNode) -> None:
    """Prolog, a dump asked over HTTP with the token, epilog: with `stallwatch record`."""
    real = {
        "STALLWATCH_BIN": str(STALLWATCH),
        "STALLWATCH_READY_TIMEOUT": "90",
        # Peers on loopback (no traffic leaves the machine): the agent itself.
        "SLURM_JOB_NODELIST": "127.0.0.[2-3],gpu2",
    }
    proc = node.run("prolog.sh", **real)
    assert proc.returncode == 0, proc.stderr
    assert "not healthy" not in proc.stderr and "exited" not in proc.stderr, proc.stderr
    pid = int(node.pid_file.read_text())
    token = Path(node.env["STALLWATCH_TOKEN_FILE"]).read_text().strip()
    request = urllib.request.Request(
        f"https://127.0.0.1:{node.port}/dump",
        data=json.dumps({"reason": "slurm test"}).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    ca = Path(node.env["STALLWATCH_TLS_DIR"]) / "ca.pem"
    context = ssl.create_default_context(cafile=str(ca))
    with urllib.request.urlopen(request, timeout=30, context=context) as response:
        assert response.status == 200

    proc = node.run("epilog.sh", **real)
    assert proc.returncode == 0
    logs = [node.state_dir / "4242.log", node.collect / "4242" / "gpu2-agent.log"]
    agent_log = "".join(p.read_text() for p in logs if p.exists())
    assert "SIGKILL" not in proc.stderr, proc.stderr + agent_log
    assert not alive(pid)
    collected = sorted((node.collect / "4242").glob("gpu2-*.msgpack"))
    assert collected
    assert read_dump(collected[0]).trigger is not None
    assert not Path(node.pin_dir).exists(), agent_log  # the job's recording is unpinned


def test_scripts_refuse_a_job_id_that_is_not_one(node: SlurmNode) -> None:
    for script in ("prolog.sh", "epilog.sh"):
        proc = node.run(script, SLURM_JOB_ID="../../etc")
        assert proc.returncode == 0
        assert "not a job id" in proc.stderr
    assert not node.state_dir.exists()
    assert not Path(node.env["STALLWATCH_RUN_DIR"]).exists()


def test_prolog_never_fails_the_job(node: SlurmNode) -> None:
    proc = node.run("prolog.sh", STALLWATCH_BIN=str(node.state / "missing"))
    assert proc.returncode == 0
    assert "not executable" in proc.stderr
    assert not node.pid_file.exists()


# --------------------------------------------------------------------------- the image
#
# No container engine runs here, so the image is not built by the suite: its
# install steps are read and held against the ones scripts/setup runs.

CONTAINERFILE = DEPLOY / "container" / "Containerfile"
SETUP = ROOT / "scripts" / "setup"


@dataclass(frozen=True, slots=True)
class Instruction:
    keyword: str
    text: str


def containerfile_stages(text: str) -> list[list[Instruction]]:
    """Instructions, continuation lines joined, one list per FROM."""
    stages: list[list[Instruction]] = []
    for line in re.sub(r"\\\n", " ", text).splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        if keyword.upper() == "FROM":
            stages.append([])
        assert stages, f"{CONTAINERFILE.name}: {keyword} before FROM"
        stages[-1].append(Instruction(keyword.upper(), rest.strip()))
    return stages


def shell_commands(stage: list[Instruction]) -> list[list[str]]:
    """Each command of the stage's RUN lines, as words (quotes kept whole)."""
    commands: list[list[str]] = []
    for ins in stage:
        if ins.keyword != "RUN":
            continue
        lexer = shlex.shlex(ins.text, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        current: list[str] = []
        for token in lexer:
            if token in {"&&", ";", "||", "|"}:
                commands.append(current)
                current = []
            else:
                current.append(token)
        commands.append(current)
    return [c for c in commands if c]


def bash_array(script: Path, name: str) -> list[str]:
    """An array of a bash script's package lists, as bash itself reads it."""
    lists = re.findall(r"^\w*DEBS=\(.*?\)$", script.read_text(), re.M | re.S)
    program = "\n".join(lists) + f'\nprintf "%s\\n" "${{{name}[@]}}"'
    done = subprocess.run(["bash", "-c", program], capture_output=True, text=True, check=True)
    return done.stdout.split()


@pytest.fixture(scope="module")
def agent_stage() -> list[Instruction]:
    *_, final = containerfile_stages(CONTAINERFILE.read_text())
    return final


def apt_packages(commands: list[list[str]]) -> list[str]:
    """The packages of the one ``apt-get install`` (after any VAR=value)."""
    bare = [[w for w in c if not re.fullmatch(r"[A-Z_]+=\S*", w)] for c in commands]
    (install,) = [c for c in bare if c[:1] == ["apt-get"] and "install" in c]
    return [w for w in install[install.index("install") + 1 :] if not w.startswith("-")]


def test_image_installs_the_debian_packages_setup_names_for_the_agent(
    agent_stage: list[Instruction],
) -> None:
    agent_debs = bash_array(SETUP, "AGENT_DEBS")
    everything = bash_array(SETUP, "DEBS")
    assert agent_debs and set(agent_debs) < set(everything)  # setup installs them too
    commands = shell_commands(agent_stage)
    assert apt_packages(commands) == agent_debs
    # the kernel headers are the node's, mounted by the DaemonSet
    assert "linux-headers-amd64" in bash_array(SETUP, "NODE_DEBS")
    assert not any("linux-headers" in w for c in commands for w in c)


def test_image_installs_the_wheel_with_setups_lock_and_bcc_link(
    agent_stage: list[Instruction],
) -> None:
    setup = SETUP.read_text()
    (lock,) = re.findall(r"^LOCK=\$\{STALLWATCH_LOCK-(\S+)\}$", setup, re.M)
    copies = {
        words[-1]: words[:-1]
        for ins in agent_stage
        if ins.keyword == "COPY"
        for words in [ins.text.split()]
    }
    commands = shell_commands(agent_stage)
    (pip,) = [c for c in commands if c[1:4] == ["-m", "pip", "install"]]
    constraints = pip[pip.index("-c") + 1]
    assert copies[constraints] == [lock]  # the very file setup installs from
    assert (ROOT / lock).is_file()
    assert any(w.endswith(".whl") for w in pip) and "-e" not in pip
    # Debian's BCC module linked into the environment, as setup links it
    (setup_link,) = re.findall(r"^ln -sfn (\S+) ", setup, re.M)
    links = [c for c in commands if c[:2] == ["ln", "-sfn"]]
    assert [c[2] for c in links] == [setup_link]
    # the venv where the unit and the Slurm scripts expect it, on PATH
    env = " ".join(i.text for i in agent_stage if i.keyword == "ENV")
    assert "PATH=/opt/stallwatch/.venv/bin:" in env
    assert "/opt/stallwatch/.venv/bin/stallwatch" in UNIT.read_text()


def test_image_wheel_stage_copies_every_part(agent_stage: list[Instruction]) -> None:
    """stallwatch/<part> links to top-level folders: each must be in the build."""
    wheel_stage, _ = containerfile_stages(CONTAINERFILE.read_text())
    copied = {ins.text.split()[0] for ins in wheel_stage if ins.keyword == "COPY"}
    links = {p.readlink().name for p in (ROOT / "stallwatch").iterdir() if p.is_symlink()}
    assert links and links | {"stallwatch", "pyproject.toml"} <= copied


def test_daemonset_runs_the_image_by_its_name(agent: Doc) -> None:
    from stallwatch import __version__

    name = f"stallwatch-agent:{__version__}"
    assert agent["image"] == name
    text = CONTAINERFILE.read_text()
    assert f"-t {name} ." in text
    assert f'org.opencontainers.image.version="{__version__}"' in text
    assert f"-t {name} ." in DAEMONSET.read_text()  # the manifest says how it is built


ALERTS = DEPLOY / "prometheus" / "stallwatch-alerts.yaml"


def _exposed_series() -> dict[str, str]:
    """Name -> one line of each series the agent's /metrics renders (a
    stream the slowdown trigger knows everything of, its counters, an
    incident's published verdict)."""
    from stallwatch.recorder.prometheus import counter_families, render, stream_families
    from stallwatch.recorder.slowdown import StreamGauges
    from stallwatch.recorder.verdicts import Published, incident_families

    known = StreamGauges(7, 0x5EED, 1, 6, 3.5, 10**9, 3 * 10**8, 10**7, 10**7, 1.0, 10**8, 0)
    incident = Published(
        "20261207T120000000-node1-00002a", 1, "missing_rank", ("node2",), (3,), "rank 3 ...",
        1_796_644_800 * 10**9, 1_796_644_808 * 10**9, ("a:1",), (), None, (),
    )  # fmt: skip
    text = render(
        [
            *stream_families([known]),
            *incident_families([incident]),
            *counter_families({"slowdowns_detected": 1}),
        ]
    )
    return {
        line.split("{")[0].split(" ")[0]: line
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def test_the_alert_rules_name_only_metrics_and_labels_the_agent_exposes() -> None:
    """Every series an alert rule reads is one the agent's /metrics renders,
    and every label its annotations cite (but the scrape's own, instance)
    is on the series an ``and`` keeps: the first the expression names."""
    exposed = _exposed_series()
    groups = {g["name"]: g for g in yaml.safe_load(ALERTS.read_text())["groups"]}
    assert [len(g["rules"]) for g in groups.values()] == [1, 3]
    for rule in (r for g in groups.values() for r in g["rules"]):
        named = re.findall(r"\bstallwatch_[a-z_]+\b", rule["expr"])
        assert named and set(named) <= exposed.keys(), (rule["alert"], set(named) - exposed.keys())
        cited = re.findall(r"\$labels\.(\w+)", " ".join(rule["annotations"].values()))
        for label in set(cited) - {"instance"}:
            assert f'{label}="' in exposed[named[0]], (rule["alert"], label)


def test_the_incident_alert_carries_the_culprit() -> None:
    (rule,) = next(
        g["rules"] for g in yaml.safe_load(ALERTS.read_text())["groups"]
        if g["name"] == "stallwatch-incidents"
    )  # fmt: skip
    assert rule["expr"].split()[0] == "stallwatch_incident_info"
    summary = rule["annotations"]["summary"]
    for label in ("kind", "ranks", "hosts", "incident", "revision"):
        assert f"$labels.{label}" in summary
    # the time filter matches the info series on every label but the verdict's own
    ignored = re.search(r"ignoring \(([^)]*)\)", rule["expr"])
    assert ignored is not None
    info = _exposed_series()["stallwatch_incident_info"]
    when = _exposed_series()["stallwatch_incident_timestamp_seconds"]
    labels = set(re.findall(r'(\w+)="', info)) - {x.strip() for x in ignored.group(1).split(",")}
    assert labels == set(re.findall(r'(\w+)="', when))


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_accepts_the_alert_rules() -> None:
    done = subprocess.run(
        ["promtool", "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_fires_the_incident_alert_with_the_culprit() -> None:
    case = Path(__file__).parent / "data" / "incident-alert.promtool.yml"
    done = subprocess.run(
        ["promtool", "test", "rules", str(case)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr

"""What the agent needs from the kernel before it loads anything.

Loading eBPF programs and attaching uprobes and tracepoints needs CAP_BPF and
CAP_PERFMON (root has both); kernels before 6.6 attach uprobes as perf
events, which also need CAP_SYS_ADMIN.  Reading other users' processes'
maps needs CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH; without them the agent
records only its own user's processes, so that is a warning, not a refusal.
The checks read the effective capability set, so root in a container whose
capabilities were dropped is told what it lacks too.
"""

from __future__ import annotations

import os
from pathlib import Path

CAPS = {
    "CAP_DAC_READ_SEARCH": 2,
    "CAP_SYS_PTRACE": 19,
    "CAP_SYS_ADMIN": 21,
    "CAP_PERFMON": 38,
    "CAP_BPF": 39,
}
NEEDED = ("CAP_BPF", "CAP_PERFMON")
NEEDED_BEFORE_6_6 = ("CAP_SYS_ADMIN",)
FOR_OTHER_USERS = ("CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH")


def effective_capabilities(status: Path = Path("/proc/self/status")) -> int:
    for line in status.read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def kernel_version(release: str | None = None) -> tuple[int, int]:
    text = release if release is not None else os.uname().release
    parts = [*text.split("-")[0].split("."), "0", "0"][:2]
    try:
        return int(parts[0]), int(parts[1])
    except ValueError:
        return 0, 0


def lacking(names: tuple[str, ...], caps: int) -> list[str]:
    return [n for n in names if not caps >> CAPS[n] & 1]


def missing_for_recording(caps: int | None = None, release: str | None = None) -> list[str]:
    """Capabilities the agent cannot record without (empty: it can)."""
    caps = effective_capabilities() if caps is None else caps
    needed = NEEDED + (NEEDED_BEFORE_6_6 if kernel_version(release) < (6, 6) else ())
    return lacking(needed, caps)


def refusal(missing: list[str]) -> str:
    """One line for the person who ran it."""
    return (
        f"needs root or the capabilities {' and '.join(missing)} to load its eBPF probes "
        f"(this process lacks {', '.join(missing)}); run it as root or grant them "
        "(deploy/ has a systemd unit and a DaemonSet that do)"
    )

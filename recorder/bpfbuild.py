"""What is compiled: the BPF sources of ``bpf/`` and the flags they are
compiled with, and the key that names a compiled build.

BCC rewrites map accesses and generates tracepoint argument structs only in
its main source, so the probe families are compiled as one module: the
files are passed together, each after a ``#line`` marker that keeps
compiler messages pointing at the right file.  The flags are the rings'
sizes, the run-queue threshold, the kernel's tick rate, and each family's
own (``recorder.<family>_probes``): the NCCL and CUDA symbol numbers, and
for the TCP and scheduler families the struct offsets of the running
kernel, from its BTF, that their raw tracepoints read.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.resources
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from stallwatch.dumpers.errors import ProbeError
from stallwatch.dumpers.schema import RING_DTYPES

from . import cuda_probes, nccl_probes, sched_probes, tcp_probes
from .btf import BtfError, KernelTypes
from .maps import RING_MAPS, MapSet
from .rings import check_ring_size

log = logging.getLogger("stallwatch.record")


def _bpf_dir() -> Path:
    """The BPF sources, shipped as package data of ``stallwatch.bpf``."""
    return Path(str(importlib.resources.files("stallwatch.bpf")))


BPF_DIR = _bpf_dir()
# cuda.h before nccl.c: BCC rewrites map accesses only in the text it is given
SOURCES = ("common.h", "cuda.h", "nccl.c", "cuda.c", "tcp.c", "sched.c", "proc.c")


@dataclass(frozen=True, slots=True)
class RingSizes:
    """Slots per ring (powers of two), derived from the nccl ring's size."""

    nccl: int
    comm: int
    tcp: int
    sched: int
    exit: int

    @classmethod
    def from_nccl(cls, slots: int) -> RingSizes:
        check_ring_size(slots)
        return cls(
            nccl=slots,
            comm=max(64, slots // 64),
            tcp=max(64, slots // 4),
            sched=max(64, slots // 8),
            exit=max(64, slots // 256),
        )

    @classmethod
    def of(cls, maps: MapSet) -> RingSizes:
        return cls(**maps.ring_slots())

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in RING_MAPS}

    def memory_bytes(self) -> int:
        return sum(n * RING_DTYPES[name].itemsize for name, n in self.as_dict().items())


def bpf_source() -> str:
    """The text BCC compiles: every file of ``bpf/`` in order."""
    parts = []
    for name in SOURCES:
        path = BPF_DIR / name
        try:
            text = path.read_text()
        except OSError as exc:
            raise ProbeError(f"cannot read BPF source {path}: {exc}") from exc
        parts.append(f'#line 1 "{path}"\n{text}')
    return "\n".join(parts)


def build_key(flags: Sequence[str]) -> str:
    """What a compiled recording is made of: every file of ``bpf/`` (those
    only included too), the flags and the kernel they were compiled for;
    not where the files are (an installed wheel and a checkout of the same
    sources compile the same programs).  Pins of the same key are adopted
    with nothing compiled; the compile cache is keyed by it."""
    digest = hashlib.sha256()
    for path in sorted(BPF_DIR.glob("*.[ch]")):
        try:
            text = path.read_bytes()
        except OSError as exc:
            raise ProbeError(f"cannot read BPF source {path}: {exc}") from exc
        digest.update(path.name.encode() + b"\0" + text + b"\0")
    digest.update("\0".join(f for f in flags if not f.startswith("-I")).encode())
    digest.update(os.uname().release.encode())
    return digest.hexdigest()[:24]


def kernel_hz() -> int:
    """The kernel's tick rate (CONFIG_HZ): retransmission timeouts come in
    jiffies.  From the kernel's configuration, else measured on
    /proc/timer_list's jiffies; 0 when neither can be read (RTOs unknown)."""
    release = os.uname().release
    for reader in (_hz_from_config, _hz_measured):
        with contextlib.suppress(OSError, ValueError, EOFError):
            hz = reader(release)
            if hz:
                return hz
    return 0


HZ_VALUES = (100, 250, 300, 1000)


def _hz_from_config(release: str) -> int:
    import gzip

    texts: list[str] = []
    with contextlib.suppress(OSError):
        texts.append(Path(f"/boot/config-{release}").read_text())
    if not texts:
        with gzip.open("/proc/config.gz", "rt") as f:
            texts.append(f.read())
    for line in texts[0].splitlines():
        if line.startswith("CONFIG_HZ="):
            return int(line.partition("=")[2])
    return 0


def _hz_measured(_release: str) -> int:
    import time

    def jiffies() -> tuple[int, int]:
        for line in Path("/proc/timer_list").read_text().splitlines():
            if line.startswith("jiffies:"):
                return int(line.split()[1]), time.monotonic_ns()
        raise ValueError("no jiffies in /proc/timer_list")

    j0, t0 = jiffies()
    time.sleep(0.2)
    j1, t1 = jiffies()
    rate = (j1 - j0) * 1e9 / (t1 - t0)
    return min(HZ_VALUES, key=lambda hz: abs(hz - rate))


_HZ: list[int] = []
_KERNEL_FLAGS: dict[bool, list[str]] = {}


def kernel_flags(raw_tracepoints: bool) -> list[str]:
    """The TCP and scheduler families' flags on this kernel: raw
    tracepoints, with the offsets its BTF gives, where it can say them and
    ``raw_tracepoints`` asks for them; else tracepoints.  Worked out once
    per process (the BTF is read, then let go)."""
    if raw_tracepoints not in _KERNEL_FLAGS:
        types = _kernel_types() if raw_tracepoints else None
        _KERNEL_FLAGS[raw_tracepoints] = tcp_probes.cflags(types) + sched_probes.cflags(types)
    return _KERNEL_FLAGS[raw_tracepoints]


def _kernel_types() -> KernelTypes | None:
    try:
        return KernelTypes.load()
    except BtfError as exc:
        log.warning("TCP and scheduler events from tracepoints: %s", exc)
        return None


def cflags(sizes: RingSizes, runq_threshold_ns: int, raw_tracepoints: bool = True) -> list[str]:
    if not _HZ:
        _HZ.append(kernel_hz())
    flags = [f"-I{BPF_DIR}", f"-DRUNQ_THRESHOLD_NS={runq_threshold_ns}ULL", f"-DKERNEL_HZ={_HZ[0]}"]
    flags += kernel_flags(raw_tracepoints)
    flags += [f"-D{RING_MAPS[name][2]}={n}" for name, n in sizes.as_dict().items()]
    return flags + nccl_probes.cflags() + cuda_probes.cflags()

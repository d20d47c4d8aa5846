"""A compile result kept on disk and reused: a cold start compiles nothing.

BCC compiles the BPF programs with LLVM: seconds of CPU, at every start
with nothing pinned (a new node, after ``--cleanup`` or a foreground
agent's Ctrl-C).  Once a loader process has compiled (``recorder.loader``),
it keeps what BCC produced in ``--bpf-cache DIR/<build key>.json``: each
program's instructions as BCC made them, its type, and which map each
map-loading instruction names; every map's type, sizes and flags as the
kernel reported them; the layout.  An agent that finds its build's entry
creates the maps with bpf(2), gives each such instruction the new map's fd,
and loads the programs itself (the kernel's verifier checks them as it
checked BCC's): no BCC and no LLVM in any process.

The key (``bpfbuild.build_key``) is the BPF sources, the flags and the kernel
release: any change is another entry; the newest ``KEEP_ENTRIES`` stay.  An
entry that does not read back, or whose programs the kernel refuses, is
passed over: the loader compiles.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import logging
import os
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import bpfsys
from .maps import Layout

log = logging.getLogger("stallwatch.record")

FORMAT = 3  # 2: a program's link is a tracepoint or a cgroup hook; 3: or a raw tracepoint
DEFAULT_CACHE_DIR = Path("/var/cache/stallwatch")
KEEP_ENTRIES = 8  # builds kept (about 300 KB each): ring sizes, versions side by side
_LD_IMM64 = 0x18
_PSEUDO_MAP_FD = 1
_INSN = struct.Struct("<BBhi")


@dataclass(frozen=True, slots=True)
class CompiledMap:
    name: str
    type: int
    key_size: int
    value_size: int
    max_entries: int
    flags: int


@dataclass(frozen=True, slots=True)
class CompiledProgram:
    name: str
    prog_type: int
    attach_type: int  # expected_attach_type (0: none)
    insns: bytes  # map fds zeroed
    maps: tuple[tuple[int, str], ...]  # (instruction index, map name)
    # what to link it to: ("tracepoint", "category:event"), ("raw_tracepoint",
    # "event") or ("cgroup", "sock_ops");
    # None: uprobe_multi programs, linked library by library
    link: tuple[str, str] | None


@dataclass(frozen=True, slots=True)
class Compiled:
    build_key: str
    license: str
    layout: Layout
    maps: tuple[CompiledMap, ...]
    programs: tuple[CompiledProgram, ...]


def unbind(insns: bytes, names: dict[int, str]) -> tuple[bytes, tuple[tuple[int, str], ...]]:
    """The instructions with every map fd zeroed, and where each map was."""
    out = bytearray(insns)
    where = []
    for i in range(len(insns) // _INSN.size):
        code, regs, off, imm = _INSN.unpack_from(insns, i * _INSN.size)
        if code == _LD_IMM64 and regs >> 4 == _PSEUDO_MAP_FD:
            if imm not in names:
                raise ValueError(f"instruction {i} loads fd {imm}, which is no map of the layout")
            where.append((i, names[imm]))
            _INSN.pack_into(out, i * _INSN.size, code, regs, off, 0)
    return bytes(out), tuple(where)


def bind(program: CompiledProgram, fds: dict[str, int]) -> bytes:
    """The program's instructions naming this process's maps."""
    out = bytearray(program.insns)
    for index, name in program.maps:
        code, regs, off, _ = _INSN.unpack_from(out, index * _INSN.size)
        _INSN.pack_into(out, index * _INSN.size, code, regs, off, fds[name])
    return bytes(out)


def path_for(cache_dir: Path, build_key: str) -> Path:
    return cache_dir / f"{build_key}.json"


def save(cache_dir: Path, compiled: Compiled) -> None:
    """Write the entry atomically (a reader never sees half of one)."""
    doc = {
        "format": FORMAT,
        "build_key": compiled.build_key,
        "license": compiled.license,
        "layout": compiled.layout.to_json(),
        "maps": [vars_of(m) for m in compiled.maps],
        "programs": [
            {
                **vars_of(p),
                "insns": base64.b64encode(p.insns).decode(),
                "maps": [list(m) for m in p.maps],
                "link": list(p.link) if p.link else None,
            }
            for p in compiled.programs
        ],
    }
    cache_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".tmp-")
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(doc, out)
        os.replace(tmp, path_for(cache_dir, compiled.build_key))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    prune(cache_dir)


def prune(cache_dir: Path, keep: int = KEEP_ENTRIES) -> None:
    """Only the ``keep`` newest entries stay: each upgrade, or other ring
    sizes, make another, and an old build's is of no use."""
    entries = sorted(cache_dir.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[keep:]:
        with contextlib.suppress(OSError):
            old.unlink()
        with contextlib.suppress(OSError):
            old.with_suffix(".lock").unlink()


@contextlib.contextmanager
def compiling(cache_dir: Path | None, build_key: str) -> Iterator[None]:
    """Held while one process looks in the cache for ``build_key`` and, on
    a miss, compiles it: agents (or ``--compile-only``) starting together on
    one node compile once, the others wait and then load the entry.  With
    no cache folder, or one that cannot be written, nothing is held."""
    if cache_dir is None:
        yield
        return
    try:
        cache_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(cache_dir / f"{build_key}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        log.warning("compile cache %s: %s (compiling without waiting for others)", cache_dir, exc)
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process compiles the same programs: waiting for it")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def vars_of(record: CompiledMap | CompiledProgram) -> dict[str, Any]:
    return {name: getattr(record, name) for name in record.__slots__}


def load(cache_dir: Path, build_key: str) -> Compiled | None:
    """The entry of ``build_key``, or None (none, unreadable, another format)."""
    path = path_for(cache_dir, build_key)
    try:
        doc = json.loads(path.read_text())
        if doc["format"] != FORMAT or doc["build_key"] != build_key:
            return None
        return Compiled(
            build_key,
            str(doc["license"]),
            Layout.from_json(doc["layout"]),
            tuple(CompiledMap(**m) for m in doc["maps"]),
            tuple(_program(p) for p in doc["programs"]),
        )
    except FileNotFoundError:
        return None
    except (OSError, KeyError, TypeError, ValueError) as exc:
        log.warning("compile cache %s passed over: %s", path, exc)
        return None


def _program(doc: dict[str, Any]) -> CompiledProgram:
    link = doc["link"]
    return CompiledProgram(
        name=str(doc["name"]),
        prog_type=int(doc["prog_type"]),
        attach_type=int(doc["attach_type"]),
        insns=base64.b64decode(doc["insns"]),
        maps=tuple((int(i), str(n)) for i, n in doc["maps"]),
        link=(str(link[0]), str(link[1])) if link else None,
    )


def compiled_map(name: str, fd: int) -> CompiledMap:
    info = bpfsys.map_info(fd)
    return CompiledMap(
        name, info.type, info.key_size, info.value_size, info.max_entries, info.flags
    )

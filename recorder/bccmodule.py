"""BCC behind one door: the only module of stallwatch that imports ``bcc``.

BCC compiles C with LLVM into a module of programs and maps, loads a
program into the kernel when asked (by name and program type), and keeps
its maps.  ``BccModule`` is that module as the recorder uses it: programs
loaded by name, the maps' descriptors and their layout (numpy dtypes of
their records), each program's instructions (for the compile cache), and
the few ways BCC attaches things itself (tracepoints on kernels without
perf-event links; the fallback's perf-event uprobes go through libbcc's C
function, ``libbcc_name``).  BCC raises a bare ``Exception``: each is
wrapped here into ``ProbeError`` naming the program or the file.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stallwatch.dumpers.errors import ProbeError

from .maps import Layout, MapSpec

NO_ATTACH_TYPE = -1  # BCC's "none"


def short(exc: Exception, limit: int = 300) -> str:
    text = str(exc)
    return text if len(text) <= limit else text[:limit] + "..."


def _bcc() -> Any:
    import bcc

    return bcc


def libbcc_name() -> str:
    """The path libbcc was loaded from (its C functions, through ctypes)."""
    return str(_bcc().libbcc.lib._name)


class BccModule:
    """One compiled BCC module; its programs are loaded on demand."""

    def __init__(self, text: str | None = None, src_file: Path | None = None,
                 cflags: Sequence[str] = ()) -> None:  # fmt: skip
        api = _bcc()
        Module = _module_class(api)
        where = str(src_file) if src_file is not None else "the BPF sources"
        try:
            if src_file is not None:
                self.bpf = Module(src_file=str(src_file).encode(), cflags=list(cflags))
            else:
                self.bpf = Module(text=(text or "").encode(), cflags=list(cflags))
        except Exception as exc:  # BCC raises bare Exception
            raise ProbeError(f"cannot load BPF programs from {where}: {short(exc)}") from exc
        self._lib = api.libbcc.lib
        _declare(self._lib)

    def load(self, name: str, prog_type: int, attach_type: int = NO_ATTACH_TYPE) -> int:
        """The fd of program ``name`` loaded as ``prog_type`` (BCC keeps it,
        and closes it at ``cleanup``); ProbeError with the verifier's word."""
        try:
            fn = self.bpf.load_func(name.encode(), prog_type, attach_type=attach_type)
        except Exception as exc:  # BCC raises bare Exception
            raise ProbeError(f"cannot load BPF program {name}: {short(exc)}") from exc
        return int(fn.fd)

    def forget(self, name: str) -> None:
        """Close program ``name`` and drop it from BCC's cache (BCC caches
        programs by name: one loaded for one attach type must be loaded
        again for another)."""
        fn = self.bpf.funcs.pop(name.encode(), None)
        if fn is not None:
            os.close(fn.fd)

    def functions(self) -> list[str]:
        """The name of every function of the module (its programs)."""
        lib, module = self._lib, self.bpf.module
        return [
            lib.bpf_function_name(module, i).decode() for i in range(lib.bpf_num_functions(module))
        ]

    def map_fd(self, name: str) -> int:
        return int(self.bpf[name.encode()].map_fd)

    def layout(self, flags: Sequence[str]) -> Layout:
        """Every map of the module, with numpy dtypes of its records."""
        import numpy as np

        lib, module = self._lib, self.bpf.module
        maps: dict[str, MapSpec] = {}
        for i in range(lib.bpf_num_tables(module)):
            name = lib.bpf_table_name(module, i)
            table = self.bpf[name]
            map_id = table.map_id
            maps[name.decode()] = MapSpec(
                name=name.decode(),
                type=int(lib.bpf_table_type_id(module, map_id)),
                key=np.dtype(table.Key),
                value=np.dtype(table.Leaf),
                max_entries=int(lib.bpf_table_max_entries_id(module, map_id)),
                flags=int(lib.bpf_table_flags_id(module, map_id)),
            )
        defines = tuple(sorted(f for f in flags if f.startswith("-D")))
        return Layout(maps, defines)

    def instructions(self, name: str) -> bytes:
        """Program ``name``'s instructions as BCC made them (map fds in)."""
        return bytes(self.bpf.dump_func(name.encode()))

    def license(self) -> str:
        return str(self._lib.bpf_module_license(self.bpf.module).decode())

    def attach_tracepoint(self, name: str, category: str, event: str) -> None:
        """BCC's own tracepoint attachment (kernels before 5.15, which have
        no perf-event links); BCC keeps it until ``cleanup``."""
        try:
            self.bpf.attach_tracepoint(tp=f"{category}:{event}".encode(), fn_name=name.encode())
        except Exception as exc:  # BCC raises bare Exception
            raise ProbeError(
                f"cannot attach tracepoint program {name} to {category}:{event}: {short(exc)}"
            ) from exc

    def drop_all(self) -> None:
        """Close every program and map of the module (a pinned recording
        was adopted instead: they are of no use)."""
        for fn in self.bpf.funcs.values():
            os.close(fn.fd)
        self.bpf.funcs.clear()
        self.bpf.tables.clear()
        self.bpf.cleanup()

    def cleanup(self) -> None:
        self.bpf.cleanup()


def _module_class(api: Any) -> Any:
    class Module(api.BPF):  # type: ignore[misc]
        """BCC's BPF without its autoload: the recorder attaches through
        links, which can be pinned."""

        def _trace_autoload(self) -> None:
            return None

    return Module


def _declare(lib: Any) -> None:
    lib.bpf_num_tables.restype = ctypes.c_ulonglong
    lib.bpf_num_tables.argtypes = [ctypes.c_void_p]
    lib.bpf_table_name.restype = ctypes.c_char_p
    lib.bpf_table_name.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong]

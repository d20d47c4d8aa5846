"""The BPF recording: the programs of ``bpf/`` compiled (or found compiled,
or adopted from pins), attached, and their maps mapped into numpy.

Every load or attach failure raises ``ProbeError`` naming the program, the
library and the symbol.  Attachments are links made here, not by BCC: each
family's uprobes (``recorder.uprobes``), the TCP and scheduler families'
raw tracepoints and the process family's tracepoints
(``recorder.kernelhooks``), the TCP family's sock_ops program on the cgroup
v2 root (``recorder.tcp_probes``).  A link can be pinned, and so the whole
recording can outlive the agent (``recorder.pinning``): with pins, the maps,
the programs links are made from and every link are pinned as they are
made, and an agent that finds a pin set of its own layout adopts it instead
of loading anything.  Where the kernel has no uprobe_multi, nothing is
pinned.

Three ways to a loaded recording, cheapest first: pins of this very build
(``bpfbuild.build_key``) adopted with nothing compiled; the compile cache's
entry of the build loaded with bpf(2) (``recorder.compiled``); BCC compiling,
here or (the agent) in a short-lived process (``recorder.loadrequest``).
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any

from stallwatch.dumpers.errors import PinError, ProbeError
from stallwatch.dumpers.model import ProgramMisses
from stallwatch.dumpers.schema import CUDA_SYMBOLS

from . import bpfsys, compiled, kernelhooks, pinning, tcp_probes
from .bccmodule import BccModule
from .bpfbuild import RingSizes, bpf_source, build_key, cflags
from .kernelhooks import Hook
from .maps import BpfMap, MapSet
from .nccl_probes import RETURN_PROGRAM
from .uprobes import PROGRAMS as UPROBE_PROGRAMS
from .uprobes import Uprobes, close_links, unsupported

log = logging.getLogger("stallwatch.record")


class Probes:
    """The loaded (or adopted) BPF recording: maps mapped into numpy, links."""

    def __init__(
        self,
        sizes: RingSizes,
        runq_threshold_ns: int,
        uprobe_multi: bool = True,
        pins: pinning.PinOptions | None = None,
        about: dict[str, Any] | None = None,
        compile_outside: bool = False,
        cache_dir: Path | None = None,
        compile_only: bool = False,
        raw_tracepoints: bool = True,
    ) -> None:
        """``uprobe_multi=False`` attaches perf-event uprobes even where the
        kernel has uprobe_multi links (the fallback, for tests);
        ``raw_tracepoints=False`` attaches the TCP and scheduler programs to
        tracepoints even where the kernel's BTF allows raw tracepoints (the
        fallback, for tests and the benchmark).  With ``pins``, the
        recording is pinned there, or adopted from there: pins of this very
        build are adopted with nothing compiled; else, with
        ``compile_outside`` (the agent), a short-lived process compiles and
        pins and they are adopted; else BCC compiles here.  ``cache_dir``:
        the compile cache, read by the agent and written by whoever
        compiles.  ``compile_only``: compile, check that the kernel loads
        every program, write the cache's entry; attach and pin nothing
        (``compile_into``)."""
        self.flags = cflags(sizes, runq_threshold_ns, raw_tracepoints)
        self.build_key = build_key(self.flags)
        self.module: BccModule | None = None  # once compiled here
        self.uprobes = Uprobes(self._compiled, self._pin_link, None if uprobe_multi else False)
        self.hooks = kernelhooks.Attached()
        self._links: list[int] = []  # the kernel hooks' and sock_ops' links
        self.pinset: pinning.PinSet | None = None
        self.adopted = False
        self.compiled = False  # whether BCC compiled in this process
        self._cache_dir = cache_dir
        self._raw = raw_tracepoints
        about = {**(about or {}), "build_key": self.build_key}
        try:
            if compile_only:
                self.maps = self._compile_into_cache()
            else:
                self.maps = self._open(pins, about, sizes, runq_threshold_ns, compile_outside)
        except BaseException:
            self.close()
            raise
        self.sizes = RingSizes.of(self.maps)

    def _compile(self) -> BccModule:
        self.module = BccModule(text=bpf_source(), cflags=self.flags)
        self.layout = self.module.layout(self.flags)
        self.compiled = True
        return self.module

    def _compiled(self) -> BccModule:
        return self.module if self.module is not None else self._compile()

    def _pin_link(self, name: str, fd: int) -> None:
        if self.pinset is not None:
            self.pinset.pin_link(name, fd)

    def _compile_into_cache(self) -> MapSet:
        if self._cache_dir is None:
            raise ProbeError("compiling for the cache needs a cache folder")
        self._compile()
        entry = self._capture()
        self._check_loads(entry)
        try:
            compiled.save(self._cache_dir, entry)
        except OSError as exc:
            raise ProbeError(f"cannot write the compile cache {self._cache_dir}: {exc}") from None
        return self._bcc_maps()

    # ---- loading or adopting ---------------------------------------------

    def _open(
        self,
        pins: pinning.PinOptions | None,
        about: dict[str, Any],
        sizes: RingSizes,
        runq_threshold_ns: int,
        compile_outside: bool,
    ) -> MapSet:
        if pins is not None and self.uprobes.multi is not False:
            ready = pinning.adopt_built(pins, self.build_key)
            how = "pins of this very build: nothing compiled"
            if ready is None and compile_outside:
                # agents starting together compile once: the others wait,
                # then load what it kept
                with compiled.compiling(self._cache_dir, self.build_key):
                    maps = self._from_cache(pins, about)
                    if maps is not None:
                        return maps
                    from .loadrequest import load_outside

                    load_outside(
                        pins, sizes.nccl, runq_threshold_ns, about, self._cache_dir, self._raw
                    )
                ready = pinning.adopt_loaded(pins)
                how = "compiled by a loader process, which has exited"
            if ready is not None:
                return self._adopt(ready, how)
        self._compile()
        if pins is not None and self.uprobes.multi is not False and self._can_multi():
            opened = pinning.open_for_agent(pins, self.layout, about)
            if opened.adopted is not None:
                return self._adopt(opened.adopted)
            assert opened.building is not None
            return self._build(opened.building)
        if pins is not None:
            log.warning(
                "this kernel has no uprobe_multi links: the recording is not pinned "
                "(it ends with the agent)"
            )
        maps = self._bcc_maps()
        self._attach_kernel(None)
        return maps

    def _can_multi(self) -> bool:
        """Whether the return program loads for uprobe_multi links (6.6+)."""
        return self.uprobes.program(RETURN_PROGRAM) is not None

    def _bcc_maps(self) -> MapSet:
        module = self._compiled()
        maps = {
            name: BpfMap(spec, module.map_fd(name), owned=False)
            for name, spec in self.layout.maps.items()
        }
        return MapSet(self.layout, maps)

    def _build(self, building: pinning.Building) -> MapSet:
        """A fresh recording, pinned into a new folder renamed into place."""
        try:
            maps = self._bcc_maps()
            for name, m in maps.maps.items():
                building.pin_map(name, m.fd)
            for program in UPROBE_PROGRAMS:
                fd = self.uprobes.program(program)
                if fd is None:
                    raise ProbeError(f"cannot load uprobe program {program} for uprobe_multi links")
                building.pin_prog(program, fd)
            self._attach_kernel(building)
            self.pinset = building.finish()
        except BaseException:
            building.abandon()
            raise
        self.pinset.lock()
        log.info("recording pinned at %s (layout %s)", self.pinset.path, self.layout.fingerprint)
        self._keep_compiled()
        return maps

    # ---- the compile cache -------------------------------------------------

    def _check_loads(self, entry: compiled.Compiled) -> None:
        """Every program of ``entry`` loads (the kernel's verifier accepts
        it) with BCC's maps; nothing is attached, each program is closed."""
        module = self._compiled()
        fds = {n: module.map_fd(n) for n in entry.layout.maps}
        for prog in entry.programs:
            try:
                fd = bpfsys.prog_load(
                    prog.prog_type,
                    compiled.bind(prog, fds),
                    entry.license,
                    prog.name,
                    prog.attach_type,
                )
            except OSError as exc:
                raise ProbeError(f"the kernel refuses BPF program {prog.name}: {exc}") from None
            os.close(fd)

    def _keep_compiled(self) -> None:
        """What BCC compiled, kept for the next cold start (best effort)."""
        if self._cache_dir is None:
            return
        try:
            compiled.save(self._cache_dir, self._capture())
        except (OSError, ValueError) as exc:
            log.warning("compiled programs not kept in %s: %s", self._cache_dir, exc)
            return
        log.info("compiled programs kept in %s", compiled.path_for(self._cache_dir, self.build_key))

    def _capture(self) -> compiled.Compiled:
        module = self._compiled()
        names = {module.map_fd(n): n for n in self.layout.maps}
        maps = tuple(compiled.compiled_map(n, fd) for fd, n in names.items())
        kprobe = bpfsys.BPF_PROG_TYPE_KPROBE
        programs = [
            self._captured(p, kprobe, bpfsys.BPF_TRACE_UPROBE_MULTI, None, names)
            for p in UPROBE_PROGRAMS
        ]
        programs += [
            self._captured(h.program, h.prog_type, 0, h.cache_link, names)
            for h in self._kernel_hooks()
        ]
        sock_ops = bpfsys.BPF_PROG_TYPE_SOCK_OPS
        link = tcp_probes.SOCK_OPS_LINK
        programs.append(self._captured(tcp_probes.SOCK_OPS_PROGRAM, sock_ops, 0, link, names))
        return compiled.Compiled(
            self.build_key, module.license(), self.layout, maps, tuple(programs)
        )

    def _captured(
        self,
        name: str,
        prog_type: int,
        attach_type: int,
        link: tuple[str, str] | None,
        names: dict[int, str],
    ) -> compiled.CompiledProgram:
        insns, where = compiled.unbind(self._compiled().instructions(name), names)
        return compiled.CompiledProgram(name, prog_type, attach_type, insns, where, link)

    def _from_cache(self, pins: pinning.PinOptions, about: dict[str, Any]) -> MapSet | None:
        """Pins made from the compile cache's entry of this build, with no
        compiler anywhere; None (nothing left behind) if there is no entry
        or the kernel refuses it."""
        entry = compiled.load(self._cache_dir, self.build_key) if self._cache_dir else None
        if entry is None:
            return None
        opened = pinning.open_for_agent(pins, entry.layout, about)
        if opened.adopted is not None:
            return self._adopt(opened.adopted, "pins of the same layout: nothing compiled")
        assert opened.building is not None
        fds: dict[str, int] = {}
        try:
            self._load_entry(entry, opened.building, fds)
            self.pinset = opened.building.finish()
        except (OSError, PinError) as exc:
            opened.building.abandon()
            self._forget_entry(fds)
            log.warning("the compile cache's programs were not loaded (%s): compiling", exc)
            return None
        self.pinset.lock()
        self.layout, self.uprobes.multi, self.uprobes.own_progs = entry.layout, True, True
        log.info(
            "recording pinned at %s (layout %s), loaded from the compile cache %s: "
            "nothing compiled",
            self.pinset.path,
            entry.layout.fingerprint,
            compiled.path_for(self._cache_dir or Path(), self.build_key),
        )
        maps = {n: BpfMap(spec, fds[n], owned=True) for n, spec in entry.layout.maps.items()}
        return MapSet(entry.layout, maps)

    def _load_entry(
        self, entry: compiled.Compiled, building: pinning.Building, fds: dict[str, int]
    ) -> None:
        for m in entry.maps:
            fds[m.name] = bpfsys.map_create(
                m.type, m.key_size, m.value_size, m.max_entries, m.name, m.flags
            )
            building.pin_map(m.name, fds[m.name])
        for prog in entry.programs:
            code = compiled.bind(prog, fds)
            fd = bpfsys.prog_load(prog.prog_type, code, entry.license, prog.name, prog.attach_type)
            if prog.link is None:
                self.uprobes.progs[prog.name] = fd
                building.pin_prog(prog.name, fd)
                continue
            try:
                self._link_cached(prog, fd, building)
            finally:
                os.close(fd)  # the link holds the program

    def _link_cached(
        self, prog: compiled.CompiledProgram, fd: int, building: pinning.Building
    ) -> None:
        assert prog.link is not None
        if prog.link == tcp_probes.SOCK_OPS_LINK:
            self._link_sock_ops(fd, building)
            return
        hook = kernelhooks.hook_of_cache(prog.name, prog.link)
        if hook is None:
            raise PinError(f"compile cache: program {prog.name} has an unknown link {prog.link}")
        self._link_hook(hook, fd, building)

    def _forget_entry(self, fds: dict[str, int]) -> None:
        close_links(self._links)
        self._links = []
        for fd in [*fds.values(), *self.uprobes.progs.values()]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.uprobes.progs.clear()

    def _adopt(self, pinset: pinning.PinSet, how: str = "compiled here") -> MapSet:
        """Take over a pinned recording: its maps, programs and links."""
        self.pinset = pinset
        self.adopted = True
        self.uprobes.own_progs = True
        self.layout = pinset.layout
        maps = MapSet(pinset.layout, pinset.open_maps())
        for program in UPROBE_PROGRAMS:
            fd = pinset.prog_fd(program)
            if fd is None:
                raise PinError(f"{pinset.path}: program {program} is not pinned there")
            self.uprobes.progs[program] = fd
        self.uprobes.linked = pinset.links()
        self.hooks = kernelhooks.pinned(pinset.path, self.uprobes.linked)
        self.uprobes.multi = True
        if self.module is not None:  # the module's own maps and programs are not used
            self.module.drop_all()
            self.module = None
        log.info(
            "adopted the pinned recording at %s (made by stallwatch %s, pid %s, %d links; %s)",
            pinset.path,
            pinset.description.get("agent_version", "?"),
            pinset.description.get("agent_pid", "?"),
            len(self.uprobes.linked),
            how,
        )
        return maps

    # ---- kernel hooks --------------------------------------------------------

    def _kernel_hooks(self) -> list[Hook]:
        hooks = (kernelhooks.hook_of_function(f) for f in self._compiled().functions())
        return kernelhooks.in_order([h for h in hooks if h is not None])

    def _link_sock_ops(self, prog_fd: int, building: pinning.Building | None) -> None:
        link = tcp_probes.link_sock_ops(prog_fd)
        if link is None:
            return
        self._links.append(link)
        if building is not None:
            building.pin_link(pinning.cgroup_link_name(tcp_probes.SOCK_OPS_LINK[1]), link)

    def _link_hook(self, hook: Hook, prog_fd: int, building: pinning.Building | None) -> None:
        try:
            link = hook.attach(prog_fd)
        except OSError as exc:
            raise ProbeError(
                f"cannot attach {hook.attachment} program {hook.program} to {hook.event}: "
                f"{exc.strerror}"
            ) from exc
        self.hooks.add(hook, prog_fd)
        self._links.append(link)
        if building is not None:
            building.pin_link(hook.pin_name, link)

    def _attach_kernel(self, building: pinning.Building | None) -> None:
        module = self._compiled()
        sock_ops = module.load(tcp_probes.SOCK_OPS_PROGRAM, bpfsys.BPF_PROG_TYPE_SOCK_OPS)
        self._link_sock_ops(sock_ops, building)
        for hook in self._kernel_hooks():
            fd = module.load(hook.program, hook.prog_type)
            try:
                self._link_hook(hook, fd, building)
            except ProbeError as exc:
                cause = exc.__cause__
                old = hook.category and isinstance(cause, OSError) and unsupported(cause)
                if building is not None or not old:
                    raise
                # no perf-event links before 5.15: BCC's way, unpinned
                module.attach_tracepoint(hook.program, hook.category, hook.event)
                self.hooks.add(hook, fd)

    def kernel_misses(self) -> tuple[ProgramMisses, ...]:
        """Per kernel hook, its program, its attachment, and the runs the
        kernel skipped (``recorder.kernelhooks``)."""
        return self.hooks.misses()

    # ---- views -------------------------------------------------------------

    @property
    def ring_arrays(self) -> dict[str, Any]:
        return self.maps.ring_arrays

    @property
    def inflight(self) -> Any:
        return self.maps.inflight

    def head(self, ring: str) -> int:
        return self.maps.head(ring)

    # ---- uprobes -------------------------------------------------------------

    def attach_symbol(self, path: str, symbol: str) -> None:
        if symbol in CUDA_SYMBOLS:
            self.maps.maps["cuda_on"].update(0, 1)  # nccl.c queues calls on streams
            self.uprobes.attach_cuda(path, symbol)
        else:
            self.uprobes.attach_nccl(path, symbol)

    def attach_exit(self, libc: str) -> None:
        self.uprobes.attach_exit(libc)

    def attach_loader(self, ldso: str) -> None:
        self.uprobes.attach_loader(ldso)

    @property
    def perf_uprobe_fds(self) -> tuple[int, ...]:
        """The perf events of the fallback (none with uprobe_multi)."""
        return self.uprobes.perf_fds

    @property
    def attach_method(self) -> str:
        """How uprobes are (or will be) attached: "uprobe_multi" or "perf event"."""
        return "perf event" if self.uprobes.multi is False else "uprobe_multi"

    # ---- maps -----------------------------------------------------------

    def set_pid(self, map_name: str, pid: int, present: bool) -> None:
        self.maps.set_pid(map_name, pid, present)

    def set_agent_self(self, tgid: int, port: int) -> None:
        """Whose TCP rows the programs leave out: the agent's process and
        its listening port (0: none)."""
        self.maps.set_agent_self(tgid, port)

    def drops(self) -> dict[str, int]:
        return self.maps.drops()

    def cuda_seen(self) -> dict[str, int]:
        """The CUDA runtime calls the probes saw, and their answers."""
        return self.maps.cuda_seen()

    def close(self) -> None:
        """Detach everything at once: links (unpinned ones wait a grace
        period each, together) and perf-event uprobes (old kernels: those
        take ~0.1 s each, in turn).  A pinned recording stays as it is."""
        links, self._links = self._links + self.uprobes.take_links(), []
        close_links(links)
        maps = getattr(self, "maps", None)
        if maps is not None:
            maps.close()
        self.uprobes.close_programs()
        if self.pinset is not None:
            self.pinset.close()
        if self.module is not None:
            self.module.cleanup()


def compile_into(cache_dir: Path, sizes: RingSizes, runq_threshold_ns: int) -> tuple[Path, bool]:
    """The compile cache's entry of this build (these sizes and threshold,
    this kernel) at ``cache_dir``, and whether it was compiled now: an
    entry already there is kept (nothing compiled).  What an install or a
    boot runs once (``stallwatch record --compile-only``), so that an agent
    started with nothing pinned loads instead of compiling."""
    key = build_key(cflags(sizes, runq_threshold_ns))
    with compiled.compiling(cache_dir, key):
        if compiled.load(cache_dir, key) is not None:
            return compiled.path_for(cache_dir, key), False
        Probes(sizes, runq_threshold_ns, cache_dir=cache_dir, compile_only=True).close()
    return compiled.path_for(cache_dir, key), True

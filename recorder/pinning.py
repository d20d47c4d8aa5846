"""The recording pinned under bpffs, so that it outlives the agent.

One folder per agent instance (``--pin-dir``, default
``/sys/fs/bpf/stallwatch/agent``)::

    meta           an array map of two JSON documents: [0] what this pin set is
                   (the layout and its fingerprint, who made it, the agent's
                   settings), [1] the agent's own state (the watchdog's incidents)
    maps/<name>    every map of the BPF module (rings, tables, counters)
    progs/<name>   every program links are made from
    links/<name>   every attachment: rtp-<event> (raw tracepoints),
                   tp-<category>-<event> (tracepoints), cg-sock_ops,
                   up-<program>-<dev>-<inode>-<offset> (hexadecimal)

While the folder exists the kernel keeps every program attached and every
map alive: with no agent running, NCCL calls and kernel events are still
written into the rings.

- Creation: the folder is built as ``<name>-new-<pid>`` beside its final
  name and renamed into place once its maps, programs and tracepoint links
  are pinned, so a folder under the final name is always whole (an agent
  killed half-way leaves a ``-new-`` folder, which the next one removes).
  Uprobe links are pinned into the final folder as libraries are attached.
- Adoption: a starting agent that finds a folder whose layout fingerprint is
  its own takes over its maps and programs as they are (the kernel never
  stopped writing: no gap, and nothing recorded twice); links already pinned
  are not made again.  A folder of another layout is left in place and named
  in one line, unless the operator asks to replace it.
- Locks: an agent holds ``flock(LOCK_EX)`` on its folder for its whole life
  (the kernel drops it when the process dies, however it dies); creation and
  adoption run under a lock of the parent folder.
- Removal (``stallwatch record --cleanup``) unpins everything; the kernel
  detaches the probes and frees the maps once no process holds them.
- Watched: the agent holds every pinned object of its folder open (an fd
  each), checks the folder every second (``damage``) and pins again what was
  removed, or the whole folder if it was removed or replaced by an unlocked
  one (``restore``): the kernel never stops recording while the agent runs,
  and a later SIGKILL loses nothing.

bpffs names may not contain dots; pin names here never do.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stallwatch.dumpers.errors import PinError

from . import bpfsys
from .maps import BpfMap, Layout, MapSpec

PIN_ROOT = Path("/sys/fs/bpf/stallwatch")
DEFAULT_PIN_DIR = PIN_ROOT / "agent"
BPF_FS_MAGIC = 0xCAFE4A11
META_BYTES = 32768  # one JSON document
META_PIN = "meta"
META_DESCRIPTION, META_STATE = 0, 1
NEW_MARK = "-new-"
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


@dataclass(frozen=True, slots=True)
class PinOptions:
    path: Path = DEFAULT_PIN_DIR
    replace: bool = False  # replace a pin set this agent cannot adopt


def link_name(program: str, dev: int, inode: int, offset: int) -> str:
    return f"up-{program}-{dev:x}-{inode:x}-{offset:x}"


def tracepoint_link_name(category: str, event: str) -> str:
    return f"tp-{category}-{event}"


def cgroup_link_name(hook: str) -> str:
    return f"cg-{hook}"


def safe_name(text: str) -> str:
    return _UNSAFE.sub("_", text)


def is_bpffs(path: Path) -> bool:
    """Whether ``path`` (or its nearest existing parent) is on a BPF file system."""
    probe = path
    while not probe.exists():
        probe = probe.parent
    try:
        return _fs_magic(probe) == BPF_FS_MAGIC
    except OSError:
        return False


def _fs_magic(path: Path) -> int:
    import ctypes

    class StatFs(ctypes.Structure):
        _fields_ = [("f_type", ctypes.c_long), ("_rest", ctypes.c_byte * 112)]

    libc = ctypes.CDLL(None, use_errno=True)
    buf = StatFs()
    if libc.statfs(os.fsencode(str(path)), ctypes.byref(buf)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(path))
    return int(buf.f_type) & 0xFFFFFFFF


def check_pin_dir(path: Path) -> None:
    """One line for the person who ran the agent when pins cannot go there."""
    if not is_bpffs(path.parent if not path.exists() else path):
        raise PinError(
            f"--pin-dir {path}: not on a BPF file system (mount it: "
            "mount -t bpf bpf /sys/fs/bpf), or record without pinning (--no-pin)"
        )


@contextlib.contextmanager
def _locked(path: Path) -> Any:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class PinSet:
    """One instance's pinned recording, opened by this process."""

    def __init__(
        self, path: Path, meta_fd: int, description: dict[str, Any], read_only: bool = False
    ) -> None:
        self.path = path
        self.read_only = read_only
        self.meta_fd = meta_fd
        self.description = description
        self.layout = Layout.from_json(description["layout"])
        self._lock_fd: int | None = None
        self._held: dict[str, int] = {}  # "maps/<name>", ... -> an fd of ours on it
        self._identity: tuple[int, int] | None = None  # the folder locked: (dev, inode)

    # ---- opening ---------------------------------------------------------

    @classmethod
    def open(cls, path: Path, read_only: bool = False) -> PinSet:
        """The pin set at ``path``; PinError if there is none or it is unreadable."""
        meta = path / META_PIN
        try:
            fd = bpfsys.obj_get(meta, read_only=read_only)
        except FileNotFoundError:
            raise PinError(f"no pinned recording at {path}") from None
        except OSError as exc:
            raise PinError(f"cannot open the pinned recording at {path}: {exc.strerror}") from None
        try:
            description = _read_json(fd, META_DESCRIPTION)
            Layout.from_json(description["layout"])
        except (KeyError, TypeError, ValueError, OSError) as exc:
            os.close(fd)
            raise PinError(f"{meta}: not a stallwatch pin set ({exc})") from None
        return cls(path, fd, description, read_only)

    def lock(self) -> None:
        """Hold the folder for this agent's life; PinError if another holds it."""
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            who = self.description.get("agent_pid", "?")
            raise PinError(
                f"--pin-dir {self.path}: another agent (pid {who}) records into it; "
                "give this one its own --pin-dir"
            ) from None
        self._lock_fd = fd
        self._identity = _identity(self.path)
        self._hold()

    def _hold(self) -> None:
        """An fd on every pinned object of the folder: what ``restore``
        pins again, and what keeps every probe attached meanwhile."""
        for sub in _SUBFOLDERS:
            with contextlib.suppress(FileNotFoundError):
                for name in os.listdir(self.path / sub):
                    key = f"{sub}/{name}"
                    if key not in self._held:
                        with contextlib.suppress(OSError):
                            self._held[key] = bpfsys.obj_get(self.path / key)

    # ---- watched ----------------------------------------------------------

    def damage(self) -> str | None:
        """What happened to the folder since it was locked, or None."""
        if self._identity is None:
            return None  # not this agent's (read only)
        found = _identity(self.path)
        if found is None:
            return f"the pin folder {self.path} was removed"
        if found != self._identity:
            return f"the pin folder {self.path} was replaced"
        missing = [k for k in (META_PIN, *self._held) if not os.path.lexists(self.path / k)]
        if missing:
            shown = ", ".join(missing[:4]) + (", ..." if len(missing) > 4 else "")
            return f"{len(missing)} pins removed from {self.path} ({shown})"
        return None

    def restore(self) -> None:
        """Pin again what ``damage`` found missing: in place, or as a new
        folder renamed into place (a folder that replaced ours is removed
        first, unless an agent holds it).  PinError if it cannot."""
        found = _identity(self.path)
        if found is not None and found != self._identity:
            if _flocked(self.path):
                raise PinError(f"{self.path} was replaced by a pin folder another agent holds")
            remove(self.path)
            found = None
        try:
            if found is None:
                self._rebuild()
            else:
                for key, fd in [(META_PIN, self.meta_fd), *self._held.items()]:
                    if not os.path.lexists(self.path / key):
                        (self.path / key).parent.mkdir(exist_ok=True)
                        _pin(fd, self.path / key)
        except OSError as exc:
            raise PinError(f"cannot pin again at {self.path}: {exc.strerror or exc}") from None

    def _rebuild(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temp = self.path.with_name(f"{self.path.name}{NEW_MARK}{os.getpid()}")
        remove(temp)
        for sub in ("", *_SUBFOLDERS):
            (temp / sub).mkdir(exist_ok=True)
        for key, fd in [(META_PIN, self.meta_fd), *self._held.items()]:
            _pin(fd, temp / key)
        os.rename(temp, self.path)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
        self._lock_fd = None
        self.lock()

    def locked_by_other(self) -> bool:
        return _flocked(self.path)

    # ---- maps, programs, links --------------------------------------------

    def open_maps(self, read_only: bool = False) -> dict[str, BpfMap]:
        out: dict[str, BpfMap] = {}
        try:
            for name, spec in self.layout.maps.items():
                # a read-only fd cannot be mmapped at all: read_only maps PROT_READ
                fd = bpfsys.obj_get(self.path / "maps" / name)
                out[name] = BpfMap(spec, fd, owned=True, read_only=read_only)
        except OSError as exc:
            for m in out.values():
                m.close()
            raise PinError(f"{self.path}: map {name} cannot be opened: {exc.strerror}") from None
        return out

    def prog_fd(self, name: str) -> int | None:
        try:
            return bpfsys.obj_get(self.path / "progs" / name)
        except FileNotFoundError:
            return None

    def pin_prog(self, name: str, fd: int) -> None:
        _pin(fd, self.path / "progs" / name)

    def pin_link(self, name: str, fd: int) -> None:
        _pin(fd, self.path / "links" / name)
        if self._identity is not None and f"links/{name}" not in self._held:
            self._held[f"links/{name}"] = os.dup(fd)

    def links(self) -> set[str]:
        try:
            return set(os.listdir(self.path / "links"))
        except FileNotFoundError:
            return set()

    # ---- the agent's state -----------------------------------------------

    def load_state(self) -> dict[str, Any]:
        try:
            return _read_json(self.meta_fd, META_STATE)
        except (OSError, ValueError):
            return {}

    def save_state(self, state: dict[str, Any]) -> None:
        _write_json(self.meta_fd, META_STATE, state)

    def note_agent(self, pid: int, version: str, about: dict[str, Any]) -> None:
        """The agent now recording here, and its settings (for dump --pinned)."""
        self.description = {**self.description, **about, "agent_pid": pid, "agent_version": version}
        _write_json(self.meta_fd, META_DESCRIPTION, self.description)

    def close(self) -> None:
        for fd in (self.meta_fd, self._lock_fd, *self._held.values()):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._lock_fd = None
        self._held.clear()
        self._identity = None


_SUBFOLDERS = ("maps", "progs", "links")


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _pin(fd: int, path: Path) -> None:
    try:
        bpfsys.obj_pin(fd, path)
    except FileExistsError:
        return  # pinned by this pin set already
    except OSError as exc:
        raise PinError(f"cannot pin {path}: {exc.strerror}") from None


def _read_json(fd: int, index: int) -> dict[str, Any]:
    raw = bpfsys.map_lookup(fd, index.to_bytes(4, "little"), META_BYTES)
    if raw is None:
        raise ValueError("no entry")
    text = raw.split(b"\0", 1)[0]
    doc = json.loads(text) if text else {}
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    return doc


def _write_json(fd: int, index: int, doc: dict[str, Any]) -> None:
    data = json.dumps(doc, sort_keys=True).encode()
    if len(data) >= META_BYTES:
        raise PinError(f"pin set description of {len(data)} bytes does not fit {META_BYTES}")
    bpfsys.map_update(fd, index.to_bytes(4, "little"), data.ljust(META_BYTES, b"\0"))


# ---- creation, adoption, removal ---------------------------------------------


@dataclass
class Building:
    """A pin set being made in its ``-new-`` folder: pin into it, then ``finish``."""

    final: Path
    path: Path
    meta_fd: int
    description: dict[str, Any]
    pinned: list[str] = field(default_factory=list)

    def pin_map(self, name: str, fd: int) -> None:
        _pin(fd, self.path / "maps" / name)

    def pin_prog(self, name: str, fd: int) -> None:
        _pin(fd, self.path / "progs" / name)

    def pin_link(self, name: str, fd: int) -> None:
        _pin(fd, self.path / "links" / name)

    def finish(self) -> PinSet:
        os.rename(self.path, self.final)
        return PinSet(self.final, self.meta_fd, self.description)

    def abandon(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.meta_fd)
        remove(self.path)


def begin(final: Path, layout: Layout, about: dict[str, Any]) -> Building:
    """Start a new pin set for ``final``: its ``-new-`` folder and meta."""
    final.parent.mkdir(parents=True, exist_ok=True)
    path = final.with_name(f"{final.name}{NEW_MARK}{os.getpid()}")
    remove(path)
    for sub in ("", "maps", "progs", "links"):
        (path / sub).mkdir(exist_ok=True)
    description = {
        **about,
        "layout": layout.to_json(),
        "fingerprint": layout.fingerprint,
        "created_realtime_ns": time.time_ns(),
        "agent_pid": os.getpid(),
    }
    fd = bpfsys.map_create(bpfsys.BPF_MAP_TYPE_ARRAY, 4, META_BYTES, 2, "sw_meta")
    building = Building(final, path, fd, description)
    try:
        _write_json(fd, META_DESCRIPTION, description)
        _write_json(fd, META_STATE, {})
        _pin(fd, path / META_PIN)
    except (OSError, PinError):
        building.abandon()
        raise
    return building


@dataclass(frozen=True, slots=True)
class Opened:
    """What ``open_for_agent`` found: a pin set to adopt, or one to build."""

    adopted: PinSet | None
    building: Building | None


def open_for_agent(options: PinOptions, layout: Layout, about: dict[str, Any]) -> Opened:
    """Adopt the pin set at ``options.path`` if its layout is ``layout``; else
    begin a new one (after removing the old one only if ``options.replace``)."""
    final = options.path
    check_pin_dir(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    with _locked(final.parent):
        _remove_abandoned(final)
        if final.exists():
            found = _adoptable(final, layout, options.replace)
            if found is not None:
                found.lock()
                return Opened(found, None)
        building = begin(final, layout, about)
    return Opened(None, building)


def adopt_built(options: PinOptions, build_key: str) -> PinSet | None:
    """The pin set at ``options.path`` if it was made from this very build
    (``bpfbuild.build_key``): adopted, locked, with nothing compiled.  None
    if there is none or it is of another build (then the compiling path
    decides, and says what is wrong)."""
    final = options.path
    if not final.parent.is_dir():
        return None
    check_pin_dir(final)
    with _locked(final.parent):
        _remove_abandoned(final)
        if not final.exists():
            return None
        try:
            found = PinSet.open(final)
        except PinError:
            return None
        if found.description.get("build_key") != build_key:
            found.close()
            return None
        return _locked_for_agent(found)


def adopt_loaded(options: PinOptions) -> PinSet | None:
    """The pin set a loader process has just made or checked at
    ``options.path``, locked for this agent; None if it pinned nothing
    (a kernel without uprobe_multi links)."""
    final = options.path
    if not final.parent.is_dir():
        return None
    with _locked(final.parent):
        if not final.exists():
            return None
        return _locked_for_agent(PinSet.open(final))


def _locked_for_agent(found: PinSet) -> PinSet:
    try:
        found.lock()
    except PinError:
        found.close()
        raise
    return found


def _adoptable(final: Path, layout: Layout, replace: bool) -> PinSet | None:
    """The pin set to adopt, or None once a replaceable one was removed."""
    try:
        found = PinSet.open(final)
    except PinError as exc:
        if not replace:
            raise PinError(f"{exc}: left in place (--replace-pinned replaces it)") from None
        remove(final)
        return None
    if found.description.get("fingerprint") == layout.fingerprint:
        return found
    made_by = found.description.get("agent_version", "?")
    why = layout.difference(found.layout)
    if found.locked_by_other():
        found.close()
        raise PinError(f"--pin-dir {final}: another agent records into it; give this one its own")
    found.close()
    if not replace:
        raise PinError(
            f"pinned recording at {final} (made by stallwatch {made_by}) has another "
            f"layout ({why}): left in place; --replace-pinned replaces it (its recording "
            "is lost), stallwatch record --cleanup removes it"
        )
    remove(final)
    return None


def _remove_abandoned(final: Path) -> None:
    """``-new-`` folders of agents that died while creating theirs."""
    prefix = f"{final.name}{NEW_MARK}"
    for entry in os.listdir(final.parent):
        if not entry.startswith(prefix):
            continue
        pid = entry[len(prefix) :]
        if pid.isdigit() and not _alive(int(pid)):
            remove(final.parent / entry)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove(path: Path) -> bool:
    """Unpin everything under ``path`` and remove it; False if it was not there."""
    if not path.exists():
        return False
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(root, name))
        for name in dirs:
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(os.path.join(root, name))
    try:
        os.rmdir(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        if exc.errno == errno.ENOTEMPTY:  # pinned into while being removed
            return remove(path)
        raise
    return True


def cleanup(path: Path) -> bool:
    """``stallwatch record --cleanup``: remove a pin set no agent holds."""
    if not path.exists():
        return False
    if not is_bpffs(path):
        raise PinError(f"--pin-dir {path}: not on a BPF file system; nothing of ours is there")
    if _flocked(path):  # the lock needs no bpf(2): root without CAP_BPF can check it
        who = "?"
        with contextlib.suppress(PinError, OSError):
            found = PinSet.open(path, read_only=True)
            who = found.description.get("agent_pid", "?")
            found.close()
        raise PinError(f"--pin-dir {path}: an agent (pid {who}) records into it; stop it first")
    return remove(path)


def _flocked(path: Path) -> bool:
    """Whether a process holds the folder's lock (an agent recording into it)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def map_specs(description: dict[str, Any]) -> dict[str, MapSpec]:
    return Layout.from_json(description["layout"]).maps

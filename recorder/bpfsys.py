"""The few bpf(2) and perf_event_open(2) calls the agent makes itself.

BCC compiles and loads the programs; everything that must outlive the agent
or be read without BCC goes through here: pinning objects under bpffs and
opening them again, describing a map or a program (``BPF_OBJ_GET_INFO_BY_FD``),
map lookups, updates and iteration on a bare fd, links (uprobe_multi,
``BPF_PERF_EVENT`` links for tracepoints, so that a tracepoint attachment can
be pinned like a uprobe one, and raw tracepoints, whose attachment is a
link), run-time statistics of programs, and a ring buffer map as a doorbell
(``RingbufBell``).

Every call raises ``OSError`` with the kernel's errno.  x86-64 syscall
numbers (the agent is x86-64 only, as its argument decoding is).
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SYS_BPF = 321
SYS_PERF_EVENT_OPEN = 298

# enum bpf_cmd
BPF_MAP_CREATE = 0
BPF_MAP_LOOKUP_ELEM = 1
BPF_MAP_UPDATE_ELEM = 2
BPF_MAP_DELETE_ELEM = 3
BPF_MAP_GET_NEXT_KEY = 4
BPF_OBJ_PIN = 6
BPF_OBJ_GET = 7
BPF_PROG_GET_FD_BY_ID = 13
BPF_OBJ_GET_INFO_BY_FD = 15
BPF_RAW_TRACEPOINT_OPEN = 17
BPF_MAP_LOOKUP_BATCH = 24
BPF_LINK_CREATE = 28
BPF_ENABLE_STATS = 32

# enum bpf_prog_type
BPF_PROG_TYPE_KPROBE = 2  # uprobes too
BPF_PROG_TYPE_TRACEPOINT = 5
BPF_PROG_TYPE_SOCK_OPS = 13
BPF_PROG_TYPE_RAW_TRACEPOINT = 17

# enum bpf_attach_type
BPF_CGROUP_SOCK_OPS = 3
BPF_PERF_EVENT = 41
BPF_TRACE_UPROBE_MULTI = 48  # Linux 6.6+
BPF_F_UPROBE_MULTI_RETURN = 1

# map types and flags
BPF_MAP_TYPE_HASH = 1
BPF_MAP_TYPE_ARRAY = 2
BPF_MAP_TYPE_PERCPU_HASH = 5
BPF_MAP_TYPE_PERCPU_ARRAY = 6
BPF_MAP_TYPE_LRU_PERCPU_HASH = 10
BPF_MAP_TYPE_RINGBUF = 27
PERCPU_TYPES = frozenset({BPF_MAP_TYPE_PERCPU_HASH, BPF_MAP_TYPE_PERCPU_ARRAY, 10})
BPF_F_RDONLY = 1 << 3
BPF_ANY = 0
BPF_STATS_RUN_TIME = 0

PERF_TYPE_TRACEPOINT = 2
PERF_SAMPLE_RAW = 1 << 10
PERF_FLAG_FD_CLOEXEC = 1 << 3
PERF_EVENT_IOC_ENABLE = 0x2400
TRACEFS = Path("/sys/kernel/tracing")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _check(ret: int) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(ret)


def bpf(cmd: int, attr: ctypes.Structure) -> int:
    return _check(_libc.syscall(SYS_BPF, cmd, ctypes.byref(attr), ctypes.sizeof(attr)))


def _addr(buf: ctypes.Array[ctypes.c_char] | None) -> int:
    return ctypes.addressof(buf) if buf is not None else 0


# ---- objects under bpffs ---------------------------------------------------


class _ObjAttr(ctypes.Structure):
    _fields_ = [
        ("pathname", ctypes.c_uint64),
        ("bpf_fd", ctypes.c_uint32),
        ("file_flags", ctypes.c_uint32),
    ]


def obj_pin(fd: int, path: str | Path) -> None:
    """Pin the map, program or link ``fd`` at ``path`` (on a bpffs)."""
    name = ctypes.create_string_buffer(os.fsencode(str(path)))
    bpf(BPF_OBJ_PIN, _ObjAttr(pathname=_addr(name), bpf_fd=fd))


def obj_get(path: str | Path, read_only: bool = False) -> int:
    """A new fd on the object pinned at ``path``."""
    name = ctypes.create_string_buffer(os.fsencode(str(path)))
    flags = BPF_F_RDONLY if read_only else 0
    fd = bpf(BPF_OBJ_GET, _ObjAttr(pathname=_addr(name), file_flags=flags))
    _cloexec(fd)
    return fd


def _cloexec(fd: int) -> None:
    flags = fcntl.fcntl(fd, fcntl.F_GETFD)
    fcntl.fcntl(fd, fcntl.F_SETFD, flags | fcntl.FD_CLOEXEC)


# ---- describing objects ----------------------------------------------------


class _InfoAttr(ctypes.Structure):
    _fields_ = [
        ("bpf_fd", ctypes.c_uint32),
        ("info_len", ctypes.c_uint32),
        ("info", ctypes.c_uint64),
    ]


class _MapInfo(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("key_size", ctypes.c_uint32),
        ("value_size", ctypes.c_uint32),
        ("max_entries", ctypes.c_uint32),
        ("map_flags", ctypes.c_uint32),
        ("name", ctypes.c_char * 16),
        ("_rest", ctypes.c_uint8 * 48),
    ]


class _ProgInfo(ctypes.Structure):
    """``struct bpf_prog_info`` up to ``recursion_misses`` (the kernel fills
    what it has: 5.12 and later count the misses)."""

    _fields_ = [
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("tag", ctypes.c_uint8 * 8),
        ("jited_prog_len", ctypes.c_uint32),
        ("xlated_prog_len", ctypes.c_uint32),
        ("jited_prog_insns", ctypes.c_uint64),
        ("xlated_prog_insns", ctypes.c_uint64),
        ("load_time", ctypes.c_uint64),
        ("created_by_uid", ctypes.c_uint32),
        ("nr_map_ids", ctypes.c_uint32),
        ("map_ids", ctypes.c_uint64),
        ("name", ctypes.c_char * 16),
        ("ifindex", ctypes.c_uint32),
        ("gpl_compatible", ctypes.c_uint32),
        ("netns_dev", ctypes.c_uint64),
        ("netns_ino", ctypes.c_uint64),
        ("nr_jited_ksyms", ctypes.c_uint32),
        ("nr_jited_func_lens", ctypes.c_uint32),
        ("jited_ksyms", ctypes.c_uint64),
        ("jited_func_lens", ctypes.c_uint64),
        ("btf_id", ctypes.c_uint32),
        ("func_info_rec_size", ctypes.c_uint32),
        ("func_info", ctypes.c_uint64),
        ("nr_func_info", ctypes.c_uint32),
        ("nr_line_info", ctypes.c_uint32),
        ("line_info", ctypes.c_uint64),
        ("jited_line_info", ctypes.c_uint64),
        ("nr_jited_line_info", ctypes.c_uint32),
        ("line_info_rec_size", ctypes.c_uint32),
        ("jited_line_info_rec_size", ctypes.c_uint32),
        ("nr_prog_tags", ctypes.c_uint32),
        ("prog_tags", ctypes.c_uint64),
        ("run_time_ns", ctypes.c_uint64),
        ("run_cnt", ctypes.c_uint64),
        ("recursion_misses", ctypes.c_uint64),
    ]


class _LinkInfo(ctypes.Structure):
    """``struct bpf_link_info``: its type, id and program; the rest unread."""

    _fields_ = [
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("prog_id", ctypes.c_uint32),
        ("_rest", ctypes.c_uint8 * 68),
    ]


class _GetIdAttr(ctypes.Structure):
    _fields_ = [
        ("id", ctypes.c_uint32),
        ("next_id", ctypes.c_uint32),
        ("open_flags", ctypes.c_uint32),
    ]


@dataclass(frozen=True, slots=True)
class MapInfo:
    type: int
    id: int
    key_size: int
    value_size: int
    max_entries: int
    flags: int
    name: str


@dataclass(frozen=True, slots=True)
class ProgInfo:
    type: int
    id: int
    name: str
    run_time_ns: int  # while statistics are enabled (enable_stats)
    run_cnt: int
    # runs the kernel skipped (counted for tracepoints and raw tracepoints
    # since Linux 6.7; recorder.kernelhooks says when it means something)
    recursion_misses: int = 0


def _info(fd: int, info: ctypes.Structure) -> None:
    attr = _InfoAttr(bpf_fd=fd, info_len=ctypes.sizeof(info), info=ctypes.addressof(info))
    bpf(BPF_OBJ_GET_INFO_BY_FD, attr)


def map_info(fd: int) -> MapInfo:
    info = _MapInfo()
    _info(fd, info)
    return MapInfo(
        info.type,
        info.id,
        info.key_size,
        info.value_size,
        info.max_entries,
        info.map_flags,
        info.name.decode(errors="replace"),
    )


def prog_info(fd: int) -> ProgInfo:
    info = _ProgInfo()
    _info(fd, info)
    return ProgInfo(
        info.type,
        info.id,
        info.name.decode(errors="replace"),
        info.run_time_ns,
        info.run_cnt,
        info.recursion_misses,
    )


def link_prog_id(fd: int) -> int:
    """The id of the program a link (``fd``) holds."""
    info = _LinkInfo()
    _info(fd, info)
    return int(info.prog_id)


def prog_fd_by_id(prog_id: int) -> int:
    """A descriptor of the loaded program ``prog_id`` (OSError: gone)."""
    fd = bpf(BPF_PROG_GET_FD_BY_ID, _GetIdAttr(id=prog_id))
    _cloexec(fd)
    return fd


class _StatsAttr(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint32)]


def enable_stats() -> int:
    """Count every program's run time while the returned fd is open
    (``kernel.bpf_stats_enabled`` without touching the sysctl)."""
    return bpf(BPF_ENABLE_STATS, _StatsAttr(type=BPF_STATS_RUN_TIME))


# ---- maps -----------------------------------------------------------------


class _ElemAttr(ctypes.Structure):
    _fields_ = [
        ("map_fd", ctypes.c_uint32),
        ("_pad", ctypes.c_uint32),
        ("key", ctypes.c_uint64),
        ("value", ctypes.c_uint64),  # next_key for GET_NEXT_KEY
        ("flags", ctypes.c_uint64),
    ]


class _CreateAttr(ctypes.Structure):
    _fields_ = [
        ("map_type", ctypes.c_uint32),
        ("key_size", ctypes.c_uint32),
        ("value_size", ctypes.c_uint32),
        ("max_entries", ctypes.c_uint32),
        ("map_flags", ctypes.c_uint32),
        ("inner_map_fd", ctypes.c_uint32),
        ("numa_node", ctypes.c_uint32),
        ("map_name", ctypes.c_char * 16),
    ]


def map_create(
    map_type: int, key_size: int, value_size: int, max_entries: int, name: str, flags: int = 0
) -> int:
    attr = _CreateAttr(
        map_type=map_type,
        key_size=key_size,
        value_size=value_size,
        max_entries=max_entries,
        map_flags=flags,
        map_name=name.encode()[:15],
    )
    fd = bpf(BPF_MAP_CREATE, attr)
    _cloexec(fd)
    return fd


class _ProgLoadAttr(ctypes.Structure):
    _fields_ = [
        ("prog_type", ctypes.c_uint32),
        ("insn_cnt", ctypes.c_uint32),
        ("insns", ctypes.c_uint64),
        ("license", ctypes.c_uint64),
        ("log_level", ctypes.c_uint32),
        ("log_size", ctypes.c_uint32),
        ("log_buf", ctypes.c_uint64),
        ("kern_version", ctypes.c_uint32),
        ("prog_flags", ctypes.c_uint32),
        ("prog_name", ctypes.c_char * 16),
        ("prog_ifindex", ctypes.c_uint32),
        ("expected_attach_type", ctypes.c_uint32),
    ]


BPF_PROG_LOAD = 5
PROG_LOG_BYTES = 1 << 20


def prog_load(
    prog_type: int, insns: bytes, license: str, name: str, expected_attach_type: int = 0
) -> int:
    """Load a program; OSError with the verifier's last lines on refusal."""
    code = ctypes.create_string_buffer(insns, len(insns))
    lic = ctypes.create_string_buffer(license.encode())
    attr = _ProgLoadAttr(
        prog_type=prog_type,
        insn_cnt=len(insns) // 8,
        insns=_addr(code),
        license=_addr(lic),
        prog_name=name.encode()[:15],
        expected_attach_type=expected_attach_type,
    )
    try:
        fd = bpf(BPF_PROG_LOAD, attr)
    except OSError:
        log = ctypes.create_string_buffer(PROG_LOG_BYTES)
        attr.log_level, attr.log_size, attr.log_buf = 1, PROG_LOG_BYTES, _addr(log)
        try:
            fd = bpf(BPF_PROG_LOAD, attr)
        except OSError as exc:
            tail = log.value.decode(errors="replace").strip().splitlines()[-3:]
            raise OSError(exc.errno, f"{exc.strerror}: {' | '.join(tail)}") from None
    _cloexec(fd)
    return fd


def possible_cpus() -> int:
    """Per-CPU map values hold one slot per possible CPU."""
    text = Path("/sys/devices/system/cpu/possible").read_text().strip()
    count = 0
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        count += int(hi or lo) - int(lo) + 1
    return count


def value_bytes(info: MapInfo) -> int:
    """Bytes a lookup of one element writes (per-CPU maps: one 8-aligned slot per CPU)."""
    if info.type in PERCPU_TYPES:
        return ((info.value_size + 7) & ~7) * possible_cpus()
    return info.value_size


def map_lookup(fd: int, key: bytes, size: int) -> bytes | None:
    """The value of ``key`` (``size`` bytes, see ``value_bytes``), None if absent."""
    kbuf = ctypes.create_string_buffer(key, len(key))
    vbuf = ctypes.create_string_buffer(size)
    attr = _ElemAttr(map_fd=fd, key=_addr(kbuf), value=_addr(vbuf))
    try:
        bpf(BPF_MAP_LOOKUP_ELEM, attr)
    except FileNotFoundError:
        return None
    return vbuf.raw


def map_update(fd: int, key: bytes, value: bytes) -> None:
    kbuf = ctypes.create_string_buffer(key, len(key))
    vbuf = ctypes.create_string_buffer(value, len(value))
    bpf(
        BPF_MAP_UPDATE_ELEM, _ElemAttr(map_fd=fd, key=_addr(kbuf), value=_addr(vbuf), flags=BPF_ANY)
    )


def map_delete(fd: int, key: bytes) -> bool:
    """False when the key was not there."""
    kbuf = ctypes.create_string_buffer(key, len(key))
    try:
        bpf(BPF_MAP_DELETE_ELEM, _ElemAttr(map_fd=fd, key=_addr(kbuf)))
    except FileNotFoundError:
        return False
    return True


def map_keys(fd: int, key_size: int) -> Iterator[bytes]:
    """Every key of a hash map (each at most once, in the kernel's order)."""
    cur = None
    nxt = ctypes.create_string_buffer(key_size)
    while True:
        attr = _ElemAttr(map_fd=fd, key=_addr(cur), value=_addr(nxt))
        try:
            bpf(BPF_MAP_GET_NEXT_KEY, attr)
        except FileNotFoundError:
            return
        key = nxt.raw
        yield key
        cur = ctypes.create_string_buffer(key, key_size)


class _BatchAttr(ctypes.Structure):
    _fields_ = [
        ("in_batch", ctypes.c_uint64),
        ("out_batch", ctypes.c_uint64),
        ("keys", ctypes.c_uint64),
        ("values", ctypes.c_uint64),
        ("count", ctypes.c_uint32),
        ("map_fd", ctypes.c_uint32),
        ("elem_flags", ctypes.c_uint64),
        ("flags", ctypes.c_uint64),
    ]


class BatchReader:
    """Every (key, value) of a hash map in a syscall or two
    (``BPF_MAP_LOOKUP_BATCH``, Linux 5.6+), into buffers allocated once."""

    def __init__(self, fd: int, key_size: int, value_size: int, max_entries: int) -> None:
        self.fd = fd
        self.key_size, self.value_size = key_size, value_size
        self.max_entries = max_entries
        self.keys = ctypes.create_string_buffer(key_size * max_entries)
        self.values = ctypes.create_string_buffer(value_size * max_entries)
        self._tokens = (ctypes.c_uint32 * 2)()  # the hash map's bucket cursor

    def read(self) -> tuple[bytes, bytes]:
        """(keys, values), each ``n * size`` bytes; OSError if the kernel
        has no batch lookup for this map."""
        n = 0
        first = True
        while n < self.max_entries:
            attr = _BatchAttr(
                in_batch=0 if first else ctypes.addressof(self._tokens),
                out_batch=ctypes.addressof(self._tokens) + 4,
                keys=ctypes.addressof(self.keys) + n * self.key_size,
                values=ctypes.addressof(self.values) + n * self.value_size,
                count=self.max_entries - n,
                map_fd=self.fd,
            )
            try:
                bpf(BPF_MAP_LOOKUP_BATCH, attr)
            except FileNotFoundError:  # the last batch: count says how many came
                n += attr.count
                break
            n += attr.count
            self._tokens[0] = self._tokens[1]
            first = False
        keys = ctypes.string_at(self.keys, n * self.key_size)
        return keys, ctypes.string_at(self.values, n * self.value_size)


# ---- links ----------------------------------------------------------------


class _UprobeMultiAttr(ctypes.Structure):
    """``union bpf_attr``, ``link_create`` with its ``uprobe_multi`` member."""

    _fields_ = [
        ("prog_fd", ctypes.c_uint32),
        ("target_fd", ctypes.c_uint32),
        ("attach_type", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("path", ctypes.c_uint64),
        ("offsets", ctypes.c_uint64),
        ("ref_ctr_offsets", ctypes.c_uint64),
        ("cookies", ctypes.c_uint64),
        ("cnt", ctypes.c_uint32),
        ("multi_flags", ctypes.c_uint32),
        ("pid", ctypes.c_uint32),
        ("_pad", ctypes.c_uint32),
    ]


def uprobe_multi_link(
    prog_fd: int, path: str, offsets: list[int], cookies: list[int], ret: bool
) -> int:
    """A uprobe_multi link of ``prog_fd`` on ``offsets`` (file offsets) of
    ``path`` in every process (a uretprobe if ``ret``); returns its fd."""
    n = len(offsets)
    c_path = ctypes.create_string_buffer(os.fsencode(path))
    c_offsets = (ctypes.c_uint64 * n)(*offsets)
    c_cookies = (ctypes.c_uint64 * n)(*cookies)
    attr = _UprobeMultiAttr(
        prog_fd=prog_fd,
        attach_type=BPF_TRACE_UPROBE_MULTI,
        path=ctypes.addressof(c_path),
        offsets=ctypes.addressof(c_offsets),
        cookies=ctypes.addressof(c_cookies),
        cnt=n,
        multi_flags=BPF_F_UPROBE_MULTI_RETURN if ret else 0,
    )
    fd = bpf(BPF_LINK_CREATE, attr)
    _cloexec(fd)
    return fd


class _PerfLinkAttr(ctypes.Structure):
    _fields_ = [
        ("prog_fd", ctypes.c_uint32),
        ("target_fd", ctypes.c_uint32),
        ("attach_type", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("bpf_cookie", ctypes.c_uint64),
        ("_pad", ctypes.c_uint64 * 4),
    ]


class _PerfEventAttr(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_uint32),
        ("size", ctypes.c_uint32),
        ("config", ctypes.c_uint64),
        ("sample_period", ctypes.c_uint64),
        ("sample_type", ctypes.c_uint64),
        ("read_format", ctypes.c_uint64),
        ("flags", ctypes.c_uint64),
        ("wakeup_events", ctypes.c_uint32),
        ("bp_type", ctypes.c_uint32),
        ("config1", ctypes.c_uint64),
        ("config2", ctypes.c_uint64),
        ("_rest", ctypes.c_uint8 * 56),
    ]


def tracepoint_id(category: str, event: str) -> int:
    path = TRACEFS / "events" / category / event / "id"
    try:
        return int(path.read_text())
    except (OSError, ValueError) as exc:
        raise OSError(
            getattr(exc, "errno", 2) or 2, f"tracepoint {category}:{event}: {exc}"
        ) from exc


def tracepoint_link(prog_fd: int, category: str, event: str) -> int:
    """Attach a tracepoint program through a ``BPF_PERF_EVENT`` link: the
    link holds the perf event, so pinning the link keeps the attachment."""
    attr = _PerfEventAttr(
        type=PERF_TYPE_TRACEPOINT,
        size=ctypes.sizeof(_PerfEventAttr),
        config=tracepoint_id(category, event),
        sample_period=1,
        sample_type=PERF_SAMPLE_RAW,
        wakeup_events=1,
    )
    pfd = _check(
        _libc.syscall(SYS_PERF_EVENT_OPEN, ctypes.byref(attr), -1, 0, -1, PERF_FLAG_FD_CLOEXEC)
    )
    try:
        link = bpf(
            BPF_LINK_CREATE,
            _PerfLinkAttr(prog_fd=prog_fd, target_fd=pfd, attach_type=BPF_PERF_EVENT),
        )
        _cloexec(link)
        fcntl.ioctl(pfd, PERF_EVENT_IOC_ENABLE, 0)
    finally:
        os.close(pfd)  # the link keeps the event
    return link


class _RawTracepointAttr(ctypes.Structure):
    _fields_ = [("name", ctypes.c_uint64), ("prog_fd", ctypes.c_uint32), ("_pad", ctypes.c_uint32)]


def raw_tracepoint_open(prog_fd: int, event: str) -> int:
    """Attach a raw tracepoint program to tracepoint ``event`` (no
    category: raw tracepoints are named by event alone); the returned fd is
    a link, which pinning keeps."""
    name = ctypes.create_string_buffer(event.encode())
    fd = bpf(BPF_RAW_TRACEPOINT_OPEN, _RawTracepointAttr(name=_addr(name), prog_fd=prog_fd))
    _cloexec(fd)
    return fd


def cgroup_link(prog_fd: int, cgroup: str | Path, attach_type: int) -> int:
    """Attach a cgroup program (sock_ops) to the cgroup v2 folder
    ``cgroup`` through a link: every socket of the cgroup and of the cgroups
    below it; pinning the link keeps the attachment."""
    cg = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        link = bpf(
            BPF_LINK_CREATE,
            _PerfLinkAttr(prog_fd=prog_fd, target_fd=cg, attach_type=attach_type),
        )
    finally:
        os.close(cg)  # the link holds the cgroup
    _cloexec(link)
    return link


class RingbufBell:
    """A BPF ring buffer used as a doorbell: poll(2) on its fd says a
    program wrote a record since the last ``clear``, which skips them all
    unread (their content is of no interest).  The consumer position lies
    in the first page of the map's mmap (the one user space may write), the
    producer's in the second."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        page = mmap.PAGESIZE
        self._consumer = mmap.mmap(fd, page, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            self._producer = mmap.mmap(fd, page, mmap.MAP_SHARED, mmap.PROT_READ, offset=page)
        except BaseException:
            self._consumer.close()
            raise

    def clear(self) -> None:
        (produced,) = struct.unpack_from("<Q", self._producer, 0)
        struct.pack_into("<Q", self._consumer, 0, produced)

    def close(self) -> None:
        self._consumer.close()
        self._producer.close()

"""The running kernel's struct offsets and tracepoint prototypes, read from
its BTF in user space: a blob made here (members inside anonymous structs
and unions, a bit field, a tracepoint's prototype) and this machine's own
``/sys/kernel/btf/vmlinux``."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from stallwatch.recorder import btf, sched_probes, tcp_probes
from stallwatch.recorder.btf import BtfError, KernelTypes, Member


class Blob:
    """A BTF blob, type by type (ids from 1)."""

    def __init__(self) -> None:
        self.types = b""
        self.strings = b"\0"
        self.count = 0

    def name(self, text: str) -> int:
        if not text:
            return 0
        at = len(self.strings)
        self.strings += text.encode() + b"\0"
        return at

    def add(self, name: str, kind: int, vlen: int, size_or_type: int, extra: bytes = b"",
            kind_flag: int = 0) -> int:  # fmt: skip
        info = (kind_flag << 31) | (kind << 24) | vlen
        self.types += struct.pack("<III", self.name(name), info, size_or_type) + extra
        self.count += 1
        return self.count

    def int_(self, name: str, size: int) -> int:
        return self.add(name, btf.INT, 0, size, struct.pack("<I", size * 8))

    def struct_(self, name: str, size: int, members: list[tuple[str, int, int]],
                kind: int = btf.STRUCT, bitfields: bool = False) -> int:  # fmt: skip
        extra = b"".join(struct.pack("<III", self.name(n), t, off) for n, t, off in members)
        return self.add(name, kind, len(members), size, extra, int(bitfields))

    def bytes(self) -> bytes:
        header = struct.pack(
            "<HBBIIIII", btf.MAGIC, 1, 0, 24, 0, len(self.types), len(self.types),
            len(self.strings),
        )  # fmt: skip
        return header + self.types + self.strings


def sample() -> bytes:
    """struct outer { int a; union { struct { short b; char c; }; long d; };
    unsigned flags:3; struct outer *next; }; and a tracepoint
    void btf_trace_thing(void *, struct outer *, int)."""
    b = Blob()
    i32 = b.int_("int", 4)
    i16 = b.int_("short", 2)
    i8 = b.int_("char", 1)
    i64 = b.int_("long", 8)
    inner = b.struct_("", 4, [("b", i16, 0), ("c", i8, 16)])
    union = b.struct_("", 8, [("", inner, 0), ("d", i64, 0)], kind=btf.UNION)
    outer_ptr = b.add("", btf.PTR, 0, 8)  # -> outer, id 8
    outer = b.struct_(
        "outer", 32,
        [("a", i32, 0), ("", union, 64), ("flags", i32, (3 << 24) | 128), ("next", outer_ptr, 192)],
        bitfields=True,
    )  # fmt: skip
    assert outer == 8
    void_ptr = b.add("", btf.PTR, 0, 0)
    params = struct.pack("<IIIIII", 0, void_ptr, b.name("p"), outer_ptr, b.name("n"), i32)
    proto = b.add("", btf.FUNC_PROTO, 3, 0, params)
    b.add("btf_trace_thing", btf.TYPEDEF, 0, b.add("", btf.PTR, 0, proto))
    return b.bytes()


def test_members_are_found_through_anonymous_structs_and_unions() -> None:
    types = KernelTypes(sample())
    assert types.member("outer", "a") == Member(0, 4)
    assert types.member("outer", "b") == Member(8, 2)  # union at 8, its struct's first
    assert types.member("outer", "c") == Member(10, 1)
    assert types.member("outer", "d") == Member(8, 8)
    assert types.member("outer", "next") == Member(24, 8)


def test_a_bit_field_or_a_missing_member_is_refused_by_name() -> None:
    types = KernelTypes(sample())
    with pytest.raises(BtfError, match="outer's member flags is a bit field"):
        types.member("outer", "flags")
    with pytest.raises(BtfError, match="struct outer has no member e"):
        types.member("outer", "e")
    with pytest.raises(BtfError, match="has no struct inner"):
        types.member("inner", "b")


def test_a_tracepoints_arguments_are_its_prototype_after_the_private_data() -> None:
    types = KernelTypes(sample())
    assert types.tracepoint_args("thing") == ("struct outer *", "int")
    with pytest.raises(BtfError, match="typedef btf_trace_other"):
        types.tracepoint_args("other")


def test_damaged_blobs_are_refused() -> None:
    good = sample()
    with pytest.raises(BtfError, match="magic"):
        KernelTypes(b"\x00\x00" + good[2:])
    with pytest.raises(BtfError, match="past"):
        KernelTypes(good[:-5])
    with pytest.raises(BtfError, match="shorter than its header"):
        KernelTypes(good[:10])
    with pytest.raises(BtfError, match="cannot read the kernel's BTF"):
        KernelTypes.load(Path("/nonexistent/vmlinux"))


@pytest.mark.skipif(not btf.VMLINUX.exists(), reason="a kernel without BTF")
def test_the_running_kernels_structs_and_tracepoints() -> None:
    """What the raw tracepoints read, on this kernel: the socket's common
    part is at its start (one read covers family, state and the far end),
    a tracepoint's arguments are as the TCP programs expect."""
    types = KernelTypes.load()
    family = types.member("sock", "__sk_common.skc_family")
    assert family == types.member("sock_common", "skc_family") and family.size == 2
    assert types.member("inet_sock", "sk").offset == 0
    assert types.member("task_struct", "pid").size == 4
    args = types.tracepoint_args("tcp_retransmit_skb")
    assert args[:2] == ("struct sock *", "struct sk_buff *")
    assert types.tracepoint_args("sched_switch")[:3] == (
        "bool", "struct task_struct *", "struct task_struct *",
    )  # fmt: skip


@pytest.mark.skipif(not btf.VMLINUX.exists(), reason="a kernel without BTF")
def test_the_tcp_and_scheduler_families_compile_for_raw_tracepoints_here() -> None:
    types = KernelTypes.load()
    tcp = dict(f.removeprefix("-D").split("=") for f in tcp_probes.cflags(types))
    assert tcp["TCP_RAW_TP"] == "1"
    for span, fields in tcp_probes.SPANS.items():  # every field of a span inside it
        start, length = int(tcp[f"{span}_OFF"]), int(tcp[f"{span}_LEN"])
        assert 0 < length <= tcp_probes.SPAN_MAX
        assert all(start <= int(tcp[f]) < start + length for f in fields)
    sched = dict(f.removeprefix("-D").split("=") for f in sched_probes.cflags(types))
    assert sched["SCHED_RAW_TP"] == "1" and int(sched["TASK_PID_OFF"]) > 0


def test_a_kernel_whose_btf_lacks_a_field_gets_tracepoints(
    caplog: pytest.LogCaptureFixture,
) -> None:
    types = KernelTypes(sample())  # no struct sock, no task_struct
    assert tcp_probes.cflags(types) == tcp_probes.tracepoint_flags()
    assert sched_probes.cflags(types) == []
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "TCP events from tracepoints" in said and "scheduler events from tracepoints" in said

"""One layout on both sides of C and numpy: bpf/events.h is generated from
dumpers.layout and is what it generates (a stale copy is found); the C
compiler lays out its structs (the header, every struct a ring holds) as the
numpy dtypes of dumpers.schema and recorder.maps say, on every size and field
offset, and a drift on either side is found (checked on mutated copies); the
ring indices and heads match recorder.maps, and the kernel's folds match
Python's."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from stallwatch.dumpers import layout, schema
from stallwatch.recorder import maps

ROOT = Path(__file__).resolve().parents[2]
HEADER_FIELDS_IN_ORDER = ("pos", "ts_ns", "kind", "size", "pid", "tid", "_pad0")
HEADER_FIELDS = set(HEADER_FIELDS_IN_ORDER)
# Every struct the rings hold, and the header alone: bpf/events.h on one side,
# the numpy dtypes of dumpers.schema and recorder.maps (the discovery ring)
# on the other.
STRUCTS = {
    "event_header": np.dtype(
        [(n, schema.NCCL_EVENT.fields[n][0]) for n in schema.NCCL_EVENT.names[:7]]
    ),
    "nccl_event": schema.NCCL_EVENT,
    "comm_event": schema.COMM_EVENT,
    "tcp_event": schema.TCP_EVENT,
    "sched_event": schema.SCHED_EVENT,
    "exit_event": schema.EXIT_EVENT,
    "link_event": schema.LINK_EVENT,
    "disc_event": maps.DISCOVERY_EVENT,
}
Layout = dict[tuple[str, str], tuple[int, int]]


def _c_member(struct: str, field: str) -> str:
    return f"hdr.{field}" if field in HEADER_FIELDS and struct != "event_header" else field


def _program(structs: dict[str, np.dtype]) -> str:
    lines = [
        "#include <stddef.h>",
        "#include <stdio.h>",
        "#include <linux/types.h>",
        '#include "events.h"',
        "int main(void) {",
    ]
    for struct, dtype in structs.items():
        lines.append(f'printf("{struct} SIZE %zu 0\\n", sizeof(struct {struct}));')
        for name in dtype.names:
            m = _c_member(struct, name)
            lines.append(
                f'printf("{struct} {name} %zu %zu\\n", offsetof(struct {struct}, {m}), '
                f"sizeof(((struct {struct} *)0)->{m}));"
            )
    lines += ["return 0;", "}"]
    return "\n".join(lines)


def compile_layout(include: Path, structs: dict[str, np.dtype], work: Path) -> Layout:
    """Sizes and field offsets of ``structs`` as the C compiler lays them out
    from ``include``/events.h (a field the header lacks fails the compile)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.fail("a C compiler is needed to check bpf/events.h")
    (work / "layout.c").write_text(_program(structs))
    subprocess.run(
        [cc, "-I", str(include), "-o", str(work / "layout"), str(work / "layout.c")],
        check=True,
        capture_output=True,
    )
    out = subprocess.run([str(work / "layout")], check=True, capture_output=True, text=True)
    layout = {}
    for line in out.stdout.splitlines():
        struct, name, offset, size = line.split()
        layout[(struct, name)] = (int(offset), int(size))
    return layout


def mismatches(layout: Layout, structs: dict[str, np.dtype]) -> list[str]:
    """Where the dtypes and the C structs differ: sizes, field offsets, field sizes."""
    found = []
    for struct, dtype in structs.items():
        if layout[(struct, "SIZE")][0] != dtype.itemsize:
            found.append(f"{struct}: C {layout[(struct, 'SIZE')][0]} bytes, numpy {dtype.itemsize}")
        for name in dtype.names:
            field_dtype, offset = dtype.fields[name][:2]
            if layout[(struct, name)] != (offset, field_dtype.itemsize):
                c_off, c_size = layout[(struct, name)]
                found.append(
                    f"{struct}.{name}: C at {c_off} ({c_size} bytes), "
                    f"numpy at {offset} ({field_dtype.itemsize} bytes)"
                )
    return found


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory: pytest.TempPathFactory) -> Layout:
    return compile_layout(ROOT / "bpf", STRUCTS, tmp_path_factory.mktemp("schema"))


def test_c_structs_and_numpy_dtypes_agree(c_layout: Layout) -> None:
    assert mismatches(c_layout, STRUCTS) == []


def test_the_header_is_what_the_layout_generates(tmp_path: Path) -> None:
    assert not layout.stale(), "bpf/events.h is stale: python -m stallwatch.dumpers.layout --write"
    copy = tmp_path / "events.h"
    copy.write_text(layout.header_text().replace("__u32 cpu;", "__u64 cpu;"))
    assert layout.stale(copy)
    assert layout.main(["--check"]) == 0


def test_the_header_pins_every_size_and_offset() -> None:
    text = (ROOT / "bpf" / "events.h").read_text()
    for struct in layout.STRUCTS:
        assert f"sizeof(struct {struct.name}) == {struct.dtype.itemsize}" in text
        for f in struct.fields:
            offset = layout.offset(struct, f.name)
            assert f"__builtin_offsetof(struct {struct.name}, {f.name}) == {offset}" in text


def test_a_struct_changed_in_c_alone_is_found(tmp_path: Path) -> None:
    """Drift on the C side: a copy of events.h whose sched_event widens cpu
    (its static assertions taken out, as a hand edit would)."""
    header = (ROOT / "bpf" / "events.h").read_text()
    drifted = header.replace("\t__u32 cpu;", "\t__u64 cpu;")
    assert drifted != header
    unpinned = "\n".join(
        line for line in drifted.splitlines() if not line.startswith("_Static_assert")
    )
    (tmp_path / "events.h").write_text(unpinned)
    found = mismatches(compile_layout(tmp_path, STRUCTS, tmp_path), STRUCTS)
    assert found == [
        "sched_event: C 56 bytes, numpy 48",
        "sched_event.cpu: C at 40 (8 bytes), numpy at 40 (4 bytes)",
        "sched_event.prev_pid: C at 48 (4 bytes), numpy at 44 (4 bytes)",
    ]


def test_a_dtype_changed_in_numpy_alone_is_found(c_layout: Layout) -> None:
    """Drift on the numpy side: the header's pid and tid swapped in a copy."""
    names = list(schema.TCP_EVENT.names)
    i, j = names.index("pid"), names.index("tid")
    names[i], names[j] = names[j], names[i]
    drifted = np.dtype([(n, schema.TCP_EVENT.fields[n][0]) for n in names])
    found = mismatches(c_layout, {**STRUCTS, "tcp_event": drifted})
    assert sorted(found) == [
        "tcp_event.pid: C at 20 (4 bytes), numpy at 24 (4 bytes)",
        "tcp_event.tid: C at 24 (4 bytes), numpy at 20 (4 bytes)",
    ]


def _defines(path: Path, prefix: str) -> dict[str, int]:
    found = re.findall(rf"^#define ({prefix}\w+) (\d+)", path.read_text(), re.M)
    return {name: int(value) for name, value in found}


def test_ring_indices_and_heads_agree() -> None:
    """bpf/events.h's ring indices and common.h's struct ring_head against recorder.maps."""
    common = (ROOT / "bpf" / "common.h").read_text()
    sources = common + "".join(p.read_text() for p in (ROOT / "bpf").glob("*.c"))
    rings = _defines(ROOT / "bpf" / "events.h", "RING_")
    for ring, (index, map_name, slots_flag) in maps.RING_MAPS.items():
        assert rings[f"RING_{ring.upper()}"] == index, ring
        assert f"#define {slots_flag} " in common, slots_flag
        assert re.search(rf"\b{map_name}\b", sources), map_name
    assert rings["RING_DISC"] == maps.DISCOVERY_HEAD
    head = re.search(r"struct ring_head \{\s*__u64 head;\s*__u64 _pad\[(\d+)\];\s*\};", common)
    assert head is not None, "struct ring_head is no longer a head and its padding"
    assert 1 + int(head.group(1)) == maps.HEAD_STRIDE_U64
    assert rings["RING_HEADS"] * maps.HEAD_STRIDE_U64 * 8 == 64 * (maps.DISCOVERY_HEAD + 1)
    disc = _defines(ROOT / "bpf" / "events.h", "DISC_")
    assert disc == {"DISC_EXEC": maps.DISC_EXEC, "DISC_LINKMAP": maps.DISC_LINKMAP}
    drops = _defines(ROOT / "bpf" / "events.h", "DROP_")
    assert drops.pop("DROP_SLOTS") == len(maps.DROP_NAMES)
    assert sorted(drops.values()) == list(range(len(layout.RINGS), len(maps.DROP_NAMES)))


def test_dtypes_cover_every_byte() -> None:
    for struct, dtype in STRUCTS.items():
        covered = sum(dtype.fields[n][0].itemsize for n in dtype.names)
        assert covered == dtype.itemsize, f"{struct} has implicit padding"


def test_ring_records_are_multiples_of_8() -> None:
    # BPF array elements are rounded up to 8 bytes; the mmap view relies on it.
    for dtype in schema.RING_DTYPES.values():
        assert dtype.itemsize % 8 == 0


def test_datatype_size_table_in_bpf_matches_schema() -> None:
    text = (ROOT / "bpf" / "nccl.c").read_text()
    packed = int(text.split("#define DATATYPE_SIZES ")[1].split("ULL")[0], 16)
    for dt, size in schema.DATATYPE_SIZE.items():
        assert (packed >> (4 * dt)) & 0xF == size, schema.DataType(dt).name


def test_every_shared_constant_has_one_name_on_both_sides() -> None:
    text = (ROOT / "bpf" / "events.h").read_text()
    for op in schema.Op:
        assert f"#define OP_{op.name} {int(op)}" in text
    assert "#define TCPEV_INET_SOCK_SET_STATE 2" in text
    assert "#define EXITEV_SIGNAL 2" in text
    for enum_type, prefix in layout.C_PREFIXES:
        for name in layout.c_names(enum_type):
            assert re.search(rf"^#define {name} \(?-?\d+\)?$", text, re.M), name
            assert name.startswith(prefix)


def test_fold_unique_id_is_order_sensitive_and_uses_all_bytes() -> None:
    base = bytes(range(128))
    h = schema.fold_unique_id(base)
    for i in (0, 8, 64, 127):
        changed = bytearray(base)
        changed[i] ^= 1
        assert schema.fold_unique_id(bytes(changed)) != h
    assert np.uint64(h) == h  # fits in 64 bits


def test_arrival_lateness_is_no_more_than_a_members_own_wait() -> None:
    """The one rule the slowdown trigger and the analyzer's scores share."""
    # on the host a member's own time is its entry: lateness after the first
    starts = np.array([100, 130, 160])
    assert schema.arrival_lateness(starts, 100, starts, 100).tolist() == [0, 30, 60]
    # on devices: the third starts 60 late, but its own queue waited only 5
    # beyond the quickest (its host enqueued late): late by 5, not 60
    waits = np.array([10, 40, 15])
    assert schema.arrival_lateness(starts, 100, waits, 10).tolist() == [0, 30, 5]
    assert int(schema.arrival_lateness(160, 100, 15, 10)) == 5  # integers alike

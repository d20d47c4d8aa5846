"""The C event structs (bpf/events.h) and the numpy dtypes (dumpers.schema)
agree on every size and field offset, and the kernel's folds match Python's."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from stallwatch.dumpers import schema

ROOT = Path(__file__).resolve().parents[2]
HEADER_FIELDS = {"pos", "ts_ns", "kind", "size", "pid", "tid", "_pad0"}
STRUCTS = {
    "nccl_event": schema.NCCL_EVENT,
    "comm_event": schema.COMM_EVENT,
    "tcp_event": schema.TCP_EVENT,
    "sched_event": schema.SCHED_EVENT,
    "exit_event": schema.EXIT_EVENT,
}


def _c_member(field: str) -> str:
    return f"hdr.{field}" if field in HEADER_FIELDS else field


def _program() -> str:
    lines = [
        "#include <stddef.h>",
        "#include <stdio.h>",
        "#include <linux/types.h>",
        '#include "events.h"',
        "int main(void) {",
    ]
    for struct, dtype in STRUCTS.items():
        lines.append(f'printf("{struct} SIZE %zu 0\\n", sizeof(struct {struct}));')
        for name in dtype.names:
            m = _c_member(name)
            lines.append(
                f'printf("{struct} {name} %zu %zu\\n", offsetof(struct {struct}, {m}), '
                f"sizeof(((struct {struct} *)0)->{m}));"
            )
    lines += ["return 0;", "}"]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], tuple[int, int]]:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.fail("a C compiler is needed to check bpf/events.h")
    work = tmp_path_factory.mktemp("schema")
    (work / "layout.c").write_text(_program())
    subprocess.run(
        [cc, "-I", str(ROOT / "bpf"), "-o", str(work / "layout"), str(work / "layout.c")],
        check=True,
        capture_output=True,
    )
    out = subprocess.run([str(work / "layout")], check=True, capture_output=True, text=True)
    layout = {}
    for line in out.stdout.splitlines():
        struct, name, offset, size = line.split()
        layout[(struct, name)] = (int(offset), int(size))
    return layout


@pytest.mark.parametrize("struct", sorted(STRUCTS))
def test_struct_size_matches_dtype(struct: str, c_layout: dict) -> None:
    assert c_layout[(struct, "SIZE")][0] == STRUCTS[struct].itemsize


@pytest.mark.parametrize("struct", sorted(STRUCTS))
def test_every_field_offset_and_size_match(struct: str, c_layout: dict) -> None:
    dtype = STRUCTS[struct]
    for name in dtype.names:
        field_dtype, offset = dtype.fields[name][:2]
        assert c_layout[(struct, name)] == (offset, field_dtype.itemsize), f"{struct}.{name}"


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


def test_op_numbers_in_header_match_enum() -> None:
    text = (ROOT / "bpf" / "events.h").read_text()
    for op in schema.Op:
        assert f"#define OP_{op.name} {int(op)}" in text


def test_fold_unique_id_is_order_sensitive_and_uses_all_bytes() -> None:
    base = bytes(range(128))
    h = schema.fold_unique_id(base)
    for i in (0, 8, 64, 127):
        changed = bytearray(base)
        changed[i] ^= 1
        assert schema.fold_unique_id(bytes(changed)) != h
    assert np.uint64(h) == h  # fits in 64 bits

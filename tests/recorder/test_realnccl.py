"""The agent on the real ``libnccl.so.2`` of the nvidia-nccl-cu12 wheel.

Opt-in by marker (``-m realnccl``; the wheel is large and must be installed
in the environment): no GPU is needed, the library still answers
``ncclGetUniqueId`` and refuses a collective on a null communicator with
``ncclInvalidArgument``.  This checks attaching to, and the calling convention
of, the library the agent exists for.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from stallwatch.dumpers.schema import Op, Result, State, decode_root_address, fold_unique_id
from stallwatch.recorder.agent import Agent, AgentConfig
from stallwatch.recorder.source import BccSource

pytestmark = [pytest.mark.bpf, pytest.mark.realnccl]


DRIVER = """
import ctypes, os, sys
nccl = ctypes.CDLL(sys.argv[1])
uid = ctypes.create_string_buffer(128)
print(nccl.ncclGetUniqueId(uid))
print(nccl.ncclAllReduce(None, None, ctypes.c_size_t(10), 7, 0, None, None))
print(nccl.ncclBroadcast(None, None, ctypes.c_size_t(3), 2, 1, None, None))
print(os.getpid())
print(uid.raw.hex())
"""


def test_agent_records_real_libnccl_calls(tmp_path: Path, real_libnccl: Path) -> None:
    lib = real_libnccl
    agent = Agent(AgentConfig(dump_dir=tmp_path), BccSource(1024, 1_000_000))
    try:
        attached = agent.attach_library(str(lib), required=True)
        assert attached is not None and attached.skipped == ()
        assert attached.first_instructions["ncclAllReduce"].startswith("push")
        out = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(DRIVER), str(lib)],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout.split()
        rec = agent.recording()
    finally:
        agent.close()
    get_id, all_reduce, broadcast, pid, uid = (
        int(out[0]),
        int(out[1]),
        int(out[2]),
        int(out[3]),
        out[4],
    )
    assert (get_id, all_reduce, broadcast) == (0, Result.INVALID_ARGUMENT, Result.INVALID_ARGUMENT)
    rows = rec.rings["nccl"].rows
    rows = rows[rows["pid"] == pid]
    assert [Op(o) for o in rows["op"]] == [Op.GET_UNIQUE_ID, Op.ALL_REDUCE, Op.BROADCAST]
    assert list(rows["result"]) == [0, Result.INVALID_ARGUMENT, Result.INVALID_ARGUMENT]
    assert (rows["state"] == State.ENQUEUED).all()
    assert list(rows["count"][1:]) == [10, 3] and rows[2]["peer"] == 1
    comm_rows = rec.rings["comm"].rows
    (id_row,) = comm_rows[(comm_rows["pid"] == pid) & (comm_rows["op"] == Op.GET_UNIQUE_ID)]
    assert bytes(id_row["unique_id"]).hex() == uid
    assert int(id_row["comm_hash"]) == fold_unique_id(bytes.fromhex(uid))
    assert decode_root_address(bytes.fromhex(uid)) is not None  # NCCL's bootstrap address

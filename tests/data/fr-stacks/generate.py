"""Make Flight Recorder dumps with stack frames, as torch writes them by default.

Needs torch 2.13 (the CPU build is enough): ``pip install torch==2.13.0``, then

    python tests/data/fr-stacks/generate.py

A 4-rank gloo job (processes on one machine) runs steps of a small training
loop whose all_reduces sit a few calls deep (``train -> step -> sync_grads``).
Rank 2 stops before the 4th step's all_reduce (it sleeps in ``load_batch``);
the others block in it.  Three seconds in, a thread in every rank dumps its
recorder with ``_dump_fr_trace(includeStackTraces=True)`` (pickle, torch's
default), and when every rank has dumped (counted on the job's store) the
job ends.  The files are kept byte for byte as torch
returned them: ``allreduce-hang-4/nccl_trace_rank_<r>``.

Stack frames carry file names.  So that they name no machine, the job runs
from a scratch folder: the script is copied to ``/tmp/frstacks/train.py`` and
torch is imported through a link, ``/tmp/frstacks/site-packages``, to the
installed site-packages.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRATCH = Path("/tmp/frstacks")
WORLD = 4
CULPRIT = 2
PORT = 29571

JOB = """
import os, sys, threading, time
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _dump_fr_trace

def load_batch(rank, step):
    if rank == CULPRIT and step == 3:
        time.sleep(60)
    return torch.ones(64)

def sync_grads(grads):
    dist.all_reduce(grads)

def step(rank, n):
    grads = load_batch(rank, n)
    sync_grads(grads)

def train(rank):
    for n in range(6):
        step(rank, n)

def dumper(store, rank, out):
    time.sleep(3.0)
    trace = _dump_fr_trace(includeStackTraces=True)
    with open(out + str(rank) + ".tmp", "wb") as f:
        f.write(trace)
    os.rename(out + str(rank) + ".tmp", out + str(rank))
    store.add("dumped", 1)
    while store.add("dumped", 0) < WORLD:  # nobody leaves before all have dumped
        time.sleep(0.05)
    os._exit(0)

def main():
    rank, out = int(sys.argv[1]), sys.argv[2]
    store = dist.TCPStore("127.0.0.1", PORT, WORLD, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    threading.Thread(target=dumper, args=(store, rank, out), daemon=True).start()
    train(rank)
    time.sleep(60)

main()
"""


def main() -> int:
    out = HERE / "allreduce-hang-4"
    shutil.rmtree(SCRATCH, ignore_errors=True)
    SCRATCH.mkdir(parents=True)
    (SCRATCH / "site-packages").symlink_to(sysconfig.get_paths()["purelib"])
    script = f"CULPRIT = {CULPRIT}\nWORLD = {WORLD}\nPORT = {PORT}\n" + JOB
    (SCRATCH / "train.py").write_text(script)
    dumps = SCRATCH / "dumps"
    dumps.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": str(SCRATCH / "site-packages"),
        "TORCH_FR_BUFFER_SIZE": "64",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "train.py", str(r), str(dumps / "nccl_trace_rank_")],
            cwd=SCRATCH,
            env=env,
        )
        for r in range(WORLD)
    ]
    deadline = time.monotonic() + 60
    for p in procs:
        p.wait(max(1.0, deadline - time.monotonic()))
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for f in sorted(dumps.iterdir()):
        shutil.copyfile(f, out / f.name)
    shutil.rmtree(SCRATCH)
    print(f"wrote {len(list(out.iterdir()))} dumps into {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

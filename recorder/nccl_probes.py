"""The NCCL probe family (bpf/nccl.c): which program each NCCL symbol
gets, and the symbol numbers the programs are compiled with.

Each NCCL entry point has an entry program of its own, its argument layout
compiled in (no attach cookie to read, ~20 ns a call), and every one shares
the return program: one uprobe_multi link per (program, symbol), or one
perf event each on kernels without uprobe_multi (``recorder.uprobes``).
"""

from __future__ import annotations

from stallwatch.dumpers.schema import NCCL_SYMBOLS

from .uprobekinds import LinkKind

RETURN_PROGRAM = "handle_nccl_return"
# NCCL symbol -> its entry program
ENTRY_PROGRAMS: dict[str, str] = {
    "ncclAllReduce": "handle_enter_all_reduce",
    "ncclAllGather": "handle_enter_all_gather",
    "ncclReduceScatter": "handle_enter_reduce_scatter",
    "ncclBroadcast": "handle_enter_broadcast",
    "ncclBcast": "handle_enter_bcast",
    "ncclReduce": "handle_enter_reduce",
    "ncclAlltoAll": "handle_enter_all_to_all",
    "ncclGather": "handle_enter_gather",
    "ncclScatter": "handle_enter_scatter",
    "ncclSend": "handle_enter_send",
    "ncclRecv": "handle_enter_recv",
    "ncclGroupStart": "handle_enter_group_start",
    "ncclGroupEnd": "handle_enter_group_end",
    "ncclCommInitRank": "handle_enter_init_rank",
    "ncclCommInitRankConfig": "handle_enter_init_rank_config",
    "ncclCommInitAll": "handle_enter_init_all",
    "ncclCommSplit": "handle_enter_split",
    "ncclCommDestroy": "handle_enter_destroy",
    "ncclCommAbort": "handle_enter_abort",
    "ncclCommFinalize": "handle_enter_finalize",
    "ncclGetUniqueId": "handle_enter_get_unique_id",
}
# NCCL symbol -> SYM_<symbol> in bpf/nccl.c, the case each entry program decodes.
SYMBOL_COOKIES: dict[str, int] = {name: i + 1 for i, name in enumerate(ENTRY_PROGRAMS)}
PROGRAMS = (*ENTRY_PROGRAMS.values(), RETURN_PROGRAM)
assert set(ENTRY_PROGRAMS) == set(NCCL_SYMBOLS), "ENTRY_PROGRAMS out of sync with schema"


def cflags() -> list[str]:
    return [f"-DSYM_{name}={cookie}" for name, cookie in SYMBOL_COOKIES.items()]


def programs_of(symbol: str) -> tuple[tuple[str, LinkKind], ...]:
    """The programs ``symbol`` gets, the return first: a process calling
    the library while it is being attached must not have an entry seen and
    its return missed."""
    return ((RETURN_PROGRAM, LinkKind.RETURN), (ENTRY_PROGRAMS[symbol], LinkKind.ENTRY))

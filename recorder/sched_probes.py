"""The scheduler probe family (bpf/sched.c): how it is attached, and the
flags it is compiled with.

Raw tracepoints (``SCHED_RAW_TP``) where the running kernel's BTF gives the
offsets of the task fields the programs read (its pid, its exit state; its
state too where sched_switch has no prev_state argument, before 5.18);
else tracepoints (said once in the log).  Either way the rows are the
same: the raw sched_switch program decides "still runnable" as the
tracepoint's prev_state would say it (``__trace_sched_switch_state``).
"""

from __future__ import annotations

import logging

from .btf import BtfError, KernelTypes

log = logging.getLogger("stallwatch.record")

SWITCH_ARGS = ("bool", "struct task_struct *", "struct task_struct *")
STATE_ARG = "unsigned int"  # 5.18+: the outgoing task's state
WAKEUP_ARGS = ("struct task_struct *",)
STATE_MEMBERS = ("__state", "state")  # the task's state: 5.14+, before


def raw_flags(types: KernelTypes) -> list[str]:
    """The flags of the raw tracepoints on this kernel; BtfError when its
    BTF lacks what they read."""
    for event in ("sched_wakeup", "sched_wakeup_new"):
        if types.tracepoint_args(event)[:1] != WAKEUP_ARGS:
            raise BtfError(f"raw tracepoint {event}'s argument is not a task")
    args = types.tracepoint_args("sched_switch")
    if args[:3] != SWITCH_ARGS:
        raise BtfError(f"raw tracepoint sched_switch has arguments {args}")
    flags = [
        "-DSCHED_RAW_TP=1",
        f"-DTASK_PID_OFF={types.member('task_struct', 'pid').offset}",
        f"-DTASK_EXIT_STATE_OFF={types.member('task_struct', 'exit_state').offset}",
    ]
    if args[3:4] != (STATE_ARG,):
        flags.append(f"-DTASK_STATE_OFF={_state_offset(types)}")
    return flags


def _state_offset(types: KernelTypes) -> int:
    for name in STATE_MEMBERS:
        try:
            return types.member("task_struct", name).offset
        except BtfError:
            continue
    raise BtfError("task_struct has no state member")


def cflags(types: KernelTypes | None) -> list[str]:
    """Raw tracepoints where ``types`` (the kernel's BTF, None: none or not
    wanted) has what they need, else tracepoints (no flag)."""
    if types is not None:
        try:
            return raw_flags(types)
        except BtfError as exc:
            log.warning("scheduler events from tracepoints, not raw tracepoints: %s", exc)
    return []

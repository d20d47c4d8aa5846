"""The TCP probe family (bpf/tcp.c): how it is attached, and the flags it is
compiled with.

Its hooks are raw tracepoints (``TCP_RAW_TP``) where the running kernel's
BTF gives the offsets of the fields the programs read and the tracepoints'
arguments are as the programs expect; else tracepoints, which the kernel
skips while any other tracing program runs on the CPU (said once in the
log).  Either way the rows are the same: the raw programs read, from the
socket and the packet, what the tracepoints would have copied (their
TP_fast_assign in include/trace/events/tcp.h and sock.h).

The sock_ops program (connection state at retransmission timeouts and
retransmits) is linked to the cgroup v2 root: every socket of the machine.
"""

from __future__ import annotations

import logging
from pathlib import Path

from . import bpfsys, kernelhooks
from .btf import BtfError, KernelTypes

log = logging.getLogger("stallwatch.record")

SOCK_OPS_PROGRAM = "handle_sock_ops"
SOCK_OPS_LINK = ("cgroup", "sock_ops")  # the compile cache's name of its link
# the raw tracepoints' arguments the programs read (the first ones: a
# kernel that appends one keeps them), and what an optional last one adds
ARGS = {
    "sock_send_length": ("struct sock *", "int", "int"),
    "sock_recv_length": ("struct sock *", "int", "int"),
    "inet_sock_set_state": ("struct sock *", "int", "int"),
    "tcp_retransmit_skb": ("struct sock *", "struct sk_buff *"),
    "tcp_send_reset": ("struct sock *", "struct sk_buff *"),
    "tcp_receive_reset": ("struct sock *",),
}
OPTIONAL_ARGS = {  # event -> (its argument after ARGS, the flag that reads it)
    "tcp_retransmit_skb": ("int", "TP_RETRANSMIT_ERR"),  # 6.12+: the send's result
    "tcp_send_reset": ("enum sk_rst_reason", "TP_SEND_RESET_REASON"),  # 6.10+
}
# Tracepoint fields only some kernels have -> the flag that reads them
# (tracepoints: the kernel's format files say).
OPTIONAL_FIELDS = {
    ("tcp", "tcp_retransmit_skb", "err"): "TP_RETRANSMIT_ERR",  # 6.12+
    ("tcp", "tcp_send_reset", "reason"): "TP_SEND_RESET_REASON",  # 6.10+
}
# flag -> (struct, member): every field the raw programs read
FIELDS = {
    "SK_DADDR_OFF": ("sock", "__sk_common.skc_daddr"),
    "SK_DPORT_OFF": ("sock", "__sk_common.skc_dport"),
    "SK_FAMILY_OFF": ("sock", "__sk_common.skc_family"),
    "SK_STATE_OFF": ("sock", "__sk_common.skc_state"),
    "SK_V6_DADDR_OFF": ("sock", "__sk_common.skc_v6_daddr"),
    "SK_V6_RCV_SADDR_OFF": ("sock", "__sk_common.skc_v6_rcv_saddr"),
    "SK_PROTOCOL_OFF": ("sock", "sk_protocol"),
    "INET_SADDR_OFF": ("inet_sock", "inet_saddr"),
    "INET_SPORT_OFF": ("inet_sock", "inet_sport"),
    "INET_PINET6_OFF": ("inet_sock", "pinet6"),
    "IPV6_SADDR_OFF": ("ipv6_pinfo", "saddr"),
    "SKB_HEAD_OFF": ("sk_buff", "head"),
    "SKB_DATA_OFF": ("sk_buff", "data"),
    "SKB_NETWORK_HEADER_OFF": ("sk_buff", "network_header"),
}
# Fields read at once (one read instead of several): name -> their flags.
SPANS = {
    "SK_HEAD": ("SK_DADDR_OFF", "SK_DPORT_OFF", "SK_FAMILY_OFF", "SK_STATE_OFF"),
    "INET_HEAD": ("INET_SADDR_OFF", "INET_SPORT_OFF"),
}
SPAN_MAX = 64  # bytes of the program's stack a span may take
# Hooks that fire in a process's context and in softirq: each has a second
# raw tracepoint program for the events the kernel skipped the first for
# (it was running on that CPU; bpf/tcp.c, RAW_PAIR).  Index: PAIR_<event>.
PAIRED = ("inet_sock_set_state", "tcp_retransmit_skb", "tcp_send_reset", "tcp_receive_reset")
PAIR_CAUGHT = "pair_caught"  # the map: per paired hook, the events its second program ran for


def raw_flags(types: KernelTypes) -> list[str]:
    """The flags of the raw tracepoints on this kernel; BtfError when its
    BTF lacks what they read."""
    flags = ["-DTCP_RAW_TP=1", f"-DPAIRS={len(PAIRED)}"]
    flags += [f"-DPAIR_{event}={i}" for i, event in enumerate(PAIRED)]
    for event, expected in ARGS.items():
        args = types.tracepoint_args(event)
        if args[: len(expected)] != expected:
            raise BtfError(f"raw tracepoint {event} has arguments {args}, not {expected}")
        optional = OPTIONAL_ARGS.get(event)
        if optional is not None and args[len(expected) : len(expected) + 1] == optional[:1]:
            flags.append(f"-D{optional[1]}=1")
    members = {flag: types.member(struct, path) for flag, (struct, path) in FIELDS.items()}
    flags += [f"-D{flag}={m.offset}" for flag, m in members.items()]
    for span, names in SPANS.items():
        start = min(members[n].offset for n in names)
        end = max(members[n].offset + members[n].size for n in names)
        if end - start > SPAN_MAX:
            raise BtfError(f"{span}: {', '.join(names)} span {end - start} bytes")
        flags += [f"-D{span}_OFF={start}", f"-D{span}_LEN={end - start}"]
    return flags


def tracepoint_flags() -> list[str]:
    """The flags of the tracepoints on this kernel (the fields it has)."""
    flags = []
    for (category, event, name), flag in OPTIONAL_FIELDS.items():
        if name in kernelhooks.tracepoint_fields(category, event):
            flags.append(f"-D{flag}=1")
    return flags


def cflags(types: KernelTypes | None) -> list[str]:
    """Raw tracepoints where ``types`` (the kernel's BTF, None: none or not
    wanted) has what they need, else tracepoints."""
    if types is not None:
        try:
            return raw_flags(types)
        except BtfError as exc:
            log.warning("TCP events from tracepoints, not raw tracepoints: %s", exc)
    return tracepoint_flags()


def cgroup2_root() -> Path | None:
    """Where the cgroup v2 hierarchy's root is mounted (pure v2:
    /sys/fs/cgroup; hybrid: /sys/fs/cgroup/unified), None if nowhere."""
    try:
        text = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        fields = line.split(" - ")
        if len(fields) != 2 or not fields[1].startswith("cgroup2 "):
            continue
        mount = fields[0].split()
        if mount[3] == "/":  # the root of the hierarchy, not a namespace's part of it
            return Path(mount[4])
    return None


def link_sock_ops(prog_fd: int) -> int | None:
    """The sock_ops program on the cgroup v2 root; None (logged) where it
    cannot be: retransmits are still recorded, with no connection state."""
    root = cgroup2_root()
    try:
        if root is None:
            raise OSError("no cgroup v2 hierarchy is mounted")
        return bpfsys.cgroup_link(prog_fd, root, bpfsys.BPF_CGROUP_SOCK_OPS)
    except OSError as exc:
        log.warning(
            "TCP retransmits are recorded without the connection's state (RTO, RTT, "
            "bytes unacknowledged): cannot link %s to the cgroup root %s: %s",
            SOCK_OPS_PROGRAM,
            root,
            exc,
        )
        return None

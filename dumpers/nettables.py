"""The SQL tables of the agent's network rings (docs/parquet.md has every
column):

    conn_samples   each job connection's struct tcp_info, every second (ring "conn_samples")
    iface_samples  each job interface's netdev and root qdisc counters, every second
                   (ring "iface_samples")
    probes         the probes between the job's nodes at an incident, sent and received
                   (ring "probes")

Times are on the incident's clock with the host's own stamp beside them, as
in every table (``dumpers.sqltables``).  A value the kernel did not give
(all ones in the ring) is NULL; so is a pid no process is known to own.
Names stored in fixed byte fields (an interface's, a qdisc's kind, an
incident id) are text, interned.  Dumps before format 9 have no rows here.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from .columns import (
    Columns,
    address_column,
    by_pid,
    counter,
    enum_names,
    families,
    flag,
    header,
    hex_ids,
    lower_name,
    maybe_null,
    pids,
    ring_rows,
    tcp_state_name,
)
from .layout import (
    IFACE_NETDEV,
    IFACE_QDISC,
    UNKNOWN_U8,
    UNKNOWN_U32,
    UNKNOWN_U64,
    ProbeKind,
    ProbeOutcome,
    ProbeRole,
)
from .model import Recording
from .ranks import Ranks

# struct tcp_info's tcpi_ca_state (include/net/tcp.h, enum tcp_ca_state)
CA_STATES = ("open", "disorder", "cwr", "recovery", "loss")
CONN_U8 = ("backoff", "retransmits")
CONN_U32 = (
    "rto_us", "srtt_us", "rttvar_us", "min_rtt_us", "snd_cwnd", "snd_mss", "pmtu", "unacked",
    "retrans_out", "lost", "total_retrans", "notsent_bytes", "last_data_sent_ms",
    "last_data_recv_ms", "last_ack_recv_ms", "segs_out", "segs_in", "snd_wnd",
)  # fmt: skip
CONN_U64 = (
    "delivery_rate", "bytes_acked", "bytes_received", "bytes_sent", "bytes_retrans",
    "busy_time_us", "rwnd_limited_us", "sndbuf_limited_us",
)  # fmt: skip

_STATES = enum_names(tcp_state_name)
_CA_STATES = enum_names(lambda v: CA_STATES[v] if v < len(CA_STATES) else f"ca_state_{v}")
_PROBE_KINDS = enum_names(lower_name(ProbeKind, "probe"))
_ROLES = enum_names(lower_name(ProbeRole, "role"))
_OUTCOMES = enum_names(lower_name(ProbeOutcome, "outcome"))


def _coded(codes: np.ndarray, names: pa.Array, null: np.ndarray) -> pa.DictionaryArray:
    indices = pa.array(codes.astype(np.uint8, copy=False), mask=null)
    return pa.DictionaryArray.from_arrays(indices, names)


def texts(raw: np.ndarray) -> pa.DictionaryArray:
    """Fixed NUL-padded byte fields (one row each) as text, interned; an
    empty one is NULL.  Each distinct value is decoded once."""
    width = raw.shape[1] if raw.ndim == 2 else 0
    if not len(raw) or not width:
        return pa.DictionaryArray.from_arrays(pa.array([], pa.int32()), pa.array([], pa.string()))
    flat = np.ascontiguousarray(raw).view(f"S{width}").reshape(-1)
    uniq, codes = np.unique(flat, return_inverse=True)
    names = [u.decode(errors="replace") for u in uniq.tolist()]
    null = np.array([not n for n in names], dtype=bool)[codes.reshape(-1)]
    return pa.DictionaryArray.from_arrays(
        pa.array(codes.reshape(-1).astype(np.int32), mask=null), pa.array(names, pa.string())
    )


def _interfaces(rec: Recording, ifindex: np.ndarray) -> pa.DictionaryArray:
    """Each row's interface name, by its ifindex among the recording's
    network interfaces (NULL: unknown, or none of them)."""
    table = {li.ifindex: li.name for li in rec.links if li.kind == "netdev" and not li.gone_ns}
    keys = sorted(k for k in table if k is not None)
    names = pa.array([table[k] for k in keys], pa.string())
    if not keys:
        return pa.DictionaryArray.from_arrays(pa.nulls(len(ifindex), pa.int32()), names)
    known = np.array(keys, dtype=np.int64)
    wanted = ifindex.astype(np.int64)
    at = np.minimum(np.searchsorted(known, wanted), len(known) - 1)
    return pa.DictionaryArray.from_arrays(
        pa.array(at.astype(np.int32), mask=known[at] != wanted), names
    )


def conn_sample_columns(rec: Recording, known: Ranks | None = None) -> Columns:
    known = known if known is not None else Ranks.of([rec])
    rows = ring_rows(rec, "conn_samples")
    _, cols = header(rec, rows)
    cols["pid"] = pids(rows["pid"])
    cols["world_rank"] = by_pid(rows["pid"], known.world_of(rec.host))
    cols["family"] = families(rows["family"])
    cols["saddr"] = address_column(rows["family"], rows["saddr"])
    cols["daddr"] = address_column(rows["family"], rows["daddr"])
    cols["sport"] = pa.array(rows["sport"].astype(np.int32))
    cols["dport"] = pa.array(rows["dport"].astype(np.int32))
    cols["state"] = _coded(rows["state"], _STATES, rows["state"] == 0)
    cols["ca_state"] = _coded(rows["ca_state"], _CA_STATES, rows["ca_state"] == UNKNOWN_U8)
    cols["ifindex"] = counter(rows["ifindex"], UNKNOWN_U32)
    cols["interface"] = _interfaces(rec, rows["ifindex"])
    for name in CONN_U8:
        cols[name] = counter(rows[name], UNKNOWN_U8)
    cols["delivery_rate_app_limited"] = flag(rows["delivery_rate_app_limited"])
    for name in CONN_U32:
        cols[name] = counter(rows[name], UNKNOWN_U32)
    for name in CONN_U64:
        cols[name] = counter(rows[name], UNKNOWN_U64)
    return cols


def iface_sample_columns(rec: Recording, known: Ranks | None = None) -> Columns:
    rows = ring_rows(rec, "iface_samples")
    _, cols = header(rec, rows)
    cols["ifindex"] = counter(rows["ifindex"], UNKNOWN_U32)
    cols["name"] = texts(rows["name"])
    cols["mtu"] = counter(rows["mtu"], UNKNOWN_U32)
    for name in IFACE_NETDEV:
        cols[name] = counter(rows[name], UNKNOWN_U64)
    cols["qdisc_kind"] = texts(rows["qdisc_kind"])
    handle = rows["qdisc_handle"].astype(np.int64)
    cols["qdisc_handle"] = maybe_null(handle, handle == UNKNOWN_U32)
    cols["qdisc_bytes"] = counter(rows["qdisc_bytes"], UNKNOWN_U64)
    for name in IFACE_QDISC:
        cols[name] = counter(rows[name], UNKNOWN_U32)
    return cols


def probe_columns(rec: Recording, known: Ranks | None = None) -> Columns:
    rows = ring_rows(rec, "probes")
    _, cols = header(rec, rows)
    cols["incident"] = texts(rows["incident"])
    cols["round"] = hex_ids(rows["round"])
    cols["kind"] = _coded(rows["probe"], _PROBE_KINDS, rows["probe"] == 0)
    cols["role"] = _coded(rows["role"], _ROLES, rows["role"] == 0)
    cols["outcome"] = _coded(rows["outcome"], _OUTCOMES, rows["outcome"] == 0)
    cols["family"] = families(rows["family"])
    cols["saddr"] = address_column(rows["family"], rows["saddr"])
    cols["daddr"] = address_column(rows["family"], rows["daddr"])
    cols["ifindex"] = counter(rows["ifindex"], UNKNOWN_U32)
    cols["interface"] = _interfaces(rec, rows["ifindex"])
    cols["size"] = counter(rows["probe_size"], UNKNOWN_U32)
    cols["df"] = flag(rows["df"])
    for name in ("sent", "answered", "rtt_us", "mtu"):
        cols[name] = counter(rows[name], UNKNOWN_U32)
    err = rows["err"].astype(np.int32)
    cols["err"] = maybe_null(err, rows["outcome"] != ProbeOutcome.ERROR)
    for name in ("throughput_bps", "bytes_sent", "bytes_received", "duration_us"):
        cols[name] = counter(rows[name], UNKNOWN_U64)
    return cols

/* GENERATED from dumpers/layout.py by `python -m stallwatch.dumpers.layout --write`:
 * do not edit.  The records every stallwatch BPF program writes and the
 * constants they share with Python, written once there.
 *
 * Every record begins with struct event_header.  Records live in rings that
 * the BPF programs write directly: an mmapable BPF array of RING_SLOTS slots
 * and a head counter.  A writer claims position `p` with an atomic add on the
 * head, fills slot p % RING_SLOTS, and writes `pos = p + 1` last; a reader
 * trusts a slot only when its `pos` equals the position it expects, which
 * detects slots that are still being written or were overwritten.
 *
 * Padding is explicit; every size and field offset is pinned with
 * _Static_assert.
 */
#ifndef STALLWATCH_EVENTS_H
#define STALLWATCH_EVENTS_H

/* `event_header.kind`: which ring a record belongs to. */
#define EVENT_NCCL 1
#define EVENT_COMM 2
#define EVENT_TCP 3
#define EVENT_SCHED 4
#define EVENT_EXIT 5
#define EVENT_LINK 6
#define EVENT_CONN_SAMPLE 7
#define EVENT_IFACE_SAMPLE 8
#define EVENT_PROBE 9
#define EVENT_DISC 16

/* NCCL call kinds (`nccl_event.op`, `comm_event.op`); `name` is the SQL spelling (`ALL_REDUCE`). */
#define OP_UNKNOWN 0
#define OP_ALL_REDUCE 1
#define OP_ALL_GATHER 2
#define OP_REDUCE_SCATTER 3
#define OP_BROADCAST 4
#define OP_REDUCE 5
#define OP_ALL_TO_ALL 6
#define OP_GATHER 7
#define OP_SCATTER 8
#define OP_SEND 9
#define OP_RECV 10
#define OP_GROUP_START 11
#define OP_GROUP_END 12
#define OP_COMM_INIT_RANK 13
#define OP_COMM_INIT_RANK_CONFIG 14
#define OP_COMM_INIT_ALL 15
#define OP_COMM_SPLIT 16
#define OP_COMM_DESTROY 17
#define OP_COMM_ABORT 18
#define OP_COMM_FINALIZE 19
#define OP_GET_UNIQUE_ID 20
#define OP_BARRIER 21
#define OP_GRAPH_LAUNCH 22

/* Lifecycle: the furthest state a call reached, as the host observed it. */
#define STATE_SCHEDULED 0
#define STATE_ENQUEUED 1
#define STATE_STARTED 2
#define STATE_COMPLETED 3

/* `ncclResult_t`; PENDING (-1) marks a call that has not returned. */
#define RESULT_PENDING (-1)
#define RESULT_SUCCESS 0
#define RESULT_UNHANDLED_CUDA_ERROR 1
#define RESULT_SYSTEM_ERROR 2
#define RESULT_INTERNAL_ERROR 3
#define RESULT_INVALID_ARGUMENT 4
#define RESULT_INVALID_USAGE 5
#define RESULT_REMOTE_ERROR 6
#define RESULT_IN_PROGRESS 7

/* `tcp_event.event`: the kernel event a TCP row records (the SQL spelling is the name in lower case, the tracepoint's). */
#define TCPEV_TCP_RETRANSMIT_SKB 1
#define TCPEV_INET_SOCK_SET_STATE 2
#define TCPEV_TCP_SEND_RESET 3
#define TCPEV_TCP_RECEIVE_RESET 4
#define TCPEV_TCP_INFO 5

/* `exit_event.event`. */
#define EXITEV_EXIT_GROUP 1
#define EXITEV_SIGNAL 2
#define EXITEV_PROCESS_EXIT 3

/* `disc_event.event`: what tells the agent a process may map a new library. */
#define DISC_EXEC 1
#define DISC_LINKMAP 2

/* `link_event.link_kind`: what the row's interface is. */
#define LINK_NETDEV 1
#define LINK_RDMA 2

/* `link_event.event`: why the agent wrote the row (the SQL spelling is the name in lower case).  One row says the strongest reason. */
#define LINKEV_SEEN 1
#define LINKEV_HEARTBEAT 2
#define LINKEV_CARRIER_DOWN 3
#define LINKEV_CARRIER_UP 4
#define LINKEV_CARRIER_FLAP 5
#define LINKEV_STATE 6
#define LINKEV_ERRORS 7
#define LINKEV_GONE 8

/* `probe_event.probe`: how a path between two of the job's nodes was probed (the SQL spelling is the name in lower case). */
#define PROBE_ICMP 1
#define PROBE_UDP 2
#define PROBE_TCP 3

/* `probe_event.role`: whose probes a row counts. */
#define PROBEROLE_SENT 1
#define PROBEROLE_RECEIVED 2

/* `probe_event.outcome`: what became of a row's probes. */
#define PROBEOUT_OK 1
#define PROBEOUT_PARTIAL 2
#define PROBEOUT_LOST 3
#define PROBEOUT_FRAG_NEEDED 4
#define PROBEOUT_UNREACHABLE 5
#define PROBEOUT_REFUSED 6
#define PROBEOUT_ERROR 7

/* Index of each ring's head in `heads`, and of its loss counter in `drops`. */
#define RING_NCCL 0
#define RING_COMM 1
#define RING_TCP 2
#define RING_SCHED 3
#define RING_EXIT 4
#define RING_DISC 7 /* the discovery ring (not dumped): the last head */
#define RING_HEADS 8
/* The other loss counters of `drops`. */
#define DROP_INFLIGHT_FULL 5
#define DROP_COMMS_FULL 6
#define DROP_OWNER_FULL 7
#define DROP_RQ_FULL 8
#define DROP_CUDA_QUEUE 9
#define DROP_GRAPH_FULL 10
#define DROP_TCP_FILTERED 11
#define DROP_CONN_FULL 12
#define DROP_SLOTS 13

/* Every record begins with it. */
struct event_header {
	__u64 pos; /* ring position + 1, written last; 0 = never written */
	__u64 ts_ns; /* bpf_ktime_get_ns(): CLOCK_MONOTONIC */
	__u16 kind; /* EVENT_* */
	__u16 size; /* sizeof the whole record */
	__u32 pid; /* thread group id (owner process for tcp events) */
	__u32 tid;
	__u32 _pad0;
};
_Static_assert(sizeof(struct event_header) == 32, "event_header size");
_Static_assert(__builtin_offsetof(struct event_header, pos) == 0, "event_header.pos");
_Static_assert(__builtin_offsetof(struct event_header, ts_ns) == 8, "event_header.ts_ns");
_Static_assert(__builtin_offsetof(struct event_header, kind) == 16, "event_header.kind");
_Static_assert(__builtin_offsetof(struct event_header, size) == 18, "event_header.size");
_Static_assert(__builtin_offsetof(struct event_header, pid) == 20, "event_header.pid");
_Static_assert(__builtin_offsetof(struct event_header, tid) == 24, "event_header.tid");
_Static_assert(__builtin_offsetof(struct event_header, _pad0) == 28, "event_header._pad0");

/* One row per NCCL API call: opened at entry, completed at return; the CUDA
 * probes (cuda.c) add when the device started and completed it, each as the
 * first observation that says so and the last that said not yet: the device
 * event lies in (*_after_ns, *_ns].  0 = not observed.
 *
 * CUDA graphs (cuda.c): a call made on a stream being captured is a row with
 * `graph` set and `replay` 0 (captured, not executed: no seq, never on a
 * stream).  Each successful cudaGraphLaunch of a graph that captured NCCL
 * calls writes one row with op OP_GRAPH_LAUNCH (comm: the cudaGraphExec_t,
 * count: the calls it replays, seq: 0) and then one row per captured call,
 * in capture order, as if the call were made again: its own per-communicator
 * seq, queued on the launch's stream, `graph`, `graph_node` and `replay`
 * saying where it came from.
 */
struct nccl_event {
	struct event_header hdr;
	__u64 end_ns; /* return time, 0 while in flight */
	__u64 comm; /* ncclComm_t as a pointer value */
	__u64 comm_hash; /* folded ncclUniqueId, 0 if the comm is unknown */
	__u64 count; /* elements */
	__u64 bytes; /* count * sizeof(datatype) */
	__u64 stream;
	__u64 seq; /* per-communicator (p2p: per peer and direction) */
	__s32 rank; /* rank in comm, -1 if unknown */
	__s32 nranks;
	__s32 peer; /* root or peer, -1 if none */
	__s32 result; /* ncclResult_t, RESULT_PENDING while in flight */
	__u8 op;
	__u8 datatype;
	__u8 redop;
	__u8 state;
	__u32 graph_node; /* 1-based place of the call in its graph's capture, 0: none */
	__u64 started_ns;
	__u64 started_after_ns;
	__u64 completed_ns;
	__u64 completed_after_ns;
	__u64 graph; /* the process's capture number (1-based), 0: not in a graph */
	__u64 replay; /* the graph executable's launch number (1-based), 0: not a replay */
};
_Static_assert(sizeof(struct nccl_event) == 160, "nccl_event size");
_Static_assert(__builtin_offsetof(struct nccl_event, end_ns) == 32, "nccl_event.end_ns");
_Static_assert(__builtin_offsetof(struct nccl_event, comm) == 40, "nccl_event.comm");
_Static_assert(__builtin_offsetof(struct nccl_event, comm_hash) == 48, "nccl_event.comm_hash");
_Static_assert(__builtin_offsetof(struct nccl_event, count) == 56, "nccl_event.count");
_Static_assert(__builtin_offsetof(struct nccl_event, bytes) == 64, "nccl_event.bytes");
_Static_assert(__builtin_offsetof(struct nccl_event, stream) == 72, "nccl_event.stream");
_Static_assert(__builtin_offsetof(struct nccl_event, seq) == 80, "nccl_event.seq");
_Static_assert(__builtin_offsetof(struct nccl_event, rank) == 88, "nccl_event.rank");
_Static_assert(__builtin_offsetof(struct nccl_event, nranks) == 92, "nccl_event.nranks");
_Static_assert(__builtin_offsetof(struct nccl_event, peer) == 96, "nccl_event.peer");
_Static_assert(__builtin_offsetof(struct nccl_event, result) == 100, "nccl_event.result");
_Static_assert(__builtin_offsetof(struct nccl_event, op) == 104, "nccl_event.op");
_Static_assert(__builtin_offsetof(struct nccl_event, datatype) == 105, "nccl_event.datatype");
_Static_assert(__builtin_offsetof(struct nccl_event, redop) == 106, "nccl_event.redop");
_Static_assert(__builtin_offsetof(struct nccl_event, state) == 107, "nccl_event.state");
_Static_assert(__builtin_offsetof(struct nccl_event, graph_node) == 108, "nccl_event.graph_node");
_Static_assert(__builtin_offsetof(struct nccl_event, started_ns) == 112, "nccl_event.started_ns");
_Static_assert(__builtin_offsetof(struct nccl_event, started_after_ns) == 120, "nccl_event.started_after_ns");
_Static_assert(__builtin_offsetof(struct nccl_event, completed_ns) == 128, "nccl_event.completed_ns");
_Static_assert(__builtin_offsetof(struct nccl_event, completed_after_ns) == 136, "nccl_event.completed_after_ns");
_Static_assert(__builtin_offsetof(struct nccl_event, graph) == 144, "nccl_event.graph");
_Static_assert(__builtin_offsetof(struct nccl_event, replay) == 152, "nccl_event.replay");

/* Communicator lifecycle (init, split, destroy, abort, finalize, unique id). */
struct comm_event {
	struct event_header hdr;
	__u64 end_ns;
	__u64 comm;
	__u64 comm_hash;
	__u64 parent_hash; /* split: parent's hash, else 0 */
	__s32 rank;
	__s32 nranks;
	__s32 color;
	__s32 key;
	__u8 op;
	__u8 state;
	__u16 _pad1;
	__s32 result;
	__u8 unique_id[128]; /* the full ncclUniqueId where the call carries one */
};
_Static_assert(sizeof(struct comm_event) == 216, "comm_event size");
_Static_assert(__builtin_offsetof(struct comm_event, end_ns) == 32, "comm_event.end_ns");
_Static_assert(__builtin_offsetof(struct comm_event, comm) == 40, "comm_event.comm");
_Static_assert(__builtin_offsetof(struct comm_event, comm_hash) == 48, "comm_event.comm_hash");
_Static_assert(__builtin_offsetof(struct comm_event, parent_hash) == 56, "comm_event.parent_hash");
_Static_assert(__builtin_offsetof(struct comm_event, rank) == 64, "comm_event.rank");
_Static_assert(__builtin_offsetof(struct comm_event, nranks) == 68, "comm_event.nranks");
_Static_assert(__builtin_offsetof(struct comm_event, color) == 72, "comm_event.color");
_Static_assert(__builtin_offsetof(struct comm_event, key) == 76, "comm_event.key");
_Static_assert(__builtin_offsetof(struct comm_event, op) == 80, "comm_event.op");
_Static_assert(__builtin_offsetof(struct comm_event, state) == 81, "comm_event.state");
_Static_assert(__builtin_offsetof(struct comm_event, _pad1) == 82, "comm_event._pad1");
_Static_assert(__builtin_offsetof(struct comm_event, result) == 84, "comm_event.result");
_Static_assert(__builtin_offsetof(struct comm_event, unique_id) == 88, "comm_event.unique_id");

/* A TCP event of a job's socket, decided in the kernel (bpf/tcp.c): the
 * header's pid is the owning process, 0 if unknown.  Retransmits carry the
 * connection's state as the kernel had it (read by the sock_ops program: the
 * row is completed right after it is written), resets their reason.  A
 * retransmit of another connection to a host the job talks to is a sample
 * (`other` 1, pid 0): at most one a second per pair of addresses.
 */
struct tcp_event {
	struct event_header hdr;
	__u64 skaddr;
	__u8 saddr[16]; /* this end's address; IPv4 in the first 4 bytes when family == AF_INET */
	__u8 daddr[16]; /* the peer's */
	__u16 sport;
	__u16 dport;
	__u16 family;
	__u8 event; /* TCPEV_* */
	__u8 backoff; /* retransmission timeouts in a row, this one included, 0: none */
	__s32 state; /* tcp state (old state for TCPEV_INET_SOCK_SET_STATE) */
	__s32 newstate; /* TCPEV_INET_SOCK_SET_STATE only */
	__u64 no_ack_ns; /* nothing acknowledged for at least this long */
	__u32 srtt_us; /* smoothed round-trip time */
	__u32 rto_us; /* retransmission timeout, 0: unknown */
	__u32 unacked; /* bytes sent and not acknowledged */
	__u32 packets_out; /* segments in flight */
	__u32 retrans_out; /* of them, retransmitted */
	__u16 reason; /* resets: enum sk_rst_reason */
	__u8 conn_known; /* 1: the fields from no_ack_ns on were read, 0: unknown */
	__u8 other; /* 1: not the job's connection, a sample (see tcp.c) */
	__s32 err; /* retransmits: the send's result (0, or -errno: not sent) */
	__u32 _pad2;
};
_Static_assert(sizeof(struct tcp_event) == 128, "tcp_event size");
_Static_assert(__builtin_offsetof(struct tcp_event, skaddr) == 32, "tcp_event.skaddr");
_Static_assert(__builtin_offsetof(struct tcp_event, saddr) == 40, "tcp_event.saddr");
_Static_assert(__builtin_offsetof(struct tcp_event, daddr) == 56, "tcp_event.daddr");
_Static_assert(__builtin_offsetof(struct tcp_event, sport) == 72, "tcp_event.sport");
_Static_assert(__builtin_offsetof(struct tcp_event, dport) == 74, "tcp_event.dport");
_Static_assert(__builtin_offsetof(struct tcp_event, family) == 76, "tcp_event.family");
_Static_assert(__builtin_offsetof(struct tcp_event, event) == 78, "tcp_event.event");
_Static_assert(__builtin_offsetof(struct tcp_event, backoff) == 79, "tcp_event.backoff");
_Static_assert(__builtin_offsetof(struct tcp_event, state) == 80, "tcp_event.state");
_Static_assert(__builtin_offsetof(struct tcp_event, newstate) == 84, "tcp_event.newstate");
_Static_assert(__builtin_offsetof(struct tcp_event, no_ack_ns) == 88, "tcp_event.no_ack_ns");
_Static_assert(__builtin_offsetof(struct tcp_event, srtt_us) == 96, "tcp_event.srtt_us");
_Static_assert(__builtin_offsetof(struct tcp_event, rto_us) == 100, "tcp_event.rto_us");
_Static_assert(__builtin_offsetof(struct tcp_event, unacked) == 104, "tcp_event.unacked");
_Static_assert(__builtin_offsetof(struct tcp_event, packets_out) == 108, "tcp_event.packets_out");
_Static_assert(__builtin_offsetof(struct tcp_event, retrans_out) == 112, "tcp_event.retrans_out");
_Static_assert(__builtin_offsetof(struct tcp_event, reason) == 116, "tcp_event.reason");
_Static_assert(__builtin_offsetof(struct tcp_event, conn_known) == 118, "tcp_event.conn_known");
_Static_assert(__builtin_offsetof(struct tcp_event, other) == 119, "tcp_event.other");
_Static_assert(__builtin_offsetof(struct tcp_event, err) == 120, "tcp_event.err");
_Static_assert(__builtin_offsetof(struct tcp_event, _pad2) == 124, "tcp_event._pad2");

/* A rank thread that waited in the run queue longer than the threshold.
 * prev_pid: the process (tgid) that held the CPU until the thread got it,
 * 0 for the idle task.  Only the last holder is known: a long wait may have
 * seen others run before it.  Dumps before format 5 had padding here; their
 * rows read as -1 (unknown).
 */
struct sched_event {
	struct event_header hdr;
	__u64 delay_ns;
	__u32 cpu;
	__s32 prev_pid;
};
_Static_assert(sizeof(struct sched_event) == 48, "sched_event size");
_Static_assert(__builtin_offsetof(struct sched_event, delay_ns) == 32, "sched_event.delay_ns");
_Static_assert(__builtin_offsetof(struct sched_event, cpu) == 40, "sched_event.cpu");
_Static_assert(__builtin_offsetof(struct sched_event, prev_pid) == 44, "sched_event.prev_pid");

/* A rank process's exit: its code, a fatal signal, its end. */
struct exit_event {
	struct event_header hdr;
	__s32 code; /* exit_group code, or -1 */
	__s32 signal; /* fatal signal number, or 0 */
	__u8 event; /* EXITEV_* */
	__u8 _pad1[7];
};
_Static_assert(sizeof(struct exit_event) == 48, "exit_event size");
_Static_assert(__builtin_offsetof(struct exit_event, code) == 32, "exit_event.code");
_Static_assert(__builtin_offsetof(struct exit_event, signal) == 36, "exit_event.signal");
_Static_assert(__builtin_offsetof(struct exit_event, event) == 40, "exit_event.event");
_Static_assert(__builtin_offsetof(struct exit_event, _pad1) == 41, "exit_event._pad1");

/* One sample of an interface's state and counters, written by the agent
 * (recorder.links, not a BPF program) when the state changed or an error
 * counter moved since the interface's previous row, and at least every
 * heartbeat.  The header's pid and tid are 0.  Every value the interface does
 * not have or that could not be read is unknown: 0xff, 0xffffffff or
 * 0xffffffffffffffff by its width.  netdev rows leave the RDMA fields
 * unknown and RDMA rows the netdev ones.
 */
struct link_event {
	struct event_header hdr;
	__u64 after_ns; /* the interface's previous sample: a change lies after it */
	__u32 link; /* the interface: its id in the dump's links table */
	__u8 link_kind; /* LINK_* */
	__u8 event; /* LINKEV_* */
	__u8 carrier; /* 1 up, 0 down (RDMA: phys_state LinkUp or not) */
	__u8 admin_up; /* netdev: IFF_UP */
	__u8 operstate; /* netdev: IF_OPER_* (RFC 2863) */
	__u8 port_state; /* RDMA: DOWN 1, INIT 2, ARMED 3, ACTIVE 4, ACTIVE_DEFER 5 */
	__u8 phys_state; /* RDMA: Sleep 1 ... LinkUp 5, LinkErrorRecovery 6 */
	__u8 _pad1;
	__u32 carrier_changes; /* netdev: IFLA_CARRIER_CHANGES */
	__u32 carrier_up_count;
	__u32 carrier_down_count;
	__u64 rx_packets;
	__u64 tx_packets;
	__u64 rx_bytes;
	__u64 tx_bytes;
	__u64 rx_errors;
	__u64 tx_errors;
	__u64 rx_dropped;
	__u64 tx_dropped;
	__u64 multicast;
	__u64 collisions;
	__u64 rx_length_errors;
	__u64 rx_over_errors;
	__u64 rx_crc_errors;
	__u64 rx_frame_errors;
	__u64 rx_fifo_errors;
	__u64 rx_missed_errors;
	__u64 tx_aborted_errors;
	__u64 tx_carrier_errors;
	__u64 tx_fifo_errors;
	__u64 tx_heartbeat_errors;
	__u64 tx_window_errors;
	__u64 rx_nohandler;
	__u64 rx_otherhost_dropped;
	__u64 symbol_error;
	__u64 port_rcv_errors;
	__u64 port_rcv_remote_physical_errors;
	__u64 port_rcv_switch_relay_errors;
	__u64 link_error_recovery;
	__u64 port_xmit_constraint_errors;
	__u64 port_rcv_constraint_errors;
	__u64 local_link_integrity_errors;
	__u64 excessive_buffer_overrun_errors;
	__u64 port_xmit_data;
	__u64 port_rcv_data;
	__u64 port_xmit_packets;
	__u64 port_rcv_packets;
	__u64 unicast_rcv_packets;
	__u64 unicast_xmit_packets;
	__u64 multicast_rcv_packets;
	__u64 multicast_xmit_packets;
	__u64 link_downed;
	__u64 port_xmit_discards;
	__u64 vl15_dropped;
	__u64 port_xmit_wait;
	__u64 out_of_sequence;
	__u64 packet_seq_err;
	__u64 out_of_buffer;
	__u64 local_ack_timeout_err;
	__u64 rnr_nak_retry_err;
	__u64 implied_nak_seq_err;
	__u64 duplicate_request;
	__u64 req_cqe_error;
	__u64 resp_cqe_error;
	__u64 rx_icrc_encapsulated;
	__u64 roce_adp_retrans;
	__u64 roce_slow_restart;
	__u64 np_ecn_marked_roce_packets;
	__u64 np_cnp_sent;
	__u64 rp_cnp_handled;
	__u64 rp_cnp_ignored;
};
_Static_assert(sizeof(struct link_event) == 544, "link_event size");
_Static_assert(__builtin_offsetof(struct link_event, after_ns) == 32, "link_event.after_ns");
_Static_assert(__builtin_offsetof(struct link_event, link) == 40, "link_event.link");
_Static_assert(__builtin_offsetof(struct link_event, link_kind) == 44, "link_event.link_kind");
_Static_assert(__builtin_offsetof(struct link_event, event) == 45, "link_event.event");
_Static_assert(__builtin_offsetof(struct link_event, carrier) == 46, "link_event.carrier");
_Static_assert(__builtin_offsetof(struct link_event, admin_up) == 47, "link_event.admin_up");
_Static_assert(__builtin_offsetof(struct link_event, operstate) == 48, "link_event.operstate");
_Static_assert(__builtin_offsetof(struct link_event, port_state) == 49, "link_event.port_state");
_Static_assert(__builtin_offsetof(struct link_event, phys_state) == 50, "link_event.phys_state");
_Static_assert(__builtin_offsetof(struct link_event, _pad1) == 51, "link_event._pad1");
_Static_assert(__builtin_offsetof(struct link_event, carrier_changes) == 52, "link_event.carrier_changes");
_Static_assert(__builtin_offsetof(struct link_event, carrier_up_count) == 56, "link_event.carrier_up_count");
_Static_assert(__builtin_offsetof(struct link_event, carrier_down_count) == 60, "link_event.carrier_down_count");
_Static_assert(__builtin_offsetof(struct link_event, rx_packets) == 64, "link_event.rx_packets");
_Static_assert(__builtin_offsetof(struct link_event, tx_packets) == 72, "link_event.tx_packets");
_Static_assert(__builtin_offsetof(struct link_event, rx_bytes) == 80, "link_event.rx_bytes");
_Static_assert(__builtin_offsetof(struct link_event, tx_bytes) == 88, "link_event.tx_bytes");
_Static_assert(__builtin_offsetof(struct link_event, rx_errors) == 96, "link_event.rx_errors");
_Static_assert(__builtin_offsetof(struct link_event, tx_errors) == 104, "link_event.tx_errors");
_Static_assert(__builtin_offsetof(struct link_event, rx_dropped) == 112, "link_event.rx_dropped");
_Static_assert(__builtin_offsetof(struct link_event, tx_dropped) == 120, "link_event.tx_dropped");
_Static_assert(__builtin_offsetof(struct link_event, multicast) == 128, "link_event.multicast");
_Static_assert(__builtin_offsetof(struct link_event, collisions) == 136, "link_event.collisions");
_Static_assert(__builtin_offsetof(struct link_event, rx_length_errors) == 144, "link_event.rx_length_errors");
_Static_assert(__builtin_offsetof(struct link_event, rx_over_errors) == 152, "link_event.rx_over_errors");
_Static_assert(__builtin_offsetof(struct link_event, rx_crc_errors) == 160, "link_event.rx_crc_errors");
_Static_assert(__builtin_offsetof(struct link_event, rx_frame_errors) == 168, "link_event.rx_frame_errors");
_Static_assert(__builtin_offsetof(struct link_event, rx_fifo_errors) == 176, "link_event.rx_fifo_errors");
_Static_assert(__builtin_offsetof(struct link_event, rx_missed_errors) == 184, "link_event.rx_missed_errors");
_Static_assert(__builtin_offsetof(struct link_event, tx_aborted_errors) == 192, "link_event.tx_aborted_errors");
_Static_assert(__builtin_offsetof(struct link_event, tx_carrier_errors) == 200, "link_event.tx_carrier_errors");
_Static_assert(__builtin_offsetof(struct link_event, tx_fifo_errors) == 208, "link_event.tx_fifo_errors");
_Static_assert(__builtin_offsetof(struct link_event, tx_heartbeat_errors) == 216, "link_event.tx_heartbeat_errors");
_Static_assert(__builtin_offsetof(struct link_event, tx_window_errors) == 224, "link_event.tx_window_errors");
_Static_assert(__builtin_offsetof(struct link_event, rx_nohandler) == 232, "link_event.rx_nohandler");
_Static_assert(__builtin_offsetof(struct link_event, rx_otherhost_dropped) == 240, "link_event.rx_otherhost_dropped");
_Static_assert(__builtin_offsetof(struct link_event, symbol_error) == 248, "link_event.symbol_error");
_Static_assert(__builtin_offsetof(struct link_event, port_rcv_errors) == 256, "link_event.port_rcv_errors");
_Static_assert(__builtin_offsetof(struct link_event, port_rcv_remote_physical_errors) == 264, "link_event.port_rcv_remote_physical_errors");
_Static_assert(__builtin_offsetof(struct link_event, port_rcv_switch_relay_errors) == 272, "link_event.port_rcv_switch_relay_errors");
_Static_assert(__builtin_offsetof(struct link_event, link_error_recovery) == 280, "link_event.link_error_recovery");
_Static_assert(__builtin_offsetof(struct link_event, port_xmit_constraint_errors) == 288, "link_event.port_xmit_constraint_errors");
_Static_assert(__builtin_offsetof(struct link_event, port_rcv_constraint_errors) == 296, "link_event.port_rcv_constraint_errors");
_Static_assert(__builtin_offsetof(struct link_event, local_link_integrity_errors) == 304, "link_event.local_link_integrity_errors");
_Static_assert(__builtin_offsetof(struct link_event, excessive_buffer_overrun_errors) == 312, "link_event.excessive_buffer_overrun_errors");
_Static_assert(__builtin_offsetof(struct link_event, port_xmit_data) == 320, "link_event.port_xmit_data");
_Static_assert(__builtin_offsetof(struct link_event, port_rcv_data) == 328, "link_event.port_rcv_data");
_Static_assert(__builtin_offsetof(struct link_event, port_xmit_packets) == 336, "link_event.port_xmit_packets");
_Static_assert(__builtin_offsetof(struct link_event, port_rcv_packets) == 344, "link_event.port_rcv_packets");
_Static_assert(__builtin_offsetof(struct link_event, unicast_rcv_packets) == 352, "link_event.unicast_rcv_packets");
_Static_assert(__builtin_offsetof(struct link_event, unicast_xmit_packets) == 360, "link_event.unicast_xmit_packets");
_Static_assert(__builtin_offsetof(struct link_event, multicast_rcv_packets) == 368, "link_event.multicast_rcv_packets");
_Static_assert(__builtin_offsetof(struct link_event, multicast_xmit_packets) == 376, "link_event.multicast_xmit_packets");
_Static_assert(__builtin_offsetof(struct link_event, link_downed) == 384, "link_event.link_downed");
_Static_assert(__builtin_offsetof(struct link_event, port_xmit_discards) == 392, "link_event.port_xmit_discards");
_Static_assert(__builtin_offsetof(struct link_event, vl15_dropped) == 400, "link_event.vl15_dropped");
_Static_assert(__builtin_offsetof(struct link_event, port_xmit_wait) == 408, "link_event.port_xmit_wait");
_Static_assert(__builtin_offsetof(struct link_event, out_of_sequence) == 416, "link_event.out_of_sequence");
_Static_assert(__builtin_offsetof(struct link_event, packet_seq_err) == 424, "link_event.packet_seq_err");
_Static_assert(__builtin_offsetof(struct link_event, out_of_buffer) == 432, "link_event.out_of_buffer");
_Static_assert(__builtin_offsetof(struct link_event, local_ack_timeout_err) == 440, "link_event.local_ack_timeout_err");
_Static_assert(__builtin_offsetof(struct link_event, rnr_nak_retry_err) == 448, "link_event.rnr_nak_retry_err");
_Static_assert(__builtin_offsetof(struct link_event, implied_nak_seq_err) == 456, "link_event.implied_nak_seq_err");
_Static_assert(__builtin_offsetof(struct link_event, duplicate_request) == 464, "link_event.duplicate_request");
_Static_assert(__builtin_offsetof(struct link_event, req_cqe_error) == 472, "link_event.req_cqe_error");
_Static_assert(__builtin_offsetof(struct link_event, resp_cqe_error) == 480, "link_event.resp_cqe_error");
_Static_assert(__builtin_offsetof(struct link_event, rx_icrc_encapsulated) == 488, "link_event.rx_icrc_encapsulated");
_Static_assert(__builtin_offsetof(struct link_event, roce_adp_retrans) == 496, "link_event.roce_adp_retrans");
_Static_assert(__builtin_offsetof(struct link_event, roce_slow_restart) == 504, "link_event.roce_slow_restart");
_Static_assert(__builtin_offsetof(struct link_event, np_ecn_marked_roce_packets) == 512, "link_event.np_ecn_marked_roce_packets");
_Static_assert(__builtin_offsetof(struct link_event, np_cnp_sent) == 520, "link_event.np_cnp_sent");
_Static_assert(__builtin_offsetof(struct link_event, rp_cnp_handled) == 528, "link_event.rp_cnp_handled");
_Static_assert(__builtin_offsetof(struct link_event, rp_cnp_ignored) == 536, "link_event.rp_cnp_ignored");

/* One job connection's struct tcp_info, sampled by the agent each second
 * (recorder.netsamples: sock_diag), one row per connection per sample.  The
 * header's pid is the process that holds it (0: unknown), tid 0.  A value
 * the running kernel does not give is unknown: all ones in its width.
 */
struct conn_sample {
	struct event_header hdr;
	__u8 saddr[16]; /* this end's address; IPv4 in the first 4 bytes */
	__u8 daddr[16]; /* the peer's */
	__u16 sport;
	__u16 dport;
	__u16 family; /* AF_INET or AF_INET6 */
	__u8 state; /* TCP state (TCP_ESTABLISHED 1 ...) */
	__u8 ca_state; /* congestion control state: Open 0, Disorder 1, CWR 2, Recovery 3, Loss 4 */
	__u32 ifindex; /* the interface holding saddr (lo's for a local peer) */
	__u8 backoff; /* retransmission timeouts in a row, unanswered */
	__u8 retransmits; /* icsk_retransmits: retransmissions of the head, unanswered */
	__u8 delivery_rate_app_limited; /* 1: the rate was limited by the sender */
	__u8 _pad1;
	__u32 rto_us; /* retransmission timeout */
	__u32 srtt_us; /* smoothed round-trip time */
	__u32 rttvar_us;
	__u32 min_rtt_us; /* the lowest RTT seen (windowed) */
	__u32 snd_cwnd; /* congestion window, segments */
	__u32 snd_mss;
	__u32 pmtu; /* the path MTU the connection uses */
	__u32 unacked; /* segments sent and not acknowledged (packets_out) */
	__u32 retrans_out; /* of them, retransmitted */
	__u32 lost; /* of them, deemed lost */
	__u32 total_retrans; /* segments retransmitted over the connection's life */
	__u32 notsent_bytes; /* written by the application, not yet sent */
	__u32 last_data_sent_ms; /* since data was last sent */
	__u32 last_data_recv_ms; /* since data was last received */
	__u32 last_ack_recv_ms; /* since the peer last acknowledged anything */
	__u32 segs_out;
	__u32 segs_in;
	__u32 snd_wnd; /* the peer's receive window, bytes */
	__u64 delivery_rate; /* bytes/s, the latest sample */
	__u64 bytes_acked;
	__u64 bytes_received;
	__u64 bytes_sent; /* retransmissions included */
	__u64 bytes_retrans;
	__u64 busy_time_us; /* time with data in flight */
	__u64 rwnd_limited_us; /* of it, limited by the peer's receive window */
	__u64 sndbuf_limited_us; /* of it, limited by the send buffer */
};
_Static_assert(sizeof(struct conn_sample) == 216, "conn_sample size");
_Static_assert(__builtin_offsetof(struct conn_sample, saddr) == 32, "conn_sample.saddr");
_Static_assert(__builtin_offsetof(struct conn_sample, daddr) == 48, "conn_sample.daddr");
_Static_assert(__builtin_offsetof(struct conn_sample, sport) == 64, "conn_sample.sport");
_Static_assert(__builtin_offsetof(struct conn_sample, dport) == 66, "conn_sample.dport");
_Static_assert(__builtin_offsetof(struct conn_sample, family) == 68, "conn_sample.family");
_Static_assert(__builtin_offsetof(struct conn_sample, state) == 70, "conn_sample.state");
_Static_assert(__builtin_offsetof(struct conn_sample, ca_state) == 71, "conn_sample.ca_state");
_Static_assert(__builtin_offsetof(struct conn_sample, ifindex) == 72, "conn_sample.ifindex");
_Static_assert(__builtin_offsetof(struct conn_sample, backoff) == 76, "conn_sample.backoff");
_Static_assert(__builtin_offsetof(struct conn_sample, retransmits) == 77, "conn_sample.retransmits");
_Static_assert(__builtin_offsetof(struct conn_sample, delivery_rate_app_limited) == 78, "conn_sample.delivery_rate_app_limited");
_Static_assert(__builtin_offsetof(struct conn_sample, _pad1) == 79, "conn_sample._pad1");
_Static_assert(__builtin_offsetof(struct conn_sample, rto_us) == 80, "conn_sample.rto_us");
_Static_assert(__builtin_offsetof(struct conn_sample, srtt_us) == 84, "conn_sample.srtt_us");
_Static_assert(__builtin_offsetof(struct conn_sample, rttvar_us) == 88, "conn_sample.rttvar_us");
_Static_assert(__builtin_offsetof(struct conn_sample, min_rtt_us) == 92, "conn_sample.min_rtt_us");
_Static_assert(__builtin_offsetof(struct conn_sample, snd_cwnd) == 96, "conn_sample.snd_cwnd");
_Static_assert(__builtin_offsetof(struct conn_sample, snd_mss) == 100, "conn_sample.snd_mss");
_Static_assert(__builtin_offsetof(struct conn_sample, pmtu) == 104, "conn_sample.pmtu");
_Static_assert(__builtin_offsetof(struct conn_sample, unacked) == 108, "conn_sample.unacked");
_Static_assert(__builtin_offsetof(struct conn_sample, retrans_out) == 112, "conn_sample.retrans_out");
_Static_assert(__builtin_offsetof(struct conn_sample, lost) == 116, "conn_sample.lost");
_Static_assert(__builtin_offsetof(struct conn_sample, total_retrans) == 120, "conn_sample.total_retrans");
_Static_assert(__builtin_offsetof(struct conn_sample, notsent_bytes) == 124, "conn_sample.notsent_bytes");
_Static_assert(__builtin_offsetof(struct conn_sample, last_data_sent_ms) == 128, "conn_sample.last_data_sent_ms");
_Static_assert(__builtin_offsetof(struct conn_sample, last_data_recv_ms) == 132, "conn_sample.last_data_recv_ms");
_Static_assert(__builtin_offsetof(struct conn_sample, last_ack_recv_ms) == 136, "conn_sample.last_ack_recv_ms");
_Static_assert(__builtin_offsetof(struct conn_sample, segs_out) == 140, "conn_sample.segs_out");
_Static_assert(__builtin_offsetof(struct conn_sample, segs_in) == 144, "conn_sample.segs_in");
_Static_assert(__builtin_offsetof(struct conn_sample, snd_wnd) == 148, "conn_sample.snd_wnd");
_Static_assert(__builtin_offsetof(struct conn_sample, delivery_rate) == 152, "conn_sample.delivery_rate");
_Static_assert(__builtin_offsetof(struct conn_sample, bytes_acked) == 160, "conn_sample.bytes_acked");
_Static_assert(__builtin_offsetof(struct conn_sample, bytes_received) == 168, "conn_sample.bytes_received");
_Static_assert(__builtin_offsetof(struct conn_sample, bytes_sent) == 176, "conn_sample.bytes_sent");
_Static_assert(__builtin_offsetof(struct conn_sample, bytes_retrans) == 184, "conn_sample.bytes_retrans");
_Static_assert(__builtin_offsetof(struct conn_sample, busy_time_us) == 192, "conn_sample.busy_time_us");
_Static_assert(__builtin_offsetof(struct conn_sample, rwnd_limited_us) == 200, "conn_sample.rwnd_limited_us");
_Static_assert(__builtin_offsetof(struct conn_sample, sndbuf_limited_us) == 208, "conn_sample.sndbuf_limited_us");

/* One job interface's counters (rtnetlink: the netdev's 64-bit counters
 * and its root qdisc's statistics), sampled by the agent each second
 * (recorder.netsamples) for every interface a job connection uses.  The
 * header's pid and tid are 0.  Unknown values are all ones in their width;
 * counters count since the interface (or its qdisc) was made.
 */
struct iface_sample {
	struct event_header hdr;
	__u32 ifindex;
	__u32 mtu;
	__u8 name[16]; /* the netdev's name, NUL-padded */
	__u8 qdisc_kind[16]; /* its root qdisc (tbf, htb, fq_codel, noqueue...), NUL-padded */
	__u64 rx_bytes;
	__u64 tx_bytes;
	__u64 rx_packets;
	__u64 tx_packets;
	__u64 rx_dropped;
	__u64 tx_dropped;
	__u64 rx_errors;
	__u64 tx_errors;
	__u64 qdisc_bytes; /* bytes the root qdisc sent */
	__u32 qdisc_packets;
	__u32 qdisc_drops;
	__u32 qdisc_overlimits;
	__u32 qdisc_requeues;
	__u32 qdisc_backlog_bytes;
	__u32 qdisc_backlog_packets;
	__u32 qdisc_handle;
	__u32 _pad1;
};
_Static_assert(sizeof(struct iface_sample) == 176, "iface_sample size");
_Static_assert(__builtin_offsetof(struct iface_sample, ifindex) == 32, "iface_sample.ifindex");
_Static_assert(__builtin_offsetof(struct iface_sample, mtu) == 36, "iface_sample.mtu");
_Static_assert(__builtin_offsetof(struct iface_sample, name) == 40, "iface_sample.name");
_Static_assert(__builtin_offsetof(struct iface_sample, qdisc_kind) == 56, "iface_sample.qdisc_kind");
_Static_assert(__builtin_offsetof(struct iface_sample, rx_bytes) == 72, "iface_sample.rx_bytes");
_Static_assert(__builtin_offsetof(struct iface_sample, tx_bytes) == 80, "iface_sample.tx_bytes");
_Static_assert(__builtin_offsetof(struct iface_sample, rx_packets) == 88, "iface_sample.rx_packets");
_Static_assert(__builtin_offsetof(struct iface_sample, tx_packets) == 96, "iface_sample.tx_packets");
_Static_assert(__builtin_offsetof(struct iface_sample, rx_dropped) == 104, "iface_sample.rx_dropped");
_Static_assert(__builtin_offsetof(struct iface_sample, tx_dropped) == 112, "iface_sample.tx_dropped");
_Static_assert(__builtin_offsetof(struct iface_sample, rx_errors) == 120, "iface_sample.rx_errors");
_Static_assert(__builtin_offsetof(struct iface_sample, tx_errors) == 128, "iface_sample.tx_errors");
_Static_assert(__builtin_offsetof(struct iface_sample, qdisc_bytes) == 136, "iface_sample.qdisc_bytes");
_Static_assert(__builtin_offsetof(struct iface_sample, qdisc_packets) == 144, "iface_sample.qdisc_packets");
_Static_assert(__builtin_offsetof(struct iface_sample, qdisc_drops) == 148, "iface_sample.qdisc_drops");
_Static_assert(__builtin_offsetof(struct iface_sample, qdisc_overlimits) == 152, "iface_sample.qdisc_overlimits");
_Static_assert(__builtin_offsetof(struct iface_sample, qdisc_requeues) == 156, "iface_sample.qdisc_requeues");
_Static_assert(__builtin_offsetof(struct iface_sample, qdisc_backlog_bytes) == 160, "iface_sample.qdisc_backlog_bytes");
_Static_assert(__builtin_offsetof(struct iface_sample, qdisc_backlog_packets) == 164, "iface_sample.qdisc_backlog_packets");
_Static_assert(__builtin_offsetof(struct iface_sample, qdisc_handle) == 168, "iface_sample.qdisc_handle");
_Static_assert(__builtin_offsetof(struct iface_sample, _pad1) == 172, "iface_sample._pad1");

/* Probes between the job's nodes at an incident (recorder.pathprobe sends
 * them, each agent's recorder.pathecho answers and counts what arrives), one
 * row per peer, kind and size: the header's ts_ns is the first probe's
 * (sent or arrived), pid and tid 0.  Unknown values are all ones in their
 * width (rtt_us with nothing answered, mtu but for FRAG_NEEDED).
 */
struct probe_event {
	struct event_header hdr;
	__u8 incident[48]; /* the incident id the probes were sent for, NUL-padded */
	__u8 saddr[16]; /* where the probes came from: this host when sent, else the peer */
	__u8 daddr[16]; /* where they went */
	__u16 family;
	__u8 probe; /* PROBE_* */
	__u8 role; /* PROBEROLE_* */
	__u8 outcome; /* PROBEOUT_* */
	__u8 df; /* 1: sent with don't-fragment */
	__u16 _pad1;
	__u32 ifindex; /* this host's interface (sent: the source's; received: where) */
	__u32 probe_size; /* bytes of each IP packet (tcp: of the exchange's payload) */
	__u32 sent; /* probes sent (tcp: exchanges) */
	__u32 answered; /* sent: answers back here; received: probes that arrived */
	__u32 rtt_us; /* median round trip of the answered (tcp: the probe's srtt) */
	__u32 mtu; /* FRAG_NEEDED: the MTU the ICMP named */
	__s32 err; /* ERROR: the errno */
	__u32 _pad2;
	__u64 round; /* the sender's round: one per incident and host, random */
	__u64 throughput_bps; /* tcp: bits/s of the exchange */
	__u64 bytes_sent; /* IP packets' bytes this host sent (tcp: payload taken) */
	__u64 bytes_received; /* received for the row (tcp: payload confirmed, read) */
	__u64 duration_us; /* first probe sent (arrived) to last answer, 0: none */
};
_Static_assert(sizeof(struct probe_event) == 192, "probe_event size");
_Static_assert(__builtin_offsetof(struct probe_event, incident) == 32, "probe_event.incident");
_Static_assert(__builtin_offsetof(struct probe_event, saddr) == 80, "probe_event.saddr");
_Static_assert(__builtin_offsetof(struct probe_event, daddr) == 96, "probe_event.daddr");
_Static_assert(__builtin_offsetof(struct probe_event, family) == 112, "probe_event.family");
_Static_assert(__builtin_offsetof(struct probe_event, probe) == 114, "probe_event.probe");
_Static_assert(__builtin_offsetof(struct probe_event, role) == 115, "probe_event.role");
_Static_assert(__builtin_offsetof(struct probe_event, outcome) == 116, "probe_event.outcome");
_Static_assert(__builtin_offsetof(struct probe_event, df) == 117, "probe_event.df");
_Static_assert(__builtin_offsetof(struct probe_event, _pad1) == 118, "probe_event._pad1");
_Static_assert(__builtin_offsetof(struct probe_event, ifindex) == 120, "probe_event.ifindex");
_Static_assert(__builtin_offsetof(struct probe_event, probe_size) == 124, "probe_event.probe_size");
_Static_assert(__builtin_offsetof(struct probe_event, sent) == 128, "probe_event.sent");
_Static_assert(__builtin_offsetof(struct probe_event, answered) == 132, "probe_event.answered");
_Static_assert(__builtin_offsetof(struct probe_event, rtt_us) == 136, "probe_event.rtt_us");
_Static_assert(__builtin_offsetof(struct probe_event, mtu) == 140, "probe_event.mtu");
_Static_assert(__builtin_offsetof(struct probe_event, err) == 144, "probe_event.err");
_Static_assert(__builtin_offsetof(struct probe_event, _pad2) == 148, "probe_event._pad2");
_Static_assert(__builtin_offsetof(struct probe_event, round) == 152, "probe_event.round");
_Static_assert(__builtin_offsetof(struct probe_event, throughput_bps) == 160, "probe_event.throughput_bps");
_Static_assert(__builtin_offsetof(struct probe_event, bytes_sent) == 168, "probe_event.bytes_sent");
_Static_assert(__builtin_offsetof(struct probe_event, bytes_received) == 176, "probe_event.bytes_received");
_Static_assert(__builtin_offsetof(struct probe_event, duration_us) == 184, "probe_event.duration_us");

/* Discovery: not a dump ring.  The agent reads it each tick instead of
 * scanning /proc; one row per event, the pid in the header.
 */
struct disc_event {
	struct event_header hdr;
	__u32 event; /* DISC_* */
	__u32 _pad1;
};
_Static_assert(sizeof(struct disc_event) == 40, "disc_event size");
_Static_assert(__builtin_offsetof(struct disc_event, event) == 32, "disc_event.event");
_Static_assert(__builtin_offsetof(struct disc_event, _pad1) == 36, "disc_event._pad1");

#endif

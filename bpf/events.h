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

/* `exit_event.event`. */
#define EXITEV_EXIT_GROUP 1
#define EXITEV_SIGNAL 2
#define EXITEV_PROCESS_EXIT 3

/* `disc_event.event`: what tells the agent a process may map a new library. */
#define DISC_EXEC 1
#define DISC_LINKMAP 2

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
 * row is completed right after it is written), resets their reason.
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
	__u8 _pad1;
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
_Static_assert(__builtin_offsetof(struct tcp_event, _pad1) == 119, "tcp_event._pad1");
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

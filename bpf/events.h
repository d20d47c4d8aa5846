/* Event records shared by every stallwatch BPF program and mirrored by the
 * numpy dtypes in dumpers/schema.py (tests/dumpers/test_schema.py pins both sides).
 *
 * Every record begins with struct event_header.  Records live in rings that
 * the BPF programs write directly: an mmapable BPF array of RING_SLOTS slots
 * and a head counter.  A writer claims position `p` with an atomic add on the
 * head, fills slot p % RING_SLOTS, and writes `pos = p + 1` last; a reader
 * trusts a slot only when its `pos` equals the position it expects, which
 * detects slots that are still being written or were overwritten.
 *
 * Padding is explicit and every size is pinned with _Static_assert.
 */
#ifndef STALLWATCH_EVENTS_H
#define STALLWATCH_EVENTS_H

#define EVENT_NCCL 1
#define EVENT_COMM 2
#define EVENT_TCP 3
#define EVENT_SCHED 4
#define EVENT_EXIT 5
#define EVENT_DISC 16 /* discovery: not a dump ring */

/* NCCL call kinds (nccl_event.op, comm_event.op). */
#define OP_UNKNOWN 0
#define OP_ALL_REDUCE 1
#define OP_ALL_GATHER 2
#define OP_REDUCE_SCATTER 3
#define OP_BROADCAST 4 /* ncclBroadcast and ncclBcast */
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
#define OP_BARRIER 21 /* never recorded here: Flight Recorder dumps name it */
#define OP_GRAPH_LAUNCH 22 /* cudaGraphLaunch of a graph that captured NCCL calls */

/* Lifecycle: the furthest state a call reached, as the host observed it. */
#define STATE_SCHEDULED 0 /* the host entered the call */
#define STATE_ENQUEUED 1  /* the call returned: queued on its stream (or done, if blocking) */
#define STATE_STARTED 2   /* the device began it (its start event was seen done) */
#define STATE_COMPLETED 3 /* the device finished it (its end event, or a sync, was seen done) */

/* tcp_event.event */
#define TCP_RETRANSMIT_SKB 1
#define TCP_SET_STATE 2

/* disc_event.event: what tells the agent a process may map a new library */
#define DISC_EXEC 1     /* sched_process_exec: a new program image */
#define DISC_LINKMAP 2  /* the dynamic loader's _dl_debug_state(): libraries came or went */

/* exit_event.event */
#define EXIT_GROUP 1      /* exit code seen (uprobe on libc _exit(status)) */
#define EXIT_SIGNAL 2     /* fatal signal generated for or delivered to it */
#define EXIT_PROCESS 3    /* the thread group is dead (sched_process_exit) */

#define RESULT_PENDING (-1)

struct event_header {
	__u64 pos;    /* ring position + 1, written last; 0 = never written */
	__u64 ts_ns;  /* bpf_ktime_get_ns(): CLOCK_MONOTONIC */
	__u16 kind;   /* EVENT_* */
	__u16 size;   /* sizeof the whole record */
	__u32 pid;    /* thread group id (owner process for tcp events) */
	__u32 tid;
	__u32 _pad0;
};
_Static_assert(sizeof(struct event_header) == 32, "event_header size");

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
 * saying where it came from. */
struct nccl_event {
	struct event_header hdr;
	__u64 end_ns;     /* return time, 0 while in flight */
	__u64 comm;       /* ncclComm_t as a pointer value */
	__u64 comm_hash;  /* folded ncclUniqueId, 0 if the comm is unknown */
	__u64 count;      /* elements */
	__u64 bytes;      /* count * sizeof(datatype) */
	__u64 stream;
	__u64 seq;        /* per-communicator (p2p: per peer and direction) */
	__s32 rank;       /* rank in comm, -1 if unknown */
	__s32 nranks;
	__s32 peer;       /* root or peer, -1 if none */
	__s32 result;     /* ncclResult_t, RESULT_PENDING while in flight */
	__u8 op;
	__u8 datatype;
	__u8 redop;
	__u8 state;
	__u32 graph_node; /* 1-based place of the call in its graph's capture, 0: none */
	__u64 started_ns;
	__u64 started_after_ns;
	__u64 completed_ns;
	__u64 completed_after_ns;
	__u64 graph;      /* the process's capture number (1-based), 0: not in a graph */
	__u64 replay;     /* the graph executable's launch number (1-based), 0: not a replay */
};
_Static_assert(sizeof(struct nccl_event) == 160, "nccl_event size");

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

struct tcp_event {
	struct event_header hdr; /* pid: owning process, 0 if unknown */
	__u64 skaddr;
	__u8 saddr[16]; /* IPv4 in the first 4 bytes when family == AF_INET */
	__u8 daddr[16];
	__u16 sport;
	__u16 dport;
	__u16 family;
	__u8 event;     /* TCP_* */
	__u8 _pad1;
	__s32 state;    /* tcp state (old state for TCP_SET_STATE) */
	__s32 newstate; /* TCP_SET_STATE only */
};
_Static_assert(sizeof(struct tcp_event) == 88, "tcp_event size");

/* A rank thread that waited in the run queue longer than the threshold.
 * prev_pid: the process (tgid) that held the CPU until the thread got it,
 * 0 for the idle task.  Only the last holder is known: a long wait may have
 * seen others run before it.  Dumps before format 5 had padding here; their
 * rows read as -1 (unknown). */
struct sched_event {
	struct event_header hdr;
	__u64 delay_ns;
	__u32 cpu;
	__s32 prev_pid;
};
_Static_assert(sizeof(struct sched_event) == 48, "sched_event size");

struct exit_event {
	struct event_header hdr;
	__s32 code;   /* exit_group code, or -1 */
	__s32 signal; /* fatal signal number, or 0 */
	__u8 event;   /* EXIT_* */
	__u8 _pad1[7];
};
_Static_assert(sizeof(struct exit_event) == 48, "exit_event size");

/* Discovery: not a dump ring.  The agent reads it each tick instead of
 * scanning /proc; one row per event, the pid in the header. */
struct disc_event {
	struct event_header hdr;
	__u32 event; /* DISC_* */
	__u32 _pad1;
};
_Static_assert(sizeof(struct disc_event) == 40, "disc_event size");

#endif

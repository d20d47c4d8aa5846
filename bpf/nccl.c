/* NCCL API calls, by uprobe at entry and uretprobe at return (x86-64 SysV).
 *
 * One entry program per symbol (SYM_<symbol>, defined by recorder/probes.py
 * through cflags, selects its argument layout), attached through a
 * uprobe_multi link (6.6+) or, on older kernels, a perf event.
 *
 * Every call is one row of `nccl_ring`: opened at entry (state SCHEDULED,
 * result -1) and completed at return (result, end time, state ENQUEUED last).
 * A collective's position is queued on its stream (cuda.h) when CUDA probes
 * are attached, for cuda.c to add its device start and completion; on a
 * stream being captured into a CUDA graph it is recorded as captured instead
 * (no seq: cuda.c numbers its replays).
 * Lifecycle calls also write a row of the small `comm_ring`, so that the
 * communicator table never depends on the big ring.  `comm_states` holds
 * each (pid, ncclComm_t)'s folded ncclUniqueId, rank, nranks and progress.
 *
 * Only probe arguments, user memory and helpers are read: no kernel struct.
 */
#include "common.h"
#include "cuda.h"

#define MAX_COMMS 8192
#define MAX_INFLIGHT 8192
#define MAX_P2P 16384
#define INIT_ALL_MAX 8

BPF_F_TABLE("array", u32, struct nccl_event, nccl_ring, NCCL_RING_SLOTS, BPF_F_MMAPABLE);
BPF_F_TABLE("array", u32, struct comm_event, comm_ring, COMM_RING_SLOTS, BPF_F_MMAPABLE);

static __always_inline struct nccl_event *claim_nccl(u64 *pos)
{
	*pos = claim_position(RING_NCCL);
	u32 slot = slot_of(*pos, NCCL_RING_SLOTS);
	struct nccl_event *row = *pos ? nccl_ring.lookup(&slot) : NULL;
	if (!row)
		count_drop(RING_NCCL);
	return row;
}

static __always_inline struct comm_event *claim_comm(u64 *pos)
{
	*pos = claim_position(RING_COMM);
	u32 slot = slot_of(*pos, COMM_RING_SLOTS);
	struct comm_event *row = *pos ? comm_ring.lookup(&slot) : NULL;
	if (!row)
		count_drop(RING_COMM);
	return row;
}

struct comm_key {
	u32 pid;
	u32 _pad;
	u64 comm;
};

/* NCCL requires the calls on one communicator to be made one at a time (by
 * one thread, or serialized by the caller): its counters are updated with
 * plain stores, not atomics (a lock-prefixed add costs ~20 ns a call). */
struct comm_state {
	u64 comm;           /* claim word: 0 while the slot is free */
	u32 pid;            /* written last: the slot is (pid, comm)'s once set */
	u32 destroyed;
	u64 hash;
	s32 rank;
	s32 nranks;
	u64 seq;            /* collectives entered on this communicator */
	u64 last_enter_ns;
	u64 last_pos;       /* nccl_ring position + 1 of its last call: user space
			     * reads that row's end_ns, so a return touches no
			     * communicator state */
	u64 calls;          /* collective + p2p calls entered */
	u64 split_count;    /* ncclCommSplit calls made on it */
	u64 init_ns;
	u64 destroy_ns;
};
_Static_assert(sizeof(struct comm_state) == 88, "comm_state size");

/* Communicator states live in an array, each at its home slot (a multiply
 * of (pid, ncclComm_t)) when free, else one of the next COMM_PROBES: a call
 * finds its communicator at home with an array lookup the verifier inlines,
 * where a hash map lookup costs ~80 ns.  `comms` says where each one is, for
 * the few not at home; the array has twice as many slots as `comms` holds
 * entries, so most are.  User space reads the array (mmapped) and frees a
 * dead process's slots. */
#define COMM_SLOTS_LOG2 14
#define COMM_SLOTS (1 << COMM_SLOTS_LOG2)
#define COMM_PROBES 32
_Static_assert(COMM_SLOTS >= 2 * MAX_COMMS, "comm_states load");
BPF_F_TABLE("array", u32, struct comm_state, comm_states, COMM_SLOTS, BPF_F_MMAPABLE);
BPF_HASH(comms, struct comm_key, u32, MAX_COMMS);

struct p2p_key {
	u32 pid;
	s32 peer;
	u64 comm;
	u32 op;
	u32 _pad;
};
BPF_HASH(p2p_seq, struct p2p_key, u64, MAX_P2P);

/* One slot per thread inside an NCCL call, at tid & (MAX_INFLIGHT - 1): an
 * mmapable array, not a hash, so that entry and return pay no hash update or
 * delete and user space reads in-flight calls through numpy.  A thread claims
 * its slot by compare-and-swap of `tid` (0 = free); a slot held by another
 * thread whose tid collides is counted as a drop.  A call made from inside
 * another (a library calling its own public symbol: its stack pointer is
 * below the outer call's) only bumps `depth`.
 * `entered_ns` is 0 while a slot is free or being filled. */
struct call_state {
	u64 tid;         /* 64 bits: BPF's 32-bit compare-and-swap needs -mcpu=v3 */
	u64 entered_ns;
	u64 pos;         /* nccl_ring position + 1 */
	u64 comm_pos;    /* comm_ring position + 1, 0 if none */
	u64 comm;
	u64 comm_hash;
	u64 parent_hash; /* split */
	u64 seq;
	u64 out;         /* user pointer the call writes: ncclComm_t*, id* */
	u64 split_index;
	s32 rank;
	s32 nranks;
	s32 color;
	s32 key;
	u32 depth;
	u32 op;
	u32 pid;
	u32 _pad;
	u64 sp;          /* the stack pointer at entry: a nested call's is lower */
};
_Static_assert(sizeof(struct call_state) == 120, "call_state size");
BPF_F_TABLE("array", u32, struct call_state, inflight, MAX_INFLIGHT, BPF_F_MMAPABLE);

static __always_inline struct call_state *inflight_slot(u32 tid)
{
	u32 slot = tid & (MAX_INFLIGHT - 1);
	return inflight.lookup(&slot);
}

/* Free a slot: its time first, so a reader never sees a stale call. */
static __always_inline void release_slot(struct call_state *slot)
{
	*(volatile __u64 *)&slot->entered_ns = 0;
	asm volatile("" ::: "memory");
	*(volatile __u64 *)&slot->tid = 0;
}

/* Arguments of one call, as decoded by its entry program. */
struct call_args {
	u64 comm;
	u64 count;
	u64 stream;
	u64 out;
	s32 peer;
	s32 rank;
	s32 nranks;
	s32 color;
	s32 key;
	u8 datatype;
	u8 redop;
	u8 op;
	u8 _pad;
};

static __always_inline u64 splitmix64(u64 x)
{
	x += 0x9E3779B97F4A7C15ULL;
	u64 z = x;
	z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
	z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
	return z ^ (z >> 31);
}

/* dumpers.schema.fold_unique_id: h = splitmix64(h ^ w) over 16 LE words. */
static __always_inline u64 fold_unique_id(const __u8 *id)
{
	u64 h = 0;
#pragma unroll
	for (int i = 0; i < 16; i++)
		h = splitmix64(h ^ ((const u64 *)id)[i]);
	return h;
}

#define SPLIT_TAG 0x73706C6974636F6DULL

/* dumpers.schema.split_hash */
static __always_inline u64 split_hash(u64 parent, s32 color, u64 index)
{
	u64 h = splitmix64(parent ^ SPLIT_TAG);
	h = splitmix64(h ^ (u64)(u32)color);
	return splitmix64(h ^ index);
}

/* sizeof each ncclDataType_t, 4 bits per type (BPF has no jump tables):
 * int8 uint8 int32 uint32 int64 uint64 f16 f32 f64 bf16 f8e4m3 f8e5m2 */
#define DATATYPE_SIZES 0x112842884411ULL

static __always_inline u64 datatype_size(u8 dt)
{
	return dt < 12 ? (DATATYPE_SIZES >> (4 * dt)) & 0xf : 0;
}

static __always_inline u64 stack_arg(struct pt_regs *ctx, int n)
{
	u64 v = 0;
	bpf_probe_read_user(&v, sizeof(v), (void *)(PT_REGS_SP(ctx) + 8 * n));
	return v;
}

static __always_inline int is_data_op(u8 op)
{
	return op >= OP_ALL_REDUCE && op <= OP_RECV;
}

static __always_inline int is_close_op(u8 op)
{
	return op == OP_COMM_DESTROY || op == OP_COMM_ABORT || op == OP_COMM_FINALIZE;
}

static __always_inline u32 comm_home(u32 pid, u64 comm)
{
	return (u32)(((comm ^ ((u64)pid << 48)) * 0x9E3779B97F4A7C15ULL) >> (64 - COMM_SLOTS_LOG2));
}

static __always_inline struct comm_state *comm_at(u32 idx, u32 pid, u64 comm)
{
	idx &= COMM_SLOTS - 1;
	struct comm_state *st = comm_states.lookup(&idx);
	return st && st->comm == comm && st->pid == pid ? st : NULL;
}

static __always_inline struct comm_state *find_comm(u32 pid, u64 comm)
{
	struct comm_state *st = comm_at(comm_home(pid, comm), pid, comm);
	if (st)
		return st;
	struct comm_key k = {.pid = pid, .comm = comm};
	u32 *idx = comms.lookup(&k);
	return idx ? comm_at(*idx, pid, comm) : NULL;
}

/* Everything but the key: the state of a communicator (re)made. */
static __always_inline void reset_comm(struct comm_state *st, u64 hash, s32 rank, s32 nranks,
				       u64 init_ns)
{
	st->destroyed = 0;
	st->hash = hash;
	st->rank = rank;
	st->nranks = nranks;
	st->seq = 0;
	st->last_enter_ns = 0;
	st->last_pos = 0;
	st->calls = 0;
	st->split_count = 0;
	st->init_ns = init_ns;
	st->destroy_ns = 0;
}

/* A free slot at or after the communicator's home, claimed by compare-and-
 * swap of its `comm` (another CPU may be claiming one too); -1 if none. */
static __always_inline s64 claim_comm_slot(u32 pid, u64 comm)
{
	u32 home = comm_home(pid, comm);
	for (u32 i = 0; i < COMM_PROBES; i++) {
		u32 idx = (home + i) & (COMM_SLOTS - 1);
		struct comm_state *st = comm_states.lookup(&idx);
		if (!st)
			return -1;
		if (st->comm == 0 && __sync_val_compare_and_swap(&st->comm, 0, comm) == 0)
			return idx;
	}
	return -1;
}

static __always_inline void free_comm_slot(struct comm_state *st)
{
	*(volatile __u32 *)&st->pid = 0;
	asm volatile("" ::: "memory");
	*(volatile __u64 *)&st->comm = 0;
}

/* The state of a communicator, made afresh (`remake`: also if known). */
static __always_inline struct comm_state *new_comm(u32 pid, u64 comm, u64 hash, s32 rank,
						   s32 nranks, u64 init_ns, int remake)
{
	struct comm_key k = {.pid = pid, .comm = comm};
	struct comm_state *st = find_comm(pid, comm);
	if (!st) {
		s64 claimed = claim_comm_slot(pid, comm);
		u32 idx = (u32)claimed;
		st = claimed < 0 ? NULL : comm_states.lookup(&idx);
		if (!st) {
			count_drop(DROP_COMMS_FULL);
			return NULL;
		}
		reset_comm(st, hash, rank, nranks, init_ns);
		asm volatile("" ::: "memory");
		*(volatile __u32 *)&st->pid = pid;
		if (comms.insert(&k, &idx) == 0)
			return st;
		/* another thread made it first (or `comms` is full) */
		free_comm_slot(st);
		st = find_comm(pid, comm);
		if (!st) {
			count_drop(DROP_COMMS_FULL);
			return NULL;
		}
	}
	if (remake)
		reset_comm(st, hash, rank, nranks, init_ns);
	return st;
}

static __always_inline struct comm_state *comm_for(u32 pid, u64 comm, int create)
{
	struct comm_state *st = find_comm(pid, comm);
	if (st || !create || !comm)
		return st;
	/* A communicator made before the agent started: progress is still
	 * tracked, its id stays unknown (hash 0). */
	return new_comm(pid, comm, 0, -1, -1, 0, 0);
}

static __always_inline u64 next_p2p_seq(u32 pid, u64 comm, s32 peer, u8 op)
{
	struct p2p_key k = {.pid = pid, .peer = peer, .comm = comm, .op = op};
	u64 zero = 0;
	u64 *n = p2p_seq.lookup_or_try_init(&k, &zero);
	if (!n)
		return 0;
	return (*n)++;
}

/* Updates the communicator's progress at entry; fills hash/rank/seq.
 * Returns its state for a collective or p2p call (NULL otherwise, and for a
 * captured one: it runs only when its graph is launched). */
static __always_inline struct comm_state *enter_comm(struct call_state *cs, struct call_args *a,
						      u64 ts, u64 graph)
{
	struct comm_state *st = comm_for(cs->pid, a->comm, is_data_op(a->op));
	if (!st)
		return NULL;
	cs->comm_hash = st->hash;
	cs->rank = st->rank;
	cs->nranks = st->nranks;
	if (a->op == OP_COMM_SPLIT) {
		cs->parent_hash = st->hash;
		cs->split_index = st->split_count++;
		return NULL;
	}
	if (is_close_op(a->op)) {
		st->destroyed = 1;
		st->destroy_ns = ts;
		return NULL;
	}
	if (graph)
		return NULL;
	if (a->op == OP_SEND || a->op == OP_RECV)
		cs->seq = next_p2p_seq(cs->pid, a->comm, a->peer, a->op);
	else
		cs->seq = st->seq++;
	st->last_enter_ns = ts;
	st->calls++;
	return st;
}

static __always_inline void open_nccl_row(struct call_state *cs, struct call_args *a, u32 tid,
					  u64 ts, struct stream_state *sst, u64 skey)
{
	struct nccl_event *e;
	u64 pos;
	e = claim_nccl(&pos);
	if (!e)
		return;
	fill_header(&e->hdr, EVENT_NCCL, sizeof(*e), cs->pid, tid, ts);
	e->end_ns = 0;
	e->comm = a->comm;
	e->comm_hash = cs->comm_hash;
	e->count = a->count;
	e->bytes = a->count * datatype_size(a->datatype);
	e->stream = a->stream;
	e->seq = cs->seq;
	e->rank = cs->rank;
	e->nranks = cs->nranks;
	e->peer = a->peer;
	e->result = RESULT_PENDING;
	e->op = a->op;
	e->datatype = a->datatype;
	e->redop = a->redop;
	e->state = STATE_SCHEDULED;
	e->started_ns = 0;
	e->started_after_ns = 0;
	e->completed_ns = 0;
	e->completed_after_ns = 0;
	e->replay = 0;
	e->graph = sst ? sst->capture : 0;
	e->graph_node = e->graph ? graph_append(cs->pid, e->graph, a->comm, a->count, a->peer, a->op,
						  a->datatype, a->redop)
				 : 0;
	publish(&e->hdr, pos);
	cs->pos = pos;
	if (sst && !e->graph)
		cuda_enqueue(cs->pid, skey, sst, pos);
}

/* Lifecycle calls: a comm_ring row opened at entry.  InitRank* read the
 * 128-byte id from the caller's stack (passed by value) and fold it. */
static __always_inline void open_comm_row(struct pt_regs *ctx, struct call_state *cs,
					  struct call_args *a, u32 tid, int id_on_stack, u64 ts)
{
	struct comm_event *c;
	u64 pos;
	c = claim_comm(&pos);
	if (!c)
		return;
	fill_header(&c->hdr, EVENT_COMM, sizeof(*c), cs->pid, tid, ts);
	c->end_ns = 0;
	c->comm = a->comm;
	c->parent_hash = cs->parent_hash;
	c->rank = id_on_stack ? a->rank : cs->rank;
	c->nranks = id_on_stack ? a->nranks : cs->nranks;
	c->color = a->color;
	c->key = a->key;
	c->op = a->op;
	c->state = STATE_SCHEDULED;
	c->_pad1 = 0;
	c->result = RESULT_PENDING;
	if (id_on_stack) {
		if (bpf_probe_read_user(c->unique_id, sizeof(c->unique_id),
					(void *)(PT_REGS_SP(ctx) + 8)))
			__builtin_memset(c->unique_id, 0, sizeof(c->unique_id));
		cs->comm_hash = fold_unique_id(c->unique_id);
		cs->rank = a->rank;
		cs->nranks = a->nranks;
	} else {
		__builtin_memset(c->unique_id, 0, sizeof(c->unique_id));
	}
	c->comm_hash = cs->comm_hash;
	publish(&c->hdr, pos);
	cs->comm_pos = pos;
}

static __always_inline int nccl_enter(struct pt_regs *ctx, struct call_args *a)
{
	u64 id = bpf_get_current_pid_tgid();
	u32 pid = id >> 32, tid = (u32)id;
	if (is_excluded(pid))
		return 0;
	struct call_state *slot = inflight_slot(tid);
	if (!slot)
		return 0;
	u64 owner = __sync_val_compare_and_swap(&slot->tid, 0, (u64)tid);
	u64 sp = PT_REGS_SP(ctx);
	if (owner == tid && sp < slot->sp) {
		slot->depth += 1; /* nested: one row per API call */
		return 0;
	}
	/* owner == tid with the stack no deeper: the thread is not inside its
	 * last call any more, whose return was not seen (probes attached while
	 * it was inside): this call starts afresh. */
	if (owner != 0 && owner != tid) {
		count_drop(DROP_INFLIGHT_FULL);
		return 0;
	}
	/* The slot is filled in place (no copy of a stack-built one); its
	 * time is written last: a reader trusts a slot whose time is set. */
	u64 ts = bpf_ktime_get_ns();
	struct call_state *cs = slot;
	cs->pid = pid;
	cs->op = a->op;
	cs->depth = 0;
	cs->sp = sp;
	cs->comm = a->comm;
	cs->out = a->out;
	cs->rank = -1;
	cs->nranks = -1;
	cs->color = a->color;
	cs->key = a->key;
	cs->pos = 0;
	cs->comm_pos = 0;
	cs->comm_hash = 0;
	cs->parent_hash = 0;
	cs->seq = 0;
	cs->split_index = 0;
	u64 skey = thread_stream(a->stream, tid);
	struct stream_state *sst = is_data_op(a->op) ? cuda_stream(pid, skey) : NULL;
	struct comm_state *st = a->comm ? enter_comm(cs, a, ts, sst ? sst->capture : 0) : NULL;
	if (a->op == OP_COMM_INIT_RANK || a->op == OP_COMM_INIT_RANK_CONFIG)
		open_comm_row(ctx, cs, a, tid, 1, ts);
	else if (a->op >= OP_COMM_SPLIT)
		open_comm_row(ctx, cs, a, tid, 0, ts);
	else if (a->op == OP_COMM_INIT_ALL)
		cs->nranks = a->nranks;
	open_nccl_row(cs, a, tid, ts, sst, skey);
	if (st)
		st->last_pos = cs->pos;
	asm volatile("" ::: "memory");
	*(volatile __u64 *)&cs->entered_ns = ts;
	return 0;
}

/* ---- argument decoding, one function per argument layout ---------------- */

static __always_inline void decode_reduce_like(struct pt_regs *ctx, struct call_args *a)
{
	/* (send, recv, count, datatype, redop, comm, stream) */
	a->peer = -1;
	a->count = PT_REGS_PARM3(ctx);
	a->datatype = PT_REGS_PARM4(ctx);
	a->redop = PT_REGS_PARM5(ctx);
	a->comm = PT_REGS_PARM6(ctx);
	a->stream = stack_arg(ctx, 1);
}

static __always_inline void decode_rooted(struct pt_regs *ctx, struct call_args *a)
{
	/* (send, recv, count, datatype, root, comm, stream) */
	a->count = PT_REGS_PARM3(ctx);
	a->datatype = PT_REGS_PARM4(ctx);
	a->peer = PT_REGS_PARM5(ctx);
	a->comm = PT_REGS_PARM6(ctx);
	a->stream = stack_arg(ctx, 1);
}

static __always_inline void decode_gather_like(struct pt_regs *ctx, struct call_args *a)
{
	/* (send, recv, count, datatype, comm, stream) */
	a->peer = -1;
	a->count = PT_REGS_PARM3(ctx);
	a->datatype = PT_REGS_PARM4(ctx);
	a->comm = PT_REGS_PARM5(ctx);
	a->stream = PT_REGS_PARM6(ctx);
}

static __always_inline void decode_p2p(struct pt_regs *ctx, struct call_args *a)
{
	/* (buf, count, datatype, peer, comm, stream); also ncclBcast's
	 * (buff, count, datatype, root, comm, stream) */
	a->count = PT_REGS_PARM2(ctx);
	a->datatype = PT_REGS_PARM3(ctx);
	a->peer = PT_REGS_PARM4(ctx);
	a->comm = PT_REGS_PARM5(ctx);
	a->stream = PT_REGS_PARM6(ctx);
}

static __always_inline void decode_reduce(struct pt_regs *ctx, struct call_args *a)
{
	/* (send, recv, count, datatype, redop, root, comm, stream) */
	a->count = PT_REGS_PARM3(ctx);
	a->datatype = PT_REGS_PARM4(ctx);
	a->redop = PT_REGS_PARM5(ctx);
	a->peer = PT_REGS_PARM6(ctx);
	a->comm = stack_arg(ctx, 1);
	a->stream = stack_arg(ctx, 2);
}

static __always_inline void decode_init_rank(struct pt_regs *ctx, struct call_args *a)
{
	/* (ncclComm_t *comm, int nranks, ncclUniqueId id [stack], int rank):
	 * the struct goes to memory, so rank is the THIRD integer register. */
	a->peer = -1;
	a->out = PT_REGS_PARM1(ctx);
	a->nranks = (s32)PT_REGS_PARM2(ctx);
	a->rank = (s32)PT_REGS_PARM3(ctx);
}

static __always_inline void decode_init_all(struct pt_regs *ctx, struct call_args *a)
{
	/* (ncclComm_t *comms, int ndev, const int *devlist) */
	a->peer = -1;
	a->out = PT_REGS_PARM1(ctx);
	a->nranks = (s32)PT_REGS_PARM2(ctx);
}

static __always_inline void decode_split(struct pt_regs *ctx, struct call_args *a)
{
	/* (ncclComm_t comm, int color, int key, ncclComm_t *newcomm, config) */
	a->peer = -1;
	a->comm = PT_REGS_PARM1(ctx);
	a->color = (s32)PT_REGS_PARM2(ctx);
	a->key = (s32)PT_REGS_PARM3(ctx);
	a->out = PT_REGS_PARM4(ctx);
}

/* (comm) for destroy/abort/finalize, (ncclUniqueId *out) for GetUniqueId,
 * nothing for the group calls. */
static __always_inline void decode_one_arg(struct pt_regs *ctx, struct call_args *a)
{
	a->peer = -1;
	if (is_close_op(a->op))
		a->comm = PT_REGS_PARM1(ctx);
	else if (a->op == OP_GET_UNIQUE_ID)
		a->out = PT_REGS_PARM1(ctx);
}

/* Decodes the arguments of symbol `sym` (SYM_* below); 0 if unknown. */
static __always_inline int decode_call(struct pt_regs *ctx, u64 sym, struct call_args *a)
{
	switch (sym) {
	case SYM_ncclAllReduce: a->op = OP_ALL_REDUCE; decode_reduce_like(ctx, a); break;
	case SYM_ncclReduceScatter: a->op = OP_REDUCE_SCATTER; decode_reduce_like(ctx, a); break;
	case SYM_ncclAllGather: a->op = OP_ALL_GATHER; decode_gather_like(ctx, a); break;
	case SYM_ncclAlltoAll: a->op = OP_ALL_TO_ALL; decode_gather_like(ctx, a); break;
	case SYM_ncclBroadcast: a->op = OP_BROADCAST; decode_rooted(ctx, a); break;
	case SYM_ncclGather: a->op = OP_GATHER; decode_rooted(ctx, a); break;
	case SYM_ncclScatter: a->op = OP_SCATTER; decode_rooted(ctx, a); break;
	case SYM_ncclBcast: a->op = OP_BROADCAST; decode_p2p(ctx, a); break;
	case SYM_ncclSend: a->op = OP_SEND; decode_p2p(ctx, a); break;
	case SYM_ncclRecv: a->op = OP_RECV; decode_p2p(ctx, a); break;
	case SYM_ncclReduce: a->op = OP_REDUCE; decode_reduce(ctx, a); break;
	case SYM_ncclGroupStart: a->op = OP_GROUP_START; decode_one_arg(ctx, a); break;
	case SYM_ncclGroupEnd: a->op = OP_GROUP_END; decode_one_arg(ctx, a); break;
	case SYM_ncclCommInitRank: a->op = OP_COMM_INIT_RANK; decode_init_rank(ctx, a); break;
	case SYM_ncclCommInitRankConfig:
		a->op = OP_COMM_INIT_RANK_CONFIG;
		decode_init_rank(ctx, a);
		break;
	case SYM_ncclCommInitAll: a->op = OP_COMM_INIT_ALL; decode_init_all(ctx, a); break;
	case SYM_ncclCommSplit: a->op = OP_COMM_SPLIT; decode_split(ctx, a); break;
	case SYM_ncclCommDestroy: a->op = OP_COMM_DESTROY; decode_one_arg(ctx, a); break;
	case SYM_ncclCommAbort: a->op = OP_COMM_ABORT; decode_one_arg(ctx, a); break;
	case SYM_ncclCommFinalize: a->op = OP_COMM_FINALIZE; decode_one_arg(ctx, a); break;
	case SYM_ncclGetUniqueId: a->op = OP_GET_UNIQUE_ID; decode_one_arg(ctx, a); break;
	default: return 0;
	}
	return 1;
}

static __always_inline int enter_symbol(struct pt_regs *ctx, u64 sym)
{
	struct call_args a = {.color = -1, .key = -1};
	if (!decode_call(ctx, sym, &a))
		return 0;
	return nccl_enter(ctx, &a);
}

/* ---- entry programs ------------------------------------------------------ */

/* One program per symbol, through a uprobe_multi link (6.6+) or its own
 * perf event: the symbol is a constant, not an attach cookie to read (a
 * helper call, ~20 ns), and the decoding switch folds away. */
#define ENTRY_PROGRAM(fn, sym) \
	int fn(struct pt_regs *ctx) { return enter_symbol(ctx, SYM_##sym); }
ENTRY_PROGRAM(handle_enter_all_reduce, ncclAllReduce)
ENTRY_PROGRAM(handle_enter_all_gather, ncclAllGather)
ENTRY_PROGRAM(handle_enter_reduce_scatter, ncclReduceScatter)
ENTRY_PROGRAM(handle_enter_broadcast, ncclBroadcast)
ENTRY_PROGRAM(handle_enter_bcast, ncclBcast)
ENTRY_PROGRAM(handle_enter_reduce, ncclReduce)
ENTRY_PROGRAM(handle_enter_all_to_all, ncclAlltoAll)
ENTRY_PROGRAM(handle_enter_gather, ncclGather)
ENTRY_PROGRAM(handle_enter_scatter, ncclScatter)
ENTRY_PROGRAM(handle_enter_send, ncclSend)
ENTRY_PROGRAM(handle_enter_recv, ncclRecv)
ENTRY_PROGRAM(handle_enter_group_start, ncclGroupStart)
ENTRY_PROGRAM(handle_enter_group_end, ncclGroupEnd)
ENTRY_PROGRAM(handle_enter_init_rank, ncclCommInitRank)
ENTRY_PROGRAM(handle_enter_init_rank_config, ncclCommInitRankConfig)
ENTRY_PROGRAM(handle_enter_init_all, ncclCommInitAll)
ENTRY_PROGRAM(handle_enter_split, ncclCommSplit)
ENTRY_PROGRAM(handle_enter_destroy, ncclCommDestroy)
ENTRY_PROGRAM(handle_enter_abort, ncclCommAbort)
ENTRY_PROGRAM(handle_enter_finalize, ncclCommFinalize)
ENTRY_PROGRAM(handle_enter_get_unique_id, ncclGetUniqueId)

/* ---- return ------------------------------------------------------------- */

static __always_inline void add_comm(u32 pid, u64 comm, u64 hash, s32 rank, s32 nranks, u64 ts)
{
	new_comm(pid, comm, hash, rank, nranks, ts, 1);
}

static __always_inline u64 read_user_ptr(u64 addr)
{
	u64 v = 0;
	if (addr)
		bpf_probe_read_user(&v, sizeof(v), (void *)addr);
	return v;
}

/* The communicator a lifecycle call produced; updates `comms`. */
static __always_inline void finish_lifecycle(struct call_state *cs, s32 result, u64 ts)
{
	u8 op = cs->op;
	if (op == OP_COMM_INIT_RANK || op == OP_COMM_INIT_RANK_CONFIG) {
		cs->comm = read_user_ptr(cs->out);
		if (result == 0 && cs->comm)
			add_comm(cs->pid, cs->comm, cs->comm_hash, cs->rank, cs->nranks, ts);
	} else if (op == OP_COMM_SPLIT) {
		u64 newcomm = read_user_ptr(cs->out);
		cs->comm = newcomm;
		/* A parent made before the agent attached has no known id: the
		 * child's id is unknown too (hash 0), not derived from 0, which
		 * would give children of different parents one id. */
		cs->comm_hash = cs->parent_hash
					? split_hash(cs->parent_hash, cs->color, cs->split_index)
					: 0;
		/* rank and nranks of a split comm are derived by the analyzer. */
		if (result == 0 && newcomm)
			add_comm(cs->pid, newcomm, cs->comm_hash, -1, -1, ts);
		else
			cs->comm_hash = 0;
	}
}

static __always_inline void finish_comm_row(struct call_state *cs, s32 result, u64 ts)
{
	u32 idx = (u32)((cs->comm_pos - 1) & (COMM_RING_SLOTS - 1));
	struct comm_event *c = comm_ring.lookup(&idx);
	if (!c || c->hdr.pos != cs->comm_pos)
		return;
	if (cs->op == OP_GET_UNIQUE_ID && result == 0 && cs->out) {
		bpf_probe_read_user(c->unique_id, sizeof(c->unique_id), (void *)cs->out);
		c->comm_hash = fold_unique_id(c->unique_id);
	} else if (cs->op == OP_COMM_SPLIT || cs->op == OP_COMM_INIT_RANK ||
		   cs->op == OP_COMM_INIT_RANK_CONFIG) {
		c->comm = cs->comm;
		c->comm_hash = cs->comm_hash;
	}
	c->end_ns = ts;
	c->result = result;
	asm volatile("" ::: "memory");
	*(volatile __u8 *)&c->state = STATE_ENQUEUED;
}

/* ncclCommInitAll: ids do not exist; all ranks are in this process, so a
 * hash from (pid, entry time) is enough to group them. */
static __always_inline void finish_init_all(struct call_state *cs, u32 tid, s32 result, u64 ts)
{
	if (result != 0 || !cs->out)
		return;
	u64 hash = splitmix64(((u64)cs->pid << 32) ^ cs->entered_ns);
	cs->comm_hash = hash;
#pragma unroll
	for (int i = 0; i < INIT_ALL_MAX; i++) {
		if (i >= cs->nranks)
			break;
		u64 comm = read_user_ptr(cs->out + 8 * i);
		if (!comm)
			continue;
		add_comm(cs->pid, comm, hash, i, cs->nranks, ts);
		struct comm_event *c;
		u64 pos;
		c = claim_comm(&pos);
		if (!c)
			continue;
		fill_header(&c->hdr, EVENT_COMM, sizeof(*c), cs->pid, tid, cs->entered_ns);
		c->end_ns = ts;
		c->comm = comm;
		c->comm_hash = hash;
		c->parent_hash = 0;
		c->rank = i;
		c->nranks = cs->nranks;
		c->color = -1;
		c->key = -1;
		c->op = OP_COMM_INIT_ALL;
		c->state = STATE_ENQUEUED;
		c->_pad1 = 0;
		c->result = result;
		__builtin_memset(c->unique_id, 0, sizeof(c->unique_id));
		publish(&c->hdr, pos);
	}
}

/* The row a call opened, if still its own (not overwritten while in flight). */
static __always_inline struct nccl_event *own_row(u64 pos)
{
	u32 idx = (u32)((pos - 1) & (NCCL_RING_SLOTS - 1));
	struct nccl_event *e = nccl_ring.lookup(&idx);
	return e && e->hdr.pos == pos ? e : NULL;
}

static __always_inline void complete_row(struct nccl_event *e, s32 result, u64 ts)
{
	e->end_ns = ts;
	e->result = result;
	asm volatile("" ::: "memory");
	/* a synchronisation on another thread may have completed it already */
	if (e->state == STATE_SCHEDULED)
		*(volatile __u8 *)&e->state = STATE_ENQUEUED;
}

static __always_inline void finish_nccl_row(u64 pos, s32 result, u64 ts)
{
	struct nccl_event *e = own_row(pos);
	if (e)
		complete_row(e, result, ts);
}

static __always_inline void finish_lifecycle_row(struct call_state *cs, s32 result, u64 ts)
{
	struct nccl_event *e = own_row(cs->pos);
	if (!e)
		return;
	/* Init calls: the row names the communicator they made.  A split's
	 * row stays on its parent (the new one is in comm_ring). */
	if (cs->op >= OP_COMM_INIT_RANK && cs->op <= OP_COMM_INIT_ALL) {
		e->comm_hash = cs->comm_hash;
		e->comm = cs->comm;
		e->rank = cs->rank;
		e->nranks = cs->nranks;
	}
	complete_row(e, result, ts);
}

/* A collective or p2p call (the common case): the slot's few fields it
 * needs are read and the slot freed, with no copy of the whole slot. */
static __always_inline void return_data_call(struct call_state *live, s32 result)
{
	u64 pos = live->pos;
	release_slot(live);
	if (pos)
		finish_nccl_row(pos, result, bpf_ktime_get_ns());
}

int handle_nccl_return(struct pt_regs *ctx)
{
	u32 tid = (u32)bpf_get_current_pid_tgid();
	struct call_state *live = inflight_slot(tid);
	if (!live || live->tid != tid)
		return 0;
	if (live->depth > 0) {
		live->depth -= 1;
		return 0;
	}
	s32 result = (s32)PT_REGS_RC(ctx);
	if (live->op <= OP_GROUP_END) {
		return_data_call(live, result);
		return 0;
	}
	struct call_state cs = *live;
	release_slot(live);
	u64 ts = bpf_ktime_get_ns();
	if (cs.op == OP_COMM_INIT_ALL)
		finish_init_all(&cs, tid, result, ts);
	else
		finish_lifecycle(&cs, result, ts);
	if (cs.comm_pos)
		finish_comm_row(&cs, result, ts);
	if (cs.pos)
		finish_lifecycle_row(&cs, result, ts);
	return 0;
}

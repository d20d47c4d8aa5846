/* CUDA runtime stream and event calls, by uprobe (and uretprobe for the
 * calls whose answer matters), x86-64 SysV, any libcudart.so.<major>:
 *
 *   cudaEventRecord[WithFlags][_ptsz](event, stream[, flags])
 *   cudaStreamWaitEvent[_ptsz](stream, event, flags)
 *   cudaEventQuery(event), cudaEventSynchronize(event)           + return
 *   cudaStreamQuery[_ptsz](stream), cudaStreamSynchronize[_ptsz]  + return
 *
 * How a framework learns that a collective finished, and so how we do:
 * PyTorch records an event on the NCCL stream after each collective (and one
 * before it), and a watchdog polls them with cudaEventQuery; steps end in a
 * stream synchronisation.  An event recorded on a stream right after an NCCL
 * call (cuda.h: `last_was_call`) ends it; one recorded otherwise starts the
 * next call.  Streams run in order, so an event seen done (a query that
 * returns cudaSuccess, a synchronisation that returns) completes every call
 * queued on its stream before it, and a start event seen done starts the
 * call after it.  A stream synchronisation completes what was queued on the
 * stream when it began, and what the stream had waited for
 * (cudaStreamWaitEvent: at most STREAM_WAITS other streams).
 *
 * Times are the return of the observing call (`*_ns`) and the latest entry of
 * a query that found the event not done, or the call's own entry or return
 * (`*_after_ns`): the device event lies between.  All of it is written into
 * the call's nccl_ring row here, no user space per event.
 *
 * Not handled: cudaDeviceSynchronize (every stream of the process), the
 * per-thread default stream told apart per thread (all share one key), CUDA
 * graphs, and the driver's cu* calls (see DESIGN.md).
 */

#define MAX_CUDA_EVENTS 65536
#define MAX_CUDA_CALLS 8192
#define CUDA_SUCCESS 0
#define CUDA_NOT_READY 600

/* Symbols (attach cookies; CSYM_* come from recorder/probes.py). */
#define CALL_RECORD 1
#define CALL_WAIT 2
#define CALL_EVENT_DONE 3  /* query / synchronize an event */
#define CALL_STREAM_DONE 4 /* query / synchronize a stream */

/* What the probes saw, per CPU (user space sums them into the counters of
 * every dump): calls by kind, and the answers of queries and syncs. */
#define SEEN_RECORD 0
#define SEEN_WAIT 1
#define SEEN_DONE 2      /* a query or sync answered cudaSuccess */
#define SEEN_NOT_READY 3 /* cudaErrorNotReady */
#define SEEN_ERROR 4     /* any other code (no device, bad handle, ...) */
#define SEEN_SLOTS 5
BPF_PERCPU_ARRAY(cuda_seen, u64, SEEN_SLOTS);

static __always_inline void count_seen(u32 slot)
{
	u64 *n = cuda_seen.lookup(&slot);
	if (n)
		*n += 1;
}

struct event_key {
	u32 pid;
	u32 _pad;
	u64 event;
};

struct event_state {
	u64 stream;
	u64 mark;        /* the stream's call count when recorded: calls [0, mark) precede it */
	u64 notready_ns; /* entry of the last query that found it not done */
	u32 is_start;    /* recorded before a call, not right after one */
	u32 seen_done;
};
BPF_TABLE("lru_hash", struct event_key, struct event_state, cuda_events, MAX_CUDA_EVENTS);

/* A query or synchronisation between entry and return, one slot per thread
 * at tid & (MAX_CUDA_CALLS - 1); a slot taken by a colliding thread loses
 * that one observation. */
struct cuda_call {
	u64 tid;
	u64 handle;
	u64 entered_ns;
	u64 mark; /* stream calls: the stream's call count at entry */
	u32 kind;
	u32 _pad;
};
BPF_ARRAY(cuda_calls, struct cuda_call, MAX_CUDA_CALLS);

static __always_inline int cuda_kind(u64 sym)
{
	switch (sym) {
	case CSYM_cudaEventRecord:
	case CSYM_cudaEventRecord_ptsz:
	case CSYM_cudaEventRecordWithFlags:
	case CSYM_cudaEventRecordWithFlags_ptsz:
		return CALL_RECORD;
	case CSYM_cudaStreamWaitEvent:
	case CSYM_cudaStreamWaitEvent_ptsz:
		return CALL_WAIT;
	case CSYM_cudaEventQuery:
	case CSYM_cudaEventSynchronize:
		return CALL_EVENT_DONE;
	case CSYM_cudaStreamQuery:
	case CSYM_cudaStreamQuery_ptsz:
	case CSYM_cudaStreamSynchronize:
	case CSYM_cudaStreamSynchronize_ptsz:
		return CALL_STREAM_DONE;
	}
	return 0;
}

/* NULL in a _ptsz call is the per-thread stream. */
static __always_inline u64 stream_arg(u64 sym, u64 stream)
{
	int ptsz = sym == CSYM_cudaEventRecord_ptsz || sym == CSYM_cudaEventRecordWithFlags_ptsz ||
		   sym == CSYM_cudaStreamWaitEvent_ptsz || sym == CSYM_cudaStreamQuery_ptsz ||
		   sym == CSYM_cudaStreamSynchronize_ptsz;
	return ptsz && stream == 0 ? 2 : stream;
}

/* ---- rows ---------------------------------------------------------------- */

static __always_inline struct nccl_event *row_at(u32 pid, u64 pos)
{
	u32 idx = (u32)((pos - 1) & (NCCL_RING_SLOTS - 1));
	struct nccl_event *e = nccl_ring.lookup(&idx);
	if (!e || e->hdr.pos != pos || e->hdr.pid != pid)
		return NULL; /* overwritten since */
	return e;
}

static __always_inline u64 max_u64(u64 a, u64 b)
{
	return a > b ? a : b;
}

static __always_inline void mark_completed(struct nccl_event *e, u64 ts, u64 after)
{
	if (e->completed_ns)
		return;
	e->completed_after_ns = max_u64(max_u64(e->end_ns, e->hdr.ts_ns), after);
	e->completed_ns = ts;
	asm volatile("" ::: "memory");
	*(volatile __u8 *)&e->state = STATE_COMPLETED;
}

static __always_inline void mark_started(struct nccl_event *e, u64 ts, u64 after)
{
	/* seen complete first (a sync): when it started was not observed */
	if (e->started_ns || e->completed_ns)
		return;
	e->started_after_ns = max_u64(e->hdr.ts_ns, after);
	e->started_ns = ts;
	asm volatile("" ::: "memory");
	if (e->state < STATE_STARTED)
		*(volatile __u8 *)&e->state = STATE_STARTED;
}

/* Calls [st->done, mark) of a stream are complete, seen at ts; `after` bounds
 * the one right before mark (the event that followed it was not done then). */
static __always_inline void complete_before(u32 pid, struct stream_state *st, u64 mark, u64 ts,
					    u64 after)
{
	u64 from = st->done;
	if (mark <= from)
		return;
	if (mark - from > STREAM_QUEUE)
		from = mark - STREAM_QUEUE;
#pragma unroll
	for (int i = 0; i < STREAM_QUEUE; i++) {
		u64 k = from + i;
		if (k >= mark)
			break;
		struct nccl_event *e = row_at(pid, st->pos[k & (STREAM_QUEUE - 1)]);
		if (e)
			mark_completed(e, ts, k + 1 == mark ? after : 0);
	}
	if (st->done < mark)
		st->done = mark;
}

static __always_inline void start_call(u32 pid, struct stream_state *st, u64 k, u64 ts, u64 after)
{
	if (k >= st->enq || st->enq - k > STREAM_QUEUE)
		return; /* not queued (yet), or fallen out */
	struct nccl_event *e = row_at(pid, st->pos[k & (STREAM_QUEUE - 1)]);
	if (e)
		mark_started(e, ts, after);
}

/* ---- observations -------------------------------------------------------- */

static __always_inline void event_seen_done(u32 pid, u64 event, u64 ts)
{
	struct event_key k = {.pid = pid, .event = event};
	struct event_state *ev = cuda_events.lookup(&k);
	if (!ev || ev->seen_done)
		return;
	ev->seen_done = 1;
	struct stream_state *st = stream_for(pid, ev->stream, 0);
	if (!st)
		return;
	complete_before(pid, st, ev->mark, ts, ev->is_start ? 0 : ev->notready_ns);
	if (ev->is_start)
		start_call(pid, st, ev->mark, ts, ev->notready_ns);
}

static __always_inline void event_seen_pending(u32 pid, u64 event, u64 entered)
{
	struct event_key k = {.pid = pid, .event = event};
	struct event_state *ev = cuda_events.lookup(&k);
	if (ev)
		ev->notready_ns = entered;
}

/* What a stream waited on is done too once the stream itself is. */
static __always_inline void waits_done(u32 pid, struct stream_state *st, u64 ts)
{
#pragma unroll
	for (int i = 0; i < STREAM_WAITS; i++) {
		u64 mark = st->wait_mark[i];
		if (!mark)
			continue;
		struct stream_state *other = stream_for(pid, st->wait_stream[i], 0);
		if (other)
			complete_before(pid, other, mark, ts, 0);
	}
}

static __always_inline void stream_seen_done(u32 pid, u64 stream, u64 mark, u64 ts)
{
	struct stream_state *st = stream_for(pid, stream, 0);
	if (!st)
		return;
	complete_before(pid, st, mark, ts, 0);
	waits_done(pid, st, ts);
}

static __always_inline void on_record(u32 pid, u64 event, u64 stream)
{
	struct stream_state *st = stream_for(pid, stream, 0);
	struct event_state ev = {.stream = stream_id(stream), .is_start = 1};
	if (st) {
		ev.mark = st->enq;
		ev.is_start = !st->last_was_call;
		st->last_was_call = 0;
	}
	struct event_key k = {.pid = pid, .event = event};
	cuda_events.update(&k, &ev);
}

static __always_inline void on_wait(u32 pid, u64 stream, u64 event)
{
	struct event_key k = {.pid = pid, .event = event};
	struct event_state *ev = cuda_events.lookup(&k);
	struct stream_state *st = stream_for(pid, stream, ev && ev->mark);
	if (!st)
		return;
	st->last_was_call = 0;
	if (!ev || !ev->mark || ev->stream == stream_id(stream))
		return;
	u32 slot = STREAM_WAITS - 1; /* the same stream again, else a free slot, else the last */
#pragma unroll
	for (int i = STREAM_WAITS - 1; i >= 0; i--)
		if (st->wait_stream[i] == ev->stream || !st->wait_mark[i])
			slot = i;
	st->wait_stream[slot & (STREAM_WAITS - 1)] = ev->stream;
	st->wait_mark[slot & (STREAM_WAITS - 1)] = ev->mark;
}

/* ---- programs ------------------------------------------------------------ */

static __always_inline int cuda_enter(struct pt_regs *ctx, u64 sym)
{
	u64 id = bpf_get_current_pid_tgid();
	u32 pid = id >> 32, tid = (u32)id;
	if (is_excluded(pid))
		return 0;
	int kind = cuda_kind(sym);
	if (kind == CALL_RECORD) {
		count_seen(SEEN_RECORD);
		on_record(pid, PT_REGS_PARM1(ctx), stream_arg(sym, PT_REGS_PARM2(ctx)));
		return 0;
	}
	if (kind == CALL_WAIT) {
		count_seen(SEEN_WAIT);
		on_wait(pid, stream_arg(sym, PT_REGS_PARM1(ctx)), PT_REGS_PARM2(ctx));
		return 0;
	}
	if (!kind)
		return 0;
	u32 slot = tid & (MAX_CUDA_CALLS - 1);
	struct cuda_call *c = cuda_calls.lookup(&slot);
	if (!c)
		return 0;
	c->tid = tid;
	c->kind = kind;
	c->handle = kind == CALL_STREAM_DONE ? stream_arg(sym, PT_REGS_PARM1(ctx)) : PT_REGS_PARM1(ctx);
	c->entered_ns = bpf_ktime_get_ns();
	c->mark = 0;
	if (kind == CALL_STREAM_DONE) {
		struct stream_state *st = stream_for(pid, c->handle, 0);
		c->mark = st ? st->enq : 0;
	}
	return 0;
}

/* The one entry program of a uprobe_multi link: its cookie is the symbol. */
int handle_cuda_enter(struct pt_regs *ctx) { return cuda_enter(ctx, bpf_get_attach_cookie(ctx)); }

/* One program per symbol, for kernels without uprobe_multi (before 6.6). */
#define CUDA_ENTRY_PROGRAM(fn, sym) \
	int fn(struct pt_regs *ctx) { return cuda_enter(ctx, CSYM_##sym); }
CUDA_ENTRY_PROGRAM(handle_enter_event_record, cudaEventRecord)
CUDA_ENTRY_PROGRAM(handle_enter_event_record_ptsz, cudaEventRecord_ptsz)
CUDA_ENTRY_PROGRAM(handle_enter_event_record_flags, cudaEventRecordWithFlags)
CUDA_ENTRY_PROGRAM(handle_enter_event_record_flags_ptsz, cudaEventRecordWithFlags_ptsz)
CUDA_ENTRY_PROGRAM(handle_enter_stream_wait_event, cudaStreamWaitEvent)
CUDA_ENTRY_PROGRAM(handle_enter_stream_wait_event_ptsz, cudaStreamWaitEvent_ptsz)
CUDA_ENTRY_PROGRAM(handle_enter_event_query, cudaEventQuery)
CUDA_ENTRY_PROGRAM(handle_enter_event_synchronize, cudaEventSynchronize)
CUDA_ENTRY_PROGRAM(handle_enter_stream_query, cudaStreamQuery)
CUDA_ENTRY_PROGRAM(handle_enter_stream_query_ptsz, cudaStreamQuery_ptsz)
CUDA_ENTRY_PROGRAM(handle_enter_stream_synchronize, cudaStreamSynchronize)
CUDA_ENTRY_PROGRAM(handle_enter_stream_synchronize_ptsz, cudaStreamSynchronize_ptsz)

int handle_cuda_return(struct pt_regs *ctx)
{
	u64 id = bpf_get_current_pid_tgid();
	u32 pid = id >> 32, tid = (u32)id;
	u32 slot = tid & (MAX_CUDA_CALLS - 1);
	struct cuda_call *c = cuda_calls.lookup(&slot);
	if (!c || c->tid != tid || !c->kind)
		return 0;
	struct cuda_call call = *c;
	c->kind = 0;
	s32 rc = (s32)PT_REGS_RC(ctx);
	u64 ts = bpf_ktime_get_ns();
	count_seen(rc == CUDA_SUCCESS ? SEEN_DONE : rc == CUDA_NOT_READY ? SEEN_NOT_READY : SEEN_ERROR);
	if (call.kind == CALL_EVENT_DONE) {
		if (rc == CUDA_SUCCESS)
			event_seen_done(pid, call.handle, ts);
		else if (rc == CUDA_NOT_READY)
			event_seen_pending(pid, call.handle, call.entered_ns);
	} else if (rc == CUDA_SUCCESS) {
		stream_seen_done(pid, call.handle, call.mark, ts);
	}
	return 0;
}

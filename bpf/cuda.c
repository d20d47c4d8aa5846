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
 * CUDA graphs, by stream capture:
 *
 *   cudaStreamBeginCapture[_ptsz](stream, mode)                   + return
 *   cudaStreamEndCapture[_ptsz](stream, cudaGraph_t *graph)        + return
 *   cudaStreamIsCapturing[_ptsz](stream, status *), and
 *   cudaStreamGetCaptureInfo[_ptsz](stream, status *, ...)        + return
 *   cudaGraphInstantiate[WithFlags](cudaGraphExec_t *exec, graph, ...) + return
 *   cudaGraphExecDestroy(exec), cudaGraphDestroy(graph)
 *   cudaGraphLaunch[_ptsz](exec, stream)                          + return
 *
 * A capture that began (or that a capture query reports active: an agent
 * that came late) gets a number; NCCL calls on its stream are appended to
 * it (nccl.c), not queued.  The graph it ends in, and each executable
 * instantiated from that graph, lead back to the number.  A launch that
 * returns cudaSuccess writes its row and one row per captured call, in
 * capture order, each with its communicator's next seq, queued on the
 * launch's stream like a call made there: the events around the launch
 * start the first and complete them all.
 *
 * cudaDeviceSynchronize() + return: a success completes every call queued,
 * before its entry, on the first PID_STREAMS streams the process queued
 * NCCL calls on.  The per-thread default stream (cudaStreamPerThread, or
 * NULL in a _ptsz call) is one stream per thread.
 *
 * Not handled: graphs built or updated node by node (cudaGraphAdd*Node, cudaGraphExecUpdate),
 * captures joined across streams by events, graphs launched from the device,
 * and the driver's cu* calls (docs/architecture.md, "Data flow").
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
#define CALL_BEGIN_CAPTURE 5
#define CALL_END_CAPTURE 6
#define CALL_CAPTURE_INFO 7 /* is capturing / get capture info */
#define CALL_INSTANTIATE 8
#define CALL_EXEC_DESTROY 9
#define CALL_GRAPH_DESTROY 10
#define CALL_GRAPH_LAUNCH 11
#define CALL_DEVICE_SYNC 12
#define CAPTURE_ACTIVE 1 /* cudaStreamCaptureStatusActive */

/* What the probes saw, per CPU (user space sums them into the counters of
 * every dump): calls by kind, and the answers of queries and syncs. */
#define SEEN_RECORD 0
#define SEEN_WAIT 1
#define SEEN_DONE 2      /* a query or sync answered cudaSuccess */
#define SEEN_NOT_READY 3 /* cudaErrorNotReady */
#define SEEN_ERROR 4     /* any other code (no device, bad handle, ...) */
#define SEEN_GRAPH 5     /* a capture or graph call returned (any answer) */
#define SEEN_SLOTS 6
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
	u64 mark; /* stream calls: the stream's call count at entry; graph calls:
		   * the pointer argument the call writes, or a launch's stream */
	u32 kind;
	u32 _pad;
	u64 marks[PID_STREAMS]; /* device sync: each of the process's streams' count at entry */
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
	case CSYM_cudaStreamBeginCapture:
	case CSYM_cudaStreamBeginCapture_ptsz:
		return CALL_BEGIN_CAPTURE;
	case CSYM_cudaStreamEndCapture:
	case CSYM_cudaStreamEndCapture_ptsz:
		return CALL_END_CAPTURE;
	case CSYM_cudaStreamIsCapturing:
	case CSYM_cudaStreamIsCapturing_ptsz:
	case CSYM_cudaStreamGetCaptureInfo:
	case CSYM_cudaStreamGetCaptureInfo_ptsz:
		return CALL_CAPTURE_INFO;
	case CSYM_cudaGraphInstantiate:
	case CSYM_cudaGraphInstantiateWithFlags:
		return CALL_INSTANTIATE;
	case CSYM_cudaGraphExecDestroy:
		return CALL_EXEC_DESTROY;
	case CSYM_cudaGraphDestroy:
		return CALL_GRAPH_DESTROY;
	case CSYM_cudaGraphLaunch:
	case CSYM_cudaGraphLaunch_ptsz:
		return CALL_GRAPH_LAUNCH;
	case CSYM_cudaDeviceSynchronize:
		return CALL_DEVICE_SYNC;
	}
	return 0;
}

/* NULL in a _ptsz call is the per-thread stream; the key of a per-thread
 * stream names the thread (thread_stream). */
static __always_inline u64 stream_arg(u64 sym, u64 stream, u32 tid)
{
	int ptsz = sym == CSYM_cudaEventRecord_ptsz || sym == CSYM_cudaEventRecordWithFlags_ptsz ||
		   sym == CSYM_cudaStreamWaitEvent_ptsz || sym == CSYM_cudaStreamQuery_ptsz ||
		   sym == CSYM_cudaStreamSynchronize_ptsz || sym == CSYM_cudaStreamBeginCapture_ptsz ||
		   sym == CSYM_cudaStreamEndCapture_ptsz || sym == CSYM_cudaStreamIsCapturing_ptsz ||
		   sym == CSYM_cudaStreamGetCaptureInfo_ptsz || sym == CSYM_cudaGraphLaunch_ptsz;
	return thread_stream(ptsz && stream == 0 ? STREAM_PER_THREAD : stream, tid);
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

/* ---- device synchronisation ----------------------------------------------- */

/* cudaDeviceSynchronize's entry: how far each stream of the process was. */
static __always_inline void device_marks(u32 pid, struct cuda_call *c)
{
	struct pid_streams *ps = streams_of.lookup(&pid);
#pragma unroll
	for (int i = 0; i < PID_STREAMS; i++) {
		struct stream_state *st = ps && i < ps->n ? stream_for(pid, ps->stream[i], 0) : NULL;
		c->marks[i] = st ? st->enq : 0;
	}
}

/* It returned cudaSuccess: every call queued before it, on every stream, is done. */
static __always_inline void device_seen_done(u32 pid, struct cuda_call *c, u64 ts)
{
	struct pid_streams *ps = streams_of.lookup(&pid);
	if (!ps)
		return;
#pragma clang loop unroll(disable)
	for (int i = 0; i < PID_STREAMS; i++) {
		if (i >= ps->n)
			break;
		struct stream_state *st = stream_for(pid, ps->stream[i & (PID_STREAMS - 1)], 0);
		if (st)
			complete_before(pid, st, c->marks[i & (PID_STREAMS - 1)], ts, c->entered_ns);
	}
}

/* ---- graphs -------------------------------------------------------------- */

/* A capture begins on `stream`: a new number, and an empty call list. */
static __always_inline void capture_begun(u32 pid, u64 stream)
{
	struct stream_state *st = stream_for(pid, stream, 1);
	u32 zero = 0;
	u64 *count = capture_count.lookup(&zero);
	struct graph_state *empty = graph_zero.lookup(&zero);
	if (!st || !count || !empty)
		return;
	u64 id = __sync_fetch_and_add(count, 1) + 1;
	struct graph_key k = {.pid = pid, .id = id};
	if (graphs.update(&k, empty)) {
		count_drop(DROP_GRAPH_FULL);
		return;
	}
	st->capture = id;
}

static __always_inline void capture_ended(u32 pid, u64 stream, u64 graph_out, s32 rc)
{
	struct stream_state *st = stream_for(pid, stream, 0);
	if (!st || !st->capture)
		return;
	u64 id = st->capture;
	st->capture = 0; /* over, whatever the answer */
	u64 graph = 0;
	if (rc != CUDA_SUCCESS || bpf_probe_read_user(&graph, sizeof(graph), (void *)graph_out) || !graph)
		return;
	struct graph_key k = {.pid = pid, .id = graph};
	graph_handles.update(&k, &id);
}

/* A capture query's answer: a capture we did not see begin (the agent came
 * late) or end is taken as the runtime says. */
static __always_inline void capture_status(u32 pid, u64 stream, u64 status_out)
{
	u32 status = 0;
	if (bpf_probe_read_user(&status, sizeof(status), (void *)status_out))
		return;
	struct stream_state *st = stream_for(pid, stream, status == CAPTURE_ACTIVE);
	if (!st)
		return;
	if (status == CAPTURE_ACTIVE && !st->capture)
		capture_begun(pid, stream);
	else if (status != CAPTURE_ACTIVE)
		st->capture = 0;
}

static __always_inline void instantiated(u32 pid, u64 graph, u64 exec_out)
{
	struct graph_key k = {.pid = pid, .id = graph};
	u64 *id = graph_handles.lookup(&k);
	u64 exec = 0;
	if (!id || bpf_probe_read_user(&exec, sizeof(exec), (void *)exec_out) || !exec)
		return;
	struct graph_exec x = {.capture = *id};
	struct graph_key xk = {.pid = pid, .id = exec};
	graph_execs.update(&xk, &x);
}

static __always_inline void forget_handle(u32 pid, u64 handle, int kind)
{
	struct graph_key k = {.pid = pid, .id = handle};
	if (kind == CALL_EXEC_DESTROY)
		graph_execs.delete(&k);
	else
		graph_handles.delete(&k);
}

struct launch {
	u32 pid;
	u32 tid;
	u64 entered_ns;
	u64 ts;
	u64 exec;
	u64 stream;
	u64 capture;
	u64 replay;
};

static __always_inline void launch_row(struct launch *l, u64 ncalls, s32 rc)
{
	u64 pos;
	struct nccl_event *e = claim_nccl(&pos);
	if (!e)
		return;
	fill_header(&e->hdr, EVENT_NCCL, sizeof(*e), l->pid, l->tid, l->entered_ns);
	e->end_ns = l->ts;
	e->comm = l->exec;
	e->comm_hash = 0;
	e->count = ncalls;
	e->bytes = 0;
	e->stream = stream_of_key(l->stream);
	e->seq = 0;
	e->rank = -1;
	e->nranks = -1;
	e->peer = -1;
	e->result = rc;
	e->op = OP_GRAPH_LAUNCH;
	e->datatype = 0;
	e->redop = 0;
	e->state = STATE_ENQUEUED;
	e->graph_node = 0;
	e->started_ns = 0;
	e->started_after_ns = 0;
	e->completed_ns = 0;
	e->completed_after_ns = 0;
	e->graph = l->capture;
	e->replay = l->replay;
	publish(&e->hdr, pos);
}

/* Captured call i, executed once more: a row as its call would have made. */
static __always_inline void replay_row(struct launch *l, struct graph_call *c, u32 i,
				       struct stream_state *st)
{
	u64 pos;
	struct nccl_event *e = claim_nccl(&pos);
	if (!e)
		return;
	struct comm_state *cm = find_comm(l->pid, c->comm);
	u64 seq = 0;
	if (cm && (c->op == OP_SEND || c->op == OP_RECV))
		seq = next_p2p_seq(l->pid, c->comm, c->peer, c->op);
	else if (cm)
		seq = cm->seq++;
	fill_header(&e->hdr, EVENT_NCCL, sizeof(*e), l->pid, l->tid, l->entered_ns);
	e->end_ns = l->ts;
	e->comm = c->comm;
	e->comm_hash = cm ? cm->hash : 0;
	e->count = c->count;
	e->bytes = c->count * datatype_size(c->datatype);
	e->stream = stream_of_key(l->stream);
	e->seq = seq;
	e->rank = cm ? cm->rank : -1;
	e->nranks = cm ? cm->nranks : -1;
	e->peer = c->peer;
	e->result = 0;
	e->op = c->op;
	e->datatype = c->datatype;
	e->redop = c->redop;
	e->state = STATE_ENQUEUED;
	e->graph_node = i + 1;
	e->started_ns = 0;
	e->started_after_ns = 0;
	e->completed_ns = 0;
	e->completed_after_ns = 0;
	e->graph = l->capture;
	e->replay = l->replay;
	publish(&e->hdr, pos);
	if (cm) {
		cm->last_enter_ns = l->entered_ns;
		cm->last_pos = pos;
		cm->calls++;
	}
	if (st)
		cuda_enqueue(l->pid, l->stream, st, pos);
}

static __always_inline void launched(u32 pid, u32 tid, struct cuda_call *call, s32 rc, u64 ts)
{
	struct graph_key xk = {.pid = pid, .id = call->handle};
	struct graph_exec *x = graph_execs.lookup(&xk);
	if (!x)
		return; /* a graph without NCCL calls we saw captured */
	struct graph_key gk = {.pid = pid, .id = x->capture};
	struct graph_state *g = graphs.lookup(&gk);
	if (!g || !g->ncalls)
		return;
	struct launch l = {.pid = pid, .tid = tid, .entered_ns = call->entered_ns, .ts = ts,
			   .exec = call->handle, .stream = call->mark, .capture = x->capture};
	if (rc == CUDA_SUCCESS)
		l.replay = ++x->launches;
	launch_row(&l, g->ncalls, rc);
	if (rc != CUDA_SUCCESS)
		return;
	struct stream_state *st = stream_for(pid, l.stream, 1);
	u64 n = g->ncalls < GRAPH_CALLS ? g->ncalls : GRAPH_CALLS;
#pragma clang loop unroll(disable)
	for (u32 i = 0; i < GRAPH_CALLS; i++) {
		if (i >= n)
			break;
		replay_row(&l, &g->calls[i], i, st);
	}
}

static __always_inline void graph_returned(u32 pid, u32 tid, struct cuda_call *call, s32 rc, u64 ts)
{
	count_seen(SEEN_GRAPH);
	if (call->kind == CALL_BEGIN_CAPTURE) {
		if (rc == CUDA_SUCCESS)
			capture_begun(pid, call->handle);
	} else if (call->kind == CALL_END_CAPTURE) {
		capture_ended(pid, call->handle, call->mark, rc);
	} else if (call->kind == CALL_CAPTURE_INFO) {
		if (rc == CUDA_SUCCESS)
			capture_status(pid, call->handle, call->mark);
	} else if (call->kind == CALL_INSTANTIATE) {
		if (rc == CUDA_SUCCESS)
			instantiated(pid, call->handle, call->mark);
	} else if (call->kind == CALL_GRAPH_LAUNCH) {
		launched(pid, tid, call, rc, ts);
	}
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
		on_record(pid, PT_REGS_PARM1(ctx), stream_arg(sym, PT_REGS_PARM2(ctx), tid));
		return 0;
	}
	if (kind == CALL_WAIT) {
		count_seen(SEEN_WAIT);
		on_wait(pid, stream_arg(sym, PT_REGS_PARM1(ctx), tid), PT_REGS_PARM2(ctx));
		return 0;
	}
	if (!kind)
		return 0;
	if (kind == CALL_EXEC_DESTROY || kind == CALL_GRAPH_DESTROY) {
		forget_handle(pid, PT_REGS_PARM1(ctx), kind);
		return 0;
	}
	u32 slot = tid & (MAX_CUDA_CALLS - 1);
	struct cuda_call *c = cuda_calls.lookup(&slot);
	if (!c)
		return 0;
	c->tid = tid;
	c->kind = kind;
	int on_stream = kind == CALL_STREAM_DONE || kind == CALL_BEGIN_CAPTURE ||
			kind == CALL_END_CAPTURE || kind == CALL_CAPTURE_INFO;
	c->handle = on_stream ? stream_arg(sym, PT_REGS_PARM1(ctx), tid) : PT_REGS_PARM1(ctx);
	c->entered_ns = bpf_ktime_get_ns();
	c->mark = 0;
	if (kind == CALL_STREAM_DONE) {
		struct stream_state *st = stream_for(pid, c->handle, 0);
		c->mark = st ? st->enq : 0;
	} else if (kind == CALL_END_CAPTURE || kind == CALL_CAPTURE_INFO) {
		c->mark = PT_REGS_PARM2(ctx); /* the graph or status it writes */
	} else if (kind == CALL_INSTANTIATE) {
		c->handle = PT_REGS_PARM2(ctx); /* the graph */
		c->mark = PT_REGS_PARM1(ctx);   /* the executable it writes */
	} else if (kind == CALL_GRAPH_LAUNCH) {
		c->mark = stream_arg(sym, PT_REGS_PARM2(ctx), tid);
	} else if (kind == CALL_DEVICE_SYNC) {
		device_marks(pid, c);
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
CUDA_ENTRY_PROGRAM(handle_enter_begin_capture, cudaStreamBeginCapture)
CUDA_ENTRY_PROGRAM(handle_enter_begin_capture_ptsz, cudaStreamBeginCapture_ptsz)
CUDA_ENTRY_PROGRAM(handle_enter_end_capture, cudaStreamEndCapture)
CUDA_ENTRY_PROGRAM(handle_enter_end_capture_ptsz, cudaStreamEndCapture_ptsz)
CUDA_ENTRY_PROGRAM(handle_enter_is_capturing, cudaStreamIsCapturing)
CUDA_ENTRY_PROGRAM(handle_enter_is_capturing_ptsz, cudaStreamIsCapturing_ptsz)
CUDA_ENTRY_PROGRAM(handle_enter_capture_info, cudaStreamGetCaptureInfo)
CUDA_ENTRY_PROGRAM(handle_enter_capture_info_ptsz, cudaStreamGetCaptureInfo_ptsz)
CUDA_ENTRY_PROGRAM(handle_enter_graph_instantiate, cudaGraphInstantiate)
CUDA_ENTRY_PROGRAM(handle_enter_graph_instantiate_flags, cudaGraphInstantiateWithFlags)
CUDA_ENTRY_PROGRAM(handle_enter_graph_exec_destroy, cudaGraphExecDestroy)
CUDA_ENTRY_PROGRAM(handle_enter_graph_destroy, cudaGraphDestroy)
CUDA_ENTRY_PROGRAM(handle_enter_graph_launch, cudaGraphLaunch)
CUDA_ENTRY_PROGRAM(handle_enter_graph_launch_ptsz, cudaGraphLaunch_ptsz)
CUDA_ENTRY_PROGRAM(handle_enter_device_synchronize, cudaDeviceSynchronize)

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
	if (call.kind >= CALL_BEGIN_CAPTURE && call.kind <= CALL_GRAPH_LAUNCH) {
		graph_returned(pid, tid, &call, rc, ts);
		return 0;
	}
	count_seen(rc == CUDA_SUCCESS ? SEEN_DONE : rc == CUDA_NOT_READY ? SEEN_NOT_READY : SEEN_ERROR);
	if (call.kind == CALL_DEVICE_SYNC) {
		if (rc == CUDA_SUCCESS)
			device_seen_done(pid, &call, ts);
	} else if (call.kind == CALL_EVENT_DONE) {
		if (rc == CUDA_SUCCESS)
			event_seen_done(pid, call.handle, ts);
		else if (rc == CUDA_NOT_READY)
			event_seen_pending(pid, call.handle, call.entered_ns);
	} else if (rc == CUDA_SUCCESS) {
		stream_seen_done(pid, call.handle, call.mark, ts);
	}
	return 0;
}

/* The NCCL calls queued on each CUDA stream, shared by nccl.c (which queues a
 * collective's ring position at entry) and cuda.c (which marks calls started
 * and completed when the runtime reports their events done).
 *
 * A stream runs in order, so one counter says how far it has come: call i
 * of a stream (0-based, in the order the host entered them) is complete once
 * anything recorded on the stream after it is seen done.  The positions of
 * the last STREAM_QUEUE calls are kept; an older call still unfinished when
 * it falls out is counted (DROP_CUDA_QUEUE) and never gets device times.
 *
 * Until user space attaches a CUDA runtime (`cuda_on`), nccl.c pays one
 * inlined array lookup per call for this.
 *
 * Stream capture: while a stream is being captured (`capture`: the capture's
 * number) an NCCL call on it is not queued but appended to its graph's
 * calls (`graphs`, at most GRAPH_CALLS), which cuda.c replays as rows at
 * each launch of an executable instantiated from it.
 */
#ifndef STALLWATCH_CUDA_H
#define STALLWATCH_CUDA_H

#define STREAM_QUEUE 32
#define STREAM_WAITS 4
#define MAX_STREAMS 8192

struct stream_key {
	u32 pid;
	u32 _pad;
	u64 stream;
};

struct stream_state {
	u64 capture;       /* the capture under way on it (a number, 1-based), 0: none */
	u64 enq;           /* NCCL calls queued on it so far */
	u64 done;          /* calls [0, done) are known complete */
	u32 last_was_call; /* an event recorded now follows a call: it ends it */
	u32 _pad;
	u64 pos[STREAM_QUEUE]; /* nccl_ring position of call i at i % STREAM_QUEUE */
	/* streams this one waited on (cudaStreamWaitEvent): a sync of this one
	 * proves their calls before the waited event complete */
	u64 wait_stream[STREAM_WAITS];
	u64 wait_mark[STREAM_WAITS];
};

BPF_TABLE("lru_hash", struct stream_key, struct stream_state, cuda_streams, MAX_STREAMS);
/* A zeroed stream_state to insert (too big for the BPF stack); never written. */
BPF_PERCPU_ARRAY(stream_zero, struct stream_state, 1);
/* [0]: 1 once user space attached a CUDA runtime. */
BPF_ARRAY(cuda_on, u32, 1);

#define STREAM_PER_THREAD 2 /* cudaStreamPerThread */
#define PID_STREAMS 8       /* streams per process a device synchronisation completes */

/* The per-thread default stream is one stream per thread: its key carries
 * the thread (no stream pointer ends in 2: they are aligned). */
static __always_inline u64 thread_stream(u64 stream, u32 tid)
{
	return stream == STREAM_PER_THREAD ? ((u64)tid << 32) | STREAM_PER_THREAD : stream;
}

/* The stream handle a key stands for (rows show handles). */
static __always_inline u64 stream_of_key(u64 key)
{
	return (u32)key == STREAM_PER_THREAD ? STREAM_PER_THREAD : key;
}

/* The streams of each process that NCCL calls were queued on (the first
 * PID_STREAMS): what cudaDeviceSynchronize completes. */
struct pid_streams {
	u64 n;
	u64 stream[PID_STREAMS];
};
BPF_HASH(streams_of, u32, struct pid_streams, MAX_STREAMS);

/* The legacy default stream has two names (NULL and cudaStreamLegacy). */
static __always_inline u64 stream_id(u64 stream)
{
	return stream == 1 ? 0 : stream;
}

static __always_inline struct stream_state *stream_for(u32 pid, u64 stream, int create)
{
	struct stream_key k = {.pid = pid, .stream = stream_id(stream)};
	if (!create)
		return cuda_streams.lookup(&k);
	u32 first = 0;
	struct stream_state *zero = stream_zero.lookup(&first);
	if (!zero)
		return NULL;
	return cuda_streams.lookup_or_try_init(&k, zero);
}

/* ---- graphs ---------------------------------------------------------------- */

#define GRAPH_CALLS 32
#define MAX_GRAPHS 4096

struct graph_key {
	u32 pid;
	u32 _pad;
	u64 id; /* a capture number, a cudaGraph_t or a cudaGraphExec_t */
};

/* One NCCL call captured into a graph: what a replay of it is. */
struct graph_call {
	u64 comm;
	u64 count;
	s32 peer;
	u8 op;
	u8 datatype;
	u8 redop;
	u8 _pad;
};

struct graph_state {
	u64 ncalls; /* calls captured (the first GRAPH_CALLS are kept) */
	struct graph_call calls[GRAPH_CALLS];
};

struct graph_exec {
	u64 capture;  /* the capture it was instantiated from */
	u64 launches; /* successful launches so far */
};

/* capture number -> its calls; cudaGraph_t -> capture number; executables */
BPF_TABLE("lru_hash", struct graph_key, struct graph_state, graphs, MAX_GRAPHS);
BPF_TABLE("lru_hash", struct graph_key, u64, graph_handles, MAX_GRAPHS);
BPF_TABLE("lru_hash", struct graph_key, struct graph_exec, graph_execs, MAX_GRAPHS);
/* A zeroed graph_state to insert (too big for the BPF stack); never written. */
BPF_PERCPU_ARRAY(graph_zero, struct graph_state, 1);
/* [0]: captures begun on this host: numbers them */
BPF_ARRAY(capture_count, u64, 1);

/* nccl.c: the stream a collective or p2p call is made on (its key: see
 * thread_stream), made known (NULL until a CUDA runtime is attached). */
static __always_inline struct stream_state *cuda_stream(u32 pid, u64 stream)
{
	u32 zero = 0;
	u32 *on = cuda_on.lookup(&zero);
	if (!on || !*on)
		return NULL;
	return stream_for(pid, stream, 1);
}

/* nccl.c: a call made on a capturing stream joins its graph; returns its
 * 1-based place there (0 if the graph is unknown). */
static __always_inline u32 graph_append(u32 pid, u64 capture, u64 comm, u64 count, s32 peer,
					u8 op, u8 datatype, u8 redop)
{
	struct graph_key k = {.pid = pid, .id = capture};
	struct graph_state *g = graphs.lookup(&k);
	if (!g) {
		count_drop(DROP_GRAPH_FULL);
		return 0;
	}
	u64 i = g->ncalls++;
	if (i >= GRAPH_CALLS) {
		count_drop(DROP_GRAPH_FULL); /* captured, never replayed as a row */
		return (u32)(i + 1);
	}
	struct graph_call *c = &g->calls[i & (GRAPH_CALLS - 1)];
	c->comm = comm;
	c->count = count;
	c->peer = peer;
	c->op = op;
	c->datatype = datatype;
	c->redop = redop;
	return (u32)(i + 1);
}

static __always_inline void remember_stream(u32 pid, u64 stream)
{
	struct pid_streams zero = {};
	struct pid_streams *ps = streams_of.lookup_or_try_init(&pid, &zero);
	if (!ps || ps->n >= PID_STREAMS)
		return;
	u64 n = __sync_fetch_and_add(&ps->n, 1);
	if (n < PID_STREAMS)
		ps->stream[n & (PID_STREAMS - 1)] = stream;
}

/* A collective or p2p call at ring position pos, queued on its stream. */
static __always_inline void cuda_enqueue(u32 pid, u64 stream, struct stream_state *st, u64 pos)
{
	u64 i = __sync_fetch_and_add(&st->enq, 1);
	if (i == 0)
		remember_stream(pid, stream_id(stream));
	if (i >= STREAM_QUEUE && st->done + STREAM_QUEUE <= i)
		count_drop(DROP_CUDA_QUEUE); /* call i - STREAM_QUEUE never completed */
	st->pos[i & (STREAM_QUEUE - 1)] = pos;
	st->last_was_call = 1;
}

#endif

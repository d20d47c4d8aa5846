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

/* nccl.c: a collective or p2p call entered on `stream`, at ring position pos. */
static __always_inline void cuda_enqueue(u32 pid, u64 stream, u64 pos)
{
	u32 zero = 0;
	u32 *on = cuda_on.lookup(&zero);
	if (!on || !*on)
		return;
	struct stream_state *st = stream_for(pid, stream, 1);
	if (!st)
		return;
	u64 i = __sync_fetch_and_add(&st->enq, 1);
	if (i >= STREAM_QUEUE && st->done + STREAM_QUEUE <= i)
		count_drop(DROP_CUDA_QUEUE); /* call i - STREAM_QUEUE never completed */
	st->pos[i & (STREAM_QUEUE - 1)] = pos;
	st->last_was_call = 1;
}

#endif

/* Streams: each an in-order executor on its own host thread.  A stream runs
 * its items one at a time: "kernels" (time the stream is busy), host
 * functions (the lab's libnccl runs its collectives so), event records and
 * waits on events.  The legacy default stream (NULL, cudaStreamLegacy) and
 * each thread's per-thread stream (cudaStreamPerThread, NULL in a _ptsz
 * call) are made on first use and never destroyed; the legacy stream does
 * not synchronise with other streams here. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <time.h>

#include "labwait.h"
#include "runtime.h"

static cudaStream_t gLegacy;
static pthread_once_t gLegacyOnce = PTHREAD_ONCE_INIT;
static __thread cudaStream_t tPerThread;

static void sleepFor(cudaStream_t s, uint64_t ns) {
    if (ns == FOREVER_NS) { /* a device that stopped: only the process's end ends it */
        for (;;) {
            struct timespec t = {1, 0};
            nanosleep(&t, NULL);
        }
    }
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += (time_t)(ns / 1000000000ull);
    until.tv_nsec += (long)(ns % 1000000000ull);
    if (until.tv_nsec >= 1000000000L) until.tv_sec++, until.tv_nsec -= 1000000000L;
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &until, NULL) == EINTR) {
    }
    (void)s;
}

void labReleaseEventLocked(cudaEvent_t e) {
    if (--e->refs == 0 && e->destroyed) free(e);
}

/* Runs the front item; called and returns with labRtLock held. */
static void runItem(cudaStream_t s, item *it) {
    switch (it->kind) {
    case ITEM_KERNEL:
        pthread_mutex_unlock(&labRtLock);
        sleepFor(s, it->ns);
        pthread_mutex_lock(&labRtLock);
        break;
    case ITEM_HOST_FN:
        pthread_mutex_unlock(&labRtLock);
        it->fn(it->arg);
        pthread_mutex_lock(&labRtLock);
        break;
    case ITEM_RECORD:
        if (it->gen > it->event->reached) {
            it->event->reached = it->gen;
            it->event->reachedNs = labNowNs();
        }
        labReleaseEventLocked(it->event);
        break;
    case ITEM_WAIT:
        while (it->event->reached < it->gen) labCondWait(&labRtCond, &labRtLock);
        labReleaseEventLocked(it->event);
        break;
    }
}

static void *streamMain(void *arg) {
    cudaStream_t s = arg;
    pthread_mutex_lock(&labRtLock);
    for (;;) {
        while (!s->head && !s->stop) pthread_cond_wait(&labRtCond, &labRtLock);
        if (!s->head) break;
        item *it = s->head;
        runItem(s, it); /* stays at the front (pending) until it has run */
        s->head = it->next;
        if (!s->head) s->tail = NULL;
        s->done++;
        free(it);
        pthread_cond_broadcast(&labRtCond);
    }
    pthread_mutex_unlock(&labRtLock);
    free(s); /* destroyed and drained: nothing refers to it any more */
    return NULL;
}

static cudaError_t createStream(cudaStream_t *out, unsigned int flags, int priority) {
    cudaStream_t s = calloc(1, sizeof *s);
    if (!s) return cudaErrorMemoryAllocation;
    *s = (struct CUstream_st){.magic = STREAM_MAGIC, .flags = flags, .priority = priority};
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&s->thread, &attr, streamMain, s);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        free(s);
        return cudaErrorMemoryAllocation;
    }
    pthread_setname_np(s->thread, "labcudart-strm");
    if (!labRegister(s)) {
        pthread_mutex_lock(&labRtLock);
        s->stop = 1;
        pthread_cond_broadcast(&labRtCond);
        pthread_mutex_unlock(&labRtLock);
        return cudaErrorMemoryAllocation;
    }
    *out = s;
    return cudaSuccess;
}

static void makeLegacy(void) { createStream(&gLegacy, cudaStreamDefault, 0); }

/* The stream a handle names: the default streams are made here. */
cudaStream_t labResolveStream(cudaStream_t stream, int perThread) {
    if (stream == cudaStreamPerThread || (stream == NULL && perThread)) {
        if (!tPerThread) createStream(&tPerThread, cudaStreamDefault, 0);
        return tPerThread;
    }
    if (stream == NULL || stream == cudaStreamLegacy) {
        pthread_once(&gLegacyOnce, makeLegacy);
        return gLegacy;
    }
    return stream;
}

cudaError_t labEnqueueLocked(cudaStream_t s, item *it) {
    if (!labIsLiveLocked(s, STREAM_MAGIC)) return cudaErrorInvalidResourceHandle;
    it->next = NULL;
    if (s->tail) s->tail->next = it;
    else s->head = it;
    s->tail = it;
    s->enqueued++;
    pthread_cond_broadcast(&labRtCond);
    return cudaSuccess;
}

static cudaError_t enqueue(cudaStream_t stream, int perThread, item proto) {
    cudaStream_t s = labResolveStream(stream, perThread);
    item *it = malloc(sizeof *it);
    if (!it) return labRtError(cudaErrorMemoryAllocation);
    *it = proto;
    pthread_mutex_lock(&labRtLock);
    int capturing = labCapturingLocked(s); /* a node of the graph, copied */
    cudaError_t err = capturing ? labCaptureLocked(s, it) : labEnqueueLocked(s, it);
    pthread_mutex_unlock(&labRtLock);
    if (capturing || err != cudaSuccess) free(it);
    return labRtError(err);
}

cudaError_t labStreamSync(cudaStream_t stream, int perThread) {
    cudaStream_t s = labResolveStream(stream, perThread);
    pthread_mutex_lock(&labRtLock);
    cudaError_t err = labIsLiveLocked(s, STREAM_MAGIC) ? cudaSuccess : cudaErrorInvalidResourceHandle;
    if (err == cudaSuccess && labCapturingLocked(s)) {
        labInvalidateCaptureLocked(s); /* CUDA's rule: no waiting on a capture */
        err = cudaErrorStreamCaptureUnsupported;
    }
    if (err == cudaSuccess) {
        uint64_t target = s->enqueued;
        while (s->done < target) labCondWait(&labRtCond, &labRtLock);
    }
    pthread_mutex_unlock(&labRtLock);
    return labRtError(err);
}

static cudaError_t query(cudaStream_t stream, int perThread) {
    cudaStream_t s = labResolveStream(stream, perThread);
    pthread_mutex_lock(&labRtLock);
    cudaError_t err = cudaErrorInvalidResourceHandle;
    if (labIsLiveLocked(s, STREAM_MAGIC) && labCapturingLocked(s)) {
        labInvalidateCaptureLocked(s);
        err = cudaErrorStreamCaptureUnsupported;
    } else if (labIsLiveLocked(s, STREAM_MAGIC)) {
        err = s->done == s->enqueued ? cudaSuccess : cudaErrorNotReady;
    }
    pthread_mutex_unlock(&labRtLock);
    return labRtError(err);
}

static cudaError_t waitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags, int perThread) {
    if (flags & ~1u) return labRtError(cudaErrorInvalidValue);
    cudaStream_t s = labResolveStream(stream, perThread);
    item *it = malloc(sizeof *it);
    if (!it) return labRtError(cudaErrorMemoryAllocation);
    pthread_mutex_lock(&labRtLock);
    cudaError_t err = cudaSuccess;
    if (!labIsLiveLocked(event, EVENT_MAGIC)) err = cudaErrorInvalidResourceHandle;
    else if (labCapturingLocked(s)) /* the wait's generation is taken at each launch */
        err = labCaptureLocked(s, &(item){.kind = ITEM_WAIT, .event = event});
    else if (event->recorded == 0) err = cudaSuccess; /* nothing to wait for */
    else {
        *it = (item){.kind = ITEM_WAIT, .event = event, .gen = event->recorded};
        err = labEnqueueLocked(s, it);
        if (err == cudaSuccess) {
            event->refs++;
            it = NULL;
        }
    }
    pthread_mutex_unlock(&labRtLock);
    free(it);
    return labRtError(err);
}

CUDART_API cudaError_t cudaStreamCreate(cudaStream_t *pStream) {
    return cudaStreamCreateWithPriority(pStream, cudaStreamDefault, 0);
}

CUDART_API cudaError_t cudaStreamCreateWithFlags(cudaStream_t *pStream, unsigned int flags) {
    return cudaStreamCreateWithPriority(pStream, flags, 0);
}

CUDART_API cudaError_t cudaStreamCreateWithPriority(cudaStream_t *pStream, unsigned int flags,
                                                    int priority) {
    if (!pStream || (flags & ~(unsigned)cudaStreamNonBlocking)) return labRtError(cudaErrorInvalidValue);
    return labRtError(createStream(pStream, flags, priority));
}

CUDART_API cudaError_t cudaStreamDestroy(cudaStream_t stream) {
    pthread_mutex_lock(&labRtLock);
    int live = stream != gLegacy && labIsLiveLocked(stream, STREAM_MAGIC);
    if (live) {
        labUnregister(stream); /* no new work; what is queued still runs */
        stream->magic = 0;
        stream->stop = 1;
        pthread_cond_broadcast(&labRtCond);
    }
    pthread_mutex_unlock(&labRtLock);
    return live ? cudaSuccess : labRtError(cudaErrorInvalidResourceHandle);
}

CUDART_API cudaError_t cudaStreamSynchronize(cudaStream_t stream) { return labStreamSync(stream, 0); }
CUDART_API cudaError_t cudaStreamSynchronize_ptsz(cudaStream_t stream) { return labStreamSync(stream, 1); }
CUDART_API cudaError_t cudaStreamQuery(cudaStream_t stream) { return query(stream, 0); }
CUDART_API cudaError_t cudaStreamQuery_ptsz(cudaStream_t stream) { return query(stream, 1); }

CUDART_API cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
    return waitEvent(stream, event, flags, 0);
}

CUDART_API cudaError_t cudaStreamWaitEvent_ptsz(cudaStream_t stream, cudaEvent_t event,
                                                unsigned int flags) {
    return waitEvent(stream, event, flags, 1);
}

CUDART_API cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void *userData) {
    if (!fn) return labRtError(cudaErrorInvalidValue);
    return enqueue(stream, 0, (item){.kind = ITEM_HOST_FN, .fn = fn, .arg = userData});
}

CUDART_API cudaError_t cudaLaunchHostFunc_ptsz(cudaStream_t stream, cudaHostFn_t fn, void *userData) {
    if (!fn) return labRtError(cudaErrorInvalidValue);
    return enqueue(stream, 1, (item){.kind = ITEM_HOST_FN, .fn = fn, .arg = userData});
}

CUDART_API cudaError_t labLaunchKernel(cudaStream_t stream, unsigned long long duration_ns) {
    return enqueue(stream, 0, (item){.kind = ITEM_KERNEL, .ns = duration_ns});
}

CUDART_API cudaError_t labStreamPending(cudaStream_t stream, unsigned long long *pending) {
    if (!pending) return labRtError(cudaErrorInvalidValue);
    cudaStream_t s = labResolveStream(stream, 0);
    pthread_mutex_lock(&labRtLock);
    cudaError_t err = cudaErrorInvalidResourceHandle;
    if (labIsLiveLocked(s, STREAM_MAGIC)) {
        *pending = s->enqueued - s->done;
        err = cudaSuccess;
    }
    pthread_mutex_unlock(&labRtLock);
    return labRtError(err);
}

/* cudaDeviceSynchronize: every stream's work enqueued before the call. */
void labSyncAll(void) {
    cudaStream_t streams[256];
    int n = labLiveStreams(streams, 256);
    for (int i = 0; i < n; i++) labStreamSync(streams[i], 0);
}

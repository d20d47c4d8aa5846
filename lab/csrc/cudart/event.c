/* Events: a record is an item on a stream; the event is complete once the
 * stream has run its newest record (an event never recorded is complete). */
#include <stdlib.h>

#include "labwait.h"
#include "runtime.h"

#define EVENT_FLAGS (cudaEventBlockingSync | cudaEventDisableTiming | cudaEventInterprocess)

CUDART_API cudaError_t cudaEventCreate(cudaEvent_t *event) {
    return cudaEventCreateWithFlags(event, cudaEventDefault);
}

CUDART_API cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags) {
    if (!event || (flags & ~(unsigned)EVENT_FLAGS)) return labRtError(cudaErrorInvalidValue);
    if ((flags & cudaEventInterprocess) && !(flags & cudaEventDisableTiming))
        return labRtError(cudaErrorInvalidValue);
    cudaEvent_t e = calloc(1, sizeof *e);
    if (!e) return labRtError(cudaErrorMemoryAllocation);
    *e = (struct CUevent_st){.magic = EVENT_MAGIC, .flags = flags};
    if (!labRegister(e)) {
        free(e);
        return labRtError(cudaErrorMemoryAllocation);
    }
    *event = e;
    return cudaSuccess;
}

static cudaError_t record(cudaEvent_t event, cudaStream_t stream, unsigned int flags, int perThread) {
    if (flags & ~(unsigned)cudaEventRecordExternal) return labRtError(cudaErrorInvalidValue);
    cudaStream_t s = labResolveStream(stream, perThread);
    item *it = malloc(sizeof *it);
    if (!it) return labRtError(cudaErrorMemoryAllocation);
    pthread_mutex_lock(&labRtLock);
    cudaError_t err = cudaErrorInvalidResourceHandle;
    if (labIsLiveLocked(event, EVENT_MAGIC) && labCapturingLocked(s)) {
        /* a record node: the generation is taken at each launch */
        err = labCaptureLocked(s, &(item){.kind = ITEM_RECORD, .event = event});
    } else if (labIsLiveLocked(event, EVENT_MAGIC)) {
        *it = (item){.kind = ITEM_RECORD, .event = event, .gen = event->recorded + 1};
        err = labEnqueueLocked(s, it);
        if (err == cudaSuccess) {
            event->recorded++;
            event->refs++;
            it = NULL;
        }
    }
    pthread_mutex_unlock(&labRtLock);
    free(it);
    return labRtError(err);
}

CUDART_API cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
    return record(event, stream, 0, 0);
}

CUDART_API cudaError_t cudaEventRecord_ptsz(cudaEvent_t event, cudaStream_t stream) {
    return record(event, stream, 0, 1);
}

CUDART_API cudaError_t cudaEventRecordWithFlags(cudaEvent_t event, cudaStream_t stream,
                                                unsigned int flags) {
    return record(event, stream, flags, 0);
}

CUDART_API cudaError_t cudaEventRecordWithFlags_ptsz(cudaEvent_t event, cudaStream_t stream,
                                                     unsigned int flags) {
    return record(event, stream, flags, 1);
}

CUDART_API cudaError_t cudaEventQuery(cudaEvent_t event) {
    pthread_mutex_lock(&labRtLock);
    cudaError_t err = cudaErrorInvalidResourceHandle;
    if (labIsLiveLocked(event, EVENT_MAGIC))
        err = event->reached >= event->recorded ? cudaSuccess : cudaErrorNotReady;
    pthread_mutex_unlock(&labRtLock);
    return labRtError(err);
}

CUDART_API cudaError_t cudaEventSynchronize(cudaEvent_t event) {
    pthread_mutex_lock(&labRtLock);
    cudaError_t err = cudaErrorInvalidResourceHandle;
    if (labIsLiveLocked(event, EVENT_MAGIC)) {
        uint64_t target = event->recorded;
        event->refs++; /* a destroy while we wait must not free it */
        while (event->reached < target) labCondWait(&labRtCond, &labRtLock);
        if (--event->refs == 0 && event->destroyed) free(event);
        err = cudaSuccess;
    }
    pthread_mutex_unlock(&labRtLock);
    return labRtError(err);
}

static cudaError_t elapsedLocked(float *ms, cudaEvent_t start, cudaEvent_t end) {
    if (!labIsLiveLocked(start, EVENT_MAGIC) || !labIsLiveLocked(end, EVENT_MAGIC))
        return cudaErrorInvalidResourceHandle;
    if ((start->flags | end->flags) & cudaEventDisableTiming) return cudaErrorInvalidResourceHandle;
    if (start->recorded == 0 || end->recorded == 0) return cudaErrorInvalidResourceHandle;
    if (start->reached < start->recorded || end->reached < end->recorded) return cudaErrorNotReady;
    *ms = (float)((double)((int64_t)(end->reachedNs - start->reachedNs)) / 1e6);
    return cudaSuccess;
}

CUDART_API cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end) {
    if (!ms) return labRtError(cudaErrorInvalidValue);
    pthread_mutex_lock(&labRtLock);
    cudaError_t err = elapsedLocked(ms, start, end);
    pthread_mutex_unlock(&labRtLock);
    return labRtError(err);
}

CUDART_API cudaError_t cudaEventDestroy(cudaEvent_t event) {
    pthread_mutex_lock(&labRtLock);
    int live = labIsLiveLocked(event, EVENT_MAGIC);
    if (live) {
        labUnregister(event);
        event->magic = 0;
        event->destroyed = 1;
        if (event->refs == 0) free(event);
    }
    pthread_mutex_unlock(&labRtLock);
    return live ? cudaSuccess : labRtError(cudaErrorInvalidResourceHandle);
}

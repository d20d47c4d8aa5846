/* Stream capture and graphs.  A capture turns what is enqueued on one stream
 * into the nodes of a graph, in order (a chain: the lab's graphs have no
 * branches); an instantiated copy of it runs, each launch, as the same items
 * enqueued at once on the stream it is launched on.  Event record and wait
 * nodes take their event's generation at each launch, as a record or wait
 * enqueued at that moment would.  A graph and an executable hold a reference
 * on every event their nodes name. */
#include <stdlib.h>
#include <string.h>

#include "runtime.h"

static unsigned long long gCaptureIds; /* guarded by labRtLock */

int labCapturingLocked(cudaStream_t s) {
    return labIsLiveLocked(s, STREAM_MAGIC) && s->captureStatus != cudaStreamCaptureStatusNone;
}

void labInvalidateCaptureLocked(cudaStream_t s) { s->captureStatus = cudaStreamCaptureStatusInvalidated; }

static int isEventNode(const item *it) { return it->kind == ITEM_RECORD || it->kind == ITEM_WAIT; }

cudaError_t labCaptureLocked(cudaStream_t s, const item *proto) {
    if (s->captureStatus == cudaStreamCaptureStatusInvalidated) return cudaErrorStreamCaptureInvalidated;
    cudaGraph_t g = s->capture;
    if (g->nnodes == g->cap) {
        int cap = g->cap ? g->cap * 2 : 16;
        item *nodes = realloc(g->nodes, sizeof *nodes * (size_t)cap);
        if (!nodes) return cudaErrorMemoryAllocation;
        g->nodes = nodes;
        g->cap = cap;
    }
    item *node = &g->nodes[g->nnodes++];
    *node = *proto;
    node->next = NULL;
    if (isEventNode(node)) node->event->refs++;
    return cudaSuccess;
}

static void releaseNodesLocked(item *nodes, int n) {
    for (int i = 0; i < n; i++)
        if (isEventNode(&nodes[i])) labReleaseEventLocked(nodes[i].event);
}

static cudaError_t beginCapture(cudaStream_t stream, enum cudaStreamCaptureMode mode, int perThread) {
    if ((unsigned)mode > cudaStreamCaptureModeRelaxed) return labRtError(cudaErrorInvalidValue);
    /* the legacy stream synchronises implicitly: CUDA refuses to capture it */
    if (!perThread && (stream == NULL || stream == cudaStreamLegacy))
        return labRtError(cudaErrorStreamCaptureUnsupported);
    cudaStream_t s = labResolveStream(stream, perThread);
    cudaGraph_t g = calloc(1, sizeof *g);
    if (!g) return labRtError(cudaErrorMemoryAllocation);
    *g = (struct CUgraph_st){.magic = GRAPH_MAGIC};
    pthread_mutex_lock(&labRtLock);
    cudaError_t err = cudaSuccess;
    if (!labIsLiveLocked(s, STREAM_MAGIC)) err = cudaErrorInvalidResourceHandle;
    else if (s->captureStatus != cudaStreamCaptureStatusNone) err = cudaErrorIllegalState;
    else {
        s->capture = g;
        s->captureStatus = cudaStreamCaptureStatusActive;
        s->captureId = ++gCaptureIds;
        g = NULL;
    }
    pthread_mutex_unlock(&labRtLock);
    free(g);
    return labRtError(err);
}

static void freeGraphLocked(cudaGraph_t g) {
    releaseNodesLocked(g->nodes, g->nnodes);
    g->magic = 0;
    free(g->nodes);
    free(g);
}

static cudaError_t endCapture(cudaStream_t stream, cudaGraph_t *pGraph, int perThread) {
    if (!pGraph) return labRtError(cudaErrorInvalidValue);
    cudaStream_t s = labResolveStream(stream, perThread);
    pthread_mutex_lock(&labRtLock);
    cudaError_t err = cudaSuccess;
    cudaGraph_t g = NULL;
    if (!labIsLiveLocked(s, STREAM_MAGIC)) err = cudaErrorInvalidResourceHandle;
    else if (s->captureStatus == cudaStreamCaptureStatusNone) err = cudaErrorStreamCaptureUnmatched;
    else {
        g = s->capture;
        if (s->captureStatus == cudaStreamCaptureStatusInvalidated) {
            freeGraphLocked(g);
            g = NULL;
            err = cudaErrorStreamCaptureInvalidated;
        }
        s->capture = NULL;
        s->captureStatus = cudaStreamCaptureStatusNone;
    }
    pthread_mutex_unlock(&labRtLock);
    if (g && !labRegister(g)) {
        pthread_mutex_lock(&labRtLock);
        freeGraphLocked(g);
        pthread_mutex_unlock(&labRtLock);
        g = NULL;
        err = cudaErrorMemoryAllocation;
    }
    *pGraph = g;
    return labRtError(err);
}

static cudaError_t captureInfo(cudaStream_t stream, enum cudaStreamCaptureStatus *status,
                               unsigned long long *id, cudaGraph_t *graph,
                               const cudaGraphNode_t **deps, size_t *ndeps, int perThread) {
    if (!status) return labRtError(cudaErrorInvalidValue);
    cudaStream_t s = labResolveStream(stream, perThread);
    pthread_mutex_lock(&labRtLock);
    cudaError_t err = cudaErrorInvalidResourceHandle;
    if (labIsLiveLocked(s, STREAM_MAGIC)) {
        *status = s->captureStatus;
        int active = s->captureStatus == cudaStreamCaptureStatusActive;
        if (id) *id = active ? s->captureId : 0;
        if (graph) *graph = active ? s->capture : NULL;
        if (deps) *deps = NULL; /* node handles are not modelled */
        if (ndeps) *ndeps = 0;
        err = cudaSuccess;
    }
    pthread_mutex_unlock(&labRtLock);
    return labRtError(err);
}

static cudaError_t instantiate(cudaGraphExec_t *pExec, cudaGraph_t graph, unsigned long long flags) {
    if (!pExec) return labRtError(cudaErrorInvalidValue);
    if (flags & ~0xfull) return labRtError(cudaErrorInvalidValue);
    cudaGraphExec_t x = calloc(1, sizeof *x);
    if (!x) return labRtError(cudaErrorMemoryAllocation);
    *x = (struct CUgraphExec_st){.magic = EXEC_MAGIC};
    pthread_mutex_lock(&labRtLock);
    cudaError_t err = cudaErrorInvalidResourceHandle;
    if (labIsLiveLocked(graph, GRAPH_MAGIC)) {
        err = cudaSuccess;
        x->nodes = malloc(sizeof *x->nodes * (size_t)(graph->nnodes ? graph->nnodes : 1));
        if (!x->nodes) err = cudaErrorMemoryAllocation;
    }
    if (err == cudaSuccess) {
        memcpy(x->nodes, graph->nodes, sizeof *x->nodes * (size_t)graph->nnodes);
        x->nnodes = graph->nnodes;
        for (int i = 0; i < x->nnodes; i++)
            if (isEventNode(&x->nodes[i])) x->nodes[i].event->refs++;
    }
    pthread_mutex_unlock(&labRtLock);
    if (err == cudaSuccess && !labRegister(x)) err = cudaErrorMemoryAllocation;
    if (err != cudaSuccess) {
        pthread_mutex_lock(&labRtLock);
        releaseNodesLocked(x->nodes, x->nnodes);
        pthread_mutex_unlock(&labRtLock);
        free(x->nodes);
        free(x);
        return labRtError(err);
    }
    *pExec = x;
    return cudaSuccess;
}

/* One launch's item for node n, with its event's generation taken now;
 * NULL for a wait on an event never recorded (nothing to wait for). */
static item *launchItemLocked(const item *node, item *it) {
    *it = *node;
    it->next = NULL;
    if (node->kind == ITEM_RECORD) {
        it->gen = ++node->event->recorded;
        node->event->refs++;
    } else if (node->kind == ITEM_WAIT) {
        if (node->event->recorded == 0) return NULL;
        it->gen = node->event->recorded;
        node->event->refs++;
    }
    return it;
}

static cudaError_t launch(cudaGraphExec_t exec, cudaStream_t stream, int perThread) {
    cudaStream_t s = labResolveStream(stream, perThread);
    pthread_mutex_lock(&labRtLock);
    cudaError_t err = cudaErrorInvalidResourceHandle;
    if (labIsLiveLocked(exec, EXEC_MAGIC) && labIsLiveLocked(s, STREAM_MAGIC))
        err = labCapturingLocked(s) ? cudaErrorStreamCaptureUnsupported : cudaSuccess;
    for (int i = 0; err == cudaSuccess && i < exec->nnodes; i++) {
        item *it = malloc(sizeof *it);
        if (!it) {
            err = cudaErrorMemoryAllocation; /* the nodes before it still run */
            break;
        }
        if (!launchItemLocked(&exec->nodes[i], it) || labEnqueueLocked(s, it) != cudaSuccess) free(it);
    }
    pthread_mutex_unlock(&labRtLock);
    return labRtError(err);
}

CUDART_API cudaError_t cudaStreamBeginCapture(cudaStream_t stream, enum cudaStreamCaptureMode mode) {
    return beginCapture(stream, mode, 0);
}

CUDART_API cudaError_t cudaStreamBeginCapture_ptsz(cudaStream_t stream,
                                                   enum cudaStreamCaptureMode mode) {
    return beginCapture(stream, mode, 1);
}

CUDART_API cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t *pGraph) {
    return endCapture(stream, pGraph, 0);
}

CUDART_API cudaError_t cudaStreamEndCapture_ptsz(cudaStream_t stream, cudaGraph_t *pGraph) {
    return endCapture(stream, pGraph, 1);
}

CUDART_API cudaError_t cudaStreamIsCapturing(cudaStream_t stream,
                                             enum cudaStreamCaptureStatus *pCaptureStatus) {
    return captureInfo(stream, pCaptureStatus, NULL, NULL, NULL, NULL, 0);
}

CUDART_API cudaError_t cudaStreamIsCapturing_ptsz(cudaStream_t stream,
                                                  enum cudaStreamCaptureStatus *pCaptureStatus) {
    return captureInfo(stream, pCaptureStatus, NULL, NULL, NULL, NULL, 1);
}

CUDART_API cudaError_t cudaStreamGetCaptureInfo(cudaStream_t stream,
                                                enum cudaStreamCaptureStatus *captureStatus_out,
                                                unsigned long long *id_out, cudaGraph_t *graph_out,
                                                const cudaGraphNode_t **dependencies_out,
                                                size_t *numDependencies_out) {
    return captureInfo(stream, captureStatus_out, id_out, graph_out, dependencies_out,
                       numDependencies_out, 0);
}

CUDART_API cudaError_t cudaStreamGetCaptureInfo_ptsz(cudaStream_t stream,
                                                     enum cudaStreamCaptureStatus *captureStatus_out,
                                                     unsigned long long *id_out, cudaGraph_t *graph_out,
                                                     const cudaGraphNode_t **dependencies_out,
                                                     size_t *numDependencies_out) {
    return captureInfo(stream, captureStatus_out, id_out, graph_out, dependencies_out,
                       numDependencies_out, 1);
}

CUDART_API cudaError_t cudaStreamGetCaptureInfo_v2(cudaStream_t stream,
                                                   enum cudaStreamCaptureStatus *captureStatus_out,
                                                   unsigned long long *id_out, cudaGraph_t *graph_out,
                                                   const cudaGraphNode_t **dependencies_out,
                                                   size_t *numDependencies_out) {
    return captureInfo(stream, captureStatus_out, id_out, graph_out, dependencies_out,
                       numDependencies_out, 0);
}

CUDART_API cudaError_t cudaGraphInstantiate(cudaGraphExec_t *pGraphExec, cudaGraph_t graph,
                                            unsigned long long flags) {
    return instantiate(pGraphExec, graph, flags);
}

CUDART_API cudaError_t cudaGraphInstantiateWithFlags(cudaGraphExec_t *pGraphExec, cudaGraph_t graph,
                                                     unsigned long long flags) {
    return instantiate(pGraphExec, graph, flags);
}

CUDART_API cudaError_t cudaGraphLaunch(cudaGraphExec_t graphExec, cudaStream_t stream) {
    return launch(graphExec, stream, 0);
}

CUDART_API cudaError_t cudaGraphLaunch_ptsz(cudaGraphExec_t graphExec, cudaStream_t stream) {
    return launch(graphExec, stream, 1);
}

/* Launches already enqueued hold their own items: they still run. */
CUDART_API cudaError_t cudaGraphExecDestroy(cudaGraphExec_t graphExec) {
    pthread_mutex_lock(&labRtLock);
    int live = labIsLiveLocked(graphExec, EXEC_MAGIC);
    if (live) {
        labUnregister(graphExec);
        releaseNodesLocked(graphExec->nodes, graphExec->nnodes);
        graphExec->magic = 0;
        free(graphExec->nodes);
        free(graphExec);
    }
    pthread_mutex_unlock(&labRtLock);
    return live ? cudaSuccess : labRtError(cudaErrorInvalidResourceHandle);
}

CUDART_API cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
    pthread_mutex_lock(&labRtLock);
    int live = labIsLiveLocked(graph, GRAPH_MAGIC);
    if (live) {
        labUnregister(graph);
        freeGraphLocked(graph);
    }
    pthread_mutex_unlock(&labRtLock);
    return live ? cudaSuccess : labRtError(cudaErrorInvalidResourceHandle);
}

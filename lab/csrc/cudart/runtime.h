/* Internals of the lab's CUDA runtime: nothing here is exported. */
#ifndef LABCUDART_RUNTIME_H
#define LABCUDART_RUNTIME_H

#define LABCUDART_BUILD 1
#include "labcudart.h"

#include <pthread.h>
#include <stdint.h>

#define STREAM_MAGIC 0x6c61627374726d31ull /* "labstrm1" */
#define EVENT_MAGIC 0x6c61626576656e31ull  /* "labeven1" */
#define GRAPH_MAGIC 0x6c61626772617031ull  /* "labgrap1" */
#define EXEC_MAGIC 0x6c61626578656331ull   /* "labexec1" */
#define FOREVER_NS (~0ull)

typedef enum { ITEM_KERNEL, ITEM_HOST_FN, ITEM_RECORD, ITEM_WAIT } itemKind;

/* One thing a stream runs, in order. */
typedef struct item {
    struct item *next;
    itemKind kind;
    uint64_t ns;        /* kernel: how long */
    cudaHostFn_t fn;    /* host function */
    void *arg;
    cudaEvent_t event;  /* record: completes it; wait: waits for it */
    uint64_t gen;       /* the event's record generation this item is about */
} item;

struct CUstream_st {
    uint64_t magic;
    unsigned int flags;
    int priority;
    pthread_t thread;
    int stop;
    item *head;
    item *tail;
    uint64_t enqueued; /* items ever enqueued; guarded by the runtime lock */
    uint64_t done;     /* items ever finished */
    /* stream capture (graph.c): while `capture` is set, work enqueued on the
     * stream becomes a node of that graph instead of running */
    enum cudaStreamCaptureStatus captureStatus;
    cudaGraph_t capture;
    unsigned long long captureId;
};

/* A graph: the items captured from one stream, in order (nodes form a chain). */
struct CUgraph_st {
    uint64_t magic;
    item *nodes;
    int nnodes;
    int cap;
};

/* An instantiated graph: its own copy of the nodes, launched as a whole. */
struct CUgraphExec_st {
    uint64_t magic;
    item *nodes;
    int nnodes;
};

struct CUevent_st {
    uint64_t magic;
    unsigned int flags;
    uint64_t recorded; /* cudaEventRecord calls so far (the generation) */
    uint64_t reached;  /* the newest generation the stream has reached */
    uint64_t reachedNs;
    int refs;      /* queued records and waits that refer to it */
    int destroyed; /* freed when the last of them has run */
};

/* device.c: the one lock and condition every stream and event uses, the
 * registry of live handles (an invalid one is never dereferenced), errors */
extern pthread_mutex_t labRtLock;
extern pthread_cond_t labRtCond;
int labRegister(void *handle);
void labUnregister(void *handle);
int labIsLiveLocked(const void *handle, uint64_t magic);
int labLiveStreams(cudaStream_t *out, int max);
cudaError_t labRtError(cudaError_t err);
uint64_t labNowNs(void);

/* stream.c */
cudaStream_t labResolveStream(cudaStream_t stream, int perThread);
cudaError_t labEnqueueLocked(cudaStream_t s, item *it);
cudaError_t labStreamSync(cudaStream_t stream, int perThread);
void labSyncAll(void);
void labReleaseEventLocked(cudaEvent_t e);

/* graph.c: called with labRtLock held */
int labCapturingLocked(cudaStream_t s);
cudaError_t labCaptureLocked(cudaStream_t s, const item *proto);
void labInvalidateCaptureLocked(cudaStream_t s);

#endif

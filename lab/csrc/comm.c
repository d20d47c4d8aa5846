/* The NCCL API: communicators (registry, lifecycle, the async "stream", the
 * CUDA streams of the lab's runtime), argument checks, groups, error strings.
 * Every exported function is here. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "internal.h"
#include "labwait.h"

/* ---- the registry of live communicators: an invalid handle is never dereferenced ---- */

static pthread_mutex_t gLock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gIdle = PTHREAD_COND_INITIALIZER;
static ncclComm_t *gComms;
static int gN, gCap;

static int findLocked(ncclComm_t c) {
    for (int i = 0; c && i < gN; i++)
        if (gComms[i] == c) return i;
    return -1;
}

static int registerComm(ncclComm_t c) {
    pthread_mutex_lock(&gLock);
    int ok = 1;
    if (gN == gCap) {
        int cap = gCap ? gCap * 2 : 16;
        ncclComm_t *v = realloc(gComms, sizeof *v * (size_t)cap);
        if (v) {
            gComms = v;
            gCap = cap;
        } else {
            ok = 0;
        }
    }
    if (ok) gComms[gN++] = c;
    pthread_mutex_unlock(&gLock);
    return ok;
}

/* Removes c so that no new call can enter it, then waits for calls inside. */
static int unregisterComm(ncclComm_t c) {
    pthread_mutex_lock(&gLock);
    int i = findLocked(c);
    if (i >= 0) {
        gComms[i] = gComms[--gN];
        while (c->active) pthread_cond_wait(&gIdle, &gLock);
    }
    pthread_mutex_unlock(&gLock);
    return i >= 0;
}

static ncclResult_t acquire(ncclComm_t c, const char *fn) {
    pthread_mutex_lock(&gLock);
    int i = findLocked(c);
    if (i >= 0) c->active++;
    pthread_mutex_unlock(&gLock);
    if (i < 0) return labError(NULL, ncclInvalidArgument, "%s: invalid communicator %p", fn, (void *)c);
    return ncclSuccess;
}

static void release(ncclComm_t c) {
    pthread_mutex_lock(&gLock);
    if (--c->active == 0) pthread_cond_broadcast(&gIdle);
    pthread_mutex_unlock(&gLock);
}

/* ---- execution: inline (blocking) or on the comm's stream thread (async) ---- */

static ncclResult_t stickyError(ncclComm_t c) {
    pthread_mutex_lock(&c->mu);
    ncclResult_t err = c->error;
    pthread_mutex_unlock(&c->mu);
    if (err == ncclSuccess) return ncclSuccess;
    return labError(c, err, "rank %d: communicator failed earlier: %s", c->rank, c->firstError);
}

static ncclResult_t execute(ncclComm_t c, const labOp *ops, int nops) {
    ncclResult_t res = stickyError(c);
    if (res != ncclSuccess) return res;
    res = labRunOps(c, ops, nops);
    if (res != ncclSuccess) {
        pthread_mutex_lock(&c->mu);
        if (c->error == ncclSuccess) {
            c->error = res;
            memcpy(c->firstError, c->lastError, sizeof c->firstError);
        }
        pthread_mutex_unlock(&c->mu);
    }
    return res;
}

static void *streamMain(void *arg) {
    ncclComm_t c = arg;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        while (!c->head && !c->stop) pthread_cond_wait(&c->cv, &c->mu);
        if (!c->head) break;
        labWork *w = c->head;
        c->head = w->next;
        if (!c->head) c->tail = NULL;
        c->busy = 1;
        pthread_mutex_unlock(&c->mu);
        if (!atomic_load(&c->aborting)) execute(c, w->ops, w->nops);
        free(w);
        pthread_mutex_lock(&c->mu);
        c->busy = 0;
        pthread_cond_broadcast(&c->cv);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

static ncclResult_t enqueue(ncclComm_t c, const labOp *ops, int nops) {
    labWork *w = malloc(sizeof *w + sizeof *ops * (size_t)nops);
    if (!w) return labError(c, ncclSystemError, "out of memory");
    w->next = NULL;
    w->nops = nops;
    memcpy(w->ops, ops, sizeof *ops * (size_t)nops);
    pthread_mutex_lock(&c->mu);
    if (c->tail) c->tail->next = w;
    else c->head = w;
    c->tail = w;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    return ncclSuccess;
}

/* ---- execution on a CUDA stream of the lab's runtime ---- */

static void cudaStreamWorkMain(void *arg) {
    labWork *w = arg;
    ncclComm_t c = w->ops[0].comm;
    if (!atomic_load(&c->aborting)) execute(c, w->ops, w->nops);
    free(w);
    pthread_mutex_lock(&c->mu);
    c->onStreams--;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

/* A captured op runs once per launch of its graph: it is never freed by a
 * run, nor counted as queued (the graph's launches are not NCCL calls). */
static void cudaGraphWorkMain(void *arg) {
    labWork *w = arg;
    ncclComm_t c = w->ops[0].comm;
    if (!atomic_load(&c->aborting)) execute(c, w->ops, w->nops);
}

static ncclResult_t captureOnStream(ncclComm_t c, labWork *w) {
    ncclResult_t res = labLaunchHost(c, w->ops[0].stream, cudaGraphWorkMain, w, labOpName(w->ops[0].kind));
    if (res != ncclSuccess) {
        free(w);
        return res;
    }
    pthread_mutex_lock(&c->mu);
    w->next = c->captured;
    c->captured = w;
    pthread_mutex_unlock(&c->mu);
    return ncclSuccess;
}

/* The ops run, in order, when the stream reaches them; errors after the
 * launch are the comm's sticky error, as on the async mode's own thread.
 * On a stream being captured they become a node of its graph instead. */
static ncclResult_t launchOnStream(ncclComm_t c, const labOp *ops, int nops) {
    labWork *w = malloc(sizeof *w + sizeof *ops * (size_t)nops);
    if (!w) return labError(c, ncclSystemError, "out of memory");
    w->next = NULL;
    w->nops = nops;
    memcpy(w->ops, ops, sizeof *ops * (size_t)nops);
    if (labStreamCapturing(ops[0].stream)) return captureOnStream(c, w);
    pthread_mutex_lock(&c->mu);
    c->onStreams++;
    pthread_mutex_unlock(&c->mu);
    ncclResult_t res = labLaunchHost(c, ops[0].stream, cudaStreamWorkMain, w, labOpName(ops[0].kind));
    if (res != ncclSuccess) {
        free(w);
        pthread_mutex_lock(&c->mu);
        c->onStreams--;
        pthread_cond_broadcast(&c->cv);
        pthread_mutex_unlock(&c->mu);
    }
    return res;
}

static void drainCudaStreams(ncclComm_t c) {
    pthread_mutex_lock(&c->mu);
    while (c->onStreams > 0) labCondWait(&c->cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
}

static void drainStream(ncclComm_t c) {
    pthread_mutex_lock(&c->mu);
    while (c->head || c->busy) labCondWait(&c->cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
}

static void stopStream(ncclComm_t c, int discard) {
    if (!c->hasStream) return;
    pthread_mutex_lock(&c->mu);
    while (discard && c->head) {
        labWork *w = c->head;
        c->head = w->next;
        free(w);
    }
    if (discard) c->tail = NULL;
    c->stop = 1;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    pthread_join(c->stream, NULL);
    c->hasStream = 0;
}

/* ---- communicator lifecycle ---- */

static void freeComm(ncclComm_t c) {
    while (c->captured) {
        labWork *w = c->captured;
        c->captured = w->next;
        free(w);
    }
    for (int i = 0; c->fds && i < c->nranks; i++)
        if (c->fds[i] >= 0) close(c->fds[i]);
    free(c->fds);
    free(c->addrs);
    free(c->sendSeq);
    free(c->recvSeq);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    c->magic = 0;
    free(c);
}

static ncclResult_t startStream(ncclComm_t c) {
    const char *env = getenv("LABNCCL_ASYNC");
    c->async = env && strcmp(env, "1") == 0;
    if (!c->async) return ncclSuccess;
    int rc = pthread_create(&c->stream, NULL, streamMain, c);
    if (rc != 0) return labError(c, ncclSystemError, "cannot start stream thread: %s", strerror(rc));
    pthread_setname_np(c->stream, "labnccl-stream");
    c->hasStream = 1;
    return ncclSuccess;
}

ncclResult_t labCreateComm(ncclComm_t *out, int rank, int nranks, uint64_t tag, int listenFd,
                           const struct sockaddr_in *self, const struct sockaddr_in *addrs) {
    ncclComm_t c = calloc(1, sizeof *c);
    if (!c) return labError(NULL, ncclSystemError, "out of memory");
    *c = (struct ncclComm){.magic = LAB_COMM_MAGIC, .rank = rank, .nranks = nranks, .tag = tag,
                           .self = *self};
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    c->fds = malloc(sizeof *c->fds * (size_t)nranks);
    c->addrs = malloc(sizeof *c->addrs * (size_t)nranks);
    c->sendSeq = calloc((size_t)nranks, sizeof *c->sendSeq);
    c->recvSeq = calloc((size_t)nranks, sizeof *c->recvSeq);
    ncclResult_t res = ncclSuccess;
    if (!c->fds || !c->addrs || !c->sendSeq || !c->recvSeq) res = labError(NULL, ncclSystemError, "out of memory");
    if (res == ncclSuccess) {
        for (int i = 0; i < nranks; i++) c->fds[i] = -1;
        memcpy(c->addrs, addrs, sizeof *addrs * (size_t)nranks);
        res = labMesh(c, listenFd);
    }
    if (res == ncclSuccess) res = startStream(c);
    if (res == ncclSuccess && !registerComm(c)) res = labError(NULL, ncclSystemError, "out of memory");
    if (res != ncclSuccess) {
        stopStream(c, 1);
        freeComm(c);
        return res;
    }
    *out = c;
    return ncclSuccess;
}

static ncclResult_t initRank(ncclComm_t *out, int nranks, const ncclUniqueId *id, int rank,
                             const char *fn) {
    if (!out) return labError(NULL, ncclInvalidArgument, "%s: comm pointer is NULL", fn);
    if (nranks < 1 || rank < 0 || rank >= nranks)
        return labError(NULL, ncclInvalidArgument, "%s: rank %d is not in [0, nranks=%d)", fn, rank, nranks);
    struct sockaddr_in root;
    memcpy(&root, id->internal + 8, sizeof root);
    if (root.sin_family != AF_INET || root.sin_port == 0)
        return labError(NULL, ncclInvalidArgument,
                        "%s: the ncclUniqueId holds no AF_INET bootstrap address (family %u): "
                        "was it made by ncclGetUniqueId?", fn, root.sin_family);
    struct sockaddr_in self;
    ncclResult_t res = labPickAddress(&self);
    if (res != ncclSuccess) return res;
    int lfd = labListen(&self);
    if (lfd < 0) return labError(NULL, ncclSystemError, "%s: cannot listen: %s", fn, strerror(errno));
    struct sockaddr_in *table = calloc((size_t)nranks, sizeof *table);
    res = table ? labBootstrap(id, rank, nranks, &self, table) : labError(NULL, ncclSystemError, "out of memory");
    uint64_t magic;
    memcpy(&magic, id->internal, sizeof magic);
    if (res == ncclSuccess) res = labCreateComm(out, rank, nranks, labMix(magic), lfd, &self, table);
    close(lfd);
    free(table);
    return res;
}

NCCL_API ncclResult_t ncclGetVersion(int *version) {
    if (!version) return labError(NULL, ncclInvalidArgument, "ncclGetVersion: version is NULL");
    *version = NCCL_VERSION_CODE;
    return ncclSuccess;
}

NCCL_API ncclResult_t ncclGetUniqueId(ncclUniqueId *uniqueId) {
    if (!uniqueId) return labError(NULL, ncclInvalidArgument, "ncclGetUniqueId: uniqueId is NULL");
    struct sockaddr_in addr;
    ncclResult_t res = labPickAddress(&addr);
    return res != ncclSuccess ? res : labStartRoot(uniqueId, &addr);
}

NCCL_API ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank) {
    return initRank(comm, nranks, &commId, rank, "ncclCommInitRank");
}

NCCL_API ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId,
                                             int rank, ncclConfig_t *config) {
    if (config && config->magic != NCCL_CONFIG_MAGIC)
        return labError(NULL, ncclInvalidArgument,
                        "ncclCommInitRankConfig: config magic is 0x%x, expected 0x%x "
                        "(initialise it with NCCL_CONFIG_INITIALIZER)", config->magic, NCCL_CONFIG_MAGIC);
    return initRank(comm, nranks, &commId, rank, "ncclCommInitRankConfig");
}

typedef struct {
    ncclComm_t *comm;
    int nranks;
    int rank;
    const ncclUniqueId *id;
    ncclResult_t res;
} initArgs;

static void *initAllMain(void *arg) {
    initArgs *a = arg;
    a->res = initRank(a->comm, a->nranks, a->id, a->rank, "ncclCommInitAll");
    return NULL;
}

NCCL_API ncclResult_t ncclCommInitAll(ncclComm_t *comms, int ndev, const int *devlist) {
    (void)devlist;
    if (!comms || ndev < 1)
        return labError(NULL, ncclInvalidArgument, "ncclCommInitAll: comms is NULL or ndev=%d < 1", ndev);
    ncclUniqueId id;
    ncclResult_t res = ncclGetUniqueId(&id);
    if (res != ncclSuccess) return res;
    initArgs *a = calloc((size_t)ndev, sizeof *a);
    pthread_t *t = calloc((size_t)ndev, sizeof *t);
    if (!a || !t) res = labError(NULL, ncclSystemError, "out of memory");
    int started = 0;
    for (; res == ncclSuccess && started < ndev; started++) {
        comms[started] = NULL;
        a[started] = (initArgs){&comms[started], ndev, started, &id, ncclSuccess};
        if (pthread_create(&t[started], NULL, initAllMain, &a[started]) != 0)
            res = labError(NULL, ncclSystemError, "ncclCommInitAll: cannot start thread");
    }
    for (int i = 0; i < started - (res != ncclSuccess); i++) {
        pthread_join(t[i], NULL);
        if (res == ncclSuccess) res = a[i].res;
    }
    for (int i = 0; res != ncclSuccess && i < ndev; i++)
        if (a && a[i].res == ncclSuccess && comms[i]) ncclCommDestroy(comms[i]), comms[i] = NULL;
    free(a);
    free(t);
    return res;
}

static int byKeyThenRank(const void *x, const void *y) {
    const int32_t *a = x, *b = y; /* (key, parent rank) */
    if (a[0] != b[0]) return a[0] < b[0] ? -1 : 1;
    return a[1] < b[1] ? -1 : a[1] > b[1];
}

static ncclResult_t splitJoin(ncclComm_t c, int color, uint64_t index, const int32_t *all,
                              const struct sockaddr_in *addrs, int lfd, ncclComm_t *newcomm) {
    int n = c->nranks, m = 0, me = -1;
    int32_t (*members)[2] = malloc(sizeof *members * (size_t)n);
    struct sockaddr_in *maddrs = malloc(sizeof *maddrs * (size_t)n);
    ncclResult_t res = members && maddrs ? ncclSuccess : labError(c, ncclSystemError, "out of memory");
    for (int p = 0; res == ncclSuccess && p < n; p++)
        if (all[2 * p] == color) members[m][0] = all[2 * p + 1], members[m++][1] = p;
    if (res == ncclSuccess) qsort(members, (size_t)m, sizeof *members, byKeyThenRank);
    for (int i = 0; res == ncclSuccess && i < m; i++) {
        maddrs[i] = addrs[members[i][1]];
        if (members[i][1] == c->rank) me = i;
    }
    uint64_t tag = labMix(c->tag ^ labMix(index + 1) ^ labMix(((uint64_t)(uint32_t)color) << 20));
    if (res == ncclSuccess) res = labCreateComm(newcomm, me, m, tag, lfd, &c->self, maddrs);
    free(members);
    free(maddrs);
    return res;
}

NCCL_API ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm,
                                    ncclConfig_t *config) {
    (void)config;
    ncclResult_t res = acquire(comm, "ncclCommSplit");
    if (res != ncclSuccess) return res;
    if (!newcomm || color < NCCL_SPLIT_NOCOLOR) {
        release(comm);
        return labError(comm, ncclInvalidArgument, "ncclCommSplit: newcomm is NULL or color %d < -1", color);
    }
    *newcomm = NULL;
    if (comm->async) drainStream(comm);
    drainCudaStreams(comm); /* the exchange uses the sockets its queued ops use */
    struct sockaddr_in self = comm->self;
    int lfd = color == NCCL_SPLIT_NOCOLOR ? -1 : labListen(&self);
    int32_t *all = malloc(sizeof *all * 2 * (size_t)comm->nranks);
    struct sockaddr_in *addrs = malloc(sizeof *addrs * (size_t)comm->nranks);
    res = stickyError(comm);
    if (res == ncclSuccess && (!all || !addrs || (color != NCCL_SPLIT_NOCOLOR && lfd < 0)))
        res = labError(comm, ncclSystemError, "ncclCommSplit: cannot listen or allocate: %s", strerror(errno));
    const int32_t mine[2] = {color, key};
    if (res == ncclSuccess) res = labSplitExchange(comm, mine, all, addrs, &self);
    uint64_t index = comm->nsplits++;
    if (res == ncclSuccess && color != NCCL_SPLIT_NOCOLOR)
        res = splitJoin(comm, color, index, all, addrs, lfd, newcomm);
    if (lfd >= 0) close(lfd);
    free(all);
    free(addrs);
    release(comm);
    return res;
}

NCCL_API ncclResult_t ncclCommFinalize(ncclComm_t comm) {
    ncclResult_t res = acquire(comm, "ncclCommFinalize");
    if (res != ncclSuccess) return res;
    if (comm->async) drainStream(comm);
    drainCudaStreams(comm);
    pthread_mutex_lock(&comm->mu);
    res = comm->error;
    pthread_mutex_unlock(&comm->mu);
    release(comm);
    return res;
}

NCCL_API ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    if (!unregisterComm(comm))
        return labError(NULL, ncclInvalidArgument, "ncclCommDestroy: invalid communicator %p", (void *)comm);
    stopStream(comm, 0); /* runs what is queued, as NCCL flushes before destroy */
    drainCudaStreams(comm);
    freeComm(comm);
    return ncclSuccess;
}

NCCL_API ncclResult_t ncclCommAbort(ncclComm_t comm) {
    pthread_mutex_lock(&gLock);
    int ok = findLocked(comm) >= 0;
    if (ok) {
        /* wake anything blocked on a socket of this comm before waiting for it */
        atomic_store(&comm->aborting, 1);
        for (int i = 0; i < comm->nranks; i++)
            if (comm->fds[i] >= 0) shutdown(comm->fds[i], SHUT_RDWR);
    }
    pthread_mutex_unlock(&gLock);
    if (!ok || !unregisterComm(comm))
        return labError(NULL, ncclInvalidArgument, "ncclCommAbort: invalid communicator %p", (void *)comm);
    stopStream(comm, 1);
    drainCudaStreams(comm); /* queued ops see `aborting` and skip */
    freeComm(comm);
    return ncclSuccess;
}

NCCL_API ncclResult_t ncclCommCount(const ncclComm_t comm, int *count) {
    ncclResult_t res = acquire(comm, "ncclCommCount");
    if (res != ncclSuccess) return res;
    if (count) *count = comm->nranks;
    release(comm);
    return count ? ncclSuccess : labError(comm, ncclInvalidArgument, "ncclCommCount: count is NULL");
}

NCCL_API ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank) {
    ncclResult_t res = acquire(comm, "ncclCommUserRank");
    if (res != ncclSuccess) return res;
    if (rank) *rank = comm->rank;
    release(comm);
    return rank ? ncclSuccess : labError(comm, ncclInvalidArgument, "ncclCommUserRank: rank is NULL");
}

NCCL_API ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError) {
    ncclResult_t res = acquire(comm, "ncclCommGetAsyncError");
    if (res != ncclSuccess) return res;
    if (asyncError) {
        pthread_mutex_lock(&comm->mu);
        *asyncError = comm->error;
        pthread_mutex_unlock(&comm->mu);
    }
    release(comm);
    return asyncError ? ncclSuccess : labError(comm, ncclInvalidArgument, "ncclCommGetAsyncError: NULL");
}

NCCL_API ncclResult_t labStreamSynchronize(ncclComm_t comm) {
    ncclResult_t res = acquire(comm, "labStreamSynchronize");
    if (res != ncclSuccess) return res;
    if (comm->async) {
        drainStream(comm);
        res = stickyError(comm);
    }
    release(comm);
    return res;
}

/* Not inlined: a leaf entry point would lose its `push %rbp` prologue. */
static __attribute__((noinline)) const char *errorString(ncclResult_t result) {
    switch (result) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
    }
}

NCCL_API const char *ncclGetErrorString(ncclResult_t result) { return errorString(result); }

NCCL_API const char *ncclGetLastError(ncclComm_t comm) {
    pthread_mutex_lock(&gLock);
    int known = findLocked(comm) >= 0;
    pthread_mutex_unlock(&gLock);
    return known ? comm->lastError : labLastError();
}

/* ---- calls: checks, then the group queue, the stream, or inline ---- */

static int sendsHere(const labOp *op, int rank) {
    switch (op->kind) {
    case OP_BROADCAST:
    case OP_SCATTER: return rank == op->root;
    case OP_RECV: return 0;
    default: return 1;
    }
}

static int recvsHere(const labOp *op, int rank) {
    switch (op->kind) {
    case OP_REDUCE:
    case OP_GATHER: return rank == op->root;
    case OP_SEND: return 0;
    default: return 1;
    }
}

static int isRootedOrP2p(int kind) {
    return kind == OP_BROADCAST || kind == OP_REDUCE || kind == OP_GATHER || kind == OP_SCATTER ||
           kind == OP_SEND || kind == OP_RECV;
}

static ncclResult_t validate(const labOp *op) {
    ncclComm_t c = op->comm;
    const char *fn = labOpName(op->kind);
    if (op->dtype < 0 || op->dtype >= ncclNumTypes)
        return labError(c, ncclInvalidArgument, "%s: invalid datatype %d", fn, op->dtype);
    int reducing = op->kind == OP_ALLREDUCE || op->kind == OP_REDUCE || op->kind == OP_REDUCESCATTER;
    if (reducing && (op->redop < 0 || op->redop >= ncclNumOps))
        return labError(c, ncclInvalidArgument, "%s: invalid reduction op %d", fn, op->redop);
    if (isRootedOrP2p(op->kind) && (op->root < 0 || op->root >= c->nranks))
        return labError(c, ncclInvalidArgument, "%s: %s %d is not in [0, nranks=%d)", fn,
                        op->kind == OP_SEND || op->kind == OP_RECV ? "peer" : "root", op->root, c->nranks);
    if (op->count > ((size_t)1 << 48))
        return labError(c, ncclInvalidArgument, "%s: count %zu is too large", fn, op->count);
    if (op->count && sendsHere(op, c->rank) && !op->send)
        return labError(c, ncclInvalidArgument, "%s: sendbuff is NULL", fn);
    if (op->count && recvsHere(op, c->rank) && !op->recv)
        return labError(c, ncclInvalidArgument, "%s: recvbuff is NULL", fn);
    return ncclSuccess;
}

static __thread struct {
    int depth;
    labOp *ops;
    int n;
    int cap;
} grp;

static ncclResult_t groupAdd(const labOp *op) {
    if (grp.n == grp.cap) {
        int cap = grp.cap ? grp.cap * 2 : 16;
        labOp *v = realloc(grp.ops, sizeof *v * (size_t)cap);
        if (!v) return labError(op->comm, ncclSystemError, "out of memory");
        grp.ops = v;
        grp.cap = cap;
    }
    grp.ops[grp.n++] = *op;
    return ncclSuccess;
}

static ncclResult_t submit(const labOp *op) {
    ncclComm_t c = op->comm;
    ncclResult_t res = acquire(c, labOpName(op->kind));
    if (res != ncclSuccess) return res;
    res = validate(op);
    if (res == ncclSuccess) res = stickyError(c);
    if (res == ncclSuccess) {
        if (grp.depth > 0) res = groupAdd(op);
        else if (op->stream) res = launchOnStream(c, op, 1);
        else if (c->async) res = enqueue(c, op, 1);
        else res = execute(c, op, 1);
    }
    release(c);
    return res;
}

NCCL_API ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count,
                                    ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                    cudaStream_t stream) {
    labOp o = {OP_ALLREDUCE, sendbuff, recvbuff, count, datatype, op, -1, comm, stream};
    return submit(&o);
}

NCCL_API ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count,
                                    ncclDataType_t datatype, int root, ncclComm_t comm,
                                    cudaStream_t stream) {
    labOp o = {OP_BROADCAST, sendbuff, recvbuff, count, datatype, 0, root, comm, stream};
    return submit(&o);
}

NCCL_API ncclResult_t ncclBcast(void *buff, size_t count, ncclDataType_t datatype, int root,
                                ncclComm_t comm, cudaStream_t stream) {
    labOp o = {OP_BROADCAST, buff, buff, count, datatype, 0, root, comm, stream};
    return submit(&o);
}

NCCL_API ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count,
                                 ncclDataType_t datatype, ncclRedOp_t op, int root,
                                 ncclComm_t comm, cudaStream_t stream) {
    labOp o = {OP_REDUCE, sendbuff, recvbuff, count, datatype, op, root, comm, stream};
    return submit(&o);
}

NCCL_API ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount,
                                    ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) {
    labOp o = {OP_ALLGATHER, sendbuff, recvbuff, sendcount, datatype, 0, -1, comm, stream};
    return submit(&o);
}

NCCL_API ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
                                        ncclDataType_t datatype, ncclRedOp_t op,
                                        ncclComm_t comm, cudaStream_t stream) {
    labOp o = {OP_REDUCESCATTER, sendbuff, recvbuff, recvcount, datatype, op, -1, comm, stream};
    return submit(&o);
}

NCCL_API ncclResult_t ncclAlltoAll(const void *sendbuff, void *recvbuff, size_t count,
                                   ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) {
    labOp o = {OP_ALLTOALL, sendbuff, recvbuff, count, datatype, 0, -1, comm, stream};
    return submit(&o);
}

NCCL_API ncclResult_t ncclGather(const void *sendbuff, void *recvbuff, size_t count,
                                 ncclDataType_t datatype, int root, ncclComm_t comm,
                                 cudaStream_t stream) {
    labOp o = {OP_GATHER, sendbuff, recvbuff, count, datatype, 0, root, comm, stream};
    return submit(&o);
}

NCCL_API ncclResult_t ncclScatter(const void *sendbuff, void *recvbuff, size_t count,
                                  ncclDataType_t datatype, int root, ncclComm_t comm,
                                  cudaStream_t stream) {
    labOp o = {OP_SCATTER, sendbuff, recvbuff, count, datatype, 0, root, comm, stream};
    return submit(&o);
}

NCCL_API ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype,
                               int peer, ncclComm_t comm, cudaStream_t stream) {
    labOp o = {OP_SEND, sendbuff, NULL, count, datatype, 0, peer, comm, stream};
    return submit(&o);
}

NCCL_API ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer,
                               ncclComm_t comm, cudaStream_t stream) {
    labOp o = {OP_RECV, NULL, recvbuff, count, datatype, 0, peer, comm, stream};
    return submit(&o);
}

NCCL_API ncclResult_t ncclGroupStart(void) {
    grp.depth++;
    return ncclSuccess;
}

typedef struct {
    ncclComm_t comm;
    labOp *ops;
    int nops;
    int held;
    int threaded;
    ncclResult_t res;
    pthread_t thread;
} groupPart;

static void *groupPartMain(void *arg) {
    groupPart *g = arg;
    g->res = execute(g->comm, g->ops, g->nops);
    return NULL;
}

/* Ops of one comm stay in call order; comms run concurrently (InitAll's ranks). */
static int splitByComm(const labOp *ops, int n, groupPart *parts) {
    int np = 0;
    for (int i = 0; i < n; i++) {
        int j = 0;
        while (j < np && parts[j].comm != ops[i].comm) j++;
        if (j == np) parts[np++].comm = ops[i].comm;
        parts[j].nops++;
    }
    for (int j = 0; j < np; j++) {
        parts[j].ops = malloc(sizeof(labOp) * (size_t)parts[j].nops);
        if (!parts[j].ops) return -1;
        parts[j].nops = 0;
    }
    for (int i = 0; i < n; i++) {
        int j = 0;
        while (parts[j].comm != ops[i].comm) j++;
        parts[j].ops[parts[j].nops++] = ops[i];
    }
    return np;
}

static void startPart(groupPart *g, int alone) {
    g->res = acquire(g->comm, "ncclGroupEnd");
    if (g->res != ncclSuccess) return;
    g->held = 1;
    if (g->ops[0].stream) g->res = launchOnStream(g->comm, g->ops, g->nops);
    else if (g->comm->async) g->res = enqueue(g->comm, g->ops, g->nops);
    else if (alone) g->res = execute(g->comm, g->ops, g->nops);
    else if (pthread_create(&g->thread, NULL, groupPartMain, g) == 0) g->threaded = 1;
    else g->res = labError(g->comm, ncclSystemError, "ncclGroupEnd: cannot start a thread");
}

static ncclResult_t runGroup(const labOp *ops, int n) {
    groupPart *parts = calloc((size_t)n, sizeof *parts);
    int np = parts ? splitByComm(ops, n, parts) : -1;
    ncclResult_t res = np < 0 ? labError(NULL, ncclSystemError, "out of memory") : ncclSuccess;
    for (int j = 0; j < np; j++) startPart(&parts[j], np == 1);
    for (int j = 0; j < np; j++)
        if (parts[j].threaded) pthread_join(parts[j].thread, NULL);
    for (int j = 0; parts && j < n; j++) {
        if (parts[j].held) release(parts[j].comm);
        if (res == ncclSuccess && j < np) res = parts[j].res;
        free(parts[j].ops);
    }
    free(parts);
    return res;
}

NCCL_API ncclResult_t ncclGroupEnd(void) {
    if (grp.depth == 0)
        return labError(NULL, ncclInvalidUsage, "ncclGroupEnd: no matching ncclGroupStart");
    if (--grp.depth > 0) return ncclSuccess;
    labOp *ops = grp.ops;
    int n = grp.n;
    grp.ops = NULL;
    grp.n = grp.cap = 0;
    ncclResult_t res = n ? runGroup(ops, n) : ncclSuccess;
    free(ops);
    return res;
}

/* Internals of the lab's libnccl: nothing here is exported. */
#ifndef LABNCCL_INTERNAL_H
#define LABNCCL_INTERNAL_H

#define LABNCCL_BUILD 1
#include "labnccl.h"

#include <netinet/in.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>

#define LAB_COMM_MAGIC 0x6c61626e63636c31ull /* "labnccl1" */
#define LAB_WIRE_MAGIC 0x4c424e43u           /* "LBNC" */
#define LAB_ERR_LEN 1024

/* What a queued or running operation is; also the op byte on the wire. */
typedef enum {
    OP_ALLREDUCE = 1,
    OP_ALLGATHER,
    OP_REDUCESCATTER,
    OP_BROADCAST,
    OP_REDUCE,
    OP_ALLTOALL,
    OP_GATHER,
    OP_SCATTER,
    OP_SEND,
    OP_RECV,
    OP_SPLIT,
} labOpKind;

/* Every data message starts with this header; the receiver checks it against
 * the call it is making itself. */
typedef struct {
    uint32_t magic;
    uint8_t op;
    uint8_t dtype;
    uint8_t redop;
    uint8_t phase;
    uint64_t seq;
    uint64_t count;
    int32_t root;
    int32_t sender;
    uint64_t nbytes;
} wireHdr;
_Static_assert(sizeof(wireHdr) == 40, "wire header is 40 bytes");

typedef struct {
    labOpKind kind;
    const void *send;
    void *recv;
    size_t count;
    int dtype;
    int redop;
    int root; /* root of a rooted collective, or the peer of send/recv */
    ncclComm_t comm;
    cudaStream_t stream; /* NULL: inline (blocking) or the comm's own thread (async) */
} labOp;

typedef struct labWork {
    struct labWork *next;
    int nops;
    labOp ops[];
} labWork;

struct ncclComm {
    uint64_t magic;
    int rank;
    int nranks;
    int async;
    uint64_t tag; /* identity shared by every member (from the unique id) */
    struct sockaddr_in self;
    struct sockaddr_in *addrs; /* each rank's listen address, for messages */
    int *fds;                  /* socket to each peer; -1 for self */
    uint64_t seq;              /* collective sequence number */
    uint64_t *sendSeq;         /* per-peer p2p sequence numbers */
    uint64_t *recvSeq;
    uint64_t nsplits;
    atomic_int aborting;

    pthread_mutex_t mu;
    pthread_cond_t cv;
    ncclResult_t error; /* sticky: first failure of an executed op */
    char firstError[LAB_ERR_LEN];
    char lastError[LAB_ERR_LEN];
    int active; /* API calls inside this comm right now (guarded by registry lock) */

    int onStreams; /* ops queued on CUDA streams and not yet run (guarded by mu) */
    labWork *captured; /* ops captured into CUDA graphs: run at each launch, freed with the comm */

    /* the background "stream" of async mode */
    pthread_t stream;
    int hasStream;
    int stop;
    int busy;
    labWork *head;
    labWork *tail;
};

/* errors.c: calls no other file of the library */
ncclResult_t labError(ncclComm_t comm, ncclResult_t res, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
const char *labOpName(int kind);
const char *labTypeName(int dtype);
const char *labRedOpName(int redop);
const char *labLastError(void);

/* cuda.c: runs fn(arg) on a stream of the process's CUDA runtime */
ncclResult_t labLaunchHost(ncclComm_t c, cudaStream_t stream, void (*fn)(void *), void *arg,
                           const char *what);
int labStreamCapturing(cudaStream_t stream);

/* comm.c */
ncclResult_t labCreateComm(ncclComm_t *out, int rank, int nranks, uint64_t tag, int listenFd,
                           const struct sockaddr_in *self, const struct sockaddr_in *addrs);

/* net.c */
ncclResult_t labPickAddress(struct sockaddr_in *out);
int labListen(struct sockaddr_in *addr);
ncclResult_t labStartRoot(ncclUniqueId *id, const struct sockaddr_in *addr);
ncclResult_t labBootstrap(const ncclUniqueId *id, int rank, int nranks,
                          const struct sockaddr_in *self, struct sockaddr_in *table);
ncclResult_t labMesh(ncclComm_t comm, int listenFd);
uint64_t labMix(uint64_t x);
const char *labFmtAddr(const struct sockaddr_in *a, char *buf, size_t len);

/* reduce.c */
size_t labTypeSize(int dtype);
void labReduce(int dtype, int redop, void *dst, const void *const *srcs, int nsrc, size_t count,
               int navg);

/* xfer.c: a set of messages to and from peers, progressed together */
typedef struct {
    wireHdr hdr; /* to send, or expected */
    const void *sbuf;
    void *rbuf;
    size_t len;
} xmsg;

typedef struct {
    xmsg *m;
    int n;
    int cap;
    int cur;
    size_t off;
    int draining;
    uint64_t left;
    wireHdr in;
} xqueue;

typedef struct {
    int nranks;
    xqueue *send;
    xqueue *recv;
    ncclResult_t mismatch;
} xfer;

int xferInit(xfer *x, int nranks);
void xferFree(xfer *x);
int xferSend(xfer *x, int peer, const wireHdr *h, const void *buf, size_t len);
int xferRecv(xfer *x, int peer, const wireHdr *expect, void *buf, size_t len);
ncclResult_t xferRun(ncclComm_t comm, xfer *x);

/* coll.c */
ncclResult_t labRunOps(ncclComm_t comm, const labOp *ops, int nops);
ncclResult_t labSplitExchange(ncclComm_t comm, const int32_t mine[2], int32_t *all,
                              struct sockaddr_in *addrs, const struct sockaddr_in *self);

#endif

/* The collectives over the full mesh.  Reductions split the buffer into one
 * chunk per rank: every rank sends chunk j to rank j, which reduces it (inputs
 * in rank order) and sends the result back to all: 2(n-1)/n of the buffer
 * on the wire per rank, like a ring, in two steps. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

typedef struct {
    ncclComm_t c;
    const labOp *op;
    size_t es;
    wireHdr h;
    xfer x;
} step;

static ncclResult_t oom(ncclComm_t c) { return labError(c, ncclSystemError, "out of memory"); }

static int isRooted(int kind) {
    return kind == OP_BROADCAST || kind == OP_REDUCE || kind == OP_GATHER || kind == OP_SCATTER;
}

static int isReducing(int kind) {
    return kind == OP_ALLREDUCE || kind == OP_REDUCE || kind == OP_REDUCESCATTER;
}

static ncclResult_t stepBegin(step *s, ncclComm_t c, const labOp *op, uint64_t seq, int phase) {
    s->c = c;
    s->op = op;
    s->es = labTypeSize(op->dtype);
    s->h = (wireHdr){LAB_WIRE_MAGIC,
                     (uint8_t)op->kind,
                     (uint8_t)op->dtype,
                     (uint8_t)(isReducing(op->kind) ? op->redop : 0),
                     (uint8_t)phase,
                     seq,
                     op->count,
                     isRooted(op->kind) ? op->root : -1,
                     c->rank,
                     0};
    return xferInit(&s->x, c->nranks) == 0 ? ncclSuccess : oom(c);
}

static ncclResult_t stepQueue(step *s, int peer, const void *sbuf, size_t sn, void *rbuf, size_t rn) {
    if (sbuf && xferSend(&s->x, peer, &s->h, sbuf, sn * s->es) != 0) return oom(s->c);
    if (rbuf && xferRecv(&s->x, peer, &s->h, rbuf, rn * s->es) != 0) return oom(s->c);
    return ncclSuccess;
}

static ncclResult_t stepRun(step *s, ncclResult_t res) {
    if (res == ncclSuccess) res = xferRun(s->c, &s->x);
    xferFree(&s->x);
    return res;
}

/* Every rank sends its part p of `send` to rank p and reduces its own part
 * from all ranks into dst. */
static ncclResult_t reduceToOwners(ncclComm_t c, const labOp *op, uint64_t seq, const size_t *offs,
                                   const size_t *cnts, void *dst) {
    int n = c->nranks, me = c->rank;
    step s;
    ncclResult_t res = stepBegin(&s, c, op, seq, 0);
    size_t mine = cnts[me] * s.es;
    char *scratch = malloc(mine * (size_t)(n - 1) + 1);
    const void **srcs = malloc(sizeof *srcs * (size_t)n);
    if (!scratch || !srcs) res = oom(c);
    const char *send = op->send;
    for (int p = 0; p < n && res == ncclSuccess; p++) {
        srcs[p] = p == me ? send + offs[me] * s.es : scratch + (size_t)(p < me ? p : p - 1) * mine;
        if (p != me) res = stepQueue(&s, p, send + offs[p] * s.es, cnts[p], (void *)srcs[p], cnts[me]);
    }
    res = stepRun(&s, res);
    if (res == ncclSuccess) labReduce(op->dtype, op->redop, dst, srcs, n, cnts[me], n);
    free(scratch);
    free(srcs);
    return res;
}

static void chunks(size_t count, int n, size_t *offs, size_t *cnts) {
    size_t base = count / (size_t)n, rem = count % (size_t)n;
    for (int j = 0; j < n; j++) {
        offs[j] = (size_t)j * base + ((size_t)j < rem ? (size_t)j : rem);
        cnts[j] = base + ((size_t)j < rem ? 1 : 0);
    }
}

static ncclResult_t allReduce(ncclComm_t c, const labOp *op, uint64_t seq) {
    int n = c->nranks, me = c->rank;
    size_t *offs = malloc(sizeof *offs * (size_t)n), *cnts = malloc(sizeof *cnts * (size_t)n);
    if (!offs || !cnts) {
        free(offs);
        free(cnts);
        return oom(c);
    }
    chunks(op->count, n, offs, cnts);
    size_t es = labTypeSize(op->dtype);
    char *recv = op->recv;
    ncclResult_t res = reduceToOwners(c, op, seq, offs, cnts, recv + offs[me] * es);
    step s;
    if (res == ncclSuccess) {
        res = stepBegin(&s, c, op, seq, 1);
        for (int p = 0; p < n && res == ncclSuccess; p++)
            if (p != me) res = stepQueue(&s, p, recv + offs[me] * es, cnts[me], recv + offs[p] * es, cnts[p]);
        res = stepRun(&s, res);
    }
    free(offs);
    free(cnts);
    return res;
}

static ncclResult_t reduceScatter(ncclComm_t c, const labOp *op, uint64_t seq) {
    int n = c->nranks;
    size_t *offs = malloc(sizeof *offs * (size_t)n), *cnts = malloc(sizeof *cnts * (size_t)n);
    ncclResult_t res = offs && cnts ? ncclSuccess : oom(c);
    for (int p = 0; p < n && res == ncclSuccess; p++) {
        offs[p] = (size_t)p * op->count;
        cnts[p] = op->count;
    }
    if (res == ncclSuccess) res = reduceToOwners(c, op, seq, offs, cnts, op->recv);
    free(offs);
    free(cnts);
    return res;
}

static ncclResult_t reduceRoot(ncclComm_t c, const labOp *op, uint64_t seq) {
    int n = c->nranks, me = c->rank;
    step s;
    ncclResult_t res = stepBegin(&s, c, op, seq, 0);
    if (me != op->root) return stepRun(&s, res == ncclSuccess ? stepQueue(&s, op->root, op->send, op->count, NULL, 0) : res);
    size_t bytes = op->count * s.es;
    char *scratch = malloc(bytes * (size_t)(n - 1) + 1);
    const void **srcs = malloc(sizeof *srcs * (size_t)n);
    if (!scratch || !srcs) res = oom(c);
    for (int p = 0; p < n && res == ncclSuccess; p++) {
        srcs[p] = p == me ? op->send : scratch + (size_t)(p < me ? p : p - 1) * bytes;
        if (p != me) res = stepQueue(&s, p, NULL, 0, (void *)srcs[p], op->count);
    }
    res = stepRun(&s, res);
    if (res == ncclSuccess) labReduce(op->dtype, op->redop, op->recv, srcs, n, op->count, n);
    free(scratch);
    free(srcs);
    return res;
}

/* AllGather, AlltoAll, Broadcast, Gather, Scatter: data moves, nothing is reduced.
 * A rank's part p of the send buffer goes to rank p (or the whole buffer, for
 * ops that send the same data to all); received data lands in part p. */
static ncclResult_t moveData(ncclComm_t c, const labOp *op, uint64_t seq) {
    int n = c->nranks, me = c->rank, k = op->kind, root = op->root;
    step s;
    ncclResult_t res = stepBegin(&s, c, op, seq, 0);
    size_t part = op->count * s.es;
    const char *send = op->send;
    char *recv = op->recv;
    int sendsParts = k == OP_ALLTOALL || k == OP_SCATTER;
    int recvsParts = k == OP_ALLTOALL || k == OP_GATHER || k == OP_ALLGATHER;
    for (int p = 0; p < n && res == ncclSuccess; p++) {
        if (p == me) continue;
        int sends = k == OP_ALLGATHER || k == OP_ALLTOALL || (k == OP_GATHER && p == root) ||
                    ((k == OP_BROADCAST || k == OP_SCATTER) && me == root);
        int recvs = k == OP_ALLGATHER || k == OP_ALLTOALL || (k == OP_GATHER && me == root) ||
                    ((k == OP_BROADCAST || k == OP_SCATTER) && p == root);
        const char *sb = sends ? send + (sendsParts ? (size_t)p * part : 0) : NULL;
        char *rb = recvs ? recv + (recvsParts ? (size_t)p * part : 0) : NULL;
        res = stepQueue(&s, p, sb, op->count, rb, op->count);
    }
    res = stepRun(&s, res);
    int keeps = k == OP_ALLGATHER || k == OP_ALLTOALL || me == root;
    if (res == ncclSuccess && keeps && part) {
        const char *from = send + (sendsParts ? (size_t)me * part : 0);
        char *to = recv + (recvsParts ? (size_t)me * part : 0);
        if (from != to) memmove(to, from, part);
    }
    return res;
}

static ncclResult_t runCollective(ncclComm_t c, const labOp *op) {
    uint64_t seq = c->seq++;
    switch (op->kind) {
    case OP_ALLREDUCE: return allReduce(c, op, seq);
    case OP_REDUCESCATTER: return reduceScatter(c, op, seq);
    case OP_REDUCE: return reduceRoot(c, op, seq);
    default: return moveData(c, op, seq);
    }
}

typedef struct {
    const labOp *op;
    int used;
} selfMsg;

/* Sends and receives to oneself pair up in call order. */
static ncclResult_t selfP2p(ncclComm_t c, const labOp *ops, int nops) {
    int si = 0;
    for (int i = 0; i < nops; i++) {
        const labOp *r = &ops[i];
        if (r->kind != OP_RECV || r->root != c->rank) continue;
        while (si < nops && !(ops[si].kind == OP_SEND && ops[si].root == c->rank)) si++;
        if (si == nops || ops[si].count != r->count || ops[si].dtype != r->dtype)
            return labError(c, ncclInvalidUsage,
                            "rank %d: ncclRecv from itself (count=%zu datatype=%s) has no matching ncclSend",
                            c->rank, r->count, labTypeName(r->dtype));
        memmove(r->recv, ops[si].send, r->count * labTypeSize(r->dtype));
        si++;
    }
    return ncclSuccess;
}

static ncclResult_t runP2p(ncclComm_t c, const labOp *ops, int nops) {
    xfer x;
    if (xferInit(&x, c->nranks) != 0) return oom(c);
    ncclResult_t res = ncclSuccess;
    for (int i = 0; i < nops && res == ncclSuccess; i++) {
        const labOp *op = &ops[i];
        int peer = op->root;
        if ((op->kind != OP_SEND && op->kind != OP_RECV) || peer == c->rank) continue;
        int sending = op->kind == OP_SEND;
        uint64_t seq = sending ? c->sendSeq[peer]++ : c->recvSeq[peer]++;
        wireHdr h = {LAB_WIRE_MAGIC, OP_SEND, (uint8_t)op->dtype, 0, 0, seq, op->count,
                     sending ? peer : c->rank, c->rank, 0};
        size_t bytes = op->count * labTypeSize(op->dtype);
        int rc = sending ? xferSend(&x, peer, &h, op->send, bytes) : xferRecv(&x, peer, &h, op->recv, bytes);
        if (rc != 0) res = oom(c);
    }
    if (res == ncclSuccess) res = xferRun(c, &x);
    xferFree(&x);
    return res == ncclSuccess ? selfP2p(c, ops, nops) : res;
}

ncclResult_t labRunOps(ncclComm_t c, const labOp *ops, int nops) {
    int p2p = 0;
    for (int i = 0; i < nops; i++) {
        if (ops[i].kind == OP_SEND || ops[i].kind == OP_RECV) {
            p2p = 1;
            continue;
        }
        ncclResult_t res = runCollective(c, &ops[i]);
        if (res != ncclSuccess) return res;
    }
    return p2p ? runP2p(c, ops, nops) : ncclSuccess;
}

typedef struct {
    int32_t color;
    int32_t key;
    struct sockaddr_in addr;
} splitEntry;

ncclResult_t labSplitExchange(ncclComm_t c, const int32_t mine[2], int32_t *all,
                              struct sockaddr_in *addrs, const struct sockaddr_in *self) {
    int n = c->nranks;
    splitEntry *e = calloc((size_t)n, sizeof *e);
    if (!e) return oom(c);
    e[c->rank] = (splitEntry){mine[0], mine[1], *self};
    labOp op = {OP_SPLIT, NULL, NULL, 1, ncclUint8, 0, -1, c, NULL};
    step s;
    ncclResult_t res = stepBegin(&s, c, &op, c->seq++, 0);
    s.es = sizeof *e;
    for (int p = 0; p < n && res == ncclSuccess; p++)
        if (p != c->rank) res = stepQueue(&s, p, &e[c->rank], 1, &e[p], 1);
    res = stepRun(&s, res);
    for (int p = 0; p < n && res == ncclSuccess; p++) {
        all[2 * p] = e[p].color;
        all[2 * p + 1] = e[p].key;
        addrs[p] = e[p].addr;
    }
    free(e);
    return res;
}

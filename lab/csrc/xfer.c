/* The progress engine: every message a step needs, to and from every peer,
 * moved together with poll() on non-blocking sockets, so that no order of
 * sends and receives can deadlock.  A received header that disagrees with the
 * receiver's own call is reported (ncclInvalidUsage) and its payload drained
 * by the sender's declared length, so both sides finish the step with an
 * error instead of hanging or writing past a buffer. */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include "internal.h"
#include "labwait.h"

#define HS sizeof(wireHdr)
#define POLL_MS 200

int xferInit(xfer *x, int nranks) {
    x->nranks = nranks;
    x->mismatch = ncclSuccess;
    x->send = calloc((size_t)nranks, sizeof *x->send);
    x->recv = calloc((size_t)nranks, sizeof *x->recv);
    return x->send && x->recv ? 0 : -1;
}

void xferFree(xfer *x) {
    for (int p = 0; p < x->nranks; p++) {
        if (x->send) free(x->send[p].m);
        if (x->recv) free(x->recv[p].m);
    }
    free(x->send);
    free(x->recv);
    x->send = x->recv = NULL;
}

static int qpush(xqueue *q, const wireHdr *h, const void *sbuf, void *rbuf, size_t len) {
    if (q->n == q->cap) {
        int cap = q->cap ? q->cap * 2 : 4;
        xmsg *m = realloc(q->m, sizeof *m * (size_t)cap);
        if (!m) return -1;
        q->m = m;
        q->cap = cap;
    }
    q->m[q->n++] = (xmsg){*h, sbuf, rbuf, len};
    return 0;
}

int xferSend(xfer *x, int peer, const wireHdr *h, const void *buf, size_t len) {
    wireHdr hdr = *h;
    hdr.nbytes = len;
    return qpush(&x->send[peer], &hdr, buf, NULL, len);
}

int xferRecv(xfer *x, int peer, const wireHdr *expect, void *buf, size_t len) {
    wireHdr hdr = *expect;
    hdr.nbytes = len;
    return qpush(&x->recv[peer], &hdr, NULL, buf, len);
}

/* A p2p receiver expects the sender's header (op ncclSend, root = receiver). */
static int describe(char *buf, size_t len, const wireHdr *h, int rank, int receiving) {
    int p2p = h->op == OP_SEND;
    const char *name = p2p && receiving ? "ncclRecv" : labOpName(h->op);
    return snprintf(buf, len, "rank %d called %s #%llu count=%llu datatype=%s%s%s %s=%d", rank, name,
                    (unsigned long long)h->seq, (unsigned long long)h->count, labTypeName(h->dtype),
                    p2p ? "" : " op=", p2p ? "" : labRedOpName(h->redop), p2p ? "to" : "root",
                    h->root);
}

/* As real NCCL's socket transport: every failure of a peer's socket during a
 * transfer is ncclRemoteError (a closed or reset connection, and any other
 * errno, e.g. ECONNABORTED when the kernel aborted the socket); the message
 * says which. */
static ncclResult_t connError(ncclComm_t comm, int peer, const wireHdr *h, int err) {
    char where[64];
    labFmtAddr(&comm->addrs[peer], where, sizeof where);
    const char *op = labOpName(h->op);
    unsigned long long seq = (unsigned long long)h->seq;
    if (atomic_load(&comm->aborting))
        return labError(comm, ncclSystemError, "rank %d: communicator aborted during %s #%llu",
                        comm->rank, op, seq);
    if (err == 0 || err == EPIPE)
        return labError(comm, ncclRemoteError,
                        "rank %d: peer rank %d (%s) closed the connection during %s #%llu "
                        "(did it exit?)",
                        comm->rank, peer, where, op, seq);
    if (err == ECONNRESET)
        return labError(comm, ncclRemoteError,
                        "rank %d: peer rank %d (%s) reset the connection during %s #%llu",
                        comm->rank, peer, where, op, seq);
    return labError(comm, ncclRemoteError, "rank %d: socket to peer rank %d (%s) during %s #%llu: %s",
                    comm->rank, peer, where, op, seq, strerror(err));
}

static ncclResult_t checkHeader(ncclComm_t comm, xfer *x, int peer, xqueue *q, const xmsg *m) {
    const wireHdr *in = &q->in, *ex = &m->hdr;
    if (in->magic != LAB_WIRE_MAGIC)
        return labError(comm, ncclRemoteError, "rank %d: garbage from peer rank %d (bad magic)",
                        comm->rank, peer);
    int same = in->op == ex->op && in->dtype == ex->dtype && in->redop == ex->redop &&
               in->phase == ex->phase && in->seq == ex->seq && in->count == ex->count &&
               in->root == ex->root && in->nbytes == ex->nbytes;
    if (same) return ncclSuccess;
    if (x->mismatch == ncclSuccess) {
        char mine[256], theirs[256];
        describe(mine, sizeof mine, ex, comm->rank, 1);
        describe(theirs, sizeof theirs, in, peer, 0);
        x->mismatch = labError(comm, ncclInvalidUsage, "mismatched calls across ranks: %s, but peer %s",
                               mine, theirs);
    }
    q->draining = 1;
    q->left = in->nbytes;
    return ncclSuccess;
}

static ncclResult_t doRecv(ncclComm_t comm, xfer *x, int peer) {
    char drain[16384];
    xqueue *q = &x->recv[peer];
    while (q->cur < q->n) {
        xmsg *m = &q->m[q->cur];
        size_t body = q->off > HS ? q->off - HS : 0;
        if (q->off >= HS && (q->draining ? q->left == 0 : body == m->len)) {
            q->cur++;
            q->off = 0;
            q->draining = 0;
            continue;
        }
        void *dst;
        size_t want;
        if (q->off < HS) {
            dst = (char *)&q->in + q->off;
            want = HS - q->off;
        } else if (q->draining) {
            dst = drain;
            want = q->left < sizeof drain ? q->left : sizeof drain;
        } else {
            dst = (char *)m->rbuf + body;
            want = m->len - body;
        }
        ssize_t n = recv(comm->fds[peer], dst, want, MSG_DONTWAIT);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return ncclSuccess;
        if (n <= 0) return connError(comm, peer, &m->hdr, n == 0 ? 0 : errno);
        size_t before = q->off;
        q->off += (size_t)n;
        if (q->draining) q->left -= (uint64_t)n;
        if (before < HS && q->off == HS) {
            ncclResult_t res = checkHeader(comm, x, peer, q, m);
            if (res != ncclSuccess) return res;
        }
    }
    return ncclSuccess;
}

static ncclResult_t doSend(ncclComm_t comm, xfer *x, int peer) {
    xqueue *q = &x->send[peer];
    while (q->cur < q->n) {
        xmsg *m = &q->m[q->cur];
        if (q->off == HS + m->len) {
            q->cur++;
            q->off = 0;
            continue;
        }
        struct iovec iov[2];
        int niov = 0;
        if (q->off < HS) {
            iov[niov++] = (struct iovec){(char *)&m->hdr + q->off, HS - q->off};
            if (m->len) iov[niov++] = (struct iovec){(void *)m->sbuf, m->len};
        } else {
            size_t body = q->off - HS;
            iov[niov++] = (struct iovec){(char *)m->sbuf + body, m->len - body};
        }
        struct msghdr msg = {.msg_iov = iov, .msg_iovlen = (size_t)niov};
        ssize_t n = sendmsg(comm->fds[peer], &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return ncclSuccess;
        if (n < 0) return connError(comm, peer, &m->hdr, errno);
        q->off += (size_t)n;
    }
    return ncclSuccess;
}

static int pending(const xqueue *q) { return q->cur < q->n; }

ncclResult_t xferRun(ncclComm_t comm, xfer *x) {
    int n = x->nranks;
    struct pollfd *pfd = calloc((size_t)n, sizeof *pfd);
    int *peer = calloc((size_t)n, sizeof *peer);
    ncclResult_t res = ncclSuccess;
    if (!pfd || !peer) res = labError(comm, ncclSystemError, "out of memory");
    while (res == ncclSuccess) {
        int np = 0;
        for (int p = 0; p < n; p++) {
            short ev = (short)((pending(&x->send[p]) ? POLLOUT : 0) | (pending(&x->recv[p]) ? POLLIN : 0));
            if (ev) {
                pfd[np] = (struct pollfd){comm->fds[p], ev, 0};
                peer[np++] = p;
            }
        }
        if (np == 0) break;
        if (atomic_load(&comm->aborting)) {
            res = labError(comm, ncclSystemError, "rank %d: communicator aborted", comm->rank);
            break;
        }
        int spin = labSpinWait();
        int rc = poll(pfd, (nfds_t)np, spin ? 0 : POLL_MS);
        if (rc < 0 && errno != EINTR) res = labError(comm, ncclSystemError, "poll: %s", strerror(errno));
        if (rc == 0 && spin) sched_yield(); /* busy polling, as NCCL's proxy does */
        for (int i = 0; rc > 0 && i < np && res == ncclSuccess; i++) {
            short re = pfd[i].revents;
            if ((re & (POLLIN | POLLHUP | POLLERR)) && pending(&x->recv[peer[i]]))
                res = doRecv(comm, x, peer[i]);
            if (res == ncclSuccess && (re & (POLLOUT | POLLHUP | POLLERR)) && pending(&x->send[peer[i]]))
                res = doSend(comm, x, peer[i]);
        }
    }
    free(pfd);
    free(peer);
    return res != ncclSuccess ? res : x->mismatch;
}

/* Sockets: the node's address, the bootstrap root that ncclGetUniqueId starts,
 * the rendezvous of ranks through it, and the full mesh of TCP connections. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#define ID_MAGIC_BYTES 8
#define ID_ADDR_OFFSET 8
#define CONNECT_TIMEOUT_MS_DEFAULT 60000

typedef struct {
    uint64_t magic;
    int32_t rank;
    int32_t nranks;
    struct sockaddr_in addr;
} rootHello;

typedef struct {
    int32_t status; /* 0 ok, else an ncclResult_t */
    int32_t nranks;
} rootReply;

typedef struct {
    uint64_t tag;
    int32_t rank;
    int32_t nranks;
} meshHello;

const char *labFmtAddr(const struct sockaddr_in *a, char *buf, size_t len) {
    char ip[INET_ADDRSTRLEN] = "?";
    inet_ntop(AF_INET, &a->sin_addr, ip, sizeof ip);
    snprintf(buf, len, "%s:%u", ip, ntohs(a->sin_port));
    return buf;
}

uint64_t labMix(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* NCCL_SOCKET_IFNAME: comma-separated prefixes, "^" to exclude, "=" for exact names. */
static int ifnameMatches(const char *spec, const char *name) {
    int exclude = spec[0] == '^';
    if (exclude) spec++;
    int exact = spec[0] == '=';
    if (exact) spec++;
    int hit = 0;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", spec);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        if (exact ? strcmp(tok, name) == 0 : strncmp(tok, name, strlen(tok)) == 0) hit = 1;
    }
    return exclude ? !hit : hit;
}

ncclResult_t labPickAddress(struct sockaddr_in *out) {
    const char *spec = getenv("NCCL_SOCKET_IFNAME");
    if (spec && !*spec) spec = NULL;
    memset(out, 0, sizeof *out);
    out->sin_family = AF_INET;
    out->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    struct ifaddrs *ifs = NULL;
    if (getifaddrs(&ifs) != 0)
        return labError(NULL, ncclSystemError, "getifaddrs: %s", strerror(errno));
    int found = 0;
    for (struct ifaddrs *i = ifs; i && !found; i = i->ifa_next) {
        if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET || !(i->ifa_flags & IFF_UP)) continue;
        if (spec ? !ifnameMatches(spec, i->ifa_name) : (i->ifa_flags & IFF_LOOPBACK) != 0) continue;
        out->sin_addr = ((struct sockaddr_in *)i->ifa_addr)->sin_addr;
        found = 1;
    }
    freeifaddrs(ifs);
    if (!found && spec)
        return labError(NULL, ncclInvalidArgument,
                        "NCCL_SOCKET_IFNAME=%s matches no UP interface with an IPv4 address", spec);
    return ncclSuccess;
}

int labListen(struct sockaddr_in *addr) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    addr->sin_port = 0;
    socklen_t len = sizeof *addr;
    if (bind(fd, (struct sockaddr *)addr, sizeof *addr) != 0 || listen(fd, 1024) != 0 ||
        getsockname(fd, (struct sockaddr *)addr, &len) != 0) {
        int saved = errno;
        close(fd);
        errno = saved;
        return -1;
    }
    return fd;
}

static int ioFull(int fd, void *buf, size_t len, int writing) {
    char *p = buf;
    while (len) {
        ssize_t n = writing ? send(fd, p, len, MSG_NOSIGNAL) : recv(fd, p, len, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            if (n == 0) errno = ECONNRESET;
            return -1;
        }
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

static int readFull(int fd, void *buf, size_t len) { return ioFull(fd, buf, len, 0); }
static int writeFull(int fd, const void *buf, size_t len) { return ioFull(fd, (void *)buf, len, 1); }

static long nowMs(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000L + ts.tv_nsec / 1000000L;
}

/* Connects, retrying while the listener is not there yet. */
static int connectRetry(const struct sockaddr_in *addr) {
    const char *env = getenv("LABNCCL_CONNECT_TIMEOUT_MS");
    long deadline = nowMs() + (env ? atol(env) : CONNECT_TIMEOUT_MS_DEFAULT);
    for (;;) {
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) return -1;
        if (connect(fd, (const struct sockaddr *)addr, sizeof *addr) == 0) {
            int one = 1;
            setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
            return fd;
        }
        int saved = errno;
        close(fd);
        if ((saved != ECONNREFUSED && saved != EINTR && saved != ETIMEDOUT) || nowMs() > deadline) {
            errno = saved;
            return -1;
        }
        usleep(20000);
    }
}

/* ---- the bootstrap root: a thread serving one unique id ---- */

typedef struct {
    int fd;
    uint64_t magic;
} rootArgs;

static void rootReplyAll(int *conns, struct sockaddr_in *table, int nranks) {
    rootReply r = {0, nranks};
    for (int i = 0; i < nranks; i++) {
        if (writeFull(conns[i], &r, sizeof r) == 0)
            writeFull(conns[i], table, sizeof *table * (size_t)nranks);
        close(conns[i]);
    }
}

static void rootRefuse(int fd, ncclResult_t status) {
    rootReply r = {(int32_t)status, 0};
    writeFull(fd, &r, sizeof r);
    close(fd);
}

static void *rootMain(void *arg) {
    rootArgs a = *(rootArgs *)arg;
    free(arg);
    pthread_setname_np(pthread_self(), "labnccl-root");
    int nranks = 0, seen = 0, *conns = NULL;
    struct sockaddr_in *table = NULL;
    while (nranks == 0 || seen < nranks) {
        int fd = accept4(a.fd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED) continue;
            break;
        }
        struct timeval tv = {10, 0}; /* a stray connection must not wedge the root */
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        rootHello h;
        if (readFull(fd, &h, sizeof h) != 0 || h.magic != a.magic) {
            close(fd);
            continue;
        }
        if (nranks == 0 && h.nranks > 0 && h.nranks <= 1 << 16) {
            nranks = h.nranks;
            conns = malloc(sizeof *conns * (size_t)nranks);
            table = calloc((size_t)nranks, sizeof *table);
            if (!conns || !table) break;
            for (int i = 0; i < nranks; i++) conns[i] = -1;
        }
        if (h.nranks != nranks || h.rank < 0 || h.rank >= nranks || conns[h.rank] >= 0) {
            rootRefuse(fd, ncclInvalidUsage);
            continue;
        }
        conns[h.rank] = fd;
        table[h.rank] = h.addr;
        seen++;
    }
    if (nranks && seen == nranks) rootReplyAll(conns, table, nranks);
    else
        for (int i = 0; conns && i < nranks; i++)
            if (conns[i] >= 0) close(conns[i]);
    free(conns);
    free(table);
    close(a.fd);
    return NULL;
}

ncclResult_t labStartRoot(ncclUniqueId *id, const struct sockaddr_in *addr) {
    struct sockaddr_in listenAddr = *addr;
    int fd = labListen(&listenAddr);
    if (fd < 0) {
        char where[64];
        return labError(NULL, ncclSystemError, "bootstrap root: cannot listen on %s: %s",
                        labFmtAddr(addr, where, sizeof where), strerror(errno));
    }
    memset(id, 0, sizeof *id);
    uint64_t magic = 0;
    while (magic == 0)
        if (getrandom(&magic, sizeof magic, 0) != sizeof magic) magic = labMix((uint64_t)nowMs());
    memcpy(id->internal, &magic, ID_MAGIC_BYTES);
    memcpy(id->internal + ID_ADDR_OFFSET, &listenAddr, sizeof listenAddr);
    rootArgs *a = malloc(sizeof *a);
    if (a) *a = (rootArgs){fd, magic};
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int rc = a ? pthread_create(&t, &attr, rootMain, a) : ENOMEM;
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        free(a);
        close(fd);
        return labError(NULL, ncclSystemError, "bootstrap root: cannot start thread: %s", strerror(rc));
    }
    return ncclSuccess;
}

ncclResult_t labBootstrap(const ncclUniqueId *id, int rank, int nranks,
                          const struct sockaddr_in *self, struct sockaddr_in *table) {
    struct sockaddr_in root;
    memcpy(&root, id->internal + ID_ADDR_OFFSET, sizeof root);
    rootHello h = {0, rank, nranks, *self};
    memcpy(&h.magic, id->internal, ID_MAGIC_BYTES);
    char where[64];
    labFmtAddr(&root, where, sizeof where);
    int fd = connectRetry(&root);
    if (fd < 0)
        return labError(NULL, ncclSystemError, "rank %d: cannot reach bootstrap root %s: %s", rank,
                        where, strerror(errno));
    rootReply r;
    if (writeFull(fd, &h, sizeof h) != 0 || readFull(fd, &r, sizeof r) != 0) {
        close(fd);
        return labError(NULL, ncclRemoteError, "rank %d: bootstrap root %s closed the connection",
                        rank, where);
    }
    if (r.status != 0 || r.nranks != nranks) {
        close(fd);
        return labError(NULL, ncclInvalidUsage,
                        "rank %d: bootstrap root %s refused rank %d of %d (duplicate rank or "
                        "another rank passed a different nranks)",
                        rank, where, rank, nranks);
    }
    int bad = readFull(fd, table, sizeof *table * (size_t)nranks);
    close(fd);
    if (bad)
        return labError(NULL, ncclRemoteError, "rank %d: bootstrap root %s closed early", rank, where);
    return ncclSuccess;
}

/* ---- the mesh: rank i connects to every j > i and accepts every j < i ---- */

static ncclResult_t meshAccept(ncclComm_t comm, int listenFd, int expected) {
    while (expected > 0) {
        int fd = accept4(listenFd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED) continue;
            return labError(comm, ncclSystemError, "rank %d: accept: %s", comm->rank, strerror(errno));
        }
        struct timeval tv = {30, 0};
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        meshHello h;
        if (readFull(fd, &h, sizeof h) != 0 || h.tag != comm->tag || h.nranks != comm->nranks ||
            h.rank < 0 || h.rank >= comm->rank || comm->fds[h.rank] >= 0) {
            close(fd);
            continue;
        }
        struct timeval none = {0, 0};
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &none, sizeof none);
        comm->fds[h.rank] = fd;
        expected--;
    }
    return ncclSuccess;
}

ncclResult_t labMesh(ncclComm_t comm, int listenFd) {
    for (int j = comm->rank + 1; j < comm->nranks; j++) {
        int fd = connectRetry(&comm->addrs[j]);
        meshHello h = {comm->tag, comm->rank, comm->nranks};
        if (fd < 0 || writeFull(fd, &h, sizeof h) != 0) {
            int saved = errno;
            if (fd >= 0) close(fd);
            char where[64];
            return labError(comm, ncclRemoteError, "rank %d: cannot connect to rank %d at %s: %s",
                            comm->rank, j, labFmtAddr(&comm->addrs[j], where, sizeof where),
                            strerror(saved));
        }
        comm->fds[j] = fd;
    }
    ncclResult_t res = meshAccept(comm, listenFd, comm->rank);
    if (res != ncclSuccess) return res;
    for (int j = 0; j < comm->nranks; j++) {
        if (comm->fds[j] < 0) continue;
        int one = 1;
        setsockopt(comm->fds[j], IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        fcntl(comm->fds[j], F_SETFL, fcntl(comm->fds[j], F_GETFL) | O_NONBLOCK);
    }
    return ncclSuccess;
}

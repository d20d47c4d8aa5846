/* Error reporting and the names used in messages: the one unit that every
 * other file of the library calls into, and that calls none of them. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "internal.h"

static const char *const OP_NAMES[] = {
    "?",          "ncclAllReduce", "ncclAllGather", "ncclReduceScatter", "ncclBroadcast", "ncclReduce",
    "ncclAlltoAll", "ncclGather",  "ncclScatter",   "ncclSend",          "ncclRecv",      "ncclCommSplit"};
static const char *const TYPE_NAMES[] = {"int8",    "uint8",   "int32",   "uint32", "int64",
                                         "uint64",  "float16", "float32", "float64", "bfloat16"};
static const char *const REDOP_NAMES[] = {"sum", "prod", "max", "min", "avg"};

const char *labOpName(int kind) {
    return kind > 0 && kind <= OP_SPLIT ? OP_NAMES[kind] : "?";
}
const char *labTypeName(int dtype) {
    return dtype >= 0 && dtype < ncclNumTypes ? TYPE_NAMES[dtype] : "?";
}
const char *labRedOpName(int redop) {
    return redop >= 0 && redop < ncclNumOps ? REDOP_NAMES[redop] : "?";
}

static pthread_mutex_t gErrLock = PTHREAD_MUTEX_INITIALIZER;
static char gLastError[LAB_ERR_LEN];

ncclResult_t labError(ncclComm_t comm, ncclResult_t res, const char *fmt, ...) {
    char msg[LAB_ERR_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (comm) {
        pthread_mutex_lock(&comm->mu);
        memcpy(comm->lastError, msg, sizeof msg);
        pthread_mutex_unlock(&comm->mu);
    }
    pthread_mutex_lock(&gErrLock);
    memcpy(gLastError, msg, sizeof msg);
    pthread_mutex_unlock(&gErrLock);
    const char *debug = getenv("NCCL_DEBUG");
    if (debug && *debug && strcasecmp(debug, "VERSION") != 0)
        fprintf(stderr, "%d:%ld [%d] NCCL WARN %s\n", getpid(), (long)syscall(SYS_gettid),
                comm ? comm->rank : -1, msg);
    return res;
}

/* The text of the last error of any communicator (ncclGetLastError(NULL)). */
const char *labLastError(void) { return gLastError; }

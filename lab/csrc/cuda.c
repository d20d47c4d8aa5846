/* The CUDA runtime as the library sees it: collectives given a stream run on
 * that stream, as host functions of the runtime the process loaded (the lab's
 * libcudart.so.12, found by its soname, or the one beside this library).
 * Calls only errors.c. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>

#include "internal.h"
#include "labcudart.h"

#define CUDART_SONAME "libcudart.so.12"

typedef cudaError_t (*launchFn)(cudaStream_t, cudaHostFn_t, void *);
typedef const char *(*errorStringFn)(cudaError_t);
typedef cudaError_t (*captureInfoFn)(cudaStream_t, enum cudaStreamCaptureStatus *, unsigned long long *,
                                     cudaGraph_t *, const cudaGraphNode_t **, size_t *);

static pthread_once_t gOnce = PTHREAD_ONCE_INIT;
static launchFn gLaunch;
static errorStringFn gErrorString;
static captureInfoFn gCaptureInfo; /* optional: a runtime without graphs never captures */
static char gWhy[256];

static void load(void) {
    void *rt = dlopen(CUDART_SONAME, RTLD_NOW);
    if (!rt) {
        snprintf(gWhy, sizeof gWhy, "cannot load %s: %s", CUDART_SONAME, dlerror());
        return;
    }
    gLaunch = (launchFn)dlsym(rt, "cudaLaunchHostFunc");
    gErrorString = (errorStringFn)dlsym(rt, "cudaGetErrorString");
    gCaptureInfo = (captureInfoFn)dlsym(rt, "cudaStreamGetCaptureInfo");
    if (!gLaunch || !gErrorString)
        snprintf(gWhy, sizeof gWhy, "%s has no cudaLaunchHostFunc or cudaGetErrorString", CUDART_SONAME);
}

ncclResult_t labLaunchHost(ncclComm_t c, cudaStream_t stream, void (*fn)(void *), void *arg,
                           const char *what) {
    pthread_once(&gOnce, load);
    if (!gLaunch || !gErrorString)
        return labError(c, ncclUnhandledCudaError, "%s on stream %p: %s", what, (void *)stream, gWhy);
    cudaError_t err = gLaunch(stream, fn, arg);
    if (err != cudaSuccess)
        return labError(c, ncclUnhandledCudaError, "%s on stream %p: cudaLaunchHostFunc: %s (%d)", what,
                        (void *)stream, gErrorString(err), (int)err);
    return ncclSuccess;
}

/* Whether `stream` is being captured into a graph (as NCCL asks, with
 * cudaStreamGetCaptureInfo); 0 where the runtime cannot say. */
int labStreamCapturing(cudaStream_t stream) {
    pthread_once(&gOnce, load);
    enum cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (!gCaptureInfo || gCaptureInfo(stream, &status, NULL, NULL, NULL, NULL) != cudaSuccess) return 0;
    return status == cudaStreamCaptureStatusActive;
}

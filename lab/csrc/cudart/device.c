/* The device, the registry of live handles, errors and their names. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "runtime.h"

pthread_mutex_t labRtLock = PTHREAD_MUTEX_INITIALIZER;
pthread_cond_t labRtCond = PTHREAD_COND_INITIALIZER;

static void **gLive;
static int gN, gCap;
static __thread cudaError_t tLastError = cudaSuccess;
static __thread int tDevice;

uint64_t labNowNs(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

int labRegister(void *handle) {
    pthread_mutex_lock(&labRtLock);
    int ok = 1;
    if (gN == gCap) {
        int cap = gCap ? gCap * 2 : 64;
        void **v = realloc(gLive, sizeof *v * (size_t)cap);
        if (v) {
            gLive = v;
            gCap = cap;
        } else {
            ok = 0;
        }
    }
    if (ok) gLive[gN++] = handle;
    pthread_mutex_unlock(&labRtLock);
    return ok;
}

/* Called with labRtLock held. */
void labUnregister(void *handle) {
    for (int i = 0; i < gN; i++)
        if (gLive[i] == handle) {
            gLive[i] = gLive[--gN];
            return;
        }
}

int labIsLiveLocked(const void *handle, uint64_t magic) {
    for (int i = gN - 1; handle && i >= 0; i--)
        if (gLive[i] == handle) return *(const uint64_t *)handle == magic;
    return 0;
}

int labLiveStreams(cudaStream_t *out, int max) {
    int n = 0;
    pthread_mutex_lock(&labRtLock);
    for (int i = 0; i < gN && n < max; i++)
        if (*(const uint64_t *)gLive[i] == STREAM_MAGIC) out[n++] = gLive[i];
    pthread_mutex_unlock(&labRtLock);
    return n;
}

/* Every failing call goes through here: the thread's last error. */
cudaError_t labRtError(cudaError_t err) {
    if (err != cudaSuccess && err != cudaErrorNotReady) tLastError = err;
    return err;
}

static int deviceCount(void) {
    const char *env = getenv("LABCUDART_DEVICES");
    int n = env ? atoi(env) : 1;
    return n < 0 ? 0 : n;
}

CUDART_API cudaError_t cudaGetDeviceCount(int *count) {
    if (!count) return labRtError(cudaErrorInvalidValue);
    int n = deviceCount();
    *count = n;
    return n ? cudaSuccess : labRtError(cudaErrorNoDevice);
}

CUDART_API cudaError_t cudaSetDevice(int device) {
    int n = deviceCount();
    if (n == 0) return labRtError(cudaErrorNoDevice);
    if (device < 0 || device >= n) return labRtError(cudaErrorInvalidDevice);
    tDevice = device;
    return cudaSuccess;
}

CUDART_API cudaError_t cudaGetDevice(int *device) {
    if (!device) return labRtError(cudaErrorInvalidValue);
    *device = tDevice;
    return cudaSuccess;
}

CUDART_API cudaError_t cudaDeviceSynchronize(void) {
    labSyncAll();
    return cudaSuccess;
}

CUDART_API cudaError_t cudaRuntimeGetVersion(int *runtimeVersion) {
    if (!runtimeVersion) return labRtError(cudaErrorInvalidValue);
    *runtimeVersion = CUDART_VERSION;
    return cudaSuccess;
}

CUDART_API cudaError_t cudaDriverGetVersion(int *driverVersion) {
    if (!driverVersion) return labRtError(cudaErrorInvalidValue);
    *driverVersion = CUDART_VERSION;
    return cudaSuccess;
}

CUDART_API cudaError_t cudaGetLastError(void) {
    cudaError_t err = tLastError;
    tLastError = cudaSuccess;
    return err;
}

CUDART_API cudaError_t cudaPeekAtLastError(void) { return tLastError; }

typedef struct {
    cudaError_t code;
    const char *name;
    const char *text;
} errorInfo;

static const errorInfo ERRORS[] = {
    {cudaSuccess, "cudaSuccess", "no error"},
    {cudaErrorInvalidValue, "cudaErrorInvalidValue", "invalid argument"},
    {cudaErrorMemoryAllocation, "cudaErrorMemoryAllocation", "out of memory"},
    {cudaErrorInitializationError, "cudaErrorInitializationError", "initialization error"},
    {cudaErrorInsufficientDriver, "cudaErrorInsufficientDriver",
     "CUDA driver version is insufficient for CUDA runtime version"},
    {cudaErrorNoDevice, "cudaErrorNoDevice", "no CUDA-capable device is detected"},
    {cudaErrorInvalidDevice, "cudaErrorInvalidDevice", "invalid device ordinal"},
    {cudaErrorInvalidResourceHandle, "cudaErrorInvalidResourceHandle", "invalid resource handle"},
    {cudaErrorIllegalState, "cudaErrorIllegalState", "the operation cannot be performed in the present state"},
    {cudaErrorNotReady, "cudaErrorNotReady", "device not ready"},
    {cudaErrorLaunchFailure, "cudaErrorLaunchFailure", "unspecified launch failure"},
    {cudaErrorNotSupported, "cudaErrorNotSupported", "operation not supported"},
    {cudaErrorStreamCaptureUnsupported, "cudaErrorStreamCaptureUnsupported",
     "operation not permitted when stream is capturing"},
    {cudaErrorStreamCaptureInvalidated, "cudaErrorStreamCaptureInvalidated",
     "operation failed due to a previous error during capture"},
    {cudaErrorStreamCaptureUnmatched, "cudaErrorStreamCaptureUnmatched",
     "capture was not initiated in this stream"},
    {cudaErrorUnknown, "cudaErrorUnknown", "unknown error"},
};

/* Not inlined into the entry points: a leaf would lose its `push %rbp`. */
static __attribute__((noinline)) const errorInfo *lookup(cudaError_t code) {
    for (size_t i = 0; i < sizeof ERRORS / sizeof ERRORS[0]; i++)
        if (ERRORS[i].code == code) return &ERRORS[i];
    return NULL;
}

CUDART_API const char *cudaGetErrorString(cudaError_t error) {
    const errorInfo *e = lookup(error);
    return e ? e->text : "unrecognized error code";
}

CUDART_API const char *cudaGetErrorName(cudaError_t error) {
    const errorInfo *e = lookup(error);
    return e ? e->name : "cudaErrorUnknown";
}

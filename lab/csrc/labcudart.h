/* The lab's CUDA-runtime-compatible API: the stream, event, device and error
 * functions of the CUDA runtime (libcudart.so.12) that a training framework
 * uses, with the runtime's names, argument orders, handle types, flag values
 * and cudaError_t codes, written from the documented ABI.  There is no GPU:
 * a "device" is a set of streams, each an in-order executor on a host thread,
 * and device work is what the lab enqueues on them (labLaunchKernel, and
 * host functions such as the lab's libnccl running a collective).
 *
 * Lab extras (not in CUDA): labLaunchKernel, labStreamPending.
 */
#ifndef LABCUDART_H
#define LABCUDART_H

#ifdef __cplusplus
extern "C" {
#endif

#define CUDART_VERSION 12080

#if defined(LABCUDART_BUILD)
#define CUDART_API __attribute__((visibility("default")))
#else
#define CUDART_API
#endif

#ifndef LAB_CUDA_STREAM_T
#define LAB_CUDA_STREAM_T
typedef struct CUstream_st *cudaStream_t;
#endif
typedef struct CUevent_st *cudaEvent_t;
typedef void (*cudaHostFn_t)(void *userData);

/* The codes the lab returns; the numbers are CUDA's. */
enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInitializationError = 3,
    cudaErrorInsufficientDriver = 35,
    cudaErrorNoDevice = 100,
    cudaErrorInvalidDevice = 101,
    cudaErrorInvalidResourceHandle = 400,
    cudaErrorNotReady = 600,
    cudaErrorLaunchFailure = 719,
    cudaErrorNotSupported = 801,
    cudaErrorUnknown = 999
};
typedef enum cudaError cudaError_t;

#define cudaStreamDefault 0x00
#define cudaStreamNonBlocking 0x01
#define cudaStreamLegacy ((cudaStream_t)0x1)
#define cudaStreamPerThread ((cudaStream_t)0x2)

#define cudaEventDefault 0x00
#define cudaEventBlockingSync 0x01
#define cudaEventDisableTiming 0x02
#define cudaEventInterprocess 0x04
#define cudaEventRecordDefault 0x00
#define cudaEventRecordExternal 0x01
#define cudaEventWaitDefault 0x00

/* device */
CUDART_API cudaError_t cudaGetDeviceCount(int *count);
CUDART_API cudaError_t cudaSetDevice(int device);
CUDART_API cudaError_t cudaGetDevice(int *device);
CUDART_API cudaError_t cudaDeviceSynchronize(void);
CUDART_API cudaError_t cudaRuntimeGetVersion(int *runtimeVersion);
CUDART_API cudaError_t cudaDriverGetVersion(int *driverVersion);

/* errors */
CUDART_API cudaError_t cudaGetLastError(void);
CUDART_API cudaError_t cudaPeekAtLastError(void);
CUDART_API const char *cudaGetErrorString(cudaError_t error);
CUDART_API const char *cudaGetErrorName(cudaError_t error);

/* streams */
CUDART_API cudaError_t cudaStreamCreate(cudaStream_t *pStream);
CUDART_API cudaError_t cudaStreamCreateWithFlags(cudaStream_t *pStream, unsigned int flags);
CUDART_API cudaError_t cudaStreamCreateWithPriority(cudaStream_t *pStream, unsigned int flags,
                                                    int priority);
CUDART_API cudaError_t cudaStreamDestroy(cudaStream_t stream);
CUDART_API cudaError_t cudaStreamSynchronize(cudaStream_t stream);
CUDART_API cudaError_t cudaStreamSynchronize_ptsz(cudaStream_t stream);
CUDART_API cudaError_t cudaStreamQuery(cudaStream_t stream);
CUDART_API cudaError_t cudaStreamQuery_ptsz(cudaStream_t stream);
CUDART_API cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event,
                                           unsigned int flags);
CUDART_API cudaError_t cudaStreamWaitEvent_ptsz(cudaStream_t stream, cudaEvent_t event,
                                                unsigned int flags);
CUDART_API cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void *userData);
CUDART_API cudaError_t cudaLaunchHostFunc_ptsz(cudaStream_t stream, cudaHostFn_t fn,
                                               void *userData);

/* events */
CUDART_API cudaError_t cudaEventCreate(cudaEvent_t *event);
CUDART_API cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags);
CUDART_API cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream);
CUDART_API cudaError_t cudaEventRecord_ptsz(cudaEvent_t event, cudaStream_t stream);
CUDART_API cudaError_t cudaEventRecordWithFlags(cudaEvent_t event, cudaStream_t stream,
                                                unsigned int flags);
CUDART_API cudaError_t cudaEventRecordWithFlags_ptsz(cudaEvent_t event, cudaStream_t stream,
                                                     unsigned int flags);
CUDART_API cudaError_t cudaEventQuery(cudaEvent_t event);
CUDART_API cudaError_t cudaEventSynchronize(cudaEvent_t event);
CUDART_API cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end);
CUDART_API cudaError_t cudaEventDestroy(cudaEvent_t event);

/* Lab extra: "kernel" work that keeps `stream` busy for duration_ns once it
 * reaches the front of the stream (~0ull: forever, a device that stopped). */
CUDART_API cudaError_t labLaunchKernel(cudaStream_t stream, unsigned long long duration_ns);
/* Lab extra: items enqueued on `stream` and not yet run (0 when idle). */
CUDART_API cudaError_t labStreamPending(cudaStream_t stream, unsigned long long *pending);

#ifdef __cplusplus
}
#endif

#endif

/* The lab's CUDA-runtime-compatible API: the stream, event, device and error
 * functions of the CUDA runtime (libcudart.so.12) that a training framework
 * uses, with the runtime's names, argument orders, handle types, flag values
 * and cudaError_t codes, written from the documented ABI.  There is no GPU:
 * a "device" is a set of streams, each an in-order executor on a host thread,
 * and device work is what the lab enqueues on them (labLaunchKernel, and
 * host functions such as the lab's libnccl running a collective).
 *
 * Stream capture and graphs: work enqueued on a capturing stream (kernels,
 * host functions, event records and waits) becomes a node of the stream's
 * graph, in order, instead of running; cudaGraphLaunch runs an instantiated
 * graph's nodes, in order, on the stream it is given.  Capture modes are kept
 * but not enforced; a synchronisation or query of a capturing stream fails
 * and invalidates the capture, as CUDA's does.
 *
 * Lab extras (not in CUDA): labLaunchKernel, labStreamPending.
 */
#ifndef LABCUDART_H
#define LABCUDART_H

#include <stddef.h>

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
typedef struct CUgraph_st *cudaGraph_t;
typedef struct CUgraphExec_st *cudaGraphExec_t;
typedef struct CUgraphNode_st *cudaGraphNode_t;
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
    cudaErrorIllegalState = 401,
    cudaErrorNotReady = 600,
    cudaErrorLaunchFailure = 719,
    cudaErrorNotSupported = 801,
    cudaErrorStreamCaptureUnsupported = 900,
    cudaErrorStreamCaptureInvalidated = 901,
    cudaErrorStreamCaptureUnmatched = 903,
    cudaErrorUnknown = 999
};
typedef enum cudaError cudaError_t;

enum cudaStreamCaptureMode {
    cudaStreamCaptureModeGlobal = 0,
    cudaStreamCaptureModeThreadLocal = 1,
    cudaStreamCaptureModeRelaxed = 2
};

enum cudaStreamCaptureStatus {
    cudaStreamCaptureStatusNone = 0,
    cudaStreamCaptureStatusActive = 1,
    cudaStreamCaptureStatusInvalidated = 2
};

#define cudaGraphInstantiateFlagAutoFreeOnLaunch 1
#define cudaGraphInstantiateFlagUpload 2
#define cudaGraphInstantiateFlagDeviceLaunch 4
#define cudaGraphInstantiateFlagUseNodePriority 8

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

/* stream capture and graphs */
CUDART_API cudaError_t cudaStreamBeginCapture(cudaStream_t stream, enum cudaStreamCaptureMode mode);
CUDART_API cudaError_t cudaStreamBeginCapture_ptsz(cudaStream_t stream,
                                                   enum cudaStreamCaptureMode mode);
CUDART_API cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t *pGraph);
CUDART_API cudaError_t cudaStreamEndCapture_ptsz(cudaStream_t stream, cudaGraph_t *pGraph);
CUDART_API cudaError_t cudaStreamIsCapturing(cudaStream_t stream,
                                             enum cudaStreamCaptureStatus *pCaptureStatus);
CUDART_API cudaError_t cudaStreamIsCapturing_ptsz(cudaStream_t stream,
                                                  enum cudaStreamCaptureStatus *pCaptureStatus);
/* CUDA 12's form (the _v2 of 11.3): dependencies are never reported here. */
CUDART_API cudaError_t cudaStreamGetCaptureInfo(cudaStream_t stream,
                                                enum cudaStreamCaptureStatus *captureStatus_out,
                                                unsigned long long *id_out, cudaGraph_t *graph_out,
                                                const cudaGraphNode_t **dependencies_out,
                                                size_t *numDependencies_out);
CUDART_API cudaError_t cudaStreamGetCaptureInfo_ptsz(cudaStream_t stream,
                                                     enum cudaStreamCaptureStatus *captureStatus_out,
                                                     unsigned long long *id_out, cudaGraph_t *graph_out,
                                                     const cudaGraphNode_t **dependencies_out,
                                                     size_t *numDependencies_out);
CUDART_API cudaError_t cudaStreamGetCaptureInfo_v2(cudaStream_t stream,
                                                   enum cudaStreamCaptureStatus *captureStatus_out,
                                                   unsigned long long *id_out, cudaGraph_t *graph_out,
                                                   const cudaGraphNode_t **dependencies_out,
                                                   size_t *numDependencies_out);
CUDART_API cudaError_t cudaGraphInstantiate(cudaGraphExec_t *pGraphExec, cudaGraph_t graph,
                                            unsigned long long flags);
CUDART_API cudaError_t cudaGraphInstantiateWithFlags(cudaGraphExec_t *pGraphExec, cudaGraph_t graph,
                                                     unsigned long long flags);
CUDART_API cudaError_t cudaGraphLaunch(cudaGraphExec_t graphExec, cudaStream_t stream);
CUDART_API cudaError_t cudaGraphLaunch_ptsz(cudaGraphExec_t graphExec, cudaStream_t stream);
CUDART_API cudaError_t cudaGraphExecDestroy(cudaGraphExec_t graphExec);
CUDART_API cudaError_t cudaGraphDestroy(cudaGraph_t graph);

/* Lab extra: "kernel" work that keeps `stream` busy for duration_ns once it
 * reaches the front of the stream (~0ull: forever, a device that stopped). */
CUDART_API cudaError_t labLaunchKernel(cudaStream_t stream, unsigned long long duration_ns);
/* Lab extra: items enqueued on `stream` and not yet run (0 when idle). */
CUDART_API cudaError_t labStreamPending(cudaStream_t stream, unsigned long long *pending);

#ifdef __cplusplus
}
#endif

#endif

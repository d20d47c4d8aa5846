/* Drives an NCCL-ABI library from C, so that Python does not dominate the
 * cost of a call.  Linked against libnccl.so.2 (any with NCCL's ABI).
 *
 *   ncclloop scenario IDHEX|- RANK NRANKS   every entry point once or more,
 *                                           printing what it used and got
 *   ncclloop loop N allreduce|baseline      N calls, prints ns per call: the
 *                                           thread's CPU time (the probes run in
 *                                           its context; time it spends preempted
 *                                           by other work does not count)
 *   ncclloop pace SECONDS RATE              RATE AllReduce calls per second, until
 *                                           SECONDS pass or SIGTERM; prints the count
 *   ncclloop wrap N                         init a communicator, N AllReduce on it
 *   ncclloop events N CUDART                N times what PyTorch does per collective,
 *                                           on the CUDA runtime CUDART: record a start
 *                                           event, the AllReduce, record an end event,
 *                                           query both; prints ns per collective
 *   ncclloop graphs N K CUDART               capture K AllReduce calls on a stream of the
 *                                           CUDA runtime CUDART into a graph, then launch
 *                                           it N times; prints ns per launch
 *
 * Declarations come from the lab's NCCL header (lab/csrc/labnccl.h).
 *
 * Each mode first waits for a line on stdin when WAIT=1 is set, so that a
 * test can attach probes before the first call.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <dlfcn.h>
#include <signal.h>
#include <unistd.h>

#include "labnccl.h"

/* Not an NCCL symbol: the fake library's baseline for a bare uprobe pair. */
ncclResult_t benchBaseline(const void *, void *, size_t, int, int, ncclComm_t, void *);

static const cudaStream_t STREAM = (cudaStream_t)0x5157;

static void print_id(const char *name, const ncclUniqueId *id)
{
	printf("%s ", name);
	for (int i = 0; i < 128; i++)
		printf("%02x", (unsigned char)id->internal[i]);
	printf("\n");
}

static void parse_id(const char *hex, ncclUniqueId *id)
{
	for (int i = 0; i < 128; i++) {
		unsigned v;
		sscanf(hex + 2 * i, "%2x", &v);
		id->internal[i] = (char)v;
	}
}

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ULL + ts.tv_nsec;
}

static uint64_t cpu_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ULL + ts.tv_nsec;
}

static int scenario(const char *idhex, int rank, int nranks)
{
	ncclUniqueId id, id2;
	ncclComm_t comm = NULL, comm2 = NULL, comm3 = NULL, sub = NULL, none = (ncclComm_t)1;
	ncclComm_t all[2] = {0};
	char buf[64];
	printf("pid %d\n", (int)getpid());
	if (strcmp(idhex, "-") == 0)
		printf("result_get_unique_id %d\n", ncclGetUniqueId(&id));
	else
		parse_id(idhex, &id);
	print_id("uid", &id);
	printf("result_init %d\n", ncclCommInitRank(&comm, nranks, id, rank));
	printf("comm %p\n", comm);
	for (int i = 0; i < 3; i++)
		ncclAllReduce(buf, buf, 1000, 7, 0, comm, STREAM);
	ncclBroadcast(buf, buf, 10, 2, 1, comm, STREAM);
	ncclReduce(buf, buf, 11, 4, 2, 3, comm, STREAM);
	ncclAllGather(buf, buf, 12, 9, comm, STREAM);
	ncclReduceScatter(buf, buf, 13, 8, 1, comm, STREAM);
	ncclBcast(buf, 14, 0, 2, comm, STREAM);
	ncclAlltoAll(buf, buf, 15, 1, comm, STREAM);
	ncclGather(buf, buf, 16, 3, 0, comm, STREAM);
	ncclScatter(buf, buf, 17, 5, 1, comm, STREAM);
	ncclGroupStart();
	ncclSend(buf, 18, 7, 1, comm, STREAM);
	ncclSend(buf, 18, 7, 1, comm, STREAM);
	ncclRecv(buf, 18, 7, 3, comm, STREAM);
	ncclGroupEnd();
	printf("result_split %d\n", ncclCommSplit(comm, 5, 7, &sub, NULL));
	printf("sub %p\n", sub);
	ncclAllReduce(buf, buf, 19, 7, 0, sub, STREAM);
	ncclCommSplit(comm, -1, 7, &none, NULL);
	printf("none %p\n", none);
	id2 = id;
	id2.internal[127] ^= 1; /* same NCCL header bytes, different id */
	print_id("uid2", &id2);
	ncclCommInitRankConfig(&comm2, nranks, id2, rank, NULL);
	printf("comm2 %p\n", comm2);
	ncclAllReduce(buf, buf, 20, 7, 0, comm2, STREAM);
	ncclCommInitAll(all, 2, NULL);
	printf("all %p %p\n", all[0], all[1]);
	ncclCommFinalize(comm2);
	ncclCommDestroy(comm2);
	ncclCommAbort(comm3);
	printf("result_null %d\n", ncclAllReduce(buf, buf, 21, 7, 0, NULL, STREAM));
	fflush(stdout);
	return 0;
}

static int loop(long n, const char *what)
{
	char buf[8];
	ncclComm_t comm = (ncclComm_t)buf; /* the library never dereferences it */
	int base = strcmp(what, "baseline") == 0;
	uint64_t t0 = cpu_ns();
	for (long i = 0; i < n; i++) {
		if (base)
			benchBaseline(buf, buf, 8, 7, 0, comm, STREAM);
		else
			ncclAllReduce(buf, buf, 8, 7, 0, comm, STREAM);
	}
	printf("%.1f\n", (double)(cpu_ns() - t0) / (double)n);
	return 0;
}

static volatile sig_atomic_t stopped;

static void stop(int sig)
{
	(void)sig;
	stopped = 1;
}

static int pace(double seconds, long rate)
{
	char buf[8];
	ncclComm_t comm = (ncclComm_t)buf;
	uint64_t t0 = now_ns(), period = 1000000000ULL / (uint64_t)rate;
	uint64_t end = t0 + (uint64_t)(seconds * 1e9), next = t0;
	long calls = 0;
	signal(SIGTERM, stop);
	while (next < end && !stopped) {
		ncclAllReduce(buf, buf, 8, 7, 0, comm, STREAM);
		calls++;
		next += period;
		uint64_t now = now_ns();
		if (next > now) {
			struct timespec ts = {0, (long)(next - now)};
			nanosleep(&ts, NULL);
		}
	}
	printf("%ld\n", calls);
	return 0;
}

static int wrap(long n)
{
	ncclUniqueId id;
	ncclComm_t comm = NULL;
	char buf[8];
	ncclGetUniqueId(&id);
	print_id("uid", &id);
	printf("result_init %d\n", ncclCommInitRank(&comm, 2, id, 1));
	for (long i = 0; i < n; i++)
		ncclAllReduce(buf, buf, 2, 7, 0, comm, STREAM);
	printf("comm %p\n", comm);
	printf("pid %d\n", (int)getpid());
	return 0;
}

typedef int (*rt_fn1)(void *);
typedef int (*rt_fn2)(void *, void *);

static int events(long n, const char *cudart)
{
	void *rt = dlopen(cudart, RTLD_NOW);
	if (!rt) {
		fprintf(stderr, "%s\n", dlerror());
		return 2;
	}
	rt_fn1 stream_create = (rt_fn1)dlsym(rt, "cudaStreamCreate");
	rt_fn1 event_create = (rt_fn1)dlsym(rt, "cudaEventCreate");
	rt_fn2 record = (rt_fn2)dlsym(rt, "cudaEventRecord");
	rt_fn1 query = (rt_fn1)dlsym(rt, "cudaEventQuery");
	rt_fn1 sync = (rt_fn1)dlsym(rt, "cudaStreamSynchronize");
	void *stream = NULL, *start = NULL, *end = NULL;
	char buf[8];
	ncclComm_t comm = (ncclComm_t)buf;
	if (!stream_create || !event_create || !record || !query || !sync || stream_create(&stream) ||
	    event_create(&start) || event_create(&end))
		return 2;
	uint64_t t0 = now_ns();
	for (long i = 0; i < n; i++) {
		record(start, stream);
		ncclAllReduce(buf, buf, 8, 7, 0, comm, (cudaStream_t)stream);
		record(end, stream);
		query(start);
		query(end);
	}
	printf("%.1f\n", (double)(now_ns() - t0) / (double)n);
	return sync(stream);
}

typedef int (*rt_fn3)(void *, void *, unsigned long long);

static int graphs(long n, long k, const char *cudart)
{
	void *rt = dlopen(cudart, RTLD_NOW);
	if (!rt) {
		fprintf(stderr, "%s\n", dlerror());
		return 2;
	}
	rt_fn1 stream_create = (rt_fn1)dlsym(rt, "cudaStreamCreate");
	int (*begin)(void *, int) = (int (*)(void *, int))dlsym(rt, "cudaStreamBeginCapture");
	rt_fn2 end = (rt_fn2)dlsym(rt, "cudaStreamEndCapture");
	rt_fn3 instantiate = (rt_fn3)dlsym(rt, "cudaGraphInstantiate");
	rt_fn2 launch = (rt_fn2)dlsym(rt, "cudaGraphLaunch");
	rt_fn1 sync = (rt_fn1)dlsym(rt, "cudaStreamSynchronize");
	void *stream = NULL, *graph = NULL, *exec = NULL;
	char buf[8];
	ncclComm_t comm = (ncclComm_t)buf;
	if (!stream_create || !begin || !end || !instantiate || !launch || !sync ||
	    stream_create(&stream) || begin(stream, 1))
		return 2;
	for (long i = 0; i < k; i++)
		ncclAllReduce(buf, buf, 8, 7, 0, comm, (cudaStream_t)stream);
	if (end(stream, &graph) || instantiate(&exec, graph, 0))
		return 2;
	uint64_t t0 = now_ns();
	for (long i = 0; i < n; i++)
		launch(exec, stream);
	printf("%.1f\n", (double)(now_ns() - t0) / (double)n);
	return sync(stream);
}

int main(int argc, char **argv)
{
	char line[16];
	if (getenv("WAIT") && strcmp(getenv("WAIT"), "1") == 0) {
		printf("ready %d\n", (int)getpid());
		fflush(stdout);
		if (!fgets(line, sizeof(line), stdin))
			return 3;
	}
	if (argc == 5 && strcmp(argv[1], "scenario") == 0)
		return scenario(argv[2], atoi(argv[3]), atoi(argv[4]));
	if (argc == 4 && strcmp(argv[1], "loop") == 0)
		return loop(atol(argv[2]), argv[3]);
	if (argc == 4 && strcmp(argv[1], "pace") == 0)
		return pace(atof(argv[2]), atol(argv[3]));
	if (argc == 3 && strcmp(argv[1], "wrap") == 0)
		return wrap(atol(argv[2]));
	if (argc == 4 && strcmp(argv[1], "events") == 0)
		return events(atol(argv[2]), argv[3]);
	if (argc == 5 && strcmp(argv[1], "graphs") == 0)
		return graphs(atol(argv[2]), atol(argv[3]), argv[4]);
	fprintf(stderr, "usage: ncclloop scenario IDHEX|- RANK NRANKS | loop N WHAT | pace S RATE | wrap N\n");
	return 2;
}

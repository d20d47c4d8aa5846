/* A tiny library with NCCL's public ABI for recorder tests and benchmarks:
 * the lab's NCCL header (lab/csrc/labnccl.h) for names and signatures, no
 * communication.  Built with frame pointers and without CET so that every
 * entry point begins with `push` (a uprobe on push is emulated, not
 * single-stepped). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "labnccl.h"

struct ncclComm { int rank, nranks; };

#define OK ncclSuccess
#define INVALID ncclInvalidArgument

ncclResult_t ncclGetUniqueId(ncclUniqueId *id)
{
	if (!id)
		return INVALID;
	uint64_t x = (uint64_t)time(NULL) ^ (uint64_t)(uintptr_t)id;
	for (int i = 0; i < 128; i++) {
		x = x * 6364136223846793005ULL + 1442695040888963407ULL;
		id->internal[i] = (char)(x >> 56);
	}
	/* magic, then a sockaddr_in: AF_INET, port 29500, 10.0.0.1 */
	id->internal[8] = 2; id->internal[9] = 0;
	id->internal[10] = 0x73; id->internal[11] = 0x3c;
	id->internal[12] = 10; id->internal[13] = 0; id->internal[14] = 0; id->internal[15] = 1;
	return OK;
}

static ncclComm_t make_comm(int rank, int nranks)
{
	ncclComm_t c = malloc(sizeof(*c));
	c->rank = rank;
	c->nranks = nranks;
	return c;
}

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank)
{
	(void)id;
	if (!comm || rank < 0 || rank >= nranks)
		return INVALID;
	*comm = make_comm(rank, nranks);
	return OK;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank,
				    ncclConfig_t *config)
{
	(void)config;
	return ncclCommInitRank(comm, nranks, id, rank);
}

ncclResult_t ncclCommInitAll(ncclComm_t *comms, int ndev, const int *devlist)
{
	(void)devlist;
	for (int i = 0; i < ndev; i++)
		comms[i] = make_comm(i, ndev);
	return OK;
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm,
			   ncclConfig_t *config)
{
	(void)config;
	if (!comm || !newcomm)
		return INVALID;
	*newcomm = color < 0 ? NULL : make_comm(key, -1);
	return OK;
}

static ncclResult_t closing(ncclComm_t comm) { return comm ? OK : INVALID; }
ncclResult_t ncclCommDestroy(ncclComm_t comm) { return closing(comm); }
ncclResult_t ncclCommAbort(ncclComm_t comm) { return closing(comm); }
ncclResult_t ncclCommFinalize(ncclComm_t comm) { return closing(comm); }

static ncclResult_t op(ncclComm_t comm) { return comm ? OK : INVALID; }

ncclResult_t ncclAllReduce(const void *s, void *r, size_t count, ncclDataType_t dt, ncclRedOp_t redop,
			   ncclComm_t comm, cudaStream_t stream)
{ (void)s; (void)r; (void)count; (void)dt; (void)redop; (void)stream; return op(comm); }
ncclResult_t ncclReduceScatter(const void *s, void *r, size_t count, ncclDataType_t dt, ncclRedOp_t redop,
			       ncclComm_t comm, cudaStream_t stream)
{ (void)s; (void)r; (void)count; (void)dt; (void)redop; (void)stream; return op(comm); }
ncclResult_t ncclBroadcast(const void *s, void *r, size_t count, ncclDataType_t dt, int root,
			   ncclComm_t comm, cudaStream_t stream)
{ (void)s; (void)r; (void)count; (void)dt; (void)root; (void)stream; return op(comm); }
ncclResult_t ncclGather(const void *s, void *r, size_t count, ncclDataType_t dt, int root,
			ncclComm_t comm, cudaStream_t stream)
{ (void)s; (void)r; (void)count; (void)dt; (void)root; (void)stream; return op(comm); }
ncclResult_t ncclScatter(const void *s, void *r, size_t count, ncclDataType_t dt, int root,
			 ncclComm_t comm, cudaStream_t stream)
{ (void)s; (void)r; (void)count; (void)dt; (void)root; (void)stream; return op(comm); }
ncclResult_t ncclBcast(void *b, size_t count, ncclDataType_t dt, int root, ncclComm_t comm, cudaStream_t stream)
{ (void)b; (void)count; (void)dt; (void)root; (void)stream; return op(comm); }
ncclResult_t ncclReduce(const void *s, void *r, size_t count, ncclDataType_t dt, ncclRedOp_t redop, int root,
			ncclComm_t comm, cudaStream_t stream)
{ (void)s; (void)r; (void)count; (void)dt; (void)redop; (void)root; (void)stream; return op(comm); }
ncclResult_t ncclAllGather(const void *s, void *r, size_t count, ncclDataType_t dt, ncclComm_t comm,
			   cudaStream_t stream)
{ (void)s; (void)r; (void)count; (void)dt; (void)stream; return op(comm); }
ncclResult_t ncclAlltoAll(const void *s, void *r, size_t count, ncclDataType_t dt, ncclComm_t comm,
			  cudaStream_t stream)
{ (void)s; (void)r; (void)count; (void)dt; (void)stream; return op(comm); }
ncclResult_t ncclSend(const void *b, size_t count, ncclDataType_t dt, int peer, ncclComm_t comm, cudaStream_t stream)
{ (void)b; (void)count; (void)dt; (void)peer; (void)stream; return op(comm); }
ncclResult_t ncclRecv(void *b, size_t count, ncclDataType_t dt, int peer, ncclComm_t comm, cudaStream_t stream)
{ (void)b; (void)count; (void)dt; (void)peer; (void)stream; return op(comm); }
ncclResult_t ncclGroupStart(void) { return OK; }
ncclResult_t ncclGroupEnd(void) { return OK; }

/* Not an NCCL symbol: the same shape as ncclAllReduce, for the benchmark's
 * bare uprobe+uretprobe baseline. */
ncclResult_t benchBaseline(const void *s, void *r, size_t count, ncclDataType_t dt, ncclRedOp_t redop,
			   ncclComm_t comm, cudaStream_t stream)
{ (void)s; (void)r; (void)count; (void)dt; (void)redop; (void)stream; return op(comm); }

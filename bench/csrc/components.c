/* The pieces of stallwatch's entry and return programs (bpf/nccl.c), one
 * program each, so that the benchmark can time each with the kernel's own
 * program statistics (BPF_ENABLE_STATS) on a do-nothing function and give
 * the agent's per-call cost piece by piece.  Each mirrors what nccl.c does:
 * the same helpers, map types and sizes. */
#include <uapi/linux/ptrace.h>

struct comm_state {
	u64 w[11];
};
BPF_F_TABLE("array", u32, struct comm_state, comm_states, 16384, BPF_F_MMAPABLE);
struct row {
	u64 w[18]; /* 144 bytes, as struct nccl_event */
};
BPF_F_TABLE("array", u32, struct row, ring, 131072, BPF_F_MMAPABLE);
BPF_F_TABLE("array", u32, u64, head, 8, BPF_F_MMAPABLE);
BPF_F_TABLE("array", u32, struct row, slots, 8192, BPF_F_MMAPABLE);

int piece_nothing(struct pt_regs *ctx)
{
	return 0;
}

int piece_ids(struct pt_regs *ctx)
{
	volatile u64 id = bpf_get_current_pid_tgid();
	return 0;
}

int piece_clock(struct pt_regs *ctx)
{
	volatile u64 t = bpf_ktime_get_ns();
	return 0;
}

/* ncclAllReduce's 7th argument, its stream, is on the caller's stack. */
int piece_stack_arg(struct pt_regs *ctx)
{
	u64 v = 0;
	bpf_probe_read_user(&v, sizeof(v), (void *)(PT_REGS_SP(ctx) + 8));
	volatile u64 keep = v;
	return 0;
}

/* (pid, ncclComm_t) -> the communicator's sequence numbers and progress,
 * at its home slot of an array (a multiply), the key checked. */
int piece_comm_lookup(struct pt_regs *ctx)
{
	u32 pid = bpf_get_current_pid_tgid() >> 32;
	u64 comm = PT_REGS_PARM6(ctx);
	u32 i = (u32)(((comm ^ ((u64)pid << 48)) * 0x9E3779B97F4A7C15ULL) >> 50);
	struct comm_state *st = comm_states.lookup(&i);
	if (!st)
		return 0;
	if (st->w[0] != comm || (u32)st->w[1] != pid) {
		st->w[0] = comm;
		st->w[1] = pid;
		return 0;
	}
	st->w[2]++;
	st->w[3] = 1;
	return 0;
}

/* The thread's in-flight slot, claimed by compare-and-swap and freed. */
int piece_thread_slot(struct pt_regs *ctx)
{
	u32 tid = (u32)bpf_get_current_pid_tgid();
	u32 i = tid & 8191;
	struct row *r = slots.lookup(&i);
	if (!r)
		return 0;
	if (__sync_val_compare_and_swap(&r->w[0], 0, (u64)tid) == 0)
		r->w[0] = 0;
	return 0;
}

/* A ring row: a position claimed with an atomic add, 144 bytes written. */
int piece_ring_row(struct pt_regs *ctx)
{
	u32 zero = 0;
	u64 *h = head.lookup(&zero);
	if (!h)
		return 0;
	u64 pos = __sync_fetch_and_add(h, 1) + 1;
	u32 i = (pos - 1) & 131071;
	struct row *r = ring.lookup(&i);
	if (!r)
		return 0;
#pragma unroll
	for (int j = 1; j < 18; j++)
		r->w[j] = pos + j;
	asm volatile("" ::: "memory");
	r->w[0] = pos;
	return 0;
}

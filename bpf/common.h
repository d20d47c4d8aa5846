/* Maps and helpers shared by every stallwatch BPF program.
 *
 * The four probe families (nccl.c, tcp.c, sched.c, proc.c) are loaded as one
 * BPF module so that they share the process filter (`tracked`, `excluded`),
 * the ring heads and the loss counters defined here.
 *
 * A ring is an mmapable BPF array of a power-of-two number of slots that the
 * programs write directly; user space maps it and views it with numpy.  A
 * writer claims position p with an atomic add on the ring's head, fills slot
 * p & (SLOTS - 1) and stores hdr.pos = p + 1 last (after a compiler barrier),
 * so a reader can tell a complete row from one being written or overwritten.
 */
#ifndef STALLWATCH_COMMON_H
#define STALLWATCH_COMMON_H

#include <uapi/linux/ptrace.h>

#include "events.h"

#ifndef NCCL_RING_SLOTS
#define NCCL_RING_SLOTS 65536
#endif
#ifndef COMM_RING_SLOTS
#define COMM_RING_SLOTS 1024
#endif
#ifndef TCP_RING_SLOTS
#define TCP_RING_SLOTS 16384
#endif
#ifndef SCHED_RING_SLOTS
#define SCHED_RING_SLOTS 8192
#endif
#ifndef EXIT_RING_SLOTS
#define EXIT_RING_SLOTS 1024
#endif
#ifndef DISC_RING_SLOTS
#define DISC_RING_SLOTS 1024
#endif

#define MAX_TRACKED 4096

/* One cache line per head, so that rings written on different CPUs do not
 * share a line. */
struct ring_head {
	__u64 head;
	__u64 _pad[7];
};
_Static_assert(sizeof(struct ring_head) == 64, "ring_head size");

BPF_F_TABLE("array", u32, struct ring_head, heads, RING_HEADS, BPF_F_MMAPABLE);
BPF_PERCPU_ARRAY(drops, u64, DROP_SLOTS);

/* tgid -> 1: processes in scope (set by user space at discovery). */
BPF_HASH(tracked, u32, u32, MAX_TRACKED);
/* tgid -> 1: processes out of scope (another namespace); dropped here. */
BPF_HASH(excluded, u32, u32, MAX_TRACKED);
/* [0]: 1 once user space has excluded any process.  Until then (always, in
 * host scope) is_excluded skips the hash lookup, some 40 ns a call: an array
 * lookup is inlined by the verifier. */
BPF_ARRAY(any_excluded, u32, 1);

static __always_inline void count_drop(u32 slot)
{
	u64 *n = drops.lookup(&slot);
	if (n)
		*n += 1;
}

static __always_inline u64 claim_position(u32 ring)
{
	struct ring_head *h = heads.lookup(&ring);
	if (!h)
		return 0;
	return __sync_fetch_and_add(&h->head, 1) + 1;
}

/* Publish a row: every field is written before its position. */
static __always_inline void publish(struct event_header *hdr, u64 pos)
{
	asm volatile("" ::: "memory");
	*(volatile __u64 *)&hdr->pos = pos;
}

static __always_inline void fill_header(struct event_header *hdr, u16 kind, u16 size,
					u32 pid, u32 tid, u64 ts)
{
	hdr->ts_ns = ts;
	hdr->kind = kind;
	hdr->size = size;
	hdr->pid = pid;
	hdr->tid = tid;
	hdr->_pad0 = 0;
}

/* The slot of ring position `pos` (claimed, 1-based); counts a failure.
 * Each ring has its own claim function below (BCC rewrites map calls only
 * outside macros): `row = ring.lookup(&slot_of(pos, SLOTS))`. */
static __always_inline u32 slot_of(u64 pos, u64 slots)
{
	return (u32)((pos - 1) & (slots - 1));
}

static __always_inline int is_excluded(u32 tgid)
{
	u32 zero = 0;
	u32 *any = any_excluded.lookup(&zero);
	if (!any || !*any)
		return 0;
	return excluded.lookup(&tgid) != NULL;
}

static __always_inline int is_tracked(u32 tgid)
{
	return tracked.lookup(&tgid) != NULL;
}

#endif

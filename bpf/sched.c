/* Run-queue delay of the threads of tracked processes, decided in the kernel:
 * one sched_event only when a thread waited longer than RUNQ_THRESHOLD_NS,
 * plus per-thread totals in `rq_totals`.  Never one event per switch.
 *
 * Threads are learned at sched_switch, where current is the outgoing thread:
 * if its tgid is tracked, remember tid -> tgid.  A thread starts waiting when
 * woken (sched_wakeup*) or when preempted while runnable.
 *
 * Attachment: raw tracepoints (SCHED_RAW_TP: the task's pid read at its
 * offset in the running kernel's task_struct, from its BTF), which the
 * kernel skips only when a program would run inside itself; else
 * tracepoints, which it skips while any other tracing program runs on the
 * CPU (a timer's wakeup in the middle of another tool's program is lost).
 */
#include "common.h"

#ifndef RUNQ_THRESHOLD_NS
#define RUNQ_THRESHOLD_NS 1000000ULL
#endif
#define MAX_THREADS 16384
/* prev_state keeps the preempted bit above the task state bits. */
#define TASK_STATE_MASK 0xff

BPF_F_TABLE("array", u32, struct sched_event, sched_ring, SCHED_RING_SLOTS, BPF_F_MMAPABLE);

static __always_inline struct sched_event *claim_sched(u64 *pos)
{
	*pos = claim_position(RING_SCHED);
	u32 slot = slot_of(*pos, SCHED_RING_SLOTS);
	struct sched_event *row = *pos ? sched_ring.lookup(&slot) : NULL;
	if (!row)
		count_drop(RING_SCHED);
	return row;
}
BPF_HASH(rq_tids, u32, u32, MAX_THREADS);     /* tid -> tgid */
BPF_HASH(rq_enqueued, u32, u64, MAX_THREADS); /* tid -> time it became runnable */

struct rq_total {
	u64 delay_ns;
	u64 waits;
	u64 over_threshold;
};
BPF_HASH(rq_totals, u32, struct rq_total, MAX_THREADS);

static __always_inline void mark_runnable(u32 tid, u64 ts)
{
	if (!rq_tids.lookup(&tid))
		return;
	if (rq_enqueued.update(&tid, &ts))
		count_drop(DROP_RQ_FULL);
}

static __always_inline void emit_delay(u32 tid, u32 tgid, u64 delay, u64 ts, u32 holder)
{
	struct sched_event *e;
	u64 pos;
	e = claim_sched(&pos);
	if (!e)
		return;
	fill_header(&e->hdr, EVENT_SCHED, sizeof(*e), tgid, tid, ts);
	e->delay_ns = delay;
	e->cpu = bpf_get_smp_processor_id();
	e->prev_pid = (s32)holder;
	publish(&e->hdr, pos);
}

/* `holder`: the process that held the CPU until `tid` got it (at
 * sched_switch, current is still the outgoing task).  The analyzer tells by
 * it whether a rank waited behind its own job's ranks or behind another
 * process. */
static __always_inline void account(u32 tid, u64 ts, u32 holder)
{
	u64 *since = rq_enqueued.lookup(&tid);
	if (!since)
		return;
	u64 delay = ts > *since ? ts - *since : 0;
	rq_enqueued.delete(&tid);
	u32 *tgid = rq_tids.lookup(&tid);
	if (!tgid)
		return;
	u32 owner = *tgid;
	struct rq_total zero = {};
	struct rq_total *t = rq_totals.lookup_or_try_init(&tid, &zero);
	if (t) {
		t->delay_ns += delay;
		t->waits += 1;
	}
	if (delay < RUNQ_THRESHOLD_NS)
		return;
	if (t)
		t->over_threshold += 1;
	emit_delay(tid, owner, delay, ts, holder);
}

/* A switch: `prev` (current, of process `tgid`) leaves the CPU, runnable
 * still or not; `next` gets it. */
static __always_inline void on_switch(u32 prev, int runnable, u32 next, u64 ts)
{
	u32 tgid = bpf_get_current_pid_tgid() >> 32;
	if (prev && is_tracked(tgid)) {
		if (!rq_tids.lookup(&prev) && rq_tids.update(&prev, &tgid))
			count_drop(DROP_RQ_FULL);
		if (runnable)
			mark_runnable(prev, ts);
	}
	account(next, ts, tgid);
}

#ifdef SCHED_RAW_TP
/* The task's fields at their offsets in the running kernel's task_struct
 * (TASK_PID_OFF, TASK_EXIT_STATE_OFF, and TASK_STATE_OFF where sched_switch has no
 * prev_state argument: before 5.18), from its BTF (recorder/sched_probes.py). */
static __always_inline u32 task_pid(u64 task)
{
	u32 pid = 0;
	bpf_probe_read_kernel(&pid, sizeof(pid), (void *)(task + TASK_PID_OFF));
	return pid;
}

RAW_TRACEPOINT_PROBE(sched_wakeup)
{
	mark_runnable(task_pid(ctx->args[0]), bpf_ktime_get_ns());
	return 0;
}

RAW_TRACEPOINT_PROBE(sched_wakeup_new)
{
	mark_runnable(task_pid(ctx->args[0]), bpf_ktime_get_ns());
	return 0;
}

/* Task state bits the tracepoint reports (include/linux/sched.h:
 * TASK_REPORT), and the lock wait it reports as uninterruptible. */
#define REPORTED_STATES 0x7f
#define RTLOCK_WAIT_STATE 0x1000

/* Whether the tracepoint's prev_state would say runnable ("R", or "R+" when
 * preempted): __trace_sched_switch_state's state index 0. */
static __always_inline int still_runnable(u64 preempt, u64 prev, u32 state)
{
	if (preempt)
		return 1;
	if ((state & REPORTED_STATES) || state == RTLOCK_WAIT_STATE)
		return 0;
	u32 exit_state = 0;
	bpf_probe_read_kernel(&exit_state, sizeof(exit_state), (void *)(prev + TASK_EXIT_STATE_OFF));
	return (exit_state & REPORTED_STATES) == 0;
}

/* args: preempt, prev, next[, prev_state] */
RAW_TRACEPOINT_PROBE(sched_switch)
{
	u64 ts = bpf_ktime_get_ns();
	u64 prev = ctx->args[1];
	u32 tid = (u32)bpf_get_current_pid_tgid(); /* prev is current */
	u32 tgid = bpf_get_current_pid_tgid() >> 32;
	int runnable = 0;
	if (tid && is_tracked(tgid)) {
#ifdef TASK_STATE_OFF
		u32 state = 0;
		bpf_probe_read_kernel(&state, sizeof(state), (void *)(prev + TASK_STATE_OFF));
#else
		u32 state = (u32)ctx->args[3];
#endif
		runnable = still_runnable(ctx->args[0], prev, state);
	}
	on_switch(tid, runnable, task_pid(ctx->args[2]), ts);
	return 0;
}

#else
/* ---- tracepoints (kernels without BTF) ---- */

TRACEPOINT_PROBE(sched, sched_wakeup)
{
	mark_runnable(args->pid, bpf_ktime_get_ns());
	return 0;
}

TRACEPOINT_PROBE(sched, sched_wakeup_new)
{
	mark_runnable(args->pid, bpf_ktime_get_ns());
	return 0;
}

TRACEPOINT_PROBE(sched, sched_switch)
{
	u64 ts = bpf_ktime_get_ns();
	int runnable = (args->prev_state & TASK_STATE_MASK) == 0;
	on_switch(args->prev_pid, runnable, args->next_pid, ts);
	return 0;
}
#endif

/* How processes that hold communicators end: the exit code (libc's _exit),
 * fatal signals (generated for them, delivered to them) and the death of the
 * thread group.  sched_process_exit carries no exit code and task structs are
 * not read by pointer, hence the three sources.
 *
 * And how the agent learns of processes that may map a new libnccl, instead
 * of scanning /proc: a program image replaced (sched_process_exec) and the
 * dynamic loader's _dl_debug_state(), which it calls whenever its list of
 * loaded objects changed (at start-up, dlopen, dlclose; debuggers break
 * there for the same reason).  There the program reads the loader's list
 * (user memory: glibc's struct r_debug and struct link_map, a public ABI
 * <link.h> that debuggers read) and writes a row only when an object just
 * added is named libnccl.so* or libcudart.so.* (discovery.GPU_LIBS in user
 * space): the other processes of the machine cost the agent nothing.
 * One row each in `disc_ring`.
 */
#include "common.h"

#define SIGABRT 6
#define SIGBUS 7
#define SIGFPE 8
#define SIGKILL 9
#define SIGSEGV 11
#define SIGTERM 15
#define SIGILL 4
#define SIGQUIT 3
#define SIGINT 2
#define SIGHUP 1
#define SIGPIPE 13
#define SIG_DFL 0

BPF_F_TABLE("array", u32, struct exit_event, exit_ring, EXIT_RING_SLOTS, BPF_F_MMAPABLE);
BPF_F_TABLE("array", u32, struct disc_event, disc_ring, DISC_RING_SLOTS, BPF_F_MMAPABLE);

/* Rung when a process loads a GPU library: a record nobody reads (the agent
 * skips them), so that poll(2) on the map wakes an idle agent at once
 * instead of it waking every 200 ms to look. */
BPF_RINGBUF_OUTPUT(disc_bell, 1);

/* tgid -> the last object of its list looked at: each dlopen reads the names
 * of the objects it added only (a Python import dlopens hundreds, one at a
 * time).  Forgotten at exec, exit, and before a dlclose (the object may be
 * the one removed: the list is read again from its head). */
BPF_TABLE("lru_hash", u32, u64, disc_tail, MAX_TRACKED);

/* tgid -> 1: tracked processes whose end has begun (libc _exit, or a fatal
 * signal delivered with its default action).  The kernel then kills the other
 * threads of the group with SIGKILL (zap_other_threads; signal_deliver fires
 * for each of them): those are the consequence of the end, not its cause, and
 * are not recorded.  Forgotten when the group dies. */
BPF_TABLE("lru_hash", u32, u8, exiting, MAX_TRACKED);

static __always_inline int already_exiting(u32 tgid)
{
	return exiting.lookup(&tgid) != NULL;
}

static __always_inline void mark_exiting(u32 tgid)
{
	u8 one = 1;
	exiting.update(&tgid, &one);
}

static __always_inline struct exit_event *claim_exit(u64 *pos)
{
	*pos = claim_position(RING_EXIT);
	u32 slot = slot_of(*pos, EXIT_RING_SLOTS);
	struct exit_event *row = *pos ? exit_ring.lookup(&slot) : NULL;
	if (!row)
		count_drop(RING_EXIT);
	return row;
}

/* Signals whose default action terminates the process (a bit mask: BPF has
 * no jump tables). */
#define FATAL_SIGNALS                                                          \
	((1ULL << SIGHUP) | (1ULL << SIGINT) | (1ULL << SIGQUIT) |             \
	 (1ULL << SIGILL) | (1ULL << SIGABRT) | (1ULL << SIGBUS) |             \
	 (1ULL << SIGFPE) | (1ULL << SIGKILL) | (1ULL << SIGSEGV) |            \
	 (1ULL << SIGPIPE) | (1ULL << SIGTERM))

static __always_inline int kills_by_default(int sig)
{
	return sig > 0 && sig < 64 && ((FATAL_SIGNALS >> sig) & 1);
}

static __always_inline void emit_exit(u32 tgid, u32 tid, s32 code, s32 sig, u8 kind)
{
	struct exit_event *e;
	u64 pos;
	e = claim_exit(&pos);
	if (!e)
		return;
	fill_header(&e->hdr, EVENT_EXIT, sizeof(*e), tgid, tid, bpf_ktime_get_ns());
	e->code = code;
	e->signal = sig;
	e->event = kind;
	__builtin_memset(e->_pad1, 0, sizeof(e->_pad1));
	publish(&e->hdr, pos);
}

/* uprobe on libc's _exit(status): every glibc exit path ends there (exit(),
 * returning from main, os._exit).  Not the syscalls:sys_enter_exit_group
 * tracepoint: enabling any syscall tracepoint sends every task's syscalls
 * through the slow path, uretprobe returns included (they are a syscall on
 * x86-64), which costs each NCCL call about a microsecond. */
int handle_libc_exit(struct pt_regs *ctx)
{
	u64 id = bpf_get_current_pid_tgid();
	u32 tgid = id >> 32;
	if (!is_tracked(tgid))
		return 0;
	mark_exiting(tgid);
	emit_exit(tgid, (u32)id, (s32)PT_REGS_PARM1(ctx), 0, EXITEV_EXIT_GROUP);
	return 0;
}

/* The target is a thread id; a signal to a process is usually sent to its
 * main thread, whose tid is the tgid.  A signal sent to a process already
 * ending changes nothing. */
TRACEPOINT_PROBE(signal, signal_generate)
{
	u32 target = args->pid;
	if (!kills_by_default(args->sig) || !is_tracked(target) || already_exiting(target))
		return 0;
	emit_exit(target, target, -1, args->sig, EXITEV_SIGNAL);
	return 0;
}

/* In the target's context: fatal when the default action applies.  Only the
 * first fatal delivery of a group counts: the SIGKILLs that follow exit() or
 * a fatal signal in another thread are the kernel ending the group. */
TRACEPOINT_PROBE(signal, signal_deliver)
{
	u64 id = bpf_get_current_pid_tgid();
	u32 tgid = id >> 32;
	if (args->sa_handler != SIG_DFL || !kills_by_default(args->sig))
		return 0;
	if (!is_tracked(tgid) || already_exiting(tgid))
		return 0;
	mark_exiting(tgid);
	emit_exit(tgid, (u32)id, -1, args->sig, EXITEV_SIGNAL);
	return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exit)
{
	u64 id = bpf_get_current_pid_tgid();
	u32 tgid = id >> 32;
	/* A thread that dies inside an NCCL call frees its slot (nccl.c). */
	struct call_state *slot = inflight_slot((u32)id);
	if (slot && slot->tid == (u32)id)
		release_slot(slot);
	if (!args->group_dead)
		return 0;
	disc_tail.delete(&tgid); /* its pid may be another process's next */
	if (is_tracked(tgid)) {
		emit_exit(tgid, (u32)id, -1, 0, EXITEV_PROCESS_EXIT);
		exiting.delete(&tgid);
	}
	return 0;
}

/* tgid -> when its last DISC_LINKMAP row was written: a process loading
 * hundreds of libraries in a row (a Python import) writes one row per
 * DISC_PERIOD_NS, not one per library.  The agent looks at a process more
 * than DISC_PERIOD_NS after a row, so a library loaded in a skipped call is
 * still seen. */
#define DISC_PERIOD_NS 100000000ULL
BPF_TABLE("lru_hash", u32, u64, disc_last, MAX_TRACKED);

static __always_inline int disc_too_soon(u32 tgid, u64 now)
{
	u64 *last = disc_last.lookup(&tgid);
	if (last && now - *last < DISC_PERIOD_NS)
		return 1;
	disc_last.update(&tgid, &now);
	return 0;
}

/* 1 when a row was written. */
static __always_inline int emit_discovery(u32 event)
{
	u64 id = bpf_get_current_pid_tgid();
	u32 tgid = id >> 32;
	if (is_excluded(tgid))
		return 0;
	u64 now = bpf_ktime_get_ns();
	if (event == DISC_LINKMAP && (is_tracked(tgid) || disc_too_soon(tgid, now)))
		return 0; /* a rank already recorded: its libraries are attached */
	u64 pos = claim_position(RING_DISC);
	u32 slot = slot_of(pos, DISC_RING_SLOTS);
	struct disc_event *e = pos ? disc_ring.lookup(&slot) : NULL;
	if (!e)
		return 0; /* the agent notices a lost row by the head and scans /proc */
	fill_header(&e->hdr, EVENT_DISC, sizeof(*e), tgid, (u32)id, now);
	e->event = event;
	e->_pad1 = 0;
	publish(&e->hdr, pos);
	return 1;
}

TRACEPOINT_PROBE(sched, sched_process_exec)
{
	u32 tgid = bpf_get_current_pid_tgid() >> 32;
	disc_tail.delete(&tgid); /* a new image: a new list of objects */
	emit_discovery(DISC_EXEC);
	return 0;
}

/* <link.h>: the loader's struct r_debug (glibc's _r_debug) and the head of
 * each struct link_map; both stable since glibc 2.0. */
struct r_debug_head {
	s32 r_version;
	u64 r_map;   /* struct link_map *: the first loaded object */
	u64 r_brk;   /* _dl_debug_state itself */
	s32 r_state; /* RT_* below */
};
struct link_map_head {
	u64 l_addr;
	u64 l_name; /* char *: the path the object was loaded from */
	u64 l_ld;
	u64 l_next;
};
#define RT_CONSISTENT 0 /* the list is complete: the objects are mapped */
#define RT_ADD 1        /* objects are about to be added */
#define RT_DELETE 2     /* objects are about to be removed */

#define DISC_NAME_MAX 256 /* a power of two: indexes are masked with it */
#define DISC_FILE_MAX 48  /* file names searched for (libcudart.so.12.4.127: 21) */
#define DISC_WALK 32      /* new objects read per call; more: a row, the agent reads the maps */
struct disc_name {
	char s[DISC_NAME_MAX];
	u64 base; /* where the file name starts */
};
BPF_PERCPU_ARRAY(disc_name_buf, struct disc_name, 1);

/* The file name part starts with libnccl.so or libcudart.so. */
static __always_inline int gpu_library_at(const char *s, u32 base)
{
	char c[13];
#pragma unroll
	for (int k = 0; k < 13; k++)
		c[k] = s[(base + k) & (DISC_NAME_MAX - 1)];
	if (c[0] != 'l' || c[1] != 'i' || c[2] != 'b')
		return 0;
	if (c[3] == 'n' && c[4] == 'c' && c[5] == 'c' && c[6] == 'l' && c[7] == '.' &&
	    c[8] == 's' && c[9] == 'o')
		return 1;
	return c[3] == 'c' && c[4] == 'u' && c[5] == 'd' && c[6] == 'a' && c[7] == 'r' &&
	       c[8] == 't' && c[9] == '.' && c[10] == 's' && c[11] == 'o' && c[12] == '.';
}

/* 1 when an object's path names a GPU library, or cannot be read whole
 * (the agent then reads the maps: no library is missed for a long path). */
static __always_inline int gpu_library(u64 name_ptr)
{
	u32 zero = 0;
	struct disc_name *buf = disc_name_buf.lookup(&zero);
	if (!buf)
		return 1;
	long len = bpf_probe_read_user_str(buf->s, DISC_NAME_MAX, (void *)name_ptr);
	if (len <= 1)
		return 0; /* the main program (""), or nothing there */
	if (len >= DISC_NAME_MAX)
		return 1;
	/* The file name's start goes through memory (volatile): the verifier
	 * then sees one state after the loop, not one per place it stopped.
	 * Only the last DISC_FILE_MAX characters are searched: a longer file
	 * name is no GPU library's, and the verifier walks this loop for each
	 * of DISC_WALK objects at every agent start (8 times the work with the
	 * whole path). */
	volatile u64 *base = &buf->base;
	*base = DISC_NAME_MAX; /* no '/' found (yet) */
	for (int k = 2; k < DISC_FILE_MAX + 2; k++) {
		int i = (int)len - k; /* len counts the NUL: the last character is len - 2 */
		if (i < 0) {
			*base = 0; /* a bare file name */
			break;
		}
		if (buf->s[i & (DISC_NAME_MAX - 1)] == '/') {
			*base = i + 1;
			break;
		}
	}
	if (*base == DISC_NAME_MAX)
		return 0; /* a file name longer than any GPU library's */
	return gpu_library_at(buf->s, *base);
}

/* Whether the objects added since the last look include a GPU library; the
 * list's new tail is remembered.  1 also when the list cannot be read or is
 * longer than DISC_WALK past the last look. */
static __always_inline int added_gpu_library(u32 tgid, struct r_debug_head *rd)
{
	struct link_map_head lm = {};
	u64 *tail = disc_tail.lookup(&tgid);
	u64 at = rd->r_map, last = 0;
	if (tail && *tail) {
		if (bpf_probe_read_user(&lm, sizeof(lm), (void *)*tail))
			return 1;
		last = *tail;
		at = lm.l_next;
	}
	for (int k = 0; k < DISC_WALK && at; k++) {
		if (bpf_probe_read_user(&lm, sizeof(lm), (void *)at))
			return 1;
		if (gpu_library(lm.l_name)) {
			disc_tail.update(&tgid, &at); /* its next dlopen does not find it again */
			return 1;
		}
		last = at;
		at = lm.l_next;
	}
	if (last)
		disc_tail.update(&tgid, &last);
	return at != 0;
}

/* uprobe_multi on ld.so's _dl_debug_state (user space attaches it to each
 * dynamic loader it finds).  The attach cookie is the distance from
 * _dl_debug_state to the loader's _r_debug in its ELF file; 0 where it is
 * not known (or on the perf-event fallback): then every call of a process
 * not recorded yet writes a row, as many as DISC_PERIOD_NS lets through. */
int handle_dl_state(struct pt_regs *ctx)
{
	u64 distance = bpf_get_attach_cookie(ctx);
	if (distance) {
		u32 tgid = bpf_get_current_pid_tgid() >> 32;
		if (is_excluded(tgid) || is_tracked(tgid))
			return 0;
		struct r_debug_head rd = {};
		u64 at = bpf_get_func_ip(ctx) + distance;
		if (!bpf_probe_read_user(&rd, sizeof(rd), (void *)at)) {
			if (rd.r_state == RT_DELETE)
				disc_tail.delete(&tgid);
			if (rd.r_state != RT_CONSISTENT || !added_gpu_library(tgid, &rd))
				return 0;
		}
	}
	if (emit_discovery(DISC_LINKMAP) && distance) {
		u8 ring = 1; /* (unfiltered rows, without a distance, are read each second) */
		disc_bell.ringbuf_output(&ring, sizeof(ring), 0);
	}
	return 0;
}

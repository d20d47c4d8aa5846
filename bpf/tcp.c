/* The job's TCP evidence, decided in the kernel: retransmits (with the
 * connection's state), resets and state changes of the job's sockets only.
 *
 * A socket is the job's when its owner is a tracked process, when it is one
 * of the job's connections (`job_conns`, by both ends: user space seeds the
 * connections a tracked process already holds), or when either end is a
 * job listener (`job_endpoints`: the programs add a tracked listener's, user
 * space every listener of a tracked process).  A connected socket is never
 * known by its local end alone: under a neighbour's churn the kernel hands
 * one ephemeral port to connections of other processes to other peers.
 * Everything else is counted (DROP_TCP_FILTERED) and never written, so that
 * no neighbour on the machine (a data loader opening thousands of
 * connections a second) can evict the job's rows from the ring; but a
 * retransmit of another connection to a host the job talks to (`job_peers`:
 * the far ends of the job's connections) is kept as a sample, at most one a
 * second per pair of addresses (`other_sampled`): other traffic failing to
 * reach a host is evidence of that host's network, where the job's own
 * connections to it carried nothing when its link went.
 *
 * Owners: retransmits fire in softirq context, where the current pid means
 * nothing, so `sock_owner` (socket address -> tgid) is learned where a
 * tracked process itself touches the socket: sock_send_length /
 * sock_recv_length (process context) and inet_sock_set_state to SYN_SENT
 * (connect) or LISTEN.  A connection accepted on a tracked listener's port
 * gets the listener's owner when it is born (softirq).  Entries are
 * forgotten when the socket closes.
 *
 * Connection state: the sock_ops program (attached to the cgroup v2 root:
 * every socket of the machine) asks the kernel for retransmission-timeout
 * and retransmit callbacks on every established socket; for the job's, it
 * keeps in `conn_state` what the kernel says there (RTO and the timeouts in
 * a row, smoothed RTT, bytes unacknowledged, segments out), and the
 * retransmit row copies it: __tcp_retransmit_skb calls the callback first
 * and the tracepoint right after it (the timeout's callback comes before
 * both).  A retransmit that fails early reaches the tracepoint alone: its
 * row says the state as last seen.  Only the
 * sock_ops context is read: no kernel struct by pointer.  "Nothing
 * acknowledged for at least" is a lower bound: the last acknowledgement
 * came before the first timeout of a run of timeouts minus its RTO, and
 * before the first moment snd_una was seen where it still is.  Sockets
 * established before the program was attached get no callbacks: their rows
 * carry no connection state (conn_known 0).
 *
 * The agent's own connections (its HTTP surface, its requests to peers) are
 * not the job's: `agent_self` names the agent's process and listening port.
 *
 * Attachment: raw tracepoints (TCP_RAW_TP, where the kernel's BTF gives the
 * struct offsets the programs read), which the kernel skips only when a
 * program would run inside itself; else tracepoints, which it skips while
 * any other tracing program runs on the CPU.  Both see the same events and
 * write the same rows.
 */
#include "common.h"

#define MAX_SOCKETS 16384
#define MAX_ENDPOINTS 4096
#define MAX_CONNS 4096
#define AF_INET 2
#define AF_INET6 10
#define IPPROTO_TCP 6
#define TCP_SYN_SENT 2
#define TCP_SYN_RECV 3
#define TCP_CLOSE 7
#define TCP_LISTEN 10
/* Tracepoint fields (raw tracepoints: arguments) only some kernels have
 * (the agent reads their format, or the kernel's BTF): the retransmit's
 * result (6.12+), a reset's reason (6.10+), whose enum the build machine's
 * older headers may not define (the tracepoint's struct names it). */
#if defined(TP_SEND_RESET_REASON) && !defined(TCP_RAW_TP)
#include <linux/version.h>
#if LINUX_VERSION_CODE < KERNEL_VERSION(6, 10, 0)
enum sk_rst_reason { SK_RST_REASON_NOT_SPECIFIED };
#else
#include <net/rstreason.h>
#endif
#endif
#ifndef KERNEL_HZ
#define KERNEL_HZ 0 /* unknown: RTOs (in jiffies) are not converted */
#endif

BPF_F_TABLE("array", u32, struct tcp_event, tcp_ring, TCP_RING_SLOTS, BPF_F_MMAPABLE);

static __always_inline struct tcp_event *claim_tcp(u64 *pos)
{
	*pos = claim_position(RING_TCP);
	u32 slot = slot_of(*pos, TCP_RING_SLOTS);
	struct tcp_event *row = *pos ? tcp_ring.lookup(&slot) : NULL;
	if (!row)
		count_drop(RING_TCP);
	return row;
}
BPF_HASH(sock_owner, u64, u32, MAX_SOCKETS);

/* An address and port of one end (addr: IPv4 in the first 4 bytes). */
struct endpoint {
	u8 addr[16];
	u16 port;
	u16 family;
	u32 _pad;
};
/* -> the tracked process that listens there */
BPF_HASH(job_endpoints, struct endpoint, u32, MAX_ENDPOINTS);

/* A connection by both ends, as its socket has them (local first). */
struct conn_key {
	u8 laddr[16];
	u8 raddr[16];
	u16 lport;
	u16 rport;
	u16 family;
	u16 _pad;
};
/* -> the tracked process that holds it */
BPF_HASH(job_conns, struct conn_key, u32, MAX_ENDPOINTS);

/* Far-end addresses of the job's connections -> 1 */
struct peer_addr {
	u8 addr[16];
	u16 family;
	u16 _pad[3];
};
BPF_TABLE("lru_hash", struct peer_addr, u32, job_peers, MAX_ENDPOINTS);
/* (this end, the far end) of other connections -> when one was last sampled */
struct addr_pair {
	u8 local[16];
	u8 remote[16];
	u16 family;
	u16 _pad[3];
};
BPF_TABLE("lru_hash", struct addr_pair, u64, other_sampled, MAX_ENDPOINTS);
#define OTHER_SAMPLE_NS 1000000000ULL

struct conn {
	u64 una_since_ns;   /* when snd_una was first seen where it is */
	u64 rto_run_ns;     /* a run of timeouts: nothing acknowledged since */
	u32 snd_una;
	u32 srtt_us;
	u32 rto_us;
	u32 unacked;
	u32 packets_out;
	u32 retrans_out;
	u8 backoff;         /* timeouts in a row */
	u8 known;           /* the sock_ops program has seen it */
	u8 _pad[6];
};
BPF_TABLE("lru_hash", u64, struct conn, conn_state, MAX_CONNS);

struct agent_self {
	u32 tgid; /* the agent's process, 0 = none */
	u32 port; /* its listening port, 0 = none */
};
BPF_ARRAY(agent_self, struct agent_self, 1);

static __always_inline int own_traffic(u32 owner, u16 sport, u16 dport)
{
	u32 zero = 0;
	struct agent_self *me = agent_self.lookup(&zero);
	if (!me)
		return 0;
	if (me->tgid && owner == me->tgid)
		return 1;
	return me->port && (sport == me->port || dport == me->port);
}

/* A socket a tracked process touches in its own context is its. */
static __always_inline void remember_owner(u64 skaddr, u32 tgid)
{
	u32 *known = sock_owner.lookup(&skaddr);
	if (known && *known == tgid)
		return;
	if (sock_owner.update(&skaddr, &tgid))
		count_drop(DROP_OWNER_FULL);
}

/* Only a tracked process's sockets: a neighbour's sends cost one lookup. */
static __always_inline void learn_owner(u64 skaddr)
{
	u32 tgid = bpf_get_current_pid_tgid() >> 32;
	if (tgid && is_tracked(tgid))
		remember_owner(skaddr, tgid);
}

static __always_inline u32 owner_of(u64 skaddr)
{
	u32 *pid = skaddr ? sock_owner.lookup(&skaddr) : NULL;
	return pid ? *pid : 0;
}

/* What a hook knows of its socket, however it is attached: the socket's
 * address, both ends as the tracepoints have them (this end is inet_sport
 * and inet_saddr, the far end inet_dport and inet_daddr; IPv6: the
 * socket's v6 addresses), and the state, where the hook has one. */
struct sock_view {
	u64 skaddr;
	struct endpoint local;
	struct endpoint remote;
	int state;
	int _pad;
};

static __always_inline u32 endpoint_owner(struct endpoint *ep)
{
	u32 *pid = job_endpoints.lookup(ep);
	return pid ? *pid : 0;
}

/* The job's process behind a connection (its owner, else the tracked
 * process at either end), 0 if it is not the job's. */
static __always_inline u32 conn_owner(struct endpoint *local, struct endpoint *remote)
{
	struct conn_key key = {};
	__builtin_memcpy(key.laddr, local->addr, 16);
	__builtin_memcpy(key.raddr, remote->addr, 16);
	key.lport = local->port;
	key.rport = remote->port;
	key.family = local->family;
	u32 *pid = job_conns.lookup(&key);
	return pid ? *pid : 0;
}

static __always_inline u32 job_of(u32 owner, struct endpoint *local, struct endpoint *remote)
{
	if (owner && is_tracked(owner))
		return owner;
	u32 pid = conn_owner(local, remote);
	if (pid)
		return pid;
	pid = endpoint_owner(local);
	if (!pid)
		pid = endpoint_owner(remote);
	if (pid)
		return pid;
	/* accepted on a listener of every address (0.0.0.0, ::) */
	struct endpoint any = {};
	any.port = local->port;
	any.family = local->family;
	return endpoint_owner(&any);
}

static __always_inline void count_filtered(void)
{
	count_drop(DROP_TCP_FILTERED);
}

/* A row's header, addresses and ports. */
static __always_inline void fill_row(struct tcp_event *e, struct sock_view *v, u8 kind, u32 pid)
{
	u64 id = bpf_get_current_pid_tgid();
	fill_header(&e->hdr, EVENT_TCP, sizeof(*e), pid, (u32)id, bpf_ktime_get_ns());
	e->skaddr = v->skaddr;
	__builtin_memcpy(e->saddr, v->local.addr, 16);
	__builtin_memcpy(e->daddr, v->remote.addr, 16);
	e->sport = v->local.port;
	e->dport = v->remote.port;
	e->family = v->local.family;
	e->event = kind;
}

/* The fields after the addresses, unknown until someone knows them. */
static __always_inline void clear_tail(struct tcp_event *e)
{
	e->backoff = 0;
	e->state = 0;
	e->newstate = 0;
	e->no_ack_ns = 0;
	e->srtt_us = 0;
	e->rto_us = 0;
	e->unacked = 0;
	e->packets_out = 0;
	e->retrans_out = 0;
	e->reason = 0;
	e->conn_known = 0;
	e->other = 0;
	e->err = 0;
	e->_pad2 = 0;
}

static __always_inline u64 no_ack_for(struct conn *c, u64 now)
{
	u64 since = c->una_since_ns;
	if (c->backoff && c->rto_run_ns && c->rto_run_ns < since)
		since = c->rto_run_ns;
	return since && now > since ? now - since : 0;
}

static __always_inline void copy_conn(struct tcp_event *e, struct conn *c, u64 now)
{
	e->backoff = c->backoff;
	e->no_ack_ns = no_ack_for(c, now);
	e->srtt_us = c->srtt_us;
	e->rto_us = c->rto_us;
	e->unacked = c->unacked;
	e->packets_out = c->packets_out;
	e->retrans_out = c->retrans_out;
	e->conn_known = 1;
}

static __always_inline void note_peer(struct endpoint *remote)
{
	struct peer_addr key = {};
	__builtin_memcpy(key.addr, remote->addr, 16);
	key.family = remote->family;
	u32 one = 1;
	job_peers.update(&key, &one);
}

/* Whether a retransmit of another connection is sampled: its far end is a
 * host the job talks to, and its pair of addresses had none this second. */
static __always_inline int sample_other(struct endpoint *local, struct endpoint *remote, u64 now)
{
	struct peer_addr peer = {};
	__builtin_memcpy(peer.addr, remote->addr, 16);
	peer.family = remote->family;
	if (!job_peers.lookup(&peer))
		return 0;
	struct addr_pair pair = {};
	__builtin_memcpy(pair.local, local->addr, 16);
	__builtin_memcpy(pair.remote, remote->addr, 16);
	pair.family = local->family;
	u64 *last = other_sampled.lookup(&pair);
	if (last && now - *last < OTHER_SAMPLE_NS)
		return 0;
	other_sampled.update(&pair, &now);
	return 1;
}

/* A sampled retransmit of another connection: no owner, no state. */
static __always_inline void write_other(struct sock_view *v)
{
	u64 pos;
	struct tcp_event *e = claim_tcp(&pos);
	if (!e)
		return;
	fill_row(e, v, TCPEV_TCP_RETRANSMIT_SKB, 0);
	clear_tail(e);
	e->state = v->state;
	e->other = 1;
	publish(&e->hdr, pos);
}

static __always_inline void on_retransmit_skb(struct sock_view *v, int err)
{
	u32 owner = owner_of(v->skaddr);
	if (own_traffic(owner, v->local.port, v->remote.port))
		return;
	u32 pid = job_of(owner, &v->local, &v->remote);
	if (!pid) {
		count_filtered();
		if (sample_other(&v->local, &v->remote, bpf_ktime_get_ns()))
			write_other(v);
		return;
	}
	note_peer(&v->remote);
	u64 pos;
	struct tcp_event *e = claim_tcp(&pos);
	if (!e)
		return;
	fill_row(e, v, TCPEV_TCP_RETRANSMIT_SKB, pid);
	clear_tail(e);
	e->state = v->state;
	e->err = err;
	u64 skaddr = v->skaddr;
	struct conn *c = conn_state.lookup(&skaddr);
	if (c && c->known) /* the callbacks of this retransmit came first */
		copy_conn(e, c, e->hdr.ts_ns);
	publish(&e->hdr, pos);
}

static __always_inline void on_send_reset(struct sock_view *v, u16 reason)
{
	u32 owner = owner_of(v->skaddr);
	if (own_traffic(owner, v->local.port, v->remote.port))
		return;
	u32 pid = job_of(owner, &v->local, &v->remote);
	if (!pid) {
		count_filtered();
		return;
	}
	u64 pos;
	struct tcp_event *e = claim_tcp(&pos);
	if (!e)
		return;
	fill_row(e, v, TCPEV_TCP_SEND_RESET, pid);
	clear_tail(e);
	e->state = v->state;
	e->reason = reason;
	publish(&e->hdr, pos);
}

static __always_inline void on_receive_reset(struct sock_view *v)
{
	u32 owner = owner_of(v->skaddr);
	if (own_traffic(owner, v->local.port, v->remote.port))
		return;
	u32 pid = job_of(owner, &v->local, &v->remote);
	if (!pid) {
		count_filtered();
		return;
	}
	u64 pos;
	struct tcp_event *e = claim_tcp(&pos);
	if (!e)
		return;
	fill_row(e, v, TCPEV_TCP_RECEIVE_RESET, pid);
	clear_tail(e);
	publish(&e->hdr, pos);
}

static __always_inline void on_set_state(struct sock_view *v, int oldstate, int newstate)
{
	u64 skaddr = v->skaddr;
	/* Only connect() (-> SYN_SENT) and listen() (-> LISTEN) are sure to run
	 * in the owner's context.  Other changes may run in softirq, in whatever
	 * task was interrupted or sent the packet: over a veth, a rank of
	 * another namespace. */
	if (newstate == TCP_SYN_SENT || newstate == TCP_LISTEN)
		learn_owner(skaddr);
	u32 owner = owner_of(skaddr);
	/* a tracked listener's port is a job endpoint while it listens */
	if (newstate == TCP_LISTEN && owner && is_tracked(owner))
		job_endpoints.update(&v->local, &owner);
	else if (oldstate == TCP_LISTEN && newstate == TCP_CLOSE)
		job_endpoints.delete(&v->local);
	u32 pid = own_traffic(owner, v->local.port, v->remote.port)
			  ? 0
			  : job_of(owner, &v->local, &v->remote);
	if (pid && !owner && oldstate == TCP_SYN_RECV)
		sock_owner.update(&skaddr, &pid); /* accepted on a tracked listener */
	if (newstate == TCP_CLOSE) {
		sock_owner.delete(&skaddr);
		conn_state.delete(&skaddr);
	}
	if (!pid) {
		count_filtered();
		return;
	}
	note_peer(&v->remote);
	u64 pos;
	struct tcp_event *e = claim_tcp(&pos);
	if (!e)
		return;
	fill_row(e, v, TCPEV_INET_SOCK_SET_STATE, pid);
	clear_tail(e);
	e->state = oldstate;
	e->newstate = newstate;
	publish(&e->hdr, pos);
}

#ifdef TCP_RAW_TP
/* ---- raw tracepoints: the kernel's arguments, its structs read here ----
 *
 * A raw tracepoint's program gets the tracepoint's arguments (the socket,
 * the packet), not its fields, and is skipped only when it would run inside
 * itself on a CPU (a tracepoint's program is skipped whenever any tracing
 * program runs there: a softirq's retransmit arriving in the middle of
 * another tool's program is lost).  The fields the tracepoints would have
 * copied are read here, each at its offset in the running kernel's
 * structs, from its BTF (the -D flags SK_*, INET_*, IPV6_*, SKB_*: see
 * recorder/tcp_probes.py), never from the build machine's headers.  Fields
 * close together are read at once: SK_HEAD_* spans family, state, the far
 * end's address and port in struct sock, INET_HEAD_* this end's address
 * and port in struct inet_sock. */
#define TCPF_TIME_WAIT (1 << 6)
#define TCPF_NEW_SYN_RECV (1 << 12)

#define FIELD(buf, base, off, dst) __builtin_memcpy(&(dst), &(buf)[(off) - (base)], sizeof(dst))

static __always_inline void *at(u64 base, u64 off)
{
	return (void *)(base + off);
}

/* This end and the far end of a full socket (family already read). */
static __always_inline void read_ends(struct sock_view *v, u64 sk, u8 *head, u16 family, int v6_pinfo)
{
	u8 inet[INET_HEAD_LEN];
	bpf_probe_read_kernel(inet, sizeof(inet), at(sk, INET_HEAD_OFF));
	u16 sport, dport;
	FIELD(inet, INET_HEAD_OFF, INET_SPORT_OFF, sport);
	FIELD(head, SK_HEAD_OFF, SK_DPORT_OFF, dport);
	v->local.port = bpf_ntohs(sport);
	v->remote.port = bpf_ntohs(dport);
	v->local.family = v->remote.family = family;
	if (family == AF_INET6) {
		if (v6_pinfo) { /* tcp_send_reset: this end from the socket's ipv6_pinfo */
			u64 np = 0;
			bpf_probe_read_kernel(&np, sizeof(np), at(sk, INET_PINET6_OFF));
			if (np)
				bpf_probe_read_kernel(v->local.addr, 16, at(np, IPV6_SADDR_OFF));
		} else {
			bpf_probe_read_kernel(v->local.addr, 16, at(sk, SK_V6_RCV_SADDR_OFF));
		}
		bpf_probe_read_kernel(v->remote.addr, 16, at(sk, SK_V6_DADDR_OFF));
	} else {
		FIELD(inet, INET_HEAD_OFF, INET_SADDR_OFF, *(u32 *)v->local.addr);
		FIELD(head, SK_HEAD_OFF, SK_DADDR_OFF, *(u32 *)v->remote.addr);
	}
}

/* The view of a socket as tcp_retransmit_skb, tcp_receive_reset and
 * inet_sock_set_state have it. */
static __always_inline void read_sock(struct sock_view *v, u64 sk)
{
	__builtin_memset(v, 0, sizeof(*v));
	u8 head[SK_HEAD_LEN];
	bpf_probe_read_kernel(head, sizeof(head), at(sk, SK_HEAD_OFF));
	u16 family;
	u8 state;
	FIELD(head, SK_HEAD_OFF, SK_FAMILY_OFF, family);
	FIELD(head, SK_HEAD_OFF, SK_STATE_OFF, state);
	v->skaddr = sk;
	v->state = state;
	read_ends(v, sk, head, family, 0);
}

static __always_inline u16 sk_protocol(u64 sk)
{
	u16 protocol = 0;
	bpf_probe_read_kernel(&protocol, sizeof(protocol), at(sk, SK_PROTOCOL_OFF));
	return protocol;
}

/* A send or a receive in the process's own context.  Tracked first: a
 * neighbour's sends cost one lookup and no read. */
static __always_inline void learn_sender(u64 sk)
{
	u32 tgid = bpf_get_current_pid_tgid() >> 32;
	if (tgid && is_tracked(tgid) && sk_protocol(sk) == IPPROTO_TCP)
		remember_owner(sk, tgid);
}

/* Hooks that fire both in a process's context and in softirq (PAIR_<event>
 * names them: recorder/tcp_probes.py).  A raw tracepoint's program is
 * skipped when its event comes while it runs on that CPU: a softirq's state
 * change (a peer's FIN or reset, a retransmission timer) in the middle of
 * the same program run for a process's connect or close.  Such a hook has a
 * second program, attached after the first (the kernel runs a tracepoint's
 * programs in the order they were attached), which does the work only for
 * an event the first did not run for.  The first marks, per CPU, that it is
 * running; the kernel skips it only while it runs on that CPU, so the
 * second finds the mark set exactly when the event came in the middle of
 * the first (and counts it in `pair_caught`).  A run the kernel skipped in
 * the instant between the first's start and its mark, or its unmark and
 * its end, is not caught: it stays counted as unseen (misses less caught),
 * never done twice.  A run of the second skipped in turn is one the first
 * was not running for: the first saw it. */
BPF_PERCPU_ARRAY(pair_running, u64, PAIRS);
BPF_PERCPU_ARRAY(pair_caught, u64, PAIRS);

static __always_inline void first_running(u32 pair, u64 running)
{
	u64 *n = pair_running.lookup(&pair);
	if (n)
		*n = running;
}

static __always_inline int first_skipped(u32 pair)
{
	u64 *running = pair_running.lookup(&pair);
	if (!running || !*running)
		return 0;
	u64 *caught = pair_caught.lookup(&pair);
	if (caught)
		*caught += 1;
	return 1;
}

/* A hook's two programs around one body: `RAW_PAIR(event) { body }`. */
#define RAW_PAIR(event)                                                        \
	static __always_inline void on_raw_##event(struct bpf_raw_tracepoint_args *ctx); \
	RAW_TRACEPOINT_PROBE(event)                                            \
	{                                                                      \
		first_running(PAIR_##event, 1);                                \
		on_raw_##event(ctx);                                           \
		first_running(PAIR_##event, 0);                                \
		return 0;                                                      \
	}                                                                      \
	int raw_tracepoint__##event##__nested(struct bpf_raw_tracepoint_args *ctx) \
	{                                                                      \
		if (first_skipped(PAIR_##event))                               \
			on_raw_##event(ctx);                                   \
		return 0;                                                      \
	}                                                                      \
	static __always_inline void on_raw_##event(struct bpf_raw_tracepoint_args *ctx)

RAW_TRACEPOINT_PROBE(sock_send_length)
{
	learn_sender(ctx->args[0]);
	return 0;
}

RAW_TRACEPOINT_PROBE(sock_recv_length)
{
	learn_sender(ctx->args[0]);
	return 0;
}

RAW_PAIR(tcp_retransmit_skb)
{
	struct sock_view v;
	read_sock(&v, ctx->args[0]);
	int err = 0;
#ifdef TP_RETRANSMIT_ERR
	err = (int)ctx->args[2];
#endif
	on_retransmit_skb(&v, err);
}

/* The packet's ends, as tcp_send_reset has them for a reset that answers
 * it (no full socket): reversed, this end is the packet's destination.
 * The IP and TCP headers are the wire's layout, not a kernel struct's. */
static __always_inline void read_packet_ends(struct sock_view *v, u64 skb)
{
	u64 head = 0, data = 0;
	u16 network = 0;
	bpf_probe_read_kernel(&head, sizeof(head), at(skb, SKB_HEAD_OFF));
	bpf_probe_read_kernel(&data, sizeof(data), at(skb, SKB_DATA_OFF));
	bpf_probe_read_kernel(&network, sizeof(network), at(skb, SKB_NETWORK_HEADER_OFF));
	u64 ip = head + network;
	u8 version = 0;
	bpf_probe_read_kernel(&version, 1, at(ip, 0));
	u16 ports[2] = {}; /* source, dest */
	bpf_probe_read_kernel(ports, sizeof(ports), at(data, 0));
	v->local.port = bpf_ntohs(ports[1]);
	v->remote.port = bpf_ntohs(ports[0]);
	if (version >> 4 == 6) {
		v->local.family = v->remote.family = AF_INET6;
		bpf_probe_read_kernel(v->remote.addr, 16, at(ip, 8));
		bpf_probe_read_kernel(v->local.addr, 16, at(ip, 24));
	} else {
		v->local.family = v->remote.family = AF_INET;
		bpf_probe_read_kernel(v->remote.addr, 4, at(ip, 12));
		bpf_probe_read_kernel(v->local.addr, 4, at(ip, 16));
	}
}

RAW_PAIR(tcp_send_reset)
{
	u64 sk = ctx->args[0], skb = ctx->args[1];
	struct sock_view v;
	__builtin_memset(&v, 0, sizeof(v));
	v.skaddr = sk;
	int full = 0;
	u8 head[SK_HEAD_LEN];
	u16 family = 0;
	if (sk) {
		u8 state;
		bpf_probe_read_kernel(head, sizeof(head), at(sk, SK_HEAD_OFF));
		FIELD(head, SK_HEAD_OFF, SK_STATE_OFF, state);
		FIELD(head, SK_HEAD_OFF, SK_FAMILY_OFF, family);
		v.state = state;
		full = !((1 << state) & (TCPF_TIME_WAIT | TCPF_NEW_SYN_RECV));
	}
	if (full)
		read_ends(&v, sk, head, family == AF_INET6 ? AF_INET6 : AF_INET, 1);
	else if (skb)
		read_packet_ends(&v, skb);
	u16 reason = 0;
#ifdef TP_SEND_RESET_REASON
	reason = (u16)ctx->args[2];
#endif
	on_send_reset(&v, reason);
}

RAW_PAIR(tcp_receive_reset)
{
	struct sock_view v;
	read_sock(&v, ctx->args[0]);
	on_receive_reset(&v);
}

RAW_PAIR(inet_sock_set_state)
{
	u64 sk = ctx->args[0];
	if (sk_protocol(sk) != IPPROTO_TCP)
		return;
	struct sock_view v;
	read_sock(&v, sk);
	on_set_state(&v, (int)ctx->args[1], (int)ctx->args[2]);
}

#else
/* ---- tracepoints: the fields the kernel copied out (kernels without BTF) ---- */

/* A tracepoint's socket (a macro: the verifier takes tracepoint arguments
 * only at constant offsets of its context). */
#define VIEW_OF(a, v)                                                          \
	do {                                                                   \
		__builtin_memset(&(v), 0, sizeof(v));                          \
		(v).skaddr = (u64)(a)->skaddr;                                 \
		if ((a)->family == AF_INET) {                                  \
			__builtin_memcpy((v).local.addr, (a)->saddr, 4);       \
			__builtin_memcpy((v).remote.addr, (a)->daddr, 4);      \
		} else {                                                       \
			__builtin_memcpy((v).local.addr, (a)->saddr_v6, 16);   \
			__builtin_memcpy((v).remote.addr, (a)->daddr_v6, 16);  \
		}                                                              \
		(v).local.port = (a)->sport;                                   \
		(v).remote.port = (a)->dport;                                  \
		(v).local.family = (v).remote.family = (a)->family;            \
	} while (0)

/* One end of a reset: its `sa` field is a sockaddr_in or sockaddr_in6
 * (family, port in network order, address); a macro, as VIEW_OF. */
#define SOCKADDR_ENDPOINT(ep, sa)                                              \
	do {                                                                   \
		(ep).family = (sa)[0] | ((u16)(sa)[1] << 8);                   \
		(ep).port = ((u16)(sa)[2] << 8) | (sa)[3];                     \
		if ((ep).family == AF_INET)                                    \
			__builtin_memcpy((ep).addr, &(sa)[4], 4);              \
		else                                                           \
			__builtin_memcpy((ep).addr, &(sa)[8], 16);             \
	} while (0)

TRACEPOINT_PROBE(sock, sock_send_length)
{
	if (args->protocol == IPPROTO_TCP)
		learn_owner((u64)args->sk);
	return 0;
}

TRACEPOINT_PROBE(sock, sock_recv_length)
{
	if (args->protocol == IPPROTO_TCP)
		learn_owner((u64)args->sk);
	return 0;
}

TRACEPOINT_PROBE(tcp, tcp_retransmit_skb)
{
	struct sock_view v;
	VIEW_OF(args, v);
	v.state = args->state;
	int err = 0;
#ifdef TP_RETRANSMIT_ERR
	err = args->err;
#endif
	on_retransmit_skb(&v, err);
	return 0;
}

TRACEPOINT_PROBE(tcp, tcp_send_reset)
{
	struct sock_view v;
	__builtin_memset(&v, 0, sizeof(v));
	v.skaddr = (u64)args->skaddr;
	SOCKADDR_ENDPOINT(v.local, args->saddr);
	SOCKADDR_ENDPOINT(v.remote, args->daddr);
	v.state = args->state;
	u16 reason = 0;
#ifdef TP_SEND_RESET_REASON
	reason = (u16)args->reason;
#endif
	on_send_reset(&v, reason);
	return 0;
}

TRACEPOINT_PROBE(tcp, tcp_receive_reset)
{
	struct sock_view v;
	VIEW_OF(args, v);
	on_receive_reset(&v);
	return 0;
}

TRACEPOINT_PROBE(sock, inet_sock_set_state)
{
	if (args->protocol != IPPROTO_TCP)
		return 0;
	struct sock_view v;
	VIEW_OF(args, v);
	on_set_state(&v, args->oldstate, args->newstate);
	return 0;
}
#endif

/* ---- sock_ops: the connection's state at retransmits -------------------- */

#define SOCK_OPS_FLAGS (BPF_SOCK_OPS_RTO_CB_FLAG | BPF_SOCK_OPS_RETRANS_CB_FLAG)

static __always_inline u32 job_of_sockops(struct bpf_sock_ops *skops, u64 skaddr)
{
	struct endpoint local = {}, remote = {};
	u16 family = skops->family;
	local.family = remote.family = family;
	local.port = skops->local_port;
	remote.port = bpf_ntohs(skops->remote_port >> 16);
	if (family == AF_INET) {
		u32 l4 = skops->local_ip4, r4 = skops->remote_ip4;
		__builtin_memcpy(local.addr, &l4, 4);
		__builtin_memcpy(remote.addr, &r4, 4);
	} else {
		/* the verifier takes these context fields 4 bytes at a time only */
		u32 l6[4], r6[4];
#pragma unroll
		for (int i = 0; i < 4; i++) {
			l6[i] = *(volatile u32 *)&skops->local_ip6[i];
			r6[i] = *(volatile u32 *)&skops->remote_ip6[i];
		}
		__builtin_memcpy(local.addr, l6, 16);
		__builtin_memcpy(remote.addr, r6, 16);
	}
	u32 owner = owner_of(skaddr);
	if (own_traffic(owner, local.port, remote.port))
		return 0;
	return job_of(owner, &local, &remote);
}

static __always_inline void read_conn(struct conn *c, struct bpf_sock_ops *skops, u64 now)
{
	u32 una = skops->snd_una;
	if (!c->known || una != c->snd_una) {
		c->snd_una = una;
		c->una_since_ns = now;
	}
	c->srtt_us = skops->srtt_us >> 3;
	c->unacked = skops->snd_nxt - una;
	c->packets_out = skops->packets_out;
	c->retrans_out = skops->retrans_out;
	c->known = 1;
}

/* A retransmission timeout: args[0] the timeouts in a row before this one
 * (icsk_retransmits), args[1] the RTO that expired (jiffies). */
static __always_inline void on_timeout(struct bpf_sock_ops *skops, u64 skaddr, u64 now)
{
	if (!job_of_sockops(skops, skaddr))
		return;
	struct conn fresh = {};
	struct conn *c = conn_state.lookup_or_try_init(&skaddr, &fresh);
	if (!c) {
		count_drop(DROP_CONN_FULL);
		return;
	}
	u32 before = skops->args[0];
	u64 rto_ns = KERNEL_HZ ? (u64)skops->args[1] * (1000000000ULL / KERNEL_HZ) : 0;
	if (before == 0 || !c->rto_run_ns)
		c->rto_run_ns = now > rto_ns ? now - rto_ns : now;
	c->backoff = before + 1 > 255 ? 255 : before + 1;
	c->rto_us = rto_ns / 1000;
	read_conn(c, skops, now);
}

/* Right before the retransmit tracepoint: what the row it writes will say.
 * A retransmit with no timeout before it (a tail loss probe, a fast
 * retransmit) may be the first the program hears of a connection. */
static __always_inline void on_retransmit(struct bpf_sock_ops *skops, u64 skaddr, u64 now)
{
	struct conn *c = conn_state.lookup(&skaddr);
	if (!c) {
		if (!job_of_sockops(skops, skaddr))
			return;
		struct conn fresh = {};
		c = conn_state.lookup_or_try_init(&skaddr, &fresh);
		if (!c) {
			count_drop(DROP_CONN_FULL);
			return;
		}
	} else if (skops->snd_una != c->snd_una) {
		c->backoff = 0; /* acknowledged since the last timeout */
	}
	read_conn(c, skops, now);
}

int handle_sock_ops(struct bpf_sock_ops *skops)
{
	u32 op = skops->op;
	if (op == BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB || op == BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB) {
		bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags | SOCK_OPS_FLAGS);
		return 1;
	}
	if (op != BPF_SOCK_OPS_RTO_CB && op != BPF_SOCK_OPS_RETRANS_CB)
		return 1;
	struct bpf_sock *sk = skops->sk;
	if (!sk)
		return 1;
	u64 skaddr = (u64)sk;
	u64 now = bpf_ktime_get_ns();
	if (op == BPF_SOCK_OPS_RTO_CB)
		on_timeout(skops, skaddr, now);
	else
		on_retransmit(skops, skaddr, now);
	return 1;
}

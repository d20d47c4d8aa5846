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
/* Tracepoint fields only some kernels have (the agent reads their format):
 * the retransmit's result (6.12+), a reset's reason (6.10+), whose enum the
 * build machine's older headers may not define. */
#ifdef TP_SEND_RESET_REASON
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

/* Only a tracked process's sockets: a neighbour's sends cost one lookup. */
static __always_inline void learn_owner(u64 skaddr)
{
	u32 tgid = bpf_get_current_pid_tgid() >> 32;
	if (!tgid || !is_tracked(tgid))
		return;
	u32 *known = sock_owner.lookup(&skaddr);
	if (known && *known == tgid)
		return;
	if (sock_owner.update(&skaddr, &tgid))
		count_drop(DROP_OWNER_FULL);
}

static __always_inline u32 owner_of(u64 skaddr)
{
	u32 *pid = skaddr ? sock_owner.lookup(&skaddr) : NULL;
	return pid ? *pid : 0;
}

/* Both ends of a tracepoint's connection (a macro: the verifier takes
 * tracepoint arguments only at constant offsets of its context). */
#define ENDPOINTS_OF(a, local, remote)                                         \
	do {                                                                   \
		__builtin_memset(&(local), 0, sizeof(local));                  \
		__builtin_memset(&(remote), 0, sizeof(remote));                \
		if ((a)->family == AF_INET) {                                  \
			__builtin_memcpy((local).addr, (a)->saddr, 4);         \
			__builtin_memcpy((remote).addr, (a)->daddr, 4);        \
		} else {                                                       \
			__builtin_memcpy((local).addr, (a)->saddr_v6, 16);     \
			__builtin_memcpy((remote).addr, (a)->daddr_v6, 16);    \
		}                                                              \
		(local).port = (a)->sport;                                     \
		(remote).port = (a)->dport;                                    \
		(local).family = (remote).family = (a)->family;                \
	} while (0)

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

/* Common part of the tracepoints with a 4-tuple: header, addresses, ports. */
#define FILL_TCP_ROW(e, a, kind, pid)                                          \
	do {                                                                   \
		u64 __id = bpf_get_current_pid_tgid();                         \
		fill_header(&(e)->hdr, EVENT_TCP, sizeof(*(e)), (pid),         \
			    (u32)__id, bpf_ktime_get_ns());                    \
		(e)->skaddr = (u64)(a)->skaddr;                                \
		if ((a)->family == AF_INET) {                                  \
			__builtin_memset((e)->saddr, 0, 16);                   \
			__builtin_memset((e)->daddr, 0, 16);                   \
			__builtin_memcpy((e)->saddr, (a)->saddr, 4);           \
			__builtin_memcpy((e)->daddr, (a)->daddr, 4);           \
		} else {                                                       \
			__builtin_memcpy((e)->saddr, (a)->saddr_v6, 16);       \
			__builtin_memcpy((e)->daddr, (a)->daddr_v6, 16);       \
		}                                                              \
		(e)->sport = (a)->sport;                                       \
		(e)->dport = (a)->dport;                                       \
		(e)->family = (a)->family;                                     \
		(e)->event = (kind);                                           \
	} while (0)

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

/* A sampled retransmit of another connection: no owner, no state (a macro:
 * tracepoint arguments at constant offsets). */
#define WRITE_OTHER(a)                                                         \
	do {                                                                   \
		u64 __pos;                                                     \
		struct tcp_event *__e = claim_tcp(&__pos);                     \
		if (__e) {                                                     \
			FILL_TCP_ROW(__e, a, TCPEV_TCP_RETRANSMIT_SKB, 0);     \
			clear_tail(__e);                                       \
			__e->state = (a)->state;                               \
			__e->other = 1;                                        \
			publish(&__e->hdr, __pos);                             \
		}                                                              \
	} while (0)

TRACEPOINT_PROBE(tcp, tcp_retransmit_skb)
{
	u64 skaddr = (u64)args->skaddr;
	u32 owner = owner_of(skaddr);
	if (own_traffic(owner, args->sport, args->dport))
		return 0;
	struct endpoint local, remote;
	ENDPOINTS_OF(args, local, remote);
	u32 pid = job_of(owner, &local, &remote);
	if (!pid) {
		count_filtered();
		if (sample_other(&local, &remote, bpf_ktime_get_ns()))
			WRITE_OTHER(args);
		return 0;
	}
	note_peer(&remote);
	struct tcp_event *e;
	u64 pos;
	e = claim_tcp(&pos);
	if (!e)
		return 0;
	FILL_TCP_ROW(e, args, TCPEV_TCP_RETRANSMIT_SKB, pid);
	clear_tail(e);
	e->state = args->state;
#ifdef TP_RETRANSMIT_ERR
	e->err = args->err;
#endif
	struct conn *c = conn_state.lookup(&skaddr);
	if (c && c->known)  /* the callbacks of this retransmit came first */
		copy_conn(e, c, e->hdr.ts_ns);
	publish(&e->hdr, pos);
	return 0;
}

/* One end of a reset: its `sa` field is a sockaddr_in or sockaddr_in6
 * (family, port in network order, address); a macro, as ENDPOINTS_OF. */
#define SOCKADDR_ENDPOINT(ep, sa)                                              \
	do {                                                                   \
		__builtin_memset(&(ep), 0, sizeof(ep));                        \
		(ep).family = (sa)[0] | ((u16)(sa)[1] << 8);                   \
		(ep).port = ((u16)(sa)[2] << 8) | (sa)[3];                     \
		if ((ep).family == AF_INET)                                    \
			__builtin_memcpy((ep).addr, &(sa)[4], 4);              \
		else                                                           \
			__builtin_memcpy((ep).addr, &(sa)[8], 16);             \
	} while (0)

TRACEPOINT_PROBE(tcp, tcp_send_reset)
{
	u64 skaddr = (u64)args->skaddr;
	u32 owner = owner_of(skaddr);
	struct endpoint local, remote;
	SOCKADDR_ENDPOINT(local, args->saddr);
	SOCKADDR_ENDPOINT(remote, args->daddr);
	if (own_traffic(owner, local.port, remote.port))
		return 0;
	u32 pid = job_of(owner, &local, &remote);
	if (!pid) {
		count_filtered();
		return 0;
	}
	struct tcp_event *e;
	u64 pos;
	e = claim_tcp(&pos);
	if (!e)
		return 0;
	u64 id = bpf_get_current_pid_tgid();
	fill_header(&e->hdr, EVENT_TCP, sizeof(*e), pid, (u32)id, bpf_ktime_get_ns());
	e->skaddr = skaddr;
	__builtin_memcpy(e->saddr, local.addr, 16);
	__builtin_memcpy(e->daddr, remote.addr, 16);
	e->sport = local.port;
	e->dport = remote.port;
	e->family = local.family;
	e->event = TCPEV_TCP_SEND_RESET;
	clear_tail(e);
	e->state = args->state;
#ifdef TP_SEND_RESET_REASON
	e->reason = (u16)args->reason;
#endif
	publish(&e->hdr, pos);
	return 0;
}

TRACEPOINT_PROBE(tcp, tcp_receive_reset)
{
	u64 skaddr = (u64)args->skaddr;
	u32 owner = owner_of(skaddr);
	if (own_traffic(owner, args->sport, args->dport))
		return 0;
	struct endpoint local, remote;
	ENDPOINTS_OF(args, local, remote);
	u32 pid = job_of(owner, &local, &remote);
	if (!pid) {
		count_filtered();
		return 0;
	}
	struct tcp_event *e;
	u64 pos;
	e = claim_tcp(&pos);
	if (!e)
		return 0;
	FILL_TCP_ROW(e, args, TCPEV_TCP_RECEIVE_RESET, pid);
	clear_tail(e);
	publish(&e->hdr, pos);
	return 0;
}

TRACEPOINT_PROBE(sock, inet_sock_set_state)
{
	if (args->protocol != IPPROTO_TCP)
		return 0;
	u64 skaddr = (u64)args->skaddr;
	/* Only connect() (-> SYN_SENT) and listen() (-> LISTEN) are sure to run
	 * in the owner's context.  Other changes may run in softirq, in whatever
	 * task was interrupted or sent the packet: over a veth, a rank of
	 * another namespace. */
	if (args->newstate == TCP_SYN_SENT || args->newstate == TCP_LISTEN)
		learn_owner(skaddr);
	u32 owner = owner_of(skaddr);
	struct endpoint local, remote;
	ENDPOINTS_OF(args, local, remote);
	/* a tracked listener's port is a job endpoint while it listens */
	if (args->newstate == TCP_LISTEN && owner && is_tracked(owner))
		job_endpoints.update(&local, &owner);
	else if (args->oldstate == TCP_LISTEN && args->newstate == TCP_CLOSE)
		job_endpoints.delete(&local);
	u32 pid = own_traffic(owner, args->sport, args->dport) ? 0 : job_of(owner, &local, &remote);
	if (pid && !owner && args->oldstate == TCP_SYN_RECV)
		sock_owner.update(&skaddr, &pid); /* accepted on a tracked listener */
	if (args->newstate == TCP_CLOSE) {
		sock_owner.delete(&skaddr);
		conn_state.delete(&skaddr);
	}
	if (!pid) {
		count_filtered();
		return 0;
	}
	note_peer(&remote);
	struct tcp_event *e;
	u64 pos;
	e = claim_tcp(&pos);
	if (!e)
		return 0;
	FILL_TCP_ROW(e, args, TCPEV_INET_SOCK_SET_STATE, pid);
	clear_tail(e);
	e->state = args->oldstate;
	e->newstate = args->newstate;
	publish(&e->hdr, pos);
	return 0;
}

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

/* TCP retransmits and connection state changes, attributed to processes.
 *
 * Retransmits fire in softirq context, where the current pid means nothing,
 * so `sock_owner` (socket address -> tgid) is learned where the owning
 * process itself touches the socket: sock_send_length / sock_recv_length
 * (process context) and inet_sock_set_state to SYN_SENT (connect).  The hash is written only when an entry is missing or changes,
 * never once per send to user space, and forgotten when the socket closes.
 *
 * The agent's own connections (its HTTP surface, its requests to peers) are
 * not the job's: `agent_self` names the agent's process and listening port,
 * and rows of sockets it owns or of connections to or from that port are
 * never written (unless user space leaves it empty).
 */
#include "common.h"

#define MAX_SOCKETS 16384
#define AF_INET 2
#define IPPROTO_TCP 6
#define TCP_SYN_SENT 2
#define TCP_CLOSE 7
#define TCP_LISTEN 10

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

/* Any process not excluded: a rank connects before discovery has classified
 * it (user space keeps only the rows of processes in scope). */
static __always_inline void learn_owner(u64 skaddr)
{
	u32 tgid = bpf_get_current_pid_tgid() >> 32;
	if (!tgid || is_excluded(tgid))
		return;
	u32 *known = sock_owner.lookup(&skaddr);
	if (known && *known == tgid)
		return;
	if (sock_owner.update(&skaddr, &tgid))
		count_drop(DROP_OWNER_FULL);
}

static __always_inline u32 owner_of(u64 skaddr)
{
	u32 *pid = sock_owner.lookup(&skaddr);
	return pid ? *pid : 0;
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

/* Common part of both tracepoints: header, addresses, ports. */
#define FILL_TCP_ROW(e, a, kind)                                               \
	do {                                                                   \
		u64 __id = bpf_get_current_pid_tgid();                         \
		fill_header(&(e)->hdr, EVENT_TCP, sizeof(*(e)),                \
			    owner_of((u64)(a)->skaddr), (u32)__id,             \
			    bpf_ktime_get_ns());                               \
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
		(e)->_pad1 = 0;                                                \
	} while (0)

TRACEPOINT_PROBE(tcp, tcp_retransmit_skb)
{
	if (own_traffic(owner_of((u64)args->skaddr), args->sport, args->dport))
		return 0;
	struct tcp_event *e;
	u64 pos;
	e = claim_tcp(&pos);
	if (!e)
		return 0;
	FILL_TCP_ROW(e, args, TCPEV_TCP_RETRANSMIT_SKB);
	e->state = args->state;
	e->newstate = 0;
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
	if (own_traffic(owner_of(skaddr), args->sport, args->dport)) {
		if (args->newstate == TCP_CLOSE)
			sock_owner.delete(&skaddr);
		return 0;
	}
	struct tcp_event *e;
	u64 pos;
	e = claim_tcp(&pos);
	if (!e)
		return 0;
	FILL_TCP_ROW(e, args, TCPEV_INET_SOCK_SET_STATE);
	e->state = args->oldstate;
	e->newstate = args->newstate;
	publish(&e->hdr, pos);
	if (args->newstate == TCP_CLOSE)
		sock_owner.delete(&skaddr);
	return 0;
}

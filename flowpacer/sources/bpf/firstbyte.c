// SPDX-License-Identifier: GPL-2.0-only
/*
 * firstbyte.c: give a target flow its class before its first data packet
 * (bcc: one cgroup sock_ops program and four cgroup sock_addr programs;
 * flowpacer/sources/firstbyte.py owns them).
 *
 * Attached (bpf_links, so they go when their owner's fds close, also on a
 * crash) to the root of the cgroup v2 hierarchy.  Who owns a socket is
 * learnt where the kernel runs us in the owner's context:
 *   cgroup/bind4, bind6       bind(): the binder (current task) is kept in
 *   (sock_addr programs)      the socket's storage (fb_owner_st)
 *   cgroup/connect4, connect6 connect(): the connecting task, the same way
 * (sock_addr programs may call bpf_get_current_{pid_tgid,uid_gid,comm} on
 * every kernel we meet; sock_ops programs on 6.18 only: 6.1 has none of
 * them, 6.12 only pid_tgid.)  The sock_ops callbacks used (all without
 * BPF_SOCK_OPS_*_CB_FLAG):
 *   TCP_LISTEN_CB           listen(): the owner from the socket's storage
 *                           (its binder), else current when sock_ops may ask
 *                           (fb_sockops_cur), else reported to user space;
 *                           remembered per local port in fb_listeners
 *   ACTIVE_ESTABLISHED_CB   SYN-ACK received (softirq): owner from the
 *                           socket's storage (its connect() caller)
 *   PASSIVE_ESTABLISHED_CB  final ACK received (softirq): owner from the
 *                           listener of the local port
 *   STATE_CB                claimed sockets only: their close
 * At the end of a handshake first_rule() walks the rules (first match
 * wins); a rule decided wholly here claims a class from its pool and sets
 * the socket's SO_PRIORITY to it: htb and psp put a packet whose
 * skb->priority is one of their class ids in that class before any filter
 * is asked, so the flow's first data packet is already paced.  The claim is
 * reported on the ring buffer; the daemon then installs the flow's u32
 * filter for that class (the source of truth for status and metrics) and
 * refills the pool.
 *
 * The rule masks (firstbyte.h) are not written by hand: the engine's side,
 * flowpacer/policy/handshake.py compile_rules(), makes them from what each field of
 * model.Match declares the kernel can decide at the handshake (yes, partly,
 * no).  A rule with a field the kernel cannot decide stays a candidate that
 * stops the walk (the flow goes to user space), so this program never gives a
 * flow a rule the engine would not.  Adding a match field: declare it in
 * model.Match; a field this program does not see (declared no) needs nothing
 * here; one it sees needs a compiler in handshake.py, a map or config mask
 * here, and the test build's socket (docs/firstbyte.md, "Adding a match
 * field").  The IPv4-mapped rule (family and addresses of a socket) is in
 * wire_addrs4/6 and must agree with FlowKey.wire(); tests/test_handshake.py
 * runs first_rule() and that rule (the FB_TEST_RUN build, BPF_PROG_TEST_RUN)
 * against the engine on random rule sets and sockets.
 *
 * When r's pool is empty the socket gets r's rate as its SO_MAX_PACING_RATE
 * (the stopgap, issue 26: TCP paces itself until the flow's class is in) and
 * its ACKs lift that limit once r's generation in fb_rate changes (a reload);
 * see stopgap() and docs/firstbyte.md.  With several interfaces (config.guard)
 * a claiming socket gets the stopgap too, lifted once user space saw its class
 * on the interface it leaves by (fb_placed; firstbyte.h, "Guarded claims").
 *
 * Pool of a rule r: fb_pool[r * FB_POOL_SLOTS + (i % FB_POOL_SLOTS)] holds
 * the class id of ticket i; tickets fb_take[r] <= i < fb_fill[r] are
 * ready.  User space (one writer) writes a slot, then advances fb_fill;
 * this program takes a ticket by compare-and-swap on fb_take, so two CPUs
 * never get the same class.  User space writes fb_take only while the rules
 * are switched off (config.live == 0).
 */
#include <uapi/linux/bpf.h>
#include <linux/socket.h>
#include <linux/in.h>

#include "firstbyte.h"

#ifndef FB_RING_PAGES
#define FB_RING_PAGES 64
#endif
#ifndef FB_MAX_CONN
#define FB_MAX_CONN 65536
#endif
#ifndef FB_MAX_LISTENERS
#define FB_MAX_LISTENERS 4096
#endif
#ifndef FB_MAX_KEYS
#define FB_MAX_KEYS 4096
#endif

#ifndef AF_INET
#define AF_INET 2
#endif
#ifndef AF_INET6
#define AF_INET6 10
#endif
#ifndef SOL_SOCKET
#define SOL_SOCKET 1
#endif
#ifndef SO_PRIORITY
#define SO_PRIORITY 12
#endif
#ifndef SOCK_STREAM
#define SOCK_STREAM 1
#endif
#ifndef SO_MAX_PACING_RATE
#define SO_MAX_PACING_RATE 47
#endif
/* what a segment carries besides its payload on the wire, as htb counts it: TCP header with
 * the timestamp option (Linux's default; without it the stopgap is 0.8 % stricter), IP header,
 * Ethernet header */
#define FB_TCP_HDR 32
#define FB_ETH_HDR 14

BPF_RINGBUF_OUTPUT(fb_events, FB_RING_PAGES);
BPF_ARRAY(fb_config, struct fb_config, 1);
BPF_ARRAY(fb_lport, u64, 65536);
BPF_ARRAY(fb_rport, u64, 65536);
BPF_HASH(fb_comms, struct fb_comm_key, u64, FB_MAX_KEYS);
BPF_HASH(fb_uids, u32, u64, FB_MAX_KEYS);
BPF_LPM_TRIE(fb_remote, struct fb_remote_key, u64, FB_MAX_KEYS);
BPF_HASH(fb_listeners, u32, struct fb_owner, FB_MAX_LISTENERS);
BPF_SK_STORAGE(fb_owner_st, struct fb_owner);	/* bound/connected socket -> its owner */
BPF_TABLE("lru_hash", u64, u32, fb_claimed, FB_MAX_CONN);	/* cookie -> class id */
BPF_ARRAY(fb_pool, u32, FB_MAX_RULES * FB_POOL_SLOTS);
BPF_ARRAY(fb_fill, u64, FB_MAX_RULES);
BPF_ARRAY(fb_take, u64, FB_MAX_RULES);
BPF_ARRAY(fb_rate, struct fb_rate, FB_MAX_RULES);	/* rule -> its stopgap (issue 26) */
BPF_SK_STORAGE(fb_stop_st, struct fb_stop);	/* stopgapped socket -> what it was given */
BPF_ARRAY(fb_placed, u64, FB_PLACED_SLOTS);	/* guarded claim's slot -> its ts_ns, placed */
BPF_PERCPU_ARRAY(fb_counters, u64, FB_C_MAX);

static __always_inline void count(u32 idx)
{
	u64 *v = fb_counters.lookup(&idx);

	if (v)
		*v += 1;
}

/* Only where the program type may ask (sock_addr always; sock_ops on 6.18): callers pass a
 * constant, so the other programs hold no call the verifier would refuse. */
static __always_inline void owner_current(struct fb_owner *o)
{
	o->pid = bpf_get_current_pid_tgid() >> 32;
	o->uid = (u32)bpf_get_current_uid_gid();
	bpf_get_current_comm(o->comm, sizeof(o->comm));
}

/* The owner kept in a socket's storage by the bind/connect programs, or NULL. */
static __always_inline struct fb_owner *owner_stored(struct bpf_sock_ops *skops)
{
	struct bpf_sock *sk = skops->sk;

	if (!sk)
		return 0;
	return fb_owner_st.sk_storage_get(sk, 0, 0);
}

/* The flow as the rules see it (filled from the callback's context). */
struct fb_flow {
	struct fb_event ev;
	int attributed;
};

static __always_inline u64 lookup_mask(void *map_lookup_result)
{
	return map_lookup_result ? *(u64 *)map_lookup_result : 0;
}

/* Index of the lowest set bit of a non-zero mask (no loop for the verifier). */
static __always_inline u32 lowest_bit(u64 m)
{
	u32 n = 0;

	if (!(m & 0xffffffffULL)) { n += 32; m >>= 32; }
	if (!(m & 0xffffULL))     { n += 16; m >>= 16; }
	if (!(m & 0xffULL))       { n += 8;  m >>= 8; }
	if (!(m & 0xfULL))        { n += 4;  m >>= 4; }
	if (!(m & 0x3ULL))        { n += 2;  m >>= 2; }
	if (!(m & 0x1ULL))        { n += 1; }
	return n;
}

/* The rule whose class the flow gets, or -1 (counted why). */
static __always_inline int first_rule(struct fb_config *cfg, struct fb_flow *f)
{
	u32 lport = f->ev.lport, rport = f->ev.rport;
	struct fb_remote_key rk = {};
	u64 cand, owner_free, first;

	cand = cfg->live & (f->ev.direction == FB_DIR_INBOUND ? cfg->inbound : cfg->outbound);
	cand &= lookup_mask(fb_lport.lookup(&lport));
	cand &= lookup_mask(fb_rport.lookup(&rport));
	if (cand & ~cfg->any_remote) {
		rk.prefixlen = 32 + (f->ev.family == 4 ? 32 : 128);
		rk.family = f->ev.family;
		__builtin_memcpy(rk.addr, f->ev.raddr, 16);
		cand &= cfg->any_remote | lookup_mask(fb_remote.lookup(&rk));
	}
	owner_free = cfg->any_comm & cfg->any_uid;
	if (f->attributed) {
		struct fb_comm_key ck = {};
		u32 uid = f->ev.uid;

		__builtin_memcpy(ck.comm, f->ev.comm, FB_COMM_LEN);
		cand &= cfg->any_comm | lookup_mask(fb_comms.lookup(&ck));
		cand &= cfg->any_uid | lookup_mask(fb_uids.lookup(&uid));
	}
	if (!cand) {
		count(FB_C_NOMATCH);
		return -1;
	}
	first = cand & (~cand + 1);		/* lowest candidate */
	if (!f->attributed && !(first & owner_free)) {
		count(FB_C_UNATTRIBUTED);
		return -1;
	}
	if (!(first & cfg->kernel)) {
		count(FB_C_UNDECIDED);
		return -1;
	}
	return lowest_bit(first);
}

/* A class of rule r's pool, or 0 when it is empty. */
static __always_inline u32 claim(u32 r)
{
	u64 *fill = fb_fill.lookup(&r);
	u64 *take = fb_take.lookup(&r);

	if (!fill || !take)
		return 0;
#pragma unroll
	for (int tries = 0; tries < 4; tries++) {
		u64 t = *(volatile u64 *)take;
		u64 f = *(volatile u64 *)fill;

		if (t >= f)
			return 0;
		if (__sync_val_compare_and_swap(take, t, t + 1) == t) {
			u32 slot = r * FB_POOL_SLOTS + (u32)(t & (FB_POOL_SLOTS - 1));
			u32 *cid = fb_pool.lookup(&slot);

			return cid ? *cid : 0;
		}
	}
	return 0;
}

/* The flow's addresses as on the wire.  flowpacer/model.py FlowKey.wire() is
 * the one definition of this rule and this must agree with it (the test build's
 * fb_test_first_rule checks both on the same sockets): an AF_INET socket is
 * IPv4; an AF_INET6 socket whose local AND remote addresses are IPv4-mapped
 * (::ffff:a.b.c.d: a dual-stack socket talking IPv4) is IPv4 too, its
 * addresses the last 4 bytes; any other AF_INET6 socket is IPv6.  (wire()'s
 * other case, an unspecified local address, is no established socket's.) */
static __always_inline void wire_addrs4(struct fb_event *e, u32 l, u32 r)
{
	e->family = 4;
	__builtin_memcpy(e->laddr, &l, 4);
	__builtin_memcpy(e->raddr, &r, 4);
}

static __always_inline void wire_addrs6(struct fb_event *e, const u32 *l, const u32 *r)
{
	if (l[0] == 0 && l[1] == 0 && l[2] == bpf_htonl(0xffff) &&
	    r[0] == 0 && r[1] == 0 && r[2] == bpf_htonl(0xffff)) {
		wire_addrs4(e, l[3], r[3]);
		return;
	}
	e->family = 6;
	__builtin_memcpy(e->laddr, l, 16);
	__builtin_memcpy(e->raddr, r, 16);
}

static __always_inline void fill_tuple(struct bpf_sock_ops *skops, struct fb_event *e)
{
	e->lport = (u16)skops->local_port;
	e->rport = (u16)bpf_ntohl(skops->remote_port);
	if (skops->family == AF_INET) {
		wire_addrs4(e, skops->local_ip4, skops->remote_ip4);
		return;
	}
	u32 l[4] = {skops->local_ip6[0], skops->local_ip6[1], skops->local_ip6[2],
		    skops->local_ip6[3]};
	u32 r[4] = {skops->remote_ip6[0], skops->remote_ip6[1], skops->remote_ip6[2],
		    skops->remote_ip6[3]};

	wire_addrs6(e, l, r);
}

/*
 * The stopgap (issue 26): rule r's pool is empty, so the socket gets r's rate as its maximum
 * pacing rate.  bpf_setsockopt(SOL_SOCKET, SO_MAX_PACING_RATE) goes through the kernel's own
 * socket option code on 6.1, 6.12 and 6.18 (sol_socket_sockopt -> sock_setsockopt /
 * sk_setsockopt), which also marks the socket as needing pacing (sk_pacing_status), so TCP
 * paces itself (its internal pacing timer; no fq needed since 4.20).  TCP's pacing counts
 * payload bytes, htb whole frames: the rate is scaled by payload / frame of one full segment,
 * so the stopgap is not looser than the class.  (TCP does not pace a flow's first 10 segments:
 * the class lets its burst through there too.)  1: paced, 0: not (counted missed).
 */
static __always_inline int stopgap(struct bpf_sock_ops *skops, u32 r, u16 family,
				   u32 classid, u64 claim_ts)
{
	struct fb_rate *fr = fb_rate.lookup(&r);
	struct bpf_sock *sk = skops->sk;
	struct fb_stop *st;
	u64 mss, rate;
	int val;

	if (!fr || !fr->rate || !sk)
		return 0;
	mss = skops->mss_cache;
	if (!mss)
		mss = 1448;
	rate = fr->rate * mss / (mss + FB_TCP_HDR + (family == 4 ? 20 : 40) + FB_ETH_HDR);
	if (!rate)
		rate = 1;
	if (rate >= 0xffffffffULL)
		rate = 0xfffffffeULL;		/* ~0U means "no limit" */
	st = fb_stop_st.sk_storage_get(sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!st)
		return 0;			/* could not be lifted later: not set */
	val = (int)(u32)rate;
	if (bpf_setsockopt(skops, SOL_SOCKET, SO_MAX_PACING_RATE, &val, sizeof(val)) != 0)
		return 0;
	st->rule = r;
	st->rate = (u32)rate;
	st->gen = fr->gen;
	st->claim_ts = claim_ts;
	st->classid = classid;
	/* the socket's ACKs re-check its rule (fb_rate.gen): a reload lifts the limit */
	bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags | BPF_SOCK_OPS_RTT_CB_FLAG);
	return 1;
}

/* A guarded claim whose class user space placed on the interface its flow leaves by. */
static __always_inline int placed(struct fb_stop *st)
{
	u32 slot;
	u64 *ts;

	if (!st->claim_ts)
		return 0;
	slot = st->classid % FB_PLACED_SLOTS;
	ts = fb_placed.lookup(&slot);
	return ts && *ts == st->claim_ts;
}

/* An ACK of a stopgapped socket: its limit stays while its rule is unchanged (the class of the
 * flow has the same rate) and, for a guarded claim, until its class is placed; it is lifted
 * once the rule, or one before it, changed, or the guarded claim's class is placed. */
static __always_inline void recheck_stopgap(struct bpf_sock_ops *skops)
{
	struct bpf_sock *sk = skops->sk;
	struct fb_stop *st;
	struct fb_rate *fr;
	u32 r;
	int val = -1;				/* ~0U: no limit */

	if (!sk)
		return;
	st = fb_stop_st.sk_storage_get(sk, 0, 0);
	if (!st || !st->rate)
		return;				/* not ours (another program asked for RTT_CB) */
	r = st->rule;
	fr = fb_rate.lookup(&r);
	if (fr && fr->gen == st->gen && !placed(st))
		return;
	if (bpf_setsockopt(skops, SOL_SOCKET, SO_MAX_PACING_RATE, &val, sizeof(val)) != 0)
		return;				/* tried again at the next ACK */
	st->rate = 0;
	count(FB_C_LIFTED);
	bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags & ~BPF_SOCK_OPS_RTT_CB_FLAG);
}

static __always_inline void established(struct bpf_sock_ops *skops, struct fb_config *cfg,
					u8 direction)
{
	struct fb_flow f = {};
	struct fb_owner *o = 0;
	u64 cookie = bpf_get_socket_cookie(skops);
	int chosen;

	f.ev.direction = direction;
	fill_tuple(skops, &f.ev);
	if (direction == FB_DIR_OUTBOUND) {
		o = owner_stored(skops);
	} else {
		u32 port = f.ev.lport;

		o = fb_listeners.lookup(&port);
	}
	if (o) {
		f.attributed = 1;
		f.ev.pid = o->pid;
		f.ev.uid = o->uid;
		__builtin_memcpy(f.ev.comm, o->comm, FB_COMM_LEN);
	}

	chosen = first_rule(cfg, &f);
	if (chosen < 0)
		return;
	u32 classid = claim(chosen);

	if (!classid) {
		count(FB_C_EMPTY);
		count(stopgap(skops, chosen, f.ev.family, 0, 0) ? FB_C_STOPGAP : FB_C_MISSED);
		return;
	}
	int prio = (int)classid;
	u64 ts = bpf_ktime_get_ns();

	if (bpf_setsockopt(skops, SOL_SOCKET, SO_PRIORITY, &prio, sizeof(prio)) != 0) {
		count(FB_C_SETSOCKOPT);	/* still reported: the daemon gives the class back */
		count(stopgap(skops, chosen, f.ev.family, 0, 0) ? FB_C_STOPGAP : FB_C_MISSED);
	} else {
		count(FB_C_CLAIMED);
		/* several interfaces: paced by TCP too until its class is where it leaves */
		if (cfg->guard && stopgap(skops, chosen, f.ev.family, classid, ts))
			count(FB_C_GUARDED);
		/* tell user space when this socket is closed: until then the class id
		 * is its priority and must not be handed to another flow */
		fb_claimed.update(&cookie, &classid);
		bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags |
					  BPF_SOCK_OPS_STATE_CB_FLAG);
	}
	struct fb_event *e = fb_events.ringbuf_reserve(sizeof(*e));

	if (!e) {
		/* the class stays in use by the socket; the daemon finds the
		 * flow with sock_diag and gives it a class of its own */
		count(FB_C_LOST);
		return;
	}
	__builtin_memcpy(e, &f.ev, sizeof(*e));
	e->ts_ns = ts;
	e->classid = classid;
	e->rule = chosen;
	e->flags = f.attributed ? FB_F_ATTRIBUTED : 0;
	fb_events.ringbuf_submit(e, 0);
}

static __always_inline int sockops(struct bpf_sock_ops *skops, const int may_ask)
{
	u32 zero = 0, op = skops->op;
	struct fb_config *cfg;

	if (op == BPF_SOCK_OPS_RTT_CB) {
		/* only stopgapped sockets asked for this callback (and maybe another program's) */
		recheck_stopgap(skops);
		return 1;
	}
	if (op == BPF_SOCK_OPS_STATE_CB) {
		/* only sockets that claimed a class asked for this callback */
		u64 cookie;
		u32 *cid;

		if (skops->args[1] != 7 /* TCP_CLOSE */)
			return 1;
		cookie = bpf_get_socket_cookie(skops);
		cid = fb_claimed.lookup(&cookie);
		if (cid) {
			/* out of fb_claimed before the report: user space, which sweeps
			 * fb_claimed for ids still held, never sees a closed one there */
			u32 classid = *cid;
			struct fb_event *e;

			fb_claimed.delete(&cookie);
			e = fb_events.ringbuf_reserve(sizeof(*e));
			if (e) {
				__builtin_memset(e, 0, sizeof(*e));
				e->classid = classid;
				e->flags = FB_F_CLOSED;
				e->ts_ns = bpf_ktime_get_ns();
				fb_events.ringbuf_submit(e, 0);
			} else {
				count(FB_C_LOST);
			}
		}
		return 1;
	}
	if (op != BPF_SOCK_OPS_TCP_LISTEN_CB && op != BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB &&
	    op != BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB)
		return 1;
	if (skops->family != AF_INET && skops->family != AF_INET6)
		return 1;
	cfg = fb_config.lookup(&zero);
	if (!cfg || !cfg->netns_cookie || bpf_get_netns_cookie(skops) != cfg->netns_cookie)
		return 1;

	switch (op) {
	case BPF_SOCK_OPS_TCP_LISTEN_CB: {
		u32 port = skops->local_port;
		struct fb_owner *so = owner_stored(skops);
		struct fb_owner o = {};

		if (so) {
			fb_listeners.update(&port, so);
		} else if (may_ask) {
			owner_current(&o);
			fb_listeners.update(&port, &o);
		} else {
			/* bound without bind(): classid 0 says "a new listener on
			 * lport", user space finds its owner */
			struct fb_event *e = fb_events.ringbuf_reserve(sizeof(*e));

			if (e) {
				__builtin_memset(e, 0, sizeof(*e));
				e->lport = port;
				fb_events.ringbuf_submit(e, 0);
			}
		}
		break;
	}
	case BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB:
		if (cfg->live)
			established(skops, cfg, FB_DIR_OUTBOUND);
		break;
	case BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB:
		if (cfg->live)
			established(skops, cfg, FB_DIR_INBOUND);
		break;
	}
	return 1;
}

/* sock_ops on a kernel whose sock_ops may ask for the current task (6.18), and without */
int fb_sockops_cur(struct bpf_sock_ops *skops)
{
	return sockops(skops, 1);
}

int fb_sockops(struct bpf_sock_ops *skops)
{
	return sockops(skops, 0);
}

/* bind() and connect() of a TCP socket of our namespace: its owner into its storage. */
static __always_inline int remember_owner(struct bpf_sock_addr *ctx)
{
	u32 zero = 0;
	struct fb_config *cfg = fb_config.lookup(&zero);
	struct bpf_sock *sk = ctx->sk;
	struct fb_owner *o;

	if (ctx->type != SOCK_STREAM || !sk)
		return 1;
	if (!cfg || !cfg->netns_cookie || bpf_get_netns_cookie(ctx) != cfg->netns_cookie)
		return 1;
	o = fb_owner_st.sk_storage_get(sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (o)
		owner_current(o);
	return 1;	/* never refuses the call */
}

/* one function per attach type (a sock_addr program is loaded for one) */
int fb_bind4(struct bpf_sock_addr *ctx)
{
	return remember_owner(ctx);
}

int fb_bind6(struct bpf_sock_addr *ctx)
{
	return remember_owner(ctx);
}

int fb_connect4(struct bpf_sock_addr *ctx)
{
	return remember_owner(ctx);
}

int fb_connect6(struct bpf_sock_addr *ctx)
{
	return remember_owner(ctx);
}

#ifdef FB_TEST_RUN
/*
 * Only in the test build (-DFB_TEST_RUN, tests/test_handshake.py): the real
 * first_rule() and address rule on one socket that user space describes, run
 * with BPF_PROG_TEST_RUN (a raw_tracepoint program, never attached).  The
 * rules are in the maps FirstByte writes; the counters say why a flow was
 * declined.
 */
struct fb_test_sock {
	__u32 family;              /* AF_INET or AF_INET6, as the socket's */
	__u32 lport;               /* host order */
	__u32 rport;
	__u32 direction;           /* FB_DIR_* */
	__u32 attributed;          /* the owner (uid, comm) is known */
	__u32 uid;
	__u32 local_ip4;           /* network order, as struct bpf_sock_ops */
	__u32 remote_ip4;
	__u32 local_ip6[4];
	__u32 remote_ip6[4];
	char  comm[FB_COMM_LEN];
};

struct fb_test_result {
	__s32 rule;                /* first_rule(): the index, or -1 */
	__u32 live;                /* config.live was non-zero */
	struct fb_event ev;        /* the flow as the rules saw it */
};

BPF_ARRAY(fb_test_in, struct fb_test_sock, 1);
BPF_ARRAY(fb_test_out, struct fb_test_result, 1);

int fb_test_first_rule(struct bpf_raw_tracepoint_args *ctx)
{
	u32 zero = 0;
	struct fb_test_sock *in = fb_test_in.lookup(&zero);
	struct fb_test_result *out = fb_test_out.lookup(&zero);
	struct fb_config *cfg = fb_config.lookup(&zero);
	struct fb_flow f = {};

	if (!in || !out || !cfg)
		return 1;
	f.ev.direction = in->direction;
	f.ev.lport = in->lport;
	f.ev.rport = in->rport;
	if (in->family == AF_INET) {
		wire_addrs4(&f.ev, in->local_ip4, in->remote_ip4);
	} else {
		u32 l[4] = {in->local_ip6[0], in->local_ip6[1], in->local_ip6[2], in->local_ip6[3]};
		u32 r[4] = {in->remote_ip6[0], in->remote_ip6[1], in->remote_ip6[2],
			    in->remote_ip6[3]};

		wire_addrs6(&f.ev, l, r);
	}
	if (in->attributed) {
		f.attributed = 1;
		f.ev.uid = in->uid;
		__builtin_memcpy(f.ev.comm, in->comm, FB_COMM_LEN);
	}
	out->live = cfg->live != 0;
	out->rule = cfg->live ? first_rule(cfg, &f) : -1;
	__builtin_memcpy(&out->ev, &f.ev, sizeof(f.ev));
	return 0;
}
#endif /* FB_TEST_RUN */

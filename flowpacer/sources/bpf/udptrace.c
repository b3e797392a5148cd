// SPDX-License-Identifier: GPL-2.0-only
/*
 * udptrace.c: UDP flow open/close events for flowpacer (issue 17).
 *
 * Compiled together with flowtrace.c (tracer.py appends this file to it: one
 * bcc object, one ring buffer `events`, the same watch filter) and uses its
 * helpers (watched_current, owner_current, emit, count, fd_to_sk, sk_netns).
 *
 * A UDP flow is a (local, remote) address/port pair of a target process:
 *
 *   connected socket     syscalls:sys_enter_connect remembers the fd of a
 *                        watched caller (per thread), cgroup/connect4|6 the
 *                        socket's cookie if it is UDP (the helper makes the
 *                        cookie; a tracepoint could only read a cookie nobody
 *                        made yet); sys_exit_connect, when connect() returned
 *                        0, walks the fd to its struct sock, reads the tuple
 *                        the connect() set (offsets from BTF like
 *                        flowtrace.c's) and sends OPEN (flag FT_F_CONNECTED)
 *                        with the cookie, which goes into udp_socks.
 *   peers of an          cgroup/sendmsg4 and cgroup/sendmsg6 (sock_addr
 *   unconnected socket   programs on the cgroup v2 root) run for every
 *                        datagram sent with an address (sendto, sendmsg, each
 *                        message of sendmmsg) in the sender's context: the
 *                        first datagram of a (socket cookie, peer) pair of a
 *                        watched process sends OPEN and enters the udp_peers
 *                        LRU map; later ones only store their time there
 *                        (last_ns), which user space scans for idle flows.  A
 *                        peer silent for reopen_ns (the shortest idle_timeout
 *                        of the rules) sends OPEN again at its next datagram,
 *                        since user space may have ended its flow meanwhile.
 *                        A dual-stack socket sending to an IPv4-mapped peer
 *                        goes through sendmsg4 (udpv6_sendmsg hands such
 *                        datagrams to udp_sendmsg): the flow is IPv4 as on
 *                        the wire.  (A connected one's send()s come this way
 *                        too, with its own peer: they are left to udp_conn.)  The local address is the datagram's
 *                        source if the sender chose one (IP_PKTINFO), else
 *                        the socket's bound address; for a socket bound to
 *                        the wildcard it stays unspecified and the flow's
 *                        filter matches local port + remote only.
 *   close                cgroup/sock_release (BPF_CGROUP_INET_SOCK_RELEASE)
 *                        of a UDP socket that has flows (its cookie in
 *                        udp_socks) sends RELEASE with the cookie: user space
 *                        ends every flow of that cookie.  (The release
 *                        program may not read the socket's addresses: the
 *                        cookie is all it has.)
 *
 *   idle connected       a connected socket's send()s carry no address and
 *   sockets              udp_sendmsg runs the sendmsg hooks only when one is
 *                        given (its `connected` fast path skips them), so the
 *                        cgroup/skb egress program (ft_udp_egress, every
 *                        packet a local socket sends, in the sender's context
 *                        for UDP) looks up each UDP packet's socket cookie in
 *                        udp_conn, which holds only the connected sockets of
 *                        targets (sys_exit_connect puts them there), and
 *                        stores the time (last_ns), which user space scans
 *                        like udp_peers' for idle flows.  A socket silent for
 *                        reopen_ns sends WAKE with its cookie at its next
 *                        packet: user space knows the flow's tuple and owner
 *                        from its OPEN and opens it again (a class anew when
 *                        its idle_timeout had ended it).  Other sockets'
 *                        packets cost the fullsock check, TCP's no more.
 *
 * Everything but the egress program runs in the calling process's context;
 * no kprobes or fentry.
 * Measured to load on Linux 6.1, 6.12 (Debian) and 6.18: docs/design.md.
 */
#include "udptrace.h"

#ifndef FT_MAX_UDP_PEERS
#define FT_MAX_UDP_PEERS 65536
#endif

#ifndef IPPROTO_UDP
#define IPPROTO_UDP 17
#endif

BPF_TABLE("lru_hash", struct ft_udp_peer, struct ft_udp_seen, udp_peers, FT_MAX_UDP_PEERS);
BPF_TABLE("lru_hash", u64, u8, udp_socks, FT_MAX_UDP_PEERS);
BPF_TABLE("lru_hash", u64, struct ft_udp_seen, udp_conn, FT_MAX_UDP_PEERS);
BPF_HASH(udp_connecting, u32, struct ft_udp_connecting, 4096);
BPF_ARRAY(udp_config, struct ft_udp_config, 1);

static __always_inline struct ft_udp_config *get_udp_config(void)
{
	u32 zero = 0;

	return udp_config.lookup(&zero);
}

static __always_inline int udp_send(struct bpf_sock_addr *ctx, u16 family)
{
	struct ft_udp_config *ucfg = get_udp_config();
	struct ft_config *cfg = get_config();
	struct ft_udp_peer key = {};
	struct ft_udp_seen *seen, n = {};
	struct ft_event e = {};
	struct bpf_sock *sk = ctx->sk;
	u64 now, last;
	u8 one = 1;
	int i;

	if (!ucfg || !cfg || !ucfg->netns_cookie || ctx->protocol != IPPROTO_UDP)
		return 1;
	if (bpf_get_netns_cookie(ctx) != ucfg->netns_cookie)
		return 1;
	key.cookie = bpf_get_socket_cookie(ctx);
	/* a dual-stack socket connected to an IPv4-mapped peer: udpv6_sendmsg
	 * gives udp_sendmsg the connected address, so sendmsg4 runs for its
	 * send()s; that flow is the connected socket's (udp_conn, egress) */
	if (family == AF_INET && sk && (u16)sk->dst_port &&
	    sk->dst_ip4 == ctx->user_ip4 && (u16)sk->dst_port == (u16)ctx->user_port &&
	    udp_conn.lookup(&key.cookie))
		return 1;
	key.family = family;
	key.rport = bpf_ntohs((u16)ctx->user_port);
	if (family == AF_INET) {
		u32 a = ctx->user_ip4;

		__builtin_memcpy(key.raddr, &a, 4);
	} else {
#pragma unroll
		for (i = 0; i < 4; i++) {
			u32 a = ctx->user_ip6[i];

			__builtin_memcpy(key.raddr + 4 * i, &a, 4);
		}
	}
	now = bpf_ktime_get_ns();
	seen = udp_peers.lookup(&key);
	if (seen) {
		last = seen->last_ns;
		seen->last_ns = now;
		if (now - last < ucfg->reopen_ns)
			return 1;
		seen->open_ns = now;	/* silent for a while: announce it again */
	}
	if (!watched_current(&e, cfg)) {
		count(FT_C_FILTERED);
		return 1;
	}
	owner_current(&e);
	e.netns_ino = cfg->netns_ino;
	e.family = family;
	e.protocol = IPPROTO_UDP;
	e.direction = FT_DIR_INBOUND;	/* answering a peer (model.Direction: see tracer.py) */
	e.cookie = key.cookie;
	e.rport = key.rport;
	__builtin_memcpy(e.raddr, key.raddr, 16);
	if (sk)
		e.lport = sk->src_port;
	if (family == AF_INET) {
		u32 a = 0;

		if (sk)
			a = sk->src_ip4;
		__builtin_memcpy(e.laddr, &a, 4);
	} else if (sk) {
#pragma unroll
		for (i = 0; i < 4; i++) {
			u32 a = sk->src_ip6[i];

			__builtin_memcpy(e.laddr + 4 * i, &a, 4);
		}
	}
	if (!seen) {
		n.last_ns = now;
		n.open_ns = now;
		udp_peers.update(&key, &n);
		udp_socks.update(&key.cookie, &one);
	}
	emit(&e, FT_OPEN, FT_F_ATTRIBUTED, now);
	return 1;
}

/* msg_src_ip4/6 (IP_PKTINFO) is readable only in the matching program */
int ft_udp_sendmsg4(struct bpf_sock_addr *ctx)
{
	return udp_send(ctx, AF_INET);
}

int ft_udp_sendmsg6(struct bpf_sock_addr *ctx)
{
	return udp_send(ctx, AF_INET6);
}

int ft_udp_release(struct bpf_sock *ctx)
{
	struct ft_udp_config *ucfg = get_udp_config();
	struct ft_config *cfg = get_config();
	struct ft_event e = {};
	u64 cookie;

	if (!ucfg || !cfg || !ucfg->netns_cookie || ctx->protocol != IPPROTO_UDP)
		return 1;
	if (bpf_get_netns_cookie(ctx) != ucfg->netns_cookie)
		return 1;
	cookie = bpf_get_socket_cookie(ctx);
	if (!udp_socks.lookup(&cookie))
		return 1;
	e.netns_ino = cfg->netns_ino;
	e.family = ctx->family;
	e.protocol = IPPROTO_UDP;
	e.cookie = cookie;
	emit(&e, FT_RELEASE, 0, bpf_ktime_get_ns());
	udp_socks.delete(&cookie);
	udp_conn.delete(&cookie);
	return 1;
}

/* Every packet a socket sends (cgroup/skb egress): a watched connected UDP
 * socket's time of sending, and WAKE when it was silent for reopen_ns. */
int ft_udp_egress(struct __sk_buff *skb)
{
	struct ft_udp_config *ucfg;
	struct ft_config *cfg;
	struct bpf_sock *sk = skb->sk;
	struct ft_udp_seen *seen;
	struct ft_event e = {};
	u64 cookie, now, last;

	if (!sk)
		return 1;
	sk = bpf_sk_fullsock(sk);
	if (!sk || sk->protocol != IPPROTO_UDP)
		return 1;
	cookie = bpf_get_socket_cookie(skb);
	seen = udp_conn.lookup(&cookie);
	if (!seen)
		return 1;
	now = bpf_ktime_get_ns();
	last = seen->last_ns;
	seen->last_ns = now;
	ucfg = get_udp_config();
	cfg = get_config();
	if (!ucfg || !cfg || now - last < ucfg->reopen_ns)
		return 1;
	seen->open_ns = now;
	e.netns_ino = cfg->netns_ino;
	e.family = sk->family;
	e.protocol = IPPROTO_UDP;
	e.cookie = cookie;
	emit(&e, FT_WAKE, FT_F_CONNECTED, now);
	return 1;
}

/* connect() of a watched thread on a UDP socket: make and keep its cookie */
static __always_inline int udp_connect(struct bpf_sock_addr *ctx)
{
	u32 tid = (u32)bpf_get_current_pid_tgid();
	struct ft_udp_connecting *c;

	if (ctx->protocol != IPPROTO_UDP)
		return 1;
	c = udp_connecting.lookup(&tid);
	if (c)
		c->cookie = bpf_get_socket_cookie(ctx);
	return 1;
}

int ft_udp_connect4(struct bpf_sock_addr *ctx)
{
	return udp_connect(ctx);
}

int ft_udp_connect6(struct bpf_sock_addr *ctx)
{
	return udp_connect(ctx);
}

TRACEPOINT_PROBE(syscalls, sys_enter_connect)
{
	struct ft_config *cfg = get_config();
	struct ft_event cur = {};
	struct ft_udp_connecting c = {};
	u32 tid;

	if (!cfg || !watched_current(&cur, cfg))
		return 0;
	tid = (u32)bpf_get_current_pid_tgid();
	c.fd = args->fd;
	udp_connecting.update(&tid, &c);
	return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_connect)
{
	struct ft_config *cfg;
	struct ft_event e = {};
	u32 tid = (u32)bpf_get_current_pid_tgid();
	struct ft_udp_connecting *c = udp_connecting.lookup(&tid);
	u64 sk, cookie;
	u16 proto = 0, family = 0, dport = 0;
	s32 fd;
	u8 one = 1;

	if (!c)
		return 0;
	fd = c->fd;
	cookie = c->cookie;
	udp_connecting.delete(&tid);
	cfg = get_config();
	if (!cfg || args->ret != 0)
		return 0;
	sk = fd_to_sk(fd);
	if (!sk)
		return 0;
	bpf_probe_read_kernel(&proto, sizeof(proto), (void *)(sk + FT_OFF_SK_PROTOCOL));
	if (proto != IPPROTO_UDP || sk_netns(sk) != cfg->netns_ino)
		return 0;
	bpf_probe_read_kernel(&family, sizeof(family), (void *)(sk + FT_OFF_SKC_FAMILY));
	bpf_probe_read_kernel(&dport, sizeof(dport), (void *)(sk + FT_OFF_SKC_DPORT));
	bpf_probe_read_kernel(&e.lport, sizeof(e.lport), (void *)(sk + FT_OFF_SKC_NUM));
	e.rport = bpf_ntohs(dport);
	if (!e.rport)
		return 0;	/* connect(AF_UNSPEC): a disconnect */
	if (family == AF_INET) {
		bpf_probe_read_kernel(e.laddr, 4, (void *)(sk + FT_OFF_SKC_RCV_SADDR));
		bpf_probe_read_kernel(e.raddr, 4, (void *)(sk + FT_OFF_SKC_DADDR));
	} else {
		bpf_probe_read_kernel(e.laddr, 16, (void *)(sk + FT_OFF_SKC_V6_RCV_SADDR));
		bpf_probe_read_kernel(e.raddr, 16, (void *)(sk + FT_OFF_SKC_V6_DADDR));
	}
	watched_current(&e, cfg);
	owner_current(&e);
	e.netns_ino = cfg->netns_ino;
	e.family = family;
	e.protocol = IPPROTO_UDP;
	e.direction = FT_DIR_OUTBOUND;
	e.cookie = cookie;
	if (cookie) {
		struct ft_udp_seen n = {};

		n.last_ns = bpf_ktime_get_ns();
		n.open_ns = n.last_ns;
		udp_socks.update(&cookie, &one);
		udp_conn.update(&cookie, &n);
	}
	emit(&e, FT_OPEN, FT_F_ATTRIBUTED | FT_F_CONNECTED, bpf_ktime_get_ns());
	return 0;
}

// SPDX-License-Identifier: GPL-2.0-only
/*
 * flowtrace.c: TCP flow open/close events for flowpacer (bcc, tracepoints only).
 * UDP flows: udptrace.c, compiled after this file as one program text (one
 * object, one ring buffer; bcc declares tracepoint records only for probes in
 * the main text, so it cannot be an #include).
 *
 * Hooks (all stable tracepoints, no kprobe/fentry needed):
 *   sock:inet_sock_set_state        every TCP state change: the 4-tuple, the
 *                                   family and the socket address (skaddr)
 *   syscalls:sys_exit_accept{,4}    which process accepted which socket
 *
 * Life of a socket in the `socks` map (key: struct sock address):
 *   CLOSE -> SYN_SENT     connect(), runs in the caller: owner = current,
 *                         watched decided here (comm/uid filter)
 *   LISTEN -> SYN_RECV    passive child created (softirq): owner unknown
 *   -> ESTABLISHED        tuple filled in (often softirq)
 *   accept() returns fd   owner = current, found by walking current's fd
 *                         table to the struct sock (offsets: see below)
 *   OPEN is sent once both "watched owner" and "established" hold (atomic
 *   fetch-or on ft_sock.bits: whichever half comes second sends it).
 *   -> FIN_WAIT2          our FIN is acknowledged: nothing left to send,
 *   -> CLOSE              the flow is over: CLOSE is sent for flows whose
 *                         OPEN was sent (once), entry deleted at CLOSE.
 * A socket the map does not hold (opened before the tracer started, or
 * evicted from the LRU map) still yields a CLOSE (flag FT_F_UNTRACKED) when
 * it goes from an established state to CLOSE, so no flow ever leaks.
 *
 * Network namespace: read from the socket (sk->__sk_common.skc_net.net->ns.inum)
 * when the socket first enters the map; only config.netns_ino is kept.
 *
 * Struct offsets (FT_OFF_*) come as -D flags computed by tracer.py from the
 * running kernel's BTF (/sys/kernel/btf/vmlinux), not from the kernel
 * headers bcc compiles with (they may be another version's). Without BTF,
 * tracer.py defines FT_OFFSETS_FROM_HEADERS, but only when the headers are
 * the running kernel's own.
 */
#include <uapi/linux/ptrace.h>
#include <linux/socket.h>
#include <linux/in.h>


#include "flowtrace.h"

#ifdef FT_OFFSETS_FROM_HEADERS
#include <net/sock.h>
#include <net/net_namespace.h>
#include <linux/fdtable.h>
#include <linux/fs.h>
#include <linux/net.h>
#include <linux/sched.h>
#define FT_OFF_SK_NET       offsetof(struct sock, __sk_common.skc_net)
#define FT_OFF_NET_INUM     offsetof(struct net, ns.inum)
#define FT_OFF_TASK_FILES   offsetof(struct task_struct, files)
#define FT_OFF_FILES_FDT    offsetof(struct files_struct, fdt)
#define FT_OFF_FDT_MAX_FDS  offsetof(struct fdtable, max_fds)
#define FT_OFF_FDT_FD       offsetof(struct fdtable, fd)
#define FT_OFF_FILE_PRIVATE offsetof(struct file, private_data)
#define FT_OFF_SOCKET_SK    offsetof(struct socket, sk)
#define FT_OFF_SK_PROTOCOL  offsetof(struct sock, sk_protocol)
#define FT_OFF_SKC_FAMILY   offsetof(struct sock, __sk_common.skc_family)
#define FT_OFF_SKC_DADDR    offsetof(struct sock, __sk_common.skc_daddr)
#define FT_OFF_SKC_RCV_SADDR offsetof(struct sock, __sk_common.skc_rcv_saddr)
#define FT_OFF_SKC_DPORT    offsetof(struct sock, __sk_common.skc_dport)
#define FT_OFF_SKC_NUM      offsetof(struct sock, __sk_common.skc_num)
#define FT_OFF_SKC_V6_DADDR offsetof(struct sock, __sk_common.skc_v6_daddr)
#define FT_OFF_SKC_V6_RCV_SADDR offsetof(struct sock, __sk_common.skc_v6_rcv_saddr)
#define FT_OFF_SK_MARK      offsetof(struct sock, sk_mark)
#define FT_OFF_SKC_BOUND_DEV_IF offsetof(struct sock, __sk_common.skc_bound_dev_if)
#endif

#if !defined(FT_OFF_SK_NET) || !defined(FT_OFF_NET_INUM) || \
    !defined(FT_OFF_TASK_FILES) || !defined(FT_OFF_FILES_FDT) || \
    !defined(FT_OFF_FDT_MAX_FDS) || !defined(FT_OFF_FDT_FD) || \
    !defined(FT_OFF_FILE_PRIVATE) || !defined(FT_OFF_SOCKET_SK) || \
    !defined(FT_OFF_SK_MARK) || !defined(FT_OFF_SKC_BOUND_DEV_IF)
#error "flowtrace.c needs the FT_OFF_* struct offsets (tracer.py passes them)"
#endif

#ifndef FT_RING_PAGES
#define FT_RING_PAGES 64
#endif
#ifndef FT_MAX_FLOWS
#define FT_MAX_FLOWS 65536
#endif
#ifndef FT_MAX_WATCH
#define FT_MAX_WATCH 1024
#endif

/* TCP states (include/net/tcp_states.h, stable ABI: also in the tracepoint) */
#define FT_TCP_ESTABLISHED 1
#define FT_TCP_SYN_SENT    2
#define FT_TCP_SYN_RECV    3
#define FT_TCP_FIN_WAIT1   4
#define FT_TCP_FIN_WAIT2   5
#define FT_TCP_TIME_WAIT   6
#define FT_TCP_CLOSE       7
#define FT_TCP_CLOSE_WAIT  8
#define FT_TCP_LAST_ACK    9
#define FT_TCP_LISTEN      10
#define FT_TCP_CLOSING     11

BPF_RINGBUF_OUTPUT(events, FT_RING_PAGES);
BPF_TABLE("lru_hash", u64, struct ft_sock, socks, FT_MAX_FLOWS);
BPF_HASH(watch_comms, struct ft_comm, u8, FT_MAX_WATCH);
BPF_HASH(watch_uids, u32, u8, FT_MAX_WATCH);
BPF_ARRAY(config, struct ft_config, 1);
BPF_PERCPU_ARRAY(counters, u64, FT_C_MAX);

static __always_inline void count(u32 idx)
{
	u64 *v = counters.lookup(&idx);

	/* per-cpu, and tracing programs do not nest on one CPU */
	if (v)
		*v += 1;
}

static __always_inline struct ft_config *get_config(void)
{
	u32 zero = 0;

	return config.lookup(&zero);
}

static __always_inline u32 sk_netns(u64 sk)
{
	u64 net = 0;
	u32 ino = 0;

	bpf_probe_read_kernel(&net, sizeof(net), (void *)(sk + FT_OFF_SK_NET));
	if (!net)
		return 0;
	bpf_probe_read_kernel(&ino, sizeof(ino), (void *)(net + FT_OFF_NET_INUM));
	return ino;
}

/* Is the calling task a target?  Fills uid and comm (the filter's inputs). */
static __always_inline int watched_current(struct ft_event *e, struct ft_config *cfg)
{
	struct ft_comm key = {};

	e->uid = (u32)bpf_get_current_uid_gid();
	bpf_get_current_comm(&key.comm, sizeof(key.comm));
	__builtin_memcpy(e->comm, key.comm, sizeof(e->comm));
	if (cfg->watch_all)
		return 1;
	if (watch_comms.lookup(&key))
		return 1;
	if (watch_uids.lookup(&e->uid))
		return 1;
	return 0;
}

/* The rest of the owner (only for targets: non-targets cost no more). */
static __always_inline void owner_current(struct ft_event *e)
{
	u64 pt = bpf_get_current_pid_tgid();

	e->pid = pt >> 32;
	e->tid = (u32)pt;
	e->cgroup_id = bpf_get_current_cgroup_id();
}

static __always_inline void emit(struct ft_event *src, u8 kind, u8 flags, u64 ts)
{
	struct ft_event *e = events.ringbuf_reserve(sizeof(*e));

	if (!e) {
		count(FT_C_LOST);
		return;
	}
	__builtin_memcpy(e, src, sizeof(*e));
	e->ts_ns = ts;
	e->kind = kind;
	e->flags = flags;
	events.ringbuf_submit(e, 0);
}

/* tuple of the inet_sock_set_state record into an ft_event (a macro: bcc
 * declares the tracepoint's record type only inside TRACEPOINT_PROBE) */
#define FILL_TUPLE(e, args)							\
	do {									\
		(e)->family = (args)->family;					\
		(e)->lport = (args)->sport;					\
		(e)->rport = (args)->dport;					\
		if ((args)->family == AF_INET) {				\
			__builtin_memset((e)->laddr, 0, sizeof((e)->laddr));	\
			__builtin_memset((e)->raddr, 0, sizeof((e)->raddr));	\
			__builtin_memcpy((e)->laddr, (args)->saddr, 4);	\
			__builtin_memcpy((e)->raddr, (args)->daddr, 4);	\
		} else {							\
			__builtin_memcpy((e)->laddr, (args)->saddr_v6, 16);	\
			__builtin_memcpy((e)->raddr, (args)->daddr_v6, 16);	\
		}								\
	} while (0)

/* what the socket's output route depends on besides its tuple and owner (issue 29:
 * which interface it leaves by): its mark and the device it is bound to, as they are
 * when it becomes established (a passive child has both from its listener by then) */
static __always_inline void fill_route(struct ft_event *e, u64 sk)
{
	bpf_probe_read_kernel(&e->mark, sizeof(e->mark), (void *)(sk + FT_OFF_SK_MARK));
	bpf_probe_read_kernel(&e->bound_if, sizeof(e->bound_if),
			      (void *)(sk + FT_OFF_SKC_BOUND_DEV_IF));
}

static __always_inline int was_established(int state)
{
	return state == FT_TCP_ESTABLISHED || state == FT_TCP_FIN_WAIT1 ||
	       state == FT_TCP_FIN_WAIT2 || state == FT_TCP_CLOSE_WAIT ||
	       state == FT_TCP_LAST_ACK || state == FT_TCP_CLOSING;
}

TRACEPOINT_PROBE(sock, inet_sock_set_state)
{
	struct ft_config *cfg;
	struct ft_sock *s;
	u64 sk = (u64)args->skaddr;
	int os = args->oldstate, ns = args->newstate;
	u64 ts, old;

	if (args->protocol != IPPROTO_TCP)
		return 0;
	cfg = get_config();
	if (!cfg)
		return 0;

	if (ns == FT_TCP_SYN_SENT) {
		/* tcp_v{4,6}_connect(): the connect() caller's context */
		struct ft_sock n = {};

		if (sk_netns(sk) != cfg->netns_ino)
			return 0;
		n.ev.netns_ino = cfg->netns_ino;
		n.ev.direction = FT_DIR_OUTBOUND;
		if (watched_current(&n.ev, cfg)) {
			owner_current(&n.ev);
			n.bits = FT_B_WATCHED;
		} else {
			count(FT_C_FILTERED);
		}
		socks.update(&sk, &n);
		return 0;
	}

	if (ns == FT_TCP_SYN_RECV && os == FT_TCP_LISTEN) {
		/* passive child cloned from the listener (softirq) */
		struct ft_sock n = {};

		if (sk_netns(sk) != cfg->netns_ino)
			return 0;
		n.ev.netns_ino = cfg->netns_ino;
		n.ev.direction = FT_DIR_INBOUND;
		socks.update(&sk, &n);
		return 0;
	}

	if (ns == FT_TCP_ESTABLISHED) {
		ts = bpf_ktime_get_ns();
		s = socks.lookup(&sk);
		if (!s) {
			/* handshake began before we started (or entry evicted) */
			struct ft_sock n = {};

			if (sk_netns(sk) != cfg->netns_ino)
				return 0;
			n.ev.netns_ino = cfg->netns_ino;
			n.ev.direction = os == FT_TCP_SYN_SENT ? FT_DIR_OUTBOUND :
					 os == FT_TCP_SYN_RECV ? FT_DIR_INBOUND :
					 FT_DIR_UNKNOWN;
			FILL_TUPLE(&n.ev, args);
			n.bits = FT_B_EST | FT_B_ADOPTED;
			socks.update(&sk, &n);
			return 0;
		}
		FILL_TUPLE(&s->ev, args);
		fill_route(&s->ev, sk);
		old = __sync_fetch_and_or(&s->bits, FT_B_EST);
		if ((old & (FT_B_WATCHED | FT_B_EST | FT_B_CLOSED)) == FT_B_WATCHED)
			emit(&s->ev, FT_OPEN, FT_F_ATTRIBUTED, ts);
		return 0;
	}

	if (ns == FT_TCP_FIN_WAIT2 || ns == FT_TCP_TIME_WAIT || ns == FT_TCP_CLOSE) {
		s = socks.lookup(&sk);
		if (s) {
			old = __sync_fetch_and_or(&s->bits, FT_B_CLOSED);
			if (!(old & FT_B_CLOSED)) {
				ts = bpf_ktime_get_ns();
				if ((old & (FT_B_WATCHED | FT_B_EST)) ==
				    (FT_B_WATCHED | FT_B_EST)) {
					emit(&s->ev, FT_CLOSE, FT_F_ATTRIBUTED, ts);
				} else if (old & FT_B_ADOPTED) {
					count(FT_C_UNATTRIBUTED);
					emit(&s->ev, FT_CLOSE, FT_F_UNTRACKED, ts);
				}
			}
			if (ns == FT_TCP_CLOSE)
				socks.delete(&sk);
			return 0;
		}
		/* never seen: predates the tracer, or evicted from the map */
		if (ns == FT_TCP_CLOSE && was_established(os)) {
			struct ft_event e = {};

			if (sk_netns(sk) != cfg->netns_ino)
				return 0;
			e.netns_ino = cfg->netns_ino;
			FILL_TUPLE(&e, args);
			count(FT_C_UNATTRIBUTED);
			emit(&e, FT_CLOSE, FT_F_UNTRACKED, bpf_ktime_get_ns());
		}
		return 0;
	}
	return 0;
}

/* fd of the calling task -> struct sock address (0 if none) */
static __always_inline u64 fd_to_sk(long fd)
{
	u64 task = bpf_get_current_task();
	u64 files = 0, fdt = 0, fdarr = 0, file = 0, sock = 0, sk = 0;
	u32 max_fds = 0;

	bpf_probe_read_kernel(&files, sizeof(files), (void *)(task + FT_OFF_TASK_FILES));
	if (!files)
		return 0;
	bpf_probe_read_kernel(&fdt, sizeof(fdt), (void *)(files + FT_OFF_FILES_FDT));
	if (!fdt)
		return 0;
	bpf_probe_read_kernel(&max_fds, sizeof(max_fds), (void *)(fdt + FT_OFF_FDT_MAX_FDS));
	if (fd < 0 || fd >= max_fds)
		return 0;
	bpf_probe_read_kernel(&fdarr, sizeof(fdarr), (void *)(fdt + FT_OFF_FDT_FD));
	if (!fdarr)
		return 0;
	bpf_probe_read_kernel(&file, sizeof(file), (void *)(fdarr + fd * sizeof(u64)));
	if (!file)
		return 0;
	bpf_probe_read_kernel(&sock, sizeof(sock), (void *)(file + FT_OFF_FILE_PRIVATE));
	if (!sock)
		return 0;
	bpf_probe_read_kernel(&sk, sizeof(sk), (void *)(sock + FT_OFF_SOCKET_SK));
	return sk;
}

static __always_inline int on_accept_exit(long ret)
{
	struct ft_config *cfg;
	struct ft_event cur = {};
	struct ft_sock *s;
	u64 sk, ts, old;

	if (ret < 0)
		return 0;
	ts = bpf_ktime_get_ns();
	cfg = get_config();
	if (!cfg)
		return 0;
	if (!watched_current(&cur, cfg)) {
		count(FT_C_FILTERED);
		return 0;
	}
	owner_current(&cur);
	sk = fd_to_sk(ret);
	s = sk ? socks.lookup(&sk) : 0;
	if (!s) {
		count(FT_C_ACCEPT_UNTRACKED);
		return 0;
	}
	if (s->bits & FT_B_WATCHED)
		return 0;	/* already attributed */
	s->ev.pid = cur.pid;
	s->ev.tid = cur.tid;
	s->ev.uid = cur.uid;
	s->ev.cgroup_id = cur.cgroup_id;
	__builtin_memcpy(s->ev.comm, cur.comm, sizeof(cur.comm));
	s->ev.direction = FT_DIR_INBOUND;
	old = __sync_fetch_and_or(&s->bits, FT_B_WATCHED);
	if ((old & (FT_B_WATCHED | FT_B_EST | FT_B_CLOSED)) == FT_B_EST)
		emit(&s->ev, FT_OPEN, FT_F_ATTRIBUTED, ts);
	return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_accept4)
{
	return on_accept_exit(args->ret);
}

TRACEPOINT_PROBE(syscalls, sys_exit_accept)
{
	return on_accept_exit(args->ret);
}

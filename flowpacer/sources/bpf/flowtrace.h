/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * flowtrace.h: types shared by the BPF program (flowtrace.c) and its
 * userspace reader (flowpacer/sources/tracer.py mirrors struct ft_event and the
 * FT_* constants; change both together: records of another size than
 * tracer.EVENT are refused and counted as bad_records).
 *
 * Plain fixed-width types only, no implicit padding: the layout is the
 * same for clang -target bpf and for the x86-64 reader.
 */
#ifndef FLOWPACER_FLOWTRACE_H
#define FLOWPACER_FLOWTRACE_H

#define FT_COMM_LEN 16

/* ft_event.kind */
#define FT_OPEN    1
#define FT_CLOSE   2
#define FT_RELEASE 3  /* a UDP socket with flows closed (udptrace.c): the flows of
                       * its cookie end */
#define FT_WAKE    4  /* a connected UDP socket silent for the shortest
                       * idle_timeout sends again (udptrace.c): its flow is
                       * open again (user space knows it by its cookie) */

/* ft_event.direction (model.Direction) */
#define FT_DIR_UNKNOWN  0
#define FT_DIR_OUTBOUND 1   /* this host called connect() */
#define FT_DIR_INBOUND  2   /* this host accepted it */

/* ft_event.flags */
#define FT_F_ATTRIBUTED 0x01 /* pid/tid/uid/comm/cgroup_id are the owner's */
#define FT_F_UNTRACKED  0x02 /* CLOSE of a flow whose OPEN the tracer never
                              * reported (it predates the tracer, or its
                              * state entry was evicted) */
#define FT_F_CONNECTED  0x04 /* UDP OPEN: a connected socket's tuple */

/* indexes of the per-cpu counters map */
#define FT_C_LOST             0 /* ring buffer reserve failed: event lost */
#define FT_C_FILTERED         1 /* connect/accept by a process not watched */
#define FT_C_UNATTRIBUTED     2 /* CLOSE sent without an owner (FT_F_UNTRACKED) */
#define FT_C_ACCEPT_UNTRACKED 3 /* watched accept() of a socket we hold no
                                 * state for (not TCP, other netns, evicted) */
#define FT_C_MAX              4

/* ft_sock.bits, set with atomic fetch-or so that the two halves of an OPEN
 * (owner known, handshake done) meet exactly once whatever the CPU order */
#define FT_B_WATCHED 0x01 /* attributed to a watched process */
#define FT_B_EST     0x02 /* reached ESTABLISHED, tuple filled in */
#define FT_B_CLOSED  0x04 /* CLOSE decided (sent or not): ignore the rest */
#define FT_B_ADOPTED 0x08 /* first seen after its start: owner unknown */

/* One event for IPv4 and IPv6.  Addresses are 16 bytes: the 4 bytes of an
 * IPv4 address first, then zeros.  Ports in host byte order.  local/remote
 * is the egress 4-tuple (local = this host's side). */
struct ft_event {
	__u64 ts_ns;      /* bpf_ktime_get_ns(): CLOCK_MONOTONIC */
	__u64 cgroup_id;  /* cgroup v2 id of the owner */
	__u32 netns_ino;  /* inode number of the socket's network namespace */
	__u32 pid;        /* tgid */
	__u32 tid;
	__u32 uid;
	__u16 family;     /* AF_INET or AF_INET6 */
	__u16 lport;
	__u16 rport;
	__u8  kind;       /* FT_OPEN / FT_CLOSE */
	__u8  direction;  /* FT_DIR_* */
	__u8  flags;      /* FT_F_* */
	__u8  protocol;   /* IPPROTO_UDP, or IPPROTO_TCP (0 too: the TCP hooks) */
	__u8  pad[6];
	__u8  laddr[16];
	__u8  raddr[16];
	char  comm[FT_COMM_LEN];
	__u64 cookie;     /* UDP: the socket's cookie (0 for TCP) */
	__u32 mark;       /* TCP OPEN: the socket's mark (sk_mark: policy routing by
	                   * fwmark), 0 otherwise */
	__u32 bound_if;   /* TCP OPEN: the ifindex of the device the socket is bound
	                   * to (SO_BINDTODEVICE, a VRF), 0 otherwise */
};                        /* 112 bytes */

/* What the program keeps per socket (key: the struct sock address). */
struct ft_sock {
	struct ft_event ev; /* owner and tuple, copied into the events */
	__u64 bits;         /* FT_B_* */
};

/* config[0] */
struct ft_config {
	__u32 netns_ino;    /* only sockets of this network namespace */
	__u32 watch_all;    /* 1: every process is a target */
};

struct ft_comm {
	char comm[FT_COMM_LEN];
};

#endif /* FLOWPACER_FLOWTRACE_H */

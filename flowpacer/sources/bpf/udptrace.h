/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * udptrace.h: types of the UDP half of the tracer (udptrace.c, compiled
 * together with flowtrace.c; tracer.py mirrors them).
 */
#ifndef FLOWPACER_UDPTRACE_H
#define FLOWPACER_UDPTRACE_H

/* One peer of one socket: the key of the udp_peers LRU map.  Addresses as
 * in struct ft_event (IPv4: 4 bytes then zeros); port in host order. */
struct ft_udp_peer {
	__u64 cookie;     /* bpf_get_socket_cookie() of the sending socket */
	__u8  raddr[16];
	__u16 rport;
	__u16 family;     /* AF_INET or AF_INET6 (of the datagrams) */
	__u32 pad;
};                        /* 32 bytes */

struct ft_udp_seen {
	__u64 last_ns;    /* bpf_ktime_get_ns() of the last datagram to the peer */
	__u64 open_ns;    /* when its OPEN was sent (again) */
};

/* A watched connect() in progress (udp_connecting, per thread). */
struct ft_udp_connecting {
	__s32 fd;         /* from sys_enter_connect */
	__u32 pad;
	__u64 cookie;     /* from cgroup/connect4|6 when the socket is UDP, else 0 */
};

/* udp_config[0] */
struct ft_udp_config {
	__u64 netns_cookie;  /* only sockets of this network namespace */
	__u64 reopen_ns;     /* a peer silent this long gets its OPEN again (the
	                      * shortest idle_timeout: user space may have ended
	                      * the flow meanwhile) */
};

#endif /* FLOWPACER_UDPTRACE_H */

/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * firstbyte.h: types shared by the sock_ops program (firstbyte.c) and its
 * owner in user space (flowpacer/sources/firstbyte.py mirrors every struct and
 * constant here; change both together).
 *
 * Plain fixed-width types, no implicit padding: the same layout for
 * clang -target bpf and for the x86-64 reader.
 */
#ifndef FLOWPACER_FIRSTBYTE_H
#define FLOWPACER_FIRSTBYTE_H

#define FB_COMM_LEN   16
#define FB_MAX_RULES  64   /* rules the kernel sees: one bit each in a u64 */
#define FB_POOL_SLOTS 64   /* ring of ready classes per rule (power of two) */

/* fb_event.direction (model.Direction) */
#define FB_DIR_OUTBOUND 1
#define FB_DIR_INBOUND  2

/* fb_event.flags */
#define FB_F_ATTRIBUTED 0x01 /* pid/uid/comm are the owner's */
#define FB_F_CLOSED     0x02 /* not a claim: the socket that claimed `classid`
                              * is closed (its priority is free again) */

/* indexes of the per-cpu counters */
#define FB_C_CLAIMED      0 /* a class was given from a pool */
#define FB_C_EMPTY        1 /* the rule matched but its pool was empty */
#define FB_C_UNDECIDED    2 /* a rule the kernel cannot decide came first */
#define FB_C_UNATTRIBUTED 3 /* owner unknown and the first rule needed it */
#define FB_C_SETSOCKOPT   4 /* bpf_setsockopt(SO_PRIORITY) failed */
#define FB_C_LOST         5 /* ring buffer full: claim not reported */
#define FB_C_NOMATCH      6 /* no rule matched */
#define FB_C_STOPGAP      7 /* no class: paced by TCP at the rule's rate (fb_rate) */
#define FB_C_MISSED       8 /* decided here but neither a class nor the stopgap */
#define FB_C_LIFTED       9 /* a stopgap lifted: its rule changed since (fb_rate.gen), or
			      * a guarded claim's class is placed (fb_placed) */
#define FB_C_GUARDED     10 /* a claim also given the stopgap (config.guard: several
			      * interfaces) until its class is on the interface it leaves by */
#define FB_C_MAX         11

/*
 * The rules as bit masks (bit i = rule i, first match wins = lowest bit).
 * A flow's candidates are the rules every part of which that the kernel
 * sees matches it; user space precomputes, per value of each part, the
 * rules it lets through:
 *   fb_lport[port], fb_rport[port]   rules whose port ranges hold port
 *                                    (all rules for a rule without ports)
 *   fb_remote (LPM)                  rules with a prefix holding the
 *                                    address, OR-ed down nested prefixes
 *   fb_comms[comm], fb_uids[uid]     rules naming that process / user
 * config[0] holds the masks of the parts with no map of their own.
 * Only a candidate whose rule is in `kernel` (no exe glob, no process
 * glob, no aggregates) may claim; the first candidate deciding otherwise
 * leaves the flow to user space (today's path).  The masks are compiled by
 * flowpacer/policy/handshake.py from model.Match's per-field declarations; a udp
 * rule is in neither `inbound` nor `outbound`; with more than FB_MAX_RULES
 * rules the last bit stands for all the rules past the first 63 (a
 * candidate of every flow, never in `kernel`).
 */
struct fb_config {
	__u64 netns_cookie;  /* only sockets of this network namespace; 0: off */
	__u64 live;          /* rules in force; 0 while user space swaps pools */
	__u64 kernel;        /* rules decided wholly here */
	__u64 inbound;       /* rules that let inbound flows through */
	__u64 outbound;      /* rules that let outbound flows through */
	__u64 any_comm;      /* rules without a process condition */
	__u64 any_uid;       /* rules without a user condition */
	__u64 any_remote;    /* rules without remote prefixes */
	__u64 guard;         /* several interfaces: claims get the stopgap too (fb_placed) */
};

/*
 * The stopgap (issue 26) of kernel rule r: fb_rate[r].  A flow decided here
 * that finds r's pool empty gets SO_MAX_PACING_RATE (TCP paces itself, no fq
 * needed) from `rate`, the class's rate in bytes/s on the wire, scaled to TCP
 * payload per segment (what TCP's pacing counts) by the program.  `gen`
 * changes whenever rule r, or a rule before it, changes (user space): a
 * stopgapped socket whose recorded gen differs has its limit lifted at its
 * next ACK (its flow's class, made for the new rules, paces it).  rate 0: no
 * stopgap for r.
 */
struct fb_rate {
	__u64 rate;          /* bytes/s as the class counts them (whole frames) */
	__u64 gen;
};

/* a stopgapped socket's record (socket storage, gone with the socket) */
struct fb_stop {
	__u32 rule;
	__u32 rate;          /* what SO_MAX_PACING_RATE was set to (payload bytes/s) */
	__u64 gen;           /* fb_rate[rule].gen when it was set */
	__u64 claim_ts;      /* a guarded claim: its event's ts_ns (0: not a claim) */
	__u32 classid;       /* ... and its class id */
	__u32 pad;
};

/*
 * Guarded claims (issue 29, several interfaces).  The program cannot tell which
 * interface a socket's route leaves by, and the pools are on the first one: a
 * claim whose flow leaves by another interface would send its head unpaced
 * until the daemon makes its class there.  With config.guard a claiming
 * socket also gets its rule's stopgap; once the flow's class is on the
 * interface it leaves by, user space writes the claim's ts_ns into
 * fb_placed[classid % FB_PLACED_SLOTS] and the socket's next ACK lifts the
 * stopgap.  ts_ns names one claim: a slot reused by a later claim of the same
 * id never lifts another socket's limit.  A guarded claim user space never
 * places (its event lost, its route on an interface not managed) keeps TCP's
 * pacing at its rule's rate until its rule changes.
 */
#define FB_PLACED_SLOTS 16384    /* pool class ids are 0xc000..0xffff: one slot each */

struct fb_comm_key {
	char  comm[FB_COMM_LEN];
};

/* LPM key: prefixlen counts the 32 bits of family, then the address bits;
 * an IPv4 address is the first 4 bytes of addr */
struct fb_remote_key {
	__u32 prefixlen;
	__u32 family;                     /* 4 or 6 */
	__u8  addr[16];
};

struct fb_owner {
	__u32 pid;
	__u32 uid;
	char  comm[FB_COMM_LEN];
};

/* One claim: a socket got class `classid` of rule `rule` at the end of its
 * handshake.  Addresses: IPv4 in the first 4 bytes; an IPv4-mapped IPv6
 * socket is reported as IPv4 (as on the wire).  Ports in host order. */
struct fb_event {
	__u64 ts_ns;       /* bpf_ktime_get_ns(): CLOCK_MONOTONIC */
	__u32 classid;
	__u32 rule;
	__u32 pid;
	__u32 uid;
	__u16 family;      /* 4 or 6 */
	__u16 lport;
	__u16 rport;
	__u8  direction;   /* FB_DIR_* */
	__u8  flags;       /* FB_F_* */
	__u8  laddr[16];
	__u8  raddr[16];
	char  comm[FB_COMM_LEN];
};                         /* 80 bytes */

#endif /* FLOWPACER_FIRSTBYTE_H */

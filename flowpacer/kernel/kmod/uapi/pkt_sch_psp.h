/* SPDX-License-Identifier: GPL-2.0 WITH Linux-syscall-note */
/*
 * pkt_sch_psp.h - netlink interface of the psp (precise software pacer) qdisc.
 *
 * The one source of truth for attribute numbers, limits and statistics
 * layouts: flowpacer/kernel/tc/psp.py mirrors it and tests/test_psp_uapi.py checks
 * the two against each other with a C compiler.
 *
 * Units: rates are bytes per second (u64), times nanoseconds, sizes bytes.
 *
 * Objects:
 *   qdisc  "psp", root, handle MAJ:.  At creation it makes its own default
 *          class MAJ:DEFCLS (unpaced: unmatched traffic, within the link rate).
 *   class  MAJ:MIN, one per paced flow, with parent the qdisc (MAJ: or root)
 *          or a group class of the same qdisc.
 *   group  MAJ:MIN with TCA_PSP_CLASS_GROUP at creation: a class that holds no
 *          packets but caps its members (classes and, one level down, groups)
 *          together at its TCA_PSP_CLASS_RATE, sharing it in proportion to
 *          their rates while they want more.  Parent: the qdisc, or a group
 *          whose parent is the qdisc (two levels: rule group, client group).
 *          Same handle space as classes; filters should not point at groups
 *          (their packets go to the default class).  A class's or group's
 *          parent is fixed at creation (change requests may repeat it); a
 *          group with members cannot be deleted (EBUSY).
 *
 * All attributes of both objects share one enum; the kernel refuses qdisc
 * attributes in class options and the other way round.
 */
#ifndef _UAPI_PKT_SCH_PSP_H
#define _UAPI_PKT_SCH_PSP_H

#include <linux/types.h>

enum {
	TCA_PSP_UNSPEC,
	TCA_PSP_PAD,		/* alignment padding in dumps, refused in requests */
	/* qdisc options */
	TCA_PSP_LINK_RATE,	/* u64 bytes/s; default: the device's ethtool speed */
	TCA_PSP_DEFCLS,		/* u32 minor of the default class (1..0xffff) */
	TCA_PSP_OVERHEAD,	/* u32 bytes added to every wire packet */
	TCA_PSP_LIMIT,		/* u32 default per-class packet limit */
	/* class options */
	TCA_PSP_CLASS_RATE,	/* u64 bytes/s, > 0 (0 in dumps: unpaced class) */
	TCA_PSP_CLASS_CEIL,	/* u64 bytes/s, >= rate; default: rate (no borrowing) */
	TCA_PSP_CLASS_LIMIT,	/* u32 packets; default: the qdisc's TCA_PSP_LIMIT */
	/* qdisc options added later (numbers are never reused or moved) */
	TCA_PSP_CATCHUP,	/* u64 ns a paced class may fall behind and make up
				 * (at <= 2x its rate); default PSP_DEFAULT_CATCHUP_NS
				 */
	/* class options added later */
	TCA_PSP_CLASS_GROUP,	/* flag: the class is a group (at creation; in dumps
				 * of groups).  A group takes TCA_PSP_CLASS_RATE (its
				 * cap) only: no ceil, no limit.
				 */
	__TCA_PSP_MAX
};

#define TCA_PSP_MAX (__TCA_PSP_MAX - 1)

#define PSP_RATE_MAX		(1ULL << 40)	/* bytes/s: ~8.8 Tbit/s */
#define PSP_OVERHEAD_MAX	1024U		/* bytes per packet */
#define PSP_LIMIT_MAX		(1U << 20)	/* packets per class */
#define PSP_DEFAULT_LIMIT	1000U		/* packets per class */
#define PSP_DEFAULT_DEFCLS	2U		/* minor of the default class */
#define PSP_CATCHUP_MAX_NS	1000000000ULL	/* 1 s */
#define PSP_DEFAULT_CATCHUP_NS	50000000ULL	/* 50 ms */

/* tc_psp_class_xstats.flags */
#define PSP_CLASS_F_UNPACED	0x1	/* no rate: served from idle link time */
#define PSP_CLASS_F_DEFAULT	0x2	/* receives unclassified traffic */
#define PSP_CLASS_F_ACTIVE	0x4	/* has packets queued (group: a member has) */
#define PSP_CLASS_F_GROUP	0x8	/* a group (aggregate cap), holds no packets */

#define PSP_GROUP_LEVELS	2	/* group levels above a class */

/* Qdisc statistics (TCA_XSTATS / TCA_STATS_APP of the qdisc). */
struct tc_psp_xstats {
	__u64	link_rate;	/* bytes/s in effect */
	__u64	rate_sum;	/* sum of the rates of the backlogged paced classes */
	__u64	paced_pkts;	/* packets sent on their class's rate clock */
	__u64	borrowed_pkts;	/* packets sent on idle link time above rate */
	__u64	unpaced_pkts;	/* packets of unpaced classes */
	__u64	late_ns_total;	/* sum of (departure - scheduled time), paced */
	__u64	late_ns_max;
	__u64	clamps;		/* times lag beyond TCA_PSP_CATCHUP was dropped */
	__u64	timer_fires;	/* dequeues at or after the armed watchdog time */
	__u64	timer_late_ns_max;	/* worst watchdog lateness seen */
	__u64	gso_split;	/* GSO packets segmented at enqueue */
	__u64	longest_run;	/* most packets one class sent in a row less than a
				 * quarter of its packet time apart (qdisc clock)
				 */
	__u32	classes;
	__u32	active;		/* classes with packets queued */
};

/* Class statistics (TCA_XSTATS / TCA_STATS_APP of a class). */
struct tc_psp_class_xstats {
	__u64	rate;		/* configured, bytes/s (0: unpaced) */
	__u64	ceil;		/* configured, bytes/s */
	__u64	eff_rate;	/* rate in effect (lower when the link or a group
			 * is oversubscribed; group: its share of its parent)
			 */
	__u64	rate_est;	/* bytes/s sent, moving average (~0.4 s) */
	__u64	borrowed_bytes;
	__u64	borrowed_pkts;
	__u64	clamps;
	__u64	late_ns_max;
	__s64	clock_ns;	/* rate clock minus now at dump time (group: its clock) */
	__u32	limit;		/* packets (0 for groups) */
	__u32	flags;		/* PSP_CLASS_F_* */
	/* groups (0 for other classes) */
	__u64	group_sum;	/* demand of the backlogged members, bytes/s */
	__u64	group_held;	/* times a member waited for the group's clock */
	__u32	members;	/* member classes and groups */
	__u32	pad;
};

#endif /* _UAPI_PKT_SCH_PSP_H */

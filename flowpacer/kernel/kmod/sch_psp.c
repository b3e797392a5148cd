// SPDX-License-Identifier: GPL-2.0
/*
 * sch_psp.c - psp: precise software pacer, a classful byte-clock qdisc.
 *
 * Each class paces its packets on a byte clock: a packet's departure time is
 * derived from the bytes the class has already sent at its rate, not from
 * timer ticks, so a late timer never lowers the long-run rate.  One hrtimer
 * (the qdisc watchdog) is armed for the earliest departure; the next class
 * comes from time-ordered rbtrees in O(log N), O(1) for the common in-order
 * inserts (each tree keeps a few sorted runs beside it).  The scheduling
 * logic lives in psp_sched.h, shared with a userspace simulator; this file
 * is the kernel glue: classes, queues, classification, netlink, statistics.
 *
 * Layout (flowpacer's daemon uses major 0xF1F0):
 *   qdisc  MAJ:     root.  Options: link rate (default: ethtool speed of the
 *                   device, required when it reports none), default class
 *                   minor, per-packet overhead, default class packet limit,
 *                   catch-up window (how much lag a class may make up after
 *                   a stall, at up to twice its rate; default 50 ms).
 *   class  MAJ:DEF  made by the qdisc itself (DEF = TCA_PSP_DEFCLS, default
 *                   2): unpaced, carries unmatched traffic within the link
 *                   rate.  Only its limit can change; it cannot be deleted.
 *   class  MAJ:N    added with parent MAJ: (or root) or a group: rate,
 *                   optional ceil, packet limit.  There is no link class.
 *   group  MAJ:N    added with TCA_PSP_CLASS_GROUP and parent MAJ: (or root)
 *                   or a top group (two levels: rule, client): rate only,
 *                   the cap of its members together (psp_sched.h, "Groups").
 *                   It holds no packets; its byte counters add up its
 *                   members'.  Parents are fixed at creation; a group with
 *                   members cannot be deleted.
 *
 * Packets: u32 (or any) filters attached to the qdisc pick a class; the
 * class can also be named in skb->priority; the rest go to the default
 * class.  Paced classes queue every wire packet: GSO packets are segmented
 * at enqueue, so offloads can stay on.  An unpaced GSO packet is segmented
 * when it would hold the link longer than PSP_UNPACED_GSO_NS.  Each class
 * is a FIFO with a packet limit and tail drop.
 *
 * Changes: every request is validated completely before anything is
 * changed; the change is then made under the tree lock.  A class's rate
 * changes in place (its queue and clock stay).  A class can be deleted while
 * traffic flows (its queue is dropped), unless a filter still points to it.
 *
 * Locks: init, change and dump run under rtnl; init and change (from
 * qdisc_create()/qdisc_change() under netdev_lock_ops()) also hold the
 * device's instance lock when the device is ops-locked, which matters from
 * 7.2 on.  Nothing called from them may take either lock again.  The only
 * device query is the default link rate in init (the ethtool speed, when the
 * request has no TCA_PSP_LINK_RATE), and since 7.2
 * __ethtool_get_link_ksettings() takes the instance lock itself: a psp qdisc
 * created without a link rate on such a device (a dummy, on Debian's 7.3.4)
 * waited for a mutex its own task held, with rtnl taken, so every later ip or
 * tc on the machine hung too.  The speed is therefore read through
 * psp_get_link_ksettings() (psp_compat.h): netif_get_link_ksettings() on 7.2+,
 * which asserts the caller's locks instead of taking them (as the kernel's
 * cbs and taprio do), __ethtool_get_link_ksettings() before (rtnl only).
 * Reading it in init keeps the documented behaviour (default: the device's
 * speed, checked when the qdisc is made; refused when it reports none),
 * which deferring the query to a work item, or requiring the rate from user
 * space, would not.
 */
#include <linux/module.h>
#include <linux/version.h>
#include <linux/types.h>
#include <linux/kernel.h>
#include <linux/errno.h>
#include <linux/slab.h>
#include <linux/skbuff.h>
#include <linux/netdevice.h>
#include <linux/ethtool.h>
#include <linux/rbtree.h>
#include <linux/math64.h>
#include <linux/prefetch.h>
#include <linux/ktime.h>
#include <net/netlink.h>
#include <net/sch_generic.h>
#include <net/pkt_sched.h>
#include <net/pkt_cls.h>

#include "psp_compat.h"		/* every kernel version difference */
#include "uapi/pkt_sch_psp.h"

#define PSP_UNPACED_GSO_NS	(50 * NSEC_PER_USEC)

/* ------------------------------------------------- psp_sched.h shims */

#include "psp_tree.h"

/* The hot head of struct psp_sclass is two cache lines. */
static inline void psp_prefetch(const void *p)
{
	prefetch(p);
	prefetch((const char *)p + L1_CACHE_BYTES);
}

static inline u64 psp_div_rem(u64 a, u64 b, u64 *rem)
{
	return div64_u64_rem(a, b, rem);
}

static inline u64 psp_mul_div(u64 a, u64 b, u64 c)
{
	return mul_u64_u64_div_u64(a, b, c);
}

#include "psp_sched.h"

/* ------------------------------------------------------------- structs */

struct psp_class {
	struct psp_sclass		sc;		/* scheduling state, hot */
	struct qdisc_skb_head		q;		/* FIFO */
	u32				limit;		/* packets */
	u32				filter_cnt;	/* filters bound to us */
	struct psp_class		*parent;	/* its group, NULL: the qdisc */
	bool				is_group;	/* a group: g, not sc and q */
	struct psp_sgroup		g;
	struct Qdisc_class_common	common;
	struct gnet_stats_basic_sync	bstats;
	struct gnet_stats_queue		qstats;		/* drops, overlimits, backlog */
	struct net_rate_estimator __rcu	*rate_est;
};

struct psp_sched_data {
	struct psp_sched		s;		/* hot */
	struct psp_class		*defclass;	/* unclassified traffic */
	u64				wd_expires;	/* armed watchdog time, 0: none */
	struct qdisc_watchdog		watchdog;
	struct tcf_proto __rcu		*filter_list;
	struct tcf_block		*block;
	struct Qdisc_class_hash		clhash;
	u32				limit;		/* default class limit */
	/* statistics */
	u64				timer_fires;
	u64				timer_late_ns_max;
	u64				gso_split;
};

/* Validated qdisc options. */
struct psp_qopt {
	u64	link_rate;
	u64	catchup_ns;
	u32	defcls;
	u32	overhead;
	u32	limit;
	bool	has_link_rate, has_defcls, has_overhead, has_limit, has_catchup;
};

/* ------------------------------------------------------------- helpers */

static struct psp_class *psp_find(u32 classid, struct Qdisc *sch)
{
	struct psp_sched_data *q = qdisc_priv(sch);
	struct Qdisc_class_common *clc;

	clc = qdisc_class_find(&q->clhash, classid);
	return clc ? container_of(clc, struct psp_class, common) : NULL;
}

static void psp_class_free(struct psp_class *cl)
{
	gen_kill_estimator(&cl->rate_est);
	__qdisc_reset_queue(&cl->q);
	kfree(cl);
}

/* Allocate a class: @rate 0 makes an unpaced class; @group a group (its
 * parent is set when it is linked in, under the tree lock).
 */
static struct psp_class *psp_class_alloc(struct psp_sched_data *q, u32 classid,
					 u64 rate, u64 ceil, u32 limit,
					 bool group)
{
	struct psp_class *cl = kzalloc(sizeof(*cl), GFP_KERNEL);

	if (!cl)
		return NULL;
	cl->common.classid = classid;
	cl->limit = limit;
	cl->is_group = group;
	gnet_stats_basic_sync_init(&cl->bstats);
	RB_CLEAR_NODE(&cl->sc.rnode.rb);
	RB_CLEAR_NODE(&cl->sc.bnode.rb);
	if (group)
		return cl;
	/* not active yet: only the class's own fields are set */
	psp_class_set(&q->s, &cl->sc, rate, ceil, 0);
	return cl;
}

/* Group levels from @cl up: 0 for NULL (the qdisc). */
static int psp_depth(const struct psp_class *cl)
{
	int d = 0;

	for (; cl; cl = cl->parent)
		d++;
	return d;
}

/* Link speed of @dev in bytes/s, 0 when it reports none.  Called from init
 * with the caller's locks held: see "Locks" above. */
static u64 psp_dev_rate(struct net_device *dev)
{
	struct ethtool_link_ksettings ks;

	if (psp_get_link_ksettings(dev, &ks))
		return 0;
	if (ks.base.speed == 0 || ks.base.speed == (u32)SPEED_UNKNOWN)
		return 0;
	return (u64)ks.base.speed * 1000000 / 8;
}

/* --------------------------------------------------------------- enqueue */

static struct psp_class *psp_classify(struct sk_buff *skb, struct Qdisc *sch,
				      int *qerr)
{
	struct psp_sched_data *q = qdisc_priv(sch);
	struct tcf_result res;
	struct tcf_proto *fl;
	struct psp_class *cl;
	int result;

	if (TC_H_MAJ(skb->priority) == sch->handle) {
		cl = psp_find(skb->priority, sch);
		if (cl && !cl->is_group)
			return cl;
	}

	*qerr = NET_XMIT_SUCCESS | __NET_XMIT_BYPASS;
	fl = rcu_dereference_bh(q->filter_list);
	result = tcf_classify(skb, NULL, fl, &res, false);
	if (result >= 0) {
#ifdef CONFIG_NET_CLS_ACT
		switch (result) {
		case TC_ACT_QUEUED:
		case TC_ACT_STOLEN:
		case TC_ACT_TRAP:
			*qerr = NET_XMIT_SUCCESS | __NET_XMIT_STOLEN;
			fallthrough;
		case TC_ACT_SHOT:
			return NULL;
		}
#endif
		cl = (struct psp_class *)res.class;
		if (!cl)
			cl = psp_find(res.classid, sch);
		if (cl && !cl->is_group)	/* groups hold no packets */
			return cl;
	}
	return q->defclass;
}

/* Wire bytes of a queued packet, as the scheduler counts them. */
static u32 psp_skb_wire(const struct psp_sched_data *q,
			const struct sk_buff *skb)
{
	u64 b = psp_wire_bytes(&q->s, qdisc_pkt_len(skb),
			       skb_is_gso(skb) ? skb_shinfo(skb)->gso_segs : 1);

	return b < U32_MAX ? (u32)b : U32_MAX;
}

static int psp_enqueue_one(struct sk_buff *skb, struct Qdisc *sch,
			   struct psp_class *cl, struct sk_buff **to_free)
{
	struct psp_sched_data *q = qdisc_priv(sch);
	unsigned int len = qdisc_pkt_len(skb);

	if (unlikely(cl->q.qlen >= cl->limit)) {
		cl->qstats.drops++;
		return qdisc_drop(skb, sch, to_free);
	}
	__qdisc_enqueue_tail(skb, &cl->q);
	cl->qstats.backlog += len;
	sch->qstats.backlog += len;
	sch->q.qlen++;
	if (cl->q.qlen == 1)
		psp_class_activate(&q->s, &cl->sc, ktime_get_ns(),
				   psp_skb_wire(q, skb));
	return NET_XMIT_SUCCESS;
}

/* Queue every segment of a GSO packet on its own (as tbf does). */
static int psp_enqueue_segs(struct sk_buff *skb, struct Qdisc *sch,
			    struct psp_class *cl, struct sk_buff **to_free)
{
	struct psp_sched_data *q = qdisc_priv(sch);
	netdev_features_t features = netif_skb_features(skb);
	unsigned int len = 0, prev_len = qdisc_pkt_len(skb);
	struct sk_buff *segs, *nskb;
	int nb = 0;

	segs = skb_gso_segment(skb, features & ~NETIF_F_GSO_MASK);
	if (IS_ERR_OR_NULL(segs))
		return qdisc_drop(skb, sch, to_free);

	q->gso_split++;
	skb_list_walk_safe(segs, segs, nskb) {
		unsigned int seg_len = segs->len;

		skb_mark_not_on_list(segs);
		qdisc_skb_cb(segs)->pkt_len = seg_len;
		psp_skb_set_one_seg(segs);
		if (psp_enqueue_one(segs, sch, cl, to_free) == NET_XMIT_SUCCESS) {
			nb++;
			len += seg_len;
		}
	}
	/* our parents counted one packet of prev_len bytes */
	if (nb > 1)
		qdisc_tree_reduce_backlog(sch, 1 - nb, (int)prev_len - (int)len);
	consume_skb(skb);
	return nb > 0 ? NET_XMIT_SUCCESS : NET_XMIT_DROP;
}

static bool psp_should_segment(const struct psp_sched_data *q,
			       const struct psp_class *cl,
			       const struct sk_buff *skb)
{
	if (!skb_is_gso(skb))
		return false;
	if (cl->sc.rate)
		return true;
	/* unpaced: only when it would hold the link too long */
	return div64_u64((u64)qdisc_pkt_len(skb) * NSEC_PER_SEC,
			 q->s.link_rate) > PSP_UNPACED_GSO_NS;
}

static int psp_enqueue(struct sk_buff *skb, struct Qdisc *sch,
		       struct sk_buff **to_free)
{
	struct psp_sched_data *q = qdisc_priv(sch);
	int ret = NET_XMIT_SUCCESS;
	struct psp_class *cl;

	cl = psp_classify(skb, sch, &ret);
	if (unlikely(!cl)) {
		if (ret & __NET_XMIT_BYPASS)
			qdisc_qstats_drop(sch);
		__qdisc_drop(skb, to_free);
		return ret;
	}
	if (psp_should_segment(q, cl, skb))
		return psp_enqueue_segs(skb, sch, cl, to_free);
	return psp_enqueue_one(skb, sch, cl, to_free);
}

/* --------------------------------------------------------------- dequeue */

static struct sk_buff *psp_dequeue(struct Qdisc *sch)
{
	struct psp_sched_data *q = qdisc_priv(sch);
	struct psp_sclass *sc, *held;
	struct psp_class *cl, *p;
	struct sk_buff *skb;
	unsigned int len;
	u64 now, next;
	int kind = PSP_SEND_NONE;

	if (!sch->q.qlen)
		return NULL;

	now = ktime_get_ns();
	if (q->wd_expires && now >= q->wd_expires) {
		q->timer_fires++;
		if (now - q->wd_expires > q->timer_late_ns_max)
			q->timer_late_ns_max = now - q->wd_expires;
		q->wd_expires = 0;
	}

	sc = psp_select(&q->s, now, &kind, &next, &held);
	if (!sc) {
		if (held)
			container_of(held, struct psp_class, sc)->qstats.overlimits++;
		if (next) {
			sch->qstats.overlimits++;
			q->wd_expires = next;
			qdisc_watchdog_schedule_range_ns(&q->watchdog, next, 0);
		}
		return NULL;
	}

	cl = container_of(sc, struct psp_class, sc);
	skb = __qdisc_dequeue_head(&cl->q);
	if (WARN_ON_ONCE(!skb)) {
		psp_class_deactivate(&q->s, sc);
		return NULL;
	}
	len = qdisc_pkt_len(skb);
	psp_charge(&q->s, sc, kind, psp_skb_wire(q, skb), now,
		   cl->q.head ? psp_skb_wire(q, cl->q.head) : 0);

	cl->qstats.backlog -= len;
	bstats_update(&cl->bstats, skb);
	for (p = cl->parent; p; p = p->parent)
		bstats_update(&p->bstats, skb);
	qdisc_qstats_backlog_dec(sch, skb);
	qdisc_bstats_update(sch, skb);
	sch->q.qlen--;
	return skb;
}

static void psp_reset(struct Qdisc *sch)
{
	struct psp_sched_data *q = qdisc_priv(sch);
	struct psp_class *cl;
	unsigned int i;

	for (i = 0; i < q->clhash.hashsize; i++) {
		hlist_for_each_entry(cl, &q->clhash.hash[i], common.hnode) {
			if (cl->is_group)
				continue;
			psp_class_deactivate(&q->s, &cl->sc);
			psp_class_reset_clocks(&cl->sc);
			__qdisc_reset_queue(&cl->q);
			cl->qstats.backlog = 0;
		}
	}
	/* all members idle now: the groups' demands are 0 */
	for (i = 0; i < q->clhash.hashsize; i++)
		hlist_for_each_entry(cl, &q->clhash.hash[i], common.hnode)
			if (cl->is_group)
				psp_group_reset_clocks(&cl->g);
	psp_sched_reset(&q->s);
	qdisc_watchdog_cancel(&q->watchdog);
	q->wd_expires = 0;
	sch->q.qlen = 0;
	sch->qstats.backlog = 0;
}

/* --------------------------------------------------------- policy/change */

static const struct nla_policy psp_qdisc_policy[TCA_PSP_MAX + 1] = {
	[TCA_PSP_LINK_RATE]	= { .type = NLA_U64 },
	[TCA_PSP_DEFCLS]	= { .type = NLA_U32 },
	[TCA_PSP_OVERHEAD]	= { .type = NLA_U32 },
	[TCA_PSP_LIMIT]		= { .type = NLA_U32 },
	[TCA_PSP_CATCHUP]	= { .type = NLA_U64 },
	[TCA_PSP_CLASS_RATE]	= { .type = NLA_REJECT,
				    .reject_message = "sch_psp: class rate given in qdisc options" },
	[TCA_PSP_CLASS_CEIL]	= { .type = NLA_REJECT,
				    .reject_message = "sch_psp: class ceil given in qdisc options" },
	[TCA_PSP_CLASS_LIMIT]	= { .type = NLA_REJECT,
				    .reject_message = "sch_psp: class limit given in qdisc options" },
	[TCA_PSP_CLASS_GROUP]	= { .type = NLA_REJECT,
				    .reject_message = "sch_psp: group flag given in qdisc options" },
};

static const struct nla_policy psp_class_policy[TCA_PSP_MAX + 1] = {
	[TCA_PSP_LINK_RATE]	= { .type = NLA_REJECT,
				    .reject_message = "sch_psp: link rate given in class options" },
	[TCA_PSP_DEFCLS]	= { .type = NLA_REJECT,
				    .reject_message = "sch_psp: default class given in class options" },
	[TCA_PSP_OVERHEAD]	= { .type = NLA_REJECT,
				    .reject_message = "sch_psp: overhead given in class options" },
	[TCA_PSP_LIMIT]		= { .type = NLA_REJECT,
				    .reject_message = "sch_psp: qdisc limit given in class options (use the class limit)" },
	[TCA_PSP_CLASS_RATE]	= { .type = NLA_U64 },
	[TCA_PSP_CLASS_CEIL]	= { .type = NLA_U64 },
	[TCA_PSP_CLASS_LIMIT]	= { .type = NLA_U32 },
	[TCA_PSP_CATCHUP]	= { .type = NLA_REJECT,
				    .reject_message = "sch_psp: catch-up window given in class options" },
	[TCA_PSP_CLASS_GROUP]	= { .type = NLA_FLAG },
};

static int psp_check_limit(u32 limit, struct netlink_ext_ack *extack)
{
	if (limit == 0) {
		NL_SET_ERR_MSG_MOD(extack, "limit must be at least 1 packet");
		return -EINVAL;
	}
	if (limit > PSP_LIMIT_MAX) {
		NL_SET_ERR_MSG_MOD(extack, "limit above 1048576 packets");
		return -EINVAL;
	}
	return 0;
}

static int psp_parse_qopt(struct Qdisc *sch, struct nlattr *opt,
			  struct psp_qopt *o, struct netlink_ext_ack *extack)
{
	struct nlattr *tb[TCA_PSP_MAX + 1];
	int err;

	memset(o, 0, sizeof(*o));
	if (!opt)
		return 0;
	err = nla_parse_nested(tb, TCA_PSP_MAX, opt, psp_qdisc_policy, extack);
	if (err < 0)
		return err;

	if (tb[TCA_PSP_LINK_RATE]) {
		o->link_rate = nla_get_u64(tb[TCA_PSP_LINK_RATE]);
		o->has_link_rate = true;
		if (o->link_rate == 0) {
			NL_SET_BAD_ATTR(extack, tb[TCA_PSP_LINK_RATE]);
			NL_SET_ERR_MSG_MOD(extack, "link rate must be > 0");
			return -EINVAL;
		}
		if (o->link_rate > PSP_RATE_MAX) {
			NL_SET_BAD_ATTR(extack, tb[TCA_PSP_LINK_RATE]);
			NL_SET_ERR_MSG_MOD(extack, "link rate above 2^40 bytes/s");
			return -ERANGE;
		}
	}
	if (tb[TCA_PSP_DEFCLS]) {
		u32 d = nla_get_u32(tb[TCA_PSP_DEFCLS]);

		if (TC_H_MAJ(d) && TC_H_MAJ(d) != sch->handle) {
			NL_SET_BAD_ATTR(extack, tb[TCA_PSP_DEFCLS]);
			NL_SET_ERR_MSG_MOD(extack, "default class is not in this qdisc");
			return -EINVAL;
		}
		if (!TC_H_MIN(d)) {
			NL_SET_BAD_ATTR(extack, tb[TCA_PSP_DEFCLS]);
			NL_SET_ERR_MSG_MOD(extack, "default class minor must be 1..0xffff");
			return -EINVAL;
		}
		o->defcls = TC_H_MIN(d);
		o->has_defcls = true;
	}
	if (tb[TCA_PSP_OVERHEAD]) {
		o->overhead = nla_get_u32(tb[TCA_PSP_OVERHEAD]);
		o->has_overhead = true;
		if (o->overhead > PSP_OVERHEAD_MAX) {
			NL_SET_BAD_ATTR(extack, tb[TCA_PSP_OVERHEAD]);
			NL_SET_ERR_MSG_MOD(extack, "overhead above 1024 bytes");
			return -EINVAL;
		}
	}
	if (tb[TCA_PSP_LIMIT]) {
		o->limit = nla_get_u32(tb[TCA_PSP_LIMIT]);
		o->has_limit = true;
		err = psp_check_limit(o->limit, extack);
		if (err)
			return err;
	}
	if (tb[TCA_PSP_CATCHUP]) {
		o->catchup_ns = nla_get_u64(tb[TCA_PSP_CATCHUP]);
		o->has_catchup = true;
		if (o->catchup_ns > PSP_CATCHUP_MAX_NS) {
			NL_SET_BAD_ATTR(extack, tb[TCA_PSP_CATCHUP]);
			NL_SET_ERR_MSG_MOD(extack, "catch-up window above 1 s");
			return -ERANGE;
		}
	}
	return 0;
}

static int psp_change(struct Qdisc *sch, struct nlattr *opt,
		      struct netlink_ext_ack *extack)
{
	struct psp_sched_data *q = qdisc_priv(sch);
	struct psp_class *def = NULL;
	struct psp_qopt o;
	u64 link_rate;
	u32 overhead;
	int err;

	err = psp_parse_qopt(sch, opt, &o, extack);
	if (err)
		return err;
	if (o.has_defcls) {
		def = psp_find(TC_H_MAKE(sch->handle, o.defcls), sch);
		if (def && def->is_group) {
			NL_SET_ERR_MSG_MOD(extack, "the default class cannot be a group");
			return -EINVAL;
		}
		if (!def) {
			NL_SET_ERR_MSG_MOD(extack, "unknown default class");
			return -ENOENT;
		}
	}
	link_rate = o.has_link_rate ? o.link_rate : q->s.link_rate;
	overhead = o.has_overhead ? o.overhead : q->s.overhead;

	sch_tree_lock(sch);
	psp_sched_set_link(&q->s, link_rate, overhead);
	if (o.has_catchup)
		psp_sched_set_catchup(&q->s, o.catchup_ns);
	if (o.has_limit)
		q->limit = o.limit;
	if (def)
		q->defclass = def;
	sch_tree_unlock(sch);
	return 0;
}

static int psp_init(struct Qdisc *sch, struct nlattr *opt,
		    struct netlink_ext_ack *extack)
{
	struct psp_sched_data *q = qdisc_priv(sch);
	struct psp_class *def;
	struct psp_qopt o;
	u64 link_rate;
	int err;

	/* first, so that destroy can always cancel it */
	qdisc_watchdog_init(&q->watchdog, sch);

	err = psp_parse_qopt(sch, opt, &o, extack);
	if (err)
		return err;
	if (!sch->handle) {
		NL_SET_ERR_MSG_MOD(extack, "psp needs a qdisc handle");
		return -EINVAL;
	}
	link_rate = o.has_link_rate ? o.link_rate : psp_dev_rate(qdisc_dev(sch));
	if (!link_rate) {
		NL_SET_ERR_MSG_MOD(extack,
				   "link rate required: the device reports no link speed");
		return -EINVAL;
	}
	if (link_rate > PSP_RATE_MAX)
		link_rate = PSP_RATE_MAX;

	err = qdisc_class_hash_init(&q->clhash);
	if (err)
		return err;
	err = tcf_block_get(&q->block, &q->filter_list, sch, extack);
	if (err)
		return err;

	q->limit = o.has_limit ? o.limit : PSP_DEFAULT_LIMIT;
	def = psp_class_alloc(q, TC_H_MAKE(sch->handle,
					   o.has_defcls ? o.defcls : PSP_DEFAULT_DEFCLS),
			      0, 0, q->limit, false);
	if (!def)
		return -ENOMEM;

	psp_sched_init(&q->s, link_rate, o.has_overhead ? o.overhead : 0,
		       o.has_catchup ? o.catchup_ns : PSP_DEFAULT_CATCHUP_NS);
	qdisc_class_hash_insert(&q->clhash, &def->common);
	q->defclass = def;
	return 0;
}

static void psp_destroy(struct Qdisc *sch)
{
	struct psp_sched_data *q = qdisc_priv(sch);
	struct hlist_node *next;
	struct psp_class *cl;
	unsigned int i;

	qdisc_watchdog_cancel(&q->watchdog);
	/* filters first: unbinding them touches the classes */
	tcf_block_put(q->block);
	for (i = 0; i < q->clhash.hashsize; i++) {
		hlist_for_each_entry_safe(cl, next, &q->clhash.hash[i],
					  common.hnode) {
			qdisc_class_hash_remove(&q->clhash, &cl->common);
			psp_class_free(cl);
		}
	}
	qdisc_class_hash_destroy(&q->clhash);
	q->defclass = NULL;
}

/* ---------------------------------------------------------- class ops */

/*
 * The group named by @parentid (NULL with *top for the qdisc itself), or an
 * error: it must be a group class of this qdisc.
 */
static int psp_parent_group(struct Qdisc *sch, u32 parentid,
			    struct psp_class **pg, struct netlink_ext_ack *extack)
{
	struct psp_class *p;

	*pg = NULL;
	if (parentid == TC_H_ROOT || parentid == TC_H_UNSPEC ||
	    parentid == sch->handle)
		return 0;
	p = psp_find(parentid, sch);
	if (!p) {
		NL_SET_ERR_MSG_MOD(extack,
				   "parent is neither this qdisc nor one of its group classes");
		return -ENOENT;
	}
	if (!p->is_group) {
		NL_SET_ERR_MSG_MOD(extack,
				   "parent class is not a group: only groups have members");
		return -EINVAL;
	}
	*pg = p;
	return 0;
}

/* Validated class options: what a request asks for, before anything changes. */
struct psp_copt {
	u64	rate, ceil;
	u32	limit;
	bool	group;
};

static int psp_parse_copt(struct Qdisc *sch, struct psp_class *cl,
			  struct nlattr **tb, struct psp_copt *o,
			  struct netlink_ext_ack *extack)
{
	struct psp_sched_data *q = qdisc_priv(sch);

	o->group = cl ? cl->is_group : !!tb[TCA_PSP_CLASS_GROUP];
	if (cl && !cl->is_group && tb[TCA_PSP_CLASS_GROUP]) {
		NL_SET_BAD_ATTR(extack, tb[TCA_PSP_CLASS_GROUP]);
		NL_SET_ERR_MSG_MOD(extack,
				   "a class cannot become a group: delete it and add the group");
		return -EINVAL;
	}
	if (o->group && tb[TCA_PSP_CLASS_CEIL]) {
		NL_SET_BAD_ATTR(extack, tb[TCA_PSP_CLASS_CEIL]);
		NL_SET_ERR_MSG_MOD(extack, "a group has no ceil: its rate is its cap");
		return -EINVAL;
	}
	if (o->group && tb[TCA_PSP_CLASS_LIMIT]) {
		NL_SET_BAD_ATTR(extack, tb[TCA_PSP_CLASS_LIMIT]);
		NL_SET_ERR_MSG_MOD(extack, "a group holds no packets: no limit");
		return -EINVAL;
	}
	if (cl && !cl->is_group && !cl->sc.rate &&
	    (tb[TCA_PSP_CLASS_RATE] || tb[TCA_PSP_CLASS_CEIL])) {
		NL_SET_ERR_MSG_MOD(extack,
				   "the default class is unpaced: only its limit can change");
		return -EINVAL;
	}
	if (cl) {
		o->rate = cl->is_group ? cl->g.rate : cl->sc.rate;
		o->ceil = cl->is_group ? cl->g.rate : cl->sc.ceil;
		if (tb[TCA_PSP_CLASS_RATE]) {
			o->rate = nla_get_u64(tb[TCA_PSP_CLASS_RATE]);
			/* a class that did not borrow keeps not borrowing */
			if (cl->is_group || cl->sc.ceil == cl->sc.rate)
				o->ceil = o->rate;
		}
		o->limit = cl->limit;
	} else {
		if (!tb[TCA_PSP_CLASS_RATE]) {
			if (o->group)
				NL_SET_ERR_MSG_MOD(extack, "psp group rate missing");
			else
				NL_SET_ERR_MSG_MOD(extack, "psp class rate missing");
			return -EINVAL;
		}
		o->rate = nla_get_u64(tb[TCA_PSP_CLASS_RATE]);
		o->ceil = o->rate;
		o->limit = o->group ? 0 : q->limit;
	}
	if (tb[TCA_PSP_CLASS_CEIL])
		o->ceil = nla_get_u64(tb[TCA_PSP_CLASS_CEIL]);
	if (tb[TCA_PSP_CLASS_LIMIT])
		o->limit = nla_get_u32(tb[TCA_PSP_CLASS_LIMIT]);

	if (!(cl && !cl->is_group && !cl->sc.rate)) {	/* unpaced: rate 0 stays */
		if (o->rate == 0) {
			NL_SET_BAD_ATTR(extack, tb[TCA_PSP_CLASS_RATE]);
			NL_SET_ERR_MSG_MOD(extack, "rate must be > 0");
			return -EINVAL;
		}
		if (o->rate > PSP_RATE_MAX) {
			NL_SET_BAD_ATTR(extack, tb[TCA_PSP_CLASS_RATE]);
			NL_SET_ERR_MSG_MOD(extack, "rate above 2^40 bytes/s");
			return -ERANGE;
		}
		if (o->ceil < o->rate) {
			NL_SET_ERR_MSG_MOD(extack, "ceil must be >= rate");
			return -EINVAL;
		}
		if (o->ceil > PSP_RATE_MAX) {
			NL_SET_BAD_ATTR(extack, tb[TCA_PSP_CLASS_CEIL]);
			NL_SET_ERR_MSG_MOD(extack, "ceil above 2^40 bytes/s");
			return -ERANGE;
		}
	}
	if (o->group)
		return 0;
	return psp_check_limit(o->limit, extack);
}

static int psp_change_class(struct Qdisc *sch, u32 classid, u32 parentid,
			    struct nlattr **tca, unsigned long *arg,
			    struct netlink_ext_ack *extack)
{
	struct psp_sched_data *q = qdisc_priv(sch);
	struct psp_class *cl = (struct psp_class *)*arg;
	struct nlattr *opt = tca[TCA_OPTIONS];
	struct nlattr *tb[TCA_PSP_MAX + 1];
	struct psp_class *pg;
	struct psp_copt o;
	int err;

	if (!opt) {
		NL_SET_ERR_MSG_MOD(extack, "psp class options missing");
		return -EINVAL;
	}
	err = nla_parse_nested(tb, TCA_PSP_MAX, opt, psp_class_policy, extack);
	if (err < 0)
		return err;
	err = psp_parent_group(sch, parentid, &pg, extack);
	if (err)
		return err;
	if (cl && parentid != TC_H_UNSPEC && pg != cl->parent) {
		NL_SET_ERR_MSG_MOD(extack,
				   "a class cannot move to another parent: delete it and add it there");
		return -EINVAL;
	}
	if (!cl && (TC_H_MAJ(classid) != sch->handle || !TC_H_MIN(classid))) {
		NL_SET_ERR_MSG_MOD(extack,
				   "class id must be MAJOR:MINOR of this qdisc, MINOR > 0");
		return -EINVAL;
	}
	err = psp_parse_copt(sch, cl, tb, &o, extack);
	if (err)
		return err;
	if (!cl && o.group && psp_depth(pg) >= PSP_GROUP_LEVELS) {
		NL_SET_ERR_MSG_MOD(extack,
				   "groups nest two levels deep at most: the parent group is already under a group");
		return -EINVAL;
	}

	if (cl) {
		if (tca[TCA_RATE]) {
			err = gen_replace_estimator(&cl->bstats, NULL,
						    &cl->rate_est, NULL, true,
						    tca[TCA_RATE]);
			if (err) {
				NL_SET_ERR_MSG_MOD(extack,
						   "bad rate estimator parameters");
				return err;
			}
		}
		sch_tree_lock(sch);
		if (cl->is_group)
			psp_group_set_rate(&q->s, &cl->g, o.rate);
		else if (cl->sc.rate)
			psp_class_set(&q->s, &cl->sc, o.rate, o.ceil,
				      ktime_get_ns());
		cl->limit = o.limit;
		sch_tree_unlock(sch);
		return 0;
	}

	cl = psp_class_alloc(q, classid, o.rate, o.ceil, o.limit, o.group);
	if (!cl)
		return -ENOMEM;
	if (tca[TCA_RATE]) {
		err = gen_new_estimator(&cl->bstats, NULL, &cl->rate_est, NULL,
					true, tca[TCA_RATE]);
		if (err) {
			NL_SET_ERR_MSG_MOD(extack, "bad rate estimator parameters");
			kfree(cl);
			return err;
		}
	}
	sch_tree_lock(sch);
	cl->parent = pg;
	if (o.group)
		psp_group_init(&cl->g, pg ? &pg->g : NULL, o.rate);
	else if (pg)
		psp_class_set_group(&q->s, &cl->sc, &pg->g, ktime_get_ns());
	qdisc_class_hash_insert(&q->clhash, &cl->common);
	sch_tree_unlock(sch);
	qdisc_class_hash_grow(sch, &q->clhash);
	*arg = (unsigned long)cl;
	return 0;
}

static int psp_delete_class(struct Qdisc *sch, unsigned long arg,
			    struct netlink_ext_ack *extack)
{
	struct psp_sched_data *q = qdisc_priv(sch);
	struct psp_class *cl = (struct psp_class *)arg;
	unsigned int qlen, backlog;

	if (cl == q->defclass) {
		NL_SET_ERR_MSG_MOD(extack, "cannot delete the default class");
		return -EBUSY;
	}
	if (cl->filter_cnt) {
		NL_SET_ERR_MSG_MOD(extack,
				   "class is used by filters: delete them first");
		return -EBUSY;
	}
	if (cl->is_group && cl->g.members) {
		NL_SET_ERR_MSG_MOD(extack,
				   "group has member classes or groups: delete them first");
		return -EBUSY;
	}

	sch_tree_lock(sch);
	if (cl->is_group) {
		psp_group_release(&cl->g);
		goto unhash;
	}
	qlen = cl->q.qlen;
	backlog = cl->qstats.backlog;
	psp_class_deactivate(&q->s, &cl->sc);
	psp_class_set_group(&q->s, &cl->sc, NULL, 0);	/* idle: no clocks move */
	__qdisc_reset_queue(&cl->q);
	if (qlen) {
		sch->q.qlen -= qlen;
		sch->qstats.backlog -= backlog;
		sch->qstats.drops += qlen;
		qdisc_tree_reduce_backlog(sch, qlen, backlog);
	}
unhash:
	qdisc_class_hash_remove(&q->clhash, &cl->common);
	sch_tree_unlock(sch);

	psp_class_free(cl);
	return 0;
}

static struct Qdisc *psp_leaf(struct Qdisc *sch, unsigned long arg)
{
	return NULL;	/* classes hold packets themselves */
}

static unsigned long psp_search_class(struct Qdisc *sch, u32 classid)
{
	return (unsigned long)psp_find(classid, sch);
}

static void psp_walk(struct Qdisc *sch, struct qdisc_walker *arg)
{
	struct psp_sched_data *q = qdisc_priv(sch);
	struct psp_class *cl;
	unsigned int i;

	if (arg->stop)
		return;
	for (i = 0; i < q->clhash.hashsize; i++) {
		hlist_for_each_entry(cl, &q->clhash.hash[i], common.hnode) {
			if (!tc_qdisc_stats_dump(sch, (unsigned long)cl, arg))
				return;
		}
	}
}

static struct tcf_block *psp_tcf_block(struct Qdisc *sch, unsigned long arg,
				       struct netlink_ext_ack *extack)
{
	struct psp_sched_data *q = qdisc_priv(sch);

	if (arg) {
		/* tc_bind_tclass() asks this of every class, without an extack, for each class
		 * made or deleted: the message (and its tracepoint) only for a request's own
		 */
		if (extack)
			NL_SET_ERR_MSG_MOD(extack,
					   "filters attach to the psp qdisc, not to its classes");
		return NULL;
	}
	return q->block;
}

static unsigned long psp_bind_tcf(struct Qdisc *sch, unsigned long parent,
				  u32 classid)
{
	struct psp_class *cl = psp_find(classid, sch);

	if (cl)
		cl->filter_cnt++;
	return (unsigned long)cl;
}

static void psp_unbind_tcf(struct Qdisc *sch, unsigned long arg)
{
	struct psp_class *cl = (struct psp_class *)arg;

	if (cl && !WARN_ON_ONCE(!cl->filter_cnt))
		cl->filter_cnt--;
}

/* ---------------------------------------------------------- init/dump */

static int psp_dump(struct Qdisc *sch, struct sk_buff *skb)
{
	struct psp_sched_data *q = qdisc_priv(sch);
	struct nlattr *nest;

	nest = nla_nest_start_noflag(skb, TCA_OPTIONS);
	if (!nest)
		goto nla_put_failure;
	if (nla_put_u64_64bit(skb, TCA_PSP_LINK_RATE, q->s.link_rate,
			      TCA_PSP_PAD) ||
	    nla_put_u32(skb, TCA_PSP_DEFCLS,
			q->defclass ? TC_H_MIN(q->defclass->common.classid) : 0) ||
	    nla_put_u32(skb, TCA_PSP_OVERHEAD, q->s.overhead) ||
	    nla_put_u32(skb, TCA_PSP_LIMIT, q->limit) ||
	    nla_put_u64_64bit(skb, TCA_PSP_CATCHUP, q->s.catchup_ns,
			      TCA_PSP_PAD))
		goto nla_put_failure;
	return nla_nest_end(skb, nest);

nla_put_failure:
	nla_nest_cancel(skb, nest);
	return -EMSGSIZE;
}

static int psp_dump_stats(struct Qdisc *sch, struct gnet_dump *d)
{
	struct psp_sched_data *q = qdisc_priv(sch);
	struct tc_psp_xstats st = {};

	sch_tree_lock(sch);
	st.link_rate = q->s.link_rate;
	st.rate_sum = q->s.rate_sum;
	st.paced_pkts = q->s.paced_pkts;
	st.borrowed_pkts = q->s.borrowed_pkts;
	st.unpaced_pkts = q->s.unpaced_pkts;
	st.late_ns_total = q->s.late_ns_total;
	st.late_ns_max = q->s.late_ns_max;
	st.clamps = q->s.clamps;
	st.timer_fires = q->timer_fires;
	st.timer_late_ns_max = q->timer_late_ns_max;
	st.gso_split = q->gso_split;
	st.longest_run = q->s.longest_run;
	st.classes = q->clhash.hashelems;
	st.active = q->s.active;
	sch_tree_unlock(sch);
	return gnet_stats_copy_app(d, &st, sizeof(st));
}

static int psp_dump_class(struct Qdisc *sch, unsigned long arg,
			  struct sk_buff *skb, struct tcmsg *tcm)
{
	struct psp_class *cl = (struct psp_class *)arg;
	struct nlattr *nest;

	tcm->tcm_parent = cl->parent ? cl->parent->common.classid : TC_H_ROOT;
	tcm->tcm_handle = cl->common.classid;
	tcm->tcm_info = 0;

	nest = nla_nest_start_noflag(skb, TCA_OPTIONS);
	if (!nest)
		goto nla_put_failure;
	if (cl->is_group) {
		if (nla_put_u64_64bit(skb, TCA_PSP_CLASS_RATE, cl->g.rate,
				      TCA_PSP_PAD) ||
		    nla_put_flag(skb, TCA_PSP_CLASS_GROUP))
			goto nla_put_failure;
		return nla_nest_end(skb, nest);
	}
	if (nla_put_u64_64bit(skb, TCA_PSP_CLASS_RATE, cl->sc.rate,
			      TCA_PSP_PAD) ||
	    nla_put_u64_64bit(skb, TCA_PSP_CLASS_CEIL, cl->sc.ceil,
			      TCA_PSP_PAD) ||
	    nla_put_u32(skb, TCA_PSP_CLASS_LIMIT, cl->limit))
		goto nla_put_failure;
	return nla_nest_end(skb, nest);

nla_put_failure:
	nla_nest_cancel(skb, nest);
	return -EMSGSIZE;
}

static int psp_dump_class_stats(struct Qdisc *sch, unsigned long arg,
				struct gnet_dump *d)
{
	struct psp_sched_data *q = qdisc_priv(sch);
	struct psp_class *cl = (struct psp_class *)arg;
	struct tc_psp_class_xstats xs = {};
	struct gnet_stats_queue qs;
	u64 now = ktime_get_ns();
	u32 qlen;

	sch_tree_lock(sch);
	qs = cl->qstats;
	qlen = cl->q.qlen;
	if (cl->is_group) {
		xs.rate = cl->g.rate;
		xs.ceil = cl->g.rate;
		xs.eff_rate = psp_group_eff_rate(&q->s, &cl->g);
		xs.rate_est = psp_group_est_read(&cl->g, now);
		xs.clock_ns = (s64)(cl->g.t_clk - now);
		xs.flags = PSP_CLASS_F_GROUP |
			   (cl->g.active ? PSP_CLASS_F_ACTIVE : 0);
		xs.group_sum = cl->g.sum;
		xs.group_held = cl->g.held;
		xs.members = cl->g.members;
		goto unlock;
	}
	xs.rate = cl->sc.rate;
	xs.ceil = cl->sc.ceil;
	xs.eff_rate = psp_eff_rate(&q->s, &cl->sc);
	xs.rate_est = psp_est_read(&cl->sc, now);
	xs.borrowed_bytes = cl->sc.borrowed_bytes;
	xs.borrowed_pkts = cl->sc.borrowed_pkts;
	xs.clamps = cl->sc.clamps;
	xs.late_ns_max = cl->sc.late_ns_max;
	xs.clock_ns = cl->sc.rate ? (s64)(cl->sc.t_rate - now) : 0;
	xs.limit = cl->limit;
	xs.flags = (cl->sc.rate ? 0 : PSP_CLASS_F_UNPACED) |
		   (cl == q->defclass ? PSP_CLASS_F_DEFAULT : 0) |
		   ((cl->sc.flags & PSP_SC_ACTIVE) ? PSP_CLASS_F_ACTIVE : 0);
unlock:
	sch_tree_unlock(sch);

	if (gnet_stats_copy_basic(d, NULL, &cl->bstats, true) < 0 ||
	    gnet_stats_copy_rate_est(d, &cl->rate_est) < 0 ||
	    gnet_stats_copy_queue(d, NULL, &qs, qlen) < 0)
		return -1;
	return gnet_stats_copy_app(d, &xs, sizeof(xs));
}

/* ----------------------------------------------------------------- ops */

static const struct Qdisc_class_ops psp_class_ops = {
	.leaf		= psp_leaf,
	.find		= psp_search_class,
	.change		= psp_change_class,
	.delete		= psp_delete_class,
	.walk		= psp_walk,
	.tcf_block	= psp_tcf_block,
	.bind_tcf	= psp_bind_tcf,
	.unbind_tcf	= psp_unbind_tcf,
	.dump		= psp_dump_class,
	.dump_stats	= psp_dump_class_stats,
};

static struct Qdisc_ops psp_qdisc_ops __read_mostly = {
	.cl_ops		= &psp_class_ops,
	.id		= "psp",
	.priv_size	= sizeof(struct psp_sched_data),
	.enqueue	= psp_enqueue,
	.dequeue	= psp_dequeue,
	.peek		= qdisc_peek_dequeued,
	.init		= psp_init,
	.reset		= psp_reset,
	.destroy	= psp_destroy,
	.change		= psp_change,
	.dump		= psp_dump,
	.dump_stats	= psp_dump_stats,
	.owner		= THIS_MODULE,
};

static int __init psp_module_init(void)
{
	return register_qdisc(&psp_qdisc_ops);
}

static void __exit psp_module_exit(void)
{
	unregister_qdisc(&psp_qdisc_ops);
}

module_init(psp_module_init);
module_exit(psp_module_exit);
PSP_MODULE_ALIAS();
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("psp: precise byte-clock pacing qdisc (flowpacer)");
MODULE_VERSION("0.1.0");

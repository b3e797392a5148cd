/* SPDX-License-Identifier: GPL-2.0 */
/*
 * psp_sched.h - scheduling core of the psp precise pacing qdisc.
 *
 * This file has no kernel dependencies.  It is compiled into the kernel
 * module (sch_psp.c) and, unchanged, into the userspace simulator
 * (sim/psp_sim.c), which drives it with a virtual clock for deterministic
 * tests.  The includer provides, before including this file:
 *
 *   u32, u64, s64, bool, likely(), unlikely(), container_of()
 *   struct psp_tnode   a tree node with members u64 key and seq (a counter)
 *   struct psp_tree    a container ordered by (key, seq), smallest first
 *   (both includers take these and the tree operations below from
 *   psp_tree.h, the same source, on the kernel's rbtree or the simulator's
 *   userspace one with the same interface, sim/kshim.h)
 *   psp_tree_init(tree)
 *   psp_tree_insert(tree, node), psp_tree_erase(tree, node),
 *   psp_tree_requeue(tree, node)  node's (key, seq) grew: move it back
 *   psp_tree_first(tree) -> node or NULL                (O(log N) or better)
 *   psp_tree_second(tree, &key) -> the node that is first once first is
 *                          gone, or NULL; its key in *key (a tree may keep
 *                          keys in its own index: the node is not touched)
 *   psp_prefetch(addr)      a cache hint, may do nothing
 *   psp_div_rem(a, b, &rem) -> a / b, rem = a % b       (64-bit)
 *   psp_mul_div(a, b, c)    -> a * b / c, 128-bit product, result fits
 *   PSP_GROUP_LEVELS        from uapi/pkt_sch_psp.h (group levels)
 *
 * Structures start zeroed (kzalloc/calloc); the init helpers set the rest.
 *
 * Algorithm: a byte clock per class ("PSPacer" idea, written from scratch).
 *
 *   Every paced class has a rate clock t_rate: the time its head packet may
 *   leave.  Sending a packet of B wire bytes (length + per-packet overhead)
 *   advances it by B * NSEC_PER_SEC / rate, with the division remainder
 *   carried to the next packet, so the long-run rate is exact.  The clock is
 *   advanced from its previous value, never set to "now + gap": a late timer
 *   delays one departure but not the ones after it.
 *
 *   The link has a clock t_link advanced the same way at the link rate; no
 *   packet leaves before it.  Classes with a ceil above their rate also have
 *   a ceil clock t_ceil advanced at the ceil for every packet they send.
 *
 *   A backlogged paced class waits in wtree, keyed by its departure time
 *   max(t_rate, t_ceil, t_min).  When that time has come it moves to
 *   etree, keyed by its deadline: departure time + the time its head packet
 *   takes at its rate (earliest deadline first among the due classes: a
 *   fast class is not held up behind a crowd of slow ones that fell due at
 *   the same time; with the rates within the link, each packet leaves
 *   within one packet time of its own, plus one link packet, of its
 *   departure time).  At most
 *   PSP_MIGRATE_MAX classes move per dequeue, so a mass wake-up never holds
 *   the lock long.  While at most one class is due it is served straight
 *   from wtree (deadlines only matter between several due classes), which
 *   costs one requeue per packet.  Borrowers also sit in btree keyed by
 *   max(t_ceil, t_min); backlogged unpaced classes sit in utree in
 *   round-robin order.  Every operation is O(log N) in the N backlogged
 *   classes, O(1) where the includer's tree makes in-order inserts cheap
 *   (both do: a few sorted runs beside the tree; among classes of one
 *   rate, departures and deadlines are inserted in the order the classes
 *   are served).
 *
 *   Order of service when the link clock allows a packet:
 *     1. the due paced class with the earliest deadline;
 *     2. else an unpaced class (the default class: unmatched traffic);
 *     3. else, if the backlogged rates leave link capacity unreserved, the
 *        borrower with the earliest ceil clock, if due ("borrowing": a
 *        borrowed packet does not move the rate clock, so the guaranteed
 *        rate is kept, and the ceil clock bounds the total).
 *   Otherwise the caller arms one timer for the earliest time anything can
 *   go (next).
 *
 * Invariants:
 *   - Late timers are made up for, without bursts: a paced class whose
 *     clock lags "now" (the timer fired late, the link was busy) catches up
 *     at no more than twice its rate.  While it lags by less than a packet
 *     time after a departure, the next one waits at least half a packet
 *     time (t_min): no two packets closer than that, so a wake-up up to two
 *     packet times late gives no back-to-back packets at all.  Only while
 *     it is still a packet time or more behind may a second packet follow
 *     at once, and after such a pair the class waits one packet time: never
 *     more than two back to back, however late the timer (pairs keep the
 *     rate where timers are routinely late by more than half a packet
 *     time, as at high rates).  The lag kept is bounded by the qdisc's
 *     catch-up window catchup_ns (or one packet time, if longer); what
 *     lies beyond is dropped and counted (clamps).  So a stall of the
 *     host shorter than the window costs no rate; a longer one costs what
 *     lies beyond the window, and the window bounds the extra a class can
 *     send at 2x after it (catchup_ns * rate bytes).
 *   - The ceil clock keeps a lag of at most PSP_CEIL_CATCHUP_NS (or two
 *     packet times at the ceil, so that a pair can form), plus what late
 *     dequeues owe it (ceil_late).  A ceil clock advances at the ceil
 *     while its class sends at its rate, so it lags whenever the class
 *     cannot borrow (the link is busy, its groups hold it); a lag kept
 *     from then would be credit above the ceil once the link frees.  But
 *     a borrower free to borrow that is sent later than its ceil clock,
 *     the link clock and its groups' clocks all allowed was late: a
 *     timer or a starved CPU, nobody else's traffic.  That lateness is
 *     added to ceil_late (at most catchup_ns, never more than the lag
 *     left), which the clock keeps as the rate clock keeps its own lag,
 *     so a lone borrower reaches its ceil wherever a paced class reaches
 *     its rate (with every wake 1.5 ms late, a borrower of ceil 6 Mbit/s
 *     sent 4.7 with a 1 ms window; tests/test_psp_sim.py).  While it is
 *     free to borrow, a borrower's catch-up pairs are judged on its ceil
 *     clock alone (its rate clock runs ahead of the borrowed packets).
 *     After a stall a borrower makes up its rate lag at up to its ceil.
 *     Borrowers pair up against their ceil's packet time.  The link clock
 *     may lag by PSP_LINK_CATCHUP_NS (or two link packets), which it
 *     makes up at the device's speed.
 *   - A class that was idle (empty queue) restarts its clocks at
 *     max(clock, now): no credit is hoarded while idle.
 *   - Oversubscription: while the rates of the backlogged paced classes add
 *     up to R > link rate L, each class's packets advance its rate clock as
 *     if its rate were rate * L / R.  Every class then gets the link in
 *     proportion to its rate, and its clock keeps pace with real time, so
 *     no class falls behind and bursts when others go idle.  rate_sum and
 *     the active count are kept up to date in O(1) as classes go busy/idle.
 *   - Unpaced classes only use link time that no due paced packet wants.
 *
 * Groups (aggregate caps: a rule's total, one client's flows of a rule):
 *
 *   A paced class may have a parent group, and a group a parent group: at
 *   most PSP_GROUP_DEPTH levels (rule group, client group under it).  A
 *   group has a rate (its cap), a byte clock t_clk advanced at that rate by
 *   every packet of its members (paced or borrowed), and the demand of its
 *   backlogged members: sum, the rates of its backlogged classes plus the
 *   demands of its backlogged groups.  A group's own demand is
 *   min(rate, sum); the link's rate_sum adds up the demands of what sits
 *   directly at the link (classes without a group, top groups), so a capped
 *   rule of many flows counts at its cap, not at its flows' total.
 *
 *   - Proportional share: while a group is oversubscribed (sum > rate) each
 *     member's packets advance its clocks as if its rate were
 *     rate * group rate / sum, level by level and then by the link's L / R,
 *     exactly as the link shares itself (2:2:2:1:1): the backlogged members
 *     of a group get its rate in proportion to their rates, each still paced
 *     on its own clock, and their clocks keep pace with real time.  Each
 *     level carries its own division remainder (grp_rem), so it is exact.
 *   - The cap: a packet leaves at the later of its class's clocks and its
 *     groups' clocks.  The scaling makes the members' clocks add up to the
 *     group's rate, so the group clock only holds a member back where the
 *     members would together go faster (catching up after a late timer,
 *     borrowing up to ceil, rates changing); then it is a hard cap: a group
 *     clock may lag by PSP_GROUP_CATCHUP_NS (or two packets at its rate)
 *     at most, as the ceil clock (a cap, not a guarantee).  Borrowing above a
 *     class's rate therefore never breaks its groups' caps.
 *   - Cost: the group clocks are checked lazily.  A class keeps t_grp, the
 *     latest of its groups' clocks it has seen (a lower bound on its
 *     departure: clocks only grow), in its departure key; it is refreshed
 *     when the class sends.  When the class chosen to send finds a group
 *     clock ahead of now, it is held: its key is raised to the next free
 *     slot of that group (t_resv: members held together get slots one packet
 *     time at the group's rate apart, in the order they were held, which is
 *     the order of their own clocks), it is requeued, O(log N), and the
 *     choice is made again (at most PSP_GATE_MAX times per dequeue, then the
 *     caller retries at once).  Without the slots a crowd of K members due
 *     together would all be held again after each packet, K requeues per
 *     packet; with them a member is held at most about once per packet it
 *     sends.  In an oversubscribed group a held member's rate clock also
 *     moves to its slot (the cap decided that departure): the members'
 *     clocks then run apart at their shares and are rarely held again, so
 *     the holds stop once the group is in step (0.1 per packet measured at
 *     100 000 classes in 1 000 groups, bench/psp_sim.py; tests/test_psp_sim.py
 *     counts them).  A packet costs O(depth + log N).  A held borrower waits at the group
 *     clock itself, so that borrowers go in the order of their ceil clocks
 *     (an even share of idle capacity); K borrowers held by one group cost
 *     up to K requeues per borrowed packet (borrowing only happens while
 *     the link has capacity nobody's rate reserves).
 *   - Going busy or idle updates the demands up the chain, O(depth), and a
 *     group that was idle restarts its clock at max(clock, now), as a class.
 *     Unpaced classes have no group.
 */
#ifndef _PSP_SCHED_H
#define _PSP_SCHED_H

#define PSP_NSEC_PER_SEC	1000000000ULL
#define PSP_TX_MAX_NS		(1ULL << 50)	/* cap on one packet's gap (~13 days) */
#define PSP_EST_WINDOW_NS	(100ULL * 1000 * 1000)	/* rate estimator window */
#define PSP_EST_SHIFT		2		/* EWMA weight 1/4 per window */
#define PSP_EST_STALE_WINDOWS	16		/* idle that long: forget the average */
#define PSP_MIGRATE_MAX		16		/* due classes moved per dequeue */
#define PSP_LINK_CATCHUP_NS	(1000ULL * 1000)	/* lag the link may make up */
#define PSP_CEIL_CATCHUP_NS	(1000ULL * 1000)	/* lag a ceil clock may make up */
#define PSP_DL_SHIFT		16		/* fixed point of dl_inv */
#define PSP_HEAD_MAX		131071		/* bytes: caps a deadline offset */
#define PSP_GROUP_DEPTH		PSP_GROUP_LEVELS	/* uapi header */
#define PSP_GROUP_CATCHUP_NS	(1000ULL * 1000)	/* lag a group clock may make up */
#define PSP_GATE_MAX		16		/* held-back classes requeued per dequeue */

enum psp_send {
	PSP_SEND_NONE,
	PSP_SEND_PACED,		/* due on the class's rate clock */
	PSP_SEND_UNPACED,	/* unpaced class, on idle link time */
	PSP_SEND_BORROW,	/* above rate, up to ceil, on idle link time */
};

#define PSP_SC_ACTIVE	0x1	/* backlogged: in the trees */
#define PSP_SC_BORROW	0x2	/* paced and ceil > rate */
#define PSP_SC_DUE	0x4	/* paced, in etree (else in wtree) */
#define PSP_SC_FIRST	0x8	/* next packet is the first after idle */
#define PSP_SC_GROUP	0x10	/* in a group (grp): the group fields, in the
				 * cold part, are read only then
				 */
#define PSP_SC_RUN_SHIFT 8	/* bits 8..15: packets in the current run */
#define PSP_SC_RUN_MAX	0xffU
#define PSP_SC_PREV_SHIFT 16	/* bits 16..31: wire bytes of the last packet */
#define PSP_SC_PREV_MAX	0xffffU

/* A group: an aggregate cap over its members (classes, groups). */
struct psp_sgroup {
	struct psp_sgroup	*parent;	/* NULL: at the link */
	u64			rate;		/* the cap, bytes/s, > 0 */
	u64			sum;		/* demand of the backlogged members */
	u64			t_clk;		/* byte clock at rate, ns */
	u64			rem;		/* its division remainder */
	u64			t_resv;		/* end of the slots given to held members */
	u32			active;		/* backlogged members */
	u32			members;	/* attached members */
	/* statistics */
	u64			est_start;
	u64			est_bytes;
	u64			rate_est;	/* bytes/s */
	u64			held;		/* times a member waited for t_clk */
};

struct psp_sclass {
	/* hot: what one packet of a paced class reads and writes; with a
	 * 40-byte rnode (the kernel's) exactly two cache lines
	 */
	struct psp_tnode	rnode;		/* wtree/etree (paced), utree */
	u64			t_rate;		/* rate clock, ns */
	u64			t_min;		/* no departure before (catch-up spacing) */
	u64			t_last;		/* last departure */
	u64			due;		/* departure time of the head */
	u64			rate;		/* bytes/s, 0 = unpaced */
	u64			rate_rem;	/* division remainder, carried */
	u64			dl_inv;		/* ns per byte << PSP_DL_SHIFT */
	u64			est_start;	/* rate estimator window */
	u64			est_bytes;
	u64			late_ns_max;
	u32			head;		/* wire bytes of the head packet */
	u32			flags;		/* PSP_SC_* */
	/* borrowers, oversubscription */
	u64			t_ceil;		/* ceil clock, ns */
	u64			ceil;		/* bytes/s, >= rate */
	u64			ceil_rem;
	u64			ceil_late;	/* lag of t_ceil late dequeues made */
	u64			scale_rem;
	struct psp_tnode	bnode;		/* btree */
	/* groups */
	struct psp_sgroup	*grp;		/* parent group, NULL: at the link */
	u64			t_grp;		/* a group clock seen: no departure before */
	u64			grp_rem[PSP_GROUP_DEPTH];	/* scaling remainders */
	/* statistics */
	u64			rate_est;	/* bytes/s */
	u64			clamps;
	u64			borrowed_bytes;
	u64			borrowed_pkts;
};

struct psp_sched {
	/* hot */
	struct psp_tree		wtree;		/* paced, waiting: by departure */
	struct psp_tree		etree;		/* paced, due: by deadline */
	struct psp_tree		utree;		/* backlogged unpaced classes */
	struct psp_tree		btree;		/* backlogged borrowers */
	u64			t_link;		/* link clock, ns */
	u64			link_rate;	/* bytes/s, > 0 */
	u64			link_rem;
	u64			catchup_ns;	/* lag a class may make up */
	u64			rate_sum;	/* demand at the link: rates of the
						 * backlogged paced classes and
						 * demands of the busy top groups
						 */
	u64			seq;		/* tie breaker: FIFO among equal keys */
	u32			overhead;	/* bytes per wire packet */
	u32			active;		/* backlogged classes */
	/* statistics */
	u64			paced_pkts;
	u64			borrowed_pkts;
	u64			unpaced_pkts;
	u64			late_ns_total;
	u64			late_ns_max;
	u64			clamps;
	u64			longest_run;	/* see tc_psp_xstats */
};

/* --------------------------------------------------------------- helpers */

static inline u64 psp_max(u64 a, u64 b)
{
	return a > b ? a : b;
}

static inline u64 psp_min(u64 a, u64 b)
{
	return a < b ? a : b;
}

/* Time to send @bytes at @rate, exact in the long run: the division
 * remainder is carried in *rem to the next packet.
 */
static inline u64 psp_tx(u64 bytes, u64 rate, u64 *rem)
{
	return psp_div_rem(bytes * PSP_NSEC_PER_SEC + *rem, rate, rem);
}

static inline bool psp_oversubscribed(const struct psp_sched *q)
{
	return q->rate_sum > q->link_rate;
}

/*
 * A paced gap stretched by R / L while oversubscribed, exact in the long
 * run: the remainder of tx * R / L (in units of 1/L ns) is carried in *rem.
 * It is the low 64 bits of tx * R - q * L, which are exact as it is < L.
 */
static inline u64 psp_scale(u64 tx, u64 sum, u64 cap, u64 *rem)
{
	u64 r, whole, quot;

	if (likely(sum <= cap))
		return tx;
	whole = psp_div_rem(sum, cap, &r);
	if (tx >= PSP_TX_MAX_NS / (whole + 1))
		return PSP_TX_MAX_NS;
	quot = psp_mul_div(tx, sum, cap);
	r = tx * sum - quot * cap + *rem;
	if (r >= cap) {
		r -= cap;
		quot++;
	}
	*rem = r;
	return quot;
}

static inline u64 psp_scaled(const struct psp_sched *q, u64 tx, u64 *rem)
{
	return psp_scale(tx, q->rate_sum, q->link_rate, rem);
}

/* The same stretch for each oversubscribed group of @c, innermost first. */
static inline u64 psp_group_scaled(struct psp_sclass *c, u64 tx)
{
	struct psp_sgroup *g;
	int i;

	if (likely(!(c->flags & PSP_SC_GROUP)))
		return tx;
	g = c->grp;
	for (i = 0; g && i < PSP_GROUP_DEPTH; i++, g = g->parent)
		tx = psp_scale(tx, g->sum, g->rate, &c->grp_rem[i]);
	return tx;
}

/* Rate a paced class gets now: rate * G / S for each oversubscribed group,
 * then * L / R when the link is oversubscribed.
 */
static inline u64 psp_eff_rate(const struct psp_sched *q,
			       const struct psp_sclass *c)
{
	const struct psp_sgroup *g;
	u64 r = c->rate;

	if (!r)
		return 0;
	for (g = c->grp; g; g = g->parent)
		if (g->sum > g->rate)
			r = psp_mul_div(r, g->rate, g->sum);
	if (psp_oversubscribed(q))
		r = psp_mul_div(r, q->link_rate, q->rate_sum);
	return r;
}

/* ------------------------------------------------------- rate estimator */

static inline u64 psp_est_fold(u64 est, u64 bytes, u64 dt)
{
	u64 sample = psp_mul_div(bytes, PSP_NSEC_PER_SEC, dt);

	if (dt >= PSP_EST_STALE_WINDOWS * PSP_EST_WINDOW_NS)
		return sample;
	return est - (est >> PSP_EST_SHIFT) + (sample >> PSP_EST_SHIFT);
}

/* One estimator (a class's or a group's): @bytes sent at @now. */
static inline void psp_est_update(u64 *est, u64 *start, u64 *acc, u64 bytes,
				  u64 now)
{
	u64 dt = now - *start;

	*acc += bytes;
	if (dt < PSP_EST_WINDOW_NS)
		return;
	*est = psp_est_fold(*est, *acc, dt);
	*start = now;
	*acc = 0;
}

/* The estimate as of @now, counting the idle time since the last packet. */
static inline u64 psp_est_value(u64 est, u64 start, u64 acc, u64 now)
{
	u64 dt = now - start;

	if (now < start || dt < PSP_EST_WINDOW_NS)
		return est;
	return psp_est_fold(est, acc, dt);
}

static inline void psp_est_add(struct psp_sclass *c, u64 bytes, u64 now)
{
	psp_est_update(&c->rate_est, &c->est_start, &c->est_bytes, bytes, now);
}

static inline u64 psp_est_read(const struct psp_sclass *c, u64 now)
{
	return psp_est_value(c->rate_est, c->est_start, c->est_bytes, now);
}

/* ---------------------------------------------------------------- groups */

/* Rate a busy group gets now: its demand, scaled as a class's rate. */
static inline u64 psp_group_eff_rate(const struct psp_sched *q,
				     const struct psp_sgroup *g)
{
	const struct psp_sgroup *p;
	u64 r = g->sum < g->rate ? g->sum : g->rate;

	for (p = g->parent; p; p = p->parent)
		if (p->sum > p->rate)
			r = psp_mul_div(r, p->rate, p->sum);
	if (psp_oversubscribed(q))
		r = psp_mul_div(r, q->link_rate, q->rate_sum);
	return r;
}

/* What a group asks of its parent (or the link): min(rate, sum). */
static inline u64 psp_group_demand(const struct psp_sgroup *g)
{
	return g->sum < g->rate ? g->sum : g->rate;
}

/* A member of @g (NULL: the link) now demands @add instead of @sub: the
 * sums up the chain follow, as far as a demand changes.  O(depth).
 */
static inline void psp_demand_move(struct psp_sched *q, struct psp_sgroup *g,
				   u64 sub, u64 add)
{
	for (; g; g = g->parent) {
		u64 before = psp_group_demand(g);

		g->sum = g->sum - sub + add;
		sub = before;
		add = psp_group_demand(g);
		if (sub == add)
			return;
	}
	q->rate_sum = q->rate_sum - sub + add;
}

/* A member of @g went busy: groups that were idle restart their clocks. */
static inline void psp_groups_busy(struct psp_sgroup *g, u64 now)
{
	for (; g; g = g->parent) {
		if (g->active++)
			return;
		if (g->t_clk < now)
			g->t_clk = now;	/* idle: no credit */
		g->t_resv = 0;
	}
}

static inline void psp_groups_idle(struct psp_sgroup *g)
{
	for (; g; g = g->parent)
		if (--g->active)
			return;
}

/* The latest of @c's groups' clocks. */
static inline u64 psp_group_gate(const struct psp_sclass *c)
{
	const struct psp_sgroup *g;
	u64 t = 0;

	for (g = c->grp; g; g = g->parent)
		t = psp_max(t, g->t_clk);
	return t;
}

static inline void psp_group_est_add(struct psp_sgroup *g, u64 bytes, u64 now)
{
	psp_est_update(&g->rate_est, &g->est_start, &g->est_bytes, bytes, now);
}

static inline u64 psp_group_est_read(const struct psp_sgroup *g, u64 now)
{
	return psp_est_value(g->rate_est, g->est_start, g->est_bytes, now);
}

static inline u64 psp_wire_bytes(const struct psp_sched *q, u64 len, u32 segs)
{
	return len + (u64)q->overhead * (segs ? segs : 1);
}

/* Departure time of a paced class's head packet. */
static inline u64 psp_rkey(const struct psp_sclass *c)
{
	u64 t = psp_max(c->t_rate, c->t_min);

	if (unlikely(c->flags & PSP_SC_GROUP))
		t = psp_max(t, c->t_grp);
	if (c->flags & PSP_SC_BORROW)
		return psp_max(t, c->t_ceil);
	return t;
}

/* Earliest time a borrower may send above its rate. */
static inline u64 psp_bkey(const struct psp_sclass *c)
{
	return psp_max(c->t_ceil, c->t_min);
}

/* Deadline of a class due at @due: + its head packet's time at its rate. */
static inline u64 psp_deadline(const struct psp_sclass *c, u64 due)
{
	u64 b = c->head < PSP_HEAD_MAX ? c->head : PSP_HEAD_MAX;

	return due + ((b * c->dl_inv) >> PSP_DL_SHIFT);
}

static inline void psp_tree_put(struct psp_sched *q, struct psp_tree *t,
				struct psp_tnode *n, u64 key)
{
	n->key = key;
	n->seq = q->seq++;
	psp_tree_insert(t, n);
}

/* Requeue a node whose key did not decrease (clocks only move forward). */
static inline void psp_tree_move(struct psp_sched *q, struct psp_tree *t,
				 struct psp_tnode *n, u64 key)
{
	n->key = key;
	n->seq = q->seq++;
	psp_tree_requeue(t, n);
}

/* Put a paced class that is in neither tree into wtree or etree. */
static inline void psp_paced_put(struct psp_sched *q, struct psp_sclass *c,
				 u64 now)
{
	c->due = psp_rkey(c);
	if (c->due <= now) {
		c->flags |= PSP_SC_DUE;
		psp_tree_put(q, &q->etree, &c->rnode, psp_deadline(c, c->due));
	} else {
		c->flags &= ~PSP_SC_DUE;
		psp_tree_put(q, &q->wtree, &c->rnode, c->due);
	}
}

static inline void psp_paced_erase(struct psp_sched *q, struct psp_sclass *c)
{
	psp_tree_erase((c->flags & PSP_SC_DUE) ? &q->etree : &q->wtree,
		       &c->rnode);
	c->flags &= ~PSP_SC_DUE;
}

/* Advance a clock by @tx for a packet leaving at @now; the clock may lag
 * now by @keep (at least @tx) before the rest of the lag is dropped.
 */
static inline bool psp_clock_advance(u64 *clock, u64 tx, u64 now, u64 keep)
{
	bool clamped = false;

	if (keep < tx)
		keep = tx;
	if (*clock + keep < now) {
		*clock = now - keep;
		clamped = true;
	}
	*clock += tx;
	return clamped;
}

/* ------------------------------------------------------- setup / change */

static inline void psp_sched_set_link(struct psp_sched *q, u64 link_rate,
				      u32 overhead)
{
	if (q->link_rate != link_rate)
		q->link_rem = 0;
	q->link_rate = link_rate;
	q->overhead = overhead;
}

/* The catch-up window: how far a paced class's clocks may lag "now".
 * Takes effect at the next packet; a lag already above it is cut then.
 */
static inline void psp_sched_set_catchup(struct psp_sched *q, u64 catchup_ns)
{
	q->catchup_ns = catchup_ns;
}

static inline void psp_sched_init(struct psp_sched *q, u64 link_rate,
				  u32 overhead, u64 catchup_ns)
{
	psp_tree_init(&q->wtree);
	psp_tree_init(&q->etree);
	psp_tree_init(&q->utree);
	psp_tree_init(&q->btree);
	psp_sched_set_link(q, link_rate, overhead);
	psp_sched_set_catchup(q, catchup_ns);
}

/* Put a class that has just got its first packet (@head wire bytes) into
 * the trees.
 */
static inline void psp_class_activate(struct psp_sched *q,
				      struct psp_sclass *c, u64 now, u32 head)
{
	if (c->flags & PSP_SC_ACTIVE)
		return;
	c->head = head;
	c->flags |= PSP_SC_ACTIVE | PSP_SC_FIRST;
	q->active++;
	if (!c->rate) {
		psp_tree_put(q, &q->utree, &c->rnode, 0);
		return;
	}
	if (c->t_rate < now)
		c->t_rate = now;	/* idle: no credit */
	if (c->flags & PSP_SC_GROUP) {
		psp_groups_busy(c->grp, now);
		psp_demand_move(q, c->grp, 0, c->rate);
	} else {
		q->rate_sum += c->rate;
	}
	if (c->flags & PSP_SC_BORROW) {
		if (c->t_ceil < now)
			c->t_ceil = now;
		c->ceil_late = 0;
		psp_tree_put(q, &q->btree, &c->bnode, psp_bkey(c));
	}
	psp_paced_put(q, c, now);
}

/* Take a class out of the trees: its queue is empty or being purged. */
static inline void psp_class_deactivate(struct psp_sched *q,
					struct psp_sclass *c)
{
	if (!(c->flags & PSP_SC_ACTIVE))
		return;
	c->flags &= ~PSP_SC_ACTIVE;
	q->active--;
	if (!c->rate) {
		psp_tree_erase(&q->utree, &c->rnode);
		return;
	}
	psp_paced_erase(q, c);
	if (c->flags & PSP_SC_BORROW)
		psp_tree_erase(&q->btree, &c->bnode);
	if (c->flags & PSP_SC_GROUP) {
		psp_demand_move(q, c->grp, c->rate, 0);
		psp_groups_idle(c->grp);
	} else {
		q->rate_sum -= c->rate;
	}
}

/* Set a class's rate and ceil (bytes/s; rate 0: unpaced), also while it is
 * backlogged: the queue and the clocks stay, the next gap uses the new rate.
 */
static inline void psp_class_set(struct psp_sched *q, struct psp_sclass *c,
				 u64 rate, u64 ceil, u64 now)
{
	bool active = c->flags & PSP_SC_ACTIVE;
	u64 rem;

	if (active)
		psp_class_deactivate(q, c);
	if (c->rate != rate)
		c->rate_rem = 0;
	if (c->ceil != ceil)
		c->ceil_rem = 0;
	c->rate = rate;
	c->ceil = ceil < rate ? rate : ceil;
	if (rate)
		c->dl_inv = psp_div_rem(PSP_NSEC_PER_SEC << PSP_DL_SHIFT, rate,
					&rem);
	if (rate && c->ceil > rate)
		c->flags |= PSP_SC_BORROW;
	else
		c->flags &= ~PSP_SC_BORROW;
	if (active)
		psp_class_activate(q, c, now, c->head);
}

/* A new group under @parent (NULL: the link) with cap @rate (bytes/s, > 0);
 * its parent never changes.  Idle until a member has packets.
 */
static inline void psp_group_init(struct psp_sgroup *g,
				  struct psp_sgroup *parent, u64 rate)
{
	g->parent = parent;
	g->rate = rate;
	if (parent)
		parent->members++;
}

/* A group's cap changes, also while busy: the demands up the chain follow. */
static inline void psp_group_set_rate(struct psp_sched *q,
				      struct psp_sgroup *g, u64 rate)
{
	u64 before = psp_group_demand(g);

	if (g->rate != rate)
		g->rem = 0;
	g->rate = rate;
	psp_demand_move(q, g->parent, before, psp_group_demand(g));
}

/* A group without members goes. */
static inline void psp_group_release(struct psp_sgroup *g)
{
	if (g->parent)
		g->parent->members--;
	g->parent = NULL;
}

/* Put a paced class into group @g (NULL: at the link), also while it is
 * backlogged (its queue and own clocks stay).
 */
static inline void psp_class_set_group(struct psp_sched *q,
				       struct psp_sclass *c,
				       struct psp_sgroup *g, u64 now)
{
	bool active = c->flags & PSP_SC_ACTIVE;
	int i;

	if (c->grp == g)
		return;
	if (active)
		psp_class_deactivate(q, c);
	if (c->grp)
		c->grp->members--;
	c->grp = g;
	if (g) {
		g->members++;
		c->flags |= PSP_SC_GROUP;
	} else {
		c->flags &= ~PSP_SC_GROUP;
	}
	c->t_grp = 0;
	for (i = 0; i < PSP_GROUP_DEPTH; i++)
		c->grp_rem[i] = 0;
	if (active)
		psp_class_activate(q, c, now, c->head);
}

/* --------------------------------------------------------------- dequeue */

/* Move paced classes whose departure time has come from wtree to etree. */
static inline void psp_migrate(struct psp_sched *q, u64 now)
{
	struct psp_tnode *n;
	int i;

	for (i = 0; i < PSP_MIGRATE_MAX; i++) {
		struct psp_sclass *c;

		n = psp_tree_first(&q->wtree);
		if (!n || n->key > now)
			return;
		c = container_of(n, struct psp_sclass, rnode);
		psp_tree_erase(&q->wtree, n);
		c->flags |= PSP_SC_DUE;
		psp_tree_put(q, &q->etree, n, psp_deadline(c, c->due));
	}
}

/* One choice of psp_select() below, group clocks not looked at. */
static inline struct psp_sclass *psp_select_once(struct psp_sched *q, u64 now,
						 int *kind, u64 *next,
						 struct psp_sclass **held)
{
	struct psp_tnode *e, *w, *u, *b = NULL;
	u64 wake = ~0ULL;

	*held = NULL;
	*next = 0;
	if (!q->active)
		return NULL;
	e = psp_tree_first(&q->etree);
	w = psp_tree_first(&q->wtree);
	if (w && w->key <= now) {
		u64 k2 = 0;
		struct psp_tnode *w2 = e ? NULL : psp_tree_second(&q->wtree, &k2);

		if (!e && (!w2 || k2 > now)) {
			/* the only due class: no deadline to compare; the
			 * second is likely the next to go, warm it up
			 */
			if (w2)
				psp_prefetch(container_of(w2, struct psp_sclass,
							  rnode));
			if (q->t_link > now) {
				*next = q->t_link;
				return NULL;
			}
			*kind = PSP_SEND_PACED;
			return container_of(w, struct psp_sclass, rnode);
		}
		psp_migrate(q, now);
		e = psp_tree_first(&q->etree);
		w = psp_tree_first(&q->wtree);
	}
	u = psp_tree_first(&q->utree);
	if (q->rate_sum < q->link_rate)
		b = psp_tree_first(&q->btree);
	if (e || u)
		wake = now;
	else if (w)
		wake = w->key;
	if (b && b->key < wake)
		wake = b->key;
	if (wake < q->t_link)
		wake = q->t_link;
	if (wake > now) {
		*next = wake;
		if (!e && w && w->key > now)
			*held = container_of(w, struct psp_sclass, rnode);
		return NULL;
	}
	if (e) {
		*kind = PSP_SEND_PACED;
		return container_of(e, struct psp_sclass, rnode);
	}
	if (u) {
		*kind = PSP_SEND_UNPACED;
		return container_of(u, struct psp_sclass, rnode);
	}
	*kind = PSP_SEND_BORROW;
	return container_of(b, struct psp_sclass, bnode);
}

/* @c, chosen to send as @kind, finds a group clock at @gate > now: it waits
 * for it, its key raised to the group's clock (see "Cost" above).
 */
static inline void psp_hold(struct psp_sched *q, struct psp_sclass *c,
			    int kind, u64 gate, u64 now)
{
	struct psp_sgroup *g;
	u64 rem;

	for (g = c->grp; g->t_clk != gate; g = g->parent)
		;
	g->held++;
	if (kind == PSP_SEND_BORROW) {
		/* Held at the group's clock itself, no slot, and the gate is
		 * not kept in the borrow key after the class sends (t_grp is
		 * not in psp_bkey()): borrowers held by one group then go in
		 * the order of their ceil clocks, the one that borrowed least
		 * first, so they share what is idle evenly.  The price: K
		 * borrowers held together are requeued up to K times per
		 * borrowed packet.  Its rnode keeps a lower key: it is held
		 * again there.
		 */
		psp_tree_move(q, &q->btree, &c->bnode,
			      psp_max(psp_bkey(c), gate));
		return;
	}
	/* paced: the next free slot of the group that holds it; members
	 * held together get successive slots a packet time at the group's
	 * rate apart, so the crowd is not held again at every packet
	 */
	if (g->t_resv > gate)
		gate = g->t_resv;
	g->t_resv = gate + psp_div_rem((u64)c->head * PSP_NSEC_PER_SEC, g->rate,
				       &rem);
	c->t_grp = gate;
	/* In an oversubscribed group its own clock moves to the slot too:
	 * the cap, not the class's rate, decided this departure, and a lag
	 * kept would have it held again at every packet; from the slot on
	 * the members' clocks run apart at their shares, and none is held
	 * while they stay in step.  In a group within its cap the lag stays
	 * (a borrower or a catch-up took the slot; the rate is owed).
	 */
	if (g->sum > g->rate && c->t_rate < gate)
		c->t_rate = gate;
	if (c->flags & PSP_SC_DUE) {
		psp_paced_erase(q, c);
		psp_paced_put(q, c, now);	/* into wtree: due > now */
	} else {
		c->due = psp_rkey(c);
		psp_tree_move(q, &q->wtree, &c->rnode, c->due);
	}
}

/*
 * Which class sends at @now.  Returns NULL when nothing may leave yet; then
 * *next is the earliest time something can (0: nothing is queued) and *held
 * the paced class that waits for its rate, if any (for overlimit counts).
 * A class held back by a group clock is requeued and the choice made again.
 */
static inline struct psp_sclass *psp_select(struct psp_sched *q, u64 now,
					    int *kind, u64 *next,
					    struct psp_sclass **held)
{
	struct psp_sclass *c;
	int i;

	for (i = 0; i < PSP_GATE_MAX; i++) {
		u64 gate;

		c = psp_select_once(q, now, kind, next, held);
		if (!c || likely(!(c->flags & PSP_SC_GROUP)))
			return c;
		gate = psp_group_gate(c);
		if (gate <= now)
			return c;
		psp_hold(q, c, *kind, gate, now);
	}
	/* many held at once: let the caller come back right away */
	*held = NULL;
	*next = now + 1;
	return NULL;
}

/*
 * Runs as a capture on the wire counts them, by the qdisc's clock: a
 * class's packet sent less than a quarter of the previous packet's time at
 * the class's rate after it extends the run.  The catch-up rule keeps runs
 * at 2 or less; longest_run lets a measurement on the wire tell its own
 * timing (a vCPU stalled between dequeue and device) from ours.  The run
 * and the previous packet's size live in spare bits of flags, and dl_inv
 * is on the same cache line: nothing more is touched per packet.
 */
static inline void psp_count_run(struct psp_sched *q, struct psp_sclass *c,
				 u64 now, u64 bytes)
{
	u32 run = (c->flags >> PSP_SC_RUN_SHIFT) & PSP_SC_RUN_MAX;
	u64 prev = c->flags >> PSP_SC_PREV_SHIFT;

	if (!(c->flags & PSP_SC_FIRST) &&
	    now - c->t_last < (prev * c->dl_inv) >> (PSP_DL_SHIFT + 2))
		run += run < PSP_SC_RUN_MAX;
	else
		run = 1;
	if (bytes > PSP_SC_PREV_MAX)
		bytes = PSP_SC_PREV_MAX;
	c->flags = (c->flags & ((1U << PSP_SC_RUN_SHIFT) - 1)) |
		   run << PSP_SC_RUN_SHIFT | (u32)bytes << PSP_SC_PREV_SHIFT;
	if (run > q->longest_run)
		q->longest_run = run;
}

/*
 * Account a packet of @bytes wire bytes that class @c sent at @now as
 * @kind; @next: wire bytes of its new head packet, 0 when its queue is empty.
 */
static inline void psp_charge(struct psp_sched *q, struct psp_sclass *c,
			      int kind, u64 bytes, u64 now, u32 next)
{
	u64 tx, late, ref = 0, free_at = q->t_link;
	bool borrowing = (c->flags & PSP_SC_BORROW) &&
			 q->rate_sum < q->link_rate;

	tx = psp_tx(bytes, q->link_rate, &q->link_rem);
	psp_clock_advance(&q->t_link, tx, now,
			  psp_max(PSP_LINK_CATCHUP_NS, 2 * tx));

	switch (kind) {
	case PSP_SEND_PACED:
		late = now - c->due;
		q->paced_pkts++;
		q->late_ns_total += late;
		if (late > q->late_ns_max)
			q->late_ns_max = late;
		if (late > c->late_ns_max)
			c->late_ns_max = late;
		tx = psp_scaled(q, psp_group_scaled(c, psp_tx(bytes, c->rate,
							      &c->rate_rem)),
				&c->scale_rem);
		if (psp_clock_advance(&c->t_rate, tx, now, q->catchup_ns)) {
			c->clamps++;
			q->clamps++;
		}
		ref = tx;
		break;
	case PSP_SEND_BORROW:
		c->borrowed_bytes += bytes;
		c->borrowed_pkts++;
		q->borrowed_pkts++;
		break;
	default:
		q->unpaced_pkts++;
		break;
	}
	if (c->flags & PSP_SC_GROUP) {
		/* paced or borrowed: every member's packet runs its groups'
		 * clocks; the class waits for the latest
		 */
		struct psp_sgroup *g;
		u64 gate = 0;

		for (g = c->grp; g; g = g->parent) {
			u64 gtx = psp_tx(bytes, g->rate, &g->rem);

			if (g->t_clk > free_at)
				free_at = g->t_clk;	/* held by the cap */
			psp_clock_advance(&g->t_clk, gtx, now,
					  psp_max(PSP_GROUP_CATCHUP_NS, 2 * gtx));
			psp_group_est_add(g, bytes, now);
			gate = psp_max(gate, g->t_clk);
		}
		c->t_grp = gate;
	}
	if (c->flags & PSP_SC_BORROW) {
		u64 lag, keep;

		tx = psp_tx(bytes, c->ceil, &c->ceil_rem);
		keep = psp_max(PSP_CEIL_CATCHUP_NS, 2 * tx);

		if (borrowing) {
			/* free to borrow, yet sent later than its ceil clock,
			 * the link and its groups allowed: a late dequeue,
			 * owed as a paced class's lag is
			 */
			u64 from = psp_max(c->t_ceil, free_at);

			if (now > from)
				c->ceil_late = psp_min(c->ceil_late + now - from,
						       q->catchup_ns);
		}
		psp_clock_advance(&c->t_ceil, tx, now,
				  psp_max(keep, c->ceil_late));
		/* what is made up is no longer owed */
		lag = c->t_ceil < now ? now - c->t_ceil : 0;
		if (c->ceil_late > lag)
			c->ceil_late = lag;
		ref = tx;	/* a borrower may go as fast as its ceil */
	}
	if (c->rate) {
		/* the clock its next departure waits for: a borrower free
		 * to borrow goes on its ceil clock alone
		 */
		u64 clk = borrowing ? psp_max(c->t_ceil, (c->flags & PSP_SC_GROUP) ?
						   c->t_grp : 0) :
			  c->flags & PSP_SC_BORROW ?
			  psp_max(c->t_rate, c->t_ceil) : c->t_rate;

		psp_count_run(q, c, now, bytes);

		if (!(c->flags & PSP_SC_FIRST) && now - c->t_last < (ref + 1) / 2)
			/* the second of a pair: rest a packet time */
			c->t_min = now + ref;
		else if (clk + ref <= now)
			/* still a packet time or more behind: a pair may form */
			c->t_min = 0;
		else
			/* catching up: no closer than half a packet time */
			c->t_min = now + (ref + 1) / 2;
		c->t_last = now;
	}
	c->flags &= ~PSP_SC_FIRST;
	psp_est_add(c, bytes, now);

	if (!next) {
		psp_class_deactivate(q, c);
		return;
	}
	c->head = next;
	if (!c->rate) {
		psp_tree_move(q, &q->utree, &c->rnode, 0);
		return;
	}
	if (c->flags & PSP_SC_DUE) {
		psp_paced_erase(q, c);
		psp_paced_put(q, c, now);
	} else {
		/* sent from wtree (alone, or borrowing): its time only grew */
		c->due = psp_rkey(c);
		psp_tree_move(q, &q->wtree, &c->rnode, c->due);
	}
	if (c->flags & PSP_SC_BORROW)
		psp_tree_move(q, &q->btree, &c->bnode, psp_bkey(c));
}

/* Forget a deactivated class's clocks (qdisc reset). */
static inline void psp_class_reset_clocks(struct psp_sclass *c)
{
	c->t_rate = 0;
	c->t_ceil = 0;
	c->t_min = 0;
	c->t_last = 0;
	c->rate_rem = 0;
	c->ceil_rem = 0;
	c->scale_rem = 0;
	c->t_grp = 0;
	c->grp_rem[0] = 0;
	c->grp_rem[1] = 0;
}

/* Forget a group's clock (qdisc reset, after its members were deactivated). */
static inline void psp_group_reset_clocks(struct psp_sgroup *g)
{
	g->t_clk = 0;
	g->rem = 0;
	g->t_resv = 0;
}

/* Forget all clocks (qdisc reset); classes must be deactivated first. */
static inline void psp_sched_reset(struct psp_sched *q)
{
	q->t_link = 0;
	q->link_rem = 0;
	q->rate_sum = 0;
	q->active = 0;
}

#endif /* _PSP_SCHED_H */

// SPDX-License-Identifier: GPL-2.0
/*
 * psp_sim.c - the psp scheduling core (../psp_sched.h) in userspace, on a
 * virtual clock.
 *
 * Built as a shared library (make -C flowpacer/kernel/kmod sim, or by the Python
 * wrapper in this directory) and driven through ctypes by
 * tests/test_psp_sim.py and bench/psp_sim.py.  Time only moves when the
 * caller says so, so every run is exactly reproducible.
 *
 * The backlogged classes are kept in the module's own trees (../psp_tree.h:
 * rbtrees, each with a few sorted runs for in-order inserts) on a userspace
 * rbtree with the kernel's interface (kshim.h).  Each class is allocated on
 * its own, cache-line aligned, hot fields first: tree nodes point at each
 * other, so a class never moves.
 *
 * A class is either fed packet by packet (psp_sim_enqueue) or "greedy": an
 * endless source of packets of one size that keeps it backlogged.
 */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "uapi/pkt_sch_psp.h"

#define static_assert _Static_assert

typedef uint32_t u32;
typedef uint64_t u64;
typedef int64_t s64;

#define likely(x)	__builtin_expect(!!(x), 1)
#define unlikely(x)	__builtin_expect(!!(x), 0)
#define container_of(ptr, type, member) \
	((type *)((char *)(ptr) - offsetof(type, member)))

/* ------------------------------------------------- psp_sched.h shims */

/*
 * The trees are the module's own code: ../psp_tree.h (an rbtree plus a few
 * sorted runs, ordered by (key, seq) with the 64-bit sequence), compiled
 * against kshim.h, a userspace red-black tree and list with the kernel's
 * interface.  So the simulator makes the module's choices with the module's
 * ordering code.
 */
#include "kshim.h"
#include "psp_tree.h"

/* The hot head of struct psp_sclass is two cache lines (a 40-byte rnode,
 * as in the kernel).
 */
static inline void psp_prefetch(const void *p)
{
	__builtin_prefetch(p);
	__builtin_prefetch((const char *)p + 64);
}

static inline u64 psp_div_rem(u64 a, u64 b, u64 *rem)
{
	*rem = a % b;
	return a / b;
}

static inline u64 psp_mul_div(u64 a, u64 b, u64 c)
{
	return (u64)((unsigned __int128)a * b / c);
}

#include "psp_sched.h"

/* ------------------------------------------------------------ the sim */

struct sim_class {
	/* hot: with the hot head of sc, the first 136 bytes (two cache
	 * lines, and 8 bytes of the third since the run links)
	 */
	u32			qlen;
	u32			greedy;		/* > 0: endless packets of this size */
	u64			pkts, bytes;
	struct psp_sclass	sc;
	/* cold */
	u32			head, cap;
	u32			*ring;		/* queued packet lengths */
	u32			limit;
	u32			used;
	u32			id;		/* index in psp_sim.cls */
	u64			drops;
} __attribute__((aligned(64)));

struct psp_sim {
	struct psp_sched	s;
	struct sim_class	**cls;		/* ncls classes, cap slots */
	u32			ncls, cap;
	struct psp_sgroup	**grp;		/* ngrp groups, gcap slots */
	u32			ngrp, gcap;
	u64			armed;		/* last wake time handed out */
	u64			timer_fires;
	u64			timer_late_ns_max;
};

/* One departure, as logged by psp_sim_run(). */
struct psp_sim_pkt {
	u64	t;
	u32	cls;
	u32	len;
	u32	kind;		/* enum psp_send */
	u32	pad;
};

struct psp_sim *psp_sim_new(u64 link_rate, u32 overhead);
void psp_sim_free(struct psp_sim *sim);
void psp_sim_set_link(struct psp_sim *sim, u64 link_rate, u32 overhead);
void psp_sim_set_catchup(struct psp_sim *sim, u64 catchup_ns);
int psp_sim_add_class(struct psp_sim *sim, u64 rate, u64 ceil, u32 limit);
int psp_sim_change_class(struct psp_sim *sim, int cls, u64 rate, u64 ceil,
			 u32 limit, u64 now);
int psp_sim_del_class(struct psp_sim *sim, int cls);
int psp_sim_enqueue(struct psp_sim *sim, int cls, u32 len, u64 now);
int psp_sim_set_greedy(struct psp_sim *sim, int cls, u32 len, u64 now);
int psp_sim_dequeue(struct psp_sim *sim, u64 now, struct psp_sim_pkt *out);
long psp_sim_run(struct psp_sim *sim, u64 start, u64 until, u64 late_ns,
		 struct psp_sim_pkt *log, long max_log, u64 *end);
void psp_sim_xstats(struct psp_sim *sim, struct tc_psp_xstats *st);
int psp_sim_class_xstats(struct psp_sim *sim, int cls, u64 now,
			 struct tc_psp_class_xstats *xs);
int psp_sim_class_counts(struct psp_sim *sim, int cls, u64 out[4]);
u32 psp_sim_sizeof(int which);
int psp_sim_add_group(struct psp_sim *sim, int parent, u64 rate);
int psp_sim_set_group_rate(struct psp_sim *sim, int grp, u64 rate);
int psp_sim_del_group(struct psp_sim *sim, int grp);
int psp_sim_set_class_group(struct psp_sim *sim, int cls, int grp, u64 now);
int psp_sim_group_stats(struct psp_sim *sim, int grp, u64 now, u64 out[7]);
long psp_sim_tree_check(u64 seed, u32 nodes, u32 ops);

static struct sim_class *sim_get(struct psp_sim *sim, int cls)
{
	if (cls < 0 || (u32)cls >= sim->ncls || !sim->cls[cls]->used)
		return NULL;
	return sim->cls[cls];
}

struct psp_sim *psp_sim_new(u64 link_rate, u32 overhead)
{
	struct psp_sim *sim;

	if (!link_rate)
		return NULL;
	sim = calloc(1, sizeof(*sim));
	if (!sim)
		return NULL;
	psp_sched_init(&sim->s, link_rate, overhead, PSP_DEFAULT_CATCHUP_NS);
	return sim;
}

void psp_sim_free(struct psp_sim *sim)
{
	u32 i;

	if (!sim)
		return;
	for (i = 0; i < sim->ncls; i++) {
		free(sim->cls[i]->ring);
		free(sim->cls[i]);
	}
	free(sim->cls);
	for (i = 0; i < sim->ngrp; i++)
		free(sim->grp[i]);
	free(sim->grp);
	free(sim);
}

void psp_sim_set_link(struct psp_sim *sim, u64 link_rate, u32 overhead)
{
	if (link_rate)
		psp_sched_set_link(&sim->s, link_rate, overhead);
}

void psp_sim_set_catchup(struct psp_sim *sim, u64 catchup_ns)
{
	psp_sched_set_catchup(&sim->s, catchup_ns);
}

int psp_sim_add_class(struct psp_sim *sim, u64 rate, u64 ceil, u32 limit)
{
	struct sim_class *c;

	if (ceil && ceil < rate)
		return -1;
	if (sim->ncls == sim->cap) {
		u32 cap = sim->cap ? 2 * sim->cap : 16;
		struct sim_class **a = realloc(sim->cls, (size_t)cap * sizeof(*a));

		if (!a)
			return -1;
		sim->cls = a;
		sim->cap = cap;
	}
	if (posix_memalign((void **)&c, 64, sizeof(*c)))
		return -1;
	memset(c, 0, sizeof(*c));
	c->limit = limit ? limit : PSP_DEFAULT_LIMIT;
	c->used = 1;
	c->id = sim->ncls;
	RB_CLEAR_NODE(&c->sc.rnode.rb);		/* in no tree, as the module's */
	RB_CLEAR_NODE(&c->sc.bnode.rb);
	sim->cls[sim->ncls] = c;
	psp_class_set(&sim->s, &c->sc, rate, ceil ? ceil : rate, 0);
	return (int)sim->ncls++;
}

int psp_sim_change_class(struct psp_sim *sim, int cls, u64 rate, u64 ceil,
			 u32 limit, u64 now)
{
	struct sim_class *c = sim_get(sim, cls);

	if (!c || (ceil && ceil < rate))
		return -1;
	psp_class_set(&sim->s, &c->sc, rate, ceil ? ceil : rate, now);
	if (limit)
		c->limit = limit;
	return 0;
}

int psp_sim_del_class(struct psp_sim *sim, int cls)
{
	struct sim_class *c = sim_get(sim, cls);

	if (!c)
		return -1;
	psp_class_set_group(&sim->s, &c->sc, NULL, 0);
	psp_class_deactivate(&sim->s, &c->sc);
	c->drops += c->qlen;
	c->qlen = 0;
	c->greedy = 0;
	c->used = 0;
	return 0;
}

int psp_sim_enqueue(struct psp_sim *sim, int cls, u32 len, u64 now)
{
	struct sim_class *c = sim_get(sim, cls);

	if (!c || !len)
		return -1;
	if (c->qlen >= c->limit) {
		c->drops++;
		return 1;
	}
	if (c->qlen == c->cap) {
		u32 cap = c->cap ? 2 * c->cap : 8, i;
		u32 *ring = malloc((size_t)cap * sizeof(*ring));

		if (!ring)
			return -1;
		for (i = 0; i < c->qlen; i++)
			ring[i] = c->ring[(c->head + i) % c->cap];
		free(c->ring);
		c->ring = ring;
		c->head = 0;
		c->cap = cap;
	}
	c->ring[(c->head + c->qlen) % c->cap] = len;
	c->qlen++;
	if (!c->greedy && c->qlen == 1)
		psp_class_activate(&sim->s, &c->sc, now,
				   (u32)psp_wire_bytes(&sim->s, len, 1));
	return 0;
}

int psp_sim_set_greedy(struct psp_sim *sim, int cls, u32 len, u64 now)
{
	struct sim_class *c = sim_get(sim, cls);

	if (!c)
		return -1;
	c->greedy = len;
	if (len)
		psp_class_activate(&sim->s, &c->sc, now,
				   (u32)psp_wire_bytes(&sim->s, c->qlen ? c->ring[c->head] : len, 1));
	else if (!c->qlen)
		psp_class_deactivate(&sim->s, &c->sc);
	return 0;
}

int psp_sim_dequeue(struct psp_sim *sim, u64 now, struct psp_sim_pkt *out)
{
	struct psp_sclass *sc, *held;
	struct sim_class *c;
	int kind = PSP_SEND_NONE;
	u64 wake;
	u32 len, next;

	if (sim->armed && now >= sim->armed) {
		sim->timer_fires++;
		if (now - sim->armed > sim->timer_late_ns_max)
			sim->timer_late_ns_max = now - sim->armed;
		sim->armed = 0;
	}
	sc = psp_select(&sim->s, now, &kind, &wake, &held);
	if (!sc) {
		out->t = wake;
		out->kind = PSP_SEND_NONE;
		sim->armed = wake;
		return 0;
	}
	c = container_of(sc, struct sim_class, sc);
	if (c->qlen) {
		len = c->ring[c->head];
		c->head = (c->head + 1) % c->cap;
		c->qlen--;
	} else {
		len = c->greedy;
	}
	next = c->qlen ? c->ring[c->head] : c->greedy;
	psp_charge(&sim->s, sc, kind, psp_wire_bytes(&sim->s, len, 1), now,
		   next ? (u32)psp_wire_bytes(&sim->s, next, 1) : 0);
	c->pkts++;
	c->bytes += len;
	out->t = now;
	out->cls = c->id;
	out->len = len;
	out->kind = (u32)kind;
	return 1;
}

long psp_sim_run(struct psp_sim *sim, u64 start, u64 until, u64 late_ns,
		 struct psp_sim_pkt *log, long max_log, u64 *end)
{
	struct psp_sim_pkt p;
	u64 now = start;
	long count = 0;

	for (;;) {
		while (psp_sim_dequeue(sim, now, &p)) {
			if (log && count < max_log)
				log[count] = p;
			count++;
		}
		if (!p.t || p.t + late_ns > until)
			break;
		now = p.t + late_ns;
	}
	if (end)
		*end = now;
	return count;
}

void psp_sim_xstats(struct psp_sim *sim, struct tc_psp_xstats *st)
{
	u32 i, n = 0;

	for (i = 0; i < sim->ncls; i++)
		n += sim->cls[i]->used;
	memset(st, 0, sizeof(*st));
	st->link_rate = sim->s.link_rate;
	st->rate_sum = sim->s.rate_sum;
	st->paced_pkts = sim->s.paced_pkts;
	st->borrowed_pkts = sim->s.borrowed_pkts;
	st->unpaced_pkts = sim->s.unpaced_pkts;
	st->late_ns_total = sim->s.late_ns_total;
	st->late_ns_max = sim->s.late_ns_max;
	st->clamps = sim->s.clamps;
	st->timer_fires = sim->timer_fires;
	st->timer_late_ns_max = sim->timer_late_ns_max;
	st->longest_run = sim->s.longest_run;
	st->classes = n;
	st->active = sim->s.active;
}

int psp_sim_class_xstats(struct psp_sim *sim, int cls, u64 now,
			 struct tc_psp_class_xstats *xs)
{
	struct sim_class *c = sim_get(sim, cls);

	if (!c)
		return -1;
	memset(xs, 0, sizeof(*xs));
	xs->rate = c->sc.rate;
	xs->ceil = c->sc.ceil;
	xs->eff_rate = psp_eff_rate(&sim->s, &c->sc);
	xs->rate_est = psp_est_read(&c->sc, now);
	xs->borrowed_bytes = c->sc.borrowed_bytes;
	xs->borrowed_pkts = c->sc.borrowed_pkts;
	xs->clamps = c->sc.clamps;
	xs->late_ns_max = c->sc.late_ns_max;
	xs->clock_ns = c->sc.rate ? (s64)(c->sc.t_rate - now) : 0;
	xs->limit = c->limit;
	xs->flags = (c->sc.rate ? 0 : PSP_CLASS_F_UNPACED) |
		    ((c->sc.flags & PSP_SC_ACTIVE) ? PSP_CLASS_F_ACTIVE : 0);
	return 0;
}

/* pkts, bytes, drops, qlen */
int psp_sim_class_counts(struct psp_sim *sim, int cls, u64 out[4])
{
	struct sim_class *c;

	if (cls < 0 || (u32)cls >= sim->ncls)
		return -1;
	c = sim->cls[cls];
	out[0] = c->pkts;
	out[1] = c->bytes;
	out[2] = c->drops;
	out[3] = c->qlen;
	return 0;
}

/* Sizes the Python side checks its ctypes mirrors against. */
u32 psp_sim_sizeof(int which)
{
	switch (which) {
	case 0: return sizeof(struct psp_sim_pkt);
	case 1: return sizeof(struct tc_psp_xstats);
	case 2: return sizeof(struct tc_psp_class_xstats);
	case 3: return sizeof(struct sim_class);
	default: return 0;
	}
}

/* ---------------------------------------------------------------- groups */

static struct psp_sgroup *sim_group(struct psp_sim *sim, int grp)
{
	if (grp < 0 || (u32)grp >= sim->ngrp || !sim->grp[grp]->rate)
		return NULL;
	return sim->grp[grp];
}

static int sim_depth(const struct psp_sgroup *g)
{
	int d = 0;

	for (; g; g = g->parent)
		d++;
	return d;
}

/* A group under group @parent (-1: the link) with cap @rate; its id, or -1. */
int psp_sim_add_group(struct psp_sim *sim, int parent, u64 rate)
{
	struct psp_sgroup *p = NULL, *g;

	if (!rate || rate > PSP_RATE_MAX)
		return -1;
	if (parent >= 0) {
		p = sim_group(sim, parent);
		if (!p || sim_depth(p) >= PSP_GROUP_DEPTH)
			return -1;
	}
	if (sim->ngrp == sim->gcap) {
		u32 cap = sim->gcap ? 2 * sim->gcap : 16;
		struct psp_sgroup **a = realloc(sim->grp, (size_t)cap * sizeof(*a));

		if (!a)
			return -1;
		sim->grp = a;
		sim->gcap = cap;
	}
	g = calloc(1, sizeof(*g));
	if (!g)
		return -1;
	psp_group_init(g, p, rate);
	sim->grp[sim->ngrp] = g;
	return (int)sim->ngrp++;
}

int psp_sim_set_group_rate(struct psp_sim *sim, int grp, u64 rate)
{
	struct psp_sgroup *g = sim_group(sim, grp);

	if (!g || !rate || rate > PSP_RATE_MAX)
		return -1;
	psp_group_set_rate(&sim->s, g, rate);
	return 0;
}

/* Refused (-1) while the group has members, as the module refuses it. */
int psp_sim_del_group(struct psp_sim *sim, int grp)
{
	struct psp_sgroup *g = sim_group(sim, grp);

	if (!g || g->members)
		return -1;
	psp_group_release(g);
	g->rate = 0;		/* the slot is marked unused */
	return 0;
}

/* Class @cls into group @grp (-1: at the link); paced classes only. */
int psp_sim_set_class_group(struct psp_sim *sim, int cls, int grp, u64 now)
{
	struct sim_class *c = sim_get(sim, cls);
	struct psp_sgroup *g = NULL;

	if (!c || !c->sc.rate)
		return -1;
	if (grp >= 0) {
		g = sim_group(sim, grp);
		if (!g)
			return -1;
	}
	psp_class_set_group(&sim->s, &c->sc, g, now);
	return 0;
}

/* rate, sum, active, members, clock - now, rate_est, held */
int psp_sim_group_stats(struct psp_sim *sim, int grp, u64 now, u64 out[7])
{
	struct psp_sgroup *g = sim_group(sim, grp);

	if (!g)
		return -1;
	out[0] = g->rate;
	out[1] = g->sum;
	out[2] = g->active;
	out[3] = g->members;
	out[4] = g->t_clk - now;
	out[5] = psp_group_est_read(g, now);
	out[6] = g->held;
	return 0;
}

/* ------------------------------------------------------ tree self-test */

/* Red-black shape of the subtree at @n: its black height, or -1 if a rule
 * is broken (a red node with a red child, unequal black heights, a wrong
 * parent pointer, keys out of order).
 */
static int tree_check_rb(const struct rb_node *n, const struct rb_node *parent)
{
	int l, r;

	if (!n)
		return 1;
	if (krb_parent(n) != parent)
		return -1;
	if (krb_color(n) == RB_RED &&
	    (krb_color(n->rb_left) == RB_RED || krb_color(n->rb_right) == RB_RED))
		return -1;
	if (n->rb_left && psp_tnode_less((struct rb_node *)n, n->rb_left))
		return -1;
	if (n->rb_right && psp_tnode_less(n->rb_right, n))
		return -1;
	l = tree_check_rb(n->rb_left, n);
	r = tree_check_rb(n->rb_right, n);
	if (l < 0 || r < 0 || l != r)
		return -1;
	return l + (krb_color(n) == RB_BLACK);
}

static u64 tree_rand(u64 *x)
{
	*x ^= *x << 13;
	*x ^= *x >> 7;
	*x ^= *x << 17;
	return *x;
}

/* @ops random inserts, erases and requeues (key grows) on one psp_tree of
 * up to @nodes nodes, keys from a narrow range (many ties) and from
 * in-order streams (the runs): after each, psp_tree_first and
 * psp_tree_second must name the smallest and second smallest (key, seq)
 * of a brute-force scan, and the rbtree must be a valid red-black tree
 * with the right leftmost node.  Returns 0, or the 1-based number of the
 * operation that went wrong (-1: no memory).
 */
long psp_sim_tree_check(u64 seed, u32 nodes, u32 ops)
{
	struct psp_tnode *nd = calloc(nodes ? nodes : 1, sizeof(*nd));
	bool *in = calloc(nodes ? nodes : 1, sizeof(*in));
	struct psp_tree t;
	u64 x = seed | 1, seq = 0, stream = 0;
	long bad = 0;
	u32 i, k;

	if (!nd || !in) {
		free(nd);
		free(in);
		return -1;
	}
	psp_tree_init(&t);
	for (i = 0; i < nodes; i++)
		RB_CLEAR_NODE(&nd[i].rb);
	for (k = 0; k < ops && !bad; k++) {
		u64 r = tree_rand(&x), key2 = 0;
		struct psp_tnode *n = &nd[r % nodes], *f, *s, *m1 = NULL, *m2 = NULL;
		const struct rb_node *lm;

		r >>= 32;
		if (!in[n - nd]) {
			n->key = (r & 1) ? (stream += r % 3) : (r >> 1) % 64;
			n->seq = seq++;
			psp_tree_insert(&t, n);
			in[n - nd] = true;
		} else if (r % 3 == 0) {
			psp_tree_erase(&t, n);
			in[n - nd] = false;
		} else {
			n->key += (r >> 2) % 8;
			n->seq = seq++;
			psp_tree_requeue(&t, n);
		}
		for (i = 0; i < nodes; i++) {
			if (!in[i])
				continue;
			if (!m1 || psp_tnode_before(&nd[i], m1)) {
				m2 = m1;
				m1 = &nd[i];
			} else if (!m2 || psp_tnode_before(&nd[i], m2)) {
				m2 = &nd[i];
			}
		}
		f = psp_tree_first(&t);
		s = psp_tree_second(&t, &key2);
		lm = t.root.rb_root.rb_node;
		while (lm && lm->rb_left)
			lm = lm->rb_left;
		if (f != m1 || s != m2 || (s && key2 != s->key) ||
		    tree_check_rb(t.root.rb_root.rb_node, NULL) < 0 ||
		    krb_color(t.root.rb_root.rb_node) != RB_BLACK ||
		    t.root.rb_leftmost != lm)
			bad = k + 1;
	}
	free(nd);
	free(in);
	return bad;
}

/* SPDX-License-Identifier: GPL-2.0 */
/*
 * psp_tree.h - the ordered containers of the psp scheduling core: the
 * struct psp_tnode / struct psp_tree that psp_sched.h is written against.
 *
 * One source for the kernel module (sch_psp.c) and the userspace simulator
 * (sim/psp_sim.c): the includer provides, before including this file, the
 * kernel's rbtree API (struct rb_node, struct rb_root_cached, RB_ROOT_CACHED,
 * RB_EMPTY_NODE, RB_CLEAR_NODE, rb_entry, rb_add_cached, rb_erase_cached,
 * rb_first_cached, rb_next), its list API (struct list_head, INIT_LIST_HEAD,
 * list_add_tail, list_del, list_empty, list_entry, list_first_entry,
 * list_next_entry), bit helpers (__set_bit, __clear_bit, for_each_set_bit,
 * GENMASK, ffz), prefetch(), static_assert, offsetof, offsetofend and u64.
 * The module takes them from <linux/...>; the simulator from sim/kshim.h,
 * a userspace rbtree and list of its own with the same interface.
 */
#ifndef _PSP_TREE_H
#define _PSP_TREE_H

/*
 * A tree is an rbtree plus PSP_RUNS runs: lists sorted by the same
 * (key, seq).  In a pacer most inserts come in order per rate: a class's
 * next departure, and the deadline of a class that falls due, grow in
 * service order among classes of the same rate (flowpacer gives all flows
 * of a rule one rate).  An insert goes to the run with the largest tail that
 * sorts at or before it (best fit, as in patience sorting: a few rates take
 * a run each), else to an empty run, else to the rbtree, O(log N).  Leaving
 * a run, from anywhere, is O(1) and keeps it sorted.  The first node is the
 * smallest of the runs' heads and the rbtree's leftmost.  The head and tail
 * keys of each run are kept in the tree, so choosing a run or the first
 * node touches no other node.  This is exact, the same order as the rbtree
 * alone; worst case (no insert in order) everything is in the rbtree, as
 * without the runs, plus O(PSP_RUNS) compares per operation.
 *
 * A node is in one of them: a run's list_head shares the rb_node's child
 * pointers, and its parent word stays RB_EMPTY_NODE() (the kernel's "in no
 * rbtree") while in a run, so the node keeps its 40 bytes.  A node is the
 * head (tail) of run r iff its prev (next) is the tree's run[r].  Nothing
 * here allocates.
 */
/* A run per rate for up to 4 rates; 8 measured no better. */
#define PSP_RUNS	4

struct psp_tnode {
	union {
		struct rb_node		rb;		/* in the rbtree */
		struct {
			unsigned long	rb_pc;		/* = rb.__rb_parent_color */
			struct list_head run;		/* in a run */
		};
	};
	u64		key;
	u64		seq;
};

static_assert(offsetof(struct psp_tnode, run) >=
	      offsetofend(struct rb_node, __rb_parent_color));
static_assert(offsetofend(struct psp_tnode, run) <= sizeof(struct rb_node));

struct psp_tree {
	struct rb_root_cached	root;
	unsigned long		used;		/* bit r: run[r] is not empty */
	struct list_head	run[PSP_RUNS];
	u64			hkey[PSP_RUNS];	/* (key, seq) of the heads */
	u64			hseq[PSP_RUNS];
	u64			tkey[PSP_RUNS];	/* and of the tails */
	u64			tseq[PSP_RUNS];
};

static inline bool psp_kless(u64 ka, u64 sa, u64 kb, u64 sb)
{
	return ka < kb || (ka == kb && sa < sb);
}

static inline bool psp_tnode_before(const struct psp_tnode *x,
				    const struct psp_tnode *y)
{
	return psp_kless(x->key, x->seq, y->key, y->seq);
}

static inline bool psp_tnode_less(struct rb_node *a, const struct rb_node *b)
{
	return psp_tnode_before(rb_entry(a, struct psp_tnode, rb),
				rb_entry(b, struct psp_tnode, rb));
}

/* Only for a node in the tree: else it is in no rbtree either. */
static inline bool psp_tnode_in_run(const struct psp_tnode *n)
{
	return RB_EMPTY_NODE(&n->rb);
}

/* r if @l is the tree's run[r] (@l is a neighbour's link: the node it
 * belongs to is a head or tail), else -1.
 */
static inline int psp_run_end(const struct psp_tree *t,
			      const struct list_head *l)
{
	unsigned long d = (unsigned long)l - (unsigned long)t->run;

	return d < sizeof(t->run) ? (int)(d / sizeof(t->run[0])) : -1;
}

static inline void psp_run_set_head(struct psp_tree *t, int r,
				    const struct psp_tnode *n)
{
	t->hkey[r] = n->key;
	t->hseq[r] = n->seq;
}

static inline void psp_run_set_tail(struct psp_tree *t, int r,
				    const struct psp_tnode *n)
{
	t->tkey[r] = n->key;
	t->tseq[r] = n->seq;
}

static inline void psp_run_append(struct psp_tree *t, int r,
				  struct psp_tnode *n)
{
	RB_CLEAR_NODE(&n->rb);
	if (list_empty(&t->run[r])) {
		__set_bit(r, &t->used);
		psp_run_set_head(t, r, n);
	}
	list_add_tail(&n->run, &t->run[r]);
	psp_run_set_tail(t, r, n);
}

static inline void psp_run_del(struct psp_tree *t, struct psp_tnode *n)
{
	struct list_head *prev = n->run.prev, *next = n->run.next;
	int hr = psp_run_end(t, prev), tr = psp_run_end(t, next);

	/* the parent word stays: still RB_EMPTY_NODE() */
	list_del(&n->run);
	if (hr >= 0 && tr >= 0) {
		__clear_bit(hr, &t->used);
		return;
	}
	if (hr >= 0) {
		psp_run_set_head(t, hr, list_entry(next, struct psp_tnode, run));
		/* read when the new head leaves */
		prefetch(next->next);
	}
	if (tr >= 0)
		psp_run_set_tail(t, tr, list_entry(prev, struct psp_tnode, run));
}

/* The run @n may be appended to: of those whose tail sorts at or before
 * it, the one with the largest tail; else an empty one; else -1.
 */
static inline int psp_run_fit(const struct psp_tree *t,
			      const struct psp_tnode *n)
{
	int r, best = -1;

	for_each_set_bit(r, &t->used, PSP_RUNS) {
		if (psp_kless(n->key, n->seq, t->tkey[r], t->tseq[r]))
			continue;
		if (best < 0 || psp_kless(t->tkey[best], t->tseq[best],
					  t->tkey[r], t->tseq[r]))
			best = r;
	}
	if (best < 0 && t->used != GENMASK(PSP_RUNS - 1, 0))
		best = ffz(t->used);
	return best;
}

/* The run with the smallest head, or -1 if all are empty. */
static inline int psp_run_min(const struct psp_tree *t)
{
	int r, best = -1;

	for_each_set_bit(r, &t->used, PSP_RUNS)
		if (best < 0 || psp_kless(t->hkey[r], t->hseq[r],
					  t->hkey[best], t->hseq[best]))
			best = r;
	return best;
}

static inline void psp_tree_init(struct psp_tree *t)
{
	int r;

	t->root = RB_ROOT_CACHED;
	t->used = 0;
	for (r = 0; r < PSP_RUNS; r++)
		INIT_LIST_HEAD(&t->run[r]);
}

static inline void psp_tree_insert(struct psp_tree *t, struct psp_tnode *n)
{
	int r = psp_run_fit(t, n);

	if (r >= 0)
		psp_run_append(t, r, n);
	else
		rb_add_cached(&n->rb, &t->root, psp_tnode_less);
}

static inline void psp_tree_erase(struct psp_tree *t, struct psp_tnode *n)
{
	if (psp_tnode_in_run(n)) {
		psp_run_del(t, n);
		return;
	}
	rb_erase_cached(&n->rb, &t->root);
	RB_CLEAR_NODE(&n->rb);
}

/* The node's (key, seq) grew: reposition it, unless it still sorts before
 * its successor.
 */
static inline void psp_tree_requeue(struct psp_tree *t, struct psp_tnode *n)
{
	struct rb_node *next;
	int r;

	if (!psp_tnode_in_run(n)) {
		r = psp_run_fit(t, n);
		if (r >= 0) {
			rb_erase_cached(&n->rb, &t->root);
			psp_run_append(t, r, n);
			return;
		}
		next = rb_next(&n->rb);
		if (!next || psp_tnode_less(&n->rb, next))
			return;
		rb_erase_cached(&n->rb, &t->root);
		rb_add_cached(&n->rb, &t->root, psp_tnode_less);
		return;
	}
	r = psp_run_end(t, n->run.next);
	if (r >= 0 || psp_tnode_before(n, list_next_entry(n, run))) {
		/* still sorted: it stays, its run's keys follow */
		if (r >= 0)
			psp_run_set_tail(t, r, n);
		r = psp_run_end(t, n->run.prev);
		if (r >= 0)
			psp_run_set_head(t, r, n);
		return;
	}
	psp_run_del(t, n);
	psp_tree_insert(t, n);
}

static inline struct psp_tnode *psp_tree_first(struct psp_tree *t)
{
	struct rb_node *rb = rb_first_cached(&t->root);
	int r = psp_run_min(t);
	struct psp_tnode *tn;

	if (r < 0)
		return rb ? rb_entry(rb, struct psp_tnode, rb) : NULL;
	tn = rb ? rb_entry(rb, struct psp_tnode, rb) : NULL;
	if (tn && psp_kless(tn->key, tn->seq, t->hkey[r], t->hseq[r]))
		return tn;
	return list_first_entry(&t->run[r], struct psp_tnode, run);
}

/* The node that is first once first is gone: the smallest of the other
 * runs' heads and the successor of first in its run or the rbtree.
 */
static inline struct psp_tnode *psp_tree_second(struct psp_tree *t, u64 *key)
{
	struct rb_node *rb = rb_first_cached(&t->root);
	struct psp_tnode *tn = rb ? rb_entry(rb, struct psp_tnode, rb) : NULL;
	struct psp_tnode *best = NULL, *x;
	int r, f = psp_run_min(t);
	bool tfirst = tn && (f < 0 || psp_kless(tn->key, tn->seq,
						t->hkey[f], t->hseq[f]));
	int br = -1;

	for_each_set_bit(r, &t->used, PSP_RUNS)
		if ((tfirst || r != f) &&
		    (br < 0 || psp_kless(t->hkey[r], t->hseq[r],
					 t->hkey[br], t->hseq[br])))
			br = r;
	if (tfirst) {
		/* first is the rbtree's: its successor or a run's head */
		rb = rb_next(rb);
		best = rb ? rb_entry(rb, struct psp_tnode, rb) : NULL;
	} else if (f >= 0) {
		/* first is run f's head: its successor, the rbtree's first
		 * or another run's head
		 */
		best = tn;
		x = list_first_entry(&t->run[f], struct psp_tnode, run);
		if (psp_run_end(t, x->run.next) < 0) {
			x = list_next_entry(x, run);
			if (!best || psp_tnode_before(x, best))
				best = x;
		}
	}
	if (br >= 0 && (!best || psp_kless(t->hkey[br], t->hseq[br],
					   best->key, best->seq)))
		best = list_first_entry(&t->run[br], struct psp_tnode, run);
	if (best)
		*key = best->key;
	return best;
}

#endif /* _PSP_TREE_H */

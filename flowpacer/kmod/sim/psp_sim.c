// SPDX-License-Identifier: GPL-2.0
/*
 * psp_sim.c - the psp scheduling core (../psp_sched.h) in userspace, on a
 * virtual clock.
 *
 * Built as a shared library (make -C flowpacer/kmod sim, or by the Python
 * wrapper in this directory) and driven through ctypes by
 * tests/test_psp_sim.py and bench/psp_sim.py.  Time only moves when the
 * caller says so, so every run is exactly reproducible.
 *
 * The kernel keeps backlogged classes in rbtrees, each with a few sorted
 * runs for in-order inserts; here a 4-ary min-heap ordered by the same
 * (key, seq) pair stands in for the rbtree, beside the same kind of runs.
 * Both return the same smallest element, so the simulator makes the same
 * choices as the module.
 * The classes live in one array, hot fields first, cache-line aligned.
 *
 * A class is either fed packet by packet (psp_sim_enqueue) or "greedy": an
 * endless source of packets of one size that keeps it backlogged.
 */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../uapi/pkt_sch_psp.h"

typedef uint32_t u32;
typedef uint64_t u64;
typedef int64_t s64;

#define likely(x)	__builtin_expect(!!(x), 1)
#define unlikely(x)	__builtin_expect(!!(x), 0)
#define container_of(ptr, type, member) \
	((type *)((char *)(ptr) - offsetof(type, member)))

/* ------------------------------------------------- psp_sched.h shims */

/*
 * A tree is PSP_RUNS runs and a heap, sorted by the same (key, seq):
 *
 * The runs, FIFOs.  In a pacer most inserts come in order per rate: a
 * class's next departure, and the deadline of a class that falls due, grow
 * in service order among classes of the same rate (flowpacer gives all
 * flows of a rule one rate).  An insert goes to the run with the largest
 * tail that sorts at or before it (best fit, as in patience sorting: a few
 * rates take a run each), else to an empty run, in O(PSP_RUNS); taking a
 * node out of a run, from anywhere, is O(1) and keeps it sorted.  A run is
 * doubly linked through the nodes by id (prev/next beside the key: the
 * node's lines are touched anyway); the head's prev and the tail's next are
 * PSP_END(run), prev == PSP_IN_HEAP marks a node in the heap.  The tree
 * keeps each run's head and tail ids and their (key, seq), and a mask of
 * the runs in use, so choosing a run or the first node touches no node.
 *
 * The heap, for the other inserts: O(log N).  The smallest node is the
 * smallest of the runs' heads and the heap's root.  This is exact: the same
 * order as a heap alone, so the same choices (and the kernel's rbtrees give
 * the same).  Worst case, no insert comes in order: everything is in the
 * heap, as before, plus O(PSP_RUNS) compares per operation.
 *
 * The heap: 4-ary, 16-byte entries, so the four children of a node share
 * one 64-byte cache line (the array is offset by HEAP_PAD entries to align
 * the groups).  The slot of each node lives in a dense array indexed by the
 * node's id, not in the node, so moving entries does not touch the classes.
 * A node is found from its id by arithmetic (the classes are one array), as
 * the kernel's rbtree hands out node pointers without a lookup table.
 * Entries keep the low 32 bits of the insertion sequence number, compared
 * with wrap-around (the run compares them the same way): ties are broken
 * exactly like the kernel's u64 as long as a node waits fewer than 2^31
 * insertions.
 */
#define PSP_RUNS	4		/* as the kernel's; <= 16 */
#define PSP_NIL		0xffffffffU	/* no node: an empty run */
#define PSP_IN_HEAP	0xfffffffeU	/* prev of a node in the heap */
#define PSP_END(r)	(0xffffff00U + (r))	/* prev of run r's head, next
						 * of its tail
						 */
#define PSP_IS_END(x)	(((x) >> 4) == 0x0ffffff0U)

struct psp_tnode {
	u64	key;
	u32	seq;		/* compared 32 bits with wrap-around */
	u32	id;		/* index in the slot table and node array */
	u32	prev;		/* run: previous id or PSP_END(run);
				 * PSP_IN_HEAP: in the heap
				 */
	u32	next;		/* run: next id or PSP_END(run) */
};

struct psp_hent {
	u64	key;
	u32	seq;
	u32	id;
};

struct psp_tree {
	struct psp_hent		*a;	/* HEAP_PAD + n entries */
	u32			*slot;	/* id -> heap index */
	char			*base;	/* node of id i: base + i * stride */
	size_t			stride;
	u32			n;	/* in the heap */
	u32			cap;
	u32			used;	/* bit r: run r is not empty */
	/* the runs: ids of head and tail (PSP_NIL: empty), and their keys */
	u32			rhead[PSP_RUNS];
	u32			rtail[PSP_RUNS];
	u32			hseq[PSP_RUNS];
	u32			tseq[PSP_RUNS];
	u64			hkey[PSP_RUNS];
	u64			tkey[PSP_RUNS];
};

#define HEAP_ARITY	4
#define HEAP_PAD	3		/* a[HEAP_PAD + 4i + 1 ..] is 64-byte aligned */
#define HENT(t, i)	((t)->a[HEAP_PAD + (i)])

static inline struct psp_tnode *psp_tnode_of(const struct psp_tree *t, u32 id)
{
	return (struct psp_tnode *)(t->base + (size_t)id * t->stride);
}

/* (ka, sa) < (kb, sb).  Branch-free: in the heap, which child is smallest
 * is a coin toss the CPU cannot predict.
 */
static inline bool psp_kless(u64 ka, u32 sa, u64 kb, u32 sb)
{
	return (ka < kb) | ((ka == kb) & ((int32_t)(sa - sb) < 0));
}

static inline bool psp_hless(const struct psp_hent *x, const struct psp_hent *y)
{
	return psp_kless(x->key, x->seq, y->key, y->seq);
}

static inline bool psp_nless(const struct psp_tnode *x,
			     const struct psp_tnode *y)
{
	return psp_kless(x->key, x->seq, y->key, y->seq);
}

/* Index of the smallest of the children c .. c + HEAP_ARITY - 1 (< n). */
static inline __attribute__((always_inline))
u32 psp_min_child(const struct psp_tree *t, u32 c, u32 n)
{
	u32 a, b, j, best;

	if (likely(c + HEAP_ARITY <= n)) {
		a = psp_hless(&HENT(t, c + 1), &HENT(t, c)) ? c + 1 : c;
		b = psp_hless(&HENT(t, c + 3), &HENT(t, c + 2)) ? c + 3 : c + 2;
		return psp_hless(&HENT(t, b), &HENT(t, a)) ? b : a;
	}
	best = c;
	for (j = c + 1; j < n; j++)
		best = psp_hless(&HENT(t, j), &HENT(t, best)) ? j : best;
	return best;
}

static inline void psp_hset(struct psp_tree *t, u32 i, struct psp_hent e)
{
	HENT(t, i) = e;
	t->slot[e.id] = i;
}

/* The grandchildren of a node whose children start at @c: one line each. */
static inline void psp_prefetch_below(const struct psp_tree *t, u32 c, u32 n)
{
	u32 j;

	if (HEAP_ARITY * c + 1 < n)
		for (j = 0; j < HEAP_ARITY; j++)
			__builtin_prefetch(&HENT(t, HEAP_ARITY * (c + j) + 1));
}

static void psp_sift_up(struct psp_tree *t, u32 i, struct psp_hent e)
{
	while (i) {
		u32 p = (i - 1) / HEAP_ARITY;

		if (!psp_hless(&e, &HENT(t, p)))
			break;
		psp_hset(t, i, HENT(t, p));
		i = p;
	}
	psp_hset(t, i, e);
}

static void psp_sift_down(struct psp_tree *t, u32 i, struct psp_hent e)
{
	u32 n = t->n;

	for (;;) {
		u32 c = HEAP_ARITY * i + 1, best;

		if (c >= n)
			break;
		psp_prefetch_below(t, c, n);
		best = psp_min_child(t, c, n);
		if (!psp_hless(&HENT(t, best), &e))
			break;
		psp_hset(t, i, HENT(t, best));
		i = best;
	}
	psp_hset(t, i, e);
}

static inline void psp_tree_init(struct psp_tree *t)
{
	int r;

	t->n = 0;
	t->used = 0;
	for (r = 0; r < PSP_RUNS; r++) {
		t->rhead[r] = PSP_NIL;
		t->rtail[r] = PSP_NIL;
	}
}

/* Room for @cap nodes with ids < @cap: insert never allocates. */
static int psp_tree_reserve(struct psp_tree *t, u32 cap)
{
	struct psp_hent *a;
	u32 *slot;

	if (cap <= t->cap)
		return 0;
	if (posix_memalign((void **)&a, 64, (HEAP_PAD + (size_t)cap) * sizeof(*a)))
		return -1;
	slot = realloc(t->slot, (size_t)cap * sizeof(*slot));
	if (!slot) {
		free(a);
		return -1;
	}
	t->slot = slot;
	if (t->a)
		memcpy(a, t->a, (HEAP_PAD + (size_t)t->n) * sizeof(*a));
	free(t->a);
	t->a = a;
	t->cap = cap;
	return 0;
}

static void psp_tree_free(struct psp_tree *t)
{
	free(t->a);
	free(t->slot);
}

static inline struct psp_hent psp_hent_of(const struct psp_tnode *n)
{
	struct psp_hent e = { n->key, n->seq, n->id };

	return e;
}

/* The hot head of struct psp_sclass: 112 bytes here (a 24-byte rnode),
 * three lines at most.
 */
static inline void psp_prefetch(const void *p)
{
	__builtin_prefetch(p);
	__builtin_prefetch((const char *)p + 64);
	__builtin_prefetch((const char *)p + 111);
}

/* ---- the runs */

static inline void psp_run_append(struct psp_tree *t, int r,
				  struct psp_tnode *n)
{
	n->next = PSP_END(r);
	if (t->rhead[r] == PSP_NIL) {
		n->prev = PSP_END(r);
		t->used |= 1U << r;
		t->rhead[r] = n->id;
		t->hkey[r] = n->key;
		t->hseq[r] = n->seq;
	} else {
		n->prev = t->rtail[r];
		psp_tnode_of(t, t->rtail[r])->next = n->id;
	}
	t->rtail[r] = n->id;
	t->tkey[r] = n->key;
	t->tseq[r] = n->seq;
}

static inline void psp_run_unlink(struct psp_tree *t, struct psp_tnode *n)
{
	u32 p = n->prev, x = n->next;
	struct psp_tnode *pn = PSP_IS_END(p) ? NULL : psp_tnode_of(t, p);
	struct psp_tnode *xn = PSP_IS_END(x) ? NULL : psp_tnode_of(t, x);

	if (pn) {
		pn->next = x;
	} else {		/* the head */
		u32 r = p - PSP_END(0);

		t->rhead[r] = xn ? x : PSP_NIL;
		if (xn) {
			t->hkey[r] = xn->key;
			t->hseq[r] = xn->seq;
			/* read when the new head leaves */
			if (!PSP_IS_END(xn->next))
				__builtin_prefetch(psp_tnode_of(t, xn->next));
		}
	}
	if (xn) {
		xn->prev = p;
	} else {		/* the tail */
		u32 r = x - PSP_END(0);

		t->rtail[r] = pn ? p : PSP_NIL;
		if (!pn)
			t->used &= ~(1U << r);
		if (pn) {
			t->tkey[r] = pn->key;
			t->tseq[r] = pn->seq;
		}
	}
}

/* The run @n may be appended to: of those whose tail sorts at or before
 * it, the one with the largest tail; else an empty one; else -1.
 */
static inline int psp_run_fit(const struct psp_tree *t,
			      const struct psp_tnode *n)
{
	u32 m, full = (1U << PSP_RUNS) - 1;
	int r, best = -1;

	for (m = t->used; m; m &= m - 1) {
		r = __builtin_ctz(m);
		if (psp_kless(n->key, n->seq, t->tkey[r], t->tseq[r]))
			continue;
		if (best < 0 || psp_kless(t->tkey[best], t->tseq[best],
					  t->tkey[r], t->tseq[r]))
			best = r;
	}
	if (best < 0 && t->used != full)
		best = __builtin_ctz(~t->used);
	return best;
}

/* The run with the smallest head, or -1 if all are empty. */
static inline int psp_run_min(const struct psp_tree *t)
{
	int r, best = -1;
	u32 m;

	for (m = t->used; m; m &= m - 1) {
		r = __builtin_ctz(m);
		if (best < 0 || psp_kless(t->hkey[r], t->hseq[r],
					  t->hkey[best], t->hseq[best]))
			best = r;
	}
	return best;
}

/* ---- the heap */

static inline void psp_heap_insert(struct psp_tree *t, struct psp_tnode *n)
{
	n->prev = PSP_IN_HEAP;
	psp_sift_up(t, t->n++, psp_hent_of(n));
}

/* Remove the root: walk the hole down along the smallest children to a
 * leaf, then put the last entry there and let it rise (Floyd): fewer
 * comparisons than sifting the last entry down from the top.
 */
static void psp_heap_pop(struct psp_tree *t)
{
	u32 i = 0, n = --t->n;

	if (!n)
		return;
	for (;;) {
		u32 c = HEAP_ARITY * i + 1, best;

		if (c >= n)
			break;
		psp_prefetch_below(t, c, n);
		best = psp_min_child(t, c, n);
		psp_hset(t, i, HENT(t, best));
		i = best;
	}
	psp_sift_up(t, i, HENT(t, n));
}

static inline void psp_heap_erase(struct psp_tree *t, struct psp_tnode *n)
{
	u32 i = t->slot[n->id], last;
	struct psp_hent e;

	if (i == 0) {
		psp_heap_pop(t);
		return;
	}
	last = --t->n;
	if (i == last)
		return;
	e = HENT(t, last);
	if (psp_hless(&e, &HENT(t, (i - 1) / HEAP_ARITY)))
		psp_sift_up(t, i, e);
	else
		psp_sift_down(t, i, e);
}

/* ---- the tree */

static inline void psp_tree_insert(struct psp_tree *t, struct psp_tnode *n)
{
	int r = psp_run_fit(t, n);

	if (likely(r >= 0))
		psp_run_append(t, r, n);
	else
		psp_heap_insert(t, n);
}

static inline void psp_tree_erase(struct psp_tree *t, struct psp_tnode *n)
{
	if (n->prev == PSP_IN_HEAP)
		psp_heap_erase(t, n);
	else
		psp_run_unlink(t, n);
}

/* (key, seq) grew: move the node back. */
static inline void psp_tree_requeue(struct psp_tree *t, struct psp_tnode *n)
{
	int r;

	if (n->prev == PSP_IN_HEAP) {
		r = psp_run_fit(t, n);
		if (r >= 0) {
			psp_heap_erase(t, n);
			psp_run_append(t, r, n);
		} else {
			/* sink it from where it is */
			psp_sift_down(t, t->slot[n->id], psp_hent_of(n));
		}
		return;
	}
	if (PSP_IS_END(n->next) ||
	    psp_nless(n, psp_tnode_of(t, n->next))) {
		/* still sorted: it stays, its run's keys follow */
		if (PSP_IS_END(n->next)) {
			r = n->next - PSP_END(0);
			t->tkey[r] = n->key;
			t->tseq[r] = n->seq;
		}
		if (PSP_IS_END(n->prev)) {
			r = n->prev - PSP_END(0);
			t->hkey[r] = n->key;
			t->hseq[r] = n->seq;
		}
		return;
	}
	psp_run_unlink(t, n);
	psp_tree_insert(t, n);
}

static inline struct psp_tnode *psp_tree_first(struct psp_tree *t)
{
	int r = psp_run_min(t);

	if (t->n && (r < 0 || psp_kless(HENT(t, 0).key, HENT(t, 0).seq,
					t->hkey[r], t->hseq[r])))
		return psp_tnode_of(t, HENT(t, 0).id);
	return r < 0 ? NULL : psp_tnode_of(t, t->rhead[r]);
}

/* The node that is first once first is gone: the smallest of the other
 * runs' heads and the successor of first in its run or heap.  Only the
 * successor in a run is read from its node.
 */
static inline struct psp_tnode *psp_tree_second(struct psp_tree *t, u64 *key)
{
	int r, f = psp_run_min(t);
	bool hfirst = t->n && (f < 0 || psp_kless(HENT(t, 0).key,
						  HENT(t, 0).seq,
						  t->hkey[f], t->hseq[f]));
	u32 m, bid = PSP_NIL, bseq = 0;
	u64 bkey = 0;

#define PSP_CAND(k, s, i)						\
	do {								\
		if (bid == PSP_NIL || psp_kless(k, s, bkey, bseq)) {	\
			bkey = (k);					\
			bseq = (s);					\
			bid = (i);					\
		}							\
	} while (0)

	for (m = t->used; m; m &= m - 1) {
		r = __builtin_ctz(m);
		if (hfirst || r != f)
			PSP_CAND(t->hkey[r], t->hseq[r], t->rhead[r]);
	}
	if (hfirst) {
		if (t->n >= 2) {
			const struct psp_hent *e =
				&HENT(t, psp_min_child(t, 1, t->n));

			PSP_CAND(e->key, e->seq, e->id);
		}
	} else if (f >= 0) {
		u32 x = psp_tnode_of(t, t->rhead[f])->next;

		if (t->n)
			PSP_CAND(HENT(t, 0).key, HENT(t, 0).seq, HENT(t, 0).id);
		if (!PSP_IS_END(x)) {
			const struct psp_tnode *xn = psp_tnode_of(t, x);

			PSP_CAND(xn->key, xn->seq, x);
		}
	}
#undef PSP_CAND
	if (bid == PSP_NIL)
		return NULL;
	*key = bkey;
	return psp_tnode_of(t, bid);
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

#include "../psp_sched.h"

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
	u64			drops;
} __attribute__((aligned(64)));

struct psp_sim {
	struct psp_sched	s;
	struct sim_class	*cls;		/* one array: cap classes */
	u32			ncls, cap;
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

static struct sim_class *sim_get(struct psp_sim *sim, int cls)
{
	if (cls < 0 || (u32)cls >= sim->ncls || !sim->cls[cls].used)
		return NULL;
	return &sim->cls[cls];
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
	for (i = 0; i < sim->ncls; i++)
		free(sim->cls[i].ring);
	free(sim->cls);
	psp_tree_free(&sim->s.wtree);
	psp_tree_free(&sim->s.etree);
	psp_tree_free(&sim->s.utree);
	psp_tree_free(&sim->s.btree);
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

/* The trees find nodes by id in the class array: point them at it. */
static void sim_tree_bases(struct psp_sim *sim)
{
	char *base = (char *)sim->cls;

	sim->s.wtree.base = base + offsetof(struct sim_class, sc.rnode);
	sim->s.etree.base = sim->s.wtree.base;
	sim->s.utree.base = sim->s.wtree.base;
	sim->s.btree.base = base + offsetof(struct sim_class, sc.bnode);
	sim->s.wtree.stride = sizeof(struct sim_class);
	sim->s.etree.stride = sizeof(struct sim_class);
	sim->s.utree.stride = sizeof(struct sim_class);
	sim->s.btree.stride = sizeof(struct sim_class);
}

int psp_sim_add_class(struct psp_sim *sim, u64 rate, u64 ceil, u32 limit)
{
	struct sim_class *c;

	if (ceil && ceil < rate)
		return -1;
	if (sim->ncls == sim->cap) {
		/* the classes move: nothing but the trees' bases points at them */
		u32 cap = sim->cap ? 2 * sim->cap : 16;
		struct sim_class *a;

		if (posix_memalign((void **)&a, 64, (size_t)cap * sizeof(*a)))
			return -1;
		if (sim->ncls)
			memcpy(a, sim->cls, (size_t)sim->ncls * sizeof(*a));
		memset(a + sim->ncls, 0, (size_t)(cap - sim->ncls) * sizeof(*a));
		free(sim->cls);
		sim->cls = a;
		sim->cap = cap;
		sim_tree_bases(sim);
	}
	if (psp_tree_reserve(&sim->s.wtree, sim->cap) ||
	    psp_tree_reserve(&sim->s.etree, sim->cap) ||
	    psp_tree_reserve(&sim->s.utree, sim->cap) ||
	    psp_tree_reserve(&sim->s.btree, sim->cap))
		return -1;
	c = &sim->cls[sim->ncls];
	c->limit = limit ? limit : PSP_DEFAULT_LIMIT;
	c->used = 1;
	c->sc.rnode.id = sim->ncls;
	c->sc.bnode.id = sim->ncls;
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
	out->cls = (u32)(c - sim->cls);
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
		n += sim->cls[i].used;
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
	c = &sim->cls[cls];
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

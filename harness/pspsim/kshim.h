/* SPDX-License-Identifier: GPL-2.0 */
/*
 * kshim.h - the few kernel interfaces ../psp_tree.h is written against, for
 * the userspace simulator: a red-black tree with the kernel's rbtree API
 * (struct rb_node with the parent and colour in one word, rb_root_cached
 * with the leftmost node cached), a doubly linked list with the kernel's
 * list API, and bit helpers.  Written for this project (textbook red-black
 * insert and delete with parent pointers); only the names and the node
 * layout follow the kernel's, so that psp_tree.h compiles unchanged here
 * and in the module.  Nothing here allocates.
 */
#ifndef _PSP_KSHIM_H
#define _PSP_KSHIM_H

#include <assert.h>
#include <stdbool.h>
#include <stddef.h>

#ifndef container_of
#define container_of(ptr, type, member) \
	((type *)((char *)(ptr) - offsetof(type, member)))
#endif
#define offsetofend(type, member) \
	(offsetof(type, member) + sizeof(((type *)0)->member))
#define prefetch(p)	__builtin_prefetch(p)

/* ------------------------------------------------------------- bits */

#define BITS_PER_LONG	(8 * (int)sizeof(long))
#define GENMASK(h, l) \
	(((~0UL) << (l)) & (~0UL >> (BITS_PER_LONG - 1 - (h))))

static inline void __set_bit(int nr, unsigned long *addr)
{
	*addr |= 1UL << nr;
}

static inline void __clear_bit(int nr, unsigned long *addr)
{
	*addr &= ~(1UL << nr);
}

/* The first zero bit (the word must have one). */
static inline int ffz(unsigned long word)
{
	return __builtin_ctzl(~word);
}

static inline int kshim_next_bit(unsigned long word, int size, int from)
{
	unsigned long w;

	if (from >= size)
		return size;
	w = word & (~0UL << from);
	if (size < BITS_PER_LONG)
		w &= (1UL << size) - 1;
	return w ? __builtin_ctzl(w) : size;
}

#define for_each_set_bit(bit, addr, size)				\
	for ((bit) = kshim_next_bit(*(addr), (size), 0); (bit) < (size);	\
	     (bit) = kshim_next_bit(*(addr), (size), (bit) + 1))

/* ------------------------------------------------------------- list */

struct list_head {
	struct list_head *next, *prev;
};

static inline void INIT_LIST_HEAD(struct list_head *h)
{
	h->next = h;
	h->prev = h;
}

static inline bool list_empty(const struct list_head *h)
{
	return h->next == h;
}

static inline void list_add_tail(struct list_head *n, struct list_head *h)
{
	struct list_head *last = h->prev;

	n->next = h;
	n->prev = last;
	last->next = n;
	h->prev = n;
}

static inline void list_del(struct list_head *n)
{
	n->prev->next = n->next;
	n->next->prev = n->prev;
	n->next = NULL;		/* a use after removal faults */
	n->prev = NULL;
}

#define list_entry(ptr, type, member)	container_of(ptr, type, member)
#define list_first_entry(head, type, member) \
	list_entry((head)->next, type, member)
#define list_next_entry(pos, member) \
	list_entry((pos)->member.next, __typeof__(*(pos)), member)

/* ----------------------------------------------------------- rbtree */

/* The parent pointer and the colour share a word (nodes are aligned);
 * a node whose word points at itself is in no tree (RB_EMPTY_NODE).
 */
struct rb_node {
	unsigned long	__rb_parent_color;
	struct rb_node	*rb_right;
	struct rb_node	*rb_left;
} __attribute__((aligned(sizeof(long))));

struct rb_root {
	struct rb_node	*rb_node;
};

struct rb_root_cached {
	struct rb_root	rb_root;
	struct rb_node	*rb_leftmost;
};

#define RB_RED		0UL
#define RB_BLACK	1UL
#define RB_ROOT_CACHED	((struct rb_root_cached){ { NULL }, NULL })
#define RB_EMPTY_NODE(n) ((n)->__rb_parent_color == (unsigned long)(n))
#define RB_CLEAR_NODE(n) ((n)->__rb_parent_color = (unsigned long)(n))
#define rb_entry(ptr, type, member)	container_of(ptr, type, member)

static inline struct rb_node *krb_parent(const struct rb_node *n)
{
	return (struct rb_node *)(n->__rb_parent_color & ~3UL);
}

/* NULL leaves are black */
static inline unsigned long krb_color(const struct rb_node *n)
{
	return n ? (n->__rb_parent_color & 1UL) : RB_BLACK;
}

static inline void krb_set_parent(struct rb_node *n, struct rb_node *p)
{
	n->__rb_parent_color = (unsigned long)p | (n->__rb_parent_color & 1UL);
}

static inline void krb_set_color(struct rb_node *n, unsigned long color)
{
	n->__rb_parent_color = (n->__rb_parent_color & ~1UL) | color;
}

/* @parent's child @old becomes @new (the root if @parent is NULL) */
static inline void krb_replace_child(struct rb_node *old, struct rb_node *new,
				     struct rb_node *parent,
				     struct rb_root *root)
{
	if (!parent)
		root->rb_node = new;
	else if (parent->rb_left == old)
		parent->rb_left = new;
	else
		parent->rb_right = new;
}

/* @x's right child takes its place, @x becomes its left child */
static inline void krb_rotate_left(struct rb_node *x, struct rb_root *root)
{
	struct rb_node *y = x->rb_right, *p = krb_parent(x);

	x->rb_right = y->rb_left;
	if (y->rb_left)
		krb_set_parent(y->rb_left, x);
	krb_set_parent(y, p);
	krb_replace_child(x, y, p, root);
	y->rb_left = x;
	krb_set_parent(x, y);
}

static inline void krb_rotate_right(struct rb_node *x, struct rb_root *root)
{
	struct rb_node *y = x->rb_left, *p = krb_parent(x);

	x->rb_left = y->rb_right;
	if (y->rb_right)
		krb_set_parent(y->rb_right, x);
	krb_set_parent(y, p);
	krb_replace_child(x, y, p, root);
	y->rb_right = x;
	krb_set_parent(x, y);
}

/* @z was linked in red as a leaf: restore "no red node has a red child" */
static inline void krb_insert_fixup(struct rb_node *z, struct rb_root *root)
{
	struct rb_node *p, *g, *u;

	while ((p = krb_parent(z)) && krb_color(p) == RB_RED) {
		g = krb_parent(p);	/* a red node is not the root */
		if (p == g->rb_left) {
			u = g->rb_right;
			if (krb_color(u) == RB_RED) {
				krb_set_color(p, RB_BLACK);
				krb_set_color(u, RB_BLACK);
				krb_set_color(g, RB_RED);
				z = g;
				continue;
			}
			if (z == p->rb_right) {
				krb_rotate_left(p, root);
				z = p;
				p = krb_parent(z);
			}
			krb_set_color(p, RB_BLACK);
			krb_set_color(g, RB_RED);
			krb_rotate_right(g, root);
		} else {
			u = g->rb_left;
			if (krb_color(u) == RB_RED) {
				krb_set_color(p, RB_BLACK);
				krb_set_color(u, RB_BLACK);
				krb_set_color(g, RB_RED);
				z = g;
				continue;
			}
			if (z == p->rb_left) {
				krb_rotate_right(p, root);
				z = p;
				p = krb_parent(z);
			}
			krb_set_color(p, RB_BLACK);
			krb_set_color(g, RB_RED);
			krb_rotate_left(g, root);
		}
	}
	krb_set_color(root->rb_node, RB_BLACK);
}

/* A black node left the path to @x (child of @parent, maybe NULL):
 * give the path its black back.
 */
static inline void krb_erase_fixup(struct rb_node *x, struct rb_node *parent,
				   struct rb_root *root)
{
	struct rb_node *w;

	while (x != root->rb_node && krb_color(x) == RB_BLACK) {
		if (x == parent->rb_left) {
			w = parent->rb_right;
			if (krb_color(w) == RB_RED) {
				krb_set_color(w, RB_BLACK);
				krb_set_color(parent, RB_RED);
				krb_rotate_left(parent, root);
				w = parent->rb_right;
			}
			if (krb_color(w->rb_left) == RB_BLACK &&
			    krb_color(w->rb_right) == RB_BLACK) {
				krb_set_color(w, RB_RED);
				x = parent;
				parent = krb_parent(x);
				continue;
			}
			if (krb_color(w->rb_right) == RB_BLACK) {
				krb_set_color(w->rb_left, RB_BLACK);
				krb_set_color(w, RB_RED);
				krb_rotate_right(w, root);
				w = parent->rb_right;
			}
			krb_set_color(w, krb_color(parent));
			krb_set_color(parent, RB_BLACK);
			krb_set_color(w->rb_right, RB_BLACK);
			krb_rotate_left(parent, root);
		} else {
			w = parent->rb_left;
			if (krb_color(w) == RB_RED) {
				krb_set_color(w, RB_BLACK);
				krb_set_color(parent, RB_RED);
				krb_rotate_right(parent, root);
				w = parent->rb_left;
			}
			if (krb_color(w->rb_left) == RB_BLACK &&
			    krb_color(w->rb_right) == RB_BLACK) {
				krb_set_color(w, RB_RED);
				x = parent;
				parent = krb_parent(x);
				continue;
			}
			if (krb_color(w->rb_left) == RB_BLACK) {
				krb_set_color(w->rb_right, RB_BLACK);
				krb_set_color(w, RB_RED);
				krb_rotate_left(w, root);
				w = parent->rb_left;
			}
			krb_set_color(w, krb_color(parent));
			krb_set_color(parent, RB_BLACK);
			krb_set_color(w->rb_left, RB_BLACK);
			krb_rotate_right(parent, root);
		}
		x = root->rb_node;
	}
	if (x)
		krb_set_color(x, RB_BLACK);
}

static inline struct rb_node *rb_next(const struct rb_node *n)
{
	struct rb_node *p;

	if (RB_EMPTY_NODE(n))
		return NULL;
	if (n->rb_right) {
		n = n->rb_right;
		while (n->rb_left)
			n = n->rb_left;
		return (struct rb_node *)n;
	}
	while ((p = krb_parent(n)) && n == p->rb_right)
		n = p;
	return p;
}

static inline struct rb_node *rb_first_cached(const struct rb_root_cached *t)
{
	return t->rb_leftmost;
}

/* Insert @node after every node it is not less than (as the kernel's). */
static inline void rb_add_cached(struct rb_node *node,
				 struct rb_root_cached *tree,
				 bool (*less)(struct rb_node *,
					      const struct rb_node *))
{
	struct rb_node **link = &tree->rb_root.rb_node, *parent = NULL;
	bool leftmost = true;

	while (*link) {
		parent = *link;
		if (less(node, parent)) {
			link = &parent->rb_left;
		} else {
			link = &parent->rb_right;
			leftmost = false;
		}
	}
	node->__rb_parent_color = (unsigned long)parent | RB_RED;
	node->rb_left = NULL;
	node->rb_right = NULL;
	*link = node;
	if (leftmost)
		tree->rb_leftmost = node;
	krb_insert_fixup(node, &tree->rb_root);
}

static inline void rb_erase_cached(struct rb_node *z,
				   struct rb_root_cached *tree)
{
	struct rb_root *root = &tree->rb_root;
	struct rb_node *child, *parent, *y;
	unsigned long color;

	if (tree->rb_leftmost == z)
		tree->rb_leftmost = rb_next(z);
	if (!z->rb_left || !z->rb_right) {
		/* at most one child: it takes z's place */
		child = z->rb_left ? z->rb_left : z->rb_right;
		parent = krb_parent(z);
		color = krb_color(z);
		if (child)
			krb_set_parent(child, parent);
		krb_replace_child(z, child, parent, root);
	} else {
		/* z's successor y (no left child) takes z's place and colour */
		y = z->rb_right;
		while (y->rb_left)
			y = y->rb_left;
		color = krb_color(y);
		child = y->rb_right;
		if (krb_parent(y) == z) {
			parent = y;
		} else {
			parent = krb_parent(y);
			if (child)
				krb_set_parent(child, parent);
			parent->rb_left = child;
			y->rb_right = z->rb_right;
			krb_set_parent(y->rb_right, y);
		}
		y->rb_left = z->rb_left;
		krb_set_parent(y->rb_left, y);
		krb_replace_child(z, y, krb_parent(z), root);
		y->__rb_parent_color = z->__rb_parent_color;
	}
	if (color == RB_BLACK)
		krb_erase_fixup(child, parent, root);
}

#endif /* _PSP_KSHIM_H */

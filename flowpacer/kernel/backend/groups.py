"""Aggregate rates on htb (issue 15): the group classes above the flow classes, and their rates.

A rule with ``total_rate`` and/or ``client_rate`` gets a class hierarchy under the link class::

    f1f0:1 link
      └─ rule class      rate = min(total_rate, what its clients want)   ceil = total_rate
           └─ client class   rate = its share (below)                     ceil = client_rate
                └─ flow class    rate = its share (below)                 ceil = min(ceil, caps)

(a rule with only one of the two has only that level; the u32 filter still points at the flow's
leaf class). The classes are made when their first flow comes and deleted with their last one.

The htb mapping. htb lets a class that is under its own ``rate`` send whatever its parents say:
only borrowing (sending above ``rate``, up to ``ceil``) asks the parents for tokens. So a parent
is a cap only if its children's rates add up to at most its own. Hence:

- every class's *nominal* rate is what it wants: a flow its rule's ``rate``, a group the sum of
  its children's nominal rates, but at most the group's cap;
- a group's rate is distributed to its children **in proportion to their nominal rates** when
  they want more than it has, else each child gets its nominal rate. The oversubscription
  factor is rounded up to a step of 2**(1/8) (``shares``), so the guaranteed shares add up to
  91-100 % of the group's rate and the rest is borrowed (DRR by quantum, also in proportion);
  a capped client with four equal flows gives each about a quarter of ``client_rate``;
- every child's ``ceil`` is its own cap clipped by its parent's ``ceil``: a flow borrows idle
  capacity up to its rule's ``ceil`` but never past its client's or its rule's cap;
- every class has the same prio and a quantum proportional to its rate (``htb.quantum_for``), so
  that what is borrowed is also shared in proportion to the rates.

A flow's rate therefore changes when a sibling comes or goes: the backend re-computes the shares
of every group touched by a plan and changes the classes whose kernel rates differ, in the same
netlink transaction as the plan's own adds and removes.

psp (``kernel_shares``): the module does the sharing itself (in proportion to the rates, the cap on
the group's byte clock), so ``targets`` gives every group its cap and every flow its nominal rate
with its ceil clipped by its groups' caps and the link: the kernel values do not depend on the
siblings, and a flow's class never changes when another comes or goes.

This module is the bookkeeping and the arithmetic (no netlink): ``GroupTree`` and ``targets``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Hashable, List, Mapping, Optional, Tuple

from flowpacer.model import Group, GroupKind

Rates = Tuple[int, int]          # (rate_bps, ceil_bps) as the kernel has them


@dataclass
class Node:
    """One group class."""
    minor: int
    parent: Optional[int]            # the parent group's minor; None: under the link class
    kind: Optional[GroupKind]        # None: adopted from the kernel, level not known yet
    gid: str                         # Group.id; "" when adopted and not yet named by a plan
    rate_bps: int                    # the group's cap (Group.rate_bps)
    ceil_bps: int
    kernel: Optional[Rates] = None   # what the kernel has; None until it was created


class GroupTree:
    """The group classes by minor, and by (parent, id) for the plan's look-ups."""

    def __init__(self):
        self.nodes: Dict[int, Node] = {}
        self._index: Dict[Tuple[Optional[int], str], int] = {}

    def __len__(self) -> int:
        return len(self.nodes)

    def find(self, parent: Optional[int], gid: str) -> Optional[int]:
        return self._index.get((parent, gid))

    def add(self, node: Node) -> None:
        self.nodes[node.minor] = node
        if node.gid:
            self._index[(node.parent, node.gid)] = node.minor

    def bind(self, minor: int, group: Group) -> bool:
        """Name an adopted node after the plan's group; False if the name is taken."""
        n = self.nodes[minor]
        if n.gid == group.id:
            n.kind = group.kind
            return True
        if n.gid or (n.parent, group.id) in self._index:
            return False
        n.gid, n.kind = group.id, group.kind
        self._index[(n.parent, n.gid)] = minor
        return True

    def drop(self, minor: int) -> None:
        n = self.nodes.pop(minor, None)
        if n is not None and n.gid and self._index.get((n.parent, n.gid)) == minor:
            del self._index[(n.parent, n.gid)]

    def chain(self, minor: Optional[int]) -> List[int]:
        """The group minors from the top down to ``minor`` (a flow's parent)."""
        out = []
        while minor is not None:
            out.append(minor)
            minor = self.nodes[minor].parent
        out.reverse()
        return out

    def groups(self, minor: Optional[int]) -> Tuple[Group, ...]:
        """The ``Shape.groups`` of a flow under ``minor`` (adopted ones: unnamed, level guessed)."""
        out = []
        for m in self.chain(minor):
            n = self.nodes[m]
            out.append(Group(n.kind or GroupKind.CLIENT, n.gid, n.rate_bps, n.ceil_bps))
        return tuple(out)

    def depth_first(self) -> List[int]:
        """Minors, children before their parents (the order to delete in)."""
        return sorted(self.nodes, key=lambda m: -len(self.chain(m)))

    def matches(self, minor: Optional[int], groups: Tuple[Group, ...]) -> bool:
        """Whether a flow under ``minor`` already sits under ``groups`` as far as the kernel is
        concerned (same levels, same caps) and each level has or can take the group's name."""
        ch = self.chain(minor)
        if len(ch) != len(groups):
            return False
        for m, g in zip(ch, groups):
            n = self.nodes[m]
            if (n.rate_bps, n.ceil_bps) != (g.rate_bps, g.ceil_bps):
                return False
            if n.gid != g.id and (n.gid or (n.parent, g.id) in self._index):
                return False
        return True


@dataclass(frozen=True)
class Member:
    """A flow as ``targets`` needs it: where it hangs and what its rule gives it."""
    parent: Optional[int]
    rate_bps: int
    ceil_bps: int


STEPS_PER_DOUBLING = 8      # oversubscription is rounded up to a power of 2**(1/8) (9 % steps)


def shares(wants: List[int], rate: int) -> List[int]:
    """``rate`` divided in proportion to ``wants`` when they add up to more, else ``wants``.

    The oversubscription factor is rounded **up** to the next step of 2**(1/8): the shares add
    up to a little less than ``rate`` (at most 9 % less; the children borrow the rest from the
    parent, as htb's DRR gives it in proportion to their quanta), and they stay the same while
    the demand moves within a step. Without the steps every flow of a full rule would change its
    class each time one client came or went (2 200 netlink messages for a flow of a new client
    in a rule of 2 000 flows over its total_rate); with them that happens once per 9 % of
    change in demand."""
    total = sum(wants)
    if total <= rate:
        return list(wants)
    k = math.ceil(STEPS_PER_DOUBLING * math.log2(total / rate) - 1e-9)
    f = 2.0 ** (k / STEPS_PER_DOUBLING)
    out = [max(1, int(w / f)) for w in wants]
    if sum(out) > rate:                  # float rounding at a step's edge, or the 1 B/s floors
        out = [max(1, w * rate // total) for w in wants]
    return out


def targets(tree: GroupTree, flows: Mapping[Hashable, Member], link_rate_bps: int,
            roots: Optional[set] = None, kernel_shares: bool = False
            ) -> Tuple[Dict[Hashable, Rates], Dict[int, Rates]]:
    """The kernel (rate, ceil) of every flow under a group and of every group class.

    ``flows``: every flow that hangs under a group (after the plan); ``roots``: only the
    trees under these top groups (None: all). Groups without members get no target (they are
    about to be deleted). ``kernel_shares``: the kernel shares a group's rate itself (psp): the
    nominal values, see the module docstring."""
    if kernel_shares:
        return _nominal_targets(tree, flows, link_rate_bps, roots)
    kids_f: Dict[int, List[Hashable]] = {}
    kids_n: Dict[int, List[int]] = {}
    for k, f in flows.items():
        if f.parent is not None:
            kids_f.setdefault(f.parent, []).append(k)
    for m, n in tree.nodes.items():
        if n.parent is not None:
            kids_n.setdefault(n.parent, []).append(m)

    nominal: Dict[int, int] = {}

    def nom(m: int) -> int:
        if m not in nominal:
            want = sum(flows[k].rate_bps for k in kids_f.get(m, ())) + \
                sum(nom(c) for c in kids_n.get(m, ()))
            nominal[m] = min(tree.nodes[m].rate_bps, want)
        return nominal[m]

    flow_out: Dict[Hashable, Rates] = {}
    node_out: Dict[int, Rates] = {}

    def assign(m: int, rate: int, parent_ceil: int) -> None:
        n = tree.nodes[m]
        ceil = max(rate, min(n.ceil_bps, parent_ceil))
        node_out[m] = (rate, ceil)
        fk = kids_f.get(m, [])
        nk = kids_n.get(m, [])
        wants = [flows[k].rate_bps for k in fk] + [nom(c) for c in nk]
        got = shares(wants, rate)
        for k, s in zip(fk, got[:len(fk)]):
            f = flows[k]
            flow_out[k] = (s, max(s, min(f.ceil_bps, ceil, link_rate_bps)))
        for c, s in zip(nk, got[len(fk):]):
            if nom(c) > 0:
                assign(c, s, ceil)

    for m, n in tree.nodes.items():
        if n.parent is None and (roots is None or m in roots) and nom(m) > 0:
            assign(m, nom(m), min(n.ceil_bps, link_rate_bps))
    return flow_out, node_out


def _nominal_targets(tree: GroupTree, flows: Mapping[Hashable, Member], link_rate_bps: int,
                     roots: Optional[set]) -> Tuple[Dict[Hashable, Rates], Dict[int, Rates]]:
    """``targets`` for a kernel that shares groups itself: a group its cap (rate == ceil), a
    flow its rate and its ceil within its groups' caps and the link."""
    flow_out: Dict[Hashable, Rates] = {}
    node_out: Dict[int, Rates] = {}
    for k, f in flows.items():
        if f.parent is None:
            continue
        chain = tree.chain(f.parent)
        if roots is not None and chain[0] not in roots:
            continue
        cap = link_rate_bps
        for m in chain:
            n = tree.nodes[m]
            node_out[m] = (n.rate_bps, n.rate_bps)
            cap = min(cap, n.rate_bps)
        flow_out[k] = (f.rate_bps, max(f.rate_bps, min(f.ceil_bps, cap)))
    return flow_out, node_out

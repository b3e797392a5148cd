"""Group classes of ``TcBackend`` (issue 15): ``GroupClasses``, the rule and client classes above
flows with ``client_rate``/``total_rate`` (their ``GroupTree`` and rates: groups.py). A plan's
ops of flows under groups are queued here, in the plan's own batch, with the group classes they
need and the new shares of their siblings; the flows' own classes and filters are queued by
``FlowClasses`` (tcflows.py), which hands itself to ``queue``. Also their adoption after a
restart and their audit.
"""
from __future__ import annotations

import errno
import logging
from typing import (TYPE_CHECKING, Dict, Iterable, List, Optional, Sequence, Set, Tuple)

from flowpacer.model import (ApplyResult, FlowKey, GroupKey, GroupView, Op, OpError, OpKind,
                             Shape)
from flowpacer.kernel.tc import nl
from flowpacer.kernel.tc.nl import tc_handle
from flowpacer.kernel.backend.filters import LayoutFull
from flowpacer.kernel.backend.groups import GroupKind, GroupTree, Member, Node, targets
from flowpacer.kernel.backend.handles import FIRST_FLOW_MINOR, MAJOR, Installed, handle_text
from flowpacer.kernel.backend.tcchannel import Channel
from flowpacer.kernel.backend.tcids import ClassIds

if TYPE_CHECKING:
    from flowpacer.kernel.backend.tcflows import FlowClasses

log = logging.getLogger(__name__)


class GroupClasses:
    """The group classes of one tc backend: the tree of them, what the kernel has of each."""

    def __init__(self, chan: Channel, ids: ClassIds):
        self._chan = chan
        self._ids = ids
        self._tree = GroupTree()
        self._warned = False            # a codec without groups: said once
        self._enabled = chan.codec.supports_groups
        self._kernel_shares = chan.codec.kernel_shares

    def __len__(self) -> int:
        return len(self._tree)

    def forget(self) -> None:
        self._tree = GroupTree()

    def involves(self, op: Op, inst: Optional[Installed]) -> bool:
        """Whether an op involves group classes: its flow gets groups or hangs under one."""
        want = op.shape is not None and bool(op.shape.groups)
        if not self._enabled:
            if want and not self._warned:
                self._warned = True
                log.warning("%s: the %s backend has no group classes yet: client_rate and "
                            "total_rate are not enforced, each flow is paced at its rate",
                            self._chan.interface, self._chan.codec.kind.value)
            return False
        return want or (inst is not None and inst.parent is not None)

    # --------------------------------------------------------------- views
    def snapshot(self) -> List[tuple]:
        """[(kind, id, classid, rate_bps, ceil_bps)] of the group classes (kernel rates)."""
        out = []
        for m, n in self._tree.nodes.items():
            if n.kernel is not None:
                out.append((n.kind, n.gid, tc_handle(MAJOR, m), n.kernel[0], n.kernel[1]))
        return out

    def views(self) -> Tuple[GroupView, ...]:
        """The group classes the kernel has, for status and metrics (no class ids)."""
        return tuple(GroupView(n.kind, n.gid, handle_text(tc_handle(MAJOR, m)), n.kernel[0],
                               n.kernel[1])
                     for m, n in list(self._tree.nodes.items()) if n.kernel is not None)

    def stat_keys(self) -> List[Tuple[int, GroupKey]]:
        """(class id, ``GroupKey``) of every group class, copied in one step."""
        return [(tc_handle(MAJOR, m), GroupKey(n.kind, n.gid))
                for m, n in list(self._tree.nodes.items())]

    # --------------------------------------------------------------- plans
    def _group_parent(self, groups, res: ApplyResult, op: Op, created: List[int]):
        """The minor of the innermost group class for ``groups`` (made in the tree if missing,
        appended to ``created``); None for no groups; False when no class id is left."""
        tree = self._tree
        parent = None
        for g in groups:
            m = tree.find(parent, g.id)
            if m is None:
                try:
                    m = self._ids.alloc()
                except LayoutFull as e:
                    res.errors.append(OpError(op, str(e)))
                    return False
                tree.add(Node(m, parent, g.kind, g.id, g.rate_bps, g.ceil_bps))
                created.append(m)
            else:
                n = tree.nodes[m]
                n.rate_bps, n.ceil_bps, n.kind = g.rate_bps, g.ceil_bps, g.kind  # a reload's rates
            parent = m
        return parent

    def queue(self, ops: Sequence[Op], add, res: ApplyResult, flows: "FlowClasses") -> None:
        """The ops of flows under groups, with their group classes: new groups first (parents
        before children), the flows' own removes/moves/adds/changes (queued by ``flows``), then
        the new shares of their siblings and groups, then the groups left empty (children
        before parents). ``add(req, callback)`` as in ``FlowClasses.apply``."""
        tree = self._tree
        under = flows.grouped()
        where: Dict[FlowKey, Optional[int]] = {k: v.parent for k, v in under.items()}
        rates: Dict[FlowKey, Shape] = {k: v.shape for k, v in under.items()}
        created: List[int] = []
        actions = []
        for op in ops:
            inst = flows.get(op.key)
            if op.kind is OpKind.REMOVE:
                if inst is not None:
                    actions.append(("remove", op, inst, None))
                    where.pop(op.key, None)
                continue
            if inst is None and op.kind in (OpKind.CHANGE, OpKind.RELABEL):
                res.errors.append(OpError(op, f"{op.kind.value} of unknown flow {op.key}"))
                continue
            if inst is not None and tree.matches(inst.parent, op.shape.groups):
                for m, g in zip(tree.chain(inst.parent), op.shape.groups):
                    tree.bind(m, g)
                    n = tree.nodes[m]
                    n.rate_bps, n.ceil_bps = g.rate_bps, g.ceil_bps
                actions.append(("change", op, inst, inst.parent))
                where[op.key], rates[op.key] = inst.parent, op.shape
                continue
            parent = self._group_parent(op.shape.groups, res, op, created)
            if parent is False:
                continue
            actions.append(("add" if inst is None else "move", op, inst, parent))
            if parent is None:
                where.pop(op.key, None)
            else:
                where[op.key], rates[op.key] = parent, op.shape
        # only the trees this plan touches are computed again (a tree is one top group)
        root_of: Dict[Optional[int], Optional[int]] = {None: None}

        def root(p):
            if p not in root_of:
                root_of[p] = tree.chain(p)[0] if p in tree.nodes else None
            return root_of[p]
        roots = set()
        for _kind, op, inst, parent in actions:
            roots.add(root(parent))
            if inst is not None:
                roots.add(root(inst.parent))
        roots.update(root(m) for m in created)
        roots.discard(None)
        members = {k: Member(p, rates[k].rate_bps, rates[k].ceil_bps) for k, p in where.items()
                   if root(p) in roots}
        flow_t, node_t = targets(tree, members, self._chan.link_rate_bps, roots,
                                 self._kernel_shares)
        for m in created:
            self._queue_group_class(m, node_t.get(m), True, add)
        for m, n in list(tree.nodes.items()):
            if m not in created and m in node_t and n.kernel != node_t[m]:
                self._queue_group_class(m, node_t[m], False, add)
        touched = set()
        for kind, op, inst, parent in actions:
            touched.add(op.key)
            if kind == "remove":
                flows.queue_remove(op, inst, add, res)
            elif kind == "add":
                flows.queue_add(op, add, res, parent, flow_t.get(op.key))
            elif kind == "move":        # htb cannot re-parent a class: a new class, a new filter
                flows.queue_remove(op, inst, add, res)
                flows.queue_add(op, add, res, parent, flow_t.get(op.key))
            else:
                kt = flow_t.get(op.key)
                if kt == inst.kernel:
                    flows.relabel(inst, op.shape)
                else:
                    flows.queue_change(op, inst, add, res, kt)
        for k, kt in flow_t.items():      # siblings whose share changed
            inst = flows.get(k)
            if k in touched or inst is None or inst.kernel == kt:
                continue
            flows.queue_change(Op(OpKind.CHANGE, k, inst.shape), inst, add, res, kt)
        used = set()
        for p in where.values():
            used.update(tree.chain(p))
        for m in tree.depth_first():
            if m not in used:
                self._queue_group_delete(m, add)

    def _queue_group_class(self, minor: int, rates: Optional[tuple], create: bool, add) -> None:
        n = self._tree.nodes[minor]
        r = rates or (n.rate_bps, n.ceil_bps)
        classid = tc_handle(MAJOR, minor)
        chan = self._chan

        def done(err):
            if err is None:
                n.kernel = r
            elif create:
                self._tree.drop(minor)
                if err.errno != errno.EEXIST:
                    self._ids.free(minor)
        what = "add" if create else "change"
        add(chan.class_msg(minor, n.parent or chan.flow_parent,
                           chan.codec.group_class_options(r[0], r[1], chan.link_rate_bps), create,
                           lambda: f"{what} group class {nl.fmt_handle(classid)} ({n.gid})"), done)

    def _queue_group_delete(self, minor: int, add) -> None:
        n = self._tree.nodes[minor]
        classid = tc_handle(MAJOR, minor)

        def done(err):
            if err is None or err.errno == errno.ENOENT:
                self._tree.drop(minor)
                self._ids.free(minor)
            else:
                log.warning("%s: cannot delete group class %s (%s): %s", self._chan.interface,
                            nl.fmt_handle(classid), n.gid, err)
        add(self._chan.class_del(classid,
                                 lambda: f"delete group class {nl.fmt_handle(classid)} ({n.gid})"),
            done)

    # ------------------------------------------------------ adoption, audit
    def adopt(self, classes: Dict[int, nl.TcObject],
              bound: Iterable[int]) -> Tuple[Set[int], Dict[int, Tuple[int, tuple]]]:
        """After a restart: the group classes above the bound flow classes (minors ``bound``)
        back in the tree (unnamed until a plan names them: ``GroupTree.bind``). Returns the
        group minors, and {flow minor: (its group's minor, its ``Shape.groups``)} of the flow
        classes under a group (``FlowClasses.adopt_parents``)."""
        def parent_minor(m):
            p = classes[m].parent
            pm = p & 0xFFFF
            if p >> 16 != MAJOR or pm < FIRST_FLOW_MINOR or pm not in classes:
                return None
            return pm
        bound = list(bound)
        group_minors = set()
        for m in bound:
            p = parent_minor(m)
            while p is not None and p not in group_minors:
                group_minors.add(p)
                p = parent_minor(p)
        has_group_kids = {parent_minor(m) for m in group_minors} - {None}
        codec = self._chan.codec
        for m in sorted(group_minors, key=lambda x: len(self._ancestry(x, parent_minor))):
            p = parent_minor(m)
            rate, ceil = codec.parse_rates(classes[m].options)
            kind = (GroupKind.RULE if m in has_group_kids else
                    GroupKind.CLIENT if p is not None else None)
            self._tree.add(Node(m, p, kind, "", ceil, ceil, (rate, ceil)))
        under = {}
        for m in bound:
            p = parent_minor(m)
            if p is not None:
                under[m] = (p, self._tree.groups(p))
        return group_minors, under

    @staticmethod
    def _ancestry(m, parent_minor) -> List[int]:
        out = []
        p = parent_minor(m)
        while p is not None and len(out) < 8:
            out.append(p)
            p = parent_minor(p)
        return out

    def audit(self, present: Set[int], parents: Set[int]) -> None:
        """Group classes someone removed (not among ``present`` class ids) are forgotten;
        groups left without flows (``parents``: the group minors flows hang under; their flows'
        classes were removed behind our back) are deleted."""
        tree = self._tree
        if not tree.nodes:
            return
        for m in list(tree.nodes):
            if tc_handle(MAJOR, m) not in present:
                tree.drop(m)
                self._ids.free(m)
        used = set()
        for p in parents:
            if p in tree.nodes:
                used.update(tree.chain(p))
        reqs, after = [], []
        for m in tree.depth_first():
            if m not in used:
                self._queue_group_delete(m, lambda r, cb: (reqs.append(r), after.append(cb)))
        if reqs:
            for cb, err in zip(after, self._chan.transact(reqs)):
                cb(err)

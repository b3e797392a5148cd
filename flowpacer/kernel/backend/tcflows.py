"""Flow classes of ``TcBackend``: a plan's adds, changes and removes, queued into one netlink
batch (a flow's filter is deleted before its class, a half-made flow is undone), and the audit of
classes someone else removed. Flows under group classes go through ``tcgroups``.

Spares (issue 26): making or deleting a class makes the kernel walk every class of the qdisc
(``tc_bind_tclass``: 50 us per class made at 1 000 classes, 0.7 ms at 5 000, 5 ms at 10 000 on
6.18), changing one does not (2 us). So with ``spare_max`` set, a closed flow's filter goes but
its class stays, a spare, and the next new flow's class is a spare changed to its rates (one
change and one filter, no class made). A reused class' counters go on from the previous flows':
the change is sent with NLM_F_ECHO, and the counters the kernel echoes are the new flow's zero
(``Installed.base``, parsed when first read, taken out in ``class_stats``). Spares go with the root qdisc at teardown; a
restart adopts them (tc.py).
"""
from __future__ import annotations

import errno
import logging
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from flowpacer.errors import NetlinkError
from flowpacer.model import (ApplyResult, FlowKey, Op, OpError, OpKind, PoolOp, Shape,
                             Side)
from flowpacer.kernel.tc import nl, u32
from flowpacer.kernel.tc.nl import (NLM_F_CREATE, NLM_F_EXCL, RTM_DELTCLASS, RTM_DELTFILTER,
                                    RTM_NEWTFILTER, Request, tc_handle)
from flowpacer.kernel.backend.filters import LayoutFull, Placement
from flowpacer.kernel.backend.handles import (LAST_FLOW_MINOR, MAJOR, EchoedStats, Installed,
                                              handle_text, wire_key)
from flowpacer.kernel.backend.pool import queue_pool_op

log = logging.getLogger(__name__)


class FlowClasses:
    """The flow-class half of ``TcBackend`` (its state is made in ``TcBackend.__init__``)."""

    def installed(self) -> Dict[FlowKey, Shape]:
        return {k: v.shape for k, v in self._flows.items()}

    def shape_of(self, key: FlowKey) -> Optional[Shape]:
        inst = self._flows.get(key)
        return inst.shape if inst else None

    def classid_of(self, key: FlowKey) -> Optional[int]:
        inst = self._flows.get(key)
        return inst.classid if inst else None

    def _flow_options(self, shape: Shape, kernel: Optional[tuple]) -> bytes:
        """The codec's options for a flow class of these rates (raises ValueError as the codec
        does). A codec's flow options depend on the rates and the link rate only, and a burst's
        flows share a few shapes: each is encoded once."""
        s = self._kernel_shape(shape, kernel)
        ck = (s.rate_bps, s.ceil_bps, self.link_rate_bps)
        cache = self._options_cache
        options = cache.get(ck)
        if options is None:
            options = self.codec.flow_class_options(s, self.link_rate_bps)
            if len(cache) >= 1024:
                cache.clear()
            cache[ck] = options
        return options

    def apply(self, plan: Sequence[Op]) -> ApplyResult:
        """Carry out a plan. Idempotent: an ADD of a known flow changes it, a REMOVE of an
        unknown one does nothing. Failures are reported per operation; the rest goes on.
        First-byte pool ops (``PoolOp``) are applied in the same batch (pool.py); a flow
        REMOVEd earlier in the plan is a new flow for a later ADD (a rebound claim)."""
        res = ApplyResult()
        self._spares_queued = 0
        reqs: List[Request] = []
        # what to do with each request's outcome
        after: List[Callable[[Optional[NetlinkError]], None]] = []
        c = self.codec

        def add(req, cb):
            reqs.append(req)
            after.append(cb)

        grouped: List[Op] = []
        removing = set()
        for op in plan:
            if isinstance(op, PoolOp):
                queue_pool_op(self, op, add, res)
                continue
            inst = None if op.key in removing else self._flows.get(op.key)
            if self._is_grouped(op, inst):
                grouped.append(op)
                continue
            if op.kind is OpKind.REMOVE:
                if inst is None:
                    continue
                removing.add(op.key)
                self._queue_remove(op, inst, add, res)
            elif inst is not None:      # ADD of a known flow or CHANGE
                if inst.shape.rate_bps == op.shape.rate_bps and inst.shape.ceil_bps == op.shape.ceil_bps:
                    inst.shape = op.shape
                    continue
                self._queue_change(op, inst, add, res)
            elif op.kind in (OpKind.CHANGE, OpKind.RELABEL):
                res.errors.append(OpError(op, f"{op.kind.value} of unknown flow {op.key}"))
            else:
                self._queue_add(op, add, res)
        if grouped:
            self._queue_groups(grouped, add, res)
        if reqs:
            for cb, err in zip(after, self._rtnl.transact(reqs)):
                cb(err)
        return res

    def spare_count(self) -> int:
        return len(self._spares)

    def spare_handles(self) -> Tuple[str, ...]:
        return tuple(handle_text(tc_handle(MAJOR, m)) for m in sorted(self._spares))

    def _spare_kept(self, inst: Installed) -> bool:
        """Whether a removed flow's class stays as a spare (a flow-range class under the link).
        The spares of this apply's earlier removes count (they join ``_spares`` once the kernel
        answered): a batch of closes stops at ``spare_max`` too."""
        m = inst.classid & 0xFFFF
        kept = len(self._spares) + self._spares_queued
        if (inst.parent is None and m <= LAST_FLOW_MINOR and kept < self.spare_max
                and len(self._flows) + len(self._spares) >= self.spare_from):
            self._spares_queued += 1
            return True
        return False

    def _queue_remove(self, op: Op, inst: Installed, add, res: ApplyResult) -> None:
        fam = op.key.family
        state = {"filter_ok": True}
        if self._spare_kept(inst):
            def spare_done(err):
                if err is not None and err.errno != errno.ENOENT:
                    res.errors.append(OpError(op, str(err)))
                    return
                self._layout.release(inst.filter_handle)
                self._spares.append(inst.classid & 0xFFFF)
                self._flows.pop(op.key, None)
                res.removed += 1
            add(self._filter_msg(RTM_DELTFILTER, 0, fam, inst.filter_handle, u32.kind_only(),
                                 lambda: f"delete filter for {op.key}"), spare_done)
            return

        def filter_done(err):
            if err is not None and err.errno != errno.ENOENT:
                state["filter_ok"] = False
                res.errors.append(OpError(op, str(err)))

        def class_done(err):
            if err is not None and err.errno != errno.ENOENT:
                if state["filter_ok"]:
                    res.errors.append(OpError(op, str(err)))
                return
            self._layout.release(inst.filter_handle)
            self._free_minor(inst.classid & 0xFFFF)
            self._flows.pop(op.key, None)
            res.removed += 1

        add(self._filter_msg(RTM_DELTFILTER, 0, fam, inst.filter_handle, u32.kind_only(),
                             lambda: f"delete filter for {op.key}"), filter_done)
        add(self._req(RTM_DELTCLASS, 0, nl.tcmsg(self.ifindex, inst.classid, self._parent_handle()),
                      lambda: f"delete class {nl.fmt_handle(inst.classid)} of {op.key}"), class_done)

    def _queue_change(self, op: Op, inst: Installed, add, res: ApplyResult,
                      kernel: Optional[tuple] = None) -> None:
        """``kernel``: the (rate, ceil) to give the class instead of the shape's (a flow under a
        group gets its share, see groups.py)."""
        try:
            options = self._flow_options(op.shape, kernel)
        except ValueError as e:
            res.errors.append(OpError(op, f"{op.key}: {e}"))
            return

        def done(err):
            if err is not None:
                res.errors.append(OpError(op, str(err)))
                return
            inst.shape = op.shape
            inst.kernel = kernel
            res.changed += 1
        add(self._class_msg(inst.classid & 0xFFFF, inst.parent or self._flow_parent, options, False,
                            lambda: f"change class {nl.fmt_handle(inst.classid)} of {op.key}"), done)

    def _queue_add(self, op: Op, add, res: ApplyResult, parent: Optional[int] = None,
                   kernel: Optional[tuple] = None) -> None:
        """``parent``: the minor of the flow's group class (None: the link); ``kernel`` as for
        ``_queue_change``."""
        key = op.key
        try:
            options = self._flow_options(op.shape, kernel)
        except ValueError as e:
            res.errors.append(OpError(op, f"{key}: {e}"))
            return
        # issue 16: a socket that claimed a pool class already sends into it: that is its class
        claimed = self.pool.take_claim(key) if parent is None and self.side is Side.SEND \
            else None
        spare = self._spares.pop() if not claimed and parent is None and self._spares else None
        try:
            minor = claimed or spare or self._alloc_minor()
        except LayoutFull as e:
            res.errors.append(OpError(op, str(e)))
            return
        wk = wire_key(key, self.side)      # the tuple the filter matches (reversed on receive)
        try:
            pl: Placement = self._layout.place(wk)
        except LayoutFull as e:
            if spare:
                self._spares.append(spare)
            else:
                self._free_minor(minor)
            res.errors.append(OpError(op, str(e)))
            return
        classid = tc_handle(MAJOR, minor)
        state = {"ok": True}

        def echo(mtype, body):          # a reused spare's counters as the change left them
            state["base"] = EchoedStats(mtype, body)

        def fail(err):
            if state["ok"]:
                res.errors.append(OpError(op, str(err)))
            state["ok"] = False

        def class_done(err):
            state["class_err"] = err.errno if err is not None else 0
            if err is not None:
                fail(err)

        def filter_done(err):
            if err is None and state["ok"]:
                self._flows[key] = Installed(classid, pl.handle, op.shape, parent, kernel,
                                             state.get("base") if spare else None)
                res.added += 1
                return
            if err is not None:
                fail(err)
            self._layout.release(pl.handle)
            # undo the half that went in; never a class that was there before us
            undo = []
            if err is None:
                undo.append(self._filter_msg(RTM_DELTFILTER, 0, key.family, pl.handle,
                                             u32.kind_only(), "undo filter"))
            if spare:                   # the spare stays one, unless it is gone
                if undo:
                    self._rtnl.transact(undo)
                if state.get("class_err") == errno.ENOENT:
                    self._free_minor(minor)
                else:
                    self._spares.append(minor)
                return
            if state.get("class_err") == 0:
                undo.append(self._req(RTM_DELTCLASS, 0,
                                      nl.tcmsg(self.ifindex, classid, self._parent_handle()),
                                      "undo class"))
            if undo:
                self._rtnl.transact(undo)
            if state.get("class_err") == errno.EEXIST:
                log.warning("%s: class %s exists but is not ours; not using that id",
                            self.interface, nl.fmt_handle(classid))
            else:
                self._free_minor(minor)

        req = self._class_msg(minor, parent or self._flow_parent, options,
                              not claimed and not spare,
                              lambda: f"{'reuse' if spare else 'add'} class "
                                      f"{nl.fmt_handle(classid)} for {key}")
        if spare:
            req.echo = echo
        add(req, class_done)
        add(self._filter_msg(RTM_NEWTFILTER, NLM_F_CREATE | NLM_F_EXCL, key.family, pl.handle,
                             u32.flow_leaf_options(classid, pl.in_table, wk.local_addr,
                                                   wk.local_port, wk.remote_addr, wk.remote_port,
                                                   wk.protocol.number),
                             lambda: f"add filter for {key}"), filter_done)


    def audit(self) -> List[FlowKey]:
        """Flows whose class someone removed behind our back: forgotten (their filter deleted if
        it is still there) and returned, so that the caller can plan them again."""
        present = set(self.stats_by_class())
        gone = [k for k, v in self._flows.items() if v.classid not in present]
        undo = []
        for k in gone:
            inst = self._flows.pop(k)
            self._layout.release(inst.filter_handle)
            self._free_minor(inst.classid & 0xFFFF)
            undo.append(self._filter_msg(RTM_DELTFILTER, 0, k.family, inst.filter_handle,
                                         u32.kind_only(), "delete orphaned filter"))
        if undo:
            self._rtnl.transact(undo)
        gone_spares = [m for m in self._spares if tc_handle(MAJOR, m) not in present]
        if gone_spares:
            self._spares = [m for m in self._spares if tc_handle(MAJOR, m) in present]
            for m in gone_spares:
                self._free_minor(m)
        self._audit_groups(present)
        return gone


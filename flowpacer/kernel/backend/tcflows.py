"""Flow classes of ``TcBackend``: ``FlowClasses``, the book of installed flows (their class,
filter, shape), the u32 layout of their filters (filters.py) and the cache of their class
options. ``apply`` turns a plan into one netlink batch: the flows' adds, changes and removes (a
flow's filter is deleted before its class, a half-made flow is undone), the ops of flows under
group classes through ``GroupClasses`` (tcgroups.py), the first-byte pool ops through pool.py;
``audit`` forgets the flows whose class someone else removed.

Class ids come from ``ClassIds`` (tcids.py), spares included: with spares kept, a removed flow's
filter goes and its class stays, and a new flow's class is a spare changed to its rates. A
reused class' counters go on from the previous flows': the change is sent with NLM_F_ECHO, and
the counters the kernel echoes are the new flow's zero (``Installed.base``, parsed when first
read, taken out in ``class_stats``, tcstats.py).
"""
from __future__ import annotations

import dataclasses
import errno
import logging
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, Set, Tuple

from flowpacer.errors import NetlinkError
from flowpacer.model import ApplyResult, FlowKey, Op, OpError, OpKind, PoolOp, Shape, Side
from flowpacer.kernel.tc import nl, u32
from flowpacer.kernel.tc.nl import (NLM_F_CREATE, NLM_F_EXCL, RTM_DELTFILTER, RTM_NEWTFILTER,
                                    Request, tc_handle)
from flowpacer.kernel.backend.filters import Layout, LayoutFull, Placement
from flowpacer.kernel.backend.handles import MAJOR, EchoedStats, Installed, handle_text, wire_key
from flowpacer.kernel.backend.pool import Pool, queue_pool_op
from flowpacer.kernel.backend.tcchannel import Channel
from flowpacer.kernel.backend.tcids import ClassIds

if TYPE_CHECKING:
    from flowpacer.kernel.backend.tcgroups import GroupClasses

log = logging.getLogger(__name__)


def kernel_shape(shape: Shape, kernel: Optional[tuple]) -> Shape:
    """The shape a flow's class gets: its own, or with the (rate, ceil) of its share under a
    group (groups.py)."""
    if kernel is None:
        return shape
    return dataclasses.replace(shape, rate_bps=kernel[0], ceil_bps=kernel[1])


class FlowClasses:
    """The flows' classes and filters, and the plans that change them."""

    def __init__(self, chan: Channel, ids: ClassIds, pool: Pool, groups: "GroupClasses"):
        self._chan = chan
        self._ids = ids
        self._pool = pool
        self._groups = groups
        self._book: Dict[FlowKey, Installed] = {}
        self._layout = Layout()
        self._options_cache: Dict[tuple, bytes] = {}   # flow class options by rates
        self._send = chan.side is Side.SEND             # first-byte claims: the send side's
        self._filter_msg = chan.filter_msg              # (bound once: called for every flow)
        self._class_msg = chan.class_msg

    # ------------------------------------------------------------ the book
    def __len__(self) -> int:
        return len(self._book)

    def installed(self) -> Dict[FlowKey, Shape]:
        return {k: v.shape for k, v in self._book.items()}

    def shape_of(self, key: FlowKey) -> Optional[Shape]:
        inst = self._book.get(key)
        return inst.shape if inst else None

    def classid_of(self, key: FlowKey) -> Optional[int]:
        inst = self._book.get(key)
        return inst.classid if inst else None

    def get(self, key: FlowKey) -> Optional[Installed]:
        """A flow's record (for ``GroupClasses``: it reads it, changes go through here)."""
        return self._book.get(key)

    def records(self) -> List[Tuple[FlowKey, Installed]]:
        """Every flow's record, copied in one step (safe from another thread under the GIL)."""
        return list(self._book.items())

    def snapshot(self) -> List[Tuple[FlowKey, str, Shape]]:
        """[(key, handle, shape)] of every installed flow (a copy; ``handle`` for display)."""
        return [(k, handle_text(v.classid), v.shape) for k, v in list(self._book.items())]

    def grouped(self) -> Dict[FlowKey, Installed]:
        """The flows under a group class."""
        return {k: v for k, v in self._book.items() if v.parent is not None}

    def group_parents(self) -> Set[int]:
        """The group classes (minors) flows hang under."""
        return {v.parent for v in self._book.values() if v.parent is not None}

    def relabel(self, inst: Installed, shape: Shape) -> None:
        """A flow's shape changed in what the kernel does not see (its rule's name, groups)."""
        inst.shape = shape

    def forget(self) -> None:
        self._book.clear()
        self._layout = Layout()

    # ------------------------------------------------------------ adoption
    def adopt_leaf(self, key: FlowKey, classid: int, filter_handle: int, shape: Shape) -> None:
        """After a restart: a flow the kernel has (its class, its filter)."""
        self._book[key] = Installed(classid, filter_handle, shape)
        self._layout.adopt_leaf(filter_handle)

    def adopt_parents(self, under: Dict[int, Tuple[int, tuple]]) -> None:
        """After a restart: the flows whose class (minor) hangs under a group class, as
        ``GroupClasses.adopt`` found them: {minor: (group minor, the flow's groups)}. Their
        kernel rates are what the classes have (their shapes were read from them)."""
        for inst in self._book.values():
            up = under.get(inst.classid & 0xFFFF)
            if up is not None:
                inst.parent = up[0]
                inst.kernel = (inst.shape.rate_bps, inst.shape.ceil_bps)
                inst.shape = dataclasses.replace(inst.shape, groups=up[1])

    # --------------------------------------------------------------- plans
    def _flow_options(self, shape: Shape, kernel: Optional[tuple]) -> bytes:
        """The codec's options for a flow class of these rates (raises ValueError as the codec
        does). A codec's flow options depend on the rates and the link rate only, and a burst's
        flows share a few shapes: each is encoded once."""
        s = kernel_shape(shape, kernel)
        chan = self._chan
        ck = (s.rate_bps, s.ceil_bps, chan.link_rate_bps)
        cache = self._options_cache
        options = cache.get(ck)
        if options is None:
            options = chan.codec.flow_class_options(s, chan.link_rate_bps)
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
        self._ids.new_apply()
        reqs: List[Request] = []
        # what to do with each request's outcome
        after: List[Callable[[Optional[NetlinkError]], None]] = []

        def add(req, cb):
            reqs.append(req)
            after.append(cb)

        grouped: List[Op] = []
        removing = set()
        book, chan, pool = self._book, self._chan, self._pool
        involves_groups = self._groups.involves
        for op in plan:
            if isinstance(op, PoolOp):
                queue_pool_op(chan, pool, op, add, res)
                continue
            inst = None if op.key in removing else book.get(op.key)
            if involves_groups(op, inst):
                grouped.append(op)
                continue
            if op.kind is OpKind.REMOVE:
                if inst is None:
                    continue
                removing.add(op.key)
                self.queue_remove(op, inst, add, res)
            elif inst is not None:      # ADD of a known flow or CHANGE
                if inst.shape.rate_bps == op.shape.rate_bps and inst.shape.ceil_bps == op.shape.ceil_bps:
                    inst.shape = op.shape
                    continue
                self.queue_change(op, inst, add, res)
            elif op.kind in (OpKind.CHANGE, OpKind.RELABEL):
                res.errors.append(OpError(op, f"{op.kind.value} of unknown flow {op.key}"))
            else:
                self.queue_add(op, add, res)
        if grouped:
            self._groups.queue(grouped, add, res, self)
        if reqs:
            for cb, err in zip(after, chan.transact(reqs)):
                cb(err)
        return res

    def queue_remove(self, op: Op, inst: Installed, add, res: ApplyResult) -> None:
        """Queue the removal of flow ``op.key`` (``add(req, callback)`` as in ``apply``): its
        filter, then its class, or only its filter when the class stays as a spare."""
        fam = op.key.family
        state = {"filter_ok": True}
        ids = self._ids
        if inst.parent is None and ids.keep_spare(inst.classid & 0xFFFF, len(self._book)):
            def spare_done(err):
                if err is not None and err.errno != errno.ENOENT:
                    res.errors.append(OpError(op, str(err)))
                    return
                self._layout.release(inst.filter_handle)
                ids.add_spare(inst.classid & 0xFFFF)
                self._book.pop(op.key, None)
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
            ids.free(inst.classid & 0xFFFF)
            self._book.pop(op.key, None)
            res.removed += 1

        add(self._filter_msg(RTM_DELTFILTER, 0, fam, inst.filter_handle, u32.kind_only(),
                             lambda: f"delete filter for {op.key}"), filter_done)
        add(self._chan.class_del(inst.classid,
                                 lambda: f"delete class {nl.fmt_handle(inst.classid)} of {op.key}"),
            class_done)

    def queue_change(self, op: Op, inst: Installed, add, res: ApplyResult,
                     kernel: Optional[tuple] = None) -> None:
        """Queue a change of flow ``op.key``'s class to ``op.shape``; ``kernel``: the (rate,
        ceil) to give the class instead of the shape's (a flow under a group gets its share,
        see groups.py)."""
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
        add(self._class_msg(inst.classid & 0xFFFF, inst.parent or self._chan.flow_parent, options,
                            False,
                            lambda: f"change class {nl.fmt_handle(inst.classid)} of {op.key}"), done)

    def queue_add(self, op: Op, add, res: ApplyResult, parent: Optional[int] = None,
                  kernel: Optional[tuple] = None) -> None:
        """Queue a new flow's class and filter. Its class is the pool class it claimed, else a
        spare, else a new one. ``parent``: the minor of the flow's group class (None: the link);
        ``kernel`` as for ``queue_change``."""
        key = op.key
        try:
            options = self._flow_options(op.shape, kernel)
        except ValueError as e:
            res.errors.append(OpError(op, f"{key}: {e}"))
            return
        ids = self._ids
        # issue 16: a socket that claimed a pool class already sends into it: that is its class
        claimed = self._pool.take_claim(key) if parent is None and self._send else None
        spare = ids.take_spare() if not claimed and parent is None else 0
        try:
            minor = claimed or spare or ids.alloc()
        except LayoutFull as e:
            res.errors.append(OpError(op, str(e)))
            return
        wk = wire_key(key, self._chan.side)   # the tuple the filter matches (reversed on receive)
        try:
            pl: Placement = self._layout.place(wk)
        except LayoutFull as e:
            if spare:
                ids.add_spare(spare)
            else:
                ids.free(minor)
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
                self._book[key] = Installed(classid, pl.handle, op.shape, parent, kernel,
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
                    self._chan.transact(undo)
                if state.get("class_err") == errno.ENOENT:
                    ids.free(minor)
                else:
                    ids.add_spare(minor)
                return
            if state.get("class_err") == 0:
                undo.append(self._chan.class_del(classid, "undo class"))
            if undo:
                self._chan.transact(undo)
            if state.get("class_err") == errno.EEXIST:
                log.warning("%s: class %s exists but is not ours; not using that id",
                            self._chan.interface, nl.fmt_handle(classid))
            else:
                ids.free(minor)

        req = self._class_msg(minor, parent or self._chan.flow_parent, options,
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

    def audit(self, present: Set[int]) -> List[FlowKey]:
        """Flows whose class someone removed behind our back (not among ``present``, the class
        ids the kernel has): forgotten (their filter deleted if it is still there) and
        returned, so that the caller can plan them again."""
        gone = [k for k, v in self._book.items() if v.classid not in present]
        undo = []
        for k in gone:
            inst = self._book.pop(k)
            self._layout.release(inst.filter_handle)
            self._ids.free(inst.classid & 0xFFFF)
            undo.append(self._filter_msg(RTM_DELTFILTER, 0, k.family, inst.filter_handle,
                                         u32.kind_only(), "delete orphaned filter"))
        if undo:
            self._chan.transact(undo)
        return gone

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
from flowpacer.model import (ApplyResult, FlowKey, Op, OpError, OpKind, PoolOp, Shape, Side,
                             SpareOp)
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
        REMOVEd earlier in the plan is a new flow for a later ADD (a rebound claim).

        Each request is queued with what to do with its outcome: ``add(req, callback)``, the
        callback called with None or the NetlinkError, or ``add(req, function, arg)``, called
        as ``function(arg, error)``: the flows' own requests take that form, a module function
        and one record a flow (``_Adding``, ``_Removing``), not closures made per request (a
        burst of thousands of flows made them by the dozen a flow, and the collector's work
        with them)."""
        res = ApplyResult()
        self._ids.new_apply()
        reqs: List[Request] = []
        # what to do with each request's outcome: a callback, or a function and its argument
        after: List[Callable] = []
        args: List[object] = []

        def add(req, cb, arg=_PLAIN):
            reqs.append(req)
            after.append(cb)
            args.append(arg)

        grouped: List[Op] = []
        removing = set()
        book, chan, pool = self._book, self._chan, self._pool
        involves_groups = self._groups.involves
        for op in plan:
            if isinstance(op, PoolOp):
                queue_pool_op(chan, pool, op, add, res)
                continue
            if isinstance(op, SpareOp):
                self.queue_spares(op, add, res)
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
            for cb, arg, err in zip(after, args, chan.transact(reqs)):
                if arg is _PLAIN:
                    cb(err)
                else:
                    cb(arg, err)
        return res

    def queue_spares(self, op: SpareOp, add, res: ApplyResult) -> None:
        """Queue ``op.count`` ready spare classes (issue 26): classes under the link without a
        filter, joined to the spares once the kernel made them. Only where spares are kept, up
        to ``spare_max``; the send side only (a burst's first bytes are sent)."""
        ids = self._ids
        ids.ready = op.target
        if not self._send or not ids.spare_max:
            res.spare_errors.append(f"{self._chan.interface}: no spare classes are kept here")
            return
        try:
            options = self._flow_options(op.shape, None)
        except ValueError as e:
            res.spare_errors.append(f"{self._chan.interface}: spare class: {e}")
            return
        room = ids.spare_max - ids.spare_count() - ids.making
        for _ in range(min(op.count, room)):
            try:
                minor = ids.alloc()
            except LayoutFull as e:
                res.spare_errors.append(f"{self._chan.interface}: spare class: {e}")
                return
            ids.making += 1
            add(self._class_msg(minor, self._chan.flow_parent, options, True,
                                (_spare_text, minor)), _spare_made, (self, minor, res))

    def queue_remove(self, op: Op, inst: Installed, add, res: ApplyResult) -> None:
        """Queue the removal of flow ``op.key`` (``add`` as in ``apply``): its filter, then its
        class, or only its filter when the class stays as a spare."""
        key = op.key
        r = _Removing(self, op, inst, res)
        if inst.parent is None and self._ids.keep_spare(inst.classid & 0xFFFF, len(self._book)):
            add(self._filter_msg(RTM_DELTFILTER, 0, key.family, inst.filter_handle,
                                 u32.kind_only(), (_filter_text, "delete", key)),
                _spare_removed, r)
            return
        add(self._filter_msg(RTM_DELTFILTER, 0, key.family, inst.filter_handle, u32.kind_only(),
                             (_filter_text, "delete", key)), _filter_removed, r)
        add(self._chan.class_del(inst.classid, (_class_text, "delete", inst.classid, "of", key)),
            _class_removed, r)

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
        add(self._class_msg(inst.classid & 0xFFFF, inst.parent or self._chan.flow_parent, options,
                            False, (_class_text, "change", inst.classid, "of", op.key)),
            _changed, (op, inst, kernel, res))

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
        a = _Adding(self, op, res, minor, classid, pl.handle, spare, parent, kernel)
        req = self._class_msg(minor, parent or self._chan.flow_parent, options,
                              not claimed and not spare,
                              (_class_text, "reuse" if spare else "add", classid, "for", key))
        if spare:
            req.echo = a            # a reused spare's counters as the change left them
        add(req, _add_class_done, a)
        add(self._filter_msg(RTM_NEWTFILTER, NLM_F_CREATE | NLM_F_EXCL, key.family, pl.handle,
                             u32.flow_leaf_options(classid, pl.in_table, wk.local_addr,
                                                   wk.local_port, wk.remote_addr, wk.remote_port,
                                                   wk.protocol.number),
                             (_filter_text, "add", key)), _add_filter_done, a)

    def _add_failed(self, a: "_Adding", err: Optional[NetlinkError]) -> None:
        """A new flow's filter did not go in, or its class did not: undo the half that went
        in (never a class that was there before us) and give its ids back."""
        key = a.op.key
        self._layout.release(a.handle)
        ids = self._ids
        undo = []
        if err is None:
            undo.append(self._filter_msg(RTM_DELTFILTER, 0, key.family, a.handle,
                                         u32.kind_only(), "undo filter"))
        if a.spare:                 # the spare stays one, unless it is gone
            if undo:
                self._chan.transact(undo)
            if a.class_err == errno.ENOENT:
                ids.free(a.minor)
            else:
                ids.add_spare(a.minor)
            return
        if a.class_err == 0:
            undo.append(self._chan.class_del(a.classid, "undo class"))
        if undo:
            self._chan.transact(undo)
        if a.class_err == errno.EEXIST:
            log.warning("%s: class %s exists but is not ours; not using that id",
                        self._chan.interface, nl.fmt_handle(a.classid))
        else:
            ids.free(a.minor)

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


# ------------------------------------------------ the outcomes of a flow's requests (apply)

_PLAIN = object()          # ``add(req, callback)``: the callback takes the error alone


def _class_text(verb: str, classid: int, prep: str, key: FlowKey) -> str:
    return f"{verb} class {nl.fmt_handle(classid)} {prep} {key}"


def _spare_text(minor: int) -> str:
    return f"add spare class {nl.fmt_handle(tc_handle(MAJOR, minor))}"


def _spare_made(arg, err: Optional[NetlinkError]) -> None:
    """A ready spare class' answer: a spare now, or its id free again (never one the kernel
    already had: that class is not ours)."""
    fl, minor, res = arg
    ids = fl._ids
    ids.making -= 1
    if err is None:
        ids.add_spare(minor)
        res.spares_made += 1
        return
    res.spare_errors.append(str(err))
    if err.errno == errno.EEXIST:
        log.warning("%s: class %s exists but is not ours; not using that id",
                    fl._chan.interface, nl.fmt_handle(tc_handle(MAJOR, minor)))
    else:
        ids.free(minor)


def _filter_text(verb: str, key: FlowKey) -> str:
    return f"{verb} filter for {key}"


class _Adding:
    """A new flow's class and filter on their way (``queue_add``): what their outcomes need.
    Called with the kernel's echo of a reused spare's change (its counters then)."""

    __slots__ = ("flows", "op", "res", "minor", "classid", "handle", "spare", "parent",
                 "kernel", "ok", "class_err", "base")

    def __init__(self, flows: FlowClasses, op: Op, res: ApplyResult, minor: int, classid: int,
                 handle: int, spare: int, parent: Optional[int], kernel: Optional[tuple]):
        self.flows = flows
        self.op = op
        self.res = res
        self.minor = minor
        self.classid = classid
        self.handle = handle
        self.spare = spare
        self.parent = parent
        self.kernel = kernel
        self.ok = True
        self.class_err: Optional[int] = None
        self.base: Optional[EchoedStats] = None

    def __call__(self, mtype: int, body: bytes) -> None:
        self.base = EchoedStats(mtype, body)

    def fail(self, err: NetlinkError) -> None:
        if self.ok:
            self.res.errors.append(OpError(self.op, str(err)))
        self.ok = False


def _add_class_done(a: _Adding, err: Optional[NetlinkError]) -> None:
    a.class_err = err.errno if err is not None else 0
    if err is not None:
        a.fail(err)


def _add_filter_done(a: _Adding, err: Optional[NetlinkError]) -> None:
    if err is None and a.ok:
        op = a.op
        a.flows._book[op.key] = Installed(a.classid, a.handle, op.shape, a.parent, a.kernel,
                                          a.base if a.spare else None)
        a.res.added += 1
        return
    if err is not None:
        a.fail(err)
    a.flows._add_failed(a, err)


class _Removing:
    """A flow's filter (and class) on their way out (``queue_remove``)."""

    __slots__ = ("flows", "op", "inst", "res", "filter_ok")

    def __init__(self, flows: FlowClasses, op: Op, inst: Installed, res: ApplyResult):
        self.flows = flows
        self.op = op
        self.inst = inst
        self.res = res
        self.filter_ok = True


def _forget(r: _Removing, spare: bool) -> None:
    """The flow is gone from the kernel: its filter's place and its class id free again (the
    class kept as a spare, or deleted), its book entry dropped."""
    fl = r.flows
    fl._layout.release(r.inst.filter_handle)
    if spare:
        fl._ids.add_spare(r.inst.classid & 0xFFFF)
    else:
        fl._ids.free(r.inst.classid & 0xFFFF)
    fl._book.pop(r.op.key, None)
    r.res.removed += 1


def _spare_removed(r: _Removing, err: Optional[NetlinkError]) -> None:
    """The filter of a flow whose class stays as a spare."""
    if err is not None and err.errno != errno.ENOENT:
        r.res.errors.append(OpError(r.op, str(err)))
        return
    _forget(r, spare=True)


def _filter_removed(r: _Removing, err: Optional[NetlinkError]) -> None:
    if err is not None and err.errno != errno.ENOENT:
        r.filter_ok = False
        r.res.errors.append(OpError(r.op, str(err)))


def _class_removed(r: _Removing, err: Optional[NetlinkError]) -> None:
    if err is not None and err.errno != errno.ENOENT:
        if r.filter_ok:
            r.res.errors.append(OpError(r.op, str(err)))
        return
    _forget(r, spare=False)


def _changed(arg: tuple, err: Optional[NetlinkError]) -> None:
    op, inst, kernel, res = arg
    if err is not None:
        res.errors.append(OpError(op, str(err)))
        return
    inst.shape = op.shape
    inst.kernel = kernel
    res.changed += 1

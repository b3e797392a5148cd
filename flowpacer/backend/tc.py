"""The tc backend: owns one root qdisc and everything under it; applies plans idempotently.

Kernel objects (all under handle major ``MAJOR``):
  root qdisc ``f1f0:``      htb or psp (the codec decides)
  class ``f1f0:1``           the link (htb only), rate = link rate
  class ``f1f0:2``           default class: unmatched traffic, unshaped up to the link rate
  class ``f1f0:10``..        one per shaped flow
  u32 filters                see ``filters.py``

``setup()`` creates or adopts them, ``apply(plan)`` adds/changes/removes flow classes and their
filters in batches, ``reconcile``-style adoption rebuilds the bookkeeping from a dump after a
restart, ``teardown()`` deletes the root qdisc (the kernel restores the interface's default).
"""
from __future__ import annotations

import dataclasses
import errno
import logging
import socket
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

from ..errors import BackendError, NetlinkError
from ..model import (ApplyResult, BackendHealth, ClassStats, FlowKey, Op, OpError, OpKind,
                     PoolOp, Protocol, Shape, Side)
from ..tc import nl, u32
from ..tc.nl import (NLM_F_CREATE, NLM_F_EXCL, NLM_F_REPLACE, RTM_DELQDISC, RTM_DELTCLASS,
                     RTM_DELTFILTER, RTM_GETQDISC, RTM_GETTCLASS, RTM_GETTFILTER, RTM_NEWQDISC,
                     RTM_NEWTCLASS, RTM_NEWTFILTER, TC_H_ROOT, Request, RtnlSocket, tc_handle)
from .filters import (DIVISOR, GUARD, HMASK_LOCAL_PORT, HMASK_REMOTE_PORT, L1_HTID, PORTS_OFF,
                      PRIO, PROTO, PROTOCOLS, Layout, LayoutFull, Placement, all_tables)
from .groups import GroupKind, GroupTree, Member, Node, targets
from .pool import Pool, queue_pool_op

log = logging.getLogger(__name__)

MAJOR = 0xF1F0
QDISC_HANDLE = tc_handle(MAJOR, 0)
LINK_MINOR = 1
DEFAULT_MINOR = 2
FIRST_FLOW_MINOR = 0x10
LAST_FLOW_MINOR = 0xBFFF         # 0xC000..0xFFFF: first-byte pool classes (pool.py)


@dataclass
class Installed:
    classid: int
    filter_handle: int
    shape: Shape
    parent: Optional[int] = None     # the minor of its group class (issue 15); None: the link
    kernel: Optional[tuple] = None   # (rate, ceil) in the kernel when it differs from the shape's


def ifindex_of(interface: str) -> int:
    try:
        return socket.if_nametoindex(interface)
    except OSError:
        raise BackendError(f"interface {interface!r} not found") from None


def link_speed_bps(interface: str) -> Optional[int]:
    """The interface's speed from ethtool (sysfs), in bytes/s; None when it reports none."""
    try:
        with open(f"/sys/class/net/{interface}/speed") as f:
            mbit = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return mbit * 1_000_000 // 8 if mbit > 0 else None


def wire_key(key: FlowKey, side: Side) -> FlowKey:
    """The tuple a flow's packets carry on ``side``: the key itself when sending (source =
    local), reversed when receiving (source = remote). Its own inverse, so adoption maps a
    filter's tuple back with it."""
    if side is Side.SEND:
        return key
    return FlowKey(key.remote_addr, key.remote_port, key.local_addr, key.local_port,
                   key.protocol)


def root_qdisc(rtnl: RtnlSocket, ifindex: int) -> Optional[nl.TcObject]:
    for mtype, body in rtnl.dump(RTM_GETQDISC, nl.tcmsg(ifindex)):
        obj = nl.parse_tcmsg(mtype, body)
        if obj.ifindex == ifindex and obj.parent == TC_H_ROOT:
            return obj
    return None


def cleanup(interface: str) -> bool:
    """Delete flowpacer's root qdisc (and so everything under it). True if there was one."""
    ifindex = ifindex_of(interface)
    with RtnlSocket() as rtnl:
        root = root_qdisc(rtnl, ifindex)
        if root is None or root.handle != QDISC_HANDLE:
            return False
        rtnl.request(Request(RTM_DELQDISC, 0, nl.tcmsg(ifindex, QDISC_HANDLE, TC_H_ROOT),
                             f"delete root qdisc on {interface}"))
        return True


class TcBackend:
    def __init__(self, codec, interface: str, link_rate_bps: Optional[int] = None,
                 take_over: bool = False, rtnl: Optional[RtnlSocket] = None,
                 side: Side = Side.SEND, speed_interface: Optional[str] = None):
        """``side``: RECEIVE on flowpacer's ifb (issue 17): filters match the reversed tuple;
        ``speed_interface``: whose speed is the link rate (the ifb has none: its interface's)."""
        self.codec = codec
        self.name = codec.kind
        self.interface = interface
        self.side = side
        self.speed_interface = speed_interface or interface
        self.take_over = take_over
        self._want_link_rate = link_rate_bps
        self.link_rate_bps = 0
        self.ifindex = 0
        self._rtnl = rtnl or RtnlSocket()
        self._flows: Dict[FlowKey, Installed] = {}
        self._free_minors: List[int] = []
        self._next_minor = FIRST_FLOW_MINOR
        self._layout = Layout()
        self._groups = GroupTree()       # group classes of rules with aggregates (groups.py)
        self._warned_groups = False
        self.adopted = 0
        self.removed_stale = 0
        self.pool = Pool(MAJOR)          # first-byte pools (issue 16, pool.py)

    # ------------------------------------------------------------ helpers
    def _req(self, mtype: int, flags: int, body: bytes, what) -> Request:
        """A request; ``what`` (a string or a callable making one) names it in error messages."""
        ifname = self.interface
        if callable(what):
            return Request(mtype, flags, body, lambda: f"{what()} on {ifname}")
        return Request(mtype, flags, body, f"{what} on {ifname}")

    def _class_msg(self, minor: int, parent_minor: Optional[int], options: bytes, create: bool,
                   what) -> Request:
        parent = tc_handle(MAJOR, parent_minor) if parent_minor else QDISC_HANDLE
        flags = NLM_F_CREATE | NLM_F_EXCL if create else 0
        return self._req(RTM_NEWTCLASS, flags,
                         nl.tcmsg(self.ifindex, tc_handle(MAJOR, minor), parent) + options, what)

    def _filter_msg(self, mtype: int, flags: int, family: int, handle: int, options: bytes,
                    what) -> Request:
        info = u32.filter_info(PRIO[family], PROTO[family])
        return self._req(mtype, flags, nl.tcmsg(self.ifindex, handle, QDISC_HANDLE, info) + options,
                         what)

    @property
    def _flow_parent(self) -> Optional[int]:
        return LINK_MINOR if self.codec.has_link_class else None

    def _alloc_minor(self) -> int:
        if self._free_minors:
            return self._free_minors.pop()
        if self._next_minor > LAST_FLOW_MINOR:
            raise LayoutFull("no free class id (49 136 flows shaped)")
        m = self._next_minor
        self._next_minor += 1
        return m

    def _free_minor(self, minor: int) -> None:
        if minor > LAST_FLOW_MINOR:
            self.pool.free_minor(minor)         # a claimed pool class's id goes back to pool.py
            return
        self._free_minors.append(minor)

    # --------------------------------------------------------------- setup
    def setup(self) -> None:
        """Create our root qdisc and skeleton, or adopt the one a previous run left."""
        self.ifindex = ifindex_of(self.interface)
        rate = self._want_link_rate or link_speed_bps(self.speed_interface)
        if not rate:
            raise BackendError(f"interface {self.interface} reports no speed: set link_rate in the "
                               "rules file")
        self.link_rate_bps = rate
        root = root_qdisc(self._rtnl, self.ifindex)
        if root is not None and root.handle == QDISC_HANDLE and root.kind == self.codec.kind:
            try:
                self._adopt()
                return
            except (NetlinkError, BackendError, ValueError) as e:
                log.warning("cannot adopt the existing flowpacer qdisc on %s (%s): rebuilding",
                            self.interface, e)
        elif root is not None and root.handle >> 16 not in (0, MAJOR) and not self.take_over:
            raise BackendError(
                f"{self.interface} already has a root qdisc ({root.kind} {nl.fmt_handle(root.handle)}) "
                "that flowpacer did not create; remove it or run with --take-over")
        self._create()

    def _create(self) -> None:
        self.forget()
        c = self.codec
        reqs = [self._req(RTM_NEWQDISC, NLM_F_CREATE | NLM_F_REPLACE,
                          nl.tcmsg(self.ifindex, QDISC_HANDLE, TC_H_ROOT)
                          + c.qdisc_options(self.link_rate_bps, DEFAULT_MINOR),
                          f"create root {c.kind} qdisc")]
        if c.has_link_class:
            reqs.append(self._class_msg(LINK_MINOR, None, c.link_class_options(self.link_rate_bps),
                                        True, "create link class"))
        if not getattr(c, "makes_default_class", False):
            reqs.append(self._class_msg(DEFAULT_MINOR, self._flow_parent,
                                        c.default_class_options(self.link_rate_bps), True,
                                        "create default class"))
        for fam, htid, b1 in all_tables():
            reqs.append(self._filter_msg(RTM_NEWTFILTER, NLM_F_CREATE | NLM_F_EXCL, fam,
                                         u32.htid_handle(htid), u32.table_options(htid, DIVISOR),
                                         f"create u32 table {htid:x}: (IPv{fam})"))
            if b1 is None:      # L1: linked from the root table, hashed by the remote port
                for proto in PROTOCOLS:     # TCP and UDP (issue 17)
                    reqs.append(self._filter_msg(
                        RTM_NEWTFILTER, NLM_F_CREATE | NLM_F_EXCL, fam, 0,
                        u32.link_options(htid, GUARD[fam](proto), PORTS_OFF[fam],
                                         HMASK_REMOTE_PORT),
                        f"create u32 root link (IPv{fam}, IP protocol {proto})"))
            else:               # L2: linked from L1 bucket b1, hashed by the local port
                reqs.append(self._filter_msg(
                    RTM_NEWTFILTER, NLM_F_CREATE | NLM_F_EXCL, fam,
                    u32.htid_handle(L1_HTID[fam], b1, 1),
                    u32.link_options(htid, [], PORTS_OFF[fam], HMASK_LOCAL_PORT,
                                     in_table=u32.htid_handle(L1_HTID[fam], b1)),
                    f"link u32 table {htid:x}:"))
        for err in self._rtnl.transact(reqs):
            if err is not None:
                raise BackendError(f"cannot set up {self.interface}: {err}")
        log.info("%s: root %s qdisc %s created, link rate %d bit/s", self.interface, c.kind,
                 nl.fmt_handle(QDISC_HANDLE), self.link_rate_bps * 8)

    def _adopt(self) -> None:
        """Rebuild our bookkeeping from the kernel; drop objects that do not fit together."""
        classes: Dict[int, nl.TcObject] = {}
        for mtype, body in self._rtnl.dump(RTM_GETTCLASS, nl.tcmsg(self.ifindex)):
            obj = nl.parse_tcmsg(mtype, body)
            if obj.ifindex == self.ifindex and obj.handle >> 16 == MAJOR:
                classes[obj.handle & 0xFFFF] = obj
        if DEFAULT_MINOR not in classes or (self.codec.has_link_class and LINK_MINOR not in classes):
            raise BackendError("skeleton classes missing")
        tables, leaves, links = set(), [], 0
        for mtype, body in self._rtnl.dump(RTM_GETTFILTER, nl.tcmsg(self.ifindex, 0, QDISC_HANDLE)):
            obj = nl.parse_tcmsg(mtype, body)
            if obj.kind != "u32":
                continue
            opts = obj.options
            if u32.TCA_U32_DIVISOR in opts:
                tables.add(obj.handle >> 20)
            elif u32.TCA_U32_LINK in opts:
                links += 1
            elif u32.TCA_U32_CLASSID in opts and u32.TCA_U32_SEL in opts:
                leaves.append(obj)
        want_tables = {htid for _, htid, _ in all_tables()}
        # a link per table, and a second root link per family for UDP (an older skeleton with
        # TCP root links only is not ours to patch: it is made anew)
        if not want_tables <= tables or links < len(want_tables) + 2:
            raise BackendError("u32 hash tables or links missing")
        # link class / default class rates follow the current link rate
        fix = []
        if self.codec.has_link_class:
            fix.append(self._class_msg(LINK_MINOR, None,
                                       self.codec.link_class_options(self.link_rate_bps), False,
                                       "update link class"))
        if getattr(self.codec, "makes_default_class", False):
            # the qdisc owns the link rate (and its default class): change it in place
            fix.append(self._req(RTM_NEWQDISC, 0, nl.tcmsg(self.ifindex, QDISC_HANDLE, TC_H_ROOT)
                                 + self.codec.qdisc_options(self.link_rate_bps, DEFAULT_MINOR),
                                 "update root qdisc"))
        else:
            fix.append(self._class_msg(DEFAULT_MINOR, self._flow_parent,
                                       self.codec.default_class_options(self.link_rate_bps), False,
                                       "update default class"))
        stale_filters = []
        bound = set()
        for obj in leaves:
            opts = obj.options
            classid = int.from_bytes(opts[u32.TCA_U32_CLASSID][:4], "little")
            _flags, _hoff, _hmask, keys = u32.unpack_sel(opts[u32.TCA_U32_SEL])
            tup = u32.keys_to_tuple(keys)
            minor = classid & 0xFFFF
            fam = 4 if socket.ntohs(obj.info & 0xFFFF) == u32.ETH_P_IP else 6
            cls = classes.get(minor)
            if tup is None or cls is None or minor < FIRST_FLOW_MINOR or classid >> 16 != MAJOR:
                stale_filters.append((fam, obj.handle))
                continue
            la, lport, ra, rport, proto = tup
            if proto not in (Protocol.TCP.number, Protocol.UDP.number):
                stale_filters.append((fam, obj.handle))
                continue
            key = wire_key(FlowKey(la, lport, ra, rport,
                                   Protocol.UDP if proto == Protocol.UDP.number else Protocol.TCP),
                           self.side)
            rate, ceil = self.codec.parse_rates(cls.options)
            self._flows[key] = Installed(classid, obj.handle, Shape("", rate, ceil))
            self._layout.adopt_leaf(obj.handle)
            bound.add(minor)
        group_minors = self._adopt_groups(classes, bound)
        used = set(bound) | group_minors
        self._next_minor = max([FIRST_FLOW_MINOR - 1]
                               + [m for m in classes if m <= LAST_FLOW_MINOR]) + 1
        self._free_minors = [m for m in range(FIRST_FLOW_MINOR, self._next_minor) if m not in used]
        self._free_minors.reverse()
        self.pool.adopted(used)       # pool-range ids of adopted flows stay taken (pool.py)
        for fam, handle in stale_filters:
            fix.append(self._filter_msg(RTM_DELTFILTER, 0, fam, handle, u32.kind_only(),
                                        f"delete stale filter {handle:x}"))
        orphans = [m for m in classes if m >= FIRST_FLOW_MINOR and m not in used]

        def depth(m):          # children before parents (a group class with children is busy)
            d, p = 0, classes[m].parent
            while p >> 16 == MAJOR and (p & 0xFFFF) in classes and d < 8:
                d, p = d + 1, classes[p & 0xFFFF].parent
            return d
        orphans.sort(key=depth, reverse=True)
        for m in orphans:
            fix.append(self._req(RTM_DELTCLASS, 0,
                                 nl.tcmsg(self.ifindex, tc_handle(MAJOR, m), self._parent_handle()),
                                 f"delete stale class {nl.fmt_handle(tc_handle(MAJOR, m))}"))
        for err in self._rtnl.transact(fix):
            if err is not None and err.errno != errno.ENOENT:
                raise BackendError(str(err))
        self.adopted = len(self._flows)
        self.removed_stale = len(stale_filters) + len(orphans)
        log.info("%s: adopted flowpacer qdisc with %d flow classes (%d stale objects removed)",
                 self.interface, self.adopted, self.removed_stale)

    def _parent_handle(self) -> int:
        return tc_handle(MAJOR, self._flow_parent) if self._flow_parent else QDISC_HANDLE

    # --------------------------------------------------------------- apply
    def installed(self) -> Dict[FlowKey, Shape]:
        return {k: v.shape for k, v in self._flows.items()}

    def shape_of(self, key: FlowKey) -> Optional[Shape]:
        inst = self._flows.get(key)
        return inst.shape if inst else None

    def classid_of(self, key: FlowKey) -> Optional[int]:
        inst = self._flows.get(key)
        return inst.classid if inst else None

    def apply(self, plan: Sequence[Op]) -> ApplyResult:
        """Carry out a plan. Idempotent: an ADD of a known flow changes it, a REMOVE of an
        unknown one does nothing. Failures are reported per operation; the rest goes on.
        First-byte pool ops (``PoolOp``) are applied in the same batch (pool.py); a flow
        REMOVEd earlier in the plan is a new flow for a later ADD (a rebound claim)."""
        res = ApplyResult()
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

    def _queue_remove(self, op: Op, inst: Installed, add, res: ApplyResult) -> None:
        fam = op.key.family
        state = {"filter_ok": True}

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
            options = self.codec.flow_class_options(self._kernel_shape(op.shape, kernel),
                                                    self.link_rate_bps)
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
            options = self.codec.flow_class_options(self._kernel_shape(op.shape, kernel),
                                                    self.link_rate_bps)
        except ValueError as e:
            res.errors.append(OpError(op, f"{key}: {e}"))
            return
        # issue 16: a socket that claimed a pool class already sends into it: that is its class
        claimed = self.pool.take_claim(key) if parent is None and self.side is Side.SEND \
            else None
        try:
            minor = claimed or self._alloc_minor()
        except LayoutFull as e:
            res.errors.append(OpError(op, str(e)))
            return
        wk = wire_key(key, self.side)      # the tuple the filter matches (reversed on receive)
        try:
            pl: Placement = self._layout.place(wk)
        except LayoutFull as e:
            self._free_minor(minor)
            res.errors.append(OpError(op, str(e)))
            return
        classid = tc_handle(MAJOR, minor)
        state = {"ok": True}

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
                self._flows[key] = Installed(classid, pl.handle, op.shape, parent, kernel)
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

        add(self._class_msg(minor, parent or self._flow_parent, options, not claimed,
                            lambda: f"add class {nl.fmt_handle(classid)} for {key}"), class_done)
        add(self._filter_msg(RTM_NEWTFILTER, NLM_F_CREATE | NLM_F_EXCL, key.family, pl.handle,
                             u32.leaf_options(classid, u32.flow_keys(wk.local_addr, wk.local_port,
                                                                     wk.remote_addr, wk.remote_port,
                                                                     wk.protocol.number),
                                              pl.in_table),
                             lambda: f"add filter for {key}"), filter_done)

    # ------------------------------------------------- groups (issue 15, see groups.py)
    @staticmethod
    def _kernel_shape(shape: Shape, kernel: Optional[tuple]) -> Shape:
        if kernel is None:
            return shape
        return dataclasses.replace(shape, rate_bps=kernel[0], ceil_bps=kernel[1])

    def _is_grouped(self, op: Op, inst: Optional[Installed]) -> bool:
        """Whether an op involves group classes: its flow gets groups or hangs under one."""
        want = op.shape is not None and bool(op.shape.groups)
        if not getattr(self.codec, "supports_groups", False):
            if want and not self._warned_groups:
                self._warned_groups = True
                log.warning("%s: the %s backend has no group classes yet: client_rate and "
                            "total_rate are not enforced, each flow is paced at its rate",
                            self.interface, self.codec.kind)
            return False
        return want or (inst is not None and inst.parent is not None)

    def groups_snapshot(self) -> List[tuple]:
        """[(kind, id, classid, rate_bps, ceil_bps)] of the group classes (kernel rates)."""
        out = []
        for m, n in self._groups.nodes.items():
            if n.kernel is not None:
                out.append((n.kind, n.gid, tc_handle(MAJOR, m), n.kernel[0], n.kernel[1]))
        return out

    def _group_parent(self, groups, res: ApplyResult, op: Op, created: List[int]):
        """The minor of the innermost group class for ``groups`` (made in the tree if missing,
        appended to ``created``); None for no groups; False when no class id is left."""
        tree = self._groups
        parent = None
        for g in groups:
            m = tree.find(parent, g.id)
            if m is None:
                try:
                    m = self._alloc_minor()
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

    def _queue_groups(self, ops: Sequence[Op], add, res: ApplyResult) -> None:
        """The ops of flows under groups, with their group classes: new groups first (parents
        before children), the flows' own removes/moves/adds/changes, then the new shares of
        their siblings and groups, then the groups left empty (children before parents)."""
        tree = self._groups
        where: Dict[FlowKey, Optional[int]] = {k: v.parent for k, v in self._flows.items()
                                               if v.parent is not None}
        rates: Dict[FlowKey, Shape] = {k: self._flows[k].shape for k in where}
        created: List[int] = []
        actions = []
        for op in ops:
            inst = self._flows.get(op.key)
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
        flow_t, node_t = targets(tree, members, self.link_rate_bps, roots,
                                 getattr(self.codec, "kernel_shares", False))
        c = self.codec
        for m in created:
            self._queue_group_class(m, node_t.get(m), True, add)
        for m, n in list(tree.nodes.items()):
            if m not in created and m in node_t and n.kernel != node_t[m]:
                self._queue_group_class(m, node_t[m], False, add)
        touched = set()
        for kind, op, inst, parent in actions:
            touched.add(op.key)
            if kind == "remove":
                self._queue_remove(op, inst, add, res)
            elif kind == "add":
                self._queue_add(op, add, res, parent, flow_t.get(op.key))
            elif kind == "move":        # htb cannot re-parent a class: a new class, a new filter
                self._queue_remove(op, inst, add, res)
                self._queue_add(op, add, res, parent, flow_t.get(op.key))
            else:
                kt = flow_t.get(op.key)
                if kt == inst.kernel:
                    inst.shape = op.shape
                else:
                    self._queue_change(op, inst, add, res, kt)
        for k, kt in flow_t.items():      # siblings whose share changed
            inst = self._flows.get(k)
            if k in touched or inst is None or inst.kernel == kt:
                continue
            self._queue_change(Op(OpKind.CHANGE, k, inst.shape), inst, add, res, kt)
        used = set()
        for p in where.values():
            used.update(tree.chain(p))
        for m in tree.depth_first():
            if m not in used:
                self._queue_group_delete(m, add)

    def _queue_group_class(self, minor: int, rates: Optional[tuple], create: bool, add) -> None:
        n = self._groups.nodes[minor]
        r = rates or (n.rate_bps, n.ceil_bps)
        classid = tc_handle(MAJOR, minor)

        def done(err):
            if err is None:
                n.kernel = r
            elif create:
                self._groups.drop(minor)
                if err.errno != errno.EEXIST:
                    self._free_minor(minor)
        what = "add" if create else "change"
        add(self._class_msg(minor, n.parent or self._flow_parent,
                            self.codec.group_class_options(r[0], r[1], self.link_rate_bps), create,
                            lambda: f"{what} group class {nl.fmt_handle(classid)} ({n.gid})"), done)

    def _queue_group_delete(self, minor: int, add) -> None:
        n = self._groups.nodes[minor]
        classid = tc_handle(MAJOR, minor)

        def done(err):
            if err is None or err.errno == errno.ENOENT:
                self._groups.drop(minor)
                self._free_minor(minor)
            else:
                log.warning("%s: cannot delete group class %s (%s): %s", self.interface,
                            nl.fmt_handle(classid), n.gid, err)
        add(self._req(RTM_DELTCLASS, 0, nl.tcmsg(self.ifindex, classid, self._parent_handle()),
                      lambda: f"delete group class {nl.fmt_handle(classid)} ({n.gid})"), done)

    def _adopt_groups(self, classes: Dict[int, nl.TcObject], bound: set) -> set:
        """After a restart: the group classes above the bound flow classes, back in the tree
        (unnamed until a plan names them: ``GroupTree.bind``); each flow's parent. Returns the
        group minors."""
        def parent_minor(m):
            p = classes[m].parent
            pm = p & 0xFFFF
            if p >> 16 != MAJOR or pm < FIRST_FLOW_MINOR or pm not in classes:
                return None
            return pm
        group_minors = set()
        for m in bound:
            p = parent_minor(m)
            while p is not None and p not in group_minors:
                group_minors.add(p)
                p = parent_minor(p)
        has_group_kids = {parent_minor(m) for m in group_minors} - {None}
        for m in sorted(group_minors, key=lambda x: len(self._ancestry(classes, x, parent_minor))):
            p = parent_minor(m)
            rate, ceil = self.codec.parse_rates(classes[m].options)
            kind = (GroupKind.RULE if m in has_group_kids else
                    GroupKind.CLIENT if p is not None else None)
            self._groups.add(Node(m, p, kind, "", ceil, ceil, (rate, ceil)))
        for k, inst in self._flows.items():
            p = parent_minor(inst.classid & 0xFFFF)
            if p is not None:
                inst.parent = p
                inst.kernel = (inst.shape.rate_bps, inst.shape.ceil_bps)
                inst.shape = dataclasses.replace(inst.shape, groups=self._groups.groups(p))
        return group_minors

    @staticmethod
    def _ancestry(classes, m, parent_minor) -> List[int]:
        out = []
        p = parent_minor(m)
        while p is not None and len(out) < 8:
            out.append(p)
            p = parent_minor(p)
        return out

    # --------------------------------------------------------------- stats
    def flows_snapshot(self) -> List[tuple]:
        """[(key, classid, shape)] of every installed flow (a copy)."""
        return [(k, v.classid, v.shape) for k, v in self._flows.items()]

    def stats_by_class(self, rtnl: Optional[RtnlSocket] = None) -> Dict[int, ClassStats]:
        """{classid: ClassStats} of our classes, read now (``rtnl``: another thread's socket)."""
        out: Dict[int, ClassStats] = {}
        for mtype, body in (rtnl or self._rtnl).dump(RTM_GETTCLASS, nl.tcmsg(self.ifindex)):
            obj = nl.parse_tcmsg(mtype, body)
            if obj.ifindex == self.ifindex and obj.handle >> 16 == MAJOR:
                out[obj.handle] = ClassStats(**nl.parse_stats2(obj))
        return out

    def stats(self) -> Dict[FlowKey, ClassStats]:
        by_class = self.stats_by_class()
        return {k: by_class[v.classid] for k, v in self._flows.items() if v.classid in by_class}

    def default_stats(self) -> ClassStats:
        for mtype, body in self._rtnl.dump(RTM_GETTCLASS, nl.tcmsg(self.ifindex)):
            obj = nl.parse_tcmsg(mtype, body)
            if obj.ifindex == self.ifindex and obj.handle == tc_handle(MAJOR, DEFAULT_MINOR):
                return ClassStats(**nl.parse_stats2(obj))
        return ClassStats()

    # -------------------------------------------------------------- health
    def check(self) -> BackendHealth:
        """What became of our objects since the last look (cheap: one qdisc dump).

        ``ok``; ``gone`` (the interface is missing); ``lost`` (our root qdisc is not there and the
        kernel's default is back: we may rebuild); ``foreign`` (someone else's root qdisc is
        there: we do not fight it); ``speed`` (no configured link rate and the interface's speed
        changed)."""
        try:
            idx = socket.if_nametoindex(self.interface)
        except OSError:
            return BackendHealth.GONE
        if idx != self.ifindex:
            return BackendHealth.LOST             # deleted and made again: nothing of ours is on it
        try:
            root = root_qdisc(self._rtnl, idx)
        except NetlinkError:
            return BackendHealth.GONE
        if root is None or root.handle >> 16 == 0:
            return BackendHealth.LOST
        if root.handle != QDISC_HANDLE or root.kind != self.codec.kind:
            return BackendHealth.FOREIGN
        if not self._want_link_rate:
            speed = link_speed_bps(self.speed_interface)
            if speed and speed != self.link_rate_bps:
                return BackendHealth.SPEED
        return BackendHealth.OK

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
        self._audit_groups(present)
        return gone

    def _audit_groups(self, present: set) -> None:
        """Group classes someone removed are forgotten; groups left without flows (their flows'
        classes were removed behind our back) are deleted."""
        tree = self._groups
        if not tree.nodes:
            return
        for m in list(tree.nodes):
            if tc_handle(MAJOR, m) not in present:
                tree.drop(m)
                self._free_minor(m)
        used = set()
        for inst in self._flows.values():
            if inst.parent is not None and inst.parent in tree.nodes:
                used.update(tree.chain(inst.parent))
        reqs, after = [], []
        for m in tree.depth_first():
            if m not in used:
                self._queue_group_delete(m, lambda r, cb: (reqs.append(r), after.append(cb)))
        if reqs:
            for cb, err in zip(after, self._rtnl.transact(reqs)):
                cb(err)

    def forget(self) -> None:
        """Drop our bookkeeping (the kernel objects are gone or not ours any more)."""
        self._groups = GroupTree()
        self._flows.clear()
        self._free_minors.clear()
        self._next_minor = FIRST_FLOW_MINOR
        self._layout = Layout()
        self.pool.forget()

    def resync(self) -> None:
        """Rebuild the bookkeeping from the kernel after an error left it uncertain."""
        self.forget()
        self.setup()

    # ------------------------------------------------------------ teardown
    def teardown(self) -> None:
        """Remove everything we made (the root qdisc and all under it)."""
        try:
            root = root_qdisc(self._rtnl, self.ifindex) if self.ifindex else None
            if root is not None and root.handle == QDISC_HANDLE:
                self._rtnl.request(self._req(RTM_DELQDISC, 0,
                                             nl.tcmsg(self.ifindex, QDISC_HANDLE, TC_H_ROOT),
                                             "delete root qdisc"))
                log.info("%s: flowpacer qdisc removed", self.interface)
        except NetlinkError as e:
            log.warning("teardown: %s", e)
        self._flows.clear()

    def close(self) -> None:
        self._rtnl.close()

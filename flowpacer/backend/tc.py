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

import errno
import logging
import socket
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

from ..errors import BackendError, NetlinkError
from ..model import ApplyResult, BackendHealth, ClassStats, FlowKey, Op, OpError, OpKind, Shape
from ..tc import nl, u32
from ..tc.nl import (NLM_F_CREATE, NLM_F_EXCL, NLM_F_REPLACE, RTM_DELQDISC, RTM_DELTCLASS,
                     RTM_DELTFILTER, RTM_GETQDISC, RTM_GETTCLASS, RTM_GETTFILTER, RTM_NEWQDISC,
                     RTM_NEWTCLASS, RTM_NEWTFILTER, TC_H_ROOT, Request, RtnlSocket, tc_handle)
from .filters import (DIVISOR, GUARD, HMASK_LOCAL_PORT, HMASK_REMOTE_PORT, L1_HTID, PORTS_OFF,
                      PRIO, PROTO, Layout, LayoutFull, Placement, all_tables)

log = logging.getLogger(__name__)

MAJOR = 0xF1F0
QDISC_HANDLE = tc_handle(MAJOR, 0)
LINK_MINOR = 1
DEFAULT_MINOR = 2
FIRST_FLOW_MINOR = 0x10
LAST_FLOW_MINOR = 0xFFFF


@dataclass
class Installed:
    classid: int
    filter_handle: int
    shape: Shape


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
                 take_over: bool = False, rtnl: Optional[RtnlSocket] = None):
        self.codec = codec
        self.name = codec.kind
        self.interface = interface
        self.take_over = take_over
        self._want_link_rate = link_rate_bps
        self.link_rate_bps = 0
        self.ifindex = 0
        self._rtnl = rtnl or RtnlSocket()
        self._flows: Dict[FlowKey, Installed] = {}
        self._free_minors: List[int] = []
        self._next_minor = FIRST_FLOW_MINOR
        self._layout = Layout()
        self.adopted = 0
        self.removed_stale = 0

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
            raise LayoutFull("no free class id (65 519 flows shaped)")
        m = self._next_minor
        self._next_minor += 1
        return m

    def _free_minor(self, minor: int) -> None:
        self._free_minors.append(minor)

    # --------------------------------------------------------------- setup
    def setup(self) -> None:
        """Create our root qdisc and skeleton, or adopt the one a previous run left."""
        self.ifindex = ifindex_of(self.interface)
        rate = self._want_link_rate or link_speed_bps(self.interface)
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
                reqs.append(self._filter_msg(RTM_NEWTFILTER, NLM_F_CREATE | NLM_F_EXCL, fam, 0,
                                             u32.link_options(htid, GUARD[fam](), PORTS_OFF[fam],
                                                              HMASK_REMOTE_PORT),
                                             f"create u32 root link (IPv{fam})"))
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
        if not want_tables <= tables or links < len(want_tables):
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
            key = FlowKey(*tup)
            rate, ceil = self.codec.parse_rates(cls.options)
            self._flows[key] = Installed(classid, obj.handle, Shape("", rate, ceil))
            self._layout.adopt_leaf(obj.handle)
            bound.add(minor)
        used = set(bound)
        self._next_minor = max([FIRST_FLOW_MINOR - 1] + list(classes)) + 1
        self._free_minors = [m for m in range(FIRST_FLOW_MINOR, self._next_minor) if m not in used]
        self._free_minors.reverse()
        for fam, handle in stale_filters:
            fix.append(self._filter_msg(RTM_DELTFILTER, 0, fam, handle, u32.kind_only(),
                                        f"delete stale filter {handle:x}"))
        orphans = [m for m in classes if m >= FIRST_FLOW_MINOR and m not in bound]
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
        unknown one does nothing. Failures are reported per operation; the rest goes on."""
        res = ApplyResult()
        reqs: List[Request] = []
        # what to do with each request's outcome
        after: List[Callable[[Optional[NetlinkError]], None]] = []
        c = self.codec

        def add(req, cb):
            reqs.append(req)
            after.append(cb)

        for op in plan:
            inst = self._flows.get(op.key)
            if op.kind is OpKind.REMOVE:
                if inst is None:
                    continue
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

    def _queue_change(self, op: Op, inst: Installed, add, res: ApplyResult) -> None:
        try:
            options = self.codec.flow_class_options(op.shape, self.link_rate_bps)
        except ValueError as e:
            res.errors.append(OpError(op, f"{op.key}: {e}"))
            return

        def done(err):
            if err is not None:
                res.errors.append(OpError(op, str(err)))
                return
            inst.shape = op.shape
            res.changed += 1
        add(self._class_msg(inst.classid & 0xFFFF, self._flow_parent, options, False,
                            lambda: f"change class {nl.fmt_handle(inst.classid)} of {op.key}"), done)

    def _queue_add(self, op: Op, add, res: ApplyResult) -> None:
        key = op.key
        try:
            options = self.codec.flow_class_options(op.shape, self.link_rate_bps)
        except ValueError as e:
            res.errors.append(OpError(op, f"{key}: {e}"))
            return
        try:
            minor = self._alloc_minor()
        except LayoutFull as e:
            res.errors.append(OpError(op, str(e)))
            return
        try:
            pl: Placement = self._layout.place(key)
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
                self._flows[key] = Installed(classid, pl.handle, op.shape)
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

        add(self._class_msg(minor, self._flow_parent, options, True,
                            lambda: f"add class {nl.fmt_handle(classid)} for {key}"), class_done)
        add(self._filter_msg(RTM_NEWTFILTER, NLM_F_CREATE | NLM_F_EXCL, key.family, pl.handle,
                             u32.leaf_options(classid, u32.flow_keys(key.local_addr, key.local_port,
                                                                     key.remote_addr, key.remote_port),
                                              pl.in_table),
                             lambda: f"add filter for {key}"), filter_done)

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
            speed = link_speed_bps(self.interface)
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
        return gone

    def forget(self) -> None:
        """Drop our bookkeeping (the kernel objects are gone or not ours any more)."""
        self._flows.clear()
        self._free_minors.clear()
        self._next_minor = FIRST_FLOW_MINOR
        self._layout = Layout()

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

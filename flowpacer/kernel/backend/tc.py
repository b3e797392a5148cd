"""The tc backend: owns one root qdisc and everything under it; applies plans idempotently.

Kernel objects: see ``handles.py`` (root qdisc ``f1f0:``, link and default classes, one class
per flow, group and pool classes) and ``filters.py`` (u32 filters).

``TcBackend`` keeps the ``Backend`` contract (contract.py). It is split along its jobs:
  tc.py        the skeleton: setup (create or adopt after a restart), health, forget, teardown
  tcflows.py   flow classes: a plan's adds, changes and removes in one batch; audit
  tcgroups.py  group classes (issue 15), planned with groups.py
  tcstats.py   class statistics, keyed by flow, group and role (class ids stay inside)
  pool.py      first-byte pool classes (issue 16)
"""
from __future__ import annotations

import errno
import logging
import socket
from typing import Dict, List, Optional

from flowpacer.errors import BackendError, NetlinkError
from flowpacer.model import BackendHealth, FlowKey, Protocol, Shape, Side
from flowpacer.kernel.tc import nl, u32
from flowpacer.kernel.tc.nl import (NLM_F_CREATE, NLM_F_EXCL, NLM_F_REPLACE, RTM_DELQDISC,
                                    RTM_DELTCLASS, RTM_DELTFILTER, RTM_GETQDISC, RTM_GETTCLASS,
                                    RTM_GETTFILTER, RTM_NEWQDISC, RTM_NEWTCLASS, RTM_NEWTFILTER,
                                    TC_H_ROOT, Request, RtnlSocket, tc_handle)
from flowpacer.kernel.backend.contract import Capabilities, Codec
from flowpacer.kernel.backend.filters import (DIVISOR, GUARD, HMASK_LOCAL_PORT, HMASK_REMOTE_PORT,
                                              L1_HTID, PORTS_OFF, PRIO, PROTO, PROTOCOLS, Layout,
                                              LayoutFull, all_tables)
from flowpacer.kernel.backend.groups import GroupTree
from flowpacer.kernel.backend.handles import (DEFAULT_MINOR, FIRST_FLOW_MINOR, FLOW_CLASS_IDS,
                                              LAST_FLOW_MINOR, LINK_MINOR, MAJOR, QDISC_HANDLE,
                                              SPARE_FROM,
                                              Installed, handle_text, wire_key)
from flowpacer.kernel.backend.pool import Pool
from flowpacer.kernel.backend.tcflows import FlowClasses
from flowpacer.kernel.backend.tcgroups import GroupClasses
from flowpacer.kernel.backend.tcstats import ClassCounters

__all__ = ["TcBackend", "cleanup", "ifindex_of", "link_speed_bps", "root_qdisc", "wire_key",
           "Installed", "MAJOR", "QDISC_HANDLE", "LINK_MINOR", "DEFAULT_MINOR",
           "FIRST_FLOW_MINOR", "LAST_FLOW_MINOR", "PRIO", "nl", "u32", "handle_text"]

log = logging.getLogger(__name__)


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


class TcBackend(FlowClasses, GroupClasses, ClassCounters):
    """A ``Backend`` (contract.py) of tc classes: htb or psp, as its ``Codec`` says."""

    def __init__(self, codec: Codec, interface: str, link_rate_bps: Optional[int] = None,
                 take_over: bool = False, rtnl: Optional[RtnlSocket] = None,
                 side: Side = Side.SEND, speed_interface: Optional[str] = None,
                 spare_max: int = 0, spare_from: int = SPARE_FROM):
        """``side``: RECEIVE on flowpacer's ifb (issue 17): filters match the reversed tuple;
        ``speed_interface``: whose speed is the link rate (the ifb has none: its interface's);
        ``spare_max``: how many closed flows' classes are kept as spares for new flows (0: none,
        a closed flow's class is deleted), once flows and spares number ``spare_from``
        (handles.py, tcflows.py)."""
        self.codec = codec
        self.kind = codec.kind
        self.name = codec.kind.value
        self.capabilities = Capabilities(has_classes=True, groups=codec.supports_groups,
                                         kernel_shares=codec.kernel_shares,
                                         pools=side is Side.SEND, side=side,
                                         class_ids=FLOW_CLASS_IDS)
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
        self._spares: List[int] = []     # minors of spare classes (tcflows.py)
        self._spares_queued = 0          # removes of this apply that keep their class (tcflows)
        self.spare_max = spare_max
        self.spare_from = spare_from
        self._next_minor = FIRST_FLOW_MINOR
        self._layout = Layout()
        self._options_cache: Dict[tuple, bytes] = {}   # flow class options by rates (tcflows)
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
        if root is not None and root.handle == QDISC_HANDLE and root.kind == self.codec.qdisc_kind:
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
                          f"create root {c.qdisc_kind} qdisc")]
        if c.has_link_class:
            reqs.append(self._class_msg(LINK_MINOR, None, c.link_class_options(self.link_rate_bps),
                                        True, "create link class"))
        if not c.makes_default_class:
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
        log.info("%s: root %s qdisc %s created, link rate %d bit/s", self.interface, c.qdisc_kind,
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
        if self.codec.makes_default_class:
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
        # leaf flow classes without a filter (spares, or flows closed while no daemon ran) are
        # kept as spares rather than deleted: both cost a walk of every class in the kernel
        parents = {c.parent & 0xFFFF for c in classes.values() if c.parent >> 16 == MAJOR}
        for m in sorted(classes):
            if len(self._spares) >= self.spare_max:
                break
            if (FIRST_FLOW_MINOR <= m <= LAST_FLOW_MINOR and m not in used and m not in parents
                    and classes[m].parent == self._parent_handle()):
                self._spares.append(m)
        used.update(self._spares)
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
        log.info("%s: adopted flowpacer qdisc with %d flow classes (%d stale objects removed, "
                 "%d spare classes kept)", self.interface, self.adopted, self.removed_stale,
                 len(self._spares))

    def _parent_handle(self) -> int:
        return tc_handle(MAJOR, self._flow_parent) if self._flow_parent else QDISC_HANDLE

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
        except NetlinkError as e:
            if e.errno == errno.ENODEV:          # went between the two looks
                return BackendHealth.GONE
            raise                                # a failed look, not a missing interface
        if root is None or root.handle >> 16 == 0:
            return BackendHealth.LOST
        if root.handle != QDISC_HANDLE or root.kind != self.codec.qdisc_kind:
            return BackendHealth.FOREIGN
        if not self._want_link_rate:
            speed = link_speed_bps(self.speed_interface)
            if speed and speed != self.link_rate_bps:
                return BackendHealth.SPEED
        return BackendHealth.OK

    def forget(self) -> None:
        """Drop our bookkeeping (the kernel objects are gone or not ours any more)."""
        self._groups = GroupTree()
        self._flows.clear()
        self._free_minors.clear()
        self._spares.clear()
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
        self._spares.clear()

    def close(self) -> None:
        self._rtnl.close()

"""The tc backend: owns one root qdisc and everything under it; applies plans idempotently.

Kernel objects: see ``handles.py`` (root qdisc ``f1f0:``, link and default classes, one class
per flow, group and pool classes) and ``filters.py`` (u32 filters).

``TcBackend`` keeps the ``Backend`` contract (contract.py). It is the skeleton (setup: create,
or adopt after a restart; health; forget, resync; teardown) and wires the objects that do the
rest, each with its own state, talking to each other through methods only:
  tcchannel.py  ``Channel``: socket, device, side, codec, link rate, request builders (shared)
  tcids.py      ``ClassIds``: flow-range class ids (free, next) and spare classes with their cap
  tcflows.py    ``FlowClasses``: the flows' book, u32 layout and options cache; a plan's adds,
                changes and removes in one batch; their audit
  tcgroups.py   ``GroupClasses``: group classes (issue 15), planned with groups.py
  tcstats.py    ``ClassCounters``: class statistics, keyed by flow, group and role
  pool.py       ``Pool``: first-byte pool classes (issue 16), ``backend.pool``
"""
from __future__ import annotations

import errno
import logging
import socket
from typing import Dict, List, Optional, Sequence, Tuple

from flowpacer.errors import BackendError, NetlinkError
from flowpacer.model import (ApplyResult, BackendHealth, ClassStats, FlowKey, GroupView, Op,
                             Protocol, Shape, Side)
from flowpacer.kernel import bond
from flowpacer.kernel.tc import nl, u32
from flowpacer.kernel.tc.nl import (NLM_F_CREATE, NLM_F_EXCL, NLM_F_REPLACE, RTM_DELQDISC,
                                    RTM_DELTFILTER, RTM_GETQDISC, RTM_GETTCLASS, RTM_GETTFILTER,
                                    RTM_NEWQDISC, RTM_NEWTFILTER, TC_H_ROOT, Request, RtnlSocket,
                                    tc_handle)
from flowpacer.kernel.backend.contract import Capabilities, ClassKey, Codec
from flowpacer.kernel.backend.filters import (DIVISOR, GUARD, HMASK_LOCAL_PORT, HMASK_REMOTE_PORT,
                                              L1_HTID, PORTS_OFF, PRIO, PROTOCOLS, all_tables)
from flowpacer.kernel.backend.handles import (DEFAULT_MINOR, FIRST_FLOW_MINOR, FLOW_CLASS_IDS,
                                              LAST_FLOW_MINOR, LINK_MINOR, MAJOR, QDISC_HANDLE,
                                              SPARE_FROM,
                                              Installed, handle_text, wire_key)
from flowpacer.kernel.backend.pool import Pool
from flowpacer.kernel.backend.tcchannel import Channel
from flowpacer.kernel.backend.tcflows import FlowClasses
from flowpacer.kernel.backend.tcgroups import GroupClasses
from flowpacer.kernel.backend.tcids import ClassIds
from flowpacer.kernel.backend.tcstats import ClassCounters

__all__ = ["TcBackend", "cleanup", "ifindex_of", "root_qdisc", "wire_key",
           "Installed", "MAJOR", "QDISC_HANDLE", "LINK_MINOR", "DEFAULT_MINOR",
           "FIRST_FLOW_MINOR", "LAST_FLOW_MINOR", "PRIO", "nl", "u32", "handle_text"]

log = logging.getLogger(__name__)


def ifindex_of(interface: str) -> int:
    try:
        return socket.if_nametoindex(interface)
    except OSError:
        raise BackendError(f"interface {interface!r} not found") from None


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
    """A ``Backend`` (contract.py) of tc classes: htb or psp, as its ``Codec`` says. The
    skeleton; flows, groups, class ids, counters and pools are its components (module
    docstring), public for the tests' and the harness' look inside."""

    def __init__(self, codec: Codec, interface: str, link_rate_bps: Optional[int] = None,
                 take_over: bool = False, rtnl: Optional[RtnlSocket] = None,
                 side: Side = Side.SEND, speed_interface: Optional[str] = None,
                 spare_max: int = 0, spare_from: int = SPARE_FROM):
        """``side``: RECEIVE on flowpacer's ifb (issue 17): filters match the reversed tuple;
        ``speed_interface``: whose speed is the link rate (the ifb has none: its interface's);
        ``spare_max``: how many closed flows' classes are kept as spares for new flows (0: none,
        a closed flow's class is deleted), once flows and spares number ``spare_from``
        (handles.py, tcids.py)."""
        self.codec = codec
        self.kind = codec.kind
        self.name = codec.kind.value
        self.capabilities = Capabilities(has_classes=True, groups=codec.supports_groups,
                                         kernel_shares=codec.kernel_shares,
                                         pools=side is Side.SEND, side=side,
                                         class_ids=FLOW_CLASS_IDS, spares=spare_max > 0)
        self.interface = interface
        self.side = side
        self.speed_interface = speed_interface or interface
        self.take_over = take_over
        self._want_link_rate = link_rate_bps
        # where the link rate comes from: "rules", "speed", or a bond and its sending members
        self.link_rate_source = "rules" if link_rate_bps else ""
        self.adopted = 0
        self.removed_stale = 0
        self.channel = Channel(codec, interface, side, rtnl or RtnlSocket())
        self.pool = Pool(MAJOR)          # first-byte pools (issue 16, pool.py)
        self.class_ids = ClassIds(self.pool, spare_max, spare_from)
        self.group_classes = GroupClasses(self.channel, self.class_ids)
        self.flow_classes = FlowClasses(self.channel, self.class_ids, self.pool,
                                        self.group_classes)
        self.counters = ClassCounters(self.channel, self.flow_classes, self.group_classes)
        # the reconciler asks for every dirty flow's shape: no delegating call in between
        self.shape_of = self.flow_classes.shape_of

    # ------------------------------------------------------- what it shows
    @property
    def link_rate_bps(self) -> int:
        return self.channel.link_rate_bps

    @property
    def ifindex(self) -> int:
        return self.channel.ifindex

    @property
    def _rtnl(self) -> RtnlSocket:
        return self.channel.rtnl

    @property
    def spare_max(self) -> int:
        return self.class_ids.spare_max

    # --------------------------------------------------------------- setup
    def setup(self) -> None:
        """Create our root qdisc and skeleton, or adopt the one a previous run left."""
        chan = self.channel
        chan.ifindex = ifindex_of(self.interface)
        rate = self._want_link_rate
        if not rate:
            got = bond.link_rate(self.speed_interface)
            rate, self.link_rate_source = got.rate_bps, got.source
            if not rate and got.source != "speed":   # a bond (or a device on one), no member
                raise BackendError(f"interface {self.interface} reports no speed ({got.source}): "
                                   "retried while its members come up; set link_rate in the "
                                   "rules file if none does")
        if not rate:
            raise BackendError(f"interface {self.interface} reports no speed: set link_rate in the "
                               "rules file")
        chan.link_rate_bps = rate
        root = root_qdisc(chan.rtnl, chan.ifindex)
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
        c, chan = self.codec, self.channel
        rate = chan.link_rate_bps
        reqs = [chan.req(RTM_NEWQDISC, NLM_F_CREATE | NLM_F_REPLACE,
                         nl.tcmsg(chan.ifindex, QDISC_HANDLE, TC_H_ROOT)
                         + c.qdisc_options(rate, DEFAULT_MINOR),
                         f"create root {c.qdisc_kind} qdisc")]
        if c.has_link_class:
            reqs.append(chan.class_msg(LINK_MINOR, None, c.link_class_options(rate), True,
                                       "create link class"))
        if not c.makes_default_class:
            reqs.append(chan.class_msg(DEFAULT_MINOR, chan.flow_parent,
                                       c.default_class_options(rate), True,
                                       "create default class"))
        for fam, htid, b1 in all_tables():
            reqs.append(chan.filter_msg(RTM_NEWTFILTER, NLM_F_CREATE | NLM_F_EXCL, fam,
                                        u32.htid_handle(htid), u32.table_options(htid, DIVISOR),
                                        f"create u32 table {htid:x}: (IPv{fam})"))
            if b1 is None:      # L1: linked from the root table, hashed by the remote port
                for proto in PROTOCOLS:     # TCP and UDP (issue 17)
                    reqs.append(chan.filter_msg(
                        RTM_NEWTFILTER, NLM_F_CREATE | NLM_F_EXCL, fam, 0,
                        u32.link_options(htid, GUARD[fam](proto), PORTS_OFF[fam],
                                         HMASK_REMOTE_PORT),
                        f"create u32 root link (IPv{fam}, IP protocol {proto})"))
            else:               # L2: linked from L1 bucket b1, hashed by the local port
                reqs.append(chan.filter_msg(
                    RTM_NEWTFILTER, NLM_F_CREATE | NLM_F_EXCL, fam,
                    u32.htid_handle(L1_HTID[fam], b1, 1),
                    u32.link_options(htid, [], PORTS_OFF[fam], HMASK_LOCAL_PORT,
                                     in_table=u32.htid_handle(L1_HTID[fam], b1)),
                    f"link u32 table {htid:x}:"))
        for err in chan.transact(reqs):
            if err is not None:
                raise BackendError(f"cannot set up {self.interface}: {err}")
        log.info("%s: root %s qdisc %s created, link rate %d bit/s", self.interface, c.qdisc_kind,
                 nl.fmt_handle(QDISC_HANDLE), rate * 8)

    def _adopt(self) -> None:
        """Rebuild the components' books from the kernel; drop objects that do not fit
        together."""
        chan, codec = self.channel, self.codec
        ifindex = chan.ifindex
        classes: Dict[int, nl.TcObject] = {}
        for mtype, body in chan.rtnl.dump(RTM_GETTCLASS, nl.tcmsg(ifindex)):
            obj = nl.parse_tcmsg(mtype, body)
            if obj.ifindex == ifindex and obj.handle >> 16 == MAJOR:
                classes[obj.handle & 0xFFFF] = obj
        if DEFAULT_MINOR not in classes or (codec.has_link_class and LINK_MINOR not in classes):
            raise BackendError("skeleton classes missing")
        tables, leaves, links = set(), [], 0
        for mtype, body in chan.rtnl.dump(RTM_GETTFILTER, nl.tcmsg(ifindex, 0, QDISC_HANDLE)):
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
        rate = chan.link_rate_bps
        fix = []
        if codec.has_link_class:
            fix.append(chan.class_msg(LINK_MINOR, None, codec.link_class_options(rate), False,
                                      "update link class"))
        if codec.makes_default_class:
            # the qdisc owns the link rate (and its default class): change it in place
            fix.append(chan.req(RTM_NEWQDISC, 0, nl.tcmsg(ifindex, QDISC_HANDLE, TC_H_ROOT)
                                + codec.qdisc_options(rate, DEFAULT_MINOR),
                                "update root qdisc"))
        else:
            fix.append(chan.class_msg(DEFAULT_MINOR, chan.flow_parent,
                                      codec.default_class_options(rate), False,
                                      "update default class"))
        stale_filters = []
        bound = set()
        flows = self.flow_classes
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
            f_rate, f_ceil = codec.parse_rates(cls.options)
            flows.adopt_leaf(key, classid, obj.handle, Shape("", f_rate, f_ceil))
            bound.add(minor)
        group_minors, under = self.group_classes.adopt(classes, bound)
        flows.adopt_parents(under)
        # leaf flow classes without a filter (spares, or flows closed while no daemon ran) are
        # kept as spares rather than deleted: both cost a walk of every class in the kernel
        parents = {c.parent & 0xFFFF for c in classes.values() if c.parent >> 16 == MAJOR}
        used = self.class_ids.adopted(
            classes, bound | group_minors,
            lambda m: m not in parents and classes[m].parent == chan.parent_handle)
        self.pool.adopted(used)       # pool-range ids of adopted flows stay taken (pool.py)
        for fam, handle in stale_filters:
            fix.append(chan.filter_msg(RTM_DELTFILTER, 0, fam, handle, u32.kind_only(),
                                       f"delete stale filter {handle:x}"))
        orphans = [m for m in classes if m >= FIRST_FLOW_MINOR and m not in used]

        def depth(m):          # children before parents (a group class with children is busy)
            d, p = 0, classes[m].parent
            while p >> 16 == MAJOR and (p & 0xFFFF) in classes and d < 8:
                d, p = d + 1, classes[p & 0xFFFF].parent
            return d
        orphans.sort(key=depth, reverse=True)
        for m in orphans:
            classid = tc_handle(MAJOR, m)
            fix.append(chan.class_del(classid, f"delete stale class {nl.fmt_handle(classid)}"))
        for err in chan.transact(fix):
            if err is not None and err.errno != errno.ENOENT:
                raise BackendError(str(err))
        self.adopted = len(flows)
        self.removed_stale = len(stale_filters) + len(orphans)
        log.info("%s: adopted flowpacer qdisc with %d flow classes (%d stale objects removed, "
                 "%d spare classes kept)", self.interface, self.adopted, self.removed_stale,
                 self.class_ids.spare_count())

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
        if idx != self.channel.ifindex:
            return BackendHealth.LOST             # deleted and made again: nothing of ours is on it
        try:
            root = root_qdisc(self.channel.rtnl, idx)
        except NetlinkError as e:
            if e.errno == errno.ENODEV:          # went between the two looks
                return BackendHealth.GONE
            raise                                # a failed look, not a missing interface
        if root is None or root.handle >> 16 == 0:
            return BackendHealth.LOST
        if root.handle != QDISC_HANDLE or root.kind != self.codec.qdisc_kind:
            return BackendHealth.FOREIGN
        if not self._want_link_rate:
            # a bond's figure follows its members (bond.py): a member down or up, a failover
            got = bond.link_rate(self.speed_interface)
            if got.rate_bps and got.rate_bps != self.channel.link_rate_bps:
                log.info("%s: link rate %d -> %d bit/s (%s)", self.interface,
                         self.channel.link_rate_bps * 8, got.rate_bps * 8, got.source)
                return BackendHealth.SPEED
            if got.rate_bps:
                self.link_rate_source = got.source
        return BackendHealth.OK

    def audit(self) -> List[FlowKey]:
        """Flows whose class someone removed behind our back: forgotten (their filter deleted if
        it is still there) and returned, so that the caller can plan them again. Spares and
        group classes someone removed are forgotten too, groups left without flows deleted."""
        present = self.counters.present()
        gone = self.flow_classes.audit(present)
        self.class_ids.audit_spares(present)
        self.group_classes.audit(present, self.flow_classes.group_parents())
        return gone

    def forget(self) -> None:
        """Drop our bookkeeping (the kernel objects are gone or not ours any more)."""
        self.group_classes.forget()
        self.flow_classes.forget()
        self.class_ids.forget()
        self.pool.forget()

    def resync(self) -> None:
        """Rebuild the bookkeeping from the kernel after an error left it uncertain."""
        self.forget()
        self.setup()

    # ------------------------------------------------------------ teardown
    def teardown(self) -> None:
        """Remove everything we made (the root qdisc and all under it)."""
        chan = self.channel
        try:
            root = root_qdisc(chan.rtnl, chan.ifindex) if chan.ifindex else None
            if root is not None and root.handle == QDISC_HANDLE:
                chan.rtnl.request(chan.req(RTM_DELQDISC, 0,
                                           nl.tcmsg(chan.ifindex, QDISC_HANDLE, TC_H_ROOT),
                                           "delete root qdisc"))
                log.info("%s: flowpacer qdisc removed", self.interface)
        except NetlinkError as e:
            log.warning("teardown: %s", e)
        self.flow_classes.forget()
        self.class_ids.drop_spares()

    def close(self) -> None:
        self.channel.rtnl.close()

    # ------------------------------------------------ flows (FlowClasses)
    def apply(self, plan: Sequence[Op]) -> ApplyResult:
        """Carry out a plan (``FlowClasses.apply``: flows, their groups and the first-byte
        pool ops in one batch)."""
        return self.flow_classes.apply(plan)

    def installed(self) -> Dict[FlowKey, Shape]:
        return self.flow_classes.installed()

    # shape_of: ``FlowClasses.shape_of``, bound in __init__

    def classid_of(self, key: FlowKey) -> Optional[int]:
        return self.flow_classes.classid_of(key)

    def flows_snapshot(self) -> List[Tuple[FlowKey, str, Shape]]:
        """[(key, handle, shape)] of every installed flow (a copy; ``handle`` for display)."""
        return self.flow_classes.snapshot()

    # --------------------------------------------------- spares (ClassIds)
    def spare_count(self) -> int:
        return self.class_ids.spare_count()

    def spare_handles(self) -> Tuple[str, ...]:
        return tuple(handle_text(tc_handle(MAJOR, m)) for m in self.class_ids.spare_minors())

    # ----------------------------------------------- groups (GroupClasses)
    def group_views(self) -> Tuple[GroupView, ...]:
        return self.group_classes.views()

    def groups_snapshot(self) -> List[tuple]:
        """[(kind, id, classid, rate_bps, ceil_bps)] of the group classes (kernel rates)."""
        return self.group_classes.snapshot()

    # ---------------------------------------------- counters (ClassCounters)
    def open_stats_channel(self) -> RtnlSocket:
        return self.counters.open_channel()

    def stats_by_class(self, rtnl: Optional[RtnlSocket] = None) -> Dict[int, ClassStats]:
        return self.counters.by_class(rtnl)

    def class_stats(self, channel: Optional[RtnlSocket] = None) -> Dict[ClassKey, ClassStats]:
        return self.counters.class_stats(channel)

    def stats(self) -> Dict[FlowKey, ClassStats]:
        return self.counters.stats()

    def default_stats(self) -> ClassStats:
        return self.counters.default_stats()

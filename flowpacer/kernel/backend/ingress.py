"""The receive side (issue 17): shape what the server accepts, on an ifb device of our own.

A qdisc only shapes what leaves through it, so what the interface receives is handed to an
ifb device first and shaped on the ifb's egress, with the same backend (psp or htb) and the same
per-flow classes and u32 layout as the send side; only the filters match the reversed tuple
(source = the remote end, destination = us: ``tc.wire_key``).

Kernel objects, all flowpacer's, all removed by ``teardown``:
  ifb ``fpi-<interface>``   (``fpi-`` and a hash when the name would be too long), up, alias
                             ``flowpacer: receive side of <interface>`` (how we know it is ours;
                             ``; clsact ours`` when we made the clsact below)
  on the ifb                 everything ``TcBackend`` makes (root qdisc ``f1f0:``, classes,
                             u32 tables and leaves)
  on the interface           a clsact qdisc (made unless one, or an ``ingress`` qdisc, is
                             already there) and at its ingress hook one u32 filter, protocol
                             all, pref ``REDIRECT_PREF``, matching every packet, with a mirred
                             egress redirect to the ifb.

Every packet the interface receives goes through the ifb: a flow without a receive_rate falls
into the default class, which borrows up to the link rate (htb) or is not paced (psp). If the ifb
were gone while the redirect stays, mirred would drop every received packet: ``check`` reports
that as LOST (the supervisor rebuilds at once), and ``teardown`` removes the redirect first.
After a crash the next start adopts the ifb, its classes and the redirect.
"""
from __future__ import annotations

import errno
import logging
import socket
import zlib
from typing import List, Optional

from flowpacer.errors import BackendError, NetlinkError
from flowpacer.model import BackendHealth, Side
from flowpacer.kernel.tc import link, mirred, nl, u32
from flowpacer.kernel.tc.nl import (NLM_F_CREATE, NLM_F_EXCL, RTM_DELQDISC, RTM_DELTFILTER,
                                    RTM_GETQDISC, RTM_GETTFILTER, RTM_NEWQDISC, RTM_NEWTFILTER,
                                    Request, RtnlSocket)
from flowpacer.kernel.tc.u32 import filter_info
from flowpacer.kernel.backend.tc import TcBackend, ifindex_of

log = logging.getLogger(__name__)

IFB_PREFIX = "fpi-"
ALIAS = "flowpacer: receive side of "
CLSACT_OURS = "; clsact ours"
REDIRECT_PREF = 0xF1F0        # late: an admin's own ingress filters (lower prefs) run first
IFB_TXQLEN = 100              # packets per leaf queue (htb: pfifo of txqueuelen): at
#                               10 Mbit/s ~120 ms of full frames, so that the ACKs of a
#                               download that ride an upload of the same flow are not held
#                               for seconds (1000, a veth's, held them 1.2 s: 12 of 40 Mbit/s)


def ifb_name(interface: str) -> str:
    """``fpi-eth0``; ``fpi-`` and 8 hex digits of a hash when that would pass IFNAMSIZ-1."""
    name = IFB_PREFIX + interface
    if len(name) <= 15:
        return name
    return f"{IFB_PREFIX}{zlib.crc32(interface.encode()):08x}"


def _links(rtnl: RtnlSocket):
    for mtype, body in rtnl.dump(link.RTM_GETLINK, link.ifinfomsg()):
        if mtype == link.RTM_NEWLINK:
            yield link.parse_link(body)


def find_link(rtnl: RtnlSocket, name: str) -> Optional[link.Link]:
    for ln in _links(rtnl):
        if ln.name == name:
            return ln
    return None


def ingress_qdisc(rtnl: RtnlSocket, ifindex: int) -> Optional[nl.TcObject]:
    """The interface's clsact or ingress qdisc (both sit at ``ffff:fff1``), or None."""
    for mtype, body in rtnl.dump(RTM_GETQDISC, nl.tcmsg(ifindex)):
        obj = nl.parse_tcmsg(mtype, body)
        if obj.ifindex == ifindex and obj.parent == mirred.TC_H_CLSACT:
            return obj
    return None


def _hook_filters(rtnl: RtnlSocket, ifindex: int, parent: int):
    try:
        for mtype, body in rtnl.dump(RTM_GETTFILTER, nl.tcmsg(ifindex, 0, parent)):
            yield nl.parse_tcmsg(mtype, body)
    except NetlinkError as e:
        if e.errno not in (errno.EINVAL, errno.ENOENT):   # no such hook (no clsact)
            raise


def redirect_targets(rtnl: RtnlSocket, ifindex: int) -> List[int]:
    """Where the rules at our pref on ``ifindex``'s ingress send packets: the ifindex of each
    one's mirred redirect, 0 for one that redirects nowhere (its ifb was deleted: mirred then
    drops every packet) or is not a redirect. Ours is in order when this is [the ifb's]."""
    out = []
    for obj in _hook_filters(rtnl, ifindex, mirred.INGRESS_PARENT):
        if obj.info >> 16 != REDIRECT_PREF:
            continue
        if obj.kind == "u32" and u32.TCA_U32_DIVISOR in obj.options:
            continue            # the u32 instance's own root table, not a rule
        if obj.handle == 0 and obj.kind == "u32" and not obj.options:
            continue            # the instance itself (some kernels dump it)
        out.append(mirred.redirect_target(obj.options, nl.parse_attrs) if obj.kind == "u32"
                   else 0)
    return out


def _redirect_del(ifindex: int, interface: str) -> Request:
    return Request(RTM_DELTFILTER, 0,
                   nl.tcmsg(ifindex, 0, mirred.INGRESS_PARENT,
                            filter_info(REDIRECT_PREF, mirred.ETH_P_ALL)),
                   f"delete the ingress redirect on {interface}")


def remove(rtnl: RtnlSocket, interface: str) -> bool:
    """Remove flowpacer's receive side of ``interface`` (redirect, our clsact if nothing else
    uses it, the ifb and all on it). Only what the ifb's alias says is ours. True if there was
    an ifb of ours."""
    ifb = find_link(rtnl, ifb_name(interface))
    if ifb is None or ifb.kind != "ifb" or not ifb.alias.startswith(ALIAS + interface):
        return False
    try:
        idx = socket.if_nametoindex(interface)
    except OSError:
        idx = 0
    if idx:
        errs = rtnl.transact([_redirect_del(idx, interface)])
        if errs[0] is not None and errs[0].errno not in (errno.ENOENT, errno.EINVAL):
            log.warning("%s", errs[0])
        if ifb.alias.endswith(CLSACT_OURS):
            q = ingress_qdisc(rtnl, idx)
            busy = any(True for p in (mirred.INGRESS_PARENT, mirred.EGRESS_PARENT)
                       for _ in _hook_filters(rtnl, idx, p))
            if q is not None and q.kind == "clsact" and not busy:
                err = rtnl.transact([Request(RTM_DELQDISC, 0,
                                             nl.tcmsg(idx, mirred.CLSACT_HANDLE,
                                                      mirred.TC_H_CLSACT),
                                             f"delete the clsact qdisc on {interface}")])[0]
                if err is not None and err.errno != errno.ENOENT:
                    log.warning("%s", err)
    err = rtnl.transact([Request(link.RTM_DELLINK, 0, link.by_index(ifb.index),
                                 f"delete {ifb.name}")])[0]
    if err is not None and err.errno != errno.ENODEV:
        raise err
    log.info("%s: receive side removed (%s deleted)", interface, ifb.name)
    return True


def cleanup(interface: str) -> bool:
    """``remove`` with a socket of its own (the daemon's start when no rule receives, and
    ``flowpacer cleanup``)."""
    with RtnlSocket() as rtnl:
        return remove(rtnl, interface)


class IngressBackend(TcBackend):
    """A ``TcBackend`` on flowpacer's ifb (side RECEIVE) plus the ifb and the redirect that
    feeds it. Same interface as the send side's backend; ``interface`` is the ifb's name,
    ``parent_interface`` the one whose ingress it shapes."""

    def __init__(self, codec, interface: str, link_rate_bps: Optional[int] = None,
                 rtnl: Optional[RtnlSocket] = None):
        super().__init__(codec, ifb_name(interface), link_rate_bps, take_over=False, rtnl=rtnl,
                         side=Side.RECEIVE, speed_interface=interface)
        self.parent_interface = interface
        self.parent_ifindex = 0
        self._clsact_ours = False    # we made the interface's clsact: kept across a rebuild of
        #                              the ifb (whose alias records it, and goes with it)

    # --------------------------------------------------------------- setup
    def setup(self) -> None:
        """Make or adopt the ifb, its qdisc and classes, then the redirect into it."""
        self.parent_ifindex = ifindex_of(self.parent_interface)
        ifb = self._ensure_ifb()
        super().setup()
        self._ensure_redirect(ifb)

    def _ensure_ifb(self) -> link.Link:
        rt = self._rtnl
        ifb = find_link(rt, self.interface)
        if ifb is not None and (ifb.kind != "ifb"
                                or not ifb.alias.startswith(ALIAS + self.parent_interface)):
            raise BackendError(f"{self.interface} exists and is not flowpacer's ifb for "
                               f"{self.parent_interface} (kind {ifb.kind or '?'}, alias "
                               f"{ifb.alias!r}); remove it or rename it")
        if ifb is None:
            try:
                rt.request(Request(link.RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL,
                                   link.new_ifb(self.interface, IFB_TXQLEN),
                                   f"create ifb {self.interface}"))
            except NetlinkError as e:
                hint = " (is the ifb driver built in or loadable?)" \
                    if e.errno in (errno.EOPNOTSUPP, errno.ENOENT) else ""
                raise BackendError(f"receive side of {self.parent_interface}: {e}{hint}") from None
            ifb = find_link(rt, self.interface)
            if ifb is None:
                raise BackendError(f"{self.interface} vanished right after it was made")
            alias = ALIAS + self.parent_interface
            rt.request(Request(link.RTM_NEWLINK, 0, link.set_alias(ifb.index, alias),
                               f"name {self.interface} as flowpacer's"))
            ifb.alias = alias
            log.info("%s: ifb %s created for the receive side", self.parent_interface,
                     self.interface)
        elif not ifb.up:
            rt.request(Request(link.RTM_NEWLINK, 0, link.set_up(ifb.index),
                               f"set {self.interface} up"))
        self._ifb = ifb
        return ifb

    def _ensure_redirect(self, ifb: link.Link) -> None:
        rt, idx, name = self._rtnl, self.parent_ifindex, self.parent_interface
        if ingress_qdisc(rt, idx) is None:
            rt.request(Request(RTM_NEWQDISC, NLM_F_CREATE | NLM_F_EXCL,
                               nl.tcmsg(idx, mirred.CLSACT_HANDLE, mirred.TC_H_CLSACT)
                               + mirred.clsact_options(), f"create clsact qdisc on {name}"))
            self._clsact_ours = True
        elif ifb.alias.endswith(CLSACT_OURS):
            self._clsact_ours = True         # adopted: a previous run made it
        if self._clsact_ours and not ifb.alias.endswith(CLSACT_OURS):
            # (also when the ifb was deleted behind us and made again: the clsact we made is
            # still there, and must still go at the stop)
            ifb.alias += CLSACT_OURS
            rt.request(Request(link.RTM_NEWLINK, 0, link.set_alias(ifb.index, ifb.alias),
                               f"note on {self.interface} that the clsact is ours"))
        targets = redirect_targets(rt, idx)
        if targets == [ifb.index]:
            return
        if targets:      # a redirect to an ifb deleted or made again (it drops everything), or
            # a second rule at our pref: all of them go, ours is made anew
            err = rt.transact([_redirect_del(idx, name)])[0]
            if err is not None and err.errno != errno.ENOENT:
                raise BackendError(str(err))
        rt.request(Request(RTM_NEWTFILTER, NLM_F_CREATE | NLM_F_EXCL,
                           nl.tcmsg(idx, 0, mirred.INGRESS_PARENT,
                                    filter_info(REDIRECT_PREF, mirred.ETH_P_ALL))
                           + mirred.redirect_all_options(ifb.index),
                           f"redirect the ingress of {name} to {self.interface}"))
        log.info("%s: ingress redirected to %s", name, self.interface)

    # -------------------------------------------------------------- health
    def check(self) -> BackendHealth:
        """GONE when the interface is missing; LOST when it was re-made, or the ifb or the
        redirect into it is gone (rebuilt at once: a redirect to nowhere drops everything);
        else what the ifb's qdisc says (``TcBackend.check``)."""
        try:
            idx = socket.if_nametoindex(self.parent_interface)
        except OSError:
            return BackendHealth.GONE
        if idx != self.parent_ifindex:
            return BackendHealth.LOST
        try:
            ifb_idx = socket.if_nametoindex(self.interface)
        except OSError:
            return BackendHealth.LOST
        try:
            if redirect_targets(self._rtnl, idx) != [ifb_idx]:
                return BackendHealth.LOST
        except NetlinkError:
            return BackendHealth.GONE
        return super().check()

    # ------------------------------------------------------------ teardown
    def teardown(self) -> None:
        try:
            remove(self._rtnl, self.parent_interface)
        except NetlinkError as e:
            log.warning("teardown of the receive side: %s", e)
        self.forget()


def cleanup_all() -> List[str]:
    """Remove what flowpacer made on every interface of this network namespace, with no rules
    file to name it (the unit's ExecStopPost=, ``flowpacer cleanup --all``): first each receive
    side (an ifb whose alias says whose it is, and that interface's redirect), then each root
    qdisc with flowpacer's handle. What was removed, one line per interface."""
    from flowpacer.kernel.backend.tc import QDISC_HANDLE, root_qdisc
    done: List[str] = []
    with RtnlSocket() as rtnl:
        for ln in list(_links(rtnl)):
            if ln.kind == "ifb" and ln.alias.startswith(ALIAS):
                parent = ln.alias[len(ALIAS):].split(";", 1)[0]
                if remove(rtnl, parent):
                    done.append(f"{parent}: receive side ({ln.name}) removed")
        for ln in list(_links(rtnl)):      # a dump at a time on the socket
            root = root_qdisc(rtnl, ln.index)
            if root is None or root.handle != QDISC_HANDLE:
                continue
            err = rtnl.transact([Request(RTM_DELQDISC, 0,
                                         nl.tcmsg(ln.index, QDISC_HANDLE, nl.TC_H_ROOT),
                                         f"delete root qdisc on {ln.name}")])[0]
            if err is not None and err.errno not in (errno.ENOENT, errno.EINVAL, errno.ENODEV):
                raise err
            done.append(f"{ln.name}: flowpacer qdisc removed")
    return done

"""Class statistics of ``TcBackend``: ``ClassCounters``, the kernel's counters read in one class
dump, keyed by what each class shapes (a flow's ``FlowKey`` from ``FlowClasses``, a group's
``GroupKey`` from ``GroupClasses``, the default class); the class ids stay in here. It keeps no
state of its own: it reads the others' books through their methods.
"""
from __future__ import annotations

from typing import Dict, Optional, Set

from flowpacer.model import ClassRole, ClassStats, FlowKey
from flowpacer.kernel.tc import nl
from flowpacer.kernel.tc.nl import RTM_GETTCLASS, RtnlSocket, tc_handle
from flowpacer.kernel.backend.contract import ClassKey
from flowpacer.kernel.backend.handles import DEFAULT_MINOR, MAJOR, less
from flowpacer.kernel.backend.tcchannel import Channel
from flowpacer.kernel.backend.tcflows import FlowClasses
from flowpacer.kernel.backend.tcgroups import GroupClasses


class ClassCounters:
    """The counters of one tc backend's classes."""

    def __init__(self, chan: Channel, flows: FlowClasses, groups: GroupClasses):
        self._chan = chan
        self._flows = flows
        self._groups = groups

    @staticmethod
    def open_channel() -> RtnlSocket:
        """A netlink socket of its own for ``class_stats`` from another thread (the
        reconciler's socket is the backend's, used under the reconciler's lock)."""
        return RtnlSocket()

    def by_class(self, rtnl: Optional[RtnlSocket] = None) -> Dict[int, ClassStats]:
        """{classid: ClassStats} of our classes, read now (``rtnl``: another thread's socket).
        Inside the tc backends only (the audit's list of what the kernel has is ``present``):
        the daemon reads ``class_stats``."""
        out: Dict[int, ClassStats] = {}
        ifindex = self._chan.ifindex
        for mtype, body in (rtnl or self._chan.rtnl).dump(RTM_GETTCLASS, nl.tcmsg(ifindex)):
            obj = nl.parse_tcmsg(mtype, body)
            if obj.ifindex == ifindex and obj.handle >> 16 == MAJOR:
                out[obj.handle] = ClassStats(**nl.parse_stats2(obj))
        return out

    def present(self) -> Set[int]:
        """The class ids of ours the kernel has now (one dump, only the messages' headers read:
        the audit at every reconcile pass needs no counters; at 10 000 classes parsing them
        cost ~20 ms a pass, under the reconciler's lock)."""
        out: Set[int] = set()
        ifindex = self._chan.ifindex
        for _mtype, body in self._chan.rtnl.dump(RTM_GETTCLASS, nl.tcmsg(ifindex)):
            idx, handle = nl.tcmsg_handle(body)
            if idx == ifindex and handle >> 16 == MAJOR:
                out.add(handle)
        return out

    def class_stats(self, channel: Optional[RtnlSocket] = None) -> Dict[ClassKey, ClassStats]:
        """The counters of our classes now, by what they shape: each flow's ``FlowKey``, each
        group's ``GroupKey``, ``ClassRole.DEFAULT``. Safe outside the reconciler's lock with
        a ``channel`` of the caller's own: the books are copied in one step each (under the
        GIL) after the dump."""
        by_class = self.by_class(channel)
        out: Dict[ClassKey, ClassStats] = {}
        default = by_class.get(tc_handle(MAJOR, DEFAULT_MINOR))
        if default is not None:
            out[ClassRole.DEFAULT] = default
        for classid, gk in self._groups.stat_keys():
            st = by_class.get(classid)
            if st is not None:
                out[gk] = st
        for k, v in self._flows.records():
            st = by_class.get(v.classid)
            if st is not None:
                out[k] = less(st, v.base)     # a reused spare: from the flow's start
        return out

    def stats(self) -> Dict[FlowKey, ClassStats]:
        return {k: st for k, st in self.class_stats().items() if isinstance(k, FlowKey)}

    def default_stats(self) -> ClassStats:
        return self.class_stats().get(ClassRole.DEFAULT, ClassStats())

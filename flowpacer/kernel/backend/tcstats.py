"""Class statistics of ``TcBackend``: the kernel's counters read in one class dump, keyed by
what each class shapes (a flow's ``FlowKey``, a group's ``GroupKey``, the default class); the
class ids stay in here.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from flowpacer.model import ClassRole, ClassStats, FlowKey, GroupKey, Shape
from flowpacer.kernel.tc import nl
from flowpacer.kernel.tc.nl import RTM_GETTCLASS, RtnlSocket, tc_handle
from flowpacer.kernel.backend.contract import ClassKey
from flowpacer.kernel.backend.handles import DEFAULT_MINOR, MAJOR, handle_text, less


class ClassCounters:
    """The statistics part of ``TcBackend``."""

    def flows_snapshot(self) -> List[Tuple[FlowKey, str, Shape]]:
        """[(key, handle, shape)] of every installed flow (a copy; ``handle`` for display)."""
        return [(k, handle_text(v.classid), v.shape) for k, v in list(self._flows.items())]

    def open_stats_channel(self) -> RtnlSocket:
        """A netlink socket of its own for ``class_stats`` from another thread (the
        reconciler's socket is the backend's, used under the reconciler's lock)."""
        return RtnlSocket()

    def stats_by_class(self, rtnl: Optional[RtnlSocket] = None) -> Dict[int, ClassStats]:
        """{classid: ClassStats} of our classes, read now (``rtnl``: another thread's socket).
        Inside the tc backends only: the daemon reads ``class_stats``."""
        out: Dict[int, ClassStats] = {}
        for mtype, body in (rtnl or self._rtnl).dump(RTM_GETTCLASS, nl.tcmsg(self.ifindex)):
            obj = nl.parse_tcmsg(mtype, body)
            if obj.ifindex == self.ifindex and obj.handle >> 16 == MAJOR:
                out[obj.handle] = ClassStats(**nl.parse_stats2(obj))
        return out

    def class_stats(self, channel: Optional[RtnlSocket] = None) -> Dict[ClassKey, ClassStats]:
        """The counters of our classes now, by what they shape: each flow's ``FlowKey``, each
        group's ``GroupKey``, ``ClassRole.DEFAULT``. Safe outside the reconciler's lock with
        a ``channel`` of the caller's own: the bookkeeping is copied in one step (under the
        GIL) after the dump."""
        by_class = self.stats_by_class(channel)
        out: Dict[ClassKey, ClassStats] = {}
        default = by_class.get(tc_handle(MAJOR, DEFAULT_MINOR))
        if default is not None:
            out[ClassRole.DEFAULT] = default
        for m, n in list(self._groups.nodes.items()):
            st = by_class.get(tc_handle(MAJOR, m))
            if st is not None:
                out[GroupKey(n.kind, n.gid)] = st
        for k, v in list(self._flows.items()):
            st = by_class.get(v.classid)
            if st is not None:
                out[k] = less(st, v.base)     # a reused spare: from the flow's start
        return out

    def stats(self) -> Dict[FlowKey, ClassStats]:
        return {k: st for k, st in self.class_stats().items() if isinstance(k, FlowKey)}

    def default_stats(self) -> ClassStats:
        return self.class_stats().get(ClassRole.DEFAULT, ClassStats())

"""What every part of ``TcBackend`` needs to talk to the kernel: ``Channel``.

One per backend, made by ``TcBackend`` and handed to each of its components (tcids.py,
tcflows.py, tcgroups.py, tcstats.py, pool.py's netlink side): the netlink socket, the device
(name and ifindex, the latter known at setup), the side, the codec, the link rate (known at
setup, changed by a rebuild) and the builders of the requests they all send. It holds no
bookkeeping of classes or filters: each component keeps its own.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

from flowpacer.errors import NetlinkError
from flowpacer.model import Side
from flowpacer.kernel.tc import nl, u32
from flowpacer.kernel.tc.nl import (NLM_F_CREATE, NLM_F_EXCL, RTM_DELTCLASS, RTM_NEWTCLASS,
                                    Request, RtnlSocket, tc_handle)
from flowpacer.kernel.backend.contract import Codec
from flowpacer.kernel.backend.filters import PRIO, PROTO
from flowpacer.kernel.backend.handles import LINK_MINOR, MAJOR, QDISC_HANDLE


class Channel:
    """The socket, device, side and codec of one tc backend, and its request builders.

    ``flow_parent``: the minor flow, pool and top group classes hang under (the link class of
    htb; None: the qdisc, psp); ``parent_handle``: the same as a handle, for deletes."""

    def __init__(self, codec: Codec, interface: str, side: Side, rtnl: RtnlSocket):
        self.codec = codec
        self.interface = interface
        self.side = side
        self.rtnl = rtnl
        self.ifindex = 0                 # set by TcBackend.setup
        self.link_rate_bps = 0           # set by TcBackend.setup
        self.flow_parent: Optional[int] = LINK_MINOR if codec.has_link_class else None
        self.parent_handle = tc_handle(MAJOR, LINK_MINOR) if codec.has_link_class \
            else QDISC_HANDLE

    def req(self, mtype: int, flags: int, body: bytes, what) -> Request:
        """A request; ``what`` (a string, a callable making one, or a tuple (function, *args))
        names it in error messages, followed by "on" and the device."""
        return Request(mtype, flags, body, what, None, self.interface)

    def class_msg(self, minor: int, parent_minor: Optional[int], options: bytes, create: bool,
                  what) -> Request:
        """Make (``create``) or change class ``minor`` under ``parent_minor`` (None: the
        qdisc)."""
        parent = tc_handle(MAJOR, parent_minor) if parent_minor else QDISC_HANDLE
        flags = NLM_F_CREATE | NLM_F_EXCL if create else 0
        return self.req(RTM_NEWTCLASS, flags,
                        nl.tcmsg(self.ifindex, tc_handle(MAJOR, minor), parent) + options, what)

    def class_del(self, classid: int, what) -> Request:
        """Delete class ``classid`` (a flow, group or pool class: all under ``parent_handle``)."""
        return self.req(RTM_DELTCLASS, 0, nl.tcmsg(self.ifindex, classid, self.parent_handle),
                        what)

    def filter_msg(self, mtype: int, flags: int, family: int, handle: int, options: bytes,
                   what) -> Request:
        """A u32 filter request of ``family``'s instance (its prio and protocol)."""
        info = u32.filter_info(PRIO[family], PROTO[family])
        return self.req(mtype, flags, nl.tcmsg(self.ifindex, handle, QDISC_HANDLE, info) + options,
                        what)

    def transact(self, reqs: Sequence[Request]) -> List[Optional[NetlinkError]]:
        """One batch; an error or None per request, in order (``RtnlSocket.transact``)."""
        return self.rtnl.transact(reqs)

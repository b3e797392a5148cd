"""RTNL link events (issue 29): which devices changed, so that the daemon looks at a shaped
interface's link rate at once rather than at its next reconcile pass.

A netlink socket bound to the ``RTMGRP_LINK`` group gets an RTM_NEWLINK for every change of a
device of the namespace (up/down, carrier, a bond member's state as the bond sees it:
NETDEV_CHANGELOWERSTATE, a bond's failover) and an RTM_DELLINK for one that goes. ``drain``
reads what is queued without blocking and returns the names of the devices concerned; a
receive buffer that overflowed (a burst of events) is reported as ``OVERFLOW``: anything may
have changed. Nothing is sent: the socket only listens (no privilege needed).
"""
from __future__ import annotations

import errno
import socket
from typing import Set

from flowpacer.kernel.tc.link import IFINFOMSG, IFLA_IFNAME, RTM_DELLINK, RTM_NEWLINK
from flowpacer.kernel.tc.nl import messages, parse_attrs

RTMGRP_LINK = 0x1
OVERFLOW = "*"                 # in drain's answer: events were lost, look at everything


def parse(data: bytes) -> Set[str]:
    """The device names of the RTM_NEWLINK/RTM_DELLINK messages in one datagram."""
    out: Set[str] = set()
    for mtype, _flags, _seq, body in messages(data):
        if mtype in (RTM_NEWLINK, RTM_DELLINK):
            name = parse_attrs(body, IFINFOMSG.size).get(IFLA_IFNAME, b"").split(b"\0", 1)[0]
            if name:
                out.add(name.decode(errors="replace"))
    return out


class LinkWatch:
    """Listens to the namespace's link events; ``fileno()`` for a selector, ``drain()``."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_NETLINK,
                                   socket.SOCK_RAW | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK,
                                   socket.NETLINK_ROUTE)
        try:
            self._sock.bind((0, RTMGRP_LINK))
        except OSError:
            self._sock.close()
            raise

    def fileno(self) -> int:
        return self._sock.fileno()

    def drain(self, limit: int = 256) -> Set[str]:
        """The devices that changed since the last call (``OVERFLOW`` among them when events
        were lost); reads at most ``limit`` datagrams."""
        out: Set[str] = set()
        for _ in range(limit):
            try:
                data = self._sock.recv(1 << 16)
            except BlockingIOError:
                break
            except OSError as e:
                if e.errno == errno.ENOBUFS:
                    out.add(OVERFLOW)
                    continue
                raise
            out |= parse(data)
        return out

    def close(self) -> None:
        self._sock.close()

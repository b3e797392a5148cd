"""rtnetlink link messages: the ifb device flowpacer makes for the receive side (issue 17).

``struct ifinfomsg`` (linux/rtnetlink.h) and the few IFLA_* attributes we send or read
(linux/if_link.h). An ifb is made up (IFF_UP in the creation request), with a queue length for
its qdisc's leaves, and marked with an alias that says it is flowpacer's (``ifalias``: read back
to tell our ifb from anyone else's of the same name).
"""
from __future__ import annotations

import socket
import struct
from dataclasses import dataclass
from typing import Optional

from flowpacer.kernel.tc.nl import nla, nla_nested, nla_str, nla_u32, parse_attrs

RTM_NEWLINK, RTM_DELLINK, RTM_GETLINK = 16, 17, 18
IFLA_IFNAME = 3
IFLA_TXQLEN = 13
IFLA_LINKINFO = 18
IFLA_IFALIAS = 20
IFLA_INFO_KIND = 1
IFF_UP = 0x1

# struct ifinfomsg: family, pad, type, index, flags, change
IFINFOMSG = struct.Struct("=BxHiII")


def ifinfomsg(index: int = 0, flags: int = 0, change: int = 0) -> bytes:
    return IFINFOMSG.pack(socket.AF_UNSPEC, 0, index, flags, change)


def new_ifb(name: str, txqlen: int) -> bytes:
    """RTM_NEWLINK body (with NLM_F_CREATE|NLM_F_EXCL): an ifb named ``name``, up."""
    return (ifinfomsg(0, IFF_UP, IFF_UP) + nla_str(IFLA_IFNAME, name)
            + nla_u32(IFLA_TXQLEN, txqlen)
            + nla_nested(IFLA_LINKINFO, nla_str(IFLA_INFO_KIND, "ifb")))


def set_alias(index: int, alias: str) -> bytes:
    """RTM_NEWLINK body (no flags): set the link's alias."""
    return ifinfomsg(index) + nla(IFLA_IFALIAS, alias.encode())


def set_up(index: int) -> bytes:
    return ifinfomsg(index, IFF_UP, IFF_UP)


def by_index(index: int) -> bytes:
    """RTM_DELLINK body."""
    return ifinfomsg(index)


@dataclass
class Link:
    index: int
    name: str
    kind: str
    alias: str
    up: bool


def parse_link(body: bytes) -> Link:
    _fam, _type, index, flags, _change = IFINFOMSG.unpack_from(body, 0)
    attrs = parse_attrs(body, IFINFOMSG.size)
    info = parse_attrs(attrs[IFLA_LINKINFO]) if IFLA_LINKINFO in attrs else {}

    def text(raw: Optional[bytes]) -> str:
        return (raw or b"").rstrip(b"\0").decode(errors="replace")
    return Link(index, text(attrs.get(IFLA_IFNAME)), text(info.get(IFLA_INFO_KIND)),
                text(attrs.get(IFLA_IFALIAS)), bool(flags & IFF_UP))

"""Which interface a flow's packets leave by: RTM_GETROUTE for the remote address from the local
one (issue 29).

One request per flow carries what the kernel's output route lookup uses: destination, source,
the ports and the protocol (so policy routing by ``ip rule ... sport/dport/ipproto`` and by source
address holds), the owner's uid when known (``ip rule uidrange``), the socket's mark
(``RTA_MARK``: ``ip rule fwmark``) and the device the socket is bound to (``RTA_OIF``: a socket
bound with SO_BINDTODEVICE leaves by that device, ``ip rule oif``; one in a VRF is bound to
the VRF's l3mdev device, whose table the kernel then looks in, as ``ip route get ... vrf X``
asks). The mark and the device come from sock_diag (``Flow.mark``, ``Flow.bound_if``). Requests are sent in batches over one raw
rtnetlink socket and the answers matched by sequence number: pyroute2's ``route('get')`` costs
close to a millisecond a call, this about 20 µs, and the reconcile pass re-checks every live
flow.
"""
from __future__ import annotations

import errno
import logging
import socket
import struct
from typing import Dict, Iterable, List, NamedTuple, Optional

from flowpacer.model import FlowKey, Protocol

log = logging.getLogger(__name__)

RTM_NEWROUTE, RTM_GETROUTE = 24, 26
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_REQUEST = 1
RTA_DST, RTA_SRC, RTA_OIF, RTA_MARK = 1, 2, 4, 16
RTA_UID, RTA_IP_PROTO, RTA_SPORT, RTA_DPORT = 25, 27, 28, 29
NLMSG_HDR = struct.Struct("=IHHII")       # len, type, flags, seq, pid
RTMSG = struct.Struct("=BBBBBBBBI")       # family, dst_len, src_len, tos, table, proto, scope,
#                                           type, flags
BATCH = 256                               # requests in flight (the socket's buffer holds them)

_PROTO = {Protocol.TCP: socket.IPPROTO_TCP, Protocol.UDP: socket.IPPROTO_UDP}


class RouteQuery(NamedTuple):
    """One flow's lookup: its tuple, its owner's uid (-1: unknown), its socket's mark and
    the ifindex of the device the socket is bound to (0: none)."""
    key: FlowKey
    uid: int = -1
    mark: int = 0
    oif: int = 0


def _attr(kind: int, payload: bytes) -> bytes:
    n = 4 + len(payload)
    return struct.pack("=HH", n, kind) + payload + b"\0" * ((4 - n % 4) % 4)


def request(key: FlowKey, uid: int, seq: int, mark: int = 0, oif: int = 0) -> bytes:
    """The RTM_GETROUTE message for ``key``'s packets (its addresses are as on the wire: an
    IPv4-mapped IPv6 flow's are IPv4)."""
    w = key                      # FlowKey addresses are as on the wire already
    fam = socket.AF_INET6 if w.remote_addr.version == 6 else socket.AF_INET
    bits = 128 if fam == socket.AF_INET6 else 32
    src = w.local_addr if w.local_addr.version == w.remote_addr.version else None
    if src is not None and src.is_unspecified:     # an unconnected UDP socket's peer
        src = None
    body = RTMSG.pack(fam, bits, bits if src is not None else 0, 0, 0, 0, 0, 0, 0)
    body += _attr(RTA_DST, w.remote_addr.packed)
    if src is not None:
        body += _attr(RTA_SRC, src.packed)
    proto = _PROTO.get(w.protocol)
    if proto is not None:
        body += _attr(RTA_IP_PROTO, struct.pack("=B", proto))
        body += _attr(RTA_SPORT, struct.pack("!H", w.local_port))
        body += _attr(RTA_DPORT, struct.pack("!H", w.remote_port))
    if uid >= 0:
        body += _attr(RTA_UID, struct.pack("=I", uid))
    if mark:
        body += _attr(RTA_MARK, struct.pack("=I", mark & 0xFFFFFFFF))
    if oif > 0:
        body += _attr(RTA_OIF, struct.pack("=I", oif))
    return NLMSG_HDR.pack(NLMSG_HDR.size + len(body), RTM_GETROUTE, NLM_F_REQUEST, seq, 0) + body


def _oif(msg: memoryview) -> int:
    """RTA_OIF of an RTM_NEWROUTE's payload, 0 when it has none."""
    at = RTMSG.size
    while at + 4 <= len(msg):
        n, kind = struct.unpack_from("=HH", msg, at)
        if n < 4:
            break
        if kind == RTA_OIF and n >= 8:
            return struct.unpack_from("=I", msg, at + 4)[0]
        at += (n + 3) & ~3
    return 0


class RouteLookup:
    """``egress(items)``: each flow's output interface index (0: no route, or the lookup
    failed). Not thread-safe: one owner (the reconciler, under its lock, and its pass)."""

    def __init__(self):
        self._sock: Optional[socket.socket] = None
        self._seq = 0
        self.failures = 0            # lookups the kernel refused (no route, ...) so far

    def _socket(self) -> socket.socket:
        if self._sock is None:
            s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC,
                              socket.NETLINK_ROUTE)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            s.bind((0, 0))
            s.settimeout(2.0)
            self._sock = s
        return self._sock

    def egress(self, items: Iterable[RouteQuery]) -> Dict[FlowKey, int]:
        """``items``: each flow's ``RouteQuery``. Raises OSError when the socket fails."""
        out: Dict[FlowKey, int] = {}
        items = list(items)
        for i in range(0, len(items), BATCH):
            out.update(self._batch(items[i:i + BATCH]))
        return out

    def _batch(self, items: List[RouteQuery]) -> Dict[FlowKey, int]:
        s = self._socket()
        pending: Dict[int, FlowKey] = {}
        msgs = []
        for key, uid, mark, oif in items:
            self._seq = (self._seq + 1) & 0xFFFFFFFF or 1
            try:
                msgs.append(request(key, uid, self._seq, mark, oif))
            except (OSError, ValueError) as e:       # an address the kernel cannot take
                log.debug("route of %s: %s", key, e)
                continue
            pending[self._seq] = key
        for m in msgs:
            s.send(m)
        out: Dict[FlowKey, int] = {k: 0 for k in pending.values()}
        try:
            while pending:
                data = memoryview(s.recv(1 << 16))
                at = 0
                while at + NLMSG_HDR.size <= len(data):
                    n, kind, _flags, seq, _pid = NLMSG_HDR.unpack_from(data, at)
                    if n < NLMSG_HDR.size:
                        break
                    key = pending.pop(seq, None)
                    if key is not None:
                        if kind == RTM_NEWROUTE:
                            out[key] = _oif(data[at + NLMSG_HDR.size:at + n])
                        elif kind == NLMSG_ERROR:
                            self.failures += 1
                    at += (n + 3) & ~3
        except socket.timeout:
            log.warning("route lookups: %d answers missing; looked up again next pass",
                        len(pending))
            self.close()         # late answers must not be read as the next batch's
            for key in pending.values():
                out.pop(key, None)
        return out

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def ifname(index: int) -> Optional[str]:
    """The name of interface ``index`` in this namespace (None: gone, or 0)."""
    if index <= 0:
        return None
    try:
        return socket.if_indextoname(index)
    except OSError as e:
        if e.errno not in (errno.ENXIO, errno.ENODEV):
            log.debug("if_indextoname(%d): %s", index, e)
        return None


def link_names() -> List[str]:
    """Every interface of this namespace (for ``interfaces:`` globs)."""
    return [name for _i, name in socket.if_nameindex()]

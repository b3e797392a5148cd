"""Minimal rtnetlink transport for tc objects: batched requests, one ack per batch.

pyroute2 builds a message through its generic ``nla`` machinery (~0.25 ms per htb class here) and
waits for each ack before the next request. The backend installs thousands of classes and filters,
so the hot path packs the few fixed structures itself (see ``htb.py``/``u32.py``, whose encodings are
checked against pyroute2's nla classes and the uapi headers in the tests), sends many requests in
one ``sendmsg`` (only its last request asks for an ack; the kernel answers every refusal anyway)
and matches the answers by sequence number. Every refusal keeps the kernel's extack
text so that it can be shown in a one-line reason.
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
import socket
import struct
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

from flowpacer.errors import NetlinkError

log = logging.getLogger(__name__)

# linux/netlink.h
NLMSG_ERROR = 2
NLMSG_DONE = 3
NLM_F_REQUEST = 0x1
NLM_F_MULTI = 0x2
NLM_F_ACK = 0x4
NLM_F_ECHO = 0x8
NLM_F_DUMP_INTR = 0x10
NLM_F_DUMP = 0x300
NLM_F_REPLACE = 0x100
NLM_F_EXCL = 0x200
NLM_F_CREATE = 0x400
NLM_F_ACK_TLVS = 0x200          # in an NLMSG_ERROR header: extack TLVs follow
NLM_F_CAPPED = 0x100            # in an NLMSG_ERROR header: request not echoed
NLMSGERR_ATTR_MSG = 1
SOL_NETLINK = 270
NETLINK_CAP_ACK = 10
NETLINK_EXT_ACK = 11

# linux/rtnetlink.h
RTM_NEWQDISC, RTM_DELQDISC, RTM_GETQDISC = 36, 37, 38
RTM_NEWTCLASS, RTM_DELTCLASS, RTM_GETTCLASS = 40, 41, 42
RTM_NEWTFILTER, RTM_DELTFILTER, RTM_GETTFILTER = 44, 45, 46

# linux/rtnetlink.h: enum TCA_*
TCA_KIND = 1
TCA_OPTIONS = 2
TCA_STATS = 3
TCA_XSTATS = 4
TCA_RATE = 5
TCA_STATS2 = 7
# linux/gen_stats.h: enum TCA_STATS_*
TCA_STATS_BASIC = 1
TCA_STATS_RATE_EST = 2
TCA_STATS_QUEUE = 3
TCA_STATS_APP = 4
TCA_STATS_RATE_EST64 = 5
TCA_STATS_PKT64 = 8

NLA_F_NESTED = 0x8000
SO_RCVBUFFORCE = 33
RCVBUF_WANT = 4 << 20
ACK_TRUESIZE = 1024
RECV_BYTES = 1 << 20            # the largest datagram read (a longer one is cut, as recv cuts)
NLA_TYPE_MASK = 0x3FFF

_NLMSGHDR = struct.Struct("=IHHII")       # len, type, flags, seq, pid
_TCMSG = struct.Struct("=BBHiIII")        # family, pad1, pad2, ifindex, handle, parent, info
_NLA = struct.Struct("=HH")

TC_H_ROOT = 0xFFFFFFFF
TC_H_UNSPEC = 0


def tc_handle(major: int, minor: int) -> int:
    return ((major & 0xFFFF) << 16) | (minor & 0xFFFF)


def fmt_handle(h: int) -> str:
    return f"{h >> 16:x}:{h & 0xFFFF:x}"


# ------------------------------------------------------------------ attributes

def nla(atype: int, payload: bytes) -> bytes:
    """One netlink attribute, padded to 4 bytes."""
    n = _NLA.size + len(payload)
    return _NLA.pack(n, atype) + payload + b"\0" * ((4 - n % 4) % 4)


def nla_u32(atype: int, value: int) -> bytes:
    return nla(atype, struct.pack("=I", value))


def nla_u64(atype: int, value: int) -> bytes:
    return nla(atype, struct.pack("=Q", value))


def nla_str(atype: int, value: str) -> bytes:
    return nla(atype, value.encode() + b"\0")


def nla_nested(atype: int, *children: bytes) -> bytes:
    return nla(atype | NLA_F_NESTED, b"".join(children))


def parse_attrs(buf: bytes, offset: int = 0, end: Optional[int] = None) -> dict:
    """Attributes of one level as {type: payload bytes} (the last one wins, as in the kernel)."""
    out = {}
    end = len(buf) if end is None else end
    while offset + 4 <= end:
        alen, atype = _NLA.unpack_from(buf, offset)
        if alen < 4 or offset + alen > end:
            break
        out[atype & NLA_TYPE_MASK] = bytes(buf[offset + 4: offset + alen])
        offset += (alen + 3) & ~3
    return out


def tcmsg(ifindex: int, handle: int = 0, parent: int = 0, info: int = 0) -> bytes:
    return _TCMSG.pack(socket.AF_UNSPEC, 0, 0, ifindex, handle, parent, info)


@dataclass
class TcObject:
    """One qdisc, class or filter from a dump."""
    msg_type: int
    ifindex: int
    handle: int
    parent: int
    info: int
    kind: str
    attrs: dict            # top-level TCA_* -> payload

    @property
    def options(self) -> dict:
        raw = self.attrs.get(TCA_OPTIONS)
        return parse_attrs(raw) if raw else {}


def tcmsg_handle(body: bytes) -> Tuple[int, int]:
    """(ifindex, handle) of a tc message, its attributes left unread (a dump's list of ids)."""
    _f, _p1, _p2, ifindex, handle, _parent, _info = _TCMSG.unpack_from(body, 0)
    return ifindex, handle


def parse_tcmsg(msg_type: int, body: bytes) -> TcObject:
    family, _, _, ifindex, handle, parent, info = _TCMSG.unpack_from(body, 0)
    attrs = parse_attrs(body, _TCMSG.size)
    kind = attrs.get(TCA_KIND, b"").rstrip(b"\0").decode(errors="replace")
    return TcObject(msg_type, ifindex, handle, parent, info, kind, attrs)


# ---------------------------------------------------------------------- socket

@dataclass(slots=True)
class Request:
    msg_type: int
    flags: int
    body: bytes
    # what it does, for error messages: "add class f1f0:12 on eth0", or made only on error by
    # a callable, or by a tuple (function, *args) (no closure object per request: the backend
    # sends thousands of them in a burst)
    what: object
    # called with (type, body) of the kernel's echo of the request (the request is sent with
    # NLM_F_ECHO): e.g. a changed class' counters as the change left them
    echo: Optional[Callable[[int, bytes], None]] = None
    where: str = ""      # the device, said after ``what`` ("... on eth0"); "": nothing added

    def describe(self) -> str:
        w = self.what
        if type(w) is tuple:
            text = w[0](*w[1:])
        else:
            text = w() if callable(w) else str(w)
        return f"{text} on {self.where}" if self.where else text


class RtnlSocket:
    """A netlink socket (NETLINK_ROUTE unless told) that sends batches and reports each
    request's outcome, and runs dumps."""

    BATCH_BYTES = 48 * 1024

    def __init__(self, protocol: int = socket.NETLINK_ROUTE) -> None:
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC,
                                   protocol)
        # SO_RCVBUF is capped by net.core.rmem_max (208 KiB on a stock Debian); as root,
        # SO_RCVBUFFORCE is not. Whatever we get decides how many acks may be in flight.
        for opt in (SO_RCVBUFFORCE, socket.SO_RCVBUF):
            try:
                self._sock.setsockopt(socket.SOL_SOCKET, opt, RCVBUF_WANT)
                break
            except OSError:
                continue
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        rcvbuf = self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        # each ack is charged at its skb's truesize (well under 1 KiB); keep half the buffer free
        self.max_in_flight = max(16, rcvbuf // 2 // ACK_TRUESIZE)
        for opt in (NETLINK_EXT_ACK, NETLINK_CAP_ACK):
            try:
                self._sock.setsockopt(SOL_NETLINK, opt, 1)
            except OSError:  # old kernels: no extack, full echo; both still parse
                pass
        self._sock.bind((0, 0))
        self._seq = int.from_bytes(os.urandom(2), "little") << 8
        self._buf: Optional[mmap.mmap] = None       # what _recv reads into

    def close(self) -> None:
        self._sock.close()
        if self._buf is not None:
            self._buf.close()
            self._buf = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _next_seq(self) -> int:
        self._seq = (self._seq + 1) & 0x7FFFFFFF or 1
        return self._seq

    def transact(self, requests: Sequence[Request]) -> List[Optional[NetlinkError]]:
        """Send every request; return None or the NetlinkError for each, in order.

        Only the last request of each sendmsg asks for an ack: the kernel answers a refused
        request with its error whether it was asked to or not, and handles one sendmsg's
        requests in order before it returns, so the last one's ack comes after every error
        of the chunk. A chunk holds at most ``max_in_flight`` requests, so that even a chunk
        refused whole fits in the receive buffer."""
        results: List[Optional[NetlinkError]] = [None] * len(requests)
        pack = _NLMSGHDR.pack
        hdr = _NLMSGHDR.size
        n = len(requests)
        i = 0
        while i < n:
            first = i
            index = {}                   # seq -> request index
            parts = []
            size = 0
            answers = 0                  # messages the chunk may get back (errors, echoes)
            while True:
                r = requests[i]
                body = r.body
                size += hdr + len(body)
                i += 1
                answers += 2 if r.echo is not None else 1
                last_of_chunk = (i == n or size >= self.BATCH_BYTES
                                 or answers >= self.max_in_flight)
                seq = self._next_seq()
                index[seq] = i - 1
                flags = r.flags | NLM_F_REQUEST | (NLM_F_ACK if last_of_chunk else 0)
                if r.echo is not None:
                    flags |= NLM_F_ECHO
                parts.append(pack(hdr + len(body), r.msg_type, flags, seq, 0))
                parts.append(body)
                if last_of_chunk:
                    break
            last = seq
            self._sock.sendall(b"".join(parts))
            done = False
            while not done:
                for mtype, flags, seq, payload in self._recv():
                    idx = index.get(seq)
                    if idx is None:
                        continue
                    if mtype != NLMSG_ERROR:
                        echo = requests[idx].echo
                        if echo is not None:
                            echo(mtype, payload)
                        continue
                    err, extack = _parse_error(flags, payload)
                    if err:
                        results[idx] = NetlinkError(requests[idx].describe(), err, extack)
                    if seq == last:
                        done = True
        return results

    def request(self, req: Request) -> None:
        """One request; raises NetlinkError on refusal."""
        err = self.transact([req])[0]
        if err is not None:
            raise err

    def dump(self, msg_type: int, body: bytes) -> Iterator[Tuple[int, bytes]]:
        """Yield (type, body) of every message of a dump request."""
        seq = self._next_seq()
        hsize = _NLMSGHDR.size
        self._sock.sendall(_NLMSGHDR.pack(hsize + len(body), msg_type,
                                          NLM_F_REQUEST | NLM_F_DUMP, seq, 0) + body)
        header = _NLMSGHDR.unpack_from
        while True:
            # the datagram's messages read here, not through ``_recv``/``messages``: a dump
            # of 10 000 sockets or classes (each reconcile pass) is that many messages, and
            # two generators less a message is a tenth of its cost
            data = self._recv_datagram()
            off, end = 0, len(data)
            while off + hsize <= end:
                mlen, mtype, flags, mseq, _pid = header(data, off)
                if mlen < hsize:
                    break
                if mseq == seq:
                    if mtype == NLMSG_DONE:
                        return
                    if mtype == NLMSG_ERROR:
                        err, extack = _parse_error(flags, data[off + hsize:off + mlen])
                        if err:
                            raise NetlinkError("dump", err, extack)
                        return
                    yield mtype, data[off + hsize:off + mlen]
                off += (mlen + 3) & ~3

    def _recv(self):
        """The messages of the next datagram (``messages``)."""
        yield from messages(self._recv_datagram())

    def _recv_datagram(self) -> bytes:
        """The next datagram (one of up to RECV_BYTES). Read into a buffer of the socket's
        own, made at the first read: ``recv(1 << 20)`` allocated a megabyte for each datagram
        (an mmap, shrunk to the datagram after, with the GIL held), and a burst's echoed class
        changes come one datagram each (issue 26's profile: ~40 us a new flow). An anonymous
        mapping: only the pages the largest datagram so far touched are memory."""
        buf = self._buf
        if buf is None:
            buf = self._buf = mmap.mmap(-1, RECV_BYTES)
        try:
            n = self._sock.recv_into(buf)
        except OSError as e:
            if e.errno == errno.ENOBUFS:
                raise NetlinkError("netlink receive", errno.ENOBUFS,
                                   "socket receive buffer overrun") from None
            raise
        return buf[:n]


def messages(data: bytes) -> Iterator[Tuple[int, int, int, bytes]]:
    """The netlink messages of one datagram: (type, flags, seq, payload after the header)."""
    off = 0
    while off + _NLMSGHDR.size <= len(data):
        mlen, mtype, flags, seq, _pid = _NLMSGHDR.unpack_from(data, off)
        if mlen < _NLMSGHDR.size:
            break
        yield mtype, flags, seq, data[off + _NLMSGHDR.size: off + mlen]
        off += (mlen + 3) & ~3


def _parse_error(flags: int, payload: bytes) -> Tuple[int, Optional[str]]:
    (err,) = struct.unpack_from("=i", payload, 0)
    extack = None
    if err and flags & NLM_F_ACK_TLVS:
        # struct nlmsgerr: int error; struct nlmsghdr msg (+ the request unless capped)
        inner_len = _NLMSGHDR.unpack_from(payload, 4)[0]
        tlv_off = 4 + (_NLMSGHDR.size if flags & NLM_F_CAPPED else inner_len)
        tlv_off = (tlv_off + 3) & ~3
        msg = parse_attrs(payload, tlv_off).get(NLMSGERR_ATTR_MSG)
        if msg:
            extack = msg.rstrip(b"\0").decode(errors="replace")
    return -err, extack


# ------------------------------------------------------------------------- stats

_BASIC = struct.Struct("=QI")
_QUEUE = struct.Struct("=IIIII")       # qlen, backlog, drops, requeues, overlimits
_RATE_EST = struct.Struct("=II")
_RATE_EST64 = struct.Struct("=QQ")


def parse_stats2(obj: TcObject) -> dict:
    """bytes, packets, drops, overlimits, backlog_bytes, qlen, rate_est_bps from TCA_STATS2."""
    raw = obj.attrs.get(TCA_STATS2)
    out = dict(bytes=0, packets=0, drops=0, overlimits=0, backlog_bytes=0, qlen=0, rate_est_bps=0)
    if not raw:
        return out
    st = parse_attrs(raw)
    if TCA_STATS_BASIC in st:
        out["bytes"], out["packets"] = _BASIC.unpack_from(st[TCA_STATS_BASIC])
    if TCA_STATS_PKT64 in st:
        (out["packets"],) = struct.unpack_from("=Q", st[TCA_STATS_PKT64])
    if TCA_STATS_QUEUE in st:
        qlen, backlog, drops, _req, over = _QUEUE.unpack_from(st[TCA_STATS_QUEUE])
        out.update(qlen=qlen, backlog_bytes=backlog, drops=drops, overlimits=over)
    if TCA_STATS_RATE_EST64 in st:
        out["rate_est_bps"] = _RATE_EST64.unpack_from(st[TCA_STATS_RATE_EST64])[0]
    elif TCA_STATS_RATE_EST in st:
        out["rate_est_bps"] = _RATE_EST.unpack_from(st[TCA_STATS_RATE_EST])[0]
    return out

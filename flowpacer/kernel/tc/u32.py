"""u32 filters with hash tables: divisor tables, link nodes and exact 4-tuple leaves.

pyroute2 0.9.7 can only add plain u32 keys (no TCA_U32_DIVISOR/LINK/HASH, no hash selector) and
decodes dumped keys 4 bytes off. This module is the whole u32 encoding we use: fast packers for
the hot path, a parser for dumps, and a pyroute2 plugin (``options`` with the same ``nla_map`` as
``linux/pkt_cls.h``) so that ``IPRoute.tc(..., 'u32', ...)`` and its dumps agree with ours once
``flowpacer.kernel.tc.register()`` has run.

How the kernel walks it (net/sched/cls_u32.c): a knode whose keys all match either returns its
class (TC_U32_TERMINAL) or, if it links to a table, descends into bucket
``(ntohl(word at hoff) & hmask) >> ffs(hmask)-1`` of that table (masked by divisor-1).
"""
from __future__ import annotations

import ipaddress
import socket
import struct
from dataclasses import dataclass
from typing import List, Optional, Tuple

from pyroute2.netlink import nla as _nla
from pyroute2.netlink.rtnl.tcmsg import cls_u32 as _pyroute2_u32

from flowpacer.kernel.tc.nl import TCA_KIND, TCA_OPTIONS, nla, nla_nested, nla_str, nla_u32

# enum TCA_U32_* (linux/pkt_cls.h)
TCA_U32_CLASSID = 1
TCA_U32_HASH = 2
TCA_U32_LINK = 3
TCA_U32_DIVISOR = 4
TCA_U32_SEL = 5
TCA_U32_FLAGS = 11
# struct tc_u32_sel.flags
TC_U32_TERMINAL = 1
TC_U32_OFFSET = 2
TC_U32_VAROFFSET = 4
TC_U32_EAT = 8

ETH_P_IP = 0x0800
ETH_P_IPV6 = 0x86DD

# struct tc_u32_sel: flags, offshift, nkeys, (pad), __be16 offmask, u16 off, s16 offoff,
#                    s16 hoff, __be32 hmask; then struct tc_u32_key keys[nkeys]
SEL_HEAD = struct.Struct("=BBBx2sHhh4s")
# struct tc_u32_key: __be32 mask, __be32 val, int off, int offmask
KEY = struct.Struct(">II") , struct.Struct("=ii")
KEY_SIZE = 16

Key = Tuple[int, int, int]      # (offset, mask, value), mask/value in host order


def htid_handle(htid: int, bucket: int = 0, node: int = 0) -> int:
    """u32 handle ``htid:bucket:node`` (12:8:12 bits)."""
    return ((htid & 0xFFF) << 20) | ((bucket & 0xFF) << 12) | (node & 0xFFF)


def split_handle(handle: int) -> Tuple[int, int, int]:
    return handle >> 20, (handle >> 12) & 0xFF, handle & 0xFFF


def filter_info(prio: int, protocol: int) -> int:
    """tcm_info: priority in the high half, protocol (network order) in the low half."""
    return ((prio & 0xFFFF) << 16) | socket.htons(protocol)


def pack_sel(keys: List[Key], flags: int = 0, hoff: int = 0, hmask: int = 0) -> bytes:
    head = SEL_HEAD.pack(flags, 0, len(keys), b"\0\0", 0, 0, hoff, struct.pack(">I", hmask))
    return head + b"".join(KEY[0].pack(m, v) + KEY[1].pack(off, 0) for off, m, v in keys)


def unpack_sel(raw: bytes) -> Tuple[int, int, int, List[Key]]:
    """(flags, hoff, hmask, keys) from a TCA_U32_SEL payload."""
    flags, _offshift, nkeys, _offmask, _off, _offoff, hoff, hmask = SEL_HEAD.unpack_from(raw)
    keys = []
    for i in range(nkeys):
        o = SEL_HEAD.size + i * KEY_SIZE
        if o + KEY_SIZE > len(raw):
            break
        m, v = KEY[0].unpack_from(raw, o)
        off, _offmask = KEY[1].unpack_from(raw, o + 8)
        keys.append((off, m, v))
    return flags, hoff, struct.unpack(">I", hmask)[0], keys


# ------------------------------------------------------------------ messages

def table_options(htid: int, divisor: int) -> bytes:
    """A hash table ``htid:`` with ``divisor`` buckets (power of two, <= 256)."""
    return nla_str(TCA_KIND, "u32") + nla_nested(TCA_OPTIONS, nla_u32(TCA_U32_DIVISOR, divisor))


def link_options(link_htid: int, keys: List[Key], hoff: int, hmask: int,
                 in_table: Optional[int] = None) -> bytes:
    """A node that, when ``keys`` match, hashes the word at ``hoff`` into table ``link_htid``.

    ``in_table`` is the full ``htid:bucket:`` the node goes into (None: the filter's root table).
    """
    opts = [nla_u32(TCA_U32_LINK, htid_handle(link_htid)),
            nla(TCA_U32_SEL, pack_sel(keys, 0, hoff, hmask))]
    if in_table is not None:
        opts.insert(0, nla_u32(TCA_U32_HASH, in_table))
    return nla_str(TCA_KIND, "u32") + nla_nested(TCA_OPTIONS, *opts)


def leaf_options(classid: int, keys: List[Key], in_table: int) -> bytes:
    """A terminal node: when every key matches, the packet goes to ``classid``."""
    return nla_str(TCA_KIND, "u32") + nla_nested(
        TCA_OPTIONS,
        nla_u32(TCA_U32_HASH, in_table),
        nla_u32(TCA_U32_CLASSID, classid),
        nla(TCA_U32_SEL, pack_sel(keys, TC_U32_TERMINAL)))


_KIND_ONLY = nla_str(TCA_KIND, "u32")


def kind_only() -> bytes:
    return _KIND_ONLY


# ------------------------------------------------------------ flow 4-tuples

# IPv4 without options: ports word at 20. IPv6 without extension headers: ports word at 40.
V4_PORTS_OFF = 20
V6_PORTS_OFF = 40


IPPROTO_TCP = 6
IPPROTO_UDP = 17


def v4_guard(proto: int = IPPROTO_TCP) -> List[Key]:
    """Version 4, IHL 5, protocol ``proto``: the only packets whose ports sit at offset 20."""
    return [(0, 0xFF000000, 0x45000000), (8, 0x00FF0000, (proto & 0xFF) << 16)]


def v6_guard(proto: int = IPPROTO_TCP) -> List[Key]:
    """Version 6 and next header ``proto`` (no extension headers)."""
    return [(0, 0xF0000000, 0x60000000), (4, 0x0000FF00, (proto & 0xFF) << 8)]


def v4_tcp_guard() -> List[Key]:
    return v4_guard(IPPROTO_TCP)


def v6_tcp_guard() -> List[Key]:
    return v6_guard(IPPROTO_TCP)


# where the protocol byte is (the guard's second key): (offset, mask, shift)
PROTO_KEY = {4: (8, 0x00FF0000, 16), 6: (4, 0x0000FF00, 8)}


def _addr_words(addr: ipaddress._BaseAddress) -> List[int]:
    raw = addr.packed
    return [int.from_bytes(raw[i:i + 4], "big") for i in range(0, len(raw), 4)]


def flow_keys(local_addr, local_port: int, remote_addr, remote_port: int,
              proto: int = IPPROTO_TCP) -> List[Key]:
    """Exact keys for a packet's 4-tuple (source = ``local``, destination = ``remote``: the flow
    itself on egress, its reversed tuple on the receive side's ifb) and the IP protocol: a TCP
    leaf never catches a UDP flow of the same addresses and ports. An unspecified address (an
    unconnected UDP socket bound to the wildcard: the source on egress, the destination when
    reversed) is left out: such a leaf matches the ports and the other address only."""
    ports = (local_port << 16) | remote_port
    fam = local_addr.version
    src_off, dst_off, ports_off = (12, 16, V4_PORTS_OFF) if fam == 4 else (8, 24, V6_PORTS_OFF)
    off, mask, shift = PROTO_KEY[fam]
    keys = [(off, mask, (proto & 0xFF) << shift)]
    for base, addr in ((src_off, local_addr), (dst_off, remote_addr)):
        if not addr.is_unspecified:
            keys += [(base + 4 * i, 0xFFFFFFFF, w) for i, w in enumerate(_addr_words(addr))]
    keys.append((ports_off, 0xFFFFFFFF, ports))
    return keys


# flow_leaf_options' pieces: (offset) -> key offset + offmask bytes, per (family, protocol) the
# protocol key, per family the attribute headers around the keys (their count is fixed)
_OFF = {o: KEY[1].pack(o, 0) for o in range(0, 64, 4)}
_EXACT = b"\xff\xff\xff\xff"
_U32 = struct.Struct("=I")
_NLA_HDR = struct.Struct("=HH")
_LEAF_PIECES = {}


def _leaf_pieces(fam: int, proto: int):
    pieces = _LEAF_PIECES.get((fam, proto))
    if pieces is None:
        nkeys = 1 + (2 if fam == 4 else 8) + 1
        sel_len = SEL_HEAD.size + nkeys * KEY_SIZE
        inner_len = 8 + 8 + 4 + sel_len
        off, mask, shift = PROTO_KEY[fam]
        kind = nla_str(TCA_KIND, "u32")
        head = (kind + _NLA_HDR.pack(4 + inner_len, TCA_OPTIONS | 0x8000)
                + _NLA_HDR.pack(8, TCA_U32_HASH))
        mid = _NLA_HDR.pack(8, TCA_U32_CLASSID)
        sel = (_NLA_HDR.pack(4 + sel_len, TCA_U32_SEL)
               + SEL_HEAD.pack(TC_U32_TERMINAL, 0, nkeys, b"\0\0", 0, 0, 0, b"\0\0\0\0")
               + KEY[0].pack(mask, (proto & 0xFF) << shift) + KEY[1].pack(off, 0))
        pieces = _LEAF_PIECES[(fam, proto)] = (head, mid, sel)
    return pieces


def flow_leaf_options(classid: int, in_table: int, local_addr, local_port: int, remote_addr,
                      remote_port: int, proto: int = IPPROTO_TCP) -> bytes:
    """``leaf_options(classid, flow_keys(...), in_table)``, the same bytes packed from
    prebuilt pieces (the daemon makes one per new flow)."""
    if local_addr.is_unspecified or remote_addr.is_unspecified:
        return leaf_options(classid, flow_keys(local_addr, local_port, remote_addr, remote_port,
                                               proto), in_table)
    fam = local_addr.version
    head, mid, sel = _leaf_pieces(fam, proto)
    la, ra = local_addr.packed, remote_addr.packed
    ports = _EXACT + struct.pack(">HH", local_port, remote_port)
    if fam == 4:
        return b"".join((head, _U32.pack(in_table), mid, _U32.pack(classid), sel,
                         _EXACT, la, _OFF[12], _EXACT, ra, _OFF[16], ports, _OFF[20]))
    return b"".join((head, _U32.pack(in_table), mid, _U32.pack(classid), sel,
                     _EXACT, la[0:4], _OFF[8], _EXACT, la[4:8], _OFF[12],
                     _EXACT, la[8:12], _OFF[16], _EXACT, la[12:16], _OFF[20],
                     _EXACT, ra[0:4], _OFF[24], _EXACT, ra[4:8], _OFF[28],
                     _EXACT, ra[8:12], _OFF[32], _EXACT, ra[12:16], _OFF[36],
                     ports, _OFF[40]))


def keys_to_tuple(keys: List[Key]):
    """Inverse of ``flow_keys``: (local_addr, local_port, remote_addr, remote_port, proto), or
    None for keys ``flow_keys`` does not make (a leaf of an older layout without the protocol
    key is None too: the backend deletes it and the flow gets a new one). A left-out address
    comes back unspecified."""
    exact = {off: v for off, m, v in keys if m == 0xFFFFFFFF}
    if len(exact) != len(keys) - 1:
        return None
    for fam in (4, 6):
        off, mask, shift = PROTO_KEY[fam]
        proto = [v for o, m, v in keys if o == off and m == mask]
        if len(proto) != 1:
            continue
        proto = (proto[0] >> shift) & 0xFF
        words = 1 if fam == 4 else 4
        src_off, dst_off, ports_off = (12, 16, V4_PORTS_OFF) if fam == 4 \
            else (8, 24, V6_PORTS_OFF)
        src = set(range(src_off, src_off + 4 * words, 4))
        dst = set(range(dst_off, dst_off + 4 * words, 4))
        have = set(exact) - {ports_off}
        if ports_off not in exact or have not in (src | dst, src, dst):
            return None
        addr_cls = ipaddress.IPv4Address if fam == 4 else ipaddress.IPv6Address

        def addr(offs):
            if not offs <= have:
                return addr_cls(0)
            return addr_cls(b"".join(exact[o].to_bytes(4, "big") for o in sorted(offs)))
        ports = exact[ports_off]
        return addr(src), ports >> 16, addr(dst), ports & 0xFFFF, proto
    return None


# --------------------------------------------------------- pyroute2 plugin
# Decoding only: with ``flowpacer.kernel.tc.register()`` pyroute2's dumps of our filters show hash tables,
# links and correctly placed keys. Requests go through the packers above.

class options(_nla):
    """TCA_OPTIONS of a u32 filter; ``nla_map`` mirrors enum TCA_U32_* in linux/pkt_cls.h."""
    nla_map = (
        ("TCA_U32_UNSPEC", "none"),
        ("TCA_U32_CLASSID", "uint32"),
        ("TCA_U32_HASH", "uint32"),
        ("TCA_U32_LINK", "uint32"),
        ("TCA_U32_DIVISOR", "uint32"),
        ("TCA_U32_SEL", "u32_sel"),
        ("TCA_U32_POLICE", "hex"),
        ("TCA_U32_ACT", "hex"),
        ("TCA_U32_INDEV", "asciiz"),
        ("TCA_U32_PCNT", "hex"),
        ("TCA_U32_MARK", "hex"),
        ("TCA_U32_FLAGS", "uint32"),
        ("TCA_U32_PAD", "hex"),
    )

    class u32_sel(_nla):
        """struct tc_u32_sel and its keys, decoded as flags, hoff, hmask, [(off, mask, value)]."""

        def decode(self):
            _nla.decode(self)
            raw = bytes(self.data[self.offset + 4: self.offset + self.length])
            self["flags"], self["hoff"], self["hmask"], self["keys"] = unpack_sel(raw)


def get_parameters(kwarg):
    return _pyroute2_u32.get_parameters(kwarg)


# pyroute2's request hook under the name the installed version calls: fix_request (>= 0.9) or
# fix_msg (0.7/0.8; Debian 12 ships python3-pyroute2 0.7.2, Debian 13 0.7.7).
if hasattr(_pyroute2_u32, "fix_request"):
    fix_request = _pyroute2_u32.fix_request
else:
    fix_msg = _pyroute2_u32.fix_msg

"""How far ahead of its rate a flow's first bytes arrived, from a capture at the receiver.

``HeadCapture(tb, port)`` opens an AF_PACKET socket on the client's veth (in the client
namespace) with a classic BPF filter for TCP segments *from* the server's ``port`` (IPv4 and
IPv6) and kernel receive timestamps, so a busy reader does not blur the timing. After a flow has
been read, ``ahead_bytes(client_port, rate_bps)`` answers

    max over the flow's data packets i of  B_i - rate_bps * (t_i - t_0)

where ``B_i`` is the payload up to and including packet i and ``t_0`` the first data packet's
arrival: the bytes that came faster than the rate (a token bucket's burst). A flow paced from
its first byte scores its class's burst plus one packet; one whose head left unshaped scores
that head.
"""
from __future__ import annotations

import socket
import struct
from typing import Dict, List, Tuple

from harness.testbed import in_netns

ETH_P_ALL = 0x0003
SO_TIMESTAMPNS = 35
SO_ATTACH_FILTER = 26
SNAP = 128

# classic BPF opcodes
_LD_H_ABS, _LD_B_ABS, _LDX_B_MSH, _LD_H_IND = 0x28, 0x30, 0xB1, 0x48
_JEQ, _JSET, _RET = 0x15, 0x45, 0x06


def _filter(port: int, off: int = 0) -> bytes:
    """tcp and src port ``port`` (``off`` 2: dst port) (IPv4 without fragments, IPv6 with TCP as
    next header)."""
    ins = [
        (_LD_H_ABS, 0, 0, 12),           # 0 ethertype
        (_JEQ, 0, 7, 0x0800),            # 1 IPv4? else -> 9
        (_LD_B_ABS, 0, 0, 23),           # 2 protocol
        (_JEQ, 0, 11, 6),                # 3 TCP? else -> 15 drop
        (_LD_H_ABS, 0, 0, 20),           # 4 flags + fragment offset
        (_JSET, 9, 0, 0x1FFF),           # 5 a fragment -> 15 drop
        (_LDX_B_MSH, 0, 0, 14),          # 6 X = 4 * IHL
        (_LD_H_IND, 0, 0, 14 + off),     # 7 A = TCP source (destination) port
        (_JEQ, 5, 6, port),              # 8 ours -> 14 accept, else -> 15 drop
        (_JEQ, 0, 5, 0x86DD),            # 9 IPv6? else -> 15 drop
        (_LD_B_ABS, 0, 0, 20),           # 10 next header
        (_JEQ, 0, 3, 6),                 # 11 TCP? else -> 15 drop
        (_LD_H_ABS, 0, 0, 54 + off),     # 12 TCP source (destination) port
        (_JEQ, 0, 1, port),              # 13 ours -> 14, else -> 15
        (_RET, 0, 0, SNAP),              # 14 accept (headers only)
        (_RET, 0, 0, 0),                 # 15 drop
    ]
    return b"".join(struct.pack("HBBI", *i) for i in ins)


def _parse(frame: bytes, off: int = 2):
    """(port at ``off`` in the TCP header, payload bytes, sequence number) of a captured frame, or
    None."""
    et = struct.unpack_from("!H", frame, 12)[0]
    if et == 0x0800:
        ihl = (frame[14] & 0xF) * 4
        total = struct.unpack_from("!H", frame, 16)[0]
        tcp = 14 + ihl
        ip_len = total - ihl
    elif et == 0x86DD:
        ip_len = struct.unpack_from("!H", frame, 18)[0]
        tcp = 54
    else:
        return None
    if len(frame) < tcp + 13:
        return None
    other = struct.unpack_from("!H", frame, tcp + off)[0]
    doff = (frame[tcp + 12] >> 4) * 4
    seq = struct.unpack_from("!I", frame, tcp + 4)[0]
    return other, ip_len - doff, seq


def _cover(ranges: List[List[int]], a: int, b: int) -> int:
    """Adds [a, b) to ``ranges`` (sorted, disjoint [start, end) pairs, merged in place); the
    bytes of it that no range held before."""
    new, lo, hi = b - a, a, b
    keep = []
    for r in ranges:
        if r[1] < a or r[0] > b:        # apart (touching ranges merge)
            keep.append(r)
            continue
        new -= max(0, min(b, r[1]) - max(a, r[0]))
        lo, hi = min(lo, r[0]), max(hi, r[1])
    keep.append([lo, hi])
    keep.sort()
    ranges[:] = keep
    return new


class HeadCapture:
    """Packets from the server's ``port`` (``side="src"``: flows the server accepted) or to the
    client's ``port`` (``side="dst"``: flows the server opened), keyed by the other port."""

    def __init__(self, tb, port: int, side: str = "src"):
        if side not in ("src", "dst"):
            raise ValueError(f"side must be src or dst, not {side!r}")
        self._off = 0 if side == "src" else 2
        with in_netns(tb.client_ns):
            s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 20)
            prog = _filter(port, self._off)
            import ctypes
            buf = ctypes.create_string_buffer(prog)
            fprog = struct.pack("HL", len(prog) // 8, ctypes.addressof(buf))
            s.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)
            self._keep = buf
            s.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
            with in_netns(tb.client_ns):
                s.bind((tb.client_if, ETH_P_ALL))
            s.setblocking(False)
        except BaseException:
            s.close()
            raise
        self.sock = s
        # other port -> [(t_ns, new payload bytes)]: a retransmission counts only the bytes no
        # earlier segment carried, so "seen" is the flow's payload and never more; a segment
        # that fills a hole (a loss repaired, a reordering) counts what it brings
        self.packets: Dict[int, List[Tuple[int, int]]] = {}
        # other port -> (first seq, the byte ranges seen, from it: sorted, disjoint, merged)
        self._seq: Dict[int, Tuple[int, List[List[int]]]] = {}

    def drops(self) -> int:
        """Frames the kernel dropped from this capture since the last call (PACKET_STATISTICS'
        tp_drops, reset by reading): a head measured with drops is not the flow's."""
        from harness.pacing import PACKET_STATISTICS, SOL_PACKET
        return struct.unpack("II", self.sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8))[1]

    def drain(self) -> None:
        while True:
            try:
                data, anc, _flags, addr = self.sock.recvmsg(SNAP, 64)
            except BlockingIOError:
                return
            if addr[2] == socket.PACKET_OUTGOING:
                continue
            t_ns = 0
            for level, kind, raw in anc:
                if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                    sec, nsec = struct.unpack_from("qq", raw)
                    t_ns = sec * 1_000_000_000 + nsec
            p = _parse(data, 2 - self._off)
            if p is None or p[1] <= 0:
                continue
            other, n, seq = p
            first, seen = self._seq.setdefault(other, (seq, []))
            start = (seq - first) & 0xFFFFFFFF
            if start > 0x7FFFFFFF:              # before the first segment seen
                continue
            new = _cover(seen, start, start + n)
            if new > 0:
                self.packets.setdefault(other, []).append((t_ns, new))

    def ahead_bytes(self, other_port: int, rate_bps: float) -> Tuple[int, int]:
        """(bytes ahead of the rate line, payload bytes seen) of the flow whose other port is
        ``other_port`` (the client's for side src, the server's for side dst)."""
        self.drain()
        pk = sorted(self.packets.pop(other_port, []))
        self._seq.pop(other_port, None)
        if not pk:
            return 0, 0
        t0 = pk[0][0]
        total = 0
        ahead = 0.0
        for t, n in pk:
            total += n
            ahead = max(ahead, total - rate_bps * (t - t0) / 1e9)
        return int(ahead), total

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "HeadCapture":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

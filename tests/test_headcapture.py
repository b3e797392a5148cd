"""The receiver-side capture that the first-byte tests measure with: a retransmitted segment is
the same payload again and must not be counted twice (CI once saw 263 572 of 262 144 bytes),
and a segment that fills a hole counts what it brings (rehearsal ci38 saw 1 047 148 of
1 048 576: one lost segment's repair was taken for a retransmission)."""
import socket
import struct

from harness.headcapture import HeadCapture, _parse


def _frame4(sport: int, dport: int, seq: int, payload: int) -> bytes:
    eth = b"\0" * 12 + struct.pack("!H", 0x0800)
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + 20 + payload, 0, 0, 64, 6, 0,
                     bytes(4), bytes(4))
    tcp = struct.pack("!HHIIBBHHH", sport, dport, seq, 0, 5 << 4, 0x10, 0, 0, 0)
    return eth + ip + tcp


def _frame6(sport: int, dport: int, seq: int, payload: int) -> bytes:
    eth = b"\0" * 12 + struct.pack("!H", 0x86DD)
    ip = struct.pack("!IHBB16s16s", 6 << 28, 20 + payload, 6, 64, bytes(16), bytes(16))
    tcp = struct.pack("!HHIIBBHHH", sport, dport, seq, 0, 5 << 4, 0x10, 0, 0, 0)
    return eth + ip + tcp


class _Sock:
    """recvmsg() of captured frames, then BlockingIOError like the real non-blocking socket."""

    def __init__(self, frames):
        self.frames = list(frames)

    def recvmsg(self, *_a):
        if not self.frames:
            raise BlockingIOError
        t_ns, frame = self.frames.pop(0)
        anc = [(socket.SOL_SOCKET, 35, struct.pack("qq", t_ns // 10**9, t_ns % 10**9))]
        return frame, anc, 0, ("veth", 3, socket.PACKET_HOST, 1, b"")

    def close(self):
        pass


def _capture(frames) -> HeadCapture:
    cap = HeadCapture.__new__(HeadCapture)
    cap._off = 0
    cap.sock = _Sock(frames)
    cap.packets, cap._seq = {}, {}
    return cap


def test_parse_reads_port_payload_and_sequence_of_both_families():
    assert _parse(_frame4(80, 5000, 7, 1000)) == (5000, 1000, 7)
    assert _parse(_frame6(80, 5001, 9, 1428)) == (5001, 1428, 9)


def test_retransmitted_segments_count_once_and_wrap_is_followed():
    isn = 0xFFFFF000                     # the sequence space wraps inside the flow
    mss = 1428
    frames = [(i * 1000, _frame4(80, 5000, (isn + i * mss) & 0xFFFFFFFF, mss)) for i in range(10)]
    # the fourth segment again, then a partial overlap with the last one, then the next segment
    frames.append((20_000, _frame6(80, 5000, (isn + 3 * mss) & 0xFFFFFFFF, mss)))
    frames.append((21_000, _frame4(80, 5000, (isn + 9 * mss + 100) & 0xFFFFFFFF, mss)))
    cap = _capture(frames)
    ahead, seen = cap.ahead_bytes(5000, 1e12)
    assert seen == 10 * mss + 100
    assert ahead > 0


def test_flows_are_kept_apart():
    frames = [(1, _frame4(80, 5000, 1, 500)), (2, _frame4(80, 5001, 1, 700)),
              (3, _frame4(80, 5000, 1, 500))]
    cap = _capture(frames)
    assert cap.ahead_bytes(5001, 1e9)[1] == 700
    assert cap.ahead_bytes(5000, 1e9)[1] == 500


def test_a_repaired_loss_and_a_reordering_count_the_bytes_they_bring():
    mss = 1428
    seg = [(i * 1000, _frame6(80, 5000, 1000 + i * mss, mss)) for i in range(8)]
    # segment 2 lost and repaired after 5; 6 and 7 swapped; then 2 again, and one spanning 5-6
    frames = seg[:2] + seg[3:6] + [(9_000, seg[2][1]), seg[7], seg[6], (12_000, seg[2][1]),
                                   (13_000, _frame6(80, 5000, 1000 + 5 * mss + 700, mss))]
    cap = _capture(frames)
    ahead, seen = cap.ahead_bytes(5000, 1e12)
    assert seen == 8 * mss
    assert sorted(n for _t, n in cap_packets(frames)) == [mss] * 8


def cap_packets(frames):
    cap = _capture(frames)
    cap.drain()
    return cap.packets[5000]

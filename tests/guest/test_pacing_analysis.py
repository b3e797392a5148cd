"""The pure parts of the measurement tools: frame parsing and the gap statistics."""
from __future__ import annotations

import struct

import pytest

from harness.pacing import Packet, analyze, mbit, parse_frame, parse_pcap

RATE = mbit(10)
GAP_NS = 1514 * 1e9 / RATE      # 1211.2 us


def frame_v4(payload: int, dport: int = 5201, sport: int = 40000, gso_size: int = 0) -> bytes:
    vnet = struct.pack("<BBHHHH", 0, 1 if gso_size else 0, 66, gso_size, 0, 0)
    eth = b"\x02" * 12 + struct.pack("!H", 0x0800)
    tcp = struct.pack("!HHIIBBHHH", sport, dport, 1, 1, 8 << 4, 0x10, 100, 0, 0) + b"\0" * 12
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(tcp) + payload, 0, 0, 64, 6, 0,
                     b"\x0a\0\0\x01", b"\x0a\0\0\x02")
    return vnet + eth + ip + tcp + b"x" * min(payload, 100)


def frame_v6(payload: int, dport: int = 5201) -> bytes:
    vnet = bytes(10)
    eth = b"\x02" * 12 + struct.pack("!H", 0x86DD)
    tcp = struct.pack("!HHIIBBHHH", 40000, dport, 1, 1, 5 << 4, 0x10, 100, 0, 0)
    ip = struct.pack("!IHBB16s16s", 6 << 28, len(tcp) + payload, 6, 64, bytes(16), bytes(16))
    return vnet + eth + ip + tcp + b"x" * min(payload, 100)


def test_parse_frame():
    assert parse_frame(frame_v4(1448), 5201) == (40000, 1514, 1448, 0)
    assert parse_frame(frame_v4(0), 5201) is None            # a pure ACK
    assert parse_frame(frame_v4(1448, dport=80), 5201) is None
    assert parse_frame(frame_v4(43440, gso_size=1448), 5201) == (40000, 43506, 43440, 1448)
    assert parse_frame(frame_v6(1428), 5201) == (40000, 14 + 40 + 20 + 1428, 1428, 0)
    assert parse_frame(b"short", 5201) is None


def test_gso_skb_expands_to_wire_packets():
    p = Packet(ts_ns=5, sport=1, l2_bytes=66 + 3000, payload_bytes=3000, gso_size=1448)
    assert p.segs == 3
    assert [w[1:] for w in p.wire()] == [(1514, 1448), (1514, 1448), (66 + 104, 104)]
    assert Packet(0, 1, 1514, 1448, 1448).segs == 1


def test_perfect_pacing():
    pkts = [Packet(int(i * GAP_NS), 1, 1514, 1448, 0) for i in range(5000)]
    st = analyze(pkts, RATE, warmup_s=1.0)
    assert st.within25 == 1.0 and st.b2b_share == 0.0 and st.longest_run == 1
    assert abs(st.rate_error) < 1e-3
    assert st.goodput_bps == pytest.approx(RATE * 1448 / 1514, rel=1e-3)
    assert st.median_gap_us == pytest.approx(GAP_NS / 1e3, rel=1e-3)
    assert st.empty_ms == pytest.approx(1 - 1000 / 1211.2, abs=0.01)
    assert st.max_per_ms == 1


def test_fitted_rate_does_not_hang_on_the_end_packets():
    """Exact pacing, every packet late by 0-300 us (not accumulating, as a byte clock does):
    the first-to-last rate moves with the two end packets, the fitted one does not."""
    late = [(i * 7919) % 300_000 for i in range(5000)]
    late[-1] = 600_000                               # the window's last packet: very late
    pkts = [Packet(int(i * GAP_NS) + late[i], 1, 1514, 1448, 0) for i in range(5000)]
    st = analyze(pkts, RATE, warmup_s=1.0)
    assert st.rate_error < -5e-5                     # the end packets: -71 ppm here
    assert abs(st.fit_rate_error) < 2e-5
    # a real rate difference shows in both
    slow = [Packet(int(i * GAP_NS * 1.001), 1, 1514, 1448, 0) for i in range(5000)]
    st = analyze(slow, RATE, warmup_s=1.0)
    assert st.fit_rate_error == pytest.approx(st.rate_error, abs=1e-6)
    assert st.fit_rate_error == pytest.approx(1 / 1.001 - 1, abs=1e-6)


def test_bursts_of_gso_skbs():
    segs = 45
    pkts = [Packet(int(i * segs * GAP_NS), 1, 66 + segs * 1448, segs * 1448, 1448)
            for i in range(200)]
    st = analyze(pkts, RATE, warmup_s=1.0)
    assert st.mean_segs == segs and st.longest_run == segs and st.max_per_ms == segs
    assert st.within25 == 0.0
    assert st.b2b_share == pytest.approx((segs - 1) / segs, abs=0.01)
    assert abs(st.rate_error) < 0.01


def test_busiest_flow_and_warmup():
    data = [Packet(int(i * GAP_NS), 1, 1514, 1448, 0) for i in range(3000)]
    data += [Packet(int(i * 1e9), 2, 200, 134, 0) for i in range(3)]  # a control flow
    st = analyze(data, RATE, warmup_s=2.0)
    assert st.packets == pytest.approx(3000 - 2e9 / GAP_NS, abs=2)
    with pytest.raises(ValueError):
        analyze([], RATE)
    with pytest.raises(ValueError):
        analyze(data[:10], RATE, warmup_s=1.0)


def pcap_file(frames, nano=True) -> bytes:
    """A pcap file (Ethernet) of (ts_ns, frame bytes, wire length) records."""
    out = struct.pack("<IHHiIII", 0xA1B23C4D if nano else 0xA1B2C3D4, 2, 4, 0, 0, 128, 1)
    for ts, frame, wire in frames:
        frac = ts % 1_000_000_000 if nano else (ts % 1_000_000_000) // 1000
        cap = frame[:128]
        out += struct.pack("<IIII", ts // 1_000_000_000, frac, len(cap), wire) + cap
    return out


def test_parse_pcap_counts_gso_skbs_as_mtu_segments():
    gso = frame_v4(43440)[10:]                        # no virtio header in a pcap
    plain = frame_v4(1448)[10:]
    ack = frame_v4(0)[10:]
    udp = bytearray(plain)
    udp[14 + 9] = 17                                   # UDP: 8-byte header, dport at the same place
    other = frame_v4(1448, dport=80)[10:]
    data = pcap_file([(1_000_000_123, plain, 1514), (2_000_000_456, gso, 14 + 20 + 32 + 43440),
                      (3, ack, 66), (4, bytes(udp), 1514), (5, other, 1514)])
    pk = list(parse_pcap(data, {5201}))
    assert [p.ts_ns for p in pk] == [1_000_000_123, 2_000_000_456, 4]
    assert pk[0].segs == 1 and pk[0].payload_bytes == 1448 and pk[0].l2_bytes == 1514
    assert pk[1].gso_size == 1448 and pk[1].segs == 30      # 1500 - 20 - 32
    assert pk[2].payload_bytes == 32 + 1448 - 8 and pk[2].gso_size == 0   # UDP: all after 8 bytes
    micro = list(parse_pcap(pcap_file([(1_000_001_000, plain, 1514)], nano=False), {5201}))
    assert micro[0].ts_ns == 1_000_001_000
    with pytest.raises(ValueError):
        list(parse_pcap(b"\0" * 24, {5201}))

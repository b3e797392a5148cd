"""The checks of the departure capture (``harness.xmitstamp``), shared by tests/test_xmitstamp.py
(the host's kernel) and tests/guest/test_xmitstamp.py (Debian's 6.1 and 6.12 in the VM): known
datagrams out of a testbed's sender veth give exactly their records; a small array counts the
rest as drops; other devices' packets (the peer veth, which has the same ifindex in its own
namespace, and the sender's loopback) are not recorded; a TCP transfer's GSO skbs carry their
gso_size; nothing of the capture is left in the kernel after it.

Every check makes the sender's neighbours permanent first, so no ARP/NDP exchange holds a
datagram back past the capture's end or adds packets of its own.
"""
from __future__ import annotations

import os
import socket
import threading
import time
from typing import List, Tuple

from . import bpfobjs
from .testbed import in_netns, sh, wait_for
from .xmitstamp import XmitStamps

UDP, TCP = socket.IPPROTO_UDP, socket.IPPROTO_TCP
ETH, IP4, IP6, UDPH = 14, 20, 40, 8


def _mac(ns: str, dev: str) -> str:
    words = sh("ip", "-n", ns, "-o", "link", "show", dev).stdout.split()
    return words[words.index("link/ether") + 1]


def static_neighbours(tb, v6: bool = True) -> None:
    """The sender's IPv4 (and IPv6) neighbour, the receiver, is permanent: no ARP or NDP."""
    mac = _mac(tb.client_ns, tb.client_if)
    for addr in (tb.client_v4, tb.client_v6) if v6 else (tb.client_v4,):
        sh("ip", "-n", tb.server_ns, "neigh", "replace", str(addr), "lladdr", mac,
           "nud", "permanent", "dev", tb.server_if)


class Receiver:
    """UDP sockets on ``port`` at ``addrs`` in namespace ``ns`` counting what arrives, so a
    check waits for the last datagram instead of sleeping."""

    def __init__(self, ns: str, addrs, port: int):
        self.socks = []
        with in_netns(ns):
            for addr in addrs:
                fam = socket.AF_INET6 if ":" in str(addr) else socket.AF_INET
                s = socket.socket(fam, socket.SOCK_DGRAM)
                s.bind((str(addr), port))
                s.setblocking(False)
                self.socks.append(s)
        self.got = 0

    def count(self) -> int:
        for s in self.socks:
            while True:
                try:
                    s.recv(65536)
                except BlockingIOError:
                    break
                self.got += 1
        return self.got

    def close(self) -> None:
        for s in self.socks:
            s.close()


def send_udp(tb, plan: List[Tuple[bool, int, int, int]], rx: Receiver, timeout: float = 20) -> None:
    """Send ``plan``'s datagrams (v6, sport, dport, payload bytes) in order from the sender's
    namespace, one socket per (family, sport), and wait until ``rx`` has them all."""
    socks = {}
    want = rx.got + len(plan)
    try:
        with in_netns(tb.server_ns):
            for v6, sport, dport, size in plan:
                s = socks.get((v6, sport))
                if s is None:
                    s = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_DGRAM)
                    s.bind((str(tb.server_v6 if v6 else tb.server_v4), sport))
                    socks[(v6, sport)] = s
                s.sendto(b"\xa5" * size, (str(tb.client_v6 if v6 else tb.client_v4), dport))
        wait_for(lambda: rx.count() >= want, timeout, what=f"{len(plan)} datagrams at the receiver")
    finally:
        for s in socks.values():
            s.close()


def frame_len(v6: bool, payload: int) -> int:
    return ETH + (IP6 if v6 else IP4) + UDPH + payload


def check_exact(tb, base_port: int = 47000) -> None:
    """IPv4 and IPv6 datagrams of known ports and sizes, interleaved, out of the sender's veth:
    the capture has exactly their records, in order, with the frame's length, the L4 offset and
    header, and CLOCK_MONOTONIC stamps inside the sending window in increasing order. The same
    ports sent the other way (out of the peer veth, ifindex equal to the sender's in its own
    namespace) and to the sender's loopback are not recorded, nor is anything else UDP."""
    idx = []
    for ns, dev in ((tb.server_ns, tb.server_if), (tb.client_ns, tb.client_if)):
        with in_netns(ns):
            idx.append(socket.if_nametoindex(dev))
    assert idx[0] == idx[1], f"the peer veth's ifindex {idx[1]} differs from the sender's " \
        f"{idx[0]}: the namespace match would go untested"
    static_neighbours(tb)
    dport = base_port
    plan = [(bool(i % 2), base_port + 1 + i % 3, dport, 1 + 97 * i) for i in range(12)]
    plan += [(False, base_port + 9, dport, 1472), (True, base_port + 9, dport, 1452)]
    rx = Receiver(tb.client_ns, (tb.client_v4, tb.client_v6), dport)
    # sinks for the reverse direction and the sender's loopback
    back = Receiver(tb.server_ns, (tb.server_v4, "127.0.0.1"), dport)
    try:
        with XmitStamps(tb.server_ns, tb.server_if, slots=256) as xs:
            t0 = time.monotonic_ns()
            send_udp(tb, plan, rx)
            with in_netns(tb.client_ns):    # out of the peer veth: not the captured device
                c = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                c.bind((str(tb.client_v4), base_port + 1))
                for _ in range(5):
                    c.sendto(b"r" * 300, (str(tb.server_v4), dport))
                c.close()
            with in_netns(tb.server_ns):    # the sender's loopback: another device there
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                s.bind(("127.0.0.1", base_port + 1))
                for _ in range(5):
                    s.sendto(b"l" * 300, ("127.0.0.1", dport))
                s.close()
            wait_for(lambda: back.count() >= 10, 10, what="the reverse and loopback datagrams")
            t1 = time.monotonic_ns()
        assert xs.drops == 0, f"{xs.drops} drops with 256 slots"
        udp = [r for r in xs.records if r.proto == UDP]
        got = [(r.l4_off == ETH + IP6, r.sport, r.dport, r.length, r.l4_off, r.l4_hdr, r.payload)
               for r in udp]
        want = [(v6, sp, dp, frame_len(v6, n), ETH + (IP6 if v6 else IP4), UDPH, n)
                for v6, sp, dp, n in plan]
        assert got == want, f"UDP records:\n{got}\nwant:\n{want}"
        assert all(r.gso_size == 0 for r in udp)
        stamps = [r.ts_ns for r in xs.records]
        assert stamps == sorted(stamps), "stamps out of order"
        assert t0 <= stamps[0] and stamps[-1] <= t1, (t0, stamps[0], stamps[-1], t1)
    finally:
        rx.close()
        back.close()


def check_overflow(tb, base_port: int = 47100, slots: int = 4, sent: int = 10) -> None:
    """A capture of ``slots`` records: the first ``slots`` datagrams are recorded, the rest
    counted as drops, exactly (IPv6 is switched off on the sender's veth for this check, so
    that nothing but the datagrams leaves it: no MLD or router solicitation)."""
    sh("ip", "netns", "exec", tb.server_ns, "sysctl", "-qw",
       f"net.ipv6.conf.{tb.server_if}.disable_ipv6=1")
    static_neighbours(tb, v6=False)
    plan = [(False, base_port + 1, base_port, 100 + i) for i in range(sent)]
    rx = Receiver(tb.client_ns, (tb.client_v4,), base_port)
    try:
        with XmitStamps(tb.server_ns, tb.server_if, slots=slots) as xs:
            send_udp(tb, plan, rx)
        assert [(r.sport, r.dport, r.payload) for r in xs.records] == \
            [(sp, dp, n) for _v6, sp, dp, n in plan[:slots]]
        assert xs.drops == sent - slots
    finally:
        rx.close()


def check_tcp_gso(tb, port: int = 47200, nbytes: int = 400_000) -> None:
    """A TCP transfer with GSO on: the data records' payloads add up to the bytes sent (no
    loss on a veth), and the large skbs carry the MSS as gso_size (read from the skb's shared
    info, the field CO-RE has to find behind skb->head + skb->end)."""
    static_neighbours(tb)
    with in_netns(tb.client_ns):
        ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        ls.bind((str(tb.client_v4), port))
        ls.listen(1)
    try:
        with XmitStamps(tb.server_ns, tb.server_if, slots=4096) as xs:
            with in_netns(tb.server_ns):
                c = socket.create_connection((str(tb.client_v4), port), timeout=10)
            conn, _ = ls.accept()
            conn.settimeout(20)
            got = []
            # the receiver reads while the sender writes (a small rmem would block sendall)
            reader = threading.Thread(target=_read_all, args=(conn, got), daemon=True)
            reader.start()
            try:
                c.settimeout(20)
                c.sendall(b"\x5a" * nbytes)
                c.shutdown(socket.SHUT_WR)
                reader.join(30)
            finally:
                c.close()
                conn.close()
            assert not reader.is_alive(), "the receiver did not see the end of the stream"
            assert sum(got) == nbytes, f"the receiver got {sum(got)} of {nbytes} bytes"
        data = [r for r in xs.records if r.proto == TCP and r.dport == port and r.payload > 0]
        assert xs.drops == 0
        assert sum(r.payload for r in data) == nbytes
        big = [r for r in data if r.length > 1514]
        assert big, "no GSO skb in the transfer"
        mss = {r.gso_size for r in big}
        assert len(mss) == 1 and 1400 <= mss.pop() <= 1460, [r.gso_size for r in big]
        assert all(r.l4_off == ETH + IP4 and r.l4_hdr >= 20 for r in data)
    finally:
        ls.close()


def _read_all(conn: socket.socket, got: list) -> None:
    """Read ``conn`` to its end (or a timeout), appending the chunk sizes to ``got``."""
    try:
        while True:
            chunk = conn.recv(1 << 16)
            if not chunk:
                return
            got.append(len(chunk))
    except OSError:
        return


def check_nothing_left(tb) -> None:
    """While a capture runs this process holds its program, link and maps; after ``stop()``
    it holds none of them and the kernel has freed them (what bpftool would list)."""
    before = bpfobjs.held(os.getpid())
    xs = XmitStamps(tb.server_ns, tb.server_if, slots=16)
    with xs:
        during = bpfobjs.held(os.getpid())
    after = bpfobjs.held(os.getpid())
    mine = {k: during[k] - before[k] for k in during}
    assert mine["prog"] and mine["link"] and len(mine["map"]) >= 3, mine
    assert all(not (after[k] & mine[k]) for k in mine), (after, mine)
    wait_for(lambda: not any(bpfobjs.alive(mine).values()), 10,
             what=f"the capture's BPF objects {mine} to be freed")
    assert xs.stop() == xs.records      # stopping again changes nothing

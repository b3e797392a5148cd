"""Pacing measurement tools for the test VM (and any root shell with veth and iperf3).

A ``Testbed`` is two network namespaces joined by a veth pair: the sender's end gets the root
qdisc under test (any callable ``setup(testbed)``: ``Htb``, ``Tbf``, ``Fq``, ``Psp`` here), iperf3
sends one bounded TCP stream, and an AF_PACKET socket records every data packet with its kernel
timestamp, at the receiver or, for gaps (``measure``), where the packets leave the sender's veth
(``sender_capture``). ``analyze`` turns that into goodput, rate error and the inter-packet gap
figures (``PacingStats``).

GSO super-packets are seen whole on a veth; the capture asks for the virtio-net header
(PACKET_VNET_HDR) so each one is counted as the ``gso_size`` segments a NIC would put on the
wire back to back at the same instant.

Rates are bytes per second (``*_bps``) as everywhere in flowpacer; ``mbit(10)`` converts.

    with Testbed() as tb:                       # harness.testbed.Testbed: sender = its server side
        st = measure(tb, Htb(mbit(10)), mbit(10), gso=False, duration=4)
        print(st.within25, st.longest_run, st.goodput_bps)
        st = measure(tb, Psp(mbit(10)), mbit(10), gso=True, duration=4)   # needs sch_psp

Command line (inside the VM, as root)::

    python -m harness.pacing matrix [--rates 2,10] [--duration 6] [--qdiscs htb,tbf,fq]
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import logging
import math
import os
import select
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

log = logging.getLogger(__name__)

ETH_P_ALL = 0x0003
ETH_P_IP = 0x0800
ETH_P_IPV6 = 0x86DD
SOL_PACKET = 263
PACKET_VNET_HDR = 15
PACKET_OUTGOING = 4
SO_TIMESTAMPNS = 35
SO_RCVBUFFORCE = 33
PACKET_STATISTICS = 6
CLONE_NEWNET = 0x40000000
VNET_HDR_LEN = 10
IPERF_PORT = 5201


def mbit(x: float) -> int:
    """Megabits per second -> bytes per second."""
    return int(round(x * 1e6 / 8))


def to_mbit(rate_bps: float) -> float:
    return rate_bps * 8 / 1e6


# the one testbed of the project (harness/testbed.py through the harness package): its
# server side is the sender here (sender_ns/sender_dev/sender_addr), its client the receiver
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:                  # also when run as a script (python harness/pacing.py)
    sys.path.insert(0, _REPO)
from harness.testbed import (VIRTUAL_TIMEOUT_SCALE, Testbed, TestbedError,  # noqa: E402,F401
                             guest_timeout, virtual_time)


def wait_for(cond: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    """Poll ``cond`` until it is true; raise TimeoutError naming ``what`` after ``timeout`` s
    (widened in virtual time, ``guest_timeout``)."""
    deadline = time.monotonic() + guest_timeout(timeout)
    while True:
        if cond():
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def require_virtual_time() -> None:
    """Fail (not skip) a pacing test that is not in virtual time: under plain TCG its figures
    depend on the host's load (``tests/test_vm.py`` runs pacing tests in virtual time)."""
    if not virtual_time():
        import pytest
        pytest.fail("pacing tests run in the VM's virtual time (vm/run.py --clock virtual; "
                    f"FLOWPACER_VM_CLOCK={os.environ.get('FLOWPACER_VM_CLOCK', '')!r})",
                    pytrace=False)


def ksoftirqd_realtime(prio: int = 1) -> List[int]:
    """Make the guest's ksoftirqd threads SCHED_FIFO ``prio`` (their pids).

    Linux 6.1 leaves pending softirqs to ksoftirqd once it is awake ("softirq: Let ksoftirqd do
    its job", reverted in 6.5): an interrupt's exit then no longer runs NET_TX, and the qdisc
    watchdog's softirq waits until the scheduler runs ksoftirqd, a normal thread competing with
    iperf3, the capture or pktgen on the one vCPU. As a real-time thread it runs at once, as
    the softirq would on 6.5 and later."""
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/comm") as f:
                if not f.read().startswith("ksoftirqd/"):
                    continue
        except OSError:
            continue
        os.sched_setscheduler(int(pid), os.SCHED_FIFO, os.sched_param(prio))
        pids.append(int(pid))
    return pids


def sh(args: Sequence[str], ns: Optional[str] = None, timeout: float = 30,
       check: bool = True) -> subprocess.CompletedProcess:
    argv = (["ip", "netns", "exec", ns] if ns else []) + [str(a) for a in args]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True,
                              timeout=guest_timeout(timeout))
    except subprocess.TimeoutExpired:
        raise TestbedError(f"{' '.join(argv)}: no answer in {timeout:.0f} s") from None
    if check and proc.returncode != 0:
        raise TestbedError(f"{' '.join(argv)}: exit {proc.returncode}: "
                           f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def modprobe(*names: str) -> None:
    """Load modules. Where the kernel has no modules directory (a host kernel with
    everything built in) a failure is left to the command that needs the feature."""
    strict = os.path.exists(f"/lib/modules/{os.uname().release}/modules.dep")
    for n in names:
        sh(["modprobe", n], check=strict)


QdiscSetup = Callable[[Testbed], None]


@dataclasses.dataclass(frozen=True)
class Htb:
    """htb root with one default class at ``rate_bps`` (tc's default burst unless given)."""
    rate_bps: int
    burst_bytes: Optional[int] = None
    name: str = "htb"

    def __call__(self, tb: Testbed) -> None:
        modprobe("sch_htb")
        tb.s("tc", "qdisc", "replace", "dev", tb.sender_dev, "root", "handle", "1:", "htb",
             "default", "1")
        extra = ["burst", str(self.burst_bytes), "cburst", str(self.burst_bytes)] \
            if self.burst_bytes else []
        tb.s("tc", "class", "add", "dev", tb.sender_dev, "parent", "1:", "classid", "1:1", "htb",
             "rate", f"{self.rate_bps * 8}bit", *extra)


@dataclasses.dataclass(frozen=True)
class Tbf:
    """tbf root at ``rate_bps`` with a bucket of two full-size frames (tbf splits GSO skbs
    bigger than the bucket into MTU-sized packets)."""
    rate_bps: int
    burst_bytes: int = 3028
    latency_ms: int = 200
    name: str = "tbf"

    def __call__(self, tb: Testbed) -> None:
        modprobe("sch_tbf")
        tb.s("tc", "qdisc", "replace", "dev", tb.sender_dev, "root", "tbf",
             "rate", f"{self.rate_bps * 8}bit", "burst", str(self.burst_bytes),
             "latency", f"{self.latency_ms}ms")


@dataclasses.dataclass(frozen=True)
class Fq:
    """fq root with a per-flow ``maxrate``."""
    rate_bps: int
    name: str = "fq"

    def __call__(self, tb: Testbed) -> None:
        modprobe("sch_fq")
        tb.s("tc", "qdisc", "replace", "dev", tb.sender_dev, "root", "fq",
             "maxrate", f"{self.rate_bps * 8}bit")


@dataclasses.dataclass(frozen=True)
class Psp:
    """flowpacer's psp root (handle f1f0:, link rate ``link_bps``) with one paced class
    f1f0:10 at ``rate_bps`` (ceil ``ceil_bps``) that a u32 filter on the iperf3 port feeds;
    the rest goes to psp's own unpaced default class. The module must be loadable
    (``psplib.ensure_loaded``); iproute2's tc cannot encode psp options, so the qdisc and the
    class are made over rtnetlink."""
    rate_bps: int
    link_bps: int = 125_000_000          # 1 Gbit/s: the veth is not the bottleneck
    ceil_bps: Optional[int] = None
    port: int = IPERF_PORT
    name: str = "psp"

    def __call__(self, tb: Testbed) -> None:
        from harness import psplib
        psplib.ensure_loaded()
        with psplib.PspNl(tb.sender_ns) as nl:
            nl.add_qdisc(tb.sender_dev, link_rate_bps=self.link_bps)
            nl.add_class(tb.sender_dev, 0x10, self.rate_bps, self.ceil_bps)
        tb.s("tc", "filter", "add", "dev", tb.sender_dev, "parent", "f1f0:", "protocol", "ip",
             "prio", "1", "u32", "match", "ip", "dport", str(self.port), "0xffff",
             "flowid", "f1f0:10")


# ------------------------------------------------------------------------ capture

@dataclasses.dataclass(frozen=True)
class Packet:
    """One captured skb (a GSO skb carries ``segs`` wire packets)."""
    ts_ns: int
    sport: int
    l2_bytes: int        # frame length as the qdisc counts it (no FCS)
    payload_bytes: int   # TCP payload
    gso_size: int        # MSS of a GSO skb, 0 for a plain packet
    dport: int = 0       # TCP destination port (0: not recorded)

    @property
    def segs(self) -> int:
        if self.gso_size and self.payload_bytes > self.gso_size:
            return -(-self.payload_bytes // self.gso_size)
        return 1

    def wire(self) -> List[Tuple[int, int, int]]:
        """(ts_ns, frame bytes, payload bytes) of each wire packet."""
        n = self.segs
        if n == 1:
            return [(self.ts_ns, self.l2_bytes, self.payload_bytes)]
        hdr = self.l2_bytes - self.payload_bytes
        out = [(self.ts_ns, hdr + self.gso_size, self.gso_size)] * (n - 1)
        last = self.payload_bytes - self.gso_size * (n - 1)
        out.append((self.ts_ns, hdr + last, last))
        return out


def parse_frame(data: bytes, dport: int) -> Optional[Tuple[int, int, int, int]]:
    """(sport, l2_bytes, payload_bytes, gso_size) for a TCP data packet to ``dport`` in a
    frame read with PACKET_VNET_HDR, else None."""
    got = parse_frame_ports(data, (dport,))
    return got[1:] if got else None


def parse_frame_ports(data: bytes, dports) -> Optional[Tuple[int, int, int, int, int]]:
    """(dport, sport, l2_bytes, payload_bytes, gso_size) for a TCP data packet to one of
    ``dports`` in a frame read with PACKET_VNET_HDR, else None."""
    if len(data) < VNET_HDR_LEN + 14 + 40:
        return None
    _flags, gso_type, _hdr_len, gso_size = struct.unpack_from("<BBHH", data, 0)
    eth = VNET_HDR_LEN
    ethertype = struct.unpack_from("!H", data, eth + 12)[0]
    ip = eth + 14
    if ethertype == ETH_P_IP:
        ihl = (data[ip] & 0x0F) * 4
        tot_len = struct.unpack_from("!H", data, ip + 2)[0]
        if data[ip + 9] != socket.IPPROTO_TCP:
            return None
        l3_len, th = tot_len, ip + ihl
        l4_len = tot_len - ihl
    elif ethertype == ETH_P_IPV6:
        plen = struct.unpack_from("!H", data, ip + 4)[0]
        if data[ip + 6] != socket.IPPROTO_TCP:
            return None
        l3_len, th = 40 + plen, ip + 40
        l4_len = plen
    else:
        return None
    if len(data) < th + 20:
        return None
    sport, dp = struct.unpack_from("!HH", data, th)
    if dp not in dports:
        return None
    doff = (data[th + 12] >> 4) * 4
    payload = l4_len - doff
    if payload <= 0:
        return None
    return dp, sport, 14 + l3_len, payload, gso_size if gso_type else 0


class Capture:
    """Records TCP data packets to ``port`` arriving on ``dev`` in network namespace ``ns``
    (``outgoing=True``: leaving through ``dev`` instead, timestamped as the device takes them,
    i.e. right after the qdisc let them go).

    A thread enters the namespace (setns) and reads an AF_PACKET socket with kernel receive
    timestamps (SO_TIMESTAMPNS) and the virtio-net header (PACKET_VNET_HDR, for gso_size).
    ``with Capture(...) as cap: ...; packets = cap.stop()``.
    """

    def __init__(self, ns: str, dev: str, port, outgoing: bool = False):
        self.ns, self.dev, self.port = ns, dev, port
        self.ports = frozenset([port] if isinstance(port, int) else port)
        self.outgoing = outgoing
        self.packets: List[Packet] = []
        self.drops = 0
        self.error: Optional[BaseException] = None
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"capture-{dev}", daemon=True)

    def __enter__(self) -> "Capture":
        self._thread.start()
        if not self._ready.wait(30):
            raise TestbedError("the capture did not start within 30 s")
        if self.error is not None:
            raise TestbedError(f"capture on {self.dev}: {self.error}")
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> List[Packet]:
        self._stop.set()
        self._thread.join(30)
        if self._thread.is_alive():
            raise TestbedError("the capture thread did not stop")
        if self.error is not None:
            raise TestbedError(f"capture on {self.dev}: {self.error}")
        return self.packets

    def _open(self) -> socket.socket:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/run/netns/{self.ns}", os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:  # this thread only
                err = ctypes.get_errno()
                raise OSError(err, f"setns {self.ns}: {os.strerror(err)}")
        finally:
            os.close(fd)
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        s.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
        s.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        try:
            s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 32 << 20)
        except OSError:
            pass
        s.bind((self.dev, ETH_P_ALL))
        s.setblocking(False)
        return s

    def _run(self) -> None:
        try:
            s = self._open()
        except BaseException as e:  # reported by __enter__
            self.error = e
            self._ready.set()
            return
        self._ready.set()
        anc = socket.CMSG_SPACE(16)
        try:
            while True:
                stopping = self._stop.is_set()
                r, _, _ = select.select([s], [], [], 0.1)
                while r:
                    try:
                        data, ancdata, _flags, addr = s.recvmsg(256, anc)
                    except BlockingIOError:
                        break
                    if (addr[2] == PACKET_OUTGOING) != self.outgoing:
                        continue
                    parsed = parse_frame_ports(data, self.ports)
                    if parsed is None:
                        continue
                    for level, typ, cdata in ancdata:
                        if level == socket.SOL_SOCKET and typ == SO_TIMESTAMPNS \
                                and len(cdata) >= 16:
                            sec, nsec = struct.unpack_from("qq", cdata)
                            self.packets.append(Packet(sec * 1_000_000_000 + nsec, *parsed[1:],
                                                       dport=parsed[0]))
                if stopping:  # one last drain after the stop request
                    break
            st = s.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8)  # tp_packets, tp_drops
            self.drops = struct.unpack("II", st)[1]
        except BaseException as e:
            self.error = e
        finally:
            s.close()


class PcapCapture:
    """Like ``Capture``, but for high rates: ``tcpdump`` (libpcap's TPACKET_V3 ring, no Python per
    packet) writes nanosecond timestamps and the first 128 bytes of each TCP/UDP packet to
    ``port`` into a file on the guest's tmpfs, and the file is parsed afterwards. ``drops`` is
    what the kernel dropped for lack of buffer (tcpdump's "dropped by kernel"); a run with drops
    is not a result. A pcap frame carries no GSO size: a TCP skb longer than the MTU is counted
    as the MTU-sized segments GSO cuts it into (``gso_size`` = MTU - IP header - TCP header).
    """

    def __init__(self, ns: str, dev: str, port, outgoing: bool = True, mtu: int = 1500,
                 buffer_kib: int = 131072):
        self.ns, self.dev, self.outgoing, self.mtu = ns, dev, outgoing, mtu
        self.ports = frozenset([port] if isinstance(port, int) else port)
        self.buffer_kib = buffer_kib
        self.packets: List[Packet] = []
        self.drops = 0
        self.received = 0
        self._proc: Optional[subprocess.Popen] = None
        self._path = f"/tmp/fp-capture-{uuid.uuid4().hex[:8]}.pcap"

    def __enter__(self) -> "PcapCapture":
        flt = " or ".join(f"dst port {p}" for p in sorted(self.ports))
        argv = ["ip", "netns", "exec", self.ns, "tcpdump", "-i", self.dev, "-nn", "-s", "128",
                "-B", str(self.buffer_kib), "--time-stamp-precision=nano",
                "-Q", "out" if self.outgoing else "in", "-w", self._path, f"({flt})"]
        self._proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True)
        err: List[str] = []

        def listening() -> bool:
            if self._proc.poll() is not None:
                err.append(self._proc.stderr.read())
                raise TestbedError(f"tcpdump on {self.dev} exited: {err[-1].strip()[-300:]}")
            return os.path.exists(self._path)
        wait_for(listening, 30, "tcpdump to start")
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> List[Packet]:
        if self._proc is None:
            return self.packets
        proc, self._proc = self._proc, None
        if proc.poll() is None:
            proc.send_signal(2)   # SIGINT: tcpdump flushes the file and prints its counts
        try:
            _out, err = proc.communicate(timeout=guest_timeout(60))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise TestbedError("tcpdump did not stop") from None
        for line in err.splitlines():
            words = line.split()
            if "dropped by kernel" in line and words and words[0].isdigit():
                self.drops = int(words[0])
            elif "packets received by filter" in line and words and words[0].isdigit():
                self.received = int(words[0])
        try:
            with open(self._path, "rb") as f:
                self.packets = list(parse_pcap(f.read(), self.ports, self.mtu))
        finally:
            try:
                os.unlink(self._path)
            except OSError:
                pass
        return self.packets


class BpfCapture:
    """Like ``PcapCapture``, with no user space per packet: a BPF program on the
    ``net_dev_start_xmit`` tracepoint (``harness.xmitstamp``) stamps every skb the sender's
    device hands its driver (where tcpdump's egress tap stamps) into a map, read at the end.
    At 1 Gbit/s in the one-vCPU guest tcpdump's process takes CPU time the qdisc's timer path
    needs; this does not. Timestamps are CLOCK_MONOTONIC (tcpdump's: CLOCK_REALTIME), so only
    differences compare. ``drops``: records that did not fit the map."""

    def __init__(self, ns: str, dev: str, port, slots: int = 1 << 20):
        from harness.xmitstamp import XmitStamps
        self.ports = frozenset([port] if isinstance(port, int) else port)
        self._xs = XmitStamps(ns, dev, slots)
        self.packets: List[Packet] = []
        self.drops = 0

    def __enter__(self) -> "BpfCapture":
        self._xs.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> List[Packet]:
        recs = self._xs.stop()
        self.drops = self._xs.drops
        self.packets = [Packet(r.ts_ns, r.sport, r.length, r.payload,
                               r.gso_size if r.proto == socket.IPPROTO_TCP else 0, dport=r.dport)
                        for r in recs if r.dport in self.ports and r.payload > 0]
        return self.packets


def make_capture(kind: str, ns: str, dev: str, port):
    """The sender-side capture by name: ``pcap`` (tcpdump), ``bpf`` (``BpfCapture``),
    ``packet`` (Python AF_PACKET, ``Capture``)."""
    if kind == "pcap":
        return PcapCapture(ns, dev, port)
    if kind == "bpf":
        return BpfCapture(ns, dev, port)
    if kind == "packet":
        return Capture(ns, dev, port, outgoing=True)
    raise ValueError(f"unknown capture {kind!r}")


def parse_pcap(data: bytes, dports, mtu: int = 1500) -> Iterable[Packet]:
    """The TCP/UDP data packets to one of ``dports`` in a pcap file (Ethernet, micro- or
    nanosecond stamps), with GSO skbs longer than ``mtu`` split by MSS as GSO would."""
    if len(data) < 24:
        raise ValueError("not a pcap file (too short)")
    magic = struct.unpack_from("<I", data, 0)[0]
    if magic == 0xA1B23C4D:
        scale = 1
    elif magic == 0xA1B2C3D4:
        scale = 1000
    else:
        raise ValueError(f"not a little-endian pcap file (magic {magic:#x})")
    link = struct.unpack_from("<I", data, 20)[0]
    if link != 1:
        raise ValueError(f"pcap link type {link}, not Ethernet")
    off = 24
    while off + 16 <= len(data):
        sec, frac, caplen, wirelen = struct.unpack_from("<IIII", data, off)
        frame = data[off + 16: off + 16 + caplen]
        off += 16 + caplen
        got = _parse_l3(frame, dports)
        if got is None:
            continue
        dport, sport, proto, l3_len, l4_hdr = got
        payload = l3_len - (l4_hdr[0] + l4_hdr[1])
        if payload <= 0:
            continue
        gso = 0
        if proto == socket.IPPROTO_TCP and l3_len > mtu:
            gso = mtu - l4_hdr[0] - l4_hdr[1]
        yield Packet(sec * 1_000_000_000 + frac * scale, sport, 14 + l3_len, payload, gso,
                     dport=dport)


def _parse_l3(frame: bytes, dports):
    """(dport, sport, proto, l3_len, (ip header, l4 header)) of a TCP/UDP frame to ``dports``."""
    if len(frame) < 14 + 28:
        return None
    ethertype = struct.unpack_from("!H", frame, 12)[0]
    ip = 14
    if ethertype == ETH_P_IP:
        ihl = (frame[ip] & 0x0F) * 4
        l3_len = struct.unpack_from("!H", frame, ip + 2)[0]
        proto = frame[ip + 9]
    elif ethertype == ETH_P_IPV6:
        ihl = 40
        l3_len = 40 + struct.unpack_from("!H", frame, ip + 4)[0]
        proto = frame[ip + 6]
    else:
        return None
    th = ip + ihl
    if proto not in (socket.IPPROTO_TCP, socket.IPPROTO_UDP) or len(frame) < th + 8:
        return None
    sport, dport = struct.unpack_from("!HH", frame, th)
    if dport not in dports:
        return None
    if proto == socket.IPPROTO_TCP:
        if len(frame) < th + 13:
            return None
        l4 = (frame[th + 12] >> 4) * 4
    else:
        l4 = 8
    return dport, sport, proto, l3_len, (ihl, l4)


# ------------------------------------------------------------------------ analysis

@dataclasses.dataclass
class PacingStats:
    target_bps: int
    packets: int             # wire packets in the analysed window
    skbs: int                # captured skbs in the window
    window_s: float
    rate_bps: float          # frame bytes per second (what the qdisc limits)
    goodput_bps: float       # TCP payload bytes per second
    rate_error: float        # rate_bps / target_bps - 1
    ideal_gap_us: float      # for a full-size frame
    median_gap_us: float
    p99_gap_us: float
    within25: float          # share of gaps within +-25 % of the ideal gap for that packet
    b2b_share: float         # share of gaps under 1/4 of the ideal ("back to back")
    longest_run: int         # most packets in a row separated by back-to-back gaps
    max_per_ms: int          # most packets in one 1 ms bin
    empty_ms: float          # share of 1 ms bins without a packet
    mean_segs: float         # wire packets per skb
    capture_drops: int = 0
    iperf_bps: float = 0.0   # iperf3's own receiver goodput over the whole run
    fit_rate_error: float = 0.0  # least-squares rate (bytes sent vs time) / target_bps - 1
    gap_pct_us: Dict[str, float] = dataclasses.field(default_factory=dict)  # p1..p99, max
    within10: float = 0.0    # share of gaps within +-10 % of the ideal gap for that packet

    def row(self) -> str:
        return (f"{to_mbit(self.goodput_bps):7.3f} {100 * self.rate_error:+6.1f}% "
                f"{self.ideal_gap_us:7.0f} {self.median_gap_us:7.0f} {self.p99_gap_us:7.0f} "
                f"{100 * self.within10:6.1f}% {100 * self.within25:6.1f}% "
                f"{100 * self.b2b_share:6.1f}% "
                f"{self.longest_run:5d} {self.max_per_ms:4d} {100 * self.empty_ms:5.1f}% "
                f"{self.mean_segs:5.1f} {self.packets:6d}")

    HEADER = ("goodput  raterr  ideal_us  med_us  p99_us  within10  within25  b2b%   run  max/ms "
              "empty  segs   pkts")


def _pct(sorted_vals: List[float], q: float) -> float:
    if not sorted_vals:
        return float("nan")
    i = min(len(sorted_vals) - 1, max(0, int(math.ceil(q * len(sorted_vals))) - 1))
    return sorted_vals[i]


def analyze(packets: Iterable[Packet], target_bps: int, warmup_s: float = 1.0,
            tail_s: float = 0.0, full_frame: int = 1514) -> PacingStats:
    """Figures for the busiest flow in ``packets`` between ``warmup_s`` after its first
    packet and ``tail_s`` before its last."""
    pkts = sorted(packets, key=lambda p: p.ts_ns)
    if not pkts:
        raise ValueError("no data packets were captured")
    by_flow: Dict[int, int] = {}
    for p in pkts:
        by_flow[p.sport] = by_flow.get(p.sport, 0) + p.payload_bytes
    flow = max(by_flow, key=by_flow.get)
    pkts = [p for p in pkts if p.sport == flow]
    t_lo = pkts[0].ts_ns + int(warmup_s * 1e9)
    t_hi = pkts[-1].ts_ns - int(tail_s * 1e9)
    win = [p for p in pkts if t_lo <= p.ts_ns <= t_hi]
    wire = [w for p in win for w in p.wire()]
    if len(wire) < 3:
        raise ValueError(f"only {len(wire)} packets after the warm-up: run longer")
    span_ns = wire[-1][0] - wire[0][0]
    if span_ns <= 0:
        raise ValueError("all packets have the same timestamp")
    # bytes sent in [first, last): the last skb's segments all arrive at the end instant
    t_end = wire[-1][0]
    sent = sum(w[1] for w in wire if w[0] < t_end)
    good = sum(w[2] for w in wire if w[0] < t_end)
    rate = sent * 1e9 / span_ns
    goodput = good * 1e9 / span_ns
    fit = _fit_rate(wire)
    gaps, ideal = [], []
    for (t0, l0, _), (t1, _, _) in zip(wire, wire[1:]):
        gaps.append(t1 - t0)
        ideal.append(l0 * 1e9 / target_bps)
    within = sum(1 for g, i in zip(gaps, ideal) if abs(g - i) <= 0.25 * i)
    within10 = sum(1 for g, i in zip(gaps, ideal) if abs(g - i) <= 0.10 * i)
    b2b = [g < i / 4 for g, i in zip(gaps, ideal)]
    longest = cur = 0
    for b in b2b:
        cur = cur + 1 if b else 0
        longest = max(longest, cur)
    bins: Dict[int, int] = {}
    for t, _, _ in wire:
        k = (t - wire[0][0]) // 1_000_000
        bins[k] = bins.get(k, 0) + 1
    nbins = (wire[-1][0] - wire[0][0]) // 1_000_000 + 1
    sg = sorted(gaps)
    return PacingStats(
        target_bps=target_bps, packets=len(wire), skbs=len(win), window_s=span_ns / 1e9,
        rate_bps=rate, goodput_bps=goodput, rate_error=rate / target_bps - 1,
        fit_rate_error=fit / target_bps - 1,
        ideal_gap_us=full_frame * 1e6 / target_bps,
        median_gap_us=_pct(sg, 0.5) / 1e3, p99_gap_us=_pct(sg, 0.99) / 1e3,
        within25=within / len(gaps), within10=within10 / len(gaps),
        b2b_share=sum(b2b) / len(gaps),
        longest_run=longest + 1 if longest else 1, max_per_ms=max(bins.values()),
        empty_ms=1 - len(bins) / nbins, mean_segs=len(wire) / len(win),
        gap_pct_us={**{f"p{q}": _pct(sg, q / 100) / 1e3
                       for q in (1, 5, 10, 25, 50, 75, 90, 95, 99)},
                    "min": sg[0] / 1e3, "max": sg[-1] / 1e3})


def _fit_rate(wire: Sequence[Tuple[int, int, int]]) -> float:
    """Bytes per second: the least-squares slope of the bytes sent before each wire packet
    against its timestamp. Unlike first-to-last, it does not hang on the lateness of the two
    end packets: at 1 Mbit/s an 8 s window holds ~690 packets, and one end packet 0.3 ms late
    (a TCG timer) moves the first-to-last rate by 40 ppm."""
    t0 = wire[0][0]
    n = len(wire)
    xs, ys, acc = [], [], 0
    for t, frame, _ in wire:
        xs.append((t - t0) / 1e9)
        ys.append(float(acc))
        acc += frame
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx <= 0:
        raise ValueError("all packets have the same timestamp")
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def window_rate(packets: Iterable[Packet], t0_ns: int, t1_ns: int) -> float:
    """Frame bytes per second of the wire packets timestamped in [t0_ns, t1_ns) (the
    capture's clock is CLOCK_REALTIME, as ``time.time_ns()``)."""
    if t1_ns <= t0_ns:
        raise ValueError("empty window")
    sent = sum(w[1] for p in packets if t0_ns <= p.ts_ns < t1_ns for w in p.wire())
    return sent * 1e9 / (t1_ns - t0_ns)


# ------------------------------------------------------------------------ traffic

class Iperf:
    """iperf3 TCP streams from the sender's namespace to one-shot servers in the receiver's,
    one per port, all started together and bounded in time (``duration`` + 60 s at most).

        with Iperf(tb, [5201, 5202], duration=6) as ip:
            ...                                  # change the qdisc while they run
        ip.reports[5201]["end"]["sum_received"]["bits_per_second"]
    """

    def __init__(self, tb: Testbed, ports: Sequence[int] = (IPERF_PORT,), duration: float = 5.0,
                 extra: Sequence[str] = ()):
        self.tb, self.ports, self.duration, self.extra = tb, list(ports), duration, list(extra)
        self.servers: Dict[int, subprocess.Popen] = {}
        self.clients: Dict[int, subprocess.Popen] = {}
        self.reports: Dict[int, dict] = {}
        self.started = 0.0

    def __enter__(self) -> "Iperf":
        tb = self.tb
        try:
            for p in self.ports:
                self.servers[p] = tb.popen(tb.receiver_ns, ["iperf3", "-s", "-1", "-B",
                                                            tb.receiver_addr, "-p", str(p)],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

            def listening() -> bool:
                dead = [p for p, s in self.servers.items() if s.poll() is not None]
                if dead:
                    raise TestbedError(f"the iperf3 server on port {dead[0]} exited")
                out = tb.r("ss", "-Hltn").stdout
                return all(f":{p} " in out for p in self.ports)
            wait_for(listening, 20, "iperf3 to listen")
            self.started = time.monotonic()
            for p in self.ports:
                self.clients[p] = tb.popen(
                    tb.sender_ns, ["iperf3", "-c", tb.receiver_addr, "-p", str(p), "-B",
                                   tb.sender_addr, "-t", str(self.duration), "-J", *self.extra],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        except BaseException:
            self._kill()
            raise
        return self

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def wait(self) -> Dict[int, dict]:
        """Wait for every client; their JSON reports by port (raises when one failed)."""
        try:
            deadline = self.started + self.duration + guest_timeout(60)
            for p, c in self.clients.items():
                try:
                    out, err = c.communicate(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise TestbedError(f"iperf3 to port {p} did not finish in "
                                       f"{self.duration + 60:.0f} s") from None
                try:
                    rep = json.loads(out)
                except ValueError:
                    rep = {"error": err.strip() or out.strip()[:200]}
                if c.returncode != 0 or "error" in rep:
                    raise TestbedError(f"iperf3 to port {p} failed: "
                                       f"{rep.get('error', c.returncode)}")
                self.reports[p] = rep
            for p, s in self.servers.items():
                wait_for(lambda: s.poll() is not None, 20, f"the iperf3 server on {p} to exit")
        finally:
            self._kill()
        return self.reports

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None and not self.reports:
            self.wait()
        self._kill()

    def _kill(self) -> None:
        for p in list(self.clients.values()) + list(self.servers.values()):
            if p.poll() is None:
                p.kill()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass


class Pktgen:
    """A cheap traffic source for rates a TCP stream cannot fill in the guest: the kernel's
    pktgen in ``queue_xmit`` mode (every packet goes through the sender's root qdisc) sends
    ``frame_bytes`` UDP frames to ``port`` at ``source_bps`` (a little above the rate under
    test, so the qdisc stays backlogged) for ``seconds``, and the receiver drops them at its
    ingress (clsact + matchall drop), so the guest spends its instructions on the qdisc. With
    ``ports`` > 1 the destination port walks ``port`` .. ``port + ports - 1`` packet by packet
    (pktgen's sequential UDP range): the same load offered to one class per port.

        with Pktgen(tb, mbit(1100), 3) as pg: ...; pg.wait()
    """

    def __init__(self, tb: Testbed, source_bps: int, seconds: float, frame_bytes: int = 1514,
                 port: int = IPERF_PORT, ports: int = 1, frags: int = 0):
        self.tb, self.source_bps, self.seconds = tb, source_bps, seconds
        self.frame_bytes, self.port, self.ports, self.frags = frame_bytes, port, ports, frags
        self._proc: Optional[subprocess.Popen] = None
        self.started = 0.0

    def _pg(self, path: str, cmd: str) -> None:
        self.tb.s("sh", "-c", f"echo {shlex_quote(cmd)} > /proc/net/pktgen/{path}")

    def __enter__(self) -> "Pktgen":
        tb = self.tb
        modprobe("pktgen", "sch_ingress", "cls_matchall", "act_gact")
        tb.r("tc", "qdisc", "replace", "dev", tb.receiver_dev, "clsact")
        tb.r("tc", "filter", "replace", "dev", tb.receiver_dev, "ingress", "pref", "1",
             "matchall", "action", "drop")
        link = tb.r("ip", "-o", "link", "show", tb.receiver_dev).stdout.split()
        mac = link[link.index("link/ether") + 1]
        dev = tb.sender_dev
        self._pg("kpktgend_0", "rem_device_all")
        self._pg("kpktgend_0", f"add_device {dev}")
        gap_ns = max(1, int(self.frame_bytes * 1e9 / self.source_bps))
        count = int(self.seconds * 1e9 / gap_ns)
        # frags N: the payload rides in N page fragments pktgen allocates once, instead of being
        # written into every packet (what bounds its rate with jumbo frames)
        for cmd in ("xmit_mode queue_xmit", "clone_skb 0", "burst 1", f"count {count}", f"frags {self.frags}",
                    f"pkt_size {self.frame_bytes}", f"delay {gap_ns}", f"dst {tb.receiver_addr}",
                    f"dst_mac {mac}", f"udp_dst_min {self.port}",
                    # pktgen wraps its sequential port when it reaches the maximum: the
                    # range is [min, max) once min < max
                    f"udp_dst_max {self.port + self.ports if self.ports > 1 else self.port}",
                    "udp_src_min 9", "udp_src_max 9"):
            self._pg(dev, cmd)
        self._proc = tb.popen(tb.sender_ns, ["sh", "-c", "echo start > /proc/net/pktgen/pgctrl"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.started = time.monotonic()
        return self

    def wait(self) -> None:
        try:
            self._proc.communicate(timeout=self.seconds + guest_timeout(60))
        except subprocess.TimeoutExpired:
            self.stop()
            raise TestbedError("pktgen did not finish") from None

    def result(self) -> dict:
        """What pktgen says it sent: ``packets`` and ``bit_s`` (its own rate over its run; the
        offered load when the guest's CPU could not keep up with ``source_bps``)."""
        import re
        text = self.tb.s("cat", f"/proc/net/pktgen/{self.tb.sender_dev}", check=False).stdout
        sofar = re.search(r"pkts-sofar:\s*(\d+)", text)
        rate = re.search(r"(\d+)pps\s+(\d+)Mb/sec", text)
        return {"packets": int(sofar.group(1)) if sofar else None,
                "pps": int(rate.group(1)) if rate else None,
                "bit_s": int(rate.group(1)) * self.frame_bytes * 8 if rate else None}

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self.tb.s("sh", "-c", "echo stop > /proc/net/pktgen/pgctrl", check=False)
            try:
                self._proc.communicate(timeout=guest_timeout(30))
            except subprocess.TimeoutExpired:
                self._proc.kill()

    def __exit__(self, *exc) -> None:
        self.stop()
        tb = self.tb
        tb.s("sh", "-c", "echo rem_device_all > /proc/net/pktgen/kpktgend_0", check=False)
        tb.r("tc", "qdisc", "del", "dev", tb.receiver_dev, "clsact", check=False)


def shlex_quote(s: str) -> str:
    import shlex
    return shlex.quote(s)


def received_bps(report: dict) -> float:
    """iperf3's receiver goodput (bytes/s) over the whole run."""
    return report["end"]["sum_received"]["bits_per_second"] / 8


def sender_capture(tb: Testbed, port=IPERF_PORT) -> Capture:
    """The packets as the qdisc lets them go: leaving the sender's veth (the wire of a veth).

    Gaps are measured here, not at the receiver: in the emulator the receiving side is a
    second softirq pass, on either vCPU, that a busy host can delay by a millisecond, which
    squeezes gaps that left the qdisc evenly (at 10 Mbit/s a receiver sees runs of 3 back to
    back from a qdisc whose output has none)."""
    return Capture(tb.sender_ns, tb.sender_dev, port, outgoing=True)


def measure_pktgen(tb: Testbed, setup: Optional[QdiscSetup], target_bps: int, *,
                   duration: float = 3.0, warmup_s: float = 0.5, overload: float = 1.1,
                   capture: str = "pcap") -> PacingStats:
    """Like ``measure``, with ``Pktgen`` at ``overload`` x the target as the source and the
    ``capture`` (``make_capture``: tcpdump by default) where the packets leave the sender's
    veth."""
    tb.clear_qdisc()
    if setup is not None:
        setup(tb)
    with make_capture(capture, tb.sender_ns, tb.sender_dev, IPERF_PORT) as cap:
        with Pktgen(tb, int(target_bps * overload), duration) as pg:
            pg.wait()
    stats = analyze(cap.packets, target_bps, warmup_s=warmup_s)
    stats.capture_drops = cap.drops
    return stats


def measure(tb: Testbed, setup: Optional[QdiscSetup], target_bps: int, *, gso: bool = True,
            duration: float = 5.0, warmup_s: float = 1.0, pcap: bool = False) -> PacingStats:
    """Install ``setup`` on the sender's veth, send one iperf3 TCP stream for ``duration``
    seconds, capture it as it leaves the sender's veth (``sender_capture``) and analyse it
    against ``target_bps``; ``iperf_bps`` is the receiver's goodput."""
    tb.clear_qdisc()
    tb.set_gso(gso)
    if setup is not None:
        setup(tb)
    cap = (PcapCapture(tb.sender_ns, tb.sender_dev, IPERF_PORT) if pcap
           else sender_capture(tb))
    with cap:
        with Iperf(tb, [IPERF_PORT], duration) as ip:
            rep = ip.wait()[IPERF_PORT]
    stats = analyze(cap.packets, target_bps, warmup_s=warmup_s)
    stats.capture_drops = cap.drops
    stats.iperf_bps = received_bps(rep)
    return stats


# ------------------------------------------------------------------------ CLI

def _matrix(args: argparse.Namespace) -> int:
    rates = [float(x) for x in args.rates.split(",")]
    kinds = {"htb": Htb, "tbf": Tbf, "fq": Fq, "psp": Psp}
    print(f"{'qdisc':5} {'rate':>5} {'gso':3} {PacingStats.HEADER}")
    with Testbed() as tb:
        for r in rates:
            for gso in (True, False):
                for name in args.qdiscs.split(","):
                    setup = kinds[name](mbit(r))
                    dur = args.duration
                    st = measure(tb, setup, mbit(r), gso=gso, duration=dur)
                    print(f"{name:5} {r:5g} {'on' if gso else 'off':3} {st.row()}", flush=True)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="pacing measurement tools (run as root)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("matrix",
                       help="measure htb, tbf, fq (and psp) at some rates, GSO on and off")
    m.add_argument("--rates", default="2,10", help="Mbit/s, comma separated")
    m.add_argument("--qdiscs", default="htb,tbf,fq", help="of htb,tbf,fq,psp")
    m.add_argument("--duration", type=float, default=6.0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        return _matrix(args)
    except (TestbedError, TimeoutError, ValueError, OSError) as e:
        print(f"pacing: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

"""Access-link topology for issue 30: one server, N clients, each behind its own access link.

    SERVER ns  [fa<T>s 10.90.0.1 fd90::1] ==veth== [10.90.0.254 fd90::fe] ROUTER ns
    HOUSE ns   [fa<T>h 10.91.0.1 fd91::1] ==veth== [10.91.0.254 fd91::fe] ROUTER ns
    ROUTER ns  [fa<T>r<i> 10.92.i.254 fd92:0:0:i::fe] ==veth== [10.92.i.1 fd92:0:0:i::1] CLIENT i

The access link of client i is the router's egress toward it: ``tbf`` at the link's rate with a
queue of ``buffer_bytes`` (shallow: 16-32 KiB, a switch port or a cheap CPE; deep: 250+ ms,
bufferbloat). The round trip is a ``netem`` delay on the client's own egress (the ACK path), so
every data packet crosses only the access queue and the RTT does not count as buffer. netem is a
module of the VM's kernels, not of the host's: the topology with an RTT runs in the test VM.

The household (``Household``): a second sender in HOUSE, sharing each chosen access link with the
server's downloads, sends an interactive UDP flow (a call or a game: ``size``-byte datagrams every
20 ms, a sequence number and the send time in the payload) to the client, which stamps each
arrival in the kernel (SO_TIMESTAMPNS). One clock serves every namespace of one kernel, so the
one-way delay is exact (in the VM's virtual time to the nanosecond); its minimum over the run is
the path's own delay and everything above it is delay added by the access queue.

Drops at the access link come from the tbf's own counters (``tc -s qdisc``): ``AccessNet.counters``.

Every process started here is bounded in time and killed on exit, and every namespace is deleted,
also on an exception (``with AccessNet(...) as net:``). Names carry a random tag.
"""
from __future__ import annotations

import ipaddress
import json
import logging
import math
import secrets
import select
import socket
import struct
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from harness.accessfig import jain  # noqa: F401 (the figures' home; re-exported)
from harness.testbed import in_netns, modprobe, sh, stop_process_groups, wait_for

log = logging.getLogger(__name__)

SO_TIMESTAMPNS = 35                  # asm-generic/socket.h; SCM_TIMESTAMPNS is the same
MAX_UDP_SECONDS = 300.0              # a household flow never runs longer
KIB = 1024


@dataclass(frozen=True)
class LinkSpec:
    """One access link: ``rate_bps`` (bytes/s, as everywhere in flowpacer), a tbf queue of
    ``buffer_bytes``, a round trip of ``rtt_ms`` (netem on the client's egress) and whether a
    household UDP flow shares it."""
    rate_bps: int
    buffer_bytes: int
    rtt_ms: float = 20.0
    household: bool = False

    @property
    def shallow(self) -> bool:
        return self.buffer_bytes <= 32 * KIB

    @property
    def buffer_ms(self) -> float:
        return self.buffer_bytes / self.rate_bps * 1000


def deep_buffer(rate_bps: int, ms: float = 250.0) -> int:
    """Bytes of a queue that holds ``ms`` of the link's rate (bufferbloat)."""
    return int(rate_bps * ms / 1000)


@dataclass
class Client:
    index: int
    spec: LinkSpec
    ns: str
    router_if: str
    client_if: str
    v4: ipaddress.IPv4Address
    v6: ipaddress.IPv6Address
    router_v4: ipaddress.IPv4Address
    router_v6: ipaddress.IPv6Address


class AccessError(Exception):
    """A topology command failed (one line: the command and its stderr)."""


def _run(*argv, timeout: float = 30) -> str:
    try:
        p = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AccessError(f"{' '.join(map(str, argv))}: no answer in {timeout:.0f} s") from None
    if p.returncode != 0:
        raise AccessError(f"{' '.join(map(str, argv))}: exit {p.returncode}: "
                          f"{(p.stderr or p.stdout).strip()}")
    return p.stdout


class AccessNet:
    """The topology (see the module's doc). ``server_ns``/``server_if``/``popen``/``run`` are
    named as ``harness.testbed.Testbed``'s, so ``harness.daemon.Daemon`` runs on the server."""
    __test__ = False

    def __init__(self, links: Sequence[LinkSpec], tag: Optional[str] = None):
        if not links or len(links) > 250:
            raise ValueError(f"1-250 access links, not {len(links)}")
        self.tag = tag or secrets.token_hex(2)
        t = self.tag
        self.server_ns, self.router_ns, self.house_ns = f"fpa-{t}-s", f"fpa-{t}-r", f"fpa-{t}-h"
        self.server_if, self.house_if = f"fa{t}s"[:15], f"fa{t}h"[:15]
        self.router_sif, self.router_hif = f"fa{t}rs"[:15], f"fa{t}rh"[:15]
        self.server_v4 = ipaddress.IPv4Address("10.90.0.1")
        self.server_v6 = ipaddress.IPv6Address("fd90::1")
        self.house_v4 = ipaddress.IPv4Address("10.91.0.1")
        self.house_v6 = ipaddress.IPv6Address("fd91::1")
        self.clients: List[Client] = [
            Client(i, spec, f"fpa-{t}-c{i}", f"fa{t}r{i}"[:15], f"fa{t}c{i}"[:15],
                   ipaddress.IPv4Address(f"10.92.{i}.1"), ipaddress.IPv6Address(f"fd92:0:0:{i:x}::1"),
                   ipaddress.IPv4Address(f"10.92.{i}.254"),
                   ipaddress.IPv6Address(f"fd92:0:0:{i:x}::fe"))
            for i, spec in enumerate(links)]
        self._procs: List[subprocess.Popen] = []

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "AccessNet":
        try:
            self.create()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    @property
    def namespaces(self) -> List[str]:
        return [self.server_ns, self.router_ns, self.house_ns, *(c.ns for c in self.clients)]

    def create(self) -> None:
        modprobe("veth", "sch_tbf")
        if any(c.spec.rtt_ms > 0 for c in self.clients):
            modprobe("sch_netem")
        for ns in self.namespaces:
            sh("ip", "netns", "del", ns, check=False)
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        r = self.router_ns
        _run("ip", "netns", "exec", r, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        _run("ip", "netns", "exec", r, "sysctl", "-qw", "net.ipv6.conf.all.forwarding=1")
        self._link(self.server_ns, self.server_if, self.server_v4, self.server_v6,
                   self.router_sif, ipaddress.IPv4Address("10.90.0.254"),
                   ipaddress.IPv6Address("fd90::fe"))
        self._link(self.house_ns, self.house_if, self.house_v4, self.house_v6,
                   self.router_hif, ipaddress.IPv4Address("10.91.0.254"),
                   ipaddress.IPv6Address("fd91::fe"))
        for c in self.clients:
            self._link(c.ns, c.client_if, c.v4, c.v6, c.router_if, c.router_v4, c.router_v6)
            self.set_link(c, c.spec)

    def _link(self, ns, ifn, v4, v6, rif, rv4, rv6) -> None:
        """A veth from ``ns`` to the router, both ends addressed, ``ns`` routed through it."""
        r = self.router_ns
        _run("ip", "-n", r, "link", "add", rif, "type", "veth", "peer", "name", ifn, "netns", ns)
        for n, i, a4, a6 in ((r, rif, rv4, rv6), (ns, ifn, v4, v6)):
            _run("ip", "-n", n, "addr", "add", f"{a4}/24", "dev", i)
            _run("ip", "-n", n, "addr", "add", f"{a6}/64", "dev", i, "nodad")
            _run("ip", "-n", n, "link", "set", i, "up")
        wait_for(lambda: "LOWER_UP" in _run("ip", "-n", ns, "-o", "link", "show", ifn), 10, 0.02,
                 f"the carrier of {ifn}")
        _run("ip", "-n", ns, "route", "add", "default", "via", rv4)
        _run("ip", "-n", ns, "-6", "route", "add", "default", "via", rv6)

    def set_link(self, c: Client, spec: LinkSpec) -> None:
        """(Re)configure client ``c``'s access link: the router's tbf and the client's netem."""
        c.spec = spec
        # tokens for 1 ms of the rate (two frames at least): timers are exact in virtual time
        burst = max(3028, spec.rate_bps // 1000)
        _run("ip", "netns", "exec", self.router_ns, "tc", "qdisc", "replace", "dev", c.router_if,
             "root", "handle", "1:", "tbf", "rate", f"{spec.rate_bps * 8}bit", "burst", burst,
             "limit", max(spec.buffer_bytes, 3028))
        if spec.rtt_ms > 0:
            _run("ip", "netns", "exec", c.ns, "tc", "qdisc", "replace", "dev", c.client_if, "root",
                 "netem", "delay", f"{spec.rtt_ms}ms", "limit", "100000")

    def destroy(self) -> None:
        stop_process_groups(self._procs)
        for ns in self.namespaces:
            sh("ip", "netns", "del", ns, check=False)

    # ------------------------------------------------------------------ running
    def popen(self, ns: str, argv: Sequence, **kw) -> subprocess.Popen:
        """A process in namespace ``ns``, in its own process group (killed on exit)."""
        kw.setdefault("stdout", subprocess.DEVNULL)
        kw.setdefault("stderr", subprocess.DEVNULL)
        p = subprocess.Popen(["ip", "netns", "exec", ns, *[str(a) for a in argv]],
                             start_new_session=True, **kw)
        self._procs.append(p)
        return p

    def run(self, ns: str, argv: Sequence, timeout: float = 60, check: bool = True):
        return sh("ip", "netns", "exec", ns, *[str(a) for a in argv], timeout=timeout, check=check)

    def wait_listening(self, port: int, timeout: float = 10) -> None:
        wait_for(lambda: self.run(self.server_ns, ["ss", "-Hltn", f"sport = :{port}"]).stdout.strip(),
                 timeout, 0.05, f"a listener on port {port}")

    def server_qdisc(self, *args: str) -> None:
        """``tc qdisc replace dev <server if> root ARGS`` (the server-side setup under test)."""
        _run("ip", "netns", "exec", self.server_ns, "tc", "qdisc", "replace", "dev",
             self.server_if, "root", *args)

    def clear_server_qdisc(self) -> None:
        """The server's interface back to its default qdisc (what the daemon starts from)."""
        self.run(self.server_ns, ["tc", "qdisc", "del", "dev", self.server_if, "root"], check=False)

    def counters(self) -> Dict[int, dict]:
        """{client index: {"packets", "bytes", "drops", "overlimits"}} of each access link's tbf."""
        out = {}
        for c in self.clients:
            doc = json.loads(_run("ip", "netns", "exec", self.router_ns, "tc", "-s", "-j",
                                  "qdisc", "show", "dev", c.router_if))
            q = next(x for x in doc if x.get("kind") == "tbf")
            out[c.index] = {k: int(q.get(k, 0)) for k in ("packets", "bytes", "drops",
                                                           "overlimits")}
        return out


def counters_delta(before: Dict[int, dict], after: Dict[int, dict]) -> Dict[int, dict]:
    return {i: {k: after[i][k] - before[i][k] for k in after[i]} for i in after}


# ---------------------------------------------------------------------- household UDP

HDR = struct.Struct("!IIq")          # flow id, sequence number, send time (CLOCK_REALTIME ns)


@dataclass
class Arrival:
    seq: int
    sent_ns: int
    recv_ns: int


@dataclass
class UdpFlow:
    client: Client
    port: int
    v6: bool
    sock: Optional[socket.socket] = None
    sent: List[tuple] = field(default_factory=list)       # (seq, sent_ns)
    arrivals: List[Arrival] = field(default_factory=list)


class Household:
    """Interactive UDP flows (``size``-byte datagrams every ``interval_s``) from the household
    namespace to each listed client, through its access link; one sender thread for all of them,
    one receiving thread (kernel arrival stamps). ``v6``: which clients' flows go over IPv6.

        with Household(net, [net.clients[0]], v6={2}) as hh:
            ...                       # traffic
            t0, t1 = ...              # a window in time.time_ns()
        hh.figures(t0, t1)            # per client: added delay p50/p99/max, jitter, loss
    """

    def __init__(self, net: AccessNet, clients: Sequence[Client], v6: Sequence[int] = (),
                 size: int = 200, interval_s: float = 0.020, base_port: int = 47000):
        if size < HDR.size:
            raise ValueError(f"datagrams of at least {HDR.size} bytes")
        self.net, self.size, self.interval_s = net, size, interval_s
        self.flows = [UdpFlow(c, base_port + c.index, c.index in set(v6)) for c in clients]
        self._stop_tx = threading.Event()
        self._stop_rx = threading.Event()
        self._threads: List[threading.Thread] = []
        self._tx4: Optional[socket.socket] = None
        self._tx6: Optional[socket.socket] = None

    def __enter__(self) -> "Household":
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        for f in self.flows:
            fam = socket.AF_INET6 if f.v6 else socket.AF_INET
            with in_netns(f.client.ns):
                s = socket.socket(fam, socket.SOCK_DGRAM)
            s.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
            s.bind((str(f.client.v6 if f.v6 else f.client.v4), f.port))
            f.sock = s
        with in_netns(self.net.house_ns):
            self._tx4 = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self._tx6 = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
        self._threads = [threading.Thread(target=self._recv, name="hh-recv", daemon=True),
                         threading.Thread(target=self._send, name="hh-send", daemon=True)]
        for t in self._threads:
            t.start()

    def _send(self) -> None:
        start = time.monotonic()
        end = start + MAX_UDP_SECONDS
        pad = b"\0" * (self.size - HDR.size)
        n = 0
        while not self._stop_tx.is_set():
            due = start + n * self.interval_s
            now = time.monotonic()
            if now >= end:
                return
            if due > now:
                self._stop_tx.wait(due - now)
                continue
            for k, f in enumerate(self.flows):
                t = time.time_ns()
                sock = self._tx6 if f.v6 else self._tx4
                dst = str(f.client.v6 if f.v6 else f.client.v4)
                try:
                    sock.sendto(HDR.pack(k, n, t) + pad, (dst, f.port))
                    f.sent.append((n, t))
                except OSError as e:          # a full local queue: counted as a loss
                    log.debug("household send to %s: %s", dst, e)
                    f.sent.append((n, t))
            n += 1

    def _recv(self) -> None:
        socks = {f.sock.fileno(): f for f in self.flows}
        deadline = time.monotonic() + MAX_UDP_SECONDS + 5
        while not self._stop_rx.is_set():
            if time.monotonic() > deadline:
                return
            ready, _, _ = select.select(list(socks), [], [], 0.05)
            for fd in ready:
                f = socks[fd]
                try:
                    data, anc, _, _ = f.sock.recvmsg(self.size + 64, 64, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    continue
                if len(data) < HDR.size:
                    continue
                _, seq, sent = HDR.unpack_from(data)
                stamp = next((struct.unpack("qq", d[:16]) for lvl, typ, d in anc
                              if lvl == socket.SOL_SOCKET and typ == SO_TIMESTAMPNS), None)
                recv = stamp[0] * 1_000_000_000 + stamp[1] if stamp else time.time_ns()
                f.arrivals.append(Arrival(seq, sent, recv))

    def stop(self, drain_s: float = 1.0) -> None:
        """Stop sending; wait (at most ``drain_s``) until the last datagram of every flow is in
        or given up as lost."""
        if self._threads and self._threads[1].is_alive():
            self._stop_tx.set()
            self._threads[1].join(timeout=5)
            last = {id(f): (f.sent[-1][0] if f.sent else -1) for f in self.flows}
            try:
                wait_for(lambda: all(not f.sent or (f.arrivals and f.arrivals[-1].seq >= last[id(f)])
                                     for f in self.flows), drain_s, 0.01, "the last datagrams")
            except TimeoutError:
                pass                                  # lost at the end: counted as loss
        self._stop_tx.set()
        self._stop_rx.set()
        for t in self._threads:
            t.join(timeout=5)

    def close(self) -> None:
        if self._threads:
            self.stop(drain_s=0.5)
        for s in (self._tx4, self._tx6, *(f.sock for f in self.flows)):
            if s is not None:
                s.close()

    def figures(self, t0_ns: int, t1_ns: int) -> Dict[int, dict]:
        """Per client index, for the datagrams sent in [t0_ns, t1_ns): ``sent``, ``lost``
        (fraction), added one-way delay (above the flow's minimum over the whole run) p50, p99
        and max in ms, and ``jitter_ms`` (mean |difference| of consecutive one-way delays, the
        RFC 3550 idea without its smoothing)."""
        out = {}
        for f in self.flows:
            base = min((a.recv_ns - a.sent_ns for a in f.arrivals), default=0)
            sent = [s for s, t in f.sent if t0_ns <= t < t1_ns]
            got = sorted((a for a in f.arrivals if t0_ns <= a.sent_ns < t1_ns), key=lambda a: a.seq)
            seen = {a.seq for a in got}
            owd = [(a.recv_ns - a.sent_ns - base) / 1e6 for a in got]
            srt = sorted(owd)
            jit = [abs(b - a) for a, b in zip(owd, owd[1:])]
            out[f.client.index] = {
                "sent": len(sent), "received": len(seen),
                "loss": round(1 - len(seen & set(sent)) / len(sent), 4) if sent else None,
                "p50_ms": round(pct(srt, 0.50), 3) if srt else None,
                "p99_ms": round(pct(srt, 0.99), 3) if srt else None,
                "max_ms": round(srt[-1], 3) if srt else None,
                "jitter_ms": round(sum(jit) / len(jit), 3) if jit else None,
                "base_ms": round(base / 1e6, 3),
                "v6": f.v6}
        return out


def pct(sorted_vals: Sequence[float], q: float) -> float:
    """The ``q`` quantile of sorted values (nearest rank)."""
    if not sorted_vals:
        return float("nan")
    k = min(len(sorted_vals) - 1, max(0, math.ceil(q * len(sorted_vals)) - 1))
    return sorted_vals[k]


# ---------------------------------------------------------------------- downloads

@dataclass
class Download:
    """One ``iperf3 -R`` download of client ``client`` from the server's ``port`` (``v6``: over
    IPv6, else IPv4, which the server's dual-stack socket sees IPv4-mapped); ``extra`` more
    iperf3 options (``-C bbr``, ``--fq-rate``)."""
    client: Client
    port: int
    v6: bool = False
    extra: Sequence[str] = ()


def start_downloads(net: AccessNet, downloads: Sequence[Download], seconds: int) -> list:
    procs = []
    for d in downloads:
        host = net.server_v6 if d.v6 else net.server_v4
        procs.append(net.popen(d.client.ns, ["iperf3", "-c", host, "-p", d.port, "-R", "-J",
                                             "-t", seconds, *d.extra],
                               stdout=subprocess.PIPE, text=True))
    return procs


def download_figures(doc: dict, skip_s: float) -> dict:
    """From an ``iperf3 -R -J`` report: goodput (payload bytes/s received) over the whole
    seconds after ``skip_s``, its worst second, the server's retransmits, and the per-second
    goodput (bytes/s)."""
    per_s = [iv["sum"]["bytes"] / iv["sum"]["seconds"] for iv in doc.get("intervals", [])
             if iv["sum"]["start"] >= skip_s - 1e-6 and iv["sum"]["seconds"] > 0.5]
    end = doc.get("end", {})
    return {"goodput_bps": round(sum(per_s) / len(per_s)) if per_s else 0,
            "worst_second_bps": round(min(per_s)) if per_s else 0,
            "retransmits": end.get("sum_sent", {}).get("retransmits"),
            "per_second_bps": [round(x) for x in per_s]}


def finish_downloads(procs: list, timeout: float) -> List[dict]:
    """Each download's iperf3 JSON report; AssertionError naming the one that failed."""
    out = []
    for p in procs:
        text, _ = p.communicate(timeout=timeout)
        doc = json.loads(text) if text.strip() else {}
        if p.returncode != 0 or "error" in doc:
            raise AssertionError(f"iperf3 exited {p.returncode}: {doc.get('error', text[-300:])}")
        out.append(doc)
    return out

"""Aggregate rates (issue 15) on psp, with real iperf3 traffic, in the VM's virtual time.

The daemon (``--no-tracer``: flows found by sock_diag) runs the psp backend with rules that have
``client_rate`` and ``total_rate``; the group classes are psp groups (flowpacer/kernel/kmod/psp_sched.h,
"Groups"). Rates are ones the VM paces exactly (2-9 Mbit/s). ``iperf3 -R`` measures at the
client (the receiver); psp counts whole frames, so a cap leaves rate x 1448/1514 (IPv4) or
x 1428/1514 (IPv6) of TCP payload. tests/test_aggregates.py has the same cases on htb.

- ``-R -P 4`` from one client against client_rate 8 Mbit/s: the streams sum to the cap within
  3 % and each gets a quarter within 10 %; a second IPv4 client and an IPv6 client (its /64) in
  the same run each get their own cap;
- total_rate 9 Mbit/s over three clients of 2 streams (client_rate 6 each): 9 within 3 %;
- borrowing: rate 1, ceil 4, client_rate 6: one stream reaches its ceil, three streams of one
  client stop at the client's cap together;
- a SIGKILLed daemon's successor adopts the group classes and the cap holds across it;
- the module alone (no daemon): a class of 8 Mbit/s in a 3 Mbit/s client group under a 4 Mbit/s
  rule group gets the client cap, the cap changed in place under traffic takes effect with the
  queue kept, the dump shows parents, flags, members and demands, and the groups count their
  members' bytes.
"""
from __future__ import annotations

import ipaddress
import subprocess
import threading
import time

import pytest

from harness import psplib
from harness import traffic
from harness.pacing import Capture, Iperf, IPERF_PORT, mbit, to_mbit, window_rate
from harness.daemon import Daemon
from harness.servers import iperf3_server
from harness.pacing import guest_timeout, require_virtual_time, wait_for
from harness.psplib import RTM_NEWTCLASS, TC_H_ROOT, PspNl, h
from flowpacer.kernel.tc import nl as N

from flowpacer.kernel.tc import psp as enc

MBIT = 1_000_000 // 8
RULES = """
    interface: IFACE
    backend: psp
    link_rate: 1gbit
    rules:
      - name: capped             # per client: 8 Mbit/s over all its streams
        match: {process: iperf3, direction: inbound, local_port: 5301-5309}
        rate: 4mbit
        client_rate: 8mbit
      - name: total              # three clients of 2 x 4 Mbit/s, 6 each at most, 9 in all
        match: {process: iperf3, direction: inbound, local_port: 5311-5319}
        rate: 4mbit
        client_rate: 6mbit
        total_rate: 9mbit
      - name: borrow             # 1 Mbit/s per stream, borrowing up to 4, 6 per client
        match: {process: iperf3, direction: inbound, local_port: 5321-5329}
        rate: 1mbit
        ceil: 4mbit
        client_rate: 6mbit
"""
PORTS = (5301, 5302, 5303, 5311, 5312, 5313, 5321, 5322)


@pytest.fixture(autouse=True, scope="module")
def _virtual_time():
    require_virtual_time()


class Site:
    """The testbed with three IPv4 client addresses and two IPv6 /64s, iperf3 servers, and the
    daemon."""

    def __init__(self, tb, workdir):
        self.tb, self.workdir = tb, workdir
        v4 = int(tb.client_v4)
        self.v4 = [tb.client_v4, ipaddress.IPv4Address(v4 + 1), ipaddress.IPv4Address(v4 + 2)]
        net = ipaddress.ip_network((tb.server_v6, 64), strict=False)
        other = ipaddress.ip_network((int(net.network_address) + (1 << 64), 64))
        self.v6_other = other.network_address + 2
        self.server_v6_other = other.network_address + 1
        for a in self.v4[1:]:
            tb.run(tb.client_ns, ["ip", "addr", "add", f"{a}/24", "dev", tb.client_if])
        tb.run(tb.client_ns, ["ip", "addr", "add", f"{self.v6_other}/64", "dev", tb.client_if,
                              "nodad"])
        tb.run(tb.server_ns, ["ip", "addr", "add", f"{self.server_v6_other}/64", "dev",
                              tb.server_if, "nodad"])
        for p in PORTS:
            iperf3_server(tb, p)
        self.daemon = self.start_daemon(RULES, "w")

    def start_daemon(self, rules, log_mode) -> Daemon:
        return Daemon(self.tb, self.workdir, rules, "--no-tracer", "--no-metrics", "--rescan",
                      "0.5", backend="psp", log_mode=log_mode).start(timeout=guest_timeout(90))

    def iperf(self, bind, port: int, streams: int, seconds: float = 6,
              omit: int = 2) -> subprocess.Popen:
        """``iperf3 -R -P streams`` from client address ``bind``, the first ``omit`` s omitted."""
        tb = self.tb
        host = tb.server_v4 if bind.version == 4 else self.server_v6_other
        return traffic.iperf3(tb, host, port, seconds=seconds, parallel=streams,
                              extra=["-O", str(omit), "-B", str(bind)])

    def kernel(self):
        """{minor: ClassInfo} of the psp classes on the server's interface."""
        with PspNl(self.tb.server_ns) as s:
            return s.classes(self.tb.server_if)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    from harness.testbed import Testbed
    psplib.ensure_loaded()
    with psplib.rmem_max(psplib.BIG_RMEM_MAX), Testbed() as tb:
        s = Site(tb, tmp_path_factory.mktemp("pspagg"))
        yield s
        rc = s.daemon.stop()
        log = s.daemon.log_text()
        assert rc == 0, f"the daemon exited {rc} on SIGTERM:\n{log[-3000:]}"
        assert "Traceback" not in log and "not enforced" not in log, log[-3000:]
        with PspNl(tb.server_ns) as sock:
            assert sock.root(tb.server_if) is None, "SIGTERM left the psp qdisc behind"


def received(p, seconds: list = None) -> tuple:
    """(sum, [each stream]) in bytes/s of TCP payload, measured by the receiving client.
    ``seconds``: a list that gets, for each second of the run (omitted ones marked "o"), the
    bytes each stream received in it, for an assertion's message."""
    doc = traffic.iperf3_result(p, timeout=guest_timeout(120))
    streams = [s["receiver"]["bits_per_second"] / 8 for s in doc["end"]["streams"]]
    if seconds is not None:
        seconds.append(f"  {doc['start']['connecting_to']['port']}: " + " | ".join(
            ("o " if iv["streams"][0]["omitted"] else "")
            + " ".join(str(x["bytes"]) for x in iv["streams"]) for iv in doc["intervals"]))
    return doc["end"]["sum_received"]["bits_per_second"] / 8, streams


def payload(rate_mbit: float, v6: bool) -> float:
    return rate_mbit * MBIT * traffic.wire(v6)


def report(what: str, got: float, want: float, streams=()) -> str:
    line = f"psp aggregates: {what}: {got * 8 / 1e6:.3f} Mbit/s, cap {want * 8 / 1e6:.3f} " \
           f"({got / want - 1:+.2%})"
    if streams:
        line += " streams " + ", ".join(f"{s * 8 / 1e6:.3f}" for s in streams)
    psplib.record(line)
    return line


def groups_of(classes) -> dict:
    return {m: c for m, c in classes.items() if c.xstats and c.xstats["flags"] & enc.PSP_CLASS_F_GROUP}


class ClassSampler:
    """Reads the psp classes every 0.5 s in a thread while the block runs; ``table()``: each
    class's rate over the longest span it was seen in (minor, parent, rate, flags, Mbit/s sent,
    eff_rate), which an assertion message shows when a flow or group is off its share."""

    def __init__(self, site, interval=0.5):
        self.site, self.interval = site, interval
        self.snaps = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            try:
                self.snaps.append((time.monotonic(), self.site.kernel()))
            except Exception as e:       # a read failing only loses a sample
                self.snaps.append((time.monotonic(), {"error": repr(e)}))
            self._stop.wait(self.interval)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(timeout=guest_timeout(30))

    def table(self) -> str:
        first, last = {}, {}
        for t, snap in self.snaps:
            if "error" in snap:
                continue
            for m, c in snap.items():
                first.setdefault(m, (t, c))
                last[m] = (t, c)
        rows = ["classes seen (minor parent rate flags Mbit/s-sent eff_rate group_held):"]
        for m in sorted(first):
            (t0, a), (t1, b) = first[m], last[m]
            dt = t1 - t0
            sent = (b.stats.get("bytes", 0) - a.stats.get("bytes", 0)) * 8 / dt / 1e6 if dt > 0 else 0
            x = b.xstats or {}
            rows.append(f"  {m:x} {b.parent:#x} {(b.rate or 0) * 8 / 1e6:g} "
                        f"{x.get('flags', 0):#x} {sent:.3f} over {dt:.1f}s "
                        f"{x.get('eff_rate', 0) * 8 / 1e6:.3f} {x.get('group_held', '-')}")
        return "\n".join(rows)


def wait_quiet(site):
    """An earlier case's classes are gone: only the default class is left."""
    wait_for(lambda: list(site.kernel()) == [2], 15, "the earlier flows' classes to go")


def test_client_rate_over_parallel_streams_each_client_its_own(site):
    wait_quiet(site)
    v4a, v4b, _ = site.v4
    # Four seconds omitted: the streams run unshaped (default class, tens of Mbit/s) until
    # sock_diag finds them, then at 2 Mbit/s each; a stream that lost packets at that switch
    # recovers behind its class's full queue. On 7.3 one stream of each IPv4 client received
    # 1448 bytes in each of its 2nd and 3rd seconds and then, the hole filled, its buffered
    # out-of-order data at once (1 062 832 bytes in the 4th second, 238 920 in every later
    # one). With a 2 s omit ~520 KB of that had passed the qdisc before the window began, so
    # the stream's goodput read 2.695 Mbit/s while every psp class sent exactly 2.000 over
    # the window. From the 5th second on every stream received its quarter each second.
    runs = {"v4 .2": (site.iperf(v4a, 5301, 4, omit=4), False),
            "v4 .3": (site.iperf(v4b, 5302, 4, omit=4), False),
            "v6 other /64": (site.iperf(site.v6_other, 5303, 4, omit=4), True)}

    def grouped():
        cls = site.kernel()
        g = groups_of(cls)
        members = [c for c in cls.values() if (c.parent & 0xFFFF) in g]
        return (g, members) if len(g) == 3 and len(members) == 15 else None
    wait_for(grouped, 10, "three client groups with 5 flows each (4 streams and control)")
    g, members = grouped()
    # while they run: groups at the cap, flows at the rule's rate, parents in the dump
    for c in g.values():
        assert c.rate == 8 * MBIT and c.ceil is None and c.limit is None
        assert c.xstats["members"] == 5 and c.parent == 0xFFFFFFFF
    for c in members:
        assert (c.rate, c.ceil) == (4 * MBIT, 4 * MBIT)
    # the groups are what limits the streams: their backlogged members want more than the cap
    wait_for(lambda: any(c.xstats["group_sum"] > c.rate for c in groups_of(site.kernel()).values()),
             10, "a client group oversubscribed by its backlogged streams")
    st = site.daemon.status()
    seconds = ["bytes each stream received in each second (o: omitted):"]
    with ClassSampler(site) as sampled:
        got = {name: received(p, seconds) for name, (p, _) in runs.items()}
    lines = [sampled.table()] + seconds
    for name, (_, v6) in runs.items():
        total, streams = got[name]
        want = payload(8, v6)
        lines.append(report(f"client_rate 8 Mbit/s, -P 4, {name}", total, want, streams))
    for name, (_, v6) in runs.items():
        total, streams = got[name]
        want = payload(8, v6)
        assert total == pytest.approx(want, rel=0.03), "\n".join(lines)
        assert len(streams) == 4
        for s in streams:
            assert s == pytest.approx(want / 4, rel=0.10), "\n".join(lines)
    capped = [f for f in st["flows"] if f["rule"] == "capped"]
    assert capped and all(f["client_rate_bit"] == 8_000_000 for f in capped)
    assert {gr["id"] for gr in st["groups"]} >= {f"capped/{v4a}/32", f"capped/{v4b}/32"}
    wait_quiet(site)


def test_total_rate_over_three_clients(site):
    wait_quiet(site)
    clients = [(site.v4[0], 5311, False), (site.v4[1], 5312, False),
               (site.v6_other, 5313, True)]
    runs = [(site.iperf(a, p, 2), v6) for a, p, v6 in clients]

    def two_levels():
        cls = site.kernel()
        g = groups_of(cls)
        tops = [m for m, c in g.items() if c.parent == 0xFFFFFFFF]
        kids = [m for m, c in g.items() if (c.parent & 0xFFFF) in tops]
        return (tops, kids, g) if len(tops) == 1 and len(kids) == 3 else None
    wait_for(two_levels, 10, "the rule group with its three client groups")
    tops, kids, g = two_levels()
    assert g[tops[0]].rate == 9 * MBIT and g[tops[0]].xstats["members"] == 3
    assert {g[k].rate for k in kids} == {6 * MBIT}
    got = [(received(p)[0], v6) for p, v6 in runs]
    total = sum(x for x, _ in got)
    want = sum(payload(3, v6) for _, v6 in got)
    lines = [report("total_rate 9 Mbit/s over 3 clients", total, want)] + \
        [report(f"total_rate: client {a}", x, payload(3, v6))
         for (a, _, _), (x, v6) in zip(clients, got)]
    assert total == pytest.approx(want, rel=0.03), "\n".join(lines)
    for x, v6 in got:
        assert x == pytest.approx(payload(3, v6), rel=0.10), "\n".join(lines)
    wait_quiet(site)


def test_borrowing_up_to_ceil_inside_the_client_cap(site):
    wait_quiet(site)
    one, _ = received(site.iperf(site.v4[0], 5321, 1))
    three, streams = received(site.iperf(site.v6_other, 5322, 3, seconds=8))
    lines = [report("borrow: one stream (rate 1, ceil 4)", one, payload(4, False)),
             report("borrow: three streams (client cap 6)", three, payload(6, True), streams)]
    assert one == pytest.approx(payload(4, False), rel=0.03), "\n".join(lines)
    assert three == pytest.approx(payload(6, True), rel=0.03), "\n".join(lines)
    for s in streams:
        assert s == pytest.approx(payload(6, True) / 3, rel=0.10), "\n".join(lines)
    wait_quiet(site)


def test_daemon_crash_under_load_keeps_the_groups(site):
    """SIGKILL the daemon while a client's 4 streams fill its group; the next daemon adopts the
    classes (groups rebuilt from the kernel's parents, nothing made anew) and the client stays
    at its cap across the restart."""
    wait_quiet(site)
    d = site.daemon
    p = site.iperf(site.v4[0], 5301, 4, seconds=10)
    wait_for(lambda: len(site.kernel()) == 1 + 1 + 5, 10, "the client's group and 5 flows")
    before = {m: (c.parent, c.rate, c.ceil) for m, c in site.kernel().items()}
    d.kill()
    site.daemon = site.start_daemon(None, "a")

    def named():
        fl = [f for f in site.daemon.status()["flows"] if f["rule"] == "capped"]
        return len(fl) == 5 and all(f["client"] == f"{site.v4[0]}/32" for f in fl)
    wait_for(named, 15, "the adopted flows named by their rule and client")
    assert {m: (c.parent, c.rate, c.ceil) for m, c in site.kernel().items()} == before
    assert "adopted flowpacer qdisc with 5 flow classes (0 stale objects removed, " in \
        site.daemon.log_text()
    total, streams = received(p)
    line = report("client_rate 8 Mbit/s across a daemon SIGKILL and restart", total,
                  payload(8, False), streams)
    assert total == pytest.approx(payload(8, False), rel=0.03), line
    wait_quiet(site)


# ------------------------------------------------------------------ the module alone

FILTER = ["protocol", "ip", "prio", "1", "u32", "match", "ip", "dport", str(IPERF_PORT), "0xffff",
          "flowid"]


def test_groups_dump_count_and_cap_under_traffic(bed):
    """A class of 8 Mbit/s in a 3 Mbit/s client group under a 4 Mbit/s rule group: iperf3 through
    it gets the client cap; the client group's rate changed in place to 1.5 Mbit/s under traffic
    takes effect (queue kept); the dump shows parents, the group flag, members and the demand;
    the groups count their members' bytes."""
    tb, sock = bed
    dev = tb.sender_dev
    tb.set_gso(True)
    sock.add_qdisc(dev, link_rate_bps=mbit(100))
    sock.add_group(dev, 0x30, mbit(4))
    sock.add_group(dev, 0x31, mbit(3), parent=0x30)
    sock.add_class(dev, 0x10, mbit(8), parent=0x31)
    tb.s("tc", "filter", "add", "dev", dev, "parent", "f1f0:", *FILTER, "f1f0:10")
    cls = sock.classes(dev)
    assert cls[0x30].parent == TC_H_ROOT and cls[0x31].parent == h(0x30)
    assert cls[0x10].parent == h(0x31)
    assert cls[0x30].xstats["flags"] & enc.PSP_CLASS_F_GROUP and cls[0x30].ceil is None
    assert (cls[0x30].rate, cls[0x30].xstats["members"], cls[0x31].xstats["members"]) == \
        (mbit(4), 1, 1)
    marks = {}
    with Capture(tb.receiver_ns, tb.receiver_dev, IPERF_PORT) as cap:
        with Iperf(tb, [IPERF_PORT], duration=8) as ip:
            def busy(after_s):
                return lambda: ip.elapsed() >= after_s and sock.classes(dev)[0x10].stats["qlen"] > 0
            wait_for(busy(4.0), 15, "the class to be backlogged")
            during = sock.classes(dev)
            marks["change"] = time.time_ns()
            sock.must(RTM_NEWTCLASS, 0, N.tcmsg(sock.ifindex(dev), h(0x31), h(0x30))
                      + enc.group_options(mbit(1.5)), "change the client group's rate")
            after = sock.classes(dev)
            ip.wait()
        end = time.time_ns()
    s = 1_000_000_000
    first = min(p.ts_ns for p in cap.packets)
    r3 = window_rate(cap.packets, first + s, marks["change"])
    r15 = window_rate(cap.packets, marks["change"] + s * 6 // 10, min(end, first + 8 * s) - s // 2)
    got = sock.classes(dev)
    psplib.record(f"psp groups: client cap 3 Mbit/s over a class of 8: {to_mbit(r3):.3f}, cap "
                  f"changed to 1.5 Mbit/s under traffic: {to_mbit(r15):.3f} Mbit/s; held "
                  f"{got[0x31].xstats['group_held']} times")
    assert during[0x31].xstats["group_sum"] == mbit(8) and during[0x30].xstats["group_sum"] == mbit(3)
    assert during[0x31].xstats["flags"] & enc.PSP_CLASS_F_ACTIVE
    assert during[0x10].xstats["eff_rate"] == mbit(3)
    assert after[0x10].stats["qlen"] > 0 and after[0x31].rate == mbit(1.5)
    assert abs(r3 / mbit(3) - 1) < 0.05
    assert abs(r15 / mbit(1.5) - 1) < 0.05
    assert got[0x30].stats["bytes"] == got[0x31].stats["bytes"] == got[0x10].stats["bytes"] > 0
    assert got[0x10].stats["drops"] == 0

"""Real servers and real clients, both address families at once (issue 12).

One testbed for the module: in its server namespace nginx (2 workers; IPv4 and IPv6 listeners
on 8080, a dual-stack ``[::]:8081 ipv6only=off`` listener where IPv4 clients become IPv4-mapped
flows, HTTP/2 on 8082), two iperf3 servers and an rsync daemon, and the daemon (htb backend)
with one rule per server program at 40 Mbit/s. Each case drives real clients from the client
namespace over IPv4, IPv6 and IPv4-mapped at the same time, bounded in time and count, and then
checks the daemon (``after_case``):

- no traceback in its log, the process alive, its status answering with every stage running;
- no flow class or filter left on the server interface within 3 s of the last flow's end;
- a new IPv4, a new IPv6 and a new IPv4-mapped download each shaped within 5 % of the rule
  (payload measured at the receiver against rate x 1448/1514, 1428/1514 over IPv6).
"""
from __future__ import annotations

import subprocess

import pytest

from harness import traffic
from harness.capture import kernel_objects, tc_show
from harness.daemon import Daemon, healthy, tracebacks
from harness.servers import Nginx, iperf3_server, rsync_daemon
from harness.testbed import wait_for

pytestmark = pytest.mark.kernel

RATE_BIT = 40_000_000
RATE_BPS = RATE_BIT / 8
RULES = """
    interface: IFACE
    backend: htb
    link_rate: 1gbit
    rules:
      - name: web
        match: {process: nginx, direction: inbound}
        rate: 40mbit
      - name: iperf
        match: {process: iperf3, direction: inbound}
        rate: 40mbit
      - name: rsync
        match: {process: rsync, direction: inbound}
        rate: 40mbit
"""
BIG, SMALL, TINY = 512 << 20, 256 << 10, 4 << 10      # bytes of /big, /small, /tiny
IPERF_V4, IPERF_V6, RSYNC = 5201, 5202, 8730


class Site:
    """The module's servers and daemon."""

    def __init__(self, tb, nginx: Nginx, daemon: Daemon):
        self.tb, self.ng, self.daemon = tb, nginx, daemon
        self.v4, self.v6 = tb.server_v4, tb.server_v6

    def targets(self, path: str, port: int = 0):
        """(host, port) of the three kinds of flow: IPv4, IPv6, IPv4-mapped (dual-stack port)."""
        p = port or self.ng.port
        return [(self.v4, p), (self.v6, p), (self.v4, self.ng.dual_port)]


@pytest.fixture(scope="module")
def site(module_testbed, tmp_path_factory):
    tb = module_testbed
    work = tmp_path_factory.mktemp("real")
    (work / "daemon").mkdir()
    ng = Nginx(tb, work / "nginx", {"big": BIG, "small": SMALL, "tiny": TINY}).start()
    iperf3_server(tb, IPERF_V4)
    iperf3_server(tb, IPERF_V6)
    rsync_daemon(tb, work / "rsync", {"file": 6 << 20}, port=RSYNC)
    d = Daemon(tb, work / "daemon", RULES, "--backend", "htb").start()
    yield Site(tb, ng, d)
    rc = d.stop()
    assert rc == 0, f"the daemon exited {rc} on SIGTERM:\n{d.log_text()[-3000:]}"


def after_case(site, what: str) -> None:
    tb, d = site.tb, site.daemon
    log = d.log_text()
    tbs = list(tracebacks(log))
    assert not tbs, f"after {what}: a traceback in the daemon's log:\n" + "\n---\n".join(tbs[:3])
    assert d.alive(), f"after {what}: the daemon exited {d.proc.returncode}:\n{log[-3000:]}"
    st = d.status()
    bad = healthy(st)
    assert not bad, f"after {what}: {bad}"

    def clean():
        return kernel_objects(tb) == (0, 0)
    try:
        wait_for(clean, 3, 0.05, "every flow class and filter to go")
    except TimeoutError:
        raise AssertionError(f"after {what}: classes/filters left 3 s after the last flow: "
                             f"{kernel_objects(tb)}\n{tc_show(tb, 'class')}\nflows in status: "
                             f"{[(f['local'], f['remote']) for f in d.flows()][:10]}") from None
    # new downloads, one of each kind at once, each at the rule's rate
    kinds = ("ipv4", "ipv6", "ipv4-mapped")
    clients = [traffic.fetch(tb, h, p, seconds=4.5, warmup=1.5, path="/big")
               for h, p in site.targets("/big")]
    res = [traffic.fetch_result(c) for c in clients]
    for kind, r in zip(kinds, res):
        want = RATE_BPS * traffic.wire(kind == "ipv6")
        assert r["goodput_bps"] == pytest.approx(want, rel=0.05), \
            f"after {what}: the new {kind} download got {r['goodput_bps'] * 8 / 1e6:.2f} Mbit/s, " \
            f"the rule says {RATE_BIT / 1e6:.0f} (x wire {want * 8 / 1e6:.2f})"
    try:
        wait_for(clean, 3, 0.05, "the downloads' classes to go")
    except TimeoutError:
        raise AssertionError(f"after {what}: the check downloads' classes stayed: "
                             f"{kernel_objects(tb)}") from None


def test_daemon_shapes_all_three_kinds_at_start(site):
    after_case(site, "the start")


def test_ab_both_families_at_once_short_connections(site):
    """ApacheBench, 300 requests 30 at a time (a new connection each), over IPv4, IPv6 and the
    dual-stack port (IPv4-mapped), all at the same time."""
    tb = site.tb
    runs = [traffic.ab(tb, traffic.url(h, p, "/small"), n=300, c=30)
            for h, p in site.targets("/small")]
    res = [traffic.ab_result(r) for r in runs]
    for r in res:
        assert r["rc"] == 0 and r["complete"] == 300 and r["failed"] == 0 and r["non_2xx"] == 0, r
    after_case(site, "ab")


def test_h2load_http2_and_http1_both_families(site):
    """h2load: HTTP/2 (4 streams per connection) over IPv4 and IPv6, HTTP/1.1 to the
    dual-stack port, at once."""
    tb, ng = site.tb, site.ng
    runs = [traffic.h2load(tb, traffic.url(site.v4, ng.h2_port, "/small"), n=200, c=10, streams=4),
            traffic.h2load(tb, traffic.url(site.v6, ng.h2_port, "/small"), n=200, c=10, streams=4),
            traffic.h2load(tb, traffic.url(site.v4, ng.dual_port, "/tiny"), n=500, c=20, h1=True)]
    res = [traffic.h2load_result(r) for r in runs]
    for r, n in zip(res, (200, 200, 500)):
        assert r["rc"] == 0 and r.get("succeeded") == n and r.get("errored") == 0, r
    after_case(site, "h2load")


def test_keepalive_clients_idle_between_requests(site):
    """curl fetching several URLs over one kept-alive connection, and socket clients that send
    a request, idle for a second, send the next, on one connection."""
    tb = site.tb
    curls = [traffic.curl(tb, [traffic.url(h, p, "/small")] * 5) for h, p in site.targets("/small")]
    th = traffic.Threads()
    for h, p in site.targets("/small") * 2:
        th.start(traffic.keepalive_client, tb, h, p, "/small", 4, 1.0)
    res = th.join(timeout=30)
    assert all(r == {"responses": 4, "bytes": 4 * SMALL} for r in res), res
    for c in curls:
        r = traffic.curl_result(c)
        assert r["rc"] == 0 and r["codes"] == ["200"] * 5 and r["bytes"] == [SMALL] * 5, r
        assert r["connects"] == 1, r              # one connection kept alive for all five
    after_case(site, "keep-alive clients")


def test_clients_that_reset_mid_transfer(site):
    """Big downloads abandoned after 1 MB with SO_LINGER 0 (a RST), 4 of each kind."""
    tb = site.tb
    th = traffic.Threads()
    for h, p in site.targets("/big") * 4:
        th.start(traffic.reset_midway, tb, h, p, "/big", 1 << 20)
    res = th.join(timeout=30)
    assert all(r["bytes"] >= 1 << 20 for r in res), res
    after_case(site, "resets mid-transfer")


def test_iperf3_eight_streams_each_family(site):
    """``iperf3 -R -P 8`` over IPv4 and over IPv6 at once: every stream is a shaped flow of the
    iperf3 server, so each test's sum is at most 8 x the rule."""
    tb = site.tb
    runs = [traffic.iperf3(tb, site.v4, IPERF_V4, seconds=4, parallel=8, extra=["-O", "1"]),
            traffic.iperf3(tb, site.v6, IPERF_V6, seconds=4, parallel=8, extra=["-O", "1"])]
    res = [traffic.iperf3_result(r) for r in runs]
    for fam, doc in zip(("ipv4", "ipv6"), res):
        got = doc["end"]["sum_received"]["bits_per_second"]
        assert len(doc["end"]["streams"]) == 8
        assert 0.75 * 8 * RATE_BIT <= got <= 1.05 * 8 * RATE_BIT, \
            f"iperf3 -P 8 over {fam}: {got / 1e6:.1f} Mbit/s, 8 streams at {RATE_BIT / 1e6:.0f}"
    after_case(site, "iperf3 -P 8")


def test_clients_that_stall_their_reads(site):
    """curl --limit-rate 10k on a big file (its window nearly shut for 4 s), and socket clients
    that ask for a big file and do not read at all for 3 s."""
    tb = site.tb
    curls = [traffic.curl(tb, [traffic.url(h, p, "/big")], max_time=4, limit_rate="10k")
             for h, p in site.targets("/big")]
    th = traffic.Threads()
    for h, p in site.targets("/big"):
        th.start(traffic.stalled_reader, tb, h, p, "/big", 3.0)
    res = th.join(timeout=30)
    assert all(r["bytes"] > 0 for r in res), res
    for c in curls:
        r = traffic.curl_result(c)
        assert r["rc"] == 28, r                   # stopped by --max-time, still reading slowly
        assert 10_000 <= r["bytes"][0] <= 200_000, r
    after_case(site, "stalled readers")


def test_rsync_daemon_both_families(site, tmp_path):
    """rsync from an rsync daemon over IPv4 and IPv6 at once (6 MiB each)."""
    tb = site.tb
    runs = []
    for fam, host in (("v4", site.v4), ("v6", f"[{site.v6}]")):
        dest = tmp_path / fam
        dest.mkdir()
        runs.append((dest, tb.popen(tb.client_ns, ["rsync", "--timeout=20", "-a",
                                                   f"rsync://{host}:{RSYNC}/data/file", str(dest)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    for dest, p in runs:
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        assert (dest / "file").stat().st_size == 6 << 20
    after_case(site, "rsync")

"""Uploads (issue 17): what the server receives, shaped on flowpacer's ifb, on real traffic.

One testbed for the module: in its server namespace iperf3 servers (bound to the IPv4 address:
pure IPv4 flows; dual-stack listeners: IPv6 flows and IPv4-mapped flows; one that no rule
matches) and flowpacer's own delivery server for a flow that goes both ways. One daemon (htb)
serves the cases; the crash case has a testbed and two daemons of its own. The rule ``ingest``
gives the iperf3 servers' TCP flows ``receive_rate: 10mbit``; ``borrow``/``no-borrow`` are
receive-only (5mbit with and without ``receive_ceil: 20mbit``); ``udp-ingest`` (rate and
receive_rate) and ``udp-receive-only`` shape ``iperf3 -u`` uploads.
Clients send from the client namespace (``iperf3`` without ``-R``: the client uploads); goodput
is what the server received, against the rate x 1448/1514 (1428/1514 over IPv6; UDP: its
datagram over its frame).

After each case (``after_case``): no traceback in the daemon's log, every stage running, the
receive side reported ok in status, and no flow class or filter left on either side within 3 s
of the last flow's end; after each daemon's clean stop no ifb, clsact, qdisc or filter is left.
"""
from __future__ import annotations

import threading
import time

import pytest

from flowpacer.kernel.backend.ingress import ifb_name
from harness import traffic
from harness.capture import kernel_objects, tc_show
from harness.daemon import Daemon, healthy, tracebacks
from harness.servers import blaster_server, iperf3_server
from harness.testbed import wait_for

pytestmark = pytest.mark.kernel

RECV_BIT = 10_000_000
SEND_BIT = 40_000_000
BORROW_RATE_BIT, BORROW_CEIL_BIT = 5_000_000, 20_000_000
P_V4, P_V6, P_MAPPED, P_FREE, P_DUPLEX = 5301, 5302, 5303, 5310, 5320
P_BORROW_V4, P_BORROW_V6, P_NO_BORROW = 5304, 5305, 5306
# the receive-only rules (borrow, no-borrow, udp-receive-only) have no rate: no send class
RULES = """
    interface: IFACE
    backend: htb
    link_rate: 1gbit
    rules:
      - name: ingest
        match: {process: iperf3, direction: inbound, local_port: 5301-5303}
        rate: 40mbit
        receive_rate: 10mbit
      - name: duplex
        match: {process: fp-duplex-srv, direction: inbound}
        rate: 40mbit
        receive_rate: 10mbit
      - name: borrow
        match: {process: iperf3, direction: inbound, local_port: 5304-5305}
        receive_rate: 5mbit
        receive_ceil: 20mbit
      - name: no-borrow
        match: {process: iperf3, direction: inbound, local_port: 5306}
        receive_rate: 5mbit
      - name: udp-ingest
        match: {process: iperf3, protocol: udp, local_port: 5301-5302}
        rate: 40mbit
        receive_rate: 10mbit
      - name: udp-receive-only
        match: {process: iperf3, protocol: udp, local_port: 5303}
        receive_rate: 10mbit
"""


@pytest.fixture(scope="module")
def bed(module_testbed):
    tb = module_testbed
    # (JSON reports: the UDP case reads what the server received from them)
    iperf3_server(tb, P_V4, bind=str(tb.server_v4), json=True)  # AF_INET: plain IPv4 flows
    iperf3_server(tb, P_V6, json=True)                  # dual-stack: the IPv6 client
    iperf3_server(tb, P_MAPPED, json=True)              # dual-stack: an IPv4-mapped flow
    iperf3_server(tb, P_FREE)                           # no rule: must not be limited
    iperf3_server(tb, P_BORROW_V4, bind=str(tb.server_v4))
    iperf3_server(tb, P_BORROW_V6)
    iperf3_server(tb, P_NO_BORROW)                      # dual-stack: an IPv4-mapped flow
    blaster_server(tb, [P_DUPLEX], name="fp-duplex-srv", v6=True)
    return tb


@pytest.fixture(scope="module")
def daemon(bed, tmp_path_factory):
    """One full daemon (tracer, first-byte) for the cases that do not stop it."""
    d = Daemon(bed, tmp_path_factory.mktemp("upload"), RULES).start()
    yield d
    rc = d.stop()
    assert rc == 0, f"the daemon exited {rc} on SIGTERM:\n{d.log_text()[-3000:]}"
    assert_all_gone(bed)
    assert not list(tracebacks(d.log_text()))


def ifb(tb) -> str:
    return ifb_name(tb.server_if)


def rx_objects(tb):
    return kernel_objects(tb, dev=ifb(tb))


def uploads(tb, seconds: float = 5.0):
    """IPv4, IPv6 and IPv4-mapped iperf3 uploads at once (started, not waited for)."""
    kinds = (("ipv4", tb.server_v4, P_V4), ("ipv6", tb.server_v6, P_V6),
             ("ipv4-mapped", tb.server_v4, P_MAPPED))
    return [(kind, traffic.iperf3(tb, host, port, seconds=seconds, reverse=False,
                                  extra=("-O", "1")))
            for kind, host, port in kinds]


def received_bps(doc: dict) -> float:
    """What the iperf3 server received, bytes of payload per second (omitted second excluded)."""
    return doc["end"]["sum_received"]["bits_per_second"] / 8


def check_uploads(started, what: str) -> dict:
    got = {}
    for kind, p in started:
        r = received_bps(traffic.iperf3_result(p, timeout=60))
        want = RECV_BIT / 8 * traffic.wire(kind == "ipv6")
        got[kind] = r * 8
        assert r == pytest.approx(want, rel=0.05), \
            f"{what}: the {kind} upload got {r * 8 / 1e6:.2f} Mbit/s, receive_rate says " \
            f"{RECV_BIT / 1e6:.0f} (x wire {want * 8 / 1e6:.2f})"
    return got


def after_case(tb, d, what: str) -> None:
    log = d.log_text()
    tbs = list(tracebacks(log))
    assert not tbs, f"after {what}: a traceback in the daemon's log:\n" + "\n---\n".join(tbs[:3])
    assert d.alive(), f"after {what}: the daemon exited {d.proc.returncode}:\n{log[-3000:]}"
    st = d.status()
    assert not healthy(st), f"after {what}: {healthy(st)}"
    assert st["receive"] == {"interface": ifb(tb), "state": "ok", "problem": ""}, st["receive"]

    def clean():
        return kernel_objects(tb) == (0, 0) and rx_objects(tb) == (0, 0)
    try:
        wait_for(clean, 3, 0.05, "every flow class and filter to go")
    except TimeoutError:
        raise AssertionError(
            f"after {what}: classes/filters left 3 s after the last flow: send "
            f"{kernel_objects(tb)}, receive {rx_objects(tb)}\n{tc_show(tb, 'class', dev=ifb(tb))}"
        ) from None


def assert_all_gone(tb) -> None:
    """After a clean stop: no ifb, no clsact, no root qdisc, no filter on either hook."""
    links = tb.run(tb.server_ns, ["ip", "-o", "link", "show"]).stdout
    assert ifb(tb) not in links, links
    qd = tc_show(tb, "qdisc")
    assert "clsact" not in qd and "htb" not in qd, qd
    assert not tc_show(tb, "filter").strip()
    assert not tb.run(tb.server_ns, ["tc", "filter", "show", "dev", tb.server_if,
                                     "ingress"], check=False).stdout.strip()


def receive_flows(d) -> list:
    return [f for f in d.flows() if f["side"] == "receive"]


def test_uploads_shaped_ipv4_ipv6_mapped_at_once(bed, daemon):
    tb = bed
    started = uploads(tb)
    # while they run: each data connection has a receive class of 10 Mbit/s, keyed by its
    # own (local, remote) tuple, and status says so
    wait_for(lambda: len([f for f in receive_flows(daemon) if f["bytes"] > 100_000]) >= 3, 10,
             0.1, "three busy receive classes")
    busy = [f for f in receive_flows(daemon) if f["bytes"] > 100_000]
    assert {f["rate_bit"] for f in busy} == {RECV_BIT} and {f["rule"] for f in busy} == {"ingest"}
    assert {f["family"] for f in busy} == {4, 6}
    got = check_uploads(started, "the batch")
    print(f"uploads received (Mbit/s): { {k: round(v / 1e6, 3) for k, v in got.items()} }")
    after_case(tb, daemon, "the upload batch")


def test_unruled_uploads_pass_the_ifb_unlimited(bed, daemon):
    """Every received packet goes through the ifb: the default class must not limit a flow that
    has no receive_rate (it borrows up to the link rate)."""
    tb = bed
    doc = traffic.iperf3_result(traffic.iperf3(tb, tb.server_v4, P_FREE, seconds=3,
                                               reverse=False, extra=("-O", "1")))
    got = received_bps(doc) * 8
    print(f"unruled upload through the ifb: {got / 1e6:.0f} Mbit/s")
    assert got > 200e6, f"an unruled upload got only {got / 1e6:.1f} Mbit/s through the ifb"
    assert not receive_flows(daemon)
    after_case(tb, daemon, "an unruled upload")


UPLOAD_ACROSS_CRASH_S = 10
DOWN_BYTES = 20_000_000       # ~4.2 s at 40 Mbit/s


def duplex(tb, host, port: int, up_seconds: float, warmup: float, box: dict) -> None:
    """One TCP connection both ways: a download of DOWN_BYTES (its goodput after ``warmup``
    into ``box["down_bps"]``), then an upload for ``up_seconds`` on the same connection
    (``box["uploading"]`` set when it starts)."""
    s = traffic.client_socket(tb, host, port)
    try:
        s.sendall(b"GET /upload/%d HTTP/1.0\r\n\r\n" % DOWN_BYTES)
        n = len(traffic.read_head(s)[1])
        buf = bytearray(1 << 16)
        t0 = time.monotonic()
        n0 = t1 = None
        while n < DOWN_BYTES:
            got = s.recv_into(buf)
            if not got:
                raise ConnectionError("the server closed in the body")
            n += got
            if n0 is None and time.monotonic() - t0 >= warmup:
                n0, t1 = n, time.monotonic()
        box["down_bps"] = (n - n0) / (time.monotonic() - t1)
        chunk = b"u" * 65536
        box["uploading"] = time.monotonic()
        while time.monotonic() - box["uploading"] < up_seconds:
            s.send(chunk)
        box["done"] = True
    finally:
        s.close()


def test_one_flow_download_and_upload_shaped_independently(bed, daemon):
    """One connection, two classes: its download at ``rate`` (the send class), then its upload
    at ``receive_rate`` (the receive class), both classes there all along. The upload's rate is
    read from its receive class's counters (wire bytes) in status.

    (Both directions at full load at once are shaped too, but TCP then cannot fill the
    download: its ACKs ride the upload through the 10 Mbit/s receive class, and BBR, this
    host's congestion control, got 6-16 of 40 Mbit/s. That is TCP's, not the classes'.)"""
    tb = bed
    box: dict = {}
    t = threading.Thread(target=duplex, args=(tb, tb.server_v6, P_DUPLEX, 5.0, 1.0, box),
                         daemon=True)
    t.start()

    def sides():
        fl = {f["side"]: f for f in daemon.flows() if f["rule"] == "duplex"}
        return fl if len(fl) == 2 else None
    both = wait_for(sides, 10, 0.1, "the duplex flow's send and receive classes")
    assert both["send"]["local"] == both["receive"]["local"]
    assert both["send"]["remote"] == both["receive"]["remote"]
    assert (both["send"]["rate_bit"], both["receive"]["rate_bit"]) == (SEND_BIT, RECV_BIT)
    wait_for(lambda: "uploading" in box or not t.is_alive(), 20, 0.05, "the upload to start")
    assert "uploading" in box, "the download did not finish"
    wait_for(lambda: time.monotonic() - box["uploading"] >= 1.5, 5, 0.05, "the upload to settle")
    f0, t0 = sides()["receive"], time.monotonic()
    wait_for(lambda: time.monotonic() - t0 >= 3.0, 5, 0.05, "3 s of upload")
    f1, t1 = sides()["receive"], time.monotonic()
    t.join(20)
    assert not t.is_alive() and box.get("done"), "the duplex client did not finish"
    up_bit = (f1["bytes"] - f0["bytes"]) * 8 / (t1 - t0)
    down_bit = box["down_bps"] * 8
    print(f"one flow: download {down_bit / 1e6:.2f} Mbit/s payload, upload "
          f"{up_bit / 1e6:.2f} Mbit/s wire")
    assert down_bit == pytest.approx(SEND_BIT * traffic.wire(True), rel=0.05)
    assert up_bit == pytest.approx(RECV_BIT, rel=0.05)
    after_case(tb, daemon, "the flow both ways")


def test_crash_with_receive_classes_then_restart_and_clean_stop(testbed, tmp_path):
    """SIGKILL while uploads run: the ifb, the redirect and the receive classes stay (and keep
    shaping); a new daemon adopts them (no second class, none left) and names their rule; a
    clean stop then removes the ifb, the clsact and its filter."""
    tb = testbed          # its own (the module's daemon must not share the interface)
    iperf3_server(tb, P_V4, bind=str(tb.server_v4))
    iperf3_server(tb, P_V6)
    iperf3_server(tb, P_MAPPED)
    # both daemons find flows by sock_diag only: they start in a second (the tracer's and
    # first-byte's compiles take ~40 s here, which the uploads would have to outlast);
    # adoption does not involve the tracer
    d = Daemon(tb, tmp_path, RULES, "--no-tracer", "--rescan", "0.2").start()
    started = uploads(tb, seconds=UPLOAD_ACROSS_CRASH_S)
    wait_for(lambda: len(receive_flows(d)) >= 6, 10, 0.1, "the uploads' receive classes")
    n = len(receive_flows(d))
    d.kill()
    assert rx_objects(tb) == (n, n), "the receive classes went with the daemon"
    t0 = time.monotonic()
    d2 = Daemon(tb, tmp_path, None, "--no-tracer", "--rescan", "0.2", log_mode="a").start()
    print(f"restarted daemon answering after {time.monotonic() - t0:.1f} s")
    try:
        wait_for(lambda: {f["rule"] for f in receive_flows(d2)} == {"ingest"}, 10, 0.1,
                 "adopted receive classes named by their rule")
        assert len(receive_flows(d2)) == n and rx_objects(tb) == (n, n)
        assert f"{ifb(tb)}: adopted flowpacer qdisc with {n} flow classes" in d2.log_text()
        check_uploads(started, "uploads across a crash")
        after_case(tb, d2, "a crash and restart")
    finally:
        rc = d2.stop()
    assert rc == 0, f"the daemon exited {rc} on SIGTERM:\n{d2.log_text()[-3000:]}"
    assert_all_gone(tb)
    assert not list(tracebacks(d2.log_text()))


def test_ifb_deleted_behind_the_daemon_is_rebuilt(bed, daemon):
    """Someone deletes the ifb (its redirect would then drop everything the interface gets):
    the next health check makes it again, points the redirect at it and re-adds the flows'
    receive classes; a new upload is shaped."""
    tb = bed
    first = traffic.iperf3(tb, tb.server_v4, P_V4, seconds=6, reverse=False)
    wait_for(lambda: len(receive_flows(daemon)) >= 2, 10, 0.1, "the upload's receive classes")
    old = tb.run(tb.server_ns, ["cat", f"/sys/class/net/{ifb(tb)}/ifindex"]).stdout.strip()
    tb.run(tb.server_ns, ["ip", "link", "del", ifb(tb)])

    def rebuilt():
        r = tb.run(tb.server_ns, ["cat", f"/sys/class/net/{ifb(tb)}/ifindex"], check=False)
        return r.returncode == 0 and r.stdout.strip() != old and rx_objects(tb)[0] >= 2
    wait_for(rebuilt, 5, 0.1, "the ifb and the receive classes back")
    ingress = tb.run(tb.server_ns, ["tc", "filter", "show", "dev", tb.server_if, "ingress"]).stdout
    # one redirect, to the new ifb (one left to the deleted ifb would drop every packet)
    assert ingress.count("mirred") == 1 and f"Redirect to device {ifb(tb)}" in ingress, ingress
    traffic.iperf3_result(first)           # the upload survived (only its queue was lost)
    assert "receive side (%s) was lost: rebuilt" % ifb(tb) in daemon.log_text()
    check_uploads([("ipv4", traffic.iperf3(tb, tb.server_v4, P_V4, seconds=4, reverse=False,
                                           extra=("-O", "1")))], "an upload after the rebuild")
    after_case(tb, daemon, "the ifb's rebuild")


def wait_busy(d, rules: set, n: int) -> list:
    def busy():
        got = [f for f in receive_flows(d) if f["rule"] in rules and f["bytes"] > 100_000]
        return got if len(got) >= n else None
    return wait_for(busy, 10, 0.1, f"{n} busy receive classes of {sorted(rules)}")


def test_receive_ceil_borrows_up_to_the_ceil_receive_only(bed, daemon):
    """receive_rate 5mbit, receive_ceil 20mbit (a receive-only rule): each upload flow borrows
    from the ifb's link class (f1f0:1, at link_rate) up to its own ceil, IPv4 and IPv6 at once;
    a flow of a rule without receive_ceil (IPv4-mapped, same batch) stays at 5 Mbit/s. The
    flows of these receive-only rules have no send class or filter at all."""
    tb = bed
    started = [(kind, traffic.iperf3(tb, host, port, seconds=4, reverse=False,
                                     extra=("-O", "1")))
               for kind, host, port in (("ipv4", tb.server_v4, P_BORROW_V4),
                                        ("ipv6", tb.server_v6, P_BORROW_V6),
                                        ("ipv4-mapped", tb.server_v4, P_NO_BORROW))]
    busy = wait_busy(daemon, {"borrow", "no-borrow"}, 3)
    assert {(f["rule"], f["rate_bit"], f["ceil_bit"]) for f in busy} == {
        ("borrow", BORROW_RATE_BIT, BORROW_CEIL_BIT), ("no-borrow", BORROW_RATE_BIT,
                                                        BORROW_RATE_BIT)}, busy
    assert {f["family"] for f in busy} == {4, 6}
    # receive-only: status lists them on the receive side only, and the interface's own qdisc
    # has no flow class or filter for them (nothing else runs now)
    assert not [f for f in daemon.flows() if f["rule"] in ("borrow", "no-borrow")
                and f["side"] != "receive"]
    assert kernel_objects(tb) == (0, 0), tc_show(tb, "class")
    # the receive classes hang under the ifb's link class, which is at link_rate (1 Gbit/s):
    # that is what they borrow from
    classes = tc_show(tb, "class", dev=ifb(tb))
    link_cls = [ln for ln in classes.splitlines() if ln.startswith("class htb f1f0:1 root")]
    assert link_cls and "rate 1Gbit ceil 1Gbit" in link_cls[0], classes
    for f in busy:
        line = next(ln for ln in classes.splitlines() if f" {f['classid']} " in ln)
        assert "parent f1f0:1 " in line, line
    got = {}
    for kind, p in started:
        r = received_bps(traffic.iperf3_result(p, timeout=60)) * 8
        got[kind] = r
        want = (BORROW_RATE_BIT if kind == "ipv4-mapped" else BORROW_CEIL_BIT) \
            * traffic.wire(kind == "ipv6")
        assert r == pytest.approx(want, rel=0.05), \
            f"the {kind} upload got {r / 1e6:.2f} Mbit/s, want {want / 1e6:.2f} " \
            f"({'receive_rate, no ceil' if kind == 'ipv4-mapped' else 'its receive_ceil'})"
    print(f"receive_ceil uploads received (Mbit/s): { {k: round(v / 1e6, 3) for k, v in got.items()} }")
    after_case(tb, daemon, "the receive_ceil batch")


def test_udp_uploads_ipv4_ipv6_and_receive_only_at_once(bed, daemon):
    """``iperf3 -u -b 50M`` uploads (the client sends, iperf3's server receives) over IPv4,
    IPv6 (rule udp-ingest: rate and receive_rate 10mbit) and IPv4-mapped (udp-receive-only:
    receive_rate only), all at once: what iperf3's server received (its own JSON report) is
    10 Mbit/s x payload/wire within 3 %, and the clients did offer 50 (``send_buffer_max``).

    iperf3's UDP server connect()s its socket to the client when the first datagram arrives
    (and opens a new unconnected socket for the next test), so the flow is a connected UDP
    socket: the tracer's connect hook (or sock_diag's rescan) reports it although the server
    never sends a datagram; its receive filter matches the reversed tuple, protocol 17."""
    tb = bed
    kinds = (("ipv4", tb.server_v4, P_V4), ("ipv6", tb.server_v6, P_V6),
             ("ipv4-mapped", tb.server_v4, P_MAPPED))
    with traffic.send_buffer_max():
        started = [(kind, traffic.udp_upload(tb, host, port)) for kind, host, port in kinds]

        def udp_flows():
            fl = [f for f in daemon.flows() if f["protocol"] == "udp"
                  and f["rule"] in ("udp-ingest", "udp-receive-only")]
            # udp-ingest: IPv4 and IPv6, each a send and a receive class; udp-receive-only: one
            return fl if len({(f["rule"], f["local"], f["side"]) for f in fl}) >= 5 else None
        fl = wait_for(udp_flows, 10, 0.1, "the three UDP uploads' classes")
        recv = [f for f in fl if f["side"] == "receive"]
        assert {(f["rule"], f["rate_bit"]) for f in recv} == {("udp-ingest", RECV_BIT),
                                                             ("udp-receive-only", RECV_BIT)}
        assert {f["family"] for f in recv} == {4, 6}
        # udp-ingest has a rate: a send class too (the server sends nothing on it); the
        # receive-only rule's flow has none
        assert {f["rule"] for f in fl if f["side"] == "send"} == {"udp-ingest"}
        print("UDP upload flows found by: "
              f"{sorted({(f['rule'], f['side'], f['source']) for f in fl})}")
        got = {kind: traffic.udp_upload_received(p) for kind, p in started}
    for kind, g in got.items():
        want = RECV_BIT / 8 * traffic.udp_wire(kind == "ipv6")
        r = g["received_bps"]
        assert r == pytest.approx(want, rel=0.03), \
            f"UDP {kind}: iperf3's server received {r * 8 / 1e6:.3f} Mbit/s, want " \
            f"{want * 8 / 1e6:.3f} (10 Mbit/s x payload/wire); the client sent " \
            f"{g['sent_bps'] * 8 / 1e6:.1f} Mbit/s, the server lost {g['lost_percent']:.1f} %"
        assert g["sent_bps"] * 8 > 45e6, \
            f"UDP {kind}: the client offered only {g['sent_bps'] * 8 / 1e6:.1f} of 50 Mbit/s"
    print("UDP uploads (received Mbit/s, sent Mbit/s, lost %): " + str(
        {k: (round(g["received_bps"] * 8e-6, 3), round(g["sent_bps"] * 8e-6, 1),
             round(g["lost_percent"], 1)) for k, g in got.items()}))
    after_case(tb, daemon, "the UDP uploads")

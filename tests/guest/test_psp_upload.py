"""Uploads (issue 17) with the psp backend, inside the VM where sch_psp is loaded.

``flowpacer run --no-tracer`` in the server namespace with a rule that gives iperf3's TCP flows
``receive_rate: 3mbit`` and a receive-only UDP rule (``receive_rate: 10mbit``, no rate): the
daemon makes its ifb, redirects the interface's ingress to it and puts a psp root qdisc and one
psp class per flow there. iperf3 clients in the client namespace upload (no ``-R``) over IPv4
and IPv6 at once; what the server received must be within 5 % of 3 Mbit/s x 1448/1514
(1428/1514 over IPv6); a third at the same time, of the receive-only rule ``borrow``
(``receive_rate: 3mbit``, ``receive_ceil: 6mbit``), borrows up to 6 Mbit/s (85-105 % of it). Then ``iperf3 -u -b 50M`` uploads over IPv4 and IPv6 at once: iperf3's
server connects its UDP socket to the client (sock_diag finds it: no tracer here), the flows get
a psp receive class and no send class, and the server's own report says 10 Mbit/s x
payload/frame within 3 %. While they run each data flow has its psp class on the ifb at the
rule's rate; after they end the classes go; SIGTERM removes the ifb and the clsact.
"""
from __future__ import annotations

import json
import subprocess

import pytest

from harness import psplib
from flowpacer.kernel.backend.ingress import ifb_name
from harness import traffic
from harness.daemon import Daemon
from harness.servers import iperf3_server
from harness.testbed import Testbed, wait_for
from harness.traffic import WIRE, WIRE6
from harness.psplib import PspNl

RECV = 3_000_000
CEIL = 6_000_000          # rule borrow: receive-only, receive_ceil (a lone flow borrows up to it)
P_V4, P_V6, P_BORROW = 5401, 5402, 5403
RULES = """
    interface: IFACE
    backend: psp
    link_rate: 1gbit
    rules:
      - name: borrow
        match: {process: iperf3, direction: inbound, local_port: 5403}
        receive_rate: 3mbit
        receive_ceil: 6mbit
      - name: ingest
        match: {process: iperf3, direction: inbound}
        rate: 20mbit
        receive_rate: 3mbit
      - name: udp-up
        match: {process: iperf3, protocol: udp}
        receive_rate: 10mbit
"""
UDP_RECV = 10_000_000


def _rx(tb: Testbed):
    """(psp root qdisc, {minor: class}) on the receive side's ifb (None, {} without it)."""
    with PspNl(tb.server_ns) as sock:
        try:
            return sock.root(ifb_name(tb.server_if)), sock.classes(ifb_name(tb.server_if))
        except Exception:            # no such device
            return None, {}


def test_uploads_paced_by_psp_on_the_ifb(tb, tmp_path, big_rmem):
    iperf3_server(tb, P_V4, bind=str(tb.server_v4), json=True)
    iperf3_server(tb, P_V6, json=True)
    iperf3_server(tb, P_BORROW)
    # bounded by a condition, long: TCG on a shared 2-core host starts Python slowly
    d = Daemon(tb, tmp_path, RULES, "--no-tracer", "--no-metrics", "--rescan", "0.5")
    try:
        d.start(timeout=300)
    except TimeoutError:
        d.stop(timeout=30)
        pytest.fail(f"the daemon did not answer in 300 s; its log:\n{d.log_text()[-4000:]}")
    try:
        st = d.status_cli()
        assert st["backend"] == "psp" and st["receive"]["state"] == "ok", st
        q, cls = _rx(tb)
        assert q is not None and list(cls) == [2], (q, cls)
        clients = {fam: tb.popen(tb.client_ns, ["iperf3", "-c", str(host), "-p", str(port),
                                                "-t", "10", "-O", "3", "-J"],
                                 stdout=subprocess.PIPE, text=True)
                   for fam, host, port in ((4, tb.server_v4, P_V4), (6, tb.server_v6, P_V6),
                                           ("borrow", tb.server_v4, P_BORROW))}
        rx = wait_for(lambda: (lambda f: f if len(f) >= 6 else None)(
            [f for f in d.flows() if f["side"] == "receive"]), 30, 0.2,
            "the uploads' receive classes (data and control flows)")
        _, cls = _rx(tb)
        for f in rx:
            minor = int(f["classid"].split(":")[1], 16)
            assert f["rate_bit"] == RECV and minor in cls, (f, sorted(cls))
            assert cls[minor].rate == RECV // 8
        borrow = [f for f in rx if f["rule"] == "borrow"]
        assert borrow and {f["ceil_bit"] for f in borrow} == {CEIL}, rx
        assert not [f for f in d.flows() if f["rule"] == "borrow" and f["side"] == "send"]
        off = []           # rates off their goal: all measured (TCP and UDP), then judged
        for fam, c in clients.items():
            out, _ = c.communicate(timeout=120)
            doc = json.loads(out)
            assert c.returncode == 0, doc.get("error")
            got = doc["end"]["sum_received"]["bits_per_second"] / 8
            goal = CEIL if fam == "borrow" else RECV
            want = goal / 8 * (WIRE6 if fam == 6 else WIRE)
            what = ("IPv4, receive_rate 3 Mbit, receive_ceil 6 Mbit" if fam == "borrow"
                    else f"IPv{fam}: receive_rate {RECV / 1e6:g} Mbit")
            psplib.record(f"psp upload ({what}): received {got * 8 / 1e6:.3f} Mbit/s = "
                          f"{100 * got / want:.2f} % of {goal / 1e6:g} Mbit x wire")
            # borrowing: far above its rate, never above its ceil; how close to the ceil a TCP
            # flow shaped at the receiver gets depends on the vCPUs it gets: 99.0-99.1 % on a
            # quiet host, 90.6 % in make test beside the untimed lane's guest (the 3 Mbit flows
            # beside it: 99.98 %)
            low = 0.85 if fam == "borrow" else 0.95
            if not low * want <= got <= 1.05 * want:
                off.append(f"TCP {what}: {got * 8 / 1e6:.3f} Mbit/s, want "
                           f"{want * 8 / 1e6:.3f} -{100 * (1 - low):.0f} % / +5 %")
        wait_for(lambda: list(_rx(tb)[1]) == [2], 10, 0.1, "the ended uploads' classes to go")
        off += udp_uploads(tb, d)
        wait_for(lambda: list(_rx(tb)[1]) == [2], 10, 0.1, "the UDP uploads' classes to go")
        assert not off, "; ".join(off)
    finally:
        rc = d.stop()
    assert rc == 0, d.log.read_text()[-3000:]
    assert "Traceback" not in d.log.read_text()
    links = tb.run(tb.server_ns, ["ip", "-o", "link", "show"]).stdout
    assert ifb_name(tb.server_if) not in links, links
    assert "clsact" not in tb.run(tb.server_ns, ["tc", "qdisc", "show", "dev",
                                                 tb.server_if]).stdout


def udp_uploads(tb: Testbed, d: Daemon) -> list:
    """``iperf3 -u -b 50M`` over IPv4 and IPv6 at once under the receive-only rule udp-up; the
    rates off their goal (received within 3 % of 10 Mbit/s x payload/frame, 50 offered)."""
    with traffic.send_buffer_max():
        runs = {fam: traffic.udp_upload(tb, host, port, seconds=6, omit=2)
                for fam, host, port in ((4, tb.server_v4, P_V4), (6, tb.server_v6, P_V6))}

        def flows():
            fl = [f for f in d.flows() if f["rule"] == "udp-up"]
            return fl if len(fl) >= 2 else None
        fl = wait_for(flows, 30, 0.2, "the UDP uploads' receive classes (sock_diag)")
        assert {(f["side"], f["protocol"], f["rate_bit"]) for f in fl} == {
            ("receive", "udp", UDP_RECV)}, fl                # receive-only: no send class
        assert {f["family"] for f in fl} == {4, 6}, fl
        _, cls = _rx(tb)
        for f in fl:
            assert cls[int(f["classid"].split(":")[1], 16)].rate == UDP_RECV // 8
        got = {fam: traffic.udp_upload_received(p, timeout=120) for fam, p in runs.items()}
    off = []
    for fam, g in got.items():
        want = UDP_RECV / 8 * traffic.udp_wire(fam == 6)
        r = g["received_bps"]
        psplib.record(f"psp UDP upload (IPv{fam}): receive_rate {UDP_RECV / 1e6:g} Mbit, "
                      f"{g['sent_bps'] * 8 / 1e6:.1f} Mbit/s offered: received "
                      f"{r * 8 / 1e6:.3f} Mbit/s = {100 * r / want:.2f} % of rate x payload/"
                      f"frame, lost {g['lost_percent']:.1f} %")
        # the guest's emulated CPUs do not always make 2 x 50 Mbit/s of datagrams (28-49 seen
        # quiet, 19.9 beside the untimed lane's guest): what matters is that well more than the
        # rate was offered and the excess dropped
        if g["sent_bps"] * 8 < 1.5 * UDP_RECV:
            off.append(f"UDP IPv{fam}: offered only {g['sent_bps'] * 8e-6:.1f} Mbit/s, not "
                       f"1.5 times the receive_rate")
        if r != pytest.approx(want, rel=0.03):
            off.append(f"UDP IPv{fam}: received {r * 8 / 1e6:.3f} Mbit/s, want "
                       f"{want * 8 / 1e6:.3f} within 3 %")
    return off


def test_crash_with_psp_receive_classes_then_restart_and_clean_stop(tb, tmp_path, big_rmem):
    """SIGKILL while uploads over IPv4 and IPv6 run: the ifb, the redirect and the psp receive
    classes stay; a new daemon adopts them (no second class or ifb, none left) and names their
    rule; when the uploads end their classes go; a clean stop removes the ifb and the clsact.
    Both daemons find flows by sock_diag (``--no-tracer``): adoption does not involve it."""
    iperf3_server(tb, P_V4, bind=str(tb.server_v4))
    iperf3_server(tb, P_V6)
    d = Daemon(tb, tmp_path, RULES, "--no-tracer", "--no-metrics", "--rescan", "0.5")
    d.start(timeout=300)
    clients = [tb.popen(tb.client_ns, ["iperf3", "-c", str(host), "-p", str(port), "-t", "90"],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
               for host, port in ((tb.server_v4, P_V4), (tb.server_v6, P_V6))]
    d2 = None
    try:
        rx = wait_for(lambda: (lambda f: f if len(f) >= 4 else None)(
            [f for f in d.flows() if f["side"] == "receive"]), 60, 0.2,
            "the uploads' receive classes (data and control flows)")
        n = len(rx)
        d.kill()
        _, cls = _rx(tb)
        assert len(cls) == n + 1, (n, sorted(cls))           # + the default class
        d2 = Daemon(tb, tmp_path, None, "--no-tracer", "--no-metrics", "--rescan", "0.5",
                    log_mode="a")
        d2.start(timeout=300)
        wait_for(lambda: {f["rule"] for f in d2.flows() if f["side"] == "receive"} == {"ingest"}
                 and len([f for f in d2.flows() if f["side"] == "receive"]) == n, 60, 0.2,
                 "the adopted receive classes named by their rule")
        q, cls2 = _rx(tb)
        assert q is not None and sorted(cls2) == sorted(cls), (sorted(cls), sorted(cls2))
        log = d2.log_text()
        assert f"{ifb_name(tb.server_if)}: adopted flowpacer qdisc with {n} flow classes" in log, \
            log[-3000:]
        links = tb.run(tb.server_ns, ["ip", "-o", "link", "show"]).stdout
        assert links.count(ifb_name(tb.server_if)) == 1, links
        for c in clients:
            c.terminate()
            c.wait(30)
        wait_for(lambda: list(_rx(tb)[1]) == [2], 60, 0.2, "the ended uploads' classes to go")
    finally:
        for c in clients:
            if c.poll() is None:
                c.kill()
        rc = (d2 or d).stop()
    assert rc == 0, (d2 or d).log_text()[-3000:]
    assert "Traceback" not in d.log.read_text()
    links = tb.run(tb.server_ns, ["ip", "-o", "link", "show"]).stdout
    assert ifb_name(tb.server_if) not in links, links
    assert "clsact" not in tb.run(tb.server_ns, ["tc", "qdisc", "show", "dev",
                                                 tb.server_if]).stdout

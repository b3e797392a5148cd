"""UDP flows through the daemon with its tracer and the psp backend (issue 17), in the VM where
sch_psp is loaded (Debian's 6.1; 6.12 with FLOWPACER_VM_KERNEL=6.12), plain TCG, real time.

The host runs these cases with htb (tests/test_udp.py); here the same pieces
(``harness.udpcases``) run against psp classes, with the tracer's cgroup programs compiled and
attached on Debian's kernel (one bcc compile, 1-2 minutes under TCG; first-byte shaping is left
out with FLOWPACER_NO_FIRST_BYTE, it would be a second compile and has its own guest test):

1. one unconnected dual-stack socket (``harness.udpflows serve``, what a QUIC server does)
   answering an IPv4 peer (IPv4-mapped on the socket) and an IPv6 peer: a psp class each at the
   rule's rate, each receiver at the rate within 3 %; the socket stays open and both flows go
   after the rule's 2 s idle_timeout;
2. connected IPv4, IPv6 and IPv4-mapped sockets sending with sendmmsg (no address: the cgroup
   egress program sees their sends): a psp class each; silent past their idle_timeout the
   classes go, sending again they come back at the rule's rate at the receiver, closed they go.

After each case: no traceback, every stage running, no class or filter left.
"""
from __future__ import annotations

import os
import time

import pytest

from harness import psplib
from harness import traffic
from harness.capture import kernel_objects, tc_show
from harness.daemon import Daemon
from harness.testbed import PY, wait_for
from harness.udpcases import (PORT, SIZE, ConnectedSenders, after_case, at_rate, conn_flows,
                              peers_at_rate, recv, result, udp_flows, wait_idled_out, wire)
from harness.psplib import PspNl

RATE_BIT = 4_000_000          # TCG's Python streams a few Mbit/s per peer comfortably
RATE_TXT = "4mbit"
RULES = f"""
    interface: IFACE
    backend: psp
    link_rate: 1gbit
    rules:
      - name: quic
        match: {{process: fp-udp-srv, protocol: udp, local_port: {PORT}}}
        rate: {RATE_TXT}
        idle_timeout: 2s
      - name: conn-udp
        match: {{process: fp-udp-conn, protocol: udp}}
        rate: {RATE_TXT}
        idle_timeout: 2s
"""
# guest-side limits: the daemon's Python and the tracer's sweeps run several times slower here
LATEST_IDLE_S = 10.0


@pytest.fixture
def site(tb, tmp_path, big_rmem):
    # the servers' sockets ask for 4 MiB send buffers (Debian caps them at 208 KiB): one
    # unconnected socket serves both peers, and datagrams waiting in either peer's psp class
    # (1000 packets) count against its buffer, so with the cap a full class held back the other
    # peer's sends too (3.75 and 3.51 of 3.87 and 3.80 Mbit/s)
    with traffic.send_buffer_max(16 << 20):
        yield from _site(tb, tmp_path)


def _site(tb, tmp_path):
    tb.popen(tb.server_ns, [PY, "-m", "harness.udpflows", "serve", "--port", str(PORT)])
    tb.wait_listening(PORT, timeout=60)
    d = Daemon(tb, tmp_path, RULES, "--no-metrics",
               env=dict(os.environ, FLOWPACER_NO_FIRST_BYTE="1"))
    try:
        d.start(timeout=600)                     # bcc compiles the tracer: minutes under TCG
    except TimeoutError:
        d.stop(timeout=30)
        pytest.fail(f"the daemon did not answer in 600 s; its log:\n{d.log_text()[-4000:]}")
    try:
        st = d.status()
        assert st["backend"] == "psp", st
        assert "cgroup udp" in st["flow_source"], st["flow_source"]
        yield tb, d
    finally:
        rc = d.stop()
    assert rc == 0, f"the daemon exited {rc} on SIGTERM:\n{d.log_text()[-3000:]}"


def _psp_rates(tb) -> dict:
    """{minor: rate (bytes/s)} of the psp classes on the server interface."""
    with PspNl(tb.server_ns) as sock:
        return {m: c.rate for m, c in sock.classes(tb.server_if).items()}


def test_psp_udp_peers_and_connected_sockets_idle_out(site):
    tb, d = site
    # 1. two peers of one unconnected socket
    runs = [recv(tb, tb.server_v4, seconds=6, warmup=2, rate=2 * RATE_BIT),
            recv(tb, tb.server_v6, seconds=6, warmup=2, rate=2 * RATE_BIT)]
    seen = wait_for(lambda: len(udp_flows(d)) >= 2 and udp_flows(d), 20, 0.1,
                    "both peers' flows in status")
    assert {f["rule"] for f in seen} == {"quic"}, seen
    assert sorted(f["local"] for f in seen) == ["0.0.0.0:7001", "[::]:7001"], seen
    rates = _psp_rates(tb)
    for f in seen:
        assert rates[int(f["classid"].split(":")[1], 16)] == RATE_BIT // 8, (f, rates)
    res = [result(r, timeout=120) for r in runs]
    psplib.record("psp UDP, two peers of one unconnected socket (rule 4 Mbit/s): " + ", ".join(
        f"IPv{fam} {r['goodput_bps'] * 8 / 1e6:.3f} Mbit/s payload (want "
        f"{RATE_BIT * wire(SIZE, fam == 6) / 1e6:.3f})" for fam, r in zip((4, 6), res)))
    peers_at_rate(res, "psp, unconnected peer", rate_bps=RATE_BIT / 8)
    ended = time.monotonic()
    wait_for(lambda: kernel_objects(tb) == (0, 0) and not udp_flows(d), LATEST_IDLE_S + 1, 0.1,
             "the idle peers' classes to go")
    gone = time.monotonic() - ended
    psplib.record(f"psp UDP: idle peers' classes gone {gone:.2f} s after the last datagram "
                  "(idle_timeout 2 s)")
    assert gone >= 1.5, f"the peers' flows went {gone:.2f} s after the last datagram, before " \
                        "their 2 s idle_timeout"
    after_case(tb, d, "psp: two peers of one unconnected socket", wait_s=20)

    # 2. connected sockets: idle out, shaped again, closed
    with ConnectedSenders(tb) as cs:
        wait_for(lambda: len(conn_flows(d)) == 3, 20, 0.1, "the three connected sockets' flows")
        cs.send(1.0, 2 * RATE_BIT)
        gone = wait_idled_out(tb, d, time.monotonic(), "psp: idle connected sockets'", LATEST_IDLE_S)
        t0 = time.monotonic()
        assert cs.send(6.0, 2 * RATE_BIT)["sent"] > 0
        t1 = time.monotonic()
        assert len(conn_flows(d)) == 3 and kernel_objects(tb)[0] == 3, \
            f"not shaped again: {conn_flows(d)}\n{tc_show(tb, 'class')}"
        got = cs.report(t0 + 2.0, t1)
        psplib.record(f"psp UDP, connected IPv4/IPv6/mapped sockets: classes gone {gone:.2f} s "
                      f"after their last datagram (idle_timeout 2 s); sending again: " + ", ".join(
                          f"{k} {v * 8 / 1e6:.3f} Mbit/s" for k, v in sorted(got.items())))
        for what, addr, port, v6 in (("IPv4", tb.server_v4, cs.ports["v4"], False),
                                     ("IPv6", tb.server_v6, cs.ports["v6"], True),
                                     ("IPv4-mapped", tb.server_v4, cs.ports["mapped"], False)):
            at_rate(got.get(f"{addr} {port}", 0.0), v6,
                    f"psp, connected {what} sending again after idling out", f": {got}",
                    rate_bps=RATE_BIT / 8)
        assert d.status()["tracer"]["udp"]["woken"] >= 3
        cs.close()
        wait_for(lambda: not conn_flows(d), 20, 0.1, "the closed sockets' flows to go")
    after_case(tb, d, "psp: connected UDP sockets idling out and sending again", wait_s=20)

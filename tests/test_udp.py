"""UDP flows on real traffic (issue 17), htb on the host, one testbed and one daemon.

- ``iperf3 -u -R`` offering 50 Mbit/s over IPv4 and IPv6 at once (iperf3's server connects its
  UDP socket to the client: connected-socket flows), ruled at 10 Mbit/s: each receiver sees
  10 Mbit/s (payload against rate x payload/wire) within 3 %;
- one unconnected dual-stack socket (``harness.udpflows``, what a QUIC server does) answering an
  IPv4 peer (IPv4-mapped on the socket) and an IPv6 peer: each shaped on its own, and both
  removed after the rule's 2 s idle_timeout while the socket stays open;
- a TCP and a UDP flow of the same ports at once, each shaped by its own rule;
- an unconnected server answering an IPv4 and an IPv6 peer with ``sendmmsg`` (both peers in one
  call, each message with its address): each peer shaped on its own;
- connected sockets (IPv4, IPv6, IPv4-mapped) sending with ``sendmmsg`` (no address): shaped,
  gone after their 2 s idle_timeout while the sockets stay open (status counts it), shaped again
  when they send again, gone at close.
After each case: no traceback, every stage running, no class or filter left.
"""
from __future__ import annotations

import json
import subprocess
import time

import pytest

from harness import traffic
from harness.capture import kernel_objects, tc_show
from harness.daemon import Daemon
from harness.servers import iperf3_server
from harness.testbed import PY, wait_for
from harness.udpcases import (PORT, RATE_BPS, SIZE, ConnectedSenders, after_case, at_rate,
                              conn_flows, peers_at_rate, recv, result, udp_flows, wait_idled_out,
                              wire)

pytestmark = pytest.mark.kernel

RULES = """
    interface: IFACE
    backend: htb
    link_rate: 1gbit
    rules:
      - name: iperf-udp
        match: {process: iperf3, protocol: udp}
        rate: 10mbit
      - name: quic
        match: {process: fp-udp-srv, protocol: udp, local_port: 7001}
        rate: 10mbit
        idle_timeout: 2s
      - name: same-ports-tcp
        match: {process: fp-udp-srv, protocol: tcp, local_port: 7001}
        rate: 20mbit
      - name: quic-mmsg
        match: {process: fp-udp-mmsg, protocol: udp, local_port: 7003}
        rate: 10mbit
        idle_timeout: 2s
      - name: conn-udp
        match: {process: fp-udp-conn, protocol: udp}
        rate: 10mbit
        idle_timeout: 2s
"""
IPERF_V4, IPERF_V6 = 5301, 5302
MMSG_PORT = 7003


@pytest.fixture(scope="module")
def site(module_testbed, tmp_path_factory):
    tb = module_testbed
    work = tmp_path_factory.mktemp("udp")
    # the servers' 4 MiB send buffers (Debian caps them at 208 KiB): an unconnected socket
    # serving two peers is held back by datagrams waiting in either peer's class otherwise
    with traffic.send_buffer_max(16 << 20):
        iperf3_server(tb, IPERF_V4)
        iperf3_server(tb, IPERF_V6)
        tb.popen(tb.server_ns, [PY, "-m", "harness.udpflows", "serve", "--port", str(PORT)])
        tb.wait_listening(PORT)
        tb.popen(tb.server_ns, [PY, "-m", "harness.udpflows", "serve", "--port", str(MMSG_PORT),
                                "--name", "fp-udp-mmsg", "--mmsg"])
        tb.wait_listening(MMSG_PORT)
        d = Daemon(tb, work, RULES, "--backend", "htb").start()
        yield tb, d
        rc = d.stop()
        assert rc == 0, f"the daemon exited {rc} on SIGTERM:\n{d.log_text()[-3000:]}"


def test_tracer_udp_peers_connected_release_idle_and_filter(module_testbed):
    """The tracer alone in the server namespace: a target's unconnected dual-stack socket gives
    one OPEN per peer (IPv4 via the mapped address, IPv6), each connected socket (IPv4, IPv6,
    IPv4-mapped) one OPEN; every one of them silent for the shortest idle_timeout is reported
    IDLE (the connected ones seen by the cgroup/skb egress program: their send()s carry no
    address); a connected socket that sends again is OPEN again (WAKE); closing them gives their
    CLOSEs; a non-target's datagrams are filtered in the kernel. (The VM runs the connected
    half on 6.1: tests/guest/test_udp_tracer.py.)"""
    import os
    from flowpacer import model
    from flowpacer.sources.tracer import Tracer
    from harness.udpflows import ProbeRun
    tb = module_testbed
    ino = os.stat(f"/run/netns/{tb.server_ns}").st_ino
    t = Tracer(netns_ino=ino, ring_pages=8)
    t.set_watch({"fp-udp-probe"}, None)
    t.start()
    try:
        assert "cgroup udp" in t.hooks, t.hooks
        t.set_udp_idle(1_000_000_000, 10_000_000_000)
        other = ProbeRun(tb, t, 0, name="fp-not-target")
        r = ProbeRun(tb, t, 2.5, again=True)
        want = r.peers | r.connected
        OPEN, IDLE, CLOSE = model.EventKind.OPEN, model.EventKind.IDLE, model.EventKind.CLOSE
        r.until(f"OPEN of {sorted(want)}", lambda: want <= set(r.of(OPEN)), 5)
        opens = [e for e in r.events if e.kind is OPEN]
        assert len(opens) == 5, "\n".join(f"{e.flow.key} {e.flow.direction}" for e in opens)
        assert {e.flow.proc.comm for e in opens} == {"fp-udp-probe"}
        assert {e.flow.direction for e in opens} == {model.Direction.INBOUND,
                                                     model.Direction.OUTBOUND}
        r.until("IDLE of every flow", lambda: want <= set(r.of(IDLE)), 5)
        r.until("the connected sockets OPEN again when they send again",
                lambda: all(r.of(OPEN).count(k) == 2 for k in r.connected), 5)
        again = [e for e in r.events if e.kind is OPEN][5:]
        assert {e.flow.proc.comm for e in again} == {"fp-udp-probe"}, again
        r.until(f"CLOSE of {sorted(want)}", lambda: want <= set(r.of(CLOSE)), 5)
        assert all(r.of(OPEN).count(k) == 1 for k in r.peers)
        assert all(r.of(IDLE).count(k) == 1 for k in r.connected), \
            "a connected socket reported IDLE more than once in one silence"
        r.proc.wait(10)
        other.proc.wait(10)
        st = t.stats()
        assert st["filtered"] >= 1          # the non-target's datagrams
        assert st["udp"]["woken"] == 3, st["udp"]
    finally:
        t.close()


def test_sockdiag_lists_connected_udp_and_unconnected_ports(module_testbed):
    """sock_diag (the reconcile pass): a connected UDP socket is a UDP flow with its owner; an
    unconnected socket gives only its local port (its peers are the tracer's)."""
    from flowpacer import model
    from flowpacer.sources.sockdiag import SockDiagSource
    from harness.testbed import in_netns
    tb = module_testbed
    p = tb.popen(tb.server_ns, [PY, "-m", "harness.udpflows", "probe", "--v4", str(tb.client_v4),
                                "--v6", str(tb.client_v6), "--hold", "3"],
                 stdout=subprocess.PIPE, text=True)
    ports = json.loads(p.stdout.readline())
    with in_netns(tb.server_ns):
        snap = SockDiagSource().snapshot()
    p.kill()
    key = model.FlowKey(tb.server_v4, ports["connected"], tb.client_v4, 9, model.Protocol.UDP)
    assert key in snap, sorted(map(str, snap))
    assert snap[key].proc.comm == "fp-udp-probe" and snap[key].direction is model.Direction.OUTBOUND
    assert snap.udp_cookies.get(key), "no socket cookie for the connected socket (the tracer " \
        "follows an adopted socket's sends by it)"
    assert ports["unconnected"] in snap.udp_ports
    assert not [k for k in snap if k.local_port == ports["unconnected"]]


def test_iperf3_udp_both_families_at_rate(site):
    tb, d = site
    extra = ["-u", "-b", "50M", "-l", str(SIZE), "-O", "1"]
    runs = [traffic.iperf3(tb, tb.server_v4, IPERF_V4, seconds=4, extra=extra),
            traffic.iperf3(tb, tb.server_v6, IPERF_V6, seconds=4, extra=extra)]
    docs = [traffic.iperf3_result(r) for r in runs]
    for doc, v6 in zip(docs, (False, True)):
        s = doc["end"]["sum"]
        at_rate(s["bytes"] / s["seconds"], v6, f"iperf3 -u IPv{6 if v6 else 4}",   # -R: client
                f"; lost {s.get('lost_percent')} %")                            # receives
    after_case(tb, d, "iperf3 -u")


def test_unconnected_server_two_peers_each_shaped_then_idle(site):
    tb, d = site
    runs = [recv(tb, tb.server_v4), recv(tb, tb.server_v6)]
    seen = wait_for(lambda: len(udp_flows(d)) >= 2 and udp_flows(d), 3, 0.05,
                    "both peers' flows in status")
    assert {f["rule"] for f in seen} == {"quic"}
    locals_ = sorted(f["local"] for f in seen)
    assert locals_ == ["0.0.0.0:7001", "[::]:7001"], locals_   # wildcard socket, both families
    peers_at_rate([result(r) for r in runs], "unconnected peer")
    ended = time.monotonic()
    # the socket stays open: the flows end by idleness, not before the 2 s idle_timeout
    time.sleep(max(0.0, ended + 1.0 - time.monotonic()))     # a point in time, not a wait
    assert kernel_objects(tb)[0] == 2 and len(udp_flows(d)) == 2, \
        "the peers' flows went before their idle_timeout"
    wait_for(lambda: kernel_objects(tb) == (0, 0) and not udp_flows(d), 6, 0.1,
             "the idle peers' classes to go")
    gone = time.monotonic() - ended
    print(f"idle peers' classes gone {gone:.2f} s after the last datagram (idle_timeout 2 s)")
    assert 1.5 <= gone <= 5.0, f"idle flows removed {gone:.2f} s after the last datagram"
    after_case(tb, d, "two peers of one unconnected socket")


def test_tcp_and_udp_same_ports_each_own_rule(site):
    tb, d = site
    port = 40777
    runs = [recv(tb, tb.server_v4, bind_port=port), recv(tb, tb.server_v4, bind_port=port,
                                                         tcp=True)]
    seen = wait_for(lambda: len(d.flows()) >= 2 and d.flows(), 3, 0.05, "both flows in status")
    by_proto = {f["protocol"]: f for f in seen}
    assert by_proto["udp"]["remote"] == by_proto["tcp"]["remote"], by_proto   # same ports
    assert {p: f["rule"] for p, f in by_proto.items()} == {"udp": "quic",
                                                          "tcp": "same-ports-tcp"}
    udp, tcp = (result(r) for r in runs)
    want_udp = RATE_BPS * wire(SIZE, False)
    want_tcp = 2 * RATE_BPS * 1448 / 1514
    print(f"same ports: UDP {udp['goodput_bps'] * 8 / 1e6:.3f} Mbit/s (want "
          f"{want_udp * 8 / 1e6:.3f}), TCP {tcp['goodput_bps'] * 8 / 1e6:.3f} (want "
          f"{want_tcp * 8 / 1e6:.3f})")
    assert udp["goodput_bps"] == pytest.approx(want_udp, rel=0.03), udp
    assert tcp["goodput_bps"] == pytest.approx(want_tcp, rel=0.05), tcp
    after_case(tb, d, "TCP and UDP of the same ports")


def test_unconnected_server_sendmmsg_two_peers_each_shaped(site):
    """sendmmsg with one message per peer address in each call: the cgroup sendmsg programs run
    for every message, so each peer is its own flow, shaped on its own."""
    tb, d = site
    runs = [recv(tb, tb.server_v4, port=MMSG_PORT), recv(tb, tb.server_v6, port=MMSG_PORT)]
    seen = wait_for(lambda: len(udp_flows(d)) >= 2 and udp_flows(d), 3, 0.05,
                    "both sendmmsg peers' flows in status")
    assert {f["rule"] for f in seen} == {"quic-mmsg"}, seen
    peers_at_rate([result(r) for r in runs], "sendmmsg peer")
    after_case(tb, d, "two peers answered with sendmmsg")


def test_connected_udp_idles_out_and_is_shaped_again(site):
    """Connected IPv4, IPv6 and IPv4-mapped sockets (send()s carry no address: the egress
    program sees them) sending with sendmmsg: a class each; silent past their 2 s idle_timeout
    with the sockets open -> classes and filters gone, status counts the idle ends; sending again
    -> a class each again, at the rule's rate at the receiver; closed -> gone."""
    tb, d = site
    with ConnectedSenders(tb) as cs:
        wait_for(lambda: len(conn_flows(d)) == 3, 3, 0.05, "the three connected sockets' flows")
        idle0 = d.status()["counters"]["events"].get("idle_close", 0)
        cs.send(1.0)
        ended = time.monotonic()
        assert kernel_objects(tb)[0] == 3, tc_show(tb, "class")
        wait_idled_out(tb, d, ended, "idle connected sockets'")
        st = d.status()
        assert st["counters"]["events"].get("idle_close", 0) - idle0 == 3, st["counters"]
        assert st["tracer"]["udp"]["connected"] == 3, st["tracer"]
        # the sockets send again: shaped again, at the rule's rate
        t0 = time.monotonic()
        sent = cs.send(4.0)
        t1 = time.monotonic()
        assert sent["sent"] > 0
        assert len(conn_flows(d)) == 3 and kernel_objects(tb)[0] == 3, \
            f"not shaped again: {conn_flows(d)}\n{tc_show(tb, 'class')}"
        got = cs.report(t0 + 1.0, t1)
        for what, addr, port, v6 in (("IPv4", tb.server_v4, cs.ports["v4"], False),
                                     ("IPv6", tb.server_v6, cs.ports["v6"], True),
                                     ("IPv4-mapped", tb.server_v4, cs.ports["mapped"], False)):
            at_rate(got.get(f"{addr} {port}", 0.0), v6,
                    f"connected {what} sending again after idling out", f": {got}")
        assert d.status()["tracer"]["udp"]["woken"] >= 3
        cs.close()
        wait_for(lambda: not conn_flows(d), 3, 0.05, "the closed sockets' flows to go")
    after_case(tb, d, "connected UDP sockets idling out and sending again")


def test_connected_udp_adopted_after_a_crash_still_idles_out(site):
    """The daemon killed (SIGKILL) while three connected sockets (IPv4, IPv6, mapped) are
    shaped, started again: it adopts their classes, and sock_diag's listing (with each socket's
    cookie) lets the tracer follow their sends although it never saw them connect: silent past
    the 2 s idle_timeout they lose their classes, sending again they get them back, closed they
    go. Runs last: it restarts the module's daemon (the fixture stops the new one)."""
    tb, d = site
    with ConnectedSenders(tb) as cs:
        wait_for(lambda: len(conn_flows(d)) == 3, 3, 0.05, "the three connected sockets' flows")
        d.kill()
        assert kernel_objects(tb)[0] == 3, "the killed daemon's classes should still be there"
        d.log_mode = "a"
        d.start()
        seen = wait_for(lambda: len(conn_flows(d)) == 3 and conn_flows(d), 10, 0.1,
                        "the connected sockets adopted by the restarted daemon")
        assert {f["source"] for f in seen} == {"reconcile"}, seen
        wait_for(lambda: d.status()["tracer"]["udp"]["adopted"] >= 3, 5, 0.1,
                 "the tracer to follow the adopted sockets")
        cs.send(1.0)
        wait_idled_out(tb, d, time.monotonic(), "adopted connected sockets'")
        woken = d.status()["tracer"]["udp"]["woken"]
        cs.start(1.5)
        wait_for(lambda: len(conn_flows(d)) == 3 and kernel_objects(tb)[0] == 3, 1.2, 0.02,
                 "the adopted sockets shaped again when they send again")
        cs.done()
        assert d.status()["tracer"]["udp"]["woken"] - woken == 3
        cs.close()
        wait_for(lambda: not conn_flows(d), 3, 0.05, "the closed sockets' flows to go")
    after_case(tb, d, "connected UDP sockets adopted after a crash")

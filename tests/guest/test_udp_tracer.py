"""The tracer's connected-UDP idleness on Debian's kernels (6.1; 6.12 with
FLOWPACER_VM_KERNEL=6.12), issue 17: the cgroup/skb egress program follows the sends of
connected IPv4, IPv6 and IPv4-mapped sockets (their send()s carry no address, so the sendmsg
programs never see them): silent for the shortest idle_timeout each is reported IDLE once, and
its next datagram opens it again (WAKE) with its owner; closed, it ends. One compile of the
tracer (about a minute under TCG), no daemon: the daemon's use of these events is
tests/test_udp.py on the host."""
from __future__ import annotations

import os

from flowpacer import model
from flowpacer.sources.tracer import Tracer
from harness.udpflows import ProbeRun

# guest time limits: TCG runs the probe and the sweeps several times slower than the host
WAIT_S = 15


def test_connected_udp_idle_and_wake(tb):
    t = Tracer(netns_ino=os.stat(f"/run/netns/{tb.server_ns}").st_ino, ring_pages=8)
    t.set_watch({"fp-udp-probe"}, None)
    t.start()
    try:
        assert "cgroup udp" in t.hooks, t.hooks
        t.set_udp_idle(1_000_000_000, 10_000_000_000)
        r = ProbeRun(tb, t, 3.0, again=True)
        OPEN, IDLE, CLOSE = model.EventKind.OPEN, model.EventKind.IDLE, model.EventKind.CLOSE
        r.until("the connected sockets' OPEN", lambda: r.connected <= set(r.of(OPEN)), WAIT_S)
        r.until("their IDLE", lambda: r.connected <= set(r.of(IDLE)), WAIT_S)
        r.until("their OPEN again when they send again",
                lambda: all(r.of(OPEN).count(k) == 2 for k in r.connected), WAIT_S)
        r.until("their CLOSE", lambda: r.connected <= set(r.of(CLOSE)), WAIT_S)
        again = [e for e in r.events if e.kind is OPEN and e.flow.direction is
                 model.Direction.OUTBOUND][3:]
        assert {e.flow.proc.comm for e in again} == {"fp-udp-probe"}, again
        assert all(r.of(IDLE).count(k) == 1 for k in r.connected), r.of(IDLE)
        assert t.stats()["udp"]["woken"] == 3, t.stats()["udp"]
        r.proc.wait(WAIT_S)
    finally:
        t.close()

"""The sock_diag flow source on real sockets: attribution, direction, IPv4-mapped addresses."""
import ipaddress
import os
import socket

import pytest

from flowpacer.model import Direction, FlowKey, FlowSource
from flowpacer.sources.sockdiag import SockDiagSource
from harness.testbed import in_netns

pytestmark = pytest.mark.kernel


def test_snapshot_attributes_and_directions(testbed):
    with in_netns(testbed.server_ns):
        lst = socket.socket(socket.AF_INET6)                   # dual-stack listener
        lst.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        lst.bind(("::", 9301))
        lst.listen(8)
        c4 = socket.create_connection((str(testbed.server_v4), 9301))
        a4, _ = lst.accept()
        c6 = socket.create_connection((str(testbed.server_v6), 9301))
        a6, _ = lst.accept()
        try:
            src = SockDiagSource()
            snap = src.snapshot()
            walks = src.proc_walks
            again = src.snapshot()
        finally:
            for s in (c4, a4, c6, a6, lst):
                s.close()
    ins = {k: f for k, f in snap.items() if f.direction is Direction.INBOUND}
    outs = {k: f for k, f in snap.items() if f.direction is Direction.OUTBOUND}
    assert len(ins) == 2 and len(outs) == 2
    # the accepted IPv4 flow on the IPv6 socket is reported with IPv4 addresses (as on the wire)
    assert {k.family for k in ins} == {4, 6}
    for k, f in snap.items():
        assert f.proc.pid == os.getpid() and f.proc.comm and f.proc.uid == 0
        assert f.source is FlowSource.RECONCILE
        assert k.local_addr.version == k.remote_addr.version
    assert all(k.local_port == 9301 for k in ins)
    # the second scan found no new socket inode: no /proc walk
    assert src.proc_walks == walks and again.keys() == snap.keys()
    # and nothing changed: it says so (issue 26: the flow table looks at its changes only),
    # every flow the very object of the scan before it
    assert again.delta_from is snap.token and snap.delta_from is None
    assert again.changed == [] and again.gone == []
    assert all(again[k] is f for k, f in snap.items())


def test_snapshot_carries_each_sockets_mark_and_bound_device(testbed):
    """Issue 29: what a socket's route depends on besides its tuple and owner, for the route
    lookup of several interfaces: its mark (SO_MARK, inherited by accepted sockets) and the
    device it is bound to (SO_BINDTODEVICE), IPv4, IPv6 and IPv4-mapped; a socket with neither
    has 0 and 0; a mark set later is seen by the next snapshot."""
    SO_MARK = 36
    with in_netns(testbed.server_ns):
        idx = socket.if_nametoindex(testbed.server_if)
        lst = socket.socket(socket.AF_INET6)                   # dual-stack listener, marked
        lst.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        lst.setsockopt(socket.SOL_SOCKET, SO_MARK, 0x29)
        lst.bind(("::", 9302))
        lst.listen(8)
        c4 = socket.create_connection((str(testbed.server_v4), 9302))   # unmarked client
        a4, _ = lst.accept()                                   # mapped, marked
        c6 = socket.socket(socket.AF_INET6)                    # bound to the veth, marked
        c6.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, testbed.server_if.encode())
        c6.setsockopt(socket.SOL_SOCKET, SO_MARK, 0x30)
        c6.connect((str(testbed.server_v6), 9302))
        a6, _ = lst.accept()
        try:
            src = SockDiagSource()
            snap = src.snapshot()
            c4.setsockopt(socket.SOL_SOCKET, SO_MARK, 0x31)
            again = src.snapshot()
        finally:
            for s in (c4, a4, c6, a6, lst):
                s.close()
    got = {(f.direction.value, k.family): (f.mark, f.bound_if) for k, f in snap.items()}
    assert got == {("inbound", 4): (0x29, 0), ("outbound", 4): (0, 0),
                   ("inbound", 6): (0x29, 0), ("outbound", 6): (0x30, idx)}, got
    out4 = next(f for k, f in again.items() if f.direction is Direction.OUTBOUND
                and k.family == 4)
    assert out4.mark == 0x31
    # the changed socket is the one change the second scan says (its old facts' key among
    # the gone, listed again), the others are not
    assert again.changed == [out4.key] and again.gone == [out4.key]

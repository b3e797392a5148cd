"""kernel/route.py: the RTM_GETROUTE requests (what the kernel's output lookup is asked, in
each family) and one real lookup in this namespace (no root needed: a route query)."""
import ipaddress
import socket
import struct

from flowpacer.kernel import route
from flowpacer.model import FlowKey, Protocol


def attrs(msg: bytes) -> dict:
    n, kind, _flags, seq, _pid = route.NLMSG_HDR.unpack_from(msg)
    assert (n, kind) == (len(msg), route.RTM_GETROUTE)
    out, at = {}, route.NLMSG_HDR.size + route.RTMSG.size
    while at < len(msg):
        ln, t = struct.unpack_from("=HH", msg, at)
        out[t] = msg[at + 4:at + ln]
        at += (ln + 3) & ~3
    return out


def family(msg: bytes) -> int:
    return msg[route.NLMSG_HDR.size]


def test_requests_carry_addresses_ports_protocol_and_uid_per_family():
    v4 = FlowKey(ipaddress.ip_address("10.1.0.1"), 80, ipaddress.ip_address("10.2.0.9"), 40000)
    a = attrs(route.request(v4, 33, 7))
    assert family(route.request(v4, 33, 7)) == socket.AF_INET
    assert a[route.RTA_DST] == socket.inet_aton("10.2.0.9")
    assert a[route.RTA_SRC] == socket.inet_aton("10.1.0.1")
    assert a[route.RTA_SPORT] == struct.pack("!H", 80)
    assert a[route.RTA_DPORT] == struct.pack("!H", 40000)
    assert a[route.RTA_IP_PROTO] == bytes([socket.IPPROTO_TCP])
    assert a[route.RTA_UID] == struct.pack("=I", 33)
    v6 = FlowKey(ipaddress.ip_address("fd00::1"), 53, ipaddress.ip_address("fd00::2"), 5353,
                 Protocol.UDP)
    m = route.request(v6, -1, 8)
    a = attrs(m)
    assert family(m) == socket.AF_INET6 and route.RTA_UID not in a
    assert a[route.RTA_DST] == socket.inet_pton(socket.AF_INET6, "fd00::2")
    assert a[route.RTA_IP_PROTO] == bytes([socket.IPPROTO_UDP])
    # IPv4-mapped: asked as IPv4 (as the packets go); an unconnected UDP peer: no source
    mapped = FlowKey.wire(ipaddress.ip_address("::ffff:10.1.0.1"), 8080,
                          ipaddress.ip_address("::ffff:10.2.0.9"), 41000)
    m = route.request(mapped, -1, 9)
    assert family(m) == socket.AF_INET and attrs(m)[route.RTA_DST] == socket.inet_aton("10.2.0.9")
    wild = FlowKey(ipaddress.ip_address("0.0.0.0"), 53, ipaddress.ip_address("10.2.0.9"), 53,
                   Protocol.UDP)
    assert route.RTA_SRC not in attrs(route.request(wild, -1, 10))
    # the socket's mark and the device it is bound to (a VRF's too), only when it has them
    a = attrs(route.request(v4, 33, 11, mark=0x29, oif=7))
    assert a[route.RTA_MARK] == struct.pack("=I", 0x29) and a[route.RTA_OIF] == struct.pack("=I", 7)
    a = attrs(route.request(v6, -1, 12, mark=0, oif=0))
    assert route.RTA_MARK not in a and route.RTA_OIF not in a


def test_a_lookup_in_this_namespace():
    r = route.RouteLookup()
    try:
        keys = [route.RouteQuery(FlowKey(ipaddress.ip_address("127.0.0.1"), 80,
                                         ipaddress.ip_address("127.0.0.1"), 40000 + i))
                for i in range(300)]
        got = r.egress(keys)          # more than one batch
        assert len(got) == 300 and {route.ifname(i) for i in got.values()} == {"lo"}
    finally:
        r.close()
    assert route.ifname(0) is None and "lo" in route.link_names()

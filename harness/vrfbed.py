"""A testbed whose server has two interfaces and one of them is in a VRF (issue 29: the route
lookup follows VRFs). Only where the kernel has the vrf module (the test VM; not the development
host).

    server ns                                            client ns
    fpTAGs  10.77.n.1  fd77:n::1   (main table) ==veth== fpTAGc  10.77.n.2  fd77:n::2
    fpTAGv  10.81.n.1  fd81:n::1   ==veth== fpTAGw  10.81.n.2  fd81:n::2
      └ master vrf-fp (table 77)                         lo: 10.79.n.2/32  fd79:n::2/128
                                                          (the client prefix, source of every
                                                           connection the client makes)

Both the main table and the VRF's table route the client prefix (10.79.n.0/24, fd79:n::/64),
each by its own interface: main by ``fpTAGs``, the VRF by ``fpTAGv``. A reply to a connection
accepted in the VRF leaves by ``fpTAGv``; the same lookup made without the VRF (``ip route get
10.79.n.2``) answers ``fpTAGs``, the wrong interface. ``net.ipv4.tcp_l3mdev_accept`` is 1 in the
server namespace, so a listener bound to no device (nginx's ``listen [::]:8081``) accepts
connections arriving in the VRF, and each accepted socket is bound to the VRF's device (its
``sk_bound_dev_if``, which sock_diag reports and ``ss`` prints as ``%vrf-fp``).

    with VrfBed() as bed:
        bed.server_v4, bed.server_v6      # the main interface's addresses
        bed.vrf_v4, bed.vrf_v6            # the VRF interface's
        bed.route_dev("10.79.n.2"), bed.route_dev("10.79.n.2", vrf=True)

Time limits are guest seconds, widened in virtual time (``harness.testbed.guest_timeout``). The
namespaces go (and everything in them) when the testbed is destroyed.
"""
from __future__ import annotations

import ipaddress
import re

from harness.testbed import Testbed, guest_timeout, modprobe, sh as _sh, wait_for

VRF = "vrf-fp"
TABLE = 77


def sh(*argv: str, check: bool = True):
    return _sh(*argv, check=check, timeout=guest_timeout(30))


class VrfBed(Testbed):
    """A ``Testbed`` with a second veth pair whose server end is enslaved to a VRF."""

    def __init__(self):
        super().__init__()
        n, t = self._n, self.tag
        self.vrf_if = f"fp{t}v"[:15]
        self.vrf_peer = f"fp{t}w"[:15]
        self.vrf_v4 = ipaddress.IPv4Address(f"10.81.{n}.1")
        self.vrf_peer_v4 = ipaddress.IPv4Address(f"10.81.{n}.2")
        self.vrf_v6 = ipaddress.IPv6Address(f"fd81:{n:x}::1")
        self.vrf_peer_v6 = ipaddress.IPv6Address(f"fd81:{n:x}::2")
        self.prefix_v4, self.prefix_v6 = f"10.79.{n}.0/24", f"fd79:{n:x}::/64"
        self.source_v4 = ipaddress.IPv4Address(f"10.79.{n}.2")
        self.source_v6 = ipaddress.IPv6Address(f"fd79:{n:x}::2")

    def create(self) -> None:
        modprobe("veth", "vrf")
        S, C = self.server_ns, self.client_ns
        for ns in (S, C):
            sh("ip", "netns", "del", ns, check=False)
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", S, "link", "add", VRF, "type", "vrf", "table", str(TABLE))
        sh("ip", "-n", S, "link", "set", VRF, "up")
        for s_if, c_if in ((self.server_if, self.client_if), (self.vrf_if, self.vrf_peer)):
            sh("ip", "-n", S, "link", "add", s_if, "type", "veth", "peer", "name", c_if,
               "netns", C)
        # enslaved before it has addresses: they (and their connected routes) are the VRF's
        sh("ip", "-n", S, "link", "set", self.vrf_if, "master", VRF)
        for ns, dev, v4, v6 in ((S, self.server_if, self.server_v4, self.server_v6),
                                (C, self.client_if, self.client_v4, self.client_v6),
                                (S, self.vrf_if, self.vrf_v4, self.vrf_v6),
                                (C, self.vrf_peer, self.vrf_peer_v4, self.vrf_peer_v6)):
            sh("ip", "-n", ns, "addr", "add", f"{v4}/24", "dev", dev)
            sh("ip", "-n", ns, "addr", "add", f"{v6}/64", "dev", dev, "nodad")
            sh("ip", "-n", ns, "link", "set", dev, "up")
        # the client prefix: one address of it on the client's lo, the source of its
        # connections to either server address (host routes with a preferred source)
        sh("ip", "-n", C, "addr", "add", f"{self.source_v4}/32", "dev", "lo")
        sh("ip", "-n", C, "addr", "add", f"{self.source_v6}/128", "dev", "lo", "nodad")
        for dst, dev, src in ((self.server_v4, self.client_if, self.source_v4),
                              (self.server_v6, self.client_if, self.source_v6),
                              (self.vrf_v4, self.vrf_peer, self.source_v4),
                              (self.vrf_v6, self.vrf_peer, self.source_v6)):
            sh("ip", "-n", C, "route", "add", str(dst), "dev", dev, "src", str(src))
        # the same prefix routed by both tables, each by its own interface
        for pfx, gw in ((self.prefix_v4, self.client_v4), (self.prefix_v6, self.client_v6)):
            sh("ip", "-n", S, "route", "add", pfx, "via", str(gw), "dev", self.server_if)
        for pfx, gw in ((self.prefix_v4, self.vrf_peer_v4), (self.prefix_v6, self.vrf_peer_v6)):
            sh("ip", "-n", S, "route", "add", pfx, "via", str(gw), "dev", self.vrf_if,
               "table", str(TABLE))
        sh("ip", "netns", "exec", S, "sysctl", "-qw", "net.ipv4.tcp_l3mdev_accept=1")
        for dev in (self.server_if, self.vrf_if):
            wait_for(lambda: "LOWER_UP" in sh("ip", "-n", S, "-o", "link", "show",
                                              dev).stdout, guest_timeout(10), 0.02,
                     f"{dev}'s carrier")

    def route_dev(self, dst: str, vrf: bool = False) -> str:
        """The device ``ip route get`` answers for ``dst`` from the server namespace, in the
        VRF or not."""
        out = self.run(self.server_ns, ["ip", "route", "get", str(dst),
                                        *(["vrf", VRF] if vrf else [])]).stdout
        m = re.search(r" dev (\S+)", out)
        return m.group(1) if m else ""

    def flowpacer_left(self) -> list:
        """flowpacer's objects anywhere in the server namespace (after stop: none)."""
        out = []
        links = self.run(self.server_ns, ["ip", "-o", "link", "show"]).stdout
        out += [ln for ln in links.splitlines() if ": fpi-" in ln]
        for dev in (self.server_if, self.vrf_if, VRF):
            text = self.run(self.server_ns, ["tc", "qdisc", "show", "dev", dev]).stdout
            out += [f"{dev}: {ln}" for ln in text.splitlines() if "f1f0" in ln or "clsact" in ln]
            for what in ("class", "filter"):
                text = self.run(self.server_ns, ["tc", what, "show", "dev", dev]).stdout
                out += [f"{dev}: {ln}" for ln in text.splitlines() if ln.strip()]
        return out

"""A testbed whose server side is a bond (issue 29): ``bond0`` over two veth members ``m0``/``m1``
in the server namespace, ``bond0.7`` (a VLAN on it); the members' peers ``p0``/``p1`` in a bridge
``br0`` in the client namespace, with ``br0.7`` on it. For 802.3ad the client side is its LACP
partner instead: a second 802.3ad bond ``lag0`` over ``p0``/``p1`` (``lag0.7`` on it; a bridge
does not speak LACP), both with ``lacp_rate fast``, and the bed waits until each side has both
members in one aggregator; ``BondBed("802.3ad", split=True)`` gives each member a partner bond
of its own (``lag0``, ``lag1``), so that bond0 has two aggregators (no traffic on that bed).
Only where the kernel has the bonding, 8021q and bridge modules (the test VM; not the
development host).

    with BondBed("balance-xor") as bed:          # or active-backup, balance-rr, ...
        bed.server_v4, bed.server_v6             # bond0's addresses (client: br0's)
        bed.vlan_v4, bed.vlan_v6                 # bond0.7's (client: br0.7's)
        bed.run(bed.server_ns, ["ip", "link", "set", "m1", "down"])
        bed.members_up(), bed.kernel_speed_bit(), bed.on_members(), bed.flowpacer_left()
        bed.aggregator()                         # 802.3ad: (active aggregator id, its ports)

balance-xor (and 802.3ad) hash by layer3+4, so that flows spread over the members; every mode
has miimon 50 ms. Its time limits are guest seconds, widened in virtual time
(``harness.testbed.guest_timeout``). The namespaces go (and everything in them) when the testbed
is destroyed.
"""
from __future__ import annotations

import re
import subprocess

from harness.testbed import guest_timeout
from harness.testbed import PY, Testbed, modprobe, sh as _sh, wait_for


def sh(*argv: str, check: bool = True):
    """``harness.testbed.sh`` with its time limit widened in virtual time (a first exec over
    9p runs the guest's clock on)."""
    return _sh(*argv, check=check, timeout=guest_timeout(30))


def parse_lacp(text: str) -> tuple:
    """(the active aggregator id or 0, {member: its aggregator id}) from the text of
    /proc/net/bonding/<bond> of an 802.3ad bond."""
    active, ids, cur = 0, {}, None
    info = text.split("Active Aggregator Info:", 1)
    if len(info) == 2:
        m = re.search(r"Aggregator ID: (\d+)", info[1])
        active = int(m.group(1)) if m else 0
    for ln in text.splitlines():
        if ln.startswith("Slave Interface:"):
            cur = ln.split(":", 1)[1].strip()
        elif cur and ln.startswith("Aggregator ID:"):
            ids[cur] = int(ln.split(":", 1)[1])
            cur = None
    return active, ids


class BondBed(Testbed):
    """A ``Testbed`` whose server side is a bond over two veth members, with a VLAN on it."""

    def __init__(self, mode: str, split: bool = False):
        super().__init__(server_if="bond0")
        self.mode = mode
        self.lacp = mode == "802.3ad"
        # 802.3ad with each member's peer in a partner bond of its own (lag0 over p0, lag1 over
        # p1): two partners, so bond0's members end up in two aggregators, one of them active.
        # No traffic on such a bed (the addresses are on lag0 only)
        self.split = split and self.lacp
        # the receiver's device (harness.pacing's receiver_dev): the bridge, or the LACP partner
        self.client_if = "lag0" if self.lacp else "br0"
        n = self._n
        self.vlan_v4, self.vlan_v6 = f"10.78.{n}.1", f"fd78:{n:x}::1"
        self.vlan_client_v4, self.vlan_client_v6 = f"10.78.{n}.2", f"fd78:{n:x}::2"

    def create(self) -> None:
        modprobe("veth", "8021q", "bridge")
        # max_bonds=0: loading the module makes no bond0 of its own in the initial namespace
        subprocess.run(["modprobe", "bonding", "max_bonds=0"], capture_output=True, timeout=30)
        S, C = self.server_ns, self.client_ns
        for ns in (S, C):
            sh("ip", "netns", "del", ns, check=False)
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        opts = self.bond_options()
        sh("ip", "-n", S, "link", "add", "bond0", "type", "bond", *opts)
        cdev = self.client_if
        if self.lacp:
            sh("ip", "-n", C, "link", "add", cdev, "type", "bond", *opts)
        else:
            sh("ip", "-n", C, "link", "add", cdev, "type", "bridge", "stp_state", "0")
        if self.split:
            sh("ip", "-n", C, "link", "add", "lag1", "type", "bond", *opts)
        for i in (0, 1):
            sh("ip", "-n", S, "link", "add", f"m{i}", "type", "veth", "peer", "name", f"p{i}",
               "netns", C)
            sh("ip", "-n", S, "link", "set", f"m{i}", "master", "bond0")
            sh("ip", "-n", C, "link", "set", f"p{i}", "master",
               "lag1" if self.split and i == 1 else cdev)
            sh("ip", "-n", C, "link", "set", f"p{i}", "up")
        if self.split:
            sh("ip", "-n", C, "link", "set", "lag1", "up")
        sh("ip", "-n", S, "link", "add", "link", "bond0", "name", "bond0.7", "type", "vlan",
           "id", "7")
        sh("ip", "-n", C, "link", "add", "link", cdev, "name", f"{cdev}.7", "type", "vlan",
           "id", "7")
        for ns, dev, v4, v6 in ((S, "bond0", self.server_v4, self.server_v6),
                                (C, cdev, self.client_v4, self.client_v6),
                                (S, "bond0.7", self.vlan_v4, self.vlan_v6),
                                (C, f"{cdev}.7", self.vlan_client_v4, self.vlan_client_v6)):
            self._address(ns, dev, v4, v6)
        self._members_up()

    def bond_options(self) -> list:
        """``ip link add ... type bond`` options of this bed's mode (both sides of 802.3ad)."""
        return ["mode", self.mode] + (["xmit_hash_policy", "layer3+4"]
                                      if self.mode in ("balance-xor", "802.3ad") else []) + (
                                          ["lacp_rate", "fast"] if self.lacp else []) + [
                                              "miimon", "50"]

    def _address(self, ns: str, dev: str, v4, v6) -> None:
        sh("ip", "-n", ns, "addr", "add", f"{v4}/24", "dev", dev)
        sh("ip", "-n", ns, "addr", "add", f"{v6}/64", "dev", dev, "nodad")
        sh("ip", "-n", ns, "link", "set", dev, "up")

    def _members_up(self) -> None:
        """The members up and the bond using both (802.3ad: LACP agreed), and the client side's
        addresses resolved from the server namespace."""
        S, C = self.server_ns, self.client_ns
        for i in (0, 1):
            sh("ip", "-n", S, "link", "set", f"m{i}", "up")
        wait_for(lambda: self.members_up() == ("m0", "m1"), guest_timeout(10), 0.05,
                 "both members up")
        if self.split:          # LACP agrees with each partner: two aggregators, one active
            wait_for(lambda: self.aggregators() == 2 and len(self.aggregator()[1]) == 1,
                     guest_timeout(30), 0.2, "bond0's members in two aggregators, one active")
            return
        if self.lacp:           # LACP agrees (fast rate: a LACPDU a second each way)
            for ns, bond in ((S, "bond0"), (C, self.client_if)):
                wait_for(lambda: len(self.aggregator(ns, bond)[1]) == 2, guest_timeout(30),
                         0.2, f"{bond}'s two members in one aggregator")
        for dst in (self.client_v4, self.vlan_client_v4, self.client_v6, self.vlan_client_v6):
            wait_for(lambda: self.resolves(str(dst)), guest_timeout(20), 0.2,
                     f"{dst}'s neighbour entry")

    def mac(self, dev: str) -> str:
        """``dev``'s link address in the server namespace."""
        out = self.run(self.server_ns, ["cat", f"/sys/class/net/{dev}/address"]).stdout
        return out.strip()

    def make_vlan(self, mac: str) -> None:
        """``bond0.7`` made again on ``bond0`` (after ``ip link del``): the same VLAN id,
        addresses and link address ``mac`` (so the client's neighbour entries stay valid)."""
        sh("ip", "-n", self.server_ns, "link", "add", "link", "bond0", "name", "bond0.7",
           "address", mac, "type", "vlan", "id", "7")
        self._address(self.server_ns, "bond0.7", self.vlan_v4, self.vlan_v6)

    def make_bond(self, mac: str, vlan_mac: str) -> None:
        """``bond0`` made again (after ``ip link del bond0``, which takes ``bond0.7`` with it
        and releases the members, down): the same mode, link address ``mac``, ``m0`` and ``m1``
        enslaved again, its addresses, and ``bond0.7`` on it (``make_vlan``); returns once both
        members are up in it."""
        S = self.server_ns
        sh("ip", "-n", S, "link", "add", "bond0", "address", mac, "type", "bond",
           *self.bond_options())
        for i in (0, 1):        # the bonding driver enslaves only a device that is down
            sh("ip", "-n", S, "link", "set", f"m{i}", "down")
            sh("ip", "-n", S, "link", "set", f"m{i}", "master", "bond0")
        self._address(S, "bond0", self.server_v4, self.server_v6)
        self.make_vlan(vlan_mac)
        self._members_up()

    def resolves(self, dst: str) -> bool:
        """A datagram from the server namespace to ``dst`` made the kernel resolve its link
        address (ARP or neighbour discovery through the bond, the bridge and the VLAN)."""
        fam = "AF_INET6" if ":" in dst else "AF_INET"
        self.run(self.server_ns, [PY, "-c", f"import socket; socket.socket(socket.{fam}, "
                                  f"socket.SOCK_DGRAM).sendto(b'x', ({dst!r}, 9))"], check=False)
        out = self.run(self.server_ns, ["ip", "neigh", "show", dst]).stdout
        return any(st in out for st in ("REACHABLE", "STALE", "DELAY", "PROBE"))

    def sysfs(self, path: str) -> str:
        return self.run(self.server_ns, ["cat", f"/sys/class/net/{path}"]).stdout.strip()

    def members_up(self) -> tuple:
        return tuple(m for m in ("m0", "m1")
                     if self.sysfs(f"{m}/bonding_slave/mii_status") == "up")

    def _lacp(self, ns=None, bond: str = "bond0") -> tuple:
        """802.3ad: (the active aggregator id, {member: its aggregator id}) from
        /proc/net/bonding/<bond> (``parse_lacp``)."""
        return parse_lacp(self.run(ns or self.server_ns,
                                   ["cat", f"/proc/net/bonding/{bond}"]).stdout)

    def aggregator(self, ns=None, bond: str = "bond0") -> tuple:
        """802.3ad: (the bond's active aggregator id, the members in it; the id is 0 and no
        member while there is none)."""
        active, ids = self._lacp(ns, bond)
        return active, tuple(m for m, i in ids.items() if active and i == active)

    def aggregators(self, ns=None, bond: str = "bond0") -> int:
        """802.3ad: how many aggregators the bond's members are in."""
        return len(set(self._lacp(ns, bond)[1].values()))

    def kernel_speed_bit(self) -> int:
        """The bonding driver's own figure (sum of the members that may send, Mbit/s)."""
        return int(self.sysfs("bond0/speed")) * 1_000_000

    def on_members(self) -> list:
        """What tc shows of flowpacer on the members (must stay empty)."""
        out = []
        for m in ("m0", "m1"):
            for what in ("qdisc", "class", "filter"):
                text = self.run(self.server_ns, ["tc", what, "show", "dev", m]).stdout
                out += [f"{m}: {ln}" for ln in text.splitlines()
                        if "f1f0" in ln or (what != "qdisc" and ln.strip())]
        return out

    def flowpacer_left(self) -> list:
        """flowpacer's objects anywhere in the server namespace (after stop: none)."""
        out = []
        links = self.run(self.server_ns, ["ip", "-o", "link", "show"]).stdout
        out += [ln for ln in links.splitlines() if ": fpi-" in ln]
        for dev in ("bond0", "bond0.7", "m0", "m1"):
            text = self.run(self.server_ns, ["tc", "qdisc", "show", "dev", dev]).stdout
            out += [f"{dev}: {ln}" for ln in text.splitlines() if "f1f0" in ln or "clsact" in ln]
            text = self.run(self.server_ns, ["tc", "class", "show", "dev", dev]).stdout
            out += [f"{dev}: {ln}" for ln in text.splitlines() if ln.strip()]
        return out

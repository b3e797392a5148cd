"""A testbed whose server side is a bond (issue 29): ``bond0`` over two veth members ``m0``/``m1``
in the server namespace, ``bond0.7`` (a VLAN on it); the members' peers ``p0``/``p1`` in a bridge
``br0`` in the client namespace, with ``br0.7`` on it. Only where the kernel has the bonding,
8021q and bridge modules (the test VM; not the development host).

    with BondBed("balance-xor") as bed:          # or active-backup, balance-rr, ...
        bed.server_v4, bed.server_v6             # bond0's addresses (client: br0's)
        bed.vlan_v4, bed.vlan_v6                 # bond0.7's (client: br0.7's)
        bed.run(bed.server_ns, ["ip", "link", "set", "m1", "down"])
        bed.members_up(), bed.kernel_speed_bit(), bed.on_members(), bed.flowpacer_left()

balance-xor (and 802.3ad) hash by layer3+4, so that flows spread over the members; every mode
has miimon 50 ms. Its time limits are guest seconds, widened in virtual time
(``harness.testbed.guest_timeout``). The namespaces go (and everything in them) when the testbed
is destroyed.
"""
from __future__ import annotations

import subprocess

from harness.testbed import guest_timeout
from harness.testbed import PY, Testbed, modprobe, sh as _sh, wait_for


def sh(*argv: str, check: bool = True):
    """``harness.testbed.sh`` with its time limit widened in virtual time (a first exec over
    9p runs the guest's clock on)."""
    return _sh(*argv, check=check, timeout=guest_timeout(30))


class BondBed(Testbed):
    """A ``Testbed`` whose server side is a bond over two veth members, with a VLAN on it."""

    def __init__(self, mode: str):
        super().__init__(server_if="bond0")
        self.client_if = "br0"          # the receiver's device (harness.pacing's receiver_dev)
        self.mode = mode
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
        opts = ["mode", self.mode] + (["xmit_hash_policy", "layer3+4"]
                                      if self.mode in ("balance-xor", "802.3ad") else [])
        sh("ip", "-n", S, "link", "add", "bond0", "type", "bond", *opts, "miimon", "50")
        sh("ip", "-n", C, "link", "add", "br0", "type", "bridge", "stp_state", "0")
        for i in (0, 1):
            sh("ip", "-n", S, "link", "add", f"m{i}", "type", "veth", "peer", "name", f"p{i}",
               "netns", C)
            sh("ip", "-n", S, "link", "set", f"m{i}", "master", "bond0")
            sh("ip", "-n", C, "link", "set", f"p{i}", "master", "br0")
            sh("ip", "-n", C, "link", "set", f"p{i}", "up")
        sh("ip", "-n", S, "link", "add", "link", "bond0", "name", "bond0.7", "type", "vlan",
           "id", "7")
        sh("ip", "-n", C, "link", "add", "link", "br0", "name", "br0.7", "type", "vlan", "id", "7")
        for ns, dev, v4, v6 in ((S, "bond0", self.server_v4, self.server_v6),
                                (C, "br0", self.client_v4, self.client_v6),
                                (S, "bond0.7", self.vlan_v4, self.vlan_v6),
                                (C, "br0.7", self.vlan_client_v4, self.vlan_client_v6)):
            sh("ip", "-n", ns, "addr", "add", f"{v4}/24", "dev", dev)
            sh("ip", "-n", ns, "addr", "add", f"{v6}/64", "dev", dev, "nodad")
            sh("ip", "-n", ns, "link", "set", dev, "up")
        for i in (0, 1):
            sh("ip", "-n", S, "link", "set", f"m{i}", "up")
        wait_for(lambda: self.members_up() == ("m0", "m1"), guest_timeout(10), 0.05,
                 "both members up")
        for dst in (self.client_v4, self.vlan_client_v4, self.client_v6, self.vlan_client_v6):
            wait_for(lambda: self.resolves(str(dst)), guest_timeout(20), 0.2,
                     f"{dst}'s neighbour entry")

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

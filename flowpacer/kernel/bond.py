"""A bond's link rate from its members (issue 29 item 3): pure logic and a sysfs reader, not yet
used by the backends.

What a bond can send is what its members that may transmit can send:

    balance-rr, balance-xor, 802.3ad,       the sum of the members that are up and active
    balance-tlb, balance-alb                 (802.3ad: those of the active aggregator; the
                                             others are "backup" in sysfs)
    active-backup                            the active member's (the only one "active")
    broadcast                                the slowest member that is up (every packet goes
                                             out of each)

This is the rule the kernel's bonding driver applies for the speed it reports
(``bond_ethtool_get_link_ksettings``: each member that ``bond_slave_can_tx``, summed, or the
minimum for broadcast), which ``TcBackend`` already reads (``/sys/class/net/BOND/speed``) and
follows (a changed speed is a SPEED health state: the root qdisc is adopted again with the new
link rate). Written out here so that status can say where a bond's rate comes from and a test
can check the kernel's figure against its members, on kernels and member drivers whose reports
differ (a member whose speed is unknown counts for nothing, as in the kernel).

Not wired in: the VM test plan in the issue 29 notes (bonds over veth members, both kernels)
decides whether the kernel's figure is enough.
"""
from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Optional, Tuple

SYSFS = "/sys/class/net"


class BondMode(str, enum.Enum):
    """The bonding driver's modes, by the names sysfs gives (``bonding/mode``: "NAME N")."""
    BALANCE_RR = "balance-rr"
    ACTIVE_BACKUP = "active-backup"
    BALANCE_XOR = "balance-xor"
    BROADCAST = "broadcast"
    IEEE_8023AD = "802.3ad"
    BALANCE_TLB = "balance-tlb"
    BALANCE_ALB = "balance-alb"


@dataclass(frozen=True)
class BondMember:
    name: str
    speed_bps: Optional[int]         # bytes/s; None: the member reports no speed
    up: bool                         # its link as the bond sees it (mii_status up)
    active: bool                     # may transmit in the bond's mode (sysfs state "active")


@dataclass(frozen=True)
class BondState:
    name: str
    mode: BondMode
    members: Tuple[BondMember, ...]

    @property
    def link_rate_bps(self) -> Optional[int]:
        return link_rate_bps(self.mode, self.members)

    def sending(self) -> Tuple[str, ...]:
        """The members that carry traffic now."""
        return tuple(m.name for m in self.members if _sends(m))


def _sends(m: BondMember) -> bool:
    return m.up and m.active and bool(m.speed_bps)


def link_rate_bps(mode: BondMode, members) -> Optional[int]:
    """The bond's link rate in bytes/s from its members; None when no member that may send
    reports a speed (the rules' ``link_rate`` is then needed, as for any such device)."""
    speeds = [m.speed_bps for m in members if _sends(m)]
    if not speeds:
        return None
    if mode is BondMode.BROADCAST:
        return min(speeds)
    return sum(speeds)


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _speed_bps(text: Optional[str]) -> Optional[int]:
    try:
        mbit = int(text or "")
    except ValueError:
        return None
    return mbit * 1_000_000 // 8 if mbit > 0 else None


def read_bond(name: str, sysfs: str = SYSFS) -> Optional[BondState]:
    """``name``'s mode and members from sysfs; None when it is not a bond (or is gone)."""
    base = os.path.join(sysfs, name)
    mode_text = _read(os.path.join(base, "bonding", "mode"))
    if not mode_text:
        return None
    try:
        mode = BondMode(mode_text.split()[0])
    except ValueError:
        return None
    members = []
    for m in (_read(os.path.join(base, "bonding", "slaves")) or "").split():
        sl = os.path.join(sysfs, m, "bonding_slave")
        members.append(BondMember(
            m, _speed_bps(_read(os.path.join(sysfs, m, "speed"))),
            up=_read(os.path.join(sl, "mii_status")) == "up",
            active=_read(os.path.join(sl, "state")) == "active"))
    return BondState(name, mode, tuple(members))

"""A bond's link rate from its members (issue 29 item 3): pure logic and a sysfs reader.

What a bond can send is what its members that may transmit can send:

    balance-rr, balance-xor, 802.3ad,       the sum of the members that are up and active
    balance-tlb, balance-alb                 (802.3ad: those of the active aggregator; the
                                             others are "backup" in sysfs)
    active-backup                            the active member's (the only one "active")
    broadcast                                the slowest member that is up (every packet goes
                                             out of each)

This is the rule the kernel's bonding driver applies for the speed it reports
(``bond_ethtool_get_link_ksettings``: each member that ``bond_slave_can_tx``, summed, or the
minimum for broadcast). Written out here so that the daemon takes a bond's link rate from its
members and says so (``link_rate``: the figure and where it came from, status'
``link_rate_source``), and so that a test can check the kernel's figure against its members, on
kernels and member drivers whose reports differ (a member whose speed is unknown counts for
nothing, as in the kernel).

Wired in by ``TcBackend`` (tc.py: ``setup`` and ``check``) for an interface without a ``link_rate`` in
the rules: a bond's figure, a device stacked on one bond (a VLAN on it) the bond's figure, any
other device its own speed. The backend's health check reads it at every pass and at once after
an RTNL link event of the interface or a device below it (``linkwatch.py``, the main loop): a
changed figure is the SPEED health state, and the supervisor sets the backend up again with the
new link rate (root qdisc, link and default classes changed in place, flows re-planned).
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


def read_bond(name: str, sysfs: Optional[str] = None) -> Optional[BondState]:
    """``name``'s mode and members from sysfs; None when it is not a bond (or is gone)."""
    sysfs = sysfs or SYSFS
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


def lower_devices(name: str, sysfs: Optional[str] = None) -> Tuple[str, ...]:
    """The devices directly below ``name`` (sysfs ``lower_*`` links: a VLAN's real device, a
    bond's members), sorted."""
    sysfs = sysfs or SYSFS
    try:
        entries = os.listdir(os.path.join(sysfs, name))
    except OSError:
        return ()
    return tuple(sorted(e[len("lower_"):] for e in entries if e.startswith("lower_")))


def below(name: str, sysfs: Optional[str] = None, depth: int = 4) -> Tuple[str, ...]:
    """Every device below ``name``, nearest first (a VLAN on a bond: the bond, its members),
    at most ``depth`` levels down."""
    out, level = [], [name]
    for _ in range(depth):
        nxt = [low for d in level for low in lower_devices(d, sysfs) if low not in out]
        if not nxt:
            break
        out.extend(nxt)
        level = nxt
    return tuple(out)


@dataclass(frozen=True)
class LinkRate:
    """An interface's link rate as the daemon takes it when the rules give none."""
    rate_bps: Optional[int]          # bytes/s; None: unknown (the rules' link_rate is needed)
    source: str                      # "speed", or "bond0 balance-xor: v0+v1" and the like


def _speed_of(name: str, sysfs: str) -> Optional[int]:
    return _speed_bps(_read(os.path.join(sysfs, name, "speed")))


def _bond_rate(st: BondState, via: str = "") -> LinkRate:
    sending = "+".join(st.sending()) or "no member sending"
    return LinkRate(st.link_rate_bps, f"{via}{st.name} {st.mode.value}: {sending}")


def link_rate(name: str, sysfs: Optional[str] = None) -> LinkRate:
    """``name``'s link rate: a bond's from its members (``link_rate_bps``), a device stacked
    on one bond (a VLAN on it, through one lower device each level) that bond's, any other
    device its own speed (ethtool's, in sysfs)."""
    sysfs = sysfs or SYSFS
    st = read_bond(name, sysfs)
    if st is not None:
        return _bond_rate(st)
    cur = name
    for _ in range(3):
        lows = lower_devices(cur, sysfs)
        if len(lows) != 1:
            break
        cur = lows[0]
        st = read_bond(cur, sysfs)
        if st is not None:
            return _bond_rate(st, via="via ")
    return LinkRate(_speed_of(name, sysfs), "speed")

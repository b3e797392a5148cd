"""A bond's link rate from its members (issue 29 item 3, pure logic over a fake sysfs tree):
the sum of the members that may send for the balancing modes and 802.3ad, the active one's for
active-backup, the slowest for broadcast; a member down, in backup or without a speed counts for
nothing; a change of member state is a new figure at the next read."""
import pytest

from flowpacer.kernel.bond import BondMember, BondMode, link_rate_bps, read_bond
from harness.metricsview import daemon_samples

G = 1_000_000_000 // 8            # 1 Gbit/s in bytes/s


def member(name, gbit, up=True, active=True):
    return BondMember(name, gbit * G if gbit else None, up, active)


@pytest.mark.parametrize("mode", [BondMode.BALANCE_RR, BondMode.BALANCE_XOR, BondMode.IEEE_8023AD,
                                  BondMode.BALANCE_TLB, BondMode.BALANCE_ALB])
def test_balancing_modes_sum_the_members_that_send(mode):
    assert link_rate_bps(mode, [member("a", 10), member("b", 10)]) == 20 * G
    assert link_rate_bps(mode, [member("a", 10), member("b", 10, up=False)]) == 10 * G
    # 802.3ad: a port of another aggregator is "backup"
    assert link_rate_bps(mode, [member("a", 10), member("b", 25, active=False)]) == 10 * G
    assert link_rate_bps(mode, [member("a", 10), member("b", None)]) == 10 * G
    assert link_rate_bps(mode, [member("a", 10, up=False), member("b", 10, up=False)]) is None


def test_active_backup_is_the_active_members_and_broadcast_the_slowest():
    ab = BondMode.ACTIVE_BACKUP
    assert link_rate_bps(ab, [member("a", 10), member("b", 1, active=False)]) == 10 * G
    assert link_rate_bps(ab, [member("a", 10, up=False, active=False), member("b", 1)]) == G
    assert link_rate_bps(BondMode.BROADCAST, [member("a", 10), member("b", 1)]) == G
    assert link_rate_bps(ab, []) is None


def sysfs(tmp_path, bond, mode, members):
    """A fake /sys/class/net with ``bond`` and its members (name, speed mbit, mii, state)."""
    b = tmp_path / bond / "bonding"
    b.mkdir(parents=True, exist_ok=True)
    (b / "mode").write_text(f"{mode}\n")
    (b / "slaves").write_text(" ".join(m[0] for m in members) + "\n")
    for name, mbit, mii, state in members:
        d = tmp_path / name
        (d / "bonding_slave").mkdir(parents=True, exist_ok=True)
        (d / "speed").write_text(f"{mbit}\n")
        (d / "bonding_slave" / "mii_status").write_text(f"{mii}\n")
        (d / "bonding_slave" / "state").write_text(f"{state}\n")


def test_read_from_sysfs_and_follow_a_member_going_down(tmp_path):
    sysfs(tmp_path, "bond0", "balance-xor 2", [("v0", 10000, "up", "active"),
                                                ("v1", 10000, "up", "active")])
    st = read_bond("bond0", sysfs=str(tmp_path))
    assert st.mode is BondMode.BALANCE_XOR and st.link_rate_bps == 20 * G
    assert st.sending() == ("v0", "v1")
    (tmp_path / "v1" / "bonding_slave" / "mii_status").write_text("down\n")
    st = read_bond("bond0", sysfs=str(tmp_path))
    assert st.link_rate_bps == 10 * G and st.sending() == ("v0",)
    # active-backup: the backup member does not add; a failover makes it the active one
    sysfs(tmp_path, "bond1", "active-backup 1", [("w0", 10000, "up", "active"),
                                                  ("w1", 1000, "up", "backup")])
    assert read_bond("bond1", sysfs=str(tmp_path)).link_rate_bps == 10 * G
    sysfs(tmp_path, "bond1", "active-backup 1", [("w0", 10000, "down", "backup"),
                                                  ("w1", 1000, "up", "active")])
    assert read_bond("bond1", sysfs=str(tmp_path)).link_rate_bps == G
    # a member that reports no speed (-1: a veth down, a virtio device) counts for nothing
    sysfs(tmp_path, "bond2", "802.3ad 4", [("x0", -1, "up", "active")])
    assert read_bond("bond2", sysfs=str(tmp_path)).link_rate_bps is None


def test_not_a_bond_or_gone(tmp_path):
    (tmp_path / "eth0").mkdir()
    assert read_bond("eth0", sysfs=str(tmp_path)) is None
    assert read_bond("nothere", sysfs=str(tmp_path)) is None
    sysfs(tmp_path, "bond9", "roundabout 9", [])
    assert read_bond("bond9", sysfs=str(tmp_path)) is None


# ---------------------------------------------------------------- wired in (issue 29 item 3)
def lowers(tmp_path, upper, *names):
    """sysfs' ``lower_<name>`` links of ``upper`` (a VLAN's real device, a bond's members)."""
    d = tmp_path / upper
    d.mkdir(parents=True, exist_ok=True)
    for n in names:
        (tmp_path / n).mkdir(exist_ok=True)
        (d / f"lower_{n}").symlink_to(f"../{n}")


def test_link_rate_of_a_bond_a_vlan_on_it_and_a_plain_device(tmp_path):
    from flowpacer.kernel.bond import LinkRate, below, link_rate
    sysfs(tmp_path, "bond0", "balance-xor 2", [("v0", 10000, "up", "active"),
                                                ("v1", 10000, "up", "active")])
    lowers(tmp_path, "bond0", "v0", "v1")
    lowers(tmp_path, "bond0.7", "bond0")
    (tmp_path / "eth0").mkdir()
    (tmp_path / "eth0" / "speed").write_text("1000\n")
    (tmp_path / "bond0.7" / "speed").write_text("20000\n")
    got = link_rate("bond0", str(tmp_path))
    assert got.rate_bps == 20 * G and got.source == "bond0 balance-xor: v0+v1"
    got = link_rate("bond0.7", str(tmp_path))
    assert got.rate_bps == 20 * G and got.source == "via bond0 balance-xor: v0+v1"
    assert link_rate("eth0", str(tmp_path)) == LinkRate(G, "speed")
    assert link_rate("nothere", str(tmp_path)).rate_bps is None
    assert below("bond0.7", str(tmp_path)) == ("bond0", "v0", "v1")
    assert below("eth0", str(tmp_path)) == ()
    (tmp_path / "v0" / "bonding_slave" / "mii_status").write_text("down\n")
    got = link_rate("bond0.7", str(tmp_path))
    assert got.rate_bps == 10 * G and got.source == "via bond0 balance-xor: v1"
    (tmp_path / "v1" / "bonding_slave" / "mii_status").write_text("down\n")
    assert link_rate("bond0", str(tmp_path)) == LinkRate(None, "bond0 balance-xor: no member sending")


def test_link_events_parsed_from_rtnetlink_messages():
    import struct
    from flowpacer.kernel.linkwatch import parse
    from flowpacer.kernel.tc.link import IFINFOMSG, IFLA_IFNAME, RTM_DELLINK, RTM_NEWLINK

    def msg(mtype, name):
        attr = name.encode() + b"\0"
        nla = struct.pack("=HH", 4 + len(attr), IFLA_IFNAME) + attr
        nla += b"\0" * (-len(nla) % 4)
        body = IFINFOMSG.pack(0, 0, 5, 0, 0) + nla
        return struct.pack("=IHHII", 16 + len(body), mtype, 0, 0, 0) + body
    assert parse(msg(RTM_NEWLINK, "v1") + msg(RTM_DELLINK, "bond0.7") + msg(20, "x")) == \
        {"v1", "bond0.7"}
    assert parse(b"\x01\x00") == set()


def test_main_loop_starts_a_pass_on_a_watched_devices_link_event_and_one_after():
    import threading
    from flowpacer.daemon.mainloop import LINK_FOLLOWUP_S, LINK_MIN_GAP_S, MainLoop
    from flowpacer.kernel.linkwatch import OVERFLOW
    from harness.fakes import FakeLinkWatch
    now = [100.0]
    watch = FakeLinkWatch()
    loop = MainLoop(None, None, rescan_s=30, reload=lambda: None, stages=list,
                    stop=threading.Event(), notify=lambda s: None, clock=lambda: now[0],
                    links=watch, watched=lambda: {"bond0", "v0", "v1"})
    try:
        loop._next_scan = now[0] + 30
        loop._last_scan = now[0] - 5
        watch.push("lo", "veth9")                      # not below a shaped interface
        assert loop.on_links() and loop._next_scan == 130.0 and loop.link_passes == 0
        watch.push("v1")
        assert loop.on_links() and loop._next_scan == 100.0 and loop.link_passes == 1
        loop._last_scan = now[0]                       # that pass ran; another event at once
        loop._next_scan = now[0] + 30
        watch.push("bond0")
        loop.on_links()
        assert loop._next_scan == 100.0 + LINK_MIN_GAP_S
        loop._next_scan = now[0] + 30
        now[0] += LINK_FOLLOWUP_S
        loop.link_followup_due()
        assert loop._next_scan == now[0] and loop.link_passes == 3
        loop._next_scan = now[0] + 30
        loop.link_followup_due()                       # once
        assert loop._next_scan == now[0] + 30
        watch.push(OVERFLOW)                           # events lost: look
        loop.on_links()
        assert loop._next_scan <= now[0] + LINK_MIN_GAP_S
    finally:
        watch.close()


def test_daemon_follows_a_bonds_members_without_a_restart(tmp_path, monkeypatch):
    """A real Daemon over fakes: the bond's link rate is its members' (bond.py over a fake
    sysfs), a member down and up again is followed at the link event (no rescan meanwhile),
    status and metrics say the figure and where it comes from, the flow's class stays; a
    link_rate in the rules wins over the members."""
    import ipaddress
    import time as _time
    from flowpacer.kernel import bond
    from flowpacer.model import (BackendKind, Direction, EventKind, Flow, FlowEvent, FlowKey,
                                 FlowSource, Match, OpKind, ProcessInfo, Rule, RuleSet)
    from flowpacer.surfaces.control import call
    from harness.fakes import (FakeFactory, FakeLinkWatch, FakeSockDiag, FakeTracer,
                               inprocess_daemon)
    from harness.testbed import wait_for
    tree = tmp_path / "sys"
    sysfs(tree, "bond0", "active-backup 1", [("v0", 10000, "up", "active"),
                                              ("v1", 1000, "up", "backup")])
    lowers(tree, "bond0", "v0", "v1")
    monkeypatch.setattr(bond, "SYSFS", str(tree))
    rule = Rule("web", Match(process=("nginx",)), 5_000_000)
    key = FlowKey(ipaddress.ip_address("10.1.0.1"), 80, ipaddress.ip_address("10.2.0.2"), 40000)
    f = Flow(key, Direction.INBOUND, ProcessInfo(pid=100, comm="nginx"), FlowSource.TRACER,
             seen_ns=_time.monotonic_ns())
    sd, tr, watch = FakeSockDiag(), FakeTracer(), FakeLinkWatch()
    sd.flows = {key: f}
    fac = FakeFactory(follow_speed=True)
    with inprocess_daemon(tmp_path, RuleSet("bond0", BackendKind.HTB, None, (rule,)),
                          factory=fac, sockdiag=sd, tracer=tr, rescan_s=3600,
                          link_watch=watch) as d:
        tr.push([FlowEvent(EventKind.OPEN, f)])
        b = d.supervisor.backend
        wait_for(lambda: key in b.installed(), 5, what="the flow's class")
        assert b.link_rate_bps == 10 * G and b.link_rate_source == "bond0 active-backup: v0"
        assert d.supervisor.watched_links() == {"bond0", "v0", "v1"}

        def status():
            return call(str(tmp_path / "ctl.sock"), {"cmd": "status"})["interfaces"][0]
        # the active member fails over to the 1 Gbit/s one
        sysfs(tree, "bond0", "active-backup 1", [("v0", 10000, "down", "backup"),
                                                  ("v1", 1000, "up", "active")])
        watch.push("v0")
        wait_for(lambda: status()["link_rate_bit"] == 1_000_000_000, 5,
                 what="the link rate of the active member after the failover")
        assert status()["link_rate_source"] == "bond0 active-backup: v1"
        gauge = {lab["interface"]: v for n, lab, v in daemon_samples(d)
                 if n == "flowpacer_link_rate_bytes_per_second"}
        assert gauge == {"bond0": G}
        assert key in b.installed() and not [o for o in b.applied if o.kind is OpKind.REMOVE]
        # back again
        sysfs(tree, "bond0", "active-backup 1", [("v0", 10000, "up", "active"),
                                                  ("v1", 1000, "up", "backup")])
        watch.push("v0")
        wait_for(lambda: status()["link_rate_bit"] == 10_000_000_000, 5, what="back to 10 G")
        assert key in b.installed() and len(fac.made) == 1
    assert watch.closed
    # the rules' link_rate wins: the members are not read
    fac = FakeFactory(follow_speed=True)
    with inprocess_daemon(tmp_path, RuleSet("bond0", BackendKind.HTB, 3 * G, (rule,)),
                          factory=fac, rescan_s=3600) as d:
        assert d.supervisor.backend.link_rate_bps == 3 * G
        assert d.supervisor.backend.link_rate_source == "rules"


def test_status_cli_names_a_bonds_link_rate_source():
    from flowpacer.surfaces.view import parse_status
    st = {"backend": "psp", "interface": "bond0", "link_rate_bit": 10_000_000_000,
          "link_rate_source": "bond0 active-backup: v1", "flows": []}
    assert parse_status(st).link_rate_source == "bond0 active-backup: v1"
    assert parse_status({"flows": []}).link_rate_source == ""

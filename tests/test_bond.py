"""A bond's link rate from its members (issue 29 item 3, pure logic over a fake sysfs tree):
the sum of the members that may send for the balancing modes and 802.3ad, the active one's for
active-backup, the slowest for broadcast; a member down, in backup or without a speed counts for
nothing; a change of member state is a new figure at the next read."""
import pytest

from flowpacer.kernel.bond import BondMember, BondMode, link_rate_bps, read_bond

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

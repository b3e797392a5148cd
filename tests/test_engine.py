"""The engine is pure: flows + rules in, desired shapes and an ordered plan out."""
import ipaddress

from flowpacer.policy import engine
from flowpacer.model import (Direction, Flow, FlowKey, Group, GroupKind, Match, Op, OpKind,
                             PortSet, ProcessInfo, Protocol, Rule, RuleSet, Shape)

A = ipaddress.ip_address


def flow(lport=8443, rport=40000, direction=Direction.INBOUND, comm="musicd", uid=1000,
         exe="/usr/bin/musicd", remote="192.0.2.7", local="198.51.100.1"):
    return Flow(FlowKey(A(local), lport, A(remote), rport), direction,
                ProcessInfo(pid=42, comm=comm, exe=exe, uid=uid))


def rule(name, rate=1_000_000, ceil=None, **m):
    return Rule(name, Match(**m), rate, ceil)


def test_first_match_wins_and_unmatched_is_not_shaped():
    rs = RuleSet("eth0", rules=(rule("a", process=("music*",), local_port=PortSet(((8443, 8443),))),
                                rule("b", 2_000_000, process=("musicd",))))
    f1 = flow()
    f2 = flow(lport=9000)
    f3 = flow(comm="nginx", rport=40001)
    want = engine.desired({f.key: f for f in (f1, f2, f3)}, rs)
    assert want == {f1.key: Shape("a", 1_000_000, 1_000_000), f2.key: Shape("b", 2_000_000, 2_000_000)}


def test_every_match_field():
    f = flow()
    cases = [
        (dict(direction=Direction.INBOUND), True), (dict(direction=Direction.OUTBOUND), False),
        (dict(exe=("/usr/bin/*",)), True), (dict(exe=("/opt/*",)), False),
        (dict(user=(1000,)), True), (dict(user=(0,)), False),
        (dict(remote_port=PortSet(((39000, 41000),))), True),
        (dict(remote_port=PortSet(((1, 100), (200, 300)))), False),
        (dict(remote=(ipaddress.ip_network("192.0.2.0/24"),)), True),
        (dict(remote=(ipaddress.ip_network("2001:db8::/32"),)), False),
        (dict(remote=(ipaddress.ip_network("2001:db8::/32"), ipaddress.ip_network("192.0.0.0/8"))), True),
        (dict(process=("musicd", "rsync")), True), (dict(process=("rsync",)), False),
    ]
    for m, expect in cases:
        assert engine.rule_matches(rule("r", **m), f) is expect, m


def test_exe_rule_does_not_match_unknown_exe():
    assert not engine.rule_matches(rule("r", exe=("*",)), flow(exe=""))


def test_ceil_defaults_to_rate():
    assert engine.shape_of(rule("r", 5, ceil=None)) == Shape("r", 5, 5)
    assert engine.shape_of(rule("r", 5, ceil=9)) == Shape("r", 5, 9)


def test_plan_orders_removes_changes_adds():
    k = [flow(rport=p).key for p in (1, 2, 3, 4)]
    have = {k[0]: Shape("a", 1, 1), k[1]: Shape("a", 1, 1), k[2]: Shape("a", 1, 1)}
    want = {k[1]: Shape("a", 1, 1), k[2]: Shape("b", 2, 2), k[3]: Shape("a", 1, 1)}
    ops = engine.plan(want, have)
    assert [(o.kind, o.key) for o in ops] == [(OpKind.REMOVE, k[0]), (OpKind.CHANGE, k[2]),
                                              (OpKind.ADD, k[3])]
    assert engine.plan(want, want) == []


def test_rule_rename_with_same_rate_is_a_relabel_not_a_kernel_change():
    # e.g. a flow adopted after a restart (its rule unknown, "") whose rate already matches:
    # status and metrics must name its rule, but the kernel has nothing to do
    k = flow().key
    for old in ("old", ""):
        assert engine.plan({k: Shape("new", 1, 1)}, {k: Shape(old, 1, 1)}) == [
            Op(OpKind.RELABEL, k, Shape("new", 1, 1))]


def test_watch_filter():
    lit = rule("a", process=("musicd", "averyveryverylongname"))
    usr = rule("b", user=(33,))
    assert engine.watch_filter(RuleSet("e", rules=(lit, usr))) == (
        frozenset({"musicd", "averyveryverylo"}), frozenset({33}))
    assert engine.watch_filter(RuleSet("e", rules=(lit, rule("g", process=("m*",))))) == (None, None)
    assert engine.watch_filter(RuleSet("e", rules=(rule("p", local_port=PortSet(((1, 2),))),))) == (None, None)
    assert engine.watch_filter(RuleSet("e", rules=(rule("g", process=("m*",), user=(5,)),))) == (
        frozenset(), frozenset({5}))
    assert engine.watch_filter(RuleSet("e")) == (frozenset(), frozenset())


# ------------------------------------------------------- aggregate rates (issue 15)

def agg_rule(name="dl", rate=1_000, ceil=None, client=4_000, total=10_000, prefix=(32, 64)):
    return Rule(name, Match(process=("musicd",)), rate, ceil, client_rate_bps=client,
                total_rate_bps=total, client_prefix=prefix)


def test_rules_without_aggregates_have_no_groups():
    rs = RuleSet("eth0", rules=(rule("a", 5, ceil=9, process=("musicd",)),))
    f = flow()
    assert engine.desired({f.key: f}, rs) == {f.key: Shape("a", 5, 9)}
    assert Shape("a", 5, 9).groups == ()


def test_a_flow_gets_its_rule_and_client_groups():
    r = agg_rule(ceil=2_000)
    rs = RuleSet("eth0", rules=(r,))
    f1, f2 = flow(rport=1, remote="192.0.2.7"), flow(rport=2, remote="192.0.2.8")
    want = engine.desired({f.key: f for f in (f1, f2)}, rs)
    rule_g = Group(GroupKind.RULE, "dl", 10_000, 10_000)
    assert want[f1.key] == Shape("dl", 1_000, 2_000, (
        rule_g, Group(GroupKind.CLIENT, "dl/192.0.2.7/32", 4_000, 4_000)))
    assert want[f2.key].groups == (rule_g, Group(GroupKind.CLIENT, "dl/192.0.2.8/32", 4_000, 4_000))
    assert want[f1.key].group(GroupKind.RULE) == rule_g
    only_client = agg_rule(total=None)
    assert engine.shape_of(only_client, f1.key).groups == (
        Group(GroupKind.CLIENT, "dl/192.0.2.7/32", 4_000, 4_000),)
    only_total = agg_rule(client=None)
    assert engine.shape_of(only_total, f1.key).groups == (rule_g,)


def test_clients_by_prefix_ipv6_by_64_and_mapped_as_ipv4():
    r = agg_rule()
    k = lambda remote, local="2001:db8::1": FlowKey.wire(A(local), 80, A(remote), 4000)
    # privacy addresses within one /64 are one client; another /64 is another
    assert engine.client_of(r, k("2001:db8:0:1::aaaa").remote_addr) == "2001:db8:0:1::/64"
    assert engine.client_of(r, k("2001:db8:0:1:ffff::1").remote_addr) == "2001:db8:0:1::/64"
    assert engine.client_of(r, k("2001:db8:0:2::1").remote_addr) == "2001:db8:0:2::/64"
    # an IPv4-mapped peer on a dual-stack socket is its IPv4 address, as on the wire
    mapped = k("::ffff:192.0.2.7", "::ffff:198.51.100.1")
    assert engine.shape_of(r, mapped).groups[-1].id == "dl/192.0.2.7/32"
    wide = agg_rule(prefix=(24, 48))
    assert engine.client_of(wide, A("192.0.2.200")) == "192.0.2.0/24"
    assert engine.client_of(wide, A("2001:db8:1:ffff::1")) == "2001:db8:1::/48"


def test_group_rate_change_is_a_change_and_a_group_rename_a_relabel():
    k = flow().key
    g = lambda gid, rate: (Group(GroupKind.CLIENT, gid, rate, rate),)
    have = {k: Shape("dl", 1, 1, g("dl/192.0.2.7/32", 4))}
    assert engine.plan({k: Shape("dl", 1, 1, g("dl/192.0.2.7/32", 5))}, have)[0].kind is OpKind.CHANGE
    # a flow adopted after a restart: the kernel's groups have the right rates, no names yet
    adopted = {k: Shape("", 1, 1, g("", 4))}
    assert [o.kind for o in engine.plan(have, adopted)] == [OpKind.RELABEL]
    # gaining or losing a level is a change (the flow moves under other parents)
    assert engine.plan({k: Shape("dl", 1, 1)}, have)[0].kind is OpKind.CHANGE
    assert engine.plan(have, have) == []


# ------------------------------------------------------------------ UDP (issue 17)

def udp(f: Flow) -> Flow:
    k = f.key
    return Flow(FlowKey(k.local_addr, k.local_port, k.remote_addr, k.remote_port,
                        Protocol.UDP), f.direction, f.proc, f.source, f.netns_ino, f.seen_ns)


def test_protocol_matching_keeps_tcp_and_udp_of_the_same_ports_apart():
    t = flow()
    u = udp(t)
    assert t.key != u.key and t.key < u.key and str(u.key).endswith("/udp")
    rs = RuleSet("eth0", rules=(rule("tcp", local_port=PortSet(((8443, 8443),))),
                                rule("udp", rate=2, local_port=PortSet(((8443, 8443),)),
                                     protocol=Protocol.UDP)))
    want = engine.desired({t.key: t, u.key: u}, rs)
    assert {k.protocol: s.rule for k, s in want.items()} == {Protocol.TCP: "tcp",
                                                             Protocol.UDP: "udp"}
    anyp = RuleSet("eth0", rules=(rule("any", local_port=PortSet(((8443, 8443),)),
                                       protocol=Protocol.ANY),))
    assert len(engine.desired({t.key: t, u.key: u}, anyp)) == 2


def test_idle_expiry_per_rule_and_bounds():
    short = Rule("short", Match(local_port=PortSet(((1, 1),)), protocol=Protocol.UDP), 1,
                 idle_timeout_ns=2 * 10**9)
    long_ = Rule("long", Match(local_port=PortSet(((2, 2),)), protocol=Protocol.UDP), 1,
                 idle_timeout_ns=60 * 10**9)
    rs = RuleSet("eth0", rules=(short, long_))
    assert engine.udp_idle_timeouts(rs) == (2 * 10**9, 60 * 10**9)
    assert engine.udp_idle_timeouts(RuleSet("eth0")) == (30 * 10**9, 30 * 10**9)
    a, b, c = udp(flow(lport=1)), udp(flow(lport=2)), udp(flow(lport=3))   # c: no rule
    flows = {f.key: f for f in (a, b, c)}
    idle = {a.key: 0, b.key: 0, c.key: 0}
    assert engine.idle_expired(flows, idle, rs, 1 * 10**9) == []
    assert engine.idle_expired(flows, idle, rs, 2 * 10**9) == [a.key]
    assert engine.idle_expired(flows, idle, rs, 30 * 10**9) == sorted([a.key, c.key])
    assert engine.idle_expired(flows, idle, rs, 60 * 10**9) == sorted([a.key, b.key, c.key])
    # TCP flows never end by idleness
    t = flow(lport=1)
    assert engine.idle_expired({t.key: t}, {t.key: 0}, rs, 10**12) == []


def test_flow_table_idle_reopen_and_snapshot_keeps_peers_of_open_sockets():
    from flowpacer.daemon.flows import FlowTable
    from flowpacer.model import EventKind, FlowEvent, FlowSource
    from flowpacer.sources.sockdiag import Snapshot
    ft = FlowTable()
    u = udp(flow())
    u = Flow(u.key, u.direction, u.proc, FlowSource.TRACER, 0, 5)
    ft.on_event(FlowEvent(EventKind.OPEN, u))
    ft.take_dirty()
    ft.on_event(FlowEvent(EventKind.IDLE, Flow(u.key, u.direction, u.proc, u.source, 0, 7)))
    assert ft.idle_since == {u.key: 7} and not ft.dirty          # idle is not an end
    ft.on_event(FlowEvent(EventKind.OPEN, u))                     # a datagram again
    assert ft.idle_since == {}
    # a snapshot without the peer (sock_diag cannot list it) keeps it while its port's socket
    # is open, and drops it once no UDP socket has that port
    snap = Snapshot()
    snap.udp_ports = frozenset({u.key.local_port})
    ft.on_snapshot(snap, started_ns=100)
    assert u.key in ft.flows
    ft.on_snapshot(Snapshot(), started_ns=100)
    assert u.key not in ft.flows
    ft.on_event(FlowEvent(EventKind.OPEN, u))
    ft.expire([u.key])
    assert u.key not in ft.flows and u.key in ft.dirty and ft.events[("idle", "close")] == 1


def test_flow_table_connected_udp_idled_out_is_not_reopened_by_a_snapshot():
    """sock_diag keeps listing a connected UDP socket that idled out: the snapshot must not open
    it again (only the tracer does, at its next datagram); once its socket is gone from the
    snapshot, a new socket of that tuple is adopted as usual."""
    from flowpacer.daemon.flows import FlowTable
    from flowpacer.model import EventKind, FlowEvent, FlowSource
    from flowpacer.sources.sockdiag import Snapshot
    ft = FlowTable()
    u = udp(flow())
    u = Flow(u.key, u.direction, u.proc, FlowSource.TRACER, 0, 5)
    listed = Snapshot({u.key: Flow(u.key, u.direction, u.proc, FlowSource.RECONCILE, 0, 50)})
    ft.on_event(FlowEvent(EventKind.OPEN, u))
    ft.expire([u.key])
    ft.take_dirty()
    ft.on_snapshot(listed, started_ns=100)
    assert u.key not in ft.flows and not ft.dirty, "an idled-out socket re-opened by sock_diag"
    ft.on_event(FlowEvent(EventKind.OPEN, u))                     # it sends again (WAKE)
    assert u.key in ft.flows and not ft.expired
    ft.expire([u.key])
    ft.on_snapshot(Snapshot(), started_ns=200)                    # closed: forgotten
    assert not ft.expired
    ft.on_snapshot(listed, started_ns=300)                        # a new socket, same tuple
    assert u.key in ft.flows and ft.flows[u.key].source is FlowSource.RECONCILE
def test_receive_side_is_its_own_map_first_match_wins():
    """Issue 17: the receive map holds the flows whose FIRST matching rule has a receive_rate;
    a flow matched first by a send-only rule is not shaped on receive, even if a later rule has a
    receive_rate."""
    import dataclasses
    up = dataclasses.replace(rule("up", process=("musicd",), local_port=PortSet(((8443, 8443),))),
                             receive_rate_bps=1_250_000)
    upc = dataclasses.replace(rule("upc", process=("nginx",)), receive_rate_bps=1_000,
                              receive_ceil_bps=500)            # ceil below rate: rate wins
    rs = RuleSet("eth0", rules=(up, rule("send", process=("musicd",)), upc))
    f1, f2, f3 = flow(), flow(lport=9000), flow(comm="nginx", rport=40001)
    flows = {f.key: f for f in (f1, f2, f3)}
    assert engine.desired_receive(flows, rs) == {f1.key: Shape("up", 1_250_000, 1_250_000),
                                                 f3.key: Shape("upc", 1_000, 1_000)}
    assert set(engine.desired(flows, rs)) == {f1.key, f2.key, f3.key}
    assert rs.receives and not RuleSet("eth0", rules=(rule("x"),)).receives


def test_receive_only_rule_no_send_shape_and_no_fall_through():
    """Issue 17: a flow whose first matching rule has receive_rate only gets a receive shape and
    no send shape at all (no 0-rate or unlimited class), and does not fall through to a later
    rule's send rate."""
    import dataclasses
    import pytest
    up = dataclasses.replace(rule("up", process=("musicd",)), rate_bps=None,
                             receive_rate_bps=625_000, receive_ceil_bps=2_500_000)
    rs = RuleSet("eth0", rules=(up, rule("send", process=("musicd",))))
    f1 = flow()
    flows = {f1.key: f1}
    assert engine.desired(flows, rs) == {}
    assert engine.desired_receive(flows, rs) == {f1.key: Shape("up", 625_000, 2_500_000)}
    assert not up.sends and rs.receives
    with pytest.raises(ValueError):
        engine.shape_of(up)

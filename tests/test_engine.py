"""The engine is pure: flows + rules in, desired shapes and an ordered plan out."""
import ipaddress

from flowpacer import engine
from flowpacer.model import (Direction, Flow, FlowKey, Match, Op, OpKind, PortSet, ProcessInfo, Rule,
                             RuleSet, Shape)

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

"""IPv4, IPv6 and IPv4-mapped flows mixed in one batch, through every place that orders,
compares, hashes or groups flow keys: FlowKey's order, the flow table (tracer events and
sock_diag diffs), the engine's plan, the reconciler and backend, the status view, metrics and
top; and the real htb backend's apply, adoption and audit with such a batch in the kernel."""
import ipaddress
import json
import time

import pytest
from hypothesis import given, settings, strategies as st

from flowpacer.policy import engine
from flowpacer.surfaces import view as views
from flowpacer.daemon.flows import FlowTable
from flowpacer.surfaces.metrics import FlowpacerCollector
from flowpacer.model import (BackendKind, Direction, EventKind, Flow, FlowEvent, FlowKey,
                             FlowSource, FlowSourceStatus, Match, Op, OpKind, ProcessInfo,
                             Protocol, Rule, RuleSet, Shape)
from flowpacer.daemon.reconciler import Reconciler
from flowpacer.sources.sockdiag import Snapshot
from flowpacer.daemon.supervisor import BackendSupervisor
from flowpacer.surfaces.top import Tracker
from harness.fakes import FakeFactory

ports = st.integers(1, 65535)
v4 = st.integers(1, 2**32 - 2).map(ipaddress.IPv4Address)
v6 = st.integers(1, 2**128 - 2).map(ipaddress.IPv6Address).filter(
    lambda a: a.ipv4_mapped is None)
mapped = v4.map(lambda a: ipaddress.IPv6Address("::ffff:" + str(a)))


@st.composite
def keys(draw):
    """Keys of every family, TCP or UDP (issue 17), and a UDP peer of an unconnected socket
    bound to the wildcard (local address unspecified; a dual-stack one to a mapped peer)."""
    proto = draw(st.sampled_from([Protocol.TCP, Protocol.UDP]))
    kind = draw(st.sampled_from(["v4", "v6", "mapped", "half-mapped", "wildcard"]))
    if kind == "wildcard":
        la = draw(st.sampled_from([ipaddress.IPv4Address(0), ipaddress.IPv6Address(0)]))
        ra = draw(v4 if la.version == 4 else st.one_of(v6, mapped))
        return FlowKey.wire(la, draw(ports), ra, draw(ports), Protocol.UDP)
    if kind == "v4":
        la, ra = draw(v4), draw(v4)
    elif kind == "v6":
        la, ra = draw(v6), draw(v6)
    elif kind == "mapped":
        la, ra = draw(mapped), draw(mapped)
    else:                       # one side mapped, the other plain IPv6: stays IPv6
        la, ra = draw(mapped), draw(v6)
    return FlowKey.wire(la, draw(ports), ra, draw(ports), proto)


RULES = RuleSet("x", BackendKind.HTB, 10**9, (
    Rule("v4net", Match(process=("srv",), remote=(ipaddress.ip_network("0.0.0.0/1"),),
                        protocol=Protocol.ANY), 1000),
    Rule("v6net", Match(process=("srv",), remote=(ipaddress.ip_network("8000::/1"),),
                        protocol=Protocol.ANY), 2000),
    Rule("rest", Match(process=("srv",), protocol=Protocol.ANY), 3000),
))


def flow(k, comm="srv", src=FlowSource.TRACER, seen=0):
    return Flow(k, Direction.INBOUND, ProcessInfo(pid=7, comm=comm), src, seen_ns=seen)


def test_flowkey_order_is_total_across_families():
    a = FlowKey(ipaddress.ip_address("10.0.0.1"), 1, ipaddress.ip_address("10.0.0.2"), 2)
    b = FlowKey(ipaddress.ip_address("fd00::1"), 1, ipaddress.ip_address("fd00::2"), 2)
    m = FlowKey.wire(ipaddress.ip_address("::ffff:10.0.0.1"), 1,
                     ipaddress.ip_address("::ffff:10.0.0.2"), 2)
    assert m == a and hash(m) == hash(a) and m.family == 4
    assert sorted([b, a]) == [a, b] and a < b and b > a and a <= m and not b < a


@settings(max_examples=200, deadline=None)
@given(st.lists(keys(), min_size=1, max_size=40, unique=True))
def test_order_is_a_total_order(ks):
    s = sorted(ks)
    assert all(x <= y for x, y in zip(s, s[1:]))
    assert sorted(reversed(s)) == s
    for x in ks:
        for y in ks[:5]:
            assert (x < y) + (y < x) + (x == y) == 1


@settings(max_examples=100, deadline=None)
@given(st.lists(keys(), min_size=1, max_size=30, unique=True),
       st.lists(keys(), max_size=10, unique=True), st.data())
def test_mixed_batches_through_table_engine_backend_view_metrics_top(ks, extra, data):
    sup = BackendSupervisor(FakeFactory())
    sup.start(RULES)
    rec = Reconciler(sup, RULES)
    # one tracer batch with every family, then a sock_diag snapshot that drops some and adds
    # others (mixed), then a reload-style re-plan of everything
    rec.on_events([FlowEvent(EventKind.OPEN, flow(k, seen=1)) for k in ks])
    assert set(sup.backend.installed()) == set(ks)
    keep = data.draw(st.sets(st.sampled_from(ks)))
    snap = Snapshot({k: flow(k, src=FlowSource.RECONCILE, seen=5) for k in keep | set(extra)})
    rec.reconcile(snap, started_ns=10)
    want = keep | set(extra)
    assert set(sup.backend.installed()) == want
    for k, s in sup.backend.installed().items():
        assert s == engine.shape_of(engine.first_match(RULES.rules, flow(k)))
    rec.table.mark_all()
    rec.apply_dirty()
    assert not rec.table.dirty
    # the view, its JSON, the metrics and top all take the mixed set
    with rec.lock:
        v = views.build(rec, sup, (), rules_path="r", flow_source=FlowSourceStatus(), tracer_stats=None)
    ch = sup.open_stats_channel()
    j = views.to_json(v, sup.class_stats(ch))
    assert len(j["flows"]) == len(want) == v.live_flows
    json.dumps(j)
    from prometheus_client import CollectorRegistry
    from prometheus_client.exposition import generate_latest
    reg = CollectorRegistry(auto_describe=False)
    reg.register(FlowpacerCollector(lambda: v, lambda: sup.class_stats(ch), addresses="full"))
    text = generate_latest(reg).decode()
    assert text.count("flowpacer_flow_sent_bytes_total{") == len(want)
    tv = Tracker("/nonexistent", 1.0).update(j, time.monotonic())
    assert len(tv.rows) == len(want)
    # and everything goes when the flows end, in one mixed close batch
    rec.on_events([FlowEvent(EventKind.CLOSE, flow(k)) for k in want])
    assert sup.backend.installed() == {}


@settings(max_examples=100, deadline=None)
@given(st.lists(keys(), max_size=25, unique=True), st.lists(keys(), max_size=25, unique=True))
def test_plan_of_mixed_want_and_have(a, b):
    want = {k: Shape("r", 1, 1) for k in a}
    have = {k: Shape("r", 2, 2) for k in b}
    ops = engine.plan(want, have)
    assert {o.key for o in ops if o.kind is OpKind.REMOVE} == set(b) - set(a)
    assert {o.key for o in ops if o.kind is OpKind.ADD} == set(a) - set(b)
    assert {o.key for o in ops if o.kind is OpKind.CHANGE} == set(a) & set(b)


def test_flow_table_snapshot_diff_with_mixed_families():
    t = FlowTable()
    ks = [FlowKey.wire(ipaddress.ip_address(x), 80, ipaddress.ip_address(y), 5000 + i)
          for i, (x, y) in enumerate([("10.0.0.1", "10.0.0.2"), ("fd00::1", "fd00::2"),
                                      ("::ffff:10.0.0.1", "::ffff:10.0.0.3")])]
    t.on_snapshot(Snapshot({k: flow(k, src=FlowSource.RECONCILE, seen=1) for k in ks}), 2)
    assert set(t.take_dirty()) == set(ks)
    t.on_snapshot(Snapshot({ks[1]: flow(ks[1], src=FlowSource.RECONCILE, seen=1)}), 3)
    assert set(t.take_dirty()) == {ks[0], ks[2]} and set(t.flows) == {ks[1]}


@pytest.mark.kernel
def test_real_htb_backend_mixed_batch_adoption_and_audit(testbed):
    """One plan with IPv4, IPv6 and v4-mapped keys into the kernel, a restart that adopts them
    (keys read back from the u32 filters), and the audit: nothing mixed up, nothing refused."""
    from flowpacer.kernel.backend import tc as tcb
    from flowpacer.kernel.backend.htb import HtbCodec
    from harness.testbed import in_netns
    tb = testbed
    mapped_server = ipaddress.ip_address(f"::ffff:{tb.server_v4}")
    mapped_client = ipaddress.ip_address(f"::ffff:{tb.client_v4}")
    ks = []
    for i in range(20):
        ks.append(FlowKey(tb.server_v4, 80, tb.client_v4, 30000 + i))
        ks.append(FlowKey(tb.server_v6, 80, tb.client_v6, 30000 + i))
        ks.append(FlowKey.wire(mapped_server, 8080, mapped_client, 31000 + i))
        # issue 17: UDP flows of the very same tuples, and peers of wildcard-bound sockets
        ks += [FlowKey(k.local_addr, k.local_port, k.remote_addr, k.remote_port, Protocol.UDP)
               for k in ks[-3:]]
        ks.append(FlowKey.wire(ipaddress.IPv6Address(0), 443, mapped_client, 32000 + i,
                               Protocol.UDP))
        ks.append(FlowKey(ipaddress.IPv6Address(0), 443, tb.client_v6, 32000 + i, Protocol.UDP))
    with in_netns(tb.server_ns):
        b = tcb.TcBackend(HtbCodec(), tb.server_if, 125_000_000)
        b.setup()
        ops = engine.plan({k: Shape("r", 125_000 * (1 + i % 3), 125_000 * (1 + i % 3))
                           for i, k in enumerate(ks)}, {})
        r = b.apply(ops)
        assert (r.added, r.errors) == (len(ks), [])
        b.close()                                   # a crash: no teardown
        b2 = tcb.TcBackend(HtbCodec(), tb.server_if, 125_000_000)
        b2.setup()
        try:
            inst = b2.installed()
            assert set(inst) == set(ks)
            assert sorted(inst) == sorted(ks)
            assert b2.audit() == []
            half = sorted(ks)[::2]
            r = b2.apply(engine.plan({}, {k: inst[k] for k in half}))
            assert (r.removed, r.errors) == (len(half), [])
            assert set(b2.installed()) == set(ks) - set(half)
        finally:
            b2.teardown()
            b2.close()

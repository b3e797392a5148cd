"""The per-flow shortcuts of the daemon's hot path (issue 26) give what the plain code gives:
the tracer's cached key building is FlowKey.wire, the key's own hash agrees with its equality,
the engine's order is FlowKey's total order, one shape per rule is the rule's shape."""
import ipaddress
import socket

from hypothesis import given, settings, strategies as st

from flowpacer.model import Direction, Flow, FlowKey, FlowSource, ProcessInfo, Protocol
from flowpacer.policy import engine, rules
from flowpacer.sources.tracer import Tracer

_v4 = st.integers(0, 2**32 - 1).map(ipaddress.IPv4Address)
_v6 = st.integers(0, 2**128 - 1).map(ipaddress.IPv6Address)
_mapped = _v4.map(lambda a: ipaddress.IPv6Address("::ffff:" + str(a)))
_raw_v6 = st.one_of(_v6, _mapped, st.just(ipaddress.IPv6Address("::")))


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.tuples(st.just(socket.AF_INET), _v4, _v4),
                 st.tuples(st.just(socket.AF_INET6), _raw_v6, _raw_v6)),
       st.integers(0, 65535), st.integers(0, 65535),
       st.sampled_from([Protocol.TCP, Protocol.UDP]))
def test_tracer_key_is_flowkey_wire(addrs, lport, rport, proto):
    fam, la, ra = addrs
    raw = lambda a: a.packed.ljust(16, b"\0")
    for _ in range(2):          # the second time from the caches
        got = Tracer._key(fam, raw(la), lport, raw(ra), rport, proto)
        assert got == FlowKey.wire(la, lport, ra, rport, proto)
        assert (got.local_addr.version, got.remote_addr.version) == \
            (FlowKey.wire(la, lport, ra, rport, proto).local_addr.version,) * 2


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.one_of(st.tuples(_v4, _v4), st.tuples(_v6, _v6)),
                          st.integers(0, 65535), st.integers(0, 65535),
                          st.sampled_from([Protocol.TCP, Protocol.UDP])), min_size=1, max_size=40))
def test_key_hash_order_and_equality(items):
    ks = [FlowKey(a[0], lp, a[1], rp, p) for a, lp, rp, p in items]
    twins = [FlowKey(k.local_addr, k.local_port, k.remote_addr, k.remote_port, k.protocol)
             for k in ks]
    for k, t in zip(ks, twins):
        assert k == t and hash(k) == hash(t) and k is not t
    assert len(set(ks) | set(twins)) == len(set((k.sort_key for k in ks)))
    assert sorted(ks, key=engine._ORDER) == sorted(ks)
    # an IPv4 key and the IPv6 key with the same integers are different keys
    v4 = FlowKey(ipaddress.IPv4Address(1), 1, ipaddress.IPv4Address(2), 2)
    v6 = FlowKey(ipaddress.IPv6Address(1), 1, ipaddress.IPv6Address(2), 2)
    assert v4 != v6 and len({v4, v6}) == 2


RULES = """
link_rate: 1gbit
interface: eth0
rules:
  - name: web
    match: {process: nginx, direction: inbound}
    rate: 2mbit
    ceil: 4mbit
  - name: agg
    match: {process: "curl*"}
    rate: 1mbit
    client_rate: 5mbit
"""


def test_desired_shapes_are_each_rules_shape():
    rs = rules.loads(RULES)
    flows = {}
    for i, comm in enumerate(["nginx", "curl", "curl2", "other", "nginx"] * 20):
        k = FlowKey(ipaddress.IPv4Address("10.0.0.1"), 80,
                    ipaddress.IPv4Address(f"10.1.{i % 7}.{i}"), 30000 + i)
        flows[k] = Flow(k, Direction.INBOUND, ProcessInfo(pid=1, comm=comm),
                        FlowSource.TRACER, 1, 1)
    want = engine.desired(flows, rs)
    assert len(want) == 80
    for k, s in want.items():
        r = engine.first_match(rs.rules, flows[k])
        assert s == engine.shape_of(r, k)

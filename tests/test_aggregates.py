"""Aggregate rates (issue 15) on htb: the group classes in the kernel, and real traffic.

The backend tests apply plans to a real htb in the testbed's server namespace and read the
classes back with ``tc``; the traffic tests run the daemon with rules that have ``client_rate``
and ``total_rate`` and measure ``iperf3 -R`` at the client (the receiver).
"""
from __future__ import annotations

import ipaddress
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowpacer.policy import engine
from flowpacer.kernel.backend import tc as tcb
from flowpacer.kernel.backend.groups import GroupTree, Member, Node, shares, targets
from flowpacer.kernel.backend.htb import HtbCodec
from flowpacer.model import FlowKey, Group, GroupKind, Match, Op, OpKind, Rule, Shape
from harness.testbed import in_netns, wait_for

MBIT = 1_000_000 // 8
LINK = 1000 * MBIT


# ------------------------------------------------------------- the arithmetic

def test_shares_in_proportion_to_the_rates_within_each_cap():
    t = GroupTree()
    t.add(Node(0x10, None, GroupKind.RULE, "dl", 30 * MBIT, 30 * MBIT))
    t.add(Node(0x11, 0x10, GroupKind.CLIENT, "dl/a", 20 * MBIT, 20 * MBIT))
    t.add(Node(0x12, 0x10, GroupKind.CLIENT, "dl/b", 20 * MBIT, 20 * MBIT))
    flows = {("a", i): Member(0x11, 8 * MBIT, 16 * MBIT) for i in range(4)}   # want 32 > 20
    flows[("b", 0)] = Member(0x12, 8 * MBIT, 16 * MBIT)                         # wants 8
    f, n = targets(t, flows, LINK)
    assert n[0x10] == (28 * MBIT, 30 * MBIT)             # the clients want 20 + 8 < 30
    assert n[0x11] == (20 * MBIT, 20 * MBIT) and n[0x12] == (8 * MBIT, 20 * MBIT)
    (quarter,) = {f[("a", i)] for i in range(4)}               # equal shares, a quarter each
    assert quarter == (shares([8 * MBIT] * 4, 20 * MBIT)[0], 16 * MBIT)
    assert 0.91 * 5 * MBIT <= quarter[0] <= 5 * MBIT
    assert f[("b", 0)] == (8 * MBIT, 16 * MBIT)
    # a third client: the rule is over its total, the clients share it by what they want
    t.add(Node(0x13, 0x10, GroupKind.CLIENT, "dl/c", 20 * MBIT, 20 * MBIT))
    flows.update({("c", i): Member(0x13, 8 * MBIT, 8 * MBIT) for i in range(2)})   # wants 16
    f, n = targets(t, flows, LINK)
    assert n[0x10] == (30 * MBIT, 30 * MBIT)
    assert sum(n[m][0] for m in (0x11, 0x12, 0x13)) <= 30 * MBIT
    assert n[0x11][1] == 20 * MBIT
    assert 0.91 * 30 * 20 / 44 <= n[0x11][0] / MBIT <= 30 * 20 / 44     # 20 of the 44 wanted
    assert 0.91 * 30 * 8 / 44 <= n[0x12][0] / MBIT <= 30 * 8 / 44
    assert sum(f[("a", i)][0] for i in range(4)) <= n[0x11][0]
    assert f[("c", 0)] == f[("c", 1)] and 2 * f[("c", 0)][0] <= n[0x13][0]


def test_unequal_flows_share_by_their_rates():
    t = GroupTree()
    t.add(Node(0x20, None, GroupKind.CLIENT, "x/a", 9 * MBIT, 9 * MBIT))
    f, _ = targets(t, {1: Member(0x20, 8 * MBIT, 8 * MBIT), 2: Member(0x20, 4 * MBIT, 4 * MBIT)},
                   LINK)
    assert f[1][0] == 2 * f[2][0] and 0.91 * 9 * MBIT <= f[1][0] + f[2][0] <= 9 * MBIT


def test_shares_change_in_steps_not_with_every_flow():
    """Oversubscription is rounded up to steps of 2**(1/8): within a step the shares stay."""
    cap = 100 * MBIT
    assert shares([8 * MBIT] * 10, cap) == [8 * MBIT] * 10                 # not full: as wanted
    seen = set()
    for n in range(13, 400):
        got = shares([8 * MBIT] * n, cap)
        assert len(set(got)) == 1 and 0.91 * cap <= sum(got) <= cap, n
        seen.add(got[0])
    # 387 client counts, a share each time that htb would have to be told about: 50 steps
    assert len(seen) <= 8 * 6 + 2



@settings(max_examples=300, deadline=None, database=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 10**8), st.integers(0, 10**8)),
                min_size=1, max_size=40),
       st.lists(st.integers(1, 10**9), min_size=6, max_size=6), st.integers(1, 10**9),
       st.booleans())
def test_targets_keep_every_cap(members, caps, total, with_rule):
    """Whatever the flows want: the children's guaranteed rates add up to at most their
    parent's (what makes a parent a cap in htb), no ceil exceeds a cap, no class gets more than
    it wants, and equal wants get equal shares."""
    t = GroupTree()
    root = None
    if with_rule:
        root = 1
        t.add(Node(1, None, GroupKind.RULE, "r", total, total))
    for c in range(6):
        cap = min(caps[c], total) if with_rule else caps[c]
        t.add(Node(0x10 + c, root, GroupKind.CLIENT, f"r/{c}", cap, cap))
    flows = {i: Member(0x10 + c, rate, rate + extra) for i, (c, rate, extra) in enumerate(members)}
    f, n = targets(t, flows, LINK)
    assert set(f) == set(flows)
    for m, (rate, ceil) in n.items():
        node = t.nodes[m]
        assert 1 <= rate <= ceil <= max(rate, node.ceil_bps), (m, rate, ceil)
        kids = [f[k][0] for k, fl in flows.items() if fl.parent == m] + \
            [n[c][0] for c in n if t.nodes[c].parent == m]
        assert sum(kids) <= rate + len(kids), (m, rate, kids)     # + the 1 B/s floors
        if node.parent is not None:
            assert ceil <= max(rate, n[node.parent][1])
    for k, (rate, ceil) in f.items():
        fl = flows[k]
        cap = n[fl.parent][1]
        assert rate <= fl.rate_bps and ceil <= max(rate, min(fl.ceil_bps, cap))
    for c in range(6):
        same = {}
        for k, fl in flows.items():
            if fl.parent == 0x10 + c:
                same.setdefault(fl.rate_bps, set()).add(f[k][0])
        assert all(len(v) == 1 for v in same.values())


# ------------------------------------------------------ the classes in the kernel

CLASS_RE = re.compile(r"class htb (\S+) (?:root|parent (\S+)) .*?rate (\S+) ceil (\S+)")


def htb_classes(tb) -> dict:
    """{classid: (parent, rate, ceil)} as tc prints them ("20Mbit")."""
    out = tb.run(tb.server_ns, ["tc", "class", "show", "dev", tb.server_if]).stdout
    got = {}
    for line in out.splitlines():
        m = CLASS_RE.search(line)
        if m:
            got[m[1]] = (m[2], m[3], m[4])
    return got


def agg_rule(client=20, total=None, ceil=None, prefix=(32, 64)):
    return Rule("dl", Match(process=("x",)), 8 * MBIT, ceil and ceil * MBIT,
                client_rate_bps=client and client * MBIT, total_rate_bps=total and total * MBIT,
                client_prefix=prefix)


def backend(tb):
    with in_netns(tb.server_ns):
        b = tcb.TcBackend(HtbCodec(), tb.server_if, LINK)
        b.setup()
    return b


def count_transactions(b):
    n = {"transact": 0}
    real = b._rtnl.transact

    def counted(reqs):
        n["transact"] += 1
        return real(reqs)
    b._rtnl.transact = counted
    return n


@pytest.mark.kernel
def test_groups_made_with_their_first_flow_and_removed_with_the_last(testbed):
    tb = testbed
    b = backend(tb)
    n = count_transactions(b)
    r = agg_rule(client=20, total=30, ceil=16)
    ka = [FlowKey(tb.server_v4, 5201, tb.client_v4, 40000 + i) for i in range(4)]
    kb = FlowKey(tb.server_v6, 5201, tb.client_v6, 41000)
    want = {k: engine.shape_of(r, k) for k in ka + [kb]}
    with in_netns(tb.server_ns):
        res = b.apply(engine.plan(want, {}))
    assert (res.added, res.errors, n["transact"]) == (5, [], 1)   # one batch, parents included
    cl = htb_classes(tb)
    groups = {g[1]: g for g in b.groups_snapshot()}
    assert set(groups) == {"dl", f"dl/{tb.client_v4}/32",
                           f"dl/{ipaddress_net(tb.client_v6, 64)}"}
    rule_cid = tcb.nl.fmt_handle(groups["dl"][2])
    a_cid = tcb.nl.fmt_handle(groups[f"dl/{tb.client_v4}/32"][2])
    assert cl[rule_cid] == ("f1f0:1", "28Mbit", "30Mbit")
    assert cl[a_cid] == (rule_cid, "20Mbit", "20Mbit")
    for k in ka:                                   # a quarter of the client rate each
        assert cl[tcb.nl.fmt_handle(b.classid_of(k))] == (a_cid, "4756Kbit", "16Mbit")  # 4.757
    assert b.installed()[ka[0]] == want[ka[0]]     # the shape is the rule's, not the share
    # two flows of the first client go: the others get half of the client rate each
    with in_netns(tb.server_ns):
        res = b.apply(engine.plan({k: want[k] for k in ka[2:] + [kb]}, want))
    assert (res.removed, res.errors, n["transact"]) == (2, [], 2)
    cl = htb_classes(tb)
    assert {cl[tcb.nl.fmt_handle(b.classid_of(k))] for k in ka[2:]} == {(a_cid, "8Mbit", "16Mbit")}
    assert cl[a_cid] == (rule_cid, "16Mbit", "20Mbit")
    # the last flows go, and so do their client and rule classes
    with in_netns(tb.server_ns):
        res = b.apply(engine.plan({}, b.installed()))
    assert (res.removed, res.errors, n["transact"]) == (3, [], 3)
    assert set(htb_classes(tb)) == {"f1f0:1", "f1f0:2"} and b.groups_snapshot() == []


def ipaddress_net(addr, bits):
    return ipaddress.ip_network((addr, bits), strict=False)


@pytest.mark.kernel
def test_plain_rules_are_unchanged_and_moving_between_groups(testbed):
    tb = testbed
    b = backend(tb)
    k = FlowKey(tb.server_v4, 80, tb.client_v4, 40000)
    plain = Shape("p", 8 * MBIT, 8 * MBIT)
    with in_netns(tb.server_ns):
        b.apply([Op(OpKind.ADD, k, plain)])
    cid = tcb.nl.fmt_handle(b.classid_of(k))
    assert htb_classes(tb)[cid][0] == "f1f0:1"
    # a reload gives the rule a client_rate: the flow moves under a new client class
    grouped = engine.shape_of(agg_rule(client=20), k)
    with in_netns(tb.server_ns):
        res = b.apply(engine.plan({k: grouped}, b.installed()))
    assert not res.errors
    cl = htb_classes(tb)
    (g,) = b.groups_snapshot()
    gcid = tcb.nl.fmt_handle(g[2])
    assert cl[gcid] == ("f1f0:1", "8Mbit", "20Mbit")
    assert cl[tcb.nl.fmt_handle(b.classid_of(k))][0] == gcid
    # the client_rate changes: the group class changes in place
    bigger = engine.shape_of(agg_rule(client=40), k)
    with in_netns(tb.server_ns):
        res = b.apply(engine.plan({k: bigger}, b.installed()))
    assert not res.errors and htb_classes(tb)[gcid] == ("f1f0:1", "8Mbit", "40Mbit")
    # and back to a plain rule: under the link again, the group class gone
    with in_netns(tb.server_ns):
        res = b.apply(engine.plan({k: plain}, b.installed()))
    assert not res.errors and b.groups_snapshot() == []
    cl = htb_classes(tb)
    assert len(cl) == 3 and cl[tcb.nl.fmt_handle(b.classid_of(k))][0] == "f1f0:1"


@pytest.mark.kernel
def test_adoption_rebuilds_the_groups_and_cleanup_removes_them(testbed):
    tb = testbed
    b = backend(tb)
    r = agg_rule(client=20, total=60)
    keys = [FlowKey(tb.server_v4, 5201, tb.client_v4, 40000 + i) for i in range(3)] + \
        [FlowKey(tb.server_v6, 5201, tb.client_v6, 40100 + i) for i in range(2)]
    want = {k: engine.shape_of(r, k) for k in keys}
    with in_netns(tb.server_ns):
        assert not b.apply(engine.plan(want, {})).errors
        b.close()                                  # the daemon died without teardown
        before = htb_classes(tb)
        b2 = tcb.TcBackend(HtbCodec(), tb.server_if, LINK)
        b2.setup()
    assert b2.removed_stale == 0 and len(b2.group_classes) == 3
    n = count_transactions(b2)
    plan = engine.plan(want, b2.installed())
    with in_netns(tb.server_ns):
        res = b2.apply(plan)
    # the plan names the adopted groups; the kernel already has the right classes
    assert not res.errors and n["transact"] == 0 and htb_classes(tb) == before
    assert b2.installed() == want
    assert engine.plan(want, b2.installed()) == []
    # a new flow of an adopted client joins its class
    k = FlowKey(tb.server_v4, 5201, tb.client_v4, 40009)
    with in_netns(tb.server_ns):
        assert not b2.apply([Op(OpKind.ADD, k, engine.shape_of(r, k))]).errors
    assert len(b2.group_classes) == 3 and len(htb_classes(tb)) == len(before) + 1
    # classes the kernel lost behind our back: audit forgets them and drops empty groups
    v6_client = [g for g in b2.groups_snapshot() if ":" in g[1]][0]
    with in_netns(tb.server_ns):
        for kk in keys[3:]:
            ht, bucket, node = tcb.u32.split_handle(b2.flow_classes.get(kk).filter_handle)
            tb.run(tb.server_ns, ["tc", "filter", "del", "dev", tb.server_if, "parent", "f1f0:",
                                  "protocol", "ipv6", "prio", str(tcb.PRIO[6]), "handle",
                                  f"{ht:x}:{bucket:x}:{node:x}", "u32"])
            tb.run(tb.server_ns, ["tc", "class", "del", "dev", tb.server_if, "classid",
                                  tcb.nl.fmt_handle(b2.classid_of(kk))])
        gone = b2.audit()
    assert set(gone) == set(keys[3:])
    assert tcb.nl.fmt_handle(v6_client[2]) not in htb_classes(tb)
    with in_netns(tb.server_ns):
        assert tcb.cleanup(tb.server_if) is True
    assert tb.run(tb.server_ns, ["tc", "class", "show", "dev", tb.server_if]).stdout == ""


# ------------------------------------------------------------- real traffic

RULES = """
    interface: IFACE
    backend: htb
    link_rate: 1gbit
    rules:
      - name: capped             # per client: 20 Mbit/s over all its streams
        match: {process: iperf3, direction: inbound, local_port: 5301-5309}
        rate: 8mbit
        client_rate: 20mbit
      - name: total              # three clients of 2 x 8 Mbit/s each, 30 Mbit/s in all
        match: {process: iperf3, direction: inbound, local_port: 5311-5319}
        rate: 8mbit
        client_rate: 16mbit
        total_rate: 30mbit
      - name: borrow             # 4 Mbit/s per stream, borrowing up to 12, 20 per client
        match: {process: iperf3, direction: inbound, local_port: 5321-5329}
        rate: 4mbit
        ceil: 12mbit
        client_rate: 20mbit
"""
PORTS = {"capped": range(5301, 5306), "total": range(5311, 5314), "borrow": range(5321, 5323)}


class Site:
    def __init__(self, tb, daemon):
        self.tb, self.daemon = tb, daemon
        v4 = int(tb.client_v4)
        # clients: .2 (the testbed's), .3; IPv6 ::2 and ::3 (one /64: one client), and ::2 in
        # the next /64 (another client)
        self.v4 = [tb.client_v4, ipaddress.IPv4Address(v4 + 1), ipaddress.IPv4Address(v4 + 2)]
        net = ipaddress.ip_network((tb.server_v6, 64), strict=False)
        other = ipaddress.ip_network((int(net.network_address) + (1 << 64), 64))
        self.v6 = [tb.client_v6, tb.client_v6 + 1, other.network_address + 2]
        self.server_v6_other = other.network_address + 1


@pytest.fixture(scope="module")
def site(module_testbed, tmp_path_factory):
    from harness.daemon import Daemon
    from harness.servers import iperf3_server
    tb = module_testbed
    s = Site(tb, None)
    for a in s.v4[1:]:
        tb.run(tb.client_ns, ["ip", "addr", "add", f"{a}/24", "dev", tb.client_if])
    tb.run(tb.client_ns, ["ip", "addr", "add", f"{s.v6[1]}/64", "dev", tb.client_if, "nodad"])
    tb.run(tb.client_ns, ["ip", "addr", "add", f"{s.v6[2]}/64", "dev", tb.client_if, "nodad"])
    tb.run(tb.server_ns, ["ip", "addr", "add", f"{s.server_v6_other}/64", "dev", tb.server_if,
                          "nodad"])
    for ports in PORTS.values():
        for p in ports:
            iperf3_server(tb, p)
    work = tmp_path_factory.mktemp("agg")
    s.daemon = Daemon(tb, work, RULES, "--backend", "htb").start()
    yield s
    rc = s.daemon.stop()
    assert rc == 0, f"the daemon exited {rc} on SIGTERM:\n{s.daemon.log_text()[-3000:]}"


def _capped_status(site):
    st = site.daemon.status()
    clients = {f["client"] for f in st["flows"] if f["rule"] == "capped"}
    n = sum(1 for f in st["flows"] if f["rule"] == "capped")
    return st if len(clients) == 4 and n == 21 else None


def iperf(site, bind, port: int, streams: int, seconds: float = 6):
    """``iperf3 -R -P streams`` from client address ``bind`` to the server's address of its
    family (the IPv6 /64 of ``bind``), the first 2 s omitted."""
    from harness import traffic
    tb = site.tb
    if bind.version == 4:
        host = tb.server_v4
    else:
        host = tb.server_v6 if bind in site.v6[:2] else site.server_v6_other
    return traffic.iperf3(tb, host, port, seconds=seconds, parallel=streams,
                          extra=["-O", "2", "-B", str(bind)])


def received(p) -> tuple:
    """(sum, [each stream]) in bytes/s of TCP payload, measured by the receiving client."""
    from harness import traffic
    doc = traffic.iperf3_result(p, timeout=60)
    streams = [s["receiver"]["bits_per_second"] / 8 for s in doc["end"]["streams"]]
    return doc["end"]["sum_received"]["bits_per_second"] / 8, streams


def payload(rate_mbit: float, v6: bool) -> float:
    """What iperf3 can receive of a class at ``rate_mbit`` (htb counts whole frames)."""
    from harness import traffic
    return rate_mbit * MBIT * traffic.wire(v6)


def report(what: str, got: float, want: float) -> str:
    return f"{what}: {got * 8 / 1e6:.2f} Mbit/s, cap {want * 8 / 1e6:.2f} ({got / want - 1:+.1%})"


@pytest.mark.kernel
def test_client_rate_over_parallel_streams_each_client_its_own(site):
    """``iperf3 -R -P 4`` from two IPv4 and two IPv6 clients at once against client_rate
    20 Mbit/s: each client's streams sum to 20 Mbit/s within 3 % and each stream gets a quarter
    within 10 %; two IPv6 addresses of one /64 are one client and share their 20 Mbit/s."""
    v4a, v4b, _ = site.v4
    v6a, v6a2, v6b = site.v6
    # 10 s, 8 measured: sixteen TCP streams on two cores need more than 4 s for each one's
    # quarter to show (one stream came out at -11 % of it in a 4 s window)
    runs = {"v4 .2": (iperf(site, v4a, 5301, 4, 10), False, 4),
            "v4 .3": (iperf(site, v4b, 5302, 4, 10), False, 4),
            "v6 other /64": (iperf(site, v6b, 5303, 4, 10), True, 4),
            "v6 ::2 half of a /64": (iperf(site, v6a, 5304, 2, 10), True, 2),
            "v6 ::3 half of a /64": (iperf(site, v6a2, 5305, 2, 10), True, 2)}
    status = wait_for(lambda: _capped_status(site), 8, 0.1, "the flows of all five clients "
                      "in status with their groups")
    got = {name: received(p) for name, (p, _, _) in runs.items()}
    # status: each flow names its rule and client and the client's rate; each group its rate
    by_client = {}
    for f in status["flows"]:
        if f["rule"] == "capped":
            assert f["client_rate_bit"] == 20_000_000 and f["total_rate_bit"] == 0
            assert f["groups"] == [{"kind": "client", "id": f"capped/{f['client']}",
                                    "rate_bit": 20_000_000, "ceil_bit": 20_000_000}]
            by_client.setdefault(f["client"], 0)
            by_client[f["client"]] += 1
    net6 = str(ipaddress.ip_network((v6a, 64), strict=False))
    net6b = str(ipaddress.ip_network((v6b, 64), strict=False))
    assert by_client == {f"{v4a}/32": 5, f"{v4b}/32": 5, net6b: 5, net6: 6}  # + control
    groups = {g["id"]: g for g in status["groups"]}
    assert groups[f"capped/{net6}"]["ceil_bit"] == 20_000_000
    assert groups[f"capped/{v4a}/32"]["kind"] == "client" and groups[f"capped/{v4a}/32"]["bytes"] > 0
    lines = []
    for name in ("v4 .2", "v4 .3", "v6 other /64"):
        v6 = runs[name][1]
        total, streams = got[name]
        want = payload(20, v6)
        lines.append(report(name, total, want) + " streams " +
                     ", ".join(f"{s * 8 / 1e6:.2f}" for s in streams))
        assert total == pytest.approx(want, rel=0.03), "\n".join(lines)
        assert len(streams) == 4
        for s in streams:
            assert s == pytest.approx(want / 4, rel=0.10), "\n".join(lines)
    shared = got["v6 ::2 half of a /64"][0] + got["v6 ::3 half of a /64"][0]
    lines.append(report("v6 ::2 + ::3 (one /64)", shared, payload(20, True)))
    assert shared == pytest.approx(payload(20, True), rel=0.03), "\n".join(lines)
    print("\n".join(lines))


@pytest.mark.kernel
def test_total_rate_over_three_clients(site):
    """Three clients of 2 streams each (IPv4 .2, .3 and IPv6) want 3 x 16 Mbit/s of a rule whose
    total_rate is 30 Mbit/s: together they get 30 within 3 %, about a third each."""
    clients = [(site.v4[0], 5311, False), (site.v4[1], 5312, False), (site.v6[2], 5313, True)]
    runs = [(iperf(site, a, p, 2), v6) for a, p, v6 in clients]
    got = [(received(p)[0], v6) for p, v6 in runs]
    total = sum(g for g, _ in got)
    # the cap counts frames: the payload it leaves depends on each client's family
    want = sum(payload(10, v6) for _, v6 in got)
    lines = [report("total of 3 clients", total, want)] + \
        [report(f"client {a}", g, payload(10, v6)) for (a, _, _), (g, v6) in zip(clients, got)]
    print("\n".join(lines))
    assert total == pytest.approx(want, rel=0.03), "\n".join(lines)
    for g, v6 in got:
        assert g == pytest.approx(payload(10, v6), rel=0.10), "\n".join(lines)


@pytest.mark.kernel
def test_borrowing_up_to_ceil_inside_the_client_cap(site):
    """rate 4, ceil 12, client_rate 20 Mbit/s: one stream alone borrows up to its ceil (12);
    three streams of one client borrow too but together stop at the client's 20."""
    one, _ = received(iperf(site, site.v4[0], 5321, 1))
    three, streams = received(iperf(site, site.v6[2], 5322, 3, seconds=8))
    lines = [report("one stream (ceil)", one, payload(12, False)),
             report("three streams (client cap)", three, payload(20, True)) + " streams " +
             ", ".join(f"{s * 8 / 1e6:.2f}" for s in streams)]
    print("\n".join(lines))
    assert one == pytest.approx(payload(12, False), rel=0.03), "\n".join(lines)
    assert three == pytest.approx(payload(20, True), rel=0.03), "\n".join(lines)
    for s in streams:
        # each near a third of the cap (htb's round robin; TCP's own dynamics on a loaded
        # 2-core host put one stream 11 % off a third)
        assert s == pytest.approx(payload(20, True) / 3, rel=0.15), "\n".join(lines)


@pytest.mark.kernel
def test_daemon_crash_under_load_keeps_the_groups(site):
    """SIGKILL the daemon while a client's 4 streams fill its client class; the next daemon
    adopts the classes (parents rebuilt from the kernel, nothing made anew) and names them again;
    the client stays at its cap all along."""
    from harness.daemon import Daemon
    tb, d = site.tb, site.daemon
    # long enough to outlive the restart: the new daemon compiles its BPF before it is ready
    # (~8 s on a quiet machine, 24 s measured on a loaded one, when 10 s streams had ended)
    p = iperf(site, site.v4[0], 5301, 4, seconds=25)
    wait_for(lambda: sum(1 for f in d.status()["flows"] if f["rule"] == "capped") == 5, 8, 0.1,
             "the 5 flows of the client (4 streams and the control connection)")
    # link, default, the client, its flows (an earlier case's classes may still be going)
    wait_for(lambda: len(htb_classes(tb)) == 2 + 1 + 5, 5, 0.1, "only this client's classes")
    before = htb_classes(tb)
    d.kill()
    d2 = Daemon(tb, d.workdir, None, "--backend", "htb", log_mode="a").start()
    site.daemon = d2                                    # the module's teardown stops this one

    def named():
        fl = [f for f in d2.status()["flows"] if f["rule"] == "capped"]
        return len(fl) == 5 and all(f["client"] == f"{site.v4[0]}/32" for f in fl)
    wait_for(named, 10, 0.1, "the adopted flows named by their rule and client")
    assert htb_classes(tb) == before                    # the same classes, parents and rates
    assert "adopted flowpacer qdisc with 5 flow classes (0 stale objects removed, " in d2.log_text()
    total, streams = received(p)
    lines = [report("4 streams across the restart", total, payload(20, False))]
    print("\n".join(lines))
    assert total == pytest.approx(payload(20, False), rel=0.03), "\n".join(lines)
    wait_for(lambda: len(htb_classes(tb)) == 2, 10, 0.1, "the client's classes to go after it")


# ------------------------------------------------------- status, top, metrics

def _view(groups, flows=()):
    from flowpacer.model import (BackendHealth, DaemonCounters, DaemonView, EventCounts,
                                 FlowSourceMode, FlowSourceStatus)
    return DaemonView(backend="htb", backend_reason="", interface="eth0",
                      backend_health=BackendHealth.OK, backend_problem="", link_rate_bps=LINK,
                      rules_path="", rule_names=("dl",),
                      flow_source=FlowSourceStatus(FlowSourceMode.TRACER), tracer=None,
                      live_flows=len(flows), flows=tuple(flows), stages=(),
                      counters=DaemonCounters(), events=EventCounts(), groups=tuple(groups))


def test_metrics_per_client_series_are_bounded_to_the_busiest():
    from flowpacer.surfaces import metrics
    from flowpacer.model import ClassStats, GroupView
    groups = [GroupView(GroupKind.RULE, "dl", "f1f0:10", 25 * MBIT, 30 * MBIT)]
    stats = {}
    for i in range(150):                      # 150 clients, client i sent i * 1000 bytes
        cid = 0x100 + i
        groups.append(GroupView(GroupKind.CLIENT, f"dl/10.0.{i // 100}.{i % 100}/32",
                                f"f1f0:{cid:x}", MBIT, 2 * MBIT))
        stats[groups[-1].stats_key("eth0")] = ClassStats(bytes=i * 1000)
    fams = {f.name: f for f in metrics.group_families(_view(groups), stats,
                                                      metrics.AddressLabels.FULL)}
    assert [(s.labels, s.value) for s in fams["flowpacer_rule_total_rate_bytes_per_second"].samples] \
        == [({"rule": "dl", "interface": "eth0"}, 30 * MBIT)]
    sent = fams["flowpacer_client_sent_bytes"].samples
    assert len(sent) == 100 and fams["flowpacer_client_series_overflow"].samples[0].value == 50
    assert sent[0].labels == {"rule": "dl", "client": "10.0.1.49/32", "interface": "eth0"}
    assert sent[0].value == 149000
    assert min(s.value for s in sent) == 50000       # the 100 busiest, no other
    # prefix mode merges clients into their /24; none has no per-client series
    fams = {f.name: f for f in metrics.group_families(_view(groups), stats,
                                                      metrics.AddressLabels.PREFIX)}
    assert {s.labels["client"] for s in fams["flowpacer_client_sent_bytes"].samples} == {
        "10.0.0.0/24", "10.0.1.0/24"}
    fams = {f.name: f for f in metrics.group_families(_view(groups), stats,
                                                      metrics.AddressLabels.NONE)}
    assert fams["flowpacer_client_sent_bytes"].samples == []


def test_status_json_and_top_show_the_groups():
    from flowpacer.surfaces import top, view
    from flowpacer.model import ClassStats, FlowView, GroupView
    k = FlowKey(ipaddress.ip_address("192.0.2.1"), 443, ipaddress.ip_address("2001:db8::7"), 4000)
    r = agg_rule(client=20, total=30)
    shape = engine.shape_of(r, k)
    f = FlowView(k, "f1f0:12", "dl", shape.rate_bps, shape.ceil_bps, 7, "nginx", groups=shape.groups)
    plain = FlowView(FlowKey(k.local_addr, 443, ipaddress.ip_address("192.0.2.9"), 1), "f1f0:13",
                     "p", MBIT, MBIT)
    gv = (GroupView(GroupKind.RULE, "dl", "f1f0:10", 8 * MBIT, 30 * MBIT),
          GroupView(GroupKind.CLIENT, "dl/2001:db8::/64", "f1f0:11", 8 * MBIT, 20 * MBIT))
    st = view.to_json(_view(gv, [f, plain]), {gv[1].stats_key("eth0"): ClassStats(bytes=1234)})
    fj = next(x for x in st["flows"] if x["rule"] == "dl")
    assert (fj["client"], fj["client_rate_bit"], fj["total_rate_bit"]) == (
        "2001:db8::/64", 20_000_000, 30_000_000)
    assert [g["kind"] for g in fj["groups"]] == ["rule", "client"]
    pj = next(x for x in st["flows"] if x["rule"] == "p")
    assert (pj["groups"], pj["client"]) == ([], "")
    assert st["groups"][1] == {"kind": "client", "id": "dl/2001:db8::/64", "interface": "eth0",
                               "classid": "f1f0:11",
                               "rate_bit": 8_000_000, "ceil_bit": 20_000_000, "bytes": 1234,
                               "packets": 0, "drops": 0}
    t = top.Tracker("/nonexistent", 1.0)
    v = t.update(st, 1.0)
    text = "\n".join(line for _s, line in top.render(v, 200, 30))
    assert "CLIENT" in text and "2001:db8::/64 @20 Mbit/s" in text
    assert "(total 30 Mbit/s)" in text


@pytest.mark.kernel          # root: chown, root-owned files
def test_the_daemon_logs_the_warnings_of_its_rules(tmp_path, caplog):
    from flowpacer.policy import rules
    f = tmp_path / "rules.yaml"
    f.write_text("link_rate: 100mbit\nrules:\n"
                 "  - {name: a, match: {process: a}, rate: 8mbit, total_rate: 60mbit}\n"
                 "  - {name: b, match: {process: b}, rate: 8mbit, total_rate: 60mbit}\n")
    f.chmod(0o644)
    with caplog.at_level("WARNING"):
        rs = rules.load_checked(str(f))
    assert len(rs.rules) == 2 and len(rs.warnings) == 1
    assert [r.getMessage() for r in caplog.records] == [str(rs.warnings[0])]
    assert f"{f}:4:61: rule 'b': total_rate: warning: " in str(rs.warnings[0])

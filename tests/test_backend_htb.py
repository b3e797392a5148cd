"""The htb backend against the real kernel, in namespaces made by the test."""
import ipaddress
import json
import subprocess

import pytest

from flowpacer.kernel.backend import tc as tcb
from flowpacer.kernel.backend.htb import HtbCodec
from flowpacer.errors import BackendError
from flowpacer.model import FlowKey, Op, OpKind, Shape
from harness.testbed import in_netns, server_argv, wait_for
from harness import traffic

pytestmark = pytest.mark.kernel

MBIT = 1_000_000 // 8
LINK = 1000 * MBIT
WIRE = 1448 / 1514


def tcj(tb, *what):
    r = tb.run(tb.server_ns, ["tc", "-j", *what, "show", "dev", tb.server_if])
    return json.loads(r.stdout or "[]")


def n_filters(tb):
    out = tb.run(tb.server_ns, ["tc", "filter", "show", "dev", tb.server_if]).stdout
    return sum(1 for line in out.splitlines() if "flowid" in line)


def classes(tb):
    """Class handles (iproute2 6.1 prints no JSON for htb classes)."""
    out = tb.run(tb.server_ns, ["tc", "class", "show", "dev", tb.server_if]).stdout
    return {line.split()[2] for line in out.splitlines() if line.startswith("class ")}


def backend(tb, **kw):
    with in_netns(tb.server_ns):
        b = tcb.TcBackend(HtbCodec(), tb.server_if, LINK, **kw)
        b.setup()
    return b


def key(tb, lport, rport, v6=False):
    if v6:
        return FlowKey(tb.server_v6, lport, tb.client_v6, rport)
    return FlowKey(tb.server_v4, lport, tb.client_v4, rport)


def test_setup_creates_skeleton_and_teardown_restores(testbed):
    b = backend(testbed)
    q = tcj(testbed, "qdisc")
    assert q[0]["kind"] == "htb" and q[0]["handle"] == "f1f0:"
    cl = classes(testbed)
    assert {"f1f0:1", "f1f0:2"} <= cl
    with in_netns(testbed.server_ns):
        b.teardown()
    assert tcj(testbed, "qdisc")[0]["kind"] != "htb"


def test_refuses_foreign_root_qdisc_unless_take_over(testbed):
    testbed.run(testbed.server_ns, ["tc", "qdisc", "add", "dev", testbed.server_if, "root",
                                    "handle", "5:", "tbf", "rate", "1mbit", "burst", "10k",
                                    "latency", "10ms"])
    with pytest.raises(BackendError, match=r"already has a root qdisc \(tbf 5:0\).*--take-over"):
        backend(testbed)
    assert tcj(testbed, "qdisc")[0]["kind"] == "tbf"
    backend(testbed, take_over=True)
    assert tcj(testbed, "qdisc")[0]["kind"] == "htb"


def test_missing_interface_is_one_line():
    b = tcb.TcBackend(HtbCodec(), "fp-nonexist0", LINK)
    with pytest.raises(BackendError, match="interface 'fp-nonexist0' not found"):
        b.setup()


@pytest.mark.parametrize("v6", [False, True], ids=["ipv4", "ipv6"])
def test_flow_is_classified_and_shaped(testbed, v6):
    """A real TCP flow lands in its own class and gets its rate; other traffic does not."""
    testbed.popen(testbed.server_ns, server_argv([9001], "fp-test-srv", v6=True))
    testbed.wait_listening(9001)
    b = backend(testbed)
    k = key(testbed, 9001, 41234, v6)
    with in_netns(testbed.server_ns):
        r = b.apply([Op(OpKind.ADD, k, Shape("t", 10 * MBIT, 10 * MBIT))])
    assert r.added == 1 and not r.errors
    res = testbed.fetch(9001, 4, v6=v6, local_port=41234)
    with in_netns(testbed.server_ns):
        st = b.stats()[k]
        dflt = b.default_stats()
    assert st.bytes > res["bytes"]                       # the whole download went through it
    assert dflt.bytes < 100_000                          # not through the default class
    # TCP payload per full frame: 1448 of 1514 bytes over IPv4, 1428 over IPv6
    assert res["goodput_bps"] == pytest.approx(10 * MBIT * traffic.wire(v6), rel=0.03)
    # another flow of the same hosts is not shaped by it
    other = testbed.fetch(9001, 2, v6=v6, local_port=41235)
    assert other["goodput_bps"] > 5 * 10 * MBIT


def test_change_in_place_and_remove(testbed):
    testbed.popen(testbed.server_ns, server_argv([9002], "fp-test-srv"))
    testbed.wait_listening(9002)
    b = backend(testbed)
    k = key(testbed, 9002, 42000)
    with in_netns(testbed.server_ns):
        b.apply([Op(OpKind.ADD, k, Shape("t", 5 * MBIT, 5 * MBIT))])
        cid = b.classid_of(k)
        r = b.apply([Op(OpKind.CHANGE, k, Shape("t", 20 * MBIT, 20 * MBIT))])
    assert r.changed == 1 and b.classid_of(k) == cid
    res = testbed.fetch(9002, 3, local_port=42000)
    assert res["goodput_bps"] == pytest.approx(20 * MBIT * WIRE, rel=0.03)
    with in_netns(testbed.server_ns):
        r = b.apply([Op(OpKind.REMOVE, k)])
    assert r.removed == 1
    assert classes(testbed) == {"f1f0:1", "f1f0:2"} and n_filters(testbed) == 0


def test_apply_is_idempotent(testbed):
    b = backend(testbed)
    k = key(testbed, 80, 5000)
    s = Shape("t", MBIT, MBIT)
    with in_netns(testbed.server_ns):
        assert b.apply([Op(OpKind.ADD, k, s)]).added == 1
        again = b.apply([Op(OpKind.ADD, k, s), Op(OpKind.REMOVE, key(testbed, 81, 1))])
    assert (again.added, again.removed, again.errors) == (0, 0, [])
    assert len(classes(testbed)) == 3 and n_filters(testbed) == 1


def test_adopt_after_restart_and_remove_stale(testbed):
    b = backend(testbed)
    keys = [key(testbed, 443, 50000 + i) for i in range(5)] + [key(testbed, 443, 50100, v6=True)]
    with in_netns(testbed.server_ns):
        b.apply([Op(OpKind.ADD, k, Shape("t", (i + 1) * MBIT, (i + 2) * MBIT)) for i, k in enumerate(keys)])
        b.close()                                        # the daemon died without teardown
        # a class without a filter (half-done add) is stale too
        testbed.run(testbed.server_ns, ["tc", "class", "add", "dev", testbed.server_if, "parent",
                                        "f1f0:1", "classid", "f1f0:ff0", "htb", "rate", "1mbit"])
        b2 = tcb.TcBackend(HtbCodec(), testbed.server_if, LINK)
        b2.setup()
    inst = b2.installed()
    assert set(inst) == set(keys)
    assert inst[keys[2]].rate_bps == 3 * MBIT and inst[keys[2]].ceil_bps == 4 * MBIT
    assert "f1f0:ff0" not in classes(testbed) and b2.removed_stale == 1
    with in_netns(testbed.server_ns):          # only the live flows stay; new ones get fresh ids
        r = b2.apply([Op(OpKind.REMOVE, k) for k in keys[:3]]
                     + [Op(OpKind.ADD, key(testbed, 443, 60000), Shape("t", MBIT, MBIT))])
    assert (r.removed, r.added, r.errors) == (3, 1, [])
    assert n_filters(testbed) == 4 and len(classes(testbed)) == 6


def test_cleanup_without_daemon(testbed):
    backend(testbed).close()
    with in_netns(testbed.server_ns):
        assert tcb.cleanup(testbed.server_if) is True
        assert tcb.cleanup(testbed.server_if) is False
    assert tcj(testbed, "qdisc")[0]["kind"] != "htb"


def test_kernel_refusal_is_one_line_with_reason(testbed):
    b = backend(testbed)
    k = key(testbed, 80, 1)
    with in_netns(testbed.server_ns):
        r = b.apply([Op(OpKind.ADD, k, Shape("t", 0, 0))])     # htb refuses a zero rate
        assert r.added == 0 and len(r.errors) == 1
        assert "\n" not in r.errors[0].reason and "Invalid argument" in r.errors[0].reason
        assert k not in b.installed()
        ok = b.apply([Op(OpKind.ADD, key(testbed, 80, 2), Shape("t", MBIT, MBIT))])
    assert ok.added == 1 and len(classes(testbed)) == 3     # nothing of the failed add is left


def test_5000_flows_hashed(testbed):
    """5000 flows in, classification still exact through the hash tables, all out again."""
    testbed.popen(testbed.server_ns, server_argv([9003], "fp-test-srv"))
    testbed.wait_listening(9003)
    b = backend(testbed)
    many = [key(testbed, 9003, 20000 + i) for i in range(2500)]
    many += [key(testbed, 9003, 20000 + i, v6=True) for i in range(2500)]
    target = key(testbed, 9003, 43210)
    with in_netns(testbed.server_ns):
        r = b.apply([Op(OpKind.ADD, k, Shape("t", 100 * MBIT, 100 * MBIT)) for k in many]
                    + [Op(OpKind.ADD, target, Shape("t", 10 * MBIT, 10 * MBIT))])
    assert r.added == 5001 and not r.errors
    assert n_filters(testbed) == 5001
    res = testbed.fetch(9003, 3, local_port=43210)
    assert res["goodput_bps"] == pytest.approx(10 * MBIT * WIRE, rel=0.03)
    with in_netns(testbed.server_ns):
        assert b.stats()[target].bytes > res["bytes"]
        r = b.apply([Op(OpKind.REMOVE, k) for k in many + [target]])
    assert r.removed == 5001 and not r.errors
    assert n_filters(testbed) == 0 and classes(testbed) == {"f1f0:1", "f1f0:2"}


def test_spare_class_reused_for_new_flow(testbed):
    """Issue 26: a closed flow's class is kept as a spare and changed for the next new flow (no
    class made or deleted: each costs the kernel a walk of every class). The reused class shapes
    the new flow at its own rate, its counters start from zero for it, a restart adopts the
    spare, and teardown leaves nothing. A: IPv4 to a dual-stack listener (IPv4-mapped at the
    server), B: IPv6."""
    testbed.popen(testbed.server_ns, server_argv([9004], "fp-test-srv", v6=True))
    testbed.wait_listening(9004)
    b = backend(testbed, spare_max=4, spare_from=0)
    ka, kb = key(testbed, 9004, 44000), key(testbed, 9004, 44001, v6=True)
    with in_netns(testbed.server_ns):
        assert b.apply([Op(OpKind.ADD, ka, Shape("a", 10 * MBIT, 10 * MBIT))]).added == 1
        cid = b.classid_of(ka)
    res_a = testbed.fetch(9004, 2, local_port=44000)
    # the rates are 2x apart: 10 % tells them apart even on a loaded machine (4 % short at a
    # load average of 10 here)
    assert res_a["goodput_bps"] == pytest.approx(10 * MBIT * WIRE, rel=0.1)
    with in_netns(testbed.server_ns):
        # what the server had queued when the client stopped leaves the class after it (13 KiB
        # of backlog in one run): A's bytes once its class is empty
        wait_for(lambda: b.stats()[ka].backlog_bytes == 0, 5, 0.02, "A's class drained")
        a_bytes = b.stats()[ka].bytes
        r = b.apply([Op(OpKind.REMOVE, ka)])
    assert r.removed == 1 and not r.errors and a_bytes > res_a["bytes"]
    assert n_filters(testbed) == 0 and len(classes(testbed)) == 3      # the spare stays
    with in_netns(testbed.server_ns):
        r = b.apply([Op(OpKind.ADD, kb, Shape("b", 20 * MBIT, 20 * MBIT))])
        assert r.added == 1 and not r.errors and b.classid_of(kb) == cid   # reused, not made
        assert b.stats()[kb].bytes == 0 and b.stats()[kb].packets == 0
    assert len(classes(testbed)) == 3 and n_filters(testbed) == 1
    res_b = testbed.fetch(9004, 2, v6=True, local_port=44001)
    assert res_b["goodput_bps"] == pytest.approx(20 * MBIT * traffic.wire(True), rel=0.1)
    with in_netns(testbed.server_ns):
        # both read with B's class drained, as A's above: a packet dequeued between the two
        # reads counted in one and not the other (12 112 bytes of backlog in one rehearsal)
        wait_for(lambda: b.stats()[kb].backlog_bytes == 0, 5, 0.02, "B's class drained")
        st = b.stats()[kb]
        raw = b.stats_by_class()[cid]
    # the flow's own bytes (its payload plus headers), not A's; the class has both (A's closing
    # segments, e.g. a FIN or RST, may pass between its reading and its filter's delete)
    assert res_b["bytes"] < st.bytes < res_b["bytes"] * 1.1
    assert a_bytes <= raw.bytes - st.bytes <= a_bytes + 3 * 1514, (raw, st, a_bytes)
    with in_netns(testbed.server_ns):          # a restart adopts the spare and reuses it
        b.apply([Op(OpKind.REMOVE, kb)])
        b.close()
        b2 = tcb.TcBackend(HtbCodec(), testbed.server_if, LINK, spare_max=4, spare_from=0)
        b2.setup()
        assert b2.removed_stale == 0 and not b2.installed()
        assert b2.apply([Op(OpKind.ADD, ka, Shape("a", MBIT, MBIT))]).added == 1
        assert b2.classid_of(ka) == cid and b2.stats()[ka].bytes == 0
        b2.teardown()
        b2.close()
    assert tcj(testbed, "qdisc")[0]["kind"] != "htb"
    assert not [c for c in classes(testbed) if c.startswith("f1f0:")] and n_filters(testbed) == 0

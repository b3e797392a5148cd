"""Several interfaces on the real kernel (issue 29, host half of item 6; htb).

    client ns 1 ── veth 1 ──┐                 ┌── veth 2 ── client ns 2
    10.77.x.2 (v4, mapped)  server ns: nginx  fd78:x::2 (v6)
         └──────────── join veth (ns 2 forwards to ns 1) ──────────┘

One daemon with ``interfaces: [fpTAGs, {name: "fpTAGs[0-9]", link_rate: 500mbit}]`` takes veth
2 when it appears (the glob, at a reconcile pass), then shapes three nginx downloads at once,
each on the interface its route leaves by, at its rule's rate measured at the receiver: a plain IPv4 one and an IPv4-mapped one (the dual-stack listener) from client 1
over veth 1, an IPv6 one from client 2 over veth 2. Then a policy-routing rule (``ip rule ...
sport 8080``) sends the plain IPv4 download out by veth 2 (client 2 forwards it to client 1):
its class moves to veth 2 and it stays at its rate, with no class or filter of it left on veth 1.
A local download leaving by ``lo`` (not managed) is counted, not shaped. Stop leaves nothing on
either interface.
"""
import time
from textwrap import dedent

import pytest

from harness.scenarios import gap_goodput
from harness.servers import Nginx
from harness.testbed import Daemon, sh, wait_for
from harness import traffic

pytestmark = pytest.mark.kernel

C1, C2 = 8, 16          # Mbit/s: client 1's rule, client 2's rule
SECONDS = 15.0
MOVE_AT = 6.0           # seconds into the downloads


def tc(tb, dev, *what):
    return tb.run(tb.server_ns, ["tc", *what, "show", "dev", dev]).stdout


def flow_classes(tb, dev):
    """Classes under the link class other than the default (:2): one per flow."""
    return [ln for ln in tc(tb, dev, "class").splitlines()
            if ln.startswith("class htb f1f0:") and ln.split()[2] not in ("f1f0:1", "f1f0:2")]


def n_filters(tb, dev):
    return sum(1 for ln in tc(tb, dev, "filter").splitlines() if "flowid" in ln)


def ours_left(tb, dev) -> str:
    """What flowpacer could have left on ``dev`` ("" when nothing)."""
    q = tc(tb, dev, "qdisc")
    return "\n".join(x for x in (q if "f1f0:" in q or "clsact" in q else "",
                                 tc(tb, dev, "class"), tc(tb, dev, "filter")) if x.strip())


def test_flows_are_shaped_on_the_interface_they_leave_by_and_follow_a_route_change(
        testbed, tmp_path):
    tb = testbed
    n = tb._n
    s1, s2 = tb.server_if, f"fp{tb.tag}s2"
    ng = Nginx(tb, tmp_path / "nginx", files={"big": 256 << 20}).start()
    rules = f"""\
        backend: htb
        link_rate: 1gbit
        interfaces: [{s1}, {{name: "fp{tb.tag}s[0-9]", link_rate: 500mbit}}]
        rules:
          - name: c1
            match: {{remote: ["10.77.{n}.0/24"]}}
            rate: {C1}mbit
          - name: c2
            match: {{remote: ["fd78:{n:x}::/64"]}}
            rate: {C2}mbit
        """
    d = Daemon(tb, tmp_path, dedent(rules), "--no-tracer", "--no-metrics", "--rescan", "0.5")
    d.start()
    try:
        assert [i["name"] for i in d.status()["interfaces"]] == [s1]
        # the second interface appears while the daemon runs: the glob takes it at a pass
        c2 = tb.add_client(2)
        assert c2.server_if == s2
        # the join: client 2 forwards to client 1's address, which then arrives by another link
        j1, j2 = f"fp{tb.tag}j1", f"fp{tb.tag}j2"
        sh("ip", "-n", c2.ns, "link", "add", j2, "type", "veth", "peer", "name", j1,
           "netns", tb.client_ns)
        sh("ip", "-n", c2.ns, "addr", "add", f"10.79.{n}.2/24", "dev", j2)
        sh("ip", "-n", tb.client_ns, "addr", "add", f"10.79.{n}.1/24", "dev", j1)
        sh("ip", "-n", c2.ns, "link", "set", j2, "up")
        sh("ip", "-n", tb.client_ns, "link", "set", j1, "up")
        for ns in (tb.server_ns, tb.client_ns, c2.ns):      # replies by the other way round
            tb.run(ns, ["sh", "-c", "for f in /proc/sys/net/ipv4/conf/*/rp_filter; do "
                                    "echo 0 > $f; done"])
        tb.run(c2.ns, ["sysctl", "-qw", "net.ipv4.ip_forward=1"])
        sh("ip", "-n", c2.ns, "route", "add", f"{tb.client_v4}/32", "via", f"10.79.{n}.1")
        wait_for(lambda: [(i["name"], i["link_rate_bit"], i["state"])
                          for i in d.status()["interfaces"]] == [
            (s1, 10**9, "ok"), (s2, 500 * 10**6, "ok")], 5, 0.1, f"{s2} taken by the glob")
        t_fetch = time.monotonic()
        mover = traffic.fetch(tb, tb.server_v4, ng.port, SECONDS, path="/big", interval=0.1,
                              name="fp-mover")
        mapped = traffic.fetch(tb, tb.server_v4, ng.dual_port, SECONDS, path="/big",
                               interval=0.1, name="fp-mapped")
        v6 = traffic.fetch(tb, c2.server_v6, ng.dual_port, SECONDS, path="/big", interval=0.1,
                           name="fp-v6", ns=c2.ns)
        local = tb.popen(tb.server_ns, ["curl", "-s", "-o", "/dev/null", "--limit-rate", "200k",
                                        "--max-time", str(SECONDS),
                                        traffic.url(tb.server_v4, ng.port, "/big")])

        def placed():
            fl = d.flows()
            return len(fl) == 3 and {(f["family"], f["interface"], f["rule"]) for f in fl}
        got = wait_for(placed, 10, 0.1, "three flows shaped")
        assert got == {(4, s1, "c1"), (6, s2, "c2")}
        assert len(flow_classes(tb, s1)) == 2 and len(flow_classes(tb, s2)) == 1
        # the local download leaves by lo: counted (both of its ends match c1), not shaped
        um = wait_for(lambda: d.status()["unmanaged_interface"], 5, 0.1, "unmanaged counted")
        assert um["count"] == 2 and {f["interface"] for f in um["flows"]} == {"lo"}
        wait_for(lambda: time.monotonic() - t_fetch > MOVE_AT, 10, 0.05, "the first window")
        # policy routing: the server's port-8080 replies to client 1 leave by veth 2
        tb.s("ip", "route", "add", f"{tb.client_v4}/32", "via", str(c2.client_v4), "dev", s2,
             "table", "2977")
        tb.s("ip", "rule", "add", "to", f"{tb.client_v4}/32", "ipproto", "tcp", "sport",
             str(ng.port), "lookup", "2977", "pref", "1000")
        t_move = time.monotonic()

        def moved():
            fl = d.flows()
            on2 = [f for f in fl if f["interface"] == s2 and f["family"] == 4]
            return (len(fl) == 3 and len(on2) == 1 and len(flow_classes(tb, s1)) == 1
                    and len(flow_classes(tb, s2)) == 2 and on2[0])
        f = wait_for(moved, 5, 0.05, "the plain IPv4 download moved to veth 2")
        assert f["rule"] == "c1" and f["local"] == f"{tb.server_v4}:{ng.port}"
        assert n_filters(tb, s1) == 1 and n_filters(tb, s2) == 2     # nothing stale on veth 1
        wait_for(lambda: [x for x in d.flows() if x["interface"] == s2 and x["family"] == 4
                          and x["bytes"] > 0], 5, 0.1, "its new class counting bytes")
        results = {name: traffic.fetch_result(p, timeout=SECONDS + 30)
                   for name, p in (("mover", mover), ("mapped", mapped), ("v6", v6))}
        local.wait(timeout=30)
    finally:
        d.stop()
    wire4, wire6 = traffic.wire(False), traffic.wire(True)
    t0 = results["mover"]["t0_monotonic"]
    before, _ = gap_goodput(results["mover"], t0 + 1.5, t_move - 0.3)
    after, _ = gap_goodput(results["mover"], t_move + 2.0, t0 + SECONDS - 0.5)
    whole_mapped, _ = gap_goodput(results["mapped"], t0 + 1.5, t0 + SECONDS - 0.5)
    whole_v6, _ = gap_goodput(results["v6"], t0 + 1.5, t0 + SECONDS - 0.5)
    print(f"\nmover {before * 8e-6:.2f} -> {after * 8e-6:.2f} Mbit/s, mapped "
          f"{whole_mapped * 8e-6:.2f}, v6 {whole_v6 * 8e-6:.2f} (goodput)")
    assert before == pytest.approx(C1 * 1e6 / 8 * wire4, rel=0.07)
    assert after == pytest.approx(C1 * 1e6 / 8 * wire4, rel=0.07)
    assert whole_mapped == pytest.approx(C1 * 1e6 / 8 * wire4, rel=0.07)
    assert whole_v6 == pytest.approx(C2 * 1e6 / 8 * wire6, rel=0.07)
    for dev in (s1, s2):
        assert ours_left(tb, dev) == "", f"{dev} after stop:\n{ours_left(tb, dev)}"

"""Bonds and VLANs (issue 29 items 3-4) with the real daemon, psp and htb, inside the VM (the
host kernel has no bonding, 8021q or bridge modules).

The server namespace has ``bond0`` over two veth members ``m0``/``m1`` (balance-xor with the
layer3+4 hash, or active-backup; miimon 50 ms) and ``bond0.7``, a VLAN on it; the client
namespace has the members' peers in a bridge ``br0`` and ``br0.7`` on it. nginx serves one
dual-stack listener; four measuring clients download at once (IPv4 and IPv6 over the bond, IPv4
and IPv6 over the VLAN), and beside them two iperf3 ``-R`` clients (IPv4 over the bond, IPv6
over the VLAN; two dual-stack ``iperf3 -s``; measured at the receiver by their 0.25 s
intervals, which count from when the client's data connection is in). The daemon shapes
``interfaces: [bond0, bond0.7]`` (each flow on the
interface its route leaves by) without a link_rate, so each interface's link rate is the bond's
figure from its members (kernel/bond.py). While the flows run a member goes down (balance-xor:
m1; active-backup: the active m0, a failover): every flow stays within 15 % of its rule's rate at
the receiver before and after (the same TCP connections), the link rate in status follows
(balance-xor 20 -> 10 Gbit/s; active-backup stays 10 Gbit/s and names the new active member),
the kernel's own figure for the bond (``/sys/class/net/bond0/speed``) agrees, and nothing is ever
put on the members. The member comes back up (the figure follows again); after SIGTERM nothing
of flowpacer's is left anywhere. Each bond mode with psp and with htb, each on a fresh bed;
802.3ad against an LACP partner (``test_802_3ad_with_a_lacp_partner``).

``test_vlan_and_bond_deleted_and_made_again``: bond0.7, then bond0 (which takes bond0.7 with it),
deleted under the daemon and made again (issue 29 item 4): gone in status and metrics, rebuilt,
new downloads shaped there at rate, the bond's own download held through its VLAN's loss.

``test_vlan_egress_qos_map_and_socket_priorities``: what 802.1p PCP a VLAN's egress-qos-map
gives flows flowpacer shapes, and a socket carrying a first-byte class id (issue 29 item 4).
"""
from __future__ import annotations

import json
import re
import subprocess
import time

import pytest

from harness import psplib
from harness.pacing import guest_timeout as gt
from harness.servers import Nginx
from harness.bondbed import BondBed
from harness.testbed import Daemon, client_argv, server_argv, wait_for
from harness.servers import iperf3_server
from harness.traffic import (WIRE, WIRE6, iperf3, iperf3_rate_between, stop_clients,
                             iperf3_started)

RATE = 8_000_000                       # bit/s of the rule, each flow
G10 = 10_000_000_000
BEFORE_S = 3.0                         # measured this long once every flow has its class,
SETTLE_S = 1.2                         # then a member goes down, and after this long
AFTER_S = 3.5                          # measured again this long (then the clients stop)
TOLERANCE = 0.15

RULES = """
    interfaces: [bond0, bond0.7]
    backend: BACKEND
    rules:
      - name: web
        match: {process: nginx, direction: inbound}
        rate: 8mbit
      - name: iperf
        match: {process: iperf3, direction: inbound}
        rate: 8mbit
"""
SUMMED = ("balance-xor", "802.3ad")     # modes whose link rate is the sum of their members'
IPERF = (("iperf v4 bond", 5201, "server_v4"), ("iperf v6 vlan", 5202, "vlan_v6"))


def _rate(samples, a: float, b: float) -> float:
    """Bytes/s received between the samples nearest ``a`` and ``b`` (s after the client's
    start)."""
    s0 = min(samples, key=lambda s: abs(s[0] - a))
    s1 = min(samples, key=lambda s: abs(s[0] - b))
    return (s1[1] - s0[1]) / (s1[0] - s0[0]) if s1[0] > s0[0] else 0.0


def _wait_flows(d: Daemon, n: int, timeout: float = 45) -> list:
    """The daemon's ``n`` shaped flows, or a failure that says what it had instead (Pythons
    starting under TCG on a busy host take seconds each)."""
    try:
        return wait_for(lambda: (lambda f: f if len(f) == n else None)(d.flows()), gt(timeout),
                        0.2, f"{n} shaped flows")
    except TimeoutError:
        st = d.status()
        raise AssertionError(
            f"{len(st['flows'])} shaped flows of {n} after {timeout} s: live {st['live_flows']}, "
            f"unmanaged {st.get('unmanaged_interface')}, flows {st['flows']}, interfaces "
            f"{st['interfaces']}\n{d.log_text()[-3000:]}") from None


def _status_if(d: Daemon, name: str) -> dict:
    return next(i for i in d.status()["interfaces"] if i["name"] == name)


def _one_backend(bed: BondBed, tmp_path, backend: str):
    """The daemon with ``backend`` on the bed: flows before and after a member goes down, the
    link rate followed, the member back up, nothing left. Returns the figures recorded."""
    mode = bed.mode
    summed = mode in SUMMED
    down = "m1" if summed else "m0"
    (tmp_path / f"d-{backend}").mkdir()
    d = Daemon(bed, tmp_path / f"d-{backend}", RULES, "--no-tracer", "--no-metrics",
               "--rescan", "0.5", backend=backend).start(timeout=gt(90))
    try:
        st = d.status()
        assert st["backend"] == backend, st["backend_reason"]
        want_link = 2 * G10 if summed else G10
        for name in ("bond0", "bond0.7"):
            i = _status_if(d, name)
            assert i["link_rate_bit"] == want_link, i
            assert i["link_rate_source"].endswith(f"bond0 {mode}: " + (
                "m0+m1" if summed else "m0")), i
        assert bed.kernel_speed_bit() == want_link
        # the iperf3 clients first: each one's test starts when its data connection is in
        # (iperf3's intervals count from there)
        iperfs, t_iperf = {}, {}
        for label, port, attr in IPERF:
            iperfs[label] = iperf3(bed, getattr(bed, attr), port, seconds=120,
                                   extra=["-i", "0.25"])
        for label, port, _attr in IPERF:
            t_iperf[label] = iperf3_started(bed, port, gt(30))
        clients = {}
        for label, host in (("bond v4", bed.server_v4), ("bond v6", bed.server_v6),
                            ("vlan v4", bed.vlan_v4), ("vlan v6", bed.vlan_v6)):
            argv = client_argv(str(host), 8081, 120, warmup=0.5) + [
                "--path", "/big", "--interval", "0.1"]
            clients[label] = bed.popen(bed.client_ns, argv, stdout=subprocess.PIPE, text=True)
        flows = _wait_flows(d, 8)       # 4 nginx, 2 x iperf3's control and data connections
        t_shaped = time.monotonic()
        by_if = sorted((f["rule"], f["interface"]) for f in flows)
        assert by_if == [("iperf", "bond0")] * 2 + [("iperf", "bond0.7")] * 2 + [
            ("web", "bond0")] * 2 + [("web", "bond0.7")] * 2, flows
        assert not bed.on_members()
        time.sleep(max(0.0, t_shaped + 0.3 + BEFORE_S - time.monotonic()))
        t_down = time.monotonic()
        bed.run(bed.server_ns, ["ip", "link", "set", down, "down"])
        want_after = G10
        wait_for(lambda: _status_if(d, "bond0")["link_rate_bit"] == want_after
                 and _status_if(d, "bond0")["link_rate_source"].endswith(
                     f"bond0 {mode}: " + ("m0" if down == "m1" else "m1")), gt(15), 0.05,
                 f"the link rate after {down} went down")
        followed_s = time.monotonic() - t_down
        assert bed.kernel_speed_bit() == want_after
        assert _status_if(d, "bond0.7")["link_rate_bit"] == want_after
        assert not bed.on_members()
        time.sleep(max(0.0, t_down + SETTLE_S + AFTER_S - time.monotonic()))
        res, reports = stop_clients(clients, iperfs, timeout=gt(30))
        figures = []
        for label, rep in reports.items():
            want = RATE / 8 * (WIRE6 if " v6 " in label else WIRE)
            t0 = t_iperf[label]
            before = iperf3_rate_between(rep, t0, t_shaped + 0.3, t_down)
            after = iperf3_rate_between(rep, t0, t_down + SETTLE_S, time.monotonic())
            figures.append((label, before, after, want))
            psplib.record(f"bond {mode} {backend} {label}: {before * 8 / 1e6:.3f} Mbit/s before, "
                          f"{after * 8 / 1e6:.3f} after {down} down ({100 * before / want:.1f} % "
                          f"/ {100 * after / want:.1f} % of rate x payload/frame)")
        for label, r in res.items():
            want = RATE / 8 * (WIRE6 if label.endswith("v6") else WIRE)
            t0 = r["t0_monotonic"]           # the client's start (CLOCK_MONOTONIC, as ours)
            before = _rate(r["samples"], t_shaped + 0.3 - t0, t_down - t0)
            after = _rate(r["samples"], t_down + SETTLE_S - t0, r["samples"][-1][0])
            figures.append((label, before, after, want))
            psplib.record(f"bond {mode} {backend} {label}: {before * 8 / 1e6:.3f} Mbit/s before, "
                          f"{after * 8 / 1e6:.3f} after {down} down ({100 * before / want:.1f} % "
                          f"/ {100 * after / want:.1f} % of rate x payload/frame)")
        psplib.record(f"bond {mode} {backend}: link rate {want_link / 1e9:g} -> "
                      f"{want_after / 1e9:g} Gbit/s in status {followed_s:.2f} s after "
                      f"{down} went down")
        for label, before, after, want in figures:
            for when, got in (("before", before), ("after", after)):
                assert abs(got / want - 1) <= TOLERANCE, \
                    f"{label} {when} {down} down: {got * 8 / 1e6:.3f} Mbit/s, want " \
                    f"{want * 8 / 1e6:.3f} +-{TOLERANCE:.0%}"
        # the member comes back: the figure follows again
        bed.run(bed.server_ns, ["ip", "link", "set", down, "up"])
        wait_for(lambda: _status_if(d, "bond0")["link_rate_bit"] == want_link
                 and len(_status_if(d, "bond0")["link_rate_source"].split(": ")[1].split("+"))
                 == (2 if summed else 1), gt(10), 0.05,
                 f"the link rate after {down} came back")
        wait_for(lambda: bed.members_up() == ("m0", "m1"), gt(10), 0.05, "members up")
        assert not bed.on_members()
    finally:
        rc = d.stop()
    assert rc == 0, d.log_text()[-3000:]
    assert "Traceback" not in d.log_text(), d.log_text()[-3000:]
    assert not bed.flowpacer_left()
    return figures


@pytest.mark.parametrize("backend", ["psp", "htb"])
@pytest.mark.parametrize("mode", ["balance-xor", "active-backup"])
def test_bond_and_vlan_at_rate_through_a_member_going_down(mode, backend, psp_module, tmp_path):
    with BondBed(mode) as bed:           # a fresh bond for each backend
        Nginx(bed, tmp_path / "nginx", files={"big": 8 << 30}).start()   # sparse
        for _label, port, _attr in IPERF:
            iperf3_server(bed, port)
        _one_backend(bed, tmp_path, backend)
        assert not bed.on_members()


@pytest.mark.parametrize("backend", ["psp", "htb"])
def test_802_3ad_with_a_lacp_partner(backend, psp_module, tmp_path):
    """802.3ad (issue 29 item 3) against an LACP partner: the client side is a second 802.3ad
    bond over the members' peers (BondBed). Both members end up in one aggregator
    (/proc/net/bonding/bond0), so the link rate is their sum, 20 Gbit/s; m1 going down leaves
    10 Gbit/s and it coming back (LACP agreeing again) 20; the flows (nginx and iperf3 over
    the bond and its VLAN, both families) hold their rate before and after, as with
    balance-xor. psp and htb, each on a fresh bed."""
    with BondBed("802.3ad") as bed:
        agg, ports = bed.aggregator()
        assert agg and ports == ("m0", "m1"), (agg, ports)
        assert len(bed.aggregator(bed.client_ns, bed.client_if)[1]) == 2
        Nginx(bed, tmp_path / "nginx", files={"big": 8 << 30}).start()   # sparse
        for _label, port, _attr in IPERF:
            iperf3_server(bed, port)
        _one_backend(bed, tmp_path, backend)
        wait_for(lambda: bed.aggregator()[1] == ("m0", "m1"), gt(30), 0.2,
                 "m0 and m1 in one aggregator again")
        psplib.record(f"bond 802.3ad {backend}: aggregator {agg} with {'+'.join(ports)} before, "
                      f"{bed.aggregator()} after m1 went down and came back")
        assert not bed.on_members()


def test_802_3ad_members_in_two_aggregators_count_the_active_one_only(tmp_path):
    """802.3ad with each member's peer a partner of its own (``BondBed(split=True)``): bond0's
    members are in two aggregators and only the active one's may send (sysfs calls the other
    member ``backup``), so the link rate is one member's, named, as the bonding driver's own
    figure says. The active aggregator's member going down makes the other aggregator active:
    the link rate names that member, and again when the first comes back (which aggregator is
    active then is the driver's choice: the figure follows it). No traffic: the figure only."""
    with BondBed("802.3ad", split=True) as bed:
        agg, ports = bed.aggregator()
        assert bed.aggregators() == 2 and len(ports) == 1, (agg, ports)
        d = Daemon(bed, tmp_path, RULES.replace("[bond0, bond0.7]", "[bond0]"), "--no-tracer",
                   "--no-metrics", "--rescan", "0.5", backend="htb").start(timeout=gt(90))
        try:
            def says(member):
                i = _status_if(d, "bond0")
                return i["link_rate_bit"] == G10 and \
                    i["link_rate_source"].endswith(f"bond0 802.3ad: {member}")

            first = ports[0]
            wait_for(lambda: says(first), gt(10), 0.05, f"the link rate of {first}'s aggregator")
            assert bed.kernel_speed_bit() == G10
            other = "m1" if first == "m0" else "m0"
            bed.run(bed.server_ns, ["ip", "link", "set", first, "down"])
            wait_for(lambda: bed.aggregator()[1] == (other,), gt(30), 0.2,
                     f"{other}'s aggregator active")
            wait_for(lambda: says(other), gt(10), 0.05, f"the link rate of {other}'s aggregator")
            assert bed.kernel_speed_bit() == G10
            bed.run(bed.server_ns, ["ip", "link", "set", first, "up"])
            wait_for(lambda: bed.members_up() == ("m0", "m1") and bed.aggregators() == 2,
                     gt(30), 0.2, f"{first} back in an aggregator of its own")
            now = wait_for(lambda: (lambda p: p if len(p) == 1 else None)(bed.aggregator()[1]),
                           gt(30), 0.2, "one active aggregator")[0]
            wait_for(lambda: says(now), gt(10), 0.05, f"the link rate of {now}'s aggregator")
            assert bed.kernel_speed_bit() == G10
            assert not bed.on_members()
            psplib.record(f"bond 802.3ad, two aggregators: link rate 10 Gbit/s from {first}, "
                          f"then {other} when {first} went down, then {now} with both up")
        finally:
            rc = d.stop()
        assert rc == 0, d.log_text()[-3000:]
        assert not bed.flowpacer_left()


# ------------------------------------------------- SO_PRIORITY and a VLAN's egress-qos-map
CLASS_PRIO = 0xF1F0C010      # a pool class id: what the first-byte program writes into a
#                              claimed socket's SO_PRIORITY (bpf/firstbyte.c)
QOS_MAP = ("0:1", "5:5")     # priority 0 -> PCP 1, 5 -> 5 (anything else: 0)
PRIO_RULES = """
    interfaces: [bond0.7]
    backend: BACKEND
    rules:
      - name: app-prio
        match: {process: fp-prio-srv, direction: inbound, local_port: 9301}
        rate: 4mbit
      - name: no-prio
        match: {process: fp-prio-srv, direction: inbound, local_port: 9302}
        rate: 4mbit
      - name: class-prio
        match: {process: fp-prio-srv, direction: inbound, local_port: 9303}
        rate: 4mbit
"""


def _pcp_by_port(capture: str) -> dict:
    """{server port: {PCP: frames}} of the tagged frames in ``tcpdump -e -nn`` output."""
    out: dict = {}
    for ln in capture.splitlines():
        m = re.search(r"vlan 7, p (\d+),.* (\S+)\.(930\d) > ", ln)
        if m:
            port = int(m.group(3))
            out.setdefault(port, {}).setdefault(int(m.group(1)), 0)
            out[port][int(m.group(1))] += 1
    return out


@pytest.mark.parametrize("backend", ["psp", "htb"])
def test_vlan_egress_qos_map_and_socket_priorities(backend, psp_module, tmp_path):
    """What 802.1p PCP a mapped VLAN on the bond gives each kind of socket while flowpacer
    shapes it (captured on the bond, below the VLAN): a flow flowpacer shapes by its u32 filter
    keeps its application's priority (set after accept(): 5 -> PCP 5) or the default (0 -> PCP
    1): classification does not touch skb->priority. A socket whose priority is a flowpacer
    class id, as the first-byte program leaves a socket it gave a ready class when the
    application sets none (written here with setsockopt: the same sk_priority), matches no map
    entry: PCP 0 where the map says 1 for priority 0 (its class id is not one of this qdisc's:
    htb and psp pass it to their filters, and its u32 filter shapes it)."""
    with BondBed("active-backup") as bed:
        bed.run(bed.server_ns, ["ip", "link", "set", "bond0.7", "type", "vlan",
                                "egress-qos-map", *QOS_MAP])
        for port, prio in ((9301, 5), (9302, 0), (9303, CLASS_PRIO)):
            bed.popen(bed.server_ns, server_argv([port], "fp-prio-srv", v6=True, priority=prio),
                      stderr=open(tmp_path / f"srv-{port}.log", "w"))
        for port in (9301, 9302, 9303):      # three Pythons starting at once under TCG
            try:
                bed.wait_listening(port, timeout=60)
            except TimeoutError:
                raise AssertionError((tmp_path / f"srv-{port}.log").read_text()) from None
        d = Daemon(bed, tmp_path, PRIO_RULES, "--no-tracer", "--no-metrics",
                   "--rescan", "0.5", backend=backend).start(timeout=gt(90))
        try:
            clients = {p: bed.popen(bed.client_ns, client_argv(bed.vlan_v4, p, 120, warmup=2.0),
                                    stdout=subprocess.PIPE, text=True)
                       for p in (9301, 9302, 9303)}
            _wait_flows(d, 3)
            time.sleep(1.0)
            cap = bed.run(bed.server_ns, ["timeout", str(gt(20)), "tcpdump", "-e", "-nn", "-l",
                                          "-Q", "out", "-i", "bond0", "-c", "900",
                                          "vlan 7 and tcp"], timeout=60, check=False).stdout
            time.sleep(1.0)
            for c in clients.values():
                c.terminate()                    # blaster ends its download and reports
            res = {}
            for p, c in clients.items():
                out, _ = c.communicate(timeout=gt(30))
                res[p] = json.loads(out.strip().splitlines()[-1])
        finally:
            rc = d.stop()
        assert rc == 0, d.log_text()[-3000:]
        pcp = _pcp_by_port(cap)
        goodput = ", ".join(f"{p}: {r['goodput_bps'] * 8 / 1e6:.2f}" for p, r in sorted(res.items()))
        psplib.record(f"vlan egress-qos-map {' '.join(QOS_MAP)} on bond0.7, {backend}: PCP by "
                      f"socket priority: 5 (u32-shaped) {pcp.get(9301)}, 0 (u32-shaped) "
                      f"{pcp.get(9302)}, {CLASS_PRIO:#x} (a first-byte class id) {pcp.get(9303)}"
                      f"; goodput {goodput} Mbit/s")
        assert set(pcp.get(9301, {})) == {5}, pcp
        assert set(pcp.get(9302, {})) == {1}, pcp
        assert set(pcp.get(9303, {})) == {0}, pcp
        for p in (9301, 9302, 9303):
            want = 4_000_000 / 8 * WIRE
            assert abs(res[p]["goodput_bps"] / want - 1) <= TOLERANCE, (p, res[p])
        assert not bed.flowpacer_left()


# ------------------------------------- a VLAN and a bond deleted and made again (issue 29 item 4)
REMADE_S = 2.5          # each download measured this long once shaped (+0.3 s)


def _states(d: Daemon) -> list:
    return [(i["name"], i["state"]) for i in d.status()["interfaces"]]


def _metric_states(bed: BondBed) -> set:
    """(interface, state) of every ``flowpacer_backend_state`` at 1, scraped in the server
    namespace."""
    import urllib.request
    from prometheus_client.parser import text_string_to_metric_families
    from harness.testbed import in_netns
    with in_netns(bed.server_ns):
        text = urllib.request.urlopen("http://127.0.0.1:9717/metrics",
                                      timeout=gt(10)).read().decode()
    return {(s.labels["interface"], s.labels["state"])
            for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "flowpacer_backend_state" and s.value == 1}


def _member_qdiscs(bed: BondBed) -> dict:
    """{member: its root qdisc line(s)}: the kernel's default for the device, never ours."""
    return {m: " | ".join(ln.split(" refcnt")[0] for ln in bed.run(
        bed.server_ns, ["tc", "qdisc", "show", "dev", m]).stdout.splitlines() if ln.strip())
        for m in ("m0", "m1")}


def _by_port(flows: list) -> dict:
    """{client port: (rule, interface)} of the shaped flows."""
    return {int(f["remote"].rsplit(":", 1)[1]): (f["rule"], f["interface"]) for f in flows}


def _classid(d: Daemon, port: int) -> str:
    return next(f["classid"] for f in d.flows() if f["remote"].endswith(f":{port}"))


def _ours_on(bed: BondBed, dev: str) -> bool:
    """flowpacer's root qdisc is on ``dev``."""
    return "f1f0:" in bed.run(bed.server_ns, ["tc", "qdisc", "show", "dev", dev]).stdout


@pytest.mark.parametrize("backend", ["psp", "htb"])
def test_vlan_and_bond_deleted_and_made_again(backend, psp_module, tmp_path):
    """Issue 29 item 4, a device that disappears and comes back is rebuilt per interface, on a
    bond and its VLAN (balance-xor) under ``interfaces: [bond0, bond0.7]``:

    1. with a download at rate over each, ``bond0.7`` is deleted: status and metrics say it is
       gone and bond0 ok, and bond0's download stays at its rule's rate (the same connection,
       measured at the receiver before and after); ``bond0.7`` is made again (VLAN id,
       addresses and link address as before): status and metrics ok, the daemon's qdisc on it
       again, new downloads over it (IPv4 and IPv6) shaped there at rate;
    2. ``bond0`` is deleted (``bond0.7`` goes with it, the members are released): both gone;
       both made again, the members enslaved again: both ok, the link rate the two members'
       sum again, new downloads over each (IPv6 over the bond, IPv4 over the VLAN) at rate.

    The members only ever have their default qdisc (nothing of flowpacer's, before, during and
    after); after SIGTERM nothing is left on any device."""
    t_test = time.monotonic()
    with BondBed("balance-xor") as bed:
        Nginx(bed, tmp_path / "nginx", files={"big": 8 << 30}).start()   # sparse
        members_default = _member_qdiscs(bed)
        assert all(members_default.values()), members_default
        d = Daemon(bed, tmp_path, RULES, "--no-tracer", "--rescan", "0.5",
                   backend=backend).start(timeout=gt(90))
        clients, res, marks = {}, {}, {}

        def download(label: str, host, port: int):
            argv = client_argv(str(host), 8081, 120, warmup=0.5, local_port=port) + [
                "--path", "/big", "--interval", "0.1"]
            clients[label] = (port, bed.popen(bed.client_ns, argv, stdout=subprocess.PIPE,
                                              text=True))

        def shaped(want: dict, what: str) -> float:
            """Wait until the clients' flows on ``want`` ({label: interface}) are shaped there
            by the web rule; the instant they were."""
            ports = {clients[label][0]: ("web", dev) for label, dev in want.items()}
            try:
                wait_for(lambda: (lambda b: all(b.get(p) == w for p, w in ports.items()))(
                    _by_port(d.flows())), gt(45), 0.1, what)
            except TimeoutError:
                st = d.status()
                raise AssertionError(f"{what}: flows {st['flows']}, interfaces "
                                     f"{st['interfaces']}\n{d.log_text()[-3000:]}") from None
            return time.monotonic()

        def stop(*labels):
            procs = {label: clients.pop(label)[1] for label in labels}
            res.update(stop_clients(procs, {}, timeout=gt(30))[0])

        def gone_and_ok(want: list, what: str) -> float:
            """Wait until status says ``want``; the instant it did. Metrics say the same, and
            the members have nothing of ours."""
            wait_for(lambda: _states(d) == want, gt(15), 0.05, what)
            t = time.monotonic()
            assert _metric_states(bed) == set(want)
            assert _member_qdiscs(bed) == members_default and not bed.on_members()
            return t

        try:
            assert _states(d) == [("bond0", "ok"), ("bond0.7", "ok")]
            bond_mac, vlan_mac = bed.mac("bond0"), bed.mac("bond0.7")
            # -- 1. the VLAN deleted under load and made again --------------------------
            download("bond v4", bed.server_v4, 40101)
            download("vlan v4", bed.vlan_v4, 40102)
            marks["shaped"] = shaped({"bond v4": "bond0", "vlan v4": "bond0.7"},
                                     "the two downloads shaped") + 0.3
            time.sleep(max(0.0, marks["shaped"] + REMADE_S - time.monotonic()))
            bond_class = _classid(d, 40101)
            marks["vlan del"] = time.monotonic()
            bed.run(bed.server_ns, ["ip", "link", "del", "bond0.7"])
            marks["vlan gone"] = gone_and_ok([("bond0", "ok"), ("bond0.7", "gone")],
                                             "bond0.7 gone, bond0 ok")
            stop("vlan v4")                     # its server side waits for a route
            assert _by_port(d.flows()).get(40101) == ("web", "bond0")
            marks["vlan made"] = time.monotonic()
            bed.make_vlan(vlan_mac)
            marks["vlan back"] = gone_and_ok([("bond0", "ok"), ("bond0.7", "ok")],
                                             "bond0.7 rebuilt")
            assert _ours_on(bed, "bond0.7")
            download("vlan again v4", bed.vlan_v4, 40103)
            download("vlan again v6", bed.vlan_v6, 40104)
            marks["vlan shaped"] = shaped({"vlan again v4": "bond0.7",
                                           "vlan again v6": "bond0.7", "bond v4": "bond0"},
                                          "new downloads shaped on the rebuilt bond0.7") + 0.3
            time.sleep(max(0.0, marks["vlan shaped"] + REMADE_S - time.monotonic()))
            marks["end 1"] = time.monotonic()
            assert _classid(d, 40101) == bond_class      # bond0's flow kept its class
            stop("bond v4", "vlan again v4", "vlan again v6")
            # -- 2. the bond deleted (its VLAN with it) and made again --------------------
            marks["bond del"] = time.monotonic()
            bed.run(bed.server_ns, ["ip", "link", "del", "bond0"])
            marks["bond gone"] = gone_and_ok([("bond0", "gone"), ("bond0.7", "gone")],
                                             "bond0 and bond0.7 gone")
            marks["bond made"] = time.monotonic()
            bed.make_bond(bond_mac, vlan_mac)
            marks["bond back"] = gone_and_ok([("bond0", "ok"), ("bond0.7", "ok")],
                                             "bond0 and bond0.7 rebuilt")
            assert _ours_on(bed, "bond0") and _ours_on(bed, "bond0.7")
            wait_for(lambda: _status_if(d, "bond0")["link_rate_bit"] == 2 * G10, gt(10), 0.05,
                     "the rebuilt bond's link rate, both members")
            assert _status_if(d, "bond0")["link_rate_source"].endswith(
                "bond0 balance-xor: m0+m1"), _status_if(d, "bond0")
            download("bond again v6", bed.server_v6, 40105)
            download("vlan again2 v4", bed.vlan_v4, 40106)
            marks["bond shaped"] = shaped({"bond again v6": "bond0",
                                           "vlan again2 v4": "bond0.7"},
                                          "new downloads shaped on the rebuilt bond and VLAN") + 0.3
            time.sleep(max(0.0, marks["bond shaped"] + REMADE_S - time.monotonic()))
            marks["end 2"] = time.monotonic()
            stop("bond again v6", "vlan again2 v4")
            assert _member_qdiscs(bed) == members_default and not bed.on_members()
        finally:
            if clients:
                stop(*list(clients))
            rc = d.stop()
        assert rc == 0, d.log_text()[-3000:]
        log = d.log_text()
        assert "Traceback" not in log, log[-3000:]
        assert not bed.flowpacer_left()
        assert _member_qdiscs(bed) == members_default
    # what the daemon said of the devices going and coming back
    said = [ln.split(": ", 1)[-1] for ln in log.splitlines()
            if re.search(r"gone|rebuilt|cannot rebuild|rebuild failed", ln)]
    psplib.record(f"bond/vlan deleted and made again, {backend}: the daemon's log: "
                  + " / ".join(said[:12]))
    # what was measured, each at the receiver, against the rule x payload/frame
    windows = {"bond v4": [("before bond0.7 went", marks["shaped"], marks["vlan del"]),
                           ("bond0.7 gone and made again", marks["vlan del"], marks["end 1"])],
               "vlan v4": [("before it went", marks["shaped"], marks["vlan del"])],
               "vlan again v4": [("on the rebuilt bond0.7", marks["vlan shaped"], marks["end 1"])],
               "vlan again v6": [("on the rebuilt bond0.7", marks["vlan shaped"], marks["end 1"])],
               "bond again v6": [("on the rebuilt bond0", marks["bond shaped"], marks["end 2"])],
               "vlan again2 v4": [("on bond0.7 rebuilt with it", marks["bond shaped"],
                                   marks["end 2"])]}
    figures = []
    for label, spans in windows.items():
        r = res[label]
        want = RATE / 8 * (WIRE6 if label.endswith("v6") else WIRE)
        for what, a, b in spans:
            got = _rate(r["samples"], a - r["t0_monotonic"], b - r["t0_monotonic"])
            figures.append((label, what, got, want))
            psplib.record(f"bond/vlan deleted and made again, {backend}: {label} {what}: "
                          f"{got * 8 / 1e6:.3f} Mbit/s ({100 * got / want:.1f} % of rate x "
                          f"payload/frame, {b - a:.1f} s)")
    psplib.record(f"bond/vlan deleted and made again, {backend}: bond0.7 gone in status "
                  f"{marks['vlan gone'] - marks['vlan del']:.2f} s after its deletion, ok "
                  f"{marks['vlan back'] - marks['vlan made']:.2f} s after the start of its "
                  f"making (ip commands included); both gone "
                  f"{marks['bond gone'] - marks['bond del']:.2f} s after bond0's deletion, ok "
                  f"{marks['bond back'] - marks['bond made']:.2f} s after the start of its "
                  f"making; whole test {time.monotonic() - t_test:.1f} s (guest)")
    for label, what, got, want in figures:
        assert abs(got / want - 1) <= TOLERANCE, \
            f"{label} {what}: {got * 8 / 1e6:.3f} Mbit/s, want {want * 8 / 1e6:.3f} " \
            f"+-{TOLERANCE:.0%}"

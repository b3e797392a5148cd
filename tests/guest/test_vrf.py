"""A VRF with the real daemon, psp and htb, inside the VM (issue 29 item 1: the route lookup
follows VRFs; the host kernel has no vrf module). In virtual time.

The server namespace (harness.vrfbed) has two interfaces: ``fpTAGs`` in the main table and
``fpTAGv`` enslaved to ``vrf-fp`` (table 77). Both tables route the client prefix, each by its
own interface, so a reply looked up without the VRF would leave by the wrong one. nginx listens
as a VRF deployment without ``ip vrf exec`` does: on ``[::]:8081`` (IPv4 clients IPv4-mapped)
bound to no device, with ``net.ipv4.tcp_l3mdev_accept=1``; a connection arriving in the VRF is
accepted there and its socket is bound to ``vrf-fp`` (sock_diag's ``idiag_if``, ``ss``'s
``%vrf-fp``; nginx's own listeners stay unbound). Beside it, the other way a server serves a
VRF: two ``iperf3 -s --bind-dev vrf-fp`` (a listener bound to the VRF with SO_BINDTODEVICE, as
``ip vrf exec`` also leaves one), their accepted sockets bound to it as well. Six downloads run
at once from the same client address: nginx IPv4 and IPv6 into the VRF (port 8081), iperf3
``-R`` IPv4 and IPv6 into the VRF (5201, 5202; measured by their 0.25 s intervals), and nginx
IPv4 and IPv6 over the main interface (port 8080, nginx's address-bound listeners). The daemon
shapes ``interfaces: [fpTAGs, fpTAGv]``: each VRF flow must be on ``fpTAGv`` at the VRF rule's
rate measured at the receiver (a lookup that missed the VRF would put its class on ``fpTAGs``
and leave it unshaped), each main flow on ``fpTAGs`` at its own rule's rate; nothing is counted
unmanaged; after SIGTERM nothing of flowpacer's is left on either interface or the VRF device.
"""
from __future__ import annotations

import subprocess
import time

import pytest

from harness import pacing, psplib
from harness.pacing import guest_timeout as gt
from harness.scenarios import gap_goodput
from harness.servers import Nginx, iperf3_server
from harness.testbed import Daemon, client_argv, wait_for
from harness.traffic import (WIRE, WIRE6, iperf3, iperf3_rate_between, stop_clients,
                             iperf3_started)
from harness.vrfbed import VRF, VrfBed

VRF_RATE, MAIN_RATE = 6_000_000, 10_000_000      # bit/s of each rule, each flow
VRF_PORT, MAIN_PORT = 8081, 8080
MEASURE_S = 3.0                # measured this long, from 0.5 s after every flow has its class
TOLERANCE = 0.10

RULES = f"""
    interfaces: [MAIN_IF, VRF_IF]
    link_rate: 1gbit
    backend: BACKEND
    rules:
      - name: in-vrf
        match: {{process: nginx, direction: inbound, local_port: {VRF_PORT}}}
        rate: 6mbit
      - name: iperf-vrf
        match: {{process: iperf3, direction: inbound}}
        rate: 6mbit
      - name: main
        match: {{process: nginx, direction: inbound, local_port: {MAIN_PORT}}}
        rate: 10mbit
"""
IPERF = (("iperf vrf v4", 5201, "vrf_v4"), ("iperf vrf v6", 5202, "vrf_v6"))


@pytest.fixture(autouse=True, scope="module")
def _virtual_time():
    pacing.require_virtual_time()


@pytest.fixture(scope="module")
def vrfbed(tmp_path_factory):
    """One bed and one nginx for both backends (each test runs its own daemon and clients)."""
    with VrfBed() as bed:
        Nginx(bed, tmp_path_factory.mktemp("nginx"), files={"big": 8 << 30}).start()  # sparse
        for _label, port, _attr in IPERF:
            iperf3_server(bed, port, bind_dev=VRF)
        yield bed


def test_the_bed_routes_the_client_prefix_differently_in_the_vrf(vrfbed):
    """What makes the VRF case a test: the same destination, looked up with and without the
    VRF, leaves by different interfaces."""
    bed = vrfbed
    for dst in (bed.source_v4, bed.source_v6):
        assert bed.route_dev(dst) == bed.server_if
        assert bed.route_dev(dst, vrf=True) == bed.vrf_if


def _bound_devices(bed: VrfBed, port: int) -> list:
    """The local address column of every established socket on ``port`` (``ss`` prints a
    socket's bound device as ``addr%dev``)."""
    out = bed.run(bed.server_ns, ["ss", "-Htn", "state", "established",
                                  f"( sport = :{port} )"]).stdout
    return [ln.split()[2] for ln in out.splitlines() if ln.strip()]


# Each flow source reads the socket's bound device its own way: sock_diag's idiag_if, the
# tracer's sk_bound_dev_if at accept (with the first-byte programs as the daemon runs by
# default: the VRF flows claim pool classes on the first interface and move to the VRF's). One
# backend each: the route lookup is the same code whatever the backend.
@pytest.mark.parametrize("backend,source", [("psp", "tracer"), ("htb", "sock_diag")])
def test_vrf_flows_shaped_on_the_vrf_interface(vrfbed, backend, source, psp_module, tmp_path):
    bed = vrfbed
    rules = RULES.replace("MAIN_IF", bed.server_if).replace("VRF_IF", bed.vrf_if)
    if source == "tracer":      # no re-scan during the test: every flow is the tracer's
        d = Daemon(bed, tmp_path, rules, "--no-metrics", "--rescan", "600",
                   backend=backend).start(timeout=gt(600))   # bcc compiles in the guest
    else:
        d = Daemon(bed, tmp_path, rules, "--no-tracer", "--no-metrics", "--rescan", "0.5",
                   backend=backend).start(timeout=gt(90))
    clients, iperfs, t_iperf = {}, {}, {}
    try:
        st = d.status()
        assert st["backend"] == backend, st["backend_reason"]
        for label, port, attr in IPERF:
            iperfs[label] = iperf3(bed, getattr(bed, attr), port, seconds=120,
                                   extra=["-i", "0.25"])
        for label, port, _attr in IPERF:
            t_iperf[label] = iperf3_started(bed, port, gt(30))
        for label, host, port in (("vrf v4", bed.vrf_v4, VRF_PORT),
                                  ("vrf v6", bed.vrf_v6, VRF_PORT),
                                  ("main v4", bed.server_v4, MAIN_PORT),
                                  ("main v6", bed.server_v6, MAIN_PORT)):
            argv = client_argv(str(host), port, 120, warmup=0.5) + [
                "--path", "/big", "--interval", "0.1"]
            clients[label] = bed.popen(bed.client_ns, argv, stdout=subprocess.PIPE, text=True)
        try:
            flows = wait_for(lambda: (lambda f: f if len(f) == 8 else None)(d.flows()),
                             gt(45), 0.2, "8 shaped flows")
        except TimeoutError:
            st = d.status()
            raise AssertionError(
                f"{len(st['flows'])} shaped flows of 8 (nginx 4, iperf3 2 x 2): live "
                f"{st['live_flows']}, unmanaged {st.get('unmanaged_interface')}, flows "
                f"{st['flows']}\n"
                f"{d.log_text()[-3000:]}") from None
        t_shaped = time.monotonic()
        want_source = "tracer" if source == "tracer" else "reconcile"
        assert [f["source"] for f in flows] == [want_source] * 8, flows
        if source == "tracer":
            st = d.status()
            assert st["flow_source"].startswith("tracer"), st["flow_source"]
            # two interfaces: every claim guarded (TCP paces it until its class is where it
            # leaves: the VRF's flows were claimed on the first interface) and then placed
            def guards_placed():
                c = d.status()["first_byte"]["counters"]
                return c["claimed"] >= 8 and c["placed"] == c["guarded"] == c["claimed"] and c
            try:
                c = wait_for(guards_placed, gt(30), 0.2, "every claim guarded and placed")
            except TimeoutError:
                raise AssertionError(d.status()["first_byte"]) from None
            psplib.record(f"vrf {backend} first-byte: claimed {c['claimed']}, guarded "
                          f"{c['guarded']}, placed {c['placed']}, lifted {c['lifted']}, "
                          f"elsewhere {d.status()['first_byte']['elsewhere']}")
        on = sorted((f["rule"], f["interface"]) for f in flows)
        assert on == [("in-vrf", bed.vrf_if)] * 2 + [("iperf-vrf", bed.vrf_if)] * 4 + [
            ("main", bed.server_if)] * 2, flows
        # the accepted VRF sockets are bound to the VRF's device (what the lookup is given),
        # the main ones to nothing
        vrf_socks = [a for p in (VRF_PORT, 5201, 5202) for a in _bound_devices(bed, p)]
        main_socks = _bound_devices(bed, MAIN_PORT)
        assert len(vrf_socks) == 6 and all(f"%{VRF}:" in a for a in vrf_socks), vrf_socks
        assert len(main_socks) == 2 and not any("%" in a for a in main_socks), main_socks
        assert d.status()["unmanaged_interface"]["count"] == 0, d.status()
        # (0.3 s more: the window's end needs a client sample after it)
        time.sleep(max(0.0, t_shaped + 0.5 + MEASURE_S + 0.3 - time.monotonic()))
        t_end = t_shaped + 0.5 + MEASURE_S
        res, reports = stop_clients(clients, iperfs, timeout=gt(30))
    finally:        # the bed (and its servers) outlives this test: its clients do not
        for c in (*clients.values(), *iperfs.values()):
            if c.poll() is None:
                c.kill()
        rc = d.stop()
    assert rc == 0, d.log_text()[-3000:]
    assert "Traceback" not in d.log_text(), d.log_text()[-3000:]
    assert not bed.flowpacer_left()
    figures = []
    for label, rep in reports.items():
        want = VRF_RATE / 8 * (WIRE6 if label.endswith("v6") else WIRE)
        got = iperf3_rate_between(rep, t_iperf[label], t_shaped + 0.5, t_end)
        figures.append((label, got, want))
        psplib.record(f"vrf {backend} {label}: {got * 8 / 1e6:.3f} Mbit/s at the receiver "
                      f"({100 * got / want:.1f} % of rate x payload/frame)")
    for label, r in res.items():
        rate = VRF_RATE if label.startswith("vrf") else MAIN_RATE
        want = rate / 8 * (WIRE6 if label.endswith("v6") else WIRE)
        got, _ = gap_goodput(r, t_shaped + 0.5, t_end)
        assert got is not None, (label, r)
        figures.append((label, got, want))
        psplib.record(f"vrf {backend} {label}: {got * 8 / 1e6:.3f} Mbit/s at the receiver "
                      f"({100 * got / want:.1f} % of rate x payload/frame)")
    for label, got, want in figures:
        assert abs(got / want - 1) <= TOLERANCE, \
            f"{label}: {got * 8 / 1e6:.3f} Mbit/s, want {want * 8 / 1e6:.3f} +-{TOLERANCE:.0%}"

"""Where per-flow pacing pays (issue 30, item 5): shallow access links, psp vs unshaped, in the
VM's virtual time.

``harness.access``: one server, three clients, each behind its own access link of 20 Mbit/s
with a 24 KiB queue (a switch port or a cheap CPE) and a 20 ms round trip; on each link a
household UDP flow (200-byte datagrams every 20 ms, from a second sender) whose one-way delay is
measured at the client. Each client downloads over TCP from the server (iperf3 -R; clients 0 and
1 over IPv4, IPv4-mapped on the server's dual-stack socket, client 2 over IPv6):

- unshaped: fq_codel at the server, CUBIC: each download fills its access link's queue, which
  must show as drops at the access link or a household p99 added delay above 2 ms;
- psp: the daemon (``--no-tracer``: sock_diag finds the flows) with one rule at 12 Mbit/s: once
  the flows are classified, no drop at any access link, every household flow's p99 added delay
  under 2 ms and no datagram lost, and each download at its rule's rate.

The window starts when the flows are in place (psp: the daemon shapes all six connections,
three control and three data) and 0.5 s (25 household datagrams) later, and ends with the
downloads: before sock_diag finds a flow it runs unshaped.
"""
from __future__ import annotations

import logging
import time

import pytest

from harness import psplib
from harness.access import (KIB, AccessNet, Download, Household, LinkSpec, counters_delta,
                            download_figures, finish_downloads, start_downloads)
from harness.daemon import Daemon, healthy, tracebacks
from harness.pacing import guest_timeout, mbit, require_virtual_time, to_mbit, wait_for
from harness.servers import iperf3_server
from harness.traffic import WIRE, WIRE6

log = logging.getLogger(__name__)

LINK = LinkSpec(mbit(20), 24 * KIB, rtt_ms=20, household=True)
RULE_MBIT = 12
PORTS = (5601, 5602, 5603)
SECONDS = 5
RULES = f"""
    interface: IFACE
    backend: psp
    link_rate: 1gbit
    rules:
      - name: download
        match: {{process: iperf3, direction: inbound, local_port: {PORTS[0]}-{PORTS[-1]}}}
        rate: {RULE_MBIT}mbit
"""


@pytest.fixture(scope="module")
def net():
    require_virtual_time()
    psplib.ensure_loaded()
    with psplib.rmem_max(psplib.BIG_RMEM_MAX), AccessNet([LINK] * 3) as n:
        for p in PORTS:
            iperf3_server(n, p)
        yield n


def run_case(net, ready) -> dict:
    """Downloads and household flows; ``ready()`` true once the flows are in place. The figures
    of the window from then (+25 datagrams) to the downloads' end."""
    downloads = [Download(c, p, v6=(c.index == 2)) for c, p in zip(net.clients, PORTS)]
    with Household(net, net.clients, v6={2}) as hh:
        procs = start_downloads(net, downloads, SECONDS)
        wait_for(ready, 20, "the flows in place")
        n0 = len(hh.flows[0].sent)
        wait_for(lambda: len(hh.flows[0].sent) >= n0 + 25, 10, "25 household datagrams")
        t0, c0 = time.time_ns(), net.counters()
        docs = finish_downloads(procs, guest_timeout(60))
        t1, c1 = time.time_ns(), net.counters()
        hh.stop()
    out = {"drops": {i: d["drops"] for i, d in counters_delta(c0, c1).items()},
           "udp": hh.figures(t0, t1),
           "tcp": [download_figures(doc, skip_s=2) for doc in docs]}
    psplib.record(f"access {out['drops']} udp p99 "
                  f"{[u['p99_ms'] for u in out['udp'].values()]} ms, tcp "
                  f"{[round(to_mbit(t['goodput_bps']), 2) for t in out['tcp']]} Mbit/s")
    return out


def _established(net) -> bool:
    """Each client's control and data connection established at the server."""
    out = net.run(net.server_ns, ["ss", "-Htn", "state", "established"]).stdout
    return sum(f":{p} " in out for p in PORTS) >= 3 and len(out.splitlines()) >= 6


def test_unshaped_downloads_fill_the_shallow_access_queue(net):
    net.server_qdisc("fq_codel")
    fig = run_case(net, lambda: _established(net))
    drops = sum(fig["drops"].values())
    p99 = max(u["p99_ms"] for u in fig["udp"].values())
    for t in fig["tcp"]:                      # the downloads used their links (nothing broken)
        assert to_mbit(t["goodput_bps"]) > RULE_MBIT, fig["tcp"]
    assert drops > 0 or p99 > 2.0, f"unshaped: no drop and household p99 {p99} ms: {fig}"


def test_psp_paced_downloads_no_drops_low_delay(net, tmp_path):
    net.clear_server_qdisc()
    d = Daemon(net, tmp_path, RULES, "--no-tracer", "--no-metrics", "--rescan", "0.2",
               backend="psp").start(timeout=guest_timeout(90))
    try:
        fig = run_case(net, lambda: d.status()["shaped_flows"] >= 6)
        # after the batch: every stage alive, the batch's flows gone, and a new batch (IPv4,
        # IPv4-mapped and IPv6 again) shaped
        assert healthy(d.status()) == [], d.status()["stages"]
        wait_for(lambda: d.status()["shaped_flows"] == 0, 20, "the flows gone")
        again = run_case(net, lambda: d.status()["shaped_flows"] >= 6)
        assert healthy(d.status()) == [], d.status()["stages"]
    finally:
        rc = d.stop()
    assert rc == 0, d.log_text()[-3000:]
    assert not list(tracebacks(d.log_text()))
    root = net.run(net.server_ns, ["tc", "qdisc", "show", "dev", net.server_if, "root"]).stdout
    assert "psp" not in root, f"left after stop: {root}"          # nothing of the daemon's left
    assert sum(again["drops"].values()) == 0, f"second batch: drops {again['drops']}"
    assert sum(fig["drops"].values()) == 0, f"drops at the access links: {fig['drops']}"
    for i, u in fig["udp"].items():
        assert u["p99_ms"] < 2.0, f"client {i}: household p99 added delay {u}"
        assert u["loss"] == 0, f"client {i}: household loss {u}"
    for i, t in enumerate(fig["tcp"]):
        want = mbit(RULE_MBIT) * (WIRE6 if i == 2 else WIRE)
        assert abs(t["goodput_bps"] / want - 1) < 0.05, \
            f"client {i}: {to_mbit(t['goodput_bps']):.2f} Mbit/s, rule {RULE_MBIT} x payload/frame"

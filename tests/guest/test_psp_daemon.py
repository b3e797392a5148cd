"""The daemon end to end with the psp backend, inside the VM where sch_psp is loaded.

``flowpacer run --no-tracer`` (finding flows by sock_diag; bcc would take minutes to compile
under TCG) runs in the server namespace of a ``harness.testbed.Testbed`` with a rules file;
a real delivery server (``harness.blaster``) serves clients in the client namespace,
which measure their goodput as they receive. Each shaped flow must be within 2 % of its rule's
rate x 1448/1514 (TCP payload per full frame; 1428/1514 over IPv6), the unmatched one far
above every rule, each flow's psp class must be in the kernel while it lives and gone after it
closes, and SIGTERM must remove the psp qdisc.
"""
from __future__ import annotations

import json
import subprocess

import pytest

from harness import psplib
from harness.daemon import Daemon
from harness.testbed import Testbed, client_argv, server_argv, wait_for
from harness.traffic import WIRE, WIRE6
from harness.psplib import PspNl
SLOW, FAST = 3_000_000, 8_000_000            # bit/s of the two rules
RULES = """
    interface: IFACE
    backend: BACKEND
    link_rate: 1gbit
    rules:
      - name: slow
        match: {process: fp-psp-srv, direction: inbound, local_port: 9101}
        rate: 3mbit
      - name: fast
        match: {process: fp-psp-srv, direction: inbound, local_port: 9102}
        rate: 8mbit
"""


def psp_daemon(tb, workdir, backend: str) -> Daemon:
    """``flowpacer run`` in the testbed's server namespace (not started)."""
    return Daemon(tb, workdir, RULES, "--no-tracer", "--no-metrics", "--rescan", "0.5",
                  backend=backend)


def _kernel(tb: Testbed):
    with PspNl(tb.server_ns) as sock:
        return sock.root(tb.server_if), sock.classes(tb.server_if)


def _fetch_all(tb: Testbed, host: str, ports, seconds: float, warmup: float):
    clients = {p: tb.popen(tb.client_ns, client_argv(host, p, seconds, warmup=warmup),
                           stdout=subprocess.PIPE, text=True) for p in ports}
    return clients


def _results(clients) -> dict:
    out = {}
    for p, c in clients.items():
        stdout, _ = c.communicate(timeout=120)
        assert c.returncode == 0, f"client of port {p} exited {c.returncode}"
        out[p] = json.loads(stdout.strip().splitlines()[-1])
    return out


def test_daemon_starts_with_stock_rmem_max(tb, tmp_path):
    """A stock kernel's net.core.rmem_max (212992) must not stop the daemon's set-up."""
    d = psp_daemon(tb, tmp_path, "psp")
    with psplib.rmem_max(psplib.STOCK_RMEM_MAX):
        try:
            d.start()
            assert d.status_cli()["backend"] == "psp"
        finally:
            if d.proc is not None:
                d.stop()
    assert _kernel(tb)[0] is None


def test_daemon_psp_backend_end_to_end(tb, tmp_path, big_rmem):
    tb.popen(tb.server_ns, server_argv([9101, 9102, 9103], "fp-psp-srv"))
    tb.wait_listening(9103)
    d = psp_daemon(tb, tmp_path, "psp").start()
    try:
        st = d.status_cli()
        assert st["backend"] == "psp", st
        assert st["backend_reason"] == "sch_psp module is loaded", st["backend_reason"]
        q, cls = _kernel(tb)
        assert q is not None and q.link_rate == 125_000_000 and list(cls) == [2]
        clients = _fetch_all(tb, str(tb.server_v4), (9101, 9102), seconds=8, warmup=2.5)
        # while they run: one psp class per shaped flow, at its rule's rate
        flows = wait_for(lambda: (lambda f: f if len(f) == 2 else None)(d.flows()), 20, 0.1,
                         "both shaped flows in the daemon's status")
        by_rule = {f["rule"]: f for f in flows}
        assert set(by_rule) == {"slow", "fast"}
        _, cls = _kernel(tb)
        for name, bit in (("slow", SLOW), ("fast", FAST)):
            f = by_rule[name]
            minor = int(f["classid"].split(":")[1], 16)
            assert f["rate_bit"] == bit and minor in cls, (f, sorted(cls))
            assert cls[minor].rate == bit // 8 and cls[minor].ceil == bit // 8
        res = _results(clients)
        x = _kernel(tb)[0].xstats
        psplib.record(f"psp daemon: qdisc: {x['paced_pkts']} paced packets, mean lateness "
                      f"{x['late_ns_total'] / max(1, x['paced_pkts']) / 1e3:.0f} us, worst "
                      f"{x['late_ns_max'] / 1e6:.1f} ms, clamps {x['clamps']}")
        for port, bit in ((9101, SLOW), (9102, FAST)):
            got = res[port]["goodput_bps"]
            want = bit / 8 * WIRE
            psplib.record(f"psp daemon: port {port} rule {bit / 1e6:g} Mbit: goodput "
                          f"{got * 8 / 1e6:.3f} Mbit/s = {100 * got / want:.2f} % of "
                          "rate x 1448/1514")
            # never above the rule; below it by more than 2 % only when the qdisc says it was
            # held up (clamps: a departure later than its catch-up window, which on this real
            # clock means the emulator was starved by the host; exact figures: test_psp_pacing)
            low = 0.98 if x["clamps"] == 0 else 0.90
            assert low * want <= got <= 1.02 * want, \
                f"port {port}: {got * 8 / 1e6:.3f} Mbit/s ({100 * got / want:.2f} %, clamps {x['clamps']})"
        # closed flows: their classes go, in the daemon and in the kernel
        wait_for(lambda: not d.flows(), 10, 0.1, "the closed flows to be forgotten")
        wait_for(lambda: list(_kernel(tb)[1]) == [2], 10, 0.1, "the closed flows' classes to go")
        # unmatched traffic (measured on its own: unshaped it takes all the guest's CPU, which
        # would delay everyone's timers): no class, far above every rule
        free = _results(_fetch_all(tb, str(tb.server_v4), (9103,), seconds=4, warmup=1))[9103]
        psplib.record(f"psp daemon: unmatched flow {free['goodput_bps'] * 8 / 1e6:.1f} Mbit/s")
        assert free["goodput_bps"] > 3 * FAST / 8, f"unmatched: {free['goodput_bps'] * 8e-6:.1f}"
        assert not d.flows() and list(_kernel(tb)[1]) == [2]
        q, _ = _kernel(tb)
        assert q.xstats["paced_pkts"] > 0 and q.xstats["gso_split"] > 0
    finally:
        rc = d.stop()
    assert rc == 0, d.log.read_text()[-3000:]
    assert _kernel(tb)[0] is None, "SIGTERM left the psp qdisc behind"
    assert "Traceback" not in d.log.read_text()


def test_daemon_auto_backend_chooses_psp(tb, tmp_path, big_rmem):
    """backend: auto picks psp because the module is loaded, and says so; IPv6 flows too."""
    tb.popen(tb.server_ns, server_argv([9101, 9103], "fp-psp-srv", v6=True))
    tb.wait_listening(9101)
    d = psp_daemon(tb, tmp_path, "auto").start()
    try:
        st = d.status_cli()
        assert st["backend"] == "psp", st
        assert st["backend_reason"] == "auto: sch_psp module is loaded", st["backend_reason"]
        clients = _fetch_all(tb, str(tb.server_v6), (9101,), seconds=6, warmup=2.5)
        f = wait_for(lambda: d.flows(), 20, 0.1, "the shaped IPv6 flow")[0]
        assert f["rule"] == "slow" and f["local"].startswith(f"[{tb.server_v6}]")
        res = _results(clients)
        res.update(_results(_fetch_all(tb, str(tb.server_v6), (9103,), seconds=4, warmup=1)))
        got, want = res[9101]["goodput_bps"], SLOW / 8 * WIRE6
        free = res[9103]["goodput_bps"]
        psplib.record(f"psp daemon (auto, IPv6): 3 Mbit rule: goodput {got * 8 / 1e6:.3f} Mbit/s "
                      f"= {100 * got / want:.2f} % of rate x 1428/1514; unmatched "
                      f"{free * 8 / 1e6:.1f} Mbit/s")
        assert got == pytest.approx(want, rel=0.02)
        assert res[9103]["goodput_bps"] > 3 * SLOW / 8
        wait_for(lambda: list(_kernel(tb)[1]) == [2], 10, 0.1, "the closed flow's class to go")
    finally:
        rc = d.stop()
    assert rc == 0, d.log.read_text()[-3000:]
    assert _kernel(tb)[0] is None

"""Flash crowds (issue 26): every flow the kernel decides at its handshake is paced from its
first byte, however many arrive at once -- by a ready pool class, or, when the rule's pool ran
dry, by the stopgap (the socket's SO_MAX_PACING_RATE at the rule's rate until its class is in);
and a reload that raises the rate lifts the stopgap.

Real nginx (2 workers, IPv4 and IPv6 listeners) and two h2load processes started together
(IPv4 and IPv6), one request per client; every reply's time from h2load's per-request log."""
import os
import secrets
import time

import pytest

from flowpacer.kernel.backend.htb import burst_for
from harness import bpfobjs, crowd
from harness.capture import daemon_spares, tc_show
from harness.daemon import Daemon
from harness.servers import Nginx
from harness.testbed import Testbed, server_argv, wait_for
from harness.traffic import WIRE, WIRE6, fetch, fetch_result

pytestmark = [pytest.mark.kernel, pytest.mark.heavy]

OBJECT = 256 << 10
RATE_BIT = 400_000                 # per flow: a shaped 256 KiB reply takes >= 5 s
RATE_BPS = RATE_BIT // 8
CLIENTS = int(os.environ.get("FP_FLASH_CLIENTS", "500"))     # per address family
# FP_FLASH_BEFORE=1: the same without the stopgap (FLOWPACER_NO_STOPGAP): how it was before
BEFORE = bool(os.environ.get("FP_FLASH_BEFORE"))
MIN_S = crowd.min_reply_s(OBJECT, RATE_BPS, burst_for(RATE_BPS))
RULES = crowd.crowd_rules("htb", RATE_BIT)


def _testbed():
    # our own names (fp-sgA...-s/-c), a subnet of our own
    return Testbed(tag=f"sgA{secrets.token_hex(2)}", subnet=230 + secrets.randbelow(20))


def test_flash_crowd_every_reply_is_paced_from_its_first_byte(root, tmp_path):
    """>= 500 clients over IPv4 and >= 500 over IPv6 at once (two h2load processes), one 256 KiB
    reply each: at least 99.5 % of the replies take at least the time their rate allows (per
    request), every flow the kernel decided is counted once (class, stopgap or missed), every
    stage runs, and nothing is left after the stop."""
    with _testbed() as tb:
        tb.set_gso(False)      # "a packet" past the class's last token is one frame
        ng = Nginx(tb, tmp_path / "nginx", files={"obj": OBJECT}).start()
        (tmp_path / "d").mkdir()
        d = Daemon(tb, tmp_path / "d", RULES, "--rescan", "1", "--no-metrics",
                   env=dict(os.environ, **({"FLOWPACER_NO_STOPGAP": "1"} if BEFORE else {})))
        d.start()
        try:
            objs = bpfobjs.held(d.pid())
            assert "rules shaped from the first byte: crowd" in d.status()["flow_source"]
            wait_for(lambda: any(p["ready"] > 0 for p in d.status()["first_byte"]["pools"]),
                     30, 0.05, "the pool made")
            c0 = crowd.first_byte_counters(d)
            got = crowd.crowd(tb, (tb.server_v4, tb.server_v6), ng.port, "/obj", CLIENTS,
                              tmp_path)
            ok, early = got.ok, got.early(MIN_S)
            delta = crowd.counted(d, c0, len(got.rows)) if got.rows else {}
            print(f"flash crowd: {len(got.rows)} requests ({len(ok)} ok) in {got.took_s:.1f} s, "
                  f"starts within {got.spread_ms:.0f} ms; {len(early)} replies under "
                  f"{MIN_S:.2f} s (fastest {early[:5]}); counters {delta}")
            assert len(ok) == 2 * CLIENTS, (len(got.rows), len(ok),
                                            [o[-600:] for o in got.outputs])
            assert len(early) <= 0.005 * len(ok), \
                f"{len(early)} of {len(ok)} replies finished in under {MIN_S:.2f} s: heads " \
                f"left unpaced (fastest {early[:10]})"
            # every flow the kernel decided is paced by a class or the stopgap, or counted missed
            assert delta["claimed"] + delta["stopgap"] + delta["missed"] == len(ok), delta
            assert delta["missed"] <= 0.005 * len(ok), delta
            # a crowd past 256 flows leaves spares (htb): told from leaks
            crowd.assert_nothing_left(tb, d, objs, spares_expected=2 * CLIENTS >= 256)
        finally:
            d.stop()


RELOAD_RULES = """
    interface: IFACE
    backend: htb
    link_rate: 10gbit
    rules:
      - name: lifted
        match: {process: fp-sgA-srv, direction: inbound}
        rate: 8mbit
"""


def _rate(res, t0, a, b):
    pts = [(res["t0_monotonic"] + t, n) for t, n in res["samples"]]
    lo = min(pts, key=lambda p: abs(p[0] - a))
    hi = min(pts, key=lambda p: abs(p[0] - b))
    return (hi[1] - lo[1]) / (hi[0] - lo[0])


def test_a_reload_raising_the_rate_lifts_the_stopgap(root, tmp_path):
    """No pool classes (FLOWPACER_FIRST_BYTE_POOL=0): an IPv4 and an IPv6 flow are paced by
    the stopgap from their first byte, at their rule's rate (measured at the receiver); after
    a reload to 3x the rate the stopgap is lifted and both flows reach the new rate (a stale
    socket limit would hold them at the old one)."""
    with _testbed() as tb:
        tb.popen(tb.server_ns, server_argv([9301], "fp-sgA-srv", v6=True))
        tb.wait_listening(9301)
        (tmp_path / "d").mkdir()
        d = Daemon(tb, tmp_path / "d", RELOAD_RULES, "--rescan", "1", "--no-metrics",
                   env=dict(os.environ, FLOWPACER_FIRST_BYTE_POOL="0")).start()
        try:
            wait_for(lambda: "rules shaped from the first byte: lifted"
                     in d.status()["flow_source"], 30, 0.05, "the kernel rule")
            c0 = crowd.first_byte_counters(d)
            ps = [fetch(tb, host, 9301, 9, warmup=0, interval=0.1)
                  for host in (tb.server_v4, tb.server_v6)]
            wait_for(lambda: d.status()["shaped_flows"] == 2, 10, 0.05, "both flows' classes")
            c1 = crowd.first_byte_counters(d)
            assert c1["stopgap"] - c0["stopgap"] == 2 and c1["claimed"] == c0["claimed"], c1
            t_in = time.monotonic()
            wait_for(lambda: time.monotonic() - t_in > 2.5, 5, 0.05, "a steady rate")
            d.rules.write_text(d.rules.read_text().replace("rate: 8mbit", "rate: 24mbit"))
            r = d.call({"cmd": "reload"})
            t_reload = time.monotonic()
            assert r["ok"] and r["changed"] == 2, r      # both flows re-rated
            res = [fetch_result(p, timeout=30) for p in ps]
            for host_res, w in zip(res, (WIRE, WIRE6)):
                before = _rate(host_res, 0, t_reload - 2.0, t_reload - 0.2)
                after = _rate(host_res, 0, t_reload + 1.5, t_reload + 3.0)
                print(f"stopgap lifted: {host_res['host']} {before * 8 / 1e6:.2f} -> "
                      f"{after * 8 / 1e6:.2f} Mbit/s of payload")
                assert before == pytest.approx(8e6 / 8 * w, rel=0.08), (before, after)
                assert after == pytest.approx(24e6 / 8 * w, rel=0.08), (before, after)
            assert crowd.first_byte_counters(d)["lifted"] - c0["lifted"] == 2
            assert "Traceback" not in d.log_text()
        finally:
            d.stop()


READY = 900                         # ready_classes: more than the crowd below needs
READY_CLIENTS = (250, 250, 250)     # IPv4, IPv6 and IPv4-mapped (the dual-stack port)


def test_a_crowd_finds_its_classes_made_ahead_by_ready_classes(root, tmp_path):
    """``ready_classes: 900`` (issue 26): after start the daemon makes 900 spare classes in the
    background; a crowd of 750 (250 IPv4, 250 IPv6, 250 IPv4-mapped at once) then makes no
    class: every flow that did not claim a pool class at its handshake gets a spare changed to
    its rate (the kernel's classes after the crowd are the same set), every reply is paced from
    its first byte; new IPv4 and IPv6 downloads after it are shaped at the rule's rate; every
    stage runs and nothing else is left."""
    with _testbed() as tb:
        tb.set_gso(False)
        ng = Nginx(tb, tmp_path / "nginx", files={"obj": OBJECT}).start()
        (tmp_path / "d").mkdir()
        rules = RULES.replace("    rules:\n", f"    ready_classes: {READY}\n    rules:\n")
        d = Daemon(tb, tmp_path / "d", rules, "--rescan", "1", "--no-metrics").start()
        try:
            objs = bpfobjs.held(d.pid())
            wait_for(lambda: d.status()["interfaces"][0]["spare_classes"] >= READY, 120, 0.05,
                     f"{READY} ready classes")
            took = time.monotonic() - d.t_start
            made = daemon_spares(d)
            kernel = flow_classes(tb)
            assert kernel == made and len(made) == READY, (len(kernel), len(made))
            wait_for(lambda: any(p["ready"] > 0 for p in d.status()["first_byte"]["pools"]),
                     30, 0.05, "the pool made")
            c0 = crowd.first_byte_counters(d)
            got = crowd.crowd(tb, (tb.server_v4, tb.server_v6, tb.server_v4),
                              (ng.port, ng.port, ng.dual_port), "/obj", READY_CLIENTS, tmp_path)
            ok, early = got.ok, got.early(MIN_S)
            delta = crowd.counted(d, c0, len(got.rows)) if got.rows else {}
            print(f"ready classes: {READY} made {took:.2f} s after the daemon's start; crowd of "
                  f"{len(got.rows)} ({len(ok)} ok), starts within {got.spread_ms:.0f} ms, "
                  f"{len(early)} early; counters {delta}")
            assert len(ok) == sum(READY_CLIENTS), (len(got.rows), [o[-600:] for o in got.outputs])
            assert len(early) <= 0.005 * len(ok), early[:10]
            assert delta["stopgap"] > 0, delta     # the crowd outran the pool: spares were used
            wait_for(lambda: d.status()["shaped_flows"] == 0, 60, 0.2, "every flow gone")
            # no class made for the crowd: the flow classes are the ready ones, spares again
            assert flow_classes(tb) == made == daemon_spares(d), \
                (len(flow_classes(tb)), len(daemon_spares(d)))
            # new downloads after the crowd, IPv4 and IPv6 at once, each at the rule's rate
            ps = [fetch(tb, host, ng.port, 4, warmup=1, path="/obj")
                  for host in (tb.server_v4, tb.server_v6)]
            for p, w in zip(ps, (WIRE, WIRE6)):
                r = fetch_result(p, timeout=30)
                assert r["goodput_bps"] == pytest.approx(RATE_BPS * w, rel=0.08), r["host"]
            crowd.assert_nothing_left(tb, d, objs, spares_expected=True)
        finally:
            d.stop()


def flow_classes(tb) -> frozenset:
    """The flow-range classes (f1f0:10..f1f0:bfff, handles.py) in the server interface's
    kernel, by name: what the daemon made for flows and spares (not its skeleton or pools)."""
    from flowpacer.kernel.backend.handles import FIRST_FLOW_MINOR, LAST_FLOW_MINOR
    out = set()
    for ln in tc_show(tb, "class").splitlines():
        parts = ln.split()
        if len(parts) > 2 and parts[2].startswith("f1f0:"):
            minor = int(parts[2][5:] or "0", 16)
            if FIRST_FLOW_MINOR <= minor <= LAST_FLOW_MINOR:
                out.add(parts[2])
    return frozenset(out)

"""Backend and daemon cost at scale (issue 2's performance targets).

1. ``install``: install N flows (class + filter) and remove them, N = 100, 1 000, 10 000: ms per
   flow, in one plan and one by one (goal at 1 000: <= 0.3 ms per flow);
2. ``classification``: with 10 000 flows installed, a single flow's throughput through the
   last-installed filter compared with the same flow alone (goal: >= 90 %); iperf3 -R with a fixed
   client port (``bench.classify_bench`` measures the whole curve, hashed and linear);
3. ``daemon``: one daemon, live shaped flows raised to 100, 1 000 and 10 000: time to shape each
   step, the daemon's RSS (goal at 10 000: <= 150 MB), the status call and the Prometheus scrape
   (``GET http://127.0.0.1:9717/metrics`` inside the server's namespace; goal at 10 000: < 1 s);
4. ``daemon_mixed``: 3 with half of the held flows over IPv6 (``install`` mixes the families
   already: every other flow key is IPv6).

Writes bench/results/backend.json (parts not run keep their previous figures unless ``--fresh``).
Run: ``.venv/bin/python -m bench.backend_bench [--quick] [--fresh] [part ...]``.
"""
from __future__ import annotations

import argparse
import http.client
import json
import subprocess
import sys
import time
from typing import List

from flowpacer.kernel.backend import tc as tcb
from flowpacer.kernel.backend.htb import HtbCodec
from flowpacer.model import FlowKey, Op, OpKind, Shape
from harness.daemon import Daemon
from harness.testbed import PY, Testbed, in_netns, wait_for

from .common import RESULTS, percentiles, write
from .reportkit import Goal, ResultIndex, g, num, pyplot, savefig, table

MBIT = 125_000


def keys(tb, n, base=20000, v6_every=2):
    out = []
    for i in range(n):
        if v6_every and i % v6_every:
            out.append(FlowKey(tb.server_v6, 443, tb.client_v6, base + i))
        else:
            out.append(FlowKey(tb.server_v4, 443, tb.client_v4, base + i))
    return out


def install_cost(tb, n=1000) -> dict:
    with in_netns(tb.server_ns):
        b = tcb.TcBackend(HtbCodec(), tb.server_if, 1000 * MBIT)
        b.setup()
        ks = keys(tb, n)
        s = Shape("b", 10 * MBIT, 10 * MBIT)
        t0 = time.perf_counter()
        r = b.apply([Op(OpKind.ADD, k, s) for k in ks])
        t1 = time.perf_counter()
        assert r.added == n and not r.errors, r.errors[:3]
        r = b.apply([Op(OpKind.REMOVE, k) for k in ks])
        t2 = time.perf_counter()
        assert r.removed == n
        # one flow per apply, as events arrive in the daemon
        one_add, one_del = [], []
        for k in ks:
            a = time.perf_counter()
            b.apply([Op(OpKind.ADD, k, s)])
            one_add.append((time.perf_counter() - a) * 1e3)
        for k in ks:
            a = time.perf_counter()
            b.apply([Op(OpKind.REMOVE, k)])
            one_del.append((time.perf_counter() - a) * 1e3)
        b.teardown()
        b.close()
    return {"flows": n,
            "batched_add_ms_per_flow": (t1 - t0) * 1e3 / n,
            "batched_remove_ms_per_flow": (t2 - t1) * 1e3 / n,
            "single_add_ms": percentiles(one_add), "single_remove_ms": percentiles(one_del)}


def iperf(tb, seconds=3, cport=45678) -> float:
    r = tb.run(tb.client_ns, ["iperf3", "-c", str(tb.server_v4), "-R", "-t", str(seconds),
                              "--cport", str(cport), "-J"], timeout=seconds + 30)
    return json.loads(r.stdout)["end"]["sum_received"]["bits_per_second"]


def classification(tb, n=10_000, runs=3) -> dict:
    tb.popen(tb.server_ns, ["iperf3", "-s"])
    tb.wait_listening(5201)
    link = 100_000 * MBIT                        # far above what veth carries: classify only
    target = FlowKey(tb.server_v4, 5201, tb.client_v4, 45678)
    s = Shape("b", link, link)
    with in_netns(tb.server_ns):
        b = tcb.TcBackend(HtbCodec(), tb.server_if, link)
        b.setup()
        b.apply([Op(OpKind.ADD, target, s)])
    alone, loaded = [], []
    many = keys(tb, n, base=1000, v6_every=0)
    for _ in range(runs):
        alone.append(iperf(tb))
        with in_netns(tb.server_ns):
            b.apply([Op(OpKind.REMOVE, target)])
            b.apply([Op(OpKind.ADD, k, s) for k in many] + [Op(OpKind.ADD, target, s)])
        loaded.append(iperf(tb))
        with in_netns(tb.server_ns):
            b.apply([Op(OpKind.REMOVE, k) for k in many])
    with in_netns(tb.server_ns):
        st = b.stats()[target]
        b.teardown()
        b.close()
    ratio = sorted(loaded)[len(loaded) // 2] / sorted(alone)[len(alone) // 2]
    return {"flows_installed": n, "alone_bit_s": alone, "with_flows_bit_s": loaded,
            "median_ratio": ratio, "target_class_bytes": st.bytes}


def scrape(ns: str, port: int = 9717, timeout: float = 60) -> tuple:
    """(seconds, body bytes, flow series) of one GET /metrics inside namespace ``ns``."""
    with in_netns(ns):
        t0 = time.perf_counter()
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        try:
            c.request("GET", "/metrics")
            r = c.getresponse()
            body = r.read()
        finally:
            c.close()
        dt = time.perf_counter() - t0
    if r.status != 200:
        raise RuntimeError(f"GET /metrics: HTTP {r.status}")
    series = sum(1 for ln in body.splitlines()
                 if ln.startswith((b"flowpacer_flow_sent_bytes{", b"flowpacer_flow_sent_bytes_total{")))
    return dt, len(body), series


HELD_RULES = """
    interface: IFACE
    backend: htb
    link_rate: 10gbit
    rules:
      - name: held
        match: {process: fp-hold-srv, local_port: 7000}
        rate: 1mbit
"""


def daemon_scale(tb, steps=(100, 1000, 10_000), scrapes=5, mixed=False) -> dict:
    """One daemon; live shaped flows raised step by step (each step one more holder process;
    with ``mixed`` two, one over IPv4 and one over IPv6, half of the new flows each)."""
    tb.popen(tb.server_ns, [PY, "-m", "harness.blaster", "hold-serve", "--port", "7000"])
    tb.wait_listening(7000)
    d = Daemon(tb, None, HELD_RULES, "--metrics-addresses", "full", verbose=False,
               rules_mode=0o600).start(timeout=60)
    wait_for(lambda: _try_scrape(tb), 30, 0.2, "the metrics endpoint")
    base = {"flows": 0, **d.memory(), "scrape_s": percentiles([scrape(tb.server_ns)[0] for _ in range(scrapes)])}
    holders, out, have = [], [], 0
    try:
        for n in steps:
            more = n - have
            t0 = time.monotonic()
            parts = ([(tb.server_v4, more - more // 2), (tb.server_v6, more // 2)] if mixed
                     else [(tb.server_v4, more)])
            hs = [tb.popen(tb.client_ns, [PY, "-m", "harness.blaster", "hold-connect", "--host",
                                          str(host), "--port", "7000", "--count", str(count),
                                          "--seconds", "600"], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True) for host, count in parts if count]
            holders.extend(hs)
            opened = {"open_s": max(json.loads(h.stdout.readline())["open_s"] for h in hs)}
            wait_for(lambda: d.status(timeout=60)["shaped_flows"] >= n, 180, 0.2,
                     f"{n} shaped flows")
            shaped_s = time.monotonic() - t0
            have = n
            time.sleep(0.5)
            t1 = time.perf_counter()
            st = d.status(timeout=60)
            status_s = time.perf_counter() - t1
            sc = [scrape(tb.server_ns) for _ in range(scrapes)]
            step = {"flows": n, "new_flows": more, "client_open_s": opened["open_s"],
                    "open_to_all_shaped_s": shaped_s, "ms_per_new_flow": shaped_s * 1e3 / more,
                    **d.memory(), "status_call_s": status_s, "status_shaped_flows": st["shaped_flows"],
                    "scrape_s": percentiles([x[0] for x in sc]), "scrape_samples_s": [x[0] for x in sc],
                    "scrape_bytes": sc[-1][1], "scrape_flow_series": sc[-1][2],
                    "apply_us": st["counters"]["apply_latency_us"]}
            out.append(step)
            print(json.dumps({k: v for k, v in step.items() if k != "scrape_samples_s"}), flush=True)
        t2 = time.monotonic()
        for h in holders:
            h.stdin.close()
        wait_for(lambda: d.status(timeout=60)["shaped_flows"] == 0, 120, 0.2,
                 "flows to be removed")
        removed_s = time.monotonic() - t2
    finally:
        for h in holders:
            if h.stdin and not h.stdin.closed:
                h.stdin.close()
        d.stop()
    res = {"steps": out, "idle": base, "close_all_to_all_removed_s": removed_s,
           "ipv6_share": 0.5 if mixed else 0.0}
    last = out[-1]
    # the figures issue 2 named, at the largest step (10 000 in a full run)
    res.update({"flows": last["flows"], "daemon_rss_bytes": last["rss_bytes"],
                "open_to_all_shaped_s": last["open_to_all_shaped_s"], "status_call_s": last["status_call_s"]})
    return res


def _try_scrape(tb):
    try:
        return scrape(tb.server_ns, timeout=5)
    except (OSError, RuntimeError):
        return None


# daemon_mixed: the daemon part with half of the flows over IPv6 (issue 12), beside IPv4 only
PARTS = {"install": "bnch1", "classification": "bnch2", "daemon": "bnch3", "daemon_mixed": "bnch4"}
ALIASES = {"daemon_10k": "daemon"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("parts", nargs="*", help=f"of {', '.join(PARTS)} (default: all)")
    ap.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    ap.add_argument("--fresh", action="store_true", help="do not keep figures of parts not run")
    ap.add_argument("--install-flows", default=None, help="flow counts of the install part (100,1000,10000)")
    ap.add_argument("--daemon-flows", default=None, help="flow steps of the daemon part (100,1000,10000)")
    args = ap.parse_args(argv)
    names = [ALIASES.get(n, n) for n in args.parts] or list(PARTS)
    for n in names:
        if n not in PARTS:
            ap.error(f"unknown part {n!r}")
    inst = [int(x) for x in (args.install_flows or ("100,1000" if args.quick else "100,1000,10000")).split(",")]
    dsteps = [int(x) for x in (args.daemon_flows or ("100,1000" if args.quick else "100,1000,10000")).split(",")]
    figures = {}
    prev = RESULTS / "backend.json"
    if prev.exists() and not args.fresh:
        figures = json.loads(prev.read_text()).get("figures", {})
        figures.pop("daemon_10k", None)
    for name in names:
        with Testbed(tag=PARTS[name]) as tb:
            if name == "install":
                scale = {}
                for n in inst:
                    scale[str(n)] = install_cost(tb, n)
                    print(json.dumps({"install": scale[str(n)]}), flush=True)
                figures["install_scale"] = scale
                if "1000" in scale:
                    figures["install"] = scale["1000"]
            elif name == "classification":
                figures[name] = classification(tb, runs=1 if args.quick else 3)
            else:
                figures[name] = daemon_scale(tb, dsteps, scrapes=3 if args.quick else 5,
                                             mixed=name == "daemon_mixed")
        if name != "install":
            print(json.dumps({name: figures[name]}, indent=2, default=str), flush=True)
    goals = {}
    if "install" in figures:
        goals["install_ms_per_flow<=0.3"] = figures["install"]["batched_add_ms_per_flow"] <= 0.3
        goals["remove_ms_per_flow<=0.3"] = figures["install"]["batched_remove_ms_per_flow"] <= 0.3
    if "classification" in figures:
        goals["throughput_with_10k_flows>=90%"] = figures["classification"]["median_ratio"] >= 0.9
    d = figures.get("daemon")
    if d and d.get("flows") == 10_000:
        goals["daemon_rss_10k<=150MB"] = d["daemon_rss_bytes"] <= 150e6
        goals["scrape_10k<1s"] = d["steps"][-1]["scrape_s"]["p50"] < 1.0
    path = write("backend", figures, goals)
    print(json.dumps(goals, indent=2))
    print(f"wrote {path}", file=sys.stderr)
    return 0


# ============================================================== report
# This benchmark's part of bench/REPORT.md (bench/report.py puts it in its chapter) and its goals.

def _daemon_step(R, flows):
    for s in g(R.fig("backend"), "daemon", "steps", default=[]) or []:
        if s.get("flows") == flows:
            return s
    return None


def report_section(R: ResultIndex) -> str:
    """Install cost per flow and the daemon at scale (chapter 4, after daemon_bench's part)."""
    plt = pyplot()
    b = R.fig("backend")
    out = ["Install cost and scale: " + R.provenance("backend", "backend") + "\n"]
    sc = g(b, "install_scale") or ({"1000": b["install"]} if g(b, "install") else {})
    if sc:
        rows = []
        for n, r in sorted(sc.items(), key=lambda kv: int(kv[0])):
            rows.append([f"{int(n):,}".replace(",", " "), num(r["batched_add_ms_per_flow"], "", 3),
                         num(r["batched_remove_ms_per_flow"], "", 3), num(r["single_add_ms"]["p50"], "", 3),
                         num(r["single_add_ms"]["p99"], "", 2), num(r["single_remove_ms"]["p50"], "", 3)])
        out.append("**Class + filter install cost** (htb backend, flowpacer's own netlink requests; ms per flow):\n")
        out.append(table(["flows", "add, one plan", "remove, one plan", "add one by one p50", "p99",
                          "remove one by one p50"], rows))
        fig, ax = plt.subplots(figsize=(6, 3.2))
        ns = sorted(int(n) for n in sc)
        for key, lab in (("batched_add_ms_per_flow", "add (one plan)"), ("batched_remove_ms_per_flow", "remove (one plan)")):
            ax.plot(ns, [sc[str(n)][key] for n in ns], "o-", label=lab)
        ax.plot(ns, [sc[str(n)]["single_add_ms"]["p50"] for n in ns], "s--", label="add one by one, p50")
        ax.axhline(0.3, color="g", ls="--", lw=0.8, label="goal 0.3 ms")
        ax.set_xscale("log")
        ax.set_xlabel("flows")
        ax.set_ylabel("ms per flow")
        ax.legend(fontsize=8)
        out.append(savefig(fig, "install_cost.png"))
    steps = g(b, "daemon", "steps")
    if steps:
        idle = g(b, "daemon", "idle") or {}
        rows = [["0 (idle)", "", num(idle.get("rss_bytes", 0) / 1e6, "MB"), num(idle.get("peak_rss_bytes", 0) / 1e6, "MB"),
                 "", num(g(idle, "scrape_s", "p50"), "s", 3), ""]]
        for s in steps:
            rows.append([f"{s['flows']:,}".replace(",", " "), num(s["open_to_all_shaped_s"], "s", 2),
                         num(s["rss_bytes"] / 1e6, "MB"), num(s["peak_rss_bytes"] / 1e6, "MB"),
                         num(s["status_call_s"], "s", 3), num(s["scrape_s"]["p50"], "s", 3),
                         f"{s['scrape_flow_series']:,}".replace(",", " ") + f" flows, {s['scrape_bytes'] / 1e6:.1f} MB"])
        out.append("**Daemon at scale** (one daemon, live shaped flows raised step by step; the scrape is "
                   "`GET http://127.0.0.1:9717/metrics` inside the server's namespace, median of "
                   f"{g(steps[-1], 'scrape_s', 'n')}):\n")
        out.append(table(["flows", "new flows shaped in", "RSS", "peak RSS", "status call", "scrape", "scrape size"], rows))
        fig, ax = plt.subplots(figsize=(6, 3.2))
        xs = [s["flows"] for s in steps]
        ax.plot(xs, [s["rss_bytes"] / 1e6 for s in steps], "o-", label="RSS (MB)")
        ax.axhline(150, color="g", ls="--", lw=0.8, label="goal 150 MB")
        ax.set_ylim(bottom=0)
        ax.set_xscale("log")
        ax.set_xlabel("live shaped flows")
        ax.set_ylabel("MB")
        ax2 = ax.twinx()
        ax2.plot(xs, [s["scrape_s"]["p50"] for s in steps], "s--", color="C3", label="scrape (s)")
        ax2.plot(xs, [s["status_call_s"] for s in steps], "^:", color="C2", label="status call (s)")
        ax2.set_ylabel("s")
        ax2.set_ylim(bottom=0)
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper left")
        out.append(savefig(fig, "daemon_scale.png"))
    msteps = {s["flows"]: s for s in g(b, "daemon_mixed", "steps", default=[]) or []}
    if steps and msteps:
        rows = []
        for s in steps:
            m = msteps.get(s["flows"])
            if m:
                rows.append([f"{s['flows']:,}".replace(",", " "), num(s["open_to_all_shaped_s"], "s", 2),
                             num(m["open_to_all_shaped_s"], "s", 2), num(s["rss_bytes"] / 1e6, "MB"),
                             num(m["rss_bytes"] / 1e6, "MB"), num(s["status_call_s"], "s", 3),
                             num(m["status_call_s"], "s", 3), num(s["scrape_s"]["p50"], "s", 3),
                             num(m["scrape_s"]["p50"], "s", 3)])
        out.append("**Daemon at scale, IPv4 only vs half of the flows over IPv6** (the same steps, one "
                   "IPv4 and one IPv6 holder process per step):\n")
        out.append(table(["flows", "shaped in, IPv4", "half IPv6", "RSS, IPv4", "half IPv6",
                          "status call, IPv4", "half IPv6", "scrape, IPv4", "half IPv6"], rows))
    return "\n".join(out)


def report_goals() -> List[Goal]:
    ms = lambda v: num(v, "ms/flow", 3)
    return [
        Goal(1, 2, "install 1 000 flows (class + filter, one plan) <= 0.3 ms per flow", "backend", "backend",
             lambda R: g(R.fig("backend"), "install", "batched_add_ms_per_flow"), lambda v: v <= 0.3, ms),
        Goal(2, 2, "remove 1 000 flows <= 0.3 ms per flow", "backend", "backend",
             lambda R: g(R.fig("backend"), "install", "batched_remove_ms_per_flow"), lambda v: v <= 0.3, ms),
        Goal(4, 2, "daemon RSS with 10 000 flows <= 150 MB", "backend", "backend",
             lambda R: g(_daemon_step(R, 10_000), "rss_bytes"), lambda v: v <= 150e6,
             lambda v: num(v / 1e6, "MB")),
        Goal(21, 5, "scrape of 10 000 flows < 1 s", "backend", "backend",
             lambda R: g(_daemon_step(R, 10_000), "scrape_s", "p50"), lambda v: v < 1,
             lambda v: num(v, "s", 3) + " (median)"),
    ]


if __name__ == "__main__":
    sys.exit(main())

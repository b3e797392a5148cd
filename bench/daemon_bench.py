"""The daemon with its tracer under connection churn (issue 3's performance targets).

1. time-to-shape: from the accept() return in the target (the tracer's kernel timestamp) to the
   netlink ack of the flow's filter, at 200 new flows/s (goal p50 <= 1 ms, p99 <= 2 ms);
2. churn: open+close at rising rates; does the daemon keep up (no growing backlog, classes back
   to zero, tracer losses), and its CPU use (goal: >= 2000 flows/s sustained);
3. bytes that leave unshaped before the filter is in place, per flow (the default class's byte
   counter around each of 100 sequential flows whose server writes 256 KB at once).
4. ``unshaped_churn`` (issue 16): the same 256 KB replies as probes while 200 or 2 000 other
   target flows/s open and close, IPv4 and IPv6, with and without first-byte shaping: how far
   ahead of the rule's rate line each probe's bytes arrived (kernel-timestamped capture at the
   client, GSO off on the server so that a packet is one frame).
1 and 2 again as ``time_to_shape_mixed`` and ``churn_mixed`` with half of the flows over IPv6.

Writes bench/results/daemon.json (parts not run keep their previous figures unless ``--fresh``).
Run: ``.venv/bin/python -m bench.daemon_bench [--quick] [--fresh] [part ...]``.
"""
from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from typing import List

from flowpacer.kernel.backend.tc import DEFAULT_MINOR, MAJOR
from flowpacer.kernel.tc import nl
from harness.daemon import Daemon
from harness.testbed import PY, Testbed, in_netns, wait_for

from .common import RESULTS, percentiles, write
from .reportkit import Goal, ResultIndex, g, num, pyplot, savefig, share, table

RULES = """
    interface: IFACE
    backend: htb
    link_rate: 10gbit
    rules:
      - name: burst
        match: {process: fp-burst-srv, direction: inbound}
        rate: RATE
"""


def bench_daemon(tb, rate="50mbit") -> Daemon:
    """The daemon (tracer on, no metrics endpoint) with one rule for fp-burst-srv at ``rate``."""
    return Daemon(tb, None, RULES.replace("RATE", rate), "--no-metrics", verbose=False).start()


def churn(tb, rate, seconds, procs=1, mixed=False):
    """``procs`` churn clients sharing ``rate`` open+read+close per second; with ``mixed`` every
    other client connects over IPv6 (half of the flows IPv6 when ``procs`` is even)."""
    hosts = [tb.server_v6 if mixed and i % 2 else tb.server_v4 for i in range(procs)]
    ps = [tb.popen(tb.client_ns, [PY, "-m", "harness.blaster", "churn", "--host",
                                  str(h), "--port", "7100", "--rate", str(rate / procs),
                                  "--seconds", str(seconds)], stdout=subprocess.PIPE, text=True)
          for h in hosts]
    outs = [json.loads(p.communicate(timeout=seconds + 60)[0].splitlines()[-1]) for p in ps]
    res = {"flows": sum(o["flows"] for o in outs), "errors": sum(o["errors"] for o in outs),
           "rate": sum(o["rate"] for o in outs)}
    if mixed:
        res["ipv6_flows"] = sum(o["flows"] for h, o in zip(hosts, outs) if h == tb.server_v6)
    return res


def time_to_shape(tb, seconds=5, mixed=False) -> dict:
    """200 new flows/s from 2 client processes (with ``mixed``: one of them over IPv6)."""
    tb.popen(tb.server_ns, [PY, "-m", "harness.blaster", "burst-serve", "--port", "7100",
                            "--bytes", "65536"])
    tb.wait_listening(7100)
    d = bench_daemon(tb)
    try:
        c = churn(tb, 200, seconds, procs=2, mixed=mixed)
        wait_for(lambda: d.status()["shaped_flows"] == 0, 30, 0.2, "all classes gone")
        st = d.status()
    finally:
        d.stop()
    return {"offered_flows_per_s": 200, "client_procs": 2, "ipv6_share": 0.5 if mixed else 0.0,
            "client": c,
            "time_to_shape_us": st["counters"]["shape_latency_us"],
            "apply_us": st["counters"]["apply_latency_us"],
            "tracer": {k: st["tracer"][k] for k in ("lost", "unattributed", "missed")}}


def churn_ceiling(tb, rates=(500, 1000, 2000, 3000, 4000), seconds=5, mixed=False) -> dict:
    """Rising open+close rates from 2 client processes (with ``mixed``: one over IPv6)."""
    tb.popen(tb.server_ns, [PY, "-m", "harness.blaster", "burst-serve", "--port", "7100"])
    tb.wait_listening(7100)
    d = bench_daemon(tb)
    steps = []
    try:
        for rate in rates:
            st0 = d.status()
            cpu0, t0 = d.cpu_s(), time.monotonic()
            c = churn(tb, rate, seconds, procs=2, mixed=mixed)
            t_end = time.monotonic()
            wait_for(lambda: d.status()["shaped_flows"] == 0, 60, 0.1, "the daemon to drain")
            lag = time.monotonic() - t_end
            st1 = d.status()
            cpu = (d.cpu_s() - cpu0) / (time.monotonic() - t0)
            ev0, ev1 = st0["counters"]["events"], st1["counters"]["events"]
            steps.append({
                "offered_per_s": rate, "achieved_per_s": c["rate"], "client_errors": c["errors"],
                "tracer_opens": ev1["tracer_open"] - ev0["tracer_open"],
                "tracer_closes": ev1["tracer_close"] - ev0["tracer_close"],
                "reconcile_fixes": (ev1["reconcile_open"] + ev1["reconcile_close"]
                                    - ev0["reconcile_open"] - ev0["reconcile_close"]),
                "lost_events": st1["tracer"]["lost"] - st0["tracer"]["lost"],
                "drain_after_s": lag, "daemon_cpu_share": cpu,
                "op_errors": st1["counters"]["op_errors"] - st0["counters"]["op_errors"]})
            print(json.dumps(steps[-1]), flush=True)
    finally:
        d.stop()
    ok = [s["achieved_per_s"] for s in steps if s["drain_after_s"] < 2 and s["lost_events"] == 0]
    return {"steps": steps, "sustained_flows_per_s": max(ok) if ok else 0,
            "ipv6_share": 0.5 if mixed else 0.0}


def unshaped_bytes(tb, n=100) -> dict:
    tb.popen(tb.server_ns, [PY, "-m", "harness.blaster", "burst-serve", "--port", "7100",
                            "--bytes", str(256 * 1024)])
    tb.popen(tb.server_ns, [PY, "-m", "harness.blaster", "burst-serve", "--port", "7101",
                            "--name", "fp-other-srv"])
    tb.wait_listening(7100)
    tb.wait_listening(7101)
    d = bench_daemon(tb, rate="20mbit")
    with in_netns(tb.server_ns):
        rtnl = nl.RtnlSocket()
        ifindex = socket.if_nametoindex(tb.server_if)

    def default_bytes():
        for attempt in range(20):   # a dump the daemon's class changes interrupt is asked again
            try:
                for mtype, body in rtnl.dump(nl.RTM_GETTCLASS, nl.tcmsg(ifindex)):
                    obj = nl.parse_tcmsg(mtype, body)
                    if obj.handle == nl.tc_handle(MAJOR, DEFAULT_MINOR):
                        return nl.parse_stats2(obj)["bytes"]
                return 0
            except nl.NetlinkError as e:
                if attempt == 19 or "busy" not in str(e):
                    raise
        return 0

    def one(port):
        before = default_bytes()
        with in_netns(tb.client_ns):
            c = socket.create_connection((str(tb.server_v4), port), timeout=10)
        got = 0
        while True:
            b = c.recv(1 << 16)
            if not b:
                break
            got += len(b)
        c.close()
        wait_for(lambda: d.status()["shaped_flows"] == 0, 10, 0.01, "class gone")
        return default_bytes() - before, got

    try:
        control = [one(7101)[0] for _ in range(10)]     # unmatched, no payload: control packets
        base = sorted(control)[len(control) // 2]
        per_flow = []
        for _ in range(n):
            delta, got = one(7100)
            assert got == 256 * 1024
            per_flow.append(max(0, delta - base))
    finally:
        rtnl.close()
        d.stop()
    return {"flows": n, "payload_bytes": 256 * 1024, "control_packets_bytes": base,
            "unshaped_bytes": percentiles(per_flow),
            "flows_with_any_unshaped_payload": sum(1 for x in per_flow if x > 0)}


def unshaped_churn(tb, probes=20, rates=(200, 2000)) -> dict:
    """Issue 16: bytes of each probe's 256 KB reply ahead of its 20 Mbit/s rate line, while
    ``rate`` other target flows/s churn, per family, with first-byte shaping off ("before",
    FLOWPACER_NO_FIRST_BYTE) and on ("after"). A flow paced from its first byte is ahead by
    its class's burst (htb: 2 ms at the rate, 5000 B) plus about one packet."""
    import os
    import threading
    from flowpacer.kernel.backend.htb import burst_for
    from harness.headcapture import HeadCapture
    rate_bps = 20_000_000 // 8
    tb.set_gso(False)
    tb.popen(tb.server_ns, [PY, "-m", "harness.blaster", "burst-serve", "--port", "7100"])
    tb.popen(tb.server_ns, [PY, "-m", "harness.blaster", "burst-serve", "--port", "7102",
                            "--bytes", str(256 * 1024)])
    tb.wait_listening(7100)
    tb.wait_listening(7102)
    out = {"probe_payload_bytes": 256 * 1024, "rate_bps": rate_bps,
           "class_burst_bytes": burst_for(rate_bps), "probes_per_case": probes}
    for mode in ("before", "after"):
        if mode == "before":
            os.environ["FLOWPACER_NO_FIRST_BYTE"] = "1"
        try:
            d = bench_daemon(tb, rate="20mbit")
        finally:
            os.environ.pop("FLOWPACER_NO_FIRST_BYTE", None)
        try:
            src = d.status()["flow_source"]
            assert ("first byte" in src) == (mode == "after"), src
            for rate in rates:
                for fam in (4, 6):
                    host = tb.server_v4 if fam == 4 else tb.server_v6
                    res = {}
                    bg = threading.Thread(target=lambda: res.update(
                        churn(tb, rate, 3 + probes * 0.25, procs=2, mixed=fam == 6)))
                    fb0 = (d.status().get("first_byte") or {}).get("counters", {})
                    bg.start()
                    time.sleep(1.0)         # the churn is under way
                    ahead = []
                    with HeadCapture(tb, 7102) as cap:
                        for _ in range(probes):
                            with in_netns(tb.client_ns):
                                c = socket.create_connection((str(host), 7102), timeout=10)
                            cport = c.getsockname()[1]
                            got = 0
                            while True:
                                b = c.recv(1 << 16)
                                if not b:
                                    break
                                got += len(b)
                            c.close()
                            a, seen = cap.ahead_bytes(cport, rate_bps)
                            if seen == got == 256 * 1024:
                                ahead.append(a)
                    bg.join(timeout=120)
                    case = {"ahead_bytes": percentiles(ahead, (50, 99)),
                            "background": res, "probes_measured": len(ahead)}
                    fb1 = (d.status().get("first_byte") or {}).get("counters", {})
                    if fb1:     # what the pools did meanwhile (exhausted: a claim found none)
                        case["first_byte"] = {k: fb1[k] - fb0.get(k, 0) for k in
                                              ("claimed", "exhausted", "refilled", "unattributed",
                                               "lost")}
                    out.setdefault(mode, {})[f"{rate}_per_s_ipv{fam}"] = case
                    print(json.dumps({mode: {f"{rate}_per_s_ipv{fam}": case}}), flush=True)
                    wait_for(lambda: d.status()["shaped_flows"] == 0, 60, 0.1, "drained")
        finally:
            d.stop()
    return out


# *_mixed: the same with half of the flows over IPv6 (issue 12), reported beside IPv4 only
PARTS = {"time_to_shape": "dbn1", "churn": "dbn2", "unshaped": "dbn3",
         "unshaped_churn": "dbn6",
         "time_to_shape_mixed": "dbn4", "churn_mixed": "dbn5"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("parts", nargs="*", help=f"of {', '.join(PARTS)} (default: all)")
    ap.add_argument("--quick", action="store_true", help="shorter runs (a smoke run)")
    ap.add_argument("--fresh", action="store_true", help="do not keep figures of parts not run")
    args = ap.parse_args(argv)
    names = args.parts or list(PARTS)
    for n in names:
        if n not in PARTS:
            ap.error(f"unknown part {n!r}")
    prev = RESULTS / "daemon.json"
    figures = json.loads(prev.read_text()).get("figures", {}) if prev.exists() and not args.fresh else {}
    for name in names:
        with Testbed(tag=PARTS[name]) as tb:
            mixed = name.endswith("_mixed")
            if name.startswith("time_to_shape"):
                figures[name] = time_to_shape(tb, 3 if args.quick else 5, mixed)
            elif name == "unshaped_churn":
                figures[name] = unshaped_churn(tb, 10 if args.quick else 20)
            elif name.startswith("churn"):
                figures[name] = churn_ceiling(tb, (500, 2000, 4000) if args.quick else
                                              (500, 1000, 2000, 3000, 4000), 3 if args.quick else 5,
                                              mixed)
            else:
                figures[name] = unshaped_bytes(tb, 30 if args.quick else 100)
        print(json.dumps({name: figures[name]}, indent=2), flush=True)
    goals = {}
    if "time_to_shape" in figures:
        t = figures["time_to_shape"]["time_to_shape_us"]
        goals["time_to_shape_p50<=1ms"] = t.get("p50", 1e9) <= 1000
        goals["time_to_shape_p99<=2ms"] = t.get("p99", 1e9) <= 2000
    if "churn" in figures:
        goals["churn>=2000_per_s"] = figures["churn"]["sustained_flows_per_s"] >= 2000
    write("daemon", figures, goals)
    print(json.dumps(goals, indent=2))
    return 0


# ============================================================== report
# This benchmark's part of bench/REPORT.md (bench/report.py puts it in its chapter) and its goals.

def report_section(R: ResultIndex) -> str:
    """Time-to-shape, churn and unshaped bytes (chapter 4; backend_bench's install cost and
    scale follow)."""
    plt = pyplot()
    d = R.fig("daemon")
    out = ["Time-to-shape, churn and unshaped bytes: " + R.provenance("daemon", "daemon") + "\n"]
    tts = g(d, "time_to_shape", "time_to_shape_us")
    if tts:
        ap = g(d, "time_to_shape", "apply_us") or {}
        out.append(f"**Time-to-shape** (accept() return in the target, as the tracer stamps it, to the netlink "
                   f"ack of the flow's filter) at {g(d, 'time_to_shape', 'offered_flows_per_s')} new flows/s, "
                   f"{tts.get('n')} flows (the daemon keeps percentiles of its last 4 096 samples):\n")
        rows = [["time-to-shape", *(num(tts.get(k, 0) / 1000, "ms", 2) for k in ("p50", "p90", "p99", "max"))],
                ["of which the netlink apply", *(num(ap.get(k, 0) / 1000, "ms", 2) for k in ("p50", "p90", "p99", "max"))]]
        mx = g(d, "time_to_shape_mixed", "time_to_shape_us")
        if mx:      # the same with half of the flows over IPv6 (issue 12)
            mxa = g(d, "time_to_shape_mixed", "apply_us") or {}
            rows += [["time-to-shape, half IPv6", *(num(mx.get(k, 0) / 1000, "ms", 2) for k in ("p50", "p90", "p99", "max"))],
                     ["of which the netlink apply, half IPv6",
                      *(num(mxa.get(k, 0) / 1000, "ms", 2) for k in ("p50", "p90", "p99", "max"))]]
        out.append(table(["", "p50", "p90", "p99", "max"], rows))
        ks = ("p50", "p90", "p99", "max")
        fig, ax = plt.subplots(figsize=(6, 3))
        xs = range(len(ks))
        ax.bar([x - 0.2 for x in xs], [tts.get(k, 0) / 1000 for k in ks], 0.4, label="time-to-shape")
        ax.bar([x + 0.2 for x in xs], [ap.get(k, 0) / 1000 for k in ks], 0.4, label="netlink apply")
        ax.hlines([1, 2], [-0.5, 1.5], [0.5, 2.5], colors="g", linestyles="--", lw=1, label="goals (p50 1 ms, p99 2 ms)")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(ks)
        ax.set_ylabel("ms")
        ax.legend(fontsize=8)
        out.append(savefig(fig, "time_to_shape.png"))
    steps = g(d, "churn", "steps")
    if steps:
        out.append("**Churn** (open + read + close, 2 client processes; a step counts as kept up when the "
                   "classes drain within 2 s of its end and no tracer event is lost):\n")
        out.append(table(["offered /s", "achieved /s", "daemon CPU", "drain after", "lost events", "op errors"],
                         [[s["offered_per_s"], num(s["achieved_per_s"], "", 0), share(s["daemon_cpu_share"], 0),
                           num(s["drain_after_s"], "s", 2), s["lost_events"], s["op_errors"]] for s in steps]))
        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.plot([s["offered_per_s"] for s in steps], [s["achieved_per_s"] for s in steps], "o-", label="achieved")
        ax.plot([s["offered_per_s"] for s in steps], [s["offered_per_s"] for s in steps], "k:", lw=0.8)
        ax.axhline(2000, color="g", ls="--", lw=0.8, label="goal 2000/s")
        ax2 = ax.twinx()
        ax2.bar([s["offered_per_s"] for s in steps], [100 * s["daemon_cpu_share"] for s in steps], width=150,
                alpha=0.25, color="C1", label="daemon CPU %")
        ax2.set_ylabel("daemon CPU (% of one core)")
        ax.set_xlabel("offered open+close per s")
        ax.set_ylabel("achieved per s")
        ax.legend(loc="upper left", fontsize=8)
        out.append(savefig(fig, "daemon_churn.png"))
    mixed = g(d, "churn_mixed", "steps")
    if mixed:
        out.append("**Churn with half of the flows over IPv6** (the same, one of the two client processes "
                   f"connecting over IPv6; sustained {g(d, 'churn_mixed', 'sustained_flows_per_s') or 0:.0f}/s, "
                   f"IPv4 only {g(d, 'churn', 'sustained_flows_per_s') or 0:.0f}/s):\n")
        out.append(table(["offered /s", "achieved /s", "daemon CPU", "drain after", "lost events", "op errors"],
                         [[s["offered_per_s"], num(s["achieved_per_s"], "", 0), share(s["daemon_cpu_share"], 0),
                           num(s["drain_after_s"], "s", 2), s["lost_events"], s["op_errors"]] for s in mixed]))
    un = g(d, "unshaped")
    if un:
        u = un["unshaped_bytes"]
        out.append(f"**Unshaped bytes per flow** (a server that writes {un['payload_bytes'] // 1024} KiB at once "
                   f"right after accept(); bytes through the default class before the flow's filter was in, "
                   f"{un['flows']} flows): p50 {num(u['p50'] / 1024, 'KiB')}, p90 {num(u['p90'] / 1024, 'KiB')}, "
                   f"max {num(u['max'] / 1024, 'KiB')}; {un['flows_with_any_unshaped_payload']} of {un['flows']} flows "
                   f"sent some payload unshaped.\n")
    return "\n".join(out)


def report_goals() -> List[Goal]:
    ms = lambda v: num(v, "ms/flow", 3)
    return [
        Goal(5, 3, "time-to-shape p50 <= 1 ms at 200 new flows/s", "daemon", "daemon",
             lambda R: g(R.fig("daemon"), "time_to_shape", "time_to_shape_us", "p50"), lambda v: v <= 1000,
             lambda v: num(v / 1000, "ms", 2)),
        Goal(6, 3, "time-to-shape p99 <= 2 ms at 200 new flows/s", "daemon", "daemon",
             lambda R: g(R.fig("daemon"), "time_to_shape", "time_to_shape_us", "p99"), lambda v: v <= 2000,
             lambda v: num(v / 1000, "ms", 2)),
        Goal(7, 3, "churn >= 2000 open+close/s sustained", "daemon", "daemon",
             lambda R: g(R.fig("daemon"), "churn", "sustained_flows_per_s"), lambda v: v >= 2000,
             lambda v: num(v, "flows/s", 0) + (" (highest step offered)" if v >= 3900 else "")),
        Goal(8, 3, "unshaped bytes per flow (report)", "daemon", "daemon",
             lambda R: g(R.fig("daemon"), "unshaped", "unshaped_bytes"), None,
             lambda v: f"p50 {num(v['p50'] / 1024, 'KiB')}, p90 {num(v['p90'] / 1024, 'KiB')} (frame bytes) of a 256 KiB reply"),
    ]


if __name__ == "__main__":
    sys.exit(main())

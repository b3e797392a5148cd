"""Where per-flow pacing pays (issue 30): many clients behind their own access links, the same
downloads through each server-side setup, in the VM's virtual time.

``harness.access``: one server, N clients (default 20), each behind an access link (tbf at the
router toward it) of a rate from ``RATES_MBIT``, a queue that is shallow (24 KiB) or deep
(250 ms of the rate), and a round trip from ``RTTS_MS`` (netem on the client's ACK path); every
link carries a household UDP flow (200-byte datagrams every 20 ms from a second sender) whose
one-way delay above its minimum is the delay the access queue adds. Each client downloads over
TCP with iperf3 -R (every third client over IPv6, the others IPv4, IPv4-mapped on the server's
dual-stack socket) from a server port of its own; "the rule's rate" of client i is
``RULE_SHARE`` x its access rate.

Setups, one after another on the same topology (the server's qdisc and congestion control):
``unshaped`` (fq_codel, CUBIC), ``fq_cubic``, ``fq_bbr``, ``fq_maxrate`` (fq, CUBIC,
SO_MAX_PACING_RATE at the rule's rate: iperf3 --fq-rate), ``flowpacer_htb`` and ``flowpacer_psp``
(the daemon, ``--no-tracer``, one rule per client's port). nginx ``limit_rate`` is not measured.

Per client and setup, over the window from ``--skip`` s to the end: goodput, its worst second,
the server's retransmits, drops at the access link (tbf counters), the household flow's added
delay p50/p99, jitter and loss; per setup Jain's index of goodput/rule rate.

Writes bench/results/access.json. Run: ``.venv/bin/python -m bench.access_bench [--quick]``
(``python -m bench.run access``).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

from .reportkit import ResultIndex, num, table

log = logging.getLogger("bench.access_bench")

RATES_MBIT = (4, 6, 8, 12, 25)
RTTS_MS = (10, 20, 40, 80, 100)
SHALLOW_BYTES = 24 * 1024
DEEP_MS = 250
RULE_SHARE = 0.8
BASE_PORT = 5700
SETUPS = ("unshaped", "fq_cubic", "fq_bbr", "fq_maxrate", "flowpacer_htb", "flowpacer_psp")


def links(n: int):
    from harness.access import LinkSpec, deep_buffer
    from harness.pacing import mbit
    out = []
    for i in range(n):
        rate = mbit(RATES_MBIT[i % len(RATES_MBIT)])
        buf = SHALLOW_BYTES if (i // len(RATES_MBIT)) % 2 == 0 else deep_buffer(rate, DEEP_MS)
        out.append(LinkSpec(rate, buf, RTTS_MS[(i * 2 + i // len(RATES_MBIT)) % len(RTTS_MS)], True))
    return out


def rules_text(net) -> str:
    lines = ["interface: IFACE", "backend: BACKEND", "link_rate: 1gbit", "rules:"]
    for c in net.clients:
        lines += [f"  - name: client{c.index}",
                  f"    match: {{process: iperf3, direction: inbound, local_port: {BASE_PORT + c.index}}}",
                  f"    rate: {round(c.spec.rate_bps * 8 * RULE_SHARE)}bit"]
    return "\n".join(lines) + "\n"


def cpu_times() -> tuple:
    """(busy, total) jiffies of the (guest's one) CPU from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return sum(v) - idle, sum(v)


def run_setup(net, setup: str, seconds: int, skip: float, workdir: Path) -> dict:
    from harness.access import (Download, Household, counters_delta, download_figures,
                                finish_downloads, jain, start_downloads)
    from harness.daemon import Daemon
    from harness.pacing import guest_timeout, wait_for
    extra: Dict[int, list] = {c.index: [] for c in net.clients}
    daemon = None
    if setup == "unshaped":
        net.server_qdisc("fq_codel")
    elif setup.startswith("fq_"):
        net.server_qdisc("fq")
        for c in net.clients:
            if setup == "fq_bbr":
                extra[c.index] = ["-C", "bbr"]
            elif setup == "fq_maxrate":
                extra[c.index] = ["--fq-rate", str(round(c.spec.rate_bps * 8 * RULE_SHARE))]
    else:
        net.clear_server_qdisc()
        backend = setup.split("_", 1)[1]
        (workdir / setup).mkdir(parents=True, exist_ok=True)
        daemon = Daemon(net, workdir / setup, rules_text(net), "--no-tracer", "--no-metrics",
                        "--rescan", "0.2", backend=backend).start(timeout=guest_timeout(90))
    downloads = [Download(c, BASE_PORT + c.index, v6=(c.index % 3 == 2), extra=extra[c.index])
                 for c in net.clients]
    try:
        with Household(net, net.clients, v6={c.index for c in net.clients if c.index % 3 == 2}) as hh:
            t_start = time.time_ns()
            procs = start_downloads(net, downloads, seconds)
            n_start = len(hh.flows[0].sent)
            wait_for(lambda: len(hh.flows[0].sent) >= n_start + int(skip / 0.02), skip + 30,
                     "the warm-up")
            t0, c0, cpu0 = time.time_ns(), net.counters(), cpu_times()
            docs = finish_downloads(procs, guest_timeout(seconds + 120))
            t1, c1, cpu1 = time.time_ns(), net.counters(), cpu_times()
            hh.stop()
            shaped = daemon.status()["shaped_flows"] if daemon else None
    finally:
        rc = daemon.stop() if daemon else 0
    drops = counters_delta(c0, c1)
    udp = hh.figures(t0, t1)
    clients = []
    for c, d, doc in zip(net.clients, downloads, docs):
        tcp = download_figures(doc, skip_s=skip)
        rule = c.spec.rate_bps * RULE_SHARE
        clients.append({"client": c.index, "rate_bit_s": c.spec.rate_bps * 8,
                        "buffer_bytes": c.spec.buffer_bytes, "shallow": c.spec.shallow,
                        "rtt_ms": c.spec.rtt_ms, "v6": d.v6, "rule_bit_s": round(rule * 8),
                        "goodput_bit_s": tcp["goodput_bps"] * 8,
                        "worst_second_bit_s": tcp["worst_second_bps"] * 8,
                        "retransmits": tcp["retransmits"],
                        "per_second_bit_s": [x * 8 for x in tcp["per_second_bps"]],
                        "access_drops": drops[c.index]["drops"],
                        "access_packets": drops[c.index]["packets"],
                        "udp": udp[c.index]})
    out = {"setup": setup, "clients": clients, "window_s": round((t1 - t0) / 1e9, 2),
           "started_s": round((t0 - t_start) / 1e9, 2), "daemon_rc": rc, "shaped_flows": shaped,
           # the whole guest (server, router, clients: one vCPU): near 1 means CPU-bound figures
           "guest_cpu_busy": round((cpu1[0] - cpu0[0]) / max(1, cpu1[1] - cpu0[1]), 3),
           "jain_goodput_per_rule": jain([x["goodput_bit_s"] / x["rule_bit_s"] for x in clients]),
           "jain_goodput_per_access": jain([x["goodput_bit_s"] / x["rate_bit_s"] for x in clients])}
    log.info("%s: drops %d, udp p99 max %.2f ms, jain %.3f", setup,
             sum(x["access_drops"] for x in clients),
             max((x["udp"]["p99_ms"] or 0) for x in clients), out["jain_goodput_per_rule"] or 0)
    return out


def guest(args) -> int:
    from harness import psplib
    from harness.access import AccessNet
    from harness.pacing import modprobe
    from harness.servers import iperf3_server
    from .vm_sharing import guest_progress, guest_result
    psplib.ensure_loaded()
    modprobe("sch_fq", "sch_fq_codel", "tcp_bbr")
    runs: List[dict] = []
    # the guest's own /tmp: the daemon's control socket cannot be bound on the 9p share
    workdir = Path(tempfile.mkdtemp(prefix="fp-access-"))
    spec = links(args.clients)
    with psplib.rmem_max(psplib.BIG_RMEM_MAX), AccessNet(spec) as net:
        for s in args.setups.split(","):
            # fresh servers for every setup: an iperf3 server keeps a client's -C for later tests
            servers = [iperf3_server(net, BASE_PORT + c.index) for c in net.clients]
            runs.append(run_setup(net, s, args.seconds, args.skip, workdir))
            for p in servers:
                p.terminate()
                p.wait(timeout=10)
            guest_progress(args.out, runs=runs)
    return guest_result(args.out, runs=runs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="5 clients, 6 s per setup")
    ap.add_argument("--clients", type=int, default=None, help="number of clients (20; quick 5)")
    ap.add_argument("--seconds", type=int, default=None, help="seconds per setup (10; quick 6)")
    ap.add_argument("--skip", type=float, default=3.0, help="seconds left out at the start")
    ap.add_argument("--setups", default=",".join(SETUPS))
    ap.add_argument("--merge", action="store_true",
                    help="keep the other setups' runs of the existing result (from an earlier boot)")
    ap.add_argument("--guest", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.clients = args.clients or (5 if args.quick else 20)
    args.seconds = args.seconds or (6 if args.quick else 10)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.guest:
        return guest(args)
    if os.geteuid() != 0:
        print("access_bench: needs root", file=sys.stderr)
        return 2
    from .common import write
    from .vm_sharing import vm_bench
    fig = {"setup": {"clients": args.clients, "seconds_per_setup": args.seconds,
                     "skip_s": args.skip, "rates_mbit": list(RATES_MBIT), "rtts_ms": list(RTTS_MS),
                     "shallow_bytes": SHALLOW_BYTES, "deep_ms": DEEP_MS, "rule_share": RULE_SHARE,
                     "household": "200-byte UDP datagrams every 20 ms on every link",
                     "setups": args.setups.split(",")}}
    t0 = time.monotonic()
    n = len(fig["setup"]["setups"])
    rc = vm_bench(fig, "bench.access_bench",
                  ["--clients", str(args.clients), "--seconds", str(args.seconds), "--skip",
                   str(args.skip), "--setups", args.setups],
                  budget=240 + n * (args.seconds + 20) * max(1, args.clients / 5) * 4)
    fig["duration_s"] = round(time.monotonic() - t0, 1)
    for r in fig.get("runs", []):
        r["boot"] = 1
    if args.merge:
        import json
        from .common import RESULTS
        try:
            old = json.loads((RESULTS / "access.json").read_text())["figures"]
        except (OSError, ValueError, KeyError):
            old = {}
        mine = {r["setup"] for r in fig.get("runs", [])}
        kept = [dict(r, boot=r.get("boot", 0)) for r in old.get("runs", []) if r["setup"] not in mine]
        fig["runs"] = kept + fig.get("runs", [])
        fig["earlier_boot"] = {k: old.get(k) for k in ("vm", "incomplete", "duration_s", "setup")}
        if old.get("not_measured"):
            fig["not_measured"] = {k: v for k, v in old["not_measured"].items() if k not in mine}
    path = write("access", fig, {})
    print(f"wrote {path}", file=sys.stderr)
    return rc


# ============================================================== report

def summary(run: dict) -> dict:
    cs = run["clients"]
    p99 = [x["udp"]["p99_ms"] for x in cs if x["udp"].get("p99_ms") is not None]
    p50 = [x["udp"]["p50_ms"] for x in cs if x["udp"].get("p50_ms") is not None]
    return {"drops": sum(x["access_drops"] for x in cs),
            "links_with_drops": sum(1 for x in cs if x["access_drops"]),
            "retransmits": sum(x["retransmits"] or 0 for x in cs),
            "udp_p50_median": sorted(p50)[len(p50) // 2] if p50 else None,
            "udp_p99_max": max(p99) if p99 else None,
            "udp_loss_max": max((x["udp"].get("loss") or 0) for x in cs),
            "goodput_per_rule_min": min(x["goodput_bit_s"] / x["rule_bit_s"] for x in cs),
            "worst_second_per_rule_min": min(x["worst_second_bit_s"] / x["rule_bit_s"] for x in cs),
            "goodput_total_bit_s": sum(x["goodput_bit_s"] for x in cs),
            "jain": run.get("jain_goodput_per_rule")}


def report_section(R: ResultIndex) -> str:
    """Issue 30 (a chapter of its own, only when there is a result)."""
    f = R.fig("access")
    if not f:
        return ""
    out = ["## Where per-flow pacing pays: clients behind access links (`bench/access_bench.py`, "
           "issue 30)\n", R.provenance("access", "access") + "\n"]
    s = f.get("setup", {})
    out.append(f"In the VM (virtual time): {s.get('clients')} clients, each behind its own access "
               f"link (tbf at {', '.join(map(str, s.get('rates_mbit', [])))} Mbit/s; queue "
               f"{num(s.get('shallow_bytes', 0) / 1024, 'KiB')} or {s.get('deep_ms')} ms of the rate; "
               f"RTT {', '.join(map(str, s.get('rtts_ms', [])))} ms by netem), one iperf3 -R download "
               f"each, {s.get('household')}; the rule's rate is {num(s.get('rule_share'))} x the "
               f"access rate; {s.get('seconds_per_setup')} s per setup, the first "
               f"{s.get('skip_s')} s left out. Added delay: the household flow's one-way delay above "
               f"its minimum. The send time is stamped in user space by the household sender, in "
               f"the same one-vCPU guest: below a few ms the figure includes the sender's own "
               f"scheduling delay, which grows with the guest's CPU load (last column).\n")
    if f.get("unavailable") or f.get("failed"):
        out.append(f"**Could not run here:** {(f.get('unavailable') or f.get('failed'))[-500:]}\n")
    if f.get("incomplete"):
        out.append(f"**Incomplete run:** {f['incomplete'].splitlines()[0][:200]}\n")
    if f.get("earlier_boot"):
        eb = f["earlier_boot"] or {}
        why = eb.get("note") or (eb.get("incomplete") or "").splitlines()[0][:160]
        out.append("Setups marked (boot 0) come from an earlier VM boot with the same topology and "
                   "arguments (virtual time: the figures do not depend on the host's load)"
                   + (f"; {why}" if why else "") + ".\n")
    for k, why in (f.get("not_measured") or {}).items():
        out.append(f"**Not measured: {k}** ({why}).\n")
    rows = []
    for run in f.get("runs", []):
        m = summary(run)
        rows.append([run["setup"] + (" (boot 0)" if run.get("boot") == 0 else ""),
                     f"{m['goodput_total_bit_s'] / 1e6:.1f}",
                     f"{m['goodput_per_rule_min']:.2f}", f"{m['worst_second_per_rule_min']:.2f}",
                     f"{m['drops']} ({m['links_with_drops']})", str(m["retransmits"]),
                     num(m["udp_p50_median"], "ms", 2), num(m["udp_p99_max"], "ms", 2),
                     f"{100 * m['udp_loss_max']:.1f} %", num(m["jain"], "", 3),
                     f"{100 * run.get('guest_cpu_busy', 0):.0f} %"])
    if rows:
        out.append(table(["setup", "goodput, all (Mbit/s)", "min goodput / rule",
                          "min worst second / rule", "access drops (links)", "retransmits",
                          "UDP added delay p50 (median link)", "UDP added delay p99 (worst link)",
                          "UDP loss (worst link)", "Jain (goodput / rule)", "guest CPU busy"], rows))
        rows = []
        for run in f.get("runs", []):
            for kind, shallow in (("shallow", True), ("deep", False)):
                cs = [x for x in run["clients"] if x["shallow"] == shallow]
                if not cs:
                    continue
                p99 = sorted(x["udp"]["p99_ms"] for x in cs if x["udp"].get("p99_ms") is not None)
                rows.append([run["setup"], f"{kind} ({len(cs)})",
                             f"{sum(x['access_drops'] for x in cs)} "
                             f"({sum(1 for x in cs if x['access_drops'])})",
                             num(p99[len(p99) // 2] if p99 else None, "ms", 2),
                             num(p99[-1] if p99 else None, "ms", 2),
                             f"{min(x['goodput_bit_s'] / x['rule_bit_s'] for x in cs):.2f}",
                             f"{min(x['goodput_bit_s'] / x['rate_bit_s'] for x in cs):.2f}"])
        out.append("By access queue:\n")
        out.append(table(["setup", "links", "access drops (links)", "UDP p99 (median link)",
                          "UDP p99 (worst link)", "min goodput / rule",
                          "min goodput / access rate"], rows))
        out.append("Per client figures (goodput per second, drops, delays) are in "
                   "bench/results/access.json.\n")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())

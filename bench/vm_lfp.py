"""TCP over a long fat pipe with a small bottleneck buffer: paced vs unpaced (issue 6, seed 003).

Inside the VM (netem is a module of the guest's 6.1 kernel, not of the host's), one testbed:

    sender (server ns)                          receiver (client ns)
    veth egress: the pacer under test  ==>  veth ingress -> mirred -> ifb: tbf (the bottleneck:
                                                  --bottleneck-mbit, a --buffer-kb queue)
                                        <==  veth egress: netem delay RTT (the ACK path)

so every packet crosses the small bottleneck queue once and the round trip is the netem delay.
Pacers: ``psp`` (one class per TCP flow, the flows' rates adding up to --margin of what the
bottleneck leaves), ``htb`` (flowpacer's htb layout, same rates) and ``none`` (no qdisc: CUBIC sends
its windows at the veth's speed; Linux paces TCP itself only under fq or BBR). Traffic mixes:
one TCP flow, two TCP flows, one TCP flow plus a --udp-mbit UDP stream (iperf3 -u, unpaced: the
default class). Figures per case: TCP goodput at the receiver (whole run and the second half),
TCP retransmits, drops at the bottleneck (loss), the UDP stream's loss and jitter (iperf3's
RFC 3550 estimate), how late the guest's own timers ran (the oversleep of 10 ms sleeps: a host
busy elsewhere starves the TCG vCPUs, and psp, a timer per packet, then loses more than htb;
session 3 reproduced psp at 50 ms RTT dropping from 43 to 20-26 Mbit/s with one busy loop on
the host) and, for psp, its own lateness, clamps and longest run. Cases run RTT by RTT, mix by mix, with the three pacers back to back.

Writes bench/results/vm_lfp.json. Run: ``.venv/bin/python -m bench.vm_lfp [--quick]``.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.vm_sharing import (Bed, guest_progress, guest_result, mbit, setup_htb, setup_psp,
                              vm_bench, wait_listening)
from harness import pacing

from .reportkit import COLORS, ResultIndex, g, mbit as mbit_text, num, pyplot, savefig, share, table

log = logging.getLogger("bench.vm_lfp")

TCP_PORT = 5201
UDP_PORT = 5301
LINK = mbit(1000)            # the pacers' link rate: the sender's own link is not the bottleneck
MIXES = {"tcp1": (1, False), "tcp2": (2, False), "tcp1+udp": (1, True)}
PACERS = ("none", "htb", "psp")


class Path_:
    """The bottleneck (ifb + tbf on the receiver's ingress) and the ACK delay (netem)."""

    def __init__(self, bed: Bed, bottleneck_bps: int, buffer_bytes: int):
        self.bed = bed
        self.bps = bottleneck_bps
        self.buffer = buffer_bytes
        self.ifb = f"fpifb{bed.tb.tag}"[:15]
        pacing.modprobe("ifb", "act_mirred", "sch_ingress", "sch_tbf", "cls_u32")
        r = bed.r
        r("ip", "link", "add", self.ifb, "type", "ifb")
        r("ip", "link", "set", self.ifb, "up")
        r("tc", "qdisc", "add", "dev", bed.receiver_dev, "handle", "ffff:", "ingress")
        r("tc", "filter", "add", "dev", bed.receiver_dev, "parent", "ffff:", "protocol", "all", "prio", "1",
          "u32", "match", "u32", "0", "0", "action", "mirred", "egress", "redirect", "dev", self.ifb)
        # tokens for 4 ms: the guest's timers fire up to a few ms late; the queue stays small
        self.burst = max(3028, bottleneck_bps * 4 // 1000)
        r("tc", "qdisc", "replace", "dev", self.ifb, "root", "tbf", "rate", f"{bottleneck_bps * 8}bit",
          "burst", str(self.burst), "limit", str(max(buffer_bytes, 3028)))

    def set_rtt(self, rtt_ms: float) -> None:
        if rtt_ms <= 0:
            self.bed.r("tc", "qdisc", "del", "dev", self.bed.receiver_dev, "root", check=False)
            return
        pacing.modprobe("sch_netem")
        self.bed.r("tc", "qdisc", "replace", "dev", self.bed.receiver_dev, "root", "netem", "delay",
                   f"{rtt_ms}ms", "limit", "100000")

    def counters(self) -> dict:
        out = json.loads(self.bed.r("tc", "-s", "-j", "qdisc", "show", "dev", self.ifb).stdout)
        q = next(x for x in out if x.get("kind") == "tbf")
        return {"packets": q.get("packets", 0), "drops": q.get("drops", 0), "bytes": q.get("bytes", 0)}


class TimerProbe:
    """How late the guest's own timers run during a case, whatever the pacer: a thread sleeps
    10 ms at a time and records the oversleep. A busy host starves the TCG vCPUs, and psp (a
    timer per packet) loses more of its rate then than htb (a GSO packet per token refill):
    the figure tells a quiet run from a starved one."""

    PERIOD_S = 0.01

    def __init__(self):
        self.late_ns = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="timer-probe", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic_ns()
            time.sleep(self.PERIOD_S)
            self.late_ns.append(time.monotonic_ns() - t0 - int(self.PERIOD_S * 1e9))

    def __enter__(self) -> "TimerProbe":
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join(timeout=5)

    def figures(self) -> dict:
        v = sorted(self.late_ns)
        if not v:
            return {}
        return {"samples": len(v), "mean_ms": round(statistics.fmean(v) / 1e6, 3),
                "p99_ms": round(v[min(len(v) - 1, int(0.99 * len(v)))] / 1e6, 3),
                "max_ms": round(v[-1] / 1e6, 3)}


def _psp_figures(bed: Bed) -> dict:
    """psp's own lateness, clamps and runs over the case (read before the qdisc goes)."""
    from harness import psplib
    with psplib.PspNl(bed.sender_ns) as nl:
        x = nl.root(bed.sender_dev).xstats
    return {"mean_lateness_us": round(x["late_ns_total"] / max(1, x["paced_pkts"]) / 1e3, 1),
            "worst_timer_lateness_us": round(x["timer_late_ns_max"] / 1e3, 1),
            "clamps": x["clamps"], "paced_pkts": x["paced_pkts"],
            "longest_run_pkts": x["longest_run"]}


def _iperf_json(p, timeout):
    out, err = p.communicate(timeout=timeout)
    try:
        return json.loads(out)
    except ValueError:
        return {"error": (err or out or "")[-300:]}


def run_case(bed: Bed, path: Path_, pacer: str, mix: str, seconds: int, udp_bps: int,
             margin: float) -> dict:
    n_tcp, udp = MIXES[mix]
    tcp_ports = [TCP_PORT + i for i in range(n_tcp)]
    per_flow = int((path.bps - (udp_bps * 1242 // 1200 if udp else 0)) * margin / n_tcp)
    classes = [(0x10 + i, per_flow, p) for i, p in enumerate(tcp_ports)]
    bed.clear_qdisc()
    if pacer == "psp":
        setup_psp(bed, LINK, classes)
    elif pacer == "htb":
        setup_htb(bed, LINK, classes)
    ports = tcp_ports + ([UDP_PORT] if udp else [])
    servers = [bed.popen(bed.receiver_ns, ["iperf3", "-s", "-1", "-J", "-B", bed.receiver_addr, "-p", p])
               for p in ports]
    wait_listening(bed, ports)
    c0 = path.counters()
    clients = {}
    for p in tcp_ports:
        clients[p] = bed.popen(bed.sender_ns, ["iperf3", "-c", bed.receiver_addr, "-p", p, "-t", seconds,
                                               "-J", "--get-server-output"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if udp:
        clients[UDP_PORT] = bed.popen(bed.sender_ns, ["iperf3", "-c", bed.receiver_addr, "-p", UDP_PORT,
                                                      "-u", "-b", str(udp_bps * 8), "-l", "1200",
                                                      "-t", seconds, "-J"],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with TimerProbe() as probe:
        reps = {p: _iperf_json(c, seconds + 60) for p, c in clients.items()}
    for s in servers:
        try:
            s.wait(timeout=20)
        except subprocess.TimeoutExpired:
            s.kill()
    c1 = path.counters()
    psp = _psp_figures(bed) if pacer == "psp" else None
    bed.clear_qdisc()
    flows = []
    for p in tcp_ports:
        rep = reps[p]
        if "error" in rep:
            flows.append({"port": p, "error": rep["error"]})
            continue
        srv = rep.get("server_output_json") or {}
        series = [iv["sum"]["bits_per_second"] for iv in srv.get("intervals", [])]
        half = series[len(series) // 2:]
        flows.append({"port": p, "pacer_rate_bit_s": per_flow * 8 if pacer != "none" else None,
                      "goodput_bit_s": rep["end"]["sum_received"]["bits_per_second"],
                      "goodput_second_half_bit_s": statistics.fmean(half) if half else None,
                      "retransmits": rep["end"]["sum_sent"].get("retransmits"),
                      "sent_bytes": rep["end"]["sum_sent"]["bytes"],
                      "receiver_series_bit_s": series})
    sent = c1["packets"] - c0["packets"]
    drops = c1["drops"] - c0["drops"]
    out = {"pacer": pacer, "mix": mix, "seconds": seconds, "tcp_flows": flows,
           "tcp_goodput_bit_s": sum(f.get("goodput_bit_s", 0) for f in flows),
           "tcp_goodput_second_half_bit_s": sum(f.get("goodput_second_half_bit_s") or 0 for f in flows),
           "tcp_retransmits": sum(f.get("retransmits") or 0 for f in flows),
           "bottleneck": {"packets_out": sent, "drops": drops,
                          "loss": drops / (sent + drops) if sent + drops else 0.0},
           "guest_timer_late": probe.figures()}
    if psp is not None:
        out["psp"] = psp
    if udp:
        rep = reps[UDP_PORT]
        s = rep.get("end", {}).get("sum", {})
        out["udp"] = {"rate_bit_s": udp_bps * 8, "jitter_ms": s.get("jitter_ms"),
                      "lost_percent": s.get("lost_percent"), "packets": s.get("packets"),
                      "lost_packets": s.get("lost_packets"), "error": rep.get("error")}
    return out


def calibrate(bed: Bed, path: Path_, seconds: int) -> dict:
    """What the bottleneck carries: one unpaced TCP flow, no added delay."""
    path.set_rtt(0)
    r = run_case(bed, path, "none", "tcp1", seconds, 0, 1.0)
    return {"goodput_bit_s": r["tcp_goodput_bit_s"], "loss": r["bottleneck"]["loss"]}


def run_all(rtts, mixes, pacers, bottleneck_mbit, buffer_kb, seconds, udp_mbit, margin, tag="vlfp",
            progress=None):
    from harness.testbed import Testbed
    res = {"cases": []}
    with Testbed(tag=tag) as tb:
        bed = Bed(tb)
        bed.set_gso(True)
        path = Path_(bed, mbit(bottleneck_mbit), int(buffer_kb * 1024))
        res["tbf_burst_bytes"] = path.burst
        res["calibration"] = calibrate(bed, path, min(seconds, 5))
        log.info("bottleneck carries %.1f Mbit/s (one unpaced flow, no delay)",
                 res["calibration"]["goodput_bit_s"] / 1e6)
        for rtt in rtts:
            path.set_rtt(rtt)
            for mix in mixes:
                for pacer in pacers:
                    r = run_case(bed, path, pacer, mix, seconds, mbit(udp_mbit), margin)
                    r["rtt_ms"] = rtt
                    res["cases"].append(r)
                    if progress:
                        progress(res)
                    udp = r.get("udp") or {}
                    log.info("rtt %3g ms %-8s %-4s: TCP %6.2f Mbit/s (2nd half %6.2f), loss %.2f %%, "
                             "retrans %s, guest timers late %s ms (mean)%s", rtt, mix, pacer,
                             r["tcp_goodput_bit_s"] / 1e6,
                             r["tcp_goodput_second_half_bit_s"] / 1e6, 100 * r["bottleneck"]["loss"],
                             r["tcp_retransmits"], r["guest_timer_late"].get("mean_ms"),
                             f", UDP loss {udp.get('lost_percent')} % jitter {udp.get('jitter_ms')} ms"
                             if udp else "")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="RTT 50 ms only, 6 s per case")
    ap.add_argument("--rtts", default=None, help="ms, comma separated (20,50,100; quick 50)")
    ap.add_argument("--mixes", default=",".join(MIXES))
    ap.add_argument("--pacers", default=",".join(PACERS))
    ap.add_argument("--bottleneck-mbit", type=float, default=50.0)
    ap.add_argument("--buffer-kb", type=float, default=32.0, help="the bottleneck's queue")
    ap.add_argument("--udp-mbit", type=float, default=2.0)
    ap.add_argument("--margin", type=float, default=0.95, help="paced rates: this share of the bottleneck")
    ap.add_argument("--seconds", type=int, default=None, help="per case (10; quick 6)")
    ap.add_argument("--guest", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rtts = [float(x) for x in (args.rtts or ("50" if args.quick else "20,50,100")).split(",")]
    seconds = args.seconds or (6 if args.quick else 10)
    mixes = args.mixes.split(",")
    pacers = args.pacers.split(",")
    setup = {"rtts_ms": rtts, "mixes": mixes, "pacers": pacers, "bottleneck_bit_s": args.bottleneck_mbit * 1e6,
             "buffer_bytes": int(args.buffer_kb * 1024), "udp_bit_s": args.udp_mbit * 1e6,
             "margin": args.margin, "seconds_per_case": seconds, "gso": "on",
             "delay": "netem on the receiver's egress (ACK path), the whole RTT",
             "bottleneck": "tbf on an ifb fed by the receiver's ingress (mirred)",
             "seed": "003 (TCP over a long fat pipe, PSPacer vs unpaced, + UDP 1-2 Mbit/s)"}
    if args.guest:
        return guest_result(args.out, **run_all(rtts, mixes, pacers, args.bottleneck_mbit, args.buffer_kb,
                                                 seconds, args.udp_mbit, args.margin,
                                                 progress=lambda res: guest_progress(args.out, **res)))
    if os.geteuid() != 0:
        print("vm_lfp: needs root", file=sys.stderr)
        return 2
    from .common import write
    t0 = time.monotonic()
    fig = {"setup": setup}
    budget = len(rtts) * len(mixes) * len(pacers) * (seconds + 15) + 300
    guest_args = ["--rtts", ",".join(map(str, rtts)), "--mixes", args.mixes, "--pacers", args.pacers,
                  "--bottleneck-mbit", str(args.bottleneck_mbit), "--buffer-kb", str(args.buffer_kb),
                  "--udp-mbit", str(args.udp_mbit), "--margin", str(args.margin), "--seconds", str(seconds)]
    rc = vm_bench(fig, "bench.vm_lfp", guest_args, budget, keys=("calibration", "tbf_burst_bytes", "cases"))
    fig["duration_s"] = round(time.monotonic() - t0, 1)
    path = write("vm_lfp", fig, {})
    print(f"wrote {path}", file=sys.stderr)
    return rc


# ============================================================== report
# This benchmark's part of bench/REPORT.md (bench/report.py puts it in its chapter) and its goals.

def report_section(R: ResultIndex) -> str:
    plt = pyplot()
    out = [R.provenance("vm_lfp", "vm_lfp") + "\n"]
    f = R.fig("vm_lfp")
    if not f:
        return "\n".join(out)
    s = f.get("setup", {})
    out.append(f"In the VM: a {num(s.get('bottleneck_bit_s', 0) / 1e6, 'Mbit/s')} bottleneck with a "
               f"{num(s.get('buffer_bytes', 0) / 1024, 'KiB')} queue ({s.get('bottleneck', '')}), RTT made by "
               f"{s.get('delay', '')}; pacers at {share(s.get('margin'), 0)} of the bottleneck (split over the TCP "
               f"flows; the UDP stream's {num(s.get('udp_bit_s', 0) / 1e6, 'Mbit/s')} left out), "
               f"{s.get('seconds_per_case', '?')} s per case, GSO on. `none` is CUBIC without a qdisc.\n")
    if f.get("unavailable") or f.get("failed"):
        out.append(f"**Could not run here:** {(f.get('unavailable') or f.get('failed'))[-500:]}\n")
        return "\n".join(out)
    if f.get("incomplete"):
        out.append(f"**Incomplete run:** the guest was cut off after {len(f.get('cases', []))} cases; the "
                   f"table has the cases it finished ({f['incomplete'].splitlines()[0][:200]}).\n")
    clock = g(f, "vm", "clock")
    if clock:
        out.append(f"VM clock: {clock} (virtual: exact guest time whatever the host's load).\n")
    cal = f.get("calibration") or {}
    out.append(f"Calibration: one unpaced flow without added delay carries {mbit_text(cal.get('goodput_bit_s'))} "
               f"through the bottleneck.\n")
    cases = f.get("cases", [])
    rows = []
    for c in cases:
        u = c.get("udp") or {}
        rows.append([f"{c['rtt_ms']:g} ms", c["mix"], c["pacer"], mbit_text(c["tcp_goodput_bit_s"]),
                     mbit_text(c["tcp_goodput_second_half_bit_s"]), share(c["bottleneck"]["loss"], 2),
                     c["tcp_retransmits"],
                     "" if not u else f"{num(u.get('lost_percent'), '%', 2)} / {num(u.get('jitter_ms'), 'ms', 3)}"])
    out.append(table(["RTT", "traffic", "pacer", "TCP goodput", "2nd half", "bottleneck loss", "TCP retrans",
                      "UDP loss / jitter"], rows))
    rtts = sorted({c["rtt_ms"] for c in cases})
    mixes = list(dict.fromkeys(c["mix"] for c in cases))
    pacers = list(dict.fromkeys(c["pacer"] for c in cases))
    if cases:
        fig, axes = plt.subplots(1, len(mixes), figsize=(4.5 * len(mixes), 3.4), squeeze=False, sharey=True)
        w = 0.8 / max(1, len(pacers))
        for ax, mix in zip(axes[0], mixes):
            for j, p in enumerate(pacers):
                ys = [next((c["tcp_goodput_bit_s"] / 1e6 for c in cases if c["mix"] == mix and c["pacer"] == p
                            and c["rtt_ms"] == r), 0) for r in rtts]
                ax.bar([i + j * w for i in range(len(rtts))], ys, w, label=p, color=COLORS.get(p))
            ax.set_xticks([i + w * (len(pacers) - 1) / 2 for i in range(len(rtts))])
            ax.set_xticklabels([f"{r:g} ms" for r in rtts])
            ax.axhline(s.get("bottleneck_bit_s", 0) / 1e6, color="k", ls=":", lw=0.8)
            ax.set_title(f"TCP goodput, {mix}")
        axes[0][0].set_ylabel("Mbit/s (dotted: bottleneck)")
        axes[0][0].legend(fontsize=8)
        out.append(savefig(fig, "lfp_goodput.png"))
        udp = [c for c in cases if c.get("udp")]
        if udp:
            fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
            w = 0.8 / max(1, len(pacers))
            for j, p in enumerate(pacers):
                loss = [next((c["udp"].get("lost_percent") or 0 for c in udp if c["pacer"] == p and c["rtt_ms"] == r), 0)
                        for r in rtts]
                jit = [next((c["udp"].get("jitter_ms") or 0 for c in udp if c["pacer"] == p and c["rtt_ms"] == r), 0)
                       for r in rtts]
                xs = [i + j * w for i in range(len(rtts))]
                axes[0].bar(xs, loss, w, label=p, color=COLORS.get(p))
                axes[1].bar(xs, jit, w, label=p, color=COLORS.get(p))
            for ax, t in zip(axes, ("UDP loss (%)", "UDP jitter (ms)")):
                ax.set_xticks([i + w * (len(pacers) - 1) / 2 for i in range(len(rtts))])
                ax.set_xticklabels([f"{r:g} ms" for r in rtts])
                ax.set_title(t + ", next to one TCP flow")
            axes[0].legend(fontsize=8)
            out.append(savefig(fig, "lfp_udp.png"))
        # goodput over time at the largest RTT, one TCP flow
        big = [c for c in cases if c["rtt_ms"] == rtts[-1] and c["mix"] == mixes[0]]
        if big and any(c["tcp_flows"] and c["tcp_flows"][0].get("receiver_series_bit_s") for c in big):
            fig, ax = plt.subplots(figsize=(8, 3))
            for c in big:
                ys = c["tcp_flows"][0].get("receiver_series_bit_s") or []
                ax.plot(range(1, len(ys) + 1), [y / 1e6 for y in ys], marker="o", ms=3, label=c["pacer"],
                        color=COLORS.get(c["pacer"]))
            ax.set_xlabel("s")
            ax.set_ylabel("Mbit/s at the receiver")
            ax.set_title(f"one TCP flow, RTT {rtts[-1]:g} ms")
            ax.legend(fontsize=8)
            out.append(savefig(fig, "lfp_timeseries.png"))
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())

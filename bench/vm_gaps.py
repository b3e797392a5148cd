"""Pacing precision in the VM: psp vs htb vs tbf vs fq (maxrate), inter-packet gaps (issues 4, 6).

One VM boot, in virtual time (``--clock``, vm/README.md); for each rate (10, 100, 1000, 2500
Mbit/s) and GSO/TSO on and off, the four qdiscs
carry the same traffic one after the other: one iperf3 TCP stream (or ``--source pktgen``: the
kernel's pktgen through the qdisc, ``--overload`` x the rate) for ``--seconds`` through the
sender's veth, every data packet captured as it leaves that veth (``--capture bpf``: a tracepoint
program stamping into a map, ``harness/xmitstamp.py``, no user space per packet; or by tcpdump, ``--capture pcap``: nanosecond
stamps to the guest's tmpfs, kernel drops counted, a run with drops marked invalid; the Python
AF_PACKET capture drops above ~150 Mbit/s) (the qdisc's output, the "wire"
of a veth; ``pacing.sender_capture`` says why not at the receiver) with its kernel timestamp
(``harness/pacing.py``: GSO skbs counted as the wire packets a NIC would send back to back).
Figures per run (after a 1 s warm-up): rate error (frame bytes/s over the target), share of gaps
within ±25 % of the ideal gap, median and p99 gap, the longest run of back-to-back packets (gaps
under 1/4 of the ideal), most packets in one 1 ms bin, share of empty 1 ms bins, capture drops.
Bounded raw data for the plots: ``--gap-sample`` consecutive gaps from the middle of the run (for
the CDF against the ideal gap) and the packets per 1 ms bin over a ``--window-ms`` window (the
time series the seed's GtrcNET captures show).

The qdiscs: ``psp`` (one class at the rate, link 1 Gbit/s; segments GSO at enqueue), ``htb`` (one
class, tc's default burst), ``tbf`` (bucket of two frames), ``fq`` with ``maxrate``.

Writes bench/results/vm_gaps.json (named apart from the other pacing benchmark, bench/vm_pacing.py).
Run: ``.venv/bin/python -m bench.vm_gaps [--quick]``.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import List

from bench.vm_sharing import Bed, guest_result, vm_bench
from harness import pacing

from .reportkit import (COLORS, Goal, ResultIndex, Unavailable, g, kernel_label, mbit, num, pct,
                        pyplot, savefig, share, table)

log = logging.getLogger("bench.vm_gaps")

QDISCS = ("psp", "htb", "tbf", "fq")
RATES = (10, 100, 1000, 2500)


def make_setup(qdisc: str, target: int):
    """The qdisc under test at ``target`` bytes/s; psp's link at the veth's 10 Gbit/s, so that
    only the class paces (its 1 Gbit/s default link would cap the runs above 1 Gbit/s)."""
    if qdisc == "psp":
        return pacing.Psp(target, link_bps=pacing.mbit(10_000))
    return {"htb": pacing.Htb, "tbf": pacing.Tbf, "fq": pacing.Fq}[qdisc](target)


def cpu_busy_ns() -> int:
    """CPU time the guest spent on anything but idle (all CPUs, /proc/stat, USER_HZ 100)."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    return (sum(vals[:8]) - idle) * 10_000_000


def psp_xstats(bed: Bed) -> dict:
    from harness import psplib
    with psplib.PspNl(bed.sender_ns) as sock:
        return dict(sock.root(bed.sender_dev).xstats)


def one_run(bed: Bed, qdisc: str, rate_mbit: float, gso: bool, seconds: int, gap_sample: int,
            window_ms: int, capture: str = "pcap") -> dict:
    target = pacing.mbit(rate_mbit)
    setup = make_setup(qdisc, target)
    bed.clear_qdisc()
    bed.set_gso(gso)
    setup(bed)
    cap = pacing.make_capture(capture, bed.sender_ns, bed.sender_dev, pacing.IPERF_PORT)
    with cap:
        busy0 = cpu_busy_ns()
        with pacing.Iperf(bed, [pacing.IPERF_PORT], seconds) as ip:
            rep = ip.wait()[pacing.IPERF_PORT]
        busy1 = cpu_busy_ns()
    xs = psp_xstats(bed) if qdisc == "psp" else None
    bed.clear_qdisc()
    st = pacing.analyze(cap.packets, target, warmup_s=1.0)
    # the raw series again, for the bounded samples (same flow and window as analyze)
    pk = sorted(cap.packets, key=lambda p: p.ts_ns)
    by = {}
    for p in pk:
        by[p.sport] = by.get(p.sport, 0) + p.payload_bytes
    flow = max(by, key=by.get)
    pk = [p for p in pk if p.sport == flow]
    lo = pk[0].ts_ns + 1_000_000_000
    wire = [w for p in pk if p.ts_ns >= lo for w in p.wire()]
    gaps = [(b[0] - a[0]) / 1e3 for a, b in zip(wire, wire[1:])]
    mid = len(gaps) // 2
    sample = gaps[max(0, mid - gap_sample // 2): max(0, mid - gap_sample // 2) + gap_sample]
    t_mid = wire[len(wire) // 2][0] if wire else 0
    t_a = t_mid - window_ms * 500_000
    bins = [0] * window_ms
    for t, _, _ in wire:
        k = (t - t_a) // 1_000_000
        if 0 <= k < window_ms:
            bins[k] += 1
    sent_pkts = rep["end"]["sum_sent"]["bytes"] / 1448
    out = {"qdisc": qdisc, "rate_mbit": rate_mbit, "gso": gso, "seconds": seconds,
            "capture": capture, "valid": cap.drops == 0,
            "cpu_ns_per_pkt": round((busy1 - busy0) / max(1.0, sent_pkts), 1),
            "within10": st.within10, "fit_rate_error": st.fit_rate_error,
            "rate_error": st.rate_error, "rate_bit_s": st.rate_bps * 8, "goodput_bit_s": st.goodput_bps * 8,
            "iperf_bit_s": pacing.received_bps(rep) * 8, "within25": st.within25, "b2b_share": st.b2b_share,
            "ideal_gap_us": st.ideal_gap_us, "median_gap_us": st.median_gap_us, "p99_gap_us": st.p99_gap_us,
            "longest_run": st.longest_run, "max_per_ms": st.max_per_ms, "empty_ms": st.empty_ms,
            "mean_segs": st.mean_segs, "packets": st.packets, "capture_drops": cap.drops,
            "gaps_sample_us": [round(x, 2) for x in sample], "per_ms_sample": bins}
    if xs is not None:
        out["psp"] = {k: xs[k] for k in ("paced_pkts", "gso_split", "late_ns_total", "late_ns_max",
                                         "clamps", "longest_run", "timer_fires",
                                         "timer_late_ns_max") if k in xs}
    return out


SCHED_FIELDS = ("se.sum_exec_runtime", "nr_switches", "nr_voluntary_switches",
                "nr_involuntary_switches", "se.nr_wakeups")


def task_sched(comm_prefix: str) -> dict:
    """/proc/PID/sched counters of the kernel threads whose name starts with ``comm_prefix``
    (summed): run time (ms) and switches; where softirq work and pktgen's CPU time went."""
    tot: dict = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/comm") as f:
                if not f.read().startswith(comm_prefix):
                    continue
            with open(f"/proc/{pid}/sched") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        for ln in lines:
            k, _, v = ln.partition(":")
            k = k.strip()
            if k in SCHED_FIELDS:
                tot[k] = tot.get(k, 0.0) + float(v.strip())
    return tot


def softirq_counts() -> dict:
    """/proc/softirqs totals (all CPUs) of the classes the qdisc's path raises."""
    out = {}
    with open("/proc/softirqs") as f:
        for ln in f.read().splitlines()[1:]:
            words = ln.split()
            if words and words[0].rstrip(":") in ("TIMER", "NET_TX", "NET_RX", "HRTIMER", "SCHED"):
                out[words[0].rstrip(":")] = sum(int(x) for x in words[1:])
    return out


def sched_snapshot() -> dict:
    return {"ksoftirqd": task_sched("ksoftirqd/"), "kpktgend": task_sched("kpktgend_"),
            "softirqs": softirq_counts()}


def sched_delta(a: dict, b: dict) -> dict:
    return {g: {k: round(b[g].get(k, 0) - a[g].get(k, 0), 3) for k in b[g]} for g in b}


def pktgen_run(bed: Bed, qdisc: str, rate_mbit: float, seconds: int, capture: str = "pcap",
               overload: float = 1.1) -> dict:
    """pktgen (queue_xmit, 1514-byte UDP frames at 1.1x the rate) through the qdisc, dropped at
    the receiver's ingress; ``capture`` (tcpdump or the BPF tracepoint) where the packets leave
    the sender's veth."""
    target = pacing.mbit(rate_mbit)
    setup = make_setup(qdisc, target)
    busy0 = cpu_busy_ns()
    sched0 = sched_snapshot()
    st = pacing.measure_pktgen(bed, setup, target, duration=seconds, capture=capture,
                               overload=overload)
    sched1 = sched_snapshot()
    busy1 = cpu_busy_ns()
    xs = psp_xstats(bed) if qdisc == "psp" else None
    bed.clear_qdisc()
    out = {"qdisc": qdisc, "rate_mbit": rate_mbit, "gso": False, "source": "pktgen", "seconds": seconds,
           "capture": capture, "overload": overload, "valid": st.capture_drops == 0,
           "sched": sched_delta(sched0, sched1),
           "gap_pct_us": st.gap_pct_us,
           "cpu_ns_per_pkt": round((busy1 - busy0) / max(1, st.packets) , 1),
           "within10": st.within10, "within25": st.within25, "fit_rate_error": st.fit_rate_error,
           "rate_error": st.rate_error, "rate_bit_s": st.rate_bps * 8, "goodput_bit_s": st.goodput_bps * 8,
           "b2b_share": st.b2b_share, "ideal_gap_us": st.ideal_gap_us, "median_gap_us": st.median_gap_us,
           "p99_gap_us": st.p99_gap_us, "longest_run": st.longest_run, "max_per_ms": st.max_per_ms,
           "empty_ms": st.empty_ms, "mean_segs": st.mean_segs, "packets": st.packets,
           "capture_drops": st.capture_drops}
    if xs is not None:
        out["psp"] = {k: xs[k] for k in ("paced_pkts", "late_ns_total", "late_ns_max", "clamps",
                                         "longest_run", "timer_fires", "timer_late_ns_max") if k in xs}
    return out


def run_all(rates, qdiscs, gsos, seconds, gap_sample, window_ms, capture="pcap", source="iperf3",
            overload=1.1) -> list:
    from harness.testbed import Testbed
    out = []
    with Testbed(tag="vgap") as tb:
        bed = Bed(tb)
        for rate in rates:
            for gso in gsos:
                for q in qdiscs:
                    t0 = time.monotonic()
                    try:
                        if source == "pktgen":
                            if not gso:
                                continue          # pktgen's frames are never GSO: one pass
                            r = pktgen_run(bed, q, rate, seconds, capture, overload)
                        else:
                            r = one_run(bed, q, rate, gso, seconds, gap_sample, window_ms, capture)
                    except Exception as e:       # one failed run must not lose the others
                        r = {"qdisc": q, "rate_mbit": rate, "gso": gso, "error": f"{type(e).__name__}: {e}"}
                        bed.clear_qdisc()
                    r["wall_s"] = round(time.monotonic() - t0, 1)
                    out.append(r)
                    if "error" in r:
                        log.info("%-4s %5g Mbit GSO %-3s: %s", q, rate, "on" if gso else "off", r["error"])
                    else:
                        log.info("%-4s %5g Mbit GSO %-3s: %7.1f Mbit/s, rate %+6.2f %%, within10 %5.1f %%, "
                                 "within25 %5.1f %%, run %3d, max/ms %3d, cpu %6.0f ns/pkt, drops %d",
                                 q, rate, "on" if gso else "off", r.get("iperf_bit_s", r["rate_bit_s"]) / 1e6,
                                 100 * r["rate_error"], 100 * r["within10"], 100 * r["within25"],
                                 r["longest_run"], r["max_per_ms"], r["cpu_ns_per_pkt"],
                                 r["capture_drops"])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2, 10, 100 Mbit, 3 s per run")
    ap.add_argument("--rates", default=None, help="Mbit/s, comma separated (1,2,10,100,500)")
    ap.add_argument("--qdiscs", default=",".join(QDISCS))
    ap.add_argument("--gso", default="on,off")
    ap.add_argument("--seconds", type=int, default=None, help="per run (4; quick 3)")
    ap.add_argument("--gap-sample", type=int, default=3000)
    ap.add_argument("--window-ms", type=int, default=200)
    ap.add_argument("--capture", choices=("pcap", "bpf", "packet"), default="pcap",
                    help="pcap: tcpdump to tmpfs (keeps up at 1 Gbit/s); bpf: a tracepoint program "
                         "stamping into a map (harness/xmitstamp.py); packet: Python AF_PACKET")
    ap.add_argument("--source", choices=("iperf3", "pktgen"), default="iperf3",
                    help="pktgen: kernel pktgen through the qdisc, dropped at the receiver's ingress")
    ap.add_argument("--clock", choices=("virtual", "real"), default="virtual",
                    help="the VM's clock (virtual: exact guest time, vm/README.md)")
    ap.add_argument("--overload", type=float, default=1.1, help="pktgen's rate over the target")
    ap.add_argument("--ksoftirqd-rt", action="store_true",
                    help="ksoftirqd as SCHED_FIFO in the guest (pacing.ksoftirqd_realtime)")
    ap.add_argument("--name", default=None, help="results file name (default vm_gaps or vm_gaps_pktgen)")
    ap.add_argument("--guest", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rates = [float(x) for x in (args.rates or ("2,10,100" if args.quick else ",".join(map(str, RATES)))).split(",")]
    seconds = args.seconds or (3 if args.quick else 4)
    qdiscs = args.qdiscs.split(",")
    gsos = [x == "on" for x in args.gso.split(",")]
    if args.guest:
        if args.ksoftirqd_rt:
            pacing.ksoftirqd_realtime()
        return guest_result(args.out, runs=run_all(rates, qdiscs, gsos, seconds, args.gap_sample,
                                                    args.window_ms, args.capture, args.source,
                                                    args.overload))
    if os.geteuid() != 0:
        print("vm_gaps: needs root", file=sys.stderr)
        return 2
    from .common import write
    t0 = time.monotonic()
    fig = {"setup": {"rates_mbit": rates, "qdiscs": qdiscs, "gso": [("on" if x else "off") for x in gsos],
                     "seconds_per_run": seconds, "warmup_s": 1.0, "gap_sample": args.gap_sample,
                     "window_ms": args.window_ms, "capture": args.capture, "clock": args.clock,
                     "description": "One iperf3 TCP stream per run through the sender's veth in the VM "
                                    "(qemu TCG, virtual time unless clock says otherwise), captured leaving the sender's veth "
                                    "(pcap: tcpdump with ns stamps to tmpfs; a run with capture drops is not valid); "
                                    "cpu_ns_per_pkt: guest CPU (all of TCP, qdisc, capture) per 1448-byte segment "
                                    "sent, = instructions in virtual time; GSO skbs count as "
                                    "back-to-back wire packets. psp: one class, link 1 Gbit/s; htb: one "
                                    "class, tc's default burst; tbf: bucket of 2 frames; fq: maxrate."}}
    budget = len(rates) * len(gsos) * len(qdiscs) * (seconds + 20) + 300
    ga = ["--rates", ",".join(map(str, rates)), "--qdiscs", args.qdiscs, "--gso", args.gso,
          "--seconds", str(seconds), "--gap-sample", str(args.gap_sample), "--window-ms", str(args.window_ms),
          "--capture", args.capture, "--source", args.source, "--overload", str(args.overload)] \
        + (["--ksoftirqd-rt"] if args.ksoftirqd_rt else [])
    rc = vm_bench(fig, "bench.vm_gaps", ga, budget, clock=args.clock)
    fig["duration_s"] = round(time.monotonic() - t0, 1)
    fig["setup"]["source"] = args.source
    fig["setup"]["ksoftirqd_rt"] = args.ksoftirqd_rt
    fig["setup"]["overload"] = args.overload
    name = "vm_gaps" if args.source == "iperf3" else "vm_gaps_pktgen"
    path = write(args.name or name, fig, {})
    print(f"wrote {path}", file=sys.stderr)
    return rc


# ============================================================== report
# This benchmark's part of bench/REPORT.md (bench/report.py puts it in its chapter) and its goals.

# pacing figures (from vm_gaps): a dict per (qdisc, rate_mbit, gso) with rate_error, within25,
# longest_run; see pacing_rows()
def pacing_rows(R) -> List[dict]:
    f = R.fig("vm_gaps")
    if not f:
        return []
    if f.get("unavailable") or f.get("failed"):
        raise Unavailable(f.get("unavailable") or "the VM run failed")
    rows = []
    for r in f.get("runs", []) or []:
        rows.append(r)
    return rows


# issue 14's gap runs: TCP, and pktgen on 6.1 as shipped, 6.1 with ksoftirqd SCHED_FIFO, 6.12
GAPS14 = (("iperf3", "vm_gaps"), ("pktgen", "vm_gaps_pktgen"), ("pktgen", "vm_gaps_pktgen_rt"),
          ("pktgen", "vm_gaps_pktgen_612"))


def _issue14(R, key, rates=(100, 1000)):
    """psp's ``key`` at each rate from a valid (no capture drops) run: TCP (vm_gaps, GSO on)
    and the cheap source (vm_gaps_pktgen), each where measured; judged on the better."""
    out = {}
    for rate in rates:
        vals = {}
        for src, name in GAPS14:
            f = R.fig(name) or {}
            label = f"{src} ({kernel_label(f)})"
            for r in f.get("runs", []) or []:
                if r.get("qdisc") == "psp" and float(r.get("rate_mbit")) == rate \
                        and (src == "pktgen" or r.get("gso", True)) \
                        and not r.get("error") and r.get("valid", r.get("capture_drops") == 0):
                    vals[label] = r.get(key)
        out[rate] = vals
    if all(not v for v in out.values()):
        return None
    return out


def _best14(vals, key):
    xs = [v for v in vals.values() if v is not None]
    if not xs:
        return None
    return max(xs) if key == "within10" else min(xs, key=abs)


def _show14(v, fmt):
    return "; ".join(f"{r:g} Mbit: " + (", ".join(f"{src} {fmt(x)}" for src, x in vals.items())
                                        or "no valid run") for r, vals in v.items())


def _issue14_cpu(R):
    out = {}
    for r in pacing_rows(R):
        if r.get("error") or r.get("cpu_ns_per_pkt") is None or float(r["rate_mbit"]) not in (100, 1000):
            continue
        out.setdefault((float(r["rate_mbit"]), "on" if r["gso"] else "off"), {})[r["qdisc"]] = r["cpu_ns_per_pkt"]
    return out or None


def _sat_rate(f) -> float:
    """The saturation runs' highest target (where every qdisc is CPU-bound)."""
    return max((float(r.get("rate_mbit", 0)) for r in (f or {}).get("runs", []) or []), default=0.0)


def _sat_cost(R):
    f = R.fig("vm_gaps_pktgen_sat")
    top = _sat_rate(f)
    out = {r["qdisc"]: 1514 * 8 * 1e9 / r["rate_bit_s"]
           for r in f.get("runs", []) or [] if not r.get("error") and r.get("rate_bit_s")
           and float(r.get("rate_mbit", 0)) == top}
    return out or None


def report_section(R: ResultIndex) -> str:
    """Chapter 1's matrix: the four qdiscs in the VM, then the pktgen and saturation runs."""
    out = ["The whole matrix (`bench/vm_gaps.py`, one VM boot, the four qdiscs back to back with the same "
           "traffic at every rate and GSO setting):\n",
           R.provenance("vm_gaps", "vm_gaps") + "\n"]
    f = R.fig("vm_gaps")
    if not f:
        return "\n".join(out)
    if f.get("unavailable") or f.get("failed"):
        out.append(f"**Could not run here:** {f.get('unavailable') or f.get('failed')[-500:]}\n")
        return "\n".join(out)
    rows = [r for r in f.get("runs", [])]
    setup = f.get("setup", {})
    out.append(setup.get("description", "") + "\n")
    hdr = ["qdisc", "rate", "GSO", "iperf3 goodput", "rate error", "within ±10 %", "within ±25 %",
           "median gap / ideal", "p99 gap", "longest b2b run", "max pkts per ms", "empty ms",
           "guest CPU per packet", "capture drops"]
    trs = []
    for r in rows:
        if r.get("error"):
            trs.append([r["qdisc"], f"{r['rate_mbit']:g} Mbit", "on" if r["gso"] else "off",
                        f"failed: {r['error'][:80]}"] + [""] * 10)
            continue
        trs.append([r["qdisc"], f"{r['rate_mbit']:g} Mbit", "on" if r["gso"] else "off",
                    mbit(r["iperf_bit_s"]) if r.get("iperf_bit_s") else "—", pct(r["rate_error"], 2),
                    share(r["within10"]) if r.get("within10") is not None else "—",
                    share(r["within25"]), f"{num(r['median_gap_us'], 'us')} / {num(r['ideal_gap_us'], 'us')}",
                    num(r["p99_gap_us"], "us"), r["longest_run"], r["max_per_ms"], share(r["empty_ms"]),
                    num(r.get("cpu_ns_per_pkt"), "ns"),
                    f"{r['capture_drops']}" + (" ⚠" if r["capture_drops"] > 0 else "")])
    out.append(table(hdr, trs))
    if any(not r.get("error") and r["capture_drops"] > 0 for r in rows):
        out.append("⚠: the capture lost packets: that run's gap figures are not a result (the goals "
                   "only count runs without drops).\n")
    out.append("Guest CPU per packet: the guest's busy CPU time over the run (TCP sender and receiver, "
               "qdisc, capture) per 1448-byte segment sent; in virtual time one ns is one instruction, "
               "so the difference between qdiscs at the same rate is their own cost.\n")
    out.append("Rate error: frame bytes per second over the target (a full-size frame is 1514 bytes, so "
               "TCP goodput is 1448/1514 of it). Within ±25 %: share of gaps within a quarter of the ideal "
               "gap for that packet. Back-to-back: a gap under a quarter of the ideal.\n")
    out.append(pacing_plots(rows))
    out.append(section_pktgen(R))
    out.append(section_saturation(R))
    return "\n".join(out)


PKTGEN_GAPS = ("vm_gaps_pktgen", "vm_gaps_pktgen_rt", "vm_gaps_pktgen_612")


def section_pktgen(R: ResultIndex) -> str:
    """The same qdiscs driven by pktgen (queue_xmit, dropped at the receiver's ingress): 6.1 as
    shipped, 6.1 with ksoftirqd SCHED_FIFO, 6.12."""
    out = []
    for name in PKTGEN_GAPS:
        f = R.fig(name)
        if not f or not f.get("runs"):
            continue
        cap = g(f, "setup", "capture", default="pcap")
        how = ("a BPF program on the `net_dev_start_xmit` tracepoint (`harness/xmitstamp.py`: no user "
               "space per packet) stamps them where they leave the sender's veth" if cap == "bpf" else
               "tcpdump where they leave the sender's veth")
        if not out:
            out += ["### A cheap source: pktgen through the qdisc (`bench/vm_gaps.py --source pktgen`)\n",
                    f"The kernel's pktgen in `queue_xmit` mode sends 1514-byte UDP frames at "
                    f"{g(f, 'setup', 'overload', default=1.1):g}x the rate through the qdisc under test; the "
                    f"receiver drops them at its ingress; {how} (a run with capture drops is not a result). "
                    "pktgen busy-waits between packets, so the guest's CPU is not a per-packet cost here "
                    "(the saturation runs below give it). Mean lateness: psp's own (xstats late_ns_total / "
                    "paced packets): how far behind its byte clock it sent.\n"]
        out += [f"**Guest kernel {kernel_label(f)}** (`{name}`)\n", R.provenance(name, name) + "\n"]
        rows = []
        for r in f["runs"]:
            if r.get("error"):
                rows.append([r["qdisc"], f"{r['rate_mbit']:g} Mbit", f"failed: {r['error'][:80]}", "", "", "", "", "", "",
                             ""])
                continue
            pc = r.get("gap_pct_us") or {}
            x = r.get("psp") or {}
            late = (num(x["late_ns_total"] / max(1, x["paced_pkts"]) / 1e3, "us", 1)
                    if x.get("paced_pkts") else "—")
            rows.append([r["qdisc"], f"{r['rate_mbit']:g} Mbit", mbit(r["rate_bit_s"]), pct(r["rate_error"], 2),
                         share(r["within10"]), share(r["within25"]),
                         " / ".join(num(pc.get(k), "", 1) for k in ("p5", "p50", "p95")) if pc else "—",
                         r["longest_run"], late,
                         f"{r['capture_drops']}" + (" ⚠" if r["capture_drops"] else "")])
        out.append(table(["qdisc", "rate", "frame rate", "rate error", "within ±10 %", "within ±25 %",
                          "gap p5 / p50 / p95 (us)", "longest b2b run", "psp mean lateness", "capture drops"],
                         rows))
        out.append("")
    return "\n".join(out)


def section_saturation(R: ResultIndex) -> str:
    """pktgen far above what the guest carries: every qdisc CPU-bound, the carried rate is the path's CPU per packet."""
    f = R.fig("vm_gaps_pktgen_sat")
    if not f or not f.get("runs"):
        return ""
    top = _sat_rate(f)
    out = ["### CPU per packet: every qdisc CPU-bound (`bench/vm_gaps.py --source pktgen`)\n",
           R.provenance("vm_gaps_pktgen_sat", "vm_gaps_pktgen_sat") + "\n",
           f"pktgen offers {1.1 * top / 1000:g} Gbit/s of 1514-byte frames to each qdisc set to "
           f"{top / 1000:g} Gbit/s (the highest rate of these runs; the table of all of them is in "
           "the JSON): no qdisc holds a packet back, the one vCPU is busy all the time, and the carried "
           "frame rate is the whole path's CPU time per packet (pktgen, the qdisc, veth, tcpdump's tap "
           "and process, the receiver's drop); in virtual time 1 ns is one instruction. The difference "
           "to another qdisc is the difference of their own costs. Guest kernel "
           f"{g(f, 'vm', 'kernel', default='?')}; capture {g(f, 'setup', 'capture', default='pcap')}.\n"]
    runs = [r for r in f["runs"] if float(r.get("rate_mbit", 0)) == top]
    rows, base = [], {}
    for r in runs:
        if not r.get("error") and r.get("rate_bit_s"):
            base[r["qdisc"]] = 1514 * 8 * 1e9 / r["rate_bit_s"]
    for r in runs:
        if r.get("error"):
            rows.append([r["qdisc"], f"failed: {r['error'][:80]}", "", "", ""])
            continue
        ns = base[r["qdisc"]]
        rows.append([r["qdisc"], mbit(r["rate_bit_s"]), num(ns, "ns"),
                     num(ns - base["htb"], "ns") if "htb" in base else "—",
                     num(ns - base["fq"], "ns") if "fq" in base else "—"])
    out.append(table(["qdisc", "carried", "CPU per packet (whole path)", "vs htb", "vs fq"], rows))
    return "\n".join(out)


def pacing_plots(rows: List[dict]) -> str:
    plt = pyplot()
    ok = [r for r in rows if not r.get("error") and r.get("gaps_sample_us")]
    if not ok:
        return ""
    md = []
    rates = sorted({r["rate_mbit"] for r in ok})
    for gso in (True, False):
        sel = [r for r in ok if r["gso"] == gso]
        if not sel:
            continue
        fig, axes = plt.subplots(1, len(rates), figsize=(4.2 * len(rates), 3.4), squeeze=False)
        for ax, rate in zip(axes[0], rates):
            for r in sel:
                if r["rate_mbit"] != rate:
                    continue
                xs = sorted(x / r["ideal_gap_us"] for x in r["gaps_sample_us"])
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step(xs, ys, where="post", label=r["qdisc"], color=COLORS.get(r["qdisc"]))
            ax.axvline(1.0, color="k", lw=0.8, ls="--")
            ax.axvspan(0.75, 1.25, color="0.9")
            ax.set_xscale("symlog", linthresh=0.1)
            ax.set_xlim(0, 20)
            ax.set_title(f"{rate:g} Mbit/s, GSO {'on' if gso else 'off'}")
            ax.set_xlabel("gap / ideal gap")
        axes[0][0].set_ylabel("CDF of inter-packet gaps")
        axes[0][0].legend(fontsize=8)
        md.append(savefig(fig, f"pacing_gap_cdf_gso_{'on' if gso else 'off'}.png"))
    # packets per 1 ms bin, a window of each run (GSO on): rates down, qdiscs across
    for gso in (True, False):
        sel = [r for r in ok if r["gso"] == gso and r.get("per_ms_sample")]
        if not sel:
            continue
        qd = list(dict.fromkeys(r["qdisc"] for r in sel))
        fig, axes = plt.subplots(len(rates), len(qd), figsize=(3.2 * len(qd), 1.7 * len(rates)),
                                 squeeze=False, sharey="row", sharex=True)
        for i, rate in enumerate(rates):
            ideal = rate * 1e6 / 8 / 1514 / 1000
            for j, q in enumerate(qd):
                ax = axes[i][j]
                r = next((x for x in sel if x["qdisc"] == q and x["rate_mbit"] == rate), None)
                if r is not None:
                    ys = r["per_ms_sample"]
                    ax.bar(range(len(ys)), ys, width=1.0, color=COLORS.get(q), linewidth=0)
                ax.axhline(ideal, color="k", ls="--", lw=0.7)
                if i == 0:
                    ax.set_title(q)
                if j == 0:
                    ax.set_ylabel(f"{rate:g} Mbit\npkts/ms", fontsize=8)
        for ax in axes[-1]:
            ax.set_xlabel("ms")
        fig.suptitle(f"packets per 1 ms bin, a window of each run (GSO {'on' if gso else 'off'}); "
                     "dashed: the ideal", fontsize=10)
        md.append(savefig(fig, f"pacing_per_ms_gso_{'on' if gso else 'off'}.png"))
    return "\n".join(md)


def report_goals() -> List[Goal]:
    return [
        Goal(16, 14, "VM, virtual time: psp >= 95 % of gaps within ±10 % at 100 Mbit and 1 Gbit (GSO on, capture without drops)",
             "vm_gaps", "vm_gaps", lambda R: _issue14(R, "within10"),
             lambda v: all((_best14(x, "within10") or 0) >= 0.95 for x in v.values()),
             lambda v: _show14(v, share)),
        Goal(17, 14, "VM, virtual time: psp rate error <= 0.1 % at 100 Mbit and 1 Gbit (GSO on)", "vm_gaps", "vm_gaps",
             lambda R: _issue14(R, "rate_error"),
             lambda v: all(_best14(x, "rate_error") is not None and abs(_best14(x, "rate_error")) <= 0.001
                           for x in v.values()),
             lambda v: _show14(v, lambda x: pct(x, 3))),
        Goal(19, 14, "VM: CPU per packet with each qdisc, all CPU-bound (pktgen far above what the guest carries; report)",
             "vm_gaps_pktgen_sat", "vm_gaps_pktgen_sat", _sat_cost, None,
             lambda v: ", ".join(f"{q} {num(ns, 'ns')}" for q, ns in v.items())),
        Goal(20, 14, "VM: psp per-packet guest CPU beside htb's and fq's at 100 Mbit and 1 Gbit (report)",
             "vm_gaps", "vm_gaps", _issue14_cpu, None,
             lambda v: "; ".join(f"{r:g} Mbit GSO {g}: " + ", ".join(
                 f"{q} {num(c, 'ns')}" for q, c in qs.items()) for (r, g), qs in v.items())),
    ]


if __name__ == "__main__":
    sys.exit(main())

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

from bench.vm_sharing import Bed, guest_result, vm_bench
from harness import pacing

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
    from flowpacer.testbed import Testbed
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


if __name__ == "__main__":
    sys.exit(main())

"""4, 4, 4, 2, 2 on a 1 Gbit/s link with every class backlogged (issue 14): pktgen, not TCP.

The TCP version (``bench/vm_sharing.py``) cannot fill a 1 Gbit/s link in the one-vCPU guest
(it carries ~550 Mbit/s of segmented TCP, so no class is backlogged and the split is the CPU's).
Here the kernel's pktgen (``queue_xmit``: every packet goes through the root qdisc) sends
1514-byte UDP frames whose destination port walks five ports packet by packet, so each class
is offered the same load, ``--offered`` x its share of the link with all five running (the
largest share, 2.5 units of 10; equal offers mean a qdisc that served in arrival order would
split the link evenly, not 2:2:2:1:1). The receiver drops the frames at its ingress. Each
class's rate is counted where the packets leave the sender's veth (``BpfCapture``: a tracepoint
program, no user space per packet), after ``--warmup`` s.

* ``psp``: link 10 units, one class per port at 4, 4, 4, 2, 2 units (the daemon's layout);
* ``htb``: flowpacer's htb layout (a link class of 10 units, the flow classes under it at their
  rates, ceil = rate). htb guarantees each class its own rate even when the rates add up to more
  than the link class, so it is expected to miss the share (it sends 16 units where it can).
* tbf and fq have no classes with rates (fq's maxrate is one rate for every flow): no share.

Writes bench/results/vm_share_pktgen.json. Run: ``.venv/bin/python -m bench.vm_share_pktgen``.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import time
from typing import Dict, List

from bench.vm_sharing import (LINK_UNITS, RATES_UNITS, Bed, guest_result, mbit, psp_stats,
                              setup_htb, setup_psp, vm_bench)
from harness import pacing

from .reportkit import Goal, ResultIndex, g, kernel_label, mbit as mbit_text, num, pct, table

log = logging.getLogger("bench.vm_share_pktgen")

BASE_PORT = 5201


def flow_row(i: int, rate_bps: float, ideal_bps: float, measured_bps: float, total_bps: float) -> dict:
    """Class ``i``'s figures (bit/s): its rate, its ideal share of the link, what it carried, the
    error against the ideal and against its 2:2:2:1:1 part of what all classes carried."""
    return {"flow": i + 1, "class_rate_bit_s": rate_bps * 8, "ideal_bit_s": ideal_bps * 8,
            "measured_bit_s": measured_bps * 8, "error": measured_bps / ideal_bps - 1,
            "share_error": (measured_bps / total_bps) / (RATES_UNITS[i] / sum(RATES_UNITS)) - 1}


def share_run(bed: Bed, qdisc: str, link_mbit: float, seconds: float, warmup: float,
              offered: float, capture: str, frame_bytes: int = 1514, frags: int = 0) -> dict:
    n = len(RATES_UNITS)
    unit = mbit(link_mbit) / LINK_UNITS
    rates = [int(r * unit) for r in RATES_UNITS]
    link = int(LINK_UNITS * unit)
    ideal = [link * r / sum(RATES_UNITS) for r in RATES_UNITS]      # all five backlogged
    ports = [BASE_PORT + i for i in range(n)]
    classes = [(0x10 + i, rates[i], ports[i]) for i in range(n)]
    bed.set_gso(True)
    (setup_psp if qdisc == "psp" else setup_htb)(bed, link, classes)
    source = int(max(ideal) * offered * n)
    set_mtu(bed, frame_bytes - 14)
    try:
        if capture == "stats":
            return stats_share_run(bed, qdisc, classes, ideal, link, source, seconds, warmup,
                                   frame_bytes, frags)
        with pacing.make_capture(capture, bed.sender_ns, bed.sender_dev, ports) as cap:
            with pacing.Pktgen(bed, source, seconds, port=BASE_PORT, ports=n,
                               frame_bytes=frame_bytes, frags=frags) as pg:
                pg.wait()
                sent = pg.result()
        stats = psp_stats(bed) if qdisc == "psp" else None
    finally:
        bed.clear_qdisc()
        set_mtu(bed, 1500)
    pk = sorted(cap.packets, key=lambda p: p.ts_ns)
    if len(pk) < 100:
        raise RuntimeError(f"only {len(pk)} packets captured")
    t_a = pk[0].ts_ns + int(warmup * 1e9)
    t_b = pk[-1].ts_ns - int(0.1 * 1e9)
    got = {p: 0 for p in ports}
    for p in pk:
        if t_a <= p.ts_ns < t_b and p.dport in got:
            got[p.dport] += p.l2_bytes
    span = (t_b - t_a) / 1e9
    meas = [got[p] / span for p in ports]
    tot = sum(meas)
    flows = [flow_row(i, rates[i], ideal[i], meas[i], tot) for i in range(n)]
    # every class backlogged: pktgen (whose rate the guest's CPU bounds) offered each class at
    # least its ideal share; otherwise the split is the offer's, not the qdisc's
    achieved = sent.get("bit_s")
    backlogged = achieved is not None and achieved / n >= max(ideal) * 8
    return {"qdisc": qdisc, "link_bit_s": link * 8, "frame_bytes": frame_bytes,
            "offered_bit_s": source * 8, "pktgen": sent,
            "offered_per_class_bit_s": source * 8 / n,
            "achieved_per_class_bit_s": achieved / n if achieved is not None else None,
            "every_class_backlogged": backlogged, "window_s": round(span, 3),
            "total_bit_s": tot * 8, "flows": flows,
            "max_abs_error": max(abs(f["error"]) for f in flows),
            "max_abs_share_error": max(abs(f["share_error"]) for f in flows),
            "capture": capture, "capture_drops": cap.drops, "valid": cap.drops == 0,
            "packets": len(pk), "psp_stats": stats}


def class_counters(bed: Bed) -> Dict[int, dict]:
    """Each class's counters under root f1f0: from ``tc -s class show`` (any qdisc kind: tc
    prints the generic counters of a kind it does not know, psp's too): minor -> bytes,
    packets, drops, qlen."""
    out: Dict[int, dict] = {}
    cur = None
    for line in bed.s("tc", "-s", "class", "show", "dev", bed.sender_dev).stdout.splitlines():
        m = re.match(r"class \S+ f1f0:([0-9a-f]+)", line)
        if m:
            cur = out.setdefault(int(m.group(1), 16), {})
            continue
        if cur is None:
            continue
        m = re.search(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+)", line)
        if m:
            cur.update(bytes=int(m.group(1)), packets=int(m.group(2)), drops=int(m.group(3)))
        m = re.search(r"backlog \S+ (\d+)p", line)
        if m:
            cur["qlen"] = int(m.group(1))
    return out


def stats_share_run(bed: Bed, qdisc: str, classes, ideal, link, source, seconds, warmup,
                    frame_bytes, frags, reads: int = 9) -> dict:
    """The share from the classes' own counters, read ``reads`` times while pktgen runs (from
    ``warmup`` to 0.2 s before its nominal end), with nothing else running per packet: no capture
    competes with pktgen and the qdisc for the vCPU. What each class was offered in the window is
    what it sent, dropped and queued more (sent + drops + queue growth); it was backlogged when its
    queue was non-empty at every read."""
    n = len(classes)
    with pacing.Pktgen(bed, source, seconds, port=BASE_PORT, ports=n,
                       frame_bytes=frame_bytes, frags=frags) as pg:
        start = time.monotonic()
        samples = []
        for k in range(reads):
            at = warmup + (seconds - 0.2 - warmup) * k / (reads - 1)
            pacing.wait_for(lambda: time.monotonic() - start >= at, at + 5, "the next read")
            t0 = time.monotonic()
            counters = class_counters(bed)
            # the counters were read somewhere in tc's run: take its middle as their time
            samples.append(((t0 + time.monotonic()) / 2, counters))
        pg.wait()
        sent = pg.result()
    stats = psp_stats(bed) if qdisc == "psp" else None
    (t_a, c_a), (t_b, c_b) = samples[0], samples[-1]
    span = t_b - t_a
    meas = []
    for minor, _rate, _port in classes:
        a, b = c_a.get(minor, {}), c_b.get(minor, {})
        meas.append((b.get("bytes", 0) - a.get("bytes", 0)) / span)
    tot = sum(meas)
    flows = []
    for i, (minor, rate, _port) in enumerate(classes):
        a, b = c_a.get(minor, {}), c_b.get(minor, {})
        qlens = [c.get(minor, {}).get("qlen", 0) for _t, c in samples]
        extra_pkts = (b.get("drops", 0) - a.get("drops", 0)) + (qlens[-1] - qlens[0])
        offered = meas[i] + extra_pkts * frame_bytes / span
        flows.append({**flow_row(i, rate, ideal[i], meas[i], tot),
                      "offered_in_window_bit_s": offered * 8,
                      "drops_in_window": b.get("drops", 0) - a.get("drops", 0),
                      "qlen_at_reads": qlens, "backlogged": min(qlens) > 0})
    return {"qdisc": qdisc, "link_bit_s": link * 8, "frame_bytes": frame_bytes, "pktgen_frags": frags,
            "offered_bit_s": source * 8, "pktgen": sent, "offered_per_class_bit_s": source * 8 / n,
            "achieved_per_class_bit_s": min(f["offered_in_window_bit_s"] for f in flows),
            "every_class_backlogged": all(f["backlogged"] for f in flows), "window_s": round(span, 3),
            "reads": reads, "total_bit_s": tot * 8, "flows": flows,
            "max_abs_error": max(abs(f["error"]) for f in flows),
            "max_abs_share_error": max(abs(f["share_error"]) for f in flows),
            "capture": "stats", "capture_drops": 0, "valid": True, "psp_stats": stats}


def set_mtu(bed: Bed, mtu: int) -> None:
    """Both ends of the veth at ``mtu`` (jumbo frames carry more bytes per packet the guest
    must handle)."""
    bed.s("ip", "link", "set", "dev", bed.sender_dev, "mtu", str(mtu))
    bed.r("ip", "link", "set", "dev", bed.receiver_dev, "mtu", str(mtu))


def run_all(qdiscs, link_mbit, seconds, warmup, offered, capture, frame_bytes=1514, frags=0) -> dict:
    from harness.testbed import Testbed
    out = {}
    with Testbed(tag="vshp") as tb:
        bed = Bed(tb)
        for q in qdiscs:
            try:
                r = share_run(bed, q, link_mbit, seconds, warmup, offered, capture, frame_bytes, frags)
                log.info("%s: %s Mbit/s of %.0f, max error %.2f %%, max share error %.2f %%", q,
                         [round(f["measured_bit_s"] / 1e6, 1) for f in r["flows"]], r["total_bit_s"] / 1e6,
                         100 * r["max_abs_error"], 100 * r["max_abs_share_error"])
            except Exception as e:
                r = {"qdisc": q, "error": f"{type(e).__name__}: {e}"}
                log.info("%s: %s", q, r["error"])
                bed.clear_qdisc()
            out[q] = r
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--qdiscs", default="psp,htb")
    ap.add_argument("--link-mbit", type=float, default=1000.0)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--offered", type=float, default=1.2,
                    help="each class is offered this x the largest ideal share")
    ap.add_argument("--capture", choices=("bpf", "pcap", "stats"), default="bpf",
                    help="how each class's rate is counted: bpf/pcap where packets leave the "
                         "sender's veth, stats: the classes' own byte counters read twice")
    ap.add_argument("--ksoftirqd-rt", action="store_true",
                    help="ksoftirqd as SCHED_FIFO in the guest (pacing.ksoftirqd_realtime: 6.1 "
                         "defers the watchdog's softirq to it)")
    ap.add_argument("--frame-bytes", type=int, default=1514,
                    help="pktgen's frame size; above 1514 both veth ends get MTU frame-14 (9014: "
                         "jumbo frames, 6x the bytes per packet the guest's CPU can send)")
    ap.add_argument("--frags", type=int, default=0,
                    help="pktgen's payload in this many page fragments (0: linear)")
    ap.add_argument("--name", default=None, help="results/NAME.json (default vm_share_pktgen, "
                                                  "vm_share_pktgen_jumbo above 1514 bytes)")
    ap.add_argument("--guest", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    qdiscs = args.qdiscs.split(",")
    if args.guest:
        if args.ksoftirqd_rt:
            pacing.ksoftirqd_realtime()
        return guest_result(args.out, runs=run_all(qdiscs, args.link_mbit, args.seconds, args.warmup,
                                                    args.offered, args.capture, args.frame_bytes,
                                                    args.frags))
    if os.geteuid() != 0:
        print("vm_share_pktgen: needs root", file=sys.stderr)
        return 2
    from .common import write
    t0 = time.monotonic()
    fig = {"setup": {"rates_units": list(RATES_UNITS), "link_units": LINK_UNITS,
                     "link_bit_s": args.link_mbit * 1e6, "seconds": args.seconds, "warmup_s": args.warmup,
                     "offered": args.offered, "capture": args.capture, "clock": "virtual",
                     "ideal_all_running": "2:2:2:1:1 of the link",
                     "frame_bytes": args.frame_bytes, "pktgen_frags": args.frags,
                     "ksoftirqd_rt": args.ksoftirqd_rt,
                     "source": f"pktgen queue_xmit, {args.frame_bytes}-byte UDP frames, destination "
                               "port walking 5 ports",
                     "measured": "frame bytes per class leaving the sender's veth"}}
    rc = vm_bench(fig, "bench.vm_share_pktgen",
                  ["--qdiscs", args.qdiscs, "--link-mbit", str(args.link_mbit), "--seconds", str(args.seconds),
                   "--warmup", str(args.warmup), "--offered", str(args.offered), "--capture", args.capture,
                   "--frame-bytes", str(args.frame_bytes), "--frags", str(args.frags)]
                  + (["--ksoftirqd-rt"] if args.ksoftirqd_rt else []),
                  len(qdiscs) * 400 + 400)
    fig["duration_s"] = round(time.monotonic() - t0, 1)
    goals = {f"{q}_max_share_error": round(r["max_abs_share_error"], 5)
             for q, r in fig.get("runs", {}).items() if "max_abs_share_error" in r}
    name = args.name or ("vm_share_pktgen" if args.frame_bytes <= 1514 else "vm_share_pktgen_jumbo")
    path = write(name, fig, goals)
    print(f"wrote {path}", file=sys.stderr)
    return rc


# ============================================================== report
# This benchmark's part of bench/REPORT.md (bench/report.py puts it in its chapter) and its goals.

SHARE_PKTGEN = ("vm_share_pktgen", "vm_share_pktgen_612")


def _share_1g(R):
    runs = []
    for name in SHARE_PKTGEN:
        f = R.fig(name)
        if not f.get("runs"):
            continue
        err = lambda q: g(f, "runs", q, "max_abs_share_error") if g(f, "runs", q, "valid") else None
        offered = g(f, "runs", "psp", "achieved_per_class_bit_s")
        runs.append({"psp": err("psp"), "htb": err("htb"), "frame": g(f, "setup", "frame_bytes", default=1514),
                     "kernel": kernel_label(f),
                     "backlogged": g(f, "runs", "psp", "every_class_backlogged"),
                     "offered": offered, "ideal": g(f, "setup", "link_bit_s", default=0) / 4})
    if runs:
        return {"runs": runs, "psp": min((r["psp"] for r in runs if r["psp"] is not None and r["backlogged"]),
                                         default=None)}
    f = R.fig("vm_sharing")
    unit = g(f, "setup", "unit_mbit")
    if not unit or unit * 10 < 1000:
        return None
    err = lambda q: g(f, "vm", "runs", q, "all_running", "max_abs_error")
    return {"runs": [{"psp": err("psp"), "htb": err("htb"), "frame": None, "backlogged": True,
                      "offered": None, "ideal": None}], "psp": err("psp")}


def _show_share(v):
    def one(r):
        pfx = (f"{r['frame']}-byte frames (pktgen, {r.get('kernel', '?')}): " if r["frame"] else "TCP: ")
        s = (f"{pfx}psp worst {pct(r['psp'], 2) if r['psp'] is not None else '—'}, htb worst "
             f"{pct(r['htb'], 2) if r['htb'] is not None else '—'}")
        if r["offered"] is not None and not r["backlogged"]:
            s += (f" (not every class backlogged: pktgen offered {r['offered'] / 1e6:.0f} Mbit/s per "
                  f"class beside psp, the largest share is {r['ideal'] / 1e6:.0f})")
        return s
    return "; ".join(one(r) for r in v["runs"])


def report_section(R: ResultIndex) -> str:
    """4,4,4,2,2 on a 1 Gbit/s link, five classes offered the same load by pktgen (1514-byte
    and jumbo frames)."""
    out = []
    for name in SHARE_PKTGEN:
        f = R.fig(name)
        if not f or not f.get("runs"):
            continue
        frame = g(f, "setup", "frame_bytes", default=1514)
        out += [f"### Five classes offered the same load: pktgen to five ports, {frame}-byte frames "
                f"(`bench/vm_share_pktgen.py{' --frame-bytes ' + str(frame) if frame != 1514 else ''}`)\n",
                R.provenance(name, name) + "\n",
                f"pktgen (queue_xmit, {frame}-byte UDP frames"
                f"{', veth MTU ' + str(frame - 14) if frame > 1514 else ''}) walks five destination ports "
                f"packet by packet, one class each, asked to offer every class {g(f, 'setup', 'offered'):g}x "
                f"the largest ideal share; link {mbit_text(g(f, 'setup', 'link_bit_s'))}, classes 4, 4, 4, 2, 2 "
                + (f"tenths of it; rates from the classes' own byte counters, read "
                   f"{(next(iter(f['runs'].values())) or {}).get('reads', '?')} times from "
                   f"{g(f, 'setup', 'warmup_s'):g} s on (no capture: nothing else runs per packet), "
                   if g(f, "setup", "capture") == "stats" else
                   f"tenths of it; rates counted where the packets leave the sender's veth "
                   f"({'BPF tracepoint' if g(f, 'setup', 'capture') == 'bpf' else 'tcpdump'}) after "
                   f"{g(f, 'setup', 'warmup_s'):g} s, ")
                + f"guest kernel {g(f, 'vm', 'kernel', default='?')}"
                + (", ksoftirqd SCHED_FIFO" if g(f, "setup", "ksoftirqd_rt") else "")
                + ", virtual time. "
                + ("Offered: the least of the five classes' offer in the window (what it sent, dropped "
                   "and queued more); backlogged: every class had a queue at every read. "
                   if g(f, "setup", "capture") == "stats" else
                   "Offered: what pktgen says it sent per class (its thread shares the one vCPU with "
                   "the qdisc, so it offers less beside a qdisc that costs more); a class offered less than "
                   "its ideal share is not backlogged, and then the split follows the offer. ")
                + "Share error: a class's part of what was sent against 2:2:2:1:1; rate error: against "
                "2:2:2:1:1 of the link.\n"]
        rows = []
        for q, r in f["runs"].items():
            if r.get("error"):
                rows.append([q, f"failed: {r['error'][:80]}", "", "", "", "", ""])
                continue
            off = r.get("achieved_per_class_bit_s")
            rows.append([q, " / ".join(num(x["measured_bit_s"] / 1e6, "", 1) for x in r["flows"]),
                         " / ".join(num(x["ideal_bit_s"] / 1e6, "", 1) for x in r["flows"]),
                         mbit_text(r["total_bit_s"]),
                         "—" if off is None else (mbit_text(off) + ("" if r.get("every_class_backlogged")
                                                               else " (not every class backlogged)")),
                         pct(r["max_abs_share_error"], 2), pct(r["max_abs_error"], 2)
                         + ("" if r.get("valid") else " (capture drops ⚠)")])
        out.append(table(["qdisc", "measured Mbit/s", "ideal Mbit/s", "total", "offered per class",
                          "max share error", "max rate error"], rows))
        out.append("")
    return "\n".join(out) + ("\n" if out else "")


def report_goals() -> List[Goal]:
    return [
        Goal(18, 14, "VM, virtual time: 4,4,4,2,2 on a 1 Gbit/s psp link, every flow within 1 % of 2:2:2:1:1 (all running)",
             "vm_sharing", "vm_sharing", _share_1g, lambda v: v["psp"] is not None and v["psp"] <= 0.01,
             _show_share),
    ]


if __name__ == "__main__":
    sys.exit(main())

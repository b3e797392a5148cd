"""Per-packet cost of psp's scheduling core at 10 ... 100 000 classes (issue 4).

The module's scheduling code (flowpacer/kernel/kmod/psp_sched.h) and its trees (psp_tree.h: rbtrees with
sorted runs) run unchanged in the userspace simulator (harness/pspsim), on a userspace rbtree
with the kernel's interface (sim/kshim.h).
Every class is backlogged all the time (an endless source of 1514-byte packets) and the rates are
equal and add up to 90 % of a 100 Gbit/s link, so each packet is one select + one charge + the
requeue of its class among N. Two ways the classes start:

* ``staggered``: at spread-out times, as real flows do; at most one class is due at a time;
* ``aligned``: all at the same instant, so all fall due together every period and every packet
  goes through the deadline tree (the worst case for the per-packet cost);
* ``mixed``: staggered starts, but four rates (1, 2, 4, 8 parts, as four rules would give) in
  round-robin. Classes of one rate are requeued in the order they are served, which the trees'
  sorted runs (4 per tree) take in O(1); here each rate needs a run of its own.
* ``grouped`` (issue 15): staggered starts, the classes in client groups of 100 (1 000 groups
  at 100 000 classes; one group below 100 classes) under 10 rule groups, every client
  oversubscribed 2x (its flows want twice its cap): each packet also scales its clock by its
  groups' shares and runs two group clocks, and members wait for their group's clock (holds,
  counted). Compared with the flat runs of the same class counts: ``ratio_grouped_to_flat``.

Each repetition times ``--packets`` packets with the thread's CPU clock (the machines are shared:
wall time would count other work); repetitions alternate between the class counts so that noise
hits all of them alike. Goal: 100 000 classes cost <= 3x of 10 classes. ``--counts`` picks the
class counts (default 10, 100, 1 000, 10 000, 100 000; 10 and 100 000 are always measured).

Writes bench/results/psp_sim.json. Run: ``.venv/bin/python -m bench.psp_sim``.
"""
from __future__ import annotations

import argparse
import logging
import os
import platform
import subprocess
import sys
import time
from typing import List

from harness.pspsim.pspsim import NSEC, Sim, build

from .common import percentiles, write
from .reportkit import Goal, ResultIndex, g, num, pyplot, savefig, share, table

log = logging.getLogger(__name__)

LINK = 12_500_000_000          # 100 Gbit/s in bytes/s
LOAD = 0.9
MTU = 1514
COUNTS = (10, 100, 1000, 10_000, 100_000)


def cpu_facts() -> dict:
    out = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    out["model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        out["lscpu_caches"] = [ln.strip() for ln in subprocess.run(
            ["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines()
            if "cache" in ln.lower()]
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        out["gcc"] = subprocess.run(["gcc", "--version"], capture_output=True, text=True,
                                    timeout=10).stdout.splitlines()[0]
    except (OSError, subprocess.TimeoutExpired, IndexError):
        pass
    return out


MIX = (1, 2, 4, 8)             # parts of the rate in the mixed scenario, round-robin


PER_GROUP = 100                # classes per client group in the grouped scenario
RULES = 10


def make_sim(n: int, staggered: bool, mixed: bool = False, grouped: bool = False) -> Sim:
    s = Sim(LINK)
    parts = [MIX[i % len(MIX)] if mixed else 1 for i in range(n)]
    unit = int(LINK * LOAD) // sum(parts)
    period = MTU * NSEC // (unit * min(parts))      # the slowest class's packet time
    groups = []
    if grouped:
        ngroups = max(1, n // PER_GROUP)
        cap = int(LINK * LOAD) // ngroups
        rules = [s.add_group(cap * ngroups // min(RULES, ngroups) + 1)
                 for _ in range(min(RULES, ngroups))]
        groups = [s.add_group(cap, rules[i % len(rules)]) for i in range(ngroups)]
        unit *= 2                                   # every client wants twice its cap
    for i in range(n):
        c = s.add_class(unit * parts[i])
        if groups:
            s.set_class_group(c, groups[i * len(groups) // n])
        s.greedy(c, MTU, now=(i * period // n) if staggered else 0)
    s.run(until=3 * period, log=False)          # warm up: every class has sent
    s.groups = groups
    return s


def scenario(name: str, staggered: bool, reps: int, packets: int, counts=COUNTS,
             mixed: bool = False, grouped: bool = False) -> dict:
    sims = {n: make_sim(n, staggered, mixed, grouped) for n in counts}
    link_tx = MTU * NSEC // LINK
    samples = {n: [] for n in counts}
    sent = {n: 0 for n in counts}
    for _ in range(reps):
        for n, s in sims.items():
            t0 = time.thread_time_ns()
            k = s.run(until=s.now + packets * link_tx, log=False)
            dt = time.thread_time_ns() - t0
            samples[n].append(dt / k)
            sent[n] += k
    out = {"start": "staggered" if staggered else "aligned", "rates": "mixed" if mixed else "equal",
           "classes": {}}
    if grouped:
        out["groups"] = {str(n): len(s.groups) for n, s in sims.items()}
    for n, s in sims.items():
        x = s.xstats()
        if grouped:
            held = sum(s.group_stats(g)["held"] for g in s.groups)
            out.setdefault("holds_per_packet", {})[str(n)] = round(held / max(1, x.paced_pkts), 3)
        out["classes"][str(n)] = {
            "ns_per_packet": percentiles(samples[n], (10, 50, 90)),
            "ns_per_packet_samples": [round(v, 2) for v in samples[n]],
            "packets_per_sample": packets,
            "packets_total": sent[n],
            "clamps": x.clamps,
            "paced_packets": x.paced_pkts,
        }
        s.close()
    med = {n: out["classes"][str(n)]["ns_per_packet"]["p50"] for n in counts}
    low = {n: out["classes"][str(n)]["ns_per_packet"]["min"] for n in counts}
    for n in counts:
        if n != 10:
            out[f"ratio_{n}_to_10"] = {"median": med[n] / med[10], "min": low[n] / low[10]}
    log.info("%s: %s ns/packet (median), 100000/10 = %.2f", name,
             {n: round(v, 1) for n, v in med.items()}, out["ratio_100000_to_10"]["median"])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--packets", type=int, default=300_000)
    ap.add_argument("--counts", default=",".join(map(str, COUNTS)),
                    help="class counts, comma separated (10 and 100000 are always added)")
    ap.add_argument("--quick", action="store_true", help="5 repetitions of 100 000 packets")
    args = ap.parse_args(argv)
    if args.quick:
        args.reps, args.packets = min(args.reps, 5), min(args.packets, 100_000)
    counts = tuple(sorted({10, 100_000} | {int(x) for x in args.counts.split(",") if x}))
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    build()
    load_before = os.getloadavg()
    t0 = time.monotonic()
    figures = {
        "setup": {"link_bit_s": LINK * 8, "load": LOAD, "packet_bytes": MTU,
                  "class_rate_bit_s": {str(n): int(LINK * LOAD) // n * 8 for n in counts},
                  "counts": list(counts), "reps": args.reps,
                  "timer": "thread CPU time", "unit": "ns per packet (select + charge + requeue)"},
        "staggered": scenario("staggered", True, args.reps, args.packets, counts),
        "aligned": scenario("aligned", False, args.reps, args.packets, counts),
        "mixed": scenario("mixed", True, args.reps, args.packets, counts, mixed=True),
        "grouped": scenario("grouped", True, args.reps, args.packets, counts, grouped=True),
        "cpu": cpu_facts(),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "duration_s": round(time.monotonic() - t0, 1),
        "python": platform.python_version(),
    }
    goals = {"ratio_100000_to_10_max": 3.0,
             "met_staggered": figures["staggered"]["ratio_100000_to_10"]["median"] <= 3.0,
             "met_aligned": figures["aligned"]["ratio_100000_to_10"]["median"] <= 3.0,
             "met_mixed": figures["mixed"]["ratio_100000_to_10"]["median"] <= 3.0}
    g, st = figures["grouped"], figures["staggered"]
    g["ratio_grouped_to_flat"] = {n: round(g["classes"][n]["ns_per_packet"]["p50"]
                                           / st["classes"][n]["ns_per_packet"]["p50"], 3)
                                  for n in g["classes"]}
    # issue 15: 100 000 classes in 1 000 groups cost per packet <= 3x of 10 flat classes
    goals["grouped_100000_to_flat_10_max"] = 3.0
    goals["grouped_100000_to_flat_10"] = round(
        g["classes"]["100000"]["ns_per_packet"]["p50"] / st["classes"]["10"]["ns_per_packet"]["p50"], 3)
    goals["met_grouped"] = goals["grouped_100000_to_flat_10"] <= 3.0
    path = write("psp_sim", figures, goals)
    log.info("wrote %s", path)
    return 0


# ============================================================== report
# This benchmark's part of bench/REPORT.md (bench/report.py puts it in its chapter) and its goals.

def _sim_ratio(R, start):
    f = R.fig("psp_sim")
    return g(f, start, "ratio_100000_to_10", "median")


def report_section(R: ResultIndex) -> str:
    plt = pyplot()
    out = [R.provenance("psp_sim", "psp_sim") + "\n"]
    f = R.fig("psp_sim")
    if not g(f, "staggered"):
        return "\n".join(out)
    s = f.get("setup", {})
    out.append(f"The module's scheduling code in the userspace simulator (virtual clock; every class always "
               f"backlogged, rates adding up to {share(s.get('load'), 0)} of {num(s.get('link_bit_s', 0) / 1e9, 'Gbit/s')}); "
               f"thread CPU time per packet (select + charge + requeue), median of the repetitions. "
               f"`staggered`: classes start at spread-out times as real flows do; `aligned`: all fall due at "
               f"once every period (the worst case); both with equal rates (one rule). `mixed`: staggered, "
               f"four rates (1, 2, 4, 8 parts, as four rules would give). Classes of one rate are requeued in "
               f"the order they are served, and the trees' sorted runs (4 per tree, beside the rbtree/heap) "
               f"take those inserts in O(1); more distinct rates than runs fall back to O(log N).\n")
    counts = sorted(int(c) for c in f["staggered"]["classes"])
    scs = [sc for sc in ("staggered", "aligned", "mixed") if g(f, sc)]
    rows = []
    for c in counts:
        rows.append([f"{c:,}".replace(",", " "),
                     *(num(g(f, sc, "classes", str(c), "ns_per_packet", "p50"), "ns", 1) for sc in scs),
                     *((f"{g(f, sc, f'ratio_{c}_to_10', 'median'):.2f}x" if c != 10 and g(f, sc, f'ratio_{c}_to_10') else "1x")
                       for sc in scs)])
    out.append(table(["classes", *scs, *(f"{sc} vs 10" for sc in scs)], rows))
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for sc in scs:
        ys = [g(f, sc, "classes", str(c), "ns_per_packet", "p50") for c in counts]
        ax.plot(counts, ys, "o-", label=sc)
        for c in counts:
            smp = g(f, sc, "classes", str(c), "ns_per_packet_samples") or []
            ax.scatter([c] * len(smp), smp, s=6, alpha=0.3)
    base = g(f, "staggered", "classes", "10", "ns_per_packet", "p50")
    if base:
        ax.axhline(3 * base, color="g", ls="--", lw=0.8, label="3x of 10 classes (staggered)")
    ax.set_xscale("log")
    ax.set_xlabel("classes")
    ax.set_ylabel("ns per packet")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    out.append(savefig(fig, "psp_sim.png"))
    return "\n".join(out)


def report_goals() -> List[Goal]:
    return [
        Goal(10, 4, "psp sim: per-packet cost at 100 000 classes <= 3x of 10 (staggered starts)", "psp_sim",
             "psp_sim", lambda R: _sim_ratio(R, "staggered"), lambda v: v <= 3, lambda v: f"{v:.2f}x"),
        Goal(11, 4, "psp sim: per-packet cost at 100 000 classes <= 3x of 10 (aligned starts, worst case)",
             "psp_sim", "psp_sim", lambda R: _sim_ratio(R, "aligned"), lambda v: v <= 3,
             lambda v: f"{v:.2f}x"),
        Goal(12, 4, "psp sim: per-packet cost at 100 000 classes <= 3x of 10 (four rates, staggered)",
             "psp_sim", "psp_sim", lambda R: _sim_ratio(R, "mixed"), lambda v: v <= 3,
             lambda v: f"{v:.2f}x"),
    ]


if __name__ == "__main__":
    sys.exit(main())

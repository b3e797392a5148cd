"""Where the guest's CPU goes while a qdisc paces pktgen's packets (issue 14: psp's per-packet cost).

One VM boot in virtual time (one instruction per ns, so CPU time is instructions). For each
qdisc (psp, htb, tbf, fq) at ``--rate``: pktgen (queue_xmit, 1514-byte frames at 1.1x the rate)
through the qdisc for ``--seconds`` while ``perf record -a -e cpu-clock`` samples the one vCPU
(no capture running: the sampling is the measurement here). Figures per qdisc: packets sent,
the share of samples in the qdisc's own functions (its module's symbols, plus the kernel's
qdisc watchdog), in pktgen's busy wait (``spin``/``ktime_get`` in kpktgend: the idle time of this
set-up), and the top symbols; the qdisc's CPU per packet = its share x the sampled CPU time
(cpu-clock's event count) / packets sent.

Writes bench/results/vm_profile.json. Run: ``.venv/bin/python -m bench.vm_profile``.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import subprocess
import sys
import time

from bench.vm_gaps import make_setup, psp_xstats, sched_delta, sched_snapshot
from bench.vm_sharing import Bed, guest_result, guest_tools, vm_bench

log = logging.getLogger("bench.vm_profile")

QDISCS = ("psp", "htb", "tbf", "fq")
# a qdisc's own code: its module's functions (perf shows the kernel's and the modules' symbols)
OWN = {"psp": ("psp_",), "htb": ("htb_",), "tbf": ("tbf_",), "fq": ("fq_",)}
SHARED_QDISC = ("qdisc_watchdog", "qdisc_peek_dequeued", "__qdisc_run", "qdisc_restart",
                "dequeue_skb", "sch_direct_xmit", "qdisc_pkt_len_init", "__dev_xmit_skb")


_SYM_MARK = re.compile(r"\s\[[k.ugH]\]\s")


def parse_report(text: str, period_ns: int) -> tuple:
    """(sampled CPU ns, [(share, comm, dso, symbol)]) of ``perf report --stdio -n --sort
    comm,dso,sym`` over cpu-clock samples of a fixed ``period_ns``: shares are of the samples
    counted (each is period_ns of CPU)."""
    raw, total = [], 0
    for ln in text.splitlines():
        s = ln.strip()
        if not s or s.startswith("#") or not s.split()[0].endswith("%"):
            continue
        parts = s.split(None, 2)
        if len(parts) < 3 or not parts[1].isdigit():
            continue
        m = _SYM_MARK.search(parts[2])               # the symbol column starts with [k] or [.]
        if m is None:
            continue
        head, sym = parts[2][:m.start()], parts[2][m.end():].strip()
        words = head.split()
        n = int(parts[1])
        total += n
        raw.append((n, words[0] if words else "", " ".join(words[1:]), sym))
    rows = [(n / total, comm, dso, sym) for n, comm, dso, sym in raw] if total else []
    return total * period_ns, rows


def tx_packets(bed: Bed) -> int:
    return int(bed.s("cat", f"/sys/class/net/{bed.sender_dev}/statistics/tx_packets").stdout)


def profile_run(bed: Bed, qdisc: str, rate_mbit: float, seconds: int, freq: int) -> dict:
    """perf samples the whole pktgen run (started before it, stopped after); CPU time per
    symbol = its share x the samples' total (cpu-clock's event count), per packet sent."""
    pacing = guest_tools()
    target = pacing.mbit(rate_mbit)
    bed.clear_qdisc()
    make_setup(pacing, qdisc, target)(bed)
    data = f"/tmp/fp-perf-{qdisc}.data"
    p0 = tx_packets(bed)
    sch0 = sched_snapshot()
    period_ns = int(1e9 / freq)       # a fixed period: each sample is period_ns of CPU time
    perf = subprocess.Popen(["perf", "record", "-a", "-e", "cpu-clock", "-c", str(period_ns), "-o", data,
                             "--", "sleep", str(seconds + 6)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(2)
    t0 = time.monotonic_ns()
    with pacing.Pktgen(bed, int(target * 1.1), seconds) as pg:
        pg.wait()
    t1 = time.monotonic_ns()
    _, err = perf.communicate(timeout=pacing.guest_timeout(120))
    sch1 = sched_snapshot()
    pkts = tx_packets(bed) - p0
    xs = psp_xstats(bed) if qdisc == "psp" else None
    bed.clear_qdisc()
    rep = subprocess.run(["perf", "report", "-i", data, "--stdio", "--no-children", "-n",
                          "--sort", "comm,dso,sym", "--percent-limit", "0.02"],
                         capture_output=True, text=True, timeout=pacing.guest_timeout(600))
    os.unlink(data)
    total, rows = parse_report(rep.stdout, period_ns)
    if not rows or not total:
        raise RuntimeError(f"perf gave no samples: {err[-500:]} {rep.stderr[-500:]} {rep.stdout[:500]}")
    own = sum(r[0] for r in rows if r[3].startswith(OWN[qdisc]))
    shared = sum(r[0] for r in rows if r[3] in SHARED_QDISC)
    spin = sum(r[0] for r in rows if r[1].startswith("kpktgend") and
               ("spin" in r[3] or "ktime_get" in r[3] or "read_tsc" in r[3]))
    idle = sum(r[0] for r in rows if r[1] == "swapper")
    per = lambda x: round(x * total / max(1, pkts), 1)
    out = {"qdisc": qdisc, "rate_mbit": rate_mbit, "seconds": seconds, "packets": pkts,
           "pktgen_ns": t1 - t0, "sampled_ns": total, "perf_freq": freq,
           "own_share": round(own, 5), "shared_qdisc_share": round(shared, 5),
           "pktgen_spin_share": round(spin, 5), "idle_share": round(idle, 5),
           "own_ns_per_pkt": per(own), "qdisc_ns_per_pkt": per(own + shared),
           "busy_ns_per_pkt": per(1 - idle - spin),
           "sched": sched_delta(sch0, sch1),
           "report_head": rep.stdout.splitlines()[:25],
           "top": [{"share": round(r[0], 5), "comm": r[1], "dso": r[2], "sym": r[3]} for r in rows[:40]],
           "own_syms": [{"share": round(r[0], 5), "sym": r[3]} for r in rows if r[3].startswith(OWN[qdisc])][:15]}
    if xs is not None:
        out["psp"] = {k: xs[k] for k in ("paced_pkts", "late_ns_total", "late_ns_max", "clamps",
                                         "longest_run", "timer_fires", "timer_late_ns_max") if k in xs}
    return out


def run_all(qdiscs, rate, seconds, freq) -> list:
    from flowpacer.testbed import Testbed
    out = []
    with Testbed(tag="vprof") as tb:
        bed = Bed(tb)
        bed.set_gso(True)
        for q in qdiscs:
            try:
                r = profile_run(bed, q, rate, seconds, freq)
                log.info("%-4s %g Mbit: %d pkts, own %.1f %% (%.0f ns/pkt), +shared %.0f ns/pkt, "
                         "busy %.0f ns/pkt, spin %.1f %%", q, rate, r["packets"], 100 * r["own_share"],
                         r["own_ns_per_pkt"], r["qdisc_ns_per_pkt"], r["busy_ns_per_pkt"],
                         100 * r["pktgen_spin_share"])
            except Exception as e:
                r = {"qdisc": q, "rate_mbit": rate, "error": f"{type(e).__name__}: {e}"}
                log.info("%s: %s", q, r["error"])
                bed.clear_qdisc()
            out.append(r)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--qdiscs", default=",".join(QDISCS))
    ap.add_argument("--rate", type=float, default=1000.0, help="Mbit/s")
    ap.add_argument("--seconds", type=int, default=2)
    ap.add_argument("--freq", type=int, default=4000, help="perf samples per second")
    ap.add_argument("--name", default="vm_profile")
    ap.add_argument("--guest", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    qdiscs = args.qdiscs.split(",")
    if args.guest:
        return guest_result(args.out, runs=run_all(qdiscs, args.rate, args.seconds, args.freq))
    if os.geteuid() != 0:
        print("vm_profile: needs root", file=sys.stderr)
        return 2
    from .common import write
    t0 = time.monotonic()
    fig = {"setup": {"qdiscs": qdiscs, "rate_mbit": args.rate, "seconds": args.seconds,
                     "perf_freq": args.freq, "clock": "virtual", "source": "pktgen queue_xmit 1.1x",
                     "description": __doc__.split("\n\n")[1].replace("\n", " ")}}
    rc = vm_bench(fig, "bench.vm_profile", ["--qdiscs", args.qdiscs, "--rate", str(args.rate),
                                            "--seconds", str(args.seconds), "--freq", str(args.freq)],
                  len(qdiscs) * 400 + 300)
    fig["duration_s"] = round(time.monotonic() - t0, 1)
    path = write(args.name, fig, {})
    print(f"wrote {path}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())

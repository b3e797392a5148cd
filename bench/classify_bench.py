"""Classification cost: one flow's throughput with 1 ... 10 000 u32 filters installed (issues 2, 6).

Two layouts on the same htb root (``f1f0:``, link class ``:1``, default class ``:2``, one class per
filter, every class far above what the veth carries, so only classification can slow the flow):

* ``hashed``: flowpacer's own (``flowpacer.kernel.backend``: two levels of 256-bucket u32 hash tables,
  installed by ``TcBackend`` exactly as the daemon does);
* ``linear``: plain u32 filters (src, dst and the ports word: three exact keys each) in one
  bucket of the root table at one prio, the target installed last. A u32 bucket holds at most
  4095 nodes, so past 4094 filters the bucket's last node links on to the next one-bucket table
  (``match u32 0 0 link N:``): still one linear walk at one prio, as one long bucket would be.

The other flows are what a server sees: same local address and port as the target (5201), remote
ports 20000, 20001, ... The target is iperf3 -R's data connection (fixed client port 45678), so the
server's egress through the veth is classified by the last-installed filter. ``none`` (no qdisc)
is measured in the same rounds as the baseline. Rounds alternate layouts and filter counts so that
the machine's noise hits all of them alike; the figure of a point is the median of its rounds, the
raw samples are kept. The ratio to the 1-filter case is taken within each round (the same layout's
1-filter run of that round) and its median over the rounds reported: one lucky or unlucky baseline
run does not move every ratio. The target class's byte counter proves that the filter matched.

Goal (issue 2): with 10 000 flows installed, the hashed layout keeps >= 90 % of the 1-flow case.

Writes bench/results/classify.json. Run: ``.venv/bin/python -m bench.classify_bench [--quick]``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from typing import List

from flowpacer.kernel.backend import tc as tcb
from flowpacer.kernel.backend.htb import HtbCodec, burst_for, quantum_for
from flowpacer.model import FlowKey, Op, OpKind, Shape
from harness.testbed import Testbed, in_netns

from .common import percentiles, write
from .reportkit import COLORS, Goal, ResultIndex, g, num, pyplot, savefig, share, table

LINK = 12_500_000_000            # 100 Gbit/s in bytes/s: far above what a veth carries
SERVER_PORT = 5201
TARGET_PORT = 45678
OTHER_BASE = 20000
COUNTS = (1, 10, 100, 1000, 10_000)
PER_TABLE = 4094                 # leaves per one-bucket table in the linear layout (+1 link node)


def other_keys(tb, n):
    """n flows of the same server port to other client ports (never the target's)."""
    return [FlowKey(tb.server_v4, SERVER_PORT, tb.client_v4, OTHER_BASE + i) for i in range(n)]


def iperf_once(tb, seconds: float) -> float:
    r = tb.run(tb.client_ns, ["iperf3", "-c", str(tb.server_v4), "-R", "-t", str(seconds),
                              "--cport", str(TARGET_PORT), "-J"], timeout=seconds + 40)
    return json.loads(r.stdout)["end"]["sum_received"]["bits_per_second"]


# ------------------------------------------------------------------------ layouts

class Hashed:
    name = "hashed"

    def __init__(self, tb):
        self.tb = tb
        self.b = None
        self.target = FlowKey(tb.server_v4, SERVER_PORT, tb.client_v4, TARGET_PORT)

    def install(self, n: int) -> float:
        s = Shape("b", LINK, LINK)
        t0 = time.perf_counter()
        with in_netns(self.tb.server_ns):
            self.b = tcb.TcBackend(HtbCodec(), self.tb.server_if, LINK)
            self.b.setup()
            ops = [Op(OpKind.ADD, k, s) for k in other_keys(self.tb, n - 1)]
            ops.append(Op(OpKind.ADD, self.target, s))        # the target last
            r = self.b.apply(ops)
        if r.errors or r.added != n:
            raise RuntimeError(f"hashed install of {n}: {r.added} added, errors {r.errors[:3]}")
        return time.perf_counter() - t0

    def target_bytes(self) -> int:
        with in_netns(self.tb.server_ns):
            return self.b.stats()[self.target].bytes

    def remove(self) -> None:
        with in_netns(self.tb.server_ns):
            self.b.teardown()
            self.b.close()
        self.b = None


class Linear:
    name = "linear"
    TARGET_MINOR = 0xF

    def __init__(self, tb):
        self.tb = tb

    @staticmethod
    def _hx(addr) -> str:
        return f"0x{int(addr):08x}"

    def lines(self, n: int):
        dev = self.tb.server_if
        src, dst = self._hx(self.tb.server_v4), self._hx(self.tb.client_v4)

        def cls(minor, rate, ceil, prio=0):
            return (f"class add dev {dev} parent f1f0:1 classid f1f0:{minor:x} htb rate {rate * 8}bit "
                    f"ceil {ceil * 8}bit burst {burst_for(rate)} cburst {burst_for(ceil)} "
                    f"quantum {quantum_for(rate)} prio {prio}")

        out = [f"qdisc add dev {dev} root handle f1f0: htb default 2",
               f"class add dev {dev} parent f1f0: classid f1f0:1 htb rate {LINK * 8}bit "
               f"ceil {LINK * 8}bit burst {burst_for(LINK)} cburst {burst_for(LINK)} "
               f"quantum {quantum_for(LINK)}",
               cls(2, LINK // 100, LINK, 1)]
        ports = [OTHER_BASE + i for i in range(n - 1)] + [TARGET_PORT]      # the target last
        minors = [0x10 + i for i in range(n - 1)] + [self.TARGET_MINOR]
        for m in minors:
            out.append(cls(m, LINK, LINK))
        tables = (n + PER_TABLE - 1) // PER_TABLE
        htids = ["800"] + [f"{t:x}" for t in range(1, tables)]
        base = f"filter add dev {dev} parent f1f0: protocol ip prio 1"
        for h in htids[1:]:
            out.append(f"{base} handle {h}: u32 divisor 1")
        for i, (port, minor) in enumerate(zip(ports, minors)):
            h, node = htids[i // PER_TABLE], i % PER_TABLE + 1
            out.append(f"{base} handle {h}:0:{node:x} u32 ht {h}:0: match u32 {src} 0xffffffff at 12 "
                       f"match u32 {dst} 0xffffffff at 16 "
                       f"match u32 0x{(SERVER_PORT << 16) | port:08x} 0xffffffff at 20 "
                       f"flowid f1f0:{minor:x}")
        for a, b in zip(htids, htids[1:]):          # each full table's last node: on to the next
            out.append(f"{base} handle {a}:0:fff u32 ht {a}:0: match u32 0 0 link {b}:")
        return out

    def install(self, n: int) -> float:
        fd, path = tempfile.mkstemp(prefix="fp-linear-", suffix=".tc")
        try:
            with os.fdopen(fd, "w") as f:
                f.write("\n".join(self.lines(n)) + "\n")
            t0 = time.perf_counter()
            self.tb.run(self.tb.server_ns, ["tc", "-batch", path], timeout=300)
            dt = time.perf_counter() - t0
        finally:
            os.unlink(path)
        got = self.tb.run(self.tb.server_ns, ["tc", "filter", "show", "dev", self.tb.server_if,
                                              "parent", "f1f0:"], timeout=120).stdout
        leaves = got.count("flowid f1f0:")
        if leaves != n:
            raise RuntimeError(f"linear install of {n}: the kernel shows {leaves} leaves")
        return dt

    def target_bytes(self) -> int:
        out = self.tb.run(self.tb.server_ns, ["tc", "-s", "class", "show", "dev", self.tb.server_if,
                                              "classid", f"f1f0:{self.TARGET_MINOR:x}"]).stdout
        m = re.search(r"Sent (\d+) bytes", out)
        return int(m.group(1)) if m else 0

    def remove(self) -> None:
        self.tb.run(self.tb.server_ns, ["tc", "qdisc", "del", "dev", self.tb.server_if, "root"],
                    check=False, timeout=120)


class NoQdisc:
    name = "none"

    def __init__(self, tb):
        self.tb = tb

    def install(self, n: int) -> float:
        return 0.0

    def target_bytes(self) -> int:
        return 0

    def remove(self) -> None:
        pass


# ------------------------------------------------------------------------ the benchmark

def run(counts, reps: int, seconds: float, log=print) -> dict:
    samples = {"none": {"0": []}, "hashed": {str(n): [] for n in counts},
               "linear": {str(n): [] for n in counts}}
    installs = {"hashed": {str(n): [] for n in counts}, "linear": {str(n): [] for n in counts}}
    matched = {"hashed": {str(n): [] for n in counts}, "linear": {str(n): [] for n in counts}}
    t_start = time.monotonic()
    with Testbed(tag="bcls") as tb:
        tb.popen(tb.server_ns, ["iperf3", "-s"])
        tb.wait_listening(SERVER_PORT)
        layouts = [Hashed(tb), Linear(tb)]
        for rep in range(reps):
            plan = [(NoQdisc(tb), 0)]
            for n in counts:
                order = layouts if (rep + counts.index(n)) % 2 == 0 else layouts[::-1]
                plan += [(lay, n) for lay in order]
            for lay, n in plan:
                dt = lay.install(n)
                try:
                    bps = iperf_once(tb, seconds)
                    got = lay.target_bytes()
                finally:
                    lay.remove()
                key = str(n)
                samples[lay.name][key].append(bps)
                if lay.name != "none":
                    installs[lay.name][key].append(dt)
                    # the target class carried the flow: bytes >= 90 % of what iperf3 received
                    matched[lay.name][key].append(got >= 0.9 * bps * seconds / 8)
                log(f"round {rep + 1}/{reps} {lay.name:6} {n:6d} filters: {bps / 1e9:6.2f} Gbit/s"
                    f" (install {dt:.2f} s)")
    med = {lay: {k: statistics.median(v) for k, v in d.items() if v} for lay, d in samples.items()}
    out = {"setup": {"link_class_bit_s": LINK * 8, "seconds_per_run": seconds, "rounds": reps,
                     "counts": list(counts), "gso": "on (veth default)",
                     "flow": "iperf3 -R TCP, server -> client through the server's egress filters",
                     "unit": "bit/s (iperf3 receiver goodput)"},
           "throughput_bit_s": {lay: {k: {"median": med[lay][k], "samples": v,
                                          **{p: x for p, x in percentiles(v).items() if p in ("min", "max")}}
                                      for k, v in d.items() if v}
                                for lay, d in samples.items()},
           "install_s": {lay: {k: percentiles(v) for k, v in d.items() if v} for lay, d in installs.items()},
           "target_filter_matched": {lay: {k: all(v) for k, v in d.items() if v} for lay, d in matched.items()},
           "duration_s": round(time.monotonic() - t_start, 1)}
    # each round's throughput over the same round's baseline (the layout with counts[0]
    # filters), then the median over the rounds: paired within a round, so a slow drift of the
    # shared machine (or one lucky baseline run) does not move the ratio
    ratios, per_round = {}, {}
    for lay in ("hashed", "linear"):
        base = samples[lay].get(str(counts[0])) or []
        per_round[lay] = {k: [x / b for x, b in zip(v, base)] for k, v in samples[lay].items()
                          if v and base}
        ratios[lay] = {k: statistics.median(v) for k, v in per_round[lay].items() if v}
    out["ratio_to_1_filter"] = ratios
    out["ratio_to_1_filter_per_round"] = per_round
    out["ratio_method"] = ("median over the rounds of (throughput / the same round's throughput "
                           f"with {counts[0]} filter(s), same layout)")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 round of 2 s, 1/100/10000 filters")
    ap.add_argument("--counts", default=None, help="comma-separated filter counts (first: the baseline)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--seconds", type=float, default=None)
    args = ap.parse_args(argv)
    counts = tuple(int(x) for x in args.counts.split(",")) if args.counts else \
        ((1, 100, 10_000) if args.quick else COUNTS)
    reps = args.rounds or (1 if args.quick else 5)
    seconds = args.seconds or (2.0 if args.quick else 3.0)
    if os.geteuid() != 0:
        print("classify_bench: needs root (network namespaces, tc)", file=sys.stderr)
        return 2
    fig = run(counts, reps, seconds, log=lambda m: print(m, flush=True))
    goals = {}
    if "10000" in fig["ratio_to_1_filter"]["hashed"] and counts[0] == 1:
        goals["hashed_10k_throughput>=90%_of_1"] = fig["ratio_to_1_filter"]["hashed"]["10000"] >= 0.9
    path = write("classify", fig, goals)
    print(json.dumps({"ratio_to_1_filter": fig["ratio_to_1_filter"], "goals": goals}, indent=2))
    print(f"wrote {path}", file=sys.stderr)
    return 0


# ============================================================== report
# This benchmark's part of bench/REPORT.md (bench/report.py puts it in its chapter) and its goals.

def report_section(R: ResultIndex) -> str:
    plt = pyplot()
    out = [R.provenance("classify", "classify") + "\n"]
    f = R.fig("classify")
    tp = g(f, "throughput_bit_s")
    if not tp:
        return "\n".join(out)
    s = f.get("setup", {})
    out.append(f"iperf3 -R, fixed client port, {s.get('seconds_per_run')} s per run, {s.get('rounds')} rounds "
               f"alternating layouts and counts, GSO on; median of the rounds (the ratio: median of each round's ratio "
               f"to that round's 1-filter run). `hashed` is flowpacer's layout "
               f"(two levels of 256-bucket u32 tables), `linear` plain u32 filters at one prio in one bucket "
               f"(chained on past 4 094 per table), the target installed last. `none`: no qdisc at all.\n")
    counts = [str(c) for c in s.get("counts", [])]
    rows = []
    base_none = g(tp, "none", "0", "median")
    for c in counts:
        h = g(tp, "hashed", c, "median")
        li = g(tp, "linear", c, "median")
        rows.append([c, num(h and h / 1e9, "Gbit/s", 2), share(g(f, "ratio_to_1_filter", "hashed", c)),
                     num(li and li / 1e9, "Gbit/s", 2), share(g(f, "ratio_to_1_filter", "linear", c)),
                     num(g(f, "install_s", "linear", c, "p50"), "s", 2)])
    out.append(table(["filters", "hashed", "of 1 filter", "linear", "of 1 filter", "linear install"], rows))
    if base_none:
        out.append(f"No qdisc: {num(base_none / 1e9, 'Gbit/s', 2)} (median). Target filter matched in every run: "
                   f"{all(all(v.values()) for v in (g(f, 'target_filter_matched') or {}).values())}.\n")
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    xs = [int(c) for c in counts]
    for lay in ("hashed", "linear"):
        ax.plot(xs, [g(tp, lay, c, "median", default=float("nan")) / 1e9 for c in counts], "o-", label=lay,
                color=COLORS[lay])
        for c in counts:
            ys = g(tp, lay, c, "samples") or []
            ax.scatter([int(c)] * len(ys), [y / 1e9 for y in ys], s=8, color=COLORS[lay], alpha=0.4)
    if base_none:
        ax.axhline(base_none / 1e9, color="k", ls=":", lw=0.8, label="no qdisc")
    h1 = g(tp, "hashed", counts[0], "median") if counts else None
    if h1:
        ax.axhline(0.9 * h1 / 1e9, color="g", ls="--", lw=0.8, label="90 % of hashed, 1 filter")
    ax.set_xscale("log")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("filters installed")
    ax.set_ylabel("Gbit/s (dots: single runs)")
    ax.legend(fontsize=8)
    out.append(savefig(fig, "classification.png"))
    return "\n".join(out)


def report_goals() -> List[Goal]:
    return [
        Goal(3, 2, "with 10 000 flows installed, one flow's throughput >= 90 % of the 1-flow case (hashed)",
             "classify", "classify", lambda R: g(R.fig("classify"), "ratio_to_1_filter", "hashed", "10000"),
             lambda v: v >= 0.9, lambda v: share(v)),
    ]


if __name__ == "__main__":
    sys.exit(main())
